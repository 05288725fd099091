"""The reference NPU worker: a simulated inference server that speaks the worker protocols.

It runs in three ways:

* in-process, as :class:`WorkerServer` (unit tests);
* as a program, ``python -m npu_sync.worker_server`` or ``npu-sync worker``;
* as a child process driven from Python, :class:`LocalWorker` (integration tests,
  benchmarks and the demo), which can kill, freeze, slow or restart it.

It speaks either of AutoBot's worker protocols (see docs/protocol.md):

* ``linux`` (the default): ``POST /inference`` takes ``{"model_id", "input_text", ...}``;
  ``GET /models``, ``POST /models/load``, ``DELETE /models/{id}`` and ``GET /devices``
  manage models; a model that is not loaded answers ``500 {"detail": "Model X not
  loaded"}``.
* ``windows``: ``POST /inference`` takes ``{"task_type", "model_name", "input_data",
  ...}`` and answers HTTP 200 with ``"status": "completed"`` or ``"failed"``;
  ``GET /health`` lists the loaded models; ``POST /model/optimize?model_name=X`` loads one.

Both also serve ``POST /echo`` (a task endpoint), ``GET /health``, ``GET /stats`` and
``POST /_control``, which changes a running worker's behaviour (latency, failures, a
lying or hanging worker, forced status codes, loaded models, NPU or CPU). Requests may be
required to carry an AutoBot HMAC signature or a bearer token; ``/stats`` and
``/_control`` never are, being test hooks that a real deployment does not have.
Standard library only.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import hashlib
import hmac
import http.client
import json
import logging
import math
import os
import random
import re
import selectors
import signal
import socket
import socketserver
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any
from urllib.parse import parse_qs, unquote

from npu_sync.auth import HmacVerifier
from npu_sync.clock import SYSTEM_CLOCK, Clock

__all__ = [
    "ANY_MODEL",
    "CPU_DEVICE",
    "DEVICE",
    "MAX_BODY_BYTES",
    "PROTOCOLS",
    "LocalWorker",
    "WorkerBehaviour",
    "WorkerServer",
    "build_arg_parser",
    "main",
    "serve",
]

_log = logging.getLogger(__name__)

DEVICE = "NPU (simulated)"
"""The ``device`` the reference worker's answers name while its NPU is available."""

CPU_DEVICE = "CPU (simulated)"
"""The ``device`` named instead once ``npu_available`` is turned off (CPU fallback)."""

PROTOCOLS = ("linux", "windows")
"""The worker protocols the reference worker speaks: AutoBot's Linux and Windows workers."""

HMAC_SECRET_ENV = "NPU_SYNC_WORKER_HMAC_SECRET"
"""Where ``npu-sync worker --hmac-service-id`` reads the HMAC secret by default."""

MAX_BODY_BYTES = 8 * 1024 * 1024
"""Request bodies larger than this are refused with 413."""

ANY_MODEL = "*"
"""In ``models``, serves every model id, loading it on first use (as AutoBot's Windows
worker does)."""

_MAX_MODEL_ID = 200
_WINDOWS_TASK_TYPES = frozenset({"embedding_generation"})
# Task types AutoBot's Windows worker routes but cannot run, with the error it answers:
# its semantic_search calls a method the worker does not have, so every such task
# fails the same way on every Windows worker.
_WINDOWS_BROKEN_TASK_TYPES = {
    "semantic_search": "'WindowsNPUWorker' object has no attribute 'process_search_task'"
}
_EMBEDDING_DIM = 8
# Paths that never require authentication: test hooks, not part of any real worker.
_OPEN_PATHS = frozenset({"/_control", "/stats"})

_SEEN_TASK_IDS_LIMIT = 1_000_000
_TRACEPARENTS_LIMIT = 1_000
"""Trace contexts of task requests remembered for ``/stats``, the latest first kept."""
"""Task ids remembered for duplicate detection; the oldest are forgotten first."""

_FORCEABLE_STATUS = range(400, 600)
_RETRY_AFTER_STATUS = (429, 503)
_READY_LINE = re.compile(r"^npu-sync worker (\S+) listening on (https?)://(\S+):(\d+)\s*$")


