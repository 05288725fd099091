"""Whole-fleet edges against real reference workers and hostile servers: hedged
failed tasks, payload-specific 404s, fleets that go down and come back."""

from __future__ import annotations

from typing import Any

import pytest

from npu_sync import Task, TaskFailed, WorkerPool
from npu_sync.config import (
    BalancingConfig,
    BreakerConfig,
    HealthConfig,
    HedgeConfig,
    PoolConfig,
    RetryConfig,
    worker_config,
)

pytestmark = pytest.mark.integration


def _rows(pool: WorkerPool) -> dict[str, dict[str, Any]]:
    return {row["id"]: row for row in pool.workers()}


def test_a_failed_task_both_workers_give_under_hedging_charges_neither(start_worker) -> None:
    """A Windows failed task answered by the first worker and by its hedge charges neither."""
    workers = [
        start_worker(worker_id=f"win{i}", protocol="windows", latency_ms=300, failure_rate=1.0)
        for i in range(2)
    ]
    config = PoolConfig(
        workers=tuple(
            worker_config(w.worker_id, w.url, protocol="autobot-windows") for w in workers
        ),
        health=HealthConfig(enabled=False),
        circuit_breaker=BreakerConfig(fail_max=2, reset_timeout=60),
        retry=RetryConfig(max_retries=3, backoff_initial=0.01, backoff_max=0.05),
        balancing=BalancingConfig(hedge=HedgeConfig(enabled=True, delay=0.05)),
    )
    with WorkerPool(config) as pool:
        for n in range(3):
            with pytest.raises(TaskFailed, match="taken as the task's fault"):
                pool.execute(Task({"model_id": "default", "input_text": f"t{n}"}, timeout=5))
        rows = _rows(pool)
    assert [r["breaker"]["failures"] for r in rows.values()] == [0, 0]
    assert [r["breaker"]["state"] for r in rows.values()] == ["closed", "closed"]


def _picky_worker(servers: list[Any]) -> Any:
    """A worker that answers every task but one about a missing document, which it
    answers 404 with its own reason (as a search worker does)."""
    import json

    from tests.hostile import Hostile, answer, keep_answering

    def reply(seen: Any) -> bytes:
        if seen.path == "/health":
            return answer(200, b'{"status": "healthy"}')
        if b"missing-doc" in seen.body:
            return answer(404, b'{"detail": "document missing-doc not found"}')
        return answer(200, json.dumps({"response": "ok", "worker": "picky"}).encode())

    server = Hostile(keep_answering(reply))
    servers.append(server)
    return server


@pytest.fixture
def servers():
    started: list[Any] = []
    yield started
    for server in started:
        server.close()


def test_a_404_for_one_payload_from_a_proven_worker_does_not_take_it_out(
    start_worker, servers
) -> None:
    """A worker whose inference path has answered tasks is not taken out by a 404 for one."""
    picky = _picky_worker(servers)
    other = start_worker(worker_id="w1")
    config = PoolConfig(
        workers=(
            worker_config("w0", picky.url(), priority=1),
            worker_config("w1", other.url, priority=2),
        ),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=2, backoff_initial=0.01, backoff_max=0.05),
    )
    with WorkerPool(config) as pool:
        assert pool.execute({"model_id": "default", "input_text": "a"})["worker"] == "picky"
        pool.execute({"model_id": "default", "input_text": "missing-doc"})  # runs on w1
        rows = _rows(pool)
        assert rows["w0"]["healthy"] is True, rows["w0"]["last_error"]
        assert pool.execute({"model_id": "default", "input_text": "b"})["worker"] == "picky"


def _down_config(urls: list[str], **breaker: Any) -> PoolConfig:
    return PoolConfig(
        workers=tuple(worker_config(f"w{i}", url) for i, url in enumerate(urls)),
        health=HealthConfig(enabled=False),
        circuit_breaker=BreakerConfig(**{"fail_max": 1, "reset_timeout": 60, **breaker}),
        retry=RetryConfig(max_retries=3, backoff_initial=0.01, backoff_max=0.05),
    )


