"""The reference NPU worker: a simulated inference server that speaks the worker protocol.

It runs in three ways:

* in-process, as :class:`WorkerServer` (unit tests);
* as a program, ``python -m npu_sync.worker_server`` or ``npu-sync worker``;
* as a child process driven from Python, :class:`LocalWorker` (integration tests,
  benchmarks and the demo), which can kill, freeze, slow or restart it.

Endpoints: ``POST /inference`` and ``POST /echo`` (task endpoints), ``GET /health``,
``GET /stats`` and ``POST /_control``, which changes a running worker's behaviour (latency,
failures, a lying or hanging worker, forced status codes). Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any

from npu_sync.clock import SYSTEM_CLOCK, Clock

__all__ = [
    "ANY_MODEL",
    "DEVICE",
    "MAX_BODY_BYTES",
    "LocalWorker",
    "WorkerBehaviour",
    "WorkerServer",
    "build_arg_parser",
    "main",
    "serve",
]

_log = logging.getLogger(__name__)

DEVICE = "NPU (simulated)"
"""The ``device`` every answer of the reference worker names."""

MAX_BODY_BYTES = 8 * 1024 * 1024
"""Request bodies larger than this are refused with 413."""

ANY_MODEL = "*"
"""In ``models``, serves every model id."""

_SEEN_TASK_IDS_LIMIT = 1_000_000
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

    def __post_init__(self) -> None:
        _check_number("latency_ms", self.latency_ms)
        _check_number("jitter_ms", self.jitter_ms)
        _check_number("failure_rate", self.failure_rate, upper=1.0)
        if not isinstance(self.health_status, str) or not self.health_status:
            raise ValueError(
                f"health_status: must be a non-empty string, got {self.health_status!r}"
            )
        for name in ("fail_all", "hang", "draining"):
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

    def to_dict(self) -> dict[str, Any]:
        """The settings as a JSON-serialisable dict."""
        return asdict(self)


_BEHAVIOUR_FIELDS = frozenset(f.name for f in fields(WorkerBehaviour))


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
    ) -> None:
        self.worker_id = worker_id
        self.models = tuple(models)
        self.any_model = ANY_MODEL in self.models
        self.max_concurrent = max_concurrent
        self.clock = clock
        self.behaviour = behaviour
        self.closing = threading.Event()
        self._cond = threading.Condition(threading.Lock())
        self._rng = random.Random(seed)
        self._requests: dict[str, int] = {}
        self._responses: dict[int, int] = {}
        self._seen: dict[str, None] = {}
        self._task_ids_seen = 0
        self._duplicates = 0
        self._in_flight = 0
        self._max_in_flight = 0
        self._inference_count = 0
        self._connections = 0

    def update(self, changes: Mapping[str, Any]) -> WorkerBehaviour:
        unknown = sorted(set(changes) - _BEHAVIOUR_FIELDS)
        if unknown:
            raise ValueError(f"unknown setting(s): {', '.join(unknown)}")
        with self._cond:
            new = replace(self.behaviour, **changes)
            self.behaviour = new
            self._cond.notify_all()
        _log.info("worker %s behaviour now %s", self.worker_id, new)
        return new

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
        if delay == 0.0:
            return not self.closing.is_set()
        return not self.clock.wait(self.closing, delay)

    def roll_failure(self, rate: float) -> bool:
        if rate <= 0.0:
            return False
        if rate >= 1.0:
            return True
        with self._cond:
            return self._rng.random() < rate

    def serves(self, model_id: str) -> bool:
        return self.any_model or model_id in self.models

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

    def count_inference(self) -> int:
        with self._cond:
            self._inference_count += 1
            self._cond.notify_all()
            return self._inference_count

    @contextlib.contextmanager
    def task(self, task_id: str | None) -> Iterator[None]:
        """Count one task request as in flight, and its task id as seen."""
        with self._cond:
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
            "duplicates": self._duplicates,
            "in_flight": self._in_flight,
            "max_in_flight": self._max_in_flight,
            "inference_count": self._inference_count,
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
        return {
            "status": behaviour.health_status,
            "worker_id": self.worker_id,
            "device": DEVICE,
            "active_tasks": self._in_flight,
            "max_concurrent": self.max_concurrent,
            "draining": behaviour.draining,
            "inference_count": self._inference_count,
            "models": list(self.models),
        }


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
        path = self.path.partition("?")[0]
        route = _ROUTES.get(path)
        self.server.state.count_request(path if route is not None else "<other>")
        body = self._read_body()
        if body is None:
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

    def _drop(self) -> None:
        """Close the connection without an answer (the server is shutting down)."""
        self.close_connection = True

    def _inference(self, body: bytes) -> None:
        state = self.server.state
        with state.task(self.headers.get("X-NPU-Task-Id")):
            if not state.wait_while_hung():
                self._drop()
                return
            forced = state.behaviour
            if forced.status_code is not None:
                headers = {}
                if forced.retry_after is not None and forced.status_code in _RETRY_AFTER_STATUS:
                    headers["Retry-After"] = _format_seconds(forced.retry_after)
                self._send_json(forced.status_code, {"detail": "forced"}, headers=headers)
                return
            try:
                model_id, input_text = _parse_inference(body)
            except ValueError as exc:
                self._send_json(422, {"detail": str(exc)})
                return
            if not state.serves(model_id):
                # The AutoBot worker's exact wording, which clients recognise.
                self._send_json(500, {"detail": f"Model {model_id} not loaded"})
                return
            started = state.clock.monotonic()
            if not state.simulate_latency():
                self._drop()
                return
            # Read again: /_control may have changed the behaviour during the latency.
            behaviour = state.behaviour
            if behaviour.fail_all or state.roll_failure(behaviour.failure_rate):
                self._send_json(500, {"detail": "simulated failure"})
                return
            count = state.count_inference()
            elapsed_ms = (state.clock.monotonic() - started) * 1000.0
            self._send_json(
                200,
                {
                    "model_id": model_id,
                    "device": DEVICE,
                    "response": _response_text(model_id, input_text),
                    "inference_time_ms": round(elapsed_ms, 3),
                    "inference_count": count,
                    "worker_id": state.worker_id,
                    "task_id": self.headers.get("X-NPU-Task-Id"),
                    "attempt": _header_int(self.headers.get("X-NPU-Attempt")),
                },
            )

    def _echo(self, body: bytes) -> None:
        state = self.server.state
        with state.task(self.headers.get("X-NPU-Task-Id")):
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
        self._send_json(200, behaviour.to_dict())


_Action = Callable[[_Handler, bytes], None]
_ROUTES: dict[str, dict[str, _Action]] = {
    "/inference": {"POST": _Handler._inference},
    "/echo": {"POST": _Handler._echo},
    "/health": {"GET": _Handler._health},
    "/stats": {"GET": _Handler._stats},
    "/_control": {"POST": _Handler._control},
}


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
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.state = state
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
        clock: the clock latency is waited on; a FakeClock makes latency instant.
        verbose: log one line per request to stderr.

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
    ) -> None:
        if isinstance(models, str):
            models = (models,)
        if not models or not all(isinstance(m, str) and m for m in models):
            raise ValueError(f"models: must be non-empty strings, got {models!r}")
        if isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int):
            raise ValueError(f"max_concurrent: must be an integer, got {max_concurrent!r}")
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent: must be >= 1, got {max_concurrent}")
        if not 0 <= port <= 65535:
            raise ValueError(f"port: must be 0..65535, got {port}")
        if (tls_key is not None or tls_client_ca is not None) and tls_cert is None:
            raise ValueError("tls_key and tls_client_ca need tls_cert")
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
            clock=clock or SYSTEM_CLOCK,
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
        help='comma-separated model ids; "*" serves any model (default %(default)s)',
    )
    parser.add_argument(
        "--max-concurrent",
        type=_positive_int,
        default=8,
        metavar="N",
        help="load hint reported by /health, in tasks (default %(default)s)",
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
        behaviour = WorkerBehaviour(
            latency_ms=args.latency_ms,
            jitter_ms=args.jitter_ms,
            failure_rate=args.failure_rate,
            health_status=args.health_status,
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
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 10.0,
        client_ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if isinstance(models, str):
            models = (models,)
        self.worker_id = worker_id
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
        ]  # fmt: skip
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
