"""Whole-fleet edges against real reference workers and hostile servers: hedged
failed tasks, payload-specific 404s, fleets that go down and come back."""

from __future__ import annotations

from typing import Any

import pytest

from npu_sync import Task, TaskFailed, WorkerPool
from npu_sync.config import (
    BalancingConfig,
    BreakerConfig,
    HealthConfig,
    HedgeConfig,
    PoolConfig,
    RetryConfig,
    worker_config,
)

pytestmark = pytest.mark.integration


def _rows(pool: WorkerPool) -> dict[str, dict[str, Any]]:
    return {row["id"]: row for row in pool.workers()}


def test_a_failed_task_both_workers_give_under_hedging_charges_neither(start_worker) -> None:
    """A Windows failed task answered by the first worker and by its hedge charges neither."""
    workers = [
        start_worker(worker_id=f"win{i}", protocol="windows", latency_ms=300, failure_rate=1.0)
        for i in range(2)
    ]
    config = PoolConfig(
        workers=tuple(
            worker_config(w.worker_id, w.url, protocol="autobot-windows") for w in workers
        ),
        health=HealthConfig(enabled=False),
        circuit_breaker=BreakerConfig(fail_max=2, reset_timeout=60),
        retry=RetryConfig(max_retries=3, backoff_initial=0.01, backoff_max=0.05),
        balancing=BalancingConfig(hedge=HedgeConfig(enabled=True, delay=0.05)),
    )
    with WorkerPool(config) as pool:
        for n in range(3):
            with pytest.raises(TaskFailed, match="taken as the task's fault"):
                pool.execute(Task({"model_id": "default", "input_text": f"t{n}"}, timeout=5))
        rows = _rows(pool)
    assert [r["breaker"]["failures"] for r in rows.values()] == [0, 0]
    assert [r["breaker"]["state"] for r in rows.values()] == ["closed", "closed"]
