"""AIMD: additive increase, multiplicative decrease, one decision per window.

The loss-based limit of TCP and of Netflix's ``AIMDLimit`` behind its ``WindowedLimit``,
for a worker the hill climbing misreads: it needs no model of the worker's throughput,
only its drops. Each :class:`~._window.TimedWindow` that closes

- with a drop (a 429, a 503, a timeout, or an answer slower than ``timeout``) leaves
  the limit where the drop put it: the first drop of a window cuts the limit by
  ``backoff`` at once (a tenth by default, at least one task, never below 1); later
  drops of the same window are counted but cut no more, since a burst of drops is the
  answer to one level, not one each; a drop of a task sent above the limit now in
  force (before a cut) describes a level left behind and is only counted;
- without a drop, with the limit in use (at least half of it in flight at once:
  below that the pool had no more to give the worker, which says nothing of more
  load), and without a latency rise, adds one;
- otherwise holds.

A *latency rise* is a window whose mean RTT is more than ``rtt_tolerance`` (1.5) times
the *baseline*: the lowest window mean seen, which follows a lower mean at once and a
higher one by ``1/16`` of the gap a window, so a worker that became slower for good
(a bigger model, longer inputs) grows again after a few dozen windows rather than
being held for ever. A rise only stops the growth, it never cuts: an NPU worker under
too much load queues tasks rather than drop them, and the queue that builds as the
limit grows raises the baseline with it, so against a worker that never drops AIMD
ends at the ceiling, one step every few windows. Choose it for workers that say when
they are full (429 or 503), and set ``max_concurrent`` to the most a worker should
ever queue.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from npu_sync._balancing.limits._window import TimedWindow, WindowSummary

_FOLLOW = 1 / 16  # the share of the gap a higher window mean moves the baseline by


class AimdLimit:
    """One more task a window while the worker keeps up, a tenth less on a drop. Not
    thread-safe: the pool calls it under its selection lock.

    Args:
        ceiling: the most the limit may reach (the worker's ``max_concurrent``).
        initial: where the limit starts, within ``[1, ceiling]``.
        backoff: the factor the limit is multiplied by on a window's first drop, in
            ``(0, 1)``.
        timeout: an answer slower than this many seconds counts as a drop (None: only
            what the pool reports as dropped, which includes its own timeouts).
        rtt_tolerance: a window whose mean RTT exceeds the baseline by this factor
            (> 1) does not grow the limit.
        clock: monotonic seconds, for the windows.
        min_time, max_time, min_samples: the window's bounds (:class:`TimedWindow`).

    Raises:
        ValueError: a setting out of its range, named with its value.
    """

    __slots__ = (
        "_baseline",
        "_limit",
        "_mode",
        "_start",
        "_timeout",
        "_window",
        "backoff",
        "ceiling",
        "drops",
        "initial",
        "rtt_tolerance",
        "samples",
    )

    algorithm = "aimd"

    def __init__(
        self,
        ceiling: int,
        *,
        initial: int = 4,
        backoff: float = 0.9,
        timeout: float | None = None,
        rtt_tolerance: float = 1.5,
        clock: Callable[[], float] = time.monotonic,
        min_time: float = 0.1,
        max_time: float = 1.0,
        min_samples: int = 10,
    ) -> None:
        if ceiling < 1:
            raise ValueError(f"ceiling must be >= 1, got {ceiling!r}")
        if not 0 < backoff < 1:
            raise ValueError(f"backoff must be in (0, 1), got {backoff!r}")
        if timeout is not None and not 0 < timeout < math.inf:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if not 1 < rtt_tolerance < math.inf:
            raise ValueError(f"rtt_tolerance must be > 1, got {rtt_tolerance!r}")
        self.ceiling = ceiling
        self._start = initial
        self.initial = max(1, min(initial, ceiling))
        self.backoff = backoff
        self._timeout = timeout
        self.rtt_tolerance = rtt_tolerance
        self._window = TimedWindow(
            clock, min_time=min_time, max_time=max_time, min_samples=min_samples
        )
        self.samples = 0
        self.drops = 0
        self._limit = self.initial
        self._baseline: float | None = None
        self._mode = "start"
        self.reset()

    @property
    def current(self) -> int:
        """Tasks the worker may have in flight now."""
        return self._limit

    def on_sample(self, rtt: float, in_flight: int, dropped: bool) -> int:
        """Count one attempt (see :meth:`HillClimbingLimit.on_sample
        <npu_sync._balancing.limits.HillClimbingLimit.on_sample>`); returns :attr:`current`.

        A zero, negative, NaN or infinite duration of an answer, or one with no task in
        flight, says nothing and is ignored; a drop counts whatever its duration.
        """
        if not dropped:
            if not 0 < rtt < math.inf or in_flight < 1:
                return self._limit
            dropped = self._timeout is not None and rtt > self._timeout
        if dropped:
            self.drops += 1
            if in_flight > self._limit:
                return self._limit  # sent before a cut: a level left behind
            if not self._window.drops:
                self._limit = max(1, min(self._limit - 1, int(self._limit * self.backoff)))
                self._mode = "down"
        else:
            self.samples += 1
        summary = self._window.offer(rtt, in_flight, dropped)
        if summary is not None:
            self._judge(summary)
        return self._limit

    def reset(self) -> None:
        """Start again from the initial limit, the baseline forgotten."""
        self._limit = self.initial
        self._baseline = None
        self._mode = "start"
        self._window.restart()

    def set_ceiling(self, ceiling: int) -> None:
        """Apply a new ceiling: the limit, and the initial one, stay within it.

        Raises:
            ValueError: ``ceiling`` is below 1.
        """
        if ceiling < 1:
            raise ValueError(f"ceiling must be >= 1, got {ceiling!r}")
        self.ceiling = ceiling
        self.initial = max(1, min(self._start, ceiling))
        self._limit = min(self._limit, ceiling)

    def stats(self) -> dict[str, float | int | str | None]:
        """``{"algorithm": "aimd", "limit", "ceiling", "mode", "baseline_rtt", "samples",
        "drops"}``: the limit in force, what the last window did (``start`` before the
        first, ``up``, ``hold``, ``down``), the baseline RTT in seconds (None before a
        window without drops), and the running totals."""
        return {
            "algorithm": self.algorithm,
            "limit": self._limit,
            "ceiling": self.ceiling,
            "mode": self._mode,
            "baseline_rtt": self._baseline,
            "samples": self.samples,
            "drops": self.drops,
        }

    def _judge(self, summary: WindowSummary) -> None:
        if summary.drops:
            self._mode = "down"  # cut at its first drop already
            return
        rtt = summary.mean_rtt
        baseline = self._baseline
        risen = baseline is not None and rtt > self.rtt_tolerance * baseline
        if baseline is None or rtt < baseline:
            self._baseline = rtt
        else:
            self._baseline = baseline + (rtt - baseline) * _FOLLOW
        limited = 2 * summary.max_in_flight < self._limit
        if limited or risen or self._limit >= self.ceiling:
            self._mode = "hold"
            return
        self._limit += 1
        self._mode = "up"
