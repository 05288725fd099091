"""Admission: hand each attempt a worker, or make it wait its turn for one.

When no eligible worker has room (all busy, open, unhealthy or already tried), a
task waits in a FIFO queue until a worker frees up or recovers, up to its deadline
("task requeue"). Freed capacity is handed directly to the first waiter that can use
it, under the same lock that released it, so a newcomer cannot overtake a waiter and
no waiter is woken for nothing. Waiters also wake on their own when an open breaker
is due for its trial or a worker's cool-down ends, since no release signals those.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Collection, Iterable
from time import perf_counter as _perf_counter  # bound once: read twice per attempt

from npu_sync.clock import Clock
from npu_sync.metrics import Window
from npu_sync.selector import Selector
from npu_sync.worker import Worker


class Lease:
    """Permission for one attempt on ``worker``; ``trial`` marks a half-open probe."""

    __slots__ = ("generation", "trial", "worker")

    def __init__(self, worker: Worker, trial: bool) -> None:
        self.worker = worker
        self.trial = trial
        self.generation = worker.generation


class _Waiter:
    __slots__ = ("cond", "deadline", "excluded", "lease")

    def __init__(self, excluded: Collection[str], deadline: float, lock: threading.Lock) -> None:
        self.excluded = excluded
        self.deadline = deadline
        self.cond = threading.Condition(lock)
        self.lease: Lease | None = None


class Dispatcher:
    """Worker selection plus FIFO waiting for capacity.

    Thread-safe. ``lock`` guards every worker's mutable state, the selector and the
    waiter queue; it is never held across I/O.

    Whoever changes a worker under ``lock`` in a way that may make it available tells
    the dispatcher: :meth:`release_worker_locked` for one worker (a task ended there),
    :meth:`release_locked` when several or unknown ones may have (a health round).
    """

    def __init__(self, clock: Clock, selector: Selector | None = None) -> None:
        self.lock = threading.Lock()
        self.clock = clock
        self.selector = selector or Selector()
        self.selector.on_earlier_wake = self.wake_all_locked
        self._parked = self.selector.parked
        self._waiters: deque[_Waiter] = deque()
        self.selection_time = Window(4096)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def set_workers(self, workers: Iterable[Worker]) -> None:
        with self.lock:
            self.set_workers_locked(workers)

    def set_workers_locked(self, workers: Iterable[Worker]) -> None:
        """Replace the candidate set. Call with ``lock`` held."""
        self.selector.set_workers(workers)
        self._serve(self.clock.monotonic())
        # Waiters whose last untried worker went away must re-check.
        self.wake_all_locked()

    def acquire(self, excluded: Collection[str], deadline: float) -> Lease | None:
        """A lease on the best worker not in ``excluded``, waiting until ``deadline``.

        Returns None when the deadline passes first, or at once when every worker
        that could ever take this task has been tried. Never hands out a lease after
        ``deadline``.
        """
        with self.lock:
            now = self.clock.monotonic()
            if now >= deadline:
                return None
            if self._waiters:
                self._serve(now)
            lease = self._try(excluded, now)
            if lease is not None:
                return lease
            if not self.selector.has_candidate(excluded):
                return None
            waiter = _Waiter(excluded, deadline, self.lock)
            self._waiters.append(waiter)
            try:
                while waiter.lease is None:
                    if now >= deadline or not self.selector.has_candidate(excluded):
                        break
                    waiter.cond.wait(self._wake_in(now, deadline))
                    if waiter.lease is not None:
                        break
                    now = self.clock.monotonic()
                    self._serve(now)
            finally:
                if waiter.lease is None:
                    self._waiters.remove(waiter)
            return waiter.lease

    def release_locked(self, now: float) -> None:
        """Workers not named may have become available (a health round, a breaker
        closed elsewhere, tasks ended): look at them again and hand freed capacity to
        waiters. Call with ``lock`` held.

        Costs a pass over the unavailable workers at the next selection: after a task
        ends, :meth:`release_worker_locked` is the cheap call.
        """
        self.selector.invalidate()
        if self._waiters:
            self._serve(now)

    def release_worker_locked(self, worker: Worker, now: float) -> None:
        """``worker`` changed (one of its tasks ended, its breaker or cool-down moved):
        hand any capacity it now has to waiters. Call with ``lock`` held."""
        if worker in self._parked:  # a worker with room already is found as it is
            self.selector.update(worker, now)
        if self._waiters:
            self._serve(now)

    def wake_all_locked(self) -> None:
        """Make every waiter recompute when to wake (a breaker tripped, a cool-down
        began: times no release will signal). Call with ``lock`` held."""
        for waiter in self._waiters:
            waiter.cond.notify()

    # -- internals ---------------------------------------------------------------------

    def _try(self, excluded: Collection[str], now: float) -> Lease | None:
        started = _perf_counter()
        selector = self.selector
        worker = selector.select(excluded, now)
        if worker is None:
            return None
        trial = worker.breaker.admit(now)
        if trial is None:  # pragma: no cover - select() checked can_admit under this lock
            return None
        worker.in_flight += 1
        if trial or worker.in_flight >= worker.capacity:
            selector.taken(worker, now)
        self.selection_time.add(_perf_counter() - started)
        return Lease(worker, trial)

    def _serve(self, now: float) -> None:
        waiters = self._waiters
        may_have_room = self.selector.may_have_room
        i = 0
        while i < len(waiters):
            waiter = waiters[i]
            if now >= waiter.deadline:
                waiter.cond.notify()  # too late for a lease: it leaves the queue itself
                i += 1
                continue
            if not may_have_room(now):
                break  # no worker has room for anyone
            waiter.lease = self._try(waiter.excluded, now)
            if waiter.lease is not None:
                del waiters[i]
                waiter.cond.notify()
            elif not waiter.excluded:
                break  # no worker has room for anyone
            else:
                i += 1

    def _wake_in(self, now: float, deadline: float) -> float:
        """How long to sleep before something time-driven may free a worker."""
        wake = deadline - now
        due = self.selector.next_wake()
        if due is not None and due - now < wake:
            wake = due - now
        return max(wake, 0.001)
