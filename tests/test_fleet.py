"""The fleet monitor: a pool's last minutes in steps, its snapshot in Redis under a TTL,
and stats(scope="fleet") summing every process's."""

# ruff: noqa: F811  (test parameters named after the fixtures imported below)

from __future__ import annotations

import gc
import json
import os
import socket
import struct
import threading
from dataclasses import replace as dataclasses_replace
from typing import Any

import pytest

from npu_sync import ConfigError, TaskFailed, WorkerPool
from npu_sync._fleet import (
    MAX_FLEET_PROCESSES,
    MAX_SNAPSHOT_BYTES,
    FleetSettings,
    Monitor,
    merge_histories,
    monitor_of,
    parse_snapshot,
)
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    RetryConfig,
    SharedStateConfig,
    parse_config,
    worker_config,
)
from npu_sync.testing import FakeClock, FakeNetwork, FakeRequest, json_response
from npu_sync.transport import Response

# Fixtures shared with the other fleet tests; pytest finds them by name here.
from tests.fleetkit import STEP, WALL, client, clock, manual, redis_server  # noqa: F401


def answer(req: FakeRequest) -> Response:
    if req.path == "/health":
        return json_response(200, {"status": "healthy"})
    if req.json().get("fail"):
        return json_response(503, {"detail": "overloaded"})
    return json_response(200, {"worker_id": req.worker_id})


def make_config(*ids: str, shared: SharedStateConfig | None = None) -> PoolConfig:
    return PoolConfig(
        workers=tuple(
            worker_config(wid, f"http://127.0.0.1:{9500 + n}", priority=n + 1)
            for n, wid in enumerate(ids)
        ),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=len(ids) - 1, backoff_initial=0.01, backoff_max=0.01),
        circuit_breaker=BreakerConfig(fail_max=1, reset_timeout=30),
        shared_state=shared or SharedStateConfig(),
    )


@pytest.fixture
def net() -> FakeNetwork:
    return FakeNetwork(answer)


SHARED = SharedStateConfig(backend="redis", namespace="fleet-test")


# -- settings ----------------------------------------------------------------------------------


def test_settings_default_and_come_from_the_environment():
    """Defaults: 5 s steps, snapshots living three steps, ten minutes kept."""
    default = FleetSettings.from_env({})
    assert (default.interval, default.expiry, default.points, default.mode) == (
        5.0,
        15.0,
        120,
        "on",
    )
    given = FleetSettings.from_env(
        {"NPU_SYNC_FLEET_INTERVAL": "0.5", "NPU_SYNC_FLEET_TTL": "2", "NPU_SYNC_FLEET": "Manual"}
    )
    assert (given.interval, given.expiry, given.points, given.mode) == (0.5, 2.0, 120, "manual")


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"NPU_SYNC_FLEET_INTERVAL": "soon"}, "NPU_SYNC_FLEET_INTERVAL: not a number, got 'soon'"),
        ({"NPU_SYNC_FLEET_INTERVAL": "0"}, "NPU_SYNC_FLEET_INTERVAL: must be 0.05 to 3600"),
        ({"NPU_SYNC_FLEET_INTERVAL": "nan"}, "NPU_SYNC_FLEET_INTERVAL: not a finite number"),
        ({"NPU_SYNC_FLEET_TTL": "5"}, "NPU_SYNC_FLEET_TTL: must be more than the interval (5 s)"),
        ({"NPU_SYNC_FLEET_POINTS": "1"}, "NPU_SYNC_FLEET_POINTS: must be a whole number 2 to"),
        ({"NPU_SYNC_FLEET": "sometimes"}, "NPU_SYNC_FLEET: must be one of on, manual, off"),
    ],
)
def test_an_unusable_setting_is_a_config_error_naming_the_variable(env, named):
    """The message names the environment variable and the value given."""
    with pytest.raises(ConfigError) as info:
        FleetSettings.from_env(env)
    assert named in str(info.value)


def test_a_pool_with_an_unusable_setting_fails_to_build(monkeypatch, net):
    """A typo in the environment fails at start-up, not silently."""
    monkeypatch.setenv("NPU_SYNC_FLEET_POINTS", "lots")
    with pytest.raises(ConfigError, match="NPU_SYNC_FLEET_POINTS"):
        WorkerPool(make_config("a"), transport_factory=net.factory)


# -- history -----------------------------------------------------------------------------------


def test_each_sample_records_what_happened_during_its_step(net, clock):
    """Per step: tasks and attempts that ended then, p99 only where attempts ran,
    and the breaker's state, with a trip marked in the step it happened."""
    with WorkerPool(make_config("a", "b"), transport_factory=net.factory, clock=clock) as pool:
        monitor = monitor_of(pool)
        assert monitor is not None
        for _ in range(3):
            pool.execute({"n": 1})
        monitor.tick()  # step 0: three tasks on a
        clock.advance(STEP)
        monitor.tick()  # step 1: nothing
        clock.advance(STEP)
        with pytest.raises(TaskFailed):
            pool.execute({"fail": True})  # fails on a and b: both breakers open
        monitor.tick()  # step 2
        history = monitor.history()

    assert history["step_s"] == STEP and history["points"] == 120
    assert history["end_at"] == WALL + 2 * STEP
    assert history["tasks"]["succeeded"][-3:] == [3, 0, 0]
    assert history["tasks"]["failed"][-3:] == [0, 0, 1]
    assert history["tasks"]["succeeded"][:-3] == [None] * 117
    a, b = history["workers"]
    assert (a["id"], b["id"]) == ("a", "b")
    assert a["succeeded"][-3:] == [3, 0, 0]
    assert a["failed"][-3:] == [0, 0, 1] and b["failed"][-3:] == [0, 0, 1]
    assert a["p99_ms"][-3] is not None and a["p99_ms"][-2] is None
    assert a["breaker"][-3:] == "cco" and b["breaker"][-3:] == "cco"
    assert a["breaker"][:-3] == "-" * 117


