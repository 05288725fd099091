"""What a running pool knows, shared by its tasks, its own life and reload.

:class:`WorkerPool` (``pool.py``) builds one :class:`PoolState`. The life of each task
(``life/``) and applying a new configuration (``reconfigure.py``) work on it, so
neither reaches back into the pool, and the pool's façade reads it for ``stats()`` and
``workers()``.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from npu_sync._admission import Dispatcher
from npu_sync._balancing.limits import limit_of, new_limit
from npu_sync._balancing.selector import Selector
from npu_sync._balancing.slowstart import SlowStart
from npu_sync._breaker import CLOSED, OPEN, WorkerBreaker
from npu_sync._budget import BudgetTotals, RetryBudget
from npu_sync._capability import CapabilityFilter
from npu_sync._clock import Clock
from npu_sync._hedge import HedgePolicy, HedgeTimer, HedgeTotals
from npu_sync._metrics import PoolStats, WorkerStats
from npu_sync._modelcost import ModelCosts
from npu_sync._redact import MIN_SECRET_LENGTH, Scrubber
from npu_sync._retry import RetryPolicy
from npu_sync._stop import TaskStop
from npu_sync._worker import Worker
from npu_sync.config import BalancingConfig, PoolConfig, WorkerConfig
from npu_sync.events import (
    BreakerStateChanged,
    Event,
    Hook,
    RetryBudgetAvailable,
    RetryBudgetExhausted,
    WorkerLimitChanged,
    WorkerModelsChanged,
    WorkerSlowStart,
    emit,
    log_event,
)
from npu_sync.protocols import LINUX, WorkerProtocol, get_protocol
from npu_sync.task import Task
from npu_sync.trace import TaskWatch
from npu_sync.transport import Transport

log = logging.getLogger(__name__)

TransportFactory = Callable[..., Transport]
"""Builds one worker's transport: ``factory(worker_config, transport_config, maxsize=n)``."""

_LACKING_LIMIT = 1024
"""Models whose lacking workers are remembered at once; tasks may name any number."""