def _check_number(name: str, value: object, *, upper: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
    if upper is not None and number > upper:
        raise ValueError(f"{name}: must be <= {upper:g}, got {value!r}")
    return number


@dataclass(frozen=True)
class WorkerBehaviour:
    """How a reference worker behaves. Immutable, so safe to share between threads.

    Attributes:
        latency_ms: time every task endpoint takes before answering.
        jitter_ms: uniform +/- spread around ``latency_ms`` (the delay never goes below 0).
        failure_rate: probability in [0, 1] that an inference answers
            ``500 {"detail": "simulated failure"}`` after the latency.
        health_status: the ``status`` in ``/health``; anything but ``"healthy"`` answers 503.
        fail_all: every inference answers 500 while ``/health`` still reports the
            configured status (a worker that lies about its health).
        hang: task endpoints and ``/health`` read requests but answer only once hang is
            turned off; on shutdown their connections are dropped unanswered.
        draining: reported in ``/health`` as a load hint; requests are still served.
        status_code: when set (400..599), every inference answers it at once with
            ``{"detail": "forced"}``.
        retry_after: seconds sent as ``Retry-After`` with a forced 429 or 503.
        npu_available: reported in ``/health`` and ``/models``; when off, the worker
            has "fallen back to CPU" and names :data:`CPU_DEVICE` as its device.
        load_delay_ms: time loading a model takes (``/models/load``,
            ``/model/optimize``, or a first use under ``"*"``).
        max_models: the most models loaded at once (None: no limit); a load beyond it
            answers ``507 {"detail": "..."}`` and loads nothing (the pool unloads one
            first). Reported as ``max_models`` in ``GET /models``.
        load_status: when set (400..599), every load request answers it at once with
            ``{"detail": "forced"}`` and loads nothing.
        echo_header: the name of a request header this worker quotes, value and all,
            in every error it answers (``detail``, a failed task's ``error``, an
            unhealthy ``/health``'s ``status``): a careless worker that leaks the
            credentials it was sent back into its error texts.
    """

    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    failure_rate: float = 0.0
    health_status: str = "healthy"
    fail_all: bool = False
    hang: bool = False
    draining: bool = False
    status_code: int | None = None
    retry_after: float | None = None
    npu_available: bool = True
    load_delay_ms: float = 0.0
    echo_header: str | None = None
    max_models: int | None = None
    load_status: int | None = None

    def __post_init__(self) -> None:
        if self.max_models is not None and (
            isinstance(self.max_models, bool)
            or not isinstance(self.max_models, int)
            or self.max_models < 1
        ):
            raise ValueError(f"max_models: must be null or >= 1, got {self.max_models!r}")
        if self.load_status is not None and (
            isinstance(self.load_status, bool)
            or not isinstance(self.load_status, int)
            or self.load_status not in _FORCEABLE_STATUS
        ):
            raise ValueError(f"load_status: must be null or 400..599, got {self.load_status!r}")
        _check_number("latency_ms", self.latency_ms)
        _check_number("load_delay_ms", self.load_delay_ms)
        _check_number("jitter_ms", self.jitter_ms)
        _check_number("failure_rate", self.failure_rate, upper=1.0)
        if not isinstance(self.health_status, str) or not self.health_status:
            raise ValueError(
                f"health_status: must be a non-empty string, got {self.health_status!r}"
            )
        for name in ("fail_all", "hang", "draining", "npu_available"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        if self.status_code is not None and (
            isinstance(self.status_code, bool)
            or not isinstance(self.status_code, int)
            or self.status_code not in _FORCEABLE_STATUS
        ):
            raise ValueError(f"status_code: must be null or 400..599, got {self.status_code!r}")
        if self.retry_after is not None:
            _check_number("retry_after", self.retry_after)
        if self.echo_header is not None and (
            not isinstance(self.echo_header, str) or not self.echo_header.strip()
        ):
            raise ValueError(
                f"echo_header: must be null or a header name, got {self.echo_header!r}"
            )

    @property
    def device(self) -> str:
        """The device answers name: the NPU, or the CPU it fell back to."""
        return DEVICE if self.npu_available else CPU_DEVICE

    def to_dict(self) -> dict[str, Any]:
        """The settings as a JSON-serialisable dict."""
        return asdict(self)


_BEHAVIOUR_FIELDS = frozenset(f.name for f in fields(WorkerBehaviour))


class ModelCapacity(Exception):
    """A load asked of a worker that has ``max_models`` loaded already."""


# Not a behaviour: which models are loaded is the worker's state, set through the same
# update() and /_control so that a test can load or unload models at run time.
_MODELS_SETTING = "models"


def _check_models(value: object) -> tuple[str, ...]:
    """Validated model ids (``"*"`` allowed); raises ValueError naming ``models``."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"models: must be a list of model ids, got {value!r:.100}")
    for model in value:
        if not _valid_model_id(model) and model != ANY_MODEL:
            raise ValueError(
                f"models: each must be a printable string of 1..{_MAX_MODEL_ID} "
                f"characters, got {model!r:.100}"
            )
    return tuple(dict.fromkeys(value))


def _valid_model_id(model: object) -> bool:
    return (
        isinstance(model, str)
        and 0 < len(model) <= _MAX_MODEL_ID
        and model.isprintable()
        and model != ANY_MODEL
    )


@dataclass
class _Model:
    """One loaded model. Changed only under the worker state's lock."""

    device: str
    loaded_at: str
    inference_count: int = 0


def _format_seconds(seconds: float) -> str:
    # Whole seconds are what RFC 9110 allows; fractions are kept so tests can use
    # sub-second values, and clients that parse floats honour them.
    if float(seconds).is_integer():
        return str(int(seconds))
    return f"{seconds:.3f}".rstrip("0").rstrip(".")


class _WorkerState:
    """Behaviour, counters and randomness of one worker, shared by its handler threads.

    Thread-safe: counters change under one condition variable, which also wakes
    hung handlers and ``wait_until`` callers. The behaviour is an immutable snapshot
    replaced whole, so handlers read it without the lock.
    """

    def __init__(
        self,
        *,
        worker_id: str,
        models: Sequence[str],
        max_concurrent: int,
        behaviour: WorkerBehaviour,
        seed: int | None,
        clock: Clock,
        protocol: str = "linux",
        slots: int | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.protocol = protocol
        self.max_concurrent = max_concurrent
        # Tasks inferred at once; the others queue (an NPU with so many parallel slots).
        self._slots = None if slots is None else threading.BoundedSemaphore(slots)
        self.clock = clock
        self.behaviour = behaviour
        self.closing = threading.Event()
        self._cond = threading.Condition(threading.Lock())
        self._rng = random.Random(seed)
        self.any_model = False
        self._loaded: dict[str, _Model] = {}
        self._set_models_locked(_check_models(list(models)))
        self._loads = 0
        self._failed_tasks = 0
        self._requests: dict[str, int] = {}
        self._responses: dict[int, int] = {}
        self._seen: dict[str, None] = {}
        self._task_ids_seen = 0
        # The trace contexts task requests came with, the latest _TRACEPARENTS_LIMIT.
        self._traceparents: collections.deque[dict[str, str | None]] = collections.deque(
            maxlen=_TRACEPARENTS_LIMIT
        )
        self._duplicates = 0
        self._in_flight = 0
        self._max_in_flight = 0
        self._inference_count = 0
        self._connections = 0

    def update(self, changes: Mapping[str, Any]) -> WorkerBehaviour:
        unknown = sorted(set(changes) - _BEHAVIOUR_FIELDS - {_MODELS_SETTING})
        if unknown:
            raise ValueError(f"unknown setting(s): {', '.join(unknown)}")
        settings = dict(changes)
        models = None
        if _MODELS_SETTING in settings:
            models = _check_models(settings.pop(_MODELS_SETTING))
        with self._cond:
            # Validated in full before anything changes: a bad value changes nothing.
            new = replace(self.behaviour, **settings)
            self.behaviour = new
            if models is not None:
                self._set_models_locked(models)
            self._cond.notify_all()
        _log.info("worker %s behaviour now %s", self.worker_id, new)
        if models is not None:
            _log.info("worker %s models now %s", self.worker_id, ", ".join(models) or "none")
        return new

    def _set_models_locked(self, models: Sequence[str]) -> None:
        """Load exactly ``models`` at once; models kept keep their counters."""
        device = self.behaviour.device
        loaded_at = self._now_iso()
        self.any_model = ANY_MODEL in models
        self._loaded = {
            model: self._loaded.get(model) or _Model(device, loaded_at)
            for model in models
            if model != ANY_MODEL
        }

    def _now_iso(self) -> str:
        return datetime.datetime.fromtimestamp(self.clock.time(), datetime.timezone.utc).isoformat()

    def models(self) -> list[str]:
        """The loaded model ids, then ``"*"`` when any model is served."""
        with self._cond:
            return [*self._loaded, *([ANY_MODEL] if self.any_model else [])]

    def model_status(self) -> dict[str, Any]:
        """AutoBot's ``GET /models`` answer."""
        behaviour = self.behaviour
        with self._cond:
            loaded = {
                model: {
                    "device": info.device,
                    "inference_count": info.inference_count,
                    "loaded_at": info.loaded_at,
                }
                for model, info in self._loaded.items()
            }
        status: dict[str, Any] = {
            "npu_available": behaviour.npu_available,
            "optimal_device": behaviour.device,
            "loaded_models": loaded,
            "available_devices": _available_devices(behaviour),
        }
        if behaviour.max_models is not None:  # not AutoBot's: only when set
            status["max_models"] = behaviour.max_models
        return status

    def load(self, model: str) -> bool:
        """Load ``model``, taking the configured load delay; False when the server
        closes meanwhile. Loading a loaded model is instant.

        Raises:
            ModelCapacity: ``max_models`` are loaded already (checked before and after
                the delay).
        """
        with self._cond:
            if model in self._loaded:
                return True
            self._check_room_locked()
        delay = self.behaviour.load_delay_ms / 1000.0
        if delay > 0 and self.clock.wait(self.closing, delay):
            return False
        if self.closing.is_set():
            return False
        with self._cond:
            if model not in self._loaded:
                self._check_room_locked()
                self._loaded[model] = _Model(self.behaviour.device, self._now_iso())
                self._loads += 1
            self._cond.notify_all()
        _log.info("worker %s loaded model %s", self.worker_id, model)
        return True

    def _check_room_locked(self) -> None:
        cap = self.behaviour.max_models
        if cap is not None and len(self._loaded) >= cap:
            raise ModelCapacity(
                f"model capacity reached: {len(self._loaded)} of {cap} loaded "
                f"({', '.join(sorted(self._loaded))}); unload one first"
            )

    def unload(self, model: str) -> bool:
        """Unload ``model``; False when it was not loaded."""
        with self._cond:
            found = self._loaded.pop(model, None) is not None
            self._cond.notify_all()
        return found

    def ensure_loaded(self, model: str) -> bool | None:
        """Whether ``model`` can serve now, loading it first under ``"*"``; None when
        the server closed during the load."""
        if not _valid_model_id(model):
            return False
        with self._cond:
            if model in self._loaded:
                return True
            if not self.any_model:
                return False
        try:
            return True if self.load(model) else None
        except ModelCapacity:
            return False  # answered as a model that is not loaded

    def release(self) -> None:
        """Wake every hung handler and latency wait for shutdown."""
        with self._cond:
            self.closing.set()
            self._cond.notify_all()

    def wait_while_hung(self) -> bool:
        """Block while hang is on; return False when the server is closing instead."""
        with self._cond:
            while self.behaviour.hang and not self.closing.is_set():
                self._cond.wait()
            return not self.closing.is_set()

    def simulate_latency(self) -> bool:
        """Wait the configured latency; return False when the server closes meanwhile."""
        behaviour = self.behaviour
        delay_ms = behaviour.latency_ms
        if behaviour.jitter_ms:
            with self._cond:
                delay_ms += self._rng.uniform(-behaviour.jitter_ms, behaviour.jitter_ms)
        delay = max(0.0, delay_ms) / 1000.0
        slots = self._slots
        if slots is None:
            if delay == 0.0:
                return not self.closing.is_set()
            return not self.clock.wait(self.closing, delay)
        while not slots.acquire(timeout=0.1):  # queued behind the tasks in the slots
            if self.closing.is_set():
                return False
        try:
            if delay == 0.0:
                return not self.closing.is_set()
            return not self.clock.wait(self.closing, delay)
        finally:
            slots.release()

    def roll_failure(self, rate: float) -> bool:
        if rate <= 0.0:
            return False
        if rate >= 1.0:
            return True
        with self._cond:
            return self._rng.random() < rate

    def count_connection(self) -> None:
        with self._cond:
            self._connections += 1
            self._cond.notify_all()

    def count_request(self, path: str) -> None:
        with self._cond:
            self._requests[path] = self._requests.get(path, 0) + 1
            self._cond.notify_all()

    def count_response(self, status: int) -> None:
        with self._cond:
            self._responses[status] = self._responses.get(status, 0) + 1
            self._cond.notify_all()

    def count_inference(self, model: str) -> int:
        with self._cond:
            self._inference_count += 1
            info = self._loaded.get(model)
            if info is not None:  # unloaded meanwhile: the task still ran
                info.inference_count += 1
            self._cond.notify_all()
            return self._inference_count

    def count_failed_task(self) -> None:
        """A Windows-style ``200 {"status": "failed"}`` answer."""
        with self._cond:
            self._failed_tasks += 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def task(
        self, task_id: str | None, traceparent: str | None = None, attempt: str | None = None
    ) -> Iterator[None]:
        """Count one task request as in flight, and its task id as seen; remember the
        trace context it came with (W3C ``traceparent``), if any, as a traced worker
        would log it."""
        with self._cond:
            if traceparent is not None:
                self._traceparents.append(
                    {"task_id": task_id, "attempt": attempt, "traceparent": traceparent}
                )
            if task_id is not None:
                if task_id in self._seen:
                    self._duplicates += 1
                else:
                    self._task_ids_seen += 1
                    self._seen[task_id] = None
                    if len(self._seen) > _SEEN_TASK_IDS_LIMIT:
                        del self._seen[next(iter(self._seen))]
            self._in_flight += 1
            self._max_in_flight = max(self._max_in_flight, self._in_flight)
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    def _stats_locked(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "requests": dict(sorted(self._requests.items())),
            "responses": {str(code): n for code, n in sorted(self._responses.items())},
            "connections": self._connections,
            "task_ids_seen": self._task_ids_seen,
            "traceparents": list(self._traceparents),
            "duplicates": self._duplicates,
            "in_flight": self._in_flight,
            "max_in_flight": self._max_in_flight,
            "inference_count": self._inference_count,
            "failed_tasks": self._failed_tasks,
            "loads": self._loads,
            "protocol": self.protocol,
            "models": [*self._loaded, *([ANY_MODEL] if self.any_model else [])],
            "behaviour": self.behaviour.to_dict(),
        }

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return self._stats_locked()

    def wait_until(self, predicate: Callable[[dict[str, Any]], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self._stats_locked()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def health(self) -> dict[str, Any]:
        behaviour = self.behaviour
        models = self.models()
        loaded = [model for model in models if model != ANY_MODEL]
        common = {
            "status": behaviour.health_status,
            "worker_id": self.worker_id,
            "npu_available": behaviour.npu_available,
            "device": behaviour.device,
            "active_tasks": self._in_flight,
            "max_concurrent": self.max_concurrent,
            "draining": behaviour.draining,
            "inference_count": self._inference_count,
        }
        if self.protocol == "windows":
            # AutoBot's Windows worker lists its models here; it has no /models.
            return {**common, "platform": "windows", "loaded_models": loaded}
        # AutoBot's Linux worker gives a count here and the list at /models.
        return {
            **common,
            "loaded_models": len(loaded),
            "optimal_device": behaviour.device,
            "models": models,
        }


def _available_devices(behaviour: WorkerBehaviour) -> list[str]:
    return [DEVICE, CPU_DEVICE] if behaviour.npu_available else [CPU_DEVICE]


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        raise ValueError("request body is not valid JSON") from None


def _parse_inference(body: bytes) -> tuple[str, str]:
    """Validate an inference request; return (model_id, input_text) or raise ValueError."""
    data = _parse_json(body)
    if not isinstance(data, dict):
        raise ValueError("request body must be a JSON object")
    input_text = data.get("input_text")
    if not isinstance(input_text, str):
        raise ValueError("input_text: a string is required")
    model_id = data.get("model_id", "default")
    if not isinstance(model_id, str):
        raise ValueError("model_id: must be a string")
    max_tokens = data.get("max_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise ValueError("max_tokens: must be a positive integer")
    for name in ("temperature", "top_p"):
        value = data.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{name}: must be a number")
    return model_id, input_text


def _model_id(value: object, name: str) -> str:
    if not _valid_model_id(value):
        raise ValueError(f"{name}: a printable string of 1..{_MAX_MODEL_ID} characters is required")
    assert isinstance(value, str)
    return value


def _parse_windows_task(body: bytes) -> tuple[str, str, dict[str, Any]]:
    """Validate a Windows-style task; return (task_type, model_name, input_data)."""
    data = _parse_json(body)
    if not isinstance(data, dict):
        raise ValueError("request body must be a JSON object")
    task_type = data.get("task_type")
    if not isinstance(task_type, str):
        raise ValueError("task_type: a string is required")
    model = _model_id(data.get("model_name"), "model_name")
    input_data = data.get("input_data")
    if not isinstance(input_data, dict):
        raise ValueError("input_data: an object is required")
    for name in ("priority", "timeout_seconds"):
        value = data.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{name}: must be an integer")
    return task_type, model, input_data


def _embedding(model: str, text: str) -> list[float]:
    """A small deterministic stand-in for an embedding of ``text`` by ``model``."""
    digest = hashlib.sha256(f"{model}\0{text}".encode("utf-8", "surrogatepass")).digest()
    return [round(byte / 127.5 - 1.0, 4) for byte in digest[:_EMBEDDING_DIM]]


def _response_text(model_id: str, input_text: str) -> str:
    digest = hashlib.sha256(input_text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    words = len(input_text.split())
    return f"[{model_id}] {words} word(s), digest {digest}: {input_text[:80]}"


def _header_int(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        return None


class _Handler(BaseHTTPRequestHandler):
    """One connection of the reference worker; serves requests until the client closes."""

    protocol_version = "HTTP/1.1"
    # Without it, a small response waits for the client's delayed ACK (~40 ms).
    disable_nagle_algorithm = True
    # Buffered writes let headers and body leave in one send; handle_one_request
    # flushes after every request.
    wbufsize = 64 * 1024
    server: _HTTPServer

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            # The handshake runs here, in the connection's thread, so a slow or broken
            # client cannot stall the accept loop.
            self.request.do_handshake()
        super().setup()
        self.server.state.count_connection()

    def handle_expect_100(self) -> bool:
        accepted = super().handle_expect_100()
        # The buffered writer would otherwise hold "100 Continue" back while the client
        # waits for it before sending the body.
        self.wfile.flush()
        return accepted

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.verbose:
            super().log_message(format, *args)

    def do_GET(self) -> None:
        self._dispatch()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_GET

    def _dispatch(self) -> None:
        server = self.server
        path = self.path.partition("?")[0]
        route = server.routes.get(path)
        counted = path
        if route is None and server.state.protocol == "linux" and path.startswith("/models/"):
            route = _MODEL_ROUTE
            counted = "/models/{model_id}"  # one counter, however many model ids
        server.state.count_request(counted if route is not None else "<other>")
        body = self._read_body()
        if body is None:
            return
        if path not in _OPEN_PATHS and server.guarded:
            refusal = self._refusal(path)
            if refusal is not None:
                self._send_json(401, {"detail": refusal[0]}, headers=refusal[1])
                return
        if route is None:
            self._send_json(404, {"detail": "Not Found"})
            return
        action = route.get(self.command)
        if action is None:
            self._send_json(
                405, {"detail": "Method Not Allowed"}, headers={"Allow": ", ".join(route)}
            )
            return
        action(self, body)

    def _read_body(self) -> bytes | None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self._send_json(411, {"detail": "Content-Length required"}, close=True)
            return None
        header = self.headers.get("Content-Length")
        if header is None:
            return b""
        try:
            length = int(header)
            if length < 0:
                raise ValueError(header)
        except ValueError:
            self._send_json(400, {"detail": "invalid Content-Length"}, close=True)
            return None
        if length > MAX_BODY_BYTES:
            # The body is left unread, so the connection cannot carry another request.
            self._send_json(413, {"detail": f"body larger than {MAX_BODY_BYTES} bytes"}, close=True)
            return None
        body = self.rfile.read(length) if length else b""
        if len(body) < length:
            self.close_connection = True
            return None
        return body

    def _send_json(
        self,
        status: int,
        payload: object,
        *,
        headers: Mapping[str, str] | None = None,
        close: bool = False,
    ) -> None:
        echo = self.server.state.behaviour.echo_header
        if echo is not None and isinstance(payload, dict):
            payload = _echoed(payload, status, f"({echo}: {self.headers.get(echo)})")
        data = json.dumps(payload, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if close:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self.server.state.count_response(status)

    def _refusal(self, path: str) -> tuple[str, dict[str, str]] | None:
        """Why the request's credentials are refused, with the headers of the 401;
        None when they are accepted. Never quotes what was expected."""
        server = self.server
        if server.bearer is not None:
            given = self.headers.get("Authorization") or ""
            if not hmac.compare_digest(
                given.encode("utf-8", "surrogateescape"), server.bearer.encode()
            ):
                why = "missing bearer token" if not given else "invalid bearer token"
                return why, {"WWW-Authenticate": "Bearer"}
        if server.verifier is not None:
            reason = server.verifier.verify(
                self.command,
                self.path,
                self.headers.get("X-Service-ID"),
                self.headers.get("X-Service-Signature"),
                self.headers.get("X-Service-Timestamp"),
            )
            if reason is not None:
                return reason, {}
        return None

    def _drop(self) -> None:
        """Close the connection without an answer (the server is shutting down)."""
        self.close_connection = True

    def _forced(self) -> bool:
        """Answer a forced status code if one is set; whether it was."""
        forced = self.server.state.behaviour
        if forced.status_code is None:
            return False
        headers = {}
        if forced.retry_after is not None and forced.status_code in _RETRY_AFTER_STATUS:
            headers["Retry-After"] = _format_seconds(forced.retry_after)
        self._send_json(forced.status_code, {"detail": "forced"}, headers=headers)
        return True

    def _task(self, state: _WorkerState) -> contextlib.AbstractContextManager[None]:
        headers = self.headers
        return state.task(
            headers.get("X-NPU-Task-Id"), headers.get("traceparent"), headers.get("X-NPU-Attempt")
        )

    def _inference(self, body: bytes) -> None:
        state = self.server.state
        with self._task(state):
            if not state.wait_while_hung():
                self._drop()
                return
            if self._forced():
                return
            try:
                model_id, input_text = _parse_inference(body)
            except ValueError as exc:
                self._send_json(422, {"detail": str(exc)})
                return
            started = state.clock.monotonic()
            ready = state.ensure_loaded(model_id)
            if ready is None:
                self._drop()
                return
            if not ready:
                # The AutoBot worker's exact wording, which clients recognise.
                self._send_json(500, {"detail": f"Model {model_id} not loaded"})
                return
            if not state.simulate_latency():
                self._drop()
                return
            # Read again: /_control may have changed the behaviour during the latency.
            behaviour = state.behaviour
            if behaviour.fail_all or state.roll_failure(behaviour.failure_rate):
                self._send_json(500, {"detail": "simulated failure"})
                return
            count = state.count_inference(model_id)
            elapsed_ms = (state.clock.monotonic() - started) * 1000.0
            self._send_json(
                200,
                {
                    "model_id": model_id,
                    "device": behaviour.device,
                    "response": _response_text(model_id, input_text),
                    "inference_time_ms": round(elapsed_ms, 3),
                    "inference_count": count,
                    "worker_id": state.worker_id,
                    "task_id": self.headers.get("X-NPU-Task-Id"),
                    "attempt": _header_int(self.headers.get("X-NPU-Attempt")),
                },
            )

    def _windows_inference(self, body: bytes) -> None:
        state = self.server.state
        header_task_id = self.headers.get("X-NPU-Task-Id")
        with self._task(state):
            if not state.wait_while_hung():
                self._drop()
                return
            if self._forced():
                return
            try:
                task_type, model, input_data = _parse_windows_task(body)
            except ValueError as exc:
                self._send_json(422, {"detail": str(exc)})
                return
            task_id = header_task_id or uuid.uuid4().hex
            started = state.clock.monotonic()
            ready = state.ensure_loaded(model)
            if ready is None:
                self._drop()
                return
            if not ready:
                self._task_failed(task_id, f"Model {model} not loaded")
                return
            broken = _WINDOWS_BROKEN_TASK_TYPES.get(task_type)
            if broken is not None:
                self._task_failed(task_id, broken)
                return
            if task_type not in _WINDOWS_TASK_TYPES:
                self._task_failed(task_id, f"Unsupported task type: {task_type}")
                return
            text = input_data.get("text", "")
            if not isinstance(text, str):
                self._task_failed(task_id, "input_data.text: must be a string")
                return
            if not state.simulate_latency():
                self._drop()
                return
            behaviour = state.behaviour
            if behaviour.fail_all or state.roll_failure(behaviour.failure_rate):
                self._task_failed(task_id, "simulated failure")
                return
            count = state.count_inference(model)
            elapsed_ms = round((state.clock.monotonic() - started) * 1000.0, 3)
            self._send_json(
                200,
                {
                    "task_id": task_id,
                    "status": "completed",
                    "result": {
                        "embedding": _embedding(model, text),
                        "model_used": model,
                        "device": behaviour.device,
                        "processing_time_ms": elapsed_ms,
                        "cache_hit": False,
                    },
                    "processing_time_ms": elapsed_ms,
                    "inference_count": count,
                    "worker_id": state.worker_id,
                    "attempt": _header_int(self.headers.get("X-NPU-Attempt")),
                },
            )

    def _task_failed(self, task_id: str, error: str) -> None:
        """AutoBot's Windows worker reports a failed task with HTTP 200."""
        self.server.state.count_failed_task()
        self._send_json(
            200,
            {
                "task_id": task_id,
                "status": "failed",
                "error": error,
                "worker_id": self.server.state.worker_id,
            },
        )

    def _models(self, body: bytes) -> None:
        self._send_json(200, self.server.state.model_status())

    def _devices(self, body: bytes) -> None:
        status = self.server.state.model_status()
        del status["loaded_models"]
        self._send_json(200, status)

    def _load_model(self, body: bytes) -> None:
        try:
            data = _parse_json(body)
            if not isinstance(data, dict):
                raise ValueError("request body must be a JSON object")
            model = _model_id(data.get("model_id"), "model_id")
            if not isinstance(data.get("model_config", {}), dict):
                raise ValueError("model_config: must be an object")
        except ValueError as exc:
            self._send_json(422, {"detail": str(exc)})
            return
        forced = self.server.state.behaviour.load_status
        if forced is not None:
            self._send_json(forced, {"detail": "forced"})
            return
        try:
            loaded = self.server.state.load(model)
        except ModelCapacity as exc:
            self._send_json(507, {"detail": str(exc)})
            return
        if not loaded:
            self._drop()
            return
        self._send_json(200, {"status": "success", "model_id": model})

    def _unload_model(self, body: bytes) -> None:
        model = unquote(self.path.partition("?")[0].removeprefix("/models/"))
        if not self.server.state.unload(model):
            self._send_json(404, {"detail": f"Model {model} not found"})
            return
        self._send_json(200, {"status": "success", "model_id": model})

    def _optimize_model(self, body: bytes) -> None:
        query = parse_qs(self.path.partition("?")[2])
        try:
            model = _model_id(query.get("model_name", [None])[0], "model_name")
        except ValueError as exc:
            self._send_json(422, {"detail": f"{exc} (a query parameter)"})
            return
        level = (query.get("optimization_level") or ["balanced"])[0]
        state = self.server.state
        try:
            loaded = state.load(model)
        except ModelCapacity as exc:
            self._send_json(507, {"detail": str(exc)})
            return
        if not loaded:
            self._drop()
            return
        self._send_json(
            200,
            {
                "status": "success",
                "model": model,
                "optimization_level": level,
                "optimized_for_npu": state.behaviour.npu_available,
            },
        )

    def _echo(self, body: bytes) -> None:
        state = self.server.state
        with self._task(state):
            if not state.wait_while_hung():
                self._drop()
                return
            try:
                payload = _parse_json(body) if body else None
            except ValueError as exc:
                self._send_json(422, {"detail": str(exc)})
                return
            if not state.simulate_latency():
                self._drop()
                return
            self._send_json(200, {"worker_id": state.worker_id, "echo": payload})

    def _health(self, body: bytes) -> None:
        state = self.server.state
        if not state.wait_while_hung():
            self._drop()
            return
        health = state.health()
        self._send_json(200 if health["status"] == "healthy" else 503, health)

    def _stats(self, body: bytes) -> None:
        self._send_json(200, self.server.state.stats())

    def _control(self, body: bytes) -> None:
        try:
            changes = _parse_json(body)
            if not isinstance(changes, dict):
                raise ValueError("control body must be a JSON object")
            behaviour = self.server.state.update(changes)
        except ValueError as exc:
            self._send_json(422, {"detail": str(exc)})
            return
        self._send_json(200, {**behaviour.to_dict(), "models": self.server.state.models()})


def _echoed(payload: dict[str, Any], status: int, quote: str) -> dict[str, Any]:
    """``payload`` with ``quote`` added to each error text it carries (see
    ``WorkerBehaviour.echo_header``)."""
    failed = status >= 400 or payload.get("status") in ("failed", "error")
    if not failed:
        return payload
    echoed = dict(payload)
    for key in ("detail", "error"):
        if isinstance(echoed.get(key), str):
            echoed[key] = f"{echoed[key]} {quote}"
    if status >= 400 and isinstance(echoed.get("status"), str):  # an unhealthy /health
        echoed["status"] = f"{echoed['status']} {quote}"
    return echoed


_Action = Callable[[_Handler, bytes], None]
_Routes = Mapping[str, Mapping[str, _Action]]
_COMMON_ROUTES: dict[str, dict[str, _Action]] = {
    "/echo": {"POST": _Handler._echo},
    "/health": {"GET": _Handler._health},
    "/stats": {"GET": _Handler._stats},
    "/_control": {"POST": _Handler._control},
}
_ROUTES: dict[str, _Routes] = {
    "linux": {
        **_COMMON_ROUTES,
        "/inference": {"POST": _Handler._inference},
        "/models": {"GET": _Handler._models},
        "/models/load": {"POST": _Handler._load_model},
        "/devices": {"GET": _Handler._devices},
    },
    "windows": {
        **_COMMON_ROUTES,
        "/inference": {"POST": _Handler._windows_inference},
        "/model/optimize": {"POST": _Handler._optimize_model},
    },
}
# DELETE /models/{model_id} (linux): the one route with a parameter.
_MODEL_ROUTE: Mapping[str, _Action] = {"DELETE": _Handler._unload_model}


class _HTTPServer(ThreadingHTTPServer):
    """The listening socket plus a registry of open connections, so stop() can end them."""

    daemon_threads = True
    allow_reuse_address = True
    # Callers open hundreds of connections at once; a short backlog would refuse some.
    request_queue_size = 1024
    block_on_close = False

    def __init__(
        self,
        address: tuple[str, int],
        *,
        state: _WorkerState,
        ssl_context: ssl.SSLContext | None,
        verbose: bool,
        thread_name: str,
        verifier: HmacVerifier | None = None,
        bearer: str | None = None,
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.state = state
        self.routes: _Routes = _ROUTES[state.protocol]
        self.verifier = verifier
        self.bearer = None if bearer is None else f"Bearer {bearer}"
        self.guarded = verifier is not None or bearer is not None
        self.verbose = verbose
        self.thread_name = thread_name
        self._conn_lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._closing = False
        super().__init__(address, _Handler)
        if ssl_context is not None:
            self.socket = ssl_context.wrap_socket(
                self.socket, server_side=True, do_handshake_on_connect=False
            )

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks up the host's FQDN, a DNS query that can stall
        # start-up for seconds; the name is never used here.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)

    def process_request(
        self, request: socket.socket | tuple[bytes, socket.socket], client_address: Any
    ) -> None:
        assert isinstance(request, socket.socket)
        thread = threading.Thread(
            target=self.process_request_thread,
            args=(request, client_address),
            name=f"{self.thread_name}-conn",
            daemon=True,
        )
        with self._conn_lock:
            if self._closing:
                self.shutdown_request(request)
                return
            self._connections[request] = thread
        thread.start()

    def process_request_thread(
        self, request: socket.socket | tuple[bytes, socket.socket], client_address: Any
    ) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._conn_lock:
                self._connections.pop(request, None)  # type: ignore[arg-type]

    def handle_error(
        self, request: socket.socket | tuple[bytes, socket.socket], client_address: Any
    ) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError) or self._closing:
            # Resets, broken pipes and failed TLS handshakes are the client's business.
            _log.debug("connection from %s ended: %r", client_address, exc)
        else:
            _log.exception("error while serving %s", client_address)

    def close_connections(self) -> list[threading.Thread]:
        """Shut down every open connection; return their threads to join."""
        with self._conn_lock:
            self._closing = True
            open_connections = list(self._connections.items())
        for sock, _ in open_connections:
            with contextlib.suppress(OSError):
                # The plain-socket shutdown, even on TLS sockets: SSLSocket.shutdown
                # also drops its TLS state, which the connection's own thread may be using.
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
        return [thread for _, thread in open_connections]


def _server_ssl_context(
    cert: str | os.PathLike[str],
    key: str | os.PathLike[str] | None,
    client_ca: str | os.PathLike[str] | None,
) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    if client_ca is not None:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class WorkerServer:
    """A reference worker served from threads of this process.

    Thread-safe: ``update``, ``stats``, ``wait_until`` and ``stop`` may be called from
    any thread while requests are served.

    Args:
        host: address to bind; loopback by default.
        port: port to bind; 0 picks a free one (read it from ``port`` after ``start``).
        worker_id: reported in every answer.
        models: model ids served; ``"*"`` serves any.
        max_concurrent: the load hint reported by ``/health``.
        behaviour: initial behaviour; change it later with ``update``.
        seed: seeds jitter and simulated failures, for repeatable runs.
        tls_cert: PEM certificate chain (may include the key); serves HTTPS when given.
        tls_key: PEM private key, when not in ``tls_cert``.
        tls_client_ca: PEM CA bundle; when given, clients must present a certificate.
        clock: the clock latency and loads are waited on, and signatures checked
            against; a FakeClock makes latency instant.
        verbose: log one line per request to stderr.
        protocol: ``"linux"`` or ``"windows"``: which AutoBot worker to simulate.
        hmac_auth: ``(service_id, secret)``: every request but ``/stats`` and
            ``/_control`` must carry a valid AutoBot HMAC signature, or gets 401.
        bearer_token: every request but ``/stats`` and ``/_control`` must carry
            ``Authorization: Bearer <token>``, or gets 401.
        slots: at most this many tasks run their latency at once, the others queue
            for a slot (an NPU with that many parallel slots); None: no limit.

    Raises:
        ValueError: on an invalid argument.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        worker_id: str = "worker",
        models: Sequence[str] = ("default",),
        max_concurrent: int = 8,
        behaviour: WorkerBehaviour | None = None,
        seed: int | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_client_ca: str | os.PathLike[str] | None = None,
        clock: Clock | None = None,
        verbose: bool = False,
        protocol: str = "linux",
        hmac_auth: tuple[str, str] | None = None,
        bearer_token: str | None = None,
        slots: int | None = None,
    ) -> None:
        if isinstance(models, str):
            models = (models,)
        if slots is not None and (
            isinstance(slots, bool) or not isinstance(slots, int) or slots < 1
        ):
            raise ValueError(f"slots: must be an integer >= 1, got {slots!r}")
        if not all(isinstance(m, str) and m for m in models):
            raise ValueError(f"models: must be non-empty strings, got {models!r}")
        models = _check_models(list(models))
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol: must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        if isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int):
            raise ValueError(f"max_concurrent: must be an integer, got {max_concurrent!r}")
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent: must be >= 1, got {max_concurrent}")
        if not 0 <= port <= 65535:
            raise ValueError(f"port: must be 0..65535, got {port}")
        if (tls_key is not None or tls_client_ca is not None) and tls_cert is None:
            raise ValueError("tls_key and tls_client_ca need tls_cert")
        clock = clock or SYSTEM_CLOCK
        self._verifier = None
        if hmac_auth is not None:
            service_id, secret = hmac_auth
            self._verifier = HmacVerifier(service_id, secret, clock=clock.time)
        if bearer_token is not None and (
            not isinstance(bearer_token, str)
            or not bearer_token
            or not (bearer_token.isascii() and bearer_token.isprintable())
        ):
            # The token itself is never quoted.
            raise ValueError("bearer_token: must be a non-empty printable ASCII string")
        self._bearer = bearer_token
        self._host = host
        self._port = port
        self._tls = (tls_cert, tls_key, tls_client_ca)
        self._verbose = verbose
        self._state = _WorkerState(
            worker_id=worker_id,
            models=models,
            max_concurrent=max_concurrent,
            behaviour=behaviour or WorkerBehaviour(),
            seed=seed,
            clock=clock,
            protocol=protocol,
            slots=slots,
        )
        self._server: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lifecycle = threading.Lock()
        self._stopped = False

    @property
    def worker_id(self) -> str:
        return self._state.worker_id

    @property
    def port(self) -> int:
        """The bound port once started; until then the port asked for."""
        return self._port

    @property
    def scheme(self) -> str:
        return "https" if self._tls[0] is not None else "http"

    @property
    def url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{self.scheme}://{host}:{self._port}"

    @property
    def behaviour(self) -> WorkerBehaviour:
        return self._state.behaviour

    @property
    def protocol(self) -> str:
        return self._state.protocol

    @property
    def models(self) -> list[str]:
        """The loaded model ids, then ``"*"`` if any model is loaded on first use."""
        return self._state.models()

    def start(self) -> None:
        """Bind and serve in a named daemon thread.

        Raises:
            RuntimeError: if already started or stopped.
            OSError: if the address cannot be bound.
            ssl.SSLError: if the TLS files cannot be loaded.
        """
        with self._lifecycle:
            if self._server is not None or self._stopped:
                raise RuntimeError(f"worker {self.worker_id} was already started")
            cert, key, client_ca = self._tls
            context = _server_ssl_context(cert, key, client_ca) if cert is not None else None
            name = f"npu-sync-worker-{self.worker_id}"
            server = _HTTPServer(
                (self._host, self._port),
                state=self._state,
                ssl_context=context,
                verbose=self._verbose,
                thread_name=name,
                verifier=self._verifier,
                bearer=self._bearer,
            )
            self._port = server.server_port
            # A short poll interval so that stop() returns within tens of milliseconds.
            self._thread = threading.Thread(
                target=server.serve_forever, kwargs={"poll_interval": 0.05}, name=name, daemon=True
            )
            self._server = server
            self._thread.start()
        _log.info("worker %s listening on %s", self.worker_id, self.url)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving: drop hung and open connections and join every thread. Idempotent."""
        with self._lifecycle:
            self._stopped = True
            server, thread = self._server, self._thread
            self._server = self._thread = None
        if server is None or thread is None:
            return
        deadline = time.monotonic() + timeout
        self._state.release()
        server.shutdown()
        connection_threads = server.close_connections()
        server.server_close()
        for t in [thread, *connection_threads]:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                _log.warning("worker %s: thread %s did not stop in time", self.worker_id, t.name)

    def update(self, **changes: Any) -> WorkerBehaviour:
        """Change the behaviour of the running worker.

        Besides the :class:`WorkerBehaviour` fields, ``models=[...]`` loads exactly those
        models at once (``"*"`` included), unloading the others.

        Returns:
            The new behaviour.

        Raises:
            ValueError: on an unknown setting or an invalid value; nothing changes then.
        """
        return self._state.update(changes)

    def stats(self) -> dict[str, Any]:
        """Counters: requests by path, responses by status, task ids and duplicates seen,
        in flight and the most in flight at once, connections, inference count."""
        return self._state.stats()

    def wait_until(self, predicate: Callable[[dict[str, Any]], bool], timeout: float) -> bool:
        """Block until ``predicate(self.stats())`` holds, re-checking on every counter change.

        Returns:
            Whether it held before ``timeout`` seconds passed.
        """
        return self._state.wait_until(predicate, timeout)

    def __enter__(self) -> WorkerServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"WorkerServer(worker_id={self.worker_id!r}, url={self.url!r})"


def _non_negative(text: str) -> float:
    try:
        return _check_number("value", float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None


def _rate(text: str) -> float:
    try:
        return _check_number("value", float(text), upper=1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535, got {text!r}")
    return value


def build_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the worker's command-line flags to ``parser`` (a new one when None).

    Returns:
        The parser.
    """
    if parser is None:
        parser = argparse.ArgumentParser(
            prog="python -m npu_sync.worker_server",
            description="Run a simulated NPU worker that speaks the npu_sync worker protocol.",
        )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    parser.add_argument(
        "--port",
        type=_port,
        default=8081,
        help="port to bind; 0 picks a free one (default %(default)s)",
    )
    parser.add_argument(
        "--worker-id", default=None, help="id reported in answers (default: worker-<port>)"
    )
    parser.add_argument(
        "--latency-ms",
        type=_non_negative,
        default=0.0,
        metavar="MS",
        help="simulated latency per task, in milliseconds (default %(default)g)",
    )
    parser.add_argument(
        "--jitter-ms",
        type=_non_negative,
        default=0.0,
        metavar="MS",
        help="uniform +/- jitter on the latency, in milliseconds (default %(default)g)",
    )
    parser.add_argument(
        "--failure-rate",
        type=_rate,
        default=0.0,
        metavar="P",
        help="probability, 0 to 1, that a task answers a simulated 500 (default %(default)g)",
    )
    parser.add_argument(
        "--health-status",
        default="healthy",
        help="status reported by /health (default %(default)s)",
    )
    parser.add_argument(
        "--models",
        default="default",
        help='comma-separated model ids loaded at start; "*" loads any model on first use '
        "(default %(default)s)",
    )
    parser.add_argument(
        "--max-models",
        type=int,
        default=None,
        metavar="N",
        help="the most models loaded at once; a load beyond answers 507 (default: no limit)",
    )
    parser.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="linux",
        help="which AutoBot worker to simulate; AutoBot's Windows worker listens on 8082 "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--load-delay-ms",
        type=_non_negative,
        default=0.0,
        metavar="MS",
        help="time loading a model takes, in milliseconds (default %(default)g)",
    )
    parser.add_argument(
        "--no-npu",
        dest="npu_available",
        action="store_false",
        help="report npu_available: false, as a worker fallen back to CPU "
        "(default: the NPU is available)",
    )
    parser.add_argument(
        "--hmac-service-id",
        default=None,
        metavar="ID",
        help="require AutoBot HMAC-signed requests from this service id; the secret is "
        "read from the environment variable named by --hmac-secret-env (default: no check)",
    )
    parser.add_argument(
        "--hmac-secret-env",
        default=HMAC_SECRET_ENV,
        metavar="VAR",
        help="environment variable holding the HMAC secret (default %(default)s)",
    )
    parser.add_argument(
        "--bearer-token-env",
        default=None,
        metavar="VAR",
        help="require 'Authorization: Bearer <token>' with the token read from this "
        "environment variable (default: no check)",
    )
    parser.add_argument(
        "--max-concurrent",
        type=_positive_int,
        default=8,
        metavar="N",
        help="load hint reported by /health, in tasks (default %(default)s)",
    )
    parser.add_argument(
        "--slots",
        type=_positive_int,
        default=None,
        metavar="N",
        help="run at most N tasks at once and queue the rest, as an NPU with N parallel "
        "slots (default: no limit)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed for jitter and failures (default: a fresh one each run)",
    )
    parser.add_argument(
        "--tls-cert", default=None, help="PEM certificate (chain); serves HTTPS (default: HTTP)"
    )
    parser.add_argument(
        "--tls-key", default=None, help="PEM private key (default: read from --tls-cert)"
    )
    parser.add_argument(
        "--tls-client-ca",
        default=None,
        help="PEM CA bundle; require client certificates (default: none required)",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="log every request to stderr (default: off)"
    )
    return parser


class _StopServing(Exception):
    """Raised by the signal handler to leave the wait in serve()."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    # Raising, rather than setting an Event, cannot deadlock on a lock the interrupted
    # main thread already holds.
    raise _StopServing(signum)


def serve(args: argparse.Namespace, *, stop: threading.Event | None = None) -> int:
    """Run a worker until SIGTERM or SIGINT (or ``stop`` is set), then stop it gracefully.

    Prints one line to stdout once it accepts connections:
    ``npu-sync worker <worker_id> listening on <scheme>://<host>:<port>``.

    Args:
        args: parsed by a parser from :func:`build_arg_parser`.
        stop: an event that also ends serving (for embedding in other threads).

    Returns:
        The exit code: 0 after a graceful stop, 1 when the worker could not start,
        2 on invalid arguments.
    """
    models = tuple(m.strip() for m in str(args.models).split(",") if m.strip())
    try:
        hmac_auth = bearer = None
        # Secrets come from the environment: a command line is visible to every user.
        if args.hmac_service_id is not None:
            secret = os.environ.get(args.hmac_secret_env)
            if not secret:
                raise ValueError(
                    f"--hmac-service-id needs the secret in ${args.hmac_secret_env}, "
                    "which is unset or empty"
                )
            hmac_auth = (args.hmac_service_id, secret)
        if args.bearer_token_env is not None:
            bearer = os.environ.get(args.bearer_token_env)
            if not bearer:
                raise ValueError(f"${args.bearer_token_env} (the bearer token) is unset or empty")
        behaviour = WorkerBehaviour(
            latency_ms=args.latency_ms,
            jitter_ms=args.jitter_ms,
            failure_rate=args.failure_rate,
            health_status=args.health_status,
            npu_available=args.npu_available,
            load_delay_ms=args.load_delay_ms,
            max_models=args.max_models,
        )
        server = WorkerServer(
            args.host,
            args.port,
            worker_id=args.worker_id or f"worker-{args.port}",
            models=models,
            max_concurrent=args.max_concurrent,
            behaviour=behaviour,
            seed=args.seed,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
            verbose=args.verbose,
            protocol=args.protocol,
            hmac_auth=hmac_auth,
            bearer_token=bearer,
            slots=args.slots,
        )
    except ValueError as exc:
        print(f"npu-sync worker: {exc}", file=sys.stderr)
        return 2
    stop = stop or threading.Event()
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.Signals.SIGTERM, signal.Signals.SIGINT):
            previous[signum] = signal.signal(signum, _raise_stop)
    try:
        try:
            server.start()
        except (OSError, RuntimeError) as exc:
            print(
                f"npu-sync worker: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr
            )
            return 1
        print(f"npu-sync worker {server.worker_id} listening on {server.url}", flush=True)
        stop.wait()
    except _StopServing:
        pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        server.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m npu_sync.worker_server``; returns the exit code."""
    args = build_arg_parser().parse_args(None if argv is None else list(argv))
    return serve(args)


_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)
# How LocalWorker hands its child the secrets: environment variables, which other users
# cannot read, unlike a command line.
_CHILD_HMAC_ENV = "NPU_SYNC_LOCAL_WORKER_HMAC_SECRET"
_CHILD_BEARER_ENV = "NPU_SYNC_LOCAL_WORKER_BEARER_TOKEN"


class LocalWorker:
    """A reference worker in a child process, for tests, benchmarks and the demo.

    Not thread-safe: start, stop, kill, pause and restart it from one thread.
    ``control`` and ``stats`` open their own connection and may run in any thread.

    Args:
        port: port to bind; 0 picks a free one, which ``restart`` then reuses.
        worker_id: reported in the worker's answers.
        latency_ms, jitter_ms, failure_rate: initial behaviour; see WorkerBehaviour.
        models: model ids served; ``"*"`` serves any.
        max_concurrent: the load hint reported by ``/health``.
        protocol: ``"linux"`` or ``"windows"`` (see :class:`WorkerServer`).
        load_delay_ms, npu_available, max_models: initial behaviour; see WorkerBehaviour.
        slots: tasks inferred at once, the rest queued (see :class:`WorkerServer`).
        hmac_auth: ``(service_id, secret)`` the worker requires signatures with; the
            secret reaches the child through its environment, not its command line.
        bearer_token: the bearer token the worker requires (passed the same way).
        tls_cert, tls_key: serve HTTPS with these PEM files.
        extra_args: more command-line flags (see :func:`build_arg_parser`).
        startup_timeout: seconds to wait for the worker to report it is listening.
        client_ssl_context: used by ``control`` and ``stats`` over HTTPS; by default
            the worker's certificate is not verified (it is this process's own child).
    """

    def __init__(
        self,
        port: int = 0,
        *,
        worker_id: str = "worker",
        latency_ms: float = 0.0,
        jitter_ms: float = 0.0,
        failure_rate: float = 0.0,
        models: Sequence[str] = ("default",),
        max_concurrent: int = 64,
        protocol: str = "linux",
        load_delay_ms: float = 0.0,
        npu_available: bool = True,
        slots: int | None = None,
        max_models: int | None = None,
        hmac_auth: tuple[str, str] | None = None,
        bearer_token: str | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 60.0,
        client_ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if isinstance(models, str):
            models = (models,)
        self.worker_id = worker_id
        self.protocol = protocol
        self._port = port
        self._scheme = "https" if tls_cert is not None else "http"
        self._args = [
            "--host", "127.0.0.1",
            "--worker-id", worker_id,
            "--latency-ms", repr(float(latency_ms)),
            "--jitter-ms", repr(float(jitter_ms)),
            "--failure-rate", repr(float(failure_rate)),
            "--models", ",".join(models),
            "--max-concurrent", str(max_concurrent),
            "--protocol", protocol,
            "--load-delay-ms", repr(float(load_delay_ms)),
        ]  # fmt: skip
        if not npu_available:
            self._args.append("--no-npu")
        if slots is not None:
            self._args += ["--slots", str(slots)]
        if max_models is not None:
            self._args += ["--max-models", str(max_models)]
        self._secrets: dict[str, str] = {}
        if hmac_auth is not None:
            self._args += ["--hmac-service-id", hmac_auth[0], "--hmac-secret-env", _CHILD_HMAC_ENV]
            self._secrets[_CHILD_HMAC_ENV] = hmac_auth[1]
        if bearer_token is not None:
            self._args += ["--bearer-token-env", _CHILD_BEARER_ENV]
            self._secrets[_CHILD_BEARER_ENV] = bearer_token
        if tls_cert is not None:
            self._args += ["--tls-cert", os.fspath(tls_cert)]
        if tls_key is not None:
            self._args += ["--tls-key", os.fspath(tls_key)]
        self._args += list(extra_args)
        self._startup_timeout = startup_timeout
        self._client_ssl_context = client_ssl_context
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None
        self._paused = False
        self.returncode: int | None = None
        """Exit code of the last child that ended (negative: killed by that signal)."""

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"{self._scheme}://127.0.0.1:{self._port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> LocalWorker:
        """Spawn the worker and wait until it listens.

        Returns:
            self.

        Raises:
            RuntimeError: if it is already running, or did not report listening within
                ``startup_timeout`` (the message carries the child's stderr).
        """
        if self.running:
            raise RuntimeError(f"worker {self.worker_id} is already running")
        self._reap()
        command = [
            sys.executable, "-m", "npu_sync.worker_server", "--port", str(self._port), *self._args
        ]  # fmt: skip
        env = dict(os.environ)
        # The child must import this same npu_sync, installed or not.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p
        )
        env.update(self._secrets)
        # Outlives this call: it holds the child's stderr until the child is reaped.
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115
        self._paused = False
        self._proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._stderr, env=env
        )
        try:
            line = self._read_ready_line(self._proc)
        except RuntimeError:
            self._proc.kill()
            self._proc.wait()
            self._reap()
            raise
        match = _READY_LINE.match(line)
        if match is None:  # pragma: no cover - the child prints exactly this line
            self.stop()
            raise RuntimeError(f"worker {self.worker_id} printed an unexpected line: {line!r}")
        self._scheme = match.group(2)
        self._port = int(match.group(4))
        _log.debug("worker %s (pid %d) listening on %s", self.worker_id, self._proc.pid, self.url)
        return self

    def _read_ready_line(self, proc: subprocess.Popen[bytes]) -> str:
        assert proc.stdout is not None
        deadline = time.monotonic() + self._startup_timeout
        buffer = b""
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(proc.stdout, selectors.EVENT_READ)
                while b"\n" not in buffer:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise RuntimeError(self._startup_failure("did not start in time"))
                    if not selector.select(remaining):
                        continue
                    chunk = os.read(proc.stdout.fileno(), 4096)
                    if not chunk:
                        proc.wait()
                        raise RuntimeError(
                            self._startup_failure(f"exited with code {proc.returncode}")
                        )
                    buffer += chunk
        finally:
            # The worker prints nothing after the ready line, so the pipe is done with.
            proc.stdout.close()
        return buffer.partition(b"\n")[0].decode(errors="replace")

    def _startup_failure(self, what: str) -> str:
        return f"worker {self.worker_id} {what}; stderr:\n{self._stderr_text()}"

    def _stderr_text(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def _reap(self) -> None:
        if self._proc is not None and self._proc.returncode is not None:
            self.returncode = self._proc.returncode
            self._proc = None
        if self._proc is None and self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def kill(self) -> None:
        """SIGKILL the worker and reap it."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._reap()

    def pause(self) -> None:
        """Freeze the worker (SIGSTOP): connections are accepted by the kernel, not answered."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        """Thaw a frozen worker (SIGCONT)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)
        self._paused = False

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM the worker and wait; SIGKILL it after ``timeout``. Idempotent."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            if self._paused:
                self.resume()
            self._proc.terminate()
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _log.warning("worker %s ignored SIGTERM; killing it", self.worker_id)
                self._proc.kill()
                self._proc.wait()
        self._reap()

    def restart(self) -> LocalWorker:
        """Stop the worker if running and start it again on the same port.

        Returns:
            self.
        """
        self.stop()
        return self.start()

    def _request(self, method: str, path: str, body: object = None, timeout: float = 10.0) -> Any:
        connection: http.client.HTTPConnection
        if self._scheme == "https":
            context = self._client_ssl_context
            if context is None:
                context = ssl.create_default_context()
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            connection = http.client.HTTPSConnection(
                "127.0.0.1", self._port, timeout=timeout, context=context
            )
        else:
            connection = http.client.HTTPConnection("127.0.0.1", self._port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if data is not None else {}
            connection.request(method, path, body=data, headers=headers)
            response = connection.getresponse()
            payload = json.loads(response.read())
        finally:
            connection.close()
        if response.status == 422:
            raise ValueError(payload.get("detail", payload))
        if response.status != 200:
            raise RuntimeError(f"worker {self.worker_id}: {method} {path} -> {response.status}")
        return payload

    def control(self, **changes: Any) -> dict[str, Any]:
        """Change the running worker's behaviour (see WorkerBehaviour).

        Returns:
            The worker's new settings.

        Raises:
            ValueError: on an unknown setting or invalid value.
        """
        result: dict[str, Any] = self._request("POST", "/_control", changes)
        return result

    def stats(self) -> dict[str, Any]:
        """The worker's counters (``GET /stats``)."""
        result: dict[str, Any] = self._request("GET", "/stats")
        return result

    def __enter__(self) -> LocalWorker:
        if not self.running:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalWorker(worker_id={self.worker_id!r}, url={self.url!r}, pid={self.pid})"


if __name__ == "__main__":
    sys.exit(main())
