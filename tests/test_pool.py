"""Unit tests of WorkerPool over a fake network: lifecycle, retries, admission."""

from __future__ import annotations

import concurrent.futures
import inspect
import threading

import pytest

from npu_sync import Task, TaskFailed, TaskRejected, WorkerPool, npu_task
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    PoolSettings,
    RetryConfig,
    worker_config,
)
from npu_sync.errors import InvalidTask, NoWorkerAvailable, PoolClosed
from npu_sync.testing import FakeClock, FakeNetwork, json_response
from npu_sync.transport import Response, TransportError


def make_config(*ids: str, priorities=None, capacity: int = 8, **kw) -> PoolConfig:
    priorities = priorities or [1] * len(ids)
    workers = tuple(
        worker_config(i, f"http://127.0.0.1:{9100 + n}", priority=p, max_concurrent=capacity)
        for n, (i, p) in enumerate(zip(ids, priorities, strict=True))
    )
    kw.setdefault("health", HealthConfig(enabled=False))
    kw.setdefault("retry", RetryConfig(max_retries=3, backoff_initial=0.01, backoff_max=0.1))
    kw.setdefault(
        "circuit_breaker", BreakerConfig(fail_max=2, reset_timeout=30, max_reset_timeout=60)
    )
    return PoolConfig(workers=workers, **kw)


@pytest.fixture
def net():
    return FakeNetwork()


def make_pool(net, *ids, clock=None, **kw):
    return WorkerPool(
        make_config(*ids, **kw), transport_factory=net.factory, clock=clock or FakeClock()
    )


def failing(status=500, detail="boom", headers=None):
    return lambda req: json_response(status, {"detail": detail}, headers)


def test_execute_returns_the_workers_json_and_sends_task_headers(net):
    """execute() returns the decoded body; the task id and attempt number are sent."""
    net.route("a", lambda req: json_response(200, {"echo": req.json()}))
    with make_pool(net, "a") as pool:
        task = Task({"model_id": "default", "input_text": "hi"}, task_id="t-1")
        assert pool.execute(task) == {"echo": {"model_id": "default", "input_text": "hi"}}
    (req,) = net.requests("a")
    assert req.method == "POST" and req.path == "/inference"
    assert req.headers["X-NPU-Task-Id"] == "t-1" and req.headers["X-NPU-Attempt"] == "1"


def test_a_bare_payload_goes_to_the_default_endpoint_and_a_task_to_its_own(net):
    """Tasks may name another endpoint; payloads use pool.default_endpoint."""
    with make_pool(net, "a") as pool:
        pool.execute({"x": 1})
        pool.execute(Task({"x": 2}, endpoint="/echo"))
    assert [r.path for r in net.requests("a")] == ["/inference", "/echo"]


def test_each_retry_goes_to_a_worker_not_yet_tried_with_the_same_task_id(net):
    """A failing task visits distinct workers, same X-NPU-Task-Id, attempts numbered."""
    for wid in "abc":
        net.route(wid, failing())
    net.route("d", lambda req: json_response(200, {"ok": True}))
    with make_pool(net, "a", "b", "c", "d", priorities=[1, 1, 1, 2]) as pool:
        assert pool.execute({"x": 1}) == {"ok": True}
    reqs = net.requests()
    assert len(reqs) == 4
    assert len({r.worker_id for r in reqs}) == 4
    assert {r.headers["X-NPU-Task-Id"] for r in reqs} == {reqs[0].headers["X-NPU-Task-Id"]}
    assert [r.headers["X-NPU-Attempt"] for r in reqs] == ["1", "2", "3", "4"]


