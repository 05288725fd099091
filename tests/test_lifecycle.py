"""A pool never hangs and never leaks a slot: close() from hooks and fallbacks, hooks that
reload, and interrupts at every step of a task."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import npu_sync._admission
import npu_sync._life
import npu_sync.protocols
from npu_sync import TaskFailed, TaskRejected, WorkerPool
from npu_sync._deadletter import MemoryDeadLetterStore
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    RetryConfig,
    worker_config,
)
from npu_sync.events import (
    AttemptFinished,
    BreakerStateChanged,
    ConfigReloaded,
    RetryScheduled,
    TaskDeadLettered,
    TaskFallback,
    TaskRejectedEvent,
    TaskStarted,
    TaskSucceeded,
    WorkerHealthChanged,
)
from npu_sync.testing import FakeClock, FakeNetwork, json_response

A = worker_config("a", "http://127.0.0.1:9701", priority=1)
B = worker_config("b", "http://127.0.0.1:9702", priority=2)
C = worker_config("c", "http://127.0.0.1:9703", priority=3)


def config(*workers, fail_max: int = 5, retries: int = 3, health: bool = False, **kw) -> PoolConfig:
    return PoolConfig(
        workers=tuple(workers),
        health=HealthConfig(enabled=health, interval=3600, timeout=1),
        circuit_breaker=BreakerConfig(fail_max=fail_max, reset_timeout=30, max_reset_timeout=60),
        retry=RetryConfig(max_retries=retries, backoff_initial=0.01, backoff_max=0.05),
        **kw,
    )


def ok(req):
    if req.path == "/health":
        return json_response(200, {"status": "healthy"})
    return json_response(200, {"by": req.worker_id})


def status(code: int):
    def handler(req):
        if req.path == "/health":
            return json_response(200, {"status": "healthy"})
        return json_response(code, {"detail": f"forced {code}"})

    return handler


def npu_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("npu-sync")}


def assert_fully_closed(pool: WorkerPool, net: FakeNetwork, before: set[threading.Thread]) -> None:
    """Closed, every connection closed, every thread the pool started ended (within 10 s:
    the last task to end may still be releasing the pool on a pool thread)."""
    assert pool.closed
    deadline = time.monotonic() + 10
    while not all(t.closed for t in net.transports()):  # closed after the threads stop
        assert time.monotonic() < deadline, "the pool was never released"
        threading.Event().wait(0.01)
    started = npu_threads() - before
    for thread in started:
        thread.join(10)
    assert [t.name for t in started if t.is_alive()] == []
    assert [t.worker_id for t in net.transports() if not t.closed] == []


def run_bounded(target: Callable[[], Any], timeout: float = 10) -> list[tuple[str, Any]]:
    """Run ``target`` on a thread; fail if it has not ended within ``timeout`` seconds."""
    outcome: list[tuple[str, Any]] = []

    def run() -> None:
        try:
            outcome.append(("result", target()))
        except BaseException as exc:
            outcome.append(("raised", exc))

    thread = threading.Thread(target=run, name="scenario")
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "the scenario hung"
    return outcome


# -- B1: close() from hooks and fallbacks ----------------------------------------------------


def local_answer() -> dict:
    return {"local": True}


SCENARIOS: dict[str, tuple[dict[str, Callable[..., Any]], Any, Any]] = {
    # name: (routes, fallback, expected outcome: a result or an exception type)
    "succeeds": ({"a": ok}, None, {"by": "a"}),
    "retried": ({"a": status(503), "b": ok}, None, {"by": "b"}),
    "dead-lettered": ({"a": status(503), "b": status(503)}, None, TaskFailed),
    "falls-back": ({"a": status(503), "b": status(503)}, local_answer, {"local": True}),
    # Refused by both: a second worker's refusal makes it the task's.
    "rejected": ({"a": status(422), "b": status(422)}, None, TaskRejected),
}

HOOK_CASES = [
    (TaskStarted, "succeeds"),
    (AttemptFinished, "succeeds"),
    (TaskSucceeded, "succeeds"),
    (RetryScheduled, "retried"),
    (BreakerStateChanged, "retried"),
    (TaskDeadLettered, "dead-lettered"),
    (TaskFallback, "falls-back"),
    (TaskRejectedEvent, "rejected"),
]


def check_outcome(outcome: list[tuple[str, Any]], expected: Any) -> None:
    assert len(outcome) == 1, outcome
    ((how, value),) = outcome
    if isinstance(expected, type):
        assert how == "raised" and type(value) is expected, outcome
    else:
        assert (how, value) == ("result", expected)


@pytest.mark.parametrize("mode", ["execute", "submit"])
@pytest.mark.parametrize(
    ("event_type", "scenario"), HOOK_CASES, ids=[e.__name__ for e, _ in HOOK_CASES]
)
def test_close_from_a_hook_lets_the_task_end_then_closes_everything(event_type, scenario, mode):
    """close() in a hook returns; the task ends once; threads stop; connections close."""
    before = npu_threads()
    routes, fallback, expected = SCENARIOS[scenario]
    net = FakeNetwork(ok)
    for worker_id, handler in routes.items():
        net.route(worker_id, handler)
    pool = WorkerPool(
        config(A, B, fail_max=1, retries=1, health=True), transport_factory=net.factory
    )
    calls: list[str] = []

    def hook(event: object) -> None:
        if isinstance(event, event_type) and not calls:
            calls.append("closing")
            pool.close()
            calls.append("returned")

    pool.add_hook(hook)

    def task() -> Any:
        if mode == "execute":
            return pool.execute({"x": 1}, fallback=fallback)
        return pool.submit({"x": 1}, fallback=fallback).result(10)

    check_outcome(run_bounded(task), expected)
    assert calls == ["closing", "returned"]
    assert_fully_closed(pool, net, before)


@pytest.mark.parametrize("mode", ["execute", "submit"])
def test_close_from_a_fallback_returns_its_result_and_closes_everything(mode):
    """A fallback that closes the pool still answers the task; then the pool is released."""
    before = npu_threads()
    net = FakeNetwork(status(503))
    pool = WorkerPool(config(A, B, retries=1, health=True), transport_factory=net.factory)

    def fallback() -> dict:
        pool.close()
        return {"local": True}

    def task() -> Any:
        if mode == "execute":
            return pool.execute({"x": 1}, fallback=fallback)
        return pool.submit({"x": 1}, fallback=fallback).result(10)

    check_outcome(run_bounded(task), {"local": True})
    assert_fully_closed(pool, net, before)


def test_close_from_a_health_hook_returns_and_health_checks_go_on_until_the_task_ends():
    """close() on the health thread returns at once; checks continue while a task runs."""
    before = npu_threads()
    gate, started, sick, closed, checked = (threading.Event() for _ in range(5))
    checks_after_close: list[float] = []

    def slow(req):
        if req.path == "/models":  # read with each passed check: no task, no list
            return json_response(404, {"detail": "Not Found"})
        if req.path == "/health":
            if closed.is_set():
                checks_after_close.append(req.timeout)
                if len(checks_after_close) >= 2:
                    checked.set()
            return json_response(200, {"status": "healthy"})
        started.set()
        gate.wait(10)
        return json_response(200, {"by": "a"})

    def b(req):
        if req.path == "/health" and sick.is_set():
            return json_response(503, {"status": "unhealthy"})
        return ok(req)

    net = FakeNetwork()
    net.route("a", slow)
    net.route("b", b)
    cfg = PoolConfig(
        workers=(A, B), health=HealthConfig(interval=0.02, timeout=1, unhealthy_threshold=1)
    )
    pool = WorkerPool(cfg, transport_factory=net.factory)
    threads_of_hook: list[str] = []

    def hook(event: object) -> None:
        if isinstance(event, WorkerHealthChanged) and not event.healthy:
            threads_of_hook.append(threading.current_thread().name)
            pool.close()
            closed.set()

    pool.add_hook(hook)
    try:
        running = pool.submit({"x": 1})
        assert started.wait(10)
        sick.set()
        assert closed.wait(10), "close() on the health thread did not return"
        assert threads_of_hook == ["npu-sync-health"]
        assert not running.done() and pool.closed
        assert checked.wait(10), "health checks stopped while a task was still running"
        assert not running.done()
    finally:
        gate.set()
    assert running.result(10) == {"by": "a"}
    assert_fully_closed(pool, net, before)


def test_close_from_a_callback_of_a_submitted_future_releases_the_pool():
    """close() in a future's done-callback, run on a pool thread, releases everything."""
    before = npu_threads()
    gate = threading.Event()

    def gated(req):
        if req.path != "/health":
            gate.wait(10)
        return ok(req)

    net = FakeNetwork(gated)
    pool = WorkerPool(config(A, health=True), transport_factory=net.factory)
    calls: list[object] = []
    done = threading.Event()

    def callback(future: object) -> None:
        try:
            pool.close()
            calls.append(threading.current_thread().name)
        except BaseException as exc:
            calls.append(exc)
        done.set()

    future = pool.submit({"x": 1})
    future.add_done_callback(callback)
    gate.set()
    assert done.wait(10)
    assert future.result(0) == {"by": "a"}
    assert len(calls) == 1 and str(calls[0]).startswith("npu-sync-task"), calls
    assert_fully_closed(pool, net, before)


