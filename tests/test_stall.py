"""The stall limit: how long an attempt may go without a byte of its answer, and what a
cut attempt charges. Units of the rule, then the pool driven by a fake clock and fake
workers (the fake transport cannot tell silence, so the limit caps its whole budget)."""

from __future__ import annotations

import pytest

from npu_sync import Task, TaskFailed, WorkerPool
from npu_sync._stall import MIN_SAMPLES, WINDOW, Pace, StallLimit, TrialDeadline
from npu_sync.config import (
    BalancingConfig,
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    RetryConfig,
    StallConfig,
    TrialConfig,
    worker_config,
)
from npu_sync.errors import ConfigError
from npu_sync.testing import FakeClock, FakeNetwork, FakeRequest, json_response
from npu_sync.transport import TransportError

READ = 20.0  # the default timeouts.read


def paced(*durations: float) -> Pace:
    pace = Pace()
    for duration in durations:
        pace.observe(duration)
    return pace


# -- the rule ---------------------------------------------------------------------------


def test_the_limit_is_a_multiple_of_the_high_percentile_clamped_to_floor_and_budget():
    """5 x p99 by default, never under the floor, and no limit at all at the budget."""
    rule = StallLimit()
    assert rule.silence(0.02, READ) == 1.0  # 0.1 s raised to the floor
    assert rule.silence(0.5, READ) == pytest.approx(2.5)
    assert rule.silence(4.0, READ) is None  # 20 s: the budget itself, nothing shorter
    assert rule.silence(0.5, 2.0) is None  # an attempt cut to 2 s by the deadline


def test_nothing_known_means_no_limit_unless_unknown_is_set():
    """A pool's first tasks are not cut on a guess; ``unknown`` sets a limit for them."""
    assert StallLimit().silence(None, READ) is None
    assert StallLimit(unknown=3.0).silence(None, READ) == 3.0
    assert StallLimit(unknown=0.2).silence(None, READ) == 1.0  # the floor still holds


def test_a_declared_timeout_allows_its_share_of_silence():
    """A task declaring 12 s may be silent 6 s; a short declaration lowers nothing."""
    rule = StallLimit()
    assert rule.silence(0.02, READ, declared=12.0) == pytest.approx(6.0)
    assert rule.silence(0.02, READ, declared=0.5) == 1.0
    assert StallLimit(declared_share=0.0).silence(0.02, READ, declared=12.0) == 1.0


def test_a_task_cut_before_gets_twice_the_silence_next_time():
    """Each cut doubles the next attempt's limit, up to the budget."""
    rule = StallLimit()
    assert rule.silence(0.02, READ, cut_before=1.0) == 2.0
    assert rule.silence(0.02, READ, cut_before=8.0) == 16.0
    assert rule.silence(0.02, READ, cut_before=10.0) is None


def test_disabled_never_limits():
    """``retry.stall.enabled: false`` leaves every attempt to its budget."""
    assert StallLimit(enabled=False).silence(0.02, READ) is None


def test_a_pace_needs_enough_answers_then_gives_its_high_percentile():
    """Fewer than MIN_SAMPLES durations give no figure; then the p99 of the window."""
    pace = paced(*[0.01] * (MIN_SAMPLES - 1))
    assert pace.high(0.99) is None and not pace.enough
    pace.observe(0.5)
    assert pace.enough and pace.high(0.99) == 0.5
    assert pace.high(0.5) == 0.01


def test_a_pace_forgets_what_left_its_window():
    """Only the last WINDOW durations count: an old outlier stops raising the limit."""
    pace = paced(5.0, *[0.02] * WINDOW)
    assert pace.high(0.99) == 0.02


def test_a_pace_figure_follows_new_answers():
    """The cached percentile is computed again as answers come."""
    pace = paced(*[0.02] * WINDOW)
    assert pace.high(0.99) == 0.02
    for _ in range(WINDOW):
        pace.observe(0.3)
    assert pace.high(0.99) == 0.3


