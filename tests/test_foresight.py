"""Unit tests of deadline-aware admission: the expectation, and refusing at once."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from npu_sync import AdmissionRefused, TaskFailed, WorkerPool
from npu_sync._admission import Dispatcher, Lease, Refusal
from npu_sync._balancing.selector import Selector
from npu_sync._breaker import WorkerBreaker
from npu_sync._foresight import DeadlineForesight, Late, foresight_for
from npu_sync._worker import Worker
from npu_sync.config import (
    AdmissionConfig,
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    RetryConfig,
    worker_config,
)
from npu_sync.testing import FakeClock, FakeNetwork, json_response
from tests.stubs import NoTransport

BREAKER = BreakerConfig(fail_max=1, reset_timeout=30, max_reset_timeout=600)


def make_worker(
    clock: FakeClock, worker_id: str, *, capacity: int = 2, mean: float | None = 1.0, n: int = 10
) -> Worker:
    cfg = worker_config(worker_id, "http://127.0.0.1:9000", max_concurrent=capacity)
    worker = Worker(
        cfg, NoTransport(), WorkerBreaker(worker_id, BREAKER, clock=clock), NoTransport()
    )  # type: ignore[arg-type]
    if mean is not None:
        for _ in range(n):
            worker.stats.observe(clock.monotonic(), mean, True)
            worker.stats.succeeded += 1
    return worker


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_a_fresh_pool_with_no_latency_data_lets_every_task_in(clock: FakeClock) -> None:
    """No answer yet from a worker: no expectation, however short the time left."""
    workers = [make_worker(clock, "a", mean=None), make_worker(clock, "b")]
    foresight = DeadlineForesight()
    assert foresight.expect(workers, (), ahead=1000) is None
    now = clock.monotonic()
    assert foresight.judge(workers, (), 1000, now, now + 0.001, now + 0.001) is None


def test_too_few_answers_are_not_trusted(clock: FakeClock) -> None:
    """A worker with fewer than min_samples answers makes the pool admit."""
    workers = [make_worker(clock, "a", n=4), make_worker(clock, "b", n=50)]
    assert DeadlineForesight(min_samples=5).expect(workers, (), 10) is None
    assert DeadlineForesight(min_samples=4).expect(workers, (), 10) is not None


def test_the_expectation_is_the_queue_ahead_plus_one_answer(clock: FakeClock) -> None:
    """Two workers of 2 slots at 1 s free 4 slots a second: 8 ahead wait 2.25 s, answer 3.25 s."""
    workers = [make_worker(clock, "a"), make_worker(clock, "b")]
    wait, answered = DeadlineForesight().expect(workers, (), ahead=8) or (0.0, 0.0)
    assert wait == pytest.approx(9 / 4)
    assert answered == pytest.approx(13 / 4)


def test_a_faster_worker_frees_slots_faster(clock: FakeClock) -> None:
    """Rates add: a worker ten times faster shortens the expectation tenfold-ish."""
    slow = [make_worker(clock, "a", mean=1.0)]
    both = [*slow, make_worker(clock, "b", mean=0.1)]
    one = DeadlineForesight().expect(slow, (), 10)
    two = DeadlineForesight().expect(both, (), 10)
    assert one is not None and two is not None
    assert two[0] == pytest.approx(11 / (2 / 1.0 + 2 / 0.1))
    assert two[0] < one[0] / 5


def test_refused_with_the_expectation_and_the_time_left_in_words(clock: FakeClock) -> None:
    """The reason reads 'expected 3.2 s, 1.0 s left'."""
    workers = [make_worker(clock, "a"), make_worker(clock, "b")]
    now = clock.monotonic()
    late = DeadlineForesight().judge(workers, (), 8, now, now + 1.0, now + 1.0)
    assert isinstance(late, Late)
    assert late.expected == pytest.approx(3.25) and late.left == pytest.approx(1.0)
    assert late.reason == "expected 3.2 s, 1.0 s left"


def test_only_a_confident_miss_is_refused(clock: FakeClock) -> None:
    """An expectation past the time left by less than the margin is let in."""
    workers = [make_worker(clock, "a"), make_worker(clock, "b")]
    now = clock.monotonic()
    # 3.25 s expected: refused with 2.5 s left (x1.3), let in with 2.7 s left (x1.2).
    assert DeadlineForesight(margin=1.25).judge(workers, (), 8, now, now + 9, now + 2.5)
    assert DeadlineForesight(margin=1.25).judge(workers, (), 8, now, now + 9, now + 2.7) is None
    assert DeadlineForesight(margin=1.0).judge(workers, (), 8, now, now + 9, now + 3.2)


def test_a_wait_past_max_queue_wait_is_refused_and_named(clock: FakeClock) -> None:
    """Waiting limited by pool.max_queue_wait: the expected wait alone is judged against it."""
    workers = [make_worker(clock, "a"), make_worker(clock, "b")]
    now = clock.monotonic()
    late = DeadlineForesight().judge(workers, (), 8, now, now + 1.0, now + 60)
    assert isinstance(late, Late) and late.waiting
    assert late.expected == pytest.approx(2.25)
    assert "pool.max_queue_wait" in late.reason


def test_workers_that_free_no_slot_now_are_not_counted(clock: FakeClock) -> None:
    """Tried, open, unhealthy, disabled or draining workers add nothing to the rate."""
    a, b = make_worker(clock, "a"), make_worker(clock, "b")
    both = DeadlineForesight().expect([a, b], (), 8)
    assert DeadlineForesight().expect([a, b], {"b"}, 8) == DeadlineForesight().expect([a], (), 8)
    b.breaker.force_open()
    assert DeadlineForesight().expect([a, b], (), 8) == DeadlineForesight().expect([a], (), 8)
    assert both != DeadlineForesight().expect([a, b], (), 8)
    # Nobody left who could serve: no expectation, the other refusals speak.
    assert DeadlineForesight().expect([b], (), 8) is None


def test_bad_settings_are_refused_naming_them() -> None:
    """A margin below 1 or no samples asked for is a clear error."""
    with pytest.raises(ValueError, match=r"margin must be >= 1, got 0\.5"):
        DeadlineForesight(margin=0.5)
    with pytest.raises(ValueError, match=r"min_samples must be >= 1, got 0"):
        DeadlineForesight(min_samples=0)


def test_the_step_is_off_when_the_key_says_so() -> None:
    """admission.deadline_aware: false builds no step; one step per configuration."""
    assert foresight_for(AdmissionConfig(deadline_aware=False)) is None
    on = AdmissionConfig(deadline_margin=2.0, min_samples=3)
    step = foresight_for(on)
    assert step is foresight_for(AdmissionConfig(deadline_margin=2.0, min_samples=3))
    assert step is not None and (step.margin, step.min_samples) == (2.0, 3)


# -- the dispatcher ---------------------------------------------------------------------


def saturated(clock: FakeClock) -> tuple[Dispatcher, list[Lease]]:
    dispatcher = Dispatcher(clock, Selector())
    dispatcher.set_workers([make_worker(clock, "a"), make_worker(clock, "b")])
    leases = [dispatcher.acquire((), clock.monotonic() + 60) for _ in range(4)]
    assert all(isinstance(lease, Lease) for lease in leases)
    return dispatcher, leases  # type: ignore[return-value]


def test_the_dispatcher_refuses_at_once_rather_than_queue(clock: FakeClock) -> None:
    """A saturated fleet and 0.5 s left: a Late, without joining the queue."""
    dispatcher, _ = saturated(clock)
    now = clock.monotonic()
    got = dispatcher.acquire_or_reason(
        (), now + 0.5, admission=AdmissionConfig(), task_deadline=now + 0.5
    )
    assert isinstance(got, Late) and got.expected == pytest.approx(1.25)
    assert dispatcher.waiting == 0


def test_with_the_step_off_the_task_waits_and_is_served(clock: FakeClock) -> None:
    """deadline_aware off: the same task queues, and takes the first slot freed."""
    dispatcher, leases = saturated(clock)
    now = clock.monotonic()
    got: list[object] = []
    waiter = threading.Thread(
        target=lambda: got.append(
            dispatcher.acquire_or_reason(
                (),
                now + 0.5,
                admission=AdmissionConfig(deadline_aware=False),
                task_deadline=now + 0.5,
            )
        )
    )
    waiter.start()
    for _ in range(5000):
        if dispatcher.waiting:
            break
        threading.Event().wait(0.001)
    assert dispatcher.waiting == 1
    lease = leases[0]
    with dispatcher.lock:
        lease.worker.in_flight -= 1
        lease.worker.breaker.record_success(lease.trial)
        dispatcher.release_worker_locked(lease.worker, clock.monotonic())
    waiter.join(5)
    assert not waiter.is_alive() and isinstance(got[0], Lease)


def test_a_free_worker_is_taken_whatever_the_expectation(clock: FakeClock) -> None:
    """The step judges only a task that would wait: a slot free now is given."""
    dispatcher = Dispatcher(clock, Selector())
    dispatcher.set_workers([make_worker(clock, "a", mean=100.0)])
    now = clock.monotonic()
    got = dispatcher.acquire_or_reason(
        (), now + 0.01, admission=AdmissionConfig(), task_deadline=now + 0.01
    )
    assert isinstance(got, Lease)


def test_other_refusals_come_first(clock: FakeClock) -> None:
    """Every worker tried: the refusal says so, not an expectation."""
    dispatcher, _ = saturated(clock)
    now = clock.monotonic()
    got = dispatcher.acquire_or_reason(
        {"a", "b"}, now + 0.5, admission=AdmissionConfig(), task_deadline=now + 0.5
    )
    assert got is Refusal.EVERY_WORKER_TRIED


def test_only_the_waiting_tasks_served_before_it_count_as_ahead(clock: FakeClock) -> None:
    """Two interactive and eight batch tasks queued on 4 slots freed at 4 a second: a
    batch task counts all ten ahead, an interactive one only the two of its own class
    (the batch tasks are served after it), so it is let in where a batch task is not."""
    dispatcher, _ = saturated(clock)
    far = clock.monotonic() + 3600
    now = clock.monotonic()
    on = AdmissionConfig()  # margin 1.25
    got: dict[str, object] = {}

    def judged(priority: str, left: float) -> None:
        got[priority] = dispatcher.acquire_or_reason(
            (), now + left, admission=on, task_deadline=now + left, priority=priority
        )

    def waits(target: Any, *args: Any, **kwargs: Any) -> threading.Thread:
        before = dispatcher.waiting
        thread = threading.Thread(target=target, args=args, kwargs=kwargs)
        thread.start()
        threads.append(thread)
        for _ in range(5000):
            if dispatcher.waiting > before or not thread.is_alive():
                break
            threading.Event().wait(0.001)
        return thread

    threads: list[threading.Thread] = []
    try:
        for priority in ("interactive",) * 2 + ("batch",) * 8:
            waits(dispatcher.acquire_or_reason, (), far, priority=priority)
        assert dispatcher.waiting == 10
        # Its own class counts: ten ahead, answered in (10 + 1 + 4) / 4 = 3.75 s > 2 x 1.25.
        waits(judged, "batch", 2.0).join(5)
        late = got.get("batch")
        assert isinstance(late, Late) and late.expected == pytest.approx(3.75)
        # Two ahead: (2 + 1 + 4) / 4 = 1.75 s <= 1.5 x 1.25, so it waits; counting the
        # whole queue it would have been refused (3.75 s).
        interactive = waits(judged, "interactive", 1.5)
        assert "interactive" not in got and interactive.is_alive()
        assert dispatcher.waiting == 11
    finally:
        clock.advance(7200)  # every waiter's deadline passes
        with dispatcher.lock:
            dispatcher.wake_all_locked()
        for thread in threads:
            thread.join(5)
            assert not thread.is_alive()


# -- the pool ---------------------------------------------------------------------------


class Gate:
    """A worker answer held until the test opens the gate; the fake clock moves 1 s per
    answer so that every worker learns it takes 1 s."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Semaphore(0)

    def __call__(self, req: Any) -> Any:
        self.entered.release()
        self.open.wait(10)
        return json_response(200, {"ok": True})


