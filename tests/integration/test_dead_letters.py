"""Dead letters on real files and real processes: exactly-once replay, bounded waits."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest
import redis

from npu_sync import ConfigError, NpuSyncError, Task, TaskFailed, WorkerPool
from npu_sync import _deadletter as deadletter_module
from npu_sync._deadletter import DeadLetter, SQLiteDeadLetterStore
from npu_sync._shared import RedisDeadLetterStore
from npu_sync.config import (
    DeadLetterConfig,
    HealthConfig,
    PoolConfig,
    RetryConfig,
    SharedStateConfig,
    TimeoutConfig,
    worker_config,
)
from npu_sync.task import Attempt

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("private_temp_dir")]

# A process that replays a file's dead letters when told to (a second argument: the
# claim's base lease in seconds).
REPLAYER = """
import json, sys
import npu_sync._deadletter
if len(sys.argv) > 2:
    npu_sync._deadletter.CLAIM_SECONDS = float(sys.argv[2])
from npu_sync import WorkerPool
with WorkerPool.from_yaml(sys.argv[1], watch=False) as pool:
    print("ready", flush=True)
    sys.stdin.readline()
    report = pool.dead_letters.replay()
    print(json.dumps(report.to_dict()["succeeded"]), flush=True)
"""


def stored_records(path, n: int) -> list[str]:
    store = SQLiteDeadLetterStore(path)
    try:
        for i in range(n):
            task = Task({"input_text": f"replay {i}"}, task_id=f"replay-{i}")
            store.add(
                DeadLetter.from_task(
                    task,
                    endpoint="/inference",
                    error="down",
                    attempts=[Attempt("w0", "refused", 0.01)],
                    now=1_700_000_000.0 + i,
                )
            )
        return [r.id for r in store.list()]
    finally:
        store.close()


def test_two_processes_replaying_one_sqlite_file_run_each_record_once(start_worker, tmp_path):
    """Two processes replay the same store at the same moment: every task reaches the
    worker exactly once, and every record is removed by exactly one of them."""
    worker = start_worker(worker_id="w0", latency_ms=30)
    store_path = tmp_path / "dead.sqlite3"
    ids = stored_records(store_path, 24)
    config = tmp_path / "pool.yaml"
    config.write_text(
        "npu_workers:\n"
        f"  workers: [{{id: w0, url: '{worker.url}'}}]\n"
        "  health: {enabled: false}\n"
        f"  dead_letter: {{backend: sqlite, path: '{store_path}'}}\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", REPLAYER, str(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        for proc in procs:
            assert proc.stdout.readline().strip() == "ready"
        for proc in procs:  # both start replaying from the same full listing
            proc.stdin.write("go\n")
            proc.stdin.flush()
        reports = [json.loads(proc.stdout.readline()) for proc in procs]
        for proc in procs:
            assert proc.wait(60) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdin.close()
            proc.stdout.close()
    stats = worker.stats()
    print(f"\nreplayed by each process: {[len(r) for r in reports]}; worker saw {stats}")
    assert stats["duplicates"] == 0
    assert stats["task_ids_seen"] == len(ids)
    assert sorted(reports[0] + reports[1]) == sorted(ids)
    assert all(reports)  # both took part: the race really happened
    store = SQLiteDeadLetterStore(store_path)
    assert len(store) == 0
    store.close()


def dead_pool_config(store_path) -> PoolConfig:
    return PoolConfig(
        workers=(worker_config("gone", "http://127.0.0.1:9"),),  # nothing listens on 9
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=0),
        dead_letter=DeadLetterConfig(backend="sqlite", path=str(store_path)),
    )


def test_a_locked_store_holds_a_failing_task_no_longer_than_its_deadline(tmp_path):
    """Another process holds the file's write lock: the task still ends (TaskFailed, its
    record logged) while that lock is held, and stats() answers meanwhile."""
    store_path = tmp_path / "dead.sqlite3"
    with WorkerPool(dead_pool_config(store_path)) as pool:
        blocker = sqlite3.connect(store_path, isolation_level=None, check_same_thread=False)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            future = pool.submit(Task({"input_text": "x"}, timeout=0.5))
            # The store's busy timeout is 30 s: ending within 10 s, with the lock still
            # held, is only possible if the wait was bounded by the task.
            error = future.exception(timeout=10)
            assert isinstance(error, TaskFailed)
            assert error.dead_letter_id is None
            assert "its dead letter could not be stored" in str(error)
            assert "stayed locked by another connection" in str(error)
            stats = pool.stats()
            assert stats["dead_letters"]["pending"] == 0
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        with pytest.raises(TaskFailed) as stored:
            pool.execute(Task({"input_text": "y"}, timeout=0.5))
        assert stored.value.dead_letter_id is not None


def test_stats_never_wait_for_a_store_another_thread_is_stuck_on(tmp_path):
    """A dead-letter write stuck on the file's lock does not make stats() wait."""
    store_path = tmp_path / "dead.sqlite3"
    with WorkerPool(dead_pool_config(store_path)) as pool:
        blocker = sqlite3.connect(store_path, isolation_level=None, check_same_thread=False)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            record = DeadLetter.from_task(
                Task({"input_text": "x"}), endpoint="/inference", error="e", attempts=(), now=1.0
            )
            stuck = threading.Thread(target=pool.dead_letters.add, args=(record,), daemon=True)
            stuck.start()  # no timeout: waits up to the 30 s busy timeout, lock held
            pause = threading.Event()
            for _ in range(1000):
                if pool.dead_letters.store._lock.locked():
                    break
                pause.wait(0.01)
            stats = pool.stats()
            assert stuck.is_alive()  # stats() came back while the write still waits
            assert stats["dead_letters"]["pending"] == 0
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        stuck.join(10)
        assert pool.stats()["dead_letters"]["pending"] == 1


