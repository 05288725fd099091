"""Pools across fork(): a child starts afresh while the parent has tasks in flight, and a
gunicorn --preload deployment serves from both children and shuts down promptly."""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import traceback
import urllib.request
import warnings
from collections.abc import Callable
from typing import Any

import pytest

import npu_sync
from npu_sync import Task, WorkerPool
from npu_sync.config import HealthConfig, PoolConfig, worker_config
from npu_sync.testing import FakeNetwork, json_response

pytestmark = pytest.mark.integration

PACKAGE_ROOT = str(pathlib.Path(npu_sync.__file__).resolve().parent.parent)


def subprocess_env() -> dict[str, str]:
    """The environment for a child Python that must import this same npu_sync."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return env


def run_in_child(body: Callable[[], dict[str, Any]], timeout: float = 30) -> dict[str, Any]:
    """Fork; run ``body`` in the child and return the JSON dict it reported.

    The child always ends with ``os._exit``; a child that reports nothing within
    ``timeout`` seconds is killed and the test fails.
    """
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads running
        pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        try:
            os.close(read_fd)
            try:
                report: dict[str, Any] = {"ok": body()}
            except BaseException as exc:
                report = {"error": f"{exc!r}\n{traceback.format_exc()}"}
            os.write(write_fd, json.dumps(report, default=repr).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([read_fd], [], [], max(left, 0))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"the forked child reported nothing within {timeout}s (it hung)")
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_fd)
        os.waitpid(pid, 0)
    report = json.loads(b"".join(chunks) or b'{"error": "the child died without a report"}')
    assert "error" not in report, report["error"]
    return report["ok"]


def npu_thread_names() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("npu-sync"))


def close_bounded(pool: WorkerPool, timeout: float = 10) -> bool:
    closer = threading.Thread(target=pool.close)
    closer.start()
    closer.join(timeout)
    return not closer.is_alive()


def test_a_forked_child_starts_afresh_while_the_parent_has_a_task_in_flight():
    """In the child: no active task, execute works, health runs, close() returns."""
    parent = os.getpid()
    gate, started = threading.Event(), threading.Event()

    def handler(req):
        if req.path == "/health":
            # Healthy, truly: the child's first health round races its first task.
            return json_response(200, {"status": "healthy"})
        if os.getpid() == parent:
            started.set()
            gate.wait(30)
        return json_response(200, {"by": req.worker_id, "pid": os.getpid()})

    net = FakeNetwork(handler)
    cfg = PoolConfig(
        workers=(worker_config("a", "http://127.0.0.1:9801", max_concurrent=1),),
        health=HealthConfig(interval=3600, timeout=1),
    )
    pool = WorkerPool(cfg, transport_factory=net.factory)
    try:
        while pool.stats()["health"]["rounds"] < 1:  # no probe mid-flight at the fork
            threading.Event().wait(0.01)
        running = pool.submit({"x": "parent"})
        assert started.wait(10)
        assert pool.stats()["tasks"]["active"] == 1

        def child() -> dict[str, Any]:
            built_before = len(net.transports())
            at_fork = pool.stats()
            result = pool.execute({"x": "child"}, timeout=5)
            after = pool.stats()
            closed = close_bounded(pool)
            return {
                "active": at_fork["tasks"]["active"],
                "in_flight": at_fork["tasks"]["in_flight"],
                "submitted": at_fork["tasks"]["submitted"],
                "result": result,
                "health_running": after["health"]["running"],
                "closed": closed,
                "threads": npu_thread_names(),
                "own_transports_closed": all(t.closed for t in net.transports()[built_before:]),
            }

        report = run_in_child(child)
        assert (report["active"], report["in_flight"], report["submitted"]) == (0, 0, 0)
        assert report["result"]["pid"] != parent  # the child's own request
        assert report["health_running"] is True
        assert report["closed"] is True and report["threads"] == []
        assert report["own_transports_closed"] is True
    finally:
        gate.set()
    assert running.result(10)["pid"] == parent
    assert pool.stats()["tasks"]["active"] == 0
    assert close_bounded(pool)


def test_a_forked_child_uses_connections_of_its_own_to_a_real_worker(start_worker):
    """Parent and child run tasks at once on one worker; every answer is the asker's."""
    worker = start_worker(worker_id="w", latency_ms=300)
    cfg = PoolConfig(
        workers=(worker_config("w", worker.url),), health=HealthConfig(interval=3600, timeout=2)
    )
    pool = WorkerPool(cfg)
    try:
        for n in range(3):  # leave keep-alive connections in the parent's pool
            pool.execute({"model_id": "default", "input_text": f"warm {n}"})
        while pool.stats()["health"]["rounds"] < 1:
            threading.Event().wait(0.01)
        running = [
            pool.submit(Task({"model_id": "default", "input_text": f"p{n}"}, task_id=f"p{n}"))
            for n in range(4)
        ]
        deadline = time.monotonic() + 10
        while worker.stats()["in_flight"] < 1:  # the fork happens mid-request
            assert time.monotonic() < deadline, "the parent's tasks never reached the worker"
            threading.Event().wait(0.01)

        def child() -> dict[str, Any]:
            tasks = [
                Task({"model_id": "default", "input_text": f"c{n}"}, task_id=f"c{n}")
                for n in range(6)
            ]
            answers = list(pool.map(tasks, timeout=10))
            closed = close_bounded(pool)
            return {
                "mismatched": [
                    a["task_id"]
                    for t, a in zip(tasks, answers, strict=True)
                    if a["task_id"] != t.task_id
                ],
                "answered": len(answers),
                "closed": closed,
                "threads": npu_thread_names(),
            }

        report = run_in_child(child)
        assert report == {"mismatched": [], "answered": 6, "closed": True, "threads": []}
        assert [f.result(10)["task_id"] for f in running] == [f"p{n}" for n in range(4)]
    finally:
        assert close_bounded(pool)


