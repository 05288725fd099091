"""Unit tests of the routing trace: choices, attempts, charges, failed tasks, dead letters."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from npu_sync import NoWorkerAvailable, Task, TaskFailed, WorkerPool
from npu_sync.config import (
    AdmissionConfig,
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    RetryConfig,
    worker_config,
)
from npu_sync.testing import FakeClock, FakeNetwork, json_response
from npu_sync.trace import Trace, TraceStep


def make_pool(net: FakeNetwork, *ids: str, priorities: list[int] | None = None) -> WorkerPool:
    priorities = priorities or [1] * len(ids)
    cfg = PoolConfig(
        workers=tuple(
            worker_config(w, f"http://127.0.0.1:{9100 + n}", priority=p)
            for n, (w, p) in enumerate(zip(ids, priorities, strict=True))
        ),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=3, backoff_initial=0.0, backoff_max=0.0),
        circuit_breaker=BreakerConfig(fail_max=5, reset_timeout=30, max_reset_timeout=60),
    )
    return WorkerPool(cfg, transport_factory=net.factory, clock=FakeClock())


def ok(req: Any) -> Any:
    return json_response(200, {"ok": True})


def kinds(trace: Trace) -> list[tuple[str, str | None]]:
    return [(s.kind, s.worker_id) for s in trace.steps]


def test_a_retried_task_names_both_workers_why_and_who_was_charged() -> None:
    """503 from a, success on b: each choice, each attempt, a charged, b's skip reason."""
    net = FakeNetwork()
    net.route("a", lambda req: json_response(503, {"detail": "busy"}))
    net.route("b", ok)
    trace = Trace()
    with make_pool(net, "a", "b", priorities=[1, 2]) as pool:
        assert pool.execute({"x": 1}, trace=trace) == {"ok": True}
    assert kinds(trace) == [("choice", "a"), ("attempt", "a"), ("choice", "b"), ("attempt", "b")]
    first, failed, second, succeeded = trace.steps
    assert dict(first.considered) == {"b": "lower tier (priority 2 after 1)"}
    assert failed.outcome == "failure" and failed.status == 503 and failed.charged == "a"
    assert dict(second.considered) == {"a": "excluded: already tried by this task"}
    assert succeeded.outcome == "success" and succeeded.charged == "nobody"
    assert trace.workers == ["a", "b"] and trace.task_id
    text = str(trace)
    assert "chose a (not b: lower tier" in text and "charged: a" in text


def test_a_failed_task_carries_its_trace_and_its_dead_letter_keeps_it() -> None:
    """No trace asked for: TaskFailed.trace still names every attempt and the charges."""
    net = FakeNetwork()
    for wid in "ab":
        net.route(wid, lambda req: json_response(503, {"detail": "down"}))
    with make_pool(net, "a", "b") as pool:
        with pytest.raises(TaskFailed) as caught:
            pool.execute({"x": 1})
        (letter,) = pool.dead_letters.list()
    trace = caught.value.trace
    assert trace is not None and set(trace.workers) == {"a", "b"}
    charges = [s.charged for s in trace.steps if s.kind == "attempt"]
    assert charges == trace.workers  # each 503 charged to the worker that gave it
    assert trace.steps[-1].kind == "note" and trace.steps[-1].text.startswith("gave up")  # type: ignore[union-attr]
    # The second choice, made once tracing began, says why the first worker was not chosen.
    choices = [s for s in trace.steps if s.kind == "choice"]
    assert choices[0].considered == ()  # the first choice predates the failure
    assert "excluded" in dict(choices[1].considered)[trace.workers[0]]
    assert letter.trace == trace.to_dict()
    assert json.loads(json.dumps(letter.to_dict()))["trace"]["steps"][1]["charged"] in "ab"
    assert Trace.from_dict(letter.trace).workers == trace.workers


