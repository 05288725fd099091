"""The pool against real worker processes that are killed, restarted and misbehave."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from npu_sync import Task, TaskFailed, TaskRejected, WorkerPool
from npu_sync.config import (
    BalancingConfig,
    BreakerConfig,
    DeadLetterConfig,
    HealthConfig,
    HedgeConfig,
    PoolConfig,
    PoolSettings,
    RetryConfig,
    TimeoutConfig,
    worker_config,
)
from npu_sync.testing import FakeClock
from tests.hostile import CLIENTS, TASK, Ended, PoolRun

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
    """500 tasks from 32 threads, one worker SIGKILLed a third of the way: all succeed
    once; every attempt the dead worker gets is charged to it, fail_max of them open
    its breaker, and then no attempt reaches it."""
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

    config = pool_config(workers)
    # A tag per worker, so that the test can offer the dead worker a task (prefers)
    # whatever its latency estimate says; tasks without prefers are chosen as before.
    config = dataclasses.replace(
        config,
        workers=tuple(dataclasses.replace(w, tags={"id": w.id}) for w in config.workers),
    )
    with WorkerPool(config) as pool:
        with concurrent.futures.ThreadPoolExecutor(32) as callers:
            futures = [callers.submit(run, i) for i in range(500)]
            assert third.wait(60)
            victim.kill()
            killed.set()
            results = [f.result(timeout=60) for f in futures]
        ids = [r["task_id"] for r in results]
        assert ids == [f"task-{i}" for i in range(500)]  # every task, once, in its place
        stats = pool.stats()["tasks"]
        assert stats["succeeded"] == 500 and stats["failed"] == 0

        def dead() -> dict:
            return {w["id"]: w for w in pool.workers()}["w1"]

        # Whether the dead worker got any task after the kill is the latency-aware
        # choice's call (on a loaded machine its estimate may keep it out of the whole
        # run, and then nothing can have told the pool it died). Whatever it got was
        # charged to it: a refused or reset attempt is the worker's failure, never
        # abandoned.
        books = dead()["tasks"]
        assert books["abandoned"] == 0
        assert books["attempts"] == books["succeeded"] + books["failed"]
        # Offered tasks now, it is charged for each attempt, and fail_max of them open
        # its breaker (fewer if the load already charged some); each of those tasks
        # is retried on a survivor and succeeds.
        offered = 0
        while dead()["breaker"]["state"] != "open":
            assert offered < config.circuit_breaker.fail_max, dead()
            before = dead()["tasks"]
            result = pool.execute(Task(payload(600 + offered), prefers={"id=w1"}))
            offered += 1
            assert result["worker_id"] in {"w0", "w2"}
            after = dead()["tasks"]
            assert after["attempts"] == before["attempts"] + 1
            assert after["failed"] == before["failed"] + 1
        attempts_on_dead = dead()["tasks"]["attempts"]
        # The open breaker keeps every further attempt off the dead worker, even from
        # tasks that prefer it.
        more = [
            Task(payload(700 + i), prefers={"id=w1"}) if i % 2 else Task(payload(700 + i))
            for i in range(200)
        ]
        assert {r["worker_id"] for r in pool.map(more)} <= {"w0", "w2"}
        assert dead()["tasks"]["attempts"] == attempts_on_dead
        assert dead()["breaker"]["state"] == "open"
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


# Attacks: workers killed with SIGKILL in the middle of a task on a reused keep-alive
# connection. The worker is a separate process (a raw-socket HTTP server), so the kernel
# closes its connections as it would for a crashed worker; the transport cannot tell the
# death from a stale keep-alive connection: a task that may be re-sent is, and the
# re-send's refused connect is the worker's failure; a task that may not ends
# dead-lettered without charging anyone. Every client.


# Answers every request on a keep-alive connection, one connection at a time, except
# POST /hang: it says "hung" on stdout and waits to be killed.
WORKER = r"""
import socket, threading

def requests(conn):
    buf = b""
    while True:
        while b"\r\n\r\n" not in buf:
            data = conn.recv(65536)
            if not data:
                return
            buf += data
        head, _, buf = buf.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(buf) < length:
            data = conn.recv(65536)
            if not data:
                return
            buf += data
        buf = buf[length:]
        yield head

listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(16)
print(listener.getsockname()[1], flush=True)
body = b'{"ok": true}'
while True:
    conn, _ = listener.accept()
    for head in requests(conn):
        if head.startswith(b"POST /hang "):
            print("hung", flush=True)
            threading.Event().wait()
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
    conn.close()
"""


@pytest.fixture
def worker() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True, bufsize=1
    )
    yield proc
    proc.kill()
    proc.wait()
    assert proc.stdout is not None
    proc.stdout.close()


@pytest.fixture(params=CLIENTS)
def run(request: pytest.FixtureRequest, worker: subprocess.Popen[str]) -> Iterator[PoolRun]:
    assert worker.stdout is not None
    port = int(worker.stdout.readline())
    pool_run = PoolRun(str(request.param), [f"http://127.0.0.1:{port}"], fail_max=10)
    yield pool_run
    pool_run.close()


def kill_mid_task(run: PoolRun, worker: subprocess.Popen[str], *, idempotent: bool) -> Ended:
    """One task on the worker's kept-alive connection; SIGKILL once the worker has it."""
    assert run.execute().kind == "result"  # leaves its connection open for reuse
    ended: list[Ended] = []
    caller = threading.Thread(
        target=lambda: ended.append(run.execute(endpoint="/hang", idempotent=idempotent)),
        name="caller",
    )
    caller.start()
    assert worker.stdout is not None
    assert worker.stdout.readline() == "hung\n"
    worker.kill()
    worker.wait()
    caller.join(TASK + 5)
    assert not caller.is_alive()
    (result,) = ended
    return result


def test_a_worker_killed_mid_task_is_charged_for_the_refused_resend(run, worker):
    """Replayable: re-sent at once on a new connection, refused, and that is charged."""
    ended = kill_mid_task(run, worker, idempotent=True)
    assert ended.kind == "failed"
    assert isinstance(ended.error, Exception)
    first = ended.error.attempts[0]  # type: ignore[attr-defined]
    # Refused, or reset when the re-send reached the listening socket of a process
    # whose exit had closed the connection but not yet the listener.
    assert first.error.startswith(("connect", "reset")), first.error
    assert "stale" not in first.error and "not re-sent" not in first.error
    assert run.charged() == len(ended.error.attempts)  # type: ignore[attr-defined]
    assert run.abandoned() == 0


def test_a_worker_killed_mid_task_that_cannot_be_resent_charges_nobody_yet(run, worker):
    """Not replayable: dead-lettered as stale, uncharged; the next task finds it gone."""
    ended = kill_mid_task(run, worker, idempotent=False)
    assert ended.kind == "failed"
    assert (run.charged(), run.abandoned()) == (0, 1)
    assert run.execute().kind == "failed"
    assert run.charged() >= 1


# Attacks on whole-fleet edges against real reference workers and hostile servers: hedged
# failed tasks, payload-specific 404s, fleets that go down and come back.


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


def _down_config(urls: list[str], **breaker: Any) -> PoolConfig:
    return PoolConfig(
        workers=tuple(worker_config(f"w{i}", url) for i, url in enumerate(urls)),
        health=HealthConfig(enabled=False),
        circuit_breaker=BreakerConfig(**{"fail_max": 1, "reset_timeout": 60, **breaker}),
        retry=RetryConfig(max_retries=3, backoff_initial=0.01, backoff_max=0.05),
    )


def test_a_fleet_killed_then_restarted_recovers_by_itself_without_health_checks(
    start_worker,
) -> None:
    """Every worker killed, one restarted: the next task waits for its trial and runs."""
    import concurrent.futures

    from npu_sync import NoWorkerAvailable

    workers = [start_worker(worker_id=f"w{i}") for i in range(2)]
    with WorkerPool(_down_config([w.url for w in workers], reset_timeout=0.3)) as pool:
        pool.execute({"model_id": "default", "input_text": "warm"})
        for w in workers:
            w.kill()
        with pytest.raises(TaskFailed):
            pool.execute({"model_id": "default", "input_text": "x"}, timeout=0.2)
        with pytest.raises(NoWorkerAvailable, match="all 2 workers are down: 2 breakers open"):
            pool.execute({"model_id": "default", "input_text": "y"}, timeout=0.1)
        workers[0].restart()
        with concurrent.futures.ThreadPoolExecutor(4) as callers:
            done = list(
                callers.map(
                    lambda n: pool.execute(
                        {"model_id": "default", "input_text": f"z{n}"}, timeout=10
                    ),
                    range(4),
                )
            )
        assert len(done) == 4


