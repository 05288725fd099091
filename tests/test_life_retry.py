"""The retry step alone (npu_sync._life.retry), driven with a stub next step."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from npu_sync import TaskRejected, WorkerPool
from npu_sync._life.context import AGAIN, Exhausted, TaskContext, Try
from npu_sync._life.outcomes import Outcomes
from npu_sync._life.retry import Retry
from npu_sync._retry import Kind, Outcome
from tests.lifekit import OK, begin, leased, stub_pool


@pytest.fixture
def pool() -> Iterator[WorkerPool]:
    with stub_pool() as p:
        yield p


def test_retry_returns_the_first_success_and_asks_for_no_other_attempt(pool: WorkerPool) -> None:
    """One successful attempt ends the task: its answer is returned, next called once."""
    state = pool._state
    calls: list[TaskContext] = []

    def next(ctx: TaskContext) -> Try:
        calls.append(ctx)
        return leased(state, ctx, OK)

    retry = Retry(state, state.config, state.retry, Outcomes(state))
    ctx = begin(pool)
    assert retry(ctx, next) == {"answer": 1}
    assert calls == [ctx]


def test_retry_goes_to_another_worker_after_a_failure(pool: WorkerPool) -> None:
    """A failed attempt excludes its worker; the next attempt goes elsewhere."""
    state = pool._state
    seen: list[str] = []
    excluded: list[set[str]] = []
    answers = [Outcome(Kind.FAILURE, None, 503, "HTTP 503"), OK]

    def next(ctx: TaskContext) -> Try:
        excluded.append(set(ctx.excluded))
        at = leased(state, ctx, answers.pop(0))
        seen.append(at.lease.worker.id)
        return at

    retry = Retry(state, state.config, state.retry, Outcomes(state))
    ctx = begin(pool)
    assert retry(ctx, next) == {"answer": 1}
    assert len(seen) == 2 and seen[0] != seen[1]
    assert excluded == [set(), {seen[0]}]
    assert ctx.failures == 1 and [a.worker_id for a in ctx.attempts] == seen[:1]


def test_retry_asks_again_without_counting_a_lease_given_back(pool: WorkerPool) -> None:
    """AGAIN (a lease given back unused) is no failure: the step just asks again."""
    state = pool._state
    answers: list[object] = [AGAIN, AGAIN]

    def next(ctx: TaskContext) -> object:
        return answers.pop(0) if answers else leased(state, ctx, OK)

    retry = Retry(state, state.config, state.retry, Outcomes(state))
    ctx = begin(pool)
    assert retry(ctx, next) == {"answer": 1}
    assert ctx.failures == 0 and ctx.attempts == []


def test_retry_gives_up_with_the_reason_when_no_attempt_could_start(pool: WorkerPool) -> None:
    """None from below (no worker had) ends the task: Exhausted names the reason."""
    state = pool._state

    def next(ctx: TaskContext) -> None:
        ctx.reason = "no worker could take the task within pool.max_queue_wait (1s)"
        return None

    retry = Retry(state, state.config, state.retry, Outcomes(state))
    with pytest.raises(Exhausted, match="max_queue_wait"):
        retry(begin(pool), next)


def test_retry_never_retries_a_rejected_task(pool: WorkerPool) -> None:
    """A 4xx the protocol is sure of raises TaskRejected after one attempt, counted once."""
    state = pool._state
    calls = []

    def next(ctx: TaskContext) -> Try:
        calls.append(1)
        return leased(state, ctx, Outcome(Kind.REJECTED, {"detail": "bad"}, 422, "HTTP 422"))

    retry = Retry(state, state.config, state.retry, Outcomes(state))
    before = state.stats.rejected
    with pytest.raises(TaskRejected):
        retry(begin(pool), next)
    assert len(calls) == 1 and state.stats.rejected == before + 1


def test_retry_stops_when_the_retry_budget_is_spent(pool: WorkerPool) -> None:
    """Without a token from the pool-wide budget, no retry: the reason says so."""
    state = pool._state
    retry = Retry(state, state.config, state.retry, Outcomes(state))
    while retry.budget.try_withdraw():
        pass

    def next(ctx: TaskContext) -> Try:
        return leased(state, ctx, Outcome(Kind.FAILURE, None, 503, "HTTP 503"))

    with pytest.raises(Exhausted, match="retry budget exhausted"):
        retry(begin(pool), next)
