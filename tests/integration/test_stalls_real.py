"""The stall limit against real sockets: a worker process frozen with SIGSTOP, a worker
that drips its answer, a heavy task on a fast worker. Reference workers are child
processes on 127.0.0.1; the dripping worker is a raw-socket server."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any

import pytest

from npu_sync import Task, WorkerPool
from npu_sync._stall import MIN_SAMPLES
from npu_sync.config import (
    BalancingConfig,
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    RetryConfig,
    StallConfig,
    TimeoutConfig,
    TransportConfig,
    worker_config,
)
from npu_sync.events import AttemptFinished
from npu_sync.testing import FakeClock
from tests.hostile import Peer, answer, serve

pytestmark = pytest.mark.integration

PAYLOAD = {"model_id": "default", "input_text": "x"}
READ = 20.0  # the default timeouts.read: what a frozen worker held each task for


def config(
    *urls: str, strategy: str = "least-loaded", client: str = "builtin", **timeouts: float
) -> PoolConfig:
    return PoolConfig(
        transport=TransportConfig(client=client),
        workers=tuple(worker_config(f"w{i}", url, max_concurrent=8) for i, url in enumerate(urls)),
        health=HealthConfig(enabled=False),
        timeouts=TimeoutConfig(**timeouts),
        balancing=BalancingConfig(strategy=strategy),
    )


def rows(pool: WorkerPool) -> dict[str, dict[str, Any]]:
    return {w["id"]: w for w in pool.workers()}


def warm(pool: WorkerPool, ids: list[str]) -> None:
    """Tasks until every worker named has answered enough for a figure of its own."""
    for _ in range(20 * MIN_SAMPLES):
        pool.execute(PAYLOAD)
        if all(rows(pool)[w]["tasks"]["succeeded"] >= MIN_SAMPLES for w in ids):
            return
    raise AssertionError(f"not every worker answered {MIN_SAMPLES} tasks: {rows(pool)}")


@pytest.mark.parametrize("client", ["builtin", "urllib3"])
def test_tasks_on_a_sigstopped_worker_end_long_before_the_read_timeout(start_worker, client):
    """Default timeouts; one of two workers frozen with SIGSTOP while eight tasks are
    sent at once: every task returns a result, none waited anywhere near the 20 s
    read timeout, and the frozen worker's cut attempts say they stalled. With urllib3,
    which cannot tell silence, the limit bounds the whole attempt instead."""
    frozen, live = start_worker(worker_id="frozen"), start_worker(worker_id="live")
    pool = WorkerPool(config(frozen.url, live.url, strategy="round-robin", client=client))
    try:
        warm(pool, ["w0", "w1"])
        frozen.pause()
        started = time.monotonic()
        futures = [pool.submit(Task(PAYLOAD)) for _ in range(8)]
        ended: list[float] = []
        for future in futures:
            assert future.result(timeout=READ + 10)["worker_id"] == "live"
            ended.append(time.monotonic() - started)
        assert max(ended) < READ / 4, ended
        row = rows(pool)["w0"]
        assert row["tasks"]["failed"] >= 1
        assert "stalled" in row["last_error"]
    finally:
        frozen.resume()
        pool.close()


def test_a_worker_that_drips_its_answer_is_not_cut(servers):
    """Silence, not total time: after fast answers (a limit of 1 s), a worker sends an
    answer of about 90 bytes a byte every 40 ms, for more than 3 s. It keeps sending,
    so the attempt runs to its end and succeeds; nothing is charged."""
    drip = threading.Event()
    body = json.dumps({"response": "steady"}).encode()

    def behaviour(peer: Peer) -> None:
        while peer.request() is not None:
            raw = answer(200, body)
            ok = peer.drip(raw, 0.04) if drip.is_set() else peer.send(raw)
            if not ok:
                return

    server = serve(servers, behaviour, nodelay=True)
    pool = WorkerPool(config(server.url(), read=10.0, task=15.0))
    try:
        warm(pool, ["w0"])
        drip.set()
        started = time.monotonic()
        assert pool.execute(PAYLOAD)["response"] == "steady"
        took = time.monotonic() - started
        assert took > 2.0  # well past the 1 s of silence allowed
        row = rows(pool)["w0"]
        assert (row["tasks"]["failed"], row["breaker"]["failures"]) == (0, 0)
    finally:
        pool.close()


def test_a_heavy_task_with_a_long_declared_timeout_runs_on_a_fast_worker(start_worker):
    """A worker that answers in a few milliseconds takes 3 s for one task declared with
    a 10 s timeout: the task may be silent 5 s, so it runs to its end on its first
    attempt and nothing is charged."""
    worker = start_worker(worker_id="fast")
    pool = WorkerPool(config(worker.url))
    try:
        warm(pool, ["w0"])
        worker.control(latency_ms=3000)
        started = time.monotonic()
        assert pool.execute(Task(PAYLOAD, timeout=10.0))["worker_id"] == "fast"
        assert time.monotonic() - started >= 3.0
        row = rows(pool)["w0"]
        assert (row["tasks"]["failed"], row["tasks"]["abandoned"]) == (0, 0)
    finally:
        pool.close()


def test_a_forked_child_keeps_what_its_parent_learnt_and_cuts_a_frozen_worker(start_worker):
    """A pool warmed in the parent, then forked (as gunicorn --preload does): in the
    child, a task on the frozen worker is cut at the parent's learnt limit, not held
    for the read timeout, and the task succeeds on the other worker."""
    from tests.integration.test_fork import run_in_child

    frozen, live = start_worker(worker_id="frozen"), start_worker(worker_id="live")
    pool = WorkerPool(config(frozen.url, live.url, strategy="round-robin"))
    try:
        warm(pool, ["w0", "w1"])
        frozen.pause()

        def child() -> dict[str, Any]:
            started = time.monotonic()
            results = [pool.execute(PAYLOAD)["worker_id"] for _ in range(2)]
            took = time.monotonic() - started
            pool.close()
            return {"results": results, "took": took}

        report = run_in_child(child, timeout=READ + 10)
        assert report["results"] == ["live", "live"]
        assert report["took"] < READ / 4
    finally:
        frozen.resume()
        pool.close()


def test_a_worker_that_stops_in_the_middle_of_its_answer_is_cut(servers):
    """Silence counts between any two bytes: a worker that sends its status line,
    headers and half its body, then nothing, is cut after the limit (not the 10 s read
    timeout) and the task runs on the other worker; the first is charged once."""
    hang = threading.Event()
    body = json.dumps({"response": "whole", "worker_id": "w0"}).encode()

    def behaviour(peer: Peer) -> None:
        while peer.request() is not None:
            raw = answer(200, body)
            if hang.is_set():
                peer.send(raw[: len(raw) - len(body) // 2])
                peer.hold()
                return
            if not peer.send(raw):
                return

    def other(peer: Peer) -> None:
        while peer.request() is not None:
            if not peer.send(answer(200, json.dumps({"worker_id": "w1"}).encode())):
                return

    first, second = serve(servers, behaviour), serve(servers, other)
    pool = WorkerPool(
        config(first.url(), second.url(), strategy="round-robin", read=10.0, task=15.0)
    )
    try:
        warm(pool, ["w0", "w1"])
        hang.set()
        started = time.monotonic()
        results = [pool.execute(PAYLOAD)["worker_id"] for _ in range(2)]
        assert results == ["w1", "w1"]
        assert time.monotonic() - started < 10.0 / 2
        row = rows(pool)["w0"]
        assert "stalled" in row["last_error"]
    finally:
        pool.close()


def test_a_trial_on_a_frozen_worker_ends_at_the_trial_deadline_whatever_the_task(start_worker):
    """A worker that answered in milliseconds opens, then is frozen with SIGSTOP; the
    stall rule is off and the read timeout 8 s. Each time its trial comes (a fake clock
    moves past the reset timeout), the task that meets it returns from the other worker
    within a few seconds, not 8: an idempotent one is cut on the frozen worker at the
    1 s trial deadline; a non-idempotent one is never sent there, the worker's health
    check, cut at the deadline, being the trial."""
    read = 8.0
    clock = FakeClock()  # the breaker's time; the sockets keep real time
    frozen, live = start_worker(worker_id="frozen"), start_worker(worker_id="live")
    cfg = dataclasses.replace(
        config(frozen.url, live.url, strategy="round-robin", read=read, task=60.0),
        retry=RetryConfig(backoff_initial=0.0, backoff_max=0.0, stall=StallConfig(enabled=False)),
        circuit_breaker=BreakerConfig(fail_max=1, reset_timeout=30, max_reset_timeout=30),
    )
    attempts: list[tuple[str, str | None]] = []

    def hook(event: object) -> None:
        if isinstance(event, AttemptFinished):
            attempts.append((event.worker_id, event.error))

    pool = WorkerPool(cfg, clock=clock, hooks=[hook])
    try:
        warm(pool, ["w0", "w1"])
        frozen.control(failure_rate=1.0)
        while rows(pool)["w0"]["breaker"]["state"] != "open":
            pool.execute(PAYLOAD)
        frozen.control(failure_rate=0.0)
        frozen.pause()
        for task, trial in (
            (Task(PAYLOAD), "trial: no answer within 1s"),
            (Task(PAYLOAD, idempotent=False), "trial: health check failed within 1s"),
        ):
            clock.advance(31.0)  # w0's trial is due
            attempts.clear()
            for _ in range(4):
                started = time.monotonic()
                assert pool.execute(task)["worker_id"] == "live"
                took = time.monotonic() - started
                if any(wid == "w0" for wid, _ in attempts):
                    break
            [(_, error)] = [a for a in attempts if a[0] == "w0"]
            assert error is not None and trial in error
            assert took < read / 2, took
            assert rows(pool)["w0"]["breaker"]["state"] == "open"
    finally:
        frozen.resume()
        pool.close()
