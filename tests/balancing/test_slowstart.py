"""Unit tests of the slow start ramp."""

from __future__ import annotations

import pytest

from npu_sync._balancing.slowstart import SlowStart


def test_the_factor_ramps_linearly_from_the_floor_to_one_over_the_window():
    """Aggression 1: a tenth at the start, half at mid-window, all of it at the end."""
    ramp = SlowStart(window=10.0)
    assert ramp.factor(100.0, 100.0) == 0.1
    assert ramp.factor(100.0, 100.5) == 0.1  # 5 % of the window: the floor still
    assert ramp.factor(100.0, 105.0) == pytest.approx(0.5)
    assert ramp.factor(100.0, 109.0) == pytest.approx(0.9)
    assert ramp.factor(100.0, 110.0) == 1.0
    assert ramp.factor(100.0, 500.0) == 1.0
    assert ramp.ends(100.0) == 110.0


def test_aggression_shapes_the_ramp():
    """Above 1 the share rises fast early; below 1 it stays small longer."""
    eager, shy = SlowStart(window=10.0, aggression=2.0), SlowStart(window=10.0, aggression=0.5)
    assert eager.factor(0.0, 2.5) == pytest.approx(0.5)
    assert shy.factor(0.0, 5.0) == pytest.approx(0.25)


def test_a_zero_window_turns_slow_start_off():
    """Window 0: not enabled, and the factor is always 1."""
    off = SlowStart(window=0.0)
    assert not off.enabled and off.factor(10.0, 10.0) == 1.0


@pytest.mark.parametrize(
    "kwargs", [{"window": -1.0}, {"aggression": 0.0}, {"min_factor": 0.0}, {"min_factor": 1.5}]
)
def test_bad_settings_are_refused(kwargs):
    """Negative windows, zero aggression and floors outside (0, 1] raise ValueError."""
    with pytest.raises(ValueError):
        SlowStart(**kwargs)


def test_a_reload_turning_slow_start_off_ends_the_ramps_under_way():
    """A worker ramping when a reload sets the window to 0: it has its whole share at
    once, and nothing shows it as ramping any more (stats()'s ``ramping``, its
    ``slow_start_until``), nor refreshes shares on every selection until the old end."""
    from npu_sync._balancing.selector import Selector
    from tests.balancing.kit import make_worker

    a, b = make_worker("a"), make_worker("b")
    selector = Selector([a, b], slow_start=SlowStart(window=10.0), now=0.0)
    selector.recovered(a, 1.0)
    assert selector.stats(2.0)["ramping"] == {"a": 9.0}
    assert selector.slow_start_until(a, 2.0) == 11.0
    selector.configure(latency_aware=False, decay=10.0, slow_start=None, now=2.0)
    assert selector.share_of(a) == 1.0
    assert selector.stats(2.5) == {
        "strategy": "least-loaded",
        "latency_aware": False,
        "latency_decay": 10.0,
        "slow_start": 0.0,
        "ramping": {},
    }
    assert selector.slow_start_until(a, 2.5) is None
    assert selector.captured(a)[5] < 2.5  # the row's slow_start_until: None
    assert selector._ramps.due == float("inf")
    # Turned on again, a recovery ramps as before.
    selector.configure(latency_aware=False, decay=10.0, slow_start=SlowStart(10.0), now=3.0)
    selector.recovered(b, 3.0)
    assert selector.stats(4.0)["ramping"] == {"b": 9.0}