def test_close_after_a_hook_closed_the_pool_still_waits_for_the_task_and_releases(request):
    """A second close(), from outside the task, blocks until the pool is really released."""
    before = npu_threads()
    gate, started = threading.Event(), threading.Event()

    def slow(req):
        if req.path == "/health":
            return json_response(200, {"status": "healthy"})
        started.set()
        gate.wait(10)
        return json_response(200, {"by": "a"})

    net = FakeNetwork()
    net.route("a", slow)
    pool = WorkerPool(config(A, health=True), transport_factory=net.factory)
    pool.add_hook(lambda event: pool.close() if isinstance(event, TaskStarted) else None)
    running = pool.submit({"x": 1})
    assert started.wait(10)
    assert pool.closed
    seen_on_return: list[object] = []
    request.addfinalizer(gate.set)  # a failing check must not leave the task blocked

    def close_again() -> None:
        pool.close()
        seen_on_return.append(running.done())
        seen_on_return.append(all(t.closed for t in net.transports()))

    closer = threading.Thread(target=close_again)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive(), "close() returned while a task was still running"
    gate.set()
    closer.join(10)
    assert not closer.is_alive()
    assert seen_on_return == [True, True]
    assert running.result(0) == {"by": "a"}
    assert_fully_closed(pool, net, before)


