"""Reload: applying a new configuration as a diff, and the file watcher."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import pytest

from npu_sync import ConfigError, NpuSyncError, WorkerPool
from npu_sync._reload import ConfigWatcher
from npu_sync._schema import hot_merge, integer, section
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    RetryConfig,
    TransportConfig,
    worker_config,
)
from npu_sync.testing import FakeClock, FakeNetwork, json_response


def config(*workers, **kw) -> PoolConfig:
    kw.setdefault("health", HealthConfig(enabled=False))
    kw.setdefault("circuit_breaker", BreakerConfig(fail_max=1, reset_timeout=60))
    return PoolConfig(workers=tuple(workers), **kw)


A = worker_config("a", "http://127.0.0.1:9501")
B = worker_config("b", "http://127.0.0.1:9502")
C = worker_config("c", "http://127.0.0.1:9503")


def echo(req):
    if req.path == "/health":  # a worker's health answer, as the protocol writes it
        return json_response(200, {"status": "healthy"})
    return json_response(200, {"worker_id": req.worker_id})


def test_reload_reports_and_applies_the_diff_by_worker_id():
    """Added, removed, updated and unchanged workers are told apart by id."""
    net = FakeNetwork(echo)
    with WorkerPool(config(A, B), transport_factory=net.factory) as pool:
        b2 = worker_config("b", "http://127.0.0.1:9502", priority=5)
        result = pool.reload(config(A, b2, C))
        assert (result.added, result.removed, result.updated, result.unchanged) == (
            ("c",),
            (),
            ("b",),
            ("a",),
        )
        result = pool.reload(config(b2, C))
        assert result.removed == ("a",) and result.changed
        assert [w["id"] for w in pool.workers()] == ["c", "b"]  # c is tier 1, b tier 5
        assert not pool.reload(config(b2, C)).changed


def test_unchanged_workers_keep_breaker_state_and_statistics():
    """A reload that leaves a worker alone keeps its open breaker and its counters."""
    net = FakeNetwork(echo)
    net.route("a", lambda req: json_response(500, {"detail": "down"}))
    with WorkerPool(config(A, B), transport_factory=net.factory, clock=FakeClock()) as pool:
        pool.execute({"x": 1})
        pool.execute({"x": 2})
        before = {w["id"]: w for w in pool.workers()}
        assert before["a"]["breaker"]["state"] == "open"
        pool.reload(config(A, B, C))
        after = {w["id"]: w for w in pool.workers()}
        assert after["a"]["breaker"] == before["a"]["breaker"]
        assert after["a"]["tasks"] == before["a"]["tasks"]
        assert after["b"]["tasks"] == before["b"]["tasks"]


def test_a_worker_whose_address_changes_gets_new_connections_and_a_fresh_breaker():
    """Changing a worker's url closes its old transport and resets its breaker."""
    net = FakeNetwork(echo)
    net.route("a", lambda req: json_response(500, {"detail": "down"}))
    with WorkerPool(config(A, B), transport_factory=net.factory, clock=FakeClock()) as pool:
        pool.execute({"x": 1})
        old = [t for t in net.transports("a")]
        moved = worker_config("a", "http://127.0.0.1:9601")
        net.route("a", echo)
        assert pool.reload(config(moved, B)).updated == ("a",)
        assert all(t.closed for t in old)
        state = {w["id"]: w for w in pool.workers()}["a"]
        assert state["breaker"]["state"] == "closed" and state["url"] == "http://127.0.0.1:9601"


def test_removed_worker_drains_its_in_flight_task_and_gets_no_new_one():
    """A worker removed while busy finishes its task, then its connections close."""
    net = FakeNetwork(echo)
    release, started = threading.Event(), threading.Event()

    def slow(req):
        started.set()
        release.wait(5)
        return json_response(200, {"worker_id": "a"})

    net.route("a", slow)
    with WorkerPool(config(A, B), transport_factory=net.factory) as pool:
        future = pool.submit({"x": 1})
        assert started.wait(5)
        pool.remove_worker("a")
        rows = {w["id"]: w for w in pool.workers()}
        assert rows["a"]["removed"] and rows["a"]["draining"] and rows["a"]["in_flight"] == 1
        assert pool.stats()["tasks"]["in_flight"] == 1 and pool.stats()["workers"]["total"] == 1
        assert {pool.execute({"x": i})["worker_id"] for i in range(5)} == {"b"}
        (task_transport,) = [t for t in net.transports("a") if not t.closed]
        release.set()
        assert future.result(5) == {"worker_id": "a"}
        assert task_transport.closed
        assert [w["id"] for w in pool.workers()] == ["b"]  # gone once drained


def test_add_and_remove_worker_at_run_time():
    """add_worker() makes a worker eligible at once; duplicates and unknowns are errors."""
    net = FakeNetwork(echo)
    with WorkerPool(config(A), transport_factory=net.factory) as pool:
        pool.add_worker(id="z", url="http://127.0.0.1:9700", priority=0)
        assert pool.execute({"x": 1})["worker_id"] == "z"
        with pytest.raises(ValueError, match="already in the pool"):
            pool.add_worker(A)
        with pytest.raises(ConfigError, match=r"worker\.url"):
            pool.add_worker(id="bad", url="ftp://x")
        pool.remove_worker("z", drain=False)
        assert pool.execute({"x": 1})["worker_id"] == "a"
        with pytest.raises(KeyError, match="no worker 'z'"):
            pool.remove_worker("z")