def test_a_refusal_is_held_then_charged_when_another_worker_answers() -> None:
    """422 from a, success on b: a's charge held at first, then made, and the trace says so."""
    net = FakeNetwork()
    net.route("a", lambda req: json_response(422, {"detail": "no"}))
    net.route("b", ok)
    trace = Trace()
    with make_pool(net, "a", "b", priorities=[1, 2]) as pool:
        pool.execute({"x": 1}, trace=trace)
    failed = trace.steps[1]
    assert failed.outcome == "rejected" and failed.status == 422
    assert failed.charged == "held: a only if another worker answers the task"
    assert trace.steps[-1].kind == "note"
    assert trace.steps[-1].text == "held answers charged after b answered: a"


def test_http_500_is_charged_at_once_the_first_time_and_held_after() -> None:
    """500 from a then from b: a charged when it answers, b's charge held (maybe the task's)."""
    net = FakeNetwork()
    for wid in "ab":
        net.route(wid, lambda req: json_response(500, {"detail": "bad input"}))
    with make_pool(net, "a", "b", priorities=[1, 2]) as pool, pytest.raises(TaskFailed) as caught:
        pool.execute({"x": 1})
    trace = caught.value.trace
    assert trace is not None
    charges = [s.charged for s in trace.steps if s.kind == "attempt"]
    assert charges[:2] == ["a", "held: b only if another worker answers the task"]


def test_a_full_worker_is_named_as_full() -> None:
    """A worker at capacity is skipped as 'full (n/n)'."""
    net = FakeNetwork()
    net.route("a", ok)
    net.route("b", ok)
    trace = Trace()
    with make_pool(net, "a", "b") as pool:
        a = pool._state.workers["a"]
        with pool._state.lock:
            held = pool._state.dispatcher._try((), pool._state.clock.monotonic())
            assert held is not None and held.worker is a
            a.in_flight = a.capacity
        try:
            pool.execute({"x": 1}, trace=trace)
        finally:
            with pool._state.lock:
                a.in_flight = 1
        from npu_sync._life import record
        from npu_sync._retry import Kind, Outcome

        record(pool._state, held, Outcome(Kind.ABANDONED), 0.0, 0.0, retry=False)
    assert dict(trace.steps[0].considered) == {"a": f"full ({a.capacity}/{a.capacity})"}


def test_steps_read_and_serialise() -> None:
    """A step with no worker is a note; to_dict drops empty fields and round-trips."""
    trace = Trace("t-1")
    trace.add(TraceStep("note", 1.0, text="refused on admission: expected 3.2 s, 1.0 s left"))
    trace.add(TraceStep("hedge", 2.0, "b"))
    assert str(trace) == "1. refused on admission: expected 3.2 s, 1.0 s left\n2. hedged to b"
    assert trace.to_dict()["steps"][0] == {
        "kind": "note",
        "at": 1.0,
        "text": "refused on admission: expected 3.2 s, 1.0 s left",
    }
    again = Trace.from_dict(trace.to_dict())
    assert again.to_dict() == trace.to_dict() and repr(again) == "<Trace t-1: 2 steps>"


def test_a_sqlite_dead_letter_keeps_the_trace_even_in_a_file_made_before_it(tmp_path) -> None:
    """A schema-1 file without the trace column gets it on open; the trace round-trips."""
    import sqlite3

    from npu_sync._deadletter import _SCHEMA, SCHEMA_VERSION, DeadLetter, SQLiteDeadLetterStore
    from npu_sync.task import Task

    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(path)
    for statement in _SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    conn.commit()
    conn.close()
    trace = Trace("t-1")
    trace.add(TraceStep("attempt", 1.0, "a", outcome="failure", status=503, charged="a"))
    letter = DeadLetter.from_task(
        Task({"x": 1}, task_id="t-1"),
        endpoint="/inference",
        error="boom",
        attempts=(),
        now=1.0,
        trace=trace.to_dict(),
    )
    plain = DeadLetter.from_task(
        Task({"x": 2}), endpoint="/inference", error="boom", attempts=(), now=1.0
    )
    store = SQLiteDeadLetterStore(str(path))
    try:
        store.add(letter)
        store.add(plain)
        got = {r.id: r for r in store.list()}
    finally:
        store.close()
    assert got[letter.id].trace == trace.to_dict() and got[plain.id].trace is None
    assert Trace.from_dict(got[letter.id].trace).workers == ["a"]


