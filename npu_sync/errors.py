"""The exceptions npu_sync raises, and the two text guards every message goes through.

Every exception derives from :class:`NpuSyncError`. :func:`scrub` removes credentials
from text that may quote a URL or a header; :func:`printable` escapes the control
characters a worker could send to reach an operator's terminal.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Final

from npu_sync._attempt import Attempt
from npu_sync.trace import Trace

__all__ = [
    "AdmissionRefused",
    "ConfigError",
    "InvalidTask",
    "NoWorkerAvailable",
    "NpuSyncError",
    "PoolClosed",
    "TaskFailed",
    "TaskRejected",
]

REDACTED: Final = "***"
"""What :func:`scrub` puts in place of a credential."""

MAX_ERRORS: Final = 100
"""The most problems a :class:`ConfigError` lists one by one."""

# user:password@ (or anything@ right after a scheme): the userinfo part of a URL. A bare
# "name@host", without a colon or a scheme, is left alone: e-mail addresses survive.
# Everything up to the *last* '@' of the word goes: a password typed unencoded may hold
# '/', '?' or '#', which end a URL's authority for a parser but not for the operator.
_USERINFO = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*:/+)(?P<info>[^\s'\"]*)@"
    r"|(?<![\w/:@.-])(?P<bare>[^\s/?#@:'\"]+:[^\s'\"]*)@"
)
# Every query value, and every name=value of a fragment (OAuth puts access_token there):
# which names carry secrets (token, sig, key, X-Amz-...) cannot be listed exhaustively,
# and the values are never needed to fix a config.
_QUERY_VALUE = re.compile(r"(?P<name>[?&;#][^=\s&#'\"]+=)[^&;\s#'\"]*")
# Authorization values: "Bearer abc", "Basic dXNlcjpw". Capitalised as HTTP writes them
# (bearer in any case), so prose such as "basic checks" is left alone.
_AUTH_VALUE = re.compile(r"\b(?P<scheme>(?i:bearer)|Basic|Digest)(?P<gap>\s+)[^\s'\",;]+")


def scrub(text: str) -> str:
    """``text`` with credentials replaced by ``***``.

    Removes the userinfo of URLs (``redis://:pw@host`` → ``redis://***@host``,
    ``user:pw@host`` → ``***@host``), every query value (``?token=x`` → ``?token=***``)
    and the value after ``Bearer``, ``Basic`` or ``Digest``. Every message that
    may quote a configured URL or header goes through this before it is raised,
    logged, counted or shown.
    """

    def userinfo(match: re.Match[str]) -> str:
        if match["scheme"] is not None:
            return f"{match['scheme']}{REDACTED}@"
        return f"{REDACTED}@"

    if "@" in text:
        text = _USERINFO.sub(userinfo, text)
    if "=" in text:
        text = _QUERY_VALUE.sub(lambda m: m["name"] + REDACTED, text)
    return _AUTH_VALUE.sub(lambda m: m["scheme"] + m["gap"] + REDACTED, text)


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\x1b``, ``\\u202e``, ``\\n``).

    Worker answers and transport errors end up in exception messages, log lines, the
    status page and ``npu-sync dlq list``: an escape sequence in them must not be able
    to rewrite an operator's terminal, nor a bidi override to hide text.
    """
    if text.isprintable():
        return text
    return "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text
    )


def install_hint(extra: str) -> str:
    """How to install one of npu_sync's extras, in a form that works from a clone.

    npu_sync is not on PyPI: installing an extra by the package's name would fail, or
    fetch whatever someone published under that name.
    """
    return (
        f"pip install -e '.[{extra}]' from the root of a clone of npu_sync, or "
        f"pip install 'dist/npu_sync-<version>-py3-none-any.whl[{extra}]' "
        "(see Installing in README.md)"
    )