def test_pool_settings_apply_to_later_tasks_and_sections_needing_restart_are_named():
    """Retry changes take effect; transport changes are reported, not applied."""
    net = FakeNetwork(lambda req: json_response(503, {"detail": "busy"}))
    workers = [worker_config(n, f"http://127.0.0.1:{9800 + i}") for i, n in enumerate("pqrs")]
    retry0 = RetryConfig(max_retries=0, backoff_initial=0, backoff_max=0)
    with WorkerPool(config(*workers, retry=retry0), transport_factory=net.factory) as pool:
        with pytest.raises(Exception) as first:
            pool.execute({"x": 1})
        assert len(first.value.attempts) == 1
        retry2 = RetryConfig(max_retries=2, backoff_initial=0, backoff_max=0)
        new = config(*workers, retry=retry2, transport=TransportConfig(client="requests"))
        result = pool.reload(new)
        assert result.settings_changed and result.restart_required == ("transport",)
        assert pool.config.transport.client == "builtin"
        with pytest.raises(Exception) as second:
            pool.execute({"x": 1})
        assert len(second.value.attempts) == 3


def test_a_reload_changing_only_models_or_reload_keys_is_reported_as_applied():
    """``models.*`` and ``reload.*`` are hot keys: a reload applies them and says so."""
    net = FakeNetwork(echo)
    with WorkerPool(config(A, B), transport_factory=net.factory) as pool:
        models = dataclasses.replace(pool.config.models, refresh_on_health=False)
        result = pool.reload(config(A, B, models=models))
        assert result.settings_changed and result.restart_required == ()
        assert pool.config.models.refresh_on_health is False
        guard = dataclasses.replace(pool.config.reload, max_removed_share=0.9)
        result = pool.reload(config(A, B, models=models, reload=guard))
        assert result.settings_changed and result.restart_required == ()
        assert pool.config.reload.max_removed_share == 0.9
        assert not pool.reload(config(A, B, models=models, reload=guard)).changed


def test_a_reload_changing_fleet_keys_keeps_them_and_names_the_section():
    """``fleet.*`` keys are not hot: the running value stays, in ``pool.config`` too."""
    net = FakeNetwork(echo)
    with WorkerPool(config(A), transport_factory=net.factory) as pool:
        running = pool.config.fleet
        fleet = dataclasses.replace(running, interval=running.interval * 2)
        result = pool.reload(config(A, fleet=fleet))
        assert result.restart_required == ("fleet",) and not result.settings_changed
        assert pool.config.fleet == running


@dataclasses.dataclass(frozen=True)
class _Inner:
    warm: int = integer(1, 0, 9, "applied")
    cold: int = integer(1, 0, 9, "kept", hot=False)


@dataclasses.dataclass(frozen=True)
class _Outer:
    inner: _Inner = section(_Inner, "a hot section with a cold key")
    kept: _Inner = section(_Inner, "a cold section", hot=False)
    top: int = integer(1, 0, 9, "applied")


def test_hot_merge_follows_each_keys_declaration_at_any_depth():
    """The one rule: a key not hot (or inside a section not hot) keeps its value."""
    old = _Outer()
    new = _Outer(inner=_Inner(warm=2, cold=3), kept=_Inner(warm=4, cold=5), top=6)
    merge = hot_merge(old, new)
    assert merge.config == _Outer(inner=_Inner(warm=2, cold=1), kept=_Inner(), top=6)
    assert merge.cold == ("inner.cold", "kept")
    assert merge.hot == ("inner.warm", "top")
    same = _Outer()
    unchanged = hot_merge(old, same)
    assert unchanged.config is same and unchanged.cold == () and unchanged.hot == ()
    assert hot_merge(old, new, skip=frozenset({"kept"})).cold == ("inner.cold",)


def test_bad_file_keeps_the_running_config_and_is_counted(tmp_path):
    """A broken YAML raises from reload(), keeps every worker and shows in stats()."""
    path = tmp_path / "pool.yaml"
    path.write_text("npu_workers:\n  workers:\n    - {id: a, url: 'http://127.0.0.1:9901'}\n")
    net = FakeNetwork(echo)
    with WorkerPool.from_yaml(path, watch=False, transport_factory=net.factory) as pool:
        path.write_text("npu_workers:\n  workers:\n    - {id: a, port: 0, host: x}\n")
        with pytest.raises(ConfigError, match=r"workers\[0\].port"):
            pool.reload()
        reloads = pool.stats()["reloads"]
        assert reloads["failed"] == 1 and "port" in reloads["last_error"]
        assert pool.execute({"x": 1})["worker_id"] == "a"
        path.write_text(
            "npu_workers:\n  workers:\n    - {id: a, url: 'http://127.0.0.1:9901'}\n"
            "    - {id: b, url: 'http://127.0.0.1:9902'}\n"
        )
        assert pool.reload().added == ("b",)
        assert pool.stats()["reloads"]["ok"] == 1
        assert pool.stats()["reloads"]["last_error"] is None


