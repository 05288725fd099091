"""Prometheus metrics for a pool (the ``prometheus`` extra: ``pip install -e '.[prometheus]'``).

Counters count from the pool's start-up: an exporter starts from the totals the pool
has kept since it was built, then follows its events with a hook, so a task pays a
dictionary update. The retry-budget and hedging counters, which have no event for each
refusal or skip, follow the pool's totals instead whenever they are read (at a scrape,
and in multiprocess mode every fleet-monitor sample), which the pool keeps for its
whole life, across reloads. Gauges are read from ``pool.stats()`` and
``pool.workers()`` when Prometheus scrapes. This is the only module that imports
``prometheus_client``, and ``import npu_sync`` does not import it.

Every pool exported on one registry under one namespace shares a single registered
collector: each metric family appears once, with one series per pool, told apart by the
``const_labels`` each exporter was given (see docs/prometheus.md).

Under gunicorn (several processes behind one port) ``prometheus_client``'s multiprocess
mode is used whenever it is on (``PROMETHEUS_MULTIPROC_DIR`` set before the process
starts): counters and the histogram are then written to that directory as they move,
gauges every fleet-monitor interval and before each scrape, and :func:`metrics_text`
serves the sum of every process, dead ones' counters included, so a counter never goes
back whichever process answers the scrape.
"""

from __future__ import annotations

import bisect
import glob
import itertools
import logging
import math
import os
import re
import struct
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol, cast

from npu_sync.errors import install_hint

try:
    from prometheus_client import (
        CONTENT_TYPE_LATEST,
        REGISTRY,
        CollectorRegistry,
        Counter,
        Gauge,
        Histogram,
        generate_latest,
        values,
    )
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )
    from prometheus_client.metrics_core import Metric
    from prometheus_client.multiprocess import MultiProcessCollector
    from prometheus_client.utils import floatToGoString
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        f"npu_sync.prometheus needs prometheus_client: {install_hint('prometheus')}"
    ) from exc

from npu_sync._fleet import monitor_of
from npu_sync.events import (
    AttemptFinished,
    BreakerStateChanged,
    ConfigReloaded,
    ConfigReloadFailed,
    Event,
    Hook,
    ModelPlacement,
    RetryScheduled,
    TaskCancelled,
    TaskDeadLettered,
    TaskFallback,
    TaskRejectedEvent,
    TaskSucceeded,
)

__all__ = [
    "DEFAULT_BUCKETS",
    "ExportablePool",
    "PrometheusExporter",
    "exporter_for",
    "instrument",
    "metrics_text",
    "multiprocess_mode",
]

log = logging.getLogger(__name__)

DEFAULT_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
"""Attempt-duration bucket bounds in seconds: a fast model's milliseconds to a long
generation's minute (``+Inf`` is added)."""

ATTEMPT_OUTCOMES = ("succeeded", "rejected", "not_here", "failed", "misconfigured", "abandoned")
TASK_OUTCOMES = ("succeeded", "rejected", "failed", "fallback", "cancelled")
RELOAD_RESULTS = ("ok", "failed")
PLACEMENT_ACTIONS = ("load", "unload", "evict", "failed")
BREAKER_STATES = ("closed", "open", "half-open")
HEDGE_RESULTS = ("won", "lost")
BALANCING_TOTALS = ("refused", "won", "lost", "skipped")
# The events say "success" and "failure"; every metric says succeeded and failed.
# A misconfigured worker's attempt (not an NPU worker at that URL) counts as failed.
_EVENT_OUTCOMES = {"success": "succeeded", "failure": "failed", "misconfigured": "failed"}
_OWN_LABELS = frozenset({"worker", "outcome", "result", "state", "le", "quantile", "pid"})
_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def multiprocess_mode() -> bool:
    """Whether ``prometheus_client`` runs in multiprocess mode in this process.

    It decides when it is first imported, from ``PROMETHEUS_MULTIPROC_DIR``.
    """
    return bool(getattr(values.ValueClass, "_multiprocess", False))


class ExportablePool(Protocol):
    """What the exporter needs of a pool; :class:`npu_sync.WorkerPool` provides it."""

    def add_hook(self, hook: Hook) -> None: ...

    def remove_hook(self, hook: Hook) -> None: ...

    def stats(self) -> Mapping[str, Any]: ...

    def workers(self) -> Sequence[Mapping[str, Any]]: ...

    @property
    def closed(self) -> bool: ...


@dataclass(slots=True)
class _Histogram:
    counts: list[int]  # per bucket, not cumulative; the last one is +Inf
    total: float = 0.0


@dataclass(slots=True)
class _Counts:
    attempts: dict[tuple[str, str], int] = field(default_factory=dict)
    tasks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TASK_OUTCOMES, 0))
    retries: int = 0
    trips: dict[str, int] = field(default_factory=dict)
    reloads: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RELOAD_RESULTS, 0))
    placements: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PLACEMENT_ACTIONS, 0))
    load_seconds: float = 0.0
    durations: dict[str, _Histogram] = field(default_factory=dict)
    # The balancing counters, followed from the pool's totals (no event per refusal or
    # skip): what was counted, and the totals last read.
    balancing: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BALANCING_TOTALS, 0))
    seen: dict[str, int] = field(default_factory=dict)


