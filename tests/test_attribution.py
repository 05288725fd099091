"""Failure attribution and fail-fast retries: a breaker measures only its own worker."""

from __future__ import annotations

import dataclasses
import inspect
import threading
import time

import pytest

from npu_sync import Task, TaskFailed, WorkerPool, npu_task
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    PoolSettings,
    RetryConfig,
    TimeoutConfig,
    TransportConfig,
    worker_config,
)
from npu_sync.errors import InvalidTask, NoWorkerAvailable
from npu_sync.testing import FakeClock, FakeNetwork, json_response
from npu_sync.transport import TransportError


def config(
    *ids: str,
    fail_max: int = 5,
    reset: float = 30.0,
    retries: int = 3,
    capacity: int = 8,
    priorities: list[int] | None = None,
    **kw,
) -> PoolConfig:
    priorities = priorities or [1] * len(ids)
    kw.setdefault("health", HealthConfig(enabled=False))
    kw.setdefault("retry", RetryConfig(max_retries=retries, backoff_initial=0.01, backoff_max=0.05))
    return PoolConfig(
        workers=tuple(
            worker_config(w, f"http://127.0.0.1:{9300 + n}", priority=p, max_concurrent=capacity)
            for n, (w, p) in enumerate(zip(ids, priorities, strict=True))
        ),
        circuit_breaker=BreakerConfig(
            fail_max=fail_max, reset_timeout=reset, max_reset_timeout=600
        ),
        **kw,
    )


def rows(pool: WorkerPool) -> dict[str, dict]:
    return {w["id"]: w for w in pool.workers()}


def ok(req):
    return json_response(200, {"by": req.worker_id})


def status(code: int, detail: str = "boom"):
    return lambda req: json_response(code, {"detail": detail})


def answers_in(clock: FakeClock, latency: float):
    """A healthy worker that needs ``latency`` seconds: a shorter budget times out."""

    def handler(req):
        if req.timeout < latency:
            clock.advance(req.timeout)
            return TransportError("timeout", f"no answer within {req.timeout}s", sent=True)
        clock.advance(latency)
        return json_response(200, {"by": req.worker_id})

    return handler


def stale(req):
    exc = TransportError("reset", "keep-alive connection closed by the worker", sent=True)
    exc.stale = True  # type: ignore[attr-defined]
    return exc


# -- A1: the caller's deadline is not the worker's fault -----------------------------------


def test_callers_with_short_deadlines_do_not_open_a_slow_workers_breaker():
    """Five tasks whose 0.1 s deadline ends before a healthy 0.3 s answer charge nobody."""
    clock = FakeClock()
    net = FakeNetwork()
    net.route("a", answers_in(clock, 0.3))
    with WorkerPool(config("a"), transport_factory=net.factory, clock=clock) as pool:
        for _ in range(5):
            with pytest.raises(TaskFailed, match="deadline"):
                pool.execute({"x": 1}, timeout=0.1)
        assert all(req.timeout == pytest.approx(0.1) for req in net.requests("a"))
        row = rows(pool)["a"]
        assert row["breaker"]["state"] == "closed" and row["breaker"]["failures"] == 0
        assert row["tasks"]["abandoned"] == 5 and row["tasks"]["failed"] == 0
        assert pool.execute({"x": 1}, timeout=2) == {"by": "a"}


@pytest.mark.parametrize("sent", [True, False], ids=["read", "connect"])
def test_a_timeout_is_charged_only_when_the_workers_own_timeout_ran_out(sent):
    """The same timeout is abandoned under a short deadline and charged under a long one."""
    clock = FakeClock()
    net = FakeNetwork()

    def times_out(req):
        clock.advance(req.timeout)
        return TransportError("timeout", "timed out", sent=sent)

    net.route("a", times_out)
    timeouts = TimeoutConfig(connect=1.0, read=2.0, task=25.0)
    cfg = config("a", fail_max=1, retries=0, timeouts=timeouts)
    with WorkerPool(cfg, transport_factory=net.factory, clock=clock) as pool:
        with pytest.raises(TaskFailed):
            pool.execute({"x": 1}, timeout=0.5)  # shorter than connect and read
        assert rows(pool)["a"]["breaker"]["state"] == "closed"
        with pytest.raises(TaskFailed):
            pool.execute({"x": 1}, timeout=10)  # the worker's own timeout ran out
        row = rows(pool)["a"]
        assert row["breaker"]["state"] == "open"
        assert (row["tasks"]["abandoned"], row["tasks"]["failed"]) == (1, 1)


