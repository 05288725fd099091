"""The pool's balancing: latency-aware choice, strategies and weights, slow start, the
retry budget, adaptive concurrency and hedging, driven through a pool with a fake
network and a fake clock."""

from __future__ import annotations

import collections
import random
import socket
import threading
from typing import Any

import pytest

from npu_sync import NoWorkerAvailable, Task, TaskFailed, WorkerPool
from npu_sync.config import (
    BalancingConfig,
    BreakerConfig,
    HealthConfig,
    HedgeConfig,
    PoolConfig,
    RetryBudgetConfig,
    RetryConfig,
    TransportConfig,
    worker_config,
)
from npu_sync.events import (
    AttemptHedged,
    Event,
    RetryBudgetAvailable,
    RetryBudgetExhausted,
    WorkerLimitChanged,
    WorkerSlowStart,
)
from npu_sync.testing import FakeClock, FakeNetwork, FakeRequest, json_response
from npu_sync.transport import Cancel, TransportError, make_transport

OK = {"model_id": "default", "input_text": "hi"}


def config(ids: Any = ("a", "b"), *, balancing: BalancingConfig | None = None, **kw: Any):
    workers = []
    for i, spec in enumerate(ids):
        wid, extra = (spec, {}) if isinstance(spec, str) else spec
        workers.append(worker_config(wid, f"http://127.0.0.1:{9200 + i}", **extra))
    kw.setdefault("health", HealthConfig(enabled=False))
    kw.setdefault("retry", RetryConfig(max_retries=3, backoff_initial=0.01, backoff_max=0.02))
    return PoolConfig(workers=tuple(workers), balancing=balancing or BalancingConfig(), **kw)


def answering(clock: FakeClock, seconds: float):
    """A handler that takes ``seconds`` of the fake clock to answer."""

    def handler(req: FakeRequest):
        clock.advance(seconds)
        return json_response(200, {"worker_id": req.worker_id})

    return handler


def served(pool: WorkerPool, tasks: int) -> collections.Counter[str]:
    return collections.Counter(pool.execute(OK)["worker_id"] for _ in range(tasks))


def rows(pool: WorkerPool) -> dict[str, Any]:
    return {row["id"]: row for row in pool.workers()}


# -- latency-aware choice and strategies -------------------------------------------------


@pytest.mark.parametrize("latency_aware", [True, False])
def test_a_slow_worker_gets_few_tasks_only_when_latency_counts(latency_aware):
    """With latency-aware choice (the default) a worker 10x slower gets few tasks; with
    it off, the same two workers share the tasks evenly."""
    clock, net = FakeClock(), FakeNetwork()
    net.route("fast", answering(clock, 0.02))
    net.route("slow", answering(clock, 0.2))
    balancing = BalancingConfig(latency_aware=latency_aware, slow_start=0)
    with WorkerPool(
        config(("fast", "slow"), balancing=balancing), transport_factory=net.factory, clock=clock
    ) as pool:
        counts = served(pool, 100)
        estimate = rows(pool)["slow"]["balancing"]["latency_estimate_ms"]
    if latency_aware:
        assert counts["slow"] <= 5
        assert estimate > 20  # the slow answers were seen
    else:
        assert counts["slow"] == 50


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        ("weighted", {"a": 75, "b": 25}),
        ("round-robin", {"a": 50, "b": 50}),
        ("priority", {"a": 100}),
    ],
)
def test_each_strategy_spreads_tasks_as_documented(strategy, expected):
    """weighted: in proportion to weight (3:1); round-robin: in turn whatever the
    weight; priority: the first worker with room takes everything."""
    clock, net = FakeClock(), FakeNetwork()
    balancing = BalancingConfig(strategy=strategy, slow_start=0)
    specs = (("a", {"weight": 3}), ("b", {"weight": 1}))
    with WorkerPool(
        config(specs, balancing=balancing), transport_factory=net.factory, clock=clock
    ) as pool:
        assert dict(served(pool, 100)) == expected
        assert pool.stats()["balancing"]["strategy"] == strategy