AT_EXIT_SCRIPT = """
import atexit, os, sys, threading
from npu_sync import WorkerPool
from npu_sync.config import HealthConfig, PoolConfig, worker_config
from npu_sync.testing import FakeNetwork, json_response

gate, started = threading.Event(), threading.Event()

def handler(req):
    if req.path == "/health":
        return json_response(200, {"status": "healthy"})
    started.set()
    gate.wait(30)
    return json_response(200, {"ok": True})

net = FakeNetwork(handler)
cfg = PoolConfig(
    workers=(worker_config("a", "http://127.0.0.1:9802"),),
    health=HealthConfig(interval=3600, timeout=1),
)
pool = WorkerPool(cfg, transport_factory=net.factory)
atexit.register(pool.close)
running = pool.submit({"x": 1})
assert started.wait(10)
pid = os.fork()
if pid == 0:
    sys.exit(0)  # interpreter exit: the atexit close() must not wait for the parent's task
reaped = []
waiter = threading.Thread(target=lambda: reaped.append(os.waitpid(pid, 0)[1]), daemon=True)
waiter.start()
waiter.join(15)
if waiter.is_alive():
    os.kill(pid, 9)
    print("child-hung", flush=True)
else:
    print(f"child-exited {os.waitstatus_to_exitcode(reaped[0])}", flush=True)
gate.set()
print("parent-result", running.result(10), flush=True)
"""


