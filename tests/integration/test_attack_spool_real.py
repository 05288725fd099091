"""Attacks on the per-process dead-letter spool and the Redis eviction check, with real
redis-servers, real SQLite files and real child processes."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from npu_sync import NpuSyncError, Task, TaskFailed, WorkerPool
from npu_sync._deadletter import DeadLetter, SQLiteDeadLetterStore
from npu_sync._spool import default_base
from npu_sync.config import (
    DeadLetterConfig,
    HealthConfig,
    PoolConfig,
    SharedStateConfig,
    worker_config,
)

from .conftest import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("private_temp_dir")]

redis = pytest.importorskip("redis")


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
