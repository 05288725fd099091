"""The fixed limit: the worker's ``max_concurrent``, nothing learned."""

from __future__ import annotations


class FixedLimit:
    """Always the ceiling (``max_concurrent``): what a worker without a limit gets, as
    an object. It counts the answers it is shown and learns nothing from them. Not
    thread-safe: the pool calls it under its selection lock.

    Args:
        ceiling: the limit (the worker's ``max_concurrent``).

    Raises:
        ValueError: ``ceiling`` is below 1.
    """

    __slots__ = ("ceiling", "drops", "samples")

    algorithm = "fixed"

    def __init__(self, ceiling: int) -> None:
        if ceiling < 1:
            raise ValueError(f"ceiling must be >= 1, got {ceiling!r}")
        self.ceiling = ceiling
        self.samples = 0
        self.drops = 0

    @property
    def current(self) -> int:
        """The ceiling."""
        return self.ceiling

    def on_sample(self, rtt: float, in_flight: int, dropped: bool) -> int:
        """Count one attempt; returns :attr:`current`, unchanged."""
        if dropped:
            self.drops += 1
        else:
            self.samples += 1
        return self.ceiling

    def reset(self) -> None:
        """Nothing to start again."""

    def set_ceiling(self, ceiling: int) -> None:
        """Apply a new ``max_concurrent``.

        Raises:
            ValueError: ``ceiling`` is below 1.
        """
        if ceiling < 1:
            raise ValueError(f"ceiling must be >= 1, got {ceiling!r}")
        self.ceiling = ceiling

    def stats(self) -> dict[str, float | int | str | None]:
        """``{"algorithm": "fixed", "limit", "ceiling", "mode": "fixed", "samples",
        "drops"}``."""
        return {
            "algorithm": self.algorithm,
            "limit": self.ceiling,
            "ceiling": self.ceiling,
            "mode": "fixed",
            "samples": self.samples,
            "drops": self.drops,
        }