def test_reload_without_a_file_needs_a_config():
    """A pool built from an object cannot re-read a file it never had."""
    pool = WorkerPool(config(A), transport_factory=FakeNetwork(echo).factory)
    with pool, pytest.raises(NpuSyncError, match="not built from a file"):
        pool.reload()


# -- the watcher ---------------------------------------------------------------------------


class Calls:
    def __init__(self) -> None:
        self.count = 0
        self.texts: list[str | None] = []
        self.cond = threading.Condition()

    def __call__(self, text: str | None) -> None:
        with self.cond:
            self.count += 1
            self.texts.append(text)
            self.cond.notify_all()

    def wait_for(self, n: int, timeout: float = 5.0) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.count >= n, timeout)


@pytest.fixture
def watched(tmp_path):
    path = tmp_path / "pool.yaml"
    path.write_text("v: 1\n")
    calls = Calls()
    watcher = ConfigWatcher(path, calls, debounce=0.05, poll_interval=3600)
    watcher.start()
    yield path, calls, watcher
    watcher.stop()


def test_watcher_sees_an_in_place_write(watched):
    """Writing the file calls back once the events settle."""
    path, calls, _ = watched
    path.write_text("v: 2\n")
    assert calls.wait_for(1)


def test_watcher_sees_an_atomic_rename(watched):
    """A temp file renamed over the config (an editor's save) is seen."""
    path, calls, _ = watched
    tmp = path.with_name(".pool.yaml.tmp")
    tmp.write_text("v: 3\n")
    os.replace(tmp, path)
    assert calls.wait_for(1)


def test_watcher_ignores_other_files_in_the_directory(tmp_path):
    """Events for unrelated files (a dead-letter database beside the config) set no flag."""
    from watchdog.events import FileModifiedEvent, FileMovedEvent

    from npu_sync._reload import _flag_handler

    flag = threading.Event()
    handler = _flag_handler()(frozenset({"pool.yaml"}), flag)
    handler.on_any_event(FileModifiedEvent(str(tmp_path / "npu_dead_letters.sqlite3")))
    handler.on_any_event(FileModifiedEvent(str(tmp_path / "pool.yaml.bak")))
    assert not flag.is_set()
    handler.on_any_event(FileMovedEvent(str(tmp_path / ".tmp123"), str(tmp_path / "pool.yaml")))
    assert flag.is_set()
    flag.clear()
    handler.on_any_event(FileMovedEvent(str(tmp_path / "..data_tmp"), str(tmp_path / "..data")))
    assert flag.is_set()


def test_watcher_survives_an_exception_in_the_callback(tmp_path):
    """A failing reload is logged; the next change still calls back."""
    path = tmp_path / "pool.yaml"
    path.write_text("v: 1\n")
    calls = Calls()

    def flaky(text: str | None) -> None:
        calls(text)
        if calls.count == 1:
            raise RuntimeError("first reload breaks")

    watcher = ConfigWatcher(path, flaky, debounce=0.05, poll_interval=3600)
    watcher.start()
    try:
        path.write_text("v: 2\n")
        assert calls.wait_for(1)
        path.write_text("v: 3\n")
        assert calls.wait_for(2)
    finally:
        watcher.stop()


def test_kubernetes_style_symlink_swap_is_seen(tmp_path):
    """The ConfigMap update (..data symlink swapped to a new directory) triggers a reload."""
    first = tmp_path / "..2026_01_01"
    first.mkdir()
    (first / "pool.yaml").write_text("v: 1\n")
    (tmp_path / "..data").symlink_to(first.name)
    (tmp_path / "pool.yaml").symlink_to("..data/pool.yaml")
    calls = Calls()
    watcher = ConfigWatcher(tmp_path / "pool.yaml", calls, debounce=0.05, poll_interval=3600)
    watcher.start()
    try:
        second = tmp_path / "..2026_01_02"
        second.mkdir()
        (second / "pool.yaml").write_text("v: 2\n")
        (tmp_path / "..data_tmp").symlink_to(second.name)
        os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
        assert calls.wait_for(1)
        assert (tmp_path / "pool.yaml").read_text() == "v: 2\n"
    finally:
        watcher.stop()


def test_periodic_recheck_without_events(tmp_path):
    """With no file-system events at all the watcher still re-checks on its interval."""
    path = tmp_path / "pool.yaml"
    path.write_text("v: 1\n")
    calls = Calls()
    watcher = ConfigWatcher(path, calls, debounce=0.01, poll_interval=0.05)
    watcher.start()
    try:
        assert calls.wait_for(2)
    finally:
        watcher.stop()


def test_watcher_stops_promptly_and_leaves_no_thread(tmp_path):
    """stop() ends the observer and the reload thread."""
    path = tmp_path / "pool.yaml"
    path.write_text("v: 1\n")
    watcher = ConfigWatcher(path, lambda text: None, poll_interval=3600)
    watcher.start()
    names = {t.name for t in threading.enumerate()}
    assert {"npu-sync-reload", "npu-sync-watchdog"} <= names
    watcher.stop()
    left = {t.name for t in threading.enumerate()} & {"npu-sync-reload", "npu-sync-watchdog"}
    assert not left


