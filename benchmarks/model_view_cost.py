"""What the per-model rows cost ``stats()``: with them against without, side by side.

One pool per fleet shape over the fake network (no I/O), each worker listing its
models with inference counts; after two health rounds (so rates exist) ``stats()`` is
called in interleaved batches with the real per-model view and with one that returns
no rows, the best batch of each kept::

    python -m benchmarks.model_view_cost

The rows are built before ``stats()`` takes the pool's lock (which tasks take to be
admitted), so what they cost falls on the caller: the fleet monitor's thread once per
sample (5 s), a status-page request once per refresh (2 s). Prints microseconds per
``stats()`` call and the ratio. Not run by pytest: it measures, it asserts nothing.
"""

from __future__ import annotations

import time
from typing import Any

import npu_sync._pool as pool_module
from npu_sync import WorkerPool
from npu_sync.config import HealthConfig, PoolConfig, worker_config
from npu_sync.testing import FakeClock, FakeNetwork, FakeRequest, json_response
from npu_sync.transport import Response

BATCHES, CALLS = 15, 200
SHAPES = ((3, 2), (20, 5), (100, 20))  # workers, models each (out of 3x as many)


def _pool(workers: int, models: int, clock: FakeClock) -> WorkerPool:
    count = [0]

    def answer(req: FakeRequest) -> Response:
        if req.path == "/health":
            return json_response(200, {"status": "healthy"})
        first = int(req.worker_id[1:])
        count[0] += 7
        loaded = {
            f"m{(first + i) % (3 * models)}": {"device": "NPU", "inference_count": count[0]}
            for i in range(models)
        }
        return json_response(200, {"loaded_models": loaded})

    config = PoolConfig(
        workers=tuple(
            worker_config(f"w{i}", f"http://127.0.0.1:{2200 + i}") for i in range(workers)
        ),
        health=HealthConfig(enabled=False),
    )
    return WorkerPool(config, transport_factory=FakeNetwork(answer).factory, clock=clock)


def _batch(pool: WorkerPool) -> float:
    t0 = time.perf_counter()
    for _ in range(CALLS):
        pool.stats()
    return (time.perf_counter() - t0) / CALLS


def _none(*_args: Any, **_kwargs: Any) -> list[Any]:
    return []


def main() -> None:
    real = pool_module.model_rows
    for workers, models in SHAPES:
        clock = FakeClock()
        pool = _pool(workers, models, clock)
        try:
            pool.check_health()
            clock.advance(10)
            pool.check_health()
            rows = len(pool.stats()["models"]["per_model"])
            best = {"without": float("inf"), "with": float("inf")}
            for _ in range(BATCHES):
                for name, rows_fn in (("without", _none), ("with", real)):
                    pool_module.model_rows = rows_fn  # type: ignore[assignment]
                    best[name] = min(best[name], _batch(pool))
        finally:
            pool_module.model_rows = real
            pool.close()
        print(
            f"{workers:3} workers x {models:2} models ({rows:2} rows): "
            f"without {best['without'] * 1e6:7.1f} µs, with {best['with'] * 1e6:7.1f} µs, "
            f"ratio {best['with'] / best['without']:.2f}"
        )


if __name__ == "__main__":
    main()
