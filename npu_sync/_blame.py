"""Who is charged for a failed attempt: the task, the worker or the operator.

A breaker must measure only its worker (docs/reliability.md, "Who is charged for a
failure"). Most answers say plainly whose fault they are: a timeout or a 503 is the
worker's, a protocol's "unsupported task type" is the task's. Two kinds do not:

* an answer that is the operator's: a 404 or 405 to the inference path itself means
  the entry does not point at an NPU worker (another service, a missing base path).
  :func:`misrouted` turns it into a ``MISCONFIGURED`` outcome: the worker is taken
  out, with a message saying what to fix, and the task goes elsewhere;
* an answer that is the task's *or* the worker's — a 4xx refusal, a protocol's failed
  task, an HTTP 500, an answer over the size limit (``Outcome.suspect``). Only another
  worker can tell: :class:`Blame` holds the charge and asks one.

Nothing here does I/O or takes a lock: :class:`Blame` belongs to the one thread that
runs a task, and the pool charges what it returns under its own lock.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import NamedTuple

from npu_sync._retry import NOT_A_WORKER, Kind, Outcome
from npu_sync._worker import Worker

__all__ = ["Blame", "Held", "Verdict", "misrouted", "proven_route", "route_answered"]

_NOT_A_ROUTE = frozenset({404, 405})


def misrouted(outcome: Outcome, method: str, path: str) -> Outcome:
    """``outcome`` as the operator's fault when it is a 404 or 405 to ``path``, the
    inference path itself: the entry is not an NPU worker. Anything else unchanged.

    Call only for the inference path: a 404 to an endpoint a task names is a refusal
    like any other 4xx (the task may name an endpoint that does not exist).
    """
    if outcome.kind is not Kind.REJECTED or outcome.status not in _NOT_A_ROUTE:
        return outcome
    return Outcome(
        Kind.MISCONFIGURED,
        outcome.value,
        outcome.status,
        f"{NOT_A_WORKER}: {method} {path} → {outcome.status} (check its url, port and base path)",
        processed=False,
    )


def proven_route(worker: Worker) -> bool:
    """Whether ``worker``'s inference path has answered a task at its current address:
    it is an NPU worker there, so a later 404 or 405 is a refusal of that task (a
    worker answering 404 for a document it lacks), judged as any other, not
    misrouting."""
    return worker.routed == worker.generation


def route_answered(worker: Worker, generation: int) -> None:
    """``worker``'s inference path answered a task at its address ``generation``.
    Called without the pool's lock: a stale generation only loses the proof."""
    worker.routed = generation


class Verdict(enum.Enum):
    """What :meth:`Blame.judge` decided about a suspect answer."""

    HOLD = "hold"
    """Unknown yet: charge nobody now, ask another worker."""
    TASK = "task"
    """A second worker answered the same way: the task's fault; nobody is charged."""


class Held(NamedTuple):
    """A charge held back until the task proves it was the worker's."""

    worker: Worker
    error: str | None
    duration: float  # how long the worker took to give that answer
    refusal: bool  # a 4xx: the worker refused a task it should have run
    stalled: bool = False  # cut for silence after ``duration``


class _Family(NamedTuple):
    """Answers that say the same thing about a task, and what a worker's is worth."""

    name: str
    # The worker said it failed (HTTP 500, an answer too large): its first such answer
    # for a task is charged at once, as in any failure; further ones are held.
    charged_at_once: bool
    # A second worker answering the same way ends the task: it is the task's fault.
    stops: bool


_REFUSED = _Family("refused", False, True)  # a 4xx
_FAILED_TASK = _Family("failed task", False, True)  # a protocol's 2xx "failed"
_SERVER_ERROR = _Family("server error", True, False)  # HTTP 500
_TOO_LARGE = _Family("too large", True, True)  # over transport.max_response_bytes
# Cut for silence (npu_sync._stall): frozen, or the task is heavy. The first cut is
# charged at once; later ones only if the task then runs faster elsewhere (proven()).
_STALLED = _Family("stalled", True, False)


def _family(outcome: Outcome) -> _Family:
    if outcome.kind is Kind.REJECTED:
        return _REFUSED
    if outcome.stalled:
        return _STALLED
    if outcome.error_kind == "too_large":
        return _TOO_LARGE
    status = outcome.status
    if status is not None and 200 <= status < 300:
        return _FAILED_TASK
    return _SERVER_ERROR


class Blame:
    """One task's suspect answers, and whose fault they turn out to be.

    The rules (docs/reliability.md, "Who is charged for a failure"):

    * a refusal (4xx) or a protocol's failed task is held while another worker can be
      asked; a second worker answering the same way makes it the task's (nobody is
      charged, the task ends); with no other worker to ask, the answer is taken at
      its word: a 4xx is the task's, a failed task the worker's;
    * an HTTP 500 or an answer over the size limit is the worker saying it failed: a
      task's first one is charged at once, the next ones are held; two answers over
      the limit from two workers end the task;
    * held answers are charged when the task succeeds on some worker: they were the
      workers' after all.

    Not thread-safe: used by the thread that runs the task (a hedge's outcome is handed
    to it on that thread).
    """

    __slots__ = ("_charged", "_first", "held", "same")

    def __init__(self) -> None:
        self.held: list[Held] = []
        self._first: dict[str, str] = {}  # family -> the first worker that answered so
        self._charged = False  # a suspect answer was charged at once
        self.same: tuple[str, str] | None = None  # the two workers that agreed

    def hold(self, worker_id: str, outcome: Outcome, others: Callable[[], bool]) -> bool:
        """Whether the charge for a suspect answer from ``worker_id`` waits (is not
        made when it comes).

        Args:
            outcome: a suspect answer.
            others: whether another worker could still be asked (called only when it
                decides: it scans the workers).
        """
        if outcome.kind is Kind.REJECTED or self._charged:
            return True  # a refusal is never charged when it comes
        family = _family(outcome)
        first = self._first.get(family.name)
        if family.stops and first is not None and first != worker_id:
            return True  # a second worker agreeing: the task's (see judge)
        if family.charged_at_once or not others():
            self._charged = True
            return False
        return True

    def judge(self, worker: Worker, outcome: Outcome, duration: float, held: bool) -> Verdict:
        """A suspect answer (``outcome.suspect``) from ``worker``.

        Args:
            held: its charge was held (see :meth:`hold`); it is kept, to be made if the
                task succeeds on some worker.

        Returns:
            ``TASK`` when another worker already answered this task the same way and
            that ends it (``self.same`` names both): nobody is charged for it. Else
            ``HOLD``. The same worker answering twice (the only one left) proves
            nothing.
        """
        family = _family(outcome)
        first = self._first.setdefault(family.name, worker.id)
        if family.stops and first != worker.id:
            self.same = (first, worker.id)
            return Verdict.TASK
        if held:
            refusal = outcome.kind is Kind.REJECTED
            self.held.append(Held(worker, outcome.error, duration, refusal, outcome.stalled))
        return Verdict.HOLD

    def proven(self, took: float = 0.0) -> list[Held]:
        """The task succeeded, in ``took`` seconds on its last attempt: every held answer
        was its worker's fault, but for a cut for silence after less time than the
        success took (the task was heavy, not that worker slow). Returns the charges
        to make, once."""
        held, self.held = self.held, []
        return [h for h in held if not (h.stalled and h.duration < took)]

    def refused_only(self) -> bool:
        """Whether every held answer is a refusal (a 4xx): a task that ends with nothing
        else to go on was refused by the only worker that could be asked."""
        return bool(self.held) and all(h.refusal for h in self.held)