def test_a_reload_puts_the_new_strategy_in_force_with_a_task_in_flight():
    """Reloading ``balancing.strategy`` while a task is on a worker: the task ends
    normally, the next tasks follow the new strategy, and the weighted credit starts
    from what the old rounds left (no burst)."""
    net = FakeNetwork()
    entered, release = threading.Event(), threading.Event()

    def held(req: FakeRequest):
        if req.json().get("hold"):
            entered.set()
            assert release.wait(10.0)
        return json_response(200, {"worker_id": req.worker_id})

    net.route("a", held)
    net.route("b", held)
    specs = (("a", {"weight": 3}), ("b", {"weight": 1}))
    before = config(specs, balancing=BalancingConfig(strategy="priority", slow_start=0))
    after = config(specs, balancing=BalancingConfig(strategy="weighted", slow_start=0))
    with WorkerPool(before, transport_factory=net.factory, clock=FakeClock()) as pool:
        results: list[Any] = []
        runner = threading.Thread(target=lambda: results.append(pool.execute({"hold": 1})))
        runner.start()
        assert entered.wait(10.0)
        assert dict(served(pool, 4)) == {"a": 4}  # priority: the first with room
        pool.reload(after)
        assert pool.stats()["balancing"]["strategy"] == "weighted"
        release.set()
        runner.join(10.0)
        assert results == [{"worker_id": "a"}]
        assert dict(served(pool, 40)) == {"a": 30, "b": 10}
        assert all(row["in_flight"] == 0 for row in pool.workers())


def test_weighted_strategy_interleaves_rather_than_bursts():
    """Smooth weighted round robin: a weight-1 worker's tasks are spread out, never two
    in a row next to a weight-3 one."""
    net = FakeNetwork()
    specs = (("a", {"weight": 3}), ("b", {"weight": 1}))
    balancing = BalancingConfig(strategy="weighted", slow_start=0)
    with WorkerPool(
        config(specs, balancing=balancing), transport_factory=net.factory, clock=FakeClock()
    ) as pool:
        order = "".join(pool.execute(OK)["worker_id"] for _ in range(40))
    assert "bb" not in order and order.count("b") == 10


# -- slow start ------------------------------------------------------------------------------


def test_a_worker_back_from_a_breaker_trip_ramps_up_over_the_window():
    """When a breaker closes after a trip, the worker's share starts low and reaches
    its weight at the end of balancing.slow_start; the ramp is an event and shows in
    stats() and workers()."""
    clock, net = FakeClock(), FakeNetwork()
    events: list[Event] = []
    failing = {"on": True}

    def flaky(req: FakeRequest):
        if failing["on"]:
            return json_response(503, {"detail": "busy"})
        return json_response(200, {"worker_id": req.worker_id})

    net.route("b", flaky)
    cfg = config(
        (("b", {"priority": 1}), ("a", {"priority": 2})),
        balancing=BalancingConfig(slow_start=10.0),
        circuit_breaker=BreakerConfig(fail_max=1, reset_timeout=1.0),
    )
    with WorkerPool(cfg, transport_factory=net.factory, clock=clock, hooks=[events.append]) as pool:
        assert pool.execute(OK)["worker_id"] == "a"  # b failed and its breaker opened
        assert rows(pool)["b"]["breaker"]["state"] == "open"
        failing["on"] = False
        clock.advance(1.5)
        assert pool.execute(OK)["worker_id"] == "b"  # the trial closes the breaker
        ramp = [e for e in events if isinstance(e, WorkerSlowStart)]
        assert [(e.worker_id, e.reason, e.window) for e in ramp] == [("b", "recovered", 10.0)]
        assert pool.stats()["balancing"]["ramping"] == ["b"]
        early = rows(pool)["b"]["balancing"]
        assert early["slow_start_until"] is not None and early["share"] < 0.2
        clock.advance(5.0)
        pool.execute(OK)
        middle = rows(pool)["b"]["balancing"]["share"]
        assert 0.3 < middle < 0.8
        clock.advance(5.5)
        pool.execute(OK)
        late = rows(pool)["b"]["balancing"]
        assert late["share"] == 1.0 and late["slow_start_until"] is None
        assert pool.stats()["balancing"]["ramping"] == []


