"""One budget per call, whatever the worker does: every transport, hostile workers.

Each test gives a call a budget of 0.5-1 s against a worker that would hold an
unbounded client for many seconds (or forever), and checks that the call ends within
a generous margin of its budget (the point is "bounded", not milliseconds), with the
right error, and that the worker saw what it should have.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from npu_sync.config import TLSConfig
from npu_sync.transport import TransportError
from tests.hostile import CLIENTS, Clients, Peer, answer, serve

MARGIN = 1.0  # far above any honest overshoot, far below what an unbounded client takes


@pytest.fixture(params=CLIENTS)
def client(request: pytest.FixtureRequest) -> Iterator[Clients]:
    clients = Clients(request.param)
    yield clients
    clients.close()


def timed_failure(transport: Any, budget: float, **kw: Any) -> tuple[TransportError, float]:
    """Run one call expected to fail; return the error and how long the call took."""
    kw.setdefault("method", "POST")
    kw.setdefault("path", "/inference")
    kw.setdefault("body", b'{"input_text": "hi"}')
    method, path = kw.pop("method"), kw.pop("path")
    start = time.monotonic()
    with pytest.raises(TransportError) as info:
        transport.request(method, path, timeout=budget, **kw)
    return info.value, time.monotonic() - start


def test_a_status_line_dripping_a_byte_at_a_time_times_out(client, servers):
    """A worker sending its status line a byte every 0.1 s cannot hold the call."""

    def drip(peer: Peer) -> None:
        if peer.request() is not None:
            peer.drip(answer(200, b"{}" * 100), 0.1)

    server = serve(servers, drip)
    error, elapsed = timed_failure(client(server.url()), 0.5, connect_timeout=0.5)
    assert (error.kind, error.sent) == ("timeout", True)
    assert elapsed < 0.5 + MARGIN
    assert len(server.seen) == 1


def test_headers_dripping_a_line_at_a_time_time_out(client, servers):
    """A worker sending a new header line every 0.1 s, forever, cannot hold the call."""

    def drip(peer: Peer) -> None:
        if peer.request() is not None:
            peer.drip_forever(b"HTTP/1.1 200 OK\r\n", lambda n: b"X-Drip-%d: x\r\n" % n, 0.1)

    server = serve(servers, drip)
    error, elapsed = timed_failure(client(server.url()), 0.5)
    assert (error.kind, error.sent) == ("timeout", True)
    assert elapsed < 0.5 + MARGIN
    assert len(server.seen) == 1


def test_a_header_line_that_never_ends_times_out(client, servers):
    """One header line growing a byte at a time, never ended, cannot hold the call."""

    def drip(peer: Peer) -> None:
        if peer.request() is not None:
            peer.drip_forever(b"HTTP/1.1 200 OK\r\nX-Endless: ", lambda n: b"a", 0.02)

    server = serve(servers, drip)
    error, elapsed = timed_failure(client(server.url()), 0.5)
    assert (error.kind, error.sent) == ("timeout", True)
    assert elapsed < 0.5 + MARGIN


def test_a_body_dripping_a_byte_at_a_time_times_out(client, servers):
    """A body that keeps arriving a byte at a time is bounded by the same budget."""

    def drip(peer: Peer) -> None:
        if peer.request() is not None:
            head = b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n"
            peer.drip_forever(head, lambda n: b" ", 0.02)

    server = serve(servers, drip)
    error, elapsed = timed_failure(client(server.url()), 0.5)
    assert (error.kind, error.sent) == ("timeout", True)
    assert elapsed < 0.5 + MARGIN


def test_a_worker_that_never_reads_a_large_body_times_out(client, servers):
    """Sending a big body to a worker that stops reading stops at the deadline."""
    reading = threading.Event()

    def never_read(peer: Peer) -> None:
        reading.set()
        peer.hold()

    server = serve(servers, never_read, rcvbuf=4096)
    body = b"x" * (32 * 1024 * 1024)  # far more than both sides' socket buffers hold
    error, elapsed = timed_failure(client(server.url()), 1.0, body=body)
    assert (error.kind, error.sent) == ("timeout", True)
    assert elapsed < 1.0 + MARGIN
    assert reading.is_set() and server.seen == []


def test_a_worker_that_never_answers_times_out(client, servers):
    """A worker that reads the request and then says nothing fails the call in time."""

    def silent(peer: Peer) -> None:
        if peer.request() is not None:
            peer.hold()

    server = serve(servers, silent)
    error, elapsed = timed_failure(client(server.url()), 0.5)
    assert (error.kind, error.sent) == ("timeout", True)
    assert elapsed < 0.5 + MARGIN
    assert len(server.seen) == 1


def test_a_slow_name_lookup_times_out_unsent(client, servers):
    """A lookup that takes 3 s fails a 0.5 s call in time, as 'timeout' never sent."""
    server = serve(servers, lambda peer: peer.hold())
    release = threading.Event()
    asked: list[str] = []

    def slow_lookup(host: str, port: int) -> list[Any]:
        asked.append(host)
        release.wait(3.0)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", server.port))]

    transport = client(f"http://npu-worker.test:{server.port}", resolver=slow_lookup)
    try:
        error, elapsed = timed_failure(transport, 0.5, connect_timeout=2.0)
    finally:
        release.set()  # let the lookup thread end with the test
    assert (error.kind, error.sent) == ("timeout", False)
    assert elapsed < 0.5 + MARGIN
    assert asked == ["npu-worker.test"]
    assert server.connections == 0


def test_a_failed_name_lookup_is_connect_unsent(client):
    """A lookup that fails is 'connect' with sent=False, from the injected resolver."""

    def no_such_host(host: str, port: int) -> list[Any]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    transport = client("http://npu-worker.test:8081", resolver=no_such_host)
    error, _ = timed_failure(transport, 1.0)
    assert (error.kind, error.sent) == ("connect", False)


def test_a_connect_that_hangs_times_out_unsent(client):
    """A worker whose accept queue is full lets connect time out: 'timeout', unsent."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", port))  # fills the queue of one
    try:
        error, elapsed = timed_failure(client(f"http://127.0.0.1:{port}"), 2.0, connect_timeout=0.3)
    finally:
        filler.close()
        listener.close()
    assert (error.kind, error.sent) == ("timeout", False)
    assert elapsed < 0.3 + MARGIN


def test_a_tls_handshake_that_never_finishes_times_out_unsent(client, servers):
    """A worker that accepts TCP and never speaks TLS fails the call in time, unsent."""
    server = serve(servers, lambda peer: peer.hold())
    transport = client(server.url("https"), tls=TLSConfig(verify=False))
    error, elapsed = timed_failure(transport, 0.5)
    assert (error.kind, error.sent) == ("timeout", False)
    assert elapsed < 0.5 + MARGIN
    assert server.seen == []


def test_the_connect_budget_caps_connecting_within_the_whole_budget(client, servers):
    """connect_timeout bounds a TLS handshake even when the whole budget is longer."""
    server = serve(servers, lambda peer: peer.hold())
    transport = client(server.url("https"), tls=TLSConfig(verify=False))
    error, elapsed = timed_failure(transport, 30.0, connect_timeout=0.3)
    assert (error.kind, error.sent) == ("timeout", False)
    assert elapsed < 0.3 + MARGIN
