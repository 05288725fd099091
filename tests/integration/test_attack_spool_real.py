"""Attacks on the per-process dead-letter spool and the Redis eviction check, with real
redis-servers, real SQLite files and real child processes."""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest

from npu_sync import NpuSyncError, Task, TaskFailed, WorkerPool
from npu_sync.config import (
    DeadLetterConfig,
    HealthConfig,
    PoolConfig,
    SharedStateConfig,
    worker_config,
)

from .conftest import RedisServer

pytestmark = pytest.mark.integration

redis = pytest.importorskip("redis")


@pytest.fixture(autouse=True)
def private_temp_dir(tmp_path, monkeypatch):
    """Default dead-letter spools, here and in child processes, go under tmp_path."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


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
            assert client.hget("npu_sync:dlq:records", record_id) is None
        finally:
            client.close()
        with pytest.raises(NpuSyncError, match="maxmemory-policy allkeys-lru"):
            pool.dead_letters.list()