class PrometheusExporter:
    """Exports one pool's metrics to a prometheus_client registry. Thread-safe.

    Counters start from the totals the pool has kept since it was built, so they count
    from the pool's start-up whenever the exporter is attached; the attempt-duration
    histogram counts from the moment it is attached (the pool keeps no durations).
    Two pools on one registry need distinct ``const_labels`` (for example
    ``{"pool": "chat"}``), or a registry each. The exporter of a pool that has been
    closed is closed when another exporter joins the same registry.

    In ``prometheus_client``'s multiprocess mode the metrics go to
    ``PROMETHEUS_MULTIPROC_DIR`` instead of a registry; :func:`metrics_text` serves them.

    Args:
        pool: the pool to export (a :class:`npu_sync.WorkerPool`).
        registry: where to register; default ``prometheus_client.REGISTRY``. Not in
            multiprocess mode.
        namespace: prefix of every metric name.
        buckets: upper bounds, in seconds, of the attempt-duration histogram.
        const_labels: labels added to every series of this pool.

    Raises:
        ValueError: an invalid namespace, bucket list or label; this pool is already
            exported on the registry; another pool there has the same ``const_labels``;
            the registry already has other metrics by these names; or a registry was
            given in multiprocess mode.
    """

    def __init__(
        self,
        pool: ExportablePool,
        registry: CollectorRegistry | None = None,
        *,
        namespace: str = "npu_sync",
        buckets: Sequence[float] = DEFAULT_BUCKETS,
        const_labels: Mapping[str, str] | None = None,
    ) -> None:
        if not _METRIC_NAME.match(namespace):
            raise ValueError(f"namespace must be a valid metric name prefix, got {namespace!r}")
        self._multiprocess = multiprocess_mode()
        if self._multiprocess and registry is not None:
            raise ValueError(
                "prometheus_client runs in multiprocess mode: the metrics are written to "
                "PROMETHEUS_MULTIPROC_DIR, not to a registry (metrics_text() serves them)"
            )
        if not self._multiprocess and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            log.warning(
                "PROMETHEUS_MULTIPROC_DIR is set but prometheus_client was imported before "
                "it was, so each process reports only itself: set it in the environment "
                "the server starts with (see docs/prometheus.md)"
            )
        self._pool = pool
        self._registry = registry if registry is not None else _default_registry()
        self._namespace = namespace
        self._bounds = _check_buckets(buckets)
        # The client's own spelling of bounds ("1.0", "+Inf"), as its Histogram writes them.
        self._le = [*(floatToGoString(b) for b in self._bounds), "+Inf"]  # type: ignore[no-untyped-call]
        self._labels = _check_labels(const_labels or {})
        self._const = tuple(self._labels.values())
        self._lock = threading.Lock()
        self._counts = _Counts()
        self._closed = False
        # Workers whose multiprocess gauges were set, with the share they take at most.
        self._gauged: dict[str, float] = {}
        self._following = False  # a thread is reading the totals the counters follow
        # remove_hook matches by identity, and each attribute access makes a new bound method.
        self._hook: Hook = self._on_event
        self._refresh_hook = self._refresh_from_monitor
        self._collector = _join(self)
        self._files = self._collector.files
        if self._files is not None and self._files.bounds != self._bounds:
            _leave(self)
            raise ValueError(
                f"buckets {list(self._bounds)} differ from those of the pools already exported "
                f"in this process ({list(self._files.bounds)}): in multiprocess mode one "
                "namespace has one set of buckets"
            )
        try:
            # The totals so far, then the events from now on. An event between the two (a
            # task ending while a busy pool is being instrumented) is missed rather than
            # counted twice; attached at start-up, as the Flask extension does, none is.
            self._seed()
            pool.add_hook(self._hook)
        except BaseException:
            _leave(self)
            raise
        monitor = monitor_of(pool)
        if self._files is not None and monitor is not None:
            monitor.add_listener(self._refresh_hook)
        _live_exporters.add(self)

    @property
    def pool(self) -> ExportablePool:
        """The pool being exported."""
        return self._pool

    @property
    def registry(self) -> CollectorRegistry:
        """The registry the metrics are registered on (in multiprocess mode a private
        one that only keeps the exporters of this process apart)."""
        return self._registry

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def const_labels(self) -> dict[str, str]:
        return dict(self._labels)

    @property
    def multiprocess(self) -> bool:
        """Whether the metrics go to ``PROMETHEUS_MULTIPROC_DIR``."""
        return self._multiprocess

    def close(self) -> None:
        """Stop counting and drop this pool's series from the registry. Idempotent.

        The registry's collector is unregistered with the last pool using it. In
        multiprocess mode the counters written stay (a counter never goes back).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.remove_hook(self._hook)
        monitor = monitor_of(self._pool)
        if monitor is not None:
            monitor.remove_listener(self._refresh_hook)
        _leave(self)

    def __enter__(self) -> PrometheusExporter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- start-up: the pool's totals so far ---------------------------------------------

    def _seed(self) -> None:
        try:
            workers = self._pool.workers()
            stats = self._pool.stats()
        except Exception:
            log.exception("could not read the pool's totals for Prometheus; counting from now")
            return
        c = self._counts
        with self._lock:
            for w in workers:
                wid = str(w["id"])
                counts = w.get("tasks") or {}
                for outcome in ATTEMPT_OUTCOMES:
                    n = int(counts.get(outcome) or 0)
                    c.attempts[(wid, outcome)] = c.attempts.get((wid, outcome), 0) + n
                trips = int((w.get("breaker") or {}).get("trips") or 0)
                c.trips[wid] = c.trips.get(wid, 0) + trips
            tasks = stats.get("tasks") or {}
            for outcome, key in zip(
                TASK_OUTCOMES,
                ("succeeded", "rejected", "failed", "fallbacks", "cancelled"),
                strict=True,
            ):
                c.tasks[outcome] += int(tasks.get(key) or 0)
            c.retries += int(tasks.get("retries") or 0)
            reloads = stats.get("reloads") or {}
            for result in RELOAD_RESULTS:
                c.reloads[result] += int(reloads.get(result) or 0)
            seeded = _Counts(
                attempts=dict(c.attempts),
                tasks=dict(c.tasks),
                retries=c.retries,
                trips=dict(c.trips),
                reloads=dict(c.reloads),
            )
        files = self._files
        if files is not None:
            const = self._const
            for (wid, outcome), n in seeded.attempts.items():
                files.add("attempts", (*const, wid, outcome), n)
            for outcome, n in seeded.tasks.items():
                files.add("tasks", (*const, outcome), n)
            files.add("retries", const, seeded.retries)
            for wid, n in seeded.trips.items():
                files.add("trips", (*const, wid), n)
            for result, n in seeded.reloads.items():
                files.add("reloads", (*const, result), n)
            for w in workers:
                files.declare_worker(const, str(w["id"]))
        self._follow(stats)

    # -- the hook: runs on task threads, so it only bumps numbers under a short lock ---

    def _on_event(self, event: Event) -> None:
        c = self._counts
        files = self._files
        if isinstance(event, AttemptFinished):
            index = bisect.bisect_left(self._bounds, event.duration)
            outcome = _EVENT_OUTCOMES.get(event.outcome, event.outcome)
            pair = (event.worker_id, outcome)
            with self._lock:
                c.attempts[pair] = c.attempts.get(pair, 0) + 1
                hist = c.durations.get(event.worker_id)
                if hist is None:
                    hist = c.durations[event.worker_id] = _Histogram([0] * (len(self._bounds) + 1))
                hist.counts[index] += 1
                hist.total += event.duration
            if files is not None:
                files.add("attempts", (*self._const, event.worker_id, outcome), 1)
                files.observe((*self._const, event.worker_id), event.duration)
            return
        if isinstance(event, TaskSucceeded):
            family, key = "tasks", "succeeded"
        elif isinstance(event, TaskRejectedEvent):
            family, key = "tasks", "rejected"
        elif isinstance(event, TaskDeadLettered):
            family, key = "tasks", "failed"
        elif isinstance(event, TaskFallback):
            family, key = "tasks", "fallback"
        elif isinstance(event, TaskCancelled):
            family, key = "tasks", "cancelled"
        elif isinstance(event, RetryScheduled):
            with self._lock:
                c.retries += 1
            if files is not None:
                files.add("retries", self._const, 1)
            return
        elif isinstance(event, BreakerStateChanged) and event.new == "open":
            family, key = "trips", event.worker_id
        elif isinstance(event, ModelPlacement):
            family, key = "placements", event.action
            if event.action == "load":
                with self._lock:
                    c.load_seconds += event.seconds
                if files is not None:
                    files.add("load_seconds", self._const, event.seconds)
        elif isinstance(event, ConfigReloaded):
            family, key = "reloads", "ok"
        elif isinstance(event, ConfigReloadFailed):
            family, key = "reloads", "failed"
        else:
            return
        counter: dict[str, int] = getattr(c, family)
        with self._lock:
            counter[key] = counter.get(key, 0) + 1
        if files is not None:
            files.add(family, (*self._const, key), 1)

    # -- gauges -------------------------------------------------------------------------

    def refresh(self) -> None:
        """Multiprocess mode: write this process's gauges, and the counters that follow
        the pool's totals, now (before a scrape)."""
        if self._files is None or self._closed:
            return
        try:
            workers, stats = self._read(workers=True)
        except Exception:
            log.exception("could not read the pool's state for Prometheus")
            return
        self._write_gauges(stats, workers)

    def _refresh_from_monitor(self, stats: Mapping[str, Any], workers: Sequence[Any]) -> None:
        if self._closed:
            return
        self._write_gauges(stats, workers)
        try:
            # The monitor read its stats before this thread could claim the totals:
            # they are read again (see _read).
            self._read(workers=False)
        except Exception:
            log.exception("could not read the pool's state for Prometheus")

    # -- the balancing counters: followed from the pool's totals ------------------------

    def _read(self, *, workers: bool) -> tuple[Sequence[Mapping[str, Any]], Mapping[str, Any]]:
        """``workers()`` (if asked) and ``stats()``, the balancing counters brought up to
        the totals in the stats. Raises what the pool raises.

        One thread at a time follows the totals, from a read made after it claimed
        them: two reads applied out of order would look like a reset (a lower total)
        and be counted twice. A thread that finds the claim taken only reads.
        """
        with self._lock:
            claimed = not self._following
            self._following = True
        try:
            rows = self._pool.workers() if workers else []
            stats = self._pool.stats()
            if claimed:
                self._follow(stats)
        finally:
            if claimed:
                with self._lock:
                    self._following = False
        return rows, stats

    def _follow(self, stats: Mapping[str, Any]) -> None:
        """Count what the pool's retry budget and hedging totals moved since last read."""
        balancing = stats.get("balancing")
        if balancing is None:  # an older pool, or one standing in for it
            return
        budget, hedge = balancing["retry_budget"], balancing["hedge"]
        hedged, won = int(hedge["hedged"]), int(hedge["won"])
        totals = {
            "refused": int(budget["refused"]),
            "won": won,
            "lost": hedged - won,
            "skipped": int(hedge["skipped"]),
        }
        c = self._counts
        moved: dict[str, int] = {}
        with self._lock:
            for key, total in totals.items():
                # The pool keeps these totals for its life, reloads included, and one
                # thread at a time applies its reads in order: they only grow, and the
                # counter moves by exactly what they grew. No reset is guessed from a
                # lower total (a restart seen only once it has grown back past the last
                # read would lose what came before); a lower one, from a stand-in that
                # counts afresh, is just the point to count from.
                moved[key] = max(0, total - c.seen.get(key, 0))
                c.seen[key] = total
                c.balancing[key] += moved[key]
        files = self._files
        if files is not None:
            const = self._const
            files.add("budget_refused", const, moved["refused"])
            for result in HEDGE_RESULTS:
                files.add("hedges", (*const, result), moved[result])
            files.add("hedges_skipped", const, moved["skipped"])

    def _write_gauges(self, stats: Mapping[str, Any], workers: Sequence[Mapping[str, Any]]) -> None:
        files = self._files
        assert files is not None
        const = self._const
        current: dict[str, float] = {}
        for w in workers:
            wid = str(w["id"])
            current[wid] = _full_share(w)
            files.declare_worker(const, wid)
            files.set_worker(const, wid, w)
        with self._lock:
            last, self._gauged = self._gauged, current
        for wid, share in last.items():
            if wid not in current:
                # The files keep a series once written: a removed worker reads zero
                # (but for its share, see clear_worker).
                files.clear_worker(const, wid, share)
        files.set_pool(const, stats)

    # -- scrape time (one process) ------------------------------------------------------

    def _fill(self, families: _Families) -> None:
        """Add this pool's samples to the families being scraped."""
        stats: Mapping[str, Any] | None
        try:
            workers, stats = self._read(workers=True)
        except Exception:
            # A scrape must not fail for every pool because one cannot report.
            log.exception("could not read the pool's state for Prometheus")
            workers, stats = [], None
        const = self._const
        with self._lock:
            c = self._counts
            attempts = dict(c.attempts)
            tasks = dict(c.tasks)
            retries = c.retries
            trips = dict(c.trips)
            reloads = dict(c.reloads)
            placements = dict(c.placements)
            load_seconds = c.load_seconds
            durations = {wid: (list(h.counts), h.total) for wid, h in c.durations.items()}
            balancing = dict(c.balancing) if c.seen else None
        # Current workers get zero series, so rate() and absent() work before any event.
        empty = ([0] * (len(self._bounds) + 1), 0.0)
        for w in workers:
            wid = w["id"]
            for outcome in ATTEMPT_OUTCOMES:
                attempts.setdefault((wid, outcome), 0)
            trips.setdefault(wid, 0)
            durations.setdefault(wid, empty)

        for (wid, outcome), n in sorted(attempts.items()):
            families.attempts.add_metric([*const, wid, outcome], n)
        for outcome, n in tasks.items():
            families.tasks.add_metric([*const, outcome], n)
        families.retries.add_metric(list(const), retries)
        for wid, n in sorted(trips.items()):
            families.trips.add_metric([*const, wid], n)
        for result, n in reloads.items():
            families.reloads.add_metric([*const, result], n)
        for action, n in placements.items():
            families.placements.add_metric([*const, action], n)
        families.load_seconds.add_metric(list(const), load_seconds)
        for wid, (counts, total) in sorted(durations.items()):
            cumulative, running = [], 0
            for bound, n in zip(self._le, counts, strict=True):
                running += n
                cumulative.append((bound, float(running)))
            families.duration.add_metric([*const, wid], cumulative, total)

        for w in workers:
            labels = [*const, w["id"]]
            families.in_flight.add_metric(labels, w["in_flight"])
            families.capacity.add_metric(labels, w["capacity"])
            families.healthy.add_metric(labels, 1.0 if w["healthy"] else 0.0)
            state = w["breaker"]["state"]
            for s in BREAKER_STATES:
                families.breaker_state.add_metric([*labels, s], 1.0 if state == s else 0.0)
            ewma_ms = w["latency"]["ewma_ms"]
            if ewma_ms is not None:
                families.latency_ewma.add_metric(labels, ewma_ms / 1000.0)
            if w["failure_rate"] is not None:
                families.failure_ratio.add_metric(labels, w["failure_rate"])
            balance = w.get("balancing")  # absent from an older pool's rows
            if balance is not None:
                estimate = balance["latency_estimate_ms"] / 1000
                families.latency_estimate.add_metric(labels, estimate)
                families.share.add_metric(labels, balance["share"])
        if balancing is not None:
            families.budget_refused.add_metric(list(const), balancing["refused"])
            for result in HEDGE_RESULTS:
                families.hedges.add_metric([*const, result], balancing[result])
            families.hedges_skipped.add_metric(list(const), balancing["skipped"])
        if stats is not None and "balancing" in stats:
            budget = stats["balancing"]["retry_budget"]
            families.budget_balance.add_metric(list(const), budget["balance"])
        if stats is not None:
            families.waiting.add_metric(list(const), stats["tasks"]["waiting"])
            pending = stats["dead_letters"]["pending"]
            if pending is not None:  # None: the store is closed
                families.dead_letters.add_metric(list(const), pending)


