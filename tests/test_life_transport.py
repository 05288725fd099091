"""The request step alone (npu_sync._life.transport), on a fake network."""

from __future__ import annotations

from typing import Any

import pytest

from npu_sync import WorkerPool
from npu_sync._life.context import FIRST, Try
from npu_sync._life.ledger import record
from npu_sync._life.transport import Send
from npu_sync._retry import Kind, Outcome
from npu_sync.errors import InvalidTask
from npu_sync.testing import FakeNetwork, FakeRequest, json_response
from npu_sync.transport import Cancel, Response
from tests.lifekit import OK, begin, config, network_pool


def _send(net: FakeNetwork, check: Any = None, cancel: object = None) -> tuple[Outcome, Try]:
    with network_pool(net) as p:
        state = p._state
        send = Send(state, state.config, state.retry, check)
        ctx = begin(p)
        lease = state.dispatcher.try_acquire(())
        assert lease is not None
        at = Try(lease, FIRST, cancel)
        at.t0 = state.clock.monotonic()
        at.remaining = 10.0
        at.body = ctx.body
        at.headers = ctx.headers
        try:
            return send(ctx, at), at
        finally:
            record(state, lease, OK, 0.0, 0.0, retry=False)


def test_send_classifies_the_answer_in_the_worker_protocol() -> None:
    """2xx JSON is a success carrying the body; a 503 is the worker's failure."""
    net = FakeNetwork(lambda req: json_response(200, {"response": "hi"}))
    outcome, _ = _send(net)
    assert outcome.kind is Kind.SUCCESS and outcome.value == {"response": "hi"}
    failing = FakeNetwork(lambda req: json_response(503, {"detail": "busy"}))
    assert _send(failing)[0].kind is Kind.FAILURE


def test_send_turns_a_refused_result_check_into_a_failure() -> None:
    """The pool's result_check raising makes the answer that worker's failure."""

    def check(value: object) -> None:
        raise ValueError("no 'response' key")

    net = FakeNetwork(lambda req: json_response(200, {"other": 1}))
    outcome, _ = _send(net, check)
    assert outcome.kind is Kind.FAILURE and "result check refused" in (outcome.error or "")


def test_send_hands_its_cancel_handle_to_a_cancellable_transport() -> None:
    """One request call: the attempt's cancel handle reaches the transport."""
    got: list[object] = []
    cancel = Cancel()

    class Spy:
        cancellable = True

        def request(self, method: str, path: str, **kw: Any) -> Response:
            got.append(kw.get("cancel"))
            return json_response(200, {})

        def close(self) -> None:
            pass

    with WorkerPool(config("a"), transport_factory=lambda *a, **k: Spy()) as p:
        state = p._state
        send = Send(state, state.config, state.retry, None)
        ctx = begin(p)
        lease = state.dispatcher.try_acquire(())
        assert lease is not None
        at = Try(lease, FIRST, cancel)
        at.t0 = state.clock.monotonic()
        at.remaining = 10.0
        at.body = ctx.body
        at.headers = ctx.headers
        send(ctx, at)
        record(state, lease, OK, 0.0, 0.0, retry=False)
    assert got == [cancel]


def test_send_raises_invalid_task_for_a_header_nothing_could_send() -> None:
    """An error before any byte was sent is the task's: InvalidTask, nobody charged."""

    def handler(req: FakeRequest) -> Response:
        raise InvalidTask("bad header value")

    with pytest.raises(InvalidTask):
        _send(FakeNetwork(handler))


# -- Outcomes ------------------------------------------------------------------------
