"""Admission: hand each attempt a worker, or make it wait its turn for one.

When no eligible worker has room (all busy, open, unhealthy or already tried), a
task waits in a FIFO queue until a worker frees up or recovers, up to its deadline
("task requeue"). With tasks of several priority classes waiting, the queue is
served by class first (:mod:`npu_sync._priority`), and a class may find no room in
the capacity the classes above it reserve. Freed capacity is handed directly to the
first waiter that can use it, under the same lock that released it, so a newcomer
cannot overtake a waiter and no waiter is woken for nothing. Waiters also wake on
their own when an open breaker is due for its trial or a worker's cool-down ends,
since no release signals those.

A task does not wait when waiting cannot help: when every worker it has not tried is
disabled, draining, or unavailable until after its deadline (see
:meth:`Selector.can_serve_before`), it is refused at once, with the reason. Nor when
the queue ahead of it is expected to outlast its deadline (deadline-aware admission,
:mod:`npu_sync._foresight`): then a :class:`~npu_sync._foresight.Late` says by how much.

Whatever is raised in a waiting thread (``KeyboardInterrupt`` included), a lease
handed to it is given back and passed on to the next waiter.
"""

from __future__ import annotations

import enum
import heapq
import threading
from collections import deque
from collections.abc import Callable, Collection, Iterable
from time import perf_counter as _perf_counter  # bound once: read twice per attempt

from npu_sync._balancing.selector import Selector
from npu_sync._clock import Clock
from npu_sync._config_types import AdmissionConfig, PriorityConfig
from npu_sync._demand import QueueMeter
from npu_sync._foresight import Late, foresight_for
from npu_sync._metrics import Window
from npu_sync._priority import PriorityClasses
from npu_sync._stop import TaskStop
from npu_sync._worker import Worker


class Lease:
    """Permission for one attempt on ``worker``; ``trial`` marks a half-open probe;
    ``in_flight`` is the worker's count of tasks in flight with this one."""

    __slots__ = ("generation", "in_flight", "trial", "worker")

    def __init__(self, worker: Worker, trial: bool) -> None:
        self.worker = worker
        self.trial = trial
        self.generation = worker.generation
        self.in_flight = worker.in_flight


class Refusal(enum.Enum):
    """Why :meth:`Dispatcher.acquire_or_reason` gave no lease; the value reads as a reason."""

    DEADLINE_PASSED = "deadline passed waiting for a worker"
    EVERY_WORKER_TRIED = "every worker was tried"
    NO_WORKER = "no worker in the pool can take tasks"
    BREAKERS_OPEN = (
        "no worker can become available before the deadline: circuit breakers open until after it"
    )
    COOLING_DOWN = (
        "no worker can become available before the deadline: Retry-After cool-downs until after it"
    )
    BREAKERS_OPEN_OR_COOLING_DOWN = (
        "no worker can become available before the deadline: "
        "circuit breakers open or Retry-After cool-downs until after it"
    )
    STOPPED = "stopped while waiting for a worker"


