"""WorkerPool: what a user calls, and the pool's own life (its threads, close, fork).

The public methods are here: ``execute``/``submit``/``map``, ``stats``/``workers``,
``add_worker``/``remove_worker``/``reload``, ``check_health``, hooks, ``close`` and
``get_pool()``. The pool composes the rest and wires it together:

* the life of one task (deadline, waiting for a worker, attempts, who is charged,
  backoff, recording, dead letter, replay) is :mod:`npu_sync._life`;
* applying a new configuration is :mod:`npu_sync._reconfigure`; watching the file,
  :mod:`npu_sync._reload`;
* what all of them share (workers, lock, counters, settings, hooks) is a
  :class:`~npu_sync._state.PoolState`.

What stays here is the pool's own life: counting the tasks in progress so that
``close()`` can wait for them, the health, reload and shared-state threads, and
starting afresh in a child process after ``fork()``.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import contextvars
import functools
import logging
import os
import random
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal, cast, overload

from npu_sync._breaker import CLOSED, OPEN
from npu_sync._clock import SYSTEM_CLOCK, Clock
from npu_sync._deadletter import DeadLetterStore, open_store
from npu_sync._fdlimit import check as check_descriptors
from npu_sync._fleet import FleetSettings, Monitor
from npu_sync._guard import ReloadGuard
from npu_sync._health import HealthChecker, HealthResult
from npu_sync._life import Runner
from npu_sync._modelview import model_rows
from npu_sync._outage import awaiting_first_check, credentials_news
from npu_sync._placement import Load, Placer, Unload
from npu_sync._reconfigure import Reconfigurer
from npu_sync._reconfigure import ReloadResult as ReloadResult
from npu_sync._redact import NO_SCRUBBER, Scrubber
from npu_sync._reload import ConfigWatcher
from npu_sync._state import PoolState
from npu_sync._state import TransportFactory as TransportFactory
from npu_sync._stats_types import (
    BalancingStats,
    ConnectionStats,
    FleetStatsDict,
    HealthStats,
    ModelStats,
    ModelViewDict,
    PoolStatsDict,
    ReloadStats,
    SharedStateStats,
    WorkerRow,
)
from npu_sync._stop import TaskStop
from npu_sync._worker import Worker, render
from npu_sync.config import (
    HealthConfig,
    PoolConfig,
    WorkerConfig,
    config_for_url,
    parse_yaml,
    read_config_text,
    worker_config,
)
from npu_sync.errors import ConfigError, InvalidTask, NpuSyncError, PoolClosed, install_hint
from npu_sync.events import (
    Hook,
    WorkerCredentialsRefused,
    WorkerHealthChanged,
    WorkerModelsChanged,
)
from npu_sync.task import Task, as_task, current_scope, priority_scope, traced
from npu_sync.trace import TaskWatch, Trace, asked
from npu_sync.transport import IdleReaper, make_transport, reap_interval

log = logging.getLogger(__name__)


class WorkerPool:
    """A pool of NPU workers that runs tasks on them from synchronous code.

    Thread-safe: any number of threads may call ``execute``/``submit``/``map`` and the
    inspection methods at once. One lock guards selection and bookkeeping; it is
    never held across network I/O.

    Args:
        config: the validated configuration.
        clock: time source (tests pass a fake one).
        transport_factory: builds each worker's HTTP transport.
        dead_letter_store: where failed tasks are kept; default from ``config``.
        rng: randomness for selection sampling.
        hooks: callables receiving every event (see :mod:`npu_sync.events`).
        result_check: called with every 2xx answer's decoded JSON before it is
            returned; if it raises, the answer counts as that worker's failure (and the
            task is retried elsewhere). By default any JSON answer is a result.
        reload_guard: what a reload of the pool's file may do (see
            docs/operations.md); the keys of the new file's ``reload:`` section win
            over it. Default: the ``NPU_SYNC_RELOAD_*`` environment variables, else
            the built-in rules.

    Raises:
        ConfigError: an ``NPU_SYNC_RELOAD_*`` variable is invalid; dead letters
            would go to a Redis whose ``maxmemory-policy`` may evict them.
    """

    def __init__(
        self,
        config: PoolConfig,
        *,
        clock: Clock = SYSTEM_CLOCK,
        transport_factory: TransportFactory = make_transport,
        dead_letter_store: DeadLetterStore | None = None,
        rng: random.Random | None = None,
        hooks: Iterable[Hook] = (),
        result_check: Callable[[Any], object] | None = None,
        reload_guard: ReloadGuard | None = None,
    ) -> None:
        # Read first: a bad NPU_SYNC_RELOAD_* value fails before anything is started.
        guard = reload_guard if reload_guard is not None else ReloadGuard.from_env(os.environ)
        check_descriptors(config)  # before any socket: EMFILE named now, not mid-task
        tracing = _tracing(config) if config.tracing.opentelemetry else None
        # Idle connections of every worker: one cap over them all, swept for expiry.
        self._reaper = IdleReaper(
            config.transport.max_idle_connections,
            reap_interval(config.transport.idle_timeout),
        )
        shared = _shared_state(config, _weakly(self, WorkerPool._apply_remote, None))
        state = self._state = PoolState(
            config,
            clock=clock,
            transport_factory=self._reaper.factory(transport_factory),
            rng=rng,
            hooks=hooks,
            shared=shared,
            # The hedge threads run tasks' attempts and their hooks: the pool's own work,
            # which close() must not wait on from there (the task waits for its hedge).
            hedge_thread_init=_weakly(self, WorkerPool._mark_own_thread, None),
        )
        if tracing is not None:
            state.observer = tracing(state.task_model)
        self._idle = threading.Condition(state.lock)
        self._active = 0
        self._released = False
        self._release_done = threading.Event()
        # close() called on a thread that runs one of our tasks (from a hook or a
        # fallback) cannot wait for that task: the last task to end finishes closing.
        self._finish_when_idle = False
        # .depth > 0: this thread runs the pool's own work (a task, a hook called from
        # one of the pool's threads, a pool thread's future callback).
        self._local = threading.local()
        self._restart_pending = False  # forked: start our threads on first use
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._started = clock.monotonic()
        self._rng = rng or random.Random()
        self._reconfigurer = Reconfigurer(
            state,
            on_health=self._health_settings_changed,
            guard=guard,
            check_soon=_weakly(self, WorkerPool._check_soon, None),
        )
        # History and fleet snapshot; sampled from the start when there is other
        # background work (health checks, shared state), else from the first look.
        self._monitor = Monitor(
            self,
            shared,
            clock=clock,
            settings=FleetSettings.from_config(config.fleet, os.environ),
            eager=config.health.enabled,
        )
        self._watcher: ConfigWatcher | None = None
        # Why the pool runs on a stand-in configuration, if it does (see get_pool).
        self._fallback_reason: str | None = None
        if dead_letter_store is not None:
            store: DeadLetterStore = dead_letter_store
        elif config.dead_letter.backend == "redis" and shared is not None:
            # Redis that may evict them is no place to acknowledge dead letters in.
            try:
                shared.eviction.refuse_dead_letters()
            except ConfigError:
                shared.stop()
                raise
            store = shared.dead_letter_store(
                config.dead_letter.max_records, spool_path=config.dead_letter.spool_path
            )
        else:
            store = open_store(config.dead_letter)
        self._runner = Runner(state, store, result_check=result_check, hold=self._replaying)
        self.dead_letters = self._runner.dead_letters
        for warning in config.warnings:  # keys of the file that have no effect
            log.warning("%s", warning)
        for worker_cfg in config.workers:
            state.workers[worker_cfg.id] = state.build_worker(worker_cfg)
        state.dispatcher.set_workers(state.workers.values())
        self._health = self._new_health_checker()
        if config.health.enabled:
            self._health.start()
        if shared is not None:
            shared.set_workers(state.workers)
            shared.on_resume = _weakly(self, WorkerPool._announce_open_breakers, None)
            shared.start()
        self._monitor.start()
        # Placement rounds (models.balance): the thread only when asked for.
        self._placer: Placer | None = None
        if config.models.balance:
            self._placer = state.placer = Placer(state, self._rng)
            self._placer.start()
        _live_pools.add(self)

    @classmethod
    def from_yaml(
        cls,
        path: str | os.PathLike[str],
        *,
        watch: bool = True,
        poll_interval: float = 10.0,
        **kwargs: Any,
    ) -> WorkerPool:
        """Build a pool from a YAML file (see docs/configuration.md).

        Args:
            path: the YAML file.
            watch: reload the file when it changes on disk (see docs/operations.md).
            poll_interval: seconds between re-checks of the file when no
                file-system event came (for file systems that send none).
            **kwargs: passed on to :class:`WorkerPool`.

        Raises:
            ConfigError: the file is missing or invalid; every error names its key.
        """
        source = os.path.abspath(os.fspath(path))
        text = read_config_text(source)
        pool = cls(parse_yaml(text, source=source), **kwargs)
        pool._reconfigurer.loaded(text)
        if watch:
            pool._watcher = ConfigWatcher(
                source,
                _weakly(pool, WorkerPool._reload_if_changed, None),
                poll_interval=poll_interval,
            )
            try:
                pool._watcher.start()
            except BaseException:
                pool.close()
                raise
        return pool

    # -- running tasks -----------------------------------------------------------------

    def execute(
        self,
        task: Task | Any,
        timeout: float | None = None,
        *,
        fallback: Callable[[], Any] | None = None,
        trace: Trace | bool | None = None,
    ) -> Any:
        """Run one task and return the worker's decoded JSON body.

        Args:
            task: a :class:`Task` or a JSON-serialisable payload for the default endpoint.
            timeout: the task's whole deadline in seconds (every attempt and wait);
                default the task's own, else ``timeouts.task``.
            fallback: run locally, and its result returned, when the task fails on
                every worker; no dead letter is stored if it succeeds.
            trace: a :class:`~npu_sync.trace.Trace` to fill with the task's routing as
                it runs; or True: the pool makes one, which
                :func:`~npu_sync.trace.last_trace` returns afterwards (and a failure
                carries). A failed task carries one anyway.

        Raises:
            TaskRejected: the task is bad (a 4xx, or no worker serves its model).
            TaskFailed: no attempt succeeded; the dead-letter record is stored first.
            InvalidTask: the task cannot be sent (not JSON, bad options).
            TypeError: ``trace`` is not a Trace, True or False.
            PoolClosed: the pool is closed.
        """
        task = as_task(task)
        if trace is not None and (wanted := asked(trace)) is not None:
            task = traced(task, wanted)
        body = task.body()
        deadline = self._runner.deadline(task, timeout)
        self._enter()
        try:
            return self._execute(task, body, deadline, fallback)
        finally:
            self._leave()

    def submit(
        self,
        task: Task | Any,
        timeout: float | None = None,
        *,
        fallback: Callable[[], Any] | None = None,
        trace: Trace | bool | None = None,
    ) -> concurrent.futures.Future[Any]:
        """Run a task on the pool's own threads; the future ends as :meth:`execute` would.

        The task's deadline starts now: time spent queued for a pool thread counts.
        With ``trace=True``, :func:`~npu_sync.trace.last_trace` on the calling thread
        is the task's trace as soon as this returns, complete once the future is done.
        """
        task = as_task(task)
        if trace is not None and (wanted := asked(trace)) is not None:
            task = traced(task, wanted)
        body = task.body()
        deadline = self._runner.deadline(task, timeout)
        self._enter()
        try:
            run: Callable[..., Any] = self._execute
            if self._state.observer is not None:
                # The caller's current span goes with the task: it is the task's parent.
                run = functools.partial(contextvars.copy_context().run, self._execute)  # type: ignore[call-arg]
            future = self._get_executor().submit(run, task, body, deadline, fallback)
        except RuntimeError:  # the executor shut down between _enter() and here
            self._leave()
            raise PoolClosed("the pool is closed") from None
        except BaseException:
            self._leave()
            raise
        future.add_done_callback(self._leave_cb)
        return future

    def map(
        self,
        tasks: Iterable[Task | Any],
        timeout: float | None = None,
        *,
        window: int | None = None,
    ) -> Iterator[Any]:
        """Run tasks concurrently and yield their results in order.

        At most ``window`` tasks (default twice the pool's thread count) are in flight
        or queued at once, so a long iterable does not build every future up front.
        The first exception is raised when its result is reached; tasks not yet
        started then are cancelled (never sent), as ``Executor.map`` does. Every task
        takes the priority class of the scope ``map`` was called in (a Flask route's),
        also those fed in later, while the results are read outside it.
        """
        limit = window or 2 * self._state.config.pool.threads
        if limit < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        source = iter(tasks)
        pending: deque[concurrent.futures.Future[Any]] = deque()
        scope = current_scope()
        self._refill(source, pending, timeout, limit, scope)
        return self._map_results(source, pending, timeout, limit, scope)

    def _refill(
        self,
        source: Iterator[Task | Any],
        pending: deque[concurrent.futures.Future[Any]],
        timeout: float | None,
        limit: int,
        scope: str | None = None,
    ) -> None:
        if scope is not None and current_scope() != scope:
            # Read after the caller left the scope (a streamed response): the class
            # is the one the map was started with.
            with priority_scope(scope):
                self._refill(source, pending, timeout, limit)
            return
        for task in source:
            try:
                future = self.submit(task, timeout)
            except InvalidTask as exc:
                # Raised at this task's own position, after the results before it.
                future = concurrent.futures.Future()
                future.set_exception(exc)
            pending.append(future)
            if len(pending) >= limit:
                return

    def _map_results(
        self,
        source: Iterator[Task | Any],
        pending: deque[concurrent.futures.Future[Any]],
        timeout: float | None,
        limit: int,
        scope: str | None,
    ) -> Iterator[Any]:
        try:
            while pending:
                result = pending.popleft().result()
                yield result
                self._refill(source, pending, timeout, limit, scope)
        finally:
            for future in pending:
                future.cancel()

    # -- inspecting --------------------------------------------------------------------

    @property
    def config(self) -> PoolConfig:
        """The configuration in force."""
        return self._state.config

    @property
    def closed(self) -> bool:
        return self._state.closed

    @overload
    def stats(self, scope: Literal["local"] = "local") -> PoolStatsDict: ...

    @overload
    def stats(self, scope: Literal["fleet"]) -> FleetStatsDict: ...

    def stats(self, scope: str = "local") -> PoolStatsDict | FleetStatsDict:
        """Pool-wide counters and gauges, JSON-serialisable (see docs/metrics.md).

        ``scope="fleet"``: every process's pool, through the shared state (see
        :mod:`npu_sync._fleet`), with this process's stats under ``local``.
        """
        if scope == "fleet":
            return self._monitor.fleet()
        if scope != "local":
            raise ValueError(f"scope must be 'local' or 'fleet', got {scope!r}")
        if self._restart_pending:
            self._restart_after_fork()
        # The store may be a file: read it (without waiting) before taking the lock; so
        # is the shared state's spool file.
        stored, dropped = self.dead_letters.counts()
        shared = {"backend": "none"} if self._state.shared is None else self._state.shared.stats()
        budget = self._state.budget.stats()
        hedge = self._state.hedge.stats()
        # The per-model rows walk every worker's models: outside the lock, which tasks
        # take to be admitted (what they read is swapped whole; a row may be a moment
        # older than the counters).
        per_model = self._model_rows()
        with self._state.lock:
            now = self._state.clock.monotonic()
            workers = list(self._state.workers.values())
            s = self._state.stats
            sel50, sel99 = self._state.dispatcher.selection_time.percentiles(50, 99)
            selection = self._state.dispatcher.selector.stats(now)
            return {
                "uptime_s": now - self._started,
                "closed": self._state.closed,
                "fallback": {
                    "active": self._fallback_reason is not None,
                    "reason": self._fallback_reason,
                },
                "workers": {
                    "total": len(workers),
                    "available": sum(1 for w in workers if w.eligible(now)),
                    "healthy": sum(1 for w in workers if w.healthy),
                    "open_breakers": sum(1 for w in workers if w.breaker.state != "closed"),
                },
                "tasks": {
                    "submitted": s.submitted,
                    "succeeded": s.succeeded,
                    "rejected": s.rejected,
                    "failed": s.failed,
                    "fallbacks": s.fallbacks,
                    "cancelled": s.cancelled,
                    "retries": s.retries,
                    "active": self._active,
                    "in_flight": sum(w.in_flight for w in workers)
                    + sum(w.in_flight for w in self._state.draining.values()),
                    "waiting": self._state.dispatcher.waiting,
                },
                "dead_letters": {
                    "stored_total": s.dead_lettered,
                    "pending": stored,
                    "dropped": dropped,
                },
                "reloads": cast(
                    ReloadStats,
                    {**self._reconfigurer.counts(), "handover": self._reconfigurer.handover()},
                ),
                "shared_state": cast(SharedStateStats, shared),
                "health": cast(
                    HealthStats,
                    {
                        "enabled": self._state.config.health.enabled,
                        "running": self._health.running,
                        "rounds": self._health.rounds,
                        **self._health.stats(),
                    },
                ),
                "connections": cast(ConnectionStats, self._reaper.stats()),
                "selection_us": {
                    "p50": None if sel50 is None else sel50 * 1e6,
                    "p99": None if sel99 is None else sel99 * 1e6,
                },
                "models": cast(
                    ModelStats,
                    {
                        "placement": self._state.config.models.placement,
                        "held": sorted(
                            {m for w in workers if w.held.models for m in w.held.models}
                        ),
                        "unknown": sum(1 for w in workers if w.held.models is None),
                        "corrections": self._state.model_counts["corrections"],
                        "placements": self._state.model_counts["placements"],
                        "placement_failures": self._state.model_counts["placement_failures"],
                        **self._placement_stats(per_model),
                    },
                ),
                "balancing": cast(
                    BalancingStats,
                    {
                        **selection,
                        "ramping": sorted(cast(dict[str, float], selection["ramping"])),
                        "adaptive_concurrency": self._state.config.balancing.adaptive_concurrency,
                        "concurrency_limit": self._state.config.balancing.concurrency_limit,
                        "retry_budget": budget,
                        "hedge": hedge,
                    },
                ),
            }

    def workers(self) -> list[WorkerRow]:
        """One JSON-serialisable dict per worker, in priority order."""
        with self._state.lock:
            now = self._state.clock.monotonic()
            # A draining worker re-added under its id shows once: the live row.
            draining = [w for w in self._state.draining.values() if w.id not in self._state.workers]
            ordered = sorted(
                [*self._state.workers.values(), *draining], key=lambda w: (w.priority, w.id)
            )
            selector = self._state.dispatcher.selector
            captured = [w.capture(selector.captured(w)) for w in ordered]
        # Percentiles and rates are computed from copies, outside the lock.
        return [render(c, now) for c in captured]

    # -- changing the pool -------------------------------------------------------------

    def add_worker(self, worker: WorkerConfig | None = None, /, **fields: Any) -> None:
        """Add a worker at run time: a ``WorkerConfig`` or its fields (``id``, ``url`` …).

        A later reload of the YAML file makes the pool match the file again, so a
        worker added here and absent from the file is removed by it.

        Raises:
            ConfigError: the fields are invalid.
            ValueError: a worker with that id is already in the pool.
        """
        self._reconfigurer.add_worker(worker if worker is not None else worker_config(**fields))

    def remove_worker(self, worker_id: str, *, drain: bool = True) -> None:
        """Stop sending tasks to a worker and drop it.

        With ``drain`` its in-flight tasks finish normally and its connections close
        once they have; without, its idle connections close now (requests already on
        the wire still finish there).

        Raises:
            KeyError: no worker has that id.
        """
        self._reconfigurer.remove_worker(worker_id, drain=drain)

    def reload(self, config: PoolConfig | None = None) -> ReloadResult:
        """Apply a new configuration, or re-read the pool's YAML file.

        The whole new configuration is validated first; on any error the running one
        is kept. Workers are matched by id: new ones are added, missing ones drain
        and go, changed ones are updated, unchanged ones keep their breaker and
        statistics. Retry, breaker, health and timeout settings apply to tasks that
        start afterwards; ``transport``, ``dead_letter`` and ``pool`` need a new pool.

        Returns:
            What changed.

        Raises:
            ConfigError: the new configuration is invalid (the running one is kept).
            NpuSyncError: no configuration given and the pool has no file.
        """
        if config is not None:
            return self._reconfigurer.reload(config)
        if self._state.config.source is None:
            raise NpuSyncError("this pool was not built from a file: pass reload(config)")
        return self._reconfigurer.reload_file(force=True)

    def check_health(self) -> dict[str, dict[str, Any]]:
        """Check every worker now (one round, in parallel) and apply the results.

        Returns:
            Per worker id, the check's result (``ok``, ``status``, ``latency_ms`` …).
        """
        return {wid: r.to_dict() for wid, r in self._health.check_once().items()}

    def add_hook(self, hook: Hook) -> None:
        """Call ``hook(event)`` for every event from now on (see :mod:`npu_sync.events`).

        Hooks run on the thread where the event happened, never under the pool's
        lock; an exception in a hook is logged and does not affect the task.
        """
        with self._state.lock:
            self._state.hooks = (*self._state.hooks, hook)

    def remove_hook(self, hook: Hook) -> None:
        """Stop calling ``hook``; a hook not registered is ignored."""
        with self._state.lock:
            self._state.hooks = tuple(h for h in self._state.hooks if h is not hook)

    def close(self) -> None:
        """Stop accepting tasks, let accepted ones finish, and release every resource.

        Blocks until submitted and running tasks end (each bounded by its deadline);
        health checks keep running meanwhile, so a waiting task can still see a worker
        recover. Then stops every thread the pool started. Idempotent, and safe from
        any thread; every call made outside the pool's own work returns only once the
        pool is released. Called on a thread doing the pool's own work (from a hook, a
        fallback, or a callback of a future the pool runs), it returns at once and the
        pool finishes closing when its last task ends.
        """
        # Not under the reconfigurer's lock: a reload in progress sees the pool closed
        # when it installs its changes, and hooks never run under that lock anyway.
        with self._state.lock:
            first = not self._state.closed
            self._state.closed = True
            executor = self._executor
            # Such a thread cannot wait: for its own task, nor for a release that stops
            # and joins it (the health, reload and shared-state threads).
            inside = bool(getattr(self._local, "depth", 0))
            if inside:
                self._finish_when_idle = True
            release_now = inside and not self._active
        if first and self._watcher is not None:
            self._watcher.stop()
        if executor is not None:
            # A pool thread cannot wait for itself; its own task ends soon after.
            executor.shutdown(wait=not inside)
        if inside:
            if release_now:  # no task left to finish closing
                self._release()
            return
        with self._state.lock:
            while self._active:
                self._idle.wait()
        self._release()
        self._release_done.wait()  # another thread may be releasing right now

    def _release(self) -> None:
        """Stop the threads and close the connections and the store, once."""
        with self._state.lock:
            if self._released:
                return
            self._released = True
            workers = [*self._state.workers.values(), *self._state.draining.values()]
        try:
            self._health.stop()
            if self._placer is not None:
                self._placer.stop()
            self._monitor.stop()  # before the shared state: it withdraws the snapshot
            # Every task has ended, so every hedge's race is decided: a hedge still on
            # the wire is its task's loser, cancelled, and ends at once. Joined before
            # the transports close, so that it is recorded while the pool still is whole.
            self._state.hedger.stop()
            if self._state.shared is not None:
                self._state.shared.stop()
            for worker in workers:
                worker.transport.close()
                worker.health.transport.close()
            self.dead_letters.close()
        finally:
            self._release_done.set()

    @contextlib.contextmanager
    def _own_work(self) -> Iterator[None]:
        """Mark this thread as doing the pool's work while hooks may run on it."""
        local = self._local
        local.depth = getattr(local, "depth", 0) + 1
        try:
            yield
        finally:
            local.depth -= 1

    def _mark_own_thread(self) -> None:
        """A thread the pool started for its tasks' work (a hedge thread)."""
        _mark_pool_thread(self._local)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<WorkerPool workers={len(self._state.workers)} closed={self._state.closed}>"

    def __del__(self, _warn: Callable[..., None] = warnings.warn) -> None:
        # Like an unclosed file: say so, then stop what can be stopped without waiting.
        # May run on any thread, one of the pool's own included, so nothing here joins.
        try:
            if self._state.closed:
                return
            _warn(f"unclosed {self!r}", ResourceWarning, stacklevel=2, source=self)
        except Exception:
            return
        with contextlib.suppress(Exception):
            self._health.stop_soon()
        with contextlib.suppress(Exception):
            self._state.hedger.stop_soon()
        with contextlib.suppress(Exception):
            if self._executor is not None:
                self._executor.shutdown(wait=False)

    # -- work in progress: what close() waits for --------------------------------------

    def _enter(self) -> None:
        if self._restart_pending:
            self._restart_after_fork()
        state = self._state
        with state.lock:
            if state.closed:
                raise PoolClosed("the pool is closed")
            self._active += 1
            state.stats.submitted += 1

    def _leave(self) -> None:
        state = self._state
        with state.lock:
            self._active -= 1
            if self._active or not state.closed:
                return
            self._idle.notify_all()
            finish = self._finish_when_idle
        if finish:
            self._release()

    def _leave_cb(self, _future: concurrent.futures.Future[Any]) -> None:
        self._leave()

    def _get_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        executor = self._executor
        if executor is None:
            with self._state.lock:
                if self._state.closed:
                    raise PoolClosed("the pool is closed")
                if self._executor is None:
                    self._executor = concurrent.futures.ThreadPoolExecutor(
                        max_workers=self._state.config.pool.threads,
                        thread_name_prefix="npu-sync-task",
                        initializer=_mark_pool_thread,
                        initargs=(self._local,),
                    )
                executor = self._executor
        return executor

    def _execute(
        self,
        task: Task,
        body: bytes,
        deadline: float,
        fallback: Callable[[], Any] | None,
        stop: TaskStop | None = None,
    ) -> Any:
        local = self._local
        local.depth = getattr(local, "depth", 0) + 1
        try:
            return self._runner.run(task, body, deadline, fallback, stop)
        finally:
            local.depth -= 1

    @contextlib.contextmanager
    def _replaying(self) -> Iterator[None]:
        """One dead letter's replay, from its claim to storing its outcome: work that
        close() waits for, so the store is not closed between the task and its record."""
        if self._restart_pending:
            self._restart_after_fork()
        with self._state.lock:
            if self._state.closed:
                raise PoolClosed("the pool is closed")
            self._active += 1  # counted as submitted only if it runs (Runner.replay)
        try:
            with self._own_work():  # the task it runs is the pool's own work
                yield
        finally:
            self._leave()

    # -- the pool's threads: health checks, the file watcher, shared state -------------

    def _new_health_checker(self) -> HealthChecker:
        # The threads hold the pool weakly, so a pool dropped unclosed can be collected
        # (and warn, see __del__) instead of living on with its threads.
        return HealthChecker(
            _weakly(self, WorkerPool._health_targets, []),
            _weakly(self, WorkerPool._apply_health, None),
            _weakly(self, _health_config, HealthConfig()),
            clock=self._state.clock,
            rng=self._rng,
            models=_weakly(self, _refresh_models, False),
            scrubber=_weakly(self, _scrubber, NO_SCRUBBER),
            keep_idle=_weakly(self, _idle_timeout, 0.0),
            housekeeping=(self._reaper.sweep, self._reaper.interval),
        )

    def _health_targets(self) -> list[Worker]:
        with self._state.lock:
            return list(self._state.workers.values())

    def _apply_health(self, results: dict[str, HealthResult] | Any) -> None:
        health = self._state.config.health
        changes: list[tuple[str, bool, str | None]] = []
        refusals: list[tuple[str, str]] = []
        first_checks = False  # a worker a reload added was checked for the first time
        models: list[WorkerModelsChanged] = []
        at = self._state.clock.time()
        with self._state.lock:
            ranks = [w.priority for w in self._state.workers.values()]
            for worker_id, result in results.items():
                worker = self._state.workers.get(worker_id)
                if worker is None or result.generation != worker.generation:
                    continue  # removed, or moved to a new address, while the round ran
                first_checks = first_checks or awaiting_first_check(worker)
                refused = credentials_news(worker, result)
                if refused is not None:
                    refusals.append((worker_id, refused))
                if worker.apply_health(
                    result, health.unhealthy_threshold, health.healthy_threshold
                ):
                    changes.append((worker_id, worker.healthy, result.error))
                    # With its breaker open, the worker returns when a trial closes it.
                    if worker.healthy and worker.breaker.state == CLOSED:
                        now = self._state.clock.monotonic()
                        self._state.recovered_locked(worker, now, "healthy")
                if result.ok:
                    held = worker.held
                    changed = held.apply_models(result)
                    worker.rank()  # npu_available may have changed
                    if changed is not None:
                        listed = None if held.models is None else tuple(sorted(held.models))
                        added, removed = (tuple(sorted(m)) for m in changed)
                        models.append(
                            WorkerModelsChanged(at, worker_id, "health", added, removed, listed)
                        )
                if result.ok and worker.breaker.state == OPEN:
                    # The worker answers again: let a real task try it now rather than
                    # wait out the reset timeout. Only that task's success closes it.
                    worker.breaker.allow_trial()
            if models:
                self._state.models_changed_locked()
            if ranks != [w.priority for w in self._state.workers.values()]:
                # npu_available changed somewhere: the tiers are formed again.
                self._state.dispatcher.set_workers_locked(self._state.workers.values())
            self._state.dispatcher.release_locked(self._state.clock.monotonic())
            if changes or refusals or first_checks:
                # A worker went down, or a new one failed its first check: a task
                # waiting for it learns now that waiting no longer helps (see
                # npu_sync._outage), rather than at its deadline.
                self._state.dispatcher.wake_all_locked()
        with self._own_work():
            for worker_id, refusal in refusals:
                self._state.notify(
                    WorkerCredentialsRefused(self._state.clock.time(), worker_id, refusal, None)
                )
            for worker_id, healthy, error in changes:
                self._state.notify(
                    WorkerHealthChanged(self._state.clock.time(), worker_id, healthy, error)
                )
            for event in models:
                self._state.notify(event)
            if self._state.events:
                self._state.flush_events()
            # New workers that answer now take over from those a reload removed.
            self._reconfigurer.health_checked()

    def check_placement(self) -> list[Load | Unload]:
        """Run one placement round now (``models.balance``; see docs/placement.md) and
        return the loads and unloads it tried.

        Raises:
            RuntimeError: ``models.balance`` was off when the pool was built.
        """
        if self._placer is None:
            raise RuntimeError("placement is off: set models.balance: true")
        return self._placer.check_once()

    def _model_rows(self) -> list[ModelViewDict]:
        """``stats()["models"]["per_model"]``, read without the pool's lock: each
        worker's holdings are swapped whole, and placement's rows take no lock of it."""
        state = self._state
        placer = self._placer
        workers = list(state.workers.values())
        placed = None if placer is None else placer.rows()
        return model_rows(workers, state.config.models, state.clock.monotonic(), placed)

    def _placement_stats(self, per_model: list[ModelViewDict]) -> dict[str, Any]:
        """Placement's counters beside the per-model rows. Under the pool's lock."""
        placer = self._placer
        if placer is None:
            return {
                "balance": False,
                "loads": 0,
                "unloads": 0,
                "evictions": 0,
                "load_failures": 0,
                "load_seconds": 0.0,
                "per_model": per_model,
            }
        counts = placer.counts
        return {
            "balance": True,
            "loads": counts["loads"],
            "unloads": counts["unloads"],
            "evictions": counts["evictions"],
            "load_failures": counts["failures"],
            "load_seconds": placer.load_seconds,
            "per_model": per_model,
        }

    def _check_soon(self) -> None:
        self._health.check_soon()

    def _health_settings_changed(self, old: HealthConfig, new: HealthConfig) -> None:
        """A change was applied: start health checks it turned on, or have the health
        thread read its new settings."""
        if new.enabled and not self._health.running:
            self._health.start()
        elif new != old:
            self._health.wake()

    def _reload_if_changed(self, text: str | None = None) -> None:
        """The watcher's callback: reload when the file's (settled) content changed."""
        # A bad file is logged and counted by reload_file; the running config stays.
        with contextlib.suppress(ConfigError), self._own_work():
            self._reconfigurer.reload_file(force=False, text=text)

    def _announce_open_breakers(self) -> None:
        """After a Redis outage: write the breakers opened here meanwhile."""
        with self._state.lock:
            now = self._state.clock.monotonic()
            opened = [
                (w.id, w.breaker.reset_timeout, w.breaker.open_for(now))
                for w in self._state.workers.values()
                if w.breaker.state == OPEN
            ]
        for worker_id, reset_timeout, age in opened:
            if self._state.shared is not None:
                self._state.shared.announce(worker_id, OPEN, reset_timeout, age)

    def _apply_remote(
        self, worker_id: str, breaker_state: str, age: float, reset_timeout: float | None
    ) -> None:
        """Another process opened or closed a worker's breaker (shared state)."""
        with self._state.lock:
            worker = self._state.workers.get(worker_id)
            if worker is None:
                return
            self._state.applying_remote = True
            try:
                if breaker_state == OPEN:
                    changed = worker.breaker.force_open(age, reset_timeout)
                else:
                    changed = worker.breaker.force_close()
            finally:
                self._state.applying_remote = False
            if changed:
                self._state.dispatcher.wake_all_locked()
                self._state.dispatcher.release_locked(self._state.clock.monotonic())
        if self._state.transitions:
            with self._own_work():
                self._state.flush_transitions()

    # -- a child process after fork() --------------------------------------------------

    def _after_fork(self) -> None:
        """Make this pool usable in a child process, right after ``fork()``.

        Only the forking thread exists in the child: every lock may be held by a
        thread that is gone, tasks in flight and their slots belong to the parent, and
        the connections are the parent's. So the locks, slots and connections start
        afresh, the numbers count the child's own work, and the threads (health,
        reload watcher, shared state) start again on the child's first use.
        """
        self._local = threading.local()
        self._reaper.after_fork()
        self._state.after_fork()
        self._idle = threading.Condition(self._state.lock)
        self._reconfigurer.after_fork()
        self._release_done = threading.Event()
        if self._released:  # the parent's release is the child's: nothing left to close
            self._release_done.set()
        self._active = 0
        self._executor = None
        self._health = self._new_health_checker()
        if self._watcher is not None:
            self._watcher = ConfigWatcher(
                self._watcher.path,
                _weakly(self, WorkerPool._reload_if_changed, None),
                poll_interval=self._watcher.poll_interval,
            )
        if self._state.shared is not None:
            self._state.shared.after_fork()
        self._monitor.after_fork()
        if self._placer is not None:
            self._placer.after_fork()
        self.dead_letters.after_fork()
        self._restart_pending = not self._state.closed

    def _restart_after_fork(self) -> None:
        with self._state.lock:
            if not self._restart_pending or self._state.closed:
                return
            self._restart_pending = False
        if self._state.config.health.enabled:
            self._health.start()
        if self._watcher is not None:
            self._watcher.start()
        if self._state.shared is not None:
            self._state.shared.start()
        self._monitor.start()
        if self._placer is not None:
            self._placer.start()