def test_a_trace_over_a_large_fleet_stays_bounded() -> None:
    """300 workers all failing, 100 retries: each choice lists at most MAX_CONSIDERED
    workers (the untried first) and counts the rest, so the dead letter stays small
    instead of growing with workers x retries (4 MB at 500 workers)."""
    from npu_sync._routing import MAX_CONSIDERED
    from npu_sync.config import TimeoutConfig

    net = FakeNetwork(default=lambda req: json_response(503, {"detail": "down"}))
    ids = [f"w{i:03d}" for i in range(300)]
    cfg = PoolConfig(
        workers=tuple(worker_config(w, f"http://127.0.0.1:{9000 + n}") for n, w in enumerate(ids)),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=100, backoff_initial=0.0, backoff_max=0.0),
        timeouts=TimeoutConfig(task=300.0),
    )
    with WorkerPool(cfg, transport_factory=net.factory, clock=FakeClock()) as pool:
        with pytest.raises(TaskFailed) as caught:
            pool.execute({"x": 1})
        letter = pool.dead_letters.get(caught.value.dead_letter_id)  # type: ignore[arg-type]
    trace = caught.value.trace
    assert trace is not None and len(trace.workers) == 101
    choices = [s for s in trace.steps if s.kind == "choice"]
    later = choices[1:]  # the first began the trace at the first failure: names nobody
    assert later and all(len(c.considered) == MAX_CONSIDERED for c in later)
    assert all(c.unlisted == 300 - 1 - MAX_CONSIDERED for c in later)
    # The untried come first: a reader sees the alternatives, not the workers tried.
    last = later[-1]
    assert all("excluded" not in why for _, why in last.considered)
    assert f"and {last.unlisted} more" in str(last)
    assert len(json.dumps(letter.to_dict())) < 400_000
    assert Trace.from_dict(letter.trace).to_dict() == trace.to_dict()  # type: ignore[arg-type]


def test_a_trace_written_by_a_newer_release_still_reads() -> None:
    """Dead letters outlive a release (a shared Redis store during a rolling deploy): a
    step with a key this release does not know is read without it, not a TypeError."""
    data = {
        "task_id": "t-1",
        "steps": [
            {"kind": "attempt", "at": 1.0, "worker_id": "a", "charged": "a", "cost_ms": 4},
            {"kind": "choice", "at": 2.0, "worker_id": "b", "unlisted": 3, "considered": []},
        ],
    }
    trace = Trace.from_dict(data)
    assert trace.workers == ["a"] and trace.steps[1].unlisted == 3
    assert "cost_ms" not in json.dumps(trace.to_dict())


def test_one_trace_for_two_tasks_is_refused_naming_both() -> None:
    """A Trace already filled by one task, given to another: InvalidTask naming the key
    and both task ids, before anything is sent; the first task's steps stay its own."""
    from npu_sync import InvalidTask, Task

    net = FakeNetwork()
    net.route("a", ok)
    trace = Trace()
    with make_pool(net, "a") as pool:
        pool.execute(Task({"x": 1}, task_id="first"), trace=trace)
        steps = list(trace.steps)
        with pytest.raises(InvalidTask, match=r"trace: .*'first'.*'second'"):
            pool.execute(Task({"x": 2}, task_id="second"), trace=trace)
        with pytest.raises(InvalidTask, match=r"trace: .*'first'"):
            pool.submit({"x": 3}, trace=trace)
        again = Trace("third")
        assert pool.execute(Task({"x": 4}, task_id="third"), trace=again) == {"ok": True}
    assert trace.steps == steps and trace.task_id == "first"
    assert len([r for r in net.requests() if r.path != "/health"]) == 2


# -- trace=True: the pool makes the trace ------------------------------------------------


