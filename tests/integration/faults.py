"""A load harness for the fault suite: run tasks, inject faults, account for every task."""

from __future__ import annotations

import concurrent.futures
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from npu_sync import Task, TaskFailed, TaskRejected, WorkerPool
from npu_sync.events import AttemptFinished, BreakerStateChanged, Event


class AttemptLog:
    """A hook that remembers when breakers opened and which attempts came after."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.opened_at: dict[str, float] = {}
        self.after_open: dict[str, int] = {}
        self.attempts = 0

    def __call__(self, event: Event) -> None:
        with self.lock:
            if isinstance(event, BreakerStateChanged) and event.new == "open":
                self.opened_at.setdefault(event.worker_id, event.at)
            elif isinstance(event, AttemptFinished):
                self.attempts += 1
                opened = self.opened_at.get(event.worker_id)
                # Failed attempts that started after the worker's breaker opened: only
                # half-open trials may do that.
                if (
                    opened is not None
                    and event.at - event.duration > opened
                    and event.outcome == "failure"
                ):
                    self.after_open[event.worker_id] = self.after_open.get(event.worker_id, 0) + 1


@dataclass
class Report:
    scenario: str
    tasks: int
    succeeded: int = 0
    rejected: int = 0
    dead_lettered: int = 0
    lost: int = 0
    returned_twice: int = 0
    latencies: list[float] = field(default_factory=list)
    attempts: int = 0
    after_open: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def success_rate(self) -> float:
        return self.succeeded / self.tasks if self.tasks else 0.0

    def row(self) -> dict[str, Any]:
        cuts = statistics.quantiles(self.latencies, n=100) if len(self.latencies) > 1 else [0] * 99
        return {
            "scenario": self.scenario,
            "tasks": self.tasks,
            "succeeded": self.succeeded,
            "rejected": self.rejected,
            "dead_lettered": self.dead_lettered,
            "lost": self.lost,
            "returned_twice": self.returned_twice,
            "success_rate": round(100 * self.success_rate, 3),
            "attempts_per_task": round(self.attempts / self.tasks, 3) if self.tasks else 0,
            "p50_ms": round(statistics.median(self.latencies) * 1000, 1) if self.latencies else "-",
            "p99_ms": round(cuts[98] * 1000, 1) if self.latencies else "-",
            "tasks_per_s": round(self.tasks / self.seconds) if self.seconds else "-",
            "failed_on_open_breaker": self.after_open,
        }


def run_load(
    pool: WorkerPool,
    scenario: str,
    tasks: int,
    *,
    threads: int = 32,
    faults: dict[int, Callable[[], object]] | None = None,
    payload: Callable[[int], Any] = lambda i: {"model_id": "default", "input_text": f"task {i}"},
) -> Report:
    """Run ``tasks`` tasks from ``threads`` callers; call ``faults[k]`` when k have ended.

    Every task is accounted for: a result (checked to be its own), TaskRejected, or
    TaskFailed whose dead letter is in the store; anything else counts as lost.
    """
    log = AttemptLog()
    pool.add_hook(log)
    report = Report(scenario, tasks)
    done = 0
    done_lock = threading.Lock()
    faults = dict(faults or {})
    fault_threads: list[threading.Thread] = []
    seen: set[str] = set()

    def one(i: int) -> None:
        nonlocal done
        task_id = f"{scenario}-{i}"
        started = time.monotonic()
        try:
            result = pool.execute(Task(payload(i), task_id=task_id))
        except TaskRejected:
            outcome = "rejected"
        except TaskFailed as exc:
            known = exc.dead_letter_id and pool.dead_letters.store.get(exc.dead_letter_id)
            outcome = "dead_lettered" if known else "lost"
        except Exception as exc:
            outcome = "lost"
            report.errors.append(f"{type(exc).__name__}: {exc}")
        else:
            outcome = "succeeded" if result.get("task_id") == task_id else "lost"
        elapsed = time.monotonic() - started
        with done_lock:
            if outcome == "succeeded":
                if task_id in seen:
                    report.returned_twice += 1
                seen.add(task_id)
                report.latencies.append(elapsed)
            setattr(report, outcome, getattr(report, outcome) + 1)
            done += 1
            action = faults.pop(done, None)
        if action is not None:
            t = threading.Thread(target=action, name=f"fault-{done}")
            fault_threads.append(t)
            t.start()

    began = time.monotonic()
    try:
        with concurrent.futures.ThreadPoolExecutor(threads) as callers:
            list(callers.map(one, range(tasks)))
        for t in fault_threads:
            t.join(30)
    finally:
        pool.remove_hook(log)
    report.seconds = time.monotonic() - began
    report.attempts = log.attempts
    report.after_open = sum(log.after_open.values())
    return report


def table(reports: list[Report]) -> str:
    rows = [r.row() for r in reports]
    keys = list(rows[0])
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in keys}
    lines = ["  ".join(k.rjust(widths[k]) for k in keys)]
    lines += ["  ".join(str(r[k]).rjust(widths[k]) for k in keys) for r in rows]
    return "\n".join(lines)
