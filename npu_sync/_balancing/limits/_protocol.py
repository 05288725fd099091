"""What a worker needs of a concurrency limit."""

from __future__ import annotations

from typing import Protocol


class ConcurrencyLimit(Protocol):
    """What a worker needs of an adaptive limit."""

    @property
    def current(self) -> int:
        """Tasks the worker may have in flight now: an int in ``[1, ceiling]``."""
        ...

    def on_sample(self, rtt: float, in_flight: int, dropped: bool) -> int:
        """Count one attempt; returns :attr:`current`."""
        ...

    def reset(self) -> None:
        """Start again from the initial limit (a worker back in service)."""
        ...

    def stats(self) -> dict[str, float | int | str | None]:
        """A JSON-serialisable view."""
        ...


class AdjustableLimit(ConcurrencyLimit, Protocol):
    """A limit whose ceiling a reload may change: every limit the pool builds."""

    @property
    def ceiling(self) -> int:
        """The most :attr:`current` may reach (the worker's ``max_concurrent``)."""
        ...

    def set_ceiling(self, ceiling: int) -> None:
        """Apply a new ceiling; :attr:`current` stays within it.

        Raises:
            ValueError: ``ceiling`` is below 1.
        """
        ...
