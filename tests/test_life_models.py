"""The model steps alone (npu_sync._life.models), with a stub next step."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from npu_sync import TaskRejected, WorkerPool
from npu_sync._life.context import AGAIN, TaskContext, Try
from npu_sync._life.ledger import record
from npu_sync._life.models import ModelCount, ModelHeld, ModelLoad, ModelRoute
from npu_sync._retry import Outcome
from npu_sync.config import ModelsConfig, worker_config
from npu_sync.task import Task
from npu_sync.testing import FakeNetwork, FakeRequest, json_response
from npu_sync.transport import Response
from npu_sync.worker_server import LocalWorker
from tests.lifekit import OK, begin, stub_pool
from tests.modelkit import config, linux, tasks_to, w


@pytest.fixture
def pool() -> Iterator[WorkerPool]:
    with stub_pool() as p:
        yield p


def test_model_held_gives_back_a_worker_learnt_to_lack_the_model(pool: WorkerPool) -> None:
    """The lease's worker lacks the model now: AGAIN, never tried, slot back."""
    state = pool._state
    ctx = begin(pool, Task({"model_id": "m", "input_text": "x"}))
    lease = state.dispatcher.try_acquire(())
    assert lease is not None
    state.model_not_loaded(lease.worker, "m")

    def next(ctx: TaskContext, at: Try) -> Outcome:
        raise AssertionError("not reached")

    assert ModelHeld(state)(ctx, Try(lease), next) is AGAIN
    assert lease.worker.in_flight == 0 and lease.worker.id in ctx.excluded
    assert ctx.missing_model == "m"


def test_model_count_ends_what_it_started_even_when_the_attempt_raises(
    pool: WorkerPool,
) -> None:
    """Tasks in flight per model go back down whatever happens below."""
    state = pool._state
    counted: list[tuple[str, str, str]] = []

    class Placer:
        def started(self, wid: str, model: str, now: float) -> None:
            counted.append(("started", wid, model))

        def ended(self, wid: str, model: str, now: float) -> None:
            counted.append(("ended", wid, model))

    state.placer = Placer()  # type: ignore[assignment]
    try:
        step = ModelCount(state)
        ctx = begin(pool, Task({"model_id": "m", "input_text": "x"}))
        lease = state.dispatcher.try_acquire(())
        assert lease is not None

        def next(ctx: TaskContext, at: Try) -> Outcome:
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError):
            step(ctx, Try(lease), next)
        record(state, lease, OK, 0.0, 0.0, retry=False)
    finally:
        state.placer = None
    wid = lease.worker.id
    assert counted == [("started", wid, "m"), ("ended", wid, "m")]


# Attacks on model routing and placement for a task, through a pool over a fake network:
# lying and hostile model lists, odd model ids, a model unloaded everywhere while tasks
# wait, placements racing, a placement worker removed while it loads.


def test_a_not_loaded_answer_naming_another_model_still_keeps_the_worker_out():
    """A worker answering "Model X not loaded" to a task for m is kept out for m: one
    bounce in the whole run, however many tasks name m."""

    def liar(req: FakeRequest) -> Response:
        return json_response(500, {"detail": "Model \x1b[31mSOMETHING-ELSE not loaded"})

    net = FakeNetwork()
    net.route("a", linux(None, task=liar))
    net.route("b", linux(None))
    cfg = config(w("a", 0, priority=1), w("b", 1, priority=2))
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        for _ in range(10):
            assert pool.execute({"model_id": "m"})["worker"] == "b"
    assert len(tasks_to(net, "a")) == 1


