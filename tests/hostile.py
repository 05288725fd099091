"""Raw-socket loopback servers that misbehave on purpose, a builder for every kind of
transport, and a pool over such servers (:class:`PoolRun`) that checks the pool's
promises after every task: for the transport and hostile-worker tests.

A :class:`Hostile` server runs a *behaviour* (a function of one :class:`Peer`) on a
thread per accepted connection. Behaviours read requests with :meth:`Peer.request`
(which records them, so a test can check what the worker saw) and answer with raw
bytes, as slowly or as wrongly as the test needs. Every wait in a behaviour is on the
server's ``stop`` event, so closing the server ends them all at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import select
import socket
import ssl
import struct
import termios
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from npu_sync import Task, TaskFailed, TaskRejected, WorkerPool
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    RetryConfig,
    TimeoutConfig,
    TLSConfig,
    TransportConfig,
    WorkerConfig,
    worker_config,
)
from npu_sync.transport import BuiltinTransport, RequestsTransport, Urllib3Transport


@dataclass(frozen=True)
class Seen:
    """One request a behaviour read in full."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    connection: int

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())


class Peer:
    """The server's side of one connection."""

    def __init__(self, server: Hostile, sock: socket.socket, number: int) -> None:
        self.server = server
        self.sock = sock
        self.number = number
        self.buf = b""
        self.stop = server.stop

    def _recv(self) -> bytes:
        try:
            return self.sock.recv(65536)
        except (OSError, ssl.SSLError):
            return b""

    def receive(self) -> bytes:
        """Whatever the client sent next, raw; b"" once it has hung up."""
        return self._recv()

    def request(self) -> Seen | None:
        """Read one whole request and record it; None if the client hung up first."""
        while b"\r\n\r\n" not in self.buf:
            data = self._recv()
            if not data:
                return None
            self.buf += data
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        while len(self.buf) < length:
            data = self._recv()
            if not data:
                return None
            self.buf += data
        body, self.buf = self.buf[:length], self.buf[length:]
        seen = Seen(method, path, headers, body, self.number)
        self.server.record(seen)
        return seen

    def send(self, data: bytes) -> bool:
        """Send all of ``data``; False if the client has gone."""
        try:
            self.sock.sendall(data)
        except OSError:
            return False
        return True

    def drip(self, data: bytes, interval: float) -> bool:
        """Send ``data`` a byte every ``interval`` seconds; False if stopped or gone."""
        for i in range(len(data)):
            if not self.send(data[i : i + 1]) or self.stop.wait(interval):
                return False
        return True

    def drip_forever(self, prefix: bytes, unit: Callable[[int], bytes], interval: float) -> None:
        """Send ``prefix``, then ``unit(n)`` for n = 0, 1, ... every ``interval`` s."""
        if not self.send(prefix):
            return
        n = 0
        while not self.stop.wait(interval):
            if not self.send(unit(n)):
                return
            n += 1

    def flushed(self, timeout: float = 5.0) -> bool:
        """Wait until the client's kernel has acknowledged every byte sent so far, so
        that those bytes are waiting in its receive buffer; False if stopped or gone.
        """
        give_up = time.monotonic() + timeout
        while time.monotonic() < give_up:
            try:
                queued = fcntl.ioctl(self.sock.fileno(), termios.TIOCOUTQ, b"\0" * 4)
            except (OSError, ValueError):
                return False
            if struct.unpack("i", queued)[0] == 0:
                return True
            # The kernel offers no wake-up for "all acknowledged": look again shortly.
            if self.stop.wait(0.001):
                return False
        return False

    def head(self) -> bytes | None:
        """Read only a request's head (up to the blank line), leaving its body unread."""
        while b"\r\n\r\n" not in self.buf:
            data = self._recv()
            if not data:
                return None
            self.buf += data
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        return head

    def half_close(self) -> None:
        """Shut down the sending side (a FIN), keeping the connection open for reading."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)

    def hold(self) -> None:
        """Keep the connection open, doing nothing, until the server closes."""
        self.stop.wait()

    def wait_readable(self) -> bool:
        """Wait until the client sends something (or hangs up) without reading it."""
        while not self.stop.is_set():
            try:
                ready, _, _ = select.select([self.sock], [], [], 0.05)
            except (OSError, ValueError):
                return False
            if ready:
                return True
        return False

    def reset(self) -> None:
        """Close with a TCP reset (SO_LINGER 0) instead of a normal close."""
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


Behaviour = Callable[[Peer], None]


@dataclass
class Hostile:
    """A loopback server running ``behaviour`` on every accepted connection.

    Args:
        behaviour: what to do with each connection; the connection is closed when it
            returns.
        tls: server-side TLS context; the handshake runs in the connection's thread.
        rcvbuf: receive buffer size for accepted connections (a slow reader).
        backlog: listen backlog.
        nodelay: send every write at once (TCP_NODELAY), so that two writes in a row
            reach the client as two segments rather than waiting for its ACK.
    """

    behaviour: Behaviour
    tls: ssl.SSLContext | None = None
    rcvbuf: int | None = None
    backlog: int = 16
    accept: bool = True
    nodelay: bool = False
    stop: threading.Event = field(default_factory=threading.Event)
    seen: list[Seen] = field(default_factory=list)
    connections: int = 0
    closed_connections: int = 0

    def __post_init__(self) -> None:
        self.changed = threading.Condition()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.rcvbuf is not None:
            # Set before listen() so that accepted sockets inherit it (and the window).
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(self.backlog)
        self.port: int = self._listener.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._peers: list[Peer] = []
        self._acceptor = threading.Thread(target=self._accept, name="hostile-accept")
        if self.accept:
            self._acceptor.start()

    def url(self, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            with self.changed:
                self.connections += 1
                number = self.connections
            thread = threading.Thread(
                target=self._serve, args=(sock, number), name=f"hostile-{number}"
            )
            self._threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket, number: int) -> None:
        if self.nodelay:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is not None:
            try:
                sock.settimeout(10)
                sock = self.tls.wrap_socket(sock, server_side=True)
                sock.settimeout(None)
            except (OSError, ssl.SSLError):
                sock.close()
                return
        peer = Peer(self, sock, number)
        self._peers.append(peer)
        try:
            self.behaviour(peer)
        finally:
            peer.close()
            with self.changed:
                self.closed_connections += 1
                self.changed.notify_all()

    def record(self, seen: Seen) -> None:
        with self.changed:
            self.seen.append(seen)
            self.changed.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        with self.changed:
            return self.changed.wait_for(predicate, timeout)

    def stop_listening(self) -> None:
        """Refuse new connections from now on (the port is freed)."""
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()

    def close(self) -> None:
        self.stop.set()
        # shutdown() wakes an accept() blocked in another thread; close() alone may not.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for peer in list(self._peers):
            with contextlib.suppress(OSError):
                peer.sock.shutdown(socket.SHUT_RDWR)
        if self._acceptor.is_alive():
            self._acceptor.join(5)
        for thread in self._threads:
            thread.join(5)


# -- answers ------------------------------------------------------------------------


def answer(
    status: int = 200,
    body: bytes = b"{}",
    headers: dict[str, str] | None = None,
    *,
    length: bool = True,
    version: str = "HTTP/1.1",
) -> bytes:
    """A raw answer: status line, headers (Content-Length unless told not to), body."""
    lines = [f"{version} {status} X"]
    all_headers = {"Content-Type": "application/json"}
    all_headers.update(headers or {})
    if length:
        all_headers["Content-Length"] = str(len(body))
    lines += [f"{k}: {v}" for k, v in all_headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def chunked(chunks: list[bytes], trailers: dict[str, str] | None = None) -> bytes:
    """A chunked body (after the head), with optional trailers."""
    out = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n"
    for name, value in (trailers or {}).items():
        out += f"{name}: {value}\r\n".encode()
    return out + b"\r\n"


def tls_handshake_stalling(ctx: ssl.SSLContext, step: str) -> Behaviour:
    """A TLS worker (on a plain-TCP :class:`Hostile`) that stops its handshake at ``step``
    and holds the connection open:

    * ``"client hello"``: reads the ClientHello, never answers it;
    * ``"server flight"``: sends the first half of its first flight (ServerHello ...);
    * ``"drip"``: sends its first flight a byte every 50 ms;
    * ``"finished"``: completes the handshake, then never reads the request.
    """

    def behaviour(peer: Peer) -> None:
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = ctx.wrap_bio(incoming, outgoing, server_side=True)
        done = False
        while not done:
            data = peer.receive()
            if not data:
                return
            incoming.write(data)
            try:
                tls.do_handshake()
                done = True
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError:
                return
            flight = outgoing.read()
            if step == "client hello":
                break
            if flight and step == "server flight":
                peer.send(flight[: len(flight) // 2])
                break
            if flight and step == "drip":
                peer.drip(flight, 0.05)
                break
            if flight and not peer.send(flight):
                return
        peer.hold()

    return behaviour


def keep_answering(reply: Callable[[Seen], bytes]) -> Behaviour:
    """A well-behaved keep-alive worker: answers every request with ``reply(seen)``."""

    def behaviour(peer: Peer) -> None:
        while (seen := peer.request()) is not None:
            if not peer.send(reply(seen)):
                return

    return behaviour


# -- the transports under test ------------------------------------------------------

CLIENTS = ("builtin", "urllib3", "requests")
CLASSES: dict[str, Any] = {
    "builtin": BuiltinTransport,
    "urllib3": Urllib3Transport,
    "requests": RequestsTransport,
}


class Clients:
    """Builds transports of one kind and closes every one built at teardown."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.built: list[Any] = []

    def __call__(
        self,
        url: str,
        *,
        limit: int = 1 << 20,
        maxsize: int = 4,
        tls: TLSConfig | None = None,
        worker_id: str = "w1",
        headers: dict[str, str] | None = None,
        **kw: Any,
    ) -> Any:
        worker = WorkerConfig(id=worker_id, url=url, headers=headers or {})
        transport = CLASSES[self.kind](
            worker,
            tls=tls if tls is not None else TLSConfig(),
            max_response_bytes=limit,
            maxsize=maxsize,
            **kw,
        )
        self.built.append(transport)
        return transport

    def close(self) -> None:
        for transport in self.built:
            transport.close()


