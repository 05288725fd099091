"""A retry budget: retries limited to a share of recent tasks, so failures do not multiply load.

When most of a fleet fails, every task retrying ``max_retries`` times multiplies the
load on workers that are already in trouble (a retry storm), and the retries rarely
succeed. Finagle's retry budget is the model: over the last ``window`` seconds,

    retries <= ratio * tasks + min_per_second * window

(by default 20 % of tasks plus 10 a second), pool-wide. Below that, retries go out
as the retry policy says; past it, a task that would retry fails instead, with the
reason. The floor keeps a quiet pool able to retry: with 1 task a second, 20 % would
be one retry every 5 seconds.

Implemented as Finagle's token bucket over a sliding window: each task (its first
attempt) deposits ``ratio`` of a token, each retry or hedge withdraws one, the floor
is a constant reserve of ``min_per_second * window`` tokens, and deposits and
withdrawals count for ``window`` seconds (in ten slices) before they expire. Tokens
are integers (thousandths) so that the running sum never drifts.

Events for the pool to emit once it uses a budget, edge-triggered through
``on_change``: ``retry_budget.exhausted`` when a retry is first refused and
``retry_budget.available`` when one is allowed again; a task failed for want of budget
says so in its reason ("retry budget exhausted").
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from npu_sync._clock import SYSTEM_CLOCK, Clock

_SCALE = 1000  # tokens per retry: deposits of a fraction of a retry stay integers


class BudgetTotals:
    """Tasks, retries allowed and retries refused over a pool's life.

    Guarded by the lock of the budgets counting into it: a pool keeps one and hands
    it to each :class:`RetryBudget` a reload puts in place (all of them on the pool's
    lock), so that a task still drawing on the budget it started with counts where
    the pool's ``stats()`` looks, and the totals never go down.
    """

    __slots__ = ("refused", "requests", "retries")

    def __init__(self) -> None:
        self.requests = 0
        self.retries = 0
        self.refused = 0


class RetryBudget:
    """How many retries the pool may send now. Thread-safe; O(1), one lock per call.

    The lock is the budget's own unless one is given: a pool gives its own lock, so
    that a task's deposit joins the lock round of its first request for a worker
    (:meth:`deposit_locked`) instead of taking one more.

    Args:
        ratio: retries allowed per task (0.2: one retry per five tasks).
        min_per_second: retries allowed each second whatever the traffic.
        window: seconds over which tasks and retries are counted.
        clock: the time source.
        slices: how finely the window slides.
        on_change: called with True when the budget starts refusing retries and with
            False when it allows them again; outside the budget's lock, on the thread
            that withdrew. It must not block.
        lock: the lock that guards the budget (not reentrant: no method may be called
            with it held but :meth:`deposit_locked`); a new one if not given.
        totals: where the running totals are counted (under ``lock``); one of its
            own if not given.
    """

    def __init__(
        self,
        ratio: float = 0.2,
        min_per_second: float = 10.0,
        window: float = 10.0,
        *,
        clock: Clock = SYSTEM_CLOCK,
        slices: int = 10,
        on_change: Callable[[bool], None] | None = None,
        lock: threading.Lock | None = None,
        totals: BudgetTotals | None = None,
    ) -> None:
        if not ratio >= 0:
            raise ValueError(f"ratio must be >= 0, got {ratio!r}")
        if not min_per_second >= 0:
            raise ValueError(f"min_per_second must be >= 0, got {min_per_second!r}")
        if not window > 0:
            raise ValueError(f"window must be > 0 seconds, got {window!r}")
        if slices < 1:
            raise ValueError(f"slices must be >= 1, got {slices!r}")
        self.ratio = ratio
        self.min_per_second = min_per_second
        self.window = window
        self._clock = clock
        self._on_change = on_change
        self._lock = threading.Lock() if lock is None else lock
        self._deposit = round(ratio * _SCALE)
        self._reserve = round(min_per_second * window * _SCALE)
        self._slice = window / slices
        self._ring = [0] * slices  # net tokens per slice
        self._sum = 0  # of the ring
        self._at = int(clock.monotonic() / self._slice)  # the current slice's number
        self._exhausted = False
        self.totals = BudgetTotals() if totals is None else totals

    def deposit(self, now: float | None = None) -> None:
        """A task was started: it earns ``ratio`` of a retry."""
        if now is None:
            now = self._clock.monotonic()
        with self._lock:
            self.deposit_locked(now)

    def deposit_locked(self, now: float) -> None:
        """:meth:`deposit`, for a caller that holds the budget's lock (see ``lock``)."""
        self.totals.requests += 1
        if int(now / self._slice) > self._at:
            self._advance(now)
        ring = self._ring
        ring[self._at % len(ring)] += self._deposit
        self._sum += self._deposit

    def try_withdraw(self, now: float | None = None) -> bool:
        """Take one retry (or hedge) from the budget; False when none is left."""
        if now is None:
            now = self._clock.monotonic()
        with self._lock:
            self._advance(now)
            allowed = self._reserve + self._sum >= _SCALE
            if allowed:
                self.totals.retries += 1
                self._add(-_SCALE, now)
            else:
                self.totals.refused += 1
            changed = allowed == self._exhausted
            self._exhausted = not allowed
        if changed and self._on_change is not None:
            self._on_change(not allowed)
        return allowed

    def balance(self, now: float | None = None) -> float:
        """Retries that would be allowed now."""
        if now is None:
            now = self._clock.monotonic()
        with self._lock:
            self._advance(now)
            return max(0, self._reserve + self._sum) / _SCALE

    def stats(self, now: float | None = None) -> dict[str, float | int | bool]:
        """JSON-serialisable: the settings; ``balance``, the retries allowed now;
        ``exhausted``, whether the last retry asked for was refused; and the running
        totals ``requests`` (tasks), ``retries`` (allowed) and ``refused`` (see
        ``totals``)."""
        balance = self.balance(now)
        with self._lock:
            totals = self.totals
            return {
                "ratio": self.ratio,
                "min_per_second": self.min_per_second,
                "window": self.window,
                "balance": balance,
                "exhausted": self._exhausted,
                "requests": totals.requests,
                "retries": totals.retries,
                "refused": totals.refused,
            }

    # -- internals: call with the lock held ---------------------------------------------

    def _add(self, tokens: int, now: float) -> None:
        self._advance(now)
        ring = self._ring
        at = self._at % len(ring)
        ring[at] += tokens
        self._sum += tokens

    def _advance(self, now: float) -> None:
        """Expire the slices that slid out of the window since the last call."""
        at = int(now / self._slice)
        steps = at - self._at
        if steps <= 0:
            return  # the same slice (or a clock read a little behind another thread's)
        ring = self._ring
        size = len(ring)
        if steps >= size:
            for i in range(size):
                ring[i] = 0
            self._sum = 0
        else:
            for k in range(1, steps + 1):
                i = (self._at + k) % size
                self._sum -= ring[i]
                ring[i] = 0
        self._at = at
