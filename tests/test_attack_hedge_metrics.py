"""Attacks on the hedging bookkeeping and on the balancing series Prometheus follows:
a hedge sent after its task already raised, hedges and refusals counted by a policy a
reload replaced, reloads that reset the totals between two scrapes, reloads racing
scrapes, NaN and infinite estimates, and workers removed by a reload."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from npu_sync import InvalidTask, TaskFailed, WorkerPool
from npu_sync.config import (
    BalancingConfig,
    BreakerConfig,
    HedgeConfig,
    RetryBudgetConfig,
)
from npu_sync.events import AttemptFinished, AttemptHedged
from npu_sync.prometheus import instrument
from npu_sync.testing import FakeClock, FakeNetwork, FakeRequest, json_response
from tests.test_prometheus import make_config, multiprocess, scripted  # noqa: F401
from tests.test_prometheus_balancing import BalancingPool, everyone, get, samples, single

STINGY = RetryBudgetConfig(ratio=0.0, min_per_second=0.0)
GENEROUS = RetryBudgetConfig(ratio=1.0, min_per_second=100.0)


def refused_total(registry: CollectorRegistry) -> float:
    return get(single(registry), "npu_sync_retry_budget_refused_total")


# -- hedging bookkeeping ---------------------------------------------------------------


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


# -- the counters that follow the pool's totals ------------------------------------------


def test_refusals_after_a_reload_that_outgrow_those_before_are_all_counted():
    """Two refusals, a scrape, a reload that renews the retry budget, then three
    refusals: the pool's total and the counter read five, not three."""
    clock = FakeClock()
    net = FakeNetwork(scripted(clock))
    stingy = BalancingConfig(retry_budget=STINGY)
    config = make_config(
        "a", "b", balancing=stingy, circuit_breaker=BreakerConfig(fail_max=100, reset_timeout=30)
    )
    registry = CollectorRegistry()
    pool = WorkerPool(config, transport_factory=net.factory, clock=clock)
    with pool, instrument(pool, registry):
        for _ in range(2):
            with pytest.raises(TaskFailed, match="retry budget"):
                pool.execute({"kind": "down"})
        before = refused_total(registry)
        renewed = BalancingConfig(retry_budget=RetryBudgetConfig(ratio=0.01, min_per_second=0))
        pool.reload(replace(config, balancing=renewed))
        for _ in range(3):
            with pytest.raises(TaskFailed, match="retry budget"):
                pool.execute({"kind": "down"})
        after = refused_total(registry)
        total = pool.stats()["balancing"]["retry_budget"]["refused"]
    assert (before, after, total) == (2, 5, 5)


def test_counters_never_go_back_while_reloads_race_scrapes():
    """Tasks whose retries the budget refuses, reloads that renew the budget, and three
    threads scraping all at once: no thread ever sees a counter lower than it saw
    before, and the last one counts no more refusals than happened."""
    clock = FakeClock()
    net = FakeNetwork(scripted(clock))
    config = make_config(
        "a",
        "b",
        balancing=BalancingConfig(retry_budget=STINGY),
        circuit_breaker=BreakerConfig(fail_max=10_000, reset_timeout=30),
    )
    budgets = [
        BalancingConfig(retry_budget=RetryBudgetConfig(ratio=r, min_per_second=0.0))
        for r in (0.0, 0.001)
    ]
    registry = CollectorRegistry()
    pool = WorkerPool(config, transport_factory=net.factory, clock=clock)
    stop = threading.Event()
    seen: dict[int, list[float]] = {}
    refused = 0

    def scrape(n: int) -> None:
        series = seen.setdefault(n, [])
        while not stop.is_set():
            series.append(refused_total(registry))

    with pool, instrument(pool, registry):
        scrapers = [threading.Thread(target=scrape, args=(n,)) for n in range(3)]
        for thread in scrapers:
            thread.start()
        try:
            for round_ in range(30):
                for _ in range(3):
                    with pytest.raises(TaskFailed, match="retry budget"):
                        pool.execute({"kind": "down"})
                refused += 3
                pool.reload(replace(config, balancing=budgets[round_ % 2 - 1]))
        finally:
            stop.set()
            for thread in scrapers:
                thread.join(30)
        last = refused_total(registry)
    for series in seen.values():
        assert series == sorted(series)
    assert last <= refused


