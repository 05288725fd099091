"""Attacks on priority classes: the pass that hands freed capacity to tasks of several
classes waiting does bounded work under the pool's lock however long the queue (see
benchmarks/serve_cost.py); aging wakes a waiter only while it can gain something; a
map's tasks keep the class of the scope it was started in."""

from __future__ import annotations

from typing import Any

import pytest

from npu_sync._admission import Lease
from npu_sync._priority import PriorityClasses
from npu_sync.testing import FakeClock
from tests.test_priority import classes, clock, dispatcher_with, free, take, until, waiting

__all__ = ["clock", "waiting"]  # fixtures used by name below

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
