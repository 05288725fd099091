"""The balancing series (latency estimate, share, retry budget, hedges) in one process
and in prometheus_client's multiprocess mode: the same names and labels, gauges combined
per series, counters summed and never going back."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from npu_sync import TaskFailed, WorkerPool
from npu_sync.config import BalancingConfig, BreakerConfig, RetryBudgetConfig
from npu_sync.events import Hook
from npu_sync.prometheus import instrument, metrics_text
from npu_sync.testing import FakeClock, FakeNetwork
from tests.test_prometheus import make_config, multiprocess, scripted  # noqa: F401

# Every balancing series and its label names, as both modes must show them.
SERIES = {
    "npu_sync_worker_latency_estimate_seconds": ("worker",),
    "npu_sync_worker_share": ("worker",),
    "npu_sync_retry_budget_balance": (),
    "npu_sync_retry_budget_refused_total": (),
    "npu_sync_hedges_total": ("result",),
    "npu_sync_hedges_skipped_total": (),
}


class BalancingPool:
    """Stands in for a pool: workers with a latency estimate and a share, and retry
    budget and hedging totals that the test moves."""

    def __init__(self, *worker_ids: str) -> None:
        self.hooks: list[Hook] = []
        self.closed = False
        self.refused = self.hedged = self.won = self.skipped = 0
        self.balance = 20.0
        self.rows = {wid: {"latency_estimate_ms": 20.0, "share": 1.0} for wid in worker_ids}
        self.during_stats: Callable[[], None] | None = None  # runs once, inside stats()

    def add_hook(self, hook: Hook) -> None:
        self.hooks.append(hook)

    def remove_hook(self, hook: Hook) -> None:
        self.hooks = [h for h in self.hooks if h is not hook]

    def stats(self) -> dict[str, Any]:
        totals = {"hedged": self.hedged, "won": self.won, "skipped": self.skipped}
        refused = self.refused
        during, self.during_stats = self.during_stats, None
        if during is not None:
            during()
        return {
            "tasks": {"waiting": 0},
            "dead_letters": {"pending": 0},
            "balancing": {
                "retry_budget": {"balance": self.balance, "refused": refused},
                "hedge": totals,
            },
        }

    def workers(self) -> list[dict[str, Any]]:
        return [
            {
                "id": wid,
                "in_flight": 0,
                "capacity": 4,
                "healthy": True,
                "breaker": {"state": "closed"},
                "latency": {"ewma_ms": None},
                "failure_rate": None,
                "balancing": dict(row),
            }
            for wid, row in self.rows.items()
        ]


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text.decode())
        for s in f.samples
    }


def balancing_series(found: dict) -> dict[str, set[tuple[str, ...]]]:
    """Per balancing series, the label names its samples carry."""
    shapes: dict[str, set[tuple[str, ...]]] = {}
    for name, labels in found:
        if name in SERIES:
            shapes.setdefault(name, set()).add(tuple(k for k, _ in labels))
    return shapes


def get(found: dict, name: str, **labels: str) -> float:
    return found[(name, tuple(sorted(labels.items())))]


def single(registry: CollectorRegistry) -> dict:
    return samples(generate_latest(registry))


def everyone(pool: Any) -> dict:
    return samples(metrics_text(pool)[0])


# -- one process ----------------------------------------------------------------------


def test_one_process_shows_every_balancing_series_from_the_pool():
    """Estimates and shares per worker, the budget's balance, and the refusal and hedge
    counters, with the pool's values and their own label names."""
    registry = CollectorRegistry()
    pool = BalancingPool("a", "b")
    pool.rows["b"] = {"latency_estimate_ms": 250.0, "share": 0.25}
    pool.refused, pool.hedged, pool.won, pool.skipped = 3, 5, 2, 1
    with instrument(pool, registry):
        found = single(registry)
    assert balancing_series(found) == {name: {labels} for name, labels in SERIES.items()}
    assert get(found, "npu_sync_worker_latency_estimate_seconds", worker="b") == 0.25
    assert get(found, "npu_sync_worker_share", worker="b") == 0.25
    assert get(found, "npu_sync_worker_share", worker="a") == 1.0
    assert get(found, "npu_sync_retry_budget_balance") == 20.0
    assert get(found, "npu_sync_retry_budget_refused_total") == 3
    assert get(found, "npu_sync_hedges_total", result="won") == 2
    assert get(found, "npu_sync_hedges_total", result="lost") == 3
    assert get(found, "npu_sync_hedges_skipped_total") == 1


