"""Which workers have room, per tier, without walking the workers.

Selection runs under the pool's lock on every attempt, so its cost must not grow with
the pool, whatever state the pool is in: idle, busy, saturated or mostly down. The
index keeps, per tier, a list of the workers that have room ("ready"); every other
worker is parked: *full* until one of its tasks ends, *timed* until a known moment
(its breaker's trial, the end of a Retry-After cool-down), or *blocked* (unhealthy,
disabled, draining, its trial in flight) until told that it changed. Saturated tiers
are skipped at a glance, and a tier with one free slot among a thousand workers is a
list of one.

The index learns of changes in two ways. Changes that make a worker *less* available
(a breaker trips, a cool-down begins, a health check fails) need no word: the worker
a strategy picks is checked again and parked (:meth:`Index.classify`) when found
unavailable. Changes that make one *more* available must be reported, by
:meth:`Index.update` for one worker (a task ended there) or :meth:`Index.invalidate`
when it is not known which (a health round); the parked workers are then checked
again before the next selection.

The index also answers whether a task could still get a worker before its deadline
(:meth:`Index.can_serve_before`, from each worker's *doom*: until when it cannot take
a task whatever happens meanwhile), so that a task fails at once rather than wait for
nothing.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Callable, Collection, Sequence

from npu_sync._balancing.slot import BLOCKED, FULL, NEVER, NOW, READY, TIMED, Slot, Tier
from npu_sync._breaker import CLOSED
from npu_sync._outage import held_until
from npu_sync._worker import Worker


class Index:
    """The tiers' ready lists, the parked workers, the wake heap and the doom list.

    Not thread-safe: the pool calls it under its selection lock.

    Args:
        shared_breakers: breakers follow other processes (shared state), so an open
            breaker may close at any time and never makes a worker unavailable until
            a known moment.
        on_trial: called with a slot found ready while its breaker is not closed (its
            trial is due).
    """

    __slots__ = (
        "_doomed",
        "_full",
        "_hopeful",
        "_others",
        "_pushes",
        "_ready",
        "_shared_breakers",
        "_stale",
        "_timed",
        "by_id",
        "due",
        "on_earlier_wake",
        "on_trial",
        "parked",
        "slots",
        "tiers",
    )

    def __init__(
        self,
        *,
        shared_breakers: bool = False,
        on_trial: Callable[[Slot], object] | None = None,
    ) -> None:
        self._shared_breakers = shared_breakers
        self.on_trial = on_trial
        self.on_earlier_wake: Callable[[], None] | None = None
        """Called when a parked worker's wake time becomes the earliest of all."""
        self.tiers: tuple[Tier, ...] = ()
        self.slots: dict[Worker, Slot] = {}
        self.by_id: dict[str, Slot] = {}
        # Parked slots, as ordered sets: full ones, and timed or blocked ones.
        self._full: dict[Slot, None] = {}
        self._others: dict[Slot, None] = {}
        self.parked: dict[Worker, Slot] = {}
        """Every worker not in a ready list: only these need :meth:`update`."""
        self._timed: list[tuple[float, int, Slot]] = []  # heap; stale entries skipped
        # When the index must be looked at before a selection: the heap's first time,
        # or NOW once invalidate() was called. One comparison on every selection.
        self.due = NEVER
        self._pushes = 0
        self._doomed: list[tuple[float, int, Slot]] = []  # sorted by doom
        self._hopeful = 0  # slots whose doom is NOW
        self._ready = 0  # slots in a ready list
        self._stale = False

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
            self._move(slot, BLOCKED, 0.0)
        self.invalidate()

    def rebuild(self, tiers: Sequence[Sequence[Slot]]) -> tuple[Tier, ...]:
        """Index these slots, tier by tier, every one parked until first looked at.
        Returns the new tiers, in the order given."""
        self.tiers = tuple(Tier() for _ in tiers)
        self.slots = {}
        self.by_id = {}
        self._full = {}
        self._others = {}
        self.parked.clear()  # the same dict: callers may keep a reference to it
        self._timed = []
        self.due = NEVER
        self._doomed = []
        self._ready = 0
        seq = 0
        for tier, members in zip(self.tiers, tiers, strict=True):
            for slot in members:
                slot.enter(tier, seq)
                seq += 1
                self.slots[slot.worker] = slot
                self.by_id[slot.id] = slot
                self._others[slot] = None  # classified on first use, at that moment
                self.parked[slot.worker] = slot
        self._hopeful = seq
        self._stale = bool(seq)
        self._sync_due()
        return self.tiers

    # -- what changed ------------------------------------------------------------------

    def update(self, worker: Worker, now: float) -> None:
        """Look at ``worker`` again: a task of its ended, or its state changed."""
        slot = self.parked.get(worker)
        if slot is not None:
            self.classify(slot, now)

    def taken(self, worker: Worker, now: float) -> None:
        """``worker`` was just given a task that filled it or is its breaker's trial."""
        slot = self.slots.get(worker)
        if slot is not None:
            self.classify(slot, now)

    def invalidate(self) -> None:
        """Some workers may have become available, which ones is not known (a health
        round, a breaker closed elsewhere): look at every parked worker again."""
        if self._full or self._others:
            self._stale = True
            self.due = NOW

    # -- room --------------------------------------------------------------------------

    def may_have_room(self, now: float) -> bool:
        """False when no selection could find a worker, whatever the exclusions."""
        return bool(self._ready) or now >= self.due

    def has_room(self, now: float) -> bool:
        """Like :meth:`may_have_room`, but first looks again at the parked workers that
        may have changed, so that it is False after an :meth:`invalidate` that found
        every worker still full."""
        if now >= self.due:
            self.catch_up(now)
        return bool(self._ready) or now >= self.due

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
            self.catch_up(now)
        hopeful = self._hopeful
        if hopeful > len(excluded):
            return True
        if hopeful:
            by_id = self.by_id
            for worker_id in excluded if isinstance(excluded, set | frozenset) else set(excluded):
                slot = by_id.get(worker_id)
                if slot is not None and slot.doom == NOW:
                    hopeful -= 1
            if hopeful > 0:
                return True
        for doom, _, slot in self._doomed:
            if doom >= deadline:
                break
            if slot.id not in excluded:
                return True
        return False

    def held_past(self, excluded: Collection[str], deadline: float) -> tuple[bool, bool]:
        """Whether open breakers, and whether cool-downs, keep some worker not in
        ``excluded`` unavailable until ``deadline`` or later."""
        breakers = cooldowns = False
        doomed = self._doomed
        for i in range(bisect_left(doomed, (deadline,)), len(doomed)):
            slot = doomed[i][2]
            if slot.id not in excluded:
                breakers = breakers or slot.breaker_until >= deadline
                cooldowns = cooldowns or slot.cooldown_until >= deadline
        return breakers, cooldowns

    # -- keeping it true ---------------------------------------------------------------

    def catch_up(self, now: float) -> None:
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
                or slot.doom != NOW
                or not w.healthy
                or w.health.hinted_draining
                or w.refused_until > now
            ]
            recheck += self._others
            for slot in recheck:
                self.classify(slot, now)
        timed = self._timed
        while timed and timed[0][0] <= now:
            wake, _, slot = heapq.heappop(timed)
            if slot.place == TIMED and slot.wake == wake:
                self.classify(slot, now)
        self._sync_due()

    def classify(self, slot: Slot, now: float) -> None:
        """Put ``slot`` where its worker's state says, as of ``now``."""
        worker = slot.worker
        breaker = worker.breaker
        retry = breaker.retry_at()
        cooldown = worker.cooldown_until
        # Whether waiting can help: see npu_sync._outage.
        doom, breaker_until, cooldown_until = held_until(
            worker, now, shared_breakers=self._shared_breakers
        )
        slot.breaker_until = breaker_until
        slot.cooldown_until = cooldown_until
        wake = 0.0
        if worker.eligible(now):
            place = READY
            if breaker.state != CLOSED and self.on_trial is not None:
                self.on_trial(slot)  # its trial is due: see rules.TrialTurn
        elif doom == NEVER:
            place = BLOCKED
        elif worker.in_flight >= worker.capacity:
            place = FULL
        elif cooldown > now or worker.refused_until > now:
            place, wake = TIMED, max(cooldown, worker.refused_until)
        elif retry is not None and retry > now:
            place, wake = TIMED, retry
        else:
            place = BLOCKED  # a half-open breaker with its trial in flight
        self._move(slot, place, wake)
        if doom != slot.doom:
            self._set_doom(slot, doom)

    def _sync_due(self) -> None:
        timed = self._timed
        self.due = NOW if self._stale else timed[0][0] if timed else NEVER

    def _drop_stale_top(self) -> None:
        timed = self._timed
        while timed:
            wake, _, slot = timed[0]
            if slot.place == TIMED and slot.wake == wake:
                break
            heapq.heappop(timed)
        self._sync_due()

    def _move(self, slot: Slot, place: int, wake: float) -> None:
        old = slot.place
        if old == place and (place != TIMED or slot.wake == wake):
            return
        if old == READY:
            self._unlist(slot)
            self.parked[slot.worker] = slot
        elif old == FULL:
            del self._full[slot]
        else:
            del self._others[slot]
        slot.place = place
        if place == READY:
            del self.parked[slot.worker]
            tier = slot.tier
            at = bisect_left(tier.keys, slot.seq)
            tier.keys.insert(at, slot.seq)
            tier.ready.insert(at, slot)
            tier.workers.insert(at, slot.worker)
            if tier.last is not None and slot.seq <= tier.last.seq:
                tier.turn += 1
            self._ready += 1
        elif place == FULL:
            self._full[slot] = None
        else:
            self._others[slot] = None
            if place == TIMED:
                slot.wake = wake
                self._push(wake, slot)

    def _unlist(self, slot: Slot) -> None:
        tier = slot.tier
        at = bisect_left(tier.keys, slot.seq)
        del tier.keys[at]
        del tier.ready[at]
        del tier.workers[at]
        if tier.last is not None and slot.seq <= tier.last.seq:
            tier.turn -= 1
        self._ready -= 1

    def _push(self, wake: float, slot: Slot) -> None:
        self._drop_stale_top()
        timed = self._timed
        earlier = not timed or wake < timed[0][0]
        if len(timed) > 2 * len(self.slots) + 64:
            # Stale entries pile up when workers flip often: keep the heap bounded.
            timed[:] = [e for e in timed if e[2].place == TIMED and e[2].wake == e[0]]
            heapq.heapify(timed)
        self._pushes += 1
        heapq.heappush(timed, (wake, self._pushes, slot))
        self._sync_due()
        if earlier and self.on_earlier_wake is not None:
            self.on_earlier_wake()

    def _set_doom(self, slot: Slot, doom: float) -> None:
        old = slot.doom
        if old == NOW:
            self._hopeful -= 1
        elif old != NEVER:
            doomed = self._doomed
            del doomed[bisect_left(doomed, (old, slot.seq))]
        slot.doom = doom
        if doom == NOW:
            self._hopeful += 1
        elif doom != NEVER:
            insort(self._doomed, (doom, slot.seq, slot))
