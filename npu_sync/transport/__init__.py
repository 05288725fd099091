"""HTTP transports: one connection pool per worker.

This package is the only part of npu_sync that imports an HTTP client. The pool calls
:meth:`Transport.request` on its hot path, so client CPU per request bounds the whole
library's throughput. ``transport.client`` chooses the implementation:
``builtin`` (:class:`BuiltinTransport`, HTTP/1.1 on the standard library: the
leanest, and the one whose deadlines hold whatever the worker does), ``urllib3``
(:class:`Urllib3Transport`) or ``requests`` (:class:`RequestsTransport`). All three
keep the same contract: one budget per call, the same errors, the same limits; see
``docs/transport.md``.

urllib3 and requests are imported when a transport that uses them is built (or when
one of their classes is named), never by ``import npu_sync``: together they cost about
as much to import as the rest of the package, and the default client needs neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from npu_sync.transport._base import (
    NO_FEATURES,
    TRANSPORT_ERROR_KINDS,
    Cancel,
    Response,
    Transport,
    TransportError,
    TransportFeatures,
    features_of,
)
from npu_sync.transport._builtin import DEFAULT_IDLE_TIMEOUT, BuiltinTransport
from npu_sync.transport._idle import IdleBudget, IdleReaper, reap_interval

if TYPE_CHECKING:
    from npu_sync.config import TransportConfig, WorkerConfig
    from npu_sync.transport._requests import RequestsTransport
    from npu_sync.transport._urllib3 import Urllib3Transport

__all__ = [
    "DEFAULT_IDLE_TIMEOUT",
    "NO_FEATURES",
    "TRANSPORT_ERROR_KINDS",
    "BuiltinTransport",
    "Cancel",
    "IdleBudget",
    "IdleReaper",
    "RequestsTransport",
    "Response",
    "Transport",
    "TransportError",
    "TransportFeatures",
    "Urllib3Transport",
    "features_of",
    "make_transport",
    "reap_interval",
]


def make_transport(
    worker: WorkerConfig, transport: TransportConfig, *, maxsize: int | None = None
) -> Transport:
    """Build the configured transport for one worker.

    Args:
        worker: the worker; its own ``tls`` settings win over ``transport.tls``.
        transport: which client to use, the response size limit and how long an idle
            connection stays reusable (``idle_timeout``).
        maxsize: connections kept for reuse; defaults to ``worker.max_concurrent``.

    Returns:
        A :class:`BuiltinTransport`, :class:`Urllib3Transport` or
        :class:`RequestsTransport`.

    Raises:
        ValueError: unknown ``transport.client`` or worker URL scheme.
    """
    tls = worker.tls if worker.tls is not None else transport.tls
    size = worker.max_concurrent if maxsize is None else maxsize
    idle_timeout = transport.idle_timeout
    if transport.client == "builtin":
        return BuiltinTransport(
            worker,
            tls=tls,
            max_response_bytes=transport.max_response_bytes,
            maxsize=size,
            idle_timeout=idle_timeout,
        )
    if transport.client == "urllib3":
        from npu_sync.transport._urllib3 import Urllib3Transport

        return Urllib3Transport(
            worker,
            tls=tls,
            max_response_bytes=transport.max_response_bytes,
            maxsize=size,
            idle_timeout=idle_timeout,
        )
    if transport.client == "requests":
        from npu_sync.transport._requests import RequestsTransport

        return RequestsTransport(
            worker,
            tls=tls,
            max_response_bytes=transport.max_response_bytes,
            maxsize=size,
            idle_timeout=idle_timeout,
        )
    raise ValueError(f"unknown transport client {transport.client!r}")


def __getattr__(name: str) -> object:
    """``Urllib3Transport`` and ``RequestsTransport``, imported when first named."""
    if name == "Urllib3Transport":
        from npu_sync.transport._urllib3 import Urllib3Transport

        return Urllib3Transport
    if name == "RequestsTransport":
        from npu_sync.transport._requests import RequestsTransport

        return RequestsTransport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