def test_a_half_open_trial_cut_short_by_its_deadline_neither_re_trips_nor_doubles():
    """A trial whose task ran out of time leaves the breaker half-open, timeout unchanged."""
    clock = FakeClock()
    net = FakeNetwork()
    net.route("a", status(500, "down"))
    with WorkerPool(
        config("a", fail_max=1, reset=30.0), transport_factory=net.factory, clock=clock
    ) as pool:
        with pytest.raises(TaskFailed):
            pool.execute({"x": 1})
        assert rows(pool)["a"]["breaker"]["state"] == "open"
        clock.advance(30)
        net.route("a", answers_in(clock, 0.3))
        with pytest.raises(TaskFailed):
            pool.execute({"x": 1}, timeout=0.1)  # the trial, cut short by the caller
        breaker = rows(pool)["a"]["breaker"]
        assert breaker["state"] == "half-open"
        assert (breaker["trips"], breaker["reset_timeout"]) == (1, 30)
        assert pool.stats()["workers"]["available"] == 1  # the next task may be the trial
        assert pool.execute({"x": 1}, timeout=2) == {"by": "a"}
        assert rows(pool)["a"]["breaker"]["state"] == "closed"


def test_a_half_open_trial_that_times_out_on_its_own_re_opens_with_a_doubled_timeout():
    """Control: a trial that used the worker's whole read timeout does count."""
    clock = FakeClock()
    net = FakeNetwork()
    net.route("a", status(500, "down"))
    timeouts = TimeoutConfig(connect=0.1, read=0.2, task=25.0)
    with WorkerPool(
        config("a", fail_max=1, reset=30.0, timeouts=timeouts),
        transport_factory=net.factory,
        clock=clock,
    ) as pool:
        with pytest.raises(TaskFailed):
            pool.execute({"x": 1})
        clock.advance(30)
        net.route("a", answers_in(clock, 0.3))
        with pytest.raises(TaskFailed):
            pool.execute({"x": 1}, timeout=5)
        breaker = rows(pool)["a"]["breaker"]
        assert (breaker["state"], breaker["trips"], breaker["reset_timeout"]) == ("open", 2, 60)


# -- A2: a task id that cannot travel as a header ------------------------------------------


@pytest.mark.parametrize("task_id", ["订单-1", "café-1"])
def test_a_task_id_that_is_not_ascii_is_refused_before_anything_is_sent(task_id):
    """A printable non-ASCII id is InvalidTask naming the header; nothing sent or charged."""
    net = FakeNetwork()
    with WorkerPool(config("a"), transport_factory=net.factory, clock=FakeClock()) as pool:
        with pytest.raises(InvalidTask, match="X-NPU-Task-Id"):
            pool.execute(Task({"x": 1}, task_id=task_id))
        with pytest.raises(InvalidTask, match="ASCII"):
            pool.submit(Task({"x": 1}, task_id=task_id))
        assert net.requests() == []
        assert pool.execute(Task({"x": 1}, task_id="order-1")) == {"ok": True, "worker_id": "a"}
        assert len(pool.dead_letters) == 0


def test_invalid_task_from_the_transport_ends_the_task_uncharged_and_unretried():
    """A transport refusing the request (InvalidTask) reaches the caller; no worker pays."""
    net = FakeNetwork()
    net.route("a", lambda req: InvalidTask("header X-NPU-Task-Id cannot be encoded"))
    net.route("b", ok)
    cfg = config("a", "b", fail_max=1, priorities=[1, 2])
    with WorkerPool(cfg, transport_factory=net.factory, clock=FakeClock()) as pool:
        with pytest.raises(InvalidTask, match="cannot be encoded"):
            pool.execute({"x": 1})
        assert [r.worker_id for r in net.requests()] == ["a"]
        row = rows(pool)["a"]
        assert row["in_flight"] == 0 and row["tasks"]["failed"] == 0
        assert (row["breaker"]["state"], row["breaker"]["failures"]) == ("closed", 0)
        assert len(pool.dead_letters) == 0 and pool.stats()["tasks"]["failed"] == 0
        net.route("a", ok)
        assert pool.execute({"x": 1}) == {"by": "a"}


