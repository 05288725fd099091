"""The one observer of a task's outcomes: what the steps report, told to everyone who
follows the pool.

A step that ends an attempt or a task reports it here once (:class:`Outcomes`); this
turns it into the hook events (``TaskStarted``, ``AttemptFinished``,
``RetryScheduled``, ``AttemptHedged``, ``TaskSucceeded``, ``TaskRejectedEvent``,
``TaskFallback``, ``TaskDeadLettered``, ``TaskCancelled``, ``WorkerModelsChanged``), the pool's task
counters, and the task's routing trace, which an OpenTelemetry observer
(:mod:`npu_sync._otel`) turns into span events. The steps themselves never call a hook.

Events are built only when there are hooks; trace steps only when the task has a
trace. Called without the pool's lock: hooks are user code.
"""

from __future__ import annotations

from collections.abc import Collection

from npu_sync._admission import Lease
from npu_sync._blame import Verdict
from npu_sync._life.context import TaskContext
from npu_sync._retry import Outcome
from npu_sync._routing import charged_to, considered
from npu_sync._state import PoolState
from npu_sync._worker import Worker
from npu_sync.events import (
    AttemptFinished,
    AttemptHedged,
    RetryScheduled,
    TaskCancelled,
    TaskDeadLettered,
    TaskFallback,
    TaskRejectedEvent,
    TaskStarted,
    TaskSucceeded,
    WorkerModelsChanged,
    emit,
)
from npu_sync.task import Task
from npu_sync.trace import Trace, TraceStep


