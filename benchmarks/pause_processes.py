"""One worker of three pauses for a second under many processes: how soon it is used
again, and the p99 it costs, against least connections in the same run.

    python benchmarks/pause_processes.py /path/to/baseline .

Three reference workers answer in 25 ms with 12 parallel slots each (36 in all, for 32
callers: two workers alone queue). For each variant, ``PROCESSES`` processes of
``THREADS`` caller threads, each process with a pool of its own (as gunicorn workers
have), send tasks for ``WARM`` seconds, then worker ``w0`` is frozen (SIGSTOP) for
``PAUSE`` seconds and thawed, and tasks go on for ``AFTER`` more seconds. Variants, in
turn (``ROUNDS`` times, alternating): ``default`` in each tree given (latency-aware
choice, every setting at its default), and ``least-connections`` in the last tree
(``balancing.latency_aware: false``).

With ``--slow``, the steady case instead: ``w0`` answers in twice the others' time
(50 ms) for the whole run, no pause; reported per variant: ``w0``'s share and the p99
of the run after its warm-up, against least connections' in the same round. Latency-
aware choice should keep its advantage there, relaxing an estimate or not.

Reported per run: ``w0``'s share of the tasks sent in each second from the pause's end
(an equal share is 0.33), the first second after the pause in which its share is back
to half an equal share (0.17) or more, the p99 of the tasks sent in the ``AFTER``
seconds after the pause, the whole run's p50, and each run's p99 against least
connections' in the same round. Not run by pytest: it measures, it asserts nothing.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from benchmarks.sidebyside import launch, quantile, start_workers, tasks_of, workers_config

PROCESSES = 8
THREADS = 4
WARM = 4.0
PAUSE = 1.0
AFTER = 10.0
ROUNDS = 2
HALF_SHARE = 1 / 6


def one_run(tree: str, workers: list, balancing: dict[str, Any]) -> dict[str, Any]:  # type: ignore[type-arg]
    pause_at = time.monotonic() + WARM + 1.0  # a second for the processes to start
    resume_at = pause_at + PAUSE
    stop_at = resume_at + AFTER
    spec = {
        "config": workers_config(workers, balancing=balancing),
        "processes": PROCESSES,
        "threads": THREADS,
        "stop_at": stop_at,
        "report": bool(os.environ.get("NPU_SYNC_BENCH_REPORT")),
    }
    proc = launch(tree, spec)
    time.sleep(max(0.0, pause_at - time.monotonic()))
    workers[0].pause()
    time.sleep(max(0.0, resume_at - time.monotonic()))
    workers[0].resume()
    tasks = tasks_of(proc)
    shares = []
    for second in range(int(AFTER)):
        sent = [w for a, _, w in tasks if resume_at + second <= a < resume_at + second + 1]
        shares.append(sum(w == "w0" for w in sent) / max(1, len(sent)))
    back = next((i + 1 for i, share in enumerate(shares) if share >= HALF_SHARE), None)
    after = [b - a for a, b, _ in tasks if resume_at <= a < stop_at]
    return {
        "shares": shares,
        "back_within_s": back,
        "p99_after": quantile(after, 0.99),
        "p50_run": quantile([b - a for a, b, _ in tasks], 0.5),
        "failed": sum(w is None for _, _, w in tasks),
        "tasks": len(tasks),
    }


def slow_run(tree: str, workers: list, balancing: dict[str, Any]) -> dict[str, Any]:  # type: ignore[type-arg]
    """``w0`` twice as slow as the others all along: its share, and the p99 after WARM."""
    start = time.monotonic() + 1.0
    stop_at = start + WARM + AFTER
    spec = {
        "config": workers_config(workers, balancing=balancing),
        "processes": PROCESSES,
        "threads": THREADS,
        "stop_at": stop_at,
    }
    tasks = [t for t in tasks_of(launch(tree, spec)) if t[0] >= start + WARM]
    return {
        "share": sum(w == "w0" for _, _, w in tasks) / max(1, len(tasks)),
        "p99": quantile([b - a for a, b, _ in tasks], 0.99),
        "p50": quantile([b - a for a, b, _ in tasks], 0.5),
        "tasks": len(tasks),
    }


def main_slow(trees: list[str]) -> None:
    variants = [(tree, "default", {}) for tree in trees]
    variants.append((trees[-1], "least-connections", {"latency_aware": False}))
    workers = start_workers(3, latency_ms=25.0, slots=12)
    workers[0].control(latency_ms=50.0)
    try:
        for round_ in range(ROUNDS):
            runs = {}
            order = variants if round_ % 2 == 0 else list(reversed(variants))
            for tree, name, balancing in order:
                runs[(tree, name)] = slow_run(tree, workers, balancing)
                time.sleep(1.0)
            lc = runs[(trees[-1], "least-connections")]["p99"]
            for (tree, name), r in runs.items():
                print(
                    f"round {round_} {tree} {name}: w0 (2x slower) share {r['share']:.2f}; "
                    f"p99 {r['p99'] * 1000:.0f} ms ({r['p99'] / lc:.2f}x least connections'); "
                    f"p50 {r['p50'] * 1000:.0f} ms; {r['tasks']} tasks"
                )
    finally:
        for worker in workers:
            worker.stop()


def main(trees: list[str]) -> None:
    variants = [(tree, "default", {}) for tree in trees]
    variants.append((trees[-1], "least-connections", {"latency_aware": False}))
    workers = start_workers(3, latency_ms=25.0, slots=12)
    rounds: list[dict[tuple[str, str], dict[str, Any]]] = []
    try:
        for round_ in range(ROUNDS):
            runs = {}
            order = variants if round_ % 2 == 0 else list(reversed(variants))
            for tree, name, balancing in order:
                runs[(tree, name)] = one_run(tree, workers, balancing)
                time.sleep(1.0)
            rounds.append(runs)
    finally:
        for worker in workers:
            worker.stop()
    print("w0's share of the tasks sent in each second after the pause ends (equal: 0.33)")
    for round_, runs in enumerate(rounds):
        lc = runs[(trees[-1], "least-connections")]["p99_after"]
        for (tree, name), r in runs.items():
            shares = " ".join(f"{s:.2f}" for s in r["shares"])
            print(
                f"round {round_} {tree} {name}: back to half a share in the second "
                f"{r['back_within_s']}; p99 after {r['p99_after'] * 1000:.0f} ms "
                f"({r['p99_after'] / lc:.2f}x least connections'); run p50 "
                f"{r['p50_run'] * 1000:.0f} ms; {r['tasks']} tasks, {r['failed']} failed"
            )
            print(f"    shares: {shares}")


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--slow" in args:
        args.remove("--slow")
        main_slow(args or ["."])
    else:
        main(args or ["."])
