"""Model-aware routing, placement, both protocols and request auth against real
reference workers (child processes on loopback), through the pool."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import pytest

from npu_sync import TaskFailed, TaskRejected, WorkerPool
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    ModelsConfig,
    PoolConfig,
    PoolSettings,
    RetryConfig,
    TimeoutConfig,
    WorkerConfig,
    worker_config,
)
from npu_sync.worker_server import LocalWorker

pytestmark = pytest.mark.integration

SERVICE, SECRET = "npu-pool", "integration-hmac-secret-41"
TOKEN = "integration-bearer-token-93"


def pool_of(*workers: WorkerConfig, **kw: Any) -> WorkerPool:
    kw.setdefault("health", HealthConfig(enabled=False, unhealthy_threshold=1, timeout=5))
    kw.setdefault("retry", RetryConfig(max_retries=3, backoff_initial=0.0, backoff_max=0.0))
    kw.setdefault("circuit_breaker", BreakerConfig(fail_max=1, reset_timeout=300))
    return WorkerPool(PoolConfig(workers=workers, **kw))


def as_config(worker: LocalWorker, **kw: Any) -> WorkerConfig:
    platform = "windows" if worker.protocol == "windows" else "linux"
    return worker_config(worker.worker_id, worker.url, platform=platform, **kw)


def bounces(worker: LocalWorker) -> int:
    """Tasks the worker answered "not loaded" (Linux: a 500; Windows: a failed 200)."""
    stats = worker.stats()
    if worker.protocol == "windows":
        return int(stats["failed_tasks"])
    return int(stats["responses"].get("500", 0))


def inferences(worker: LocalWorker) -> int:
    return int(worker.stats()["requests"].get("/inference", 0))


def task(model: str, text: str = "hello") -> dict[str, Any]:
    return {"model_id": model, "input_text": text}


def test_tasks_reach_only_workers_with_their_model_in_both_protocols(
    start_worker: Callable[..., LocalWorker],
) -> None:
    """Linux and Windows workers with different models: no bounced attempt in steady
    state, each task on a worker holding its model, and workers() shows what each holds.

    The Windows worker loads models on demand, so the pool offers it any model until it
    answers "not loaded" (this one does not load on demand): that costs it one bounce
    for the one model it lacks (phi), in the whole run."""
    lin = start_worker(worker_id="lin", models=("phi", "shared"))
    win = start_worker(worker_id="win", protocol="windows", models=("nomic", "shared"))
    with pool_of(as_config(lin, name="Linux NPU"), as_config(win, name="Windows NPU")) as pool:
        pool.check_health()
        for n in range(30):
            assert pool.execute(task("phi", f"p{n}"))["model_id"] == "phi"
            assert pool.execute(task("nomic", f"n{n}"))["status"] == "completed"
            pool.execute(task("shared", f"s{n}"))
        rows = {row["id"]: row for row in pool.workers()}
    assert bounces(lin) == 0 and bounces(win) <= 1
    assert rows["lin"]["models"] == ["phi", "shared"] and rows["win"]["models"] == [
        "nomic",
        "shared",
    ]
    assert rows["lin"]["protocol"] == "autobot-linux" and rows["win"]["name"] == "Windows NPU"
    assert rows["lin"]["npu_available"] is True and rows["lin"]["device"]
    assert inferences(lin) >= 30 and inferences(win) >= 30


def test_a_model_unloaded_mid_run_costs_at_most_one_bounce_per_worker(
    start_worker: Callable[..., LocalWorker],
) -> None:
    """Both workers hold m; m is pulled from each in turn mid-run: one bounce per worker,
    health rounds in between do not bring it back, and the last pull rejects the task."""
    workers = [start_worker(worker_id=f"w{i}", models=("m", "other")) for i in range(2)]
    with pool_of(*(as_config(w) for w in workers)) as pool:
        pool.check_health()
        for _ in range(10):
            pool.execute(task("m"))
        workers[0].control(models=["other"])
        for _ in range(20):
            assert pool.execute(task("m"))
            pool.check_health()
        workers[1].control(models=["other"])
        with pytest.raises(TaskRejected) as info:
            pool.execute(task("m"))
        assert info.value.model == "m"
        for _ in range(5):
            with pytest.raises(TaskRejected):
                pool.execute(task("m"))
        assert pool.stats()["models"]["held"] == ["other"]
    # At most one each: a worker whose unload the health round learns before any task
    # reaches it (latency-aware choice may send the next tasks to the other) costs none.
    counts = [bounces(w) for w in workers]
    assert all(n <= 1 for n in counts), counts
    assert counts[1] == 1  # the last holder: the task that found it gone bounced once


def test_a_missing_model_with_its_worker_down_is_rejected_without_an_attempt_or_a_wait(
    start_worker: Callable[..., LocalWorker],
) -> None:
    """The only holder of m2 is down (breaker open): TaskRejected naming m2 at once, no
    attempt made and no wait for a worker, even with a 60 s deadline."""
    a = start_worker(worker_id="a", models=("m1",))
    b = start_worker(worker_id="b", models=("m2",))
    with pool_of(as_config(a), as_config(b)) as pool:
        pool.check_health()
        b.kill()
        with pytest.raises(TaskFailed):  # b refuses connections: its breaker opens
            pool.execute(task("m2"), timeout=60)
        assert {r["id"]: r["breaker"]["state"] for r in pool.workers()}["b"] == "open"
        seen: list[str] = []
        pool.add_hook(lambda event: seen.append(event.name))
        dispatcher = pool._state.dispatcher
        real = dispatcher.acquire_or_reason
        waited: list[object] = []
        dispatcher.acquire_or_reason = lambda *a: waited.append(a) or real(*a)  # type: ignore[method-assign]
        with pytest.raises(TaskRejected) as info:
            pool.execute(task("m2"), timeout=60)
        assert info.value.model == "m2"
        assert "attempt.finished" not in seen and waited == []
        assert seen == ["task.started", "task.rejected"]
        assert len(pool.dead_letters) == 1  # only the task that really failed
    assert inferences(a) == 0


def test_placement_loads_a_model_no_worker_holds_then_runs_the_task(
    start_worker: Callable[..., LocalWorker],
) -> None:
    """With models.placement, a model nobody holds is loaded once on the least-loaded
    worker (however many tasks ask at once), and every task then runs there."""
    busy = start_worker(worker_id="busy", models=("other",), latency_ms=300)
    idle = start_worker(worker_id="idle", models=("other",), load_delay_ms=200)
    cfg = pool_of(as_config(busy), as_config(idle), models=ModelsConfig(placement=True))
    with cfg as pool:
        pool.check_health()
        running = pool.submit(task("other"))  # the first in the tier with no load: busy
        while busy.stats()["in_flight"] < 1:  # each look is a request to the worker
            assert not running.done()
        futures = [pool.submit(task("fresh", f"t{n}")) for n in range(4)]
        results = [f.result(30) for f in futures]
        running.result(30)
        assert all(r["model_id"] == "fresh" for r in results)
        assert pool.stats()["models"]["placements"] == 1
        holders = [r["id"] for r in pool.workers() if "fresh" in (r["models"] or [])]
    loads = {w.worker_id: w.stats()["loads"] for w in (busy, idle)}
    assert loads == {"busy": 0, "idle": 1} and holders == ["idle"]
    assert bounces(busy) == bounces(idle) == 0


def test_windows_failures_answered_with_200_are_retried_elsewhere_and_dead_lettered(
    start_worker: Callable[..., LocalWorker],
) -> None:
    """HTTP 200 {"status": "failed"} from both Windows workers: both tried, then the task
    is dead-lettered as its own fault, and neither breaker counts it."""
    workers = [
        start_worker(worker_id=f"win{i}", protocol="windows", models=("nomic",)) for i in range(2)
    ]
    for w in workers:
        w.control(fail_all=True)
    with pool_of(*(as_config(w) for w in workers)) as pool:
        with pytest.raises(TaskFailed) as info:
            pool.execute(task("nomic"))
        assert {a.worker_id for a in info.value.attempts} == {"win0", "win1"}
        assert all("status failed" in (a.error or "") for a in info.value.attempts)
        record = pool.dead_letters.get(info.value.dead_letter_id)
        assert record.payload == task("nomic")
        # The same failure from two workers is the task's doing: nobody is charged.
        assert [r["breaker"]["failures"] for r in pool.workers()] == [0, 0]


def test_hmac_signed_requests_verify_on_the_worker_and_a_wrong_secret_is_that_workers(
    start_worker: Callable[..., LocalWorker], caplog: pytest.LogCaptureFixture
) -> None:
    """Tasks, health and /models are signed and accepted; a worker configured with the
    wrong secret answers 401, which takes it out (its breaker untouched, the error
    saying credentials refused), and the task runs on the other. Neither secret shows
    in stats, workers(), errors or the log."""
    caplog.set_level(logging.DEBUG, logger="npu_sync")
    good = start_worker(worker_id="good", models=("m",), hmac_auth=(SERVICE, SECRET))
    wrong = start_worker(
        worker_id="wrong", protocol="windows", models=("m",), hmac_auth=(SERVICE, SECRET)
    )
    bad_secret = SECRET + "-old"
    with pool_of(
        as_config(good, priority=2, auth={"type": "hmac", "service_id": SERVICE, "secret": SECRET}),
        as_config(
            wrong, priority=1, auth={"type": "hmac", "service_id": SERVICE, "secret": bad_secret}
        ),
    ) as pool:
        # The wrong worker is preferred (priority 1): the task meets its 401 first.
        assert pool.execute(task("m"))["model_id"] == "m"
        checks = pool.check_health()
        assert checks["good"]["ok"] and not checks["wrong"]["ok"]
        assert checks["wrong"]["error"] == "credentials refused: HTTP 401: bad signature"
        rows = {r["id"]: r for r in pool.workers()}
        shown = json.dumps([pool.stats(), pool.workers(), checks]) + caplog.text
    assert rows["good"]["models"] == ["m"]  # /models was read, signed
    assert good.stats()["responses"].get("401", 0) == 0
    assert rows["wrong"]["tasks"]["failed"] == 1 and rows["wrong"]["tasks"]["rejected"] == 0
    assert rows["wrong"]["breaker"]["state"] == "closed"
    assert rows["wrong"]["last_error"] == "credentials refused: HTTP 401: bad signature"
    assert wrong.stats()["responses"].get("401", 0) == 2  # the task and the health check
    assert SECRET not in shown and bad_secret not in shown


def test_a_401_on_a_task_is_charged_to_the_worker_not_the_task(
    start_worker: Callable[..., LocalWorker],
) -> None:
    """A worker refusing the bearer token fails the attempt (it is taken out, its
    breaker stays closed), the task succeeds on the worker with the right token, and
    no TaskRejected is raised."""
    refusing = start_worker(worker_id="refusing", models=("m",), bearer_token=TOKEN)
    accepting = start_worker(worker_id="accepting", models=("m",), bearer_token=TOKEN)
    with pool_of(
        as_config(refusing, priority=1, auth={"type": "bearer", "token": "not-" + TOKEN}),
        as_config(accepting, priority=2, auth={"type": "bearer", "token": TOKEN}),
    ) as pool:
        result = pool.execute(task("m"))
        rows = {r["id"]: r for r in pool.workers()}
        text = json.dumps([pool.stats(), pool.workers()])
    assert result["model_id"] == "m"
    assert rows["refusing"]["tasks"]["failed"] == 1 and rows["refusing"]["tasks"]["rejected"] == 0
    assert rows["refusing"]["breaker"]["state"] == "closed"
    assert rows["refusing"]["last_error"] == "credentials refused: HTTP 401: invalid bearer token"
    assert refusing.stats()["responses"] == {"401": 1}
    assert TOKEN not in text


def test_when_every_worker_refuses_the_credentials_tasks_fail_at_once_saying_so(
    start_worker: Callable[..., LocalWorker],
) -> None:
    """Both workers configured with a wrong HMAC secret: the first task is refused by
    each and fails naming the state, the next fail at once (well under the 30 s
    max_queue_wait) without another request; a reload with the right secret brings
    them back."""
    workers = [
        start_worker(worker_id=f"w{i}", models=("m",), hmac_auth=(SERVICE, SECRET))
        for i in range(2)
    ]

    def configs(secret: str) -> PoolConfig:
        auth = {"type": "hmac", "service_id": SERVICE, "secret": secret}
        return PoolConfig(
            workers=tuple(as_config(w, auth=auth) for w in workers),
            health=HealthConfig(enabled=False),
            pool=PoolSettings(max_queue_wait=30.0),
            timeouts=TimeoutConfig(task=60.0),
        )

    clause = "all 2 workers are down: 2 refusing the credentials"
    with WorkerPool(configs(SECRET + "-wrong")) as pool:
        started = time.monotonic()
        for n in range(5):
            with pytest.raises(TaskFailed, match=clause) as info:
                pool.execute(task("m", str(n)))
        assert time.monotonic() - started < 5.0
        assert "2 refusing the credentials (w0: HTTP 401: bad signature)" in str(info.value)
        assert sum(w.stats()["responses"].get("401", 0) for w in workers) == 2
        pool.reload(configs(SECRET))
        assert pool.execute(task("m"))["model_id"] == "m"
        assert all(r["last_error"] is not None for r in pool.workers())


# Attacks on model-aware routing, placement, Windows answers and request auth against real
# reference workers.


OLD_SECRET, NEW_SECRET = "attack-old-secret-17", "attack-new-secret-29"


def pool_config(*workers: WorkerConfig, **kw: Any) -> PoolConfig:
    kw.setdefault("health", HealthConfig(enabled=False, unhealthy_threshold=1, timeout=5))
    kw.setdefault("retry", RetryConfig(max_retries=3, backoff_initial=0.0, backoff_max=0.0))
    kw.setdefault("circuit_breaker", BreakerConfig(fail_max=2, reset_timeout=300))
    return PoolConfig(workers=workers, **kw)


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