def pool_with(net: FakeNetwork, clock: FakeClock, **kw: Any) -> WorkerPool:
    cfg = PoolConfig(
        workers=(worker_config("a", "http://127.0.0.1:9100", max_concurrent=2),),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=1, backoff_initial=0.01, backoff_max=0.01),
        **kw,
    )
    return WorkerPool(cfg, transport_factory=net.factory, clock=clock)


def warm(pool: WorkerPool, clock: FakeClock) -> None:
    """Five answers of 1 s each on the fake clock."""
    worker = pool._state.workers["a"]
    with pool._state.lock:
        for _ in range(5):
            worker.stats.observe(clock.monotonic(), 1.0, True)
            worker.stats.succeeded += 1


def saturate(pool: WorkerPool, gate: Gate, n: int) -> list[Any]:
    gate.open.clear()
    futures = [pool.submit({"i": i}) for i in range(n)]
    for _ in range(2):  # both slots busy
        assert gate.entered.acquire(timeout=10)
    for _ in range(5000):
        if pool._state.dispatcher.waiting == n - 2:
            break
        threading.Event().wait(0.001)
    assert pool._state.dispatcher.waiting == n - 2
    return futures


def test_a_refused_task_raises_admission_refused_and_stores_no_dead_letter() -> None:
    """Refused before any attempt: AdmissionRefused (a TaskRejected), nothing dead-lettered."""
    net, clock = FakeNetwork(), FakeClock()
    gate = Gate(clock)
    net.route("a", gate)
    with pool_with(net, clock) as pool:
        warm(pool, clock)
        futures = saturate(pool, gate, 6)
        sent = len(net.requests("a"))
        with pytest.raises(AdmissionRefused) as caught:
            pool.execute({"late": True}, timeout=1.0)
        assert "refused on admission: expected 3.5 s, 1.0 s left" in str(caught.value)
        assert caught.value.expected == pytest.approx(3.5) and caught.value.left == 1.0
        assert len(net.requests("a")) == sent  # nothing sent for it
        assert pool.dead_letters.list() == []
        assert pool.stats()["tasks"]["rejected"] == 1
        gate.open.set()
        assert [f.result(10) for f in futures] == [{"ok": True}] * 6


