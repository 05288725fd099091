"""Which limit a worker gets: ``balancing.concurrency_limit`` by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, cast

from npu_sync._balancing.limits._aimd import AimdLimit
from npu_sync._balancing.limits._fixed import FixedLimit
from npu_sync._balancing.limits._gradient2 import Gradient2Limit
from npu_sync._balancing.limits._hill import HillClimbingLimit
from npu_sync._balancing.limits._protocol import AdjustableLimit
from npu_sync.config import CONCURRENCY_LIMITS

_CLASSES: Final[dict[str, type]] = {
    "fixed": FixedLimit,
    "hill-climbing": HillClimbingLimit,
    "aimd": AimdLimit,
    "gradient2": Gradient2Limit,
}


def new_limit(name: str, ceiling: int, clock: Callable[[], float]) -> AdjustableLimit | None:
    """The limit ``balancing.concurrency_limit: name`` gives a worker of ``max_concurrent``
    ``ceiling``, its windows timed by ``clock``; None for ``fixed``: a worker without a
    limit has ``max_concurrent`` for capacity, as a :class:`FixedLimit` would give it,
    without a call per answer.

    Raises:
        ValueError: ``name`` is none of :data:`~npu_sync.config.CONCURRENCY_LIMITS`.
    """
    if name == "fixed":
        return None
    if name == "hill-climbing":
        return HillClimbingLimit(ceiling)
    if name == "aimd":
        return AimdLimit(ceiling, clock=clock)
    if name == "gradient2":
        return Gradient2Limit(ceiling, clock=clock)
    raise ValueError(
        f"balancing.concurrency_limit must be one of {', '.join(CONCURRENCY_LIMITS)}, got {name!r}"
    )


def limit_of(limit: object, name: str) -> AdjustableLimit | None:
    """``limit`` when it is the kind ``name`` builds, else None (a reload chose another)."""
    cls = _CLASSES.get(name)
    if cls is None or not isinstance(limit, cls):
        return None
    return cast(AdjustableLimit, limit)
