"""Unit tests of worker selection: priority tiers, least connections, fair ties."""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from typing import Any, ClassVar

import pytest

from npu_sync._admission import Dispatcher
from npu_sync._balancing.least_loaded import P2C_THRESHOLD
from npu_sync._balancing.limits import HillClimbingLimit
from npu_sync._balancing.selector import Selector
from npu_sync._balancing.slowstart import SlowStart
from npu_sync._breaker import WorkerBreaker
from npu_sync._latency import TYPICAL
from npu_sync._worker import Worker
from npu_sync.config import BreakerConfig, worker_config
from npu_sync.testing import FakeClock
from tests.stubs import NoTransport

CLOCK = FakeClock()
NOW = CLOCK.monotonic()


def make_worker(worker_id: str, priority: int = 1, capacity: int = 8, port: int = 0) -> Worker:
    port = port or 9000 + abs(hash(worker_id)) % 50000
    cfg = worker_config(
        worker_id, f"http://127.0.0.1:{port}", priority=priority, max_concurrent=capacity
    )
    breaker = WorkerBreaker(worker_id, BreakerConfig(fail_max=1), clock=CLOCK)
    return Worker(cfg, NoTransport(), breaker, NoTransport())


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
        NoTransport(),
        WorkerBreaker("b", BreakerConfig(), clock=CLOCK),
        NoTransport(),
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
    return _Watched(cfg, NoTransport(), breaker, NoTransport())


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


# -- latency-aware choice, weights, slow start -----------------------------------------


class Fleet:
    """Tasks on a simulated clock: ``callers`` threads that each send a task as soon as
    the last one answered, to workers answering after ``latency[worker_id]`` seconds
    (None: never). Selection, leases and releases go through a real Dispatcher."""

    def __init__(self, selector: Selector, latency: dict[str, float | None], callers: int):
        self.clock = FakeClock()
        self.selector = selector
        self.dispatcher = Dispatcher(self.clock, selector)
        self.latency = latency
        self.callers = callers
        self.sent: list[tuple[float, str]] = []  # (time, worker id) of every task sent
        self._heap: list[tuple[float, int, Worker]] = []
        self._seq = 0
        self._idle = callers  # callers with nothing in flight (their worker froze)

    def run(self, until: float) -> None:
        """Run until the clock reaches ``until``."""
        for _ in range(self._idle):
            self._send()
        self._idle = 0
        while self._heap and self._heap[0][0] <= until:
            at, _, worker = heapq.heappop(self._heap)
            self.clock.advance(at - self.clock.monotonic())
            with self.dispatcher.lock:
                worker.in_flight -= 1
                self.selector.observe(worker, self.latency[worker.id] or 0.0, at)
                self.dispatcher.release_worker_locked(worker, at)
            self._send()
        self.clock.advance(max(0.0, until - self.clock.monotonic()))

    def _send(self) -> None:
        now = self.clock.monotonic()
        lease = self.dispatcher.acquire((), now + 3600)
        assert lease is not None, "capacity is sized so that nobody waits"
        worker = lease.worker
        self.sent.append((now, worker.id))
        rtt = self.latency[worker.id]
        if rtt is None:
            return  # frozen: this caller is stuck for the rest of the run
        self._seq += 1
        heapq.heappush(self._heap, (now + rtt, self._seq, worker))

    def freeze(self, worker_id: str) -> None:
        """The worker stops answering, the tasks it has in flight included."""
        self.latency[worker_id] = None
        self._heap = [event for event in self._heap if event[2].id != worker_id]
        heapq.heapify(self._heap)

    def share(self, worker_id: str, since: float, until: float = float("inf")) -> float:
        window = [wid for at, wid in self.sent if since <= at < until]
        return window.count(worker_id) / len(window)


def latency_selector(workers: list[Worker], **kw: Any) -> Selector:
    return Selector(workers, latency_aware=True, now=CLOCK.monotonic(), **kw)


@pytest.mark.parametrize("aware", [True, False])
def test_a_slower_worker_gets_tasks_in_proportion_to_what_it_can_do(aware):
    """Latency-aware: a worker 10x slower gets a fraction of a percent of the tasks, not
    the ~5 % least connections gives it (equal in-flight counts)."""
    ws = [make_worker(n, capacity=64) for n in "abc"]
    fleet = Fleet(
        Selector(ws, latency_aware=aware, now=CLOCK.monotonic()),
        {"a": 0.02, "b": 0.02, "c": 0.2},
        callers=32,
    )
    start = fleet.clock.monotonic()
    fleet.run(start + 10)
    share = fleet.share("c", start + 2)
    if aware:
        assert share < 0.01
    else:
        assert share > 0.03