@pytest.mark.parametrize("client", ["builtin", "urllib3", "requests"])
def test_every_transport_refuses_an_unencodable_task_id_as_invalid_task(client):
    """Past Task's own check, each real transport still turns a bad header into
    InvalidTask: the task's fault, no worker charged."""
    task = Task({"x": 1}, task_id="order-1")
    object.__setattr__(task, "task_id", "订单-1")  # as a record from an older version could
    cfg = config(
        "a",
        timeouts=TimeoutConfig(connect=0.5, read=1.0, task=2.0),
        transport=TransportConfig(client=client),
    )
    with WorkerPool(cfg) as pool:
        with pytest.raises(InvalidTask):
            pool.execute(task)
        (row,) = pool.workers()
        assert row["breaker"]["failures"] == 0 and row["in_flight"] == 0
        assert row["tasks"]["failed"] == 0


# -- A3: answers over the size limit -------------------------------------------------------


def test_answers_over_the_size_limit_charge_one_worker_and_stop_after_two():
    """Every worker answering too big: one charge per task, two workers tried, no trip."""
    net = FakeNetwork(lambda req: json_response(200, {"blob": "x" * 5000}))
    cfg = config("a", "b", "c", transport=TransportConfig(max_response_bytes=1000))
    with WorkerPool(cfg, transport_factory=net.factory, clock=FakeClock()) as pool:
        for n in range(5):
            with pytest.raises(TaskFailed, match="max_response_bytes") as info:
                pool.execute({"n": n})
            tried = [a.worker_id for a in info.value.attempts]
            assert len(tried) == 2 and len(set(tried)) == 2
        workers = rows(pool).values()
        assert all(w["breaker"]["state"] == "closed" for w in workers)
        assert sum(w["breaker"]["failures"] for w in workers) == 5  # the first of each task
        assert sum(w["tasks"]["failed"] for w in workers) == 10
        assert len(net.requests()) == 10


def test_an_answer_over_the_limit_from_one_worker_only_is_that_workers_failure():
    """A worker answering too big while another answers normally is charged and bypassed."""
    net = FakeNetwork(ok)
    net.route("a", lambda req: json_response(200, {"blob": "x" * 5000}))
    cfg = config(
        "a", "b", fail_max=1, priorities=[1, 2], transport=TransportConfig(max_response_bytes=1000)
    )
    with WorkerPool(cfg, transport_factory=net.factory, clock=FakeClock()) as pool:
        assert pool.execute({"x": 1}) == {"by": "b"}
        assert rows(pool)["a"]["breaker"]["state"] == "open"


# -- A5, A6: stale connections and our own errors ------------------------------------------


def test_a_stale_keep_alive_connection_is_retried_elsewhere_uncharged():
    """An idempotent task on a closed keep-alive connection moves on; nobody is charged."""
    net = FakeNetwork(ok)
    net.route("a", stale)
    cfg = config("a", "b", fail_max=1, priorities=[1, 2])
    with WorkerPool(cfg, transport_factory=net.factory, clock=FakeClock()) as pool:
        for _ in range(3):
            assert pool.execute({"x": 1}) == {"by": "b"}
        row = rows(pool)["a"]
        assert row["breaker"]["state"] == "closed" and row["breaker"]["failures"] == 0
        assert (row["tasks"]["abandoned"], row["tasks"]["failed"]) == (3, 0)


def test_a_stale_connection_on_a_non_idempotent_task_dead_letters_without_charge():
    """A non-idempotent task that may have run is not re-sent, and the worker is not blamed."""
    net = FakeNetwork(ok)
    net.route("a", stale)
    cfg = config("a", "b", fail_max=1, priorities=[1, 2])
    with WorkerPool(cfg, transport_factory=net.factory, clock=FakeClock()) as pool:
        with pytest.raises(TaskFailed, match="non-idempotent") as info:
            pool.execute(Task({"x": 1}, idempotent=False))
        assert pool.dead_letters.get(info.value.dead_letter_id) is not None
        assert [r.worker_id for r in net.requests()] == ["a"]
        row = rows(pool)["a"]
        assert row["breaker"]["state"] == "closed" and row["breaker"]["failures"] == 0
        assert row["tasks"]["failed"] == 0


def test_a_stale_connection_on_the_only_worker_is_retried_there():
    """With one worker, an idempotent task whose keep-alive connection was stale tries again."""
    calls = []

    def stale_once(req):
        calls.append(req)
        return stale(req) if len(calls) == 1 else ok(req)

    net = FakeNetwork()
    net.route("a", stale_once)
    with WorkerPool(config("a"), transport_factory=net.factory, clock=FakeClock()) as pool:
        assert pool.execute({"x": 1}) == {"by": "a"}
        row = rows(pool)["a"]
        assert row["breaker"]["failures"] == 0 and row["tasks"]["failed"] == 0
    assert len(calls) == 2


