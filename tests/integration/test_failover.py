"""The pool against real worker processes that are killed, restarted and misbehave."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import subprocess
import sys
import threading
import time

import pytest

from npu_sync import Task, TaskFailed, TaskRejected, WorkerPool
from npu_sync.config import (
    BreakerConfig,
    DeadLetterConfig,
    HealthConfig,
    PoolConfig,
    PoolSettings,
    RetryConfig,
    TimeoutConfig,
    worker_config,
)
from npu_sync.testing import FakeClock

pytestmark = pytest.mark.integration


def pool_config(workers, *, fail_max=3, reset=60.0, retries=3, priorities=None, capacity=32, **kw):
    priorities = priorities or [1] * len(workers)
    return PoolConfig(
        workers=tuple(
            worker_config(w.worker_id, w.url, priority=p, max_concurrent=capacity)
            for w, p in zip(workers, priorities, strict=True)
        ),
        health=HealthConfig(enabled=False),
        circuit_breaker=BreakerConfig(
            fail_max=fail_max, reset_timeout=reset, max_reset_timeout=max(reset, 600)
        ),
        retry=RetryConfig(max_retries=retries, backoff_initial=0.01, backoff_max=0.05),
        timeouts=TimeoutConfig(connect=1.0, read=5.0, task=30.0),
        **kw,
    )


def payload(i: int) -> dict:
    return {"model_id": "default", "input_text": f"task {i}"}


def test_one_of_three_killed_under_load_loses_no_task(start_worker):
    """500 tasks from 32 threads, one worker SIGKILLed a third of the way: all succeed once."""
    workers = [start_worker(worker_id=f"w{i}", latency_ms=5) for i in range(3)]
    victim = workers[1]
    done = 0
    done_lock = threading.Lock()
    third = threading.Event()
    killed = threading.Event()

    def run(i: int) -> dict:
        nonlocal done
        if i >= 200:
            # However the machine schedules the callers, 300 tasks start after the kill.
            assert killed.wait(60)
        task = Task(payload(i), task_id=f"task-{i}")
        result = pool.execute(task)
        with done_lock:
            done += 1
            if done == 166:
                third.set()
        return result

    with WorkerPool(pool_config(workers)) as pool:
        with concurrent.futures.ThreadPoolExecutor(32) as callers:
            futures = [callers.submit(run, i) for i in range(500)]
            assert third.wait(60)
            victim.kill()
            killed.set()
            results = [f.result(timeout=60) for f in futures]
        ids = [r["task_id"] for r in results]
        assert ids == [f"task-{i}" for i in range(500)]  # every task, once, in its place
        state = {w["id"]: w for w in pool.workers()}
        assert state["w1"]["breaker"]["state"] == "open"
        attempts_on_dead = state["w1"]["tasks"]["attempts"]
        stats = pool.stats()["tasks"]
        assert stats["succeeded"] == 500 and stats["failed"] == 0
        # The open breaker keeps every further attempt off the dead worker.
        assert list(pool.map(payload(i) for i in range(200)))
        assert {w["id"]: w for w in pool.workers()}["w1"]["tasks"]["attempts"] == attempts_on_dead
    served = sum(w.stats()["inference_count"] for w in workers if w is not victim)
    assert served >= 500 + 200 - 200  # the survivors served everything after the kill


def test_restarted_worker_is_used_again_after_reset_timeout(start_worker):
    """A worker restarted on its port gets its trial once the reset timeout has passed."""
    a, b = start_worker(worker_id="a"), start_worker(worker_id="b")
    clock = FakeClock()
    with WorkerPool(pool_config([a, b], fail_max=2, reset=30.0), clock=clock) as pool:
        a.kill()
        for i in range(10):
            assert pool.execute(payload(i))["worker_id"] == "b"
        assert {w["id"]: w["breaker"]["state"] for w in pool.workers()}["a"] == "open"
        a.restart()
        assert all(pool.execute(payload(i))["worker_id"] == "b" for i in range(10))
        clock.advance(30.0)
        seen = {pool.execute(payload(i))["worker_id"] for i in range(10)}
        assert "a" in seen
        assert {w["id"]: w["breaker"]["state"] for w in pool.workers()}["a"] == "closed"


def test_breakers_do_not_serialise_calls_to_one_worker(start_worker):
    """16 concurrent tasks on one 200 ms worker overlap instead of queueing."""
    w = start_worker(worker_id="slow", latency_ms=200, max_concurrent=32)
    barrier = threading.Barrier(16)

    def run(i: int) -> dict:
        barrier.wait(10)
        return pool.execute(payload(i))

    with (
        WorkerPool(pool_config([w], capacity=16)) as pool,
        concurrent.futures.ThreadPoolExecutor(16) as callers,
    ):
        results = list(callers.map(run, range(16)))
    assert len(results) == 16
    # All 16 were at the worker at once: had a breaker serialised them, it would have
    # seen one at a time (and the run would take 16 x 0.2 s).
    assert w.stats()["max_in_flight"] >= 16


def test_half_open_admits_exactly_one_trial_while_others_wait(start_worker):
    """With N tasks waiting when the reset timeout ends, one trial reaches the worker."""
    w = start_worker(worker_id="flaky")
    w.control(status_code=500)
    with WorkerPool(pool_config([w], fail_max=2, reset=0.3, retries=0)) as pool:
        for i in range(2):
            with pytest.raises(TaskFailed):
                pool.execute(payload(i))
        assert pool.workers()[0]["breaker"]["state"] == "open"
        before = w.stats()["requests"].get("/inference", 0)
        w.control(status_code=None, hang=True)
        n = 8
        futures = [pool.submit(payload(100 + i), timeout=20) for i in range(n)]
        # The trial arrives once the reset timeout ends, and hangs there.
        deadline = time.monotonic() + 10
        while w.stats()["requests"].get("/inference", 0) == before:
            assert time.monotonic() < deadline, "no trial reached the worker"
            time.sleep(0.01)
        time.sleep(0.6)  # two more reset periods: nothing else may get through
        assert w.stats()["requests"]["/inference"] == before + 1
        assert pool.stats()["tasks"]["waiting"] == n - 1
        assert pool.workers()[0]["breaker"]["state"] == "half-open"
        w.control(hang=False)
        assert len([f.result(timeout=20) for f in futures]) == n
        assert pool.workers()[0]["breaker"]["state"] == "closed"
    assert w.stats()["requests"]["/inference"] == before + n


def test_422_from_two_workers_is_rejected_and_leaves_the_breakers_closed(start_worker):
    """A 422 the second worker agrees with is the task's: TaskRejected after those two
    attempts, no further retry, no breaker count, no dead letter."""
    a, b = start_worker(worker_id="a"), start_worker(worker_id="b")
    for w in (a, b):
        w.control(status_code=422)
    with WorkerPool(pool_config([a, b], fail_max=1)) as pool:
        with pytest.raises(TaskRejected) as info:
            pool.execute(payload(1))
        assert info.value.status == 422
        assert all(w["breaker"]["state"] == "closed" for w in pool.workers())
        assert len(pool.dead_letters) == 0
    assert [w.stats()["requests"].get("/inference", 0) for w in (a, b)] == [1, 1]


def test_all_workers_down_dead_letters_durably_and_replays(start_worker, tmp_path):
    """TaskFailed after all attempts; the SQLite record outlives the process; replay works."""
    workers = [start_worker(worker_id=f"w{i}") for i in range(3)]
    db = tmp_path / "dlq.sqlite3"
    config = pool_config(
        workers, retries=2, dead_letter=DeadLetterConfig(backend="sqlite", path=str(db))
    )
    for w in workers:
        w.kill()
    with WorkerPool(config) as pool:
        with pytest.raises(TaskFailed) as info:
            pool.execute(Task(payload(1), task_id="lost-cause"))
        assert len(info.value.attempts) == 3
        assert {a.worker_id for a in info.value.attempts} == {"w0", "w1", "w2"}
        record_id = info.value.dead_letter_id
    script = (
        "import json, sys; from npu_sync._deadletter import SQLiteDeadLetterStore as S; "
        "r = S(sys.argv[1]).get(sys.argv[2]); print(json.dumps(r.to_dict()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(db), record_id],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    stored = json.loads(out.stdout)
    assert stored["task_id"] == "lost-cause" and len(stored["attempts"]) == 3
    workers[0].restart()
    with WorkerPool(config) as pool:
        report = pool.dead_letters.replay()
        assert report.succeeded == (record_id,)
        assert report.results[record_id]["task_id"] == "lost-cause"
        assert len(pool.dead_letters) == 0


def test_priority_one_gets_everything_until_it_dies(start_worker):
    """All tasks go to the priority-1 worker; killed, they go to priority 2."""
    p1, p2 = start_worker(worker_id="p1"), start_worker(worker_id="p2")
    with WorkerPool(pool_config([p1, p2], priorities=[1, 2])) as pool:
        with concurrent.futures.ThreadPoolExecutor(8) as callers:
            first = list(callers.map(lambda i: pool.execute(payload(i))["worker_id"], range(100)))
        assert set(first) == {"p1"}
        p1.kill()
        with concurrent.futures.ThreadPoolExecutor(8) as callers:
            after = list(callers.map(lambda i: pool.execute(payload(i))["worker_id"], range(100)))
        assert set(after) == {"p2"}


def test_model_typo_does_not_open_any_breaker(start_worker):
    """A task for a model no worker has is rejected; no breaker counts it."""
    workers = [start_worker(worker_id=f"w{i}") for i in range(3)]
    with WorkerPool(pool_config(workers, fail_max=1)) as pool:
        for _ in range(5):
            with pytest.raises(TaskRejected, match="no-such-model"):
                pool.execute({"model_id": "no-such-model", "input_text": "x"})
        assert all(w["breaker"]["state"] == "closed" for w in pool.workers())
        assert pool.execute(payload(1))["model_id"] == "default"


def test_submit_pool_threads_are_used(start_worker):
    """submit() runs on the pool's own bounded thread pool."""
    w = start_worker(worker_id="a", latency_ms=20)
    with WorkerPool(pool_config([w], pool=PoolSettings(threads=4))) as pool:
        futures = [pool.submit(payload(i)) for i in range(16)]
        assert len({f.result(timeout=30)["task_id"] for f in futures}) == 16
    assert w.stats()["max_in_flight"] <= 4


