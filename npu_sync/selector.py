"""Which worker gets the next attempt: priority tier first, then the cheapest worker.

Selection runs under the pool's lock on every attempt, so its cost must not grow with
the pool, whatever state the pool is in: idle, busy, saturated or mostly down. The
selector keeps an index for that. Per tier, a list of the workers that have room
("ready"); every other worker is parked: *full* until one of its tasks ends, *timed*
until a known moment (its breaker's trial, the end of a Retry-After cool-down), or
*blocked* (unhealthy, disabled, draining, its trial in flight)
until told that it changed. Saturated tiers are skipped at a glance, and a tier with
one free slot among a thousand workers is a list of one.

The index learns of changes in two ways. Changes that make a worker *less* available
(a breaker trips, a cool-down begins, a health check fails) need no word: the worker
picked is checked again and parked when found unavailable. Changes that make one
*more* available must be reported, by :meth:`Selector.update` for one worker (a task
ended there) or :meth:`Selector.invalidate` when it is not known which (a health
round); the parked workers are then checked again before the next selection.

Within a tier the worker with the fewest tasks in flight wins; ties go round robin,
with a cursor per tier (the last worker picked there), so equal workers share the
load evenly however many tiers were looked at first and however workers come and
go. When more than :data:`P2C_THRESHOLD` workers of a tier have room, two of them
are sampled and the lighter one wins (power of two choices): O(1) rather than exact.

Workers are not all alike, and "fewest tasks" is then refined into a *cost* of one
more task on the worker, lowest wins:

* with latency-aware choice on, ``estimate * (1 + (in_flight + 1) / (capacity *
  share))``, where ``estimate`` is the worker's peak-EWMA latency (see
  :mod:`npu_sync.latency`) and ``capacity`` its current ``max_concurrent`` (its
  adaptive limit when on). Workers run their tasks in parallel, up to their capacity,
  so a worker's latency does not grow with its load until it is full: the next task
  takes about the estimate wherever it goes, and the fastest worker with room wins.
  The load term (at most 2 while the worker has room) decides between workers about
  as fast as each other, by how full each is for its share, and spreads a burst of
  selections made before any estimate moves. A worker 10x slower than one with room
  gets nothing from it; one 1.5x slower takes tasks once the faster is half full. A
  worker whose latency does grow with its load (it serves its tasks one after
  another, or queues them) shows it in its estimate, which takes a slower answer at
  once;
* otherwise ``(in_flight + 1) / share``: least connections weighted;

and its share is its ``weight`` times its slow start factor (see
:mod:`npu_sync.slowstart`), which ramps a worker back in service from a tenth of its
share to all of it. Under light load, when the winner is idle, costs alone would
give an idle ramping worker nothing until its ramp ends: it is then picked by chance,
with its factor as the probability. With every weight 1, no ramp under way and latency-aware choice
off, the plain count of tasks in flight is compared, as above. ``Worker.score`` holds
the part of the cost that changes only when an answer or a ramp step comes: the
estimate (in the time-free form below), or ``1 / share``.

A slow answer's peak is held for ``peak_hold`` seconds (1 s by default) after the
worker's last answer; then, if it has nothing in flight, its estimate relaxes to its
typical latency, or its tier's while it has few answers of its own, but never below
the lower median of its tier's estimates (see :meth:`PeakEwma.relax
<npu_sync.latency.PeakEwma.relax>` and :meth:`Selector._relaxed`). A worker that
paused is back in use a second after its late answers came, in every process, rather
than once the decay has worn its peak down; one slower in steady state keeps its cost.
Due relaxations are kept in a heap and looked at with one comparison per selection.

A worker that has tasks in flight and has answered none of them for longer than its
estimate (it froze, or its network did) is taken to be at least as slow as the time
it has been quiet: its cost grows with that time, so new tasks avoid it well before
the attempts already there time out. Scores are compared without a clock read or an
``exp()`` per worker: estimates are kept in the time-free form of
:meth:`PeakEwma.key <npu_sync.latency.PeakEwma.key>`.

The pool tells the selector what it learns: :meth:`Selector.observe` when an attempt
ends, :meth:`Selector.recovered` when a worker comes back into service (a breaker
closes after a trip, a health check passes again). A worker added to a running pool
(by :meth:`Selector.set_workers`) is seeded and ramped in by itself.

That is the ``least-loaded`` strategy, the default. ``balancing.strategy`` may choose
another way to pick within a tier (tiers always come first):

* ``round-robin``: each worker with room in turn, whatever its load, latency or weight;
* ``weighted``: tasks in proportion to each worker's share (weight times slow start):
  smooth weighted round robin (nginx's), whatever the load or latency; a worker of
  weight 3 gets three tasks for every one of a worker of weight 1, spread out;
* ``priority``: the first worker with room in configuration order: fill one worker up
  to its capacity before the next gets any;
* ``weighted-random`` (AutoBot's name): a random worker with room, each drawn with
  probability proportional to its share (weight times slow start);
* ``priority-failover`` (AutoBot's name): only the single most preferred live worker
  (first tier, then configuration order) gets tasks; while it is busy a task waits for
  it. The next one is used only when it is down (disabled, draining, unhealthy, breaker
  open) or already failed this task.

These scan the tier's workers with room on every selection (no sampling).

The index also answers whether a task could still get a worker before its deadline
(:meth:`Selector.can_serve_before`), so that a task fails at once rather than wait
for nothing.
"""