def test_a_fresh_worker_takes_the_highest_figure_of_its_peers():
    """No answers of its own: the slowest known peer's figure, never a guess below it."""
    rule = StallLimit()
    fresh = Pace()
    peers = [paced(*[0.02] * 16), paced(*[0.4] * 16), fresh, Pace()]
    assert rule.known(fresh, peers) == 0.4
    assert rule.known(fresh, [fresh]) is None
    assert rule.known(paced(*[0.1] * 16), peers) == 0.1  # its own figure wins


def test_the_yaml_spelling_loads_and_bad_values_name_the_key():
    """``retry.stall`` reads from YAML; a bad value names its key path and value."""
    from npu_sync.config import parse_config

    cfg = parse_config(
        {"npu_workers": {"workers": [], "retry": {"stall": {"multiplier": 8, "unknown": 5}}}}
    )
    assert cfg.retry.stall == StallConfig(multiplier=8.0, unknown=5.0)
    with pytest.raises(ConfigError, match=r"npu_workers\.retry\.stall\.floor: .*got -1"):
        parse_config({"npu_workers": {"workers": [], "retry": {"stall": {"floor": -1}}}})


# -- in a pool, with a fake clock -------------------------------------------------------


class Fleet:
    """Fake workers on a fake clock: each answers in its own latency, or never."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.latency: dict[str, float] = {}
        self.frozen: set[str] = set()
        self.heavy = 0.0  # what a task whose payload says "heavy" takes anywhere
        self.budgets: list[tuple[str, float]] = []

    def __call__(self, req: FakeRequest) -> object:
        wid = req.worker_id
        self.budgets.append((wid, req.timeout))
        took = self.heavy if req.json().get("heavy") else self.latency.get(wid, 0.02)
        if wid in self.frozen or req.timeout < took:
            self.clock.advance(req.timeout)
            return TransportError("timeout", f"{wid}: timed out", sent=True)
        self.clock.advance(took)
        return json_response(200, {"by": wid})


def pool_of(ids: tuple[str, ...], clock: FakeClock, fleet: Fleet, **kw: object) -> WorkerPool:
    net = FakeNetwork(fleet)
    cfg = PoolConfig(
        workers=tuple(
            worker_config(w, f"http://127.0.0.1:{9400 + n}", max_concurrent=8)
            for n, w in enumerate(ids)
        ),
        health=HealthConfig(enabled=False),
        balancing=BalancingConfig(strategy="round-robin"),
        retry=kw.pop(  # type: ignore[arg-type]
            "retry", RetryConfig(backoff_initial=0.01, backoff_max=0.02)
        ),
        circuit_breaker=kw.pop(  # type: ignore[arg-type]
            "breaker", BreakerConfig(fail_max=5, reset_timeout=30)
        ),
        **kw,  # type: ignore[arg-type]
    )
    return WorkerPool(cfg, transport_factory=net.factory, clock=clock)


def warm(pool: WorkerPool, n: int) -> None:
    for _ in range(n):
        pool.execute({"input_text": "x"})


def rows(pool: WorkerPool) -> dict[str, dict]:
    return {w["id"]: w for w in pool.workers()}


def test_a_frozen_worker_is_cut_at_the_floor_and_the_task_retried_elsewhere():
    """Workers that answer in 20 ms: a frozen one holds a task 1 s (the floor), not the
    20 s read timeout; the task succeeds on another worker and the frozen one is
    charged once."""
    clock = FakeClock()
    fleet = Fleet(clock)
    with pool_of(("a", "b"), clock, fleet) as pool:
        warm(pool, 2 * MIN_SAMPLES)
        fleet.frozen.add("a")
        fleet.budgets.clear()
        start = clock.monotonic()
        assert pool.execute({"input_text": "x"}) == {"by": "b"}  # round robin: a first
        assert fleet.budgets == [("a", 1.0), ("b", 2.0)]
        assert clock.monotonic() - start < 1.5  # one cut, not the read timeout
        assert rows(pool)["a"]["breaker"]["failures"] == 1


def test_nothing_known_leaves_the_first_attempts_to_the_read_timeout():
    """A pool that has seen no answer yet does not cut its first attempt on a guess."""
    clock = FakeClock()
    fleet = Fleet(clock)
    with pool_of(("a",), clock, fleet) as pool:
        pool.execute({"input_text": "x"})
    assert fleet.budgets == [("a", 20.0)]


def test_a_fresh_worker_is_judged_by_its_tier():
    """A worker added to a running pool, with no answer of its own yet, is given the
    limit its tier's figures give, not the whole read timeout."""
    clock = FakeClock()
    fleet = Fleet(clock)
    with pool_of(("a", "b"), clock, fleet) as pool:
        warm(pool, 2 * MIN_SAMPLES)
        pool.add_worker(worker_config("c", "http://127.0.0.1:9499", max_concurrent=8))
        fleet.frozen.add("c")
        fleet.budgets.clear()
        for _ in range(6):
            pool.execute({"input_text": "x"})
        assert ("c", 1.0) in fleet.budgets
        assert not any(wid == "c" and budget > 1.0 for wid, budget in fleet.budgets)


