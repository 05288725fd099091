"""The one observer of outcomes alone (npu_sync._life.outcomes)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from npu_sync import WorkerPool
from npu_sync._life.outcomes import Outcomes
from npu_sync._retry import Kind, Outcome
from npu_sync.events import AttemptFinished, Event, TaskRejectedEvent
from tests.lifekit import OK, begin, config, stub_pool
from tests.stubs import NoTransport


@pytest.fixture
def pool() -> Iterator[WorkerPool]:
    with stub_pool() as p:
        yield p


def test_the_observer_builds_no_event_without_hooks_and_one_per_report_with_them() -> None:
    """attempt_ended and rejected reach the hooks once each; counters move once."""
    events: list[Event] = []
    with WorkerPool(
        config("a"), transport_factory=lambda *a, **k: NoTransport(), hooks=[events.append]
    ) as p:
        state = p._state
        outcomes = Outcomes(state)
        ctx = begin(p)
        worker = state.workers["a"]
        outcomes.attempt_ended(ctx, worker, OK, 1.0, 1.25)
        before = state.stats.rejected
        outcomes.rejected(ctx.task.task_id, "a", 422, "bad")
        assert state.stats.rejected == before + 1
    finished = [e for e in events if isinstance(e, AttemptFinished)]
    rejected = [e for e in events if isinstance(e, TaskRejectedEvent)]
    assert len(finished) == 1 and finished[0].duration == pytest.approx(0.25)
    assert len(rejected) == 1 and rejected[0].status == 422


def test_a_failed_attempt_starts_the_trace_of_a_task_that_asked_for_none(
    pool: WorkerPool,
) -> None:
    """traced_attempt begins a trace at the first failure: choice, then the attempt."""
    state = pool._state
    ctx = begin(pool)
    assert ctx.trace is None
    fail = Outcome(Kind.FAILURE, None, 503, "HTTP 503")
    Outcomes(state).traced_attempt(ctx, state.workers["a"], fail, 1.0, 2.0, False)
    assert ctx.trace is not None
    assert [s.kind for s in ctx.trace.steps] == ["choice", "attempt"]
