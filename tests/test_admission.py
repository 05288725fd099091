"""Unit tests of admission: leases, FIFO hand-off, failing fast, interrupted waiters."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any, ClassVar

import pytest

from npu_sync import _admission as admission
from npu_sync._admission import Dispatcher, Lease, Refusal
from npu_sync._balancing.selector import Selector
from npu_sync._breaker import WorkerBreaker
from npu_sync._worker import Worker
from npu_sync.config import BreakerConfig, worker_config
from npu_sync.testing import FakeClock
from tests.stubs import NoTransport

BREAKER = BreakerConfig(fail_max=1, reset_timeout=30, max_reset_timeout=600)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make_worker(
    clock: FakeClock, worker_id: str, priority: int = 1, capacity: int = 1, **kw: Any
) -> Worker:
    cfg = worker_config(
        worker_id, "http://127.0.0.1:9000", priority=priority, max_concurrent=capacity, **kw
    )
    breaker = WorkerBreaker(worker_id, BREAKER, clock=clock)
    return Worker(cfg, NoTransport(), breaker, NoTransport())


def far(clock: FakeClock) -> float:
    return clock.monotonic() + 3600


def give_back(dispatcher: Dispatcher, lease: Lease, *, failed: bool = False) -> None:
    """What the pool does when an attempt ends: slot back, breaker told, waiters served."""
    worker = lease.worker
    with dispatcher.lock:
        worker.in_flight -= 1
        if failed:
            worker.breaker.record_failure(lease.trial)
            dispatcher.wake_all_locked()
        else:
            worker.breaker.record_success(lease.trial)
        dispatcher.release_worker_locked(worker, dispatcher.clock.monotonic())


def wait_until(condition: Callable[[], bool]) -> None:
    for _ in range(5000):
        if condition():
            return
        threading.Event().wait(0.001)
    raise AssertionError("condition not reached in 5 s")


class Waiting:
    """``acquire_or_reason`` running on a thread of its own."""

    def __init__(
        self, dispatcher: Dispatcher, deadline: float, excluded: Collection[str] = ()
    ) -> None:
        self.dispatcher = dispatcher
        self.deadline = deadline
        self.result: Lease | Refusal | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(excluded,))
        self.thread.start()

    def _run(self, excluded: Collection[str]) -> None:
        try:
            self.result = self.dispatcher.acquire_or_reason(excluded, self.deadline)
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    def stop(self, clock: FakeClock) -> None:
        """Let the call end, whatever state it is in: its deadline passes."""
        if not self.done.is_set():
            clock.advance(self.deadline - clock.monotonic() + 1)
            with self.dispatcher.lock:
                self.dispatcher.wake_all_locked()
        self.thread.join(5)


@pytest.fixture
def started(clock: FakeClock) -> Iterator[list[Waiting]]:
    """Every Waiting of the test, ended when the test ends, passed or failed."""
    calls: list[Waiting] = []
    yield calls
    for call in calls:
        call.stop(clock)


def queue(started: list[Waiting], dispatcher: Dispatcher, deadline: float, **kw: Any) -> Waiting:
    """Start an acquire that must wait, and return once it is queued."""
    before = dispatcher.waiting
    call = Waiting(dispatcher, deadline, **kw)
    started.append(call)
    wait_until(lambda: dispatcher.waiting > before or call.done.is_set())
    assert not call.done.is_set(), f"expected to wait, got {call.result!r}"
    return call


def open_after_early_trial(worker: Worker, clock: FakeClock) -> None:
    """Open the breaker, grant and fail its early trial: open for 60 s, no early trial left."""
    breaker = worker.breaker
    breaker.record_failure(False)
    breaker.allow_trial()
    assert breaker.admit(clock.monotonic()) is True
    breaker.record_failure(True)
    assert breaker.retry_at() == clock.monotonic() + 60


# -- basic contract ----------------------------------------------------------------------


def test_acquire_returns_a_lease_or_none_and_acquire_or_reason_says_why(clock):
    """acquire() keeps its Lease-or-None contract; acquire_or_reason() names the refusal."""
    a = make_worker(clock, "a")
    dispatcher = Dispatcher(clock, Selector([a]))
    lease = dispatcher.acquire((), far(clock))
    assert isinstance(lease, Lease) and lease.worker is a and a.in_flight == 1
    assert dispatcher.acquire({"a"}, far(clock)) is None
    assert dispatcher.acquire_or_reason({"a"}, far(clock)) is Refusal.EVERY_WORKER_TRIED
    assert dispatcher.acquire_or_reason((), clock.monotonic()) is Refusal.DEADLINE_PASSED


def test_sequential_leases_rotate_over_backups_while_the_primary_is_down(clock):
    """Tasks one after another spread evenly over equal backups when the primary is down."""
    primary = make_worker(clock, "primary", priority=1)
    primary.healthy = False
    backups = [make_worker(clock, f"backup-{i}", priority=2) for i in range(4)]
    dispatcher = Dispatcher(clock, Selector([primary, *backups]))
    picks: dict[str, int] = {}
    for _ in range(200):
        lease = dispatcher.acquire((), far(clock))
        assert lease is not None
        picks[lease.worker.id] = picks.get(lease.worker.id, 0) + 1
        give_back(dispatcher, lease)
    assert picks == {w.id: 50 for w in backups}


def test_a_freed_slot_goes_to_the_first_waiter(clock, started):
    """FIFO: the waiter queued first gets the slot a finished task frees."""
    a = make_worker(clock, "a")
    dispatcher = Dispatcher(clock, Selector([a]))
    held = dispatcher.acquire((), far(clock))
    assert held is not None
    first = queue(started, dispatcher, far(clock))
    second = queue(started, dispatcher, far(clock))
    give_back(dispatcher, held)
    assert first.done.wait(5)
    assert isinstance(first.result, Lease) and not second.done.is_set()
    give_back(dispatcher, first.result)
    assert second.done.wait(5) and isinstance(second.result, Lease)


def test_a_release_of_unnamed_workers_still_serves_waiters(clock, started):
    """release_locked() (a health round, a remote change) finds what became available."""
    a = make_worker(clock, "a")
    dispatcher = Dispatcher(clock, Selector([a]))
    a.in_flight = a.capacity  # full: worth waiting for
    waiting = queue(started, dispatcher, far(clock))
    with dispatcher.lock:
        a.in_flight = 0
        dispatcher.release_locked(clock.monotonic())
    assert waiting.done.wait(5) and isinstance(waiting.result, Lease)


# -- cost: queueing and hand-off do not look at every worker -----------------------------


class _Watched(Worker):
    """A worker that notes every read of its state, to count the workers looked at."""

    seen: ClassVar[set[str]] = set()

    def __getattribute__(self, name: str) -> Any:
        _Watched.seen.add(super().__getattribute__("id"))
        return super().__getattribute__(name)


def test_queueing_and_hand_off_in_a_full_pool_look_at_few_workers(clock, started):
    """With 1,000 workers at capacity, a task queues, and gets the next freed slot,
    without a pass over the workers (no O(n) check of candidates or wake times)."""
    workers = [
        _Watched(
            worker_config(f"w{i}", "http://127.0.0.1:9000", max_concurrent=1),
            NoTransport(),
            WorkerBreaker(f"w{i}", BREAKER, clock=clock),
            NoTransport(),
        )
        for i in range(1000)
    ]
    dispatcher = Dispatcher(clock, Selector(workers))
    leases = [dispatcher.acquire((), far(clock)) for _ in range(1000)]
    _Watched.seen.clear()
    waiting = queue(started, dispatcher, far(clock))
    assert len(_Watched.seen) <= 2
    lease = leases[700]
    assert lease is not None
    _Watched.seen.clear()
    give_back(dispatcher, lease)
    assert waiting.done.wait(5)
    assert isinstance(waiting.result, Lease) and waiting.result.worker is lease.worker
    assert _Watched.seen == {lease.worker.id}


# -- failing fast when waiting cannot help -----------------------------------------------


def test_breakers_open_past_the_deadline_with_no_early_trial_left_refuse_at_once(clock):
    """Open until after the deadline, early trial spent: refused at once, not queued."""
    a, b = make_worker(clock, "a"), make_worker(clock, "b")
    open_after_early_trial(a, clock)
    open_after_early_trial(b, clock)
    dispatcher = Dispatcher(clock, Selector([a, b]))
    got = dispatcher.acquire_or_reason((), clock.monotonic() + 10)
    assert got is Refusal.BREAKERS_OPEN and dispatcher.waiting == 0


def test_an_open_breaker_is_not_waited_for_on_the_chance_of_a_health_check(clock):
    """Open past the deadline, early trial not used: refused at once all the same (a
    health check is news the pool does not wait for); once one grants the trial, the
    next task gets it."""
    a = make_worker(clock, "a")
    a.breaker.record_failure(False)  # open for 30 s, early trial not used
    dispatcher = Dispatcher(clock, Selector([a]))
    assert dispatcher.acquire_or_reason((), clock.monotonic() + 10) is Refusal.BREAKERS_OPEN
    with dispatcher.lock:  # what the pool does when a health check passes
        a.breaker.allow_trial()
        dispatcher.release_locked(clock.monotonic())
    got = dispatcher.acquire_or_reason((), clock.monotonic() + 10)
    assert isinstance(got, Lease) and got.trial


def test_a_waiter_is_handed_the_early_trial_a_health_check_grants(clock, started):
    """A task already waiting (for a busy worker) gets an open breaker's early trial the
    moment a passing health check grants it."""
    a, busy = make_worker(clock, "a"), make_worker(clock, "busy")
    a.breaker.record_failure(False)
    busy.in_flight = busy.capacity
    dispatcher = Dispatcher(clock, Selector([a, busy]))
    waiting = queue(started, dispatcher, clock.monotonic() + 10)
    with dispatcher.lock:
        a.breaker.allow_trial()
        dispatcher.release_locked(clock.monotonic())
    assert waiting.done.wait(5)
    assert isinstance(waiting.result, Lease) and waiting.result.worker is a


def test_a_breaker_due_before_the_deadline_is_waited_for(clock, started):
    """Early trial spent, but the trial time comes before the deadline: wait for it."""
    a = make_worker(clock, "a")
    open_after_early_trial(a, clock)
    dispatcher = Dispatcher(clock, Selector([a]))
    waiting = queue(started, dispatcher, clock.monotonic() + 61)
    clock.advance(60)
    with dispatcher.lock:
        dispatcher.wake_all_locked()
    assert waiting.done.wait(5)
    assert isinstance(waiting.result, Lease) and waiting.result.trial


def test_shared_breakers_are_waited_for(clock, started):
    """With breakers shared between processes, another's trial may close one any time."""
    a = make_worker(clock, "a")
    open_after_early_trial(a, clock)
    dispatcher = Dispatcher(clock, Selector([a], shared_breakers=True))
    queue(started, dispatcher, clock.monotonic() + 10)