def test_pool_follows_a_kubernetes_configmap_update(tmp_path):
    """A pool watching a ConfigMap-style mount picks up the swapped ..data directory."""
    v1 = tmp_path / "..v1"
    v1.mkdir()
    (v1 / "npu_workers.yaml").write_text(
        "npu_workers:\n  workers:\n    - {id: a, url: 'http://127.0.0.1:9951'}\n"
        "  health: {enabled: false}\n"
    )
    (tmp_path / "..data").symlink_to(v1.name)
    (tmp_path / "npu_workers.yaml").symlink_to("..data/npu_workers.yaml")
    net = FakeNetwork(echo)
    with WorkerPool.from_yaml(tmp_path / "npu_workers.yaml", transport_factory=net.factory) as pool:
        v2 = tmp_path / "..v2"
        v2.mkdir()
        (v2 / "npu_workers.yaml").write_text(
            "npu_workers:\n  workers:\n    - {id: a, url: 'http://127.0.0.1:9951'}\n"
            "    - {id: b, url: 'http://127.0.0.1:9952', priority: 0}\n"
            "  health: {enabled: false}\n"
        )
        (tmp_path / "..data_tmp").symlink_to(v2.name)
        os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
        changed = threading.Event()
        deadline = 5.0
        while not changed.wait(0.01) and deadline > 0:
            deadline -= 0.01
            if "b" in [w["id"] for w in pool.workers()]:
                changed.set()
        assert changed.is_set(), "the swapped configuration was not applied"
        assert pool.execute({"x": 1})["worker_id"] == "b"
        assert pool.stats()["reloads"]["last_change"]["added"] == ["b"]


def test_the_pools_own_read_of_the_file_does_not_trigger_another_reload(tmp_path):
    """Opening and reading the config (as a reload does) is not a change."""
    path = tmp_path / "pool.yaml"
    path.write_text("v: 1\n")
    calls = Calls()

    def read_it(text: str | None) -> None:
        calls(text)
        path.read_text()  # what a reload does

    watcher = ConfigWatcher(path, read_it, debounce=0.05, poll_interval=3600)
    watcher.start()
    try:
        path.write_text("v: 2\n")
        assert calls.wait_for(1)
        assert not calls.wait_for(2, timeout=0.5), "the reload's own read triggered a reload"
    finally:
        watcher.stop()


def test_a_moved_worker_starts_fresh_and_stale_outcomes_are_ignored():
    """A new address resets health and breaker; a late failure from the old one is ignored."""
    net = FakeNetwork(echo)
    gate, started = threading.Event(), threading.Event()

    def old_address(req):
        if req.path == "/health":
            return json_response(503, {"status": "down"})
        started.set()
        gate.wait(5)
        return json_response(500, {"detail": "old address failing"})

    net.route("a", old_address)
    health = HealthConfig(enabled=False, unhealthy_threshold=1)
    with WorkerPool(config(A, health=health), transport_factory=net.factory) as pool:
        in_flight = pool.submit({"x": 1}, timeout=5)
        assert started.wait(5)
        pool.check_health()
        assert pool.workers()[0]["healthy"] is False
        net.route("a", echo)
        pool.reload(config(worker_config("a", "http://127.0.0.1:9777"), health=health))
        row = pool.workers()[0]
        assert row["healthy"] is True and row["health"] is None
        gate.set()
        # It failed on the old address; a, its only worker, was tried again at the new.
        assert in_flight.result(5) == {"worker_id": "a"}
        row = pool.workers()[0]
        assert row["breaker"]["failures"] == 0 and row["tasks"]["failed"] == 0
        assert pool.execute({"x": 2}) == {"worker_id": "a"}


def test_reload_with_a_config_object_keeps_watching_the_file(tmp_path):
    """pool.reload(config) on a file-backed pool does not lose the file."""
    path = tmp_path / "pool.yaml"
    path.write_text("npu_workers:\n  workers:\n    - {id: a, url: 'http://127.0.0.1:9901'}\n")
    net = FakeNetwork(echo)
    with WorkerPool.from_yaml(path, watch=False, transport_factory=net.factory) as pool:
        pool.reload(config(A, B))
        assert pool.config.source == str(path)
        assert pool.reload().removed == ("b",)


def test_a_closed_pool_refuses_changes():
    """add_worker, remove_worker and reload after close() raise PoolClosed."""
    from npu_sync import PoolClosed

    pool = WorkerPool(config(A), transport_factory=FakeNetwork(echo).factory)
    pool.close()
    for change in (
        lambda: pool.add_worker(B),
        lambda: pool.remove_worker("a"),
        lambda: pool.reload(config(A, B)),
    ):
        with pytest.raises(PoolClosed):
            change()


def test_a_waiter_whose_last_candidate_is_removed_fails_at_once():
    """Removing the only worker a waiting task could use ends its wait, not its deadline."""
    gate, started = threading.Event(), threading.Event()

    def slow(req):
        started.set()
        gate.wait(5)
        return json_response(200, {"worker_id": "a"})

    net = FakeNetwork(echo)
    net.route("a", slow)
    one = worker_config("a", "http://127.0.0.1:9501", max_concurrent=1)
    with WorkerPool(config(one), transport_factory=net.factory) as pool:
        busy = pool.submit({"x": 0})
        assert started.wait(5)
        waiting = pool.submit({"x": 1}, timeout=30)
        while pool.stats()["tasks"]["waiting"] < 1:
            threading.Event().wait(0.001)
        began = time.monotonic()
        pool.remove_worker("a")
        with pytest.raises(NpuSyncError):
            waiting.result(10)
        assert time.monotonic() - began < 5
        gate.set()
        busy.result(5)


