"""The Redis address of ``shared_state.url``: one server, a Sentinel-managed primary, or
a Cluster, read without importing redis. Immutable results, so thread-safe.

Spellings (see docs/deployment.md, "Sentinel and Cluster"):

- ``redis://``, ``rediss://``, ``unix://``: one server, as redis-py reads it;
- ``redis+sentinel://[[user]:password@]host[:port][,host[:port]…]/service[/db]``:
  the primary Sentinel names ``service`` (port 26379 by default); ``rediss+`` for TLS
  to the primary and its replicas;
- ``redis+cluster://[[user]:password@]host[:port][,host[:port]…]``: a Cluster,
  found from any of the nodes given (port 6379 by default); no database (a Cluster
  has only 0); ``rediss+`` for TLS.

Messages never quote the URL: it usually holds the password.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Final
from urllib.parse import parse_qsl, unquote

SERVER: Final = "server"
SENTINEL: Final = "sentinel"
CLUSTER: Final = "cluster"

_MULTI: Final = {
    "redis+sentinel": (SENTINEL, False, 26379),
    "rediss+sentinel": (SENTINEL, True, 26379),
    "redis+cluster": (CLUSTER, False, 6379),
    "rediss+cluster": (CLUSTER, True, 6379),
}

SCHEMES_TEXT: Final = (
    "redis://, rediss://, unix://, redis+sentinel:// or redis+cluster:// (rediss+ for TLS)"
)


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """Where the shared state lives. ``nodes`` are the sentinels (``kind == "sentinel"``)
    or the cluster's start-up nodes (``"cluster"``); empty for one server, whose URL
    redis-py reads itself. Immutable, so thread-safe."""

    kind: str
    nodes: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    query: tuple[tuple[str, str], ...] = ()

    def __repr__(self) -> str:
        # Never the password.
        return (
            f"RedisTarget(kind={self.kind!r}, nodes={self.nodes!r}, "
            f"service={self.service!r}, db={self.db!r}, tls={self.tls!r})"
        )


class RedisUrlError(ValueError):
    """What is wrong with a Redis URL, worded without quoting it."""


def parse(text: str) -> RedisTarget:
    """The target a ``shared_state.url`` names.

    Raises:
        RedisUrlError: the URL cannot be used; the message never quotes it.
    """
    scheme, sep, rest = text.partition("://")
    if not sep or (scheme not in _MULTI and scheme not in ("redis", "rediss", "unix")):
        raise RedisUrlError(f"must start with {SCHEMES_TEXT}")
    if scheme not in _MULTI:
        return RedisTarget(SERVER, tls=scheme == "rediss")
    kind, tls, default_port = _MULTI[scheme]
    rest, _, query = rest.partition("?")
    if "#" in rest or "#" in query:
        raise RedisUrlError("has a fragment ('#'); name the service in the path")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
        if not colon and user:
            # redis://secret@host is read by redis-py as a password alone; so here.
            username, password = None, unquote(user)
    nodes = tuple(_node(part, default_port) for part in hosts.split(","))
    parts = [unquote(p) for p in path.split("/")] if path else []
    service: str | None = None
    db = 0
    if kind == SENTINEL:
        if not parts or not parts[0]:
            raise RedisUrlError(
                "needs the service name Sentinel knows the primary by "
                "(redis+sentinel://host:26379,host2:26379/mymaster)"
            )
        service = parts[0]
        if any(c.isspace() for c in service):
            raise RedisUrlError("has a service name with spaces")
        extra = [p for p in parts[1:] if p]
        if len(extra) > 1:
            raise RedisUrlError("has more than /service/db in its path")
        if extra:
            if not extra[0].isdigit():
                raise RedisUrlError(
                    "has a database that is not a number (the path is /service/db, e.g. "
                    "/mymaster/0)"
                )
            db = int(extra[0])
    elif any(parts):
        raise RedisUrlError("has a path: a Cluster has no database and no service name")
    pairs = tuple(parse_qsl(query, keep_blank_values=True))
    return RedisTarget(kind, nodes, service, db, username, password, tls, pairs)


def _node(text: str, default_port: int) -> tuple[str, int]:
    if not text:
        raise RedisUrlError("has an empty host in its list (host:port,host:port)")
    if text.startswith("["):
        host, bracket, tail = text[1:].partition("]")
        if not bracket:
            raise RedisUrlError("has an IPv6 address without its closing ']'")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise RedisUrlError("has an invalid IPv6 address") from None
        port_text = tail[1:] if tail.startswith(":") else None
        if tail and port_text is None:
            raise RedisUrlError("has text after an IPv6 address that is not ':port'")
    else:
        host, colon, port_text_ = text.partition(":")
        port_text = port_text_ if colon else None
        if not host:
            raise RedisUrlError("has a node with no host")
    if port_text is None:
        return host, default_port
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise RedisUrlError("has an invalid port (must be 1..65535)")
    return host, int(port_text)
