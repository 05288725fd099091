"""Attacks on priority classes, deadline-aware admission and the routing trace, against
real reference workers on loopback ports."""

from __future__ import annotations

from typing import Any

import pytest

from npu_sync import Task, WorkerPool
from npu_sync.config import (
    ClassConfig,
    HealthConfig,
    PoolConfig,
    PriorityConfig,
    RetryConfig,
    TimeoutConfig,
    worker_config,
)

pytestmark = pytest.mark.integration


def _payload(i: object) -> dict[str, Any]:
    return {"model_id": "default", "input_text": f"task {i}"}


@pytest.mark.parametrize(
    ("capacity", "reserves"),
    [
        (1, (0.2, 0.0)),  # one slot: a reserve of any size would be all of it
        (8, (0.5, 0.45)),  # reserves adding up to 0.95 of 8 slots: ceil(7.6) = 8
    ],
)
def test_a_reserve_never_keeps_the_lowest_class_off_an_idle_worker(
    start_worker, capacity: int, reserves: tuple[float, float]
) -> None:
    """Reserves the configuration accepts, no aging, nothing else running: a batch task
    is answered at once instead of waiting out its deadline beside an idle worker."""
    worker = start_worker(worker_id="w", latency_ms=10)
    interactive, standard = reserves
    config = PoolConfig(
        workers=(worker_config("w", worker.url, max_concurrent=capacity),),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=0),
        timeouts=TimeoutConfig(connect=2.0, read=10.0, task=30.0),
        priority=PriorityConfig(
            classes=(
                ClassConfig("interactive", interactive),
                ClassConfig("standard", standard),
                ClassConfig("batch"),
            ),
            aging=0.0,
        ),
    )
    with WorkerPool(config) as pool:
        answered = pool.execute(Task(_payload("batch"), priority="batch", timeout=5.0))
    assert answered["model_id"] == "default"
    assert worker.stats()["task_ids_seen"] == 1
