"""What one more task on a worker costs: the score kept per worker, and its cost.

A worker's *score* is the part of the cost that changes only when an answer or a ramp
step comes: with latency-aware choice its peak-EWMA estimate, in the time-free form
of :meth:`PeakEwma.key <npu_sync._latency.PeakEwma.key>` (so that scores compare as
the estimates do without a clock read or an ``exp()`` per worker), else ``1 /
share``. :meth:`Scores.cost` turns it into the cost of one more task; the lowest
wins (see :class:`~npu_sync._balancing.least_loaded.LeastLoaded`).
"""

from __future__ import annotations

from npu_sync._balancing.slot import Slot
from npu_sync._latency import DEFAULT_DECAY, MIN_COST

REBASE = 50.0
"""Decay constants after which the keys' epoch moves forward (keys grow by e**50)."""


class Scores:
    """Each member's score, and the epoch its latency keys are taken from.

    Not thread-safe: under the pool's lock.

    Args:
        latency_aware: weigh each worker's load by its latency estimate.
        decay: the latency estimates' time constant, in seconds (> 0).
        now: the first epoch.
    """

    __slots__ = ("decay", "epoch", "latency_aware", "members", "rebase_at", "scored")

    def __init__(
        self, *, latency_aware: bool = False, decay: float = DEFAULT_DECAY, now: float = 0.0
    ) -> None:
        self.latency_aware = latency_aware
        self.decay = decay
        self.members: tuple[Slot, ...] = ()
        """The candidates, in priority order."""
        self.epoch = now
        self.rebase_at = now + REBASE * decay
        self.scored = False
        """Whether scores, not plain in-flight counts, are compared: latency counts, a
        ramp is under way or some weight is not 1."""

    def restart(self, now: float) -> None:
        """Take ``now`` as the epoch (new settings)."""
        self.epoch = now
        self.rebase_at = now + REBASE * self.decay

    def rekey(self, slot: Slot, now: float) -> None:
        """Compute ``slot.score`` from its share and, when latency counts, its estimate."""
        if self.latency_aware:
            if slot.latency.stamp > self.rebase_at:
                self.rebase(max(now, slot.latency.stamp))
                return  # rebase rekeyed every member
            key = slot.latency.key(self.epoch)
            # An estimate decayed to nothing still weighs in-flight counts.
            slot.score = key if key > MIN_COST else MIN_COST
        else:
            slot.score = 1.0 / slot.share

    def rebase(self, now: float) -> None:
        """Move the keys' epoch to ``now`` so that they stay finite, and rekey all."""
        self.restart(now)
        for slot in self.members:
            self.rekey(slot, now)

    def cost(self, slot: Slot) -> float:
        """What one more task on ``slot``'s worker costs; the lowest wins.

        Latency-aware: ``estimate * (1 + (in_flight + 1) / (capacity * share))``. A
        worker runs up to ``capacity`` tasks at once, so its latency does not grow with
        its load until it is full: the next task there takes about its estimate, and
        the load term only breaks ties between workers about as fast (by how full each
        is, for its share), so that a burst of selections between two answers spreads
        instead of piling onto the one that answered fastest. A worker whose latency
        does grow with its load (it runs tasks one after another, or queues them) shows
        it in its estimate: the peak-EWMA takes a slower answer at once. Otherwise:
        least connections weighted, ``(in_flight + 1) / share``.
        """
        worker = slot.worker
        if self.latency_aware:
            return slot.score * (1.0 + (worker.in_flight + 1) / (worker.capacity * slot.share))
        return (worker.in_flight + 1) * slot.score
