"""Stopping one task from another thread: what cancelling an awaiting asyncio task does.

A :class:`TaskStop` is handed to the task's life (:mod:`npu_sync._life`) when the
task starts. Stopping it ends the task wherever it is, and charges nobody:

* waiting for a worker (:mod:`npu_sync._admission`): the waiter is woken and leaves
  the queue without a lease;
* on the wire: the attempt's socket is shut down (as a hedge's loser's is), and the
  attempt is recorded as abandoned, its slot (maybe its breaker's one trial) given back;
* backing off between attempts: the wait ends at once.

A stopped task raises :class:`Stopped` on its own thread: no fallback runs and no dead
letter is stored, since nobody is left to hear of the failure.
"""

from __future__ import annotations

from collections.abc import Callable

from npu_sync.transport import Cancel


class Stopped(Exception):
    """Raised on a task's own thread once its :class:`TaskStop` is stopped."""


class TaskStop(Cancel):
    """A way to stop one whole task from another thread.

    Thread-safe. Besides shutting the socket of the attempt in flight (see
    :class:`~npu_sync.transport.Cancel`), it calls the callbacks registered with
    :meth:`on_cancel`: what wakes the task where it waits. Callbacks run on the thread
    that calls :meth:`cancel`, with no lock of this object held; they must not block.
    """

    __slots__ = ("_callbacks", "reason")

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], None]] = []
        self.reason = "cancelled by its caller"

    def on_cancel(self, callback: Callable[[], None]) -> bool:
        """Call ``callback`` when stopped. False (and never called) if already stopped."""
        with self._lock:
            if self.event.is_set():
                return False
            self._callbacks.append(callback)
            return True

    def forget(self, callback: Callable[[], None]) -> None:
        """No longer call ``callback`` (the wait it wakes is over)."""
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

    def stop(self, reason: str) -> None:
        """Stop the task, saying why (the stopped attempt's error)."""
        with self._lock:
            if not self.event.is_set():
                self.reason = reason
        self.cancel()

    def cancel(self) -> None:
        """Stop the task: shut its attempt's socket, wake its waits (idempotent)."""
        super().cancel()
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()
