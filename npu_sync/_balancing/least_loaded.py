"""``least-loaded``, the default strategy: the cheapest worker with room in a tier.

Within a tier the worker with the lowest cost of one more task wins (see
:meth:`Scores.cost <npu_sync._balancing.scores.Scores.cost>`); with every weight 1, no
ramp under way and latency-aware choice off, the plain count of tasks in flight is
compared. Ties go round robin, with a cursor per tier (the last worker picked there),
so equal workers share the load evenly however many tiers were looked at first and
however workers come and go. When more than :data:`P2C_THRESHOLD` workers of a tier
have room, :class:`TwoChoices` samples two of them and the lighter one wins (power of
two choices): O(1) rather than exact.

On top of costs, the rules of :mod:`npu_sync._balancing.rules`: the stall rule (a busy
worker silent for longer than its estimate is as slow as its silence), and under
light load a worker's breaker trial, then a ramping worker by chance.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from npu_sync._balancing.hold import PeakHold
from npu_sync._balancing.index import Index
from npu_sync._balancing.rules import STALL_RESCANS, RampTurn, StallRule, TrialTurn
from npu_sync._balancing.scores import Scores
from npu_sync._balancing.slot import Slot, Tier
from npu_sync._balancing.slowstart import Ramps
from npu_sync._breaker import CLOSED
from npu_sync._worker import Worker

P2C_THRESHOLD = 64
"""When more workers than this have room in a tier, two are sampled rather than all scanned."""

P2C_MISSES = 8
"""Samples that hit a worker the task already tried before the tier is scanned instead."""

_INF = float("inf")

_Scan = Callable[[Tier, Collection[str], float], Slot | None]


class LeastLoaded:
    """Picks the cheapest eligible worker of the first tier that has one.

    Not thread-safe: the selector calls it under the pool's lock. Holds no state of
    its own: built once per configuration over the selector's collaborators.
    """

    name = "least-loaded"

    __slots__ = ("_holds", "_index", "_p2c", "_ramp_turn", "_ramps", "_scores", "_stall", "_trials")

    def __init__(
        self,
        index: Index,
        scores: Scores,
        ramps: Ramps,
        holds: PeakHold,
        stall: StallRule,
        trials: TrialTurn,
        ramp_turn: RampTurn,
        random: Callable[[], float],
    ) -> None:
        self._index = index
        self._scores = scores
        self._ramps = ramps
        self._holds = holds
        self._stall = stall
        self._trials = trials
        self._ramp_turn = ramp_turn
        self._p2c = TwoChoices(index, scores, stall, self.scan, self.scan_scores, random)

    def select(self, excluded: Collection[str], now: float) -> Worker | None:
        """The cheapest eligible worker not in ``excluded``, of the first tier that has
        one; None when no tier has."""
        index = self._index
        if now >= index.due:
            index.catch_up(now)
        scores = self._scores
        if scores.scored:
            if now >= self._ramps.due:
                self._ramps.refresh(now)
            if now > scores.rebase_at:
                scores.rebase(now)
            if now >= self._holds.due:
                self._holds.relax(now)
            scan = self.scan_scores
        else:
            scan = self.scan
        for tier in index.tiers:
            ready = tier.ready
            if ready:
                chosen = (
                    scan(tier, excluded, now)
                    if len(ready) <= P2C_THRESHOLD
                    else self._p2c.sample(tier, excluded, now)
                )
                if chosen is not None:
                    return chosen.worker
        return None

    def scan(self, tier: Tier, excluded: Collection[str], now: float) -> Slot | None:
        """The worker of ``tier`` with the fewest tasks in flight; ties round robin."""
        ready = tier.workers
        n = len(ready)
        start = tier.turn
        best: Worker | None = None
        best_load = 0
        best_at = 0
        unavailable: list[Worker] | None = None
        for i in range(start, start + n):
            worker = ready[i % n]
            load = worker.in_flight
            if (best is None or load < best_load) and worker.id not in excluded:
                if worker.eligible(now):
                    best = worker
                    best_load = load
                    best_at = i
                    if load == 0:
                        break
                elif unavailable is None:
                    unavailable = [worker]
                else:
                    unavailable.append(worker)
        chosen: Slot | None = None
        if best is not None:
            chosen = tier.ready[best_at % n]
            tier.turn = best_at % n + 1
            tier.last = chosen
        if unavailable is not None:
            classify = self._index.classify
            slots = self._index.slots
            for worker in unavailable:
                classify(slots[worker], now)
        return chosen

    def scan_scores(self, tier: Tier, excluded: Collection[str], now: float) -> Slot | None:
        """:meth:`scan` comparing costs, with the stall rule.

        Costs differ far more often than counts tie, so a new best is met at many
        steps of the scan: its eligibility is checked once, at the end (the index
        keeps ready workers eligible but for changes it was not told of). So is the
        stall rule: it can only raise a score, so it matters only for the winner.
        """
        stalls = 0
        passed: Slot | None = None  # the last stalled winner, its score raised
        latency_aware = self._scores.latency_aware
        while True:
            ready = tier.ready
            n = len(ready)
            if not n:
                return None
            start = tier.turn % n
            best: Slot | None = None
            # Costs are finite (scores are rebased, shares and capacities positive),
            # so the first worker not excluded always beats this.
            best_load = _INF
            order = ready[start:] + ready[:start] if start else ready
            if latency_aware:
                # The cost of Scores.cost, inlined: this loop is the hot path.
                for slot in order:
                    worker = slot.worker
                    load = slot.score * (
                        1.0 + (worker.in_flight + 1) / (worker.capacity * slot.share)
                    )
                    if load < best_load and slot.id not in excluded:
                        best = slot
                        best_load = load
            else:
                for slot in order:
                    load = (slot.worker.in_flight + 1) * slot.score
                    if load < best_load and slot.id not in excluded:
                        best = slot
                        best_load = load
            if best is None:
                return None
            worker = best.worker
            if not worker.eligible(now):
                self._index.classify(best, now)  # leaves the ready list
            elif (
                now > best.stall_after
                and worker.in_flight
                and best is not passed
                and stalls < STALL_RESCANS
            ):
                self._stall.stalled(best, now)
                passed = best
                stalls += 1
            else:
                if not worker.in_flight:
                    if self._trials.pending:
                        best = self._trials.turn(tier, excluded, best, now)
                    if self._ramps.ramping and best.worker.breaker.state == CLOSED:
                        best = self._ramp_turn.turn(tier, excluded, best, now)
                tier.turn = ready.index(best) + 1
                tier.last = best
                return best


class TwoChoices:
    """Power of two choices over a large tier: two workers with room sampled, the
    lighter one wins. Falls back to :class:`LeastLoaded`'s scan when few are left
    with room, or when the samples keep hitting workers the task already tried.

    Not thread-safe: under the pool's lock.
    """

    __slots__ = ("_index", "_random", "_scan", "_scan_scores", "_scores", "_stall")

    def __init__(
        self,
        index: Index,
        scores: Scores,
        stall: StallRule,
        scan: _Scan,
        scan_scores: _Scan,
        random: Callable[[], float],
    ) -> None:
        self._index = index
        self._scores = scores
        self._stall = stall
        self._scan = scan
        self._scan_scores = scan_scores
        self._random = random

    def sample(self, tier: Tier, excluded: Collection[str], now: float) -> Slot | None:
        """The lighter of two sampled workers of ``tier`` not in ``excluded``."""
        scores = self._scores
        ready = tier.ready
        rnd = self._random
        first: Slot | None = None
        misses = 0
        while misses < P2C_MISSES:
            n = len(ready)
            if n <= P2C_THRESHOLD:
                return (
                    self._scan_scores(tier, excluded, now)
                    if scores.scored
                    else self._scan(tier, excluded, now)
                )
            slot = ready[int(rnd() * n)]
            if slot is first or slot.id in excluded:
                misses += 1
            elif not slot.worker.eligible(now):
                self._index.classify(slot, now)  # leaves the ready list
            elif first is None:
                first = slot
            elif scores.scored:
                for one in (first, slot):
                    # StallRule.quiet(), inlined: two of these on every sampled selection.
                    if now > one.stall_after and one.worker.in_flight:
                        self._stall.stalled(one, now)
                return first if scores.cost(first) <= scores.cost(slot) else slot
            else:
                return first if first.worker.in_flight <= slot.worker.in_flight else slot
        if first is not None:
            return first
        # The task has tried much of what is left here: look at every worker with room
        # (few, or the samples would not have kept missing).
        return (
            self._scan_scores(tier, excluded, now)
            if scores.scored
            else self._scan(tier, excluded, now)
        )
