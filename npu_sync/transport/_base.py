"""What every transport shares: the protocol, the response, the one error type.

A transport carries one worker's HTTP exchanges. The pool calls
:meth:`Transport.request` on its hot path and reads only :class:`Response` and
:class:`TransportError` from it, so a transport may be built on any client.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from npu_sync._version import installed_version
from npu_sync.errors import NpuSyncError

if TYPE_CHECKING:
    from npu_sync.config import WorkerConfig

TRANSPORT_ERROR_KINDS = frozenset({"connect", "timeout", "reset", "too_large", "protocol", "tls"})
"""Every value :attr:`TransportError.kind` can take."""


@dataclass(frozen=True, slots=True)
class Response:
    """A worker's complete HTTP response. Immutable; safe to share between threads.

    ``headers`` has lower-cased names; repeated headers are joined with ``", "``.
    """

    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        """The body decoded as JSON.

        Raises:
            ValueError: the body is not JSON.
        """
        return json.loads(self.body)


class TransportError(NpuSyncError):
    """An HTTP exchange with a worker failed.

    Attributes:
        kind: one of ``connect``, ``timeout``, ``reset``, ``too_large``, ``protocol``,
            ``tls``.
        sent: ``False`` only when the request provably never reached the worker, so
            retrying it elsewhere is safe even for a non-idempotent task.
        stale: a reused keep-alive connection was closed by the worker before any
            byte of the answer: most likely the worker never saw the request; nobody
            is to blame. Always with ``kind="reset"`` and ``sent=True``.
        stalled: the worker sent no byte of the answer for the call's ``silence``
            (see :mod:`npu_sync._stall`). Always with ``kind="timeout"``.
    """

    def __init__(
        self, kind: str, message: str, *, sent: bool, stale: bool = False, stalled: bool = False
    ) -> None:
        if kind not in TRANSPORT_ERROR_KINDS:
            raise ValueError(f"unknown transport error kind {kind!r}")
        super().__init__(message)
        self.kind = kind
        self.sent = sent
        self.stale = stale
        self.stalled = stalled

    def __repr__(self) -> str:
        stale = ", stale=True" if self.stale else ""
        return f"TransportError({self.kind!r}, {str(self)!r}, sent={self.sent!r}{stale})"


class Cancel:
    """A way to abort one request from another thread: the losing attempt of a hedge.

    Thread-safe. The transport attaches the socket a request uses; :meth:`cancel`
    shuts it down, so that the request fails at once (its connection is closed, never
    reused) instead of waiting for the worker. A transport that supports it declares
    :attr:`TransportFeatures.cancellable` and takes ``cancel=`` in
    :meth:`~Transport.request`; with any other, a cancelled request simply runs to its
    end and its answer is dropped.
    """

    __slots__ = ("_lock", "_sock", "event")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.event = threading.Event()
        """Set once cancelled: what a transport without a socket (a fake) waits on."""

    @property
    def cancelled(self) -> bool:
        return self.event.is_set()

    def attach(self, sock: socket.socket | None) -> bool:
        """The request now uses ``sock`` (None: no longer any). False when already
        cancelled: the caller must not start (or go on with) the exchange."""
        with self._lock:
            if self.event.is_set():
                return False
            self._sock = sock
            return True

    def cancel(self) -> None:
        """Abort the request: shut its socket down (idempotent)."""
        with self._lock:
            self.event.set()
            sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed by its own thread
                sock.shutdown(socket.SHUT_RDWR)


@dataclass(frozen=True, slots=True)
class TransportFeatures:
    """What a transport can do beyond :meth:`~Transport.request` and
    :meth:`~Transport.close`, declared once as its ``features`` attribute. Immutable.

    The pool reads the declaration with :func:`features_of` and uses each feature
    only when it is declared; a transport that declares nothing gets the defaults
    (every feature off), and works as before.

    Attributes:
        cancellable: :meth:`~Transport.request` takes ``cancel=`` (a :class:`Cancel`)
            and fails at once when another thread cancels it: the losing attempt of a
            hedge, a health check or a model load cut short by ``close()``.
        silences: :meth:`~Transport.request` takes ``silence=`` (seconds) and fails
            with ``kind="timeout"``, ``stalled=True`` once the worker sends no byte of
            its answer for that long (see :mod:`npu_sync._stall`). Without it, the pool
            cuts the call's whole ``timeout`` to the stall limit instead.
        shares_idle: the transport has ``share_idle(budget)`` (an
            :class:`~npu_sync.transport.IdleBudget`): its idle keep-alive connections
            count against the pool's cap, and what holds them is swept (see
            :mod:`npu_sync.transport._idle`).
    """

    cancellable: bool = False
    silences: bool = False
    shares_idle: bool = False


NO_FEATURES = TransportFeatures()
"""What a transport that declares nothing can do: nothing optional."""


def features_of(transport: object) -> TransportFeatures:
    """What ``transport`` declares it can do (its ``features`` attribute).

    A transport written before :class:`TransportFeatures` existed, which said so with
    a true ``cancellable`` or ``silences`` attribute or a ``share_idle`` method, gets
    those features; one that declares nothing gets :data:`NO_FEATURES`.

    Raises:
        TypeError: ``features`` is set to something other than a TransportFeatures.
    """
    declared = getattr(transport, "features", None)
    if isinstance(declared, TransportFeatures):
        return declared
    if declared is not None:
        raise TypeError(
            f"{type(transport).__name__}.features: must be a TransportFeatures, "
            f"got {declared!r:.100}"
        )
    # Read as the probes they replace read them: truthy attributes, a share_idle at all.
    cancellable = bool(getattr(transport, "cancellable", False))
    silences = bool(getattr(transport, "silences", False))
    shares_idle = getattr(transport, "share_idle", None) is not None
    if not (cancellable or silences or shares_idle):
        return NO_FEATURES
    return TransportFeatures(cancellable=cancellable, silences=silences, shares_idle=shares_idle)


class Transport(Protocol):
    """What the pool needs to talk to one worker. Implementations must be thread-safe.

    Only :meth:`request` and :meth:`close` are required. A transport that can do more
    says so once, with a class (or instance) attribute ``features`` holding a
    :class:`TransportFeatures`; the pool reads it with :func:`features_of`.
    """

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
    ) -> Response:
        """Send one request and return the whole response.

        Args:
            method: HTTP method, e.g. ``"POST"``.
            path: absolute path on the worker, starting with ``/``.
            body: JSON bytes, sent with ``Content-Type: application/json``.
            headers: added to (and overriding) the worker's configured headers.
            timeout: seconds the whole exchange may take, from this call to the last
                byte of the answer: name resolution, connecting, TLS, sending, the
                status line, the headers and the body all come out of this one budget.
            connect_timeout: at most this much of ``timeout`` may go on establishing
                a new connection; ``None`` means all of it.
            replayable: the request may safely reach the worker twice (an idempotent
                task). A transport may then re-send it once on a fresh connection
                when a reused keep-alive connection turns out to have been closed by
                the worker before any byte of the answer arrived.

        Returns:
            The response, whatever its status code.

        Raises:
            TransportError: the exchange failed; see its ``kind`` and ``sent``.
            InvalidTask: the request cannot be sent as given (a header value that
                cannot be encoded); raised before anything is sent.
        """
        ...

    def close(self) -> None:
        """Close every pooled connection. Requests made afterwards fail."""
        ...


def header_index(headers: Mapping[str, str]) -> dict[str, str]:
    return {name.lower(): name for name in headers}


def merge_headers(
    base: dict[str, str], index: dict[str, str], extra: Mapping[str, str]
) -> dict[str, str]:
    """``base`` updated with ``extra``, header names compared case-insensitively."""
    merged = base.copy()
    for name, value in extra.items():
        existing = index.get(name.lower())
        if existing is not None and existing != name:
            del merged[existing]
        merged[name] = value
    return merged


def user_agent() -> str:
    """``npu-sync/<version>``; the version is read when the first transport is built."""
    version = installed_version()
    return "npu-sync" if version is None else f"npu-sync/{version}"


def base_headers(worker: WorkerConfig) -> dict[str, str]:
    return merge_headers({"User-Agent": user_agent()}, {"user-agent": "User-Agent"}, worker.headers)


def with_content_type(headers: dict[str, str]) -> dict[str, str]:
    if "content-type" in header_index(headers):
        return headers
    return {**headers, "Content-Type": "application/json"}


class Where:
    """Names one exchange in an error message, once: ``worker-id: what happened (where)``.

    ``str()`` is the worker id, so ``f"{where}: {problem}"`` reads as one clause.
    """

    __slots__ = ("address", "request", "timeout", "worker")

    def __init__(
        self, worker: WorkerConfig, method: str, path: str, timeout: float | None = None
    ) -> None:
        self.worker = worker.id
        self.timeout = timeout
        host = f"[{worker.host}]" if ":" in worker.host else worker.host
        self.address = f"{host}:{worker.port}"
        self.request = f"{method} {path}"

    def __str__(self) -> str:
        return self.worker

    def at(self, happened: str) -> str:
        """A failure to reach the worker: names its address."""
        return f"{self.worker}: {_one_line(happened)} ({self.address})"

    def on(self, happened: str) -> str:
        """A failure of the exchange itself: names the method and path."""
        return f"{self.worker}: {_one_line(happened)} ({self.request})"

    def late(self) -> str:
        """The answer did not come in time."""
        after = "" if self.timeout is None else f" after {self.timeout:g}s"
        return self.on(f"timed out{after} waiting for the answer")


def _one_line(text: str) -> str:
    # A worker's own bytes may end up quoted in a message; a status table wants one line.
    return " ".join(text.split())


def describe(worker: WorkerConfig, method: str, path: str, timeout: float | None = None) -> Where:
    return Where(worker, method, path, timeout)


def os_reason(exc: BaseException) -> str:
    """An OS error in plain words, without the errno and the address it repeats."""
    while not isinstance(exc, OSError) and exc.__cause__ is not None:
        exc = exc.__cause__
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, ConnectionResetError):
        return "connection reset by the worker"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror[0].lower() + exc.strerror[1:]
    return str(exc)


def tls_reason(exc: BaseException) -> str:
    """A TLS failure in plain words, without OpenSSL's source file and line."""
    import ssl

    if isinstance(exc, ssl.SSLCertVerificationError):
        detail = f": {exc.verify_message}" if exc.verify_message else ""
        return f"certificate verify failed{detail}"
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason).lower().replace("_", " ")
    if isinstance(exc, ssl.CertificateError):
        return str(exc.args[0]) if exc.args else "certificate error"
    return str(exc)


def check_scheme(worker: WorkerConfig) -> str:
    scheme = worker.scheme
    if scheme not in ("http", "https"):
        raise ValueError(f"worker {worker.id}: unsupported URL scheme {scheme!r}")
    return scheme