def test_4xx_from_two_workers_rejects_after_two_attempts_without_touching_the_breaker(net):
    """A 422 from two workers is the task's: TaskRejected, breakers closed, no dead letter."""
    for wid in "ab":
        net.route(wid, failing(422, "input_text missing"))
    with make_pool(net, "a", "b") as pool:
        for _ in range(5):
            with pytest.raises(TaskRejected, match="input_text missing") as info:
                pool.execute({"x": 1})
        assert info.value.status == 422 and info.value.worker_id in ("a", "b")
        workers = {w["id"]: w for w in pool.workers()}
        assert all(
            w["breaker"]["state"] == "closed" and w["breaker"]["failures"] == 0
            for w in workers.values()
        )
        assert len(pool.dead_letters) == 0
        assert pool.stats()["tasks"]["rejected"] == 5
    # A second worker is asked once: its agreement makes the refusal the task's.
    assert len(net.requests("a")) == len(net.requests("b")) == 5


def test_model_not_loaded_anywhere_is_rejected_and_blames_no_worker(net):
    """'Model X not loaded' from every worker → TaskRejected naming X; breakers stay closed."""
    for wid in "abc":
        net.route(wid, failing(500, "Model typo-model not loaded"))
    with make_pool(net, "a", "b", "c") as pool:
        for _ in range(10):
            with pytest.raises(TaskRejected, match="typo-model"):
                pool.execute({"model_id": "typo-model", "input_text": "x"})
        assert all(w["breaker"]["state"] == "closed" for w in pool.workers())
        assert all(w["breaker"]["failures"] == 0 for w in pool.workers())
        assert len(pool.dead_letters) == 0


def test_model_not_loaded_on_one_worker_is_served_by_another(net):
    """A worker without the model passes the task on without counting a failure."""
    net.route("a", failing(500, "Model big not loaded"))
    net.route("b", lambda req: json_response(200, {"by": "b"}))
    with make_pool(net, "a", "b", priorities=[1, 2]) as pool:
        assert pool.execute({"model_id": "big"}) == {"by": "b"}
        assert pool.workers()[0]["tasks"]["failed"] == 0


def test_all_workers_failing_dead_letters_before_raising(net):
    """TaskFailed carries every attempt and a dead-letter id already stored."""
    for wid in "ab":
        net.route(wid, failing(503, "overloaded"))
    with make_pool(net, "a", "b") as pool:
        with pytest.raises(TaskFailed) as info:
            pool.execute(Task({"x": 1}, task_id="doomed"))
        exc = info.value
        # Both workers first, then (max_retries: 3) each of them once more.
        tried = [a.worker_id for a in exc.attempts]
        assert sorted(tried[:2]) == ["a", "b"] and sorted(tried[2:]) == ["a", "b"]
        record = pool.dead_letters.get(exc.dead_letter_id)
        assert record.task_id == "doomed" and record.payload == {"x": 1}
        assert len(record.attempts) == 4 and "overloaded" in record.error
        assert pool.stats()["tasks"]["failed"] == 1


def test_retries_stop_at_max_retries(net):
    """max_retries=1 means two attempts at most, even with more workers."""
    for wid in "abcd":
        net.route(wid, failing())
    with (
        make_pool(
            net,
            "a",
            "b",
            "c",
            "d",
            retry=RetryConfig(max_retries=1, backoff_initial=0, backoff_max=0),
        ) as pool,
        pytest.raises(TaskFailed) as info,
    ):
        pool.execute({"x": 1})
    assert len(info.value.attempts) == 2 and len(net.requests()) == 2


def test_backoff_waits_fit_inside_the_deadline(net):
    """No retry is scheduled past the task's deadline."""
    for wid in "abcd":
        net.route(wid, failing())
    clock = FakeClock()
    cfg = RetryConfig(max_retries=3, backoff_initial=1.0, backoff_max=10.0)
    with make_pool(net, "a", "b", "c", "d", clock=clock, retry=cfg) as pool:
        start = clock.monotonic()
        with pytest.raises(TaskFailed, match="deadline"):
            pool.execute({"x": 1}, timeout=2.5)
        assert clock.monotonic() - start <= 2.5
    assert 1 <= len(clock.sleeps) <= 2


