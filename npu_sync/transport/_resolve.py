"""Name resolution that never outlives the caller's budget.

``socket.getaddrinfo`` blocks for as long as the system resolver takes (seconds, on a
bad day) and cannot be interrupted. :class:`BoundedResolver` runs each lookup on a
daemon thread of its own and lets the caller wait only as long as its budget allows; a
lookup that outlives its caller still finishes and fills the cache for the next one.
Callers asking for the same name share one lookup, so a slow resolver cannot pile up
a thread per caller, and answers are cached for a few seconds, so a pool opening
connections in a burst asks once. IP literals never reach the resolver at all.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

AddrInfo = tuple[int, int, int, str, tuple[Any, ...]]
"""One ``getaddrinfo`` result: family, type, proto, canonical name, socket address."""

Lookup = Callable[[str, int], Sequence[AddrInfo]]
"""A blocking lookup of ``(host, port)``, like ``socket.getaddrinfo``; raises OSError."""

# Successful answers are reused this long: worker addresses rarely move, and a pool
# opening connections in bursts would otherwise ask the system resolver every time.
DEFAULT_TTL = 10.0
# The cache holds a pool's worker names; this bound only stops unbounded growth.
_CACHE_MAX = 256


class ResolveTimeout(Exception):
    """The lookup did not answer within the caller's budget."""


class ResolveError(Exception):
    """The lookup failed (no such name, resolver error); ``cause`` is the OSError."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def system_lookup(host: str, port: int) -> list[AddrInfo]:
    """``socket.getaddrinfo`` for TCP, looked up at call time (so tests may patch it)."""
    return [
        (int(family), int(kind), proto, name, tuple(address))
        for family, kind, proto, name, address in socket.getaddrinfo(
            host, port, 0, socket.SOCK_STREAM
        )
    ]


def ip_literal(host: str, port: int) -> list[AddrInfo] | None:
    """The one address of an IPv4 or IPv6 literal, or None for a name."""
    try:
        socket.inet_pton(socket.AF_INET, host)
    except OSError:
        pass
    else:
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (host, port))]
    if ":" in host:
        try:
            socket.inet_pton(socket.AF_INET6, host)
        except OSError:
            return None
        return [(socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (host, port, 0, 0))]
    return None


class _Job:
    __slots__ = ("done", "error", "key", "result")

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.done = threading.Event()
        self.result: list[AddrInfo] = []
        self.error: BaseException | None = None


class BoundedResolver:
    """Resolves host names on daemon threads, waiting no longer than a deadline.

    Thread-safe. A lookup thread ends as soon as its lookup does. Survives ``fork()``:
    the child starts with no lookups in flight (the cache is kept).

    Args:
        lookup: the blocking lookup to run; ``socket.getaddrinfo`` by default.
        ttl: seconds a successful answer is reused. Failures are not cached.
        clock: monotonic clock, for the cache.
    """

    def __init__(
        self,
        lookup: Lookup | None = None,
        *,
        ttl: float = DEFAULT_TTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lookup: Lookup = lookup if lookup is not None else system_lookup
        self._ttl = ttl
        self._clock = clock
        self._cache: dict[tuple[str, int], tuple[float, list[AddrInfo]]] = {}
        self._reset()
        _live.add(self)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._inflight: dict[tuple[str, int], _Job] = {}

    def resolve(self, host: str, port: int, deadline: float) -> list[AddrInfo]:
        """The addresses of ``host``, waiting at most until ``deadline`` (monotonic).

        Raises:
            ResolveTimeout: no answer before the deadline.
            ResolveError: the lookup failed.
        """
        literal = ip_literal(host, port)
        if literal is not None:
            return literal
        key = (host, port)
        now = self._clock()
        start = False
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] > now:
                return hit[1]
            job = self._inflight.get(key)
            if job is None:
                job = self._inflight[key] = _Job(key)
                start = True
        if start:
            threading.Thread(
                target=self._run, args=(job,), name="npu-sync-resolver", daemon=True
            ).start()
        if not job.done.wait(max(0.0, deadline - now)):
            raise ResolveTimeout(f"looking up {host!r} took longer than the time left")
        if job.error is not None:
            raise ResolveError(job.error)
        return job.result

    def _run(self, job: _Job) -> None:
        try:
            result = list(self._lookup(*job.key))
            if not result:
                raise socket.gaierror(socket.EAI_NONAME, "no addresses")
        except BaseException as exc:  # whatever the lookup raised goes to the caller
            job.error = exc
        else:
            job.result = result
        with self._lock:
            if self._inflight.get(job.key) is job:
                del self._inflight[job.key]
            if job.error is None:
                if len(self._cache) >= _CACHE_MAX:
                    self._cache.clear()
                self._cache[job.key] = (self._clock() + self._ttl, job.result)
        job.done.set()

    def forget(self) -> None:
        """Drop every cached answer."""
        with self._lock:
            self._cache.clear()


_live: weakref.WeakSet[BoundedResolver] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for resolver in list(_live):
        resolver._reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

default_resolver = BoundedResolver()
"""Shared by every transport built without a lookup of its own."""
