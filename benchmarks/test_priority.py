"""Interactive tasks under a batch flood: priority classes and a reserve, against FIFO.

Three reference workers (``--slots 8``, 50 ms), ``max_concurrent`` 8 each: 24 slots,
about 480 tasks a second. Phases, run one after the other on the same workers:

* ``batch alone``: ``BATCH_CALLERS`` threads run batch tasks back to back for
  ``SECONDS``: the fleet's capacity;
* ``interactive alone``: one thread runs ``INTERACTIVE`` interactive tasks back to back:
  the unloaded latency;
* ``fifo``: both at once, every task of the default class (the queue is FIFO);
* ``classes``: both at once, batch tasks of class ``batch``, interactive ones of class
  ``interactive``, which reserves ``RESERVE`` of the capacity (one slot of 24).

Reported: the interactive tasks' p50 and p99 latency (the wait for a slot plus the
answer) against the unloaded ones, and batch throughput against the capacity left to
it (the fleet's capacity less the interactive tasks' rate in the same phase).

The targets (issue): interactive p99 within 2x the unloaded p99, batch throughput at
least 0.9 of the capacity left to it.

Run: ``python -m pytest benchmarks/test_priority.py -s -n 0 -p no:randomly`` (about a
minute).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.conftest import report
from npu_sync import Task, WorkerPool
from npu_sync.config import (
    ClassConfig,
    HealthConfig,
    PoolConfig,
    PoolSettings,
    PriorityConfig,
    RetryConfig,
    TimeoutConfig,
    worker_config,
)
from npu_sync.worker_server import LocalWorker

BATCH_CALLERS = 64
INTERACTIVE = 150
SECONDS = 8.0
RESERVE = 0.04
PAYLOAD = {"model_id": "default", "input_text": "priority"}


@pytest.fixture(scope="module")
def workers() -> Iterator[list[LocalWorker]]:
    started = [LocalWorker(worker_id=f"w{i}", latency_ms=50, slots=8).start() for i in range(3)]
    try:
        yield started
    finally:
        for worker in started:
            worker.stop()


def _pool(workers: list[LocalWorker], classes: bool) -> WorkerPool:
    priority = (
        PriorityConfig(
            classes=(
                ClassConfig("interactive", RESERVE),
                ClassConfig("standard"),
                ClassConfig("batch"),
            ),
            default="standard",
            aging=30.0,
        )
        if classes
        else PriorityConfig()
    )
    return WorkerPool(
        PoolConfig(
            workers=tuple(worker_config(w.worker_id, w.url, max_concurrent=8) for w in workers),
            health=HealthConfig(enabled=False),
            retry=RetryConfig(max_retries=1),
            timeouts=TimeoutConfig(connect=2.0, read=30.0, task=60.0),
            pool=PoolSettings(threads=8, max_queue_wait=60.0),
            priority=priority,
        )
    )


def _phase(pool: WorkerPool, *, batch: bool, interactive: bool, classes: bool) -> dict[str, Any]:
    stop = threading.Event()
    batch_done = [0]
    lock = threading.Lock()
    latencies: list[float] = []
    batch_class = "batch" if classes else None
    top_class = "interactive" if classes else None

    def flood() -> None:
        while not stop.is_set():
            pool.execute(Task(PAYLOAD, priority=batch_class))
            with lock:
                batch_done[0] += 1

    threads = [threading.Thread(target=flood) for _ in range(BATCH_CALLERS)] if batch else []
    for _ in range(30):  # latency estimates and connections warm
        pool.execute(PAYLOAD)
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    if batch:
        stop.wait(1.0)  # the flood saturates the fleet before interactive tasks come
    started = time.perf_counter()
    if interactive:
        for _ in range(INTERACTIVE):
            a = time.perf_counter()
            pool.execute(Task(PAYLOAD, priority=top_class))
            latencies.append(time.perf_counter() - a)
    else:
        stop.wait(SECONDS)
    span = time.perf_counter() - started
    with lock:
        counted = batch_done[0]
    took = time.perf_counter() - t0
    stop.set()
    for t in threads:
        t.join()
    latencies.sort()
    return {
        "p50": latencies[len(latencies) // 2] if latencies else None,
        "p99": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
        if latencies
        else None,
        "interactive_rate": len(latencies) / span if latencies else 0.0,
        "batch_rate": counted / took,
    }


def test_interactive_latency_under_a_batch_flood(workers: list[LocalWorker]) -> None:
    """Interactive p99 against unloaded; batch throughput against the capacity left to it."""
    with _pool(workers, False) as pool:
        capacity = _phase(pool, batch=True, interactive=False, classes=False)
        alone = _phase(pool, batch=False, interactive=True, classes=False)
        fifo = _phase(pool, batch=True, interactive=True, classes=False)
    with _pool(workers, True) as pool:
        ranked = _phase(pool, batch=True, interactive=True, classes=True)
        alone_again = _phase(pool, batch=False, interactive=True, classes=True)
    unloaded = min(alone["p99"], alone_again["p99"])
    rows: list[tuple[str, ...]] = [
        ("phase", "int. p50 ms", "int. p99 ms", "p99 / unloaded", "batch/s", "batch / left")
    ]
    for name, run in (
        ("batch alone", capacity),
        ("interactive alone", alone),
        ("interactive alone (classes)", alone_again),
        ("fifo", fifo),
        ("classes", ranked),
    ):
        left = capacity["batch_rate"] - run["interactive_rate"]
        rows.append(
            (
                name,
                "-" if run["p50"] is None else f"{run['p50'] * 1000:.1f}",
                "-" if run["p99"] is None else f"{run['p99'] * 1000:.1f}",
                "-" if run["p99"] is None else f"{run['p99'] / unloaded:.2f}",
                f"{run['batch_rate']:.0f}",
                f"{run['batch_rate'] / left:.3f}"
                if run is not alone and run is not alone_again
                else "-",
            )
        )
    report("Interactive tasks under a batch flood (3 workers x 8 slots, 50 ms)", rows)
    assert ranked["p99"] is not None and fifo["p99"] is not None