def test_a_fleet_killed_then_restarted_recovers_by_itself_without_health_checks(
    start_worker,
) -> None:
    """Every worker killed, one restarted: the next task waits for its trial and runs."""
    import concurrent.futures

    from npu_sync import NoWorkerAvailable

    workers = [start_worker(worker_id=f"w{i}") for i in range(2)]
    with WorkerPool(_down_config([w.url for w in workers], reset_timeout=0.3)) as pool:
        pool.execute({"model_id": "default", "input_text": "warm"})
        for w in workers:
            w.kill()
        with pytest.raises(TaskFailed):
            pool.execute({"model_id": "default", "input_text": "x"}, timeout=0.2)
        with pytest.raises(NoWorkerAvailable, match="all 2 workers are down: 2 breakers open"):
            pool.execute({"model_id": "default", "input_text": "y"}, timeout=0.1)
        workers[0].restart()
        with concurrent.futures.ThreadPoolExecutor(4) as callers:
            done = list(
                callers.map(
                    lambda n: pool.execute(
                        {"model_id": "default", "input_text": f"z{n}"}, timeout=10
                    ),
                    range(4),
                )
            )
        assert len(done) == 4


def test_two_misrouted_workers_end_a_task_at_once_with_the_clause(servers) -> None:
    """Both entries point at another service: TaskFailed names them, its dead letter stored."""
    from tests.hostile import Hostile, answer, keep_answering

    for _ in range(2):
        servers.append(Hostile(keep_answering(lambda seen: answer(404, b'{"detail":"Not Found"}'))))
    with WorkerPool(_down_config([s.url() for s in servers])) as pool:
        with pytest.raises(TaskFailed) as info:
            pool.execute({"model_id": "default", "input_text": "x"}, timeout=30)
        assert "not NPU workers" in str(info.value), str(info.value)
        assert pool.dead_letters.get(info.value.dead_letter_id) is not None
        with pytest.raises(TaskFailed, match="all 2 workers are down: 2 not NPU workers"):
            pool.execute({"model_id": "default", "input_text": "x"}, timeout=30)


def test_a_fallback_that_calls_back_into_a_pool_that_is_down_does_not_deadlock(servers) -> None:
    """A fallback running another task on the same downed pool gets its own fallback."""
    from tests.hostile import Hostile, answer, keep_answering

    servers.append(Hostile(keep_answering(lambda seen: answer(503, b'{"detail":"down"}'))))
    with WorkerPool(_down_config([servers[0].url()])) as pool:
        with pytest.raises(TaskFailed):
            pool.execute({"model_id": "default", "input_text": "trip"}, timeout=5)

        def fallback() -> Any:
            inner = pool.execute(
                {"model_id": "default", "input_text": "inner"}, timeout=30, fallback=lambda: 1
            )
            return inner + 1

        assert pool.execute({"model_id": "default"}, timeout=30, fallback=fallback) == 2
        assert pool.stats()["tasks"]["fallbacks"] == 2


def _interrupting(name: str) -> Any:
    def hook(event: Any) -> None:
        if getattr(event, "name", "") == name:
            raise KeyboardInterrupt

    return hook


def _quiet(pool: WorkerPool) -> None:
    assert [w["in_flight"] for w in pool.workers()] == [0] * len(pool.workers())
    assert pool.stats()["tasks"]["active"] == 0


def test_an_interrupt_in_the_credentials_hook_leaves_the_pool_whole(servers) -> None:
    """KeyboardInterrupt from the credentials-refused hook: no slot held, next task runs."""
    from tests.hostile import Hostile, answer, keep_answering

    def refusing(seen: Any) -> bytes:
        if seen.path == "/health":
            return answer(200, b'{"status": "healthy"}')
        return answer(401, b'{"detail": "bad signature"}')

    servers.append(Hostile(keep_answering(refusing)))
    servers.append(Hostile(keep_answering(lambda seen: answer(200, b'{"ok": 1}'))))
    config = PoolConfig(
        workers=(
            worker_config("w0", servers[0].url(), priority=1),
            worker_config("w1", servers[1].url(), priority=2),
        ),
        health=HealthConfig(enabled=False),
    )
    with WorkerPool(config) as pool:
        pool.add_hook(_interrupting("worker.credentials_refused"))
        with pytest.raises(KeyboardInterrupt):
            pool.execute({"model_id": "default"}, timeout=30)
        _quiet(pool)
        assert pool.execute({"model_id": "default"}, timeout=30) == {"ok": 1}
        _quiet(pool)


def test_an_interrupt_while_a_downed_fleet_fails_a_task_at_once_keeps_its_dead_letter(
    servers,
) -> None:
    """KeyboardInterrupt from the dead-letter hook on the at-once path: record kept, pool whole."""
    from tests.hostile import Hostile, answer, keep_answering

    servers.append(Hostile(keep_answering(lambda seen: answer(503, b'{"detail":"down"}'))))
    with WorkerPool(_down_config([servers[0].url()])) as pool:
        with pytest.raises(TaskFailed):
            pool.execute({"model_id": "default"}, timeout=30)
        pool.add_hook(_interrupting("task.dead_lettered"))
        with pytest.raises(KeyboardInterrupt):
            pool.execute(Task({"model_id": "default"}, task_id="interrupted"), timeout=30)
        assert [r.task_id for r in pool.dead_letters.list()].count("interrupted") == 1
        _quiet(pool)
        assert pool.execute({"model_id": "default"}, timeout=30, fallback=lambda: 7) == 7


