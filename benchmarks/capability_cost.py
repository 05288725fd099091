"""What capabilities and tags cost the choice of a worker.

One task's way to a lease and back, without I/O: build the ``Task``, begin its life
(``Stack.begin``: its context), the ``Fit`` step (``requires`` / ``prefers``) over the
``Admit`` step for a lease, and give the lease back (``record``). Three kinds of task
on the same tree and the same pool, interleaved round by round so that the machine's
noise hits them alike: one that needs nothing (the baseline), one requiring a
capability half the workers have, one preferring a tag a third of them have::

    python benchmarks/capability_cost.py

Prints each kind's best round (each round the best of five batches), in microseconds
per task, and its ratio to the task that needs nothing. Not run by pytest: it
measures, it asserts nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from npu_sync import Task, WorkerPool
from npu_sync._life import record
from npu_sync._life.context import Try
from npu_sync._retry import Kind, Outcome
from npu_sync.config import HealthConfig, PoolConfig, worker_config
from npu_sync.testing import FakeNetwork

ROUNDS = 9
BATCHES = 5
CALLS = 20_000
WORKERS = 10

CASES: dict[str, dict[str, Any]] = {
    "none": {},
    "requires": {"requires": {"vision"}},
    "prefers": {"prefers": {"location=lab"}},
}


def build() -> tuple[WorkerPool, Callable[[dict[str, Any]], float]]:
    """The pool, and a function timing one batch of tasks of one kind (seconds/task)."""
    workers = tuple(
        worker_config(
            f"w{i}",
            f"http://127.0.0.1:{2000 + i}",
            capabilities=("llm", "vision") if i % 2 else ("llm",),
            tags={"location": "lab" if i % 3 == 0 else "dc"},
        )
        for i in range(WORKERS)
    )
    config = PoolConfig(workers=workers, health=HealthConfig(enabled=False))
    pool = WorkerPool(config, transport_factory=FakeNetwork().factory)
    state = pool._state
    stack = pool._runner.stack()
    fit = next(s for s in stack.steps if type(s).__name__ == "Fit")
    admit = next(s for s in stack.steps if type(s).__name__ == "Admit")
    ok = Outcome(Kind.SUCCESS, {})
    body = b"{}"

    def leased(ctx: Any) -> Any:
        return admit(ctx, lambda ctx, at: at)

    def batch(kw: dict[str, Any]) -> float:
        clock = time.perf_counter
        t0 = clock()
        for _ in range(CALLS):
            task = Task({"x": 1}, **kw)
            at = fit(stack.begin(task, body, time.monotonic() + 60, None, None), leased)
            assert type(at) is Try
            record(state, at.lease, ok, 0.0, 0.0, retry=False)
        return (clock() - t0) / CALLS

    return pool, batch


def main() -> None:
    pool, batch = build()
    best: dict[str, list[float]] = {case: [] for case in CASES}
    try:
        for _ in range(ROUNDS):
            for case, kw in CASES.items():
                best[case].append(min(batch(kw) for _ in range(BATCHES)))
    finally:
        pool.close()
    base = min(best["none"])
    print(f"{'task':9} {'µs/task':>8} {'ratio':>6}")
    for case, values in best.items():
        value = min(values)  # best round: other load on the machine only adds time
        print(f"{case:9} {value * 1e6:8.2f} {value / base:6.2f}")


if __name__ == "__main__":
    main()
