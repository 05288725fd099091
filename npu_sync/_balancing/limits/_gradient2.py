"""A gradient2-style limit: grow while a short-term RTT keeps up with a long-term one.

Taken from Netflix's ``Gradient2Limit`` (concurrency-limits), behind the same kind of
window as its ``WindowedLimit``: each :class:`~._window.TimedWindow` gives the short
RTT (the window's mean) and the most tasks in flight. The long RTT is an exponential
average of the short ones over ``long_window`` windows (a plain mean over the first
ten), brought down by 5 % a window while it is more than twice the short one (latency
back to normal after a long overload). Then, unless the limit is app-limited (fewer
than half of it in flight at once), ::

    gradient = clamp(rtt_tolerance * long / short, 0.5, 1.0)
    target   = estimate * gradient + queue_size(estimate)
    estimate = estimate * (1 - smoothing) + target * smoothing

within ``[1, ceiling]``; the limit in force is the estimate rounded down. While the
short RTT stays within ``rtt_tolerance`` (1.5) of the long one the gradient is 1 and
the estimate grows by ``smoothing`` times the queue size a window; when it rises past
it, the estimate shrinks, by at most half of itself a window before smoothing.

What differs from Netflix's: the limit starts at 4 and may go down to 1 (theirs at 20,
and not under 20), the queue size is ``ceil(sqrt(estimate))`` as the hill climbing's
headroom (theirs a constant 4), and a drop (429, 503, a timeout) cuts the estimate by
``backoff`` at once, once a window and only for a task sent within the limit in force,
and a window with a drop does not grow it, as AIMD does (theirs ignores drops: against
a worker that answers 429 past its room, growing by the queue size every window would
undo each cut and keep it refusing).

Against a worker that queues the tasks it cannot run yet (an NPU worker), the long
average follows the RTT as the queue grows, so the gradient stays near 1 and the limit
keeps growing toward the ceiling, more slowly than AIMD's; it reacts to a sudden rise
in latency (a worker that became slower, or lost slots) by shrinking until the long
average catches up.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from npu_sync._balancing.limits._hill import square_root_headroom
from npu_sync._balancing.limits._window import TimedWindow, WindowSummary

_WARMUP = 10  # windows averaged plainly before the long RTT becomes exponential


class Gradient2Limit:
    """Netflix's gradient2 over windows: the ratio of a long to a short RTT. Not
    thread-safe: the pool calls it under its selection lock.

    Args:
        ceiling: the most the limit may reach (the worker's ``max_concurrent``).
        initial: where the estimate starts, within ``[1, ceiling]``.
        smoothing: how far each window moves the estimate toward its target, in (0, 1].
        rtt_tolerance: how much longer than the long RTT the short one may get before
            the limit shrinks (>= 1).
        long_window: the windows the long RTT averages over (>= 1).
        queue_size: tasks added on top of the estimate, given it.
        backoff: the factor a window's first drop multiplies the estimate by, in (0, 1).
        clock: monotonic seconds, for the windows.
        min_time, max_time, min_samples: the window's bounds (:class:`TimedWindow`).

    Raises:
        ValueError: a setting out of its range, named with its value.
    """

    __slots__ = (
        "_estimate",
        "_long",
        "_long_count",
        "_mode",
        "_queue_size",
        "_start",
        "_window",
        "backoff",
        "ceiling",
        "drops",
        "initial",
        "long_window",
        "rtt_tolerance",
        "samples",
        "smoothing",
    )

    algorithm = "gradient2"

    def __init__(
        self,
        ceiling: int,
        *,
        initial: int = 4,
        smoothing: float = 0.2,
        rtt_tolerance: float = 1.5,
        long_window: int = 600,
        queue_size: Callable[[int], int] = square_root_headroom,
        backoff: float = 0.9,
        clock: Callable[[], float] = time.monotonic,
        min_time: float = 0.1,
        max_time: float = 1.0,
        min_samples: int = 10,
    ) -> None:
        if ceiling < 1:
            raise ValueError(f"ceiling must be >= 1, got {ceiling!r}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")
        if not 1 <= rtt_tolerance < math.inf:
            raise ValueError(f"rtt_tolerance must be >= 1, got {rtt_tolerance!r}")
        if long_window < 1:
            raise ValueError(f"long_window must be >= 1, got {long_window!r}")
        if not 0 < backoff < 1:
            raise ValueError(f"backoff must be in (0, 1), got {backoff!r}")
        self.ceiling = ceiling
        self._start = initial
        self.initial = max(1, min(initial, ceiling))
        self.smoothing = smoothing
        self.rtt_tolerance = rtt_tolerance
        self.long_window = long_window
        self._queue_size = queue_size
        self.backoff = backoff
        self._window = TimedWindow(
            clock, min_time=min_time, max_time=max_time, min_samples=min_samples
        )
        self.samples = 0
        self.drops = 0
        self._estimate = float(self.initial)
        self._long = 0.0
        self._long_count = 0
        self._mode = "start"
        self.reset()

    @property
    def current(self) -> int:
        """Tasks the worker may have in flight now: the estimate rounded down."""
        return max(1, min(self.ceiling, int(self._estimate)))

    def on_sample(self, rtt: float, in_flight: int, dropped: bool) -> int:
        """Count one attempt (see :meth:`HillClimbingLimit.on_sample
        <npu_sync._balancing.limits.HillClimbingLimit.on_sample>`); returns :attr:`current`.

        A zero, negative, NaN or infinite duration of an answer, or one with no task in
        flight, says nothing and is ignored; a drop counts whatever its duration.
        """
        if dropped:
            self.drops += 1
            if in_flight > self.current:
                return self.current  # sent before a cut: a level left behind
            if not self._window.drops:
                self._estimate = max(1.0, self._estimate * self.backoff)
                self._mode = "down"
        elif not 0 < rtt < math.inf or in_flight < 1:
            return self.current
        else:
            self.samples += 1
        summary = self._window.offer(rtt, in_flight, dropped)
        if summary is not None:
            self._judge(summary)
        return self.current

    def reset(self) -> None:
        """Start again from the initial limit, the long RTT forgotten."""
        self._estimate = float(self.initial)
        self._long = 0.0
        self._long_count = 0
        self._mode = "start"
        self._window.restart()

    def set_ceiling(self, ceiling: int) -> None:
        """Apply a new ceiling: the estimate, and the initial one, stay within it.

        Raises:
            ValueError: ``ceiling`` is below 1.
        """
        if ceiling < 1:
            raise ValueError(f"ceiling must be >= 1, got {ceiling!r}")
        self.ceiling = ceiling
        self.initial = max(1, min(self._start, ceiling))
        self._estimate = min(self._estimate, float(ceiling))

    def stats(self) -> dict[str, float | int | str | None]:
        """``{"algorithm": "gradient2", "limit", "ceiling", "mode", "estimate",
        "long_rtt", "samples", "drops"}``: the limit in force, which way the last
        window moved it (``start`` before the first, ``up``, ``hold``, ``down``), the
        estimate it is rounded from, the long RTT in seconds (None before a window),
        and the running totals."""
        return {
            "algorithm": self.algorithm,
            "limit": self.current,
            "ceiling": self.ceiling,
            "mode": self._mode,
            "estimate": self._estimate,
            "long_rtt": self._long if self._long_count else None,
            "samples": self.samples,
            "drops": self.drops,
        }

    def _judge(self, summary: WindowSummary) -> None:
        if not summary.samples:
            return  # a window of drops alone: cut already, no RTT to judge
        short = summary.mean_rtt
        if self._long_count < _WARMUP:
            self._long_count += 1
            self._long += (short - self._long) / self._long_count
        else:
            factor = 2 / (self.long_window + 1)
            self._long = self._long * (1 - factor) + short * factor
        if self._long / short > 2:
            # Latency back to normal after a long overload: do not wait for the
            # average to forget it.
            self._long *= 0.95
        if summary.drops:
            # Cut at its first drop already; growing by the queue size now would undo
            # the cut every window, and keep a worker that refuses above its room.
            self._mode = "down"
            return
        before = self.current
        estimate = self._estimate
        if 2 * summary.max_in_flight < estimate:
            self._mode = "hold"  # app-limited: says nothing of more load
            return
        gradient = max(0.5, min(1.0, self.rtt_tolerance * self._long / short))
        target = estimate * gradient + self._queue_size(int(estimate))
        estimate = estimate * (1 - self.smoothing) + target * self.smoothing
        self._estimate = max(1.0, min(float(self.ceiling), estimate))
        after = self.current
        self._mode = "up" if after > before else "down" if after < before else "hold"