def test_a_ten_times_slower_parallel_worker_gets_nothing_while_the_fast_ones_have_room():
    """Workers that run their tasks in parallel: once its first answers are seen, a
    worker 10x slower gets no task while the fast ones have room (a task there takes
    20 ms however many they run), where counting its tasks in flight as a queue gave
    it one whenever it was idle."""
    ws = [make_worker(n, capacity=64) for n in "abc"]
    fleet = Fleet(latency_selector(ws), {"a": 0.02, "b": 0.02, "c": 0.2}, callers=32)
    start = fleet.clock.monotonic()
    fleet.run(start + 10)
    assert [at for at, wid in fleet.sent if wid == "c" and at >= start + 1] == []
    assert ws[0].in_flight < ws[0].capacity and ws[1].in_flight < ws[1].capacity
    assert fleet.share("a", start + 1) == pytest.approx(0.5, abs=0.1)


def test_a_slow_worker_takes_the_overflow_once_the_fast_ones_are_full():
    """With the fast workers at capacity, the slow one serves what they cannot: every
    caller stays busy, the slow worker holding the callers left over."""
    ws = [make_worker(n, capacity=8) for n in "abc"]
    fleet = Fleet(latency_selector(ws), {"a": 0.02, "b": 0.02, "c": 0.2}, callers=20)
    start = fleet.clock.monotonic()
    fleet.run(start + 10)
    assert [w.in_flight for w in ws] == [8, 8, 4]
    # 4 tasks in flight at 200 ms against 16 at 20 ms: 20 a second of 820.
    assert fleet.share("c", start + 1) == pytest.approx(20 / 820, abs=0.01)


def test_a_burst_before_any_answer_spreads_over_workers_about_as_fast():
    """Many selections between two answers do not all go to the worker whose estimate
    is a hair lower: the load term spreads them, by how full each worker is."""
    a, b = make_worker("a", capacity=64), make_worker("b", capacity=64)
    selector = latency_selector([a, b])
    now = CLOCK.monotonic()
    selector.observe(a, 0.020, now)
    selector.observe(b, 0.022, now)
    for _ in range(32):
        chosen = selector.select((), now)
        assert chosen is not None
        chosen.in_flight += 1
    assert a.in_flight > b.in_flight >= 8


def test_the_first_answer_of_a_tier_seeds_the_workers_without_one():
    """At a pool's start, a worker that has not answered yet does not look free (0) next
    to one that answered in 20 ms: it starts from that answer, and a burst of tasks
    before its own first answer spreads instead of filling it up."""
    a, b = make_worker("a", capacity=64), make_worker("b", capacity=64)
    selector = latency_selector([a, b])
    now = CLOCK.monotonic()
    selector.observe(a, 0.02, now)
    b_latency = selector.state_of(b).latency
    assert b_latency.value(now) == pytest.approx(0.02) and not b_latency.observed
    for _ in range(32):
        chosen = selector.select((), now)
        assert chosen is not None
        if not chosen.in_flight:
            selector.started(chosen, now)  # as the dispatcher does
        chosen.in_flight += 1
    assert a.in_flight == b.in_flight == 16
    selector.observe(b, 0.2, now)
    assert b_latency.value(now) == pytest.approx(0.2)  # its own answer replaces the seed
    selector.observe(a, 0.01, now)
    assert b_latency.value(now) == pytest.approx(0.2)  # once per tier


def test_costs_follow_capacity_and_weight_with_latency_on():
    """Equal estimates: a worker that runs twice as many tasks at once, or has twice
    the weight, holds twice the tasks in flight."""
    a, b, c = (make_worker(n, capacity=k) for n, k in (("a", 16), ("b", 32), ("c", 16)))
    c.weight = 2
    selector = latency_selector([a, b, c])
    now = CLOCK.monotonic()
    for w in (a, b, c):
        selector.observe(w, 0.02, now)
    for _ in range(40):
        chosen = selector.select((), now)
        assert chosen is not None
        chosen.in_flight += 1
    assert (a.in_flight, b.in_flight, c.in_flight) == (8, 16, 16)


