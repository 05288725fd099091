"""close() with a hedge in flight to a real, frozen worker process: close() waits for
the hedge threads, the hedge is cancelled rather than left to its read timeout, and no
hedge thread is left."""

from __future__ import annotations

import gc
import os
import threading
import time
import warnings
import weakref
from dataclasses import replace
from typing import Any

import pytest

from npu_sync import Task, TaskFailed, TaskRejected, WorkerPool
from npu_sync.config import (
    BalancingConfig,
    BreakerConfig,
    HealthConfig,
    HedgeConfig,
    PoolConfig,
    PoolSettings,
    RetryBudgetConfig,
    TimeoutConfig,
    TransportConfig,
    worker_config,
)
from npu_sync.events import AttemptFinished, AttemptHedged, Event
from tests.hostile import Hostile, Peer, answer, keep_answering
from tests.integration.test_fork import run_in_child

pytestmark = pytest.mark.integration


def hedge_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("npu-sync-hedge")]


def test_close_with_a_hedge_in_flight_joins_it_and_leaves_no_hedge_thread(start_worker):
    """The task's first attempt waits on a paused worker, its hedge on a frozen one;
    close() is called and the first worker answers: the hedge is cancelled, close()
    returns only once the hedge's thread is done, and no npu-sync-hedge thread is alive."""
    fast, frozen = start_worker(worker_id="fast"), start_worker(worker_id="frozen")
    fast.pause()
    frozen.pause()
    config = PoolConfig(
        # Tiers: the first attempt goes to "fast", the hedge to "frozen".
        workers=(
            worker_config("fast", fast.url, priority=1),
            worker_config("frozen", frozen.url, priority=2),
        ),
        health=HealthConfig(enabled=False),
        # A read timeout far beyond close()'s budget for its threads (5 s): a hedge
        # left to wait for the frozen worker would still be alive after close().
        timeouts=TimeoutConfig(read=120.0, task=240.0),
        balancing=BalancingConfig(hedge=HedgeConfig(enabled=True, delay=0.01)),
    )
    hedged = threading.Event()
    release = threading.Event()  # lets the cancelled hedge's thread finish
    hedge_done = threading.Event()
    finished: list[tuple[str, str, str]] = []

    def hook(event: Event) -> None:
        if isinstance(event, AttemptHedged):
            hedged.set()
        elif isinstance(event, AttemptFinished):
            finished.append((event.worker_id, event.outcome, threading.current_thread().name))
            if event.worker_id == "frozen":
                # The hedge's own thread, after its attempt was cancelled: still busy
                # when the task has returned.
                release.wait(60)
                hedge_done.set()

    pool = WorkerPool(config, hooks=[hook])
    answers: list[Any] = []
    done_when_closed: list[bool] = []

    def close() -> None:
        pool.close()
        done_when_closed.append(hedge_done.is_set())

    caller = threading.Thread(
        target=lambda: answers.append(pool.execute({"model_id": "default", "input_text": "x"}))
    )
    closer = threading.Thread(target=close)
    try:
        caller.start()
        assert hedged.wait(30), "no hedge was sent"
        closer.start()  # waits for the task, which waits for a worker
        fast.resume()
        caller.join(60)
        assert [a["worker_id"] for a in answers] == ["fast"]
        # A close() that does not wait for the hedge's thread returns meanwhile.
        closer.join(0.5)
        release.set()
        closer.join(60)
        assert not closer.is_alive(), "close() did not return"
        assert done_when_closed == [True]
        assert hedge_threads() == []
    finally:
        release.set()
        fast.resume()
        frozen.resume()
        pool.close()
        caller.join(60)
    assert [(wid, outcome) for wid, outcome, _ in sorted(finished)] == [
        ("fast", "success"),
        ("frozen", "abandoned"),
    ]
    assert next(name for wid, _, name in finished if wid == "frozen").startswith("npu-sync-hedge")


# Attacks on hedging and close(): close() from the hedge threads' own hooks, a loser whose
# answer still arrives after the hedge won, close() from several threads while hedges are
# in flight to a frozen worker, a pool dropped unclosed, many open/close cycles, a fork
# while a hedge runs.


PAYLOAD = {"model_id": "default", "input_text": "x"}


# Room for every task in these tests: no hedge is skipped for want of a token.
GENEROUS = RetryBudgetConfig(ratio=1.0, min_per_second=100.0)


