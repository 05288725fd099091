"""Descriptors and threads stay bounded by configuration, whatever the workers do:
idle connections a worker closed or that expired are reaped, the idle cap holds over a
fleet that fails over, health checks run on a bounded set of threads, close() does
not wait on hung checks, and a too-low RLIMIT_NOFILE is named at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from npu_sync import WorkerPool
from npu_sync._fdlimit import need
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    PoolSettings,
    RetryConfig,
    TransportConfig,
    worker_config,
)
from npu_sync.errors import TaskFailed

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd"
)

IDLE_WORKER = Path(__file__).resolve().parent.parent / "idle_worker.py"


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0) -> bool:
    """Poll ``predicate`` until it holds (generous deadline): no fixed sleep."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


class Process:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(IDLE_WORKER), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.ports: list[int] = json.loads(self.proc.stdout.readline())["ports"]

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.kill()
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def idle_worker() -> Iterator[Callable[..., Process]]:
    started: list[Process] = []

    def start(*args: str) -> Process:
        process = Process(*args)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


def test_connections_a_worker_closed_while_idle_are_reaped(idle_worker):
    """A worker that closes idle connections after 0.3 s: after a sweep, the pool holds
    none of them (the descriptors come back to where they were)."""
    worker = idle_worker("--ports", "1", "--idle-close", "0.3")
    config = PoolConfig(
        workers=(worker_config("w", f"http://127.0.0.1:{worker.ports[0]}", max_concurrent=16),),
        health=HealthConfig(enabled=False),
        transport=TransportConfig(idle_timeout=3600),  # age cannot be what closes them
    )
    before = fds()
    with WorkerPool(config) as pool:
        base = fds()
        gate = threading.Barrier(16)

        def task() -> None:
            gate.wait(10)  # 16 at once: 16 connections
            pool.execute({"input_text": "x"})

        threads = [threading.Thread(target=task) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        transport = pool._state.workers["w"].transport
        opened = transport.idle_connections
        assert opened >= 8 and fds() >= base + opened
        # The worker closes its ends; each sweep closes what it finds closed.
        assert wait_for(lambda: (pool._reaper.sweep(), transport.idle_connections)[1] == 0)
        assert fds() <= base
        assert pool.stats()["connections"]["idle"] == 0
        assert pool.stats()["connections"]["reaped"] >= opened
    assert fds() <= before


def test_idle_connections_past_idle_timeout_are_reaped_without_a_request(idle_worker):
    """With a worker that keeps them open, a sweep past idle_timeout closes them all."""
    worker = idle_worker("--ports", "1", "--idle-close", "3600")
    config = PoolConfig(
        workers=(worker_config("w", f"http://127.0.0.1:{worker.ports[0]}", max_concurrent=8),),
        health=HealthConfig(enabled=False),
        transport=TransportConfig(idle_timeout=30),
    )
    with WorkerPool(config) as pool:
        base = fds()
        futures = [pool.submit({"input_text": str(i)}) for i in range(32)]
        for future in futures:
            future.result(30)
        transport = pool._state.workers["w"].transport
        held = transport.idle_connections
        assert held >= 1
        assert pool._reaper.sweep() == 0, "nothing expired yet, nothing closed by the worker"
        assert transport.idle_connections == held
        assert pool._reaper.sweep(now=time.monotonic() + 31) == held
        assert transport.idle_connections == 0 and fds() <= base


@pytest.mark.parametrize("client", ["builtin", "urllib3"])
def test_a_fleet_failing_over_keeps_its_idle_connections_under_the_cap(idle_worker, client):
    """44 workers each serve 40 tasks then fail, so 16 callers move from worker to
    worker: the pool's descriptors never exceed the idle cap plus those in flight."""
    worker = idle_worker("--ports", "44", "--idle-close", "3600", "--good", "40")
    workers = tuple(
        worker_config(f"w{i}", f"http://127.0.0.1:{port}", priority=i + 1, max_concurrent=16)
        for i, port in enumerate(worker.ports)
    )
    cap = 24
    config = PoolConfig(
        workers=workers,
        health=HealthConfig(enabled=False),
        transport=TransportConfig(client=client, idle_timeout=3600, max_idle_connections=cap),
        circuit_breaker=BreakerConfig(fail_max=1, reset_timeout=3600),
        retry=RetryConfig(max_retries=3, backoff_initial=0.001, backoff_max=0.002),
        pool=PoolSettings(threads=16),
    )
    peak = {"fds": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak["fds"] = max(peak["fds"], fds())

    with WorkerPool(config) as pool:
        base = fds()
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            futures = [pool.submit({"input_text": str(i)}) for i in range(44 * 40)]
            ok = 0
            for future in futures:
                try:
                    future.result(60)
                    ok += 1
                except TaskFailed:
                    pass
        finally:
            done.set()
            sampler.join(10)
        used = {w["id"] for w in pool.workers() if w["tasks"]["succeeded"]}
        assert len(used) >= 20, "the fleet failed over across many workers"
        assert ok >= 20 * 40
        # 16 connections in flight at most (one per pool thread), plus the cap.
        assert peak["fds"] - base <= cap + 16, (peak, base)
        assert pool.stats()["connections"]["idle"] <= cap
        assert pool.stats()["connections"]["closed_over_budget"] > 0


def test_a_health_round_over_thousands_of_workers_runs_on_the_configured_threads(idle_worker):
    """2,000 workers on 20 ports: one round checks them all, never on more than
    health.concurrency threads, and leaves no health socket open."""
    worker = idle_worker("--ports", "20", "--idle-close", "3600")
    workers = tuple(
        worker_config(f"w{i}", f"http://127.0.0.1:{worker.ports[i % 20]}") for i in range(2000)
    )
    config = PoolConfig(
        workers=workers,
        health=HealthConfig(enabled=False, concurrency=6, timeout=10),
        transport=TransportConfig(max_idle_connections=16),
    )
    most = {"threads": 0}
    stop = threading.Event()

    def count() -> None:
        while not stop.wait(0.001):
            alive = [t for t in threading.enumerate() if t.name.startswith("npu-sync-health")]
            most["threads"] = max(most["threads"], len(alive))

    with WorkerPool(config) as pool:
        base = fds()
        counter = threading.Thread(target=count)
        counter.start()
        try:
            results = pool.check_health()
        finally:
            stop.set()
            counter.join(10)
        assert len(results) == 2000 and all(r["ok"] for r in results.values())
        assert 1 <= most["threads"] <= 6
        assert pool.stats()["health"]["threads"] <= 6
        # Each probe's connection is closed after it (the next one is 30 s away).
        assert fds() <= base + 6


def test_close_with_checks_hanging_on_a_worker_that_never_answers_ends_promptly(idle_worker):
    """200 workers that accept and never answer, health.timeout 60 s: close() shuts
    the running checks' sockets and returns long before any timeout."""
    worker = idle_worker("--ports", "4", "--hang")
    workers = tuple(
        worker_config(f"w{i}", f"http://127.0.0.1:{worker.ports[i % 4]}") for i in range(200)
    )
    config = PoolConfig(
        workers=workers, health=HealthConfig(interval=30, timeout=60, concurrency=16)
    )
    pool = WorkerPool(config)
    closer = threading.Thread(target=pool.close)
    try:
        # 16 checks hang on their sockets, the other 184 wait for a thread.
        assert wait_for(
            lambda: (
                (pool.stats()["health"]["threads"], pool.stats()["health"]["in_flight"])
                == (16, 200)
            )
        )
    finally:
        closer.start()
        closer.join(10)  # a sixth of one check's timeout
    assert not closer.is_alive(), "close() waited for hung checks"
    assert not [t for t in threading.enumerate() if t.name.startswith("npu-sync-health")]


LOWERED = textwrap.dedent(
    """
    import resource, sys
    from npu_sync import WorkerPool
    from npu_sync.config import HealthConfig, PoolConfig, worker_config
    from npu_sync.errors import ConfigError
    soft = int(sys.argv[1])
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    workers = tuple(
        worker_config(f"w{i}", f"http://127.0.0.1:{9000 + i % 50}") for i in range(10000)
    )
    config = PoolConfig(workers=workers, health=HealthConfig(interval=3600))
    try:
        pool = WorkerPool(config)
    except ConfigError as exc:
        print("refused:", exc)
        sys.exit(3)
    pool.close()
    print("started")
    """
)


def run_with_limit(soft: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", LOWERED, str(soft)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NPU_SYNC_FLEET": "off"},
    )


def test_a_too_low_open_file_limit_is_named_at_start():
    """Under a soft RLIMIT_NOFILE of 128 the pool refuses to start, naming the limit and
    the figure to raise it to; under the default 1,024 the same 10,000 workers start."""
    workers = tuple(worker_config(f"w{i}", "http://127.0.0.1:9000") for i in range(10000))
    wanted = need(PoolConfig(workers=workers)).total
    low = run_with_limit(128)
    assert low.returncode == 3, low.stderr
    assert "RLIMIT_NOFILE" in low.stdout and "is 128" in low.stdout
    assert f"raise it to at least {wanted}" in low.stdout
    ok = run_with_limit(1024)
    assert ok.returncode == 0 and "started" in ok.stdout, ok.stdout + ok.stderr
