"""Throughput at 256 callers: the pool against HAProxy leastconn + aiohttp, side by side.

Usage, from a clone (aiohttp comes with the ``bench`` extra; HAProxy from the
distribution)::

    pip install -e '.[bench]'
    apt-get install -y haproxy
    python benchmarks/callers_256.py [--callers 256] [--rounds 5] [--tasks N]
        [--latency-ms 20] [--json PATH] [--only NAME ...] [--locks]

Three reference workers, each in its own process on loopback (``--latency-ms`` per
task, 256 slots each, so the workers themselves never refuse), shared by every
contender. Each contender keeps ``--callers`` tasks in flight:

* ``npu_sync pool (default config)``: one :class:`~npu_sync.WorkerPool` given only the
  workers (default ``max_concurrent``, default everything), ``--callers`` threads
  calling ``execute``; tasks beyond the workers' slots wait in the pool's queue;
* ``npu_sync pool (slots for every caller)``: the same with ``max_concurrent`` of
  ``ceil(callers / 3)`` per worker, so that no task queues in the pool: the fair
  comparison with HAProxy, which queues nothing;
* ``haproxy leastconn + aiohttp``: HAProxy in front of the workers (the configuration
  and process handling of ``benchmarks/test_alternatives.py``: ``balance leastconn``,
  health checks every second, ``retries 3``, ``option redispatch``, ``http-reuse
  always``), driven by one asyncio loop running ``--callers`` coroutines through one
  ``aiohttp.ClientSession`` (``TCPConnector(limit=callers)``); the client does not
  retry, since retrying is the proxy's job;
* ``bare threads`` (reference, not a contender): ``--callers`` threads, each sending
  bare HTTP/1.1 requests on a keep-alive socket of its own (caller ``i`` to worker
  ``i % 3``): no pool, no balancing, no retry. The floor of any threaded client.

Every contender runs ``--callers`` x 4 warm-up tasks (connections opened, threads and
caches warm), then ``--rounds`` rounds of ``--tasks`` tasks, the contenders' order
alternating from round to round so that other work on the machine hits each alike.

Per run: tasks/s; p50 and p99 of every task's latency as its caller saw it; client CPU
per task (this process's ``time.process_time()``, every thread's; for HAProxy plus
HAProxy's own, from ``/proc/<pid>/stat``); context switches per task (this process's
``getrusage(RUSAGE_SELF)``, voluntary and involuntary, every thread's; for HAProxy
plus those of each of its threads, from ``/proc/<pid>/task/*/status``); the three
workers' CPU per task (they share the machine's cores with the client); attempts per
task (the pool's retries, HAProxy's retries and redispatches); failed tasks. The
summary gives each contender's median per-round throughput ratio against HAProxy +
aiohttp's run in the same round. Not run by pytest: it measures, it asserts nothing.

``--only NAME`` runs the contenders whose name contains ``NAME`` (repeatable), for a
profiler attached to one of them; the header names this process's pid, so that the
callers' switches can be told from the workers' (``perf script --pid``). ``--locks``
counts, per task, acquisitions of the package's own locks and those that found the
lock taken, with where they were taken (the counting costs CPU: leave it off for the
figures).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import resource
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.test_alternatives import HAProxyContender, haproxy_binary, process_cpu
from npu_sync import NpuSyncError, WorkerPool
from npu_sync.config import PoolConfig, worker_config
from npu_sync.worker_server import LocalWorker

try:
    import aiohttp
except ImportError:  # pragma: no cover - depends on the environment
    aiohttp = None  # type: ignore[assignment]

PAYLOAD = {"model_id": "default", "input_text": "benchmark", "max_tokens": 16}
BODY = json.dumps(PAYLOAD).encode()
WORKERS = 3
WORKER_SLOTS = 256
CONNECT_TIMEOUT = 2.0
READ_TIMEOUT = 30.0
# A run that has not ended by then is reported as stuck, not waited on forever.
RUN_TIMEOUT = 300.0
ANCHOR = "haproxy leastconn + aiohttp"

Usage = tuple[float, int]
"""CPU seconds and context switches so far, of this process and any helper process."""


def own_usage() -> Usage:
    """This process's CPU time and context switches, every thread's."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return time.process_time(), usage.ru_nvcsw + usage.ru_nivcsw


def process_switches(pid: int) -> int:
    """Context switches of every thread of another process so far.

    ``/proc/<pid>/status`` counts the main thread's only; HAProxy runs one thread per
    core, so each thread's own ``status`` is summed.
    """
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            for line in status.read_text().splitlines():
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    total += int(line.split()[1])
    return total


