"""Prometheus metrics for a pool (``pip install npu_sync[prometheus]``).

Counters and the attempt-latency histogram are kept by a hook, from the pool's events;
gauges are read from ``pool.stats()``/``pool.workers()`` only when Prometheus scrapes,
so a task pays a dictionary update and nothing for the gauges. This is the only module
that imports ``prometheus_client``, and ``import npu_sync`` does not import it.

Every pool exported on one registry under one namespace shares a single registered
collector: each metric family appears once, with one series per pool, told apart by the
``const_labels`` each exporter was given (see docs/prometheus.md).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import re
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

try:
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )
    from prometheus_client.metrics_core import Metric
    from prometheus_client.utils import floatToGoString
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "npu_sync.prometheus needs prometheus_client: pip install 'npu_sync[prometheus]'"
    ) from exc

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
    TaskSucceeded,
)

__all__ = [
    "DEFAULT_BUCKETS",
    "ExportablePool",
    "PrometheusExporter",
    "instrument",
    "metrics_text",
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

_ATTEMPT_OUTCOMES = ("success", "rejected", "not_here", "failure", "abandoned")
_TASK_OUTCOMES = ("succeeded", "rejected", "failed", "fallback")
_RELOAD_RESULTS = ("ok", "failed")
_BREAKER_STATES = ("closed", "open", "half-open")
_OWN_LABELS = frozenset({"worker", "outcome", "result", "state", "le", "quantile"})
_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


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
    tasks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_TASK_OUTCOMES, 0))
    retries: dict[str, int] = field(default_factory=dict)
    trips: dict[str, int] = field(default_factory=dict)
    reloads: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_RELOAD_RESULTS, 0))
    durations: dict[str, _Histogram] = field(default_factory=dict)


class PrometheusExporter:
    """Exports one pool's metrics to a prometheus_client registry. Thread-safe.

    Counters count from the moment the exporter is attached: build it right after the
    pool. Two pools on one registry need distinct ``const_labels`` (for example
    ``{"pool": "chat"}``), or a registry each. The exporter of a pool that has been
    closed is closed when another exporter joins the same registry.

    Args:
        pool: the pool to export (a :class:`npu_sync.WorkerPool`).
        registry: where to register; default ``prometheus_client.REGISTRY``.
        namespace: prefix of every metric name.
        buckets: upper bounds, in seconds, of the attempt-duration histogram.
        const_labels: labels added to every series of this pool.

    Raises:
        ValueError: an invalid namespace, bucket list or label; this pool is already
            exported on the registry; another pool there has the same ``const_labels``;
            or the registry already has other metrics by these names.
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
        self._pool = pool
        self._registry = registry if registry is not None else REGISTRY
        self._namespace = namespace
        self._bounds = _check_buckets(buckets)
        # The client's own spelling of bounds ("1.0", "+Inf"), as its Histogram writes them.
        self._le = [*(floatToGoString(b) for b in self._bounds), "+Inf"]  # type: ignore[no-untyped-call]
        self._labels = _check_labels(const_labels or {})
        self._lock = threading.Lock()
        self._counts = _Counts()
        self._closed = False
        # remove_hook matches by identity, and each attribute access makes a new bound method.
        self._hook: Hook = self._on_event
        self._collector = _join(self)
        try:
            pool.add_hook(self._hook)
        except BaseException:
            _leave(self)
            raise

    @property
    def pool(self) -> ExportablePool:
        """The pool being exported."""
        return self._pool

    @property
    def registry(self) -> CollectorRegistry:
        """The registry the metrics are registered on."""
        return self._registry

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def const_labels(self) -> dict[str, str]:
        return dict(self._labels)

    def close(self) -> None:
        """Stop counting and drop this pool's series from the registry. Idempotent.

        The registry's collector is unregistered with the last pool using it.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.remove_hook(self._hook)
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

    # -- the hook: runs on task threads, so it only bumps numbers under a short lock ---

    def _on_event(self, event: Event) -> None:
        c = self._counts
        if isinstance(event, AttemptFinished):
            index = bisect.bisect_left(self._bounds, event.duration)
            key = (event.worker_id, event.outcome)
            with self._lock:
                c.attempts[key] = c.attempts.get(key, 0) + 1
                hist = c.durations.get(event.worker_id)
                if hist is None:
                    hist = c.durations[event.worker_id] = _Histogram([0] * (len(self._bounds) + 1))
                hist.counts[index] += 1
                hist.total += event.duration
        elif isinstance(event, TaskSucceeded):
            self._bump(c.tasks, "succeeded")
        elif isinstance(event, TaskRejectedEvent):
            self._bump(c.tasks, "rejected")
        elif isinstance(event, TaskDeadLettered):
            self._bump(c.tasks, "failed")
        elif isinstance(event, TaskFallback):
            self._bump(c.tasks, "fallback")
        elif isinstance(event, RetryScheduled):
            self._bump(c.retries, event.worker_id)
        elif isinstance(event, BreakerStateChanged):
            if event.new == "open":
                self._bump(c.trips, event.worker_id)
        elif isinstance(event, ConfigReloaded):
            self._bump(c.reloads, "ok")
        elif isinstance(event, ConfigReloadFailed):
            self._bump(c.reloads, "failed")

    def _bump(self, counter: dict[str, int], key: str) -> None:
        with self._lock:
            counter[key] = counter.get(key, 0) + 1

    # -- scrape time --------------------------------------------------------------------

    def _fill(self, families: _Families) -> None:
        """Add this pool's samples to the families being scraped."""
        try:
            workers = self._pool.workers()
            stats = self._pool.stats()
        except Exception:
            # A scrape must not fail for every pool because one cannot report.
            log.exception("could not read the pool's state for Prometheus")
            workers, stats = [], None
        const = tuple(self._labels.values())
        with self._lock:
            c = self._counts
            attempts = dict(c.attempts)
            tasks = dict(c.tasks)
            retries = dict(c.retries)
            trips = dict(c.trips)
            reloads = dict(c.reloads)
            durations = {wid: (list(h.counts), h.total) for wid, h in c.durations.items()}
        # Current workers get zero series, so rate() and absent() work before any event.
        empty = ([0] * (len(self._bounds) + 1), 0.0)
        for w in workers:
            wid = w["id"]
            for outcome in _ATTEMPT_OUTCOMES:
                attempts.setdefault((wid, outcome), 0)
            retries.setdefault(wid, 0)
            trips.setdefault(wid, 0)
            durations.setdefault(wid, empty)

        for (wid, outcome), n in sorted(attempts.items()):
            families.attempts.add_metric([*const, wid, outcome], n)
        for outcome, n in tasks.items():
            families.tasks.add_metric([*const, outcome], n)
        for wid, n in sorted(retries.items()):
            families.retries.add_metric([*const, wid], n)
        for wid, n in sorted(trips.items()):
            families.trips.add_metric([*const, wid], n)
        for result, n in reloads.items():
            families.reloads.add_metric([*const, result], n)
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
            for s in _BREAKER_STATES:
                families.breaker_state.add_metric([*labels, s], 1.0 if state == s else 0.0)
            ewma_ms = w["latency"]["ewma_ms"]
            if ewma_ms is not None:
                families.latency_ewma.add_metric(labels, ewma_ms / 1000.0)
            if w["failure_rate"] is not None:
                families.failure_rate.add_metric(labels, w["failure_rate"])
            balance = w.get("balancing")  # absent from an older pool's rows
            if balance is not None:
                estimate = balance["latency_estimate_ms"] / 1000
                families.latency_estimate.add_metric(labels, estimate)
                families.share.add_metric(labels, balance["share"])
        if stats is not None and "balancing" in stats:
            budget = stats["balancing"]["retry_budget"]
            families.budget_balance.add_metric(list(const), budget["balance"])
            families.budget_refused.add_metric(list(const), budget["refused"])
            hedge = stats["balancing"]["hedge"]
            families.hedges.add_metric([*const, "won"], hedge["won"])
            families.hedges.add_metric([*const, "lost"], hedge["hedged"] - hedge["won"])
            families.hedges_skipped.add_metric(list(const), hedge["skipped"])
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


