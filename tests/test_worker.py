"""Unit tests of one worker: how what its health checks and its holdings decide reaches
its counts (healthy, capacity, priority, eligibility), and what a move or a new
protocol forgets."""

from __future__ import annotations

from typing import Any

from npu_sync._breaker import WorkerBreaker
from npu_sync._health import HealthResult
from npu_sync._worker import CPU_PENALTY, Worker
from npu_sync.config import BreakerConfig, worker_config
from npu_sync.testing import FakeClock
from tests.stubs import NoTransport


def make_worker(**kw: Any) -> Worker:
    cfg = worker_config("a", "http://127.0.0.1:9000", **kw)
    breaker = WorkerBreaker("a", BreakerConfig(), clock=FakeClock())
    return Worker(cfg, NoTransport(), breaker, NoTransport())


def passed(**kw: Any) -> HealthResult:
    return HealthResult("a", True, 0.0, status=200, **kw)


def test_a_health_verdict_reaches_the_workers_healthy_flag_and_says_when_it_changed():
    """Falling and rising are reported once, when ``healthy`` changes."""
    worker = make_worker()
    down = HealthResult("a", False, 0.0, error="refused")
    assert worker.apply_health(down, 2, 1) is False and worker.healthy
    assert worker.apply_health(down, 2, 1) is True and not worker.healthy
    assert worker.apply_health(down, 2, 1) is False
    assert worker.apply_health(passed(), 2, 1) is True and worker.healthy
    assert worker.health.last is not None and worker.health.last.ok


def test_a_capacity_hint_caps_the_configured_capacity_until_a_check_drops_it():
    """The worker's own max_concurrent caps the configuration's, never raises it."""
    worker = make_worker(max_concurrent=8)
    worker.apply_health(passed(max_concurrent=3), 2, 1)
    assert worker.capacity == 3
    worker.apply_health(passed(max_concurrent=50), 2, 1)
    assert worker.capacity == 8
    worker.apply_health(passed(max_concurrent=2), 2, 1)
    worker.apply_health(passed(), 2, 1)
    assert worker.capacity == 8


def test_a_worker_that_says_it_drains_takes_no_task():
    """The draining hint alone makes a healthy worker with room ineligible."""
    worker = make_worker()
    assert worker.eligible(0.0)
    worker.apply_health(passed(draining=True), 2, 1)
    assert worker.healthy and not worker.eligible(0.0)
    assert worker.snapshot(0.0)["draining"] is True
    worker.apply_health(passed(), 2, 1)
    assert worker.eligible(0.0)


def test_a_worker_added_by_a_reload_waits_for_its_first_check():
    """Out of service until a check passes, and awaiting one until any is applied."""
    worker = make_worker()
    worker.await_first_check()
    assert not worker.healthy and worker.health.awaiting_check
    worker.apply_health(passed(), 2, 1)
    assert worker.healthy and not worker.health.awaiting_check


def test_a_worker_taken_out_returns_only_after_the_passes_it_needs():
    """Misconfigured: out with the reason, and the passes before it do not count."""
    worker = make_worker()
    worker.apply_health(passed(), 2, 2)
    assert worker.take_out("not an NPU worker") is True
    assert worker.stats.last_error == "not an NPU worker"
    assert worker.take_out("again") is False
    worker.apply_health(passed(), 2, 2)
    assert not worker.healthy
    worker.apply_health(passed(), 2, 2)
    assert worker.healthy


def test_a_worker_without_an_npu_ranks_after_its_tier_until_it_moves():
    """npu_available false: priority plus the penalty, after the list is applied and
    ranked; a move forgets it."""
    worker = make_worker(priority=2)
    worker.held.apply_models(passed(npu_available=False, device="CPU"))
    worker.rank()
    assert worker.priority == 2 + CPU_PENALTY
    worker.held.apply_models(passed(npu_available=True))
    worker.rank()
    assert worker.priority == 2
    worker.held.apply_models(passed(npu_available=False))
    worker.rank()
    worker.moved(NoTransport(), NoTransport())
    assert worker.priority == 2 and worker.held.npu_available is None


