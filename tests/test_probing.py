"""Health checks on bounded threads, at stable slots; falling behind is said, not hidden."""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from dataclasses import dataclass

import pytest

from npu_sync._health import HealthChecker, _Schedule
from npu_sync._probing import ProbeRunner, Slots
from npu_sync.config import HealthConfig, TransportConfig, worker_config
from npu_sync.testing import FakeNetwork, json_response
from npu_sync.transport import Transport


@dataclass
class Target:
    id: str
    health_transport: Transport


def wait_for(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    gate = threading.Event()
    while time.monotonic() < deadline:
        if predicate():
            return True
        gate.wait(0.01)
    return predicate()


def fleet(net: FakeNetwork, count: int, handler) -> list[Target]:
    targets = []
    for i in range(count):
        worker_id = f"w{i}"
        net.route(worker_id, handler)
        cfg = worker_config(worker_id, f"http://127.0.0.1:{10000 + i}")
        targets.append(Target(worker_id, net.factory(cfg, TransportConfig())))
    return targets


# -- slots ----------------------------------------------------------------------------------


def test_each_worker_has_one_stable_slot_per_interval_spread_over_it():
    """Offsets are stable for a worker, distinct between salts, and spread evenly."""
    slots = Slots(salt=0.37, epoch=100.0)
    interval = 10.0
    ids = [f"worker-{i}" for i in range(2000)]
    offsets = [slots.offset(w, interval) for w in ids]
    assert all(0 <= o < interval for o in offsets)
    assert offsets == [slots.offset(w, interval) for w in ids]  # stable
    deciles = [0] * 10
    for o in offsets:
        deciles[int(o)] += 1
    assert min(deciles) > 120 and max(deciles) < 280, deciles  # about 200 each
    other = Slots(salt=0.81, epoch=100.0)
    assert sum(other.offset(w, interval) != slots.offset(w, interval) for w in ids) > 1990
    # next() lands on the worker's offset, once per interval, never before `after`.
    for w in ids[:50]:
        at = slots.next(w, interval, 1234.5)
        assert at >= 1234.5 and at - 1234.5 < interval
        assert (at - 100.0 - slots.offset(w, interval)) / interval == pytest.approx(
            round((at - 100.0 - slots.offset(w, interval)) / interval)
        )


def test_the_schedule_checks_a_new_worker_at_once_then_once_per_interval_at_its_slot():
    """Driven by hand: each worker comes due exactly once in every interval, at its offset."""
    slots = Slots(salt=0.5, epoch=0.0)
    schedule = _Schedule(slots)
    targets = {f"w{i}": Target(f"w{i}", None) for i in range(100)}  # type: ignore[arg-type]
    schedule.update(targets, 10.0, 0.0, moved=False)
    first = schedule.take_due(0.0)
    assert {t.id for t, _ in first} == set(targets)  # every new worker at once
    seen: dict[str, list[float]] = {w: [] for w in targets}
    now = 0.0
    while now < 60.0:
        now += 0.25
        for target, at in schedule.take_due(now):
            seen[target.id].append(at)
    for worker_id, times in seen.items():
        offset = slots.offset(worker_id, 10.0)
        # Six intervals: five or six checks (the first slot may fall within half an
        # interval of the check at start), each at the worker's offset.
        assert len(times) in (5, 6), (worker_id, times)
        assert all(t % 10.0 == pytest.approx(offset) for t in times)
        assert all(b - a == pytest.approx(10.0) for a, b in itertools.pairwise(times))


def test_a_worker_added_or_moved_is_checked_at_once_and_a_new_interval_moves_slots():
    """update(): new and moved workers come due now; a new interval re-plans everyone."""
    slots = Slots(salt=0.1, epoch=0.0)
    schedule = _Schedule(slots)
    a = Target("a", None)  # type: ignore[arg-type]
    schedule.update({"a": a}, 10.0, 0.0, moved=False)
    assert [t.id for t, _ in schedule.take_due(0.0)] == ["a"]
    b = Target("b", None)  # type: ignore[arg-type]
    schedule.update({"a": a, "b": b}, 10.0, 3.0, moved=False)
    assert [t.id for t, _ in schedule.take_due(3.0)] == ["b"]
    schedule.update({"a": a, "b": b}, 2.0, 4.0, moved=False)
    due = schedule.next_due()
    assert 4.0 <= due < 6.0  # a slot within the new, shorter interval
    schedule.update({"b": b}, 2.0, 5.0, moved=False)
    times = [at for _, at in schedule.take_due(100.0)]
    assert {t.id for t, _ in schedule.take_due(200.0)} <= {"b"} and times


# -- the runner -------------------------------------------------------------------------------


def test_the_runner_never_runs_more_threads_than_its_size():
    """500 probes that each wait a little: never more than 4 threads, all run, all end."""
    runner = ProbeRunner(4, name="npu-sync-test-probe")
    most = {"now": 0, "max": 0}
    lock = threading.Lock()

    def probe(cancel):
        with lock:
            most["now"] += 1
            most["max"] = max(most["max"], most["now"])
        alive = sum(1 for t in threading.enumerate() if t.name.startswith("npu-sync-test-probe"))
        cancel.event.wait(0.001)
        with lock:
            most["now"] -= 1
        return alive

    futures = [runner.submit(probe, budget=10) for _ in range(500)]
    results = [f.result(30) for f in futures if f is not None]
    runner.stop(5)
    assert len(results) == 500
    assert most["max"] <= 4 and max(results) <= 4
    assert runner.threads() == 0


def test_stop_shuts_running_probes_and_drops_queued_ones():
    """stop() cancels what runs (its Cancel fires) and what waits, and returns."""
    runner = ProbeRunner(2)
    started = threading.Semaphore(0)

    def hang(cancel):
        started.release()
        return cancel.event.wait(30)

    futures = [runner.submit(hang, budget=60) for _ in range(5)]
    assert started.acquire(timeout=5) and started.acquire(timeout=5)
    runner.stop(5)
    assert [f.result(5) for f in futures[:2]] == [True, True]  # woken by their Cancel
    assert all(f.cancelled() for f in futures[2:])
    assert runner.threads() == 0
    assert runner.submit(hang, budget=1) is None


def test_a_probe_overrunning_its_budget_is_replaced_so_others_still_run():
    """A probe that ignores its budget and its Cancel loses its thread's slot to another."""
    runner = ProbeRunner(1)
    release = threading.Event()
    stuck = runner.submit(lambda cancel: release.wait(30), budget=0.05)
    assert wait_for(lambda: runner.next_overdue() is not None)
    other = runner.submit(lambda cancel: "ran", budget=1)
    assert wait_for(lambda: bool(runner.abandon_overdue()) or other.done())
    assert other.result(10) == "ran"
    release.set()
    assert stuck.result(10) is True
    runner.stop(5)
    assert runner.threads() == 0


# -- the checker ------------------------------------------------------------------------------


def test_a_round_over_3000_workers_uses_at_most_the_configured_threads():
    """check_once() over 3,000 in-process workers: all checked, on at most 5 threads."""
    net = FakeNetwork()
    most = {"threads": 0}

    def handler(req):
        alive = [t for t in threading.enumerate() if t.name.startswith("npu-sync-health-probe")]
        most["threads"] = max(most["threads"], len(alive))
        return json_response(200, {"status": "healthy"})

    targets = fleet(net, 3000, handler)
    applied: list[int] = []
    checker = HealthChecker(
        lambda: targets,
        lambda results: applied.append(len(results)),
        lambda: HealthConfig(concurrency=5, timeout=5),
    )
    try:
        results = checker.check_once()
    finally:
        checker.stop()
    assert len(results) == 3000 and all(r.ok for r in results.values())
    assert 1 <= most["threads"] <= 5 and applied == [3000]


def test_the_thread_checks_every_worker_once_per_interval_not_all_at_once(caplog):
    """With a 0.5 s interval, 40 workers' second checks come at 40 distinct slots."""
    net = FakeNetwork()
    seen: dict[str, list[float]] = {}
    lock = threading.Lock()

    def handler(req):
        with lock:
            seen.setdefault(req.worker_id, []).append(time.monotonic())
        return json_response(200, {"status": "healthy"})

    targets = fleet(net, 40, handler)
    checker = HealthChecker(
        lambda: targets,
        lambda results: None,
        lambda: HealthConfig(interval=0.5, timeout=1, concurrency=4),
        rng=random.Random(7),
    )
    checker.start()
    try:
        assert wait_for(lambda: all(len(seen.get(t.id, ())) >= 3 for t in targets))
    finally:
        checker.stop()
    seconds = sorted(times[1] for times in seen.values())
    # Spread over the interval rather than in one burst: the second checks of the 40
    # workers cover most of an interval.
    assert seconds[-1] - seconds[0] > 0.25
    assert checker.skipped == 0 and not checker.behind


def test_checks_that_cannot_keep_up_are_skipped_counted_and_logged(caplog):
    """One thread, checks that each take longer than the interval allows: the checker
    says it falls behind (stats and a warning naming health.concurrency)."""
    net = FakeNetwork()
    release = threading.Event()
    targets = fleet(
        net, 6, lambda req: (release.wait(0.2), json_response(200, {"status": "healthy"}))[1]
    )
    checker = HealthChecker(
        lambda: targets,
        lambda results: None,
        lambda: HealthConfig(interval=0.1, timeout=5, concurrency=1),
    )
    caplog.set_level(logging.WARNING, logger="npu_sync._health")
    checker.start()
    try:
        assert wait_for(lambda: checker.skipped > 0 and checker.behind)
        assert wait_for(lambda: "fall behind" in caplog.text)
    finally:
        release.set()
        checker.stop()
    assert "health.concurrency (now 1)" in caplog.text
    assert checker.stats()["skipped"] == checker.skipped


def test_the_threads_check_that_overruns_its_budget_is_reported_failed_once():
    """A transport that ignores its budget: the health thread gives its check up after
    health.timeout + 0.5 s, applies one failure, and the worker is not probed twice."""
    net = FakeNetwork()
    release = threading.Event()
    calls = []

    def hung(req):
        calls.append(req)
        release.wait(30)  # ignores its budget and its cancellation
        return json_response(200, {"status": "healthy"})

    targets = fleet(net, 1, hung)
    applied: list[str | None] = []
    checker = HealthChecker(
        lambda: targets,
        lambda results: applied.extend(r.error for r in results.values()),
        lambda: HealthConfig(interval=0.05, timeout=0.05, concurrency=1),
    )
    checker.start()
    try:
        assert wait_for(lambda: any(e and "no answer within 0.05s" in e for e in applied))
        assert len(calls) == 1 and checker.skipped > 0
    finally:
        release.set()
        checker.stop()
    assert sum(1 for e in applied if e and "no answer" in e) == 1
