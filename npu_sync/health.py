"""Active health checks: a daemon thread probes every worker's ``/health``.

Each round checks all workers in parallel, each on its own connection (never the task
connections) and bounded by ``health.timeout``, so a hung worker delays neither the
other checks nor ``close()`` by more than that timeout. Rounds run every
``health.interval`` seconds ±10 % so that many processes do not probe in step.
The checker only *measures*; the pool applies results (thresholds, hints, breaker
trials) under its own lock.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from npu_sync.clock import SYSTEM_CLOCK, Clock
from npu_sync.config import HealthConfig
from npu_sync.transport import Transport, TransportError

log = logging.getLogger(__name__)

JITTER = 0.1
"""Rounds are spaced ``interval * (1 +/- JITTER)`` apart."""


@dataclass(frozen=True, slots=True)
class HealthResult:
    """The outcome of one check of one worker."""

    worker_id: str
    ok: bool
    checked_at: float  # wall-clock epoch seconds
    latency: float | None = None  # seconds
    status: int | None = None
    error: str | None = None
    draining: bool | None = None  # load hints from the body, when present
    max_concurrent: int | None = None
    active_tasks: int | None = None
    generation: int = 0  # which address of the worker was checked (bumped on a move)

    def to_dict(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "ok": self.ok,
            "checked_at": self.checked_at,
            "latency_ms": None if self.latency is None else self.latency * 1000,
            "status": self.status,
            "error": self.error,
            "draining": self.draining,
            "max_concurrent": self.max_concurrent,
            "active_tasks": self.active_tasks,
        }


class Target(Protocol):
    """What the checker needs of a worker: its id and a transport of its own."""

    @property
    def id(self) -> str: ...

    @property
    def health_transport(self) -> Transport: ...


def probe(
    worker_id: str, transport: Transport, config: HealthConfig, clock: Clock = SYSTEM_CLOCK
) -> HealthResult:
    """Check one worker once: GET the health endpoint and read its verdict and hints."""
    checked_at = clock.time()
    started = clock.monotonic()
    try:
        response = transport.request(
            "GET", config.endpoint, timeout=config.timeout, replayable=True
        )
    except TransportError as exc:
        return HealthResult(worker_id, False, checked_at, error=f"{exc.kind}: {exc}")
    except Exception as exc:  # a broken transport must not stop the round
        log.exception("health check of worker %s failed unexpectedly", worker_id)
        return HealthResult(worker_id, False, checked_at, error=f"{type(exc).__name__}: {exc}")
    latency = clock.monotonic() - started
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return HealthResult(
            worker_id, False, checked_at, latency, response.status, "body is not a JSON object"
        )
    status = body.get("status")
    ok = response.status == 200 and status == "healthy"
    error = None if ok else f"HTTP {response.status}, status {status!r}"
    return HealthResult(
        worker_id,
        ok,
        checked_at,
        latency,
        response.status,
        error,
        draining=_bool(body.get("draining")),
        max_concurrent=_positive_int(body.get("max_concurrent")),
        active_tasks=_positive_int(body.get("active_tasks"), allow_zero=True),
    )


def _probe_generation(
    worker_id: str, transport: Transport, config: HealthConfig, clock: Clock, generation: int
) -> HealthResult:
    result = probe(worker_id, transport, config, clock)
    return dataclasses.replace(result, generation=generation) if generation else result


def _bool(value: object) -> bool | None:
    return value if isinstance(value, bool) else None


def _positive_int(value: object, *, allow_zero: bool = False) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if value > 0 or (allow_zero and value == 0) else None


class HealthChecker:
    """Runs health rounds, on demand (:meth:`check_once`) or on a daemon thread.

    Thread-safe: ``check_once`` may be called while the thread runs.

    Args:
        targets: returns the workers to check now (the pool's current set).
        apply: receives each round's results; the pool updates worker state with them.
        config: returns the health settings in force (they are hot-reloadable).
    """

    def __init__(
        self,
        targets: Callable[[], Sequence[Target]],
        apply: Callable[[Mapping[str, HealthResult]], None],
        config: Callable[[], HealthConfig],
        *,
        clock: Clock = SYSTEM_CLOCK,
        rng: random.Random | None = None,
        max_parallel: int = 32,
    ) -> None:
        self._targets = targets
        self._apply = apply
        self._config = config
        self._clock = clock
        self._rng = rng or random.Random()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_parallel, thread_name_prefix="npu-sync-health-check"
        )
        self._running: dict[str, concurrent.futures.Future[HealthResult]] = {}
        self.rounds = 0

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the daemon thread; the first round runs at once."""
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(target=self._run, name="npu-sync-health", daemon=True)
            self._thread.start()

    def wake(self) -> None:
        """The settings changed: start the next wait over with the new interval."""
        self._wake.set()

    def stop(self) -> None:
        """Stop the thread; returns within the health timeout (a check may be in flight)."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._executor.shutdown(wait=True, cancel_futures=True)

    def check_once(self) -> dict[str, HealthResult]:
        """Check every worker now, in parallel; apply and return the results."""
        config = self._config()
        targets = list(self._targets())
        if not targets:
            return {}
        futures: dict[concurrent.futures.Future[HealthResult], str] = {}
        busy: list[str] = []
        generations = {t.id: getattr(t, "generation", 0) for t in targets}
        try:
            with self._lock:
                for t in targets:
                    previous = self._running.get(t.id)
                    if previous is not None and not previous.done():
                        # Never a second probe of a worker whose last one still runs.
                        busy.append(t.id)
                        continue
                    generation = getattr(t, "generation", 0)
                    future = self._executor.submit(
                        _probe_generation, t.id, t.health_transport, config, self._clock, generation
                    )
                    self._running[t.id] = future
                    futures[future] = t.id
        except RuntimeError:  # shut down while a round was starting
            return {}
        # A probe is bounded by its socket timeouts; the margin covers scheduling. One
        # still running after that (a worker that accepted and hung) is reported as
        # failed now, and its thread ends when its read timeout fires.
        done, _ = concurrent.futures.wait(futures, timeout=config.timeout + 0.5)
        now = self._clock.time()
        results: dict[str, HealthResult] = {
            worker_id: HealthResult(
                worker_id,
                False,
                now,
                error="previous check still running",
                generation=generations[worker_id],
            )
            for worker_id in busy
        }
        for future, worker_id in futures.items():
            if future in done and not future.cancelled():
                results[worker_id] = future.result()
            else:
                results[worker_id] = HealthResult(
                    worker_id,
                    False,
                    now,
                    error=f"no answer within {config.timeout}s",
                    generation=generations[worker_id],
                )
        self.rounds += 1
        self._apply(results)
        return results

    def _run(self) -> None:
        delay = 0.0
        while True:
            if self._wake.wait(delay):
                self._wake.clear()
                if self._stop.is_set():
                    return
                delay = self._next_delay()  # new settings: wait the new interval
                continue
            if self._stop.is_set():
                return
            if self._config().enabled:  # a reload may turn checks off, and on again
                try:
                    self.check_once()
                except Exception:  # the thread must outlive any bad round
                    log.exception("health round failed")
            delay = self._next_delay()

    def _next_delay(self) -> float:
        return self._config().interval * self._rng.uniform(1 - JITTER, 1 + JITTER)
