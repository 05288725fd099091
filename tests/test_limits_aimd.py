"""Unit tests of the AIMD limit, against synthetic answers and a simulated worker on the
simulation's clock: growth per window, the cut on a drop, and the attacks the hill
climbing's tests make where they apply (a stall, bursty drops, an RTT that doubles,
oscillating capacity)."""

from __future__ import annotations

import json
import math

import pytest

from npu_sync._balancing.limits import AimdLimit
from tests.limitsim import Fixed, Sim, within_bounds


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def windows(limit: AimdLimit, clock: Clock, count: int, *, rtt: float = 0.02, in_flight=None):
    """Feed ``count`` windows of 10 answers 11.5 ms apart (the tenth 0.1035 s after the
    first), every one sent with ``in_flight`` (by default the limit in force) in flight."""
    for _ in range(count):
        for _ in range(10):
            limit.on_sample(rtt, limit.current if in_flight is None else in_flight, False)
            clock.now += 0.0115


def test_one_more_per_window_without_drops_up_to_the_ceiling():
    """Each window in use and without a drop adds one; the ceiling stops it."""
    clock = Clock()
    limit = AimdLimit(10, initial=4, clock=clock)
    seen = []
    for _ in range(8):
        windows(limit, clock, 1)
        seen.append(limit.current)
    assert seen == [5, 6, 7, 8, 9, 10, 10, 10]
    assert limit.stats()["mode"] == "hold"


def test_a_drop_cuts_a_tenth_at_once_and_never_below_one():
    """A 429 cuts 30 to 27 on the spot; at least one task a cut; down to 1 at the least."""
    clock = Clock()
    limit = AimdLimit(64, initial=30, clock=clock)
    assert limit.on_sample(0.5, 30, True) == 27
    clock.now += 0.2
    windows(limit, clock, 1)  # closes the window with the drop: no growth
    assert limit.current == 27 and limit.stats()["mode"] == "down"
    small = AimdLimit(64, initial=5, clock=clock)
    assert small.on_sample(0.5, 5, True) == 4  # int(5 * 0.9) is 4: one off
    for _ in range(100):
        clock.now += 1.0
        windows(small, clock, 1)
        small.on_sample(0.5, 1, True)
    assert small.current == 1 and small.drops == 101


def test_a_burst_of_drops_in_one_window_cuts_once():
    """Every task in flight refused at once is the answer to one level: one cut, not
    twenty compounded (20 would end at 2)."""
    clock = Clock()
    limit = AimdLimit(64, initial=20, clock=clock)
    for _ in range(20):
        limit.on_sample(0.001, 20, True)
    assert limit.current == 18 and limit.drops == 20
    clock.now += 1.0
    windows(limit, clock, 1)
    limit.on_sample(0.001, 18, True)  # the next window's first drop cuts again
    assert limit.current == 16
    limit.on_sample(0.001, 40, True)  # sent before the cuts: counted, nothing cut
    assert limit.current == 16 and limit.drops == 22


def test_an_app_limited_worker_does_not_grow_the_limit():
    """Windows in which fewer than half the limit were in flight hold it."""
    clock = Clock()
    limit = AimdLimit(64, initial=16, clock=clock)
    windows(limit, clock, 20, in_flight=7)
    assert limit.current == 16 and limit.stats()["mode"] == "hold"
    windows(limit, clock, 1, in_flight=8)
    assert limit.current == 17


def test_a_latency_rise_holds_the_limit_without_cutting_it():
    """A window whose mean RTT is past 1.5 times the baseline grows nothing and cuts
    nothing; the baseline follows a lasting rise, and growth comes back."""
    clock = Clock()
    limit = AimdLimit(64, initial=8, clock=clock)
    windows(limit, clock, 5, rtt=0.02)
    assert limit.current == 13
    modes = []
    for _ in range(60):
        windows(limit, clock, 1, rtt=0.04)
        modes.append(limit.stats()["mode"])
    assert modes[:5] == ["hold"] * 5  # the RTT doubled: held, not cut
    assert "up" in modes[5:]  # the worker is slower for good: it grows again
    assert limit.stats()["baseline_rtt"] > 0.03


def test_a_stalled_worker_neither_grows_nor_collapses_the_limit():
    """A worker that answers nothing for 30 s, then answers with the stall in its RTTs:
    the window over the stall is a latency rise (held); with timeouts (drops), one cut
    a window, not one per task."""
    clock = Clock()
    limit = AimdLimit(64, initial=16, clock=clock)
    windows(limit, clock, 3)
    before = limit.current
    clock.now += 30.0
    windows(limit, clock, 10, rtt=30.0)  # a second of answers, each 30 s long
    assert limit.current == before and limit.stats()["mode"] == "hold"
    clock.now += 30.0
    for _ in range(before):
        limit.on_sample(30.0, before, True)  # every task in flight timed out at once
    assert limit.current == int(before * 0.9)