def test_trace_true_keeps_a_trace_from_the_start_read_with_last_trace() -> None:
    """execute(trace=True): the pool makes the task's Trace, read after the call with
    last_trace(); kept from the task's start, its first choice names why the others
    were not chosen (a failed task's own trace, begun at its first failure, does not);
    a failure carries that same trace."""
    from npu_sync.trace import last_trace

    net = FakeNetwork()
    net.route("a", ok)
    net.route("b", lambda req: json_response(503, {"detail": "down"}))
    net.route("c", lambda req: json_response(503, {"detail": "down"}))
    with make_pool(net, "a", "b", priorities=[1, 2]) as pool:
        assert pool.execute(Task({"x": 1}, task_id="t-ok"), trace=True) == {"ok": True}
        done = last_trace()
        assert done is not None and done.task_id == "t-ok" and done.workers == ["a"]
        assert dict(done.steps[0].considered) == {"b": "lower tier (priority 2 after 1)"}
        assert pool.execute({"x": 2}) == {"ok": True}  # not traced: last_trace() stays
        assert pool.execute({"x": 3}, trace=False) == {"ok": True}  # nor this one
        assert last_trace() is done
    with make_pool(net, "b", "c", priorities=[1, 2]) as pool, pytest.raises(TaskFailed) as caught:
        pool.execute({"x": 4}, trace=True)
    failed = last_trace()
    assert failed is not None and caught.value.trace is failed
    assert failed.task_id == caught.value.task_id and failed.workers[:2] == ["b", "c"]
    assert dict(failed.steps[0].considered) == {"c": "lower tier (priority 2 after 1)"}


def test_trace_true_on_submit_is_the_submitting_threads_last_trace() -> None:
    """submit(trace=True): last_trace() on the submitting thread is that task's trace
    as soon as submit returns, filled once the future is done; other threads keep their
    own."""
    from npu_sync.trace import last_trace

    net = FakeNetwork()
    net.route("a", ok)
    seen: list[object] = []
    with make_pool(net, "a") as pool:
        future = pool.submit(Task({"x": 1}, task_id="t-sub"), trace=True)
        trace = last_trace()
        assert trace is not None and trace.task_id == "t-sub"
        assert future.result(10) == {"ok": True}
        other = threading.Thread(target=lambda: seen.append(last_trace()))
        other.start()
        other.join(5)
    assert trace.workers == ["a"] and seen == [None]


@pytest.mark.parametrize("value", ["yes", 1, 0, Trace, {"on": True}])
def test_a_trace_that_is_neither_a_trace_nor_a_bool_is_a_type_error(value: object) -> None:
    """trace= takes a Trace, True or False (None: the default): anything else is a
    TypeError naming what was given, raised before anything is sent."""
    net = FakeNetwork()
    net.route("a", ok)
    with make_pool(net, "a") as pool:
        for run in (pool.execute, pool.submit):
            with pytest.raises(TypeError, match=r"trace: expected a Trace, True or False, got"):
                run({"x": 1}, trace=value)  # type: ignore[operator]
        assert net.requests() == []


# -- why a worker was not chosen, and why the task gave up -------------------------------


def test_a_worker_without_the_tasks_model_is_named_as_lacking_it() -> None:
    """a holds m1 only, b holds m2: a task for m2 goes to b, and the trace says a lacks
    the model (not that it was tried, nor that the balancing passed it over)."""
    from tests.modelkit import config, linux, w

    net = FakeNetwork()
    net.route("a", linux(["m1"]))
    net.route("b", linux(["m2"]))
    trace = Trace()
    with WorkerPool(config(w("a", 0), w("b", 1)), transport_factory=net.factory) as pool:
        pool.check_health()  # the model lists are read
        assert pool.execute({"model_id": "m2"}, trace=trace)["worker"] == "b"
    choice = trace.steps[0]
    assert (choice.kind, choice.worker_id) == ("choice", "b")
    assert dict(choice.considered) == {"a": "no model: does not hold the task's model"}


def test_a_worker_with_room_the_balancing_passed_over_is_named_so() -> None:
    """a and b in one tier, a already running a task: the task goes to b, the less
    loaded, and a is 'not picked by the balancing', with its load."""
    net = FakeNetwork()
    net.route("a", ok)
    net.route("b", ok)
    trace = Trace()
    with make_pool(net, "a", "b") as pool:
        state = pool._state
        a = state.workers["a"]
        with state.lock:
            held = state.dispatcher._try({"b"}, state.clock.monotonic())
        assert held is not None and held.worker is a
        try:
            pool.execute({"x": 1}, trace=trace)
        finally:
            from npu_sync._life import record
            from npu_sync._retry import Kind, Outcome

            record(state, held, Outcome(Kind.ABANDONED), 0.0, 0.0, retry=False)
    choice = trace.steps[0]
    assert (choice.kind, choice.worker_id) == ("choice", "b")
    assert dict(choice.considered) == {
        "a": f"not picked by the balancing (1/{a.capacity} in flight)"
    }


