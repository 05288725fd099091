"""Who is charged for a failed attempt: the task, the worker or the operator (blame.py)."""

from __future__ import annotations

import pytest

from npu_sync import TaskFailed, TaskRejected, WorkerPool
from npu_sync._blame import Blame, Verdict, misrouted
from npu_sync._retry import Kind, Outcome, classify_response
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    RetryConfig,
    worker_config,
)
from npu_sync.testing import FakeClock, FakeNetwork, json_response


class _W:
    """The little of a worker that Blame reads."""

    def __init__(self, wid: str) -> None:
        self.id = wid


A, B = _W("a"), _W("b")


def refusal(status: int = 413) -> Outcome:
    return classify_response(json_response(status, {"detail": "too big"}))


def failed_task() -> Outcome:
    return Outcome(Kind.FAILURE, None, 200, "HTTP 200, status failed: boom", suspect=True)


def server_error() -> Outcome:
    return classify_response(json_response(500, {"detail": "boom"}))


# -- the rules on their own --------------------------------------------------------------


def test_a_refusal_is_held_and_a_second_workers_refusal_makes_it_the_tasks() -> None:
    """Two workers refusing one task: the task's (TASK verdict naming both), nobody held."""
    blame = Blame()
    assert blame.hold("a", refusal(), lambda: True)
    assert blame.judge(A, refusal(), 0.01, True) is Verdict.HOLD  # type: ignore[arg-type]
    assert blame.judge(B, refusal(400), 0.01, True) is Verdict.TASK  # type: ignore[arg-type]
    assert blame.same == ("a", "b") and len(blame.held) == 1 and blame.refused_only()


def test_a_held_refusal_is_proven_the_workers_once_the_task_succeeds() -> None:
    """proven() hands back each held answer once, marked as a refusal."""
    blame = Blame()
    blame.judge(A, refusal(), 0.02, True)  # type: ignore[arg-type]
    (held,) = blame.proven()
    assert held.worker is A and held.refusal and held.duration == 0.02
    assert blame.proven() == [] and not blame.refused_only()


def test_a_failed_task_is_held_while_another_worker_can_be_asked() -> None:
    """A protocol's failed task is held if another worker is left, else charged at once."""
    assert Blame().hold("a", failed_task(), lambda: True)
    alone = Blame()
    assert not alone.hold("a", failed_task(), lambda: False)
    assert alone.hold("a", failed_task(), lambda: False)  # one charge at once per task


def test_a_failed_task_from_two_workers_is_the_tasks() -> None:
    """The same failed task from two workers ends it; from the same worker twice, not."""
    blame = Blame()
    assert blame.judge(A, failed_task(), 0.01, True) is Verdict.HOLD  # type: ignore[arg-type]
    assert blame.judge(A, failed_task(), 0.01, True) is Verdict.HOLD  # type: ignore[arg-type]
    assert blame.judge(B, failed_task(), 0.01, True) is Verdict.TASK  # type: ignore[arg-type]


def test_a_500_keeps_its_rule_first_charged_then_held_and_never_stops_the_task() -> None:
    """HTTP 500: the first charged at once, the next held; two workers do not end it."""
    blame = Blame()
    asked: list[bool] = []
    assert not blame.hold("a", server_error(), lambda: asked.append(True) or True)
    assert asked == []  # a 500 is charged without asking who is left
    assert blame.hold("b", server_error(), lambda: True)
    assert blame.judge(A, server_error(), 0.01, False) is Verdict.HOLD  # type: ignore[arg-type]
    assert blame.judge(B, server_error(), 0.01, True) is Verdict.HOLD  # type: ignore[arg-type]
    assert [h.worker for h in blame.held] == [B]


def test_different_families_do_not_agree() -> None:
    """A refusal and a failed task from two workers say different things: no verdict."""
    blame = Blame()
    blame.judge(A, refusal(), 0.01, True)  # type: ignore[arg-type]
    assert blame.judge(B, failed_task(), 0.01, True) is Verdict.HOLD  # type: ignore[arg-type]


@pytest.mark.parametrize("status", [404, 405])
def test_a_404_or_405_to_the_inference_path_is_the_operators(status: int) -> None:
    """misrouted() turns it into MISCONFIGURED naming the request and what to check."""
    outcome = misrouted(refusal(status), "POST", "/npu/inference")
    assert outcome.kind is Kind.MISCONFIGURED and outcome.processed is False
    assert outcome.error is not None
    assert outcome.error.startswith(
        f"not an NPU worker at this URL: POST /npu/inference → {status}"
    )


@pytest.mark.parametrize("status", [400, 413, 422, 500])
def test_other_answers_are_not_misrouted(status: int) -> None:
    """Only 404 and 405 say the URL is wrong; anything else is left as it is."""
    outcome = classify_response(json_response(status, {"detail": "x"}))
    assert misrouted(outcome, "POST", "/inference") is outcome


# -- through a pool --------------------------------------------------------------------


def make_pool(net: FakeNetwork, *ids: str, fail_max: int = 3, **kw: object) -> WorkerPool:
    kw.setdefault("health", HealthConfig(enabled=False))
    config = PoolConfig(
        workers=tuple(worker_config(w, f"http://127.0.0.1:{9400 + n}") for n, w in enumerate(ids)),
        circuit_breaker=BreakerConfig(fail_max=fail_max, reset_timeout=60),
        retry=RetryConfig(max_retries=3, backoff_initial=0.01, backoff_max=0.05),
        **kw,  # type: ignore[arg-type]
    )
    return WorkerPool(config, transport_factory=net.factory, clock=FakeClock())


