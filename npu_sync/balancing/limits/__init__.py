"""Concurrency limits: how many tasks a worker may have in flight.

A worker without a limit takes up to its ``max_concurrent``. With one, that is the
limit's ceiling and the worker's capacity is the limit's :attr:`~ConcurrencyLimit.current`
(see :meth:`npu_sync.worker.Worker.set_limit`). Each limit keeps its measurement apart:
a window (:mod:`._window`) collects the answers and hands the algorithm one
:class:`WindowSummary` when it closes.
"""

from __future__ import annotations

from npu_sync.balancing.limits._hill import HillClimbingLimit, square_root_headroom
from npu_sync.balancing.limits._protocol import AdjustableLimit, ConcurrencyLimit
from npu_sync.balancing.limits._window import (
    RoundWindow,
    SampleWindow,
    TimedWindow,
    WindowSummary,
)

__all__ = [
    "AdjustableLimit",
    "ConcurrencyLimit",
    "HillClimbingLimit",
    "RoundWindow",
    "SampleWindow",
    "TimedWindow",
    "WindowSummary",
    "square_root_headroom",
]
