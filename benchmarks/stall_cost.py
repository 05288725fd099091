"""A frozen worker: how long tasks wait for it, in each source tree given, side by side.

    python benchmarks/stall_cost.py /path/to/baseline .

Three reference workers answer in 20 ms. For each tree, in turn (``ROUNDS`` times,
alternating), 16 caller threads send tasks through one pool with default settings
(only the workers are configured: ``timeouts.read`` 20 s, ``timeouts.task`` 25 s); after
``WARM`` seconds one worker is frozen with SIGSTOP for the rest of the run, tasks go on
being sent for ``FROZEN`` seconds, then every task sent is waited for and the worker is
thawed. Reported for the tasks in flight when it froze or sent while it was frozen:
the longest any took, its p99, how many took over 2 s, how many failed; and each
tree's longest wait against the first tree's. Not run by pytest: it measures, it asserts nothing.
"""

from __future__ import annotations

import sys
import time

from benchmarks.sidebyside import launch, quantile, start_workers, tasks_of, workers_config

WARM = 4.0
FROZEN = 8.0
THREADS = 16
ROUNDS = 2


def one_run(tree: str, workers: list, frozen) -> dict[str, float]:  # type: ignore[type-arg]
    freeze_at = time.monotonic() + WARM
    stop_at = freeze_at + FROZEN
    spec = {
        "config": workers_config(workers),
        "processes": 1,
        "threads": THREADS,
        "stop_at": stop_at,
    }
    proc = launch(tree, spec)
    time.sleep(max(0.0, freeze_at - time.monotonic()))
    frozen.pause()
    try:
        tasks = tasks_of(proc)
    finally:
        frozen.resume()
    # Every task the freeze could hold: in flight when it came, or sent during it.
    during = [(b - a, w) for a, b, w in tasks if b >= freeze_at and a < stop_at]
    waits = [d for d, _ in during]
    return {
        "tasks": len(during),
        "max_s": max(waits),
        "p99_s": quantile(waits, 0.99),
        "over_2s": sum(d > 2.0 for d in waits),
        "failed": sum(w is None for _, w in during),
    }


def main(trees: list[str]) -> None:
    workers = start_workers(3, latency_ms=20.0)
    results: dict[str, list[dict[str, float]]] = {tree: [] for tree in trees}
    try:
        for round_ in range(ROUNDS):
            order = trees if round_ % 2 == 0 else list(reversed(trees))
            for tree in order:
                results[tree].append(one_run(tree, workers, workers[0]))
                time.sleep(1.0)  # the thawed worker answers its backlog
    finally:
        for worker in workers:
            worker.stop()
    base = max(r["max_s"] for r in results[trees[0]])
    head = f"{'tasks':>6} {'max wait':>9} {'p99':>7} {'>2 s':>5} {'failed':>6} {'max/first':>9}"
    print(f"{'tree':<40} {head}")
    for tree in trees:
        for r in results[tree]:
            print(
                f"{tree:<40} {r['tasks']:>6} {r['max_s']:>8.2f}s {r['p99_s']:>6.2f}s "
                f"{r['over_2s']:>5} {r['failed']:>6} {r['max_s'] / base:>9.3f}"
            )


if __name__ == "__main__":
    main(sys.argv[1:] or ["."])