def test_a_task_every_worker_bounces_is_rejected_naming_the_tasks_own_model():
    """When every worker says "not loaded", exc.model is the model the task named, not
    whatever (escape sequences included) a worker's answer named."""
    hostile = "\x1b]0;pwned\x07" + "x" * 10_000

    def liar(req: FakeRequest) -> Response:
        return json_response(500, {"detail": f"Model {hostile} not loaded"})

    net = FakeNetwork()
    net.route("a", linux(None, task=liar))
    with WorkerPool(config(w("a", 0)), transport_factory=net.factory) as pool:
        with pytest.raises(TaskRejected) as info:
            pool.execute({"model_id": "m"})
        assert info.value.model == "m"
        assert "\x1b" not in str(info.value) and len(str(info.value)) < 2000
        assert len(pool.dead_letters) == 0


def test_a_worker_listing_a_model_it_never_serves_costs_one_bounce_per_health_round():
    """A /models that always names m while tasks for m always bounce: each round brings
    the lie back, each costs at most one bounce, and every task succeeds elsewhere."""

    def never(req: FakeRequest) -> Response:
        return json_response(500, {"detail": "Model m not loaded"})

    net = FakeNetwork()
    net.route("liar", linux(["m"], task=never))
    net.route("b", linux(["m"]))
    cfg = config(w("liar", 0, priority=1), w("b", 1, priority=2))
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        rounds = 5
        for _ in range(rounds):
            pool.check_health()
            for _ in range(10):
                assert pool.execute({"model_id": "m"})["worker"] == "b"
        assert pool.stats()["tasks"]["failed"] == 0
    assert len(tasks_to(net, "liar")) == rounds


def test_a_correction_without_a_model_list_gives_way_at_the_next_health_round():
    """A worker with no /models that once said "not loaded" for m is tried for m again
    after a health round (it may have loaded m since), not rejected for ever."""
    held: list[str] = []

    def task(req: FakeRequest) -> Response:
        model = req.json()["model_id"]
        if model not in held:
            return json_response(500, {"detail": f"Model {model} not loaded"})
        return json_response(200, {"worker": req.worker_id})

    net = FakeNetwork()
    net.route("a", linux(None, task=task))
    with WorkerPool(config(w("a", 0)), transport_factory=net.factory) as pool:
        pool.check_health()
        with pytest.raises(TaskRejected):
            pool.execute({"model_id": "m"})
        with pytest.raises(TaskRejected):  # known to lack m: nothing sent
            pool.execute({"model_id": "m"})
        assert len(tasks_to(net, "a")) == 1
        held.append("m")  # an operator loads m by hand
        pool.check_health()
        assert pool.execute({"model_id": "m"}) == {"worker": "a"}


@pytest.mark.parametrize(
    "models",
    [
        {"loaded_models": {str(n): {} for n in range(200_000)}},  # megabytes of ids
        {"loaded_models": [1, None, ["m"], {"m": 1}, "ok\x1b[2J", "\u202eevil"]},
        {"loaded_models": "m"},
    ],
)
def test_hostile_model_lists_neither_raise_nor_reach_workers_output(models: Any):
    """A huge, mistyped or escape-laden /models never breaks a round and never puts a
    control character or a non-string into workers(), stats() or their JSON."""
    net = FakeNetwork()

    def handle(req: FakeRequest) -> Response:
        if req.path == "/models":
            return json_response(200, models)
        return linux([])(req)

    net.route("a", handle)
    with WorkerPool(config(w("a", 0)), transport_factory=net.factory) as pool:
        pool.check_health()
        (row,) = pool.workers()
        assert row["healthy"] is True
        listed = row["models"] or []
        assert all(isinstance(m, str) and m.isprintable() for m in listed)
        shown = json.dumps([pool.workers(), pool.stats()])
    assert "\x1b" not in shown and "\u202e" not in shown


@pytest.mark.parametrize("model", [["m"], {"m": 1}, 7, None, True])
def test_a_payload_naming_a_model_of_another_type_is_routed_as_naming_none(model: Any):
    """model_id that is not a string: no routing by models, no crash, the task runs."""
    net = FakeNetwork()
    net.route("a", linux([], task=lambda req: json_response(200, {"ok": req.json()})))
    with WorkerPool(config(w("a", 0)), transport_factory=net.factory) as pool:
        pool.check_health()
        assert pool.execute({"model_id": model}) == {"ok": {"model_id": model}}