def test_two_misrouted_workers_end_a_task_at_once_with_the_clause(servers) -> None:
    """Both entries point at another service: TaskFailed names them, its dead letter stored."""
    from tests.hostile import Hostile, answer, keep_answering

    for _ in range(2):
        servers.append(Hostile(keep_answering(lambda seen: answer(404, b'{"detail":"Not Found"}'))))
    with WorkerPool(_down_config([s.url() for s in servers])) as pool:
        with pytest.raises(TaskFailed) as info:
            pool.execute({"model_id": "default", "input_text": "x"}, timeout=30)
        assert "not NPU workers" in str(info.value), str(info.value)
        assert pool.dead_letters.get(info.value.dead_letter_id) is not None
        with pytest.raises(TaskFailed, match="all 2 workers are down: 2 not NPU workers"):
            pool.execute({"model_id": "default", "input_text": "x"}, timeout=30)


def test_a_fallback_that_calls_back_into_a_pool_that_is_down_does_not_deadlock(servers) -> None:
    """A fallback running another task on the same downed pool gets its own fallback."""
    from tests.hostile import Hostile, answer, keep_answering

    servers.append(Hostile(keep_answering(lambda seen: answer(503, b'{"detail":"down"}'))))
    with WorkerPool(_down_config([servers[0].url()])) as pool:
        with pytest.raises(TaskFailed):
            pool.execute({"model_id": "default", "input_text": "trip"}, timeout=5)

        def fallback() -> Any:
            inner = pool.execute(
                {"model_id": "default", "input_text": "inner"}, timeout=30, fallback=lambda: 1
            )
            return inner + 1

        assert pool.execute({"model_id": "default"}, timeout=30, fallback=fallback) == 2
        assert pool.stats()["tasks"]["fallbacks"] == 2


def _interrupting(name: str) -> Any:
    def hook(event: Any) -> None:
        if getattr(event, "name", "") == name:
            raise KeyboardInterrupt

    return hook


def _quiet(pool: WorkerPool) -> None:
    assert [w["in_flight"] for w in pool.workers()] == [0] * len(pool.workers())
    assert pool.stats()["tasks"]["active"] == 0


def test_an_interrupt_in_the_credentials_hook_leaves_the_pool_whole(servers) -> None:
    """KeyboardInterrupt from the credentials-refused hook: no slot held, next task runs."""
    from tests.hostile import Hostile, answer, keep_answering

    def refusing(seen: Any) -> bytes:
        if seen.path == "/health":
            return answer(200, b'{"status": "healthy"}')
        return answer(401, b'{"detail": "bad signature"}')

    servers.append(Hostile(keep_answering(refusing)))
    servers.append(Hostile(keep_answering(lambda seen: answer(200, b'{"ok": 1}'))))
    config = PoolConfig(
        workers=(
            worker_config("w0", servers[0].url(), priority=1),
            worker_config("w1", servers[1].url(), priority=2),
        ),
        health=HealthConfig(enabled=False),
    )
    with WorkerPool(config) as pool:
        pool.add_hook(_interrupting("worker.credentials_refused"))
        with pytest.raises(KeyboardInterrupt):
            pool.execute({"model_id": "default"}, timeout=30)
        _quiet(pool)
        assert pool.execute({"model_id": "default"}, timeout=30) == {"ok": 1}
        _quiet(pool)


def test_an_interrupt_while_a_downed_fleet_fails_a_task_at_once_keeps_its_dead_letter(
    servers,
) -> None:
    """KeyboardInterrupt from the dead-letter hook on the at-once path: record kept, pool whole."""
    from tests.hostile import Hostile, answer, keep_answering

    servers.append(Hostile(keep_answering(lambda seen: answer(503, b'{"detail":"down"}'))))
    with WorkerPool(_down_config([servers[0].url()])) as pool:
        with pytest.raises(TaskFailed):
            pool.execute({"model_id": "default"}, timeout=30)
        pool.add_hook(_interrupting("task.dead_lettered"))
        with pytest.raises(KeyboardInterrupt):
            pool.execute(Task({"model_id": "default"}, task_id="interrupted"), timeout=30)
        assert [r.task_id for r in pool.dead_letters.list()].count("interrupted") == 1
        _quiet(pool)
        assert pool.execute({"model_id": "default"}, timeout=30, fallback=lambda: 7) == 7


