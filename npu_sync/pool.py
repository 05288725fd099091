"""WorkerPool: composes selection, admission, breakers, retries and dead letters.

The life of one task (see docs/architecture.md): acquire a worker lease (waiting FIFO
for capacity up to the task's deadline), POST outside any lock, classify the answer,
record it under the lock (which also hands the freed slot to the next waiter), then
return, raise ``TaskRejected``, or back off and try a worker not yet tried. When no
attempt is left, the dead-letter record is stored *before* ``TaskFailed`` is raised.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any, Literal, NoReturn, cast, overload

from npu_sync.admission import Dispatcher, Lease, Refusal
from npu_sync.breaker import CLOSED, OPEN, WorkerBreaker
from npu_sync.clock import SYSTEM_CLOCK, Clock
from npu_sync.config import (
    HealthConfig,
    PoolConfig,
    WorkerConfig,
    check_reload,
    config_for_url,
    parse_yaml,
    read_config_text,
    worker_config,
)
from npu_sync.deadletter import DeadLetter, DeadLetterQueue, DeadLetterStore, open_store
from npu_sync.errors import (
    ConfigError,
    InvalidTask,
    NoWorkerAvailable,
    NpuSyncError,
    PoolClosed,
    TaskFailed,
    TaskRejected,
)
from npu_sync.events import (
    AttemptFinished,
    BreakerStateChanged,
    ConfigReloaded,
    ConfigReloadFailed,
    Event,
    Hook,
    RetryScheduled,
    TaskDeadLettered,
    TaskFallback,
    TaskRejectedEvent,
    TaskStarted,
    TaskSucceeded,
    WorkerHealthChanged,
    emit,
    log_event,
)
from npu_sync.fleet import Monitor
from npu_sync.health import HealthChecker, HealthResult
from npu_sync.metrics import PoolStats, WorkerStats
from npu_sync.reload import ConfigWatcher
from npu_sync.retry import Kind, Outcome, RetryPolicy, classify_error, classify_response
from npu_sync.selector import Selector
from npu_sync.stats_types import (
    FleetStatsDict,
    PoolStatsDict,
    ReloadStats,
    SharedStateStats,
    WorkerRow,
)
from npu_sync.task import Attempt, Task, as_task
from npu_sync.transport import Transport, TransportError, make_transport
from npu_sync.worker import Worker, render

log = logging.getLogger(__name__)

TransportFactory = Callable[..., Transport]
"""Builds one worker's transport: ``factory(worker_config, transport_config, maxsize=n)``."""


@dataclasses.dataclass(frozen=True)
class ReloadResult:
    """What a reload changed, by worker id.

    ``restart_required`` names pool sections that differ in the new configuration
    but only take effect on a new pool (``transport``, ``dead_letter``, ``pool``);
    the running values are kept.
    """

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    updated: tuple[str, ...] = ()
    unchanged: tuple[str, ...] = ()
    settings_changed: bool = False
    restart_required: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed or self.updated or self.settings_changed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "added": list(self.added),
            "removed": list(self.removed),
            "updated": list(self.updated),
            "unchanged": list(self.unchanged),
            "settings_changed": self.settings_changed,
            "restart_required": list(self.restart_required),
        }


_NOT_HOT = ("transport", "dead_letter", "pool", "shared_state")
"""Sections a reload cannot change in a running pool."""

_ADDRESS_FIELDS = ("url", "tls", "headers")
"""A worker whose address changes gets new connections and a fresh breaker."""


