"""Workers killed with SIGKILL in the middle of a task on a reused keep-alive connection.

The worker is a separate process (a raw-socket HTTP server), so the kernel closes its
connections as it would for a crashed worker. The task was on a connection used before,
so the transport cannot tell the death from a stale keep-alive connection: a task that
may be re-sent is, and the re-send's refused connect is the worker's failure; a task
that may not, ends dead-lettered without charging anyone. Every client.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from tests.hostile import CLIENTS, TASK, Ended, PoolRun

# Answers every request on a keep-alive connection, one connection at a time, except
# POST /hang: it says "hung" on stdout and waits to be killed.
WORKER = r"""
import socket, threading

def requests(conn):
    buf = b""
    while True:
        while b"\r\n\r\n" not in buf:
            data = conn.recv(65536)
            if not data:
                return
            buf += data
        head, _, buf = buf.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(buf) < length:
            data = conn.recv(65536)
            if not data:
                return
            buf += data
        buf = buf[length:]
        yield head

listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(16)
print(listener.getsockname()[1], flush=True)
body = b'{"ok": true}'
while True:
    conn, _ = listener.accept()
    for head in requests(conn):
        if head.startswith(b"POST /hang "):
            print("hung", flush=True)
            threading.Event().wait()
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
    conn.close()
"""


@pytest.fixture
def worker() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True, bufsize=1
    )
    yield proc
    proc.kill()
    proc.wait()
    assert proc.stdout is not None
    proc.stdout.close()


@pytest.fixture(params=CLIENTS)
def run(request: pytest.FixtureRequest, worker: subprocess.Popen[str]) -> Iterator[PoolRun]:
    assert worker.stdout is not None
    port = int(worker.stdout.readline())
    pool_run = PoolRun(str(request.param), [f"http://127.0.0.1:{port}"], fail_max=10)
    yield pool_run
    pool_run.close()


def kill_mid_task(run: PoolRun, worker: subprocess.Popen[str], *, idempotent: bool) -> Ended:
    """One task on the worker's kept-alive connection; SIGKILL once the worker has it."""
    assert run.execute().kind == "result"  # leaves its connection open for reuse
    ended: list[Ended] = []
    caller = threading.Thread(
        target=lambda: ended.append(run.execute(endpoint="/hang", idempotent=idempotent)),
        name="caller",
    )
    caller.start()
    assert worker.stdout is not None
    assert worker.stdout.readline() == "hung\n"
    worker.kill()
    worker.wait()
    caller.join(TASK + 5)
    assert not caller.is_alive()
    (result,) = ended
    return result


def test_a_worker_killed_mid_task_is_charged_for_the_refused_resend(run, worker):
    """Replayable: re-sent at once on a new connection, refused, and that is charged."""
    ended = kill_mid_task(run, worker, idempotent=True)
    assert ended.kind == "failed"
    assert isinstance(ended.error, Exception)
    first = ended.error.attempts[0]  # type: ignore[attr-defined]
    # Refused, or reset when the re-send reached the listening socket of a process
    # whose exit had closed the connection but not yet the listener.
    assert first.error.startswith(("connect", "reset")), first.error
    assert "stale" not in first.error and "not re-sent" not in first.error
    assert run.charged() == len(ended.error.attempts)  # type: ignore[attr-defined]
    assert run.abandoned() == 0


def test_a_worker_killed_mid_task_that_cannot_be_resent_charges_nobody_yet(run, worker):
    """Not replayable: dead-lettered as stale, uncharged; the next task finds it gone."""
    ended = kill_mid_task(run, worker, idempotent=False)
    assert ended.kind == "failed"
    assert (run.charged(), run.abandoned()) == (0, 1)
    assert run.execute().kind == "failed"
    assert run.charged() >= 1