def test_an_unexpected_transport_exception_charges_nobody(caplog):
    """A RuntimeError from a transport is logged and retried elsewhere; no breaker moves."""
    net = FakeNetwork(ok)
    net.route("a", lambda req: RuntimeError("bug in a custom transport"))
    cfg = config("a", "b", fail_max=1, priorities=[1, 2])
    with WorkerPool(cfg, transport_factory=net.factory, clock=FakeClock()) as pool:
        for _ in range(3):
            assert pool.execute({"x": 1}) == {"by": "b"}
        row = rows(pool)["a"]
        assert row["breaker"]["state"] == "closed" and row["tasks"]["failed"] == 0
        assert row["in_flight"] == 0
    assert "bug in a custom transport" in caplog.text


# -- A7: the pool-wide result check ------------------------------------------------------


def refuse_errors(result: object) -> None:
    if not isinstance(result, dict) or "error" in result:
        raise ValueError(f"not a result: {result!r}")


@pytest.mark.parametrize("body", [[1, 2], {"error": "out of memory"}], ids=["list", "error"])
def test_a_result_check_turns_a_2xx_answer_into_that_workers_failure(body):
    """A refused 2xx answer is charged to its worker and the task is retried elsewhere."""
    net = FakeNetwork(ok)
    net.route("a", lambda req: json_response(200, body))
    cfg = config("a", "b", fail_max=1, priorities=[1, 2])
    with WorkerPool(
        cfg, transport_factory=net.factory, clock=FakeClock(), result_check=refuse_errors
    ) as pool:
        assert pool.execute({"x": 1}) == {"by": "b"}
        row = rows(pool)["a"]
        assert row["breaker"]["state"] == "open" and row["tasks"]["failed"] == 1
        assert "result check refused" in row["last_error"]


@pytest.mark.parametrize("body", [[1, 2], {"error": "out of memory"}, None], ids=repr)
def test_without_a_result_check_any_json_answer_is_the_result(body):
    """By default a 2xx JSON body is returned as it is, whatever its shape."""
    net = FakeNetwork(lambda req: json_response(200, body))
    with WorkerPool(config("a"), transport_factory=net.factory, clock=FakeClock()) as pool:
        assert pool.execute({"x": 1}) == body
        assert rows(pool)["a"]["tasks"]["succeeded"] == 1


# -- C1, C2: failing fast ------------------------------------------------------------------


def test_a_task_fails_fast_when_no_worker_can_take_it_before_its_deadline():
    """With one breaker open for 60 s and the others failing, a 60 s task does not wait."""
    net = FakeNetwork(ok)
    net.route("a", status(503, "down"))
    cfg = config("a", "b", "c", fail_max=1, reset=60.0, priorities=[1, 2, 2])
    with WorkerPool(cfg, transport_factory=net.factory) as pool:  # the real clock
        assert pool.execute({"x": 1}) in ({"by": "b"}, {"by": "c"})  # opens a's breaker
        assert rows(pool)["a"]["breaker"]["state"] == "open"
        net.route("b", status(503, "down"))
        net.route("c", status(503, "down"))
        outcome: list[BaseException] = []
        runner = threading.Thread(target=lambda: _catch(outcome, pool, timeout=60))
        began = time.monotonic()
        runner.start()
        runner.join(30)
        assert not runner.is_alive(), "the task waited for a worker that cannot come back"
        assert time.monotonic() - began < 5
        (exc,) = outcome
        assert isinstance(exc, TaskFailed) and pool.dead_letters.get(exc.dead_letter_id)
        assert {a.worker_id for a in exc.attempts} <= {"b", "c"}


def _catch(into: list[BaseException], pool: WorkerPool, **kw) -> None:
    try:
        pool.execute({"x": 1}, **kw)
    except BaseException as exc:
        into.append(exc)


def test_a_task_waits_for_a_busy_pool_only_max_queue_wait_not_its_deadline():
    """Every worker busy: NoWorkerAvailable after pool.max_queue_wait, which it names."""
    gate, started = threading.Event(), threading.Event()

    def busy(req):
        started.set()
        gate.wait(30)
        return ok(req)

    net = FakeNetwork(busy)
    cfg = config("a", capacity=1, pool=PoolSettings(max_queue_wait=0.2))
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        blocker = pool.submit({"x": 0})
        assert started.wait(5)
        began = time.monotonic()
        with pytest.raises(NoWorkerAvailable, match=r"pool\.max_queue_wait") as info:
            pool.execute({"x": 1}, timeout=30)
        assert time.monotonic() - began < 10  # about 0.2 s; the deadline was 30 s
        assert pool.dead_letters.get(info.value.dead_letter_id) is not None
        gate.set()
        assert blocker.result(5) == {"by": "a"}


