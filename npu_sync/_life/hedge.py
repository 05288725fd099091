"""The hedging step: an idempotent task's slow first attempt raced by a second worker.

In the stack only with ``balancing.hedge`` on. :class:`Hedge` sends the caller's
attempt itself and arms the pool's timer; when it fires (:meth:`Hedge.fire`), the task
goes to a second worker too if one has room now and the retry budget allows. The first
success wins and the other attempt is cancelled (:class:`Race`). See
:mod:`npu_sync._hedge` for when a task is hedged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from npu_sync._admission import Lease
from npu_sync._attempt import Attempt
from npu_sync._blame import Held
from npu_sync._hedge import HedgePolicy
from npu_sync._life.context import FIRST, HEDGE, TaskContext, Try
from npu_sync._life.ledger import UNUSED, charge, record, untried_left
from npu_sync._life.models import named_model
from npu_sync._life.outcomes import Outcomes
from npu_sync._retry import Kind
from npu_sync._state import PoolState
from npu_sync._worker import Worker
from npu_sync.transport import Cancel

log = logging.getLogger(__name__)

Lower = Callable[[TaskContext, Try], "Try | None"]

# Where a hedge stands (Race.state).
_WAITING = 0  # the delay has not passed
_SENDING = 1  # the timer fired: a hedge is being sent, or runs
_CLOSED = 2  # no hedge will run any more (none was sent, or it ended)


class Race:
    """A hedged task's two attempts: which answered first. Thread-safe.

    The first success wins and cancels the other attempt (see :class:`Cancel`); the
    loser's end, whatever it is, is its cancellation, recorded as abandoned.
    """

    __slots__ = ("cancels", "cond", "hedge_result", "state", "winner")

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.state = _WAITING
        self.winner: int | None = None
        self.cancels = (Cancel(), Cancel())
        self.hedge_result: Try | None = None

    def claim(self) -> bool:
        """The timer fired: True if the hedge is still wanted (it is then being sent)."""
        with self.cond:
            if self.state != _WAITING or self.winner is not None:
                return False
            self.state = _SENDING
            return True

    def settle(self, side: int, success: bool) -> bool:
        """``side``'s attempt ended; True when the other had already won."""
        with self.cond:
            winner = self.winner
            if winner is not None:
                return winner != side
            if not success:
                return False
            self.winner = side
        self.cancels[1 - side].cancel()
        return False

    def abandon(self) -> None:
        """The caller's attempt raised: no hedge is sent any more, and one already out
        is cancelled and ends as the loser (its answer is never the one returned)."""
        with self.cond:
            self.winner = FIRST
            if self.state == _WAITING:
                self.state = _CLOSED
        self.cancels[HEDGE].cancel()

    def hedge_ended(self, result: Try | None) -> None:
        """The hedge ended (``result``) or was never sent (None)."""
        with self.cond:
            self.hedge_result = result
            self.state = _CLOSED
            self.cond.notify_all()

    def first_ended(self, success: bool, wait: float) -> Try | None:
        """The caller's attempt ended. Without success, the hedge's result, waiting up
        to ``wait`` seconds for it; with success, the hedge's result only if it had
        already ended (a failure to settle); None when no hedge runs (none will be
        sent)."""
        with self.cond:
            if self.state == _WAITING:
                self.state = _CLOSED
                return None
            if success:
                return self.hedge_result if self.state == _CLOSED else None
            self.cond.wait_for(lambda: self.state == _CLOSED, wait)
            return self.hedge_result


