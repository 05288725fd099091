"""The life of one task, from its deadline to its result, rejection or dead letter.

Acquire a worker lease (waiting FIFO for capacity up to the task's deadline), POST
outside any lock, classify the answer, record it under the lock (which also hands the
freed slot to the next waiter), then return, raise ``TaskRejected``, or back off and
try a worker not yet tried. When no attempt is left, the dead-letter record is stored
*before* ``TaskFailed`` is raised.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NoReturn

from npu_sync.admission import Lease, Refusal
from npu_sync.attempt import Attempt
from npu_sync.deadletter import DeadLetter, DeadLetterQueue, DeadLetterStore
from npu_sync.errors import InvalidTask, NoWorkerAvailable, TaskFailed, TaskRejected
from npu_sync.events import (
    AttemptFinished,
    RetryScheduled,
    TaskDeadLettered,
    TaskFallback,
    TaskRejectedEvent,
    TaskStarted,
    TaskSucceeded,
    emit,
)
from npu_sync.retry import Kind, Outcome, classify_error, classify_response
from npu_sync.state import PoolState
from npu_sync.task import Task
from npu_sync.transport import TransportError
from npu_sync.worker import Worker

log = logging.getLogger(__name__)


class _Exhausted(Exception):
    """No attempt is left for a task; carries why and what was tried."""

    def __init__(self, reason: str, attempts: list[Attempt], first_at: float) -> None:
        super().__init__(reason)
        self.reason = reason
        self.attempts = attempts
        self.first_at = first_at


class Runner:
    """Runs the tasks of one pool. Thread-safe: each task runs on its caller's thread.

    Args:
        state: the pool's running state.
        store: where dead letters are kept.
        result_check: see :class:`~npu_sync.pool.WorkerPool`.
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
        _check_timeout(timeout)
        budget = timeout or task.timeout or self.state.config.timeouts.task
        return self.state.clock.monotonic() + budget

    def run(
        self, task: Task, body: bytes, deadline: float, fallback: Callable[[], Any] | None
    ) -> Any:
        if self.state.hooks:
            endpoint = task.endpoint or self.state.config.pool.default_endpoint
            emit(self.state.hooks, TaskStarted(self.state.clock.time(), task.task_id, endpoint))
        try:
            return self._attempts(task, body, deadline)
        except _Exhausted as exhausted:
            if fallback is None:
                self._dead_letter(task, exhausted, deadline)
            try:
                result = fallback()
            except Exception as exc:
                exhausted.reason += f"; fallback failed: {type(exc).__name__}: {exc}"
                self._dead_letter(task, exhausted, deadline, cause=exc)
            with self.state.lock:
                self.state.stats.fallbacks += 1
            self.state.notify(TaskFallback(self.state.clock.time(), task.task_id, exhausted.reason))
            return result

    def replay_budget(self, record: DeadLetter) -> float:
        """The longest a replay of ``record`` may run: its task's deadline."""
        return record.timeout or self.state.config.timeouts.task

    def replay(self, task: Task) -> Any:
        """Run a dead-lettered task again without dead-lettering it a second time.
        Called inside the pool's hold on the record (see ``DeadLetterQueue``)."""
        body = task.body()
        deadline = self.deadline(task, None)
        with self.state.lock:
            self.state.stats.submitted += 1
        try:
            return self._attempts(task, body, deadline)
        except _Exhausted as exhausted:
            raise TaskFailed(
                f"task {task.task_id} failed again: {exhausted.reason}",
                task_id=task.task_id,
                dead_letter_id="",
                attempts=exhausted.attempts,
            ) from None

    def _dead_letter(
        self,
        task: Task,
        exhausted: _Exhausted,
        deadline: float,
        cause: BaseException | None = None,
    ) -> NoReturn:
        now = self.state.clock.time()
        record = DeadLetter.from_task(
            task,
            endpoint=task.endpoint or self.state.config.pool.default_endpoint,
            error=exhausted.reason,
            attempts=exhausted.attempts,
            now=now,
            first_attempt_at=exhausted.first_at,
        )
        error = NoWorkerAvailable if not exhausted.attempts else TaskFailed
        try:
            # Durable before the caller hears of the failure; a busy store may not hold
            # the caller much past the task's deadline.
            self.dead_letters.add(record, timeout=deadline - self.state.clock.monotonic())
        except Exception as exc:
            # The one case where the record cannot be kept: say so loudly, with the
            # whole record in the log so that nothing is lost without a trace.
            with self.state.lock:
                self.state.stats.failed += 1
            self.state.notify(
                TaskDeadLettered(
                    self.state.clock.time(),
                    task.task_id,
                    None,
                    len(exhausted.attempts),
                    exhausted.reason,
                )
            )
            log.error(
                "task %s failed and its dead letter could not be stored (%s: %s); record: %s",
                task.task_id,
                type(exc).__name__,
                exc,
                json.dumps(record.to_dict(), default=repr),
            )
            raise error(
                f"task {task.task_id} failed: {exhausted.reason}; and its dead letter could "
                f"not be stored: {type(exc).__name__}: {exc}",
                task_id=task.task_id,
                dead_letter_id=None,
                attempts=exhausted.attempts,
            ) from exc
        with self.state.lock:
            self.state.stats.failed += 1
            self.state.stats.dead_lettered += 1
        self.state.notify(
            TaskDeadLettered(
                now, task.task_id, record.id, len(exhausted.attempts), exhausted.reason
            )
        )
        raise error(
            f"task {task.task_id} failed: {exhausted.reason} (dead letter {record.id})",
            task_id=task.task_id,
            dead_letter_id=record.id,
            attempts=exhausted.attempts,
        ) from cause

    def _attempts(self, task: Task, body: bytes, deadline: float) -> Any:
        """Try the task on successive workers; return the result or raise.

        Raises TaskRejected, or _Exhausted for the caller to dead-letter.
        """
        config = self.state.config
        policy = self.state.retry
        clock = self.state.clock
        path = task.endpoint or config.pool.default_endpoint
        timeouts = config.timeouts
        connect_timeout = timeouts.connect
        read_timeout = timeouts.read
        queue_wait = config.pool.max_queue_wait
        check = self.result_check
        start = clock.monotonic()
        # Wall-clock times (for people reading dead letters) from the monotonic clock,
        # saving a clock call per attempt.
        wall = clock.time() - start
        attempts: list[Attempt] = []
        excluded: set[str] = set()  # not to be chosen for the next attempt
        not_here: set[str] = set()  # do not serve the task's model: never again
        failures = 0
        missing_model: str | None = None
        # A task that gets HTTP 500 (or an answer over the size limit) from every worker
        # may be the one at fault (a poison payload). Its first such failure is charged
        # at once, as any worker failure; further ones are charged only if the task then
        # succeeds elsewhere, so one bad task cannot count against every breaker.
        charged_suspect = False
        suspects: list[Worker] = []
        too_large = 0
        headers = {"X-NPU-Task-Id": task.task_id, "X-NPU-Attempt": "1"}
        acquire = self.state.dispatcher.acquire_or_reason
        while True:
            wait_until = clock.monotonic() + queue_wait
            lease = acquire(excluded, wait_until if wait_until < deadline else deadline)
            if isinstance(lease, Refusal):
                reason = self._refusal_reason(lease, attempts, deadline, wait_until)
                break
            # From here until _record() takes it back, the lease holds a slot on the
            # worker (maybe its one half-open trial): whatever is raised, give it back.
            recorded = False
            try:
                if self.state.transitions:
                    self.state.flush_transitions()
                worker = lease.worker
                t0 = clock.monotonic()
                remaining = deadline - t0
                if remaining <= _MIN_ATTEMPT:
                    recorded = True
                    self.record(lease, _UNUSED, 0.0, t0, retry=False)
                    reason = "deadline passed"
                    break
                if attempts:
                    headers["X-NPU-Attempt"] = str(len(attempts) + 1)
                budget = read_timeout if read_timeout < remaining else remaining
                try:
                    response = worker.transport.request(
                        "POST",
                        path,
                        body=body,
                        headers=headers,
                        timeout=budget,
                        connect_timeout=connect_timeout,
                        replayable=task.idempotent,
                    )
                    outcome = classify_response(response, now=t0 + wall)
                    if check is not None and outcome.kind is Kind.SUCCESS:
                        outcome = _checked(check, outcome)
                except TransportError as exc:
                    # A timeout is the worker's only when its own timeout ran out: one
                    # cut short by the task's deadline says nothing about the worker.
                    # Connecting gets at most the smaller of the two timeouts.
                    own = read_timeout if exc.sent else min(connect_timeout, read_timeout)
                    outcome = classify_error(exc, cut_by_caller=remaining < own)
                except InvalidTask:
                    # Refused before anything was sent (a header that cannot be encoded):
                    # the task's fault, so no worker is charged and nothing is retried.
                    recorded = True
                    self.record(lease, _UNUSED, 0.0, clock.monotonic(), retry=False)
                    raise
                except Exception as exc:  # a bug of ours, or of a custom transport
                    log.exception("unexpected error sending task to worker %s", worker.id)
                    outcome = Outcome(Kind.ABANDONED, error=f"{type(exc).__name__}: {exc}")
                t1 = clock.monotonic()
                suspect = False
                if outcome.suspect:
                    suspect, charged_suspect = charged_suspect, True
                recorded = True
                self.record(lease, outcome, t1 - t0, t1, retry=failures > 0, defer=suspect)
            finally:
                if not recorded:
                    self.record(lease, _UNUSED, 0.0, clock.monotonic(), retry=False)
            kind = outcome.kind
            hooks = self.state.hooks
            if hooks:
                emit(
                    hooks,
                    AttemptFinished(
                        t1 + wall,
                        task.task_id,
                        worker.id,
                        len(attempts) + 1,
                        kind.value,
                        outcome.status,
                        outcome.error,
                        t1 - t0,
                    ),
                )
            if kind is Kind.SUCCESS:
                if suspects:
                    self._charge(suspects)
                if hooks:
                    emit(
                        hooks,
                        TaskSucceeded(
                            t1 + wall, task.task_id, worker.id, len(attempts) + 1, t1 - start
                        ),
                    )
                return outcome.value
            attempts.append(Attempt(worker.id, outcome.error, t1 - t0, outcome.status, t0 + wall))
            if kind is Kind.REJECTED:
                self.state.notify(
                    TaskRejectedEvent(
                        t1 + wall, task.task_id, worker.id, outcome.status, outcome.error or ""
                    )
                )
                raise TaskRejected(
                    f"worker {worker.id} rejected task {task.task_id}: {outcome.error}",
                    task_id=task.task_id,
                    status=outcome.status,
                    worker_id=worker.id,
                    body=outcome.value,
                )
            excluded.add(worker.id)
            if kind is Kind.NOT_HERE:
                not_here.add(worker.id)
                missing_model = outcome.model
                continue
            if not task.idempotent and outcome.processed:
                reason = f"worker {worker.id} failed a non-idempotent task that may have run"
                break
            if kind is Kind.ABANDONED and self._untried_left(excluded, deadline):
                continue  # nothing learnt about the worker: no backoff, no retry counted
            # An abandoned attempt with no other worker left (a stale connection on the
            # only worker) is retried like a failure: after a backoff, within max_retries.
            failures += 1
            if suspect:
                suspects.append(worker)
            if outcome.error is not None and outcome.error.startswith("too_large"):
                too_large += 1
                if too_large >= 2:
                    # Two workers answered beyond the limit: the task asks for too much.
                    reason = "two workers answered beyond transport.max_response_bytes"
                    break
            wait = policy.next_wait(failures, t1 - start)
            if wait is None:
                reason = f"all {failures} attempt(s) failed"
                break
            # A worker is worth waiting for only if it can take the task before the next
            # attempt would stop waiting for one (pool.max_queue_wait, or the deadline).
            horizon = min(deadline, t1 + wait + queue_wait)
            if not self._untried_left(excluded, horizon):
                # Every worker was tried. Trying one again is better than failing, once
                # the backoff has passed: the failure may have been transient.
                excluded = set(not_here)
                if not self._untried_left(excluded, horizon):
                    reason = _EVERY_WORKER_TRIED
                    break
            if t1 + wait >= deadline:
                reason = "deadline passed"
                break
            self.state.notify(
                RetryScheduled(
                    t1 + wall, task.task_id, worker.id, len(attempts), wait, outcome.error
                )
            )
            clock.sleep(wait)
        if missing_model is not None and not failures and reason == _EVERY_WORKER_TRIED:
            with self.state.lock:
                self.state.stats.rejected += 1
            self.state.notify(
                TaskRejectedEvent(
                    clock.time(),
                    task.task_id,
                    None,
                    500,
                    f"no worker serves model {missing_model!r}",
                )
            )
            raise TaskRejected(
                f"no worker serves model {missing_model!r} (task {task.task_id})",
                task_id=task.task_id,
                status=500,
            )
        if suspects:
            log.info(
                "task %s failed the same way on %d more worker(s) (HTTP 500 or an answer "
                "too large) and never succeeded: only its first failure was charged",
                task.task_id,
                len(suspects),
            )
        last_error = attempts[-1].error if attempts else None
        if last_error:
            wid = attempts[-1].worker_id
            # Transport errors name their worker already ("timeout: a: timed out ...").
            on = "" if f"{wid}: " in last_error else f" on {wid}"
            reason = f"{reason}; last error{on}: {last_error}"
        raise _Exhausted(reason, attempts, start + wall)

    def _refusal_reason(
        self, refusal: Refusal, attempts: list[Attempt], deadline: float, wait_until: float
    ) -> str:
        """Why no worker was had, naming the limit that ran out."""
        if wait_until >= deadline:
            if refusal is Refusal.DEADLINE_PASSED and attempts:
                return "deadline passed"
            return str(refusal.value)
        limit = f"pool.max_queue_wait ({self.state.config.pool.max_queue_wait:g}s)"
        if refusal is Refusal.DEADLINE_PASSED:
            return f"no worker could take the task within {limit}"
        return str(refusal.value).replace("before the deadline", f"within {limit}")

    def _untried_left(self, excluded: Collection[str], by: float = math.inf) -> bool:
        """Whether a worker outside ``excluded`` could take a task before ``by``.

        A worker whose breaker stays open, or whose Retry-After cool-down lasts, past
        ``by`` cannot. Costs a scan of the workers: called on the failure path only.
        """
        with self.state.lock:
            for w in self.state.workers.values():
                if w.id in excluded or not w.enabled or w.draining:
                    continue
                retry_at = w.breaker.retry_at()
                if (retry_at is None or retry_at < by) and w.cooldown_until < by:
                    return True
            return False

    def record(
        self,
        lease: Lease,
        outcome: Outcome,
        duration: float,
        now: float,
        *,
        retry: bool,
        defer: bool = False,
    ) -> None:
        state = self.state
        worker = lease.worker
        trial = lease.trial
        kind = outcome.kind
        close_transport = False
        reported = False
        with state.lock:
            worker.in_flight -= 1
            stats = worker.stats
            if lease.generation != worker.generation and outcome is not _UNUSED:
                # An attempt on the worker's old address: it says nothing about the new
                # one (nor about its breaker), so only the slot is given back, and a
                # result still counts as the task's success.
                if kind is Kind.SUCCESS:
                    state.stats.succeeded += 1
                kind = Kind.NOT_HERE
                outcome = _STALE
            if outcome is _STALE:
                pass
            elif kind is Kind.SUCCESS:
                stats.attempts += 1
                worker.breaker.record_success(trial)
                stats.succeeded += 1
                stats.observe(now, duration, True)
                state.stats.succeeded += 1
            elif kind is Kind.FAILURE:
                stats.attempts += 1
                if state.shared is not None and not defer:
                    # No new attempt here until every process's count is known: on a
                    # dead worker this keeps the attempts near fail_max in total.
                    worker.reporting += 1
                    reported = True
                if defer:
                    worker.breaker.release(trial)
                else:
                    worker.breaker.record_failure(trial)
                stats.failed += 1
                stats.last_error = outcome.error
                stats.last_error_at = state.clock.time()
                stats.observe(now, duration, False)
                if outcome.retry_after:
                    cap = state.config.circuit_breaker.max_reset_timeout
                    worker.cooldown_until = now + min(outcome.retry_after, cap)
                # A trip or a cool-down changes when a waiter should wake.
                state.dispatcher.wake_all_locked()
            elif outcome is _UNUSED:
                worker.breaker.release(trial)
            else:
                stats.attempts += 1
                worker.breaker.release(trial)
                if kind is Kind.REJECTED:
                    stats.rejected += 1
                    state.stats.rejected += 1
                elif kind is Kind.ABANDONED:
                    stats.abandoned += 1
                else:
                    stats.not_here += 1
            if retry:
                state.stats.retries += 1
            state.dispatcher.release_worker_locked(worker, now)
            if worker.removed and not worker.in_flight:
                close_transport = True
                if state.draining.get(worker.id) is worker:
                    del state.draining[worker.id]
        shared = state.shared
        if shared is not None:
            # Redis I/O, outside the lock, and only on the failure path (or the first
            # success after failures).
            if reported:
                trip = False
                try:
                    trip = shared.report_failure(worker.id, state.config.circuit_breaker.fail_max)
                finally:
                    with state.lock:
                        worker.reporting -= 1
                        if trip and worker.breaker.force_open():
                            state.dispatcher.wake_all_locked()
                        state.dispatcher.release_worker_locked(worker, state.clock.monotonic())
            elif kind is Kind.SUCCESS:
                shared.report_success(worker.id)
        if state.transitions:
            state.flush_transitions()
        if close_transport:
            worker.transport.close()

    def _charge(self, workers: list[Worker]) -> None:
        """Count deferred failures against workers that failed where another succeeded."""
        with self.state.lock:
            for worker in workers:
                worker.breaker.record_failure(False)
            self.state.dispatcher.wake_all_locked()
        if self.state.transitions:
            self.state.flush_transitions()


_MIN_ATTEMPT = 0.001
"""An attempt with less time than this left before the deadline is not started."""

_EVERY_WORKER_TRIED = "every worker was tried"

_UNUSED = Outcome(Kind.NOT_HERE, error="lease not used")
"""Records a lease given back without an attempt (deadline reached, interrupted)."""

_STALE = Outcome(Kind.NOT_HERE, error="attempt on a previous address")
"""Records an attempt made on a worker's address before a reload moved it."""


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


_MAX_TIMEOUT = 86400
"""A task's deadline is at most a day, like ``timeouts.task``."""
