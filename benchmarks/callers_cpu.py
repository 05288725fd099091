"""Client CPU and context switches per task as callers grow, in each source tree given,
side by side.

    python benchmarks/callers_cpu.py /path/to/baseline . [--threads 1,8,128] [--rounds 5]

One reference worker answering at once (latency 0) runs in a child process, so its CPU
is not counted. For each round, each thread count and each tree in turn (interleaved,
so that noise from other work on the machine hits every tree alike), a fresh child
interpreter whose ``PYTHONPATH`` is the tree builds a one-worker pool with room for
every caller (``max_concurrent`` 512: no task ever queues), warms it up, then runs
``TASKS`` tasks on that many caller threads and prints the process's CPU
(``time.process_time()``) and context switches (``getrusage(RUSAGE_SELF)``, every
thread's, voluntary and involuntary) per task. With 1 caller, CPU is the calling
thread's. The figures are the median round per tree, and each tree's against the first
tree's. Not run by pytest: it measures, it asserts nothing.

``--profile`` adds, per tree, what the callers were doing when sampled from a thread
of the child every millisecond (``sys._current_frames()``): the innermost npu_sync
frame of each caller, counted.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from npu_sync.worker_server import LocalWorker

TASKS = 6000
WARM = 600


def child(spec: dict[str, Any]) -> None:
    """Runs in the tree's interpreter: one measured batch, one JSON line out."""
    import collections
    import itertools
    import resource
    import threading
    import time

    from npu_sync import WorkerPool
    from npu_sync.config import parse_config

    payload = {"model_id": "default", "input_text": "hello"}
    config = parse_config(
        {
            "npu_workers": {
                "workers": [{"id": "w0", "url": spec["url"], "max_concurrent": spec["slots"]}],
                "health": {"enabled": False},
                # A worker process on a shared machine with 128 connections may leave
                # one silent for a second: not what is measured here.
                "retry": {"stall": {"enabled": False}},
            }
        }
    )
    threads, tasks = spec["threads"], spec["tasks"]

    def switches() -> int:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_nvcsw + usage.ru_nivcsw

    samples: collections.Counter[str] = collections.Counter()
    errors: collections.Counter[str] = collections.Counter()
    locks: collections.Counter[str] = collections.Counter()
    if spec["locks"]:
        _count_locks(locks)
    with WorkerPool(config) as pool:
        call = _bare_call(spec["url"]) if spec["bare"] else (lambda: pool.execute(payload))
        for _ in range(spec["warm"]):
            call()
        locks.clear()
        if threads == 1:
            s0, c0 = switches(), time.thread_time()
            for _ in range(tasks):
                call()
            cpu, sw = time.thread_time() - c0, switches() - s0
        else:
            claim = itertools.count()
            start = threading.Barrier(threads + 1)
            done = threading.Event()
            idents: set[int] = set()

            def loop() -> None:
                idents.add(threading.get_ident())
                start.wait()
                while next(claim) < tasks:
                    try:
                        call()
                    except Exception as exc:  # counted: a run with failures is void
                        errors[type(exc).__name__ + ": " + str(exc)[:200]] += 1

            def sample() -> None:
                while not done.wait(0.001):
                    for ident, frame in sys._current_frames().items():
                        if ident not in idents:
                            continue
                        f: Any = frame
                        where = None
                        while f is not None:
                            name = f.f_code.co_filename
                            if "npu_sync" in name:
                                where = f"{os.path.basename(name)}:{f.f_lineno} {f.f_code.co_name}"
                                break
                            f = f.f_back
                        samples[
                            where
                            or f"{os.path.basename(frame.f_code.co_filename)}:"
                            f"{frame.f_lineno} {frame.f_code.co_name}"
                        ] += 1

            callers = [threading.Thread(target=loop) for _ in range(threads)]
            for t in callers:
                t.start()
            sampler = threading.Thread(target=sample) if spec["profile"] else None
            s0, c0 = switches(), time.process_time()
            start.wait()
            if sampler is not None:
                sampler.start()
            for t in callers:
                t.join()
            cpu, sw = time.process_time() - c0, switches() - s0
            done.set()
            if sampler is not None:
                sampler.join()
    print(
        json.dumps(
            {
                "cpu_us": cpu / tasks * 1e6,
                "switches": sw / tasks,
                "profile": samples.most_common(25),
                "errors": errors.most_common(5),
                "locks": {k: v / tasks for k, v in locks.most_common(12)},
            }
        )
    )


