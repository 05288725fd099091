"""Idle keep-alive connections across all of a pool's transports: a total cap and a reaper.

A transport keeps at most ``maxsize`` idle connections to its worker, and before this
module it looked at them only when a request came: a worker that stopped getting tasks
(it failed over, its breaker opened, it was drained) kept its idle connections open
for as long as the pool ran, even after the worker had closed its end. Across many
workers that grows until the process runs out of descriptors.

Two rules, as Go's ``net/http`` (``MaxIdleConns``, ``IdleConnTimeout``) and Envoy's
``idle_timeout`` have them:

* :class:`IdleBudget`: at most ``transport.max_idle_connections`` idle connections
  over *all* the pool's transports. A connection released when the budget is spent is
  closed instead of kept.
* :class:`IdleReaper`: every second (sooner with a short ``idle_timeout``) a sweep
  closes the idle connections older than ``idle_timeout`` and those the worker
  closed or reset (one ``getsockopt(TCP_INFO)`` per idle connection; a zero-timeout
  ``poll()`` off Linux). It runs on the pool's health thread, and on the
  thread of any request that keeps a connection idle once the interval has passed,
  so it needs no thread of its own; it visits only transports holding idle
  connections, not all of a large fleet's.

A transport joins by declaring ``TransportFeatures(shares_idle=True)`` and having
``share_idle(budget)``: it then counts its idle connections against the budget, calls
``budget.holding(self, now)`` when it keeps one, and has ``reap(now) -> int`` and
``idle_connections`` for the sweep. Transports without it (fakes, a custom factory's)
are left alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from npu_sync.transport._base import features_of

log = logging.getLogger(__name__)

REAP_EVERY = 1.0
"""Seconds between sweeps, unless ``idle_timeout`` is shorter (see :func:`reap_interval`)."""
_REAP_MIN = 0.05


def reap_interval(idle_timeout: float) -> float:
    """How often idle connections are swept: every second, or a quarter of a shorter
    ``idle_timeout``, never more often than every 50 ms."""
    return max(_REAP_MIN, min(REAP_EVERY, idle_timeout / 4))


class IdleBudget:
    """How many idle connections the transports sharing it may keep, all together, and
    which transports hold some.

    Thread-safe; its lock is held for an integer update, never across I/O. A
    transport calls :meth:`take` before keeping a connection idle, :meth:`give` when
    one leaves the idle set, and :meth:`holding` after keeping one, which also runs
    the sweep when one is due (so a pool with no thread of its own still sweeps while
    it has work).
    """

    __slots__ = ("_lock", "_sweep", "held", "holders", "interval", "limit", "next_sweep", "refused")

    def __init__(
        self,
        limit: int,
        interval: float = REAP_EVERY,
        sweep: Callable[[float], object] | None = None,
    ) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self._lock = threading.Lock()
        self.limit = limit
        self.held = 0
        self.refused = 0  # connections closed at release because the budget was spent
        self.interval = interval
        self.next_sweep = time.monotonic() + interval
        self._sweep = sweep
        # Transports (or urllib3 pools) that kept an idle connection since the last
        # sweep found them empty: a sweep visits these, not every worker's transport.
        self.holders: set[Any] = set()

    def take(self) -> bool:
        """One more connection may be kept idle: True, and it is counted; False when
        the budget is spent (the caller closes the connection)."""
        with self._lock:
            if self.held >= self.limit:
                self.refused += 1
                return False
            self.held += 1
            return True

    def give(self, count: int = 1) -> None:
        """``count`` idle connections were taken into use or closed."""
        with self._lock:
            self.held = max(0, self.held - count)

    def holding(self, holder: Any, now: float) -> None:
        """``holder`` keeps an idle connection; sweeps when one is due."""
        self.holders.add(holder)  # set.add is atomic: no lock on the hot path
        if now >= self.next_sweep and self._sweep is not None:
            self.next_sweep = now + self.interval  # racing callers may both sweep: harmless
            self._sweep(now)

    def reset(self) -> None:
        """Forget every count: after ``fork()``, the child holds none of the parent's."""
        with self._lock:
            self.held = 0
        self.holders = set()


class IdleReaper:
    """The pool's idle connections: their budget, and their sweep.

    Thread-safe. The pool's health thread runs :meth:`sweep` every ``interval``;
    without one, a transport keeping a connection idle runs it once the interval
    has passed. Tests call it with a ``now`` of their own.

    Args:
        limit: idle connections all adopted transports may keep together.
        interval: seconds between sweeps.
        clock: monotonic seconds (``time.monotonic``); the transports' own clock.
    """

    def __init__(
        self,
        limit: int,
        interval: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.budget = IdleBudget(limit, interval, self.sweep)
        self.interval = interval
        self._clock = clock
        self.reaped = 0  # idle connections the sweeps closed

    def adopt(self, transport: Any) -> Any:
        """Put ``transport``'s idle connections under the budget and the sweeps; a
        transport that does not declare ``shares_idle`` is returned untouched.

        Every transport a pool builds passes here, so a transport's declaration of its
        features is read (and a malformed one refused) as its worker is built.

        Raises:
            TypeError: the transport's ``features`` is not a TransportFeatures.
        """
        if features_of(transport).shares_idle:
            transport.share_idle(self.budget)
        return transport

    def factory(self, build: Callable[..., Any]) -> Callable[..., Any]:
        """``build`` (a transport factory) whose every transport is adopted."""

        def build_adopted(*args: Any, **kwargs: Any) -> Any:
            return self.adopt(build(*args, **kwargs))

        return build_adopted

    def sweep(self, now: float | None = None) -> int:
        """Close every idle connection that expired or that its worker closed; returns
        how many. Never raises: a transport that fails its sweep is logged."""
        at = self._clock() if now is None else now
        self.budget.next_sweep = at + self.interval
        holders = self.budget.holders
        closed = 0
        for holder in list(holders):
            try:
                closed += int(holder.reap(at))
                if not holder.idle_connections:
                    # Kept again later: holding() adds it back.
                    holders.discard(holder)
            except Exception:
                log.exception("sweeping the idle connections of %r failed", holder)
        if closed:
            self.reaped += closed
            log.debug("closed %d idle connections", closed)
        return closed

    def after_fork(self) -> None:
        """In a forked child: none of the parent's connections."""
        self.budget.reset()

    def stats(self) -> dict[str, int]:
        budget = self.budget
        return {
            "idle": budget.held,
            "max_idle": budget.limit,
            "closed_over_budget": budget.refused,
            "reaped": self.reaped,
        }
