"""The same pool for asyncio code: ``await apool.execute(task)``.

An :class:`AsyncWorkerPool` wraps a :class:`~npu_sync._pool.WorkerPool` that synchronous
callers may be using at the same time: one set of workers, breakers, health checks,
reloads, dead letters and metrics. Each task runs its whole life (see
:mod:`npu_sync._life`) on one of a bounded set of threads of its own, and its end is
handed to the awaiting coroutine with ``loop.call_soon_threadsafe``; the event loop
only builds the task and waits. docs/async.md says why threads under the hood and not
an asyncio transport of its own, with the figures.

Cancelling the awaiting asyncio task stops its task (see :mod:`npu_sync._stop`) wherever
it is: still waiting for a thread (it never starts), waiting for a worker (it leaves
the queue), on the wire (its socket is shut down, its slot given back, the attempt
recorded as abandoned: no worker charged) or backing off (the wait ends). A stopped
task runs no fallback and stores no dead letter.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, ParamSpec

from npu_sync._decorator import NpuTask
from npu_sync._life import Exhausted
from npu_sync._pool import WorkerPool
from npu_sync._stop import Stopped, TaskStop
from npu_sync.errors import PoolClosed
from npu_sync.task import Task, as_task, traced
from npu_sync.trace import Trace, asked

log = logging.getLogger(__name__)

P = ParamSpec("P")

_MAX_THREADS = 4096
_PER_TURN = 8
"""Tasks handed to threads per turn of the event loop (see :class:`_Pump`)."""
_CLOSED_WHILE_RUNNING = "the pool was closed while the task ran"
_NO_TASK = Task(None, task_id="-")  # a call's task until the pump makes it


class _Call:
    """One task handed to a thread: what it runs, and where its end goes.

    Built as the caller asks (with what it gave, and when); the pump gives it its
    deadline and a thread, a few calls at a time; the thread makes the :class:`Task`.
    """

    __slots__ = (
        "context",
        "deadline",
        "fallback",
        "future",
        "given",
        "loop",
        "started",
        "stop",
        "task",
        "timeout",
        "timer",
        "trace",
        "waiter",
    )

    def __init__(
        self,
        given: Task | Any,
        timeout: float | None,
        fallback: Callable[[], Any] | None,
        loop: asyncio.AbstractEventLoop,
        started: float,
    ) -> None:
        self.given = given
        self.timeout = timeout
        self.fallback = fallback
        self.loop = loop
        self.started = started
        self.task: Task = _NO_TASK
        self.deadline = 0.0
        self.stop = TaskStop()
        self.waiter: asyncio.Future[Any] = loop.create_future()
        self.future: concurrent.futures.Future[Any] | None = None
        self.timer: asyncio.TimerHandle | None = None
        # The awaiting coroutine's context variables (its current span), when the pool
        # traces: the task runs in them on its thread.
        self.context: contextvars.Context | None = None
        self.trace: Trace | None = None  # the routing trace the caller asked for

    def made(self) -> Task:
        """The task, made from what the caller gave (on its thread: a task id is a
        system call), with the trace the caller asked for."""
        task = as_task(self.given)
        if self.trace is not None:
            task = traced(task, self.trace)
        self.task = task
        return task

    def deliver(self, source: concurrent.futures.Future[Any]) -> None:
        """Hand ``source``'s end to the awaiting coroutine, from any thread."""
        if source.cancelled():
            return  # never ran: whoever cancelled it ends the coroutine
        try:
            self.loop.call_soon_threadsafe(self._settle, source)
        except RuntimeError:
            # The loop is closed: nobody awaits this task any more.
            log.debug("task %s ended after its event loop closed", self.task.task_id)

    def fail(self, error: BaseException) -> None:
        """End the awaiting coroutine with ``error``, from any thread."""
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody awaits
            self.loop.call_soon_threadsafe(self._set_error, error)

    def _settle(self, source: concurrent.futures.Future[Any]) -> None:
        if self.timer is not None:
            self.timer.cancel()
        waiter = self.waiter
        if waiter.done():  # the caller was cancelled meanwhile
            return
        error = source.exception()
        if error is None:
            waiter.set_result(source.result())
        else:
            waiter.set_exception(error)

    def _set_error(self, error: BaseException) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if not self.waiter.done():
            self.waiter.set_exception(error)


