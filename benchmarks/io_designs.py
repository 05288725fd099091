"""Two I/O designs for many caller threads, side by side: each caller blocking in its own
``recv`` (today's), against one I/O thread multiplexing every socket with ``selectors``.

Usage, from a clone::

    python benchmarks/io_designs.py [--callers 8,128,256] [--rounds 3] [--tasks 4000]
        [--latency-ms 20] [--extra-us 25] [--io-threads 1] [--json PATH] [--only NAME ...]

    python benchmarks/io_designs.py --tasks 2000 --rounds 2      # a quick look

No pool in any contender: bare HTTP/1.1 clients, so that the figures are the design's.
Three reference workers (:class:`~npu_sync.worker_server.LocalWorker`), each in its own
process on loopback, ``--latency-ms`` a task, 256 slots each so that they never refuse.
For each caller count, every contender keeps that many tasks in flight from that many
caller threads; caller ``i`` owns keep-alive connection ``i`` (to worker ``i % 3``), and
the contenders of one caller count share those connections (all but the built-in
transport's, which keeps its own), so the workers see the same sockets whichever design
drives them. Every task sends the same bytes (``POST /inference``, a small JSON body)
and reads the answer's head and its ``Content-Length`` body in full with the same
parser (the built-in transport uses its own), then decodes the JSON body.

* ``a: blocking socket per caller``: today's design. The caller thread sends on its own
  blocking socket (kernel timeouts, ``SO_RCVTIMEO``, as the built-in transport sets
  them: one system call per read) and blocks in ``recv`` until its answer is whole.
* ``a: built-in transport``: the same design in the package's own code,
  ``BuiltinTransport.request()`` (one transport per worker, its idle connections).
* ``b: selector thread, Lock``: one I/O thread owns every socket (non-blocking,
  registered with a ``selectors.DefaultSelector``). A caller appends its connection to a
  ``collections.deque`` (no lock), wakes the selector through an ``os.eventfd`` (only
  when the I/O thread is asleep in ``select()``, and once per sleep), and blocks on its
  own ``threading.Lock``, held at rest, which the I/O thread releases once it has
  written the request, read the answer and parsed its head. The caller decodes the JSON.
* ``b: selector thread, Event``: the same, the caller waiting on a ``threading.Event``.
* ``c: selector thread decodes JSON, Lock``: design b whose I/O thread also decodes the
  JSON body before waking the caller.
* ``b: caller sends, selector thread reads, Lock``: design b whose callers write their
  own requests on their non-blocking sockets (one ``send``, as in design a), so that no
  wake-up of the selector is needed; the I/O thread only reads (and sends what the
  kernel did not take at once, which a request this small never leaves).
* ``d: a + N µs Python`` (``--extra-us N``, repeatable as ``25,75``): design a with N µs
  of pure Python a task on the caller's thread (a busy loop calibrated at start-up,
  half before sending, half after the answer), to see how switches and CPU grow with
  the Python a task runs while holding the GIL; ``d: b + N µs Python`` and
  ``d: b, caller sends + N µs Python`` the same on design b and its variant.
* ``--io-threads 1,2`` adds design b with two I/O threads (connection ``i`` on thread
  ``i % 2``).

Each contender runs ``callers`` x 4 warm-up tasks, then ``--rounds`` rounds of
``--tasks`` tasks, the contenders' order rotated from round to round so that other work
on the machine hits each alike. Per contender and caller count: tasks/s; p50 and p99 of
every task's latency as its caller saw it; client CPU per task (``time.process_time()``,
every thread of this process, the I/O threads included); context switches per task
(``getrusage(RUSAGE_SELF)``, voluntary and involuntary, every thread's); each round's
CPU and switches against design a's in the same round; for design b, ``select()``
returns and eventfd wake-ups per task; the workers' CPU per task (they share the
machine's cores). Not run by pytest: it measures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import selectors
import socket
import statistics
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.callers_256 import _med, _pct, own_usage, process_cpu, run_threads
from npu_sync.config import TLSConfig, worker_config
from npu_sync.errors import NpuSyncError
from npu_sync.transport import BuiltinTransport
from npu_sync.worker_server import LocalWorker

PAYLOAD = {"model_id": "default", "input_text": "benchmark", "max_tokens": 16}
BODY = json.dumps(PAYLOAD).encode()
REQUEST = (
    "POST /inference HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n"
).encode() + BODY
WORKERS = 3
WORKER_SLOTS = 256
READ_SIZE = 65536
CONNECT_TIMEOUT = 2.0
READ_TIMEOUT = 30.0
BASELINE = "a: blocking socket per caller"

# -- pure Python work of a known length ------------------------------------------------


def spin(n: int) -> None:
    """Pure Python, holding the GIL throughout: ``n`` turns of an empty loop."""
    for _ in itertools.repeat(None, n):
        pass


def calibrate(micros: float) -> tuple[int, float]:
    """Turns of :func:`spin` that take ``micros`` µs of this thread's CPU, and the µs a
    turn took (the fastest of several measurements: other work only slows it)."""
    if micros <= 0:
        return 0, 0.0
    turns = 200_000
    best = min(_timed_spin(turns) for _ in range(15))
    per_turn_us = best / turns * 1e6
    return max(1, round(micros / per_turn_us)), per_turn_us


def _timed_spin(turns: int) -> float:
    t0 = time.thread_time()
    spin(turns)
    return time.thread_time() - t0


# -- one HTTP/1.1 answer, parsed as its bytes come --------------------------------------


class Answer:
    """The answer to one request on a keep-alive connection, ``Content-Length`` framed.

    :meth:`feed` takes bytes as they are read and says when the answer is whole; then
    ``status`` (the three digits) and ``body`` hold it. The same code for every design.
    """

    __slots__ = ("body", "buf", "need", "start", "status")

    def __init__(self) -> None:
        self.buf = b""
        self.need = -1
        self.start = 0
        self.status = b""
        self.body = b""

    def feed(self, data: bytes) -> bool:
        """Take the next bytes read; True once the answer is whole.

        Raises:
            ValueError: not an answer this benchmark can read.
        """
        buf = self.buf + data if self.buf else data
        need = self.need
        if need < 0:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self.buf = buf
                return False
            head = buf[:end].lower()
            at = head.find(b"\r\ncontent-length:")
            if at < 0:
                raise ValueError("no Content-Length")
            stop = head.find(b"\r\n", at + 17)
            length = int(head[at + 17 :] if stop < 0 else head[at + 17 : stop])
            self.status = buf[9:12]
            self.start = end + 4
            need = self.need = end + 4 + length
        if len(buf) < need:
            self.buf = buf
            return False
        if len(buf) > need:
            raise ValueError("bytes after the answer")
        self.body = buf[self.start :]
        self.buf = b""
        self.need = -1
        return True


_TIMEVAL = struct.Struct("@ll")


class Conn:
    """Caller ``i``'s keep-alive connection, and what design b hands over with it."""

    __slots__ = (
        "address",
        "answer",
        "engine",
        "event",
        "lock",
        "ok",
        "out",
        "registered",
        "result",
        "sock",
    )

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        self.sock: socket.socket | None = None
        self.answer = Answer()
        # Design b: the caller's wake-ups. The lock is held at rest: the caller blocks
        # acquiring it, the I/O thread's release hands it over, and it is held again.
        self.lock = threading.Lock()
        self.lock.acquire()
        self.event = threading.Event()
        self.ok = False
        self.result: Any = None
        self.out: memoryview | None = None  # a request the kernel took only part of
        self.registered = False
        self.engine: SelectorEngine | None = None
        self.connect()

    def connect(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=CONNECT_TIMEOUT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Blocking, with kernel timeouts as the built-in transport sets them on Linux: a
        # read is one system call (a Python socket timeout would add a poll() to each).
        sock.settimeout(None)
        wait = _TIMEVAL.pack(int(READ_TIMEOUT), 0)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, wait)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, wait)
        self.sock = sock
        self.answer = Answer()
        self.registered = False
        self.out = None
        return sock

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()


