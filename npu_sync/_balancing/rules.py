"""The small rules least-loaded choice applies on top of costs.

* :class:`StallRule`: a worker that has tasks in flight and has answered none of them
  for longer than its estimate (it froze, or its network did) is taken to be at least
  as slow as the time it has been quiet: its cost grows with that time, so new tasks
  avoid it well before the attempts already there time out.
* :class:`TrialTurn`: under light load, a worker whose breaker admits its trial takes
  the task, else on costs alone it would stay out of service.
* :class:`RampTurn`: under light load, an idle ramping worker is picked by chance, with
  its slow start factor as the probability.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from npu_sync._balancing.hold import PeakHold
from npu_sync._balancing.index import Index
from npu_sync._balancing.scores import Scores
from npu_sync._balancing.slot import READY, Slot, Tier
from npu_sync._balancing.slowstart import Ramps
from npu_sync._breaker import CLOSED

STALL_RESCANS = 4
"""Stalled winners one selection may pass over before it takes the cheapest anyway."""


class StallRule:
    """A busy worker quiet for longer than its estimate is as slow as its silence.

    Not thread-safe: under the pool's lock.
    """

    __slots__ = ("_holds", "_scores")

    def __init__(self, scores: Scores, holds: PeakHold) -> None:
        self._scores = scores
        self._holds = holds

    @staticmethod
    def quiet(slot: Slot, now: float) -> bool:
        """Whether ``slot``'s worker has tasks in flight and no answer for longer than
        its estimate (``stall_after``, kept when it answers or becomes busy)."""
        return now > slot.stall_after and slot.worker.in_flight > 0

    def stalled(self, slot: Slot, now: float) -> None:
        """``slot``'s worker has been quiet too long: it is at least as slow as that
        silence, until it answers."""
        slot.latency.raise_to(now - slot.busy_since, now)
        self._scores.rekey(slot, now)
        self._holds.note(slot, now)


class TrialTurn:
    """Under light load (the winner is idle), a worker whose breaker admits its trial
    now takes the task: on costs alone (its estimate from before it failed, its
    capacity a single trial) it would lose to every idle worker, and a caller sending
    one task at a time would leave it out of service indefinitely.

    Not thread-safe: under the pool's lock.
    """

    __slots__ = ("_index", "pending")

    def __init__(self, index: Index) -> None:
        self._index = index
        # Workers whose breaker admitted a trial when last placed, in the order they
        # were noted (closed ones are dropped as they are met).
        self.pending: dict[Slot, None] = {}

    def note(self, slot: Slot) -> None:
        """``slot`` was found ready with its breaker not closed: its trial is due."""
        self.pending[slot] = None

    def forget_gone(self) -> None:
        """Drop the slots no longer in the index (a new candidate set): a removed worker
        is not kept here until a trial turn happens to meet it."""
        pending = self.pending
        if pending:
            members = self._index.slots
            self.pending = {s: None for s in pending if members.get(s.worker) is s}

    def turn(self, tier: Tier, excluded: Collection[str], best: Slot, now: float) -> Slot:
        """A worker of ``tier`` whose trial is due, else ``best``."""
        members = self._index.slots
        for slot in list(self.pending):
            worker = slot.worker
            if members.get(worker) is not slot or worker.breaker.state == CLOSED:
                del self.pending[slot]  # closed (or removed) since it was noted
            elif (
                slot is not best
                and slot.tier is tier
                and slot.place == READY
                and slot.id not in excluded
                and worker.eligible(now)
            ):
                return slot
        return best


class RampTurn:
    """Under light load (the winner is idle), give an idle ramping worker its share by
    chance: with scores alone it would lose every selection while the others are idle,
    and a caller sending one task at a time would never reach it before its ramp ends.
    Under load, scores alone ramp it.

    Not thread-safe: under the pool's lock.
    """

    __slots__ = ("_ramps", "_random")

    def __init__(self, ramps: Ramps, random: Callable[[], float]) -> None:
        self._ramps = ramps
        self._random = random

    def turn(self, tier: Tier, excluded: Collection[str], best: Slot, now: float) -> Slot:
        """An idle ramping worker of ``tier`` drawn with its factor, else ``best``."""
        for slot in self._ramps.ramping:
            worker = slot.worker
            if (
                slot is not best
                and not worker.in_flight
                and slot.tier is tier
                and slot.place == READY
                and slot.id not in excluded
                and self._random() * worker.weight < slot.share
                and worker.eligible(now)
            ):
                return slot
        return best
