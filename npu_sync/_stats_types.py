"""The shapes of ``stats()`` and ``workers()``, for type checkers and IDEs.

These are ``TypedDict``s: at run time the values are the plain dicts described in
docs/metrics.md, and a type checker catches a misspelt key. A test keeps them, the
code and the docs in agreement.
"""

from typing import TypedDict

__all__ = [
    "BalancingStats",
    "BreakerStats",
    "ConnectionStats",
    "DeadLetterStats",
    "FallbackStats",
    "FleetSkipped",
    "FleetSnapshotStats",
    "FleetStatsDict",
    "FleetTotals",
    "FleetWorkerTotals",
    "HandoverDict",
    "HealthCheckDict",
    "HealthStats",
    "HedgeStats",
    "HistoryDict",
    "HostRow",
    "HostTasks",
    "LatencyStats",
    "ModelRowDict",
    "ModelStats",
    "ModelViewDict",
    "PoolStatsDict",
    "PoolTaskStats",
    "PoolWorkerCounts",
    "ProcessInfo",
    "ProcessSnapshot",
    "ProcessWorkerStats",
    "ReloadChangeDict",
    "ReloadStats",
    "RetryBudgetStats",
    "SelectionStats",
    "SharedStateStats",
    "SilentProcess",
    "TaskHistory",
    "WorkerBalancing",
    "WorkerHistory",
    "WorkerRow",
    "WorkerTaskStats",
]


class PoolWorkerCounts(TypedDict):
    """``stats()["workers"]``."""

    total: int
    available: int
    healthy: int
    open_breakers: int


class PoolTaskStats(TypedDict):
    """``stats()["tasks"]``."""

    submitted: int
    succeeded: int
    rejected: int
    failed: int
    fallbacks: int
    cancelled: int
    retries: int
    active: int
    in_flight: int
    waiting: int


class DeadLetterStats(TypedDict):
    """``stats()["dead_letters"]``."""

    stored_total: int
    pending: int | None
    dropped: int | None


class ReloadChangeDict(TypedDict):
    """A :class:`~npu_sync._pool.ReloadResult` as a dict (``stats()["reloads"]["last_change"]``)."""

    added: list[str]
    removed: list[str]
    updated: list[str]
    unchanged: list[str]
    settings_changed: bool
    restart_required: list[str]
    retiring: list[str]


class HandoverDict(TypedDict):
    """``stats()["reloads"]["handover"]``: removed workers still serving until the
    workers a reload added pass a health check."""

    retiring: list[str]
    awaited: list[str]
    joined: list[str]
    seconds: float  # since the handover began
    overdue: bool


class ReloadStats(TypedDict):
    """``stats()["reloads"]``."""

    ok: int
    failed: int
    last_error: str | None
    last_at: float | None
    last_change: ReloadChangeDict | None
    handover: HandoverDict | None


class _SharedStateBackend(TypedDict):
    backend: str  # "none" or "redis"


class FleetSnapshotStats(TypedDict):
    """``stats()["shared_state"]["fleet_snapshots"]``: this process's snapshot traffic.
    A failed one (late, refused) is counted here and is not an outage."""

    written: int
    write_failed: int
    read: int
    read_failed: int
    last_error: str | None


class SharedStateStats(_SharedStateBackend, total=False):
    """``stats()["shared_state"]``: only ``backend`` when it is ``none``."""

    # Present with the redis backend only. Declared through ``total=False`` rather
    # than ``NotRequired`` so the module imports on Python 3.10.
    available: bool
    outages: int
    last_error: str | None
    published: int
    received: int
    trials_taken: int
    trials_yielded: int
    dead_letters_held_locally: int
    eviction_policy: str | None
    eviction_warnings: int
    fleet_snapshots: FleetSnapshotStats


class HealthStats(TypedDict):
    """``stats()["health"]``."""

    enabled: bool
    running: bool
    rounds: int
    threads: int
    concurrency: int
    in_flight: int
    skipped: int
    behind: bool
    lag_ms: float


class ConnectionStats(TypedDict):
    """``stats()["connections"]``: idle keep-alive connections over all workers."""

    idle: int
    max_idle: int
    closed_over_budget: int
    reaped: int


class SelectionStats(TypedDict):
    """``stats()["selection_us"]``: microseconds, ``None`` before the first selection."""

    p50: float | None
    p99: float | None


