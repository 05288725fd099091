"""The floor under any pool written in Python, on real sockets: how close to a bare call
can a pool get at all?

    python benchmarks/pool_floor.py [--rounds 3000] [--runs 3]

``execute`` ÷ a bare call is what ``benchmarks/test_overhead.py`` (``-k by_fleet``)
measures for npu_sync's pool. This puts a third contender beside the two: **the
floor**, the least a thread-safe pool must do per task in Python and nothing more,
written straight through in one function with no step, no event, no option — a task
id, the JSON body, a deadline; under a lock, the least-loaded worker whose breaker is
closed and its in-flight count raised; the request with the attempt's headers and a
timeout cut to the deadline on the same built-in transport; the answer's status read
and its JSON decoded; under the lock again, the slot given back, the worker's latency
average and its breaker's failure count updated, the success counted. Retries,
backoff, half-open trials, stall limits, hooks, stats, priorities and models are not
in it: on a healthy task they would cost it only more.

Fleets as in the overhead benchmark: a worker that answers at once
(``benchmarks/instant_worker.py``) and the reference worker, 1 and 10 of each, each
worker a process of its own, health checks off. With 10 workers the bare call goes to
the worker that answered the pool's last task (the same worker processes woken as the
pool's). Calls are interleaved one by one, the order alternating; each run gives the
median wall clock and the calling thread's CPU of each contender, and their ratios to
the bare call. A ratio above the issue's 1.05 for the floor means no Python pool with
breakers and least-connections reaches it on that fleet; the gap between the floor and
npu_sync is what its features cost on a healthy task.

Timings move with the machine's load: compare figures of one run only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.instant_worker import InstantWorkers
from benchmarks.overhead_where import FollowTheLast, _pool
from npu_sync.config import TransportConfig, worker_config
from npu_sync.task import new_task_id
from npu_sync.transport import make_transport
from npu_sync.worker_server import LocalWorker

PAYLOAD = {"model_id": "default", "input_text": "benchmark", "max_tokens": 16}
FLEET = 10
_pc, _tt, _mono = time.perf_counter, time.thread_time, time.monotonic


class _Slot:
    """One worker of the floor pool: its transport, in-flight count, breaker, latency."""

    __slots__ = ("failures", "in_flight", "latency", "limit", "open_until", "transport", "url")

    def __init__(self, url: str) -> None:
        self.url = url
        self.transport = make_transport(
            worker_config(url, url, max_concurrent=8), TransportConfig()
        )
        self.in_flight = 0
        self.limit = 8
        self.failures = 0
        self.open_until = 0.0
        self.latency = 0.0


class FloorPool:
    """The least a thread-safe pool with breakers and least-connections does per task."""

    def __init__(self, urls: list[str]) -> None:
        self.slots = [_Slot(url) for url in urls]
        self.lock = threading.Lock()
        self.succeeded = 0

    def execute(self, payload: Any, timeout: float = 60.0) -> Any:
        task_id = new_task_id()
        body = json.dumps(payload).encode()
        now = _mono()
        deadline = now + timeout
        with self.lock:
            best = None
            for slot in self.slots:
                if (
                    slot.in_flight < slot.limit
                    and slot.open_until <= now
                    and (best is None or slot.in_flight < best.in_flight)
                ):
                    best = slot
            if best is None:
                raise RuntimeError("no worker free (the benchmark never queues)")
            best.in_flight += 1
        t0 = _mono()
        response = best.transport.request(
            "POST",
            "/inference",
            body=body,
            headers={"X-NPU-Task-Id": task_id, "X-NPU-Attempt": "1"},
            timeout=min(20.0, deadline - t0),
            connect_timeout=2.0,
        )
        t1 = _mono()
        ok = response.status == 200
        result = json.loads(response.body) if ok else None
        with self.lock:
            best.in_flight -= 1
            best.latency += (t1 - t0 - best.latency) * 0.2
            if ok:
                best.failures = 0
                self.succeeded += 1
            else:
                best.failures += 1
                if best.failures >= 5:
                    best.open_until = t1 + 30.0
        if not ok:
            raise RuntimeError(f"HTTP {response.status} (the benchmark's workers never fail)")
        return result

    def close(self) -> None:
        for slot in self.slots:
            slot.transport.close()


def one_fleet(urls: list[str], rounds: int) -> dict[str, dict[str, float]]:
    """Median wall and CPU µs of each contender on ``urls``, interleaved call by call."""
    with ExitStack() as stack:
        pool = stack.enter_context(_pool(urls))
        floor = FloorPool(urls)
        stack.callback(floor.close)
        follow = FollowTheLast(urls, stack)
        contenders = {
            "bare call": follow.bare,
            "floor pool": follow.tracked(floor.execute),
            "npu_sync pool": follow.tracked(pool.execute),
        }
        names = list(contenders)
        wall: dict[str, list[float]] = {name: [] for name in names}
        cpu: dict[str, list[float]] = {name: [] for name in names}
        warm = 300
        for i in range(rounds + warm):
            shift = i % len(names)
            for name in names[shift:] + names[:shift]:
                fn = contenders[name]
                c0 = _tt()
                t0 = _pc()
                fn()
                t1 = _pc()
                c1 = _tt()
                if i >= warm:
                    wall[name].append(t1 - t0)
                    cpu[name].append(c1 - c0)
    return {
        name: {
            "wall_us": statistics.median(wall[name]) * 1e6,
            "cpu_us": statistics.median(cpu[name]) * 1e6,
        }
        for name in names
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", help="write every run's figures here")
    args = parser.parse_args(argv)
    runs: list[dict[str, Any]] = []
    with ExitStack() as stack:
        reference = [
            stack.enter_context(LocalWorker(worker_id=f"ref{i}", max_concurrent=256).start())
            for i in range(FLEET)
        ]
        fleets = {
            "instant": stack.enter_context(InstantWorkers(processes=FLEET)).urls,
            "reference": [worker.url for worker in reference],
        }
        for run in range(args.runs):
            print(f"run {run + 1} of {args.runs}: median µs, and ÷ the bare call's wall clock")
            figures: dict[str, Any] = {}
            for kind, urls in fleets.items():
                for size in (1, FLEET):
                    case = f"{kind}, {size} worker{'s' if size > 1 else ''}"
                    result = figures[case] = one_fleet(urls[:size], args.rounds)
                    bare = result["bare call"]["wall_us"]
                    print(f"  {case}:")
                    for name, f in result.items():
                        print(
                            f"    {name:14s} wall {f['wall_us']:6.1f}  CPU {f['cpu_us']:6.1f}"
                            f"  ÷ bare {f['wall_us'] / bare:.3f}"
                        )
            runs.append(figures)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