def _health_config(workers: list[tuple[str, str]]) -> PoolConfig:
    return PoolConfig(
        workers=tuple(worker_config(wid, url) for wid, url in workers),
        health=HealthConfig(enabled=True, interval=60, timeout=2, healthy_threshold=1),
        circuit_breaker=BreakerConfig(fail_max=1, reset_timeout=60),
        retry=RetryConfig(max_retries=2, backoff_initial=0.01, backoff_max=0.05),
    )


def _gated_worker(servers: list[Any], gate: Any, health: int) -> Any:
    """A worker whose health checks wait for ``gate``, then answer ``health``."""
    from tests.hostile import Hostile, answer, keep_answering

    def reply(seen: Any) -> bytes:
        if seen.path == "/health":
            gate.wait(30)
            status = b"healthy" if health == 200 else b"starting"
            return answer(health, b'{"status": "%s"}' % status)
        return answer(200, b'{"worker_id": "w4"}')

    server = Hostile(keep_answering(reply))
    servers.append(server)
    return server


def _wait_until(predicate: Any) -> None:
    import threading

    pause = threading.Event()
    for _ in range(3000):
        if predicate():
            return
        pause.wait(0.01)
    raise AssertionError("condition never met")


def _replace_dead_fleet(start_worker, servers, health: int) -> Any:
    """A pool whose only worker w1 died, reloaded to w4 whose first check is held
    until a task waits; returns how that task ended."""
    import threading

    old = start_worker(worker_id="w1")
    gate = threading.Event()
    new = _gated_worker(servers, gate, health)
    with WorkerPool(_health_config([("w1", old.url)])) as pool:
        pool.execute({"model_id": "default", "input_text": "x"}, timeout=10)
        old.kill()
        with pytest.raises(TaskFailed):
            pool.execute({"model_id": "default", "input_text": "x"}, timeout=10)
        pool.reload(_health_config([("w4", new.url())]))
        future = pool.submit({"model_id": "default", "input_text": "x"}, timeout=60)
        _wait_until(lambda: future.done() or pool.stats()["tasks"]["waiting"] == 1)
        gate.set()
        try:
            return future.result(timeout=5)  # pool.max_queue_wait is 10 s
        except Exception as exc:
            return exc


def test_a_task_right_after_a_reload_replacing_a_dead_fleet_waits_for_the_new_worker(
    start_worker, servers
) -> None:
    """w1 dead, replaced by a live w4: a task sent before w4's first check runs on w4."""
    assert _replace_dead_fleet(start_worker, servers, 200) == {"worker_id": "w4"}


def test_a_task_waiting_for_a_new_worker_is_refused_when_its_first_check_fails(
    start_worker, servers
) -> None:
    """w1 dead, replaced by a sick w4: the waiting task ends on w4's first check, well
    before pool.max_queue_wait (TaskFailed, or NoWorkerAvailable when it never got as
    far as trying the dead w1, which serves until w4 answers)."""
    ended = _replace_dead_fleet(start_worker, servers, 503)
    assert isinstance(ended, TaskFailed), ended
    assert "all 2 workers are down" in str(ended)


def test_close_during_a_handover_returns_and_leaves_no_thread(start_worker, servers) -> None:
    """close() while the new worker's first check hangs: returns, no pool thread left."""
    import threading
    import time

    old = start_worker(worker_id="w1")
    gate = threading.Event()
    new = _gated_worker(servers, gate, 200)
    pool = WorkerPool(_health_config([("w1", old.url)]))
    try:
        pool.reload(_health_config([("w4", new.url())]))
        assert pool.stats()["reloads"]["handover"]["awaited"] == ["w4"]
        assert pool.execute({"model_id": "default", "input_text": "x"}, timeout=10)
    finally:
        start = time.monotonic()
        pool.close()
        took = time.monotonic() - start
        gate.set()
    assert took < 5  # the health check's own timeout is 2 s
    left = [t for t in threading.enumerate() if t.name.startswith("npu-sync")]
    for thread in left:
        thread.join(2)
    assert not [t.name for t in left if t.is_alive()]
