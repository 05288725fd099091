"""Admission against real reference workers: deadline-aware refusal under a saturated
fleet."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any

import pytest

from npu_sync import AdmissionRefused, NoWorkerAvailable, Task, TaskFailed, WorkerPool
from npu_sync.config import (
    AdmissionConfig,
    ClassConfig,
    HealthConfig,
    PoolConfig,
    PoolSettings,
    PriorityConfig,
    RetryConfig,
    TimeoutConfig,
    worker_config,
)

pytestmark = pytest.mark.integration


def _config(workers: list[Any], *, capacity: int = 2, **kw: Any) -> PoolConfig:
    return PoolConfig(
        workers=tuple(worker_config(w.worker_id, w.url, max_concurrent=capacity) for w in workers),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=2, backoff_initial=0.01, backoff_max=0.05),
        timeouts=TimeoutConfig(connect=2.0, read=10.0, task=30.0),
        pool=PoolSettings(threads=32),
        **kw,
    )


def _payload(i: object) -> dict[str, Any]:
    return {"model_id": "default", "input_text": f"task {i}"}


def _until(condition: Any, timeout: float = 10.0) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` passes (a generous deadline)."""
    done = threading.Event()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        done.wait(0.005)
    return bool(condition())


def _saturate(pool: WorkerPool, worker: Any, n: int) -> list[concurrent.futures.Future[Any]]:
    """``n`` tasks: two running on the worker, the rest queued in the pool."""
    futures = [pool.submit(_payload(i)) for i in range(n)]
    assert _until(lambda: worker.stats()["in_flight"] == 2)
    dispatcher = pool._state.dispatcher
    assert _until(lambda: dispatcher.waiting >= n - 4)
    return futures


def test_a_task_that_cannot_make_its_deadline_is_refused_while_the_queue_is_full(
    start_worker,
) -> None:
    """A saturated real worker and 0.4 s left: AdmissionRefused at once, nothing sent,
    no dead letter, while the tasks ahead are still queued."""
    worker = start_worker(worker_id="w", latency_ms=150, slots=2)
    with WorkerPool(_config([worker])) as pool:
        for i in range(6):  # the pool learns the worker takes ~150 ms
            pool.execute(_payload(f"warm {i}"))
        futures = _saturate(pool, worker, 16)
        task = Task(_payload("late"), timeout=0.4)
        with pytest.raises(AdmissionRefused, match=r"refused on admission: expected \d+\.\d s"):
            pool.execute(task)
        # Refused before the queue ahead moved on: most of it is still waiting.
        assert pool._state.dispatcher.waiting >= 8
        assert pool.dead_letters.list() == []
        results = [f.result(30) for f in futures]
        stats = worker.stats()
    assert all(r["model_id"] == "default" for r in results)
    # Nothing was ever sent for the refused task: 6 warm-up tasks and 16 queued ones.
    assert stats["task_ids_seen"] == 6 + 16
    assert stats["duplicates"] == 0


def test_with_the_key_off_the_same_task_waits_and_fails_into_the_dead_letter_queue(
    start_worker,
) -> None:
    """admission.deadline_aware: false: the task waits out its deadline, then is dead-lettered."""
    worker = start_worker(worker_id="w", latency_ms=150, slots=2)
    config = _config([worker], admission=AdmissionConfig(deadline_aware=False))
    with WorkerPool(config) as pool:
        for i in range(6):
            pool.execute(_payload(f"warm {i}"))
        futures = _saturate(pool, worker, 16)
        with pytest.raises(TaskFailed) as caught:
            pool.execute(Task(_payload("late"), timeout=0.4))
        assert isinstance(caught.value, NoWorkerAvailable)
        assert caught.value.dead_letter_id is not None
        assert len(pool.dead_letters.list()) == 1
        for f in futures:
            f.result(30)


def test_a_fresh_pool_lets_the_task_in(start_worker) -> None:
    """No answers yet: no expectation, the task waits its turn and succeeds."""
    worker = start_worker(worker_id="w", latency_ms=150, slots=2)
    with WorkerPool(_config([worker])) as pool:
        futures = [pool.submit(_payload(i)) for i in range(4)]
        assert _until(lambda: worker.stats()["in_flight"] == 2)
        assert pool.execute(Task(_payload("in"), timeout=10))["model_id"] == "default"
        for f in futures:
            f.result(30)


def _classes_config(workers: list[Any], aging: float) -> PoolConfig:
    from npu_sync.config import ClassConfig, PriorityConfig

    return _config(
        workers,
        priority=PriorityConfig(
            classes=(ClassConfig("interactive"), ClassConfig("standard"), ClassConfig("batch")),
            default="standard",
            aging=aging,
        ),
    )


def _stream(pool: WorkerPool, stop: threading.Event, served: list[int]) -> None:
    """Interactive tasks back to back until ``stop``."""
    while not stop.is_set():
        pool.execute(Task(_payload("interactive"), priority="interactive"))
        served.append(1)


