"""Placement rounds and eviction (models.balance): replica targets, the coldest model
evicted from a full worker, hold times, and attacks on each promise."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from npu_sync import NoWorkerAvailable, Task, TaskRejected, WorkerPool
from npu_sync._placement import Load, ModelUse, Planner, Unload, WorkerView
from npu_sync._stop import TaskStop
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    ModelPolicy,
    ModelsConfig,
    PoolConfig,
    RetryConfig,
    TimeoutConfig,
    worker_config,
)
from npu_sync.events import Event, ModelPlacement
from npu_sync.testing import FakeClock, FakeNetwork, FakeRequest, json_response
from npu_sync.transport import Response
from npu_sync.worker_server import LocalWorker


class ModelWorker:
    """A fake Linux worker with a model list, an optional cap (answered 507 beyond it;
    reported in its list as ``max_models`` only when ``reports`` says what, as AutoBot's
    worker reports none), a load time on the fake clock, and tasks that may be held
    open."""

    def __init__(
        self,
        clock: FakeClock,
        models: tuple[str, ...] = (),
        cap: int | None = None,
        load_seconds: float = 1.0,
        reports: int | None = None,
    ) -> None:
        self.clock = clock
        self.models = list(models)
        self.cap = cap
        self.reports = reports
        self.full = 0  # loads answered 507
        self.load_seconds = load_seconds
        self.latency = 0.0  # fake seconds each task takes
        self.load_status: int | None = None
        self.loads: list[str] = []
        self.unloads: list[str] = []
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, req: FakeRequest) -> Response:
        path = req.path
        if path == "/health":
            return json_response(200, {"status": "healthy"})
        if path == "/models" and req.method == "GET":
            with self.lock:
                loaded = {m: {"device": "NPU"} for m in self.models}
            listed: dict[str, object] = {"loaded_models": loaded}
            if self.reports is not None:
                listed["max_models"] = self.reports
            return json_response(200, listed)
        if path == "/models/load":
            model = req.json()["model_id"]
            if self.load_status is not None:
                return json_response(self.load_status, {"detail": "forced"})
            with self.lock:
                if self.cap is not None and len(self.models) >= self.cap:
                    self.full += 1
                    return json_response(507, {"detail": "model capacity reached"})
            self.clock.advance(self.load_seconds)
            with self.lock:
                self.models.append(model)
                self.loads.append(model)
            return json_response(200, {"status": "success", "model_id": model})
        if path.startswith("/models/") and req.method == "DELETE":
            model = path.removeprefix("/models/")
            with self.lock:
                if model not in self.models:
                    return json_response(404, {"detail": "not found"})
                self.models.remove(model)
                self.unloads.append(model)
            return json_response(200, {"status": "success", "model_id": model})
        model = req.json().get("model_id")
        with self.lock:
            here = model in self.models
        if not here:
            return json_response(500, {"detail": f"Model {model} not loaded"})
        if req.json().get("hold"):
            self.entered.set()
            self.hold.wait(10)
        self.clock.advance(self.latency)
        return json_response(200, {"worker": req.worker_id, "model_id": model})


def config(n: int, **models: object) -> PoolConfig:
    models.setdefault("balance", True)
    models.setdefault("placement", True)
    models.setdefault("interval", 3600)  # rounds are run by the test
    return PoolConfig(
        workers=tuple(worker_config(f"w{i}", f"http://127.0.0.1:{9500 + i}") for i in range(n)),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=2, backoff_initial=0.0, backoff_max=0.0),
        circuit_breaker=BreakerConfig(fail_max=3),
        models=ModelsConfig(**models),  # type: ignore[arg-type]
    )


def fleet(
    clock: FakeClock, *workers: ModelWorker, events: list[Event] | None = None, **models: object
) -> WorkerPool:
    net = FakeNetwork()
    for i, worker in enumerate(workers):
        net.route(f"w{i}", worker)
    pool = WorkerPool(
        config(len(workers), **models),
        transport_factory=net.factory,
        clock=clock,
        hooks=[] if events is None else [events.append],
    )
    pool.check_health()  # reads every worker's list
    return pool


def placements(events: list[Event], action: str) -> list[tuple[str, str]]:
    return [
        (e.worker_id, e.model)
        for e in events
        if isinstance(e, ModelPlacement) and e.action == action
    ]


# -- the planner alone -------------------------------------------------------------


def view(
    wid: str, models: tuple[str, ...], cap: int | None = None, live: bool = True
) -> WorkerView:
    return WorkerView(wid, live, frozenset(models), cap, 4, 0)


def test_a_new_replica_goes_where_loading_was_cheapest() -> None:
    """Learnt load times decide; a free model slot beats an eviction at the same cost."""
    cfg = ModelsConfig(hold=0)
    costs = {("a", "m"): 9.0, ("b", "m"): 2.0, ("c", "m"): 2.0}
    planner = Planner(cfg, ModelUse(), {}, costs)
    workers = [view("a", ()), view("b", ("x",), cap=1), view("c", ())]
    load = planner.target("m", workers, now=100.0)
    assert load == Load("c", "m", (), "a task needs it")
    unknown = Planner(cfg, ModelUse(), {}, {("a", "other"): 0.5, ("b", "other"): 3.0})
    assert unknown.target("m", [view("a", ()), view("b", ())], 100.0).worker_id == "a"  # type: ignore[union-attr]


def test_the_coldest_model_per_second_of_load_cost_is_evicted() -> None:
    """Idle time per second of load cost: long idle and cheap to reload goes first;
    a model with a task in flight never does."""
    use = ModelUse()
    use.start("a", "hot", 95.0)  # in flight
    use.start("a", "cheap", 10.0)
    use.end("a", "cheap", 10.0)
    use.start("a", "dear", 5.0)
    use.end("a", "dear", 5.0)
    costs = {("a", "cheap"): 1.0, ("a", "dear"): 30.0, ("a", "hot"): 1.0}
    planner = Planner(ModelsConfig(hold=0), use, {}, costs)
    assert planner.coldest("a", ["hot", "cheap", "dear"], 100.0, {}) == "cheap"
    assert planner.coldest("a", ["hot"], 100.0, {}) is None


def test_min_replicas_and_hold_protect_a_model() -> None:
    """The last replica of a min>=1 model, and a model inside its hold time (or never
    seen loaded: its hold starts now), stay."""
    cfg = ModelsConfig(hold=60, catalog={"keep": ModelPolicy(1, None)})
    planner = Planner(cfg, ModelUse(), {("a", "fresh"): 90.0, ("a", "keep"): 0.0}, {})
    assert not planner.may_unload("a", "unseen", 1000.0, replicas=2)
    assert not planner.may_unload("a", "keep", 1000.0, replicas=1)
    assert planner.may_unload("a", "keep", 1000.0, replicas=2)
    assert not planner.may_unload("a", "fresh", 100.0, replicas=2)
    assert planner.may_unload("a", "fresh", 151.0, replicas=2)


def test_a_round_adds_below_min_scales_up_and_removes_cold_and_surplus() -> None:
    """One plan: below min → load; busy → another replica; cold → unload; above max →
    unload; never more loads than loads_per_round."""
    use = ModelUse()
    cfg = ModelsConfig(
        hold=0,
        idle=50,
        loads_per_round=2,
        catalog={"need": ModelPolicy(1, None), "capped": ModelPolicy(0, 1)},
    )
    now = 100.0
    for _ in range(4):
        use.start("a", "busy", now)
    use.start("b", "capped", now)
    use.end("b", "capped", now)
    use.start("c", "capped", now)
    use.end("c", "capped", now)
    planner = Planner(cfg, use, {("b", "cold"): 0.0}, {})
    workers = [view("a", ("busy",)), view("b", ("capped", "cold")), view("c", ("capped",))]
    actions = planner.plan(workers, use.take_windows(now, 10.0), now)
    loads = [a for a in actions if isinstance(a, Load)]
    unloads = {(a.worker_id, a.model) for a in actions if isinstance(a, Unload)}
    assert {load.model for load in loads} == {"busy", "need"} and len(loads) == 2
    assert ("b", "cold") in unloads
    assert len([u for u in unloads if u[1] == "capped"]) == 1


def test_one_round_never_evicts_a_min_models_replicas_below_its_min() -> None:
    """loads_per_round 3 on three full workers, each holding the coldest model x: the
    round's evictions count each other, so x (min 1, then min 2) keeps its min."""
    now = 1000.0
    for keep in (1, 2):
        use = ModelUse()
        for wid, hot in (("a", "h0"), ("b", "h1"), ("c", "h2")):
            use.start(wid, hot, now - 1)
            use.end(wid, hot, now - 1)
            use.start(wid, "x", 10.0)
            use.end(wid, "x", 10.0)
        catalog = {m: ModelPolicy(1, None) for m in ("h0", "h1", "h2", "n0", "n1", "n2")}
        catalog["x"] = ModelPolicy(keep, None)
        cfg = ModelsConfig(hold=0, idle=86400, loads_per_round=3, catalog=catalog)
        workers = [view(w, ("x", h), cap=2) for w, h in (("a", "h0"), ("b", "h1"), ("c", "h2"))]
        actions = Planner(cfg, use, {}, {}).plan(workers, {}, now)
        loads = [a for a in actions if isinstance(a, Load)]
        gone = sum(a.evict.count("x") for a in loads)
        gone += sum(1 for a in actions if isinstance(a, Unload) and a.model == "x")
        assert 3 - gone >= keep, actions
        assert len(loads) == 3 - keep  # the other loads found nothing that may leave


