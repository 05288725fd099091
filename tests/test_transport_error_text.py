"""A transport error reads as one clause: the worker, what happened, where, once."""

from __future__ import annotations

import contextlib
import socket
import ssl
from collections.abc import Iterator

import pytest

from npu_sync.config import TLSConfig
from npu_sync.transport import TransportError
from tests.hostile import CLIENTS, Clients, Peer, answer, serve

TIMEOUTS = {"timeout": 5.0, "connect_timeout": 2.0}


@pytest.fixture(params=CLIENTS)
def client(request: pytest.FixtureRequest) -> Iterator[Clients]:
    clients = Clients(request.param)
    yield clients
    clients.close()


def check_one_clause(message: str, worker_id: str, where: str) -> None:
    """The shape every message shares: ``id: happened (where)``, with nothing repeated."""
    assert message.startswith(f"{worker_id}: ") and message.endswith(f"({where})")
    assert "\n" not in message and message.count(where) == 1
    for noise in ("http://", "https://", "Errno", "HTTPConnection", "(worker "):
        assert noise not in message


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_refused_connection_names_the_worker_and_address_once(client):
    """Nothing listening: 'backup-npu: connection refused (127.0.0.1:port)' and nothing else."""
    port = free_port()
    transport = client(f"http://127.0.0.1:{port}", worker_id="backup-npu")
    with pytest.raises(TransportError) as info:
        transport.request("GET", "/health", **TIMEOUTS)
    assert (info.value.kind, info.value.sent) == ("connect", False)
    assert str(info.value) == f"backup-npu: connection refused (127.0.0.1:{port})"


def test_a_late_answer_names_the_budget_and_the_request(client, servers):
    """A worker that never answers: 'timed out after 0.3s waiting for the answer (POST /x)'."""

    def silent(peer: Peer) -> None:
        peer.request()
        peer.hold()

    server = serve(servers, silent)
    transport = client(server.url(), worker_id="slow")
    with pytest.raises(TransportError) as info:
        transport.request("POST", "/inference", body=b"{}", timeout=0.3)
    assert (info.value.kind, info.value.sent) == ("timeout", True)
    assert str(info.value) == "slow: timed out after 0.3s waiting for the answer (POST /inference)"


def test_a_malformed_answer_is_one_clause(client, servers):
    """An answer that is not HTTP names the worker and the request, once."""

    def garbage(peer: Peer) -> None:
        if peer.request() is not None:
            peer.send(b"NOT HTTP AT ALL\r\n\r\n")

    server = serve(servers, garbage)
    with pytest.raises(TransportError) as info:
        client(server.url()).request("GET", "/x", **TIMEOUTS)
    assert info.value.kind == "protocol"
    check_one_clause(str(info.value), "w1", "GET /x")


def test_an_oversized_answer_is_one_clause(client, servers):
    """A body over the limit reads the same from every transport."""

    def big(peer: Peer) -> None:
        if peer.request() is not None:
            peer.send(answer(200, b"x" * 4096))

    server = serve(servers, big)
    with pytest.raises(TransportError) as info:
        client(server.url(), limit=1024).request("POST", "/big", body=b"{}", **TIMEOUTS)
    assert info.value.kind == "too_large"
    assert str(info.value) == "w1: answer larger than 1024 bytes (POST /big)"


def test_an_untrusted_certificate_names_the_reason_and_address_once(client, servers, tmp_path):
    """A self-signed worker: 'TLS handshake failed: certificate verify failed ... (address)'."""
    trustme = pytest.importorskip("trustme")
    cert = trustme.CA().issue_cert("127.0.0.1")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    cert.configure_cert(ctx)

    def handshake(peer: Peer) -> None:
        with contextlib.suppress(OSError):
            ctx.wrap_socket(peer.sock, server_side=True).close()

    server = serve(servers, handshake)
    transport = client(server.url("https"), worker_id="secure", tls=TLSConfig(verify=True))
    with pytest.raises(TransportError) as info:
        transport.request("GET", "/health", **TIMEOUTS)
    assert (info.value.kind, info.value.sent) == ("tls", False)
    message = str(info.value)
    assert message.startswith("secure: TLS handshake failed: certificate verify failed")
    check_one_clause(message, "secure", f"127.0.0.1:{server.port}")