def test_slow_start_zero_gives_a_returning_worker_its_share_at_once():
    """balancing.slow_start 0: no ramp, no event."""
    clock, net = FakeClock(), FakeNetwork()
    events: list[Event] = []
    failing = {"on": True}
    net.route(
        "b",
        lambda req: (
            json_response(503, {}) if failing["on"] else json_response(200, {"worker_id": "b"})
        ),
    )
    cfg = config(
        (("b", {"priority": 1}), ("a", {"priority": 2})),
        balancing=BalancingConfig(slow_start=0),
        circuit_breaker=BreakerConfig(fail_max=1, reset_timeout=1.0),
    )
    with WorkerPool(cfg, transport_factory=net.factory, clock=clock, hooks=[events.append]) as pool:
        pool.execute(OK)
        failing["on"] = False
        clock.advance(1.5)
        assert pool.execute(OK)["worker_id"] == "b"
        assert rows(pool)["b"]["balancing"]["share"] == 1.0
    assert not [e for e in events if isinstance(e, WorkerSlowStart)]


def test_a_worker_added_at_run_time_ramps_in_and_says_so():
    """add_worker(): the new worker's slow start is a ``worker.slow_start`` event with
    reason ``added``, and its row shows the ramp."""
    clock, net = FakeClock(), FakeNetwork()
    events: list[Event] = []
    cfg = config(("a",), balancing=BalancingConfig(slow_start=10.0))
    with WorkerPool(cfg, transport_factory=net.factory, clock=clock, hooks=[events.append]) as pool:
        pool.execute(OK)
        pool.add_worker(worker_config("b", "http://127.0.0.1:9300"))
        ramp = [e for e in events if isinstance(e, WorkerSlowStart)]
        assert [(e.worker_id, e.reason, e.window) for e in ramp] == [("b", "added", 10.0)]
        row = rows(pool)["b"]["balancing"]
        assert row["slow_start_until"] is not None and row["share"] < 0.2
        assert pool.stats()["balancing"]["ramping"] == ["b"]


def test_a_worker_back_twice_at_the_same_moment_ramps_once():
    """Two reasons to ramp at one moment (a move resets the breaker too): one slow
    start, one event."""
    clock, net = FakeClock(), FakeNetwork()
    events: list[Event] = []
    cfg = config(("a", "b"), balancing=BalancingConfig(slow_start=10.0))
    with WorkerPool(cfg, transport_factory=net.factory, clock=clock, hooks=[events.append]) as pool:
        state = pool._state
        worker = state.workers["b"]
        with state.lock:
            now = clock.monotonic()
            state.recovered_locked(worker, now, "moved")
            state.recovered_locked(worker, now, "recovered")
        state.flush_events()
        ramp = [e for e in events if isinstance(e, WorkerSlowStart)]
        assert [(e.worker_id, e.reason) for e in ramp] == [("b", "moved")]
        clock.advance(1.0)
        with state.lock:
            state.recovered_locked(worker, clock.monotonic(), "healthy")  # a later moment
        state.flush_events()
        assert len([e for e in events if isinstance(e, WorkerSlowStart)]) == 2


# -- the retry budget ---------------------------------------------------------------------


def test_the_retry_budget_stops_retries_then_allows_them_again():
    """With a budget of one retry per window and no share of tasks, the second retry
    is refused with the reason; the budget's edges are events; once the window has
    slid past, retries are allowed again."""
    clock, net = FakeClock(), FakeNetwork(lambda req: json_response(500, {"detail": "down"}))
    events: list[Event] = []
    budget = RetryBudgetConfig(ratio=0.0, min_per_second=0.1)  # 1 retry per 10 s window
    cfg = config(
        ("a", "b", "c"),
        balancing=BalancingConfig(retry_budget=budget),
        circuit_breaker=BreakerConfig(fail_max=100),
    )
    with WorkerPool(cfg, transport_factory=net.factory, clock=clock, hooks=[events.append]) as pool:
        with pytest.raises(TaskFailed, match="retry budget exhausted") as failed:
            pool.execute(OK)
        assert len(failed.value.attempts) == 2  # the first attempt and one retry
        stats = pool.stats()["balancing"]["retry_budget"]
        assert (stats["retries"], stats["refused"], stats["exhausted"]) == (1, 1, True)
        assert [type(e) for e in events if "RetryBudget" in type(e).__name__] == [
            RetryBudgetExhausted
        ]
        clock.advance(11.0)
        with pytest.raises(TaskFailed, match="retry budget exhausted") as again:
            pool.execute(OK)
        assert len(again.value.attempts) == 2
    kinds = [type(e) for e in events if "RetryBudget" in type(e).__name__]
    assert kinds == [RetryBudgetExhausted, RetryBudgetAvailable, RetryBudgetExhausted]