def test_a_trip_and_recovery_within_one_step_still_marks_the_step_open(net, clock):
    """A breaker that opened and closed again between two samples shows as opened."""
    with WorkerPool(make_config("a", "b"), transport_factory=net.factory, clock=clock) as pool:
        monitor = monitor_of(pool)
        monitor.tick()
        clock.advance(STEP)
        with pytest.raises(TaskFailed):
            pool.execute({"fail": True})
        clock.advance(31)  # past the reset timeout: the next task is a's trial
        pool.execute({"ok": True})
        assert pool.workers()[0]["breaker"]["state"] == "closed"
        monitor.tick()
        letters = monitor.history()["workers"][0]["breaker"]
    assert letters[-1] == "o"


def test_samples_land_on_the_multiples_of_the_step(net, clock):
    """A sample a little late or early counts for the nearest step; two in one step add up."""
    with WorkerPool(make_config("a"), transport_factory=net.factory, clock=clock) as pool:
        monitor = monitor_of(pool)
        clock.advance(0.3)
        pool.execute({})
        monitor.tick()
        clock.advance(STEP - 0.6)  # 0.3 s before the next step
        pool.execute({})
        monitor.tick()
        pool.execute({})
        monitor.tick()  # the same step again
        history = monitor.history()
    assert history["end_at"] == WALL + STEP
    assert history["tasks"]["succeeded"][-2:] == [1, 2]


def test_histories_of_several_processes_merge_step_by_step():
    """Counts add up in the step they share, the highest p99 wins, the worst state too."""

    def history(end_at: float, ok: list, p99: list, breaker: str) -> dict:
        return {
            "step_s": STEP,
            "points": 3,
            "end_at": end_at,
            "tasks": {"succeeded": ok, "failed": [0, 0, 0]},
            "workers": [{"id": "a", "succeeded": ok, "failed": [0, 0, 0], "p99_ms": p99,
                         "breaker": breaker}],
        }  # fmt: skip

    one = history(WALL, [1, 2, 3], [10.0, None, 30.0], "cco")
    two = history(WALL - STEP, [5, 6, 7], [50.0, 20.0, 5.0], "hcc")  # one step behind
    other_step = {**history(WALL, [100, 100, 100], [1.0, 1.0, 1.0], "ccc"), "step_s": 1.0}
    merged = merge_histories([one, two, other_step], step=STEP, points=4, end_at=WALL)
    assert merged["end_at"] == WALL
    assert merged["tasks"]["succeeded"] == [5, 7, 9, 3]
    (a,) = merged["workers"]
    assert a["succeeded"] == [5, 7, 9, 3]
    assert a["p99_ms"] == [50.0, 20.0, 5.0, 30.0]
    assert a["breaker"] == "hcco"


# -- the fleet view ----------------------------------------------------------------------------


def test_without_redis_the_fleet_is_this_process_and_says_which(net, clock):
    """scope="fleet" without shared state: one process, named by pid and host."""
    with WorkerPool(make_config("a"), transport_factory=net.factory, clock=clock) as pool:
        pool.execute({})
        fleet = pool.stats(scope="fleet")
        local = pool.stats()
    assert fleet["scope"] == "fleet" and fleet["shared"] is False and fleet["available"] is False
    me = fleet["this_process"]
    assert me["pid"] == os.getpid() and me["host"] == socket.gethostname()
    assert f"One process only: pid {os.getpid()} on {socket.gethostname()}" in fleet["note"]
    (process,) = fleet["processes"]
    assert process["this_process"] is True and process["process"] == me
    assert fleet["totals"]["processes"] == 1
    assert fleet["totals"]["tasks"]["succeeded"] == local["tasks"]["succeeded"] == 1
    assert fleet["local"]["tasks"] == local["tasks"]


def test_an_unknown_scope_is_refused(net):
    """stats(scope=...) takes 'local' or 'fleet' only."""
    with (
        WorkerPool(make_config("a"), transport_factory=net.factory) as pool,
        pytest.raises(ValueError, match="scope"),
    ):
        pool.stats(scope="cluster")  # type: ignore[call-overload]


def test_processes_sharing_redis_see_each_other_and_their_totals(net, clock, redis_server):
    """Two pools (two processes) on one namespace: each lists both, totals are the sums."""
    config = make_config("a", "b", shared=SHARED)
    with (
        WorkerPool(config, transport_factory=net.factory, clock=clock) as first,
        WorkerPool(config, transport_factory=net.factory, clock=clock) as second,
    ):
        for _ in range(5):
            first.execute({})
        for _ in range(3):
            second.execute({})
        monitor_of(first).tick()
        monitor_of(second).tick()
        first.execute({})  # after the last sample: the answering process is fresh
        fleet = first.stats(scope="fleet")
        seen_by_second = second.stats(scope="fleet")
        capacity = first.workers()[0]["capacity"]
    assert fleet["shared"] and fleet["available"]
    assert fleet["note"].startswith("2 processes on 1 host")
    assert fleet["totals"]["processes"] == 2
    assert fleet["totals"]["tasks"]["succeeded"] == 9
    assert seen_by_second["totals"]["tasks"]["succeeded"] == 8  # first's last sample
    by_id = {p["process"]["id"]: p for p in fleet["processes"]}
    assert by_id[monitor_of(first).process["id"]]["this_process"] is True
    assert by_id[monitor_of(second).process["id"]]["tasks"]["succeeded"] == 3
    a, b = fleet["totals"]["workers"]
    assert (a["id"], a["processes"], a["succeeded"], a["capacity"]) == ("a", 2, 9, 2 * capacity)
    assert b["attempts"] == 0
    assert fleet["history"]["tasks"]["succeeded"][-1] == 8  # the two samples, merged