# -- a pool over fake workers ------------------------------------------------------


def test_a_round_loads_a_model_below_its_min_and_reports_it() -> None:
    """min 2: two rounds (one load each) give the model two holders, with events,
    stats and the per-model row; the learnt load time is the worker's."""
    clock = FakeClock()
    workers = [ModelWorker(clock, load_seconds=2.0) for _ in range(3)]
    events: list[Event] = []
    with fleet(clock, *workers, events=events, catalog={"m": ModelPolicy(2, 3)}) as pool:
        pool.check_placement()
        pool.check_placement()
        pool.check_placement()  # at min: nothing more
        assert sum(w.loads.count("m") for w in workers) == 2
        assert len(placements(events, "load")) == 2
        models = pool.stats()["models"]
        assert (models["balance"], models["loads"], models["unloads"]) == (True, 2, 0)
        (row,) = models["per_model"]
        assert row["model"] == "m" and (row["min"], row["max"]) == (2, 3)
        assert len(row["workers"]) == 2 and row["load_seconds"] == pytest.approx(2.0)
        assert pool.execute({"model_id": "m"})["model_id"] == "m"


def test_a_full_worker_evicts_its_coldest_model_never_one_in_flight() -> None:
    """Cap 2 holding busy (a task in flight) and idle; a task for new evicts idle,
    the task in flight ends well, and the new model serves."""
    clock = FakeClock()
    worker = ModelWorker(clock, ("busy", "idle"), cap=2)
    events: list[Event] = []
    with fleet(clock, worker, events=events, hold=10) as pool:
        assert pool.check_placement() == []  # a round sees what each worker holds
        clock.advance(30)  # past the hold time of the models first seen
        worker.hold.clear()
        held = pool.submit({"model_id": "busy", "hold": True})
        assert worker.entered.wait(10)
        assert pool.execute({"model_id": "new"})["model_id"] == "new"
        assert worker.unloads == ["idle"] and "busy" in worker.models
        worker.hold.set()
        assert held.result(10)["model_id"] == "busy"
        assert placements(events, "evict") == [("w0", "idle")]
        assert pool.stats()["models"]["evictions"] == 1