def test_each_task_pays_into_the_budget():
    """Every task deposits its share: requests counts tasks, and a pool whose floor is
    0 can retry once enough tasks have paid in."""
    clock = FakeClock()
    calls = collections.Counter[str]()

    def first_fails(req: FakeRequest):
        calls[req.headers["X-NPU-Task-Id"]] += 1
        if calls[req.headers["X-NPU-Task-Id"]] == 1:
            return json_response(500, {})
        return json_response(200, {"worker_id": req.worker_id})

    budget = RetryBudgetConfig(ratio=0.5, min_per_second=0.0)
    cfg = config(
        ("a", "b"),
        balancing=BalancingConfig(retry_budget=budget),
        circuit_breaker=BreakerConfig(fail_max=100),
    )
    net = FakeNetwork(first_fails)
    with WorkerPool(cfg, transport_factory=net.factory, clock=clock) as pool:
        with pytest.raises(TaskFailed, match="retry budget exhausted"):
            pool.execute(OK)  # pays 0.5: not enough for its own retry ...
        assert pool.execute(OK)["worker_id"]  # ... 1.0 now: its retry is allowed
        stats = pool.stats()["balancing"]["retry_budget"]
    assert stats["requests"] == 2
    assert stats["refused"] == 1 and stats["retries"] == 1


def test_a_task_refused_a_worker_at_once_still_pays_into_the_budget():
    """A task pays in with its first request for a worker, whatever the answer: one
    that no worker can take (the only worker is disabled) is counted too."""
    clock, net = FakeClock(), FakeNetwork()
    cfg = config((("a", {"enabled": False}),))
    with WorkerPool(cfg, transport_factory=net.factory, clock=clock) as pool:
        with pytest.raises(NoWorkerAvailable):
            pool.execute(OK)
        with pytest.raises(NoWorkerAvailable):
            pool.execute(OK)
        stats = pool.stats()["balancing"]["retry_budget"]
    assert stats["requests"] == 2
    assert net.requests("a") == []


# -- adaptive concurrency ---------------------------------------------------------------------


def test_adaptive_concurrency_sets_capacity_and_backs_off_on_overload():
    """With adaptive_concurrency, a worker's capacity is its limit (starting at 4,
    never above max_concurrent); a 503 cuts it by a tenth, announced as an event."""
    clock, net = FakeClock(), FakeNetwork()
    events: list[Event] = []
    net.route("a", lambda req: json_response(503, {"detail": "overloaded"}))
    cfg = config(
        (
            ("a", {"priority": 1}),
            ("b", {"priority": 2}),
            ("c", {"priority": 2, "max_concurrent": 2}),
        ),
        balancing=BalancingConfig(adaptive_concurrency=True),
        circuit_breaker=BreakerConfig(fail_max=100),
    )
    with WorkerPool(cfg, transport_factory=net.factory, clock=clock, hooks=[events.append]) as pool:
        before = rows(pool)
        assert before["a"]["capacity"] == 4 and before["a"]["balancing"]["limit"] == 4
        assert before["c"]["capacity"] == 2  # the ceiling
        assert pool.execute(OK)["worker_id"] in ("b", "c")  # a answered 503 first
        after = rows(pool)["a"]
        assert after["capacity"] == 3 and after["balancing"]["limit"] == 3
        assert pool.stats()["balancing"]["adaptive_concurrency"] is True
        assert pool.stats()["balancing"]["concurrency_limit"] == "hill-climbing"
    changes = [(e.worker_id, e.old, e.new) for e in events if isinstance(e, WorkerLimitChanged)]
    assert changes == [("a", 4, 3)]


def test_without_adaptive_concurrency_capacity_is_max_concurrent():
    """The default: no limit, capacity is max_concurrent; a reload turns a limit on."""
    net = FakeNetwork()
    cfg = config(("a",))
    with WorkerPool(cfg, transport_factory=net.factory, clock=FakeClock()) as pool:
        assert rows(pool)["a"]["capacity"] == 32 and rows(pool)["a"]["balancing"]["limit"] is None
        pool.reload(config(("a",), balancing=BalancingConfig(adaptive_concurrency=True)))
        assert rows(pool)["a"]["capacity"] == 4


# -- hedging -----------------------------------------------------------------------------------


