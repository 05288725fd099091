"""Health checks and hot reload against real worker processes, under load."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest

from npu_sync import Task, WorkerPool
from npu_sync.config import HealthConfig, PoolConfig, RetryConfig, worker_config

pytestmark = pytest.mark.integration


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll a condition of the system under test; returns how long it took."""
    started = time.monotonic()
    gate = threading.Event()
    while not predicate():
        assert time.monotonic() - started < timeout, f"timed out waiting for {what}"
        gate.wait(0.01)
    return time.monotonic() - started


def by_id(pool: WorkerPool) -> dict[str, dict]:
    return {w["id"]: w for w in pool.workers()}


def test_failing_health_takes_a_worker_out_and_recovery_brings_it_back(start_worker):
    """/health turning 503 while inference still answers stops tasks to that worker."""
    a, b = start_worker(worker_id="a"), start_worker(worker_id="b")
    health = HealthConfig(interval=0.1, timeout=0.5, unhealthy_threshold=2, healthy_threshold=1)
    config = PoolConfig(
        workers=(worker_config("a", a.url), worker_config("b", b.url)), health=health
    )
    with WorkerPool(config) as pool:
        assert {pool.execute({"input_text": str(i)})["worker_id"] for i in range(20)} == {"a", "b"}
        a.control(health_status="unhealthy")
        rounds = pool.stats()["health"]["rounds"]
        wait_until(lambda: not by_id(pool)["a"]["healthy"], 5, "a to turn unhealthy")
        # Two failed checks (the threshold): each worker is checked once per interval,
        # at a slot of its own, so they span one interval boundary at least, and need
        # no more than a couple besides (the check running when /health turned, one
        # to spare).
        assert 1 <= pool.stats()["health"]["rounds"] - rounds <= 4
        assert {pool.execute({"input_text": str(i)})["worker_id"] for i in range(40)} == {"b"}
        a.control(health_status="healthy")
        wait_until(lambda: by_id(pool)["a"]["healthy"], 5, "a to recover")
        # Back in service, "a" ramps up from a tenth of its share (slow start): one task
        # at a time, it wins a selection by chance at first, so look until it does.
        served = (pool.execute({"input_text": str(i)})["worker_id"] for i in range(2000))
        assert "a" in served


def test_hung_worker_delays_neither_other_checks_nor_close(start_worker):
    """A worker that accepts and never answers costs one health timeout, no more."""
    hung, fine = start_worker(worker_id="hung"), start_worker(worker_id="fine")
    hung.control(hang=True)
    health = HealthConfig(interval=30, timeout=0.5, unhealthy_threshold=1)
    config = PoolConfig(
        workers=(worker_config("hung", hung.url), worker_config("fine", fine.url)),
        health=health,
    )
    pool = WorkerPool(config)
    try:
        # The health thread's first round runs at start; a check of a worker whose
        # previous check still runs is refused, so let that round end first.
        wait_until(lambda: pool.stats()["health"]["rounds"] >= 1, 5, "the first round")
        # The hung worker never answers: the round can only end by its timeout.
        results = pool.check_health()
        assert results["fine"]["ok"] is True and results["hung"]["ok"] is False
        assert pool.execute({"input_text": "x"})["worker_id"] == "fine"
    finally:
        closer = threading.Thread(target=pool.close)
        closer.start()
        closer.join(10)  # the hung worker never answers: close() must not wait for it
    assert not closer.is_alive(), "close() waited for the hung worker"
    assert not [t for t in threading.enumerate() if t.name.startswith("npu-sync")]