def test_a_slow_worker_is_tried_again_once_its_estimate_has_decayed():
    """Its answers take 200 ms; while the others answer in 20 ms, it gets a task now
    and then while it has too few answers for a typical latency of its own (each hold,
    at its tier's), then nothing until its estimate decays below theirs (about ln(10)
    decays), then a task."""
    ws = [make_worker(n, capacity=64) for n in "abc"]
    selector = latency_selector(ws)
    fleet = Fleet(selector, {"a": 0.02, "b": 0.02, "c": 0.2}, callers=1)
    start = fleet.clock.monotonic()
    for w in ws:
        selector.observe(w, fleet.latency[w.id] or 0.0, start)
    fleet.run(start + 60)
    to_c = [at - start for at, wid in fleet.sent if wid == "c"]
    assert to_c, "the slow worker was never tried again"
    assert 1.0 <= to_c[0] < 2.0  # the hold: it has one answer, its tier's median counts
    # Its own median once it has half of TYPICAL answers: then only the decay.
    probes = [at for at in to_c if at < 15]
    assert len(probes) == TYPICAL // 2 - 1
    later = [at for at in to_c if at >= 15]
    assert later and later[0] - probes[-1] > 20  # 0.2 * exp(-t / 10) < 0.02: 23 s


def test_a_frozen_worker_gets_no_more_tasks_while_its_estimate_decays():
    """A worker that stops answering keeps its stuck tasks (nobody could know) but gets
    no new one: silent for longer than its estimate, it counts as at least that slow,
    where decay alone would make it look cheaper by the second."""
    ws = [make_worker(n, capacity=64) for n in "abc"]
    fleet = Fleet(latency_selector(ws), {"a": 0.02, "b": 0.02, "c": 0.02}, callers=32)
    start = fleet.clock.monotonic()
    fleet.run(start + 1)
    fleet.freeze("c")
    frozen_at = fleet.clock.monotonic()
    stuck = ws[2].in_flight
    fleet.run(frozen_at + 5)
    assert ws[2].in_flight == stuck > 0
    assert not [at for at, wid in fleet.sent if wid == "c" and at >= frozen_at]


def test_weights_divide_load_with_latency_off():
    """Weighted least connections: a worker of weight 3 holds three times the tasks."""
    a, b = make_worker("a", capacity=64), make_worker("b", capacity=64)
    b.weight = 3
    selector = Selector([a, b])
    held = Counter()
    for _ in range(40):
        chosen = selector.select((), NOW)
        assert chosen is not None
        chosen.in_flight += 1
        held[chosen.id] += 1
    assert held == {"a": 10, "b": 30}


def test_weights_divide_load_with_latency_on():
    """Latency-aware and weighted: equal latencies, weight 2 takes twice the tasks."""
    a, b = make_worker("a", capacity=64), make_worker("b", capacity=64)
    b.weight = 2
    selector = latency_selector([a, b])
    fleet = Fleet(selector, {"a": 0.02, "b": 0.02}, callers=30)
    start = fleet.clock.monotonic()
    fleet.run(start + 5)
    assert fleet.share("b", start + 1) == pytest.approx(2 / 3, abs=0.05)


def test_round_robin_holds_when_scores_are_compared():
    """Equal scores (weights 2, no answers yet) still go round robin, worker by worker."""
    ws = [make_worker(n) for n in "abcd"]
    for w in ws:
        w.weight = 2
    selector = latency_selector(ws)
    assert [selector.select((), NOW).id for _ in range(8)] == list("abcdabcd")


def test_a_worker_added_to_a_running_pool_is_seeded_and_ramped_in():
    """A new worker starts from its tier's median estimate (not 0, not unknown) and a
    slow start that ends one window later; workers there from the start are not ramped."""
    ws = [make_worker(n) for n in "abc"]
    selector = latency_selector(ws, slow_start=SlowStart(window=10.0))
    now = CLOCK.monotonic()
    assert all(selector.slow_start_until(w, now) is None for w in ws)
    for w, rtt in zip(ws, (0.01, 0.03, 0.3), strict=True):
        selector.observe(w, rtt, now)
    d = make_worker("d")
    selector.set_workers([*ws, d], now)
    d_latency = selector.state_of(d).latency
    assert d_latency.value(now) == pytest.approx(0.03) and not d_latency.observed
    assert selector.slow_start_until(d, now) == now + 10.0
    assert selector.stats(now)["ramping"] == {"d": 10.0}
    assert selector.slow_start_until(d, now + 10.0) is None


