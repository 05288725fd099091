"""Unit tests of priority classes: order of service, reserved capacity, aging, reloads."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from npu_sync import ConfigError, InvalidTask, Task, WorkerPool
from npu_sync._admission import Dispatcher, Lease
from npu_sync._balancing.selector import Selector
from npu_sync._breaker import WorkerBreaker
from npu_sync._priority import PriorityClasses
from npu_sync._worker import Worker
from npu_sync.config import (
    BreakerConfig,
    ClassConfig,
    HealthConfig,
    PoolConfig,
    PriorityConfig,
    worker_config,
)
from npu_sync.testing import FakeClock, FakeNetwork, json_response
from tests.stubs import NoTransport

BREAKER = BreakerConfig(fail_max=1, reset_timeout=30, max_reset_timeout=600)


def make_worker(clock: FakeClock, worker_id: str, capacity: int = 1) -> Worker:
    cfg = worker_config(worker_id, "http://127.0.0.1:9000", max_concurrent=capacity)
    breaker = WorkerBreaker(worker_id, BREAKER, clock=clock)
    return Worker(cfg, NoTransport(), breaker, NoTransport())  # type: ignore[arg-type]


def classes(*reserves: float, aging: float = 0.0, default: str = "standard") -> PriorityConfig:
    names = ("interactive", "standard", "batch")
    shares = (*reserves, 0.0, 0.0, 0.0)[:3]
    return PriorityConfig(
        classes=tuple(ClassConfig(n, r) for n, r in zip(names, shares, strict=True)),
        default=default,
        aging=aging,
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


class Waiting:
    """``acquire_or_reason`` for a task of class ``priority`` on a thread of its own."""

    def __init__(self, dispatcher: Dispatcher, priority: str | None, deadline: float) -> None:
        self.dispatcher = dispatcher
        self.priority = priority
        self.result: Any = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(deadline,))

    def _run(self, deadline: float) -> None:
        try:
            self.result = self.dispatcher.acquire_or_reason((), deadline, priority=self.priority)
        finally:
            self.done.set()


@pytest.fixture
def waiting() -> Iterator[Any]:
    started: list[Waiting] = []

    def start(dispatcher: Dispatcher, priority: str | None, clock: FakeClock) -> Waiting:
        before = dispatcher.waiting
        w = Waiting(dispatcher, priority, clock.monotonic() + 3600)
        w.thread.start()
        until(lambda: dispatcher.waiting == before + 1 or w.done.is_set())
        assert not w.done.is_set(), f"expected to wait, got {w.result!r}"
        started.append(w)
        return w

    yield start
    for w in started:
        if not w.done.is_set():
            w.dispatcher.clock.advance(7200)  # type: ignore[attr-defined]
            with w.dispatcher.lock:
                w.dispatcher.wake_all_locked()
        w.thread.join(5)
        assert not w.thread.is_alive()


def until(condition: Any) -> None:
    for _ in range(5000):
        if condition():
            return
        threading.Event().wait(0.001)
    raise AssertionError("condition not reached in 5 s")


def free(dispatcher: Dispatcher, lease: Lease) -> None:
    """An attempt ends: its slot goes back and to the next waiter."""
    with dispatcher.lock:
        lease.worker.in_flight -= 1
        lease.worker.breaker.record_success(lease.trial)
        dispatcher.release_worker_locked(lease.worker, dispatcher.clock.monotonic())


def dispatcher_with(clock: FakeClock, config: PriorityConfig, capacity: int = 1) -> Dispatcher:
    dispatcher = Dispatcher(clock, Selector())
    dispatcher.set_workers([make_worker(clock, "a", capacity)])
    with dispatcher.lock:
        dispatcher.set_classes_locked(config)
    return dispatcher


def take(dispatcher: Dispatcher, priority: str | None = None) -> Lease:
    now = dispatcher.clock.monotonic()
    got = dispatcher.acquire_or_reason((), now + 3600, priority=priority)
    assert isinstance(got, Lease), got
    return got


# -- the classes ------------------------------------------------------------------------


def test_ranks_follow_the_configured_order_and_none_is_the_default() -> None:
    """Highest first; a task naming no class is of priority.default."""
    table = PriorityClasses(classes())
    assert [table.rank(n) for n in ("interactive", "standard", "batch")] == [0, 1, 2]
    assert table.rank(None) == 1
    assert PriorityClasses(classes(default="batch")).rank(None) == 2


def test_an_unknown_class_is_a_clear_error_naming_it() -> None:
    """The message names the class asked for and the classes there are."""
    with pytest.raises(InvalidTask, match="task priority 'urgent' is not a class of this pool"):
        PriorityClasses(classes()).rank("urgent")
    with pytest.raises(InvalidTask, match="interactive, standard, batch"):
        PriorityClasses(classes()).rank("urgent")


def test_a_task_names_its_class_as_a_string() -> None:
    """Task(priority=3) or an empty name is refused when the task is built."""
    with pytest.raises(InvalidTask, match=r"task priority must be a class name.*got 3"):
        Task({}, priority=3)  # type: ignore[arg-type]
    with pytest.raises(InvalidTask, match="got ''"):
        Task({}, priority="")
    assert Task({}, priority="batch").priority == "batch"


def test_aging_moves_a_task_up_one_class_per_period() -> None:
    """With aging 5 s, batch waits 5 s to count as standard and 10 s as interactive."""
    table = PriorityClasses(classes(aging=5.0))
    assert [table.effective(2, w) for w in (0, 4.9, 5.0, 9.9, 10.0, 60)] == [2, 2, 1, 1, 0, 0]
    assert PriorityClasses(classes(aging=0)).effective(2, 1e6) == 2


def test_bad_class_settings_are_refused_naming_the_key() -> None:
    """Duplicate names, reserves of 1 or more, an unknown default: ConfigError."""
    with pytest.raises(ConfigError, match="names must be distinct, got a twice"):
        PriorityConfig(classes=(ClassConfig("a"), ClassConfig("a")), default="a")
    with pytest.raises(ConfigError, match=r"reserves must add up to less than 1, got 1\.2"):
        PriorityConfig(classes=(ClassConfig("a", 0.6), ClassConfig("b", 0.6)), default="a")
    with pytest.raises(ConfigError, match=r"priority.default: must be one of the classes \(a\)"):
        PriorityConfig(classes=(ClassConfig("a"),), default="b")


# -- order of service -------------------------------------------------------------------


def test_a_higher_class_waiting_is_served_first(clock: FakeClock, waiting: Any) -> None:
    """Batch queued first, interactive after: the freed slot goes to interactive."""
    dispatcher = dispatcher_with(clock, classes())
    held = take(dispatcher)
    batch = waiting(dispatcher, "batch", clock)
    interactive = waiting(dispatcher, "interactive", clock)
    free(dispatcher, held)
    assert interactive.done.wait(5) and isinstance(interactive.result, Lease)
    assert not batch.done.is_set()
    free(dispatcher, interactive.result)
    assert batch.done.wait(5) and isinstance(batch.result, Lease)


def test_within_a_class_the_queue_is_fifo(clock: FakeClock, waiting: Any) -> None:
    """Two batch tasks and an interactive one: interactive, then the batch tasks in order."""
    dispatcher = dispatcher_with(clock, classes())
    held = take(dispatcher)
    first = waiting(dispatcher, "batch", clock)
    second = waiting(dispatcher, "batch", clock)
    top = waiting(dispatcher, "interactive", clock)
    order = []
    lease = held
    for _ in range(3):
        free(dispatcher, lease)
        until(lambda: sum(w.done.is_set() for w in (first, second, top)) == len(order) + 1)
        done = next(w for w in (top, first, second) if w.done.is_set() and w not in order)
        order.append(done)
        lease = done.result
    free(dispatcher, lease)
    assert order == [top, first, second]


def test_a_batch_task_is_not_starved_by_a_stream_of_interactive_ones(
    clock: FakeClock, waiting: Any
) -> None:
    """Aging 5 s: after waiting 10 s the batch task comes before a newer interactive one."""
    dispatcher = dispatcher_with(clock, classes(aging=5.0))
    lease = take(dispatcher)
    batch = waiting(dispatcher, "batch", clock)
    # Interactive tasks keep arriving; each freed slot goes to one of them.
    for _ in range(3):
        newer = waiting(dispatcher, "interactive", clock)
        free(dispatcher, lease)
        assert newer.done.wait(5) and isinstance(newer.result, Lease)
        assert not batch.done.is_set()
        lease = newer.result
    clock.advance(10.0)  # the batch task has waited two periods: it counts as interactive
    newer = waiting(dispatcher, "interactive", clock)
    free(dispatcher, lease)
    assert batch.done.wait(5) and isinstance(batch.result, Lease)
    assert not newer.done.is_set()
    free(dispatcher, batch.result)
    assert newer.done.wait(5)


def test_one_class_waiting_costs_no_ranking(clock: FakeClock, waiting: Any) -> None:
    """Tasks naming no class keep the plain FIFO path: the ranked pass is never taken."""
    dispatcher = dispatcher_with(clock, classes())
    held = take(dispatcher)
    calls: list[float] = []
    ranked = dispatcher._serve_ranked
    dispatcher._serve_ranked = lambda now: (calls.append(now), ranked(now))[1]  # type: ignore[method-assign]
    first, second = waiting(dispatcher, None, clock), waiting(dispatcher, None, clock)
    free(dispatcher, held)
    assert first.done.wait(5) and not second.done.is_set()
    free(dispatcher, first.result)
    assert second.done.wait(5)
    free(dispatcher, second.result)
    assert calls == []


# -- reserved capacity ------------------------------------------------------------------


def test_batch_cannot_take_the_capacity_interactive_reserves(
    clock: FakeClock, waiting: Any
) -> None:
    """4 slots, interactive reserving 0.25: batch fills 3 and waits; interactive takes the 4th."""
    dispatcher = dispatcher_with(clock, classes(0.25), capacity=4)
    batch = [take(dispatcher, "batch") for _ in range(3)]
    blocked = waiting(dispatcher, "batch", clock)
    top = take(dispatcher, "interactive")
    assert not blocked.done.is_set()
    free(dispatcher, top)  # serves the queue on this thread: the slot is not batch's
    assert dispatcher.waiting == 1 and blocked.result is None
    free(dispatcher, batch[0])  # a slot batch may use: served
    assert blocked.done.wait(5) and isinstance(blocked.result, Lease)
    for lease in (*batch[1:], blocked.result):
        free(dispatcher, lease)


def test_a_standard_task_may_use_what_batch_reserves_but_not_interactive(
    clock: FakeClock, waiting: Any
) -> None:
    """Reserves protect a class from the ones below it only."""
    dispatcher = dispatcher_with(clock, classes(0.25, 0.0, 0.5), capacity=4)
    leases = [take(dispatcher, "standard") for _ in range(3)]  # batch's reserve too
    blocked = waiting(dispatcher, "standard", clock)  # the 4th slot is interactive's
    leases.append(take(dispatcher, "interactive"))
    # Trunk reservation: standard may take a slot only while more than interactive's
    # one slot stays free, whoever fills the rest.
    free(dispatcher, leases.pop(0))  # serves the queue on this thread: nobody taken
    assert dispatcher.waiting == 1 and blocked.result is None
    free(dispatcher, leases.pop(0))
    assert blocked.done.wait(5) and isinstance(blocked.result, Lease)
    for lease in (*leases, blocked.result):
        free(dispatcher, lease)


def test_an_aged_batch_task_may_use_the_reserve(clock: FakeClock, waiting: Any) -> None:
    """Reserve kept free, batch waiting: once it has aged to the top class, it takes the
    reserved slot without any release to wake it."""
    dispatcher = dispatcher_with(clock, classes(0.5, aging=1.0), capacity=2)
    held = take(dispatcher, "batch")
    blocked = waiting(dispatcher, "batch", clock)
    clock.advance(2.0)
    assert blocked.done.wait(5) and isinstance(blocked.result, Lease)
    free(dispatcher, held)
    free(dispatcher, blocked.result)


def held_answers() -> tuple[threading.Semaphore, threading.Event, Any]:
    """A worker's answer held until ``gate`` is set; ``entered`` counts the requests in."""
    entered = threading.Semaphore(0)
    gate = threading.Event()

    def held(req: Any) -> Any:
        entered.release()
        gate.wait(10)
        return json_response(200, {"ok": True})

    return entered, gate, held