def test_a_task_refused_a_retry_by_the_budget_says_so_in_its_trace() -> None:
    """A budget of one retry per window: the task's second retry is refused, and its
    trace (and dead letter) end on the note that the retry budget was spent."""
    from npu_sync.config import BalancingConfig, RetryBudgetConfig

    net = FakeNetwork(default=lambda req: json_response(500, {"detail": "down"}))
    cfg = PoolConfig(
        workers=tuple(
            worker_config(w, f"http://127.0.0.1:{9100 + n}") for n, w in enumerate("abc")
        ),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=3, backoff_initial=0.0, backoff_max=0.0),
        circuit_breaker=BreakerConfig(fail_max=100, reset_timeout=30, max_reset_timeout=60),
        balancing=BalancingConfig(
            retry_budget=RetryBudgetConfig(ratio=0.0, min_per_second=0.1)  # 1 per 10 s
        ),
    )
    with WorkerPool(cfg, transport_factory=net.factory, clock=FakeClock()) as pool:
        with pytest.raises(TaskFailed) as caught:
            pool.execute({"x": 1})
        letter = pool.dead_letters.get(caught.value.dead_letter_id)  # type: ignore[arg-type]
    trace = caught.value.trace
    assert trace is not None and len(trace.workers) == 2  # the first attempt and one retry
    last = trace.steps[-1]
    assert last.kind == "note" and last.text is not None
    assert last.text.startswith("gave up: retry budget exhausted; last error on ")
    assert letter is not None and Trace.from_dict(letter.trace).steps[-1] == last  # type: ignore[arg-type]


def test_a_worker_lacking_what_the_task_requires_is_named_as_lacking_it() -> None:
    """a and b have 'vision', c has not: a task requiring it, failed by a and answered by
    b, names c as lacking the capability in each choice, never as tried by the task."""
    net = FakeNetwork()
    net.route("a", lambda req: json_response(503, {"detail": "busy"}))
    net.route("b", ok)
    net.route("c", ok)
    cfg = PoolConfig(
        workers=(
            worker_config("a", "http://127.0.0.1:9100", priority=1, capabilities=["vision"]),
            worker_config("b", "http://127.0.0.1:9101", priority=2, capabilities=["vision"]),
            worker_config("c", "http://127.0.0.1:9102", priority=1),
        ),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=2, backoff_initial=0.0, backoff_max=0.0),
    )
    trace = Trace()
    with WorkerPool(cfg, transport_factory=net.factory, clock=FakeClock()) as pool:
        pool.execute(Task({"x": 1}, requires=["vision"]), trace=trace)
    first, _, second, _ = trace.steps
    lacks = "lacks capability 'vision', which the task requires"
    assert dict(first.considered) == {"b": "lower tier (priority 2 after 1)", "c": lacks}
    assert dict(second.considered) == {"a": "excluded: already tried by this task", "c": lacks}


# -- a task that fails before any attempt ------------------------------------------------


def test_a_task_failed_with_every_breaker_open_carries_a_trace_naming_why() -> None:
    """The only worker's breaker is open: NoWorkerAvailable, no attempt, and its trace
    (and dead letter's) says why the worker was not chosen, and why the task gave up."""
    net = FakeNetwork()
    net.route("a", lambda req: json_response(503, {"detail": "down"}))
    cfg = PoolConfig(
        workers=(worker_config("a", "http://127.0.0.1:9100"),),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=0),
        circuit_breaker=BreakerConfig(fail_max=1, reset_timeout=60, max_reset_timeout=600),
    )
    with WorkerPool(cfg, transport_factory=net.factory, clock=FakeClock()) as pool:
        with pytest.raises(TaskFailed):
            pool.execute({"x": 1})  # opens a's breaker
        with pytest.raises(NoWorkerAvailable) as caught:
            pool.execute({"x": 2})
        letter = pool.dead_letters.get(caught.value.dead_letter_id)  # type: ignore[arg-type]
    trace = caught.value.trace
    assert trace is not None and trace.task_id == caught.value.task_id
    assert trace.workers == []  # no attempt
    none, gave_up = trace.steps
    assert (none.kind, none.worker_id) == ("choice", None)
    assert dict(none.considered) == {"a": "breaker open"}
    assert str(none) == "no worker chosen (a: breaker open)"
    assert gave_up.kind == "note" and gave_up.text is not None
    assert gave_up.text.startswith("gave up: ") and "breaker open" in gave_up.text
    assert letter is not None and letter.trace == trace.to_dict()


