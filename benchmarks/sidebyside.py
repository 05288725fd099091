"""What ``stall_cost.py`` and ``pause_processes.py`` share: reference workers, running
callers in a source tree's interpreter, and reading their tasks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from npu_sync.worker_server import LocalWorker

CALLERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "callers.py")


def start_workers(n: int, **behaviour: Any) -> list[LocalWorker]:
    return [LocalWorker(worker_id=f"w{i}", **behaviour).start() for i in range(n)]


def workers_config(workers: Sequence[LocalWorker], **sections: Any) -> dict[str, Any]:
    """A YAML-shaped configuration: the workers, and whatever else the run sets."""
    return {"workers": [{"id": w.worker_id, "url": w.url} for w in workers], **sections}


def launch(tree: str, spec: dict[str, Any]) -> subprocess.Popen[str]:
    """Start the callers in ``tree``'s interpreter (its ``npu_sync``); see callers.py."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    return subprocess.Popen(
        [sys.executable, CALLERS, json.dumps(spec)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=os.path.abspath(tree),
    )


def tasks_of(proc: subprocess.Popen[str]) -> list[tuple[float, float, str | None]]:
    out, _ = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"callers exited with {proc.returncode}")
    return [(a, b, w) for a, b, w in json.loads(out)]


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