@pytest.mark.parametrize("estimate", [float("inf"), float("nan")])
def test_an_infinite_or_nan_estimate_does_not_break_the_scrape(estimate):
    """A worker whose estimate is inf or NaN: the scrape still serves every series,
    the other worker's estimate and the counters included."""
    registry = CollectorRegistry()
    pool = BalancingPool("a", "b")
    pool.rows["a"] = {"latency_estimate_ms": estimate, "share": 1.0}
    pool.refused = 2
    with instrument(pool, registry):
        found = samples(generate_latest(registry))
    assert get(found, "npu_sync_worker_latency_estimate_seconds", worker="b") == 0.02
    value = get(found, "npu_sync_worker_latency_estimate_seconds", worker="a")
    assert value == estimate or (value != value and estimate != estimate)
    assert get(found, "npu_sync_retry_budget_refused_total") == 2


def test_a_worker_removed_by_a_reload_leaves_the_balancing_gauges():
    """One process: after a reload removes a worker, its estimate and share series are
    gone at the next scrape while the other worker's stay."""
    clock = FakeClock()
    net = FakeNetwork(scripted(clock))
    config = make_config("a", "b")
    registry = CollectorRegistry()
    pool = WorkerPool(config, transport_factory=net.factory, clock=clock)
    with pool, instrument(pool, registry):
        pool.execute({"kind": "ok"})
        before = single(registry)
        pool.reload(replace(config, workers=config.workers[:1]))
        after = single(registry)
    for name in ("npu_sync_worker_latency_estimate_seconds", "npu_sync_worker_share"):
        assert (name, (("worker", "b"),)) in before
        assert (name, (("worker", "b"),)) not in after
        assert (name, (("worker", "a"),)) in after


def test_multiprocess_a_removed_worker_reads_zero_and_a_live_one_its_values(
    multiprocess,  # noqa: F811
):
    """Multiprocess mode: a worker a reload removed reads 0 for its estimate and its
    full share, its weight (a series in the files cannot go); the remaining worker
    reads its own values."""
    clock = FakeClock()
    net = FakeNetwork(scripted(clock))
    config = make_config("a", "b")
    pool = WorkerPool(config, transport_factory=net.factory, clock=clock)
    with pool, instrument(pool):
        pool.execute({"kind": "ok"})
        everyone(pool)
        pool.reload(replace(config, workers=config.workers[:1]))
        found = everyone(pool)
        row = {w["id"]: w["balancing"] for w in pool.workers()}["a"]
    assert get(found, "npu_sync_worker_share", worker="b") == 1  # its weight
    assert get(found, "npu_sync_worker_latency_estimate_seconds", worker="b") == 0
    assert get(found, "npu_sync_worker_share", worker="a") == row["share"]


def test_multiprocess_a_worker_one_process_removed_keeps_the_share_others_give_it(
    multiprocess,  # noqa: F811
):
    """Two processes use worker ``b``, one still ramping it up (share 0.4 of weight 2);
    the other removes it: the fleet's share of ``b`` stays 0.4, not 0."""
    pids, _ = multiprocess
    ramping = BalancingPool("a", "b")
    ramping.rows["b"] = {"latency_estimate_ms": 20.0, "share": 0.4, "weight": 2}
    with instrument(ramping):  # closed, its files stay: a process still running
        everyone(ramping)

    pids.pid = 102
    removing = BalancingPool("a", "b")
    removing.rows["b"] = {"latency_estimate_ms": 20.0, "share": 2.0, "weight": 2}
    with instrument(removing):
        assert get(everyone(removing), "npu_sync_worker_share", worker="b") == 0.4
        del removing.rows["b"]
        found = everyone(removing)
    assert get(found, "npu_sync_worker_share", worker="b") == 0.4
    assert get(found, "npu_sync_worker_latency_estimate_seconds", worker="b") == 0.02
