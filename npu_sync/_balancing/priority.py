"""``priority`` and ``priority-failover``: workers used in configuration order.

* ``priority``: the first worker with room in configuration order: fill one worker up
  to its capacity before the next gets any;
* ``priority-failover`` (AutoBot's name): only the single most preferred live worker
  (first tier, then configuration order) gets tasks; while it is busy a task waits for
  it. The next one is used only when it is down (disabled, draining, unhealthy,
  breaker open) or already failed this task.
"""

from __future__ import annotations

from collections.abc import Collection

from npu_sync._balancing.index import Index
from npu_sync._balancing.round_robin import RoundRobin
from npu_sync._balancing.scores import Scores
from npu_sync._balancing.slot import READY
from npu_sync._balancing.slowstart import Ramps
from npu_sync._outage import down_reason
from npu_sync._worker import Worker


class Priority(RoundRobin):
    """The first eligible worker with room, in configuration order, of the first tier
    that has one. Not thread-safe: under the pool's lock."""

    name = "priority"
    rotate = False

    __slots__ = ()


class PriorityFailover:
    """The most preferred live worker not yet tried, if it can take a task now; else
    None (the task waits for it): busy is not down.

    Not thread-safe: under the pool's lock.
    """

    name = "priority-failover"

    __slots__ = ("_index", "_ramps", "_scores")

    def __init__(self, index: Index, ramps: Ramps, scores: Scores) -> None:
        self._index = index
        self._ramps = ramps
        self._scores = scores

    def select(self, excluded: Collection[str], now: float) -> Worker | None:
        """The first live worker not in ``excluded`` when it has room, else None."""
        index = self._index
        if now >= index.due:
            index.catch_up(now)
        if now >= self._ramps.due:
            self._ramps.refresh(now)
        for slot in self._scores.members:
            worker = slot.worker
            if slot.id in excluded or down_reason(worker, now) is not None:
                continue
            if not worker.eligible(now):
                return None
            if slot.place != READY:
                index.classify(slot, now)  # parked before it had room again
            return worker if slot.place == READY else None
        return None