def npu_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("npu-sync"))


def no_npu_threads_left(timeout: float = 10.0) -> list[str]:
    """The npu-sync threads still alive once each had ``timeout`` to end."""
    for thread in threading.enumerate():
        if thread.name.startswith("npu-sync"):
            thread.join(timeout)
    return npu_threads()


def hedged_config(
    first: str,
    second: str,
    *,
    client: str = "builtin",
    read: float = 30.0,
    task: float = 4.0,
    **balancing: Any,
) -> PoolConfig:
    """Two workers in two tiers: every first attempt goes to ``w0``, every hedge to
    ``w1``; a hedge 10 ms after the first attempt began."""
    return PoolConfig(
        workers=(
            worker_config("w0", first, priority=1, max_concurrent=32),
            worker_config("w1", second, priority=2, max_concurrent=32),
        ),
        health=HealthConfig(enabled=False),
        timeouts=TimeoutConfig(read=read, task=task),
        transport=TransportConfig(client=client),
        circuit_breaker=BreakerConfig(fail_max=1000, reset_timeout=60),
        balancing=BalancingConfig(
            hedge=HedgeConfig(enabled=True, delay=0.01),
            retry_budget=GENEROUS,
            **balancing,
        ),
    )


@pytest.fixture
def servers():
    """Raw-socket loopback servers, closed at teardown."""
    started: list[Hostile] = []
    yield started
    for server in started:
        server.close()


def serve(servers: list[Hostile], behaviour: Any) -> Hostile:
    server = Hostile(behaviour, nodelay=True)
    servers.append(server)
    return server


def says(worker_id: str) -> Any:
    """A worker that answers every request at once, naming itself."""
    body = f'{{"worker_id": "{worker_id}"}}'.encode()
    return keep_answering(lambda _seen: answer(200, body))


def holds(peer: Peer) -> None:
    """A frozen worker: reads the request and never answers."""
    if peer.request() is not None:
        peer.hold()


def outcome_of(pool: WorkerPool) -> Any:
    """The task's result, or the TaskFailed / TaskRejected it ended in."""
    try:
        return pool.execute(PAYLOAD)
    except (TaskFailed, TaskRejected) as exc:
        return exc


def test_close_from_a_hook_on_the_hedge_thread_returns_and_the_hedge_answer_is_returned(
    servers,
):
    """A hook that closes the pool when the hedge's attempt finishes (on the hedge's
    thread) returns at once, as close() from any hook does, and the task returns the
    hedge's answer, which won."""
    frozen, fast = serve(servers, holds), serve(servers, says("w1"))
    closed_from_hook = threading.Event()
    pool: WorkerPool

    def hook(event: Event) -> None:
        if isinstance(event, AttemptFinished) and event.worker_id == "w1":
            assert threading.current_thread().name.startswith("npu-sync-hedge")
            pool.close()
            closed_from_hook.set()

    pool = WorkerPool(hedged_config(frozen.url(), fast.url(), task=2.0), hooks=[hook])
    try:
        outcome = [outcome_of(pool)]
    finally:
        pool.close()
    assert closed_from_hook.is_set()
    assert outcome == [{"worker_id": "w1"}]
    assert no_npu_threads_left() == []


def test_close_from_a_hook_on_the_timer_thread_lets_the_hedge_answer(servers):
    """A hook that closes the pool on ``attempt.hedged`` (on the timer thread) returns
    at once; the hedge is then sent, and when the first attempt fails (HTTP 500) the
    task returns the hedge's answer."""
    hedged = threading.Event()

    def fails_once_hedged(peer: Peer) -> None:
        if peer.request() is not None and hedged.wait(30):
            peer.send(answer(500, b'{"detail": "boom"}'))

    first, second = serve(servers, fails_once_hedged), serve(servers, says("w1"))
    pool: WorkerPool

    def hook(event: Event) -> None:
        if isinstance(event, AttemptHedged):
            assert threading.current_thread().name == "npu-sync-hedge-timer"
            hedged.set()
            pool.close()

    pool = WorkerPool(hedged_config(first.url(), second.url(), task=2.0), hooks=[hook])
    try:
        outcome = [outcome_of(pool)]
    finally:
        hedged.set()
        pool.close()
    assert outcome == [{"worker_id": "w1"}]
    assert no_npu_threads_left() == []


