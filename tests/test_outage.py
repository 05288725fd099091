"""Unit tests of the outage rule: which workers are worth waiting for, the clause that
names a fleet's state, and a pool that fails at once when its whole fleet is down."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import pytest

from npu_sync import WorkerPool
from npu_sync._admission import Dispatcher, Lease, Refusal
from npu_sync._balancing.selector import Selector
from npu_sync._breaker import WorkerBreaker
from npu_sync._health import HealthResult
from npu_sync._outage import (
    NEVER,
    NOW,
    credentials_news,
    describe,
    held_until,
    refuse_credentials,
)
from npu_sync._worker import Worker
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    PoolSettings,
    RetryConfig,
    TimeoutConfig,
    worker_config,
)
from npu_sync.errors import NoWorkerAvailable, TaskFailed
from npu_sync.testing import FakeClock, FakeNetwork, json_response
from npu_sync.transport import TransportError
from tests.stubs import NoTransport

BREAKER = BreakerConfig(fail_max=1, reset_timeout=30, max_reset_timeout=600)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make_worker(clock: FakeClock, worker_id: str, capacity: int = 1, **kw: Any) -> Worker:
    cfg = worker_config(worker_id, "http://127.0.0.1:9000", max_concurrent=capacity, **kw)
    return Worker(cfg, NoTransport(), WorkerBreaker(worker_id, BREAKER, clock=clock), NoTransport())


def open_breaker(worker: Worker) -> None:
    worker.breaker.record_failure(False)  # fail_max 1: open for 30 s


# -- held_until: whether waiting for a worker can help ------------------------------------


def test_a_busy_worker_or_one_whose_trial_is_in_flight_may_free_up_at_any_moment(clock):
    """Full, or half-open with another task's trial in flight: worth waiting for."""
    busy = make_worker(clock, "busy")
    busy.in_flight = 1
    assert held_until(busy, clock.monotonic())[0] == NOW
    trial = make_worker(clock, "trial")
    open_breaker(trial)
    clock.advance(30)
    assert trial.breaker.admit(clock.monotonic()) is True  # another task's trial
    assert held_until(trial, clock.monotonic())[0] == NOW


def test_an_open_breaker_holds_its_worker_until_its_reset_time_early_trial_or_not(clock):
    """An open breaker is held until its own reset time even when a passing health
    check could still grant it an early trial: the pool does not wait for news."""
    a = make_worker(clock, "a")
    open_breaker(a)
    assert not a.breaker.early_trial_used
    until, breaker_until, cooldown_until = held_until(a, clock.monotonic())
    assert until == breaker_until == clock.monotonic() + 30 and cooldown_until == NOW
    assert held_until(a, clock.monotonic(), shared_breakers=True)[0] == NOW


@pytest.mark.parametrize("state", ["unhealthy", "disabled", "draining", "hinted", "refused"])
def test_a_worker_that_is_down_is_held_until_news_comes(clock, state):
    """Unhealthy, disabled, draining (removed, or saying so itself), or refusing the
    credentials with health checks on: only news brings it back, so never waited for."""
    a = make_worker(clock, "a", enabled=state != "disabled")
    a.healthy = state != "unhealthy"
    a.draining = state == "draining"
    a.health.hinted_draining = state == "hinted"
    if state == "refused":
        a.refused_until = NEVER
    assert held_until(a, clock.monotonic())[0] == NEVER


def test_a_cool_down_and_credentials_tried_again_later_hold_until_their_time(clock):
    """A Retry-After cool-down, or refused credentials tried again later, hold the
    worker until that time, the later of the two."""
    a = make_worker(clock, "a")
    a.cooldown_until = clock.monotonic() + 5
    a.refused_until = clock.monotonic() + 20
    until, _, cooldown_until = held_until(a, clock.monotonic())
    assert until == clock.monotonic() + 20 and cooldown_until == clock.monotonic() + 5


# -- describe: one clause naming the state -----------------------------------------------


def test_the_clause_counts_every_worker_by_its_state(clock):
    """Three workers down: the clause names how many for each reason, and when the
    next breaker trial comes."""
    a, b, c = make_worker(clock, "a"), make_worker(clock, "b"), make_worker(clock, "c")
    open_breaker(a)
    clock.advance(10)
    open_breaker(b)
    c.healthy = False
    clause = describe([a, b, c], clock.monotonic())
    assert clause == "all 3 workers are down: 2 breakers open (next trial in 20s), 1 unhealthy"


