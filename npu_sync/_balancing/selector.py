"""Which worker gets the next attempt: priority tier first, then the strategy's pick.

:class:`Selector` is what the rest of the package talks to. It owns each worker's
:class:`~npu_sync._balancing.slot.Slot` (its place in the index, its latency estimate,
its slow start, its score) and wires the parts of the balancing package together:

* :class:`~npu_sync._balancing.index.Index`: per tier, the workers with room, and
  whether waiting for one can help;
* the strategy, built once per configuration from ``balancing.strategy``:
  :class:`~npu_sync._balancing.least_loaded.LeastLoaded` (the default),
  :class:`~npu_sync._balancing.round_robin.RoundRobin`,
  :class:`~npu_sync._balancing.weighted.Weighted`,
  :class:`~npu_sync._balancing.weighted.WeightedRandom`,
  :class:`~npu_sync._balancing.priority.Priority`,
  :class:`~npu_sync._balancing.priority.PriorityFailover`;
* what every strategy shares: :class:`~npu_sync._balancing.scores.Scores` (each
  worker's score, the latency keys' epoch),
  :class:`~npu_sync._balancing.slowstart.Ramps` (slow start),
  :class:`~npu_sync._balancing.hold.PeakHold` (a slow answer's peak held only while it
  is news), and least-loaded's rules (:mod:`npu_sync._balancing.rules`).

The pool tells the selector what it learns: :meth:`Selector.observe` when an attempt
ends, :meth:`Selector.started` when an idle worker gets a task,
:meth:`Selector.recovered` when a worker comes back into service (a breaker closes
after a trip, a health check passes again, it moves). A worker added to a running pool
(by :meth:`Selector.set_workers`) is seeded with its tier's median latency and ramped
in by itself. A worker with no observation yet takes its tier's median estimate; when
a pool starts, the first answer in a tier is the estimate of the workers there that
have not answered yet, so none looks free and takes a burst up to its capacity.

Others read a worker's balancing state through the selector:
:meth:`Selector.share_of`, :meth:`Selector.slow_start_until`,
:meth:`Selector.state_of`, :meth:`Selector.balancing_of` and, for ``workers()``
rows, :meth:`Selector.captured`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Iterable
from itertools import groupby
from typing import Any, Protocol

from npu_sync._balancing.hold import PeakHold
from npu_sync._balancing.index import Index
from npu_sync._balancing.least_loaded import LeastLoaded
from npu_sync._balancing.priority import Priority, PriorityFailover
from npu_sync._balancing.round_robin import RoundRobin
from npu_sync._balancing.rules import RampTurn, StallRule, TrialTurn
from npu_sync._balancing.scores import Scores
from npu_sync._balancing.slot import NEVER, Slot
from npu_sync._balancing.slowstart import Ramps, SlowStart
from npu_sync._balancing.weighted import Weighted, WeightedRandom
from npu_sync._latency import DEFAULT_DECAY, DEFAULT_HOLD
from npu_sync._worker import Balancing, Worker
from npu_sync.config import STRATEGIES


class Strategy(Protocol):
    """How a worker is picked within the tiers (``balancing.strategy``)."""

    name: str

    def select(self, excluded: Collection[str], now: float) -> Worker | None:
        """The worker for the next attempt, not in ``excluded``; None when none has
        room. Brings the index up to date first."""


class Selector:
    """Picks a worker for an attempt.

    Not thread-safe: the pool calls it under its selection lock.

    Args:
        workers: the candidates.
        rng: randomness for sampling large tiers, ramping workers' chances and
            ``weighted-random``.
        shared_breakers: breakers follow other processes (shared state), so an open
            breaker may close at any time and never makes a worker unavailable until
            a known moment.
        latency_aware: weigh each worker's load by its latency estimate.
        decay: the latency estimates' time constant, in seconds.
        slow_start: how a worker back in service ramps up; None for no ramp.
        now: the time of the first :meth:`set_workers` (workers it adds are not
            ramped: every worker starts together).
        strategy: how a worker is picked within a tier (:data:`STRATEGIES`).
        peak_hold: seconds after a worker's last answer before an idle worker's
            estimate relaxes to its typical latency; 0 never relaxes it.
    """

    def __init__(
        self,
        workers: Iterable[Worker] = (),
        *,
        rng: random.Random | None = None,
        shared_breakers: bool = False,
        latency_aware: bool = False,
        decay: float = DEFAULT_DECAY,
        slow_start: SlowStart | None = None,
        now: float = 0.0,
        strategy: str = "least-loaded",
        peak_hold: float = DEFAULT_HOLD,
    ) -> None:
        _check_strategy(strategy)
        self._rng = rng or random.Random()
        self._random = self._rng.random
        _check_decay(decay)
        index = self._index = Index(shared_breakers=shared_breakers)
        self._trials = TrialTurn(index)
        index.on_trial = self._trials.note
        self._scores = Scores(latency_aware=latency_aware, decay=decay, now=now)
        self._holds = PeakHold(index, self._scores, peak_hold)
        self._ramps = Ramps(slow_start or SlowStart(window=0.0), index, self._scores)
        self._stall = StallRule(self._scores, self._holds)
        self._ramp_turn = RampTurn(self._ramps, self._random)
        # The slots of workers that left with tasks in flight (draining): what their
        # last answers teach still shows in their rows until they are gone.
        self._retired: dict[Worker, Slot] = {}
        self.tiers: tuple[tuple[Worker, ...], ...] = ()
        self.workers: tuple[Worker, ...] = ()
        self.parked: dict[Worker, Slot] = index.parked
        """Every worker not in a ready list: only these need :meth:`update`."""
        # The index's own methods, bound once: each is on every task's path.
        self.update: Callable[[Worker, float], None] = index.update
        """Look at ``worker`` again: a task of its ended, or its state changed."""
        self.taken: Callable[[Worker, float], None] = index.taken
        """``worker`` was just given a task that filled it or is its breaker's trial."""
        self.invalidate: Callable[[], None] = index.invalidate
        """Some workers may have become available, which ones is not known."""
        self.may_have_room: Callable[[float], bool] = index.may_have_room
        """False when :meth:`select` would certainly return None."""
        self.has_room: Callable[[float], bool] = index.has_room
        """Like :meth:`may_have_room`, after looking again at the parked workers."""
        self.next_wake: Callable[[], float | None] = index.next_wake
        """When the earliest timed worker is due to be looked at again, if any."""
        self.can_serve_before: Callable[[Collection[str], float, float], bool] = (
            index.can_serve_before
        )
        """Whether some worker not in ``excluded`` may take a task before ``deadline``."""
        self.held_past: Callable[[Collection[str], float], tuple[bool, bool]] = index.held_past
        """Whether open breakers, and whether cool-downs, hold some worker past it."""
        self._strategy = self._build(strategy)
        self.select: Callable[[Collection[str], float], Worker | None] = self._strategy.select
        """The best eligible worker not in ``excluded``, or None; a lower tier is used
        only when no worker of a higher tier is eligible."""
        self.set_workers(workers, now)

    # -- configuration -----------------------------------------------------------------

    @property
    def shared_breakers(self) -> bool:
        return self._index.shared_breakers

    @shared_breakers.setter
    def shared_breakers(self, value: bool) -> None:
        self._index.shared_breakers = value

    @property
    def on_earlier_wake(self) -> Callable[[], None] | None:
        """Called when a parked worker's wake time becomes the earliest of all."""
        return self._index.on_earlier_wake

    @on_earlier_wake.setter
    def on_earlier_wake(self, callback: Callable[[], None] | None) -> None:
        self._index.on_earlier_wake = callback

    @property
    def latency_aware(self) -> bool:
        return self._scores.latency_aware

    @property
    def slow_start(self) -> SlowStart:
        return self._ramps.slow_start

    @property
    def strategy(self) -> str:
        return self._strategy.name

    def _build(self, name: str) -> Strategy:
        """The strategy called ``name``, over this selector's parts."""
        index, ramps = self._index, self._ramps
        if name == "least-loaded":
            return LeastLoaded(
                index,
                self._scores,
                ramps,
                self._holds,
                self._stall,
                self._trials,
                self._ramp_turn,
                self._random,
            )
        if name == "round-robin":
            return RoundRobin(index, ramps)
        if name == "priority":
            return Priority(index, ramps)
        if name == "weighted":
            return Weighted(index, ramps)
        if name == "weighted-random":
            return WeightedRandom(index, ramps, self._random)
        return PriorityFailover(index, ramps, self._scores)

    def configure(
        self,
        *,
        latency_aware: bool,
        decay: float,
        slow_start: SlowStart | None,
        now: float,
        strategy: str | None = None,
        peak_hold: float | None = None,
    ) -> None:
        """Take new balancing settings (a reload). Ramps under way keep their end."""
        if peak_hold is not None:
            self._holds.seconds = peak_hold
        _check_decay(decay)
        if strategy is not None:
            _check_strategy(strategy)
        scores = self._scores
        scores.latency_aware = latency_aware
        scores.decay = decay
        self._ramps.slow_start = slow_start or SlowStart(window=0.0)
        for slot in scores.members:
            slot.latency.decay = decay
            if not latency_aware:
                slot.stall_after = NEVER
        scores.restart(now)
        self._ramps.refresh(now, everyone=True)
        self._strategy = self._build(strategy or self._strategy.name)
        self.select = self._strategy.select

    def set_workers(self, workers: Iterable[Worker], now: float | None = None) -> None:
        """Replace the candidate set; lower ``priority`` numbers form earlier tiers.

        Given ``now``, workers that were not candidates before are ramped in (slow
        start) and seeded with their tier's median latency, unless there were no
        candidates before (a pool starting: every worker starts together). A worker
        that stays keeps its slot, and what was learnt of it, as does a draining worker
        taken back.
        """
        workers = list(workers)
        previous = self._index.slots
        retired = self._retired
        # A draining worker taken back keeps its slot as it was: no seed, no ramp.
        added = (
            [w for w in workers if w not in previous and w not in retired]
            if previous and now is not None
            else []
        )
        ordered = sorted(workers, key=lambda w: w.priority)
        self.workers = tuple(ordered)
        self.tiers = tuple(tuple(tier) for _, tier in groupby(ordered, key=lambda w: w.priority))
        staying = set(ordered)
        slot_tiers = [
            [previous.get(w) or retired.pop(w, None) or Slot(w) for w in tier]
            for tier in self.tiers
        ]
        for worker, slot in [*previous.items(), *retired.items()]:
            if worker not in staying and worker.in_flight:
                retired[worker] = slot
            else:
                retired.pop(worker, None)
        tiers = self._index.rebuild(slot_tiers)
        self._trials.forget_gone()
        self._holds.forget_gone()
        for tier, members in zip(tiers, slot_tiers, strict=True):
            tier.observed = any(s.latency.observed for s in members)
            tier.alone = len(members) == 1
        scores = self._scores
        scores.members = tuple(s for members in slot_tiers for s in members)
        for slot in scores.members:
            slot.latency.decay = scores.decay
            if not scores.latency_aware:
                slot.stall_after = NEVER
        slots = self._index.slots
        for worker in added:
            self._seed(slots[worker], now)  # type: ignore[arg-type]  # added only when now is given
            self._ramps.start(slots[worker], now)  # type: ignore[arg-type]
        self._ramps.restart(scores.epoch if now is None else now)

    # -- what the pool learns ----------------------------------------------------------

    def observe(self, worker: Worker, rtt: float, now: float, ok: bool = True) -> None:
        """An attempt on ``worker`` ended at ``now`` after ``rtt`` seconds.

        Call for every attempt the worker answered or failed (``ok`` False unless it
        succeeded: only a success may lower the estimate), not for leases given back
        unused. Also marks the worker as making progress (see the stall rule).
        """
        slot = self._index.slots.get(worker)
        member = slot is not None
        if slot is None:
            slot = self._retired.get(worker)
            if slot is None:
                return  # never a candidate here: nothing to learn for
        latency = slot.latency
        latency.observe(rtt, now, ok)
        slot.busy_since = now
        scores = self._scores
        if scores.latency_aware:
            holds = self._holds
            if holds.seconds and slot not in holds.held:  # PeakHold.note(), inlined
                holds.hold_until(slot, now + holds.seconds)
            # The estimate as of its stamp, now but for clock reads a hair apart.
            slot.stall_after = now + latency.cost
            if not member:
                scores.rekey(slot, now)
                return
            tier = slot.tier
            if not tier.alone:
                scores.rekey(slot, now)
            if latency.observed and not tier.observed:
                tier.observed = True
                self._seed_unknown(slot, latency.cost, now)

    def _seed_unknown(self, first: Slot, cost: float, now: float) -> None:
        """The first answer in ``first``'s tier took ``cost``: give it as an estimate to
        the tier's workers that have none yet. Left at nothing, they would look free
        and take every task up to their capacity (the load term is at most 2) until
        their silence grew past the others' latency. Once per tier."""
        priority = first.worker.priority
        for slot in self._scores.members:
            if (
                slot is not first
                and slot.worker.priority == priority
                and not slot.latency.observed
                and slot.latency.value(now) < cost
            ):
                slot.latency.seed(cost, now)
                slot.stall_after = slot.busy_since + cost
                self._scores.rekey(slot, now)

    def started(self, worker: Worker, now: float) -> None:
        """``worker`` just got its first task in flight (it was idle)."""
        if self._scores.latency_aware:
            slot = self._index.slots.get(worker) or self._retired.get(worker)
            if slot is not None:
                slot.busy_since = now
                # The estimate as last set, not decayed to now: no exp() on every idle
                # worker's first task, at the price of noticing a stall a little later.
                slot.stall_after = now + slot.latency.cost

    def recovered(self, worker: Worker, now: float) -> None:
        """``worker`` is back in service: its breaker closed after a trip, its health
        check passes again, or it moved to a new address. Its latency estimate starts
        again from its tier's median and its share ramps up (slow start)."""
        slot = self._index.slots.get(worker)
        if slot is not None:
            self._seed(slot, now)
            self._ramps.start(slot, now)
            self._ramps.refresh(now)

    def _seed(self, slot: Slot, now: float) -> None:
        """Start ``slot``'s estimate from the median of its tier's observed ones."""
        priority = slot.worker.priority
        peers = sorted(
            s.latency.value(now)
            for s in self._scores.members
            if s.worker.priority == priority and s is not slot and s.latency.observed
        )
        seed = peers[len(peers) // 2] if peers else slot.latency.value(now)
        slot.latency.seed(seed, now)
        if self._scores.latency_aware:
            slot.busy_since = now
            slot.stall_after = now + seed

    # -- what others read --------------------------------------------------------------

    def state_of(self, worker: Worker) -> Slot:
        """``worker``'s balancing state, to read: a fresh one for a worker never a
        candidate here (or gone with nothing in flight)."""
        return self._index.slots.get(worker) or self._retired.get(worker) or Slot(worker)

    def share_of(self, worker: Worker) -> float:
        """``worker``'s share: its weight times its slow start factor."""
        return self.state_of(worker).share

    def slow_start_until(self, worker: Worker, now: float) -> float | None:
        """When ``worker``'s slow start ends, or None if none is under way at ``now``."""
        until = self.state_of(worker).ramp_until
        return until if until > now else None

    def captured(self, worker: Worker) -> Balancing:
        """What ``worker``'s ``workers()`` row shows of its balancing state, copied
        under the pool's lock: see :func:`npu_sync._worker.render`."""
        slot = self.state_of(worker)
        latency = slot.latency
        return (
            slot.share,
            latency.cost,
            latency.stamp,
            latency.decay,
            latency.observed,
            slot.ramp_until,
        )

    def balancing_of(self, worker: Worker, now: float) -> dict[str, Any]:
        """What the balancing mechanisms know of ``worker``: JSON-serialisable.

        ``weight``; ``latency``, the estimate (see :class:`~npu_sync._latency.PeakEwma`);
        ``slow_start_until``, monotonic seconds when the ramp ends (None when none is
        under way) and ``share``, the ramp's factor times the weight; ``limit``, the
        adaptive limit's stats or None.
        """
        slot = self.state_of(worker)
        return {
            "weight": worker.weight,
            "share": slot.share,
            "latency": slot.latency.stats(now),
            "slow_start_until": slot.ramp_until if slot.ramp_until > now else None,
            "limit": None if worker.limit is None else worker.limit.stats(),
        }

    def stats(self, now: float) -> dict[str, object]:
        """The balancing settings and the ramps under way: JSON-serialisable.

        ``{"strategy", "latency_aware", "latency_decay", "slow_start", "ramping"}``, where
        ``ramping`` maps each ramping worker's id to the seconds its ramp has left.
        """
        return {
            "strategy": self._strategy.name,
            "latency_aware": self._scores.latency_aware,
            "latency_decay": self._scores.decay,
            "slow_start": self._ramps.slow_start.window,
            "ramping": {
                s.id: s.ramp_until - now for s in self._ramps.ramping if s.ramp_until > now
            },
        }


def _check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")


def _check_decay(decay: float) -> None:
    if not decay > 0:
        raise ValueError(f"decay must be > 0 seconds, got {decay!r}")