_live_pools: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


def _reinit_after_fork() -> None:
    for pool in list(_live_pools):
        try:
            pool._after_fork()
        except Exception:  # one broken pool must not break the others in the child
            log.exception("could not prepare %r for the child process", pool)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reinit_after_fork)


def _weakly(pool: WorkerPool, method: Callable[..., Any], dead: Any) -> Callable[..., Any]:
    """``method`` called on ``pool`` through a weak reference; ``dead`` once it is gone."""
    ref = weakref.ref(pool)

    def call(*args: Any) -> Any:
        target = ref()
        return dead if target is None else method(target, *args)

    return call


def _health_config(pool: WorkerPool) -> HealthConfig:
    return pool._state.config.health


def _idle_timeout(pool: WorkerPool) -> float:
    return pool._state.config.transport.idle_timeout


def _scrubber(pool: WorkerPool) -> Scrubber:
    return pool._state.scrubber


def _refresh_models(pool: WorkerPool) -> bool:
    return pool._state.config.models.refresh_on_health


def _mark_pool_thread(local: threading.local) -> None:
    """The executor's initializer: a pool thread's future callbacks are pool work."""
    local.depth = 1


def _shared_state(config: PoolConfig, on_remote: Any) -> Any:
    """The Redis-backed shared state, when configured (redis is imported only then)."""
    if config.shared_state.backend != "redis":
        return None
    from npu_sync._shared import SharedState

    return SharedState(config.shared_state, on_remote)


