"""What an attempt's outcome means, and how long to wait before the next attempt.

Classification follows the worker protocol in docs/protocol.md. The backoff is tenacity's
``wait_exponential_jitter`` and ``stop_after_attempt`` strategies, evaluated on a
``RetryCallState`` only when an attempt has failed: building a ``Retrying`` loop per
task costs ~30 µs even when nothing is retried, which the hot path cannot afford.
"""

from __future__ import annotations

import enum
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from npu_sync._stall import StallLimit
from npu_sync.config import RetryConfig
from npu_sync.errors import printable
from npu_sync.transport import Response, TransportError


class Kind(enum.Enum):
    SUCCESS = "success"
    # The task is bad: 4xx other than 401/403/408/429, or a protocol's "cannot run
    # this task". A 4xx is *suspect*: it is the task's only if a second worker says so.
    REJECTED = "rejected"
    NOT_HERE = "not_here"  # the worker does not serve this model: try another, no blame
    FAILURE = "failure"  # the worker failed: counts against it, retried elsewhere
    # The operator's: the worker refused the pool's credentials (401, 403; see
    # npu_sync._outage), or the entry is not an NPU worker (404/405 on the inference
    # path; see npu_sync._blame). It ran nothing; it is taken out, the task goes
    # elsewhere, and its breaker, which measures only its sickness, is untouched.
    MISCONFIGURED = "misconfigured"
    # No answer, and nobody to blame on the worker's side: the caller's deadline cut the
    # attempt short, a reused keep-alive connection was found closed, or npu_sync itself
    # failed. Never counts against the worker.
    ABANDONED = "abandoned"


NOT_A_WORKER = "not an NPU worker at this URL"
"""How the error of a worker entry that points at something else begins: a task or
health answer that no NPU worker gives (404/405 on its own paths, another service's
page). The operator's to fix: the worker is taken out, no breaker counts it."""

_MODEL_NOT_LOADED = re.compile(r"^Model (?P<model>.+) not loaded$")

MAX_MODEL_ID = 256
"""Model ids longer than this (or not printable) are not believed from a worker."""


def not_loaded_model(detail: str) -> tuple[str, str | None] | None:
    """Whether ``detail`` is a "Model X not loaded" answer: its escaped, bounded text
    and the model it names, or None when it is not one. A name longer than
    :data:`MAX_MODEL_ID` or not printable is not kept (``None``): a worker's words
    are stored per worker, and must not grow without bound."""
    match = _MODEL_NOT_LOADED.match(detail)
    if match is None:
        return None
    model = match["model"]
    kept = model if len(model) <= MAX_MODEL_ID and model.isprintable() else None
    return printable(detail[:300]), kept


_NOT_PROCESSED = frozenset({429, 503})
# Credentials the worker refuses say nothing about the task, nor about the worker's
# health: its configuration (here or there) is at fault, it ran nothing, and another
# worker may take the task.
REFUSED_CREDENTIALS = frozenset({401, 403})


@dataclass(slots=True)
class Outcome:
    """One attempt's classified outcome. Not frozen: one is built per attempt."""

    kind: Kind
    value: Any = None  # the decoded JSON on success, the decoded error body otherwise
    status: int | None = None
    error: str | None = None
    retry_after: float | None = None
    model: str | None = None  # the model a NOT_HERE answer named
    processed: bool = True  # False when the worker provably did not run the task
    # The answer may be the task's doing as much as the worker's (HTTP 500, a 4xx, an
    # answer over the size limit): see npu_sync._blame for who is charged.
    suspect: bool = False
    # Cut for silence (npu_sync._stall): the worker's, or a heavy task's (npu_sync._blame).
    stalled: bool = False
    # The transport's kind of error when the attempt got no usable answer ("timeout",
    # "connect", "too_large", ...: TransportError.kind); None for an HTTP answer. Read
    # it, never the text of ``error``, to tell failures apart.
    error_kind: str | None = None


def classify_response(response: Response, *, now: float | None = None) -> Outcome:
    """Classify a worker's HTTP answer (see docs/protocol.md)."""
    status = response.status
    if 200 <= status < 300:
        try:
            return Outcome(Kind.SUCCESS, decode_json(response.body), status)
        except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
            return Outcome(Kind.FAILURE, None, status, f"HTTP {status} with a non-JSON body")
    body = _decode(response.body)
    detail = body.get("detail") if isinstance(body, dict) else None
    if status in REFUSED_CREDENTIALS:
        return Outcome(
            Kind.MISCONFIGURED,
            body,
            status,
            "credentials refused: " + _describe(status, detail),
            processed=False,
        )
    if 400 <= status < 500 and status not in (408, 429):
        # Refused before running: the task may go to another worker, which says
        # whether the refusal was the task's (npu_sync._blame).
        return Outcome(
            Kind.REJECTED, body, status, _describe(status, detail), processed=False, suspect=True
        )
    if status == 500 and isinstance(detail, str):
        named = not_loaded_model(detail)
        if named is not None:
            return Outcome(Kind.NOT_HERE, body, status, named[0], model=named[1], processed=False)
    return Outcome(
        Kind.FAILURE,
        body,
        status,
        _describe(status, detail),
        retry_after=parse_retry_after(response.headers.get("retry-after"), now=now),
        processed=status not in _NOT_PROCESSED,
        suspect=status == 500,
    )


