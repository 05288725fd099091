"""What the tier-by-tier strategies share: bring the index and the ramps up to date,
then look at the tiers in order and take the first worker the strategy picks in one."""

from __future__ import annotations

from collections.abc import Collection

from npu_sync._balancing.index import Index
from npu_sync._balancing.slot import Tier
from npu_sync._balancing.slowstart import Ramps
from npu_sync._worker import Worker


class TierByTier:
    """A strategy that picks within one tier at a time (:meth:`pick`), the most
    preferred tier first. Not thread-safe: the selector calls it under the pool's lock.
    """

    name = "tier-by-tier"

    __slots__ = ("_index", "_ramps")

    def __init__(self, index: Index, ramps: Ramps) -> None:
        self._index = index
        self._ramps = ramps

    def select(self, excluded: Collection[str], now: float) -> Worker | None:
        """The worker :meth:`pick` takes in the first tier where it takes one."""
        index = self._index
        if now >= index.due:
            index.catch_up(now)
        if now >= self._ramps.due:
            self._ramps.refresh(now)
        for tier in index.tiers:
            if tier.ready:
                chosen = self.pick(tier, excluded, now)
                if chosen is not None:
                    return chosen
        return None

    def pick(self, tier: Tier, excluded: Collection[str], now: float) -> Worker | None:
        """An eligible worker with room in ``tier`` not in ``excluded``, or None."""
        raise NotImplementedError
