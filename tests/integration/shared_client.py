"""One process of the shared-state tests: a pool from a YAML, driven over stdin/stdout.

Prints "ready" once warmed up, runs its tasks when it reads a line, then prints one
JSON line: attempts per worker, tasks succeeded and failed.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import threading

from npu_sync import TaskFailed, WorkerPool
from npu_sync.events import AttemptFinished


def main() -> None:
    config, tasks, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    attempts: dict[str, int] = {}
    counting = threading.Event()
    lock = threading.Lock()

    def hook(event: object) -> None:
        if counting.is_set() and isinstance(event, AttemptFinished):
            with lock:
                attempts[event.worker_id] = attempts.get(event.worker_id, 0) + 1

    with WorkerPool.from_yaml(config, watch=False, hooks=[hook]) as pool:
        for i in range(10):
            pool.execute({"input_text": f"warm {i}"})
        print("ready", flush=True)
        sys.stdin.readline()
        counting.set()
        outcomes = {"succeeded": 0, "failed": 0}

        def one(i: int) -> None:
            try:
                pool.execute({"input_text": f"task {i}"})
                key = "succeeded"
            except TaskFailed:
                key = "failed"
            with lock:
                outcomes[key] += 1

        with concurrent.futures.ThreadPoolExecutor(threads) as callers:
            list(callers.map(one, range(tasks)))
        shared = pool.stats()["shared_state"]
    print(json.dumps({"attempts": attempts, **outcomes, "shared": shared}), flush=True)


if __name__ == "__main__":
    main()