# -- the I/O thread of design b -----------------------------------------------------------


class SelectorEngine:
    """One I/O thread multiplexing its connections with ``selectors.DefaultSelector``.

    Callers hand it a connection with :meth:`submit` (a deque append, and a wake-up of
    the selector only when the thread sleeps in ``select()``); it writes the request,
    reads and parses the answer (and with ``decode`` the JSON body), then wakes the
    caller with ``wake`` (the connection's lock released, or its event set).
    """

    def __init__(self, conns: Sequence[Conn], wake: str, decode: bool) -> None:
        self.sel = selectors.DefaultSelector()
        self.pending: deque[Conn] = deque()
        self.armed = False
        self.stopping = False
        self.decode = decode
        self.wake_event = wake == "event"
        self.selects = 0
        self.kicks = itertools.count()
        if hasattr(os, "eventfd"):
            self.rfd = self.wfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._pair: tuple[socket.socket, socket.socket] | None = None
        else:  # pragma: no cover - not Linux
            self._pair = socket.socketpair()
            for s in self._pair:
                s.setblocking(False)
            self.rfd, self.wfd = self._pair[0].fileno(), self._pair[1].fileno()
        self.sel.register(self.rfd, selectors.EVENT_READ, None)
        self.conns = list(conns)
        for conn in self.conns:
            conn.engine = self
            if conn.sock is not None:
                conn.sock.setblocking(False)
                self.sel.register(conn.sock, selectors.EVENT_READ, conn)
                conn.registered = True
        self.thread = threading.Thread(target=self._loop, name="bench-io", daemon=True)
        self.thread.start()

    # Called on the callers' threads.
    def submit(self, conn: Conn) -> None:
        self.pending.append(conn)
        if self.armed:
            # Several callers may get here before the thread wakes: one write is enough.
            self.armed = False
            next(self.kicks)
            self._kick()

    def _kick(self) -> None:
        if self._pair is None:
            os.eventfd_write(self.wfd, 1)
        else:  # pragma: no cover - not Linux
            with contextlib.suppress(BlockingIOError):
                os.write(self.wfd, b"\0")

    def _drain_kicks(self) -> None:
        with contextlib.suppress(BlockingIOError):
            if self._pair is None:
                os.eventfd_read(self.rfd)
            else:  # pragma: no cover - not Linux
                os.read(self.rfd, 4096)

    # The I/O thread.
    def _loop(self) -> None:
        pending = self.pending
        select = self.sel.select
        send = self._send
        read = self._read
        while True:
            while pending:
                send(pending.popleft())
            if self.stopping:
                return
            # A caller that appends after this sees the flag and wakes the selector; one
            # that appended before it is seen here.
            self.armed = True
            if pending:
                self.armed = False
                continue
            events = select()
            self.armed = False
            self.selects += 1
            for key, mask in events:
                conn = key.data
                if conn is None:
                    self._drain_kicks()
                    continue
                if mask & selectors.EVENT_WRITE:
                    self._send_rest(conn)
                if mask & selectors.EVENT_READ:
                    read(conn)

    def _send(self, conn: Conn) -> None:
        sock = conn.sock
        if sock is None:
            self._fail(conn)
            return
        if not conn.registered:  # reconnected by its caller after a failure
            sock.setblocking(False)
            self.sel.register(sock, selectors.EVENT_READ, conn)
            conn.registered = True
        if conn.out is not None:  # the rest of a request its caller began to send
            self.sel.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
            return
        try:
            sent = sock.send(REQUEST)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._fail(conn)
            return
        if sent < len(REQUEST):
            conn.out = memoryview(REQUEST)[sent:]
            self.sel.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)

    def _send_rest(self, conn: Conn) -> None:
        sock, out = conn.sock, conn.out
        if sock is None or out is None:
            return
        try:
            sent = sock.send(out)
        except BlockingIOError:
            return
        except OSError:
            self._fail(conn)
            return
        conn.out = out[sent:] if sent < len(out) else None
        if conn.out is None:
            self.sel.modify(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: Conn) -> None:
        sock = conn.sock
        if sock is None:
            return
        try:
            data = sock.recv(READ_SIZE)
        except BlockingIOError:
            return
        except OSError:
            self._fail(conn)
            return
        if not data:
            self._fail(conn)
            return
        try:
            answer = conn.answer
            if not answer.feed(data):
                return
            if self.decode:
                conn.result = json.loads(answer.body)
        except ValueError:
            self._fail(conn)
            return
        conn.ok = answer.status == b"200"
        self._wake(conn)

    def _fail(self, conn: Conn) -> None:
        if conn.registered and conn.sock is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self.sel.unregister(conn.sock)
        conn.registered = False
        conn.close()
        conn.ok = False
        self._wake(conn)

    def _wake(self, conn: Conn) -> None:
        if self.wake_event:
            conn.event.set()
        elif conn.lock.locked():  # not already released by a failure seen while idle
            conn.lock.release()

    def close(self) -> None:
        """Stop the thread; the connections go back to blocking mode for design a."""
        self.stopping = True
        self._kick()
        self.thread.join(10)
        for conn in self.conns:
            if conn.registered and conn.sock is not None:
                with contextlib.suppress(KeyError, ValueError, OSError):
                    self.sel.unregister(conn.sock)
            conn.registered = False
            conn.engine = None
            if conn.sock is not None:
                conn.sock.settimeout(None)
        self.sel.close()
        if self._pair is None:
            os.close(self.rfd)
        else:  # pragma: no cover - not Linux
            for s in self._pair:
                s.close()


