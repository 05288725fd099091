"""The life of one task, from its deadline to its result, its rejection or its dead letter.

Read top to bottom, it is the order things happen in (docs/architecture.md tells the
same story):

``Runner.deadline``
    When the task must be over: the caller's ``timeout``, else the task's, else
    ``timeouts.task``. Every wait and every attempt fits before it.
``Runner.run``
    The whole life: ``TaskStarted``, then :class:`TaskRun` tries workers until one
    attempt ends the task; if none did, the fallback runs, or ``dead_letter`` stores the
    record *before* ``TaskFailed`` is raised.
``TaskRun.run``, one attempt after another:
    ``wait_for_worker`` (a lease on the best worker not yet tried, waiting FIFO for
    capacity); ``attempt`` (``send`` outside any lock, the answer classified, then
    :func:`record` under the lock); then ``succeeded``, or ``failed``: reject the task,
    decide who is charged, back off, and try a worker not yet tried; ``give_up`` says
    why nothing is left.
``Runner.replay``
    A dead letter's task run again, never dead-lettered a second time.

Nothing here holds the pool's lock across I/O or while user code (hooks, the result
check, the fallback) runs. The pool's lifecycle (threads, ``close()``, ``fork()``) is
``pool.py``'s; this module only reads and changes the :class:`PoolState`.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable, Collection, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NoReturn

from npu_sync.admission import Lease, Refusal
from npu_sync.attempt import Attempt
from npu_sync.blame import Blame, Held, Verdict, misrouted, proven_route, route_answered
from npu_sync.breaker import HALF_OPEN
from npu_sync.budget import RetryBudget
from npu_sync.deadletter import DeadLetter, DeadLetterQueue, DeadLetterStore
from npu_sync.errors import (
    AdmissionRefused,
    InvalidTask,
    NoWorkerAvailable,
    TaskFailed,
    TaskRejected,
    printable,
)
from npu_sync.events import (
    AttemptFinished,
    AttemptHedged,
    RetryScheduled,
    TaskDeadLettered,
    TaskFallback,
    TaskRejectedEvent,
    TaskStarted,
    TaskSucceeded,
    WorkerCredentialsRefused,
    WorkerHealthChanged,
    WorkerModelsChanged,
    emit,
)
from npu_sync.foresight import Late
from npu_sync.hedge import HedgePolicy
from npu_sync.modelcost import ModelCosts
from npu_sync.outage import describe, down_reason, held_until, refuse_credentials
from npu_sync.protocols import WorkerProtocol
from npu_sync.redact import Scrubber
from npu_sync.retry import REFUSED_CREDENTIALS, Kind, Outcome, classify_error
from npu_sync.routing import charged_to, considered
from npu_sync.stall import Pace
from npu_sync.state import Placement, PoolState
from npu_sync.stop import Stopped, TaskStop
from npu_sync.task import Task
from npu_sync.trace import TaskWatch, Trace, TraceStep
from npu_sync.transport import Cancel, TransportError
from npu_sync.worker import Worker

log = logging.getLogger(__name__)

_MAX_TIMEOUT = 86400
"""A task's deadline is at most a day, like ``timeouts.task``."""

_MIN_ATTEMPT = 0.001
"""An attempt with less time than this left before the deadline is not started."""

_EVERY_WORKER_TRIED = "every worker was tried"

_UNUSED = Outcome(Kind.NOT_HERE, error="lease not used")
"""Records a lease given back without an attempt (deadline reached, interrupted)."""

_BUDGET_EXHAUSTED = "retry budget exhausted"

# A hedged task's two attempts: the caller's own, and the hedge sent after a delay.
_FIRST = 0
_HEDGE = 1
# Where a hedge stands (_Race.state).
_WAITING = 0  # the delay has not passed
_SENDING = 1  # the timer fired: a hedge is being sent, or runs
_CLOSED = 2  # no hedge will run any more (none was sent, or it ended)


class _Race:
    """A hedged task's two attempts: which answered first. Thread-safe.

    The first success wins and cancels the other attempt (see :class:`Cancel`); the
    loser's end, whatever it is, is its cancellation, recorded as abandoned.
    """

    __slots__ = ("cancels", "cond", "hedge_result", "state", "winner")

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.state = _WAITING
        self.winner: int | None = None
        self.cancels = (Cancel(), Cancel())
        self.hedge_result: tuple[Lease, tuple[Outcome, bool, float, float]] | None = None

    def claim(self) -> bool:
        """The timer fired: True if the hedge is still wanted (it is then being sent)."""
        with self.cond:
            if self.state != _WAITING or self.winner is not None:
                return False
            self.state = _SENDING
            return True

    def settle(self, side: int, success: bool) -> bool:
        """``side``'s attempt ended; True when the other had already won."""
        with self.cond:
            winner = self.winner
            if winner is not None:
                return winner != side
            if not success:
                return False
            self.winner = side
        self.cancels[1 - side].cancel()
        return False

    def abandon(self) -> None:
        """The caller's attempt raised: no hedge is sent any more, and one already out
        is cancelled and ends as the loser (its answer is never the one returned)."""
        with self.cond:
            self.winner = _FIRST
            if self.state == _WAITING:
                self.state = _CLOSED
        self.cancels[_HEDGE].cancel()

    def hedge_ended(self, result: tuple[Lease, tuple[Outcome, bool, float, float]] | None) -> None:
        """The hedge ended (``result``) or was never sent (None)."""
        with self.cond:
            self.hedge_result = result
            self.state = _CLOSED
            self.cond.notify_all()

    def first_ended(
        self, success: bool, wait: float
    ) -> tuple[Lease, tuple[Outcome, bool, float, float]] | None:
        """The caller's attempt ended. Without success, the hedge's result, waiting up
        to ``wait`` seconds for it; with success, the hedge's result only if it had
        already ended (a failure to settle); None when no hedge runs (none will be
        sent)."""
        with self.cond:
            if self.state == _WAITING:
                self.state = _CLOSED
                return None
            if success:
                return self.hedge_result if self.state == _CLOSED else None
            self.cond.wait_for(lambda: self.state == _CLOSED, wait)
            return self.hedge_result


class _Exhausted(Exception):
    """No attempt is left for a task; carries why and what was tried."""

    def __init__(self, reason: str, attempts: list[Attempt], first_at: float) -> None:
        super().__init__(reason)
        self.reason = reason
        self.attempts = attempts
        self.first_at = first_at
        self.trace: Trace | None = None


