"""What the configuration costs: ``import npu_sync`` and loading a typical file.

Runs each source tree given on the command line side by side, interleaved, so that two
versions (say a checkout of main and this tree) are measured in the same conditions::

    python benchmarks/config_cost.py /path/to/baseline .

Each tree is a directory holding the ``npu_sync`` package. Prints the median import
time (a fresh interpreter each run), the median time to load a typical configuration
file, and each tree's ratio to the first. Not run by pytest: it measures, it asserts
nothing.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import textwrap

IMPORT_RUNS = 21
LOAD_RUNS = 7

TYPICAL = textwrap.dedent(
    """\
    npu_workers:
      workers:
        - {id: vm2-npu, host: 172.16.168.22, port: 8081, priority: 1, max_concurrent: 8}
        - {id: vm3-npu, host: 172.16.168.23, port: 8081, priority: 1, max_concurrent: 8}
        - id: windows-npu
          url: https://172.16.168.20:8082
          priority: 2
          headers: {Authorization: "Bearer ${NPU_TOKEN:-t}"}
          tls: {verify: false}
      health: {interval: 30, timeout: 2, unhealthy_threshold: 2, healthy_threshold: 1}
      circuit_breaker: {fail_max: 5, reset_timeout: 60, max_reset_timeout: 600}
      retry: {max_retries: 3, backoff_initial: 0.05, backoff_max: 2.0}
      timeouts: {connect: 2, read: 20, task: 25}
      dead_letter: {backend: sqlite, path: npu_dead_letters.sqlite3}
      transport: {client: builtin, idle_timeout: 4}
      pool: {threads: 32, max_queue_wait: 10}
      reload: {max_removed_share: 0.5}
    """
)

# Loads the file many times in one interpreter: the median of LOAD_RUNS batches of 200.
LOAD_SNIPPET = """
import sys, time, tempfile, os
from npu_sync.config import load_config
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "npu_workers.yaml")
    with open(path, "w") as f:
        f.write(sys.stdin.read())
    load_config(path)
    start = time.perf_counter()
    for _ in range(200):
        load_config(path)
    print((time.perf_counter() - start) / 200)
"""


def _run(tree: str, code: str, stdin: str = "") -> float:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), PYTHONDONTWRITEBYTECODE="")
    done = subprocess.run(
        [sys.executable, "-c", code],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return float(done.stdout.strip())


def main(trees: list[str]) -> None:
    imports: dict[str, list[float]] = {tree: [] for tree in trees}
    loads: dict[str, list[float]] = {tree: [] for tree in trees}
    timed_import = (
        "import time; s = time.perf_counter(); import npu_sync; print(time.perf_counter() - s)"
    )
    for tree in trees:  # warm the bytecode caches before anything is timed
        _run(tree, timed_import)
    for _ in range(IMPORT_RUNS):
        for tree in trees:
            imports[tree].append(_run(tree, timed_import))
    for _ in range(LOAD_RUNS):
        for tree in trees:
            loads[tree].append(_run(tree, LOAD_SNIPPET, TYPICAL))
    base_import = statistics.median(imports[trees[0]])
    base_load = statistics.median(loads[trees[0]])
    print(f"{'tree':40} {'import npu_sync':>16} {'ratio':>6} {'load typical':>13} {'ratio':>6}")
    for tree in trees:
        imp = statistics.median(imports[tree])
        load = statistics.median(loads[tree])
        print(
            f"{tree[-40:]:40} {imp * 1000:13.1f} ms {imp / base_import:6.2f} "
            f"{load * 1e6:10.0f} us {load / base_load:6.2f}"
        )


if __name__ == "__main__":
    main(sys.argv[1:] or ["."])
