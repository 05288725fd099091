"""Learned limits against real HTTP workers on loopback: a worker with admission of its
own (it answers 429 past two tasks at once) is kept near its room by AIMD and by
gradient2, and no task is lost while they learn it."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from npu_sync import WorkerPool
from npu_sync.config import (
    BalancingConfig,
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    RetryBudgetConfig,
    RetryConfig,
    worker_config,
)
from npu_sync.events import Event, WorkerLimitChanged
from tests.hostile import Hostile, Seen, answer, keep_answering, serve

OK = {"model_id": "default", "input_text": "hi"}


class Admitting:
    """A worker that runs at most ``room`` tasks at once (each taking ``seconds``) and
    answers 429 to any task beyond; counts what it ran and refused."""

    def __init__(self, name: str, room: int, seconds: float, stop: threading.Event) -> None:
        self.name = name
        self.room = room
        self.seconds = seconds
        self.stop = stop
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.refused = 0
        self.ran = 0

    def __call__(self, seen: Seen) -> bytes:
        with self.lock:
            if self.running >= self.room:
                self.refused += 1
                return answer(429, b'{"detail": "busy"}')
            self.running += 1
            self.most = max(self.most, self.running)
        self.stop.wait(self.seconds)  # the task's own work
        with self.lock:
            self.running -= 1
            self.ran += 1
        return answer(200, b'{"worker_id": "%s"}' % self.name.encode())


@pytest.mark.parametrize("limit", ["aimd", "gradient2"])
def test_a_worker_with_its_own_admission_is_kept_near_its_room(servers, limit):
    """Eight callers, a worker admitting two at a time and a backup, tasks of 10 ms:
    every task ends with a result, the worker's limit is cut from 4 at its first
    refusal and further down to its room (one cut a window), and the capacity it ends
    with is within a step of its room."""
    stop = threading.Event()
    admitting = Admitting("a", room=2, seconds=0.01, stop=stop)
    a = serve(servers, keep_answering(admitting))
    backup = Admitting("b", room=100, seconds=0.01, stop=stop)
    b: Hostile = serve(servers, keep_answering(backup))
    cfg = PoolConfig(
        workers=(
            worker_config("a", a.url(), priority=1, max_concurrent=8),
            worker_config("b", b.url(), priority=2, max_concurrent=8),
        ),
        # Every refusal is retried on the backup: the budget must not be what ends a task.
        balancing=BalancingConfig(
            concurrency_limit=limit, retry_budget=RetryBudgetConfig(1.0, 10_000.0)
        ),
        circuit_breaker=BreakerConfig(fail_max=10_000),
        retry=RetryConfig(max_retries=3, backoff_initial=0.001, backoff_max=0.002),
        health=HealthConfig(enabled=False),
    )
    events: list[Event] = []
    try:
        with WorkerPool(cfg, hooks=[events.append]) as pool:
            with ThreadPoolExecutor(8) as callers:
                results = list(callers.map(lambda _: pool.execute(OK), range(800)))
            capacity = {row["id"]: row["capacity"] for row in pool.workers()}
    finally:
        stop.set()
    assert len(results) == 800 and {r["worker_id"] for r in results} <= {"a", "b"}
    assert admitting.ran > 0 and admitting.most <= 2
    moves = [
        (e.old, e.new) for e in events if isinstance(e, WorkerLimitChanged) and e.worker_id == "a"
    ]
    assert moves and moves[0] == (4, 3)  # the first refusal cut it at once
    assert min(new for _, new in moves) <= 2 and capacity["a"] <= 3
    # Kept under its room most of the time: refusals come only when a window grew it.
    assert admitting.refused < admitting.ran


class Ledger(Admitting):
    """An :class:`Admitting` worker that also records which task each run served, and
    the most requests it was sent at once, refused ones included."""

    def __init__(self, name: str, room: int, seconds: float, stop: threading.Event) -> None:
        super().__init__(name, room, seconds, stop)
        self.served: list[int] = []
        self.arrived = 0
        self.most_sent = 0

    def __call__(self, seen: Seen) -> bytes:
        with self.lock:
            self.arrived += 1
            self.most_sent = max(self.most_sent, self.arrived)
        try:
            reply = super().__call__(seen)
        finally:
            with self.lock:
                self.arrived -= 1
        if b" 200 " in reply.split(b"\r\n", 1)[0]:
            with self.lock:
                self.served.append(int(json.loads(seen.body)["input_text"]))
        return reply


def test_reloads_of_limit_and_strategy_under_load_lose_and_repeat_no_task(servers):
    """16 callers, two real workers admitting three at a time (429 past that) and a
    roomy backup, while a thread reloads the pool through every limit and strategy:
    every task ends with its own result, each ran exactly once, no worker was ever
    sent more than its max_concurrent at once, and nothing is left in flight."""
    import itertools

    from npu_sync.config import CONCURRENCY_LIMITS, STRATEGIES

    stop = threading.Event()
    ledgers = {
        "a": Ledger("a", room=3, seconds=0.005, stop=stop),
        "b": Ledger("b", room=3, seconds=0.005, stop=stop),
        "c": Ledger("c", room=100, seconds=0.005, stop=stop),
    }
    urls = {name: serve(servers, keep_answering(ledger)).url() for name, ledger in ledgers.items()}

    def build(limit: str, strategy: str) -> PoolConfig:
        return PoolConfig(
            workers=(
                worker_config("a", urls["a"], priority=1, max_concurrent=4),
                worker_config("b", urls["b"], priority=1, max_concurrent=4),
                worker_config("c", urls["c"], priority=2, max_concurrent=16),
            ),
            balancing=BalancingConfig(
                concurrency_limit=limit,
                strategy=strategy,
                retry_budget=RetryBudgetConfig(1.0, 10_000.0),
            ),
            circuit_breaker=BreakerConfig(fail_max=10_000),
            retry=RetryConfig(max_retries=8, backoff_initial=0.001, backoff_max=0.002),
            health=HealthConfig(enabled=False),
        )

    choices = itertools.cycle(
        [(limit, strategy) for strategy in STRATEGIES for limit in CONCURRENCY_LIMITS]
    )
    reloads = [0]
    errors: list[BaseException] = []
    callers_done = threading.Event()
    try:
        with WorkerPool(build("aimd", "least-loaded")) as pool:

            def reloader() -> None:
                while not callers_done.is_set():
                    try:
                        pool.reload(build(*next(choices)))
                    except BaseException as exc:  # the test reports it
                        errors.append(exc)
                        return
                    reloads[0] += 1

            churn = threading.Thread(target=reloader)
            churn.start()
            try:
                with ThreadPoolExecutor(16) as callers:
                    results = list(
                        callers.map(
                            lambda i: pool.execute({"model_id": "default", "input_text": str(i)}),
                            range(600),
                        )
                    )
            finally:
                callers_done.set()
                churn.join(30.0)
            assert not churn.is_alive() and errors == []
            rows = pool.workers()
            in_flight = pool.stats()["tasks"]["in_flight"]
    finally:
        stop.set()
    assert reloads[0] > 0
    assert [r["worker_id"] for r in results if r["worker_id"] not in ledgers] == []
    ran = sorted(i for ledger in ledgers.values() for i in ledger.served)
    assert ran == list(range(600))  # each task ran once: none lost, none repeated
    # The pool never sent a worker more than its max_concurrent at once.
    assert max(ledgers["a"].most_sent, ledgers["b"].most_sent) <= 4
    assert ledgers["c"].most_sent <= 16
    assert in_flight == 0 and all(row["in_flight"] == 0 for row in rows)
