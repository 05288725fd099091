"""State shared by every process that uses the same workers, through Redis.

Several processes (gunicorn workers, several hosts) each run a pool. Alone, each must
find a dead worker by failing on it ``fail_max`` times and keeps its own dead letters.
With ``shared_state: {backend: redis}`` they share:

- **breakers**: decisions, never counts. Each process counts its own consecutive
  failures; the one that reaches ``fail_max`` opens its breaker and publishes the
  opening, and the others open theirs on receipt (pub/sub, with a periodic re-read in
  case a message is lost). The half-open trial is the fleet's: one process takes it
  as a lease (:meth:`SharedState.take_trial`, ``SET NX PX``, expiring by itself if
  that process dies) and publishes its result, closed or opened again, the same way;
- **dead letters**: :class:`RedisDeadLetterStore`, listed and replayed from any process,
  with a claim per record that expires if the replaying process dies;
- **the fleet view**: each process's pool snapshot under a key that expires (written by
  :mod:`npu_sync._fleet`'s monitor thread, read by ``stats(scope="fleet")``).

Nothing here runs under the pool's lock, and a task thread touches Redis only for a
breaker decision (an opening, a closing, a trial's lease), never for a task that
succeeds nor for a failure short of an opening;
snapshots are written by the fleet monitor's own thread, on a timer.

Redis fails too. The client has short timeouts and no retry loop (redis-py's defaults
can stall a call for seconds). The first error marks Redis unavailable: from then on
no call is made (each process works on its local state), the outage is logged once
and counted, and the sync thread probes Redis until it answers, then re-reads the
shared state and resumes. Dead letters written meanwhile are kept in a local SQLite
file of this process's own (the *spool*, :mod:`npu_sync._spool`), which survives the
process being killed, and are pushed to Redis once it is back, by this process or,
once it has ended, by any other of the same app.

Redis's ``maxmemory-policy`` is read at start and after each outage
(:class:`EvictionPolicy`): dead letters are refused a Redis that may evict them, and
any other policy but ``noeviction`` is warned about and counted.

Redis is one server, a primary behind Sentinel or a Cluster (the client is built by
:mod:`npu_sync._redis_client`); every key of a namespace starts with the hash tag
``{namespace}``, so on a Cluster all of them share one slot. A dead letter counts as
stored once the primary's replica has it too (``WAIT``), when there is one; behind
Sentinel a failover is one outage, which ends once the new primary answers.

Redis refusing the credentials (or the database number) is not an outage but a
configuration error, raised when the state is built. A new process reads the shared
breaker states before its first task (:meth:`SharedState.start`), so it does not
open with an attempt on a worker every other process already knows is down.

pybreaker's ``CircuitRedisStorage`` keeps ``opened_at`` in whole seconds; npu_sync also
stores the opening time to the microsecond (``{<namespace>}:…:opened_at_precise``) with the
reset timeout in force, and uses those, so a reset timeout is not cut short or
stretched by up to a second in the other processes.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from redis.exceptions import AuthenticationError, RedisError, ResponseError

from npu_sync._breaker import CLOSED, OPEN, redis_storage
from npu_sync._deadletter import CLAIM_SECONDS, DeadLetter, SQLiteDeadLetterStore
from npu_sync._redis_client import (
    NotReplicated,
    ReplicatedWriter,
    build_client,
    primary_moved,
    reconnect,
)
from npu_sync._spool import ProcessSpool, default_base
from npu_sync.config import SharedStateConfig
from npu_sync.errors import ConfigError, NpuSyncError, scrub

log = logging.getLogger(__name__)

RemoteChange = Callable[[str, str, float, float | None], None]
"""``on_remote(worker_id, state, age_seconds, reset_timeout)`` for another process's
breaker change; ``state`` is ``"open"`` or ``"closed"``."""


class _ErrorSink:
    """Stands in for pybreaker's storage logger: CircuitRedisStorage swallows Redis
    errors and logs each with a traceback; we turn them into an outage instead."""

    def __init__(self, shared: SharedState) -> None:
        self._shared = shared

    def exception(self, msg: str, *args: object, **kwargs: object) -> None:
        import sys

        self._shared.lost(sys.exc_info()[1])


class EvictionPolicy:
    """What Redis does with keys once it reaches ``maxmemory``, and what that risks for
    ours. Immutable.

    Read as Sidekiq does: ``CONFIG GET maxmemory-policy``, else (CONFIG renamed away or
    refused by an ACL) the ``maxmemory_policy`` line of ``INFO memory``. ``name`` is None
    when neither answers.

    - ``noeviction``: nothing is ever evicted; a full Redis refuses writes, and a dead
      letter it refuses is spooled like in any outage. The only safe policy.
    - ``volatile-*``: only keys with a TTL go. Dead letters and breaker states have
      none; replay claims and fleet snapshots do (a claim evicted early may let a record
      be replayed twice): :attr:`risky`.
    - ``allkeys-*``: any key may go, dead letters included, with no error to anyone:
      :attr:`evicts_records`.
    """

    def __init__(self, name: str | None) -> None:
        self.name = name

    @classmethod
    def read(cls, client: Any) -> EvictionPolicy:
        try:
            found = client.config_get("maxmemory-policy")
            name = found.get("maxmemory-policy") if isinstance(found, dict) else None
            if name:
                return cls(str(name))
        except ResponseError:
            pass  # CONFIG disabled or not allowed: INFO says it too
        try:
            info = client.info("memory")
        except ResponseError:
            return cls(None)
        name = info.get("maxmemory_policy") if isinstance(info, dict) else None
        return cls(str(name) if name else None)

    @property
    def evicts_records(self) -> bool:
        """Redis may drop keys without a TTL: dead letters, breaker states."""
        return self.name is not None and self.name.startswith("allkeys-")

    @property
    def risky(self) -> bool:
        """Redis may drop some of our keys: any policy but ``noeviction``."""
        return self.name is not None and self.name != "noeviction"

    def refuse_dead_letters(self) -> None:
        """Refuse to acknowledge dead letters into a Redis that may evict them.

        Raises:
            ConfigError: the policy is ``allkeys-*``.
        """
        if self.evicts_records:
            raise ConfigError(
                f"shared_state.url: Redis may evict dead letters (maxmemory-policy "
                f"{self.name}): a record could vanish after TaskFailed named it. Set "
                "maxmemory-policy noeviction on that Redis (CONFIG SET maxmemory-policy "
                "noeviction, and in redis.conf), or keep dead letters elsewhere "
                "(dead_letter.backend: sqlite); see docs/deployment.md, Redis requirements"
            )


class SharedState:
    """One pool's view of the shared Redis state. Thread-safe.

    Args:
        config: the ``shared_state`` settings.
        on_remote: called (on the sync thread) when another process changes a breaker.
        client: a Redis client to use instead of one built from ``config.url`` (tests).

    Raises:
        ConfigError: Redis refused the credentials or the database number in
            ``config.url``. Redis being unreachable is not an error: the state starts
            unavailable and is probed.
    """

    def __init__(
        self, config: SharedStateConfig, on_remote: RemoteChange, *, client: Any = None
    ) -> None:
        self.config = config
        self.namespace = config.namespace
        # Every key starts with the hash tag `{namespace}`: one slot on a Cluster, where
        # MGET and MULTI then work (docs/deployment.md, keys under one hash tag).
        self.prefix = "{" + config.namespace + "}"
        self._client_given = client is not None
        self._client = client or build_client(config)
        self._on_remote = on_remote
        self._lock = threading.Lock()
        self._storages: dict[str, Any] = {}
        self._workers: tuple[str, ...] = ()
        self._trials: set[str] = set()  # workers whose trial lease this process took
        self.trials_taken = 0
        self.trials_yielded = 0
        self.lease_margin = 1.0 + 2 * config.timeout
        """Seconds a trial lease outlasts its attempt's budget: for the result's write."""
        # The (state, opening time) last read from or written to Redis, per worker.
        self._seen: dict[str, tuple[str, float | None]] = {}
        self.on_resume: Callable[[], None] | None = None
        self._sink = _ErrorSink(self)
        self.available = True
        self.outages = 0
        self.last_error: str | None = None
        self.published = 0
        self.received = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stores: list[RedisDeadLetterStore] = []
        self._channel = f"{self.prefix}:breakers"
        self._origin = f"{id(self):x}-{time.time_ns():x}"
        self.eviction = EvictionPolicy(None)
        self.eviction_warnings = 0
        self.fleet_timeout = self.FLEET_TIMEOUT
        self._fleet_redis: Any = None
        self._fleet_stats: dict[str, Any] = {
            "written": 0,
            "write_failed": 0,
            "read": 0,
            "read_failed": 0,
            "streak": 0,
            "last_error": None,
        }
        # WAIT's own timeout stays under the socket's, which would take it for an outage.
        self.replication = ReplicatedWriter(self._client, self._channel, config.timeout / 2)
        self._check_credentials()
        if self.available and self._check_eviction():
            problem = self._check_replication()
            if problem is not None:
                self.lost(None, problem)

    def _check_credentials(self) -> None:
        """One PING at start: a wrong password, or a database number the server does not
        have, is the operator's to fix, not an outage to wait out; an unreachable server
        is an outage like any later one."""
        try:
            self._client.ping()
        except (AuthenticationError, ResponseError) as exc:
            text = str(exc)
            if isinstance(exc, AuthenticationError) or text.startswith(
                ("NOAUTH", "WRONGPASS", "NOPERM")
            ):
                refused = "the credentials"
            elif "DB index" in text:  # SELECT n, sent on connecting, beyond `databases`
                refused = "the database number"
            else:
                self.lost(exc)
                return
            with contextlib.suppress(RedisError):
                self._client.close()
            raise ConfigError(
                f"shared_state.url: Redis refused {refused} ({type(exc).__name__}: {scrub(text)})"
            ) from None
        except RedisError as exc:
            self.lost(exc)

    def _check_eviction(self) -> bool:
        """Read Redis's eviction policy (at start and whenever Redis answers again: it may
        have been restarted with another configuration); warn loudly and count when it
        may drop our keys. False when Redis did not answer."""
        try:
            policy = EvictionPolicy.read(self._client)
        except RedisError as exc:
            self.lost(exc)
            return False
        self.eviction = policy
        if policy.name is None:
            log.warning(
                "cannot read Redis's maxmemory-policy (CONFIG GET and INFO refused): make "
                "sure it is noeviction, or dead letters may vanish (docs/deployment.md)"
            )
        elif policy.risky:
            with self._lock:
                self.eviction_warnings += 1
            lost = (
                "dead letters and breaker states"
                if policy.evicts_records
                else ("replay claims and fleet snapshots")
            )
            log.warning(
                "Redis evicts keys when full (maxmemory-policy %s): %s stored there may "
                "vanish without an error. Set maxmemory-policy noeviction "
                "(docs/deployment.md, Redis requirements)",
                policy.name,
                lost,
            )
        return True

    def _check_replication(self) -> str | None:
        """Read whether the primary has replicas a dead letter must reach (at start, and
        whenever Redis answers again). What keeps Redis unavailable, or None: it did not
        answer, or is no longer the primary (a failover demoted it)."""
        try:
            if self.replication.check():
                return None
        except RedisError as exc:
            return scrub(f"{type(exc).__name__}: {exc}")
        return "the server is no longer the primary (a failover): waiting for the new one"

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Read every worker's shared breaker state now, then keep it in sync on the
        ``npu-sync-shared`` thread. The first read is made here, on the caller's
        thread, so the pool's first task already knows which workers are down."""
        if self.available:
            try:
                self._sync()
            except RedisError as exc:
                self.lost(exc)
        self._thread = threading.Thread(target=self._run, name="npu-sync-shared", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        if not self.available:
            self._probe()
        for store in self._stores:
            store.flush()
            held = store.held_count()
            if held:
                # Redis is still unreachable; the records are safe on disk.
                log.warning(
                    "%d dead letter(s) could not be written to Redis before closing; they "
                    "stay in %s and are written by the next process that finds Redis up",
                    held,
                    store.spool_path,
                )
        fleet = self._fleet_redis
        if fleet is not None and fleet is not self._client:
            fleet.close()
        self._client.close()

    def after_fork(self) -> None:
        """In a child process: fresh locks, no thread (``start()`` again), and nothing
        of the parent's held records, which the parent still writes itself. The Redis
        client's connection pool notices the new process id and reconnects."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        # The child speaks for itself: its own messages, claims and trial leases.
        self._origin = f"{id(self):x}-{time.time_ns():x}-{os.getpid():x}"
        self._trials = set()
        for store in self._stores:
            store.after_fork()

    def set_workers(self, worker_ids: Iterable[str]) -> None:
        with self._lock:
            self._workers = tuple(worker_ids)

    # -- availability --------------------------------------------------------------------

    def lost(self, error: BaseException | None, reason: str = "unknown error") -> None:
        """Redis failed: stop using it until the sync thread sees it answer again."""
        with self._lock:
            was = self.available
            self.available = False
            self.last_error = scrub(f"{type(error).__name__}: {error}") if error else reason
            if was:
                self.outages += 1
        if was:
            log.warning(
                "shared state unavailable (%s); each process uses its local state until "
                "Redis answers again",
                self.last_error,
            )

    def _call(self, fn: Callable[[], Any]) -> Any:
        if not self.available:
            return None
        try:
            return fn()
        except RedisError as exc:
            self.lost(exc)
            return None

    # -- breakers ------------------------------------------------------------------------

    def _storage(self, worker_id: str) -> Any:
        storage = self._storages.get(worker_id)
        if storage is None and self.available:
            try:
                storage = redis_storage(self._client, self._key(worker_id))
            except RedisError as exc:
                self.lost(exc)
                return None
            storage.logger = self._sink
            self._storages[worker_id] = storage
        return storage

    def _key(self, worker_id: str, field: str | None = None) -> str:
        base = f"{self.prefix}:worker:{worker_id}"
        return base if field is None else f"{base}:{field}"

    def take_trial(self, worker_id: str, budget: float) -> float | None:
        """Take the fleet's one half-open trial of a worker, as a lease in Redis.

        ``SET NX PX``: one process gets it, for ``budget`` seconds (the trial's attempt
        may run that long) plus :attr:`lease_margin`; the lease expires by itself if
        its holder dies. Its result reaches the others like any breaker change
        (:meth:`announce`, which also ends the lease).

        The lease is for the opening this process knows: if Redis already holds a
        newer decision (the trial of another process failed, and its new opening, or
        its closing, has not reached this process yet), that decision is applied here
        and no lease is taken. Otherwise a process a moment late would take the lease
        that trial just gave back and send a second trial in the same period.

        Returns:
            None when this process may send the trial: it holds the lease (taken now,
            or still its own), or Redis is unavailable (each process then tries on its
            own). Otherwise the seconds until the other holder's lease expires (0 when
            a newer decision was found and applied).
        """
        if not self.available:
            return None
        keys = self._breaker_keys(worker_id)
        key = keys["trial"]
        token = self._origin
        lease_ms = max(1, int((max(0.0, budget) + self.lease_margin) * 1000))
        newer: list[tuple[tuple[str, float | None], float | None]] = []

        def take(pipe: Any) -> None:
            # WATCH: the opening read is still the one in force when the lease is set.
            pipe.watch(keys["state"], keys["opened_at_precise"])
            state, opened, reset = pipe.mget(
                keys["state"], keys["opened_at_precise"], keys["reset_timeout"]
            )
            newer.clear()
            decided = self._newer_decision(worker_id, state, opened, reset)
            if decided is not None:
                newer.append(decided)
                return
            pipe.multi()
            pipe.set(key, token, nx=True, px=lease_ms)
            pipe.get(key)
            pipe.pttl(key)

        answer = self._call(lambda: self._client.transaction(take))
        if answer is None:
            return None  # Redis failed just now: a local trial, as in any outage
        if newer:
            (state, opened), reset_timeout = newer[0]
            with self._lock:
                self.trials_yielded += 1
            # Marked seen only now that it is applied: the re-read acts on changes only.
            self._seen[worker_id] = (state, opened)
            age = 0.0 if opened is None else max(0.0, time.time() - opened)
            self._on_remote(worker_id, state, age, reset_timeout)
            return 0.0
        taken, holder, ttl_ms = answer
        if not taken and holder == token.encode():
            # Ours still (a trial sent earlier was given back unsent): renewed.
            taken = self._call(lambda: self._client.pexpire(key, lease_ms)) is not None
        with self._lock:
            if taken:
                self._trials.add(worker_id)
                self.trials_taken += 1
            else:
                self.trials_yielded += 1
        if taken:
            return None
        ttl = int(ttl_ms) if ttl_ms is not None else -1
        # A lease without an expiry is not ours to wait on for ever: one budget.
        return ttl / 1000 if ttl >= 0 else lease_ms / 1000

    def _newer_decision(
        self, worker_id: str, state: Any, opened: Any, reset: Any
    ) -> tuple[tuple[str, float | None], float | None] | None:
        """``((state, opening time), reset_timeout)`` of a decision in Redis this process
        has not seen yet, or None."""
        if state is None:
            return None
        try:
            current = (state.decode(), float(opened) if opened else None)
            reset_timeout = float(reset) if reset else None
        except (ValueError, UnicodeDecodeError):
            return None
        seen = self._seen.get(worker_id)
        if current[0] == OPEN and current[1] is not None:
            if seen is not None and seen[0] == OPEN and current[1] <= (seen[1] or 0.0):
                return None
            return current, reset_timeout
        if current[0] == CLOSED and seen is not None and seen[0] == OPEN:
            return current, None
        return None

    def end_trial(self, worker_id: str) -> None:
        """Give back this process's trial lease unused (the trial was called off)."""
        if worker_id in self._trials:
            self._call(lambda: self._client.transaction(self._release_trial(worker_id)))

    def _release_trial(self, worker_id: str, then: Callable[[Any], None] | None = None) -> Any:
        """A WATCH transaction body: delete ``worker_id``'s trial lease if it is still
        ours (after it expired another process may hold it), then queue ``then``."""
        key = self._breaker_keys(worker_id)["trial"]
        token = self._origin.encode()

        def body(pipe: Any) -> None:
            pipe.watch(key)
            mine = pipe.get(key) == token
            pipe.multi()
            if then is not None:
                then(pipe)
            if mine:
                pipe.delete(key)
            with self._lock:
                self._trials.discard(worker_id)

        return body

    def announce(
        self, worker_id: str, state: str, reset_timeout: float | None, age: float = 0.0
    ) -> None:
        """Tell the other processes this process's breaker for a worker opened or closed.

        One MULTI writes the state with its opening time, so a reader never sees a new
        state with an old time; while Redis is unavailable nothing is sent at all.
        """
        if not self.available or self._storage(worker_id) is None:
            return
        now = time.time() - max(0.0, age)  # when it opened, for a breaker opened earlier
        keys = self._breaker_keys(worker_id)

        def queue(pipe: Any) -> None:
            if state == OPEN:
                pipe.mset(
                    {
                        keys["state"]: state,
                        keys["opened_at"]: str(int(now)),  # pybreaker's own, in seconds
                        keys["opened_at_precise"]: repr(now),
                        keys["reset_timeout"]: repr(reset_timeout or 0.0),
                    }
                )
            else:
                pipe.set(keys["state"], state)
            pipe.publish(self._channel, message)

        def write() -> Any:
            if worker_id in self._trials:
                # The end of this process's trial: its result and the lease's end in
                # one transaction, so the next trial waits for the next reset time.
                return self._client.transaction(self._release_trial(worker_id, queue))
            pipe = self._client.pipeline(transaction=True)
            queue(pipe)
            return pipe.execute()

        message = json.dumps(
            {
                "origin": self._origin,
                "worker": worker_id,
                "state": state,
                "at": now,
                "reset_timeout": reset_timeout,
            }
        )
        if self._call(write) is not None:
            self.published += 1
            self._seen[worker_id] = (state, now if state == OPEN else None)

    def _breaker_keys(self, worker_id: str) -> dict[str, str]:
        """pybreaker's CircuitRedisStorage key names for a worker, plus ours."""
        pybreaker_ns = f"{self._key(worker_id)}:pybreaker"
        return {
            "state": f"{pybreaker_ns}:state",
            "opened_at": f"{pybreaker_ns}:opened_at",
            "opened_at_precise": self._key(worker_id, "opened_at_precise"),
            "reset_timeout": self._key(worker_id, "reset_timeout"),
            "trial": self._key(worker_id, "trial"),
        }

    # -- the sync thread -----------------------------------------------------------------

    def _run(self) -> None:
        pubsub = None
        next_sync = 0.0
        while not self._stop.is_set():
            if not self.available:
                if pubsub is not None:
                    pubsub.close()
                    pubsub = None
                if self._stop.wait(self.config.sync_interval):
                    break
                if self._probe():
                    next_sync = 0.0
                continue
            try:
                if pubsub is None:
                    pubsub = self._client.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(self._channel)
                message = pubsub.get_message(timeout=0.1)
                if message is not None:
                    self._handle(message)
                if time.monotonic() >= next_sync:
                    if primary_moved(self._client, pubsub):
                        # Reads and pub/sub would go on with the old primary unnoticed.
                        self.lost(None, "the sentinels name another primary (a failover)")
                        continue
                    if self.replication.stale:
                        # Here, not on a task's write: a replica joined or left, or a
                        # write no replica confirmed.
                        problem = self._check_replication()
                        if problem is not None:
                            self.lost(None, problem)
                            continue
                    self._sync()
                    self._flush_stores()
                    next_sync = time.monotonic() + self.config.sync_interval
            except RedisError as exc:
                self.lost(exc)
            except Exception:  # never let the thread die
                log.exception("shared state sync failed")
                self._stop.wait(self.config.sync_interval)
        if pubsub is not None:
            with contextlib.suppress(RedisError):
                pubsub.close()

    def _probe(self) -> bool:
        # A fresh connection each probe: behind Sentinel it goes to the primary the
        # sentinels name now, not to one a failover demoted.
        reconnect(self._client)
        try:
            self._client.ping()
        except RedisError:
            return False
        # The policy before anything is written: Redis may be back with another
        # configuration, one that may evict the dead letters spooled meanwhile.
        if not self._check_eviction():
            return False
        # And whether it is still the primary, and has replicas a dead letter must reach.
        problem = self._check_replication()
        if problem is not None:
            with self._lock:
                self.last_error = problem
            return False
        with self._lock:
            self.available = True
        log.warning("shared state available again: sharing resumes")
        if self.on_resume is not None:
            # Breakers opened here during the outage were never written: write them now,
            # before reading, so the re-read does not close them again.
            self.on_resume()
        return True

    def _handle(self, message: dict[str, Any]) -> None:
        try:
            data = json.loads(message["data"])
            if data.get("origin") == self._origin:
                return
            worker, state = str(data["worker"]), str(data["state"])
            age = max(0.0, time.time() - float(data["at"]))
            reset = data.get("reset_timeout")
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring a malformed shared-state message: %r", message.get("data"))
            return
        self.received += 1
        # The re-read must not take this same change for a new one.
        self._seen[worker] = (state, float(data["at"]) if state == OPEN else None)
        self._on_remote(worker, state, age, None if reset is None else float(reset))

    def _sync(self) -> None:
        """Re-read every worker's shared state: catches changes whose message was missed."""
        workers = self._workers
        if not workers:
            return
        keys: list[str] = []
        for worker in workers:
            if self._storage(worker) is None:
                return
            k = self._breaker_keys(worker)
            keys += [k["state"], k["opened_at_precise"], k["reset_timeout"]]
        values: list[Any] = self._client.mget(keys)
        now = time.time()
        for i, worker in enumerate(workers):
            try:
                state, opened, reset = values[3 * i : 3 * i + 3]
                if state is None:
                    continue
                current = (state.decode(), float(opened) if opened else None)
                reset_timeout = float(reset) if reset else None
            except (ValueError, UnicodeDecodeError):
                log.warning("ignoring malformed shared state of worker %s", worker)
                continue
            # Edge-triggered: act only on what changed in Redis since the last read, so a
            # breaker this process opened a moment ago (not yet written) is not undone.
            previous = self._seen.get(worker)
            self._seen[worker] = current
            if current == previous:
                continue
            if current[0] == OPEN and current[1] is not None:
                self._on_remote(worker, "open", max(0.0, now - current[1]), reset_timeout)
            elif current[0] == CLOSED and previous is not None and previous[0] == OPEN:
                self._on_remote(worker, "closed", 0.0, None)

    # -- the fleet view -----------------------------------------------------------------
    #
    # Snapshots are bookkeeping, not coordination: they go through a client of their
    # own, with a timeout of their own (``fleet.timeout``, longer than the breakers'),
    # and a snapshot that is late or refused is counted (``stats()["fleet_snapshots"]``)
    # but never taken for an outage: only the breaker and dead-letter paths decide
    # that Redis is down. So one slow write at the instant every process writes, or a
    # read of a fleet full of oversized members, never stops this process sharing
    # its breakers.

    FLEET_TIMEOUT = 1.0
    """Seconds a snapshot write or read may take, unless the fleet settings say."""

    def _fleet_client(self) -> Any:
        """The client snapshot traffic uses: the same server and credentials as the
        shared state's, on connections of its own with ``fleet_timeout``."""
        with self._lock:
            fleet = self._fleet_redis
            if fleet is None:
                if self._client_given:  # a test's client: snapshots share it
                    fleet = self._client
                else:  # one server, a Sentinel's primary or a Cluster, as configured
                    fleet = build_client(self.config, timeout=self.fleet_timeout)
                self._fleet_redis = fleet
            return fleet

    def _fleet_failed(self, action: str, error: BaseException) -> None:
        with self._lock:
            counts = self._fleet_stats
            counts[action] += 1
            streak = counts["streak"]
            counts["streak"] = streak + 1
            counts["last_error"] = scrub(f"{type(error).__name__}: {error}")
        if streak == 0:
            log.warning(
                "a fleet snapshot %s failed (%s): counted, not taken for a Redis outage; "
                "breakers are still shared",
                action.partition("_")[0],
                counts["last_error"],
            )

    def _fleet_ok(self, action: str) -> None:
        with self._lock:
            counts = self._fleet_stats
            counts[action] += 1
            counts["streak"] = 0

    def publish_snapshot(self, member: str, payload: str, ttl: float) -> bool:
        """Store this process's pool snapshot for ``ttl`` seconds and list it in the
        fleet's index; False while Redis is unavailable (nothing is sent then) or when
        the write failed (counted in ``stats()["fleet_snapshots"]``, not an outage).

        Called by the fleet monitor's thread only, never by a task.
        """
        if not self.available:
            return False
        key = self._fleet_key(member)
        client = self._fleet_client()
        try:
            pipe = client.pipeline(transaction=False)
            pipe.set(key, payload, px=max(1, int(ttl * 1000)))
            pipe.zadd(self._fleet_index, {member: time.time()})
            pipe.execute()
        except RedisError as exc:
            self._fleet_failed("write_failed", exc)
            return False
        self._fleet_ok("written")
        return True

    def withdraw_snapshot(self, member: str) -> None:
        """Remove this process from the fleet at once (its pool is closing). A failure
        is counted, not an outage: the snapshot then expires on its own."""
        if not self.available:
            return
        try:
            pipe = self._fleet_client().pipeline(transaction=False)
            pipe.delete(self._fleet_key(member))
            pipe.zrem(self._fleet_index, member)
            pipe.execute()
        except RedisError as exc:
            self._fleet_failed("write_failed", exc)

    READ_BATCH = 16
    """Snapshots fetched per round trip: a read of many members is many short replies,
    none of which can run into the timeout on its own."""

    def read_snapshots(
        self,
        stale_after: float,
        *,
        limit: int,
        max_bytes: int,
        budget: int | None = None,
    ) -> dict[str, Any] | None:
        """The snapshots of the ``limit`` most recently published processes; None while
        Redis is unavailable or when the read failed (counted, not an outage).

        Returns a mapping with:

        - ``entries``: ``(member, snapshot text)`` of each live process, newest first;
        - ``silent``: ``(member, last published, epoch seconds)`` of each process still
          in the index whose snapshot has expired: it stopped publishing without
          closing its pool (killed, hung, cut off from Redis);
        - ``oversized``: members whose snapshot is over ``max_bytes``, left unread;
        - ``malformed``: members whose key holds something other than a string;
        - ``unread``: index entries not read (beyond ``limit``, or past ``budget``).

        Index entries not refreshed for ``stale_after`` seconds are pruned. A snapshot's
        size is asked first (``STRLEN``) and at most ``max_bytes`` of it is read, and
        reading stops once ``budget`` bytes are read in all, so a namespace filled with
        garbage costs a reader no more than that. A key of another type under a
        snapshot's name is left out too.
        """
        if not self.available:
            return None
        client = self._fleet_client()
        index = self._fleet_index
        spend = budget if budget is not None else max_bytes * limit
        try:
            pipe = client.pipeline(transaction=False)
            pipe.zremrangebyscore(index, "-inf", time.time() - stale_after)
            pipe.zcard(index)
            pipe.zrevrange(index, 0, limit - 1, withscores=True)
            _, total, members = pipe.execute()
            listed = [(m.decode("utf-8", "replace"), float(score)) for m, score in members]
            entries: list[tuple[str, str]] = []
            silent: list[tuple[str, float]] = []
            oversized: list[str] = []
            malformed: list[str] = []
            spent = 0
            done = 0
            for start in range(0, len(listed), self.READ_BATCH):
                if spent >= spend:
                    break
                batch = listed[start : start + self.READ_BATCH]
                pipe = client.pipeline(transaction=False)
                for name, _ in batch:
                    pipe.strlen(self._fleet_key(name))
                sizes = pipe.execute(raise_on_error=False)
                pipe = client.pipeline(transaction=False)
                wanted = []
                for (name, seen), size in zip(batch, sizes, strict=True):
                    if not isinstance(size, int):
                        malformed.append(name)  # not a string: nothing of ours wrote it
                        continue
                    if size == 0:
                        silent.append((name, seen))
                    elif size > max_bytes:
                        oversized.append(name)
                    else:
                        wanted.append(name)
                        pipe.getrange(self._fleet_key(name), 0, max_bytes)
                values = pipe.execute(raise_on_error=False) if wanted else []
                for name, value in zip(wanted, values, strict=True):
                    if not isinstance(value, bytes) or not value:
                        continue  # expired between the two round trips
                    if len(value) > max_bytes:
                        oversized.append(name)  # grew between the two round trips
                        continue
                    spent += len(value)
                    entries.append((name, value.decode("utf-8", "replace")))
                done += len(batch)
        except RedisError as exc:
            self._fleet_failed("read_failed", exc)
            return None
        self._fleet_ok("read")
        return {
            "entries": entries,
            "silent": silent,
            "oversized": oversized,
            "malformed": malformed,
            "unread": max(0, int(total) - done),
        }

    def fleet_stats(self) -> dict[str, Any]:
        """Counts of snapshot writes and reads, failed ones included."""
        with self._lock:
            counts = dict(self._fleet_stats)
        counts.pop("streak")
        return counts

    @property
    def _fleet_index(self) -> str:
        return f"{self.prefix}:fleet:index"

    def _fleet_key(self, member: str) -> str:
        return f"{self.prefix}:fleet:process:{member}"

    # -- dead letters --------------------------------------------------------------------

    def dead_letter_store(
        self, max_records: int, *, spool_path: str | None = None
    ) -> RedisDeadLetterStore:
        """The shared dead-letter store, spooling beside ``spool_path`` (default
        :func:`~npu_sync._deadletter.default_spool_path`) while Redis is away.

        Raises:
            ConfigError: the spool file cannot be opened or created, naming
                ``dead_letter.spool_path``.
        """
        store = RedisDeadLetterStore(self, max_records=max_records, spool_path=spool_path)
        self._stores.append(store)
        return store

    def _flush_stores(self) -> None:
        for store in self._stores:
            store.flush()

    def stats(self) -> dict[str, Any]:
        return {
            "backend": "redis",
            "available": self.available,
            "outages": self.outages,
            "last_error": self.last_error,
            "published": self.published,
            "received": self.received,
            "trials_taken": self.trials_taken,
            "trials_yielded": self.trials_yielded,
            "dead_letters_held_locally": sum(s.held_count() for s in self._stores),
            "eviction_policy": self.eviction.name,
            "eviction_warnings": self.eviction_warnings,
            "fleet_snapshots": self.fleet_stats(),
        }


