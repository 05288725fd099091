"""Why a task went where it went: the words of a routing trace (:mod:`npu_sync.trace`).

Read only when a trace is being kept: nothing here is on the path of a task that is
not traced and does not fail.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Final

from npu_sync._breaker import OPEN
from npu_sync._capability import lacked
from npu_sync._retry import Kind, Outcome
from npu_sync._worker import Worker

__all__ = ["MAX_CONSIDERED", "charged_to", "considered"]


MAX_CONSIDERED: Final = 20
"""The most workers a choice names with why they were not chosen; the rest are counted.
A trace is kept with every dead letter: without a bound a task retried 100 times over
a fleet of 500 workers would store 50,000 reasons (4 MB) in one record."""


def considered(
    workers: Iterable[Worker],
    chosen: Worker | None,
    excluded: Collection[str],
    lacking: Collection[str],
    now: float,
    requires: Collection[str] = (),
    reserved: str | None = None,
) -> tuple[tuple[tuple[str, str], ...], int]:
    """For every worker but ``chosen``, why it was not chosen, as the pool saw it just
    after the choice: at most :data:`MAX_CONSIDERED` of them, those not yet tried by
    the task first (the alternatives a reader wants to see), and how many more were
    left unlisted. A worker lacking what the task ``requires`` says so, though the
    task keeps it out as it keeps out the workers it tried. Read without the pool's
    lock: a snapshot for people, which a worker changing at that moment may make one
    step stale.

    ``chosen`` None: no worker could be had (the task is about to fail without an
    attempt); a worker with room then was kept for the classes above the task's,
    when ``reserved`` names them."""
    untried: list[tuple[str, str]] = []
    kept_out: list[tuple[str, str]] = []  # tried, or lacking what the task requires
    for worker in workers:
        if worker is chosen:
            continue
        if requires and (absent := lacked(worker.config, requires)):
            kept_out.append((worker.id, f"lacks {absent}, which the task requires"))
        elif worker.id in excluded:
            kept_out.append((worker.id, _TRIED))
        else:
            why = _why_not(worker, chosen, lacking, now, reserved)
            untried.append((worker.id, why))
    listed = untried + kept_out
    return tuple(listed[:MAX_CONSIDERED]), max(0, len(listed) - MAX_CONSIDERED)


_TRIED: Final = "excluded: already tried by this task"


def _why_not(
    worker: Worker,
    chosen: Worker | None,
    lacking: Collection[str],
    now: float,
    reserved: str | None,
) -> str:
    if worker.id in lacking:
        return "no model: does not hold the task's model"
    if not worker.enabled:
        return "disabled"
    if worker.draining:
        return "draining"
    if worker.refused is not None and worker.refused_until > now:
        return "taken out: refused the credentials"
    if not worker.healthy:
        return "unhealthy"
    if worker.breaker.state == OPEN:
        return "breaker open"
    if worker.cooldown_until > now:
        return "cooling down after Retry-After"
    load = f"{worker.in_flight}/{worker.capacity}"
    if worker.in_flight >= worker.capacity:
        return f"full ({load})"
    if chosen is None:
        if reserved is not None:
            return f"reserved for the classes above {reserved} ({load} in flight)"
        return f"had no room when the task asked ({load} in flight now)"
    if worker.priority > chosen.priority:
        return f"lower tier (priority {worker.priority} after {chosen.priority})"
    return f"not picked by the balancing ({load} in flight)"


def charged_to(outcome: Outcome, worker_id: str, held: bool) -> str:
    """Who a failed attempt's outcome is charged to, in words."""
    kind = outcome.kind
    if kind is Kind.SUCCESS:
        return "nobody"
    if held:
        return f"held: {worker_id} only if another worker answers the task"
    if kind is Kind.FAILURE:
        return worker_id
    if kind is Kind.ABANDONED:
        return "nobody: cut short by the task's deadline or a closed connection"
    if kind is Kind.NOT_HERE:
        return "nobody: the model is not loaded there"
    if kind is Kind.MISCONFIGURED:
        return f"the operator: {worker_id} taken out"
    return "the task"