def test_non_idempotent_task_is_not_retried_after_it_may_have_run(net):
    """A read timeout on a non-idempotent task ends it; a connect error does not."""
    net.route("a", lambda req: TransportError("timeout", "read timed out", sent=True))
    net.route("b", lambda req: json_response(200, {"ok": 1}))
    with make_pool(net, "a", "b", priorities=[1, 2]) as pool:
        with pytest.raises(TaskFailed, match="non-idempotent"):
            pool.execute(Task({"x": 1}, idempotent=False))
        net.route("a", lambda req: TransportError("connect", "refused", sent=False))
        assert pool.execute(Task({"x": 1}, idempotent=False)) == {"ok": 1}


def test_breaker_opens_after_fail_max_and_the_worker_gets_no_more_attempts(net):
    """After fail_max failures the worker is skipped until its reset timeout."""
    net.route("a", lambda req: TransportError("connect", "refused", sent=False))
    net.route("b", lambda req: json_response(200, {"ok": 1}))
    clock = FakeClock()
    with make_pool(net, "a", "b", clock=clock) as pool:
        for _ in range(20):
            assert pool.execute({"x": 1}) == {"ok": 1}
        assert len(net.requests("a")) == 2  # fail_max
        state = {w["id"]: w["breaker"]["state"] for w in pool.workers()}
        assert state == {"a": "open", "b": "closed"}
        clock.advance(30)
        net.route("a", lambda req: json_response(200, {"ok": "a"}))
        results = [pool.execute({"x": 1}) for _ in range(4)]
        assert {"ok": "a"} in results
        assert {w["id"]: w["breaker"]["state"] for w in pool.workers()}["a"] == "closed"


def test_retry_after_keeps_tasks_off_the_worker_until_it_passes(net):
    """A 429 with Retry-After cools the worker down for that long."""
    net.route("a", failing(429, "slow down", {"Retry-After": "5"}))
    net.route("b", lambda req: json_response(200, {"ok": 1}))
    clock = FakeClock()
    with make_pool(net, "a", "b", priorities=[1, 2], clock=clock) as pool:
        pool.execute({"x": 1})
        pool.execute({"x": 1})
        assert len(net.requests("a")) == 1
        clock.advance(5)
        pool.execute({"x": 1})
        assert len(net.requests("a")) == 2


def test_invalid_tasks_raise_at_once_and_send_nothing(net):
    """A payload that is not JSON, or a bad timeout, is InvalidTask before any attempt."""
    with make_pool(net, "a") as pool:
        with pytest.raises(InvalidTask, match="JSON"):
            pool.execute({"x": object()})
        with pytest.raises(InvalidTask, match="timeout"):
            pool.execute({"x": 1}, timeout=-1)
        with pytest.raises(InvalidTask, match="endpoint"):
            pool.execute(Task({"x": 1}, endpoint="inference"))
    assert net.requests() == []


def test_empty_pool_dead_letters_with_no_worker_available(net):
    """With no workers a task fails as NoWorkerAvailable, still dead-lettered."""
    with make_pool(net) as pool:
        with pytest.raises(NoWorkerAvailable) as info:
            pool.execute({"x": 1})
        assert pool.dead_letters.get(info.value.dead_letter_id).attempts == ()


def test_submit_and_map_return_results_in_order(net):
    """submit() gives a future; map() yields results in input order."""
    net.route("a", lambda req: json_response(200, req.json()))
    with make_pool(net, "a", pool=PoolSettings(threads=4)) as pool:
        assert pool.submit({"n": -1}).result(timeout=5) == {"n": -1}
        assert list(pool.map([{"n": i} for i in range(50)], window=8)) == [
            {"n": i} for i in range(50)
        ]


