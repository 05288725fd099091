"""The model steps alone (npu_sync._life.models), with a stub next step."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from npu_sync import WorkerPool
from npu_sync._life.context import AGAIN, TaskContext, Try
from npu_sync._life.ledger import record
from npu_sync._life.models import ModelCount, ModelHeld
from npu_sync._retry import Outcome
from npu_sync.task import Task
from tests.lifekit import OK, begin, stub_pool


@pytest.fixture
def pool() -> Iterator[WorkerPool]:
    with stub_pool() as p:
        yield p


def test_model_held_gives_back_a_worker_learnt_to_lack_the_model(pool: WorkerPool) -> None:
    """The lease's worker lacks the model now: AGAIN, never tried, slot back."""
    state = pool._state
    ctx = begin(pool, Task({"model_id": "m", "input_text": "x"}))
    lease = state.dispatcher.try_acquire(())
    assert lease is not None
    state.model_not_loaded(lease.worker, "m")

    def next(ctx: TaskContext, at: Try) -> Outcome:
        raise AssertionError("not reached")

    assert ModelHeld(state)(ctx, Try(lease), next) is AGAIN
    assert lease.worker.in_flight == 0 and lease.worker.id in ctx.excluded
    assert ctx.missing_model == "m"


def test_model_count_ends_what_it_started_even_when_the_attempt_raises(
    pool: WorkerPool,
) -> None:
    """Tasks in flight per model go back down whatever happens below."""
    state = pool._state
    counted: list[tuple[str, str, str]] = []

    class Placer:
        def started(self, wid: str, model: str, now: float) -> None:
            counted.append(("started", wid, model))

        def ended(self, wid: str, model: str, now: float) -> None:
            counted.append(("ended", wid, model))

    state.placer = Placer()  # type: ignore[assignment]
    try:
        step = ModelCount(state)
        ctx = begin(pool, Task({"model_id": "m", "input_text": "x"}))
        lease = state.dispatcher.try_acquire(())
        assert lease is not None

        def next(ctx: TaskContext, at: Try) -> Outcome:
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError):
            step(ctx, Try(lease), next)
        record(state, lease, OK, 0.0, 0.0, retry=False)
    finally:
        state.placer = None
    wid = lease.worker.id
    assert counted == [("started", wid, "m"), ("ended", wid, "m")]
