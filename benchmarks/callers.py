"""Callers for the side-by-side benchmarks (``stall_cost.py``, ``pause_processes.py``):
run in a child interpreter whose ``PYTHONPATH`` is the source tree under test.

``python benchmarks/callers.py SPEC`` reads a JSON spec (the workers' URLs, the pool's
configuration as a YAML-shaped mapping, how many processes and threads, until when),
forks ``processes`` processes of ``threads`` callers each, every process with a pool of
its own (as gunicorn workers have), and prints one JSON list of tasks: ``[start, end,
worker_id or null]`` on the machine's monotonic clock, which every process shares.
Workers must answer ``{"worker_id": ...}`` (the reference worker does).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import threading
import time
from typing import Any

PAYLOAD = {"model_id": "default", "input_text": "hello"}


def _process(spec: dict[str, Any], out: Any) -> None:
    from npu_sync import WorkerPool
    from npu_sync.config import parse_config

    config = parse_config({"npu_workers": spec["config"]})
    stop_at = spec["stop_at"]
    tasks: list[list[Any]] = []
    lock = threading.Lock()
    with WorkerPool(config) as pool:

        def caller() -> None:
            mine = []
            while (start := time.monotonic()) < stop_at:
                try:
                    wid = pool.execute(PAYLOAD)["worker_id"]
                except Exception:
                    wid = None
                mine.append([start, time.monotonic(), wid])
            with lock:
                tasks.extend(mine)

        threads = [threading.Thread(target=caller) for _ in range(spec["threads"])]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if spec.get("report"):
            for row in pool.workers():
                breaker, done = row["breaker"], row["tasks"]
                print(
                    f"pid {os.getpid()} {row['id']}: breaker {breaker['state']} trips "
                    f"{breaker['trips']}, succeeded {done['succeeded']} failed {done['failed']}"
                    f" latency {row.get('latency')} in flight {row['in_flight']}"
                    f" last error {row['last_error']!r}",
                    file=sys.stderr,
                )
    out.put(tasks)


def main(spec: dict[str, Any]) -> None:
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_process, args=(spec, out)) for _ in range(spec["processes"])]
    for proc in procs:
        proc.start()
    tasks: list[list[Any]] = []
    for _ in procs:
        tasks.extend(out.get())
    for proc in procs:
        proc.join()
    json.dump(tasks, sys.stdout)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
