"""Stale keep-alive connections are nobody's failure: every transport.

A worker may close an idle keep-alive connection just as a request goes out on it.
The worker never saw that request, so it is re-sent once on a fresh connection when
the call is replayable; otherwise the error says ``stale=True``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from npu_sync.transport import TransportError
from tests.hostile import CLIENTS, Clients, Peer, answer, serve

TIMEOUTS = {"timeout": 5.0, "connect_timeout": 2.0}


@pytest.fixture(params=CLIENTS)
def client(request: pytest.FixtureRequest) -> Iterator[Clients]:
    clients = Clients(request.param)
    yield clients
    clients.close()


def one_answer_then_close(delay: float) -> Any:
    """A worker that answers one request per connection, then closes it ``delay`` s
    later, without ever saying ``Connection: close``.
    """

    def behaviour(peer: Peer) -> None:
        seen = peer.request()
        if seen is None:
            return
        peer.send(answer(200, b'{"n": "%s"}' % seen.header("x-seq").encode()))
        if delay:
            peer.stop.wait(delay)  # the worker's own keep-alive timer, not a test wait

    return behaviour


@pytest.mark.parametrize("delay", [0.0, 0.002], ids=["at-once", "after-2ms"])
def test_a_worker_closing_every_connection_after_answering_costs_no_task(client, servers, delay):
    """200 replayable requests in a row all succeed; the worker sees each exactly once."""
    server = serve(servers, one_answer_then_close(delay))
    transport = client(server.url())
    for i in range(200):
        resp = transport.request(
            "POST",
            "/inference",
            body=b"{}",
            headers={"X-Seq": str(i)},
            replayable=True,
            **TIMEOUTS,
        )
        assert resp.json() == {"n": str(i)}
    assert [seen.header("x-seq") for seen in server.seen] == [str(i) for i in range(200)]


def close_when_the_next_request_arrives(peer: Peer) -> None:
    """Answer the first request; close without reading as soon as a second arrives.

    Closing with unread data makes the kernel reset the connection: the client's second
    request ends before any byte of an answer, and the worker never read it.
    """
    if peer.request() is None:
        return
    peer.send(answer(200, b'{"first": true}'))
    if peer.wait_readable():
        peer.close()


def then_keep_answering(first: Any) -> Any:
    """``first`` on the first connection, a well-behaved worker on every later one."""

    def behaviour(peer: Peer) -> None:
        if peer.number == 1:
            first(peer)
            return
        while (seen := peer.request()) is not None:
            peer.send(answer(200, b'{"path": "%s"}' % seen.path.encode()))

    return behaviour


def test_a_stale_connection_is_not_resent_unless_replayable(client, servers):
    """Non-replayable: 'reset', sent=True, stale=True, and the worker never saw it."""
    server = serve(servers, then_keep_answering(close_when_the_next_request_arrives))
    transport = client(server.url())
    transport.request("POST", "/first", body=b"{}", **TIMEOUTS)
    with pytest.raises(TransportError) as info:
        transport.request("POST", "/second", body=b"{}", replayable=False, **TIMEOUTS)
    assert (info.value.kind, info.value.sent, info.value.stale) == ("reset", True, True)
    assert [seen.path for seen in server.seen] == ["/first"]
    assert transport.request("POST", "/third", body=b"{}", **TIMEOUTS).json() == {"path": "/third"}
    assert [(seen.path, seen.connection) for seen in server.seen] == [
        ("/first", 1),
        ("/third", 2),
    ]


def test_a_stale_connection_is_resent_once_on_a_fresh_one_when_replayable(client, servers):
    """Replayable: the request goes out again on a new connection and succeeds."""
    server = serve(servers, then_keep_answering(close_when_the_next_request_arrives))
    transport = client(server.url())
    transport.request("POST", "/first", body=b"{}", **TIMEOUTS)
    resp = transport.request("POST", "/second", body=b"{}", replayable=True, **TIMEOUTS)
    assert resp.json() == {"path": "/second"}
    assert [(seen.path, seen.connection) for seen in server.seen] == [
        ("/first", 1),
        ("/second", 2),
    ]


def test_a_fresh_connection_closed_without_an_answer_is_a_plain_reset(client, servers):
    """On a new connection, EOF before any answer is the worker's fault, never stale."""

    def read_and_hang_up(peer: Peer) -> None:
        peer.request()

    server = serve(servers, read_and_hang_up)
    transport = client(server.url())
    with pytest.raises(TransportError) as info:
        transport.request("POST", "/x", body=b"{}", replayable=True, **TIMEOUTS)
    assert (info.value.kind, info.value.sent, info.value.stale) == ("reset", True, False)
    assert len(server.seen) == 1  # not re-sent


def test_a_stale_resend_that_fails_again_is_the_workers_failure(client, servers):
    """A re-send whose fresh connection also ends unanswered is a plain 'reset'."""

    def behaviour(peer: Peer) -> None:
        if peer.number == 1:
            close_when_the_next_request_arrives(peer)
        else:
            peer.request()  # reads, then hangs up without answering

    server = serve(servers, behaviour)
    transport = client(server.url())
    transport.request("POST", "/first", body=b"{}", **TIMEOUTS)
    with pytest.raises(TransportError) as info:
        transport.request("POST", "/second", body=b"{}", replayable=True, **TIMEOUTS)
    assert (info.value.kind, info.value.sent, info.value.stale) == ("reset", True, False)
    assert [(seen.path, seen.connection) for seen in server.seen] == [
        ("/first", 1),
        ("/second", 2),
    ]


def test_a_resend_that_cannot_connect_keeps_sent_true(client, servers):
    """If the worker is gone by the re-send, the error still says the request may have
    reached it: the stale attempt cannot prove it did not."""

    def behaviour(peer: Peer) -> None:
        if peer.request() is None:
            return
        peer.send(answer(200, b"{}"))
        if peer.wait_readable():
            peer.server.stop_listening()
            peer.close()

    server = serve(servers, behaviour)
    transport = client(server.url())
    transport.request("POST", "/first", body=b"{}", **TIMEOUTS)
    with pytest.raises(TransportError) as info:
        transport.request("POST", "/second", body=b"{}", replayable=True, **TIMEOUTS)
    assert (info.value.kind, info.value.sent) == ("connect", True)
    assert [seen.path for seen in server.seen] == ["/first"]
