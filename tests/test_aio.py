"""AsyncWorkerPool: asyncio callers on the same pool, and cancelling them at every step.

Workers are loopback servers that misbehave on purpose (tests/hostile.py) or reference
workers in their own processes. Every test waits on events or polls with a generous
deadline; none sleeps in place of a signal.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from npu_sync import (
    AsyncWorkerPool,
    NoWorkerAvailable,
    PoolClosed,
    Task,
    TaskFailed,
    WorkerPool,
)
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    ModelsConfig,
    PoolConfig,
    PoolSettings,
    RetryConfig,
    TimeoutConfig,
    TransportConfig,
    worker_config,
)
from npu_sync.events import Event, RetryScheduled, TaskCancelled
from npu_sync.worker_server import LocalWorker
from tests.hostile import Peer, answer, keep_answering, serve

PAYLOAD = {"model_id": "default", "input_text": "hi"}
OK = answer(200, b'{"response": "ok"}')
PATIENCE = 10.0  # a generous deadline for what should happen at once


def until(predicate: Callable[[], bool], timeout: float = PATIENCE) -> bool:
    """Poll ``predicate`` until true or ``timeout`` (the state it reads has no signal)."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


async def until_async(predicate: Callable[[], bool], timeout: float = PATIENCE) -> bool:
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        if predicate():
            return True
        await asyncio.sleep(0.005)
    return predicate()


def make_pool(
    urls: list[str],
    *,
    max_concurrent: int = 4,
    read: float = 30.0,
    task: float = 30.0,
    retries: int = 0,
    backoff: float = 0.01,
    max_queue_wait: float = 60.0,
    fail_max: int = 1,
    client: str = "builtin",
    hooks: tuple[Callable[[Event], None], ...] = (),
) -> WorkerPool:
    return WorkerPool(
        PoolConfig(
            workers=tuple(
                worker_config(f"w{i}", url, max_concurrent=max_concurrent)
                for i, url in enumerate(urls)
            ),
            timeouts=TimeoutConfig(connect=read, read=read, task=task),
            health=HealthConfig(enabled=False),
            retry=RetryConfig(max_retries=retries, backoff_initial=backoff, backoff_max=backoff),
            circuit_breaker=BreakerConfig(
                fail_max=fail_max, reset_timeout=60, max_reset_timeout=600
            ),
            pool=PoolSettings(max_queue_wait=max_queue_wait),
            transport=TransportConfig(client=client),
        ),
        hooks=hooks,
    )


def row(pool: WorkerPool, worker_id: str = "w0") -> Any:
    (found,) = [w for w in pool.workers() if w["id"] == worker_id]
    return found


def check_untouched(pool: WorkerPool) -> None:
    """Nothing in flight or waiting, no worker charged, every breaker closed, no dead
    letter: what a cancelled or stopped task must leave."""
    for worker in pool.workers():
        assert worker["in_flight"] == 0, worker
        assert worker["tasks"]["failed"] == 0, worker
        assert worker["breaker"]["state"] == "closed", worker
    tasks = pool.stats()["tasks"]
    assert tasks["waiting"] == 0 and tasks["active"] == 0, tasks
    assert pool.dead_letters.list() == []


def aio_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("npu-sync-aio")]


class Requests:
    """A hostile behaviour's view from the test: an event per request received."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.count = 0

    def seen(self) -> None:
        with self.cond:
            self.count += 1
            self.cond.notify_all()

    def wait(self, n: int = 1) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.count >= n, PATIENCE)


def holding(requests: Requests) -> Callable[[Peer], None]:
    """A worker that reads the request and never answers."""

    def behaviour(peer: Peer) -> None:
        if peer.request() is not None:
            requests.seen()
            peer.hold()

    return behaviour


def until_hung_up(requests: Requests) -> Callable[[Peer], None]:
    """A worker that reads the request and never answers; it lets the connection go
    (and counts it closed) as soon as the client hangs up."""

    def behaviour(peer: Peer) -> None:
        if peer.request() is not None:
            requests.seen()
            peer.wait_readable()

    return behaviour


def dripping(requests: Requests) -> Callable[[Peer], None]:
    """A worker that answers a byte every 50 ms: a whole answer takes seconds."""

    def behaviour(peer: Peer) -> None:
        if peer.request() is not None:
            requests.seen()
            peer.drip(answer(200, b'{"response": "' + b"x" * 200 + b'"}'), 0.05)

    return behaviour


@pytest.fixture
def worker() -> Iterator[LocalWorker]:
    """One reference worker in its own process."""
    with LocalWorker(worker_id="w0").start() as local:
        yield local


# -- what a caller gets --------------------------------------------------------------


def test_execute_map_and_the_decorator_return_the_workers_answers(worker):
    """execute, map (in order, within its window) and an async task function return
    what the worker answered."""

    async def main() -> None:
        async with AsyncWorkerPool(make_pool([worker.url]), close_pool=True) as apool:
            one = await apool.execute(PAYLOAD)
            assert one["worker_id"] == "w0"
            texts = [f"t{i}" for i in range(20)]
            tasks = ({"model_id": "default", "input_text": t} for t in texts)
            answers = [a async for a in apool.map(tasks, window=3)]
            assert [a["response"].rsplit(": ", 1)[1] for a in answers] == texts

            @apool.task(timeout=5.0)
            def analyze(text: str) -> dict[str, str]:
                return {"model_id": "default", "input_text": text}

            assert (await analyze("hello"))["response"].endswith(": hello")
            assert apool.pool.stats()["tasks"]["succeeded"] == 22

    asyncio.run(main())
    assert not aio_threads()


def test_trace_true_is_the_awaiting_tasks_last_trace(worker):
    """execute(trace=True) on the async pool: last_trace() in the coroutine that awaited
    it is the task's trace; a Trace of the caller's own is filled; anything else is a
    TypeError before the task is handed over."""
    from npu_sync.trace import Trace, last_trace

    async def main() -> None:
        async with AsyncWorkerPool(make_pool([worker.url]), close_pool=True) as apool:
            await apool.execute(Task(PAYLOAD, task_id="t-aio"), trace=True)
            made = last_trace()
            assert made is not None and made.task_id == "t-aio" and made.workers == ["w0"]
            own = Trace()
            await apool.execute(PAYLOAD, trace=own)
            assert own.workers == ["w0"] and last_trace() is made
            with pytest.raises(TypeError, match="trace: expected a Trace, True or False"):
                await apool.execute(PAYLOAD, trace="yes")  # type: ignore[arg-type]
            assert apool.pool.stats()["tasks"]["succeeded"] == 2

    asyncio.run(main())
    assert not aio_threads()


def test_bad_thread_counts_are_refused_naming_the_value():
    """threads must be an integer in 1..4096; the error names the key and the value."""
    pool = make_pool(["http://127.0.0.1:9"])
    try:
        for bad in (0, 5000, 2.5, True):
            with pytest.raises(ValueError, match=rf"threads: .*{bad!r}"):
                AsyncWorkerPool(pool, threads=bad)  # type: ignore[arg-type]
    finally:
        pool.close()
    # Refused before a pool is built from the file: no pool, no thread left behind.
    with pytest.raises(ValueError, match=r"threads: must be 1\.\.4096, got 0"):
        AsyncWorkerPool.from_yaml("/nonexistent/npu_workers.yaml", threads=0)


# -- cancelling the awaiting task, at each step ----------------------------------------


def test_cancel_while_waiting_for_a_thread_never_starts_the_task(servers):
    """A task cancelled while it waits for one of the pool's threads is never sent."""
    requests = Requests()
    server = serve(servers, holding(requests))
    pool = make_pool([server.url()])

    async def main() -> None:
        apool = AsyncWorkerPool(pool, threads=1)
        first = asyncio.ensure_future(apool.execute(PAYLOAD))
        assert await asyncio.to_thread(requests.wait, 1)
        second = asyncio.ensure_future(apool.execute(PAYLOAD))
        await until_async(lambda: apool.in_flight() == 2)
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        assert apool.in_flight() == 1
        assert pool.stats()["tasks"]["active"] == 1
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert await until_async(lambda: apool.in_flight() == 0)
        await apool.aclose()

    asyncio.run(main())
    assert len(server.seen) == 1  # the second task never reached the worker
    check_untouched(pool)
    assert row(pool)["tasks"]["abandoned"] == 1
    pool.close()
    assert not aio_threads()


