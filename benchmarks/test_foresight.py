"""How often deadline-aware admission is wrong, under a saturated fleet of real workers.

Three reference workers (``--slots 2``, 40 ms +/- 20 ms), ``max_concurrent`` 2 each:
the fleet answers about 150 tasks a second. ``CALLERS`` threads keep it saturated,
each task's deadline drawn from ``DEADLINES`` (seeded, the same sequence in every
run), so that the queue ahead decides which tasks can make it.

Two runs side by side:

* ``shadow``: ``admission.deadline_aware`` off. Every task that is about to wait is
  judged by :class:`~npu_sync._foresight.DeadlineForesight` without acting on it; its
  expectation is compared, per margin, with what then happened: *refused that would
  have finished* (judged late, succeeded) and *admitted that timed out* (judged in
  time or not judged — it found a slot at once — and failed on its deadline);
* ``on``: the default, acting: how many tasks are refused, how many admitted ones
  still time out, and the goodput (tasks answered in time a second) against ``shadow``.

Run: ``python -m pytest benchmarks/test_foresight.py -s -n 0`` (about a minute).
"""

from __future__ import annotations

import inspect
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.conftest import report
from npu_sync import AdmissionRefused, Task, TaskFailed, WorkerPool
from npu_sync._admission import Dispatcher
from npu_sync._foresight import DeadlineForesight
from npu_sync.config import (
    AdmissionConfig,
    HealthConfig,
    PoolConfig,
    PoolSettings,
    RetryConfig,
    TimeoutConfig,
    worker_config,
)
from npu_sync.worker_server import LocalWorker

CALLERS = 24
TASKS_PER_CALLER = 60
DEADLINES = (0.05, 0.5)  # uniform, seconds
MARGINS = (1.0, 1.25, 1.5, 2.0)
PAYLOAD = {"model_id": "default", "input_text": "foresight"}


@pytest.fixture(scope="module")
def workers() -> Iterator[list[LocalWorker]]:
    started = [
        LocalWorker(worker_id=f"w{i}", latency_ms=40, jitter_ms=20, slots=2).start()
        for i in range(3)
    ]
    try:
        yield started
    finally:
        for worker in started:
            worker.stop()


def _config(workers: list[LocalWorker], deadline_aware: bool) -> PoolConfig:
    return PoolConfig(
        workers=tuple(worker_config(w.worker_id, w.url, max_concurrent=2) for w in workers),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=0),
        timeouts=TimeoutConfig(connect=1.0, read=5.0, task=5.0),
        pool=PoolSettings(threads=CALLERS, max_queue_wait=60.0),
        admission=AdmissionConfig(deadline_aware=deadline_aware),
    )


_judged = threading.local()


def _shadowed(original: Any) -> Any:
    """Dispatcher._wait that first records what the foresight would say (not acting).

    It passes every argument on as it came and reads only the three it needs by name:
    arguments the real method gains later (the task's class, its stop) do not break
    it, and a renamed one fails loudly here rather than measuring something else."""
    foresight = DeadlineForesight(margin=1.0)
    signature = inspect.signature(original)

    def wait(self: Dispatcher, *args: Any, **kwargs: Any) -> Any:
        given = signature.bind(self, *args, **kwargs).arguments
        excluded, deadline, now = given["excluded"], given["deadline"], given["now"]
        # Every task of this benchmark is of one class: the whole queue is ahead.
        expected = foresight.expect(self.selector.workers, excluded, len(self._waiters))
        _judged.value = (None if expected is None else expected[1], deadline - now)
        return original(self, *args, **kwargs)

    return wait


def _run(pool: WorkerPool, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    deadlines = [[rng.uniform(*DEADLINES) for _ in range(TASKS_PER_CALLER)] for _ in range(CALLERS)]
    outcomes: list[tuple[str, float | None, float]] = []
    refusals: list[float] = []  # time to the refusal, as a share of the task's deadline
    lock = threading.Lock()
    go = threading.Event()

    def caller(mine: list[float]) -> None:
        go.wait()
        for timeout in mine:
            _judged.value = None
            started = time.perf_counter()
            try:
                pool.execute(Task(PAYLOAD, timeout=timeout))
                kind = "ok"
            except AdmissionRefused:
                kind = "refused"
                with lock:
                    refusals.append((time.perf_counter() - started) / timeout)
            except TaskFailed:
                kind = "failed"
            judged = _judged.value
            with lock:
                outcomes.append(
                    (
                        kind,
                        None if judged is None else judged[0],
                        timeout if judged is None else judged[1],
                    )
                )

    for _ in range(20):  # the pool learns the workers' answer times
        pool.execute(PAYLOAD)
    threads = [threading.Thread(target=caller, args=(d,)) for d in deadlines]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    go.set()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    return {"outcomes": outcomes, "took": took, "refusals": sorted(refusals)}


def test_how_often_the_foresight_is_wrong(workers: list[LocalWorker], monkeypatch) -> None:
    """Refused-that-would-have-finished and admitted-that-timed-out, per margin."""
    rows: list[tuple[str, ...]] = [("run", "tasks", "ok", "refused", "timed out", "goodput/s")]
    with monkeypatch.context() as patch:
        patch.setattr(Dispatcher, "_wait", _shadowed(Dispatcher._wait))
        with WorkerPool(_config(workers, False)) as pool:
            shadow = _run(pool, 1)
    with WorkerPool(_config(workers, True)) as pool:
        on = _run(pool, 1)
    for name, run in (("shadow (off)", shadow), ("on", on)):
        kinds = [k for k, _, _ in run["outcomes"]]
        rows.append(
            (
                name,
                str(len(kinds)),
                str(kinds.count("ok")),
                str(kinds.count("refused")),
                str(kinds.count("failed")),
                f"{kinds.count('ok') / run['took']:.0f}",
            )
        )
    report("Deadline-aware admission under a saturated fleet", rows)
    refusals = on["refusals"]
    if refusals:
        median = refusals[len(refusals) // 2]
        p99 = refusals[min(len(refusals) - 1, int(len(refusals) * 0.99))]
        print(
            "  time to a refusal, as a share of the task's deadline: "
            f"median {median:.3f}, p99 {p99:.3f}"
        )

    judged_rows: list[tuple[str, ...]] = [
        ("margin", "judged late", "of which finished", "admitted", "of which timed out")
    ]
    for margin in MARGINS:
        late = [
            (k, e, left) for k, e, left in shadow["outcomes"] if e is not None and e > left * margin
        ]
        kept = [
            (k, e, left)
            for k, e, left in shadow["outcomes"]
            if not (e is not None and e > left * margin)
        ]
        judged_rows.append(
            (
                f"{margin:g}",
                str(len(late)),
                f"{sum(k == 'ok' for k, _, _ in late)} ({_share(late, 'ok')})",
                str(len(kept)),
                f"{sum(k == 'failed' for k, _, _ in kept)} ({_share(kept, 'failed')})",
            )
        )
    report("The shadow run judged, per margin (what refusing would have got wrong)", judged_rows)
    assert shadow["outcomes"] and on["outcomes"]


def _share(items: list[tuple[str, Any, Any]], kind: str) -> str:
    if not items:
        return "-"
    return f"{100 * sum(k == kind for k, _, _ in items) / len(items):.0f} %"
