"""A user's script type-checked with ``mypy --strict`` against this package: misspelt
stats() keys, a scope that does not exist and wrong arguments to decorated tasks are
reported; correct code passes, indexing both scopes of stats() without a cast."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import npu_sync

pytest.importorskip("mypy", reason="mypy is not installed: the typing test needs it")

HEADER = """\
from npu_sync import PoolStatsDict, WorkerPool, WorkerRow, npu_task
from npu_sync.config import PoolConfig, worker_config

pool = WorkerPool(PoolConfig(workers=(worker_config("a", "http://127.0.0.1:8081"),)))


@npu_task(pool)
def summarize(text: str, *, max_words: int = 50) -> dict[str, object]:
    return {"input_text": text, "max_words": max_words}


class Service:
    @npu_task(pool)
    def classify(self, label: str) -> dict[str, object]:
        return {"label": label}

"""

GOOD = """
stats: PoolStatsDict = pool.stats()
rows: list[WorkerRow] = pool.workers()
submitted: int = stats["tasks"]["submitted"]
p99: float | None = rows[0]["latency"]["p99_ms"]
backend: str = stats["shared_state"]["backend"]
print(submitted, p99, backend, summarize("hello", max_words=3))
print(Service().classify("x"), Service().classify.submit("y").result())
local_active: int = pool.stats(scope="local")["tasks"]["active"]
fleet = pool.stats(scope="fleet")
processes: int = fleet["totals"]["processes"]
fleet_submitted: int = fleet["totals"]["tasks"]["submitted"]
this_pool: int = pool.stats("fleet")["local"]["tasks"]["in_flight"]
print(local_active, processes, fleet_submitted, this_pool, fleet["note"])
"""

BAD = """
print(pool.stats()["taks"])
print(summarize(42))
print(Service().classify(7))
print(pool.stats(scope="fleet")["tasks"])
print(pool.stats(scope="flet"))
print(pool.stats(scope="local")["totals"])
"""


def run_mypy(tmp_path: Path, *scripts: str) -> str:
    env = dict(os.environ)
    root = Path(npu_sync.__file__).resolve().parent.parent
    # Check the package this test imports (a source tree), not another installed copy.
    if (root / "pyproject.toml").exists():
        env["MYPYPATH"] = str(root)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-color-output",
            "--no-error-summary",
            "--cache-dir",
            str(tmp_path / ".mypy_cache"),
            *scripts,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode in (0, 1), result.stderr
    return result.stdout


def test_mypy_strict_reports_a_misspelt_stats_key_and_a_wrong_task_argument(tmp_path):
    """mypy --strict flags pool.stats()["taks"], a local key on the fleet's stats (and the
    reverse), an unknown scope and wrong argument types to decorated functions and
    methods, and finds nothing wrong in the correct script."""
    (tmp_path / "good.py").write_text(HEADER + GOOD)
    (tmp_path / "bad.py").write_text(HEADER + BAD)
    out = run_mypy(tmp_path, "good.py", "bad.py")
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert not [e for e in errors if not e.startswith("bad.py:")], out
    offset = HEADER.count("\n") + 1
    by_line = {int(re.match(r"bad\.py:(\d+):", e)[1]) - offset: e for e in errors}
    assert sorted(by_line) == [1, 2, 3, 4, 5, 6], out
    assert '"taks"' in by_line[1] and "[typeddict-item]" in by_line[1]
    assert '"int"' in by_line[2] and '"str"' in by_line[2] and "[arg-type]" in by_line[2]
    assert '"int"' in by_line[3] and '"str"' in by_line[3] and "[arg-type]" in by_line[3]
    # Each scope has its own shape: no union to narrow, so no cast in correct code.
    assert '"FleetStatsDict"' in by_line[4] and '"tasks"' in by_line[4], out
    assert "[typeddict-item]" in by_line[4]
    assert "[call-overload]" in by_line[5], out
    assert '"PoolStatsDict"' in by_line[6] and '"totals"' in by_line[6], out
    assert "[typeddict-item]" in by_line[6]
