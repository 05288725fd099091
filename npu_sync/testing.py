"""Helpers for testing code that uses npu_sync: a fake clock, a fake transport,
and local reference workers. Public and used by npu_sync's own tests.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from npu_sync.transport import Cancel, Response, TransportError, TransportFeatures

if TYPE_CHECKING:
    from npu_sync.config import TransportConfig, WorkerConfig


__all__ = [
    "DrippingServer",
    "FakeClock",
    "FakeNetwork",
    "FakeRequest",
    "FakeTransport",
    "json_response",
]


class FakeClock:
    """A clock that moves only when told to. Thread-safe.

    ``sleep`` advances the clock instead of blocking, so backoff and breaker
    timeouts can be driven without waiting; ``sleeps`` records every sleep asked for.
    """

    def __init__(self, start: float = 1000.0, wall: float = 1_700_000_000.0) -> None:
        self._lock = threading.Lock()
        self._now = start
        self._wall_offset = wall - start
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def time(self) -> float:
        with self._lock:
            return self._now + self._wall_offset

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.sleeps.append(seconds)
            if seconds > 0:
                self._now += seconds

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        if event.is_set():
            return True
        if timeout is not None:
            self.advance(timeout)
        return event.is_set()


Handler = Callable[["FakeRequest"], Response | BaseException]
"""Answers a FakeRequest: a Response to return, or an exception instance to raise."""


@dataclass(frozen=True)
class FakeRequest:
    """One request a FakeTransport received, with the headers it would have sent."""

    worker_id: str
    method: str
    path: str
    body: bytes | None
    headers: Mapping[str, str]
    timeout: float
    connect_timeout: float | None = None
    replayable: bool = False
    cancel: Cancel | None = None
    """Given for a hedged attempt: a handler that blocks may wait on ``cancel.event``."""

    def json(self) -> Any:
        """The body decoded as JSON; ValueError when there is none or it is not JSON."""
        if self.body is None:
            raise ValueError(f"{self.method} {self.path} has no body")
        return json.loads(self.body)


def json_response(status: int, body: Any, headers: Mapping[str, str] | None = None) -> Response:
    """A Response carrying ``body`` as JSON, with header names lower-cased."""
    all_headers = {"content-type": "application/json"}
    if headers:
        all_headers.update((name.lower(), value) for name, value in headers.items())
    return Response(status, all_headers, json.dumps(body).encode())


class FakeTransport:
    """A Transport that hands each request to ``handler`` instead of the network.

    Thread-safe. Records every request in ``requests`` (including ones made after
    :meth:`close`, which fail like a closed real transport). Headers are merged the
    way the real transports merge them: ``headers`` given here, plus
    ``Content-Type: application/json`` when there is a body and they name none, then
    the call's own headers, which win by case-insensitive name.

    Cancellable: a request given ``cancel=`` carries it in its FakeRequest, and a
    request cancelled by the time its handler returns fails as a real one would.

    Args:
        worker_id: recorded on every FakeRequest.
        handler: answers each request.
        headers: the worker's configured headers.
        max_response_bytes: if given, larger bodies fail with ``kind="too_large"``.
    """

    def __init__(
        self,
        worker_id: str,
        handler: Handler,
        *,
        headers: Mapping[str, str] | None = None,
        max_response_bytes: int | None = None,
    ) -> None:
        self.worker_id = worker_id
        self._handler = handler
        self._headers = dict(headers or {})
        self._limit = max_response_bytes
        self._lock = threading.Lock()
        self.requests: list[FakeRequest] = []
        self.closed = False

    features = TransportFeatures(cancellable=True)
    # The older spelling, for code that probes the attribute.
    cancellable = features.cancellable

    def request(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float,
        connect_timeout: float | None = None,
        replayable: bool = False,
        cancel: Cancel | None = None,
    ) -> Response:
        """Record the request, then answer it with the handler.

        Raises:
            TransportError: the transport is closed, the body exceeds the size limit,
                or the handler returned one.
            BaseException: whatever exception instance the handler returned.
        """
        sent = dict(self._headers)
        if body is not None and not any(name.lower() == "content-type" for name in sent):
            sent["Content-Type"] = "application/json"
        if headers:
            sent = _merged(sent, headers)
        req = FakeRequest(
            self.worker_id, method, path, body, sent, timeout, connect_timeout, replayable, cancel
        )
        with self._lock:
            self.requests.append(req)
            closed = self.closed
        if closed:
            raise TransportError("connect", f"transport for {self.worker_id} is closed", sent=False)
        outcome = self._handler(req)
        if cancel is not None and cancel.cancelled:
            raise TransportError("reset", f"{self.worker_id}: request cancelled", sent=True)
        if isinstance(outcome, BaseException):
            raise outcome
        if self._limit is not None and len(outcome.body) > self._limit:
            raise TransportError(
                "too_large", f"response body exceeds {self._limit} bytes", sent=True
            )
        return outcome

    def close(self) -> None:
        """Mark the transport closed; later requests fail with ``kind="connect"``."""
        with self._lock:
            self.closed = True


def _merged(base: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    merged = dict(base)
    for name, value in extra.items():
        for existing in [key for key in merged if key.lower() == name.lower()]:
            del merged[existing]
        merged[name] = value
    return merged


def _default_handler(req: FakeRequest) -> Response:
    if req.path == "/health":
        return json_response(200, {"status": "healthy", "worker_id": req.worker_id})
    return json_response(200, {"ok": True, "worker_id": req.worker_id})


class FakeNetwork:
    """Routes each worker id to a handler; builds FakeTransports for a pool.

    Pass :meth:`factory` where a transport factory is expected (it has the signature
    of :func:`npu_sync.transport.make_transport`). Handlers are looked up on every
    request, so :meth:`route` changes a worker's behaviour for transports already built.
    Thread-safe.

    Args:
        default: answers workers without a route of their own. The built-in default
            answers ``/health`` with ``200 {"status": "healthy", "worker_id": ...}``
            and anything else with ``200 {"ok": true, "worker_id": ...}``.
    """

    def __init__(self, default: Handler | None = None) -> None:
        self._default: Handler = default if default is not None else _default_handler
        self._routes: dict[str, Handler] = {}
        self._lock = threading.Lock()
        self._requests: list[FakeRequest] = []
        self._transports: list[FakeTransport] = []

    def route(self, worker_id: str, handler: Handler) -> None:
        """Send ``worker_id``'s requests to ``handler`` from now on."""
        with self._lock:
            self._routes[worker_id] = handler

    def factory(
        self,
        worker: WorkerConfig,
        transport_config: TransportConfig,
        maxsize: int | None = None,
    ) -> FakeTransport:
        """Build a FakeTransport for ``worker``, routed through this network."""
        transport = FakeTransport(
            worker.id,
            self._dispatch,
            headers=worker.headers,
            max_response_bytes=transport_config.max_response_bytes,
        )
        with self._lock:
            self._transports.append(transport)
        return transport

    def requests(self, worker_id: str | None = None) -> list[FakeRequest]:
        """Every request that reached a handler, in order; only ``worker_id``'s if given."""
        with self._lock:
            recorded = list(self._requests)
        if worker_id is None:
            return recorded
        return [req for req in recorded if req.worker_id == worker_id]

    def transports(self, worker_id: str | None = None) -> list[FakeTransport]:
        """Every transport built so far, in order; only ``worker_id``'s if given."""
        with self._lock:
            built = list(self._transports)
        if worker_id is None:
            return built
        return [t for t in built if t.worker_id == worker_id]

    def _dispatch(self, req: FakeRequest) -> Response | BaseException:
        with self._lock:
            self._requests.append(req)
            handler = self._routes.get(req.worker_id, self._default)
        return handler(req)


class DrippingServer:
    """A loopback HTTP server that answers its first connection one byte at a time.

    It sends a 200 status and a ``Content-Length`` far larger than it will ever
    send, then one byte every ``interval`` seconds (each socket read on the client
    succeeds well within any read timeout), until closed. For testing that a whole
    answer, not only each read, is bounded in time. Use as a context manager; the
    server thread ends on exit.
    """

    def __init__(self, interval: float = 0.05) -> None:
        import socket

        self._interval = interval
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(8)
        self.port: int = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drip, name="dripping-server")

    def _drip(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return  # closed before any client came
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")
            while not self._stop.wait(self._interval):
                try:
                    conn.sendall(b" ")
                except OSError:
                    return

    def __enter__(self) -> DrippingServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._listener.close()
        self._thread.join(5)