def write_atomically(path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def yaml_for(workers) -> str:
    lines = ["npu_workers:", "  workers:"]
    lines += [f"    - {{id: {w.worker_id}, url: '{w.url}', max_concurrent: 8}}" for w in workers]
    lines += [
        "  health: {interval: 0.5, timeout: 0.5}",
        "  retry: {max_retries: 3, backoff_initial: 0.01, backoff_max: 0.05}",
    ]
    return "\n".join(lines) + "\n"


class Load:
    """16 threads calling execute() in a loop until stopped; counts every outcome."""

    def __init__(self, pool: WorkerPool, threads: int = 16) -> None:
        self.pool = pool
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.ok = 0
        self.errors: list[BaseException] = []
        self.by_worker: dict[str, int] = {}
        self.threads = [threading.Thread(target=self._run) for _ in range(threads)]

    def _run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                result = self.pool.execute({"input_text": f"load {n}"})
            except Exception as exc:
                with self.lock:
                    self.errors.append(exc)
                continue
            with self.lock:
                self.ok += 1
                worker = result["worker_id"]
                self.by_worker[worker] = self.by_worker.get(worker, 0) + 1

    def done(self) -> int:
        with self.lock:
            return self.ok

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


@pytest.mark.slow
def test_yaml_rewrites_under_load_add_remove_and_survive_a_broken_file(start_worker, tmp_path):
    """Add a worker, remove one, then save a syntax error: no task fails or is lost."""
    ws = [start_worker(worker_id=f"w{i}", latency_ms=10) for i in range(4)]
    path = tmp_path / "npu_workers.yaml"
    path.write_text(yaml_for(ws[:3]))
    with WorkerPool.from_yaml(path) as pool, Load(pool) as load:
        wait_until(lambda: load.done() >= 100, 20, "the load to get going")

        write_atomically(path, yaml_for(ws))
        wait_until(lambda: load.by_worker.get("w3", 0) > 0, 5, "w3 to receive tasks")

        write_atomically(path, yaml_for([ws[0], ws[2], ws[3]]))
        wait_until(lambda: "w1" not in by_id(pool), 5, "w1 to be removed")
        mark = load.done()
        wait_until(lambda: load.done() >= mark + 100, 20, "tasks after the removal")
        served = ws[1].stats()["requests"].get("/inference", 0)
        mark = load.done()
        wait_until(lambda: load.done() >= mark + 200, 20, "more tasks after the removal")
        assert ws[1].stats()["requests"].get("/inference", 0) == served

        write_atomically(path, yaml_for(ws) + "  retry: [unclosed\n")
        wait_until(lambda: pool.stats()["reloads"]["failed"] >= 1, 5, "the failed reload")
        assert "YAML syntax error" in pool.stats()["reloads"]["last_error"]
        mark = load.done()
        wait_until(lambda: load.done() >= mark + 100, 20, "tasks after the broken save")
        assert sorted(by_id(pool)) == ["w0", "w2", "w3"]
    assert load.errors == []
    assert pool.stats()["tasks"]["failed"] == 0
    assert pool.stats()["tasks"]["succeeded"] == load.ok


def test_close_ends_every_thread_and_observer(start_worker, tmp_path):
    """After close() no thread the pool started (tasks, health, reload, watchdog) is left."""
    w = start_worker(worker_id="solo")
    path = tmp_path / "npu_workers.yaml"
    path.write_text(yaml_for([w]))
    before = set(threading.enumerate())
    pool = WorkerPool.from_yaml(path)
    assert [f.result(10)["worker_id"] for f in [pool.submit({"input_text": "x"})]] == ["solo"]
    pool.check_health()
    started = {t.name for t in set(threading.enumerate()) - before}
    assert {"npu-sync-health", "npu-sync-reload", "npu-sync-watchdog"} <= started
    assert any(name.startswith("npu-sync-task") for name in started)
    pool.close()
    assert set(threading.enumerate()) - before == set()


def test_retry_settings_follow_the_file(start_worker, tmp_path):
    """A reload that changes retry settings applies them to the next task."""
    ws = [start_worker(worker_id=f"r{i}") for i in range(3)]
    for w in ws:
        w.control(status_code=503)
    path = tmp_path / "npu_workers.yaml"
    path.write_text(yaml_for(ws).replace("max_retries: 3", "max_retries: 0"))
    with WorkerPool.from_yaml(path, watch=False) as pool:
        with pytest.raises(Exception) as first:
            pool.execute({"input_text": "x"})
        assert len(first.value.attempts) == 1
        path.write_text(yaml_for(ws).replace("max_retries: 3", "max_retries: 2"))
        assert pool.reload().settings_changed
        assert pool.config.retry == RetryConfig(
            max_retries=2, backoff_initial=0.01, backoff_max=0.05
        )
        with pytest.raises(Exception) as second:
            pool.execute({"input_text": "x"})
        assert len(second.value.attempts) == 3


# -- replacing workers: make before break -------------------------------------------


def _one_worker_file(worker_id: str, url: str, extra: str = "") -> str:
    return (
        "npu_workers:\n"
        "  health: {interval: 3600, timeout: 1, healthy_threshold: 1}\n"
        f"{extra}"
        "  workers:\n"
        f"    - {{id: {worker_id}, url: '{url}'}}\n"
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_replacing_the_only_worker_hands_tasks_over_make_before_break(start_worker, tmp_path):
    """w1 replaced by w4: accepted; w1 serves until w4 passes a health check, its task
    in flight then finishes on it, and every later task goes to w4."""
    w1, w4 = start_worker(worker_id="w1"), start_worker(worker_id="w4")
    w4.control(health_status="unhealthy")  # not ready yet when the file is saved
    path = tmp_path / "npu_workers.yaml"
    path.write_text(_one_worker_file("w1", w1.url))
    events: list = []
    with WorkerPool.from_yaml(path, watch=False, hooks=[events.append]) as pool:
        path.write_text(_one_worker_file("w4", w4.url))
        result = pool.reload()
        assert (result.added, result.removed, result.retiring) == (("w4",), ("w1",), ("w1",))
        pool.check_health()
        assert pool.stats()["reloads"]["handover"]["awaited"] == ["w4"]
        assert {pool.execute({"input_text": str(i)})["worker_id"] for i in range(10)} == {"w1"}
        # A repeated save of the same fleet is accepted too, and changes nothing.
        path.write_text(_one_worker_file("w4", w4.url) + "  retry: {max_retries: 2}\n")
        assert pool.reload().retiring == ("w1",)

        w1.control(latency_ms=1500)
        # Declared heavy, so the stall limit (retry.stall) lets it take its time on w1.
        slow = pool.submit(Task({"input_text": "in flight"}, timeout=15))
        wait_until(lambda: by_id(pool)["w1"]["in_flight"] == 1, 10, "a task in flight on w1")
        w4.control(health_status="healthy")
        pool.check_health()
        assert pool.stats()["reloads"]["handover"] is None
        assert {pool.execute({"input_text": str(i)})["worker_id"] for i in range(10)} == {"w4"}
        assert slow.result(timeout=20)["worker_id"] == "w1"
        wait_until(lambda: "w1" not in by_id(pool), 10, "w1 to drain and go")
    names = [e.name for e in events if e.name.startswith("reload.handover")]
    assert names == ["reload.handover_started", "reload.handover_done"]


def test_a_new_worker_that_never_answers_leaves_the_old_one_serving(start_worker, tmp_path):
    """w4 at a port nobody listens on: past the bound w1 still serves (one warning);
    saving the old file again ends the handover and keeps w1 as it was."""
    from npu_sync._guard import ReloadGuard

    w1 = start_worker(worker_id="w1")
    dead = f"http://127.0.0.1:{_free_port()}"
    path = tmp_path / "npu_workers.yaml"
    old = _one_worker_file("w1", w1.url)
    path.write_text(old)
    events: list = []
    guard = ReloadGuard(handover_timeout=0.001)  # from code: the file says nothing
    with WorkerPool.from_yaml(path, watch=False, hooks=[events.append], reload_guard=guard) as pool:
        pool.execute({"input_text": "before"})
        path.write_text(_one_worker_file("w4", dead))
        pool.reload()
        for _ in range(3):
            pool.check_health()
        overdue = [e for e in events if e.name == "reload.handover_overdue"]
        assert [(e.retiring, e.awaited) for e in overdue] == [(("w1",), ("w4",))]
        assert {pool.execute({"input_text": str(i)})["worker_id"] for i in range(10)} == {"w1"}
        assert pool.stats()["reloads"]["handover"]["overdue"] is True

        path.write_text(old)
        result = pool.reload()
        assert (result.removed, result.unchanged, result.retiring) == (("w4",), ("w1",), ())
        assert pool.stats()["reloads"]["handover"] is None
        assert list(by_id(pool)) == ["w1"]
        assert by_id(pool)["w1"]["tasks"]["succeeded"] == 11  # its statistics were kept
