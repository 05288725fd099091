"""Per-worker request authentication: the headers each request to a worker carries.

Three forms, all with one method, ``headers(method, path)``, called for every request
(tasks, health checks, model lists, model loads) with the request's method and its
path on the wire (the worker's base path included; a query string is allowed and
ignored where it does not belong in a signature):

* :class:`StaticHeaders`: the same headers on every request;
* :class:`BearerAuth`: ``Authorization: Bearer <token>``;
* :class:`HmacAuth`: AutoBot's service-to-service signing, ``X-Service-ID``,
  ``X-Service-Timestamp`` and ``X-Service-Signature``, the hex HMAC-SHA256 of
  ``f"{service_id}:{METHOD}:{path}:{timestamp}"`` keyed with the shared secret, with
  the path taken without its query and percent-decoded (what AutoBot's verifier reads,
  Starlette's ``request.url.path``), and the timestamp in whole Unix seconds.

:class:`HmacVerifier` checks such signatures on the receiving side (the reference
worker uses it).

Secrets never leave these objects except in the headers they make: not in ``repr()``,
``str()``, exception messages or logs. This module logs nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Final, Protocol
from urllib.parse import unquote

if TYPE_CHECKING:
    from npu_sync.config import AuthConfig

__all__ = [
    "HMAC_WINDOW",
    "NO_AUTH",
    "BearerAuth",
    "HmacAuth",
    "HmacVerifier",
    "RequestAuth",
    "StaticHeaders",
    "from_config",
]

HMAC_WINDOW: Final = 300.0
"""Seconds a signed request's timestamp may be away from the receiver's clock."""

SERVICE_ID_HEADER: Final = "X-Service-ID"
SIGNATURE_HEADER: Final = "X-Service-Signature"
TIMESTAMP_HEADER: Final = "X-Service-Timestamp"

# Distinct (method, path) pairs whose current signature is kept; tasks name few paths.
_CACHE_LIMIT = 64


class RequestAuth(Protocol):
    """What the pool asks of a worker's authentication. Implementations are thread-safe."""

    def headers(self, method: str, path: str) -> Mapping[str, str]:
        """The headers to add to one request.

        Args:
            method: the HTTP method, e.g. ``"POST"``.
            path: the request target on the wire, starting with ``/``.

        Returns:
            A mapping the caller must not modify.
        """
        ...


def _header_value(what: str, value: object, *, allow_space: bool) -> str:
    """``value`` if it can go in an HTTP header; the error never quotes it."""
    if not isinstance(value, str):
        raise ValueError(f"{what}: must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{what}: must not be empty")
    if not (value.isascii() and value.isprintable()) or (not allow_space and " " in value):
        # A secret is never echoed, not even in part: say only what is wrong with it.
        rule = "printable ASCII" if allow_space else "printable ASCII without spaces"
        raise ValueError(f"{what}: must be {rule} ({len(value)} characters given)")
    return value


class StaticHeaders:
    """The same headers on every request. Immutable, thread-safe.

    ``repr()`` names the headers, never their values: they often carry credentials.

    Raises:
        ValueError: a name or value that cannot be sent as a header.
    """

    __slots__ = ("_headers",)

    def __init__(self, headers: Mapping[str, str] | None = None) -> None:
        checked = {}
        for name, value in (headers or {}).items():
            _header_value("header name", name, allow_space=False)
            if ":" in name:
                raise ValueError(f"header name {name!r}: must not contain ':'")
            checked[name] = _header_value(f"header {name!r}", value, allow_space=True)
        self._headers: Mapping[str, str] = MappingProxyType(checked)

    def headers(self, method: str, path: str) -> Mapping[str, str]:
        return self._headers

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return dict(self._headers) == dict(other._headers)

    def __hash__(self) -> int:
        return hash(frozenset(self._headers.items()))

    def __copy__(self) -> StaticHeaders:
        return self

    def __deepcopy__(self, memo: object) -> StaticHeaders:
        return self

    def __repr__(self) -> str:
        return f"StaticHeaders(names={sorted(self._headers)!r})"