def ok(req):  # type: ignore[no-untyped-def]
    return json_response(200, {"by": req.worker_id})


def answer(status: int, body: object):  # type: ignore[no-untyped-def]
    return lambda req: json_response(status, body)


def rows(pool: WorkerPool) -> dict[str, dict]:  # type: ignore[type-arg]
    return {w["id"]: dict(w) for w in pool.workers()}


def test_a_misrouted_worker_is_taken_out_and_its_task_served_elsewhere() -> None:
    """404 to POST /inference: the task succeeds on b; a is out, breaker closed, named."""
    net = FakeNetwork()
    net.route("a", answer(404, {"detail": "Not Found"}))
    net.route("b", ok)
    with make_pool(net, "a", "b") as pool:
        results = [pool.execute({"n": n}) for n in range(20)]
        row = rows(pool)["a"]
    assert results == [{"by": "b"}] * 20
    assert len(net.requests("a")) == 1  # out after its first answer
    assert row["healthy"] is False and row["breaker"]["state"] == "closed"
    assert row["last_error"].startswith("not an NPU worker at this URL: POST /inference → 404")


def test_a_404_to_an_endpoint_the_task_names_is_a_refusal_not_a_misroute() -> None:
    """A task naming a path no worker has: TaskRejected after two workers, nobody out."""
    from npu_sync import Task

    net = FakeNetwork()
    for wid in "ab":
        net.route(wid, answer(404, {"detail": "Not Found"}))
    with make_pool(net, "a", "b") as pool:
        with pytest.raises(TaskRejected, match="404"):
            pool.execute(Task({"n": 1}, endpoint="/nowhere"))
        assert all(r["healthy"] and r["breaker"]["failures"] == 0 for r in rows(pool).values())
    assert len(net.requests()) == 2


@pytest.mark.parametrize("status", [413, 404, 400])
def test_a_worker_refusing_what_others_run_is_charged_and_opened(status: int) -> None:
    """A worker refusing tasks b runs: every task succeeds; its breaker opens at fail_max."""
    net = FakeNetwork()
    net.route("a", answer(status, {"detail": "refused"}))
    net.route("b", ok)
    with make_pool(net, "a", "b", fail_max=3) as pool:
        from npu_sync import Task

        # A named endpoint, so that a 404 is a refusal and not a misroute.
        results = [pool.execute(Task({"n": n}, endpoint="/run")) for n in range(30)]
        row = rows(pool)["a"]
    assert results == [{"by": "b"}] * 30
    assert row["breaker"]["state"] == "open" and len(net.requests("a")) == 3
    assert row["last_error"].startswith("refused a task another worker ran")


def test_a_refusal_charged_raises_the_workers_latency_estimate() -> None:
    """A fast refusal never makes a worker look fast: its estimate rises to what it cost."""
    clock = FakeClock()
    net = FakeNetwork()

    def slow_ok(req):  # type: ignore[no-untyped-def]
        clock.advance(0.2)
        return json_response(200, {"by": req.worker_id})

    net.route("a", answer(413, {"detail": "refused"}))
    net.route("b", slow_ok)
    config = PoolConfig(
        workers=(
            worker_config("a", "http://127.0.0.1:9400"),
            worker_config("b", "http://127.0.0.1:9401"),
        ),
        health=HealthConfig(enabled=False),
        circuit_breaker=BreakerConfig(fail_max=5, reset_timeout=60),
    )
    with WorkerPool(config, transport_factory=net.factory, clock=clock) as pool:
        for n in range(4):
            pool.execute({"n": n})
        estimates = {r["id"]: r["balancing"]["latency_estimate_ms"] for r in pool.workers()}
    assert net.requests("a")  # it was asked, and refused
    assert estimates["a"] >= estimates["b"] > 100


def test_a_refusal_from_the_only_worker_is_the_tasks_at_once() -> None:
    """With nobody else to ask, the one worker's 400 stands: TaskRejected, one attempt."""
    net = FakeNetwork()
    net.route("a", answer(400, {"detail": "bad input"}))
    with make_pool(net, "a") as pool:
        with pytest.raises(TaskRejected, match="bad input"):
            pool.execute({"n": 1})
        assert rows(pool)["a"]["breaker"]["failures"] == 0
        assert pool.stats()["tasks"]["rejected"] == 1
    assert len(net.requests("a")) == 1


def test_a_failed_task_from_two_windows_workers_charges_nobody() -> None:
    """HTTP 200 "failed" from two workers: TaskFailed after two attempts, breakers untouched."""
    net = FakeNetwork()
    failed = answer(200, {"task_id": "t", "status": "failed", "error": "no attribute 'x'"})
    net.route("a", failed)
    net.route("b", failed)
    cfg = [
        worker_config(w, f"http://127.0.0.1:{9500 + n}", protocol="autobot-windows")
        for n, w in enumerate("ab")
    ]
    config = PoolConfig(
        workers=tuple(cfg),
        health=HealthConfig(enabled=False),
        circuit_breaker=BreakerConfig(fail_max=1, reset_timeout=60),
    )
    with WorkerPool(config, transport_factory=net.factory, clock=FakeClock()) as pool:
        for n in range(6):
            with pytest.raises(TaskFailed, match="taken as the task's fault") as info:
                pool.execute(
                    {"model_id": "m", "input_text": str(n), "task_type": "semantic_search"}
                )
            assert len(info.value.attempts) == 2
        assert [r["breaker"]["state"] for r in pool.workers()] == ["closed", "closed"]
