"""Failure attribution against real reference workers over loopback HTTP."""

from __future__ import annotations

import concurrent.futures

import pytest

from npu_sync import Task, TaskFailed, WorkerPool
from npu_sync.config import (
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