def test_a_batch_task_that_prefers_a_worker_keeps_out_of_the_reserve_too() -> None:
    """4 slots, standard and interactive reserving 0.25 each: two batch tasks in flight
    on a fill batch's share. A third that prefers a, which still has room, waits like
    any batch task: its preference is judged by its own class's ceiling, not the
    default class's (which would let it take a third slot)."""
    from npu_sync.config import AdmissionConfig

    entered, gate, held = held_answers()

    net = FakeNetwork(default=held)
    cfg = PoolConfig(
        workers=(
            worker_config("a", "http://127.0.0.1:9100", max_concurrent=3, capabilities=["x"]),
            worker_config("b", "http://127.0.0.1:9101", max_concurrent=1),
        ),
        health=HealthConfig(enabled=False),
        admission=AdmissionConfig(deadline_aware=False),
        priority=classes(0.25, 0.25),
    )
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        dispatcher = pool._state.dispatcher
        try:
            first = [pool.submit(Task({"i": i}, priority="batch", prefers=["x"])) for i in (1, 2)]
            for _ in first:
                assert entered.acquire(timeout=10)
            late = pool.submit(Task({"i": 3}, priority="batch", prefers=["x"]))
            until(lambda: dispatcher.waiting == 1 or len(net.requests()) > 2)
            assert dispatcher.waiting == 1 and len(net.requests()) == 2
            assert sum(w.in_flight for w in pool._state.workers.values()) == 2
        finally:
            gate.set()
        for future in (*first, late):
            assert future.result(10) == {"ok": True}