# -- running N callers -----------------------------------------------------------------


@dataclass
class Run:
    """One contender's measured run."""

    callers: int
    contender: str
    round: int
    tasks: int
    elapsed_s: float
    cpu_s: float
    switches: int
    failed: int
    latencies: list[float] = field(repr=False)
    worker_cpu_s: float = 0.0
    selects: int | None = None
    kicks: int | None = None

    @property
    def tasks_per_s(self) -> float:
        return self.tasks / self.elapsed_s


class Contender(Protocol):
    name: str

    def run(self, round_: int, tasks: int) -> Run: ...

    def close(self) -> None: ...


# -- the contenders ----------------------------------------------------------------------


class BlockingSockets:
    """Design a: each caller sends on its own blocking socket and blocks in ``recv``."""

    def __init__(self, conns: list[Conn], extra_turns: int = 0, extra_us: float = 0) -> None:
        self.conns = conns
        self.before = extra_turns // 2
        self.after = extra_turns - self.before
        self.name = BASELINE if not extra_us else f"d: a + {extra_us:g} µs Python"

    def _call(self, i: int) -> bool:
        conn = self.conns[i]
        try:
            sock = conn.sock or conn.connect()
            if self.before:
                spin(self.before)
            sock.sendall(REQUEST)
            answer = conn.answer
            while True:
                data = sock.recv(READ_SIZE)
                if not data:
                    raise ConnectionResetError("closed by the worker")
                if answer.feed(data):
                    break
            json.loads(answer.body)
            if self.after:
                spin(self.after)
        except (OSError, ValueError):
            conn.close()
            return False
        return answer.status == b"200"

    def run(self, round_: int, tasks: int) -> Run:
        callers = len(self.conns)
        elapsed, cpu, switches, latencies, failed = run_threads(
            self._call, callers, tasks, own_usage
        )
        return Run(callers, self.name, round_, tasks, elapsed, cpu, switches, failed, latencies)

    def close(self) -> None:
        pass  # the connections are the caller count's, closed with it


