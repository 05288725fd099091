"""Active health checks: a daemon thread probes every worker's ``/health``.

Each worker is checked once per ``health.interval``, at an offset of its own within
the interval (salted per process, so that many processes do not probe in step), on at
most ``health.concurrency`` threads, each check on a connection of its own (never the
task connections) and bounded by ``health.timeout``. A worker whose previous check
still runs is not checked again: that check is skipped and counted, and the checker
says it falls behind. ``close()`` shuts the sockets of running checks rather than
waiting for them, and whatever one worker answers fails at most that worker's check.
The checker only *measures*; the pool applies results (thresholds, hints, breaker
trials, model lists) under its own lock.

Each probe speaks the worker's protocol and carries its auth headers. A passed check
of a worker whose protocol lists models apart (``models_path``, AutoBot's Linux
``GET /models``) reads that list too, on the same connection and within the same
``health.timeout``, when the pool asks for model lists.

A probe's error text is what the worker said: it is scrubbed of the configuration's
secrets and bounded (:class:`~npu_sync._redact.Scrubber`) before the result leaves the
probe, so neither ``workers()``, ``npu-sync status`` nor a log line shows a credential
the worker quoted back.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import heapq
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from npu_sync._clock import SYSTEM_CLOCK, Clock
from npu_sync._probing import ProbeRunner, Slots
from npu_sync._redact import NO_SCRUBBER, Scrubber
from npu_sync._retry import NOT_A_WORKER, REFUSED_CREDENTIALS
from npu_sync.auth import RequestAuth
from npu_sync.config import HealthConfig
from npu_sync.errors import printable
from npu_sync.protocols import LINUX, WorkerProtocol
from npu_sync.transport import (
    DEFAULT_IDLE_TIMEOUT,
    Cancel,
    Response,
    Transport,
    TransportError,
    features_of,
)

log = logging.getLogger(__name__)

JITTER = 0.1
"""Headroom over a day-long interval for the longest wait (kept for compatibility:
checks now come at per-worker slots, not at jittered rounds)."""


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
    max_models: int | None = None  # the cap on loaded models the worker reports
    model_inferences: Mapping[str, int] | None = None  # per model, its inference count

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


class WorkerHealth:
    """What the health checks have learnt of one worker (``worker.health``): the
    rise/fall counts behind its ``healthy`` flag, the hints its last passed check
    carried, the last result, and the connection the checks use.

    ``failures`` and ``passes`` count consecutive failed and passed checks;
    ``hinted_capacity`` and ``hinted_draining`` are the worker's own word on how many
    tasks it takes and whether it is draining (None and False until it said);
    ``awaiting_check``: a worker a reload added takes no task until a check passes, and
    until that check is applied a task may wait for it (see :mod:`npu_sync._outage`).
    ``transport`` is the health checks' own connection, never the tasks'.

    Not thread-safe: read and written under the pool's lock (``transport`` itself is
    thread-safe and used outside it).
    """

    __slots__ = (
        "awaiting_check",
        "failures",
        "hinted_capacity",
        "hinted_draining",
        "last",
        "passes",
        "transport",
    )

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.last: HealthResult | None = None
        self.awaiting_check = False
        self.failures = 0
        self.passes = 0
        self.hinted_capacity: int | None = None
        self.hinted_draining = False

    def apply(
        self, result: HealthResult, healthy: bool, unhealthy_after: int, healthy_after: int
    ) -> bool:
        """Count one check of a worker that was ``healthy`` before it, and take its
        hints if it passed; returns whether the worker is healthy after it."""
        self.last = result
        self.awaiting_check = False
        if result.ok:
            self.failures = 0
            self.passes += 1
            self.hinted_draining = bool(result.draining)
            self.hinted_capacity = result.max_concurrent
            return healthy or self.passes >= healthy_after
        self.passes = 0
        self.failures += 1
        # An answer that is not a worker's (a 404, another service's page) is the
        # operator's to fix: no point waiting for more checks to agree.
        return healthy and not (self.failures >= unhealthy_after or result.not_a_worker)

    def await_first_check(self) -> None:
        """A check is on its way that the worker must pass before it takes a task."""
        self.awaiting_check = True

    def restart(self) -> None:
        """The worker was taken out of service: it comes back only after
        ``health.healthy_threshold`` checks pass from now."""
        self.passes = 0

    def forget(self, transport: Transport) -> None:
        """The worker moved to a new address (checked on ``transport``): nothing learnt
        of the old one carries over."""
        self.transport = transport
        self.last = None
        self.failures = 0
        self.passes = 0
        self.hinted_capacity = None
        self.hinted_draining = False


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
    cancel: Cancel | None = None,
) -> HealthResult:
    """Check one worker once: GET the health endpoint and read its verdict and hints;
    with ``models``, read its model list too (see the module's docstring). The error
    text is passed through ``scrubber``. ``cancel`` (for a transport that is
    ``cancellable``) lets another thread shut the probe's socket.

    Never raises: whatever goes wrong is a failed check of this worker.
    """
    extra: dict[str, Any] = {}
    if cancel is not None and features_of(transport).cancellable:
        extra["cancel"] = cancel
    result = _probe(
        worker_id, transport, config, clock, protocol, auth, base_path, models, scrubber, extra
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
    extra: Mapping[str, Any],
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
            **extra,
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
                result, transport, protocol, auth, base_path, left, clock, scrubber, extra
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
    extra: Mapping[str, Any] | None = None,
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
            **(extra or {}),
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
        max_models=info.max_models if info.max_models is not None else result.max_models,
        model_inferences=info.inferences,
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
        max_models=info.max_models,
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


def _bool(value: object) -> bool | None:
    return value if isinstance(value, bool) else None


def _positive_int(value: object, *, allow_zero: bool = False) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if value > 0 or (allow_zero and value == 0) else None


# A probe may run this long past health.timeout before it is given up: scheduling, not
# network (every transport keeps to its budget; this covers one that does not).
_ROUND_MARGIN = 0.5
# Event.wait raises OverflowError beyond threading.TIMEOUT_MAX, which would end the
# thread; no valid interval (at most a day, plus jitter) comes near this cap.
_MAX_DELAY = 86400 * (1 + JITTER)
# The wait after a round whose settings could not be read at all.
_FALLBACK_DELAY = HealthConfig().interval
# How long stop() waits for probe threads once their sockets are shut.
STOP_WAIT = 0.5
# The checker reads the pool's workers at most this often (and when told of a change).
_REFRESH = 1.0
# Results are applied in batches at most this often: applying takes the pool's lock.
_APPLY_EVERY = 0.05
# Due probes this close together are sent in one go.
_SLACK = 0.002


class HealthChecker:
    """Checks workers' health, on demand (:meth:`check_once`) or on a daemon thread.

    The thread checks each worker once per ``health.interval``, at an offset of its
    own within the interval (:class:`~npu_sync._probing.Slots`), so a large fleet's
    checks are spread over the interval; a worker the pool adds, or moves, is checked
    at once. Probes run on at most ``health.concurrency`` threads
    (:class:`~npu_sync._probing.ProbeRunner`), each with at most one socket. When the
    checks cannot keep up — a worker's check is due while its last one is still
    queued or running — that check is skipped, counted in :attr:`skipped`, and a
    warning says what to raise; the schedule never drifts.

    Thread-safe: ``check_once`` may be called while the thread runs.

    Args:
        targets: returns the workers to check now (the pool's current set). A target
            with ``protocol``, ``auth`` and ``base_path`` attributes is spoken to in its
            protocol, with its auth headers.
        apply: receives results (the thread's in batches); the pool updates worker
            state with them.
        config: returns the health settings in force (they are hot-reloadable).
        models: returns whether passed checks read the workers' model lists too.
        scrubber: returns the scrubber that keeps secrets out of the probes' error
            texts (read once per round).
        keep_idle: returns how long a transport keeps an idle connection
            (``transport.idle_timeout``): a probe's connection is closed after the
            probe unless the worker's next probe comes sooner.
        housekeeping: a chore and its period in seconds, run on the thread whether
            checks are on or off (the pool's sweep of idle connections).
        timer: monotonic seconds for the schedule (waits are real).
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
        keep_idle: Callable[[], float] = lambda: DEFAULT_IDLE_TIMEOUT,
        housekeeping: tuple[Callable[[], object], float] | None = None,
        timer: Callable[[], float] = time.monotonic,
    ) -> None:
        self._housekeeping = housekeeping
        self._chore_at = 0.0
        self._models = models
        self._scrubber = scrubber
        self._targets = targets
        self._apply = apply
        self._config = config
        self._clock = clock
        self._timer = timer
        self._keep_idle = keep_idle
        self._rng = rng or random.Random()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._soon = threading.Event()
        self._changed = threading.Event()  # settings changed: slots move
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        # Sized from the settings in force at each round (they are hot-reloadable).
        self._runner = ProbeRunner(HealthConfig().concurrency, timer=timer)
        # Each worker's latest probe: never two of one worker at once.
        self._running: dict[str, concurrent.futures.Future[HealthResult]] = {}
        # Results of the thread's probes, waiting to be applied in a batch.
        self._done: list[HealthResult] = []
        self.rounds = 0
        self.skipped = 0  # checks not made because the worker's last one still ran
        self.lag = 0.0  # the longest a check waited past its slot, last interval
        self.behind = False  # the last interval had skipped checks
        self._warned_at: float | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> dict[str, Any]:
        """What the checker does now: threads, probes in flight, and whether it keeps up."""
        return {
            "threads": self._runner.threads(),
            "concurrency": self._runner.size,
            "in_flight": self._runner.busy(),
            "skipped": self.skipped,
            "behind": self.behind,
            "lag_ms": self.lag * 1000,
        }

    def start(self) -> None:
        """Start the daemon thread, or start it again if it died; every worker is
        checked at once, then at its slot. Does nothing once :meth:`stop` was called.
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
        """The settings changed: the thread reads them, and the slots follow the new
        interval."""
        self._changed.set()
        self._wake.set()

    def check_soon(self) -> None:
        """Look at the pool's workers now: those it added are checked at once."""
        self._soon.set()
        self._wake.set()

    def stop_soon(self) -> None:
        """Ask the thread and the checks to stop, without waiting for them."""
        self._stop.set()
        self._wake.set()
        self._runner.stop(0.0)

    def stop(self) -> None:
        """Stop the thread and the checks in flight.

        Returns within about half a second (``STOP_WAIT``) after the thread's current
        batch: queued checks are dropped, and running ones have their sockets shut
        (a transport that can be cancelled). A check that ignores that is left to end
        on its own; its thread is a daemon.
        """
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._runner.stop(STOP_WAIT)

    # -- one round, on demand -------------------------------------------------------

    def check_once(self) -> dict[str, HealthResult]:
        """Check every worker now, on the probe threads; apply and return the results."""
        config = self._config()
        targets = list(self._targets())
        if not targets:
            return {}
        self._runner.resize(config.concurrency)
        futures: dict[concurrent.futures.Future[HealthResult], str] = {}
        # Workers whose probe from another round still runs: never probed twice at
        # once. That probe's answer, if it comes in time, is this round's answer too,
        # but it is applied once, by the round that started it.
        busy: dict[concurrent.futures.Future[HealthResult], str] = {}
        generations = {t.id: getattr(t, "generation", 0) for t in targets}
        models = bool(self._models())
        scrubber = self._scrubber()
        now = self._timer()
        with self._lock:
            if self._stop.is_set():
                return {}
            for t in targets:
                previous = self._running.get(t.id)
                if previous is not None and not previous.done():
                    busy[previous] = t.id
                    continue
                future = self._submit(t, config, generations[t.id], models, scrubber, now)
                if future is not None:
                    futures[future] = t.id
            for worker_id in [w for w in self._running if w not in generations]:
                if self._running[worker_id].done():
                    del self._running[worker_id]  # the worker left the pool
        self._wait([*futures, *busy], config)
        now = self._clock.time()
        results: dict[str, HealthResult] = {}
        shared: dict[str, HealthResult] = {}
        for future, worker_id in busy.items():
            if future.done() and not future.cancelled() and future.exception() is None:
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
            if not future.done() or future.cancelled():
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

    def _wait(
        self, futures: list[concurrent.futures.Future[HealthResult]], config: HealthConfig
    ) -> None:
        """Until every probe ended, was given up (past its budget) or the checker stopped.

        Probes queued behind others start as threads free up; each is given up
        ``health.timeout`` + 0.5 s after it started, so this ends.
        """
        pending = set(futures)
        budget = config.timeout + _ROUND_MARGIN
        while pending and not self._stop.is_set():
            overdue = self._runner.next_overdue()
            wait = budget if overdue is None else max(0.0, overdue - self._timer()) + 0.001
            done, _ = concurrent.futures.wait(pending, timeout=min(wait, _MAX_DELAY))
            pending -= done
            self._abandon_overdue()
            pending = {f for f in pending if not self._runner.is_abandoned(f)}

    def _submit(
        self,
        target: Target,
        config: HealthConfig,
        generation: int,
        models: bool,
        scrubber: Scrubber,
        due: float,
        *,
        by_thread: bool = False,
    ) -> concurrent.futures.Future[HealthResult] | None:
        """Queue one probe on the probe threads; None once stopped. Called with
        ``_lock`` held; queueing does no I/O. ``by_thread``: the health thread's own
        check, whose result it applies (check_once() applies its own)."""
        options: dict[str, Any] = {
            "protocol": getattr(target, "protocol", LINUX),
            "auth": getattr(target, "auth", None),
            "base_path": getattr(target, "base_path", ""),
            "models": models,
            "scrubber": scrubber,
        }
        transport = target.health_transport
        worker_id = target.id
        clock = self._clock
        close_after = config.interval >= self._keep_idle()

        def run(cancel: Cancel) -> HealthResult:
            try:
                result = probe(worker_id, transport, config, clock, cancel=cancel, **options)
            finally:
                if close_after:
                    # The next probe comes after the connection would have expired:
                    # holding it idle till then only takes a descriptor.
                    _close_idle(transport)
            return dataclasses.replace(result, generation=generation) if generation else result

        future = self._runner.submit(
            run,
            budget=config.timeout + _ROUND_MARGIN,
            due=due,
            tag=(worker_id, generation, by_thread, config.timeout),
        )
        if future is not None:
            self._running[worker_id] = future
        return future

    # -- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        schedule = _Schedule(Slots(self._rng.random(), self._timer()))
        while not self._stop.is_set():
            # Nothing may end this loop but stop(): the pool relies on the thread.
            try:
                delay = self._step(schedule)
            except Exception:
                log.exception("health round failed")
                delay = _FALLBACK_DELAY
            if self._wake.wait(min(max(delay, 0.0), _MAX_DELAY)):
                self._wake.clear()
        self._runner.stop(0.0)  # stopped by stop_soon() alone: the probe threads end too

    def _step(self, schedule: _Schedule) -> float:
        """Apply what came in, send what is due; the wait until there is more to do."""
        now = self._timer()
        chore_wait = self._chores(now)
        return min(chore_wait, self._checks(schedule, now))

    def _chores(self, now: float) -> float:
        """Run the housekeeping chore when due; the wait until it is due again."""
        if self._housekeeping is None:
            return _MAX_DELAY
        chore, every = self._housekeeping
        if now >= self._chore_at:
            self._chore_at = now + every
            try:
                chore()
            except Exception:
                log.exception("health thread housekeeping failed")
        return self._chore_at - now

    def _checks(self, schedule: _Schedule, now: float) -> float:
        changed = self._changed.is_set()
        self._changed.clear()
        try:
            config = self._config()
        except Exception:
            log.exception("cannot read the health settings; next try in %ss", _FALLBACK_DELAY)
            return _FALLBACK_DELAY
        self._flush()
        if not config.enabled:  # a reload may turn checks off, and on again
            schedule.forget()
            return _MAX_DELAY
        self._runner.resize(config.concurrency)
        interval = _interval(config)
        soon = self._soon.is_set()
        self._soon.clear()
        if soon or changed or schedule.refresh_at <= now or interval != schedule.interval:
            targets = {t.id: t for t in self._targets()}
            schedule.update(targets, interval, now, moved=changed)
            schedule.refresh_at = now + min(interval, _REFRESH)
        if schedule.round_end <= now:
            self._round_ended(schedule, config, now)
            schedule.round_end = now + interval
        self._abandon_overdue(now)
        due = schedule.take_due(now + _SLACK)
        if due:
            models = bool(self._models())
            scrubber = self._scrubber()
            with self._lock:
                if self._stop.is_set():
                    return 0.0
                for target, at in due:
                    if self._stop.is_set():
                        break  # close(): do not queue thousands of checks to drop them
                    previous = self._running.get(target.id)
                    if previous is not None and not previous.done():
                        self.skipped += 1
                        schedule.skipped += 1
                        continue
                    future = self._submit(
                        target,
                        config,
                        getattr(target, "generation", 0),
                        models,
                        scrubber,
                        at,
                        by_thread=True,
                    )
                    if future is not None:
                        future.add_done_callback(self._probe_done)
        wake_at = min(schedule.next_due(), schedule.refresh_at, schedule.round_end)
        overdue = self._runner.next_overdue()
        if overdue is not None:
            wake_at = min(wake_at, overdue + 0.001)
        if self._done:
            wake_at = min(wake_at, now + _APPLY_EVERY)
        return wake_at - now

    def _abandon_overdue(self, now: float | None = None) -> None:
        """Give up checks past their budget; the thread's own are reported failed (a
        check_once() reports its own)."""
        for tag in self._runner.abandon_overdue(now):
            worker_id, generation, by_thread, timeout = cast("tuple[str, int, bool, float]", tag)
            if by_thread:
                failed = HealthResult(
                    worker_id,
                    False,
                    self._clock.time(),
                    error=f"no answer within {timeout}s",
                    generation=generation,
                )
                with self._lock:
                    self._done.append(failed)

    def _probe_done(self, future: concurrent.futures.Future[HealthResult]) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # cancelled by stop(); probe() itself never raises
        with self._lock:
            self._done.append(future.result())
        self._wake.set()

    def _flush(self) -> None:
        with self._lock:
            batch, self._done = self._done, []
        if batch:
            try:
                self._apply({r.worker_id: r for r in batch})
            except Exception:  # those results are lost; the next ones are not
                log.exception("health round failed")

    def _round_ended(self, schedule: _Schedule, config: HealthConfig, now: float) -> None:
        """An interval passed: count it, and say so when the checks fell behind."""
        if schedule.interval is None:
            return
        self.rounds += 1
        self.lag = self._runner.take_max_lag()
        self.behind = schedule.skipped > 0
        if schedule.skipped and (
            self._warned_at is None or now - self._warned_at >= max(60.0, schedule.interval)
        ):
            self._warned_at = now
            log.warning(
                "health checks fall behind: %d of %d workers' checks were skipped in the last "
                "%gs because the previous check was still running (checks wait up to %.3gs "
                "past their slot); raise health.concurrency (now %d) or health.interval",
                schedule.skipped,
                len(schedule.targets),
                schedule.interval,
                self.lag,
                config.concurrency,
            )
        schedule.skipped = 0


def _interval(config: HealthConfig) -> float:
    try:
        interval = float(config.interval)
    except (TypeError, ValueError):
        return _FALLBACK_DELAY
    if not math.isfinite(interval) or interval > _MAX_DELAY:
        return _MAX_DELAY
    return max(interval, 0.001)


def _close_idle(transport: Transport) -> None:
    close_idle = getattr(transport, "close_idle", None)
    if close_idle is not None:
        try:
            close_idle()
        except Exception:
            log.exception("closing the idle health connection failed")


class _Schedule:
    """The health thread's plan: every worker's next slot. Owned by that thread."""

    def __init__(self, slots: Slots) -> None:
        self.slots = slots
        self.targets: dict[str, Target] = {}
        self.generations: dict[str, int] = {}
        self.due: dict[str, float] = {}
        self.heap: list[tuple[float, str]] = []
        self.interval: float | None = None
        self.refresh_at = 0.0
        self.round_end = 0.0
        self.skipped = 0

    def forget(self) -> None:
        """Checks are off: when they come back on, every worker is checked at once."""
        self.targets.clear()
        self.generations.clear()
        self.due.clear()
        self.heap.clear()
        self.interval = None

    def update(
        self, targets: dict[str, Target], interval: float, now: float, *, moved: bool
    ) -> None:
        """Follow the pool's workers: new (or moved) ones are due now; a new interval
        moves every other worker to its slot in it."""
        resched = moved or interval != self.interval
        self.interval = interval
        for worker_id in [w for w in self.targets if w not in targets]:
            del self.targets[worker_id]
            self.generations.pop(worker_id, None)
            self.due.pop(worker_id, None)
        for worker_id, target in targets.items():
            generation = getattr(target, "generation", 0)
            known = worker_id in self.targets and self.generations.get(worker_id) == generation
            self.targets[worker_id] = target
            self.generations[worker_id] = generation
            if not known:
                self._plan(worker_id, now)
            elif resched:
                self._plan(worker_id, self.slots.next(worker_id, interval, now))
        if resched or len(self.heap) > 2 * len(self.due) + 64:
            self.heap = [(at, w) for w, at in self.due.items()]
            heapq.heapify(self.heap)

    def _plan(self, worker_id: str, at: float) -> None:
        self.due[worker_id] = at
        heapq.heappush(self.heap, (at, worker_id))

    def take_due(self, until: float) -> list[tuple[Target, float]]:
        """The workers whose slot came, each moved to its next slot."""
        interval = self.interval
        if interval is None:
            return []
        taken: list[tuple[Target, float]] = []
        heap = self.heap
        while heap and heap[0][0] <= until:
            at, worker_id = heapq.heappop(heap)
            if self.due.get(worker_id) != at:
                continue  # replaced by a later plan
            target = self.targets.get(worker_id)
            if target is None:
                continue
            taken.append((target, at))
            # The next slot after this one, at least half an interval away (the first
            # check of a new worker comes at once, off its slot).
            self._plan(
                worker_id, self.slots.next(worker_id, interval, max(at, until) + interval / 2)
            )
        return taken

    def next_due(self) -> float:
        heap = self.heap
        while heap and self.due.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf
