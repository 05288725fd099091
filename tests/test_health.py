"""Health checks: probing, thresholds, load hints and the breaker shortcut."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from npu_sync import WorkerPool
from npu_sync._health import MAX_BODY_BYTES, HealthChecker, HealthResult, WorkerHealth, probe
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    RetryConfig,
    TransportConfig,
    worker_config,
)
from npu_sync.testing import FakeClock, FakeNetwork, json_response
from npu_sync.transport import Response, Transport, TransportError
from tests.stubs import NoTransport


def health_route(state: dict):
    """A handler whose /health answer the test changes through ``state``."""

    def handle(req):
        if req.path == "/health":
            if state.get("error"):
                return TransportError("connect", "refused", sent=False)
            return json_response(state.get("code", 200), state.get("body", {"status": "healthy"}))
        return json_response(200, {"worker_id": req.worker_id})

    return handle


def make_pool(net, ids=("a", "b"), *, fail=2, ok=1, clock=None, **kw) -> WorkerPool:
    workers = tuple(
        worker_config(w, f"http://127.0.0.1:{9200 + i}", priority=i + 1) for i, w in enumerate(ids)
    )
    health = HealthConfig(enabled=False, unhealthy_threshold=fail, healthy_threshold=ok)
    config = PoolConfig(workers=workers, health=health, retry=RetryConfig(max_retries=1), **kw)
    return WorkerPool(config, transport_factory=net.factory, clock=clock or FakeClock())


def test_probe_reads_verdict_and_hints():
    """200 + status healthy passes; hints are parsed; anything else fails with a reason."""
    net = FakeNetwork()
    cfg = worker_config("a", "http://127.0.0.1:9300")
    state = {
        "body": {"status": "healthy", "draining": True, "max_concurrent": 3, "active_tasks": 0}
    }
    net.route("a", health_route(state))
    transport = net.factory(cfg, TransportConfig())
    result = probe("a", transport, HealthConfig())
    assert result.ok and result.draining is True and result.max_concurrent == 3
    assert result.active_tasks == 0
    for change, reason in [
        ({"code": 503, "body": {"status": "unhealthy"}}, "HTTP 503"),
        ({"body": {"status": "degraded"}}, "degraded"),
        ({"body": ["not", "an", "object"]}, "not a JSON object"),
        ({"error": True}, "connect"),
    ]:
        state.clear()
        state.update(change)
        failed = probe("a", transport, HealthConfig())
        assert not failed.ok and reason in (failed.error or "")


def test_unhealthy_after_threshold_then_healthy_again():
    """Two failed checks take a worker out; a passing one brings it back."""
    net = FakeNetwork()
    state_a: dict = {}
    net.route("a", health_route(state_a))
    net.route("b", health_route({}))
    with make_pool(net, fail=2, ok=1) as pool:
        state_a.update(code=503, body={"status": "unhealthy"})
        pool.check_health()
        assert pool.execute({"x": 1})["worker_id"] == "a"  # one failure is not enough
        result = pool.check_health()
        assert result["a"]["ok"] is False and result["b"]["ok"] is True
        assert {w["id"]: w["healthy"] for w in pool.workers()} == {"a": False, "b": True}
        assert {pool.execute({"x": i})["worker_id"] for i in range(10)} == {"b"}
        state_a.clear()
        pool.check_health()
        assert pool.execute({"x": 1})["worker_id"] == "a"


def test_healthy_threshold_needs_consecutive_passes():
    """With healthy_threshold=3 a worker needs three passing checks in a row."""
    net = FakeNetwork()
    state: dict = {"code": 503, "body": {"status": "down"}}
    net.route("a", health_route(state))
    with make_pool(net, ids=("a",), fail=1, ok=3) as pool:
        pool.check_health()
        state.clear()
        healthy = []
        for _ in range(3):
            pool.check_health()
            healthy.append(pool.workers()[0]["healthy"])
        assert healthy == [False, False, True]


def test_draining_hint_stops_new_tasks_and_capacity_hint_lowers_it():
    """draining: true in /health takes the worker out; max_concurrent caps its capacity."""
    net = FakeNetwork()
    state: dict = {"body": {"status": "healthy", "draining": True}}
    net.route("a", health_route(state))
    net.route("b", health_route({}))
    with make_pool(net) as pool:
        pool.check_health()
        assert {pool.execute({"x": i})["worker_id"] for i in range(5)} == {"b"}
        state["body"] = {"status": "healthy", "max_concurrent": 2}
        pool.check_health()
        workers = {w["id"]: w for w in pool.workers()}
        assert workers["a"]["capacity"] == 2 and not workers["a"]["draining"]
        assert pool.execute({"x": 1})["worker_id"] == "a"


def test_passing_check_lets_an_open_breaker_try_at_once_but_does_not_close_it():
    """A worker answering its health check gets a trial task before the reset timeout."""
    net = FakeNetwork()
    broken = threading.Event()
    broken.set()

    def handler(req):
        if req.path == "/health":
            return json_response(200, {"status": "healthy"})
        if broken.is_set():
            return json_response(500, {"detail": "boom"})
        return json_response(200, {"worker_id": "a"})

    net.route("a", handler)
    net.route("b", health_route({}))
    clock = FakeClock()
    breaker = BreakerConfig(fail_max=1, reset_timeout=600, max_reset_timeout=600)
    with make_pool(net, clock=clock, circuit_breaker=breaker) as pool:
        assert pool.execute({"x": 1})["worker_id"] == "b"  # a failed, its breaker opened
        assert pool.workers()[0]["breaker"]["state"] == "open"
        broken.clear()
        pool.check_health()
        assert pool.workers()[0]["breaker"]["state"] == "open"  # a check alone does not close
        assert pool.execute({"x": 2})["worker_id"] == "a"  # the trial, long before 600 s
        assert pool.workers()[0]["breaker"]["state"] == "closed"


def test_health_thread_runs_rounds_and_stops_on_close():
    """With health enabled the pool probes on a named thread that close() ends."""
    net = FakeNetwork()
    seen = threading.Event()

    def handler(req):
        if req.path == "/health":
            seen.set()
        return json_response(200, {"status": "healthy"})

    net.route("a", handler)
    config = PoolConfig(
        workers=(worker_config("a", "http://127.0.0.1:9400"),),
        health=HealthConfig(interval=30, timeout=1),
    )
    pool = WorkerPool(config, transport_factory=net.factory)
    assert seen.wait(5), "the first round runs at start"
    assert "npu-sync-health" in {t.name for t in threading.enumerate()}
    pool.close()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("npu-sync")]
    assert pool.stats()["health"]["rounds"] >= 1


@pytest.mark.parametrize("hint", [0, -1, True, "3"])
def test_nonsense_capacity_hints_are_ignored(hint):
    """A max_concurrent hint that is not a positive integer leaves capacity alone."""
    net = FakeNetwork()
    net.route("a", health_route({"body": {"status": "healthy", "max_concurrent": hint}}))
    with make_pool(net, ids=("a",)) as pool:
        pool.check_health()
        assert pool.workers()[0]["capacity"] == 32


def test_health_thread_survives_a_bad_round_and_follows_reloaded_settings(monkeypatch):
    """A round that raises is logged; a reload turns checks off and back on live."""
    net = FakeNetwork()
    rounds = threading.Semaphore(0)

    def handler(req):
        if req.path == "/health":
            rounds.release()
        return json_response(200, {"status": "healthy"})

    net.route("a", handler)
    workers = (worker_config("a", "http://127.0.0.1:9401"),)
    fast = HealthConfig(interval=0.02, timeout=1)
    pool = WorkerPool(PoolConfig(workers=workers, health=fast), transport_factory=net.factory)
    try:
        assert rounds.acquire(timeout=5)
        original = pool._apply_health
        calls = {"n": 0}

        def flaky(results):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("bad round")
            original(results)

        monkeypatch.setattr(pool._health, "_apply", flaky)
        for _ in range(3):
            assert rounds.acquire(timeout=5)  # still checking after the bad round
        pool.reload(PoolConfig(workers=workers, health=HealthConfig(enabled=False, interval=0.02)))
        while rounds.acquire(timeout=0.3):  # drain a round that was already under way
            pass
        assert not rounds.acquire(timeout=0.3), "checks went on while disabled"
        pool.reload(PoolConfig(workers=workers, health=fast))
        assert rounds.acquire(timeout=5)
    finally:
        pool.close()


def test_a_moved_worker_whose_check_overruns_is_still_marked_unhealthy():
    """Results the round fills in itself carry the worker's current address generation."""
    net = FakeNetwork()
    hold = threading.Event()

    def hung(req):
        hold.wait(5)
        return json_response(200, {"status": "healthy"})

    net.route("a", hung)
    fast = HealthConfig(enabled=False, timeout=0.05, unhealthy_threshold=1)
    config = PoolConfig(workers=(worker_config("a", "http://127.0.0.1:9501"),), health=fast)
    with WorkerPool(config, transport_factory=net.factory) as pool:
        moved = worker_config("a", "http://127.0.0.1:9502")
        pool.reload(PoolConfig(workers=(moved,), health=fast))
        try:
            result = pool.check_health()["a"]
            assert result["ok"] is False and "no answer" in result["error"]
            assert pool.workers()[0]["healthy"] is False
        finally:
            hold.set()


# -- one worker's probe never affects another's -------------------------------------------


@dataclass
class Target:
    """What HealthChecker needs of a worker, without a pool around it."""

    id: str
    health_transport: Transport


def raw_response(body: bytes) -> Response:
    return Response(200, {"content-type": "application/json"}, body)


NESTED = b"[" * 100_000


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (NESTED, "not a JSON object"),
        (b'{"status": ' + b"[" * 500 + b"]" * 500 + b"}", "status of type list"),
        (b'{"status": "healthy", "pad": "' + b"x" * MAX_BODY_BYTES + b'"}', "bytes is over"),
    ],
    ids=["nested-list", "nested-status", "oversized"],
)
def test_probe_fails_an_unreadable_answer_without_raising(body, reason):
    """Deep nesting or an oversized body is a failed check with a reason, not an exception."""
    net = FakeNetwork()
    net.route("a", lambda req: raw_response(body))
    transport = net.factory(worker_config("a", "http://127.0.0.1:9310"), TransportConfig())
    result = probe("a", transport, HealthConfig())
    assert not result.ok and result.status == 200 and reason in (result.error or "")


def test_deeply_nested_answer_fails_that_worker_only_and_the_thread_lives_on():
    """One worker answering '[' * 100000 leaves the others' results right, round after round."""
    net = FakeNetwork()
    checked_b = threading.Semaphore(0)

    def healthy_b(req):
        checked_b.release()
        return json_response(200, {"status": "healthy"})

    net.route("a", lambda req: raw_response(NESTED))
    net.route("b", healthy_b)
    workers = (
        worker_config("a", "http://127.0.0.1:9311"),
        worker_config("b", "http://127.0.0.1:9312"),
    )
    fast = HealthConfig(interval=0.02, timeout=1, unhealthy_threshold=1)
    with WorkerPool(
        PoolConfig(workers=workers, health=fast), transport_factory=net.factory
    ) as pool:
        for _ in range(3):  # rounds keep coming: the thread survived the first
            assert checked_b.acquire(timeout=5)
        assert pool.stats()["health"]["running"]
        result = pool.check_health()
        assert result["a"]["ok"] is False and "not a JSON object" in result["a"]["error"]
        assert result["b"]["ok"] is True
        assert {w["id"]: w["healthy"] for w in pool.workers()} == {"a": False, "b": True}


def test_hung_workers_do_not_keep_healthy_ones_from_being_checked():
    """With 40 workers hung on their check, the 2 healthy ones pass every round."""
    net = FakeNetwork()
    release = threading.Event()

    def hung(req):
        release.wait(30)
        return json_response(200, {"status": "healthy"})

    hung_ids = [f"hung{i}" for i in range(40)]
    for worker_id in hung_ids:
        net.route(worker_id, hung)
    ids = [*hung_ids, "ok1", "ok2"]  # the healthy ones last, behind every hung probe
    workers = tuple(worker_config(w, f"http://127.0.0.1:{10000 + i}") for i, w in enumerate(ids))
    health = HealthConfig(enabled=False, timeout=0.2, unhealthy_threshold=1)
    pool = WorkerPool(PoolConfig(workers=workers, health=health), transport_factory=net.factory)
    try:
        for round_no in range(3):
            results = pool.check_health()
            assert results["ok1"]["ok"] and results["ok2"]["ok"], (round_no, results["ok1"])
            assert not any(results[w]["ok"] for w in hung_ids)
            healthy = {w["id"] for w in pool.workers() if w["healthy"]}
            assert healthy == {"ok1", "ok2"}
        # A hung worker is not probed again while its first check still runs.
        assert len(net.requests("hung0")) == 1
        assert len([r for r in net.requests("ok1") if r.path == "/health"]) == 3
    finally:
        release.set()
        pool.close()


def test_health_thread_survives_an_interval_beyond_any_timer_and_unreadable_settings():
    """A smuggled huge interval or settings that raise never end the thread; wake() resumes."""
    net = FakeNetwork()
    rounds = threading.Semaphore(0)
    transport = net.factory(worker_config("a", "http://127.0.0.1:9313"), TransportConfig())
    huge = HealthConfig(timeout=1)
    object.__setattr__(huge, "interval", 1e10)  # past validation, as a bug might
    state: dict = {"config": huge, "fail": False}
    failed = threading.Event()

    def settings():
        if state["fail"]:
            state["fail"] = False
            failed.set()
            raise RuntimeError("settings unavailable")
        return state["config"]

    checker = HealthChecker(
        lambda: [Target("a", transport)], lambda results: rounds.release(), settings
    )
    checker.start()
    try:
        assert rounds.acquire(timeout=5)  # the first round, then a wait of 1e10 s, capped
        assert checker.running
        state.update(config=HealthConfig(interval=0.02, timeout=1), fail=True)
        checker.wake()  # the next read of the settings fails
        assert failed.wait(5)
        assert checker.running
        checker.wake()  # as a reload would
        for _ in range(3):
            assert rounds.acquire(timeout=5)
        assert checker.running
    finally:
        checker.stop()
    assert not checker.running


class Die(BaseException):
    """Ends a thread the way nothing in its loop can catch."""


def test_start_restarts_a_health_thread_that_died(monkeypatch):
    """start() after the thread died starts a new one, which runs rounds again."""
    deaths: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: deaths.append(args.exc_value))
    net = FakeNetwork()
    rounds = threading.Semaphore(0)
    transport = net.factory(worker_config("a", "http://127.0.0.1:9314"), TransportConfig())
    dying = {"left": 1}

    def settings():
        if dying["left"]:
            dying["left"] -= 1
            raise Die()
        return HealthConfig(interval=0.02, timeout=1)

    checker = HealthChecker(
        lambda: [Target("a", transport)], lambda results: rounds.release(), settings
    )
    checker.start()
    try:
        checker._thread.join(5)
        assert not checker.running and len(deaths) == 1 and isinstance(deaths[0], Die)
        checker.start()
        assert rounds.acquire(timeout=5)
        assert checker.running
    finally:
        checker.stop()


def test_a_reload_restarts_a_dead_health_thread(monkeypatch):
    """A good reload with health enabled brings back a health thread that had died."""
    monkeypatch.setattr(threading, "excepthook", lambda args: None)
    net = FakeNetwork()
    rounds = threading.Semaphore(0)

    def handler(req):
        if req.path == "/health":
            rounds.release()
        return json_response(200, {"status": "healthy"})

    net.route("a", handler)
    workers = (worker_config("a", "http://127.0.0.1:9315"),)
    fast = HealthConfig(interval=0.02, timeout=1)
    with WorkerPool(
        PoolConfig(workers=workers, health=fast), transport_factory=net.factory
    ) as pool:
        assert rounds.acquire(timeout=5)
        settings = pool._health._config
        dying = {"left": 1}

        def die_once():
            if dying["left"]:
                dying["left"] -= 1
                raise Die()
            return settings()

        monkeypatch.setattr(pool._health, "_config", die_once)
        pool._health._thread.join(5)
        assert not pool.stats()["health"]["running"]
        while rounds.acquire(timeout=0.1):  # a probe already started may still report
            pass
        pool.reload(PoolConfig(workers=workers, health=HealthConfig(interval=0.03, timeout=1)))
        assert rounds.acquire(timeout=5)
        assert pool.stats()["health"]["running"]


def test_close_returns_while_a_probe_overruns_its_budget():
    """close() waits for a check at most about health.timeout, even one that never ends."""
    net = FakeNetwork()
    started = threading.Event()
    release = threading.Event()

    def stuck(req):
        # A real transport gives up after health.timeout; this one ignores its budget.
        started.set()
        release.wait(30)
        return json_response(200, {"status": "healthy"})

    net.route("a", stuck)
    workers = (worker_config("a", "http://127.0.0.1:9316"),)
    health = HealthConfig(interval=30, timeout=0.2)
    pool = WorkerPool(PoolConfig(workers=workers, health=health), transport_factory=net.factory)
    closer = threading.Thread(target=pool.close)
    try:
        assert started.wait(5)
        closer.start()
        closer.join(10)
        assert not closer.is_alive(), "close() waited for a probe past its budget"
        assert "npu-sync-health" not in {t.name for t in threading.enumerate()}
    finally:
        release.set()
        closer.join(10)


def test_a_check_during_another_rounds_probe_shares_its_answer_and_applies_it_once(
    monkeypatch,
):
    """check_once() while a probe of the same worker runs waits for that probe's answer
    (no second probe at once, no false 'still running' failure) and counts it once."""
    import concurrent.futures
    import types

    import npu_sync._health

    waiting = threading.Semaphore(0)

    def wait(fs, timeout=None):
        waiting.release()
        return concurrent.futures.wait(fs, timeout=timeout)

    fake = types.SimpleNamespace(
        futures=types.SimpleNamespace(wait=wait, Future=concurrent.futures.Future)
    )
    monkeypatch.setattr(npu_sync._health, "concurrent", fake)
    net = FakeNetwork()
    gate, probing = threading.Event(), threading.Event()
    probes = []

    def handle(req):
        if req.path == "/health":
            probes.append(req)
            probing.set()
            assert gate.wait(5)
        return json_response(200, {"status": "healthy"})

    net.route("a", handle)
    with make_pool(net, ids=("a",), fail=1) as pool:
        first: dict = {}
        runner = threading.Thread(target=lambda: first.update(pool.check_health()))
        runner.start()
        assert probing.wait(5)
        second: dict = {}
        joiner = threading.Thread(target=lambda: second.update(pool.check_health()))
        joiner.start()
        # Both rounds are waiting for answers: the first for its probe, the second
        # for the same one.
        assert waiting.acquire(timeout=5) and waiting.acquire(timeout=5)
        gate.set()
        runner.join(5)
        joiner.join(5)
        assert first["a"]["ok"] is True and second["a"]["ok"] is True
        assert len(probes) == 1
        worker = pool._state.workers["a"]
        assert worker.health.passes == 1 and worker.healthy


@pytest.mark.parametrize(
    ("code", "body", "shown"),
    [
        (404, {"detail": "Not Found"}, "GET /health → 404"),
        (405, {"detail": "Method Not Allowed"}, "GET /health → 405"),
        (200, {"service": "grafana", "version": "10"}, "200, a JSON object without a status"),
    ],
)
def test_a_health_answer_that_is_not_a_workers_takes_the_worker_out_at_once(code, body, shown):
    """404/405 or another service's JSON on /health: out after one check, saying why."""
    net = FakeNetwork()
    net.route("a", lambda req: json_response(code, body))
    net.route("b", lambda req: json_response(200, {"status": "healthy"}))
    with make_pool(net, fail=3) as pool:
        result = pool.check_health()["a"]
        row = {w["id"]: w for w in pool.workers()}["a"]
    assert result["error"].startswith("not an NPU worker at this URL: GET /health → ")
    assert shown in result["error"] and row["healthy"] is False


# -- WorkerHealth: what the checks learnt of one worker -----------------------------------


def passed(**kw) -> HealthResult:
    return HealthResult("a", True, 0.0, status=200, **kw)


def failed(**kw) -> HealthResult:
    return HealthResult("a", False, 0.0, error="connect: refused", **kw)


def test_a_healthy_worker_falls_only_after_enough_failures_in_a_row():
    """unhealthy_after 3: two failures, a pass, two failures keep it up; a third in a
    row takes it down, and the failures are counted."""
    health = WorkerHealth(NoTransport())
    healthy = True
    for result in (failed(), failed(), passed(), failed(), failed()):
        healthy = health.apply(result, healthy, 3, 1)
        assert healthy
    assert not health.apply(failed(), healthy, 3, 1)
    assert (health.failures, health.passes) == (3, 0)


