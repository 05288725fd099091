"""Fixtures for the benchmarks: real reference workers in child processes."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import pytest

from benchmarks.instant_worker import InstantWorkers
from npu_sync.worker_server import LocalWorker

FLEET = 10  # workers in the fleets below


def pytest_configure(config: pytest.Config) -> None:
    # The project's pytest settings run tests on every core (pytest-xdist); a benchmark
    # measures timings, so it runs alone in one process whatever the settings say.
    if hasattr(config.option, "numprocesses"):
        config.option.numprocesses = 0
        config.option.dist = "no"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--json",
        metavar="PATH",
        default=None,
        help="write the alternatives benchmark's figures to PATH as JSON",
    )


@pytest.fixture(scope="module")
def fast_worker() -> Iterator[LocalWorker]:
    """One reference worker answering at once (latency 0), in its own process."""
    with LocalWorker(worker_id="bench", max_concurrent=256).start() as worker:
        yield worker


@pytest.fixture(scope="module")
def instant_fleet() -> Iterator[list[str]]:
    """The URLs of FLEET workers that answer at once (benchmarks/instant_worker.py),
    one process each."""
    with InstantWorkers(processes=FLEET) as workers:
        yield workers.urls


@pytest.fixture(scope="module")
def reference_fleet() -> Iterator[list[str]]:
    """The URLs of FLEET reference workers (latency 0), one process each."""
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(LocalWorker(worker_id=f"ref{i}", max_concurrent=256).start()).url
            for i in range(FLEET)
        ]


def report(title: str, rows: list[tuple[str, ...]]) -> None:
    """Print a small aligned table (shown with -s, and in the benchmark's extra_info)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"\n{title}")
    for row in rows:
        print("  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))


def interleave(
    contenders: dict[str, Callable[[], object]],
    rounds: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Time each contender once per round, rotating who goes first.

    Interleaving call by call makes machine noise hit every contender alike; the
    rotation removes any advantage of a fixed position in the round. ``clock``:
    ``time.thread_time`` gives the calling thread's CPU time instead of wall clock.
    """
    names = list(contenders)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            fn = contenders[name]
            t0 = clock()
            fn()
            samples[name].append(clock() - t0)
    return samples


def summarise(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Median and p99 in µs per contender."""
    return {
        name: {
            "median_us": statistics.median(values) * 1e6,
            "p99_us": statistics.quantiles(values, n=100)[98] * 1e6,
        }
        for name, values in samples.items()
    }
