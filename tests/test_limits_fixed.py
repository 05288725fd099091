"""Unit tests of the fixed limit: max_concurrent, nothing learned."""

from __future__ import annotations

import json
import math

import pytest

from npu_sync._balancing.limits import FixedLimit


@pytest.mark.parametrize(
    ("rtt", "in_flight", "dropped"),
    [(0.02, 8, False), (30.0, 64, False), (0.001, 8, True), (math.nan, 0, False)],
)
def test_the_limit_is_the_ceiling_whatever_the_answers(rtt, in_flight, dropped):
    """Fast, stalled, dropped or meaningless answers: always max_concurrent."""
    limit = FixedLimit(12)
    for _ in range(1000):
        assert limit.on_sample(rtt, in_flight, dropped) == 12
    limit.reset()
    assert limit.current == 12
    assert (limit.samples, limit.drops) == ((0, 1000) if dropped else (1000, 0))


def test_a_new_ceiling_is_the_new_limit():
    """set_ceiling is all that moves it; below 1 is refused naming the value."""
    limit = FixedLimit(12)
    limit.set_ceiling(3)
    assert limit.current == 3
    with pytest.raises(ValueError, match="ceiling must be >= 1, got 0"):
        limit.set_ceiling(0)
    with pytest.raises(ValueError, match="ceiling must be >= 1, got -1"):
        FixedLimit(-1)


def test_stats_name_the_algorithm():
    """stats() is JSON-ready and says fixed."""
    stats = FixedLimit(8).stats()
    assert json.loads(json.dumps(stats)) == stats
    assert stats["algorithm"] == "fixed" and stats["limit"] == stats["ceiling"] == 8