def test_a_snapshot_lives_for_its_ttl_and_a_closed_pool_withdraws_it(
    net, clock, redis_server, monkeypatch
):
    """The key carries the TTL (so a killed process drops out); close() removes it at once."""
    monkeypatch.setenv("NPU_SYNC_FLEET_INTERVAL", "2")
    monkeypatch.setenv("NPU_SYNC_FLEET_TTL", "7")
    redis = client(redis_server)
    config = make_config("a", shared=SHARED)
    with WorkerPool(config, transport_factory=net.factory, clock=clock) as pool:
        monitor = monitor_of(pool)
        member = monitor.process["id"]
        key = f"{{fleet-test}}:fleet:process:{member}"
        assert redis.exists(key) == 0  # nothing before the first sample
        monitor.tick()
        assert 6000 < redis.pttl(key) <= 7000
        snapshot = parse_snapshot(redis.get(key).decode())
        assert snapshot is not None and snapshot["process"]["pid"] == os.getpid()
    assert redis.exists(key) == 0
    assert redis.zrange("{fleet-test}:fleet:index", 0, -1) == []


def test_expired_and_unreadable_snapshots_are_left_out(net, clock, redis_server):
    """A process whose key expired, or whose snapshot is garbage or of another version,
    is not in the view; stale index entries are pruned."""
    redis = client(redis_server)
    config = make_config("a", shared=SHARED)
    with WorkerPool(config, transport_factory=net.factory, clock=clock) as pool:
        monitor_of(pool).tick()
        now = redis.time()[0]
        redis.zadd("{fleet-test}:fleet:index", {"gone:1:x": now, "bad:2:x": now, "v9:3:x": now})
        redis.set("{fleet-test}:fleet:process:bad:2:x", "{not json")
        redis.set("{fleet-test}:fleet:process:v9:3:x", json.dumps({"v": 9}))
        redis.zadd("{fleet-test}:fleet:index", {"ancient:4:x": now - 3600})
        fleet = pool.stats(scope="fleet")
        index = {m.decode() for m in redis.zrange("{fleet-test}:fleet:index", 0, -1)}
    assert [p["this_process"] for p in fleet["processes"]] == [True]
    assert "ancient:4:x" not in index


def test_redis_unavailable_shows_this_process_and_says_why(net, clock, redis_server):
    """During an outage the view is this process only, and the note says so."""
    config = make_config("a", shared=SHARED)
    with WorkerPool(config, transport_factory=net.factory, clock=clock) as pool:
        pool._state.shared.lost(ConnectionError("Connection refused"))
        fleet = pool.stats(scope="fleet")
    assert fleet["shared"] is True and fleet["available"] is False
    assert fleet["note"].startswith(
        "Shared state unavailable (ConnectionError: Connection refused)"
    )
    assert len(fleet["processes"]) == 1


def test_parse_snapshot_refuses_malformed_series():
    """Lists of the wrong length or type would break the merge: the snapshot is skipped."""
    net = FakeNetwork(answer)
    with WorkerPool(make_config("a"), transport_factory=net.factory) as pool:
        monitor = monitor_of(pool)
        monitor.tick()
        good = monitor._snapshot(pool.stats(), pool.workers(), 0.0)
    assert parse_snapshot(json.dumps(good)) is not None
    short = json.loads(json.dumps(good))
    short["history"]["workers"][0]["succeeded"].pop()
    assert parse_snapshot(json.dumps(short)) is None
    wrong = json.loads(json.dumps(good))
    wrong["workers"][0]["attempts"] = "many"
    assert parse_snapshot(json.dumps(wrong)) is None
    assert parse_snapshot("[]") is None


def test_a_snapshot_from_before_the_cancelled_counter_reads_it_as_zero():
    """A process of an earlier release publishes no ``tasks.cancelled``: its snapshot
    is kept (a rolling upgrade keeps the fleet view whole), the count read as 0; a
    snapshot whose count is not a number is still refused."""
    net = FakeNetwork(answer)
    with WorkerPool(make_config("a"), transport_factory=net.factory) as pool:
        monitor = monitor_of(pool)
        monitor.tick()
        good = monitor._snapshot(pool.stats(), pool.workers(), 0.0)
    assert good["tasks"]["cancelled"] == 0
    older = json.loads(json.dumps(good))
    del older["tasks"]["cancelled"]
    read = parse_snapshot(json.dumps(older))
    assert read is not None and read["tasks"]["cancelled"] == 0
    wrong = json.loads(json.dumps(good))
    wrong["tasks"]["cancelled"] = "some"
    assert parse_snapshot(json.dumps(wrong)) is None


# -- the thread --------------------------------------------------------------------------------


