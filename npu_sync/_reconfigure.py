"""Changing a running pool's configuration: ``reload()``, ``add_worker``, ``remove_worker``.

A new configuration is matched to the running one by worker id
(:meth:`Reconfigurer.apply`): new workers are added, missing ones drain and go, changed
ones are updated in place, unchanged ones keep their breaker and statistics. Health,
breaker, retry and timeout settings apply to tasks that start afterwards; ``transport``,
``dead_letter``, ``pool`` and ``shared_state`` need a new pool. Re-reading the pool's
file (:meth:`Reconfigurer.reload_file`) adds a file's own rules: unchanged content is
skipped, the same broken content counted once, and no reload may empty the pool by
accident (:func:`npu_sync.config.check_reload`). A reload that replaces workers hands
tasks over make before break (:class:`npu_sync._handover.Handover`): the removed
workers keep serving until the added ones pass a health check.

One change at a time, under this module's own lock. The pool's lock is held only to
swap the new workers and settings in, never while connections are built or closed;
hooks run once both locks are released. The file watcher itself is ``reload.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from npu_sync._guard import ReloadGuard
from npu_sync._handover import Handover
from npu_sync._redact import Scrubber
from npu_sync._retry import RetryPolicy
from npu_sync._schema import hot_merge
from npu_sync._state import PoolState
from npu_sync._worker import Worker
from npu_sync.config import (
    HealthConfig,
    PoolConfig,
    WorkerConfig,
    check_reload,
    parse_yaml,
    read_config_text,
)
from npu_sync.errors import ConfigError, PoolClosed
from npu_sync.events import (
    ConfigReloaded,
    ConfigReloadFailed,
    Event,
    HandoverDone,
    HandoverOverdue,
    HandoverStarted,
    WorkerSlowStart,
)
from npu_sync.transport import Transport

log = logging.getLogger(__name__)

_COMPARED = frozenset({"workers", "source"})
"""Fields a reload compares itself (workers one by one) or always takes (the file)."""

_ADDRESS_FIELDS = ("url", "tls", "headers")
"""A worker whose address changes gets new connections and a fresh breaker."""


@dataclasses.dataclass(frozen=True)
class ReloadResult:
    """What a reload changed, by worker id.

    ``restart_required`` names the pool sections holding keys that differ in the new
    configuration but are not hot (declared ``hot=False``): they take effect on a new
    pool, and the running values are kept. ``settings_changed`` says a hot pool-level
    key changed. ``retiring`` names the ``removed`` workers that keep
    taking tasks until the added ones pass a health check (make before break).
    """

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    updated: tuple[str, ...] = ()
    unchanged: tuple[str, ...] = ()
    settings_changed: bool = False
    restart_required: tuple[str, ...] = ()
    retiring: tuple[str, ...] = ()

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
            "retiring": list(self.retiring),
        }


@dataclasses.dataclass
class _Built:
    """What a change needs built before it takes the pool's lock."""

    workers: dict[str, Worker]  # added
    # Added again while their old selves still drain at the same address: taken back
    # rather than replaced, if still draining once the pool's lock is taken (the
    # worker built for the id then serves only as its spare connections).
    revived: dict[str, Worker]
    rewired: dict[str, tuple[Transport, Transport]]  # moved to a new address
    resized: dict[str, Transport]  # a new max_concurrent: a task transport of that size

    def close(self) -> None:
        """Close everything built: the change will not be installed."""
        for worker in self.workers.values():
            worker.transport.close()
            worker.health.transport.close()
        for pair in self.rewired.values():
            for transport in pair:
                transport.close()
        for transport in self.resized.values():
            transport.close()