class _Waiter:
    __slots__ = ("cond", "deadline", "excluded", "lease", "model", "priority", "queued", "since")

    def __init__(
        self,
        excluded: Collection[str],
        deadline: float,
        lock: threading.Lock,
        priority: str | None = None,
        since: float = 0.0,
        model: str | None = None,
    ) -> None:
        self.excluded = excluded
        self.deadline = deadline
        self.cond = threading.Condition(lock)
        self.lease: Lease | None = None
        self.queued = True
        self.priority = priority  # the task's class by name; None: the default
        self.since = since  # when it joined the queue (aging)
        self.model = model  # the model the task names, for the queue per model


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
        # Waiting tasks that named a class: while there are none, the queue is FIFO.
        self._named = 0
        # Task-seconds waited per model (placement's sign of queueing). Under lock.
        self.queued = QueueMeter()
        self.classes = PriorityClasses()
        self.selection_time = Window(4096)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def set_classes_locked(self, config: PriorityConfig) -> None:
        """Put new priority classes in force (a reload); waiting tasks are served by
        them from now on. Call with ``lock`` held."""
        if config == self.classes.config:
            return
        self.classes = PriorityClasses(config)
        if self._waiters:
            self._serve(self.clock.monotonic())
            self.wake_all_locked()

    def set_workers(self, workers: Iterable[Worker]) -> None:
        with self.lock:
            self.set_workers_locked(workers)

    def set_workers_locked(self, workers: Iterable[Worker]) -> None:
        """Replace the candidate set. Call with ``lock`` held."""
        now = self.clock.monotonic()
        self.selector.set_workers(workers, now)
        self._serve(now)
        # Waiters whose last untried worker went away must re-check.
        self.wake_all_locked()

    def acquire(self, excluded: Collection[str], deadline: float) -> Lease | None:
        """A lease on the best worker not in ``excluded``, waiting until ``deadline``.

        Returns None when the deadline passes first, or at once when no worker that
        could take this task can do so before ``deadline`` (see
        :meth:`acquire_or_reason`). Never hands out a lease after ``deadline``.
        """
        with self.lock:
            now = self.clock.monotonic()
            if now < deadline and not self._waiters:
                lease = self._try(excluded, now, self.classes.default_rank)
                if lease is not None:
                    return lease
        # No worker has room now (or others queue first): the full procedure.
        got = self.acquire_or_reason(excluded, deadline)
        return got if type(got) is Lease else None

    def acquire_or_reason(
        self,
        excluded: Collection[str],
        deadline: float,
        first: Callable[[float], None] | None = None,
        stop: TaskStop | None = None,
        *,
        admission: AdmissionConfig | None = None,
        task_deadline: float | None = None,
        priority: str | None = None,
        model: str | None = None,
    ) -> Lease | Refusal | Late:
        """Like :meth:`acquire`, but say why no lease was given.

        Args:
            first: called with the time under ``lock``, before anything else: work a
                caller would otherwise take the lock for once more (a task's first
                request pays into the retry budget, which shares this lock). It must
                not block nor raise.
            stop: the task's stop: once stopped, it waits no more (``STOPPED``).
            admission: the admission settings in force for the task; with
                ``deadline_aware`` on, a task that would wait is first judged by
                :class:`~npu_sync._foresight.DeadlineForesight`.
            task_deadline: when the task must be answered (``deadline`` is when it
                must have a worker); ``deadline`` when None.
            priority: the task's class (:mod:`npu_sync._priority`); None: the default.
            model: the model the task names, if any: its wait is counted per model
                (:attr:`queued`).

        Returns:
            A Lease; or the Refusal: the deadline passed, every worker was tried,
            the pool has no worker that takes tasks, or every worker not tried is
            held by an open breaker or a cool-down until after ``deadline``; or a
            Late: the task is expected to be answered only past its deadline.
        """
        with self.lock:
            now = self.clock.monotonic()
            if first is not None:
                first(now)
            if now >= deadline:
                return Refusal.DEADLINE_PASSED
            if stop is not None and stop.cancelled:
                return Refusal.STOPPED
            if self._waiters:
                self._serve(now)
            # Whoever still waits after _serve() could not use what is free now: taking
            # it overtakes nobody.
            classes = self.classes
            rank = classes.default_rank if priority is None else classes.rank_or_default(priority)
            lease = self._try(excluded, now, rank)
            if lease is not None:
                return lease
            refusal = self._refusal(excluded, deadline, now)
            if refusal is not None:
                return refusal
            if admission is not None and admission.deadline_aware:
                late = self._foresee(admission, excluded, now, deadline, task_deadline, rank)
                if late is not None:
                    return late
            if stop is None:
                return self._wait(excluded, deadline, now, priority, model=model)
            return self._wait_stoppable(excluded, deadline, now, stop, priority, model)

    def try_acquire(self, excluded: Collection[str], priority: str | None = None) -> Lease | None:
        """A lease on the best worker not in ``excluded`` if one has room now, else None.

        Never waits, never takes a slot a queued task is waiting for, nor one the
        classes above ``priority`` (the task's class; None: the default) reserve: for
        a choice beside the usual one (a preferred worker, a hedge), which must not
        delay anybody's first attempt.
        """
        with self.lock:
            if self._waiters:
                return None
            classes = self.classes
            rank = classes.default_rank if priority is None else classes.rank_or_default(priority)
            return self._try(excluded, self.clock.monotonic(), rank)

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

    def _wait_stoppable(
        self,
        excluded: Collection[str],
        deadline: float,
        now: float,
        stop: TaskStop,
        priority: str | None,
        model: str | None = None,
    ) -> Lease | Refusal:
        """:meth:`_wait`, woken and ended early when ``stop`` is stopped. Called with
        ``lock`` held; the stop's callback takes it (a stop never runs under it)."""
        waiter = _Waiter(excluded, deadline, self.lock, priority, now, model)

        def wake() -> None:
            with self.lock:
                waiter.cond.notify()

        if not stop.on_cancel(wake):
            return Refusal.STOPPED
        try:
            return self._wait(excluded, deadline, now, priority, stop, waiter)
        finally:
            stop.forget(wake)

    def _foresee(
        self,
        admission: AdmissionConfig,
        excluded: Collection[str],
        now: float,
        deadline: float,
        task_deadline: float | None,
        rank: int,
    ) -> Late | None:
        """Whether the queue ahead is expected to outlast the task's deadline."""
        foresight = foresight_for(admission)
        if foresight is None:  # pragma: no cover - deadline_aware was checked
            return None
        ahead = len(self._waiters)
        if self._named:
            # Only the tasks served before it are ahead: its class and those above.
            classes = self.classes
            ahead = sum(
                1
                for w in self._waiters
                if classes.effective(classes.rank_or_default(w.priority), now - w.since) <= rank
            )
        return foresight.judge(
            self.selector.workers,
            excluded,
            ahead,
            now,
            deadline,
            deadline if task_deadline is None else task_deadline,
        )

    def _wait(
        self,
        excluded: Collection[str],
        deadline: float,
        now: float,
        priority: str | None = None,
        stop: TaskStop | None = None,
        waiter: _Waiter | None = None,
        model: str | None = None,
    ) -> Lease | Refusal:
        if waiter is None:
            waiter = _Waiter(excluded, deadline, self.lock, priority, now, model)
        self._waiters.append(waiter)
        if priority is not None:
            self._named += 1
        if waiter.model is not None:
            self.queued.join(waiter.model, now)
        refusal: Refusal | None = None
        try:
            while True:
                wake = self._wake_in(now, deadline)
                classes = self.classes
                # Aging may let it into capacity kept for the classes above: no
                # release signals that moment.
                step = classes.next_step(
                    classes.rank_or_default(waiter.priority), now - waiter.since
                )
                if step is not None:
                    wake = min(wake, max(step, 0.001))
                waiter.cond.wait(wake)
                if waiter.lease is not None:
                    break
                if stop is not None and stop.cancelled:
                    refusal = Refusal.STOPPED
                    break
                now = self.clock.monotonic()
                if now >= deadline:
                    refusal = Refusal.DEADLINE_PASSED
                    break
                self._serve(now)
                if waiter.lease is not None:
                    break
                refusal = self._refusal(excluded, deadline, now)
                if refusal is not None:
                    break
        except BaseException:
            # Interrupted, perhaps just as a lease was handed over: give it back and
            # pass it on, or the slot (or the breaker's only trial) is lost for good.
            self._leave(waiter)
            lease, waiter.lease = waiter.lease, None
            if lease is not None:
                self._give_back(lease.worker, lease.trial)
                self._serve(self.clock.monotonic())
            raise
        finally:
            self._leave(waiter)
        if waiter.lease is not None:
            return waiter.lease
        assert refusal is not None
        return refusal

    def _leave(self, waiter: _Waiter) -> None:
        if waiter.queued:
            waiter.queued = False
            self._waiters.remove(waiter)
            if waiter.model is not None:
                self.queued.leave(waiter.model, self.clock.monotonic())
            if waiter.priority is not None:
                self._named -= 1

    def _try(self, excluded: Collection[str], now: float, rank: int = 0) -> Lease | None:
        started = _perf_counter()
        selector = self.selector
        classes = self.classes
        if classes.reserving and rank and not classes.may_take(rank, selector.workers):
            return None  # what is left is kept for the classes above
        worker = selector.select(excluded, now)
        if worker is None:
            return None
        trial = worker.breaker.admit(now)
        if trial is None:  # pragma: no cover - select() checked can_admit under this lock
            return None
        worker.in_flight += 1
        try:
            if worker.in_flight == 1:
                selector.started(worker, now)
            if trial or worker.in_flight >= worker.capacity:
                selector.taken(worker, now)
            lease = Lease(worker, trial)
            self.selection_time.add(_perf_counter() - started)
        except BaseException:
            self._give_back(worker, trial)
            raise
        return lease

    def _give_back(self, worker: Worker, trial: bool) -> None:
        """Undo a lease that no attempt will use."""
        worker.in_flight -= 1
        worker.breaker.release(trial)
        self.selector.update(worker, self.clock.monotonic())

    def _serve(self, now: float) -> None:
        if self._named:
            self._serve_ranked(now)
            return
        rank = self.classes.default_rank
        waiters = self._waiters
        may_have_room = self.selector.may_have_room
        i = 0
        while i < len(waiters):
            waiter = waiters[i]
            if waiter.lease is not None or now >= waiter.deadline:
                # Too late for a lease, or already has one (a hand-over interrupted
                # before the notify): it leaves the queue itself.
                waiter.cond.notify()
                i += 1
                continue
            if not may_have_room(now):
                break  # no worker has room for anyone
            waiter.lease = self._try(waiter.excluded, now, rank)
            if waiter.lease is not None:
                del waiters[i]
                waiter.queued = False
                if waiter.model is not None:
                    self.queued.leave(waiter.model, now)
                waiter.cond.notify()
            elif not waiter.excluded:
                break  # no worker has room for anyone
            else:
                i += 1

    def _serve_ranked(self, now: float) -> None:
        """:meth:`_serve` with tasks of several classes waiting: the highest class (after
        aging) first, the longest waiting first within a class.

        Bounded work under the lock whatever the queue's length: nothing is ranked
        while no worker has room (every release of a saturated fleet, every waiter
        woken at once), the ranking is a heap popped only as far as waiters are
        served, and the pass ends at the first class the reserves keep out, since
        every class after it is kept out too.
        """
        if not self.selector.has_room(now):
            return  # no worker has room for anyone; a waiter past its deadline wakes itself
        may_have_room = self.selector.may_have_room
        waiters = self._waiters
        classes = self.classes
        workers = self.selector.workers
        ranked = [
            (classes.effective(classes.rank_or_default(w.priority), now - w.since), i, w)
            for i, w in enumerate(waiters)
        ]
        heapq.heapify(ranked)
        while ranked:
            rank, _, waiter = heapq.heappop(ranked)
            if waiter.lease is not None or now >= waiter.deadline:
                waiter.cond.notify()  # it leaves the queue itself
                continue
            if not may_have_room(now):
                break
            if classes.reserving and rank and not classes.may_take(rank, workers):
                break  # kept for the classes above: so is it for every class below
            waiter.lease = self._try(waiter.excluded, now, rank)
            if waiter.lease is not None:
                waiters.remove(waiter)
                waiter.queued = False
                if waiter.model is not None:
                    self.queued.leave(waiter.model, now)
                if waiter.priority is not None:
                    self._named -= 1
                waiter.cond.notify()
            elif not waiter.excluded:
                break  # no worker has room for anyone

    def _refusal(self, excluded: Collection[str], deadline: float, now: float) -> Refusal | None:
        """Why waiting cannot help this task, or None if it may."""
        selector = self.selector
        if selector.can_serve_before(excluded, deadline, now):
            return None
        breakers, cooldowns = selector.held_past(excluded, deadline)
        if breakers and cooldowns:
            return Refusal.BREAKERS_OPEN_OR_COOLING_DOWN
        if breakers:
            return Refusal.BREAKERS_OPEN
        if cooldowns:
            return Refusal.COOLING_DOWN
        return Refusal.EVERY_WORKER_TRIED if excluded else Refusal.NO_WORKER

    def _wake_in(self, now: float, deadline: float) -> float:
        """How long to sleep before something time-driven may free a worker."""
        wake = deadline - now
        due = self.selector.next_wake()
        if due is not None and due - now < wake:
            wake = due - now
        return max(wake, 0.001)