def test_the_thread_samples_on_its_own_and_only_it_writes_to_redis(net, redis_server, monkeypatch):
    """With the timer on, samples and snapshots come from the npu-sync-fleet thread; a
    task thread sends nothing for them."""
    from npu_sync._shared import SharedState

    monkeypatch.setenv("NPU_SYNC_FLEET", "on")
    monkeypatch.setenv("NPU_SYNC_FLEET_INTERVAL", "0.05")
    publishers: list[str] = []
    published = threading.Event()
    real = SharedState.publish_snapshot

    def spy(self: SharedState, member: str, payload: str, ttl: float) -> bool:
        publishers.append(threading.current_thread().name)
        if len(publishers) >= 2:
            published.set()
        return real(self, member, payload, ttl)

    monkeypatch.setattr(SharedState, "publish_snapshot", spy)
    with WorkerPool(make_config("a", shared=SHARED), transport_factory=net.factory) as pool:
        for _ in range(20):
            pool.execute({})
        assert published.wait(timeout=10)
    assert set(publishers) == {"npu-sync-fleet"}
    assert not any(t.name == "npu-sync-fleet" for t in threading.enumerate())


def test_a_pool_dropped_without_close_lets_its_monitor_thread_go(net, monkeypatch):
    """The thread holds the pool weakly and ends when the pool is collected."""
    monkeypatch.setenv("NPU_SYNC_FLEET", "on")
    monkeypatch.setenv("NPU_SYNC_FLEET_INTERVAL", "60")
    pool = WorkerPool(make_config("a"), transport_factory=net.factory)
    monitor_of(pool).history()
    thread = monitor_of(pool)._thread
    assert thread is not None and thread.is_alive()
    with pytest.warns(ResourceWarning):
        del pool
        gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_a_pool_without_background_work_samples_from_the_first_look(net, monkeypatch):
    """Health off and no shared state: no thread until the history or fleet is asked for;
    with health checks on, sampling starts with the pool."""
    monkeypatch.setenv("NPU_SYNC_FLEET", "on")
    monkeypatch.setenv("NPU_SYNC_FLEET_INTERVAL", "60")
    with WorkerPool(make_config("a"), transport_factory=net.factory) as quiet:
        assert monitor_of(quiet)._thread is None
        quiet.stats(scope="fleet")
        assert monitor_of(quiet)._thread is not None
    checked = PoolConfig(workers=(worker_config("a", "http://127.0.0.1:9500"),))
    with WorkerPool(checked, transport_factory=net.factory) as busy:
        assert monitor_of(busy)._thread is not None


def test_a_failing_listener_neither_stops_the_sample_nor_the_others(net, clock):
    """Listeners run after each sample; one raising is logged and the next still runs."""
    calls: list[int] = []

    def broken(stats, rows):
        raise RuntimeError("listener bug")

    with WorkerPool(make_config("a"), transport_factory=net.factory, clock=clock) as pool:
        monitor = monitor_of(pool)
        monitor.add_listener(broken)
        monitor.add_listener(lambda stats, rows: calls.append(len(rows)))
        monitor.tick()
        monitor.remove_listener(broken)
        monitor.tick()
    assert calls == [1, 1] and monitor.ticks == 2


def test_after_fork_the_child_is_a_new_process_with_an_empty_history(net, clock):
    """The child gets its own identity (pid, start time, id) and no history of the parent."""
    with WorkerPool(make_config("a"), transport_factory=net.factory, clock=clock) as pool:
        monitor = monitor_of(pool)
        pool.execute({})
        monitor.tick()
        before = monitor.process
        clock.advance(STEP)
        monitor.after_fork()
        after = monitor.process
        assert monitor.history()["end_at"] is None
    assert after["id"] != before["id"] and after["started_at"] == WALL + STEP


def test_off_takes_no_samples_and_says_so(net, monkeypatch):
    """NPU_SYNC_FLEET=off: tick() does nothing and the fleet view names the switch."""
    monkeypatch.setenv("NPU_SYNC_FLEET", "off")
    with WorkerPool(make_config("a"), transport_factory=net.factory) as pool:
        monitor = monitor_of(pool)
        monitor.tick()
        fleet = pool.stats(scope="fleet")
    assert monitor.ticks == 0 and fleet["history"]["end_at"] is None
    assert "NPU_SYNC_FLEET=off" in fleet["note"]


def test_a_monitor_can_be_built_for_any_pool_like_object(clock):
    """Monitor needs only stats() and workers() of what it samples."""

    class Stub:
        def stats(self):
            return {"uptime_s": 1.0, "tasks": dict.fromkeys(
                ("submitted", "succeeded", "rejected", "failed", "fallbacks", "retries",
                 "active", "in_flight", "waiting"), 0)}  # fmt: skip

        def workers(self):
            return []

    stub = Stub()
    monitor = Monitor(stub, None, clock=clock, settings=FleetSettings(mode="manual"))
    monitor.tick()
    assert monitor_of(stub) is monitor and monitor.history()["end_at"] == WALL


def test_the_fleet_section_of_the_configuration_sets_the_monitor(net, monkeypatch):
    """fleet.interval, fleet.points and fleet.mode in the file reach the pool's monitor."""
    for name in ("NPU_SYNC_FLEET", "NPU_SYNC_FLEET_INTERVAL", "NPU_SYNC_FLEET_TTL"):
        monkeypatch.delenv(name, raising=False)
    config = parse_config(
        {
            "npu_workers": {
                "workers": [{"id": "a", "url": "http://127.0.0.1:9500"}],
                "health": {"enabled": False},
                "fleet": {"mode": "manual", "interval": 2, "points": 50},
            }
        }
    )
    with WorkerPool(config, transport_factory=net.factory) as pool:
        settings = monitor_of(pool).settings
    assert (settings.mode, settings.interval, settings.points) == ("manual", 2.0, 50)
    assert settings.expiry == 6.0  # three intervals when fleet.ttl is not given


