"""The top of a task's life: its deadline, and how it ends when no attempt answered.

:class:`Runner` fixes the deadline (:meth:`Runner.deadline`), runs the task down the
pool's :class:`~npu_sync._life.stack.Stack` of steps (:meth:`Runner.run`), and when
nothing is left, runs the caller's fallback (:meth:`Runner.fall_back`) or stores the
dead letter *before* ``TaskFailed`` is raised (:meth:`Runner.dead_letter`).
:meth:`Runner.replay` runs a dead letter's task again, never dead-lettered a second
time.

Nothing here holds the pool's lock across I/O or while user code (hooks, the result
check, the fallback) runs. The pool's lifecycle (threads, ``close()``, ``fork()``) is
``pool.py``'s; this only reads and changes the :class:`PoolState`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NoReturn

from npu_sync._deadletter import DeadLetter, DeadLetterQueue, DeadLetterStore
from npu_sync._life.context import Exhausted, check_timeout
from npu_sync._life.outcomes import Outcomes
from npu_sync._life.retry import Retry
from npu_sync._life.stack import Stack
from npu_sync._state import PoolState
from npu_sync._stop import Stopped, TaskStop
from npu_sync.errors import AdmissionRefused, NoWorkerAvailable, TaskFailed, TaskRejected
from npu_sync.task import Task
from npu_sync.trace import TaskWatch, Trace, TraceStep

log = logging.getLogger(__name__)

_retry = Retry.__call__


class Runner:
    """Runs the tasks of one pool, each on its caller's thread. Thread-safe.

    Args:
        state: the pool's running state.
        store: where dead letters are kept.
        result_check: called with every 2xx answer's decoded JSON; if it raises, the
            answer is that worker's failure (see :class:`~npu_sync._pool.WorkerPool`).
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
        self.outcomes = Outcomes(state)
        self._stack = Stack(state, self.outcomes, result_check)
        self.dead_letters = DeadLetterQueue(
            store, self.replay, clock=state.clock, run_time=self.replay_budget, hold=hold
        )

    def stack(self) -> Stack:
        """The steps for the pool's configuration as it is now: built again when a
        reload (or the pool's start) changed what they were built from. Built outside
        any lock: two tasks may both build one after a reload; either serves."""
        stack = self._stack
        if not stack.current():
            stack = self._stack = Stack(self.state, self.outcomes, self.result_check)
        return stack

    def deadline(self, task: Task, timeout: float | None) -> float:
        """When ``task`` must be over, on the pool's monotonic clock.

        Raises:
            InvalidTask: ``timeout`` is not a number of seconds in (0, a day].
        """
        if timeout is not None:
            check_timeout(timeout)
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
        ``stop`` is stopped first (see :mod:`npu_sync._stop`): no fallback, no dead
        letter, nobody charged. With an observer (tracing), :meth:`watched` runs it."""
        state = self.state
        if watch is None:
            if state.hooks:
                self.outcomes.started(task)
            if state.observer is not None:
                return self.watched(state.observer(task), task, body, deadline, fallback, stop)
        stack = self._stack
        if not (  # Stack.current(), inline: asked once per task
            state.config is stack.config
            and state.hedge is stack.hedge
            and state.placer is stack.placer
        ):
            stack = self.stack()
        try:
            # Retry.__call__ called directly: one call less per task than stack.run.
            return _retry(stack.retry, stack.begin(task, body, deadline, stop, watch), stack.first)
        except Exhausted as exhausted:
            if stop is not None and stop.cancelled:
                self.outcomes.cancelled(task.task_id)
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
        except Stopped:
            self.outcomes.cancelled(task.task_id)
            raise

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
        self.outcomes.fell_back(task.task_id, str(rejected))
        return result

    def fall_back(
        self, task: Task, exhausted: Exhausted, deadline: float, fallback: Callable[[], Any]
    ) -> Any:
        """Run the caller's fallback (no lock held); dead-letter the task if it fails too."""
        try:
            result = fallback()
        except Exception as exc:
            exhausted.reason += f"; fallback failed: {type(exc).__name__}: {exc}"
            self.dead_letter(task, exhausted, deadline, cause=exc)
        self.outcomes.fell_back(task.task_id, exhausted.reason)
        return result

    def dead_letter(
        self,
        task: Task,
        exhausted: Exhausted,
        deadline: float,
        cause: BaseException | None = None,
    ) -> NoReturn:
        """Store the task's dead letter, then raise ``TaskFailed`` (``NoWorkerAvailable``
        when no attempt was made) carrying the record's id and every attempt."""
        state = self.state
        now = state.clock.time()
        if exhausted.trace is None:
            # Ended before any step traced it (no thread of the asyncio pool took it,
            # too little time was left to send it): its trace still says why.
            trace = task.trace if task.trace is not None else Trace(task.task_id)
            trace.add(TraceStep("note", now, text=f"gave up: {exhausted.reason}"))
            exhausted.trace = trace
        letter = DeadLetter.from_task(
            task,
            endpoint=task.endpoint or state.config.pool.default_endpoint,
            error=exhausted.reason,
            attempts=exhausted.attempts,
            now=now,
            first_attempt_at=exhausted.first_at,
            trace=exhausted.trace.to_dict(),
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
        tried = len(exhausted.attempts)
        self.outcomes.dead_lettered(task.task_id, letter.id, tried, exhausted.reason, now)
        raise error(
            f"task {task.task_id} failed: {exhausted.reason} (dead letter {letter.id})",
            task_id=task.task_id,
            dead_letter_id=letter.id,
            attempts=exhausted.attempts,
            trace=exhausted.trace,
        ) from cause

    def _record_lost(
        self, task: Task, exhausted: Exhausted, letter: DeadLetter, exc: Exception
    ) -> None:
        """The one case where the record cannot be kept: say so loudly, with the whole
        record in the log so that nothing is lost without a trace."""
        tried = len(exhausted.attempts)
        self.outcomes.dead_lettered(
            task.task_id, None, tried, exhausted.reason, self.state.clock.time()
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
        stack = self.stack()
        try:
            return stack.run(stack.begin(task, body, deadline, None, watch))
        except Exhausted as exhausted:
            raise TaskFailed(
                f"task {task.task_id} failed again: {exhausted.reason}",
                task_id=task.task_id,
                dead_letter_id="",
                attempts=exhausted.attempts,
                trace=exhausted.trace,
            ) from None
