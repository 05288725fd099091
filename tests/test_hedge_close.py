"""HedgeTimer.stop(): nothing is scheduled, run or accepted afterwards, hedges in flight
are cancelled, and no hedge thread is left."""

from __future__ import annotations

import threading

import pytest

from npu_sync._hedge import HedgeTimer
from npu_sync.testing import FakeClock


def hedge_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("npu-sync-hedge")]


def test_stop_cancels_hedges_in_flight_and_joins_every_thread():
    """A hedge on the wire when stop() is called is cancelled, and once stop() returns
    neither the timer thread nor any hedge thread is alive."""
    clock = FakeClock()
    timer = HedgeTimer(clock, threads=4)
    started = [threading.Event() for _ in range(3)]
    cancelled = [threading.Event() for _ in range(3)]
    ended: list[int] = []

    def hedge(n: int) -> None:
        started[n].set()
        cancelled[n].wait()
        ended.append(n)

    timer.schedule(clock.monotonic() + 3600, lambda: None)  # starts the timer thread
    for n in range(3):
        timer.submit(hedge, n, cancel=cancelled[n].set)
    for event in started:
        assert event.wait(10)
    assert len(hedge_threads()) == 4  # the timer and three hedges

    assert timer.stop() is True
    assert sorted(ended) == [0, 1, 2]
    assert hedge_threads() == []


def test_idle_hedge_threads_end_on_stop():
    """Threads kept for the next hedge do not outlive stop()."""
    timer = HedgeTimer(FakeClock(), threads=2)
    done = threading.Event()
    timer.submit(done.set)
    assert done.wait(10)
    assert hedge_threads() == ["npu-sync-hedge-0"]
    timer.stop()
    assert hedge_threads() == []


def test_nothing_is_scheduled_run_or_accepted_once_stopped():
    """After stop(): a due callback is not run, a new one not scheduled (no thread
    started), and a hedge is refused."""
    clock = FakeClock()
    timer = HedgeTimer(clock)
    ran: list[str] = []
    timer.schedule(clock.monotonic() + 10, lambda: ran.append("before"))
    timer.stop()
    clock.advance(20)
    timer.schedule(clock.monotonic(), lambda: ran.append("after"))
    assert timer.run_due() == 0
    assert (ran, timer.pending()) == ([], 0)
    with pytest.raises(RuntimeError, match="stopped"):
        timer.submit(ran.append, "hedge")
    assert hedge_threads() == []


def test_a_callback_under_way_when_stop_begins_hands_over_a_hedge_that_is_cancelled():
    """A task's timer firing while close runs: the callback under way finishes, its
    hedge is accepted and cancelled at once, and stop() leaves no thread behind."""
    clock = FakeClock()
    timer = HedgeTimer(clock)
    entered, proceed = threading.Event(), threading.Event()
    cancelled = threading.Event()
    outcome: list[object] = []

    def hedge() -> None:
        outcome.append(cancelled.wait(30))

    def fire() -> None:  # what fire_hedge does: a lease, then the hedge handed over
        entered.set()
        proceed.wait(30)
        try:
            timer.submit(hedge, cancel=cancelled.set)
        except RuntimeError as exc:
            outcome.append(exc)

    timer.schedule(clock.monotonic(), fire)
    assert entered.wait(10)
    stopper = threading.Thread(target=timer.stop)
    stopper.start()
    proceed.set()
    stopper.join(30)
    assert not stopper.is_alive()
    assert outcome == [True]  # accepted, then ended by its cancel
    assert hedge_threads() == []


def test_stop_from_a_hedge_thread_does_not_wait_for_itself():
    """A hedge whose hook closes the pool stops the timer from its own thread; the
    call returns and the thread then ends."""
    timer = HedgeTimer(FakeClock())
    returned = threading.Event()
    threads: list[threading.Thread] = []

    def hedge() -> None:
        threads.append(threading.current_thread())
        timer.stop(timeout=30)
        returned.set()

    timer.submit(hedge)
    assert returned.wait(10)
    threads[0].join(10)
    assert hedge_threads() == []


def test_stop_soon_signals_without_waiting():
    """stop_soon() cancels what runs and refuses more; the threads end on their own."""
    timer = HedgeTimer(FakeClock())
    cancelled = threading.Event()
    started = threading.Event()

    def hedge() -> None:
        started.set()
        cancelled.wait(30)

    timer.submit(hedge, cancel=cancelled.set)
    assert started.wait(10)
    timer.stop_soon()
    assert cancelled.is_set()
    with pytest.raises(RuntimeError):
        timer.submit(hedge)
    assert timer.stop() is True
    assert hedge_threads() == []
