"""The retry step: one attempt after another until one ends the task.

:class:`Retry` asks the steps below it for an attempt (a worker, the request, its
outcome), and decides from the outcome: the answer returned; the task rejected
(:meth:`Retry.reject`), or found at fault itself (:meth:`Retry.tasks_fault`); another
worker tried at once, or after a backoff that fits the deadline and the pool-wide retry
budget (:meth:`Retry.backoff`); or nothing left (:meth:`Retry.give_up`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NoReturn

from npu_sync._attempt import Attempt
from npu_sync._blame import Verdict
from npu_sync._budget import RetryBudget
from npu_sync._life.context import AGAIN, EVERY_WORKER_TRIED, Exhausted, TaskContext, Try, shown
from npu_sync._life.ledger import charge, untried_left
from npu_sync._life.models import named_model
from npu_sync._life.outcomes import Outcomes
from npu_sync._retry import Kind, Outcome, RetryPolicy
from npu_sync._state import PlaceLater, PoolState
from npu_sync._stop import Stopped
from npu_sync._worker import Worker
from npu_sync.config import PoolConfig
from npu_sync.errors import TaskRejected

log = logging.getLogger(__name__)

_BUDGET_EXHAUSTED = "retry budget exhausted"


class Retry:
    """Try the task on one worker after another until an attempt ends it.
    Built once per configuration; thread-safe (each task has its own context)."""

    __slots__ = ("budget", "max_queue_wait", "outcomes", "policy", "state")

    def __init__(
        self, state: PoolState, config: PoolConfig, policy: RetryPolicy, outcomes: Outcomes
    ) -> None:
        self.state = state
        self.policy = policy
        self.budget: RetryBudget = state.budget
        self.max_queue_wait = config.pool.max_queue_wait
        self.outcomes = outcomes

    def __call__(self, ctx: TaskContext, next: Callable[[TaskContext], object]) -> Any:
        """Returns:
            The first successful answer's decoded JSON.

        Raises:
            TaskRejected: the task is bad (a 4xx, or no worker holds its model).
            InvalidTask: the request could not be built (nothing was sent).
            Exhausted: nothing is left to try; the caller dead-letters the task.
        """
        state = self.state
        while True:
            try:
                at = next(ctx)
            except PlaceLater as late:
                # Its model's load waits for a slot past the task's wait: no worker
                # could take it in time (a dead letter; a replay may succeed).
                ctx.reason = late.reason
                break
            if type(at) is not Try:
                if at is AGAIN:
                    continue
                break  # None: no attempt could start (ctx.reason says why)
            outcome = at.outcome
            worker = at.lease.worker
            if outcome.kind is Kind.SUCCESS:
                if ctx.trace is not None:
                    self.outcomes.traced_attempt(ctx, worker, outcome, at.t0, at.t1, False)
                if (ctx.blame is not None and ctx.blame.held) or state.hooks:
                    return self.succeeded(ctx, worker, outcome, at.t1, at.t1 - at.t0)
                return outcome.value
            if not self.failed(ctx, at):
                break
        raise self.give_up(ctx)

    def succeeded(
        self, ctx: TaskContext, worker: Worker, outcome: Outcome, t1: float, took: float
    ) -> Any:
        """The task's result. The answers held as maybe the task's own fault were the
        workers' after all: they are charged now (``took``: this attempt's time)."""
        blame = ctx.blame
        if blame is not None and blame.held:
            proven = blame.proven(took)
            charge(self.state, proven, took, t1)
            if proven:
                charged = ", ".join(held.worker.id for held in proven)
                text = f"held answers charged after {worker.id} answered: {charged}"
                self.outcomes.note(ctx, text, t1 + ctx.wall)
        self.outcomes.succeeded(ctx, worker, t1)
        return outcome.value

    def failed(self, ctx: TaskContext, at: Try) -> bool:
        """Note a failed attempt and decide what comes next.

        Returns:
            True to try again (after the backoff, slept here); False to give up, with
            the reason in ``ctx.reason``.

        Raises:
            TaskRejected: the worker said the task itself is bad.
        """
        task = ctx.task
        stop = ctx.stop
        if stop is not None and stop.cancelled:
            raise Stopped(task.task_id)  # a hedged attempt's end after the caller left
        outcome = at.outcome
        worker = at.lease.worker
        t0, t1, deferred = at.t0, at.t1, at.deferred
        ctx.attempts.append(
            Attempt(worker.id, outcome.error, t1 - t0, outcome.status, t0 + ctx.wall)
        )
        kind = outcome.kind
        verdict = (
            ctx.blamed().judge(worker, outcome, t1 - t0, deferred) if outcome.suspect else None
        )
        self.outcomes.traced_attempt(ctx, worker, outcome, t0, t1, deferred, verdict)
        if verdict is Verdict.TASK:
            return self.tasks_fault(ctx, worker, outcome, t1)
        if kind is Kind.REJECTED and not outcome.suspect:
            self.reject(ctx, worker, outcome, t1)  # the protocol says the task is bad
        ctx.excluded.add(worker.id)
        if kind is Kind.NOT_HERE or kind is Kind.MISCONFIGURED:
            ctx.not_here.add(worker.id)  # never again for this task
            if kind is Kind.NOT_HERE:
                ctx.missing_model = named_model(self.state, ctx) or outcome.model
            return True
        state = self.state
        if kind is Kind.REJECTED:
            # Refused: another worker tells whether the task or this worker is at
            # fault. With no other worker, this one's word stands.
            if untried_left(state, ctx.excluded, ctx.deadline):
                return True
            self.reject(ctx, worker, outcome, t1)
        if not task.idempotent and outcome.processed:
            ctx.reason = f"worker {worker.id} failed a non-idempotent task that may have run"
            return False
        if kind is Kind.ABANDONED and untried_left(state, ctx.excluded, ctx.deadline):
            return True  # nothing learnt about the worker: no backoff, no retry counted
        # An abandoned attempt with no other worker left (a stale connection on the
        # only worker) is retried like a failure: after a backoff, within max_retries.
        ctx.failures += 1
        wait = self.backoff(ctx, t1)
        if wait is None:
            return False
        self.outcomes.retry_scheduled(ctx, worker, wait, outcome.error, t1)
        if stop is None:
            state.clock.sleep(wait)
        elif state.clock.wait(stop.event, wait):
            raise Stopped(task.task_id)
        return True

    def tasks_fault(self, ctx: TaskContext, worker: Worker, outcome: Outcome, t1: float) -> bool:
        """A second worker answered this task as another already had: the task is at
        fault, not they. Nobody is charged; a refusal raises ``TaskRejected``, a
        failure ends the task (False, the reason in ``ctx.reason``)."""
        if outcome.kind is Kind.REJECTED:
            self.reject(ctx, worker, outcome, t1)
        first, second = ctx.blamed().same or ("?", worker.id)
        if outcome.error_kind == "too_large":
            ctx.reason = "two workers answered beyond transport.max_response_bytes"
        else:
            ctx.reason = (
                f"workers {first} and {second} failed the task the same way, so it is taken "
                "as the task's fault (no worker charged)"
            )
        return False

    def reject(self, ctx: TaskContext, worker: Worker, outcome: Outcome, t1: float) -> NoReturn:
        """The task is bad (a 4xx, or the protocol says so): no retry, nobody charged."""
        task_id = ctx.task.task_id
        self.outcomes.rejected(
            task_id, worker.id, outcome.status, outcome.error or "", t1 + ctx.wall
        )
        raise TaskRejected(
            f"worker {worker.id} rejected task {task_id}: {outcome.error}",
            task_id=task_id,
            status=outcome.status,
            worker_id=worker.id,
            body=outcome.value,
        )

    def backoff(self, ctx: TaskContext, t1: float) -> float | None:
        """How long to wait before the next attempt; None, with the reason, when no next
        attempt can help: retries spent, no worker able to take the task in time, or
        the deadline before the backoff ends."""
        wait = self.policy.next_wait(ctx.failures, t1 - ctx.start)
        if wait is None:
            ctx.reason = f"all {ctx.failures} attempt(s) failed"
            return None
        # A worker is worth waiting for only if it can take the task before the next
        # attempt would stop waiting for one (pool.max_queue_wait, or the deadline).
        horizon = min(ctx.deadline, t1 + wait + self.max_queue_wait)
        state = self.state
        if not untried_left(state, ctx.excluded, horizon):
            # Every worker was tried. Trying one again is better than failing, once
            # the backoff has passed: the failure may have been transient.
            ctx.excluded = set(ctx.not_here)
            if not untried_left(state, ctx.excluded, horizon):
                ctx.reason = EVERY_WORKER_TRIED
                return None
        if t1 + wait >= ctx.deadline:
            ctx.reason = "deadline passed"
            return None
        if not self.budget.try_withdraw(t1):
            ctx.reason = _BUDGET_EXHAUSTED
            return None
        return wait

    def give_up(self, ctx: TaskContext) -> Exception:
        """What ends a task no attempt succeeded for: ``TaskRejected`` when the only
        answers were that no worker holds its model, else ``Exhausted``, whose reason
        names the last error."""
        reason = ctx.reason
        task_id = ctx.task.task_id
        model = ctx.missing_model
        if model is not None and not ctx.failures and reason == EVERY_WORKER_TRIED:
            message = f"no worker serves model {shown(model)}"
            self.outcomes.rejected(task_id, None, 500, message)
            return TaskRejected(
                f"{message} (task {task_id})", task_id=task_id, status=500, model=model
            )
        blame = ctx.blamed()
        held = blame.held
        if not ctx.failures and blame.refused_only():
            # Refused, and no other worker could be asked: the refusal stands.
            last = ctx.attempts[-1]
            message = f"worker {last.worker_id} rejected task {task_id}: {last.error}"
            self.outcomes.rejected(task_id, last.worker_id, last.status, message)
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
        attempts = ctx.attempts
        last_error = attempts[-1].error if attempts else None
        if last_error:
            wid = attempts[-1].worker_id
            # Transport errors name their worker already ("timeout: a: timed out ...").
            on = "" if f"{wid}: " in last_error else f" on {wid}"
            reason = f"{reason}; last error{on}: {last_error}"
        exhausted = Exhausted(reason, attempts, ctx.start + ctx.wall)
        exhausted.trace = ctx.trace
        self.outcomes.note(ctx, f"gave up: {exhausted.reason}")
        return exhausted
