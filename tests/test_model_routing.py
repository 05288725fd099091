"""Model-aware routing, protocols and auth in the pool, over a fake network."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
from collections.abc import Callable, Iterable

import pytest

from npu_sync import TaskFailed, TaskRejected, WorkerPool, npu_task
from npu_sync._health import HealthResult
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    ModelsConfig,
    PoolConfig,
    RetryConfig,
    WorkerConfig,
    worker_config,
)
from npu_sync.events import Event, WorkerModelsChanged
from npu_sync.testing import FakeClock, FakeNetwork, FakeRequest, json_response
from npu_sync.transport import Response

SECRET = "s3cret-hmac-key-9f"
TOKEN = "tok-7c1e-bearer"


def linux(models: Iterable[str] | None, *, npu: bool = True, task: Callable | None = None):
    """A Linux-protocol worker holding ``models`` (None: /models answers 404)."""

    def handle(req: FakeRequest) -> Response:
        if req.path.endswith("/health"):
            count = 0 if models is None else len(list(models))
            return json_response(
                200, {"status": "healthy", "npu_available": npu, "loaded_models": count}
            )
        if req.path.endswith("/models"):
            if models is None:
                return json_response(404, {"detail": "Not Found"})
            loaded = {m: {"device": "NPU"} for m in models}
            return json_response(200, {"npu_available": npu, "loaded_models": loaded})
        if task is not None:
            return task(req)
        model = req.json().get("model_id")
        if model is not None and model not in list(models or ()):
            return json_response(500, {"detail": f"Model {model} not loaded"})
        return json_response(200, {"worker": req.worker_id, "model_id": model})

    return handle


def config(*workers: WorkerConfig, **kw) -> PoolConfig:
    kw.setdefault("health", HealthConfig(enabled=False, unhealthy_threshold=1))
    kw.setdefault("retry", RetryConfig(max_retries=3, backoff_initial=0.0, backoff_max=0.0))
    kw.setdefault("circuit_breaker", BreakerConfig(fail_max=1, reset_timeout=60))
    return PoolConfig(workers=workers, **kw)


def w(wid: str, n: int, **kw) -> WorkerConfig:
    return worker_config(wid, f"http://127.0.0.1:{9200 + n}", **kw)


def tasks_to(net: FakeNetwork, wid: str) -> list[FakeRequest]:
    return [r for r in net.requests(wid) if r.method == "POST" and r.path.endswith("/inference")]


def test_a_task_naming_a_model_goes_only_to_workers_that_hold_it():
    """After a health round, tasks for m2 never reach the worker holding only m1."""
    net = FakeNetwork()
    net.route("a", linux(["m1"]))
    net.route("b", linux(["m2"]))
    with WorkerPool(config(w("a", 0), w("b", 1)), transport_factory=net.factory) as pool:
        pool.check_health()
        for _ in range(20):
            assert pool.execute({"model_id": "m2", "input_text": "x"})["worker"] == "b"
            assert pool.execute({"model_id": "m1", "input_text": "x"})["worker"] == "a"
        rows = {row["id"]: row for row in pool.workers()}
        assert rows["a"]["models"] == ["m1"] and rows["b"]["models"] == ["m2"]
        assert rows["a"]["tasks"]["not_here"] == rows["b"]["tasks"]["not_here"] == 0
        assert pool.stats()["models"]["held"] == ["m1", "m2"]
    assert len(tasks_to(net, "a")) == len(tasks_to(net, "b")) == 20


def test_workers_whose_list_is_unknown_are_candidates_and_learn_from_not_loaded():
    """Without a list, a worker is tried; its "not loaded" answer keeps it out after."""
    net = FakeNetwork()
    net.route("a", linux(["other"]))
    net.route("b", linux(["m"]))
    events: list[Event] = []
    cfg = config(w("a", 0, priority=1), w("b", 1, priority=2))
    with WorkerPool(cfg, transport_factory=net.factory, hooks=[events.append]) as pool:
        for _ in range(10):
            assert pool.execute({"model_id": "m"})["worker"] == "b"
        assert pool.stats()["models"]["corrections"] == 1
    assert len(tasks_to(net, "a")) == 1  # one bounce, then a is known to lack m
    (changed,) = [e for e in events if isinstance(e, WorkerModelsChanged)]
    assert changed.worker_id == "a" and changed.reason == "not_loaded"


def test_a_model_unloaded_mid_run_costs_one_bounce_and_the_next_round_agrees():
    """A list that named m, then "not loaded": one bounce, and a round since keeps it out."""
    held = ["m"]
    net = FakeNetwork()
    net.route("a", linux(held))
    net.route("b", linux(["m"]))
    cfg = config(w("a", 0, priority=1), w("b", 1, priority=2))
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        pool.check_health()
        assert pool.execute({"model_id": "m"})["worker"] == "a"
        held.clear()
        for _ in range(5):
            assert pool.execute({"model_id": "m"})["worker"] == "b"
        pool.check_health()
        for _ in range(5):
            assert pool.execute({"model_id": "m"})["worker"] == "b"
        assert {r["id"]: r["models"] for r in pool.workers()} == {"a": [], "b": ["m"]}
    assert len(tasks_to(net, "a")) == 2  # the task before the unload, and one bounce


def test_a_correction_newer_than_the_list_outlives_that_list():
    """A list asked for before a "not loaded" answer does not bring the model back."""
    net = FakeNetwork()
    with WorkerPool(config(w("a", 0)), transport_factory=net.factory) as pool:
        worker = pool._state.workers["a"]
        worker.held.model_not_loaded("m", now=10.0)
        old = HealthResult("a", True, 0.0, models=frozenset({"m", "n"}), models_at=9.0)
        assert worker.held.apply_models(old) == (frozenset({"n"}), frozenset())
        assert worker.held.lacks("m") and not worker.held.lacks("n")
        newer = HealthResult("a", True, 0.0, models=frozenset({"m", "n"}), models_at=11.0)
        worker.held.apply_models(newer)
        assert not worker.held.lacks("m")


def test_a_model_whose_holders_are_down_is_rejected_at_once_with_no_attempt():
    """The only holder's breaker is open: TaskRejected naming the model, nothing sent,
    no waiting for a worker, and @npu_task's fallback answers instead."""
    down = threading.Event()

    def b_task(req: FakeRequest) -> Response:
        if down.is_set():
            return json_response(503, {"detail": "down"})
        return json_response(200, {"worker": "b"})

    net = FakeNetwork()
    net.route("a", linux(["m1"]))
    net.route("b", linux(["m2"], task=b_task))
    clock = FakeClock()
    with WorkerPool(
        config(w("a", 0), w("b", 1)), transport_factory=net.factory, clock=clock
    ) as pool:
        pool.check_health()
        down.set()
        with pytest.raises(TaskFailed):  # b fails (fail_max 1: its breaker opens)
            pool.execute({"model_id": "m2"})
        assert {r["id"]: r["breaker"]["state"] for r in pool.workers()}["b"] == "open"
        sent = len(net.requests())
        waits: list[object] = []
        dispatcher = pool._state.dispatcher
        real = dispatcher.acquire_or_reason
        dispatcher.acquire_or_reason = lambda *a: waits.append(a) or real(*a)  # type: ignore[method-assign]
        with pytest.raises(TaskRejected) as info:
            pool.execute({"model_id": "m2"}, timeout=60)
        assert info.value.model == "m2" and "m2" in str(info.value)
        assert "b: circuit breaker open" in str(info.value)

        @npu_task(pool, fallback=lambda text: {"local": text})
        def embed(text: str) -> dict:
            return {"model_id": "m2", "input_text": text}

        assert embed("hi") == {"local": "hi"}
        assert len(net.requests()) == sent and waits == []
        assert pool.stats()["tasks"]["fallbacks"] == 1
        assert len(pool.dead_letters) == 1  # only the task that really failed