def test_map_raises_the_first_failure_at_its_position(net):
    """A rejected task in map() raises when its result is reached."""
    net.route("a", lambda req: json_response(422 if req.json()["n"] == 3 else 200, req.json()))
    with make_pool(net, "a") as pool:
        results = pool.map([{"n": i} for i in range(6)])
        assert [next(results) for _ in range(3)] == [{"n": 0}, {"n": 1}, {"n": 2}]
        with pytest.raises(TaskRejected):
            next(results)


def test_closed_pool_refuses_tasks(net):
    """After close() execute and submit raise PoolClosed."""
    pool = make_pool(net, "a")
    pool.close()
    with pytest.raises(PoolClosed):
        pool.execute({"x": 1})
    with pytest.raises(PoolClosed):
        pool.submit({"x": 1})
    pool.close()  # idempotent


def test_close_waits_for_submitted_tasks(net):
    """close() lets tasks already submitted finish with their results."""
    gate = threading.Event()

    def slow(req):
        gate.wait(5)
        return json_response(200, {"done": True})

    net.route("a", slow)
    pool = make_pool(net, "a")
    futures = [pool.submit({"n": i}) for i in range(4)]
    closer = threading.Thread(target=pool.close)
    closer.start()
    gate.set()
    closer.join(5)
    assert not closer.is_alive()
    assert [f.result(0) for f in futures] == [{"done": True}] * 4


def test_waiting_for_capacity_is_fifo_and_bounded_by_the_deadline(net):
    """With every slot busy, tasks queue in arrival order; one past its deadline fails."""
    release = threading.Event()
    started = threading.Semaphore(0)
    order: list[int] = []

    def handler(req):
        n = req.json()["n"]
        if n == 0:
            started.release()
            release.wait(5)
        order.append(n)
        return json_response(200, {"n": n})

    net.route("a", handler)
    cfg = make_config("a", capacity=1)
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        first = pool.submit({"n": 0})
        started.acquire(timeout=5)
        waiters = []
        for n in (1, 2, 3):
            waiters.append(pool.submit({"n": n}))
            while pool.stats()["tasks"]["waiting"] < n:  # wait until it is queued
                threading.Event().wait(0.001)
        with pytest.raises(NoWorkerAvailable, match="deadline"):
            pool.execute({"n": 99}, timeout=0.05)
        release.set()
        assert [f.result(5) for f in [first, *waiters]] == [{"n": n} for n in range(4)]
    assert order == [0, 1, 2, 3]


def test_fallback_runs_when_every_worker_fails_and_stores_no_dead_letter(net):
    """@npu_task(fallback=...) returns the local result; no dead letter is kept."""
    net.route("a", failing())
    with make_pool(net, "a") as pool:

        def cpu(text: str) -> dict:
            return {"cpu": text}

        @npu_task(pool, fallback=cpu)
        def analyze(text: str) -> dict:
            """Analyse text."""
            return {"model_id": "default", "input_text": text}

        assert analyze("hi") == {"cpu": "hi"}
        assert len(pool.dead_letters) == 0
        assert pool.stats()["tasks"]["fallbacks"] == 1


def test_failing_fallback_dead_letters_and_raises_task_failed(net):
    """If the fallback raises too, the task is dead-lettered and TaskFailed raised."""
    net.route("a", failing())
    with make_pool(net, "a") as pool:

        def cpu(text: str) -> dict:
            raise RuntimeError("no CPU model either")

        @npu_task(pool, fallback=cpu)
        def analyze(text: str) -> dict:
            return {"input_text": text}

        with pytest.raises(TaskFailed, match="no CPU model") as info:
            analyze("hi")
        assert isinstance(info.value.__cause__, RuntimeError)
        assert len(pool.dead_letters) == 1