def test_a_long_model_name_in_a_rejection_is_bounded_and_escaped():
    """A 10 kB model id with control characters that no worker holds: TaskRejected at
    once, with exc.model the id itself and a message short and free of escapes."""
    model = "\x1b[1m" + "y" * 10_000
    net = FakeNetwork()
    net.route("a", linux(["m"]))
    with WorkerPool(config(w("a", 0)), transport_factory=net.factory) as pool:
        pool.check_health()
        with pytest.raises(TaskRejected) as info:
            pool.execute({"model_id": model})
    assert info.value.model == model
    assert "\x1b" not in str(info.value) and len(str(info.value)) < 2000
    assert tasks_to(net, "a") == []


def test_a_model_unloaded_everywhere_rejects_waiting_tasks_without_dead_letters():
    """Tasks queued for m when every worker unloads it: each ends TaskRejected naming m,
    each worker bounces one task only (the rest know by then), and no dead letter."""
    held = {"a": ["m"], "b": ["m"]}
    gate = threading.Event()
    inside = threading.Barrier(3)

    def task(req: FakeRequest) -> Response:
        if not gate.is_set():
            inside.wait(5)  # both workers busy with a first task each
            gate.wait(5)
        if "m" not in held[req.worker_id]:
            return json_response(500, {"detail": "Model m not loaded"})
        return json_response(200, {"worker": req.worker_id})

    net = FakeNetwork()
    net.route("a", linux(held["a"], task=task))
    net.route("b", linux(held["b"], task=task))
    cfg = config(w("a", 0, max_concurrent=1), w("b", 1, max_concurrent=1))
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        pool.check_health()
        first = [pool.submit({"model_id": "m"}) for _ in range(2)]
        inside.wait(5)
        queued = [pool.submit({"model_id": "m"}, timeout=10) for _ in range(8)]
        held["a"].clear()
        held["b"].clear()
        gate.set()
        outcomes = []
        for future in first + queued:
            try:
                outcomes.append(future.result(15))
            except TaskRejected as exc:
                assert exc.model == "m"
                outcomes.append("rejected")
        assert outcomes.count("rejected") == 10
        assert len(pool.dead_letters) == 0
    assert len(tasks_to(net, "a")) == len(tasks_to(net, "b")) == 1


def test_placement_never_loads_a_model_a_live_worker_already_serves():
    """A task that decided to place m just as another task's placement of m finished
    finds the model served and sends no second load."""
    loads: list[str] = []

    def load(req: FakeRequest) -> Response:
        loads.append(req.worker_id)
        return json_response(200, {"status": "success"})

    held = ["other"]
    net = FakeNetwork()
    net.route("a", linux(held, load=load))
    cfg = config(w("a", 0), models=ModelsConfig(placement=True))
    real = ModelLoad.place

    def place_after_another(run: ModelLoad, model: str) -> str | None:
        # Another task's placement of the model ends between this task's check and
        # its own placement.
        held.append(model)
        with run.state.lock:
            run.state.workers["a"].held.model_placed(model)
            run.state.models_changed_locked()
        return real(run, model)

    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        pool.check_health()
        ModelLoad.place = place_after_another  # type: ignore[method-assign]
        try:
            assert pool.execute({"model_id": "m"})["worker"] == "a"
        finally:
            ModelLoad.place = real  # type: ignore[method-assign]
    assert loads == []