def test_an_environment_variable_overrides_its_fleet_key(net, monkeypatch):
    """NPU_SYNC_FLEET_INTERVAL wins over fleet.interval; the other keys still apply."""
    monkeypatch.setenv("NPU_SYNC_FLEET", "manual")
    monkeypatch.setenv("NPU_SYNC_FLEET_INTERVAL", "3")
    config = parse_config(
        {
            "npu_workers": {
                "workers": [{"id": "a", "url": "http://127.0.0.1:9500"}],
                "health": {"enabled": False},
                "fleet": {"interval": 2, "points": 40},
            }
        }
    )
    with WorkerPool(config, transport_factory=net.factory) as pool:
        settings = monitor_of(pool).settings
    assert (settings.interval, settings.points) == (3.0, 40)


def test_a_fleet_ttl_within_the_interval_is_refused_naming_the_key():
    """A snapshot that would expire before the next is written is a config error at its
    key path, so a live process cannot blink out of the fleet view."""
    with pytest.raises(ConfigError) as caught:
        parse_config({"npu_workers": {"workers": [], "fleet": {"interval": 5, "ttl": 4}}})
    assert "npu_workers.fleet.ttl: must be more than fleet.interval (5), got 4" in str(caught.value)


# -- spreading the writes, capping the snapshot ----------------------------------------------


def test_each_process_samples_at_a_stable_offset_of_its_own_within_the_step(net, clock):
    """The next sample falls at the process's offset into a step: under a third of the
    step, the same at every sample, different between processes."""
    pools = [
        WorkerPool(make_config("a"), transport_factory=net.factory, clock=clock) for _ in range(8)
    ]
    try:
        monitors = [monitor_of(p) for p in pools]
        offsets = [m.offset for m in monitors]
        assert all(0 <= o < 0.3 * STEP for o in offsets)
        assert len(set(offsets)) == 8
        m = monitors[0]
        for now in (WALL, WALL + 0.7, WALL + 3.2, WALL + 4.99, WALL + 1234.5):
            at = now + m.next_delay(now)
            assert (at - m.offset) % STEP == pytest.approx(0, abs=1e-6) or (
                at - m.offset
            ) % STEP == pytest.approx(STEP, abs=1e-6)
            assert 0 < at - now <= STEP * 1.01
        assert m.offset == offsets[0]
        # The history still lands in the step the offset belongs to.
        assert round((WALL + m.offset) / STEP) == round(WALL / STEP)
    finally:
        for p in pools:
            p.close()


def test_a_snapshot_over_the_cap_is_written_without_worker_history_or_not_at_all(
    net, clock, redis_server, caplog
):
    """A pool whose snapshot is over fleet.max_snapshot_bytes publishes it without its
    per-worker history (one WARNING); one too large even so publishes nothing."""
    from npu_sync.config import FleetConfig

    redis = client(redis_server)
    small = dataclasses_replace(make_config(*[f"w{n}" for n in range(20)], shared=SHARED),
                                fleet=FleetConfig(max_snapshot_bytes=16 * 1024))  # fmt: skip
    with WorkerPool(small, transport_factory=net.factory, clock=clock) as pool:
        monitor = monitor_of(pool)
        for _ in range(3):
            monitor.tick()
            clock.advance(STEP)
        raw = redis.get(f"{{fleet-test}}:fleet:process:{monitor.process['id']}")
        assert raw is not None and len(raw) <= 16 * 1024
        snap = json.loads(raw)
        assert snap["history"]["workers"] == [] and len(snap["workers"]) == 20
        assert parse_snapshot(raw.decode()) is not None
        assert monitor.oversized == 3
    assert sum("fleet.max_snapshot_bytes" in r.getMessage() for r in caplog.records) == 1
    huge = dataclasses_replace(
        small,
        workers=tuple(worker_config(f"w{n}", f"http://127.0.0.1:{9500 + n}") for n in range(120)),
    )
    redis.flushall()
    with WorkerPool(huge, transport_factory=net.factory, clock=clock) as pool:
        monitor = monitor_of(pool)
        monitor.tick()
        assert redis.get(f"{{fleet-test}}:fleet:process:{monitor.process['id']}") is None
        assert monitor.oversized == 1


def test_a_listener_that_asks_for_the_fleet_from_the_monitor_thread_gets_it(
    net, clock, redis_server
):
    """A listener reading the fleet view inside a sample (the shared read's computation
    runs on the caller's thread, under no lock) neither deadlocks nor reads twice."""
    with WorkerPool(make_config("a", shared=SHARED), transport_factory=net.factory,
                    clock=clock) as pool:  # fmt: skip
        monitor = monitor_of(pool)
        seen: list[int] = []
        monitor.add_listener(lambda stats, rows: seen.append(
            pool.stats(scope="fleet")["totals"]["processes"]))  # fmt: skip
        done = threading.Event()
        worker = threading.Thread(target=lambda: (monitor.tick(), monitor.tick(), done.set()))
        worker.start()
        worker.join(30)
        assert done.is_set(), "a sample calling back into the fleet view hung"
        assert seen == [1, 1] and monitor.reads == 1


# Attacks on the fleet view: garbage snapshots in Redis, clock steps, a publish racing
# close(), unusable settings, and prometheus_client's multiprocess files under children
# that die or restart. Each test names a promise and tries to break it.


ATTACK_SHARED = SharedStateConfig(backend="redis", namespace="attack")


INDEX = "{attack}:fleet:index"


def own_snapshot(pool: WorkerPool, redis: Any) -> dict[str, Any]:
    """The snapshot this pool just published, as a dict to tamper with."""
    monitor = monitor_of(pool)
    monitor.tick()
    text = redis.get(f"{{attack}}:fleet:process:{monitor.process['id']}")
    return json.loads(text)


