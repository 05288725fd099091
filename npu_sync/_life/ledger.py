"""The pool's books for one attempt, under its one lock: the lease given back, what
its outcome counts against (the worker's breaker, counters, latency samples, adaptive
limit), and the freed slot handed on. Also the few questions of the books a step asks:
whether a worker not yet tried could take the task (:func:`untried_left`), the fleet's
lease on a shared breaker's trial (:func:`take_fleet_trial`), and charging answers held
as maybe the task's own fault once another worker proved them the worker's
(:func:`charge`).

Nothing here does I/O or runs user code under the lock: announcements (hooks, other
processes told of a breaker change) follow once the lock is released.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from npu_sync._admission import Lease
from npu_sync._blame import Held
from npu_sync._breaker import HALF_OPEN
from npu_sync._outage import held_until, refuse_credentials
from npu_sync._retry import REFUSED_CREDENTIALS, Kind, Outcome
from npu_sync._state import PoolState
from npu_sync._worker import Worker
from npu_sync.events import WorkerCredentialsRefused, WorkerHealthChanged

UNUSED = Outcome(Kind.NOT_HERE, error="lease not used")
"""Records a lease given back without an attempt (deadline reached, interrupted)."""


def record(
    state: PoolState,
    lease: Lease,
    outcome: Outcome,
    duration: float,
    now: float,
    *,
    retry: bool,
    defer: bool = False,
) -> None:
    """Give ``lease`` back and count what its attempt came to.

    Under the pool's lock, for no I/O and no user code: the worker's slot and breaker,
    the counters and latency samples, the freed slot handed to the next waiter. Then
    without it: breaker changes announced (hooks run, other processes told: Redis I/O),
    a removed worker's connections closed once it is idle.

    Args:
        retry: the attempt retried the task (counted in ``stats()``).
        defer: a failure whose charge is held (see :mod:`npu_sync._blame`).
    """
    worker = lease.worker
    kind = outcome.kind
    with state.lock:
        worker.in_flight -= 1
        if outcome is UNUSED:
            _count_no_fault_locked(state, lease, outcome)
        elif lease.generation != worker.generation:
            # An attempt on the worker's old address: it says nothing about the new
            # one (nor about its breaker), so only the slot is given back, and a
            # result still counts as the task's success.
            if kind is Kind.SUCCESS:
                state.stats.succeeded += 1
            kind = Kind.NOT_HERE
        elif kind is Kind.MISCONFIGURED:
            # Not a fast answer to learn a latency from, nor the worker's sickness:
            # credentials refused (until they are tried again), or not an NPU worker
            # (until a health check is a worker's answer, or a reload moves it).
            if outcome.status in REFUSED_CREDENTIALS:
                _count_refused_locked(state, lease, outcome, now)
            else:
                _count_no_fault_locked(state, lease, outcome)
        else:
            # What balancing learns first: the worker's latency, and its adaptive
            # limit's sample.
            state.dispatcher.selector.observe(worker, duration, now, kind is Kind.SUCCESS)
            if worker.limit is not None:
                _sample_limit_locked(state, lease, outcome, duration)
            if kind is Kind.SUCCESS:
                worker.pace.observe(duration)
                stats = worker.stats
                stats.attempts += 1
                worker.breaker.record_success(lease.trial)
                stats.succeeded += 1
                stats.observe(now, duration, True)
                state.stats.succeeded += 1
            elif kind is Kind.FAILURE:
                _count_failure_locked(state, lease, outcome, duration, now, defer)
            else:
                _count_no_fault_locked(state, lease, outcome)
        if retry:
            state.stats.retries += 1
        state.dispatcher.release_worker_locked(worker, now)
        drained = worker.removed and not worker.in_flight
        if drained and state.draining.get(worker.id) is worker:
            del state.draining[worker.id]
    if state.transitions:
        state.flush_transitions()
    if state.events:
        state.flush_events()
    if drained:
        worker.transport.close()


def _sample_limit_locked(state: PoolState, lease: Lease, outcome: Outcome, duration: float) -> None:
    """What the worker's adaptive limit learns from an attempt: a success, or an
    overload answer or timeout (a dropped sample)."""
    worker = lease.worker
    kind = outcome.kind
    if kind is Kind.SUCCESS:
        dropped = False
    elif kind is Kind.FAILURE and (outcome.status in (429, 503) or outcome.error_kind == "timeout"):
        dropped = True
    else:
        return  # says nothing about the worker's load
    before = worker.capacity
    if worker.sample_limit(duration, lease.in_flight, dropped):
        state.limit_changed_locked(worker, before)


def _count_failure_locked(
    state: PoolState, lease: Lease, outcome: Outcome, duration: float, now: float, defer: bool
) -> None:
    """Charge a failure to the worker (unless deferred). Counted here only, in this
    process: other processes hear of the opening it may cause, never of the count."""
    worker = lease.worker
    stats = worker.stats
    stats.attempts += 1
    if defer:
        worker.breaker.release(lease.trial)
    else:
        worker.breaker.record_failure(lease.trial)
    stats.failed += 1
    stats.last_error = outcome.error
    stats.last_error_at = state.clock.time()
    stats.observe(now, duration, False)
    if outcome.retry_after:
        cap = state.config.circuit_breaker.max_reset_timeout
        worker.cooldown_until = now + min(outcome.retry_after, cap)
    # A trip or a cool-down changes when a waiter should wake.
    state.dispatcher.wake_all_locked()


def _count_refused_locked(state: PoolState, lease: Lease, outcome: Outcome, now: float) -> None:
    """The worker refused the credentials: the operator's fault. The worker is taken
    out (its breaker untouched) until its credentials are tried again: when a health
    check passes, a reload changes them, or ``circuit_breaker.reset_timeout`` from now."""
    worker = lease.worker
    worker.breaker.release(lease.trial)
    stats = worker.stats
    stats.attempts += 1
    stats.failed += 1
    error = outcome.error or f"credentials refused: HTTP {outcome.status}"
    stats.last_error = error
    stats.last_error_at = state.clock.time()
    wait = state.config.circuit_breaker.reset_timeout
    if refuse_credentials(worker, error, now + wait):
        wid = worker.id
        state.events.append(lambda at: WorkerCredentialsRefused(at, wid, error, at + wait))
    # Waiters hoping for this worker must look again.
    state.dispatcher.wake_all_locked()


def _count_no_fault_locked(state: PoolState, lease: Lease, outcome: Outcome) -> None:
    """An outcome that charges nobody: rejected, not here, abandoned, or a lease given
    back unused. The breaker's slot (maybe its trial) is released, not counted."""
    worker = lease.worker
    worker.breaker.release(lease.trial)
    if outcome is UNUSED:
        return
    stats = worker.stats
    stats.attempts += 1
    kind = outcome.kind
    if kind is Kind.REJECTED:
        stats.rejected += 1  # the task's count is the task life's (Retry.reject)
    elif kind is Kind.MISCONFIGURED:
        _take_out_locked(state, worker, outcome.error or "misconfigured")
    elif kind is Kind.ABANDONED:
        stats.abandoned += 1
    else:
        stats.not_here += 1