def test_a_refused_task_runs_its_fallback() -> None:
    """With a fallback, the refusal is answered by it, at once, and no dead letter is stored."""
    net, clock = FakeNetwork(), FakeClock()
    gate = Gate(clock)
    net.route("a", gate)
    with pool_with(net, clock) as pool:
        warm(pool, clock)
        futures = saturate(pool, gate, 6)
        assert pool.execute({"late": True}, timeout=1.0, fallback=lambda: "cached") == "cached"
        assert pool.dead_letters.list() == [] and pool.stats()["tasks"]["fallbacks"] == 1
        gate.open.set()
        for f in futures:
            f.result(10)


def test_with_the_key_off_the_task_waits_as_before() -> None:
    """admission.deadline_aware: false: the same task queues and is served when a slot frees."""
    net, clock = FakeNetwork(), FakeClock()
    gate = Gate(clock)
    net.route("a", gate)
    with pool_with(net, clock, admission=AdmissionConfig(deadline_aware=False)) as pool:
        warm(pool, clock)
        futures = saturate(pool, gate, 6)
        late = pool.submit({"late": True}, timeout=1.0)
        for _ in range(5000):
            if pool._state.dispatcher.waiting == 5:
                break
            threading.Event().wait(0.001)
        assert pool._state.dispatcher.waiting == 5
        gate.open.set()
        assert late.result(10) == {"ok": True}
        for f in futures:
            f.result(10)