class PlaceLater(Exception):
    """A model no live worker holds could be loaded, but not before the task must stop
    waiting: every worker is full of models that may not leave yet (inside their
    hold time, or serving tasks) until after then. Raised by
    :meth:`ModelPlacer.place` through the steps of the task's life; the retry step
    ends the task as one no worker could take (``NoWorkerAvailable``, its dead letter
    stored first): the task is not bad, and a replay later may well succeed."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ModelPlacer(Protocol):
    """What the life of a task asks of placement (``models.balance``, see
    :mod:`npu_sync._placement`): counting tasks per worker and model, and loading a
    model no live worker holds where it is cheapest, evicting if need be (waiting,
    within the task's wait for a worker, for a slot to free; else
    :class:`PlaceLater`)."""

    def started(self, worker_id: str, model: str, now: float) -> None: ...

    def ended(self, worker_id: str, model: str, now: float) -> None: ...

    def place(
        self,
        model: str,
        timeout: float,
        stop: TaskStop | None = None,
        skip: frozenset[str] = frozenset(),
    ) -> str | None: ...


class Placement:
    """One model being loaded on a worker for the tasks that wait for it."""

    __slots__ = ("done", "error", "wakers", "worker_id")

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.done = threading.Event()
        self.error: str | None = None
        # Set with ``done``: what a task that can also be stopped waits on. Guarded by
        # the pool's lock, under which the placement ends.
        self.wakers: list[threading.Event] = []


class PoolState:
    """The mutable state of one running pool.

    Thread-safe as used: ``lock`` (the dispatcher's) guards every worker's mutable
    state, ``workers``, ``draining``, ``stats``, ``closed``, the queue of breaker
    transitions and the retry budget's counts (the budget takes it itself, but for a
    task's deposit, made in a lock round of the dispatcher's). ``config``, ``retry``,
    ``scrubber`` and ``hooks`` are immutable values replaced whole, so a task reads
    them without the lock and keeps what it read.

    Args:
        config: the configuration in force.
        clock: time source.
        transport_factory: builds each worker's transports.
        rng: randomness for selection sampling.
        hooks: callables receiving every event.
        shared: the Redis-backed shared state, or None.
        hedge_thread_init: called first on each hedge thread (see :class:`HedgeTimer`).
    """

    def __init__(
        self,
        config: PoolConfig,
        *,
        clock: Clock,
        transport_factory: TransportFactory,
        rng: random.Random | None,
        hooks: Iterable[Hook],
        shared: Any,
        hedge_thread_init: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.retry = RetryPolicy(config.retry)
        # Keeps the configuration's secrets out of what workers say (redact.py).
        self.scrubber = self.new_scrubber(config)
        self.clock = clock
        self.transport_factory = transport_factory
        balancing = config.balancing
        self.dispatcher = Dispatcher(
            clock,
            Selector(
                rng=rng,
                shared_breakers=config.shared_state.backend == "redis",
                latency_aware=balancing.latency_aware,
                decay=balancing.latency_decay,
                slow_start=SlowStart(window=balancing.slow_start),
                now=clock.monotonic(),
                strategy=balancing.strategy,
                peak_hold=balancing.peak_hold,
            ),
        )
        self.lock = self.dispatcher.lock
        self.dispatcher.set_classes_locked(config.priority)  # no other thread yet
        # The pool's totals, kept across reloads that replace the budget or the policy
        # (a task counts into the one it started with, which shares these).
        self.budget_totals = BudgetTotals()
        self.hedge_totals = HedgeTotals()
        self.budget = self._new_budget(balancing)
        self.hedge = _hedge_policy(balancing, self.hedge_totals)
        self._hedge_thread_init = hedge_thread_init
        self.hedger = self._new_hedger()
        # Balancing events found under the lock (a ramp begun, a limit moved), announced
        # after it by flush_events(): each built from the wall-clock time then, so that
        # no clock is read under the lock for them.
        self.events: list[Callable[[float], Event]] = []
        # Workers whose breaker closed after a trip: their slow start begins when the
        # transition is announced (pybreaker calls its listener in the middle of its
        # own state change, where nothing more should happen).
        self.recovering: list[Worker] = []
        self.stats = PoolStats()
        self.workers: dict[str, Worker] = {}
        self.draining: dict[str, Worker] = {}  # removed, with tasks still in flight
        self.hooks: tuple[Hook, ...] = tuple(hooks)
        # Follows every task from start to end when tracing is on (npu_sync._otel).
        self.observer: Callable[[Task], TaskWatch] | None = None
        self.shared = shared
        self.closed = False
        # Breaker transitions happen under the lock; they are announced after it.
        self.transitions: list[tuple[str, str, str, bool]] = []
        self.applying_remote = False  # a transition now comes from another process
        # Per model, the workers known not to serve it, for the configuration and
        # knowledge in force: emptied (under the lock) when either changes.
        self._lacking: dict[str, frozenset[str]] = {}
        self._lacking_for: PoolConfig | None = None
        # Whether some worker has a model list or a "not loaded" answer. Until one has,
        # no worker is known to lack any model, and a task skips reading the model it
        # names and looking up who lacks it (two look-ups an attempt). Set under the
        # lock before the news can route a task (models_changed_locked(),
        # model_not_loaded()), worked out again by a reload (models_checked_locked());
        # read without it: a task that reads it a moment late is bounced once, as one
        # that read the lacking workers a moment late would be.
        self.models_known = False
        self._protocols: tuple[WorkerProtocol, ...] = (LINUX,)
        self._protocols_for: PoolConfig | None = None
        # Models being loaded right now, per model and the workers it may not go to
        # (those lacking what the task requires).
        self.placements: dict[tuple[str, frozenset[str]], Placement] = {}
        self.capabilities = CapabilityFilter()  # who meets a task's requires/prefers
        self.placer: ModelPlacer | None = None  # set by the pool with models.balance
        models = config.models
        # Per-(worker, model) latency (models.model_latency), None when off.
        self.model_costs = (
            ModelCosts(config.balancing.latency_decay, models.latency_models)
            if models.model_latency
            else None
        )
        self.model_counts = {"corrections": 0, "placements": 0, "placement_failures": 0}

    def new_scrubber(self, config: PoolConfig, previous: Scrubber | None = None) -> Scrubber:
        """The scrubber for ``config`` (still covering ``previous``'s secrets); warns
        once per configuration of each secret too short to be looked for."""
        scrubber = Scrubber.from_config(config, previous)
        if previous is None or scrubber.too_short != previous.too_short:
            for where in scrubber.too_short:
                log.warning(
                    "%s is shorter than %d characters: a worker quoting it back cannot be "
                    "told from ordinary text, so it is not redacted from what workers say",
                    where,
                    MIN_SECRET_LENGTH,
                )
        return scrubber

    def build_worker(self, cfg: WorkerConfig) -> Worker:
        """A new worker: its transports and a closed breaker reporting to this state."""
        transport, health_transport = self.build_transports(cfg)
        breaker = WorkerBreaker(
            cfg.id,
            self.config.circuit_breaker,
            clock=self.clock,
            listener=self.on_transition,
            # Shared breakers: one trial per opening for the whole fleet.
            leased_trials=self.shared is not None,
        )
        worker = Worker(cfg, transport, breaker, health_transport)
        limit = new_limit(
            self.config.balancing.concurrency_limit, cfg.max_concurrent, self.clock.monotonic
        )
        if limit is not None:
            worker.set_limit(limit)
        return worker

    # -- balancing ---------------------------------------------------------------------

    def _new_budget(self, balancing: BalancingConfig) -> RetryBudget:
        return RetryBudget(
            balancing.retry_budget.ratio,
            balancing.retry_budget.min_per_second,
            clock=self.clock,
            on_change=self._budget_changed,
            # The pool's lock: a task pays in under the lock its first request for a
            # worker takes anyway (see Dispatcher.acquire_or_reason).
            lock=self.lock,
            totals=self.budget_totals,
        )

    def _new_hedger(self) -> HedgeTimer:
        return HedgeTimer(
            self.clock, threads=self.config.pool.threads, initializer=self._hedge_thread_init
        )

    def _budget_changed(self, exhausted: bool) -> None:
        """The budget's edge: outside every lock, on the thread that withdrew."""
        at = self.clock.time()
        self.notify(RetryBudgetExhausted(at) if exhausted else RetryBudgetAvailable(at))

    def configure_balancing_locked(self, old: BalancingConfig, new: BalancingConfig) -> None:
        """Apply a reload's balancing settings. Call with ``lock`` held, after the new
        workers are configured (adaptive limits follow each worker's ceiling)."""
        now = self.clock.monotonic()
        self.dispatcher.selector.configure(
            latency_aware=new.latency_aware,
            decay=new.latency_decay,
            slow_start=SlowStart(window=new.slow_start),
            now=now,
            strategy=new.strategy,
            peak_hold=new.peak_hold,
        )
        if new.retry_budget != old.retry_budget:
            self.budget = self._new_budget(new)  # a new window: tasks start it afresh
        if new.hedge != old.hedge:
            self.hedge = _hedge_policy(new, self.hedge_totals)
        name = new.concurrency_limit
        for worker in self.workers.values():
            ceiling = worker.config.max_concurrent
            limit = limit_of(worker.limit, name)
            if limit is None:
                # Another limit chosen (or none): the new one starts afresh.
                if worker.limit is not None or name != "fixed":
                    worker.set_limit(new_limit(name, ceiling, self.clock.monotonic))
            elif limit.ceiling != ceiling:
                limit.set_ceiling(ceiling)
                worker.set_limit(limit)
        self.dispatcher.release_locked(now)

    def recovered_locked(self, worker: Worker, now: float, reason: str) -> None:
        """``worker`` is back in service (``reason``: ``recovered``, a breaker closed
        after a trip; ``healthy``; ``moved``): its latency estimate starts again from
        its tier's, its share ramps up, its adaptive limit starts again. Call with
        ``lock`` held; the event waits in ``events``."""
        selector = self.dispatcher.selector
        ramp = selector.state_of(worker)
        if ramp.ramp_from == now and ramp.ramp_until > now:
            return  # already, this very moment (a move resets the breaker too)
        selector.recovered(worker, now)
        if worker.limit is not None:
            worker.limit.reset()
            worker.set_limit(worker.limit)
        if selector.slow_start.enabled and worker.id in self.workers:
            window = selector.slow_start.window
            wid = worker.id
            self.events.append(lambda at: WorkerSlowStart(at, wid, window, reason))

    def limit_changed_locked(self, worker: Worker, old: int) -> None:
        """``worker``'s adaptive limit moved its capacity from ``old``. Call with ``lock``."""
        wid, new = worker.id, worker.capacity
        self.events.append(lambda at: WorkerLimitChanged(at, wid, old, new))

    def flush_events(self) -> None:
        """Announce the balancing events found under the lock. Call without the lock."""
        with self.lock:
            events, self.events = self.events, []
        at = self.clock.time()
        for event in events:
            self.notify(event(at))

    def build_transports(self, cfg: WorkerConfig) -> tuple[Transport, Transport]:
        """A worker's task transport and its health-check transport."""
        # Health checks get a connection of their own, so a check never waits behind
        # tasks for a pooled connection, nor tasks behind a hung check.
        settings = self.config.transport
        return (
            self.transport_factory(cfg, settings, maxsize=cfg.max_concurrent),
            self.transport_factory(cfg, settings, maxsize=1),
        )

    # -- models ------------------------------------------------------------------------

    def task_model(self, payload: Any) -> str | None:
        """The model a task's payload names, read by the protocols the workers speak."""
        config = self.config
        protocols = self._protocols
        if self._protocols_for is not config:
            protocols = tuple(dict.fromkeys(get_protocol(w.protocol) for w in config.workers))
            self._protocols = protocols = protocols or (LINUX,)
            self._protocols_for = config
        for protocol in protocols:
            model = protocol.task_model(payload)
            if model is not None:
                return model
        return None

    def lacking(self, model: str) -> frozenset[str]:
        """The ids of the workers known not to serve ``model``: cached, so that routing
        a task that names a model costs a dictionary lookup until knowledge changes."""
        found = self._lacking.get(model)
        if found is not None and self._lacking_for is self.config:
            return found
        with self.lock:
            if self._lacking_for is not self.config or len(self._lacking) >= _LACKING_LIMIT:
                self._lacking = {}
                self._lacking_for = self.config
            found = frozenset(w.id for w in self.workers.values() if w.held.lacks(model))
            self._lacking[model] = found
            return found

    def models_changed_locked(self) -> None:
        """Some worker's models changed: forget what was derived. Call under the lock."""
        self._lacking = {}
        self.models_known = True

    def models_checked_locked(self) -> None:
        """The workers changed (a reload): whether any of them has a model list or a
        "not loaded" answer now. Call under the lock."""
        self._lacking = {}
        self.models_known = any(
            w.held.models is not None or w.held.not_loaded for w in self.workers.values()
        )

    def model_not_loaded(self, worker: Worker, model: str) -> None:
        """``worker`` answered "not loaded" for ``model``: correct its list at once."""
        with self.lock:
            before = worker.held.models
            news = worker.held.model_not_loaded(model, self.clock.monotonic())
            self.model_counts["corrections"] += 1
            self.models_known = True
            if news:
                self.models_changed_locked()
            now_models = worker.held.models
        if news:
            removed = (model,) if before is not None and model in before else ()
            self.notify(
                WorkerModelsChanged(
                    self.clock.time(),
                    worker.id,
                    "not_loaded",
                    (),
                    removed,
                    None if now_models is None else tuple(sorted(now_models)),
                )
            )

    def on_transition(self, name: str, old: str, new: str) -> None:
        """The breakers' listener. Called by pybreaker under the lock: only queues, and
        starts a worker's slow start when its breaker closes after a trip."""
        self.transitions.append((name, old, new, self.applying_remote))
        if new == CLOSED and old != CLOSED:
            worker = self.workers.get(name)
            if worker is not None:
                self.recovering.append(worker)

    def flush_transitions(self) -> None:
        """Announce the queued breaker transitions: to hooks, the log, other processes.

        Call without the lock: hooks run here, and the shared state does I/O.
        """
        with self.lock:
            transitions, self.transitions = self.transitions, []
            timeouts = {w.id: w.breaker.reset_timeout for w in self.workers.values()}
            recovering, self.recovering = self.recovering, []
            if recovering:
                now = self.dispatcher.clock.monotonic()
                for worker in recovering:
                    self.recovered_locked(worker, now, "recovered")
                self.dispatcher.release_locked(now)
        now = self.clock.time()
        shared = self.shared
        for name, old, new, remote in transitions:
            if shared is not None and not remote and new in (OPEN, CLOSED):
                # Before the hooks: a slow hook must not keep other processes waiting
                # for a decision (nor for the trial lease it ends).
                shared.announce(name, new, timeouts.get(name))
            self.notify(BreakerStateChanged(now, name, old, new))
        if self.events:
            self.flush_events()

    def notify(self, event: Event) -> None:
        """Log a notable event and pass it to the hooks. Call without the lock."""
        log_event(event)
        hooks = self.hooks
        if hooks:
            emit(hooks, event)

    def after_fork(self) -> None:
        """In a child process: a fresh lock and slots, the child's own numbers and
        connections. Tasks in flight, their slots, model loads and draining workers are
        the parent's: the child forgets them, its selector keeps no slot of them.
        """
        self.dispatcher = Dispatcher(self.clock, self.dispatcher.selector)
        self.lock = self.dispatcher.lock
        self.transitions = []
        self.events = []
        self.recovering = []
        self.budget_totals = BudgetTotals()  # the child's own, as its other numbers
        self.hedge_totals = HedgeTotals()
        self.budget = self._new_budget(self.config.balancing)
        self.hedge = _hedge_policy(self.config.balancing, self.hedge_totals)
        self.hedger = self._new_hedger()
        self.stats = PoolStats()
        # Their tasks are the parent's, and so are their connections: nothing here
        # would ever end them, and counted they would keep the workers' balancing slots
        # (and a worker re-added under the id full) for the child's whole life.
        for worker in self.draining.values():
            worker.in_flight = 0
        self.draining.clear()
        # A load under way is the parent's: no thread here would ever end it, and the
        # child's tasks for its model would wait on it until their deadlines.
        self.placements.clear()
        for worker in self.workers.values():
            worker.in_flight = 0
            worker.breaker.release(True)  # a trial in flight is the parent's
            worker.stats = WorkerStats()
            worker.transport, worker.health.transport = self.build_transports(worker.config)
        self.dispatcher.set_workers(self.workers.values())


def _hedge_policy(balancing: BalancingConfig, totals: HedgeTotals) -> HedgePolicy:
    hedge = balancing.hedge
    return HedgePolicy(
        enabled=hedge.enabled, delay=hedge.delay, percentile=hedge.percentile, totals=totals
    )
