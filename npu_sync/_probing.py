"""Where and when health probes run: a bounded set of threads, and each worker's slot.

A thread per probe does not scale: with 10,000 workers a round started 10,000 threads
and as many sockets at once, ran out of descriptors, and ``close()`` spent half a
minute joining them. Here probes queue for at most ``health.concurrency`` threads
(:class:`ProbeRunner`), and each worker's probe is due once per interval at an offset
of its own (:class:`Slots`), so the work of a round is spread over the interval
instead of arriving all at once.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import math
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from npu_sync.transport import Cancel

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(eq=False)
class _Job(Generic[T]):
    run: Callable[[Cancel], T]
    future: concurrent.futures.Future[T]
    due: float
    budget: float  # seconds the probe may run before it is abandoned
    tag: Hashable
    cancel: Cancel = field(default_factory=Cancel)
    started: float | None = None


@dataclass(eq=False)
class _Slot:
    thread: threading.Thread | None = None
    job: _Job[Any] | None = None
    abandoned: bool = False  # its job overran: it ends with that job, another replaces it


class ProbeRunner:
    """Runs probes FIFO on at most ``size`` threads, started as work comes.

    Thread-safe; its lock is never held across a probe. A probe is a callable given a
    :class:`~npu_sync.transport.Cancel` that it passes to its transport, so that
    :meth:`stop` can shut its socket instead of waiting for it.

    A probe still running ``budget`` seconds after it started (a transport that does
    not keep to its timeout) is abandoned by :meth:`abandon_overdue`: it is cancelled,
    its thread ends once the probe returns, and another thread takes its place, so one
    broken transport cannot hold up every other worker's check.

    Args:
        size: the most threads probing at once (``health.concurrency``).
        name: prefix of the threads' names.
        timer: monotonic seconds, for start lags and budgets.
    """

    def __init__(
        self,
        size: int,
        *,
        name: str = "npu-sync-health-probe",
        timer: Callable[[], float] = time.monotonic,
    ) -> None:
        self._size = max(1, size)
        self._name = name
        self._timer = timer
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[_Job[Any]] = deque()
        self._slots: list[_Slot] = []
        self._idle = 0
        self._stopped = False
        self._numbers = itertools.count(1)
        self.started = 0  # probes started
        self.max_lag = 0.0  # the longest wait past a probe's due time, since taken

    @property
    def size(self) -> int:
        return self._size

    def resize(self, size: int) -> None:
        """At most ``size`` threads from now on; extra ones end after their probe."""
        with self._cond:
            self._size = max(1, size)
            self._cond.notify_all()
            self._spawn_locked()

    def threads(self) -> int:
        """Threads alive now, abandoned ones included."""
        with self._cond:
            return len(self._slots)

    def busy(self) -> int:
        """Probes running now (abandoned ones included) and probes queued."""
        with self._cond:
            return sum(1 for s in self._slots if s.job is not None) + len(self._queue)

    def submit(
        self,
        run: Callable[[Cancel], T],
        *,
        budget: float,
        due: float | None = None,
        tag: Hashable = None,
    ) -> concurrent.futures.Future[T] | None:
        """Queue a probe; None once stopped. ``due``: when it was meant to start."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        job = _Job(run, future, self._timer() if due is None else due, budget, tag)
        with self._cond:
            if self._stopped:
                return None
            self._queue.append(job)
            if self._idle:
                self._cond.notify()
            else:
                self._spawn_locked()
        return future

    def abandon_overdue(self, now: float | None = None) -> list[Hashable]:
        """Abandon probes running past their budget; returns their tags."""
        at = self._timer() if now is None else now
        abandoned: list[_Job[Any]] = []
        with self._cond:
            for slot in self._slots:
                job = slot.job
                if (
                    job is not None
                    and not slot.abandoned
                    and job.started is not None
                    and at - job.started > job.budget
                ):
                    slot.abandoned = True
                    abandoned.append(job)
            if abandoned:
                self._spawn_locked()
        for job in abandoned:
            job.cancel.cancel()
            log.warning(
                "a health check ran %.3gs past its budget of %.3gs; its thread is replaced",
                at - (job.started or at) - job.budget,
                job.budget,
            )
        return [job.tag for job in abandoned]

    def is_abandoned(self, future: concurrent.futures.Future[Any]) -> bool:
        with self._cond:
            return any(s.abandoned and s.job and s.job.future is future for s in self._slots)

    def next_overdue(self) -> float | None:
        """When the next running probe overruns its budget, if one runs."""
        with self._cond:
            ends = [
                s.job.started + s.job.budget
                for s in self._slots
                if s.job is not None and s.job.started is not None and not s.abandoned
            ]
        return min(ends) if ends else None

    def take_max_lag(self) -> float:
        """The longest start lag since the last call, and start over."""
        with self._cond:
            lag, self.max_lag = self.max_lag, 0.0
        return lag

    def stop(self, wait: float) -> None:
        """Cancel queued probes, shut the sockets of running ones, and wait up to
        ``wait`` seconds for the threads to end. Idempotent."""
        with self._cond:
            self._stopped = True
            queued = list(self._queue)
            self._queue.clear()
            running = [s.job for s in self._slots if s.job is not None]
            threads = [s.thread for s in self._slots if s.thread is not None]
            self._cond.notify_all()
        for job in queued:
            job.future.cancel()
        for job in running:
            if job is not None:
                job.cancel.cancel()
        deadline = time.monotonic() + wait
        me = threading.current_thread()
        for thread in threads:
            if thread is not me:
                thread.join(max(0.0, deadline - time.monotonic()))

    def _spawn_locked(self) -> None:
        active = sum(1 for s in self._slots if not s.abandoned)
        wanted = min(len(self._queue) - self._idle, self._size - active)
        for _ in range(max(0, wanted)):
            slot = _Slot()
            thread = threading.Thread(
                target=self._work,
                args=(slot,),
                name=f"{self._name}-{next(self._numbers)}",
                daemon=True,
            )
            slot.thread = thread
            try:
                thread.start()
            except RuntimeError:
                log.warning("cannot start a health check thread: out of threads")
                return
            self._slots.append(slot)

    def _work(self, slot: _Slot) -> None:
        cond = self._cond
        while True:
            with cond:
                while not self._queue and not self._stopped and not self._surplus_locked(slot):
                    self._idle += 1
                    try:
                        cond.wait()
                    finally:
                        self._idle -= 1
                if self._stopped or self._surplus_locked(slot):
                    self._slots.remove(slot)
                    return
                job = self._queue.popleft()
                job.started = now = self._timer()
                slot.job = job
                self.started += 1
                self.max_lag = max(self.max_lag, now - job.due)
            if job.future.set_running_or_notify_cancel():
                try:
                    result = job.run(job.cancel)
                except BaseException as exc:  # the caller learns of it from the future
                    job.future.set_exception(exc)
                else:
                    job.future.set_result(result)
            with cond:
                slot.job = None
                if slot.abandoned:
                    self._slots.remove(slot)
                    return

    def _surplus_locked(self, slot: _Slot) -> bool:
        active = [s for s in self._slots if not s.abandoned]
        return len(active) > self._size and slot is active[-1]


class Slots:
    """When each worker's probe is due: once per interval, at an offset of its own.

    The offset is a hash of the worker's id mixed with a salt drawn once per checker:
    stable for a worker for as long as the checker lives, spread evenly over the
    interval across workers, and different between processes (so that many processes
    do not probe a worker at the same moment). Not thread-safe: one thread owns it.
    """

    def __init__(self, salt: float, epoch: float) -> None:
        self._salt = salt
        self._epoch = epoch

    def offset(self, worker_id: str, interval: float) -> float:
        fraction = (zlib.crc32(worker_id.encode()) / 2**32 + self._salt) % 1.0
        return fraction * interval

    def next(self, worker_id: str, interval: float, after: float) -> float:
        """The worker's first slot at or after ``after``."""
        start = self._epoch + self.offset(worker_id, interval)
        if after <= start:
            return start
        return start + math.ceil((after - start) / interval) * interval