# -- the process-wide default pool -----------------------------------------------------

_default_lock = threading.Lock()
_default_pool: WorkerPool | None = None


def get_pool() -> WorkerPool:
    """The process-wide default pool, built on first use.

    From ``$NPU_SYNC_CONFIG``, else ``./npu_workers.yaml``; with neither, a single
    worker at ``$NPU_WORKER_URL`` (default ``http://127.0.0.1:8081``) — the
    single-worker compatibility mode, which is logged. Closed at interpreter exit.
    """
    global _default_pool
    with _default_lock:
        if _default_pool is None or _default_pool.closed:
            _default_pool = _build_default(os.environ)
            atexit.register(_default_pool.close)
        return _default_pool


def adopt_default_pool(pool: WorkerPool, source: str) -> bool:
    """Make ``pool`` the process-wide default, unless a live default exists already.

    The Flask extension calls this with the pool it builds from ``NPU_SYNC_CONFIG``, so
    that ``@npu_task()`` and :func:`get_pool` in that process use the pool the app's
    endpoints, status page and metrics show, instead of building a second one. The
    caller keeps closing ``pool``; a closed default is rebuilt on next use.

    Returns:
        Whether ``pool`` is now the default. When another live pool is, a warning says
        so: tasks sent through the default would not show with the app's pool.
    """
    global _default_pool
    with _default_lock:
        current = _default_pool
        if current is None or current.closed or current is pool:
            _default_pool = pool
            return True
    log.warning(
        "this process has two pools: get_pool() and @npu_task() without a pool use the "
        "default pool built before %s was loaded, not the pool built from it; pass the "
        "pool to npu_task() or build the default first",
        source,
    )
    return False