from __future__ import annotations

import heapq
import random
from bisect import bisect_left, insort
from collections.abc import Callable, Collection, Iterable
from itertools import groupby

from npu_sync.breaker import CLOSED
from npu_sync.config import STRATEGIES
from npu_sync.latency import DEFAULT_DECAY, DEFAULT_HOLD, MIN_COST
from npu_sync.outage import down_reason, held_until
from npu_sync.slowstart import SlowStart
from npu_sync.worker import Worker

P2C_THRESHOLD = 64
"""When more workers than this have room in a tier, two are sampled rather than all scanned."""

_P2C_MISSES = 8
"""Samples that hit a worker the task already tried before the tier is scanned instead."""

# Where a worker is in the index.
_READY = 0  # in its tier's ready list: believed to have room
_FULL = 1  # in_flight >= capacity: looked at again when one of its tasks ends
_TIMED = 2  # unavailable until ``wake``: looked at again then
_BLOCKED = 3  # unavailable until told otherwise

_NEVER = float("inf")
_NOW = float("-inf")

_REBASE = 50.0
"""Decay constants after which the keys' epoch moves forward (keys grow by e**50)."""

_RAMP_STEPS = 100
"""How many times a slow start's factor is refreshed over its window."""

_STALL_RESCANS = 4
"""Stalled winners one selection may pass over before it takes the cheapest anyway."""


class _Tier:
    __slots__ = ("alone", "keys", "last", "observed", "ready", "turn")

    def __init__(self) -> None:
        # The workers with room, in configuration order, and their slots' seq: the
        # order stays the same however workers leave and come back.
        self.ready: list[Worker] = []
        self.keys: list[int] = []
        # Round robin by identity: the next scan starts at the first worker after the
        # last one picked, which stays the same as others enter and leave the list.
        self.last: Worker | None = None
        self.turn = 0  # how many keys are <= the last picked worker's seq
        # Whether some worker here has had an answer: until then every estimate is
        # unknown, and the first answer seeds the others (see Selector.observe).
        self.observed = False
        # One worker only: its score is never compared, so an answer need not rekey it
        # (every change of the tiers' members rekeys every worker).
        self.alone = False


class _Slot:
    """One worker's place in the index."""

    __slots__ = (
        "breaker_until",
        "cooldown_until",
        "doom",
        "seq",
        "state",
        "tier",
        "wake",
        "worker",
    )

    def __init__(self, worker: Worker, tier: _Tier, seq: int) -> None:
        self.worker = worker
        self.tier = tier
        self.seq = seq
        self.state = _BLOCKED
        self.wake = 0.0  # while _TIMED
        # Until when the worker cannot take a task whatever happens meanwhile: _NOW
        # when it may at any moment, _NEVER when disabled or draining.
        self.doom = _NOW
        self.breaker_until = _NOW
        self.cooldown_until = _NOW