def test_cancel_while_queued_for_a_slot_leaves_the_queue(servers):
    """A task cancelled while it waits for a worker's slot leaves the queue at once:
    the slot's holder is untouched and nothing is charged or dead-lettered."""
    requests = Requests()
    server = serve(servers, holding(requests))
    pool = make_pool([server.url()], max_concurrent=1)

    async def main() -> None:
        apool = AsyncWorkerPool(pool, threads=4)
        holder = asyncio.ensure_future(apool.execute(PAYLOAD))
        assert await asyncio.to_thread(requests.wait, 1)
        queued = asyncio.ensure_future(apool.execute(PAYLOAD))
        assert await until_async(lambda: pool.stats()["tasks"]["waiting"] == 1)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        # Its thread leaves the queue promptly, long before any deadline.
        assert await until_async(lambda: apool.in_flight() == 1)
        assert pool.stats()["tasks"]["waiting"] == 0
        assert row(pool)["in_flight"] == 1 and not holder.done()
        holder.cancel()
        with pytest.raises(asyncio.CancelledError):
            await holder
        assert await until_async(lambda: apool.in_flight() == 0)
        await apool.aclose()

    asyncio.run(main())
    assert len(server.seen) == 1
    check_untouched(pool)
    pool.close()


@pytest.mark.parametrize("client", ["builtin", "urllib3"])
def test_cancel_mid_request_shuts_the_socket_and_charges_nobody(servers, client):
    """A task cancelled while its worker drips the answer: the connection is shut at
    once, the slot given back, the attempt abandoned, the breaker (fail_max 1) closed,
    no dead letter, and the worker serves the next task."""
    from prometheus_client import CollectorRegistry

    from npu_sync.prometheus import PrometheusExporter

    requests = Requests()
    server = serve(servers, dripping(requests))
    seen: list[TaskCancelled] = []
    pool = make_pool(
        [server.url()],
        max_concurrent=1,
        client=client,
        hooks=(lambda e: seen.append(e) if isinstance(e, TaskCancelled) else None,),
    )
    registry = CollectorRegistry()
    exporter = PrometheusExporter(pool, registry)

    async def main() -> None:
        apool = AsyncWorkerPool(pool, threads=2)
        task = asyncio.ensure_future(apool.execute(Task(PAYLOAD, task_id="cut-short")))
        assert await asyncio.to_thread(requests.wait, 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The worker sees the connection go well before its answer would end (~4 s).
        assert await asyncio.to_thread(server.wait_for, lambda: server.closed_connections == 1, 2.0)
        assert await until_async(lambda: apool.in_flight() == 0)
        check_untouched(pool)
        assert row(pool)["tasks"]["abandoned"] == 1
        tasks = pool.stats()["tasks"]
        assert tasks["cancelled"] == 1 and tasks["failed"] == tasks["succeeded"] == 0
        # Told once to the hooks, and counted by Prometheus as the task's end.
        assert [e.task_id for e in seen] == ["cut-short"]
        outcomes = ("cancelled", "succeeded", "failed", "rejected", "fallback")
        counted = {
            o: registry.get_sample_value("npu_sync_tasks_total", {"outcome": o}) for o in outcomes
        }
        assert counted == {
            "cancelled": 1,
            "succeeded": 0,
            "failed": 0,
            "rejected": 0,
            "fallback": 0,
        }
        late = CollectorRegistry()  # an exporter attached later starts from the pool's totals
        with PrometheusExporter(pool, late):
            assert late.get_sample_value("npu_sync_tasks_total", {"outcome": "cancelled"}) == 1
        await apool.aclose()

    asyncio.run(main())
    exporter.close()
    pool.close()


def test_cancel_during_retry_backoff_ends_the_wait(servers):
    """A task cancelled while it backs off (30 s) before its retry ends at once, with
    no dead letter; only the worker's own failure is charged."""
    server = serve(servers, keep_answering(lambda seen: answer(503, b'{"detail": "busy"}')))
    scheduled = threading.Event()

    def hook(event: Event) -> None:
        if isinstance(event, RetryScheduled):
            scheduled.set()

    # One worker, so its breaker must not stop the retry: fail_max 1 would open it.
    pool = make_pool([server.url()], retries=2, backoff=30.0, task=60.0, fail_max=5, hooks=(hook,))

    async def main() -> None:
        apool = AsyncWorkerPool(pool, threads=2)
        task = asyncio.ensure_future(apool.execute(PAYLOAD))
        assert await asyncio.to_thread(scheduled.wait, PATIENCE)
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await until_async(lambda: apool.in_flight() == 0)
        assert time.monotonic() - started < 30.0 / 2  # not the backoff's end
        await apool.aclose()

    asyncio.run(main())
    assert len(server.seen) == 1
    assert row(pool)["tasks"]["failed"] == 1  # the 503: the worker's own
    assert row(pool)["in_flight"] == 0
    assert pool.dead_letters.list() == []
    pool.close()


# -- deadlines, bounds, other callers --------------------------------------------------


def test_a_deadline_shorter_than_a_slow_worker_ends_the_task_with_its_dead_letter(servers):
    """A task whose worker never answers ends by its deadline with TaskFailed, after
    its dead letter is stored; the worker is not charged for the caller's deadline."""
    requests = Requests()
    server = serve(servers, holding(requests))
    pool = make_pool([server.url()])

    async def main() -> tuple[TaskFailed, float]:
        async with AsyncWorkerPool(pool) as apool:
            started = time.monotonic()
            with pytest.raises(TaskFailed) as caught:
                await apool.execute(Task(PAYLOAD, timeout=0.5))
            return caught.value, time.monotonic() - started

    error, took = asyncio.run(main())
    assert took < 0.5 + 1.0
    assert error.dead_letter_id is not None
    record = pool.dead_letters.get(error.dead_letter_id)
    assert record is not None and record.task_id == error.task_id
    assert row(pool)["tasks"]["failed"] == 0 and row(pool)["breaker"]["state"] == "closed"
    pool.close()


def test_a_task_waiting_too_long_for_a_thread_is_dead_lettered_in_time(servers):
    """With every thread busy, a task waits for one no longer than pool.max_queue_wait:
    then NoWorkerAvailable, its dead letter stored first, and it was never sent."""
    requests = Requests()
    server = serve(servers, holding(requests))
    pool = make_pool([server.url()], max_queue_wait=0.3)

    async def main() -> tuple[NoWorkerAvailable, float]:
        apool = AsyncWorkerPool(pool, threads=1)
        busy = asyncio.ensure_future(apool.execute(PAYLOAD))
        assert await asyncio.to_thread(requests.wait, 1)
        started = time.monotonic()
        with pytest.raises(NoWorkerAvailable) as caught:
            await apool.execute(PAYLOAD)
        took = time.monotonic() - started
        busy.cancel()
        await apool.aclose()
        return caught.value, took

    error, took = asyncio.run(main())
    assert took < 0.3 + 1.0
    assert "no thread free" in str(error) and "threads=1" in str(error)
    assert error.dead_letter_id is not None
    letter = pool.dead_letters.get(error.dead_letter_id)
    assert letter is not None
    # No step of the task ran: its trace is the reason it gave up, in the letter too.
    assert error.trace is not None and [s.kind for s in error.trace.steps] == ["note"]
    assert str(error.trace).startswith("1. gave up: no thread free for the task")
    assert letter.trace == error.trace.to_dict()
    assert len(server.seen) == 1
    pool.close()
    assert not aio_threads()


def test_a_thousand_concurrent_tasks_run_on_a_bounded_set_of_threads(worker):
    """1,000 tasks at once from one loop: every one answered, at most ``threads``
    task threads (and the thread that starts them) ever exist, sampled while the
    tasks run."""
    most: list[int] = [0, 0]  # task threads; every thread of the async pool

    async def main() -> None:
        async with AsyncWorkerPool(
            make_pool([worker.url], max_concurrent=8), threads=6, close_pool=True
        ) as apool:

            async def sample() -> None:
                while True:
                    runners = [t for t in aio_threads() if t.name.startswith("npu-sync-aio_")]
                    most[0] = max(most[0], len(runners))
                    most[1] = max(most[1], len(aio_threads()))
                    await asyncio.sleep(0.001)

            sampler = asyncio.ensure_future(sample())
            answers = await asyncio.gather(
                *(
                    apool.execute({"model_id": "default", "input_text": f"t{i}"})
                    for i in range(1000)
                )
            )
            sampler.cancel()
            ids = [a["task_id"] for a in answers]
            assert len(set(ids)) == 1000
            assert apool.pool.stats()["tasks"]["succeeded"] == 1000

    asyncio.run(main())
    assert 1 <= most[0] <= 6 and most[1] <= 7
    assert not aio_threads()


def test_sync_and_async_callers_share_one_pool(worker):
    """Threads calling execute and coroutines awaiting at once on one pool: every
    task answered once, counted in one set of stats."""
    pool = make_pool([worker.url], max_concurrent=4)
    sync_answers: list[Any] = []

    def sync_caller() -> None:
        for i in range(50):
            sync_answers.append(pool.execute({"model_id": "default", "input_text": f"s{i}"}))

    async def main() -> list[Any]:
        apool = AsyncWorkerPool(pool, threads=4)
        callers = [asyncio.to_thread(sync_caller) for _ in range(2)]
        tasks = [apool.execute({"model_id": "default", "input_text": f"a{i}"}) for i in range(200)]
        results = await asyncio.gather(*tasks, *callers)
        await apool.aclose()
        return results[:200]

    async_answers = asyncio.run(main())
    assert len(sync_answers) == 100 and len(async_answers) == 200
    ids = {a["task_id"] for a in [*sync_answers, *async_answers]}
    assert len(ids) == 300
    assert pool.stats()["tasks"]["succeeded"] == 300
    assert pool.stats()["tasks"]["submitted"] == 300
    pool.close()


# -- closing ---------------------------------------------------------------------------


def test_close_while_tasks_await_ends_them_promptly_with_pool_closed(servers):
    """aclose() while tasks wait on a silent worker, for a slot and for a thread:
    each awaiting coroutine gets PoolClosed at once; nothing charged, no dead letter,
    no thread left."""
    requests = Requests()
    server = serve(servers, holding(requests))
    pool = make_pool([server.url()], max_concurrent=2)

    async def main() -> list[BaseException | Any]:
        apool = AsyncWorkerPool(pool, threads=3, close_pool=True)
        tasks = [asyncio.ensure_future(apool.execute(PAYLOAD)) for _ in range(5)]
        assert await asyncio.to_thread(requests.wait, 2)
        assert await until_async(lambda: pool.stats()["tasks"]["waiting"] == 1)
        started = time.monotonic()
        await apool.aclose()
        ends = await asyncio.gather(*tasks, return_exceptions=True)
        assert time.monotonic() - started < 5.0  # the tasks' deadline is 30 s
        with pytest.raises(PoolClosed):
            await apool.execute(PAYLOAD)
        return ends

    ends = asyncio.run(main())
    assert all(isinstance(e, PoolClosed) for e in ends), ends
    assert pool.closed
    assert all(w["tasks"]["failed"] == 0 and w["in_flight"] == 0 for w in pool.workers())
    assert pool.stats()["tasks"]["failed"] == 0  # so no dead letter either
    assert not aio_threads()


def test_a_hook_closing_the_pool_from_a_task_thread_does_not_deadlock(worker):
    """A hook that closes the async pool from the task's own thread returns at once;
    the pool finishes closing and no thread is left."""
    pool_box: list[AsyncWorkerPool] = []
    closed = threading.Event()

    def hook(event: Event) -> None:
        if event.name == "task.succeeded" and not closed.is_set():
            closed.set()
            pool_box[0].close()

    async def main() -> Any:
        apool = AsyncWorkerPool(make_pool([worker.url], hooks=(hook,)), close_pool=True)
        pool_box.append(apool)
        try:
            return await apool.execute(PAYLOAD)
        finally:
            await apool.aclose()

    with contextlib.suppress(PoolClosed):  # the close raced the answer: either is honest
        asyncio.run(main())
    assert closed.is_set() and pool_box[0].closed
    assert until(lambda: not aio_threads())


def test_a_loop_closed_with_tasks_in_flight_leaves_nothing_behind(servers, caplog):
    """asyncio.run() returning while tasks are in flight cancels them: their attempts
    are stopped, nobody is charged; a loop closed by hand drops its tasks' ends
    silently; close() then ends every thread."""
    requests = Requests()
    server = serve(servers, holding(requests))
    pool = make_pool([server.url()])
    apool = AsyncWorkerPool(pool, threads=4)

    left: list[asyncio.Future[Any]] = []

    async def leave_early() -> None:
        left.extend(asyncio.ensure_future(apool.execute(PAYLOAD)) for _ in range(3))
        assert await asyncio.to_thread(requests.wait, 3)

    asyncio.run(leave_early())
    assert until(lambda: apool.in_flight() == 0)
    check_untouched(pool)

    loop = asyncio.new_event_loop()

    async def start() -> None:
        left.append(asyncio.ensure_future(apool.execute(PAYLOAD)))
        assert await asyncio.to_thread(requests.wait, 4)

    with caplog.at_level(logging.WARNING, logger="npu_sync"):
        loop.run_until_complete(start())
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()
        assert apool.in_flight() == 1
        started = time.monotonic()
        apool.close()
        assert time.monotonic() - started < 5.0
    assert apool.in_flight() == 0
    assert [r for r in caplog.records if r.name.startswith("npu_sync")] == []
    assert all(w["tasks"]["failed"] == 0 and w["in_flight"] == 0 for w in pool.workers())
    pool.close()
    assert not aio_threads()


# -- more attacks ----------------------------------------------------------------------


def by_request(*behaviours: Callable[[Peer], None]) -> Callable[[Peer], None]:
    """The n-th connection gets the n-th behaviour (the last one after that)."""
    lock = threading.Lock()
    count = [0]

    def behaviour(peer: Peer) -> None:
        with lock:
            n = count[0]
            count[0] += 1
        behaviours[min(n, len(behaviours) - 1)](peer)

    return behaviour


def test_cancelling_a_half_open_trial_gives_the_trial_back(servers):
    """A task cancelled during its worker's one half-open trial gives the trial back
    uncharged: the breaker stays half-open-able and the next task's trial closes it."""
    requests = Requests()

    def fail(peer: Peer) -> None:
        if peer.request() is not None:
            peer.send(answer(503, b'{"detail": "busy"}'))

    def ok(peer: Peer) -> None:
        keep_answering(lambda seen: OK)(peer)

    server = serve(servers, by_request(fail, holding(requests), ok))
    pool = WorkerPool(
        PoolConfig(
            workers=(worker_config("w0", server.url(), max_concurrent=4),),
            timeouts=TimeoutConfig(connect=30, read=30, task=30),
            health=HealthConfig(enabled=False),
            retry=RetryConfig(max_retries=0),
            circuit_breaker=BreakerConfig(fail_max=1, reset_timeout=0.2, max_reset_timeout=0.2),
        )
    )

    async def main() -> Any:
        async with AsyncWorkerPool(pool) as apool:
            with pytest.raises(TaskFailed):
                await apool.execute(PAYLOAD)  # the 503 opens the breaker
            assert row(pool)["breaker"]["state"] == "open"
            trial = asyncio.ensure_future(apool.execute(PAYLOAD))
            assert await asyncio.to_thread(requests.wait, 1)  # the trial is on the wire
            trial.cancel()
            with pytest.raises(asyncio.CancelledError):
                await trial
            assert await until_async(lambda: apool.in_flight() == 0)
            assert row(pool)["tasks"]["failed"] == 1  # the 503 only
            return await apool.execute(PAYLOAD)  # a new trial: the slot came back

    assert asyncio.run(main()) == {"response": "ok"}
    assert row(pool)["breaker"]["state"] == "closed"
    assert row(pool)["tasks"]["abandoned"] == 1
    pool.close()


def test_leaving_map_early_cancels_the_tasks_in_flight(servers):
    """Leaving ``async for ... in map()`` early stops the tasks still in flight, long
    before their deadline (30 s), whether the generator is closed by ``aclosing`` or
    left to the loop."""

    def answers_only_the_first(peer: Peer) -> None:
        # The first task of each map is answered; every other one held.
        while (seen := peer.request()) is not None:
            if b'"first"' not in seen.body:
                peer.hold()
                return
            if not peer.send(OK):
                return

    server = serve(servers, answers_only_the_first)
    tasks = [{"input_text": "first"}] + [PAYLOAD] * 5
    # Room for a whole window at once: the first task never queues behind a held one.
    pool = make_pool([server.url()], max_concurrent=3)

    async def main() -> None:
        async with AsyncWorkerPool(pool, threads=4) as apool:
            async with contextlib.aclosing(apool.map(tasks, window=3)) as answers:
                async for answer in answers:
                    assert answer == {"response": "ok"}
                    break
            # Closed by aclosing: the tasks are stopped; their threads end promptly.
            assert await until_async(lambda: apool.in_flight() == 0)
            check_untouched(pool)
            # Without aclosing, the loop closes the abandoned generator soon after.
            async for answer in apool.map(tasks, window=3):
                assert answer == {"response": "ok"}
                break
            assert await until_async(lambda: apool.in_flight() == 0)
            check_untouched(pool)

    started = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - started < PATIENCE
    pool.close()


def test_random_cancellations_leave_the_pool_whole(worker):
    """Tasks cancelled at random moments of their life, among tasks that finish: no
    slot held, nothing charged or dead-lettered, and the pool serves on."""
    import random

    rng = random.Random(7)

    async def main() -> None:
        async with AsyncWorkerPool(
            make_pool([worker.url], max_concurrent=3), threads=4, close_pool=True
        ) as apool:
            tasks = [asyncio.ensure_future(apool.execute(PAYLOAD)) for _ in range(200)]
            for task in rng.sample(tasks, 100):
                await asyncio.sleep(rng.random() * 0.002)
                task.cancel()
            ends = await asyncio.gather(*tasks, return_exceptions=True)
            kinds = {type(e).__name__ for e in ends if not isinstance(e, dict)}
            assert kinds <= {"CancelledError"}, kinds
            assert await until_async(lambda: apool.in_flight() == 0)
            check_untouched(apool.pool)
            # Each task that started is counted once: a result, or cancelled (a task
            # cancelled before it reached a thread never started, and counts nowhere;
            # one whose result came as its caller left counts as a success).
            tasks = apool.pool.stats()["tasks"]
            finished = sum(isinstance(e, dict) for e in ends)
            assert finished <= tasks["succeeded"] <= finished + 100 - tasks["cancelled"]
            assert tasks["submitted"] == tasks["succeeded"] + tasks["cancelled"]
            assert tasks["failed"] == tasks["rejected"] == tasks["fallbacks"] == 0
            assert (await apool.execute(PAYLOAD))["worker_id"] == "w0"

    asyncio.run(main())


def test_a_forked_child_runs_async_tasks_on_threads_of_its_own(worker):
    """After fork(), the child's async pool starts its own threads and runs tasks;
    the parent's pool goes on as before."""
    import os

    pool = make_pool([worker.url])
    apool = AsyncWorkerPool(pool, threads=2)

    async def one() -> Any:
        return await apool.execute(PAYLOAD)

    assert asyncio.run(one())["worker_id"] == "w0"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery from here on
        code = 1
        try:
            if asyncio.run(one())["worker_id"] == "w0":
                os.write(write, b"ok")
                code = 0
            apool.close()
            pool.close()
        finally:
            os._exit(code)
    os.close(write)
    said = os.read(read, 16)
    os.close(read)
    assert os.waitpid(pid, 0)[1] == 0 and said == b"ok"
    assert asyncio.run(one())["worker_id"] == "w0"
    apool.close()
    pool.close()


def test_a_task_that_cannot_be_sent_is_refused_to_its_caller_only(worker):
    """A payload that is not JSON, or a bad timeout, raises InvalidTask to the awaiting
    coroutine, naming the problem; nothing is left accepted and others run on."""
    from npu_sync import InvalidTask

    async def main() -> None:
        async with AsyncWorkerPool(make_pool([worker.url]), close_pool=True) as apool:
            with pytest.raises(InvalidTask):
                await apool.execute({"model_id": "default", "input_text": object()})
            with pytest.raises(InvalidTask, match="-1"):
                await apool.execute(PAYLOAD, timeout=-1)
            assert apool.in_flight() == 0
            assert apool.pool.stats()["tasks"]["active"] == 0
            assert apool.pool.stats()["tasks"]["submitted"] == 0  # as execute counts them
            assert (await apool.execute(PAYLOAD))["worker_id"] == "w0"
            counts = apool.stats()
            assert counts["threads"] == 32 and counts["in_flight"] == 0
            assert 1 <= counts["started"] <= 32 and counts["waiting_for_thread"] == 0

    asyncio.run(main())


def test_a_fallback_answers_on_the_task_thread_when_every_worker_fails():
    """With no worker reachable, the decorated coroutine returns its fallback's
    answer, computed on a task thread (not the loop), and stores no dead letter."""
    pool = make_pool(["http://127.0.0.1:9"], read=2.0)
    ran_on: list[str] = []

    def shout(text: str) -> dict[str, str]:
        ran_on.append(threading.current_thread().name)
        return {"response": text.upper()}

    async def main() -> Any:
        async with AsyncWorkerPool(pool, close_pool=True) as apool:

            @apool.task(fallback=shout, timeout=5.0)
            def analyze(text: str) -> dict[str, str]:
                return {"model_id": "default", "input_text": text}

            return await analyze("hello")

    assert asyncio.run(main()) == {"response": "HELLO"}
    assert ran_on and ran_on[0].startswith("npu-sync-aio_")
    assert pool.stats()["tasks"]["fallbacks"] == 1


def test_closing_the_worker_pool_alone_waits_for_async_tasks(worker):
    """WorkerPool.close() with asyncio tasks in flight waits for them, as for threaded
    ones: each ends with its answer, and the async pool then refuses new tasks."""
    pool = make_pool([worker.url])
    worker.control(latency_ms=200)

    async def main() -> list[Any]:
        apool = AsyncWorkerPool(pool, threads=4)
        tasks = [asyncio.ensure_future(apool.execute(PAYLOAD)) for _ in range(4)]
        assert await until_async(lambda: pool.stats()["tasks"]["in_flight"] == 4)
        await asyncio.to_thread(pool.close)
        ends = await asyncio.gather(*tasks, return_exceptions=True)
        with pytest.raises(PoolClosed):
            await apool.execute(PAYLOAD)
        await apool.aclose()
        return ends

    ends = asyncio.run(main())
    assert [e["worker_id"] for e in ends] == ["w0"] * 4


def test_a_slow_dead_letter_store_and_a_blocking_hook_never_hold_the_loop(servers):
    """While a hook blocks, and while a dead letter is being stored by a store that
    blocks (as a slow Redis would), the event loop goes on running other coroutines;
    the task ends with TaskFailed once its record is stored."""
    from npu_sync._deadletter import MemoryDeadLetterStore

    hook_release, store_release = threading.Event(), threading.Event()
    hooked, storing = threading.Event(), threading.Event()

    class SlowStore(MemoryDeadLetterStore):
        def add(self, record: Any) -> None:
            storing.set()
            store_release.wait(PATIENCE)
            super().add(record)

    def blocking_hook(event: Event) -> None:
        if event.name == "task.started":
            hooked.set()
            hook_release.wait(PATIENCE)

    requests = Requests()
    server = serve(servers, holding(requests))
    pool = WorkerPool(
        PoolConfig(
            workers=(worker_config("w0", server.url()),),
            health=HealthConfig(enabled=False),
            retry=RetryConfig(max_retries=0),
        ),
        dead_letter_store=SlowStore(),
        hooks=[blocking_hook],
    )

    async def other_work(turns: int) -> int:
        done = 0
        for _ in range(turns):
            await asyncio.sleep(0)
            done += 1
        return done

    async def main() -> TaskFailed:
        async with AsyncWorkerPool(pool, close_pool=True) as apool:
            task = asyncio.ensure_future(apool.execute(Task(PAYLOAD, timeout=0.5)))
            assert await asyncio.to_thread(hooked.wait, PATIENCE)
            assert await other_work(50) == 50 and not task.done()  # the hook blocks
            hook_release.set()
            assert await asyncio.to_thread(storing.wait, PATIENCE)
            assert await other_work(50) == 50 and not task.done()  # the store blocks
            store_release.set()
            with pytest.raises(TaskFailed) as caught:
                await task
            return caught.value

    error = asyncio.run(main())
    assert error.dead_letter_id is not None


def test_import_npu_sync_does_not_import_asyncio():
    """``import npu_sync`` leaves asyncio and the async module unloaded; asking for
    ``npu_sync.AsyncWorkerPool`` loads them (checked in a fresh interpreter)."""
    import json
    import pathlib
    import subprocess
    import sys

    import npu_sync

    code = (
        "import json, sys, npu_sync\n"
        "before = ['asyncio' in sys.modules, 'npu_sync._aio' in sys.modules]\n"
        "cls = npu_sync.AsyncWorkerPool\n"
        "after = ['asyncio' in sys.modules, 'npu_sync._aio' in sys.modules]\n"
        "print(json.dumps([before, after, cls.__module__, 'AsyncWorkerPool' in dir(npu_sync)]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=pathlib.Path(npu_sync.__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    before, after, module, listed = json.loads(done.stdout)
    assert before == [False, False] and after == [True, True]
    assert module == "npu_sync._aio" and listed


def test_two_event_loops_in_two_threads_share_one_async_pool(worker):
    """One AsyncWorkerPool serves coroutines on two loops in two threads at once, each
    task answered once, on the loop that awaited it."""
    pool = make_pool([worker.url], max_concurrent=4)
    apool = AsyncWorkerPool(pool, threads=4)
    results: dict[str, list[Any]] = {}
    errors: list[BaseException] = []

    def run_loop(name: str) -> None:
        async def main() -> list[Any]:
            loop = asyncio.get_running_loop()
            answers = await asyncio.gather(
                *(
                    apool.execute({"model_id": "default", "input_text": f"{name}{i}"})
                    for i in range(100)
                )
            )
            assert asyncio.get_running_loop() is loop
            return list(answers)

        try:
            results[name] = asyncio.run(main())
        except BaseException as exc:  # reported by the test below
            errors.append(exc)

    threads = [threading.Thread(target=run_loop, args=(n,)) for n in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    for name in ("a", "b"):
        texts = [a["response"].rsplit(": ", 1)[1] for a in results[name]]
        assert texts == [f"{name}{i}" for i in range(100)]
    assert pool.stats()["tasks"]["succeeded"] == 200
    apool.close()
    pool.close()


def test_cancel_on_a_transport_that_cannot_cancel_still_charges_nobody(servers):
    """On ``transport.client: requests`` (no way to shut its socket) a cancelled
    attempt runs to its own timeout, then counts as abandoned: no worker charged,
    breaker closed, no dead letter."""
    requests = Requests()
    server = serve(servers, holding(requests))
    pool = make_pool([server.url()], client="requests", read=1.0)

    async def main() -> None:
        async with AsyncWorkerPool(pool) as apool:
            task = asyncio.ensure_future(apool.execute(PAYLOAD))
            assert await asyncio.to_thread(requests.wait, 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await until_async(lambda: apool.in_flight() == 0)

    asyncio.run(main())
    check_untouched(pool)
    assert row(pool)["tasks"]["abandoned"] == 1
    pool.close()


def test_close_racing_cancellations_ends_every_task_once(worker):
    """aclose() while tasks are being cancelled and others answered: every task ends
    exactly once (an answer, CancelledError or PoolClosed), nothing is charged or
    dead-lettered, and no thread is left."""
    import random

    rng = random.Random(11)
    worker.control(latency_ms=20)
    pool = make_pool([worker.url], max_concurrent=4)

    async def main() -> list[Any]:
        apool = AsyncWorkerPool(pool, threads=6, close_pool=True)
        tasks = [asyncio.ensure_future(apool.execute(PAYLOAD)) for _ in range(200)]
        doomed = rng.sample(tasks, 60)

        async def cancel_some() -> None:
            for task in doomed:
                task.cancel()
                await asyncio.sleep(0)

        await asyncio.sleep(0.05)
        await asyncio.gather(cancel_some(), apool.aclose())
        return await asyncio.gather(*tasks, return_exceptions=True)

    ends = asyncio.run(main())
    kinds = {"answer" if isinstance(e, dict) else type(e).__name__ for e in ends}
    assert kinds <= {"answer", "CancelledError", "PoolClosed"}, kinds
    assert "PoolClosed" in kinds  # some were still waiting when it closed
    assert pool.closed
    assert all(w["tasks"]["failed"] == 0 and w["in_flight"] == 0 for w in pool.workers())
    assert pool.stats()["tasks"]["failed"] == 0
    assert not aio_threads()


def hedged_pair(a: str, b: str) -> PoolConfig:
    """Two workers of four slots, hedging after 50 ms, one retry, a breaker that opens
    at the first failure: the set-up of the hedged-cancellation tests."""
    from npu_sync.config import BalancingConfig, HedgeConfig

    return PoolConfig(
        workers=(
            worker_config("w0", a, max_concurrent=4),
            worker_config("w1", b, max_concurrent=4),
        ),
        timeouts=TimeoutConfig(connect=30, read=30, task=30),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=1),
        circuit_breaker=BreakerConfig(fail_max=1, reset_timeout=60, max_reset_timeout=600),
        balancing=BalancingConfig(hedge=HedgeConfig(enabled=True, delay=0.05)),
    )


def test_cancelling_a_hedged_task_shuts_both_attempts(servers):
    """With hedging on, a task cancelled while its attempt and its hedge are both on
    the wire: both connections are shut at once, neither worker is charged, no dead
    letter, and no hedge thread is left."""

    requests = Requests()
    a = serve(servers, until_hung_up(requests))
    b = serve(servers, until_hung_up(requests))
    pool = WorkerPool(hedged_pair(a.url(), b.url()))

    async def main() -> None:
        async with AsyncWorkerPool(pool) as apool:
            task = asyncio.ensure_future(apool.execute(PAYLOAD))
            assert await asyncio.to_thread(requests.wait, 2)  # the attempt and its hedge
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for server in (a, b):
                assert await asyncio.to_thread(
                    server.wait_for, lambda s=server: s.closed_connections == 1, 5.0
                )
            assert await until_async(lambda: apool.in_flight() == 0)
            assert await until_async(lambda: pool.stats()["tasks"]["in_flight"] == 0)

    asyncio.run(main())
    check_untouched(pool)
    assert sum(w["tasks"]["abandoned"] for w in pool.workers()) == 2
    pool.close()


# Attacks on AsyncWorkerPool and the task stop: forks, races and storms that try to break
# the promises of docs/async.md. Workers are loopback servers (tests/hostile.py) or
# reference workers in their own processes; nothing sleeps in place of a signal.


HEALTHY = answer(200, b'{"status": "healthy"}')


def released(requests: Requests, release: threading.Event) -> Callable[[Peer], None]:
    """A worker that reads the request, then answers only once ``release`` is set."""

    def behaviour(peer: Peer) -> None:
        if peer.request() is not None:
            requests.seen()
            while not release.wait(0.05):
                if peer.stop.is_set():
                    return
            peer.send(OK)

    return behaviour


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running on a thread of its own, so the test's thread may fork."""
    running = asyncio.new_event_loop()
    thread = threading.Thread(target=running.run_forever, name="test-loop")
    thread.start()
    yield running
    running.call_soon_threadsafe(running.stop)
    thread.join(PATIENCE)
    running.close()


def wait_child(pid: int) -> int:
    """The child's exit status; killed (and the test failed) if it hangs."""
    give_up = time.monotonic() + PATIENCE
    while time.monotonic() < give_up:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung")


def test_a_child_forked_mid_task_neither_sees_nor_cuts_the_parents_tasks(servers, loop):
    """A child forked while the parent's task is on the wire starts with no task and no
    thread of its parent's, and closing its AsyncWorkerPool leaves the parent's
    connection alone: the parent's task gets its answer, nobody charged."""
    requests, release = Requests(), threading.Event()
    server = serve(servers, released(requests, release))
    pool = make_pool([server.url()], max_concurrent=2)
    apool = AsyncWorkerPool(pool, threads=2)
    try:
        running: concurrent.futures.Future[Any] = asyncio.run_coroutine_threadsafe(
            apool.execute(PAYLOAD), loop
        )
        assert requests.wait(1)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no pytest machinery from here on
            code = 1
            try:
                counts = apool.stats()
                seen = (apool.in_flight(), counts["started"], counts["in_flight"])
                apool.close()
                pool.close()
                os.write(write, repr(seen).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        assert wait_child(pid) == 0
        said = os.read(read, 100).decode()
        os.close(read)
        release.set()
        assert running.result(PATIENCE) == {"response": "ok"}
        assert said == "(0, 0, 0)", f"the child saw (in_flight, started, in_flight): {said}"
        assert row(pool)["tasks"]["failed"] == 0 and row(pool)["breaker"]["state"] == "closed"
    finally:
        release.set()
        apool.close()
        pool.close()


def test_ten_thousand_cancels_leave_every_slot_and_the_full_concurrency(servers):
    """10,000 tasks cancelled at once — on the wire, queued for a slot, waiting for a
    thread, not yet pumped — leave no slot, waiter or thread taken, charge nobody,
    store no dead letter; then every slot of the worker serves at once again."""
    requests, release = Requests(), threading.Event()
    server = serve(servers, released(requests, release))
    pool = make_pool([server.url()], max_concurrent=4)

    async def main() -> None:
        async with AsyncWorkerPool(pool, threads=16) as apool:
            tasks = [asyncio.ensure_future(apool.execute(PAYLOAD)) for _ in range(10_000)]
            assert await asyncio.to_thread(requests.wait, 4)  # every slot on the wire
            assert await until_async(lambda: pool.stats()["tasks"]["waiting"] == 12)
            for task in tasks:
                task.cancel()
            ends = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(e, asyncio.CancelledError) for e in ends)
            assert await until_async(lambda: apool.in_flight() == 0)
            assert await until_async(lambda: pool.stats()["tasks"]["active"] == 0)
            check_untouched(pool)
            # Slots freed by the first cancels may take a queued task onto the wire
            # before its own cancel is run: each attempt that went out is abandoned,
            # whether the worker read its request or it was cut short before that.
            abandoned = row(pool)["tasks"]["abandoned"]
            assert abandoned >= 4 and len(server.seen) <= abandoned
            counts = apool.stats()
            assert counts["waiting_for_thread"] == 0 and counts["started"] <= 16
            # The four slots serve four tasks at once: each is held until all arrived.
            seen = requests.count
            again = [asyncio.ensure_future(apool.execute(PAYLOAD)) for _ in range(4)]
            assert await asyncio.to_thread(requests.wait, seen + 4)
            release.set()
            assert await asyncio.gather(*again) == [{"response": "ok"}] * 4

    try:
        asyncio.run(main())
    finally:
        release.set()
        pool.close()


def test_a_cancel_while_the_request_is_half_written_ends_it_at_once(servers):
    """A worker that reads the head of a large request and then stops reading: the
    sender blocks with the body half written. Cancelling then shuts the connection at
    once, abandons the attempt, gives the slot back and charges nobody."""
    heads = Requests()

    def stalls_reading(peer: Peer) -> None:
        if peer.head() is not None:
            heads.seen()
            peer.wait_readable()  # until the client hangs up (it has sent more)
            while peer.receive():
                pass  # drain until the client's close arrives

    server = serve(servers, stalls_reading, rcvbuf=4096)
    pool = make_pool([server.url()], max_concurrent=1)
    big = {"model_id": "default", "input_text": "x" * (8 << 20)}

    async def main() -> None:
        async with AsyncWorkerPool(pool, threads=2) as apool:
            task = asyncio.ensure_future(apool.execute(big))
            assert await asyncio.to_thread(heads.wait, 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(
                server.wait_for, lambda: server.closed_connections == 1, PATIENCE
            )
            assert await until_async(lambda: apool.in_flight() == 0)
            assert await until_async(lambda: pool.stats()["tasks"]["active"] == 0)
            check_untouched(pool)
            assert row(pool)["tasks"]["abandoned"] == 1

    try:
        asyncio.run(main())
    finally:
        pool.close()


def test_cancels_racing_answers_end_each_task_once_and_count_every_attempt(servers):
    """Each task is cancelled the moment its request reaches a worker that answers at
    once, so the cancel races the answer: every caller sees its answer or a
    CancelledError, nothing is charged or dead-lettered, and every request the worker
    read counts once, as a success or an abandoned attempt."""
    requests = Requests()

    def reply(_seen: Any) -> bytes:
        requests.seen()
        return OK

    server = serve(servers, keep_answering(reply))
    pool = make_pool([server.url()], max_concurrent=2)

    async def main() -> None:
        async with AsyncWorkerPool(pool, threads=4) as apool:
            answered = 0
            for n in range(1, 201):
                task = asyncio.ensure_future(apool.execute(PAYLOAD))
                assert await asyncio.to_thread(requests.wait, n)
                task.cancel()
                try:
                    assert await task == {"response": "ok"}
                    answered += 1
                except asyncio.CancelledError:
                    pass
            assert await until_async(lambda: apool.in_flight() == 0)
            assert await until_async(lambda: pool.stats()["tasks"]["active"] == 0)
            check_untouched(pool)
            tasks = pool.stats()["tasks"]
            worker = row(pool)["tasks"]
            assert tasks["submitted"] == 200 and tasks["failed"] == tasks["rejected"] == 0
            assert answered <= tasks["succeeded"] == worker["succeeded"]
            assert worker["succeeded"] + worker["abandoned"] == len(server.seen) == 200

    try:
        asyncio.run(main())
    finally:
        pool.close()


def test_a_thread_wait_running_out_while_closing_leaves_no_thread_behind(servers):
    """close() stops the tasks one by one; a task whose wait for a thread runs out
    meanwhile must not start a thread that nobody shuts down. Here stopping the first
    task is held up (its stop's callbacks: what wakes its waits) until the other
    task's wait has run out, or long enough that it would have."""
    requests = Requests()
    server = serve(servers, holding(requests))
    pool = make_pool([server.url()], max_queue_wait=0.3)
    ended = threading.Event()

    async def main() -> BaseException | None:
        apool = AsyncWorkerPool(pool, threads=1)
        busy = asyncio.ensure_future(apool.execute(PAYLOAD))
        assert await asyncio.to_thread(requests.wait, 1)
        waiting = asyncio.ensure_future(apool.execute(PAYLOAD))
        waiting.add_done_callback(lambda _: ended.set())
        assert await until_async(lambda: apool.stats()["waiting_for_thread"] == 1)
        for call in list(apool._calls):
            call.stop.on_cancel(lambda: ended.wait(2.0))
        await apool.aclose()
        await asyncio.gather(busy, return_exceptions=True)
        return (await asyncio.gather(waiting, return_exceptions=True))[0]

    try:
        error = asyncio.run(main())
        assert isinstance(error, PoolClosed), error
        assert pool.dead_letters.list() == []
        assert until(lambda: not aio_threads(), 2.0), aio_threads()
    finally:
        pool.close()


def model_worker(loading: Requests, release: threading.Event) -> Callable[[Peer], None]:
    """A Linux-protocol worker holding only ``other``; its first load of a model waits
    for ``release`` (a model may take minutes to load), later ones answer at once."""
    held = ["other"]

    def reply(seen: Any) -> bytes:
        if seen.path == "/health":
            return answer(200, b'{"status": "healthy"}')
        if seen.path == "/models":
            listed = ", ".join(f'"{m}": {{"device": "NPU"}}' for m in held)
            return answer(200, ('{"loaded_models": {' + listed + "}}").encode())
        if seen.path == "/models/load":
            loading.seen()
            if loading.count == 1:
                release.wait(PATIENCE)
            held.append("m")
            return answer(200, b'{"status": "success"}')
        return OK

    return keep_answering(reply)


def placing_pool(url: str, *, balance: bool = False) -> WorkerPool:
    return WorkerPool(
        PoolConfig(
            workers=(worker_config("w0", url, max_concurrent=4),),
            timeouts=TimeoutConfig(connect=30.0, read=30.0, task=60.0),
            health=HealthConfig(enabled=False),
            models=ModelsConfig(placement=True, balance=balance),
        )
    )


@pytest.mark.parametrize("balance", [False, True], ids=["on-demand", "balanced"])
def test_a_task_cancelled_while_its_model_loads_frees_its_thread_at_once(servers, balance):
    """Tasks for a model no worker holds wait while one of them has it loaded (which
    may take minutes on an NPU). Cancelling one that only waits ends it at once: its
    thread is free again, the load and the task that asked for it go on. Placement
    rounds (``models.balance``) load through a placer of their own: the same holds."""
    loading, release = Requests(), threading.Event()
    server = serve(servers, model_worker(loading, release))
    pool = placing_pool(server.url(), balance=balance)
    task = {"model_id": "m", "input_text": "hi"}

    async def main() -> None:
        async with AsyncWorkerPool(pool, threads=4) as apool:
            await asyncio.to_thread(pool.check_health)
            placer = asyncio.ensure_future(apool.execute(task))
            assert await asyncio.to_thread(loading.wait, 1)
            waiter = asyncio.ensure_future(apool.execute(task))
            assert await until_async(lambda: apool.stats()["in_flight"] == 2)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            assert await until_async(lambda: apool.in_flight() == 1)
            assert pool.stats()["tasks"]["active"] == 1
            release.set()
            assert await placer == {"response": "ok"}

    try:
        asyncio.run(main())
    finally:
        release.set()
        pool.close()


def test_a_hook_closing_the_pools_as_a_thread_less_task_is_dead_lettered_returns(servers):
    """A task that found no thread is dead-lettered on a thread of its own; a hook told
    of it there that closes the AsyncWorkerPool (and with it the pool) returns, as
    close() does from any other hook, instead of waiting for its own task forever."""
    from npu_sync.events import TaskDeadLettered

    requests = Requests()
    server = serve(servers, holding(requests))
    apools: list[AsyncWorkerPool] = []
    returned = threading.Event()

    def hook(event: Any) -> None:
        if isinstance(event, TaskDeadLettered):
            apools[0].close()
            returned.set()

    pool = make_pool([server.url()], max_queue_wait=0.3, hooks=(hook,))

    async def main() -> BaseException | None:
        apool = AsyncWorkerPool(pool, threads=1, close_pool=True)
        apools.append(apool)
        busy = asyncio.ensure_future(apool.execute(PAYLOAD))
        assert await asyncio.to_thread(requests.wait, 1)
        waiting = asyncio.ensure_future(apool.execute(PAYLOAD))
        assert await asyncio.to_thread(returned.wait, PATIENCE), "close() from the hook hung"
        await asyncio.gather(busy, return_exceptions=True)
        return (await asyncio.gather(waiting, return_exceptions=True))[0]

    error = asyncio.run(main())
    assert isinstance(error, NoWorkerAvailable), error
    assert pool.closed
    assert until(lambda: not aio_threads()), aio_threads()


def test_a_child_forked_while_a_model_loads_places_it_itself(servers):
    """A child forked while the parent has a model loaded does not wait for the
    parent's load (no thread of the child's would ever end it): its own task for the
    model loads it and is answered."""
    from npu_sync import TaskRejected

    loading, release = Requests(), threading.Event()
    server = serve(servers, model_worker(loading, release))
    pool = placing_pool(server.url())
    task = {"model_id": "m", "input_text": "hi"}
    try:
        pool.check_health()
        placer = pool.submit(task)
        assert loading.wait(1)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no pytest machinery from here on
            code = 1
            try:
                try:
                    said = repr(pool.execute(task, timeout=5.0))
                except TaskRejected as exc:
                    said = f"TaskRejected: {exc}"
                os.write(write, said.encode()[:500])
                pool.close()
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        assert wait_child(pid) == 0
        said = os.read(read, 500).decode()
        os.close(read)
        assert said == "{'response': 'ok'}", said
        release.set()
        assert placer.result(PATIENCE) == {"response": "ok"}
    finally:
        release.set()
        pool.close()


def test_a_task_cancelled_on_a_retiring_worker_lets_the_handover_finish(servers):
    """A reload replaces the worker a task is on; the old one drains. Cancelling the
    task then shuts its connection, gives the old worker's slot back, charges nobody,
    and the old worker leaves; the new one serves."""
    import dataclasses

    requests = Requests()
    old = serve(servers, until_hung_up(requests))
    new = serve(servers, keep_answering(lambda seen: OK if seen.path != "/health" else HEALTHY))
    pool = make_pool([old.url()], max_concurrent=2)

    async def main() -> None:
        async with AsyncWorkerPool(pool, threads=4) as apool:
            task = asyncio.ensure_future(apool.execute(PAYLOAD))
            assert await asyncio.to_thread(requests.wait, 1)
            replaced = dataclasses.replace(
                pool.config, workers=(worker_config("w1", new.url(), max_concurrent=2),)
            )
            await asyncio.to_thread(pool.reload, replaced)
            assert {w["id"] for w in pool.workers()} == {"w0", "w1"}  # w0 drains
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await until_async(lambda: apool.in_flight() == 0)
            assert await until_async(lambda: [w["id"] for w in pool.workers()] == ["w1"])
            assert await asyncio.to_thread(
                old.wait_for, lambda: old.closed_connections == 1, PATIENCE
            )
            check_untouched(pool)
            assert await apool.execute(PAYLOAD) == {"response": "ok"}
            assert row(pool, "w1")["tasks"]["succeeded"] == 1

    try:
        asyncio.run(main())
    finally:
        pool.close()


def test_cancelled_tasks_stop_counting_as_waiting_for_a_thread(servers):
    """With every thread busy, tasks cancelled while they wait for one no longer count
    in stats()'s waiting_for_thread, which stays a part of in_flight."""
    requests = Requests()
    server = serve(servers, until_hung_up(requests))
    pool = make_pool([server.url()])

    async def main() -> None:
        async with AsyncWorkerPool(pool, threads=1) as apool:
            busy = asyncio.ensure_future(apool.execute(PAYLOAD))
            assert await asyncio.to_thread(requests.wait, 1)
            queued = [asyncio.ensure_future(apool.execute(PAYLOAD)) for _ in range(100)]
            assert await until_async(lambda: apool.stats()["waiting_for_thread"] == 100)
            for task in queued:
                task.cancel()
            await asyncio.gather(*queued, return_exceptions=True)
            counts = apool.stats()
            assert counts["in_flight"] == 1 and counts["waiting_for_thread"] == 0, counts
            busy.cancel()
            await asyncio.gather(busy, return_exceptions=True)

    try:
        asyncio.run(main())
    finally:
        pool.close()


def test_prometheus_counts_a_cancelled_attempt_as_stats_does(servers):
    """An attempt cut short by a cancel counts once as abandoned in Prometheus, as in
    workers(); the worker's in-flight gauge is back to 0, and no gauge is negative."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from npu_sync.prometheus import instrument

    requests = Requests()
    server = serve(servers, until_hung_up(requests))
    pool = make_pool([server.url()], max_concurrent=1)
    registry = CollectorRegistry()
    exporter = instrument(pool, registry)

    async def main() -> None:
        async with AsyncWorkerPool(pool, threads=2) as apool:
            task = asyncio.ensure_future(apool.execute(PAYLOAD))
            assert await asyncio.to_thread(requests.wait, 1)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert await until_async(lambda: apool.in_flight() == 0)

    try:
        asyncio.run(main())
        assert row(pool)["tasks"]["abandoned"] == 1
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples
        }
        key = ("npu_sync_attempts_total", (("outcome", "abandoned"), ("worker", "w0")))
        assert samples[key] == 1, {k: v for k, v in samples.items() if "attempts" in k[0]}
        assert samples[("npu_sync_worker_in_flight", (("worker", "w0"),))] == 0
        assert all(v >= 0 for v in samples.values())
    finally:
        exporter.close()
        pool.close()


def test_a_cancelled_hedged_task_tells_the_hooks_of_both_attempts(servers):
    """A hedged task cancelled with its attempt and its hedge on the wire: each
    attempt is told to the hooks once, as abandoned, as workers() counts them."""
    from npu_sync.events import AttemptFinished

    requests = Requests()
    a = serve(servers, until_hung_up(requests))
    b = serve(servers, until_hung_up(requests))
    told: list[AttemptFinished] = []
    lock = threading.Lock()

    def hook(event: Any) -> None:
        if isinstance(event, AttemptFinished):
            with lock:
                told.append(event)

    pool = WorkerPool(
        hedged_pair(a.url(), b.url()),
        hooks=(hook,),
    )

    async def main() -> None:
        async with AsyncWorkerPool(pool) as apool:
            task = asyncio.ensure_future(apool.execute(PAYLOAD))
            assert await asyncio.to_thread(requests.wait, 2)  # the attempt and its hedge
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert await until_async(lambda: apool.in_flight() == 0)
            assert await until_async(lambda: pool.stats()["tasks"]["in_flight"] == 0)

    try:
        asyncio.run(main())
        check_untouched(pool)
        assert until(lambda: len(told) >= 2)
        with lock:
            outcomes = sorted((e.worker_id, e.outcome) for e in told)
        assert outcomes == [("w0", "abandoned"), ("w1", "abandoned")], outcomes
        assert [w["tasks"]["abandoned"] for w in pool.workers()] == [1, 1]
    finally:
        pool.close()