class _Threads:
    """At most ``size`` threads running jobs from one FIFO queue.

    Thread-safe. Like a ``ThreadPoolExecutor``, but a thread is never started on the
    caller's thread: ``Thread.start()`` waits for the new thread to run, which on a
    busy machine held the event loop for hundreds of milliseconds while the first
    threads came up. A spawner thread of its own starts them, one more whenever a
    job finds no thread idle, up to ``size``.
    """

    def __init__(self, size: int, name: str, initializer: Callable[[], None]) -> None:
        self._size = size
        self._name = name
        self._initializer = initializer
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # a job is waiting, or shut down
        self._more = threading.Condition(lock)  # the spawner has a thread to start
        self._jobs: deque[tuple[concurrent.futures.Future[Any], Callable[[Any], Any], Any]] = (
            deque()
        )
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._wanted = 0  # threads the spawner is to start
        self._spawner: threading.Thread | None = None
        self._shutdown = False

    def submit(self, fn: Callable[[Any], Any], arg: Any) -> concurrent.futures.Future[Any]:
        """Run ``fn(arg)`` on one of the threads.

        Raises:
            RuntimeError: shut down.
        """
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            if self._shutdown:
                raise RuntimeError("cannot submit after shutdown")
            self._jobs.append((future, fn, arg))
            if self._idle:
                self._cond.notify()
            if self._idle < len(self._jobs) and len(self._threads) + self._wanted < self._size:
                self._wanted += 1
                if self._spawner is None:
                    self._spawner = threading.Thread(
                        target=self._spawn, name=f"{self._name}-spawner", daemon=True
                    )
                    self._spawner.start()  # once: for the first job
                self._more.notify()
        return future

    def counts(self) -> tuple[int, int]:
        """Threads started, and jobs waiting for one (a job cancelled meanwhile stays
        queued until a thread skips it, but waits for nothing)."""
        with self._cond:
            waiting = sum(1 for future, _, _ in self._jobs if not future.cancelled())
            return len(self._threads), waiting

    def shutdown(self, wait: bool = True) -> None:
        """Take no more jobs; the threads end once the queue is empty."""
        with self._cond:
            self._shutdown = True
            self._cond.notify_all()
            self._more.notify_all()
            spawner = self._spawner
        if not wait:
            return
        current = threading.current_thread()
        if spawner is not None and spawner is not current:
            spawner.join()
        with self._cond:
            threads = list(self._threads)
        for thread in threads:
            if thread is not current:
                thread.join()

    def _spawn(self) -> None:
        while True:
            with self._cond:
                while not self._wanted and not self._shutdown:
                    self._more.wait()
                if self._shutdown:
                    return
                self._wanted -= 1
                number = len(self._threads)
                thread = threading.Thread(
                    target=self._run, name=f"{self._name}_{number}", daemon=True
                )
                self._threads.append(thread)
                last = len(self._threads) >= self._size
            thread.start()
            if last:
                return

    def _run(self) -> None:
        self._initializer()
        while True:
            with self._cond:
                while not self._jobs and not self._shutdown:
                    self._idle += 1
                    self._cond.wait()
                    self._idle -= 1
                if not self._jobs:
                    return  # shut down, and nothing left to run
                future, fn, arg = self._jobs.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(arg)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)


class _Pump:
    """Hands one loop's new tasks to threads, a few per turn of the loop.

    Handing a task over wakes a thread that then competes with the loop for the GIL:
    a thousand handed over in one turn held the loop for 60 to 400 ms on two cores.
    A few per turn keeps each turn short (docs/async.md has the figures). Used on
    its loop's thread only.
    """

    __slots__ = ("_queue", "_scheduled", "_submit")

    def __init__(self, turn: Callable[[_Call], None]) -> None:
        self._submit = turn
        self._queue: deque[_Call] = deque()
        self._scheduled = False

    def push(self, call: _Call) -> None:
        self._queue.append(call)
        if not self._scheduled:
            self._scheduled = True
            call.loop.call_soon(self._turn, call.loop)

    def _turn(self, loop: asyncio.AbstractEventLoop) -> None:
        queue = self._queue
        for _ in range(min(_PER_TURN, len(queue))):
            self._submit(queue.popleft())
        if queue:
            loop.call_soon(self._turn, loop)
        else:
            self._scheduled = False


