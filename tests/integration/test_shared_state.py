"""Several processes sharing breakers and dead letters through a real Redis."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from npu_sync import ConfigError, NpuSyncError, Task, TaskFailed, WorkerPool
from npu_sync._deadletter import DeadLetter, SQLiteDeadLetterStore
from npu_sync._spool import default_base
from npu_sync.config import (
    BalancingConfig,
    BreakerConfig,
    DeadLetterConfig,
    HealthConfig,
    PoolConfig,
    RetryConfig,
    SharedStateConfig,
    worker_config,
)

from .conftest import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("private_temp_dir")]

CLIENT = [sys.executable, "-m", "tests.integration.shared_client"]


class RedisCalls:
    """Counts the commands each thread sends to Redis (a frozen Redis makes each wait)."""

    def __init__(self, monkeypatch) -> None:
        self.by_thread: dict[str, int] = {}
        self.lock = threading.Lock()
        self.counting = False
        original = redis.connection.AbstractConnection.send_packed_command

        def counted(conn, *args, **kwargs):
            if self.counting:
                name = threading.current_thread().name
                with self.lock:
                    self.by_thread[name] = self.by_thread.get(name, 0) + 1
            return original(conn, *args, **kwargs)

        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)

    def from_callers(self) -> int:
        """Commands sent by the test's own thread, which is where tasks run."""
        with self.lock:
            return self.by_thread.get(threading.main_thread().name, 0)


def yaml_for(workers, redis_url: str, *, fail_max: int = 5, shared: bool = True) -> str:
    lines = ["npu_workers:", "  workers:"]
    lines += [f"    - {{id: {w.worker_id}, url: '{w.url}', max_concurrent: 8}}" for w in workers]
    lines += [
        "  health: {enabled: false}",
        f"  circuit_breaker: {{fail_max: {fail_max}, reset_timeout: 60}}",
        "  retry: {max_retries: 3, backoff_initial: 0.01, backoff_max: 0.02}",
        # Least connections: a dead worker's attempts are counted by its breaker, not
        # avoided because its reset connections made it look slow.
        "  balancing: {latency_aware: false}",
    ]
    if shared:
        lines += [f"  shared_state: {{backend: redis, url: '{redis_url}', sync_interval: 0.2}}"]
    return "\n".join(lines) + "\n"