def test_decorator_keeps_name_doc_signature_and_runs_on_the_pool(net):
    """The decorated function looks like the original and returns the worker's result."""
    net.route("a", lambda req: json_response(200, {"got": req.json()}))
    with make_pool(net, "a") as pool:

        @npu_task(pool, timeout=3)
        def analyze(text: str, *, temperature: float = 0.5) -> dict:
            """Analyse some text."""
            return {"input_text": text, "temperature": temperature}

        assert analyze.__name__ == "analyze" and analyze.__doc__ == "Analyse some text."
        assert list(inspect.signature(analyze).parameters) == ["text", "temperature"]
        assert analyze("x") == {"got": {"input_text": "x", "temperature": 0.5}}
        assert analyze.submit("y").result(5) == {"got": {"input_text": "y", "temperature": 0.5}}


def test_replay_succeeds_once_a_worker_answers(net):
    """dead_letters.replay() re-runs a stored task and removes it on success."""
    net.route("a", failing())
    with make_pool(net, "a") as pool:
        with pytest.raises(TaskFailed) as info:
            pool.execute(Task({"x": 1}, task_id="again"))
        net.route("a", lambda req: json_response(200, {"task": req.headers["X-NPU-Task-Id"]}))
        report = pool.dead_letters.replay()
        assert report.succeeded == (info.value.dead_letter_id,)
        assert report.results[info.value.dead_letter_id] == {"task": "again"}
        assert len(pool.dead_letters) == 0


def test_many_threads_lose_nothing_and_count_everything(net):
    """Under concurrency every task ends exactly once and the counters add up."""
    net.route("a", lambda req: json_response(200, req.json()))
    net.route("b", failing())
    with make_pool(net, "a", "b", capacity=4) as pool:
        with concurrent.futures.ThreadPoolExecutor(16) as callers:
            results = list(callers.map(lambda n: pool.execute({"n": n}), range(400)))
        assert results == [{"n": n} for n in range(400)]
        stats = pool.stats()["tasks"]
        assert stats["submitted"] == stats["succeeded"] == 400
        assert stats["in_flight"] == 0 and stats["waiting"] == 0


# -- edge cases of the lifecycle -----------------------------------------------------------


def test_waiter_wakes_when_a_cool_down_begins_after_it_fell_asleep(net):
    """A Retry-After set while a task waits makes it wake when the cool-down ends."""
    gate, busy = threading.Event(), threading.Event()
    calls = []

    def handler(req):
        calls.append(req.json()["n"])
        if calls == [1]:
            busy.set()
            gate.wait(5)
            return json_response(429, {"detail": "later"}, {"Retry-After": "0.2"})
        return json_response(200, {"n": req.json()["n"]})

    net.route("a", handler)
    net.route("b", lambda req: json_response(503, {"detail": "down"}))
    cfg = make_config("a", "b", capacity=1, priorities=[1, 2])
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        pool.remove_worker("b")  # a single worker, one slot
        first = pool.submit({"n": 1})
        assert busy.wait(5)
        second = pool.submit({"n": 2}, timeout=5)
        while pool.stats()["tasks"]["waiting"] < 1:
            threading.Event().wait(0.001)
        gate.set()
        # The second task waited out the cool-down; the first, with nowhere else to go,
        # tried its one worker again after it too (a 429 never ran the task).
        assert second.result(5) == {"n": 2}
        assert first.result(5) == {"n": 1}
    assert sorted(calls) == [1, 1, 2] and calls[0] == 1


def test_waiters_recompute_their_wake_after_a_failed_trial(net):
    """A half-open trial that fails re-opens the breaker; waiting tasks still get served."""
    state = {"fail": 2}
    lock = threading.Lock()

    def handler(req):
        with lock:
            if state["fail"]:
                state["fail"] -= 1
                return json_response(500, {"detail": "warming up"})
        return json_response(200, {"ok": True})

    net.route("a", handler)
    breaker = BreakerConfig(fail_max=1, reset_timeout=0.1, max_reset_timeout=1)
    cfg = make_config("a", circuit_breaker=breaker, retry=RetryConfig(max_retries=0))
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        with pytest.raises(TaskFailed):
            pool.execute({"n": 0})  # first failure: opens
        futures = [pool.submit({"n": i}, timeout=5) for i in range(1, 6)]
        outcomes = []
        for f in futures:
            try:
                outcomes.append(f.result(10))
            except TaskFailed:
                outcomes.append("failed")
        assert outcomes.count("failed") == 1  # the failed trial
        assert outcomes.count({"ok": True}) == 4


