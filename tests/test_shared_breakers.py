"""Breakers shared between pools through Redis (fakeredis here; real processes and a real
redis-server in tests/integration/test_shared_breakers_real.py): failures are counted
per process, openings and closings are shared, and one trial per opening is sent for
the whole fleet."""

# ruff: noqa: F811  (test parameters named after the fixtures imported below)
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from npu_sync import Task, WorkerPool
from npu_sync.config import (
    BalancingConfig,
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    RetryConfig,
    SharedStateConfig,
    worker_config,
)
from npu_sync.testing import FakeClock, FakeNetwork, FakeRequest, json_response
from npu_sync.transport import Response, TransportError
from tests.fleetkit import client, clock, manual, redis_server  # noqa: F401

redis = pytest.importorskip("redis")

FAIL_MAX = 3
RESET = 30.0


def config(*, shared: bool = True) -> PoolConfig:
    return PoolConfig(
        workers=(
            worker_config("w0", "http://127.0.0.1:9601", priority=1),
            worker_config("w1", "http://127.0.0.1:9602", priority=2),
        ),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=1, backoff_initial=0.0, backoff_max=0.0),
        circuit_breaker=BreakerConfig(fail_max=FAIL_MAX, reset_timeout=RESET),
        balancing=BalancingConfig(latency_aware=False),
        shared_state=(
            SharedStateConfig(backend="redis", namespace="sb", sync_interval=0.05)
            if shared
            else SharedStateConfig()
        ),
    )


def answer(req: FakeRequest) -> Response:
    """w0 fails a task whose input says so; everything else is answered."""
    if req.path == "/health":
        return json_response(200, {"status": "healthy"})
    body = json.loads(req.body or b"{}")
    if req.worker_id == "w0" and str(body.get("input_text", "")).startswith("fail"):
        return json_response(500, {"detail": "simulated failure"})
    return json_response(200, {"response": "ok"})


def dead(req: FakeRequest) -> Response:
    return json_response(500, {"detail": "down"})


@pytest.fixture
def pools(redis_server, clock: FakeClock) -> Iterator[Callable[[], tuple[WorkerPool, FakeNetwork]]]:
    """Pools standing for processes: one Redis, one clock, a network each (so each
    process's requests are counted apart)."""
    built: list[WorkerPool] = []

    def build() -> tuple[WorkerPool, FakeNetwork]:
        net = FakeNetwork(answer)
        pool = WorkerPool(config(), transport_factory=net.factory, clock=clock)
        built.append(pool)
        return pool, net

    yield build
    for pool in built:
        pool.close()


def breaker(pool: WorkerPool, worker_id: str = "w0") -> str:
    return {w["id"]: w["breaker"]["state"] for w in pool.workers()}[worker_id]


def counts(pool: WorkerPool, worker_id: str) -> dict[str, Any]:
    return {w["id"]: w["tasks"] for w in pool.workers()}[worker_id]


