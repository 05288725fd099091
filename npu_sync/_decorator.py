"""``@npu_task``: a function that builds a payload becomes a function that runs it."""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
from collections.abc import Callable, Collection
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, cast, overload

from npu_sync._pool import WorkerPool, get_pool
from npu_sync.task import Task

P = ParamSpec("P")
Q = ParamSpec("Q")
R = TypeVar("R")
S = TypeVar("S")


class NpuTask(Generic[P]):
    """A decorated task function. Thread-safe when its pool is.

    Calling it builds the payload with the wrapped function and runs it on the pool;
    ``submit`` does the same on the pool's threads and returns a future.
    """

    def __init__(
        self,
        func: Callable[P, Any],
        pool: WorkerPool | None,
        *,
        fallback: Callable[P, Any] | None,
        timeout: float | None,
        endpoint: str | None,
        idempotent: bool,
        priority: str | None = None,
        requires: Collection[str] = frozenset(),
        prefers: Collection[str] = frozenset(),
    ) -> None:
        functools.update_wrapper(self, func)
        self._priority = priority
        self._func = func
        self._pool = pool
        self._fallback = fallback
        self._timeout = timeout
        self._endpoint = endpoint
        self._idempotent = idempotent
        # Checked now, so that a bad requirement fails at decoration, not at a call.
        probe = Task(payload=None, requires=requires, prefers=prefers)
        self._requires = probe.requires
        self._prefers = probe.prefers

    @property
    def pool(self) -> WorkerPool:
        """The pool tasks run on: the one given, else the default pool."""
        return self._pool if self._pool is not None else get_pool()

    def _prepare(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Task, Callable[[], Any] | None]:
        built = self._func(*args, **kwargs)
        task = (
            built
            if isinstance(built, Task)
            else Task(
                payload=built,
                endpoint=self._endpoint,
                timeout=self._timeout,
                idempotent=self._idempotent,
                priority=self._priority,
                requires=self._requires,
                prefers=self._prefers,
            )
        )
        fallback = self._fallback
        local = None if fallback is None else functools.partial(fallback, *args, **kwargs)
        return task, local

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Any:
        return self._call(*args, **kwargs)

    def submit(self, *args: P.args, **kwargs: P.kwargs) -> concurrent.futures.Future[Any]:
        """Run on the pool's threads; the future ends as a direct call would."""
        task, local = self._prepare(args, kwargs)
        return self.pool.submit(task, fallback=local)

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> NpuTask[P]: ...

    @overload
    def __get__(
        self: NpuTask[Concatenate[S, Q]], instance: S, owner: type | None = None
    ) -> _BoundNpuTask[Q]: ...

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        # Behave like a function when used on a method: bound to the instance, with
        # submit() bound too.
        if instance is None:
            return self
        # The overload above has checked that the first parameter takes the instance.
        return _BoundNpuTask(cast("NpuTask[Concatenate[Any, ...]]", self), instance)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        task, local = self._prepare(args, kwargs)
        return self.pool.execute(task, fallback=local)


class _BoundNpuTask(Generic[P]):
    # An NpuTask defined on a class, bound to one instance. Like a bound method it shows
    # the function's name, docstring and signature (without ``self``); __doc__ is a
    # property, so this class has no docstring of its own.

    __slots__ = ("__self__", "__wrapped__")

    def __init__(self, task: NpuTask[Concatenate[Any, P]], instance: object) -> None:
        self.__wrapped__ = task
        self.__self__ = instance

    @property
    def __doc__(self) -> str | None:  # type: ignore[override]
        return self.__wrapped__.__doc__

    @property
    def __name__(self) -> str:
        return str(getattr(self.__wrapped__, "__name__", "?"))

    @property
    def __signature__(self) -> inspect.Signature:
        signature = inspect.signature(self.__wrapped__)
        return signature.replace(parameters=list(signature.parameters.values())[1:])

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Any:
        return self.__wrapped__._call(self.__self__, *args, **kwargs)

    def submit(self, *args: P.args, **kwargs: P.kwargs) -> concurrent.futures.Future[Any]:
        """Run on the pool's threads; the future ends as a direct call would."""
        return self.__wrapped__.submit(self.__self__, *args, **kwargs)

    @property
    def pool(self) -> WorkerPool:
        return self.__wrapped__.pool

    def __repr__(self) -> str:
        return f"<bound npu_task {self.__name__} of {self.__self__!r}>"


def npu_task(
    pool: WorkerPool | None = None,
    *,
    fallback: Callable[..., Any] | None = None,
    timeout: float | None = None,
    endpoint: str | None = None,
    idempotent: bool = True,
    priority: str | None = None,
    requires: Collection[str] = frozenset(),
    prefers: Collection[str] = frozenset(),
) -> Callable[[Callable[P, Any]], NpuTask[P]]:
    """Turn a payload-building function into one that runs the task on a pool.

    Args:
        pool: the pool to use; default the process-wide :func:`get_pool` (looked up
            at call time, so decorating does not build a pool).
        fallback: called with the same arguments when the task fails on every
            worker; its result is returned and no dead letter is stored. If it
            raises too, the dead letter is stored and ``TaskFailed`` raised.
        timeout, endpoint, idempotent, priority, requires, prefers: the task options
            (see :class:`Task`), unless the function returns a ``Task`` itself.

    The wrapper keeps the function's name, docstring and signature.
    """
    if callable(pool) and not isinstance(pool, WorkerPool):
        raise TypeError("use @npu_task() or @npu_task(pool), not bare @npu_task")

    def decorate(func: Callable[P, Any]) -> NpuTask[P]:
        return NpuTask(
            func,
            pool,
            fallback=fallback,
            timeout=timeout,
            endpoint=endpoint,
            idempotent=idempotent,
            priority=priority,
            requires=requires,
            prefers=prefers,
        )

    if priority is not None:
        Task({}, priority=priority)  # a name of the wrong form fails at decoration
    return decorate