def test_breaker_settings_reach_existing_breakers_and_capacity_resizes_connections():
    """A reload's fail_max applies to running breakers; a new max_concurrent gets a new pool."""
    net = FakeNetwork(echo)
    net.route("a", lambda req: json_response(500, {"detail": "down"}))
    with WorkerPool(config(A, B), transport_factory=net.factory, clock=FakeClock()) as pool:
        pool.reload(config(A, B, circuit_breaker=BreakerConfig(fail_max=3, reset_timeout=60)))
        pool.execute({"x": 1})
        pool.execute({"x": 2})
        assert {w["id"]: w["breaker"]["state"] for w in pool.workers()}["a"] == "closed"
        before = [t for t in net.transports("b") if not t.closed]
        bigger = worker_config("b", "http://127.0.0.1:9502", max_concurrent=64)
        pool.reload(config(A, bigger, circuit_breaker=BreakerConfig(fail_max=3, reset_timeout=60)))
        assert len([t for t in before if t.closed]) == 1  # the task connections, not health
        row = {w["id"]: w for w in pool.workers()}["b"]
        assert row["capacity"] == 64
        assert len([t for t in net.transports("b") if not t.closed]) == 2  # task + health


def test_close_from_a_reload_hook_does_not_deadlock():
    """A hook that closes the pool when a reload happens returns (no lock is held twice)."""
    from npu_sync.events import ConfigReloaded

    pool = WorkerPool(config(A), transport_factory=FakeNetwork(echo).factory)
    pool.add_hook(lambda event: pool.close() if isinstance(event, ConfigReloaded) else None)
    done = threading.Event()

    def reload_then_signal() -> None:
        pool.reload(config(A, B))
        done.set()

    worker = threading.Thread(target=reload_then_signal)
    worker.start()
    assert done.wait(10), "close() inside a reload hook deadlocked"
    worker.join(5)
    assert pool.closed


def test_a_worker_re_added_while_draining_shows_once():
    """Removing and re-adding a busy worker gives one row per id (Prometheus needs that)."""
    gate, started = threading.Event(), threading.Event()

    def slow(req):
        started.set()
        gate.wait(5)
        return json_response(200, {"worker_id": "a"})

    net = FakeNetwork(echo)
    net.route("a", slow)
    with WorkerPool(config(A), transport_factory=net.factory) as pool:
        busy = pool.submit({"x": 1})
        assert started.wait(5)
        pool.remove_worker("a")
        pool.add_worker(A)
        assert [w["id"] for w in pool.workers()] == ["a"]
        assert pool.stats()["tasks"]["in_flight"] == 1
        gate.set()
        busy.result(5)


def test_a_broken_file_is_counted_once_until_it_changes(tmp_path):
    """Periodic re-checks of the same broken content do not count (and log) it again."""
    path = tmp_path / "pool.yaml"
    path.write_text("npu_workers:\n  workers:\n    - {id: a, url: 'http://127.0.0.1:9901'}\n")
    net = FakeNetwork(echo)
    with WorkerPool.from_yaml(path, watch=False, transport_factory=net.factory) as pool:
        path.write_text("npu_workers: [broken\n")
        for _ in range(3):
            pool._reload_if_changed()  # what the watcher's periodic re-check calls
        assert pool.stats()["reloads"]["failed"] == 1
        path.write_text("npu_workers: {workers: [{id: a, port: 0, host: x}]}\n")
        pool._reload_if_changed()
        assert pool.stats()["reloads"]["failed"] == 2


# -- reloads that must not take a working pool down -------------------------------------

TWO_WORKERS = (
    "npu_workers:\n  workers:\n"
    "    - {id: a, url: 'http://127.0.0.1:9901'}\n"
    "    - {id: b, url: 'http://127.0.0.1:9902'}\n"
)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("npu_workers:\n", "no enabled worker"),  # an in-place rewrite read too early
        ("npu_workers:\n  workers:\n", "no enabled worker"),
        (
            TWO_WORKERS + "  workers: []\n",
            "duplicate key",
        ),
        (
            TWO_WORKERS.replace("{id: b, url: 'http://127.0.0.1:9902'}", "{id: b, enabled: false,"),
            "YAML syntax error",
        ),
        ("npu_workers:\n  workers: " + "[" * 5000 + "]" * 5000 + "\n", "nested deeper"),
    ],
)
def test_a_file_that_would_empty_or_break_the_pool_is_refused_and_counted(tmp_path, text, message):
    """Half-written, duplicated, truncated or absurd files keep both workers."""
    path = tmp_path / "pool.yaml"
    path.write_text(TWO_WORKERS)
    net = FakeNetwork(echo)
    with WorkerPool.from_yaml(path, watch=False, transport_factory=net.factory) as pool:
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            pool.reload()
        assert [w["id"] for w in pool.workers()] == ["a", "b"]
        reloads = pool.stats()["reloads"]
        assert (reloads["ok"], reloads["failed"]) == (0, 1)
        assert message in reloads["last_error"]