def test_a_heavy_task_that_declares_its_timeout_is_not_cut():
    """On a worker that answers in 20 ms, a task declaring 12 s that takes 4 s runs to
    its end: it may be silent 6 s. Nothing is charged."""
    clock = FakeClock()
    fleet = Fleet(clock)
    fleet.heavy = 4.0
    with pool_of(("a",), clock, fleet) as pool:
        warm(pool, 2 * MIN_SAMPLES)
        fleet.budgets.clear()
        assert pool.execute(Task({"heavy": True}, timeout=12.0)) == {"by": "a"}
        assert fleet.budgets == [("a", 6.0)]
        assert rows(pool)["a"]["tasks"]["failed"] == 0


def test_an_undeclared_heavy_task_ends_and_does_not_open_a_healthy_breaker():
    """A 3 s task on the only worker, which answers others in 20 ms: cut at 1 s, then
    2 s, it runs at the third attempt (4 s allowed). Only the first cut is charged,
    so a breaker that opens at two failures stays closed."""
    clock = FakeClock()
    fleet = Fleet(clock)
    fleet.heavy = 3.0
    with pool_of(("a",), clock, fleet, breaker=BreakerConfig(fail_max=2)) as pool:
        warm(pool, 2 * MIN_SAMPLES)
        fleet.budgets.clear()
        assert pool.execute({"heavy": True}) == {"by": "a"}
        assert [b for _, b in fleet.budgets] == [1.0, 2.0, 4.0]
        breaker = rows(pool)["a"]["breaker"]
        assert (breaker["state"], breaker["trips"]) == ("closed", 0)


def test_a_held_cut_is_charged_when_the_task_then_runs_faster_elsewhere():
    """Two frozen workers and a live one: the task is cut on both (1 s, then 2 s) and
    succeeds on the third in 20 ms, which proves both cut workers slow: each is
    charged."""
    clock = FakeClock()
    fleet = Fleet(clock)
    with pool_of(("a", "b", "c"), clock, fleet) as pool:
        warm(pool, 3 * MIN_SAMPLES)  # round robin: the next task starts on a
        fleet.frozen.update({"a", "b"})
        fleet.budgets.clear()
        assert pool.execute({"input_text": "x"}) == {"by": "c"}
        assert fleet.budgets == [("a", 1.0), ("b", 2.0), ("c", 4.0)]
        charged = {wid: row["breaker"]["failures"] for wid, row in rows(pool).items()}
        assert charged == {"a": 1, "b": 1, "c": 0}


def test_a_non_idempotent_task_is_not_cut_for_silence():
    """A non-idempotent task cannot be retried elsewhere: cutting it would lose a slow
    worker's answer for nothing but an earlier failure. It keeps the read timeout; on a
    frozen worker it fails there, once, its dead letter stored first."""
    clock = FakeClock()
    fleet = Fleet(clock)
    with pool_of(("a", "b"), clock, fleet) as pool:
        warm(pool, 2 * MIN_SAMPLES)
        read = pool.config.timeouts.read
        fleet.latency["a"] = fleet.latency["b"] = 3.0  # far beyond the 1 s limit, alive
        fleet.budgets.clear()
        assert pool.execute(Task({"input_text": "x"}, idempotent=False))["by"] in ("a", "b")
        assert [budget for _, budget in fleet.budgets] == [read]
        fleet.frozen.update({"a", "b"})
        start = clock.monotonic()
        with pytest.raises(TaskFailed) as failed:
            pool.execute(Task({"input_text": "x"}, idempotent=False))
        assert clock.monotonic() - start == pytest.approx(read)
        assert "non-idempotent" in str(failed.value) and "stalled" not in str(failed.value)
        assert failed.value.dead_letter_id is not None
        assert pool.dead_letters.get(failed.value.dead_letter_id) is not None
        assert len(failed.value.attempts) == 1