def test_windows_workers_load_on_demand_until_they_say_not_loaded():
    """A Windows worker lists m1 yet takes m2 (on demand); once it answers "not loaded"
    for m3 it is kept out for m3 until its list names m3."""
    listed = ["m1"]

    def windows(req: FakeRequest) -> Response:
        if req.path == "/health":
            return json_response(200, {"status": "healthy", "loaded_models": listed})
        model = req.json()["model_name"]
        if model == "m3" and "m3" not in listed:
            return json_response(200, {"status": "failed", "error": "Model m3 not loaded"})
        return json_response(200, {"status": "completed", "result": {"model": model}})

    net = FakeNetwork()
    net.route("win", windows)
    net.route("lin", linux(["m3"]))
    cfg = config(w("win", 0, platform="windows", priority=1), w("lin", 1, priority=2))
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        pool.check_health()
        assert pool.execute({"model_id": "m2", "input_text": "x"})["result"] == {"model": "m2"}
        assert pool.execute({"model_id": "m3"})["worker"] == "lin"
        assert pool.execute({"model_id": "m3"})["worker"] == "lin"
        listed.append("m3")
        pool.check_health()
        assert pool.execute({"model_id": "m3"})["result"] == {"model": "m3"}
    sent = [r.json() for r in tasks_to(net, "win")]
    assert sent[0] == {
        "task_type": "embedding_generation",
        "model_name": "m2",
        "input_data": {"text": "x"},
    }
    assert [s["model_name"] for s in sent] == ["m2", "m3", "m3"]


