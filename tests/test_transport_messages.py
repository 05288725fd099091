"""What a worker's answer may look like, and what each transport makes of it.

Framing and content codings a worker may use (gzip, chunked with trailers, interim
1xx answers, HTTP/1.0 bodies ended by closing), answers that must be refused as
malformed, limits on heads and bodies, and requests that cannot be sent at all.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from npu_sync.errors import InvalidTask
from npu_sync.transport import TransportError
from tests.hostile import (
    CLIENTS,
    Clients,
    Peer,
    Seen,
    answer,
    chunked,
    keep_answering,
    serve,
)

TIMEOUTS = {"timeout": 5.0, "connect_timeout": 2.0}


@pytest.fixture(params=CLIENTS)
def client(request: pytest.FixtureRequest) -> Iterator[Clients]:
    clients = Clients(request.param)
    yield clients
    clients.close()


def routes(table: dict[str, Callable[[Seen], bytes]]) -> Any:
    """A keep-alive worker answering by path; unknown paths echo the path as JSON."""

    def reply(seen: Seen) -> bytes:
        route = table.get(seen.path)
        if route is not None:
            return route(seen)
        return answer(200, json.dumps({"path": seen.path}).encode())

    return keep_answering(reply)


def raw_then_close(data: bytes) -> Any:
    """A worker that answers the first request with ``data`` and hangs up."""

    def behaviour(peer: Peer) -> None:
        if peer.request() is not None:
            peer.send(data)

    return behaviour


# -- bodies ----------------------------------------------------------------------------

BIG_JSON = json.dumps({"response": "word " * 48_000}).encode()  # 240 KB


def test_a_gzip_body_with_a_content_length_is_decoded_whole(client, servers):
    """240 KB of JSON sent gzipped, with a Content-Length, arrives whole and exact."""
    packed = gzip.compress(BIG_JSON)
    server = serve(
        servers, routes({"/gz": lambda s: answer(200, packed, {"Content-Encoding": "gzip"})})
    )
    transport = client(server.url())
    resp = transport.request("POST", "/gz", body=b"{}", **TIMEOUTS)
    assert len(BIG_JSON) > 200_000 and resp.body == BIG_JSON
    # The connection is still good for the next request.
    assert transport.request("POST", "/next", body=b"{}", **TIMEOUTS).json() == {"path": "/next"}
    assert {seen.connection for seen in server.seen} == {1}


def test_a_gzip_bomb_stops_at_the_size_limit(client, servers):
    """64 MiB of zeros in 64 KB of gzip fails as 'too_large' under a 1 MiB limit."""
    bomb = gzip.compress(b"\0" * (64 << 20), compresslevel=9)
    server = serve(
        servers, routes({"/bomb": lambda s: answer(200, bomb, {"Content-Encoding": "gzip"})})
    )
    transport = client(server.url(), limit=1 << 20)
    with pytest.raises(TransportError) as info:
        transport.request("POST", "/bomb", body=b"{}", **TIMEOUTS)
    assert (info.value.kind, info.value.sent) == ("too_large", True)


def test_a_chunked_body_with_trailers_is_read_whole(client, servers):
    """Chunks are joined, trailers consumed, and the connection kept for reuse."""
    head = answer(200, b"", {"Transfer-Encoding": "chunked"}, length=False)
    body = chunked([b'{"a":', b" [1, 2", b", 3]}"], trailers={"X-Checksum": "abc"})
    server = serve(servers, routes({"/chunks": lambda s: head + body}))
    transport = client(server.url())
    assert transport.request("GET", "/chunks", **TIMEOUTS).json() == {"a": [1, 2, 3]}
    assert transport.request("GET", "/next", **TIMEOUTS).json() == {"path": "/next"}
    assert {seen.connection for seen in server.seen} == {1}


def test_interim_answers_are_skipped(client, servers):
    """100 Continue and 103 Early Hints before the final answer are passed over."""
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
    server = serve(servers, routes({"/hints": lambda s: interim + answer(200, b'{"ok": 1}')}))
    transport = client(server.url())
    resp = transport.request("POST", "/hints", body=b"{}", **TIMEOUTS)
    assert resp.status == 200 and resp.json() == {"ok": 1}
    assert transport.request("GET", "/next", **TIMEOUTS).status == 200


def test_an_http10_body_ended_by_closing_is_read_whole(client, servers):
    """An HTTP/1.0 answer without a length ends when the worker closes; not reused."""
    data = answer(200, BIG_JSON, length=False, version="HTTP/1.0")

    def behaviour(peer: Peer) -> None:
        if peer.number == 1:
            raw_then_close(data)(peer)
        else:
            routes({})(peer)

    server = serve(servers, behaviour)
    transport = client(server.url())
    assert transport.request("GET", "/old", **TIMEOUTS).body == BIG_JSON
    assert transport.request("GET", "/next", **TIMEOUTS).json() == {"path": "/next"}
    assert [seen.connection for seen in server.seen] == [1, 2]


def test_connection_close_in_the_answer_is_honoured(client, servers):
    """After 'Connection: close' the next request goes out on a new connection."""

    def behaviour(peer: Peer) -> None:
        seen = peer.request()
        if seen is not None:
            peer.send(answer(200, b"{}", {"Connection": "close"}))
            # Keeps the connection open: only the header says it must not be reused.
            peer.wait_readable()

    server = serve(servers, behaviour)
    transport = client(server.url())
    transport.request("GET", "/a", **TIMEOUTS)
    transport.request("GET", "/b", **TIMEOUTS)
    assert [seen.connection for seen in server.seen] == [1, 2]


def test_a_head_answer_has_no_body_and_keeps_the_connection(client, servers):
    """HEAD and 204 answers carry no body, whatever their Content-Length says."""

    def reply(seen: Seen) -> bytes:
        if seen.path == "/empty":
            return b"HTTP/1.1 204 No Content\r\n\r\n"
        return b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n"

    server = serve(servers, keep_answering(reply))
    transport = client(server.url())
    resp = transport.request("HEAD", "/x", **TIMEOUTS)
    assert (resp.status, resp.body, resp.headers["content-length"]) == (200, b"", "1234")
    assert transport.request("GET", "/empty", **TIMEOUTS).body == b""
    assert [seen.connection for seen in server.seen] == [1, 1]


def test_repeated_headers_are_joined_and_names_lower_cased(client, servers):
    """A header sent twice arrives once, values joined by ', '; names are lower-case."""
    data = (
        b"HTTP/1.1 200 OK\r\nX-A: 1\r\nx-a: 2\r\nContent-TYPE: application/json\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    )
    server = serve(servers, routes({"/multi": lambda s: data}))
    resp = client(server.url()).request("GET", "/multi", **TIMEOUTS)
    assert resp.headers["x-a"] == "1, 2"
    assert resp.headers["content-type"] == "application/json"


# -- malformed answers ---------------------------------------------------------------

MALFORMED = {
    "not-http": b"NOT HTTP AT ALL\r\n\r\n",
    "bad-status-code": b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n",
    "header-without-colon": b"HTTP/1.1 200 OK\r\nNo colon here\r\nContent-Length: 0\r\n\r\n",
    "bad-chunk-size": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"zz\r\nabc\r\n0\r\n\r\n",
    "too-many-headers": b"HTTP/1.1 200 OK\r\n"
    + b"".join(b"X-H-%d: v\r\n" % i for i in range(101))
    + b"Content-Length: 0\r\n\r\n",
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_answer_is_protocol(client, servers, data):
    """Answers that are not well-formed HTTP fail as 'protocol' with sent=True."""
    server = serve(servers, raw_then_close(data))
    with pytest.raises(TransportError) as info:
        client(server.url()).request("GET", "/x", **TIMEOUTS)
    assert (info.value.kind, info.value.sent) == ("protocol", True)


def test_many_headers_within_the_limit_are_accepted(client, servers):
    """An answer with 99 header fields is read (http.client's own limit is 99)."""
    data = (
        b"HTTP/1.1 200 OK\r\n"
        + b"".join(b"X-H-%d: v\r\n" % i for i in range(98))
        + b"Content-Length: 2\r\n\r\n{}"
    )
    server = serve(servers, routes({"/many": lambda s: data}))
    resp = client(server.url()).request("GET", "/many", **TIMEOUTS)
    assert resp.status == 200 and len(resp.headers) == 99


# -- requests that cannot be sent ---------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [{"X-Bad": "a\r\nX-Injected: 1"}, {"X-Bad": "line\nbreak"}, {"X-Bad": "snow ☃"}],
    ids=["crlf", "lf", "not-latin-1"],
)
def test_a_header_value_that_cannot_be_sent_is_the_tasks_fault(client, servers, headers):
    """CR, LF or a non-latin-1 value raises InvalidTask before anything is sent."""
    server = serve(servers, routes({}))
    transport = client(server.url())
    with pytest.raises(InvalidTask):
        transport.request("POST", "/x", body=b"{}", headers=headers, **TIMEOUTS)
    assert server.connections == 0


