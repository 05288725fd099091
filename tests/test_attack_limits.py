"""Attacks on the adaptive concurrency limit: odd samples, small ceilings, drops, noise,
reloads and resets, against a simulated worker and through a pool.

Each test names the behaviour that holds and, where it once broke, how: the first
block pins those breaks, the second attacks the limit withstood from the start.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from typing import Any

import pytest

from npu_sync import WorkerPool
from npu_sync._balancing.limits import HillClimbingLimit, square_root_headroom
from npu_sync.config import BalancingConfig, HealthConfig, PoolConfig, worker_config
from npu_sync.testing import FakeClock, FakeNetwork, json_response

OK = {"model_id": "default", "input_text": "hi"}


def steady(rng: random.Random, i: int) -> float:
    """A task time of 20 ms, within 5 %."""
    return 0.02 * rng.uniform(0.95, 1.05)


def simulate(
    limit: HillClimbingLimit,
    answers: int,
    *,
    slots: Callable[[int], int] = lambda i: 8,
    duration: Callable[[random.Random, int], float] | None = None,
    seed: int = 1,
    watch: Callable[[HillClimbingLimit], None] | None = None,
    hold: bool = False,
) -> None:
    """Feed ``limit`` the answers of a worker kept full by more callers than the limit
    (as ``tests/test_limits.py`` does), where the worker's parallel slots after ``i``
    answers are ``slots(i)`` and a task started then takes ``duration(rng, i)`` seconds
    in its slot. ``watch`` sees the limit after each answer. With ``hold``, go on past
    ``answers`` until the limit holds (not in the middle of a probe)."""
    if duration is None:
        duration = steady
    rng = random.Random(seed)
    now = 0.0
    free_at = [0.0] * slots(0)
    in_flight: list[tuple[float, float, int]] = []  # (ends, started, in flight at start)

    def start(i: int) -> tuple[float, float, int]:
        nonlocal free_at
        wanted = slots(i)
        if wanted != len(free_at):
            # Slots lost take no new task; slots gained are free from now on.
            free_at = sorted(free_at)[:wanted] + [now] * max(0, wanted - len(free_at))
        slot = min(range(len(free_at)), key=free_at.__getitem__)
        begins = max(now, free_at[slot])
        free_at[slot] = begins + duration(rng, i)
        return (free_at[slot], now, len(in_flight) + 1)

    for _ in range(limit.current):
        heapq.heappush(in_flight, start(0))
    i = 0
    while i < answers or (hold and limit.stats()["mode"] != "hold"):
        ends, started, level = heapq.heappop(in_flight)
        now = ends
        limit.on_sample(ends - started, level, False)
        if watch is not None:
            watch(limit)
        while len(in_flight) < limit.current:
            heapq.heappush(in_flight, start(i))
        i += 1


def settled(limit: HillClimbingLimit) -> int:
    """What a limit holding at its knee exposes: the knee plus its headroom, capped."""
    return min(limit.ceiling, limit.limit + square_root_headroom(limit.limit))


def within_bounds(limit: HillClimbingLimit) -> None:
    """A ``watch`` asserting the contract on every answer: an int in [1, ceiling], and
    stats() that agree with it."""
    current = limit.current
    stats = limit.stats()
    assert isinstance(current, int) and 1 <= current <= limit.ceiling
    assert stats["limit"] == current == stats["knee"] + stats["headroom"]


def note_modes(seen: list[str]) -> Callable[[HillClimbingLimit], None]:
    """A ``watch`` that notes each answer's mode in ``seen``."""
    return lambda limit: seen.append(str(limit.stats()["mode"]))


def lower_ceiling_as_a_reload_does(limit: HillClimbingLimit, ceiling: int) -> None:
    """What ``PoolState.configure_balancing_locked`` does to a limit on a reload."""
    limit.set_ceiling(ceiling)


# -- breaks ------------------------------------------------------------------------------


