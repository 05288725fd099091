"""Unit tests of worker selection: priority tiers, least connections, fair ties."""

from __future__ import annotations

import random
from collections import Counter

from npu_sync.breaker import WorkerBreaker
from npu_sync.config import BreakerConfig, worker_config
from npu_sync.selector import P2C_THRESHOLD, Selector
from npu_sync.testing import FakeClock
from npu_sync.worker import Worker

CLOCK = FakeClock()
NOW = CLOCK.monotonic()


class _NoTransport:
    def request(self, *args, **kwargs):  # pragma: no cover - selection never sends
        raise AssertionError("selection must not do I/O")

    def close(self) -> None:
        pass


def make_worker(worker_id: str, priority: int = 1, capacity: int = 8, port: int = 0) -> Worker:
    port = port or 9000 + abs(hash(worker_id)) % 50000
    cfg = worker_config(
        worker_id, f"http://127.0.0.1:{port}", priority=priority, max_concurrent=capacity
    )
    breaker = WorkerBreaker(worker_id, BreakerConfig(fail_max=1), clock=CLOCK)
    return Worker(cfg, _NoTransport(), breaker, _NoTransport())


def test_lower_priority_number_wins_even_when_busier():
    """A busy priority-1 worker is preferred over an idle priority-2 one."""
    w1, w2 = make_worker("a", 1), make_worker("b", 2)
    w1.in_flight = 5
    assert Selector([w2, w1]).select((), NOW) is w1


def test_spills_to_next_tier_only_when_higher_tier_has_no_eligible_worker():
    """Tier 2 is used once every tier-1 worker is full, open, unhealthy, draining or tried."""
    a, b, c = make_worker("a", 1, capacity=1), make_worker("b", 1), make_worker("c", 2)
    selector = Selector([a, b, c])
    a.in_flight = 1
    assert selector.select((), NOW) is b
    b.healthy = False
    assert selector.select((), NOW) is c
    b.healthy = True
    b.draining = True
    assert selector.select((), NOW) is c
    b.draining = False
    assert selector.select({"b"}, NOW) is c
    b.breaker.record_failure(False)  # fail_max=1: opens
    assert selector.select((), NOW) is c


def test_disabled_and_cooling_down_workers_are_skipped():
    """A disabled worker, or one inside its Retry-After, gets nothing."""
    a = make_worker("a")
    b = Worker(
        worker_config("b", "http://127.0.0.1:9999", enabled=False),
        _NoTransport(),
        WorkerBreaker("b", BreakerConfig(), clock=CLOCK),
        _NoTransport(),
    )
    selector = Selector([a, b])
    assert selector.select((), NOW) is a
    a.cooldown_until = NOW + 1
    assert selector.select((), NOW) is None
    assert selector.select((), NOW + 1) is a


def test_fewest_in_flight_wins_within_a_tier():
    """Least connections: the worker with the fewest tasks in flight is chosen."""
    ws = [make_worker(n) for n in "abcd"]
    for w, load in zip(ws, [3, 1, 2, 4], strict=True):
        w.in_flight = load
    assert Selector(ws).select((), NOW) is ws[1]


def test_excluded_workers_are_never_picked():
    """A worker already tried for the task is skipped even if it is the best."""
    a, b = make_worker("a"), make_worker("b")
    b.in_flight = 7
    assert Selector([a, b]).select({"a"}, NOW) is b
    assert Selector([a, b]).select({"a", "b"}, NOW) is None


def test_ties_are_spread_evenly():
    """Equal workers share picks evenly rather than the first always winning."""
    ws = [make_worker(n) for n in "abc"]
    selector = Selector(ws)
    picks = Counter(selector.select((), NOW).id for _ in range(300))
    assert picks == {"a": 100, "b": 100, "c": 100}


def test_large_tier_sampling_never_picks_an_ineligible_worker():
    """Power-of-two-choices on a large tier still honours exclusions and capacity."""
    ws = [make_worker(f"w{i}", capacity=1, port=10000 + i) for i in range(P2C_THRESHOLD * 2)]
    for w in ws[:-1]:
        w.in_flight = 1  # full
    selector = Selector(ws, rng=random.Random(7))
    for _ in range(50):
        assert selector.select((), NOW) is ws[-1]
    assert selector.select({ws[-1].id}, NOW) is None


def test_large_tier_sampling_prefers_the_less_loaded_of_two():
    """With two candidates sampled, the lighter one is chosen."""
    ws = [make_worker(f"w{i}", capacity=100, port=20000 + i) for i in range(P2C_THRESHOLD + 10)]
    for i, w in enumerate(ws):
        w.in_flight = i % 50
    selector = Selector(ws, rng=random.Random(1))
    loads = [selector.select((), NOW).in_flight for _ in range(2000)]
    # Uniform random choice would average ~24.5; the better of two averages ~16.
    assert sum(loads) / len(loads) < 20
