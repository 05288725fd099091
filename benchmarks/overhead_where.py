"""Where pool.execute's time over a bare built-in call goes, on real sockets.

    python -m benchmarks.overhead_where [rounds]

``benchmarks/test_overhead.py::test_execute_overhead_by_fleet`` gives the ratios; this
takes them apart. Four fleets, as there: a worker that answers at once
(``benchmarks/instant_worker.py``) and the reference worker, 1 and 10 of each, every
worker a process of its own, health checks off. Calls are interleaved one by one.

1. **Split.** Each call cut in three by clock reads around the transport's
   ``request()``: *before* (the pool: the task, its id and body, the lease; the bare
   call: encoding the body), *transport* (the request written, the wait, the answer
   parsed; the same code for both) and *after* (the pool: classifying the answer,
   the books; the bare call: decoding the JSON). Wall clock and the calling thread's
   CPU time (``time.thread_time``), medians. The bare call goes to the worker that
   answered the pool's last task, so both wake the same worker processes. Also
   counted: connections the pool opened while timed (a worker left idle for
   ``transport.idle_timeout`` is connected to again).
2. **After a round trip.** The pool's own work on a transport of its own that answers
   at once (no socket: what ``test_the_pools_own_work_per_task`` times), and a bare
   call's JSON encoding and decoding, timed in a row (20 calls, the last 10 kept) and
   each right after a blocking round trip to the fleet's workers (round-robin): what
   the same Python work costs once the caller has slept while a worker process ran.
3. **Wake-ups.** The bare call on one worker, round-robin over 10 worker processes,
   and round-robin over 10 ports of one process (instant workers only): what waking a
   different process each time costs, apart from any client work.

Timings move with the machine's load: compare figures of one run only.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from benchmarks.instant_worker import InstantWorkers
from npu_sync import WorkerPool
from npu_sync.config import HealthConfig, PoolConfig, TransportConfig, worker_config
from npu_sync.transport import Response, make_transport
from npu_sync.transport._builtin import BuiltinTransport
from npu_sync.worker_server import LocalWorker

PAYLOAD = {"model_id": "default", "input_text": "benchmark", "max_tokens": 16}
HEADERS = {"X-NPU-Task-Id": "0" * 32, "X-NPU-Attempt": "1"}
FLEET = 10
_pc, _tt = time.perf_counter, time.thread_time

# Clock reads around every BuiltinTransport.request (the pool's and the bare calls'):
# wall and CPU on the way in, then on the way out.
_stamps = [0.0, 0.0, 0.0, 0.0]
_connects = [0]
_request = BuiltinTransport.request
_connect = BuiltinTransport._connect


def _stamped(self: BuiltinTransport, *args: Any, **kwargs: Any) -> Response:
    _stamps[1] = _tt()
    _stamps[0] = _pc()
    try:
        return _request(self, *args, **kwargs)
    finally:
        _stamps[2] = _pc()
        _stamps[3] = _tt()


def _counted(self: BuiltinTransport, *args: Any, **kwargs: Any) -> Any:
    _connects[0] += 1
    return _connect(self, *args, **kwargs)


def _bare(url: str) -> tuple[Callable[[], Any], Callable[[], None]]:
    transport = make_transport(worker_config("bare", url, max_concurrent=4), TransportConfig())

    def call() -> Any:
        body = json.dumps(PAYLOAD).encode()
        response = transport.request(
            "POST", "/inference", body=body, headers=HEADERS, timeout=20.0, connect_timeout=2.0
        )
        return json.loads(response.body)

    return call, transport.close


def _pool(urls: list[str], **options: Any) -> WorkerPool:
    config = PoolConfig(
        workers=tuple(worker_config(f"w{i}", url, max_concurrent=8) for i, url in enumerate(urls)),
        health=HealthConfig(enabled=False),
    )
    return WorkerPool(config, **options)


class FollowTheLast:
    """Bare calls to the worker that answered the last tracked task: timed beside a
    pool, they wake the same worker processes as its tasks, so that what differs is
    the pool's work in the client. Each worker's bare call is closed with ``stack``."""

    def __init__(self, urls: list[str], stack: ExitStack) -> None:
        calls = []
        for url in urls:
            call, close = _bare(url)
            stack.callback(close)
            calls.append(call)
        self.by_id = {call()["worker_id"]: call for call in calls}
        self.last = next(iter(self.by_id))

    def bare(self) -> Any:
        return self.by_id[self.last]()

    def tracked(self, execute: Callable[[Any], Any]) -> Callable[[], Any]:
        """``execute(PAYLOAD)``, its answer's worker remembered for the next bare call."""

        def call() -> Any:
            result = execute(PAYLOAD)
            self.last = result["worker_id"]
            return result

        return call


