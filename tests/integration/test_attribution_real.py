"""Failure attribution against real reference workers over loopback HTTP."""

from __future__ import annotations

import concurrent.futures

import pytest

from npu_sync import Task, TaskFailed, WorkerPool
from npu_sync.config import (
    BalancingConfig,
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    RetryConfig,
    TimeoutConfig,
    TransportConfig,
    worker_config,
)

pytestmark = pytest.mark.integration


def pool_config(workers, **kw) -> PoolConfig:
    return PoolConfig(
        workers=tuple(worker_config(w.worker_id, w.url) for w in workers),
        health=HealthConfig(enabled=False),
        circuit_breaker=BreakerConfig(fail_max=5, reset_timeout=60),
        retry=RetryConfig(max_retries=3, backoff_initial=0.01, backoff_max=0.05),
        timeouts=TimeoutConfig(connect=1.0, read=5.0, task=10.0),
        **kw,
    )


def test_impatient_callers_do_not_open_the_breaker_of_a_slow_healthy_worker(start_worker):
    """Five concurrent 0.1 s deadlines on a 0.3 s worker: breaker closed, then it serves."""
    worker = start_worker(worker_id="slow", latency_ms=300)
    with WorkerPool(pool_config([worker])) as pool:
        task = {"model_id": "default", "input_text": "hi"}
        with concurrent.futures.ThreadPoolExecutor(5) as callers:
            futures = [callers.submit(pool.execute, task, 0.1) for _ in range(5)]
            for future in futures:
                with pytest.raises(TaskFailed, match="deadline"):
                    future.result(30)
        (row,) = pool.workers()
        assert row["breaker"]["state"] == "closed" and row["breaker"]["failures"] == 0
        assert (row["tasks"]["abandoned"], row["tasks"]["failed"]) == (5, 0)
        assert pool.execute(task, timeout=2)["worker_id"] == "slow"


def test_answers_over_the_limit_from_every_worker_charge_one_and_stop_after_two(start_worker):
    """Real answers over max_response_bytes: two workers per task, one charge, no trip."""
    workers = [start_worker(worker_id=f"w{i}") for i in range(3)]
    cfg = pool_config(workers, transport=TransportConfig(max_response_bytes=10_000))
    with WorkerPool(cfg) as pool:
        for n in range(5):
            with pytest.raises(TaskFailed, match="max_response_bytes") as info:
                pool.execute(Task({"n": n, "blob": "x" * 20_000}, endpoint="/echo"))
            tried = [a.worker_id for a in info.value.attempts]
            assert len(tried) == 2 and len(set(tried)) == 2
            assert all(a.error.startswith("too_large") for a in info.value.attempts)
        rows = pool.workers()
        assert [r["breaker"]["state"] for r in rows] == ["closed"] * 3
        assert sum(r["breaker"]["failures"] for r in rows) == 5
        assert sum(r["tasks"]["failed"] for r in rows) == 10
        small = pool.execute(Task({"n": "small"}, endpoint="/echo"))
        assert small["echo"] == {"n": "small"}
    assert sum(w.stats()["requests"].get("/echo", 0) for w in workers) == 11


def run_many(pool: WorkerPool, n: int, threads: int = 8) -> list[str]:
    """Run ``n`` valid tasks from ``threads`` callers; what each ended in."""

    def one(i: int) -> str:
        try:
            pool.execute({"model_id": "default", "input_text": f"task {i}"}, timeout=10)
        except TaskFailed as exc:
            return f"failed: {exc}"
        except Exception as exc:  # TaskRejected and anything else: the valid task was lost
            return f"{type(exc).__name__}: {exc}"
        return "ok"

    with concurrent.futures.ThreadPoolExecutor(threads) as callers:
        return list(callers.map(one, range(n)))


def test_a_worker_entry_at_the_wrong_path_is_taken_out_and_no_task_fails(start_worker):
    """One entry with a wrong base path among three: 400 tasks succeed, the entry is out."""
    workers = [start_worker(worker_id=f"w{i}") for i in range(3)]
    entries = [worker_config(w.worker_id, w.url) for w in workers[:2]]
    entries.append(worker_config("misrouted", workers[2].url + "/npu"))  # no such base path
    config = pool_config([], **{})
    config = PoolConfig(
        workers=tuple(entries),
        health=config.health,
        circuit_breaker=config.circuit_breaker,
        retry=config.retry,
        timeouts=config.timeouts,
    )
    with WorkerPool(config) as pool:
        results = run_many(pool, 400)
        row = {r["id"]: r for r in pool.workers()}["misrouted"]
        health = pool.check_health()["misrouted"]
    assert results == ["ok"] * 400
    assert row["healthy"] is False and row["breaker"]["state"] == "closed"
    assert row["last_error"].startswith("not an NPU worker at this URL: POST /npu/inference → 404")
    assert row["tasks"]["failed"] <= 8  # the attempts in flight when it first answered
    assert health["error"] == "not an NPU worker at this URL: GET /npu/health → 404"


@pytest.mark.parametrize("status", [413, 404])
def test_a_worker_refusing_every_task_is_taken_out_and_no_task_fails(start_worker, status):
    """A healthy worker answering 413 (or 404) to every task among three: all 300 succeed."""
    refuser = start_worker(worker_id="refuser")
    refuser.control(status_code=status)
    workers = [refuser] + [start_worker(worker_id=f"ok{i}") for i in range(2)]
    with WorkerPool(pool_config(workers)) as pool:
        results = run_many(pool, 300)
        row = {r["id"]: r for r in pool.workers()}["refuser"]
    assert results == ["ok"] * 300
    if status == 413:  # the worker's fault, proven by the others: charged
        # Each charge also raises its latency estimate, so latency-aware choice may
        # stop sending it tasks before fail_max of them: charged, if not always opened
        # (the round-robin test below shows the charges open it).
        assert row["tasks"]["failed"] >= 1 and row["healthy"] is True
        assert row["breaker"]["state"] == "open" or row["breaker"]["failures"] >= 1
        assert row["last_error"].startswith("refused a task another worker ran: HTTP 413")
    else:  # 404 to the inference path: not a worker at this URL, taken out
        assert row["breaker"]["state"] == "closed" and row["healthy"] is False
        assert row["last_error"].startswith("not an NPU worker at this URL: POST /inference → 404")
    assert refuser.stats()["requests"].get("/inference", 0) < 30  # out, not drawing tasks


def test_a_worker_refusing_every_task_opens_its_breaker_when_it_keeps_being_chosen(
    start_worker,
):
    """Round robin keeps sending the refuser tasks: its charged refusals open its
    breaker after fail_max, and every task still succeeds elsewhere."""
    refuser = start_worker(worker_id="refuser")
    refuser.control(status_code=413)
    workers = [refuser] + [start_worker(worker_id=f"ok{i}") for i in range(2)]
    config = pool_config(workers, balancing=BalancingConfig(strategy="round-robin"))
    with WorkerPool(config) as pool:
        results = run_many(pool, 150)
        row = {r["id"]: r for r in pool.workers()}["refuser"]
    assert results == ["ok"] * 150
    assert row["breaker"]["state"] == "open" and row["breaker"]["trips"] >= 1