class Runner:
    """Runs the tasks of one pool, each on its caller's thread. Thread-safe.

    Args:
        state: the pool's running state.
        store: where dead letters are kept.
        result_check: called with every 2xx answer's decoded JSON; if it raises, the
            answer is that worker's failure (see :class:`~npu_sync.pool.WorkerPool`).
        hold: entered around each dead letter's replay (see :class:`DeadLetterQueue`).
    """

    def __init__(
        self,
        state: PoolState,
        store: DeadLetterStore,
        *,
        result_check: Callable[[Any], object] | None = None,
        hold: Callable[[], AbstractContextManager[object]] = nullcontext,
    ) -> None:
        self.state = state
        self.result_check = result_check
        self.dead_letters = DeadLetterQueue(
            store, self.replay, clock=state.clock, run_time=self.replay_budget, hold=hold
        )

    def deadline(self, task: Task, timeout: float | None) -> float:
        """When ``task`` must be over, on the pool's monotonic clock.

        Raises:
            InvalidTask: ``timeout`` is not a number of seconds in (0, a day].
        """
        if timeout is not None:
            _check_timeout(timeout)
        state = self.state
        return state.clock.monotonic() + (timeout or task.timeout or state.config.timeouts.task)

    def run(
        self,
        task: Task,
        body: bytes,
        deadline: float,
        fallback: Callable[[], Any] | None,
        stop: TaskStop | None = None,
        watch: TaskWatch | None = None,
    ) -> Any:
        """The whole life of one task: its result, or ``TaskRejected``, or the fallback's
        result, or ``TaskFailed`` once its dead letter is stored; or ``Stopped`` when
        ``stop`` is stopped first (see :mod:`npu_sync.stop`): no fallback, no dead
        letter, nobody charged. With an observer (tracing), :meth:`watched` runs it."""
        if watch is None:
            state = self.state
            if state.hooks:
                endpoint = task.endpoint or state.config.pool.default_endpoint
                emit(state.hooks, TaskStarted(state.clock.time(), task.task_id, endpoint))
            if state.observer is not None:
                return self.watched(state.observer(task), task, body, deadline, fallback, stop)
        try:
            return TaskRun(self, task, body, deadline, stop, watch).run()
        except _Exhausted as exhausted:
            if stop is not None and stop.cancelled:
                raise Stopped(task.task_id) from None  # nobody is left to hear of it
            if fallback is None:
                self.dead_letter(task, exhausted, deadline)
            return self.fall_back(task, exhausted, deadline, fallback)
        except TaskRejected as rejected:
            if fallback is None or (
                rejected.model is None and not isinstance(rejected, AdmissionRefused)
            ):
                raise
            return self.fall_back_model(task, rejected, fallback)

    def watched(
        self,
        watch: TaskWatch,
        task: Task,
        body: bytes,
        deadline: float,
        fallback: Callable[[], Any] | None,
        stop: TaskStop | None,
    ) -> Any:
        """:meth:`run`, the pool's observer told how the task ends (no lock held)."""
        try:
            result = self.run(task, body, deadline, fallback, stop, watch)
        except BaseException as exc:
            watch.end(exc)
            raise
        watch.end(None)
        return result

    def fall_back_model(
        self, task: Task, rejected: TaskRejected, fallback: Callable[[], Any]
    ) -> Any:
        """No live worker serves the task's model: the caller's fallback answers (no lock
        held). If it fails too, the rejection is raised, from the fallback's error: a
        task no worker can serve is not dead-lettered."""
        try:
            result = fallback()
        except Exception as exc:
            raise rejected from exc
        state = self.state
        with state.lock:
            state.stats.fallbacks += 1
        state.notify(TaskFallback(state.clock.time(), task.task_id, str(rejected)))
        return result

    def fall_back(
        self, task: Task, exhausted: _Exhausted, deadline: float, fallback: Callable[[], Any]
    ) -> Any:
        """Run the caller's fallback (no lock held); dead-letter the task if it fails too."""
        try:
            result = fallback()
        except Exception as exc:
            exhausted.reason += f"; fallback failed: {type(exc).__name__}: {exc}"
            self.dead_letter(task, exhausted, deadline, cause=exc)
        state = self.state
        with state.lock:
            state.stats.fallbacks += 1
        state.notify(TaskFallback(state.clock.time(), task.task_id, exhausted.reason))
        return result

    def dead_letter(
        self,
        task: Task,
        exhausted: _Exhausted,
        deadline: float,
        cause: BaseException | None = None,
    ) -> NoReturn:
        """Store the task's dead letter, then raise ``TaskFailed`` (``NoWorkerAvailable``
        when no attempt was made) carrying the record's id and every attempt."""
        state = self.state
        now = state.clock.time()
        letter = DeadLetter.from_task(
            task,
            endpoint=task.endpoint or state.config.pool.default_endpoint,
            error=exhausted.reason,
            attempts=exhausted.attempts,
            now=now,
            first_attempt_at=exhausted.first_at,
            trace=None if exhausted.trace is None else exhausted.trace.to_dict(),
        )
        error = NoWorkerAvailable if not exhausted.attempts else TaskFailed
        try:
            # Durable before the caller hears of the failure; a busy store may not hold
            # the caller much past the task's deadline.
            self.dead_letters.add(letter, timeout=deadline - state.clock.monotonic())
        except Exception as exc:
            self._record_lost(task, exhausted, letter, exc)
            raise error(
                f"task {task.task_id} failed: {exhausted.reason}; and its dead letter could "
                f"not be stored: {type(exc).__name__}: {exc}",
                task_id=task.task_id,
                dead_letter_id=None,
                attempts=exhausted.attempts,
                trace=exhausted.trace,
            ) from exc
        with state.lock:
            state.stats.failed += 1
            state.stats.dead_lettered += 1
        tried = len(exhausted.attempts)
        state.notify(TaskDeadLettered(now, task.task_id, letter.id, tried, exhausted.reason))
        raise error(
            f"task {task.task_id} failed: {exhausted.reason} (dead letter {letter.id})",
            task_id=task.task_id,
            dead_letter_id=letter.id,
            attempts=exhausted.attempts,
            trace=exhausted.trace,
        ) from cause

    def _record_lost(
        self, task: Task, exhausted: _Exhausted, letter: DeadLetter, exc: Exception
    ) -> None:
        """The one case where the record cannot be kept: say so loudly, with the whole
        record in the log so that nothing is lost without a trace."""
        state = self.state
        with state.lock:
            state.stats.failed += 1
        state.notify(
            TaskDeadLettered(
                state.clock.time(), task.task_id, None, len(exhausted.attempts), exhausted.reason
            )
        )
        log.error(
            "task %s failed and its dead letter could not be stored (%s: %s); record: %s",
            task.task_id,
            type(exc).__name__,
            exc,
            json.dumps(letter.to_dict(), default=repr),
        )

    def replay_budget(self, record: DeadLetter) -> float:
        """The longest a replay of ``record`` may run: its task's deadline."""
        return record.timeout or self.state.config.timeouts.task

    def replay(self, task: Task) -> Any:
        """Run a dead-lettered task again without dead-lettering it a second time.

        Called inside the pool's hold on the record (see :class:`DeadLetterQueue`).

        Raises:
            TaskRejected: as for any task.
            TaskFailed: the task failed again (``dead_letter_id`` is empty).
        """
        body = task.body()
        deadline = self.deadline(task, None)
        with self.state.lock:
            self.state.stats.submitted += 1
        observer = self.state.observer
        if observer is None:
            return self._replayed(task, body, deadline, None)
        watch = observer(task)  # a replay is traced as any task
        try:
            result = self._replayed(task, body, deadline, watch)
        except BaseException as exc:
            watch.end(exc)
            raise
        watch.end(None)
        return result

    def _replayed(self, task: Task, body: bytes, deadline: float, watch: TaskWatch | None) -> Any:
        try:
            return TaskRun(self, task, body, deadline, watch=watch).run()
        except _Exhausted as exhausted:
            raise TaskFailed(
                f"task {task.task_id} failed again: {exhausted.reason}",
                task_id=task.task_id,
                dead_letter_id="",
                attempts=exhausted.attempts,
                trace=exhausted.trace,
            ) from None


