"""Unit tests of the index: ready lists, parked workers, the wake heap, room checks."""

from __future__ import annotations

from npu_sync._balancing.slot import BLOCKED, FULL, READY, TIMED
from npu_sync.testing import FakeClock
from tests.balancing.kit import make_worker, parts


def test_every_worker_starts_parked_and_is_placed_on_first_look():
    """A new index knows nothing yet: every worker parked, placed at the first catch-up."""
    a, b = make_worker("a"), make_worker("b", priority=2)
    p = parts([a, b])
    assert set(p.index.parked) == {a, b} and p.index.may_have_room(0.0)
    p.index.catch_up(0.0)
    assert p.index.parked == {}
    assert [[s.id for s in t.ready] for t in p.index.tiers] == [["a"], ["b"]]


def test_a_full_worker_leaves_the_ready_list_and_returns_when_a_task_ends():
    """Filled up, the worker is parked as full; update() after its task ends brings it back."""
    a = make_worker("a", capacity=1)
    p = parts([a])
    p.index.catch_up(0.0)
    a.in_flight = 1
    p.index.taken(a, 0.0)
    assert p.slot(a).place == FULL and not p.index.may_have_room(0.0)
    a.in_flight = 0
    p.index.update(a, 0.0)
    assert p.slot(a).place == READY and p.index.tiers[0].ready == [p.slot(a)]


def test_a_cool_down_parks_a_worker_until_it_ends_and_says_so_once():
    """A Retry-After cool-down makes the worker timed: its wake is the earliest, the
    callback hears of it, and the worker is ready again when the time comes."""
    clock = FakeClock()
    a = make_worker("a", clock=clock)
    p = parts([a])
    woken: list[bool] = []
    p.index.on_earlier_wake = lambda: woken.append(True)
    now = clock.monotonic()
    p.index.catch_up(now)
    a.cooldown_until = now + 5.0
    p.index.taken(a, now)
    assert p.slot(a).place == TIMED and p.index.next_wake() == now + 5.0
    assert woken == [True]
    assert not p.index.has_room(now + 4.0)
    assert p.index.has_room(now + 5.0) and p.slot(a).place == READY


def test_invalidate_has_every_parked_worker_looked_at_again():
    """A worker made healthy without a word is found after invalidate(), not before."""
    a = make_worker("a")
    p = parts([a])
    p.index.catch_up(0.0)
    a.healthy = False
    p.index.taken(a, 0.0)
    assert p.slot(a).place == BLOCKED and not p.index.has_room(0.0)
    a.healthy = True
    assert not p.index.has_room(0.0)  # not told
    p.index.invalidate()
    assert p.index.has_room(0.0) and p.slot(a).place == READY


def test_a_disabled_worker_cannot_serve_before_any_deadline_a_cooling_one_can_after():
    """can_serve_before() reads each worker's doom: never for a disabled worker, the end
    of its cool-down for a cooling one; held_past() names the cool-down."""
    clock = FakeClock()
    now = clock.monotonic()
    a, b = make_worker("a", clock=clock), make_worker("b", clock=clock)
    p = parts([a, b])
    a.enabled = False
    b.cooldown_until = now + 10.0
    p.index.invalidate()
    assert not p.index.can_serve_before(set(), now + 5.0, now)
    assert p.index.can_serve_before(set(), now + 20.0, now)
    assert not p.index.can_serve_before({"b"}, now + 20.0, now)
    assert p.index.held_past(set(), now + 5.0) == (False, True)


def test_a_half_open_breaker_found_ready_is_noted_for_its_trial():
    """The trial rule hears of a worker whose breaker admits its trial."""
    clock = FakeClock()
    a = make_worker("a", clock=clock)
    p = parts([a])
    a.breaker.record_failure(False)  # fail_max=1: open
    clock.advance(a.breaker.reset_timeout + 1)
    p.index.catch_up(clock.monotonic())
    assert p.slot(a).place == READY and list(p.trials.pending) == [p.slot(a)]


def test_rebuild_keeps_the_parked_dict_callers_hold():
    """The dispatcher keeps a reference to ``parked``: a rebuild refills the same dict."""
    a = make_worker("a")
    p = parts([a])
    parked = p.index.parked
    p.index.catch_up(0.0)
    p.index.rebuild([[p.slot(a)]])
    assert p.index.parked is parked and set(parked) == {a}


def test_each_tiers_worker_list_mirrors_its_ready_slots():
    """The workers a count scan reads are the ready slots' workers, in order, through
    every move in and out of the ready list."""
    ws = [make_worker(n, capacity=1) for n in "abcd"]
    p = parts(ws)
    p.index.catch_up(0.0)
    tier = p.index.tiers[0]
    for worker in (ws[1], ws[3], ws[0]):
        worker.in_flight = 1
        p.index.taken(worker, 0.0)
        assert tier.workers == [s.worker for s in tier.ready]
    for worker in (ws[3], ws[1]):
        worker.in_flight = 0
        p.index.update(worker, 0.0)
        assert tier.workers == [s.worker for s in tier.ready]
    assert [w.id for w in tier.workers] == ["b", "c", "d"]