def test_a_deleted_store_directory_fails_tasks_loudly_and_logs_each_record(tmp_path, caplog):
    """With the store's directory gone, TaskFailed says the record was not stored and
    the whole record is in the log: none "succeeds" into an unlinked file."""
    directory = tmp_path / "state"
    directory.mkdir()
    with WorkerPool(dead_pool_config(directory / "dead.sqlite3")) as pool:
        with pytest.raises(TaskFailed) as first:
            pool.execute(Task({"input_text": "before"}, task_id="before"))
        assert first.value.dead_letter_id is not None
        shutil.rmtree(directory)
        with caplog.at_level(logging.ERROR):
            for i in range(3):
                with pytest.raises(TaskFailed) as lost:
                    pool.execute(Task({"input_text": f"after {i}"}, task_id=f"after-{i}"))
                assert lost.value.dead_letter_id is None
                assert "its dead letter could not be stored" in str(lost.value)
                assert "directory was deleted" in str(lost.value)
        logged = [r.getMessage() for r in caplog.records if "record:" in r.getMessage()]
        assert [m for m in logged if '"task_id": "after-' in m] == logged
        assert len(logged) == 3
        assert pool.stats()["dead_letters"]["pending"] is None


# Attacks on dead-letter durability and exactly-once replay, with real files, real worker
# processes, real Redis and processes killed mid-way.


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    pause = threading.Event()
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        pause.wait(0.01)


def record(i: int, *, timeout: float | None = None) -> DeadLetter:
    task = Task({"input_text": f"replay {i}"}, task_id=f"replay-{i}", timeout=timeout)
    return DeadLetter.from_task(
        task,
        endpoint="/inference",
        error="down",
        attempts=[Attempt("w0", "refused", 0.01)],
        now=1_700_000_000.0 + i,
    )


def fill_sqlite(path, n: int, **kw) -> list[str]:
    store = SQLiteDeadLetterStore(path)
    try:
        for i in range(n):
            store.add(record(i, **kw))
        return [r.id for r in store.list()]
    finally:
        store.close()


def sqlite_yaml(tmp_path, worker, store_path, *, task_timeout: float = 25.0):
    path = tmp_path / "pool.yaml"
    path.write_text(
        "npu_workers:\n"
        f"  workers: [{{id: w0, url: '{worker.url}', max_concurrent: 64}}]\n"
        "  health: {enabled: false}\n"
        f"  timeouts: {{task: {task_timeout}, read: {task_timeout}}}\n"
        f"  dead_letter: {{backend: sqlite, path: '{store_path}'}}\n"
    )
    return path