class TaskRun:
    """One task's way through the workers: what it tried, and why each try failed.

    Not thread-safe: used by the one thread that runs the task. The configuration and
    retry policy are read once, when the task starts: a reload applies to tasks that
    start after it.
    """

    __slots__ = (
        "attempts",
        "blame",
        "bodies",
        "body",
        "budget",
        "check",
        "clock",
        "config",
        "cut_at",
        "deadline",
        "deposit",
        "excluded",
        "extra_headers",
        "failures",
        "headers",
        "hedge",
        "missing_model",
        "model",
        "model_read",
        "not_here",
        "path",
        "placed",
        "policy",
        "reason",
        "start",
        "state",
        "stop",
        "task",
        "trace",
        "wall",
    )

    def __init__(
        self,
        runner: Runner,
        task: Task,
        body: bytes,
        deadline: float,
        stop: TaskStop | None = None,
        watch: TaskWatch | None = None,
    ) -> None:
        state = runner.state
        self.stop = stop
        self.state = state
        self.task = task
        self.body = body
        self.deadline = deadline
        self.config = config = state.config
        self.policy = state.retry
        self.check = runner.result_check
        self.clock = clock = state.clock
        self.path = task.endpoint or config.pool.default_endpoint
        self.headers = {"X-NPU-Task-Id": task.task_id, "X-NPU-Attempt": "1"}
        self.start = start = clock.monotonic()
        # Wall-clock times (for people reading dead letters) from the monotonic clock,
        # saving a clock call per attempt.
        self.wall = clock.time() - start
        self.attempts: list[Attempt] = []  # every attempt that did not succeed
        self.excluded: set[str] = set()  # not to be chosen for the next attempt
        self.not_here: set[str] = set()  # do not serve the task's model: never again
        self.failures = 0  # the attempts counted against retry.max_retries
        self.cut_at = 0.0  # the longest silence an attempt of this task was cut at
        self.missing_model: str | None = None
        # Who is charged when the task itself may be at fault (npu_sync.blame).
        self.blame = Blame()
        self.reason = ""  # why the task gives up, once it does
        # The model the task names (only workers that may hold it are chosen), read
        # when first needed: not at all while no worker is known to lack any model.
        self.model: str | None = None
        self.model_read = False
        self.placed = False  # placement is asked for at most once per task
        self.bodies: dict[WorkerProtocol, bytes] | None = None  # the body, per protocol
        self.budget: RetryBudget = state.budget
        # The task pays into the retry budget in the lock round of its first request
        # for a worker; None once it has.
        self.deposit: Callable[[float], None] | None = self.budget.deposit_locked
        hedge = state.hedge
        self.hedge: HedgePolicy | None = hedge if hedge.enabled else None
        if task.priority is not None:
            state.dispatcher.classes.rank(task.priority)  # an unknown class: InvalidTask
        # The routing trace: the caller's, else begun at the first failed attempt.
        self.trace: Trace | None = task.trace
        # Headers an observer adds to each attempt (a tracing context), if any.
        self.extra_headers: Callable[[str, int], Mapping[str, str]] | None = None
        if watch is not None:
            self.trace = watch.trace
            self.extra_headers = watch.attempt_headers

    def run(self) -> Any:
        """Try the task on one worker after another until an attempt ends it.

        Returns:
            The first successful answer's decoded JSON.

        Raises:
            TaskRejected: the task is bad (a 4xx, or no worker holds its model).
            InvalidTask: the request could not be built (nothing was sent).
            _Exhausted: nothing is left to try; the caller dead-letters the task.
        """
        hedge = self.hedge
        state = self.state
        while True:
            lease = self.wait_for_worker()
            if lease is None:
                break
            if state.models_known and self.lacks_model(lease):
                continue
            if lease.trial and state.shared is not None and not self.fleet_trial(lease):
                continue
            delay = None
            if hedge is not None and not self.attempts:
                delay = hedge.delay_for(self.task.idempotent)
            placer = state.placer
            used = None
            if placer is not None and (model := self.named_model()) is not None:
                used = lease.worker.id  # tasks in flight per model: placement's measure
                placer.started(used, model, self.clock.monotonic())
            try:
                if delay is None:
                    done = self.attempt(lease)
                    if done is not None and state.hooks:
                        self.announce_attempt(lease.worker, done[0], done[2], done[3])
                else:
                    lease, done = self.hedged(lease, delay)
            finally:
                if used is not None and placer is not None and model is not None:
                    placer.ended(used, model, self.clock.monotonic())
            if done is None:
                break
            outcome, deferred, t0, t1 = done
            worker = lease.worker
            if outcome.kind is Kind.SUCCESS:
                if state.model_costs is not None:
                    self.learn(worker, t1 - t0, t1)
                if self.trace is not None:
                    self.traced_attempt(worker, outcome, t0, t1, False)
                if self.blame.held or state.hooks:
                    return self.succeeded(worker, outcome, t1, t1 - t0)
                return outcome.value
            if not self.failed(worker, outcome, deferred, t0, t1):
                break
        raise self.give_up()

    def wait_for_worker(self) -> Lease | None:
        """A lease on the best worker not yet tried (see admission.py), waiting FIFO for
        one up to ``pool.max_queue_wait`` within the deadline; None, with the reason
        in ``self.reason``, when none could be had."""
        deadline = self.deadline
        state = self.state
        task = self.task
        if task.requires or task.prefers:
            ready = self.fit()
            if ready is not None:
                return ready
        costs = state.model_costs
        if (
            costs is not None
            and costs.active
            and (model := self.named_model()) is not None
            and costs.uneven(model)
            and self.config.balancing.latency_aware
            and self.config.balancing.strategy == "least-loaded"
        ):
            ready = self.fastest_for(costs, model)
            if ready is not None:
                return ready
        excluded: set[str] | frozenset[str] = self.excluded
        deposit = self.deposit
        if state.models_known and (model := self.named_model()) is not None:
            lacking = state.lacking(model)
            if lacking:
                if deposit is not None:
                    self.deposit = deposit = None
                    self.budget.deposit(self.start)
                ready = state.dispatcher.try_acquire(excluded := excluded | lacking)
                if ready is not None:
                    if self.trace is not None:
                        self.chose(ready, lacking)
                    return ready
                if not self.serve_model(model):
                    return None
                excluded = self.excluded | state.lacking(model)
        if deposit is not None:
            self.deposit = None
        wait_until = self.clock.monotonic() + self.config.pool.max_queue_wait
        lease = state.dispatcher.acquire_or_reason(
            excluded,
            wait_until if wait_until < deadline else deadline,
            deposit,
            self.stop,
            admission=self.config.admission,
            task_deadline=deadline,
            priority=self.task.priority,
        )
        if isinstance(lease, Lease):
            if self.trace is not None:
                self.chose(lease, excluded)
            return lease
        if isinstance(lease, Refusal):
            if lease is Refusal.STOPPED:
                raise Stopped(self.task.task_id)
            self.reason = self._refusal_reason(lease, wait_until)
        else:
            self.late(lease)
        return None

    def chose(self, lease: Lease, excluded: Collection[str]) -> None:
        """Trace the choice of the lease's worker, and why every other was not chosen."""
        assert self.trace is not None
        state = self.state
        now = self.clock.monotonic()
        lacking = excluded if excluded is not self.excluded else ()
        why, unlisted = considered(
            state.workers.values(), lease.worker, self.excluded, lacking, now
        )
        self.trace.add(
            TraceStep(
                "choice", now + self.wall, lease.worker.id, considered=why, unlisted=unlisted
            )
        )

    def traced_attempt(
        self,
        worker: Worker,
        outcome: Outcome,
        t0: float,
        t1: float,
        held: bool,
        verdict: Verdict | None = None,
    ) -> None:
        """Trace one attempt's end and who it was charged to; a failed task's trace
        begins here when the caller asked for none."""
        trace = self.trace
        if trace is None:
            self.trace = trace = Trace(self.task.task_id)
            trace.add(TraceStep("choice", t0 + self.wall, worker.id))
        charged = (
            "the task: nobody"
            if verdict is Verdict.TASK
            else charged_to(outcome, worker.id, held)
        )
        trace.add(
            TraceStep(
                "attempt",
                t1 + self.wall,
                worker.id,
                outcome=outcome.kind.value,
                status=outcome.status,
                error=outcome.error,
                duration=t1 - t0,
                charged=charged,
            )
        )

    def late(self, late: Late) -> None:
        """The queue ahead is expected to outlast the deadline (:mod:`npu_sync.foresight`):
        a task not yet tried is refused at once, no dead letter stored; a task already
        tried gives up with that reason (and is dead-lettered, as any retry that fails).

        Raises:
            AdmissionRefused: no attempt was made.
        """
        reason = f"refused on admission: {late.reason}"
        if self.trace is not None:
            self.trace.add(TraceStep("note", self.clock.time(), text=reason))
        if self.attempts:
            self.reason = reason
            return
        state = self.state
        task_id = self.task.task_id
        with state.lock:
            state.stats.rejected += 1
        state.notify(TaskRejectedEvent(state.clock.time(), task_id, None, None, reason))
        raise AdmissionRefused(
            f"{reason} (task {task_id})", task_id=task_id, expected=late.expected, left=late.left
        )

    def fleet_trial(self, lease: Lease) -> bool:
        """Whether this task may send the half-open trial its lease holds, with breakers
        shared between processes: one trial per opening for the whole fleet (see
        :func:`take_fleet_trial`). False gives the lease back; the task picks again."""
        remaining = self.deadline - self.clock.monotonic()
        read = self.config.timeouts.read
        return take_fleet_trial(self.state, lease, read if read < remaining else remaining)

    def fit(self) -> Lease | None:
        """Keep the task off the workers that lack what it ``requires`` (for good, like
        a missing model), and a lease on one meeting what it ``prefers`` if one has room
        now (see :mod:`npu_sync.capability`).

        Raises:
            TaskRejected: no configured worker meets ``requires``; nothing is sent.
        """
        state = self.state
        task = self.task
        config = state.config
        needs = state.capabilities
        if task.requires:
            unfit = needs.unfit(config, task.requires)
            if unfit:
                if len(unfit) >= len(config.workers):
                    why = needs.missing(config, task.requires)
                    raise self.reject_unfit(why)
                self.excluded |= unfit
                self.not_here |= unfit
        if not task.prefers:
            return None
        others = needs.unfit(config, task.prefers)
        if not others or len(others) >= len(config.workers):
            return None  # all or none preferred: the usual choice is the preferred one
        excluded = self.excluded | others
        if state.models_known and (model := self.named_model()) is not None:
            excluded |= state.lacking(model)
        if self.deposit is not None:
            self.deposit = None
            self.budget.deposit(self.start)
        return state.dispatcher.try_acquire(excluded)

    def learn(self, worker: Worker, rtt: float, now: float) -> None:
        """A success took ``rtt``: feed the per-(worker, model) estimate."""
        model = self.named_model()
        costs = self.state.model_costs
        if model is not None and costs is not None:
            costs.observe(worker.id, model, rtt, now, self.task.size)

    def fastest_for(self, costs: ModelCosts, model: str) -> Lease | None:
        """A lease on the worker fastest for ``model`` by its per-model estimate, if
        that worker has room now (see :mod:`npu_sync.modelcost`); else None, and the
        usual choice follows."""
        state = self.state
        now = self.clock.monotonic()
        excluded = self.excluded
        lacking = state.lacking(model) if state.models_known else frozenset()
        workers = list(state.workers.values())
        candidates = [
            w for w in workers if w.id not in excluded and w.id not in lacking and w.eligible(now)
        ]
        if len(candidates) < 2:
            return None
        best = costs.best(candidates, model, now, self.task.size)
        if best is None:
            return None
        if self.deposit is not None:
            self.deposit = None
            self.budget.deposit(self.start)
        return state.dispatcher.try_acquire([w.id for w in workers if w is not best])

    def reject_unfit(self, why: str) -> TaskRejected:
        """The rejection of a task no configured worker can serve; nobody is charged."""
        state = self.state
        task_id = self.task.task_id
        with state.lock:
            state.stats.rejected += 1
        needs = ", ".join(sorted(self.task.requires))
        message = f"no worker meets the task's requires ({needs}): {why}"
        state.notify(TaskRejectedEvent(state.clock.time(), task_id, None, None, message))
        return TaskRejected(f"{message} (task {task_id})", task_id=task_id)

    def lacks_model(self, lease: Lease) -> bool:
        """Whether the lease's worker was learnt to lack the task's model while the task
        waited for it (another task's attempt bounced there): if so, the lease is given
        back unused and the worker is not tried, so an unload costs one bounce per
        worker, not one per queued task. Asked only once some worker has a model list
        (``models_known``)."""
        model = self.named_model()
        worker = lease.worker
        if model is None or worker.id not in self.state.lacking(model):
            return False
        record(self.state, lease, _UNUSED, 0.0, self.clock.monotonic(), retry=False)
        self.excluded.add(worker.id)
        self.not_here.add(worker.id)
        self.missing_model = model
        return True

    def named_model(self) -> str | None:
        """The model the task names, read once, by the protocols the workers speak."""
        if not self.model_read:
            self.model = self.state.task_model(self.task.payload)
            self.model_read = True
        return self.model

    def serve_model(self, model: str) -> bool:
        """Whether some live worker may hold ``model`` (so waiting for one may help),
        after loading it on one if ``models.placement`` allows.

        Live means enabled, healthy, not draining, its breaker not open: a worker that
        is merely busy is worth waiting for, one that is down is not. A task that has
        already failed on a worker gives up (False, the reason in ``self.reason``): it
        may well succeed when replayed, once that worker is back.

        Raises:
            TaskRejected: no live worker serves the model, naming it (``exc.model``),
                and no attempt failed.
        """
        state = self.state
        with state.lock:
            now = self.clock.monotonic()
            down: list[str] = []
            lacking = 0
            for worker in state.workers.values():
                if worker.held.lacks(model):
                    lacking += 1
                    continue
                why = down_reason(worker, now)
                if why is None:
                    return True
                down.append(f"{worker.id}: {why}")
        detail = f"{lacking} worker(s) do not hold it"
        if down:
            detail += "; " + ", ".join(down[:5]) + (" ..." if len(down) > 5 else "")
        if self.failures:
            self.reason = f"no live worker serves model {_shown(model)} ({detail})"
            return False
        if self.config.models.placement and not self.placed:
            self.placed = True
            failed = self.place(model)
            if failed is None:
                self.readmit(model)
                return True
            detail += f"; {failed}"
        raise self.reject_model(model, detail)

    def readmit(self, model: str) -> None:
        """``model`` was just loaded: a worker this task found without it (it unloaded
        the model behind the pool's back) may hold it now, and may be tried again."""
        state = self.state
        with state.lock:
            back = {
                wid
                for wid in self.not_here
                if (w := state.workers.get(wid)) is not None and not w.held.lacks(model)
            }
        self.not_here -= back
        self.excluded -= back

    def place(self, model: str) -> str | None:
        """Have the least-loaded live worker load ``model`` (``models.placement``).

        One load per model at a time: a task that finds one under way waits for it,
        within its deadline, rather than ask again. Returns None once the model is
        loaded, else why it is not.
        """
        state = self.state
        placer = state.placer
        if placer is not None:  # models.balance: where loading is cheapest, evicting
            why = placer.place(model, self.deadline - self.clock.monotonic(), self.stop)
            if self.stop is not None and self.stop.cancelled:
                raise Stopped(self.task.task_id)
            return why
        with state.lock:
            placement = state.placements.get(model)
            worker = None
            if placement is None:
                if self._served_locked(model):
                    return None  # another task's placement ended since this one looked
                worker = self._placement_worker()
                if worker is None:
                    return "no live worker to load it on"
                placement = state.placements[model] = Placement(worker.id)
        if worker is None:
            if not self.await_placement(placement):
                return f"loading it on {placement.worker_id} did not end before the deadline"
            return placement.error
        error: str | None = "loading it was interrupted"
        try:
            error = self.load(worker, model)
        finally:
            with state.lock:
                del state.placements[model]
                if error is None and state.workers.get(worker.id) is not worker:
                    error = f"{worker.id} left the pool while loading it"
                if error is None:
                    worker.held.model_placed(model)
                    state.models_changed_locked()
                    state.model_counts["placements"] += 1
                else:
                    state.model_counts["placement_failures"] += 1
                models = worker.held.models
                placement.error = error
                # Under the lock: a waiter that can be stopped checks done under it.
                placement.done.set()
                wakers = list(placement.wakers)
            for waker in wakers:
                waker.set()
        if error is None:
            state.notify(
                WorkerModelsChanged(
                    state.clock.time(),
                    worker.id,
                    "placed",
                    (model,),
                    (),
                    None if models is None else tuple(sorted(models)),
                )
            )
        return error

    def await_placement(self, placement: Placement) -> bool:
        """Wait for another task's placement to end, within the deadline: whether it
        did. A model may take minutes to load: a task stopped meanwhile leaves at once
        (``Stopped``), its thread free, the load going on for the others.
        """
        left = max(0.0, self.deadline - self.clock.monotonic())
        stop = self.stop
        if stop is None:
            return placement.done.wait(left)
        woken = threading.Event()
        with self.state.lock:
            if placement.done.is_set():
                return True
            placement.wakers.append(woken)
        try:
            if stop.on_cancel(woken.set):
                try:
                    woken.wait(left)
                finally:
                    stop.forget(woken.set)
        finally:
            with self.state.lock:
                placement.wakers.remove(woken)
        if placement.done.is_set():
            return True
        if stop.cancelled:
            raise Stopped(self.task.task_id)
        return False

    def _served_locked(self, model: str) -> bool:
        """Whether a live worker may serve ``model``. Under the lock."""
        now = self.clock.monotonic()
        return any(
            not w.held.lacks(model) and down_reason(w, now) is None
            for w in self.state.workers.values()
        )

    def _placement_worker(self) -> Worker | None:
        """The live worker with the least load for its weight. Under the lock."""
        now = self.clock.monotonic()
        best: Worker | None = None
        best_load = 0.0
        for worker in self.state.workers.values():
            if down_reason(worker, now) is None:
                load = worker.in_flight / worker.weight
                if best is None or load < best_load:
                    best, best_load = worker, load
        return best

    def load(self, worker: Worker, model: str) -> str | None:
        """Send ``worker`` its protocol's load request for ``model``, no lock held,
        within the task's deadline; None when it answered 2xx (and not "failed")."""
        method, path, body = worker.protocol.load_request(model)
        auth = worker.auth
        timeouts = self.config.timeouts
        try:
            response = worker.transport.request(
                method,
                path,
                body=None if body is None else json.dumps(body).encode(),
                headers=None if auth is None else auth.headers(method, worker.base_path + path),
                timeout=max(_MIN_ATTEMPT, self.deadline - self.clock.monotonic()),
                connect_timeout=timeouts.connect,
            )
        except TransportError as exc:
            # The worker's words enter the pool here too: scrubbed, bounded.
            why = self.state.scrubber(printable(f"{exc.kind}: {exc}"))
            return f"loading it on {worker.id} failed: {why}"
        except Exception as exc:  # a bug of ours, or of a custom transport
            log.exception("unexpected error loading model on worker %s", worker.id)
            return f"loading it on {worker.id} failed: {type(exc).__name__}"
        outcome = worker.protocol.classify(response)
        if outcome.kind is Kind.SUCCESS:
            value = outcome.value
            if not (type(value) is dict and value.get("status") in ("failed", "error")):
                return None
        why = self.state.scrubber(outcome.error or f"HTTP {response.status}")
        return f"loading it on {worker.id} failed: {why}"

    def reject_model(self, model: str, detail: str) -> TaskRejected:
        """The rejection of a task whose model no live worker serves; no attempt is
        charged to anybody."""
        state = self.state
        task_id = self.task.task_id
        with state.lock:
            state.stats.rejected += 1
        message = f"no live worker serves model {_shown(model)} ({detail})"
        state.notify(TaskRejectedEvent(state.clock.time(), task_id, None, None, message))
        return TaskRejected(f"{message} (task {task_id})", task_id=task_id, model=model)

    def _refusal_reason(self, refusal: Refusal, wait_until: float) -> str:
        """Why no worker was had: the limit that ran out, or, when waiting could not
        help, the state of the workers in one clause (:func:`outage.describe`)."""
        if refusal is not Refusal.DEADLINE_PASSED:
            return self._fleet_state()
        if wait_until >= self.deadline:
            return "deadline passed" if self.attempts else str(refusal.value)
        limit = f"pool.max_queue_wait ({self.config.pool.max_queue_wait:g}s)"
        return f"no worker could take the task within {limit}"

    def _fleet_state(self) -> str:
        """The workers' state, as a task that none of them can take sees it."""
        state = self.state
        model = self.model if self.model_read else None
        with state.lock:
            lacking = state.lacking(model) if model is not None and state.models_known else ()
            return describe(
                state.workers.values(),
                self.clock.monotonic(),
                tried=self.excluded,
                lacking=lacking,
                model=model,
            )

    def attempt(
        self, lease: Lease, race: _Race | None = None, side: int = _FIRST
    ) -> tuple[Outcome, bool, float, float] | None:
        """One attempt on the lease's worker, its outcome recorded.

        From here until :func:`record` takes it back, the lease holds a slot on the
        worker (maybe its one half-open trial): whatever is raised, it is given back.
        A hedged attempt (``race``) that ends after the other one won was cancelled:
        it is recorded as abandoned, even if its answer was a success.

        Returns:
            The outcome, whether its charge is held (see :mod:`npu_sync.blame`), and
            when the attempt started and ended; None when too little time is left to
            start one (``self.reason`` says so).
        """
        state = self.state
        clock = self.clock
        stop = self.stop
        recorded = False
        try:
            if state.transitions:
                state.flush_transitions()
            t0 = clock.monotonic()
            remaining = self.deadline - t0
            if remaining <= _MIN_ATTEMPT:
                recorded = True
                record(state, lease, _UNUSED, 0.0, t0, retry=False)
                if side == _FIRST:
                    self.reason = "deadline passed"
                return None
            if stop is not None and stop.cancelled and side == _FIRST:
                # Stopped while the lease was handed over: give it back unused.
                raise Stopped(self.task.task_id)
            if race is not None:
                outcome = self.send(lease.worker, t0, remaining, side, race.cancels[side])
            elif stop is not None:
                outcome = self.send(lease.worker, t0, remaining, side, stop)
            else:
                outcome = self.send(lease.worker, t0, remaining)
            if stop is not None and stop.cancelled and outcome.kind is not Kind.SUCCESS:
                # Cut short by the caller: says nothing about the worker.
                outcome = Outcome(Kind.ABANDONED, error=stop.reason)
            t1 = clock.monotonic()
            wid = lease.worker.id
            success = outcome.kind is Kind.SUCCESS
            if (
                success
                and lease.worker.routed != lease.generation
                and self.path == self.config.pool.default_endpoint
            ):
                route_answered(lease.worker, lease.generation)
            if race is not None and race.settle(side, success):
                # The other attempt won. A success here came too late (a transport that
                # cannot cancel): dropped like a failure, credited to nobody.
                outcome = Outcome(Kind.ABANDONED, error="cancelled: the hedged task was answered")
            elif success and side == _FIRST and self.hedge is not None:
                self.hedge.observe(t1 - t0)
            if outcome.kind is Kind.NOT_HERE:
                # Before record() hands the slot on: the next task must know.
                self.not_loaded(lease.worker, outcome)
            # An answer that may be the task's fault: is its charge held? Asked on the
            # caller's side only: the hedge's thread never touches the blame, so a
            # hedge's suspect answer is held until the caller settles it (settle_hedge).
            deferred = outcome.suspect and (
                side == _HEDGE
                or self.blame.hold(
                    wid,
                    outcome,
                    lambda: untried_left(state, self.excluded | {wid}, self.deadline),
                )
            )
            recorded = True
            record(state, lease, outcome, t1 - t0, t1, retry=self.failures > 0, defer=deferred)
        finally:
            if not recorded:
                record(state, lease, _UNUSED, 0.0, clock.monotonic(), retry=False)
        stopped = stop is not None and stop.cancelled and side == _FIRST
        if stopped and outcome.kind is not Kind.SUCCESS:
            if state.hooks:  # counted as stats() counts it (the caller announces others)
                self.announce_attempt(lease.worker, outcome, t0, t1)
            raise Stopped(self.task.task_id)
        return outcome, deferred, t0, t1

    def send(
        self,
        worker: Worker,
        t0: float,
        remaining: float,
        side: int = _FIRST,
        cancel: Cancel | None = None,
    ) -> Outcome:
        """POST the task to ``worker``, no lock held, and classify what came back.

        What the worker said enters the pool here: its text is scrubbed of the
        configuration's secrets and bounded (``PoolState.scrubber``) before anything
        stores or shows it.

        One budget covers the whole exchange: ``timeouts.read`` cut to what is left of
        the deadline, of which connecting may take at most ``timeouts.connect``. A
        hedge (``side``) is ``X-NPU-Attempt: 2`` and may be cancelled (``cancel``) by
        the other attempt's answer, as may that one.

        Raises:
            InvalidTask: refused before anything was sent (a header that cannot be
                encoded): the task's fault, so no worker is charged and nothing is
                retried.
        """
        return _scrubbed(self._exchange(worker, t0, remaining, side, cancel), self.state.scrubber)

    def _exchange(
        self, worker: Worker, t0: float, remaining: float, side: int, cancel: Cancel | None
    ) -> Outcome:
        timeouts = self.config.timeouts
        connect_timeout = timeouts.connect
        read_timeout = timeouts.read
        headers = self.headers
        if side == _HEDGE:
            headers = {**headers, "X-NPU-Attempt": "2"}
        elif self.attempts:
            headers["X-NPU-Attempt"] = str(len(self.attempts) + 1)
        protocol = worker.protocol
        if protocol.plain_requests:
            body = self.body
        else:
            payload = self.task.payload
            mapped = protocol.request_body(payload)
            body = self.body if mapped is payload else self.body_for(protocol, mapped)
        auth = worker.auth
        if auth is not None:
            headers = {**headers, **auth.headers("POST", worker.base_path + self.path)}
        if self.extra_headers is not None:  # never over the pool's own or the auth's
            headers = {**self.extra_headers(worker.id, int(headers["X-NPU-Attempt"])), **headers}
        transport = worker.transport
        timeout = read_timeout if read_timeout < remaining else remaining
        extra: dict[str, Any] = {}
        if cancel is not None and getattr(transport, "cancellable", False):
            extra["cancel"] = cancel
        silence = self.silence(worker, timeout)
        if silence is not None:
            if getattr(transport, "silences", False):
                extra["silence"] = silence
            else:
                timeout = silence  # a transport that cannot tell silence: total time
        try:
            response = transport.request(
                "POST",
                self.path,
                body=body,
                headers=headers,
                timeout=timeout,
                connect_timeout=connect_timeout,
                replayable=self.task.idempotent,
                **extra,
            )
            outcome = protocol.classify(response, now=t0 + self.wall)
            if (
                outcome.kind is Kind.REJECTED
                and self.path == self.config.pool.default_endpoint
                and not proven_route(worker)
            ):
                outcome = misrouted(outcome, "POST", worker.base_path + self.path)
            check = self.check
            if check is not None and outcome.kind is Kind.SUCCESS:
                outcome = _checked(check, outcome)
        except TransportError as exc:
            if silence is not None and (
                exc.stalled or (exc.kind == "timeout" and exc.sent and "silence" not in extra)
            ):
                self.cut_at = max(self.cut_at, silence)
                if not exc.stalled:  # the budget cut to the limit ran out
                    happened = f"{worker.id}: stalled: no answer within {silence:g}s"
                    exc = TransportError("timeout", happened, sent=True, stalled=True)
                return classify_error(exc)
            # A timeout is the worker's only when its own timeout ran out: one cut
            # short by the task's deadline says nothing about the worker. Connecting
            # gets at most the smaller of the two timeouts.
            own = read_timeout if exc.sent else min(connect_timeout, read_timeout)
            return classify_error(exc, cut_by_caller=remaining < own)
        except InvalidTask:
            raise
        except Exception as exc:  # a bug of ours, or of a custom transport
            log.exception("unexpected error sending task to worker %s", worker.id)
            return Outcome(Kind.ABANDONED, error=f"{type(exc).__name__}: {exc}")
        return outcome

    def silence(self, worker: Worker, budget: float) -> float | None:
        """How long this attempt may wait without a byte of the answer (see
        :mod:`npu_sync.stall`), or None when only ``budget`` bounds it."""
        stall = self.policy.stall
        if not stall.enabled or not self.task.idempotent:
            # A non-idempotent task cannot be retried elsewhere: cutting it would lose
            # the answer of a worker that is only slow, for nothing but an earlier
            # failure. Its read timeout and deadline bound it, as before.
            return None
        pace = worker.pace
        peers = () if pace.enough else _peers(self.state, worker)
        return stall.silence(
            stall.known(pace, peers), budget, declared=self.task.timeout, cut_before=self.cut_at
        )

    def not_loaded(self, worker: Worker, outcome: Outcome) -> None:
        """Correct the worker's models after a "not loaded" answer. It lacks the model
        the task names, whatever its answer calls it: recording another name would
        send it every later task for this model."""
        model = self.named_model() or worker.protocol.not_loaded_model(outcome)
        if model is not None:
            self.state.model_not_loaded(worker, model)

    def body_for(self, protocol: WorkerProtocol, mapped: Any) -> bytes:
        """The body ``protocol`` maps the payload to, encoded once per task."""
        bodies = self.bodies
        if bodies is None:
            bodies = self.bodies = {}
        body = bodies.get(protocol)
        if body is None:
            try:
                body = json.dumps(mapped, separators=(",", ":"), allow_nan=False).encode()
            except (TypeError, ValueError) as exc:
                task_id = self.task.task_id
                raise InvalidTask(f"task {task_id}: {protocol.name} body: {exc}") from None
            bodies[protocol] = body
        return body

    def hedged(
        self, lease: Lease, delay: float
    ) -> tuple[Lease, tuple[Outcome, bool, float, float] | None]:
        """The first attempt of an idempotent task, hedged after ``delay`` seconds.

        The caller's thread sends the attempt itself; a timer sends the task to a
        second worker (:meth:`fire_hedge`) if no answer came by then. The first
        success wins and the other attempt is cancelled. Without a success here,
        the hedge's outcome is waited for: it is the retry this task would make.

        Returns:
            The lease and outcome the task goes on with (as :meth:`attempt`'s).
        """
        race = _Race()
        state = self.state
        first = lease.worker
        if self.stop is not None:

            def stopped() -> None:
                race.abandon()
                race.cancels[_FIRST].cancel()

            # The task's stop ends both attempts. Never forgotten: one hedged attempt
            # per task, and stopping a race that is over changes nothing that counts.
            self.stop.on_cancel(stopped)
        state.hedger.schedule(
            self.clock.monotonic() + delay, lambda: self.fire_hedge(race, first, delay)
        )
        try:
            done = self.attempt(lease, race, _FIRST)
        except BaseException:
            race.abandon()  # nothing may be sent once the caller is told nothing was
            raise
        if done is not None and state.hooks:
            self.announce_attempt(first, done[0], done[2], done[3])
        success = done is not None and done[0].kind is Kind.SUCCESS
        wait = max(0.0, self.deadline - self.clock.monotonic()) + 1.0
        hedge = race.first_ended(success, wait)
        if hedge is None:
            return lease, done
        hedge_lease, hedge_done = hedge
        hedge_done = self.settle_hedge(hedge_lease.worker, hedge_done, success)
        if success:
            return lease, done
        kind = hedge_done[0].kind
        if done is not None and done[0].kind is not Kind.ABANDONED:
            if kind is Kind.REJECTED:
                return hedge_lease, hedge_done
            self.note(first, done)  # the hedge goes on; the first failure is noted
            return hedge_lease, hedge_done
        if kind is Kind.SUCCESS or kind is Kind.REJECTED or done is None:
            return hedge_lease, hedge_done
        self.note(hedge_lease.worker, hedge_done)
        return lease, done

    def settle_hedge(
        self, worker: Worker, done: tuple[Outcome, bool, float, float], won_elsewhere: bool
    ) -> tuple[Outcome, bool, float, float]:
        """On the caller's thread: the charge for a hedge's suspect answer, held when it
        came (see :meth:`attempt`), is made now if the blame says so, as the caller's
        own answer's would have been: at once for a task's first HTTP 500, or because
        the task was answered by the other attempt. Else it stays held.

        Returns:
            ``done``, its ``deferred`` flag saying whether the charge is still held.
        """
        outcome, deferred, t0, t1 = done
        if not deferred:
            return done
        wid = worker.id
        if not won_elsewhere and (
            outcome.kind is Kind.REJECTED
            or self.blame.hold(
                wid,
                outcome,
                lambda: untried_left(self.state, self.excluded | {wid}, self.deadline),
            )
        ):
            return done
        held = Held(worker, outcome.error, t1 - t0, outcome.kind is Kind.REJECTED)
        charge(self.state, [held], 0.0, self.clock.monotonic())
        return outcome, False, t0, t1

    def note(self, worker: Worker, done: tuple[Outcome, bool, float, float]) -> None:
        """A hedged attempt that failed while the other goes on: remembered, its worker
        not tried again, counted as a retry."""
        outcome, deferred, t0, t1 = done
        self.attempts.append(
            Attempt(worker.id, outcome.error, t1 - t0, outcome.status, t0 + self.wall)
        )
        self.excluded.add(worker.id)
        verdict = self.blame.judge(worker, outcome, t1 - t0, deferred) if outcome.suspect else None
        self.traced_attempt(worker, outcome, t0, t1, deferred, verdict)
        if outcome.kind is Kind.NOT_HERE:
            self.not_here.add(worker.id)
            self.missing_model = self.named_model() or outcome.model
        elif outcome.kind is not Kind.ABANDONED:
            self.failures += 1

    def fire_hedge(self, race: _Race, first: Worker, delay: float) -> None:
        """On the timer's thread, ``delay`` after the first attempt began: send the task
        to another worker if it is still unanswered, a worker has room now (a hedge
        never waits, nor takes a slot a queued task waits for) and the retry budget
        allows it. Otherwise the hedge is skipped."""
        if not race.claim():
            return
        state = self.state
        hedge = self.hedge
        lease: Lease | None = None
        try:
            lease = state.dispatcher.try_acquire(self.excluded | {first.id})
            # A shared breaker's trial needs the fleet's lease, a Redis round trip the
            # hedge's timer thread does not make: it is left to a task.
            fleet_trial = lease is not None and lease.trial and state.shared is not None
            if lease is not None and not fleet_trial and self.budget.try_withdraw():
                if self.trace is not None:
                    self.trace.add(TraceStep("hedge", self.clock.time(), lease.worker.id))
                if state.hooks:
                    event = AttemptHedged(
                        self.clock.time(), self.task.task_id, first.id, lease.worker.id, delay
                    )
                    emit(state.hooks, event)
                try:
                    state.hedger.submit(self.run_hedge, race, lease)
                except RuntimeError:  # close() stopped the hedger: not an error
                    log.debug("hedge for task %s not sent: the pool closed", self.task.task_id)
                else:
                    lease = None
                    return
        except Exception:
            log.exception("could not send a hedge for task %s", self.task.task_id)
        if lease is not None:
            record(state, lease, _UNUSED, 0.0, self.clock.monotonic(), retry=False)
        if hedge is not None:
            hedge.count_skipped()
        race.hedge_ended(None)

    def run_hedge(self, race: _Race, lease: Lease) -> None:
        """On a hedge thread: the hedge attempt, then its result handed to the caller."""
        done = None
        try:
            done = self.attempt(lease, race, _HEDGE)
            if done is not None:
                if self.state.hooks:
                    self.announce_attempt(lease.worker, done[0], done[2], done[3], number=2)
                if self.hedge is not None:
                    self.hedge.count_hedge(won=race.winner == _HEDGE)
        except Exception:
            log.exception("hedge for task %s failed", self.task.task_id)
        finally:
            race.hedge_ended((lease, done) if done is not None else None)

    def announce_attempt(
        self, worker: Worker, outcome: Outcome, t0: float, t1: float, number: int | None = None
    ) -> None:
        """Tell the hooks how the attempt ended (built only when there are hooks)."""
        emit(
            self.state.hooks,
            AttemptFinished(
                t1 + self.wall,
                self.task.task_id,
                worker.id,
                len(self.attempts) + 1 if number is None else number,
                outcome.kind.value,
                outcome.status,
                outcome.error,
                t1 - t0,
            ),
        )

    def succeeded(self, worker: Worker, outcome: Outcome, t1: float, took: float) -> Any:
        """The task's result. The answers held as maybe the task's own fault were the
        workers' after all: they are charged now (``took``: this attempt's time)."""
        if self.blame.held:
            proven = self.blame.proven(took)
            charge(self.state, proven, took, t1)
            if self.trace is not None and proven:
                charged = ", ".join(held.worker.id for held in proven)
                text = f"held answers charged after {worker.id} answered: {charged}"
                self.trace.add(TraceStep("note", t1 + self.wall, text=text))
        hooks = self.state.hooks
        if hooks:
            emit(
                hooks,
                TaskSucceeded(
                    t1 + self.wall,
                    self.task.task_id,
                    worker.id,
                    len(self.attempts) + 1,
                    t1 - self.start,
                ),
            )
        return outcome.value

    def failed(
        self, worker: Worker, outcome: Outcome, deferred: bool, t0: float, t1: float
    ) -> bool:
        """Note a failed attempt and decide what comes next.

        Returns:
            True to try again (after the backoff, slept here); False to give up, with
            the reason in ``self.reason``.

        Raises:
            TaskRejected: the worker said the task itself is bad.
        """
        task = self.task
        if self.stop is not None and self.stop.cancelled:
            raise Stopped(task.task_id)  # a hedged attempt's end after the caller left
        self.attempts.append(
            Attempt(worker.id, outcome.error, t1 - t0, outcome.status, t0 + self.wall)
        )
        kind = outcome.kind
        verdict = self.blame.judge(worker, outcome, t1 - t0, deferred) if outcome.suspect else None
        self.traced_attempt(worker, outcome, t0, t1, deferred, verdict)
        if verdict is Verdict.TASK:
            return self.tasks_fault(worker, outcome, t1)
        if kind is Kind.REJECTED and not outcome.suspect:
            self.reject(worker, outcome, t1)  # the protocol says the task is bad
        self.excluded.add(worker.id)
        if kind is Kind.NOT_HERE or kind is Kind.MISCONFIGURED:
            self.not_here.add(worker.id)  # never again for this task
            if kind is Kind.NOT_HERE:
                self.missing_model = self.named_model() or outcome.model
            return True
        if kind is Kind.REJECTED:
            # Refused: another worker tells whether the task or this worker is at
            # fault. With no other worker, this one's word stands.
            if untried_left(self.state, self.excluded, self.deadline):
                return True
            self.reject(worker, outcome, t1)
        if not task.idempotent and outcome.processed:
            self.reason = f"worker {worker.id} failed a non-idempotent task that may have run"
            return False
        if kind is Kind.ABANDONED and untried_left(self.state, self.excluded, self.deadline):
            return True  # nothing learnt about the worker: no backoff, no retry counted
        # An abandoned attempt with no other worker left (a stale connection on the
        # only worker) is retried like a failure: after a backoff, within max_retries.
        self.failures += 1
        wait = self.backoff(t1)
        if wait is None:
            return False
        self.state.notify(
            RetryScheduled(
                t1 + self.wall, task.task_id, worker.id, len(self.attempts), wait, outcome.error
            )
        )
        stop = self.stop
        if stop is None:
            self.clock.sleep(wait)
        elif self.clock.wait(stop.event, wait):
            raise Stopped(task.task_id)
        return True

    def tasks_fault(self, worker: Worker, outcome: Outcome, t1: float) -> bool:
        """A second worker answered this task as another already had: the task is at
        fault, not they. Nobody is charged; a refusal raises ``TaskRejected``, a
        failure ends the task (False, the reason in ``self.reason``)."""
        if outcome.kind is Kind.REJECTED:
            self.reject(worker, outcome, t1)
        first, second = self.blame.same or ("?", worker.id)
        if outcome.error_kind == "too_large":
            self.reason = "two workers answered beyond transport.max_response_bytes"
        else:
            self.reason = (
                f"workers {first} and {second} failed the task the same way, so it is taken "
                "as the task's fault (no worker charged)"
            )
        return False

    def reject(self, worker: Worker, outcome: Outcome, t1: float) -> NoReturn:
        """The task is bad (a 4xx, or the protocol says so): no retry, nobody charged."""
        task_id = self.task.task_id
        at = t1 + self.wall
        state = self.state
        with state.lock:
            state.stats.rejected += 1
        event = TaskRejectedEvent(at, task_id, worker.id, outcome.status, outcome.error or "")
        self.state.notify(event)
        raise TaskRejected(
            f"worker {worker.id} rejected task {task_id}: {outcome.error}",
            task_id=task_id,
            status=outcome.status,
            worker_id=worker.id,
            body=outcome.value,
        )

    def backoff(self, t1: float) -> float | None:
        """How long to wait before the next attempt; None, with the reason, when no next
        attempt can help: retries spent, no worker able to take the task in time, or
        the deadline before the backoff ends."""
        wait = self.policy.next_wait(self.failures, t1 - self.start)
        if wait is None:
            self.reason = f"all {self.failures} attempt(s) failed"
            return None
        # A worker is worth waiting for only if it can take the task before the next
        # attempt would stop waiting for one (pool.max_queue_wait, or the deadline).
        horizon = min(self.deadline, t1 + wait + self.config.pool.max_queue_wait)
        if not untried_left(self.state, self.excluded, horizon):
            # Every worker was tried. Trying one again is better than failing, once
            # the backoff has passed: the failure may have been transient.
            self.excluded = set(self.not_here)
            if not untried_left(self.state, self.excluded, horizon):
                self.reason = _EVERY_WORKER_TRIED
                return None
        if t1 + wait >= self.deadline:
            self.reason = "deadline passed"
            return None
        if not self.budget.try_withdraw(t1):
            self.reason = _BUDGET_EXHAUSTED
            return None
        return wait

    def give_up(self) -> Exception:
        """What ends a task no attempt succeeded for: ``TaskRejected`` when the only
        answers were that no worker holds its model, else ``_Exhausted``, whose reason
        names the last error."""
        reason = self.reason
        task_id = self.task.task_id
        model = self.missing_model
        if model is not None and not self.failures and reason == _EVERY_WORKER_TRIED:
            state = self.state
            with state.lock:
                state.stats.rejected += 1
            message = f"no worker serves model {_shown(model)}"
            state.notify(TaskRejectedEvent(state.clock.time(), task_id, None, 500, message))
            return TaskRejected(
                f"{message} (task {task_id})", task_id=task_id, status=500, model=model
            )
        held = self.blame.held
        if not self.failures and self.blame.refused_only():
            # Refused, and no other worker could be asked: the refusal stands.
            last = self.attempts[-1]
            state = self.state
            with state.lock:
                state.stats.rejected += 1
            message = f"worker {last.worker_id} rejected task {task_id}: {last.error}"
            state.notify(
                TaskRejectedEvent(state.clock.time(), task_id, last.worker_id, last.status, message)
            )
            return TaskRejected(
                message, task_id=task_id, status=last.status, worker_id=last.worker_id
            )
        if held:
            log.info(
                "task %s never succeeded: the %d answer(s) that may have been its own fault "
                "(a 4xx, HTTP 500, a failed task, an answer too large) charged nobody",
                task_id,
                len(held),
            )
        attempts = self.attempts
        last_error = attempts[-1].error if attempts else None
        if last_error:
            wid = attempts[-1].worker_id
            # Transport errors name their worker already ("timeout: a: timed out ...").
            on = "" if f"{wid}: " in last_error else f" on {wid}"
            reason = f"{reason}; last error{on}: {last_error}"
        exhausted = _Exhausted(reason, attempts, self.start + self.wall)
        trace = exhausted.trace = self.trace
        if trace is not None:
            trace.add(TraceStep("note", self.clock.time(), text=f"gave up: {exhausted.reason}"))
        return exhausted


