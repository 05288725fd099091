"""The built-in transport's own connection pool and limits.

What the other two clients leave to urllib3 (or do differently): the LIFO of idle
connections, the idle timeout and Keep-Alive hints, close() while a call is in flight,
the exact header limits, framing the built-in parser refuses that http.client lets
through, and the re-send when a write on a reused connection provably delivered nothing.
"""

from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import trustme

from npu_sync.config import TLSConfig
from npu_sync.transport import TransportError, _builtin
from tests.hostile import Clients, Peer, Seen, answer, keep_answering, serve

TIMEOUTS = {"timeout": 5.0, "connect_timeout": 2.0}


@pytest.fixture
def client() -> Iterator[Clients]:
    clients = Clients("builtin")
    yield clients
    clients.close()


def echo(extra: dict[str, str] | None = None) -> Any:
    """A keep-alive worker answering every request with its path (and ``extra``)."""
    return keep_answering(lambda seen: answer(200, json.dumps({"path": seen.path}).encode(), extra))


def raw_then_close(data: bytes) -> Any:
    def behaviour(peer: Peer) -> None:
        if peer.request() is not None:
            peer.send(data)

    return behaviour


# -- the pool of idle connections ------------------------------------------------------


def test_an_expired_idle_connection_is_closed_not_reused(client, servers):
    """With idle_timeout=0 every request opens a new connection; the old ones close."""
    server = serve(servers, echo())
    transport = client(server.url(), idle_timeout=0.0)
    for path in ("/a", "/b", "/c"):
        transport.request("GET", path, **TIMEOUTS)
    assert [seen.connection for seen in server.seen] == [1, 2, 3]
    assert server.wait_for(lambda: server.closed_connections >= 2)


def test_a_fresh_idle_connection_is_reused(client, servers):
    """Within the idle timeout, requests in a row share one connection."""
    server = serve(servers, echo())
    transport = client(server.url(), idle_timeout=60.0)
    for path in ("/a", "/b", "/c"):
        transport.request("GET", path, **TIMEOUTS)
    assert [seen.connection for seen in server.seen] == [1, 1, 1]


@pytest.mark.parametrize(("hint", "reused"), [("timeout=1", False), ("timeout=30, max=99", True)])
def test_a_keep_alive_hint_shortens_the_idle_timeout(client, servers, hint, reused):
    """'Keep-Alive: timeout=N' is trusted for N - 1 s: timeout=1 means no reuse."""
    server = serve(servers, echo({"Keep-Alive": hint}))
    transport = client(server.url())
    transport.request("GET", "/a", **TIMEOUTS)
    transport.request("GET", "/b", **TIMEOUTS)
    assert [seen.connection for seen in server.seen] == ([1, 1] if reused else [1, 2])


