"""A slow answer's peak is held only while it is news.

``peak_hold`` seconds (1 s by default) after a worker's last answer, if it has
nothing in flight, its estimate relaxes to its typical latency, or its tier's while
it has few answers of its own, but never below the lower median of its tier's
estimates (see :meth:`PeakEwma.relax <npu_sync._latency.PeakEwma.relax>` and
:meth:`PeakHold.relaxed`). A worker that paused is back in use a second after its
late answers came, in every process, rather than once the decay has worn its peak
down; one slower in steady state keeps its cost. Due relaxations are kept in a heap
and looked at with one comparison per selection.
"""

from __future__ import annotations

import heapq

from npu_sync._balancing.index import Index
from npu_sync._balancing.scores import Scores
from npu_sync._balancing.slot import NEVER, Slot
from npu_sync._latency import DEFAULT_HOLD


class PeakHold:
    """When each worker's peak stops being news, and what it relaxes to.

    Not thread-safe: under the pool's lock.

    Args:
        seconds: after a worker's last answer before an idle worker's estimate
            relaxes; 0 never relaxes it.
        index: whose members may relax.
        scores: rekeys a worker whose estimate moved.
    """

    __slots__ = ("_holds", "_index", "_scores", "due", "held", "seconds")

    def __init__(self, index: Index, scores: Scores, seconds: float = DEFAULT_HOLD) -> None:
        self.seconds = seconds
        self._index = index
        self._scores = scores
        # Workers whose estimate may relax, by when.
        self._holds: list[tuple[float, int, Slot]] = []
        self.held: set[Slot] = set()
        """The slots waiting for their hold to end."""
        self.due = NEVER
        """When :meth:`relax` has something to do: one comparison per selection."""

    def note(self, slot: Slot, now: float) -> None:
        """``slot``'s estimate just moved up (an answer, a stall): hold it from ``now``."""
        if self.seconds and slot not in self.held:
            self.hold_until(slot, now + self.seconds)

    def hold_until(self, slot: Slot, when: float) -> None:
        self.held.add(slot)
        heapq.heappush(self._holds, (when, id(slot), slot))
        if when < self.due:
            self.due = when

    def forget_gone(self) -> None:
        """Drop the slots no longer in the index (a new candidate set): a removed worker
        is not kept here until its hold would have ended."""
        if self.held:
            members = self._index.slots
            self._holds = [e for e in self._holds if members.get(e[2].worker) is e[2]]
            heapq.heapify(self._holds)
            self.held = {s for s in self.held if members.get(s.worker) is s}
            self.due = self._holds[0][0] if self._holds else NEVER

    def relax(self, now: float) -> None:
        """Relax the estimates whose hold ended: of idle workers not heard from for
        ``seconds``. A worker heard from since waits again; a busy one is looked at
        again when it answers, or when the stall rule raises it."""
        holds = self._holds
        hold = self.seconds
        members = self._index.slots
        while holds and holds[0][0] <= now:
            _, _, slot = heapq.heappop(holds)
            self.held.discard(slot)
            if members.get(slot.worker) is not slot or not hold:
                continue
            due = slot.latency.stamp + hold
            if due > now:
                self.hold_until(slot, due)
            elif not slot.worker.in_flight:
                target = self.relaxed(slot, now)
                if target is not None and slot.latency.relax(now, target):
                    self._scores.rekey(slot, now)
        self.due = holds[0][0] if holds else NEVER

    def relaxed(self, slot: Slot, now: float) -> float | None:
        """What ``slot``'s estimate relaxes to: its typical latency (its tier's median
        one while it has too few answers of its own), but never below the lower median
        of its tier's estimates now. A worker back from a pause looks like its peers,
        not cheaper than all of them: every process relaxes it at about the same
        moment, and a worker cheaper than all would draw every process's tasks at once.
        Scans the workers: called once per hold of an idle worker, not per task."""
        members = slot.tier
        peers = [s for s in self._scores.members if s.tier is members and s is not slot]
        latency = slot.latency
        if latency.known:
            typical = latency.typical()
        else:
            known = sorted(
                t for s in peers if s.latency.known and (t := s.latency.typical()) is not None
            )
            typical = known[len(known) // 2] if known else latency.typical()
        if typical is None:
            return None
        now_values = sorted(s.latency.value(now) for s in peers if s.latency.observed)
        if now_values:
            # The lower median: with two peers, the cheaper one's (then the load term
            # shares tasks between them as least connections would).
            typical = max(typical, now_values[(len(now_values) - 1) // 2])
        return typical
