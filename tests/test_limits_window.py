"""Unit tests of the measurement windows: what a window adds up, and when it closes."""

from __future__ import annotations

import math

import pytest

from npu_sync._balancing.limits import RoundWindow, SampleWindow, TimedWindow, WindowSummary


class Clock:
    """Seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_sample_window_adds_up_answers_and_drops():
    """Counts, sums, the smallest RTT, the most in flight and the drops; Little's law
    gives the throughput."""
    window = SampleWindow()
    for rtt, in_flight in ((0.02, 4), (0.04, 8), (0.03, 6)):
        window.add(rtt, in_flight)
    window.drop()
    summary = window.summary()
    assert summary == WindowSummary(3, 18, pytest.approx(0.09), 0.02, 8, 1)
    assert summary.throughput == pytest.approx(18 / 0.09)
    assert summary.mean_rtt == pytest.approx(0.03)
    window.clear()
    empty = window.summary()
    assert (empty.samples, empty.drops, empty.throughput, empty.mean_rtt) == (0, 0, 0.0, math.inf)


def test_a_round_closes_at_the_size_asked_after_the_skipped_turnover():
    """Skipped answers are not counted; the round closes on the answer that makes it
    ``needed`` long, and starts afresh."""
    window = RoundWindow()
    window.skip(3)
    closed = [window.offer(1.0, 9, 4) for _ in range(3)]  # the old level's answers
    assert closed == [None, None, None] and window.samples == 0
    summaries = [window.offer(0.5, 2, 4) for _ in range(4)]
    assert summaries[:3] == [None, None, None]
    assert summaries[3] is not None and summaries[3].samples == 4
    assert summaries[3].throughput == pytest.approx(8 / 2.0)
    assert window.samples == 0


def test_a_round_is_judged_against_the_size_given_with_each_answer():
    """The size may change between answers (the limit moved): each answer is judged
    against the size given with it."""
    window = RoundWindow()
    assert window.offer(0.1, 1, 10) is None
    assert window.offer(0.1, 1, 10) is None
    assert window.offer(0.1, 1, 2) is not None


def test_a_timed_window_closes_after_its_time_with_enough_answers():
    """Timed from its first answer: not before ``min_time`` (2 x the smallest RTT being
    shorter), nor with fewer than ``min_samples`` answers; then on the next answer."""
    clock = Clock()
    window = TimedWindow(clock, min_time=0.1, max_time=1.0, min_samples=3)
    clock.now += 50.0  # idle since it was built: not part of the window
    for _ in range(6):
        assert window.offer(0.02, 4, False) is None
        clock.now += 0.017  # the seventh answer comes 0.102 s after the first
    summary = window.offer(0.02, 4, False)
    assert summary is not None and summary.samples == 7 and summary.max_in_flight == 4
    clock.now += 5.0
    assert window.offer(0.02, 4, False) is None  # one answer of three
    clock.now += 0.2
    assert window.offer(0.02, 4, False) is None
    assert window.offer(0.02, 4, False) is not None


def test_a_timed_window_lasts_twice_its_smallest_rtt_within_its_bounds():
    """Slow answers (0.3 s) make a window last 0.6 s, not ``min_time``; very slow ones
    (2 s) are bounded by ``max_time``."""
    clock = Clock()
    window = TimedWindow(clock, min_time=0.1, max_time=1.0, min_samples=1)
    window.min_samples = 2
    assert window.offer(0.3, 1, False) is None
    clock.now += 0.55
    assert window.offer(0.3, 1, False) is None
    clock.now += 0.1
    assert window.offer(0.3, 1, False) is not None
    assert window.offer(2.0, 1, False) is None
    clock.now += 0.9
    assert window.offer(2.0, 1, False) is None
    clock.now += 0.15
    assert window.offer(2.0, 1, False) is not None


def test_a_window_of_drops_alone_closes_after_its_longest_time():
    """Drops are counted apart from the answers and count toward ``min_samples``: a
    worker refusing everything still closes windows, ``max_time`` long (no RTT to size
    them by)."""
    clock = Clock()
    window = TimedWindow(clock, min_time=0.1, max_time=1.0, min_samples=2)
    for _ in range(10):
        assert window.offer(0.001, 4, True) is None
        clock.now += 0.1
    clock.now += 0.05
    summary = window.offer(0.001, 4, True)
    assert summary is not None and summary.drops == 11 and summary.samples == 0
    assert summary.min_rtt == math.inf and window.drops == 0


def test_restart_forgets_the_window_under_way():
    """A window restarted holds nothing, and the next answer starts the next one."""
    clock = Clock()
    window = TimedWindow(clock, min_time=1.0, max_time=1.0, min_samples=1)
    window.offer(0.02, 1, True)
    clock.now += 5.0
    window.restart()
    assert window.drops == 0
    assert window.offer(0.02, 1, False) is None  # a second has not passed since it


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"min_time": -1.0}, "min_time=-1.0"),
        ({"min_time": 2.0, "max_time": 1.0}, "max_time=1.0"),
        ({"max_time": math.inf}, "max_time=inf"),
        ({"min_samples": 0}, "min_samples must be >= 1, got 0"),
    ],
)
def test_bad_window_bounds_are_refused_naming_the_value(kwargs, named):
    """A negative or inverted time bound, an infinite one, or no answers: ValueError."""
    with pytest.raises(ValueError, match=named):
        TimedWindow(Clock(), **kwargs)