def test_a_batch_task_naming_a_model_keeps_out_of_the_reserve_too() -> None:
    """As above, for the choice among the workers holding the task's model: a holds m
    (3 slots), b does not (1 slot); standard and interactive reserve 0.25 each of the 4.
    With two batch tasks for m in flight, a third waits, though a still has room: the
    model route judges it by batch's ceiling, not the default class's."""
    from npu_sync.config import AdmissionConfig
    from tests.modelkit import linux

    entered, gate, held = held_answers()

    net = FakeNetwork()
    net.route("a", linux(["m"], task=held))
    net.route("b", linux(["other"], task=held))
    cfg = PoolConfig(
        workers=(
            worker_config("a", "http://127.0.0.1:9100", max_concurrent=3),
            worker_config("b", "http://127.0.0.1:9101", max_concurrent=1),
        ),
        health=HealthConfig(enabled=False),
        admission=AdmissionConfig(deadline_aware=False),
        priority=classes(0.25, 0.25),
    )
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        pool.check_health()  # a holds m, b does not
        dispatcher = pool._state.dispatcher
        payload = {"model_id": "m", "input_text": "x"}
        try:
            first = [pool.submit(Task(dict(payload), priority="batch")) for _ in (1, 2)]
            for _ in first:
                assert entered.acquire(timeout=10)
            late = pool.submit(Task(dict(payload), priority="batch"))
            until(lambda: dispatcher.waiting == 1 or entered.acquire(blocking=False))
            assert dispatcher.waiting == 1
            assert sum(w.in_flight for w in pool._state.workers.values()) == 2
        finally:
            gate.set()
        for future in (*first, late):
            assert future.result(10) == {"ok": True}