# -- C3: one worker and retries ------------------------------------------------------------


def flaky(first_status: int):
    calls = []

    def handler(req):
        calls.append(req.headers["X-NPU-Attempt"])
        if len(calls) == 1:
            return json_response(first_status, {"detail": "transient"})
        return ok(req)

    handler.calls = calls  # type: ignore[attr-defined]
    return handler


def test_a_single_worker_retries_a_transient_503_after_backoff():
    """max_retries: 3 and one worker: a 503 is retried on it after a backoff wait."""
    clock = FakeClock()
    net = FakeNetwork()
    handler = flaky(503)
    net.route("a", handler)
    with WorkerPool(config("a"), transport_factory=net.factory, clock=clock) as pool:
        assert pool.execute({"x": 1}) == {"by": "a"}
        assert pool.stats()["tasks"]["retries"] == 1
    assert handler.calls == ["1", "2"]
    assert len(clock.sleeps) == 1 and clock.sleeps[0] > 0


@pytest.mark.parametrize(("first_status", "retried"), [(500, False), (429, True), (503, True)])
def test_a_non_idempotent_task_is_retried_on_its_only_worker_only_if_it_never_ran(
    first_status, retried
):
    """After a 500 (may have run) it ends; after a 429 or 503 (not processed) it retries."""
    net = FakeNetwork()
    handler = flaky(first_status)
    net.route("a", handler)
    with WorkerPool(config("a"), transport_factory=net.factory, clock=FakeClock()) as pool:
        task = Task({"x": 1}, idempotent=False)
        if retried:
            assert pool.execute(task) == {"by": "a"}
        else:
            with pytest.raises(TaskFailed, match="non-idempotent"):
                pool.execute(task)
    assert len(handler.calls) == (2 if retried else 1)


# -- C4: a success on a worker's previous address ------------------------------------------


def test_a_success_on_a_workers_previous_address_is_returned_and_counted():
    """A reload moves the worker mid-attempt: the old address's answer still counts."""
    gate, started = threading.Event(), threading.Event()

    def slow(req):
        started.set()
        gate.wait(5)
        return json_response(200, {"from": "old address"})

    net = FakeNetwork()
    net.route("a", slow)
    cfg = config("a")
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        pending = pool.submit({"x": 1})
        assert started.wait(5)
        moved = worker_config("a", "http://127.0.0.1:9399")
        assert pool.reload(dataclasses.replace(cfg, workers=(moved,))).updated == ("a",)
        gate.set()
        assert pending.result(5) == {"from": "old address"}
        tasks = pool.stats()["tasks"]
        assert (tasks["succeeded"], tasks["failed"], tasks["in_flight"]) == (1, 0, 0)
        row = rows(pool)["a"]
        assert row["tasks"]["attempts"] == 0 and row["breaker"]["state"] == "closed"


# -- C5: @npu_task on methods --------------------------------------------------------------


def test_npu_task_on_a_method_passes_self_to_calls_submit_and_fallback():
    """obj.method(), .submit() and the fallback get the instance; name and doc are kept."""
    net = FakeNetwork(lambda req: json_response(200, {"got": req.json()}))
    with WorkerPool(config("a"), transport_factory=net.factory, clock=FakeClock()) as pool:

        class Analyzer:
            def __init__(self, prefix: str) -> None:
                self.prefix = prefix

            def local(self, text: str) -> dict:
                return {"cpu": self.prefix + text}

            @npu_task(pool, fallback=local)
            def analyze(self, text: str) -> dict:
                """Analyse text."""
                return {"input_text": self.prefix + text}

        one, two = Analyzer("1:"), Analyzer("2:")
        assert one.analyze("x") == {"got": {"input_text": "1:x"}}
        assert two.analyze.submit("y").result(5) == {"got": {"input_text": "2:y"}}
        assert Analyzer.analyze(one, "z") == {"got": {"input_text": "1:z"}}
        assert one.analyze.__doc__ == "Analyse text." and one.analyze.__name__ == "analyze"
        assert list(inspect.signature(one.analyze).parameters) == ["text"]
        net.route("a", status(503, "down"))
        assert two.analyze("w") == {"cpu": "2:w"}
        assert two.analyze.submit("v").result(5) == {"cpu": "2:v"}