def instrument(
    pool: ExportablePool, registry: CollectorRegistry | None = None, **kwargs: Any
) -> PrometheusExporter:
    """Export ``pool``'s metrics: ``PrometheusExporter(pool, registry, **kwargs)``.

    Returns:
        The exporter; ``close()`` it to stop.

    Raises:
        ValueError: as :class:`PrometheusExporter`.
    """
    return PrometheusExporter(pool, registry, **kwargs)


def exporter_for(
    pool: ExportablePool, registry: CollectorRegistry | None = None
) -> PrometheusExporter:
    """The exporter of ``pool`` on ``registry``, built with the defaults if it has none.

    Raises:
        ValueError: the pool had to be instrumented and could not be (as
            :class:`PrometheusExporter`).
    """
    target = registry if registry is not None else _default_registry()
    with _registry_lock:
        for member in _members(target):
            if member.pool is pool:
                return member
        return PrometheusExporter(pool, registry)


def metrics_text(
    pool: ExportablePool, registry: CollectorRegistry | None = None
) -> tuple[bytes, str]:
    """The metrics in the Prometheus text format, for a ``/metrics`` endpoint.

    The first call for a pool and registry instruments the pool (with the defaults)
    unless an exporter for it is already registered there; its counters still count
    from the pool's start-up. In multiprocess mode the answer is every process's
    metrics from ``PROMETHEUS_MULTIPROC_DIR``, this process's gauges written first.

    Returns:
        The body and its content type.

    Raises:
        ValueError: the pool had to be instrumented and could not be (as
            :class:`PrometheusExporter`).
    """
    exporter = exporter_for(pool, registry)
    if exporter.multiprocess:
        exporter.refresh()
        everyone = CollectorRegistry()
        _TolerantMultiProcessCollector(everyone)  # type: ignore[no-untyped-call]
        return generate_latest(everyone), CONTENT_TYPE_LATEST
    return generate_latest(exporter.registry), CONTENT_TYPE_LATEST


