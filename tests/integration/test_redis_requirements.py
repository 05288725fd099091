"""What npu_sync asks of the Redis it keeps dead letters in, on real redis-servers: a
policy that may evict them is refused (or warned about and counted, for breakers
only), and two apps on one host never mix their dead letters."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from npu_sync import ConfigError, WorkerPool
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


def redis_with(tmp_path, name: str, *options: str) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    directory = tmp_path / name
    directory.mkdir()
    server = RedisServer(str(directory), *options).start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def lru_redis(tmp_path) -> Iterator[RedisServer]:
    """A Redis used as a cache: it may evict any key."""
    yield from redis_with(
        tmp_path, "lru", "--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru"
    )


def refused_url() -> str:
    """A loopback URL nothing listens on: every attempt fails at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def config_for(url: str, dead_letter: str = "redis", namespace: str = "npu_sync") -> PoolConfig:
    return PoolConfig(
        workers=(worker_config("w0", refused_url()),),
        health=HealthConfig(enabled=False),
        shared_state=SharedStateConfig(backend="redis", url=url, namespace=namespace),
        dead_letter=DeadLetterConfig(backend=dead_letter),
    )


def test_dead_letters_in_a_redis_that_may_evict_them_are_refused_at_start(lru_redis):
    """allkeys-lru: building the pool fails, naming the policy and the fix."""
    with pytest.raises(ConfigError, match=r"maxmemory-policy allkeys-lru.*noeviction"):
        WorkerPool(config_for(lru_redis.url))


def test_the_policy_is_read_from_info_when_config_is_disabled(tmp_path):
    """CONFIG renamed away (as managed Redis services do): INFO tells the policy."""
    for server in redis_with(
        tmp_path, "noconfig", "--maxmemory-policy", "allkeys-lru", "--rename-command", "CONFIG", ""
    ):
        with pytest.raises(ConfigError, match="maxmemory-policy allkeys-lru"):
            WorkerPool(config_for(server.url))


def test_breakers_alone_in_an_evicting_redis_are_warned_about_and_counted(lru_redis, caplog):
    """Shared breakers with dead letters kept elsewhere: the pool starts, says loudly
    what may vanish, and stats() shows the policy and the count."""
    with (
        caplog.at_level(logging.WARNING, logger="npu_sync._shared"),
        WorkerPool(config_for(lru_redis.url, dead_letter="memory")) as pool,
    ):
        shared = pool.stats()["shared_state"]
    assert shared["eviction_policy"] == "allkeys-lru"
    assert shared["eviction_warnings"] == 1
    assert any("maxmemory-policy allkeys-lru" in r.getMessage() for r in caplog.records)


FAILER = """
import json, sys
from npu_sync import TaskFailed, WorkerPool
pool = WorkerPool.from_yaml(sys.argv[1], watch=False)
try:
    pool.execute({"input_text": "secret payload of app A"})
except TaskFailed as exc:
    print(json.dumps(exc.dead_letter_id), flush=True)
sys.stdin.readline()  # SIGKILLed here: the record stays in this process's spool
"""


def test_two_apps_on_one_host_never_mix_their_dead_letters(tmp_path):
    """App A spools a record while its Redis is down and is killed; app B (another
    Redis, the same namespace, the same user and temp dir) never moves it into its
    Redis; app A's `npu-sync dlq list` finds it once A's Redis is back."""
    servers = [iter(redis_with(tmp_path, name)) for name in ("redis_a", "redis_b")]
    redis_a, redis_b = (next(s) for s in servers)
    try:
        yaml_a = tmp_path / "a.yaml"
        yaml_a.write_text(
            "npu_workers:\n"
            f"  workers: [{{id: w0, url: '{refused_url()}'}}]\n"
            "  health: {enabled: false}\n"
            f"  shared_state: {{backend: redis, url: '{redis_a.url}'}}\n"
            "  dead_letter: {backend: redis}\n"
        )
        env = {
            **os.environ,
            "TMPDIR": str(tmp_path),
            "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path]),
        }
        redis_a.kill()
        app_a = subprocess.Popen(
            [sys.executable, "-c", FAILER, str(yaml_a)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            record_id = json.loads(app_a.stdout.readline())
        finally:
            app_a.kill()
            app_a.wait(30)
            app_a.stdin.close()
            app_a.stdout.close()
        assert record_id

        with WorkerPool(config_for(redis_b.url)) as app_b:
            assert app_b.dead_letters.list() == []
        client_b = redis.Redis.from_url(redis_b.url)
        assert client_b.keys("*dlq*") == []
        client_b.close()

        redis_a.start()
        listing = subprocess.run(
            [sys.executable, "-m", "npu_sync", "dlq", "--config", str(yaml_a), "list", "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=True,
        )
        assert [r["id"] for r in json.loads(listing.stdout)] == [record_id]
    finally:
        for server in servers:
            server.close()
