"""A worker that answers at once: the floor under any HTTP worker, for the benchmarks.

    python benchmarks/instant_worker.py [--ports N]

Listens on N loopback ports (picked by the kernel) in one process and one thread: a
loop over ``epoll`` on non-blocking sockets, no ``http.server``, no threads, so that
what a request costs the worker is the system calls and a few dozen bytecodes.
Every request is answered on its keep-alive connection with a canned answer of the
reference worker's size and shape: ``POST /inference`` with the inference result,
``GET /health`` with a healthy worker, anything else with a 404; the ``worker_id`` of
an answer is ``instant-`` and its port. Prints one JSON line
``{"ports": [...]}`` once listening, and runs until its stdin closes.

:class:`InstantWorkers` starts it from Python (one process per worker, or several
ports in one process) and stops it.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
from types import TracebackType


def _answer(status: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


def _answers(port: int) -> dict[bytes, bytes]:
    """The canned answers of the worker on ``port``, which names itself by it."""
    worker_id = f"instant-{port:05d}"  # the same length on every port
    inference = {
        "model_id": "default",
        "device": "NPU (simulated)",
        "response": "[default] 1 word(s), digest 0e89820860c342f2: benchmark",
        "inference_time_ms": 0.01,
        "inference_count": 1,
        "worker_id": worker_id,
        "task_id": None,
        "attempt": None,
    }
    health = {"status": "healthy", "worker_id": worker_id, "models": ["default"]}
    compact = (",", ":")
    return {
        b"POST /inference": _answer(b"200 OK", json.dumps(inference, separators=compact).encode()),
        b"GET /health": _answer(b"200 OK", json.dumps(health, separators=compact).encode()),
    }


_NOT_FOUND = _answer(b"404 Not Found", b'{"detail":"Not Found"}')


def _body_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def serve(listeners: list[socket.socket], stop_fd: int) -> None:
    """Answer every request on every connection until ``stop_fd`` is readable."""
    poller = select.epoll()
    listening = {s.fileno(): (s, _answers(s.getsockname()[1])) for s in listeners}
    for fd in listening:
        poller.register(fd, select.EPOLLIN)
    poller.register(stop_fd, select.EPOLLIN)
    peers: dict[int, tuple[socket.socket, bytearray, dict[bytes, bytes]]] = {}
    while True:
        for fd, _events in poller.poll():
            if fd == stop_fd:
                return
            listener = listening.get(fd)
            if listener is not None:
                sock, _ = listener[0].accept()
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                peers[sock.fileno()] = (sock, bytearray(), listener[1])
                poller.register(sock.fileno(), select.EPOLLIN)
                continue
            sock, buffer, answers = peers[fd]
            try:
                data = sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if not data:
                poller.unregister(fd)
                del peers[fd]
                sock.close()
                continue
            buffer += data
            out = b""
            while True:
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    break
                head = bytes(buffer[:end])
                total = end + 4 + _body_length(head)
                if len(buffer) < total:
                    break
                del buffer[:total]
                request_line = head.split(b"\r\n", 1)[0]
                method, _, rest = request_line.partition(b" ")
                path = rest.partition(b" ")[0].partition(b"?")[0]
                out += answers.get(method + b" " + path, _NOT_FOUND)
            if out:
                sock.sendall(out)  # a few hundred bytes: the loopback buffer takes them


def main() -> None:
    ports = 1
    if len(sys.argv) == 3 and sys.argv[1] == "--ports":
        ports = int(sys.argv[2])
    elif len(sys.argv) != 1:
        sys.exit(__doc__)
    listeners = []
    for _ in range(ports):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(256)
        listener.setblocking(False)
        listeners.append(listener)
    print(json.dumps({"ports": [s.getsockname()[1] for s in listeners]}), flush=True)
    serve(listeners, sys.stdin.fileno())


class InstantWorkers:
    """Instant workers in child processes: ``processes`` of them, ``ports_each`` ports
    in each. ``urls`` lists every port's address. Not thread-safe."""

    def __init__(self, processes: int = 1, ports_each: int = 1) -> None:
        self._shape = (processes, ports_each)
        self._procs: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []

    def start(self) -> InstantWorkers:
        processes, ports_each = self._shape
        command = [sys.executable, os.path.abspath(__file__), "--ports", str(ports_each)]
        for _ in range(processes):
            proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self._procs.append(proc)
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                self.stop()
                raise RuntimeError("an instant worker ended before it listened")
            self.urls += [f"http://127.0.0.1:{p}" for p in json.loads(line)["ports"]]
        return self

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def stop(self) -> None:
        for proc in self._procs:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.close()  # the worker's loop sees its stdin readable (EOF) and ends
            proc.stdout.close()
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()

    def __enter__(self) -> InstantWorkers:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


if __name__ == "__main__":
    main()