class SelectorThread:
    """Design b (and c): one or more I/O threads; the callers wait on a Lock or Event."""

    def __init__(
        self,
        conns: list[Conn],
        *,
        wake: str = "lock",
        decode: bool = False,
        io_threads: int = 1,
        caller_sends: bool = False,
        extra_turns: int = 0,
        extra_us: float = 0,
    ) -> None:
        self.conns = conns
        self.caller_sends = caller_sends
        self.wake = wake
        self.decode = decode
        self.io_threads = io_threads
        self.before = extra_turns // 2
        self.after = extra_turns - self.before
        if extra_us:
            how = ", caller sends" if caller_sends else ""
            self.name = f"d: b{how} + {extra_us:g} µs Python"
        elif decode:
            self.name = "c: selector thread decodes JSON, Lock"
        elif caller_sends:
            self.name = "b: caller sends, selector thread reads, Lock"
        elif io_threads > 1:
            self.name = f"b: {io_threads} selector threads, Lock"
        else:
            self.name = f"b: selector thread, {wake.capitalize()}"

    def _call(self, i: int) -> bool:
        conn = self.conns[i]
        if conn.sock is None:
            try:
                conn.connect()  # registered by the I/O thread when it next sends on it
            except OSError:
                return False
        engine = conn.engine
        assert engine is not None
        if self.before:
            spin(self.before)
        if self.wake == "event":
            conn.event.clear()
            engine.submit(conn)
            if not conn.event.wait(READ_TIMEOUT):
                raise RuntimeError(f"caller {i}: no answer in {READ_TIMEOUT:g} s")
        else:
            if self.caller_sends and conn.registered:
                self._send(conn, engine)
            else:
                engine.submit(conn)
            if not conn.lock.acquire(timeout=READ_TIMEOUT):
                raise RuntimeError(f"caller {i}: no answer in {READ_TIMEOUT:g} s")
        if not conn.ok:
            return False
        if not self.decode:
            try:
                json.loads(conn.answer.body)
            except ValueError:
                return False
        if self.after:
            spin(self.after)
        return True

    @staticmethod
    def _send(conn: Conn, engine: SelectorEngine) -> None:
        """Variant: the caller writes the request on its non-blocking socket (a request
        this small is taken whole); a rest the kernel did not take goes to the I/O
        thread."""
        sock = conn.sock
        assert sock is not None
        try:
            sent = sock.send(REQUEST)
        except BlockingIOError:
            sent = 0
        except OSError:
            engine.submit(conn)  # the I/O thread fails it and wakes the caller
            return
        if sent < len(REQUEST):
            conn.out = memoryview(REQUEST)[sent:]
            engine.submit(conn)

    def run(self, round_: int, tasks: int) -> Run:
        callers = len(self.conns)
        engines = [
            SelectorEngine(self.conns[k :: self.io_threads], self.wake, self.decode)
            for k in range(self.io_threads)
        ]
        try:
            elapsed, cpu, switches, latencies, failed = run_threads(
                self._call, callers, tasks, own_usage
            )
        finally:
            for engine in engines:
                engine.close()
        run = Run(callers, self.name, round_, tasks, elapsed, cpu, switches, failed, latencies)
        run.selects = sum(e.selects for e in engines)
        run.kicks = sum(next(e.kicks) for e in engines)
        return run

    def close(self) -> None:
        pass


