"""Choosing a limit: ``balancing.concurrency_limit`` and its older spelling
``adaptive_concurrency``, read from YAML, refused when they contradict each other, and
applied to a running pool's workers on a reload."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import yaml

from npu_sync import ConfigError, WorkerPool
from npu_sync._balancing.limits import (
    AimdLimit,
    FixedLimit,
    Gradient2Limit,
    HillClimbingLimit,
    limit_of,
    new_limit,
)
from npu_sync.config import (
    CONCURRENCY_LIMITS,
    BalancingConfig,
    HealthConfig,
    PoolConfig,
    parse_config,
    worker_config,
)
from npu_sync.events import WorkerLimitChanged
from npu_sync.testing import FakeClock, FakeNetwork, json_response

OK = {"model_id": "default", "input_text": "hi"}


def balancing(text: str) -> BalancingConfig:
    data = yaml.safe_load(f"npu_workers:\n  balancing:\n{text}")
    return parse_config(data).balancing


@pytest.mark.parametrize(
    ("text", "chosen"),
    [
        ("    strategy: least-loaded\n", "fixed"),
        ("    concurrency_limit: fixed\n", "fixed"),
        ("    concurrency_limit: hill-climbing\n", "hill-climbing"),
        ("    concurrency_limit: aimd\n", "aimd"),
        ("    concurrency_limit: gradient2\n", "gradient2"),
        ("    adaptive_concurrency: true\n", "hill-climbing"),
        ("    adaptive_concurrency: false\n", "fixed"),
        ("    adaptive_concurrency: true\n    concurrency_limit: hill-climbing\n", "hill-climbing"),
        ("    adaptive_concurrency: false\n    concurrency_limit: fixed\n", "fixed"),
        ("    adaptive_concurrency: false\n    concurrency_limit: aimd\n", "aimd"),
    ],
)
def test_each_spelling_chooses_its_limit(text, chosen):
    """The YAML spellings of each limit, and the older adaptive_concurrency one; built,
    adaptive_concurrency says whether the hill climbing is chosen."""
    cfg = balancing(text)
    assert cfg.concurrency_limit == chosen
    assert cfg.adaptive_concurrency is (chosen == "hill-climbing")


@pytest.mark.parametrize(
    ("adaptive", "limit"),
    [("true", "fixed"), ("true", "aimd"), ("true", "gradient2"), ("false", "hill-climbing")],
)
def test_a_file_giving_both_keys_inconsistently_is_refused_naming_both(adaptive, limit):
    """adaptive_concurrency: true means hill-climbing: a file saying otherwise is
    refused with both keys and both values in the message."""
    text = f"    adaptive_concurrency: {adaptive}\n    concurrency_limit: {limit}\n"
    with pytest.raises(ConfigError) as caught:
        balancing(text)
    message = str(caught.value)
    assert f"npu_workers.balancing.adaptive_concurrency: {adaptive}" in message
    assert f"balancing.concurrency_limit: {limit}" in message


def test_an_unknown_limit_is_refused_naming_the_choices():
    """A misspelt limit names the key, the value and every choice."""
    with pytest.raises(ConfigError) as caught:
        balancing("    concurrency_limit: hillclimbing\n")
    message = str(caught.value)
    assert "npu_workers.balancing.concurrency_limit" in message and "'hillclimbing'" in message
    assert all(name in message for name in CONCURRENCY_LIMITS)


def test_configs_built_in_code_agree_with_the_file_and_survive_replace():
    """BalancingConfig(adaptive_concurrency=True) is the hill climbing, equal to the file's
    spelling; replace() of another field keeps the choice, and a contradiction built in
    code is refused as in a file."""
    assert BalancingConfig(adaptive_concurrency=True) == balancing(
        "    concurrency_limit: hill-climbing\n"
    )
    for name in CONCURRENCY_LIMITS:
        cfg = BalancingConfig(concurrency_limit=name)
        assert dataclasses.replace(cfg, strategy="weighted").concurrency_limit == name
    with pytest.raises(ConfigError, match="adaptive_concurrency: true contradicts"):
        BalancingConfig(adaptive_concurrency=True, concurrency_limit="aimd")
    with pytest.raises(ConfigError, match="concurrency_limit: must be one of"):
        BalancingConfig(concurrency_limit="vegas")
    # Built, the hill climbing says adaptive_concurrency: true: replacing only the limit
    # contradicts it loudly rather than keeping the hill climbing silently.
    with pytest.raises(ConfigError, match=r"contradicts balancing\.concurrency_limit: aimd"):
        dataclasses.replace(BalancingConfig(adaptive_concurrency=True), concurrency_limit="aimd")


def test_new_limit_builds_the_class_each_name_names():
    """fixed gives no limit object (a worker's max_concurrent is the same capacity);
    each other name its class, at max_concurrent's ceiling, on the clock given."""
    assert new_limit("fixed", 8, lambda: 0.0) is None
    classes = {"hill-climbing": HillClimbingLimit, "aimd": AimdLimit, "gradient2": Gradient2Limit}
    for name, cls in classes.items():
        limit = new_limit(name, 8, lambda: 0.0)
        assert isinstance(limit, cls) and limit.ceiling == 8
        assert limit.stats()["algorithm"] == name
        assert limit_of(limit, name) is limit
        assert all(limit_of(limit, other) is None for other in CONCURRENCY_LIMITS if other != name)
    assert limit_of(FixedLimit(4), "fixed") is not None
    with pytest.raises(ValueError, match="got 'vegas'"):
        new_limit("vegas", 8, lambda: 0.0)


def config(limit: str, **worker: Any) -> PoolConfig:
    cfg = worker_config("a", "http://127.0.0.1:9200", **worker)
    return PoolConfig(
        workers=(cfg,),
        balancing=BalancingConfig(concurrency_limit=limit),
        health=HealthConfig(enabled=False),
    )


def algorithm(pool: WorkerPool) -> str | None:
    limit = pool._state.workers["a"].limit
    return None if limit is None else str(limit.stats()["algorithm"])


def capacity(pool: WorkerPool) -> int:
    (row,) = pool.workers()
    return int(row["capacity"])


def test_a_reload_swaps_the_limit_of_running_workers():
    """fixed -> aimd -> gradient2 -> hill-climbing -> fixed by reloads: each worker gets
    the limit chosen, starting at 4 (the ceiling when fixed); a reload that changes only
    max_concurrent keeps the limit and lowers its ceiling."""
    clock, net = FakeClock(), FakeNetwork()
    net.route("a", lambda req: json_response(200, {"worker_id": "a"}))
    with WorkerPool(config("fixed"), transport_factory=net.factory, clock=clock) as pool:
        assert algorithm(pool) is None and capacity(pool) == 32
        for name in ("aimd", "gradient2", "hill-climbing"):
            pool.reload(config(name))
            assert algorithm(pool) == name and capacity(pool) == 4
            pool.execute(OK)
        kept = pool._state.workers["a"].limit
        pool.reload(config("hill-climbing", max_concurrent=2))
        assert pool._state.workers["a"].limit is kept and capacity(pool) == 2
        pool.reload(config("fixed", max_concurrent=2))
        assert algorithm(pool) is None and capacity(pool) == 2


@pytest.mark.parametrize("name", ["aimd", "gradient2"])
def test_a_learned_limit_cuts_on_an_overload_answer(name):
    """Under aimd or gradient2 a 503 cuts the worker's capacity from 4 to 3 at once, as
    under the hill climbing; the task goes to the other worker."""
    clock, net = FakeClock(), FakeNetwork()
    net.route("a", lambda req: json_response(503, {"detail": "overloaded"}))
    net.route("b", lambda req: json_response(200, {"worker_id": "b"}))
    workers = (
        worker_config("a", "http://127.0.0.1:9200", priority=1),
        worker_config("b", "http://127.0.0.1:9201", priority=2),
    )
    cfg = PoolConfig(
        workers=workers,
        balancing=BalancingConfig(concurrency_limit=name),
        health=HealthConfig(enabled=False),
    )
    with WorkerPool(cfg, transport_factory=net.factory, clock=clock) as pool:
        assert {row["id"]: row["capacity"] for row in pool.workers()} == {"a": 4, "b": 4}
        assert pool.execute(OK)["worker_id"] == "b"
        assert {row["id"]: row["capacity"] for row in pool.workers()} == {"a": 3, "b": 4}


def write(path: Any, limit_lines: str) -> None:
    path.write_text(
        "npu_workers:\n"
        "  workers:\n"
        "    - {id: a, url: 'http://127.0.0.1:9200'}\n"
        "  health: {enabled: false}\n"
        f"  balancing:\n{limit_lines}"
    )


def test_the_file_s_choice_is_hot_and_a_contradiction_keeps_the_running_limit(tmp_path):
    """Re-reading the file applies a new concurrency_limit to the running pool (a hot
    setting, reported as changed); a file contradicting itself is refused and the
    running limit is kept."""
    path = tmp_path / "pool.yaml"
    write(path, "    adaptive_concurrency: true\n")
    net = FakeNetwork()
    with WorkerPool.from_yaml(path, watch=False, transport_factory=net.factory) as pool:
        assert algorithm(pool) == "hill-climbing"
        write(path, "    concurrency_limit: aimd\n")
        result = pool.reload()
        assert result.settings_changed and result.restart_required == ()
        assert algorithm(pool) == "aimd" and pool.config.balancing.concurrency_limit == "aimd"
        shown = pool.stats()["balancing"]
        assert shown["concurrency_limit"] == "aimd" and shown["adaptive_concurrency"] is False
        write(path, "    adaptive_concurrency: true\n    concurrency_limit: gradient2\n")
        with pytest.raises(ConfigError, match="concurrency_limit: gradient2"):
            pool.reload()
        assert algorithm(pool) == "aimd"


def test_a_hook_that_turns_the_limit_off_from_its_event_does_not_deadlock():
    """A hook that answers the first worker.limit_changed (an AIMD cut) by reloading the
    pool to fixed runs outside the pool's lock: the reload applies, the task that caused
    the cut still ends with the backup's result, and the worker is back at its
    max_concurrent."""
    clock, net = FakeClock(), FakeNetwork()
    net.route("a", lambda req: json_response(503, {"detail": "overloaded"}))
    net.route("b", lambda req: json_response(200, {"worker_id": "b"}))
    workers = (
        worker_config("a", "http://127.0.0.1:9200", priority=1),
        worker_config("b", "http://127.0.0.1:9201", priority=2),
    )

    def build(name: str) -> PoolConfig:
        return PoolConfig(
            workers=workers,
            balancing=BalancingConfig(concurrency_limit=name),
            health=HealthConfig(enabled=False),
        )

    reloaded: list[bool] = []

    def hook(event: Any) -> None:
        if isinstance(event, WorkerLimitChanged) and not reloaded:
            reloaded.append(pool.reload(build("fixed")).settings_changed)

    pool = WorkerPool(build("aimd"), transport_factory=net.factory, clock=clock, hooks=[hook])
    with pool:
        assert pool.execute(OK)["worker_id"] == "b"
        assert reloaded == [True]
        assert algorithm(pool) is None
        assert {row["id"]: row["capacity"] for row in pool.workers()} == {"a": 32, "b": 32}


def _reloaded_config(strategy: str, limit: str, with_c: bool) -> PoolConfig:
    ids = ("a", "b", "c") if with_c else ("a", "b")
    workers = tuple(
        worker_config(wid, f"http://127.0.0.1:{9300 + i}", max_concurrent=4, weight=1 + i)
        for i, wid in enumerate(ids)
    )
    return PoolConfig(
        workers=workers,
        balancing=BalancingConfig(strategy=strategy, concurrency_limit=limit, slow_start=1.0),
        health=HealthConfig(enabled=False),
    )


def test_reloads_of_strategy_limit_and_workers_from_many_threads_keep_the_books():
    """16 callers run tasks while 3 threads reload the strategy, the limit and whether
    worker c exists, back and forth; some answers are 429/503 in bursts. Every call
    ends exactly once, and once all have ended: nothing is in flight, each worker's
    capacity is its limit's (kind as configured), and the selector keeps a slot for
    exactly the configured workers and none for c after it left."""
    import random
    import threading

    from npu_sync import NoWorkerAvailable, TaskFailed

    rng_lock = threading.Lock()
    rng = random.Random(7)

    def handler(req: Any) -> Any:
        with rng_lock:
            roll = rng.random()
        if roll < 0.1:
            return json_response(429, {"detail": "busy"})
        if roll < 0.15:
            return json_response(503, {"detail": "overloaded"})
        return json_response(200, {"worker_id": req.worker_id})

    net = FakeNetwork(handler)
    strategies = ("least-loaded", "round-robin", "weighted", "weighted-random", "priority")
    strategies += ("priority-failover",)
    first = _reloaded_config("least-loaded", "aimd", True)
    stop = threading.Event()
    ended: list[str] = []
    errors: list[BaseException] = []
    ended_lock = threading.Lock()
    with WorkerPool(first, transport_factory=net.factory) as pool:

        def caller() -> None:
            for _ in range(40):
                try:
                    pool.execute(OK, timeout=10.0)
                    outcome = "ok"
                except (TaskFailed, NoWorkerAvailable) as exc:
                    outcome = type(exc).__name__
                except BaseException as exc:
                    errors.append(exc)
                    outcome = "error"
                with ended_lock:
                    ended.append(outcome)

        def reloader(seed: int) -> None:
            local = random.Random(seed)
            while not stop.is_set():
                cfg = _reloaded_config(
                    local.choice(strategies),
                    local.choice(CONCURRENCY_LIMITS),
                    local.random() < 0.5,
                )
                try:
                    pool.reload(cfg)
                except BaseException as exc:
                    errors.append(exc)
                    return

        callers = [threading.Thread(target=caller) for _ in range(16)]
        reloaders = [threading.Thread(target=reloader, args=(s,)) for s in range(3)]
        for t in [*callers, *reloaders]:
            t.start()
        for t in callers:
            t.join(120.0)
        stop.set()
        for t in reloaders:
            t.join(30.0)
        assert not any(t.is_alive() for t in [*callers, *reloaders])
        assert errors == []
        assert len(ended) == 16 * 40
        final = _reloaded_config("weighted", "gradient2", False)
        pool.reload(final)
        pool.execute(OK, timeout=10.0)
        state = pool._state
        selector = state.dispatcher.selector
        rows = {row["id"]: row for row in pool.workers()}
        assert set(rows) == {"a", "b"}
        assert all(row["in_flight"] == 0 for row in rows.values())
        assert {w.id for w in selector.workers} == {"a", "b"}
        assert set(selector._index.slots) == set(state.workers.values())
        assert selector._retired == {}
        for worker in state.workers.values():
            assert isinstance(worker.limit, Gradient2Limit)
            assert worker.capacity == min(worker.config.max_concurrent, worker.limit.current)
            assert rows[worker.id]["capacity"] == worker.capacity
        assert pool.stats()["balancing"]["strategy"] == "weighted"


@pytest.mark.parametrize("name", ["aimd", "gradient2", "hill-climbing"])
def test_a_hook_reloading_from_limit_changed_under_load_never_overfills_a_worker(name):
    """16 callers against workers that answer 429 and 503 in bursts; a hook answers
    every worker.limit_changed by reloading to another limit or strategy. No worker ever
    has more requests at once than its max_concurrent, no call hangs, and once all end
    nothing is in flight and each worker's capacity is its limit's."""
    import random
    import threading

    from npu_sync import NoWorkerAvailable, TaskFailed

    lock = threading.Condition()
    at_once: dict[str, int] = {}
    most: dict[str, int] = {}
    served = [0]

    def handler(req: Any) -> Any:
        wid = req.worker_id
        with lock:
            at_once[wid] = at_once.get(wid, 0) + 1
            most[wid] = max(most.get(wid, 0), at_once[wid])
            served[0] += 1
            burst = (served[0] // 25) % 3 == 1  # every third run of 25 answers refuses
            # Answer once a second request overlaps here (or after a moment): the
            # worker's room is then really in use.
            lock.notify_all()
            lock.wait_for(lambda: at_once[wid] > 1, timeout=0.02)
        try:
            if burst:
                status = 429 if served[0] % 2 else 503
                return json_response(status, {"detail": "full"})
            return json_response(200, {"worker_id": wid})
        finally:
            with lock:
                at_once[wid] -= 1

    def build(limit: str, strategy: str) -> PoolConfig:
        return PoolConfig(
            workers=tuple(
                worker_config(w, f"http://127.0.0.1:{9400 + i}", max_concurrent=3)
                for i, w in enumerate(("a", "b", "c"))
            ),
            balancing=BalancingConfig(concurrency_limit=limit, strategy=strategy),
            health=HealthConfig(enabled=False),
        )

    rng = random.Random(3)
    reloads: list[str] = []
    errors: list[BaseException] = []

    def hook(event: Any) -> None:
        if isinstance(event, WorkerLimitChanged) and len(reloads) < 200:
            limit = rng.choice(("aimd", "gradient2", "hill-climbing"))
            reloads.append(limit)
            try:
                pool.reload(build(limit, rng.choice(("least-loaded", "round-robin", "weighted"))))
            except BaseException as exc:  # the test reports it
                errors.append(exc)

    net = FakeNetwork(handler)
    pool = WorkerPool(build(name, "least-loaded"), transport_factory=net.factory, hooks=[hook])
    with pool:

        def caller() -> None:
            for _ in range(30):
                try:
                    pool.execute(OK, timeout=10.0)
                except (TaskFailed, NoWorkerAvailable):
                    pass
                except BaseException as exc:  # the test reports it
                    errors.append(exc)

        callers = [threading.Thread(target=caller) for _ in range(16)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(120.0)
        assert not any(t.is_alive() for t in callers)
        assert errors == []
        assert reloads  # the bursts moved some limit, and the hook reloaded
        assert max(most.values()) <= 3
        state = pool._state
        for worker in state.workers.values():
            assert worker.in_flight == 0
            bound = worker.config.max_concurrent
            if worker.limit is not None:
                bound = min(bound, worker.limit.current)
            assert worker.capacity == bound
