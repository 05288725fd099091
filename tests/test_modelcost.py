"""Per-(worker, model) latency: each model's tasks go to the worker fastest for it."""

from __future__ import annotations

import pytest

from npu_sync import ConfigError, InvalidTask, Task, WorkerPool
from npu_sync._modelcost import ModelCosts
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    ModelsConfig,
    PoolConfig,
    RetryConfig,
    worker_config,
)
from npu_sync.testing import FakeClock, FakeNetwork, FakeRequest, json_response
from npu_sync.transport import Response
from npu_sync.worker_server import LocalWorker


class _W:
    """Just what ModelCosts.best reads of a worker."""

    def __init__(self, wid: str, priority: int = 1, in_flight: int = 0, capacity: int = 8):
        self.id = wid
        self.priority = priority
        self.in_flight = in_flight
        self.capacity = capacity


def test_estimates_are_kept_per_worker_and_model() -> None:
    """The same worker has one estimate per model; an unseen pair has none."""
    costs = ModelCosts(decay=10.0)
    costs.observe("a", "small", 0.01, now=1.0)
    costs.observe("a", "big", 0.5, now=1.0)
    assert costs.estimate("a", "small", 1.0) == pytest.approx(0.01)
    assert costs.estimate("a", "big", 1.0) == pytest.approx(0.5)
    assert costs.estimate("b", "small", 1.0) is None
    assert costs.estimate("a", "other", 1.0) is None


def test_best_picks_each_models_fastest_worker() -> None:
    """a is fast for small and slow for big, b the reverse: each model gets its own."""
    costs = ModelCosts()
    a, b = _W("a"), _W("b")
    for now in (1.0, 2.0, 3.0):
        costs.observe("a", "small", 0.01, now)
        costs.observe("b", "small", 0.2, now)
        costs.observe("a", "big", 0.4, now)
        costs.observe("b", "big", 0.05, now)
    assert costs.best([a, b], "small", 3.0) is a
    assert costs.best([a, b], "big", 3.0) is b


def test_best_declines_while_a_candidate_is_unknown_or_only_one_is_known() -> None:
    """A worker never seen with the model is left to the usual choice (which tries it)."""
    costs = ModelCosts()
    costs.observe("a", "m", 0.01, 1.0)
    assert costs.best([_W("a"), _W("b")], "m", 1.0) is None
    assert costs.best([_W("a")], "m", 1.0) is None
    costs.observe("b", "m", 0.02, 1.0)
    assert costs.best([_W("a"), _W("b")], "m", 1.0).id == "a"  # type: ignore[union-attr]


def test_best_ranks_only_the_preferred_tier_and_weighs_load() -> None:
    """A faster worker in a lower tier loses; a loaded fast worker loses to an idle one."""
    costs = ModelCosts()
    for wid, rtt in (("a", 0.10), ("b", 0.12), ("c", 0.001)):
        costs.observe(wid, "m", rtt, 1.0)
    a, b, c = _W("a"), _W("b"), _W("c", priority=2)
    assert costs.best([a, b, c], "m", 1.0) is a
    busy_a = _W("a", in_flight=7, capacity=8)
    assert costs.best([busy_a, b, c], "m", 1.0) is b


def test_size_makes_the_estimate_per_unit() -> None:
    """a got large tasks (1 s for 1000 units), b small ones (50 ms for 10 units): per
    unit a is five times faster, and a sized task goes there."""
    costs = ModelCosts()
    for now in (1.0, 2.0):
        costs.observe("a", "m", 1.0, now, size=1000)
        costs.observe("b", "m", 0.05, now, size=10)
    assert costs.estimate("a", "m", 2.0, size=500) == pytest.approx(0.5)
    assert costs.best([_W("a"), _W("b")], "m", 2.0, size=100) is not None
    assert costs.best([_W("a"), _W("b")], "m", 2.0, size=100).id == "a"  # type: ignore[union-attr]
    assert costs.best([_W("a"), _W("b")], "m", 2.0) is None  # no unsized answers yet