# -- reloads ----------------------------------------------------------------------------


def test_a_reload_that_reorders_the_classes_serves_the_waiting_by_the_new_order(
    clock: FakeClock, waiting: Any
) -> None:
    """batch put above interactive while both wait: batch is served first."""
    dispatcher = dispatcher_with(clock, classes())
    held = take(dispatcher)
    interactive = waiting(dispatcher, "interactive", clock)
    batch = waiting(dispatcher, "batch", clock)
    reordered = PriorityConfig(
        classes=(ClassConfig("batch"), ClassConfig("interactive"), ClassConfig("standard")),
        default="standard",
    )
    with dispatcher.lock:
        dispatcher.set_classes_locked(reordered)
    free(dispatcher, held)
    assert batch.done.wait(5) and not interactive.done.is_set()
    free(dispatcher, batch.result)
    assert interactive.done.wait(5)
    free(dispatcher, interactive.result)


def test_a_task_whose_class_a_reload_removed_waits_as_the_default_class(
    clock: FakeClock, waiting: Any
) -> None:
    """'batch' gone: its waiting task counts as the default, ahead of a later standard one."""
    dispatcher = dispatcher_with(clock, classes())
    held = take(dispatcher)
    orphan = waiting(dispatcher, "batch", clock)
    later = waiting(dispatcher, "standard", clock)
    with dispatcher.lock:
        dispatcher.set_classes_locked(
            PriorityConfig(
                classes=(ClassConfig("interactive"), ClassConfig("standard")), default="standard"
            )
        )
    free(dispatcher, held)
    assert orphan.done.wait(5) and not later.done.is_set()
    free(dispatcher, orphan.result)
    assert later.done.wait(5)
    free(dispatcher, later.result)


