"""The bottom step: one request on the worker's transport, and what it came to.

:class:`Send` makes the one transport call of an attempt (a hedged attempt and a
stoppable one hand it their cancel handle the same way: ``Try.cancel``), bounds it by
one budget for the whole exchange and by the stall limit (:mod:`npu_sync._stall`), and
classifies the answer or the error in the worker's protocol. What the worker said enters
the pool here: scrubbed of the configuration's secrets and bounded before anything
stores or shows it.

A half-open worker's trial is bounded by the trial deadline (:func:`trial_deadline`)
instead of ``timeouts.read``, whatever the task. An idempotent task is the trial
itself: cut at the deadline, it is retried elsewhere. A non-idempotent task is never
sent to a worker that may be frozen, since cutting it there could run it twice (once
there, once elsewhere) or lose an answer: the worker's health check, bounded by the
deadline, is the trial's first step. No answer in time fails the trial (the task, never
sent, goes elsewhere); an answer lets the task go, with its usual timeouts, and its
outcome decides the trial.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from npu_sync._blame import misrouted, proven_route
from npu_sync._health import probe
from npu_sync._life.context import MIN_ATTEMPT, TaskContext, Try
from npu_sync._redact import Scrubber
from npu_sync._retry import Kind, Outcome, RetryPolicy, classify_error
from npu_sync._stall import Pace, TrialDeadline
from npu_sync._state import PoolState
from npu_sync._worker import Worker
from npu_sync.config import HealthConfig, PoolConfig
from npu_sync.errors import InvalidTask
from npu_sync.transport import Cancel, TransportError, TransportFeatures, features_of

log = logging.getLogger(__name__)

_REJECTED = Kind.REJECTED


class Send:
    """POST an attempt's body (``Try.body``, ``Try.headers``) to its worker, no lock
    held, and classify what came back. Built once per configuration; thread-safe."""

    __slots__ = (
        "check",
        "connect_timeout",
        "default_endpoint",
        "features",
        "health",
        "read_timeout",
        "stall",
        "state",
        "trial_rule",
    )

    def __init__(
        self,
        state: PoolState,
        config: PoolConfig,
        policy: RetryPolicy,
        check: Callable[[Any], object] | None,
    ) -> None:
        self.state = state
        self.connect_timeout = config.timeouts.connect
        self.read_timeout = config.timeouts.read
        self.default_endpoint = config.pool.default_endpoint
        self.stall = policy.stall if policy.stall.enabled else None
        self.trial_rule = TrialDeadline.from_config(config.circuit_breaker.trial)
        self.health: HealthConfig = config.health
        self.check = check
        # What each worker's transport declares (features_of), read once per transport:
        # a transport is replaced only with the configuration, and so is this step.
        self.features: dict[object, TransportFeatures] = {}

    def __call__(self, ctx: TaskContext, at: Try, own: float | None = None) -> Outcome:
        """The attempt's outcome, within ``at.remaining`` seconds of the deadline.

        ``own`` is the worker's own budget for the attempt: ``timeouts.read`` (None), or
        a trial's deadline.

        Raises:
            InvalidTask: refused before anything was sent (a header that cannot be
                encoded): the task's fault, so no worker is charged and nothing is
                retried.
        """
        lease = at.lease
        if own is None:
            if lease.trial:
                return self.trial(ctx, at)
            own = self.read_timeout
        worker = lease.worker
        remaining = at.remaining
        connect_timeout = self.connect_timeout
        read_timeout = own
        transport = worker.transport
        timeout = read_timeout if read_timeout < remaining else remaining
        extra: dict[str, Any] = {}
        cancel = at.cancel
        # The stall limit, for an idempotent task (asked here first: most attempts
        # of a pool without it skip the call).
        silence = (
            None
            if self.stall is None or not ctx.task.idempotent
            else self.silence(ctx, worker, timeout)
        )
        if cancel is not None or silence is not None:
            # What the transport declares it can do, read once per transport.
            features = self.features.get(transport) or self.features_of(transport)
            if cancel is not None and features.cancellable:
                extra["cancel"] = cancel
            if silence is not None:
                if features.silences:
                    extra["silence"] = silence
                else:
                    timeout = silence  # a transport that cannot tell silence: total time
        path = ctx.path
        try:
            response = transport.request(
                "POST",
                path,
                body=at.body,
                headers=at.headers,
                timeout=timeout,
                connect_timeout=connect_timeout,
                replayable=ctx.task.idempotent,
                **extra,
            )
            outcome = worker.protocol.classify(response, now=at.t0 + ctx.wall)
            if (
                outcome.kind is Kind.REJECTED
                and path == self.default_endpoint
                and not proven_route(worker)
            ):
                outcome = misrouted(outcome, "POST", worker.base_path + path)
            check = self.check
            if check is not None and outcome.kind is Kind.SUCCESS:
                outcome = _checked(check, outcome)
        except TransportError as exc:
            if silence is not None and (
                exc.stalled or (exc.kind == "timeout" and exc.sent and "silence" not in extra)
            ):
                ctx.cut_at = max(ctx.cut_at, silence)
                if not exc.stalled:  # the budget cut to the limit ran out
                    happened = f"{worker.id}: stalled: no answer within {silence:g}s"
                    exc = TransportError("timeout", happened, sent=True, stalled=True)
                return _scrubbed(classify_error(exc), self.state.scrubber)
            # A timeout is the worker's only when its own timeout ran out: one cut
            # short by the task's deadline says nothing about the worker. Connecting
            # gets at most the smaller of the two timeouts.
            limit = read_timeout if exc.sent else min(connect_timeout, read_timeout)
            cut_by_caller = remaining < limit
            if (
                exc.kind == "timeout"
                and not cut_by_caller
                and read_timeout < self.read_timeout
                and lease.trial
            ):
                happened = f"{worker.id}: trial: no answer within {read_timeout:g}s"
                exc = TransportError("timeout", happened, sent=exc.sent)
            return _scrubbed(classify_error(exc, cut_by_caller=cut_by_caller), self.state.scrubber)
        except InvalidTask:
            raise
        except Exception as exc:  # a bug of ours, or of a custom transport
            log.exception("unexpected error sending task to worker %s", worker.id)
            return _scrubbed(
                Outcome(Kind.ABANDONED, error=f"{type(exc).__name__}: {exc}"), self.state.scrubber
            )
        if outcome.error is None and outcome.model is None and outcome.kind is not _REJECTED:
            return outcome  # nothing the worker said is kept: nothing to scrub
        return _scrubbed(outcome, self.state.scrubber)

    def trial(self, ctx: TaskContext, at: Try) -> Outcome:
        """A half-open worker's trial, bounded by its trial deadline: the task itself
        when it is idempotent, else the worker's health check first (see the module's
        docstring)."""
        worker = at.lease.worker
        limit = trial_deadline(self.state, worker, self.trial_rule, self.read_timeout)
        if ctx.task.idempotent:
            return Send.__call__(self, ctx, at, limit)
        failed = self.probe(at, worker, limit)
        if failed is not None:
            return failed
        remaining = ctx.deadline - self.state.clock.monotonic()
        if remaining <= MIN_ATTEMPT:
            return Outcome(
                Kind.ABANDONED, error="deadline passed during the trial's check", processed=False
            )
        at.remaining = remaining
        return Send.__call__(self, ctx, at, self.read_timeout)

    def probe(self, at: Try, worker: Worker, limit: float) -> Outcome | None:
        """The health check that opens a non-idempotent task's trial, within ``limit``:
        None when the worker answered healthy, else the trial's failed outcome (the
        task was not sent: ``processed`` is False, so it may go elsewhere)."""
        remaining = at.remaining
        budget = limit if limit < remaining else remaining
        cancel = at.cancel
        result = probe(
            worker.id,
            worker.health_transport,
            dataclasses.replace(self.health, timeout=budget),
            self.state.clock,
            protocol=worker.protocol,
            auth=worker.auth,
            base_path=worker.base_path,
            scrubber=self.state.scrubber,
            cancel=cancel if isinstance(cancel, Cancel) else None,
        )
        if result.ok:
            return None
        error = f"{worker.id}: trial: health check failed within {budget:g}s ({result.error})"
        if budget < limit and result.error is not None and result.error.startswith("timeout"):
            # Cut by the task's deadline, not the trial's: says nothing of the worker.
            return Outcome(Kind.ABANDONED, error=error, processed=False)
        return Outcome(Kind.FAILURE, status=result.status, error=error, processed=False)

    def features_of(self, transport: object) -> TransportFeatures:
        """What ``transport`` declares it can do (:func:`features_of`), kept."""
        features = self.features.get(transport)
        if features is None:
            features = self.features[transport] = features_of(transport)
        return features

    def silence(self, ctx: TaskContext, worker: Worker, budget: float) -> float | None:
        """How long this attempt may wait without a byte of the answer (see
        :mod:`npu_sync._stall`), or None when only ``budget`` bounds it."""
        stall = self.stall
        if stall is None or not ctx.task.idempotent:
            # A non-idempotent task cannot be retried elsewhere: cutting it would lose
            # the answer of a worker that is only slow, for nothing but an earlier
            # failure. Its read timeout and deadline bound it, as before.
            return None
        pace = worker.pace
        peers = () if pace.enough else _peers(self.state, worker)
        return stall.silence(
            stall.known(pace, peers), budget, declared=ctx.task.timeout, cut_before=ctx.cut_at
        )


def trial_deadline(state: PoolState, worker: Worker, rule: TrialDeadline, read: float) -> float:
    """How long ``worker``'s half-open trial may take (:class:`TrialDeadline`): from its
    own latency, else its tier's, else the rule's cap; never more than ``read``."""
    pace = worker.pace
    peers = () if pace.enough else _peers(state, worker)
    return rule.seconds(rule.known(pace, peers), read)


def _peers(state: PoolState, worker: Worker) -> list[Pace]:
    """The paces of ``worker``'s tier (its own included), for a worker that has too few
    answers of its own yet. The selector's tiers are replaced whole: no lock needed."""
    for tier in state.dispatcher.selector.tiers:
        if worker in tier:
            return [w.pace for w in tier]
    return []


def _checked(check: Callable[[Any], object], outcome: Outcome) -> Outcome:
    """Run the pool's result check on a successful answer; a refusal is a failure."""
    try:
        check(outcome.value)
    except Exception as exc:
        return Outcome(
            Kind.FAILURE,
            outcome.value,
            outcome.status,
            f"result check refused the answer: {type(exc).__name__}: {exc}",
        )
    return outcome


def _scrubbed(outcome: Outcome, scrubber: Scrubber) -> Outcome:
    """``outcome`` with what the worker said scrubbed of secrets and bounded: its error
    text, the model a "not loaded" answer named (dropped if it held a secret) and, for
    a rejection, the body ``TaskRejected.body`` carries."""
    if outcome.error is not None:
        outcome.error = scrubber(outcome.error)
    model = outcome.model
    if model is not None and scrubber(model) != model:
        outcome.model = None
    if outcome.kind is Kind.REJECTED and scrubber:
        outcome.value = scrubber.value(outcome.value)
    return outcome
