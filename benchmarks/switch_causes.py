"""Why the callers' threads were switched out: ``perf script`` output, classified.

    perf record -q -e sched:sched_switch -g -o switches.data \\
        python benchmarks/callers_cpu.py --child '{"url": "http://127.0.0.1:8081",
        "threads": 128, "tasks": 6000, "warm": 600, "profile": false, "slots": 512,
        "bare": false}'
    perf script -i switches.data | python benchmarks/switch_causes.py --tasks 6600

Each switch of a ``python`` thread is counted by its state (``S``: it went to sleep,
a voluntary switch; ``R``: it was preempted, an involuntary one), the kernel function
it slept in (``tcp_recvmsg_locked``: waiting for the answer; ``futex_do_wait``: a lock
or condition) and the first C library function on its stack, which tells a Python
lock or the GIL's condition (``__futex_abstimed_wait_common``: a timed wait, the GIL's
or a ``threading`` lock's), the GIL's own mutex (``__GI___lll_lock_wait``), or a
wake-up that let the woken thread preempt the waker (``pthread_cond_signal``,
``__GI___lll_lock_wake``, ``sem_post`` in state ``R``). Per task with ``--tasks``
(the measured tasks and the warm-up ones). Needs no npu_sync: it reads text.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from collections.abc import Iterable

_KERNEL = re.compile(r"futex|recv|send|poll|select|nanosleep|wait4|exit_to|irqentry|connect")
_HEADER = re.compile(r"^(\S+)\s+\d+\s+\[\d+\].*sched:sched_switch:.*prev_state=(\S+)")


def classify(lines: Iterable[str]) -> collections.Counter[tuple[str, str, str]]:
    """(state, kernel function, C library function) of each switch of a python thread."""
    counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
    current: list[str] | None = None

    def close() -> None:
        if current is not None:
            counts[(current[0], current[1] or "?", current[2] or "?")] += 1

    for line in lines:
        header = _HEADER.match(line)
        if header:
            close()
            current = [header.group(2), "", ""] if header.group(1) == "python" else None
            continue
        if current is None:
            continue
        parts = line.split()
        if len(parts) < 3:
            continue
        function = parts[1].split("+", 1)[0]
        if "kallsyms" in line and not current[1] and _KERNEL.search(function):
            current[1] = function
        elif ("libc.so" in line or "libpthread" in line) and not current[2]:
            current[2] = function
    close()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=0, help="divide the counts by this")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    counts = classify(sys.stdin)
    total = sum(counts.values())
    per = args.tasks or 1
    print(f"{total} switches, {total / per:.2f} per task" if args.tasks else f"{total} switches")
    for (state, kernel, libc), n in counts.most_common(args.top):
        print(f"{n / per:8.2f}  {state:2} {kernel:28} {libc}")


if __name__ == "__main__":
    main()
