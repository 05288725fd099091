"""The request-building step alone (npu_sync._life.protocol), with a stub next step."""

from __future__ import annotations

from npu_sync._life.context import HEDGE, TaskContext, Try
from npu_sync._life.ledger import record
from npu_sync._life.protocol import Compose
from npu_sync._retry import Outcome
from npu_sync.testing import FakeNetwork
from tests.lifekit import OK, begin, network_pool


def test_compose_numbers_the_attempt_and_marks_a_hedge_as_the_second() -> None:
    """X-NPU-Attempt is 1 + failed attempts; a hedge is 2; the task id never changes."""
    net = FakeNetwork()
    with network_pool(net) as p:
        ctx = begin(p)
        lease = p._state.dispatcher.try_acquire(())
        assert lease is not None
        seen: list[dict[str, str]] = []

        def next(ctx: TaskContext, at: Try) -> Outcome:
            seen.append(dict(at.headers))
            return OK

        Compose()(ctx, Try(lease), next)
        ctx.attempts.append(object())  # type: ignore[arg-type]
        ctx.attempts.append(object())  # type: ignore[arg-type]
        Compose()(ctx, Try(lease), next)
        Compose()(ctx, Try(lease, HEDGE), next)
        record(p._state, lease, OK, 0.0, 0.0, retry=False)
    assert [h["X-NPU-Attempt"] for h in seen] == ["1", "3", "2"]
    assert {h["X-NPU-Task-Id"] for h in seen} == {ctx.task.task_id}


def test_compose_never_lets_an_observer_header_override_the_pool_own() -> None:
    """An observer's headers come first: the task id and attempt number win."""
    net = FakeNetwork()
    with network_pool(net) as p:
        ctx = begin(p)
        ctx.extra_headers = lambda wid, n: {"X-NPU-Task-Id": "forged", "traceparent": "00-x"}
        lease = p._state.dispatcher.try_acquire(())
        assert lease is not None
        seen: list[dict[str, str]] = []

        def next(ctx: TaskContext, at: Try) -> Outcome:
            seen.append(dict(at.headers))
            return OK

        Compose()(ctx, Try(lease), next)
        record(p._state, lease, OK, 0.0, 0.0, retry=False)
    assert seen[0]["X-NPU-Task-Id"] == ctx.task.task_id
    assert seen[0]["traceparent"] == "00-x"