def test_a_file_may_empty_the_pool_when_it_says_so(tmp_path):
    """reload.allow_empty: true in the new file lets the reload through."""
    path = tmp_path / "pool.yaml"
    path.write_text(TWO_WORKERS)
    net = FakeNetwork(echo)
    with WorkerPool.from_yaml(path, watch=False, transport_factory=net.factory) as pool:
        path.write_text("npu_workers:\n  workers: []\n  reload: {allow_empty: true}\n")
        assert pool.reload().removed == ("a", "b")
        assert pool.workers() == []


def test_removing_more_than_the_allowed_share_is_refused(tmp_path):
    """Four workers down to one is refused at the default share; the file can allow it."""
    four = "npu_workers:\n  workers:\n" + "".join(
        f"    - {{id: w{i}, url: 'http://127.0.0.1:{9910 + i}'}}\n" for i in range(4)
    )
    one = "npu_workers:\n  workers:\n    - {id: w0, url: 'http://127.0.0.1:9910'}\n"
    path = tmp_path / "pool.yaml"
    path.write_text(four)
    net = FakeNetwork(echo)
    with WorkerPool.from_yaml(path, watch=False, transport_factory=net.factory) as pool:
        path.write_text(one)
        with pytest.raises(ConfigError, match=r"leaves 1 of the 4 enabled workers"):
            pool.reload()
        assert len(pool.workers()) == 4
        path.write_text(one + "  reload: {max_removed_share: 0.75}\n")
        assert pool.reload().removed == ("w1", "w2", "w3")


def test_the_pools_rules_come_from_the_environment_unless_the_file_says(tmp_path, monkeypatch):
    """NPU_SYNC_RELOAD_MAX_REMOVED_SHARE=0 refuses dropping one of two workers from a
    file without a reload section; a file that gives the key wins; replacing passes."""
    monkeypatch.setenv("NPU_SYNC_RELOAD_MAX_REMOVED_SHARE", "0")
    two = "npu_workers:\n  health: {enabled: false}\n  workers:\n" + "".join(
        f"    - {{id: {wid}, url: 'http://127.0.0.1:{port}'}}\n"
        for wid, port in (("a", 9920), ("b", 9921))
    )
    path = tmp_path / "pool.yaml"
    path.write_text(two)
    net = FakeNetwork(echo)
    with WorkerPool.from_yaml(path, watch=False, transport_factory=net.factory) as pool:
        path.write_text(
            two.replace("b, url: 'http://127.0.0.1:9921'", "c, url: 'http://127.0.0.1:9922'")
        )
        assert pool.reload().removed == ("b",)  # replaced, so no loss
        one = two.split("    - {id: b")[0]
        path.write_text(one)
        with pytest.raises(ConfigError, match=r"leaves 1 of the 2 enabled workers"):
            pool.reload()
        path.write_text(one + "  reload: {max_removed_share: 0.5}\n")
        assert pool.reload().removed == ("c",)


def test_a_bad_environment_rule_fails_the_pool_naming_the_variable(monkeypatch):
    """An invalid NPU_SYNC_RELOAD_* value is a ConfigError when the pool is built."""
    monkeypatch.setenv("NPU_SYNC_RELOAD_ALLOW_EMPTY", "perhaps")
    with pytest.raises(ConfigError, match="NPU_SYNC_RELOAD_ALLOW_EMPTY: must be true or false"):
        WorkerPool(config(A), transport_factory=FakeNetwork(echo).factory)


def test_a_reload_with_a_config_object_is_taken_as_meant():
    """The guard is for files: a PoolConfig built in code may empty the pool."""
    with WorkerPool(config(A, B), transport_factory=FakeNetwork(echo).factory) as pool:
        assert pool.reload(config()).removed == ("a", "b")


class ScriptedWatcher(ConfigWatcher):
    """A watcher whose reads of the file follow a script, to test settling alone."""

    def __init__(self, path, reads) -> None:
        super().__init__(path, lambda text: None, debounce=0.001, poll_interval=3600)
        self.script = list(reads)
        self.reads = 0

    def _read(self):
        self.reads += 1
        return self.script.pop(0) if len(self.script) > 1 else self.script[0]


def test_the_watcher_waits_for_two_equal_reads_before_calling_back(tmp_path):
    """Content still changing is read again until it stays the same for a debounce."""
    watcher = ScriptedWatcher(
        tmp_path / "pool.yaml",
        [(True, "npu_workers:\n"), (True, "npu_workers:\n  wor"), (True, "full"), (True, "full")],
    )
    assert watcher._settle() == (True, "full")
    assert watcher.reads == 4


def test_an_unreadable_file_settles_too_and_is_reported_by_the_pool(tmp_path):
    """A file that stays unreadable is handed on (as None) for the pool to count."""
    watcher = ScriptedWatcher(tmp_path / "pool.yaml", [(False, "cannot read: gone")])
    assert watcher._settle() == (False, "cannot read: gone")
    assert watcher.reads == 2