# -- the pool ---------------------------------------------------------------------------


def test_the_pool_refuses_a_task_of_an_unknown_class_naming_it() -> None:
    """execute(Task(priority='urgent')) raises InvalidTask naming 'urgent'; nothing is sent."""
    net = FakeNetwork()
    net.route("a", lambda req: json_response(200, {"ok": True}))
    cfg = PoolConfig(
        workers=(worker_config("a", "http://127.0.0.1:9100"),), health=HealthConfig(enabled=False)
    )
    with WorkerPool(cfg, transport_factory=net.factory, clock=FakeClock()) as pool:
        with pytest.raises(InvalidTask, match="'urgent' is not a class of this pool"):
            pool.execute(Task({"x": 1}, priority="urgent"))
        assert pool.execute(Task({"x": 1}, priority="batch")) == {"ok": True}
    assert len(net.requests("a")) == 1


def test_the_yaml_section_reads_names_reserves_and_errors_with_key_paths() -> None:
    """`priority:` in a file: bare names or {name, reserve}; mistakes name their key."""
    from npu_sync.config import parse_config

    cfg = parse_config(
        {
            "npu_workers": {
                "priority": {
                    "classes": [{"name": "web", "reserve": 0.3}, "jobs"],
                    "default": "jobs",
                    "aging": 30,
                }
            }
        }
    )
    assert cfg.priority == PriorityConfig(
        classes=(ClassConfig("web", 0.3), ClassConfig("jobs")), default="jobs", aging=30.0
    )
    with pytest.raises(ConfigError) as caught:
        parse_config({"npu_workers": {"priority": {"classes": ["a", {"name": "b", "reserve": 2}]}}})
    assert caught.value.errors == (
        "npu_workers.priority.classes[1].reserve: must be >= 0 and < 1, got 2",
    )
    with pytest.raises(ConfigError, match=r"npu_workers\.priority\.default: must be one of"):
        parse_config({"npu_workers": {"priority": {"classes": ["a"], "default": "b"}}})


# -- where a class comes from -----------------------------------------------------------


def _pool(net: FakeNetwork) -> WorkerPool:
    net.route("a", lambda req: json_response(200, {"ok": True}))
    cfg = PoolConfig(
        workers=(worker_config("a", "http://127.0.0.1:9100"),), health=HealthConfig(enabled=False)
    )
    return WorkerPool(cfg, transport_factory=net.factory, clock=FakeClock())


