"""What capabilities and tags cost the choice of a worker.

One task's selection, end to end but without I/O: build the ``Task``, make its
``TaskRun`` (``Stack.begin``: its context), ``wait_for_worker()`` (``Fit`` then
``Admit``) for a lease, and give the lease back (``record``). Runs each source tree
given on the command line in its own interpreter, interleaved, so that two versions (a
checkout of main and this tree) are measured in the same conditions::

    python benchmarks/capability_cost.py /path/to/baseline .

For every tree it measures a task that needs nothing; for trees that know
``Task(requires=...)`` also a task requiring a capability half the workers have, and
one preferring a tag a third of them have. Prints the best of several rounds (each
the best of five batches), in microseconds, and each case's ratio to the first tree's
task that needs nothing. Not run by pytest: it measures, it asserts nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys

ROUNDS = 9

SNIPPET = r"""
import sys, time, json
from npu_sync import Task, WorkerPool
from npu_sync.config import HealthConfig, PoolConfig, worker_config
from npu_sync._retry import Kind, Outcome
try:
    from npu_sync.taskrun import TaskRun, record
except ImportError:  # a tree where the task's life is a stack of steps (npu_sync._life)
    from npu_sync._life import record
    TaskRun = None
from npu_sync.testing import FakeNetwork

N, CALLS = 10, 20000
extra = {}
def worker(i):
    try:
        return worker_config(f"w{i}", f"http://127.0.0.1:{2000 + i}",
                             capabilities=("llm", "vision") if i % 2 else ("llm",),
                             tags={"location": "lab" if i % 3 == 0 else "dc"})
    except TypeError:  # a tree before capabilities
        return worker_config(f"w{i}", f"http://127.0.0.1:{2000 + i}")
config = PoolConfig(workers=tuple(worker(i) for i in range(N)), health=HealthConfig(enabled=False))
pool = WorkerPool(config, transport_factory=FakeNetwork().factory)
runner, state = pool._runner, pool._state
ok = Outcome(Kind.SUCCESS, {})
body = b"{}"
if TaskRun is not None:
    def wait_for_worker(task):
        return TaskRun(runner, task, body, time.monotonic() + 60).wait_for_worker()
else:
    stack = runner.stack()
    fit, admit = stack.steps[1], next(s for s in stack.steps if type(s).__name__ == "Admit")
    def leased(ctx):
        return admit(ctx, lambda ctx, at: at.lease)
    def wait_for_worker(task):
        return fit(stack.begin(task, body, time.monotonic() + 60, None, None), leased)
def case(kw):
    clock = time.perf_counter
    best = []
    for _ in range(5):
        t0 = clock()
        for _ in range(CALLS):
            task = Task({"x": 1}, **kw)
            lease = wait_for_worker(task)
            record(state, lease, ok, 0.0, 0.0, retry=False)
        best.append((clock() - t0) / CALLS)
    return min(best)
out = {"none": case({})}
try:
    Task({}, requires={"vision"})
except TypeError:
    pass
else:
    out["requires"] = case({"requires": {"vision"}})
    out["prefers"] = case({"prefers": {"location=lab"}})
pool.close()
import npu_sync
assert npu_sync.__file__.startswith(sys.argv[1] if len(sys.argv) > 1 else ""), npu_sync.__file__
print(json.dumps(out))
"""


def _once(tree: str) -> dict[str, float]:
    tree = os.path.abspath(tree)
    env = {**os.environ, "PYTHONPATH": tree}
    # Run from the tree itself: ``-c`` puts the working directory first on the path.
    done = subprocess.run(
        [sys.executable, "-c", SNIPPET, tree],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    )
    import json

    result: dict[str, float] = json.loads(done.stdout)
    return result


def main(trees: list[str]) -> None:
    runs: dict[str, list[dict[str, float]]] = {tree: [] for tree in trees}
    for _ in range(ROUNDS):
        for tree in trees:
            runs[tree].append(_once(tree))
    base = min(r["none"] for r in runs[trees[0]])
    print(f"{'tree':40} {'case':9} {'µs/task':>8} {'ratio':>6}")
    for tree in trees:
        for case in ("none", "requires", "prefers"):
            values = [r[case] for r in runs[tree] if case in r]
            if not values:
                continue
            best = min(values)  # best of the rounds: other load on the machine only adds
            print(f"{tree:40} {case:9} {best * 1e6:8.2f} {best / base:6.2f}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["."])
