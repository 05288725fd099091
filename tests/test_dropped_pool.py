"""A pool dropped without close() warns like an unclosed file and lets its threads go."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest

from npu_sync import WorkerPool
from npu_sync.config import HealthConfig, PoolConfig, worker_config
from npu_sync.testing import FakeNetwork, json_response


def config(health: bool) -> PoolConfig:
    return PoolConfig(
        workers=(worker_config("a", "http://127.0.0.1:9201"),),
        health=HealthConfig(enabled=health, interval=3600),
    )


def dropped_pool(health: bool) -> tuple[weakref.ref[WorkerPool], list[threading.Thread]]:
    """Build a pool, run a task so its task threads exist, and drop it unclosed."""
    net = FakeNetwork()
    net.route(
        "a",
        lambda req: json_response(
            200, {"status": "healthy"} if req.path == "/health" else {"ok": True}
        ),
    )
    pool = WorkerPool(config(health), transport_factory=net.factory)
    assert pool.submit({"input_text": "x"}).result(timeout=10) == {"ok": True}
    threads = [t for t in threading.enumerate() if t.name.startswith("npu-sync")]
    return weakref.ref(pool), threads


def collect(ref: weakref.ref[WorkerPool]) -> None:
    """Collect until the pool is gone: a health round may hold it for a moment."""
    pause = threading.Event()
    give_up = time.monotonic() + 10
    gc.collect()
    while ref() is not None and time.monotonic() < give_up:
        pause.wait(0.01)
        gc.collect()


@pytest.mark.parametrize("health", [False, True], ids=["no-health", "health"])
def test_a_dropped_pool_warns_and_its_threads_end(health):
    """gc of an unclosed pool emits ResourceWarning and its npu-sync threads then end."""
    with pytest.warns(ResourceWarning, match="unclosed <WorkerPool"):
        ref, threads = dropped_pool(health)
        collect(ref)
    assert ref() is None
    assert threads, "the pool started no thread to check"
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive(), thread.name


def test_a_closed_pool_is_collected_without_a_warning(recwarn):
    """close() then dropping the pool is silent."""
    pool = WorkerPool(config(health=True))
    ref = weakref.ref(pool)
    pool.close()
    del pool
    gc.collect()
    assert ref() is None
    assert [w for w in recwarn if issubclass(w.category, ResourceWarning)] == []


def test_a_pool_used_as_a_context_manager_is_silent(recwarn):
    """Leaving a with block closes the pool, so collecting it later is silent."""
    with WorkerPool(config(health=False)) as pool:
        ref = weakref.ref(pool)
    del pool
    gc.collect()
    assert ref() is None
    assert [w for w in recwarn if issubclass(w.category, ResourceWarning)] == []