# -- B2: hooks that reload ----------------------------------------------------------------


def apply_from_hook(pool: WorkerPool, action: str) -> None:
    if action == "reload":
        pool.reload(config(A, B, C))
    elif action == "reload-file":
        pool.reload()
    else:
        pool.add_worker(C)


@pytest.mark.parametrize("action", ["reload", "add_worker"])
def test_a_reload_hook_may_reload_or_add_a_worker(action):
    """A ConfigReloaded hook calling reload() or add_worker() does not deadlock."""
    net = FakeNetwork(ok)
    pool = WorkerPool(config(A), transport_factory=net.factory)
    fired: list[object] = []

    def hook(event: object) -> None:
        if isinstance(event, ConfigReloaded) and not fired:
            fired.append(event)
            apply_from_hook(pool, action)

    pool.add_hook(hook)
    outcome = run_bounded(lambda: pool.reload(config(A, B)))
    assert outcome[0][0] == "result", outcome
    assert len(fired) == 1
    assert sorted(w["id"] for w in pool.workers()) == ["a", "b", "c"]
    run_bounded(pool.close)
    assert pool.closed


YAML = """
npu_workers:
  workers:
{workers}
  health: {{enabled: false}}
"""


def yaml_for(*workers) -> str:
    return YAML.format(
        workers="\n".join(
            f"    - {{id: {w.id}, url: '{w.url}', priority: {w.priority}}}" for w in workers
        )
    )


