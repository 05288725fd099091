"""Unit tests of TaskStop: stopping one task from another thread."""

from __future__ import annotations

import socket
import threading

from npu_sync._admission import Dispatcher, Refusal
from npu_sync._stop import TaskStop
from npu_sync.testing import FakeClock
from tests.test_admission import far, make_worker


def test_callbacks_run_once_when_stopped_and_not_after_forget():
    """A registered callback runs once on cancel; a forgotten one never; registering
    after the stop is refused."""
    stop = TaskStop()
    calls: list[str] = []
    stop.on_cancel(lambda: calls.append("a"))

    def forgotten() -> None:
        calls.append("b")

    stop.on_cancel(forgotten)
    stop.forget(forgotten)
    stop.stop("the pool was closed")
    stop.cancel()
    assert calls == ["a"]
    assert stop.cancelled and stop.reason == "the pool was closed"
    assert stop.on_cancel(lambda: calls.append("c")) is False
    assert calls == ["a"]


def test_the_first_reason_stands():
    """A second stop does not rewrite why the task was stopped."""
    stop = TaskStop()
    stop.stop("first")
    stop.stop("second")
    assert stop.reason == "first"


def test_stopping_shuts_the_attached_socket():
    """The socket of the attempt in flight is shut down: its reader sees the end."""
    left, right = socket.socketpair()
    try:
        stop = TaskStop()
        assert stop.attach(left)
        stop.cancel()
        assert left.recv(1) == b""  # shut down: no wait for the peer
        assert stop.attach(left) is False  # no new exchange once stopped
    finally:
        left.close()
        right.close()


def test_a_waiter_for_a_full_worker_leaves_when_stopped():
    """A task waiting for capacity is woken by its stop and leaves the queue with
    STOPPED; the worker's slot stays with its holder, and the queue is empty."""
    clock = FakeClock()
    dispatcher = Dispatcher(clock)
    worker = make_worker(clock, "w1", capacity=1)
    dispatcher.set_workers([worker])
    held = dispatcher.acquire((), far(clock))
    assert held is not None
    stop = TaskStop()
    got: list[object] = []
    waiting = threading.Thread(
        target=lambda: got.append(dispatcher.acquire_or_reason((), far(clock), stop=stop))
    )
    waiting.start()
    # Polled: the queue has no signal for "someone joined".
    while dispatcher.waiting == 0 and waiting.is_alive():
        waiting.join(0.001)
    stop.cancel()
    waiting.join(10)
    assert not waiting.is_alive()
    assert got == [Refusal.STOPPED]
    assert dispatcher.waiting == 0 and worker.in_flight == 1


def test_a_stopped_task_does_not_start_waiting():
    """A task stopped before it asks for a worker gets STOPPED, not a lease."""
    clock = FakeClock()
    dispatcher = Dispatcher(clock)
    dispatcher.set_workers([make_worker(clock, "w1", capacity=1)])
    stop = TaskStop()
    stop.cancel()
    assert dispatcher.acquire_or_reason((), far(clock), stop=stop) is Refusal.STOPPED
