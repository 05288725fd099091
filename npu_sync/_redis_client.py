"""The Redis client of the shared state, for one server, a Sentinel-managed primary or a
Cluster, and the durable write of a dead letter.

Built on redis-py's own clients: :class:`redis.Redis` for one server,
:meth:`redis.sentinel.Sentinel.master_for` (which asks the sentinels for the primary on
every new connection and drops a connection that finds a demoted primary), and
:class:`redis.cluster.RedisCluster`. Every client has the shared state's short timeouts
and no retry loop of its own, so no call stalls a task; a Cluster client follows one
``MOVED`` at once.

Every key of one namespace carries the hash tag ``{namespace}`` (see
:mod:`npu_sync._shared`), so on a Cluster all of them live in one slot: MGET, MSET and
MULTI work there as on one server. redis-py's cluster pipeline refuses MSET and PUBLISH
inside a transaction; :class:`ClusterClient` gives the shared state pipelines that
take them (MSET as SETs inside the same MULTI, PUBLISH sent once the MULTI ran).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError, ResponseError
from redis.retry import Retry
from redis.sentinel import Sentinel

from npu_sync import _redis_url
from npu_sync.config import SharedStateConfig
from npu_sync.errors import scrub

log = logging.getLogger(__name__)

__all__ = [
    "ClusterClient",
    "NotReplicated",
    "ReplicatedWriter",
    "build_client",
    "primary_moved",
    "reconnect",
]


def _untyped(fn: Any) -> Any:
    """redis-py's functions that carry no annotations, called from typed code."""
    return fn


class NotReplicated(Exception):
    """The primary took a write that no replica confirmed in time: not yet durable."""


def build_client(config: SharedStateConfig, timeout: float | None = None) -> Any:
    """A Redis client for ``config.url``: :class:`redis.Redis`, a Sentinel primary's
    client, or a :class:`ClusterClient`. Nothing is connected yet. ``timeout`` replaces
    ``config.timeout`` (the fleet snapshots' client has a longer one of its own)."""
    target = _redis_url.parse(config.url)
    if timeout is None:
        timeout = config.timeout
    own: dict[str, Any] = {
        "socket_connect_timeout": timeout,
        "socket_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
        "retry_on_timeout": False,
        "health_check_interval": 0,
    }
    if target.kind == _redis_url.SERVER:
        return redis.Redis.from_url(config.url, **own)
    extra = _query_arguments(target)
    auth = {"username": target.username, "password": target.password}
    if target.kind == _redis_url.SENTINEL:
        # The sentinels are asked with the same short timeouts and no retries: asking is
        # part of connecting, which a task may wait on. They take no password here.
        # Timeouts are retried only through `retry` (none): the flag is deprecated there.
        given = {k: v for k, v in own.items() if k != "retry_on_timeout"}
        sentinels = _untyped(Sentinel)(
            list(target.nodes),
            sentinel_kwargs={k: v for k, v in given.items() if k != "health_check_interval"},
        )
        assert target.service is not None
        client = _untyped(sentinels.master_for)(
            target.service, db=target.db, ssl=target.tls, **auth, **given, **extra
        )
        client.npu_sync_sentinel = (sentinels, target.service)
        return client
    return ClusterClient(target, {**own, **auth, **extra, "ssl": target.tls})


def _query_arguments(target: _redis_url.RedisTarget) -> dict[str, Any]:
    """The query parameters, typed as redis-py types them for a plain URL."""
    if not target.query:
        return {}
    query = "&".join(f"{name}={value}" for name, value in target.query)
    found = _untyped(parse_url)(("rediss" if target.tls else "redis") + "://localhost/?" + query)
    return {k: v for k, v in found.items() if k not in ("host", "port", "connection_class")}


def sentinel_of(client: Any) -> tuple[Sentinel, str] | None:
    """The sentinels and service name behind a client :func:`build_client` made."""
    found = getattr(client, "npu_sync_sentinel", None)
    return found if isinstance(found, tuple) else None