def test_an_unhealthy_worker_rises_only_after_enough_passes_in_a_row():
    """healthy_after 2: a pass, a failure, a pass keep it down; a second pass in a row
    brings it back."""
    health = WorkerHealth(NoTransport())
    healthy = False
    for result in (passed(), failed(), passed()):
        healthy = health.apply(result, healthy, 1, 2)
        assert not healthy
    assert health.apply(passed(), healthy, 1, 2)
    assert (health.failures, health.passes) == (0, 2)


def test_an_answer_that_is_not_a_workers_takes_it_down_at_once():
    """Not a worker's answer (404, another service): down after one check, whatever
    the threshold."""
    health = WorkerHealth(NoTransport())
    assert not health.apply(failed(not_a_worker=True), True, 5, 1)


def test_a_passed_check_sets_the_hints_a_failed_one_leaves_them():
    """The worker's own word on capacity and draining comes from passed checks only; a
    pass without hints clears them."""
    health = WorkerHealth(NoTransport())
    health.apply(passed(max_concurrent=3, draining=True), True, 2, 1)
    assert (health.hinted_capacity, health.hinted_draining) == (3, True)
    health.apply(failed(), True, 2, 1)
    assert (health.hinted_capacity, health.hinted_draining) == (3, True)
    health.apply(passed(), True, 2, 1)
    assert (health.hinted_capacity, health.hinted_draining) == (None, False)


def test_the_last_check_is_kept_and_a_first_check_ends_the_wait_for_one():
    """A worker awaiting its first check stops awaiting it once any check is applied."""
    health = WorkerHealth(NoTransport())
    health.await_first_check()
    assert health.awaiting_check and health.last is None
    result = failed()
    health.apply(result, False, 2, 1)
    assert not health.awaiting_check and health.last is result


def test_a_worker_taken_out_counts_its_passes_anew():
    """Taken out of service: the passes before do not count towards its return."""
    health = WorkerHealth(NoTransport())
    health.apply(passed(), True, 2, 2)
    health.restart()
    assert not health.apply(passed(), False, 2, 2)
    assert health.apply(passed(), False, 2, 2)


def test_a_move_forgets_what_the_checks_learnt_and_swaps_the_connection():
    """A new address: counts, hints and the last check are gone; checks use the new
    connection."""
    old, new = NoTransport(), NoTransport()
    health = WorkerHealth(old)
    health.apply(passed(max_concurrent=2, draining=True), True, 2, 1)
    health.apply(failed(), True, 2, 1)
    health.forget(new)
    assert health.transport is new and health.last is None
    assert (health.failures, health.passes) == (0, 0)
    assert (health.hinted_capacity, health.hinted_draining) == (None, False)


def test_a_check_of_the_old_address_that_ends_after_a_move_teaches_the_new_one_nothing():
    """A check still running when a reload moves the worker answers with hints, no NPU
    and a model list: none of it reaches the worker at its new address."""
    net = FakeNetwork()
    entered, release = threading.Event(), threading.Event()

    def old_address(req):
        if req.path == "/health":
            entered.set()
            release.wait(10)
        body = {"status": "healthy", "max_concurrent": 1, "draining": True}
        return json_response(200, {**body, "npu_available": False, "loaded_models": ["m"]})

    net.route("a", old_address)
    checks = HealthConfig(enabled=False, timeout=10)
    first = worker_config("a", "http://127.0.0.1:9511", max_concurrent=4, priority=2)
    with WorkerPool(
        PoolConfig(workers=(first,), health=checks), transport_factory=net.factory
    ) as pool:
        results: dict = {}
        round_ = threading.Thread(target=lambda: results.update(pool.check_health()))
        round_.start()
        try:
            assert entered.wait(10)
            moved = worker_config("a", "http://127.0.0.1:9512", max_concurrent=4, priority=2)
            assert pool.reload(PoolConfig(workers=(moved,), health=checks)).updated == ("a",)
        finally:
            release.set()
            round_.join(10)
        assert results["a"]["ok"] is True and results["a"]["draining"] is True
        worker = pool._state.workers["a"]
        assert worker.health.last is None and not worker.health.hinted_draining
        assert worker.capacity == 4 and worker.eligible(pool._state.clock.monotonic())
        assert worker.held.npu_available is None and worker.held.models is None
        assert worker.priority == 2