def test_windows_200_failures_are_retried_elsewhere_and_dead_lettered():
    """HTTP 200 {"status": "failed"} is a worker failure: retried, then dead-lettered."""
    net = FakeNetwork()
    for wid in ("w1", "w2"):
        net.route(wid, lambda req: json_response(200, {"status": "failed", "error": "boom"}))
    cfg = config(w("w1", 0, platform="windows"), w("w2", 1, platform="windows"))
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        with pytest.raises(TaskFailed) as info:
            pool.execute({"model_id": "m", "input_text": "x"})
        assert {a.worker_id for a in info.value.attempts} == {"w1", "w2"}
        assert "status failed: boom" in str(info.value)
        assert pool.dead_letters.get(info.value.dead_letter_id) is not None


def _expected_signature(method: str, path: str, timestamp: str) -> str:
    message = f"pool:{method}:{path}:{timestamp}".encode()
    return hmac.new(SECRET.encode(), message, hashlib.sha256).hexdigest()


def test_every_request_is_signed_over_its_full_path_on_the_wire():
    """HMAC headers on tasks, health checks and /models, signed with the base path."""
    net = FakeNetwork()
    net.route("a", linux(["m"]))
    auth = {"type": "hmac", "service_id": "pool", "secret": SECRET}
    cfg = config(worker_config("a", "http://127.0.0.1:9300/api/v1", auth=auth))
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        pool.check_health()
        pool.execute({"model_id": "m"})
    paths = []
    for req in net.requests("a"):
        stamp = req.headers["X-Service-Timestamp"]
        wire = "/api/v1" + req.path
        assert req.headers["X-Service-ID"] == "pool"
        assert req.headers["X-Service-Signature"] == _expected_signature(req.method, wire, stamp)
        paths.append(wire)
    assert paths == ["/api/v1/health", "/api/v1/models", "/api/v1/inference"]


