"""``round-robin``: each worker with room in a tier in turn, whatever its load,
latency or weight."""

from __future__ import annotations

from collections.abc import Collection

from npu_sync._balancing.index import Index
from npu_sync._balancing.slot import Tier
from npu_sync._balancing.slowstart import Ramps
from npu_sync._worker import Worker


class RoundRobin:
    """The first eligible worker with room after the last one picked in its tier.

    Not thread-safe: the selector calls it under the pool's lock. Its only state is
    each tier's cursor, which the index keeps.
    """

    name = "round-robin"
    rotate = True
    """Whether the scan starts after the last worker picked (else at the first)."""

    __slots__ = ("_index", "_ramps")

    def __init__(self, index: Index, ramps: Ramps) -> None:
        self._index = index
        self._ramps = ramps

    def select(self, excluded: Collection[str], now: float) -> Worker | None:
        """The next worker with room not in ``excluded``, of the first tier that has one."""
        index = self._index
        if now >= index.due:
            index.catch_up(now)
        if now >= self._ramps.due:
            self._ramps.refresh(now)
        for tier in index.tiers:
            if tier.ready:
                chosen = self.first(tier, excluded, now)
                if chosen is not None:
                    return chosen
        return None

    def first(self, tier: Tier, excluded: Collection[str], now: float) -> Worker | None:
        """The first eligible worker with room in ``tier``: after the last one picked
        (:attr:`rotate`) or in configuration order."""
        rotate = self.rotate
        while True:
            ready = tier.ready
            n = len(ready)
            start = tier.turn % n if rotate and n else 0
            for i in range(start, start + n):
                slot = ready[i % n]
                if slot.id in excluded:
                    continue
                if slot.worker.eligible(now):
                    tier.turn = i % n + 1
                    tier.last = slot
                    return slot.worker
                self._index.classify(slot, now)  # leaves the ready list
                break  # the list changed: start again
            else:
                return None
