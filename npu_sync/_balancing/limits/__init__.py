"""Concurrency limits: how many tasks a worker may have in flight.

A worker without a limit takes up to its ``max_concurrent``. With one, that is the
limit's ceiling and the worker's capacity is the limit's :attr:`~ConcurrencyLimit.current`
(see :meth:`npu_sync._worker.Worker.set_limit`). ``balancing.concurrency_limit`` chooses
it (:func:`new_limit`):

- ``fixed`` — :class:`FixedLimit`, ``max_concurrent`` and nothing learned (the default;
  the pool then gives its workers no limit object at all, which is the same capacity);
- ``hill-climbing`` — :class:`HillClimbingLimit`, the knee of the worker's throughput
  plus a small headroom (``adaptive_concurrency: true`` spells it too);
- ``aimd`` — :class:`AimdLimit`, one more per window without a drop, a tenth less on one;
- ``gradient2`` — :class:`Gradient2Limit`, Netflix's ratio of a long to a short RTT.

Each keeps its measurement apart: a window (:mod:`._window`) collects the answers and
hands the algorithm one :class:`WindowSummary` when it closes.
"""

from __future__ import annotations

from npu_sync._balancing.limits._aimd import AimdLimit
from npu_sync._balancing.limits._choice import limit_of, new_limit
from npu_sync._balancing.limits._fixed import FixedLimit
from npu_sync._balancing.limits._gradient2 import Gradient2Limit
from npu_sync._balancing.limits._hill import HillClimbingLimit, square_root_headroom
from npu_sync._balancing.limits._protocol import AdjustableLimit, ConcurrencyLimit
from npu_sync._balancing.limits._window import (
    RoundWindow,
    SampleWindow,
    TimedWindow,
    WindowSummary,
)

__all__ = [
    "AdjustableLimit",
    "AimdLimit",
    "ConcurrencyLimit",
    "FixedLimit",
    "Gradient2Limit",
    "HillClimbingLimit",
    "RoundWindow",
    "SampleWindow",
    "TimedWindow",
    "WindowSummary",
    "limit_of",
    "new_limit",
    "square_root_headroom",
]
