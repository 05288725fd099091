"""Transports on urllib3 and requests, for ``transport.client: urllib3 | requests``.

:class:`Urllib3Transport` talks to one ``urllib3`` connection pool directly;
:class:`RequestsTransport` does the same job through a ``requests.Session`` for
deployments that standardise on requests. Both behave the same way:

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

Stale keep-alive connections: urllib3 checks a pooled connection for a peer close
before reusing it and quietly opens a fresh one, so a worker that restarted between
two requests costs nothing. What remains is the race where the worker closes the
connection while our request is in flight. The transport does not retry that itself:
it cannot prove the worker did not receive the request, so it reports
``kind="reset"``, ``sent=True`` and the pool decides, on another worker, whether the
task is idempotent enough to try again.

TLS with ``verify=False``: urllib3 emits ``InsecureRequestWarning`` on every request
to a pool that does not verify certificates. Filtering that warning would be global
to the process and silence it for unrelated code too, so instead the HTTPS pool class
used here skips that one warning when certificate checks were turned off for this
pool on purpose by configuration. The same pool class marks handshake failures, which
is how ``sent=False`` is known for TLS errors.
"""

from __future__ import annotations

import http.client
import logging
import os
import ssl
import time
from collections.abc import Mapping
from http.cookiejar import DefaultCookiePolicy
from typing import TYPE_CHECKING, Any

import requests
import requests.adapters
import requests.cookies
import requests.exceptions
import requests.structures
import urllib3
from urllib3.exceptions import (
    ClosedPoolError,
    ConnectTimeoutError,
    DecodeError,
    HTTPError,
    InvalidChunkLength,
    MaxRetryError,
    NewConnectionError,
    ProtocolError,
    ReadTimeoutError,
    SSLError,
)
from urllib3.util.retry import Retry
from urllib3.util.ssl_ import resolve_cert_reqs
from urllib3.util.ssl_match_hostname import CertificateError