class TransportContender:
    """Design a in the package's own code: ``BuiltinTransport.request()``."""

    name = "a: built-in transport"

    def __init__(self, workers: Sequence[LocalWorker], callers: int) -> None:
        self.callers = callers
        self.transports = [
            BuiltinTransport(
                worker_config(w.worker_id, w.url),
                tls=TLSConfig(),
                max_response_bytes=1 << 24,
                maxsize=callers,
            )
            for w in workers
        ]
        self.headers = {"Content-Type": "application/json"}

    def _call(self, i: int) -> bool:
        transport = self.transports[i % len(self.transports)]
        try:
            response = transport.request(
                "POST",
                "/inference",
                body=BODY,
                headers=self.headers,
                timeout=READ_TIMEOUT,
                connect_timeout=CONNECT_TIMEOUT,
            )
            json.loads(response.body)
        except (NpuSyncError, ValueError):
            return False
        return response.status == 200

    def run(self, round_: int, tasks: int) -> Run:
        elapsed, cpu, switches, latencies, failed = run_threads(
            self._call, self.callers, tasks, own_usage
        )
        return Run(
            self.callers, self.name, round_, tasks, elapsed, cpu, switches, failed, latencies
        )

    def close(self) -> None:
        for transport in self.transports:
            transport.close()