def _round_robin(calls: list[Callable[[], Any]]) -> Callable[[], Any]:
    turn = [0]

    def call() -> Any:
        i = turn[0]
        turn[0] = (i + 1) % len(calls)
        return calls[i]()

    return call


def _median_us(values: list[float]) -> float:
    return statistics.median(values) * 1e6


def split(urls: list[str], rounds: int) -> list[str]:
    """Part 1 for one fleet: the table's lines."""
    lines = []
    with ExitStack() as stack:
        pool = stack.enter_context(_pool(urls))
        follow = FollowTheLast(urls, stack)
        contenders = {"bare": follow.bare, "pool": follow.tracked(pool.execute)}
        rows: dict[str, list[tuple[float, ...]]] = {name: [] for name in contenders}
        names = list(contenders)
        for i in range(rounds + 300):
            if i == 300:
                _connects[0] = 0
            shift = i % 2
            for name in names[shift:] + names[:shift]:
                fn = contenders[name]
                c0 = _tt()
                t0 = _pc()
                fn()
                t1 = _pc()
                c1 = _tt()
                if i >= 300:
                    w0, k0, w1, k1 = _stamps
                    rows[name].append(
                        (t1 - t0, w0 - t0, w1 - w0, t1 - w1, c1 - c0, k0 - c0, k1 - k0, c1 - k1)
                    )
        medians = {
            name: [_median_us(list(column)) for column in zip(*rows[name], strict=True)]
            for name in names
        }
        for name in names:
            m = medians[name]
            lines.append(
                f"  {name:5s} wall {m[0]:6.1f} = {m[1]:5.1f} + {m[2]:6.1f} + {m[3]:5.1f}"
                f"   CPU {m[4]:6.1f} = {m[5]:5.1f} + {m[6]:5.1f} + {m[7]:5.1f}"
            )
        d = [p - b for p, b in zip(medians["pool"], medians["bare"], strict=True)]
        lines.append(
            f"  pool - bare: wall {d[0]:+.1f} (before {d[1]:+.1f}, transport {d[2]:+.1f}, "
            f"after {d[3]:+.1f}); CPU {d[4]:+.1f} (before {d[5]:+.1f}, transport {d[6]:+.1f}, "
            f"after {d[7]:+.1f}); connections opened by the pool: {_connects[0]}"
        )
    return lines


class _Instant:
    """A transport that answers at once: what is left is the pool's own work."""

    cancellable = False

    def __init__(self, answer: Response) -> None:
        self.answer = answer

    def request(self, method: str, path: str, **options: Any) -> Response:
        return self.answer

    def close(self) -> None:
        pass