NO_AUTH: Final = StaticHeaders()
"""No headers at all."""


class BearerAuth:
    """``Authorization: Bearer <token>`` on every request. Immutable, thread-safe.

    Args:
        token: the bearer token (in a configuration, from ``${ENV}``).

    Raises:
        ValueError: a token that cannot be sent in a header (the message does not
            quote it).
    """

    __slots__ = ("_headers",)

    def __init__(self, token: str) -> None:
        token = _header_value("bearer token", token, allow_space=False)
        self._headers: Mapping[str, str] = MappingProxyType({"Authorization": f"Bearer {token}"})

    def headers(self, method: str, path: str) -> Mapping[str, str]:
        return self._headers

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return hmac.compare_digest(
            self._headers["Authorization"],
            other._headers["Authorization"],
        )

    def __hash__(self) -> int:
        return hash((BearerAuth, self._headers["Authorization"]))

    def __repr__(self) -> str:
        return "BearerAuth(token=***)"

    def __copy__(self) -> BearerAuth:
        return self

    def __deepcopy__(self, memo: object) -> BearerAuth:
        return self


def _signed(path: str) -> str:
    """The part of a request target a signature covers: the path without its query,
    percent-decoded as an ASGI server decodes it for the verifier."""
    return unquote(path.partition("?")[0])


def _signature(key: hmac.HMAC, message: str) -> str:
    mac = key.copy()
    mac.update(message.encode())
    return mac.hexdigest()


