"""Unit tests of RoundRobin and Priority (the first with room, in configuration order)."""

from __future__ import annotations

from npu_sync._balancing.priority import Priority
from npu_sync._balancing.round_robin import RoundRobin
from tests.balancing.kit import make_worker, parts


def test_round_robin_takes_each_worker_with_room_in_turn_whatever_its_load():
    """a, b, c, a, … even when one of them is far busier."""
    ws = [make_worker(n, capacity=100) for n in "abc"]
    p = parts(ws)
    strategy = RoundRobin(p.index, p.ramps)
    ws[0].in_flight = 50
    assert [strategy.select((), 0.0).id for _ in range(6)] == list("abcabc")


def test_round_robin_skips_a_full_or_tried_worker_and_keeps_the_turn():
    """A full worker leaves the turn; an excluded one is skipped for that task only."""
    ws = [make_worker(n, capacity=1) for n in "abc"]
    p = parts(ws)
    strategy = RoundRobin(p.index, p.ramps)
    assert strategy.select({"a"}, 0.0) is ws[1]
    ws[2].in_flight = 1
    assert strategy.select((), 0.0) is ws[0]  # c is full
    ws[2].in_flight = 0
    p.index.update(ws[2], 0.0)
    assert strategy.select((), 0.0) is ws[1]


def test_priority_fills_the_first_worker_before_the_next_gets_a_task():
    """Configuration order: a takes everything up to its capacity, then b."""
    a, b = make_worker("a", capacity=2), make_worker("b", capacity=2)
    p = parts([a, b])
    strategy = Priority(p.index, p.ramps)
    picks = []
    for _ in range(4):
        chosen = strategy.select((), 0.0)
        assert chosen is not None
        chosen.in_flight += 1
        p.index.taken(chosen, 0.0)
        picks.append(chosen.id)
    assert picks == list("aabb")
    assert strategy.select((), 0.0) is None
