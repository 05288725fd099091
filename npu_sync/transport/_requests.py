"""The transport on requests, for ``transport.client: requests``.

:class:`RequestsTransport` sends through a ``requests.Session`` whose adapter runs on
the connection pools of :mod:`._urllib3`, so it keeps the same contract (one budget
per call, the bounded resolver, stale connections re-sent, the same errors); see that
module. requests is imported here only, and this module is imported only when a
``requests`` transport is built: ``import requests`` costs about as much as the rest
of npu_sync together.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from http.cookiejar import DefaultCookiePolicy
from typing import TYPE_CHECKING, Any

import requests
import requests.adapters
import requests.cookies
import requests.exceptions
import requests.structures

from npu_sync.transport._base import (
    Response,
    TransportError,
    TransportFeatures,
    Where,
    base_headers,
    check_scheme,
    describe,
    os_reason,
    tls_reason,
)
from npu_sync.transport._builtin import DEFAULT_IDLE_TIMEOUT
from npu_sync.transport._idle import IdleBudget
from npu_sync.transport._resolve import BoundedResolver, Lookup, default_resolver
from npu_sync.transport._urllib3 import (
    IdleShare,
    _check_headers,
    _exchange,
    _from_urllib3,
    _HTTPConnectionPool,
    _HTTPSConnectionPool,
)

if TYPE_CHECKING:
    from urllib3.response import BaseHTTPResponse

    from npu_sync.config import TLSConfig, WorkerConfig


class _NoRetryAdapter(requests.adapters.HTTPAdapter):
    """HTTPAdapter on the urllib3 transport's pools: handshake failures reported as
    never sent, the reaper, the bounded resolver and the idle timeout.
    """

    def __init__(self, idle_timeout: float, **kwargs: Any) -> None:
        self._idle_timeout = idle_timeout
        self.idle_share = IdleShare()
        super().__init__(**kwargs)

    def reap(self, now: float, *, everything: bool = False) -> int:
        pools = self.poolmanager.pools
        closed = 0
        for key in pools.keys():  # noqa: SIM118 - the container refuses plain iteration
            pool = pools.get(key)
            if pool is not None:
                closed += pool.reap(now, everything=everything)
        return closed

    def init_poolmanager(
        self, connections: int, maxsize: int, block: bool = False, **pool_kwargs: Any
    ) -> None:
        super().init_poolmanager(connections, maxsize, block, **pool_kwargs)
        # PoolManager builds pools as cls(host, port, **kw) and refuses unknown keys in
        # kw (they become part of the pool key), so the idle timeout is bound here.
        self.poolmanager.pool_classes_by_scheme = {
            "http": functools.partial(
                _HTTPConnectionPool, idle_timeout=self._idle_timeout, share=self.idle_share
            ),
            "https": functools.partial(
                _HTTPSConnectionPool, idle_timeout=self._idle_timeout, share=self.idle_share
            ),
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
        idle_timeout: seconds an idle connection stays reusable.
        resolver: the blocking name lookup (``socket.getaddrinfo`` by default), run
            on a daemon thread and waited for only within the connect budget.
    """

    # Neither cancel= nor silence=: a hedge's loser runs to its end, and the pool cuts
    # the call's budget to the stall limit.
    features = TransportFeatures(shares_idle=True)

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
        check_scheme(worker)
        self.worker = worker
        self._base_path = worker.base_path
        self._limit = max_response_bytes
        self._resolver = default_resolver if resolver is None else BoundedResolver(resolver)
        # scheme://host:port: the worker's base path is joined to each request's path.
        self._base_url = worker.url.removesuffix(worker.base_path)
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
        adapter = _NoRetryAdapter(
            idle_timeout, pool_connections=1, pool_maxsize=max(1, maxsize), max_retries=0
        )
        # Only this worker's URL is served; anything else would fail loudly.
        session.adapters.clear()
        session.mount(self._base_url + "/", adapter)
        self._session = session
        self._adapter = adapter
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
        path = self._base_path + path
        what = describe(self.worker, method, path, timeout)
        if self._closed:
            raise TransportError("connect", what.on("transport is closed"), sent=False)
        if headers:
            _check_headers(headers, what)
        sent_headers: Mapping[str, str] | None = headers
        if body is not None:
            sent_headers = {**self._json_headers, **headers} if headers else self._json_headers
        connect = timeout if connect_timeout is None else min(connect_timeout, timeout)

        def send() -> BaseHTTPResponse:
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
                raise _from_requests(exc, what) from exc
            raw: BaseHTTPResponse = resp.raw
            return raw

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
        )

    def share_idle(self, budget: IdleBudget) -> None:
        """Count the idle connections against ``budget``, shared with the pool's other
        transports (``transport.max_idle_connections``)."""
        self._adapter.idle_share.budget = budget

    def reap(self, now: float | None = None) -> int:
        """Close idle connections that expired or that the worker closed; how many."""
        return self._adapter.reap(time.monotonic() if now is None else now)

    def close_idle(self) -> int:
        """Close every idle connection now (the transport stays usable); how many."""
        return self._adapter.reap(0.0, everything=True)

    def close(self) -> None:
        """Close every pooled connection; later requests fail with ``kind="connect"``."""
        self._closed = True
        self._session.close()


def _from_requests(exc: requests.exceptions.RequestException, what: Where) -> TransportError:
    """Map a requests exception to a TransportError through the urllib3 error it wraps."""
    inner = exc.args[0] if exc.args else None
    if isinstance(inner, BaseException):
        return _from_urllib3(inner, what)
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return TransportError("timeout", what.at("timed out connecting"), sent=False)
    if isinstance(exc, requests.exceptions.Timeout):
        return TransportError("timeout", what.late(), sent=True)
    if isinstance(exc, requests.exceptions.SSLError):
        return TransportError("tls", what.on(f"TLS error: {tls_reason(exc)}"), sent=True)
    if isinstance(exc, requests.exceptions.ConnectionError):
        return TransportError("reset", what.on(f"connection lost: {os_reason(exc)}"), sent=True)
    return TransportError("protocol", what.on(f"{type(exc).__name__}: {exc}"), sent=True)
