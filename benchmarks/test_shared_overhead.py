"""Per-task cost of Redis-shared state against local state, side by side.

Two pools on the same three reference workers, one with ``shared_state: redis`` (a
real redis-server on loopback), one without; calls interleaved one by one. Redis is
touched only on the failure path, so a healthy run should cost nothing extra.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest

from benchmarks.conftest import interleave, report, summarise
from npu_sync import WorkerPool
from npu_sync.config import HealthConfig, PoolConfig, SharedStateConfig, worker_config
from npu_sync.worker_server import LocalWorker

PAYLOAD = {"model_id": "default", "input_text": "benchmark"}


def test_task_latency_with_shared_state_vs_local(benchmark):
    """Median and p99 per task: shared Redis state against local state."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    from tests.integration.conftest import RedisServer

    with tempfile.TemporaryDirectory() as directory:
        server = RedisServer(directory).start()
        workers = [LocalWorker(worker_id=f"r{i}", max_concurrent=64).start() for i in range(3)]
        try:
            base = dict(
                workers=tuple(worker_config(w.worker_id, w.url) for w in workers),
                health=HealthConfig(enabled=False),
            )
            shared = SharedStateConfig(backend="redis", url=server.url)
            with (
                WorkerPool(PoolConfig(**base)) as local,
                WorkerPool(PoolConfig(**base, shared_state=shared)) as pooled,
            ):
                contenders = {
                    "local state": lambda: local.execute(PAYLOAD),
                    "shared (Redis)": lambda: pooled.execute(PAYLOAD),
                }
                interleave(contenders, 200)
                figures = summarise(interleave(contenders, 3000))
                assert pooled.stats()["shared_state"]["available"]
                benchmark.pedantic(lambda: pooled.execute(PAYLOAD), rounds=200)
            ratio = figures["shared (Redis)"]["median_us"] / figures["local state"]["median_us"]
            benchmark.extra_info.update({"figures": figures, "median_ratio": ratio})
            first = figures["local state"]["median_us"]
            report(
                "per-task latency, shared state vs local",
                [("pool", "median µs", "p99 µs", "median ratio")]
                + [
                    (
                        k,
                        f"{f['median_us']:.0f}",
                        f"{f['p99_us']:.0f}",
                        f"{f['median_us'] / first:.3f}",
                    )
                    for k, f in figures.items()
                ],
            )
        finally:
            for w in workers:
                w.stop()
            server.kill()