def late_winner_servers(servers: list[Hostile], client: str) -> tuple[Hostile, Hostile, Any]:
    """``w0`` answers only once the hedge to ``w1`` has succeeded; with urllib3 it
    sends its head at once, so that its attempt is reading the body when the hedge
    wins (where urllib3 cannot cancel)."""
    hedge_won = threading.Event()

    def slow(peer: Peer) -> None:
        if peer.request() is None:
            return
        body = b'{"worker_id": "w0"}'
        whole = answer(200, body)
        head = whole[: len(whole) - len(body)]
        if client == "urllib3" and not peer.send(head):
            return
        if hedge_won.wait(30):
            peer.send(body if client == "urllib3" else whole)

    def hook(event: Event) -> None:
        if isinstance(event, AttemptFinished) and (event.worker_id, event.outcome) == (
            "w1",
            "success",
        ):
            hedge_won.set()

    return serve(servers, slow), serve(servers, says("w1")), hook


@pytest.mark.parametrize("client", ["requests", "urllib3"])
def test_a_losers_late_success_is_dropped_and_the_winners_answer_returned(servers, client):
    """On a transport that cannot cancel the first attempt, the hedge answers first and
    wins; the first attempt's answer, arriving after, is dropped: the task returns the
    hedge's answer, the hedge counts as won, and the first attempt is abandoned."""
    first, second, hook = late_winner_servers(servers, client)
    pool = WorkerPool(hedged_config(first.url(), second.url(), client=client), hooks=[hook])
    try:
        result = pool.execute(PAYLOAD)
    finally:
        pool.close()
    hedge = pool.stats()["balancing"]["hedge"]
    rows = {w["id"]: w["tasks"] for w in pool.workers()}
    # Whichever answer is returned, the counter must say whose it was.
    assert (hedge["hedged"], hedge["won"]) == (1, 1 if result["worker_id"] == "w1" else 0)
    assert result == {"worker_id": "w1"}
    assert (rows["w0"]["succeeded"], rows["w0"]["abandoned"]) == (0, 1)


def test_close_from_many_threads_with_hedges_in_flight_to_a_frozen_worker(start_worker):
    """Tasks whose first attempts wait on a SIGSTOPped worker are hedged to a live one;
    four threads close the pool at once: every call returns, every task ends in exactly
    one of the three ways (a dead letter stored for a failure), the live worker is never
    charged, and no thread of the pool is left."""
    frozen, live = start_worker(worker_id="frozen"), start_worker(worker_id="live")
    frozen.pause()
    config = replace(
        hedged_config(frozen.url, live.url, read=1.0, task=3.0), pool=PoolSettings(threads=16)
    )
    hedges = threading.Semaphore(0)

    def hook(event: Event) -> None:
        if isinstance(event, AttemptHedged):
            hedges.release()

    pool = WorkerPool(config, hooks=[hook])
    tasks = [Task(PAYLOAD) for _ in range(16)]
    futures = [pool.submit(task) for task in tasks]
    try:
        assert hedges.acquire(timeout=30), "no hedge was sent"
        barrier = threading.Barrier(4)
        errors: list[BaseException] = []

        def close() -> None:
            barrier.wait()
            try:
                pool.close()
            except BaseException as exc:
                errors.append(exc)

        closers = [threading.Thread(target=close) for _ in range(4)]
        for closer in closers:
            closer.start()
        for closer in closers:
            closer.join(60)
        assert not any(c.is_alive() for c in closers), "a close() did not return"
        assert errors == []
    finally:
        frozen.resume()
        pool.close()
    kinds = []
    for task, future in zip(tasks, futures, strict=True):
        assert future.done()
        try:
            future.result(0)
            kinds.append("result")
        except TaskRejected:
            kinds.append("rejected")
        except TaskFailed as exc:
            kinds.append("failed")
            record = pool.dead_letters.get(exc.dead_letter_id)
            assert record is not None and record.task_id == task.task_id
    assert len(kinds) == len(tasks)
    assert "rejected" not in kinds
    rows = {w["id"]: w for w in pool.workers()}
    assert rows["w1"]["tasks"]["failed"] == 0  # the live worker, hedged to
    assert rows["w1"]["breaker"]["state"] == "closed"
    assert pool.stats()["balancing"]["hedge"]["hedged"] >= 1
    assert no_npu_threads_left() == []


