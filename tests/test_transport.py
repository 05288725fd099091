"""Tests of the HTTP transports against a loopback server and the ``responses`` mock,
and of the fake transport in npu_sync.testing.
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import requests
import responses
import trustme
import urllib3
import urllib3.util.connection
from urllib3.exceptions import InsecureRequestWarning, MaxRetryError, NewConnectionError

from npu_sync.config import TLSConfig, TransportConfig, WorkerConfig
from npu_sync.testing import FakeNetwork, FakeRequest, FakeTransport, json_response
from npu_sync.transport import (
    BuiltinTransport,
    RequestsTransport,
    Response,
    TransportError,
    Urllib3Transport,
    make_transport,
)

LIMIT = 1000
TIMEOUTS = {"connect_timeout": 2.0, "timeout": 5.0}


# --- a loopback HTTP server ------------------------------------------------------------


@dataclass(frozen=True)
class Seen:
    """One request as the server received it."""

    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes
    port: int
    peer_cert: bool

    def header(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]


Route = Callable[["_Handler"], None]


def reply(h: _Handler, status: int, body: bytes = b"{}", headers: dict[str, str] | None = None):
    h.send_response(status)
    for name, value in (headers or {"Content-Type": "application/json"}).items():
        h.send_header(name, value)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


def reply_chunked(h: _Handler, chunks: list[bytes]) -> None:
    h.send_response(200)
    h.send_header("Transfer-Encoding", "chunked")
    h.end_headers()
    for chunk in chunks:
        h.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    h.wfile.write(b"0\r\n\r\n")


def echo(h: _Handler) -> None:
    seen = h.server.seen[-1]
    reply(h, 200, json.dumps({"path": seen.path, "body": seen.body.decode()}).encode())


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    timeout = 10  # a stuck client cannot hold the server's teardown for long
    server: _Server

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            self.request.settimeout(self.timeout)
            self.request.do_handshake()
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        peer_cert = isinstance(self.connection, ssl.SSLSocket) and bool(
            self.connection.getpeercert()
        )
        self.server.record(
            Seen(
                self.command,
                self.path,
                list(self.headers.items()),
                body,
                self.client_address[1],
                peer_cert,
            )
        )
        self.server.routes.get(self.path, echo)(self)

    do_GET = do_POST = _serve


class _Server(ThreadingHTTPServer):
    # Non-daemon handler threads are joined by server_close(), so none outlive a test.
    daemon_threads = False

    def __init__(self, tls: ssl.SSLContext | None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.tls = tls
        self.routes: dict[str, Route] = {}
        self.seen: list[Seen] = []
        self.closed_ports: list[int] = []
        self.changed = threading.Condition()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def url(self, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port}"

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = super().get_request()
        if self.tls is not None:
            # The handshake runs in the handler thread, not in the accept loop.
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def record(self, seen: Seen) -> None:
        with self.changed:
            self.seen.append(seen)
            self.changed.notify_all()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        super().process_request_thread(request, client_address)  # closes the socket
        with self.changed:
            self.closed_ports.append(client_address[1])
            self.changed.notify_all()

    def wait_closed(self, port: int) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: port in self.closed_ports, timeout=5)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients that hang up mid-reply (timeouts, size limits) are expected here.
        pass

    def ports(self) -> list[int]:
        return [s.port for s in self.seen]


class Net:
    """Starts servers and transports for one test and stops them all afterwards."""

    def __init__(self) -> None:
        self.servers: list[tuple[_Server, threading.Thread]] = []
        self.transports: list[Any] = []

    def server(self, tls: ssl.SSLContext | None = None) -> _Server:
        server = _Server(tls)
        thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="test-server"
        )
        thread.start()
        self.servers.append((server, thread))
        return server

    def track(self, transport: Any) -> Any:
        self.transports.append(transport)
        return transport

    def urllib3(self, url: str, *, maxsize: int = 4, limit: int = LIMIT, **kw: Any) -> Any:
        tls = kw.pop("tls", TLSConfig())
        return self.track(
            Urllib3Transport(worker(url, **kw), tls=tls, max_response_bytes=limit, maxsize=maxsize)
        )

    def builtin(self, url: str, *, maxsize: int = 4, limit: int = LIMIT, **kw: Any) -> Any:
        tls = kw.pop("tls", TLSConfig())
        return self.track(
            BuiltinTransport(worker(url, **kw), tls=tls, max_response_bytes=limit, maxsize=maxsize)
        )

    def requests(self, url: str, *, maxsize: int = 4, limit: int = LIMIT, **kw: Any) -> Any:
        tls = kw.pop("tls", TLSConfig())
        return self.track(
            RequestsTransport(worker(url, **kw), tls=tls, max_response_bytes=limit, maxsize=maxsize)
        )

    def close(self) -> None:
        # Transports first: handler threads end when their keep-alive clients hang up.
        for transport in self.transports:
            transport.close()
        for server, thread in self.servers:
            server.shutdown()
            server.server_close()
            thread.join()


def worker(url: str, **kw: Any) -> WorkerConfig:
    return WorkerConfig(id=kw.pop("id", "w1"), url=url, **kw)


@pytest.fixture
def net() -> Iterator[Net]:
    nets = Net()
    yield nets
    nets.close()


@pytest.fixture
def server(net: Net) -> _Server:
    return net.server()


@pytest.fixture(params=["builtin", "urllib3", "requests"])
def client(request: pytest.FixtureRequest, net: Net) -> Callable[..., Any]:
    """Builds a transport of each kind, so a test runs against all three."""
    return getattr(net, request.param)  # type: ignore[no-any-return]


@pytest.fixture(params=["urllib3", "requests"])
def urllib3_client(request: pytest.FixtureRequest, net: Net) -> Callable[..., Any]:
    """Builds a transport of each kind built on urllib3."""
    return getattr(net, request.param)  # type: ignore[no-any-return]


@pytest.fixture
def refusing_port() -> Iterator[int]:
    """A loopback port that is bound but not listening, so connecting is refused."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield sock.getsockname()[1]
    sock.close()


