"""Unit tests of the adaptive concurrency limit, and of a worker's capacity under one."""

from __future__ import annotations

import heapq
import random

import pytest

from npu_sync.breaker import WorkerBreaker
from npu_sync.config import BreakerConfig, worker_config
from npu_sync.limits import HillClimbingLimit
from npu_sync.testing import FakeClock
from npu_sync.worker import Worker


def run(limit: HillClimbingLimit, slots: int, base: float, answers: int, seed: int = 1) -> None:
    """Feed ``limit`` the answers of a worker with ``slots`` parallel slots, each task
    taking ``base`` seconds (±5 %), kept full by more callers than the limit: every
    task is sent at the limit and waits for a slot inside the worker."""
    rng = random.Random(seed)
    now = 0.0
    free_at = [0.0] * slots  # when each slot is next free
    in_flight: list[tuple[float, float, int]] = []  # (ends, started, in flight at start)
    for _ in range(limit.current):
        heapq.heappush(in_flight, _start(now, free_at, base, rng, limit.current))
    for _ in range(answers):
        ends, started, level = heapq.heappop(in_flight)
        now = ends
        limit.on_sample(ends - started, level, False)
        while len(in_flight) < limit.current:
            heapq.heappush(in_flight, _start(now, free_at, base, rng, len(in_flight) + 1))


def _start(now: float, free_at: list[float], base: float, rng: random.Random, level: int):
    slot = min(range(len(free_at)), key=free_at.__getitem__)
    begins = max(now, free_at[slot])
    free_at[slot] = begins + base * rng.uniform(0.95, 1.05)
    return (free_at[slot], now, level)


@pytest.mark.parametrize(("slots", "initial"), [(8, 4), (8, 30), (2, 4), (1, 4), (24, 1)])
def test_the_limit_settles_at_the_workers_parallelism(slots, initial):
    """From above or below, the limit finds where throughput stops growing: the
    worker's parallel slots (or one more, while it probes)."""
    limit = HillClimbingLimit(64, initial=initial)
    run(limit, slots, 0.02, 20000)
    assert slots <= limit.current <= slots + 1


def test_without_a_knee_the_limit_climbs_to_the_ceiling():
    """A worker whose throughput keeps growing gets all the ceiling allows."""
    limit = HillClimbingLimit(48, initial=4)
    run(limit, 1000, 0.02, 5000)
    assert limit.current == 48


def test_the_climb_is_fast_while_throughput_scales():
    """Steps of a quarter of the limit: 4 to 64 in a few thousand answers, not 60 rounds."""
    limit = HillClimbingLimit(64, initial=4)
    run(limit, 1000, 0.02, 2500)
    assert limit.current == 64


def test_a_worker_that_loses_slots_is_followed_down():
    """A worker whose parallelism halves (throughput falls at the held limit) gets a
    lower limit: probes go down once throughput fell by a tenth."""
    limit = HillClimbingLimit(64, initial=4)
    run(limit, 16, 0.02, 10000)
    assert 16 <= limit.current <= 17
    run(limit, 8, 0.02, 20000, seed=2)
    assert 8 <= limit.current <= 9


def test_answers_below_the_limit_do_not_move_it():
    """App-limited: a worker never given as many tasks as its limit keeps the limit."""
    limit = HillClimbingLimit(64, initial=8)
    for _ in range(5000):
        limit.on_sample(0.02, 3, False)
    assert limit.current == 8 and limit.samples == 0


def test_a_drop_cuts_the_limit_at_once_and_never_below_one():
    """A 429 or a timeout: 10 % off at once (at least one), down to 1 at the least."""
    limit = HillClimbingLimit(64, initial=30)
    assert limit.on_sample(0.5, 30, True) == 27
    for _ in range(100):
        limit.on_sample(0.5, 1, True)
    assert limit.current == 1 and limit.drops == 101


def test_the_limit_stays_within_one_and_the_ceiling():
    """The initial value is clamped, and climbing stops at the ceiling."""
    assert HillClimbingLimit(3, initial=10).current == 3
    assert HillClimbingLimit(3, initial=0).current == 1
    limit = HillClimbingLimit(6, initial=1)
    run(limit, 1000, 0.02, 3000)
    assert limit.current == 6


def test_reset_starts_again_from_the_initial_limit():
    """A worker back in service: the limit starts over, counters stay."""
    limit = HillClimbingLimit(64, initial=4)
    run(limit, 1000, 0.02, 2500)
    samples = limit.samples
    limit.reset()
    assert limit.current == 4 and limit.stats()["mode"] == "start"
    assert limit.samples == samples


def test_stats_name_the_limit_its_mode_and_the_measured_throughput():
    """stats() is JSON-serialisable and says what the limit is doing."""
    limit = HillClimbingLimit(64, initial=8)
    run(limit, 8, 0.02, 5000)
    stats = limit.stats()
    assert stats["limit"] == limit.current and stats["ceiling"] == 64
    assert stats["mode"] in {"up", "down", "hold"}
    assert stats["throughput"] == pytest.approx(8 / 0.02, rel=0.05)


@pytest.mark.parametrize(
    "kwargs", [{"ceiling": 0}, {"ceiling": 4, "backoff": 1.0}, {"ceiling": 4, "min_round": 0}]
)
def test_bad_settings_are_refused(kwargs):
    """A ceiling below 1, a backoff that does not cut, or an empty round raise."""
    with pytest.raises(ValueError):
        HillClimbingLimit(**kwargs)


# -- a worker under a limit ------------------------------------------------------------


class _NoTransport:
    def request(self, *args, **kwargs):  # pragma: no cover - never sends
        raise AssertionError("no I/O here")

    def close(self) -> None:
        pass


def make_worker(max_concurrent: int = 16) -> Worker:
    cfg = worker_config("a", "http://127.0.0.1:9000", max_concurrent=max_concurrent)
    breaker = WorkerBreaker("a", BreakerConfig(), clock=FakeClock())
    return Worker(cfg, _NoTransport(), breaker, _NoTransport())


def test_a_workers_capacity_follows_its_limit_under_max_concurrent():
    """With a limit the capacity is the limit's value, max_concurrent its ceiling, and
    the worker's own hint still caps both."""
    worker = make_worker(max_concurrent=16)
    assert worker.capacity == 16
    worker.set_limit(HillClimbingLimit(16, initial=4))
    assert worker.capacity == 4
    changed = [worker.sample_limit(0.02, 4, False) for _ in range(4 + 16)]
    assert changed[-1] and not any(changed[:-1]) and worker.capacity == 5  # a step up
    worker.hinted_capacity = 2
    worker.sample_limit(0.02, 5, False)
    assert worker.capacity == 2
    worker.hinted_capacity = None
    worker.set_limit(None)
    assert worker.capacity == 16


def test_a_workers_balancing_view_is_json_ready():
    """balancing() names weight, share, latency, slow start and limit."""
    worker = make_worker()
    worker.set_limit(HillClimbingLimit(16, initial=4))
    view = worker.balancing(0.0)
    assert view["weight"] == 1 and view["slow_start_until"] is None
    assert view["limit"]["limit"] == 4
    assert set(view["latency"]) == {"estimate_ms", "observed", "observations"}