def waited_out(pool: WorkerPool, task: Any, held: list[Any]) -> NoWorkerAvailable:
    """Run ``task`` on a thread until it waits for a worker, then move the fake clock past
    its deadline: the NoWorkerAvailable it ends with. ``held``: leases to give back."""
    from npu_sync._life import record
    from npu_sync._retry import Kind, Outcome

    state = pool._state
    dispatcher = state.dispatcher
    caught: list[BaseException] = []

    def run() -> None:
        try:
            pool.execute(task, timeout=5.0)
        except BaseException as exc:
            caught.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        for _ in range(5000):
            if dispatcher.waiting or not thread.is_alive():
                break
            threading.Event().wait(0.001)
        assert dispatcher.waiting == 1
    finally:
        state.clock.advance(10.0)  # type: ignore[attr-defined]
        with dispatcher.lock:
            dispatcher.wake_all_locked()
        thread.join(5)
        for lease in held:
            record(state, lease, Outcome(Kind.ABANDONED), 0.0, 0.0, retry=False)
    assert not thread.is_alive()
    (error,) = caught
    assert isinstance(error, NoWorkerAvailable)
    return error


def test_a_task_that_found_no_free_slot_in_time_carries_a_trace_naming_why() -> None:
    """a full until the task's deadline: NoWorkerAvailable, and its trace names a as full."""
    net = FakeNetwork()
    net.route("a", ok)
    cfg = PoolConfig(
        workers=(worker_config("a", "http://127.0.0.1:9100", max_concurrent=1),),
        health=HealthConfig(enabled=False),
        admission=AdmissionConfig(deadline_aware=False),
    )
    with WorkerPool(cfg, transport_factory=net.factory, clock=FakeClock()) as pool:
        state = pool._state
        with state.lock:
            lease = state.dispatcher._try((), state.clock.monotonic())
        failed = waited_out(pool, {"x": 1}, [lease])
        (letter,) = pool.dead_letters.list()
    trace = failed.trace
    assert trace is not None and trace.workers == []
    none = trace.steps[0]
    assert (none.kind, none.worker_id) == ("choice", None)
    assert dict(none.considered) == {"a": "full (1/1)"}
    assert trace.steps[-1].text == "gave up: deadline passed waiting for a worker"
    assert letter.trace == trace.to_dict()


def test_a_batch_task_kept_off_a_reserved_slot_is_told_so_in_its_trace() -> None:
    """Interactive reserving half of a's two slots, one batch task running: a second
    batch task waits beside the free slot, and its trace says the slot is reserved."""
    from npu_sync.config import ClassConfig, PriorityConfig

    net = FakeNetwork()
    net.route("a", ok)
    cfg = PoolConfig(
        workers=(worker_config("a", "http://127.0.0.1:9100", max_concurrent=2),),
        health=HealthConfig(enabled=False),
        admission=AdmissionConfig(deadline_aware=False),
        priority=PriorityConfig(
            classes=(ClassConfig("interactive", 0.5), ClassConfig("batch", 0.0)),
            default="interactive",
            aging=0,
        ),
    )
    with WorkerPool(cfg, transport_factory=net.factory, clock=FakeClock()) as pool:
        state = pool._state
        with state.lock:
            lease = state.dispatcher._try((), state.clock.monotonic(), rank=1)
        failed = waited_out(pool, Task({"x": 1}, priority="batch"), [lease])
    trace = failed.trace
    assert trace is not None
    assert dict(trace.steps[0].considered) == {
        "a": "reserved for the classes above batch (1/2 in flight)"
    }