class Reconfigurer:
    """Applies new configurations to one pool. Thread-safe: one change at a time.

    Args:
        state: the pool's running state.
        on_health: called with the old and the new health settings after every
            applied change, without the pool's lock: the pool starts health checks
            that were turned on, or wakes its health thread to read new settings.
        guard: the pool's own reload rules; the file's ``reload:`` keys win over them.
        check_soon: asks for a health round now (new workers to wait for).
    """

    def __init__(
        self,
        state: PoolState,
        *,
        on_health: Callable[[HealthConfig, HealthConfig], None],
        guard: ReloadGuard | None = None,
        check_soon: Callable[[], None] = lambda: None,
    ) -> None:
        self._state = state
        self._on_health = on_health
        self._guard = guard or ReloadGuard()
        self._check_soon = check_soon
        # Removed workers still serving until the ones replacing them answer.
        self._handover: Handover | None = None
        self._lock = threading.Lock()
        self._source_digest: str | None = None
        self._rejected_digest: str | None = None
        # The workers the file named when last applied: a reload is refused for
        # removing most of those, not for dropping workers added in code since.
        self._file_workers = frozenset(w.id for w in state.config.workers)
        self._counts: dict[str, Any] = {
            "ok": 0,
            "failed": 0,
            "last_error": None,
            "last_at": None,
            "last_change": None,
        }

    def loaded(self, text: str) -> None:
        """The pool was built from a file with this content: reloading it is a no-op."""
        self._source_digest = _digest(text)

    def counts(self) -> dict[str, Any]:
        """Reloads applied and failed, and the last error and change (``stats()``)."""
        return dict(self._counts)

    def after_fork(self) -> None:
        """In a child process: a lock no thread of the parent may hold."""
        self._lock = threading.Lock()

    @property
    def guard(self) -> ReloadGuard:
        return self._guard

    def handover(self) -> dict[str, Any] | None:
        """The handover under way (``stats()["reloads"]["handover"]``), or None."""
        h = self._handover
        if h is None:
            return None
        return {
            "retiring": sorted(h.retiring),
            "awaited": sorted(h.awaited),
            "joined": sorted(h.joined),
            "seconds": max(0.0, self._state.clock.monotonic() - h.started),
            "overdue": h.overdue_told,
        }

    def reload(self, config: PoolConfig) -> ReloadResult:
        """Make the pool match ``config``, counted and announced as a reload."""
        with self._lock:
            result, events = self._replace(config)
            self._count(result)
        # Hooks run after the lock is released: one may reload or add a worker.
        self._announce(result, events)
        return result

    def add_worker(self, cfg: WorkerConfig) -> None:
        """Add one worker (see ``WorkerPool.add_worker``)."""
        with self._lock:
            config = self._state.config
            if cfg.id in self._state.workers:
                raise ValueError(f"worker {cfg.id!r} is already in the pool")
            keep = self._handover.retiring if self._handover is not None else frozenset()
            self.apply(dataclasses.replace(config, workers=(*config.workers, cfg)), keep=keep)

    def remove_worker(self, worker_id: str, *, drain: bool) -> None:
        """Remove one worker (see ``WorkerPool.remove_worker``)."""
        with self._lock:
            config = self._state.config
            if worker_id not in self._state.workers:
                raise KeyError(f"no worker {worker_id!r} in the pool")
            workers = tuple(w for w in config.workers if w.id != worker_id)
            h = self._handover
            keep = h.retiring - {worker_id} if h is not None else frozenset()
            self.apply(dataclasses.replace(config, workers=workers), drain=drain, keep=keep)
            if h is not None:
                self._handover = h.without(worker_id)
                if self._handover is None:
                    self._retire(keep)  # nothing left to wait for

    def reload_file(self, *, force: bool, text: str | None = None) -> ReloadResult:
        """Re-read the pool's file (or take its ``text``) and apply it if it changed.

        Args:
            force: apply even if the content is the one last applied or rejected.
            text: the file's content, already read by the watcher.

        Raises:
            ConfigError: the file is invalid, or would empty the pool; counted in
                ``stats()`` and announced, and the running configuration is kept.
        """
        source = self._state.config.source
        assert source is not None
        clock = self._state.clock
        failure: ConfigError | None = None
        with self._lock:
            if self._state.closed:
                return ReloadResult()
            digest = None
            try:
                text = read_config_text(source) if text is None else text
                digest = _digest(text)
                if not force and digest in (self._source_digest, self._rejected_digest):
                    # Unchanged, or the same broken content already counted and logged.
                    return ReloadResult()
                new = parse_yaml(text, source=source)
                config = self._state.config
                from_file = tuple(w for w in config.workers if w.id in self._file_workers)
                # No emptying the pool by accident.
                check_reload(dataclasses.replace(config, workers=from_file), new, self._guard)
                result, events = self._replace(new)
            except ConfigError as exc:
                self._rejected_digest = digest
                self._counts["failed"] += 1
                self._counts["last_error"] = str(exc)
                self._counts["last_at"] = clock.time()
                failure = exc
            else:
                self._source_digest = digest
                for warning in new.warnings:  # keys of the file that have no effect
                    log.warning("%s", warning)
                self._file_workers = frozenset(w.id for w in new.workers)
                # Should the file go back to that broken content, it is a new failure.
                self._rejected_digest = None
                self._count(result)
        # Hooks run after the lock is released: one may reload or add a worker.
        if failure is not None:
            self._state.notify(ConfigReloadFailed(clock.time(), source, str(failure)))
            raise failure
        self._announce(result, events)
        return result

    def _replace(self, new: PoolConfig) -> tuple[ReloadResult, list[Event]]:
        """Apply ``new`` as a reload: workers it replaces hand over make before break.
        Call with ``_lock`` held. Returns the result and the events to announce."""
        state = self._state
        with state.lock:
            current = set(state.workers)
        before = self._handover
        wanted = {w.id: w for w in new.workers}
        kept = before.retiring if before is not None else frozenset()
        h = None
        if new.health.enabled:
            h = Handover.after_reload(
                before,
                removed=[wid for wid in current if wid not in wanted and wid not in kept],
                added=[wid for wid in wanted if wid not in current and wanted[wid].enabled],
                wanted=wanted,
                now=state.clock.monotonic(),
                bound=self._guard.under(new.reload).handover_timeout,
            )
        keep = h.retiring if h is not None else frozenset()
        result = self.apply(new, keep=keep, unproven=h.awaited if h is not None else frozenset())
        self._handover = h
        events: list[Event] = []
        at = state.clock.time()
        if before is not None and (h is None or not h.retiring >= before.retiring):
            gone = before.retiring - keep - set(wanted)
            if gone:
                events.append(HandoverDone(at, tuple(sorted(gone)), (), ()))
        if h is not None and (before is None or h.awaited - before.awaited):
            events.append(HandoverStarted(at, tuple(sorted(h.retiring)), tuple(sorted(h.awaited))))
            self._check_soon()
        return dataclasses.replace(result, retiring=tuple(sorted(keep))), events

    def health_checked(self) -> None:
        """A health round was applied: hand over if the new workers answer now.

        Called on the health thread (or by ``check_health()``), without the pool's lock.
        """
        state = self._state
        event: Event | None = None
        with self._lock:
            h = self._handover
            if h is None or state.closed:
                return
            with state.lock:
                passed = [
                    wid
                    for wid in h.awaited
                    if (worker := state.workers.get(wid)) is not None and worker.healthy
                ]
            h = h.passed(passed)
            now = state.clock.monotonic()
            verdict = h.verdict(now)
            if verdict == "done":
                self._retire(h.retiring)
                self._handover = None
                event = HandoverDone(
                    state.clock.time(),
                    tuple(sorted(h.retiring)),
                    tuple(sorted(h.joined)),
                    tuple(sorted(h.awaited)),
                )
            else:
                if verdict == "overdue" and not h.overdue_told:
                    h = dataclasses.replace(h, overdue_told=True)
                    event = HandoverOverdue(
                        state.clock.time(),
                        tuple(sorted(h.retiring)),
                        tuple(sorted(h.awaited)),
                        now - h.started,
                    )
                self._handover = h
        if event is not None:
            state.notify(event)

    def _retire(self, worker_ids: frozenset[str]) -> None:
        """Take the retiring workers out: they drain. Call with ``_lock`` held."""
        state = self._state
        to_close: list[Transport] = []
        with state.lock:
            for wid in worker_ids:
                if wid in state.workers:
                    _remove_locked(state, wid, drain=True, to_close=to_close)
            state.dispatcher.set_workers_locked(state.workers.values())
            state.models_checked_locked()
            worker_ids_left = list(state.workers)
        if state.shared is not None:
            state.shared.set_workers(worker_ids_left)
        for transport in to_close:
            transport.close()

    def _count(self, result: ReloadResult) -> None:
        """Record a reload that was applied. Call with ``_lock`` held."""
        self._counts["ok"] += 1
        self._counts["last_error"] = None
        self._counts["last_at"] = self._state.clock.time()
        self._counts["last_change"] = result.to_dict()

    def _announce(self, result: ReloadResult, events: Sequence[Event] = ()) -> None:
        state = self._state
        state.notify(ConfigReloaded(state.clock.time(), state.config.source, result.to_dict()))
        for event in events:
            state.notify(event)
        for section in result.restart_required:
            log.warning("configuration section %r changed; it takes effect on restart", section)

    def apply(
        self,
        new: PoolConfig,
        *,
        drain: bool = True,
        keep: frozenset[str] = frozenset(),
        unproven: frozenset[str] = frozenset(),
    ) -> ReloadResult:
        """Make the running pool match ``new``. Call with ``_lock`` held.

        Args:
            drain: removed workers finish their tasks in flight before their
                connections close; without, idle connections close at once.
            keep: removed workers that keep taking tasks for now (retiring).
            unproven: added workers that take no task until a health check passes.

        Raises:
            PoolClosed: the pool is closed, or closed while the change was built.
        """
        state = self._state
        old = state.config
        if state.closed:
            raise PoolClosed("the pool is closed")
        # Each key's ``hot`` declaration decides: a key that is not hot keeps its running
        # value (named as needing a restart), a hot one applies to the tasks after this.
        merge = hot_merge(old, new, skip=_COMPARED)
        restart = tuple(dict.fromkeys(path.split(".", 1)[0] for path in merge.cold))
        # A configuration built in code keeps the pool's file, and its watcher.
        new = dataclasses.replace(merge.config, source=new.source or old.source)
        wanted = {w.id: w for w in new.workers}
        with state.lock:
            current = dict(state.workers)
        added = [wid for wid in wanted if wid not in current]
        removed = [wid for wid in current if wid not in wanted]
        leaving = [wid for wid in removed if wid not in keep]
        updated = [wid for wid in wanted if wid in current and current[wid].config != wanted[wid]]
        unchanged = [wid for wid in wanted if wid in current and wid not in updated]
        built = self._build(current, wanted, added, updated)
        scrubber = state.new_scrubber(new, state.scrubber)
        for wid in unproven:
            if wid in built.workers:
                built.workers[wid].await_first_check()  # takes tasks once a check passes
        with state.lock:
            closed_meanwhile = state.closed
        if closed_meanwhile:
            built.close()
            raise PoolClosed("the pool is closed")
        to_close, worker_ids = self._install(
            new, built, wanted, leaving, updated, drain=drain, scrubber=scrubber
        )
        if state.events:
            state.flush_events()
        if state.shared is not None:
            state.shared.set_workers(worker_ids)
        for transport in to_close:
            transport.close()
        self._on_health(old.health, new.health)
        settings_changed = bool(merge.hot)
        return ReloadResult(
            tuple(added),
            tuple(removed),
            tuple(updated),
            tuple(unchanged),
            settings_changed,
            restart,
        )

    def _build(
        self,
        current: dict[str, Worker],
        wanted: dict[str, WorkerConfig],
        added: list[str],
        updated: list[str],
    ) -> _Built:
        """The workers and connections a change needs, built before taking the pool's
        lock (no I/O happens, but nothing that could block belongs under it)."""
        state = self._state
        moved = [
            wid
            for wid in updated
            if any(
                getattr(current[wid].config, f) != getattr(wanted[wid], f) for f in _ADDRESS_FIELDS
            )
        ]
        with state.lock:
            draining = {wid: state.draining.get(wid) for wid in added}
        return _Built(
            workers={wid: state.build_worker(wanted[wid]) for wid in added},
            revived={
                wid: worker
                for wid, worker in draining.items()
                if worker is not None and _same_address(worker.config, wanted[wid])
            },
            rewired={wid: state.build_transports(wanted[wid]) for wid in moved},
            resized={
                wid: state.transport_factory(
                    wanted[wid], state.config.transport, maxsize=wanted[wid].max_concurrent
                )
                for wid in updated
                if wid not in moved
                and current[wid].config.max_concurrent != wanted[wid].max_concurrent
            },
        )

    def _install(
        self,
        new: PoolConfig,
        built: _Built,
        wanted: dict[str, WorkerConfig],
        removed: list[str],
        updated: list[str],
        *,
        drain: bool,
        scrubber: Scrubber,
    ) -> tuple[list[Transport], list[str]]:
        """Swap the change in under the pool's lock. Returns the transports it replaced,
        to be closed once the lock is released, and the ids of the pool's workers."""
        state = self._state
        old = state.config
        to_close: list[Transport] = []
        with state.lock:
            revived = _revive_locked(state, built, wanted, to_close)
            state.workers.update(built.workers)
            state.workers.update(revived)
            for wid in removed:
                _remove_locked(state, wid, drain=drain, to_close=to_close)
            for wid in updated:
                worker = state.workers[wid]
                worker.configure(wanted[wid])
                if wid in built.rewired:
                    to_close += [worker.transport, worker.health.transport]
                    worker.moved(*built.rewired[wid])
                    state.recovered_locked(worker, state.clock.monotonic(), "moved")
                elif wid in built.resized:
                    # More (or fewer) connections: swap the task transport; requests in
                    # flight finish on the old one, which is closed after.
                    to_close.append(worker.transport)
                    worker.transport = built.resized[wid]
            if new.circuit_breaker != old.circuit_breaker:
                for worker in state.workers.values():
                    worker.breaker.configure(new.circuit_breaker)
            state.config = new
            state.scrubber = scrubber
            if new.retry != old.retry:
                state.retry = RetryPolicy(new.retry)
            state.dispatcher.set_workers_locked(state.workers.values())
            # A moved worker, or one of another protocol now, forgot its models.
            state.models_checked_locked()
            state.configure_balancing_locked(old.balancing, new.balancing)
            state.dispatcher.set_classes_locked(new.priority)
            now = state.clock.monotonic()
            for worker in built.workers.values():
                until = state.dispatcher.selector.slow_start_until(worker, now)
                if until is not None:  # a new worker ramps in (slow start)
                    state.events.append(_ramp_event(worker.id, until - now))
            return to_close, list(state.workers)


