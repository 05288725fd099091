"""One process of the shared-breaker tests: a pool from a YAML, driven line by line.

Prints ``ready`` once the pool is built, then answers each command on stdin with one
JSON line:

- ``run N PREFIX``: N tasks one after another, inputs ``PREFIX0``, ``PREFIX1`` ...;
- ``loop SECONDS [once]``: tasks from two threads, without pause, for that long
  (with ``once``, non-idempotent tasks);
- ``state WORKER``: that worker's breaker state here;
- ``attempts``: every attempt since the last asked, ``[worker, start, end, outcome]``
  in wall-clock seconds;
- ``stats``: ``stats()["shared_state"]``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

from npu_sync import Task, TaskFailed, WorkerPool
from npu_sync.events import AttemptFinished


def work(
    pool: WorkerPool, lock: threading.Lock, done: dict[str, int], until: float, once: bool
) -> None:
    """Tasks without pause until ``until`` (monotonic), counted into ``done``; with
    ``once``, non-idempotent ones."""
    while time.monotonic() < until:
        try:
            pool.execute(Task({"input_text": "loop"}, idempotent=not once))
            key = "succeeded"
        except TaskFailed:
            key = "failed"
        with lock:
            done[key] += 1


def main() -> None:
    lock = threading.Lock()
    attempts: list[list[Any]] = []

    def hook(event: object) -> None:
        if isinstance(event, AttemptFinished):
            with lock:
                attempts.append(
                    [event.worker_id, event.at - event.duration, event.at, event.outcome]
                )

    with WorkerPool.from_yaml(sys.argv[1], watch=False, hooks=[hook]) as pool:
        print("ready", flush=True)
        for line in sys.stdin:
            command, *args = line.split()
            answer: Any
            if command == "run":
                done = {"succeeded": 0, "failed": 0}
                for i in range(int(args[0])):
                    try:
                        pool.execute({"input_text": f"{args[1]}{i}"})
                        done["succeeded"] += 1
                    except TaskFailed:
                        done["failed"] += 1
                answer = done
            elif command == "loop":
                done = {"succeeded": 0, "failed": 0}
                threads = [
                    threading.Thread(
                        target=work,
                        args=(
                            pool,
                            lock,
                            done,
                            time.monotonic() + float(args[0]),
                            args[1:] == ["once"],
                        ),
                    )
                    for _ in range(2)
                ]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                answer = done
            elif command == "state":
                answer = {w["id"]: w["breaker"]["state"] for w in pool.workers()}[args[0]]
            elif command == "attempts":
                with lock:
                    answer, attempts[:] = list(attempts), []
            elif command == "stats":
                answer = pool.stats()["shared_state"]
            else:
                answer = {"error": f"unknown command {command!r}"}
            print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