def test_counters_move_by_what_the_totals_grew_and_never_go_back():
    """Each counter moves by what its total grew since the last read; a total that
    drops (a stand-in counting afresh: a pool's never do) is not taken for a reset from
    zero, only as the point to count on from, and the counter never goes back."""
    registry = CollectorRegistry()
    pool = BalancingPool("a")
    pool.refused, pool.hedged, pool.won, pool.skipped = 10, 8, 6, 4
    with instrument(pool, registry):
        assert get(single(registry), "npu_sync_retry_budget_refused_total") == 10
        pool.refused, pool.hedged, pool.won, pool.skipped = 2, 1, 1, 0
        after = single(registry)
        pool.refused, pool.hedged, pool.won, pool.skipped = 5, 4, 2, 3
        later = single(registry)
    assert get(after, "npu_sync_retry_budget_refused_total") == 10
    assert get(after, "npu_sync_hedges_total", result="won") == 6
    assert get(after, "npu_sync_hedges_total", result="lost") == 2
    assert get(after, "npu_sync_hedges_skipped_total") == 4
    assert get(later, "npu_sync_retry_budget_refused_total") == 13
    assert get(later, "npu_sync_hedges_total", result="won") == 7
    assert get(later, "npu_sync_hedges_total", result="lost") == 4
    assert get(later, "npu_sync_hedges_skipped_total") == 7


def test_a_reload_that_renews_the_retry_budget_does_not_take_refusals_back():
    """A real pool: refusals counted, then a reload replaces the budget; the pool's
    total and the counter keep the refusals from before."""
    clock = FakeClock()
    net = FakeNetwork(scripted(clock))
    stingy = BalancingConfig(retry_budget=RetryBudgetConfig(ratio=0.0, min_per_second=0.0))
    # Breakers that stay closed: every task's first attempt fails on "a", its retry is refused.
    config = make_config(
        "a", "b", balancing=stingy, circuit_breaker=BreakerConfig(fail_max=100, reset_timeout=30)
    )
    registry = CollectorRegistry()
    pool = WorkerPool(config, transport_factory=net.factory, clock=clock)
    with pool, instrument(pool, registry):
        for _ in range(2):
            with pytest.raises(TaskFailed, match="retry budget"):
                pool.execute({"kind": "down"})
        before = get(single(registry), "npu_sync_retry_budget_refused_total")
        renewed = replace(stingy, retry_budget=RetryBudgetConfig(ratio=0.01, min_per_second=0))
        pool.reload(replace(config, balancing=renewed))
        with pytest.raises(TaskFailed, match="retry budget"):
            pool.execute({"kind": "down"})
        assert pool.stats()["balancing"]["retry_budget"]["refused"] == 3
        after = get(single(registry), "npu_sync_retry_budget_refused_total")
    assert (before, after) == (2, 3)


def test_concurrent_scrapes_count_each_refusal_once():
    """A scrape that read the totals earlier but applies them later does not count
    them again: only the thread that claimed the totals before reading follows them."""
    registry = CollectorRegistry()
    pool = BalancingPool("a")
    pool.refused = 5
    with instrument(pool, registry):
        inside, release = threading.Event(), threading.Event()

        def slow_read() -> None:  # the first scrape's stats(): it read 6, then stalls
            inside.set()
            release.wait(30)

        pool.refused = 6
        pool.during_stats = slow_read
        first = threading.Thread(target=generate_latest, args=(registry,))
        first.start()
        assert inside.wait(10)
        pool.refused = 7
        generate_latest(registry)  # reads 7 meanwhile
        release.set()
        first.join(30)
        assert get(single(registry), "npu_sync_retry_budget_refused_total") == 7


# -- multiprocess mode ------------------------------------------------------------------


def test_multiprocess_mode_has_the_same_series_and_labels(multiprocess):  # noqa: F811
    """The balancing series are written to the files and served with the names and
    labels of one process (no pid label)."""
    pool = BalancingPool("a", "b")
    pool.refused, pool.hedged, pool.won, pool.skipped = 3, 5, 2, 1
    with instrument(pool):
        found = everyone(pool)
    assert balancing_series(found) == {name: {labels} for name, labels in SERIES.items()}
    assert get(found, "npu_sync_retry_budget_refused_total") == 3
    assert get(found, "npu_sync_hedges_total", result="lost") == 3


