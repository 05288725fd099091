"""Unit tests of WorkerBreaker, driven by a fake clock."""

from __future__ import annotations

import pytest

from npu_sync._breaker import CLOSED, HALF_OPEN, OPEN, WorkerBreaker
from npu_sync.config import BreakerConfig
from npu_sync.testing import FakeClock


def make(fail_max: int = 3, reset: float = 10.0, cap: float = 35.0, listener=None):
    clock = FakeClock()
    config = BreakerConfig(fail_max=fail_max, reset_timeout=reset, max_reset_timeout=cap)
    return WorkerBreaker("w1", config, clock=clock, listener=listener), clock


def trip(breaker: WorkerBreaker, clock: FakeClock, n: int) -> None:
    for _ in range(n):
        assert breaker.admit(clock.monotonic()) is False
        breaker.record_failure(False)


def test_closed_admits_ordinary_calls():
    """A closed breaker admits every call as a non-trial call."""
    breaker, clock = make()
    assert [breaker.admit(clock.monotonic()) for _ in range(10)] == [False] * 10
    assert breaker.state == CLOSED


def test_opens_after_fail_max_consecutive_failures():
    """fail_max consecutive failures open the breaker; fewer do not."""
    breaker, clock = make(fail_max=3)
    trip(breaker, clock, 2)
    assert breaker.state == CLOSED
    trip(breaker, clock, 1)
    assert breaker.state == OPEN
    assert breaker.trips == 1
    assert breaker.admit(clock.monotonic()) is None


def test_success_resets_the_failure_count():
    """A success between failures starts the count again."""
    breaker, clock = make(fail_max=3)
    trip(breaker, clock, 2)
    breaker.admit(clock.monotonic())
    breaker.record_success(False)
    assert breaker.failures == 0
    trip(breaker, clock, 2)
    assert breaker.state == CLOSED


def test_open_refuses_until_reset_timeout_then_admits_exactly_one_trial():
    """After reset_timeout one trial is admitted and every other caller is refused."""
    breaker, clock = make(reset=10.0)
    trip(breaker, clock, 3)
    clock.advance(9.9)
    assert not breaker.can_admit(clock.monotonic())
    assert breaker.admit(clock.monotonic()) is None
    clock.advance(0.2)
    assert breaker.can_admit(clock.monotonic())
    assert breaker.admit(clock.monotonic()) is True
    assert breaker.state == HALF_OPEN
    assert [breaker.admit(clock.monotonic()) for _ in range(5)] == [None] * 5
    assert not breaker.can_admit(clock.monotonic())


def test_trial_success_closes():
    """A successful trial closes the breaker and restores the base reset timeout."""
    breaker, clock = make(reset=10.0)
    trip(breaker, clock, 3)
    clock.advance(10)
    assert breaker.admit(clock.monotonic()) is True
    breaker.record_success(True)
    assert breaker.state == CLOSED
    assert breaker.reset_timeout == 10.0
    assert breaker.admit(clock.monotonic()) is False


def test_trial_failure_reopens_with_doubled_timeout_up_to_the_cap():
    """Each consecutive trip doubles the reset timeout, capped at max_reset_timeout."""
    breaker, clock = make(reset=10.0, cap=35.0)
    trip(breaker, clock, 3)
    seen = []
    for _ in range(4):
        seen.append(breaker.reset_timeout)
        clock.advance(breaker.reset_timeout)
        assert breaker.admit(clock.monotonic()) is True
        breaker.record_failure(True)
        assert breaker.state == OPEN
    assert seen == [10.0, 20.0, 35.0, 35.0]
    assert breaker.trips == 5


def test_release_frees_the_trial_slot_without_closing():
    """A trial that ended with a neutral outcome lets the next caller try."""
    breaker, clock = make()
    trip(breaker, clock, 3)
    clock.advance(10)
    assert breaker.admit(clock.monotonic()) is True
    breaker.release(True)
    assert breaker.state == HALF_OPEN
    assert breaker.admit(clock.monotonic()) is True