def until(condition: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        threading.Event().wait(0.005)


def inferences(net: FakeNetwork, worker_id: str = "w0") -> int:
    return sum(1 for r in net.requests(worker_id) if r.path != "/health")


def open_everywhere(one: WorkerPool, net: FakeNetwork, *others: WorkerPool) -> None:
    net.route("w0", dead)
    for i in range(FAIL_MAX):
        one.execute({"input_text": f"t{i}"})
    assert breaker(one) == "open"
    for other in others:
        until(lambda o=other: breaker(o) == "open", "the opening did not reach every pool")


def test_failures_spread_over_processes_never_add_up_to_an_opening(pools):
    """Three processes each fail every other task on w0: the fleet sees fail_max failures
    in a row between two successes many times over, no process sees fail_max in a row
    of its own, and w0 stays closed everywhere."""
    built = [pools() for _ in range(FAIL_MAX)]
    for i in range(4 * FAIL_MAX):
        for pool, _ in built:
            pool.execute({"input_text": ("fail" if i % 2 == 0 else "ok") + str(i)})
    assert [breaker(pool) for pool, _ in built] == ["closed"] * FAIL_MAX
    failed = sum(counts(pool, "w0")["failed"] for pool, _ in built)
    assert failed == 2 * FAIL_MAX * FAIL_MAX
    # Every task still went to w0 first: it was never taken out.
    assert [inferences(net) for _, net in built] == [4 * FAIL_MAX] * FAIL_MAX


def test_fail_max_in_a_row_in_one_process_opens_the_worker_in_every_process(pools):
    """A dead worker opens where fail_max failed in a row; the other adopts the opening
    and sends it nothing."""
    (one, net_one), (two, net_two) = pools(), pools()
    net_two.route("w0", dead)
    open_everywhere(one, net_one, two)
    assert inferences(net_one) == FAIL_MAX
    for i in range(5):
        two.execute({"input_text": f"after {i}"})
    assert inferences(net_two) == 0
    assert counts(two, "w1")["succeeded"] == 5


class Gate:
    """A worker handler that holds each inference until released, counting arrivals."""

    def __init__(self, then: Callable[[FakeRequest], Response]) -> None:
        self.then = then
        self.arrived = threading.Semaphore(0)
        self.release = threading.Event()

    def __call__(self, req: FakeRequest) -> Response:
        if req.path != "/health":
            self.arrived.release()
            self.release.wait(30)
        return self.then(req)


def test_one_trial_per_opening_for_the_whole_fleet(pools, clock):
    """After the reset timeout the first process takes the trial; the others keep the
    worker out, send it nothing, and take the trial's success as their closing."""
    (one, net_one), (two, net_two), (three, net_three) = pools(), pools(), pools()
    open_everywhere(one, net_one, two, three)
    opening = inferences(net_one)
    clock.advance(RESET + 1)
    gate = Gate(answer)
    net_one.route("w0", gate)
    net_two.route("w0", gate)
    net_three.route("w0", gate)
    trial = threading.Thread(target=one.execute, args=({"input_text": "trial"},))
    trial.start()
    try:
        assert gate.arrived.acquire(timeout=10), "no trial was sent"
        for pool in (two, three):
            for i in range(3):
                pool.execute({"input_text": f"meanwhile {i}"})
        assert inferences(net_two) == inferences(net_three) == 0
        assert (breaker(two), breaker(three)) == ("open", "open")
        assert two.stats()["shared_state"]["trials_yielded"] >= 1
    finally:
        gate.release.set()
        trial.join(10)
    assert breaker(one) == "closed"
    until(lambda: breaker(two) == breaker(three) == "closed", "the trial's success not shared")
    assert inferences(net_one) == opening + 1
    assert one.stats()["shared_state"]["trials_taken"] == 1


def test_a_failed_trial_reopens_everywhere_and_the_next_period_has_one_trial_again(pools, clock):
    """The holder's failed trial is published as a new opening (doubled timeout) that the
    others follow; after it, again exactly one trial reaches the worker."""
    (one, net_one), (two, net_two) = pools(), pools()
    open_everywhere(one, net_one, two)
    net_two.route("w0", dead)
    for period, wait in enumerate((RESET, 2 * RESET)):
        clock.advance(wait + 1)
        before = inferences(net_one) + inferences(net_two)
        first, second = (one, two) if period == 0 else (two, one)
        first.execute({"input_text": f"trial {period}"})
        assert inferences(net_one) + inferences(net_two) == before + 1
        assert breaker(first) == "open"
        # The new opening reaches the other pool, which then sends no trial of its own.
        until(
            lambda s=second, f=first: (
                s.workers()[0]["breaker"]["reset_timeout"]
                == f.workers()[0]["breaker"]["reset_timeout"]
            ),
            "the re-opening did not reach the other pool",
        )
        second.execute({"input_text": f"after {period}"})
        assert inferences(net_one) + inferences(net_two) == before + 1


def test_the_fleets_trial_lease_lasts_the_trial_deadline_not_the_read_timeout(
    pools, clock, redis_server
):
    """w0 answered at once before it opened, then froze: its trial is sent with the
    trial deadline (the 1 s floor), and the fleet's lease on it ends that plus the
    margin from now, not after the 20 s read timeout. A non-idempotent task's trial is
    w0's health check within the deadline, its lease long enough for the check and
    then the task's own read timeout."""
    (one, net_one), (two, _) = pools(), pools()
    for i in range(10):
        one.execute({"input_text": f"warm {i}"})
    open_everywhere(one, net_one, two)
    margin = one._state.shared.lease_margin
    redis = client(redis_server)
    seen: list[tuple[str, float, int]] = []

    def frozen(req: FakeRequest) -> TransportError:
        seen.append((req.method, req.timeout, int(redis.pttl("{sb}:worker:w0:trial"))))
        return TransportError("timeout", "w0: timed out", sent=True)

    net_one.route("w0", frozen)
    clock.advance(RESET + 1)
    one.execute({"input_text": "trial"})  # cut on w0, then run on w1
    ((method, timeout, lease_ms),) = seen
    assert (method, timeout) == ("POST", 1.0)
    assert 1000 < lease_ms <= (1.0 + margin) * 1000
    assert breaker(one) == "open"
    seen.clear()
    clock.advance(2 * RESET + 1)  # the failed trial doubled the open time
    one.execute(Task({"input_text": "once"}, idempotent=False))
    ((method, timeout, lease_ms),) = seen
    assert (method, timeout) == ("GET", 1.0)
    read = one.config.timeouts.read
    assert (read + 1.0) * 1000 < lease_ms <= (read + 1.0 + margin) * 1000
    assert breaker(one) == "open"


def test_without_redis_each_process_sends_its_own_trial(pools, clock, redis_server):
    """Redis away: the trial lease cannot be taken, and each process tries on its own
    rather than keep a worker out for ever."""
    (one, net_one), (two, net_two) = pools(), pools()
    open_everywhere(one, net_one, two)
    redis_server.connected = False
    clock.advance(RESET + 1)
    net_two.route("w0", answer)
    one.execute({"input_text": "trial one"})
    two.execute({"input_text": "trial two"})
    assert inferences(net_two) == 1
    assert breaker(two) == "closed"


class RedisCalls:
    """Counts the commands the test's own thread (where tasks run) sends to Redis."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.counting = False
        main = threading.main_thread()
        for owner, name in (
            (redis.Redis, "execute_command"),
            (redis.client.Pipeline, "execute"),
        ):
            original = getattr(owner, name)

            def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                if self.counting and threading.current_thread() is main:
                    self.calls += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(owner, name, counted)


def test_healthy_tasks_and_failures_below_fail_max_send_nothing_to_redis(pools, monkeypatch):
    """Only decisions are shared: successes and failures short of an opening cost no
    Redis command on the task's thread; an opening costs one transaction."""
    calls = RedisCalls(monkeypatch)
    (one, net_one), (_two, _) = pools(), pools()
    one.execute({"input_text": "warm"})
    calls.counting = True
    for i in range(20):
        one.execute({"input_text": ("fail" if i % FAIL_MAX == 0 else "ok") + str(i)})
    assert calls.calls == 0
    net_one.route("w0", dead)
    for i in range(FAIL_MAX):
        one.execute({"input_text": f"dead {i}"})
    assert breaker(one) == "open"
    assert calls.calls == 1


def test_a_hook_that_blocks_or_calls_back_on_the_closing_does_not_hold_the_fleet(
    redis_server, clock
):
    """The trial's holder has a hook that, on the closing, runs a task on its own pool
    and then blocks: the other process learns of the closing (and the lease is free)
    while the hook still runs."""
    release = threading.Event()
    in_hook = threading.Event()
    box: dict[str, WorkerPool] = {}

    def hook(event: object) -> None:
        if getattr(event, "new", None) == "closed" and not in_hook.is_set():
            in_hook.set()
            box["one"].execute({"input_text": "from the hook"})
            release.wait(30)

    net_one, net_two = FakeNetwork(answer), FakeNetwork(answer)
    one = WorkerPool(config(), transport_factory=net_one.factory, clock=clock, hooks=[hook])
    box["one"] = one
    two = WorkerPool(config(), transport_factory=net_two.factory, clock=clock)
    trial = threading.Thread(target=one.execute, args=({"input_text": "trial"},))
    try:
        open_everywhere(one, net_one, two)
        net_one.route("w0", answer)
        clock.advance(RESET + 1)
        trial.start()
        assert in_hook.wait(10)
        until(lambda: breaker(two) == "closed", "the closing waited for the hook")
        assert one._state.shared._client.get("sb:worker:w0:trial") is None
    finally:
        release.set()
        trial.join(10)
        one.close()
        two.close()


def test_a_trial_called_off_while_its_lease_was_taken_leaves_a_later_trial_alone(pools, clock):
    """Task A's trial is called off (another process closed the worker) while A waits on
    Redis; the worker reopens and task B sends the next trial. A giving its lease back
    must not free B's trial slot: no second trial is admitted beside B's."""
    (one, net_one), (two, _) = pools(), pools()
    open_everywhere(one, net_one, two)
    clock.advance(RESET + 1)
    shared = one._state.shared
    entered, go = threading.Event(), threading.Event()
    real_take = shared.take_trial

    def slow_take(worker_id: str, budget: float) -> float | None:
        if not entered.is_set():
            entered.set()
            go.wait(30)
        return real_take(worker_id, budget)

    shared.take_trial = slow_take
    gate = Gate(answer)
    net_one.route("w0", gate)
    task_a = threading.Thread(target=one.execute, args=({"input_text": "a"},))
    task_b = threading.Thread(target=one.execute, args=({"input_text": "b"},))
    task_a.start()
    try:
        assert entered.wait(10)
        one._apply_remote("w0", "closed", 0.0, None)  # another process's trial closed it
        one._apply_remote("w0", "open", RESET + 1, RESET)  # and it failed again, long ago
        task_b.start()
        assert gate.arrived.acquire(timeout=10), "task B sent no trial"
        go.set()
        task_a.join(10)
        # A ran on w1; had it freed B's slot, it would have taken a second trial and be
        # held at w0 beside B.
        assert not task_a.is_alive(), "task A sent a second trial beside B's"
        assert not gate.arrived.acquire(timeout=0)
        breaker_w0 = one._state.workers["w0"].breaker
        with one._state.lock:
            assert breaker_w0.state == "half-open"
            assert not breaker_w0.can_admit(clock.monotonic())
    finally:
        go.set()
        gate.release.set()
        task_a.join(10)
        if task_b.ident is not None:  # started
            task_b.join(10)