class Frozen:
    """A worker handler that holds each request until cancelled or released."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.requests: list[FakeRequest] = []

    def __call__(self, req: FakeRequest):
        self.requests.append(req)
        self.started.set()
        cancel = req.cancel
        for _ in range(1000):  # bounded: a broken test must not hang the suite
            if self.release.is_set() or (cancel is not None and cancel.cancelled):
                break
            (cancel.event if cancel is not None else self.release).wait(0.01)
        return json_response(200, {"worker_id": req.worker_id})


def hedged_pool(net: FakeNetwork, clock: FakeClock, events: list[Event], **hedge: Any):
    cfg = config(
        (("a", {"priority": 1}), ("b", {"priority": 2})),
        balancing=BalancingConfig(hedge=HedgeConfig(**{"enabled": True, "delay": 0.05, **hedge})),
    )
    return WorkerPool(cfg, transport_factory=net.factory, clock=clock, hooks=[events.append])


def run_in_thread(fn):
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    return thread, box


def test_a_hedge_answers_first_and_the_first_attempt_is_cancelled_uncharged():
    """A task stuck on a frozen worker is sent to another after the delay; that answer
    is returned, the stuck attempt is cancelled and recorded as abandoned (not
    charged), the hedge carries X-NPU-Attempt 2, and the hedge is counted."""
    clock, net, frozen = FakeClock(), FakeNetwork(), Frozen()
    events: list[Event] = []
    net.route("a", frozen)
    with hedged_pool(net, clock, events) as pool:
        thread, box = run_in_thread(lambda: pool.execute(Task(payload=OK, idempotent=True)))
        assert frozen.started.wait(10)
        clock.advance(0.1)
        pool._state.hedger.run_due()  # or the timer thread did it already
        thread.join(10)
        assert not thread.is_alive()
        assert box["value"]["worker_id"] == "b"
        a = rows(pool)["a"]
        stats = pool.stats()["balancing"]
    assert frozen.requests[0].cancel is not None and frozen.requests[0].cancel.cancelled
    assert net.requests("b")[0].headers["X-NPU-Attempt"] == "2"
    assert a["tasks"]["abandoned"] == 1 and a["tasks"]["failed"] == 0
    assert a["breaker"]["failures"] == 0
    assert (stats["hedge"]["hedged"], stats["hedge"]["won"]) == (1, 1)
    assert stats["retry_budget"]["retries"] == 1  # the hedge drew on the budget
    hedged = [e for e in events if isinstance(e, AttemptHedged)]
    assert [(e.worker_id, e.hedge_worker_id) for e in hedged] == [("a", "b")]


def test_a_task_not_idempotent_is_never_hedged():
    """Hedging is for idempotent tasks only: nothing is scheduled for the others."""
    clock, net, frozen = FakeClock(), FakeNetwork(), Frozen()
    net.route("a", frozen)
    with hedged_pool(net, clock, []) as pool:
        thread, box = run_in_thread(lambda: pool.execute(Task(payload=OK, idempotent=False)))
        assert frozen.started.wait(10)
        assert pool._state.hedger.pending() == 0
        frozen.release.set()
        thread.join(10)
        assert box["value"] == {"worker_id": "a"}
    assert net.requests("b") == []


def test_a_hedge_is_skipped_without_retry_budget():
    """A hedge needs a retry token: with an empty budget it is skipped, counted, and
    the task waits for its first attempt."""
    clock, net, frozen = FakeClock(), FakeNetwork(), Frozen()
    net.route("a", frozen)
    cfg = config(
        (("a", {"priority": 1}), ("b", {"priority": 2})),
        balancing=BalancingConfig(
            hedge=HedgeConfig(enabled=True, delay=0.05),
            retry_budget=RetryBudgetConfig(ratio=0.0, min_per_second=0.0),
        ),
    )
    with WorkerPool(cfg, transport_factory=net.factory, clock=clock) as pool:
        thread, box = run_in_thread(lambda: pool.execute(Task(payload=OK, idempotent=True)))
        assert frozen.started.wait(10)
        clock.advance(0.1)
        pool._state.hedger.run_due()
        for _ in range(1000):  # until the timer's callback has run, whichever thread ran it
            if pool.stats()["balancing"]["hedge"]["skipped"]:
                break
            frozen.started.wait(0.01)
        frozen.release.set()
        thread.join(10)
        assert box["value"] == {"worker_id": "a"}
        hedge = pool.stats()["balancing"]["hedge"]
    assert (hedge["hedged"], hedge["skipped"]) == (0, 1)
    assert net.requests("b") == []


def test_a_first_answer_before_the_delay_sends_no_hedge():
    """The common case: an answer before the delay; the timer then does nothing."""
    clock, net = FakeClock(), FakeNetwork()
    with hedged_pool(net, clock, []) as pool:
        assert pool.execute(Task(payload=OK, idempotent=True))["worker_id"] == "a"
        clock.advance(1.0)
        pool._state.hedger.run_due()
        hedge = pool.stats()["balancing"]["hedge"]
    assert (hedge["hedged"], hedge["skipped"]) == (0, 0)
    assert net.requests("b") == []


# -- cancelling a request in the built-in transport ----------------------------------------


@pytest.mark.parametrize("client", ["builtin", "urllib3"])
def test_cancel_aborts_a_request_waiting_for_its_answer(client):
    """Cancel shuts the request's socket down: a request to a worker that never
    answers fails at once with a cancelled error instead of waiting its timeout."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    accepted: list[socket.socket] = []
    got_request = threading.Event()

    def serve():
        conn, _ = listener.accept()
        accepted.append(conn)
        conn.recv(65536)
        got_request.set()

    server = threading.Thread(target=serve)
    server.start()
    transport = make_transport(
        worker_config("w", f"http://127.0.0.1:{port}"), TransportConfig(client=client)
    )
    cancel = Cancel()
    thread, box = run_in_thread(
        lambda: transport.request("POST", "/inference", body=b"{}", timeout=60, cancel=cancel)  # type: ignore[call-arg]
    )
    try:
        assert got_request.wait(10)
        cancel.cancel()
        thread.join(10)
        assert not thread.is_alive()
        assert isinstance(box.get("error"), TransportError)
        assert "cancelled" in str(box["error"]) or box["error"].kind == "reset"
    finally:
        server.join(10)
        for conn in accepted:
            conn.close()
        listener.close()
        transport.close()