def _take_out_locked(state: PoolState, worker: Worker, reason: str) -> None:
    """The operator's fault: the worker is not what its entry says. Out of service
    (not its breaker: it is not sick) until a health check that is a worker's answer
    passes, or a reload moves it; the event waits in ``state.events``."""
    stats = worker.stats
    stats.failed += 1
    stats.last_error_at = state.clock.time()
    if worker.take_out(reason):
        wid = worker.id
        state.events.append(lambda at: WorkerHealthChanged(at, wid, False, reason))


def take_fleet_trial(state: PoolState, lease: Lease, budget: float) -> bool:
    """Take the fleet's lease on the half-open trial ``lease`` holds (breakers shared
    between processes): True when the trial may be sent. Otherwise the lease is given
    back unused, and the worker stays out here until the other holder's lease expires
    or its result arrives, whichever comes first.

    Redis I/O: call without the lock, before the attempt. ``budget`` is how long the
    attempt may run."""
    shared = state.shared
    assert shared is not None
    worker = lease.worker
    wait = shared.take_trial(worker.id, budget)
    with state.lock:
        if wait is None:
            if worker.breaker.lease_taken():
                return True
            # Another process opened or closed the worker meanwhile: no trial now.
        else:
            worker.breaker.lease_refused(state.clock.monotonic() + wait)
        # The breaker has already withdrawn this trial; giving the lease back must not
        # release a trial admitted since to another task.
        lease.trial = False
    if wait is None:
        shared.end_trial(worker.id)
    record(state, lease, UNUSED, 0.0, state.clock.monotonic(), retry=False)
    return False


def charge(state: PoolState, held: list[Held], took: float, now: float) -> None:
    """Charge the held answers of a task that then succeeded elsewhere (in ``took``
    seconds): each was its worker's fault. A refusal also raises the worker's latency
    estimate to what the task cost there, refusal and real work: a worker that refuses
    fast must not look like the fastest."""
    selector = state.dispatcher.selector
    with state.lock:
        for entry in held:
            worker = entry.worker
            if worker.removed:
                continue
            # A held answer to a half-open trial is the trial's failure: it reopens.
            worker.breaker.record_failure(worker.breaker.state == HALF_OPEN)
            if entry.refusal:
                worker.stats.rejected -= 1  # counted as a rejection when it came
                worker.stats.failed += 1
                worker.stats.last_error = f"refused a task another worker ran: {entry.error}"
                worker.stats.last_error_at = state.clock.time()
                selector.observe(worker, entry.duration + took, now, False)
        state.dispatcher.wake_all_locked()
    if state.transitions:
        state.flush_transitions()


def untried_left(state: PoolState, excluded: Collection[str], by: float = math.inf) -> bool:
    """Whether a worker outside ``excluded`` could take a task before ``by``.

    A worker whose breaker stays open, or whose Retry-After cool-down lasts, past
    ``by`` cannot, nor one that is down (:func:`outage.held_until`). Costs a scan of
    the workers: called on the failure path only.
    """
    with state.lock:
        shared = state.dispatcher.selector.shared_breakers
        now = state.clock.monotonic()
        for w in state.workers.values():
            if w.id not in excluded and held_until(w, now, shared_breakers=shared)[0] < by:
                return True
        return False
