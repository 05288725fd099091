"""Run every benchmark and, with ``--json PATH``, write all their figures to one file.

Usage, from anywhere in a clone::

    pip install -e '.[test,bench]'
    python benchmarks/run.py [--json out.json] [extra pytest arguments]

It runs ``pytest benchmarks -s -q`` (``-s`` prints each benchmark's table). With
``--json`` it also asks pytest-benchmark for its JSON (the figures the benchmarks keep
in ``extra_info``, and their timing statistics) and the comparison against the
alternatives for its own, then merges both into PATH:

``{"machine": ..., "benchmarks": [...], "alternatives": {...}}``

The exit status is pytest's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _benchmarks(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """pytest-benchmark's machine info and, per benchmark, its figures and timings."""
    if not path.exists():
        return {}, []
    data = json.loads(path.read_text())
    rows = [
        {
            "name": bench["fullname"],
            "extra_info": bench.get("extra_info", {}),
            "stats_s": {
                key: bench["stats"][key]
                for key in ("min", "median", "mean", "max", "stddev", "rounds")
                if key in bench["stats"]
            },
        }
        for bench in data.get("benchmarks", [])
    ]
    return data.get("machine_info", {}), rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--json", metavar="PATH", help="write every figure to PATH as JSON")
    args, pytest_args = parser.parse_known_args(argv)
    command = [sys.executable, "-m", "pytest", "benchmarks", "-s", "-q", *pytest_args]
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="npu-bench-") as scratch:
        benchmark_json = Path(scratch, "pytest-benchmark.json")
        alternatives_json = Path(scratch, "alternatives.json")
        if args.json:
            command.append(f"--benchmark-json={benchmark_json}")
            env["NPU_SYNC_BENCH_JSON"] = str(alternatives_json)
        print("running:", " ".join(command), flush=True)
        status = subprocess.run(command, cwd=ROOT, env=env, check=False).returncode
        if args.json:
            machine, rows = _benchmarks(benchmark_json)
            alternatives = (
                json.loads(alternatives_json.read_text()) if alternatives_json.exists() else None
            )
            document = {
                "pytest_exit_status": status,
                "machine": machine,
                "benchmarks": rows,
                "alternatives": alternatives,
            }
            out = Path(args.json)
            out.write_text(json.dumps(document, indent=2) + "\n")
            print(f"figures written to {out.resolve()}")
    return status


if __name__ == "__main__":
    sys.exit(main())