# -- recording an attempt's outcome, under the pool's lock -----------------------------


def record(
    state: PoolState,
    lease: Lease,
    outcome: Outcome,
    duration: float,
    now: float,
    *,
    retry: bool,
    defer: bool = False,
) -> None:
    """Give ``lease`` back and count what its attempt came to.

    Under the pool's lock, for no I/O and no user code: the worker's slot and breaker,
    the counters and latency samples, the freed slot handed to the next waiter. Then
    without it: breaker changes announced (hooks run, other processes told: Redis I/O),
    a removed worker's connections closed once it is idle.

    Args:
        retry: the attempt retried the task (counted in ``stats()``).
        defer: a failure whose charge is held (see :mod:`npu_sync.blame`).
    """
    worker = lease.worker
    kind = outcome.kind
    with state.lock:
        worker.in_flight -= 1
        if outcome is _UNUSED:
            _count_no_fault_locked(state, lease, outcome)
        elif lease.generation != worker.generation:
            # An attempt on the worker's old address: it says nothing about the new
            # one (nor about its breaker), so only the slot is given back, and a
            # result still counts as the task's success.
            if kind is Kind.SUCCESS:
                state.stats.succeeded += 1
            kind = Kind.NOT_HERE
        elif kind is Kind.MISCONFIGURED:
            # Not a fast answer to learn a latency from, nor the worker's sickness:
            # credentials refused (until they are tried again), or not an NPU worker
            # (until a health check is a worker's answer, or a reload moves it).
            if outcome.status in REFUSED_CREDENTIALS:
                _count_refused_locked(state, lease, outcome, now)
            else:
                _count_no_fault_locked(state, lease, outcome)
        else:
            # What balancing learns first: the worker's latency, and its adaptive
            # limit's sample.
            state.dispatcher.selector.observe(worker, duration, now, kind is Kind.SUCCESS)
            if worker.limit is not None:
                _sample_limit_locked(state, lease, outcome, duration)
            if kind is Kind.SUCCESS:
                worker.pace.observe(duration)
                stats = worker.stats
                stats.attempts += 1
                worker.breaker.record_success(lease.trial)
                stats.succeeded += 1
                stats.observe(now, duration, True)
                state.stats.succeeded += 1
            elif kind is Kind.FAILURE:
                _count_failure_locked(state, lease, outcome, duration, now, defer)
            else:
                _count_no_fault_locked(state, lease, outcome)
        if retry:
            state.stats.retries += 1
        state.dispatcher.release_worker_locked(worker, now)
        drained = worker.removed and not worker.in_flight
        if drained and state.draining.get(worker.id) is worker:
            del state.draining[worker.id]
    if state.transitions:
        state.flush_transitions()
    if state.events:
        state.flush_events()
    if drained:
        worker.transport.close()