def test_cool_downs_past_the_deadline_refuse_at_once_and_say_so(clock):
    """A Retry-After ending after the deadline counts as unavailable; the reason names
    breakers, cool-downs, or both."""
    a, b = make_worker(clock, "a"), make_worker(clock, "b")
    a.cooldown_until = clock.monotonic() + 20
    b.cooldown_until = clock.monotonic() + 30
    dispatcher = Dispatcher(clock, Selector([a, b]))
    assert dispatcher.acquire_or_reason((), clock.monotonic() + 10) is Refusal.COOLING_DOWN
    with dispatcher.lock:
        b.cooldown_until = 0.0
        open_after_early_trial(b, clock)
        dispatcher.release_worker_locked(b, clock.monotonic())
    got = dispatcher.acquire_or_reason((), clock.monotonic() + 10)
    assert got is Refusal.BREAKERS_OPEN_OR_COOLING_DOWN
    assert dispatcher.acquire_or_reason({"a"}, clock.monotonic() + 10) is Refusal.BREAKERS_OPEN
    assert dispatcher.waiting == 0


def test_disabled_workers_and_tried_workers_leave_nothing_to_wait_for(clock):
    """Only disabled workers: no worker; the rest tried: every worker tried."""
    off = make_worker(clock, "off", enabled=False)
    dispatcher = Dispatcher(clock, Selector([off]))
    assert dispatcher.acquire_or_reason((), far(clock)) is Refusal.NO_WORKER
    a = make_worker(clock, "a")
    dispatcher.set_workers([off, a])
    assert dispatcher.acquire_or_reason({"a"}, far(clock)) is Refusal.EVERY_WORKER_TRIED