class LockCounts:
    """``--locks``: every ``threading.Lock`` the package creates from now on counts its
    acquisitions and those that found it taken, by where they were taken.

    Thread-safe: ``next()`` on an ``itertools.count`` is atomic in CPython; reading a
    count takes one more, which :meth:`snapshot` subtracts.
    """

    def __init__(self) -> None:
        self.acquired = itertools.count()
        self.blocked: dict[str, itertools.count[int]] = {}
        counts = self
        allocate = threading.Lock

        class CountingLock:
            def __init__(self) -> None:
                self._lock = allocate()

            def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
                next(counts.acquired)
                if self._lock.acquire(False):
                    return True
                if not blocking:
                    return False
                frame = sys._getframe(1)
                if frame.f_code.co_name == "__enter__" and frame.f_back is not None:
                    frame = frame.f_back
                where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
                next(
                    counts.blocked.setdefault(f"{where} {frame.f_code.co_name}", itertools.count())
                )
                return self._lock.acquire(True, timeout)

            def release(self) -> None:
                self._lock.release()

            def locked(self) -> bool:
                return self._lock.locked()

            def __enter__(self) -> bool:
                return self.acquire()

            def __exit__(self, *exc: object) -> None:
                self._lock.release()

        def make_lock() -> Any:
            # The package's locks only: not the benchmark's, nor asyncio's or aiohttp's.
            package = os.sep + "npu_sync" + os.sep
            return CountingLock() if package in sys._getframe(1).f_code.co_filename else allocate()

        threading.Lock = make_lock  # type: ignore[assignment]

    def snapshot(self) -> dict[str, int]:
        out = {"acquired": next(self.acquired)}
        for where, count in list(self.blocked.items()):
            out[where] = next(count)
        return out

    @staticmethod
    def since(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
        """What was counted between two snapshots (each snapshot took one of each)."""
        return {k: v - before.get(k, -1) - 1 for k, v in after.items()}


LOCKS: LockCounts | None = None


@dataclass
class Run:
    """One contender's measured run."""

    contender: str
    round: int
    tasks: int
    elapsed_s: float
    cpu_s: float
    switches: int
    failed: int
    latencies: list[float] = field(repr=False)
    attempts: int | None = None
    proxy_cpu_s: float | None = None
    proxy_switches: int | None = None
    worker_cpu_s: float = 0.0
    locks: dict[str, int] | None = None

    @property
    def tasks_per_s(self) -> float:
        return self.tasks / self.elapsed_s


def _measured(
    usage: Callable[[], Usage], go: Callable[[], tuple[list[float], int]]
) -> tuple[float, float, int, list[float], int]:
    """Time ``go`` (which returns latencies and failures) and the usage it caused."""
    cpu0, sw0 = usage()
    t0 = time.perf_counter()
    latencies, failed = go()
    elapsed = time.perf_counter() - t0
    cpu1, sw1 = usage()
    return elapsed, cpu1 - cpu0, sw1 - sw0, latencies, failed


def run_threads(
    call: Callable[[int], bool], callers: int, tasks: int, usage: Callable[[], Usage]
) -> tuple[float, float, int, list[float], int]:
    """``tasks`` calls on ``callers`` threads; ``call(i)`` (caller ``i``) says if it worked.

    The threads are started and parked on a barrier first, so that their start-up is
    not measured; the measured span ends when the last of them has ended.
    """
    claim = itertools.count()
    failures = itertools.count()
    latencies: list[float] = []
    ready = threading.Barrier(callers + 1)
    clock = time.perf_counter

    def caller(i: int) -> None:
        mine: list[float] = []
        ready.wait()
        while next(claim) < tasks:
            t0 = clock()
            if not call(i):
                next(failures)
            mine.append(clock() - t0)
        latencies.extend(mine)

    threads = [
        threading.Thread(target=caller, args=(i,), name=f"bench-caller-{i}", daemon=True)
        for i in range(callers)
    ]
    for thread in threads:
        thread.start()

    def go() -> tuple[list[float], int]:
        ready.wait()
        for thread in threads:
            thread.join(RUN_TIMEOUT)
            if thread.is_alive():
                raise RuntimeError(f"{thread.name} still running after {RUN_TIMEOUT:g} s")
        return latencies, next(failures)

    return _measured(usage, go)


class Contender(Protocol):
    name: str

    def run(self, round_: int, tasks: int) -> Run: ...

    def close(self) -> None: ...


# -- the contenders ------------------------------------------------------------------


class PoolContender:
    """npu_sync's pool; ``slots`` per worker, or the default when None."""

    def __init__(
        self, name: str, workers: Sequence[LocalWorker], callers: int, slots: int | None
    ) -> None:
        self.name = name
        self.callers = callers
        self.pool = WorkerPool(
            PoolConfig(
                workers=tuple(
                    worker_config(w.worker_id, w.url)
                    if slots is None
                    else worker_config(w.worker_id, w.url, max_concurrent=slots)
                    for w in workers
                )
            )
        )

    def _call(self, i: int) -> bool:
        try:
            self.pool.execute(PAYLOAD)
        except NpuSyncError:
            return False
        return True

    def run(self, round_: int, tasks: int) -> Run:
        retries = self.pool.stats()["tasks"]["retries"]
        elapsed, cpu, switches, latencies, failed = run_threads(
            self._call, self.callers, tasks, own_usage
        )
        retries = self.pool.stats()["tasks"]["retries"] - retries
        return Run(
            self.name, round_, tasks, elapsed, cpu, switches, failed, latencies, tasks + retries
        )

    def close(self) -> None:
        self.pool.close()


class HAProxyAiohttpContender:
    """HAProxy (leastconn) in front of the workers, one asyncio loop + aiohttp before it."""

    name = ANCHOR

    def __init__(self, workers: Sequence[LocalWorker], callers: int, binary: str) -> None:
        self.callers = callers
        self.proxy = HAProxyContender(workers, binary)
        self.url = f"http://127.0.0.1:{self.proxy.port}/inference"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="bench-asyncio", daemon=True
        )
        self.thread.start()
        self.session: Any = self._on_loop(self._open())

    def _on_loop(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(RUN_TIMEOUT)

    async def _open(self) -> Any:
        connector = aiohttp.TCPConnector(limit=self.callers)
        timeout = aiohttp.ClientTimeout(sock_connect=CONNECT_TIMEOUT, sock_read=READ_TIMEOUT)
        return aiohttp.ClientSession(connector=connector, timeout=timeout)

    async def _call(self) -> bool:
        try:
            async with self.session.post(self.url, json=PAYLOAD) as response:
                if response.status != 200:
                    await response.read()
                    return False
                await response.json()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return False
        return True

    def _usage(self) -> Usage:
        cpu, switches = own_usage()
        return cpu + process_cpu(self.proxy.pid), switches + process_switches(self.proxy.pid)

    async def _drive(self, tasks: int) -> tuple[float, float, int, list[float], int]:
        claim = itertools.count()
        latencies: list[float] = []
        failed = 0
        clock = time.perf_counter

        async def caller() -> None:
            nonlocal failed
            while next(claim) < tasks:
                t0 = clock()
                if not await self._call():
                    failed += 1
                latencies.append(clock() - t0)

        async def go() -> tuple[list[float], int]:
            await asyncio.gather(*(caller() for _ in range(self.callers)))
            return latencies, failed

        cpu0, sw0 = self._usage()
        t0 = clock()
        await go()
        elapsed = clock() - t0
        cpu1, sw1 = self._usage()
        return elapsed, cpu1 - cpu0, sw1 - sw0, latencies, failed

    def run(self, round_: int, tasks: int) -> Run:
        before = self.proxy.backend_counters()
        proxy0 = process_cpu(self.proxy.pid), process_switches(self.proxy.pid)
        elapsed, cpu, switches, latencies, failed = self._on_loop(self._drive(tasks))
        proxy1 = process_cpu(self.proxy.pid), process_switches(self.proxy.pid)
        after = self.proxy.backend_counters()
        # A redispatch is one more attempt on another server; wretr counts the others.
        again = sum(after[k] - before[k] for k in ("wretr", "wredis"))
        return Run(
            self.name,
            round_,
            tasks,
            elapsed,
            cpu,
            switches,
            failed,
            latencies,
            tasks + again,
            proxy_cpu_s=proxy1[0] - proxy0[0],
            proxy_switches=proxy1[1] - proxy0[1],
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._on_loop(self.session.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        self.proxy.close()


class BareThreadsReference:
    """The floor: one blocking keep-alive socket per caller thread, no pool at all."""

    name = "bare threads (reference)"

    def __init__(self, workers: Sequence[LocalWorker], callers: int) -> None:
        self.callers = callers
        self.addresses = [("127.0.0.1", w.port) for w in workers]
        self.socks: list[socket.socket | None] = [None] * callers
        self.files: list[Any] = [None] * callers
        self.head = (
            "POST /inference HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n"
        ).encode() + BODY

    def _drop(self, i: int) -> None:
        sock, self.socks[i] = self.socks[i], None
        if sock is not None:
            self.files[i].close()
            sock.close()

    def _call(self, i: int) -> bool:
        try:
            sock = self.socks[i]
            if sock is None:
                sock = socket.create_connection(
                    self.addresses[i % len(self.addresses)], timeout=READ_TIMEOUT
                )
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.socks[i], self.files[i] = sock, sock.makefile("rb")
            file = self.files[i]
            sock.sendall(self.head)
            status = file.readline()
            length = 0
            while (line := file.readline()) not in (b"\r\n", b""):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            json.loads(file.read(length))
            if status[9:12] != b"200":
                return False
        except (OSError, ValueError):
            self._drop(i)
            return False
        return True

    def run(self, round_: int, tasks: int) -> Run:
        elapsed, cpu, switches, latencies, failed = run_threads(
            self._call, self.callers, tasks, own_usage
        )
        return Run(self.name, round_, tasks, elapsed, cpu, switches, failed, latencies, tasks)

    def close(self) -> None:
        for i in range(self.callers):
            self._drop(i)


# -- the report ----------------------------------------------------------------------


def _pct(values: Sequence[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summary(runs: Sequence[Run]) -> dict[str, dict[str, Any]]:
    """Per contender: medians over its rounds, percentiles over all its tasks, and its
    per-round throughput ratio against the anchor's run of the same round."""
    anchor = {r.round: r.tasks_per_s for r in runs if r.contender == ANCHOR}
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r.contender for r in runs):
        mine = [r for r in runs if r.contender == name]
        latencies = [x for r in mine for x in r.latencies]
        ratios = [r.tasks_per_s / anchor[r.round] for r in mine if r.round in anchor]
        per_task = {
            "cpu_us": [r.cpu_s / r.tasks * 1e6 for r in mine],
            "switches": [r.switches / r.tasks for r in mine],
            "worker_cpu_us": [r.worker_cpu_s / r.tasks * 1e6 for r in mine],
        }
        figures: dict[str, Any] = {
            "tasks_per_s": [r.tasks_per_s for r in mine],
            "ratio_vs_anchor": ratios,
            "p50_ms": statistics.median(latencies) * 1e3,
            "p99_ms": _pct(latencies, 99) * 1e3,
            **per_task,
            "attempts_per_task": sum(r.attempts or 0 for r in mine) / sum(r.tasks for r in mine),
            "failed": sum(r.failed for r in mine),
        }
        if mine[0].proxy_cpu_s is not None:
            figures["proxy_cpu_us"] = [(r.proxy_cpu_s or 0.0) / r.tasks * 1e6 for r in mine]
            figures["proxy_switches"] = [(r.proxy_switches or 0) / r.tasks for r in mine]
        if all(r.locks is not None for r in mine):
            tasks = sum(r.tasks for r in mine)
            where = dict.fromkeys(k for r in mine for k in r.locks or {})
            figures["locks_per_task"] = {
                k: sum((r.locks or {}).get(k, 0) for r in mine) / tasks for k in where
            }
        out[name] = figures
    return out


def _med(values: Sequence[float], spec: str, span: bool = True) -> str:
    if not values:
        return "—"
    text = format(statistics.median(values), spec)
    if span and len(values) > 1:
        text += f" ({format(min(values), spec)}-{format(max(values), spec)})"
    return text


def table(figures: dict[str, dict[str, Any]]) -> str:
    head = (
        "contender",
        "tasks/s",
        "vs anchor",
        "p50 ms",
        "p99 ms",
        "client CPU µs/task",
        "switches/task",
        "of which proxy µs, sw",
        "worker CPU µs/task",
        "attempts/task",
        "failed",
    )
    rows = [head]
    for name, f in figures.items():
        proxy = "—"
        if "proxy_cpu_us" in f:
            cpu, switches = f["proxy_cpu_us"], f["proxy_switches"]
            proxy = f"{_med(cpu, '.0f', False)}, {_med(switches, '.1f', False)}"
        rows.append(
            (
                name,
                _med(f["tasks_per_s"], ".0f"),
                _med(f["ratio_vs_anchor"], ".2f"),
                f"{f['p50_ms']:.1f}",
                f"{f['p99_ms']:.1f}",
                _med(f["cpu_us"], ".0f"),
                _med(f["switches"], ".1f"),
                proxy,
                _med(f["worker_cpu_us"], ".0f", False),
                f"{f['attempts_per_task']:.3f}",
                str(f["failed"]),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    )


# -- the run -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--callers", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=5000, help="tasks per run")
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    parser.add_argument(
        "--only", action="append", metavar="NAME", help="run the contenders named so"
    )
    parser.add_argument(
        "--locks", action="store_true", help="count acquisitions of the package's locks"
    )
    args = parser.parse_args(argv)
    global LOCKS
    if args.locks:
        LOCKS = LockCounts()
    binary = haproxy_binary()
    if aiohttp is None or binary is None:
        missing = "aiohttp (pip install -e '.[bench]')" if aiohttp is None else "haproxy"
        print(f"cannot run without {missing}", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    callers = args.callers
    workers: list[LocalWorker] = []
    contenders: list[Contender] = []
    runs: list[Run] = []
    try:
        for i in range(WORKERS):
            workers.append(
                LocalWorker(
                    worker_id=f"w{i}", latency_ms=args.latency_ms, max_concurrent=WORKER_SLOTS
                ).start()
            )
        slots = math.ceil(callers / WORKERS)
        contenders.append(PoolContender("npu_sync pool (default config)", workers, callers, None))
        contenders.append(
            PoolContender("npu_sync pool (slots for every caller)", workers, callers, slots)
        )
        contenders.append(HAProxyAiohttpContender(workers, callers, binary))
        contenders.append(BareThreadsReference(workers, callers))
        if args.only:
            for contender in contenders:
                if not any(part in contender.name for part in args.only):
                    contender.close()
            contenders = [c for c in contenders if any(p in c.name for p in args.only)]
        print(f"pid {os.getpid()}: {', '.join(c.name for c in contenders)}", file=sys.stderr)
        for contender in contenders:
            contender.run(0, callers * 4)
        for round_ in range(1, args.rounds + 1):
            order = contenders if round_ % 2 else contenders[::-1]
            for contender in order:
                before = sum(process_cpu(w.pid) for w in workers)
                locks = LOCKS.snapshot() if LOCKS is not None else None
                run = contender.run(round_, args.tasks)
                run.worker_cpu_s = sum(process_cpu(w.pid) for w in workers) - before
                if LOCKS is not None and locks is not None:
                    run.locks = LockCounts.since(locks, LOCKS.snapshot())
                runs.append(run)
                print(
                    f"round {round_}: {run.contender}: {run.tasks_per_s:.0f} tasks/s,"
                    f" {run.failed} failed",
                    file=sys.stderr,
                )
    finally:
        for contender in contenders:
            with contextlib.suppress(Exception):
                contender.close()
        for worker in workers:
            with contextlib.suppress(Exception):
                worker.stop()
    load_after = os.getloadavg()
    figures = summary(runs)
    print(
        f"{callers} callers, {WORKERS} workers x {args.latency_ms:g} ms, {args.rounds} rounds"
        f" of {args.tasks} tasks; {os.cpu_count()} CPUs, Python {sys.version.split()[0]},"
        f" aiohttp {aiohttp.__version__}; load average {load_before[0]:.2f} before,"
        f" {load_after[0]:.2f} after"
    )
    print("medians over the rounds (min-max); p50/p99 over every task of every round")
    print(table(figures))
    for name, f in figures.items():
        if name != ANCHOR and f["ratio_vs_anchor"]:
            print(
                f"{name}: median throughput {_med(f['ratio_vs_anchor'], '.2f')}x"
                f" {ANCHOR}'s (per round, same round)"
            )
    for name, f in figures.items():
        if f.get("locks_per_task"):
            print(f"{name}: the package's locks, per task")
            for where, n in sorted(f["locks_per_task"].items(), key=lambda kv: -kv[1]):
                print(f"  {n:7.3f}  {'acquired' if where == 'acquired' else 'blocked at ' + where}")
    if args.json:
        document = {
            "settings": {**vars(args), "workers": WORKERS, "worker_slots": WORKER_SLOTS},
            "load_average": {"before": load_before, "after": load_after},
            "runs": [{k: v for k, v in asdict(r).items() if k != "latencies"} for r in runs],
            "summary": figures,
        }
        Path(args.json).write_text(json.dumps(document, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