def _sample_limit_locked(state: PoolState, lease: Lease, outcome: Outcome, duration: float) -> None:
    """What the worker's adaptive limit learns from an attempt: a success, or an
    overload answer or timeout (a dropped sample)."""
    worker = lease.worker
    kind = outcome.kind
    if kind is Kind.SUCCESS:
        dropped = False
    elif kind is Kind.FAILURE and (
        outcome.status in (429, 503)
        or outcome.error_kind == "timeout"
    ):
        dropped = True
    else:
        return  # says nothing about the worker's load
    before = worker.capacity
    if worker.sample_limit(duration, lease.in_flight, dropped):
        state.limit_changed_locked(worker, before)


def _count_failure_locked(
    state: PoolState, lease: Lease, outcome: Outcome, duration: float, now: float, defer: bool
) -> None:
    """Charge a failure to the worker (unless deferred). Counted here only, in this
    process: other processes hear of the opening it may cause, never of the count."""
    worker = lease.worker
    stats = worker.stats
    stats.attempts += 1
    if defer:
        worker.breaker.release(lease.trial)
    else:
        worker.breaker.record_failure(lease.trial)
    stats.failed += 1
    stats.last_error = outcome.error
    stats.last_error_at = state.clock.time()
    stats.observe(now, duration, False)
    if outcome.retry_after:
        cap = state.config.circuit_breaker.max_reset_timeout
        worker.cooldown_until = now + min(outcome.retry_after, cap)
    # A trip or a cool-down changes when a waiter should wake.
    state.dispatcher.wake_all_locked()