# --- every transport against the loopback server -------------------------------------


def test_post_sends_body_worker_headers_and_call_headers(client, server):
    """A POST carries the JSON body, the worker's headers, and per-call headers that win."""
    t = client(server.url(), headers={"Authorization": "Bearer s3cret", "X-Env": "prod"})
    resp = t.request(
        "POST",
        "/inference",
        body=b'{"input_text":"hi"}',
        headers={"X-NPU-Task-Id": "t-1", "x-env": "test"},
        **TIMEOUTS,
    )
    assert resp.status == 200
    assert resp.json() == {"path": "/inference", "body": '{"input_text":"hi"}'}
    assert resp.headers["content-type"] == "application/json"
    (seen,) = server.seen
    assert seen.method == "POST" and seen.body == b'{"input_text":"hi"}'
    assert seen.header("Content-Type") == ["application/json"]
    assert seen.header("Authorization") == ["Bearer s3cret"]
    assert seen.header("X-NPU-Task-Id") == ["t-1"]
    assert seen.header("X-Env") == ["test"]
    assert seen.header("Cookie") == []


def test_get_without_body_sends_no_content_type(client, server):
    """A request without a body is not labelled as JSON."""
    t = client(server.url())
    assert t.request("GET", "/health", **TIMEOUTS).status == 200
    assert server.seen[0].header("Content-Type") == []


def test_sequential_requests_reuse_one_keep_alive_connection(client, server):
    """Several requests in a row travel over a single connection."""
    t = client(server.url())
    for _ in range(3):
        assert t.request("POST", "/inference", body=b"{}", **TIMEOUTS).status == 200
    assert len(set(server.ports())) == 1


def test_connection_refused_is_connect_and_not_sent(client, refusing_port):
    """A refused connection is kind 'connect' with sent=False."""
    t = client(f"http://127.0.0.1:{refusing_port}")
    with pytest.raises(TransportError) as info:
        t.request("POST", "/inference", body=b"{}", **TIMEOUTS)
    assert (info.value.kind, info.value.sent) == ("connect", False)