from npu_sync.transport._base import (
    Response,
    TransportError,
    base_headers,
    check_scheme,
    describe,
    header_index,
    merge_headers,
    with_content_type,
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


class _HTTPSConnectionPool(urllib3.HTTPSConnectionPool):
    """HTTPS pool that tells handshake failures apart from later ones and does not warn
    about unverified requests when verification was switched off for it on purpose.
    """

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
    """The body kept arriving past the attempt's whole read time."""


def _read_limited(raw: BaseHTTPResponse, limit: int, encoded: bool, give_up: float) -> bytes | None:
    """Read the whole body, or return None as soon as it proves larger than ``limit``.

    The read timeout bounds each socket read, so a worker that drips its answer a byte
    at a time would never time out: reading also stops at ``give_up`` (monotonic), the
    request's start plus the larger of its connect and read timeouts. The pool caps
    both at the time left to the task, so an attempt never outlives its deadline.
    """
    length = raw.length_remaining
    if length is not None and length > limit:
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
        if raw.length_remaining == 0:
            return b"".join(chunks)  # all of a Content-Length body: no read for EOF
        if time.monotonic() > give_up:
            raise _TooSlow


def _discard(raw: BaseHTTPResponse) -> None:
    """Close a response's connection (it may hold unread bytes) and free its pool slot."""
    raw.close()
    raw.release_conn()


def _from_urllib3(exc: BaseException, what: str) -> TransportError:
    """Map an exception raised by urllib3 (or the socket under it) to a TransportError."""
    if isinstance(exc, MaxRetryError) and exc.reason is not None:
        exc = exc.reason
    if isinstance(exc, _HandshakeError):
        cause = exc.cause
        if isinstance(cause, TimeoutError):
            return TransportError("timeout", f"{what}: TLS handshake timed out", sent=False)
        if isinstance(cause, (ssl.SSLError, CertificateError)):
            return TransportError("tls", f"{what}: TLS handshake failed: {cause}", sent=False)
        return TransportError("connect", f"{what}: connection failed: {cause}", sent=False)
    # NewConnectionError derives from ConnectTimeoutError, so it must be tested first.
    if isinstance(exc, NewConnectionError):
        return TransportError("connect", f"{what}: cannot connect: {exc}", sent=False)
    if isinstance(exc, ConnectTimeoutError):
        return TransportError("timeout", f"{what}: connect timed out", sent=False)
    if isinstance(exc, ClosedPoolError):
        return TransportError("connect", f"{what}: transport is closed", sent=False)
    if isinstance(exc, ReadTimeoutError):
        return TransportError("timeout", f"{what}: read timed out", sent=True)
    if isinstance(exc, SSLError):
        return TransportError("tls", f"{what}: TLS error: {exc}", sent=True)
    if isinstance(exc, ProtocolError):
        inner = exc.args[1] if len(exc.args) > 1 else exc.__cause__
        if _is_malformed(inner):
            return TransportError("protocol", f"{what}: malformed response: {exc}", sent=True)
        return TransportError("reset", f"{what}: connection lost: {exc}", sent=True)
    if isinstance(exc, DecodeError):
        return TransportError("protocol", f"{what}: undecodable body: {exc}", sent=True)
    if isinstance(exc, OSError):
        return TransportError("reset", f"{what}: connection lost: {exc}", sent=True)
    return TransportError("protocol", f"{what}: {type(exc).__name__}: {exc}", sent=True)


def _is_malformed(cause: object) -> bool:
    """Whether a ProtocolError's cause is a bad message rather than a lost connection."""
    if isinstance(cause, InvalidChunkLength):
        return True
    # RemoteDisconnected is both a BadStatusLine and a ConnectionResetError, and an
    # IncompleteRead means the peer stopped sending: both are lost connections.
    if isinstance(cause, (ConnectionError, http.client.IncompleteRead)):
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


class Urllib3Transport:
    """The default transport: one urllib3 connection pool to one worker.

    Thread-safe: any number of threads may call :meth:`request` at once.

    Args:
        worker: the worker to talk to; its ``headers`` go on every request.
        tls: certificate settings for ``https://`` workers.
        max_response_bytes: larger response bodies fail with ``kind="too_large"``.
        maxsize: connections kept open for reuse (at least one).
    """

    def __init__(
        self, worker: WorkerConfig, *, tls: TLSConfig, max_response_bytes: int, maxsize: int
    ) -> None:
        self.worker = worker
        self._limit = max_response_bytes
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
                **_urllib3_tls_kwargs(tls),
            )
        else:
            self._pool = urllib3.HTTPConnectionPool(
                worker.host, worker.port, maxsize=size, block=False, retries=_NO_RETRIES
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
    ) -> Response:
        """Send one request; see :meth:`Transport.request`."""
        if not path.startswith("/"):
            raise ValueError(f"path must start with '/', got {path!r}")
        if body is None:
            sent_headers = self._headers
            if headers:
                sent_headers = merge_headers(sent_headers, self._headers_index, headers)
        else:
            sent_headers = self._json_headers
            if headers:
                sent_headers = merge_headers(sent_headers, self._json_headers_index, headers)
        connect = timeout if connect_timeout is None else min(connect_timeout, timeout)
        give_up = time.monotonic() + timeout
        try:
            raw = self._pool.urlopen(
                method,
                path,
                body=body,
                headers=sent_headers,
                retries=_NO_RETRIES,
                redirect=False,
                assert_same_host=False,
                timeout=self._timeouts.get(connect, timeout),
                preload_content=False,
                release_conn=False,
            )
        except (HTTPError, OSError) as exc:
            raise _from_urllib3(exc, describe(self.worker, method, path)) from exc
        return _finish(raw, self._limit, self.worker, method, path, give_up)

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
            f"{describe(worker, method, path)}: the answer was still arriving when the "
            "read timeout (counted from the request's start) ran out",
            sent=True,
        ) from None
    if data is None:
        _discard(raw)
        raise TransportError(
            "too_large",
            f"{describe(worker, method, path)}: response body exceeds {limit} bytes",
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


class _NoRetryAdapter(requests.adapters.HTTPAdapter):
    """HTTPAdapter whose HTTPS pools report handshake failures as never sent."""

    def init_poolmanager(
        self, connections: int, maxsize: int, block: bool = False, **pool_kwargs: Any
    ) -> None:
        super().init_poolmanager(connections, maxsize, block, **pool_kwargs)
        self.poolmanager.pool_classes_by_scheme = {
            "http": urllib3.HTTPConnectionPool,
            "https": _HTTPSConnectionPool,
        }

    def close(self) -> None:
        # PoolManager.clear() only forgets its pools, leaving their idle connections
        # open until garbage collection; close them now.
        pools = self.poolmanager.pools
        keys = pools.keys()  # the container refuses plain iteration
        for key in keys:
            pool = pools.get(key)
            if pool is not None:
                pool.close()
        super().close()


class _Session(requests.Session):
    """A Session that never sees a redirect.

    With ``allow_redirects=False`` requests still prepares the next hop of a 3xx, which
    reads the whole body (past any size limit) and, with ``max_redirects=0``, raises
    TooManyRedirects. Reporting no redirect target skips all of that.
    """

    def get_redirect_target(self, resp: requests.Response) -> None:
        return None


class RequestsTransport:
    """A transport built on ``requests.Session``, for ``transport.client: requests``.

    Slower per request than :class:`Urllib3Transport`, with the same behaviour: no
    environment proxies, no cookies, no redirects, no retries, the same errors. One
    difference: ``verify=True`` trusts requests' CA bundle (certifi), where
    :class:`Urllib3Transport` trusts the system's CAs.
    Thread-safe: the session holds no per-request state that threads could share
    (its cookie jar never stores anything), and urllib3's pool is thread-safe.

    Args:
        worker: the worker to talk to; its ``headers`` go on every request.
        tls: certificate settings for ``https://`` workers.
        max_response_bytes: larger response bodies fail with ``kind="too_large"``.
        maxsize: connections kept open for reuse (at least one).
    """

    def __init__(
        self, worker: WorkerConfig, *, tls: TLSConfig, max_response_bytes: int, maxsize: int
    ) -> None:
        check_scheme(worker)
        self.worker = worker
        self._limit = max_response_bytes
        self._base_url = worker.url.rstrip("/")
        session = _Session()
        session.trust_env = False
        session.max_redirects = 0
        session.cookies = requests.cookies.RequestsCookieJar(
            policy=DefaultCookiePolicy(allowed_domains=[])
        )
        # Replacing the defaults drops requests' Accept-Encoding and Accept, so both
        # transports send the same headers.
        session.headers = requests.structures.CaseInsensitiveDict(base_headers(worker))
        session.verify = tls.verify
        if tls.cert is not None:
            session.cert = (tls.cert, tls.key) if tls.key is not None else tls.cert
        adapter = _NoRetryAdapter(pool_connections=1, pool_maxsize=max(1, maxsize), max_retries=0)
        # Only this worker's URL is served; anything else would fail loudly.
        session.adapters.clear()
        session.mount(self._base_url + "/", adapter)
        self._session = session
        self._json_headers = {"Content-Type": "application/json"}
        # A closed Session would quietly build a new pool on the next request.
        self._closed = False

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
        """Send one request; see :meth:`Transport.request`."""
        if not path.startswith("/"):
            raise ValueError(f"path must start with '/', got {path!r}")
        if self._closed:
            raise TransportError(
                "connect",
                f"{describe(self.worker, method, path)}: transport is closed",
                sent=False,
            )
        sent_headers: Mapping[str, str] | None = headers
        if body is not None:
            sent_headers = {**self._json_headers, **headers} if headers else self._json_headers
        connect = timeout if connect_timeout is None else min(connect_timeout, timeout)
        give_up = time.monotonic() + timeout
        try:
            resp = self._session.request(
                method,
                self._base_url + path,
                data=body,
                headers=sent_headers,
                timeout=(connect, timeout),
                allow_redirects=False,
                stream=True,
            )
        except requests.exceptions.RequestException as exc:
            if isinstance(exc, ValueError):  # a bad header or URL: the caller's mistake
                raise
            raise _from_requests(exc, describe(self.worker, method, path)) from exc
        except (HTTPError, OSError) as exc:
            raise _from_urllib3(exc, describe(self.worker, method, path)) from exc
        return _finish(resp.raw, self._limit, self.worker, method, path, give_up)

    def close(self) -> None:
        """Close every pooled connection; later requests fail with ``kind="connect"``."""
        self._closed = True
        self._session.close()


def _from_requests(exc: requests.exceptions.RequestException, what: str) -> TransportError:
    """Map a requests exception to a TransportError through the urllib3 error it wraps."""
    inner = exc.args[0] if exc.args else None
    if isinstance(inner, BaseException):
        return _from_urllib3(inner, what)
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return TransportError("timeout", f"{what}: connect timed out", sent=False)
    if isinstance(exc, requests.exceptions.Timeout):
        return TransportError("timeout", f"{what}: read timed out", sent=True)
    if isinstance(exc, requests.exceptions.SSLError):
        return TransportError("tls", f"{what}: TLS error: {exc}", sent=True)
    if isinstance(exc, requests.exceptions.ConnectionError):
        return TransportError("reset", f"{what}: connection error: {exc}", sent=True)
    return TransportError("protocol", f"{what}: {type(exc).__name__}: {exc}", sent=True)