def run_processes(config_path, n: int, tasks: int, threads: int, before_go) -> list[dict]:
    procs = [
        subprocess.Popen(
            [*CLIENT, str(config_path), str(tasks), str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        before_go()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [json.loads(p.stdout.readline()) for p in procs]
        for p in procs:
            p.wait(30)
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stdin.close()
            p.stdout.close()


@pytest.mark.slow
def test_a_dead_worker_costs_fail_max_attempts_across_processes_not_per_process(
    start_worker, redis_server, tmp_path
):
    """Four processes, one worker killed: it opens everywhere, for fewer attempts in all
    than each process finding it by itself."""
    processes, fail_max = 4, 5
    counts = {}
    for shared in (False, True):
        workers = [start_worker(worker_id=f"w{i}", latency_ms=2) for i in range(3)]
        path = tmp_path / f"pool-{shared}.yaml"
        path.write_text(yaml_for(workers, redis_server.url, fail_max=fail_max, shared=shared))
        results = run_processes(path, processes, 150, 4, workers[1].kill)
        assert all(r["failed"] == 0 for r in results)
        counts[shared] = sum(r["attempts"].get("w1", 0) for r in results)
        if shared:
            assert all(r["shared"]["available"] for r in results)
    print(
        f"\nattempts on the dead worker, 4 processes: alone {counts[False]}, shared {counts[True]}"
    )
    # Alone, every process pays fail_max. Shared, failures are counted per process: the
    # first to see fail_max in a row opens the worker everywhere; each other process has
    # paid at most fail_max - 1 of its own by then, plus the attempts it had in flight
    # (its callers spread over three workers, so about two).
    assert counts[False] >= processes * fail_max
    assert counts[True] <= fail_max + (processes - 1) * (fail_max - 1) + 2 * processes


def dead_letter_yaml(tmp_path, worker, redis_url: str, namespace: str):
    """A one-worker pool keeping its dead letters in Redis, as a file other processes load."""
    path = tmp_path / f"{namespace}.yaml"
    path.write_text(
        "npu_workers:\n  workers:\n"
        f"    - {{id: w0, url: '{worker.url}'}}\n"
        "  health: {enabled: false}\n"
        "  retry: {max_retries: 0}\n"
        "  circuit_breaker: {fail_max: 5, reset_timeout: 0.2, max_reset_timeout: 0.5}\n"
        f"  shared_state: {{backend: redis, url: '{redis_url}', namespace: {namespace}}}\n"
        "  dead_letter: {backend: redis}\n"
    )
    return path


def in_another_process(path, body: str) -> list[str]:
    """Run ``body`` with ``pool`` built from ``path`` in a new interpreter."""
    script = (
        "import json, sys\n"
        "from npu_sync import WorkerPool\n"
        "with WorkerPool.from_yaml(sys.argv[1], watch=False) as pool:\n"
        + "".join(f"    {line}\n" for line in body.splitlines())
    )
    return [sys.executable, "-c", script, str(path)]


def fail_into_dead_letters(path, worker, task_ids) -> None:
    worker.kill()
    with WorkerPool.from_yaml(path, watch=False) as pool:
        for task_id in task_ids:
            with pytest.raises(TaskFailed):
                pool.execute(Task({"input_text": task_id}, task_id=task_id))
    worker.restart()


def test_dead_letters_written_by_one_process_are_replayed_by_another(
    start_worker, redis_server, tmp_path
):
    """Records stored by one pool are listed, and replayed, by a pool in another process."""
    worker = start_worker(worker_id="w0")
    path = dead_letter_yaml(tmp_path, worker, redis_server.url, "dlq-test")
    fail_into_dead_letters(path, worker, [f"dl-{i}" for i in range(5)])
    command = in_another_process(
        path,
        "listed = [r.task_id for r in pool.dead_letters.list()]\n"
        "report = pool.dead_letters.replay()\n"
        "print(json.dumps({'listed': listed, 'succeeded': len(report.succeeded),"
        " 'left': len(pool.dead_letters)}))",
    )
    out = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(out.stdout)
    assert result == {"listed": [f"dl-{i}" for i in range(5)], "succeeded": 5, "left": 0}


@pytest.mark.slow
def test_a_replaying_process_killed_midway_loses_no_record(start_worker, redis_server, tmp_path):
    """Every record ends replayed (the worker saw it) or still stored (at-least-once)."""
    worker = start_worker(worker_id="w0")
    path = dead_letter_yaml(tmp_path, worker, redis_server.url, "kill-test")
    ids = [f"k-{i}" for i in range(20)]
    fail_into_dead_letters(path, worker, ids)
    worker.control(latency_ms=100)
    replayer = subprocess.Popen(in_another_process(path, "pool.dead_letters.replay()"))
    try:
        deadline = time.monotonic() + 30
        while worker.stats()["inference_count"] < 5:
            assert time.monotonic() < deadline, "the replay never got going"
            time.sleep(0.02)
    finally:
        replayer.kill()
        replayer.wait()
    worker.control(latency_ms=0)
    with WorkerPool.from_yaml(path, watch=False) as pool:
        left = {r.task_id for r in pool.dead_letters.list()}
        served = worker.stats()["task_ids_seen"]
        assert len(left) < len(ids)  # some were replayed and removed
        assert len(left) + served >= len(ids)  # nothing vanished unreplayed
        # The killed process's claims end with their lease; let them end now.
        import redis

        client = redis.Redis.from_url(redis_server.url)
        for key in client.keys("{kill-test}:dlq:claim:*"):
            client.delete(key)
        client.close()
        report = pool.dead_letters.replay()
        assert len(report.succeeded) == len(left)
        assert len(pool.dead_letters) == 0


def test_redis_outage_fails_no_task_and_sharing_resumes(
    start_worker, redis_server, tmp_path, monkeypatch
):
    """Redis killed under load: tasks carry on locally; restarted: sharing resumes."""
    workers = [start_worker(worker_id=f"w{i}") for i in range(2)]
    shared = SharedStateConfig(backend="redis", url=redis_server.url, sync_interval=0.1)
    config = PoolConfig(
        workers=tuple(worker_config(w.worker_id, w.url) for w in workers),
        health=HealthConfig(enabled=False),
        circuit_breaker=BreakerConfig(fail_max=2, reset_timeout=60),
        shared_state=shared,
        # Every other task goes to w1 whatever its latency: one task at a time, latency-
        # aware choice may keep picking the worker that answered faster, and w1 would
        # see no task while it is dead.
        balancing=BalancingConfig(strategy="round-robin"),
    )
    calls = RedisCalls(monkeypatch)
    with WorkerPool(config) as pool, WorkerPool(config) as other:
        for i in range(200):
            pool.execute({"input_text": f"before {i}"})
        redis_server.kill()
        workers[1].kill()  # failures while Redis is down: counted locally only
        calls.counting = True
        for i in range(200):
            pool.execute({"input_text": f"during {i}"})  # none fails: it would raise
        calls.counting = False
        # Tasks touch Redis only on the failure path, and after the first error not at
        # all: however slow an unreachable Redis is, no more than one task paid for it.
        assert calls.from_callers() <= 1
        stats = pool.stats()["shared_state"]
        assert stats["available"] is False and stats["outages"] == 1
        assert {w["id"]: w["breaker"]["state"] for w in pool.workers()}["w1"] == "open"
        redis_server.start()
        deadline = time.monotonic() + 10
        while not pool.stats()["shared_state"]["available"]:
            assert time.monotonic() < deadline, "sharing did not resume"
            time.sleep(0.02)
        # Sharing works again: a breaker opened now in one pool reaches the other.
        workers[0].kill()
        for i in range(3):
            # w1 is still dead and open: these fail fast rather than wait for it
            with pytest.raises(TaskFailed):
                pool.execute({"input_text": f"after {i}"}, timeout=0.3)
        deadline = time.monotonic() + 10
        while {w["id"]: w["breaker"]["state"] for w in other.workers()}["w0"] != "open":
            assert time.monotonic() < deadline, "the opening did not reach the other pool"
            time.sleep(0.02)


def shared_config(workers, url: str, **kw) -> PoolConfig:
    kw.setdefault("circuit_breaker", BreakerConfig(fail_max=2, reset_timeout=60))
    # Least connections, so that one task at a time goes round every worker (the dead
    # one included); latency-aware choice would keep sending them to the fastest.
    kw.setdefault("balancing", BalancingConfig(latency_aware=False))
    return PoolConfig(
        workers=tuple(worker_config(w.worker_id, w.url) for w in workers),
        health=HealthConfig(enabled=False),
        shared_state=SharedStateConfig(
            backend="redis", url=url, sync_interval=kw.pop("sync_interval", 0.1)
        ),
        **kw,
    )


def test_a_frozen_redis_costs_a_task_at_most_one_timeout(start_worker, redis_server, monkeypatch):
    """Redis hung (SIGSTOP), a worker dying: of all the tasks, at most one sends a
    command to Redis, i.e. at most one waits out shared_state.timeout."""
    workers = [start_worker(worker_id=f"w{i}") for i in range(3)]
    quick = RetryConfig(max_retries=3, backoff_initial=0.001, backoff_max=0.002)
    calls = RedisCalls(monkeypatch)
    with WorkerPool(shared_config(workers, redis_server.url, retry=quick)) as pool:
        for i in range(20):
            pool.execute({"input_text": f"warm {i}"})
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            workers[1].kill()
            calls.counting = True
            for i in range(300):
                pool.execute({"input_text": f"frozen {i}"})  # none fails: it would raise
            calls.counting = False
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        stats = pool.stats()
        assert stats["shared_state"]["available"] is False
    # w1 failed on the way (a failure is what sends a command): the path was taken.
    assert stats["tasks"]["retries"] >= 1
    # Each command to a frozen Redis waits out the timeout; the first marks Redis
    # unavailable, after which tasks send nothing: one wait at most, by construction.
    assert calls.from_callers() <= 1


def test_an_opening_reaches_another_process_by_pubsub_well_before_a_resync(
    start_worker, redis_server
):
    """With a 30 s re-read interval, another pool still sees an opening within a second."""
    workers = [start_worker(worker_id=f"w{i}") for i in range(2)]
    config = shared_config(workers, redis_server.url, sync_interval=30.0)
    with WorkerPool(config) as one, WorkerPool(config) as two:
        one.execute({"input_text": "warm"})
        two.execute({"input_text": "warm"})
        time.sleep(0.2)  # both subscribed (the first re-read happens at start)
        workers[0].kill()
        for i in range(4):
            one.execute({"input_text": f"x{i}"})
        assert {w["id"]: w["breaker"]["state"] for w in one.workers()}["w0"] == "open"
        deadline = time.monotonic() + 1.0
        while {w["id"]: w["breaker"]["state"] for w in two.workers()}["w0"] != "open":
            assert time.monotonic() < deadline, "the opening did not arrive by pub/sub"
            time.sleep(0.01)


def test_dead_letters_held_during_an_outage_reach_redis_at_close(start_worker, redis_server):
    """Records stored while Redis was down are written when the pool closes after it returns."""
    worker = start_worker(worker_id="w0")
    config = PoolConfig(
        workers=(worker_config("w0", worker.url),),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=0),
        shared_state=SharedStateConfig(
            backend="redis", url=redis_server.url, namespace="held", sync_interval=30.0
        ),
        dead_letter=DeadLetterConfig(backend="redis"),
    )
    worker.kill()
    pool = WorkerPool(config)
    try:
        redis_server.kill()
        for i in range(3):
            with pytest.raises(TaskFailed):
                pool.execute(Task({"input_text": "x"}, task_id=f"held-{i}"))
        assert pool.stats()["shared_state"]["dead_letters_held_locally"] == 3
        redis_server.start()
    finally:
        pool.close()
    import redis

    client = redis.Redis.from_url(redis_server.url)
    assert client.zcard("{held}:dlq:order") == 3
    client.close()


def test_the_cli_lists_dead_letters_kept_in_redis(start_worker, redis_server, tmp_path):
    """npu-sync dlq list works with dead_letter.backend: redis."""
    worker = start_worker(worker_id="w0")
    path = tmp_path / "pool.yaml"
    path.write_text(
        "npu_workers:\n  workers:\n"
        f"    - {{id: w0, url: '{worker.url}'}}\n"
        "  health: {enabled: false}\n"
        "  retry: {max_retries: 0}\n"
        f"  shared_state: {{backend: redis, url: '{redis_server.url}', namespace: cli}}\n"
        "  dead_letter: {backend: redis}\n"
    )
    worker.kill()
    with WorkerPool.from_yaml(path, watch=False) as pool, pytest.raises(TaskFailed):
        pool.execute(Task({"input_text": "x"}, task_id="from-cli"))
    out = subprocess.run(
        [sys.executable, "-m", "npu_sync", "dlq", "list", "--config", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert [r["task_id"] for r in json.loads(out.stdout)] == ["from-cli"]


def test_the_cli_waits_for_a_redis_slower_than_the_pools_timeout(
    start_worker, redis_server, tmp_path, capsys
):
    """npu-sync dlq list on a Redis that answers 0.5 s late (a busy host) lists the
    records rather than calling Redis unavailable: the pool's 50 ms is a task's limit,
    not an operator's."""
    from npu_sync.cli import main

    worker = start_worker(worker_id="w0")
    path = tmp_path / "pool.yaml"
    path.write_text(
        "npu_workers:\n  workers:\n"
        f"    - {{id: w0, url: '{worker.url}'}}\n"
        "  health: {enabled: false}\n"
        "  retry: {max_retries: 0}\n"
        f"  shared_state: {{backend: redis, url: '{redis_server.url}', namespace: slow}}\n"
        "  dead_letter: {backend: redis}\n"
    )
    worker.kill()
    with WorkerPool.from_yaml(path, watch=False) as pool, pytest.raises(TaskFailed):
        pool.execute(Task({"input_text": "x"}, task_id="listed-late"))
    capsys.readouterr()
    client = redis.Redis.from_url(redis_server.url)
    client.execute_command("CLIENT", "PAUSE", "500", "ALL")  # every other client waits
    client.close()
    assert main(["dlq", "list", "--config", str(path), "--json"]) == 0
    assert [r["task_id"] for r in json.loads(capsys.readouterr().out)] == ["listed-late"]


def test_a_wrong_redis_password_is_a_config_error_at_start(start_worker, redis_server):
    """Redis refusing the credentials fails the pool's start with shared_state.url named,
    the password masked; it is not taken for an outage to wait out."""
    client = redis.Redis.from_url(redis_server.url)
    client.config_set("requirepass", "right-password")
    client.close()
    worker = start_worker(worker_id="w0")
    for url in (
        redis_server.url.replace("redis://", "redis://:wrong-password@"),
        redis_server.url,  # no password at all
    ):
        config = shared_config([worker], url)
        with pytest.raises(ConfigError) as info:
            WorkerPool(config)
        (error,) = info.value.errors
        assert error.startswith("shared_state.url: Redis refused the credentials")
        assert "wrong-password" not in str(info.value)
    good = shared_config([worker], redis_server.url.replace("redis://", "redis://:right-password@"))
    with WorkerPool(good) as pool:
        assert pool.stats()["shared_state"]["available"] is True
        assert "right-password" not in repr(pool.config)


FIRST_TASK = """
import json, sys
from npu_sync import WorkerPool
with WorkerPool.from_yaml(sys.argv[1], watch=False) as pool:
    print(json.dumps(pool.execute({"input_text": "first"})["worker_id"]), flush=True)
"""


def test_a_new_process_reads_the_shared_breakers_before_its_first_task(
    start_worker, redis_server, tmp_path
):
    """Another process has opened w1's breaker: a new process's very first task goes to
    w0, although w1 is its preferred tier and answers again."""
    w0, w1 = start_worker(worker_id="w0"), start_worker(worker_id="w1")
    path = tmp_path / "pool.yaml"
    path.write_text(
        "npu_workers:\n  workers:\n"
        f"    - {{id: w1, url: '{w1.url}', priority: 1}}\n"
        f"    - {{id: w0, url: '{w0.url}', priority: 2}}\n"
        "  health: {enabled: false}\n"
        "  circuit_breaker: {fail_max: 2, reset_timeout: 600}\n"
        "  retry: {max_retries: 1, backoff_initial: 0.001, backoff_max: 0.002}\n"
        f"  shared_state: {{backend: redis, url: '{redis_server.url}', sync_interval: 30}}\n"
    )
    with WorkerPool.from_yaml(path, watch=False) as first:
        w1.control(status_code=503)
        for i in range(4):
            first.execute({"input_text": f"trip {i}"})
        assert {w["id"]: w["breaker"]["state"] for w in first.workers()}["w1"] == "open"
    w1.control(status_code=None)
    for _ in range(3):
        out = subprocess.run(
            [sys.executable, "-c", FIRST_TASK, str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert json.loads(out.stdout) == "w0", out.stderr
    assert w1.stats()["requests"].get("/inference", 0) == 2  # only the first pool's trips


HOLDER = """
import json, sys
from npu_sync import ConfigError, Task, TaskFailed, WorkerPool
pool = WorkerPool.from_yaml(sys.argv[1], watch=False)
try:
    pool.execute(Task({"input_text": "x"}, task_id="spooled"))
except TaskFailed as exc:
    print(json.dumps([exc.dead_letter_id, pool.stats()["shared_state"]]), flush=True)
sys.stdin.readline()  # killed here, without closing the pool
"""


def test_dead_letters_spooled_during_an_outage_survive_a_killed_process(
    start_worker, redis_server, tmp_path
):
    """TaskFailed gave an id while Redis was down; the process is SIGKILLed; once Redis
    is back, the next process writes the record from the spool file to Redis."""
    worker = start_worker(worker_id="w0")
    path = dead_letter_yaml(tmp_path, worker, redis_server.url, "spool-test")
    spool = tmp_path / "spool.sqlite3"
    path.write_text(
        path.read_text().replace("{backend: redis}", f"{{backend: redis, spool_path: '{spool}'}}")
    )
    worker.kill()
    redis_server.kill()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        record_id, shared = json.loads(holder.stdout.readline())
        assert record_id and shared["available"] is False
        assert shared["dead_letters_held_locally"] == 1
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdin.close()
        holder.stdout.close()
    redis_server.start()
    with WorkerPool.from_yaml(path, watch=False) as pool:
        deadline = time.monotonic() + 10
        while pool.stats()["shared_state"]["dead_letters_held_locally"]:
            assert time.monotonic() < deadline, "the spooled record never reached Redis"
            time.sleep(0.02)
        assert [(r.id, r.task_id) for r in pool.dead_letters.list()] == [(record_id, "spooled")]
    client = redis.Redis.from_url(redis_server.url)
    assert client.hexists("{spool-test}:dlq:records", record_id)
    client.close()


# Attacks on the per-process dead-letter spool and the Redis eviction check, with real
# redis-servers, real SQLite files and real child processes.


def refused_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def config_for(url: str, *, sync_interval: float = 0.05) -> PoolConfig:
    return PoolConfig(
        workers=(worker_config("w0", refused_url()),),
        health=HealthConfig(enabled=False),
        shared_state=SharedStateConfig(
            backend="redis", url=url, sync_interval=sync_interval, timeout=1.0
        ),
        dead_letter=DeadLetterConfig(backend="redis"),
    )


def wait_until(condition, what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        threading.Event().wait(0.02)


@pytest.fixture
def lru_redis_down(tmp_path) -> Iterator[RedisServer]:
    """An allkeys-lru Redis, not running yet (started by the test)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    directory = tmp_path / "lru"
    directory.mkdir()
    server = RedisServer(str(directory), "--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")
    try:
        yield server
    finally:
        server.kill()


def test_an_evicting_redis_that_comes_up_after_start_gets_no_dead_letters(lru_redis_down):
    """Redis down at start, then up with allkeys-lru: no dead letter goes into it, and a
    listing fails naming the policy instead of answering from a Redis that may evict."""
    with WorkerPool(config_for(lru_redis_down.url)) as pool:
        shared = pool._state.shared
        assert shared is not None and not shared.available
        lru_redis_down.start()
        wait_until(lambda: shared.available, "the shared state to come back")
        with pytest.raises(TaskFailed) as failed:
            pool.execute(Task({"input_text": "x"}, timeout=2))
        record_id = failed.value.dead_letter_id
        assert record_id
        client = redis.Redis.from_url(lru_redis_down.url)
        try:
            assert client.hget("{npu_sync}:dlq:records", record_id) is None
        finally:
            client.close()
        with pytest.raises(NpuSyncError, match="maxmemory-policy allkeys-lru"):
            pool.dead_letters.list()


SPOOLER = """
import sys, time
from npu_sync import Task
from npu_sync._deadletter import DeadLetter
from npu_sync._spool import ProcessSpool, default_base
spool = ProcessSpool(default_base(sys.argv[1], sys.argv[2]))
record = DeadLetter.from_task(
    Task({"input_text": "kept"}), endpoint="/x", error="e", attempts=[], now=time.time()
)
spool.own.store.add(record)
print(record.id, flush=True)
sys.stdin.readline()  # SIGKILLed here: the file is an ended process's
"""


def corrupt_spool(base: str) -> str:
    """A spool file whose header reads but whose records do not (a bad disk sector, a
    partial copy), left with a free lock by a process that ended; it sorts first."""
    path = f"{base}.{'0' * 32}"
    store = SQLiteDeadLetterStore(path)
    for _ in range(4):
        store.add(
            DeadLetter.from_task(
                Task({"input_text": "y" * 50_000}),
                endpoint="/x",
                error="e",
                attempts=[],
                now=time.time(),
            )
        )
    store.close()
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\xa5" * 8192)
    with open(path + ".lock", "w"):
        pass
    return path


def test_a_corrupt_spool_of_an_ended_process_does_not_hide_the_others(redis_server, caplog):
    """An unreadable orphan spool is skipped and named in an ERROR; the records of the
    other ended processes are still moved and listed, and the listing does not crash."""
    config = config_for(redis_server.url)
    base = default_base(config.shared_state.namespace, redis_server.url)
    bad = corrupt_spool(base)
    child = subprocess.Popen(
        [sys.executable, "-c", SPOOLER, config.shared_state.namespace, redis_server.url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])},
    )
    try:
        record_id = child.stdout.readline().strip()
    finally:
        child.kill()
        child.wait(30)
        child.stdin.close()
        child.stdout.close()
    assert record_id
    with (
        caplog.at_level(logging.ERROR, logger="npu_sync._shared"),
        WorkerPool(config_for(redis_server.url, sync_interval=60)) as pool,
    ):
        assert [r.id for r in pool.dead_letters.list()] == [record_id]
    assert any(bad in r.getMessage() for r in caplog.records)
    assert os.path.exists(bad)  # left for the operator, never deleted