def _same_address(old: WorkerConfig, new: WorkerConfig) -> bool:
    return all(getattr(old, f) == getattr(new, f) for f in _ADDRESS_FIELDS)


def _revive_locked(
    state: PoolState, built: _Built, wanted: dict[str, WorkerConfig], to_close: list[Transport]
) -> dict[str, Worker]:
    """Take back the draining workers a change adds again at the same address: the
    tasks still in flight on them count against their capacity, and their breaker,
    counts and what was learnt of them carry on. Call with the pool's lock held.
    Returns them by id; the workers built for their ids give the connections they
    need (a health check's, closed when they left; a task transport of a new size) and
    are dropped, their other connections added to ``to_close``."""
    revived: dict[str, Worker] = {}
    for wid, worker in built.revived.items():
        if state.draining.get(wid) is not worker:
            continue  # drained meanwhile, its connections closed: the new one goes in
        spare = built.workers.pop(wid)
        del state.draining[wid]
        worker.draining = False
        worker.removed = False
        cfg = wanted[wid]
        if worker.config.max_concurrent != cfg.max_concurrent:
            # Requests in flight finish on the old transport, closed after.
            to_close.append(worker.transport)
            worker.transport = spare.transport
        else:
            to_close.append(spare.transport)
        worker.health.transport = spare.health.transport
        if worker.config != cfg:
            worker.configure(cfg)
        revived[wid] = worker
    return revived


def _remove_locked(state: PoolState, wid: str, *, drain: bool, to_close: list[Transport]) -> None:
    """Take one worker out of the pool: no new task; its tasks in flight finish (with
    ``drain``). Call with the pool's lock held; the transports to close are added to
    ``to_close``, for after the lock is released."""
    worker = state.workers.pop(wid)
    worker.draining = True
    worker.removed = True
    if not drain or not worker.in_flight:
        to_close += [worker.transport, worker.health.transport]
    else:
        to_close.append(worker.health.transport)
        # Still shown by workers() and stats() until its tasks finish.
        state.draining[wid] = worker


def _ramp_event(worker_id: str, window: float) -> Callable[[float], WorkerSlowStart]:
    """A new worker's slow start, announced once the pool's lock is released."""
    return lambda at: WorkerSlowStart(at, worker_id, window, "added")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
