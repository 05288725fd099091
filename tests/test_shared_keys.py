"""Key names under one hash tag, the move of dead letters from the keys of earlier
versions, the durable write's replica rule and the Cluster pipeline (npu_sync._shared,
npu_sync._redis_client)."""

from __future__ import annotations

import json

import pytest

fakeredis = pytest.importorskip("fakeredis")
redis = pytest.importorskip("redis")

from npu_sync import _redis_url  # noqa: E402
from npu_sync._deadletter import DeadLetter  # noqa: E402
from npu_sync._redis_client import (  # noqa: E402
    ClusterClient,
    NotReplicated,
    ReplicatedWriter,
    SlotPipeline,
)
from npu_sync._shared import SharedState  # noqa: E402
from npu_sync.config import SharedStateConfig  # noqa: E402
from npu_sync.task import Attempt, Task  # noqa: E402


@pytest.fixture(autouse=True)
def private_temp_dir(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def state(server, namespace: str = "app") -> SharedState:
    config = SharedStateConfig(backend="redis", namespace=namespace)
    return SharedState(config, lambda *a: None, client=fakeredis.FakeRedis(server=server))


def record(n: int) -> DeadLetter:
    task = Task({"n": n}, task_id=f"task-{n}")
    return DeadLetter.from_task(
        task, endpoint="/inference", error="down", attempts=[Attempt("w", "x", 0.1)], now=1000.0 + n
    )


def test_every_key_of_a_namespace_carries_its_hash_tag():
    """Breakers, claims, records, the fleet and the channel: all `{namespace}:…`, one slot."""
    server = fakeredis.FakeServer()
    shared = state(server)
    shared.set_workers(["w1"])
    store = shared.dead_letter_store(10)
    first = record(1)
    store.add(first)
    assert store.claim(first.id)
    assert shared.take_trial("w1", 1.0) is None  # this process holds the lease
    shared.announce("w1", "open", 30.0)
    assert shared.publish_snapshot("m1", "{}", 10)
    keys = {k.decode() for k in fakeredis.FakeRedis(server=server).keys("*")}
    assert keys and all(k.startswith("{app}:") for k in keys), keys
    assert shared._channel == "{app}:breakers"
    store.close()
    shared.stop()


def test_dead_letters_under_the_keys_of_earlier_versions_are_moved_once_and_listed():
    """Records an earlier version stored as `<ns>:dlq:…` are moved to `{<ns>}:dlq:…` by
    the first flush, each written before it leaves the old keys; a corrupt one stays."""
    server = fakeredis.FakeServer()
    old = fakeredis.FakeRedis(server=server)
    records = [record(n) for n in (1, 2, 3)]
    for r in records:
        old.hset("app:dlq:records", r.id, json.dumps(r.to_dict()))
        old.zadd("app:dlq:order", {r.id: r.created_at})
    old.hset("app:dlq:records", "broken", "{not json")
    old.zadd("app:dlq:order", {"broken": 1.0})
    shared = state(server)
    store = shared.dead_letter_store(10)
    listed = [r.id for r in store.list()]
    assert listed == [r.id for r in records]
    assert old.zcard("app:dlq:order") == 0
    assert old.hkeys("app:dlq:records") == [b"broken"]  # left for an operator to read
    assert store._old_checked
    assert [r.id for r in store.list()] == listed  # moved once, listed once
    store.close()
    shared.stop()


class FakeNode:
    """A client whose pipeline answers like Redis does, WAIT included."""

    def __init__(self, acks: int) -> None:
        self.acks = acks
        self.sent: list[tuple[object, ...]] = []

    def pipeline(self, transaction: bool = True) -> FakeNode:
        assert transaction is False  # MULTI, EXEC and WAIT are sent as plain commands
        return self

    def execute_command(self, *args: object) -> None:
        self.sent.append(args)

    def execute(self) -> list[object]:
        names = [a[0] for a in self.sent]
        replies: list[object] = [b"OK", b"QUEUED", b"QUEUED", b"QUEUED", [1, 1, 7]]
        if "WAIT" in names:
            replies.append(self.acks)
        return replies

    def info(self, section: str) -> dict[str, object]:
        return {"role": "master", "connected_slaves": 1}


def test_a_write_no_replica_confirms_is_not_acknowledged():
    """With a replica expected, WAIT answering 0 raises NotReplicated; 1 returns the count."""
    node = FakeNode(acks=0)
    writer = ReplicatedWriter(node, "{app}:breakers", 0.1)
    assert writer.check() and writer.replicas == 1
    with pytest.raises(NotReplicated):
        writer.write("{app}:dlq:records", "{app}:dlq:order", "r1", "{}", 1.5)
    assert writer.stale  # checked again before the next write
    assert [a[0] for a in node.sent] == ["MULTI", "HSET", "ZADD", "ZCARD", "EXEC", "WAIT"]
    assert node.sent[-1] == ("WAIT", 1, 100)
    node.sent.clear()
    node.acks = 1
    assert writer.write("{app}:dlq:records", "{app}:dlq:order", "r1", "{}", 1.5) == 7


def test_the_store_keeps_a_record_no_replica_confirmed_in_its_spool(monkeypatch):
    """add() spools a record WAIT did not confirm, and flush() keeps it there until one does."""
    server = fakeredis.FakeServer()
    shared = state(server)
    store = shared.dead_letter_store(10)
    confirmed = {"now": False}

    def write(records, order, record_id, body, at):
        if not confirmed["now"]:
            raise NotReplicated("no replica")
        return 1

    monkeypatch.setattr(shared.replication, "write", write)
    store.add(record(1))
    assert store.held_count() == 1 and shared.available
    store.flush()
    assert store.held_count() == 1
    confirmed["now"] = True
    store.flush()
    assert store.held_count() == 0
    store.close()
    shared.stop()


class FakeClusterPipeline:
    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def set(self, key: str, value: object) -> None:
        self.calls.append(("SET", key, value))

    def incr(self, key: str) -> None:
        self.calls.append(("INCR", key))

    def execute(self, raise_on_error: bool = True) -> list[object]:
        return [True for _ in self.calls]


def test_a_cluster_pipeline_takes_mset_inside_the_multi_and_publishes_after_it():
    """MSET becomes SETs in the transaction; PUBLISH goes out once it has run."""
    target = _redis_url.parse("redis+cluster://127.0.0.1:7000")
    client = ClusterClient(target, {})
    order: list[str] = []
    inner = FakeClusterPipeline()
    client.publish = lambda channel, message: order.append(f"publish {channel}") or 2  # type: ignore[method-assign]
    pipe = SlotPipeline(inner, client)
    pipe.mset({"{a}:x": 1, "{a}:y": 2})
    pipe.publish("{a}:breakers", "m")
    pipe.incr("{a}:z")  # anything else goes to the cluster pipeline as it is
    assert order == []  # nothing published before the transaction ran
    assert pipe.execute() == [True, True, True, 2]
    assert inner.calls == [("SET", "{a}:x", 1), ("SET", "{a}:y", 2), ("INCR", "{a}:z")]
    assert order == ["publish {a}:breakers"]


class NamedPrimary:
    """Stands in for redis.sentinel.Sentinel: names a primary, which a test moves."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address

    def discover_master(self, service: str) -> tuple[str, int]:
        return self.address


class Sentinels(NamedPrimary):
    """Sentinels naming one primary and listing its replicas; ``silent`` makes every
    one of them fail to answer (busy, or failing over)."""

    def __init__(self, address: tuple[str, int], replicas: int) -> None:
        super().__init__(address)
        self.silent = False
        outer = self

        class One:
            def sentinel_slaves(self, service: str) -> list[dict[str, object]]:
                if outer.silent:
                    raise redis.exceptions.TimeoutError("Timeout reading from socket")
                return [
                    {"is_sdown": False, "role-reported": "slave", "master-link-status": "ok"}
                ] * replicas

        self.sentinels = [One(), One(), One()]


@pytest.mark.parametrize("connected", [0, 1])
def test_sentinels_that_do_not_answer_never_turn_an_expected_replica_into_none(
    monkeypatch, connected
):
    """The writer expected a replica; at its next check no sentinel answers. It must go
    on waiting for a replica (a write WAIT does not confirm stays spooled), whatever
    the old primary's own count says: before, silence read as "no replica", so records
    were acknowledged on the primary alone just as a failover was replacing it."""
    address = ("10.0.0.1", 6379)
    sentinels = Sentinels(address, replicas=1)
    client = fakeredis.FakeRedis()
    client.npu_sync_sentinel = (sentinels, "mymaster")
    info = {"role": "master", "connected_slaves": str(connected)}
    monkeypatch.setattr(
        ReplicatedWriter, "_info_of_connection", staticmethod(lambda pool: (info, address))
    )
    writer = ReplicatedWriter(client, "{app}:breakers", 0.1)
    assert writer.check() and writer.replicas == 1
    sentinels.silent = True
    assert writer.check() and writer.replicas == 1
    # With nothing expected before, the primary's own count decides.
    fresh = ReplicatedWriter(client, "{app}:breakers", 0.1)
    assert fresh.check() and fresh.replicas == connected


def test_a_process_that_only_reads_notices_a_failover_at_its_next_sync():
    """The sentinels naming another primary is an outage at the next re-read, so the
    sync thread reconnects instead of reading the old primary until it is demoted."""
    import threading
    import time

    server = fakeredis.FakeServer()
    client = fakeredis.FakeRedis(server=server)
    named = NamedPrimary(("10.0.0.1", 6379))
    client.npu_sync_sentinel = (named, "mymaster")
    client.connection_pool.master_address = ("10.0.0.1", 6379)
    client.connection_pool.get_master_address = lambda: named.address
    config = SharedStateConfig(backend="redis", namespace="app", sync_interval=0.05)
    shared = SharedState(config, lambda *a: None, client=client)
    # fakeredis's connections have no address the sentinels could name: start as if the
    # check at start had passed.
    shared.available, shared.outages = True, 0
    shared.replication._stale, shared.replication._checked_at = False, time.monotonic()
    shared.set_workers(["w1"])
    shared.start()
    try:
        deadline = time.monotonic() + 10
        while shared.outages == 0:
            threading.Event().wait(0.02)
            if shared.outages == 0 and named.address == ("10.0.0.1", 6379):
                assert shared.available  # no outage while the sentinels name the same one
                named.address = ("10.0.0.2", 6379)  # the failover
            assert time.monotonic() < deadline, "the moved primary was not noticed"
        assert "another primary" in (shared.last_error or "")
    finally:
        shared.stop()


def test_a_subscription_left_on_the_old_primary_is_noticed_though_the_pool_moved():
    """Any connection made after a failover (a task's write, the replication check)
    moves the pool's own address to the new primary at once, while the subscription
    made before stays on the old one, deaf to every message, until the sentinels demote
    that server some 10 s later. The next re-read notices the subscription: an outage,
    after which the state resubscribes on the new primary."""
    import threading
    import time

    server = fakeredis.FakeServer()
    client = fakeredis.FakeRedis(server=server)
    old, new = ("10.0.0.1", 6379), ("10.0.0.2", 6379)
    named = NamedPrimary(old)
    client.npu_sync_sentinel = (named, "mymaster")
    client.connection_pool.master_address = old
    client.connection_pool.get_master_address = lambda: named.address
    subscribed = threading.Event()
    real_pubsub = client.pubsub

    def pubsub(**kwargs: object) -> object:
        made = real_pubsub(**kwargs)
        real_subscribe = made.subscribe

        def subscribe(*args: object) -> object:
            done = real_subscribe(*args)
            # A subscription's connection is made to the primary the pool names then.
            address = client.connection_pool.master_address
            made.connection.host, made.connection.port = address
            subscribed.set()
            return done

        made.subscribe = subscribe
        return made

    client.pubsub = pubsub
    config = SharedStateConfig(backend="redis", namespace="app", sync_interval=0.05)
    shared = SharedState(config, lambda *a: None, client=client)
    shared.available, shared.outages = True, 0
    shared.replication._stale, shared.replication._checked_at = False, time.monotonic()
    shared.set_workers(["w1"])
    shared.start()
    try:
        assert subscribed.wait(10), "the sync thread did not subscribe"
        # The failover, and at once a new connection that moves the pool to the new one.
        named.address = new
        client.connection_pool.master_address = new
        # Well within the replication check's 10 s recheck, which would find it too.
        deadline = time.monotonic() + 5
        while shared.outages == 0:
            threading.Event().wait(0.02)
            assert time.monotonic() < deadline, "the subscription on the old primary was kept"
        assert "another primary" in (shared.last_error or "")
    finally:
        shared.stop()


def test_a_tasks_write_never_waits_for_the_replication_check(monkeypatch):
    """Reading whether a replica must confirm a record takes a round trip or two (INFO,
    the sentinels): a task out of time cannot spare them. Its write never checks; the
    refresh is the sync thread's, and a record written while nothing is known waits in
    the spool for it."""
    server = fakeredis.FakeServer()
    shared = state(server)
    store = shared.dead_letter_store(10)
    replication = shared.replication

    def no_check() -> bool:
        raise AssertionError("a task's write ran the replication check")

    monkeypatch.setattr(replication, "check", no_check)
    replication._checked_at -= 3600  # the periodic refresh is due: still not the task's
    first = record(1)
    store.add(first)
    assert store.held_count() == 0 and store.get(first.id) is not None
    replication._stale = True  # a write no replica confirmed: nothing known now
    second = record(2)
    store.add(second)
    assert store.held_count() == 1  # safe in the spool, for the sync thread to move
    store.close()
    shared.stop()
