"""Unit tests of the slow start ramp."""

from __future__ import annotations

import pytest

from npu_sync.balancing.slowstart import SlowStart


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
