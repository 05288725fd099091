"""The per-model view of stats(): who holds each model, its load (the workers' own
inference counts and their rate; tasks in flight with placement rounds), its replicas
against its targets — with or without models.balance."""

from __future__ import annotations

import threading

from npu_sync import WorkerPool
from npu_sync._stats_types import ModelViewDict
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    ModelPolicy,
    ModelsConfig,
    PoolConfig,
    RetryConfig,
    worker_config,
)
from npu_sync.testing import FakeClock, FakeNetwork, FakeRequest, json_response
from npu_sync.transport import Response


class Holder:
    """A fake Linux worker listing its models with their inference counts; a task may be
    held open; its health may fail."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts
        self.healthy = True
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()

    def __call__(self, req: FakeRequest) -> Response:
        if req.path == "/health":
            return json_response(200 if self.healthy else 503, {"status": "healthy"})
        if req.path == "/models":
            loaded = {m: {"device": "NPU", "inference_count": n} for m, n in self.counts.items()}
            return json_response(200, {"loaded_models": loaded})
        model = req.json()["model_id"]
        if req.json().get("hold"):
            self.entered.set()
            self.hold.wait(10)
        return json_response(200, {"model_id": model})


def make_pool(clock: FakeClock, *workers: Holder, **models: object) -> WorkerPool:
    net = FakeNetwork()
    for i, worker in enumerate(workers):
        net.route(f"w{i}", worker)
    models.setdefault("interval", 3600)  # any round is run by the test
    cfg = PoolConfig(
        workers=tuple(
            worker_config(f"w{i}", f"http://127.0.0.1:{9600 + i}") for i in range(len(workers))
        ),
        health=HealthConfig(enabled=False, unhealthy_threshold=1),
        retry=RetryConfig(max_retries=0),
        circuit_breaker=BreakerConfig(fail_max=5),
        models=ModelsConfig(**models),  # type: ignore[arg-type]
    )
    return WorkerPool(cfg, transport_factory=net.factory, clock=clock)


def by_model(pool: WorkerPool) -> dict[str, ModelViewDict]:
    return {row["model"]: row for row in pool.stats()["models"]["per_model"]}


def test_rows_without_placement_rounds_show_holders_load_and_targets() -> None:
    """models.balance off: each model held or in the catalog has a row with its holders,
    live replicas, catalog targets, the holders' inference counts summed and their rate
    over the last two lists; tasks in flight are not counted (None)."""
    clock = FakeClock()
    w0, w1 = Holder({"llama": 10}), Holder({"llama": 4, "e5": 0})
    catalog = {"llama": ModelPolicy(1, 3), "whisper": ModelPolicy(1, None)}
    with make_pool(clock, w0, w1, catalog=catalog) as pool:
        pool.check_health()
        rows = by_model(pool)
        assert pool.stats()["models"]["balance"] is False
        assert sorted(rows) == ["e5", "llama", "whisper"]
        assert rows["llama"] == {
            "model": "llama",
            "workers": ["w0", "w1"],
            "replicas": 2,
            "min": 1,
            "max": 3,
            "in_flight": None,
            "inferences": 14,
            "rate": None,  # one list so far: no rate yet
            "load_seconds": None,
        }
        w0.counts["llama"], w1.counts["llama"], w1.counts["e5"] = 30, 14, 5
        clock.advance(10)
        pool.check_health()
        rows = by_model(pool)
        assert (rows["llama"]["inferences"], rows["llama"]["rate"]) == (44, 3.0)
        assert (rows["e5"]["workers"], rows["e5"]["inferences"], rows["e5"]["rate"]) == (
            ["w1"],
            5,
            0.5,
        )
        assert rows["whisper"]["workers"] == [] and rows["whisper"]["replicas"] == 0
        assert rows["whisper"]["inferences"] is None and rows["whisper"]["rate"] is None


def test_a_holder_that_went_down_stays_listed_but_is_no_replica() -> None:
    """A holder whose health check fails is still named (its last list stands) but not
    counted as a replica, and its stale rate is left out of the model's."""
    clock = FakeClock()
    w0, w1 = Holder({"m": 0}), Holder({"m": 0})
    with make_pool(clock, w0, w1) as pool:
        pool.check_health()
        w0.counts["m"], w1.counts["m"] = 20, 40
        clock.advance(10)
        pool.check_health()
        assert by_model(pool)["m"]["rate"] == 6.0
        w1.healthy = False
        pool.check_health()
        row = by_model(pool)["m"]
        assert (row["workers"], row["replicas"], row["rate"]) == (["w0", "w1"], 1, 2.0)


def test_with_placement_rounds_a_task_in_flight_is_counted_for_its_model() -> None:
    """models.balance on: a task held open on a worker counts 1 in flight for its model
    (0 for the others), and 0 once it has ended."""
    clock = FakeClock()
    worker = Holder({"a": 0, "b": 0})
    with make_pool(clock, worker, balance=True) as pool:
        pool.check_health()
        rows = by_model(pool)
        assert (rows["a"]["in_flight"], rows["b"]["in_flight"]) == (0, 0)
        worker.hold.clear()
        held = pool.submit({"model_id": "a", "hold": True})
        try:
            assert worker.entered.wait(10)
            rows = by_model(pool)
            assert (rows["a"]["in_flight"], rows["b"]["in_flight"]) == (1, 0)
        finally:
            worker.hold.set()
        assert held.result(10) == {"model_id": "a"}
        assert by_model(pool)["a"]["in_flight"] == 0