class _TolerantMultiProcessCollector(MultiProcessCollector):
    """``MultiProcessCollector`` that leaves out a file it cannot read.

    A process killed while creating its file (or a full disk) leaves a truncated one,
    and the stock collector then raises on every scrape, in every process, until
    somebody cleans the directory: the whole fleet's metrics gone for one file.
    """

    def collect(self) -> Iterable[Metric]:
        files = sorted(glob.glob(os.path.join(self._path, "*.db")))
        readable = [f for f in files if _readable(f)]
        try:
            return cast(Iterable[Metric], self.merge(readable, accumulate=True))  # type: ignore[no-untyped-call]
        except FileNotFoundError:
            # child_exit removed a dead process's gauge file meanwhile: read again.
            return cast(
                Iterable[Metric],
                self.merge(  # type: ignore[no-untyped-call]
                    [f for f in readable if os.path.exists(f)], accumulate=True
                ),
            )


_unreadable_logged: set[str] = set()


def _readable(path: str) -> bool:
    try:
        MultiProcessCollector._read_metrics([path])  # type: ignore[no-untyped-call]
    except FileNotFoundError:
        return False  # removed since listed (a dead process's gauges, by child_exit)
    except (struct.error, ValueError, KeyError, IndexError, RuntimeError, OSError) as exc:
        if path not in _unreadable_logged:
            _unreadable_logged.add(path)
            log.warning(
                "prometheus: leaving out unreadable metrics file %s (%s: %s); delete it "
                "or restart with an empty PROMETHEUS_MULTIPROC_DIR",
                path,
                type(exc).__name__,
                exc,
            )
        return False
    return True