def test_the_clause_for_one_worker_and_for_tried_or_lacking_workers(clock):
    """One worker: "the only worker"; workers already tried or without the task's model
    are named as such, not as down."""
    a = make_worker(clock, "a", enabled=False)
    assert describe([a], clock.monotonic()) == "the only worker is down: 1 disabled"
    b, c = make_worker(clock, "b"), make_worker(clock, "c")
    c.refused, c.refused_until = "credentials refused: HTTP 401: bad signature", NEVER
    clause = describe([a, b, c], clock.monotonic(), tried={"b", "c"})
    assert clause == (
        "2 of 3 workers are down, no other left to try: 1 disabled, "
        "1 refusing the credentials (c: HTTP 401: bad signature), 1 already tried"
    )
    clause = describe([b], clock.monotonic(), lacking={"b"}, model="m")
    assert clause == "no worker of 1 left to try: 1 without model 'm'"
    assert describe([], clock.monotonic()) == "the pool has no workers"


# -- admission: refused at once, or waiting while it may help -----------------------------


def test_unhealthy_workers_are_refused_at_once_not_waited_for(clock):
    """Every worker unhealthy: no worker to wait for, refused at once."""
    a, b = make_worker(clock, "a"), make_worker(clock, "b")
    a.healthy = b.healthy = False
    dispatcher = Dispatcher(clock, Selector([a, b]))
    deadline = clock.monotonic() + 10
    got: list[Lease | Refusal] = []
    call = threading.Thread(target=lambda: got.append(dispatcher.acquire_or_reason((), deadline)))
    call.start()
    call.join(5)
    if call.is_alive():  # it waits: end it, then fail
        clock.advance(20)
        with dispatcher.lock:
            dispatcher.wake_all_locked()
        call.join(5)
    assert got == [Refusal.NO_WORKER] and dispatcher.waiting == 0


def test_a_waiter_behind_another_tasks_trial_gets_the_worker_when_the_trial_succeeds(clock):
    """Another task holds the half-open trial: waiting may help, so the task waits, and
    gets the worker once the trial closes the breaker."""
    a = make_worker(clock, "a", capacity=4)
    open_breaker(a)
    clock.advance(30)
    dispatcher = Dispatcher(clock, Selector([a]))
    trial = dispatcher.acquire((), clock.monotonic() + 10)
    assert trial is not None and trial.trial
    got: list[Lease | Refusal] = []
    waiter = threading.Thread(
        target=lambda: got.append(dispatcher.acquire_or_reason((), clock.monotonic() + 10))
    )
    waiter.start()
    for _ in range(5000):
        if dispatcher.waiting:
            break
        threading.Event().wait(0.001)
    assert dispatcher.waiting == 1
    with dispatcher.lock:
        a.in_flight -= 1
        a.breaker.record_success(True)
        dispatcher.release_worker_locked(a, clock.monotonic())
    waiter.join(5)
    assert len(got) == 1 and isinstance(got[0], Lease) and got[0].worker is a


# -- the pool: all workers down ----------------------------------------------------------


HEALTHY = {"status": "healthy"}
ONE_CHECK = HealthConfig(enabled=False, unhealthy_threshold=1)
"""Health checks run only when a test calls check_health(); one failure counts."""


def make_pool(net: FakeNetwork, clock: FakeClock, *ids: str, **kw: Any) -> WorkerPool:
    workers = tuple(
        worker_config(w, f"http://127.0.0.1:{9100 + n}", max_concurrent=kw.pop("capacity", 8))
        for n, w in enumerate(ids)
    )
    config = PoolConfig(
        workers=workers,
        health=kw.pop("health", HealthConfig(enabled=False)),
        circuit_breaker=BreakerConfig(fail_max=2, reset_timeout=60, max_reset_timeout=600),
        retry=RetryConfig(max_retries=3, backoff_initial=0.01, backoff_max=0.05),
        timeouts=TimeoutConfig(task=120.0),
        pool=PoolSettings(max_queue_wait=30.0),
    )
    return WorkerPool(config, transport_factory=net.factory, clock=clock)