def replayers(config, n: int, *extra: str) -> list[subprocess.Popen]:
    return [
        subprocess.Popen(
            [sys.executable, "-c", REPLAYER, str(config), *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for _ in range(n)
    ]


def finish(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


def test_three_processes_replaying_200_records_run_each_once(start_worker, tmp_path):
    """Three processes replay one SQLite file of 200 records at the same moment: the
    worker sees each task id once, and each record is removed by exactly one of them."""
    worker = start_worker(worker_id="w0", latency_ms=2)
    store_path = tmp_path / "dead.sqlite3"
    ids = fill_sqlite(store_path, 200)
    procs = replayers(sqlite_yaml(tmp_path, worker, store_path), 3)
    try:
        for proc in procs:
            assert proc.stdout.readline().strip() == "ready"
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        reports = [json.loads(proc.stdout.readline()) for proc in procs]
        for proc in procs:
            assert proc.wait(120) == 0
    finally:
        finish(procs)
    stats = worker.stats()
    print(f"\nreplayed per process: {[len(r) for r in reports]}; worker: {stats['duplicates']}")
    assert stats["duplicates"] == 0
    assert stats["task_ids_seen"] == 200
    assert sorted(rid for report in reports for rid in report) == sorted(ids)
    store = SQLiteDeadLetterStore(store_path)
    assert len(store) == 0
    store.close()


@pytest.mark.slow
def test_a_replayer_killed_mid_replay_leaves_records_for_another_once_its_claims_end(
    start_worker, tmp_path
):
    """SIGKILL while a replay's task is at the worker: its claim holds off a second
    replayer until the lease ends, then every record is replayed; only the task that
    was on the wire when the process died reaches the worker twice (same task id, so
    the worker can tell)."""
    worker = start_worker(worker_id="w0")
    store_path = tmp_path / "dead.sqlite3"
    fill_sqlite(store_path, 10)
    config = sqlite_yaml(tmp_path, worker, store_path, task_timeout=5.0)
    (victim,) = replayers(config, 1, "0.5")
    try:
        assert victim.stdout.readline().strip() == "ready"
        worker.control(latency_ms=50)
        victim.stdin.write("go\n")
        victim.stdin.flush()
        wait_for(lambda: worker.stats()["task_ids_seen"] >= 4, "the replay to get going")
        worker.control(hang=True)
        wait_for(lambda: worker.stats()["in_flight"] == 1, "a task on the wire")
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    finally:
        finish([victim])
    worker.control(hang=False, latency_ms=0)
    left = {r.task_id for r in SQLiteDeadLetterStore(store_path).list()}
    assert 0 < len(left) < 10
    claimed = sqlite3.connect(store_path).execute("SELECT COUNT(*) FROM dead_letter_claims")
    assert claimed.fetchone()[0] == 1  # the killed process's claim is still in the file
    with WorkerPool.from_yaml(config, watch=False) as pool:
        early = pool.dead_letters.replay()
        assert len(early.succeeded) == len(left) - 1  # the claimed one is left alone
        wait_for(lambda: len(pool.dead_letters.replay().succeeded) == 1, "the lease to end")
        assert len(pool.dead_letters) == 0
    stats = worker.stats()
    assert stats["task_ids_seen"] == 10
    assert stats["duplicates"] == 1


def hung_worker_pool_config(worker, store) -> PoolConfig:
    return PoolConfig(
        workers=(worker_config("w0", worker.url),),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=0),
        timeouts=TimeoutConfig(read=60.0, task=60.0),
        dead_letter=store,
    )


def second_replay_of(pool: WorkerPool, record_id: str, worker) -> str:
    """Replay record_id from another pool while the first replay hangs at the worker:
    "refused", or "ran" once that second run reached the worker."""
    outcome: list[str] = []

    def run() -> None:
        try:
            pool.dead_letters.replay(record_id)
        except NpuSyncError as exc:
            assert "already being replayed" in str(exc)
            outcome.append("refused")
        else:
            outcome.append("ran")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_for(lambda: outcome or worker.stats()["duplicates"], "the second replay's outcome")
    return outcome[0] if outcome else "ran"


def replay_past_the_lease(first, second, rid, worker) -> str:
    """``first`` replays ``rid`` on the hung ``worker``; once the replay is at the
    worker and the base claim lease has passed, ``second`` tries the same record.
    The worker is let go whatever happens; returns what the second replay met."""
    claimed_at = time.time()
    replay = threading.Thread(target=first.dead_letters.replay, args=(rid,))
    replay.start()
    try:
        wait_for(lambda: worker.stats()["in_flight"] == 1, "the replay at the worker")
        wait_for(lambda: time.time() > claimed_at + 0.6, "the base lease to pass")
        return second_replay_of(second, rid, worker)
    finally:
        worker.control(hang=False)
        replay.join(30)


def test_a_sqlite_claim_outlives_a_replay_longer_than_its_lease(
    start_worker, tmp_path, monkeypatch
):
    """A replay that runs past the claim's base lease (a slow worker, a long task
    timeout) still holds its claim: another process's replay is refused, not run."""
    monkeypatch.setattr(deadletter_module, "CLAIM_SECONDS", 0.3)
    worker = start_worker(worker_id="w0")
    store_path = tmp_path / "dead.sqlite3"
    (rid,) = fill_sqlite(store_path, 1)
    settings = DeadLetterConfig(backend="sqlite", path=str(store_path))
    worker.control(hang=True)
    with (
        WorkerPool(hung_worker_pool_config(worker, settings)) as first,
        WorkerPool(hung_worker_pool_config(worker, settings)) as second,
    ):
        outcome = replay_past_the_lease(first, second, rid, worker)
    assert worker.stats()["duplicates"] == 0, "the record ran twice"
    assert outcome == "refused"


def test_a_redis_claim_outlives_a_replay_longer_than_its_lease(
    start_worker, redis_server, monkeypatch
):
    """The same with dead letters in Redis: the claim's PX lease covers the replay."""
    monkeypatch.setattr(RedisDeadLetterStore, "CLAIM_SECONDS", 0.3)
    worker = start_worker(worker_id="w0")
    settings = DeadLetterConfig(backend="redis")

    def config() -> PoolConfig:
        return dataclasses.replace(
            hung_worker_pool_config(worker, settings),
            shared_state=SharedStateConfig(
                backend="redis", url=redis_server.url, namespace="lease", timeout=0.5
            ),
        )

    worker.control(hang=True)
    with WorkerPool(config()) as first, WorkerPool(config()) as second:
        first.dead_letters.add(record(0))
        (rid,) = [r.id for r in first.dead_letters.list()]
        outcome = replay_past_the_lease(first, second, rid, worker)
    assert worker.stats()["duplicates"] == 0, "the record ran twice"
    assert outcome == "refused"


class CloseDuringRemove(SQLiteDeadLetterStore):
    """A real SQLite store on which the pool's close() starts just as a replay removes
    its record: the moment a close could slip in between the task and its bookkeeping."""

    pool: WorkerPool | None = None
    closer: threading.Thread | None = None

    def remove(self, record_id: str) -> bool:
        pool = self.pool
        if pool is not None and self.closer is None:
            self.closer = threading.Thread(target=pool.close)
            self.closer.start()
            # Either close() is waiting for this replay to finish (it must), or it has
            # already closed the store under it.
            wait_for(lambda: self._closed or (pool.closed and pool._active > 0), "close()")
        return super().remove(record_id)


def test_closing_the_pool_during_a_replay_keeps_the_replays_outcome(start_worker, tmp_path):
    """close() called while a replayed task finishes waits for the record's removal: the
    record is not left behind (to run again later) with its task already done."""
    worker = start_worker(worker_id="w0")
    store_path = tmp_path / "dead.sqlite3"
    (rid,) = fill_sqlite(store_path, 1)
    store = CloseDuringRemove(store_path)
    pool = WorkerPool(hung_worker_pool_config(worker, DeadLetterConfig()), dead_letter_store=store)
    store.pool = pool
    try:
        report = pool.dead_letters.replay(rid)
    finally:
        if store.closer is not None:
            store.closer.join(30)
        pool.close()
    assert report.succeeded == (rid,)
    after = SQLiteDeadLetterStore(store_path)
    try:
        assert len(after) == 0
        (claims,) = after._conn.execute("SELECT COUNT(*) FROM dead_letter_claims").fetchone()
        assert claims == 0
    finally:
        after.close()


@pytest.fixture
def tiny_disk(tmp_path):
    """A 256 kB tmpfs (needs root and mount); skipped where it cannot be mounted."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)],
        capture_output=True,
    )
    if done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill_up(directory) -> str:
    filler = os.path.join(directory, "filler")
    with open(filler, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError:
            pass
    return filler


def test_a_full_disk_fails_tasks_loudly_and_the_store_recovers_once_there_is_room(
    tiny_disk, caplog
):
    """Disk full: TaskFailed says the record was not stored and the log has it whole;
    once space is freed the same pool stores records again."""
    store_path = tiny_disk / "dead.sqlite3"
    config = PoolConfig(
        workers=(worker_config("gone", "http://127.0.0.1:9"),),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=0),
        dead_letter=DeadLetterConfig(backend="sqlite", path=str(store_path)),
    )
    with WorkerPool(config) as pool:
        with pytest.raises(TaskFailed) as first:
            pool.execute(Task({"input_text": "fits"}, task_id="fits"))
        assert first.value.dead_letter_id is not None
        filler = fill_up(tiny_disk)
        big = {"input_text": "x" * 20_000}
        with caplog.at_level(logging.ERROR), pytest.raises(TaskFailed) as full:
            pool.execute(Task(big, task_id="no-room", timeout=2))
        assert full.value.dead_letter_id is None
        assert "disk is full" in str(full.value)
        assert any('"task_id": "no-room"' in r.getMessage() for r in caplog.records)
        assert pool.stats()["dead_letters"]["pending"] == 1
        os.unlink(filler)
        with pytest.raises(TaskFailed) as again:
            pool.execute(Task(big, task_id="room-again", timeout=2))
        assert again.value.dead_letter_id is not None
        assert [r.task_id for r in pool.dead_letters.list()] == ["fits", "room-again"]


FLUSHER = """
import sys
from npu_sync import WorkerPool
with WorkerPool.from_yaml(sys.argv[1], watch=False) as pool:
    print("ready", flush=True)
    sys.stdin.readline()
    pool.dead_letters.store.flush()
    print("flushed", flush=True)
"""


def test_two_processes_flushing_one_spool_write_each_record_once(
    start_worker, redis_server, tmp_path
):
    """200 records wait in a spool file; two processes flush it at once: Redis ends with
    each record exactly once, in order, and the spool empty."""
    worker = start_worker(worker_id="w0")
    spool = tmp_path / "spool.sqlite3"
    ids = fill_sqlite(spool, 200)
    path = tmp_path / "pool.yaml"
    path.write_text(
        "npu_workers:\n"
        f"  workers: [{{id: w0, url: '{worker.url}'}}]\n"
        "  health: {enabled: false}\n"
        f"  shared_state: {{backend: redis, url: '{redis_server.url}', namespace: flush,"
        " sync_interval: 3600}\n"
        f"  dead_letter: {{backend: redis, spool_path: '{spool}'}}\n"
    )
    client = redis.Redis.from_url(redis_server.url)
    writes: list[str] = []
    monitor = client.monitor().__enter__()  # every command Redis runs, from here on
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", FLUSHER, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for _ in range(2)
    ]
    try:
        for proc in procs:
            assert proc.stdout.readline().strip() == "ready"
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        for proc in procs:
            assert proc.stdout.readline().strip() == "flushed"
        for proc in procs:
            assert proc.wait(60) == 0
    finally:
        finish(procs)
    checker = redis.Redis.from_url(redis_server.url)
    checker.set("flush:end-marker", 1)
    for event in monitor.listen():
        command = event["command"]
        if command.startswith("HSET {flush}:dlq:records"):
            writes.append(command.split()[2])
        if "flush:end-marker" in command:
            break
    monitor.connection.disconnect()
    left = SQLiteDeadLetterStore(spool)
    assert len(left) == 0  # records the other process was moving are not waited for
    left.close()
    assert len(writes) == 200, f"{len(writes) - len(set(writes))} records written twice"
    assert [m.decode() for m in checker.zrange("{flush}:dlq:order", 0, -1)] == ids
    checker.close()
    client.close()


def test_a_redis_database_number_redis_refuses_is_a_config_error_at_start(
    start_worker, redis_server
):
    """redis://host:port/99 on a server of 16 databases: Redis answers, and refuses the
    database. That is the operator's to fix (ConfigError naming shared_state.url), not
    an outage that spools every dead letter for ever."""
    worker = start_worker(worker_id="w0")
    config = PoolConfig(
        workers=(worker_config("w0", worker.url),),
        health=HealthConfig(enabled=False),
        shared_state=SharedStateConfig(
            backend="redis", url=redis_server.url.rsplit("/", 1)[0] + "/99", timeout=0.5
        ),
        dead_letter=DeadLetterConfig(backend="redis"),
    )
    with pytest.raises(ConfigError) as info:
        WorkerPool(config)
    (error,) = info.value.errors
    assert error.startswith("shared_state.url: ")
    assert "DB index is out of range" in error


def test_stats_read_the_redis_spool_without_holding_the_pools_lock(
    start_worker, redis_server, monkeypatch
):
    """stats() counts the records held in the spool file (SQLite I/O) outside the lock
    every task's worker selection takes."""
    worker = start_worker(worker_id="w0")
    config = PoolConfig(
        workers=(worker_config("w0", worker.url),),
        health=HealthConfig(enabled=False),
        shared_state=SharedStateConfig(backend="redis", url=redis_server.url, timeout=0.5),
        dead_letter=DeadLetterConfig(backend="redis"),
    )
    with WorkerPool(config) as pool:
        store = pool.dead_letters.store
        spool = store._spool.own.store
        held_during_io: list[bool] = []
        original = type(spool).counts

        def counts(self):
            held_during_io.append(pool._state.lock.locked())
            return original(self)

        monkeypatch.setattr(spool, "counts", counts.__get__(spool))
        stats = pool.stats()
    assert stats["shared_state"]["dead_letters_held_locally"] == 0
    assert held_during_io, "the spool was not read"
    assert not any(held_during_io), "the spool file was read under the pool's lock"


LOCK_HOLDER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.readline()
"""


def test_a_frozen_redis_and_a_spool_locked_by_another_process_bound_task_and_stats(
    start_worker, redis_server, tmp_path, caplog
):
    """Redis frozen (SIGSTOP) and the spool's write lock held by another process (a
    backup, a stray sqlite3 shell: no npu_sync process opens another's spool): a
    task with timeout=0.5 still ends (TaskFailed, no dead-letter id, the record logged)
    long before the 30 s busy timeout, and stats() answers meanwhile."""
    worker = start_worker(worker_id="w0")
    config = PoolConfig(
        workers=(worker_config("w0", worker.url),),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=0),
        shared_state=SharedStateConfig(
            backend="redis", url=redis_server.url, namespace="frozen", sync_interval=3600
        ),
        dead_letter=DeadLetterConfig(backend="redis", spool_path=str(tmp_path / "spool.sqlite3")),
    )
    worker.kill()
    with WorkerPool(config) as pool:
        holder = subprocess.Popen(
            [sys.executable, "-c", LOCK_HOLDER, pool.dead_letters.store.spool_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            assert holder.stdout.readline().strip() == "locked"
            failure = pool.submit(Task({"input_text": "x"}, task_id="locked-out", timeout=0.5))
            with caplog.at_level(logging.ERROR):
                error = failure.exception(timeout=10)
            assert isinstance(error, TaskFailed)
            assert error.dead_letter_id is None
            assert any('"task_id": "locked-out"' in r.getMessage() for r in caplog.records)
            answers: list[dict] = []
            asker = threading.Thread(target=lambda: answers.append(pool.stats()), daemon=True)
            asker.start()
            asker.join(5)
            assert answers, "stats() did not answer while Redis and the spool were stuck"
            assert answers[0]["shared_state"]["available"] is False
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
            holder.stdin.write("\n")
            holder.stdin.close()
            holder.wait(10)
            holder.stdout.close()