def test_a_scope_gives_its_class_to_tasks_that_name_none() -> None:
    """Inside priority_scope('batch') a bare payload and a Task naming no class are batch."""
    from npu_sync.task import as_task, priority_scope

    with priority_scope("batch"):
        assert as_task({"x": 1}).priority == "batch"
        assert as_task(Task({"x": 1})).priority == "batch"
        assert as_task(Task({"x": 1}, priority="interactive")).priority == "interactive"
        with priority_scope("interactive"):
            assert as_task({}).priority == "interactive"
        assert as_task({}).priority == "batch"
    assert as_task({}).priority is None


def test_the_decorator_passes_its_class_to_the_pool() -> None:
    """@npu_task(pool, priority=...) runs its tasks in that class: an unknown one is refused."""
    from npu_sync import npu_task

    net = FakeNetwork()
    with _pool(net) as pool:

        @npu_task(pool, priority="batch")
        def known(text: str) -> dict[str, str]:
            return {"input_text": text}

        @npu_task(pool, priority="urgent")
        def unknown(text: str) -> dict[str, str]:
            return {"input_text": text}

        assert known("hi") == {"ok": True}
        with pytest.raises(InvalidTask, match="'urgent' is not a class of this pool"):
            unknown("hi")
    with pytest.raises(InvalidTask, match="task priority must be a class name"):
        npu_task(None, priority="")


def test_a_flask_route_gives_its_class_to_the_tasks_its_view_runs() -> None:
    """@npu_priority on a view: the tasks it runs take the class, checked by the pool."""
    flask = pytest.importorskip("flask")
    from npu_sync.flask import NpuSync, current_pool, npu_priority

    net = FakeNetwork()
    seen: list[str | None] = []
    with _pool(net) as pool:
        app = flask.Flask(__name__)
        app.testing = True  # the view's exception reaches the test
        NpuSync(app, pool=pool)
        original = pool._state.dispatcher.acquire_or_reason

        def spy(*args: Any, **kwargs: Any) -> Any:
            seen.append(kwargs.get("priority"))
            return original(*args, **kwargs)

        pool._state.dispatcher.acquire_or_reason = spy  # type: ignore[method-assign]

        @app.get("/search")
        @npu_priority("interactive")
        def search() -> Any:
            return current_pool().execute({"q": 1})

        @app.get("/report")
        @npu_priority("urgent")
        def report() -> Any:
            return current_pool().execute({"q": 2})

        client = app.test_client()
        assert client.get("/search").get_json() == {"ok": True}
        with pytest.raises(InvalidTask, match="'urgent' is not a class"):
            client.get("/report")
        pool.execute({"q": 3})
    assert seen == ["interactive", None]


# Attacks: the pass that hands freed capacity to waiting tasks of several classes does
# bounded work under the pool's lock however long the queue; aging wakes a waiter only
# while it can gain something; a map's tasks keep the class of the scope it started in.


WAITERS = 60


