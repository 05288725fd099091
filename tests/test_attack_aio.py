"""Attacks on AsyncWorkerPool and the task stop: forks, races and storms that try to
break the promises of docs/async.md. Workers are loopback servers (tests/hostile.py)
or reference workers in their own processes; nothing sleeps in place of a signal."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from npu_sync import AsyncWorkerPool, NoWorkerAvailable, PoolClosed, WorkerPool
from npu_sync.config import (
    HealthConfig,
    ModelsConfig,
    PoolConfig,
    TimeoutConfig,
    worker_config,
)
from tests.hostile import Peer, answer, keep_answering, serve
from tests.test_aio import (
    PATIENCE,
    PAYLOAD,
    Requests,
    aio_threads,
    check_untouched,
    holding,
    make_pool,
    row,
    until,
    until_async,
    until_hung_up,
)

OK = answer(200, b'{"response": "ok"}')
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
    from npu_sync.config import BalancingConfig, BreakerConfig, HedgeConfig, RetryConfig
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
        PoolConfig(
            workers=(
                worker_config("w0", a.url(), max_concurrent=4),
                worker_config("w1", b.url(), max_concurrent=4),
            ),
            timeouts=TimeoutConfig(connect=30, read=30, task=30),
            health=HealthConfig(enabled=False),
            retry=RetryConfig(max_retries=1),
            circuit_breaker=BreakerConfig(fail_max=1, reset_timeout=60, max_reset_timeout=600),
            balancing=BalancingConfig(hedge=HedgeConfig(enabled=True, delay=0.05)),
        ),
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
