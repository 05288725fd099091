"""Unit tests of the gradient2-style limit: Netflix's formula window by window, and the
attacks the hill climbing's tests make where they apply (a stall, bursty drops, a
worker whose RTT doubles, oscillating capacity), on the simulation's clock."""

from __future__ import annotations

import json
import math

import pytest

from npu_sync._balancing.limits import Gradient2Limit, square_root_headroom
from tests.limitsim import Sim, within_bounds


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def window(limit: Gradient2Limit, clock: Clock, rtt: float, in_flight: int | None = None) -> None:
    """One window of 10 answers 11.5 ms apart, each taking ``rtt``, sent with
    ``in_flight`` (by default the limit in force) in flight."""
    for _ in range(10):
        limit.on_sample(rtt, limit.current if in_flight is None else in_flight, False)
        clock.now += 0.0115


def test_each_window_moves_the_estimate_by_the_gradient2_formula():
    """long = mean of the short RTTs while warming up (5 % off while over twice the
    short one); gradient = clamp(1.5 long / short, 0.5, 1); target = estimate x
    gradient + sqrt-queue; smoothed by 0.2."""
    clock = Clock()
    limit = Gradient2Limit(100, initial=10, clock=clock, max_time=0.1)
    expected, long = 10.0, 0.0
    for n, short in enumerate((0.02, 0.04, 0.08, 0.08, 0.02), start=1):
        window(limit, clock, short)
        long += (short - long) / n
        if long / short > 2:
            long *= 0.95  # the last window: 0.05 against 0.02
        gradient = max(0.5, min(1.0, 1.5 * long / short))
        target = expected * gradient + square_root_headroom(int(expected))
        expected = expected * 0.8 + target * 0.2
        stats = limit.stats()
        assert stats["long_rtt"] == pytest.approx(long)
        assert stats["estimate"] == pytest.approx(expected)
        assert limit.current == int(expected)
    assert limit.stats()["algorithm"] == "gradient2"


def test_without_a_latency_rise_it_grows_to_the_ceiling():
    """A worker with room to spare (80 slots): the limit reaches the ceiling."""
    sim = Sim(seed=1)
    limit = Gradient2Limit(64, clock=sim.clock)
    sim.run(limit, 20000, slots=lambda i: 80, watch=within_bounds)
    assert limit.current == 64


def test_a_worker_whose_rtt_doubles_is_given_less_then_more_again():
    """Task times going from 20 to 40 ms: the short RTT is past 1.5 times the long one,
    so the limit shrinks within a few windows; once the long RTT has caught up the
    limit grows back rather than stay down."""
    sim = Sim(seed=2)
    limit = Gradient2Limit(64, long_window=300, clock=sim.clock)  # catches up sooner
    sim.run(limit, 20000, slots=lambda i: 80)
    assert limit.current == 64
    seen: list[int] = []
    slower = lambda rng, i: 0.04 * rng.uniform(0.95, 1.05)  # noqa: E731
    sim.run(
        limit,
        5000,
        slots=lambda i: 80,
        duration=slower,
        watch=lambda lim: seen.append(lim.current),
    )
    assert min(seen) <= 56
    sim.run(limit, 60000, slots=lambda i: 80, duration=slower, watch=within_bounds)
    assert limit.current == 64


def test_one_stalled_window_cuts_at_most_a_tenth():
    """A window whose answers took 30 s instead of 20 ms: the gradient is held at 0.5
    and smoothed, so the limit loses at most a tenth, not everything at once."""
    clock = Clock()
    limit = Gradient2Limit(64, initial=32, clock=clock)
    for _ in range(20):
        window(limit, clock, 0.02)
    before = limit.stats()["estimate"]
    clock.now += 30.0
    for _ in range(100):  # a second of answers: one window of max_time
        limit.on_sample(30.0, limit.current, False)
        clock.now += 0.0115
    after = limit.stats()["estimate"]
    assert isinstance(before, float) and isinstance(after, float)
    assert 0.89 * before <= after < before


def test_a_long_rtt_far_above_the_short_one_comes_down_faster():
    """Latency back to normal after a long overload: while the long RTT is more than
    twice the short one it loses 5 % a window on top of the average."""
    clock = Clock()
    limit = Gradient2Limit(64, initial=8, long_window=600, clock=clock, max_time=0.1)
    for _ in range(10):
        window(limit, clock, 1.0)  # warm-up at a second
    window(limit, clock, 0.1)
    factor = 2 / 601
    assert limit.stats()["long_rtt"] == pytest.approx((1.0 * (1 - factor) + 0.1 * factor) * 0.95)