def settled(future: concurrent.futures.Future[Any], pool: WorkerPool, clock: FakeClock) -> Any:
    """The task's result or exception, which must come at once; a task still waiting
    after 5 s fails the test (its fake deadline is then moved past, so it ends)."""
    try:
        return future.result(5)
    except concurrent.futures.TimeoutError:
        clock.advance(10_000)
        with pool._state.lock:
            pool._state.dispatcher.wake_all_locked()
        raise AssertionError("the task waited for a worker instead of ending") from None


def refused(req: Any) -> TransportError:
    return TransportError("connect", f"{req.worker_id}: connection refused", sent=False)


def test_with_every_worker_down_a_task_fails_at_once_naming_the_state(clock):
    """Two breakers open and one worker unhealthy: the task ends without waiting
    pool.max_queue_wait, its dead letter stored first, the state named; a fallback
    runs at once."""

    def handler(req: Any) -> Any:
        if req.path == "/health":  # a and b answer their health checks, c does not
            return refused(req) if req.worker_id == "c" else json_response(200, HEALTHY)
        return refused(req)

    net = FakeNetwork(handler)
    with make_pool(net, clock, "a", "b", "c", health=ONE_CHECK) as pool:
        pool.check_health()
        with pytest.raises(TaskFailed):  # two failures each open a's and b's breakers
            settled(pool.submit({"x": 1}), pool, clock)
        states = {w["id"]: (w["breaker"]["state"], w["healthy"]) for w in pool.workers()}
        assert states == {"a": ("open", True), "b": ("open", True), "c": ("closed", False)}
        before = clock.monotonic()
        with pytest.raises(NoWorkerAvailable) as info:
            settled(pool.submit({"x": 2}), pool, clock)
        assert clock.monotonic() == before  # no backoff slept, nothing waited for
        message = str(info.value)
        assert "all 3 workers are down: 2 breakers open (next trial in 60s), 1 unhealthy" in message
        record = pool.dead_letters.get(info.value.dead_letter_id)
        assert record is not None and "all 3 workers are down" in record.error
        cpu = pool.submit({"x": 3}, fallback=lambda: {"cpu": True})
        assert settled(cpu, pool, clock) == {"cpu": True}
        assert pool.stats()["tasks"]["fallbacks"] == 1


def test_when_the_reset_time_comes_a_trial_goes_out_and_the_pool_recovers(clock):
    """Refused at once while every breaker is open; once the reset time has come, a
    task is the trial, and when the worker answers again the pool is back."""
    up = threading.Event()
    net = FakeNetwork(lambda req: json_response(200, {"ok": True}) if up.is_set() else refused(req))
    with make_pool(net, clock, "a") as pool:
        with pytest.raises(TaskFailed):  # fails twice: the breaker opens
            settled(pool.submit({"x": 1}), pool, clock)
        with pytest.raises(NoWorkerAvailable, match="the only worker is down: 1 breaker open"):
            settled(pool.submit({"x": 1}), pool, clock)
        up.set()
        clock.advance(60)
        assert pool.execute({"x": 1}) == {"ok": True}
        assert pool.workers()[0]["breaker"]["state"] == "closed"


def test_a_waiting_task_is_handed_a_worker_a_reload_adds(clock):
    """A task waiting for a full worker is woken by add_worker() and runs on the new one."""
    gate = threading.Event()
    running = threading.Event()

    def slow(req: Any) -> Any:
        running.set()
        gate.wait(10)
        return json_response(200, {"on": req.worker_id})

    net = FakeNetwork(lambda req: json_response(200, {"on": req.worker_id}))
    net.route("a", slow)
    with make_pool(net, clock, "a", capacity=1) as pool:
        first = pool.submit({"x": 1})
        assert running.wait(5)
        second = pool.submit({"x": 2})
        for _ in range(5000):
            if pool.stats()["tasks"]["waiting"]:
                break
            threading.Event().wait(0.001)
        assert pool.stats()["tasks"]["waiting"] == 1
        pool.add_worker(worker_config("b", "http://127.0.0.1:9200"))
        assert second.result(5) == {"on": "b"}
        gate.set()
        assert first.result(5) == {"on": "a"}