def test_refused_credentials_take_the_worker_out_not_its_breaker(caplog):
    """A 401 takes that worker out with last_error "credentials refused: HTTP 401 ...",
    its breaker untouched, an event says so; the task and the next ones run on another
    worker, and neither token appears in errors, stats, workers() or the log."""
    net = FakeNetwork()
    seen: list[object] = []

    def guarded(req: FakeRequest) -> Response:
        if req.headers.get("Authorization") != f"Bearer {TOKEN}":
            return json_response(401, {"detail": "invalid bearer token"})
        return json_response(200, {"worker": req.worker_id})

    net.route("a", guarded)
    net.route("b", guarded)
    cfg = config(
        w("a", 0, priority=1, auth={"type": "bearer", "token": "wrong-" + TOKEN}),
        w("b", 1, priority=2, auth={"type": "bearer", "token": TOKEN}),
    )
    caplog.set_level(logging.DEBUG, logger="npu_sync")
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        pool.add_hook(seen.append)
        assert pool.execute({"x": 1}) == {"worker": "b"}
        rows = {r["id"]: r for r in pool.workers()}
        assert rows["a"]["breaker"]["state"] == "closed"
        assert rows["a"]["breaker"]["failures"] == 0
        assert rows["a"]["last_error"] == "credentials refused: HTTP 401: invalid bearer token"
        assert all(pool.execute({"x": i}) == {"worker": "b"} for i in range(5))
        assert len(net.requests("a")) == 1  # taken out: no task went there again
        refused = [e for e in seen if getattr(e, "name", "") == "worker.credentials_refused"]
        assert [(e.worker_id, e.error) for e in refused] == [  # type: ignore[attr-defined]
            ("a", "credentials refused: HTTP 401: invalid bearer token")
        ]
        shown = json.dumps([pool.stats(), pool.workers()]) + caplog.text + repr(pool.config)
    assert TOKEN not in shown


def test_a_cpu_fallback_worker_ranks_below_npu_workers_of_its_tier():
    """npu_available: false puts a worker after its tier's NPU workers, before the next."""
    gate = threading.Event()
    started = threading.Event()

    def held(req: FakeRequest) -> Response:
        started.set()
        gate.wait(5)
        return json_response(200, {"worker": req.worker_id})

    net = FakeNetwork()
    net.route("cpu", linux(None, npu=False))
    net.route("npu", linux(None, task=held))
    net.route("next", linux(None))
    cfg = config(
        w("cpu", 0, priority=1, max_concurrent=1),
        w("npu", 1, priority=1, max_concurrent=1),
        w("next", 2, priority=2),
    )
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        pool.check_health()
        rows = {r["id"]: r for r in pool.workers()}
        assert rows["cpu"]["npu_available"] is False and rows["cpu"]["priority"] == 1
        busy = pool.submit({"x": 1})
        assert started.wait(5)  # the NPU worker took the first task
        assert pool.execute({"x": 2})["worker"] == "cpu"  # then its tier's CPU worker
        gate.set()
        assert busy.result(5) == {"worker": "npu"}


def test_placement_loads_the_model_once_on_the_least_loaded_worker_then_runs():
    """No worker holds m: one load request (however many tasks ask), then the tasks run."""
    loaded: list[str] = []
    release = threading.Event()

    def handle(req: FakeRequest) -> Response:
        if req.path == "/models/load":
            release.wait(5)
            loaded.append(req.json()["model_id"])
            return json_response(200, {"status": "success", "model_id": "m"})
        return linux(["other", *loaded])(req)

    net = FakeNetwork()
    net.route("a", handle)
    cfg = config(w("a", 0), models=ModelsConfig(placement=True))
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        pool.check_health()
        futures = [pool.submit({"model_id": "m"}) for _ in range(4)]
        release.set()
        assert [f.result(10)["worker"] for f in futures] == ["a"] * 4
        assert pool.stats()["models"]["placements"] == 1
        assert {r["id"]: r["models"] for r in pool.workers()} == {"a": ["m", "other"]}
    assert loaded == ["m"]
    assert [r.path for r in net.requests("a")].count("/models/load") == 1


def test_a_failed_placement_rejects_the_task_naming_the_model():
    """A load the worker refuses ends the task as TaskRejected naming the model."""
    net = FakeNetwork()

    def handle(req: FakeRequest) -> Response:
        if req.path == "/models/load":
            return json_response(500, {"detail": "out of memory"})
        return linux(["other"])(req)

    net.route("a", handle)
    cfg = config(w("a", 0), models=ModelsConfig(placement=True))
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        pool.check_health()
        with pytest.raises(TaskRejected) as info:
            pool.execute({"model_id": "m"})
        assert info.value.model == "m" and "out of memory" in str(info.value)
        assert pool.stats()["models"]["placement_failures"] == 1
    assert tasks_to(net, "a") == []


