"""The steps that hold a worker for an attempt: choosing it, and giving it back.

:class:`Fit`
    keeps the task off the workers that lack what it ``requires`` and takes a worker it
    ``prefers`` when one has room now.
:class:`Admit`
    the lease on the best worker not yet tried, from ``Dispatcher.acquire_or_reason()``
    (the pick, the breaker's admission and the in-flight count under the pool's one
    lock), waiting FIFO for capacity up to ``pool.max_queue_wait`` within the deadline,
    or refused at once when waiting cannot help; it makes the attempt's :class:`Try`.
:class:`FleetTrial` (breakers shared between processes)
    the fleet's lease on a half-open trial, one per opening for the whole fleet.
:class:`Record`
    the attempt itself, from the lease to :func:`~npu_sync._life.ledger.record` under
    the lock: whatever is raised in between, the lease is given back.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from npu_sync._admission import Lease, Refusal
from npu_sync._blame import route_answered
from npu_sync._foresight import Late
from npu_sync._life.context import AGAIN, FIRST, HEDGE, MIN_ATTEMPT, TaskContext, Try
from npu_sync._life.ledger import UNUSED, record, take_fleet_trial, untried_left
from npu_sync._life.models import named_model, not_loaded
from npu_sync._life.outcomes import Outcomes
from npu_sync._life.transport import trial_deadline
from npu_sync._outage import describe
from npu_sync._retry import Kind, Outcome
from npu_sync._stall import TrialDeadline
from npu_sync._state import PoolState
from npu_sync._stop import Stopped
from npu_sync.config import AdmissionConfig, PoolConfig
from npu_sync.errors import AdmissionRefused, TaskRejected

Upper = Callable[[TaskContext], object]
Lower = Callable[[TaskContext, Try], object]


class Fit:
    """Keep the task off the workers that lack what it ``requires`` (for good, like a
    missing model), and a lease on one meeting what it ``prefers`` if one has room now
    (see :mod:`npu_sync._capability`). Thread-safe."""

    __slots__ = ("budget", "config", "outcomes", "state")

    def __init__(self, state: PoolState, config: PoolConfig, outcomes: Outcomes) -> None:
        self.state = state
        self.config = config
        self.budget = state.budget
        self.outcomes = outcomes

    def __call__(self, ctx: TaskContext, next: Upper) -> object:
        task = ctx.task
        if task.requires or task.prefers:
            ctx.lease = self.fit(ctx)
        return next(ctx)

    def fit(self, ctx: TaskContext) -> Lease | None:
        """Raises:
        TaskRejected: no configured worker meets ``requires``; nothing is sent."""
        state = self.state
        task = ctx.task
        config = state.config
        needs = state.capabilities
        if task.requires:
            ctx.unfit = unfit = needs.unfit(config, task.requires)
            if unfit:
                if len(unfit) >= len(config.workers):
                    why = needs.missing(config, task.requires)
                    raise self.reject_unfit(ctx, why)
                ctx.excluded |= unfit
                ctx.not_here |= unfit
        if not task.prefers:
            return None
        others = needs.unfit(config, task.prefers)
        if not others or len(others) >= len(config.workers):
            return None  # all or none preferred: the usual choice is the preferred one
        excluded = ctx.excluded | others
        if state.models_known and (model := named_model(state, ctx)) is not None:
            excluded |= state.lacking(model)
        if ctx.deposit is not None:
            ctx.deposit = None
            self.budget.deposit(ctx.start)
        return state.dispatcher.try_acquire(excluded, task.priority)

    def reject_unfit(self, ctx: TaskContext, why: str) -> TaskRejected:
        """The rejection of a task no configured worker can serve; nobody is charged."""
        task_id = ctx.task.task_id
        needs = ", ".join(sorted(ctx.task.requires))
        message = f"no worker meets the task's requires ({needs}): {why}"
        self.outcomes.rejected(task_id, None, None, message)
        return TaskRejected(f"{message} (task {task_id})", task_id=task_id)


class Admit:
    """A lease on the best worker not yet tried (see :mod:`npu_sync._admission`),
    waiting FIFO for one; the attempt's :class:`Try` handed down. Thread-safe."""

    __slots__ = ("admission", "max_queue_wait", "outcomes", "state")

    def __init__(self, state: PoolState, config: PoolConfig, outcomes: Outcomes) -> None:
        self.state = state
        self.max_queue_wait = config.pool.max_queue_wait
        self.admission: AdmissionConfig = config.admission
        self.outcomes = outcomes

    def __call__(self, ctx: TaskContext, next: Lower) -> object:
        """The lease (one had already, or waiting up to ``pool.max_queue_wait`` within
        the deadline), handed down in a :class:`Try`; None, with the reason in
        ``ctx.reason``, when none could be had."""
        lease = ctx.lease
        if lease is not None:
            ctx.lease = None
            return next(ctx, Try(lease, FIRST, ctx.stop))
        # Acquiring is inline, not a method of its own: one call less per attempt.
        excluded: Collection[str] = ctx.excluded
        if ctx.avoid is not None:
            excluded, ctx.avoid = ctx.avoid, None
        deposit = ctx.deposit
        if deposit is not None:
            ctx.deposit = None
        deadline = ctx.deadline
        state = self.state
        wait_until = state.clock.monotonic() + self.max_queue_wait
        got = state.dispatcher.acquire_or_reason(
            excluded,
            wait_until if wait_until < deadline else deadline,
            deposit,
            ctx.stop,
            admission=self.admission,
            task_deadline=deadline,
            priority=ctx.task.priority,
            model=ctx.model,
        )
        if isinstance(got, Lease):
            if ctx.trace is not None:
                self.outcomes.chose(ctx, got, excluded)
            return next(ctx, Try(got, FIRST, ctx.stop))
        if isinstance(got, Refusal):
            if got is Refusal.STOPPED:
                raise Stopped(ctx.task.task_id)
            self.outcomes.none_chosen(ctx, excluded)
            ctx.reason = self.refusal_reason(ctx, got, wait_until)
        else:
            self.late(ctx, got)
        return None

    def late(self, ctx: TaskContext, late: Late) -> None:
        """The queue ahead is expected to outlast the deadline (:mod:`npu_sync._foresight`):
        a task not yet tried is refused at once, no dead letter stored; a task already
        tried gives up with that reason (and is dead-lettered, as any retry that fails).

        Raises:
            AdmissionRefused: no attempt was made.
        """
        reason = f"refused on admission: {late.reason}"
        self.outcomes.note(ctx, reason)
        if ctx.attempts:
            ctx.reason = reason
            return
        task_id = ctx.task.task_id
        self.outcomes.rejected(task_id, None, None, reason)
        raise AdmissionRefused(
            f"{reason} (task {task_id})", task_id=task_id, expected=late.expected, left=late.left
        )

    def refusal_reason(self, ctx: TaskContext, refusal: Refusal, wait_until: float) -> str:
        """Why no worker was had: the limit that ran out, or, when waiting could not
        help, the state of the workers in one clause (:func:`outage.describe`)."""
        if refusal is not Refusal.DEADLINE_PASSED:
            return self.fleet_state(ctx)
        if wait_until >= ctx.deadline:
            return "deadline passed" if ctx.attempts else str(refusal.value)
        limit = f"pool.max_queue_wait ({self.max_queue_wait:g}s)"
        return f"no worker could take the task within {limit}"

    def fleet_state(self, ctx: TaskContext) -> str:
        """The workers' state, as a task that none of them can take sees it."""
        state = self.state
        model = ctx.model if ctx.model_read else None
        with state.lock:
            lacking = state.lacking(model) if model is not None and state.models_known else ()
            return describe(
                state.workers.values(),
                state.clock.monotonic(),
                tried=ctx.excluded,
                lacking=lacking,
                model=model,
            )


