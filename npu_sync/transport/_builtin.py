"""The built-in transport: HTTP/1.1 over plain sockets, for ``transport.client: builtin``.

Why not a general HTTP client: the pool sends one kind of request (a small JSON POST)
to workers it knows, and the client's CPU per request bounds the whole library's
throughput. This transport does exactly that job with the standard library:

* A keep-alive pool per worker: a LIFO stack of idle connections (the most recently
  used one is the likeliest to be alive), at most ``maxsize`` kept; when none is idle a
  new one is opened rather than waiting, and closed after use if the stack is full.
  Before reuse a connection is checked: one that the worker closed, reset or sent
  anything on while it was idle (junk, a second answer, a TLS close_notify) is dropped. Connections
  idle longer than ``idle_timeout`` (4 s, under uvicorn's 5 s keep-alive) or than a
  worker's ``Keep-Alive: timeout=N`` hint allow are closed, not reused.
* One deadline per call. Every wait (name resolution, connect, TLS handshake, each
  write, each read) gets the time left to it, and the clock is checked after every
  read, so a worker dripping bytes cannot stretch the call: it fails with
  ``kind="timeout"`` within a few milliseconds of its budget. After connecting, sockets
  are non-blocking and waits are ``poll()`` calls: no ``settimeout`` (a system call
  that releases the GIL) on the hot path.
* The request goes out in one write; the answer's head is parsed with plain ``str``
  operations (no ``email`` package) and its body read straight into its final buffer.
* Stale keep-alive connections: a *reused* connection that gives EOF or a reset before
  any byte of the answer was most likely closed by the worker while idle. The request
  is re-sent once on a fresh connection when that is safe (``replayable``, or the
  write itself failed before the kernel took a byte); otherwise the error says
  ``stale=True`` so the pool can tell it apart from a worker failure.

Thread-safe, and no lock is held across I/O.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import socket
import ssl
import struct
import sys
import time
import weakref
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING

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
from npu_sync.transport._idle import IdleBudget
from npu_sync.transport._resolve import (
    BoundedResolver,
    Lookup,
    ResolveError,
    ResolveTimeout,
    default_resolver,
)

if TYPE_CHECKING:
    from npu_sync.config import TLSConfig, WorkerConfig

log = logging.getLogger(__name__)

DEFAULT_IDLE_TIMEOUT = 4.0
"""Seconds a connection may sit idle before it is closed instead of reused."""

# Checked request lines kept per transport: a pool uses a handful of endpoints.
_REQUEST_LINES_MAX = 64
# Most answers fit in one read of this size; bigger heads grow the buffer.
_READ_SIZE = 16 * 1024
# A Keep-Alive hint of N seconds is trusted for N minus this, for the time the answer
# spent in flight and the worker's timer granularity.
_HINT_MARGIN = 1.0

_HAS_POLL = hasattr(select, "poll")
# Linux: blocking plain sockets with kernel timeouts (see _Conn), and the TCP state of
# an idle connection read with getsockopt(TCP_INFO).
_KERNEL_TIMEOUTS = sys.platform.startswith("linux")
_TCP_INFO: int | None = getattr(socket, "TCP_INFO", None) if _KERNEL_TIMEOUTS else None
_ESTABLISHED = 1  # tcpi_state of a connection neither side has closed
# struct tcp_info's tcpi_state (its first byte) and tcpi_bytes_received (Linux 4.1+).
_TCP_INFO_FIELDS = struct.Struct("=B127xQ")
_TCP_INFO_SIZE = _TCP_INFO_FIELDS.size
_tcp_info_fields = _TCP_INFO_FIELDS.unpack_from
_IPPROTO_TCP = int(socket.IPPROTO_TCP)
_TIMEVAL = struct.Struct("@ll")
# The longest a blocking wait lasts before the deadline is checked again; waits nearer
# the deadline are shorter. Longer caps save nothing: at this value the timeouts
# almost never need setting.
_WAIT_CAP = 0.25
_POLLIN = getattr(select, "POLLIN", 1) | getattr(select, "POLLPRI", 2)
_POLLOUT = getattr(select, "POLLOUT", 4)

# Errors that mean the connection is gone (as opposed to a malformed answer).
_LOST = (ConnectionError, ssl.SSLEOFError, ssl.SSLZeroReturnError)
_WANT_READ = (BlockingIOError, InterruptedError, ssl.SSLWantReadError)


class _Timeout(Exception):
    """The call's budget ran out."""


class _Partial(_Timeout):
    """The budget ran out after TLS took part of the request."""


