"""Unit tests of the adaptive concurrency limit, and of a worker's capacity under one."""

from __future__ import annotations

import heapq
import json
import random
from collections.abc import Callable
from typing import Any

import pytest

from npu_sync._balancing.limits import HillClimbingLimit, square_root_headroom
from npu_sync._breaker import WorkerBreaker
from npu_sync._worker import Worker
from npu_sync.config import BreakerConfig, worker_config
from npu_sync.testing import FakeClock
from tests.stubs import NoTransport


class Fixed:
    """A fixed limit, for comparison."""

    def __init__(self, current: int) -> None:
        self.current = current

    def on_sample(self, rtt: float, in_flight: int, dropped: bool) -> int:
        return self.current


def run(
    limit: HillClimbingLimit | Fixed,
    slots: int,
    base: float,
    answers: int,
    seed: int = 1,
    gap: float = 0.0,
    watch: Callable[[Any], None] | None = None,
    hold: bool = False,
) -> float:
    """Feed ``limit`` the answers of a worker with ``slots`` parallel slots, each task
    taking ``base`` seconds (±5 %), kept full by more callers than the limit: every
    task is sent at the limit and waits for a slot inside the worker. With ``gap``,
    a task reaches the worker a random time after it is sent (exponential, mean
    ``gap``), as a real pool's tasks do after a slot frees (answer, parse, wake a
    caller, send). ``watch`` sees the limit after each answer; with ``hold``, answers
    go on until the limit holds (not in the middle of a probe). Returns the worker's
    throughput over the second half of the answers, in tasks a second."""
    rng = random.Random(seed)
    now = 0.0
    free_at = [0.0] * slots  # when each slot is next free
    in_flight: list[tuple[float, float, int]] = []  # (ends, started, in flight at start)
    for _ in range(limit.current):
        heapq.heappush(in_flight, _start(now, free_at, base, rng, limit.current, gap))
    half = 0.0
    i = 0
    while i < answers or (hold and isinstance(limit, HillClimbingLimit) and not held(limit)):
        ends, started, level = heapq.heappop(in_flight)
        now = ends
        if i == answers // 2:
            half = now
        limit.on_sample(ends - started, level, False)
        if watch is not None:
            watch(limit)
        while len(in_flight) < limit.current:
            heapq.heappush(in_flight, _start(now, free_at, base, rng, len(in_flight) + 1, gap))
        i += 1
    return (i - answers // 2) / (now - half)


def held(limit: HillClimbingLimit) -> bool:
    """Whether ``limit`` holds, between probes."""
    return limit.stats()["mode"] == "hold"


def _start(
    now: float, free_at: list[float], base: float, rng: random.Random, level: int, gap: float
) -> tuple[float, float, int]:
    slot = min(range(len(free_at)), key=free_at.__getitem__)
    arrives = now + (rng.expovariate(1 / gap) if gap else 0.0)
    begins = max(arrives, free_at[slot])
    free_at[slot] = begins + base * rng.uniform(0.95, 1.05)
    return (free_at[slot], now, level)


def modes(seen: list[tuple[str, int]]) -> Callable[[HillClimbingLimit], None]:
    """A ``watch`` that notes each answer's mode and headroom in ``seen``."""
    return lambda limit: seen.append((str(limit.stats()["mode"]), limit.current - limit.limit))


def settled(limit: HillClimbingLimit) -> int:
    """What a limit holding at its knee exposes: the knee plus its headroom, capped."""
    return min(limit.ceiling, limit.limit + square_root_headroom(limit.limit))


@pytest.mark.parametrize(("slots", "initial"), [(8, 4), (8, 30), (2, 4), (1, 4), (24, 1)])
def test_the_limit_settles_at_the_workers_parallelism(slots, initial):
    """From above or below, the knee is where throughput stops growing: the worker's
    parallel slots (or one more, while it probes); the limit adds the headroom."""
    limit = HillClimbingLimit(64, initial=initial)
    run(limit, slots, 0.02, 20000)
    stats = limit.stats()
    assert slots <= stats["knee"] <= slots + 1
    assert stats["headroom"] == square_root_headroom(limit.limit)
    assert limit.current == settled(limit) > limit.limit


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
    """A worker whose parallelism halves (throughput falls at the held knee) gets a
    lower knee: probes go down, without headroom, once throughput fell by a tenth."""
    limit = HillClimbingLimit(64, initial=4)
    run(limit, 16, 0.02, 10000)
    assert 16 <= limit.limit <= 17
    seen: list[tuple[str, int]] = []
    run(
        limit,
        8,
        0.02,
        20000,
        seed=2,
        watch=modes(seen),
    )
    assert 8 <= limit.limit <= 9 and limit.current == settled(limit)
    downs = [headroom for mode, headroom in seen if mode == "down"]
    assert downs and set(downs) == {0}


def test_the_headroom_keeps_a_worker_busy_when_tasks_take_time_to_reach_it():
    """With a gap between a freed slot and the next task's arrival, the settled
    limit's throughput matches a fixed limit well past the knee; the knee alone's
    falls short."""
    for seed in (1, 2, 3):
        best = run(Fixed(16), 8, 0.02, 10000, seed=seed, gap=0.002)
        padded = run(HillClimbingLimit(32), 8, 0.02, 10000, seed=seed, gap=0.002)
        bare = run(
            HillClimbingLimit(32, headroom=lambda knee: 0), 8, 0.02, 10000, seed=seed, gap=0.002
        )
        assert padded >= 0.99 * best
        assert bare < 0.98 * best


def test_climbing_rounds_measure_the_knee_without_headroom():
    """While it climbs (or descends from a high start) the limit is the knee itself;
    the headroom comes once it holds."""
    for initial in (4, 30):
        limit = HillClimbingLimit(64, initial=initial)
        seen: list[tuple[str, int]] = []
        run(limit, 8, 0.02, 3000, watch=modes(seen))
        first_hold = next(i for i, (mode, _) in enumerate(seen) if mode == "hold")
        assert first_hold > 0 and {headroom for _, headroom in seen[:first_hold]} == {0}
        assert {headroom for mode, headroom in seen if mode == "hold"} == {3}


def test_one_slow_round_does_not_make_a_held_limit_probe_down():
    """A fall is judged on a whole hold period against the settled throughput: one
    round a quarter slower (noise on a busy machine) keeps the knee; a period a fifth
    slower (the worker lost capacity) sends it down, without headroom."""
    limit = HillClimbingLimit(4, initial=4, min_round=16)  # at the ceiling: no probes up

    def feed(answers: int, rtt: float) -> None:
        for _ in range(answers):
            limit.on_sample(rtt, limit.current, False)

    feed(4 + 16, 0.02)  # the turnover skipped after a move, then the first round
    assert limit.stats()["mode"] == "down" and limit.current == 3  # no room to climb
    feed(4 + 16, 0.02)  # 3 in flight lose a quarter: the knee is 4, a step down lost
    assert limit.stats()["mode"] == "hold" and limit.current == 4
    feed(4 + 64, 0.02)  # a period of four rounds: the settled throughput
    feed(4 + 48, 0.02)
    feed(16, 0.02 / 0.75)  # its last round a quarter slower
    assert limit.stats()["mode"] == "hold" and limit.limit == 4
    feed(4 + 64, 0.02 / 0.8)
    assert limit.stats()["mode"] == "down" and limit.current == limit.limit == 3


def test_the_settled_limit_is_capped_at_the_ceiling():
    """A knee just under the ceiling gets only the headroom the ceiling leaves."""
    limit = HillClimbingLimit(10, initial=8)
    run(limit, 8, 0.02, 5000)
    assert 8 <= limit.limit <= 9 and limit.current == 10
    assert limit.stats()["headroom"] == 10 - limit.limit


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


def test_a_drop_cuts_a_settled_limit_headroom_and_all():
    """A drop while settled cuts what the worker was given (knee plus headroom) by a
    tenth at once: it holds at the lowest knee whose headroom reaches the cut."""
    limit = HillClimbingLimit(64, initial=4)
    run(limit, 16, 0.02, 10000, hold=True)
    before, knee = limit.current, limit.limit
    assert before == settled(limit) > knee
    after = limit.on_sample(0.5, before, True)
    cut = int(before * 0.9)
    assert after == limit.current == cut and settled(limit) >= cut
    assert limit.limit - 1 + square_root_headroom(limit.limit - 1) < cut
    assert limit.stats()["headroom"] > 0 and limit.stats()["mode"] == "hold"


def test_the_limit_stays_within_one_and_the_ceiling():
    """The initial value is clamped, and climbing stops at the ceiling."""
    assert HillClimbingLimit(3, initial=10).current == 3
    assert HillClimbingLimit(3, initial=0).current == 1
    limit = HillClimbingLimit(6, initial=1)
    run(limit, 1000, 0.02, 3000)
    assert limit.current == 6


def test_reset_starts_again_from_the_initial_limit():
    """A worker back in service: the limit starts over without headroom, counters stay."""
    limit = HillClimbingLimit(64, initial=4)
    run(limit, 16, 0.02, 10000)
    assert limit.current > limit.limit
    samples = limit.samples
    limit.reset()
    assert limit.current == 4 and limit.stats()["mode"] == "start"
    assert limit.stats()["knee"] == 4 and limit.stats()["headroom"] == 0
    assert limit.samples == samples


def test_stats_name_the_limit_its_knee_its_mode_and_the_measured_throughput():
    """stats() is JSON-serialisable and says what the limit is doing: the limit in
    force, the knee under it and the headroom between them."""
    limit = HillClimbingLimit(64, initial=8)
    run(limit, 8, 0.02, 5000)
    stats = limit.stats()
    assert json.loads(json.dumps(stats)) == stats
    assert stats["limit"] == limit.current and stats["ceiling"] == 64
    assert stats["knee"] == limit.limit
    assert stats["headroom"] == limit.current - limit.limit
    assert stats["mode"] in {"up", "down", "hold"}
    assert stats["throughput"] == pytest.approx(8 / 0.02, rel=0.05)


def test_the_square_root_headroom():
    """ceil(sqrt(knee)): one for a knee of one, three for eight, eight for 64."""
    assert [square_root_headroom(k) for k in (0, 1, 2, 4, 5, 8, 9, 10, 64)] == [
        0,
        1,
        2,
        2,
        3,
        3,
        3,
        4,
        8,
    ]


@pytest.mark.parametrize(
    "kwargs", [{"ceiling": 0}, {"ceiling": 4, "backoff": 1.0}, {"ceiling": 4, "min_round": 0}]
)
def test_bad_settings_are_refused(kwargs):
    """A ceiling below 1, a backoff that does not cut, or an empty round raise."""
    with pytest.raises(ValueError):
        HillClimbingLimit(**kwargs)


# -- a worker under a limit ------------------------------------------------------------


def make_worker(max_concurrent: int = 16) -> Worker:
    cfg = worker_config("a", "http://127.0.0.1:9000", max_concurrent=max_concurrent)
    breaker = WorkerBreaker("a", BreakerConfig(), clock=FakeClock())
    return Worker(cfg, NoTransport(), breaker, NoTransport())


def test_a_workers_capacity_follows_its_limit_under_max_concurrent():
    """With a limit the capacity is the limit's value, max_concurrent its ceiling, and
    the worker's own hint still caps both."""
    worker = make_worker(max_concurrent=16)
    assert worker.capacity == 16
    worker.set_limit(HillClimbingLimit(16, initial=4))
    assert worker.capacity == 4
    changed = [worker.sample_limit(0.02, 4, False) for _ in range(4 + 16)]
    assert changed[-1] and not any(changed[:-1]) and worker.capacity == 5  # a step up
    worker.health.hinted_capacity = 2
    worker.sample_limit(0.02, 5, False)
    assert worker.capacity == 2
    worker.health.hinted_capacity = None
    worker.set_limit(None)
    assert worker.capacity == 16


@pytest.mark.parametrize("name", ["hill-climbing", "aimd", "gradient2"])
@pytest.mark.parametrize("seed", range(8))
def test_every_limit_keeps_its_contract_whatever_a_hostile_worker_answers(name, seed):
    """Answers whose latency swings tenfold, bursts of 429/503, meaningless durations
    (0, negative, NaN, infinite, a day), in-flight counts above the limit, and reloads
    that move the ceiling or reset the limit in between: after every call the limit is
    an int in [1, ceiling], on_sample returns it, and stats() is JSON without NaN or
    infinity and names the limit in force."""
    from npu_sync._balancing.limits import new_limit

    rng = random.Random(seed)
    clock = FakeClock()
    ceiling = rng.choice((1, 2, 4, 16, 64))
    limit = new_limit(name, ceiling, clock.monotonic)
    assert limit is not None
    base = rng.choice((0.001, 0.05, 2.0))
    for step in range(2000):
        roll = rng.random()
        if roll < 0.01:
            ceiling = rng.choice((1, 2, 4, 16, 64))
            limit.set_ceiling(ceiling)
        elif roll < 0.015:
            limit.reset()
        else:
            phase = (step // 200) % 3  # steady, ten times slower, refusing in bursts
            rtt = base * (1 + rng.random()) * (10 if phase == 1 else 1)
            if rng.random() < 0.02:
                rtt = rng.choice((0.0, -1.0, float("nan"), float("inf"), 1e-12, 86400.0))
            in_flight = rng.randint(0, 2 * ceiling + 2)
            dropped = rng.random() < (0.4 if phase == 2 else 0.02)
            assert limit.on_sample(rtt, in_flight, dropped) == limit.current
            clock.advance(rtt if 0 < rtt < 10 else 0.01)
        current = limit.current
        assert isinstance(current, int) and 1 <= current <= limit.ceiling == ceiling, step
        stats = limit.stats()
        json.dumps(stats, allow_nan=False)
        assert stats["limit"] == current and stats["ceiling"] == ceiling
