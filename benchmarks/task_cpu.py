"""The pool's own work per task in CPU time and in interpreter steps, two trees.

    python benchmarks/task_cpu.py <old tree> <new tree> [rounds]

``task_cost.py`` times wall clock, which a machine shared with other work blurs by
more than the few per cent a refactoring may cost. This one runs, alternately in a
fresh interpreter per tree, a one-worker pool on a transport that answers at once and
reports the best of 7 batches of 10,000 tasks in CPU time (``time.process_time``),
then counts, once per tree, the Python calls and bytecode instructions one task takes
(``sys.setprofile`` / opcode tracing): figures that do not depend on the machine at
all. Printed: each tree's median CPU time over the rounds, the ratio new/old, and the
counts.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent(
    """
    import collections, gc, json, sys, time
    sys.path.insert(0, sys.argv[1])
    from npu_sync import WorkerPool
    from npu_sync.config import HealthConfig, PoolConfig, worker_config
    from npu_sync.transport import Response

    ANSWER = Response(200, {"content-type": "application/json"}, b'{"ok":true}')

    class Instant:
        cancellable = False
        def request(self, method, path, *, body=None, headers=None, timeout, **options):
            return ANSWER
        def close(self):
            pass

    config = PoolConfig(
        workers=(worker_config("w", "http://127.0.0.1:9", max_concurrent=8),),
        health=HealthConfig(enabled=False),
    )
    payload = {"model_id": "default", "input_text": "x"}
    with WorkerPool(config, transport_factory=lambda *a, **k: Instant()) as pool:
        for _ in range(3000):
            pool.execute(payload)
        if sys.argv[2] == "count":
            calls = collections.Counter()
            def profile(frame, event, arg):
                calls[event] += 1
            sys.setprofile(profile)
            pool.execute(payload)
            sys.setprofile(None)
            ops = [0]
            def trace(frame, event, arg):
                frame.f_trace_opcodes = True
                if event == "opcode":
                    ops[0] += 1
                return trace
            sys.settrace(trace)
            pool.execute(payload)
            sys.settrace(None)
            print(json.dumps({"python calls": calls["call"], "opcodes": ops[0]}))
        else:
            best = []
            for _ in range(7):
                gc.collect()
                t0 = time.process_time()
                for _ in range(10000):
                    pool.execute(payload)
                best.append((time.process_time() - t0) / 10000 * 1e6)
            print(json.dumps(min(best)))
    """
)


def _run(tree: str, what: str) -> object:
    args = [sys.executable, "-c", _CHILD, tree, what]
    return json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    trees = argv[:2]
    rounds = int(argv[2]) if len(argv) > 2 else 7
    cpu: dict[str, list[float]] = {tree: [] for tree in trees}
    for n in range(rounds):
        for tree in trees if n % 2 == 0 else trees[::-1]:
            value = _run(tree, "time")
            assert isinstance(value, float)
            cpu[tree].append(value)
    old, new = (statistics.median(cpu[tree]) for tree in trees)
    print(f"CPU per task: old {old:.2f} µs, new {new:.2f} µs, new/old {new / old:.3f}")
    for label, tree in zip(("old", "new"), trees, strict=True):
        print(f"  {label} rounds: " + " ".join(f"{v:.2f}" for v in cpu[tree]))
    for label, tree in zip(("old", "new"), trees, strict=True):
        print(f"  {label} per task: {_run(tree, 'count')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