def test_a_health_round_taking_the_last_hope_down_ends_a_waiting_task_at_once(clock):
    """A task waits for a full worker; a health check finds that worker unhealthy: the
    task leaves the queue then, not at pool.max_queue_wait."""
    gate = threading.Event()
    running = threading.Event()

    def handler(req: Any) -> Any:
        if req.path == "/health":
            return json_response(503, {"status": "unhealthy"})
        running.set()
        gate.wait(10)
        return json_response(200, {"ok": True})

    net = FakeNetwork(handler)
    with make_pool(net, clock, "a", capacity=1, health=ONE_CHECK) as pool:
        first = pool.submit({"x": 1})
        assert running.wait(5)
        second = pool.submit({"x": 2})
        for _ in range(5000):
            if pool.stats()["tasks"]["waiting"]:
                break
            threading.Event().wait(0.001)
        pool.check_health()
        try:
            with pytest.raises(NoWorkerAvailable, match="the only worker is down: 1 unhealthy"):
                settled(second, pool, clock)
        finally:
            gate.set()
        first.result(5)


# -- credentials refused: the operator's fault -------------------------------------------


def test_a_refused_health_check_takes_the_worker_out_until_a_check_passes(clock):
    """A health check answered 401 takes the worker out (news once); the next check
    that passes brings it back."""
    a = make_worker(clock, "a")
    refused_check = HealthResult("a", False, 0.0, status=401, error="credentials refused: HTTP 401")
    assert credentials_news(a, refused_check) == "credentials refused: HTTP 401"
    a.health.last = refused_check
    assert credentials_news(a, refused_check) is None  # not news the second time
    assert held_until(a, clock.monotonic())[0] == NEVER and not a.eligible(clock.monotonic())
    assert a.stats.last_error == "credentials refused: HTTP 401"
    credentials_news(a, HealthResult("a", True, 0.0, status=200))
    assert a.refused is None and a.eligible(clock.monotonic())


def test_a_passing_unauthenticated_health_check_does_not_undo_a_tasks_refusal(clock):
    """AutoBot answers /health without asking for credentials: a passing check after
    a task was refused says nothing of them, so the worker waits out its time."""
    a = make_worker(clock, "a")
    a.health.last = HealthResult("a", True, 0.0, status=200)
    refuse_credentials(a, "credentials refused: HTTP 401", clock.monotonic() + 60)
    credentials_news(a, HealthResult("a", True, 0.0, status=200))
    assert not a.eligible(clock.monotonic())
    clock.advance(60)
    assert a.eligible(clock.monotonic())


def test_new_credentials_from_a_reload_bring_a_refused_worker_back(clock):
    """A reload that changes the worker's auth lets the next task try it at once."""
    a = make_worker(clock, "a")
    refuse_credentials(a, "credentials refused: HTTP 401", NEVER)
    a.configure(a.config)
    assert a.refused is not None  # the same credentials: still out
    a.configure(worker_config("a", "http://127.0.0.1:9000", auth={"type": "bearer", "token": "t"}))
    assert a.refused is None and a.eligible(clock.monotonic())


def test_a_misrouted_worker_and_refused_credentials_are_told_apart(clock):
    """Both are the operator's, and both keep their breakers closed; but a 404 on the
    inference path takes the worker out as 'not an NPU worker', and a 401 as refusing
    the credentials: the clause names each, and a fleet of the two fails at once."""
    net = FakeNetwork(lambda request: json_response(200, {"ok": True}))
    net.route("wrong", lambda request: json_response(404, {"detail": "Not Found"}))
    net.route("locked", lambda request: json_response(401, {"detail": "bad signature"}))
    config = PoolConfig(
        workers=(
            worker_config("wrong", "http://127.0.0.1:9001"),
            worker_config("locked", "http://127.0.0.1:9002"),
        ),
        health=HealthConfig(enabled=False),
        pool=PoolSettings(max_queue_wait=30.0),
    )
    with WorkerPool(config, transport_factory=net.factory, clock=clock) as pool:
        began = clock.monotonic()
        with pytest.raises(TaskFailed) as info:
            pool.execute({"input_text": "x"})
        rows = {w["id"]: w for w in pool.workers()}
        assert rows["wrong"]["last_error"].startswith("not an NPU worker at this URL")
        assert rows["locked"]["last_error"].startswith("credentials refused: HTTP 401")
        assert {r["breaker"]["state"] for r in rows.values()} == {"closed"}
        with pytest.raises(TaskFailed) as again:
            pool.execute({"input_text": "y"})
        message = str(again.value)
        assert "1 not an NPU worker" in message and "1 refusing the credentials" in message
        assert len(info.value.attempts) == 2 and again.value.attempts == ()
        assert clock.monotonic() == began  # the fake clock never moved: nothing waited