def test_a_cancel_after_the_answer_leaves_the_connection_reusable():
    """A request detaches from its Cancel before its connection is pooled again: a
    late cancel does not reach the next request on that connection."""
    cancel = Cancel()
    assert cancel.attach(None)  # nothing attached: a cancel has nothing to shut down
    cancel.cancel()
    assert not cancel.attach(None) and cancel.cancelled


def test_weighted_random_draws_in_proportion_to_weight_at_random():
    """weighted-random: about 3:1 for weights 3 and 1, drawn at random (runs of the
    light worker happen), unlike smooth weighted round robin."""
    net = FakeNetwork()
    specs = (("a", {"weight": 3}), ("b", {"weight": 1}))
    balancing = BalancingConfig(strategy="weighted-random", slow_start=0)
    with WorkerPool(
        config(specs, balancing=balancing),
        transport_factory=net.factory,
        clock=FakeClock(),
        rng=random.Random(7),
    ) as pool:
        order = "".join(pool.execute(OK)["worker_id"] for _ in range(2000))
    assert 0.70 < order.count("a") / len(order) < 0.80
    assert "bb" in order  # random, not interleaved


def test_priority_failover_uses_only_the_preferred_worker_while_it_is_up():
    """priority-failover: a busy preferred worker makes the task wait rather than go to
    another; a worker that fails a task hands it to the next; a down one is skipped."""
    clock, net = FakeClock(), FakeNetwork()
    specs = (("a", {"max_concurrent": 1}), ("b", {}))
    balancing = BalancingConfig(strategy="priority-failover", slow_start=0)
    with WorkerPool(
        config(specs, balancing=balancing), transport_factory=net.factory, clock=clock
    ) as pool:
        assert dict(served(pool, 20)) == {"a": 20}
        dispatcher = pool._state.dispatcher
        with pool._state.lock:
            held = dispatcher.selector.select((), clock.monotonic())
            assert held is not None and held.id == "a"
            held.in_flight += 1  # a is at capacity: nothing else is offered
            assert dispatcher.selector.select((), clock.monotonic()) is None
            held.in_flight -= 1
            dispatcher.selector.taken(held, clock.monotonic())
            # a failed this task already: the next one takes it.
            other = dispatcher.selector.select(("a",), clock.monotonic())
            assert other is not None and other.id == "b"
        net.route("a", lambda req: json_response(503, {"detail": "down"}))
        assert pool.execute(OK)["worker_id"] == "b"
        for _ in range(10):  # a's breaker opens: a is down
            pool.execute(OK)
        failed = rows(pool)["a"]["tasks"]["failed"]
        assert dict(served(pool, 10)) == {"b": 10}
        assert rows(pool)["a"]["tasks"]["failed"] == failed  # not even tried