# -- metric names, help and label names: one place for both modes ----------------------

_WORKER = "w"  # the worker label follows the const labels
_HELP = {
    "attempts": ("Attempts sent to a worker, by outcome.", _WORKER, ("outcome",)),
    "tasks": ("Tasks ended, by outcome.", "", ("outcome",)),
    "retries": ("Attempts made again after a worker failed one.", "", ()),
    "trips": ("Times the worker's circuit breaker opened.", _WORKER, ()),
    "reloads": ("Configuration reloads, by result.", "", ("result",)),
    "budget_refused": ("Retries and hedges the retry budget refused.", "", ()),
    "hedges": (
        "Hedged attempts sent, by whether theirs was the answer returned.",
        "",
        ("result",),
    ),
    "hedges_skipped": ("Hedges due but not sent: no budget or no worker free.", "", ()),
    "placements": (
        "Placement's model loads, unloads, evictions and refused requests, by action.",
        "",
        ("action",),
    ),
    "load_seconds": ("Time placement's model loads took, in all.", "", ()),
}
_NAMES = {
    "attempts": "attempts",
    "tasks": "tasks",
    "retries": "retries",
    "trips": "breaker_trips",
    "reloads": "reloads",
    "duration": "attempt_duration_seconds",
    "in_flight": "worker_in_flight",
    "capacity": "worker_capacity",
    "healthy": "worker_healthy",
    "breaker_state": "worker_breaker_state",
    "latency_ewma": "worker_latency_ewma_seconds",
    "failure_ratio": "worker_failure_ratio",
    "waiting": "tasks_waiting",
    "dead_letters": "dead_letters_pending",
    "budget_refused": "retry_budget_refused",
    "hedges": "hedges",
    "hedges_skipped": "hedges_skipped",
    "placements": "model_placements",
    "load_seconds": "model_load_seconds",
    "latency_estimate": "worker_latency_estimate_seconds",
    "share": "worker_share",
    "budget_balance": "retry_budget_balance",
}
_DURATION_HELP = "Duration of attempts, any outcome."
_GAUGES: dict[str, tuple[str, str, tuple[str, ...], str]] = {
    # name: (help, worker label?, extra labels, multiprocess mode)
    "in_flight": ("Attempts on the wire to the worker now.", _WORKER, (), "livesum"),
    "capacity": ("Most attempts the worker may have at once.", _WORKER, (), "livesum"),
    "healthy": ("1 if the worker passes its health checks.", _WORKER, (), "livemin"),
    "breaker_state": (
        "1 for the breaker's current state, 0 for the others.",
        _WORKER,
        ("state",),
        "livemax",
    ),
    "latency_ewma": ("Moving average of the worker's attempt latency.", _WORKER, (), "livemax"),
    "failure_ratio": (
        "Failed share of the worker's attempts over the sliding window.",
        _WORKER,
        (),
        "livemax",
    ),
    "waiting": ("Tasks queued for a worker with capacity.", "", (), "livesum"),
    "dead_letters": ("Dead-letter records in the store.", "", (), "livemax"),
    # Each process balances on its own: the worst estimate, the smallest share (a
    # worker still ramping up in some process), and the retries the fleet may send.
    "latency_estimate": (
        "The peak-EWMA latency estimate latency-aware choice compares.",
        _WORKER,
        (),
        "livemax",
    ),
    "share": ("The worker's weight times its slow start factor.", _WORKER, (), "livemin"),
    "budget_balance": ("Retries and hedges the retry budget allows now.", "", (), "livesum"),
}


