"""Unit tests of TierByTier, what the tier-by-tier strategies share."""

from __future__ import annotations

from collections.abc import Collection

import pytest

from npu_sync._balancing.slot import Tier
from npu_sync._balancing.tiered import TierByTier
from npu_sync._worker import Worker
from tests.balancing.kit import make_worker, parts


class Recording(TierByTier):
    """Picks the last worker with room of a tier, unless told to pass the tier."""

    __slots__ = ("passes", "seen")

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.passes: set[str] = set()
        self.seen: list[list[str]] = []

    def pick(self, tier: Tier, excluded: Collection[str], now: float) -> Worker | None:
        ids = [slot.id for slot in tier.ready]
        self.seen.append(ids)
        if self.passes & set(ids):
            return None
        return tier.ready[-1].worker


def test_tiers_are_asked_in_order_and_a_tier_that_yields_none_passes_to_the_next():
    """The preferred tier first; when its pick is None, the next tier's pick wins."""
    first = [make_worker(n, priority=1) for n in "ab"]
    second = [make_worker(n, priority=2) for n in "cd"]
    p = parts([*first, *second])
    strategy = Recording(p.index, p.ramps)
    assert strategy.select((), 0.0) is first[1]
    strategy.passes = {"a"}
    assert strategy.select((), 0.0) is second[1]
    assert strategy.seen[-2:] == [["a", "b"], ["c", "d"]]


def test_a_tier_with_no_worker_ready_is_not_asked():
    """Workers at capacity leave their tier's ready list; pick never sees an empty one."""
    full = make_worker("a", priority=1, capacity=1)
    spare = make_worker("b", priority=2)
    p = parts([full, spare])
    full.in_flight = 1
    p.index.update(full, 0.0)
    strategy = Recording(p.index, p.ramps)
    assert strategy.select((), 0.0) is spare
    assert strategy.seen == [["b"]]


def test_a_strategy_that_does_not_say_how_it_picks_fails_loudly():
    """The base class is not a strategy of its own."""
    p = parts([make_worker("a")])
    with pytest.raises(NotImplementedError):
        TierByTier(p.index, p.ramps).select((), 0.0)