def primary_moved(client: Any, pubsub: Any = None) -> bool:
    """Behind Sentinel: whether the sentinels name another primary than the one this
    client's connections go to (a failover, which a client that only reads would not
    notice until the old primary is turned into a replica, seconds later), or than the
    one ``pubsub`` is subscribed on. One question to a sentinel; False for other
    clients, and before any connection was made.

    The pool's own address is not enough: any connection made after the failover (a
    task's write, the replication check) moves it to the new primary, while a
    subscription made before stays on the old one, hearing nothing published since,
    until the sentinels demote that server about ten seconds later."""
    found = sentinel_of(client)
    if found is None:
        return False
    addresses = []
    current = client.connection_pool.master_address
    if current is not None:
        addresses.append((str(current[0]), int(current[1])))
    connection = getattr(pubsub, "connection", None)
    if connection is not None and getattr(connection, "host", None):
        addresses.append((str(connection.host), int(connection.port)))
    if not addresses:
        return False
    sentinels, service = found
    named = _untyped(sentinels.discover_master)(service)
    return any(address != (str(named[0]), int(named[1])) for address in addresses)


def reconnect(client: Any) -> None:
    """Drop every pooled connection, so the next one is made afresh: to the primary the
    sentinels name now, or after a Cluster's slots moved."""
    try:
        if isinstance(client, ClusterClient):
            client.reset()
        else:
            # Idle connections only: one in use is another thread's call, which a closed
            # socket would fail with an error that is not Redis's.
            client.connection_pool.disconnect(inuse_connections=False)
    except (RedisError, OSError):
        log.debug("dropping the Redis connections failed", exc_info=True)


class ClusterClient:
    """A :class:`redis.cluster.RedisCluster` built on first use (a Cluster that does not
    answer yet is an outage, not an error at start), whose pipelines take MSET and
    PUBLISH. Thread-safe.
    """

    def __init__(self, target: _redis_url.RedisTarget, options: dict[str, Any]) -> None:
        self._target = target
        self._options = options
        self._real: RedisCluster | None = None
        self._lock = threading.Lock()

    def _get(self) -> RedisCluster:
        real = self._real
        if real is not None:
            return real
        # RedisCluster retries timeouts only through `retry`: the flag is deprecated there.
        options = {k: v for k, v in self._options.items() if k != "retry_on_timeout"}
        # One immediate retry: enough to follow a MOVED after the slots moved.
        options["retry"] = Retry(NoBackoff(), 1)
        try:
            built = RedisCluster(
                startup_nodes=[_untyped(ClusterNode)(h, p) for h, p in self._target.nodes],
                require_full_coverage=False,
                **options,
            )
        except RedisClusterException as exc:
            raise RedisConnectionError(scrub(str(exc))) from None
        with self._lock:  # built outside the lock: building connects
            if self._real is None:
                self._real = built
                return built
            real = self._real
        built.close()
        return real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._get(), name)

    def pipeline(self, transaction: bool | None = None) -> SlotPipeline:
        return SlotPipeline(_untyped(self._get().pipeline)(transaction=transaction), self)

    def node_client(self, key: str) -> redis.Redis:
        """The client of the primary that holds ``key``'s slot."""
        real = self._get()
        node = _untyped(real.get_node_from_key)(key)
        connection = real.get_redis_connection(node)
        return connection

    def reset(self) -> None:
        """Forget the Cluster's layout: the next call reads it again."""
        with self._lock:
            real, self._real = self._real, None
        if real is not None:
            real.close()

    def close(self) -> None:
        self.reset()