class AsyncWorkerPool:
    """A :class:`WorkerPool` for asyncio callers, shared with its synchronous callers.

    Thread-safe, and usable from several event loops (each in its own thread) at once.
    Every task runs on one of at most ``threads`` threads of this object; tasks beyond
    that wait for a thread in FIFO order, each no longer than ``pool.max_queue_wait``
    within its deadline, after which it ends like a task that found no worker:
    ``NoWorkerAvailable``, its dead letter stored first.

    Args:
        pool: the pool to run tasks on.
        threads: the most tasks running at once for asyncio callers (1..4096); by
            default the pool's ``pool.threads``. More threads than the workers have
            slots (the sum of their ``max_concurrent``) only wait for a worker.
        close_pool: close ``pool`` too when this is closed.

    Raises:
        ValueError: ``threads`` is not an integer in 1..4096.
    """

    def __init__(
        self, pool: WorkerPool, *, threads: int | None = None, close_pool: bool = False
    ) -> None:
        if threads is None:
            threads = pool.config.pool.threads
        _check_threads(threads)
        self._pool = pool
        self._clock = pool._state.clock
        self._threads = threads
        self._close_pool = close_pool
        self._lock = threading.Lock()
        self._executor: _Threads | None = None
        self._spare: _Threads | None = None
        self._calls: set[_Call] = set()
        self._pumps: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Pump] = (
            weakref.WeakKeyDictionary()
        )
        self._closed = False
        _live.add(self)

    @classmethod
    def from_yaml(
        cls, path: str | os.PathLike[str], *, threads: int | None = None, **kwargs: Any
    ) -> AsyncWorkerPool:
        """Build a pool from a YAML file (see :meth:`WorkerPool.from_yaml`, which takes
        ``kwargs``); closing this closes it."""
        if threads is not None:
            _check_threads(threads)  # before a pool (and its threads) is built
        return cls(WorkerPool.from_yaml(path, **kwargs), threads=threads, close_pool=True)

    @property
    def pool(self) -> WorkerPool:
        """The synchronous pool underneath: ``stats()``, ``workers()``, dead letters."""
        return self._pool

    @property
    def threads(self) -> int:
        return self._threads

    @property
    def closed(self) -> bool:
        return self._closed or self._pool.closed

    def in_flight(self) -> int:
        """Tasks accepted and not yet ended (running, or waiting for a thread)."""
        with self._lock:
            return len(self._calls)

    def stats(self) -> dict[str, int]:
        """This object's own counts (the pool's are ``pool.stats()``): ``threads``
        (the bound), ``started`` (threads running now), ``in_flight`` (tasks accepted
        and not ended) and ``waiting_for_thread`` (of those, not yet on a thread)."""
        with self._lock:
            executor = self._executor
            in_flight = len(self._calls)
        started, queued = (0, 0) if executor is None else executor.counts()
        return {
            "threads": self._threads,
            "started": started,
            "in_flight": in_flight,
            "waiting_for_thread": queued,
        }

    # -- running tasks -----------------------------------------------------------------

    async def execute(
        self,
        task: Task | Any,
        timeout: float | None = None,
        *,
        fallback: Callable[[], Any] | None = None,
        trace: Trace | bool | None = None,
    ) -> Any:
        """Run one task; the coroutine ends as :meth:`WorkerPool.execute` would.

        The task's deadline starts now: time spent waiting for a thread counts.
        Cancelling the awaiting task stops the task and charges no worker.

        Args:
            task, timeout, fallback: as for :meth:`WorkerPool.execute` (the fallback
                runs on the task's thread, never on the event loop).
            trace: as for :meth:`WorkerPool.execute`; with True,
                :func:`~npu_sync.trace.last_trace` in the asyncio task that awaited
                this returns the trace.

        Raises:
            TaskRejected: the task is bad.
            TaskFailed: no attempt succeeded; the dead letter is stored first
                (``NoWorkerAvailable`` when none could start, no thread included).
            InvalidTask: the task cannot be sent.
            TypeError: ``trace`` is not a Trace, True or False.
            PoolClosed: the pool is closed, or was closed while the task ran.
        """
        loop = asyncio.get_running_loop()
        call = _Call(task, timeout, fallback, loop, self._clock.monotonic())
        if trace is not None:
            call.trace = asked(trace)  # made here: last_trace() is the awaiting task's
        if self._pool._state.observer is not None:
            call.context = contextvars.copy_context()
        with self._lock:
            if self._closed:
                raise PoolClosed("the pool is closed")
            pump = self._pumps.get(loop)
            if pump is None:
                pump = self._pumps[loop] = _Pump(self._turn)
        pump.push(call)
        try:
            return await call.waiter
        except asyncio.CancelledError:
            if call.timer is not None:
                call.timer.cancel()
            self._cancel(call, call.stop.reason)
            raise

    async def map(
        self,
        tasks: Iterable[Task | Any],
        timeout: float | None = None,
        *,
        window: int | None = None,
    ) -> AsyncIterator[Any]:
        """Run tasks concurrently and yield their results in order.

        At most ``window`` tasks (default twice ``threads``) are in flight at once. The
        first exception is raised when its result is reached; the tasks still in flight
        then (or when the iteration is left early) are cancelled.
        """
        limit = window if window is not None else 2 * self._threads
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"window: must be an integer >= 1, got {window!r}")
        pending: deque[asyncio.Future[Any]] = deque()
        source = iter(tasks)
        try:
            for task in source:
                pending.append(asyncio.ensure_future(self.execute(task, timeout)))
                if len(pending) >= limit:
                    break
            while pending:
                result = await pending.popleft()
                for task in source:
                    pending.append(asyncio.ensure_future(self.execute(task, timeout)))
                    break
                yield result
        finally:
            for future in pending:
                future.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    def task(
        self,
        *,
        fallback: Callable[..., Any] | None = None,
        timeout: float | None = None,
        endpoint: str | None = None,
        idempotent: bool = True,
    ) -> Callable[[Callable[P, Any]], Callable[P, Awaitable[Any]]]:
        """``@npu_task`` for asyncio: the payload-building function becomes a coroutine
        function running its task here (arguments as for :func:`~npu_sync.npu_task`)."""

        def decorate(func: Callable[P, Any]) -> Callable[P, Awaitable[Any]]:
            built = NpuTask(
                func,
                self._pool,
                fallback=fallback,
                timeout=timeout,
                endpoint=endpoint,
                idempotent=idempotent,
            )

            @functools.wraps(func)
            async def run(*args: P.args, **kwargs: P.kwargs) -> Any:
                task, local = built._prepare(args, kwargs)
                return await self.execute(task, fallback=local)

            return run

        return decorate

    # -- closing -----------------------------------------------------------------------

    def close(self) -> None:
        """Stop accepting tasks, stop every task still running (its awaiting coroutine
        ends at once with ``PoolClosed``; no worker charged, no dead letter), and join
        this object's threads; then close the pool if it was given ``close_pool``.

        Blocks for as long as the stopped tasks take to end (a socket shut down ends
        at once); from a coroutine, await :meth:`aclose` instead. Idempotent.
        """
        with self._lock:
            self._closed = True
            calls = list(self._calls)
            executor, spare = self._executor, self._spare
        for call in calls:
            call.stop.stop(_CLOSED_WHILE_RUNNING)
            self._cancel(call, _CLOSED_WHILE_RUNNING)
            call.fail(PoolClosed(_CLOSED_WHILE_RUNNING))  # one each: tracebacks grow
        # A thread of this pool (a hook, a fallback) cannot wait for itself.
        inside = bool(getattr(self._pool._local, "depth", 0))
        for ex in (executor, spare):
            if ex is not None:
                ex.shutdown(wait=not inside)
        if self._close_pool:
            self._pool.close()

    async def aclose(self) -> None:
        """:meth:`close` on a thread, so that the event loop goes on meanwhile."""
        await asyncio.to_thread(self.close)

    async def __aenter__(self) -> AsyncWorkerPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<AsyncWorkerPool threads={self._threads} closed={self.closed} {self._pool!r}>"

    # -- internals ---------------------------------------------------------------------

    def _turn(self, call: _Call) -> None:
        """Accept ``call`` and hand it to a thread (on its loop, from the pump)."""
        if call.waiter.done():
            return  # cancelled before its turn
        try:
            self._accept(call)
        except BaseException as exc:  # InvalidTask, PoolClosed: the caller's to see
            call.waiter.set_exception(exc)
            return
        self._submit(call)

    def _accept(self, call: _Call) -> None:
        """On the loop: the deadline, and a place among the accepted tasks. The task
        itself (its id: a system call; its body) is made on its thread."""
        pool = self._pool
        given = call.given
        # The deadline counts from the caller's call, not from this turn.
        now = self._clock.monotonic()
        timed = given if isinstance(given, Task) else _NO_TASK
        call.deadline = pool._runner.deadline(timed, call.timeout) - (now - call.started)
        with self._lock:
            if self._closed or pool.closed:
                raise PoolClosed("the pool is closed")
            self._calls.add(call)
        # A task still waiting for a thread when it may wait no more ends then.
        limit = min(call.deadline, call.started + pool.config.pool.max_queue_wait)
        call.timer = call.loop.call_later(max(limit - now, 0.0), self._expire, call)

    def _submit(self, call: _Call) -> None:
        """Hand ``call`` to a thread (on its loop, from the pump)."""
        with self._lock:
            if self._closed or call not in self._calls:
                # Cancelled, or closing, while it waited for the pump: close() ends it,
                # and shuts only the threads it saw.
                return
            executor = self._executor_locked()
        try:
            if call.context is None:
                future = executor.submit(self._work, call)
            else:
                run = functools.partial(call.context.run, self._work)  # type: ignore[call-arg]
                future = executor.submit(run, call)
        except RuntimeError:  # closed between the check and here
            self._never_ran(call)
            call.fail(PoolClosed("the pool is closed"))
            return
        call.future = future
        future.add_done_callback(call.deliver)

    def _after_fork(self) -> None:
        """In a child, right after ``fork()``: the parent's threads do not exist here,
        and its tasks are the parent's. Their stops are dropped, never used: stopping
        one would shut a socket the child shares with the parent, cutting the parent's
        request. The lock may have been held by a thread that is gone."""
        self._lock = threading.Lock()
        self._executor = self._spare = None
        self._calls = set()
        self._pumps = weakref.WeakKeyDictionary()

    def _executor_locked(self) -> _Threads:
        if self._executor is None:
            self._executor = _Threads(self._threads, "npu-sync-aio", self._pool._mark_own_thread)
        return self._executor

    def _work(self, call: _Call) -> Any:
        """A task's whole life, on one of this pool's threads: made from what the
        caller gave (``InvalidTask`` as ``execute`` raises it: before the task counts
        as submitted), then run as ``WorkerPool.execute`` runs it."""
        pool = self._pool
        try:
            task = call.made()
            body = task.body()
            if call.loop.is_closed():
                raise Stopped(task.task_id)  # nobody can hear of its end
            pool._enter()  # PoolClosed once the pool is closed
            try:
                return pool._execute(task, body, call.deadline, call.fallback, call.stop)
            finally:
                pool._leave()
        except Stopped:
            if call.stop.reason == _CLOSED_WHILE_RUNNING:
                raise PoolClosed(
                    f"task {call.task.task_id} was stopped: {_CLOSED_WHILE_RUNNING}"
                ) from None
            raise
        finally:
            self._take(call)

    def _cancel(self, call: _Call, reason: str) -> None:
        """Stop ``call``'s task; if it never reached a thread, it is over now."""
        call.stop.stop(reason)
        future = call.future
        if future is None or future.cancel():
            self._never_ran(call)  # the pump skips a call no longer accepted

    def _expire(self, call: _Call) -> None:
        """On the loop, when the task may wait for a thread no longer: if it still
        waits, it ends as a task no worker could take, its dead letter stored first."""
        future = call.future
        if future is not None and not future.cancel():
            return  # running, or over
        with self._lock:
            # cancel() is true for a future cancelled before: who ends the call is
            # whoever takes it. Once closing, close() does (and shuts only the
            # threads it saw: a spare started now would be left running).
            if self._closed or call not in self._calls:
                return
            self._calls.remove(call)
            spare = self._spare
            if spare is None:
                # A pool thread: close() from a hook told of the dead letter there
                # must not wait for the very task it runs in.
                spare = self._spare = _Threads(
                    1, "npu-sync-aio-letters", self._pool._mark_own_thread
                )
        try:
            letter = spare.submit(self._dead_letter, call)
        except RuntimeError:  # closing: close() has told the caller
            return
        letter.add_done_callback(call.deliver)

    def _dead_letter(self, call: _Call) -> Any:
        """Store the dead letter of a task that never got a thread, then raise."""
        pool = self._pool
        task = call.made()
        task.body()  # InvalidTask, as execute raises it
        pool._enter()  # PoolClosed once the pool is closed
        try:
            waited = pool.config.pool.max_queue_wait
            reason = (
                f"no thread free for the task within its wait (threads={self._threads}, "
                f"pool.max_queue_wait={waited:g}s)"
            )
            exhausted = Exhausted(reason, [], pool._state.clock.time())
            pool._runner.dead_letter(task, exhausted, call.deadline)
        finally:
            pool._leave()

    def _never_ran(self, call: _Call) -> None:
        """A task whose thread never took it: over."""
        self._take(call)

    def _take(self, call: _Call) -> bool:
        """Whether ``call`` was still accepted; it is no longer."""
        with self._lock:
            if call in self._calls:
                self._calls.remove(call)
                return True
            return False


_live: weakref.WeakSet[AsyncWorkerPool] = weakref.WeakSet()


def _reinit_after_fork() -> None:
    for apool in list(_live):
        apool._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reinit_after_fork)


def _check_threads(threads: object) -> None:
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise ValueError(f"threads: must be an integer, got {threads!r}")
    if not 1 <= threads <= _MAX_THREADS:
        raise ValueError(f"threads: must be 1..{_MAX_THREADS}, got {threads}")
