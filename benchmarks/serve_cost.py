"""How long a release holds the pool's lock with a long queue of several classes, two
trees side by side.

    python benchmarks/serve_cost.py <old tree> <new tree> [rounds]

When a slot frees, the dispatcher hands it to a waiting task under the pool's lock
(``Dispatcher._serve``); every waiter woken at once (a breaker trips, a health round, a
reload) runs the same pass. This measures one pass with ``n`` tasks waiting on three
workers of 8 slots, ``interactive`` reserving 0.1 (3 slots):

* ``full``: every slot taken, the queue a mix of the three classes: nobody can be served;
* ``reserved``: 21 slots taken, the queue all ``batch``: the 3 free slots are kept for
  ``interactive``, nobody can be served;
* ``one freed``: 23 slots taken, the queue a mix: one task is served.

Each in a fresh interpreter per tree (alternating which goes first), best of 200
passes; printed: each tree's median over the rounds in microseconds and new/old, and
each tree's pass against its own one-class (FIFO) queue of the same length.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent(
    """
    import json, sys, time
    sys.path.insert(0, sys.argv[1])
    from npu_sync._admission import Dispatcher, _Waiter
    from npu_sync._breaker import WorkerBreaker
    from npu_sync.config import BreakerConfig, ClassConfig, PriorityConfig, worker_config
    from npu_sync._balancing.selector import Selector
    from npu_sync.testing import FakeClock
    from npu_sync._worker import Worker

    class NoTransport:
        def request(self, *a, **k):
            raise AssertionError
        def close(self):
            pass

    CLASSES = PriorityConfig(
        classes=(ClassConfig("interactive", 0.1), ClassConfig("standard"), ClassConfig("batch")),
        default="standard",
        aging=10.0,
    )
    NAMES = ("interactive", "standard", "batch")

    def dispatcher(taken, n, names):
        clock = FakeClock()
        d = Dispatcher(clock, Selector())
        workers = []
        for i in range(3):
            cfg = worker_config(f"w{i}", "http://127.0.0.1:9", max_concurrent=8)
            breaker = WorkerBreaker(f"w{i}", BreakerConfig(), clock=clock)
            workers.append(Worker(cfg, NoTransport(), breaker, NoTransport()))
        d.set_workers(workers)
        leases = [d.acquire((), clock.monotonic() + 1e6) for _ in range(taken)]
        assert all(leases)
        with d.lock:
            d.set_classes_locked(CLASSES)
        for i in range(n):
            name = names(i)
            d._waiters.append(_Waiter((), 1e12, d.lock, name, clock.monotonic()))
            if name is not None:
                d._named += 1
        return d, clock

    def best_pass(d, clock, undo=False):
        best = 1e9
        for _ in range(200):
            waiters = list(d._waiters)
            named = d._named
            with d.lock:
                t0 = time.perf_counter()
                d._serve(clock.monotonic())
                took = time.perf_counter() - t0
                if undo:  # give the slot back and put the served task back in the queue
                    for w in waiters:
                        if w.lease is not None:
                            d._give_back(w.lease.worker, w.lease.trial)
                            w.lease, w.queued = None, True
                    d._waiters.clear()
                    d._waiters.extend(waiters)
                    d._named = named
            best = min(best, took)
        return best * 1e6

    n = int(sys.argv[2])
    mixed = lambda i: NAMES[i % 3]
    fifo = lambda i: None
    out = {
        "full": best_pass(*dispatcher(24, n, mixed)),
        "full, one class": best_pass(*dispatcher(24, n, fifo)),
        "reserved": best_pass(*dispatcher(21, n, lambda i: "batch")),
        "one freed": best_pass(*dispatcher(23, n, mixed), undo=True),
        "one freed, one class": best_pass(*dispatcher(23, n, fifo), undo=True),
    }
    print(json.dumps(out))
    """
)


def _run(tree: str, n: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, tree, str(n)], capture_output=True, text=True, check=True
    )
    result: dict[str, float] = json.loads(out.stdout)
    return result


def main() -> None:
    old, new = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    for n in (100, 2000):
        runs: dict[str, list[dict[str, float]]] = {old: [], new: []}
        for r in range(rounds):
            for tree in (old, new) if r % 2 == 0 else (new, old):
                runs[tree].append(_run(tree, n))
        med = {
            tree: {k: statistics.median(run[k] for run in runs[tree]) for k in runs[tree][0]}
            for tree in (old, new)
        }
        print(f"\n{n} tasks waiting: one pass under the lock, best of 200, median of {rounds}")
        print(f"{'queue':<22}{'old us':>10}{'new us':>10}{'new/old':>10}")
        for key in med[old]:
            o, w = med[old][key], med[new][key]
            print(f"{key:<22}{o:>10.1f}{w:>10.1f}{w / o:>10.3f}")
        for tree, name in ((old, "old"), (new, "new")):
            m = med[tree]
            print(
                f"{name}: full / one class {m['full'] / m['full, one class']:.1f}x, "
                f"one freed / one class {m['one freed'] / m['one freed, one class']:.1f}x"
            )


if __name__ == "__main__":
    main()