def test_a_recovered_worker_forgets_its_timeouts_and_ramps_up():
    """Back from a breaker trip, a worker whose estimate is a 20 s timeout is seeded
    with its tier's median and gets a growing share over the slow start window."""
    ws = [make_worker(n, capacity=64) for n in "abc"]
    selector = latency_selector(ws, slow_start=SlowStart(window=10.0))
    fleet = Fleet(selector, {"a": 0.02, "b": 0.02, "c": 0.02}, callers=32)
    start = fleet.clock.monotonic()
    fleet.run(start + 2)
    selector.state_of(ws[2]).latency.observe(20.0, start + 2, ok=False)
    back = fleet.clock.monotonic()
    selector.recovered(ws[2], back)
    assert selector.state_of(ws[2]).latency.value(back) == pytest.approx(0.02)
    fleet.run(back + 12)
    shares = [fleet.share("c", back + t, back + t + 2) for t in (0, 4, 8, 10)]
    assert shares[0] < 0.1
    assert shares[0] < shares[1] < shares[2]
    assert shares[3] == pytest.approx(1 / 3, abs=0.03)


def test_slow_start_ramps_the_share_with_latency_off_too():
    """Least connections with a ramp: the recovered worker's in-flight share grows."""
    ws = [make_worker(n, capacity=64) for n in "abc"]
    selector = Selector(ws, slow_start=SlowStart(window=10.0), now=CLOCK.monotonic())
    fleet = Fleet(selector, {"a": 0.02, "b": 0.02, "c": 0.02}, callers=32)
    start = fleet.clock.monotonic()
    fleet.run(start + 1)
    selector.recovered(ws[2], fleet.clock.monotonic())
    back = fleet.clock.monotonic()
    fleet.run(back + 12)
    first, later = fleet.share("c", back, back + 2), fleet.share("c", back + 10, back + 12)
    assert first < 0.12 and later == pytest.approx(1 / 3, abs=0.03)


def test_scores_stay_finite_however_long_the_pool_runs():
    """A day of decays later (the keys' epoch moved), choice still follows the estimates."""
    a, b = make_worker("a", capacity=64), make_worker("b", capacity=64)
    selector = latency_selector([a, b])
    now = CLOCK.monotonic()
    for day in range(1, 4):
        later = now + day * 86400.0
        selector.observe(a, 0.5, later)
        selector.observe(b, 0.05, later)
        assert selector.select((), later) is b
        selector.observe(b, 0.05, later + 30)
        assert selector.select((), later + 30) is a  # idle, 0.5 s decayed past 0.05 s
        assert math.isfinite(selector.state_of(a).score) and math.isfinite(
            selector.state_of(b).score
        )


def test_configure_turns_latency_awareness_off_and_on():
    """With latency-aware choice off, a slow worker is just another worker again."""
    a, b = make_worker("a"), make_worker("b")
    selector = latency_selector([a, b])
    now = CLOCK.monotonic()
    selector.observe(a, 0.5, now)
    selector.observe(b, 0.05, now)
    assert {selector.select((), now).id for _ in range(4)} == {"b"}
    selector.configure(latency_aware=False, decay=10.0, slow_start=None, now=now)
    assert {selector.select((), now).id for _ in range(4)} == {"a", "b"}
    selector.configure(latency_aware=True, decay=10.0, slow_start=None, now=now)
    assert {selector.select((), now).id for _ in range(4)} == {"b"}


def test_large_tier_sampling_compares_scores():
    """Power of two choices above 64 workers prefers the faster of the two sampled."""
    ws = [make_worker(f"w{i}", capacity=100, port=30000 + i) for i in range(P2C_THRESHOLD * 2)]
    selector = latency_selector(ws, rng=random.Random(3))
    now = CLOCK.monotonic()
    for i, w in enumerate(ws):
        selector.observe(w, 0.2 if i % 2 else 0.02, now)
    slow = sum(int(selector.select((), now).id[1:]) % 2 for _ in range(2000))
    # Uniform choice would pick a slow one half the time; the better of two, a quarter.
    assert slow / 2000 < 0.3