def test_a_half_open_trial_is_bounded_by_the_rule():
    """A worker whose breaker opened gets its trial; frozen, the trial ends at the
    stall limit and the breaker opens again, while the task runs elsewhere."""
    clock = FakeClock()
    fleet = Fleet(clock)
    with pool_of(
        ("a", "b"), clock, fleet, breaker=BreakerConfig(fail_max=1, reset_timeout=5)
    ) as pool:
        warm(pool, 2 * MIN_SAMPLES)
        fleet.frozen.add("a")
        while rows(pool)["a"]["breaker"]["state"] != "open":
            pool.execute({"input_text": "x"})
        clock.advance(6.0)  # the reset timeout passed: a's next task is its trial
        fleet.budgets.clear()
        for _ in range(2):
            assert pool.execute({"input_text": "x"}) == {"by": "b"}
        assert ("a", 1.0) in fleet.budgets
        assert all(budget <= 1.0 for wid, budget in fleet.budgets if wid == "a")
        assert rows(pool)["a"]["breaker"]["state"] == "open"


# -- the trial deadline: how long a half-open worker's one trial may take -----------------


def test_the_trial_deadline_is_a_multiple_of_the_p99_clamped_to_floor_and_cap():
    """5 x p99, at least 1 s, at most 10 s and never beyond the read timeout; the cap
    when nothing is known."""
    rule = TrialDeadline()
    assert rule.seconds(0.02, READ) == 1.0
    assert rule.seconds(0.5, READ) == pytest.approx(2.5)
    assert rule.seconds(4.0, READ) == 10.0
    assert rule.seconds(0.5, 2.0) == 2.0
    assert rule.seconds(None, READ) == 10.0
    assert rule.seconds(None, 3.0) == 3.0
    assert TrialDeadline(multiplier=3.0, floor=0.5, cap=4.0).seconds(0.1, READ) == 0.5


def test_the_trial_deadline_takes_the_workers_own_figure_else_its_tiers():
    """Its own p99 first; with too few answers, the slowest of its tier's; else None."""
    rule = TrialDeadline()
    fresh = Pace()
    peers = [paced(*[0.02] * 16), paced(*[0.4] * 16), fresh]
    assert rule.known(paced(*[0.1] * 16), peers) == 0.1
    assert rule.known(fresh, peers) == 0.4
    assert rule.known(fresh, [fresh]) is None


def test_the_trial_settings_load_from_yaml_and_bad_values_name_the_key():
    """``circuit_breaker.trial`` reads from YAML; a cap under the floor names its key."""
    from npu_sync.config import parse_config

    def parsed(trial: dict[str, float]) -> object:
        return parse_config({"npu_workers": {"workers": [], "circuit_breaker": {"trial": trial}}})

    cfg = parsed({"multiplier": 3, "floor": 0.5, "cap": 4})
    assert cfg.circuit_breaker.trial == TrialConfig(multiplier=3.0, floor=0.5, cap=4.0)
    with pytest.raises(ConfigError, match=r"circuit_breaker\.trial\.cap: must be >= floor"):
        parsed({"floor": 2, "cap": 1})