def test_not_loaded_then_deadline_is_a_failure_not_a_rejection(net):
    """A worker that has the model but stays busy past the deadline: dead letter, not 'no model'."""
    gate = threading.Event()
    started = threading.Event()

    def busy(req):
        started.set()
        gate.wait(5)
        return json_response(200, {"by": "b"})

    net.route("a", failing(500, "Model big not loaded"))
    net.route("b", busy)
    cfg = make_config("a", "b", capacity=1, priorities=[2, 1])
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        blocker = pool.submit({"model_id": "big"})
        assert started.wait(5)
        with pytest.raises(TaskFailed) as info:
            pool.execute({"model_id": "big"}, timeout=0.2)
        assert not isinstance(info.value, TaskRejected)
        assert pool.dead_letters.get(info.value.dead_letter_id)
        gate.set()
        assert blocker.result(5) == {"by": "b"}
        assert {w["id"]: w["in_flight"] for w in pool.workers()} == {"a": 0, "b": 0}


@pytest.mark.parametrize(
    "response",
    [
        lambda: Response(200, {}, b"[" * 100_000 + b"]" * 100_000),
        lambda: Response(503, {"retry-after": "Fri, 31 Dec 99999 23:59:59 GMT"}, b"{}"),
    ],
    ids=["deeply-nested-json", "absurd-retry-after"],
)
def test_an_answer_that_cannot_be_understood_is_a_worker_failure(net, response):
    """Odd bodies or headers fail the attempt, are retried elsewhere, and leak no lease."""
    net.route("a", lambda req: response())
    net.route("b", lambda req: json_response(200, {"by": "b"}))
    with make_pool(net, "a", "b", priorities=[1, 2]) as pool:
        assert pool.execute({"x": 1}) == {"by": "b"}
        assert {w["id"]: w["in_flight"] for w in pool.workers()} == {"a": 0, "b": 0}
        assert pool.workers()[0]["tasks"]["failed"] == 1


def test_a_dead_letter_that_cannot_be_stored_still_fails_the_task_loudly(net, caplog):
    """If the store refuses the record, TaskFailed says so and the record is logged."""
    import sqlite3

    from npu_sync._deadletter import MemoryDeadLetterStore

    class BrokenStore(MemoryDeadLetterStore):
        def add(self, record):
            raise sqlite3.OperationalError("disk I/O error")

    net.route("a", failing())
    pool = WorkerPool(
        make_config("a"), transport_factory=net.factory, dead_letter_store=BrokenStore()
    )
    with pool, pytest.raises(TaskFailed, match="could not be stored") as info:
        pool.execute(Task({"secret": "kept"}, task_id="unstorable"))
    assert info.value.dead_letter_id is None
    assert isinstance(info.value.__cause__, sqlite3.OperationalError)
    assert "unstorable" in caplog.text and '"secret": "kept"' in caplog.text