def test_a_workers_balancing_view_is_json_ready():
    """balancing_of() names weight, share, latency, slow start and limit."""
    worker = make_worker("a", capacity=16)
    worker.set_limit(HillClimbingLimit(16, initial=4))
    view = Selector([worker]).balancing_of(worker, 0.0)
    assert view["weight"] == 1 and view["slow_start_until"] is None
    assert view["limit"]["limit"] == 4
    assert set(view["latency"]) == {"estimate_ms", "observed", "observations"}


def test_the_strategy_is_built_once_per_configuration_not_per_selection():
    """select() is the configured strategy's own: the same object across selections,
    a new one (of the new kind) after configure()."""
    ws = [make_worker(n) for n in "ab"]
    selector = Selector(ws, strategy="round-robin", now=NOW)
    strategy = selector.select.__self__  # type: ignore[attr-defined]
    for _ in range(3):
        selector.select((), NOW)
    assert selector.select.__self__ is strategy  # type: ignore[attr-defined]
    assert type(strategy).__name__ == "RoundRobin" and selector.strategy == "round-robin"
    selector.configure(
        latency_aware=False, decay=10.0, slow_start=None, now=NOW, strategy="weighted"
    )
    assert type(selector.select.__self__).__name__ == "Weighted"  # type: ignore[attr-defined]
    assert selector.stats(NOW)["strategy"] == "weighted"


def test_a_bad_strategy_is_refused_naming_the_value_and_the_choices():
    """An unknown strategy raises at once, naming what was given and what is allowed."""
    with pytest.raises(ValueError, match=r"strategy must be one of least-loaded.*'fastest'"):
        Selector([make_worker("a")], strategy="fastest")
    selector = Selector([make_worker("a")])
    with pytest.raises(ValueError, match="'fastest'"):
        selector.configure(
            latency_aware=False, decay=10.0, slow_start=None, now=NOW, strategy="fastest"
        )
    assert selector.strategy == "least-loaded"


def test_the_balancing_state_is_the_selectors_not_the_workers():
    """A Worker carries no balancing slot of the selector's any more: share, estimate,
    ramp and score are read through the selector."""
    worker = make_worker("a")
    for name in ("latency", "share", "score", "ramp_until", "busy_since", "stall_after", "wrr"):
        assert not hasattr(worker, name), name
    selector = Selector([worker], latency_aware=True, now=NOW)
    selector.observe(worker, 0.05, NOW)
    assert selector.state_of(worker).latency.value(NOW) == pytest.approx(0.05)
    assert selector.share_of(worker) == 1.0
    share, cost, _stamp, _decay, observed, _ramp = selector.captured(worker)
    assert (share, cost, observed) == (1.0, pytest.approx(0.05), True)


def test_a_worker_keeps_what_was_learnt_when_the_candidate_set_is_replaced():
    """set_workers() with the same worker keeps its slot: its estimate is not lost."""
    a, b = make_worker("a"), make_worker("b")
    selector = Selector([a, b], latency_aware=True, now=NOW)
    selector.observe(a, 0.3, NOW)
    slot = selector.state_of(a)
    selector.set_workers([a], NOW)
    assert selector.state_of(a) is slot and slot.latency.value(NOW) == pytest.approx(0.3)


def test_a_draining_worker_still_learns_from_its_last_answers_then_is_forgotten():
    """A worker removed with a task in flight keeps its state for its row while it
    drains; once it has nothing in flight, the next change of candidates drops it."""
    a, b = make_worker("a"), make_worker("b")
    selector = Selector([a, b], latency_aware=True, now=NOW)
    selector.observe(b, 0.02, NOW)
    b.in_flight = 1
    selector.set_workers([a], NOW)
    selector.observe(b, 0.4, NOW + 1)
    assert selector.captured(b)[1] == pytest.approx(0.4)
    assert b not in selector.workers and selector.select((), NOW + 1) is a
    b.in_flight = 0
    selector.set_workers([a], NOW + 2)
    assert not selector.state_of(b).latency.observed  # a fresh view: nothing kept
    selector.observe(b, 0.5, NOW + 3)  # a late answer of a forgotten worker is ignored
    assert not selector.state_of(b).latency.observed


_STRATEGIES = (
    "least-loaded",
    "round-robin",
    "weighted",
    "weighted-random",
    "priority",
    "priority-failover",
)


