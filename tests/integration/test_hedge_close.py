"""close() with a hedge in flight to a real, frozen worker process: close() waits for
the hedge threads, the hedge is cancelled rather than left to its read timeout, and no
hedge thread is left."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from npu_sync import WorkerPool
from npu_sync.config import (
    BalancingConfig,
    HealthConfig,
    HedgeConfig,
    PoolConfig,
    TimeoutConfig,
    worker_config,
)
from npu_sync.events import AttemptFinished, AttemptHedged, Event

pytestmark = pytest.mark.integration


def hedge_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("npu-sync-hedge")]


def test_close_with_a_hedge_in_flight_joins_it_and_leaves_no_hedge_thread(start_worker):
    """The task's first attempt waits on a paused worker, its hedge on a frozen one;
    close() is called and the first worker answers: the hedge is cancelled, close()
    returns only once the hedge's thread is done, and no npu-sync-hedge thread is alive."""
    fast, frozen = start_worker(worker_id="fast"), start_worker(worker_id="frozen")
    fast.pause()
    frozen.pause()
    config = PoolConfig(
        # Tiers: the first attempt goes to "fast", the hedge to "frozen".
        workers=(
            worker_config("fast", fast.url, priority=1),
            worker_config("frozen", frozen.url, priority=2),
        ),
        health=HealthConfig(enabled=False),
        # A read timeout far beyond close()'s budget for its threads (5 s): a hedge
        # left to wait for the frozen worker would still be alive after close().
        timeouts=TimeoutConfig(read=120.0, task=240.0),
        balancing=BalancingConfig(hedge=HedgeConfig(enabled=True, delay=0.01)),
    )
    hedged = threading.Event()
    release = threading.Event()  # lets the cancelled hedge's thread finish
    hedge_done = threading.Event()
    finished: list[tuple[str, str, str]] = []

    def hook(event: Event) -> None:
        if isinstance(event, AttemptHedged):
            hedged.set()
        elif isinstance(event, AttemptFinished):
            finished.append((event.worker_id, event.outcome, threading.current_thread().name))
            if event.worker_id == "frozen":
                # The hedge's own thread, after its attempt was cancelled: still busy
                # when the task has returned.
                release.wait(60)
                hedge_done.set()

    pool = WorkerPool(config, hooks=[hook])
    answers: list[Any] = []
    done_when_closed: list[bool] = []

    def close() -> None:
        pool.close()
        done_when_closed.append(hedge_done.is_set())

    caller = threading.Thread(
        target=lambda: answers.append(pool.execute({"model_id": "default", "input_text": "x"}))
    )
    closer = threading.Thread(target=close)
    try:
        caller.start()
        assert hedged.wait(30), "no hedge was sent"
        closer.start()  # waits for the task, which waits for a worker
        fast.resume()
        caller.join(60)
        assert [a["worker_id"] for a in answers] == ["fast"]
        # A close() that does not wait for the hedge's thread returns meanwhile.
        closer.join(0.5)
        release.set()
        closer.join(60)
        assert not closer.is_alive(), "close() did not return"
        assert done_when_closed == [True]
        assert hedge_threads() == []
    finally:
        release.set()
        fast.resume()
        frozen.resume()
        pool.close()
        caller.join(60)
    assert [(wid, outcome) for wid, outcome, _ in sorted(finished)] == [
        ("fast", "success"),
        ("frozen", "abandoned"),
    ]
    assert next(name for wid, _, name in finished if wid == "frozen").startswith("npu-sync-hedge")
