"""Events and hooks: what a pool reports, in order, and that hooks cannot hurt it."""

from __future__ import annotations

import logging

import pytest

from npu_sync import TaskFailed, TaskRejected, WorkerPool
from npu_sync.config import BreakerConfig, HealthConfig, PoolConfig, RetryConfig, worker_config
from npu_sync.events import (
    AttemptFinished,
    BreakerStateChanged,
    ConfigReloaded,
    Event,
    RetryScheduled,
    TaskDeadLettered,
    TaskRejectedEvent,
    TaskStarted,
    TaskSucceeded,
    WorkerHealthChanged,
)
from npu_sync.testing import FakeClock, FakeNetwork, json_response


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)

    def names(self) -> list[str]:
        return [e.name for e in self.events]


def make_pool(net, *ids, hooks=(), **kw) -> WorkerPool:
    workers = tuple(
        worker_config(w, f"http://127.0.0.1:{9600 + i}", priority=i + 1) for i, w in enumerate(ids)
    )
    kw.setdefault("health", HealthConfig(enabled=False))
    kw.setdefault("retry", RetryConfig(max_retries=3, backoff_initial=0.01, backoff_max=0.01))
    config = PoolConfig(workers=workers, **kw)
    return WorkerPool(config, transport_factory=net.factory, clock=FakeClock(), hooks=hooks)


def test_a_successful_task_reports_start_attempt_success_in_order():
    """One task on a healthy worker: started, attempt finished, succeeded."""
    rec = Recorder()
    with make_pool(FakeNetwork(), "a", hooks=[rec]) as pool:
        pool.execute({"x": 1})
    assert rec.names() == ["task.started", "attempt.finished", "task.succeeded"]
    started, attempt, done = rec.events
    assert isinstance(started, TaskStarted) and started.endpoint == "/inference"
    assert isinstance(attempt, AttemptFinished) and attempt.outcome == "success"
    assert isinstance(done, TaskSucceeded) and done.worker_id == "a" and done.attempts == 1
    assert started.task_id == attempt.task_id == done.task_id


def test_a_retried_task_reports_the_failure_the_retry_and_the_success():
    """A failure on one worker, then success on the next, in that order."""
    net = FakeNetwork()
    net.route("a", lambda req: json_response(503, {"detail": "busy"}))
    rec = Recorder()
    with make_pool(net, "a", "b", hooks=[rec]) as pool:
        pool.execute({"x": 1})
    assert rec.names() == [
        "task.started",
        "attempt.finished",
        "retry.scheduled",
        "attempt.finished",
        "task.succeeded",
    ]
    retry = rec.events[2]
    assert isinstance(retry, RetryScheduled) and retry.worker_id == "a" and retry.attempt == 1
    assert [e.outcome for e in rec.events if isinstance(e, AttemptFinished)] == [
        "failure",
        "success",
    ]


def test_breaker_dead_letter_and_rejection_events():
    """Breaker transitions, dead letters and rejections reach hooks with their details."""
    net = FakeNetwork()
    net.route("a", lambda req: json_response(500, {"detail": "down"}))
    rec = Recorder()
    breaker = BreakerConfig(fail_max=1, reset_timeout=60)
    with make_pool(net, "a", hooks=[rec], circuit_breaker=breaker) as pool:
        with pytest.raises(TaskFailed) as info:
            pool.execute({"x": 1})
        net.route("a", lambda req: json_response(422, {"detail": "bad"}))
        pool.workers()  # nothing emitted by reading
    changes = [e for e in rec.events if isinstance(e, BreakerStateChanged)]
    assert [(e.worker_id, e.old, e.new) for e in changes] == [("a", "closed", "open")]
    (dead,) = [e for e in rec.events if isinstance(e, TaskDeadLettered)]
    assert dead.record_id == info.value.dead_letter_id and dead.attempts == 1

    rec2 = Recorder()
    with make_pool(net, "b", hooks=[rec2]) as pool:
        net.route("b", lambda req: json_response(422, {"detail": "bad input"}))
        with pytest.raises(TaskRejected):
            pool.execute({"x": 1})
    (rejected,) = [e for e in rec2.events if isinstance(e, TaskRejectedEvent)]
    assert rejected.status == 422 and "bad input" in rejected.reason


def test_health_and_reload_events():
    """A worker turning unhealthy and a reload are reported."""
    net = FakeNetwork()
    net.route("a", lambda req: json_response(503, {"status": "down"}))
    rec = Recorder()
    health = HealthConfig(enabled=False, unhealthy_threshold=1)
    with make_pool(net, "a", hooks=[rec], health=health) as pool:
        pool.check_health()
        pool.reload(PoolConfig(workers=(), health=health))
    (changed,) = [e for e in rec.events if isinstance(e, WorkerHealthChanged)]
    assert changed.worker_id == "a" and changed.healthy is False and "503" in changed.error
    (reloaded,) = [e for e in rec.events if isinstance(e, ConfigReloaded)]
    assert reloaded.changes["removed"] == ["a"]


def test_a_failing_hook_never_fails_a_task(caplog):
    """A hook that raises is logged; the task still returns its result."""

    def broken(event: Event) -> None:
        raise RuntimeError("hook bug")

    rec = Recorder()
    with make_pool(FakeNetwork(), "a", hooks=[broken, rec]) as pool:
        assert pool.execute({"x": 1}) == {"ok": True, "worker_id": "a"}
    assert rec.names()[-1] == "task.succeeded"  # later hooks still ran
    assert "hook bug" in caplog.text


def test_hooks_can_be_added_and_removed_at_run_time():
    """add_hook starts delivery, remove_hook stops it."""
    rec = Recorder()
    with make_pool(FakeNetwork(), "a") as pool:
        pool.execute({"x": 1})
        pool.add_hook(rec)
        pool.execute({"x": 2})
        pool.remove_hook(rec)
        pool.execute({"x": 3})
    assert rec.names() == ["task.started", "attempt.finished", "task.succeeded"]


def test_logging_uses_stable_event_names(caplog):
    """Notable events are logged under their names, with the event as structured extra."""
    net = FakeNetwork()
    net.route("a", lambda req: json_response(500, {"detail": "down"}))
    pool = make_pool(net, "a")
    with caplog.at_level(logging.INFO, logger="npu_sync"), pool, pytest.raises(TaskFailed):
        pool.execute({"x": 1})
    by_name = {r.npu_event["event"]: r for r in caplog.records if hasattr(r, "npu_event")}
    assert "task.dead_lettered" in by_name
    assert by_name["task.dead_lettered"].levelno == logging.WARNING
    assert by_name["task.dead_lettered"].getMessage().startswith("task.dead_lettered ")


def test_events_serialise_to_dicts_with_their_name():
    """to_dict() carries the stable name and every field."""
    event = TaskSucceeded(1.5, "t1", "w1", 2, 0.25)
    assert event.to_dict() == {
        "event": "task.succeeded",
        "at": 1.5,
        "task_id": "t1",
        "worker_id": "w1",
        "attempts": 2,
        "duration": 0.25,
    }
