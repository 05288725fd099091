"""The HTTP side of the reference worker: one handler per connection, each protocol's
routes, and the listening server that keeps track of its connections."""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import socket
import socketserver
import ssl
import sys
import threading
import uuid
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote

from npu_sync.auth import HmacVerifier
from npu_sync.worker_server._models import (
    WINDOWS_BROKEN_TASK_TYPES,
    WINDOWS_TASK_TYPES,
    ModelCapacity,
    embedding,
    response_text,
)
from npu_sync.worker_server._payloads import (
    checked_model_id,
    header_int,
    parse_inference,
    parse_json,
    parse_windows_task,
)
from npu_sync.worker_server._state import WorkerState

_log = logging.getLogger("npu_sync.worker_server")  # one logger for the whole worker

MAX_BODY_BYTES = 8 * 1024 * 1024
"""Request bodies larger than this are refused with 413."""

# Paths that never require authentication: test hooks, not part of any real worker.
_OPEN_PATHS = frozenset({"/_control", "/stats"})
_RETRY_AFTER_STATUS = (429, 503)


def _format_seconds(seconds: float) -> str:
    # Whole seconds are what RFC 9110 allows; fractions are kept so tests can use
    # sub-second values, and clients that parse floats honour them.
    if float(seconds).is_integer():
        return str(int(seconds))
    return f"{seconds:.3f}".rstrip("0").rstrip(".")


class _Handler(BaseHTTPRequestHandler):
    """One connection of the reference worker; serves requests until the client closes."""

    protocol_version = "HTTP/1.1"
    # Without it, a small response waits for the client's delayed ACK (~40 ms).
    disable_nagle_algorithm = True
    # Buffered writes let headers and body leave in one send; handle_one_request
    # flushes after every request.
    wbufsize = 64 * 1024
    server: WorkerHTTPServer

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

    def _task(self, state: WorkerState) -> contextlib.AbstractContextManager[None]:
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
                model_id, input_text = parse_inference(body)
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
            if not state.simulate_latency(model_id):
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
                    "response": response_text(model_id, input_text),
                    "inference_time_ms": round(elapsed_ms, 3),
                    "inference_count": count,
                    "worker_id": state.worker_id,
                    "task_id": self.headers.get("X-NPU-Task-Id"),
                    "attempt": header_int(self.headers.get("X-NPU-Attempt")),
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
                task_type, model, input_data = parse_windows_task(body)
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
            broken = WINDOWS_BROKEN_TASK_TYPES.get(task_type)
            if broken is not None:
                self._task_failed(task_id, broken)
                return
            if task_type not in WINDOWS_TASK_TYPES:
                self._task_failed(task_id, f"Unsupported task type: {task_type}")
                return
            text = input_data.get("text", "")
            if not isinstance(text, str):
                self._task_failed(task_id, "input_data.text: must be a string")
                return
            if not state.simulate_latency(model):
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
                        "embedding": embedding(model, text),
                        "model_used": model,
                        "device": behaviour.device,
                        "processing_time_ms": elapsed_ms,
                        "cache_hit": False,
                    },
                    "processing_time_ms": elapsed_ms,
                    "inference_count": count,
                    "worker_id": state.worker_id,
                    "attempt": header_int(self.headers.get("X-NPU-Attempt")),
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
            data = parse_json(body)
            if not isinstance(data, dict):
                raise ValueError("request body must be a JSON object")
            model = checked_model_id(data.get("model_id"), "model_id")
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
            model = checked_model_id(query.get("model_name", [None])[0], "model_name")
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
                payload = parse_json(body) if body else None
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
            changes = parse_json(body)
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


class WorkerHTTPServer(ThreadingHTTPServer):
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
        state: WorkerState,
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