def plant(redis: Any, member: str, text: str | bytes) -> None:
    """Another 'process' publishes ``text`` as its snapshot."""
    redis.set(f"{{attack}}:fleet:process:{member}", text)
    redis.zadd(INDEX, {member: redis.time()[0]})


def forged(base: dict[str, Any], member: str, **changes: Any) -> dict[str, Any]:
    snap = json.loads(json.dumps(base))
    snap["process"] = {**snap["process"], "id": member, "pid": 4242, "host": "other"}
    for path, value in changes.items():
        target = snap
        *parts, last = path.split("__")
        for part in parts:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value
    return snap


NON_FINITE = [
    ("history__end_at", "NaN"),
    ("history__end_at", "Infinity"),
    ("published_at", "NaN"),
    ("uptime_s", "-Infinity"),
    ("history__step_s", "NaN"),
    ("history__tasks__succeeded__119", "Infinity"),
    ("history__tasks__failed__0", "1e400"),
    ("workers__0__p99_ms", "NaN"),
    ("history__workers__0__p99_ms__119", "Infinity"),
]


@pytest.mark.parametrize(("path", "literal"), NON_FINITE)
def test_a_snapshot_with_a_non_finite_number_is_left_out_and_the_view_stays_json(
    net, clock, redis_server, path, literal
):
    """NaN/Infinity in another process's snapshot neither breaks stats(scope="fleet") nor
    reaches its JSON (a browser's JSON.parse refuses NaN and would blank the page)."""
    redis = client(redis_server)
    with WorkerPool(make_config("a"), transport_factory=net.factory, clock=clock) as plain:
        plain.execute({})
    with WorkerPool(make_config("a", shared=ATTACK_SHARED), transport_factory=net.factory,
                    clock=clock) as pool:  # fmt: skip
        pool.execute({})
        base = own_snapshot(pool, redis)
        snap = forged(base, "evil:1:x", **{path: "__MARK__"})
        plant(redis, "evil:1:x", json.dumps(snap).replace('"__MARK__"', literal))
        assert parse_snapshot(json.dumps(snap).replace('"__MARK__"', literal)) is None
        fleet = pool.stats(scope="fleet")
    json.dumps(fleet, allow_nan=False)  # raises on NaN or Infinity anywhere
    assert [p["process"]["host"] for p in fleet["processes"]] != ["other"]
    assert len(fleet["processes"]) == 1


@pytest.mark.parametrize(
    "path",
    ["tasks__submitted", "tasks__succeeded", "workers__0__attempts", "workers__0__in_flight",
     "workers__0__capacity", "history__tasks__succeeded__119", "history__workers__0__failed__119",
     "process__pid", "uptime_s"],
)  # fmt: skip
def test_a_snapshot_with_a_negative_count_is_left_out(net, clock, redis_server, path):
    """A count below zero is no process's: it would pull the fleet's totals down."""
    redis = client(redis_server)
    with WorkerPool(make_config("a", shared=ATTACK_SHARED), transport_factory=net.factory,
                    clock=clock) as pool:  # fmt: skip
        pool.execute({})
        base = own_snapshot(pool, redis)
        plant(redis, "neg:1:x", json.dumps(forged(base, "neg:1:x", **{path: -1000})))
        fleet = pool.stats(scope="fleet")
    assert fleet["totals"]["processes"] == 1
    assert fleet["totals"]["tasks"]["succeeded"] == 1


@pytest.mark.parametrize(
    "text",
    [
        "",
        "null",
        "[]",
        '"x"',
        "{",
        '{"v": 1}',
        b"\xff\xfe\x00garbage",
        "1" * 5000,
        '{"v": 1, "process": {"id": 1}}',
        "[" * 100_000 + "]" * 100_000,
    ],
)
def test_garbage_under_a_snapshot_key_is_left_out(net, clock, redis_server, text):
    """Invalid JSON, wrong types, bytes that are not UTF-8, nesting deep enough to hit
    the recursion limit: the process is left out, the view is still answered."""
    redis = client(redis_server)
    with WorkerPool(make_config("a", shared=ATTACK_SHARED), transport_factory=net.factory,
                    clock=clock) as pool:  # fmt: skip
        monitor_of(pool).tick()
        plant(redis, "junk:1:x", text)
        fleet = pool.stats(scope="fleet")
    assert fleet["available"] is True
    assert [p["this_process"] for p in fleet["processes"]] == [True]


def test_a_key_of_another_redis_type_under_a_snapshot_name_is_left_out(net, clock, redis_server):
    """A list where a snapshot string should be (WRONGTYPE) is one bad process, not an
    outage of the whole shared state."""
    redis = client(redis_server)
    with WorkerPool(make_config("a", shared=ATTACK_SHARED), transport_factory=net.factory,
                    clock=clock) as pool:  # fmt: skip
        monitor_of(pool).tick()
        redis.rpush("{attack}:fleet:process:list:1:x", "a", "b")
        redis.zadd(INDEX, {"list:1:x": redis.time()[0]})
        fleet = pool.stats(scope="fleet")
        stats = pool.stats()
    assert fleet["available"] is True and len(fleet["processes"]) == 1
    assert stats["shared_state"]["available"] is True


