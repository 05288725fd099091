"""A pool's last minutes, and the fleet view: every process's pool at once.

Each pool has a :class:`Monitor`. Its thread (``npu-sync-fleet``) samples the pool every
``interval`` seconds, on the multiples of the interval on the wall clock, so that the
samples of every process on every (NTP-synchronised) host fall in the same steps. A
sample keeps what happened during the step — per worker the attempts that succeeded and
failed, the p99 latency and the breaker state, and for the pool the tasks that
succeeded and failed — and the monitor keeps the last ``points`` samples: the charts of
the status page.

With shared state in Redis the monitor also publishes a compact snapshot of its pool
(per-worker counts, latency percentiles, breaker state, process id, host, start time,
and those samples) under a key that expires ``ttl`` seconds later.
``pool.stats(scope="fleet")`` reads every snapshot still there: a process that dies
stops publishing and drops out after ``ttl``; one that closes its pool withdraws its
snapshot at once. Without Redis the fleet view holds this process only, and says so.

A task pays nothing for any of this: the monitor reads ``stats()`` and ``workers()``
on its own thread once per interval, and only that thread writes to Redis.

The settings are the configuration's ``fleet:`` section (``FleetConfig``); each has an
environment variable that wins over its key when set (see docs/deployment.md):

- ``fleet.interval`` / ``NPU_SYNC_FLEET_INTERVAL``: seconds between samples (default 5);
- ``fleet.ttl`` / ``NPU_SYNC_FLEET_TTL``: seconds a snapshot outlives its process
  (default three times the interval);
- ``fleet.points`` / ``NPU_SYNC_FLEET_POINTS``: samples kept (default 120: ten minutes
  at 5 s);
- ``fleet.mode`` / ``NPU_SYNC_FLEET``: ``on`` (default), ``manual`` (no thread: call
  :meth:`Monitor.tick` yourself, as tests do) or ``off`` (no samples, nothing
  published).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

from npu_sync._clock import SYSTEM_CLOCK, Clock
from npu_sync._fleetview import SharedRead, host_rows, silent_process
from npu_sync._stats_types import (
    FleetSkipped,
    FleetStatsDict,
    FleetTotals,
    FleetWorkerTotals,
    HistoryDict,
    HostRow,
    PoolStatsDict,
    PoolTaskStats,
    ProcessInfo,
    ProcessSnapshot,
    ProcessWorkerStats,
    SilentProcess,
    WorkerHistory,
    WorkerRow,
)
from npu_sync.config import FleetConfig
from npu_sync.errors import ConfigError, scrub

if TYPE_CHECKING:
    from npu_sync._shared import SharedState
    from npu_sync.config import SharedStateConfig

__all__ = [
    "FleetSettings",
    "FleetView",
    "Monitor",
    "fleet_view",
    "merge_histories",
    "monitor_of",
    "parse_snapshot",
    "read_fleet",
]

log = logging.getLogger(__name__)

SNAPSHOT_VERSION = 1
"""Bumped when a snapshot's shape changes; readers skip versions they do not know."""

MODES = ("on", "manual", "off")

MAX_SNAPSHOT_BYTES = 512 * 1024
"""The default ``fleet.max_snapshot_bytes``: a process trims (or does not write) a larger
snapshot and a reader leaves one out unread (a pool of 20 workers with the default 120
points publishes some 40 KB, one of 64 some 130 KB)."""

MAX_FLEET_PROCESSES = 200
"""The default ``fleet.max_processes``: the fleet view lists at most this many
processes, the most recently published first; its note says how many more there are."""

SPREAD = 0.3
"""Each process samples and writes its snapshot this share of a step after the step
begins, at an offset of its own (stable, drawn from its id): the writes of many
processes are spread over the step instead of landing on Redis at one instant. Under
half a step, so that every sample still falls in its own step of the history."""

_MAX_NUMBER = 2**53  # above it a browser's JSON.parse loses digits: no real count gets there

Listener = Callable[[PoolStatsDict, list[WorkerRow]], None]
"""Called on the monitor's thread after each sample with what it read."""

_TASK_KEYS = (
    "submitted",
    "succeeded",
    "rejected",
    "failed",
    "fallbacks",
    "retries",
    "active",
    "in_flight",
    "waiting",
)
_LATER_TASK_KEYS = ("cancelled",)
"""Task counters added since the snapshot format's version: a process of an earlier
release publishes none of them (read as 0), so a rolling upgrade keeps its view."""
_ATTEMPT_KEYS = ("attempts", "succeeded", "failed", "rejected", "not_here", "abandoned")
_LETTERS = {"closed": "c", "half-open": "h", "open": "o"}
_SEVERITY = {"-": 0, "c": 1, "h": 2, "o": 3}


class _Pool(Protocol):
    def stats(self) -> PoolStatsDict: ...

    def workers(self) -> list[WorkerRow]: ...


