"""The transport on urllib3, for ``transport.client: urllib3``, and the urllib3 hooks
that the requests transport (:mod:`._requests`) runs on too.

:class:`Urllib3Transport` talks to one ``urllib3`` connection pool directly;
``RequestsTransport`` does the same job through a ``requests.Session`` for
deployments that standardise on requests. This module never imports requests, so
choosing urllib3 does not load it. Both behave the same way:

* One pool of keep-alive connections per worker, ``block=False``: the worker pool
  already bounds concurrency to ``max_concurrent``, and one extra short-lived
  connection beats a thread blocked on an empty pool.
* No retries, no redirects (a 3xx comes back as a :class:`Response`), no proxies from
  the environment, no cookies. npu_sync retries on its own terms, on another worker.
* Every failure is a :class:`TransportError` whose ``kind`` says what happened and
  whose ``sent`` is ``False`` only when the request provably never reached the worker:
  connection refused, DNS failure, connect timeout, or a TLS handshake that failed (or
  timed out) before the request was written. Everything later is ``sent=True``.
* A response body larger than ``max_response_bytes`` is ``kind="too_large"``; the
  connection it arrived on is closed, never returned half-read to the pool.

The contract the built-in transport keeps, kept here too through hooks in urllib3's
connection classes:

* One budget per call. urllib3 bounds each socket read, so a worker dripping its
  status line, its headers or its body a byte at a time would hold the caller for
  many times the budget. Once connected, a connection's socket becomes a
  :class:`_DeadlineSocket` (or :class:`_DeadlineSSLSocket`): the same object, whose
  reads and writes each get the time left to the call as their timeout and fail at
  once when none is left, so the call fails with ``kind="timeout"`` at its deadline
  whatever http.client is reading.
* Name lookups run on the bounded resolver (:mod:`._resolve`) and the connection is
  made to the address found, while TLS still checks the worker's host name (urllib3
  takes the name for SNI and verification from the connection, not the socket).
* Idle connections older than ``idle_timeout`` are closed instead of reused.
* Stale keep-alive connections: urllib3 checks a pooled connection for a peer close
  before reusing it. What remains is the race where the worker closes the connection
  just as our request goes out: a *reused* connection that ends before any byte of
  the answer is re-sent once on a fresh connection when ``replayable``, and otherwise
  reported with ``stale=True``.

TLS with ``verify=False``: urllib3 emits ``InsecureRequestWarning`` on every request
to a pool that does not verify certificates. Filtering that warning would be global
to the process and silence it for unrelated code too, so instead the HTTPS pool class
used here skips that one warning when certificate checks were turned off for this
pool on purpose by configuration. The same pool class marks handshake failures, which
is how ``sent=False`` is known for TLS errors.
"""

from __future__ import annotations

import errno
import http.client
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import urllib3
import urllib3.connection
import urllib3.util.connection
from urllib3.exceptions import (
    ClosedPoolError,
    ConnectTimeoutError,
    DecodeError,
    HeaderParsingError,
    HTTPError,
    InvalidChunkLength,
    MaxRetryError,
    NameResolutionError,
    NewConnectionError,
    ProtocolError,
    ReadTimeoutError,
    SSLError,
)
from urllib3.util.connection import is_connection_dropped
from urllib3.util.response import assert_header_parsing
from urllib3.util.retry import Retry
from urllib3.util.ssl_ import resolve_cert_reqs
from urllib3.util.ssl_match_hostname import CertificateError

from npu_sync.errors import InvalidTask
from npu_sync.transport import _http11 as h11
from npu_sync.transport._base import (
    Cancel,
    Response,
    TransportError,
    TransportFeatures,
    Where,
    base_headers,
    check_scheme,
    describe,
    header_index,
    merge_headers,
    os_reason,
    tls_reason,
    with_content_type,
)
from npu_sync.transport._builtin import DEFAULT_IDLE_TIMEOUT, tcp_closed
from npu_sync.transport._idle import IdleBudget
from npu_sync.transport._resolve import (
    BoundedResolver,
    Lookup,
    ResolveError,
    ResolveTimeout,
    default_resolver,
)

