"""What one task carries down the steps of its life, and what one attempt carries.

:class:`TaskContext` is the task's own state (its body, deadline, the attempts that
failed, the workers it may not go to, who is held to blame, its routing trace): the one
object each step is handed, so no step needs another step's insides. :class:`Try` is
one attempt's (its lease, when it began and ended, its outcome), made where a lease is
had (:class:`~npu_sync._life.admission.Admit`) and handed back up to the retry step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from typing import Final

from npu_sync._admission import Lease
from npu_sync._attempt import Attempt
from npu_sync._blame import Blame
from npu_sync._retry import Outcome
from npu_sync._stop import TaskStop
from npu_sync.errors import InvalidTask
from npu_sync.protocols import WorkerProtocol
from npu_sync.task import Task
from npu_sync.trace import Trace

_MAX_TIMEOUT = 86400
"""A task's deadline is at most a day, like ``timeouts.task``."""

MIN_ATTEMPT = 0.001
"""An attempt with less time than this left before the deadline is not started."""

EVERY_WORKER_TRIED = "every worker was tried"

_NOBODY: frozenset[str] = frozenset()  # made once: a task pays no call for it

FIRST = 0
"""The caller's own attempt (``Try.side``)."""
HEDGE = 1
"""A hedge: the task sent to a second worker while the first attempt goes on."""


class _Again:
    """The lease was given back unused: the retry step asks for a worker again."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "AGAIN"


AGAIN: Final = _Again()


class TaskContext:
    """One task's way through the workers: what it tried, and why each try failed.

    Not thread-safe: used by the one thread that runs the task (a hedge thread reads
    the fields that do not change while it runs).
    """

    __slots__ = (
        "attempts",
        "avoid",
        "blame",
        "bodies",
        "body",
        "chains",
        "cut_at",
        "deadline",
        "deposit",
        "excluded",
        "extra_headers",
        "failures",
        "headers",
        "lease",
        "missing_model",
        "model",
        "model_read",
        "not_here",
        "path",
        "placed",
        "reason",
        "start",
        "stop",
        "task",
        "trace",
        "unfit",
        "wall",
    )

    def __init__(
        self,
        task: Task,
        body: bytes,
        deadline: float,
        path: str,
        start: float,
        wall: float,
        stop: TaskStop | None,
        deposit: Callable[[float], None] | None,
    ) -> None:
        self.task = task
        self.body = body
        self.deadline = deadline
        self.path = path
        self.start = start
        # Wall-clock times (for people reading dead letters) from the monotonic clock,
        # saving a clock call per attempt.
        self.wall = wall
        self.stop = stop
        self.headers = {"X-NPU-Task-Id": task.task_id, "X-NPU-Attempt": "1"}
        self.attempts: list[Attempt] = []  # every attempt that did not succeed
        self.excluded: set[str] = set()  # not to be chosen for the next attempt
        self.not_here: set[str] = set()  # do not serve the task's model: never again
        # Lack what the task requires (Fit): never tried, never loaded a model for it.
        self.unfit: frozenset[str] = _NOBODY
        self.failures = 0  # the attempts counted against retry.max_retries
        self.cut_at = 0.0  # the longest silence an attempt of this task was cut at
        self.missing_model: str | None = None
        # Who is charged when the task itself may be at fault (npu_sync._blame): made
        # at the first answer that may be (blamed()), so a task that never gets one
        # pays nothing for it.
        self.blame: Blame | None = None
        self.reason = ""  # why the task gives up, once it does
        # The model the task names, read when first needed (ModelRoute.named).
        self.model: str | None = None
        self.model_read = False
        self.placed = False  # placement is asked for at most once per task
        self.bodies: dict[WorkerProtocol, bytes] | None = None  # the body, per protocol
        # The task pays into the retry budget in the lock round of its first request
        # for a worker; None once it has.
        self.deposit = deposit
        # The routing trace: the caller's, else begun at the first failed attempt.
        self.trace: Trace | None = task.trace
        # Headers an observer adds to each attempt (a tracing context), if any.
        self.extra_headers: Callable[[str, int], Mapping[str, str]] | None = None
        # A lease had before the admission step (a preferred worker with room).
        self.lease: Lease | None = None
        # The workers the next choice leaves out when more than ``excluded`` (the
        # ones lacking the task's model), set for one choice only.
        self.avoid: Collection[str] | None = None
        # The task's two chains of steps: without and with the model steps.
        self.chains: tuple[Callable[[TaskContext], object], ...] = ()

    def blamed(self) -> Blame:
        """The task's :class:`Blame`, made when first needed."""
        blame = self.blame
        if blame is None:
            blame = self.blame = Blame()
        return blame


class Try:
    """One attempt: the lease it runs on, which side of a hedged task it is, what may
    cancel it, when it began and ended, and its outcome. Not thread-safe: one thread
    fills it (the caller's, or a hedge thread for a hedge)."""

    __slots__ = (
        "body",
        "cancel",
        "deferred",
        "headers",
        "lease",
        "outcome",
        "remaining",
        "settle",
        "side",
        "t0",
        "t1",
    )

    def __init__(self, lease: Lease, side: int = FIRST, cancel: object = None) -> None:
        self.lease = lease
        self.side = side
        self.cancel = cancel  # a Cancel handle: a TaskStop, or a hedge race's
        # A hedged attempt's race: settle(side, success) is True when the other won.
        self.settle: Callable[[int, bool], bool] | None = None
        # Set on the way down (Record: t0, remaining; Compose: body, headers) and up
        # (Record: t1, outcome, deferred), never read before: a Try is made per
        # attempt, so nothing is set twice.
        self.outcome: Outcome
        self.deferred: bool  # the charge for a suspect answer is held (npu_sync._blame)
        self.t0: float
        self.t1: float
        self.remaining: float  # seconds from t0 to the task's deadline
        self.body: bytes
        self.headers: Mapping[str, str]


class Exhausted(Exception):
    """No attempt is left for a task; carries why and what was tried."""

    def __init__(self, reason: str, attempts: list[Attempt], first_at: float) -> None:
        super().__init__(reason)
        self.reason = reason
        self.attempts = attempts
        self.first_at = first_at
        self.trace: Trace | None = None


def shown(model: str) -> str:
    """A model id as messages quote it: escaped by repr(), and bounded, since a task
    (or a worker's answer) may name anything."""
    text = repr(model)
    return text if len(text) <= 120 else text[:100] + f"...' ({len(model)} characters)"


def check_timeout(timeout: float | None) -> None:
    """Raises ``InvalidTask`` unless ``timeout`` is None or seconds in (0, a day]."""
    if timeout is None:
        return
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not (math.isfinite(timeout) and 0 < timeout <= _MAX_TIMEOUT)
    ):
        raise InvalidTask(
            f"timeout must be a number of seconds > 0 and <= {_MAX_TIMEOUT}, got {timeout!r}"
        )