class FleetTrial:
    """With breakers shared between processes: a lease holding a half-open trial may
    send it only with the fleet's lease on it (see
    :func:`~npu_sync._life.ledger.take_fleet_trial`); else the lease is given back and
    the task picks again. Thread-safe.

    The fleet's lease lasts as long as the trial may: the trial deadline for an
    idempotent task (:func:`~npu_sync._life.transport.trial_deadline`), the deadline
    of the health check and then the task's own budget for a non-idempotent one (see
    :class:`~npu_sync._life.transport.Send`); never beyond the task's deadline."""

    __slots__ = ("read_timeout", "rule", "state")

    def __init__(self, state: PoolState, config: PoolConfig) -> None:
        self.state = state
        self.read_timeout = config.timeouts.read
        self.rule = TrialDeadline.from_config(config.circuit_breaker.trial)

    def __call__(self, ctx: TaskContext, at: Try, next: Lower) -> object:
        lease = at.lease
        if lease.trial:
            state = self.state
            remaining = ctx.deadline - state.clock.monotonic()
            read = self.read_timeout
            budget = trial_deadline(state, lease.worker, self.rule, read)
            if not ctx.task.idempotent:
                budget += read  # the health check, then the task
            if not take_fleet_trial(state, lease, budget if budget < remaining else remaining):
                return AGAIN
        return next(ctx, at)