class HmacAuth:
    """AutoBot's HMAC request signing. Immutable to its users, thread-safe.

    Each request carries ``X-Service-ID``, ``X-Service-Timestamp`` (whole Unix seconds)
    and ``X-Service-Signature``: the hex HMAC-SHA256, keyed with ``secret``, of
    ``f"{service_id}:{METHOD}:{path}:{timestamp}"`` with the path's query left out and
    the rest percent-decoded: AutoBot's verifier signs the path its ASGI server hands
    it, which is decoded (``/models/a%20b`` is checked as ``/models/a b``).

    Signatures are cached per method and path for the current second, so signing
    costs a dictionary lookup on most requests.

    Args:
        service_id: sent as ``X-Service-ID``; the receiver knows the secret by it.
        secret: the shared secret (in a configuration, from ``${ENV}``).
        clock: wall-clock seconds since the epoch.

    Raises:
        ValueError: an empty or unsendable service id or secret (a message about the
            secret never quotes it).
    """

    __slots__ = ("_cache", "_clock", "_key", "_prefix", "service_id")

    def __init__(
        self, service_id: str, secret: str, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.service_id = _header_value("service id", service_id, allow_space=True)
        if not isinstance(secret, str):
            raise ValueError(f"HMAC secret: must be a string, got {type(secret).__name__}")
        if not secret:
            raise ValueError("HMAC secret: must not be empty")
        # The keyed state is built once; each signature copies it.
        self._key = hmac.new(secret.encode(), digestmod=hashlib.sha256)
        self._clock = clock
        self._prefix = service_id + ":"
        # (method, path) -> (timestamp, headers). Entries are replaced whole, never
        # changed, so concurrent readers see one consistent entry or the other.
        self._cache: dict[tuple[str, str], tuple[int, Mapping[str, str]]] = {}

    def headers(self, method: str, path: str) -> Mapping[str, str]:
        now = int(self._clock())
        key = (method, path)
        entry = self._cache.get(key)
        if entry is not None and entry[0] == now:
            return entry[1]
        method = method.upper()
        signature = _signature(self._key, f"{self._prefix}{method}:{_signed(path)}:{now}")
        headers = MappingProxyType(
            {
                SERVICE_ID_HEADER: self.service_id,
                SIGNATURE_HEADER: signature,
                TIMESTAMP_HEADER: str(now),
            }
        )
        cache = self._cache
        if len(cache) >= _CACHE_LIMIT and key not in cache:
            cache.clear()  # many distinct paths: keep it bounded, rebuild as needed
        cache[key] = (now, headers)
        return headers

    def sign(self, method: str, path: str, timestamp: int) -> str:
        """The signature of one request at ``timestamp`` (for tests and receivers)."""
        return _signature(self._key, f"{self._prefix}{method.upper()}:{_signed(path)}:{timestamp}")

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        # Equal keys sign alike: compare a signature, not the secrets themselves.
        probe = "npu-sync-key-check"
        return (
            self.service_id == other.service_id
            and self._clock is other._clock
            and hmac.compare_digest(
                _signature(self._key, probe),
                _signature(other._key, probe),
            )
        )

    def __hash__(self) -> int:
        return hash((HmacAuth, self.service_id))

    def __repr__(self) -> str:
        return f"HmacAuth(service_id={self.service_id!r}, secret=***)"

    # Immutable: a copy is the object itself (the keyed hash state cannot be copied
    # by the copy module anyway).
    def __copy__(self) -> HmacAuth:
        return self

    def __deepcopy__(self, memo: object) -> HmacAuth:
        return self


class HmacVerifier:
    """Checks AutoBot-style signed requests on the receiving side. Thread-safe.

    Checks the signature over the percent-decoded path, as AutoBot's verifier does
    (it reads Starlette's ``request.url.path``), so a signer that signs the path as
    sent on the wire is refused here as it would be there; the timestamp must be
    within ``window`` seconds of the clock.

    Args:
        service_id: the one service id accepted.
        secret: the shared secret.
        window: seconds of clock difference (and replay time) accepted.
        clock: wall-clock seconds since the epoch.
    """

    __slots__ = ("_clock", "_signer", "_window")

    def __init__(
        self,
        service_id: str,
        secret: str,
        *,
        window: float = HMAC_WINDOW,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._signer = HmacAuth(service_id, secret, clock=clock)
        self._window = window
        self._clock = clock

    def verify(
        self,
        method: str,
        path: str,
        service_id: str | None,
        signature: str | None,
        timestamp: str | None,
    ) -> str | None:
        """Check one request's headers.

        Returns:
            ``None`` when the request is signed correctly, otherwise why not: a
            reason that quotes neither the secret nor the expected signature.
        """
        for name, value in (
            (SERVICE_ID_HEADER, service_id),
            (SIGNATURE_HEADER, signature),
            (TIMESTAMP_HEADER, timestamp),
        ):
            if not value:
                return f"missing {name} header"
        assert service_id is not None and signature is not None and timestamp is not None
        if service_id != self._signer.service_id:
            return "unknown service id"
        text = timestamp.strip()
        if not (text.isascii() and text.isdigit()) or len(text) > 12:
            return f"{TIMESTAMP_HEADER} is not a Unix time in seconds"
        when = int(text)
        if abs(self._clock() - when) > self._window:
            return f"timestamp is more than {self._window:g} seconds away"
        given = signature.strip().lower()
        if not given.isascii():
            return "bad signature"
        if hmac.compare_digest(given, self._signer.sign(method, path, when)):
            return None
        return "bad signature"

    def __repr__(self) -> str:
        return f"HmacVerifier(service_id={self._signer.service_id!r}, secret=***)"


def from_config(config: AuthConfig) -> RequestAuth | None:
    """The auth a worker's ``auth:`` section asks for; ``None`` for ``type: none``
    (its static ``headers`` are the transport's to send).

    Raises:
        ValueError: a token, service id or secret that cannot be sent (never quoted).
    """
    if config.type == "bearer" and config.token is not None:
        return BearerAuth(config.token)
    if config.type == "hmac" and config.service_id is not None and config.secret is not None:
        return HmacAuth(config.service_id, config.secret)
    return None