class FallbackStats(TypedDict):
    """``stats()["fallback"]``: whether the pool is :func:`~npu_sync.get_pool`'s
    single-worker fallback, and why."""

    active: bool
    reason: str | None


class ModelStats(TypedDict):
    """``stats()["models"]``: what the pool knows of the workers' models."""

    placement: bool
    held: list[str]
    unknown: int
    corrections: int
    placements: int
    placement_failures: int
    balance: bool
    loads: int
    unloads: int
    evictions: int
    load_failures: int
    load_seconds: float
    per_model: list["ModelViewDict"]


class ModelRowDict(TypedDict):
    """One model as placement rounds see it (``Placer.rows()``); ``stats()`` shows it
    merged into a :class:`ModelViewDict`."""

    model: str
    min: int
    max: int | None
    workers: list[str]
    in_flight: int
    load_seconds: float | None


class ModelViewDict(TypedDict):
    """``stats()["models"]["per_model"][i]``: one model, who holds it, its load, its
    replicas against its targets."""

    model: str
    workers: list[str]  # every worker known to hold it, by id
    replicas: int  # of those, the ones that can take a task now
    min: int
    max: int | None
    in_flight: int | None  # this process's tasks (models.balance); None: not counted
    inferences: int | None  # the holders' own counts; None: none reports one
    rate: float | None  # inferences per second between the last two lists
    load_seconds: float | None


class RetryBudgetStats(TypedDict):
    """``stats()["balancing"]["retry_budget"]``: the pool-wide retry budget."""

    ratio: float
    min_per_second: float
    window: float
    balance: float
    exhausted: bool
    requests: int
    retries: int
    refused: int


class HedgeStats(TypedDict):
    """``stats()["balancing"]["hedge"]``: hedged requests."""

    enabled: bool
    mode: str  # "delay" or "percentile"
    delay_ms: float | None
    percentile: float | None
    samples: int
    hedged: int
    won: int
    skipped: int


class BalancingStats(TypedDict):
    """``stats()["balancing"]``: how tasks are spread, and the mechanisms' counters."""

    strategy: str
    latency_aware: bool
    latency_decay: float
    slow_start: float
    ramping: list[str]
    adaptive_concurrency: bool
    concurrency_limit: str
    retry_budget: RetryBudgetStats
    hedge: HedgeStats


class PoolStatsDict(TypedDict):
    """What :meth:`WorkerPool.stats` returns."""

    uptime_s: float
    closed: bool
    fallback: FallbackStats
    workers: PoolWorkerCounts
    tasks: PoolTaskStats
    dead_letters: DeadLetterStats
    reloads: ReloadStats
    shared_state: SharedStateStats
    health: HealthStats
    connections: ConnectionStats
    selection_us: SelectionStats
    models: ModelStats
    balancing: BalancingStats


class HealthCheckDict(TypedDict):
    """A worker's last health check (``workers()[i]["health"]``)."""

    worker_id: str
    ok: bool
    checked_at: float
    latency_ms: float | None
    status: int | None
    error: str | None
    draining: bool | None
    max_concurrent: int | None
    active_tasks: int | None


class BreakerStats(TypedDict):
    """``workers()[i]["breaker"]``."""

    state: str  # "closed", "open" or "half-open"
    trips: int
    failures: int
    reset_timeout: float


class WorkerTaskStats(TypedDict):
    """``workers()[i]["tasks"]``: attempts by outcome."""

    attempts: int
    succeeded: int
    failed: int
    rejected: int
    not_here: int
    abandoned: int


class LatencyStats(TypedDict):
    """``workers()[i]["latency"]``: milliseconds, ``None`` before the first attempt."""

    ewma_ms: float | None
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None


class WorkerBalancing(TypedDict):
    """``workers()[i]["balancing"]``: what the balancing mechanisms know of the worker."""

    weight: int
    share: float
    latency_estimate_ms: float
    latency_observed: bool
    slow_start_until: float | None
    limit: int | None
    limit_mode: str | None


class WorkerRow(TypedDict):
    """One row of :meth:`WorkerPool.workers`."""

    id: str
    name: str
    url: str
    priority: int
    protocol: str
    models: list[str] | None
    device: str | None
    npu_available: bool | None
    max_models: int | None
    enabled: bool
    draining: bool
    removed: bool
    healthy: bool
    health: HealthCheckDict | None
    breaker: BreakerStats
    in_flight: int
    capacity: int
    tasks: WorkerTaskStats
    failure_rate: float | None
    latency: LatencyStats
    last_error: str | None
    last_error_at: float | None
    cooldown_remaining: float
    balancing: WorkerBalancing