def _count_refused_locked(state: PoolState, lease: Lease, outcome: Outcome, now: float) -> None:
    """The worker refused the credentials: the operator's fault. The worker is taken
    out (its breaker untouched) until its credentials are tried again: when a health
    check passes, a reload changes them, or ``circuit_breaker.reset_timeout`` from now."""
    worker = lease.worker
    worker.breaker.release(lease.trial)
    stats = worker.stats
    stats.attempts += 1
    stats.failed += 1
    error = outcome.error or f"credentials refused: HTTP {outcome.status}"
    stats.last_error = error
    stats.last_error_at = state.clock.time()
    wait = state.config.circuit_breaker.reset_timeout
    if refuse_credentials(worker, error, now + wait):
        wid = worker.id
        state.events.append(lambda at: WorkerCredentialsRefused(at, wid, error, at + wait))
    # Waiters hoping for this worker must look again.
    state.dispatcher.wake_all_locked()


def _count_no_fault_locked(state: PoolState, lease: Lease, outcome: Outcome) -> None:
    """An outcome that charges nobody: rejected, not here, abandoned, or a lease given
    back unused. The breaker's slot (maybe its trial) is released, not counted."""
    worker = lease.worker
    worker.breaker.release(lease.trial)
    if outcome is _UNUSED:
        return
    stats = worker.stats
    stats.attempts += 1
    kind = outcome.kind
    if kind is Kind.REJECTED:
        stats.rejected += 1  # the task's count is the task life's (TaskRun.reject)
    elif kind is Kind.MISCONFIGURED:
        _take_out_locked(state, worker, outcome.error or "misconfigured")
    elif kind is Kind.ABANDONED:
        stats.abandoned += 1
    else:
        stats.not_here += 1


