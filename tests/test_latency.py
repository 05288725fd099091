"""Unit tests of the peak-EWMA latency estimate."""

from __future__ import annotations

import math

import pytest

from npu_sync._latency import MIN_COST, PeakEwma

T = 1000.0


def test_a_slower_answer_replaces_the_estimate_at_once():
    """The peak: one slow answer sets the estimate, however many fast ones came before."""
    est = PeakEwma(10.0, now=T)
    for i in range(100):
        est.observe(0.02, T + i * 0.01)
    est.observe(0.2, T + 1.0)
    assert est.value(T + 1.0) == pytest.approx(0.2)


def test_a_faster_answer_moves_the_estimate_by_the_time_since_the_last():
    """Below the estimate, the weight of a new answer is 1 - exp(-dt / decay)."""
    est = PeakEwma(10.0, now=T)
    est.observe(0.2, T)
    est.observe(0.02, T + 10.0)
    decayed = 0.2 * math.exp(-1.0)
    w = math.exp(-1.0)
    assert est.value(T + 10.0) == pytest.approx(decayed * w + 0.02 * (1 - w))


def test_steady_answers_keep_the_estimate_at_their_latency():
    """Answers of 20 ms every millisecond hold the estimate at 20 ms, not below."""
    est = PeakEwma(10.0, now=T)
    for i in range(2000):
        est.observe(0.02, T + i * 0.001)
    assert est.value(T + 1.999) == pytest.approx(0.02, rel=1e-3)


def test_a_recovered_worker_falls_back_to_its_real_latency_over_the_decay():
    """After one slow answer, fast answers bring the estimate down within a few decays."""
    est = PeakEwma(10.0, now=T)
    est.observe(0.2, T)
    fast = PeakEwma(10.0, now=T)
    fast.observe(0.2, T)
    for i in range(1, 301):
        fast.observe(0.02, T + i * 0.01)  # 3 s of fast answers
    assert fast.value(T + 3.0) > 0.06  # not at once: the decay is 10 s
    for i in range(1, 3001):
        est.observe(0.02, T + i * 0.01)  # 30 s of fast answers
    assert est.value(T + 30.0) < 0.03


def test_an_idle_estimate_decays_toward_zero():
    """With no observation, the estimate decays with time constant ``decay``."""
    est = PeakEwma(10.0, now=T)
    est.observe(0.2, T)
    assert est.value(T + 10.0) == pytest.approx(0.2 * math.exp(-1.0))
    assert est.value(T + 100.0) < 0.0001


def test_a_failure_may_raise_the_estimate_but_never_lower_it():
    """A fast failure (connection refused) leaves the estimate; a slow one raises it."""
    est = PeakEwma(10.0, now=T)
    est.observe(0.1, T)
    est.observe(0.001, T + 0.5, ok=False)
    assert est.value(T + 0.5) == pytest.approx(0.1 * math.exp(-0.05))
    est.observe(2.0, T + 1.0, ok=False)
    assert est.value(T + 1.0) == pytest.approx(2.0)


def test_the_first_observation_replaces_a_seed_whatever_its_value():
    """A seeded estimate is a placeholder: the first answer, even faster, replaces it."""
    est = PeakEwma(10.0, now=T, seed=0.5)
    assert not est.observed
    est.observe(0.01, T + 0.001)
    assert est.observed and est.value(T + 0.001) == pytest.approx(0.01)
    est.seed(0.3, T + 1)
    assert not est.observed and est.value(T + 1) == pytest.approx(0.3)


def test_a_fast_failure_does_not_replace_a_seed():
    """A failure faster than the seed says nothing: the seed stays, still unobserved."""
    est = PeakEwma(10.0, now=T, seed=0.05)
    est.observe(0.001, T, ok=False)
    assert not est.observed and est.value(T) == pytest.approx(0.05)


