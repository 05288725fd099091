"""Where the test suite's time goes: wall and CPU per test, the CPU of the processes it
starts included.

As a pytest plugin, from the clone's root (it works under pytest-xdist too):

    python -m pytest -q -p tools.test_cost

writes one ``.test_cost/<pid>.tsv`` per test process; then

    python tools/test_cost.py [--top 25]

sums them per file and lists the costliest tests. CPU counts this process's own time
and that of every child it reaped during the test (reference workers, CLIs, gunicorn).
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

OUT = Path(".test_cost")
_rows: list[tuple[float, float, float, str]] = []


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    own, children = _cpu()
    started = time.monotonic()
    yield
    own2, children2 = _cpu()
    _rows.append((time.monotonic() - started, own2 - own, children2 - children, item.nodeid))


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not _rows:
        return
    OUT.mkdir(exist_ok=True)
    with open(OUT / f"{os.getpid()}.tsv", "w") as out:
        for wall, own, children, nodeid in _rows:
            out.write(f"{wall:.3f}\t{own:.3f}\t{children:.3f}\t{nodeid}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description="Sum .test_cost/*.tsv per file and test.")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    tests: list[tuple[float, float, str]] = []
    for path in OUT.glob("*.tsv"):
        for line in path.read_text().splitlines():
            wall, own, children, nodeid = line.split("\t", 3)
            tests.append((float(wall), float(own) + float(children), nodeid))
    if not tests:
        raise SystemExit("no .test_cost/*.tsv: run pytest with -p tools.test_cost first")
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for wall, cpu, nodeid in tests:
        files[nodeid.split("::")[0]][0] += wall
        files[nodeid.split("::")[0]][1] += cpu
    total_wall = sum(t[0] for t in tests)
    total_cpu = sum(t[1] for t in tests)
    print(f"{len(tests)} tests: {total_wall:.0f} s of test time, {total_cpu:.0f} s of CPU")
    print(f"\nfiles by CPU (top {args.top}):  wall s   cpu s")
    for name, (wall, cpu) in sorted(files.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"  {name:60} {wall:7.1f} {cpu:7.1f}")
    print(f"\ntests by wall time (top {args.top}):  wall s   cpu s")
    for wall, cpu, nodeid in sorted(tests, reverse=True)[: args.top]:
        print(f"  {nodeid[:90]:90} {wall:6.2f} {cpu:6.2f}")
    top = sorted(tests, reverse=True)[:60]
    print(f"\nthe 60 slowest tests: {100 * sum(t[0] for t in top) / total_wall:.0f} % of test time")


if __name__ == "__main__":
    main()