def test_read_timeout_is_timeout_and_sent(client, server):
    """A worker that does not answer in time gives kind 'timeout' with sent=True."""
    release = threading.Event()

    def stall(h: _Handler) -> None:
        release.wait(10)
        reply(h, 200)

    server.routes["/slow"] = stall
    t = client(server.url())
    try:
        with pytest.raises(TransportError) as info:
            t.request("POST", "/slow", body=b"{}", connect_timeout=2.0, timeout=0.2)
    finally:
        release.set()
    assert (info.value.kind, info.value.sent) == ("timeout", True)


def test_too_large_by_content_length_closes_the_connection(client, server):
    """A Content-Length over the limit fails as 'too_large' and its connection is dropped."""
    server.routes["/big"] = lambda h: reply(h, 200, b"x" * (LIMIT + 1))
    t = client(server.url())
    t.request("GET", "/small", **TIMEOUTS)
    with pytest.raises(TransportError) as info:
        t.request("GET", "/big", **TIMEOUTS)
    assert (info.value.kind, info.value.sent) == ("too_large", True)
    assert t.request("GET", "/after", **TIMEOUTS).json()["path"] == "/after"
    first, big, after = server.ports()
    assert big == first and after != big


def test_too_large_chunked_body_is_cut_off_and_the_connection_dropped(client, server):
    """A chunked body that grows past the limit fails as 'too_large' without reuse."""
    server.routes["/stream"] = lambda h: reply_chunked(h, [b"y" * 400] * 5)
    t = client(server.url())
    with pytest.raises(TransportError) as info:
        t.request("GET", "/stream", **TIMEOUTS)
    assert info.value.kind == "too_large"
    assert t.request("GET", "/after", **TIMEOUTS).status == 200
    assert len(set(server.ports())) == 2


def test_chunked_body_within_limit_is_read_whole_and_the_connection_kept(client, server):
    """A chunked body under the limit is reassembled and its connection reused."""
    server.routes["/stream"] = lambda h: reply_chunked(h, [b"[1,", b"2,", b"3]"])
    t = client(server.url())
    assert t.request("GET", "/stream", **TIMEOUTS).json() == [1, 2, 3]
    assert t.request("GET", "/after", **TIMEOUTS).status == 200
    assert len(set(server.ports())) == 1


def test_redirect_is_returned_not_followed(client, server):
    """A 302 comes back as a response; its Location is never requested."""
    server.routes["/old"] = lambda h: reply(h, 302, b"", {"Location": "/new"})
    t = client(server.url())
    resp = t.request("POST", "/old", body=b"{}", **TIMEOUTS)
    assert resp.status == 302 and resp.headers["location"] == "/new"
    assert [s.path for s in server.seen] == ["/old"]


def test_environment_proxies_are_ignored(client, server, monkeypatch, refusing_port):
    """Proxy variables in the environment do not divert requests to a worker."""
    dead = f"http://127.0.0.1:{refusing_port}"
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, dead)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    t = client(server.url())
    assert t.request("GET", "/health", **TIMEOUTS).status == 200
    assert len(server.seen) == 1


def test_worker_restart_between_requests_is_not_an_error(client, server):
    """A pooled connection the worker closed while idle is replaced, not reported."""

    def reply_then_hang_up(h: _Handler) -> None:
        reply(h, 200)
        h.close_connection = True  # closes without having said "Connection: close"

    server.routes["/bye"] = reply_then_hang_up
    t = client(server.url())
    t.request("GET", "/bye", **TIMEOUTS)
    server.wait_closed(server.ports()[0])
    assert t.request("GET", "/after", **TIMEOUTS).status == 200
    assert len(set(server.ports())) == 2


def test_connection_dropped_without_reply_is_reset_and_sent(client, server):
    """A worker that hangs up after reading the request gives 'reset' with sent=True."""

    def hang_up(h: _Handler) -> None:
        h.close_connection = True

    server.routes["/drop"] = hang_up
    t = client(server.url())
    with pytest.raises(TransportError) as info:
        t.request("POST", "/drop", body=b"{}", **TIMEOUTS)
    assert (info.value.kind, info.value.sent) == ("reset", True)


