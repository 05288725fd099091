"""The fleet view against a real redis-server: a namespace full of hostile members, many
readers at once, members going silent, and a Redis that stalls while snapshots are
written. Throughout, the reading process keeps sharing its breakers."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from npu_sync import WorkerPool
from npu_sync._fleet import monitor_of
from npu_sync._shared import SharedState
from npu_sync.config import (
    BreakerConfig,
    FleetConfig,
    HealthConfig,
    PoolConfig,
    RetryConfig,
    SharedStateConfig,
    worker_config,
)
from npu_sync.testing import FakeClock, FakeNetwork, FakeRequest, json_response
from npu_sync.transport import Response

pytestmark = pytest.mark.integration

NS = "fleet-real"
# Every key of a namespace sits under its hash tag (one Cluster slot).
PREFIX = "{" + NS + "}"
INDEX = f"{PREFIX}:fleet:index"
WORKERS = [f"npu-{n:02d}" for n in range(20)]


def answer(req: FakeRequest) -> Response:
    if req.path == "/health":
        return json_response(200, {"status": "healthy"})
    return json_response(200, {"worker_id": req.worker_id})


def make_config(url: str, **fleet: Any) -> PoolConfig:
    return PoolConfig(
        workers=tuple(
            worker_config(wid, f"http://127.0.0.1:{9600 + n}") for n, wid in enumerate(WORKERS)
        ),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=0),
        circuit_breaker=BreakerConfig(fail_max=1, reset_timeout=30),
        # The breakers' own short timeout; the sync thread's re-read is kept out of the
        # way so that what is measured is the snapshots' traffic alone.
        shared_state=SharedStateConfig(
            backend="redis", url=url, namespace=NS, timeout=0.05, sync_interval=600
        ),
        fleet=FleetConfig(**fleet),
    )


@pytest.fixture(autouse=True)
def manual(monkeypatch: pytest.MonkeyPatch) -> None:
    """Samples are taken by the test (tick()), not on the wall clock."""
    for name in ("NPU_SYNC_FLEET_INTERVAL", "NPU_SYNC_FLEET_TTL", "NPU_SYNC_FLEET_POINTS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NPU_SYNC_FLEET", "manual")


@pytest.fixture
def redis(redis_server: Any) -> Iterator[Any]:
    import redis as redis_py

    client = redis_py.Redis(host="127.0.0.1", port=redis_server.port, socket_timeout=30)
    yield client
    client.close()


def member(n: int, host: str) -> str:
    return f"{host}:{2000 + n}:x{n}"


def forged(base: dict[str, Any], name: str) -> dict[str, Any]:
    snap = json.loads(json.dumps(base))
    host, pid, _ = name.rsplit(":", 2)
    snap["process"] = {**snap["process"], "id": name, "pid": int(pid), "host": host}
    snap["published_at"] = time.time()
    return snap


def plant(redis: Any, name: str, value: Any, *, ttl: float = 600) -> None:
    key = f"{PREFIX}:fleet:process:{name}"
    if isinstance(value, dict):
        redis.delete(key)
        redis.hset(key, mapping=value)
    else:
        redis.set(key, value, px=int(ttl * 1000))
    redis.zadd(INDEX, {name: time.time()})


def own_snapshot(pool: WorkerPool, redis: Any) -> dict[str, Any]:
    monitor = monitor_of(pool)
    assert monitor is not None
    for _ in range(3):
        pool.execute({})
    monitor.tick()
    raw = redis.get(f"{PREFIX}:fleet:process:{monitor.process['id']}")
    assert raw, "the pool did not publish its snapshot"
    return dict(json.loads(raw))


class SharingWatch:
    """Polls the reading process's shared state on a thread of its own, the whole time a
    test runs, and remembers any moment it was not available."""

    def __init__(self, pool: WorkerPool) -> None:
        self._pool = pool
        self._stop = threading.Event()
        self.dropped: list[Any] = []
        self.polls = 0
        self._thread = threading.Thread(target=self._run, name="test-sharing-watch")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            shared = self._pool.stats()["shared_state"]
            self.polls += 1
            if not shared["available"] or shared["outages"]:
                self.dropped.append(shared)
            self._stop.wait(0.002)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def test_64_members_many_hostile_cost_one_bounded_read_and_no_outage(redis_server, redis):
    """64 members — 40 honest on 8 hosts, oversized, malformed JSON, wrong types, huge
    worker lists, a hash under a snapshot key — are read again and again: the honest
    ones are shown, every other one is counted, and the reader keeps sharing breakers."""
    net = FakeNetwork(answer)
    with WorkerPool(make_config(redis_server.url, cache=0), transport_factory=net.factory) as pool:
        base = own_snapshot(pool, redis)
        honest = [member(n, f"web-{n % 8}") for n in range(40)]
        for name in honest:
            plant(redis, name, json.dumps(forged(base, name)))
        for n in range(8):  # 2 MiB each: over the cap, never read
            big = forged(base, member(100 + n, "big"))
            big["pad"] = "x" * (2 * 1024 * 1024)
            plant(redis, member(100 + n, "big"), json.dumps(big))
        for n in range(6):
            plant(redis, member(200 + n, "junk"), '{"v": 1, "process": ' + "[" * n)
        for n in range(4):
            wrong = forged(base, member(300 + n, "types"))
            wrong["workers"] = "lots" if n % 2 else [{"id": 5}]
            wrong["process"]["pid"] = "one" if n == 2 else wrong["process"]["pid"]
            plant(redis, member(300 + n, "types"), json.dumps(wrong))
        for n in range(4):  # 1,500 workers each: large, under the cap, valid
            huge = forged(base, member(400 + n, "huge"))
            row = huge["workers"][0]
            huge["workers"] = [{**row, "id": f"h{n}-{k}"} for k in range(1500)]
            huge["history"]["workers"] = []
            text = json.dumps(huge, separators=(",", ":"))
            assert 300_000 < len(text) < 512 * 1024
            plant(redis, member(400 + n, "huge"), text)
        plant(redis, member(500, "hash"), {"not": "a string"})
        plant(redis, member(501, "hash"), {"nor": "this"})
        assert redis.zcard(INDEX) == 1 + 64

        watch = SharingWatch(pool)
        try:
            views = [pool.stats(scope="fleet") for _ in range(5)]
        finally:
            watch.stop()
        shared = pool.stats()["shared_state"]
    assert watch.polls > 0 and watch.dropped == []
    assert shared["available"] and shared["outages"] == 0
    assert shared["fleet_snapshots"]["read_failed"] == 0
    assert shared["fleet_snapshots"]["read"] >= 5
    for fleet in views:
        assert fleet["available"] is True
        assert fleet["skipped"] == {"oversized": 8, "malformed": 12, "unread": 0}
        assert "8 over 512 KiB" in fleet["note"] and "12 unreadable" in fleet["note"]
        ids = {p["process"]["id"] for p in fleet["processes"]}
        assert set(honest) <= ids and len(ids) == 1 + 40 + 4
        hosts = {h["host"]: h for h in fleet["hosts"]}
        assert {f"web-{n}" for n in range(8)} <= set(hosts)
        assert all(hosts[f"web-{n}"]["processes"] == 5 for n in range(8))
        assert hosts["web-0"]["workers"] == 20
        assert "big" not in hosts and "junk" not in hosts
        json.dumps(fleet, allow_nan=False)


def test_many_concurrent_readers_share_one_read_per_interval(redis_server, redis):
    """Thirty-two threads asking for the fleet at once cost one Redis read and one merge;
    the next read comes only once the interval has passed."""
    clock = FakeClock(wall=time.time())
    net = FakeNetwork(answer)
    config = make_config(redis_server.url, interval=5, cache=5)
    with WorkerPool(config, transport_factory=net.factory, clock=clock) as pool:
        base = own_snapshot(pool, redis)
        for n in range(16):
            name = member(n, f"web-{n % 4}")
            plant(redis, name, json.dumps(forged(base, name)))
        monitor = monitor_of(pool)
        assert monitor is not None
        shared = pool._state.shared
        assert shared is not None
        reads_before = shared.fleet_stats()["read"]
        barrier = threading.Barrier(32)
        answers: list[Any] = []

        def reader() -> None:
            barrier.wait(30)
            answers.append(pool.stats(scope="fleet"))

        threads = [threading.Thread(target=reader) for _ in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(answers) == 32
        assert monitor.reads == 1
        assert shared.fleet_stats()["read"] - reads_before == 1
        assert all(a["read_at"] == answers[0]["read_at"] for a in answers)
        assert all(a["totals"]["processes"] == 17 for a in answers)
        clock.advance(4.9)
        pool.stats(scope="fleet")
        assert monitor.reads == 1
        clock.advance(0.2)
        pool.stats(scope="fleet")
        assert monitor.reads == 2
        assert shared.fleet_stats()["read"] - reads_before == 2


def poll(check: Any, what: str, deadline: float = 30.0) -> Any:
    end = time.monotonic() + deadline
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > end:
            raise AssertionError(f"not within {deadline} s: {what}")
        threading.Event().wait(0.02)


def test_a_member_that_stops_publishing_is_silent_then_gone(redis_server, redis):
    """Another host's process publishes, then stops without withdrawing: it is listed live,
    then silent (its host too, since when), then — after fleet.silent_for — not at all."""
    net = FakeNetwork(answer)
    config = make_config(redis_server.url, interval=0.1, ttl=0.4, cache=0, silent_for=1.0)
    with WorkerPool(config, transport_factory=net.factory) as pool:
        base = own_snapshot(pool, redis)
        other = SharedState(config.shared_state, lambda *change: None)
        try:
            name = member(1, "far-host")
            snap = forged(base, name)
            assert other.publish_snapshot(name, json.dumps(snap), 0.4)
            published = time.time()
        finally:
            other.stop()

        def fleet() -> Any:
            return pool.stats(scope="fleet")

        first = fleet()
        hosts = {h["host"]: h for h in first["hosts"]}
        assert name in {p["process"]["id"] for p in first["processes"]}
        assert hosts["far-host"]["state"] == "live"

        def silent() -> Any:
            view = fleet()
            rows = {h["host"]: h for h in view["hosts"]}
            row = rows.get("far-host")
            return view if row is not None and row["state"] == "silent" else None

        view = poll(silent, "the far host listed as silent")
        row = next(h for h in view["hosts"] if h["host"] == "far-host")
        assert name not in {p["process"]["id"] for p in view["processes"]}
        assert [s["id"] for s in view["silent"]] == [name]
        assert row["silent_processes"] == 1 and row["processes"] == 0
        assert abs(row["silent_since"] - published) < 5
        assert "1 silent" in view["note"]

        def gone() -> Any:
            view = fleet()
            return view if all(h["host"] != "far-host" for h in view["hosts"]) else None

        view = poll(gone, "the silent host dropped after fleet.silent_for")
        assert view["silent"] == [] and redis.zscore(INDEX, name) is None
        assert pool.stats()["shared_state"]["outages"] == 0


def pause(redis: Any, seconds: float) -> None:
    """Redis answers no client for ``seconds``: as a server stalled by a slow command,
    a fork for a snapshot or a saturated host.

    First waits for the pool's sync thread to be subscribed and through its first
    re-read of the breakers (the second MGET, after the one on start): either in the
    stall would be an outage of the breakers' own (with their 50 ms timeout), which is
    not what these tests are about."""
    channel = f"{PREFIX}:breakers"
    poll(lambda: dict(redis.pubsub_numsub(channel)).get(channel.encode()), "sync thread subscribed")

    def resynced() -> bool:
        calls = redis.info("commandstats").get("cmdstat_mget", {}).get("calls", 0)
        return int(calls) >= 2

    poll(resynced, "sync thread through its first re-read")
    redis.execute_command("CLIENT", "PAUSE", int(seconds * 1000), "ALL")


def test_a_stalled_redis_delays_a_snapshot_write_without_an_outage(redis_server, redis):
    """Redis stalls for 0.3 s, six times the breakers' timeout, as the snapshot is written:
    the write waits it out within fleet.timeout, and breakers are still shared after."""
    net = FakeNetwork(answer)
    config = make_config(redis_server.url, timeout=5.0)
    with WorkerPool(config, transport_factory=net.factory) as pool:
        monitor = monitor_of(pool)
        assert monitor is not None
        pool.execute({})
        monitor.tick()
        written = pool.stats()["shared_state"]["fleet_snapshots"]["written"]
        pause(redis, 0.3)
        started = time.monotonic()
        monitor.tick()
        waited = time.monotonic() - started
        shared = pool.stats()["shared_state"]
        assert waited > 0.05, "the write did not meet the stall"
        assert shared["fleet_snapshots"]["written"] == written + 1
        assert shared["fleet_snapshots"]["write_failed"] == 0
        assert shared["available"] and shared["outages"] == 0
        # Sharing still works: an opening announced now reaches Redis.
        state = pool._state.shared
        assert state is not None
        published = state.published
        state.announce("npu-00", "open", 60.0)
        assert state.published == published + 1
        assert redis.get(state._breaker_keys("npu-00")["state"]) == b"open"
        assert pool.stats()["shared_state"]["outages"] == 0


def test_a_snapshot_write_longer_than_its_timeout_is_counted_not_an_outage(redis_server, redis):
    """Redis stalls longer than fleet.timeout: the write fails, is counted as failed, the
    shared state stays available, and the next write after the stall lands."""
    net = FakeNetwork(answer)
    config = make_config(redis_server.url, timeout=0.1)
    with WorkerPool(config, transport_factory=net.factory) as pool:
        monitor = monitor_of(pool)
        assert monitor is not None
        watch = SharingWatch(pool)
        try:
            pause(redis, 0.6)
            monitor.tick()
            shared = pool.stats()["shared_state"]
            assert shared["fleet_snapshots"]["write_failed"] == 1
            assert "Timeout" in (shared["fleet_snapshots"]["last_error"] or "")
            poll(lambda: redis.ping(), "Redis answering again")
            monitor.tick()
        finally:
            watch.stop()
        shared = pool.stats()["shared_state"]
    assert watch.dropped == []
    assert shared["available"] and shared["outages"] == 0
    assert shared["fleet_snapshots"]["written"] == 1


def test_a_fleet_read_in_a_stall_shows_the_last_read_and_keeps_sharing(redis_server, redis):
    """A read that times out in a stall leaves the shared state available and shows the
    snapshots read before, saying how old they are."""
    net = FakeNetwork(answer)
    config = make_config(redis_server.url, timeout=0.1, cache=0)
    with WorkerPool(config, transport_factory=net.factory) as pool:
        base = own_snapshot(pool, redis)
        plant(redis, member(1, "web-1"), json.dumps(forged(base, member(1, "web-1"))))
        before = pool.stats(scope="fleet")
        assert before["totals"]["processes"] == 2
        pause(redis, 0.6)
        during = pool.stats(scope="fleet")
        shared = pool.stats()["shared_state"]
        poll(lambda: redis.ping(), "Redis answering again")
    assert shared["fleet_snapshots"]["read_failed"] == 1
    assert shared["available"] and shared["outages"] == 0
    assert during["available"] is True and during["totals"]["processes"] == 2
    assert "could not be read now" in during["note"]


def test_get_fleet_shows_a_row_per_host_and_one_hosts_processes(redis_server, redis):
    """GET fleet carries every host and this host's processes; ?host= another's,
    ?processes=all every one; garbage in a snapshot or a query never breaks the page."""
    pytest.importorskip("flask")
    from tests.test_flask import PREFIX, make_app

    net = FakeNetwork(answer)
    with WorkerPool(make_config(redis_server.url, cache=0), transport_factory=net.factory) as pool:
        base = own_snapshot(pool, redis)
        for n in range(3):
            plant(redis, member(n, "far"), json.dumps(forged(base, member(n, "far"))))
        plant(redis, member(9, "near"), json.dumps(forged(base, member(9, "near"))))
        plant(redis, member(10, "near"), "[[[[not json")
        client = make_app(pool).test_client()
        plain = client.get(f"{PREFIX}/fleet")
        far = client.get(f"{PREFIX}/fleet?host=far")
        every = client.get(f"{PREFIX}/fleet?processes=all")
        bad = client.get(f"{PREFIX}/fleet?processes=some")
        twice = client.get(f"{PREFIX}/fleet?host=a&host=b")
        nowhere = client.get(f"{PREFIX}/fleet?host=nowhere")
    me = base["process"]["host"]
    body = plain.get_json()
    assert plain.status_code == 200
    assert {h["host"] for h in body["hosts"]} == {me, "far", "near"}
    assert [p["process"]["host"] for p in body["processes"]] == [me]
    assert body["processes_of"] == me and body["totals"]["processes"] == 5
    assert body["skipped"]["malformed"] == 1
    assert [p["process"]["pid"] for p in far.get_json()["processes"]] == [2000, 2001, 2002]
    assert len(every.get_json()["processes"]) == 5 and every.get_json()["processes_of"] == "all"
    assert bad.status_code == 400 and "processes: must be 'all', got 'some'" in bad.get_data(True)
    assert twice.status_code == 400 and "host: give it once" in twice.get_data(True)
    assert nowhere.status_code == 200 and nowhere.get_json()["processes"] == []