def test_close_at_exit_in_a_forked_child_does_not_wait_for_the_parents_task():
    """A child exiting normally runs an atexit close() that returns at once."""
    result = subprocess.run(
        [sys.executable, "-c", AT_EXIT_SCRIPT],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["child-exited 0", "parent-result {'ok': True}"], (
        result.stdout + result.stderr
    )


APP = """
import atexit, json, os, pathlib
from npu_sync import WorkerPool

HERE = pathlib.Path(__file__).parent
pool = WorkerPool.from_yaml(HERE / "npu_workers.yaml")


def _close():
    pool.close()
    (HERE / f"closed-{os.getpid()}").write_text("closed")


atexit.register(_close)


def app(environ, start_response):
    if environ["PATH_INFO"] == "/infer":
        result = pool.execute({"model_id": "default", "input_text": "from gunicorn"})
        body = {"pid": os.getpid(), "result": result, "stats": pool.stats()}
    else:
        body = {"pid": os.getpid(), "stats": pool.stats()}
    data = json.dumps(body).encode()
    start_response("200 OK", [("Content-Type", "application/json"),
                              ("Content-Length", str(len(data)))])
    return [data]
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str, timeout: float = 10) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def test_gunicorn_preload_serves_from_both_children_and_stops_promptly(tmp_path, start_worker):
    """--preload --workers 2: both children serve, their health runs, SIGTERM exits fast."""
    worker = start_worker(worker_id="w", latency_ms=300)
    (tmp_path / "npu_workers.yaml").write_text(
        textwrap.dedent(
            f"""
            npu_workers:
              workers:
                - {{id: w, url: '{worker.url}'}}
              health: {{interval: 60, timeout: 2}}
            """
        )
    )
    (tmp_path / "npu_app.py").write_text(APP)
    port = free_port()
    log = (tmp_path / "gunicorn.log").open("w")
    command = [
        sys.executable, "-m", "gunicorn", "--workers", "2", "--preload",
        "--bind", f"127.0.0.1:{port}", "--chdir", str(tmp_path),
        "--graceful-timeout", "30", "npu_app:app",
    ]  # fmt: skip
    master = subprocess.Popen(
        command,
        env=subprocess_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                get_json(base + "/stats", timeout=2)
                break
            except OSError:
                assert master.poll() is None, (tmp_path / "gunicorn.log").read_text()
                assert time.monotonic() < deadline, "gunicorn did not start"
                threading.Event().wait(0.05)
        answers: dict[int, dict[str, Any]] = {}
        with concurrent.futures.ThreadPoolExecutor(2) as callers:
            # A sync worker serves one request at a time: two slow views at once need
            # both children.
            for _ in range(10):
                batch = [callers.submit(get_json, base + "/infer") for _ in range(2)]
                for future in batch:
                    answer = future.result(30)
                    answers[answer["pid"]] = answer
                if len(answers) == 2:
                    break
        assert len(answers) == 2 and master.pid not in answers
        for answer in answers.values():
            assert answer["result"]["worker_id"] == "w"
            stats = answer["stats"]
            assert stats["health"]["running"] is True
            assert stats["tasks"]["succeeded"] >= 1 and stats["tasks"]["failed"] == 0
        began = time.monotonic()
        master.send_signal(signal.SIGTERM)
        master.wait(timeout=20)
        assert time.monotonic() - began < 15
    finally:
        if master.poll() is None:
            master.kill()
            master.wait()
        log.close()
    output = (tmp_path / "gunicorn.log").read_text()
    assert master.returncode == 0, output
    closed = {p.name for p in tmp_path.glob("closed-*")}
    assert {f"closed-{pid}" for pid in answers} <= closed, output
    assert f"closed-{master.pid}" in closed, output


def test_a_forked_child_counts_its_own_work_in_prometheus_and_the_fleet(monkeypatch):
    """After fork the child's exporter and fleet monitor start from zero, as its pool
    does: they report the child's tasks, not the parent's again, under the child's pid."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from npu_sync._fleet import monitor_of
    from npu_sync.prometheus import instrument

    monkeypatch.setenv("NPU_SYNC_FLEET", "manual")
    net = FakeNetwork(lambda req: json_response(200, {"pid": os.getpid()}))
    cfg = PoolConfig(
        workers=(worker_config("a", "http://127.0.0.1:9811"),),
        health=HealthConfig(enabled=False),
    )
    registry = CollectorRegistry()
    with WorkerPool(cfg, transport_factory=net.factory) as pool, instrument(pool, registry):
        for _ in range(3):
            pool.execute({})
        monitor_of(pool).tick()
        parent_id = monitor_of(pool).process["id"]

        def child() -> dict[str, Any]:
            for _ in range(2):
                pool.execute({})
            monitor = monitor_of(pool)
            monitor.tick()
            text = generate_latest(registry).decode()
            succeeded = next(
                s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
                if s.name == "npu_sync_tasks_total" and s.labels["outcome"] == "succeeded"
            )
            fleet = pool.stats(scope="fleet")
            return {
                "succeeded": succeeded,
                "fleet": fleet["totals"]["tasks"]["succeeded"],
                "history": sum(v or 0 for v in monitor.history()["tasks"]["succeeded"]),
                "id": monitor.process["id"],
                "pid": monitor.process["pid"],
            }

        seen = run_in_child(child)
        after = generate_latest(registry).decode()
    assert seen["succeeded"] == 2 and seen["fleet"] == 2 and seen["history"] == 2
    assert seen["id"] != parent_id and seen["pid"] != os.getpid()
    assert 'npu_sync_tasks_total{outcome="succeeded"} 3.0' in after  # the parent's own


@pytest.mark.parametrize("limit", ["aimd", "gradient2", "hill-climbing"])
def test_a_forked_child_keeps_a_consistent_learned_limit_while_the_parent_has_tasks_out(limit):
    """The parent's worker a (max_concurrent 4) had its learned limit cut by a 503 and
    has a task in flight when the process forks. In the child: nothing is in flight,
    a's capacity is what its limit allows, before and after forty tasks of its own
    from four threads (the parent's answer never comes to lift or cut it), every task
    ends there and nothing is left in flight; in the parent, the late answer leaves a
    consistent too."""
    from npu_sync.config import BalancingConfig

    parent = os.getpid()
    gate, started = threading.Event(), threading.Event()
    refused: list[int] = []

    def handler(req):
        body = req.json()
        if body.get("x") == "refuse" and not refused:
            refused.append(1)
            return json_response(503, {"detail": "overloaded"})
        if os.getpid() == parent and body.get("x") == "hold":
            started.set()
            gate.wait(30)
        return json_response(200, {"by": req.worker_id, "pid": os.getpid()})

    net = FakeNetwork(handler)
    cfg = PoolConfig(
        workers=(
            worker_config("a", "http://127.0.0.1:9811", max_concurrent=4),
            worker_config("b", "http://127.0.0.1:9812", priority=2, max_concurrent=4),
        ),
        balancing=BalancingConfig(concurrency_limit=limit),
        health=HealthConfig(enabled=False),
    )
    pool = WorkerPool(cfg, transport_factory=net.factory)
    try:
        pool.execute({"x": "refuse"})  # a's 503 cuts its limit; b serves the task
        before = {row["id"]: row for row in pool.workers()}["a"]
        assert before["capacity"] < 4  # cut from its initial 4
        running = pool.submit({"x": "hold"})
        assert started.wait(10)

        def child() -> dict[str, Any]:
            state = pool._state
            worker = state.workers["a"]
            at_fork = {row["id"]: row for row in pool.workers()}["a"]
            consistent_at_fork = worker.capacity == min(4, worker.limit.current)
            with concurrent.futures.ThreadPoolExecutor(4) as callers:
                results = list(callers.map(lambda i: pool.execute({"x": i}), range(40)))
            after = {row["id"]: row for row in pool.workers()}["a"]
            consistent_after = worker.capacity == min(4, worker.limit.current)
            closed = close_bounded(pool)
            return {
                "at_fork": [at_fork["in_flight"], at_fork["capacity"]],
                "consistent": [consistent_at_fork, consistent_after],
                "after_in_flight": after["in_flight"],
                "results": len(results),
                "pids": sorted({r["pid"] for r in results}),
                "closed": closed,
            }

        report = run_in_child(child)
        assert report["at_fork"] == [0, before["capacity"]]
        assert report["consistent"] == [True, True]
        assert report["after_in_flight"] == 0 and report["results"] == 40
        assert report["pids"] != [parent]
        assert report["closed"] is True
    finally:
        gate.set()
    assert running.result(10)["pid"] == parent
    row = {row["id"]: row for row in pool.workers()}["a"]
    assert row["in_flight"] == 0 and row["capacity"] == pool._state.workers["a"].capacity
    assert close_bounded(pool)


def test_a_forked_child_keeps_nothing_of_a_worker_the_parent_was_draining():
    """The parent removed worker a by a reload while a's task was in flight (a drains).
    The child, forked then, has no task of its own on a: it keeps no balancing slot of
    a, and a re-added in the child starts with nothing in flight."""
    from npu_sync.config import BalancingConfig

    parent = os.getpid()
    gate, started = threading.Event(), threading.Event()

    def handler(req):
        if os.getpid() == parent and req.json().get("x") == "hold":
            started.set()
            gate.wait(30)
        return json_response(200, {"by": req.worker_id, "pid": os.getpid()})

    a = worker_config("a", "http://127.0.0.1:9821")
    b = worker_config("b", "http://127.0.0.1:9822")

    def config(*workers):
        return PoolConfig(
            workers=workers,
            balancing=BalancingConfig(slow_start=0),
            health=HealthConfig(enabled=False),
        )

    net = FakeNetwork(handler)
    pool = WorkerPool(config(a, b), transport_factory=net.factory)
    try:
        running = pool.submit({"x": "hold"})
        assert started.wait(10)
        pool.reload(config(b))  # a drains its task

        def child() -> dict[str, Any]:
            selector = pool._state.dispatcher.selector
            kept = sorted(w.id for w in selector._retired)
            pool.execute({"x": "child"}, timeout=5)
            pool.reload(config(a, b))
            rows = {row["id"]: row["in_flight"] for row in pool.workers()}
            kept_after = sorted(w.id for w in selector._retired)
            closed = close_bounded(pool)
            return {"kept": kept, "kept_after": kept_after, "rows": rows, "closed": closed}

        report = run_in_child(child)
    finally:
        gate.set()
    assert running.result(10)["pid"] == parent
    assert close_bounded(pool)
    assert report["rows"] == {"a": 0, "b": 0} and report["closed"] is True
    assert report["kept"] == [] and report["kept_after"] == []


def test_a_fork_amid_many_draining_tasks_leaves_the_child_clean_and_the_parent_draining():
    """Two workers drain two slow tasks each in the parent when it forks. The child
    keeps none of them, takes a back as a new worker with all its room, and serves
    from it; the parent's workers still drain, and close, once their tasks end."""
    from npu_sync.config import BalancingConfig

    parent = os.getpid()
    gate = threading.Event()
    entered = threading.Semaphore(0)

    def handler(req):
        if os.getpid() == parent and req.json().get("x") == "hold":
            entered.release()
            gate.wait(30)
        return json_response(200, {"by": req.worker_id, "pid": os.getpid()})

    a = worker_config("a", "http://127.0.0.1:9823", max_concurrent=2)
    b = worker_config("b", "http://127.0.0.1:9824", max_concurrent=2, priority=5)
    c = worker_config("c", "http://127.0.0.1:9825", max_concurrent=2)

    def config(*workers):
        return PoolConfig(
            workers=workers,
            balancing=BalancingConfig(slow_start=0),
            health=HealthConfig(enabled=False),
        )

    def child() -> dict[str, Any]:
        selector = pool._state.dispatcher.selector
        kept = sorted(w.id for w in selector._retired)
        draining = sorted(pool._state.draining)
        pool.reload(config(a, b))
        fresh = pool._state.workers["a"] not in leaving
        room = pool.workers()[0]
        by = {pool.execute({"x": i}, timeout=5)["by"] for i in range(4)}
        closed = close_bounded(pool)
        return {
            "kept": kept,
            "draining": draining,
            "fresh": fresh,
            "room": [room["id"], room["in_flight"], room["capacity"]],
            "by": sorted(by),
            "closed": closed,
        }

    net = FakeNetwork(handler)
    pool = WorkerPool(config(a, b, c), transport_factory=net.factory)
    try:
        try:
            running = [pool.submit({"x": "hold"}) for _ in range(4)]
            for _ in running:
                assert entered.acquire(timeout=10)
            in_flight = {w.id: w.in_flight for w in pool._state.workers.values()}
            assert in_flight == {"a": 2, "b": 0, "c": 2}
            leaving = [pool._state.workers["a"], pool._state.workers["c"]]
            pool.reload(config(b))  # a and c drain their tasks
            report = run_in_child(child)
            assert pool._state.draining == {"a": leaving[0], "c": leaving[1]}
        finally:
            gate.set()
        assert all(f.result(10)["pid"] == parent for f in running)
        assert report == {
            "kept": [],
            "draining": [],
            "fresh": True,
            "room": ["a", 0, 2],
            "by": ["a"],
            "closed": True,
        }
        assert not pool._state.draining and all(w.transport.closed for w in leaving)
    finally:
        assert close_bounded(pool)