def test_close_waits_for_tasks_running_on_callers_threads(net):
    """close() does not tear connections down under an execute() still running."""
    gate, started = threading.Event(), threading.Event()

    def slow(req):
        started.set()
        gate.wait(5)
        return json_response(200, {"done": True})

    net.route("a", slow)
    pool = make_pool(net, "a")
    results = []
    caller = threading.Thread(target=lambda: results.append(pool.execute({"x": 1})))
    caller.start()
    assert started.wait(5)
    closer = threading.Thread(target=pool.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive(), "close() returned while a task was running"
    assert not any(t.closed for t in net.transports("a"))
    gate.set()
    caller.join(5)
    closer.join(5)
    assert results == [{"done": True}] and not closer.is_alive()


def test_submit_runs_on_the_pools_own_named_threads(net):
    """submit() runs tasks on npu-sync-task threads, not the caller's."""
    names = []
    net.route(
        "a", lambda req: names.append(threading.current_thread().name) or json_response(200, {})
    )
    with make_pool(net, "a", pool=PoolSettings(threads=2)) as pool:
        for f in [pool.submit({"n": i}) for i in range(6)]:
            f.result(5)
    assert names and all(n.startswith("npu-sync-task") for n in names)


def test_map_raises_a_bad_payload_at_its_own_position(net):
    """An unencodable payload mid-stream does not swallow results before it."""
    net.route("a", lambda req: json_response(200, req.json()))
    payloads = [{"n": 0}, {"n": 1}, {"n": object()}, {"n": 3}]
    with make_pool(net, "a") as pool:
        results = pool.map(payloads, window=1)
        assert next(results) == {"n": 0}
        assert next(results) == {"n": 1}
        with pytest.raises(InvalidTask):
            next(results)


def test_the_deadline_of_a_submitted_task_includes_its_time_in_the_queue(net):
    """A task queued behind others for longer than its timeout fails instead of running late."""
    gate, started = threading.Event(), threading.Event()

    def slow(req):
        started.set()
        gate.wait(5)
        return json_response(200, {})

    net.route("a", slow)
    cfg = make_config("a", pool=PoolSettings(threads=1))
    with WorkerPool(cfg, transport_factory=net.factory) as pool:  # the real clock
        blocker = pool.submit({"n": 0})
        assert started.wait(5)
        late = pool.submit({"n": 1}, timeout=0.05)
        threading.Event().wait(0.1)  # let its deadline pass while it is queued
        gate.set()
        blocker.result(5)
        with pytest.raises(NoWorkerAvailable, match="deadline"):
            late.result(5)
    assert len(net.requests("a")) == 1


def test_one_task_failing_everywhere_charges_one_breaker_only(net):
    """A poison task (HTTP 500 on every worker) counts against one worker, not all."""
    for wid in "abc":
        net.route(wid, failing(500, "poison"))
    with make_pool(net, "a", "b", "c", circuit_breaker=BreakerConfig(fail_max=1)) as pool:
        with pytest.raises(TaskFailed) as info:
            pool.execute({"poison": True})
        # Three workers, then one of the two whose breaker is still closed again.
        assert len(info.value.attempts) == 4
        states = sorted(w["breaker"]["state"] for w in pool.workers())
        assert states == ["closed", "closed", "open"]


def test_500s_are_charged_when_the_task_then_succeeds_elsewhere(net):
    """Workers that failed a task another worker served are charged after all."""
    net.route("a", failing(500, "broken"))
    net.route("b", failing(500, "broken"))
    net.route("c", lambda req: json_response(200, {"by": "c"}))
    with make_pool(
        net, "a", "b", "c", priorities=[1, 1, 2], circuit_breaker=BreakerConfig(fail_max=1)
    ) as pool:
        assert pool.execute({"x": 1}) == {"by": "c"}
        states = {w["id"]: w["breaker"]["state"] for w in pool.workers()}
        assert states == {"a": "open", "b": "open", "c": "closed"}


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), 1e10, 86400.5, True, "5"])
def test_a_call_timeout_outside_one_day_is_an_invalid_task(net, timeout):
    """execute(timeout=...) takes 0 < seconds <= 86400; anything else is InvalidTask, unsent."""
    with make_pool(net, "a") as pool:
        with pytest.raises(InvalidTask, match="timeout"):
            pool.execute({"x": 1}, timeout=timeout)
        assert pool.execute({"x": 1}, timeout=86400) == {"ok": True, "worker_id": "a"}
    assert len(net.requests("a")) == 1