class _Exhausted(Exception):
    """No attempt is left for a task; carries why and what was tried."""

    def __init__(self, reason: str, attempts: list[Attempt], first_at: float) -> None:
        super().__init__(reason)
        self.reason = reason
        self.attempts = attempts
        self.first_at = first_at


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
    ) -> None:
        self._config = config
        self._result_check = result_check
        self._hooks: tuple[Hook, ...] = tuple(hooks)
        self._clock = clock
        self._transport_factory = transport_factory
        self._retry = RetryPolicy(config.retry)
        self._dispatcher = Dispatcher(
            clock,
            Selector(rng=rng, shared_breakers=config.shared_state.backend == "redis"),
        )
        self._lock = self._dispatcher.lock
        self._idle = threading.Condition(self._lock)
        self._stats = PoolStats()
        self._workers: dict[str, Worker] = {}
        self._draining: dict[str, Worker] = {}  # removed, with tasks still in flight
        self._active = 0
        self._closed = False
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
        # Breaker transitions happen under the lock; they are logged after it.
        self._events: list[tuple[str, str, str, bool]] = []
        self._applying_remote = False
        self._shared = _shared_state(config, _weakly(self, WorkerPool._apply_remote, None))
        # History and fleet snapshot; sampled from the start when there is other
        # background work (health checks, shared state), else from the first look.
        self._monitor = Monitor(self, self._shared, clock=clock, eager=config.health.enabled)
        self._source_digest: str | None = None
        # The workers the file named when last applied: a reload is refused for
        # removing most of those, not for dropping workers added in code since.
        self._file_workers = frozenset(w.id for w in config.workers)
        self._rejected_digest: str | None = None
        self._reload_lock = threading.Lock()
        self._reloads: dict[str, Any] = {
            "ok": 0,
            "failed": 0,
            "last_error": None,
            "last_at": None,
            "last_change": None,
        }
        self._watcher: ConfigWatcher | None = None
        # Why the pool runs on a stand-in configuration, if it does (see get_pool).
        self._fallback_reason: str | None = None
        if dead_letter_store is not None:
            store: DeadLetterStore = dead_letter_store
        elif config.dead_letter.backend == "redis" and self._shared is not None:
            store = self._shared.dead_letter_store(
                config.dead_letter.max_records, spool_path=config.dead_letter.spool_path
            )
        else:
            store = open_store(config.dead_letter)
        self.dead_letters = DeadLetterQueue(
            store,
            self._replay,
            clock=clock,
            run_time=self._replay_budget,
            hold=self._replaying,
        )
        for worker_cfg in config.workers:
            self._workers[worker_cfg.id] = self._build_worker(worker_cfg)
        self._dispatcher.set_workers(self._workers.values())
        self._health = self._new_health_checker()
        if config.health.enabled:
            self._health.start()
        if self._shared is not None:
            self._shared.set_workers(self._workers)
            self._shared.on_resume = _weakly(self, WorkerPool._announce_open_breakers, None)
            self._shared.start()
        self._monitor.start()
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
        pool._source_digest = _digest(text)
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
    ) -> Any:
        """Run one task and return the worker's decoded JSON body.

        Args:
            task: a :class:`Task` or a JSON-serialisable payload for the default endpoint.
            timeout: the task's whole deadline in seconds (every attempt and wait);
                default the task's own, else ``timeouts.task``.
            fallback: run locally, and its result returned, when the task fails on
                every worker; no dead letter is stored if it succeeds.

        Raises:
            TaskRejected: the task is bad (a 4xx, or no worker serves its model).
            TaskFailed: no attempt succeeded; the dead-letter record is stored first.
            InvalidTask: the task cannot be sent (not JSON, bad options).
            PoolClosed: the pool is closed.
        """
        task = as_task(task)
        body = task.body()
        deadline = self._deadline(task, timeout)
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
    ) -> concurrent.futures.Future[Any]:
        """Run a task on the pool's own threads; the future ends as :meth:`execute` would.

        The task's deadline starts now: time spent queued for a pool thread counts.
        """
        task = as_task(task)
        body = task.body()
        deadline = self._deadline(task, timeout)
        self._enter()
        try:
            future = self._get_executor().submit(self._execute, task, body, deadline, fallback)
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
        started then are cancelled (never sent), as ``Executor.map`` does.
        """
        limit = window or 2 * self._config.pool.threads
        if limit < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        source = iter(tasks)
        pending: deque[concurrent.futures.Future[Any]] = deque()
        self._refill(source, pending, timeout, limit)
        return self._map_results(source, pending, timeout, limit)

    def _refill(
        self,
        source: Iterator[Task | Any],
        pending: deque[concurrent.futures.Future[Any]],
        timeout: float | None,
        limit: int,
    ) -> None:
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
    ) -> Iterator[Any]:
        try:
            while pending:
                result = pending.popleft().result()
                yield result
                self._refill(source, pending, timeout, limit)
        finally:
            for future in pending:
                future.cancel()

    # -- inspecting --------------------------------------------------------------------

    @property
    def config(self) -> PoolConfig:
        """The configuration in force."""
        return self._config

    @property
    def closed(self) -> bool:
        return self._closed

    @overload
    def stats(self, scope: Literal["local"] = "local") -> PoolStatsDict: ...

    @overload
    def stats(self, scope: Literal["fleet"]) -> FleetStatsDict: ...

    def stats(self, scope: str = "local") -> PoolStatsDict | FleetStatsDict:
        """Pool-wide counters and gauges, JSON-serialisable (see docs/metrics.md).

        ``scope="fleet"``: every process's pool, through the shared state (see
        :mod:`npu_sync.fleet`), with this process's stats under ``local``.
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
        shared = {"backend": "none"} if self._shared is None else self._shared.stats()
        with self._lock:
            now = self._clock.monotonic()
            workers = list(self._workers.values())
            s = self._stats
            sel50, sel99 = self._dispatcher.selection_time.percentiles(50, 99)
            return {
                "uptime_s": now - self._started,
                "closed": self._closed,
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
                    "retries": s.retries,
                    "active": self._active,
                    "in_flight": sum(w.in_flight for w in workers)
                    + sum(w.in_flight for w in self._draining.values()),
                    "waiting": self._dispatcher.waiting,
                },
                "dead_letters": {
                    "stored_total": s.dead_lettered,
                    "pending": stored,
                    "dropped": dropped,
                },
                "reloads": cast(ReloadStats, dict(self._reloads)),
                "shared_state": cast(SharedStateStats, shared),
                "health": {
                    "enabled": self._config.health.enabled,
                    "running": self._health.running,
                    "rounds": self._health.rounds,
                },
                "selection_us": {
                    "p50": None if sel50 is None else sel50 * 1e6,
                    "p99": None if sel99 is None else sel99 * 1e6,
                },
            }

    def workers(self) -> list[WorkerRow]:
        """One JSON-serialisable dict per worker, in priority order."""
        with self._lock:
            now = self._clock.monotonic()
            # A draining worker re-added under its id shows once: the live row.
            draining = [w for w in self._draining.values() if w.id not in self._workers]
            ordered = sorted([*self._workers.values(), *draining], key=lambda w: (w.priority, w.id))
            captured = [w.capture() for w in ordered]
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
        cfg = worker if worker is not None else worker_config(**fields)
        with self._reload_lock:
            if cfg.id in self._workers:
                raise ValueError(f"worker {cfg.id!r} is already in the pool")
            workers = (*self._config.workers, cfg)
            self._apply_config(dataclasses.replace(self._config, workers=workers))

    def remove_worker(self, worker_id: str, *, drain: bool = True) -> None:
        """Stop sending tasks to a worker and drop it.

        With ``drain`` its in-flight tasks finish normally and its connections close
        once they have; without, its idle connections close now (requests already on
        the wire still finish there).

        Raises:
            KeyError: no worker has that id.
        """
        with self._reload_lock:
            if worker_id not in self._workers:
                raise KeyError(f"no worker {worker_id!r} in the pool")
            workers = tuple(w for w in self._config.workers if w.id != worker_id)
            self._apply_config(dataclasses.replace(self._config, workers=workers), drain=drain)

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
            with self._reload_lock:
                result = self._apply_config(config)
                self._count_reload(result)
            # Hooks run after the lock is released: one may reload or add a worker.
            self._announce_reload(result)
            return result
        if self._config.source is None:
            raise NpuSyncError("this pool was not built from a file: pass reload(config)")
        return self._reload_file(force=True)

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
        with self._lock:
            self._hooks = (*self._hooks, hook)

    def remove_hook(self, hook: Hook) -> None:
        """Stop calling ``hook``; a hook not registered is ignored."""
        with self._lock:
            self._hooks = tuple(h for h in self._hooks if h is not hook)

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
        # Not under _reload_lock: a reload in progress sees _closed when it installs
        # its changes, and hooks never run under that lock anyway.
        with self._lock:
            first = not self._closed
            self._closed = True
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
        with self._lock:
            while self._active:
                self._idle.wait()
        self._release()
        self._release_done.wait()  # another thread may be releasing right now

    def _release(self) -> None:
        """Stop the threads and close the connections and the store, once."""
        with self._lock:
            if self._released:
                return
            self._released = True
            workers = [*self._workers.values(), *self._draining.values()]
        try:
            self._health.stop()
            self._monitor.stop()  # before the shared state: it withdraws the snapshot
            if self._shared is not None:
                self._shared.stop()
            for worker in workers:
                worker.transport.close()
                worker.health_transport.close()
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

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<WorkerPool workers={len(self._workers)} closed={self._closed}>"

    def __del__(self, _warn: Callable[..., None] = warnings.warn) -> None:
        # Like an unclosed file: say so, then stop what can be stopped without waiting.
        # May run on any thread, one of the pool's own included, so nothing here joins.
        try:
            if self._closed:
                return
            _warn(f"unclosed {self!r}", ResourceWarning, stacklevel=2, source=self)
        except Exception:
            return
        with contextlib.suppress(Exception):
            self._health.stop_soon()
        with contextlib.suppress(Exception):
            if self._executor is not None:
                self._executor.shutdown(wait=False)

    # -- internals ---------------------------------------------------------------------

    def _new_health_checker(self) -> HealthChecker:
        # The threads hold the pool weakly, so a pool dropped unclosed can be collected
        # (and warn, see __del__) instead of living on with its threads.
        return HealthChecker(
            _weakly(self, WorkerPool._health_targets, []),
            _weakly(self, WorkerPool._apply_health, None),
            _weakly(self, _health_config, HealthConfig()),
            clock=self._clock,
            rng=self._rng,
        )

    def _after_fork(self) -> None:
        """Make this pool usable in a child process, right after ``fork()``.

        Only the forking thread exists in the child: every lock may be held by a
        thread that is gone, tasks in flight and their slots belong to the parent, and
        the connections are the parent's. So the locks, slots and connections start
        afresh, the numbers count the child's own work, and the threads (health,
        reload watcher, shared state) start again on the child's first use.
        """
        self._local = threading.local()
        self._dispatcher = Dispatcher(self._clock, self._dispatcher.selector)
        self._lock = self._dispatcher.lock
        self._idle = threading.Condition(self._lock)
        self._reload_lock = threading.Lock()
        self._release_done = threading.Event()
        if self._released:  # the parent's release is the child's: nothing left to close
            self._release_done.set()
        self._active = 0
        self._executor = None
        self._events = []
        self._stats = PoolStats()
        self._draining.clear()  # their tasks run in the parent
        for worker in self._workers.values():
            worker.in_flight = 0
            worker.reporting = 0
            worker.breaker.release(True)  # a trial in flight is the parent's
            worker.stats = WorkerStats()
            worker.transport, worker.health_transport = self._build_transports(worker.config)
        self._dispatcher.set_workers(self._workers.values())
        self._health = self._new_health_checker()
        if self._watcher is not None:
            self._watcher = ConfigWatcher(
                self._watcher.path,
                _weakly(self, WorkerPool._reload_if_changed, None),
                poll_interval=self._watcher.poll_interval,
            )
        if self._shared is not None:
            self._shared.after_fork()
        self._monitor.after_fork()
        self.dead_letters.after_fork()
        self._restart_pending = not self._closed

    def _restart_after_fork(self) -> None:
        with self._lock:
            if not self._restart_pending or self._closed:
                return
            self._restart_pending = False
        if self._config.health.enabled:
            self._health.start()
        if self._watcher is not None:
            self._watcher.start()
        if self._shared is not None:
            self._shared.start()
        self._monitor.start()

    def _build_worker(self, cfg: WorkerConfig) -> Worker:
        transport, health_transport = self._build_transports(cfg)
        breaker = WorkerBreaker(
            cfg.id, self._config.circuit_breaker, clock=self._clock, listener=self._on_transition
        )
        return Worker(cfg, transport, breaker, health_transport)

    def _build_transports(self, cfg: WorkerConfig) -> tuple[Transport, Transport]:
        # Health checks get a connection of their own, so a check never waits behind
        # tasks for a pooled connection, nor tasks behind a hung check.
        settings = self._config.transport
        return (
            self._transport_factory(cfg, settings, maxsize=cfg.max_concurrent),
            self._transport_factory(cfg, settings, maxsize=1),
        )

    # -- health and reload internals ---------------------------------------------------

    def _health_targets(self) -> list[Worker]:
        with self._lock:
            return list(self._workers.values())

    def _apply_health(self, results: dict[str, HealthResult] | Any) -> None:
        health = self._config.health
        changes: list[tuple[str, bool, str | None]] = []
        with self._lock:
            for worker_id, result in results.items():
                worker = self._workers.get(worker_id)
                if worker is None or result.generation != worker.generation:
                    continue  # removed, or moved to a new address, while the round ran
                if worker.apply_health(
                    result, health.unhealthy_threshold, health.healthy_threshold
                ):
                    changes.append((worker_id, worker.healthy, result.error))
                if result.ok and worker.breaker.state == OPEN:
                    # The worker answers again: let a real task try it now rather than
                    # wait out the reset timeout. Only that task's success closes it.
                    worker.breaker.allow_trial()
            self._dispatcher.release_locked(self._clock.monotonic())
        with self._own_work():
            for worker_id, healthy, error in changes:
                self._notify(WorkerHealthChanged(self._clock.time(), worker_id, healthy, error))

    def _reload_if_changed(self, text: str | None = None) -> None:
        """The watcher's callback: reload when the file's (settled) content changed."""
        # A bad file is logged and counted by _reload_file; the running config stays.
        with contextlib.suppress(ConfigError), self._own_work():
            self._reload_file(force=False, text=text)

    def _reload_file(self, *, force: bool, text: str | None = None) -> ReloadResult:
        source = self._config.source
        assert source is not None
        failure: ConfigError | None = None
        with self._reload_lock:
            if self._closed:
                return ReloadResult()
            digest = None
            try:
                text = read_config_text(source) if text is None else text
                digest = _digest(text)
                if not force and digest in (self._source_digest, self._rejected_digest):
                    # Unchanged, or the same broken content already counted and logged.
                    return ReloadResult()
                new = parse_yaml(text, source=source)
                named = self._file_workers
                from_file = tuple(w for w in self._config.workers if w.id in named)
                # No emptying the pool by accident.
                check_reload(dataclasses.replace(self._config, workers=from_file), new)
                result = self._apply_config(new)
            except ConfigError as exc:
                self._rejected_digest = digest
                self._reloads["failed"] += 1
                self._reloads["last_error"] = str(exc)
                self._reloads["last_at"] = self._clock.time()
                failure = exc
            else:
                self._source_digest = digest
                self._file_workers = frozenset(w.id for w in new.workers)
                # Should the file go back to that broken content, it is a new failure.
                self._rejected_digest = None
                self._count_reload(result)
        # Hooks run after the lock is released: one may reload or add a worker.
        if failure is not None:
            self._notify(ConfigReloadFailed(self._clock.time(), source, str(failure)))
            raise failure
        self._announce_reload(result)
        return result

    def _count_reload(self, result: ReloadResult) -> None:
        """Record a reload that was applied. Call with ``_reload_lock`` held."""
        self._reloads["ok"] += 1
        self._reloads["last_error"] = None
        self._reloads["last_at"] = self._clock.time()
        self._reloads["last_change"] = result.to_dict()

    def _announce_reload(self, result: ReloadResult) -> None:
        self._notify(ConfigReloaded(self._clock.time(), self._config.source, result.to_dict()))
        for section in result.restart_required:
            log.warning("configuration section %r changed; it takes effect on restart", section)

    def _apply_config(self, new: PoolConfig, *, drain: bool = True) -> ReloadResult:
        """Make the running pool match ``new``. Call with ``_reload_lock`` held."""
        old = self._config
        if self._closed:
            raise PoolClosed("the pool is closed")
        restart = tuple(name for name in _NOT_HOT if getattr(new, name) != getattr(old, name))
        new = dataclasses.replace(
            new,
            transport=old.transport,
            dead_letter=old.dead_letter,
            pool=old.pool,
            shared_state=old.shared_state,
            # A configuration built in code keeps the pool's file, and its watcher.
            source=new.source or old.source,
        )
        wanted = {w.id: w for w in new.workers}
        with self._lock:
            current = dict(self._workers)
        added = [wid for wid in wanted if wid not in current]
        removed = [wid for wid in current if wid not in wanted]
        updated = [wid for wid in wanted if wid in current and current[wid].config != wanted[wid]]
        unchanged = [wid for wid in wanted if wid in current and wid not in updated]
        # Connections are built before taking the lock (no I/O happens, but nothing
        # that could block belongs under it).
        built = {wid: self._build_worker(wanted[wid]) for wid in added}
        rewired = {
            wid: self._build_transports(wanted[wid])
            for wid in updated
            if any(
                getattr(current[wid].config, f) != getattr(wanted[wid], f) for f in _ADDRESS_FIELDS
            )
        }
        resized = {
            wid: self._transport_factory(
                wanted[wid], self._config.transport, maxsize=wanted[wid].max_concurrent
            )
            for wid in updated
            if wid not in rewired
            and current[wid].config.max_concurrent != wanted[wid].max_concurrent
        }
        to_close: list[Transport] = []
        settings_changed = any(
            getattr(new, name) != getattr(old, name)
            for name in ("health", "circuit_breaker", "retry", "timeouts")
        )
        with self._lock:
            closed_meanwhile = self._closed
        if closed_meanwhile:
            for worker in built.values():
                worker.transport.close()
                worker.health_transport.close()
            for pair in rewired.values():
                for transport in pair:
                    transport.close()
            for transport in resized.values():
                transport.close()
            raise PoolClosed("the pool is closed")
        with self._lock:
            for wid, worker in built.items():
                self._workers[wid] = worker
            for wid in removed:
                worker = self._workers.pop(wid)
                worker.draining = True
                worker.removed = True
                if not drain or not worker.in_flight:
                    to_close += [worker.transport, worker.health_transport]
                else:
                    to_close.append(worker.health_transport)
                    # Still shown by workers() and stats() until its tasks finish.
                    self._draining[wid] = worker
            for wid in updated:
                worker = self._workers[wid]
                worker.configure(wanted[wid])
                if wid in rewired:
                    to_close += [worker.transport, worker.health_transport]
                    worker.moved(*rewired[wid])
                elif wid in resized:
                    # More (or fewer) connections: swap the task transport; requests in
                    # flight finish on the old one, which is closed after.
                    to_close.append(worker.transport)
                    worker.transport = resized[wid]
            if new.circuit_breaker != old.circuit_breaker:
                for worker in self._workers.values():
                    worker.breaker.configure(new.circuit_breaker)
            self._config = new
            if new.retry != old.retry:
                self._retry = RetryPolicy(new.retry)
            self._dispatcher.set_workers_locked(self._workers.values())
            worker_ids = list(self._workers)
        if self._shared is not None:
            self._shared.set_workers(worker_ids)
        for transport in to_close:
            transport.close()
        if new.health.enabled and not self._health.running:
            self._health.start()
        elif new.health != old.health:
            self._health.wake()
        return ReloadResult(
            tuple(added),
            tuple(removed),
            tuple(updated),
            tuple(unchanged),
            settings_changed,
            restart,
        )

    def _enter(self) -> None:
        if self._restart_pending:
            self._restart_after_fork()
        with self._lock:
            if self._closed:
                raise PoolClosed("the pool is closed")
            self._active += 1
            self._stats.submitted += 1

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active or not self._closed:
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
            with self._lock:
                if self._closed:
                    raise PoolClosed("the pool is closed")
                if self._executor is None:
                    self._executor = concurrent.futures.ThreadPoolExecutor(
                        max_workers=self._config.pool.threads,
                        thread_name_prefix="npu-sync-task",
                        initializer=_mark_pool_thread,
                        initargs=(self._local,),
                    )
                executor = self._executor
        return executor

    def _deadline(self, task: Task, timeout: float | None) -> float:
        _check_timeout(timeout)
        budget = timeout or task.timeout or self._config.timeouts.task
        return self._clock.monotonic() + budget

    def _execute(
        self, task: Task, body: bytes, deadline: float, fallback: Callable[[], Any] | None
    ) -> Any:
        local = self._local
        local.depth = getattr(local, "depth", 0) + 1
        try:
            return self._run_task(task, body, deadline, fallback)
        finally:
            local.depth -= 1

    def _run_task(
        self, task: Task, body: bytes, deadline: float, fallback: Callable[[], Any] | None
    ) -> Any:
        if self._hooks:
            endpoint = task.endpoint or self._config.pool.default_endpoint
            emit(self._hooks, TaskStarted(self._clock.time(), task.task_id, endpoint))
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
            with self._lock:
                self._stats.fallbacks += 1
            self._notify(TaskFallback(self._clock.time(), task.task_id, exhausted.reason))
            return result

    @contextlib.contextmanager
    def _replaying(self) -> Iterator[None]:
        """One dead letter's replay, from its claim to storing its outcome: work that
        close() waits for, so the store is not closed between the task and its record."""
        if self._restart_pending:
            self._restart_after_fork()
        with self._lock:
            if self._closed:
                raise PoolClosed("the pool is closed")
            self._active += 1  # counted as submitted only if it runs (in _replay)
        try:
            yield
        finally:
            self._leave()

    def _replay_budget(self, record: DeadLetter) -> float:
        """The longest a replay of ``record`` may run: its task's deadline."""
        return record.timeout or self._config.timeouts.task

    def _replay(self, task: Task) -> Any:
        """Run a dead-lettered task again without dead-lettering it a second time.
        Called inside :meth:`_replaying`."""
        body = task.body()
        deadline = self._deadline(task, None)
        with self._lock:
            self._stats.submitted += 1
        local = self._local
        local.depth = getattr(local, "depth", 0) + 1
        try:
            return self._attempts(task, body, deadline)
        except _Exhausted as exhausted:
            raise TaskFailed(
                f"task {task.task_id} failed again: {exhausted.reason}",
                task_id=task.task_id,
                dead_letter_id="",
                attempts=exhausted.attempts,
            ) from None
        finally:
            local.depth -= 1

    def _dead_letter(
        self,
        task: Task,
        exhausted: _Exhausted,
        deadline: float,
        cause: BaseException | None = None,
    ) -> NoReturn:
        now = self._clock.time()
        record = DeadLetter.from_task(
            task,
            endpoint=task.endpoint or self._config.pool.default_endpoint,
            error=exhausted.reason,
            attempts=exhausted.attempts,
            now=now,
            first_attempt_at=exhausted.first_at,
        )
        error = NoWorkerAvailable if not exhausted.attempts else TaskFailed
        try:
            # Durable before the caller hears of the failure; a busy store may not hold
            # the caller much past the task's deadline.
            self.dead_letters.add(record, timeout=deadline - self._clock.monotonic())
        except Exception as exc:
            # The one case where the record cannot be kept: say so loudly, with the
            # whole record in the log so that nothing is lost without a trace.
            with self._lock:
                self._stats.failed += 1
            self._notify(
                TaskDeadLettered(
                    self._clock.time(),
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
        with self._lock:
            self._stats.failed += 1
            self._stats.dead_lettered += 1
        self._notify(
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
        config = self._config
        policy = self._retry
        clock = self._clock
        path = task.endpoint or config.pool.default_endpoint
        timeouts = config.timeouts
        connect_timeout = timeouts.connect
        read_timeout = timeouts.read
        queue_wait = config.pool.max_queue_wait
        check = self._result_check
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
        acquire = self._dispatcher.acquire_or_reason
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
                if self._events:
                    self._flush_events()
                worker = lease.worker
                t0 = clock.monotonic()
                remaining = deadline - t0
                if remaining <= _MIN_ATTEMPT:
                    recorded = True
                    self._record(lease, _UNUSED, 0.0, t0, retry=False)
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
                    self._record(lease, _UNUSED, 0.0, clock.monotonic(), retry=False)
                    raise
                except Exception as exc:  # a bug of ours, or of a custom transport
                    log.exception("unexpected error sending task to worker %s", worker.id)
                    outcome = Outcome(Kind.ABANDONED, error=f"{type(exc).__name__}: {exc}")
                t1 = clock.monotonic()
                suspect = False
                if outcome.suspect:
                    suspect, charged_suspect = charged_suspect, True
                recorded = True
                self._record(lease, outcome, t1 - t0, t1, retry=failures > 0, defer=suspect)
            finally:
                if not recorded:
                    self._record(lease, _UNUSED, 0.0, clock.monotonic(), retry=False)
            kind = outcome.kind
            hooks = self._hooks
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
                self._notify(
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
            self._notify(
                RetryScheduled(
                    t1 + wall, task.task_id, worker.id, len(attempts), wait, outcome.error
                )
            )
            clock.sleep(wait)
        if missing_model is not None and not failures and reason == _EVERY_WORKER_TRIED:
            with self._lock:
                self._stats.rejected += 1
            self._notify(
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
        limit = f"pool.max_queue_wait ({self._config.pool.max_queue_wait:g}s)"
        if refusal is Refusal.DEADLINE_PASSED:
            return f"no worker could take the task within {limit}"
        return str(refusal.value).replace("before the deadline", f"within {limit}")

    def _untried_left(self, excluded: Collection[str], by: float = math.inf) -> bool:
        """Whether a worker outside ``excluded`` could take a task before ``by``.

        A worker whose breaker stays open, or whose Retry-After cool-down lasts, past
        ``by`` cannot. Costs a scan of the workers: called on the failure path only.
        """
        with self._lock:
            for w in self._workers.values():
                if w.id in excluded or not w.enabled or w.draining:
                    continue
                retry_at = w.breaker.retry_at()
                if (retry_at is None or retry_at < by) and w.cooldown_until < by:
                    return True
            return False

    def _record(
        self,
        lease: Lease,
        outcome: Outcome,
        duration: float,
        now: float,
        *,
        retry: bool,
        defer: bool = False,
    ) -> None:
        worker = lease.worker
        trial = lease.trial
        kind = outcome.kind
        close_transport = False
        reported = False
        with self._lock:
            worker.in_flight -= 1
            stats = worker.stats
            if lease.generation != worker.generation and outcome is not _UNUSED:
                # An attempt on the worker's old address: it says nothing about the new
                # one (nor about its breaker), so only the slot is given back, and a
                # result still counts as the task's success.
                if kind is Kind.SUCCESS:
                    self._stats.succeeded += 1
                kind = Kind.NOT_HERE
                outcome = _STALE
            if outcome is _STALE:
                pass
            elif kind is Kind.SUCCESS:
                stats.attempts += 1
                worker.breaker.record_success(trial)
                stats.succeeded += 1
                stats.observe(now, duration, True)
                self._stats.succeeded += 1
            elif kind is Kind.FAILURE:
                stats.attempts += 1
                if self._shared is not None and not defer:
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
                stats.last_error_at = self._clock.time()
                stats.observe(now, duration, False)
                if outcome.retry_after:
                    cap = self._config.circuit_breaker.max_reset_timeout
                    worker.cooldown_until = now + min(outcome.retry_after, cap)
                # A trip or a cool-down changes when a waiter should wake.
                self._dispatcher.wake_all_locked()
            elif outcome is _UNUSED:
                worker.breaker.release(trial)
            else:
                stats.attempts += 1
                worker.breaker.release(trial)
                if kind is Kind.REJECTED:
                    stats.rejected += 1
                    self._stats.rejected += 1
                elif kind is Kind.ABANDONED:
                    stats.abandoned += 1
                else:
                    stats.not_here += 1
            if retry:
                self._stats.retries += 1
            self._dispatcher.release_worker_locked(worker, now)
            if worker.removed and not worker.in_flight:
                close_transport = True
                if self._draining.get(worker.id) is worker:
                    del self._draining[worker.id]
        shared = self._shared
        if shared is not None:
            # Redis I/O, outside the lock, and only on the failure path (or the first
            # success after failures).
            if reported:
                trip = False
                try:
                    trip = shared.report_failure(worker.id, self._config.circuit_breaker.fail_max)
                finally:
                    with self._lock:
                        worker.reporting -= 1
                        if trip and worker.breaker.force_open():
                            self._dispatcher.wake_all_locked()
                        self._dispatcher.release_worker_locked(worker, self._clock.monotonic())
            elif kind is Kind.SUCCESS:
                shared.report_success(worker.id)
        if self._events:
            self._flush_events()
        if close_transport:
            worker.transport.close()

    def _announce_open_breakers(self) -> None:
        """After a Redis outage: write the breakers opened here meanwhile."""
        with self._lock:
            now = self._clock.monotonic()
            opened = [
                (w.id, w.breaker.reset_timeout, w.breaker.open_for(now))
                for w in self._workers.values()
                if w.breaker.state == OPEN
            ]
        for worker_id, reset_timeout, age in opened:
            if self._shared is not None:
                self._shared.announce(worker_id, OPEN, reset_timeout, age)

    def _apply_remote(
        self, worker_id: str, state: str, age: float, reset_timeout: float | None
    ) -> None:
        """Another process opened or closed a worker's breaker (shared state)."""
        with self._lock:
            worker = self._workers.get(worker_id)
            if worker is None:
                return
            self._applying_remote = True
            try:
                if state == OPEN:
                    changed = worker.breaker.force_open(age, reset_timeout)
                else:
                    changed = worker.breaker.force_close()
            finally:
                self._applying_remote = False
            if changed:
                self._dispatcher.wake_all_locked()
                self._dispatcher.release_locked(self._clock.monotonic())
        if self._events:
            with self._own_work():
                self._flush_events()

    def _charge(self, workers: list[Worker]) -> None:
        """Count deferred failures against workers that failed where another succeeded."""
        with self._lock:
            for worker in workers:
                worker.breaker.record_failure(False)
            self._dispatcher.wake_all_locked()
        if self._events:
            self._flush_events()

    def _on_transition(self, name: str, old: str, new: str) -> None:
        # Called by pybreaker under the pool's lock: queue, log after releasing it.
        self._events.append((name, old, new, self._applying_remote))

    def _flush_events(self) -> None:
        with self._lock:
            events, self._events = self._events, []
            timeouts = {w.id: w.breaker.reset_timeout for w in self._workers.values()}
        now = self._clock.time()
        for name, old, new, remote in events:
            self._notify(BreakerStateChanged(now, name, old, new))
            if self._shared is not None and not remote and new in (OPEN, CLOSED):
                self._shared.announce(name, new, timeouts.get(name))

    def _notify(self, event: Event) -> None:
        """Log a notable event and pass it to the hooks."""
        log_event(event)
        hooks = self._hooks
        if hooks:
            emit(hooks, event)


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
    return pool._config.health


def _mark_pool_thread(local: threading.local) -> None:
    """The executor's initializer: a pool thread's future callbacks are pool work."""
    local.depth = 1


def _shared_state(config: PoolConfig, on_remote: Any) -> Any:
    """The Redis-backed shared state, when configured (redis is imported only then)."""
    if config.shared_state.backend != "redis":
        return None
    from npu_sync.shared import SharedState

    return SharedState(config.shared_state, on_remote)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


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


# -- the process-wide default pool -------------------------------------------------------

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