class SlotPipeline:
    """A cluster pipeline whose keys share one slot: MSET becomes SETs in the same MULTI
    and PUBLISH is sent after it (redis-py refuses both inside a cluster pipeline).
    ``execute()`` gives one result per SET and the PUBLISH results last. Not
    thread-safe, like any pipeline."""

    def __init__(self, pipe: Any, client: ClusterClient) -> None:
        self._pipe = pipe
        self._client = client
        self._messages: list[tuple[str, str]] = []

    def mset(self, mapping: dict[str, Any]) -> SlotPipeline:
        for key, value in mapping.items():
            self._pipe.set(key, value)
        return self

    def publish(self, channel: str, message: str) -> SlotPipeline:
        self._messages.append((channel, message))
        return self

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        results = list(self._pipe.execute(raise_on_error=raise_on_error))
        for channel, message in self._messages:
            results.append(self._client.publish(channel, message))
        self._messages.clear()
        return results

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    def __enter__(self) -> SlotPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pipe.reset()


def _live_replicas(sentinels: Sentinel, service: str, *, settled: bool) -> int | None:
    """Replicas the first sentinel that answers sees up; with ``settled``, only those
    reporting ``role:slave`` with their link to the primary ok. None when no sentinel
    answers: not knowing is not the same as none."""
    for one in sentinels.sentinels:
        try:
            found: list[dict[str, Any]] = _untyped(one.sentinel_slaves)(service)
        except RedisError:
            continue
        up = [r for r in found if not (r.get("is_sdown") or r.get("is_odown"))]
        if settled:
            up = [
                r
                for r in up
                if r.get("role-reported") == "slave" and r.get("master-link-status") == "ok"
            ]
        return len(up)
    return None


RECHECK = 10.0
"""Seconds after which whether the primary has replicas is read again, at the next
dead letter (the old primary rejoining as a replica after a failover, a new replica)."""