def _count_locks(counts: Any) -> None:
    """Make every ``threading.Lock`` created from now on count its acquisitions
    (``acquired``), those that found it taken (``blocked``), and where those were."""
    import threading

    allocate = threading.Lock

    class CountingLock:
        def __init__(self) -> None:
            self._lock = allocate()

        def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
            counts["acquired"] += 1
            if self._lock.acquire(False):
                return True
            if not blocking:
                return False
            counts["blocked"] += 1
            frame = sys._getframe(1)
            if frame.f_code.co_name == "__enter__" and frame.f_back is not None:
                frame = frame.f_back
            where = os.path.basename(frame.f_code.co_filename)
            counts[f"blocked at {where}:{frame.f_lineno} {frame.f_code.co_name}"] += 1
            return self._lock.acquire(True, timeout)

        def release(self) -> None:
            self._lock.release()

        def locked(self) -> bool:
            return self._lock.locked()

        def __enter__(self) -> bool:
            return self.acquire()

        def __exit__(self, *exc: object) -> None:
            self._lock.release()

    threading.Lock = CountingLock  # type: ignore[misc,assignment]


def _bare_call(url: str) -> Any:
    """The floor: the built-in transport alone, the same request, the answer decoded."""
    from npu_sync.config import TLSConfig, worker_config
    from npu_sync.transport import BuiltinTransport

    transport = BuiltinTransport(
        worker_config("w0", url), tls=TLSConfig(), max_response_bytes=1 << 24, maxsize=512
    )
    headers = {"Content-Type": "application/json", "X-NPU-Task-Id": "0" * 32}
    body = json.dumps({"model_id": "default", "input_text": "hello"}).encode()

    def call() -> Any:
        response = transport.request(
            "POST", "/inference", body=body, headers=headers, timeout=30.0, connect_timeout=2.0
        )
        return json.loads(response.body)

    return call


def run(
    tree: str, url: str, threads: int, profile: bool, slots: int, bare: bool, locks: bool
) -> dict[str, Any]:
    spec = {
        "url": url,
        "threads": threads,
        "tasks": TASKS,
        "warm": WARM,
        "profile": profile,
        "slots": slots,
        "bare": bare,
        "locks": locks,
    }
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
        env=env,
        cwd=os.path.abspath(tree),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    if result["errors"]:
        print(f"{tree}, {threads} callers: failed tasks {result['errors']}", file=sys.stderr)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trees", nargs="*")
    parser.add_argument("--threads", default="1,8,128")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--bare", action="store_true", help="the built-in transport alone, no pool (the floor)"
    )
    parser.add_argument(
        "--locks", action="store_true", help="count lock acquisitions per task, and blocked ones"
    )
    parser.add_argument("--slots", type=int, default=512, help="the worker's max_concurrent")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    counts = [int(n) for n in args.threads.split(",")]
    figures: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with LocalWorker(worker_id="w0", max_concurrent=512).start() as worker:
        for _ in range(args.rounds):
            for n in counts:
                for tree in args.trees:
                    figures.setdefault((tree, n), []).append(
                        run(tree, worker.url, n, args.profile, args.slots, args.bare, args.locks)
                    )
    base = args.trees[0]
    print("tree | callers | CPU µs/task median (range) | vs first | switches/task median (range)")
    for n in counts:
        for tree in args.trees:
            rows = figures[(tree, n)]
            cpu = [r["cpu_us"] for r in rows]
            sw = [r["switches"] for r in rows]
            ratios = [
                r["cpu_us"] / b["cpu_us"] for r, b in zip(rows, figures[(base, n)], strict=True)
            ]
            print(
                f"{tree} | {n} | {statistics.median(cpu):.0f} ({min(cpu):.0f}-{max(cpu):.0f}) | "
                f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
                f"{statistics.median(sw):.1f} ({min(sw):.1f}-{max(sw):.1f})"
            )
    # Growth within a round (the same minute of the machine's load): CPU per task at
    # each caller count over the next smaller count's, per tree.
    for tree in args.trees:
        for small, large in itertools.pairwise(counts):
            growth = [
                b["cpu_us"] / a["cpu_us"]
                for a, b in zip(figures[(tree, small)], figures[(tree, large)], strict=True)
            ]
            print(
                f"{tree}: CPU at {large} callers ÷ at {small}, per round: median "
                f"{statistics.median(growth):.2f} ({min(growth):.2f}-{max(growth):.2f}); "
                + ", ".join(f"{g:.2f}" for g in growth)
            )
    if args.locks:
        for tree in args.trees:
            for n in counts:
                rounds = figures[(tree, n)]
                keys = sorted({k for r in rounds for k in r["locks"]})
                print(f"\n{tree}, {n} callers: lock acquisitions per task (per round)")
                for key in keys:
                    values = ", ".join(f"{r['locks'].get(key, 0):.3f}" for r in rounds)
                    print(f"  {key}: {values}")
    if args.profile:
        for tree in args.trees:
            for n in counts:
                if n == 1:
                    continue
                merged: dict[str, int] = {}
                for r in figures[(tree, n)]:
                    for where, count in r["profile"]:
                        merged[where] = merged.get(where, 0) + count
                total = sum(merged.values()) or 1
                print(f"\n{tree}, {n} callers: where callers were sampled")
                for where, count in sorted(merged.items(), key=lambda kv: -kv[1])[:20]:
                    print(f"  {count / total:6.1%}  {where}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