def test_an_oversized_snapshot_is_left_out_without_being_read_whole(net, clock, redis_server):
    """A 50 MB value under a snapshot key costs a reader at most the size limit."""
    redis = client(redis_server)
    with WorkerPool(make_config("a", shared=ATTACK_SHARED), transport_factory=net.factory,
                    clock=clock) as pool:  # fmt: skip
        base = own_snapshot(pool, redis)
        big = forged(base, "big:1:x")
        big["pad"] = "x" * (50 * 1024 * 1024)
        plant(redis, "big:1:x", json.dumps(big))
        shared = pool._state.shared
        fleet_client = shared._fleet_client()  # snapshots go through a client of their own
        sizes: list[int] = []
        real = fleet_client.pipeline

        def watched(*args: Any, **kwargs: Any) -> Any:
            pipe = real(*args, **kwargs)
            execute = pipe.execute

            def run(*a: Any, **k: Any) -> Any:
                answers = execute(*a, **k)
                sizes.extend(len(x) for x in answers if isinstance(x, bytes))
                return answers

            pipe.execute = run
            return pipe

        fleet_client.pipeline = watched
        get = fleet_client.mget
        fleet_client.mget = lambda *a, **k: pytest.fail("snapshots read whole with MGET")
        try:
            fleet = pool.stats(scope="fleet")
        finally:
            fleet_client.pipeline = real
            fleet_client.mget = get
    assert [p["this_process"] for p in fleet["processes"]] == [True]
    assert sizes and max(sizes) <= MAX_SNAPSHOT_BYTES + 1
    assert fleet["skipped"]["oversized"] == 1 and "1 over" in fleet["note"]


def test_thousands_of_processes_keep_the_view_bounded_and_say_so(net, clock, redis_server):
    """More processes than the view lists: the freshest are shown, this one always, and
    the note says how many were left out."""
    redis = client(redis_server)
    extra = MAX_FLEET_PROCESSES + 300
    with WorkerPool(make_config("a", shared=ATTACK_SHARED), transport_factory=net.factory,
                    clock=clock) as pool:  # fmt: skip
        pool.execute({})
        base = own_snapshot(pool, redis)
        now = redis.time()[0]
        pipe = redis.pipeline(transaction=False)
        for n in range(extra):
            member = f"h{n}:{n}:x"
            pipe.set(f"{{attack}}:fleet:process:{member}", json.dumps(forged(base, member)))
            pipe.zadd(INDEX, {member: now - 30 + n * 1e-3})
        pipe.execute()
        fleet = pool.stats(scope="fleet")
        me = monitor_of(pool).process["id"]
    assert len(fleet["processes"]) == MAX_FLEET_PROCESSES
    assert me in {p["process"]["id"] for p in fleet["processes"]}
    assert f"{extra + 1 - MAX_FLEET_PROCESSES} more" in fleet["note"]
    assert len(json.dumps(fleet)) < MAX_FLEET_PROCESSES * 8 * 1024


def test_html_in_ids_and_hosts_comes_back_as_data(net, clock, redis_server):
    """Markup in a host name or worker id is carried as a string, byte for byte: escaping
    is the page's job, and a changed id would break the merge."""
    redis = client(redis_server)
    host = '<img src=x onerror="alert(1)">'
    wid = "</script><script>alert(2)</script>"
    with WorkerPool(make_config("a", shared=ATTACK_SHARED), transport_factory=net.factory,
                    clock=clock) as pool:  # fmt: skip
        base = own_snapshot(pool, redis)
        snap = forged(base, "x:1:y")
        snap["process"]["host"] = host
        snap["workers"][0]["id"] = wid
        snap["history"]["workers"][0]["id"] = wid
        plant(redis, "x:1:y", json.dumps(snap))
        fleet = pool.stats(scope="fleet")
    assert host in {p["process"]["host"] for p in fleet["processes"]}
    assert wid in {w["id"] for w in fleet["totals"]["workers"]}
    assert wid in {w["id"] for w in fleet["history"]["workers"]}


class SteppedClock(FakeClock):
    """A FakeClock whose wall clock can be stepped back or forward, as NTP or an operator
    may; the monotonic clock goes on."""

    def step_wall(self, seconds: float) -> None:
        with self._lock:
            self._wall_offset += seconds


def stub_pool() -> Any:
    class Stub:
        done = 0

        def stats(self) -> dict[str, Any]:
            return {"uptime_s": 1.0, "tasks": {**dict.fromkeys(
                ("submitted", "rejected", "failed", "fallbacks", "retries", "active",
                 "in_flight", "waiting"), 0), "succeeded": self.done}}  # fmt: skip

        def workers(self) -> list[Any]:
            return []

    return Stub()


def test_a_wall_clock_stepped_back_does_not_freeze_the_history():
    """After the wall clock jumps an hour ahead and is set right again, each later sample
    still gets its own step and the history ends at the present, not an hour ahead."""
    clock = SteppedClock(wall=WALL)
    pool = stub_pool()
    monitor = Monitor(pool, None, clock=clock, settings=FleetSettings(mode="manual"))
    monitor.tick()
    clock.step_wall(3600)
    clock.advance(STEP)
    monitor.tick()
    clock.step_wall(-3600)
    for n in range(1, 4):
        clock.advance(STEP)
        pool.done += n
        monitor.tick()
    history = monitor.history()
    assert history["end_at"] == pytest.approx(clock.time(), abs=STEP)
    assert history["tasks"]["succeeded"][-3:] == [1, 2, 3]


def test_a_wall_clock_stepped_back_a_little_adds_to_the_newest_step():
    """A step back shorter than a step is jitter: the sample joins the newest step."""
    clock = SteppedClock(wall=WALL)
    pool = stub_pool()
    monitor = Monitor(pool, None, clock=clock, settings=FleetSettings(mode="manual"))
    monitor.tick()
    clock.advance(STEP)
    pool.done = 2
    monitor.tick()
    clock.step_wall(-STEP * 0.8)
    pool.done = 5
    monitor.tick()
    history = monitor.history()
    assert history["end_at"] == WALL + STEP
    assert history["tasks"]["succeeded"][-2:] == [0, 5]