def test_many_open_close_cycles_with_hedging_leave_no_thread(start_worker):
    """Twenty pools, each hedging tasks from a slow worker process to a fast one, then
    closed: once each close() returns, none of its threads is alive, so the thread
    count does not grow from cycle to cycle."""
    slow = start_worker(worker_id="slow", latency_ms=300)
    fast = start_worker(worker_id="fast")
    before = npu_threads()
    hedged = 0
    for _ in range(20):
        pool = WorkerPool(hedged_config(slow.url, fast.url, task=10.0))
        try:
            results = list(pool.map([PAYLOAD] * 4))
            hedged += pool.stats()["balancing"]["hedge"]["hedged"]
        finally:
            pool.close()
        assert {r["worker_id"] for r in results} <= {"slow", "fast"}
        assert npu_threads() == before
    assert hedged >= 20


def test_a_pool_dropped_unclosed_with_hedge_threads_lets_them_go(start_worker):
    """A pool whose hedge timer and hedge threads are running, dropped without close(),
    is collected with a ResourceWarning and its hedge threads end."""
    slow = start_worker(worker_id="slow", latency_ms=300)
    fast = start_worker(worker_id="fast")

    def run() -> weakref.ref[WorkerPool]:
        pool = WorkerPool(hedged_config(slow.url, fast.url, task=10.0))
        assert pool.execute(PAYLOAD)["worker_id"] == "fast"
        assert pool.stats()["balancing"]["hedge"]["hedged"] >= 1
        assert any(name.startswith("npu-sync-hedge-") for name in npu_threads())
        return weakref.ref(pool)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref = run()
        give_up = time.monotonic() + 10
        while ref() is not None and time.monotonic() < give_up:
            gc.collect()
            threading.Event().wait(0.01)
        hedge_threads = [t for t in threading.enumerate() if t.name.startswith("npu-sync-hedge")]
        for thread in hedge_threads:
            thread.join(10)
        messages = [str(w.message) for w in caught]
        # The warning's source is the pool itself: let it go, and the connections it
        # leaves to the collector with it, while warnings are still recorded here.
        caught.clear()
        gc.collect()
    assert ref() is None
    assert any("unclosed <WorkerPool" in m for m in messages)
    assert [t.name for t in hedge_threads if t.is_alive()] == []


def test_a_child_forked_while_a_hedge_runs_hedges_on_its_own_and_closes(start_worker):
    """fork() while the parent's hedge thread is in the middle of its hedge (held in a
    hook): the child has no hedge of the parent's, hedges its own task (first attempt to
    a frozen worker process, hedge to a live one), counts only its own hedge, and
    closes promptly with no thread left; the parent's task then ends normally."""
    frozen, live = start_worker(worker_id="frozen"), start_worker(worker_id="live")
    frozen.pause()
    parent = os.getpid()
    in_hook, gate = threading.Event(), threading.Event()

    def hook(event: Event) -> None:
        # w1: the live worker, hedged to
        if os.getpid() == parent and isinstance(event, AttemptFinished) and event.worker_id == "w1":
            in_hook.set()
            gate.wait(30)

    pool = WorkerPool(hedged_config(frozen.url, live.url, read=20.0, task=20.0), hooks=[hook])
    try:
        running = pool.submit(PAYLOAD)
        assert in_hook.wait(30), "the parent's hedge did not run"

        def child() -> dict[str, Any]:
            at_fork = pool.stats()["balancing"]["hedge"]["hedged"]
            result = pool.execute(PAYLOAD, timeout=10)
            hedge = pool.stats()["balancing"]["hedge"]
            closer = threading.Thread(target=pool.close)
            closer.start()
            closer.join(10)
            return {
                "at_fork": at_fork,
                "result": result,
                "hedged": hedge["hedged"],
                "closed": not closer.is_alive(),
                "threads": npu_threads(),
            }

        report = run_in_child(child)
        gate.set()
        assert running.result(30)["worker_id"] == "live"
    finally:
        gate.set()
        frozen.resume()
        pool.close()
    assert report["at_fork"] == 0
    assert report["result"]["worker_id"] == "live"
    assert report["hedged"] == 1
    assert report["closed"] is True and report["threads"] == []
    assert no_npu_threads_left() == []