def _restored(
    cls: type[NpuSyncError], args: tuple[object, ...], state: dict[str, object]
) -> NpuSyncError:
    """An exception rebuilt from a pickle, without calling its ``__init__`` again."""
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class NpuSyncError(Exception):
    """Root of every exception npu_sync raises on purpose.

    Every one pickles, whatever its constructor asks for: ``multiprocessing`` and
    ``ProcessPoolExecutor`` carry a child's exception to its parent that way, and the
    default (calling the class with ``args`` alone) fails for keyword-only fields,
    which breaks the whole executor rather than raising the task's error.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restored, (type(self), self.args, dict(self.__dict__)))


class ConfigError(NpuSyncError, ValueError):
    """A configuration is invalid.

    ``errors`` lists every problem found (the first :data:`MAX_ERRORS`, then how many
    more), each naming its key path, e.g.
    ``npu_workers.workers[2].port: must be 1..65535, got 0``.

    Messages are passed through :func:`scrub` and :func:`printable`: a credential in a
    mistyped URL never reaches a log, ``stats()`` or a terminal through this error.
    """

    def __init__(self, errors: str | Sequence[str], *, source: str | None = None) -> None:
        found = (errors,) if isinstance(errors, str) else tuple(errors)
        if len(found) > MAX_ERRORS:
            # A list of aliases can repeat one mistake 100,000 times in a small file;
            # the message goes to stats(), logs and HTTP answers, which need only a few.
            hidden = len(found) - MAX_ERRORS
            found = (*found[:MAX_ERRORS], f"... and {hidden} more problem(s) not shown")
        self.errors: tuple[str, ...] = tuple(printable(scrub(error)) for error in found)
        self.source = source
        head = f"invalid configuration in {source}" if source else "invalid configuration"
        super().__init__(head + ":\n  " + "\n  ".join(self.errors))


class InvalidTask(NpuSyncError, ValueError):
    """A task could not be built: its payload, endpoint or options are unusable.

    The message is passed through :func:`printable`: it may quote a caller's path or
    header, whose control characters must not reach a terminal.
    """

    def __init__(self, message: str) -> None:
        super().__init__(printable(message))


class TaskRejected(NpuSyncError):
    """The task itself is bad: a worker refused it (4xx other than 408/429, but 401 and
    403), or no live worker serves the model it names (``model`` says which). Never
    retried, never counted against a worker.
    """

    def __init__(
        self,
        message: str,
        *,
        task_id: str,
        status: int | None = None,
        worker_id: str | None = None,
        body: object = None,
        model: str | None = None,
    ) -> None:
        # A worker's words and a caller's model name are quoted here: escaped again,
        # whoever built the message (escaping is idempotent).
        super().__init__(printable(message))
        self.task_id = task_id
        self.status = status
        self.worker_id = worker_id
        self.body = body
        self.model = model


class AdmissionRefused(TaskRejected):
    """The pool refused the task before any attempt: waiting for a worker could not
    have it answered by its deadline (``expected`` and ``left``, in seconds, say by how
    much). Nothing was sent, no worker is charged, and no dead letter is stored: the
    task was never taken on. A fallback given with the task runs instead.
    """

    def __init__(self, message: str, *, task_id: str, expected: float, left: float) -> None:
        super().__init__(message, task_id=task_id)
        self.expected = expected
        self.left = left


class TaskFailed(NpuSyncError):
    """The task could not succeed; its dead-letter record was stored before this was raised.

    ``attempts`` holds every attempt (worker id, error, duration) in order, and
    ``trace`` the task's routing trace (:class:`~npu_sync.trace.Trace`): each choice
    of a worker with why the others were not chosen, each attempt and who was charged.
    ``dead_letter_id`` is None only when storing the record itself failed; the error
    says so and the whole record is logged at ERROR level.
    """

    def __init__(
        self,
        message: str,
        *,
        task_id: str,
        dead_letter_id: str | None,
        attempts: Sequence[Attempt] = (),
        trace: Trace | None = None,
    ) -> None:
        super().__init__(printable(message))
        self.task_id = task_id
        self.dead_letter_id = dead_letter_id
        self.attempts: tuple[Attempt, ...] = tuple(attempts)
        # The routing trace (npu_sync.trace.Trace): every choice and attempt, and who
        # was charged. Set by the pool for every failed task.
        self.trace: Trace | None = trace


class NoWorkerAvailable(TaskFailed):
    """A task failed without a single attempt: no worker could take it before its
    deadline (none in the pool, all disabled, or all busy or down throughout).
    Its dead-letter record was stored, as for any ``TaskFailed``.
    """


class PoolClosed(NpuSyncError):
    """The pool was closed; it accepts no more tasks."""