def test_the_watcher_hands_the_settled_text_to_the_callback(tmp_path):
    """The callback gets exactly the content that was compared, not a later read."""
    path = tmp_path / "pool.yaml"
    path.write_text("v: 1\n")
    calls = Calls()
    watcher = ConfigWatcher(path, calls, debounce=0.05, poll_interval=3600)
    watcher.start()
    try:
        path.write_text("v: 2\n")
        assert calls.wait_for(1)
        assert calls.texts[-1] == "v: 2\n"
        path.unlink()
        assert calls.wait_for(2)
        assert calls.texts[-1] is None
    finally:
        watcher.stop()


def test_a_fifo_put_in_place_of_the_file_is_counted_not_waited_on(tmp_path):
    """The pool's reload of a FIFO fails at once, is counted, and keeps the workers."""
    path = tmp_path / "pool.yaml"
    path.write_text(TWO_WORKERS)
    net = FakeNetwork(echo)
    with WorkerPool.from_yaml(path, watch=False, transport_factory=net.factory) as pool:
        path.unlink()
        os.mkfifo(path)
        with pytest.raises(ConfigError, match=r"not a regular file \(a FIFO\)"):
            pool.reload()
        assert pool.stats()["reloads"]["failed"] == 1
        assert len(pool.workers()) == 2


# -- a worker added again while its old self still drains ------------------------------


class Gate:
    """Requests whose body says ``hold`` wait for ``release``; counts requests at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()
        self.now: dict[str, int] = {}
        self.most: dict[str, int] = {}

    def __call__(self, req):
        if req.path == "/health":
            return json_response(200, {"status": "healthy"})
        where = req.headers.get("X-Where", req.worker_id)
        with self.lock:
            self.now[where] = self.now.get(where, 0) + 1
            self.most[where] = max(self.most.get(where, 0), self.now[where])
        try:
            body = req.json()
            if body.get("fail") == req.worker_id:
                return json_response(500, {"detail": "boom"})
            if body.get("hold"):
                self.entered.release()
                assert self.release.wait(10.0)
            return json_response(200, {"worker_id": req.worker_id, "where": where})
        finally:
            with self.lock:
                self.now[where] -= 1

    def wait_entered(self, n: int = 1) -> None:
        for _ in range(n):
            assert self.entered.acquire(timeout=10.0)


def test_a_draining_worker_taken_back_keeps_its_breaker_statistics_and_latency():
    """Worker a, slow to answer its last task, is removed and added again at the same
    address: the pool takes back the very worker, with its breaker's count, its task
    counts and its observed latency, and does not ramp it in again."""
    from npu_sync.config import BalancingConfig

    gate = Gate()
    a = worker_config("a", "http://127.0.0.1:9511", max_concurrent=1, priority=1)
    b = worker_config("b", "http://127.0.0.1:9512", priority=2)

    def cfg(*workers):
        return config(
            *workers,
            circuit_breaker=BreakerConfig(fail_max=3, reset_timeout=60),
            retry=RetryConfig(max_retries=1, backoff_initial=0.0, backoff_max=0.0),
            balancing=BalancingConfig(slow_start=30.0),
        )

    net = FakeNetwork(gate)
    with WorkerPool(cfg(a, b), transport_factory=net.factory) as pool:
        for i in range(3):
            assert pool.execute({"x": i})["worker_id"] == "a"
        assert pool.execute({"fail": "a"})["worker_id"] == "b"  # a fails, b serves
        worker = pool._state.workers["a"]
        before = {r["id"]: r for r in pool.workers()}["a"]
        assert before["breaker"]["failures"] == 1 and before["tasks"]["attempts"] == 4
        held = pool.submit({"hold": 1})
        try:
            gate.wait_entered()
            pool.reload(cfg(b))
            assert pool._state.draining["a"] is worker
            result = pool.reload(cfg(a, b))
            assert result.added == ("a",)
            assert pool._state.workers["a"] is worker and "a" not in pool._state.draining
            row = {r["id"]: r for r in pool.workers()}["a"]
            assert (row["in_flight"], row["draining"], row["removed"]) == (1, False, False)
            assert row["breaker"]["failures"] == 1
            assert row["tasks"]["attempts"] == 4
            assert row["balancing"]["latency_observed"] is True
            assert row["balancing"]["slow_start_until"] is None
            # Full: a task meanwhile goes to b, the lower tier.
            assert pool.execute({"x": "meanwhile"})["worker_id"] == "b"
        finally:
            gate.release.set()
        assert held.result(10.0)["worker_id"] == "a"
        # Its task connections were not closed when its last old task ended.
        assert pool.execute({"x": "after"})["worker_id"] == "a"
        assert not pool._state.draining and pool.stats()["tasks"]["in_flight"] == 0
    assert gate.most["a"] == 1


def test_taking_back_a_worker_while_its_last_tasks_end_never_loses_its_connections():
    """Many rounds of a race: a's last tasks end on their threads while a reload adds a
    back. Whichever wins, a serves afterwards on open connections (no retries to hide a
    closed one), never above its max_concurrent, and nothing is left in flight."""
    gate = Gate()
    a = worker_config("a", "http://127.0.0.1:9513", max_concurrent=2)

    def cfg(*workers):
        return config(*workers, retry=RetryConfig(max_retries=0))

    net = FakeNetwork(gate)
    with WorkerPool(cfg(a), transport_factory=net.factory) as pool:
        for round_ in range(25):
            gate.release = threading.Event()
            held = [pool.submit({"hold": True, "round": round_}) for _ in range(2)]
            gate.wait_entered(2)
            pool.reload(cfg())
            start = threading.Barrier(2)

            def let_go(release=gate.release, start=start):
                start.wait(10.0)
                release.set()

            releaser = threading.Thread(target=let_go)
            releaser.start()
            start.wait(10.0)
            pool.reload(cfg(a))
            releaser.join(10.0)
            assert all(f.result(10.0)["worker_id"] == "a" for f in held), f"round {round_}"
            served = [pool.execute({"x": i}, timeout=10.0)["worker_id"] for i in range(3)]
            assert served == ["a", "a", "a"], f"round {round_}"
            assert not pool._state.draining
            assert [r["in_flight"] for r in pool.workers()] == [0]
        assert pool.stats()["tasks"]["failed"] == 0
    assert gate.most["a"] == 2


def test_a_worker_added_back_at_another_address_is_a_new_worker_beside_the_draining_one():
    """Make before break still holds for a move: a back at a new address is a new
    worker with room of its own while the old address finishes its task, then the old
    one's connections close."""
    gate = Gate()
    old = worker_config("a", "http://127.0.0.1:9514", max_concurrent=1, headers={"X-Where": "old"})
    new = worker_config("a", "http://127.0.0.1:9515", max_concurrent=1, headers={"X-Where": "new"})
    net = FakeNetwork(gate)
    with WorkerPool(config(old), transport_factory=net.factory) as pool:
        held = pool.submit({"hold": 1})
        try:
            gate.wait_entered()
            leaving = pool._state.workers["a"]
            pool.reload(config())
            pool.reload(config(new))
            assert pool._state.workers["a"] is not leaving
            assert pool._state.draining["a"] is leaving
            assert pool.execute({"x": 1}, timeout=10.0)["where"] == "new"
            rows = pool.workers()
            assert [(r["id"], r["url"], r["in_flight"]) for r in rows] == [
                ("a", "http://127.0.0.1:9515", 0)
            ]
        finally:
            gate.release.set()
        assert held.result(10.0)["where"] == "old"
        assert not pool._state.draining and leaving.transport.closed
        assert not pool._state.workers["a"].transport.closed
    assert gate.most == {"old": 1, "new": 1}