@pytest.mark.parametrize(("seed", "size"), [*((s, 6) for s in range(12)), (12, 90), (13, 90)])
def test_selection_is_sound_and_complete_after_any_sequence_of_changes(seed, size):
    """Random sequences through the dispatcher, as the pool drives it: leases and their
    answers (failures trip breakers), time passing (trials due, cool-downs over),
    workers disabled, unhealthy, cooling down or given a learned limit and back,
    strategy and latency settings reloaded, the candidate set replaced, recoveries.
    After each step: a lease goes to a candidate not excluded, eligible, within its
    capacity; no lease means no such worker exists (priority-failover: the first live
    worker, when it has room); the selector holds a slot for exactly the candidates and
    keeps a removed worker's only while it has tasks in flight."""
    from npu_sync._balancing.limits import AimdLimit
    from npu_sync._outage import down_reason
    from tests.balancing.kit import make_worker as kit_worker

    rng = random.Random(seed)
    clock = FakeClock()
    workers = [
        kit_worker(
            f"w{i}",
            priority=rng.choice((1, 1, 2)),
            capacity=rng.choice((1, 2, 3)),
            weight=rng.choice((1, 2)),
            clock=clock,
        )
        for i in range(size)
    ]

    def learned(worker: Worker) -> AimdLimit:
        return AimdLimit(
            worker.config.max_concurrent,
            initial=rng.randint(1, 3),
            clock=clock.monotonic,
            min_samples=1,
            min_time=0.0,
        )

    selector = Selector(
        workers,
        rng=random.Random(seed),
        latency_aware=rng.random() < 0.5,
        slow_start=SlowStart(window=rng.choice((0.0, 5.0))),
        now=clock.monotonic(),
        strategy=rng.choice(_STRATEGIES),
    )
    dispatcher = Dispatcher(clock, selector)
    leases: list[Any] = []
    for step in range(400):
        now = clock.monotonic()
        roll = rng.random()
        if roll < 0.35:
            excluded = {w.id for w in workers if rng.random() < 0.2}
            live = [
                w for w in selector.workers if w.id not in excluded and down_reason(w, now) is None
            ]
            first_live = live[0] if live and live[0].eligible(now) else None
            open_to = [w for w in selector.workers if w.id not in excluded and w.eligible(now)]
            lease = dispatcher.try_acquire(excluded)
            chosen = None if lease is None else lease.worker
            if selector.strategy == "priority-failover":
                assert chosen is first_live, step
            elif chosen is None:
                assert open_to == [], step
            if chosen is not None:
                assert chosen in open_to, step
                assert chosen.in_flight <= chosen.capacity, step
                leases.append(lease)
        elif roll < 0.6 and leases:
            lease = leases.pop(rng.randrange(len(leases)))
            worker = lease.worker
            ok = rng.random() < 0.8
            rtt = rng.choice((0.01, 0.05, 0.5))
            with dispatcher.lock:
                worker.in_flight -= 1
                selector.observe(worker, rtt, now, ok)
                if ok:
                    worker.breaker.record_success(lease.trial)
                else:
                    worker.breaker.record_failure(lease.trial)
                worker.sample_limit(rtt, lease.in_flight, not ok)
                dispatcher.release_worker_locked(worker, now)
        elif roll < 0.7:
            clock.advance(rng.choice((0.01, 0.5, 5.0, 61.0)))
        elif roll < 0.88:
            with dispatcher.lock:
                worker = rng.choice(workers)
                if roll < 0.73:
                    worker.enabled = not worker.enabled
                elif roll < 0.76:
                    worker.healthy = not worker.healthy
                elif roll < 0.79:
                    worker.cooldown_until = now + rng.choice((0.0, 1.0, 10.0))
                elif roll < 0.82:
                    worker.set_limit(learned(worker) if rng.random() < 0.7 else None)
                elif roll < 0.85:
                    selector.recovered(worker, now)
                else:
                    selector.configure(
                        latency_aware=rng.random() < 0.5,
                        decay=10.0,
                        slow_start=SlowStart(window=rng.choice((0.0, 5.0))),
                        now=now,
                        strategy=rng.choice(_STRATEGIES),
                    )
                dispatcher.release_locked(now)
        else:
            members = [w for w in workers if rng.random() < 0.7] or [workers[0]]
            dispatcher.set_workers(members)
            assert set(selector._index.slots) == set(members)
            assert all(w not in members and w.in_flight for w in selector._retired)
