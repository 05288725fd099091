"""One worker as the pool sees it: its config, its connection pool, its breaker, its load.

What the health checks learnt of it is :mod:`npu_sync._health`'s (``worker.health``), what
it holds is :mod:`npu_sync._holdings`'s (``worker.held``); the worker keeps the counts they
decide (``healthy``, ``capacity``, ``priority``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, cast

from npu_sync._breaker import WorkerBreaker
from npu_sync._health import WorkerHealth
from npu_sync._holdings import Holdings
from npu_sync._latency import DEFAULT_DECAY, MIN_COST
from npu_sync._metrics import WorkerStats
from npu_sync._stall import Pace
from npu_sync._stats_types import WorkerRow
from npu_sync.auth import RequestAuth, from_config
from npu_sync.config import WorkerConfig
from npu_sync.protocols import WorkerProtocol, get_protocol
from npu_sync.transport import Transport

if TYPE_CHECKING:
    from npu_sync._balancing.limits import ConcurrencyLimit
    from npu_sync._health import HealthResult


Balancing = tuple[float, float, float, float, bool, float]
"""What a ``workers()`` row shows of the selector's state of a worker: share, latency
estimate, its stamp and decay, whether observed, when its slow start ends."""

UNSEEN: Balancing = (1.0, MIN_COST, 0.0, DEFAULT_DECAY, False, -math.inf)
"""That state for a worker no selector has seen."""

CPU_PENALTY = 0.5
"""Added to the priority of a worker that reports ``npu_available: false``: it forms a
tier of its own, after the NPU workers of its configured tier and before the next."""


class Worker:
    """Runtime state of one worker.

    Not thread-safe on its own: every mutable field (``in_flight``, ``capacity``,
    ``healthy``, ``draining``, ``cooldown_until``, ``stats``, the breaker) is read and
    written under the pool's selection lock. ``transport`` is thread-safe and used
    outside that lock.

    ``weight`` is the configured weight; what the selector learns of the worker (its
    latency estimate, slow start, share, score) is the selector's own, in its slot
    (see :mod:`npu_sync._balancing.slot`), read through it
    (:meth:`Selector.state_of <npu_sync._balancing.selector.Selector.state_of>`).
    ``pace``, the recent successful durations the stall limit reads, stays here: the
    task's life reads it. ``limit`` is the adaptive concurrency limit, if any.

    Identity: ``id``, ``config``, ``generation`` (bumped when the worker moves to a
    new address), ``priority`` (its configured tier, after the NPU workers of that
    tier when it reported no NPU), ``base_path``, ``enabled`` and ``removed``.
    ``protocol`` and ``auth`` say how to talk to it, ``breaker`` whether it is sick.
    Counts: ``in_flight`` and ``capacity``; ``healthy``; ``draining`` (being removed);
    ``cooldown_until`` (a ``Retry-After``); ``refused`` and ``refused_until`` (the
    operator's credentials refused, see :mod:`npu_sync._outage`); ``stats``; ``routed``,
    the generation whose inference path answered a task (see :mod:`npu_sync._blame`).

    Owned elsewhere: ``health`` (:class:`~npu_sync._health.WorkerHealth`: rise/fall
    counts, hints, the last check, the checks' connection) and ``held``
    (:class:`~npu_sync._holdings.Holdings`: models, device, NPU). The worker applies
    what they decide to its counts (:meth:`apply_health`, :meth:`rank`).
    """

    __slots__ = (
        "auth",
        "base_path",
        "breaker",
        "capacity",
        "config",
        "cooldown_until",
        "draining",
        "enabled",
        "generation",
        "health",
        "healthy",
        "held",
        "id",
        "in_flight",
        "limit",
        "pace",
        "priority",
        "protocol",
        "refused",
        "refused_until",
        "removed",
        "routed",
        "stats",
        "transport",
        "weight",
    )

    def __init__(
        self,
        config: WorkerConfig,
        transport: Transport,
        breaker: WorkerBreaker,
        health_transport: Transport,
    ) -> None:
        self.id = config.id
        self.transport = transport
        self.breaker = breaker
        self.in_flight = 0
        self.healthy = True
        self.health = WorkerHealth(health_transport)
        self.draining = False  # being removed: finishes its tasks, takes no new ones
        self.removed = False
        self.generation = 0  # bumped when the worker moves: older outcomes are stale
        # The generation whose inference path answered a task (-1: none yet): an NPU
        # worker at this address, whatever it answers later (see npu_sync._blame).
        self.routed = -1
        self.cooldown_until = 0.0
        # The operator's fault, not the worker's sickness (see npu_sync._outage): why
        # the worker refused the pool's credentials, and until when it takes no task.
        self.refused: str | None = None
        self.refused_until = 0.0
        self.stats = WorkerStats()
        self.pace = Pace()  # recent successful durations, for the stall limit
        self.limit: ConcurrencyLimit | None = None
        self.weight = 1
        self.protocol: WorkerProtocol = get_protocol(config.protocol)
        self.held = Holdings(self.protocol.loads_on_demand)
        self.auth: RequestAuth | None = None
        self.configure(config)

    def configure(self, config: WorkerConfig) -> None:
        """Take a new configuration of the same worker (priority, capacity, enabled,
        protocol, auth). New credentials, or a new address, are tried again at once
        by the next task, whatever the old ones were refused for."""
        old = getattr(self, "config", None)
        if old is not None and (old.auth != config.auth or old.headers != config.headers):
            self.refused = None
            self.refused_until = 0.0
        self.config = config
        protocol = get_protocol(config.protocol)
        if protocol is not self.protocol:
            # A list read in another protocol's terms.
            self.held.forget_models(protocol.loads_on_demand)
        self.protocol = protocol
        self.auth = from_config(config.auth)
        self.base_path = config.base_path
        self.rank()
        self.enabled = config.enabled
        # Until the configuration declares it, every worker weighs 1.
        self.weight = int(getattr(config, "weight", 1))
        self._update_capacity()

    @property
    def health_transport(self) -> Transport:
        """The health checks' own connection (what :class:`~npu_sync._health.Target`
        asks of a worker)."""
        return self.health.transport

    def apply_health(self, result: HealthResult, unhealthy_after: int, healthy_after: int) -> bool:
        """Count a health check (see :meth:`WorkerHealth.apply
        <npu_sync._health.WorkerHealth.apply>`); returns whether ``healthy`` changed."""
        was = self.healthy
        self.healthy = self.health.apply(result, was, unhealthy_after, healthy_after)
        if result.ok:
            self._update_capacity()  # the hint may have changed
        return self.healthy != was

    def await_first_check(self) -> None:
        """Take no task until a health check passes, which is asked for now: a worker a
        reload added (make before break). Until that check is applied, the worker may
        come at any moment, so a task waits for it (see :mod:`npu_sync._outage`)."""
        self.healthy = False
        self.health.await_first_check()

    def take_out(self, reason: str) -> bool:
        """Take the worker out of service: it is misconfigured (``reason`` says how),
        not sick, so its breaker is left alone. It comes back as an unhealthy worker
        does, after ``health.healthy_threshold`` passed checks, or when a reload moves
        it to a new address. Returns whether it was in service."""
        self.stats.last_error = reason
        self.health.restart()
        was = self.healthy
        self.healthy = False
        return was

    def moved(self, transport: Transport, health_transport: Transport) -> None:
        """The worker's address changed: new connections, and nothing learnt about the
        old address (health, hints, breaker, cool-down) carries over."""
        self.generation += 1
        self.transport = transport
        self.health.forget(health_transport)
        self.healthy = True
        self.cooldown_until = 0.0
        self.refused = None
        self.refused_until = 0.0
        self.breaker.reset()
        self.held.forget()
        self.rank()
        self._update_capacity()

    def rank(self) -> None:
        """Set ``priority`` from the configured tier and what the worker reported: one
        fallen back to CPU comes after the NPU workers of its tier. Call after
        ``held.apply_models()``."""
        base = self.config.priority
        self.priority = base + CPU_PENALTY if self.held.npu_available is False else base

    def set_limit(self, limit: ConcurrencyLimit | None) -> None:
        """Let ``limit`` find this worker's concurrency (None: ``max_concurrent`` alone).

        The capacity is then the smallest of ``max_concurrent`` (the limit's ceiling),
        the worker's own hint and the limit's current value. Tell the dispatcher
        (``release_worker_locked``) afterwards: the capacity may have grown.
        """
        self.limit = limit
        self._update_capacity()

    def sample_limit(self, rtt: float, in_flight: int, dropped: bool) -> bool:
        """Feed the adaptive limit one attempt; returns whether the capacity changed.

        Args:
            rtt: the attempt's duration in seconds.
            in_flight: tasks in flight here when the attempt started (the lease's).
            dropped: the worker turned it away for overload (429, 503, a timeout).
        """
        if self.limit is None:
            return False
        self.limit.on_sample(rtt, in_flight, dropped)
        before = self.capacity
        self._update_capacity()
        return self.capacity != before

    def _update_capacity(self) -> None:
        hinted = self.health.hinted_capacity
        limit = self.config.max_concurrent
        capacity = limit if hinted is None else min(limit, hinted)
        if self.limit is not None:
            capacity = min(capacity, self.limit.current)
        self.capacity = capacity

    def eligible(self, now: float) -> bool:
        """Whether a new attempt may start here now (ignoring per-task exclusions)."""
        return (
            self.in_flight < self.capacity
            and self.healthy
            and self.enabled
            and not self.draining
            and not self.health.hinted_draining
            and now >= self.cooldown_until
            and now >= self.refused_until
            and self.breaker.can_admit(now)
        )

    def capture(self, balancing: Balancing = UNSEEN) -> dict[str, Any]:
        """Copy what :func:`render` needs. Call under the pool's lock; cheap.

        Args:
            balancing: the selector's state of this worker
                (:meth:`Selector.captured <npu_sync._balancing.selector.Selector.captured>`).
        """
        share, cost, stamp, decay, observed, ramp_until = balancing
        held = self.held
        return {
            "id": self.id,
            "name": self.config.name,
            "url": self.config.url,
            "priority": self.config.priority,
            "protocol": self.config.protocol,
            "models": None if held.models is None else sorted(held.models),
            "device": held.device,
            "npu_available": held.npu_available,
            "max_models": self.config.max_models or held.max_models,
            "enabled": self.enabled,
            "draining": self.draining or self.health.hinted_draining,
            "removed": self.removed,
            "healthy": self.healthy,
            "health": self.health.last,
            "breaker": {
                "state": self.breaker.state,
                "trips": self.breaker.trips,
                "failures": self.breaker.failures,
                "reset_timeout": self.breaker.reset_timeout,
            },
            "in_flight": self.in_flight,
            "capacity": self.capacity,
            "cooldown_until": self.cooldown_until,
            "stats": self.stats.copy(),
            "balancing_state": (
                self.weight,
                share,
                cost,
                stamp,
                decay,
                observed,
                ramp_until,
                None if self.limit is None else self.limit.stats(),
            ),
        }

    def snapshot(self, now: float, balancing: Balancing = UNSEEN) -> WorkerRow:
        """A JSON-serialisable view. Call under the pool's lock."""
        return render(self.capture(balancing), now)


def render(captured: dict[str, Any], now: float) -> WorkerRow:
    """Turn a :meth:`Worker.capture` into the JSON-serialisable ``workers()`` row."""
    stats: WorkerStats = captured.pop("stats")
    health: HealthResult | None = captured.pop("health")
    cooldown_until: float = captured.pop("cooldown_until")
    weight, share, cost, stamp, decay, observed, ramp_until, limit = captured.pop("balancing_state")
    p50, p95, p99 = stats.latency.percentiles(50, 95, 99)
    row = dict(captured)
    row["health"] = None if health is None else health.to_dict()
    row.update(
        {
            "tasks": {
                "attempts": stats.attempts,
                "succeeded": stats.succeeded,
                "failed": stats.failed,
                "rejected": stats.rejected,
                "not_here": stats.not_here,
                "abandoned": stats.abandoned,
            },
            "failure_rate": stats.outcomes.failure_rate(now),
            "latency": {
                "ewma_ms": None if stats.latency_ewma is None else stats.latency_ewma * 1000,
                "p50_ms": None if p50 is None else p50 * 1000,
                "p95_ms": None if p95 is None else p95 * 1000,
                "p99_ms": None if p99 is None else p99 * 1000,
            },
            "last_error": stats.last_error,
            "last_error_at": stats.last_error_at,
            "cooldown_remaining": max(0.0, cooldown_until - now),
            "balancing": {
                "weight": weight,
                "share": share,
                # The estimate decayed to now, as the selector sees it.
                "latency_estimate_ms": (
                    cost * math.exp((stamp - now) / decay) if now > stamp else cost
                )
                * 1000.0,
                "latency_observed": observed,
                "slow_start_until": ramp_until if ramp_until > now else None,
                "limit": None if limit is None else limit["limit"],
                "limit_mode": None if limit is None else limit["mode"],
            },
        }
    )
    return cast(WorkerRow, row)