def test_a_task_refused_after_an_attempt_is_dead_lettered() -> None:
    """A retry the queue cannot serve in time ends as TaskFailed, with its dead letter."""
    net, clock = FakeNetwork(), FakeClock()
    gate = Gate(clock)
    retry_in, proceed = threading.Event(), threading.Event()

    def first_fails(req: Any) -> Any:
        if req.json() == {"retry": True}:
            retry_in.set()
            proceed.wait(10)
            return json_response(503, {"detail": "busy"})
        return gate(req)

    net.route("a", first_fails)
    net.route("b", gate)
    cfg = PoolConfig(
        workers=(
            worker_config("a", "http://127.0.0.1:9100", max_concurrent=1, priority=1),
            worker_config("b", "http://127.0.0.1:9101", max_concurrent=2, priority=2),
        ),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=3, backoff_initial=0.0, backoff_max=0.0),
        circuit_breaker=BreakerConfig(fail_max=100, reset_timeout=30, max_reset_timeout=60),
    )
    with WorkerPool(cfg, transport_factory=net.factory, clock=clock) as pool:
        with pool._state.lock:
            for worker in pool._state.workers.values():
                for _ in range(5):
                    worker.stats.observe(clock.monotonic(), 1.0, True)
                    worker.stats.succeeded += 1
        gate.open.clear()
        retried = pool.submit({"retry": True}, timeout=1.0)  # first to a, the first tier
        assert retry_in.wait(10)
        futures = [pool.submit({"i": i}) for i in range(8)]  # 2 on b, 6 queued
        for _ in range(2):
            assert gate.entered.acquire(timeout=10)
        for _ in range(5000):
            if pool._state.dispatcher.waiting == 6:
                break
            threading.Event().wait(0.001)
        assert pool._state.dispatcher.waiting == 6
        proceed.set()
        with pytest.raises(TaskFailed) as caught:
            retried.result(10)
        gate.open.set()
        for f in futures:
            f.result(10)
    assert caught.value.dead_letter_id and len(caught.value.attempts) == 1
    assert "refused on admission: expected" in str(caught.value)