class Outcomes:
    """Turns the outcomes the steps report into events, counters and trace steps.
    Thread-safe (hooks must be: a hedge's attempt is reported from its own thread)."""

    __slots__ = ("state",)

    def __init__(self, state: PoolState) -> None:
        self.state = state

    # -- the task ---------------------------------------------------------------------

    def started(self, task: Task) -> None:
        """A task began (announced only when there are hooks)."""
        state = self.state
        if state.hooks:
            endpoint = task.endpoint or state.config.pool.default_endpoint
            emit(state.hooks, TaskStarted(state.clock.time(), task.task_id, endpoint))

    def succeeded(self, ctx: TaskContext, worker: Worker, t1: float) -> None:
        """The task's answer came from ``worker``."""
        hooks = self.state.hooks
        if hooks:
            emit(
                hooks,
                TaskSucceeded(
                    t1 + ctx.wall,
                    ctx.task.task_id,
                    worker.id,
                    len(ctx.attempts) + 1,
                    t1 - ctx.start,
                ),
            )

    def rejected(
        self,
        task_id: str,
        worker_id: str | None,
        status: int | None,
        message: str,
        at: float | None = None,
    ) -> None:
        """The task is rejected (bad, or no worker can serve it): counted, announced."""
        state = self.state
        with state.lock:
            state.stats.rejected += 1
        when = state.clock.time() if at is None else at
        state.notify(TaskRejectedEvent(when, task_id, worker_id, status, message))

    def fell_back(self, task_id: str, reason: str) -> None:
        """The caller's fallback answered for the task."""
        state = self.state
        with state.lock:
            state.stats.fallbacks += 1
        state.notify(TaskFallback(state.clock.time(), task_id, reason))

    def cancelled(self, task_id: str) -> None:
        """The task's caller stopped it before it ended: counted, nobody charged."""
        state = self.state
        with state.lock:
            state.stats.cancelled += 1
        state.notify(TaskCancelled(state.clock.time(), task_id))

    def dead_lettered(
        self, task_id: str, letter_id: str | None, tried: int, reason: str, at: float
    ) -> None:
        """The task failed; its dead letter ``letter_id`` is stored (None: it could not
        be, and the record went to the log)."""
        state = self.state
        with state.lock:
            state.stats.failed += 1
            if letter_id is not None:
                state.stats.dead_lettered += 1
        state.notify(TaskDeadLettered(at, task_id, letter_id, tried, reason))

    # -- its attempts -----------------------------------------------------------------

    def attempt_ended(
        self,
        ctx: TaskContext,
        worker: Worker,
        outcome: Outcome,
        t0: float,
        t1: float,
        number: int | None = None,
    ) -> None:
        """An attempt ended (announced only when there are hooks)."""
        hooks = self.state.hooks
        if hooks:
            emit(
                hooks,
                AttemptFinished(
                    t1 + ctx.wall,
                    ctx.task.task_id,
                    worker.id,
                    len(ctx.attempts) + 1 if number is None else number,
                    outcome.kind.value,
                    outcome.status,
                    outcome.error,
                    t1 - t0,
                ),
            )

    def retry_scheduled(
        self, ctx: TaskContext, worker: Worker, wait: float, error: str | None, t1: float
    ) -> None:
        """The task goes to another attempt after ``wait`` seconds."""
        self.state.notify(
            RetryScheduled(
                t1 + ctx.wall, ctx.task.task_id, worker.id, len(ctx.attempts), wait, error
            )
        )

    def hedged(self, ctx: TaskContext, first: Worker, lease: Lease, delay: float) -> None:
        """A hedge was sent to the lease's worker while ``first`` still works."""
        state = self.state
        if ctx.trace is not None:
            ctx.trace.add(TraceStep("hedge", state.clock.time(), lease.worker.id))
        if state.hooks:
            event = AttemptHedged(
                state.clock.time(), ctx.task.task_id, first.id, lease.worker.id, delay
            )
            emit(state.hooks, event)

    def placed(self, worker: Worker, model: str, models: frozenset[str] | None) -> None:
        """A task had ``model`` loaded on ``worker``."""
        state = self.state
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

    # -- the routing trace ------------------------------------------------------------

    def chose(self, ctx: TaskContext, lease: Lease, excluded: Collection[str]) -> None:
        """Trace the choice of the lease's worker, and why every other was not chosen.
        Call only when the task has a trace."""
        trace = ctx.trace
        assert trace is not None
        now = self.state.clock.monotonic()
        why, unlisted = self._considered(ctx, lease.worker, excluded, now)
        trace.add(
            TraceStep("choice", now + ctx.wall, lease.worker.id, considered=why, unlisted=unlisted)
        )

    def none_chosen(self, ctx: TaskContext, excluded: Collection[str]) -> None:
        """Trace that no worker could be had, and why each was not: the task is about to
        end without this attempt. A task with no trace begins one here, so that one
        failed before any attempt says why too."""
        trace = ctx.trace
        if trace is None:
            ctx.trace = trace = Trace(ctx.task.task_id)
        now = self.state.clock.monotonic()
        why, unlisted = self._considered(ctx, None, excluded, now)
        trace.add(TraceStep("choice", now + ctx.wall, None, considered=why, unlisted=unlisted))

    def _considered(
        self, ctx: TaskContext, chosen: Worker | None, excluded: Collection[str], now: float
    ) -> tuple[tuple[tuple[str, str], ...], int]:
        state = self.state
        workers = state.workers.values()
        # Left out beyond what the task tried: the workers lacking its model.
        lacking = excluded if excluded is not ctx.excluded else ()
        reserved = None
        if chosen is None:
            classes = state.dispatcher.classes
            rank = classes.rank_or_default(ctx.task.priority)
            rank = classes.effective(rank, now - ctx.start)
            if classes.reserving and rank and not classes.may_take(rank, workers):
                reserved = classes.names[rank]
        return considered(workers, chosen, ctx.excluded, lacking, now, ctx.task.requires, reserved)

    def traced_attempt(
        self,
        ctx: TaskContext,
        worker: Worker,
        outcome: Outcome,
        t0: float,
        t1: float,
        held: bool,
        verdict: Verdict | None = None,
    ) -> None:
        """Trace one attempt's end and who it was charged to; a failed task's trace
        begins here when the caller asked for none."""
        trace = ctx.trace
        if trace is None:
            ctx.trace = trace = Trace(ctx.task.task_id)
            trace.add(TraceStep("choice", t0 + ctx.wall, worker.id))
        charged = (
            "the task: nobody" if verdict is Verdict.TASK else charged_to(outcome, worker.id, held)
        )
        trace.add(
            TraceStep(
                "attempt",
                t1 + ctx.wall,
                worker.id,
                outcome=outcome.kind.value,
                status=outcome.status,
                error=outcome.error,
                duration=t1 - t0,
                charged=charged,
            )
        )

    def note(self, ctx: TaskContext, text: str, at: float | None = None) -> None:
        """A line of admission's or retry's word in the task's trace, if it has one."""
        trace = ctx.trace
        if trace is not None:
            trace.add(TraceStep("note", self.state.clock.time() if at is None else at, text=text))
