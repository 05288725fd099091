"""The steps of a task that names a model: routing it to the workers that hold it, and
loading it on one when none does.

In the stack only when the configuration needs them (:mod:`npu_sync._life.stack`):

:class:`Costed` (with per-model latency estimates, ``models.model_latency``)
    a lease on the worker fastest for an uneven model, if it has room now; and every
    success fed to the estimate.
:class:`ModelRoute` (once some worker's model list is known)
    the workers known to lack the task's model are left out of the choice; when no
    worker holding it has room, :meth:`ModelRoute.serve` checks that a live worker may
    hold it, or loads it on one (:class:`ModelLoad`, with ``models.placement``), or
    rejects the task at once.
:class:`ModelHeld` (with it, below the lease)
    a worker learnt to lack the model while the task waited for it is given back
    unused, never tried.
:class:`ModelCount` (with ``models.balance``)
    tasks in flight per model, placement's measure, counted around each attempt.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable

from npu_sync._admission import Lease
from npu_sync._life.context import AGAIN, MIN_ATTEMPT, TaskContext, Try, shown
from npu_sync._life.ledger import UNUSED, record
from npu_sync._life.outcomes import Outcomes
from npu_sync._modelcost import ModelCosts
from npu_sync._outage import down_reason
from npu_sync._retry import Kind, Outcome
from npu_sync._state import Placement, PoolState
from npu_sync._stop import Stopped
from npu_sync._worker import Worker
from npu_sync.errors import TaskRejected, printable
from npu_sync.transport import TransportError

log = logging.getLogger(__name__)

_SUCCESS = Kind.SUCCESS

Upper = Callable[[TaskContext], object]
Lower = Callable[[TaskContext, Try], object]


def named_model(state: PoolState, ctx: TaskContext) -> str | None:
    """The model the task names, read once, by the protocols the workers speak."""
    if not ctx.model_read:
        ctx.model = state.task_model(ctx.task.payload)
        ctx.model_read = True
    return ctx.model


def not_loaded(state: PoolState, ctx: TaskContext, worker: Worker, outcome: Outcome) -> None:
    """Correct the worker's models after a "not loaded" answer. It lacks the model the
    task names, whatever its answer calls it: recording another name would send it
    every later task for this model."""
    model = named_model(state, ctx) or worker.protocol.not_loaded_model(outcome)
    if model is not None:
        state.model_not_loaded(worker, model)


class Costed:
    """The worker fastest for the task's model, by the per-(worker, model) estimates
    (:mod:`npu_sync._modelcost`), when it has room now; each success feeds them.
    Thread-safe."""

    __slots__ = ("budget", "choose", "costs", "state")

    def __init__(self, state: PoolState, costs: ModelCosts, choose: bool) -> None:
        self.state = state
        self.costs = costs
        self.budget = state.budget
        # Choosing by the estimate is least-loaded balancing's, latency-aware.
        self.choose = choose

    def __call__(self, ctx: TaskContext, next: Upper) -> object:
        costs = self.costs
        state = self.state
        if (
            ctx.lease is None
            and self.choose
            and costs.active
            and (model := named_model(state, ctx)) is not None
            and costs.uneven(model)
        ):
            ctx.lease = self.fastest_for(ctx, model)
        at = next(ctx)
        if type(at) is Try and at.outcome.kind is _SUCCESS:
            model = ctx.model if ctx.model_read else named_model(state, ctx)
            if model is not None:
                costs.observe(at.lease.worker.id, model, at.t1 - at.t0, at.t1, ctx.task.size)
        return at

    def fastest_for(self, ctx: TaskContext, model: str) -> Lease | None:
        """A lease on the worker fastest for ``model``, if it has room now; else None,
        and the usual choice follows."""
        state = self.state
        now = state.clock.monotonic()
        excluded = ctx.excluded
        lacking = state.lacking(model) if state.models_known else frozenset()
        workers = list(state.workers.values())
        candidates = [
            w for w in workers if w.id not in excluded and w.id not in lacking and w.eligible(now)
        ]
        if len(candidates) < 2:
            return None
        best = self.costs.best(candidates, model, now, ctx.task.size)
        if best is None:
            return None
        if ctx.deposit is not None:
            ctx.deposit = None
            self.budget.deposit(ctx.start)
        return state.dispatcher.try_acquire(
            [w.id for w in workers if w is not best], ctx.task.priority
        )


class ModelRoute:
    """Leave out the workers known to lack the task's model; when none that may hold it
    has room, make sure one may (or load it), else reject the task. Thread-safe."""

    __slots__ = ("budget", "connect_timeout", "outcomes", "placement", "state")

    def __init__(
        self, state: PoolState, outcomes: Outcomes, placement: bool, connect_timeout: float
    ) -> None:
        self.state = state
        self.outcomes = outcomes
        self.budget = state.budget
        self.placement = placement  # models.placement: load a model no worker holds
        self.connect_timeout = connect_timeout

    def __call__(self, ctx: TaskContext, next: Upper) -> object:
        if ctx.lease is None and (model := named_model(self.state, ctx)) is not None:
            state = self.state
            lacking = state.lacking(model)
            if lacking:
                if ctx.deposit is not None:
                    ctx.deposit = None
                    self.budget.deposit(ctx.start)
                ready = state.dispatcher.try_acquire(ctx.excluded | lacking, ctx.task.priority)
                if ready is not None:
                    if ctx.trace is not None:
                        self.outcomes.chose(ctx, ready, lacking)
                    ctx.lease = ready
                else:
                    if not self.serve(ctx, model):
                        return None
                    ctx.avoid = ctx.excluded | state.lacking(model)
        return next(ctx)

    def serve(self, ctx: TaskContext, model: str) -> bool:
        """Whether some live worker the task may run on may hold ``model`` (so waiting
        for one may help), after loading it on one if ``models.placement`` allows.

        Live means enabled, healthy, not draining, its breaker not open: a worker that
        is merely busy is worth waiting for, one that is down is not. A worker lacking
        what the task ``requires`` does not count, whatever it holds. A task that has
        already failed on a worker gives up (False, the reason in ``ctx.reason``): it
        may well succeed when replayed, once that worker is back.

        Raises:
            TaskRejected: no live worker the task may run on serves the model, naming
                it (``exc.model``) and what the others lack, and no attempt failed.
        """
        state = self.state
        unfit = ctx.unfit
        with state.lock:
            now = state.clock.monotonic()
            down: list[str] = []
            lacking = 0
            for worker in state.workers.values():
                if worker.id in unfit:
                    continue
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
        if unfit:
            detail += "; " + state.capabilities.unmet(state.config, ctx.task.requires, unfit)
        if ctx.failures:
            ctx.reason = f"{no_server(ctx)} serves model {shown(model)} ({detail})"
            return False
        if self.placement and not ctx.placed:
            ctx.placed = True
            failed = ModelLoad(state, ctx, self.outcomes, self.connect_timeout).place(model)
            if failed is None:
                self.readmit(ctx, model)
                return True
            detail += f"; {failed}"
        raise self.reject_model(ctx, model, detail)

    def readmit(self, ctx: TaskContext, model: str) -> None:
        """``model`` was just loaded: a worker this task found without it (it unloaded
        the model behind the pool's back) may hold it now, and may be tried again; a
        worker lacking what the task requires stays out, whatever it holds."""
        state = self.state
        with state.lock:
            back = {
                wid
                for wid in ctx.not_here - ctx.unfit
                if (w := state.workers.get(wid)) is not None and not w.held.lacks(model)
            }
        ctx.not_here -= back
        ctx.excluded -= back

    def reject_model(self, ctx: TaskContext, model: str, detail: str) -> TaskRejected:
        """The rejection of a task whose model no live worker serves; no attempt is
        charged to anybody."""
        task_id = ctx.task.task_id
        message = f"{no_server(ctx)} serves model {shown(model)} ({detail})"
        self.outcomes.rejected(task_id, None, None, message)
        return TaskRejected(f"{message} (task {task_id})", task_id=task_id, model=model)


def no_server(ctx: TaskContext) -> str:
    """Who a rejection says is missing: a live worker, one meeting what the task
    requires when some workers do not."""
    if not ctx.unfit:
        return "no live worker"
    return f"no live worker meeting the task's requires ({', '.join(sorted(ctx.task.requires))})"


class ModelHeld:
    """Below the lease: a worker learnt to lack the task's model while the task waited
    for it (another task's attempt bounced there) is given back unused and not tried,
    so an unload costs one bounce per worker, not one per queued task. Thread-safe."""

    __slots__ = ("state",)

    def __init__(self, state: PoolState) -> None:
        self.state = state

    def __call__(self, ctx: TaskContext, at: Try, next: Lower) -> object:
        state = self.state
        model = named_model(state, ctx)
        worker = at.lease.worker
        if model is None or worker.id not in state.lacking(model):
            return next(ctx, at)
        record(state, at.lease, UNUSED, 0.0, state.clock.monotonic(), retry=False)
        ctx.excluded.add(worker.id)
        ctx.not_here.add(worker.id)
        ctx.missing_model = model
        return AGAIN


class ModelCount:
    """Tasks in flight per model (``models.balance``'s measure), counted around each
    attempt of a task that names one. Thread-safe."""

    __slots__ = ("placer", "state")

    def __init__(self, state: PoolState) -> None:
        self.state = state
        self.placer = state.placer

    def __call__(self, ctx: TaskContext, at: Try, next: Lower) -> object:
        placer = self.placer
        state = self.state
        model = named_model(state, ctx)
        if placer is None or model is None:
            return next(ctx, at)
        used = at.lease.worker.id
        placer.started(used, model, state.clock.monotonic())
        try:
            return next(ctx, at)
        finally:
            placer.ended(used, model, state.clock.monotonic())


class ModelLoad:
    """Loading one model for one task that found no live worker holding it
    (``models.placement``). Made only then; used by the task's thread."""

    __slots__ = ("connect_timeout", "ctx", "outcomes", "state")

    def __init__(
        self, state: PoolState, ctx: TaskContext, outcomes: Outcomes, connect_timeout: float
    ) -> None:
        self.state = state
        self.ctx = ctx
        self.outcomes = outcomes
        self.connect_timeout = connect_timeout

    def place(self, model: str) -> str | None:
        """Have the least-loaded live worker that the task may run on (one meeting its
        ``requires``) load ``model``.

        One load per model and set of workers left out at a time: a task that finds
        one under way waits for it, within its deadline, rather than ask again. Returns
        None once the model is loaded, else why it is not.
        """
        state = self.state
        ctx = self.ctx
        skip = ctx.unfit
        placer = state.placer
        if placer is not None:  # models.balance: where loading is cheapest, evicting
            why = placer.place(model, ctx.deadline - state.clock.monotonic(), ctx.stop, skip)
            if ctx.stop is not None and ctx.stop.cancelled:
                raise Stopped(ctx.task.task_id)
            return why
        key = (model, skip)
        with state.lock:
            placement = state.placements.get(key)
            worker = None
            if placement is None:
                if self._served_locked(model, skip):
                    return None  # another task's placement ended since this one looked
                worker = self._placement_worker(skip)
                if worker is None:
                    return "no live worker to load it on"
                placement = state.placements[key] = Placement(worker.id)
        if worker is None:
            if not self.await_placement(placement):
                return f"loading it on {placement.worker_id} did not end before the deadline"
            return placement.error
        error: str | None = "loading it was interrupted"
        try:
            error = self.load(worker, model)
        finally:
            with state.lock:
                del state.placements[key]
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
            self.outcomes.placed(worker, model, models)
        return error

    def await_placement(self, placement: Placement) -> bool:
        """Wait for another task's placement to end, within the deadline: whether it
        did. A model may take minutes to load: a task stopped meanwhile leaves at once
        (``Stopped``), its thread free, the load going on for the others.
        """
        ctx = self.ctx
        left = max(0.0, ctx.deadline - self.state.clock.monotonic())
        stop = ctx.stop
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
            raise Stopped(ctx.task.task_id)
        return False

    def _served_locked(self, model: str, skip: frozenset[str]) -> bool:
        """Whether a live worker not in ``skip`` may serve ``model``. Under the lock."""
        now = self.state.clock.monotonic()
        return any(
            w.id not in skip and not w.held.lacks(model) and down_reason(w, now) is None
            for w in self.state.workers.values()
        )

    def _placement_worker(self, skip: frozenset[str]) -> Worker | None:
        """The live worker not in ``skip`` with the least load for its weight. Under
        the lock."""
        now = self.state.clock.monotonic()
        best: Worker | None = None
        best_load = 0.0
        for worker in self.state.workers.values():
            if worker.id not in skip and down_reason(worker, now) is None:
                load = worker.in_flight / worker.weight
                if best is None or load < best_load:
                    best, best_load = worker, load
        return best

    def load(self, worker: Worker, model: str) -> str | None:
        """Send ``worker`` its protocol's load request for ``model``, no lock held,
        within the task's deadline; None when it answered 2xx (and not "failed")."""
        state = self.state
        method, path, body = worker.protocol.load_request(model)
        auth = worker.auth
        try:
            response = worker.transport.request(
                method,
                path,
                body=None if body is None else json.dumps(body).encode(),
                headers=None if auth is None else auth.headers(method, worker.base_path + path),
                timeout=max(MIN_ATTEMPT, self.ctx.deadline - state.clock.monotonic()),
                connect_timeout=self.connect_timeout,
            )
        except TransportError as exc:
            # The worker's words enter the pool here too: scrubbed, bounded.
            why = state.scrubber(printable(f"{exc.kind}: {exc}"))
            return f"loading it on {worker.id} failed: {why}"
        except Exception as exc:  # a bug of ours, or of a custom transport
            log.exception("unexpected error loading model on worker %s", worker.id)
            return f"loading it on {worker.id} failed: {type(exc).__name__}"
        outcome = worker.protocol.classify(response)
        if outcome.kind is Kind.SUCCESS:
            value = outcome.value
            if not (type(value) is dict and value.get("status") in ("failed", "error")):
                return None
        why = state.scrubber(outcome.error or f"HTTP {response.status}")
        return f"loading it on {worker.id} failed: {why}"
