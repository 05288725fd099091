"""Keep the machine busy while something else runs: N processes spinning on the CPU.

Used to prove the test suite does not depend on a quiet machine:

    python tools/busy.py --per-core 2 -- python -m pytest -q

runs the command with two busy processes per core beside it, and stops them when the
command ends (or after ``--limit`` seconds, whichever comes first). Exits with the
command's own code.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import subprocess
import sys
import time


def spin(limit: float) -> None:
    end = time.monotonic() + limit
    n = 0
    while time.monotonic() < end:
        for _ in range(100_000):
            n += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-core", type=int, default=2, help="busy processes per core")
    parser.add_argument("--limit", type=float, default=1800.0, help="seconds at most")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give a command to run after --")
    count = args.per_core * (os.cpu_count() or 1)
    busy = [multiprocessing.Process(target=spin, args=(args.limit,)) for _ in range(count)]
    for process in busy:
        process.start()
    print(f"busy.py: {count} busy processes beside: {' '.join(command)}", file=sys.stderr)
    try:
        return subprocess.call(command)
    finally:
        for process in busy:
            if process.pid is not None:
                os.kill(process.pid, signal.SIGKILL)
            process.join()


if __name__ == "__main__":
    sys.exit(main())