def test_the_request_carries_the_body_its_length_and_the_headers(client, servers):
    """The worker reads the body whole, with its Content-Type and per-call headers."""
    server = serve(servers, routes({}))
    transport = client(server.url(), headers={"Authorization": "Bearer t"})
    transport.request("POST", "/inference", body=b'{"k": 1}', headers={"X-Id": "7"}, **TIMEOUTS)
    (seen,) = server.seen
    assert (seen.method, seen.path, seen.body) == ("POST", "/inference", b'{"k": 1}')
    assert seen.header("content-length") == "8"
    assert seen.header("content-type") == "application/json"
    assert seen.header("authorization") == "Bearer t" and seen.header("x-id") == "7"
    assert seen.header("host") == f"127.0.0.1:{server.port}"
    assert "gzip" not in (seen.header("accept-encoding") or "")


def test_deflate_bodies_are_decoded_zlib_wrapped_or_raw(client, servers):
    """Content-Encoding: deflate is decoded whether the worker wraps it in zlib or not."""
    wrapped = zlib.compress(BIG_JSON)
    raw = zlib.compressobj(wbits=-15)
    bare = raw.compress(BIG_JSON) + raw.flush()
    server = serve(
        servers,
        routes(
            {
                "/zlib": lambda s: answer(200, wrapped, {"Content-Encoding": "deflate"}),
                "/raw": lambda s: answer(200, bare, {"Content-Encoding": "deflate"}),
            }
        ),
    )
    transport = client(server.url())
    assert transport.request("GET", "/zlib", **TIMEOUTS).body == BIG_JSON
    assert transport.request("GET", "/raw", **TIMEOUTS).body == BIG_JSON