class _Lost(Exception):
    """The worker closed or reset the connection.

    ``answered``: some bytes of the answer had arrived. ``delivered``: the request may
    have reached the worker (False only when the kernel took no byte of it).
    """

    def __init__(self, reason: str, *, answered: bool, delivered: bool = True) -> None:
        super().__init__(reason)
        self.answered = answered
        self.delivered = delivered


class _Conn:
    """One connection to the worker. Used by one thread at a time.

    Two ways to wait within a deadline. Plain TCP on Linux uses a blocking socket whose
    kernel timeouts (SO_RCVTIMEO, SO_SNDTIMEO) end each wait: a read is one system
    call, and the timeouts are set with setsockopt, which keeps the GIL, only when the
    deadline comes closer than the last value set (each wait is capped at
    ``_WAIT_CAP`` so that value rarely needs to change). Elsewhere, and for TLS (whose
    blocking reads retry inside OpenSSL and would never come back to check the
    deadline), the socket is non-blocking and each wait is a ``poll()``.
    """

    __slots__ = (
        "blocking",
        "buf",
        "expires",
        "max_idle",
        "poller",
        "rcv_wait",
        "received",
        "reused",
        "snd_wait",
        "sock",
        "tls",
    )

    def __init__(self, sock: socket.socket, tls: bool, max_idle: float) -> None:
        self.sock = sock
        self.tls = tls
        self.buf = bytearray(_READ_SIZE)
        self.max_idle = max_idle
        self.expires = 0.0
        self.received = 0  # bytes read from the socket, all of them consumed
        self.reused = False
        self.blocking = _KERNEL_TIMEOUTS and not tls
        self.rcv_wait = self.snd_wait = 0.0
        self.poller: select.poll | None = None
        if self.blocking:
            sock.settimeout(None)
            self.rcv_wait = self._set_wait(socket.SO_RCVTIMEO, _WAIT_CAP)
            self.snd_wait = self._set_wait(socket.SO_SNDTIMEO, _WAIT_CAP)
        else:
            sock.setblocking(False)
            if _HAS_POLL:
                self.poller = select.poll()
                self.poller.register(sock.fileno(), _POLLIN)

    def _set_wait(self, option: int, seconds: float) -> float:
        whole, fraction = divmod(seconds, 1.0)
        # A zero timeval means "wait forever": never ask for less than a microsecond.
        micros = max(1, int(fraction * 1e6)) if whole == 0 else int(fraction * 1e6)
        self.sock.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(int(whole), micros))
        return seconds

    def alive(self) -> bool:
        """Whether an idle connection may carry a request: the worker has neither closed
        nor reset it, nor sent anything on it since the last answer (a second answer to
        one request would otherwise be taken for the next request's).
        """
        if _TCP_INFO is not None and not self.tls:
            # Without a system call that gives up the GIL as poll() does: the TCP state,
            # and whether the kernel received more bytes than were read.
            info = self.sock.getsockopt(_IPPROTO_TCP, _TCP_INFO, _TCP_INFO_SIZE)
            try:
                state, received = _tcp_info_fields(info)
            except struct.error:
                pass  # a kernel older than 4.1: no byte count; ask the socket below
            else:
                return bool(state == _ESTABLISHED and received == self.received)
        # TLS: bytes OpenSSL has not read yet cannot be counted; ask the socket.
        return not self._readable(0.0)

    def peer_closed(self) -> bool:
        """Whether the worker closed or reset this idle connection, judged by the TCP
        state alone where the kernel tells it: bytes waiting on it (a stray answer,
        a TLS close_notify on a connection kept open) are for :meth:`alive` to judge
        when the connection is next taken, not a reason to sweep it."""
        closed = tcp_closed(self.sock)
        return (not self.alive()) if closed is None else closed

    def recv_into(self, view: memoryview, deadline: float) -> int:
        """One read into ``view`` (0 means EOF), waiting no later than ``deadline``.

        Raises:
            _Timeout: the deadline passed before any byte came.
            OSError: the connection failed (ConnectionError, TLS errors).
        """
        sock = self.sock
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Timeout
            if self.blocking:
                wait = self.rcv_wait
                if wait > remaining or wait < _WAIT_CAP / 2 < remaining:
                    self.rcv_wait = self._set_wait(socket.SO_RCVTIMEO, min(remaining, _WAIT_CAP))
            elif not self._readable(remaining):
                continue
            try:
                n = sock.recv_into(view)
            except _WANT_READ:
                continue  # a kernel timeout, or a TLS record not yet whole
            except ssl.SSLWantWriteError:
                self._writable(deadline - time.monotonic())
            else:
                self.received += n
                return n

    def send(self, view: memoryview, deadline: float) -> int:
        """One write from ``view``, waiting no later than ``deadline``; bytes taken.

        Raises:
            _Timeout: the deadline passed before the kernel took anything.
            _Partial: TLS took part of a record without saying how much.
            OSError: the connection failed.
        """
        sock = self.sock
        partial = False
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Partial if partial else _Timeout
            if self.blocking:
                wait = self.snd_wait
                if wait > remaining or wait < _WAIT_CAP / 2 < remaining:
                    self.snd_wait = self._set_wait(socket.SO_SNDTIMEO, min(remaining, _WAIT_CAP))
            try:
                return sock.send(view)
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError):
                # Without partial writes, TLS may have taken part of the record already.
                partial = partial or self.tls
                if not self.blocking:
                    self._writable(deadline - time.monotonic())
            except ssl.SSLWantReadError:
                partial = True
                self._readable(deadline - time.monotonic())

    def _readable(self, timeout: float) -> bool:
        if self.tls and self.sock.pending():  # type: ignore[attr-defined]
            return True
        if self.poller is not None:
            return bool(self.poller.poll(math.ceil(timeout * 1000) if timeout > 0 else 0))
        return bool(select.select([self.sock], [], [], max(0.0, timeout))[0])

    def _writable(self, timeout: float) -> bool:
        if _HAS_POLL:
            poller = select.poll()
            poller.register(self.sock.fileno(), _POLLOUT)
            return bool(poller.poll(math.ceil(timeout * 1000) if timeout > 0 else 0))
        return bool(select.select([], [self.sock], [], max(0.0, timeout))[1])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def tcp_closed(sock: socket.socket) -> bool | None:
    """Whether the peer closed or reset a TCP connection (its state is no longer
    ESTABLISHED), from one ``getsockopt(TCP_INFO)``; None where the kernel cannot say.
    """
    if _TCP_INFO is None:
        return None
    info = sock.getsockopt(_IPPROTO_TCP, _TCP_INFO, _TCP_INFO_SIZE)
    return bool(info[0] != _ESTABLISHED)