@pytest.mark.parametrize("action", ["reload", "reload-file", "add_worker"])
def test_a_hook_on_a_file_reload_may_reload_or_add_a_worker(tmp_path, action):
    """On the watcher's thread, a ConfigReloaded hook may reload or add a worker."""
    before = npu_threads()
    path = tmp_path / "pool.yaml"
    path.write_text(yaml_for(A))
    net = FakeNetwork(ok)
    pool = WorkerPool.from_yaml(path, watch=True, poll_interval=0.1, transport_factory=net.factory)
    done = threading.Event()
    fired: list[str] = []

    def hook(event: object) -> None:
        if isinstance(event, ConfigReloaded) and not fired:
            fired.append(threading.current_thread().name)
            if action == "reload-file":
                path.write_text(yaml_for(A, B, C))
            apply_from_hook(pool, action)
            done.set()

    pool.add_hook(hook)
    path.write_text(yaml_for(A, B))
    assert done.wait(10), "the hook on the file reload never finished"
    assert fired == ["npu-sync-reload"]
    assert sorted(w["id"] for w in pool.workers()) == ["a", "b", "c"]
    run_bounded(pool.close)
    assert_fully_closed(pool, net, before)


# -- B3: interrupts ------------------------------------------------------------------------


class InterruptingClock(FakeClock):
    """A FakeClock whose monotonic() or sleep() raises KeyboardInterrupt once, when armed."""

    def __init__(self) -> None:
        super().__init__()
        self.countdown: int | None = None
        self.interrupt_sleep = False

    def monotonic(self) -> float:
        if self.countdown is not None:
            self.countdown -= 1
            if self.countdown == 0:
                self.countdown = None
                raise KeyboardInterrupt("injected into clock.monotonic()")
        return super().monotonic()

    def sleep(self, seconds: float) -> None:
        if self.interrupt_sleep:
            self.interrupt_sleep = False
            raise KeyboardInterrupt("injected into clock.sleep()")
        super().sleep(seconds)


class InterruptingStore(MemoryDeadLetterStore):
    armed = False

    def add(self, record: Any) -> None:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt("injected into the dead-letter store")
        super().add(record)


class Rig:
    """A pool whose task path can be interrupted at one chosen step."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.clock = InterruptingClock()
        self.net = FakeNetwork(ok)
        self.store = InterruptingStore()
        self.check_interrupts = False
        self.pool = WorkerPool(
            config(A, B, fail_max=1),
            transport_factory=self.net.factory,
            clock=self.clock,
            dead_letter_store=self.store,
            result_check=self.check,
        )

    def check(self, result: object) -> None:
        if self.check_interrupts:
            raise KeyboardInterrupt("injected into the result check")

    def open_a_then_wait_out_its_reset(self) -> None:
        """Leave worker a's breaker due for its half-open trial; b disabled."""
        self.pool.remove_worker("b")
        self.net.route("a", status(500))
        with pytest.raises(TaskFailed):
            self.pool.execute({"x": 1})
        assert self.rows()["a"]["breaker"]["state"] == "open"
        self.clock.advance(30)
        self.net.route("a", ok)

    def rows(self) -> dict[str, dict]:
        return {w["id"]: w for w in self.pool.workers()}

    def assert_no_slot_held(self) -> None:
        tasks = self.pool.stats()["tasks"]
        assert (tasks["in_flight"], tasks["waiting"], tasks["active"]) == (0, 0, 0)
        assert {w["id"]: w["in_flight"] for w in self.pool.workers()} == dict.fromkeys(
            self.rows(), 0
        )


def interrupt_clock_at(n: int):
    def arm(rig: Rig) -> None:
        rig.clock.countdown = n

    return arm


def interrupt_transport(rig: Rig) -> None:
    rig.net.route("a", lambda req: KeyboardInterrupt("injected into the transport"))