def test_two_hundred_tasks_for_one_unplaced_model_load_it_exactly_once():
    """200 threads ask at once for a model no worker holds: one load, 200 results."""
    loads: list[str] = []
    release = threading.Event()
    held = ["other"]

    def load(req: FakeRequest) -> Response:
        release.wait(10)
        loads.append(req.json()["model_id"])
        held.append("m")
        return json_response(200, {"status": "success"})

    net = FakeNetwork()
    net.route("a", linux(held, load=load))
    cfg = config(w("a", 0, max_concurrent=16), models=ModelsConfig(placement=True))
    start = threading.Barrier(201)
    results: list[Any] = []

    def one(pool: WorkerPool) -> None:
        start.wait(10)
        results.append(pool.execute({"model_id": "m"}, timeout=30)["worker"])

    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        pool.check_health()
        threads = [threading.Thread(target=one, args=(pool,)) for _ in range(200)]
        for t in threads:
            t.start()
        start.wait(10)
        release.set()
        for t in threads:
            t.join(30)
    assert loads == ["m"]
    assert results == ["a"] * 200


def test_a_worker_removed_while_loading_the_model_rejects_the_task_at_once():
    """The placement worker leaves the pool during the load: the task is rejected naming
    the model (the only other worker lacks it), not parked until a dead letter."""
    loading = threading.Event()
    release = threading.Event()

    def load(req: FakeRequest) -> Response:
        loading.set()
        release.wait(10)
        return json_response(200, {"status": "success"})

    net = FakeNetwork()
    net.route("a", linux(["other"], load=load))
    net.route("b", linux(["other"]))
    cfg = config(w("a", 0), w("b", 1), models=ModelsConfig(placement=True))
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        pool.check_health()
        future = pool.submit({"model_id": "m"}, timeout=20)
        assert loading.wait(10)
        pool.remove_worker("a")
        release.set()
        with pytest.raises(TaskRejected) as info:
            future.result(5)  # far below the task's deadline
        assert info.value.model == "m"
        assert len(pool.dead_letters) == 0
    assert tasks_to(net, "b") == []


# Attacks on a task's requires meeting its model: a model loaded on demand for a task
# that requires what only some workers have, a model held only by workers the task may
# not use, and a task no live worker may serve. The load goes only where the task may
# run, the task never runs elsewhere, and a task nobody can serve is rejected at once.


def _loader(held: dict[str, list[str]], loads: list[tuple[str, str]]) -> Any:
    def load(req: FakeRequest) -> Response:
        model = req.json()["model_id"]
        loads.append((req.worker_id, model))
        held[req.worker_id].append(model)
        return json_response(200, {"status": "success", "model_id": model})

    return load


def _requires_fleet(
    held: dict[str, list[str]], loads: list[tuple[str, str]], **models: Any
) -> tuple[FakeNetwork, WorkerPool]:
    # "plain" comes first: where nothing else decides, a load goes there.
    net = FakeNetwork()
    for wid in held:
        net.route(wid, linux(held[wid], load=_loader(held, loads)))
    models.setdefault("interval", 3600)  # no round runs on its own
    cfg = config(
        w("plain", 0),
        w("cam", 1, capabilities=("vision",)),
        models=ModelsConfig(**models),
    )
    pool = WorkerPool(cfg, transport_factory=net.factory)
    pool.check_health()
    return net, pool


@pytest.mark.parametrize("balance", [False, True])
def test_a_model_loaded_for_a_task_goes_only_to_a_worker_meeting_its_requires(
    balance: bool,
) -> None:
    """No worker holds m; a task for m requiring vision has it loaded on the vision
    worker and runs there, never on the other (which a load would otherwise pick)."""
    held: dict[str, list[str]] = {"plain": ["x"], "cam": ["x"]}
    loads: list[tuple[str, str]] = []
    net, pool = _requires_fleet(held, loads, placement=True, balance=balance)
    with pool:
        task = Task({"model_id": "m"}, requires={"vision"}, timeout=10)
        assert pool.execute(task)["worker"] == "cam"
    assert loads == [("cam", "m")]
    assert tasks_to(net, "plain") == []