# -- the report --------------------------------------------------------------------------


def summary(runs: Sequence[Run]) -> dict[str, dict[str, Any]]:
    """Per contender of one caller count: medians over its rounds, percentiles over all
    its tasks, and its CPU and switches per task against design a's in the same round."""
    base = {r.round: r for r in runs if r.contender == BASELINE}
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r.contender for r in runs):
        mine = [r for r in runs if r.contender == name]
        latencies = [x for r in mine for x in r.latencies]
        figures: dict[str, Any] = {
            "tasks_per_s": [r.tasks_per_s for r in mine],
            "p50_ms": statistics.median(latencies) * 1e3,
            "p99_ms": _pct(latencies, 99) * 1e3,
            "cpu_us": [r.cpu_s / r.tasks * 1e6 for r in mine],
            "switches": [r.switches / r.tasks for r in mine],
            "cpu_vs_a": [
                (r.cpu_s / r.tasks) / (base[r.round].cpu_s / base[r.round].tasks)
                for r in mine
                if r.round in base
            ],
            "switches_vs_a": [
                (r.switches / r.tasks) / max(1e-9, base[r.round].switches / base[r.round].tasks)
                for r in mine
                if r.round in base
            ],
            "worker_cpu_us": [r.worker_cpu_s / r.tasks * 1e6 for r in mine],
            "failed": sum(r.failed for r in mine),
        }
        if mine[0].selects is not None:
            figures["selects"] = [(r.selects or 0) / r.tasks for r in mine]
            figures["kicks"] = [(r.kicks or 0) / r.tasks for r in mine]
        out[name] = figures
    return out