def test_an_eviction_never_takes_a_model_with_a_task_in_flight() -> None:
    """Both models of a full worker keep tasks in flight past the new task's wait:
    nothing is unloaded, the new task fails as no worker available (its dead letter
    stored: it is not a bad task), and both tasks end well."""
    clock = FakeClock()
    worker = ModelWorker(clock, ("a", "b"), cap=2)
    with fleet(clock, worker, hold=0) as pool:
        worker.hold.clear()
        first = pool.submit({"model_id": "a", "hold": True})
        assert worker.entered.wait(10)
        worker.entered.clear()
        second = pool.submit({"model_id": "b", "hold": True})
        assert worker.entered.wait(10)
        with pytest.raises(NoWorkerAvailable, match="may not leave yet") as failed:
            pool.execute({"model_id": "c"})
        assert failed.value.dead_letter_id is not None
        assert [r.id for r in pool.dead_letters.list()] == [failed.value.dead_letter_id]
        assert worker.unloads == []
        worker.hold.set()
        assert first.result(10)["model_id"] == "a" and second.result(10)["model_id"] == "b"


class WaitingClock(FakeClock):
    """A fake clock whose ``wait`` blocks for real (10 s at most) until its event is
    set, and says when a wait began."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        if timeout is not None and timeout <= 0:
            return event.is_set()
        self.waiting.set()
        return event.wait(10 if timeout is None else min(timeout, 10))


def test_a_load_waits_for_a_task_in_flight_to_end_then_evicts() -> None:
    """Both models of a full worker have a task in flight: a task for a third model
    waits for a slot instead of being refused; once those tasks end, the coldest
    model leaves and the waiting task is served."""
    clock = WaitingClock()
    worker = ModelWorker(clock, ("a", "b"), cap=2)
    with fleet(clock, worker, hold=0) as pool:
        worker.hold.clear()
        first = pool.submit({"model_id": "a", "hold": True})
        assert worker.entered.wait(10)
        worker.entered.clear()
        second = pool.submit({"model_id": "b", "hold": True})
        assert worker.entered.wait(10)
        third = pool.submit({"model_id": "c"})
        assert clock.waiting.wait(10)  # its load waits for a slot
        assert worker.unloads == [] and not third.done()
        worker.hold.set()
        assert third.result(10)["model_id"] == "c"
        assert first.result(10)["model_id"] == "a" and second.result(10)["model_id"] == "b"
        assert len(worker.unloads) == 1 and "c" in worker.models


def test_a_task_waiting_for_a_slot_leaves_when_stopped() -> None:
    """A task whose load waits for a slot held by a task in flight is woken by its
    stop and leaves at once, nothing unloaded."""
    clock = WaitingClock()
    worker = ModelWorker(clock, ("a",), cap=1)
    with fleet(clock, worker, hold=0, max_models=1) as pool:
        placer = pool._placer
        assert placer is not None
        placer.started("w0", "a", clock.monotonic())  # a task of a's, in flight
        stop = TaskStop()
        answer: list[str | None] = []
        waiting = threading.Thread(target=lambda: answer.append(placer.place("c", 60.0, stop)))
        waiting.start()
        assert clock.waiting.wait(10)
        stop.cancel()
        waiting.join(10)
        assert answer == ["the task was stopped while it waited for a model slot"]
        assert worker.unloads == [] and worker.loads == []
        placer.ended("w0", "a", clock.monotonic())


def test_a_load_waits_for_a_hold_that_ends_within_the_tasks_wait() -> None:
    """Every slot is inside its hold time: a task whose wait for a worker (10 s) ends
    before the first hold does fails at once as no worker available, nothing
    unloaded; one arriving 5 s before a hold ends waits those 5 s, then evicts."""
    clock = FakeClock()
    worker = ModelWorker(clock, ("a", "b"), cap=2, load_seconds=0.5)
    with fleet(clock, worker, hold=30, max_models=2) as pool:
        start = clock.monotonic()  # a and b count as loaded at the pool's first look
        pool.check_placement()
        clock.advance(19)
        with pytest.raises(NoWorkerAvailable, match=r"may leave in 11\.0s"):
            pool.execute({"model_id": "c"})
        assert clock.monotonic() == start + 19 and worker.unloads == []
        clock.advance(6)
        assert pool.execute({"model_id": "c"})["model_id"] == "c"
        assert len(worker.unloads) == 1
        assert clock.monotonic() == start + 30 + 0.5  # its hold's end, then the load


def test_a_round_never_unloads_a_model_whose_task_is_in_flight() -> None:
    """A replica whose one task has been in flight for longer than idle looks cold by
    its last use: a round leaves it; once the task ended and idle passed, it goes."""
    clock = FakeClock()
    worker = ModelWorker(clock, ("m",))
    with fleet(clock, worker, hold=0, idle=5) as pool:
        pool.check_placement()
        worker.hold.clear()
        held = pool.submit({"model_id": "m", "hold": True})
        assert worker.entered.wait(10)
        clock.advance(100)
        pool.check_placement()
        assert worker.models == ["m"] and worker.unloads == []
        worker.hold.set()
        assert held.result(10)["model_id"] == "m"
        clock.advance(100)
        pool.check_placement()
        assert worker.unloads == ["m"]


def test_the_last_replica_of_a_min_model_stays_however_cold() -> None:
    """keep (min 1) and spare (min 0) are both cold: spare is unloaded, keep stays."""
    clock = FakeClock()
    worker = ModelWorker(clock, ("keep", "spare"))
    with fleet(clock, worker, hold=0, idle=10, catalog={"keep": ModelPolicy(1, None)}) as pool:
        assert pool.check_placement() == []  # first seen: idle counts from here
        clock.advance(1000)
        pool.check_placement()
        pool.check_placement()
        assert worker.models == ["keep"] and worker.unloads == ["spare"]


def test_a_round_of_two_loads_leaves_a_min_model_one_replica() -> None:
    """Two workers full of x (min 1, the coldest) and a hot model each; two models
    below their min: one round with loads_per_round 2 loads one of them, evicting x
    once, and x keeps a replica."""
    clock = FakeClock()
    w0 = ModelWorker(clock, ("x", "h0"), cap=2)
    w1 = ModelWorker(clock, ("x", "h1"), cap=2)
    catalog = {m: ModelPolicy(1, None) for m in ("x", "h0", "h1", "n1", "n2")}
    with fleet(
        clock, w0, w1, hold=0, idle=86400, max_models=2, loads_per_round=2, catalog=catalog
    ) as pool:
        clock.advance(100)
        pool.execute({"model_id": "h0"})
        pool.execute({"model_id": "h1"})  # x is now the coldest everywhere
        pool.check_placement()
        assert sum("x" in w.models for w in (w0, w1)) == 1
        assert w0.unloads + w1.unloads == ["x"]


def test_a_second_try_after_a_507_counts_the_rounds_evictions_to_come() -> None:
    """w0's cap is unknown, w1's is configured: the round loads one model on w0 (no
    eviction planned) and one on w1 evicting x (min 1). w0 answers 507; trying again
    there must not evict x too, since the round's w1 eviction is still to come."""
    clock = FakeClock()
    w0 = ModelWorker(clock, ("x", "h0"), cap=2)
    w1 = ModelWorker(clock, ("x", "h1"), cap=2)
    net = FakeNetwork()
    net.route("w0", w0)
    net.route("w1", w1)
    catalog = {m: ModelPolicy(1, None) for m in ("x", "h0", "h1", "n1", "n2")}
    cfg = dataclasses.replace(
        config(2, hold=0, idle=86400, loads_per_round=2, catalog=catalog),
        workers=(
            worker_config("w0", "http://127.0.0.1:9500"),
            worker_config("w1", "http://127.0.0.1:9501", max_models=2),
        ),
    )
    with WorkerPool(cfg, transport_factory=net.factory, clock=clock) as pool:
        pool.check_health()
        clock.advance(100)
        pool.execute({"model_id": "h0"})
        pool.execute({"model_id": "h1"})
        pool.check_placement()
        assert sum("x" in w.models for w in (w0, w1)) == 1
        assert w0.unloads + w1.unloads == ["x"]