def test_at_most_maxsize_connections_are_kept_idle(client, servers):
    """Two concurrent calls with maxsize=1 use two connections; one is closed after."""
    both = threading.Barrier(2, timeout=5)

    def pair(seen: Seen) -> bytes:
        if seen.path == "/pair":
            both.wait()
        return answer(200, b"{}")

    server = serve(servers, keep_answering(pair))
    transport = client(server.url(), maxsize=1)
    threads = [
        threading.Thread(target=transport.request, args=("GET", "/pair"), kwargs=TIMEOUTS)
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert server.wait_for(lambda: server.closed_connections == 1)
    transport.request("GET", "/after", **TIMEOUTS)
    assert server.closed_connections == 1 and server.connections == 2


def test_close_does_not_wait_for_a_call_in_flight(client, servers):
    """close() returns while a call is blocked; later calls fail unsent; the call's
    connection is closed when it ends."""
    arrived = threading.Event()

    def silent(peer: Peer) -> None:
        if peer.request() is not None:
            arrived.set()
            peer.wait_readable()  # returns when the client closes the connection

    server = serve(servers, silent)
    transport = client(server.url())
    errors: list[TransportError] = []

    def call() -> None:
        try:
            transport.request("GET", "/slow", timeout=1.0)
        except TransportError as exc:
            errors.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    assert arrived.wait(5)
    transport.close()
    assert caller.is_alive()  # close() did not wait for it
    with pytest.raises(TransportError) as info:
        transport.request("GET", "/after", **TIMEOUTS)
    assert (info.value.kind, info.value.sent) == ("connect", False)
    caller.join()
    assert [(e.kind, e.sent) for e in errors] == [("timeout", True)]
    assert server.wait_for(lambda: server.closed_connections == 1)
    assert [seen.path for seen in server.seen] == ["/slow"]


def test_a_send_that_provably_delivered_nothing_is_resent_even_if_not_replayable(
    client, servers, monkeypatch
):
    """A reused connection reset before the write is re-sent: the worker saw nothing."""
    reset_done = threading.Event()

    def behaviour(peer: Peer) -> None:
        if peer.number == 1:
            if peer.request() is not None:
                peer.send(answer(200, b"{}"))
                peer.reset()  # RST: the client's next write on it fails outright
                reset_done.set()
            return
        echo()(peer)

    server = serve(servers, behaviour)
    transport = client(server.url())
    transport.request("POST", "/first", body=b"{}", **TIMEOUTS)
    assert reset_done.wait(5)
    # The reset lands just after the idle check: the check sees nothing.
    monkeypatch.setattr(_builtin._Conn, "alive", lambda self: True)
    resp = transport.request("POST", "/second", body=b"{}", replayable=False, **TIMEOUTS)
    assert resp.json() == {"path": "/second"}
    assert [(seen.path, seen.connection) for seen in server.seen] == [
        ("/first", 1),
        ("/second", 2),
    ]


def test_bytes_after_an_answer_keep_its_connection_out_of_the_pool(client, servers):
    """An answer followed by junk is returned, and its connection is not reused."""

    def behaviour(peer: Peer) -> None:
        if peer.number == 1:
            raw_then_close(answer(200, b'{"ok": 1}') + b"JUNK")(peer)
        else:
            echo()(peer)

    server = serve(servers, behaviour)
    transport = client(server.url())
    assert transport.request("GET", "/a", **TIMEOUTS).json() == {"ok": 1}
    assert transport.request("GET", "/b", **TIMEOUTS).json() == {"path": "/b"}
    assert [seen.connection for seen in server.seen] == [1, 2]


def test_tls_connections_are_kept_alive_too(client, servers, tmp_path):
    """Requests in a row over TLS share one connection (TLS 1.3 tickets do not spoil it)."""
    ca = trustme.CA()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(ctx)
    ca_path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    server = serve(servers, echo(), tls=ctx)
    transport = client(server.url("https"), tls=TLSConfig(verify=str(ca_path)))
    for path in ("/a", "/b", "/c"):
        assert transport.request("GET", path, **TIMEOUTS).json() == {"path": path}
    assert [seen.connection for seen in server.seen] == [1, 1, 1]


def test_a_certificate_for_another_name_fails_before_sending(client, servers, tmp_path):
    """Host names are checked: a certificate for another host is 'tls', unsent."""
    ca = trustme.CA()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("npu.example.org").configure_cert(ctx)
    ca_path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    server = serve(servers, echo(), tls=ctx)
    transport = client(server.url("https"), tls=TLSConfig(verify=str(ca_path)))
    with pytest.raises(TransportError) as info:
        transport.request("GET", "/a", **TIMEOUTS)
    assert (info.value.kind, info.value.sent) == ("tls", False)
    assert server.seen == []


# -- limits and framing ---------------------------------------------------------------

FRAMING = {
    "content-length-and-chunked": b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    "bad-content-length": b"HTTP/1.1 200 OK\r\nContent-Length: 12a\r\n\r\n{}",
    "signed-content-length": b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\n{}",
    "conflicting-content-lengths": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n"
    b"Content-Length: 3\r\n\r\n{}",
    "unknown-transfer-coding": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
    "chunk-longer-than-its-size": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"2\r\nabc\r\n0\r\n\r\n",
    "folded-header": b"HTTP/1.1 200 OK\r\nX-A: 1\r\n  folded\r\nContent-Length: 0\r\n\r\n",
    "space-before-colon": b"HTTP/1.1 200 OK\r\nX-A : 1\r\nContent-Length: 0\r\n\r\n",
    "http2-status-line": b"HTTP/2 200 OK\r\nContent-Length: 0\r\n\r\n",
    "switching-protocols": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n",
    "head-over-64KiB": b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n",
}


@pytest.mark.parametrize("data", FRAMING.values(), ids=FRAMING.keys())
def test_ambiguous_framing_is_refused_as_protocol(client, servers, data):
    """Answers whose length or structure is ambiguous fail as 'protocol'."""
    server = serve(servers, raw_then_close(data))
    with pytest.raises(TransportError) as info:
        client(server.url()).request("GET", "/x", **TIMEOUTS)
    assert (info.value.kind, info.value.sent) == ("protocol", True)


def test_exactly_one_hundred_headers_are_accepted(client, servers):
    """The limit is 100 header fields: 100 is read, 101 is refused (see messages)."""
    data = (
        b"HTTP/1.1 200 OK\r\n"
        + b"".join(b"X-H-%d: v\r\n" % i for i in range(99))
        + b"Content-Length: 2\r\n\r\n{}"
    )
    server = serve(servers, raw_then_close(data))
    resp = client(server.url()).request("GET", "/many", **TIMEOUTS)
    assert resp.status == 200 and len(resp.headers) == 100


def test_repeated_equal_content_lengths_are_accepted(client, servers):
    """Two identical Content-Length headers are one length, not a conflict."""
    data = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}"
    server = serve(servers, raw_then_close(data))
    assert client(server.url()).request("GET", "/x", **TIMEOUTS).body == b"{}"


