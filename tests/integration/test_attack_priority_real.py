"""Attacks on priority classes, deadline-aware admission and the routing trace, against
real reference workers on loopback ports."""

from __future__ import annotations

from typing import Any

import pytest

from npu_sync import Task, WorkerPool
from npu_sync.config import (
    ClassConfig,
    HealthConfig,
    PoolConfig,
    PriorityConfig,
    RetryConfig,
    TimeoutConfig,
    worker_config,
)

pytestmark = pytest.mark.integration


def _payload(i: object) -> dict[str, Any]:
    return {"model_id": "default", "input_text": f"task {i}"}


@pytest.mark.parametrize(
    ("capacity", "reserves"),
    [
        (1, (0.2, 0.0)),  # one slot: a reserve of any size would be all of it
        (8, (0.5, 0.45)),  # reserves adding up to 0.95 of 8 slots: ceil(7.6) = 8
    ],
)
def test_a_reserve_never_keeps_the_lowest_class_off_an_idle_worker(
    start_worker, capacity: int, reserves: tuple[float, float]
) -> None:
    """Reserves the configuration accepts, no aging, nothing else running: a batch task
    is answered at once instead of waiting out its deadline beside an idle worker."""
    worker = start_worker(worker_id="w", latency_ms=10)
    interactive, standard = reserves
    config = PoolConfig(
        workers=(worker_config("w", worker.url, max_concurrent=capacity),),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=0),
        timeouts=TimeoutConfig(connect=2.0, read=10.0, task=30.0),
        priority=PriorityConfig(
            classes=(
                ClassConfig("interactive", interactive),
                ClassConfig("standard", standard),
                ClassConfig("batch"),
            ),
            aging=0.0,
        ),
    )
    with WorkerPool(config) as pool:
        answered = pool.execute(Task(_payload("batch"), priority="batch", timeout=5.0))
    assert answered["model_id"] == "default"
    assert worker.stats()["task_ids_seen"] == 1


def test_a_failed_tasks_error_and_trace_cross_a_process_boundary(start_worker) -> None:
    """TaskFailed (with its trace), TaskRejected and AdmissionRefused survive pickling,
    as concurrent.futures.ProcessPoolExecutor and multiprocessing do to an exception a
    child raises; the trace still reads and serialises, and still takes steps."""
    import json
    import pickle

    from npu_sync import AdmissionRefused, TaskFailed, TaskRejected
    from npu_sync.trace import Trace, TraceStep

    a, b = start_worker(worker_id="a"), start_worker(worker_id="b")
    a.control(status_code=503)
    b.control(status_code=503)
    config = PoolConfig(
        workers=(worker_config("a", a.url), worker_config("b", b.url)),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=1, backoff_initial=0.0, backoff_max=0.0),
    )
    with WorkerPool(config) as pool, pytest.raises(TaskFailed) as caught:
        pool.execute(_payload("doomed"))
    failed = caught.value
    assert failed.trace is not None and sorted(failed.trace.workers) == ["a", "b"]
    again = pickle.loads(pickle.dumps(failed))
    assert type(again) is type(failed) and str(again) == str(failed)
    assert (again.task_id, again.dead_letter_id) == (failed.task_id, failed.dead_letter_id)
    assert again.attempts == failed.attempts
    assert again.trace is not None and again.trace.to_dict() == failed.trace.to_dict()
    assert json.loads(json.dumps(again.trace.to_dict())) == failed.trace.to_dict()
    again.trace.add(TraceStep("note", 0.0, text="read in the parent"))  # its lock works
    assert len(again.trace.steps) == len(failed.trace.steps) + 1

    rejected = TaskRejected("bad", task_id="t", status=422, worker_id="a", body={"x": 1})
    back = pickle.loads(pickle.dumps(rejected))
    assert (back.task_id, back.status, back.worker_id, back.body) == ("t", 422, "a", {"x": 1})
    refused = AdmissionRefused("late", task_id="t", expected=3.0, left=1.0)
    back_refused = pickle.loads(pickle.dumps(refused))
    assert isinstance(back_refused, AdmissionRefused)
    assert (back_refused.expected, back_refused.left) == (3.0, 1.0)
    assert pickle.loads(pickle.dumps(Trace("t"))).task_id == "t"


def _fail_in_child(url: str) -> None:
    """Run in a child process: a task on a worker that answers 503 only."""
    config = PoolConfig(
        workers=(worker_config("a", url),),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=0),
    )
    with WorkerPool(config) as pool:
        pool.execute(_payload("from a child"))


def test_a_child_process_task_failure_reaches_the_parent_as_task_failed(start_worker) -> None:
    """ProcessPoolExecutor: the child's TaskFailed arrives whole in the parent (not a
    broken executor), its trace naming the worker that failed."""
    import concurrent.futures
    import multiprocessing

    from npu_sync import TaskFailed

    a = start_worker(worker_id="a")
    a.control(status_code=503)
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as executor:
        future = executor.submit(_fail_in_child, a.url)
        with pytest.raises(TaskFailed) as caught:
            future.result(120)
        assert executor.submit(len, "still works").result(120) == 11
    assert caught.value.trace is not None and caught.value.trace.workers == ["a"]
    assert caught.value.dead_letter_id


