"""When a worker can take tasks again, as far as the pool can tell by itself, and how
to say in one clause that a whole fleet is down.

A task waits for a worker only when waiting can help: when some worker may take it
before the task stops waiting. :func:`held_until` is that rule for one worker. It
answers from what the pool knows now, without news from outside:

* a worker that is busy, or whose half-open trial another task holds, may free up at
  any moment (:data:`NOW`): worth waiting for;
* an open breaker admits its trial at a known time, and so does the end of a
  ``Retry-After`` cool-down: worth waiting for only if that time comes first;
* a worker that is disabled, draining (being removed, or saying so itself),
  unhealthy, or that refused the pool's credentials comes back only with news: a
  health check that passes, a reload, its credentials accepted (:data:`NEVER`, or
  the time its credentials are tried again). The pool does not wait on the chance
  of a health check: at the default interval the next one is seconds to a minute
  away, and a recovery needs ``healthy_threshold`` passes, while the waiting task
  usually has a fallback or a caller that is better told at once. The early trial a
  passing health check grants an open breaker is news of the same kind, so an open
  breaker counts as held until its own reset time.

A worker that refuses the pool's credentials (401, 403) is the operator's fault, not
the worker's sickness: :func:`refuse_credentials` takes it out without touching its
breaker, until a health check it answers passes, a reload gives it new credentials,
or (with its health checks not refused, or off) ``circuit_breaker.reset_timeout``
has passed and the next task tries it again.

News is not lost on a task that was refused: the next task finds the worker back.
And a task already waiting (for a busy worker) is handed the worker the moment the
news comes.

With breakers shared between processes (Redis), another process's trial may close a
breaker at any moment, so an open breaker is never held.

Not thread-safe on its own: call with the pool's lock held (it reads worker state).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable

from npu_sync._breaker import OPEN
from npu_sync._health import HealthResult
from npu_sync._retry import NOT_A_WORKER, REFUSED_CREDENTIALS
from npu_sync._worker import Worker

NOW = float("-inf")
"""May take a task at any moment."""

NEVER = float("inf")
"""Not before the pool hears news of it (a health check, a reload, an operator)."""

_NEVER_HOLD = (NEVER, NEVER, NEVER)


Hold = tuple[float, float, float]
"""``(until, breaker_until, cooldown_until)``: see :func:`held_until`."""


def held_until(worker: Worker, now: float, *, shared_breakers: bool = False) -> Hold:
    """Until when ``worker`` cannot take a task, whatever happens meanwhile inside this
    process: ``(until, breaker_until, cooldown_until)``, each :data:`NOW` when nothing
    holds it, :data:`NEVER` when only news can bring it back."""
    if not worker.enabled or worker.draining or worker.health.hinted_draining:
        return _NEVER_HOLD
    if not worker.healthy and not awaiting_first_check(worker):
        return _NEVER_HOLD
    refused = worker.refused_until
    cooldown = worker.cooldown_until
    cooldown_until = cooldown if cooldown > now else NOW
    breaker_until = NOW
    if not shared_breakers:
        retry = worker.breaker.retry_at()
        if retry is not None and retry > now:
            breaker_until = retry
    until = max(cooldown_until, breaker_until)
    if refused > now and refused > until:
        until = refused
    return until, breaker_until, cooldown_until


def awaiting_first_check(worker: Worker) -> bool:
    """Whether ``worker`` was added by a reload and takes no task until its first health
    check passes (make before break): that check is already on its way, so the news
    may come at any moment, and a task waits for it rather than fail while the new
    worker is seconds from answering. Its first check, passed or failed, ends this
    (the waiters are woken then)."""
    return worker.health.awaiting_check and not worker.healthy


def down_reason(worker: Worker, now: float) -> str | None:
    """Why ``worker`` cannot take a task now nor soon, in a few words, or None: busy,
    cooling down after a ``Retry-After``, or waiting for its half-open trial to end is
    not down."""
    if not worker.enabled:
        return "disabled"
    if worker.draining or worker.health.hinted_draining:
        return "draining"
    if worker.refused_until > now:
        return "refusing the credentials"
    if awaiting_first_check(worker):
        return "awaiting its first health check"
    if not worker.healthy:
        # The latest word on why: a failed health check, else what a task was answered.
        checked = worker.health.last
        if checked is not None and not checked.ok:
            return "not an NPU worker" if checked.not_a_worker else "unhealthy"
        error = worker.stats.last_error
        if error is not None and error.startswith(NOT_A_WORKER):
            return "not an NPU worker"
        return "unhealthy"
    if worker.breaker.state == OPEN and not worker.breaker.can_admit(now):
        return "circuit breaker open"
    return None


# How each reason is counted in the clause: (singular, plural) after the number.
_COUNTED = {
    "disabled": ("disabled", "disabled"),
    "draining": ("draining", "draining"),
    "refusing the credentials": ("refusing the credentials", "refusing the credentials"),
    "unhealthy": ("unhealthy", "unhealthy"),
    "awaiting its first health check": (
        "awaiting its first health check",
        "awaiting their first health check",
    ),
    "not an NPU worker": ("not an NPU worker", "not NPU workers"),
    "circuit breaker open": ("breaker open", "breakers open"),
    "cooling down (Retry-After)": ("cooling down (Retry-After)", "cooling down (Retry-After)"),
    None: ("busy", "busy"),
}


def describe(
    workers: Iterable[Worker],
    now: float,
    *,
    tried: Collection[str] = (),
    lacking: Collection[str] = (),
    model: str | None = None,
) -> str:
    """One clause naming the state of a fleet no worker of which can take a task:
    ``"all 3 workers are down: 2 breakers open (next trial in 50s), 1 unhealthy"``.

    Args:
        tried: workers this task already tried: named as such unless they are down.
        lacking: workers known not to hold the task's ``model``.
    """
    counts: Counter[str | None] = Counter()
    skipped_tried = skipped_lacking = 0
    total = 0
    next_trial: float | None = None
    refusal: str | None = None  # what the first worker refusing the credentials said
    for worker in workers:
        total += 1
        if worker.id in lacking:
            skipped_lacking += 1
            continue
        why = down_reason(worker, now)
        if why is None and worker.cooldown_until > now:
            why = "cooling down (Retry-After)"
        if why is None and worker.id in tried:
            skipped_tried += 1  # a worker that is down is named down, tried or not
            continue
        counts[why] += 1
        if why == "refusing the credentials" and refusal is None:
            refusal = f"{worker.id}: {(worker.refused or '').removeprefix('credentials refused: ')}"
        if why == "circuit breaker open":
            retry = worker.breaker.retry_at()
            if retry is not None and (next_trial is None or retry < next_trial):
                next_trial = retry
    if total == 0:
        return "the pool has no workers"
    parts = []
    # The most common state first; ties in the order of _COUNTED.
    for why, (one, many) in sorted(_COUNTED.items(), key=lambda item: -counts[item[0]]):
        n = counts[why]
        if n:
            part = f"{n} {one if n == 1 else many}"
            if why == "circuit breaker open" and next_trial is not None:
                part += f" (next trial in {max(0.0, next_trial - now):.0f}s)"
            elif why == "refusing the credentials" and refusal is not None:
                part += f" ({refusal})"
            parts.append(part)
    if skipped_tried:
        parts.append(f"{skipped_tried} already tried")
    if skipped_lacking:
        shown = "its model" if model is None else f"model {model!r}"
        parts.append(f"{skipped_lacking} without {shown}")
    down = sum(counts.values())
    if down == total:
        head = "the only worker is down" if total == 1 else f"all {total} workers are down"
    elif down == 0:
        head = f"no worker of {total} left to try"
    else:
        head = f"{down} of {total} workers are down, no other left to try"
    return f"{head}: {', '.join(parts)}"


# -- the operator's fault: credentials refused -------------------------------------------


def refuse_credentials(worker: Worker, error: str, until: float) -> bool:
    """Take ``worker`` out because it refused the pool's credentials (401, 403): no
    task goes there before ``until`` (:data:`NEVER`: until a health check passes). Its
    breaker is left alone: it measures the worker's sickness, not a wrong secret.

    Returns:
        Whether this is news (the worker was taking tasks until now).
    """
    news = worker.refused is None
    worker.refused = error
    worker.refused_until = max(until, worker.refused_until) if not news else until
    return news


def accept_credentials(worker: Worker) -> bool:
    """``worker`` accepted the pool's credentials again; returns whether it was out."""
    was = worker.refused is not None
    worker.refused = None
    worker.refused_until = 0.0
    return was


def credentials_news(worker: Worker, result: HealthResult) -> str | None:
    """What a health check says of ``worker``'s credentials, applied to it. Call under
    the pool's lock, before the result itself is applied (``worker.health.last`` is still
    the previous check).

    A check answered 401/403 takes the worker out until a check passes. A check that
    passes brings it back only if the previous one was refused: AutoBot's workers
    answer ``/health`` without asking for credentials, so there a passing check says
    nothing of them, and a worker whose tasks were refused waits out its time.

    Returns:
        The error, when the check was refused and that is news.
    """
    if result.status in REFUSED_CREDENTIALS:
        error = result.error or f"credentials refused: HTTP {result.status}"
        worker.stats.last_error = error
        worker.stats.last_error_at = result.checked_at
        return error if refuse_credentials(worker, error, NEVER) else None
    previous = worker.health.last
    if result.ok and previous is not None and previous.status in REFUSED_CREDENTIALS:
        accept_credentials(worker)
    return None