def _label_names(const_names: Sequence[str], worker: str, extra: Sequence[str]) -> list[str]:
    return [*const_names, *(["worker"] if worker else []), *extra]


class _Families:
    """Fresh, empty metric families for one scrape."""

    def __init__(self, namespace: str, const_names: Sequence[str]) -> None:
        def counter(key: str) -> CounterMetricFamily:
            text, worker, extra = _HELP[key]
            labels = _label_names(const_names, worker, extra)
            return CounterMetricFamily(f"{namespace}_{_NAMES[key]}", text, labels=labels)

        def gauge(key: str) -> GaugeMetricFamily:
            text, worker, extra, _ = _GAUGES[key]
            labels = _label_names(const_names, worker, extra)
            return GaugeMetricFamily(f"{namespace}_{_NAMES[key]}", text, labels=labels)

        self.attempts = counter("attempts")
        self.tasks = counter("tasks")
        self.retries = counter("retries")
        self.trips = counter("trips")
        self.reloads = counter("reloads")
        self.duration = HistogramMetricFamily(
            f"{namespace}_{_NAMES['duration']}",
            _DURATION_HELP,
            labels=_label_names(const_names, _WORKER, ()),
        )
        self.in_flight = gauge("in_flight")
        self.capacity = gauge("capacity")
        self.healthy = gauge("healthy")
        self.breaker_state = gauge("breaker_state")
        self.latency_ewma = gauge("latency_ewma")
        self.failure_ratio = gauge("failure_ratio")
        self.waiting = gauge("waiting")
        self.dead_letters = gauge("dead_letters")
        self.latency_estimate = gauge("latency_estimate")
        self.share = gauge("share")
        self.budget_balance = gauge("budget_balance")
        self.budget_refused = counter("budget_refused")
        self.hedges = counter("hedges")
        self.hedges_skipped = counter("hedges_skipped")
        self.placements = counter("placements")
        self.load_seconds = counter("load_seconds")

    def all(self) -> list[Metric]:
        return [
            self.placements,
            self.load_seconds,
            self.attempts,
            self.tasks,
            self.retries,
            self.trips,
            self.reloads,
            self.duration,
            self.in_flight,
            self.capacity,
            self.healthy,
            self.breaker_state,
            self.latency_ewma,
            self.failure_ratio,
            self.waiting,
            self.dead_letters,
            self.latency_estimate,
            self.share,
            self.budget_balance,
            self.budget_refused,
            self.hedges,
            self.hedges_skipped,
        ]