def _ssl_context(tls: TLSConfig) -> ssl.SSLContext:
    """One client context per transport, with the worker's verification settings."""
    if tls.verify is False:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif isinstance(tls.verify, str):
        if os.path.isdir(tls.verify):
            ctx = ssl.create_default_context(capath=tls.verify)
        else:
            ctx = ssl.create_default_context(cafile=tls.verify)
    else:
        ctx = ssl.create_default_context()
    if tls.cert is not None:
        ctx.load_cert_chain(tls.cert, tls.key)
    return ctx


class BuiltinTransport:
    """The default transport: HTTP/1.1 to one worker over the standard library.

    Thread-safe: any number of threads may call :meth:`request` at once; each uses a
    connection of its own, and no lock is held across I/O. A request can be cancelled
    from another thread (see :class:`~npu_sync.transport.Cancel`); its ``features`` say so.

    Args:
        worker: the worker to talk to; its ``headers`` go on every request.
        tls: certificate settings for ``https://`` workers.
        max_response_bytes: larger response bodies (after undoing gzip or deflate)
            fail with ``kind="too_large"``.
        maxsize: idle connections kept open for reuse (at least one).
        idle_timeout: seconds an idle connection stays reusable.
        resolver: the blocking name lookup (``socket.getaddrinfo`` by default); it
            runs on a daemon thread and the call waits for it only as long as its
            connect budget allows. IP addresses are never looked up.
    """

    # cancel= shuts the socket down whatever the request is doing; silence= is timed
    # per read (npu_sync._stall); idle connections join the pool's cap and sweep.
    features = TransportFeatures(cancellable=True, silences=True, shares_idle=True)
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
        self._tls = check_scheme(worker) == "https"
        # Each of these parses the URL again: read once (a fleet builds thousands).
        self._host = host = worker.host
        self._port = port = worker.port
        self._base_path = worker.base_path
        self._limit = max_response_bytes
        self._maxsize = max(1, maxsize)
        self._idle_timeout = idle_timeout
        self._resolver = default_resolver if resolver is None else BoundedResolver(resolver)
        self._ctx = _ssl_context(tls) if self._tls else None
        headers = base_headers(worker)
        default_port = 443 if self._tls else 80
        host = f"[{host}]" if ":" in host else host
        authority = host if port == default_port else f"{host}:{port}"
        if "host" not in header_index(headers):
            headers = {"Host": authority, **headers}
        json_headers = with_content_type(headers)
        try:
            self._block = h11.header_lines(headers)
            if len(json_headers) == len(headers) + 1:  # only Content-Type added, last
                self._json_block = self._block + "Content-Type: application/json\r\n"
            else:
                self._json_block = h11.header_lines(json_headers)
        except h11.BadRequest as exc:
            raise ValueError(f"worker {worker.id}: {exc}") from None
        self._headers = headers
        self._index = header_index(headers)
        self._json_headers = json_headers
        self._json_index = header_index(json_headers)
        self._request_lines: dict[tuple[str, str], str] = {}
        self._idle: deque[_Conn] = deque()
        # Shared with the pool's other transports (transport.max_idle_connections).
        self._budget: IdleBudget | None = None
        self._closed = False
        _live.add(self)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("builtin transport for worker %s (%s)", worker.id, worker.url)

    # -- the call ------------------------------------------------------------------

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
        silence: float | None = None,
    ) -> Response:
        """Send one request; see :meth:`Transport.request`. ``cancel``: see :class:`Cancel`.
        ``silence``: the call fails (``kind="timeout"``, ``stalled=True``) once that many
        seconds pass without a byte of the answer, however much of ``timeout`` is left."""
        start = time.monotonic()
        deadline = start + timeout
        path = self._base_path + path
        data = self._encode(method, path, body, headers)
        conn = self._checkout(method, path)
        if conn is None:
            conn = self._connect(start, deadline, connect_timeout, method, path)
        try:
            return self._exchange(conn, data, method, path, deadline, timeout, cancel, silence)
        except _Lost as lost:
            # Only a reused connection that failed before any answer byte gets here.
            if cancel is not None and cancel.cancelled:
                raise self._cancelled(method, path) from None
            delivered = lost.delivered
            if delivered and not replayable:
                raise TransportError(
                    "reset",
                    describe(self.worker, method, path).on(
                        "reused keep-alive connection closed before any answer; not re-sent"
                    ),
                    sent=True,
                    stale=True,
                ) from None
        log.debug("worker %s: stale keep-alive connection; re-sending", self.worker.id)
        try:
            conn = self._connect(time.monotonic(), deadline, connect_timeout, method, path)
            return self._exchange(conn, data, method, path, deadline, timeout, cancel, silence)
        except TransportError as exc:
            if exc.sent or not delivered:
                raise
            # This attempt sent nothing, but the first may have reached the worker.
            raise TransportError(exc.kind, f"{exc}, on re-sending", sent=True) from exc

    def _encode(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str] | None
    ) -> bytes:
        try:
            line = self._request_lines.get((method, path))
            if line is None:
                line = self._request_line(method, path)
            if body is None:
                block, base, index = self._block, self._headers, self._index
                length = "Content-Length: 0\r\n" if method in h11.BODY_METHODS else ""
            else:
                block, base, index = self._json_block, self._json_headers, self._json_index
                length = f"Content-Length: {len(body)}\r\n"
            if headers:
                extra = []
                for name, value in headers.items():
                    if h11.request_name(name) in index:
                        # Overrides a configured header: rebuild the whole block.
                        block = h11.header_lines(merge_headers(base, index, headers))
                        break
                    h11.check_value(name, value)
                    extra.append(f"{name}: {value}\r\n")
                else:
                    block += "".join(extra)
            head = h11.encode_head(f"{line}{block}{length}\r\n")
        except h11.BadRequest as exc:
            raise InvalidTask(describe(self.worker, method, path).on(str(exc))) from None
        return head + body if body else head

    def _request_line(self, method: str, path: str) -> str:
        if not path.startswith("/"):
            raise ValueError(f"path must start with '/', got {path!r}")
        h11.check_target(method, path)
        line = f"{method} {path} HTTP/1.1\r\n"
        lines = self._request_lines
        if len(lines) >= _REQUEST_LINES_MAX:
            lines.clear()  # a race here only rebuilds a line
        lines[(method, path)] = line
        return line

    def _cancelled(self, method: str, path: str) -> TransportError:
        return TransportError(
            "reset", describe(self.worker, method, path).on("request cancelled"), sent=True
        )

    def _exchange(
        self,
        conn: _Conn,
        data: bytes,
        method: str,
        path: str,
        deadline: float,
        timeout: float,
        cancel: Cancel | None = None,
        silence: float | None = None,
    ) -> Response:
        """Send, read the whole answer, give the connection back or close it.

        Raises _Lost only for a reused connection that failed before any answer byte.
        """
        sent = False
        if cancel is not None and not cancel.attach(conn.sock):
            conn.close()
            raise self._cancelled(method, path)
        try:
            try:
                sent = self._send(conn, data, deadline)
            except _Lost as lost:
                if not lost.delivered:
                    raise
                sent = True
                response, keep = self._early_answer(conn, method, deadline, lost), False
            else:
                response, keep = self._read_response(conn, method, deadline, silence)
        except (_Timeout, _Lost, h11.MessageError, OSError) as exc:
            conn.close()
            if isinstance(exc, _Lost) and conn.reused and not exc.answered:
                raise
            cause = exc if isinstance(exc, OSError) else exc.__cause__
            raise self._error(exc, sent, method, path, timeout, silence) from cause
        except BaseException:
            conn.close()
            raise
        # Detached before the connection goes back: a late cancel must not reach the
        # next request on it. Cancelled meanwhile: its socket was shut down.
        if keep and (cancel is None or cancel.attach(None)):
            self._release(conn)
        else:
            conn.close()
        return response

    def _early_answer(self, conn: _Conn, method: str, deadline: float, lost: _Lost) -> Response:
        """The answer a worker sent before it stopped reading the request, if any.

        A worker may answer before it has read the whole request (a 413 for a body too
        large, say) and close the connection: the write fails, yet the answer waits in
        the socket. Raises ``lost`` when no byte of an answer came.
        """
        try:
            return self._read_response(conn, method, deadline)[0]
        except _Lost as late:
            if late.answered:
                raise
        except (_Timeout, ssl.SSLError):
            pass  # nothing more to be had from a connection whose write failed
        raise lost

    def _error(
        self,
        exc: Exception,
        sent: bool,
        method: str,
        path: str,
        timeout: float,
        silence: float | None = None,
    ) -> TransportError:
        what = describe(self.worker, method, path)
        if isinstance(exc, _Stalled):
            happened = f"stalled: no byte of the answer for {silence:g}s"
            return TransportError("timeout", what.on(happened), sent=True, stalled=True)
        if isinstance(exc, _Timeout):
            sent = sent or isinstance(exc, _SentTimeout)
            happened = f"timed out after {timeout:g}s waiting for the answer"
            return TransportError("timeout", what.on(happened), sent=sent)
        if isinstance(exc, _Lost):
            return TransportError("reset", what.on(str(exc)), sent=exc.delivered)
        if isinstance(exc, h11.MessageError):
            return TransportError(exc.kind, what.on(str(exc)), sent=True)
        if isinstance(exc, ssl.SSLError):
            return TransportError("tls", what.on(f"TLS error: {tls_reason(exc)}"), sent=True)
        return TransportError("reset", what.on(f"connection lost: {os_reason(exc)}"), sent=True)

    # -- the connection pool ---------------------------------------------------------

    # The idle stack is a deque, whose append, pop and popleft are atomic: no lock, so a
    # thread that loses the GIL while taking a connection cannot make 31 others wait.

    def _checkout(self, method: str, path: str) -> _Conn | None:
        """An idle connection that still looks alive, or None."""
        if self._closed:
            raise TransportError(
                "connect",
                describe(self.worker, method, path).on("transport is closed"),
                sent=False,
            )
        idle = self._idle
        now = time.monotonic()
        while True:
            try:
                conn = idle.pop()
            except IndexError:
                return None
            if self._budget is not None:
                self._budget.give()
            # Expired, or closed (or written to) by the worker while idle.
            if conn.expires <= now or not conn.alive():
                conn.close()
                continue
            conn.reused = True
            return conn

    def _release(self, conn: _Conn) -> None:
        now = time.monotonic()
        conn.expires = now + conn.max_idle
        idle = self._idle
        if self._closed or len(idle) >= self._maxsize:
            conn.close()  # racing releases may keep one or two more: harmless
            return
        budget = self._budget
        if budget is not None and not budget.take():
            conn.close()  # the pool's idle connections are at their total cap
            return
        idle.append(conn)
        if self._closed:
            self._drain()  # close() ran between the check and the append
            return
        if budget is not None:
            budget.holding(self, now)
        # LIFO leaves the bottom of the stack unused longest: close it once it has
        # expired instead of leaving the worker's close unanswered.
        try:
            if idle[0].expires > now:
                return
            bottom = idle.popleft()
        except IndexError:
            return  # others took every connection meanwhile
        if bottom.expires <= now:
            bottom.close()
            if budget is not None:
                budget.give()
        else:
            idle.appendleft(bottom)  # another thread's pop changed the bottom

    def _drain(self) -> int:
        idle = self._idle
        closed = 0
        while True:
            try:
                conn = idle.pop()
            except IndexError:
                break
            conn.close()
            closed += 1
        if closed and self._budget is not None:
            self._budget.give(closed)
        return closed

    def share_idle(self, budget: IdleBudget) -> None:
        """Count this transport's idle connections against ``budget``, which the
        pool's other transports share (``transport.max_idle_connections``). Call
        before the first request."""
        self._budget = budget

    def reap(self, now: float | None = None) -> int:
        """Close the idle connections that expired or that the worker closed or reset
        while they sat idle; returns how many. Never blocks: one ``getsockopt`` (or,
        off Linux, a zero-timeout ``poll()``) per idle connection.

        Safe while requests run: a connection a request takes meanwhile is that
        request's, and is checked again by it.
        """
        at = time.monotonic() if now is None else now
        idle = self._idle
        closed = 0
        for conn in list(idle):
            try:
                dead = conn.expires <= at or conn.peer_closed()
            except OSError:
                dead = True  # closed under us: in use by a request that failed
            if not dead:
                continue
            try:
                idle.remove(conn)
            except ValueError:
                continue  # a request took it meanwhile: its own check decides
            conn.close()
            closed += 1
        if closed and self._budget is not None:
            self._budget.give(closed)
        return closed

    def close_idle(self) -> int:
        """Close every idle connection now (the transport stays usable); how many."""
        return self._drain()

    @property
    def idle_connections(self) -> int:
        """Connections kept open for reuse right now."""
        return len(self._idle)

    def close(self) -> None:
        """Close idle connections now; connections in use close when their call ends.

        Later requests fail with ``kind="connect"``. Never waits for a call in flight.
        """
        self._closed = True
        self._drain()

    def _forget_after_fork(self) -> None:
        # The parent's connections are the parent's: drop our copies of them.
        self._drain()

    # -- connecting -------------------------------------------------------------------

    def _connect(
        self,
        start: float,
        deadline: float,
        connect_timeout: float | None,
        method: str,
        path: str,
    ) -> _Conn:
        limit = deadline if connect_timeout is None else min(deadline, start + connect_timeout)
        what = describe(self.worker, method, path)
        try:
            addresses = self._resolver.resolve(self._host, self._port, limit)
        except ResolveTimeout:
            raise TransportError("timeout", what.at("name lookup timed out"), sent=False) from None
        except ResolveError as exc:
            raise TransportError(
                "connect", what.at(f"cannot resolve the host: {exc}"), sent=False
            ) from exc.cause
        sock = None
        error: OSError = TimeoutError("no time left to connect")
        for family, kind, proto, _, address in addresses:
            remaining = limit - time.monotonic()
            if remaining <= 0:
                error = TimeoutError("no time left to connect")
                break
            candidate = socket.socket(family, kind, proto)
            try:
                candidate.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                candidate.settimeout(remaining)
                candidate.connect(address)
            except OSError as exc:
                candidate.close()
                error = exc
                continue
            sock = candidate
            break
        if sock is None:
            if isinstance(error, TimeoutError):
                happened = f"timed out after {limit - start:.3g}s connecting"
                raise TransportError("timeout", what.at(happened), sent=False) from error
            raise TransportError("connect", what.at(os_reason(error)), sent=False) from error
        if self._ctx is not None:
            sock = self._handshake(sock, limit, what)
        return _Conn(sock, self._ctx is not None, self._idle_timeout)

    def _handshake(self, sock: socket.socket, limit: float, what: Where) -> socket.socket:
        assert self._ctx is not None
        try:
            remaining = limit - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no time left for the TLS handshake")
            tls = self._ctx.wrap_socket(
                sock, server_hostname=self._host, do_handshake_on_connect=False
            )
            sock = tls
            # do_handshake bounds the whole handshake by the socket's timeout.
            tls.settimeout(remaining)
            tls.do_handshake()
        except TimeoutError as exc:
            sock.close()
            happened = what.at("timed out during the TLS handshake")
            raise TransportError("timeout", happened, sent=False) from exc
        except (ssl.SSLError, ssl.CertificateError) as exc:
            sock.close()
            happened = what.at(f"TLS handshake failed: {tls_reason(exc)}")
            raise TransportError("tls", happened, sent=False) from exc
        except OSError as exc:
            sock.close()
            happened = what.at(f"connection failed during the TLS handshake: {os_reason(exc)}")
            raise TransportError("connect", happened, sent=False) from exc
        return tls

    # -- writing ------------------------------------------------------------------------

    def _send(self, conn: _Conn, data: bytes, deadline: float) -> bool:
        """Write the whole request; returns True (the request may have been delivered).

        Raises _Lost with ``delivered=False`` when the kernel took no byte of it, and
        _Timeout (_SentTimeout once a byte was taken).
        """
        total = len(data)
        done = 0
        with memoryview(data) as view:
            try:
                while done < total:
                    done += conn.send(view[done:], deadline)
            except _Partial:
                raise _SentTimeout from None
            except _Timeout:
                if done:
                    raise _SentTimeout from None
                raise
            except _LOST as exc:
                raise _Lost(
                    f"connection lost while sending: {exc}",
                    answered=False,
                    # A plain socket's failed send took nothing; TLS may have taken some.
                    delivered=bool(done) or conn.tls,
                ) from exc
        return True

    # -- reading ------------------------------------------------------------------------

    def _read_response(
        self, conn: _Conn, method: str, deadline: float, silence: float | None = None
    ) -> tuple[Response, bool]:
        """Read one whole answer. Returns it and whether the connection may be reused.
        With ``silence``, each wait for more of it ends that many seconds after it
        began (raising _Stalled) if that comes before ``deadline``."""
        reader = _Reader(conn, deadline, silence)
        for _ in range(h11.MAX_INTERIM + 1):
            version, status, headers = reader.head()
            if status >= 200:
                break
            if status == 101:
                raise h11.MessageError("protocol", "unexpected 101 Switching Protocols")
        else:
            raise h11.MessageError("protocol", f"more than {h11.MAX_INTERIM} interim answers")
        get = headers.get
        if version == "HTTP/1.1" and get("connection") is None:
            keep = True
        else:
            keep = h11.keeps_alive(version, headers)
        encoding = get("content-encoding")
        codings = h11.decodable(encoding) if encoding else None
        limit = self._limit
        # A compressed body can be a little larger than what it decodes to.
        raw_limit = limit + (limit >> 6) + 1024 if codings else limit
        length_text = get("content-length")
        if method == "HEAD" or status == 204 or status == 304:
            body = b""
        elif (
            length_text is not None
            and length_text.isdigit()
            and length_text.isascii()
            and len(length_text) < 19
            and "transfer-encoding" not in headers
        ):
            # The common answer, framed by one plain Content-Length.
            length = int(length_text)
            if length > raw_limit:
                raise h11.MessageError("too_large", f"answer larger than {limit} bytes")
            body = reader.exactly(length)
        elif "transfer-encoding" in headers:
            if "content-length" in headers:
                raise h11.MessageError("protocol", "both Transfer-Encoding and Content-Length")
            h11.is_chunked(headers["transfer-encoding"])
            body = reader.chunked(raw_limit)
        elif "content-length" in headers:
            length = h11.content_length(headers["content-length"])
            if length > raw_limit:
                raise h11.MessageError("too_large", f"answer larger than {limit} bytes")
            body = reader.exactly(length)
        else:
            keep = False
            body = reader.until_close(raw_limit)
        if reader.leftover():
            keep = False  # bytes after the answer: nothing was asked for them
        if codings:
            body = h11.decode(body, codings, limit)
        if keep:
            hint = get("keep-alive")
            if hint is not None:
                seconds = h11.keep_alive_timeout(hint)
                if seconds is not None:
                    conn.max_idle = min(conn.max_idle, seconds - _HINT_MARGIN)
                    keep = conn.max_idle > 0
        return Response(status, headers, body), keep


