"""Each step of a task's life alone, driven with a stub next step (npu_sync.life).

No worker answers here: the steps above the request get a pool whose transports fail
the test if used (tests/stubs.py), and the request steps a FakeNetwork.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from npu_sync import TaskRejected, WorkerPool
from npu_sync.config import HealthConfig, PoolConfig, worker_config
from npu_sync.errors import InvalidTask
from npu_sync.events import AttemptFinished, Event, TaskRejectedEvent
from npu_sync.life.admission import Admit, Fit, Record
from npu_sync.life.context import AGAIN, FIRST, HEDGE, Exhausted, TaskContext, Try
from npu_sync.life.hedge import Hedge, Race
from npu_sync.life.ledger import record
from npu_sync.life.models import ModelCount, ModelHeld
from npu_sync.life.outcomes import Outcomes
from npu_sync.life.protocol import Compose
from npu_sync.life.retry import Retry
from npu_sync.life.transport import Send
from npu_sync.retry import Kind, Outcome
from npu_sync.state import PoolState
from npu_sync.stop import Stopped, TaskStop
from npu_sync.task import Task
from npu_sync.testing import FakeNetwork, FakeRequest, json_response
from npu_sync.transport import Cancel, Response
from tests.stubs import NoTransport

OK = Outcome(Kind.SUCCESS, {"answer": 1}, 200)


def config(*ids: str, **pool: Any) -> PoolConfig:
    return PoolConfig(
        workers=tuple(worker_config(i, f"http://127.0.0.1:{9400 + n}") for n, i in enumerate(ids)),
        health=HealthConfig(enabled=False),
        **pool,
    )


@pytest.fixture
def pool() -> Iterator[WorkerPool]:
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


# -- Retry ---------------------------------------------------------------------------


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


# -- Fit, Admit, Record --------------------------------------------------------------


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


# -- model steps ---------------------------------------------------------------------


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


# -- hedging -------------------------------------------------------------------------


def test_the_first_success_of_a_race_wins_and_cancels_the_other() -> None:
    """settle(): the winner cancels the loser; the loser learns it lost."""
    race = Race()
    assert race.settle(HEDGE, True) is False
    assert race.cancels[FIRST].cancelled and not race.cancels[HEDGE].cancelled
    assert race.settle(FIRST, True) is True


def test_a_race_abandoned_by_the_caller_sends_no_hedge() -> None:
    """Once the caller's attempt raised, the timer's claim is refused."""
    race = Race()
    race.abandon()
    assert race.claim() is False
    assert race.cancels[HEDGE].cancelled


def test_the_hedge_step_passes_a_retry_through_without_a_timer() -> None:
    """Only a task's first attempt is hedged: a retry goes straight down."""
    cfg = config("a", "b")
    with WorkerPool(cfg, transport_factory=lambda *a, **k: NoTransport()) as p:
        state = p._state
        scheduled: list[object] = []

        class Policy:
            def delay_for(self, idempotent: bool) -> float | None:
                return 0.0

            def observe(self, duration: float) -> None:
                scheduled.append(("observed", duration))

        step = Hedge(state, Policy(), Outcomes(state))  # type: ignore[arg-type]
        ctx = begin(p)
        ctx.attempts.append(object())  # type: ignore[arg-type]

        def next(ctx: TaskContext, at: Try) -> Try:
            at.outcome, at.t0, at.t1 = OK, 1.0, 1.5
            record(state, at.lease, OK, 0.0, 0.0, retry=False)
            return at

        lease = state.dispatcher.try_acquire(())
        assert lease is not None
        at = Try(lease)
        assert step(ctx, at, next) is at
        assert at.settle is None  # no race was set up
        assert scheduled == [("observed", 0.5)]


# -- Compose, Send -------------------------------------------------------------------


def _network_pool(net: FakeNetwork, **pool: Any) -> WorkerPool:
    return WorkerPool(config("a", **pool), transport_factory=net.factory)


def test_compose_numbers_the_attempt_and_marks_a_hedge_as_the_second() -> None:
    """X-NPU-Attempt is 1 + failed attempts; a hedge is 2; the task id never changes."""
    net = FakeNetwork()
    with _network_pool(net) as p:
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
    with _network_pool(net) as p:
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


def _send(net: FakeNetwork, check: Any = None, cancel: object = None) -> tuple[Outcome, Try]:
    with _network_pool(net) as p:
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


def test_the_stack_is_built_once_per_configuration_not_per_task() -> None:
    """Tasks share one Stack; a reload that changes the configuration builds another."""
    net = FakeNetwork(lambda req: json_response(200, {}))
    with _network_pool(net) as p:
        p.execute({"x": 1})
        first = p._runner.stack()
        for _ in range(20):
            p.execute({"x": 1})
        assert p._runner.stack() is first
        new = config("a", pool=type(p._state.config.pool)(max_queue_wait=2.5))
        p.reload(new)
        p.execute({"x": 1})
        second = p._runner.stack()
        assert second is not first and second.config is p._state.config


def test_a_configuration_without_hedging_has_no_hedge_step() -> None:
    """The steps a configuration does not need are not in its stack."""
    with WorkerPool(config("a"), transport_factory=lambda *a, **k: NoTransport()) as p:
        names = [type(s).__name__ for s in p._runner.stack().steps]
    assert "Hedge" not in names and "FleetTrial" not in names and "ModelCount" not in names
    assert names[0] == "Retry" and names[-3:] == ["Record", "Compose", "Send"]


def test_many_threads_share_one_stack_without_mixing_their_tasks() -> None:
    """Steps keep no per-task state: 8 threads' tasks each get their own answer."""
    net = FakeNetwork(lambda req: json_response(200, {"echo": req.json()["n"]}))
    errors: list[BaseException] = []
    with _network_pool(net) as p:

        def run(n: int) -> None:
            try:
                for i in range(50):
                    assert p.execute({"n": n * 1000 + i})["echo"] == n * 1000 + i
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert errors == [] and not any(t.is_alive() for t in threads)