def test_late_failures_of_calls_admitted_before_the_trip_do_not_extend_it():
    """Failures recorded while open (calls started earlier) do not re-trip."""
    breaker, clock = make()
    trip(breaker, clock, 3)
    breaker.record_failure(False)
    breaker.record_failure(False)
    assert breaker.trips == 1
    clock.advance(10)
    assert breaker.admit(clock.monotonic()) is True


def test_listener_sees_every_transition_in_order():
    """State changes reach the listener as (name, old, new)."""
    seen = []
    breaker, clock = make(listener=lambda *args: seen.append(args))
    trip(breaker, clock, 3)
    clock.advance(10)
    breaker.admit(clock.monotonic())
    breaker.record_success(True)
    assert seen == [("w1", CLOSED, OPEN), ("w1", OPEN, HALF_OPEN), ("w1", HALF_OPEN, CLOSED)]


def test_allow_trial_skips_the_rest_of_the_reset_timeout():
    """allow_trial() makes an open breaker admit its trial at once."""
    breaker, clock = make(reset=60)
    trip(breaker, clock, 3)
    assert breaker.admit(clock.monotonic()) is None
    breaker.allow_trial()
    assert breaker.admit(clock.monotonic()) is True


def test_retry_at_reports_when_the_trial_is_due():
    """retry_at() is the open time plus the reset timeout, and None when closed."""
    breaker, clock = make(reset=10)
    assert breaker.retry_at() is None
    trip(breaker, clock, 3)
    assert breaker.retry_at() == pytest.approx(clock.monotonic() + 10)


def test_reset_closes_and_forgets():
    """reset() closes an open breaker and restores the base timeout."""
    breaker, clock = make(reset=10)
    trip(breaker, clock, 3)
    clock.advance(10)
    breaker.admit(clock.monotonic())
    breaker.record_failure(True)
    breaker.reset()
    assert breaker.state == CLOSED and breaker.reset_timeout == 10 and breaker.failures == 0


def test_early_trial_is_granted_once_per_opening():
    """A second allow_trial() after a failed early trial waits out the doubled timeout."""
    breaker, clock = make(reset=10)
    trip(breaker, clock, 3)
    breaker.allow_trial()
    assert breaker.admit(clock.monotonic()) is True
    breaker.record_failure(True)  # the early trial failed: open again, timeout 20
    breaker.allow_trial()
    assert breaker.admit(clock.monotonic()) is None
    clock.advance(20)
    assert breaker.admit(clock.monotonic()) is True
    breaker.record_success(True)
    trip(breaker, clock, 3)  # a new opening earns a new early trial
    breaker.allow_trial()
    assert breaker.admit(clock.monotonic()) is True


def test_a_failed_regular_trial_earns_the_next_opening_an_early_trial():
    """After an early trial fails, a regular trial's failure lets health cut the wait again."""
    breaker, clock = make(reset=10, cap=100)
    trip(breaker, clock, 3)
    breaker.allow_trial()
    assert breaker.admit(clock.monotonic()) is True
    breaker.record_failure(True)  # early trial failed
    clock.advance(breaker.reset_timeout)
    assert breaker.admit(clock.monotonic()) is True  # the regular trial
    breaker.record_failure(True)  # fails too: a new opening
    breaker.allow_trial()  # the worker is fixed and its check passes
    assert breaker.admit(clock.monotonic()) is True


def test_state_names_are_pybreakers_own():
    """The state names spelled out in breaker.py (so reading a state needs no pybreaker
    import) are the ones pybreaker sets, in its storage and in Redis."""
    import pybreaker

    assert (CLOSED, OPEN, HALF_OPEN) == (
        pybreaker.STATE_CLOSED,
        pybreaker.STATE_OPEN,
        pybreaker.STATE_HALF_OPEN,
    )
    breaker, clock = make(fail_max=1)
    trial = breaker.admit(clock.monotonic())
    assert trial is False  # an ordinary call on a closed breaker
    breaker.record_failure(trial)
    assert breaker.state == breaker._cb.current_state == OPEN


# -- trials leased from the fleet (breakers shared between processes) ----------------------