def _count(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    calls: list[int] = []
    original = getattr(PriorityClasses, name)

    def counted(self: PriorityClasses, *args: Any) -> Any:
        calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(PriorityClasses, name, counted)
    return calls


def test_a_saturated_fleet_ranks_nobody(
    clock: FakeClock, waiting: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every slot taken, 60 tasks of three classes waiting: a release pass (as every
    waiter woken at once runs) ranks no waiter, since nobody can be served."""
    dispatcher = dispatcher_with(clock, classes(aging=10.0), capacity=2)
    held = [take(dispatcher), take(dispatcher)]
    names = ("interactive", "standard", "batch")
    for i in range(WAITERS):
        waiting(dispatcher, names[i % 3], clock)
    ranked = _count(monkeypatch, "effective")
    with dispatcher.lock:
        dispatcher.release_locked(clock.monotonic())
    assert ranked == [] and dispatcher.waiting == WAITERS
    free(dispatcher, held[0])  # and a slot freed still goes to the highest class
    assert dispatcher.waiting == WAITERS - 1
    monkeypatch.undo()
    free(dispatcher, held[1])


def test_capacity_kept_for_a_class_above_is_judged_once_per_pass(
    clock: FakeClock, waiting: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot free but reserved for interactive, 60 batch tasks waiting: the pass stops at
    the first of them, since every task after it is of a class kept out too."""
    dispatcher = dispatcher_with(clock, classes(0.25), capacity=4)
    batch = [take(dispatcher, "batch") for _ in range(3)]  # the 4th slot is interactive's
    for _ in range(WAITERS):
        waiting(dispatcher, "batch", clock)
    judged = _count(monkeypatch, "may_take")
    with dispatcher.lock:
        dispatcher.release_locked(clock.monotonic())
    assert len(judged) == 1 and dispatcher.waiting == WAITERS
    monkeypatch.undo()
    top = take(dispatcher, "interactive")  # the reserve is still there for its class
    assert isinstance(top, Lease)
    for lease in (*batch, top):
        free(dispatcher, lease)


def test_a_waiter_stops_waking_for_aging_once_it_counts_as_the_top_class() -> None:
    """aging 0.001 s, batch waiting: it wakes at each step until it counts as
    interactive, then no more (it would spin a thousand times a second for nothing)."""
    ranks = PriorityClasses(classes(0.25, aging=0.001))
    batch = ranks.rank("batch")
    assert ranks.next_step(batch, 0.0) == pytest.approx(0.001)
    assert ranks.next_step(batch, 0.0015) == pytest.approx(0.0005)
    assert ranks.next_step(batch, 0.002) is None  # two steps up: interactive
    assert ranks.next_step(batch, 3600.0) is None
    assert ranks.next_step(ranks.rank("interactive"), 0.0) is None
    assert PriorityClasses(classes(0.0, aging=0.001)).next_step(batch, 0.0) is None  # no reserve
    assert PriorityClasses(classes(0.25, aging=0.0)).next_step(batch, 0.0) is None  # no aging


def test_an_aged_waiter_sleeps_until_its_deadline_not_an_aging_period(
    clock: FakeClock, waiting: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every slot taken, a batch task aged to the top class: the next time it sleeps
    it sleeps until a release or its deadline, not one more aging period."""
    import threading

    from npu_sync import _admission as admission

    slept: list[float | None] = []
    ours: list[object] = []

    class Recording(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            if self._lock in ours:  # type: ignore[attr-defined]
                slept.append(timeout)
            return super().wait(timeout)

    monkeypatch.setattr(admission.threading, "Condition", Recording)
    dispatcher = dispatcher_with(clock, classes(0.5, aging=1.0), capacity=2)
    ours.append(dispatcher.lock)
    held = [take(dispatcher, "interactive"), take(dispatcher, "interactive")]
    waiting(dispatcher, "batch", clock)
    until(lambda: len(slept) >= 1)
    assert slept[0] == pytest.approx(1.0)  # one aging period: it may gain a class
    clock.advance(5.0)  # counts as interactive now
    seen = len(slept)
    with dispatcher.lock:
        dispatcher.wake_all_locked()
    until(lambda: len(slept) > seen)
    last = slept[-1]
    assert last is not None and last > 3000  # its deadline: nothing more to gain
    for lease in held:
        free(dispatcher, lease)


def test_every_task_of_a_map_takes_the_class_of_the_scope_it_was_started_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch route streams map()'s results after the view returned (the scope left):
    the tasks fed in after the first window are batch too, not the default class."""
    from npu_sync import WorkerPool
    from npu_sync import _pool as pool_module
    from npu_sync.config import HealthConfig, PoolConfig, worker_config
    from npu_sync.task import as_task, priority_scope
    from npu_sync.testing import FakeNetwork

    seen: list[str | None] = []

    def recording(task: Any) -> Any:
        made = as_task(task)
        seen.append(made.priority)
        return made

    monkeypatch.setattr(pool_module, "as_task", recording)
    config = PoolConfig(
        workers=(worker_config("a", "http://127.0.0.1:9100"),),
        health=HealthConfig(enabled=False),
    )
    with WorkerPool(config, transport_factory=FakeNetwork().factory) as pool:
        with priority_scope("batch"):
            results = pool.map(({"i": i} for i in range(10)), window=2)
        assert len(list(results)) == 10  # consumed outside the scope, as a stream is
    assert seen == ["batch"] * 10