# -- a pool over hostile workers ------------------------------------------------------

TASK = 1.2  # a task's deadline
READ = 0.8  # one attempt's own budget: the first attempt's timeout is the worker's
MARGIN = 1.0  # far above an honest overshoot, far below what an unbounded wait takes
PAYLOAD = {"model_id": "default", "input_text": "hi"}


@dataclass
class Ended:
    """How one task ended."""

    kind: str  # "result", "rejected" or "failed"
    value: Any
    error: Exception | None
    elapsed: float


class PoolRun:
    """A pool over hostile workers (servers or URLs, ids ``w0``, ``w1`` ...), and the
    checks every scenario ends with: see :meth:`execute` and :meth:`close`."""

    def __init__(
        self,
        client: str,
        workers: list[Hostile | str],
        *,
        scheme: str = "http",
        tls: TLSConfig | None = None,
        connect: float = READ,
        read: float = READ,
        fail_max: int = 3,
        max_retries: int = 3,
    ) -> None:
        configs = tuple(
            worker_config(f"w{i}", w if isinstance(w, str) else w.url(scheme), max_concurrent=4)
            for i, w in enumerate(workers)
        )
        self.pool = WorkerPool(
            PoolConfig(
                workers=configs,
                timeouts=TimeoutConfig(connect=connect, read=read, task=TASK),
                transport=TransportConfig(client=client, tls=tls or TLSConfig()),
                health=HealthConfig(enabled=False),
                retry=RetryConfig(max_retries=max_retries, backoff_initial=0.01, backoff_max=0.05),
                circuit_breaker=BreakerConfig(
                    fail_max=fail_max, reset_timeout=60, max_reset_timeout=600
                ),
            )
        )
        self.closed = False

    def execute(self, timeout: float = TASK, *, idempotent: bool = True, **kw: Any) -> Ended:
        """Run one task; check that it ended in time, in exactly one of the three ways,
        and that it left nothing in flight."""
        task = Task(kw.pop("payload", PAYLOAD), timeout=timeout, idempotent=idempotent, **kw)
        start = time.monotonic()
        try:
            ended = self._ended(task, lambda: self.pool.execute(task))
        finally:
            elapsed = time.monotonic() - start
        ended.elapsed = elapsed
        assert elapsed < timeout + MARGIN, f"task took {elapsed:.2f}s: {ended.error!r}"
        self.check_quiet()
        return ended

    def submit(
        self, timeout: float = TASK, *, idempotent: bool = True, **kw: Any
    ) -> Callable[[], Ended]:
        """Submit one task; the returned call waits for it and checks, as :meth:`execute`
        does, how and when it ended (counting from the submission)."""
        task = Task(kw.pop("payload", PAYLOAD), timeout=timeout, idempotent=idempotent, **kw)
        start = time.monotonic()
        future = self.pool.submit(task)
        done = threading.Event()
        ended_at: list[float] = []

        def finished(_: Any) -> None:
            ended_at.append(time.monotonic())
            done.set()

        future.add_done_callback(finished)

        def wait() -> Ended:
            assert done.wait(timeout + 5 * MARGIN)
            ended = self._ended(task, future.result)
            ended.elapsed = ended_at[0] - start
            assert ended.elapsed < timeout + MARGIN, f"took {ended.elapsed:.2f}s: {ended.error!r}"
            return ended

        return wait

    def _ended(self, task: Task, call: Callable[[], Any]) -> Ended:
        error: Exception | None = None
        value = None
        try:
            value = call()
            kind = "result"
        except TaskRejected as exc:
            kind, error = "rejected", exc
        except TaskFailed as exc:
            kind, error = "failed", exc
            assert exc.dead_letter_id is not None, exc
            record = self.pool.dead_letters.get(exc.dead_letter_id)
            assert record is not None and record.task_id == task.task_id
        return Ended(kind, value, error, 0.0)

    def check_quiet(self) -> None:
        assert [w["in_flight"] for w in self.pool.workers()] == [0] * len(self.pool.workers())
        assert self.pool.stats()["tasks"]["active"] == 0

    def row(self, worker_id: str = "w0") -> dict[str, Any]:
        (row,) = [w for w in self.pool.workers() if w["id"] == worker_id]
        return row

    def charged(self, worker_id: str = "w0") -> int:
        """Failures charged to the worker (each counts towards its breaker)."""
        return int(self.row(worker_id)["tasks"]["failed"])

    def abandoned(self, worker_id: str = "w0") -> int:
        return int(self.row(worker_id)["tasks"]["abandoned"])

    def breaker(self, worker_id: str = "w0") -> str:
        return str(self.row(worker_id)["breaker"]["state"])

    def close(self, within: float = MARGIN) -> None:
        """Close the pool; check that close() returned ``within`` seconds and that no
        thread of the pool is left."""
        if self.closed:
            return
        self.closed = True
        start = time.monotonic()
        self.pool.close()
        assert time.monotonic() - start < within
        left = []
        for thread in threading.enumerate():
            if thread.name.startswith("npu-sync"):
                thread.join(MARGIN)
                if thread.is_alive():
                    left.append(thread.name)
        assert not left, f"threads left after close(): {left}"


def concurrently(scenarios: dict[str, Callable[[], None]]) -> None:
    """Run independent scenarios on threads of their own (each takes a task's deadline
    or two of waiting); fail naming every scenario that failed."""
    failures: dict[str, BaseException] = {}

    def run(name: str, scenario: Callable[[], None]) -> None:
        try:
            scenario()
        except BaseException as exc:  # reported below, under the scenario's name
            failures[name] = exc

    threads = [
        threading.Thread(target=run, args=item, name=f"scenario-{item[0]}")
        for item in scenarios.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, "\n".join(f"{name}: {exc!r}" for name, exc in failures.items())


def serve(servers: list[Hostile], behaviour: Behaviour, **kw: Any) -> Hostile:
    """Start a Hostile server, recorded in ``servers`` (the fixture) to be closed."""
    server = Hostile(behaviour, **kw)
    servers.append(server)
    return server
