"""Helpers for the tests of the steps of a task's life (tests/test_life_*.py): a pool
whose transports fail the test if used (tests/stubs.py), a task's context, a lease
recorded as the steps below it would."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from npu_sync import WorkerPool
from npu_sync._life.context import TaskContext, Try
from npu_sync._life.ledger import record
from npu_sync._retry import Kind, Outcome
from npu_sync._state import PoolState
from npu_sync._stop import TaskStop
from npu_sync.config import HealthConfig, PoolConfig, worker_config
from npu_sync.task import Task
from npu_sync.testing import FakeNetwork
from tests.stubs import NoTransport

OK = Outcome(Kind.SUCCESS, {"answer": 1}, 200)


def config(*ids: str, **pool: Any) -> PoolConfig:
    return PoolConfig(
        workers=tuple(worker_config(i, f"http://127.0.0.1:{9400 + n}") for n, i in enumerate(ids)),
        health=HealthConfig(enabled=False),
        **pool,
    )


@contextmanager
def stub_pool() -> Iterator[WorkerPool]:
    with WorkerPool(config("a", "b"), transport_factory=lambda *a, **k: NoTransport()) as p:
        yield p


def begin(p: WorkerPool, task: Task | None = None, stop: TaskStop | None = None) -> TaskContext:
    task = task or Task({"input_text": "x"}, idempotent=True)
    stack = p._runner.stack()
    return stack.begin(task, task.body(), p._state.clock.monotonic() + 30, stop, None)


def leased(state: PoolState, ctx: TaskContext, outcome: Outcome) -> Try:
    """What the steps below the lease would give back: a real lease, recorded."""
    lease = state.dispatcher.try_acquire(ctx.excluded)
    assert lease is not None
    at = Try(lease)
    at.outcome = outcome
    at.deferred = False
    at.t0 = at.t1 = state.clock.monotonic()
    record(state, lease, outcome, 0.0, at.t1, retry=False)
    return at


def network_pool(net: FakeNetwork, **pool: Any) -> WorkerPool:
    return WorkerPool(config("a", **pool), transport_factory=net.factory)
