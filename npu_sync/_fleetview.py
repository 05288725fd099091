"""The fleet view's shape and cost: one read shared by every reader, rows per host.

Two small pieces :mod:`npu_sync._fleet` composes:

- :class:`SharedRead` computes a value at most once per interval however many threads
  ask for it; a caller arriving while it is being computed waits for that computation
  instead of starting another. Every status page, ``GET /fleet`` and
  ``stats(scope="fleet")`` of a process thus costs one Redis read and one merge per
  interval, not one per request.
- :func:`host_rows` sums the processes of the fleet per host (processes, the workers
  they see, tasks, errors) and keeps a host whose processes all went silent, with the
  time they did, instead of letting it vanish.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

from npu_sync._stats_types import HostRow, ProcessSnapshot, SilentProcess

__all__ = ["SharedRead", "host_rows", "silent_process"]

T = TypeVar("T")


class SharedRead(Generic[T]):
    """A value computed at most once per ``interval`` seconds, shared by every caller.
    Thread-safe.

    No lock is held while ``compute`` runs (it does I/O). A caller that finds a
    computation under way waits for it and takes its result; if that computation
    raises, the waiting callers try again themselves, one at a time.

    Args:
        compute: makes a fresh value (called on the thread of one caller).
        interval: seconds a value serves; 0: every caller not overlapping another
            computes afresh.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        compute: Callable[[], T],
        interval: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._compute = compute
        self.interval = interval
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._value: T | None = None
        self._at: float | None = None
        self._running = False
        self._generation = 0
        self.computed = 0
        """How many times ``compute`` ran (for stats and tests)."""

    def get(self) -> T:
        """The value, computed now if the last one is older than the interval."""
        with self._cond:
            while True:
                if self._value is not None and self._fresh():
                    return self._value
                if not self._running:
                    break
                generation = self._generation
                while self._running and self._generation == generation:
                    self._cond.wait()
                if self._generation != generation and self._value is not None:
                    return self._value  # computed while this caller waited: share it
                # The computation failed: try again, one caller at a time.
            self._running = True
        try:
            value = self._compute()
        except BaseException:
            with self._cond:
                self._running = False
                self._cond.notify_all()
            raise
        with self._cond:
            self._value, self._at = value, self._clock()
            self._running = False
            self._generation += 1
            self.computed += 1
            self._cond.notify_all()
        return value

    def _fresh(self) -> bool:
        return self._at is not None and self._clock() - self._at < self.interval

    def age(self) -> float | None:
        """Seconds since the value was computed; None before the first."""
        with self._cond:
            return None if self._at is None else max(0.0, self._clock() - self._at)

    def clear(self) -> None:
        """Forget the value (the next caller computes)."""
        with self._cond:
            self._value = None
            self._at = None


def silent_process(member: str, last_seen: float) -> SilentProcess:
    """A process listed in the fleet's index whose snapshot expired: ``member`` is its
    id, ``<host>:<pid>:<random>``."""
    host, pid = member, 0
    parts = member.rsplit(":", 2)
    if len(parts) == 3:
        host = parts[0]
        pid = int(parts[1]) if parts[1].isdigit() and len(parts[1]) < 10 else 0
    return {"id": member, "host": host, "pid": pid, "last_seen": last_seen}


def host_rows(
    processes: Sequence[ProcessSnapshot],
    silent: Iterable[SilentProcess],
    *,
    this_host: str | None = None,
) -> list[HostRow]:
    """One row per host: its live processes summed, and its silent ones counted.

    A host with no live process left is ``"silent"``, ``silent_since`` the last time
    one of its processes published. Rows come live first, then by host name.
    """
    rows: dict[str, HostRow] = {}
    seen: dict[str, set[str]] = {}
    down: dict[str, set[str]] = {}

    def row(host: str) -> HostRow:
        found = rows.get(host)
        if found is None:
            found = rows[host] = {
                "host": host,
                "state": "silent",
                "this_host": host == this_host,
                "processes": 0,
                "silent_processes": 0,
                "workers": 0,
                "workers_down": 0,
                "tasks": {"succeeded": 0, "failed": 0, "in_flight": 0, "waiting": 0},
                "errors": 0,
                "last_seen": 0.0,
                "silent_since": None,
            }
            seen[host] = set()
            down[host] = set()
        return found

    for p in processes:
        host = p["process"]["host"]
        r = row(host)
        r["state"] = "live"
        r["processes"] += 1
        r["last_seen"] = max(r["last_seen"], p["published_at"])
        tasks = p["tasks"]
        mine = r["tasks"]
        mine["succeeded"] += tasks["succeeded"]
        mine["failed"] += tasks["failed"]
        mine["in_flight"] += tasks["in_flight"]
        mine["waiting"] += tasks["waiting"]
        for w in p["workers"]:
            seen[host].add(w["id"])
            r["errors"] += w["failed"]
            if w["breaker"] != "closed" or not w["healthy"]:
                down[host].add(w["id"])
    for s in silent:
        r = row(s["host"])
        r["silent_processes"] += 1
        if r["state"] == "silent":
            r["last_seen"] = max(r["last_seen"], s["last_seen"])
    for host, r in rows.items():
        r["workers"] = len(seen[host])
        r["workers_down"] = len(down[host])
        if r["state"] == "silent":
            r["silent_since"] = r["last_seen"]
    return sorted(rows.values(), key=lambda r: (r["state"] != "live", r["host"]))
