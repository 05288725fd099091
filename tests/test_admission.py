"""Unit tests of admission: leases, FIFO hand-off, and what waiting costs."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any, ClassVar

import pytest

from npu_sync.admission import Dispatcher, Lease
from npu_sync.breaker import WorkerBreaker
from npu_sync.config import BreakerConfig, worker_config
from npu_sync.selector import Selector
from npu_sync.testing import FakeClock
from npu_sync.worker import Worker

BREAKER = BreakerConfig(fail_max=1, reset_timeout=30, max_reset_timeout=600)


class _NoTransport:
    def request(self, *args, **kwargs):  # pragma: no cover - admission never sends
        raise AssertionError("admission must not do I/O")

    def close(self) -> None:
        pass


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
    return Worker(cfg, _NoTransport(), breaker, _NoTransport())


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
    """``acquire`` running on a thread of its own."""

    def __init__(
        self, dispatcher: Dispatcher, deadline: float, excluded: Collection[str] = ()
    ) -> None:
        self.dispatcher = dispatcher
        self.deadline = deadline
        self.result: Lease | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(excluded,))
        self.thread.start()

    def _run(self, excluded: Collection[str]) -> None:
        try:
            self.result = self.dispatcher.acquire(excluded, self.deadline)
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


# -- basic contract ----------------------------------------------------------------------


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
    a.healthy = False
    waiting = queue(started, dispatcher, far(clock))
    with dispatcher.lock:
        a.healthy = True
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
            _NoTransport(),
            WorkerBreaker(f"w{i}", BREAKER, clock=clock),
            _NoTransport(),
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
