"""One process of the failover tests and benchmark: a pool from a YAML, under load until
told to stop, driven over stdin/stdout.

Prints "ready" once warmed up; on "go" runs tasks on ``threads`` threads, every
``doom_every``-th of them with a deadline its worker cannot meet (it fails into a dead
letter whatever Redis does); on "stop" closes the pool and prints one JSON line: tasks
succeeded, tasks that failed though they should not have, the dead-letter ids of the
doomed tasks' TaskFailed, and the shared state's outages and their wall times.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import sys
import threading
import time

from npu_sync import Task, TaskFailed, WorkerPool


class Transitions(logging.Handler):
    """The wall times at which the shared state went unavailable and available again."""

    def __init__(self) -> None:
        super().__init__()
        self.guard = threading.Lock()
        self.seen: list[tuple[str, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        kind = (
            "down"
            if text.startswith("shared state unavailable")
            else "up"
            if text.startswith("shared state available again")
            else None
        )
        if kind is not None:
            with self.guard:
                self.seen.append((kind, time.time()))


def main() -> None:
    config, threads, doom_every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    transitions = Transitions()
    logger = logging.getLogger("npu_sync._shared")
    logger.addHandler(transitions)
    logger.setLevel(logging.INFO)
    stop = threading.Event()
    lock = threading.Lock()
    outcome: dict[str, object] = {"succeeded": 0, "unexpected": [], "doomed": [], "missing": 0}

    pool = WorkerPool.from_yaml(config, watch=False)
    for i in range(5):
        pool.execute({"input_text": f"warm {i}"})
    print("ready", flush=True)
    sys.stdin.readline()

    def caller(n: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            doomed = i % doom_every == 0
            task = Task(payload={"input_text": f"{n}-{i}"}, timeout=0.005 if doomed else 20.0)
            try:
                pool.execute(task)
            except TaskFailed as exc:
                with lock:
                    if not doomed:
                        outcome["unexpected"].append(str(exc)[:300])  # type: ignore[attr-defined]
                    elif exc.dead_letter_id is None:
                        outcome["missing"] += 1  # type: ignore[operator]
                    else:
                        outcome["doomed"].append(exc.dead_letter_id)  # type: ignore[attr-defined]
                continue
            if not doomed:
                with lock:
                    outcome["succeeded"] += 1  # type: ignore[operator]

    callers = [threading.Thread(target=caller, args=(n,)) for n in range(threads)]
    for t in callers:
        t.start()
    sys.stdin.readline()
    # A process that hangs on its way out says where, on stderr, and ends.
    faulthandler.dump_traceback_later(60, exit=True)
    stop.set()
    for t in callers:
        t.join()
    shared = pool.stats()["shared_state"]
    pool.close()
    with transitions.guard:
        outcome["transitions"] = transitions.seen
    outcome["outages"] = shared.get("outages")
    print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main()
