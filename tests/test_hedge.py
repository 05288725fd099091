"""Unit tests of the hedging policy: when to send a task a second time."""

from __future__ import annotations

import random
import threading

import pytest

from npu_sync._hedge import HedgePolicy


def test_disabled_by_default_and_never_for_tasks_that_are_not_idempotent():
    """Hedging is opt-in, and a task that may not run twice is never hedged."""
    assert HedgePolicy().delay_for(True) is None
    policy = HedgePolicy(enabled=True, delay=0.05)
    assert policy.delay_for(False) is None
    assert policy.delay_for(True) == 0.05


def test_a_percentile_policy_waits_for_enough_samples():
    """No hedge until min_samples durations are known: a guess would hedge at random."""
    policy = HedgePolicy(enabled=True, percentile=0.95, min_samples=20)
    for _ in range(19):
        policy.observe(0.02)
    assert policy.delay_for(True) is None
    policy.observe(0.02)
    assert policy.delay_for(True) == pytest.approx(0.02)


def test_the_delay_is_the_percentile_of_recent_durations():
    """p95 of 1..100 ms is 95 ms, p50 is 50 ms (give or take one rank)."""
    for q, expected in ((0.95, 0.095), (0.5, 0.050)):
        policy = HedgePolicy(enabled=True, percentile=q, min_samples=10, refresh_every=1)
        durations = [i / 1000 for i in range(1, 101)]
        random.Random(2).shuffle(durations)
        for d in durations:
            policy.observe(d)
        assert policy.delay_for(True) == pytest.approx(expected, abs=0.0011)


def test_only_the_window_of_recent_durations_counts():
    """Once a worker fleet got faster, old slow durations leave the window."""
    policy = HedgePolicy(enabled=True, window=100, min_samples=10, refresh_every=1)
    for _ in range(100):
        policy.observe(1.0)
    for _ in range(100):
        policy.observe(0.01)
    assert policy.delay_for(True) == pytest.approx(0.01)


def test_the_percentile_is_recomputed_every_refresh_every_samples():
    """Between refreshes the cached delay is answered; then the new durations count."""
    policy = HedgePolicy(enabled=True, window=64, min_samples=8, refresh_every=8)
    for _ in range(8):
        policy.observe(0.01)
    assert policy.current() == pytest.approx(0.01)
    for _ in range(7):
        policy.observe(0.5)
    assert policy.current() == pytest.approx(0.01)  # cached
    policy.observe(0.5)
    assert policy.current() == pytest.approx(0.5)


def test_counts_of_hedges_sent_won_and_skipped_are_in_the_stats():
    """stats() names the mode, the delay in ms, the samples and the totals."""
    policy = HedgePolicy(enabled=True, percentile=0.9, min_samples=4)
    for _ in range(4):
        policy.observe(0.2)
    policy.count_hedge(won=True)
    policy.count_hedge(won=False)
    policy.count_skipped()
    assert policy.stats() == {
        "enabled": True,
        "mode": "percentile",
        "delay_ms": pytest.approx(200.0),
        "percentile": 0.9,
        "samples": 4,
        "hedged": 2,
        "won": 1,
        "skipped": 1,
    }
    fixed = HedgePolicy(enabled=True, delay=0.03).stats()
    assert fixed["mode"] == "delay" and fixed["delay_ms"] == pytest.approx(30.0)


def test_observing_from_many_threads_loses_no_sample():
    """observe() is thread-safe: 8 threads x 100 durations fill a window of 800."""
    policy = HedgePolicy(enabled=True, window=800, min_samples=1)
    start = threading.Barrier(8)

    def feed() -> None:
        start.wait()
        for _ in range(100):
            policy.observe(0.01)

    threads = [threading.Thread(target=feed) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert policy.stats()["samples"] == 800


@pytest.mark.parametrize(
    "kwargs", [{"delay": -1.0}, {"percentile": 1.0}, {"percentile": 0.0}, {"window": 0}]
)
def test_bad_settings_are_refused(kwargs):
    """A negative delay, a percentile outside (0, 1) or an empty window raise."""
    with pytest.raises(ValueError):
        HedgePolicy(**kwargs)