def test_two_hot_sets_alternating_do_not_thrash() -> None:
    """One worker, two model slots, hot sets {a, b} and {c, d} alternating every 20 s
    with a 60 s hold: a model stays at least its hold time, so loads are bounded by
    the hold (at most two slots per 60 s), not by the switches (18 without it). A task
    that finds every slot held fails as no worker available, its dead letter stored
    (replayable once a slot frees), never as a bad task."""
    clock = FakeClock()
    worker = ModelWorker(clock, (), cap=2, load_seconds=0.5)
    served = failed = 0
    with fleet(clock, worker, hold=60) as pool:
        for phase in range(9):
            hot = ("a", "b") if phase % 2 == 0 else ("c", "d")
            for _ in range(3):
                for model in hot:
                    try:
                        pool.execute({"model_id": model})
                        served += 1
                    except NoWorkerAvailable:
                        failed += 1
            clock.advance(20)
        assert len(pool.dead_letters.list()) == failed
    assert len(worker.loads) <= 2 * (9 * 20 // 60 + 1)
    assert len(worker.loads) < 16 and served > 0 and failed > 0
    assert all(worker.loads.count(m) <= 4 for m in "abcd")


def test_a_worker_refusing_a_load_fails_the_task_and_charges_nobody() -> None:
    """500 to a load: the task is rejected naming the answer; 507 (full, and x is
    inside its hold time): the task fails as no worker available. Either way a failed
    placement event is sent and the worker's breaker is untouched."""
    ends: list[tuple[int, type[Exception], str]] = [
        (507, NoWorkerAvailable, "may not leave yet"),
        (500, TaskRejected, "HTTP 500"),
    ]
    for status, error, match in ends:
        clock = FakeClock()
        worker = ModelWorker(clock, ("x",))
        worker.load_status = status
        events: list[Event] = []
        with fleet(clock, worker, events=events) as pool:
            with pytest.raises(error, match=match):
                pool.execute({"model_id": "m"})
            assert placements(events, "failed") == [("w0", "m")]
            assert pool.workers()[0]["breaker"]["failures"] == 0
            assert pool.stats()["models"]["load_failures"] == 1
            assert pool.execute({"model_id": "x"})["model_id"] == "x"


def test_a_model_unloaded_behind_the_pools_back_is_placed_again() -> None:
    """The worker drops m itself: the next task's "not loaded" corrects the list and
    the task is placed again, once."""
    clock = FakeClock()
    worker = ModelWorker(clock, ("m",))
    with fleet(clock, worker) as pool:
        assert pool.execute({"model_id": "m"})["model_id"] == "m"
        with worker.lock:
            worker.models.remove("m")
        assert pool.execute({"model_id": "m"})["model_id"] == "m"
        assert worker.loads == ["m"]


def test_a_reload_that_changes_replica_targets_is_followed_by_the_next_round() -> None:
    """min 1 → min 2 adds a replica; max 1 afterwards removes one."""
    clock = FakeClock()
    workers = [ModelWorker(clock, ("m",)), ModelWorker(clock), ModelWorker(clock)]
    with fleet(clock, *workers, hold=0, catalog={"m": ModelPolicy(1, None)}) as pool:
        pool.check_placement()
        assert sum("m" in w.models for w in workers) == 1
        cfg = pool.config
        more = dataclasses.replace(cfg.models, catalog={"m": ModelPolicy(2, None)})
        pool.reload(dataclasses.replace(cfg, models=more))
        pool.check_placement()
        assert sum("m" in w.models for w in workers) == 2
        fewer = dataclasses.replace(cfg.models, catalog={"m": ModelPolicy(1, 1)})
        pool.reload(dataclasses.replace(cfg, models=fewer))
        clock.advance(1)
        pool.check_placement()
        assert sum("m" in w.models for w in workers) == 1


def test_load_on_a_model_outgrowing_its_replicas_adds_one() -> None:
    """Tasks in flight reaching scale_up of the replicas' capacity add a replica at
    the next round, on a worker that did not hold it."""
    clock = FakeClock()
    workers = [ModelWorker(clock, ("m",)), ModelWorker(clock)]
    with fleet(clock, *workers, hold=0, scale_up=0.5) as pool:
        placer = pool._placer
        assert placer is not None
        capacity = pool._state.workers["w0"].capacity
        for _ in range(capacity // 2 + 1):
            placer.started("w0", "m", clock.monotonic())
        (load,) = pool.check_placement()
        assert isinstance(load, Load) and load.worker_id == "w1" and "m" in workers[1].models


def test_tasks_queueing_for_a_models_workers_add_a_replica() -> None:
    """w0 holds m and x and takes one task at a time; x's task fills it and m's task
    waits for a worker: the next round adds a replica of m on w1, though no task of
    m's was ever in flight."""
    clock = FakeClock()
    w0 = ModelWorker(clock, ("m", "x"))
    w1 = ModelWorker(clock)
    net = FakeNetwork()
    net.route("w0", w0)
    net.route("w1", w1)
    cfg = dataclasses.replace(
        config(2, hold=0, catalog={"x": ModelPolicy(0, 1)}),
        workers=(
            worker_config("w0", "http://127.0.0.1:9500", max_concurrent=1),
            worker_config("w1", "http://127.0.0.1:9501", max_concurrent=1),
        ),
    )
    with WorkerPool(cfg, transport_factory=net.factory, clock=clock) as pool:
        pool.check_health()
        assert pool.check_placement() == []
        w0.hold.clear()
        held = pool.submit({"model_id": "x", "hold": True})
        assert w0.entered.wait(10)
        queued = pool.submit({"model_id": "m"})
        dispatcher = pool._state.dispatcher
        for _ in range(5000):  # until m's task waits in the queue
            if dispatcher.waiting:
                break
            threading.Event().wait(0.001)
        assert dispatcher.waiting == 1
        clock.advance(5)
        (load,) = pool.check_placement()
        assert isinstance(load, Load) and (load.worker_id, load.model) == ("w1", "m")
        assert "waiting for a worker" in load.reason and "m" in w1.models
        w0.hold.set()
        assert held.result(10)["model_id"] == "x" and queued.result(10)["model_id"] == "m"


def test_a_models_latency_rising_above_its_normal_adds_a_replica() -> None:
    """m's tasks take 100 ms for a round (its normal), then 300 ms: the next round adds
    a replica though its tasks in flight never came near its capacity."""
    clock = FakeClock()
    w0 = ModelWorker(clock, ("m",))
    w1 = ModelWorker(clock)
    with fleet(clock, w0, w1, hold=0) as pool:
        assert pool.check_placement() == []
        w0.latency = 0.100
        for _ in range(5):
            pool.execute({"model_id": "m"})
        clock.advance(10)
        assert pool.check_placement() == []  # 100 ms is its normal
        w0.latency = 0.300
        for _ in range(5):
            pool.execute({"model_id": "m"})
        clock.advance(10)
        (load,) = pool.check_placement()
        assert isinstance(load, Load) and (load.worker_id, load.model) == ("w1", "m")
        assert "latency 300 ms against a normal 100 ms" in load.reason


def test_placement_off_means_no_thread_and_a_clear_error() -> None:
    """Without models.balance no placement thread runs and check_placement says why."""
    clock = FakeClock()
    with fleet(clock, ModelWorker(clock), balance=False) as pool:
        assert not any(t.name == "npu-sync-placement" for t in threading.enumerate())
        with pytest.raises(RuntimeError, match=r"models\.balance"):
            pool.check_placement()


# -- real reference workers --------------------------------------------------------


def test_real_workers_full_worker_evicts_and_a_slow_load_ends_by_the_deadline() -> None:
    """A reference worker capped at 2 models: a third model evicts the one never used;
    once its loads take a minute, a task needing a load ends by its deadline."""
    with LocalWorker(worker_id="a", models=("m1", "m2"), max_models=2).start() as a:
        cfg = PoolConfig(
            workers=(worker_config("a", a.url),),
            health=HealthConfig(interval=3600),
            models=ModelsConfig(placement=True, balance=True, interval=3600, hold=0),
        )
        with WorkerPool(cfg) as pool:
            pool.check_health()
            pool.execute({"model_id": "m1", "input_text": "x"})
            assert pool.execute({"model_id": "m3", "input_text": "x"})["model_id"] == "m3"
            assert sorted(a.control()["models"]) == ["m1", "m3"]  # m2, never used, went
            a.control(load_delay_ms=60_000)
            start = time.monotonic()
            with pytest.raises(TaskRejected, match="loading it on a failed"):
                pool.execute(Task({"model_id": "m9", "input_text": "x"}, timeout=1.0))
            assert time.monotonic() - start < 15  # the deadline, not the load, ends it


def test_placement_is_counted_by_prometheus() -> None:
    """Loads, evictions and load time reach the Prometheus series."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry

    from npu_sync.prometheus import instrument

    clock = FakeClock()
    worker = ModelWorker(clock, ("old",), cap=1, load_seconds=3.0)
    registry = CollectorRegistry()
    with fleet(clock, worker, hold=0) as pool, instrument(pool, registry):
        pool.check_placement()
        clock.advance(5)
        assert pool.execute({"model_id": "new"})["model_id"] == "new"

        def sample(name: str, **labels: str) -> float | None:
            return registry.get_sample_value(name, {**labels})

        assert sample("npu_sync_model_placements_total", action="load") == 1
        assert sample("npu_sync_model_placements_total", action="evict") == 1
        assert sample("npu_sync_model_placements_total", action="failed") == 1  # the 507
        assert sample("npu_sync_model_load_seconds_total") == pytest.approx(3.0)


def test_status_shows_each_model_its_replicas_and_targets(tmp_path, capsys) -> None:
    """'npu-sync status' lists per model its holders and catalog targets, and says when
    a model is below its min."""
    from npu_sync.cli import main

    with (
        LocalWorker(worker_id="a", models=("llama", "e5")).start() as a,
        LocalWorker(worker_id="b", models=("e5",)).start() as b,
    ):
        path = tmp_path / "pool.yaml"
        path.write_text(
            "npu_workers:\n  workers:\n"
            f"    - {{id: a, url: '{a.url}'}}\n"
            f"    - {{id: b, url: '{b.url}'}}\n"
            "  models:\n    catalog:\n"
            "      llama: {replicas: {min: 2, max: 3}}\n"
            "      whisper: {replicas: {min: 1}}\n",
            encoding="utf-8",
        )
        assert main(["status", str(path)]) == 0
    out = capsys.readouterr().out.split("per model:", 1)[1]
    rows = {line.split()[0]: line.split() for line in out.strip().splitlines()[1:]}
    assert rows["e5"][:4] == ["e5", "2", "0", "-"] and "a," in rows["e5"] and "b" in rows["e5"]
    assert rows["llama"][:4] == ["llama", "1", "2", "3"] and "min" in " ".join(rows["llama"])
    assert rows["whisper"][:7] == ["whisper", "0", "1", "-", "-", "-", "none"]


def test_close_cuts_a_rounds_slow_load_short() -> None:
    """A round loading on a worker whose loads take a minute does not hold close():
    the request is cut, the thread ends, and nothing is left behind."""
    with LocalWorker(worker_id="slow", models=("x",), load_delay_ms=60_000).start() as slow:
        cfg = PoolConfig(
            workers=(worker_config("slow", slow.url),),
            health=HealthConfig(interval=3600),
            timeouts=TimeoutConfig(read=120.0, task=120.0),
            models=ModelsConfig(balance=True, interval=0.05, catalog={"m": ModelPolicy(1, None)}),
        )
        pool = WorkerPool(cfg)
        try:
            pool.check_health()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # until the round's load reached the worker
                if slow.stats()["requests"].get("/models/load"):
                    break
                time.sleep(0.01)
            else:
                pytest.fail("no load was asked for")
        finally:
            start = time.monotonic()
            pool.close()
        assert time.monotonic() - start < 20  # not the minute the load would take
        assert not any(t.name == "npu-sync-placement" for t in threading.enumerate())


def test_a_task_waiting_behind_another_models_slow_load_ends_by_its_deadline() -> None:
    """A round is loading one model on a worker whose loads take a minute; a task for
    another model nobody holds needs the same placer. It waits for it only within its
    own deadline, then ends (rejected: the model could not be placed), not a minute
    later."""
    with LocalWorker(worker_id="slow", models=("x",), load_delay_ms=60_000).start() as slow:
        cfg = PoolConfig(
            workers=(worker_config("slow", slow.url),),
            health=HealthConfig(interval=3600),
            timeouts=TimeoutConfig(read=120.0, task=120.0),
            models=ModelsConfig(
                placement=True, balance=True, interval=0.05, catalog={"m": ModelPolicy(1, None)}
            ),
        )
        pool = WorkerPool(cfg)
        try:
            pool.check_health()
            deadline = time.monotonic() + 30
            while not slow.stats()["requests"].get("/models/load"):  # the round's load
                assert time.monotonic() < deadline, "no load was asked for"
                time.sleep(0.01)
            start = time.monotonic()
            with pytest.raises(TaskRejected, match="another model was being loaded"):
                pool.execute(Task({"model_id": "z", "input_text": "hi"}, timeout=1.0))
            assert time.monotonic() - start < 20  # its deadline, not the minute-long load
        finally:
            pool.close()


def test_a_round_learns_a_workers_cap_from_its_507_and_evicts() -> None:
    """No cap configured: the round's load is answered 507, the cap is learnt from it,
    and the same round evicts the idle model and loads the one below its min."""
    clock = FakeClock()
    worker = ModelWorker(clock, ("old",), cap=1)
    events: list[Event] = []
    with fleet(clock, worker, events=events, hold=0, catalog={"new": ModelPolicy(1, None)}) as pool:
        pool.check_placement()
        assert worker.models == ["new"] and worker.unloads == ["old"]
        assert placements(events, "failed") == [("w0", "new")]  # the 507
        assert placements(events, "evict") == [("w0", "old")]
        assert placements(events, "load") == [("w0", "new")]


# -- the cap a worker reports --------------------------------------------------------


def test_a_cap_the_worker_reports_is_filled_to_and_evicts_without_a_507() -> None:
    """No cap configured; the worker's list says max_models 1: a task for a second model
    evicts the first at once, no load is answered 507, nothing is reported failed."""
    clock = FakeClock()
    worker = ModelWorker(clock, ("old",), cap=1, reports=1)
    events: list[Event] = []
    with fleet(clock, worker, events=events, hold=0) as pool:
        assert pool.execute({"model_id": "new"})["model_id"] == "new"
        assert worker.full == 0 and worker.unloads == ["old"] and worker.models == ["new"]
        assert placements(events, "failed") == []
        assert placements(events, "evict") == [("w0", "old")]


@pytest.mark.parametrize(
    ("own", "default", "evicted"),
    [
        (2, None, []),  # the worker's own max_models in the file wins over its answer
        (None, 2, ["old"]),  # the answer wins over the pool-wide default
        (None, None, ["old"]),  # the answer alone
    ],
)
def test_which_cap_counts_the_files_own_then_the_workers_then_the_default(
    own: int | None, default: int | None, evicted: list[str]
) -> None:
    """A worker reporting max_models 1 while it could hold more: a max_models of its own
    in the file is its cap (nothing evicted); models.max_models is not, the answer is."""
    clock = FakeClock()
    worker = ModelWorker(clock, ("old",), reports=1)
    net = FakeNetwork()
    net.route("w0", worker)
    cfg = config(1, hold=0, max_models=default)
    cfg = dataclasses.replace(cfg, workers=(dataclasses.replace(cfg.workers[0], max_models=own),))
    with WorkerPool(cfg, transport_factory=net.factory, clock=clock) as pool:
        pool.check_health()
        assert pool.execute({"model_id": "new"})["model_id"] == "new"
        assert worker.unloads == evicted
        assert sorted(worker.models) == sorted({"old", "new"} - set(evicted))


def test_a_list_without_a_cap_drops_the_one_reported_before() -> None:
    """The worker stops reporting max_models (restarted without it): the next list
    drops the cap, and a second model is loaded beside the first."""
    clock = FakeClock()
    worker = ModelWorker(clock, ("old",), reports=1)
    with fleet(clock, worker, hold=0) as pool:
        worker.reports = None
        pool.check_health()
        assert pool.execute({"model_id": "new"})["model_id"] == "new"
        assert worker.unloads == [] and sorted(worker.models) == ["new", "old"]


def test_real_worker_reporting_its_cap_is_evicted_from_not_answered_507() -> None:
    """A reference worker started with --max-models 1 says so in GET /models: a task for
    a second model evicts the first at once, and the worker never answers 507."""
    with LocalWorker(worker_id="a", models=("m1",), max_models=1).start() as a:
        cfg = PoolConfig(
            workers=(worker_config("a", a.url),),
            health=HealthConfig(interval=3600),
            models=ModelsConfig(placement=True, balance=True, interval=3600, hold=0),
        )
        with WorkerPool(cfg) as pool:
            pool.check_health()
            assert pool.execute({"model_id": "m2", "input_text": "x"})["model_id"] == "m2"
            stats = a.stats()
        assert stats["models"] == ["m2"]
        assert "507" not in stats["responses"]
