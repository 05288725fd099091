"""Unit tests of Weighted (smooth weighted round robin) and WeightedRandom."""

from __future__ import annotations

from collections import Counter

from npu_sync._balancing.slowstart import SlowStart
from npu_sync._balancing.weighted import Weighted, WeightedRandom
from tests.balancing.kit import make_worker, parts


def test_weights_three_and_one_give_aaab_interleaved():
    """Smooth: a worker of weight 3 gets three of every four tasks, never four in a row."""
    a, b = make_worker("a", weight=3, capacity=100), make_worker("b", capacity=100)
    p = parts([a, b])
    strategy = Weighted(p.index, p.ramps)
    picks = "".join(strategy.select((), 0.0).id for _ in range(12))
    assert Counter(picks) == {"a": 9, "b": 3}
    assert "aaaa" not in picks


def test_a_ramping_worker_gets_its_share_of_the_weight():
    """The credit a worker gains per round is its share: weight times its ramp's factor."""
    a, b = make_worker("a", capacity=100), make_worker("b", capacity=100)
    p = parts([a, b], slow_start=SlowStart(window=10.0))
    p.ramps.start(p.slot(b), 0.0)
    p.ramps.refresh(5.0)  # half way: b's share is 0.5
    strategy = Weighted(p.index, p.ramps)
    picks = Counter(strategy.select((), 5.0).id for _ in range(30))
    assert picks == {"a": 20, "b": 10}


def test_a_worker_found_unavailable_gives_back_the_rounds_credit():
    """The round that picked an unhealthy worker did not happen: the next pick is
    the one smooth weighted round robin gives without it."""
    a, b = make_worker("a", weight=2, capacity=100), make_worker("b", capacity=100)
    p = parts([a, b])
    strategy = Weighted(p.index, p.ramps)
    assert [strategy.select((), 0.0).id for _ in range(2)] == ["a", "b"]
    a.healthy = False  # not told: found when this round makes a the richest
    assert strategy.select((), 0.0) is b
    assert p.slot(a).wrr == 1.0 and p.slot(b).wrr == -1.0  # as if a had never been in it


def test_weighted_random_draws_in_proportion_to_share():
    """A draw below a's share of the total picks a; above it, b."""
    a, b = make_worker("a", weight=3, capacity=100), make_worker("b", capacity=100)
    p = parts([a, b])
    draws = iter([0.7, 0.8])
    strategy = WeightedRandom(p.index, p.ramps, lambda: next(draws))
    assert strategy.select((), 0.0) is a  # 0.7 * 4 = 2.8 < 3
    assert strategy.select((), 0.0) is b  # 0.8 * 4 = 3.2 >= 3