# A removed worker's gauges set to 0 in the files (one-hot breaker states and share apart).
_ZEROED = ("in_flight", "capacity", "healthy", "failure_ratio", "latency_estimate")


class _Files:
    """The multiprocess-mode metrics of one namespace in this process: prometheus_client
    metric objects whose values live in ``PROMETHEUS_MULTIPROC_DIR``. Thread-safe (the
    client's values take their own lock)."""

    def __init__(self, namespace: str, const_names: Sequence[str], bounds: tuple[float, ...]):
        self.bounds = bounds
        self.const_names = tuple(const_names)
        self._metrics: dict[str, Any] = {}
        for key, (text, worker, extra) in _HELP.items():
            self._metrics[key] = Counter(
                f"{namespace}_{_NAMES[key]}",
                text,
                _label_names(const_names, worker, extra),
                registry=None,
            )
        self._metrics["duration"] = Histogram(
            f"{namespace}_{_NAMES['duration']}",
            _DURATION_HELP,
            _label_names(const_names, _WORKER, ()),
            buckets=bounds,
            registry=None,
        )
        for key, (text, worker, extra, mode) in _GAUGES.items():
            self._metrics[key] = Gauge(
                f"{namespace}_{_NAMES[key]}",
                text,
                _label_names(const_names, worker, extra),
                registry=None,
                multiprocess_mode=cast(Any, mode),
            )
        self._children: dict[tuple[str, tuple[str, ...]], Any] = {}

    def _child(self, key: str, labels: tuple[str, ...]) -> Any:
        child = self._children.get((key, labels))
        if child is None:
            metric = self._metrics[key]
            child = metric.labels(*labels) if labels else metric
            self._children[(key, labels)] = child
        return child

    def add(self, key: str, labels: tuple[str, ...], n: float) -> None:
        child = self._child(key, labels)
        if n:
            child.inc(n)

    def observe(self, labels: tuple[str, ...], seconds: float) -> None:
        self._child("duration", labels).observe(seconds)

    def declare_worker(self, const: tuple[str, ...], wid: str) -> None:
        """Zero series for a worker, so rate() works before its first event."""
        for outcome in ATTEMPT_OUTCOMES:
            self._child("attempts", (*const, wid, outcome))
        self._child("trips", (*const, wid))
        self._child("duration", (*const, wid))

    def set_worker(self, const: tuple[str, ...], wid: str, w: Mapping[str, Any]) -> None:
        labels = (*const, wid)
        self._child("in_flight", labels).set(w["in_flight"])
        self._child("capacity", labels).set(w["capacity"])
        self._child("healthy", labels).set(1.0 if w["healthy"] else 0.0)
        state = w["breaker"]["state"]
        for s in BREAKER_STATES:
            self._child("breaker_state", (*labels, s)).set(1.0 if state == s else 0.0)
        ewma_ms = w["latency"]["ewma_ms"]
        if ewma_ms is not None:
            self._child("latency_ewma", labels).set(ewma_ms / 1000.0)
        # A series once in a file cannot be made absent again: no attempt in the window
        # reads 0, not the last window's ratio.
        self._child("failure_ratio", labels).set(w["failure_rate"] or 0.0)
        balance = w.get("balancing")  # absent from an older pool's rows
        if balance is not None:
            self._child("latency_estimate", labels).set(balance["latency_estimate_ms"] / 1000)
            self._child("share", labels).set(balance["share"])

    def clear_worker(self, const: tuple[str, ...], wid: str, full_share: float) -> None:
        """A worker this process no longer has: its gauges read 0, but for its share.
        That is combined by the smallest (``livemin``), so 0 would read 0 fleet-wide
        while other processes still use the worker; its full share (the weight) leaves
        theirs to decide."""
        labels = (*const, wid)
        for key in _ZEROED:
            self._child(key, labels).set(0.0)
        self._child("share", labels).set(full_share)
        for s in BREAKER_STATES:
            self._child("breaker_state", (*labels, s)).set(0.0)

    def set_pool(self, const: tuple[str, ...], stats: Mapping[str, Any]) -> None:
        self._child("waiting", const).set(stats["tasks"]["waiting"])
        pending = stats["dead_letters"]["pending"]
        if pending is not None:
            self._child("dead_letters", const).set(pending)
        if "balancing" in stats:
            balance = stats["balancing"]["retry_budget"]["balance"]
            self._child("budget_balance", const).set(balance)


class _SharedCollector:
    """The registered collector of every pool exported on one registry and namespace."""

    def __init__(self, namespace: str, const_names: tuple[str, ...], files: _Files | None) -> None:
        self.namespace = namespace
        self.const_names = const_names
        self.files = files
        self.members: list[PrometheusExporter] = []

    def describe(self) -> Iterable[Metric]:
        # Names only, so the registry can refuse a clash without reading any pool.
        return _Families(self.namespace, self.const_names).all()

    def collect(self) -> Iterable[Metric]:
        families = _Families(self.namespace, self.const_names)
        with _registry_lock:
            members = list(self.members)
        for member in members:
            member._fill(families)
        return families.all()


