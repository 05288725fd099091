"""Selection latency of two trees side by side: ``benchmarks/test_selection.py`` of each.

    python benchmarks/selection_side_by_side.py <old tree> <new tree> [rounds]

Each round runs the selection benchmarks once per tree, in a fresh interpreter, the
trees alternating (old first in odd rounds, new first in even ones), with the
benchmark file of each tree. Printed per case: each tree's median over the rounds of
the selection p50 (the ``p50_us`` of 10,000-20,000 leases) and of the benchmark's own
median (a lease acquired and its outcome recorded), the ratio new/old, and the
geometric mean of the ratios.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile


def _run(tree: str, out: str) -> dict[str, tuple[float, float]]:
    env = {**os.environ, "PYTHONPATH": tree}
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
         "benchmarks/test_selection.py", "--benchmark-only", f"--benchmark-json={out}"],
        cwd=tree, env=env, check=True, capture_output=True,
    )  # fmt: skip
    with open(out) as f:
        found = json.load(f)["benchmarks"]
    return {
        b["name"]: (b["extra_info"].get("p50_us", float("nan")), b["stats"]["median"] * 1e6)
        for b in found
    }


def main() -> None:
    old, new = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    runs: dict[str, list[dict[str, tuple[float, float]]]] = {old: [], new: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for tree in (old, new) if r % 2 == 0 else (new, old):
                runs[tree].append(_run(tree, os.path.join(tmp, f"{r}-{len(runs[tree])}.json")))
    for column, label in ((0, "selection p50 µs"), (1, "lease + record, median µs")):
        ratios = []
        print(f"\n{label:48s} {'old':>8s} {'new':>8s} {'new/old':>8s}")
        for name in sorted(runs[old][0]):
            a = statistics.median(run[name][column] for run in runs[old])
            b = statistics.median(run[name][column] for run in runs[new])
            if a == a and b == b:  # not NaN: the case reports this column
                ratios.append(b / a)
                print(f"{name:48s} {a:8.2f} {b:8.2f} {b / a:8.3f}")
        print(f"{'geometric mean of the ratios':48s} {'':8s} {'':8s} "
              f"{statistics.geometric_mean(ratios):8.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
