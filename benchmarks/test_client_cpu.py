"""Client CPU per task: the built-in transport against other HTTP clients, side by side.

One reference worker answering at once (latency 0) in a child process, so its CPU is
not counted and the client's own cost is as large a share of a task as it can be.
Every contender sends the same request (the pool's JSON body and headers) and decodes
the JSON answer:

* ``builtin transport``: :meth:`BuiltinTransport.request` and ``json.loads``;
* ``pool.execute (builtin)`` / ``pool.execute (urllib3)``: a one-worker
  :class:`WorkerPool` (health checks off) on that client;
* ``http.client``: one ``HTTPConnection`` per thread, kept alive;
* ``urllib3``: one ``HTTPConnectionPool`` shared by the threads;
* ``asyncio+aiohttp``: one ``ClientSession`` on an event loop in its own thread, with
  as many tasks as the others have threads.

With 1 caller, CPU is the calling thread's (``time.thread_time()``; for aiohttp, the
loop thread's). With 32 callers it is the whole process's (``time.process_time()``),
which includes GIL hand-overs and futex wake-ups between threads, and context switches
are read from ``getrusage(RUSAGE_SELF)`` (``/proc/self/status`` counts only the main
thread's). Rounds rotate through the contenders so that noise from other work on the
machine hits all of them alike; the figure is the median round. ``-s`` prints the table.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import resource
import statistics
import threading
import time
import timeit
from collections.abc import Callable
from typing import Any

import pytest
import urllib3

from benchmarks.conftest import report
from npu_sync import WorkerPool
from npu_sync.config import HealthConfig, PoolConfig, TLSConfig, TransportConfig, worker_config
from npu_sync.transport import BuiltinTransport
from npu_sync.transport import _http11 as h11

try:
    import aiohttp
except ImportError:  # pragma: no cover - depends on the environment
    aiohttp = None  # type: ignore[assignment]

PAYLOAD = {"model_id": "default", "input_text": "benchmark", "max_tokens": 16}
HEADERS = {
    "User-Agent": "npu-sync",
    "Content-Type": "application/json",
    "X-NPU-Task-Id": "0" * 32,
    "X-NPU-Attempt": "1",
}
CALL_HEADERS = {"X-NPU-Task-Id": "0" * 32, "X-NPU-Attempt": "1"}
TASKS = 1000  # per round
ROUNDS = 7
WARMUP = 200
THREADS = (1, 32)


class Batch:
    """What one round of one contender cost."""

    def __init__(self, tasks: int, cpu_s: float, switches: int) -> None:
        self.tasks = tasks
        self.cpu_us = cpu_s / tasks * 1e6
        self.switches = switches / tasks


def _switches() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw


def run_threads(call: Callable[[], object], tasks: int, threads: int) -> Batch:
    """``tasks`` calls on ``threads`` threads (the calling thread when 1)."""
    if threads == 1:
        s0, c0 = _switches(), time.thread_time()
        for _ in range(tasks):
            call()
        return Batch(tasks, time.thread_time() - c0, _switches() - s0)
    claim = itertools.count()
    start = threading.Barrier(threads + 1)
    failures: list[BaseException] = []

    def loop() -> None:
        start.wait()
        try:
            while next(claim) < tasks:
                call()
        except BaseException as exc:
            failures.append(exc)

    workers = [threading.Thread(target=loop, name=f"cpu-bench-{i}") for i in range(threads)]
    for worker in workers:
        worker.start()
    s0, c0 = _switches(), time.process_time()
    start.wait()
    for worker in workers:
        worker.join()
    batch = Batch(tasks, time.process_time() - c0, _switches() - s0)
    if failures:
        raise failures[0]
    return batch


class ThreadContender:
    """A blocking call made from ``threads`` threads."""

    def __init__(self, name: str, call: Callable[[], object], close: Callable[[], None]) -> None:
        self.name = name
        self._call = call
        self._close = close

    def run(self, tasks: int, threads: int) -> Batch:
        return run_threads(self._call, tasks, threads)

    def close(self) -> None:
        self._close()


class AiohttpContender:
    """aiohttp on an event loop in its own thread, ``threads`` tasks in flight."""

    name = "asyncio+aiohttp"

    def __init__(self, url: str) -> None:
        self._url = url + "/inference"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cpu-bench-loop")
        self._thread.start()
        self._session = self._on_loop(self._open())

    def _on_loop(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(300)

    async def _open(self) -> Any:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))

    async def _call(self) -> Any:
        async with self._session.post(
            self._url, data=json.dumps(PAYLOAD).encode(), headers=HEADERS
        ) as response:
            return json.loads(await response.read())

    async def _batch(self, tasks: int, threads: int) -> tuple[float, int]:
        claim = itertools.count()

        async def loop() -> None:
            while next(claim) < tasks:
                await self._call()

        s0, c0 = _switches(), time.thread_time()
        await asyncio.gather(*(loop() for _ in range(threads)))
        return time.thread_time() - c0, _switches() - s0

    def run(self, tasks: int, threads: int) -> Batch:
        if threads == 1:
            cpu, switches = self._on_loop(self._batch(tasks, 1))
            return Batch(tasks, cpu, switches)
        s0, c0 = _switches(), time.process_time()
        self._on_loop(self._batch(tasks, threads))
        return Batch(tasks, time.process_time() - c0, _switches() - s0)

    def close(self) -> None:
        self._on_loop(self._session.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def builtin_transport(url: str) -> ThreadContender:
    transport = BuiltinTransport(
        worker_config("bench", url), tls=TLSConfig(), max_response_bytes=1 << 24, maxsize=64
    )

    def call() -> Any:
        body = json.dumps(PAYLOAD).encode()
        response = transport.request(
            "POST", "/inference", body=body, headers=CALL_HEADERS, timeout=30.0,
            connect_timeout=2.0,
        )  # fmt: skip
        return json.loads(response.body)

    return ThreadContender("builtin transport", call, transport.close)


def pool_execute(url: str, client: str) -> ThreadContender:
    config = PoolConfig(
        workers=(worker_config("bench", url, max_concurrent=64),),
        health=HealthConfig(enabled=False),
        transport=TransportConfig(client=client),
    )
    pool = WorkerPool(config)
    return ThreadContender(f"pool.execute ({client})", lambda: pool.execute(PAYLOAD), pool.close)


def bare_http_client(url: str) -> ThreadContender:
    host, port = url.removeprefix("http://").split(":")
    local = threading.local()
    opened: list[http.client.HTTPConnection] = []
    lock = threading.Lock()

    def call() -> Any:
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = http.client.HTTPConnection(host, int(port), timeout=30.0)
            with lock:
                opened.append(conn)
        conn.request("POST", "/inference", body=json.dumps(PAYLOAD).encode(), headers=HEADERS)
        return json.loads(conn.getresponse().read())

    def close() -> None:
        for conn in opened:
            conn.close()

    return ThreadContender("http.client", call, close)


def bare_urllib3(url: str) -> ThreadContender:
    host, port = url.removeprefix("http://").split(":")
    pool = urllib3.HTTPConnectionPool(host, int(port), maxsize=64, block=False, retries=False)
    timeout = urllib3.Timeout(connect=2.0, read=30.0)

    def call() -> Any:
        response = pool.urlopen(
            "POST", "/inference", body=json.dumps(PAYLOAD).encode(), headers=HEADERS,
            timeout=timeout, redirect=False,
        )  # fmt: skip
        return json.loads(response.data)

    return ThreadContender("urllib3", call, pool.close)


def test_client_cpu_per_task(benchmark, fast_worker):
    """Client CPU per task at 1 and 32 callers, every contender against aiohttp."""
    if aiohttp is None:
        pytest.skip("aiohttp is not installed (pip install aiohttp)")
    url = fast_worker.url
    contenders: list[Any] = [
        builtin_transport(url),
        pool_execute(url, "builtin"),
        pool_execute(url, "urllib3"),
        bare_http_client(url),
        bare_urllib3(url),
        AiohttpContender(url),
    ]
    figures: dict[int, dict[str, list[Batch]]] = {
        n: {c.name: [] for c in contenders} for n in THREADS
    }
    try:
        for threads in THREADS:
            for contender in contenders:
                contender.run(WARMUP, threads)
            for i in range(ROUNDS):
                shift = i % len(contenders)
                for contender in contenders[shift:] + contenders[:shift]:
                    figures[threads][contender.name].append(contender.run(TASKS, threads))
    finally:
        for contender in contenders:
            contender.close()
    summary: dict[str, dict[str, float]] = {}
    for contender in contenders:
        row: dict[str, float] = {}
        for threads in THREADS:
            batches = figures[threads][contender.name]
            row[f"cpu_us_{threads}"] = statistics.median(b.cpu_us for b in batches)
            row[f"switches_{threads}"] = statistics.median(b.switches for b in batches)
        summary[contender.name] = row
    base = summary[AiohttpContender.name]
    for row in summary.values():
        for threads in THREADS:
            row[f"vs_aiohttp_{threads}"] = row[f"cpu_us_{threads}"] / base[f"cpu_us_{threads}"]
    benchmark.extra_info.update({"client_cpu": summary})
    report(
        "client CPU per task (one loopback worker answering at once; median of "
        f"{ROUNDS} rounds of {TASKS})",
        [("contender", "1 thread µs", "vs aiohttp", "32 threads µs", "vs aiohttp", "ctx sw/task")]
        + [
            (
                name,
                f"{row['cpu_us_1']:.0f}",
                f"{row['vs_aiohttp_1']:.2f}",
                f"{row['cpu_us_32']:.0f}",
                f"{row['vs_aiohttp_32']:.2f}",
                f"{row['switches_32']:.2f}",
            )
            for name, row in summary.items()
        ],
    )
    single = builtin_transport(url)
    try:
        benchmark.pedantic(single.run, args=(1, 1), rounds=500, warmup_rounds=50)
    finally:
        single.close()


# -- parsing one answer ---------------------------------------------------------------

ANSWER = (
    b"HTTP/1.1 200 OK\r\nServer: BaseHTTP/0.6 Python/3.11.7\r\n"
    b"Date: Mon, 30 Nov 2026 21:25:25 GMT\r\nContent-Type: application/json\r\n"
    b"Content-Length: 203\r\n\r\n"
    b'{"model_id":"default","device":"NPU (simulated)","response":"[default] 1 word(s), '
    b'digest 8f434346648f6b96: hi","inference_time_ms":0.005,"inference_count":1,'
    b'"worker_id":"x","task_id":null,"attempt":null}'
)


def parse_stdlib(buf: bytearray, end: int) -> tuple[int, dict[str, str], bytes]:
    """What the built-in transport does with an answer already in its read buffer."""
    at = buf.find(b"\r\n\r\n", 0, end)
    version, status, headers = h11.parse_head(str(memoryview(buf)[:at], "latin-1"))
    length = h11.content_length(headers["content-length"])
    with memoryview(buf) as view:
        body = bytes(view[at + 4 : at + 4 + length])
    h11.keeps_alive(version, headers)
    return status, headers, body


class _Collect:
    __slots__ = ("body", "headers")

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        old = self.headers.get(key)
        self.headers[key] = text if old is None else f"{old}, {text}"

    def on_body(self, body: bytes) -> None:
        self.body.append(body)


def test_parse_cost_stdlib_against_httptools(benchmark):
    """Parsing one typical answer into status, merged headers and body, both ways."""
    httptools = pytest.importorskip("httptools")
    buf = bytearray(16384)
    buf[: len(ANSWER)] = ANSWER
    end = len(ANSWER)

    def with_httptools() -> tuple[int, dict[str, str], bytes]:
        collect = _Collect()
        parser = httptools.HttpResponseParser(collect)
        parser.feed_data(memoryview(buf)[:end])
        return parser.get_status_code(), collect.headers, b"".join(collect.body)

    assert parse_stdlib(buf, end) == with_httptools()
    figures = {}
    for name, fn in (("stdlib", lambda: parse_stdlib(buf, end)), ("httptools", with_httptools)):
        figures[name] = min(timeit.repeat(fn, number=20_000, repeat=7)) / 20_000 * 1e6
    benchmark.extra_info.update({"parse_us": figures})
    report(
        "parsing one answer (status line, 4 headers, 203-byte body)",
        [("parser", "µs")] + [(k, f"{v:.2f}") for k, v in figures.items()],
    )
    benchmark(lambda: parse_stdlib(buf, end))