def test_a_move_forgets_health_hints_and_holdings_and_uses_the_new_connections():
    """A new address: healthy again, no hint, no list, new generation, new transports
    for tasks and for checks."""
    worker = make_worker(max_concurrent=8)
    worker.apply_health(passed(max_concurrent=1, draining=True), 1, 1)
    worker.apply_health(HealthResult("a", False, 0.0), 1, 1)
    worker.held.apply_models(passed(models=frozenset({"m"}), device="NPU"))
    tasks, checks = NoTransport(), NoTransport()
    worker.moved(tasks, checks)
    assert worker.generation == 1 and worker.healthy and worker.capacity == 8
    assert worker.transport is tasks and worker.health_transport is checks
    assert worker.health.last is None and not worker.health.hinted_draining
    assert worker.held.models is None and worker.held.device is None


def test_another_protocol_forgets_the_model_list_and_reads_the_next_in_its_terms():
    """Linux to Windows: the list is dropped, the device kept, and the on-demand rule
    of the new protocol applies to what the worker lacks."""
    worker = make_worker(protocol="autobot-linux")
    worker.held.apply_models(passed(models=frozenset({"a"}), device="NPU"))
    assert worker.held.lacks("b")
    worker.configure(worker_config("a", "http://127.0.0.1:9000", protocol="autobot-windows"))
    assert worker.held.models is None and worker.held.device == "NPU"
    worker.held.apply_models(passed(models=frozenset({"a"})))
    assert not worker.held.lacks("b")
    same = worker.held.models
    worker.configure(worker_config("a", "http://127.0.0.1:9000", protocol="autobot-windows"))
    assert worker.held.models is same


def test_the_workers_row_shows_what_its_owners_know():
    """workers(): models, device and NPU from the holdings, the last check from health."""
    worker = make_worker()
    worker.held.apply_models(passed(models=frozenset({"b", "a"}), device="NPU", npu_available=True))
    worker.apply_health(passed(max_concurrent=4), 2, 1)
    row = worker.snapshot(0.0)
    assert (row["models"], row["device"], row["npu_available"]) == (["a", "b"], "NPU", True)
    assert row["health"] is not None and row["health"]["max_concurrent"] == 4
    assert row["capacity"] == 4


def test_a_worker_re_added_while_its_old_self_drains_counts_the_task_still_there():
    """Worker a (max_concurrent 1) is removed by a reload while a task is on it, then
    re-added at the same address before the task ends: the address still has that task,
    so a's row shows it in flight and no second request reaches a until it ends."""
    import threading

    from npu_sync import WorkerPool
    from npu_sync.config import BalancingConfig, HealthConfig, PoolConfig
    from npu_sync.testing import FakeNetwork, FakeRequest, json_response

    lock = threading.Lock()
    at_once: dict[str, int] = {}
    most: dict[str, int] = {}
    entered, release = threading.Event(), threading.Event()

    def handler(req: FakeRequest) -> Any:
        with lock:
            at_once[req.worker_id] = at_once.get(req.worker_id, 0) + 1
            most[req.worker_id] = max(most.get(req.worker_id, 0), at_once[req.worker_id])
        try:
            if req.json().get("hold"):
                entered.set()
                assert release.wait(10.0)
            return json_response(200, {"worker_id": req.worker_id})
        finally:
            with lock:
                at_once[req.worker_id] -= 1

    a = worker_config("a", "http://127.0.0.1:9600", max_concurrent=1)
    b = worker_config("b", "http://127.0.0.1:9601", max_concurrent=1)

    def config(*workers: Any) -> PoolConfig:
        return PoolConfig(
            workers=workers,
            health=HealthConfig(enabled=False),
            balancing=BalancingConfig(slow_start=0),
        )

    net = FakeNetwork(handler)
    with WorkerPool(config(a, b), transport_factory=net.factory) as pool:
        held = pool.submit({"hold": 1})
        try:
            assert entered.wait(10.0)
            pool.reload(config(b))
            pool.reload(config(a, b))
            row = {r["id"]: r for r in pool.workers()}["a"]
            in_flight = row["in_flight"]
            served = [pool.execute({"x": i}, timeout=10.0)["worker_id"] for i in range(4)]
        finally:
            release.set()
        assert held.result(10.0) == {"worker_id": "a"}
        assert pool.stats()["tasks"]["in_flight"] == 0
    assert served  # every task was served, by b while a's address was full
    assert in_flight == 1
    assert most["a"] == 1
