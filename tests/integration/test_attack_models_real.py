"""Attacks on model-aware routing, placement, Windows answers and request auth against
real reference workers (child processes on loopback), through the pool."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

import pytest

from npu_sync import TaskFailed, TaskRejected, WorkerPool
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    ModelsConfig,
    PoolConfig,
    RetryConfig,
    WorkerConfig,
    worker_config,
)
from npu_sync.worker_server import LocalWorker

pytestmark = pytest.mark.integration

SERVICE = "npu-pool"
OLD_SECRET, NEW_SECRET = "attack-old-secret-17", "attack-new-secret-29"


def pool_config(*workers: WorkerConfig, **kw: Any) -> PoolConfig:
    kw.setdefault("health", HealthConfig(enabled=False, unhealthy_threshold=1, timeout=5))
    kw.setdefault("retry", RetryConfig(max_retries=3, backoff_initial=0.0, backoff_max=0.0))
    kw.setdefault("circuit_breaker", BreakerConfig(fail_max=2, reset_timeout=300))
    return PoolConfig(workers=workers, **kw)


def as_config(worker: LocalWorker, **kw: Any) -> WorkerConfig:
    platform = "windows" if worker.protocol == "windows" else "linux"
    return worker_config(worker.worker_id, worker.url, platform=platform, **kw)


def status_count(worker: LocalWorker, status: int) -> int:
    return int(worker.stats()["responses"].get(str(status), 0))


def test_a_model_unloaded_on_every_worker_with_tasks_queued_ends_each_task_cleanly(
    start_worker: Callable[..., LocalWorker],
) -> None:
    """Unloading m everywhere while tasks wait for busy workers: every task ends as a
    result or a TaskRejected naming m, none is dead-lettered, and each worker bounces
    at most one task."""
    workers = [
        start_worker(worker_id=f"w{n}", models=("m",), latency_ms=100, max_concurrent=1)
        for n in range(2)
    ]
    cfg = pool_config(*(as_config(w, max_concurrent=1) for w in workers))
    with WorkerPool(cfg) as pool:
        pool.check_health()
        futures = [pool.submit({"model_id": "m", "input_text": str(n)}) for n in range(12)]
        for worker in workers:
            worker.control(models=[])
        ended = {"result": 0, "rejected": 0}
        for future in futures:
            try:
                future.result(30)
                ended["result"] += 1
            except TaskRejected as exc:
                assert exc.model == "m"
                ended["rejected"] += 1
        assert sum(ended.values()) == 12 and ended["rejected"] >= 1
        assert len(pool.dead_letters) == 0
        assert {row["id"]: row["models"] for row in pool.workers()} == {"w0": [], "w1": []}
    assert all(status_count(w, 500) <= 1 for w in workers)


def test_a_placement_load_hanging_past_the_deadline_rejects_the_task_by_its_deadline(
    start_worker: Callable[..., LocalWorker],
) -> None:
    """A worker whose load takes far longer than the task may: the task ends by its
    deadline as a TaskRejected naming the model, with no dead letter."""
    worker = start_worker(worker_id="slow", models=("other",), load_delay_ms=20_000)
    cfg = pool_config(as_config(worker), models=ModelsConfig(placement=True))
    with WorkerPool(cfg) as pool:
        pool.check_health()
        future = pool.submit({"model_id": "m", "input_text": "x"}, timeout=1.0)
        with pytest.raises(TaskRejected) as info:
            future.result(10)  # well before the 20 s load would end
        assert info.value.model == "m"
        assert len(pool.dead_letters) == 0
        assert pool.stats()["models"]["placement_failures"] == 1


def test_two_hundred_tasks_for_one_unplaced_model_load_it_once_on_a_real_worker(
    start_worker: Callable[..., LocalWorker],
) -> None:
    """200 concurrent tasks for a model no worker holds: one load, 200 results."""
    worker = start_worker(worker_id="a", models=("other",), load_delay_ms=300)
    cfg = pool_config(as_config(worker, max_concurrent=16), models=ModelsConfig(placement=True))
    with WorkerPool(cfg) as pool, concurrent.futures.ThreadPoolExecutor(200) as threads:
        pool.check_health()
        futures = [
            threads.submit(pool.execute, {"model_id": "m", "input_text": str(n)}, timeout=30)
            for n in range(200)
        ]
        results = [f.result(60) for f in futures]
        assert pool.stats()["models"]["placements"] == 1
    assert {r["model_id"] for r in results} == {"m"}
    assert worker.stats()["requests"].get("/models/load", 0) == 1


def test_a_bad_task_on_three_windows_workers_opens_no_breaker(
    start_worker: Callable[..., LocalWorker],
) -> None:
    """A task every Windows worker fails with HTTP 200 (an unsupported task type) is
    rejected on its first attempt, the protocol's declared task fault: it charges
    nobody, so no breaker opens and good tasks keep running everywhere."""
    workers = [
        start_worker(worker_id=f"win{n}", protocol="windows", models=("m",)) for n in range(3)
    ]
    with WorkerPool(pool_config(*(as_config(w) for w in workers))) as pool:
        bad = {"model_id": "m", "input_text": "x", "task_type": "no_such_type"}
        with pytest.raises(TaskRejected, match="Unsupported task type: no_such_type"):
            pool.execute(bad)
        assert sum(w.stats()["failed_tasks"] for w in workers) == 1
        rows = pool.workers()
        assert all(row["breaker"]["state"] == "closed" for row in rows)
        assert sum(row["breaker"]["failures"] for row in rows) == 0
        for n in range(6):
            assert pool.execute({"model_id": "m", "input_text": str(n)})["status"] == "completed"


def test_after_a_reload_rotating_the_secret_the_old_signature_is_never_sent(
    start_worker: Callable[..., LocalWorker],
) -> None:
    """The worker knows only the new secret: before the reload every request is refused;
    after it, tasks, health checks and model lists all verify, and no refusal follows."""
    worker = start_worker(worker_id="a", models=("m",), hmac_auth=(SERVICE, NEW_SECRET))

    def cfg(secret: str) -> PoolConfig:
        auth = {"type": "hmac", "service_id": SERVICE, "secret": secret}
        return pool_config(as_config(worker, auth=auth), circuit_breaker=BreakerConfig(fail_max=5))

    with WorkerPool(cfg(OLD_SECRET)) as pool:
        with pytest.raises(TaskFailed):
            pool.execute({"model_id": "m", "input_text": "x"})
        refused = status_count(worker, 401)
        assert refused >= 1
        pool.reload(cfg(NEW_SECRET))
        assert pool.check_health()["a"]["ok"] is True
        for n in range(5):
            assert pool.execute({"model_id": "m", "input_text": str(n)})["model_id"] == "m"
        assert pool.workers()[0]["models"] == ["m"]
        shown = repr(pool.config) + repr(pool.workers()) + repr(pool.stats())
    assert status_count(worker, 401) == refused
    assert OLD_SECRET not in shown and NEW_SECRET not in shown