def test_raise_to_lifts_the_estimate_without_counting_an_observation():
    """What is known without an answer raises the estimate, never lowers it."""
    est = PeakEwma(10.0, now=T)
    est.observe(0.02, T)
    est.raise_to(0.5, T + 0.5)
    assert est.value(T + 0.5) == pytest.approx(0.5) and est.observations == 1
    est.raise_to(0.1, T + 0.6)
    assert est.value(T + 0.6) == pytest.approx(0.5 * math.exp(-0.01))


def test_keys_compare_as_the_estimates_do_at_any_later_time():
    """key(epoch) * exp((epoch - now) / decay) is the estimate at now, for any epoch."""
    a, b = PeakEwma(10.0, now=T), PeakEwma(10.0, now=T)
    a.observe(0.2, T)
    b.observe(0.05, T + 20.0)
    for epoch in (T - 50, T, T + 20):
        for now in (T + 20, T + 30, T + 90):
            for est in (a, b):
                assert est.key(epoch) * math.exp((epoch - now) / 10.0) == pytest.approx(
                    est.value(now)
                )
    # 0.2 s twenty seconds ago has decayed below 0.05 s now: a is the cheaper.
    assert a.key(T) < b.key(T)


def test_zero_latency_is_floored_so_that_load_still_counts():
    """An answer of 0 s gives the smallest estimate, not 0."""
    est = PeakEwma(10.0, now=T)
    est.observe(0.0, T)
    assert est.value(T) == MIN_COST


def test_stats_report_milliseconds_and_counts():
    """stats() gives the estimate in ms, whether it was observed, and how often."""
    est = PeakEwma(10.0, now=T)
    est.observe(0.25, T)
    assert est.stats(T) == {
        "estimate_ms": pytest.approx(250.0),
        "observed": True,
        "observations": 1,
    }


def test_decay_must_be_positive():
    """A decay of 0 would divide by zero: refused at once."""
    with pytest.raises(ValueError, match="decay"):
        PeakEwma(0.0)


def test_relax_brings_a_pause_peak_down_to_the_typical_latency():
    """Four late answers of a 1 s pause after sixteen of 30 ms: the peak says 1 s; once
    relaxed, the estimate is the median of the recent answers, 30 ms, from then on."""
    est = PeakEwma(10.0, now=T)
    for i in range(16):
        est.observe(0.03, T + i * 0.01)
    for i in range(4):
        est.observe(1.0 - i * 0.01, T + 1.2 + i * 0.001)
    assert est.value(T + 1.203) == pytest.approx(1.0, rel=0.01)
    assert est.typical() == pytest.approx(0.03)
    assert est.relax(T + 2.5)
    assert est.value(T + 2.5) == pytest.approx(0.03)
    assert est.value(T + 12.5) == pytest.approx(0.03 * math.exp(-1.0))


def test_relax_never_lowers_a_steadily_slower_worker():
    """A worker whose answers are 50-90 ms keeps its cost, its last peak included:
    that is its own jitter, within twice its median."""
    est = PeakEwma(10.0, now=T)
    for i in range(32):
        est.observe(0.05 + (i % 5) * 0.01, T + i * 0.05)
    est.observe(0.095, T + 1.6)  # a peak of its own
    before = est.value(T + 5.0)
    assert not est.relax(T + 5.0)
    assert est.value(T + 5.0) == before


def test_relax_follows_a_worker_that_stays_slow():
    """After nine slow answers of sixteen the median is slow: relaxing keeps it slow."""
    est = PeakEwma(10.0, now=T)
    for i in range(16):
        est.observe(0.03, T + i * 0.01)
    for i in range(9):
        est.observe(0.5, T + 1.0 + i * 0.5)
    est.relax(T + 10.0)
    assert est.value(T + 10.0) > 0.3


def test_relax_needs_answers_and_a_seed_forgets_them():
    """No successful answer: nothing to relax to; a seed starts the recent answers again."""
    est = PeakEwma(10.0, now=T)
    est.observe(1.0, T, ok=False)
    assert est.typical() is None and not est.relax(T + 5.0)
    est.observe(0.03, T + 1.0)
    est.seed(0.5, T + 2.0)
    assert est.typical() is None