def after_round_trip(urls: list[str], rounds: int) -> list[str]:
    """Part 2 for one fleet: the table's lines."""
    with ExitStack() as stack:
        trips = []
        for url in urls:
            call, close = _bare(url)
            stack.callback(close)
            trips.append(call)
        round_trip = _round_robin(trips)
        body = json.dumps(trips[0]()).encode()  # a real answer of this fleet's workers
        answer = Response(200, {"content-type": "application/json"}, body)
        instant = _Instant(answer)
        pool = stack.enter_context(_pool(urls, transport_factory=lambda *a, **k: instant))

        def bare() -> Any:
            body = json.dumps(PAYLOAD).encode()
            return json.loads(instant.request("POST", "/inference", body=body).body)

        work = {"bare encode + decode": bare, "pool.execute": lambda: pool.execute(PAYLOAD)}
        warm: dict[str, list[float]] = {name: [] for name in work}
        cold: dict[str, list[float]] = {name: [] for name in work}
        for i in range(rounds // 10 + 30):
            for name, fn in work.items():
                for j in range(20):
                    c0 = _tt()
                    fn()
                    if j >= 10 and i >= 30:
                        warm[name].append(_tt() - c0)
                for _ in range(10):
                    round_trip()
                    c0 = _tt()
                    fn()
                    if i >= 30:
                        cold[name].append(_tt() - c0)
    lines = []
    for name in work:
        w, c = _median_us(warm[name]), _median_us(cold[name])
        lines.append(f"  {name:21s} in a row {w:5.1f}   after a round trip {c:5.1f} ({c / w:.2f}x)")
    gap_warm = _median_us(warm["pool.execute"]) - _median_us(warm["bare encode + decode"])
    gap_cold = _median_us(cold["pool.execute"]) - _median_us(cold["bare encode + decode"])
    lines.append(f"  pool - bare: in a row {gap_warm:+.1f}, after a round trip {gap_cold:+.1f}")
    return lines


def wake_ups(rounds: int) -> list[str]:
    """Part 3: the table's lines."""
    with ExitStack() as stack:
        processes = stack.enter_context(InstantWorkers(processes=FLEET)).urls
        ports = stack.enter_context(InstantWorkers(processes=1, ports_each=FLEET)).urls
        calls = {}
        for name, urls in (("processes", processes), ("ports", ports)):
            made = []
            for url in urls:
                call, close = _bare(url)
                stack.callback(close)
                made.append(call)
            calls[name] = made
        contenders = {
            "one worker": calls["processes"][0],
            f"round-robin over {FLEET} processes": _round_robin(calls["processes"]),
            f"round-robin over {FLEET} ports of one process": _round_robin(calls["ports"]),
        }
        names = list(contenders)
        wall: dict[str, list[float]] = {name: [] for name in names}
        cpu: dict[str, list[float]] = {name: [] for name in names}
        for i in range(rounds + 300):
            shift = i % len(names)
            for name in names[shift:] + names[:shift]:
                c0 = _tt()
                t0 = _pc()
                contenders[name]()
                t1 = _pc()
                c1 = _tt()
                if i >= 300:
                    wall[name].append(t1 - t0)
                    cpu[name].append(c1 - c0)
    base = _median_us(wall["one worker"])
    return [
        f"  {name:42s} wall {_median_us(wall[name]):6.1f} "
        f"({_median_us(wall[name]) / base:.2f}x)   CPU {_median_us(cpu[name]):5.1f}"
        for name in names
    ]


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    BuiltinTransport.request = _stamped  # type: ignore[method-assign]
    BuiltinTransport._connect = _counted  # type: ignore[method-assign]
    with ExitStack() as stack:
        reference = [
            stack.enter_context(LocalWorker(worker_id=f"ref{i}", max_concurrent=256).start())
            for i in range(FLEET)
        ]
        fleets = {
            "instant": stack.enter_context(InstantWorkers(processes=FLEET)).urls,
            "reference": [worker.url for worker in reference],
        }
        print("1. Split, median µs: wall = before + transport + after; CPU likewise")
        for kind, urls in fleets.items():
            for size in (1, FLEET):
                print(f"{kind}, {size} worker{'s' if size > 1 else ''}:")
                print("\n".join(split(urls[:size], rounds)))
        print("\n2. The same Python work in a row and right after a round trip, CPU µs (median)")
        for kind, urls in fleets.items():
            for size in (1, FLEET):
                print(f"{kind}, {size} worker{'s' if size > 1 else ''}:")
                print("\n".join(after_round_trip(urls[:size], rounds)))
    print("\n3. Wake-ups: bare calls to instant workers, median µs (ratio to one worker)")
    print("\n".join(wake_ups(rounds)))


if __name__ == "__main__":
    main()
