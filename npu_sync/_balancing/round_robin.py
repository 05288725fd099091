"""``round-robin``: each worker with room in a tier in turn, whatever its load,
latency or weight."""

from __future__ import annotations

from collections.abc import Collection

from npu_sync._balancing.slot import Tier
from npu_sync._balancing.tiered import TierByTier
from npu_sync._worker import Worker


class RoundRobin(TierByTier):
    """The first eligible worker with room after the last one picked in its tier.

    Not thread-safe: the selector calls it under the pool's lock. Its only state is
    each tier's cursor, which the index keeps.
    """

    name = "round-robin"
    rotate = True
    """Whether the scan starts after the last worker picked (else at the first)."""

    __slots__ = ()

    def pick(self, tier: Tier, excluded: Collection[str], now: float) -> Worker | None:
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