def _take_out_locked(state: PoolState, worker: Worker, reason: str) -> None:
    """The operator's fault: the worker is not what its entry says. Out of service
    (not its breaker: it is not sick) until a health check that is a worker's answer
    passes, or a reload moves it; the event waits in ``state.events``."""
    stats = worker.stats
    stats.failed += 1
    stats.last_error_at = state.clock.time()
    if worker.take_out(reason):
        wid = worker.id
        state.events.append(lambda at: WorkerHealthChanged(at, wid, False, reason))


def take_fleet_trial(state: PoolState, lease: Lease, budget: float) -> bool:
    """Take the fleet's lease on the half-open trial ``lease`` holds (breakers shared
    between processes): True when the trial may be sent. Otherwise the lease is given
    back unused, and the worker stays out here until the other holder's lease expires
    or its result arrives, whichever comes first.

    Redis I/O: call without the lock, before the attempt. ``budget`` is how long the
    attempt may run."""
    shared = state.shared
    assert shared is not None
    worker = lease.worker
    wait = shared.take_trial(worker.id, budget)
    with state.lock:
        if wait is None:
            if worker.breaker.lease_taken():
                return True
            # Another process opened or closed the worker meanwhile: no trial now.
        else:
            worker.breaker.lease_refused(state.clock.monotonic() + wait)
        # The breaker has already withdrawn this trial; giving the lease back must not
        # release a trial admitted since to another task.
        lease.trial = False
    if wait is None:
        shared.end_trial(worker.id)
    record(state, lease, _UNUSED, 0.0, state.clock.monotonic(), retry=False)
    return False