def metrics_text(
    pool: ExportablePool, registry: CollectorRegistry | None = None
) -> tuple[bytes, str]:
    """The registry's metrics in the Prometheus text format, for a ``/metrics`` endpoint.

    The first call for a pool and registry instruments the pool (with the defaults)
    unless an exporter for it is already registered there.

    Returns:
        The body and its content type.

    Raises:
        ValueError: the pool had to be instrumented and could not be (as
            :class:`PrometheusExporter`).
    """
    target = registry if registry is not None else REGISTRY
    with _registry_lock:
        if not any(m.pool is pool for m in _members(target)):
            PrometheusExporter(pool, target)
    return generate_latest(target), CONTENT_TYPE_LATEST


# -- one collector per (registry, namespace), shared by the pools exported there -------


class _Families:
    """Fresh, empty metric families for one scrape."""

    def __init__(self, namespace: str, const_names: Sequence[str]) -> None:
        def name(suffix: str) -> str:
            return f"{namespace}_{suffix}"

        c = list(const_names)
        w = [*c, "worker"]
        self.attempts = CounterMetricFamily(
            name("attempts"), "Attempts sent to a worker, by outcome.", labels=[*w, "outcome"]
        )
        self.tasks = CounterMetricFamily(
            name("tasks"), "Tasks ended, by outcome.", labels=[*c, "outcome"]
        )
        self.retries = CounterMetricFamily(
            name("retries"), "Retries scheduled after this worker failed an attempt.", labels=w
        )
        self.trips = CounterMetricFamily(
            name("breaker_trips"), "Times the worker's circuit breaker opened.", labels=w
        )
        self.reloads = CounterMetricFamily(
            name("reloads"), "Configuration reloads, by result.", labels=[*c, "result"]
        )
        self.duration = HistogramMetricFamily(
            name("attempt_duration_seconds"), "Duration of attempts, any outcome.", labels=w
        )
        self.in_flight = GaugeMetricFamily(
            name("worker_in_flight"), "Attempts on the wire to the worker now.", labels=w
        )
        self.capacity = GaugeMetricFamily(
            name("worker_capacity"), "Most attempts the worker may have at once.", labels=w
        )
        self.healthy = GaugeMetricFamily(
            name("worker_healthy"), "1 if the worker passes its health checks.", labels=w
        )
        self.breaker_state = GaugeMetricFamily(
            name("worker_breaker_state"),
            "1 for the breaker's current state, 0 for the others.",
            labels=[*w, "state"],
        )
        self.latency_ewma = GaugeMetricFamily(
            name("worker_latency_ewma_seconds"),
            "Moving average of the worker's attempt latency.",
            labels=w,
        )
        self.failure_rate = GaugeMetricFamily(
            name("worker_failure_rate"),
            "Failed share of the worker's attempts over the sliding window.",
            labels=w,
        )
        self.waiting = GaugeMetricFamily(
            name("tasks_waiting"), "Tasks queued for a worker with capacity.", labels=c
        )
        self.dead_letters = GaugeMetricFamily(
            name("dead_letters_pending"), "Dead-letter records in the store.", labels=c
        )
        self.latency_estimate = GaugeMetricFamily(
            name("worker_latency_estimate_seconds"),
            "The peak-EWMA latency estimate latency-aware choice compares.",
            labels=w,
        )
        self.share = GaugeMetricFamily(
            name("worker_share"), "The worker's weight times its slow start factor.", labels=w
        )
        self.budget_balance = GaugeMetricFamily(
            name("retry_budget_balance"), "Retries and hedges the budget allows now.", labels=c
        )
        self.budget_refused = CounterMetricFamily(
            name("retry_budget_refused"), "Retries and hedges the budget refused.", labels=c
        )
        self.hedges = CounterMetricFamily(
            name("hedges"),
            "Hedged attempts sent, by whether theirs was the answer returned.",
            labels=[*c, "result"],
        )
        self.hedges_skipped = CounterMetricFamily(
            name("hedges_skipped"),
            "Hedges due but not sent: no budget or no worker free.",
            labels=c,
        )

    def all(self) -> list[Metric]:
        return [
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
            self.failure_rate,
            self.waiting,
            self.dead_letters,
            self.latency_estimate,
            self.share,
            self.budget_balance,
            self.budget_refused,
            self.hedges,
            self.hedges_skipped,
        ]


class _SharedCollector:
    """The registered collector of every pool exported on one registry and namespace."""

    def __init__(self, namespace: str, const_names: tuple[str, ...]) -> None:
        self.namespace = namespace
        self.const_names = const_names
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
# metrics_text() builds an exporter while holding it.
_registry_lock = threading.RLock()
_collectors: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, _SharedCollector]] = (
    weakref.WeakKeyDictionary()
)


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
            collector = _SharedCollector(namespace, tuple(labels))
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