def test_a_waiter_leaves_at_once_when_its_last_hope_is_gone(clock, started):
    """Queued behind an early trial that then fails: the breaker is open past the
    deadline with no early trial left, so the waiter is refused without waiting it out."""
    a = make_worker(clock, "a", capacity=4)
    a.breaker.record_failure(False)
    a.breaker.allow_trial()
    dispatcher = Dispatcher(clock, Selector([a]))
    trial = dispatcher.acquire((), far(clock))
    assert trial is not None and trial.trial
    waiting = queue(started, dispatcher, clock.monotonic() + 10)
    give_back(dispatcher, trial, failed=True)
    assert waiting.done.wait(5)
    assert waiting.result is Refusal.BREAKERS_OPEN and dispatcher.waiting == 0


# -- interrupted waiters give their lease back -------------------------------------------


class _Interrupted(KeyboardInterrupt):
    pass


def interrupt_waiters(monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    """Make a waiter's condition raise ``_Interrupted``, as a Ctrl-C landing then would.

    ``when``: "handed" (on waking with a lease handed over by another thread), "woken"
    (on any waking), "notified" (as the waiter's own serving pass hands it a lease).
    """

    class Interrupting(threading.Condition):
        def __init__(self, lock: threading.Lock, waiter: Any) -> None:
            super().__init__(lock)
            self.waiter = waiter
            self.armed = True

        def wait(self, timeout: float | None = None) -> bool:
            woke = super().wait(timeout)
            if self.armed and (when == "woken" or (when == "handed" and self.waiter.lease)):
                self.armed = False
                raise _Interrupted
            return woke

        def notify(self, n: int = 1) -> None:
            if self.armed and when == "notified" and self.waiter.lease:
                self.armed = False
                raise _Interrupted
            super().notify(n)

    class Waiter(admission._Waiter):
        def __init__(
            self, excluded: Any, deadline: float, lock: threading.Lock, *rest: Any
        ) -> None:
            super().__init__(excluded, deadline, lock, *rest)
            self.cond = Interrupting(lock, self)

    monkeypatch.setattr(admission, "_Waiter", Waiter)


@pytest.mark.parametrize("trial", [False, True], ids=["slot", "trial"])
def test_a_lease_handed_to_an_interrupted_waiter_is_given_back(clock, started, monkeypatch, trial):
    """Interrupted as it wakes with a lease: the slot (or the half-open trial) is freed."""
    interrupt_waiters(monkeypatch, "handed")
    a = make_worker(clock, "a")
    if trial:
        a.breaker.record_failure(False)
        clock.advance(30)  # half-open: one trial at a time
    dispatcher = Dispatcher(clock, Selector([a]))
    held = dispatcher.acquire((), far(clock))
    assert held is not None and held.trial is trial
    waiting = queue(started, dispatcher, far(clock))
    with dispatcher.lock:  # the held attempt ends without a verdict: a new lease is due
        a.in_flight -= 1
        a.breaker.release(held.trial)
        dispatcher.release_worker_locked(a, clock.monotonic())
    assert waiting.done.wait(5)
    assert isinstance(waiting.error, _Interrupted)
    assert a.in_flight == 0 and dispatcher.waiting == 0
    again = dispatcher.acquire((), far(clock))
    assert again is not None and again.trial is trial


def test_an_interrupted_waiter_passes_the_lease_to_the_next_one(clock, started, monkeypatch):
    """The lease an interrupted waiter gives back goes to the waiter behind it."""
    a = make_worker(clock, "a")
    dispatcher = Dispatcher(clock, Selector([a]))
    held = dispatcher.acquire((), far(clock))
    assert held is not None
    interrupt_waiters(monkeypatch, "handed")
    first = queue(started, dispatcher, far(clock))
    monkeypatch.undo()
    second = queue(started, dispatcher, far(clock))
    give_back(dispatcher, held)
    assert first.done.wait(5) and isinstance(first.error, _Interrupted)
    assert second.done.wait(5) and isinstance(second.result, Lease)
    assert a.in_flight == 1


def test_a_waiter_interrupted_while_waiting_leaves_the_queue(clock, started, monkeypatch):
    """Interrupted with no lease: it leaves the queue, and later slots go to nobody else."""
    interrupt_waiters(monkeypatch, "woken")
    a = make_worker(clock, "a")
    dispatcher = Dispatcher(clock, Selector([a]))
    held = dispatcher.acquire((), far(clock))
    assert held is not None
    waiting = queue(started, dispatcher, far(clock))
    with dispatcher.lock:
        dispatcher.wake_all_locked()
    assert waiting.done.wait(5) and isinstance(waiting.error, _Interrupted)
    assert dispatcher.waiting == 0
    give_back(dispatcher, held)
    assert a.in_flight == 0


def test_a_waiter_interrupted_while_serving_itself_gives_the_lease_back(
    clock, started, monkeypatch
):
    """Its own serving pass hands it a lease and is interrupted: the lease is freed."""
    interrupt_waiters(monkeypatch, "notified")
    a = make_worker(clock, "a")
    dispatcher = Dispatcher(clock, Selector([a]))
    held = dispatcher.acquire((), far(clock))
    assert held is not None
    waiting = queue(started, dispatcher, far(clock))
    with dispatcher.lock:  # freed without serving anyone: the waiter serves itself on waking
        a.in_flight -= 1
        dispatcher.selector.update(a, clock.monotonic())
        dispatcher.wake_all_locked()
    assert waiting.done.wait(5) and isinstance(waiting.error, _Interrupted)
    assert a.in_flight == 0 and dispatcher.waiting == 0


def test_an_interrupt_after_the_slot_is_taken_gives_it_back(clock, monkeypatch):
    """Raised between taking the slot and returning the lease: slot and trial freed."""
    a = make_worker(clock, "a")
    a.breaker.record_failure(False)
    clock.advance(30)
    dispatcher = Dispatcher(clock, Selector([a]))

    class Interrupting:
        def add(self, value: float) -> None:
            raise _Interrupted

    monkeypatch.setattr(dispatcher, "selection_time", Interrupting())
    with pytest.raises(_Interrupted):
        dispatcher.acquire((), far(clock))
    monkeypatch.undo()
    assert a.in_flight == 0
    again = dispatcher.acquire((), far(clock))
    assert again is not None and again.trial


# -- hedges: a lease now or none ---------------------------------------------------------


def test_try_acquire_gives_a_lease_now_or_none_without_waiting(clock):
    """A hedge's lease: the best worker with room, or None at once when none has room."""
    a, b = make_worker(clock, "a"), make_worker(clock, "b")
    dispatcher = Dispatcher(clock, Selector([a, b]))
    first = dispatcher.try_acquire(())
    assert first is not None and first.in_flight == 1
    second = dispatcher.try_acquire({first.worker.id})
    assert second is not None and second.worker is not first.worker
    assert dispatcher.try_acquire(()) is None
    assert dispatcher.waiting == 0


def test_try_acquire_never_takes_a_slot_a_queued_task_waits_for(clock, started):
    """While a task waits its turn, a hedge gets nothing, even from a worker the waiter
    cannot use: hedges are extra work and must not delay anybody's first attempt."""
    a, b = make_worker(clock, "a"), make_worker(clock, "b")
    dispatcher = Dispatcher(clock, Selector([a, b]))
    held = dispatcher.acquire({"b"}, far(clock))
    assert held is not None and held.worker is a
    queue(started, dispatcher, far(clock), excluded={"b"})
    assert dispatcher.try_acquire(()) is None
    assert b.in_flight == 0


def test_a_lease_carries_the_workers_in_flight_count_with_it(clock):
    """Lease.in_flight is the count an adaptive limit samples: this task included."""
    a = make_worker(clock, "a", capacity=4)
    dispatcher = Dispatcher(clock, Selector([a]))
    counts = [dispatcher.acquire((), far(clock)).in_flight for _ in range(3)]
    assert counts == [1, 2, 3]


def test_a_worker_becoming_busy_starts_its_stall_clock(clock):
    """Latency-aware: the first task on an idle worker marks when it became busy, and
    when its silence would exceed its estimate."""
    a = make_worker(clock, "a", capacity=4)
    selector = Selector([a], latency_aware=True, now=clock.monotonic())
    selector.observe(a, 0.05, clock.monotonic())
    dispatcher = Dispatcher(clock, selector)
    clock.advance(1.0)
    now = clock.monotonic()
    dispatcher.acquire((), far(clock))
    balance = selector.state_of(a)
    assert balance.busy_since == now
    assert balance.stall_after == pytest.approx(now + 0.05)  # the estimate as last observed
    clock.advance(0.5)
    dispatcher.acquire((), far(clock))
    assert balance.busy_since == now  # still busy since then: the second task changes nothing


# -- the queue per model (placement's sign of queueing) ------------------------------------


def test_a_waiting_task_is_counted_under_the_model_it_names(clock):
    """A task naming m waits 3 s and is served: 3 task-seconds under m; a task naming
    no model waits too and is counted nowhere."""
    a = make_worker(clock, "a")
    dispatcher = Dispatcher(clock, Selector([a]))
    lease = dispatcher.acquire((), far(clock))
    assert isinstance(lease, Lease)
    got: dict[str, Any] = {}

    def wait(name: str, model: str | None) -> None:
        got[name] = dispatcher.acquire_or_reason((), far(clock), model=model)

    named = threading.Thread(target=wait, args=("named", "m"))
    named.start()
    wait_until(lambda: dispatcher.waiting == 1)
    plain = threading.Thread(target=wait, args=("plain", None))
    plain.start()
    wait_until(lambda: dispatcher.waiting == 2)
    assert dispatcher.queued.waiting("m") == 1
    clock.advance(3)
    give_back(dispatcher, lease)
    named.join(5)
    assert isinstance(got["named"], Lease)
    assert dispatcher.queued.take(clock.monotonic()) == {"m": pytest.approx(3.0)}
    clock.advance(2)
    give_back(dispatcher, got["named"])
    plain.join(5)
    assert isinstance(got["plain"], Lease)
    assert dispatcher.queued.take(clock.monotonic()) == {}
    give_back(dispatcher, got["plain"])
