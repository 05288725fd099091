"""Hedging: when a task's attempt is slow, send the task to a second worker as well.

A worker that froze, or is stuck behind one long task, holds its attempts until the
per-try timeout: those tasks take the timeout and more, whatever the rest of the
fleet could have done. gRPC's hedging policy is the model: after a delay, a second
attempt of the same task goes to another worker; the first answer wins and the
other attempt is abandoned. Only for idempotent tasks (``Task.idempotent``): both
attempts may run, and the worker sees the same ``X-NPU-Task-Id`` on each.

This module decides *when*: :meth:`HedgePolicy.delay_for` answers "hedge after how
many seconds", from a fixed ``delay`` or from a percentile (0.95 by default) of the
recent successful attempts' durations, so that about 5 % of tasks are hedged when
all is well and every task stuck behind a frozen worker is. Until enough durations
are known (``min_samples``) a percentile policy does not hedge.

The attempt loop's side (``life.hedge.Hedge.hedged``) works as follows, which fixes
what this policy must answer:

* ``delay = hedge.delay_for(task.idempotent)``, once per task, after its first lease;
  None means the task runs as today. Most tasks answer before ``delay``, so the
  common path must stay on the caller's thread: the caller sends the first attempt
  itself and arms a timer (one scheduler thread with a heap, shared by the pool) to
  fire at ``t0 + delay``.
* When the timer fires and the first attempt has not answered: the hedge needs a
  retry token (``budget.try_withdraw()``, hedges count against the retry budget) and
  a lease that waits for nothing (``Dispatcher.try_acquire(excluded)`` with the first
  worker excluded: a hedge never queues nor takes a slot a queued task waits for).
  Without either it is skipped (``hedge.count_skipped()``). With both, a pool thread
  sends the second attempt (``X-NPU-Attempt: 2``).
* The first answer wins. The winner's thread aborts the other attempt: its transport
  request needs a way to be closed from another thread (a cancel handle the request
  registers its connection with; the connection is closed, never returned to the
  pool). The loser is recorded as abandoned: its slot and breaker trial given back,
  nothing charged to its worker; its elapsed time is observed with ``ok=False`` (its
  worker was at least that slow). ``hedge.count_hedge(won=...)`` says whether the
  hedge's answer was the one returned.
* ``hedge.observe(duration)`` after every successful attempt that was not a hedge, so
  that the percentile is that of ordinary attempts.

Events for the pool to emit once it hedges: ``attempt.hedged`` (task id, the first
worker, the hedge's worker, the delay) when a hedge is sent; the abandoned attempt's
``attempt.finished`` carries outcome ``abandoned``.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from npu_sync._clock import Clock
from npu_sync._metrics import percentile

log = logging.getLogger(__name__)

STOP_TIMEOUT = 5.0
"""Seconds :meth:`HedgeTimer.stop` waits for its threads in all, as the pool's other
threads are waited for on close."""


class HedgeTotals:
    """Hedges sent, won and skipped over a pool's life. Thread-safe.

    A pool keeps one and hands it to each :class:`HedgePolicy` a reload puts in place:
    a task still running with the policy it started with counts where the pool's
    ``stats()`` looks, and the totals never go down.
    """

    __slots__ = ("hedged", "lock", "skipped", "won")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.hedged = 0
        self.won = 0
        self.skipped = 0


class HedgePolicy:
    """When to hedge a task. Thread-safe; :meth:`observe` costs an append.

    Args:
        enabled: hedging is opt-in.
        delay: a fixed delay in seconds; None to follow ``percentile``.
        percentile: the quantile (0..1, exclusive) of recent attempt durations after
            which to hedge, when no fixed delay is given.
        window: how many recent durations the percentile is taken over.
        min_samples: durations needed before a percentile policy hedges.
        refresh_every: new durations after which the percentile is computed again.
        totals: where hedges are counted; one of its own if not given.
    """

    def __init__(
        self,
        *,
        enabled: bool = False,
        delay: float | None = None,
        percentile: float = 0.95,
        window: int = 512,
        min_samples: int = 32,
        refresh_every: int = 32,
        totals: HedgeTotals | None = None,
    ) -> None:
        if delay is not None and not delay >= 0:
            raise ValueError(f"delay must be >= 0 seconds, got {delay!r}")
        if not 0 < percentile < 1:
            raise ValueError(f"percentile must be between 0 and 1, got {percentile!r}")
        if window < 1 or min_samples < 1 or refresh_every < 1:
            raise ValueError("window, min_samples and refresh_every must be >= 1")
        self.enabled = enabled
        self.delay = delay
        self.percentile = percentile
        self._min_samples = min(min_samples, window)
        self._refresh_every = refresh_every
        self._lock = threading.Lock()
        self._ring = [0.0] * window
        self._next = 0  # where the next duration goes
        self._count = 0  # durations in the ring
        self._fresh = 0  # durations since the percentile was computed
        self._cached: float | None = None
        self.totals = HedgeTotals() if totals is None else totals

    def observe(self, duration: float) -> None:
        """A successful attempt (not a hedge) took ``duration`` seconds."""
        with self._lock:
            ring = self._ring
            ring[self._next] = duration
            self._next = (self._next + 1) % len(ring)
            if self._count < len(ring):
                self._count += 1
            self._fresh += 1

    def delay_for(self, idempotent: bool) -> float | None:
        """Seconds after which to send a task a second time, or None not to hedge it."""
        if not self.enabled or not idempotent:
            return None
        if self.delay is not None:
            return self.delay
        return self.current()

    def current(self) -> float | None:
        """The percentile delay now, or None until ``min_samples`` durations are known."""
        with self._lock:
            if self._count < self._min_samples:
                return None
            if self._cached is not None and self._fresh < self._refresh_every:
                return self._cached
            values = self._ring[: self._count]  # a copy: sorted outside the lock
            self._fresh = 0
        cached = percentile(sorted(values), self.percentile * 100)
        with self._lock:
            self._cached = cached
        return cached

    def count_hedge(self, won: bool) -> None:
        """A hedge was sent; ``won``: its answer was the one returned."""
        totals = self.totals
        with totals.lock:
            totals.hedged += 1
            if won:
                totals.won += 1

    def count_skipped(self) -> None:
        """A hedge was due but not sent: no retry budget, or no worker free."""
        totals = self.totals
        with totals.lock:
            totals.skipped += 1

    def stats(self) -> dict[str, float | int | bool | str | None]:
        """JSON-serialisable: ``enabled``, ``mode`` (``"delay"`` or ``"percentile"``),
        ``delay_ms`` (the delay now, None while unknown), ``percentile``, ``samples``,
        and the totals ``hedged``, ``won`` and ``skipped`` (see ``totals``)."""
        fixed = self.delay is not None
        delay = self.delay if fixed else self.current()
        totals = self.totals
        with totals.lock:
            hedged, won, skipped = totals.hedged, totals.won, totals.skipped
        with self._lock:
            samples = self._count
        return {
            "enabled": self.enabled,
            "mode": "delay" if fixed else "percentile",
            "delay_ms": None if delay is None else delay * 1000.0,
            "percentile": None if fixed else self.percentile,
            "samples": samples,
            "hedged": hedged,
            "won": won,
            "skipped": skipped,
        }


class HedgeTimer:
    """Runs callbacks when their time comes, and hedges on threads of their own.

    Thread-safe. One daemon thread (``npu-sync-hedge-timer``) waits for the earliest
    due time; a callback runs on it and must be short (it takes a lease, then hands
    the hedge to :meth:`submit`). Hedges run on up to ``threads`` daemon threads
    (``npu-sync-hedge-0``, ``-1`` …), started as hedges need them and kept for the next
    ones. None is started before first use, so a pool that never hedges has none.
    :meth:`run_due` is the one-shot step the timer thread repeats, for tests with a
    fake clock.

    :meth:`stop` ends all of it: nothing is scheduled, run or accepted afterwards, the
    hedges in flight are cancelled, and every thread is joined within a time budget.

    Args:
        clock: the time source; due times are on its monotonic clock.
        threads: the most hedges sent at once.
        initializer: called first on each thread the timer starts (the pool marks
            them as its own, as it does its task threads).
    """

    def __init__(
        self,
        clock: Clock,
        *,
        threads: int = 32,
        initializer: Callable[[], None] | None = None,
    ) -> None:
        self._clock = clock
        self._threads = threads
        self._initializer = initializer
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # the timer thread waits on it
        self._work = threading.Condition(lock)  # idle hedge threads wait on it
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._jobs: deque[_Hedge] = deque()  # submitted, not yet taken by a thread
        self._running: set[_Hedge] = set()
        self._workers: list[threading.Thread] = []
        self._idle = 0  # hedge threads waiting for a job, not yet woken for one
        self._closing = False  # no callback is scheduled or run any more
        self._stopped = False  # no hedge is accepted any more

    def schedule(self, when: float, callback: Callable[[], None]) -> None:
        """Call ``callback`` at ``when`` (monotonic seconds); nothing once stopped."""
        with self._cond:
            if self._closing:
                return
            entry = (when, next(self._seq), callback)
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="npu-sync-hedge-timer", daemon=True
                )
                self._thread.start()
            elif self._heap[0] is entry:
                self._cond.notify()

    def run_due(self) -> int:
        """Run every callback whose time has come; returns how many ran. Once
        :meth:`stop` began, none is run."""
        now = self._clock.monotonic()
        ran = 0
        while True:
            # One at a time: stop() may come between two of them.
            with self._cond:
                heap = self._heap
                if self._closing or not heap or heap[0][0] > now:
                    return ran
                callback = heapq.heappop(heap)[2]
            try:
                callback()
            except Exception:
                log.exception("hedge callback failed")
            ran += 1

    def submit(
        self, fn: Callable[..., Any], *args: Any, cancel: Callable[[], None] | None = None
    ) -> None:
        """Run ``fn(*args)`` on a hedge thread.

        Args:
            fn: the hedge.
            *args: its arguments.
            cancel: ends ``fn`` early (closes its request); :meth:`stop` calls it.

        Raises:
            RuntimeError: the timer was stopped.
        """
        hedge = _Hedge(fn, args, cancel)
        with self._cond:
            if self._stopped:
                raise RuntimeError("hedging stopped")
            self._jobs.append(hedge)
            if self._idle:
                self._idle -= 1
                self._work.notify()
            elif len(self._workers) < self._threads:
                thread = threading.Thread(
                    target=self._serve, name=f"npu-sync-hedge-{len(self._workers)}", daemon=True
                )
                # Started under the lock, so that stop() never sees a thread it cannot join.
                thread.start()
                self._workers.append(thread)

    def pending(self) -> int:
        """Callbacks waiting for their time."""
        with self._cond:
            return len(self._heap)

    def stop_soon(self) -> None:
        """Stop without waiting: drop what is scheduled, accept no more hedges, cancel
        the hedges in flight; the threads end on their own. Idempotent."""
        self._close_timer()
        self._close_hedges()

    def stop(self, timeout: float = STOP_TIMEOUT) -> bool:
        """Drop what is scheduled, cancel the hedges in flight, and join every thread
        within ``timeout`` seconds in all. Idempotent; safe from any thread, one of
        the timer's own included (it is then not waited for).

        A callback running when this is called ends first and may still hand its hedge
        over; that hedge is cancelled with the others, before any thread is joined.
        A hedge given no ``cancel`` runs to its end (its request's own timeout).

        Returns:
            True when every thread ended in time; those left are logged.
        """
        deadline = time.monotonic() + timeout  # real waits, whatever the pool's clock
        me = threading.current_thread()
        timer = self._close_timer()
        if timer is not None and timer is not me:
            timer.join(max(0.0, deadline - time.monotonic()))
        workers = self._close_hedges()
        for thread in workers:
            if thread is not me:
                thread.join(max(0.0, deadline - time.monotonic()))
        left = [t.name for t in (timer, *workers) if t is not None and t is not me and t.is_alive()]
        if left:
            log.warning("hedge threads still running %.1f s after close: %s", timeout, left)
        return not left

    def _close_timer(self) -> threading.Thread | None:
        with self._cond:
            self._closing = True
            self._heap.clear()
            self._cond.notify()
            return self._thread

    def _close_hedges(self) -> list[threading.Thread]:
        with self._cond:
            self._stopped = True
            self._idle = 0
            self._work.notify_all()
            cancels = [h.cancel for h in (*self._running, *self._jobs) if h.cancel is not None]
            workers = list(self._workers)
        for cancel in cancels:
            try:
                cancel()
            except Exception:
                log.exception("could not cancel a hedge")
        return workers

    def _start_thread(self) -> None:
        if self._initializer is not None:
            try:
                self._initializer()
            except Exception:
                log.exception("hedge thread initializer failed")

    def _loop(self) -> None:
        self._start_thread()
        cond = self._cond
        while True:
            with cond:
                if self._closing:
                    return
                heap = self._heap
                wait = heap[0][0] - self._clock.monotonic() if heap else None
                if wait is None or wait > 0:
                    cond.wait(wait)
                    continue
            self.run_due()

    def _serve(self) -> None:
        """A hedge thread: run hedges until stopped and none is left to run."""
        self._start_thread()
        work = self._work
        while True:
            with work:
                while not self._jobs:
                    if self._stopped:
                        return
                    self._idle += 1
                    work.wait()  # submit() or stop() takes us off the idle count
                # Still run once stopped: stop() cancelled it, and only its own end
                # gives back what it holds (its lease).
                hedge = self._jobs.popleft()
                self._running.add(hedge)
            try:
                hedge.fn(*hedge.args)
            except Exception:
                log.exception("hedge failed")
            finally:
                with work:
                    self._running.discard(hedge)
            # Not kept while idle: a hedge holds its task (payload, body, race).
            del hedge


class _Hedge:
    """One submitted hedge: what to run, and how to end it early."""

    __slots__ = ("args", "cancel", "fn")

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], cancel: Callable[[], None] | None
    ) -> None:
        self.fn = fn
        self.args = args
        self.cancel = cancel