@pytest.mark.parametrize("balance", [False, True])
def test_a_model_held_only_by_workers_failing_requires_is_loaded_on_one_meeting_them(
    balance: bool,
) -> None:
    """Only the worker without vision holds m: a task for m requiring vision has m
    loaded on the vision worker and runs there, not failing as if every worker had been
    tried."""
    held: dict[str, list[str]] = {"plain": ["m"], "cam": ["x"]}
    loads: list[tuple[str, str]] = []
    net, pool = _requires_fleet(held, loads, placement=True, balance=balance)
    with pool:
        for _ in range(3):
            task = Task({"model_id": "m"}, requires={"vision"}, timeout=10)
            assert pool.execute(task)["worker"] == "cam"
        assert len(pool.dead_letters) == 0
    assert loads == [("cam", "m")]
    assert tasks_to(net, "plain") == []


@pytest.mark.parametrize(
    ("placement", "refused"), [(False, ""), (True, "loading it on cam failed: HTTP 500")]
)
def test_a_task_no_live_worker_meeting_its_requires_can_serve_is_rejected_at_once(
    placement: bool, refused: str
) -> None:
    """m is held only by the worker without vision, and the vision worker cannot have
    it (no placement, or it refuses the load): TaskRejected naming the model and what
    the holder lacks, no task request, no dead letter."""
    held: dict[str, list[str]] = {"plain": ["m"], "cam": ["x"]}
    net = FakeNetwork()
    net.route("plain", linux(held["plain"]))
    net.route("cam", linux(held["cam"], load=lambda req: json_response(500, {"detail": "no"})))
    cfg = config(
        w("plain", 0),
        w("cam", 1, capabilities=("vision",)),
        models=ModelsConfig(placement=placement),
    )
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        pool.check_health()
        with pytest.raises(TaskRejected) as info:
            pool.execute(Task({"model_id": "m"}, requires={"vision"}, timeout=10))
        assert len(pool.dead_letters) == 0
        assert pool.stats()["tasks"]["rejected"] == 1
    message = str(info.value)
    assert info.value.model == "m"
    assert "requires (vision)" in message
    assert "plain lacks capability 'vision'" in message
    assert refused in message
    assert tasks_to(net, "plain") == tasks_to(net, "cam") == []


def test_a_worker_failing_requires_is_not_readmitted_after_its_model_is_loaded(
    pool: WorkerPool,
) -> None:
    """After a load, a worker the task found without the model may be tried again, but
    never one the task's requires keep out, whatever it holds."""
    state = pool._state
    route = ModelRoute(state, pool._runner.outcomes, True, 1.0)
    ctx = begin(pool, Task({"model_id": "m", "input_text": "x"}))
    ctx.unfit = frozenset({"a"})
    ctx.not_here |= {"a", "b"}
    ctx.excluded |= {"a", "b"}
    route.readmit(ctx, "m")  # neither worker's list is known: both may hold m
    assert ctx.not_here == ctx.excluded == {"a"}


@pytest.mark.parametrize("balance", [False, True])
def test_real_workers_a_model_loaded_for_a_task_requiring_vision_runs_only_with_vision(
    balance: bool,
) -> None:
    """Two reference workers holding another model; tasks for m1 requiring vision have
    m1 loaded on the vision worker only and all run there; a task without requires for
    m2 is still loaded where placement likes."""
    with (
        LocalWorker(worker_id="plain", models=("x",)).start() as plain,
        LocalWorker(worker_id="cam", models=("x",)).start() as cam,
    ):
        cfg = config(
            worker_config("plain", plain.url),
            worker_config("cam", cam.url, capabilities=("vision",)),
            models=ModelsConfig(placement=True, balance=balance, interval=3600),
        )
        with WorkerPool(cfg) as pool:
            pool.check_health()
            for _ in range(5):
                task = Task({"model_id": "m1", "input_text": "hi"}, requires={"vision"})
                assert pool.execute(task)["worker_id"] == "cam"
            assert pool.execute({"model_id": "m2", "input_text": "hi"})["model_id"] == "m2"
            rows = {row["id"]: row for row in pool.workers()}
        assert "m1" not in plain.control()["models"]
        assert "m1" in cam.control()["models"]
        assert rows["plain"]["tasks"]["attempts"] <= 1  # m2's task only
