"""Hostile input to the fleet view: garbage snapshots in Redis, clock steps, a publish
racing close(), unusable settings. Each test names a promise and tries to break it."""

# ruff: noqa: F811  (test parameters named after the fixtures imported below)

from __future__ import annotations

import json
import struct
import threading
from typing import Any

import pytest

from npu_sync import ConfigError, WorkerPool
from npu_sync._fleet import (
    MAX_FLEET_PROCESSES,
    MAX_SNAPSHOT_BYTES,
    FleetSettings,
    Monitor,
    monitor_of,
    parse_snapshot,
)
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    RetryConfig,
    SharedStateConfig,
    worker_config,
)
from npu_sync.testing import FakeClock, FakeNetwork, FakeRequest, json_response
from npu_sync.transport import Response

# Fixtures shared with the other fleet tests; pytest finds them by name here.
from tests.fleetkit import STEP, WALL, client, clock, manual, redis_server  # noqa: F401

SHARED = SharedStateConfig(backend="redis", namespace="attack")
INDEX = "{attack}:fleet:index"


def answer(req: FakeRequest) -> Response:
    if req.path == "/health":
        return json_response(200, {"status": "healthy"})
    return json_response(200, {"worker_id": req.worker_id})


def make_config(*ids: str, shared: SharedStateConfig | None = None) -> PoolConfig:
    return PoolConfig(
        workers=tuple(
            worker_config(wid, f"http://127.0.0.1:{9500 + n}", priority=n + 1)
            for n, wid in enumerate(ids)
        ),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=0),
        circuit_breaker=BreakerConfig(fail_max=1, reset_timeout=30),
        shared_state=shared or SharedStateConfig(),
    )


@pytest.fixture
def net() -> FakeNetwork:
    return FakeNetwork(answer)


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


# -- garbage snapshots ---------------------------------------------------------------------------


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
    with WorkerPool(make_config("a", shared=SHARED), transport_factory=net.factory,
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
    with WorkerPool(make_config("a", shared=SHARED), transport_factory=net.factory,
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
    with WorkerPool(make_config("a", shared=SHARED), transport_factory=net.factory,
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
    with WorkerPool(make_config("a", shared=SHARED), transport_factory=net.factory,
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
    with WorkerPool(make_config("a", shared=SHARED), transport_factory=net.factory,
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
    with WorkerPool(make_config("a", shared=SHARED), transport_factory=net.factory,
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
    with WorkerPool(make_config("a", shared=SHARED), transport_factory=net.factory,
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


# -- the clock ----------------------------------------------------------------------------------


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


# -- close() against a publish in flight --------------------------------------------------------


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


# -- settings ------------------------------------------------------------------------------------


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


# -- Prometheus in multiprocess mode -----------------------------------------------------------


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
