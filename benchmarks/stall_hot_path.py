"""What the stall limit adds to every attempt, against the pool's own work per task.

    python -m benchmarks.stall_hot_path

Times, in one interpreter and interleaved, ``Send.silence()`` (the limit worked out
at each attempt's start), ``Pace.observe()`` (a success fed to it) and one whole
``pool.execute`` over a transport that answers at once (the pool's own work per task,
no network). Prints the medians of ``ROUNDS`` rounds and the share of a task the
first two take. Not run by pytest: it measures, it asserts nothing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from npu_sync import Task, WorkerPool
from npu_sync._life.transport import Send
from npu_sync.config import HealthConfig, PoolConfig, worker_config
from npu_sync.testing import FakeNetwork, json_response
from npu_sync.transport import Response

ROUNDS = 7
CALLS = 20_000
ANSWER: Response = json_response(200, {"response": "ok"})


def per_call(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> None:
    net = FakeNetwork(lambda req: ANSWER)
    config = PoolConfig(
        workers=(
            worker_config("a", "http://127.0.0.1:9401"),
            worker_config("b", "http://127.0.0.1:9402"),
        ),
        health=HealthConfig(enabled=False),
    )
    with WorkerPool(config, transport_factory=net.factory) as pool:
        for _ in range(200):
            pool.execute({"input_text": "x"})
        stack = pool._runner.stack()
        ctx = stack.begin(Task({"input_text": "x"}), b"{}", 1e12, None, None)
        send = next(step for step in stack.steps if isinstance(step, Send))
        worker = pool._state.workers["a"]
        rows: dict[str, list[float]] = {"silence()": [], "pace.observe()": [], "execute": []}
        for _ in range(ROUNDS):
            rows["silence()"].append(per_call(lambda: send.silence(ctx, worker, 20.0), CALLS))
            rows["pace.observe()"].append(per_call(lambda: worker.pace.observe(0.02), CALLS))
            rows["execute"].append(per_call(lambda: pool.execute({"input_text": "x"}), CALLS // 10))
    medians = {name: statistics.median(values) for name, values in rows.items()}
    task = medians["execute"]
    for name, value in medians.items():
        print(f"{name:<16} {value * 1e6:8.2f} µs  {value / task:6.3f} of a task's own work")


if __name__ == "__main__":
    main()