@pytest.mark.parametrize("aging", [0.2, 0.0])
def test_a_batch_task_behind_a_stream_of_interactive_ones(start_worker, aging: float) -> None:
    """With aging the batch task is served while interactive tasks keep coming; without,
    the stream takes every slot and the batch task runs out of time."""
    worker = start_worker(worker_id="w", latency_ms=50, slots=2)
    with WorkerPool(_classes_config([worker], aging)) as pool:
        for i in range(6):
            pool.execute(_payload(f"warm {i}"))
        stop = threading.Event()
        served: list[int] = []
        stream = [threading.Thread(target=_stream, args=(pool, stop, served)) for _ in range(4)]
        for t in stream:
            t.start()
        try:
            dispatcher = pool._state.dispatcher
            assert _until(lambda: dispatcher.waiting >= 2)  # interactive tasks queue
            before = len(served)
            task = Task(_payload("batch"), priority="batch", timeout=3.0)
            if aging:
                assert pool.execute(task)["model_id"] == "default"
                # Served while the stream went on: interactive tasks were answered
                # meanwhile and still wait now.
                assert len(served) > before and not stop.is_set()
            else:
                with pytest.raises(TaskFailed, match=r"no worker could take the task|deadline"):
                    pool.execute(task)
                assert len(served) > before + 20
        finally:
            stop.set()
            for t in stream:
                t.join(30)
        assert not any(t.is_alive() for t in stream)


def test_interactive_tasks_overtake_a_queue_of_batch_ones(start_worker) -> None:
    """16 batch tasks queued on a saturated worker: an interactive task comes next."""
    worker = start_worker(worker_id="w", latency_ms=100, slots=2)
    with WorkerPool(_classes_config([worker], 0.0)) as pool:
        order: list[str] = []
        lock = threading.Lock()

        def run(name: str, priority: str) -> None:
            pool.execute(Task(_payload(name), priority=priority))
            with lock:
                order.append(name)

        batch = [threading.Thread(target=run, args=(f"b{i}", "batch")) for i in range(16)]
        for t in batch:
            t.start()
        dispatcher = pool._state.dispatcher
        assert _until(lambda: dispatcher.waiting >= 12)
        run("interactive", "interactive")
        with lock:
            done_before = len(order) - 1
        for t in batch:
            t.join(30)
    # Answered after at most the two batch tasks in flight and the two that took their
    # slots as the interactive task joined (the worker has two slots): not the 12 queued.
    assert done_before <= 4
    assert order.index("interactive") == done_before


# -- the routing trace -----------------------------------------------------------------


def test_the_trace_of_a_task_retried_after_a_worker_failure(start_worker) -> None:
    """a answers 503, b answers: the trace names both workers, why b waited, and a's charge."""
    from npu_sync.trace import Trace

    a, b = start_worker(worker_id="a"), start_worker(worker_id="b")
    a.control(status_code=503)
    config = PoolConfig(
        workers=(
            worker_config("a", a.url, priority=1),
            worker_config("b", b.url, priority=2),
        ),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=2, backoff_initial=0.0, backoff_max=0.0),
    )
    trace = Trace()
    with WorkerPool(config) as pool:
        assert pool.execute(_payload("traced"), trace=trace)["model_id"] == "default"
    assert trace.workers == ["a", "b"]
    choice_a, failed, choice_b, answered = trace.steps
    assert dict(choice_a.considered) == {"b": "lower tier (priority 2 after 1)"}
    assert (failed.status, failed.charged) == (503, "a")
    assert dict(choice_b.considered) == {"a": "excluded: already tried by this task"}
    assert answered.outcome == "success"


def test_the_trace_of_a_hedged_task(start_worker) -> None:
    """A slow first worker and a hedge to a fast one: the trace shows the hedge and who answered."""
    from npu_sync.config import BalancingConfig, HedgeConfig
    from npu_sync.trace import Trace

    slow, fast = start_worker(worker_id="slow", latency_ms=3000), start_worker(worker_id="fast")
    config = PoolConfig(
        workers=(
            worker_config("slow", slow.url, priority=1),
            worker_config("fast", fast.url, priority=2),
        ),
        health=HealthConfig(enabled=False),
        balancing=BalancingConfig(hedge=HedgeConfig(enabled=True, delay=0.05)),
    )
    trace = Trace()
    with WorkerPool(config) as pool:
        pool.execute(Task(_payload("hedged"), idempotent=True), trace=trace)
    kinds = [(s.kind, s.worker_id) for s in trace.steps]
    assert kinds[:2] == [("choice", "slow"), ("hedge", "fast")]
    assert ("attempt", "fast") in kinds
    assert next(s for s in trace.steps if s.kind == "attempt").outcome == "success"


def test_a_forked_child_keeps_the_classes_and_orders_its_own_queue(start_worker) -> None:
    """After fork() the child's pool knows the classes (an unknown one is refused there)
    and serves its tasks; the parent's pool goes on as before."""
    from tests.integration.test_fork import run_in_child

    worker = start_worker(worker_id="w", latency_ms=20, slots=2)
    with WorkerPool(_classes_config([worker], 1.0)) as pool:
        pool.execute(Task(_payload("parent"), priority="batch"))

        def child() -> dict[str, Any]:
            answered = pool.execute(Task(_payload("child"), priority="interactive"))
            try:
                pool.execute(Task(_payload("child"), priority="urgent"))
            except Exception as exc:  # the child reports, the parent asserts
                refused = f"{type(exc).__name__}: {exc}"
            else:
                refused = ""
            return {"model": answered["model_id"], "refused": refused}

        got = run_in_child(child)
        assert pool.execute(Task(_payload("parent again"), priority="batch"))["model_id"]
    assert got["model"] == "default"
    assert got["refused"].startswith("InvalidTask: task priority 'urgent' is not a class")


# Attacks on priority classes, deadline-aware admission and the routing trace, against real
# reference workers.


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