def test_a_worker_dripping_its_answer_cannot_hold_a_task_past_its_deadline():
    """An answer that keeps arriving a byte at a time still ends the attempt at the deadline."""
    from npu_sync.testing import DrippingServer

    with DrippingServer() as server:
        config = PoolConfig(
            workers=(worker_config("drip", server.url),),
            health=HealthConfig(enabled=False),
            retry=RetryConfig(max_retries=0),
        )
        with WorkerPool(config) as pool:
            started = time.monotonic()
            with pytest.raises(TaskFailed, match="timeout"):
                pool.execute({"input_text": "x"}, timeout=0.5)
            # The drip never ends: any bound on a busy machine's overshoot proves it.
            assert time.monotonic() - started < 0.5 + 2.0


@pytest.mark.parametrize("health", [False, True], ids=["health-off", "health-on"])
def test_every_worker_down_fails_at_once_naming_the_state_then_recovers(start_worker, health):
    """All three workers killed: once the pool knows (breakers open, or unhealthy), each
    task fails well before pool.max_queue_wait (30 s) with the state named, a fallback
    runs at once; a worker restarted is used again by itself."""
    workers = [start_worker(worker_id=f"w{i}") for i in range(3)]
    config = dataclasses.replace(
        pool_config(
            workers,
            fail_max=1,
            reset=60.0,
            retries=5,
            pool=PoolSettings(max_queue_wait=30.0),
        ),
        health=HealthConfig(enabled=health, interval=0.2, timeout=1.0, unhealthy_threshold=1),
    )
    for w in workers:
        w.kill()
    # Without health checks, the breakers' reset time is what brings a worker back:
    # a fake clock moves it on. The health thread needs the real one.
    clock = None if health else FakeClock()
    with WorkerPool(config, **({} if clock is None else {"clock": clock})) as pool:
        if health:
            deadline = time.monotonic() + 30
            while any(w["healthy"] for w in pool.workers()):
                assert time.monotonic() < deadline, "health checks never saw the workers down"
                threading.Event().wait(0.05)
        else:
            with pytest.raises(TaskFailed):  # fail_max 1: this task opens every breaker
                pool.execute(payload(0))
        state = "3 unhealthy" if health else "3 breakers open"
        started = time.monotonic()
        for i in range(5):
            future = pool.submit(payload(i))
            try:
                with pytest.raises(TaskFailed, match=f"all 3 workers are down: {state}"):
                    future.result(10)
            finally:
                if clock is not None and not future.done():
                    clock.advance(1000.0)  # a task still waiting: let it end, the test failed
        assert pool.execute(payload(9), fallback=lambda: "cpu") == "cpu"
        assert time.monotonic() - started < 5.0  # six tasks, well under one 30 s wait
        workers[1].restart()
        if clock is not None:
            clock.advance(60.0)
        deadline = time.monotonic() + 30
        while True:  # the breaker's reset time, or a health check, brings it back
            try:
                assert pool.execute(payload(10))["worker_id"] == "w1"
                break
            except TaskFailed:
                assert time.monotonic() < deadline, "the pool never used the restarted worker"
                threading.Event().wait(0.1)