if TYPE_CHECKING:
    from urllib3.response import BaseHTTPResponse

    from npu_sync.config import TLSConfig, WorkerConfig


log = logging.getLogger(__name__)

# Bodies without a usable Content-Length (chunked, compressed, or delimited by the
# connection closing) are read in pieces of at most this size.
_READ_CHUNK = 64 * 1024

# Per-call timeouts usually repeat (the configured pair), but a caller trimming the
# read timeout to a task deadline produces many distinct values; the cache stays small.
_TIMEOUT_CACHE_MAX = 64

# Retry objects are immutable, so one shared instance spares urllib3 building a new
# one per request. total=False makes urllib3 raise the original error unchanged.
_NO_RETRIES = Retry(total=False, redirect=False)


class _HandshakeError(HTTPError):
    """A new connection failed after the TCP connect and before the request was sent.

    Derives from urllib3's ``HTTPError`` root only, so urllib3 neither wraps nor retries
    it: it discards the connection and lets it propagate unchanged.
    """

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _Call:
    """The call in progress on this thread, as the connection hooks see it."""

    __slots__ = (
        "cancel",
        "connect_deadline",
        "deadline",
        "expired",
        "fresh",
        "lost",
        "resolver",
        "reused",
    )

    def __init__(
        self,
        deadline: float,
        connect_deadline: float,
        resolver: BoundedResolver,
        fresh: bool,
        cancel: Cancel | None = None,
    ) -> None:
        self.cancel = cancel  # shuts the socket down while the answer's head is awaited
        self.deadline = deadline
        self.connect_deadline = connect_deadline
        self.resolver = resolver
        self.fresh = fresh  # take no idle connection: this is a re-send
        self.expired = False  # a socket call found the budget spent
        self.reused = False  # the request went out on a connection used before
        self.lost = False  # the connection ended before any byte of the answer


# urllib3 runs a whole exchange on the calling thread, so the hooks find their call here.
_calls = threading.local()


def _current() -> _Call | None:
    return getattr(_calls, "call", None)


def _budget(sock: socket.socket) -> None:
    """Give the socket's next call the time left to this thread's call, or fail it."""
    call = _current()
    if call is None:
        return
    remaining = call.deadline - time.monotonic()
    if remaining <= 0:
        call.expired = True
        raise TimeoutError("timed out (the call's budget is spent)")
    current = sock.gettimeout()
    if current is None or remaining < current:
        sock.settimeout(remaining)


def _timed_out() -> None:
    """Note a socket timeout that ended the call's budget (rather than a shorter one)."""
    call = _current()
    # Socket timeouts wake at or just after the deadline they were given.
    if call is not None and time.monotonic() >= call.deadline - 0.005:
        call.expired = True


class _DeadlineSocket(socket.socket):
    """A connected socket whose every read and write fits in the call's budget.

    Not built: a connection's socket gets this class once connected. No slots of its
    own, so the swap keeps the object's layout.
    """

    __slots__ = ()

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        _budget(self)
        try:
            return super().recv_into(buffer, nbytes, flags)
        except TimeoutError:
            _timed_out()
            raise

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        _budget(self)
        try:
            return super().recv(bufsize, flags)
        except TimeoutError:
            _timed_out()
            raise

    def send(self, data: Any, flags: int = 0) -> int:
        _budget(self)
        try:
            return super().send(data, flags)
        except TimeoutError:
            _timed_out()
            raise

    def sendall(self, data: Any, flags: int = 0) -> None:
        # With a timeout, socket.sendall bounds the whole write, not each piece.
        _budget(self)
        try:
            super().sendall(data, flags)
        except TimeoutError:
            _timed_out()
            raise