def _pause_scenario(peak_hold: float) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """Three workers answering in 30 ms; ``a`` gives one late answer of 1 s (a pause).
    Returns which workers took the tasks just after it, and those once ``a`` has been
    idle past the hold."""
    clock = FakeClock()
    latency = {"a": 0.03, "b": 0.03, "c": 0.03}

    def handler(req: FakeRequest) -> Any:
        clock.advance(latency[req.worker_id])
        return json_response(200, {"worker_id": req.worker_id})

    net = FakeNetwork(handler)
    cfg = config(("a", "b", "c"), balancing=BalancingConfig(peak_hold=peak_hold))
    with WorkerPool(cfg, transport_factory=net.factory, clock=clock) as pool:
        served(pool, 48)
        latency["a"] = 1.0
        while pool.execute(OK)["worker_id"] != "a":
            pass
        latency["a"] = 0.03
        during = served(pool, 6)  # 0.18 s: within the hold
        clock.advance(1.0)
        after = served(pool, 6)
    return during, after


def test_a_paused_worker_is_chosen_again_once_its_peak_hold_passes():
    """After one late answer the worker is avoided while the peak is news; once it has
    been idle past ``peak_hold`` its estimate is its typical 30 ms again, and it takes
    its share at once instead of after the 10 s decay has worn the peak down."""
    during, after = _pause_scenario(peak_hold=1.0)
    assert during["a"] == 0
    assert after["a"] >= 2


def test_without_a_peak_hold_only_the_decay_brings_a_paused_worker_back():
    """``peak_hold: 0``: the same worker, a second later, still gets nothing."""
    _, after = _pause_scenario(peak_hold=0.0)
    assert after["a"] == 0


def test_a_worker_whose_only_answer_was_slow_is_tried_again_at_its_tiers_latency():
    """A worker whose first answer was slow (a cold connection) has one answer: its own
    median says little. Once idle past the hold it relaxes to its tier's typical
    latency and is chosen again, instead of waiting for the decay."""
    clock = FakeClock()
    first = {"a": 0.3}

    def handler(req: FakeRequest) -> Any:
        clock.advance(first.pop(req.worker_id, 0.03))
        return json_response(200, {"worker_id": req.worker_id})

    net = FakeNetwork(handler)
    with WorkerPool(config(("a", "b", "c")), transport_factory=net.factory, clock=clock) as pool:
        before = served(pool, 20)  # 0.6 s: a's one slow answer keeps it out
        assert before["a"] == 1
        clock.advance(1.0)  # idle past the hold
        assert served(pool, 6)["a"] >= 1


def test_a_relaxed_worker_looks_like_its_peers_never_cheaper_than_all():
    """While a worker paused, the others took its load and answer in 60 ms: once
    relaxed, its estimate is their median, not its own typical 30 ms, so processes
    relaxing it together do not all send it every task at once."""
    clock = FakeClock()
    latency = {"a": 0.03, "b": 0.03, "c": 0.03}

    def handler(req: FakeRequest) -> Any:
        clock.advance(latency[req.worker_id])
        return json_response(200, {"worker_id": req.worker_id})

    net = FakeNetwork(handler)
    with WorkerPool(config(("a", "b", "c")), transport_factory=net.factory, clock=clock) as pool:
        served(pool, 48)
        latency.update(a=1.0, b=0.06, c=0.06)
        while pool.execute(OK)["worker_id"] != "a":
            pass
        latency["a"] = 0.03
        served(pool, 12)  # b and c answer in 60 ms now
        clock.advance(1.0)
        served(pool, 1)  # the hold has passed: a relaxes at this selection
        estimates = {r["id"]: r["balancing"]["latency_estimate_ms"] for r in pool.workers()}
    assert 45 < estimates["a"] < 200