def interrupt_classify(rig: Rig) -> None:
    def raising(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt("injected into classify_response")

    rig.monkeypatch.setattr(npu_sync.protocols, "classify_response", raising)


def interrupt_result_check(rig: Rig) -> None:
    rig.check_interrupts = True


def interrupt_breaker_hook(rig: Rig) -> None:
    def hook(event: object) -> None:
        if isinstance(event, BreakerStateChanged):
            rig.pool.remove_hook(hook)
            raise KeyboardInterrupt("injected into a hook")

    rig.pool.add_hook(hook)


def undo(rig: Rig) -> None:
    rig.monkeypatch.undo()
    rig.net.route("a", ok)
    rig.check_interrupts = False
    rig.clock.countdown = None


TRIAL_STEPS = {
    **{f"clock-call-{n}": interrupt_clock_at(n) for n in range(1, 9)},
    "transport": interrupt_transport,
    "classify": interrupt_classify,
    "result-check": interrupt_result_check,
    "breaker-hook": interrupt_breaker_hook,
}


@pytest.mark.parametrize("step", list(TRIAL_STEPS))
def test_an_interrupted_half_open_trial_gives_back_its_slot_and_its_trial(monkeypatch, step):
    """KeyboardInterrupt at any step of a trial: no slot held, the next task is the trial."""
    rig = Rig(monkeypatch)
    with rig.pool as pool:
        rig.open_a_then_wait_out_its_reset()
        TRIAL_STEPS[step](rig)
        try:
            result = pool.execute({"x": 1})
        except KeyboardInterrupt:
            pass
        else:  # the step came after the task's last clock call: nothing to interrupt
            assert step.startswith("clock-call-") and result == {"by": "a"}
        undo(rig)
        rig.assert_no_slot_held()
        assert pool.stats()["workers"]["available"] == 1  # a admits a trial again
        assert pool.execute({"x": 1}, timeout=1) == {"by": "a"}
        assert rig.rows()["a"]["breaker"]["state"] == "closed"


def test_an_interrupted_backoff_sleep_holds_no_slot(monkeypatch):
    """KeyboardInterrupt while backing off between attempts leaves every slot free."""
    rig = Rig(monkeypatch)
    with rig.pool as pool:
        rig.net.route("a", status(503))
        rig.clock.interrupt_sleep = True
        with pytest.raises(KeyboardInterrupt):
            pool.execute({"x": 1})
        rig.assert_no_slot_held()
        assert pool.execute({"x": 1}) == {"by": "b"}


def test_an_interrupted_dead_letter_write_holds_no_slot(monkeypatch):
    """KeyboardInterrupt while storing the dead letter leaves every slot free."""
    rig = Rig(monkeypatch)
    with rig.pool as pool:
        rig.net.route("a", status(503))
        rig.net.route("b", status(503))
        rig.store.armed = True
        with pytest.raises(KeyboardInterrupt):
            pool.execute({"x": 1})
        rig.assert_no_slot_held()
        rig.net.route("a", ok)
        rig.clock.advance(30)  # both breakers (fail_max 1) admit their trial again
        assert pool.execute({"x": 1}) == {"by": "a"}


class _InterruptedOnHandOver(threading.Condition):
    """A waiter's condition that is interrupted right after it was notified."""

    armed = True

    def wait(self, timeout: float | None = None) -> bool:
        notified = super().wait(timeout)
        if notified and _InterruptedOnHandOver.armed:
            _InterruptedOnHandOver.armed = False
            raise KeyboardInterrupt("injected as a waiter was handed a slot")
        return notified


def test_an_interrupt_as_a_waiter_is_handed_a_slot_leaks_nothing(monkeypatch):
    """A waiter interrupted just as a slot was handed to it gives the slot back."""
    gate, started = threading.Event(), threading.Event()

    def slow(req):
        started.set()
        gate.wait(10)
        return ok(req)

    net = FakeNetwork()
    net.route("a", slow)
    cfg = PoolConfig(
        workers=(worker_config("a", A.url, max_concurrent=1),),
        health=HealthConfig(enabled=False),
    )
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        busy = pool.submit({"x": 0})
        assert started.wait(10)
        conditions = type("threading", (), {"Condition": _InterruptedOnHandOver})
        monkeypatch.setattr(npu_sync._admission, "threading", conditions)
        _InterruptedOnHandOver.armed = True

        def release_once_waiting() -> None:
            while pool.stats()["tasks"]["waiting"] < 1:
                threading.Event().wait(0.001)
            gate.set()

        releaser = threading.Thread(target=release_once_waiting)
        releaser.start()
        with pytest.raises(KeyboardInterrupt):
            pool.execute({"x": 1}, timeout=10)
        releaser.join()
        assert busy.result(10) == {"by": "a"}
        assert pool.stats()["tasks"]["in_flight"] == 0
