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

from npu_sync import AsyncWorkerPool
from tests.hostile import Peer, answer, serve
from tests.test_aio import PATIENCE, PAYLOAD, Requests, make_pool, row

OK = answer(200, b'{"response": "ok"}')


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