def test_a_burst_of_drops_cuts_once_and_drops_of_tasks_above_the_limit_not_at_all():
    """Twenty tasks refused at once cut the estimate by a tenth once; a drop of a task
    sent above the limit in force (before a cut) is counted and cuts nothing."""
    clock = Clock()
    limit = Gradient2Limit(64, initial=20, clock=clock)
    for _ in range(20):
        limit.on_sample(0.001, 20, True)
    assert limit.stats()["estimate"] == pytest.approx(18.0) and limit.drops == 20
    fresh = Gradient2Limit(64, initial=20, clock=clock)
    fresh.on_sample(0.001, 40, True)
    assert fresh.stats()["estimate"] == 20.0 and fresh.drops == 1
    fresh.on_sample(0.001, 20, True)
    assert fresh.stats()["estimate"] == pytest.approx(18.0)


def test_a_window_with_a_drop_does_not_grow_the_estimate():
    """The cut holds for the rest of its window: growing by the queue size at the window's
    end would undo it (10 x 0.9 + 0.2 x 3 = 9.6) every window."""
    clock = Clock()
    limit = Gradient2Limit(64, initial=10, clock=clock, max_time=0.1)
    limit.on_sample(0.001, 10, True)
    window(limit, clock, 0.02)
    stats = limit.stats()
    assert stats["estimate"] == pytest.approx(9.0) and stats["mode"] == "down"
    window(limit, clock, 0.02)  # a window without drops grows again
    assert limit.stats()["estimate"] == pytest.approx(9.0 + 0.2 * square_root_headroom(9))


def test_a_worker_that_refuses_past_its_room_is_held_near_it():
    """A worker of 8 slots that answers 429 once 12 tasks are in it: the limit stays
    near 12 for good, refusing a small share of the tasks."""
    sim = Sim(seed=3)
    limit = Gradient2Limit(64, clock=sim.clock)
    seen: list[int] = []
    sim.run(
        limit,
        40000,
        refuse_above=lambda i: 12,
        watch=lambda lim: (within_bounds(lim), seen.append(lim.current)),
    )
    assert max(seen[len(seen) // 2 :]) <= 13
    assert sim.drops < 0.05 * sim.answers


def test_oscillating_capacity_keeps_the_contract_and_is_followed_down():
    """Slots swinging 8 <-> 16 every 3000 answers, with a worker refusing past slots +
    4: every answer leaves an int in [1, ceiling], and each fall in room brings the
    limit under it (the drops cut it)."""
    sim = Sim(seed=6)
    limit = Gradient2Limit(64, clock=sim.clock)
    for swing in range(6):
        slots = 16 if swing % 2 else 8
        seen: list[int] = []
        sim.run(
            limit,
            3000,
            slots=lambda i, slots=slots: slots,
            refuse_above=lambda i, slots=slots: slots + 4,
            watch=lambda lim, seen=seen: (within_bounds(lim), seen.append(lim.current)),
        )
        assert max(seen[-500:]) <= slots + 5


def test_an_app_limited_worker_holds_the_estimate():
    """Windows with fewer than half the estimate in flight say nothing of more load."""
    clock = Clock()
    limit = Gradient2Limit(64, initial=20, clock=clock)
    for _ in range(20):
        window(limit, clock, 0.02, in_flight=9)
    assert limit.stats()["estimate"] == 20.0 and limit.stats()["mode"] == "hold"


@pytest.mark.parametrize(
    ("rtt", "in_flight"), [(0.0, 8), (-0.02, 8), (math.nan, 8), (math.inf, 8), (0.02, 0)]
)
def test_meaningless_samples_are_ignored(rtt, in_flight):
    """A zero, negative, NaN or infinite duration, or nothing in flight: not counted."""
    clock = Clock()
    limit = Gradient2Limit(64, initial=8, clock=clock)
    for _ in range(100):
        clock.now += 0.01
        assert limit.on_sample(rtt, in_flight, False) == 8
    assert limit.samples == 0 and limit.stats()["long_rtt"] is None


def test_set_ceiling_and_reset():
    """A lower ceiling lowers the limit at once; reset forgets the long RTT."""
    clock = Clock()
    limit = Gradient2Limit(64, initial=8, clock=clock)
    for _ in range(30):
        window(limit, clock, 0.02)
    assert limit.current > 8
    limit.set_ceiling(5)
    assert limit.current == 5
    limit.set_ceiling(64)
    limit.reset()
    stats = limit.stats()
    assert limit.current == 8 and stats["long_rtt"] is None and stats["mode"] == "start"
    assert json.loads(json.dumps(stats)) == stats


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"ceiling": 0}, "ceiling must be >= 1, got 0"),
        ({"ceiling": 4, "smoothing": 0.0}, "smoothing must be in \\(0, 1\\], got 0.0"),
        ({"ceiling": 4, "rtt_tolerance": 0.9}, "rtt_tolerance must be >= 1, got 0.9"),
        ({"ceiling": 4, "long_window": 0}, "long_window must be >= 1, got 0"),
        ({"ceiling": 4, "backoff": 0.0}, "backoff must be in \\(0, 1\\), got 0.0"),
    ],
)
def test_bad_settings_are_refused_naming_them(kwargs, named):
    """Each setting out of range raises naming it and its value."""
    with pytest.raises(ValueError, match=named):
        Gradient2Limit(**kwargs)