def test_isolated_drops_do_not_raise_a_settled_limit():
    """A worker of 8 slots settled at 11 that now and then answers 429 never holds
    higher than 11: a drop never leaves the worker more tasks than before it."""
    limit = HillClimbingLimit(64)
    simulate(limit, 10000, hold=True)
    before = limit.current
    assert before == settled(limit) == 11
    held: set[int] = set()

    def note_held(limit: HillClimbingLimit) -> None:
        if limit.stats()["mode"] == "hold":
            held.add(limit.current)

    for cycle in range(6):
        level = limit.current
        assert limit.on_sample(0.5, level, True) < level  # cut at once: that holds
        simulate(limit, 3000, seed=10 + cycle, watch=note_held)
    # The last run may end in a probe up (12): see where it settles.
    simulate(limit, 0, seed=16, watch=note_held, hold=True)
    # A bare cut padded later would hold at 9 + 3 = 12, for a worker flat past 8.
    assert max(held) <= before and limit.current <= before


@pytest.mark.parametrize(
    "duration",
    [
        pytest.param(lambda rng, i: 0.02 * rng.lognormvariate(0, 0.2), id="jitter-20%"),
        pytest.param(
            lambda rng, i: (0.02 if (i // 100) % 2 else 0.03) * rng.uniform(0.95, 1.05),
            id="fast-slow-rounds",
        ),
    ],
)
def test_noisy_task_times_do_not_ratchet_the_knee_up(duration):
    """A worker of 8 slots whose task times vary by a fifth (or alternate fast and slow
    every hundred answers) keeps a knee near 8 over thousands of rounds, not a climb
    toward the ceiling that queues dozens of tasks inside the worker."""
    limit = HillClimbingLimit(64)
    simulate(limit, 60000, duration=duration, seed=8)
    # Probing only up, noise kept it about 20-30 after 60 000 answers, the ceiling later.
    assert limit.limit <= 12


@pytest.mark.parametrize(("ceiling", "slots"), [(3, 1), (4, 1), (4, 2)])
def test_a_ceiling_at_or_under_the_start_still_finds_the_knee(ceiling, slots):
    """With max_concurrent at or below the initial 4 the knee still settles at the
    worker's slots or one more, as it does for ceilings above the start (ceiling 5
    with one slot settles at a knee of 1): it steps down before it first holds, rather
    than hold at the ceiling unmeasured."""
    limit = HillClimbingLimit(ceiling)
    seen: list[str] = []
    simulate(limit, 5000, slots=lambda i: slots, watch=note_modes(seen))
    assert limit.limit <= slots + 1
    assert "down" in seen[: seen.index("hold")]  # measured before it first holds


def test_a_knee_stopped_short_by_noise_climbs_back():
    """A climb that noise stopped short of 8 slots (knee 5, whose headroom alone fills
    the slots, so probes with headroom gain nothing) is found out by probes down that
    lose far more than one task's worth: the knee ends within one of the slots."""
    limit = HillClimbingLimit(64)
    simulate(limit, 60000, duration=lambda rng, i: 0.02 * rng.lognormvariate(0, 0.2), seed=8)
    simulate(limit, 0, seed=9, hold=True)
    assert 7 <= limit.limit <= 9


def test_a_ceiling_above_the_start_finds_a_knee_below_it():
    """The control for the test above: ceiling 5, one slot, descends to a knee of 1."""
    limit = HillClimbingLimit(5)
    simulate(limit, 5000, slots=lambda i: 1)
    assert limit.limit == 1 and limit.current == 2


def test_an_infinite_rtt_is_ignored_like_a_nan_one():
    """One answer with an infinite duration (a clock gone wrong) is ignored as a NaN one
    is: it does not make a held limit's whole period read zero and probe down."""
    limit = HillClimbingLimit(4, initial=4, min_round=16)  # at the ceiling: no probes up

    def feed(answers: int, rtt: float) -> None:
        for _ in range(answers):
            limit.on_sample(rtt, limit.current, False)

    feed(4 + 16, 0.02)
    feed(4 + 16, 0.02)  # one step down loses: it holds at 4
    feed(4 + 64, 0.02)  # a period: the settled throughput
    assert limit.stats()["mode"] == "hold"
    feed(4 + 32, 0.02)
    feed(1, math.inf)
    feed(32, 0.02)  # the rest of the period, judged on its last answer
    assert limit.stats()["mode"] == "hold" and limit.limit == 4
    assert limit.samples == 20 + 20 + 68 + 36 + 32  # all but the infinite one


def config(**worker: Any) -> PoolConfig:
    cfg = worker_config("a", worker.pop("url", "http://127.0.0.1:9200"), **worker)
    return PoolConfig(
        workers=(cfg,),
        balancing=BalancingConfig(adaptive_concurrency=True),
        health=HealthConfig(enabled=False),
    )


def limit_row(pool: WorkerPool) -> tuple[int, int]:
    (row,) = pool.workers()
    return row["capacity"], row["balancing"]["limit"]


def test_a_worker_moved_after_its_ceiling_was_lowered_keeps_its_limit_under_it():
    """After a reload lowers max_concurrent to 2 and a later one moves the worker to a
    new address (its limit starts again), workers() shows a limit of at most 2, the
    one the capacity obeys, not 4, above its own ceiling, ignoring every answer (never
    4 in flight) until drops cut it."""
    clock, net = FakeClock(), FakeNetwork()
    net.route("a", lambda req: json_response(200, {"worker_id": "a"}))
    with WorkerPool(config(), transport_factory=net.factory, clock=clock) as pool:
        pool.reload(config(max_concurrent=2))
        assert limit_row(pool) == (2, 2)
        pool.reload(config(max_concurrent=2, url="http://127.0.0.1:9201"))
        capacity, limit = limit_row(pool)
        assert capacity == 2
        assert limit == capacity


# -- what held ---------------------------------------------------------------------------


def test_a_reload_lowering_max_concurrent_is_obeyed_at_once():
    """A reload lowering max_concurrent under the limit lowers capacity and limit
    together; one raising it again leaves them within the new ceiling."""
    clock, net = FakeClock(), FakeNetwork()
    net.route("a", lambda req: json_response(200, {"worker_id": "a"}))
    with WorkerPool(config(), transport_factory=net.factory, clock=clock) as pool:
        assert limit_row(pool) == (4, 4)
        pool.reload(config(max_concurrent=3))
        assert limit_row(pool) == (3, 3)
        pool.reload(config(max_concurrent=1))
        assert limit_row(pool) == (1, 1)
        pool.execute(OK)
        pool.reload(config(max_concurrent=32))
        capacity, limit = limit_row(pool)
        assert capacity == limit and 1 <= limit <= 32


@pytest.mark.parametrize(
    ("rtt", "in_flight"),
    [(0.0, 8), (-0.02, 8), (math.nan, 8), (-math.inf, 8), (0.02, 0), (0.02, -3)],
)
def test_meaningless_samples_are_ignored(rtt, in_flight):
    """A zero, negative or NaN duration, or no task in flight, neither counts as a
    sample nor moves the limit, nor raises (it runs under the pool's lock)."""
    limit = HillClimbingLimit(64, initial=8)
    for _ in range(1000):
        assert limit.on_sample(rtt, in_flight, False) == 8
    assert limit.samples == 0 and limit.stats()["mode"] == "start"


def test_far_more_in_flight_than_the_limit_keeps_it_in_bounds():
    """Answers claiming thousands in flight (a stale lease) move the limit only within
    [1, ceiling]."""
    limit = HillClimbingLimit(16, initial=4)
    for i in range(5000):
        limit.on_sample(0.02 * (1 + i % 3), 10_000, False)
        within_bounds(limit)


@pytest.mark.parametrize("ceiling", [1, 2, 3])
@pytest.mark.parametrize("slots", [1, 8])
def test_small_ceilings_keep_headroom_under_them(ceiling, slots):
    """Ceilings 1, 2 and 3: the headroom never lifts the limit over the ceiling, on every
    answer, drops included."""
    limit = HillClimbingLimit(ceiling)
    simulate(limit, 3000, slots=lambda i: slots, watch=within_bounds)
    for _ in range(5):
        limit.on_sample(0.5, limit.current, True)
        within_bounds(limit)
    assert limit.current == 1
    simulate(limit, 3000, slots=lambda i: slots, watch=within_bounds, seed=2)


def test_a_knee_of_one_gets_a_headroom_of_one():
    """A worker of one slot under a high ceiling: knee 1 (or 2), the headroom on top."""
    limit = HillClimbingLimit(64)
    simulate(limit, 10000, slots=lambda i: 1, watch=within_bounds)
    assert limit.limit <= 2 and limit.current == settled(limit)


def test_a_worker_going_from_8_to_2_to_16_slots_is_followed_down_then_up():
    """Slots 8 -> 2 -> 16: the knee follows down to 2 or 3, and the capacity back up
    to at least the 16 slots within a few thousand answers."""
    limit = HillClimbingLimit(64)
    simulate(limit, 10000)
    assert 8 <= limit.limit <= 9
    simulate(limit, 5000, slots=lambda i: 2, seed=2, watch=within_bounds)
    assert limit.limit <= 3 and limit.current == settled(limit)
    simulate(limit, 5000, slots=lambda i: 16, seed=3, watch=within_bounds)
    assert limit.current >= 16  # the knee itself: see the headroom test below


def test_a_burst_of_drops_cuts_to_one_and_the_limit_climbs_back():
    """Every task in flight dropped at once cuts the limit to 1, and the worker's knee
    is found again within a couple of thousand answers."""
    limit = HillClimbingLimit(64)
    simulate(limit, 10000)
    for _ in range(limit.current):
        limit.on_sample(0.5, limit.current, True)
    assert limit.current == 1
    simulate(limit, 2000, seed=4, watch=within_bounds)
    assert 8 <= limit.limit <= 9 and limit.current == settled(limit)


def at_first_probe(act: Callable[[HillClimbingLimit], None]) -> Callable[[Any], None]:
    """A ``watch`` that runs ``act`` once, on the first answer where the limit probes up,
    and checks the bounds on every answer."""
    done: list[bool] = []

    def watch(limit: HillClimbingLimit) -> None:
        if not done and limit.stats()["mode"] == "up":
            done.append(True)
            act(limit)
        within_bounds(limit)

    return watch


@pytest.mark.parametrize("lowered", [1, 3, 6])
def test_a_ceiling_lowered_then_raised_mid_probe_stays_in_bounds(lowered):
    """A reload lowering the ceiling while the limit probes up, and one raising it back,
    keep the limit within bounds on every answer; the capacity climbs back to the
    worker's slots at least."""
    limit = HillClimbingLimit(64)
    simulate(limit, 10000)
    probed: list[int] = []

    def lower(limit: HillClimbingLimit) -> None:
        probed.append(limit.current)
        lower_ceiling_as_a_reload_does(limit, lowered)

    simulate(limit, 2000, seed=2, watch=at_first_probe(lower))
    assert probed and probed[0] > settled(limit) and limit.current <= lowered
    lower_ceiling_as_a_reload_does(limit, 64)
    simulate(limit, 10000, seed=4, watch=within_bounds)
    assert limit.current >= 8


def regain_after_a_lowered_ceiling(limit: HillClimbingLimit, watch: Any) -> tuple[int, int]:
    simulate(limit, 10000)
    lower_ceiling_as_a_reload_does(limit, 3)
    simulate(limit, 2000, seed=2)
    lower_ceiling_as_a_reload_does(limit, 64)
    simulate(limit, 20000, seed=4, watch=watch, hold=True)
    return 8, 400  # slots, and the answers within which the knee holds there


def regain_slots(limit: HillClimbingLimit, watch: Any) -> tuple[int, int]:
    simulate(limit, 10000)
    simulate(limit, 5000, slots=lambda i: 2, seed=2)
    simulate(limit, 20000, slots=lambda i: 16, seed=3, watch=watch, hold=True)
    return 16, 1600


@pytest.mark.parametrize("regain", [regain_after_a_lowered_ceiling, regain_slots])
def test_a_regained_worker_gets_its_headroom_back(regain):
    """A worker whose room comes back (a ceiling raised again after a reload lowered it
    to 3; slots going 8 -> 2 -> 16) ends at the knee a fresh start finds, its slots or
    one more, with the headroom on top, and promptly: probes with headroom alone would
    stop where knee plus headroom equals the slots (5 + 3 for 8, 12 + 4 for 16), so no
    task would wait at the worker to cover the gap between answer and next task."""
    limit = HillClimbingLimit(64)
    seen: list[tuple[Any, int]] = []  # each answer's mode and knee after the change

    def watch(limit: HillClimbingLimit) -> None:
        within_bounds(limit)
        seen.append((limit.stats()["mode"], limit.limit))

    slots, within = regain(limit, watch)
    assert slots <= limit.limit <= slots + 1 and limit.current == settled(limit)
    # Padded probes one knee at a time, then a bare search: about twice as long.
    assert any(mode == "hold" and knee >= slots for mode, knee in seen[:within])


def slower_then_more_slots(limit: HillClimbingLimit) -> int:
    simulate(limit, 10000)
    slower = lambda rng, i: 0.04 * rng.uniform(0.95, 1.05)  # noqa: E731
    simulate(limit, 10000, duration=slower, seed=2)
    simulate(limit, 20000, duration=slower, slots=lambda i: 16, seed=3)
    return 16


def ceiling_two_then_raised(limit: HillClimbingLimit) -> int:
    simulate(limit, 10000)
    lower_ceiling_as_a_reload_does(limit, 2)
    simulate(limit, 2000, seed=2)
    lower_ceiling_as_a_reload_does(limit, 64)
    simulate(limit, 20000, seed=4, watch=within_bounds)
    return 8


def test_a_worker_slower_for_good_is_still_probed_up():
    """A worker whose tasks now take twice as long (same slots) is judged against its
    new throughput: probes up go on, not a probe down after every period held."""
    limit = HillClimbingLimit(64)
    simulate(limit, 10000, hold=True)
    modes: list[str] = []
    slower = lambda rng, i: 0.04 * rng.uniform(0.95, 1.05)  # noqa: E731
    simulate(limit, 10000, duration=slower, seed=2, watch=note_modes(modes))
    assert "up" in modes[5000:]
    assert 8 <= limit.limit <= 9


def test_a_worker_losing_slots_one_at_a_time_is_followed_down():
    """Slots going 16 -> 12 one every 2000 answers (each a fall of less than a tenth)
    bring the knee down to 12 or 13 by probes down, not a knee left at 16."""
    limit = HillClimbingLimit(64)
    simulate(limit, 10000, slots=lambda i: 16, hold=True)
    assert 16 <= limit.limit <= 17
    simulate(limit, 30000, slots=lambda i: max(12, 16 - i // 2000), seed=2, hold=True)
    assert 12 <= limit.limit <= 13 and limit.current == settled(limit)


@pytest.mark.parametrize("scenario", [slower_then_more_slots, ceiling_two_then_raised])
def test_a_held_throughput_that_fell_for_good_does_not_pin_the_limit(scenario):
    """A worker whose tasks now take twice as long (same slots), then gains slots to 16,
    is followed up; so is one whose ceiling went to 2 (its first period there counted
    the queued tasks' answers) and back to 64, rather than kept at 7-11 tasks for 16
    slots, 4 for 8, by hold and probe down cycles against the throughput of the past."""
    limit = HillClimbingLimit(64)
    slots = scenario(limit)
    assert limit.current >= slots


def test_a_reset_with_tasks_still_queued_settles_at_the_same_knee():
    """reset() while a probe is under way and a dozen tasks still queue at the worker:
    the limit starts from 4 without headroom and settles at the knee it had (8 or 9).
    Counting the queued tasks' answers (in flight 12) in the first round at 4 would
    read the old level's throughput, find no gain at 5 and descend to a knee of 4."""
    limit = HillClimbingLimit(64)
    simulate(limit, 10000)
    after: list[tuple[int, Any]] = []
    first_held: list[int] = []

    def reset(limit: HillClimbingLimit) -> None:
        limit.reset()
        after.append((limit.current, limit.stats()["headroom"]))

    def watch(limit: HillClimbingLimit) -> None:
        probe(limit)
        if after and not first_held and limit.stats()["mode"] == "hold":
            first_held.append(limit.limit)

    probe = at_first_probe(reset)
    simulate(limit, 10000, seed=5, watch=watch, hold=True)
    assert after == [(4, 0)]
    assert 8 <= first_held[0] <= 9  # found at once, not after a detour down
    assert 8 <= limit.limit <= 9 and limit.current == settled(limit)


def test_a_reset_on_an_idle_worker_settles_at_the_same_knee():
    """The control for the test above: reset() with nothing left in flight (a worker
    back in service) starts from 4 and finds the same knee."""
    limit = HillClimbingLimit(64)
    simulate(limit, 10000)
    limit.reset()
    assert limit.current == 4 and limit.stats()["headroom"] == 0
    simulate(limit, 10000, seed=5, watch=within_bounds)
    assert 8 <= limit.limit <= 9 and limit.current == settled(limit)


def test_no_drift_over_thousands_of_rounds_with_steady_task_times():
    """With task times within 5 %, the knee stays at the slots or one more over some
    five thousand rounds."""
    knees: set[int] = set()
    limit = HillClimbingLimit(64)
    simulate(limit, 10000)
    simulate(limit, 150000, seed=9, watch=lambda limit: knees.add(limit.limit))
    assert knees <= {7, 8, 9, 10}
    assert 8 <= limit.limit <= 9
