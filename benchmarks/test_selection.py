"""Selection latency: one acquire + release of a worker lease, no I/O.

With 10, 100 and 1,000 workers, from 1 thread and from 16 threads at once.
"""

from __future__ import annotations

import statistics
import threading
import time

import pytest

from benchmarks.conftest import report
from npu_sync import WorkerPool
from npu_sync.config import HealthConfig, PoolConfig, worker_config
from npu_sync.retry import Kind, Outcome
from npu_sync.testing import FakeNetwork

SUCCESS = Outcome(Kind.SUCCESS, {})
RESULTS: list[tuple[str, ...]] = []


def _pool(n: int) -> WorkerPool:
    workers = tuple(
        worker_config(
            f"w{i}", f"http://127.0.0.{1 + i // 60000}:{1024 + i % 60000}", max_concurrent=64
        )
        for i in range(n)
    )
    config = PoolConfig(workers=workers, health=HealthConfig(enabled=False))
    return WorkerPool(config, transport_factory=FakeNetwork().factory)


def _measure(pool: WorkerPool, calls: int, out: list[float]) -> None:
    dispatcher = pool._dispatcher
    record = pool._record
    clock = time.perf_counter
    for _ in range(calls):
        t0 = clock()
        lease = dispatcher.acquire((), float("inf"))
        out.append(clock() - t0)
        assert lease is not None
        record(lease, SUCCESS, 0.0, 0.0, retry=False)


@pytest.mark.parametrize("threads", [1, 16])
@pytest.mark.parametrize("workers", [10, 100, 1000])
def test_selection_latency(benchmark, workers, threads):
    """p50/p99 of acquiring a lease (select + breaker admit + in-flight count)."""
    with _pool(workers) as pool:
        samples: list[float] = []
        calls = 20000 // threads
        runners = [
            threading.Thread(target=_measure, args=(pool, calls, samples)) for _ in range(threads)
        ]
        for t in runners:
            t.start()
        for t in runners:
            t.join()
        cuts = statistics.quantiles(samples, n=100)
        p50, p99 = statistics.median(samples) * 1e6, cuts[98] * 1e6
        benchmark.extra_info.update({"p50_us": p50, "p99_us": p99})
        RESULTS.append((str(workers), str(threads), f"{p50:.1f}", f"{p99:.1f}"))
        report(
            "selection latency",
            [("workers", "threads", "p50 µs", "p99 µs"), *RESULTS],
        )
        benchmark.pedantic(_measure, args=(pool, 1, []), rounds=2000, warmup_rounds=100)


def test_plain_min_over_all_workers_baseline(benchmark):
    """What exact least-connections costs at 1,000 workers: a min() over every worker."""
    with _pool(1000) as pool:
        workers = pool._dispatcher.selector.workers
        now = time.monotonic()

        def plain_min() -> object:
            return min((w for w in workers if w.eligible(now)), key=lambda w: w.in_flight)

        samples = []
        for _ in range(2000):
            t0 = time.perf_counter()
            plain_min()
            samples.append(time.perf_counter() - t0)
        p50 = statistics.median(samples) * 1e6
        benchmark.extra_info["p50_us"] = p50
        RESULTS.append(("1000 (min)", "1", f"{p50:.1f}", "-"))
        report("selection latency", [("workers", "threads", "p50 µs", "p99 µs"), *RESULTS])
        benchmark.pedantic(plain_min, rounds=200)