def test_malformed_response_is_protocol(client, server):
    """A reply that is not HTTP gives kind 'protocol' with sent=True."""

    def garbage(h: _Handler) -> None:
        h.wfile.write(b"NOT HTTP AT ALL\r\n\r\n")
        h.close_connection = True

    server.routes["/garbage"] = garbage
    t = client(server.url())
    with pytest.raises(TransportError) as info:
        t.request("GET", "/garbage", **TIMEOUTS)
    assert (info.value.kind, info.value.sent) == ("protocol", True)


def test_closed_transport_fails_as_not_sent(client, server):
    """After close(), requests fail with kind 'connect' and sent=False."""
    t = client(server.url())
    t.close()
    with pytest.raises(TransportError) as info:
        t.request("GET", "/health", **TIMEOUTS)
    assert (info.value.kind, info.value.sent) == ("connect", False)
    assert server.seen == []


def test_close_hangs_up_idle_connections_at_once(client, server):
    """close() closes pooled connections itself instead of leaving them to the GC."""
    server.routes["/big"] = lambda h: reply(h, 200, b"x" * (LIMIT + 1))
    t = client(server.url())
    # The error's traceback keeps the last streamed response, and so its pool, alive.
    with pytest.raises(TransportError) as held:
        t.request("GET", "/big", **TIMEOUTS)
    t.request("GET", "/after", **TIMEOUTS)
    t.close()
    server.wait_closed(server.ports()[-1])
    assert held.value.kind == "too_large"


def test_path_must_be_absolute(client, server):
    """A path that does not start with '/' is refused before any I/O."""
    t = client(server.url())
    with pytest.raises(ValueError, match="must start with '/'"):
        t.request("GET", "http://elsewhere/x", **TIMEOUTS)
    assert server.seen == []