class ReplicatedWriter:
    """Writes a dead letter so that it counts as stored only once it is on the primary
    and, when the primary has replicas, on at least one of them (``WAIT 1``). Thread-safe.

    Whether replicas are expected is read by :meth:`check` (at start, on every
    reconnect, after a write no replica confirmed, and every ``RECHECK`` seconds at the
    next write): from the sentinels' list of
    live replicas behind a Sentinel URL, else from the primary's ``INFO replication``.
    A primary that is no longer one (demoted by a failover) fails the check.

    Args:
        client: a client :func:`build_client` made.
        key: a key of the namespace (its slot names the node on a Cluster).
        wait_timeout: seconds WAIT waits for a replica; below the socket timeout.
    """

    def __init__(self, client: Any, key: str, wait_timeout: float) -> None:
        self._client = client
        self._key = key
        self._wait_ms = max(1, int(wait_timeout * 1000))
        self.replicas = 0
        """Replica acknowledgements a write needs: 0 or 1."""
        self._checked_at = -RECHECK
        self._stale = True
        self._primary: tuple[str, int] | None = None

    @property
    def stale(self) -> bool:
        """Whether :meth:`check` is due: never run, a write no replica confirmed since,
        or ``RECHECK`` seconds passed (a replica may have joined)."""
        return self._stale or time.monotonic() - self._checked_at >= RECHECK

    @property
    def known(self) -> bool:
        """Whether a check has said what a write needs since the last doubt (never
        run, or a write no replica confirmed). The ``RECHECK`` refresh leaves it known:
        that one is the sync thread's, never a task's."""
        return not self._stale

    def _node(self) -> Any:
        if isinstance(self._client, ClusterClient):
            return self._client.node_client(self._key)
        return self._client

    def check(self) -> bool:
        """Read whether replicas are expected; False (and the idle connections dropped,
        so the next one finds the primary afresh) when the server is not the primary.

        Behind Sentinel the server must be at the address the sentinels name: a primary
        a failover is replacing still says ``role:master`` for seconds, and what it
        takes then is lost when it turns replica. The replicas counted are those the
        sentinels see up. On a primary checked before, a replica counts until the
        sentinels find it down: one that left may be the replica a failover is
        promoting, and what the old primary takes alone then is lost. On a new primary
        only replicas reporting ``role:slave`` with their link ok count: the old
        primary, not yet reconfigured, still says it is one.

        Raises:
            RedisError: Redis did not answer.
        """
        found = sentinel_of(self._client)
        if found is None:
            info = self._info(self._node())
            where = None
        else:
            info, where = self._info_of_connection(self._client.connection_pool)
        role = info.get("role", "master")
        if role == "master" and found is not None:
            sentinels, service = found
            named = _untyped(sentinels.discover_master)(service)
            if where is None or (str(named[0]), int(named[1])) != where:
                role = "not at the address the sentinels name"
        if role != "master":
            log.warning("the shared-state Redis is not the primary (%s): reconnecting", role)
            if found is not None:
                # Tells the pool the primary moved: it drops connections to the old one.
                _untyped(self._client.connection_pool.get_master_address)()
            reconnect(self._client)
            return False
        if found is not None:
            sentinels, service = found
            # A replica that vanished from the primary we already wrote to may be one a
            # failover is promoting: it counts until the sentinels find it down. On a
            # new primary only replicas replicating from it count.
            live = _live_replicas(sentinels, service, settled=where != self._primary)
            if live is None:
                # No sentinel answered (busy, failing over): keep waiting for a replica
                # if one was expected, or if the primary itself has one. Taking silence
                # for "no replica" acknowledged records a failover then lost.
                live = max(self.replicas, int(info.get("connected_slaves") or 0))
            replicas = live
            self._primary = where
        else:
            replicas = int(info.get("connected_slaves") or 0)
        self.replicas = 1 if replicas > 0 else 0
        self._stale = False
        self._checked_at = time.monotonic()
        return True

    @staticmethod
    def _info(client: Any) -> dict[str, str]:
        try:
            info = client.info("replication")
        except ResponseError:
            return {}  # INFO refused (an ACL, a renamed command): no replicas known
        return {str(k): str(v) for k, v in info.items()} if isinstance(info, dict) else {}

    @staticmethod
    def _info_of_connection(pool: Any) -> tuple[dict[str, str], tuple[str, int]]:
        """``INFO replication`` and the address it came from, on one pooled connection."""
        connection = pool.get_connection()
        raw: Any = None
        try:
            connection.send_command("INFO", "replication")
            # INFO refused (an ACL, a renamed command): no replicas known.
            with contextlib.suppress(ResponseError):
                raw = connection.read_response()
            where = (str(connection.host), int(connection.port))
        except BaseException:
            connection.disconnect()
            raise
        finally:
            pool.release(connection)
        if raw is None:
            return {}, where
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        info = {}
        for line in text.splitlines():
            key, sep, value = line.partition(":")
            if sep and not key.startswith("#"):
                info[key.strip()] = value.strip()
        return info, where

    def write(self, records: str, order: str, record_id: str, body: str, at: float) -> int:
        """Write one record and its place in the order in one MULTI, then wait for a
        replica when one is expected.

        Returns:
            How many records the order holds now.

        Raises:
            NotReplicated: no replica confirmed the write in time; the record is not
                to be acknowledged (it is written again, under the same id, later).
            RedisError: Redis failed.
        """
        needed = self.replicas
        # MULTI … EXEC and WAIT on one connection (WAIT counts this connection's writes),
        # sent as one plain pipeline: replies are read raw, "QUEUED" included.
        pipe = self._node().pipeline(transaction=False)
        pipe.response_callbacks = {}
        pipe.execute_command("MULTI")
        pipe.execute_command("HSET", records, record_id, body)
        pipe.execute_command("ZADD", order, repr(at), record_id)
        pipe.execute_command("ZCARD", order)
        pipe.execute_command("EXEC")
        if needed:
            pipe.execute_command("WAIT", needed, self._wait_ms)
        results = pipe.execute()
        done = results[4]
        if not isinstance(done, list) or len(done) != 3:
            raise RedisError("the dead letter's MULTI was aborted")
        if needed and int(results[5]) < needed:
            self._stale = True
            raise NotReplicated(f"no replica confirmed a dead letter within {self._wait_ms} ms")
        return int(done[2])