class _DeadlineSSLSocket(ssl.SSLSocket):
    """The TLS counterpart of :class:`_DeadlineSocket`. SSLSocket's recv and recv_into
    read through read(), and its sendall writes piece by piece through send().

    A write to a connection the worker closed fails with SSLEOFError where plain TCP
    says BrokenPipeError; it is raised as the latter, on which urllib3 goes on to read
    the answer (a worker may answer before reading the whole request, then close), and
    a connection that ends with no answer is then known for stale like a plain one.
    """

    def read(self, len: int = 1024, buffer: Any = None) -> Any:
        _budget(self)
        try:
            return super().read(len, buffer)
        except TimeoutError:
            _timed_out()
            raise

    def send(self, data: Any, flags: int = 0) -> int:
        _budget(self)
        try:
            return super().send(data, flags)
        except TimeoutError:
            _timed_out()
            raise
        except ssl.SSLEOFError as exc:
            raise BrokenPipeError(errno.EPIPE, f"connection lost while sending: {exc}") from exc


_DEADLINE_CLASSES: dict[type, type] = {
    socket.socket: _DeadlineSocket,
    ssl.SSLSocket: _DeadlineSSLSocket,
}


class _HTTPResponse(http.client.HTTPResponse):
    """http.client's response, skipping every interim 1xx answer (it skips only 100)."""

    def _read_status(self) -> tuple[str, int, str]:
        for _ in range(h11.MAX_INTERIM + 1):
            version, status, reason = super()._read_status()  # type: ignore[misc]
            if not 100 < status < 200 or status == 101:
                return version, status, reason
            _skip_head(self.fp)
        raise http.client.HTTPException(f"more than {h11.MAX_INTERIM} interim answers")


def _skip_head(fp: Any) -> None:
    for _ in range(h11.MAX_HEADER_LINES + 1):
        line = fp.readline(h11.MAX_LINE_BYTES + 1)
        if line in (b"\r\n", b"\n", b""):
            return
    raise http.client.HTTPException("interim answer with too many header lines")


