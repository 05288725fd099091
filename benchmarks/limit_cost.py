"""What one answer costs a worker's hill-climbing limit, two trees side by side.

    python benchmarks/limit_cost.py <old tree> <new tree> [rounds]

The pool calls ``HillClimbingLimit.on_sample`` under its lock for every answer of a
worker with ``balancing.concurrency_limit: hill-climbing``. Each round runs, in a fresh
interpreter per tree (alternating which goes first), the same 200,000 answers of a
simulated worker of 8 slots at 20 ms kept full by more callers than the limit (recorded
once in a closed loop, then replayed into a fresh limit, which takes the same path since
the limit is deterministic), and reports the best of 5 replays in nanoseconds per call.
Printed: each tree's median over the rounds and the ratio new/old. A tree before the
limits moved to ``npu_sync._balancing.limits`` is read from ``npu_sync.limits``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent(
    """
    import gc, heapq, json, random, sys, time
    sys.path.insert(0, sys.argv[1])
    try:
        from npu_sync._balancing.limits import HillClimbingLimit
    except ImportError:
        from npu_sync.limits import HillClimbingLimit

    rng = random.Random(1)
    limit = HillClimbingLimit(64)
    now, free_at, in_flight, answers = 0.0, [0.0] * 8, [], []

    def start():
        slot = min(range(8), key=free_at.__getitem__)
        free_at[slot] = max(now, free_at[slot]) + 0.02 * rng.uniform(0.95, 1.05)
        heapq.heappush(in_flight, (free_at[slot], now, len(in_flight) + 1))

    for _ in range(limit.current):
        start()
    for _ in range(200_000):
        ends, started, level = heapq.heappop(in_flight)
        now = ends
        answers.append((ends - started, level))
        limit.on_sample(ends - started, level, False)
        while len(in_flight) < limit.current:
            start()
    best = []
    for _ in range(5):
        on_sample = HillClimbingLimit(64).on_sample
        gc.collect()
        t0 = time.perf_counter()
        for rtt, level in answers:
            on_sample(rtt, level, False)
        best.append((time.perf_counter() - t0) / len(answers) * 1e9)
    print(json.dumps(min(best)))
    """
)


def _run(tree: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, tree], check=True, capture_output=True, text=True
    ).stdout
    return float(json.loads(out))


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    old, new = argv[0], argv[1]
    rounds = int(argv[2]) if len(argv) > 2 else 5
    olds: list[float] = []
    news: list[float] = []
    for i in range(rounds):
        order = [(old, olds), (new, news)] if i % 2 == 0 else [(new, news), (old, olds)]
        for tree, into in order:
            into.append(_run(tree))
    o, n = statistics.median(olds), statistics.median(news)
    print(f"HillClimbingLimit.on_sample: old {o:.0f} ns, new {n:.0f} ns, new/old {n / o:.3f}")
    print("  old rounds: " + " ".join(f"{v:.0f}" for v in olds))
    print("  new rounds: " + " ".join(f"{v:.0f}" for v in news))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
