"""Asyncio callers, side by side: AsyncWorkerPool against aiohttp doing its own balancing.

Usage, from a clone (aiohttp comes with the ``bench`` extra)::

    pip install -e '.[bench]'
    python benchmarks/aio_side_by_side.py [--tasks 1000] [--rounds 3] [--latency-ms 50]

Three reference workers, each in its own process on loopback (``--latency-ms`` per
task, 32 slots each). Four contenders, each on a fresh event loop in this process, each
given ``--tasks`` tasks at once (one ``gather``):

* ``npu_sync``: :class:`~npu_sync.AsyncWorkerPool` over one :class:`~npu_sync.WorkerPool`
  (built-in transport, 32 tasks a worker, 96 threads, 3 retries, health every second);
* ``executor``: ``run_in_executor(pool.execute)`` on 96 threads, what callers write
  without ``AsyncWorkerPool``;
* ``threads`` (steady phase only): the floor of any threads-under-the-hood design,
  ``run_in_executor`` on 96 threads each sending a bare HTTP/1.1 request on a socket
  of its own: no pool, no balancing, no retries;
* ``aiohttp``: one ``ClientSession``, least connections of its own (the worker with
  the fewest requests in flight, at most 32 each), up to 3 attempts on workers not yet
  tried, a worker that refused a connection skipped for a second.

Steady phase: ``--rounds`` rounds, the contenders' order alternating. Kill phase: each
contender once more, a worker SIGKILLed when a third of its tasks have ended and
restarted at once (in a thread: the loop goes on).

Per run: tasks/s, client CPU per task (this process's CPU time: every thread, the
pool's health thread included), of which the event loop's own thread spent (``loop
µs``: what the loop is kept from other work, whatever the machine), event-loop lag (a
coroutine asks to sleep 5 ms over and over; the lag is how late it wakes: p50, p99,
max), tasks lost (ended without a
result), duplicated (an answer returned twice, or for another task: every answer
carries the ``X-NPU-Task-Id`` it was sent), attempts. The table's last column is each
figure's ratio against aiohttp's in the same phase.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import socket
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from npu_sync import AsyncWorkerPool, Task, WorkerPool
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    RetryConfig,
    TimeoutConfig,
    worker_config,
)
from npu_sync.events import AttemptFinished, Event
from npu_sync.worker_server import LocalWorker

try:
    import aiohttp
except ImportError:  # pragma: no cover - depends on the environment
    aiohttp = None  # type: ignore[assignment]

PER_WORKER = 32
ATTEMPTS = 3
TICK = 0.005


@dataclass
class Run:
    contender: str
    phase: str
    tasks: int
    elapsed_s: float = 0.0
    cpu_s: float = 0.0
    loop_cpu_s: float = 0.0
    lags_ms: list[float] = field(default_factory=list)
    lost: int = 0
    duplicated: int = 0
    attempts: int = 0
    served_by_restarted: int = 0

    @property
    def tasks_per_s(self) -> float:
        return self.tasks / self.elapsed_s

    @property
    def cpu_us_per_task(self) -> float:
        return self.cpu_s / self.tasks * 1e6

    @property
    def loop_cpu_us_per_task(self) -> float:
        return self.loop_cpu_s / self.tasks * 1e6

    def lag(self, q: float) -> float:
        ordered = sorted(self.lags_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def _lag_probe(stop: asyncio.Event, lags: list[float]) -> None:
    clock = time.perf_counter
    while not stop.is_set():
        t0 = clock()
        await asyncio.sleep(TICK)
        lags.append((clock() - t0 - TICK) * 1000)


async def _measure(
    run: Run,
    payloads: list[tuple[str, dict[str, Any]]],
    call: Callable[[str, dict[str, Any]], Awaitable[dict[str, Any] | None]],
    on_progress: Callable[[int], Awaitable[None]] | None,
) -> None:
    stop = asyncio.Event()
    probe = asyncio.ensure_future(_lag_probe(stop, run.lags_ms))
    done = 0
    side: list[asyncio.Future[None]] = []

    async def one(task_id: str, payload: dict[str, Any]) -> dict[str, Any] | None:
        nonlocal done
        try:
            return await call(task_id, payload)
        except Exception:
            return None
        finally:
            done += 1
            if on_progress is not None:
                side.append(asyncio.ensure_future(on_progress(done)))

    cpu = time.process_time()
    loop_cpu = time.thread_time()
    t0 = time.perf_counter()
    answers = await asyncio.gather(*(one(tid, p) for tid, p in payloads))
    run.elapsed_s = time.perf_counter() - t0
    run.cpu_s = time.process_time() - cpu
    run.loop_cpu_s = time.thread_time() - loop_cpu
    stop.set()
    await probe
    await asyncio.gather(*side)
    seen: set[str] = set()
    for (task_id, _), answer in zip(payloads, answers, strict=True):
        if answer is None:
            run.lost += 1
            continue
        if answer.get("task_id") != task_id or task_id in seen:
            run.duplicated += 1
        seen.add(task_id)


class NpuSyncContender:
    name = "npu_sync"

    def __init__(self, workers: list[LocalWorker]) -> None:
        self.attempts = 0
        self.pool = WorkerPool(
            PoolConfig(
                workers=tuple(
                    worker_config(w.worker_id, w.url, max_concurrent=PER_WORKER) for w in workers
                ),
                timeouts=TimeoutConfig(connect=2, read=10, task=30),
                health=HealthConfig(interval=1.0, timeout=1.0),
                retry=RetryConfig(max_retries=ATTEMPTS, backoff_initial=0.01, backoff_max=0.1),
                circuit_breaker=BreakerConfig(fail_max=3, reset_timeout=1, max_reset_timeout=5),
            ),
            hooks=[self._count],
        )
        self.apool = AsyncWorkerPool(self.pool, threads=PER_WORKER * len(workers))

    def _count(self, event: Event) -> None:
        if isinstance(event, AttemptFinished):
            self.attempts += 1

    async def call(self, task_id: str, payload: dict[str, Any]) -> dict[str, Any] | None:
        answer: dict[str, Any] = await self.apool.execute(Task(payload, task_id=task_id))
        return answer

    def close(self) -> None:
        self.apool.close()
        self.pool.close()


class ExecutorContender:
    """What an asyncio caller writes today: ``run_in_executor(pool.execute)`` on an
    executor of its own (96 threads), over the same kind of pool. Not cancellable."""

    name = "executor"

    def __init__(self, workers: list[LocalWorker]) -> None:
        self._inner = NpuSyncContender(workers)
        self.pool = self._inner.pool
        self.executor = concurrent.futures.ThreadPoolExecutor(PER_WORKER * len(workers))

    @property
    def attempts(self) -> int:
        return self._inner.attempts

    async def call(self, task_id: str, payload: dict[str, Any]) -> dict[str, Any] | None:
        loop = asyncio.get_running_loop()
        task = Task(payload, task_id=task_id)
        answer: dict[str, Any] = await loop.run_in_executor(self.executor, self.pool.execute, task)
        return answer

    def close(self) -> None:
        self.executor.shutdown()
        self._inner.close()


class BareThreadsContender:
    """The floor of threads under the hood: ``run_in_executor`` on 96 threads, each
    sending a bare HTTP/1.1 request on a keep-alive socket of its own (a third of the
    threads on each worker), with no pool, no balancing, no retry. Steady phase only:
    it has nothing to survive a killed worker with. What any design that runs blocking
    I/O on threads costs the loop, whatever it does around the I/O."""

    name = "threads"

    def __init__(self, workers: list[LocalWorker]) -> None:
        self.addresses = [("127.0.0.1", int(w.url.rsplit(":", 1)[1])) for w in workers]
        self.attempts = 0
        self.executor = concurrent.futures.ThreadPoolExecutor(PER_WORKER * len(workers))
        self.local = threading.local()
        self.lock = threading.Lock()
        self.opened = 0
        # Its threads started before the first run, not on the loop during it.
        list(self.executor.map(time.sleep, [0.01] * PER_WORKER * len(workers)))

    def _send(self, task_id: str, payload: dict[str, Any]) -> dict[str, Any]:
        local = self.local
        if getattr(local, "sock", None) is None:
            with self.lock:
                address = self.addresses[self.opened % len(self.addresses)]
                self.opened += 1
            local.sock = socket.create_connection(address)
            local.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            local.file = local.sock.makefile("rb")
        body = json.dumps(payload).encode()
        head = (
            "POST /inference HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nX-NPU-Task-Id: {task_id}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        local.sock.sendall(head.encode() + body)
        length = 0
        local.file.readline()  # the status line
        while (line := local.file.readline()) not in (b"\r\n", b""):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        answer: dict[str, Any] = json.loads(local.file.read(length))
        return answer

    async def call(self, task_id: str, payload: dict[str, Any]) -> dict[str, Any] | None:
        self.attempts += 1
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self._send, task_id, payload)

    def close(self) -> None:
        self.executor.shutdown()


class AiohttpContender:
    """aiohttp with least connections of its own: what an asyncio service writes."""

    name = "aiohttp"

    def __init__(self, workers: list[LocalWorker]) -> None:
        self.urls = [w.url + "/inference" for w in workers]
        self.attempts = 0
        self.session: Any = None
        self.in_flight = [0] * len(workers)
        self.down_until = [0.0] * len(workers)
        self.cond: asyncio.Condition | None = None

    async def _pick(self, tried: set[int]) -> int:
        assert self.cond is not None
        loop = asyncio.get_running_loop()
        async with self.cond:
            while True:
                now = loop.time()
                up = [i for i in range(len(self.urls)) if self.down_until[i] <= now]
                fresh = [i for i in up if i not in tried] or up
                room = [i for i in fresh if self.in_flight[i] < PER_WORKER]
                if room:
                    best = min(room, key=lambda i: self.in_flight[i])
                    self.in_flight[best] += 1
                    return best
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.cond.wait(), 0.05)

    async def _release(self, i: int) -> None:
        assert self.cond is not None
        async with self.cond:
            self.in_flight[i] -= 1
            self.cond.notify()

    async def call(self, task_id: str, payload: dict[str, Any]) -> dict[str, Any] | None:
        if self.session is None:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=PER_WORKER)
            timeout = aiohttp.ClientTimeout(total=30, sock_connect=2, sock_read=10)
            self.session = aiohttp.ClientSession(connector=connector, timeout=timeout)
            self.cond = asyncio.Condition()
        tried: set[int] = set()
        headers = {"X-NPU-Task-Id": task_id}
        for attempt in range(ATTEMPTS + 1):
            i = await self._pick(tried)
            tried.add(i)
            self.attempts += 1
            headers["X-NPU-Attempt"] = str(attempt + 1)
            try:
                async with self.session.post(self.urls[i], json=payload, headers=headers) as r:
                    if r.status >= 500 or r.status in (408, 429):
                        continue
                    r.raise_for_status()
                    answer: dict[str, Any] = await r.json()
                    return answer
            except aiohttp.ClientConnectorError:
                self.down_until[i] = asyncio.get_running_loop().time() + 1.0
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            finally:
                await self._release(i)
        return None

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None


def _payloads(n: int) -> list[tuple[str, dict[str, Any]]]:
    return [
        (uuid.uuid4().hex, {"model_id": "default", "input_text": f"t{i}", "max_tokens": 16})
        for i in range(n)
    ]


def _run(contender: Any, phase: str, tasks: int, victim: LocalWorker | None) -> Run:
    run = Run(contender.name, phase, tasks)
    killed = asyncio.Event()

    async def progress(done: int) -> None:
        if victim is None or killed.is_set() or done < tasks // 3:
            return
        killed.set()
        await asyncio.to_thread(victim.kill)
        await asyncio.to_thread(victim.restart)

    async def main() -> None:
        first = contender.attempts
        payloads = _payloads(tasks)
        await _measure(run, payloads, contender.call, progress if victim else None)
        run.attempts = contender.attempts - first
        if isinstance(contender, AiohttpContender):
            await contender.aclose()

    asyncio.run(main())
    return run


def _idle(seconds: float) -> Run:
    """The loop's own floor: the lag probe alone, as long as a contender's run."""
    run = Run("idle", "floor", 1)

    async def main() -> None:
        stop = asyncio.Event()
        probe = asyncio.ensure_future(_lag_probe(stop, run.lags_ms))
        await asyncio.sleep(seconds)
        stop.set()
        await probe

    asyncio.run(main())
    run.elapsed_s = seconds
    return run


def _table(runs: list[Run]) -> str:
    head = (
        f"{'phase':<7}{'contender':<10}{'tasks/s':>9}{'CPU µs/task':>13}{'loop µs':>9}"
        f"{'lag p50':>9}{'lag p99':>9}{'lag max':>9}{'lost':>6}{'dup':>5}{'attempts':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in runs:
        if r.contender == "idle":
            lines.append(
                f"{r.phase:<7}{r.contender:<10}{'':>9}{'':>13}{'':>9}{r.lag(0.5):>8.2f}m"
                f"{r.lag(0.99):>8.2f}m{max(r.lags_ms, default=0):>8.2f}m"
            )
            continue
        lines.append(
            f"{r.phase:<7}{r.contender:<10}{r.tasks_per_s:>9.0f}{r.cpu_us_per_task:>13.0f}"
            f"{r.loop_cpu_us_per_task:>9.0f}"
            f"{r.lag(0.5):>8.2f}m{r.lag(0.99):>8.2f}m{max(r.lags_ms, default=0):>8.2f}m"
            f"{r.lost:>6}{r.duplicated:>5}{r.attempts:>10}"
        )
    return "\n".join(lines)


def _pooled_lag(rows: list[Run], q: float) -> float:
    """The ``q`` quantile of every lag sample of ``rows`` together."""
    pooled = Run("", "", 1, lags_ms=[x for r in rows for x in r.lags_ms])
    return pooled.lag(q)


def _ratios(runs: list[Run]) -> dict[str, dict[str, float]]:
    """Per phase and contender: median tasks/s and CPU per task over aiohttp's, and the
    p99 loop lag of all its runs' samples together (the idle floor's alongside)."""
    out: dict[str, dict[str, float]] = {}
    floor = [r for r in runs if r.contender == "idle"]
    for phase in ("steady", "kill"):
        base = [r for r in runs if r.phase == phase and r.contender == "aiohttp"]
        for name in ("npu_sync", "executor", "threads", "aiohttp"):
            mine = [r for r in runs if r.phase == phase and r.contender == name]
            if not mine or not base:
                continue
            out[f"{phase}/{name}"] = {
                "tasks_per_s_vs_aiohttp": statistics.median(r.tasks_per_s for r in mine)
                / statistics.median(r.tasks_per_s for r in base),
                "cpu_per_task_vs_aiohttp": statistics.median(r.cpu_us_per_task for r in mine)
                / statistics.median(r.cpu_us_per_task for r in base),
                "loop_cpu_us_per_task": statistics.median(r.loop_cpu_us_per_task for r in mine),
                "lag_p99_ms": _pooled_lag(mine, 0.99),
                "lag_p99_ms_idle_floor": _pooled_lag(floor, 0.99),
                "lost": sum(r.lost for r in mine),
                "duplicated": sum(r.duplicated for r in mine),
            }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument(
        "--switch-interval",
        type=float,
        metavar="S",
        help="sys.setswitchinterval(S) for the whole run (an application's setting: "
        "how long a thread may keep the GIL while another waits; Python's default 0.005)",
    )
    args = parser.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if aiohttp is None:
        print("aiohttp is not installed: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    workers = [
        LocalWorker(worker_id=f"w{i}", latency_ms=args.latency_ms, max_concurrent=PER_WORKER)
        for i in range(3)
    ]
    runs: list[Run] = []
    try:
        for w in workers:
            w.start()
        mine = NpuSyncContender(workers)
        naive = ExecutorContender(workers)
        floor = BareThreadsContender(workers)
        theirs = AiohttpContender(workers)
        try:
            order: list[Any] = [mine, naive, floor, theirs]
            for round_ in range(args.rounds):
                for contender in order if round_ % 2 == 0 else order[::-1]:
                    runs.append(_run(contender, "steady", args.tasks, None))
                runs.append(_idle(runs[-1].elapsed_s))
            for contender in (mine, naive, theirs):
                runs.append(_run(contender, "kill", args.tasks, workers[2]))
        finally:
            mine.close()
            naive.close()
            floor.close()
    finally:
        for w in workers:
            with contextlib.suppress(Exception):
                w.stop()
    print(
        f"{args.tasks} tasks at once, 3 workers x {PER_WORKER} slots, "
        f"{args.latency_ms:g} ms a task; Python {sys.version.split()[0]}, "
        f"{os.cpu_count()} CPUs, switch interval {sys.getswitchinterval() * 1000:g} ms"
    )
    print(_table(runs))
    ratios = _ratios(runs)
    for key, figures in ratios.items():
        print(
            f"{key:<17} tasks/s {figures['tasks_per_s_vs_aiohttp']:.2f}x aiohttp, CPU per "
            f"task {figures['cpu_per_task_vs_aiohttp']:.2f}x, on the loop "
            f"{figures['loop_cpu_us_per_task']:.0f} µs; loop lag p99 "
            f"{figures['lag_p99_ms']:.2f} ms (idle loop {figures['lag_p99_ms_idle_floor']:.2f} ms)"
            f"; lost {figures['lost']:.0f}, duplicated {figures['duplicated']:.0f}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"runs": [asdict(r) for r in runs], "ratios": ratios}, indent=1)
        )
    bad = sum(r.lost + r.duplicated for r in runs if r.contender == "npu_sync")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
