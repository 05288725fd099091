"""Priority classes: which waiting task a freed slot goes to, and capacity kept per class.

A task names a class (``Task(priority="interactive")``); a task that names none is of
``priority.default``. The classes are ordered, highest first. They matter only when
workers are saturated and tasks wait (see :mod:`npu_sync._admission`):

* **served first**: a freed slot goes to the waiting task of the highest class, the
  longest waiting within a class. With every waiting task of one class the queue is
  the plain FIFO it always was, at no extra cost;
* **reserved capacity**: a class's ``reserve`` is a share of the pool's capacity (the
  slots of the workers in service) that only it and the classes above it may fill. A
  ``batch`` task finds no room once the pool's tasks in flight reach its *ceiling*,
  the capacity less what the classes above it reserve, even while a slot is free.
  The reserve never takes the last slot: every class may use at least one;
* **aging**: a waiting task moves up one class for every ``priority.aging`` seconds
  it has waited, for both rules. A batch task behind a stream of interactive ones is
  served, at the latest, once it has waited ``aging`` times the classes between them:
  no class is starved for ever.

Immutable, so thread-safe: a reload builds a new :class:`PriorityClasses` and the
dispatcher swaps it in under its lock. A task waiting when its class is removed by a
reload is served as the default class.

Per process: the reservation counts this process's tasks in flight against its
workers' capacity. Under gunicorn each process keeps its own reserve (see
docs/priority.md for what holds fleet-wide).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from npu_sync._breaker import OPEN
from npu_sync._config_types import PriorityConfig
from npu_sync._worker import Worker
from npu_sync.errors import InvalidTask

__all__ = ["PriorityClasses"]


class PriorityClasses:
    """The classes in force, as admission uses them. Immutable, so thread-safe.

    Args:
        config: the ``priority`` section.
    """

    __slots__ = ("above", "aging", "config", "default_rank", "names", "ranks", "reserving")

    def __init__(self, config: PriorityConfig | None = None) -> None:
        config = config if config is not None else PriorityConfig()
        self.config = config
        self.names: tuple[str, ...] = tuple(c.name for c in config.classes)
        self.ranks: dict[str, int] = {name: i for i, name in enumerate(self.names)}
        self.default_rank = self.ranks[config.default]
        # The share of capacity a class may not fill: what the classes above reserve.
        above = []
        total = 0.0
        for c in config.classes:
            above.append(total)
            total += c.reserve
        self.above: tuple[float, ...] = tuple(above)
        self.reserving = any(share > 0 for share in self.above)
        self.aging = config.aging

    def rank(self, name: str | None) -> int:
        """The rank (0 the highest) of class ``name``; None is the default class.

        Raises:
            InvalidTask: no class has that name.
        """
        if name is None:
            return self.default_rank
        rank = self.ranks.get(name)
        if rank is None:
            raise InvalidTask(
                f"task priority {name!r} is not a class of this pool "
                f"(priority.classes: {', '.join(self.names)})"
            )
        return rank

    def rank_or_default(self, name: str | None) -> int:
        """Like :meth:`rank`, but a class no longer known (a reload removed it) is the
        default class."""
        if name is None:
            return self.default_rank
        return self.ranks.get(name, self.default_rank)

    def effective(self, rank: int, waited: float) -> int:
        """The class a task of ``rank`` counts as after waiting ``waited`` seconds."""
        aging = self.aging
        if aging <= 0 or waited < aging or rank == 0:
            return rank
        return max(0, rank - int(waited / aging))

    def next_step(self, rank: int, waited: float) -> float | None:
        """Seconds until a task of ``rank`` that has waited ``waited`` counts one class
        higher, when that may let it into capacity kept for the classes above; None
        when it never will: aging is off, nothing is reserved, or it already counts as
        the top class (a waiter woken on every aging period for ever would spin once
        there is nothing left to gain)."""
        aging = self.aging
        if aging <= 0 or not self.reserving or self.effective(rank, waited) == 0:
            return None
        return aging - waited % aging

    def may_take(self, rank: int, workers: Iterable[Worker]) -> bool:
        """Whether a task counting as ``rank`` may take one more slot among ``workers``:
        the tasks in flight are below the capacity less what the classes above reserve.
        Call under the pool's lock."""
        share = self.above[rank] if rank < len(self.above) else self.above[-1]
        if share <= 0.0:
            return True
        capacity = 0
        used = 0
        for worker in workers:
            used += worker.in_flight
            if (
                worker.enabled
                and not worker.draining
                and worker.healthy
                and worker.breaker.state != OPEN
            ):
                capacity += worker.capacity
        # Never the whole of it: with few slots (one worker of one slot, or a fleet
        # reduced by failures) or reserves adding up to nearly 1, ceil() would keep
        # every slot, and a lower class would wait beside an idle worker.
        kept = min(math.ceil(share * capacity), capacity - 1)
        return used < capacity - kept