def test_a_one_connection_transport_does_not_block_concurrent_callers(client, server):
    """With maxsize=1, a second concurrent request opens a connection instead of waiting."""
    both_arrived = threading.Barrier(2, timeout=5)

    def pair(h: _Handler) -> None:
        both_arrived.wait()
        reply(h, 200)

    server.routes["/pair"] = pair
    t = client(server.url(), maxsize=1)
    statuses: list[int] = []
    threads = [
        threading.Thread(
            target=lambda: statuses.append(t.request("GET", "/pair", **TIMEOUTS).status)
        )
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert statuses == [200, 200]


def test_many_threads_share_one_transport(client, server):
    """Concurrent callers each get their own response back."""
    t = client(server.url(), maxsize=4)
    results: dict[int, Any] = {}

    def run(n: int) -> None:
        for i in range(10):
            body = json.dumps({"n": n, "i": i}).encode()
            results[n * 100 + i] = t.request("POST", f"/t/{n}/{i}", body=body, **TIMEOUTS).json()

    threads = [threading.Thread(target=run, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 80
    for key, value in results.items():
        n, i = divmod(key, 100)
        assert value == {"path": f"/t/{n}/{i}", "body": json.dumps({"n": n, "i": i})}


# --- failures that need a controlled network -------------------------------------------


def test_name_resolution_failure_is_connect_and_not_sent(client, monkeypatch):
    """A worker host that does not resolve gives 'connect' with sent=False."""

    def no_such_host(*args: Any, **kwargs: Any) -> Any:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_host)
    t = client("http://npu-worker.invalid:8081")
    with pytest.raises(TransportError) as info:
        t.request("GET", "/health", **TIMEOUTS)
    assert (info.value.kind, info.value.sent) == ("connect", False)


def test_connect_timeout_is_timeout_and_not_sent(urllib3_client, monkeypatch):
    """A TCP connect that times out gives 'timeout' with sent=False.

    (tests/test_transport_deadlines.py makes a real connect time out, for all three.)
    """

    def black_hole(*args: Any, **kwargs: Any) -> Any:
        raise TimeoutError("timed out")

    monkeypatch.setattr(urllib3.util.connection, "create_connection", black_hole)
    t = urllib3_client("http://127.0.0.1:9")
    with pytest.raises(TransportError) as info:
        t.request("GET", "/health", **TIMEOUTS)
    assert (info.value.kind, info.value.sent) == ("timeout", False)


# --- TLS ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def ca_path(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tls") / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


def server_tls(ca: trustme.CA, require_client_cert: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(ctx)
    if require_client_cert:
        ca.configure_trust(ctx)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def test_https_verified_against_a_ca_bundle(client, net, ca, ca_path):
    """verify=<CA path> trusts a worker certificate signed by that CA."""
    server = net.server(server_tls(ca))
    t = client(server.url("https"), tls=TLSConfig(verify=ca_path))
    assert t.request("POST", "/inference", body=b"{}", **TIMEOUTS).status == 200


def test_https_with_an_unknown_ca_fails_before_sending(client, net, ca):
    """verify=True rejects a self-signed CA as a TLS failure with sent=False."""
    server = net.server(server_tls(ca))
    t = client(server.url("https"), tls=TLSConfig(verify=True))
    with pytest.raises(TransportError) as info:
        t.request("POST", "/inference", body=b"{}", **TIMEOUTS)
    assert (info.value.kind, info.value.sent) == ("tls", False)
    assert server.seen == []


def test_https_without_verification_emits_no_warning(client, net, ca):
    """verify=False works and urllib3's InsecureRequestWarning stays silent for it."""
    server = net.server(server_tls(ca))
    t = client(server.url("https"), tls=TLSConfig(verify=False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert t.request("GET", "/health", **TIMEOUTS).status == 200
        assert t.request("GET", "/health", **TIMEOUTS).status == 200
    assert [w for w in caught if issubclass(w.category, InsecureRequestWarning)] == []


def test_insecure_request_warning_is_not_silenced_for_other_code(net, ca):
    """Other urllib3 pools in the process still warn about unverified HTTPS."""
    server = net.server(server_tls(ca))
    net.urllib3(server.url("https"), tls=TLSConfig(verify=False))
    pool = urllib3.HTTPSConnectionPool(
        "127.0.0.1", server.port, cert_reqs="CERT_NONE", assert_hostname=False
    )
    try:
        with pytest.warns(InsecureRequestWarning):
            pool.request("GET", "/health")
    finally:
        pool.close()


def test_https_client_certificate_is_presented(client, net, ca, ca_path, tmp_path):
    """A configured client cert and key are sent to a worker that requires them."""
    leaf = ca.issue_cert("npu-client@example.org")
    cert, key = tmp_path / "client.pem", tmp_path / "client.key"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    server = net.server(server_tls(ca, require_client_cert=True))
    t = client(server.url("https"), tls=TLSConfig(verify=ca_path, cert=str(cert), key=str(key)))
    assert t.request("GET", "/health", **TIMEOUTS).status == 200
    assert server.seen[0].peer_cert


def test_tls_handshake_timeout_is_timeout_and_not_sent(client):
    """A worker that accepts TCP but never completes TLS gives 'timeout' with sent=False."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    try:
        port = listener.getsockname()[1]
        t = client(f"https://127.0.0.1:{port}", tls=TLSConfig(verify=False))
        with pytest.raises(TransportError) as info:
            t.request("GET", "/health", connect_timeout=0.2, timeout=5.0)
    finally:
        listener.close()
    assert (info.value.kind, info.value.sent) == ("timeout", False)


# --- RequestsTransport against the responses mock ----------------------------------------

BASE = "http://npu.test:8081"


@pytest.fixture
def mocked() -> Iterator[responses.RequestsMock]:
    with responses.RequestsMock() as rsps:
        yield rsps


def test_requests_transport_returns_status_headers_and_body(net, mocked):
    """A mocked reply comes back as a Response with lower-cased header names."""
    mocked.post(f"{BASE}/inference", json={"response": "ok"}, headers={"X-Trace": "abc"})
    resp = net.requests(BASE).request("POST", "/inference", body=b"{}", **TIMEOUTS)
    assert resp.status == 200 and resp.json() == {"response": "ok"}
    assert resp.headers["x-trace"] == "abc"


def test_requests_transport_merges_headers_case_insensitively(net, mocked):
    """Worker headers go on every request; per-call headers override them by name."""
    mocked.post(f"{BASE}/inference", json={})
    t = net.requests(BASE, headers={"Authorization": "Bearer a", "X-Env": "prod"})
    t.request("POST", "/inference", body=b"{}", headers={"x-env": "test", "X-Id": "1"}, **TIMEOUTS)
    sent = mocked.calls[0].request.headers
    assert sent["Authorization"] == "Bearer a"
    assert sent["X-Env"] == "test" and sent["X-Id"] == "1"
    assert sent["Content-Type"] == "application/json"
    assert "gzip" not in sent.get("Accept-Encoding", "")


def test_requests_transport_never_stores_cookies(net, mocked):
    """A Set-Cookie from a worker is not sent back on the next request."""
    mocked.get(f"{BASE}/login", json={}, headers={"Set-Cookie": "session=abc; Path=/"})
    mocked.get(f"{BASE}/next", json={})
    t = net.requests(BASE)
    t.request("GET", "/login", **TIMEOUTS)
    t.request("GET", "/next", **TIMEOUTS)
    assert "Cookie" not in mocked.calls[1].request.headers


def test_requests_transport_does_not_follow_redirects(net, mocked):
    """A 302 from the mock is returned as is; the target is never requested."""
    mocked.post(f"{BASE}/old", status=302, headers={"Location": f"{BASE}/new"})
    resp = net.requests(BASE).request("POST", "/old", body=b"{}", **TIMEOUTS)
    assert resp.status == 302 and len(mocked.calls) == 1


@pytest.mark.parametrize("with_length", [True, False])
def test_requests_transport_enforces_the_size_limit(net, mocked, with_length):
    """A body over the limit fails as 'too_large', with or without a Content-Length."""
    mocked.get(
        f"{BASE}/big",
        body=b"z" * (LIMIT + 1),
        auto_calculate_content_length=with_length,
    )
    with pytest.raises(TransportError) as info:
        net.requests(BASE).request("GET", "/big", **TIMEOUTS)
    assert (info.value.kind, info.value.sent) == ("too_large", True)


@pytest.mark.parametrize(
    ("error", "kind", "sent"),
    [
        (
            requests.ConnectionError(
                MaxRetryError(None, "/", NewConnectionError(None, "refused"))  # type: ignore[arg-type]
            ),
            "connect",
            False,
        ),
        (requests.ConnectTimeout(), "timeout", False),
        (requests.ReadTimeout(), "timeout", True),
        (requests.ConnectionError(ConnectionResetError(104, "reset")), "reset", True),
        (requests.exceptions.SSLError(), "tls", True),
    ],
)
def test_requests_transport_maps_errors(net, mocked, error, kind, sent):
    """Each requests exception becomes the TransportError kind the pool expects."""
    mocked.get(f"{BASE}/x", body=error)
    with pytest.raises(TransportError) as info:
        net.requests(BASE).request("GET", "/x", **TIMEOUTS)
    assert (info.value.kind, info.value.sent) == (kind, sent)


# --- make_transport, Response, TransportError ----------------------------------------------


def test_make_transport_picks_the_configured_client():
    """client 'builtin', 'urllib3' and 'requests' build the matching transport."""
    w = worker("http://127.0.0.1:8081")
    for client_name, cls in (
        ("builtin", BuiltinTransport),
        ("urllib3", Urllib3Transport),
        ("requests", RequestsTransport),
    ):
        t = make_transport(w, TransportConfig(client=client_name))
        try:
            assert isinstance(t, cls)
        finally:
            t.close()
    with pytest.raises(ValueError, match="unknown transport client"):
        make_transport(w, TransportConfig(client="httpx"))


def test_make_transport_refuses_an_unknown_scheme():
    """Only http and https workers can be reached."""
    with pytest.raises(ValueError, match="unsupported URL scheme"):
        make_transport(worker("ftp://127.0.0.1:21"), TransportConfig())


def test_make_transport_prefers_the_workers_own_tls_settings(net, ca, ca_path):
    """A worker's tls block overrides the transport-wide one."""
    server = net.server(server_tls(ca))
    w = worker(server.url("https"), tls=TLSConfig(verify=ca_path))
    t = net.track(make_transport(w, TransportConfig(tls=TLSConfig(verify=True))))
    assert t.request("GET", "/health", **TIMEOUTS).status == 200


def test_make_transport_applies_the_size_limit(net, server):
    """transport.max_response_bytes reaches the transport."""
    server.routes["/big"] = lambda h: reply(h, 200, b"x" * 101)
    t = net.track(make_transport(worker(server.url()), TransportConfig(max_response_bytes=100)))
    with pytest.raises(TransportError, match="larger than 100 bytes"):
        t.request("GET", "/big", **TIMEOUTS)


def test_response_json_raises_value_error_on_non_json():
    """Response.json() decodes JSON and raises ValueError for anything else."""
    assert Response(200, {}, b'{"a": 1}').json() == {"a": 1}
    with pytest.raises(ValueError):
        Response(200, {}, b"<html>").json()
    with pytest.raises(ValueError):
        Response(200, {}, b"\xff\xfe").json()


def test_repeated_response_headers_are_joined(client, server):
    """A header sent twice arrives once, its values joined by a comma."""
    server.routes["/multi"] = lambda h: reply(h, 200, b"{}", {"X-A": "1", "x-a": "2"})
    resp = client(server.url()).request("GET", "/multi", **TIMEOUTS)
    assert resp.headers["x-a"] == "1, 2"


def test_transport_error_rejects_unknown_kinds():
    """TransportError only takes the documented kinds and shows them in its repr."""
    err = TransportError("reset", "peer went away", sent=True)
    assert repr(err) == "TransportError('reset', 'peer went away', sent=True)"
    assert err.stale is False
    stale = TransportError("reset", "closed while idle", sent=True, stale=True)
    assert stale.stale and repr(stale).endswith("sent=True, stale=True)")
    with pytest.raises(ValueError, match="unknown transport error kind"):
        TransportError("oops", "x", sent=True)


# --- FakeTransport and FakeNetwork -------------------------------------------------------------


def test_fake_network_default_answers_with_the_worker_id():
    """Without routes, workers answer OK and report healthy on /health."""
    net = FakeNetwork()
    t = net.factory(worker("http://a:1", id="a"), TransportConfig())
    assert t.request("POST", "/inference", body=b"{}", **TIMEOUTS).json() == {
        "ok": True,
        "worker_id": "a",
    }
    assert t.request("GET", "/health", **TIMEOUTS).json()["status"] == "healthy"


def test_fake_network_routes_apply_to_transports_already_built():
    """route() changes a worker's behaviour for its existing transports too."""
    net = FakeNetwork()
    t = net.factory(worker("http://a:1", id="a"), TransportConfig())
    net.route("a", lambda req: json_response(503, {"detail": "busy"}))
    assert t.request("GET", "/x", **TIMEOUTS).status == 503


def test_fake_handler_returning_an_exception_raises_it():
    """A handler's exception instance is raised from request()."""
    refused = TransportError("connect", "refused", sent=False)
    net = FakeNetwork(default=lambda req: refused)
    t = net.factory(worker("http://a:1", id="a"), TransportConfig())
    with pytest.raises(TransportError) as info:
        t.request("GET", "/x", **TIMEOUTS)
    assert info.value is refused


def test_fake_transport_merges_headers_like_the_real_one():
    """Worker headers, then Content-Type for a body, then call headers, by name."""
    net = FakeNetwork()
    w = worker("http://a:1", id="a", headers={"Authorization": "t", "X-Env": "prod"})
    t = net.factory(w, TransportConfig())
    t.request("POST", "/inference", body=b'{"k":1}', headers={"x-env": "dev"}, **TIMEOUTS)
    t.request("GET", "/health", **TIMEOUTS)
    post, get = net.requests("a")
    assert post.headers == {
        "Authorization": "t",
        "Content-Type": "application/json",
        "x-env": "dev",
    }
    assert post.json() == {"k": 1}
    assert get.headers == {"Authorization": "t", "X-Env": "prod"}
    with pytest.raises(ValueError):
        get.json()


def test_fake_network_records_requests_per_worker_in_order():
    """requests() lists every request, or one worker's, in arrival order."""
    net = FakeNetwork()
    a = net.factory(worker("http://a:1", id="a"), TransportConfig())
    b = net.factory(worker("http://b:1", id="b"), TransportConfig())
    a.request("GET", "/1", **TIMEOUTS)
    b.request("GET", "/2", **TIMEOUTS)
    a.request("GET", "/3", connect_timeout=1.0, timeout=2.5)
    assert [r.path for r in net.requests()] == ["/1", "/2", "/3"]
    assert [r.path for r in net.requests("a")] == ["/1", "/3"]
    assert net.requests("a")[-1].timeout == 2.5
    assert [r.path for r in a.requests] == ["/1", "/3"]
    assert net.transports("b") == [b]


def test_fake_transport_is_safe_under_concurrent_use():
    """Requests from many threads are all recorded."""
    net = FakeNetwork()
    t = net.factory(worker("http://a:1", id="a"), TransportConfig())
    go = threading.Event()

    def run() -> None:
        go.wait(5)
        for _ in range(200):
            t.request("GET", "/x", **TIMEOUTS)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for thread in threads:
        thread.start()
    go.set()
    for thread in threads:
        thread.join()
    assert len(t.requests) == 1600 and len(net.requests("a")) == 1600


def test_closed_fake_transport_fails_as_not_sent():
    """A closed FakeTransport raises 'connect' with sent=False and records the attempt."""
    calls: list[FakeRequest] = []
    t = FakeTransport("a", lambda req: calls.append(req) or json_response(200, {}))
    t.close()
    assert t.closed
    with pytest.raises(TransportError) as info:
        t.request("GET", "/x", **TIMEOUTS)
    assert (info.value.kind, info.value.sent) == ("connect", False)
    assert calls == [] and len(t.requests) == 1


def test_fake_transport_enforces_the_size_limit():
    """Bodies over the transport's max_response_bytes fail as 'too_large'."""
    net = FakeNetwork(default=lambda req: Response(200, {}, b"x" * 11))
    t = net.factory(worker("http://a:1", id="a"), TransportConfig(max_response_bytes=10))
    with pytest.raises(TransportError) as info:
        t.request("GET", "/x", **TIMEOUTS)
    assert info.value.kind == "too_large"


def test_json_response_builds_a_json_reply():
    """json_response encodes the body and lower-cases header names."""
    resp = json_response(429, {"detail": "slow down"}, {"Retry-After": "2"})
    assert resp.status == 429 and resp.json() == {"detail": "slow down"}
    assert resp.headers == {"content-type": "application/json", "retry-after": "2"}


@pytest.mark.parametrize("client_name", ["builtin", "urllib3", "requests"])
def test_an_answer_dripping_a_byte_at_a_time_times_out_overall(client_name):
    """The read timeout bounds the whole body, not only each socket read."""
    from npu_sync.config import TransportConfig as _TransportConfig
    from npu_sync.config import worker_config as _worker_config
    from npu_sync.testing import DrippingServer
    from npu_sync.transport import make_transport as _make_transport

    with DrippingServer() as server:
        transport = _make_transport(
            _worker_config("drip", server.url), _TransportConfig(client=client_name)
        )
        try:
            with pytest.raises(TransportError) as info:
                transport.request("GET", "/health", connect_timeout=0.2, timeout=0.3)
            assert info.value.kind == "timeout" and info.value.sent
        finally:
            transport.close()