def table(figures: dict[str, dict[str, Any]]) -> str:
    head = (
        "contender",
        "tasks/s",
        "p50 ms",
        "p99 ms",
        "client CPU µs/task",
        "CPU vs a",
        "switches/task",
        "switches vs a",
        "selects, wakes /task",
        "worker CPU µs/task",
        "failed",
    )
    rows = [head]
    for name, f in figures.items():
        io = "—"
        if "selects" in f:
            io = f"{_med(f['selects'], '.2f', False)}, {_med(f['kicks'], '.2f', False)}"
        rows.append(
            (
                name,
                _med(f["tasks_per_s"], ".0f"),
                f"{f['p50_ms']:.1f}",
                f"{f['p99_ms']:.1f}",
                _med(f["cpu_us"], ".0f"),
                _med(f["cpu_vs_a"], ".2f"),
                _med(f["switches"], ".2f"),
                _med(f["switches_vs_a"], ".2f"),
                io,
                _med(f["worker_cpu_us"], ".0f", False),
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


# -- the run -----------------------------------------------------------------------------


def _numbers(text: str, kind: Callable[[str], Any]) -> list[Any]:
    return [kind(part) for part in text.split(",") if part.strip()]


def contenders_for(
    workers: Sequence[LocalWorker],
    conns: list[Conn],
    extras: Sequence[tuple[float, int]],
    io_threads: Sequence[int],
) -> list[Contender]:
    callers = len(conns)
    out: list[Contender] = [
        BlockingSockets(conns),
        TransportContender(workers, callers),
        SelectorThread(conns, wake="lock"),
        SelectorThread(conns, wake="event"),
        SelectorThread(conns, wake="lock", decode=True),
        SelectorThread(conns, caller_sends=True),
    ]
    out += [SelectorThread(conns, io_threads=n) for n in io_threads if n > 1]
    for micros, turns in extras:
        out.append(BlockingSockets(conns, turns, micros))
        out.append(SelectorThread(conns, extra_turns=turns, extra_us=micros))
        out.append(SelectorThread(conns, caller_sends=True, extra_turns=turns, extra_us=micros))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--callers", default="8,128,256", help="caller counts, e.g. 8,128,256")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=4000, help="tasks per run")
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument(
        "--extra-us", default="25", help="µs of Python a task for the d contenders (0: none)"
    )
    parser.add_argument("--io-threads", default="1", help="I/O thread counts for design b")
    parser.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    parser.add_argument(
        "--only", action="append", metavar="NAME", help="run the contenders named so"
    )
    args = parser.parse_args(argv)
    counts = _numbers(args.callers, int)
    extras = [(us, calibrate(us)) for us in _numbers(args.extra_us, float) if us > 0]
    load_before = os.getloadavg()
    print(f"pid {os.getpid()}", file=sys.stderr)
    for micros, (turns, per_turn) in extras:
        print(f"{micros:g} µs of Python: {turns} turns of {per_turn * 1e3:.1f} ns", file=sys.stderr)
    workers: list[LocalWorker] = []
    runs: list[Run] = []
    try:
        for i in range(WORKERS):
            workers.append(
                LocalWorker(
                    worker_id=f"w{i}", latency_ms=args.latency_ms, max_concurrent=WORKER_SLOTS
                ).start()
            )
        addresses = [("127.0.0.1", w.port) for w in workers]
        for callers in counts:
            runs += _one_count(args, workers, addresses, callers, [(u, t) for u, (t, _) in extras])
    finally:
        for worker in workers:
            with contextlib.suppress(Exception):
                worker.stop()
    load_after = os.getloadavg()
    print(
        f"{WORKERS} workers x {args.latency_ms:g} ms, {args.rounds} rounds of {args.tasks}"
        f" tasks; {os.cpu_count()} CPUs, Python {sys.version.split()[0]}; load average"
        f" {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    for micros, (turns, per_turn) in extras:
        print(f"{micros:g} µs of Python: {turns} turns of {per_turn * 1e3:.1f} ns")
    print("medians over the rounds (min-max); p50/p99 over every task of every round")
    figures = {}
    for callers in counts:
        figures[callers] = summary([r for r in runs if r.callers == callers])
        print(f"\n{callers} callers")
        print(table(figures[callers]))
    if args.json:
        document = {
            "settings": {**vars(args), "workers": WORKERS, "worker_slots": WORKER_SLOTS},
            "extra": {str(u): {"turns": t, "ns_per_turn": p * 1e3} for u, (t, p) in extras},
            "load_average": {"before": load_before, "after": load_after},
            "runs": [{k: v for k, v in asdict(r).items() if k != "latencies"} for r in runs],
            "summary": {str(k): v for k, v in figures.items()},
        }
        Path(args.json).write_text(json.dumps(document, indent=1) + "\n")
    return 0


def _one_count(
    args: argparse.Namespace,
    workers: Sequence[LocalWorker],
    addresses: Sequence[tuple[str, int]],
    callers: int,
    extras: Sequence[tuple[float, int]],
) -> list[Run]:
    """Every contender at one caller count, interleaved by rounds."""
    conns: list[Conn] = []
    contenders: list[Contender] = []
    runs: list[Run] = []
    try:
        conns = [Conn(addresses[i % len(addresses)]) for i in range(callers)]
        io_threads = _numbers(args.io_threads, int)
        contenders = contenders_for(workers, conns, extras, io_threads)
        if args.only:
            contenders = [c for c in contenders if any(p in c.name for p in args.only)]
        for contender in contenders:
            contender.run(0, callers * 4)
        for round_ in range(1, args.rounds + 1):
            shift = (round_ - 1) % len(contenders)
            for contender in contenders[shift:] + contenders[:shift]:
                before = sum(process_cpu(w.pid) for w in workers)
                run = contender.run(round_, args.tasks)
                run.worker_cpu_s = sum(process_cpu(w.pid) for w in workers) - before
                runs.append(run)
                print(
                    f"{callers} callers, round {round_}: {run.contender}:"
                    f" {run.tasks_per_s:.0f} tasks/s, {run.cpu_s / run.tasks * 1e6:.0f} µs,"
                    f" {run.switches / run.tasks:.2f} switches, {run.failed} failed",
                    file=sys.stderr,
                )
    finally:
        for contender in contenders:
            with contextlib.suppress(Exception):
                contender.close()
        for conn in conns:
            conn.close()
    return runs


if __name__ == "__main__":
    raise SystemExit(main())