# -- pool.stats(scope="fleet") ---------------------------------------------------------


class ProcessInfo(TypedDict):
    """One process's pool: which process it is (``stats(scope="fleet")["this_process"]``)."""

    id: str  # "<host>:<pid>:<random>", unique even when a pid is reused
    pid: int
    host: str
    started_at: float  # epoch seconds: when the pool started in this process


class ProcessWorkerStats(TypedDict):
    """One worker as one process sees it (``processes[i]["workers"][j]``)."""

    id: str
    breaker: str  # "closed", "open" or "half-open"
    healthy: bool
    in_flight: int
    capacity: int
    attempts: int
    succeeded: int
    failed: int
    rejected: int
    not_here: int
    abandoned: int
    trips: int
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None


class ProcessSnapshot(TypedDict):
    """One process of the fleet, as it last published itself (``processes[i]``)."""

    process: ProcessInfo
    this_process: bool
    published_at: float
    age_s: float
    uptime_s: float
    tasks: PoolTaskStats
    workers: list[ProcessWorkerStats]


class FleetWorkerTotals(TypedDict):
    """One worker over every process (``totals["workers"][j]``)."""

    id: str
    processes: int
    in_flight: int
    capacity: int
    attempts: int
    succeeded: int
    failed: int
    rejected: int
    not_here: int
    abandoned: int
    trips: int
    p99_ms: float | None  # the highest of the processes'
    open_in: int
    half_open_in: int
    unhealthy_in: int


class FleetTotals(TypedDict):
    """Sums over the processes of the fleet (``stats(scope="fleet")["totals"]``)."""

    processes: int
    hosts: int
    tasks: PoolTaskStats
    workers: list[FleetWorkerTotals]


class TaskHistory(TypedDict):
    """Tasks per step (``history["tasks"]``)."""

    succeeded: list[int | None]
    failed: list[int | None]


class WorkerHistory(TypedDict):
    """One worker's last minutes, one entry per step (``history["workers"][j]``)."""

    id: str
    succeeded: list[int | None]
    failed: list[int | None]
    p99_ms: list[float | None]
    breaker: str  # one letter per step: c closed, h half-open, o open (or opened), - none


class HistoryDict(TypedDict):
    """The last minutes in steps of ``step_s`` seconds, oldest first; ``None`` (or ``-``)
    where no process sampled that step."""

    step_s: float
    points: int
    end_at: float | None  # epoch seconds of the newest step
    tasks: TaskHistory
    workers: list[WorkerHistory]


class HostTasks(TypedDict):
    """Tasks of a host's live processes (``hosts[i]["tasks"]``)."""

    succeeded: int
    failed: int
    in_flight: int
    waiting: int


class HostRow(TypedDict):
    """One host of the fleet (``hosts[i]``): its live processes summed."""

    host: str
    state: str  # "live", or "silent": every process of it stopped publishing
    this_host: bool
    processes: int  # live
    silent_processes: int  # stopped publishing without closing, within fleet.silent_for
    workers: int  # distinct workers its processes see
    workers_down: int  # of those, open, half-open or unhealthy in one of its processes
    tasks: HostTasks
    errors: int  # failed attempts, over its processes and workers
    last_seen: float  # epoch seconds: its newest snapshot
    silent_since: float | None  # when silent: when it last published


class SilentProcess(TypedDict):
    """A process that stopped publishing without closing its pool (``silent[i]``)."""

    id: str
    host: str
    pid: int
    last_seen: float  # epoch seconds: its last snapshot


class FleetSkipped(TypedDict):
    """Snapshots a fleet read left out (``skipped``), each counted and shown."""

    oversized: int  # over fleet.max_snapshot_bytes: not read
    malformed: int  # not JSON, another version, wrong types: read, refused
    unread: int  # beyond fleet.max_processes or the read's byte budget


class FleetStatsDict(TypedDict):
    """What :meth:`WorkerPool.stats` returns with ``scope="fleet"``."""

    scope: str  # "fleet"
    shared: bool
    available: bool
    note: str
    this_process: ProcessInfo
    totals: FleetTotals
    hosts: list[HostRow]
    processes: list[ProcessSnapshot]
    silent: list[SilentProcess]
    skipped: FleetSkipped
    read_at: float  # epoch seconds: when the snapshots shown were read
    history: HistoryDict
    local: PoolStatsDict
