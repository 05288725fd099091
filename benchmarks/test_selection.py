"""Selection latency: one acquire + release of a worker lease, no I/O.

Each idle and all-busy case runs twice: comparing in-flight counts (least
connections, as before latency-aware choice) and comparing latency-weighted scores
(every answer observed as 20 ms, as the pool will once it feeds the selector).

Idle pools of 10, 100 and 1,000 workers, from 1 thread and from 16 at once; then the
states where a scan would cost the most: a tier of 10 or 64 workers that all have tasks
in flight (no idle worker ends the scan early: every worker is compared), a saturated
tier of 1,000 workers in front of a tier with room, a 1,000-worker tier with one free
slot, and the rate at which freed slots are handed to queued tasks when 32 threads
compete for that one slot.
"""

from __future__ import annotations

import statistics
import threading
import time

import pytest

from benchmarks.conftest import report
from npu_sync import WorkerPool
from npu_sync._admission import Lease
from npu_sync._life import record
from npu_sync._retry import Kind, Outcome
from npu_sync._worker import Worker
from npu_sync.config import HealthConfig, PoolConfig, worker_config
from npu_sync.testing import FakeNetwork

SUCCESS = Outcome(Kind.SUCCESS, {})
HEADER = ("workers", "threads", "choice", "p50 µs", "p99 µs")
RESULTS: list[tuple[str, ...]] = []
BUSY: list[tuple[str, ...]] = []
HANDOFF: list[tuple[str, ...]] = []


def _pool(n: int, capacity: int = 64, spill: int = 0, choice: str = "count") -> WorkerPool:
    """``n`` workers at priority 1, then ``spill`` more at priority 2; ``choice``
    ``"latency"`` turns latency-aware selection on."""
    workers = tuple(
        worker_config(
            f"w{i}",
            f"http://127.0.0.{1 + i // 60000}:{1024 + i % 60000}",
            max_concurrent=capacity,
            priority=1 if i < n else 2,
        )
        for i in range(n + spill)
    )
    config = PoolConfig(workers=workers, health=HealthConfig(enabled=False))
    pool = WorkerPool(config, transport_factory=FakeNetwork().factory)
    if choice == "latency":
        dispatcher = pool._state.dispatcher
        selector = dispatcher.selector
        with dispatcher.lock:
            selector.configure(
                latency_aware=True, decay=10.0, slow_start=None, now=time.monotonic()
            )
        release = dispatcher.release_worker_locked

        def observed(worker: Worker, now: float) -> None:
            # What the pool's outcome recording will do, under the same lock, once it
            # feeds the selector: every answer observed as 20 ms.
            selector.observe(worker, 0.02, now)
            release(worker, now)

        dispatcher.release_worker_locked = observed  # type: ignore[method-assign]
    return pool


def _fill(pool: WorkerPool, leases: int) -> list[Lease]:
    """Take ``leases`` leases and keep them: the tier fills the way real traffic fills it."""
    held = []
    for _ in range(leases):
        lease = pool._state.dispatcher.acquire((), float("inf"))
        assert lease is not None
        held.append(lease)
    return held


def _give_back(pool: WorkerPool, held: list[Lease]) -> None:
    for lease in held:
        record(pool._state, lease, SUCCESS, 0.0, 0.0, retry=False)


def _measure(pool: WorkerPool, calls: int, out: list[float], spill: bool = False) -> None:
    dispatcher = pool._state.dispatcher
    state = pool._state
    clock = time.perf_counter
    for _ in range(calls):
        t0 = clock()
        lease = dispatcher.acquire((), float("inf"))
        out.append(clock() - t0)
        assert lease is not None
        assert not spill or lease.worker.priority == 2
        record(state, lease, SUCCESS, 0.0, time.monotonic(), retry=False)