def test_multiprocess_mode_combines_each_series_over_the_processes(multiprocess):  # noqa: F811
    """Counters add up over the processes; the estimate is the worst process's, the
    share the smallest (a worker still ramping up somewhere), the balance the sum. Once
    a process dies its gauges go and its counters stay."""
    from prometheus_client.multiprocess import mark_process_dead

    pids, directory = multiprocess
    first = BalancingPool("a")
    first.rows["a"] = {"latency_estimate_ms": 30.0, "share": 1.0}
    first.refused, first.hedged, first.won, first.skipped = 4, 3, 1, 2
    first.balance = 20.0
    exporter = instrument(first)
    first_view = everyone(first)
    exporter.close()

    pids.pid = 102
    second = BalancingPool("a")
    second.rows["a"] = {"latency_estimate_ms": 500.0, "share": 0.2}
    second.refused, second.hedged, second.won, second.skipped = 1, 2, 2, 0
    second.balance = 5.0
    with instrument(second):
        both = everyone(second)
        mark_process_dead(101, directory)
        after = everyone(second)

    assert get(first_view, "npu_sync_retry_budget_balance") == 20.0
    assert get(both, "npu_sync_retry_budget_refused_total") == 5
    assert get(both, "npu_sync_hedges_total", result="won") == 3
    assert get(both, "npu_sync_hedges_total", result="lost") == 2
    assert get(both, "npu_sync_hedges_skipped_total") == 2
    assert get(both, "npu_sync_worker_latency_estimate_seconds", worker="a") == 0.5
    assert get(both, "npu_sync_worker_share", worker="a") == 0.2
    assert get(both, "npu_sync_retry_budget_balance") == 25.0
    # The dead process's gauges are gone, its counters stay in the sum.
    assert get(after, "npu_sync_retry_budget_balance") == 5.0
    assert get(after, "npu_sync_retry_budget_refused_total") == 5
    assert get(after, "npu_sync_hedges_skipped_total") == 2


def test_multiprocess_counters_never_go_back_when_a_total_drops(multiprocess):  # noqa: F811
    """In the files too, a total that drops is never subtracted, and what it grows
    afterwards is added."""
    pool = BalancingPool("a")
    pool.refused, pool.skipped = 10, 4
    with instrument(pool):
        assert get(everyone(pool), "npu_sync_retry_budget_refused_total") == 10
        pool.refused, pool.skipped = 2, 1
        dropped = everyone(pool)
        pool.refused, pool.skipped = 3, 3
        found = everyone(pool)
    assert get(dropped, "npu_sync_retry_budget_refused_total") == 10
    assert get(found, "npu_sync_retry_budget_refused_total") == 11
    assert get(found, "npu_sync_hedges_skipped_total") == 6


def test_a_process_never_scraped_writes_its_balancing_series_each_monitor_sample(
    multiprocess,  # noqa: F811
):
    """A real pool's estimates, shares, balance and refusals reach the files on a
    fleet-monitor sample, without a scrape of that process."""
    from prometheus_client import CollectorRegistry as Registry
    from prometheus_client.multiprocess import MultiProcessCollector

    from npu_sync._fleet import monitor_of

    _, directory = multiprocess
    clock = FakeClock()
    net = FakeNetwork(scripted(clock))
    stingy = BalancingConfig(retry_budget=RetryBudgetConfig(ratio=0.0, min_per_second=0.0))
    pool = WorkerPool(
        make_config("a", "b", balancing=stingy), transport_factory=net.factory, clock=clock
    )
    with pool, instrument(pool):
        pool.execute({"kind": "ok"})
        with pytest.raises(TaskFailed, match="retry budget"):
            pool.execute({"kind": "down"})
        files = Registry()
        MultiProcessCollector(files, directory)
        assert files.get_sample_value("npu_sync_worker_share", {"worker": "a"}) is None
        monitor_of(pool).tick()
        rows = {w["id"]: w["balancing"] for w in pool.workers()}
        balance = pool.stats()["balancing"]["retry_budget"]["balance"]
        share = files.get_sample_value("npu_sync_worker_share", {"worker": "b"})
        estimate = files.get_sample_value(
            "npu_sync_worker_latency_estimate_seconds", {"worker": "a"}
        )
        refused = files.get_sample_value("npu_sync_retry_budget_refused_total")
        budget = files.get_sample_value("npu_sync_retry_budget_balance")
    assert share == rows["b"]["share"]
    assert estimate == pytest.approx(rows["a"]["latency_estimate_ms"] / 1000)
    assert (refused, budget) == (1, balance)


# Attacks on the balancing series: reloads that reset the totals between two scrapes,
# reloads racing scrapes, NaN and infinite estimates, and workers removed by a reload.


STINGY = RetryBudgetConfig(ratio=0.0, min_per_second=0.0)


def refused_total(registry: CollectorRegistry) -> float:
    return get(single(registry), "npu_sync_retry_budget_refused_total")


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