class Hedge:
    """The first attempt of an idempotent task, hedged after the policy's delay; every
    other attempt passes through, its success timed for the policy. Thread-safe."""

    __slots__ = ("budget", "outcomes", "policy", "state")

    def __init__(self, state: PoolState, policy: HedgePolicy, outcomes: Outcomes) -> None:
        self.state = state
        self.policy = policy
        self.budget = state.budget
        self.outcomes = outcomes

    def __call__(self, ctx: TaskContext, at: Try, next: Lower) -> Try | None:
        delay = None if ctx.attempts else self.policy.delay_for(ctx.task.idempotent)
        if delay is not None:
            return self.hedged(ctx, at, delay, next)
        done = next(ctx, at)
        if done is not None and done.outcome is not None and done.outcome.kind is Kind.SUCCESS:
            self.policy.observe(done.t1 - done.t0)
        return done

    def hedged(self, ctx: TaskContext, at: Try, delay: float, next: Lower) -> Try | None:
        """The caller's thread sends the attempt itself; a timer sends the task to a
        second worker (:meth:`fire`) if no answer came by then. The first success wins
        and the other attempt is cancelled. Without a success here, the hedge's outcome
        is waited for: it is the retry this task would make.

        Returns:
            The attempt the task goes on with (this one's, or the hedge's).
        """
        race = Race()
        state = self.state
        clock = state.clock
        first = at.lease.worker
        stop = ctx.stop
        if stop is not None:

            def stopped() -> None:
                race.abandon()
                race.cancels[FIRST].cancel()

            # The task's stop ends both attempts. Never forgotten: one hedged attempt
            # per task, and stopping a race that is over changes nothing that counts.
            stop.on_cancel(stopped)
        state.hedger.schedule(
            clock.monotonic() + delay, lambda: self.fire(ctx, race, first, delay, next)
        )
        at.cancel = race.cancels[FIRST]
        at.settle = race.settle
        try:
            done = next(ctx, at)
        except BaseException:
            race.abandon()  # nothing may be sent once the caller is told nothing was
            raise
        success = (
            done is not None and done.outcome is not None and done.outcome.kind is Kind.SUCCESS
        )
        if success and done is not None:
            self.policy.observe(done.t1 - done.t0)
        wait = max(0.0, ctx.deadline - clock.monotonic()) + 1.0
        other = race.first_ended(success, wait)
        if other is None:
            return done
        self.settle_hedge(ctx, other, success)
        if success:
            return done
        assert other.outcome is not None
        kind = other.outcome.kind
        if (
            done is not None
            and done.outcome is not None
            and done.outcome.kind is not Kind.ABANDONED
        ):
            if kind is Kind.REJECTED:
                return other
            self.note(ctx, done)  # the hedge goes on; the first failure is noted
            return other
        if kind is Kind.SUCCESS or kind is Kind.REJECTED or done is None:
            return other
        self.note(ctx, other)
        return done

    def settle_hedge(self, ctx: TaskContext, at: Try, won_elsewhere: bool) -> None:
        """On the caller's thread: the charge for a hedge's suspect answer, held when it
        came (see :class:`~npu_sync._life.admission.Record`), is made now if the blame
        says so, as the caller's own answer's would have been: at once for a task's
        first HTTP 500, or because the task was answered by the other attempt. Else it
        stays held (``at.deferred``)."""
        if not at.deferred:
            return
        outcome = at.outcome
        assert outcome is not None
        worker = at.lease.worker
        wid = worker.id
        state = self.state
        if not won_elsewhere and (
            outcome.kind is Kind.REJECTED
            or ctx.blamed().hold(
                wid,
                outcome,
                lambda: untried_left(state, ctx.excluded | {wid}, ctx.deadline),
            )
        ):
            return
        held = Held(worker, outcome.error, at.t1 - at.t0, outcome.kind is Kind.REJECTED)
        charge(state, [held], 0.0, state.clock.monotonic())
        at.deferred = False

    def note(self, ctx: TaskContext, at: Try) -> None:
        """A hedged attempt that failed while the other goes on: remembered, its worker
        not tried again, counted as a retry."""
        outcome = at.outcome
        assert outcome is not None
        worker = at.lease.worker
        t0, t1 = at.t0, at.t1
        ctx.attempts.append(
            Attempt(worker.id, outcome.error, t1 - t0, outcome.status, t0 + ctx.wall)
        )
        ctx.excluded.add(worker.id)
        verdict = (
            ctx.blamed().judge(worker, outcome, t1 - t0, at.deferred) if outcome.suspect else None
        )
        self.outcomes.traced_attempt(ctx, worker, outcome, t0, t1, at.deferred, verdict)
        if outcome.kind is Kind.NOT_HERE:
            ctx.not_here.add(worker.id)
            ctx.missing_model = named_model(self.state, ctx) or outcome.model
        elif outcome.kind is not Kind.ABANDONED:
            ctx.failures += 1

    def fire(self, ctx: TaskContext, race: Race, first: Worker, delay: float, next: Lower) -> None:
        """On the timer's thread, ``delay`` after the first attempt began: send the task
        to another worker if it is still unanswered, a worker has room now (a hedge
        never waits, nor takes a slot a queued task waits for or the classes above
        the task's reserve) and the retry budget allows it. Otherwise the hedge is
        skipped."""
        if not race.claim():
            return
        state = self.state
        lease: Lease | None = None
        try:
            lease = state.dispatcher.try_acquire(ctx.excluded | {first.id}, ctx.task.priority)
            # A shared breaker's trial needs the fleet's lease, a Redis round trip the
            # hedge's timer thread does not make: it is left to a task.
            fleet_trial = lease is not None and lease.trial and state.shared is not None
            if lease is not None and not fleet_trial and self.budget.try_withdraw():
                self.outcomes.hedged(ctx, first, lease, delay)
                try:
                    state.hedger.submit(self.run_hedge, ctx, race, lease, next)
                except RuntimeError:  # close() stopped the hedger: not an error
                    log.debug("hedge for task %s not sent: the pool closed", ctx.task.task_id)
                else:
                    lease = None
                    return
        except Exception:
            log.exception("could not send a hedge for task %s", ctx.task.task_id)
        if lease is not None:
            record(state, lease, UNUSED, 0.0, state.clock.monotonic(), retry=False)
        self.policy.count_skipped()
        race.hedge_ended(None)

    def run_hedge(self, ctx: TaskContext, race: Race, lease: Lease, next: Lower) -> None:
        """On a hedge thread: the hedge attempt, then its result handed to the caller."""
        done = None
        try:
            at = Try(lease, HEDGE, race.cancels[HEDGE])
            at.settle = race.settle
            done = next(ctx, at)
            if done is not None:
                self.policy.count_hedge(won=race.winner == HEDGE)
        except Exception:
            log.exception("hedge for task %s failed", ctx.task.task_id)
        finally:
            race.hedge_ended(done)
