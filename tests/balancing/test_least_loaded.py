"""Unit tests of LeastLoaded and its power of two choices, built over hand-made parts."""

from __future__ import annotations

from collections import Counter

from npu_sync._balancing.least_loaded import P2C_THRESHOLD, LeastLoaded, TwoChoices
from tests.balancing.kit import Parts, make_worker, parts


def least_loaded(p: Parts) -> LeastLoaded:
    return LeastLoaded(
        p.index, p.scores, p.ramps, p.holds, p.stall, p.trials, p.ramp_turn, p.rng.random
    )


def test_the_fewest_tasks_in_flight_wins_and_ties_go_round_robin():
    """Counts compared (weights 1, latency off): the idlest wins; equal ones take turns."""
    ws = [make_worker(n) for n in "abc"]
    strategy = least_loaded(parts(ws))
    ws[0].in_flight, ws[1].in_flight, ws[2].in_flight = 3, 1, 2
    assert strategy.select((), 0.0) is ws[1]
    for w in ws:
        w.in_flight = 0
    assert [strategy.select((), 0.0).id for _ in range(6)] == list("cabcab")


def test_a_heavier_weight_takes_more_tasks_in_flight():
    """Weighted least connections: weight 2 is as cheap with two tasks as weight 1 with one."""
    a, b = make_worker("a", weight=2), make_worker("b")
    strategy = least_loaded(parts([a, b]))
    for _ in range(6):
        chosen = strategy.select((), 0.0)
        assert chosen is not None
        chosen.in_flight += 1
    assert (a.in_flight, b.in_flight) == (4, 2)


def test_a_lower_tier_is_used_only_when_the_first_has_no_eligible_worker():
    """Tiers first: the busy priority-1 worker wins over an idle priority-2 one."""
    a, b = make_worker("a", capacity=2), make_worker("b", priority=2)
    strategy = least_loaded(parts([a, b]))
    a.in_flight = 1
    assert strategy.select((), 0.0) is a
    assert strategy.select({"a"}, 0.0) is b


def test_the_fastest_worker_with_room_wins_with_latency_on():
    """Latency-aware: the estimate decides between workers with room."""
    a, b = make_worker("a"), make_worker("b")
    p = parts([a, b], latency_aware=True)
    for worker, rtt in ((a, 0.2), (b, 0.02)):
        p.slot(worker).latency.observe(rtt, 0.0)
        p.scores.rekey(p.slot(worker), 0.0)
    assert least_loaded(p).select((), 0.0) is b


def test_a_quiet_busy_worker_is_passed_over_by_the_stall_rule():
    """A worker with tasks in flight and no answer for longer than its estimate is taken
    to be as slow as its silence: an idle slower worker wins."""
    a, b = make_worker("a"), make_worker("b")
    p = parts([a, b], latency_aware=True)
    p.slot(a).latency.observe(0.01, 0.0)
    p.slot(b).latency.observe(0.05, 0.0)
    for s in p.slots.values():
        p.scores.rekey(s, 0.0)
    a.in_flight = 1
    p.slot(a).busy_since, p.slot(a).stall_after = 0.0, 0.01
    assert least_loaded(p).select((), 0.0) is a  # not yet quiet
    assert least_loaded(p).select((), 1.0) is b
    assert p.slot(a).latency.value(1.0) >= 1.0


def test_two_choices_picks_the_lighter_of_two_in_a_large_tier():
    """Above the threshold, the lighter of two sampled workers: never the heaviest ones
    when most are light, and never an excluded one."""
    ws = [make_worker(f"w{i}", capacity=100) for i in range(P2C_THRESHOLD + 36)]
    p = parts(ws)
    for i, w in enumerate(ws):
        w.in_flight = 50 if i % 2 else 0
    p.index.catch_up(0.0)
    strategy = least_loaded(p)
    sampler = TwoChoices(
        p.index, p.scores, p.stall, strategy.scan, strategy.scan_scores, p.rng.random
    )
    tier = p.index.tiers[0]
    picks = Counter(sampler.sample(tier, {"w0"}, 0.0).worker.in_flight for _ in range(400))
    assert picks[50] < 160  # uniform would be ~200, the lighter of two ~100
    assert all(sampler.sample(tier, {"w0"}, 0.0).id != "w0" for _ in range(200))
