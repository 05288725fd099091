"""The built-in transport's ``silence``: a call ends once the worker has sent nothing
for that long, and never while it keeps sending. Raw-socket servers on 127.0.0.1."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from npu_sync.transport import TransportError
from tests.hostile import Clients, Peer, answer, serve

BUDGET = 5.0  # the whole call's budget: far above every silence here


@pytest.fixture
def client() -> Iterator[Clients]:
    clients = Clients("builtin")
    yield clients
    clients.close()


def test_a_silent_worker_fails_the_call_as_stalled_long_before_its_budget(servers, client):
    """The worker reads the request and sends nothing: the call fails after its 0.3 s
    of silence with ``kind="timeout"``, ``stalled=True``, ``sent=True``."""

    def silent(peer: Peer) -> None:
        peer.request()
        peer.hold()

    transport = client(serve(servers, silent).url())
    assert transport.silences
    started = time.monotonic()
    with pytest.raises(TransportError) as failed:
        transport.request("POST", "/inference", body=b"{}", timeout=BUDGET, silence=0.3)
    assert time.monotonic() - started < BUDGET / 2
    error = failed.value
    assert (error.kind, error.stalled, error.sent) == ("timeout", True, True)
    assert "stalled" in str(error) and "0.3s" in str(error)


def test_silence_restarts_with_every_byte(servers, client):
    """An answer sent a byte every 20 ms for well over a second, with 1 s of silence
    allowed: the call succeeds."""
    raw = answer(200, b'{"response": "dripped"}')

    def dripping(peer: Peer) -> None:
        peer.request()
        peer.drip(raw, 0.02)

    transport = client(serve(servers, dripping, nodelay=True).url())
    started = time.monotonic()
    response = transport.request("POST", "/inference", body=b"{}", timeout=BUDGET, silence=1.0)
    assert response.json() == {"response": "dripped"}
    assert time.monotonic() - started > 1.0


def test_the_budget_still_bounds_a_worker_that_keeps_sending(servers, client):
    """Silence never stretches the call: a worker dripping forever ends at the budget,
    as an ordinary timeout (not stalled)."""

    def forever(peer: Peer) -> None:
        peer.request()
        peer.drip_forever(b"HTTP/1.1 200 OK\r\n", lambda n: b"X-Pad-%d: y\r\n" % n, 0.05)

    transport = client(serve(servers, forever, nodelay=True).url())
    with pytest.raises(TransportError) as failed:
        transport.request("POST", "/inference", body=b"{}", timeout=1.0, silence=0.3)
    assert (failed.value.kind, failed.value.stalled) == ("timeout", False)


def test_without_silence_the_call_waits_for_its_budget(servers, client):
    """No ``silence``: a silent worker holds the call for its whole budget, as before."""

    def silent(peer: Peer) -> None:
        peer.request()
        peer.hold()

    transport = client(serve(servers, silent).url())
    started = time.monotonic()
    with pytest.raises(TransportError) as failed:
        transport.request("POST", "/inference", body=b"{}", timeout=1.0)
    assert time.monotonic() - started >= 1.0
    assert not failed.value.stalled


def test_an_answer_already_waiting_is_read_however_late_the_reader_wakes():
    """A thread that wakes past its silence with the answer in the socket (a starved
    process) reads it: the bytes came, so there was no silence. Here the answer is
    written before the read starts and the silence allowed is zero."""
    import socket as socket_module

    from npu_sync.transport._builtin import _Conn, _Reader

    ours, theirs = socket_module.socketpair()
    try:
        theirs.sendall(answer(200, b'{"response": "waiting"}'))
        conn = _Conn(ours, False, 4.0)
        reader = _Reader(conn, time.monotonic() + BUDGET, silence=0.0)
        _, status, headers = reader.head()
        body = reader.exactly(int(headers["content-length"]))
        assert (status, body) == (200, b'{"response": "waiting"}')
    finally:
        ours.close()
        theirs.close()
