"""Unit tests of scores, the peak hold and slow start's ramps, apart from any strategy."""

from __future__ import annotations

import math

import pytest

from npu_sync._balancing.slowstart import SlowStart
from tests.balancing.kit import make_worker, parts


def test_without_latency_the_score_is_one_over_the_share():
    """Least connections weighted: cost (in_flight + 1) / share."""
    a = make_worker("a", weight=4)
    p = parts([a])
    slot = p.slot(a)
    assert slot.score == 0.25
    a.in_flight = 3
    assert p.scores.cost(slot) == 1.0


def test_with_latency_the_cost_is_the_estimate_times_the_load_term():
    """estimate * (1 + (in_flight + 1) / (capacity * share))."""
    a = make_worker("a", capacity=4)
    p = parts([a], latency_aware=True)
    slot = p.slot(a)
    slot.latency.observe(0.1, 0.0)
    p.scores.rekey(slot, 0.0)
    a.in_flight = 1
    assert p.scores.cost(slot) == pytest.approx(0.1 * (1 + 2 / 4))


def test_an_answer_far_past_the_epoch_rebases_every_key():
    """An estimate stamped beyond the epoch's reach moves the epoch: keys stay finite."""
    a, b = make_worker("a"), make_worker("b")
    p = parts([a, b], latency_aware=True)
    later = 1e6
    for s in p.slots.values():
        s.latency.observe(0.05, later)
    p.scores.rekey(p.slot(a), later)
    assert p.scores.epoch == later
    assert all(math.isfinite(s.score) and s.score > 0 for s in p.slots.values())


def test_a_paused_workers_peak_relaxes_after_the_hold_but_not_below_its_peers():
    """Idle past ``peak_hold`` after a late answer, a worker relaxes to its typical
    latency, raised to the lower median of its tier's estimates."""
    a, b = make_worker("a"), make_worker("b")
    p = parts([a, b], latency_aware=True, peak_hold=1.0)
    for t in range(16):
        p.slot(a).latency.observe(0.01, t * 0.01)
    p.slot(b).latency.observe(0.03, 0.16)
    p.slot(a).latency.observe(1.0, 0.2)  # the pause
    p.holds.note(p.slot(a), 0.2)
    p.holds.relax(1.0)
    assert p.slot(a).latency.value(1.0) > 0.5  # still news
    p.holds.relax(1.2)
    assert p.slot(a).latency.value(1.2) == pytest.approx(p.slot(b).latency.value(1.2))


def test_a_busy_worker_is_not_relaxed():
    """A worker with tasks in flight keeps its peak when its hold ends."""
    a, b = make_worker("a"), make_worker("b")
    p = parts([a, b], latency_aware=True, peak_hold=1.0)
    for t in range(16):
        p.slot(a).latency.observe(0.01, t * 0.01)
    p.slot(a).latency.observe(1.0, 0.2)
    p.holds.note(p.slot(a), 0.2)
    a.in_flight = 1
    p.holds.relax(2.0)
    assert p.slot(a).latency.value(2.0) > 0.5


def test_a_ramp_grows_the_share_and_ends_at_the_weight():
    """Ramps give a ramping worker weight * factor, refreshed as time goes, then its
    whole weight once the window is over."""
    a = make_worker("a", weight=2)
    p = parts([a], slow_start=SlowStart(window=10.0))
    p.ramps.start(p.slot(a), 0.0)
    p.ramps.refresh(0.0)
    assert p.slot(a).share == pytest.approx(0.2) and p.scores.scored
    p.ramps.refresh(5.0)
    assert p.slot(a).share == pytest.approx(1.0)
    p.ramps.refresh(10.0)
    assert p.slot(a).share == 2.0 and p.ramps.ramping == [] and p.ramps.due == math.inf


@pytest.mark.parametrize("strategy", ["round-robin", "weighted", "priority", "least-loaded"])
def test_a_removed_workers_held_peak_is_not_kept_by_the_selector(strategy):
    """Latency-aware, a worker answers (its peak is held for a while) and is removed
    before the hold ends, under a strategy that never relaxes peaks too: once it has
    nothing in flight and the candidates change, the selector keeps nothing of it."""
    from npu_sync._balancing.selector import Selector

    a, b = make_worker("a"), make_worker("b")
    selector = Selector([a, b], latency_aware=True, strategy=strategy, now=0.0)
    selector.observe(b, 0.5, 1.0)
    assert [s.worker for s in selector._holds.held] == [b]
    selector.set_workers([a], 1.1)
    assert selector.select((), 1.2) is a
    assert selector._holds.held == set()
    assert all(s.worker is not b for _, _, s in selector._holds._holds)