def test_a_header_value_a_worker_echoes_reaches_no_trace(monkeypatch) -> None:
    """a quotes the X-Api-Key it was sent in its 503s: the caller's trace of a task b
    then answers, and the trace and dead letter of a task every worker fails, hold the
    redaction and never the key."""
    import json

    from npu_sync import TaskFailed
    from npu_sync._redact import REDACTED
    from npu_sync.trace import Trace
    from npu_sync.worker_server import WorkerBehaviour, WorkerServer

    key = "k3y-5ecret-8d1f0c2b9e"
    echo = WorkerBehaviour(fail_all=True, echo_header="X-Api-Key")
    with (
        WorkerServer(worker_id="a", behaviour=echo) as a,
        WorkerServer(worker_id="b") as b,
        WorkerServer(worker_id="c", behaviour=WorkerBehaviour(fail_all=True)) as c,
    ):
        headers = {"X-Api-Key": key}
        config = PoolConfig(
            workers=(
                worker_config("a", a.url, priority=1, headers=headers),
                worker_config("b", b.url, priority=2, headers=headers),
            ),
            health=HealthConfig(enabled=False),
            retry=RetryConfig(max_retries=2, backoff_initial=0.0, backoff_max=0.0),
        )
        trace = Trace()
        with WorkerPool(config) as pool:
            pool.execute(_payload("traced"), trace=trace)
        failing = PoolConfig(
            workers=(
                worker_config("a", a.url, priority=1, headers=headers),
                worker_config("c", c.url, priority=2, headers=headers),
            ),
            health=HealthConfig(enabled=False),
            retry=RetryConfig(max_retries=2, backoff_initial=0.0, backoff_max=0.0),
        )
        with WorkerPool(failing) as pool:
            with pytest.raises(TaskFailed) as caught:
                pool.execute(_payload("doomed"))
            letters = [json.dumps(r.to_dict()) for r in pool.dead_letters.list()]
    assert trace.workers == ["a", "b"]
    failed = caught.value.trace
    assert failed is not None and "a" in failed.workers
    surfaces = {
        "caller's trace": str(trace) + json.dumps(trace.to_dict()),
        "TaskFailed.trace": str(failed) + json.dumps(failed.to_dict()),
        "dead letter": "".join(letters),
    }
    assert REDACTED in surfaces["caller's trace"] and REDACTED in surfaces["dead letter"]
    for where, text in surfaces.items():
        assert key not in text, f"the key reached {where}"


def test_the_trace_names_a_breaker_that_opened_during_the_task(start_worker) -> None:
    """Three real workers, a and b failing with fail_max 1: the first task's trace
    charges each failure and ends on c; the next task's first choice names a and b as
    behind open breakers."""
    from npu_sync.config import BreakerConfig
    from npu_sync.trace import Trace

    a, b, c = (start_worker(worker_id=w) for w in "abc")
    a.control(status_code=503)
    b.control(status_code=503)
    config = PoolConfig(
        workers=(
            worker_config("a", a.url, priority=1),
            worker_config("b", b.url, priority=2),
            worker_config("c", c.url, priority=3),
        ),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=2, backoff_initial=0.0, backoff_max=0.0),
        circuit_breaker=BreakerConfig(fail_max=1, reset_timeout=60, max_reset_timeout=600),
    )
    first, second = Trace(), Trace()
    with WorkerPool(config) as pool:
        pool.execute(_payload("first"), trace=first)
        pool.execute(_payload("second"), trace=second)
    assert first.workers == ["a", "b", "c"]
    charges = [s.charged for s in first.steps if s.kind == "attempt"]
    assert charges == ["a", "b", "nobody"]
    last_choice = [s for s in first.steps if s.kind == "choice"][-1]
    assert dict(last_choice.considered) == {
        "a": "excluded: already tried by this task",
        "b": "excluded: already tried by this task",
    }
    assert second.workers == ["c"]
    assert dict(second.steps[0].considered) == {"a": "breaker open", "b": "breaker open"}


_OPEN_AND_ADD = """
import os, sys, time
go, path, n = sys.argv[1], sys.argv[2], sys.argv[3]
from npu_sync._deadletter import DeadLetter, SQLiteDeadLetterStore
from npu_sync.task import Task
deadline = time.monotonic() + 60
while not os.path.exists(go):
    if time.monotonic() > deadline:
        sys.exit("no go")
    time.sleep(0.001)
store = SQLiteDeadLetterStore(path)
trace = {"task_id": n, "steps": [{"kind": "note", "at": 1.0, "text": "from " + n}]}
store.add(DeadLetter.from_task(
    Task({"x": n}, task_id=n), endpoint="/inference", error="boom", attempts=(), now=1.0,
    trace=trace,
))
store.close()
"""


def test_processes_opening_an_old_dead_letter_file_at_once_each_add_the_trace_column_once(
    tmp_path,
) -> None:
    """Six processes open a schema-1 file made before the trace column, released at the
    same moment: every one opens it and stores its record, trace included."""
    import os
    import sqlite3
    import subprocess
    import sys

    from npu_sync._deadletter import _SCHEMA, SCHEMA_VERSION, SQLiteDeadLetterStore

    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(path)
    for statement in _SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    conn.commit()
    conn.close()
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _OPEN_AND_ADD, str(go), str(path), f"t{i}"],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(6)
    ]
    go.touch()
    errors = [child.communicate(timeout=120)[1] for child in children]
    assert [child.returncode for child in children] == [0] * 6, errors
    store = SQLiteDeadLetterStore(str(path))
    try:
        traces = sorted(r.trace["task_id"] for r in store.list() if r.trace)
    finally:
        store.close()
    assert traces == [f"t{i}" for i in range(6)]
