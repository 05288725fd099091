"""Which worker gets the next attempt: priority tier first, then least connections.

Selection runs under the pool's lock on every attempt, so its cost must not grow with
the pool, whatever state the pool is in: idle, busy, saturated or mostly down. The
selector keeps an index for that. Per tier, a list of the workers that have room
("ready"); every other worker is parked: *full* until one of its tasks ends, *timed*
until a known moment (its breaker's trial, the end of a Retry-After cool-down), or
*blocked* (unhealthy, disabled, draining, reporting a failure, its trial in flight)
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


class _Tier:
    __slots__ = ("keys", "last", "ready", "turn")

    def __init__(self) -> None:
        # The workers with room, in configuration order, and their slots' seq: the
        # order stays the same however workers leave and come back.
        self.ready: list[Worker] = []
        self.keys: list[int] = []
        # Round robin by identity: the next scan starts at the first worker after the
        # last one picked, which stays the same as others enter and leave the list.
        self.last: Worker | None = None
        self.turn = 0  # how many keys are <= the last picked worker's seq


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
    """

    def __init__(
        self,
        workers: Iterable[Worker] = (),
        *,
        rng: random.Random | None = None,
        shared_breakers: bool = False,
    ) -> None:
        self._rng = rng or random.Random()
        self._random = self._rng.random
        self._shared_breakers = shared_breakers
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
        self.set_workers(workers)

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

    def set_workers(self, workers: Iterable[Worker]) -> None:
        """Replace the candidate set; lower ``priority`` numbers form earlier tiers."""
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
        self._hopeful = seq
        self._stale = bool(seq)
        self._sync_due()

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

    def select(self, excluded: Collection[str], now: float) -> Worker | None:
        """The best eligible worker not in ``excluded``, or None.

        A lower tier is used only when no worker of a higher tier is eligible.
        """
        if now >= self._due:
            self._catch_up(now)
        for tier in self._tiers:
            ready = tier.ready
            if ready:
                chosen = (
                    self._scan(tier, excluded, now)
                    if len(ready) <= P2C_THRESHOLD
                    else self._sample(tier, excluded, now)
                )
                if chosen is not None:
                    return chosen
        return None

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

    def _sample(self, tier: _Tier, excluded: Collection[str], now: float) -> Worker | None:
        ready = tier.ready
        rnd = self._random
        first: Worker | None = None
        misses = 0
        while misses < _P2C_MISSES:
            n = len(ready)
            if n <= P2C_THRESHOLD:
                return self._scan(tier, excluded, now)
            worker = ready[int(rnd() * n)]
            if worker is first or worker.id in excluded:
                misses += 1
            elif not worker.eligible(now):
                self._classify(self._slots[worker], now)  # leaves the ready list
            elif first is None:
                first = worker
            else:
                return first if first.in_flight <= worker.in_flight else worker
        if first is not None:
            return first
        # The task has tried much of what is left here: look at every worker with room
        # (few, or the samples would not have kept missing).
        return self._scan(tier, excluded, now)

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
            # may have changed in a way that matters (a breaker closed elsewhere).
            recheck = [
                slot
                for slot in self._full
                if slot.worker.in_flight < slot.worker.capacity or slot.doom != _NOW
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
        usable = worker.enabled and not worker.draining
        if not usable:
            doom = breaker_until = cooldown_until = _NEVER
        else:
            cooldown_until = cooldown if cooldown > now else _NOW
            breaker_until = (
                retry
                if retry is not None
                and retry > now
                and not self._shared_breakers
                and breaker.early_trial_used
                else _NOW
            )
            doom = max(cooldown_until, breaker_until)
        slot.breaker_until = breaker_until
        slot.cooldown_until = cooldown_until
        wake = 0.0
        if worker.eligible(now):
            state = _READY
        elif not usable or not worker.healthy or worker.hinted_draining or worker.reporting:
            state = _BLOCKED
        elif worker.in_flight >= worker.capacity:
            state = _FULL
        elif cooldown > now:
            state, wake = _TIMED, cooldown
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