class TrialFleet(Fleet):
    """Fleet that also answers health checks (healthy unless frozen) and records every
    request as (worker, method, timeout)."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.requests: list[tuple[str, str, float]] = []

    def __call__(self, req: FakeRequest) -> object:
        self.requests.append((req.worker_id, req.method, req.timeout))
        if req.path != "/health":
            return super().__call__(req)
        if req.worker_id in self.frozen:
            self.clock.advance(req.timeout)
            return TransportError("timeout", f"{req.worker_id}: timed out", sent=True)
        return json_response(200, {"status": "healthy"})

    def to(self, worker_id: str) -> list[tuple[str, float]]:
        return [(method, timeout) for wid, method, timeout in self.requests if wid == worker_id]


def trial_pool(clock: FakeClock, fleet: Fleet, **kw: object) -> WorkerPool:
    """Workers a and b; a opens at its first failure and tries again after 5 s."""
    breaker = BreakerConfig(fail_max=1, reset_timeout=5, trial=kw.pop("trial", TrialConfig()))  # type: ignore[arg-type]
    return pool_of(("a", "b"), clock, fleet, breaker=breaker, **kw)


def open_a(pool: WorkerPool, clock: FakeClock, fleet: TrialFleet) -> None:
    """Freeze a, let a task open it, then let its reset timeout pass: a's trial is due."""
    fleet.frozen.add("a")
    while rows(pool)["a"]["breaker"]["state"] != "open":
        pool.execute({"input_text": "x"})
    clock.advance(6.0)
    fleet.requests.clear()


def run_until_tried(pool: WorkerPool, fleet: TrialFleet, task: Task) -> float:
    """Tasks until one meets a's trial; the fake seconds that task took."""
    for _ in range(4):
        start = fleet.clock.monotonic()
        assert pool.execute(task) == {"by": "b"}
        if fleet.to("a"):
            return fleet.clock.monotonic() - start
    raise AssertionError("a's trial never came")


def test_a_trial_is_cut_at_the_workers_latency_not_the_read_timeout_with_no_stall_rule():
    """The stall rule off, a worker that answered in 0.4 s before it froze: its trial
    ends at 5 x 0.4 = 2 s, not the 20 s read timeout, and the task runs on b."""
    clock = FakeClock()
    fleet = TrialFleet(clock)
    fleet.latency["a"] = 0.4
    retry = RetryConfig(backoff_initial=0.01, backoff_max=0.02, stall=StallConfig(enabled=False))
    with trial_pool(clock, fleet, retry=retry) as pool:
        warm(pool, 2 * MIN_SAMPLES)
        fleet.frozen.add("a")
        while rows(pool)["a"]["breaker"]["state"] != "open":  # the read timeout, once
            pool.execute({"input_text": "x"})
        clock.advance(6.0)
        fleet.requests.clear()
        took = run_until_tried(pool, fleet, Task({"input_text": "x"}))
        assert fleet.to("a") == [("POST", pytest.approx(2.0))]
        assert took == pytest.approx(2.0, abs=0.1)
        row = rows(pool)["a"]
        assert row["breaker"]["state"] == "open"
        assert "trial: no answer within 2s" in row["last_error"]


def test_a_trial_on_a_worker_with_no_latency_known_is_cut_at_the_cap():
    """A worker that never answered, alone in its tier (so no figure anywhere): its
    trial gets the cap (10 s), not the read timeout (20 s)."""
    clock = FakeClock()
    fleet = TrialFleet(clock)
    net = FakeNetwork(fleet)
    cfg = PoolConfig(
        workers=(
            worker_config("a", "http://127.0.0.1:9401", priority=1, max_concurrent=8),
            worker_config("b", "http://127.0.0.1:9402", priority=2, max_concurrent=8),
        ),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(backoff_initial=0.01, backoff_max=0.02),
        circuit_breaker=BreakerConfig(fail_max=1, reset_timeout=5),
    )
    with WorkerPool(cfg, transport_factory=net.factory, clock=clock) as pool:
        open_a(pool, clock, fleet)
        assert pool.execute({"input_text": "x"}) == {"by": "b"}  # a first: its trial
        assert fleet.to("a") == [("POST", 10.0)]


