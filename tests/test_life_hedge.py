"""The hedge step and its race alone (npu_sync._life.hedge)."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from npu_sync import InvalidTask, WorkerPool
from npu_sync._life.context import FIRST, HEDGE, TaskContext, Try
from npu_sync._life.hedge import Hedge, Race
from npu_sync._life.ledger import record
from npu_sync._life.outcomes import Outcomes
from npu_sync.config import BalancingConfig, BreakerConfig, HedgeConfig, RetryBudgetConfig
from npu_sync.events import AttemptFinished, AttemptHedged
from npu_sync.prometheus import instrument
from npu_sync.testing import FakeClock, FakeNetwork, FakeRequest, json_response
from tests.lifekit import OK, begin, config
from tests.stubs import NoTransport
from tests.test_prometheus import make_config
from tests.test_prometheus_balancing import get, single


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


# Attacks on the hedging bookkeeping: a hedge sent after its task already raised, hedges
# counted by a policy a reload replaced, a hedge refused as the pool stops, a cancelled
# hedge whose worker fails late.


GENEROUS = RetryBudgetConfig(ratio=1.0, min_per_second=100.0)


class Gated:
    """``w0`` answers once ``gate`` is set (``seen`` when its request arrived); ``w1``
    answers at once. Both name themselves."""

    def __init__(self, first: Any = None) -> None:
        self.seen = threading.Event()
        self.gate = threading.Event()
        self.first = first  # what w0 answers, by default a success

    def __call__(self, req: FakeRequest) -> Any:
        if req.worker_id == "w0":
            self.seen.set()
            self.gate.wait(30)
            if self.first is not None:
                return self.first
        return json_response(200, {"worker_id": req.worker_id})


def hedging(delay: float = 0.5, **kw: Any) -> BalancingConfig:
    return BalancingConfig(hedge=HedgeConfig(enabled=True, delay=delay), **kw)


def test_a_task_refused_as_invalid_is_never_hedged_afterwards():
    """The first attempt raises InvalidTask (nothing was sent): once the hedge's time
    comes, no hedge is sent, no request reaches the other worker, none is counted."""
    clock = FakeClock()
    net = FakeNetwork(lambda req: json_response(200, {"worker_id": req.worker_id}))
    net.route("w0", lambda req: InvalidTask("w0: a header value cannot be encoded"))
    config = make_config(
        "w0", "w1", balancing=hedging(retry_budget=GENEROUS), circuit_breaker=BreakerConfig()
    )
    pool = WorkerPool(config, transport_factory=net.factory, clock=clock)
    try:
        with pytest.raises(InvalidTask):
            pool.execute({"kind": "ok"})
        clock.advance(5)
        pool._state.hedger.run_due()
    finally:
        pool.close()  # joins the hedge threads: a hedge sent has ended
    assert net.requests("w1") == []
    assert pool.stats()["balancing"]["hedge"]["hedged"] == 0


def test_a_hedge_keeps_out_of_the_capacity_the_classes_above_its_task_reserve():
    """interactive (the default class) reserving 0.9 of 8 slots: a batch task's first
    attempt takes batch's one slot, and its hedge, judged by batch's ceiling and not
    the default class's, is skipped: nothing reaches the second worker."""
    from npu_sync import Task
    from npu_sync.config import ClassConfig, PriorityConfig

    clock = FakeClock()
    script = Gated()
    net = FakeNetwork(script)
    classes = PriorityConfig(
        classes=(ClassConfig("interactive", 0.9), ClassConfig("batch", 0.0)),
        default="interactive",
        aging=0,
    )
    config = make_config(
        "w0",
        "w1",
        balancing=hedging(retry_budget=GENEROUS),
        circuit_breaker=BreakerConfig(),
        priority=classes,
    )
    result: list[Any] = []
    with WorkerPool(config, transport_factory=net.factory, clock=clock) as pool:
        task = Task({"kind": "ok"}, priority="batch")
        caller = threading.Thread(target=lambda: result.append(pool.execute(task)))
        caller.start()
        try:
            assert script.seen.wait(10)
            clock.advance(1)
            pool._state.hedger.run_due()  # the hedge's time: judged here
        finally:
            script.gate.set()
            caller.join(30)
        hedge = pool.stats()["balancing"]["hedge"]
    assert result == [{"worker_id": "w0"}]
    assert net.requests("w1") == []
    assert (hedge["hedged"], hedge["skipped"]) == (0, 1)


