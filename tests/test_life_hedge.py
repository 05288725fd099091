"""The hedge step and its race alone (npu_sync._life.hedge)."""

from __future__ import annotations

from npu_sync import WorkerPool
from npu_sync._life.context import FIRST, HEDGE, TaskContext, Try
from npu_sync._life.hedge import Hedge, Race
from npu_sync._life.ledger import record
from npu_sync._life.outcomes import Outcomes
from tests.lifekit import OK, begin, config
from tests.stubs import NoTransport


def test_the_first_success_of_a_race_wins_and_cancels_the_other() -> None:
    """settle(): the winner cancels the loser; the loser learns it lost."""
    race = Race()
    assert race.settle(HEDGE, True) is False
    assert race.cancels[FIRST].cancelled and not race.cancels[HEDGE].cancelled
    assert race.settle(FIRST, True) is True


def test_a_race_abandoned_by_the_caller_sends_no_hedge() -> None:
    """Once the caller's attempt raised, the timer's claim is refused."""
    race = Race()
    race.abandon()
    assert race.claim() is False
    assert race.cancels[HEDGE].cancelled


def test_the_hedge_step_passes_a_retry_through_without_a_timer() -> None:
    """Only a task's first attempt is hedged: a retry goes straight down."""
    cfg = config("a", "b")
    with WorkerPool(cfg, transport_factory=lambda *a, **k: NoTransport()) as p:
        state = p._state
        scheduled: list[object] = []

        class Policy:
            def delay_for(self, idempotent: bool) -> float | None:
                return 0.0

            def observe(self, duration: float) -> None:
                scheduled.append(("observed", duration))

        step = Hedge(state, Policy(), Outcomes(state))  # type: ignore[arg-type]
        ctx = begin(p)
        ctx.attempts.append(object())  # type: ignore[arg-type]

        def next(ctx: TaskContext, at: Try) -> Try:
            at.outcome, at.t0, at.t1 = OK, 1.0, 1.5
            record(state, at.lease, OK, 0.0, 0.0, retry=False)
            return at

        lease = state.dispatcher.try_acquire(())
        assert lease is not None
        at = Try(lease)
        assert step(ctx, at, next) is at
        assert at.settle is None  # no race was set up
        assert scheduled == [("observed", 0.5)]