def charge(state: PoolState, held: list[Held], took: float, now: float) -> None:
    """Charge the held answers of a task that then succeeded elsewhere (in ``took``
    seconds): each was its worker's fault. A refusal also raises the worker's latency
    estimate to what the task cost there, refusal and real work: a worker that refuses
    fast must not look like the fastest."""
    selector = state.dispatcher.selector
    with state.lock:
        for entry in held:
            worker = entry.worker
            if worker.removed:
                continue
            # A held answer to a half-open trial is the trial's failure: it reopens.
            worker.breaker.record_failure(worker.breaker.state == HALF_OPEN)
            if entry.refusal:
                worker.stats.rejected -= 1  # counted as a rejection when it came
                worker.stats.failed += 1
                worker.stats.last_error = f"refused a task another worker ran: {entry.error}"
                worker.stats.last_error_at = state.clock.time()
                selector.observe(worker, entry.duration + took, now, False)
        state.dispatcher.wake_all_locked()
    if state.transitions:
        state.flush_transitions()


def untried_left(state: PoolState, excluded: Collection[str], by: float = math.inf) -> bool:
    """Whether a worker outside ``excluded`` could take a task before ``by``.

    A worker whose breaker stays open, or whose Retry-After cool-down lasts, past
    ``by`` cannot, nor one that is down (:func:`outage.held_until`). Costs a scan of
    the workers: called on the failure path only.
    """
    with state.lock:
        shared = state.dispatcher.selector.shared_breakers
        now = state.clock.monotonic()
        for w in state.workers.values():
            if w.id not in excluded and held_until(w, now, shared_breakers=shared)[0] < by:
                return True
        return False


def _peers(state: PoolState, worker: Worker) -> list[Pace]:
    """The paces of ``worker``'s tier (its own included), for a worker that has too few
    answers of its own yet. The selector's tiers are replaced whole: no lock needed."""
    for tier in state.dispatcher.selector.tiers:
        if worker in tier:
            return [w.pace for w in tier]
    return []


def _checked(check: Callable[[Any], object], outcome: Outcome) -> Outcome:
    """Run the pool's result check on a successful answer; a refusal is a failure."""
    try:
        check(outcome.value)
    except Exception as exc:
        return Outcome(
            Kind.FAILURE,
            outcome.value,
            outcome.status,
            f"result check refused the answer: {type(exc).__name__}: {exc}",
        )
    return outcome


def _shown(model: str) -> str:
    """A model id as messages quote it: escaped by repr(), and bounded, since a task
    (or a worker's answer) may name anything."""
    text = repr(model)
    return text if len(text) <= 120 else text[:100] + f"...' ({len(model)} characters)"


def _check_timeout(timeout: float | None) -> None:
    if timeout is None:
        return
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not (math.isfinite(timeout) and 0 < timeout <= _MAX_TIMEOUT)
    ):
        raise InvalidTask(
            f"timeout must be a number of seconds > 0 and <= {_MAX_TIMEOUT}, got {timeout!r}"
        )


def _scrubbed(outcome: Outcome, scrubber: Scrubber) -> Outcome:
    """``outcome`` with what the worker said scrubbed of secrets and bounded: its error
    text, the model a "not loaded" answer named (dropped if it held a secret) and, for
    a rejection, the body ``TaskRejected.body`` carries."""
    if outcome.error is not None:
        outcome.error = scrubber(outcome.error)
    model = outcome.model
    if model is not None and scrubber(model) != model:
        outcome.model = None
    if outcome.kind is Kind.REJECTED and scrubber:
        outcome.value = scrubber.value(outcome.value)
    return outcome
