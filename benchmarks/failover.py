"""A failover of the shared-state Redis under load from 8 processes, before and after.

Starts 1 primary, 1 replica and 3 sentinels (``redis-server --sentinel``) and two
reference workers on loopback; 8 processes each run a pool with
``shared_state`` and ``dead_letter: redis``, every 4th task with a deadline its
worker cannot meet (a dead letter whatever Redis does). After 2 s the primary is
failed over (``SENTINEL FAILOVER``) or SIGKILLed; ``--after`` seconds (12) after the
new primary is promoted (long enough for the sentinels to turn the old primary, when
alive, into a replica) the processes stop and a fresh one lists the dead letters::

    python benchmarks/failover.py [--runs 3] [--baseline /path/to/main] [--modes failover,kill]
                                  [--io-load 4]

``--baseline`` is a checkout whose ``npu_sync`` cannot speak to Sentinel: its
processes are given the primary's ``redis://`` URL (what a deployment could do) and
the listing is made on the new primary's. This tree's are given the
``redis+sentinel://`` URL. Per run it prints: dead letters TaskFailed named, those not
found by the listing (*lost*), tasks that failed though they should not have, the
outages of all processes together (*flips*), and the seconds from the promotion to
the last process's resumption. ``--io-load N`` runs N processes beside each run that
append to a file and ``fsync`` it without pause (a host whose disk is busy, as when
other processes commit SQLite or AOF writes): the load under which a process once
stayed subscribed to the old primary until it was demoted. Not run by pytest: it
measures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from npu_sync.worker_server import LocalWorker  # noqa: E402
from tests.integration.failover_run import run  # noqa: E402
from tests.integration.redis_topology import Sentinel  # noqa: E402


def fsync_loop(path: str, stop: multiprocessing.synchronize.Event) -> None:
    """Append 4 KiB and fsync, without pause, until ``stop`` is set."""
    block = os.urandom(4096)
    with open(path, "ab") as f:
        while not stop.is_set():
            f.write(block)
            f.flush()
            os.fsync(f.fileno())
            if f.tell() > 64 << 20:
                f.truncate(0)
                f.seek(0)


def one(mode: str, baseline: str | None, after: float, io_load: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as directory:
        stop = multiprocessing.Event()
        loaders = [
            multiprocessing.Process(
                target=fsync_loop, args=(os.path.join(directory, f"io{i}"), stop), daemon=True
            )
            for i in range(io_load)
        ]
        for loader in loaders:
            loader.start()
        try:
            return measure(directory, mode, baseline, after)
        finally:
            stop.set()
            for loader in loaders:
                loader.join()


def measure(directory: str, mode: str, baseline: str | None, after: float) -> dict[str, object]:
    topology = Sentinel(directory).start()
    workers = [
        LocalWorker(worker_id=f"w{i}", latency_ms=30, max_concurrent=64).start() for i in range(2)
    ]
    try:
        url = None if baseline is None else f"redis://127.0.0.1:{topology.primary_port()}/0"
        figures = run(topology, workers, directory, mode=mode, url=url, code=baseline, after=after)
    finally:
        for worker in workers:
            worker.stop()
        topology.stop()
    for reason in figures.unexpected:
        print(f"a task failed that should not have: {reason}", file=sys.stderr)
    if figures.unnamed:
        print(f"{figures.unnamed} TaskFailed named no dead letter", file=sys.stderr)
    return {
        "raised": figures.raised,
        "lost": figures.lost,
        "unexpected": len(figures.unexpected) + figures.unnamed,
        "flips": figures.flips,
        "resume": figures.resume,
        "still_down": figures.still_down,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--baseline", help="a checkout of main, run side by side")
    parser.add_argument("--modes", default="failover,kill")
    parser.add_argument(
        "--after", type=float, default=12.0, help="seconds of load after the promotion"
    )
    parser.add_argument(
        "--io-load", type=int, default=0, help="processes that fsync without pause beside"
    )
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        sys.exit("redis-server is not installed")
    print(f"load average {os.getloadavg()[0]:.1f}, {args.io_load} fsync loops beside")
    print(
        "| tree | failover | dead letters raised | lost | tasks failed wrongly | flips "
        "| resumed after (s) | still down |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    trees = ([("main", args.baseline)] if args.baseline else []) + [("this", None)]
    for _ in range(args.runs):
        for mode in args.modes.split(","):
            for name, code in trees:
                f = one(mode, code, args.after, args.io_load)
                resume = "never" if f["still_down"] else f"{f['resume']:.2f}"
                print(
                    f"| {name} | {mode} | {f['raised']} | {f['lost']} | {f['unexpected']} | "
                    f"{f['flips']} | {resume} | {f['still_down']} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
