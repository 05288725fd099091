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
    HealthConfig,
    PoolConfig,
    PoolSettings,
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