class RedisDeadLetterStore:
    """Dead letters in Redis, shared by every process. Thread-safe.

    Records are a hash (``<ns>:dlq:records``, id → JSON) ordered by a sorted set
    (``<ns>:dlq:order``). While Redis cannot take a record it goes to the *spool*, a
    local SQLite file of this process's own (:class:`~npu_sync._spool.ProcessSpool`),
    and is written to Redis once it is back, by this process or, once it has ended,
    any other of the same app: a Redis outage loses no record, not even if the
    process is killed meanwhile. ``claim``/``release_claim`` give a
    replay exclusive use of a record across processes, with a lease that expires if
    the process dies mid-replay; the release deletes the claim only if it is still
    this process's, atomically (WATCH/MULTI).

    Raises:
        ConfigError: the spool file cannot be opened or created.
    """

    CLAIM_SECONDS = CLAIM_SECONDS
    FLUSH_WAIT = 10.0
    """Seconds a listing waits for a flush under way (an operator's call, never a task's)."""

    def __init__(
        self, shared: SharedState, *, max_records: int = 10000, spool_path: str | None = None
    ) -> None:
        self._shared = shared
        self._client = shared._client
        ns = shared.namespace
        self._records = f"{shared.prefix}:dlq:records"
        self._order = f"{shared.prefix}:dlq:order"
        self._dropped_key = f"{shared.prefix}:dlq:dropped"
        self._claims = f"{shared.prefix}:dlq:claim:"
        # Where versions before the hash tag kept them: moved here by flush().
        self._old_records, self._old_order = f"{ns}:dlq:records", f"{ns}:dlq:order"
        self._old_checked = False
        self._max = max_records
        self._lock = threading.Lock()
        # One flush at a time per store (the sync thread, close(), a listing): taken
        # without waiting, never waited on, so a task's add() never waits behind it.
        self._flushing = threading.Lock()
        self._legacy: SQLiteDeadLetterStore | None = None
        try:
            base = spool_path or default_base(ns, shared.config.url)
            self._spool = ProcessSpool(base, max_records=max_records)
            if spool_path is not None and os.path.exists(spool_path):
                # The one file every process of a host shared before: its records are
                # moved to Redis like any spool's, claimed one by one.
                self._legacy = SQLiteDeadLetterStore(spool_path, max_records=max_records)
        except (OSError, NpuSyncError) as exc:
            raise ConfigError(f"dead_letter.spool_path: {exc}") from exc

    @property
    def spool_path(self) -> str:
        """This process's own spool file."""
        return self._spool.own.path

    def after_fork(self) -> None:
        """In a child process: fresh locks and a spool file of its own."""
        self._lock = threading.Lock()
        self._flushing = threading.Lock()
        self._spool.after_fork()
        if self._legacy is not None:
            self._legacy.after_fork()

    def held_count(self) -> int:
        """Records waiting in this process's spool for Redis (the last known number if busy)."""
        return self._spool.own.store.counts()[0] or 0

    def _write(self, record: DeadLetter) -> None:
        """Store one record, durably: on the primary and, when it has replicas, on one.

        Raises:
            NotReplicated: no replica confirmed it (it is to stay spooled).
            RedisError: Redis failed.
        """
        replication = self._shared.replication
        if not replication.known:
            # Checking takes a round trip or two (INFO, the sentinels) a task out of time
            # cannot spare: the record waits in the spool for the sync thread's check.
            raise NotReplicated("whether a replica must confirm it is not known yet")
        body = json.dumps(record.to_dict())
        count = replication.write(self._records, self._order, record.id, body, record.created_at)
        excess = int(count) - self._max
        if excess > 0:
            oldest: list[Any] = self._client.zpopmin(self._order, excess)
            ids = [member for member, _ in oldest]
            if ids:
                self._client.hdel(self._records, *ids)
                self._client.incrby(self._dropped_key, len(ids))
                log.warning("dead-letter store full: evicted %d oldest record(s)", len(ids))

    def add(self, record: DeadLetter, *, timeout: float | None = None) -> None:
        """Write ``record`` to Redis, or to the spool while Redis is unavailable.

        Raises:
            NpuSyncError: Redis is unavailable and the spool could not take the record
                within ``timeout`` seconds.
        """
        if self._keeps_records():
            try:
                self._write(record)
                return
            except NotReplicated:
                pass  # on the primary alone: kept here too until a replica has it
            except RedisError as exc:
                self._shared.lost(exc)
        self._spool.own.store.add(record, timeout=timeout)

    def _keeps_records(self) -> bool:
        """Redis answers and keeps what it is given. A Redis that came back (or first
        answered) after the pool started with an ``allkeys-*`` policy gets no record:
        they stay spooled, as in an outage, until it is ``noeviction``."""
        return self._shared.available and not self._shared.eviction.evicts_records

    def flush(self, batch: int = 100, *, wait: float = 0.0) -> None:
        """Move spooled records to Redis, oldest first: this process's own, then those of
        processes that ended (their files are deleted once empty). Called by the sync
        thread, by ``close()`` and before a listing; one call at a time per store: a
        second one waits up to ``wait`` seconds for the first to end, then returns.

        A record is removed from a spool only once Redis has it, so a process killed in
        between leaves it in both: whoever moves it next writes it again under the same
        id, which Redis keeps once.
        """
        if not self._flushing.acquire(timeout=wait):
            return
        try:
            if not self._move_all(self._spool.own.store, batch):
                return
            if not self._old_checked and not self._move_old_keys(batch):
                return
            for orphan in self._spool.orphans():
                try:
                    moved = self._move_all(orphan.store, batch)
                finally:
                    deleted = orphan.discard_if_empty()
                if deleted:
                    log.info("moved the dead letters of ended process spool %s", orphan.path)
                if not moved:
                    return
            if self._legacy is not None:
                self._flush_shared(self._legacy, batch)
        finally:
            self._flushing.release()

    def _move_old_keys(self, batch: int) -> bool:
        """Move the records kept under the keys of versions before the hash tag
        (``<ns>:dlq:…``) to today's (``{<ns>}:dlq:…``), once per process, each written
        durably before it is removed from the old keys; False when Redis failed."""
        while self._keeps_records():
            try:
                ids = self._client.zrange(self._old_order, 0, batch - 1)
                if not ids:
                    self._old_checked = True
                    return True
                for record_id in ids:
                    raw = self._client.hget(self._old_records, record_id)
                    try:
                        record = None if raw is None else DeadLetter.from_dict(json.loads(raw))
                    except (ValueError, TypeError, KeyError):
                        log.error(
                            "a dead letter under the old key %s cannot be read: left there",
                            self._old_records,
                        )
                        record = None
                    if record is not None:
                        self._write(record)
                        self._client.hdel(self._old_records, record_id)
                    self._client.zrem(self._old_order, record_id)
                log.info("moved %d dead letter(s) from the keys of earlier versions", len(ids))
            except NotReplicated:
                return False
            except RedisError as exc:
                self._shared.lost(exc)
                return False
        return False

    def _move_all(self, spool: SQLiteDeadLetterStore, batch: int) -> bool:
        """Move every record of a spool only this process uses; False when Redis failed.

        The records Redis took are removed from the spool together, in one transaction
        per batch: a commit for each would hold the spool, one ``fsync`` after another,
        while tasks failing meanwhile wait to spool their own records.

        A spool that cannot be read (a corrupt file an ended process left) is named in
        an ERROR and left where it is; it does not stop the moving of the others."""
        while self._keeps_records():
            try:
                waiting = spool.list(limit=batch)
            except (NpuSyncError, sqlite3.Error, ValueError):
                log.exception("cannot read the dead-letter spool %s", spool.path)
                return True
            if not waiting:
                return True
            moved: list[str] = []
            redis_up = True
            for record in waiting:
                try:
                    self._write(record)
                except NotReplicated:
                    redis_up = False  # tried again at the next flush
                    break
                except RedisError as exc:
                    self._shared.lost(exc)
                    redis_up = False
                    break
                moved.append(record.id)
            try:
                spool.remove_many(moved)
            except (NpuSyncError, sqlite3.Error):
                # Redis has them; written again, under the same ids, by a later move.
                log.exception("cannot remove moved records from spool %s", spool.path)
                return True
            if not redis_up:
                return False
        return False

    def _flush_shared(self, spool: SQLiteDeadLetterStore, batch: int) -> None:
        """Move the records of a spool file other processes may be moving too (the
        shared file of earlier versions): each is claimed in the file first, so none is
        written twice (and resurrected after a replay removed it)."""
        skipped = 0  # records another process is moving: passed over, not waited for
        while self._keeps_records():
            try:
                waiting = spool.list(limit=batch, offset=skipped)
            except NpuSyncError:
                log.exception("cannot read the dead-letter spool %s", spool.path)
                return
            if not waiting:
                return
            for record in waiting:
                moved = self._flush_one(spool, record.id)
                if moved is None:
                    return
                if not moved:
                    skipped += 1

    def _flush_one(self, spool: SQLiteDeadLetterStore, record_id: str) -> bool | None:
        """Move one spooled record to Redis: True when moved (by us or already by
        another process), False when another process holds it, None when Redis failed."""
        if not spool.claim(record_id):
            return False
        try:
            record = spool.get(record_id)
            if record is None:
                return True  # moved already
            try:
                self._write(record)
            except NotReplicated:
                return None
            except RedisError as exc:
                self._shared.lost(exc)
                return None
            spool.remove(record_id)
            return True
        finally:
            spool.release_claim(record_id)

    def _strict(self, fn: Callable[[], Any]) -> Any:
        """Operator calls (list, remove, purge …) fail loudly while Redis is away:
        answering from this process's few held records would mislead."""
        if not self._shared.available:
            raise NpuSyncError(
                f"shared state unavailable ({self._shared.last_error}): dead letters in "
                "Redis cannot be read or changed now"
            )
        policy = self._shared.eviction
        if policy.evicts_records:
            raise NpuSyncError(
                f"Redis may evict dead letters (maxmemory-policy {policy.name}): they are "
                "kept in the spool files until it is noeviction (docs/deployment.md, "
                "Redis requirements)"
            )
        try:
            return fn()
        except RedisError as exc:
            self._shared.lost(exc)
            raise NpuSyncError(f"shared state unavailable ({exc})") from exc

    def get(self, record_id: str) -> DeadLetter | None:
        spooled = self._spool.own.store.get(record_id)
        if spooled is not None:
            return spooled
        raw = self._strict(lambda: self._client.hget(self._records, record_id))
        return None if raw is None else DeadLetter.from_dict(json.loads(raw))

    def list(self, *, limit: int | None = None, offset: int = 0) -> builtins.list[DeadLetter]:
        """Records in Redis, oldest first, after moving there what the spools of this
        process and of ended ones hold, so a record is listed once, from Redis. A flush
        already under way (the sync thread's) is waited for, up to ``FLUSH_WAIT``."""
        self.flush(wait=self.FLUSH_WAIT)
        end = -1 if limit is None else offset + limit - 1
        ids = self._strict(lambda: self._client.zrange(self._order, offset, end)) or []
        if not ids:
            return []
        raws = self._strict(lambda: self._client.hmget(self._records, ids)) or []
        return [DeadLetter.from_dict(json.loads(r)) for r in raws if r is not None]

    def replace(self, record: DeadLetter) -> None:
        def write() -> None:
            # Only a record still stored: one removed meanwhile stays removed.
            if self._client.zscore(self._order, record.id) is not None:
                self._client.hset(self._records, record.id, json.dumps(record.to_dict()))

        self._strict(write)

    def remove(self, record_id: str) -> bool:
        held = self._spool.own.store.remove(record_id)

        def drop() -> bool:
            pipe = self._client.pipeline(transaction=True)
            pipe.zrem(self._order, record_id)
            pipe.hdel(self._records, record_id)
            return bool(pipe.execute()[1])

        return bool(self._strict(drop)) or held

    def purge(self) -> int:
        def drop() -> int:
            pipe = self._client.pipeline(transaction=True)
            pipe.zcard(self._order)
            pipe.delete(self._order, self._records)
            return int(pipe.execute()[0])

        removed = int(self._strict(drop) or 0)
        return removed + self._spool.own.store.purge()

    def __len__(self) -> int:
        return int(self._strict(lambda: self._client.zcard(self._order)) or 0) + len(
            self._spool.own.store
        )

    @property
    def dropped(self) -> int:
        stored = self._strict(lambda: self._client.get(self._dropped_key))
        return int(stored or 0) + self._spool.own.store.dropped

    def counts(self) -> tuple[int | None, int | None]:
        """``(records, dropped)`` for ``stats()``: one short Redis round trip while it is
        available (bounded by ``shared_state.timeout``), the spool alone otherwise."""
        spooled, spool_dropped = self._spool.own.store.counts()
        if not self._shared.available:
            return None, None
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.zcard(self._order)
            pipe.get(self._dropped_key)
            records, dropped = pipe.execute()
        except RedisError as exc:
            self._shared.lost(exc)
            return None, None
        return int(records) + (spooled or 0), int(dropped or 0) + (spool_dropped or 0)

    def claim(self, record_id: str, *, run_time: float = 0.0) -> bool:
        """Claim a record for one replay across processes, for ``run_time`` seconds (how
        long the replay may run) plus ``CLAIM_SECONDS``."""
        key = self._claims + record_id
        owner = self._shared._origin
        lease_ms = int((self.CLAIM_SECONDS + max(0.0, run_time)) * 1000)
        ok = self._strict(lambda: self._client.set(key, owner, nx=True, px=lease_ms))
        return bool(ok)

    def release_claim(self, record_id: str) -> None:
        key = self._claims + record_id
        owner = self._shared._origin.encode()

        def compare_and_delete(pipe: Any) -> None:
            # Only our own claim: after a lease ran out another process may hold it.
            # WATCH makes the check and the delete one step: should the key change in
            # between, EXEC fails and redis-py runs this again.
            if pipe.get(key) == owner:
                pipe.multi()
                pipe.delete(key)

        self._shared._call(lambda: self._client.transaction(compare_and_delete, key))

    def close(self) -> None:
        """Close the spool, deleting this process's file when empty (one holding records
        is left for the next process, or ``npu-sync dlq``, to move). The connection
        belongs to the shared state, which closes it."""
        self._spool.close()
        if self._legacy is not None:
            self._legacy.close()
