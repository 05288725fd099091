"""HedgeTimer's threads: each starts with the initializer the pool gives it, and an idle
hedge thread holds nothing of the hedge it ran last."""

from __future__ import annotations

import gc
import threading
import time
import weakref

from npu_sync._hedge import HedgeTimer
from npu_sync.testing import FakeClock


def test_every_thread_the_timer_starts_runs_the_initializer_first():
    """The timer thread and a hedge thread have each run the initializer before the
    callback or hedge they run."""
    clock = FakeClock()
    initialized: set[str] = set()
    seen: dict[str, bool] = {}
    done = threading.Event()

    def initializer() -> None:
        initialized.add(threading.current_thread().name)

    def note() -> None:
        name = threading.current_thread().name
        seen[name] = name in initialized

    def hedge() -> None:
        note()
        done.set()

    timer = HedgeTimer(clock, threads=2, initializer=initializer)
    try:
        timer.schedule(clock.monotonic(), lambda: (note(), timer.submit(hedge)))
        assert done.wait(10)
    finally:
        timer.stop()
    assert seen == {"npu-sync-hedge-timer": True, "npu-sync-hedge-0": True}


def test_an_idle_hedge_thread_lets_its_last_hedge_go():
    """Once a hedge has run, the thread waiting for the next one keeps no reference to
    it (nor to its arguments: a task's payload)."""

    class Payload:
        pass

    payload = Payload()
    ref = weakref.ref(payload)
    done = threading.Event()
    timer = HedgeTimer(FakeClock(), threads=1)
    try:
        timer.submit(lambda _payload: done.set(), payload)
        del payload
        assert done.wait(10)
        give_up = time.monotonic() + 10
        while ref() is not None and time.monotonic() < give_up:
            gc.collect()
            threading.Event().wait(0.01)
        assert ref() is None
        assert [t.name for t in threading.enumerate() if t.name == "npu-sync-hedge-0"]
    finally:
        timer.stop()
