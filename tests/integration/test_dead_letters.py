"""Dead letters on real files and real processes: exactly-once replay, bounded waits."""

from __future__ import annotations

import json
import logging
import shutil
import sqlite3
import subprocess
import sys
import threading

import pytest

from npu_sync import Task, TaskFailed, WorkerPool
from npu_sync._deadletter import DeadLetter, SQLiteDeadLetterStore
from npu_sync.config import (
    DeadLetterConfig,
    HealthConfig,
    PoolConfig,
    RetryConfig,
    worker_config,
)
from npu_sync.task import Attempt

pytestmark = pytest.mark.integration

REPLAYER = """
import json, sys
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