# -- settings ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class FleetSettings:
    """How often a pool is sampled, how long its snapshot lives, how much is kept.
    Immutable, so thread-safe.

    Raises:
        ConfigError: a value out of range, naming it.
    """

    interval: float = 5.0
    ttl: float | None = None  # None: three times the interval
    points: int = 120
    mode: str = "on"
    timeout: float = 1.0
    cache: float | None = None  # None: the interval
    silent_for: float = 600.0
    max_processes: int = MAX_FLEET_PROCESSES
    max_snapshot_bytes: int = MAX_SNAPSHOT_BYTES

    def __post_init__(self) -> None:
        if not (isinstance(self.interval, (int, float)) and 0.05 <= self.interval <= 3600):
            raise ConfigError(
                f"fleet.interval: must be 0.05 to 3600 seconds, got {self.interval!r}"
            )
        if self.ttl is None:
            object.__setattr__(self, "ttl", 3.0 * self.interval)
        elif not (isinstance(self.ttl, (int, float)) and self.interval < self.ttl <= 86400):
            # A snapshot that expires before the next one is written would make a live
            # process blink in and out of the fleet.
            raise ConfigError(
                f"fleet.ttl: must be more than the interval ({self.interval:g} s) and at most "
                f"86400, got {self.ttl!r}"
            )
        if isinstance(self.points, bool) or not (
            isinstance(self.points, int) and 2 <= self.points <= 10_000
        ):
            raise ConfigError(
                f"fleet.points: must be a whole number 2 to 10000, got {self.points!r}"
            )
        if self.mode not in MODES:
            raise ConfigError(f"fleet.mode: must be one of {', '.join(MODES)}, got {self.mode!r}")
        for key, lo, hi in (("timeout", 0.05, 30), ("silent_for", 0, 86400)):
            value = getattr(self, key)
            if isinstance(value, bool) or not (
                isinstance(value, (int, float)) and lo <= value <= hi
            ):
                raise ConfigError(f"fleet.{key}: must be {lo:g} to {hi:g} seconds, got {value!r}")
        if self.cache is not None and (
            isinstance(self.cache, bool)
            or not (isinstance(self.cache, (int, float)) and 0 <= self.cache <= 3600)
        ):
            raise ConfigError(f"fleet.cache: must be 0 to 3600 seconds or null, got {self.cache!r}")
        for key, lo, hi in (
            ("max_processes", 1, 5000),
            ("max_snapshot_bytes", 16 * 1024, 8 * 1024 * 1024),
        ):
            value = getattr(self, key)
            if isinstance(value, bool) or not (isinstance(value, int) and lo <= value <= hi):
                raise ConfigError(
                    f"fleet.{key}: must be a whole number {lo} to {hi}, got {value!r}"
                )

    @property
    def expiry(self) -> float:
        """Seconds a snapshot lives (``ttl``, filled in)."""
        return self.ttl if self.ttl is not None else 3.0 * self.interval

    @property
    def view_cache(self) -> float:
        """Seconds one read of the fleet serves (``cache``, filled in)."""
        return self.cache if self.cache is not None else self.interval

    @property
    def retention(self) -> float:
        """Seconds an index entry is kept after its process last published: its life,
        then ``silent_for`` listed as silent."""
        return self.expiry + self.silent_for

    @property
    def read_budget(self) -> int:
        """Bytes one read of the fleet may take in all: the listed processes at a
        typical size (a tenth of the cap each), and never less than eight at the cap."""
        return max(8 * self.max_snapshot_bytes, self.max_processes * self.max_snapshot_bytes // 10)

    @classmethod
    def from_config(cls, config: FleetConfig, env: Mapping[str, str]) -> FleetSettings:
        """The ``fleet:`` section of the configuration, with any ``NPU_SYNC_FLEET*``
        variable in ``env`` taking precedence over its key.

        Raises:
            ConfigError: a variable's value is unusable, naming the variable.
        """
        base = {
            "interval": config.interval,
            "ttl": config.ttl,
            "points": config.points,
            "mode": config.mode,
            "timeout": config.timeout,
            "cache": config.cache,
            "silent_for": config.silent_for,
            "max_processes": config.max_processes,
            "max_snapshot_bytes": config.max_snapshot_bytes,
        }
        return cls.from_env(env, base)

    @classmethod
    def from_env(
        cls, env: Mapping[str, str], base: Mapping[str, Any] | None = None
    ) -> FleetSettings:
        """Settings from ``NPU_SYNC_FLEET_*`` variables over ``base`` (defaults for those
        in neither).

        Raises:
            ConfigError: a variable's value is unusable, naming the variable.
        """
        fields: dict[str, Any] = dict(base or {})
        for name, field, parse in (
            ("NPU_SYNC_FLEET_INTERVAL", "interval", float),
            ("NPU_SYNC_FLEET_TTL", "ttl", float),
            ("NPU_SYNC_FLEET_POINTS", "points", int),
            ("NPU_SYNC_FLEET", "mode", str.lower),
        ):
            raw = env.get(name, "").strip()
            if not raw:
                continue
            try:
                value = parse(raw)
            except ValueError:
                raise ConfigError(f"{name}: not a number, got {raw!r}") from None
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{name}: not a finite number, got {raw!r}")
            fields[field] = value
        try:
            return cls(**fields)
        except ConfigError as exc:
            # Name the variable the operator set, not the future YAML key.
            message = exc.errors[0]
            for name, field in (
                ("NPU_SYNC_FLEET_INTERVAL", "interval"),
                ("NPU_SYNC_FLEET_TTL", "ttl"),
                ("NPU_SYNC_FLEET_POINTS", "points"),
                ("NPU_SYNC_FLEET", "mode"),
            ):
                message = message.replace(f"fleet.{field}:", f"{name}:")
            raise ConfigError(message) from None


# -- history -----------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class _Step:
    """What happened during one step: per worker [succeeded, failed, p99_ms, letter]."""

    tasks_succeeded: int = 0
    tasks_failed: int = 0
    workers: dict[str, list[Any]] = dataclasses.field(default_factory=dict)


class _History:
    """The last ``points`` steps of one pool. Not thread-safe: the monitor's lock guards it."""

    def __init__(self, step: float, points: int) -> None:
        self.step = step
        self.points = points
        self._steps: dict[int, _Step] = {}
        self._newest: int | None = None
        self._order: list[str] = []
        # Counters as last read: each sample records the difference.
        self._tasks: tuple[int, int] = (0, 0)
        self._seen: dict[str, tuple[int, int]] = {}
        self._trips: dict[str, int] | None = None  # None: nothing read yet

    def record(self, now: float, stats: PoolStatsDict, rows: Sequence[WorkerRow]) -> None:
        bucket = round(now / self.step)
        if self._newest is not None and bucket < self._newest - 1:
            # The wall clock was set back (after a jump ahead, say): move the history
            # back with it, or every sample would pile into one step, ahead of the
            # present and of every other process, until the clock caught up.
            shift = self._newest - bucket
            self._steps = {b - shift: step for b, step in self._steps.items()}
            self._newest = bucket
        elif self._newest is not None and bucket < self._newest:
            bucket = self._newest  # a step back within a step is jitter: add to the newest
        step = self._steps.get(bucket)
        if step is None:
            step = self._steps[bucket] = _Step()
        tasks = stats["tasks"]
        ok, failed = tasks["succeeded"], tasks["failed"]
        step.tasks_succeeded += _delta(ok, self._tasks[0])
        step.tasks_failed += _delta(failed, self._tasks[1])
        self._tasks = (ok, failed)
        first = self._trips is None
        trips = self._trips if self._trips is not None else {}
        order = []
        for row in rows:
            if row["removed"]:
                continue
            wid = row["id"]
            order.append(wid)
            counts = row["tasks"]
            before = self._seen.get(wid, (0, 0))
            d_ok = _delta(counts["succeeded"], before[0])
            d_failed = _delta(counts["failed"], before[1])
            self._seen[wid] = (counts["succeeded"], counts["failed"])
            breaker = row["breaker"]
            # Trips before the first sample are not this history's (after a fork they
            # are the parent's), so they mark nothing.
            tripped = not first and _delta(breaker["trips"], trips.get(wid, 0)) > 0
            trips[wid] = breaker["trips"]
            letter = "o" if tripped else _LETTERS.get(breaker["state"], "c")
            p99 = row["latency"]["p99_ms"] if d_ok + d_failed else None
            cell = step.workers.get(wid)
            if cell is None:
                step.workers[wid] = [d_ok, d_failed, _round(p99), letter]
            else:  # a second sample in one step (a tick by hand): add it up
                cell[0] += d_ok
                cell[1] += d_failed
                cell[2] = _max(cell[2], _round(p99))
                cell[3] = _worst(cell[3], letter)
        self._trips = trips
        self._order = order
        self._newest = bucket
        for old in [b for b in self._steps if b <= bucket - self.points]:
            del self._steps[old]

    def export(self) -> HistoryDict:
        n = self.points
        if self._newest is None:
            return _empty_history(self.step, n)
        first = self._newest - n + 1
        steps = [self._steps.get(b) for b in range(first, self._newest + 1)]
        ids = list(self._order)
        for step in steps:
            if step is not None:
                ids += [wid for wid in step.workers if wid not in ids]
        workers: list[WorkerHistory] = []
        for wid in ids:
            cells = [None if s is None else s.workers.get(wid) for s in steps]
            workers.append(
                {
                    "id": wid,
                    "succeeded": [None if c is None else c[0] for c in cells],
                    "failed": [None if c is None else c[1] for c in cells],
                    "p99_ms": [None if c is None else c[2] for c in cells],
                    "breaker": "".join("-" if c is None else c[3] for c in cells),
                }
            )
        return {
            "step_s": self.step,
            "points": n,
            "end_at": self._newest * self.step,
            "tasks": {
                "succeeded": [None if s is None else s.tasks_succeeded for s in steps],
                "failed": [None if s is None else s.tasks_failed for s in steps],
            },
            "workers": workers,
        }


def _delta(now: int, before: int) -> int:
    # A counter below its last reading started again (a worker removed and added back).
    return now - before if now >= before else now


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _max(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else max(a, b)


def _worst(a: str, b: str) -> str:
    return a if _SEVERITY.get(a, 0) >= _SEVERITY.get(b, 0) else b


def _empty_history(step: float, points: int) -> HistoryDict:
    nothing: list[Any] = [None] * points
    return {
        "step_s": step,
        "points": points,
        "end_at": None,
        "tasks": {"succeeded": list(nothing), "failed": list(nothing)},
        "workers": [],
    }


def merge_histories(
    histories: Iterable[HistoryDict], *, step: float, points: int, end_at: float | None
) -> HistoryDict:
    """The histories of several processes as one: counts summed per step, the highest
    p99, the worst breaker state. Histories in another step size are left out.

    Args:
        histories: the processes' histories.
        step: the step size in seconds.
        points: how many steps the result has.
        end_at: the newest step of the result (epoch seconds); None: the newest of any.
    """
    usable = [h for h in histories if h["end_at"] is not None and math.isclose(h["step_s"], step)]
    if end_at is None:
        ends = [h["end_at"] for h in usable if h["end_at"] is not None]
        if not ends:
            return _empty_history(step, points)
        end_at = max(ends)
    ok: list[int | None] = [None] * points
    failed: list[int | None] = [None] * points
    per_worker: dict[str, WorkerHistory] = {}
    for h in usable:
        assert h["end_at"] is not None
        shift = round((end_at - h["end_at"]) / step)
        length = h["points"]

        # Index i of this history is index i - offset of the result; only the steps
        # that fall inside the result are walked.
        offset = (length - points) + shift
        first, last = max(0, offset), min(length, points + offset)
        succeeded, failures = h["tasks"]["succeeded"], h["tasks"]["failed"]
        for i in range(first, min(last, len(succeeded), len(failures))):
            j = i - offset
            s, f = succeeded[i], failures[i]
            if s is not None:
                ok[j] = s if ok[j] is None else ok[j] + s  # type: ignore[operator]
            if f is not None:
                failed[j] = f if failed[j] is None else failed[j] + f  # type: ignore[operator]
        for series in h["workers"]:
            wid = series["id"]
            merged = per_worker.get(wid)
            if merged is None:
                merged = per_worker[wid] = {
                    "id": wid,
                    "succeeded": [None] * points,
                    "failed": [None] * points,
                    "p99_ms": [None] * points,
                    "breaker": "-" * points,
                }
            letters = list(merged["breaker"])
            m_ok, m_failed, m_p99 = merged["succeeded"], merged["failed"], merged["p99_ms"]
            s_ok, s_failed, s_p99 = series["succeeded"], series["failed"], series["p99_ms"]
            s_letters = series["breaker"]
            for i in range(first, min(last, len(s_letters))):
                j = i - offset
                v = s_ok[i]
                if v is not None:
                    m_ok[j] = v if m_ok[j] is None else m_ok[j] + v  # type: ignore[operator]
                v = s_failed[i]
                if v is not None:
                    m_failed[j] = v if m_failed[j] is None else m_failed[j] + v  # type: ignore[operator]
                p = s_p99[i]
                if p is not None and (m_p99[j] is None or p > m_p99[j]):  # type: ignore[operator]
                    m_p99[j] = p
                letter = s_letters[i]
                if letter != letters[j] and _SEVERITY.get(letter, 0) > _SEVERITY.get(letters[j], 0):
                    letters[j] = letter
            merged["breaker"] = "".join(letters)
    return {
        "step_s": step,
        "points": points,
        "end_at": end_at,
        "tasks": {"succeeded": ok, "failed": failed},
        "workers": list(per_worker.values()),
    }


# -- snapshots ---------------------------------------------------------------------------


def _process_info(now: float) -> ProcessInfo:
    host = socket.gethostname()
    pid = os.getpid()
    # The random part keeps a pid reused after a restart (or in another container with
    # the same host name) from being taken for the old process.
    return {
        "id": f"{host}:{pid}:{secrets.token_hex(4)}",
        "pid": pid,
        "host": host,
        "started_at": now,
    }


def _worker_stats(row: WorkerRow) -> ProcessWorkerStats:
    tasks = row["tasks"]
    latency = row["latency"]
    return {
        "id": row["id"],
        "breaker": row["breaker"]["state"],
        "healthy": row["healthy"],
        "in_flight": row["in_flight"],
        "capacity": row["capacity"],
        "attempts": tasks["attempts"],
        "succeeded": tasks["succeeded"],
        "failed": tasks["failed"],
        "rejected": tasks["rejected"],
        "not_here": tasks["not_here"],
        "abandoned": tasks["abandoned"],
        "trips": row["breaker"]["trips"],
        "p50_ms": _round(latency["p50_ms"]),
        "p95_ms": _round(latency["p95_ms"]),
        "p99_ms": _round(latency["p99_ms"]),
    }


def parse_snapshot(text: str) -> dict[str, Any] | None:
    """A snapshot another process published, checked; None if unreadable or of an
    unknown version (another release of npu_sync may share the namespace)."""
    try:
        # NaN and Infinity (or 1e400) would reach the JSON endpoints, which a browser's
        # JSON.parse refuses: one such snapshot would blank every status page.
        data = json.loads(text, parse_float=_finite, parse_constant=_not_a_number)
        if not isinstance(data, dict) or data.get("v") != SNAPSHOT_VERSION:
            return None
        process = data["process"]
        _check(process, {"id": str, "pid": int, "host": str, "started_at": float})
        _check(data, {"published_at": float, "uptime_s": float})
        _check(data["tasks"], dict.fromkeys(_TASK_KEYS, int))
        for key in _LATER_TASK_KEYS:
            data["tasks"].setdefault(key, 0)
        _check(data["tasks"], dict.fromkeys(_LATER_TASK_KEYS, int))
        workers = data["workers"]
        if not isinstance(workers, list):
            return None
        for row in workers:
            _check(row, {"id": str, "breaker": str, "healthy": bool, "in_flight": int})
            _check(row, {"capacity": int, "trips": int, **dict.fromkeys(_ATTEMPT_KEYS, int)})
            for key in ("p50_ms", "p95_ms", "p99_ms"):
                if row.get(key) is not None:
                    _check(row, {key: float})
        history = data["history"]
        _check(history, {"step_s": float, "points": int})
        if history["step_s"] <= 0 or not 1 <= history["points"] <= 10_000:
            return None
        if not (isinstance(history["tasks"], dict) and isinstance(history["workers"], list)):
            return None
        if history["end_at"] is not None:
            _check(history, {"end_at": float})
        points = history["points"]
        lists = [history["tasks"]["succeeded"], history["tasks"]["failed"]]
        for series in history["workers"]:
            _check(series, {"id": str, "breaker": str})
            lists += [series["succeeded"], series["failed"], series["p99_ms"]]
            if len(series["breaker"]) != points or not _BREAKER_LETTERS.issuperset(
                series["breaker"]
            ):
                return None
        for values in lists:
            if not isinstance(values, list) or len(values) != points or not _numbers(values):
                return None
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    return data


_BREAKER_LETTERS = frozenset(_SEVERITY)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {text}")
    return value


def _not_a_number(name: str) -> Any:
    raise ValueError(f"not a number: {name}")


def _numbers(values: list[Any]) -> bool:
    """Every value None or a :func:`_number`. Inline, since a fleet read checks some
    500,000 of them (64 processes x 20 workers x 3 series x 120 steps)."""
    for v in values:
        if v is None:
            continue
        kind = type(v)  # exact: a bool is not a count
        if (kind is not int and kind is not float) or not 0 <= v <= _MAX_NUMBER:
            return False
    return True


def _number(value: Any) -> bool:
    """A count, time or latency as a snapshot may hold it: never negative, never huge."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and 0 <= value <= _MAX_NUMBER
    )


def _check(value: Any, types: Mapping[str, type]) -> None:
    if not isinstance(value, dict):
        raise TypeError("not an object")
    for key, kind in types.items():
        item = value[key]
        if kind is float:
            ok = _number(item)
        elif kind is int:
            ok = isinstance(item, int) and _number(item)
        else:
            ok = isinstance(item, kind)
        if not ok:
            raise TypeError(f"{key}: not {kind.__name__}")


def _nothing_skipped() -> FleetSkipped:
    return {"oversized": 0, "malformed": 0, "unread": 0}


@dataclasses.dataclass(frozen=True)
class FleetView:
    """Every process's snapshot, summed up. Frozen; the lists in it are the caller's."""

    shared: bool
    available: bool
    note: str
    processes: list[ProcessSnapshot]
    totals: FleetTotals
    history: HistoryDict
    hosts: list[HostRow] = dataclasses.field(default_factory=list)
    silent: list[SilentProcess] = dataclasses.field(default_factory=list)
    skipped: FleetSkipped = dataclasses.field(default_factory=lambda: _nothing_skipped())
    read_at: float = 0.0


def fleet_view(
    snapshots: Iterable[dict[str, Any]],
    *,
    now: float,
    settings: FleetSettings,
    this_process: str | None = None,
    order: Sequence[str] = (),
    shared: bool,
    available: bool,
    note: str,
    end_at: float | None = None,
    silent: Sequence[SilentProcess] = (),
    skipped: FleetSkipped | None = None,
    this_host: str | None = None,
) -> FleetView:
    """Totals, per-host and per-process rows and merged history of checked snapshots.

    Args:
        snapshots: from :func:`parse_snapshot` (and this process's own).
        now: epoch seconds, for the age of each snapshot.
        settings: for the history's step and length.
        this_process: the id of the process answering, marked in its row.
        order: worker ids in the order to list them (the rest follow, sorted).
        shared, available, note: copied into the view.
        end_at: the newest step of the merged history (None: the newest of any).
        silent: processes that stopped publishing, listed under their hosts.
        skipped: snapshots left out, counted.
        this_host: the host of the process answering, marked in its row.
    """
    snaps = sorted(snapshots, key=lambda s: (s["process"]["host"], s["process"]["pid"]))
    processes: list[ProcessSnapshot] = []
    tasks = cast(PoolTaskStats, dict.fromkeys(_TASK_KEYS + _LATER_TASK_KEYS, 0))
    workers: dict[str, FleetWorkerTotals] = {}
    for snap in snaps:
        info: ProcessInfo = snap["process"]
        rows: list[ProcessWorkerStats] = snap["workers"]
        processes.append(
            {
                "process": info,
                "this_process": info["id"] == this_process,
                "published_at": snap["published_at"],
                "age_s": max(0.0, now - snap["published_at"]),
                "uptime_s": snap["uptime_s"],
                "tasks": snap["tasks"],
                "workers": rows,
            }
        )
        for key in _TASK_KEYS + _LATER_TASK_KEYS:
            tasks[key] += snap["tasks"][key]  # type: ignore[literal-required]
        for row in rows:
            total = workers.get(row["id"])
            if total is None:
                total = workers[row["id"]] = {
                    "id": row["id"],
                    "processes": 0,
                    "in_flight": 0,
                    "capacity": 0,
                    "attempts": 0,
                    "succeeded": 0,
                    "failed": 0,
                    "rejected": 0,
                    "not_here": 0,
                    "abandoned": 0,
                    "trips": 0,
                    "p99_ms": None,
                    "open_in": 0,
                    "half_open_in": 0,
                    "unhealthy_in": 0,
                }
            total["processes"] += 1
            for key in ("in_flight", "capacity", "trips", *_ATTEMPT_KEYS):
                total[key] += row[key]  # type: ignore[literal-required]
            total["p99_ms"] = _max(total["p99_ms"], row["p99_ms"])
            total["open_in"] += row["breaker"] == "open"
            total["half_open_in"] += row["breaker"] == "half-open"
            total["unhealthy_in"] += not row["healthy"]
    ranked = {wid: n for n, wid in enumerate(order)}
    listed = sorted(workers.values(), key=lambda w: (ranked.get(w["id"], len(ranked)), w["id"]))
    if end_at is None:
        # The newest step any process sampled, but not one ahead of the present by more
        # than a snapshot's life: a host whose clock runs far ahead (or a forged
        # snapshot) would otherwise push every other process out of the charts.
        ends = [
            s["history"]["end_at"]
            for s in snaps
            if s["history"]["end_at"] is not None
            and s["history"]["end_at"] <= now + settings.expiry
        ]
        end_at = max(ends) if ends else None
    history = merge_histories(
        (s["history"] for s in snaps),
        step=settings.interval,
        points=settings.points,
        end_at=end_at,
    )
    hist_rank = {w["id"]: n for n, w in enumerate(listed)}
    history["workers"].sort(key=lambda w: (hist_rank.get(w["id"], len(hist_rank)), w["id"]))
    return FleetView(
        shared=shared,
        available=available,
        note=note,
        processes=processes,
        totals={
            "processes": len(processes),
            "hosts": len({p["process"]["host"] for p in processes}),
            "tasks": tasks,
            "workers": listed,
        },
        history=history,
        hosts=host_rows(processes, silent, this_host=this_host),
        silent=list(silent),
        skipped=(skipped if skipped is not None else {"oversized": 0, "malformed": 0, "unread": 0}),
        read_at=now,
    )


def _collect(
    found: Mapping[str, Any], *, exclude: str | None = None
) -> tuple[list[dict[str, Any]], list[SilentProcess], FleetSkipped]:
    """The checked snapshots, the silent processes and what was left out, of one
    :meth:`SharedState.read_snapshots` result."""
    snapshots: list[dict[str, Any]] = []
    malformed = len(found["malformed"])
    for member, text in found["entries"]:
        if member == exclude:
            continue  # this process: its fresh snapshot instead of the last one
        parsed = parse_snapshot(text)
        if parsed is None:
            malformed += 1
            log.debug("fleet view: skipping an unreadable snapshot of %s", member)
        else:
            snapshots.append(parsed)
    silent = [silent_process(m, seen) for m, seen in found["silent"] if m != exclude]
    skipped: FleetSkipped = {
        "oversized": len(found["oversized"]),
        "malformed": malformed,
        "unread": int(found["unread"]),
    }
    return snapshots, silent, skipped


def _left_out(skipped: FleetSkipped, settings: FleetSettings) -> str:
    """The note's words for snapshots left out (empty when none was)."""
    parts = []
    if skipped["oversized"]:
        parts.append(
            f"{skipped['oversized']} over {settings.max_snapshot_bytes // 1024} KiB "
            "(fleet.max_snapshot_bytes)"
        )
    if skipped["malformed"]:
        parts.append(f"{skipped['malformed']} unreadable")
    text = f" Left out: {', '.join(parts)}." if parts else ""
    if skipped["unread"]:
        text += (
            f" {skipped['unread']} more not shown: the view lists the "
            f"{settings.max_processes} most recently published (fleet.max_processes)."
        )
    return text


def _counted(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else ('es' if word.endswith('s') else 's')}"


def _read(shared: SharedState, settings: FleetSettings) -> dict[str, Any] | None:
    return shared.read_snapshots(
        settings.retention,
        limit=settings.max_processes,
        max_bytes=settings.max_snapshot_bytes,
        budget=settings.read_budget,
    )


def read_fleet(
    config: SharedStateConfig,
    *,
    settings: FleetSettings | None = None,
    now: float | None = None,
) -> FleetView:
    """The fleet as another program sees it (``npu-sync status``): every snapshot in Redis
    under ``config.namespace``, without a pool of its own and without joining the fleet.

    Raises:
        ConfigError: Redis refused the credentials or the database number.
    """
    from npu_sync._shared import SharedState  # imports redis: only when asked for

    settings = settings if settings is not None else FleetSettings.from_env(os.environ)
    when = time.time() if now is None else now
    if config.backend != "redis":
        return fleet_view(
            [],
            now=when,
            settings=settings,
            shared=False,
            available=False,
            note=(
                "Not shared (shared_state.backend: none): each process reports only itself, "
                "on its own status endpoints."
            ),
        )
    shared = SharedState(config, lambda *change: None)
    shared.fleet_timeout = settings.timeout
    try:
        found = _read(shared, settings) if shared.available else None
        error = shared.fleet_stats()["last_error"] or shared.last_error
    finally:
        shared.stop()
    if found is None:
        return fleet_view(
            [],
            now=when,
            settings=settings,
            shared=True,
            available=False,
            note=f"Shared state unavailable ({scrub(str(error or 'no answer'))}).",
        )
    snapshots, silent, skipped = _collect(found)
    hosts = len({s["process"]["host"] for s in snapshots})
    count = len(snapshots)
    note = (
        f"{_counted(count, 'process')} on {_counted(hosts, 'host')} "
        f"publish to Redis namespace {config.namespace!r}"
        + ("" if count or silent or skipped["unread"] else ": none is running, or none sampled yet")
        + "."
        + (f" {len(silent)} silent (stopped publishing)." if silent else "")
        + _left_out(skipped, settings)
    )
    return fleet_view(
        snapshots,
        now=when,
        settings=settings,
        shared=True,
        available=True,
        note=note,
        silent=silent,
        skipped=skipped,
    )


# -- the monitor -------------------------------------------------------------------------


class Monitor:
    """Samples one pool on a timer: its history, its fleet snapshot, its listeners.

    Thread-safe. Holds the pool weakly: a pool dropped without ``close()`` lets the
    thread go. ``tick()`` takes one sample now (the thread calls it; tests may too).

    The thread starts with :meth:`start` when there is a fleet to publish to (``shared``)
    or the pool runs background work anyway (``eager``: its health checks); otherwise a
    pool with nothing to do in the background starts no thread until its history or the
    fleet view is first asked for, or a listener is added.

    Args:
        pool: the pool to sample (a :class:`npu_sync.WorkerPool`).
        shared: its shared state, to publish to; None without Redis.
        clock: the pool's clock (its ``time()`` stamps the samples).
        settings: default from the ``NPU_SYNC_FLEET_*`` environment variables.
        eager: start sampling with :meth:`start` even without shared state.

    Raises:
        ConfigError: an ``NPU_SYNC_FLEET_*`` variable is unusable.
    """

    def __init__(
        self,
        pool: _Pool,
        shared: SharedState | None,
        *,
        clock: Clock = SYSTEM_CLOCK,
        settings: FleetSettings | None = None,
        eager: bool = True,
    ) -> None:
        self.settings = settings if settings is not None else FleetSettings.from_env(os.environ)
        self._wanted = eager or shared is not None
        self._pool = weakref.ref(pool)
        self._shared = shared
        self._clock = clock
        self._listeners: tuple[Listener, ...] = ()
        self._thread: threading.Thread | None = None
        if shared is not None:
            shared.fleet_timeout = self.settings.timeout
        self._fresh(pool)
        _monitors[pool] = self

    def _fresh(self, pool: _Pool) -> None:
        """State of a new process: its own identity, history, lock and stop event."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # A pool collected without close() wakes the thread, which then ends.
        self._finalizer = weakref.finalize(pool, self._stop.set)
        self._process = _process_info(self._clock.time())
        self._history = _History(self.settings.interval, self.settings.points)
        self._published = False
        self._too_big_logged = False
        self.ticks = 0
        self.oversized = 0
        """Snapshots of this pool too large to publish whole (trimmed or not written)."""
        digest = int.from_bytes(hashlib.sha256(self._process["id"].encode()).digest()[:4], "big")
        self.offset = SPREAD * self.settings.interval * digest / 2**32
        """Seconds after each step begins that this process samples and publishes."""
        # One read and merge of the fleet serves every reader for `fleet.cache` seconds.
        self._view: SharedRead[FleetView] = SharedRead(
            self._read_view, self.settings.view_cache, clock=self._clock.monotonic
        )
        # The last view merged from a successful read: shown, aged, when a read fails
        # while Redis is up. A merged view, not the snapshots: it holds no histories.
        self._last_good: FleetView | None = None

    @property
    def process(self) -> ProcessInfo:
        """Which process (and pool) this is."""
        return dict(self._process)  # type: ignore[return-value]

    def start(self) -> None:
        """Start the sampling thread, if it is wanted yet (unless the mode is ``manual``
        or ``off``). Idempotent; does nothing once stopped."""
        if self.settings.mode != "on" or not self._wanted:
            return
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(target=self._run, name="npu-sync-fleet", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread and withdraw this process from the fleet. Idempotent."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        self._withdraw()

    def _withdraw(self) -> None:
        """Take this process's snapshot out of the fleet, if it is in."""
        with self._lock:
            published, self._published = self._published, False
        if published and self._shared is not None and self._shared.available:
            self._shared.withdraw_snapshot(self._process["id"])

    def after_fork(self) -> None:
        """In a child process: a process of its own, with an empty history; the thread
        starts again with :meth:`start` (the pool calls it on first use)."""
        pool = self._pool()
        self._finalizer.detach()
        self._thread = None
        if pool is not None:
            self._fresh(pool)

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(stats, workers)`` on the monitor's thread after every sample."""
        with self._lock:
            self._listeners = (*self._listeners, listener)
        self._want()

    def _want(self) -> None:
        """Somebody looks at this pool's history: sample from now on."""
        if not self._wanted:
            self._wanted = True
            self.start()

    def remove_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners = tuple(x for x in self._listeners if x is not listener)

    def _run(self) -> None:
        while True:
            if self._stop.wait(self.next_delay(self._clock.time())):
                return
            try:
                self.tick()
            except Exception:  # the thread must outlive one bad sample
                log.exception("fleet monitor: could not sample the pool")

    def next_delay(self, now: float) -> float:
        """Seconds from ``now`` (epoch) to this process's next sample: its offset into
        the next step. Every process samples the same steps, each at its own instant
        within them, so their snapshots do not reach Redis all at once."""
        step = self.settings.interval
        delay = step - ((now - self.offset) % step)
        if delay < step * 0.01:
            delay += step
        return delay

    def tick(self) -> None:
        """Sample the pool now: record a step, publish the snapshot, call the listeners."""
        if self.settings.mode == "off":
            return
        pool = self._pool()
        if pool is None:
            return
        stats = pool.stats()
        rows = pool.workers()
        now = self._clock.time()
        with self._lock:
            self._history.record(now, stats, rows)
            snapshot = self._snapshot(stats, rows, now)
            listeners = self._listeners
            self.ticks += 1
        shared = self._shared
        if shared is not None and shared.available and not self._stop.is_set():
            payload = self._payload(snapshot)
            if payload is not None and shared.publish_snapshot(
                self._process["id"], payload, self.settings.expiry
            ):
                with self._lock:
                    self._published = True
                if self._stop.is_set():
                    # stop() ran while Redis was answering: the snapshot that just landed
                    # would keep a closed pool in the fleet for its TTL.
                    self._withdraw()
        for listener in listeners:
            try:
                listener(stats, rows)
            except Exception:
                log.exception("fleet monitor: a listener failed")

    def _payload(self, snapshot: dict[str, Any]) -> str | None:
        """The snapshot as written, within ``fleet.max_snapshot_bytes``: whole, else
        without its per-worker history (the counts and the fleet's task history stay),
        else None (not written: readers would leave it out anyway)."""
        cap = self.settings.max_snapshot_bytes
        payload = json.dumps(snapshot, separators=(",", ":"))
        if len(payload) <= cap:
            return payload
        trimmed = {**snapshot, "history": {**snapshot["history"], "workers": []}}
        smaller = json.dumps(trimmed, separators=(",", ":"))
        fits = len(smaller) <= cap
        with self._lock:
            self.oversized += 1
            first, self._too_big_logged = not self._too_big_logged, True
        if first:
            log.warning(
                "fleet monitor: this pool's snapshot is %d bytes, more than "
                "fleet.max_snapshot_bytes (%d): %s; lower fleet.points or raise "
                "fleet.max_snapshot_bytes",
                len(payload),
                cap,
                "published without its per-worker history"
                if fits
                else "not published, so this process is missing from the fleet view",
            )
        return smaller if fits else None

    def _snapshot(
        self, stats: PoolStatsDict, rows: Sequence[WorkerRow], now: float
    ) -> dict[str, Any]:
        """Call with the lock held."""
        return {
            "v": SNAPSHOT_VERSION,
            "process": dict(self._process),
            "published_at": now,
            "uptime_s": stats["uptime_s"],
            "tasks": {
                **{key: stats["tasks"][key] for key in _TASK_KEYS},  # type: ignore[literal-required]
                **{key: stats["tasks"].get(key, 0) for key in _LATER_TASK_KEYS},
            },
            "workers": [_worker_stats(row) for row in rows if not row["removed"]],
            "history": self._history.export(),
        }

    def history(self) -> HistoryDict:
        """This process's history, as of its last sample."""
        self._want()
        with self._lock:
            return self._history.export()

    def fleet(self) -> FleetStatsDict:
        """What ``pool.stats(scope="fleet")`` returns: every live process's snapshot and
        the silent ones, per host, their totals and merged history, next to this
        process's ``stats()``.

        With shared state, the fleet is read from Redis and merged at most once per
        ``fleet.cache`` seconds (``read_at`` says when), whatever the number of callers;
        ``local`` is always fresh."""
        pool = self._pool()
        if pool is None:
            raise RuntimeError("the pool of this monitor is gone")
        self._want()
        if self._shared is None or self.settings.mode == "off":
            view = self._read_view()  # nothing to read from Redis: nothing to share
        else:
            view = self._view.get()
        if self._shared is not None and view.available and not self._shared.available:
            # Redis went away since that read: say so now, not an interval later.
            self._view.clear()
            view = self._view.get()
        return {
            "scope": "fleet",
            "shared": view.shared,
            "available": view.available,
            "note": view.note,
            "this_process": self.process,
            "totals": view.totals,
            "hosts": view.hosts,
            "processes": view.processes,
            "silent": view.silent,
            "skipped": view.skipped,
            "read_at": view.read_at,
            "history": view.history,
            "local": pool.stats(),
        }

    @property
    def reads(self) -> int:
        """How many times the fleet was read and merged for ``fleet()``."""
        return self._view.computed

    def _read_view(self) -> FleetView:
        """Read the fleet from Redis and merge it with this process's fresh snapshot."""
        pool = self._pool()
        if pool is None:
            raise RuntimeError("the pool of this monitor is gone")
        stats = pool.stats()
        rows = pool.workers()
        now = self._clock.time()
        with self._lock:
            mine = self._snapshot(stats, rows, now)
            end_at = mine["history"]["end_at"]
        me = self._process
        where = f"pid {me['pid']} on {me['host']}"
        others: list[dict[str, Any]] = []
        silent: list[SilentProcess] = []
        skipped: FleetSkipped | None = None
        shared = self._shared is not None and self.settings.mode != "off"
        available = False
        if self.settings.mode == "off":
            note = f"Fleet snapshots are off (NPU_SYNC_FLEET=off): this shows one process, {where}."
        elif self._shared is None:
            note = (
                f"One process only: {where}. Processes share nothing without Redis "
                "(shared_state.backend: redis), so each shows only itself."
            )
        else:
            found = _read(self._shared, self.settings) if self._shared.available else None
            last = self._last_good
            if found is None and self._shared.available and last is not None:
                # The read failed, Redis did not: show the last view read, aged.
                error = self._shared.fleet_stats()["last_error"] or "no answer"
                return dataclasses.replace(
                    last,
                    note=f"{last.note} The snapshots could not be read now ({scrub(error)}): "
                    f"these were read {max(0.0, now - last.read_at):.0f} s ago.",
                )
            if found is not None:
                others, silent, skipped = _collect(found, exclude=me["id"])
                # This process is always listed, in the place of the stalest other.
                keep = self.settings.max_processes - 1
                skipped["unread"] += max(0, len(others) - keep)
                del others[keep:]
            if found is None:
                error = scrub(
                    str(
                        self._shared.last_error
                        if not self._shared.available
                        else self._shared.fleet_stats()["last_error"] or "no answer"
                    )
                )
                what = (
                    "Shared state unavailable"
                    if not self._shared.available
                    else ("Fleet snapshots could not be read")
                )
                note = f"{what} ({error}): this shows one process, {where}."
            else:
                available = True
                count = 1 + len(others)
                hosts = len({me["host"], *(o["process"]["host"] for o in others)})
                note = (
                    f"{_counted(count, 'process')} on {_counted(hosts, 'host')}, answered by "
                    f"{where}; snapshots every {self.settings.interval:g} s, silent "
                    f"{self.settings.expiry:g} s after a process stops publishing, gone "
                    f"{self.settings.silent_for:g} s later."
                    + (f" {len(silent)} silent." if silent else "")
                    + (_left_out(skipped, self.settings) if skipped is not None else "")
                )
        view = fleet_view(
            [mine, *others],
            now=now,
            settings=self.settings,
            this_process=me["id"],
            order=[r["id"] for r in rows],
            shared=shared,
            available=available,
            note=note,
            end_at=end_at,
            silent=silent,
            skipped=skipped,
            this_host=me["host"],
        )
        if available:
            self._last_good = view
        return view


_monitors: weakref.WeakKeyDictionary[Any, Monitor] = weakref.WeakKeyDictionary()


def monitor_of(pool: object) -> Monitor | None:
    """The monitor of a pool, if it has one (every :class:`npu_sync.WorkerPool` does)."""
    return _monitors.get(pool)
