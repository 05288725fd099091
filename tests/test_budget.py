"""Unit tests of the retry budget."""

from __future__ import annotations

import random
import threading

import pytest

from npu_sync._budget import RetryBudget
from npu_sync.testing import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start=1000.0)


def test_with_no_traffic_the_floor_allows_min_per_second_times_window(clock):
    """10 a second over 10 s: 100 retries, the 101st refused."""
    budget = RetryBudget(0.2, 10.0, 10.0, clock=clock)
    assert [budget.try_withdraw() for _ in range(101)].count(True) == 100
    assert budget.stats()["refused"] == 1


def test_tasks_earn_their_ratio_of_retries(clock):
    """With no floor, 1,000 tasks allow 200 retries at 20 %."""
    budget = RetryBudget(0.2, 0.0, 10.0, clock=clock)
    for _ in range(1000):
        budget.deposit()
    assert budget.balance() == pytest.approx(200.0)
    assert [budget.try_withdraw() for _ in range(250)].count(True) == 200


def test_a_failing_fleet_keeps_retries_within_ratio_plus_floor(clock):
    """Half of all attempts fail and every failure wants a retry (up to 3): over a
    minute of 100 tasks a second, retries stay within 20 % of tasks plus 10 a second
    (one window's worth more at most, for the window sliding), where without the
    budget there would be 0.875 per task."""
    budget = RetryBudget(0.2, 10.0, 10.0, clock=clock)
    rng = random.Random(4)
    tasks, retries = 60 * 100, 0
    for _ in range(tasks):
        clock.advance(0.01)
        budget.deposit()
        for _ in range(3):
            if rng.random() < 0.5 or not budget.try_withdraw():
                break  # the attempt succeeded, or no retry is allowed
            retries += 1
    assert retries <= 0.2 * tasks + 10 * 60 + (0.2 * 1000 + 100)
    assert retries >= 0.2 * tasks  # and the budget is used, not sat on
    assert (tasks + retries) / tasks < 1.4


def test_counts_expire_after_the_window(clock):
    """Deposits and withdrawals count for the window, then slide out."""
    budget = RetryBudget(0.5, 0.0, 10.0, clock=clock)
    for _ in range(10):
        budget.deposit()
    assert budget.try_withdraw() and budget.balance() == pytest.approx(4.0)
    clock.advance(10.0)
    assert budget.balance() == 0.0
    assert not budget.try_withdraw()


def test_the_window_slides_slice_by_slice(clock):
    """A deposit counts until its slice leaves the window: still there at 9 s, gone at 10."""
    budget = RetryBudget(1.0, 0.0, 10.0, clock=FakeClock(start=1000.0))
    budget.deposit(1000.0)
    budget.deposit(1005.0)
    assert budget.balance(1009.9) == 2.0
    assert budget.balance(1010.0) == 1.0
    assert budget.balance(1015.0) == 0.0


def test_a_long_silence_empties_the_window_in_one_step(clock):
    """Hours later, every slice is expired at once and the floor is whole again."""
    budget = RetryBudget(0.2, 1.0, 10.0, clock=clock)
    while budget.try_withdraw():
        pass
    clock.advance(7200.0)
    assert budget.balance() == 10.0


def test_on_change_fires_on_the_edges_only(clock):
    """Exhausted once when retries start being refused, available once when allowed."""
    changes: list[bool] = []
    budget = RetryBudget(0.0, 0.1, 10.0, clock=clock, on_change=changes.append)
    assert budget.try_withdraw()
    assert not budget.try_withdraw() and not budget.try_withdraw()
    assert changes == [True] and budget.stats()["exhausted"]
    clock.advance(10.0)
    assert budget.try_withdraw()
    assert changes == [True, False]


def test_concurrent_use_never_grants_more_than_the_balance(clock):
    """16 threads withdrawing at once share the 100 retries of the floor exactly."""
    budget = RetryBudget(0.2, 10.0, 10.0, clock=clock)
    granted: list[int] = []
    start = threading.Barrier(16)

    def take() -> None:
        start.wait()
        granted.append(sum(budget.try_withdraw() for _ in range(50)))

    threads = [threading.Thread(target=take) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(granted) == 100
    assert budget.stats()["refused"] == 16 * 50 - 100


def test_stats_carry_the_settings_balance_and_totals(clock):
    """stats() is JSON-serialisable and counts tasks, retries and refusals."""
    budget = RetryBudget(0.25, 0.0, 4.0, clock=clock)
    for _ in range(8):
        budget.deposit()
    budget.try_withdraw()
    budget.try_withdraw()
    budget.try_withdraw()
    assert budget.stats() == {
        "ratio": 0.25,
        "min_per_second": 0.0,
        "window": 4.0,
        "balance": 0.0,
        "exhausted": True,
        "requests": 8,
        "retries": 2,
        "refused": 1,
    }


@pytest.mark.parametrize("args", [(-0.1, 10.0, 10.0), (0.2, -1.0, 10.0), (0.2, 10.0, 0.0)], ids=str)
def test_bad_settings_are_refused(args):
    """A negative ratio or floor, or an empty window, raise ValueError."""
    with pytest.raises(ValueError):
        RetryBudget(*args)


def test_a_deposit_under_a_lock_the_caller_holds_counts_as_any_deposit(clock):
    """Given the pool's lock, the budget guards itself with it: deposits made with that
    lock held fill the same window as deposit() does, and expire with it."""
    lock = threading.Lock()
    budget = RetryBudget(1.0, 0.0, 10.0, clock=clock, lock=lock)
    with lock:
        budget.deposit_locked(1000.0)
        budget.deposit_locked(1005.0)
    budget.deposit(1005.0)
    assert not lock.locked()
    assert budget.balance(1009.9) == 3.0
    assert budget.balance(1010.0) == 2.0
    assert budget.stats(1010.0)["requests"] == 3
    assert budget.try_withdraw(1010.0) and budget.try_withdraw(1010.0)
    assert not budget.try_withdraw(1010.0)