def test_a_worker_that_refuses_past_its_room_is_held_near_it():
    """A worker of 8 slots that answers 429 once 12 tasks are in it: the limit saws
    under 13 for good, and the throughput is a fixed limit of 12's."""
    sim = Sim(seed=3)
    limit = AimdLimit(64, clock=sim.clock)
    seen: list[int] = []
    throughput = sim.run(
        limit,
        40000,
        refuse_above=lambda i: 12,
        watch=lambda limit: (within_bounds(limit), seen.append(limit.current)),
    )
    best = Sim(seed=3).run(Fixed(12), 40000)
    assert max(seen[20000:]) <= 13 and min(seen[20000:]) >= 5
    assert throughput >= 0.97 * best


def test_oscillating_capacity_is_followed_both_ways():
    """Room swinging 12 <-> 24 tasks every 5000 answers: the limit goes under each
    room within the swing, and back up when it grows."""
    sim = Sim(seed=4)
    limit = AimdLimit(64, clock=sim.clock)
    for swing in range(6):
        room = 24 if swing % 2 else 12
        seen: list[int] = []
        sim.run(
            limit,
            5000,
            slots=lambda i, room=room: room - 4,
            refuse_above=lambda i, room=room: room,
            watch=lambda limit, seen=seen: (within_bounds(limit), seen.append(limit.current)),
        )
        assert max(seen[-1000:]) <= room + 1
        if room == 24:
            assert max(seen) >= 20


def test_a_worker_that_never_drops_is_taken_to_the_ceiling():
    """The documented weakness: against a worker that queues rather than refuse, AIMD
    ends at max_concurrent (the hill climbing's case)."""
    sim = Sim(seed=5)
    limit = AimdLimit(32, clock=sim.clock)
    sim.run(limit, 40000)
    assert limit.current == 32


def test_timeouts_count_as_drops():
    """With ``timeout``, an answer slower than it cuts like a 429."""
    clock = Clock()
    limit = AimdLimit(64, initial=20, timeout=1.0, clock=clock)
    assert limit.on_sample(1.5, 20, False) == 18
    assert limit.drops == 1 and limit.samples == 0


@pytest.mark.parametrize(
    ("rtt", "in_flight"), [(0.0, 8), (-0.02, 8), (math.nan, 8), (math.inf, 8), (0.02, 0)]
)
def test_meaningless_samples_are_ignored(rtt, in_flight):
    """A zero, negative, NaN or infinite duration, or nothing in flight: not counted."""
    clock = Clock()
    limit = AimdLimit(64, initial=8, clock=clock)
    for _ in range(100):
        clock.now += 0.01
        assert limit.on_sample(rtt, in_flight, False) == 8
    assert limit.samples == 0 and limit.stats()["mode"] == "start"


def test_set_ceiling_and_reset():
    """A lower ceiling lowers the limit at once; reset starts again from the initial
    limit within the ceiling, the counters kept."""
    clock = Clock()
    limit = AimdLimit(64, initial=8, clock=clock)
    windows(limit, clock, 10)
    assert limit.current == 18
    limit.set_ceiling(6)
    assert limit.current == 6
    limit.set_ceiling(3)
    limit.reset()
    assert limit.current == 3 and limit.stats()["mode"] == "start"
    limit.set_ceiling(64)
    limit.reset()
    assert limit.current == 8 and limit.samples == 100
    with pytest.raises(ValueError, match="ceiling must be >= 1, got 0"):
        limit.set_ceiling(0)


def test_stats_name_the_algorithm_and_are_json_ready():
    """stats() says aimd, the limit in force, what the last window did and the baseline."""
    clock = Clock()
    limit = AimdLimit(64, clock=clock)
    windows(limit, clock, 2)
    stats = limit.stats()
    assert json.loads(json.dumps(stats)) == stats
    assert stats["algorithm"] == "aimd" and stats["limit"] == limit.current == 6
    assert stats["mode"] == "up" and stats["baseline_rtt"] == pytest.approx(0.02)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"ceiling": 0}, "ceiling must be >= 1, got 0"),
        ({"ceiling": 4, "backoff": 1.0}, "backoff must be in \\(0, 1\\), got 1.0"),
        ({"ceiling": 4, "timeout": 0}, "timeout must be a positive number of seconds, got 0"),
        ({"ceiling": 4, "rtt_tolerance": 1.0}, "rtt_tolerance must be > 1, got 1.0"),
        ({"ceiling": 4, "min_samples": 0}, "min_samples must be >= 1, got 0"),
    ],
)
def test_bad_settings_are_refused_naming_them(kwargs, named):
    """Each setting out of range raises naming it and its value."""
    with pytest.raises(ValueError, match=named):
        AimdLimit(**kwargs)