def test_models_per_worker_are_bounded_least_recent_first() -> None:
    """With room for 2 models, a third forgets the least recently answered one."""
    costs = ModelCosts(max_models=2)
    costs.observe("a", "m1", 0.1, 1.0)
    costs.observe("a", "m2", 0.1, 2.0)
    costs.observe("a", "m1", 0.1, 3.0)  # m1 used again: m2 is the older
    costs.observe("a", "m3", 0.1, 4.0)
    assert costs.estimate("a", "m2", 4.0) is None
    assert costs.estimate("a", "m1", 4.0) is not None
    assert costs.estimate("a", "m3", 4.0) is not None
    costs.forget(keep=["b"])
    assert costs.stats(4.0) == {}


def test_bad_sizes_and_settings_are_refused() -> None:
    """A task size must be a positive finite number; latency_models at least 1."""
    for bad in (0, -1, float("nan"), float("inf"), "10", True):
        with pytest.raises(InvalidTask, match="task size must be a positive number"):
            Task({}, size=bad)  # type: ignore[arg-type]
    assert Task({}, size=12).size == 12
    with pytest.raises(ConfigError, match=r"models\.latency_models"):
        ModelsConfig(latency_models=0)


def _pool(clock: FakeClock, model_latency: bool = True) -> tuple[FakeNetwork, WorkerPool]:
    # a: small 10 ms, big 400 ms; b: small 200 ms, big 50 ms (on the fake clock).
    speeds = {"a": {"small": 0.01, "big": 0.4}, "b": {"small": 0.2, "big": 0.05}}

    def handler(wid: str):
        def handle(req: FakeRequest) -> Response:
            if req.path.endswith("/health"):
                return json_response(200, {"status": "healthy"})
            model = req.json()["model_id"]
            clock.advance(speeds[wid][model])
            return json_response(200, {"worker": wid})

        return handle

    net = FakeNetwork()
    net.route("a", handler("a"))
    net.route("b", handler("b"))
    cfg = PoolConfig(
        workers=(
            worker_config("a", "http://127.0.0.1:9401"),
            worker_config("b", "http://127.0.0.1:9402"),
        ),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=1, backoff_initial=0.0, backoff_max=0.0),
        circuit_breaker=BreakerConfig(fail_max=5),
        models=ModelsConfig(model_latency=model_latency),
    )
    return net, WorkerPool(cfg, transport_factory=net.factory, clock=clock)


def test_a_worker_fast_for_one_model_and_slow_for_another_gets_each_by_its_speed() -> None:
    """Once both workers have answered both models, small tasks go to a and big ones
    to b; with per-model latency off the same run mixes them."""

    def run(model_latency: bool) -> dict[tuple[str, str], int]:
        clock = FakeClock()
        _, pool = _pool(clock, model_latency)
        with pool:
            for _ in range(40):  # learn: the usual choice spreads them
                for model in ("small", "big"):
                    pool.execute({"model_id": model})
            counts: dict[tuple[str, str], int] = {}
            for _ in range(30):
                for model in ("small", "big"):
                    wid = pool.execute({"model_id": model})["worker"]
                    counts[model, wid] = counts.get((model, wid), 0) + 1
        return counts

    on = run(True)
    assert on.get(("small", "a"), 0) >= 27 and on.get(("big", "b"), 0) >= 27
    off = run(False)
    assert off.get(("small", "a"), 0) + off.get(("big", "b"), 0) < 54