class Record:
    """One attempt on the lease's worker, its outcome recorded under the lock.

    From here until :func:`~npu_sync._life.ledger.record` takes it back, the lease holds
    a slot on the worker (maybe its one half-open trial): whatever is raised, it is
    given back. A hedged attempt (``Try.settle``) that ends after the other one won was
    cancelled: it is recorded as abandoned, even if its answer was a success.
    Thread-safe (a hedge's attempt runs here on its own thread).
    """

    __slots__ = ("default_endpoint", "outcomes", "state")

    def __init__(self, state: PoolState, config: PoolConfig, outcomes: Outcomes) -> None:
        self.state = state
        self.default_endpoint = config.pool.default_endpoint
        self.outcomes = outcomes

    def __call__(
        self, ctx: TaskContext, at: Try, next: Callable[[TaskContext, Try], Outcome]
    ) -> Try | None:
        """Returns:
        ``at``, its outcome, held charge and times filled; None when too little time
        is left to start an attempt (``ctx.reason`` says so)."""
        state = self.state
        clock = state.clock
        stop = ctx.stop
        lease = at.lease
        side = at.side
        recorded = False
        try:
            if state.transitions:
                state.flush_transitions()
            t0 = clock.monotonic()
            remaining = ctx.deadline - t0
            if remaining <= MIN_ATTEMPT:
                recorded = True
                record(state, lease, UNUSED, 0.0, t0, retry=False)
                if side == FIRST:
                    ctx.reason = "deadline passed"
                return None
            if stop is not None and stop.cancelled and side == FIRST:
                # Stopped while the lease was handed over: give it back unused.
                raise Stopped(ctx.task.task_id)
            at.t0 = t0
            at.remaining = remaining
            outcome = next(ctx, at)
            if stop is not None and stop.cancelled and outcome.kind is not Kind.SUCCESS:
                # Cut short by the caller: says nothing about the worker.
                outcome = Outcome(Kind.ABANDONED, error=stop.reason)
            at.t1 = t1 = clock.monotonic()
            worker = lease.worker
            wid = worker.id
            success = outcome.kind is Kind.SUCCESS
            if success and worker.routed != lease.generation and ctx.path == self.default_endpoint:
                route_answered(worker, lease.generation)
            settle = at.settle
            if settle is not None and settle(side, success):
                # The other attempt won. A success here came too late (a transport that
                # cannot cancel): dropped like a failure, credited to nobody.
                outcome = Outcome(Kind.ABANDONED, error="cancelled: the hedged task was answered")
            if outcome.kind is Kind.NOT_HERE and lease.generation == worker.generation:
                # Before record() hands the slot on: the next task must know. An answer
                # from an address the worker has since left says nothing of the new one.
                not_loaded(state, ctx, worker, outcome)
            # An answer that may be the task's fault: is its charge held? Asked on the
            # caller's side only: the hedge's thread never touches the blame, so a
            # hedge's suspect answer is held until the caller settles it.
            deferred = outcome.suspect and (
                side == HEDGE
                or ctx.blamed().hold(
                    wid,
                    outcome,
                    lambda: untried_left(state, ctx.excluded | {wid}, ctx.deadline),
                )
            )
            at.outcome = outcome
            at.deferred = deferred
            recorded = True
            record(state, lease, outcome, t1 - t0, t1, retry=ctx.failures > 0, defer=deferred)
        finally:
            if not recorded:
                record(state, lease, UNUSED, 0.0, clock.monotonic(), retry=False)
        if state.hooks:
            self.outcomes.attempt_ended(ctx, worker, outcome, t0, t1, 2 if side == HEDGE else None)
        if (
            stop is not None
            and stop.cancelled
            and side == FIRST
            and outcome.kind is not Kind.SUCCESS
        ):
            raise Stopped(ctx.task.task_id)
        return at
