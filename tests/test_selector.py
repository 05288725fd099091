"""Unit tests of worker selection: priority tiers, least connections, fair ties."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any, ClassVar

import pytest

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


# -- fairness across tiers --------------------------------------------------------------


def _unavailable(worker: Worker, how: str) -> None:
    if how == "unhealthy":
        worker.healthy = False
    elif how == "full":
        worker.in_flight = worker.capacity
    else:
        worker.breaker.record_failure(False)  # fail_max=1: opens


@pytest.mark.parametrize(
    ("down_tiers", "backups", "how"),
    [(1, 2, "unhealthy"), (1, 4, "full"), (2, 3, "open"), (3, 2, "unhealthy")],
)
def test_ties_rotate_evenly_in_a_lower_tier_whatever_was_scanned_before(down_tiers, backups, how):
    """With every higher tier unavailable, sequential picks spread evenly over the backups."""
    down = [make_worker(f"down{t}", priority=t + 1) for t in range(down_tiers)]
    for worker in down:
        _unavailable(worker, how)
    spare = [make_worker(f"backup-{i}", priority=down_tiers + 1) for i in range(backups)]
    selector = Selector([*down, *spare])
    picks = Counter(selector.select((), NOW).id for _ in range(60 * backups))
    assert picks == {w.id: 60 for w in spare}


def test_a_higher_tier_scanned_with_exclusions_does_not_skew_the_next_tier():
    """A task that tried the primary still rotates over the backups evenly."""
    primary = make_worker("primary", priority=1)
    spare = [make_worker(f"backup-{i}", priority=2) for i in range(2)]
    selector = Selector([primary, *spare])
    picks = Counter(selector.select({"primary"}, NOW).id for _ in range(100))
    assert picks == {"backup-0": 50, "backup-1": 50}


# -- the index: what it is told, and what it finds out ----------------------------------


def test_a_recovered_worker_is_found_once_reported():
    """A worker parked as unavailable is picked again after update() or invalidate()."""
    a, b = make_worker("a", priority=1), make_worker("b", priority=2)
    selector = Selector([a, b])
    a.healthy = False
    assert selector.select((), NOW) is b
    a.healthy = True
    selector.update(a, NOW)
    assert selector.select((), NOW) is a
    a.healthy = False
    assert selector.select((), NOW) is b
    a.healthy = True
    selector.invalidate()
    assert selector.select((), NOW) is a


def test_a_timed_worker_comes_back_by_itself_when_its_time_comes():
    """A breaker's trial time and a cool-down's end need no report."""
    a, b = make_worker("a", priority=1), make_worker("b", priority=2)
    selector = Selector([a, b])
    a.breaker.record_failure(False)  # opens for reset_timeout
    retry_at = a.breaker.retry_at()
    assert retry_at is not None
    assert selector.select((), NOW) is b
    assert selector.next_wake() == retry_at
    assert selector.select((), retry_at) is a


def test_least_connections_stays_exact_as_workers_fill_and_free():
    """In a small tier the least-loaded worker wins, whatever was parked and came back."""
    ws = [make_worker(n, capacity=3) for n in "abcd"]
    selector = Selector(ws)
    for w, load in zip(ws, [3, 2, 3, 1], strict=True):
        w.in_flight = load
    assert selector.select((), NOW) is ws[3]  # a and c are found full and parked
    ws[0].in_flight = 0
    selector.update(ws[0], NOW)
    assert selector.select((), NOW) is ws[0]
    ws[0].in_flight = 3
    ws[2].in_flight = 2
    selector.update(ws[2], NOW)
    ws[3].in_flight = 3
    assert selector.select((), NOW) in (ws[1], ws[2])
    assert selector.select({"b"}, NOW) is ws[2]


# -- cost: how many workers selection looks at ------------------------------------------


class _Watched(Worker):
    """A worker that notes every read of its state, to count the workers looked at."""

    seen: ClassVar[set[str]] = set()

    def __getattribute__(self, name: str) -> Any:
        _Watched.seen.add(super().__getattribute__("id"))
        return super().__getattribute__(name)


def watched(worker_id: str, priority: int = 1, capacity: int = 1) -> Worker:
    cfg = worker_config(
        worker_id, "http://127.0.0.1:9000", priority=priority, max_concurrent=capacity
    )
    breaker = WorkerBreaker(worker_id, BreakerConfig(fail_max=1), clock=CLOCK)
    return _Watched(cfg, _NoTransport(), breaker, _NoTransport())


def _fill(selector: Selector, count: int) -> list[Worker]:
    taken = []
    for _ in range(count):
        worker = selector.select((), NOW)
        assert worker is not None
        worker.in_flight += 1
        selector.taken(worker, NOW)
        taken.append(worker)
    return taken


def test_a_saturated_large_tier_is_passed_over_without_looking_at_its_workers():
    """1,000 workers at capacity in front of a spill tier: a pick looks at a few workers."""
    tier = [watched(f"w{i}") for i in range(1000)]
    spill = [watched("s0", priority=2), watched("s1", priority=2)]
    selector = Selector([*tier, *spill], rng=random.Random(3))
    assert all(w.priority == 1 for w in _fill(selector, 1000))
    _Watched.seen.clear()
    for _ in range(10):
        assert selector.select((), NOW) in spill
    assert _Watched.seen <= {"s0", "s1"}


def test_one_free_slot_among_a_thousand_workers_is_found_at_once():
    """A nearly full tier: the one worker with room is picked without a scan, and a
    worker whose task ends is back in one step."""
    tier = [watched(f"w{i}") for i in range(1000)]
    selector = Selector(tier, rng=random.Random(5))
    taken = _fill(selector, 999)
    (free,) = set(tier) - set(taken)
    _Watched.seen.clear()
    assert selector.select((), NOW) is free
    assert _Watched.seen == {free.id}
    free.in_flight += 1
    selector.taken(free, NOW)
    assert selector.select((), NOW) is None
    back = taken[500]
    back.in_flight -= 1
    _Watched.seen.clear()
    selector.update(back, NOW)
    assert selector.select((), NOW) is back
    assert _Watched.seen == {back.id}


def test_round_robin_follows_identity_as_workers_leave_and_rejoin():
    """Ties go to the first worker after the last one picked, in configuration order,
    whichever workers filled up or freed meanwhile."""
    rng = random.Random(11)
    ws = [make_worker(f"w{i:02}", capacity=1) for i in range(12)]
    selector = Selector(ws)
    order = {w.id: i for i, w in enumerate(ws)}
    last = -1
    for _ in range(500):
        for w in rng.sample(ws, 3):  # some fill up, some free: the ready list changes
            w.in_flight = 1 - w.in_flight
            selector.update(w, NOW)
        free = [order[w.id] for w in ws if w.in_flight == 0]
        chosen = selector.select((), NOW)
        if not free:
            assert chosen is None
            continue
        expected = min((i for i in free if i > last), default=min(free))
        assert chosen is not None and order[chosen.id] == expected
        last = expected
