"""Which workers meet a task's ``requires`` and ``prefers``: capabilities and tags.

A need is a capability name (``vision``: the worker lists it in ``capabilities``) or a
tag (``location=lab``: the worker's ``tags`` map ``location`` to ``lab``). The answer
depends only on the configuration, so it is worked out once per configuration and set
of needs, and a task that needs nothing never comes here.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from npu_sync._config_types import PoolConfig, WorkerConfig

__all__ = ["CapabilityFilter", "lacked", "meets"]

_MAX_CACHED = 256  # distinct sets of needs remembered per configuration


def meets(worker: WorkerConfig, needs: Iterable[str]) -> bool:
    """Whether ``worker`` has every capability and tag in ``needs``."""
    for need in needs:
        key, eq, value = need.partition("=")
        if eq:
            if worker.tags.get(key) != value:
                return False
        elif need not in worker.capabilities:
            return False
    return True


def lacked(worker: WorkerConfig, needs: Iterable[str]) -> str:
    """What of ``needs`` ``worker`` lacks, in words (``capability 'vision', tag
    site=lab``); empty when it has them all."""
    return ", ".join(_shown(n) for n in sorted(needs) if not meets(worker, (n,)))


def _shown(need: str) -> str:
    key, eq, value = need.partition("=")
    return f"tag {key}={value}" if eq else f"capability {need!r}"


class CapabilityFilter:
    """The ids of the workers that do not meet a set of needs, per configuration.

    Thread-safe: the cache is one (configuration, dict) pair swapped whole when the
    configuration changes; two threads filling it at once compute the same answer.
    """

    __slots__ = ("_cache",)

    def __init__(self) -> None:
        self._cache: tuple[PoolConfig | None, dict[frozenset[str], frozenset[str]]] = (None, {})

    def unfit(self, config: PoolConfig, needs: Collection[str]) -> frozenset[str]:
        """The ids of ``config``'s workers that lack any of ``needs``."""
        if type(needs) is not frozenset:
            needs = frozenset(needs)
        cached_config, found = self._cache
        if cached_config is not config:
            found = {}
            self._cache = (config, found)
        result = found.get(needs)
        if result is None:
            if len(found) >= _MAX_CACHED:
                found.clear()
            result = frozenset(w.id for w in config.workers if not meets(w, needs))
            found[needs] = result
        return result

    def missing(self, config: PoolConfig, needs: Collection[str]) -> str:
        """Why no worker of ``config`` meets ``needs``, for a rejection: the needs no
        worker has at all, else the closest workers and what each lacks."""
        workers = config.workers
        if not workers:
            return "the pool has no workers"
        nobody = sorted(n for n in needs if not any(meets(w, (n,)) for w in workers))
        if nobody:
            return "no worker has " + ", ".join(_shown(n) for n in nobody)
        return "no worker has them all: " + lacking(workers, needs)

    def unmet(self, config: PoolConfig, needs: Collection[str], ids: Collection[str]) -> str:
        """What each of the workers ``ids`` lacks of ``needs``, for a rejection of a
        task that other workers meet but none of them may serve."""
        return lacking([w for w in config.workers if w.id in ids], needs)


def lacking(workers: Sequence[WorkerConfig], needs: Collection[str]) -> str:
    """``"a lacks capability 'vision'; b lacks tag site=lab"``: the first five workers
    and what each lacks of ``needs``."""
    lacks = []
    for worker in workers[:5]:
        absent = sorted(n for n in needs if not meets(worker, (n,)))
        lacks.append(f"{worker.id} lacks " + ", ".join(_shown(n) for n in absent))
    more = " ..." if len(workers) > 5 else ""
    return "; ".join(lacks) + more
