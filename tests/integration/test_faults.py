"""The fault suite: real workers killed, frozen, slowed, flaky and lying under load.

Every scenario accounts for every task: lost and returned-twice must be zero.
Run with -s to see the table; set NPU_SYNC_FAULT_REPORT=path.json to keep it.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from npu_sync import Task, WorkerPool
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    TimeoutConfig,
    worker_config,
)
from tests.integration.faults import Report, run_load, table

pytestmark = pytest.mark.integration

REPORTS: list[Report] = []


@pytest.fixture(scope="module", autouse=True)
def print_reports():
    yield
    if REPORTS:
        print("\n" + table(REPORTS))
        path = os.environ.get("NPU_SYNC_FAULT_REPORT")
        if path:
            with open(path, "w") as fh:
                json.dump([r.row() for r in REPORTS], fh, indent=2)


@pytest.fixture
def three(start_worker):
    return [start_worker(worker_id=f"w{i}", latency_ms=5, jitter_ms=2) for i in range(3)]


def config_for(workers, **kw) -> PoolConfig:
    return PoolConfig(
        workers=tuple(worker_config(w.worker_id, w.url, max_concurrent=16) for w in workers), **kw
    )


def check(report: Report, *, min_success: float = 1.0) -> None:
    REPORTS.append(report)
    assert report.lost == 0, report.errors[:5]
    assert report.returned_twice == 0
    assert report.succeeded + report.rejected + report.dead_lettered == report.tasks
    assert report.success_rate >= min_success, report.row()


def test_kill_one_of_three_with_the_default_config(three):
    """SIGKILL one worker mid-load, default settings: at least 99.9 % succeed, none lost."""
    with WorkerPool(config_for(three)) as pool:
        report = run_load(pool, "kill", 3000, faults={1000: three[1].kill})
        check(report, min_success=0.999)
        assert report.dead_lettered == len(pool.dead_letters)
        assert report.after_open == 0


def test_freeze_with_sigstop_then_resume(three):
    """A frozen worker costs its in-flight tasks one read timeout; they finish elsewhere."""
    timeouts = TimeoutConfig(connect=0.5, read=0.5, task=30.0)
    with WorkerPool(config_for(three, timeouts=timeouts)) as pool:
        report = run_load(pool, "freeze", 5000, faults={300: three[2].pause, 4500: three[2].resume})
        check(report)
        frozen = {w["id"]: w for w in pool.workers()}["w2"]
    assert frozen["tasks"]["failed"] >= 1  # its in-flight tasks timed out ...
    assert report.attempts > report.tasks  # ... and were retried on the others


def test_one_worker_ten_times_slower(three):
    """Least connections moves load off a worker that turns 10x slower."""
    with WorkerPool(config_for(three)) as pool:
        report = run_load(pool, "slow", 3000, faults={300: lambda: three[0].control(latency_ms=50)})
        check(report)
        served = {w["id"]: w["tasks"]["succeeded"] for w in pool.workers()}
    assert served["w0"] < min(served["w1"], served["w2"])


def test_five_percent_random_500s_on_one_worker(start_worker):
    """Random 500s on one worker are retried elsewhere: every task succeeds."""
    workers = [start_worker(worker_id="flaky", latency_ms=5, failure_rate=0.05)]
    workers += [start_worker(worker_id=f"ok{i}", latency_ms=5) for i in range(2)]
    with WorkerPool(config_for(workers)) as pool:
        check(run_load(pool, "flaky-5pct", 3000))


def test_worker_healthy_by_its_health_check_while_every_task_fails(start_worker):
    """A lying worker (healthy /health, 500 on every task) is cut off by its breaker."""
    workers = [start_worker(worker_id=f"w{i}", latency_ms=5) for i in range(3)]
    workers[0].control(fail_all=True)
    health = HealthConfig(interval=0.2, timeout=0.5)
    breaker = BreakerConfig(fail_max=5, reset_timeout=60)
    with WorkerPool(config_for(workers, health=health, circuit_breaker=breaker)) as pool:
        report = run_load(pool, "lying", 3000)
        check(report)
        liar = {w["id"]: w for w in pool.workers()}["w0"]
    assert liar["healthy"] and liar["breaker"]["state"] == "open"
    assert liar["tasks"]["succeeded"] == 0


def test_worker_restarted_on_the_same_port_is_used_again(three):
    """Killed then restarted on its port: its breaker lets it back in."""
    breaker = BreakerConfig(fail_max=3, reset_timeout=0.3, max_reset_timeout=1.0)
    health = HealthConfig(interval=0.2, timeout=0.5)
    with WorkerPool(config_for(three, circuit_breaker=breaker, health=health)) as pool:
        report = run_load(
            pool, "restart", 4000, faults={800: three[0].kill, 1600: three[0].restart}
        )
        check(report)
        # The new process gets tasks again once its breaker lets a trial through; if
        # the load ended first, keep sending until it does (bounded).
        gate = threading.Event()
        for i in range(2000):
            if three[0].stats()["inference_count"] > 0:
                break
            pool.execute({"model_id": "default", "input_text": f"after {i}"})
            gate.wait(0.005)
        row = next(r for r in pool.workers() if r["id"] == three[0].worker_id)
    # the new process served tasks
    assert three[0].stats()["inference_count"] > 0, (i, row)


def test_a_thousand_callers_at_once(three):
    """1,000 threads call execute() at the same moment; all succeed, FIFO admission holds."""
    barrier = threading.Barrier(1000)
    with WorkerPool(config_for(three)) as pool:

        def payload(i: int) -> dict:
            barrier.wait(30)
            return {"model_id": "default", "input_text": f"burst {i}"}

        report = run_load(pool, "1000-callers", 1000, threads=1000, payload=payload)
        check(report)
        assert pool.stats()["tasks"]["waiting"] == 0


@pytest.mark.slow
def test_map_over_ten_thousand_tasks(three):
    """pool.map() over 10,000 tasks yields every result, in order."""
    tasks = [
        Task({"model_id": "default", "input_text": "m"}, task_id=f"m{i}") for i in range(10_000)
    ]
    with WorkerPool(config_for(three)) as pool:
        began = time.monotonic()
        results = list(pool.map(tasks))
        seconds = time.monotonic() - began
        attempts = sum(w["tasks"]["attempts"] for w in pool.workers())
    assert [r["task_id"] for r in results] == [t.task_id for t in tasks]
    REPORTS.append(
        Report("map-10k", 10_000, succeeded=len(results), attempts=attempts, seconds=seconds)
    )
