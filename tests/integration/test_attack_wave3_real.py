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


def _picky_worker(servers: list[Any]) -> Any:
    """A worker that answers every task but one about a missing document, which it
    answers 404 with its own reason (as a search worker does)."""
    import json

    from tests.hostile import Hostile, answer, keep_answering

    def reply(seen: Any) -> bytes:
        if seen.path == "/health":
            return answer(200, b'{"status": "healthy"}')
        if b"missing-doc" in seen.body:
            return answer(404, b'{"detail": "document missing-doc not found"}')
        return answer(200, json.dumps({"response": "ok", "worker": "picky"}).encode())

    server = Hostile(keep_answering(reply))
    servers.append(server)
    return server


@pytest.fixture
def servers():
    started: list[Any] = []
    yield started
    for server in started:
        server.close()


def test_a_404_for_one_payload_from_a_proven_worker_does_not_take_it_out(
    start_worker, servers
) -> None:
    """A worker whose inference path has answered tasks is not taken out by a 404 for one."""
    picky = _picky_worker(servers)
    other = start_worker(worker_id="w1")
    config = PoolConfig(
        workers=(
            worker_config("w0", picky.url(), priority=1),
            worker_config("w1", other.url, priority=2),
        ),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=2, backoff_initial=0.01, backoff_max=0.05),
    )
    with WorkerPool(config) as pool:
        assert pool.execute({"model_id": "default", "input_text": "a"})["worker"] == "picky"
        pool.execute({"model_id": "default", "input_text": "missing-doc"})  # runs on w1
        rows = _rows(pool)
        assert rows["w0"]["healthy"] is True, rows["w0"]["last_error"]
        assert pool.execute({"model_id": "default", "input_text": "b"})["worker"] == "picky"