# Held while registering, unregistering or listing members; a reentrant lock because
# exporter_for() builds an exporter while holding it.
_registry_lock = threading.RLock()
_collectors: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, _SharedCollector]] = (
    weakref.WeakKeyDictionary()
)
_live_exporters: weakref.WeakSet[PrometheusExporter] = weakref.WeakSet()
# In multiprocess mode: never served, it only keeps this process's exporters apart.
_private_registry: CollectorRegistry | None = None
# One set of metric objects per namespace and process, whatever the exporters.
_files_by_namespace: dict[str, _Files] = {}


def _default_registry() -> CollectorRegistry:
    global _private_registry
    if not multiprocess_mode():
        return REGISTRY
    with _registry_lock:
        if _private_registry is None:
            _private_registry = CollectorRegistry(auto_describe=True)
        return _private_registry


def _members(registry: CollectorRegistry) -> list[PrometheusExporter]:
    with _registry_lock:
        by_namespace = _collectors.get(registry, {})
        return [m for collector in by_namespace.values() for m in collector.members]


def _join(exporter: PrometheusExporter) -> _SharedCollector:
    registry = exporter.registry
    namespace = exporter.namespace
    labels = exporter.const_labels
    with _registry_lock:
        # A closed pool reports nothing new; its place goes to the pool that replaces it
        # (a restarted app, a test building a pool per test) rather than refusing that one.
        for other in _members(registry):
            if other.pool.closed:
                other.close()
        for other in _members(registry):
            if other.pool is exporter.pool and other.namespace == namespace:
                raise ValueError(f"this pool is already exported on this registry ({namespace})")
        by_namespace = _collectors.setdefault(registry, {})
        collector = by_namespace.get(namespace)
        if collector is None:
            files = None
            if exporter.multiprocess:
                files = _files_by_namespace.get(namespace)
                if files is None:
                    files = _Files(namespace, tuple(labels), exporter._bounds)
                    _files_by_namespace[namespace] = files
                elif files.const_names != tuple(labels):
                    raise ValueError(
                        f"const_labels {labels!r} differ in names from those this process "
                        f"exported before under {namespace!r} {list(files.const_names)}: in "
                        "multiprocess mode one namespace has one set of label names"
                    )
            collector = _SharedCollector(namespace, tuple(labels), files)
            registry.register(collector)  # raises ValueError on a name clash
            by_namespace[namespace] = collector
        else:
            hint = (
                "give each pool distinct const_labels (such as {'pool': 'name'}) "
                "with the same label names, or a registry of its own"
            )
            if tuple(labels) != collector.const_names:
                raise ValueError(
                    f"const_labels {labels!r} differ in names from those of the pools already "
                    f"exported on this registry {list(collector.const_names)}: {hint}"
                )
            if any(m.const_labels == labels for m in collector.members):
                raise ValueError(
                    f"another pool is exported on this registry with const_labels "
                    f"{labels!r}: {hint}"
                )
        collector.members.append(exporter)
        return collector


def _leave(exporter: PrometheusExporter) -> None:
    registry = exporter.registry
    with _registry_lock:
        collector = exporter._collector
        if exporter in collector.members:
            collector.members.remove(exporter)
        if not collector.members:
            by_namespace = _collectors.get(registry, {})
            if by_namespace.get(collector.namespace) is collector:
                registry.unregister(collector)
                del by_namespace[collector.namespace]


def _after_fork_in_child() -> None:
    """A forked child counts its own work from zero, like its pool does (in multiprocess
    mode prometheus_client moves to files of the child's own pid by itself)."""
    global _registry_lock
    _registry_lock = threading.RLock()
    for exporter in list(_live_exporters):
        exporter._lock = threading.Lock()
        exporter._counts = _Counts()
        exporter._gauged = {}
        exporter._following = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _full_share(row: Mapping[str, Any]) -> float:
    """The most share a worker's row can show: its weight (the share of a stand-in row
    without one)."""
    balance = row.get("balancing")  # absent from an older pool's rows
    if balance is None:
        return 1.0
    return float(balance.get("weight", balance["share"]))


def _check_buckets(buckets: Sequence[float]) -> tuple[float, ...]:
    bounds = tuple(float(b) for b in buckets)
    if bounds and math.isinf(bounds[-1]):
        bounds = bounds[:-1]  # +Inf is always added
    if not bounds:
        raise ValueError("buckets must name at least one finite upper bound")
    if any(math.isnan(b) or math.isinf(b) for b in bounds):
        raise ValueError(f"buckets must be finite numbers, got {list(buckets)!r}")
    if any(a >= b for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"buckets must be strictly increasing, got {list(buckets)!r}")
    return bounds


def _check_labels(labels: Mapping[str, str]) -> dict[str, str]:
    checked: dict[str, str] = {}
    # Sorted, so that pools sharing a collector agree on the label order.
    for name, value in sorted(labels.items()):
        if not isinstance(name, str) or not _LABEL_NAME.match(name) or name.startswith("__"):
            raise ValueError(f"const_labels: {name!r} is not a valid label name")
        if name in _OWN_LABELS:
            raise ValueError(f"const_labels: {name!r} is a label the exporter sets itself")
        if not isinstance(value, str):
            raise ValueError(f"const_labels[{name!r}] must be a string, got {value!r}")
        checked[name] = value
    return checked