def test_a_worker_that_served_the_large_tasks_is_not_taken_for_the_slow_one() -> None:
    """a takes 1 ms per unit, b 3 ms; a learnt on tasks of 100 units, b on tasks of 10,
    so per task a looks the slower (100 ms against 30). Every sized task that follows
    goes to a, the fastest per unit, from the first one on; a pool that ignored the
    size would send the first to b."""
    clock = FakeClock()
    per_unit = {"a": 0.001, "b": 0.003}

    def handler(wid: str):
        def handle(req: FakeRequest) -> Response:
            if req.path.endswith("/health"):
                return json_response(200, {"status": "healthy"})
            clock.advance(per_unit[wid] * req.json()["units"])
            return json_response(200, {"worker": wid})

        return handle

    net = FakeNetwork()
    net.route("a", handler("a"))
    net.route("b", handler("b"))
    cfg = PoolConfig(
        workers=(
            worker_config("a", "http://127.0.0.1:9401", tags={"name": "a"}),
            worker_config("b", "http://127.0.0.1:9402", tags={"name": "b"}),
        ),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=1, backoff_initial=0.0, backoff_max=0.0),
        circuit_breaker=BreakerConfig(fail_max=5),
    )

    def run(units: int, requires: frozenset[str] = frozenset()) -> str:
        task = Task({"model_id": "m", "units": units}, size=units, requires=requires)
        return str(pool.execute(task)["worker"])

    with WorkerPool(cfg, transport_factory=net.factory, clock=clock) as pool:
        for _ in range(10):  # a: 100 units in 100 ms; b: 10 units in 30 ms
            assert run(100, frozenset({"name=a"})) == "a"
            assert run(10, frozenset({"name=b"})) == "b"
        chosen = [run(50) for _ in range(10)]
        costs = pool._state.model_costs
        assert costs is not None
        now = clock.monotonic()
        per_unit_seen = {w: costs.estimate(w, "m", now, size=1) for w in ("a", "b")}
    assert chosen == ["a"] * 10
    assert per_unit_seen["a"] == pytest.approx(0.001, rel=0.1)
    assert per_unit_seen["b"] == pytest.approx(0.003, rel=0.2)  # decayed a little since


def test_real_workers_each_model_goes_to_the_worker_fast_for_it() -> None:
    """Two reference workers holding both models: "one" fast for A (1 ms) and slow for
    B (100 ms), "two" the other way round. Once each has answered both, A's tasks go
    to "one" and B's to "two"; each worker's own estimate, mixing both models, could
    not tell them apart."""
    with (
        LocalWorker(worker_id="one", models=("A", "B")).start() as one,
        LocalWorker(worker_id="two", models=("A", "B")).start() as two,
    ):
        one.control(model_latency_ms={"A": 1, "B": 100})
        two.control(model_latency_ms={"A": 100, "B": 1})
        cfg = PoolConfig(
            workers=(worker_config("one", one.url), worker_config("two", two.url)),
            health=HealthConfig(enabled=False),
        )
        served: list[tuple[str, str]] = []
        with WorkerPool(cfg) as pool:
            for _ in range(30):
                for model in ("A", "B"):
                    answer = pool.execute({"model_id": model, "input_text": "x"})
                    served.append((model, answer["worker_id"]))
    last = served[20:]  # 20 rounds after the first ten, in which both were learnt
    assert sum(1 for pair in last if pair == ("A", "one")) >= 18, served
    assert sum(1 for pair in last if pair == ("B", "two")) >= 18, served


def test_only_an_uneven_model_makes_tasks_look_for_the_fastest() -> None:
    """Workers alike for a model (or within a millisecond) leave it to the usual choice;
    one three times slower makes the model uneven."""
    costs = ModelCosts()
    costs.observe("a", "even", 0.100, 1.0)
    costs.observe("b", "even", 0.110, 1.0)
    costs.observe("a", "tiny", 0.00002, 1.0)
    costs.observe("b", "tiny", 0.00009, 1.0)  # 4.5x, but 70 µs apart: noise
    assert not costs.uneven("even") and not costs.uneven("tiny") and not costs.active
    costs.observe("a", "skewed", 0.01, 1.0)
    costs.observe("b", "skewed", 0.03, 2.5)  # judged again a second after the first
    assert costs.uneven("skewed") and costs.active
