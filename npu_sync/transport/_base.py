"""What every transport shares: the protocol, the response, the one error type.

A transport carries one worker's HTTP exchanges. The pool calls
:meth:`Transport.request` on its hot path and reads only :class:`Response` and
:class:`TransportError` from it, so a transport may be built on any client.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any, Protocol

from npu_sync.errors import NpuSyncError

if TYPE_CHECKING:
    from npu_sync.config import WorkerConfig

TRANSPORT_ERROR_KINDS = frozenset({"connect", "timeout", "reset", "too_large", "protocol", "tls"})
"""Every value :attr:`TransportError.kind` can take."""

try:
    USER_AGENT = f"npu-sync/{metadata.version('npu_sync')}"
except metadata.PackageNotFoundError:  # running from a source tree
    USER_AGENT = "npu-sync"


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
    """

    def __init__(self, kind: str, message: str, *, sent: bool, stale: bool = False) -> None:
        if kind not in TRANSPORT_ERROR_KINDS:
            raise ValueError(f"unknown transport error kind {kind!r}")
        super().__init__(message)
        self.kind = kind
        self.sent = sent
        self.stale = stale

    def __repr__(self) -> str:
        stale = ", stale=True" if self.stale else ""
        return f"TransportError({self.kind!r}, {str(self)!r}, sent={self.sent!r}{stale})"


class Transport(Protocol):
    """What the pool needs to talk to one worker. Implementations must be thread-safe."""

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


def base_headers(worker: WorkerConfig) -> dict[str, str]:
    return merge_headers({"User-Agent": USER_AGENT}, {"user-agent": "User-Agent"}, worker.headers)


def with_content_type(headers: dict[str, str]) -> dict[str, str]:
    if "content-type" in header_index(headers):
        return headers
    return {**headers, "Content-Type": "application/json"}


def describe(worker: WorkerConfig, method: str, path: str) -> str:
    return f"{method} {worker.url}{path} (worker {worker.id})"


def check_scheme(worker: WorkerConfig) -> str:
    scheme = worker.scheme
    if scheme not in ("http", "https"):
        raise ValueError(f"worker {worker.id}: unsupported URL scheme {scheme!r}")
    return scheme
