"""Shared breakers across 16 processes, two trees side by side: how long a worker that
fails one task in five is kept out, how many half-open trials a down worker gets per
reset period, and how long a frozen worker's trials hold the fleet.

Usage, from a clone, with the tree to compare against checked out beside it::

    git worktree add /tmp/before main
    python benchmarks/shared_breakers.py --before /tmp/before --after . --alone

(``--alone`` adds a third run of ``--after`` without shared state, each process on its
own.) About 75 s per run on two cores.

Each side starts its own redis-server and reference workers, then 16 processes (each
one pool, one thread sending tasks without pause) importing ``npu_sync`` from that
tree. Two scenarios, each ``--seconds`` long:

- ``flaky``: w0 fails 20 % of tasks at random (``--failure-rate 0.2``), w1 is sound.
  Reported: the share of the time w0's breaker is not closed, per process (mean), and
  in all 16 processes at once.
- ``down``: w0 fails every task. Reported: the attempts w0 got until every process had
  it open (what finding a dead worker costs the fleet), then trials per reset period.
- ``frozen`` (``--frozen``, ``--seconds`` + 10 s): w0 answers until every process has
  learnt its latency, then is frozen (SIGSTOP); each process sends idempotent tasks
  until it has w0 open, then idempotent and non-idempotent tasks in turn, so that
  either kind may meet w0's trial (``timeouts.read`` 20 s). Reported, from the moment
  w0 was open in every process: trials per reset period, the longest trial, the
  longest task, non-idempotent tasks sent to the frozen w0 and tasks failed.

Timings are ratios and counts of one run; the machine's load moves them a little.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PROCESSES = 16
FAIL_MAX = 5
RESET = 1.0


# -- one process of the fleet -----------------------------------------------------------


def client(config: str, seconds: float, mixed: bool) -> None:
    """Run tasks for ``seconds`` after reading ``go``; print what w0's breaker and
    attempts did, as one JSON line. With ``mixed`` (the frozen scenario): a few tasks to
    learn w0's latency before ``ready``, then idempotent tasks until w0 opens here, then
    idempotent and non-idempotent ones in turn."""
    from npu_sync import Task, TaskFailed, WorkerPool
    from npu_sync.events import AttemptFinished, BreakerStateChanged

    lock = threading.Lock()
    changes: list[tuple[float, str]] = []
    attempts: list[tuple[float, float, str, str, str]] = []
    once: set[str] = set()  # ids of the non-idempotent tasks
    spans: list[tuple[float, float, bool, bool]] = []  # start, end, once, failed
    opened = threading.Event()

    def hook(event: object) -> None:
        if isinstance(event, BreakerStateChanged) and event.worker_id == "w0":
            with lock:
                changes.append((event.at, event.new))
            if event.new == "open":
                opened.set()
        elif isinstance(event, AttemptFinished) and event.worker_id == "w0":
            with lock:
                attempts.append(
                    (
                        event.at - event.duration,
                        event.at,
                        event.outcome,
                        event.task_id,
                        event.error or "",
                    )
                )

    with WorkerPool.from_yaml(config, watch=False, hooks=[hook]) as pool:
        if mixed:
            for _ in range(20):
                pool.execute({"input_text": "warm"})
        outages = pool.stats()["shared_state"].get("outages", 0)
        print("ready", flush=True)
        sys.stdin.readline()
        start = time.time()
        until = time.monotonic() + seconds
        tasks = failed = 0
        while time.monotonic() < until:
            tasks += 1
            kind_once = mixed and opened.is_set() and tasks % 2 == 0
            task = Task({"input_text": "bench"}, idempotent=not kind_once)
            if kind_once:
                once.add(task.task_id)
            began = time.time()
            try:
                pool.execute(task)
                lost = False
            except TaskFailed:
                failed += 1
                lost = True
            spans.append((began, time.time(), kind_once, lost))
        end = time.time()
        outages = pool.stats()["shared_state"].get("outages", 0) - outages
    with lock:
        print(
            json.dumps(
                {
                    "start": start,
                    "end": end,
                    "tasks": tasks,
                    "failed": failed,
                    "outages": outages,
                    "changes": changes,
                    "attempts": [
                        (a, b, outcome, task_id in once, error)
                        for a, b, outcome, task_id, error in attempts
                    ],
                    "spans": spans if mixed else [],
                }
            ),
            flush=True,
        )


# -- the driver -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(directory: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
         "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", directory],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start") from None
            threading.Event().wait(0.02)
    return proc, f"redis://127.0.0.1:{port}/0"


def out_fractions(results: list[dict[str, Any]]) -> tuple[float, float]:
    """(mean share of the run w0 was not closed in a process, share it was not closed in
    every process at once), over the window all processes were running."""
    begin = max(r["start"] for r in results)
    finish = min(r["end"] for r in results)
    step = 0.002
    samples = max(1, int((finish - begin) / step))
    per_process = []
    timelines = []
    for r in results:
        changes = sorted(r["changes"])
        out = []
        state, i = "closed", 0
        for k in range(samples):
            t = begin + k * step
            while i < len(changes) and changes[i][0] <= t:
                state = changes[i][1]
                i += 1
            out.append(state != "closed")
        timelines.append(out)
        per_process.append(sum(out) / samples)
    everywhere = sum(all(t[k] for t in timelines) for k in range(samples)) / samples
    return sum(per_process) / len(per_process), everywhere


def down_figures(results: list[dict[str, Any]]) -> tuple[int, float, int]:
    """(attempts on w0 until it was open in every process; then the trials of each reset
    period, mean and most): attempts starting within half a reset timeout of a period's
    first trial belong to that period."""
    opened = [min((at for at, new in r["changes"] if new == "open"), default=None) for r in results]
    if any(t is None for t in opened):
        return -1, float("nan"), -1
    all_open = max(t for t in opened if t is not None)
    attempts = sorted(a for r in results for a in r["attempts"])
    finding = sum(1 for a in attempts if a[0] < all_open)
    periods: list[int] = []
    first = -1.0
    for start, _, _ in (a for a in attempts if a[0] >= all_open):
        if periods and start - first < RESET / 2:
            periods[-1] += 1
        else:
            periods.append(1)
            first = start
    if not periods:
        return finding, 0.0, 0
    return finding, sum(periods) / len(periods), max(periods)


def frozen_figures(results: list[dict[str, Any]]) -> dict[str, Any]:
    """What w0's trials cost once it was open in every process: trials per reset period
    (all, mean, most), the longest trial and the longest task (seconds), the non-idempotent
    tasks sent to w0 (a trial that was its health check sent none) and tasks failed."""
    opened = [min((at for at, new in r["changes"] if new == "open"), default=None) for r in results]
    if any(t is None for t in opened):
        return {}
    all_open = max(t for t in opened if t is not None)
    trials = sorted(a for r in results for a in r["attempts"] if a[0] >= all_open)
    periods: list[int] = []
    first = -1.0
    for start, *_ in trials:
        if periods and start - first < RESET / 2:
            periods[-1] += 1
        else:
            periods.append(1)
            first = start
    spans = [s for r in results for s in r["spans"] if s[0] >= all_open]
    return {
        "trials": len(trials),
        "per_period": sum(periods) / len(periods) if periods else 0.0,
        "most": max(periods, default=0),
        "longest_trial": max((b - a for a, b, *_ in trials), default=0.0),
        "longest_task": max((b - a for a, b, *_ in spans), default=0.0),
        "once_sent": sum(1 for t in trials if t[3] and "health check" not in t[4]),
        "failed": sum(1 for s in spans if s[3]),
        "tasks": len(spans),
    }


def run_side(
    tree: Path, scenario: str, seconds: float, work: str, *, shared: bool = True
) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    sys.path.insert(0, str(tree.resolve()))
    from npu_sync.worker_server import LocalWorker

    redis_proc, url = start_redis(work)
    rate = {"flaky": 0.2, "down": 1.0}.get(scenario, 0.0)
    w0 = LocalWorker(worker_id="w0", latency_ms=10, failure_rate=rate).start()
    w1 = LocalWorker(worker_id="w1", latency_ms=10).start()
    procs: list[subprocess.Popen[str]] = []
    try:
        config = Path(work) / f"{scenario}.yaml"
        config.write_text(
            "npu_workers:\n  workers:\n"
            f"    - {{id: w0, url: '{w0.url}', priority: 1}}\n"
            f"    - {{id: w1, url: '{w1.url}', priority: 2}}\n"
            "  health: {enabled: false}\n"
            f"  circuit_breaker: {{fail_max: {FAIL_MAX}, reset_timeout: {RESET}, "
            f"max_reset_timeout: {RESET}}}\n"
            "  retry: {max_retries: 2, backoff_initial: 0.01, backoff_max: 0.02}\n"
            "  balancing: {latency_aware: false}\n"
            "  timeouts: {read: 20, task: 25}\n"
            # A timeout the loaded machine keeps to, so that the figures are the rules'
            # and not Redis outages (which are counted, and should be 0).
            + (
                f"  shared_state: {{backend: redis, url: '{url}', sync_interval: 1.0, "
                "timeout: 0.5}\n"
                if shared
                else ""
            )
        )
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "client",
                    str(config),
                    str(seconds),
                    str(scenario == "frozen"),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for _ in range(PROCESSES)
        ]
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        if scenario == "frozen":
            w0.pause()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            assert p.stdout is not None
            results.append(json.loads(p.stdout.readline()))
        return results
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
            p.wait(60)
            if p.stdout is not None:
                p.stdout.close()
        w0.stop()
        w1.stop()
        redis_proc.kill()
        redis_proc.wait()
        sys.path.remove(str(tree.resolve()))
        for name in [m for m in sys.modules if m == "npu_sync" or m.startswith("npu_sync.")]:
            del sys.modules[name]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        client(sys.argv[2], float(sys.argv[3]), sys.argv[4] == "True")
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the tree to compare with")
    parser.add_argument("--after", type=Path, default=Path("."), help="this tree (default .)")
    parser.add_argument("--seconds", type=float, default=10.0, help="per scenario and side")
    parser.add_argument(
        "--alone", action="store_true", help="also run --after without shared state"
    )
    parser.add_argument(
        "--frozen", action="store_true", help="run only the frozen scenario, both trees"
    )
    args = parser.parse_args()
    rows = []
    sides = (("before", args.before, True), ("after", args.after, True))
    if args.alone:
        sides += (("alone", args.after, False),)
    if args.frozen:
        frozen_rows = []
        for label, tree, shared in sides:
            with tempfile.TemporaryDirectory() as work:
                frozen = run_side(tree, "frozen", args.seconds + 10, work, shared=shared)
            frozen_rows.append((label, frozen_figures(frozen)))
        print(f"\n{PROCESSES} processes, w0 frozen, reset_timeout {RESET} s, read 20 s")
        print(
            f"{'':8} {'trials':>7} {'trials/period':>14} {'most':>5} {'longest trial (s)':>18} "
            f"{'longest task (s)':>17} {'non-idempotent sent to w0':>26} {'tasks failed':>13}"
        )
        for label, f in frozen_rows:
            if not f:
                print(f"{label:8} w0 was not open in every process")
                continue
            print(
                f"{label:8} {f['trials']:>7} {f['per_period']:>14.2f} {f['most']:>5} "
                f"{f['longest_trial']:>18.2f} {f['longest_task']:>17.2f} "
                f"{f['once_sent']:>26} {f['failed']:>8} of {f['tasks']}"
            )
        return
    for label, tree, shared in sides:
        with tempfile.TemporaryDirectory() as work:
            flaky = run_side(tree, "flaky", args.seconds, work, shared=shared)
            down = run_side(tree, "down", args.seconds, work, shared=shared)
        mean_out, all_out = out_fractions(flaky)
        finding, per_period, most = down_figures(down)
        failed = sum(r["failed"] for r in flaky + down)
        outages = sum(r["outages"] for r in flaky + down)
        rows.append((label, mean_out, all_out, finding, per_period, most, failed, outages))
    print(f"\n{PROCESSES} processes, fail_max {FAIL_MAX}, reset_timeout {RESET} s, "
          f"{args.seconds:.0f} s per scenario")  # fmt: skip
    print(
        f"{'':8} {'20% errors: out, mean':>22} {'out in all 16':>14} "
        f"{'dead: attempts to open':>23} {'trials/period':>14} {'most':>5} "
        f"{'tasks failed':>13} {'Redis outages':>14}"
    )
    for label, mean_out, all_out, finding, per_period, most, failed, outages in rows:
        print(
            f"{label:8} {mean_out:>22.1%} {all_out:>14.1%} {finding:>23} "
            f"{per_period:>14.2f} {most:>5} {failed:>13} {outages:>14}"
        )


if __name__ == "__main__":
    main()
