"""Unit tests of least-loaded's rules: the stall rule, the trial turn, the ramp turn."""

from __future__ import annotations

import pytest

from npu_sync._balancing.rules import RampTurn, StallRule
from npu_sync._balancing.slowstart import SlowStart
from npu_sync.testing import FakeClock
from tests.balancing.kit import make_worker, parts


def test_a_worker_is_quiet_only_with_tasks_in_flight_past_its_estimate():
    """quiet(): busy and silent past ``stall_after``; an idle worker never is."""
    a = make_worker("a")
    p = parts([a], latency_aware=True)
    slot = p.slot(a)
    slot.stall_after = 1.0
    assert not StallRule.quiet(slot, 2.0)  # idle
    a.in_flight = 1
    assert not StallRule.quiet(slot, 1.0)
    assert StallRule.quiet(slot, 1.5)


def test_a_stalled_worker_is_as_slow_as_its_silence_and_held_there():
    """stalled() raises the estimate to the time since it was last heard from, rekeys
    it, and holds the peak for relaxing later."""
    a, b = make_worker("a"), make_worker("b")
    p = parts([a, b], latency_aware=True, peak_hold=1.0)
    slot = p.slot(a)
    slot.latency.observe(0.01, 0.0)
    slot.busy_since = 0.0
    before = slot.score
    p.stall.stalled(slot, 3.0)
    assert slot.latency.value(3.0) == pytest.approx(3.0)
    assert slot.score > before
    assert p.holds.due == 4.0


def test_a_due_trial_takes_the_task_under_light_load_and_is_dropped_once_closed():
    """With the winner idle, the worker whose breaker admits its trial is picked; once
    its breaker closes it is forgotten."""
    clock = FakeClock()
    a, b = make_worker("a", clock=clock), make_worker("b", clock=clock)
    p = parts([a, b])
    b.breaker.record_failure(False)
    clock.advance(b.breaker.reset_timeout + 1)
    now = clock.monotonic()
    p.index.catch_up(now)
    tier = p.index.tiers[0]
    assert p.trials.turn(tier, (), p.slot(a), now) is p.slot(b)
    assert p.trials.turn(tier, {"b"}, p.slot(a), now) is p.slot(a)  # tried already
    b.breaker.record_success(b.breaker.admit(now))
    assert p.trials.turn(tier, (), p.slot(a), now) is p.slot(a)
    assert not p.trials.pending


def test_an_idle_ramping_worker_is_drawn_with_its_factor():
    """The ramp turn picks a ramping worker when the draw falls below its factor, and
    leaves the winner otherwise; a busy ramping worker is never drawn."""
    a, b = make_worker("a"), make_worker("b")
    p = parts([a, b], slow_start=SlowStart(window=10.0))
    p.ramps.start(p.slot(b), 0.0)
    p.ramps.refresh(0.0)
    p.index.catch_up(0.0)
    tier = p.index.tiers[0]
    draws = iter([0.05, 0.5])
    turn = RampTurn(p.ramps, lambda: next(draws))
    assert p.slot(b).share == pytest.approx(0.1)
    assert turn.turn(tier, (), p.slot(a), 0.0) is p.slot(b)  # 0.05 < 0.1
    assert turn.turn(tier, (), p.slot(a), 0.0) is p.slot(a)  # 0.5 >= 0.1
    b.in_flight = 1
    assert RampTurn(p.ramps, lambda: 0.0).turn(tier, (), p.slot(a), 0.0) is p.slot(a)


@pytest.mark.parametrize("strategy", ["round-robin", "weighted", "priority", "least-loaded"])
def test_a_removed_workers_due_trial_is_not_kept_by_the_selector(strategy):
    """A worker whose breaker trial is due, then removed from the candidates (by the
    strategy that never takes trial turns too): the selector keeps nothing of it, so
    repeated reloads of workers in that state hold no memory of the workers gone."""
    from npu_sync._balancing.selector import Selector

    clock = FakeClock()
    a, b = make_worker("a", clock=clock), make_worker("b", clock=clock)
    selector = Selector([a, b], strategy=strategy, now=clock.monotonic())
    b.breaker.record_failure(False)
    clock.advance(b.breaker.reset_timeout + 1)
    now = clock.monotonic()
    selector.invalidate()
    a.in_flight = a.capacity  # b's trial is the only room left
    selector.update(a, now)
    assert selector.select((), now) is b
    assert [s.worker for s in selector._trials.pending] == [b]
    a.in_flight = 0
    selector.set_workers([a], now)
    assert selector.select((), now) is a
    assert selector._trials.pending == {}