def test_a_hedge_ending_after_a_reload_is_counted():
    """A task is hedged, the hedging policy is replaced by a reload while its hedge is
    out, and the hedge wins: the pool's totals and the Prometheus counter show it."""
    clock = FakeClock()
    script = Gated()
    net = FakeNetwork(script)
    config = make_config(
        "w0", "w1", balancing=hedging(retry_budget=GENEROUS), circuit_breaker=BreakerConfig()
    )
    registry = CollectorRegistry()
    hedge_answered = threading.Event()

    def hook(event: Any) -> None:
        if isinstance(event, AttemptFinished) and event.worker_id == "w1":
            hedge_answered.set()

    pool = WorkerPool(config, transport_factory=net.factory, clock=clock, hooks=[hook])
    result: list[Any] = []
    with pool, instrument(pool, registry):
        caller = threading.Thread(target=lambda: result.append(pool.execute({"kind": "ok"})))
        caller.start()
        try:
            assert script.seen.wait(10)
            pool.reload(replace(config, balancing=hedging(0.75, retry_budget=GENEROUS)))
            clock.advance(1)
            pool._state.hedger.run_due()  # the hedge goes to w1, which answers: it wins
            assert hedge_answered.wait(10)  # before the first attempt may answer
        finally:
            script.gate.set()
            caller.join(30)
        hedge = pool.stats()["balancing"]["hedge"]
        found = single(registry)
    assert result == [{"worker_id": "w1"}]
    assert (hedge["hedged"], hedge["won"]) == (1, 1)
    assert get(found, "npu_sync_hedges_total", result="won") == 1


def test_a_hedge_refused_because_the_pool_stops_is_skipped_without_an_error(caplog):
    """The hedger stops while a hedge is being handed over: the hedge is skipped and
    logged at debug level, not as an error with a traceback; the first attempt's
    answer is returned."""
    clock = FakeClock()
    script = Gated()
    net = FakeNetwork(script)
    config = make_config(
        "w0", "w1", balancing=hedging(retry_budget=GENEROUS), circuit_breaker=BreakerConfig()
    )
    pool: WorkerPool
    handing_over = threading.Event()

    def hook(event: Any) -> None:
        if isinstance(event, AttemptHedged):
            pool._state.hedger.stop_soon()  # as close() does, between hand-over and send
            handing_over.set()

    pool = WorkerPool(config, transport_factory=net.factory, clock=clock, hooks=[hook])
    result: list[Any] = []
    caplog.set_level(logging.DEBUG, logger="npu_sync")
    with pool:
        caller = threading.Thread(target=lambda: result.append(pool.execute({"kind": "ok"})))
        caller.start()
        try:
            assert script.seen.wait(10)
            clock.advance(1)
            pool._state.hedger.run_due()  # or the timer thread does
            assert handing_over.wait(10)
        finally:
            script.gate.set()
            caller.join(30)
    # close() joined the timer thread: the skipped hedge is counted.
    hedge = pool.stats()["balancing"]["hedge"]
    assert result == [{"worker_id": "w0"}]
    assert net.requests("w1") == []
    assert (hedge["hedged"], hedge["skipped"]) == (0, 1)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert any("not sent" in r.getMessage() for r in caplog.records)


def test_a_cancelled_hedge_whose_worker_fails_late_is_not_charged():
    """The first attempt wins; the hedge's worker then answers 500 (after its request
    was cancelled): the hedge is abandoned, its worker's breaker is not charged."""
    clock = FakeClock()
    first_won = threading.Event()
    hedge_seen = threading.Event()

    def handler(req: FakeRequest) -> Any:
        if req.worker_id == "w1":
            hedge_seen.set()
            first_won.wait(30)
            return json_response(500, {"detail": "late failure"})
        hedge_seen.wait(30)  # the first attempt answers once the hedge is out
        return json_response(200, {"worker_id": "w0"})

    net = FakeNetwork(handler)
    config = make_config(
        "w0",
        "w1",
        balancing=hedging(retry_budget=GENEROUS),
        circuit_breaker=BreakerConfig(fail_max=1, reset_timeout=30),
    )

    def hook(event: Any) -> None:
        if isinstance(event, AttemptFinished) and event.worker_id == "w0":
            first_won.set()

    pool = WorkerPool(config, transport_factory=net.factory, clock=clock, hooks=[hook])
    result: list[Any] = []
    with pool:
        caller = threading.Thread(target=lambda: result.append(pool.execute({"kind": "ok"})))
        caller.start()
        try:
            while not hedge_seen.is_set():
                clock.advance(1)
                pool._state.hedger.run_due()
                hedge_seen.wait(0.01)
        except BaseException:
            first_won.set()  # only to let the threads go: the test has failed
            raise
        finally:
            caller.join(30)
    rows = {w["id"]: w for w in pool.workers()}
    hedge = pool.stats()["balancing"]["hedge"]
    assert result == [{"worker_id": "w0"}]
    assert (hedge["hedged"], hedge["won"]) == (1, 0)
    assert rows["w1"]["tasks"]["failed"] == 0
    assert rows["w1"]["tasks"]["abandoned"] == 1
    assert rows["w1"]["breaker"]["state"] == "closed"