def test_bare_lf_line_ends_are_read(client, servers):
    """A worker ending lines with LF alone is still understood."""
    data = b"HTTP/1.1 200 OK\nContent-Type: application/json\nContent-Length: 2\n\n{}"
    server = serve(servers, raw_then_close(data))
    resp = client(server.url()).request("GET", "/x", **TIMEOUTS)
    assert (resp.status, resp.headers["content-type"], resp.body) == (
        200,
        "application/json",
        b"{}",
    )


@pytest.mark.parametrize("keep_open", [False, True], ids=["then-close", "kept-open"])
def test_a_bare_lf_head_ends_before_a_crlf_pair_in_its_body(client, servers, keep_open):
    """A head ended by LF LF is not read past into a body that holds CR LF CR LF (valid
    JSON whitespace): the answer is read whole, not taken for a longer head and then
    waited on until the timeout."""
    body = b'{"response":\r\n\r\n"ok"}'
    data = b"HTTP/1.1 200 OK\nContent-Type: application/json\nContent-Length: %d\n\n%s" % (
        len(body),
        body,
    )
    behaviour = keep_answering(lambda seen: data) if keep_open else raw_then_close(data)
    server = serve(servers, behaviour)
    transport = client(server.url())
    for _ in range(2 if keep_open else 1):
        resp = transport.request("GET", "/x", **TIMEOUTS)
        assert (resp.status, json.loads(resp.body)) == (200, {"response": "ok"})


def test_an_unknown_content_coding_is_returned_as_sent(client, servers):
    """A body in a coding the transport cannot undo (br) is left as the worker sent it."""
    server = serve(servers, raw_then_close(answer(200, b"\x8b\x00", {"Content-Encoding": "br"})))
    resp = client(server.url()).request("GET", "/x", **TIMEOUTS)
    assert resp.body == b"\x8b\x00" and resp.headers["content-encoding"] == "br"


def test_a_corrupt_gzip_body_is_protocol(client, servers):
    """A body that says gzip but is not fails as 'protocol'."""
    data = answer(200, b"not gzip at all", {"Content-Encoding": "gzip"})
    server = serve(servers, raw_then_close(data))
    with pytest.raises(TransportError) as info:
        client(server.url()).request("GET", "/x", **TIMEOUTS)
    assert info.value.kind == "protocol"


def test_a_content_length_over_the_limit_fails_before_reading_the_body(client, servers):
    """A declared length over the limit is 'too_large' without reading the body."""

    def behaviour(peer: Peer) -> None:
        if peer.request() is not None:
            peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 999999999\r\n\r\n")
            peer.hold()  # never sends the body: reading it would time out instead

    server = serve(servers, behaviour)
    with pytest.raises(TransportError) as info:
        client(server.url(), limit=1000).request("GET", "/x", **TIMEOUTS)
    assert (info.value.kind, info.value.sent) == ("too_large", True)


@pytest.mark.parametrize(
    ("method", "path", "headers"),
    [
        ("GET", "/a b", {}),
        ("GET", "/a\r\nX: y", {}),
        ("G T", "/", {}),
        ("POST", "/", {"Bad Name": "x"}),
        ("POST", "/", {"Content-Length": "5"}),
        ("POST", "/", {"Transfer-Encoding": "chunked"}),
    ],
    ids=["space-in-path", "crlf-in-path", "bad-method", "bad-name", "length", "chunked"],
)
def test_a_request_that_cannot_be_written_is_refused_before_io(
    client, servers, method, path, headers
):
    """Bad targets, header names and framing headers raise InvalidTask, nothing sent."""
    from npu_sync.errors import InvalidTask

    server = serve(servers, echo())
    with pytest.raises(InvalidTask):
        client(server.url()).request(method, path, headers=headers, **TIMEOUTS)
    assert server.connections == 0


def test_a_worker_header_overriding_host_replaces_the_default(client, servers):
    """A configured Host header is sent instead of the address's, and only once."""
    server = serve(servers, echo())
    client(server.url(), headers={"Host": "npu.internal"}).request("GET", "/x", **TIMEOUTS)
    assert server.seen[0].header("host") == "npu.internal"


def test_a_post_without_a_body_says_its_length_is_zero(client, servers):
    """POST with no body carries 'Content-Length: 0' so the worker does not wait."""
    server = serve(servers, echo())
    client(server.url()).request("POST", "/x", **TIMEOUTS)
    assert server.seen[0].header("content-length") == "0"
    assert server.seen[0].header("content-type") is None
