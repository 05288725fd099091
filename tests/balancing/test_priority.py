"""Unit tests of PriorityFailover: the single most preferred live worker."""

from __future__ import annotations

from npu_sync._balancing.priority import PriorityFailover
from tests.balancing.kit import make_worker, parts


def test_a_busy_primary_is_waited_for_not_failed_over():
    """While the primary is at capacity, nothing is picked: busy is not down."""
    a, b = make_worker("a", capacity=1), make_worker("b", priority=2)
    p = parts([a, b])
    strategy = PriorityFailover(p.index, p.ramps, p.scores)
    assert strategy.select((), 0.0) is a
    a.in_flight = 1
    assert strategy.select((), 0.0) is None


def test_the_next_worker_serves_when_the_primary_is_down_or_tried():
    """Unhealthy or already tried for this task, the primary gives way to the next."""
    a, b = make_worker("a"), make_worker("b")
    p = parts([a, b])
    strategy = PriorityFailover(p.index, p.ramps, p.scores)
    assert strategy.select({"a"}, 0.0) is b
    a.healthy = False
    assert strategy.select((), 0.0) is b
    a.healthy = True
    p.index.invalidate()
    assert strategy.select((), 0.0) is a
