"""The steps of a task's life, stacked once per configuration.

:class:`Stack` builds, from the pool's configuration, the chain of small steps each
attempt goes down, top to bottom (a step the configuration does not need is not in
it)::

    Retry                      the loop: one attempt after another (retry.py)
      Fit                      for a task with requires / prefers (admission.py)
      Costed                   with models.model_latency: the fastest for the model
      ModelRoute               once model lists are known: workers lacking it left out
      Admit                    the lease, waiting FIFO for capacity (admission.py)
        ModelHeld              once model lists are known: learnt to lack it meanwhile
        FleetTrial             with shared breakers: the fleet's lease on a trial
        ModelCount             with models.balance: tasks in flight per model
        Hedge                  with balancing.hedge: a second worker for a slow answer
        Record                 the attempt, recorded under the lock (admission.py)
        Compose                body, headers, auth (protocol.py)
        Send                   the request and its outcome (transport.py)

Above :class:`~npu_sync._life.admission.Admit` a step is called as
``step(ctx, next)``; from the lease down, as ``step(ctx, attempt, next)``. Each link
is a closure made here once, so a task pays one call per step and no lookup. Which
chain an attempt takes is read per task (``Fit`` for a task with ``requires`` or
``prefers``) and per attempt (the model steps once ``PoolState.models_known``: a pool
learns its workers' models while it runs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from npu_sync._life.admission import Admit, Fit, FleetTrial, Record
from npu_sync._life.context import TaskContext, Try
from npu_sync._life.hedge import Hedge
from npu_sync._life.models import Costed, ModelCount, ModelHeld, ModelRoute
from npu_sync._life.outcomes import Outcomes
from npu_sync._life.protocol import Compose
from npu_sync._life.retry import Retry
from npu_sync._life.transport import Send
from npu_sync._state import PoolState
from npu_sync._stop import TaskStop
from npu_sync.task import Task
from npu_sync.trace import TaskWatch

UpperStep = Callable[[TaskContext, Callable[[TaskContext], Any]], Any]
LowerStep = Callable[[TaskContext, Try, Callable[[TaskContext, Try], Any]], Any]


def upper(
    steps: Sequence[UpperStep], last: Callable[[TaskContext], Any]
) -> Callable[[TaskContext], Any]:
    """``steps`` chained in front of ``last``: each called as ``step(ctx, next)``."""
    call = last
    for step in reversed(steps):
        call = _upper_link(step, call)
    return call


def lower(
    steps: Sequence[LowerStep], last: Callable[[TaskContext, Try], Any]
) -> Callable[[TaskContext, Try], Any]:
    """``steps`` chained in front of ``last``: each called as ``step(ctx, at, next)``."""
    call = last
    for step in reversed(steps):
        call = _lower_link(step, call)
    return call


def _upper_link(step: UpperStep, nxt: Callable[[TaskContext], Any]) -> Callable[[TaskContext], Any]:
    # The class's function, not the instance: calling an instance looks up __call__
    # each time, which costs about as much as the step's own work (benchmarks.md).
    call = type(step).__call__

    def link(ctx: TaskContext) -> Any:
        return call(step, ctx, nxt)

    return link


def _lower_link(
    step: LowerStep, nxt: Callable[[TaskContext, Try], Any]
) -> Callable[[TaskContext, Try], Any]:
    call = type(step).__call__

    def link(ctx: TaskContext, at: Try) -> Any:
        return call(step, ctx, at, nxt)

    return link


class Stack:
    """The steps for one configuration (and its retry policy, hedge policy, budget,
    placer, model costs and shared state: :meth:`current` says whether the pool still
    runs with them). Immutable once built; thread-safe."""

    __slots__ = (
        "budget",
        "chains",
        "config",
        "costs",
        "first",
        "hedge",
        "outcomes",
        "placer",
        "policy",
        "retry",
        "shared",
        "state",
        "steps",
    )

    def __init__(
        self, state: PoolState, outcomes: Outcomes, check: Callable[[Any], object] | None
    ) -> None:
        self.state = state
        self.outcomes = outcomes
        self.config = config = state.config
        self.policy = policy = state.retry
        self.hedge = hedge = state.hedge
        self.budget = state.budget
        self.placer = placer = state.placer
        self.costs = costs = state.model_costs
        self.shared = shared = state.shared
        self.retry = Retry(state, config, policy, outcomes)
        below: list[Any] = []
        if shared is not None:
            below.append(FleetTrial(state, config))
        if placer is not None:
            below.append(ModelCount(state))
        if hedge.enabled:
            below.append(Hedge(state, hedge, outcomes))
        below += [Record(state, config, outcomes), Compose()]
        fit = Fit(state, config, outcomes)
        costed: list[Any] = []
        if costs is not None:
            balancing = config.balancing
            choose = balancing.latency_aware and balancing.strategy == "least-loaded"
            costed.append(Costed(state, costs, choose))
        admit = Admit(state, config, outcomes)
        send = Send(state, config, policy, check)
        route = ModelRoute(state, outcomes, config.models.placement, config.timeouts.connect)
        held = ModelHeld(state)
        plain = _admit(admit, lower(below, send.__call__))
        models = _admit(admit, lower([held, *below], send.__call__))
        # A task that names no requires/prefers goes without the Fit step; one chain
        # or the other by whether any worker's models are known (read per attempt).
        self.chains = (
            (upper(costed, plain), upper([*costed, route], models)),
            (upper([fit, *costed], plain), upper([fit, *costed, route], models)),
        )
        # The retry step's next step (Stack.attempt's work), made once, not per task.
        self.first = _attempt(state)
        # The stack as a list, top to bottom, for docs, tests and repr().
        self.steps: tuple[Any, ...] = (self.retry, fit, *costed, route, admit, held, *below, send)

    def current(self) -> bool:
        """Whether the pool still runs with what this stack was built from.

        Asked once per task, so it compares only what can change while the pool
        runs: the configuration (a reload; the retry policy, retry budget and hedge
        policy are replaced only with it), the hedge policy (replaced, with the retry
        budget, in a child process after ``fork()``) and the placer (set once when the
        pool starts). Shared state and model costs are fixed when the pool is built.
        """
        state = self.state
        return (
            state.config is self.config
            and state.hedge is self.hedge
            and state.placer is self.placer
        )

    def attempt(self, ctx: TaskContext) -> Any:
        """One attempt down the task's chain (the model-aware one once models are
        known)."""
        return self.first(ctx)

    def run(self, ctx: TaskContext) -> Any:
        """The task's result (see :class:`~npu_sync._life.retry.Retry`)."""
        return _retry(self.retry, ctx, self.first)

    def begin(
        self,
        task: Task,
        body: bytes,
        deadline: float,
        stop: TaskStop | None,
        watch: TaskWatch | None,
    ) -> TaskContext:
        """The context of a task about to run.

        Raises:
            InvalidTask: the task names a priority class the pool does not have.
        """
        state = self.state
        clock = state.clock
        start = clock.monotonic()
        ctx = TaskContext(
            task,
            body,
            deadline,
            task.endpoint or self.config.pool.default_endpoint,
            start,
            clock.time() - start,
            stop,
            self.budget.deposit_locked,
        )
        if task.priority is not None:
            state.dispatcher.classes.rank(task.priority)  # an unknown class: InvalidTask
        ctx.chains = self.chains[bool(task.requires or task.prefers)]
        if watch is not None:
            ctx.trace = watch.trace
            ctx.extra_headers = watch.attempt_headers
        return ctx


_retry = Retry.__call__


def _attempt(state: PoolState) -> Callable[[TaskContext], Any]:
    """One attempt down the task's chain: the model-aware one once any worker's models
    are known."""

    def attempt(ctx: TaskContext) -> Any:
        return ctx.chains[state.models_known](ctx)

    return attempt


def _admit(admit: Admit, below: Callable[[TaskContext, Try], Any]) -> Callable[[TaskContext], Any]:
    """The junction: the admission step, its next step the chain below the lease."""

    call = Admit.__call__

    def link(ctx: TaskContext) -> Any:
        return call(admit, ctx, below)

    return link
