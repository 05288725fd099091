"""Placement under shifting popularity: tasks/s and p99 with placement on, against
load-on-demand only (``models.placement`` without ``models.balance``) and a static
assignment (no loads at all).

Six models with skewed popularity (weights 40/25/15/10/6/4 %) whose ranking rotates
by two places every phase (``--phase``, 30 s), over four reference workers capped at
2 models each (``--max-models``), each serving ``--slots`` tasks at once (4; the rest
queue) at ``--latency-ms`` a task (100 ms), each load taking ``--load-delay-ms``
(1.5 s). Each mode has fresh worker processes and ``--threads`` callers (32) in a
closed loop. Where the models start is what each user would have:

- **static** and **placement**: the assignment an operator made by hand (w0 m0+m1,
  w1 m2+m3, w2 m4+m5, w3 m0+m1): every model held somewhere;
- **on-demand** (``models.placement`` without ``models.balance``): nothing loaded;
  each model is loaded by the first task that names it, on the least-loaded worker,
  and stays there (load-on-demand never unloads, so a full worker refuses a further
  load: 507, the task rejected).

::

    python -m benchmarks.placement_bench                   # 4 phases of 30 s per mode
    python -m benchmarks.placement_bench --phase 10        # a quick run

Prints, per mode, successful tasks per second, p50/p99 of successful tasks, tasks
rejected or failed, and the loads and unloads the pool made; and each mode's
throughput as a ratio to the static assignment's. Not run by pytest: it measures, it
asserts nothing.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from typing import Any

from npu_sync import Task, TaskFailed, TaskRejected, WorkerPool
from npu_sync.config import (
    HealthConfig,
    ModelPolicy,
    ModelsConfig,
    PoolConfig,
    RetryConfig,
    TimeoutConfig,
    worker_config,
)
from npu_sync.worker_server import LocalWorker

MODELS = [f"m{i}" for i in range(6)]
WEIGHTS = [0.40, 0.25, 0.15, 0.10, 0.06, 0.04]
START = [("m0", "m1"), ("m2", "m3"), ("m4", "m5"), ("m0", "m1")]


def popularity(phase: int) -> list[float]:
    """The weights of m0..m5 in ``phase``: the ranking rotated by two per phase."""
    shift = (2 * phase) % len(MODELS)
    weights = [0.0] * len(MODELS)
    for rank, weight in enumerate(WEIGHTS):
        weights[(rank + shift) % len(MODELS)] = weight
    return weights


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    workers = [
        LocalWorker(
            worker_id=f"w{i}",
            models=() if mode == "on-demand" else START[i],
            max_models=2,
            load_delay_ms=args.load_delay_ms,
            latency_ms=args.latency_ms,
            jitter_ms=args.latency_ms / 4,
            slots=args.slots,  # an NPU serves a few tasks at once; the rest queue
        ).start()
        for i in range(4)
    ]
    try:
        models = {
            "static": ModelsConfig(placement=False),
            "on-demand": ModelsConfig(placement=True),
            "placement": ModelsConfig(
                placement=True,
                balance=True,
                interval=args.interval,
                hold=args.hold,
                idle=args.idle,
                loads_per_round=2,
                catalog={m: ModelPolicy(args.min_replicas, None) for m in MODELS},
            ),
        }[mode]
        config = PoolConfig(
            workers=tuple(
                worker_config(f"w{i}", w.url, max_concurrent=args.slots, max_models=2)
                for i, w in enumerate(workers)
            ),
            health=HealthConfig(interval=2.0, timeout=2.0),
            retry=RetryConfig(max_retries=2, backoff_initial=0.01, backoff_max=0.1),
            timeouts=TimeoutConfig(read=10.0, task=10.0),
            models=models,
        )
        latencies: list[float] = []
        outcomes = {"ok": 0, "rejected": 0, "failed": 0}
        lock = threading.Lock()
        phase_box = [0]
        stop = threading.Event()
        with WorkerPool(config) as pool:
            pool.check_health()

            def caller(seed: int) -> None:
                rng = random.Random(seed)
                while not stop.is_set():
                    model = rng.choices(MODELS, popularity(phase_box[0]))[0]
                    t0 = time.perf_counter()
                    try:
                        pool.execute(Task({"model_id": model, "input_text": "x"}))
                        kind = "ok"
                    except TaskRejected:
                        kind = "rejected"
                    except TaskFailed:
                        kind = "failed"
                    took = time.perf_counter() - t0
                    with lock:
                        outcomes[kind] += 1
                        if kind == "ok":
                            latencies.append(took)

            threads = [
                threading.Thread(target=caller, args=(i,), name=f"bench-{i}")
                for i in range(args.threads)
            ]
            start = time.perf_counter()
            for thread in threads:
                thread.start()
            for phase in range(args.phases):
                phase_box[0] = phase
                stop.wait(args.phase)
            stop.set()
            for thread in threads:
                thread.join()
            elapsed = time.perf_counter() - start
            stats = pool.stats()["models"]
        latencies.sort()
        return {
            "mode": mode,
            "tasks_per_s": outcomes["ok"] / elapsed,
            "p50_ms": statistics.median(latencies) * 1000 if latencies else None,
            "p99_ms": latencies[int(0.99 * (len(latencies) - 1))] * 1000 if latencies else None,
            "rejected": outcomes["rejected"],
            "failed": outcomes["failed"],
            # The placer counts every load it makes, for a waiting task too; without
            # it, a task's loads are the pool's placements.
            "pool_loads": stats["loads"] if stats["balance"] else stats["placements"],
            "pool_unloads": stats["unloads"] + stats["evictions"],
            "load_failures": stats["load_failures"] + stats["placement_failures"],
        }
    finally:
        for worker in workers:
            worker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", type=float, default=30.0, help="seconds per phase")
    parser.add_argument("--phases", type=int, default=4)
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--load-delay-ms", type=float, default=1500.0)
    parser.add_argument("--latency-ms", type=float, default=100.0)
    parser.add_argument("--slots", type=int, default=4, help="tasks a worker serves at once")
    parser.add_argument("--interval", type=float, default=2.0, help="placement rounds")
    parser.add_argument("--hold", type=float, default=20.0)
    parser.add_argument("--idle", type=float, default=20.0)
    parser.add_argument(
        "--min-replicas",
        type=int,
        default=1,
        help="placement: each model's replicas.min (1: none is ever unloaded entirely)",
    )
    parser.add_argument("--modes", default="static,on-demand,placement")
    args = parser.parse_args()
    results = [run_mode(mode, args) for mode in args.modes.split(",")]
    base = next((r["tasks_per_s"] for r in results if r["mode"] == "static"), None)
    print(
        f"{'mode':10} {'tasks/s':>8} {'vs static':>9} {'p50 ms':>7} {'p99 ms':>8} "
        f"{'rejected':>8} {'failed':>6} {'loads':>5} {'unloads':>7}"
    )
    for r in results:
        ratio = f"{r['tasks_per_s'] / base:.2f}" if base else "-"
        p50 = "-" if r["p50_ms"] is None else f"{r['p50_ms']:.0f}"
        p99 = "-" if r["p99_ms"] is None else f"{r['p99_ms']:.0f}"
        print(
            f"{r['mode']:10} {r['tasks_per_s']:8.1f} {ratio:>9} {p50:>7} {p99:>8} "
            f"{r['rejected']:8d} {r['failed']:6d} {r['pool_loads']:5d} {r['pool_unloads']:7d}"
        )


if __name__ == "__main__":
    main()