def _build_default(env: Mapping[str, str]) -> WorkerPool:
    path = env.get("NPU_SYNC_CONFIG")
    if path:
        return WorkerPool.from_yaml(path)
    if os.path.exists("npu_workers.yaml"):
        return WorkerPool.from_yaml("npu_workers.yaml")
    config, reason = fallback_config(env)
    log.warning("%s", reason)
    pool = WorkerPool(config)
    pool._fallback_reason = reason
    return pool


def fallback_config(env: Mapping[str, str]) -> tuple[PoolConfig, str]:
    """The single-worker configuration used when no configuration file is found.

    Returns:
        The configuration (one worker at ``$NPU_WORKER_URL``, default
        ``http://127.0.0.1:8081``) and the reason, as ``stats()["fallback"]`` gives it.
    """
    url = env.get("NPU_WORKER_URL", "http://127.0.0.1:8081")
    source = "$NPU_WORKER_URL" if "NPU_WORKER_URL" in env else "the default"
    reason = (
        "no configuration found ($NPU_SYNC_CONFIG unset, no ./npu_workers.yaml): "
        f"a single worker at {url} ({source})"
    )
    return config_for_url(url), reason


def _tracing(
    config: PoolConfig,
) -> Callable[[Callable[[Any], str | None]], Callable[[Task], TaskWatch]]:
    """What builds the pool's OpenTelemetry observer (``tracing.opentelemetry``): the
    package is imported here, by a pool that asks for it, never by ``import npu_sync``.

    Raises:
        ConfigError: ``opentelemetry-api`` is not installed.
    """
    try:
        from npu_sync._otel import TracingObserver
    except ImportError as exc:
        key = config.key_path("tracing.opentelemetry")
        raise ConfigError(
            f"{key}: true needs the opentelemetry-api package ({exc}); {install_hint('otel')}"
        ) from None
    return TracingObserver