class SlowShared:
    """Shared state whose publish blocks until released; records what is in 'Redis'."""

    available = True
    last_error = None

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.stored: set[str] = set()
        self.lock = threading.Lock()

    def publish_snapshot(self, member: str, payload: str, ttl: float) -> bool:
        self.entered.set()
        assert self.release.wait(10), "never released"
        with self.lock:
            self.stored.add(member)
        return True

    def withdraw_snapshot(self, member: str) -> None:
        with self.lock:
            self.stored.discard(member)


def test_a_publish_that_lands_after_stop_is_withdrawn():
    """close() during a slow publish: the snapshot that lands afterwards is taken back, so
    a closed process does not linger in the fleet for its TTL."""
    shared = SlowShared()
    pool = stub_pool()
    monitor = Monitor(pool, shared, clock=FakeClock(wall=WALL),  # type: ignore[arg-type]
                      settings=FleetSettings(mode="manual"))  # fmt: skip
    ticking = threading.Thread(target=monitor.tick)
    ticking.start()
    assert shared.entered.wait(10)
    monitor.stop()
    shared.release.set()
    ticking.join(10)
    assert not ticking.is_alive()
    assert shared.stored == set()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("NPU_SYNC_FLEET_INTERVAL", "0"),
        ("NPU_SYNC_FLEET_INTERVAL", "-5"),
        ("NPU_SYNC_FLEET_INTERVAL", "nan"),
        ("NPU_SYNC_FLEET_INTERVAL", "1e999"),
        ("NPU_SYNC_FLEET_INTERVAL", "five"),
        ("NPU_SYNC_FLEET_TTL", "0"),
        ("NPU_SYNC_FLEET_TTL", "-inf"),
        ("NPU_SYNC_FLEET_TTL", "1e12"),
        ("NPU_SYNC_FLEET_POINTS", "0"),
        ("NPU_SYNC_FLEET_POINTS", "2.5"),
        ("NPU_SYNC_FLEET_POINTS", "10000000000"),
        ("NPU_SYNC_FLEET", "sometimes"),
    ],
)
def test_an_unusable_fleet_variable_fails_the_pool_naming_variable_and_value(
    net, monkeypatch, name, value
):
    """0, negative, NaN, huge or words: the pool is not built and the error says which
    variable and what it held."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as caught:
        WorkerPool(make_config("a"), transport_factory=net.factory)
    message = str(caught.value)
    assert name + ":" in message
    assert value in message or repr(float(value)) in message


class FakePids:
    """Stands in for os.getpid in prometheus_client's multiprocess values."""

    def __init__(self) -> None:
        self.pid = 101

    def __call__(self) -> int:
        return self.pid


@pytest.fixture
def multiprocess(tmp_path, monkeypatch):
    """prometheus_client in multiprocess mode on a fresh directory, as under gunicorn."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import values

    import npu_sync.prometheus as exporter_module

    directory = tmp_path / "prometheus"
    directory.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
    pids = FakePids()
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue(pids))
    monkeypatch.setattr(exporter_module, "_files_by_namespace", {})
    monkeypatch.setattr(exporter_module, "_private_registry", None)
    yield pids, directory
    close = getattr(values, "close_all_multiprocess_files", None)
    if close is not None:
        close()


def scraped(body: bytes, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        s.value
        for f in text_string_to_metric_families(body.decode())
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


@pytest.mark.parametrize(
    "damage",
    ["truncated", "corrupt", "empty"],
)
def test_a_metrics_file_left_broken_by_a_killed_child_does_not_fail_every_scrape(
    net, multiprocess, damage, caplog
):
    """A child killed while creating its metrics file leaves it cut short: the scrape
    still answers with every readable process's counters, and the bad file is named."""
    from npu_sync.prometheus import instrument, metrics_text

    _pids, directory = multiprocess
    with WorkerPool(make_config("a"), transport_factory=net.factory) as pool, instrument(pool):
        for _ in range(3):
            pool.execute({})
        before = metrics_text(pool)[0]
        good = next(p for p in directory.iterdir() if p.name.startswith("counter_"))
        bad = directory / "counter_99999.db"
        data = good.read_bytes()
        bad.write_bytes(
            {
                "truncated": data[:37],
                "corrupt": data[:8] + struct.pack("i", 1 << 20) + data[12:],
                "empty": b"",
            }[damage]
        )
        with caplog.at_level("WARNING", logger="npu_sync.prometheus"):
            after = metrics_text(pool)[0]
    assert scraped(after, "npu_sync_tasks_total", outcome="succeeded") == 3
    assert scraped(after, "npu_sync_tasks_total", outcome="succeeded") == scraped(
        before, "npu_sync_tasks_total", outcome="succeeded"
    )
    if damage != "empty":  # an empty file reads as no metrics: nothing to warn of
        assert "counter_99999.db" in caplog.text


def test_counters_add_up_across_a_child_restart_and_never_go_back(net, multiprocess):
    """A child that exits and is replaced: every scrape, from any process, reads counters at
    least as high as the one before."""
    from prometheus_client.multiprocess import mark_process_dead

    from npu_sync.prometheus import instrument, metrics_text

    pids, directory = multiprocess
    readings = []
    for pid in (101, 102, 103):
        pids.pid = pid
        with (
            WorkerPool(make_config("a"), transport_factory=net.factory) as pool,
            instrument(pool),
        ):
            for _ in range(pid - 100):
                pool.execute({})
                readings.append(
                    scraped(metrics_text(pool)[0], "npu_sync_tasks_total", outcome="succeeded")
                )
        mark_process_dead(pid, str(directory))
    assert readings == sorted(readings) and readings[-1] == 1 + 2 + 3