def _health_config(workers: list[tuple[str, str]]) -> PoolConfig:
    return PoolConfig(
        workers=tuple(worker_config(wid, url) for wid, url in workers),
        health=HealthConfig(enabled=True, interval=60, timeout=2, healthy_threshold=1),
        circuit_breaker=BreakerConfig(fail_max=1, reset_timeout=60),
        retry=RetryConfig(max_retries=2, backoff_initial=0.01, backoff_max=0.05),
    )


def _gated_worker(servers: list[Any], gate: Any, health: int) -> Any:
    """A worker whose health checks wait for ``gate``, then answer ``health``."""
    from tests.hostile import Hostile, answer, keep_answering

    def reply(seen: Any) -> bytes:
        if seen.path == "/health":
            gate.wait(30)
            status = b"healthy" if health == 200 else b"starting"
            return answer(health, b'{"status": "%s"}' % status)
        return answer(200, b'{"worker_id": "w4"}')

    server = Hostile(keep_answering(reply))
    servers.append(server)
    return server


def _wait_until(predicate: Any) -> None:
    import threading

    pause = threading.Event()
    for _ in range(3000):
        if predicate():
            return
        pause.wait(0.01)
    raise AssertionError("condition never met")


def _replace_dead_fleet(start_worker, servers, health: int) -> Any:
    """A pool whose only worker w1 died, reloaded to w4 whose first check is held
    until a task waits; returns how that task ended."""
    import threading

    old = start_worker(worker_id="w1")
    gate = threading.Event()
    new = _gated_worker(servers, gate, health)
    with WorkerPool(_health_config([("w1", old.url)])) as pool:
        pool.execute({"model_id": "default", "input_text": "x"}, timeout=10)
        old.kill()
        with pytest.raises(TaskFailed):
            pool.execute({"model_id": "default", "input_text": "x"}, timeout=10)
        pool.reload(_health_config([("w4", new.url())]))
        future = pool.submit({"model_id": "default", "input_text": "x"}, timeout=60)
        _wait_until(lambda: future.done() or pool.stats()["tasks"]["waiting"] == 1)
        gate.set()
        try:
            return future.result(timeout=5)  # pool.max_queue_wait is 10 s
        except Exception as exc:
            return exc


def test_a_task_right_after_a_reload_replacing_a_dead_fleet_waits_for_the_new_worker(
    start_worker, servers
) -> None:
    """w1 dead, replaced by a live w4: a task sent before w4's first check runs on w4."""
    assert _replace_dead_fleet(start_worker, servers, 200) == {"worker_id": "w4"}


def test_a_task_waiting_for_a_new_worker_is_refused_when_its_first_check_fails(
    start_worker, servers
) -> None:
    """w1 dead, replaced by a sick w4: the waiting task ends on w4's first check, well
    before pool.max_queue_wait (TaskFailed, or NoWorkerAvailable when it never got as
    far as trying the dead w1, which serves until w4 answers)."""
    ended = _replace_dead_fleet(start_worker, servers, 503)
    assert isinstance(ended, TaskFailed), ended
    assert "all 2 workers are down" in str(ended)


def test_close_during_a_handover_returns_and_leaves_no_thread(start_worker, servers) -> None:
    """close() while the new worker's first check hangs: returns, no pool thread left."""
    import threading
    import time

    old = start_worker(worker_id="w1")
    gate = threading.Event()
    new = _gated_worker(servers, gate, 200)
    pool = WorkerPool(_health_config([("w1", old.url)]))
    try:
        pool.reload(_health_config([("w4", new.url())]))
        assert pool.stats()["reloads"]["handover"]["awaited"] == ["w4"]
        assert pool.execute({"model_id": "default", "input_text": "x"}, timeout=10)
    finally:
        start = time.monotonic()
        pool.close()
        took = time.monotonic() - start
        gate.set()
    assert took < 5  # the health check's own timeout is 2 s
    left = [t for t in threading.enumerate() if t.name.startswith("npu-sync")]
    for thread in left:
        thread.join(2)
    assert not [t.name for t in left if t.is_alive()]