class _Hooks(urllib3.connection.HTTPConnection):
    """What both connection classes add to urllib3's: bounded name lookup, sockets
    bound by the call's deadline, and the bookkeeping that tells a stale keep-alive
    connection apart from a failing worker.
    """

    response_class = _HTTPResponse
    _npu_served = 0  # requests sent on the current socket
    _npu_idle_since = 0.0
    _npu_counted = False  # counted against the shared idle budget

    def _new_conn(self) -> socket.socket:
        call = _current()
        if call is None:
            return super()._new_conn()
        try:
            addresses = call.resolver.resolve(self._dns_host, self.port, call.connect_deadline)
        except ResolveTimeout as exc:
            raise ConnectTimeoutError(
                self, f"Connection to {self.host} timed out (name lookup)"
            ) from exc
        except ResolveError as exc:
            cause = exc.cause
            if not isinstance(cause, socket.gaierror):
                cause = socket.gaierror(str(cause))
            raise NameResolutionError(self.host, self, cause) from exc.cause
        error: OSError = TimeoutError("no time left to connect")
        for _, _, _, _, address in addresses:
            remaining = call.connect_deadline - time.monotonic()
            if remaining <= 0:
                error = TimeoutError("no time left to connect")
                break
            timeout = remaining if self.timeout is None else min(float(self.timeout), remaining)
            try:
                sock = urllib3.util.connection.create_connection(
                    (address[0], address[1]),
                    timeout,
                    source_address=self.source_address,
                    socket_options=self.socket_options,
                )
            except OSError as exc:
                error = exc
                continue
            return sock
        if isinstance(error, TimeoutError):
            raise ConnectTimeoutError(self, f"Connection to {self.host} timed out") from error
        raise NewConnectionError(self, f"Failed to establish a new connection: {error}") from error

    def connect(self) -> None:
        super().connect()
        self._npu_served = 0
        sock = self.sock
        deadline_class = _DEADLINE_CLASSES.get(type(sock))
        if deadline_class is not None:
            sock.__class__ = deadline_class

    def request(  # type: ignore[override]
        self,
        method: str,
        url: str,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        call = _current()
        if call is not None:
            call.reused = self.sock is not None and self._npu_served > 0
        try:
            super().request(method, url, body=body, headers=headers, **kwargs)
        except ConnectionError:
            # urllib3 swallows a broken pipe or reset here to read what the worker
            # answered before; if it answered nothing, the connection was stale.
            if call is not None:
                call.lost = True
            raise
        finally:
            self._npu_served += 1

    def getresponse(self) -> Any:
        call = _current()
        cancel = None if call is None else call.cancel
        if cancel is None:
            return self._getresponse()
        if not cancel.attach(self.sock):
            raise ConnectionResetError("request cancelled")
        try:
            response = self._getresponse()
        finally:
            # Best effort: a cancel while the body is read is not seen, and the socket
            # must not be shut down once the connection may serve another request.
            detached = cancel.attach(None)
        if not detached:
            response.close()
            raise ConnectionResetError("request cancelled")
        return response

    def _getresponse(self) -> Any:
        try:
            response = super().getresponse()
        except ConnectionError:
            # RemoteDisconnected (EOF before the status line) is a ConnectionResetError.
            call = _current()
            if call is not None:
                call.lost = True
            raise
        # urllib3 only logs a head the email parser could not make sense of (a line
        # without a colon, say); a worker's malformed answer is a protocol error.
        original = response._original_response
        try:
            if original is not None:
                assert_header_parsing(original.msg)
        except HeaderParsingError as exc:
            response.close()
            raise http.client.HTTPException(f"malformed header: {exc}") from exc
        return response


class _HTTPConnection(_Hooks):
    pass


class _HTTPSConnection(_Hooks, urllib3.connection.HTTPSConnection):
    pass


def _peer_closed(conn: Any) -> bool:
    """The worker closed or reset an idle connection (bytes merely waiting on it are
    urllib3's to judge when it is next taken)."""
    try:
        closed = tcp_closed(conn.sock)
    except OSError:
        return True
    return bool(is_connection_dropped(conn)) if closed is None else closed


class IdleShare:
    """The idle budget a transport's urllib3 pools count against, once one is shared
    (the requests transport's pools are built after the transport)."""

    __slots__ = ("budget",)

    def __init__(self) -> None:
        self.budget: IdleBudget | None = None


class _PoolHooks(urllib3.HTTPConnectionPool):
    """Idle timeout, the shared idle budget, the reaper, fresh connections for re-sends."""

    ConnectionCls: Any = _HTTPConnection
    _npu_idle_timeout = DEFAULT_IDLE_TIMEOUT
    _npu_share: IdleShare | None = None

    def _get_conn(self, timeout: float | None = None) -> Any:
        conn: Any = super()._get_conn(timeout)
        if getattr(conn, "_npu_counted", False):
            conn._npu_counted = False
            self._npu_give(1)
        if conn.sock is not None:
            call = _current()
            if (call is not None and call.fresh) or (
                time.monotonic() - conn._npu_idle_since > self._npu_idle_timeout
            ):
                conn.close()
        return conn

    def _put_conn(self, conn: Any) -> None:
        if conn is not None:
            conn._npu_idle_since = time.monotonic()
            share = self._npu_share
            budget = None if share is None else share.budget
            if budget is not None and conn.sock is not None and self.pool is not None:
                if budget.take():
                    conn._npu_counted = True
                else:
                    conn.close()  # the pool's idle connections are at their total cap
            super()._put_conn(conn)
            if budget is not None and conn._npu_counted:
                budget.holding(self, conn._npu_idle_since)
            return
        super()._put_conn(conn)

    @property
    def idle_connections(self) -> int:
        queue = self.pool
        if queue is None:
            return 0
        with queue.mutex:
            return sum(1 for c in queue.queue if c is not None and c.sock is not None)

    def _npu_give(self, count: int) -> None:
        share = self._npu_share
        if count and share is not None and share.budget is not None:
            share.budget.give(count)

    def reap(self, now: float, *, everything: bool = False) -> int:
        """Close idle connections that expired or whose worker closed them (with
        ``everything``, every idle connection)."""
        queue = self.pool
        if queue is None:
            return 0
        closed = counted = 0
        # Under the queue's own lock, so no request takes a connection being judged;
        # closing a socket does not block.
        with queue.mutex:
            for conn in queue.queue:
                if conn is None or conn.sock is None:
                    continue
                if (
                    not everything
                    and now - conn._npu_idle_since <= self._npu_idle_timeout
                    and not _peer_closed(conn)
                ):
                    continue
                conn.close()  # stays in the queue, closed: urllib3 reconnects it on use
                closed += 1
                if getattr(conn, "_npu_counted", False):
                    conn._npu_counted = False
                    counted += 1
        self._npu_give(counted)
        return closed

    def close(self) -> None:
        queue = self.pool
        counted = 0
        if queue is not None:
            with queue.mutex:
                for conn in queue.queue:
                    if conn is not None and getattr(conn, "_npu_counted", False):
                        conn._npu_counted = False
                        counted += 1
        super().close()
        self._npu_give(counted)


class _HTTPConnectionPool(_PoolHooks):
    def __init__(
        self,
        *args: Any,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        share: IdleShare | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._npu_idle_timeout = idle_timeout
        self._npu_share = share


class _HTTPSConnectionPool(_PoolHooks, urllib3.HTTPSConnectionPool):
    """HTTPS pool that tells handshake failures apart from later ones and does not warn
    about unverified requests when verification was switched off for it on purpose.
    """

    ConnectionCls = _HTTPSConnection

    def __init__(
        self,
        *args: Any,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        share: IdleShare | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._npu_idle_timeout = idle_timeout
        self._npu_share = share

    def _validate_conn(self, conn: Any) -> None:
        # urllib3 connects HTTPS connections here, before anything is written, so any
        # failure in this call proves the request was never sent.
        if conn.is_closed:
            try:
                conn.connect()
            except (OSError, CertificateError) as exc:
                raise _HandshakeError(exc) from exc
        if conn.is_verified or resolve_cert_reqs(self.cert_reqs) != ssl.CERT_NONE:
            super()._validate_conn(conn)


class _TooSlow(Exception):
    """The body kept arriving past the call's deadline."""


def _read_limited(raw: BaseHTTPResponse, limit: int, encoded: bool, give_up: float) -> bytes | None:
    """Read the whole body, or return None as soon as it proves larger than ``limit``.

    ``limit`` bounds the decoded body; with a content coding, the raw length is only
    checked against a slightly larger bound (compressed data can be a little larger
    than what it decodes to). Reading also stops at ``give_up`` (monotonic): the reaper
    would stop a dripping body anyway, but checking between reads ends it sooner.
    """
    length = raw.length_remaining
    raw_limit = limit + (limit >> 6) + 1024 if encoded else limit
    if length is not None and length > raw_limit:
        return None
    chunks: list[bytes] = []
    size = 0
    while True:
        # Never ask for more than one byte past the limit: that byte proves the excess.
        # read1 returns what one socket read gave, so the clock is checked in between.
        chunk = raw.read1(min(_READ_CHUNK, limit + 1 - size), decode_content=encoded)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        # All of a Content-Length body is in: no read for EOF. A decoder may still
        # hold output when the raw bytes are all in, so encoded bodies read on to EOF.
        if not encoded and raw.length_remaining == 0:
            return b"".join(chunks)
        if time.monotonic() > give_up:
            raise _TooSlow


def _discard(raw: BaseHTTPResponse) -> None:
    """Close a response's connection (it may hold unread bytes) and free its pool slot."""
    raw.close()
    raw.release_conn()


def _from_urllib3(exc: BaseException, what: Where) -> TransportError:
    """Map an exception raised by urllib3 (or the socket under it) to a TransportError."""
    if isinstance(exc, MaxRetryError) and exc.reason is not None:
        exc = exc.reason
    if isinstance(exc, _HandshakeError):
        cause = exc.cause
        if isinstance(cause, TimeoutError):
            return TransportError(
                "timeout", what.at("timed out during the TLS handshake"), sent=False
            )
        if isinstance(cause, (ssl.SSLError, CertificateError)):
            happened = f"TLS handshake failed: {tls_reason(cause)}"
            return TransportError("tls", what.at(happened), sent=False)
        happened = f"connection failed during the TLS handshake: {os_reason(cause)}"
        return TransportError("connect", what.at(happened), sent=False)
    # NewConnectionError derives from ConnectTimeoutError, so it must be tested first.
    if isinstance(exc, NewConnectionError):
        return TransportError("connect", what.at(os_reason(exc)), sent=False)
    if isinstance(exc, ConnectTimeoutError):
        return TransportError("timeout", what.at("timed out connecting"), sent=False)
    if isinstance(exc, ClosedPoolError):
        return TransportError("connect", what.on("transport is closed"), sent=False)
    if isinstance(exc, ReadTimeoutError):
        return TransportError("timeout", what.late(), sent=True)
    if isinstance(exc, SSLError):
        return TransportError("tls", what.on(f"TLS error: {tls_reason(exc)}"), sent=True)
    if isinstance(exc, ProtocolError):
        inner = exc.args[1] if len(exc.args) > 1 else exc.__cause__
        if _is_malformed(inner):
            return TransportError("protocol", what.on(f"malformed answer: {inner}"), sent=True)
        lost = os_reason(inner) if isinstance(inner, BaseException) else str(exc)
        return TransportError("reset", what.on(f"connection lost: {lost}"), sent=True)
    if isinstance(exc, DecodeError):
        return TransportError("protocol", what.on("undecodable body"), sent=True)
    if isinstance(exc, OSError):
        return TransportError("reset", what.on(f"connection lost: {os_reason(exc)}"), sent=True)
    return TransportError("protocol", what.on(f"{type(exc).__name__}: {exc}"), sent=True)


def _is_malformed(cause: object) -> bool:
    """Whether a ProtocolError's cause is a bad message rather than a lost connection."""
    if isinstance(cause, InvalidChunkLength):
        return True
    # http.client reports a chunk size that is not a number as an IncompleteRead
    # raised while handling the ValueError.
    if isinstance(cause, http.client.IncompleteRead):
        return isinstance(cause.__context__, ValueError)
    # RemoteDisconnected is both a BadStatusLine and a ConnectionResetError, and any
    # other IncompleteRead means the peer stopped sending: both are lost connections.
    if isinstance(cause, ConnectionError):
        return False
    return isinstance(cause, http.client.HTTPException)


class _TimeoutCache:
    """Shares urllib3 Timeout objects between calls with the same pair of values."""

    __slots__ = ("_cache",)

    def __init__(self) -> None:
        self._cache: dict[tuple[float, float], urllib3.Timeout] = {}

    def get(self, connect: float, read: float) -> urllib3.Timeout:
        key = (connect, read)
        timeout = self._cache.get(key)
        if timeout is None:
            timeout = urllib3.Timeout(connect=connect, read=read)
            # Races here only build a duplicate or drop the cache; both are harmless.
            if len(self._cache) >= _TIMEOUT_CACHE_MAX:
                self._cache.clear()
            self._cache[key] = timeout
        return timeout


def _check_headers(headers: Mapping[str, str], what: Where) -> None:
    """Refuse header values that cannot be sent, before anything is sent."""
    try:
        h11.encode_head(h11.header_lines(headers))
    except h11.BadRequest as exc:
        raise InvalidTask(f"{what}: {exc}") from None


def _exchange(
    send: Callable[[], BaseHTTPResponse],
    map_error: Callable[[BaseException, Where], TransportError],
    worker: WorkerConfig,
    resolver: BoundedResolver,
    limit: int,
    method: str,
    path: str,
    timeout: float,
    connect_timeout: float | None,
    replayable: bool,
    cancel: Cancel | None = None,
) -> Response:
    """Run one call through urllib3 under the call's deadline, re-sending once on a
    fresh connection when a reused one turned out stale and the request is replayable.
    """
    start = time.monotonic()
    deadline = start + timeout
    connect_deadline = (
        deadline if connect_timeout is None else min(deadline, start + connect_timeout)
    )
    what = describe(worker, method, path, timeout)
    fresh = False
    while True:
        call = _Call(deadline, connect_deadline, resolver, fresh, cancel)
        _calls.call = call
        error: TransportError
        try:
            return _finish(send(), limit, worker, method, path, deadline)
        except TransportError as exc:
            error = exc
        except (HTTPError, OSError) as exc:
            error = map_error(exc, what)
            error.__cause__ = exc
        finally:
            _calls.call = None
        if call.expired:
            # urllib3 reports a timeout while sending as a lost connection, and a
            # timeout inside http.client's header parsing in other ways again.
            cause = error.__cause__
            error = TransportError("timeout", what.late(), sent=error.sent)
            error.__cause__ = cause
        if cancel is not None and cancel.cancelled:
            raise TransportError("reset", what.on("request cancelled"), sent=True) from error
        if fresh or not (call.reused and call.lost and error.kind == "reset"):
            if fresh and not error.sent:
                # This attempt sent nothing, but the first may have reached the worker.
                raise TransportError(error.kind, f"{error}, on re-sending", sent=True) from error
            raise error
        if not replayable:
            raise TransportError(
                "reset",
                what.on("reused keep-alive connection closed before any answer; not re-sent"),
                sent=True,
                stale=True,
            ) from error.__cause__
        log.debug("worker %s: stale keep-alive connection; re-sending", worker.id)
        fresh = True


class Urllib3Transport:
    """A transport on one urllib3 connection pool to one worker.

    Thread-safe: any number of threads may call :meth:`request` at once.

    Args:
        worker: the worker to talk to; its ``headers`` go on every request.
        tls: certificate settings for ``https://`` workers.
        max_response_bytes: larger response bodies fail with ``kind="too_large"``.
        maxsize: connections kept open for reuse (at least one).
        idle_timeout: seconds an idle connection stays reusable.
        resolver: the blocking name lookup (``socket.getaddrinfo`` by default), run
            on a daemon thread and waited for only within the connect budget.
    """

    # cancel= works best effort: while the answer's head is awaited. No silence=: one
    # budget per call, which the pool cuts to the stall limit instead.
    features = TransportFeatures(cancellable=True, shares_idle=True)
    # The older spelling of two of them, for code that probes the attributes.
    cancellable = features.cancellable
    silences = features.silences

    def __init__(
        self,
        worker: WorkerConfig,
        *,
        tls: TLSConfig,
        max_response_bytes: int,
        maxsize: int,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        resolver: Lookup | None = None,
    ) -> None:
        self.worker = worker
        self._base_path = worker.base_path
        self._limit = max_response_bytes
        self._resolver = default_resolver if resolver is None else BoundedResolver(resolver)
        self._headers = base_headers(worker)
        self._headers_index = header_index(self._headers)
        self._json_headers = with_content_type(self._headers)
        self._json_headers_index = header_index(self._json_headers)
        self._timeouts = _TimeoutCache()
        size = max(1, maxsize)
        self._pool: urllib3.HTTPConnectionPool
        if check_scheme(worker) == "https":
            self._pool = _HTTPSConnectionPool(
                worker.host,
                worker.port,
                maxsize=size,
                block=False,
                retries=_NO_RETRIES,
                idle_timeout=idle_timeout,
                **_urllib3_tls_kwargs(tls),
            )
        else:
            self._pool = _HTTPConnectionPool(
                worker.host,
                worker.port,
                maxsize=size,
                block=False,
                retries=_NO_RETRIES,
                idle_timeout=idle_timeout,
            )
        log.debug("transport for worker %s (%s), %d connections", worker.id, worker.url, size)

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
        """Send one request; see :meth:`Transport.request`. ``cancel``: best effort,
        while the answer's head is awaited (see :class:`Cancel`)."""
        if not path.startswith("/"):
            raise ValueError(f"path must start with '/', got {path!r}")
        path = self._base_path + path
        if headers:
            _check_headers(headers, describe(self.worker, method, path))
        if body is None:
            sent_headers = self._headers
            if headers:
                sent_headers = merge_headers(sent_headers, self._headers_index, headers)
        else:
            sent_headers = self._json_headers
            if headers:
                sent_headers = merge_headers(sent_headers, self._json_headers_index, headers)
        connect = timeout if connect_timeout is None else min(connect_timeout, timeout)
        urllib3_timeout = self._timeouts.get(connect, timeout)

        def send() -> BaseHTTPResponse:
            return self._pool.urlopen(
                method,
                path,
                body=body,
                headers=sent_headers,
                retries=_NO_RETRIES,
                redirect=False,
                assert_same_host=False,
                timeout=urllib3_timeout,
                preload_content=False,
                release_conn=False,
            )

        return _exchange(
            send,
            _from_urllib3,
            self.worker,
            self._resolver,
            self._limit,
            method,
            path,
            timeout,
            connect_timeout,
            replayable,
            cancel,
        )

    def share_idle(self, budget: IdleBudget) -> None:
        """Count the idle connections against ``budget``, shared with the pool's other
        transports (``transport.max_idle_connections``)."""
        share = IdleShare()
        share.budget = budget
        self._pool._npu_share = share  # type: ignore[attr-defined]

    def reap(self, now: float | None = None) -> int:
        """Close idle connections that expired or that the worker closed; how many."""
        pool: Any = self._pool
        return int(pool.reap(time.monotonic() if now is None else now))

    def close_idle(self) -> int:
        """Close every idle connection now (the transport stays usable); how many."""
        pool: Any = self._pool
        return int(pool.reap(0.0, everything=True))

    def close(self) -> None:
        """Close every pooled connection; later requests fail with ``kind="connect"``."""
        self._pool.close()


def _finish(
    raw: BaseHTTPResponse,
    limit: int,
    worker: WorkerConfig,
    method: str,
    path: str,
    give_up: float = float("inf"),
) -> Response:
    """Read a streamed urllib3 response into a Response, enforcing the size limit."""
    headers = {name.lower(): value for name, value in raw.headers.itermerged()}
    try:
        data = _read_limited(raw, limit, "content-encoding" in headers, give_up)
    except (HTTPError, OSError) as exc:
        _discard(raw)
        raise _from_urllib3(exc, describe(worker, method, path)) from exc
    except _TooSlow:
        _discard(raw)
        raise TransportError(
            "timeout",
            describe(worker, method, path).late(),
            sent=True,
        ) from None
    if data is None:
        _discard(raw)
        raise TransportError(
            "too_large",
            describe(worker, method, path).on(f"answer larger than {limit} bytes"),
            sent=True,
        )
    # Normally already released when the body ended; this covers the rest.
    raw.release_conn()
    return Response(raw.status, headers, data)


def _urllib3_tls_kwargs(tls: TLSConfig) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"cert_file": tls.cert, "key_file": tls.key}
    if tls.verify is False:
        kwargs.update(cert_reqs="CERT_NONE", assert_hostname=False)
    else:
        kwargs["cert_reqs"] = "CERT_REQUIRED"
        if isinstance(tls.verify, str):
            kwargs["ca_cert_dir" if os.path.isdir(tls.verify) else "ca_certs"] = tls.verify
    return kwargs