def test_a_worker_taken_back_with_a_larger_max_concurrent_counts_its_old_task_in_it():
    """Added back at the same address with max_concurrent 2: the task still there takes
    one of the two, a second task goes to it at once on a transport of the new size,
    and the old task finishes on the old transport."""
    gate = Gate()
    one = worker_config("a", "http://127.0.0.1:9516", max_concurrent=1)
    two = worker_config("a", "http://127.0.0.1:9516", max_concurrent=2)
    net = FakeNetwork(gate)
    with WorkerPool(config(one), transport_factory=net.factory) as pool:
        worker = pool._state.workers["a"]
        first = worker.transport
        held = pool.submit({"hold": 1})
        try:
            gate.wait_entered()
            pool.reload(config())
            pool.reload(config(two))
            assert pool._state.workers["a"] is worker
            row = pool.workers()[0]
            assert (row["in_flight"], row["capacity"]) == (1, 2)
            assert worker.transport is not first and first.closed
            second = pool.submit({"hold": 2})
            gate.wait_entered()
            assert pool.workers()[0]["in_flight"] == 2
        finally:
            gate.release.set()
        assert held.result(10.0)["worker_id"] == "a" and second.result(10.0)["worker_id"] == "a"
        assert not worker.transport.closed
    assert gate.most["a"] == 2


def test_a_worker_whose_last_task_ends_while_it_is_being_added_back_comes_back_afresh():
    """The old self's last task ends after the reload saw it draining but before the
    change is swapped in: its connections are closed by then, so a new worker takes
    the id, and a task after is served on open connections."""
    gate = Gate()
    a = worker_config("a", "http://127.0.0.1:9517", max_concurrent=1)
    net = FakeNetwork(gate)
    armed = threading.Event()
    holder: list[WorkerPool] = []

    def factory(cfg, transport_config, maxsize=None):
        transport = net.factory(cfg, transport_config, maxsize=maxsize)
        if cfg.id == "a" and armed.is_set():
            armed.clear()
            gate.release.set()  # the last task ends while the change is being built
            deadline = time.monotonic() + 10.0
            while holder[0]._state.draining and time.monotonic() < deadline:
                time.sleep(0.001)
        return transport

    with WorkerPool(config(a, retry=RetryConfig(max_retries=0)), transport_factory=factory) as pool:
        holder.append(pool)
        leaving = pool._state.workers["a"]
        held = pool.submit({"hold": 1})
        gate.wait_entered()
        pool.reload(config(retry=RetryConfig(max_retries=0)))
        armed.set()
        pool.reload(config(a, retry=RetryConfig(max_retries=0)))
        assert not armed.is_set() and held.result(10.0)["worker_id"] == "a"
        assert leaving.transport.closed and pool._state.workers["a"] is not leaving
        assert pool.execute({"x": 1}, timeout=10.0)["worker_id"] == "a"
        assert not pool._state.draining and pool.workers()[0]["in_flight"] == 0
