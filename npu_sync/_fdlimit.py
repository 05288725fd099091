"""Whether the process may open the file descriptors a configuration may need.

A pool's sockets are bounded by its configuration: the idle keep-alive connections of
all workers together (``transport.max_idle_connections``), one socket per health check
in flight (``health.concurrency``), and one per task in flight, which the pool's own
threads bound for ``submit``/``map`` (``pool.threads``) and ``max_concurrent`` bounds
per worker. Against the soft ``RLIMIT_NOFILE`` (``ulimit -n``, 1024 by default on
Linux) that sum, plus a reserve for the process's own files, must fit; otherwise the
pool fails at start with an error that says which limit to raise and to what, instead
of failing tasks with ``EMFILE`` ("too many open files") later.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from npu_sync.config import PoolConfig
from npu_sync.errors import ConfigError

RESERVE = 64
"""Descriptors left for the process itself: its standard streams, log files, the
dead-letter store, the interpreter's own, a Redis connection or two."""


@dataclass(frozen=True, slots=True)
class Need:
    """What a configuration may hold open at once, by cause."""

    idle: int
    health: int
    tasks: int
    reserve: int = RESERVE

    @property
    def total(self) -> int:
        return self.idle + self.health + self.tasks + self.reserve

    def explain(self) -> str:
        return (
            f"transport.max_idle_connections {self.idle} + health.concurrency {self.health}"
            f" + tasks in flight {self.tasks} + {self.reserve} for the process"
        )


def need(config: PoolConfig) -> Need:
    """The descriptors ``config`` may hold open at once (see the module's docstring)."""
    in_flight = sum(w.max_concurrent for w in config.workers if w.enabled)
    return Need(
        idle=config.transport.max_idle_connections,
        health=config.health.concurrency if config.health.enabled else 0,
        tasks=min(in_flight, config.pool.threads),
    )


def _getrlimit() -> tuple[int, int] | None:
    try:
        import resource
    except ImportError:  # not a Unix: no such limit to read
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft, hard


def check(config: PoolConfig, getrlimit: Callable[[], tuple[int, int] | None] = _getrlimit) -> Need:
    """Raise when the soft ``RLIMIT_NOFILE`` is below what ``config`` may need.

    Returns:
        What the configuration may need.

    Raises:
        ConfigError: names the limit, the figure to raise it to, and the keys that
            make up that figure.
    """
    wanted = need(config)
    limits = getrlimit()
    if limits is None:
        return wanted
    soft, hard = limits
    infinite = soft < 0  # RLIM_INFINITY
    if infinite or soft >= wanted.total:
        return wanted
    where = (
        f"raise it to at least {wanted.total} (`ulimit -n {wanted.total}`, or LimitNOFILE= "
        f"for a systemd service)"
        if hard < 0 or hard >= wanted.total
        else f"the hard limit is {hard}: raise both to at least {wanted.total}"
    )
    raise ConfigError(
        f"the open-file limit (RLIMIT_NOFILE, `ulimit -n`) is {soft}, but this "
        f"configuration may open {wanted.total} files at once ({wanted.explain()}): "
        f"{where}, or lower transport.max_idle_connections or health.concurrency"
    )