def test_tasks_without_a_model_are_not_routed_by_models():
    """A payload naming no model may go to any worker, whatever the lists say."""
    net = FakeNetwork()
    net.route("a", linux([]))
    with WorkerPool(config(w("a", 0)), transport_factory=net.factory) as pool:
        pool.check_health()
        assert pool.execute({"input_text": "x"}) == {"worker": "a", "model_id": None}


# -- while no worker has a model list, tasks skip the model look-ups ------------------------


def test_model_look_ups_start_when_a_health_round_brings_a_list():
    """No list, no look-ups; the first health round's list turns them on, so tasks
    for m2 avoid the worker listing only m1 from then on."""
    net = FakeNetwork()
    net.route("a", linux(["m1"]))
    net.route("b", linux(["m2"]))
    cfg = config(w("a", 0, priority=1), w("b", 1, priority=2))
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        assert not pool._state.models_known
        assert pool.execute({"model_id": "m1"})["worker"] == "a"
        assert not pool._state.models_known  # a success teaches nothing about models
        pool.check_health()
        assert pool._state.models_known
        for _ in range(5):
            assert pool.execute({"model_id": "m2"})["worker"] == "b"
        assert pool.stats()["models"]["corrections"] == 0
    assert len(tasks_to(net, "a")) == 1


def test_model_look_ups_start_with_the_first_not_loaded_answer():
    """With no list anywhere, a "not loaded" answer turns the look-ups on before the
    slot is handed on: the next task for that model skips the worker."""
    net = FakeNetwork()
    net.route("a", linux(["other"]))
    net.route("b", linux(["m"]))
    cfg = config(w("a", 0, priority=1), w("b", 1, priority=2))
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        assert pool.execute({"model_id": "other"})["worker"] == "a"
        assert not pool._state.models_known
        assert pool.execute({"model_id": "m"})["worker"] == "b"
        assert pool._state.models_known
        for _ in range(5):
            assert pool.execute({"model_id": "m"})["worker"] == "b"
    assert [r.json()["model_id"] for r in tasks_to(net, "a")] == ["other", "m"]


def test_a_reload_works_the_model_look_ups_out_again():
    """A reload that keeps a listed worker keeps the look-ups on; one that moves the
    only listed worker (its list forgotten) turns them off, and its next list turns
    them on again."""
    net = FakeNetwork()
    net.route("a", linux(["m1"]))
    net.route("b", linux(["m2"]))
    cfg = config(w("a", 0, priority=1), w("b", 1, priority=2))
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        pool.check_health()
        pool.reload(config(w("a", 0, priority=1), w("b", 1, priority=2, max_concurrent=4)))
        assert pool._state.models_known
        assert pool.execute({"model_id": "m2"})["worker"] == "b"
        assert tasks_to(net, "a") == []
        pool.reload(config(w("a", 0, priority=1)))  # b goes; a keeps its list
        assert pool._state.models_known
        pool.reload(config(w("a", 5, priority=1)))  # a moves: nothing is known of it
        assert not pool._state.models_known
        assert pool.stats()["models"]["unknown"] == 1
        pool.check_health()
        assert pool._state.models_known
        with pytest.raises(TaskRejected, match="no live worker serves model 'm2'"):
            pool.execute({"model_id": "m2"})
    assert tasks_to(net, "a") == []


def test_a_worker_listing_its_models_as_objects_still_gets_their_tasks(servers):
    """Over a real socket: a worker whose /health lists models as objects (no string
    ids) is not taken to hold nothing; tasks naming its model run on it."""
    from tests.hostile import answer, keep_answering, serve

    def reply(seen) -> bytes:
        if seen.path == "/health":
            body = {"status": "healthy", "loaded_models": [{"id": "default"}]}
        else:
            body = {"model_id": "default", "response": "ok"}
        return answer(200, json.dumps(body).encode())

    server = serve(servers, keep_answering(reply))
    config = PoolConfig(
        workers=(worker_config("w", server.url()),), health=HealthConfig(enabled=False)
    )
    with WorkerPool(config) as pool:
        pool.check_health()
        assert pool.workers()[0]["models"] is None  # unknown, not "none"
        assert pool.execute({"model_id": "default", "input_text": "x"})["response"] == "ok"