def classify_error(error: TransportError, *, cut_by_caller: bool = False) -> Outcome:
    """A request that got no usable answer: the worker's failure, unless nobody's.

    Args:
        error: what the transport raised.
        cut_by_caller: the attempt's budget was the task's remaining time, shorter than
            the worker's own timeouts: a timeout then says nothing about the worker.
    """
    # A garbled status line or header from the worker is quoted in the transport's error.
    kind = error.kind
    message = printable(f"{kind}: {error}")
    if kind == "timeout" and cut_by_caller:
        return Outcome(
            Kind.ABANDONED,
            error=message + " (the task's deadline ran out)",
            processed=error.sent,
            error_kind=kind,
        )
    if error.stale:
        return Outcome(Kind.ABANDONED, error=message, processed=error.sent, error_kind=kind)
    if error.stalled:
        return Outcome(
            Kind.FAILURE,
            error=message,
            processed=error.sent,
            suspect=True,
            stalled=True,
            error_kind=kind,
        )
    return Outcome(
        Kind.FAILURE,
        error=message,
        processed=error.sent,
        suspect=kind == "too_large",
        error_kind=kind,
    )


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        # An HTTP date is rare (workers send seconds): email.utils, which parses it,
        # is imported only then.
        import email.utils

        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if now is None or when is None:
            return None
        seconds = when.timestamp() - now
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


_DECODE = json.JSONDecoder().decode


def decode_json(body: bytes) -> Any:
    """``json.loads(body)``, a few microseconds faster for the usual UTF-8 answer.

    ``json.loads`` on bytes first sniffs the encoding (UTF-8, -16 or -32, with or
    without BOM); answers are UTF-8 by the JSON standard, so that is tried directly.
    """
    try:
        text = body.decode()
    except UnicodeDecodeError:
        return json.loads(body)  # UTF-16/32, or not JSON: json.loads says which
    if text.startswith("\ufeff"):  # json.loads accepts a UTF-8 BOM on bytes too
        text = text[1:]
    return _DECODE(text)


def _decode(body: bytes) -> Any:
    try:
        return decode_json(body)
    except (ValueError, RecursionError):
        return body[:200].decode("utf-8", "replace")


def _describe(status: int, detail: object) -> str:
    """The error text of an answer. Worker text is escaped here, where it enters
    npu_sync: it reaches exception messages, logs and terminals from this point on."""
    if detail is None:
        return f"HTTP {status}"
    text = detail if isinstance(detail, str) else json.dumps(detail)
    return f"HTTP {status}: {printable(text[:300])}"


class RetryPolicy:
    """Backoff and attempt limits for one pool configuration. Immutable, thread-safe.

    ``max_retries`` extra attempts after the first, each on a worker not yet tried
    for the task; between attempts a jittered exponential wait
    (``backoff_initial * 2**n`` plus up to ``backoff_initial`` of jitter, capped at
    ``backoff_max``).
    """

    def __init__(self, config: RetryConfig) -> None:
        # tenacity is imported with the first policy (a pool being built), not with this
        # module, to keep it out of `import npu_sync`; next_wait uses what is kept here.
        import tenacity

        self.config = config
        self.stall = StallLimit.from_config(config.stall)
        self.max_attempts = config.max_retries + 1
        self._stop = tenacity.stop_after_attempt(self.max_attempts)
        self._wait = tenacity.wait_exponential_jitter(
            multiplier=config.backoff_initial,
            max=config.backoff_max,
            jitter=config.backoff_initial,
        )
        self._call_state = tenacity.RetryCallState

    def next_wait(self, failures: int, elapsed: float) -> float | None:
        """Seconds to wait after the ``failures``-th failed attempt, or None to stop."""
        state = self._call_state(None, None, (), {})  # type: ignore[arg-type]
        state.attempt_number = failures
        state.start_time = 0.0
        state.outcome_timestamp = elapsed
        if self._stop(state):
            return None
        return float(self._wait(state))
