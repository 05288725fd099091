"""The routing trace of one task: every worker considered, every attempt, who was charged.

Asked for with ``pool.execute(task, trace=Trace())`` (the object given is filled as the
task runs, whatever its end) or ``trace=True`` (the pool makes one, which
:func:`last_trace` returns afterwards in the caller's thread or asyncio task), and
always kept for a task that fails: ``TaskFailed.trace``
and the dead letter's ``trace``. A failed task's trace starts at its first failed
attempt, so that a task that succeeds at once pays nothing for it: its first choice
then names the worker chosen, without the others; a task that fails before any
attempt has one from the choice that found no worker.

A module of the vocabulary layer: plain records, importing nothing from the package.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, fields
from typing import Any, Protocol

__all__ = ["TaskWatch", "Trace", "TraceStep", "last_trace"]


@dataclass(frozen=True, slots=True)
class TraceStep:
    """One step of a task's routing.

    ``kind`` is ``choice`` (a worker was chosen: ``worker_id``; ``considered`` says for
    the other workers, at most 20 of them, why they were not; ``unlisted`` counts the
    rest; ``worker_id`` None: none could be had, and the task ends), ``attempt`` (an
    attempt ended: ``outcome``, ``status``, ``error``, ``duration``, ``charged``),
    ``hedge`` (a second attempt sent while the first went on) or ``note`` (admission's
    word: a refusal, the retry budget spent, why the task gave up).
    """

    kind: str
    at: float
    worker_id: str | None = None
    considered: tuple[tuple[str, str], ...] = ()
    outcome: str | None = None
    status: int | None = None
    error: str | None = None
    duration: float | None = None
    charged: str | None = None
    text: str | None = None
    unlisted: int = 0  # workers of a choice not named in ``considered`` (a large fleet)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"kind": self.kind, "at": self.at}
        for name in ("worker_id", "outcome", "status", "error", "duration", "charged", "text"):
            value = getattr(self, name)
            if value is not None:
                data[name] = value
        if self.considered:
            data["considered"] = [{"worker_id": w, "why": why} for w, why in self.considered]
        if self.unlisted:
            data["unlisted"] = self.unlisted
        return data

    def __str__(self) -> str:
        if self.kind == "choice":
            others = "; ".join(f"{w}: {why}" for w, why in self.considered)
            if self.unlisted:
                others += f"; and {self.unlisted} more"
            if self.worker_id is None:
                return "no worker chosen" + (f" ({others})" if others else "")
            return f"chose {self.worker_id}" + (f" (not {others})" if others else "")
        if self.kind == "attempt":
            took = f" in {self.duration * 1000:.0f} ms" if self.duration is not None else ""
            what = self.outcome or "?"
            if self.error:
                what += f": {self.error}"
            return f"attempt on {self.worker_id}: {what}{took}; charged: {self.charged}"
        if self.kind == "hedge":
            return f"hedged to {self.worker_id}"
        return self.text or ""


_STEP_FIELDS: frozenset[str] = frozenset(f.name for f in fields(TraceStep))


class Trace:
    """The routing of one task, in order. Thread-safe: a hedged task's two attempts
    add steps from two threads.

    Args:
        task_id: set when the task starts, if not given; if given, the id of the task
            it is given to. A trace is one task's: given to a second task, it is
            refused (``InvalidTask``).
    """

    __slots__ = ("_lock", "steps", "task_id")

    def __init__(self, task_id: str | None = None) -> None:
        self.task_id = task_id
        self.steps: list[TraceStep] = []
        self._lock = threading.Lock()

    def __getstate__(self) -> tuple[str | None, list[TraceStep]]:
        # The lock stays behind (a lock does not pickle): a TaskFailed carrying its
        # trace crosses process boundaries.
        with self._lock:
            return self.task_id, list(self.steps)

    def __setstate__(self, state: tuple[str | None, list[TraceStep]]) -> None:
        self.task_id, steps = state
        self.steps = list(steps)
        self._lock = threading.Lock()

    def add(self, step: TraceStep) -> None:
        with self._lock:
            self.steps.append(step)

    @property
    def workers(self) -> list[str]:
        """The workers attempts went to, in order (a worker tried twice appears twice)."""
        return [s.worker_id for s in self.steps if s.kind == "attempt" and s.worker_id]

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable: ``{"task_id", "steps": [...]}``."""
        with self._lock:
            steps = list(self.steps)
        return {"task_id": self.task_id, "steps": [s.to_dict() for s in steps]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trace:
        trace = cls(data.get("task_id"))
        for raw in data.get("steps", ()):
            # Keys this release does not know (a record a newer one wrote) are left out.
            known = {k: v for k, v in raw.items() if k in _STEP_FIELDS}
            considered = tuple((c["worker_id"], c["why"]) for c in known.pop("considered", ()))
            trace.steps.append(TraceStep(considered=considered, **known))
        return trace

    def __str__(self) -> str:
        with self._lock:
            steps = list(self.steps)
        return "\n".join(f"{i + 1}. {step}" for i, step in enumerate(steps))

    def __repr__(self) -> str:
        return f"<Trace {self.task_id}: {len(self.steps)} steps>"


_LAST: ContextVar[Trace | None] = ContextVar("npu_sync_last_trace", default=None)


def last_trace() -> Trace | None:
    """The trace the pool made for the last task handed to it with ``trace=True`` from
    this context (this thread, or this asyncio task), whatever its end; None if none was.

    Set when the task is handed over (``execute``, ``submit``, an ``await`` on
    ``AsyncWorkerPool.execute``) and filled as it runs: after ``execute`` returns or
    raises it is complete, after ``submit`` once the future is done. A task given a
    ``Trace()`` of the caller's own, or none, leaves it as it was.
    """
    return _LAST.get()


def asked(trace: Trace | bool | None) -> Trace | None:
    """The trace a ``trace=`` argument of the pool's asks for: the one given, a new one
    for True (then :func:`last_trace` in this context), none for None or False.

    Raises:
        TypeError: ``trace`` is none of those.
    """
    if trace is True:
        made = Trace()
        _LAST.set(made)
        return made
    if trace is None or trace is False:
        return None
    if isinstance(trace, Trace):
        return trace
    raise TypeError(
        f"trace: expected a Trace, True or False, got {type(trace).__name__} {trace!r:.80}"
    )


class TaskWatch(Protocol):
    """Someone following one task from its start to its end, e.g. a tracing system.

    The pool asks its observer for one when a task starts (on the caller's thread) and
    then: fills ``trace`` as the task runs, calls ``attempt_headers`` just before each
    attempt is sent (on the caller's thread, or a hedge thread: must be thread-safe),
    and ``end`` once the task is over, whatever its end.
    """

    @property
    def trace(self) -> Trace:
        """The routing trace the task fills (the caller's, or one of the watch's own)."""
        ...

    def attempt_headers(self, worker_id: str, attempt: int) -> Mapping[str, str]:
        """Extra headers for one attempt on ``worker_id`` (1, 2, ...: ``X-NPU-Attempt``).
        The pool's own and the worker's auth headers win over these."""
        ...

    def end(self, error: BaseException | None) -> None:
        """The task is over: ``error`` is what the caller is raised, None for a result
        (a worker's answer, or the fallback's)."""
        ...