def test_a_hook_that_calls_back_into_the_pool_on_a_refusal_does_not_deadlock() -> None:
    """The refusal's event reaches hooks outside the lock: one that runs another task
    (refused in turn, answered by its fallback) and reads stats() returns."""
    from npu_sync.events import TaskRejectedEvent

    net, clock = FakeNetwork(), FakeClock()
    gate = Gate(clock)
    net.route("a", gate)
    seen: list[object] = []
    holder: list[WorkerPool] = []

    def hook(event: object) -> None:
        if isinstance(event, TaskRejectedEvent) and not seen:
            seen.append(event)
            pool = holder[0]
            seen.append(pool.execute({"again": True}, timeout=1.0, fallback=lambda: "inner"))
            seen.append(pool.stats()["tasks"]["rejected"])

    cfg = PoolConfig(
        workers=(worker_config("a", "http://127.0.0.1:9100", max_concurrent=2),),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=1, backoff_initial=0.01, backoff_max=0.01),
    )
    with WorkerPool(cfg, transport_factory=net.factory, clock=clock, hooks=[hook]) as pool:
        holder.append(pool)
        warm(pool, clock)
        futures = saturate(pool, gate, 6)
        assert pool.execute({"late": True}, timeout=1.0, fallback=lambda: "outer") == "outer"
        gate.open.set()
        for f in futures:
            f.result(10)
    assert seen[1:] == ["inner", 2]