def test_a_non_idempotent_task_is_never_sent_to_a_frozen_worker_on_trial():
    """A non-idempotent task meeting a's trial: a's health check is the trial, cut at
    the deadline (1 s); the task itself never reaches a and runs on b, and a opens
    again."""
    clock = FakeClock()
    fleet = TrialFleet(clock)
    with trial_pool(clock, fleet) as pool:
        warm(pool, 2 * MIN_SAMPLES)
        open_a(pool, clock, fleet)
        took = run_until_tried(pool, fleet, Task({"input_text": "x"}, idempotent=False))
        assert fleet.to("a") == [("GET", 1.0)]
        assert took == pytest.approx(1.0, abs=0.1)
        row = rows(pool)["a"]
        assert row["breaker"]["state"] == "open"
        assert "trial: health check failed within 1s" in row["last_error"]


def test_a_non_idempotent_trial_on_a_worker_that_answers_is_sent_once_and_closes_it():
    """a answers again: its health check passes within the deadline, then the task is
    sent once, with the read timeout, and its success closes a's breaker."""
    clock = FakeClock()
    fleet = TrialFleet(clock)
    with trial_pool(clock, fleet) as pool:
        warm(pool, 2 * MIN_SAMPLES)
        open_a(pool, clock, fleet)
        fleet.frozen.clear()
        for _ in range(4):
            by = pool.execute(Task({"input_text": "x"}, idempotent=False))["by"]
            if by == "a":
                break
        assert fleet.to("a") == [("GET", 1.0), ("POST", READ)]
        assert rows(pool)["a"]["breaker"]["state"] == "closed"


def test_the_trial_deadline_follows_its_settings():
    """``circuit_breaker.trial``: a floor of 3 s makes the trial of a fast worker 3 s."""
    clock = FakeClock()
    fleet = TrialFleet(clock)
    with trial_pool(clock, fleet, trial=TrialConfig(floor=3.0)) as pool:
        warm(pool, 2 * MIN_SAMPLES)
        open_a(pool, clock, fleet)
        run_until_tried(pool, fleet, Task({"input_text": "x"}, idempotent=False))
        assert fleet.to("a") == [("GET", 3.0)]


def test_a_hook_that_calls_back_into_the_pool_on_a_cut_attempt():
    """A hook reading the pool's stats and workers on every event, a cut among them:
    no deadlock, and the hook sees the cut as a failed attempt that says it stalled."""
    from npu_sync.events import AttemptFinished

    clock = FakeClock()
    fleet = Fleet(clock)
    seen: list[str] = []
    pools: list[WorkerPool] = []

    def hook(event: object) -> None:
        for pool in pools:
            pool.stats()
            pool.workers()
        if isinstance(event, AttemptFinished) and event.outcome == "failure":
            seen.append(event.error or "")

    net = FakeNetwork(fleet)
    cfg = PoolConfig(
        workers=(
            worker_config("a", "http://127.0.0.1:9401", max_concurrent=8),
            worker_config("b", "http://127.0.0.1:9402", max_concurrent=8),
        ),
        health=HealthConfig(enabled=False),
        balancing=BalancingConfig(strategy="round-robin"),
    )
    with WorkerPool(cfg, transport_factory=net.factory, clock=clock, hooks=[hook]) as pool:
        pools.append(pool)
        warm(pool, 2 * MIN_SAMPLES)
        fleet.frozen.add("a")
        assert pool.execute({"input_text": "x"}) == {"by": "b"}
    assert len(seen) == 1 and "stalled" in seen[0]


def test_a_reload_changes_the_limit_for_tasks_that_start_after_it():
    """``retry.stall`` follows a reload: a floor of 3 s, then the rule turned off."""
    import dataclasses

    clock = FakeClock()
    fleet = Fleet(clock)
    with pool_of(("a", "b"), clock, fleet) as pool:
        warm(pool, 2 * MIN_SAMPLES)
        fleet.frozen.add("a")
        config = pool.config
        for stall, expected in ((StallConfig(floor=3.0), 3.0), (StallConfig(enabled=False), 20.0)):
            pool.reload(
                dataclasses.replace(config, retry=dataclasses.replace(config.retry, stall=stall))
            )
            fleet.budgets.clear()
            while not any(wid == "a" for wid, _ in fleet.budgets):
                pool.execute({"input_text": "x"})
            assert [b for wid, b in fleet.budgets if wid == "a"] == [expected]
