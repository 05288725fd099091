"""Tasks: one unit of work for a worker, validated when built."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

# Attempt lives in its own module (errors.py names it too); still importable from here.
from npu_sync._attempt import Attempt
from npu_sync.errors import InvalidTask
from npu_sync.trace import Trace

__all__ = ["Attempt", "Task", "as_task", "new_task_id", "priority_scope", "traced"]

_NONE: frozenset[str] = frozenset()  # the needs of a task that needs nothing
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_V4_CLEAR = ~((0xF000 << 64) | (0xC000 << 48))
_V4_SET = (0x4000 << 64) | (0x8000 << 48)


# Random bits for the next task ids, read from the system in batches: os.urandom()
# gives up the GIL for its system call, and with many caller threads each such release
# hands the GIL to a waiting thread and back, two context switches for 16 bytes.
# list.pop() and list.extend() are atomic, so threads share the list without a lock;
# two threads refilling it at once both add fresh bits. A forked child starts empty,
# or it would hand out the ids its parent hands out too.
_ID_BATCH = 256
_spare_ids: list[int] = []
if hasattr(os, "register_at_fork"):  # pragma: no branch - POSIX
    os.register_at_fork(after_in_child=_spare_ids.clear)


def new_task_id() -> str:
    """A random (version 4) UUID as 32 hex digits.

    Equivalent to ``uuid.uuid4().hex`` at a fraction of the cost: it is made for every
    task. Thread-safe; a forked child never repeats its parent's ids.
    """
    try:
        bits = _spare_ids.pop()
    except IndexError:
        raw = os.urandom(16 * _ID_BATCH)
        batch = [int.from_bytes(raw[i : i + 16], "big") for i in range(0, len(raw), 16)]
        bits = batch.pop()
        _spare_ids.extend(batch)
    return "%032x" % (bits & _V4_CLEAR | _V4_SET)


@dataclass(frozen=True, slots=True)
class Task:
    """One unit of work for a worker: a JSON payload POSTed to ``endpoint``.

    Immutable and so safe to share between threads.

    Args:
        payload: any JSON-serialisable value; the pool does not interpret it.
        endpoint: path on the worker, default the pool's (``/inference``).
        timeout: the task's whole deadline in seconds, across every attempt and wait;
            ``None`` takes the pool's ``timeouts.task``.
        idempotent: whether a retry after the request may have reached a worker is
            safe. Non-idempotent tasks are retried only when the request provably never
            reached the worker (connect errors, an open breaker).
        task_id: sent as ``X-NPU-Task-Id`` on every attempt; a uuid4 by default.
            Printable ASCII, at most 200 characters.
        priority: the task's priority class (``priority.classes``: by default
            ``interactive``, ``standard``, ``batch``); ``None`` takes
            ``priority.default``. Decides who is served first while tasks wait for a
            worker (see docs/priority.md); a name the pool does not know raises
            ``InvalidTask`` when the task is run.
        requires: what a worker must have to be given the task: capability names
            (``"vision"``, matched against a worker's ``capabilities``) and tags as
            ``"key=value"`` (``"location=lab"``, matched against its ``tags``). A task
            no configured worker meets is rejected at once (``TaskRejected``).
        prefers: the same, as a preference: a worker meeting all of it is chosen when
            one has room now, else any worker meeting ``requires``.
        size: how big the task is, in a unit of the caller's choosing for its model
            (tokens, pixels, bytes): its answer time is learnt per unit of size, so
            that workers given larger tasks are not taken for slower ones. A positive
            finite number, or None.
    """

    payload: Any
    endpoint: str | None = None
    timeout: float | None = None
    idempotent: bool = True
    task_id: str = field(default_factory=lambda: new_task_id())
    priority: str | None = None
    # Filled as the task runs when given (see npu_sync.trace); not part of its identity.
    trace: Trace | None = field(default=None, compare=False, repr=False)
    requires: Collection[str] = _NONE
    prefers: Collection[str] = _NONE
    size: float | None = None

    def __post_init__(self) -> None:
        # Checks and normalises the fields given, nothing else, and leaves a field at
        # its default as it is: a bare payload's task (plain_task) skips this, and
        # tests/test_task.py calls it on one to prove that skipping it changes nothing.
        if self.size is not None and (
            isinstance(self.size, bool)
            or not isinstance(self.size, (int, float))
            or not math.isfinite(self.size)
            or self.size <= 0
        ):
            raise InvalidTask(f"task size must be a positive number, got {self.size!r}")
        if self.requires is not _NONE or self.prefers is not _NONE:
            # Off the path of a task that needs nothing: it keeps the shared defaults.
            object.__setattr__(self, "requires", _needs("requires", self.requires))
            object.__setattr__(self, "prefers", _needs("prefers", self.prefers))
        if self.endpoint is not None and (
            not isinstance(self.endpoint, str) or not self.endpoint.startswith("/")
        ):
            raise InvalidTask(
                f"task endpoint must be a path starting with '/', got {self.endpoint!r}"
            )
        if self.timeout is not None:
            if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)):
                raise InvalidTask(f"task timeout must be a number of seconds, got {self.timeout!r}")
            if not math.isfinite(self.timeout) or self.timeout <= 0:
                raise InvalidTask(f"task timeout must be > 0 seconds, got {self.timeout!r}")
        if not isinstance(self.task_id, str) or not self.task_id or len(self.task_id) > 200:
            raise InvalidTask(
                f"task_id must be a non-empty string of at most 200 chars, got {self.task_id!r}"
            )
        if self.priority is not None and (
            not isinstance(self.priority, str)
            or not self.priority
            or not self.priority.isprintable()
        ):
            raise InvalidTask(
                f"task priority must be a class name (a printable string), got {self.priority!r}"
            )
        if not self.task_id.isprintable():
            raise InvalidTask(f"task_id must be printable, got {self.task_id!r}")
        if not self.task_id.isascii():
            # Sent as the X-NPU-Task-Id header: beyond ASCII, HTTP clients refuse it or
            # servers decode it differently, and a worker could not de-duplicate by it.
            raise InvalidTask(
                f"task_id must be ASCII (it is sent as the X-NPU-Task-Id header), "
                f"got {self.task_id!r}"
            )

    def body(self) -> bytes:
        """The payload encoded as JSON; raises InvalidTask when it cannot be."""
        try:
            return _ENCODER.encode(self.payload).encode()
        except (TypeError, ValueError) as exc:
            raise InvalidTask(
                f"task {self.task_id} payload is not JSON-serialisable: {exc}"
            ) from None


# The class of the tasks started in the current context that name none (a Flask
# route's), and whether any scope was ever entered: until one is, as_task() reads no
# context variable.
_SCOPED: ContextVar[str | None] = ContextVar("npu_sync_priority", default=None)
_scopes_used = False


@contextmanager
def priority_scope(name: str) -> Iterator[None]:
    """Tasks run from this context that name no priority class take ``name``.

    The class is read when the task is handed to the pool (``execute``, ``submit``,
    ``map``, a decorated function), on the caller's thread; the Flask extension's
    ``npu_priority`` route decorator enters one around a view. An unknown name raises
    ``InvalidTask`` when such a task is run.
    """
    global _scopes_used
    Task({}, priority=name)  # checks the name's form now
    _scopes_used = True
    token = _SCOPED.set(name)
    try:
        yield
    finally:
        _SCOPED.reset(token)


_MAX_NEEDS = 32
_MAX_NEED = 201  # a tag: key, "=", value of at most 100 characters each


def _needs(key: str, value: object) -> frozenset[str]:
    """``requires``/``prefers`` checked: capability names and ``key=value`` tags."""
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, Collection) or isinstance(items, (bytes, dict)):
        raise InvalidTask(
            f"task {key} must be a name or a collection of names, got {type(value).__name__}"
        )
    if len(items) > _MAX_NEEDS:
        raise InvalidTask(f"task {key} must have at most {_MAX_NEEDS} items, got {len(items)}")
    for item in items:
        if not isinstance(item, str):
            raise InvalidTask(f"task {key} items must be strings, got {item!r}")
        name, eq, tag_value = item.partition("=")
        if (
            not name
            or (eq and not tag_value)
            or "=" in tag_value
            or len(item) > _MAX_NEED
            or not item.isprintable()
            or any(ch.isspace() for ch in item)
        ):
            raise InvalidTask(
                f"task {key} items must be a capability (`vision`) or a tag (`location=lab`) "
                f"without spaces, got {item!r}"
            )
    return frozenset(items)


def current_scope() -> str | None:
    """The class of the :func:`priority_scope` this context is in, if any."""
    return _SCOPED.get() if _scopes_used else None


def _plain_task_maker() -> Callable[[Any], Task]:
    """``Task(payload=p)`` for a bare payload, without the dataclass's ``__init__``:
    every field but the payload and the id takes its default, which
    ``__post_init__`` has nothing to check in, and the id is made valid. Each field is
    set through its slot's descriptor (what ``object.__setattr__`` reaches, without
    its lookup), in half the time of the checked constructor, on every plain task.
    ``tests/test_task.py`` checks that the two make equal tasks, field by field."""
    make = object.__new__
    setters = []
    for f in dataclasses.fields(Task):
        if f.name not in ("payload", "task_id"):
            if f.default is dataclasses.MISSING:
                raise TypeError(
                    f"Task.{f.name} has no plain default (none, or a default_factory): "
                    "update _plain_task_maker"
                )
            setters.append((getattr(Task, f.name).__set__, f.default))
    set_payload = getattr(Task, "payload").__set__  # noqa: B009 - the slot's descriptor
    set_id = getattr(Task, "task_id").__set__  # noqa: B009
    defaults = tuple(setters)

    def plain_task(payload: Any) -> Task:
        task = make(Task)
        set_payload(task, payload)
        set_id(task, new_task_id())
        for setter, value in defaults:
            setter(task, value)
        return task

    return plain_task


plain_task = _plain_task_maker()


def as_task(task: Task | Any) -> Task:
    """Accept a Task or a bare payload; one naming no class takes the scope's, if any."""
    if not _scopes_used:
        return task if isinstance(task, Task) else plain_task(task)
    scoped = _SCOPED.get()
    if scoped is None:  # outside any scope: as if none had ever been entered
        return task if isinstance(task, Task) else plain_task(task)
    if isinstance(task, Task):
        if task.priority is not None:
            return task
        return dataclasses.replace(task, priority=scoped)
    return Task(payload=task, priority=scoped)


def traced(task: Task, trace: Trace) -> Task:
    """``task`` with ``trace`` to fill as it runs.

    Raises:
        InvalidTask: ``trace`` is another task's (a trace given to a second task
            would mix the two tasks' steps).
    """
    if trace.task_id is None:
        trace.task_id = task.task_id
    elif trace.task_id != task.task_id:
        raise InvalidTask(
            f"trace: already the trace of task {trace.task_id!r}, not of task "
            f"{task.task_id!r}: give each task a Trace() of its own"
        )
    return dataclasses.replace(task, trace=trace)