class Selector:
    """Picks a worker for an attempt.

    Not thread-safe: the pool calls it under its selection lock.

    Args:
        workers: the candidates.
        rng: randomness for sampling large tiers.
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
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        self._strategy = strategy
        self._rng = rng or random.Random()
        self._random = self._rng.random
        self._shared_breakers = shared_breakers
        if not decay > 0:
            raise ValueError(f"decay must be > 0 seconds, got {decay!r}")
        self._latency_aware = latency_aware
        self._decay = decay
        self._hold = peak_hold
        # Workers whose estimate may relax, by when: see _relax.
        self._holds: list[tuple[float, int, Worker]] = []
        self._held: set[Worker] = set()
        self._hold_due = _NEVER
        self._slow_start = slow_start or SlowStart(window=0.0)
        self._epoch = now
        self._rebase_at = now + _REBASE * decay
        self._ramping: list[Worker] = []
        # Workers whose breaker admitted a trial when last placed (closed ones are
        # dropped as they are met): under light load one of them takes the next task.
        self._trials: set[Worker] = set()
        self._ramp_due = _NEVER
        self._scored = False  # whether scores, not plain in-flight counts, are compared
        self.on_earlier_wake: Callable[[], None] | None = None
        """Called when a parked worker's wake time becomes the earliest of all."""
        self.tiers: tuple[tuple[Worker, ...], ...] = ()
        self.workers: tuple[Worker, ...] = ()
        self._tiers: tuple[_Tier, ...] = ()
        self._slots: dict[Worker, _Slot] = {}
        self._by_id: dict[str, _Slot] = {}
        # Parked slots, as ordered sets: full ones, and timed or blocked ones.
        self._full: dict[_Slot, None] = {}
        self._others: dict[_Slot, None] = {}
        self.parked: dict[Worker, _Slot] = {}
        """Every worker not in a ready list: only these need :meth:`update`."""
        self._timed: list[tuple[float, int, _Slot]] = []  # heap; stale entries skipped
        # When the index must be looked at before a selection: the heap's first time,
        # or _NOW once invalidate() was called. One comparison on every selection.
        self._due = _NEVER
        self._pushes = 0
        self._doomed: list[tuple[float, int, _Slot]] = []  # sorted by doom
        self._hopeful = 0  # slots whose doom is _NOW
        self._ready = 0  # slots in a ready list
        self._stale = False
        self.set_workers(workers, now)

    # -- configuration -----------------------------------------------------------------

    @property
    def shared_breakers(self) -> bool:
        return self._shared_breakers

    @shared_breakers.setter
    def shared_breakers(self, value: bool) -> None:
        self._shared_breakers = value
        # What an open breaker means for the deadline changed: examine every parked
        # worker again (full ones included, which a refresh otherwise mostly skips).
        for slot in list(self._full):
            self._move(slot, _BLOCKED, 0.0)
        self.invalidate()

    @property
    def latency_aware(self) -> bool:
        return self._latency_aware

    @property
    def slow_start(self) -> SlowStart:
        return self._slow_start

    @property
    def strategy(self) -> str:
        return self._strategy

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
            self._hold = peak_hold
        if not decay > 0:
            raise ValueError(f"decay must be > 0 seconds, got {decay!r}")
        if strategy is not None:
            if strategy not in STRATEGIES:
                raise ValueError(
                    f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}"
                )
            self._strategy = strategy
        self._latency_aware = latency_aware
        self._decay = decay
        self._slow_start = slow_start or SlowStart(window=0.0)
        for worker in self.workers:
            worker.latency.decay = decay
            if not latency_aware:
                worker.stall_after = _NEVER
        self._epoch = now
        self._rebase_at = now + _REBASE * decay
        self._refresh_ramps(now, everyone=True)

    def set_workers(self, workers: Iterable[Worker], now: float | None = None) -> None:
        """Replace the candidate set; lower ``priority`` numbers form earlier tiers.

        Given ``now``, workers that were not candidates before are ramped in (slow
        start) and seeded with their tier's median latency, unless there were no
        candidates before (a pool starting: every worker starts together).
        """
        workers = list(workers)
        previous = self._slots
        added = [w for w in workers if w not in previous] if previous and now is not None else []
        ordered = sorted(workers, key=lambda w: w.priority)
        self.workers = tuple(ordered)
        self.tiers = tuple(tuple(tier) for _, tier in groupby(ordered, key=lambda w: w.priority))
        self._tiers = tuple(_Tier() for _ in self.tiers)
        self._slots = {}
        self._by_id = {}
        self._full = {}
        self._others = {}
        self.parked.clear()  # the same dict: callers may keep a reference to it
        self._timed = []
        self._due = _NEVER
        self._doomed = []
        self._ready = 0
        seq = 0
        for tier, members in zip(self._tiers, self.tiers, strict=True):
            for worker in members:
                slot = _Slot(worker, tier, seq)
                seq += 1
                self._slots[worker] = slot
                self._by_id[worker.id] = slot
                self._others[slot] = None  # classified on first use, at that moment
                self.parked[worker] = slot
        for tier, members in zip(self._tiers, self.tiers, strict=True):
            tier.observed = any(w.latency.observed for w in members)
            tier.alone = len(members) == 1
        self._hopeful = seq
        self._stale = bool(seq)
        self._sync_due()
        for worker in self.workers:
            worker.latency.decay = self._decay
            if not self._latency_aware:
                worker.stall_after = _NEVER
        for worker in added:
            self._seed(worker, now)  # type: ignore[arg-type]  # added only when now is given
            self._start_ramp(worker, now)  # type: ignore[arg-type]
        self._ramping = [w for w in self.workers if w.ramp_until > _NOW]
        self._refresh_ramps(self._epoch if now is None else now, everyone=True)

    # -- what the pool learns ----------------------------------------------------------

    def observe(self, worker: Worker, rtt: float, now: float, ok: bool = True) -> None:
        """An attempt on ``worker`` ended at ``now`` after ``rtt`` seconds.

        Call for every attempt the worker answered or failed (``ok`` False unless it
        succeeded: only a success may lower the estimate), not for leases given back
        unused. Also marks the worker as making progress (see the stall rule).
        """
        latency = worker.latency
        latency.observe(rtt, now, ok)
        worker.busy_since = now
        if self._latency_aware:
            if self._hold and worker not in self._held:
                self._hold_until(worker, now + self._hold)
            # The estimate as of its stamp, now but for clock reads a hair apart.
            worker.stall_after = now + latency.cost
            slot = self._slots.get(worker)
            if slot is None:
                self._rekey(worker, now)
                return
            tier = slot.tier
            if not tier.alone:
                self._rekey(worker, now)
            if latency.observed and not tier.observed:
                tier.observed = True
                self._seed_unknown(worker, latency.cost, now)

    def _seed_unknown(self, first: Worker, cost: float, now: float) -> None:
        """The first answer in ``first``'s tier took ``cost``: give it as an estimate to
        the tier's workers that have none yet. Left at nothing, they would look free
        and take every task up to their capacity (the load term is at most 2) until
        their silence grew past the others' latency. Once per tier."""
        for worker in self.workers:
            if (
                worker is not first
                and worker.priority == first.priority
                and not worker.latency.observed
                and worker.latency.value(now) < cost
            ):
                worker.latency.seed(cost, now)
                worker.stall_after = worker.busy_since + cost
                self._rekey(worker, now)

    def started(self, worker: Worker, now: float) -> None:
        """``worker`` just got its first task in flight (it was idle)."""
        if self._latency_aware:
            worker.busy_since = now
            # The estimate as last set, not decayed to now: no exp() on every idle
            # worker's first task, at the price of noticing a stall a little later.
            worker.stall_after = now + worker.latency.cost

    def recovered(self, worker: Worker, now: float) -> None:
        """``worker`` is back in service: its breaker closed after a trip, its health
        check passes again, or it moved to a new address. Its latency estimate starts
        again from its tier's median and its share ramps up (slow start)."""
        if worker in self._slots:
            self._seed(worker, now)
            self._start_ramp(worker, now)
            self._refresh_ramps(now)

    def slow_start_until(self, worker: Worker, now: float) -> float | None:
        """When ``worker``'s slow start ends, or None if none is under way at ``now``."""
        return worker.ramp_until if worker.ramp_until > now else None

    def stats(self, now: float) -> dict[str, object]:
        """The balancing settings and the ramps under way: JSON-serialisable.

        ``{"strategy", "latency_aware", "latency_decay", "slow_start", "ramping"}``, where
        ``ramping`` maps each ramping worker's id to the seconds its ramp has left.
        """
        return {
            "strategy": self._strategy,
            "latency_aware": self._latency_aware,
            "latency_decay": self._decay,
            "slow_start": self._slow_start.window,
            "ramping": {w.id: w.ramp_until - now for w in self._ramping if w.ramp_until > now},
        }

    # -- what changed ------------------------------------------------------------------

    def update(self, worker: Worker, now: float) -> None:
        """Look at ``worker`` again: a task of its ended, or its state changed."""
        slot = self.parked.get(worker)
        if slot is not None:
            self._classify(slot, now)

    def taken(self, worker: Worker, now: float) -> None:
        """``worker`` was just given a task that filled it or is its breaker's trial."""
        slot = self._slots.get(worker)
        if slot is not None:
            self._classify(slot, now)

    def invalidate(self) -> None:
        """Some workers may have become available, which ones is not known (a health
        round, a breaker closed elsewhere): look at every parked worker again."""
        if self._full or self._others:
            self._stale = True
            self._due = _NOW

    # -- selection ---------------------------------------------------------------------

    def may_have_room(self, now: float) -> bool:
        """False when :meth:`select` would certainly return None, whatever the exclusions."""
        return bool(self._ready) or now >= self._due

    def has_room(self, now: float) -> bool:
        """Like :meth:`may_have_room`, but first looks again at the parked workers that
        may have changed, so that it is False after an :meth:`invalidate` that found
        every worker still full. Call under the pool's lock."""
        if now >= self._due:
            self._catch_up(now)
        return bool(self._ready) or now >= self._due

    def select(self, excluded: Collection[str], now: float) -> Worker | None:
        """The best eligible worker not in ``excluded``, or None.

        A lower tier is used only when no worker of a higher tier is eligible.
        """
        if now >= self._due:
            self._catch_up(now)
        if self._strategy != "least-loaded":
            return self._select_other(excluded, now)
        if self._scored:
            if now >= self._ramp_due:
                self._refresh_ramps(now)
            if now > self._rebase_at:
                self._rebase(now)
            if now >= self._hold_due:
                self._relax(now)
            scan = self._scan_scores
        else:
            scan = self._scan
        for tier in self._tiers:
            ready = tier.ready
            if ready:
                chosen = (
                    scan(tier, excluded, now)
                    if len(ready) <= P2C_THRESHOLD
                    else self._sample(tier, excluded, now)
                )
                if chosen is not None:
                    return chosen
        return None

    def _select_other(self, excluded: Collection[str], now: float) -> Worker | None:
        """:meth:`select` for the strategies other than least-loaded."""
        if now >= self._ramp_due:
            self._refresh_ramps(now)
        if self._strategy == "priority-failover":
            return self._failover(excluded, now)
        pick = {"weighted": self._weighted, "weighted-random": self._weighted_random}.get(
            self._strategy, self._first
        )
        for tier in self._tiers:
            if tier.ready:
                chosen = pick(tier, excluded, now)
                if chosen is not None:
                    return chosen
        return None

    def _first(self, tier: _Tier, excluded: Collection[str], now: float) -> Worker | None:
        """The first eligible worker with room: after the last one picked (round-robin)
        or in configuration order (priority)."""
        rotate = self._strategy == "round-robin"
        while True:
            ready = tier.ready
            n = len(ready)
            start = tier.turn % n if rotate and n else 0
            for i in range(start, start + n):
                worker = ready[i % n]
                if worker.id in excluded:
                    continue
                if worker.eligible(now):
                    tier.turn = i % n + 1
                    tier.last = worker
                    return worker
                self._classify(self._slots[worker], now)  # leaves the ready list
                break  # the list changed: start again
            else:
                return None

    def _failover(self, excluded: Collection[str], now: float) -> Worker | None:
        """The most preferred live worker not yet tried, if it can take a task now;
        else None (the task waits for it): busy is not down."""
        for worker in self.workers:
            if worker.id in excluded or down_reason(worker, now) is not None:
                continue
            if not worker.eligible(now):
                return None
            slot = self._slots[worker]
            if slot.state != _READY:
                self._classify(slot, now)  # parked before it had room again
            return worker if slot.state == _READY else None
        return None

    def _weighted_random(self, tier: _Tier, excluded: Collection[str], now: float) -> Worker | None:
        """A random worker with room, drawn in proportion to its share."""
        while True:
            candidates = [w for w in tier.ready if w.id not in excluded]
            if not candidates:
                return None
            point = self._random() * sum(w.share for w in candidates)
            chosen = candidates[-1]
            for worker in candidates:
                point -= worker.share
                if point < 0:
                    chosen = worker
                    break
            if chosen.eligible(now):
                return chosen
            self._classify(self._slots[chosen], now)  # leaves the ready list

    def _weighted(self, tier: _Tier, excluded: Collection[str], now: float) -> Worker | None:
        """Smooth weighted round robin over the tier's workers with room: each gains
        its share, the richest is picked and pays the total."""
        while True:
            candidates = [w for w in tier.ready if w.id not in excluded]
            if not candidates:
                return None
            total = 0.0
            best = candidates[0]
            for worker in candidates:
                worker.wrr += worker.share
                total += worker.share
                if worker.wrr > best.wrr:
                    best = worker
            if best.eligible(now):
                best.wrr -= total
                return best
            for worker in candidates:
                worker.wrr -= worker.share  # this round did not happen
            self._classify(self._slots[best], now)  # leaves the ready list

    def _scan(self, tier: _Tier, excluded: Collection[str], now: float) -> Worker | None:
        ready = tier.ready
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
        if best is not None:
            tier.turn = best_at % n + 1
            tier.last = best
        if unavailable is not None:
            slots = self._slots
            for worker in unavailable:
                self._classify(slots[worker], now)
        return best

    def _scan_scores(self, tier: _Tier, excluded: Collection[str], now: float) -> Worker | None:
        """:meth:`_scan` comparing costs (:meth:`_cost`), with the stall rule.

        Costs differ far more often than counts tie, so a new best is met at many
        steps of the scan: its eligibility is checked once, at the end (the index
        keeps ready workers eligible but for changes it was not told of). So is the
        stall rule: it can only raise a score, so it matters only for the winner.
        """
        stalls = 0
        passed: Worker | None = None  # the last stalled winner, its score raised
        while True:
            ready = tier.ready
            n = len(ready)
            if not n:
                return None
            start = tier.turn % n
            best: Worker | None = None
            best_load = 0.0
            order = ready[start:] + ready[:start] if start else ready
            if self._latency_aware:
                # The cost of :meth:`_cost`, inlined: this loop is the hot path.
                for worker in order:
                    load = worker.score * (
                        1.0 + (worker.in_flight + 1) / (worker.capacity * worker.share)
                    )
                    if (best is None or load < best_load) and worker.id not in excluded:
                        best = worker
                        best_load = load
            else:
                for worker in order:
                    load = (worker.in_flight + 1) * worker.score
                    if (best is None or load < best_load) and worker.id not in excluded:
                        best = worker
                        best_load = load
            if best is None:
                return None
            if not best.eligible(now):
                self._classify(self._slots[best], now)  # leaves the ready list
            elif (
                now > best.stall_after
                and best.in_flight
                and best is not passed
                and stalls < _STALL_RESCANS
            ):
                self._stalled(best, now)
                passed = best
                stalls += 1
            else:
                if not best.in_flight:
                    if self._trials:
                        best = self._trial_turn(tier, excluded, best, now)
                    if self._ramping and best.breaker.state == CLOSED:
                        best = self._ramp_turn(tier, excluded, best, now)
                tier.turn = ready.index(best) + 1
                tier.last = best
                return best

    def _trial_turn(
        self, tier: _Tier, excluded: Collection[str], best: Worker, now: float
    ) -> Worker:
        """Under light load (the winner is idle), a worker whose breaker admits its
        trial now takes the task: on costs alone (its estimate from before it failed,
        its capacity a single trial) it would lose to every idle worker, and a caller
        sending one task at a time would leave it out of service indefinitely."""
        slots = self._slots
        for worker in list(self._trials):
            slot = slots.get(worker)
            if slot is None or worker.breaker.state == CLOSED:
                self._trials.discard(worker)  # closed (or removed) since it was noted
            elif (
                worker is not best
                and slot.tier is tier
                and slot.state == _READY
                and worker.id not in excluded
                and worker.eligible(now)
            ):
                return worker
        return best

    def _ramp_turn(
        self, tier: _Tier, excluded: Collection[str], best: Worker, now: float
    ) -> Worker:
        """Under light load (the winner is idle), give an idle ramping worker its share
        by chance: with scores alone it would lose every selection while the others
        are idle, and a caller sending one task at a time would never reach it before
        its ramp ends. Under load, scores alone ramp it."""
        for worker in self._ramping:
            if (
                worker is not best
                and not worker.in_flight
                and self._slots[worker].tier is tier
                and self._slots[worker].state == _READY
                and worker.id not in excluded
                and self._random() * worker.weight < worker.share
                and worker.eligible(now)
            ):
                return worker
        return best

    def _stalled(self, worker: Worker, now: float) -> None:
        """``worker`` has had tasks in flight and no answer for longer than its estimate:
        it is at least as slow as that silence, until it answers."""
        worker.latency.raise_to(now - worker.busy_since, now)
        self._rekey(worker, now)
        if self._hold and worker not in self._held:
            self._hold_until(worker, now + self._hold)

    def _hold_until(self, worker: Worker, when: float) -> None:
        self._held.add(worker)
        heapq.heappush(self._holds, (when, id(worker), worker))
        if when < self._hold_due:
            self._hold_due = when

    def _relax(self, now: float) -> None:
        """Relax the estimates whose hold ended (see :meth:`PeakEwma.relax
        <npu_sync.latency.PeakEwma.relax>`): of idle workers not heard from for
        ``peak_hold`` seconds. A worker heard from since waits again; a busy one is
        looked at again when it answers, or when the stall rule raises it."""
        holds = self._holds
        hold = self._hold
        while holds and holds[0][0] <= now:
            _, _, worker = heapq.heappop(holds)
            self._held.discard(worker)
            if worker not in self._slots or not hold:
                continue
            due = worker.latency.stamp + hold
            if due > now:
                self._hold_until(worker, due)
            elif not worker.in_flight:
                target = self._relaxed(worker, now)
                if target is not None and worker.latency.relax(now, target):
                    self._rekey(worker, now)
        self._hold_due = holds[0][0] if holds else _NEVER

    def _relaxed(self, worker: Worker, now: float) -> float | None:
        """What ``worker``'s estimate relaxes to: its typical latency (its tier's median
        one while it has too few answers of its own), but never below the lower median
        of its tier's estimates now. A worker back from a pause looks like its peers,
        not cheaper than all of them: every process relaxes it at about the same
        moment, and a worker cheaper than all would draw every process's tasks at once.
        Scans the workers: called once per hold of an idle worker, not per task."""
        members = self._slots[worker].tier
        peers = [w for w in self.workers if self._slots[w].tier is members and w is not worker]
        if worker.latency.known:
            typical = worker.latency.typical()
        else:
            known = sorted(
                t for w in peers if w.latency.known and (t := w.latency.typical()) is not None
            )
            typical = known[len(known) // 2] if known else worker.latency.typical()
        if typical is None:
            return None
        now_values = sorted(w.latency.value(now) for w in peers if w.latency.observed)
        if now_values:
            # The lower median: with two peers, the cheaper one's (then the load term
            # shares tasks between them as least connections would).
            typical = max(typical, now_values[(len(now_values) - 1) // 2])
        return typical

    def _sample(self, tier: _Tier, excluded: Collection[str], now: float) -> Worker | None:
        ready = tier.ready
        rnd = self._random
        first: Worker | None = None
        misses = 0
        while misses < _P2C_MISSES:
            n = len(ready)
            if n <= P2C_THRESHOLD:
                return (
                    self._scan_scores(tier, excluded, now)
                    if self._scored
                    else self._scan(tier, excluded, now)
                )
            worker = ready[int(rnd() * n)]
            if worker is first or worker.id in excluded:
                misses += 1
            elif not worker.eligible(now):
                self._classify(self._slots[worker], now)  # leaves the ready list
            elif first is None:
                first = worker
            elif self._scored:
                for one in (first, worker):
                    if now > one.stall_after and one.in_flight:
                        self._stalled(one, now)
                return first if self._cost(first) <= self._cost(worker) else worker
            else:
                return first if first.in_flight <= worker.in_flight else worker
        if first is not None:
            return first
        # The task has tried much of what is left here: look at every worker with room
        # (few, or the samples would not have kept missing).
        return (
            self._scan_scores(tier, excluded, now)
            if self._scored
            else self._scan(tier, excluded, now)
        )

    # -- scores ------------------------------------------------------------------------

    def _rekey(self, worker: Worker, now: float) -> None:
        """Compute ``worker.score`` from its share and, when latency counts, its estimate."""
        if self._latency_aware:
            if worker.latency.stamp > self._rebase_at:
                self._rebase(max(now, worker.latency.stamp))
                return  # _rebase rekeyed every worker
            key = worker.latency.key(self._epoch)
            # An estimate decayed to nothing still weighs in-flight counts.
            worker.score = key if key > MIN_COST else MIN_COST
        else:
            worker.score = 1.0 / worker.share

    def _cost(self, worker: Worker) -> float:
        """What one more task on ``worker`` costs; the lowest wins.

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
        if self._latency_aware:
            return worker.score * (1.0 + (worker.in_flight + 1) / (worker.capacity * worker.share))
        return (worker.in_flight + 1) * worker.score

    def _rebase(self, now: float) -> None:
        """Move the keys' epoch to ``now`` so that they stay finite, and rekey all."""
        self._epoch = now
        self._rebase_at = now + _REBASE * self._decay
        for worker in self.workers:
            self._rekey(worker, now)

    def _seed(self, worker: Worker, now: float) -> None:
        """Start ``worker``'s estimate from the median of its tier's observed ones."""
        peers = sorted(
            w.latency.value(now)
            for w in self.workers
            if w.priority == worker.priority and w is not worker and w.latency.observed
        )
        seed = peers[len(peers) // 2] if peers else worker.latency.value(now)
        worker.latency.seed(seed, now)
        if self._latency_aware:
            worker.busy_since = now
            worker.stall_after = now + seed

    def _start_ramp(self, worker: Worker, now: float) -> None:
        slow_start = self._slow_start
        if slow_start.enabled:
            worker.ramp_from = now
            worker.ramp_until = slow_start.ends(now)
            if worker not in self._ramping:
                self._ramping.append(worker)
        else:
            self._rekey(worker, now)

    def _refresh_ramps(self, now: float, everyone: bool = False) -> None:
        """Give every ramping worker its share at ``now`` and forget finished ramps;
        with ``everyone``, recompute every worker's share and score (new weights, new
        settings, a new candidate set)."""
        slow_start = self._slow_start
        still: list[Worker] = []
        for worker in self._ramping:
            if worker.ramp_until > now and worker in self._slots:
                worker.share = worker.weight * slow_start.factor(worker.ramp_from, now)
                still.append(worker)
            else:
                worker.share = float(worker.weight)
                worker.ramp_until = -_NEVER
            if not everyone:
                self._rekey(worker, now)
        self._ramping = still
        if everyone:
            for worker in self.workers:
                if worker.ramp_until <= now:
                    worker.share = float(worker.weight)
                self._rekey(worker, now)
        self._ramp_due = now + max(slow_start.window / _RAMP_STEPS, 1e-3) if still else _NEVER
        self._scored = (
            self._latency_aware or bool(still) or any(w.weight != 1 for w in self.workers)
        )

    # -- whether waiting can help ------------------------------------------------------

    def next_wake(self) -> float | None:
        """When the earliest timed worker is due to be looked at again, if any."""
        self._drop_stale_top()
        timed = self._timed
        return timed[0][0] if timed else None

    def can_serve_before(self, excluded: Collection[str], deadline: float, now: float) -> bool:
        """Whether some worker not in ``excluded`` may take a task before ``deadline``.

        A worker may not when disabled or draining, in a Retry-After cool-down that
        ends at or after ``deadline``, or when its breaker opens until then and cannot
        be cut short: it already had the early trial a passing health check grants
        (and breakers are not shared with other processes). Errs on the side of True.
        """
        if self._stale:
            self._catch_up(now)
        hopeful = self._hopeful
        if hopeful > len(excluded):
            return True
        if hopeful:
            by_id = self._by_id
            for worker_id in excluded if isinstance(excluded, set | frozenset) else set(excluded):
                slot = by_id.get(worker_id)
                if slot is not None and slot.doom == _NOW:
                    hopeful -= 1
            if hopeful > 0:
                return True
        for doom, _, slot in self._doomed:
            if doom >= deadline:
                break
            if slot.worker.id not in excluded:
                return True
        return False

    def held_past(self, excluded: Collection[str], deadline: float) -> tuple[bool, bool]:
        """Whether open breakers, and whether cool-downs, keep some worker not in
        ``excluded`` unavailable until ``deadline`` or later."""
        breakers = cooldowns = False
        doomed = self._doomed
        for i in range(bisect_left(doomed, (deadline,)), len(doomed)):
            slot = doomed[i][2]
            if slot.worker.id not in excluded:
                breakers = breakers or slot.breaker_until >= deadline
                cooldowns = cooldowns or slot.cooldown_until >= deadline
        return breakers, cooldowns

    # -- the index ---------------------------------------------------------------------

    def _catch_up(self, now: float) -> None:
        """Look again at the parked workers that may have changed: all of them after an
        :meth:`invalidate`, and the timed ones whose time has come."""
        if self._stale:
            self._stale = False
            # A full worker whose tasks did not end is still full; only a doomed one
            # may have changed in a way that matters (a breaker closed elsewhere), or
            # one gone down meanwhile (unhealthy, refusing the credentials), which
            # waiters must stop hoping for.
            recheck = [
                slot
                for slot in self._full
                if (w := slot.worker).in_flight < w.capacity
                or slot.doom != _NOW
                or not w.healthy
                or w.health.hinted_draining
                or w.refused_until > now
            ]
            recheck += self._others
            for slot in recheck:
                self._classify(slot, now)
        timed = self._timed
        while timed and timed[0][0] <= now:
            wake, _, slot = heapq.heappop(timed)
            if slot.state == _TIMED and slot.wake == wake:
                self._classify(slot, now)
        self._sync_due()

    def _sync_due(self) -> None:
        timed = self._timed
        self._due = _NOW if self._stale else timed[0][0] if timed else _NEVER

    def _drop_stale_top(self) -> None:
        timed = self._timed
        while timed:
            wake, _, slot = timed[0]
            if slot.state == _TIMED and slot.wake == wake:
                break
            heapq.heappop(timed)
        self._sync_due()

    def _classify(self, slot: _Slot, now: float) -> None:
        """Put ``slot`` where its worker's state says, as of ``now``."""
        worker = slot.worker
        breaker = worker.breaker
        retry = breaker.retry_at()
        cooldown = worker.cooldown_until
        # Whether waiting can help: see npu_sync.outage.
        doom, breaker_until, cooldown_until = held_until(
            worker, now, shared_breakers=self._shared_breakers
        )
        slot.breaker_until = breaker_until
        slot.cooldown_until = cooldown_until
        wake = 0.0
        if worker.eligible(now):
            state = _READY
            if breaker.state != CLOSED:
                self._trials.add(worker)  # its trial is due: see _trial_turn
        elif doom == _NEVER:
            state = _BLOCKED
        elif worker.in_flight >= worker.capacity:
            state = _FULL
        elif cooldown > now or worker.refused_until > now:
            state, wake = _TIMED, max(cooldown, worker.refused_until)
        elif retry is not None and retry > now:
            state, wake = _TIMED, retry
        else:
            state = _BLOCKED  # a half-open breaker with its trial in flight
        self._move(slot, state, wake)
        if doom != slot.doom:
            self._set_doom(slot, doom)

    def _move(self, slot: _Slot, state: int, wake: float) -> None:
        old = slot.state
        if old == state and (state != _TIMED or slot.wake == wake):
            return
        if old == _READY:
            self._unlist(slot)
            self.parked[slot.worker] = slot
        elif old == _FULL:
            del self._full[slot]
        else:
            del self._others[slot]
        slot.state = state
        if state == _READY:
            del self.parked[slot.worker]
            tier = slot.tier
            at = bisect_left(tier.keys, slot.seq)
            tier.keys.insert(at, slot.seq)
            tier.ready.insert(at, slot.worker)
            if tier.last is not None and slot.seq <= self._slots[tier.last].seq:
                tier.turn += 1
            self._ready += 1
        elif state == _FULL:
            self._full[slot] = None
        else:
            self._others[slot] = None
            if state == _TIMED:
                slot.wake = wake
                self._push(wake, slot)

    def _unlist(self, slot: _Slot) -> None:
        tier = slot.tier
        at = bisect_left(tier.keys, slot.seq)
        del tier.keys[at]
        del tier.ready[at]
        if tier.last is not None and slot.seq <= self._slots[tier.last].seq:
            tier.turn -= 1
        self._ready -= 1

    def _push(self, wake: float, slot: _Slot) -> None:
        self._drop_stale_top()
        timed = self._timed
        earlier = not timed or wake < timed[0][0]
        if len(timed) > 2 * len(self._slots) + 64:
            # Stale entries pile up when workers flip often: keep the heap bounded.
            timed[:] = [e for e in timed if e[2].state == _TIMED and e[2].wake == e[0]]
            heapq.heapify(timed)
        self._pushes += 1
        heapq.heappush(timed, (wake, self._pushes, slot))
        self._sync_due()
        if earlier and self.on_earlier_wake is not None:
            self.on_earlier_wake()

    def _set_doom(self, slot: _Slot, doom: float) -> None:
        old = slot.doom
        if old == _NOW:
            self._hopeful -= 1
        elif old != _NEVER:
            doomed = self._doomed
            del doomed[bisect_left(doomed, (old, slot.seq))]
        slot.doom = doom
        if doom == _NOW:
            self._hopeful += 1
        elif doom != _NEVER:
            insort(self._doomed, (doom, slot.seq, slot))
