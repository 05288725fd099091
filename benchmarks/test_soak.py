"""Soak: 100,000 tasks through one pool; resident memory must stay bounded.

Run by hand (about a minute): ``python -m pytest benchmarks/test_soak.py -s -q``.
Per-task state must be released and every sample window is bounded, so after a
warm-up the process's RSS should stay flat however many tasks have run.
"""

from __future__ import annotations

import gc
import time

from benchmarks.conftest import report
from npu_sync import Task, WorkerPool
from npu_sync.config import HealthConfig, PoolConfig, worker_config
from npu_sync.worker_server import LocalWorker

TASKS = 100_000
STEP = 10_000


def rss_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def test_resident_memory_stays_flat_over_100k_tasks(benchmark):
    """RSS after each 10,000 tasks; growth after the first 20,000 must stay small."""
    workers = [LocalWorker(worker_id=f"s{i}", max_concurrent=64).start() for i in range(3)]
    try:
        config = PoolConfig(
            workers=tuple(worker_config(w.worker_id, w.url, max_concurrent=16) for w in workers),
            health=HealthConfig(interval=1.0, timeout=1.0),
        )
        samples: list[tuple[int, int, float]] = []
        with WorkerPool(config) as pool:
            started = time.monotonic()
            done = 0
            while done < TASKS:
                batch = (Task({"input_text": "soak"}) for _ in range(STEP))
                for _ in pool.map(batch):
                    done += 1
                gc.collect()
                samples.append((done, rss_kib(), time.monotonic() - started))
            stats = pool.stats()
        assert stats["tasks"]["succeeded"] == TASKS
        settled = samples[1][1]
        growth = samples[-1][1] - settled
        benchmark.extra_info.update(
            {"rss_kib": samples, "growth_after_20k_kib": growth, "tasks": TASKS}
        )
        report(
            f"RSS over {TASKS} tasks (growth after 20k: {growth} KiB)",
            [("tasks", "RSS MiB", "seconds")]
            + [(str(n), f"{kib / 1024:.1f}", f"{s:.1f}") for n, kib, s in samples],
        )
        assert growth < 8 * 1024, f"RSS grew {growth} KiB after warm-up"
        benchmark.pedantic(lambda: None, rounds=1)
    finally:
        for w in workers:
            w.stop()