def make_leased(reset: float = 10.0, listener=None):
    clock = FakeClock()
    config = BreakerConfig(fail_max=2, reset_timeout=reset, max_reset_timeout=40.0)
    breaker = WorkerBreaker("w1", config, clock=clock, listener=listener, leased_trials=True)
    trip(breaker, clock, 2)
    clock.advance(reset)
    return breaker, clock


def test_a_leased_trial_stays_open_until_its_lease_is_taken():
    """The trial is admitted pending: still open, nothing else admitted, no transition
    told; the lease taken makes it half-open."""
    seen: list[tuple[str, str]] = []
    breaker, clock = make_leased(listener=lambda name, old, new: seen.append((old, new)))
    assert breaker.admit(clock.monotonic()) is True
    assert (breaker.state, breaker.lease_pending) == (OPEN, True)
    assert breaker.admit(clock.monotonic()) is None
    assert seen == [(CLOSED, OPEN)]
    assert breaker.lease_taken() is True
    assert breaker.state == HALF_OPEN and not breaker.lease_pending
    breaker.record_success(True)
    assert breaker.state == CLOSED


def test_a_refused_lease_keeps_the_breaker_open_until_the_other_lease_expires():
    """Another process holds the trial: none is admitted here before its lease ends,
    and the wait is when the pool wakes its waiters."""
    breaker, clock = make_leased()
    assert breaker.admit(clock.monotonic()) is True
    breaker.lease_refused(clock.monotonic() + 7.0)
    assert breaker.state == OPEN
    assert breaker.retry_at() == clock.monotonic() + 7.0
    clock.advance(6.9)
    assert not breaker.can_admit(clock.monotonic())
    assert breaker.admit(clock.monotonic()) is None
    clock.advance(0.2)
    assert breaker.can_admit(clock.monotonic())
    assert breaker.admit(clock.monotonic()) is True


def test_the_holders_result_ends_the_wait_for_its_lease():
    """A closing from the holder closes at once; its new opening sets a new timer with
    no wait for the old lease."""
    breaker, clock = make_leased()
    breaker.admit(clock.monotonic())
    breaker.lease_refused(clock.monotonic() + 30.0)
    assert breaker.force_close() is True and breaker.state == CLOSED
    trip(breaker, clock, 2)
    clock.advance(10.0)
    breaker.admit(clock.monotonic())
    breaker.lease_refused(clock.monotonic() + 30.0)
    breaker.force_open(0.0, 20.0)
    assert breaker.retry_at() == clock.monotonic() + 20.0


def test_a_pending_trial_is_called_off_by_another_processs_decision():
    """A closing or a newer opening that arrives while the lease is being taken calls the
    pending trial off: lease_taken says so, and nothing half-opens."""
    breaker, clock = make_leased()
    breaker.admit(clock.monotonic())
    assert breaker.force_close() is True
    assert breaker.lease_taken() is False
    assert breaker.state == CLOSED
    trip(breaker, clock, 2)
    clock.advance(10.0)
    breaker.admit(clock.monotonic())
    clock.advance(1.0)
    breaker.force_open(0.0, 20.0)  # the other process's trial failed just now
    assert breaker.lease_taken() is False
    assert breaker.state == OPEN and breaker.admit(clock.monotonic()) is None


def test_a_trial_given_back_unsent_waits_for_the_process_that_took_the_lease_since():
    """Half-open here with the trial released (an outcome that says nothing), our lease
    ran out and another process took it: its result decides, and until its lease ends
    none is admitted here."""
    breaker, clock = make_leased()
    breaker.admit(clock.monotonic())
    assert breaker.lease_taken()
    breaker.release(True)
    assert breaker.admit(clock.monotonic()) is True
    breaker.lease_refused(clock.monotonic() + 5.0)
    assert breaker.state == HALF_OPEN and breaker.admit(clock.monotonic()) is None
    assert breaker.force_open(0.0, 20.0) is True
    assert breaker.state == OPEN and breaker.retry_at() == clock.monotonic() + 20.0
