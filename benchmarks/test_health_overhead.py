"""Do health checks slow tasks down? Checks every 0.1 s against checks off, side by side.

Two pools over the same three reference workers, one probing every 0.1 s, one not;
their calls are interleaved one by one so noise hits both alike.
"""

from __future__ import annotations

import time

from benchmarks.conftest import interleave, report, summarise
from npu_sync import WorkerPool
from npu_sync.config import HealthConfig, PoolConfig, worker_config
from npu_sync.worker_server import LocalWorker

PAYLOAD = {"model_id": "default", "input_text": "benchmark"}
ROUNDS = 3000


def test_task_latency_with_health_checks_every_100ms(benchmark):
    """Median and p99 task latency, health every 0.1 s vs health off."""
    workers = [LocalWorker(worker_id=f"h{i}", max_concurrent=64).start() for i in range(3)]
    try:

        def config(health: HealthConfig) -> PoolConfig:
            return PoolConfig(
                workers=tuple(worker_config(w.worker_id, w.url) for w in workers), health=health
            )

        on = WorkerPool(config(HealthConfig(interval=0.1, timeout=1.0)))
        off = WorkerPool(config(HealthConfig(enabled=False)))
        with on, off:
            contenders = {
                "health off": lambda: off.execute(PAYLOAD),
                "health every 0.1 s": lambda: on.execute(PAYLOAD),
            }
            interleave(contenders, 200)  # warm up
            first_round = on.stats()["health"]["rounds"]
            started = time.monotonic()
            figures = summarise(interleave(contenders, ROUNDS))
            elapsed = time.monotonic() - started
            rounds = on.stats()["health"]["rounds"] - first_round
            base = figures["health off"]["median_us"]
            ratio = figures["health every 0.1 s"]["median_us"] / base
            benchmark.extra_info.update(
                {"figures": figures, "median_ratio": ratio, "health_rounds": rounds}
            )
            report(
                f"task latency, {rounds} health rounds during {elapsed:.1f}s",
                [("pool", "median µs", "p99 µs", "median ratio")]
                + [
                    (
                        k,
                        f"{f['median_us']:.0f}",
                        f"{f['p99_us']:.0f}",
                        f"{f['median_us'] / base:.3f}",
                    )
                    for k, f in figures.items()
                ],
            )
            benchmark.pedantic(lambda: on.execute(PAYLOAD), rounds=300, warmup_rounds=20)
    finally:
        for w in workers:
            w.stop()