class _SentTimeout(_Timeout):
    """The budget ran out after part of the request was written."""


class _Stalled(_SentTimeout):
    """No byte of the answer came for the call's ``silence``."""


class _Reader:
    """Reads one answer from a connection's buffer and socket, within a deadline."""

    __slots__ = ("buf", "conn", "deadline", "end", "got", "silence", "start")

    def __init__(self, conn: _Conn, deadline: float, silence: float | None = None) -> None:
        self.conn = conn
        self.deadline = deadline
        self.silence = silence
        self.buf = conn.buf
        self.start = 0
        self.end = 0
        self.got = False  # any byte of the answer arrived

    def _recv_into(self, view: memoryview) -> int:
        """One read into ``view``; 0 means EOF. Waits for data within the deadline, and
        within ``silence`` from now when given."""
        until = self.deadline
        silence = self.silence
        if silence is not None and (quiet := time.monotonic() + silence) < until:
            until = quiet
        conn = self.conn
        try:
            try:
                n = conn.recv_into(view, until)
            except _Timeout:
                # Bytes that came while this thread was not running are not silence (a
                # starved process wakes past its limit with the answer waiting).
                if until >= self.deadline or not conn._readable(0.0):
                    raise
                n = conn.recv_into(view, self.deadline)
        except _Timeout:
            if until < self.deadline:
                raise _Stalled from None
            raise _SentTimeout from None
        except _LOST as exc:
            raise _Lost(f"connection lost: {os_reason(exc)}", answered=self.got) from exc
        if n:
            self.got = True
        return n

    def _fill(self) -> None:
        """Read more bytes after ``end``, making room first; EOF raises _Lost."""
        buf = self.buf
        if self.end == len(buf):
            if self.start:
                size = self.end - self.start
                buf[:size] = buf[self.start : self.end]
                self.start, self.end = 0, size
            else:
                buf.extend(bytes(len(buf)))
        with memoryview(buf) as view:
            n = self._recv_into(view[self.end :])
        if not n:
            if self.got:
                raise _Lost("connection closed in the middle of the answer", answered=True)
            raise _Lost("connection closed without an answer", answered=False)
        self.end += n

    def head(self) -> tuple[str, int, dict[str, str]]:
        buf = self.buf
        if self.start == self.end:
            self._fill()  # nothing to search yet (the first answer on a connection)
        scan = self.start
        while True:
            at = buf.find(b"\r\n\r\n", scan, self.end)
            # A head ended by LF LF comes before any CR LF CR LF found further on, which
            # is then in the body (JSON may hold it as whitespace): look for the LF end
            # only up to the CRLF one.
            lf = buf.find(b"\n\n", scan, at if at >= 0 else self.end)
            if at >= 0 and lf < 0:
                text = str(memoryview(buf)[self.start : at], "latin-1")
                self.start = at + 4
                break
            if lf >= 0:
                text = h11.head_text(memoryview(buf)[self.start : lf], lf_only=True)
                self.start = lf + 2
                break
            size = self.end - self.start
            if size >= 5 and buf[self.start : self.start + 5] != b"HTTP/":
                raise h11.MessageError(
                    "protocol", f"not an HTTP answer: {bytes(buf[self.start : self.end])[:40]!r}"
                )
            if size > h11.MAX_HEAD_BYTES:
                raise h11.MessageError("protocol", f"answer head over {h11.MAX_HEAD_BYTES} bytes")
            scan = max(self.start, self.end - 3)
            self._fill()
        if len(text) > h11.MAX_HEAD_BYTES:
            raise h11.MessageError("protocol", f"answer head over {h11.MAX_HEAD_BYTES} bytes")
        return h11.parse_head(text)

    def exactly(self, length: int) -> bytes:
        """The next ``length`` bytes, read straight into their final buffer."""
        have = self.end - self.start
        if have >= length:
            start = self.start
            self.start = start + length
            with memoryview(self.buf) as view:
                return bytes(view[start : start + length])
        out = bytearray(length)
        out[:have] = memoryview(self.buf)[self.start : self.end]
        self.start = self.end = 0
        with memoryview(out) as view:
            while have < length:
                n = self._recv_into(view[have:])
                if not n:
                    raise _Lost("connection closed in the middle of the body", answered=True)
                have += n
        return bytes(out)

    def _line(self) -> bytes:
        buf = self.buf
        scan = self.start
        while True:
            at = buf.find(b"\n", scan, self.end)
            if at >= 0:
                line = bytes(buf[self.start : at])
                self.start = at + 1
                return line.removesuffix(b"\r")
            if self.end - self.start > h11.MAX_LINE_BYTES:
                raise h11.MessageError("protocol", "chunk-size or trailer line too long")
            scan = self.end
            self._fill()

    def chunked(self, limit: int) -> bytes:
        parts: list[bytes] = []
        total = 0
        while True:
            size = h11.chunk_size(self._line())
            if not size:
                break
            total += size
            if total > limit:
                raise h11.MessageError("too_large", f"answer larger than {limit} bytes")
            parts.append(self.exactly(size))
            if self._line():
                raise h11.MessageError("protocol", "chunk data longer than its size")
        # Trailers are read (the connection must end clean) and dropped, as urllib3 does.
        count = 0
        size = 0
        while line := self._line():
            count += 1
            size += len(line)
            if count > h11.MAX_HEADER_LINES or size > h11.MAX_HEAD_BYTES:
                raise h11.MessageError("protocol", "too many trailer lines")
        return b"".join(parts)

    def until_close(self, limit: int) -> bytes:
        parts = [bytes(self.buf[self.start : self.end])]
        total = len(parts[0])
        self.start = self.end = 0
        with memoryview(self.buf) as view:
            while total <= limit:
                n = self._recv_into(view)
                if not n:
                    return b"".join(parts)
                total += n
                parts.append(bytes(view[:n]))
        raise h11.MessageError("too_large", f"answer larger than {limit} bytes")

    def leftover(self) -> bool:
        return self.end > self.start


_live: weakref.WeakSet[BuiltinTransport] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for transport in list(_live):
        transport._forget_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
