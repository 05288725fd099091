"""The admission steps alone (npu_sync._life.admission): Fit, Admit, Record."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from npu_sync import TaskRejected, WorkerPool
from npu_sync._life.admission import Admit, Fit, Record
from npu_sync._life.context import TaskContext, Try
from npu_sync._life.ledger import record
from npu_sync._life.outcomes import Outcomes
from npu_sync._retry import Kind, Outcome
from npu_sync._stop import Stopped, TaskStop
from npu_sync.task import Task
from tests.lifekit import OK, begin, stub_pool


@pytest.fixture
def pool() -> Iterator[WorkerPool]:
    with stub_pool() as p:
        yield p


def test_fit_rejects_a_task_no_worker_meets_before_anything_else(pool: WorkerPool) -> None:
    """requires nobody meets: TaskRejected, and the next step is never called."""
    state = pool._state
    fit = Fit(state, state.config, Outcomes(state))

    def next(ctx: TaskContext) -> None:
        raise AssertionError("not reached")

    with pytest.raises(TaskRejected, match="requires"):
        fit(begin(pool, Task({"x": 1}, requires={"vision"})), next)


def test_admit_hands_down_a_lease_on_a_worker_not_excluded(pool: WorkerPool) -> None:
    """The attempt below holds a slot on a worker outside the task's exclusions."""
    state = pool._state
    admit = Admit(state, state.config, Outcomes(state))
    ctx = begin(pool)
    ctx.excluded.add("a")
    held: list[tuple[str, int]] = []

    def next(ctx: TaskContext, at: Try) -> Try:
        held.append((at.lease.worker.id, at.lease.worker.in_flight))
        record(state, at.lease, OK, 0.0, state.clock.monotonic(), retry=False)
        return at

    admit(ctx, next)
    assert held == [("b", 1)]
    assert state.workers["b"].in_flight == 0


def test_admit_returns_none_with_the_reason_when_no_worker_can_be_had(pool: WorkerPool) -> None:
    """Every worker excluded: no wait, no next step, a reason naming the fleet's state."""
    state = pool._state
    admit = Admit(state, state.config, Outcomes(state))
    ctx = begin(pool)
    ctx.excluded |= {"a", "b"}

    def next(ctx: TaskContext, at: Try) -> None:
        raise AssertionError("not reached")

    assert admit(ctx, next) is None
    assert ctx.reason


def _record_step(p: WorkerPool) -> tuple[Record, TaskContext, Try]:
    state = p._state
    ctx = begin(p)
    lease = state.dispatcher.try_acquire(())
    assert lease is not None
    return Record(state, state.config, Outcomes(state)), ctx, Try(lease)


def test_record_gives_the_lease_back_when_the_step_below_raises(pool: WorkerPool) -> None:
    """An error below the lease (a bug, an interrupt) never leaks the worker's slot."""
    step, ctx, at = _record_step(pool)

    def next(ctx: TaskContext, at: Try) -> Outcome:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        step(ctx, at, next)
    assert all(w.in_flight == 0 for w in pool._state.workers.values())


def test_record_starts_no_attempt_past_the_deadline(pool: WorkerPool) -> None:
    """Less than a millisecond left: lease back unused, reason 'deadline passed'."""
    step, ctx, at = _record_step(pool)
    ctx.deadline = pool._state.clock.monotonic()

    def next(ctx: TaskContext, at: Try) -> Outcome:
        raise AssertionError("not reached")

    assert step(ctx, at, next) is None
    assert ctx.reason == "deadline passed"
    assert at.lease.worker.in_flight == 0


def test_record_raises_stopped_for_a_task_stopped_before_its_attempt(pool: WorkerPool) -> None:
    """A task stopped while its lease was handed over sends nothing, charges nobody."""
    stop = TaskStop()
    step, _, at = _record_step(pool)
    ctx = begin(pool, stop=stop)
    stop.stop("caller left")

    def next(ctx: TaskContext, at: Try) -> Outcome:
        raise AssertionError("not reached")

    with pytest.raises(Stopped):
        step(ctx, at, next)
    assert at.lease.worker.in_flight == 0 and at.lease.worker.stats.failed == 0


def test_record_records_a_hedge_that_lost_as_abandoned(pool: WorkerPool) -> None:
    """A success that came after the other attempt won is credited to nobody."""
    step, ctx, at = _record_step(pool)
    at.settle = lambda side, success: True  # the other side won

    def next(ctx: TaskContext, at: Try) -> Outcome:
        return Outcome(Kind.SUCCESS, {}, 200)

    done = step(ctx, at, next)
    assert done is at and at.outcome is not None and at.outcome.kind is Kind.ABANDONED
    assert at.lease.worker.stats.succeeded == 0 and at.lease.worker.stats.abandoned == 1


def test_record_corrects_the_worker_models_before_the_slot_is_handed_on(
    pool: WorkerPool,
) -> None:
    """A 'not loaded' answer marks the worker as lacking the task's model."""
    state = pool._state
    step = Record(state, state.config, Outcomes(state))
    ctx = begin(pool, Task({"model_id": "m", "input_text": "x"}))
    lease = state.dispatcher.try_acquire(())
    assert lease is not None

    def next(ctx: TaskContext, at: Try) -> Outcome:
        assert at.lease.worker.in_flight == 1
        return Outcome(Kind.NOT_HERE, None, 500, "Model m not loaded", model="m")

    step(ctx, Try(lease), next)
    assert lease.worker.id in state.lacking("m")
