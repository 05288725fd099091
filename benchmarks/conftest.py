"""Fixtures for the benchmarks: real reference workers in child processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from npu_sync.worker_server import LocalWorker


@pytest.fixture(scope="module")
def fast_worker() -> Iterator[LocalWorker]:
    """One reference worker answering at once (latency 0), in its own process."""
    with LocalWorker(worker_id="bench", max_concurrent=256).start() as worker:
        yield worker


def report(title: str, rows: list[tuple[str, ...]]) -> None:
    """Print a small aligned table (shown with -s, and in the benchmark's extra_info)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"\n{title}")
    for row in rows:
        print("  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