def _run(pool: WorkerPool, threads: int, calls: int, spill: bool = False) -> tuple[float, float]:
    samples: list[float] = []
    runners = [
        threading.Thread(target=_measure, args=(pool, calls // threads, samples, spill))
        for _ in range(threads)
    ]
    for t in runners:
        t.start()
    for t in runners:
        t.join()
    cuts = statistics.quantiles(samples, n=100)
    return statistics.median(samples) * 1e6, cuts[98] * 1e6


@pytest.mark.parametrize("choice", ["count", "latency"])
@pytest.mark.parametrize("threads", [1, 16])
@pytest.mark.parametrize("workers", [10, 100, 1000])
def test_selection_latency(benchmark, workers, threads, choice):
    """p50/p99 of acquiring a lease (select + breaker admit + in-flight count)."""
    with _pool(workers, choice=choice) as pool:
        p50, p99 = _run(pool, threads, 20000)
        benchmark.extra_info.update({"p50_us": p50, "p99_us": p99})
        RESULTS.append((str(workers), str(threads), choice, f"{p50:.1f}", f"{p99:.1f}"))
        report("selection latency, idle pool", [HEADER, *RESULTS])
        benchmark.pedantic(_measure, args=(pool, 1, []), rounds=2000, warmup_rounds=100)


@pytest.mark.parametrize("choice", ["count", "latency"])
@pytest.mark.parametrize("workers", [10, 64])
def test_selection_with_every_worker_busy(benchmark, workers, choice):
    """Every worker of the tier has a task in flight: the scan compares all of them
    (64 is the most a tier scans before sampling two)."""
    with _pool(workers, choice=choice) as pool:
        held = _fill(pool, workers)
        p50, p99 = _run(pool, 1, 10000)
        benchmark.extra_info.update({"p50_us": p50, "p99_us": p99})
        BUSY.append((f"{workers}, all busy", "1", choice, f"{p50:.1f}", f"{p99:.1f}"))
        report("selection latency, busy pool", [HEADER, *BUSY])
        benchmark.pedantic(_measure, args=(pool, 1, []), rounds=500, warmup_rounds=10)
        _give_back(pool, held)


@pytest.mark.parametrize("threads", [1, 16])
def test_selection_past_a_saturated_tier(benchmark, threads):
    """Every one of 1,000 priority-1 workers at capacity: leases go to priority 2."""
    with _pool(1000, capacity=2, spill=10) as pool:
        held = _fill(pool, 2000)
        p50, p99 = _run(pool, threads, 10000, spill=True)
        benchmark.extra_info.update({"p50_us": p50, "p99_us": p99})
        BUSY.append(("1000 full + 10", str(threads), "count", f"{p50:.1f}", f"{p99:.1f}"))
        report("selection latency, busy pool", [HEADER, *BUSY])
        benchmark.pedantic(_measure, args=(pool, 1, [], True), rounds=500, warmup_rounds=10)
        _give_back(pool, held)


@pytest.mark.parametrize("workers", [10, 1000])
def test_selection_with_one_free_slot(benchmark, workers):
    """A tier with one free slot among all its workers' capacity, one thread."""
    with _pool(workers, capacity=2) as pool:
        held = _fill(pool, workers * 2 - 1)
        p50, p99 = _run(pool, 1, 10000)
        benchmark.extra_info.update({"p50_us": p50, "p99_us": p99})
        BUSY.append((f"{workers}, 1 slot free", "1", "count", f"{p50:.1f}", f"{p99:.1f}"))
        report("selection latency, busy pool", [HEADER, *BUSY])
        benchmark.pedantic(_measure, args=(pool, 1, []), rounds=500, warmup_rounds=10)
        _give_back(pool, held)


def _cycle(
    pool: WorkerPool, calls: int, records: list[float], queued: list[int], start: threading.Barrier
) -> None:
    dispatcher = pool._state.dispatcher
    state = pool._state
    clock = time.perf_counter
    start.wait()
    deadline = time.monotonic() + 3600  # finite: a queued task waits on a timed condition
    for _ in range(calls):
        lease = dispatcher.acquire((), deadline)
        assert lease is not None
        # Let go of the GIL while holding the lease, as a request would: the other
        # threads run, find no room and queue.
        time.sleep(0)
        queued.append(dispatcher.waiting)
        t0 = clock()
        record(state, lease, SUCCESS, 0.0, 0.0, retry=False)
        records.append(clock() - t0)


@pytest.mark.parametrize("workers", [10, 1000])
def test_hand_off_rate_with_32_threads_queued(benchmark, workers):
    """Leases per second when 32 threads compete for one free slot: each release hands
    it to the next queued thread; also the release's own p50/p99 (where the hand-off
    happens, under the lock)."""
    threads, calls = 32, 250
    with _pool(workers, capacity=2) as pool:
        held = _fill(pool, workers * 2 - 1)
        records: list[float] = []
        queued: list[int] = []
        start = threading.Barrier(threads + 1)
        runners = [
            threading.Thread(target=_cycle, args=(pool, calls, records, queued, start))
            for _ in range(threads)
        ]
        for t in runners:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in runners:
            t.join()
        rate = threads * calls / (time.perf_counter() - t0)
        cuts = statistics.quantiles(records, n=100)
        p50, p99 = statistics.median(records) * 1e6, cuts[98] * 1e6
        depth = statistics.mean(queued)
        benchmark.extra_info.update(
            {"leases_per_s": rate, "release_p50_us": p50, "release_p99_us": p99, "queued": depth}
        )
        HANDOFF.append(
            (str(workers), str(threads), f"{depth:.0f}", f"{rate:,.0f}", f"{p50:.1f}", f"{p99:.1f}")
        )
        report(
            "hand-off with 32 threads queued for 1 free slot",
            [
                ("workers", "threads", "queued", "leases/s", "release p50 µs", "release p99 µs"),
                *HANDOFF,
            ],
        )
        benchmark.pedantic(_measure, args=(pool, 1, []), rounds=100, warmup_rounds=10)
        _give_back(pool, held)


def test_plain_min_over_all_workers_baseline(benchmark):
    """What exact least-connections costs at 1,000 workers: a min() over every worker."""
    with _pool(1000) as pool:
        workers = pool._state.dispatcher.selector.workers
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
        RESULTS.append(("1000 (min)", "1", "count", f"{p50:.1f}", "-"))
        report("selection latency, idle pool", [HEADER, *RESULTS])
        benchmark.pedantic(plain_min, rounds=200)
