"""The fleet view's shared read and its rows per host."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from npu_sync._fleetview import SharedRead, host_rows, silent_process
from npu_sync._stats_types import ProcessSnapshot


class Ticker:
    """Monotonic seconds a test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_computation_serves_every_caller_within_the_interval():
    """Callers within the interval get the same value; the next one after it computes."""
    clock = Ticker()
    made: list[int] = []
    read = SharedRead(lambda: made.append(len(made)) or len(made), 5.0, clock=clock)
    assert [read.get() for _ in range(10)] == [1] * 10
    clock.now += 4.9
    assert read.get() == 1
    clock.now += 0.2
    assert read.get() == 2
    assert read.computed == 2 and made == [0, 1]


def test_concurrent_callers_share_the_computation_under_way():
    """Sixteen threads asking while one computation runs: it runs once, all get it."""
    started = threading.Event()
    release = threading.Event()
    calls: list[int] = []

    def compute() -> dict[str, int]:
        calls.append(1)
        started.set()
        assert release.wait(30)
        return {"n": len(calls)}

    read: SharedRead[dict[str, int]] = SharedRead(compute, 0.0)
    results: list[dict[str, int]] = []
    first = threading.Thread(target=lambda: results.append(read.get()))
    first.start()
    assert started.wait(30)
    waiting = [threading.Thread(target=lambda: results.append(read.get())) for _ in range(15)]
    for t in waiting:
        t.start()
    # Every waiter is parked on the condition before the computation ends.
    deadline = threading.Event()
    for _ in range(30_000):
        if len(read._cond._waiters) == 15:  # type: ignore[attr-defined]
            break
        deadline.wait(0.001)
    assert len(read._cond._waiters) == 15  # type: ignore[attr-defined]
    release.set()
    for t in [first, *waiting]:
        t.join(30)
    assert len(results) == 16 and len(calls) == 1
    assert all(r is results[0] for r in results)


def test_a_failed_computation_is_retried_by_the_next_caller_and_raises_to_its_own():
    """The caller whose computation raised gets the error; nothing is kept from it."""
    clock = Ticker()
    outcomes: list[Any] = [RuntimeError("redis said no"), "ok"]

    def compute() -> str:
        out = outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return str(out)

    read = SharedRead(compute, 5.0, clock=clock)
    with pytest.raises(RuntimeError, match="redis said no"):
        read.get()
    assert read.get() == "ok" and read.computed == 1


def test_clear_forgets_the_value():
    """After clear() the next caller computes afresh, even within the interval."""
    clock = Ticker()
    count = iter(range(1, 100))
    read = SharedRead(lambda: next(count), 60.0, clock=clock)
    assert read.get() == 1
    read.clear()
    assert read.get() == 2 and read.age() == 0.0


def _process(host: str, pid: int, *, at: float, workers: list[tuple[str, str, bool, int]]) -> Any:
    tasks = dict.fromkeys(
        ("submitted", "succeeded", "rejected", "failed", "fallbacks", "retries"), 0
    ) | {"active": 0, "in_flight": 1, "waiting": 2, "succeeded": 10, "failed": 1}
    rows = [
        {"id": wid, "breaker": breaker, "healthy": healthy, "failed": failed}
        for wid, breaker, healthy, failed in workers
    ]
    snap: ProcessSnapshot = {  # type: ignore[typeddict-item]
        "process": {"id": f"{host}:{pid}:ab", "pid": pid, "host": host, "started_at": 0.0},
        "published_at": at,
        "tasks": tasks,
        "workers": rows,
    }
    return snap


def test_hosts_sum_their_processes_and_count_workers_once():
    """Two processes on one host: tasks and errors summed, each worker counted once,
    a worker down in one process counted as down for the host."""
    a1 = _process("a", 1, at=50.0, workers=[("w1", "closed", True, 2), ("w2", "open", True, 3)])
    a2 = _process("a", 2, at=55.0, workers=[("w1", "closed", False, 1), ("w2", "closed", True, 0)])
    b1 = _process("b", 1, at=52.0, workers=[("w1", "closed", True, 0)])
    rows = host_rows([a1, a2, b1], [], this_host="b")
    by_host = {r["host"]: r for r in rows}
    a = by_host["a"]
    assert (a["processes"], a["workers"], a["workers_down"], a["errors"]) == (2, 2, 2, 6)
    assert a["tasks"] == {"succeeded": 20, "failed": 2, "in_flight": 2, "waiting": 4}
    assert a["last_seen"] == 55.0 and a["state"] == "live" and a["silent_since"] is None
    assert by_host["b"]["this_host"] and not a["this_host"]
    assert by_host["b"]["workers_down"] == 0


def test_a_host_whose_processes_all_went_silent_stays_listed_as_silent():
    """A host with only silent processes is kept, last, with when it went silent; a live
    host with one silent process counts it without going silent."""
    live = _process("a", 1, at=50.0, workers=[("w1", "closed", True, 0)])
    silent = [
        silent_process("a:9:ff", 40.0),
        silent_process("gone:1:aa", 30.0),
        silent_process("gone:2:bb", 35.0),
    ]
    rows = host_rows([live], silent)
    assert [r["host"] for r in rows] == ["a", "gone"]
    a, gone = rows
    assert (a["state"], a["processes"], a["silent_processes"]) == ("live", 1, 1)
    assert a["last_seen"] == 50.0
    assert (gone["state"], gone["processes"], gone["silent_processes"]) == ("silent", 0, 2)
    assert gone["silent_since"] == 35.0 and gone["workers"] == 0


def test_a_silent_member_name_is_read_without_trusting_it():
    """Host and pid come from the member id; one not shaped like ours keeps its name."""
    assert silent_process("web-3:4242:9f0e", 1.0) == {
        "id": "web-3:4242:9f0e", "host": "web-3", "pid": 4242, "last_seen": 1.0
    }  # fmt: skip
    assert silent_process("garbage", 2.0)["host"] == "garbage"
    assert silent_process("h:99999999999999:x", 2.0)["pid"] == 0
