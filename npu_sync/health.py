"""Active health checks: a daemon thread probes every worker's ``/health``.

Each round checks all workers in parallel, each on a thread and a connection of its
own (never the task connections) and bounded by ``health.timeout``, so a hung worker
delays neither the other checks nor ``close()`` by more than that timeout, and
whatever one worker answers fails at most that worker's check. Rounds run every
``health.interval`` seconds ±10 % so that many processes do not probe in step.
The checker only *measures*; the pool applies results (thresholds, hints, breaker
trials, model lists) under its own lock.

Each probe speaks the worker's protocol and carries its auth headers. A passed check
of a worker whose protocol lists models apart (``models_path``, AutoBot's Linux
``GET /models``) reads that list too, on the same connection and within the same
``health.timeout``, when the pool asks for model lists.

A probe's error text is what the worker said: it is scrubbed of the configuration's
secrets and bounded (:class:`~npu_sync.redact.Scrubber`) before the result leaves the
probe, so neither ``workers()``, ``npu-sync status`` nor a log line shows a credential
the worker quoted back.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from npu_sync.auth import RequestAuth
from npu_sync.clock import SYSTEM_CLOCK, Clock
from npu_sync.config import HealthConfig
from npu_sync.errors import printable
from npu_sync.protocols import LINUX, WorkerProtocol
from npu_sync.redact import NO_SCRUBBER, Scrubber
from npu_sync.retry import NOT_A_WORKER, REFUSED_CREDENTIALS
from npu_sync.transport import Response, Transport, TransportError

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
    # The answer is not a worker's (404/405, a body that is not the protocol's): the
    # entry points at something else, and the worker is taken out at once.
    not_a_worker: bool = False
    # What the worker says of itself, when the answers said it (never in to_dict()).
    models: frozenset[str] | None = None  # None: no list read this time
    models_at: float = 0.0  # monotonic time the list was asked for
    model_devices: Mapping[str, str] | None = None
    npu_available: bool | None = None
    device: str | None = None

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


MAX_BODY_BYTES = 1024 * 1024
"""A health answer larger than this fails its check without being decoded."""


def probe(
    worker_id: str,
    transport: Transport,
    config: HealthConfig,
    clock: Clock = SYSTEM_CLOCK,
    *,
    protocol: WorkerProtocol = LINUX,
    auth: RequestAuth | None = None,
    base_path: str = "",
    models: bool = False,
    scrubber: Scrubber = NO_SCRUBBER,
) -> HealthResult:
    """Check one worker once: GET the health endpoint and read its verdict and hints;
    with ``models``, read its model list too (see the module's docstring). The error
    text is passed through ``scrubber``.

    Never raises: whatever goes wrong is a failed check of this worker.
    """
    result = _probe(
        worker_id, transport, config, clock, protocol, auth, base_path, models, scrubber
    )
    if result.error is not None:
        result = dataclasses.replace(result, error=scrubber(result.error))
    return result


def _probe(
    worker_id: str,
    transport: Transport,
    config: HealthConfig,
    clock: Clock,
    protocol: WorkerProtocol,
    auth: RequestAuth | None,
    base_path: str,
    models: bool,
    scrubber: Scrubber,
) -> HealthResult:
    checked_at = clock.time()
    started = clock.monotonic()
    path = config.endpoint
    try:
        response = transport.request(
            "GET",
            path,
            headers=None if auth is None else auth.headers("GET", base_path + path),
            timeout=config.timeout,
            replayable=True,
        )
    except TransportError as exc:
        return HealthResult(worker_id, False, checked_at, error=f"{exc.kind}: {exc}")
    except Exception as exc:  # a broken transport must not stop the round
        log.exception("health check of worker %s failed unexpectedly", worker_id)
        return HealthResult(worker_id, False, checked_at, error=f"{type(exc).__name__}: {exc}")
    latency = clock.monotonic() - started
    try:
        result = _verdict(
            worker_id, response, checked_at, latency, protocol, started, base_path + path
        )
    except Exception as exc:  # an answer no rule foresaw fails this check, nothing more
        log.exception("health answer of worker %s could not be read", worker_id)
        return HealthResult(
            worker_id,
            False,
            checked_at,
            latency,
            response.status,
            f"unreadable answer: {type(exc).__name__}",
        )
    models_path = protocol.models_path
    if models and result.ok and models_path is not None:
        left = config.timeout - (clock.monotonic() - started)
        if left > 0.001:
            result = _with_models(
                result, transport, protocol, auth, base_path, left, clock, scrubber
            )
    return result


def _with_models(
    result: HealthResult,
    transport: Transport,
    protocol: WorkerProtocol,
    auth: RequestAuth | None,
    base_path: str,
    timeout: float,
    clock: Clock,
    scrubber: Scrubber = NO_SCRUBBER,
) -> HealthResult:
    """``result`` with the worker's model list, when it can be read in ``timeout``;
    a list that cannot be read leaves the last one standing (never a failed check)."""
    asked = clock.monotonic()
    path = protocol.models_path or "/models"
    try:
        response = transport.request(
            "GET",
            path,
            headers=None if auth is None else auth.headers("GET", base_path + path),
            timeout=timeout,
            replayable=True,
        )
        if response.status != 200 or len(response.body) > MAX_BODY_BYTES:
            raise ValueError(f"HTTP {response.status}")
        info = protocol.parse_models(response.json())
    except (TransportError, ValueError, RecursionError) as exc:
        log.debug("model list of worker %s not read: %s", result.worker_id, scrubber(str(exc)))
        return result
    except Exception:
        log.exception("model list of worker %s could not be read", result.worker_id)
        return result
    if info is None:
        log.debug("model list of worker %s is not one", result.worker_id)
        return result
    return dataclasses.replace(
        result,
        models=info.models,
        models_at=asked,
        model_devices=info.devices,
        npu_available=(
            info.npu_available if info.npu_available is not None else result.npu_available
        ),
        device=result.device or info.optimal_device,
    )


def _verdict(
    worker_id: str,
    response: Response,
    checked_at: float,
    latency: float,
    protocol: WorkerProtocol = LINUX,
    started: float = 0.0,
    path: str = "/health",
) -> HealthResult:
    def failed(error: str, *, not_a_worker: bool = False) -> HealthResult:
        return HealthResult(
            worker_id,
            False,
            checked_at,
            latency,
            response.status,
            error,
            not_a_worker=not_a_worker,
        )

    if len(response.body) > MAX_BODY_BYTES:
        return failed(f"body of {len(response.body)} bytes is over {MAX_BODY_BYTES}")
    try:
        body = response.json()
    except (ValueError, RecursionError):
        # RecursionError: JSON nested deeper than the interpreter's recursion limit.
        body = None
    if response.status in REFUSED_CREDENTIALS:
        # Not the worker's sickness but its credentials here (or there): say so, with
        # the worker's own reason, for the pool to take it out and for the probe.
        detail = body.get("detail") if isinstance(body, dict) else None
        reason = f": {printable(detail[:300])}" if isinstance(detail, str) else ""
        return failed(f"credentials refused: HTTP {response.status}{reason}")
    misrouted = _not_a_worker(response.status, body)
    if misrouted is not None:
        return failed(f"{NOT_A_WORKER}: GET {path} → {misrouted}", not_a_worker=True)
    if not isinstance(body, dict):
        return failed("body is not a JSON object")
    status = body.get("status")
    ok = response.status == 200 and status == "healthy"
    error = None if ok else f"HTTP {response.status}, status {_short(status)}"
    info = protocol.parse_health(body)
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
        models=info.models if protocol.models_path is None else None,
        models_at=started,
        npu_available=info.npu_available,
        device=info.device,
    )


def _not_a_worker(status: int, body: object) -> str | None:
    """What shows that a health answer is not an NPU worker's, or None.

    A worker answers its health path (even when sick: 503 with a status), so a 404 or
    405 there means the URL points elsewhere; so does a 2xx whose body is not a JSON
    object with a ``status`` (an HTML page, another service's JSON).
    """
    if status in (404, 405):
        return str(status)
    if 200 <= status < 300 and not (isinstance(body, dict) and "status" in body):
        what = "a JSON object without a status" if isinstance(body, dict) else "not a JSON object"
        return f"{status}, {what}"
    return None


def _short(value: object) -> str:
    """A status as an error quotes it: a worker's answer may be any size or depth."""
    if isinstance(value, (dict, list)):
        return f"of type {type(value).__name__}"
    try:
        text = repr(value)
    except ValueError:  # an int beyond sys.get_int_max_str_digits()
        return "a very large integer"
    return text if len(text) <= 80 else text[:77] + "..."


def _probe_generation(
    worker_id: str,
    transport: Transport,
    config: HealthConfig,
    clock: Clock,
    generation: int,
    options: Mapping[str, Any],
) -> HealthResult:
    result = probe(worker_id, transport, config, clock, **options)
    return dataclasses.replace(result, generation=generation) if generation else result


def _run_probe(
    future: concurrent.futures.Future[HealthResult],
    worker_id: str,
    transport: Transport,
    config: HealthConfig,
    clock: Clock,
    generation: int,
    options: Mapping[str, Any],
) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = _probe_generation(worker_id, transport, config, clock, generation, options)
    except BaseException as exc:  # the round must learn of it, as of any other end
        future.set_exception(exc)
    else:
        future.set_result(result)


def _bool(value: object) -> bool | None:
    return value if isinstance(value, bool) else None


def _positive_int(value: object, *, allow_zero: bool = False) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if value > 0 or (allow_zero and value == 0) else None


# A round waits this long past health.timeout for its probes: scheduling, not network.
_ROUND_MARGIN = 0.5
# Event.wait raises OverflowError beyond threading.TIMEOUT_MAX, which would end the
# thread; no valid interval (at most a day, plus jitter) comes near this cap.
_MAX_DELAY = 86400 * (1 + JITTER)
# The wait after a round whose settings could not be read at all.
_FALLBACK_DELAY = HealthConfig().interval


class HealthChecker:
    """Runs health rounds, on demand (:meth:`check_once`) or on a daemon thread.

    Thread-safe: ``check_once`` may be called while the thread runs.

    Args:
        targets: returns the workers to check now (the pool's current set). A target
            with ``protocol``, ``auth`` and ``base_path`` attributes is spoken to in its
            protocol, with its auth headers.
        apply: receives each round's results; the pool updates worker state with them.
        config: returns the health settings in force (they are hot-reloadable).
        models: returns whether passed checks read the workers' model lists too.
        scrubber: returns the scrubber that keeps secrets out of the probes' error
            texts (read once per round).
    """

    def __init__(
        self,
        targets: Callable[[], Sequence[Target]],
        apply: Callable[[Mapping[str, HealthResult]], None],
        config: Callable[[], HealthConfig],
        *,
        clock: Clock = SYSTEM_CLOCK,
        rng: random.Random | None = None,
        models: Callable[[], bool] = lambda: False,
        scrubber: Callable[[], Scrubber] = lambda: NO_SCRUBBER,
    ) -> None:
        self._models = models
        self._scrubber = scrubber
        self._targets = targets
        self._apply = apply
        self._config = config
        self._clock = clock
        self._rng = rng or random.Random()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._soon = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        # Each worker's latest probe, and the thread running it.
        self._running: dict[
            str, tuple[concurrent.futures.Future[HealthResult], threading.Thread]
        ] = {}
        self.rounds = 0

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the daemon thread, or start it again if it died; the first round runs
        at once. Does nothing once :meth:`stop` was called.
        """
        with self._lock:
            if self._stop.is_set() or self.running:
                return
            if self._thread is not None:
                log.warning("the health thread had ended; starting it again")
            self._wake.clear()  # the new thread reads the settings in force anyway
            self._thread = threading.Thread(target=self._run, name="npu-sync-health", daemon=True)
            self._thread.start()

    def wake(self) -> None:
        """The settings changed: start the next wait over with the new interval."""
        self._wake.set()

    def check_soon(self) -> None:
        """Run a round now rather than at the end of the current wait (new workers to
        hear from); a thread that is not running is left so."""
        self._soon.set()
        self._wake.set()

    def stop_soon(self) -> None:
        """Ask the thread to stop after its current round, without waiting for it."""
        self._stop.set()
        self._wake.set()

    def stop(self) -> None:
        """Stop the thread and wait for probes in flight.

        Returns within about ``health.timeout`` + 0.5 s: a round in progress waits at
        most that long for its probes, and every probe is bounded by ``health.timeout``
        end to end. A probe that overruns even that (a transport not keeping to its
        budget) is left to end on its own; its thread is a daemon.
        """
        try:
            budget = self._config().timeout + _ROUND_MARGIN
        except Exception:
            budget = HealthConfig().timeout + _ROUND_MARGIN
        # Every probe running now, and every probe of a round in progress, started
        # before this and ends within health.timeout of its start.
        deadline = time.monotonic() + budget
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()  # a round in progress waits at most `budget` for its probes
        with self._lock:
            probes = [probe_thread for _, probe_thread in self._running.values()]
        for probe_thread in probes:
            if probe_thread is not threading.current_thread():
                probe_thread.join(max(0.0, deadline - time.monotonic()))

    def check_once(self) -> dict[str, HealthResult]:
        """Check every worker now, in parallel; apply and return the results."""
        config = self._config()
        targets = list(self._targets())
        if not targets:
            return {}
        futures: dict[concurrent.futures.Future[HealthResult], str] = {}
        # Workers whose probe from another round still runs: never probed twice at
        # once. That probe's answer, if it comes in time, is this round's answer too,
        # but it is applied once, by the round that started it.
        busy: dict[concurrent.futures.Future[HealthResult], str] = {}
        generations = {t.id: getattr(t, "generation", 0) for t in targets}
        models = bool(self._models())
        scrubber = self._scrubber()
        with self._lock:
            if self._stop.is_set():
                return {}
            for t in targets:
                previous = self._running.get(t.id)
                if previous is not None and not previous[0].done():
                    busy[previous[0]] = t.id
                    continue
                future = self._start_probe(t, config, generations[t.id], models, scrubber)
                if future is not None:
                    futures[future] = t.id
            for worker_id in [w for w in self._running if w not in generations]:
                if self._running[worker_id][0].done():
                    del self._running[worker_id]  # the worker left the pool
        # Each probe is bounded by health.timeout end to end; the margin covers
        # scheduling. One still running after that (a transport overrunning its budget)
        # is reported as failed now and is not probed again until it ends.
        done, _ = concurrent.futures.wait([*futures, *busy], timeout=config.timeout + _ROUND_MARGIN)
        now = self._clock.time()
        results: dict[str, HealthResult] = {}
        shared: dict[str, HealthResult] = {}
        for future, worker_id in busy.items():
            if future in done and future.exception() is None:
                shared[worker_id] = future.result()
            else:
                results[worker_id] = HealthResult(
                    worker_id,
                    False,
                    now,
                    error="previous check still running",
                    generation=generations[worker_id],
                )
        for future, worker_id in futures.items():
            if future not in done:
                results[worker_id] = HealthResult(
                    worker_id,
                    False,
                    now,
                    error=f"no answer within {config.timeout}s",
                    generation=generations[worker_id],
                )
                continue
            exc = future.exception()
            if exc is None:
                results[worker_id] = future.result()
            else:  # probe() catches Exception: this is something stranger, still one worker's
                results[worker_id] = HealthResult(
                    worker_id,
                    False,
                    now,
                    error=scrubber(f"{type(exc).__name__}: {exc}"),
                    generation=generations[worker_id],
                )
        self.rounds += 1
        self._apply(results)
        return {**results, **shared}

    def _start_probe(
        self,
        target: Target,
        config: HealthConfig,
        generation: int,
        models: bool = False,
        scrubber: Scrubber = NO_SCRUBBER,
    ) -> concurrent.futures.Future[HealthResult] | None:
        """Start one probe on a thread of its own; None if no thread could be started.

        A thread per probe rather than a fixed pool: probes queued behind hung ones in
        a pool would never start within the round, and their workers would be marked
        unhealthy for another worker's fault. A probe's thread lives at most
        ``health.timeout``, so there are never more of them than workers. Called
        with ``_lock`` held; starting a thread does no I/O.
        """
        future: concurrent.futures.Future[HealthResult] = concurrent.futures.Future()
        options = {
            "protocol": getattr(target, "protocol", LINUX),
            "auth": getattr(target, "auth", None),
            "base_path": getattr(target, "base_path", ""),
            "models": models,
            "scrubber": scrubber,
        }
        thread = threading.Thread(
            target=_run_probe,
            args=(
                future,
                target.id,
                target.health_transport,
                config,
                self._clock,
                generation,
                options,
            ),
            name=f"npu-sync-health-check-{target.id}",
            daemon=True,
        )
        try:
            thread.start()
        except RuntimeError:
            # Out of threads: the process's trouble, not the worker's, so this worker
            # is not checked this round rather than failed.
            log.warning("cannot start a health check of worker %s: out of threads", target.id)
            return None
        self._running[target.id] = (future, thread)
        return future

    def _run(self) -> None:
        delay = 0.0
        while not self._stop.is_set():
            # Nothing may end this loop but stop(): the pool relies on the thread.
            try:
                if self._wake.wait(delay):
                    self._wake.clear()
                    if self._soon.is_set():
                        self._soon.clear()
                        delay = 0.0
                    else:
                        delay = self._next_delay()  # new settings: wait the new interval
                    continue
                if self._stop.is_set():
                    return
                if self._config().enabled:  # a reload may turn checks off, and on again
                    self.check_once()
            except Exception:
                log.exception("health round failed")
            delay = self._next_delay()

    def _next_delay(self) -> float:
        """The wait before the next round: the interval, jittered, capped; never raises."""
        try:
            delay = float(self._config().interval) * self._rng.uniform(1 - JITTER, 1 + JITTER)
        except Exception:
            log.exception("cannot read health.interval; next round in %ss", _FALLBACK_DELAY)
            return _FALLBACK_DELAY
        if not math.isfinite(delay) or delay > _MAX_DELAY:
            return _MAX_DELAY  # NaN too: it would make Event.wait raise
        return max(delay, 0.0)
