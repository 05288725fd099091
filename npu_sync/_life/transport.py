"""The bottom step: one request on the worker's transport, and what it came to.

:class:`Send` makes the one transport call of an attempt (a hedged attempt and a
stoppable one hand it their cancel handle the same way: ``Try.cancel``), bounds it by
one budget for the whole exchange and by the stall limit (:mod:`npu_sync._stall`), and
classifies the answer or the error in the worker's protocol. What the worker said enters
the pool here: scrubbed of the configuration's secrets and bounded before anything
stores or shows it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from npu_sync._blame import misrouted, proven_route
from npu_sync._life.context import TaskContext, Try
from npu_sync._redact import Scrubber
from npu_sync._retry import Kind, Outcome, RetryPolicy, classify_error
from npu_sync._stall import Pace
from npu_sync._state import PoolState
from npu_sync._worker import Worker
from npu_sync.config import PoolConfig
from npu_sync.errors import InvalidTask
from npu_sync.transport import TransportError, TransportFeatures, features_of

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
        "read_timeout",
        "stall",
        "state",
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
        self.check = check
        # What each worker's transport declares (features_of), read once per transport:
        # a transport is replaced only with the configuration, and so is this step.
        self.features: dict[object, TransportFeatures] = {}

    def __call__(self, ctx: TaskContext, at: Try) -> Outcome:
        """The attempt's outcome, within ``at.remaining`` seconds of the deadline.

        Raises:
            InvalidTask: refused before anything was sent (a header that cannot be
                encoded): the task's fault, so no worker is charged and nothing is
                retried.
        """
        worker = at.lease.worker
        remaining = at.remaining
        connect_timeout = self.connect_timeout
        read_timeout = self.read_timeout
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
            own = read_timeout if exc.sent else min(connect_timeout, read_timeout)
            return _scrubbed(
                classify_error(exc, cut_by_caller=remaining < own), self.state.scrubber
            )
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
