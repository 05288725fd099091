"""What per-(worker, model) latency costs a task: ``models.model_latency`` on against off.

Two pools in one interpreter, over the fake network (no I/O, so the pool's own cost is
all there is), 4 workers, tasks naming one of 4 models, run interleaved batch by batch::

    python -m benchmarks.model_latency_cost

Prints the best batch of each, in microseconds per ``execute()``, and the ratio. Not
run by pytest: it measures, it asserts nothing.
"""

from __future__ import annotations

import time

from npu_sync import WorkerPool
from npu_sync.config import HealthConfig, ModelsConfig, PoolConfig, worker_config
from npu_sync.testing import FakeNetwork

BATCHES, CALLS = 15, 4000


def _pool(on: bool) -> WorkerPool:
    workers = tuple(worker_config(f"w{i}", f"http://127.0.0.1:{2100 + i}") for i in range(4))
    config = PoolConfig(
        workers=workers,
        health=HealthConfig(enabled=False),
        models=ModelsConfig(model_latency=on),
    )
    return WorkerPool(config, transport_factory=FakeNetwork().factory)


def _batch(pool: WorkerPool) -> float:
    payloads = [{"model_id": f"m{i % 4}", "input_text": "x"} for i in range(CALLS)]
    t0 = time.perf_counter()
    for payload in payloads:
        pool.execute(payload)
    return (time.perf_counter() - t0) / CALLS


def main() -> None:
    pools = {"off": _pool(False), "on": _pool(True)}
    best = {name: float("inf") for name in pools}
    try:
        for _ in range(BATCHES):
            for name, pool in pools.items():
                best[name] = min(best[name], _batch(pool))
    finally:
        for pool in pools.values():
            pool.close()
    for name in pools:
        print(f"model_latency {name:3}: {best[name] * 1e6:7.2f} µs/task")
    print(f"ratio on/off: {best['on'] / best['off']:.3f}")


if __name__ == "__main__":
    main()
