"""The rule by which a placement round adds a replica (npu_sync._demand): tasks in
flight, tasks queued for a worker, latency against the model's own normal; and the
per-model queue meter. Times are given, never slept."""

from __future__ import annotations

import pytest

from npu_sync._demand import MIN_TASKS, QUEUED, RISE, SETTLE, Demand, QueueMeter, Window
from npu_sync._placement import ModelUse
from npu_sync.testing import FakeClock


def test_a_peak_in_flight_at_scale_up_of_the_capacity_wants_a_replica() -> None:
    """6 in flight on 8 slots at scale_up 0.75 is enough; 5 is not; no capacity, never."""
    demand = Demand()
    assert demand.judge("m", Window(10.0, peak=6), 8, 0.75, 100.0) == "load: 6 in flight on 8 slots"
    assert demand.judge("m", Window(10.0, peak=5), 8, 0.75, 110.0) is None
    assert demand.judge("m", Window(10.0, peak=5), 0, 0.75, 120.0) is None


def test_tasks_queued_for_a_worker_on_average_want_a_replica() -> None:
    """Half a task waiting on average over the window is queueing, whatever the
    model's tasks in flight; less is not; an empty window judges nothing."""
    demand = Demand()
    why = demand.judge("m", Window(10.0, peak=1, queued=QUEUED * 10.0), 8, 0.75, 100.0)
    assert why == "load: 0.5 tasks waiting for a worker on average"
    assert demand.judge("m", Window(10.0, peak=1, queued=4.9), 8, 0.75, 110.0) is None
    assert demand.judge("m", Window(0.0, queued=4.9), 8, 0.75, 110.0) is None


def test_latency_rising_above_the_models_own_normal_wants_a_replica() -> None:
    """The first judged window is the normal (100 ms); one at RISE times it is rising;
    one at 1.4 times is not; a window of too few attempts is not judged."""
    clock = FakeClock(start=0.0)
    demand = Demand()

    def window(mean: float, tasks: int = MIN_TASKS) -> Window:
        return Window(10.0, peak=1, tasks=tasks, busy=mean * tasks)

    assert demand.judge("m", window(0.100), 8, 0.75, clock.monotonic()) is None
    assert demand.normal("m") == pytest.approx(0.100)
    clock.advance(10)
    few = window(0.100 * RISE * 10, tasks=MIN_TASKS - 1)
    assert demand.judge("m", few, 8, 0.75, clock.monotonic()) is None
    why = demand.judge("m", window(0.100 * RISE), 8, 0.75, clock.monotonic())
    assert why == "load: latency 150 ms against a normal 100 ms"
    clock.advance(10)
    assert demand.judge("m", window(0.140), 8, 0.75, clock.monotonic()) is None
    assert demand.judge("other", window(0.300), 8, 0.75, clock.monotonic()) is None  # its own


def test_a_lasting_change_of_latency_becomes_the_new_normal() -> None:
    """Twice the normal, window after window, is rising at first and, after a few
    time constants of SETTLE, the normal itself: replicas are not added for ever."""
    demand = Demand()
    now = 0.0
    demand.judge("m", Window(10.0, tasks=10, busy=1.0), 8, 0.75, now)  # 100 ms
    verdicts = []
    while now < 3 * SETTLE:
        now += 10.0
        verdicts.append(demand.judge("m", Window(10.0, tasks=10, busy=2.0), 8, 0.75, now))
    assert verdicts[0] is not None and verdicts[-1] is None
    assert demand.normal("m") == pytest.approx(0.200, rel=0.06)


def test_several_signs_are_named_together_and_forget_drops_normals() -> None:
    """A window in flight, queued and slow says all three; forget keeps only the
    models named."""
    demand = Demand()
    demand.judge("m", Window(10.0, tasks=5, busy=0.5), 8, 0.75, 0.0)
    demand.judge("gone", Window(10.0, tasks=5, busy=0.5), 8, 0.75, 0.0)
    why = demand.judge("m", Window(10.0, peak=8, tasks=5, busy=1.0, queued=20.0), 8, 0.75, 10.0)
    assert why is not None
    assert "8 in flight" in why and "2.0 tasks waiting" in why and "latency 200 ms" in why
    demand.forget({"m"})
    assert demand.normal("gone") is None and demand.normal("m") is not None


def test_the_queue_meter_counts_task_seconds_waited_per_model() -> None:
    """Two tasks of m wait 3 s and 5 s, one of x 1 s; a wait under way is counted up to
    the take, and again from there at the next one."""
    meter = QueueMeter()
    meter.join("m", 0.0)
    meter.join("m", 1.0)
    meter.join("x", 1.0)
    meter.leave("x", 2.0)
    meter.leave("m", 3.0)
    assert meter.waiting("m") == 1
    assert meter.take(4.0) == {"m": pytest.approx(3.0 + 3.0), "x": pytest.approx(1.0)}
    meter.leave("m", 6.0)
    assert meter.take(10.0) == {"m": pytest.approx(2.0)}
    assert meter.take(20.0) == {} and meter.waiting("m") == 0


def test_model_use_windows_sum_the_attempts_time_in_flight() -> None:
    """Overlapping attempts of m (0-2 s and 1-4 s) give 2 ended attempts, 5 attempt-
    seconds and a peak of 2; one still in flight is counted up to the window's end
    and starts the next window's peak."""
    use = ModelUse()
    use.start("a", "m", 0.0)
    use.start("b", "m", 1.0)
    use.end("a", "m", 2.0)
    use.end("b", "m", 4.0)
    use.start("a", "m", 8.0)
    (window,) = use.take_windows(10.0, 10.0).values()
    assert (window.seconds, window.peak, window.tasks) == (10.0, 2, 2)
    assert window.busy == pytest.approx(2.0 + 3.0 + 2.0)
    use.end("a", "m", 11.0)
    again = use.take_windows(20.0, 10.0)["m"]
    assert (again.peak, again.tasks, again.busy) == (1, 1, pytest.approx(1.0))
