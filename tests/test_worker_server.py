"""Tests of the reference worker served in-process (WorkerServer): each protocol's
routes, models, behaviours, stopping, TLS and authentication. The command line is in
test_worker_server_cli.py, the child-process LocalWorker in test_worker_server_local.py."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from npu_sync._retry import Kind
from npu_sync.auth import BearerAuth, HmacAuth
from npu_sync.protocols import LINUX, WINDOWS
from npu_sync.testing import FakeClock
from npu_sync.transport import Response
from npu_sync.worker_server import (
    CPU_DEVICE,
    DEVICE,
    MAX_BODY_BYTES,
    WorkerBehaviour,
    WorkerServer,
)
from tests.workerkit import SERVICE, call, in_background, infer, signed_call, win_task

MakeServer = Callable[..., WorkerServer]


@pytest.fixture
def make_server() -> Iterator[MakeServer]:
    servers: list[WorkerServer] = []

    def make(**kwargs: Any) -> WorkerServer:
        server = WorkerServer(**kwargs)
        server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


# --- /inference -----------------------------------------------------------------------------


def test_inference_success_has_the_protocol_shape(make_server: MakeServer) -> None:
    """A valid inference answers 200 with every protocol field and a deterministic response."""
    server = make_server(worker_id="w1")
    first = infer(server, "the quick brown fox")
    again = infer(server, "the quick brown fox")
    other = infer(server, "something else")
    assert first.status == 200
    assert first.headers["Content-Type"] == "application/json"
    assert set(first.json) == {
        "model_id",
        "device",
        "response",
        "inference_time_ms",
        "inference_count",
        "worker_id",
        "task_id",
        "attempt",
    }
    assert first.json["model_id"] == "default"
    assert first.json["device"] == DEVICE
    assert first.json["worker_id"] == "w1"
    assert first.json["task_id"] is None and first.json["attempt"] is None
    assert first.json["inference_time_ms"] >= 0
    assert [first.json["inference_count"], again.json["inference_count"]] == [1, 2]
    assert first.json["response"] == again.json["response"] != other.json["response"]


def test_inference_echoes_task_id_and_attempt_headers(make_server: MakeServer) -> None:
    """X-NPU-Task-Id is echoed as task_id and X-NPU-Attempt as an int (null if not an int)."""
    server = make_server()
    reply = infer(server, headers={"X-NPU-Task-Id": "abc123", "X-NPU-Attempt": "2"})
    bad = infer(server, headers={"X-NPU-Task-Id": "def456", "X-NPU-Attempt": "two"})
    assert (reply.json["task_id"], reply.json["attempt"]) == ("abc123", 2)
    assert (bad.json["task_id"], bad.json["attempt"]) == ("def456", None)


def test_repeated_task_ids_are_counted_as_duplicates(make_server: MakeServer) -> None:
    """A task id seen a second time counts as a duplicate; distinct ids count once each."""
    server = make_server()
    for task_id in ("t1", "t2", "t1", "t1"):
        assert infer(server, headers={"X-NPU-Task-Id": task_id}).status == 200
    infer(server)  # no task id: neither seen nor duplicate
    stats = server.stats()
    assert stats["task_ids_seen"] == 2
    assert stats["duplicates"] == 2


@pytest.mark.parametrize(
    "raw",
    [
        b"{not json",
        b"[1, 2]",
        b'{"model_id": "default"}',
        b'{"input_text": 5}',
        b'{"input_text": "x", "model_id": 3}',
        b'{"input_text": "x", "max_tokens": "many"}',
        b'{"input_text": "x", "temperature": "hot"}',
        b"",
    ],
)
def test_bad_inference_body_is_422_with_detail(make_server: MakeServer, raw: bytes) -> None:
    """Invalid JSON, a non-object or a missing/non-string input_text answers 422 {detail}."""
    server = make_server()
    reply = call(server, "POST", "/inference", raw=raw)
    assert reply.status == 422
    assert isinstance(reply.json["detail"], str) and reply.json["detail"]
    assert server.stats()["inference_count"] == 0


def test_unknown_model_answers_the_autobot_not_loaded_error(make_server: MakeServer) -> None:
    """A model the worker has not loaded answers 500 'Model <id> not loaded'."""
    server = make_server(models=("default", "llama"))
    reply = call(server, "POST", "/inference", {"model_id": "phi-3", "input_text": "x"})
    loaded = call(server, "POST", "/inference", {"model_id": "llama", "input_text": "x"})
    assert reply.status == 500
    assert reply.json == {"detail": "Model phi-3 not loaded"}
    assert loaded.status == 200 and loaded.json["model_id"] == "llama"


def test_model_id_defaults_to_default_and_star_serves_any(make_server: MakeServer) -> None:
    """A missing model_id means "default"; models=("*",) serves any model id."""
    only_other = make_server(models=("other",))
    anything = make_server(models=("*",))
    missing = call(only_other, "POST", "/inference", {"input_text": "x"})
    assert missing.status == 500 and missing.json == {"detail": "Model default not loaded"}
    reply = call(anything, "POST", "/inference", {"model_id": "whatever", "input_text": "x"})
    assert reply.status == 200 and reply.json["model_id"] == "whatever"


def test_failure_rate_one_always_answers_simulated_failure(make_server: MakeServer) -> None:
    """failure_rate=1.0 answers 500 'simulated failure' and counts no inference."""
    server = make_server(behaviour=WorkerBehaviour(failure_rate=1.0))
    replies = [infer(server) for _ in range(5)]
    assert {r.status for r in replies} == {500}
    assert replies[0].json == {"detail": "simulated failure"}
    assert server.stats()["inference_count"] == 0


def test_failure_rate_is_repeatable_with_a_seed(make_server: MakeServer) -> None:
    """With the same seed, a partial failure rate fails the same requests."""
    first = make_server(behaviour=WorkerBehaviour(failure_rate=0.5), seed=7)
    second = make_server(behaviour=WorkerBehaviour(failure_rate=0.5), seed=7)
    pattern_a = [infer(first).status for _ in range(30)]
    pattern_b = [infer(second).status for _ in range(30)]
    assert pattern_a == pattern_b
    assert set(pattern_a) == {200, 500}


def test_fail_all_fails_inference_while_health_says_healthy(make_server: MakeServer) -> None:
    """fail_all makes every inference 500 while /health keeps answering 200 healthy."""
    server = make_server(behaviour=WorkerBehaviour(fail_all=True))
    assert infer(server).status == 500
    health = call(server, "GET", "/health")
    assert health.status == 200 and health.json["status"] == "healthy"


def test_latency_and_jitter_are_waited_on_the_clock(make_server: MakeServer) -> None:
    """The latency is waited on the injected clock; jitter stays within +/- and never below 0."""
    clock = FakeClock()
    server = make_server(clock=clock, behaviour=WorkerBehaviour(latency_ms=5000.0))
    before = clock.monotonic()
    reply = infer(server)
    assert clock.monotonic() - before == pytest.approx(5.0)
    assert reply.json["inference_time_ms"] == pytest.approx(5000.0)

    server.update(latency_ms=100.0, jitter_ms=50.0)
    times = [infer(server).json["inference_time_ms"] for _ in range(30)]
    assert all(50.0 <= t <= 150.0 for t in times)
    assert len(set(times)) > 1

    server.update(latency_ms=0.0, jitter_ms=1000.0)
    for _ in range(30):
        before = clock.monotonic()
        infer(server)
        assert clock.monotonic() >= before


def test_a_model_latency_replaces_the_latency_for_its_tasks(make_server: MakeServer) -> None:
    """model_latency_ms: a task for a listed model waits its own latency, any other
    model the worker's; set at run time through /_control like any setting."""
    clock = FakeClock()
    server = make_server(
        clock=clock, models=("fast", "slow", "other"), behaviour=WorkerBehaviour(latency_ms=50.0)
    )
    reply = call(server, "POST", "/_control", {"model_latency_ms": {"fast": 2, "slow": 400}})
    assert reply.status == 200 and reply.json["model_latency_ms"] == {"fast": 2, "slow": 400}

    def waited(model: str) -> float:
        before = clock.monotonic()
        body = {"model_id": model, "input_text": "x"}
        assert call(server, "POST", "/inference", body).status == 200
        return clock.monotonic() - before

    assert waited("fast") == pytest.approx(0.002)
    assert waited("slow") == pytest.approx(0.4)
    assert waited("other") == pytest.approx(0.05)
    for bad in ({"fast": -1}, {"": 1}, ["fast"], {"fast": "1"}):
        assert call(server, "POST", "/_control", {"model_latency_ms": bad}).status == 422
    assert server.behaviour.model_latency_ms == {"fast": 2, "slow": 400}


# --- /health, /echo, routing ------------------------------------------------------------------


def test_health_reports_load_hints(make_server: MakeServer) -> None:
    """/health carries status, worker id, active tasks, max_concurrent, draining, models."""
    server = make_server(worker_id="w9", max_concurrent=3, models=("a", "b"))
    call(server, "POST", "/inference", {"model_id": "a", "input_text": "x"})
    reply = call(server, "GET", "/health")
    assert reply.status == 200
    assert reply.json["status"] == "healthy"
    assert reply.json["worker_id"] == "w9"
    assert reply.json["active_tasks"] == 0
    assert reply.json["max_concurrent"] == 3
    assert reply.json["draining"] is False
    assert reply.json["inference_count"] == 1
    assert reply.json["models"] == ["a", "b"]
    server.update(draining=True)
    assert call(server, "GET", "/health").json["draining"] is True


def test_unhealthy_status_answers_503(make_server: MakeServer) -> None:
    """A health_status other than "healthy" answers 503 with that status in the body."""
    server = make_server(behaviour=WorkerBehaviour(health_status="degraded"))
    reply = call(server, "GET", "/health")
    assert reply.status == 503
    assert reply.json["status"] == "degraded"
    server.update(health_status="healthy")
    assert call(server, "GET", "/health").status == 200


def test_echo_returns_the_body(make_server: MakeServer) -> None:
    """POST /echo answers the worker id and the JSON body it was sent."""
    server = make_server(worker_id="e1")
    reply = call(server, "POST", "/echo", {"a": [1, 2, {"b": None}]})
    assert reply.status == 200
    assert reply.json == {"worker_id": "e1", "echo": {"a": [1, 2, {"b": None}]}}


def test_unknown_path_is_404_and_wrong_method_is_405(make_server: MakeServer) -> None:
    """Unknown paths answer 404 JSON; known paths with the wrong method answer 405 with Allow."""
    server = make_server()
    missing = call(server, "GET", "/nope")
    wrong = call(server, "GET", "/inference")
    put = call(server, "PUT", "/health", {})
    assert missing.status == 404 and "detail" in missing.json
    assert wrong.status == 405 and wrong.headers["Allow"] == "POST"
    assert put.status == 405 and put.headers["Allow"] == "GET"
    assert call(server, "POST", "/_control", {}).status == 200
    assert call(server, "GET", "/_control").status == 405


def test_oversized_body_is_413_and_the_connection_closes(make_server: MakeServer) -> None:
    """A Content-Length above the limit answers 413 without reading the body, then closes."""
    server = make_server()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.putrequest("POST", "/inference")
        conn.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
        conn.endheaders()
        response = conn.getresponse()
        assert response.status == 413
        assert response.getheader("Connection") == "close"
        assert "detail" in json.loads(response.read())
    finally:
        conn.close()


def test_expect_100_continue_is_answered_before_the_body(make_server: MakeServer) -> None:
    """A client sending Expect: 100-continue gets the interim answer before it sends the body."""
    server = make_server()
    body = json.dumps({"input_text": "x"}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(
            b"POST /inference HTTP/1.1\r\nHost: 127.0.0.1\r\nExpect: 100-continue\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        )
        interim = b""
        while b"\r\n\r\n" not in interim:
            chunk = sock.recv(4096)
            assert chunk, "connection closed before 100 Continue"
            interim += chunk
        assert interim.startswith(b"HTTP/1.1 100")
        sock.sendall(body)
        final = sock.recv(4096)
    assert final.startswith(b"HTTP/1.1 200")


# --- keep-alive, stats, control ---------------------------------------------------------------


def test_keep_alive_serves_several_requests_on_one_connection(make_server: MakeServer) -> None:
    """HTTP/1.1 keep-alive: several requests on one connection use one server connection."""
    server = make_server()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        assert infer(server, connection=conn).status == 200
        sock = conn.sock
        assert call(server, "GET", "/health", connection=conn).status == 200
        stats = call(server, "GET", "/stats", connection=conn).json
        assert conn.sock is sock
    finally:
        conn.close()
    assert stats["connections"] == 1
    assert stats["requests"] == {"/health": 1, "/inference": 1, "/stats": 1}


def test_stats_count_paths_statuses_and_max_in_flight(make_server: MakeServer) -> None:
    """/stats counts requests by path, responses by status and the most tasks in flight."""
    server = make_server(behaviour=WorkerBehaviour(hang=True))
    clients = [in_background(lambda: infer(server)) for _ in range(3)]
    assert server.wait_until(lambda s: s["in_flight"] == 3, timeout=10)
    server.update(hang=False)
    for thread, outcome in clients:
        thread.join(10)
        assert outcome["result"].status == 200
    call(server, "GET", "/nope")
    stats = call(server, "GET", "/stats").json
    assert stats["requests"] == {"/inference": 3, "<other>": 1, "/stats": 1}
    assert stats["responses"] == {"200": 3, "404": 1}
    assert stats["max_in_flight"] == 3
    assert stats["in_flight"] == 0


def test_control_endpoint_changes_behaviour_at_run_time(make_server: MakeServer) -> None:
    """POST /_control updates the running worker and answers the new settings."""
    server = make_server()
    reply = call(server, "POST", "/_control", {"failure_rate": 1.0, "latency_ms": 1})
    assert reply.status == 200
    assert reply.json["failure_rate"] == 1.0 and reply.json["latency_ms"] == 1
    assert server.behaviour.failure_rate == 1.0
    assert infer(server).status == 500
    call(server, "POST", "/_control", {"failure_rate": 0.0})
    assert infer(server).status == 200


@pytest.mark.parametrize(
    "changes",
    [{"failure_rate": 2}, {"bogus": 1}, {"status_code": 200}, {"hang": "yes"}, [1], "x"],
)
def test_control_rejects_bad_settings_and_keeps_the_old(
    make_server: MakeServer, changes: object
) -> None:
    """An unknown setting or bad value answers 422 and changes nothing."""
    server = make_server()
    reply = call(server, "POST", "/_control", changes)
    assert reply.status == 422 and reply.json["detail"]
    assert server.behaviour == WorkerBehaviour()


def test_update_validates_values() -> None:
    """WorkerBehaviour and WorkerServer.update raise ValueError on invalid settings."""
    with pytest.raises(ValueError, match="failure_rate"):
        WorkerBehaviour(failure_rate=1.5)
    with pytest.raises(ValueError, match="latency_ms"):
        WorkerBehaviour(latency_ms=-1)
    server = WorkerServer()
    with pytest.raises(ValueError, match="unknown"):
        server.update(latency=3)
    with pytest.raises(ValueError, match="status_code"):
        server.update(status_code=True)


def test_forced_status_with_retry_after(make_server: MakeServer) -> None:
    """status_code forces every inference's answer; Retry-After goes with 429 and 503 only."""
    server = make_server()
    server.update(status_code=429, retry_after=2)
    limited = infer(server)
    assert limited.status == 429
    assert limited.json == {"detail": "forced"}
    assert limited.headers["Retry-After"] == "2"
    server.update(status_code=503, retry_after=0.25)
    assert infer(server).headers["Retry-After"] == "0.25"
    server.update(status_code=422)
    rejected = infer(server)
    assert rejected.status == 422 and rejected.headers["Retry-After"] is None
    server.update(status_code=None)
    assert infer(server).status == 200


# --- hang and stop ----------------------------------------------------------------------------


def test_hang_holds_requests_until_turned_off(make_server: MakeServer) -> None:
    """With hang on, inference and health are not answered; turning it off answers them."""
    server = make_server(behaviour=WorkerBehaviour(hang=True))
    inference, inference_outcome = in_background(lambda: infer(server))
    health, health_outcome = in_background(lambda: call(server, "GET", "/health"))
    assert server.wait_until(
        lambda s: s["in_flight"] == 1 and s["requests"].get("/health") == 1, timeout=10
    )
    assert call(server, "GET", "/stats").json["in_flight"] == 1  # /stats never hangs
    with pytest.raises(TimeoutError):
        call(server, "GET", "/health", timeout=0.2)
    assert inference.is_alive() and health.is_alive()
    server.update(hang=False)
    inference.join(10)
    health.join(10)
    assert inference_outcome["result"].status == 200
    assert health_outcome["result"].status == 200


def test_stop_returns_promptly_and_drops_hung_requests(make_server: MakeServer) -> None:
    """stop() releases hung handlers at once; their clients see the connection close."""
    server = make_server(behaviour=WorkerBehaviour(hang=True))
    client, outcome = in_background(lambda: infer(server, timeout=30))
    idle = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        assert call(server, "GET", "/stats", connection=idle).status == 200
        assert server.wait_until(lambda s: s["in_flight"] == 1, timeout=10)
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 10  # the handler hangs for good
        # stop() closed the idle keep-alive connection and joined every server thread.
        assert idle.sock is not None
        idle.sock.settimeout(5)
        assert idle.sock.recv(1) == b""
        assert not [t.name for t in threading.enumerate() if t.name.startswith("npu-sync-worker")]
    finally:
        idle.close()
    client.join(10)
    assert not client.is_alive()
    assert isinstance(outcome.get("error"), (http.client.RemoteDisconnected, ConnectionError))
    with pytest.raises(ConnectionRefusedError):
        infer(server)


def test_stop_interrupts_a_long_latency(make_server: MakeServer) -> None:
    """A request waiting out a long latency does not hold up stop()."""
    server = make_server(behaviour=WorkerBehaviour(latency_ms=60_000))
    client, outcome = in_background(lambda: infer(server, timeout=30))
    assert server.wait_until(lambda s: s["in_flight"] == 1, timeout=10)
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 10  # far below the 60 s latency
    client.join(10)
    assert "error" in outcome


def test_server_cannot_start_twice_and_stop_is_idempotent() -> None:
    """start() after start() raises; stop() may be called again and before start."""
    server = WorkerServer()
    server.stop()
    with pytest.raises(RuntimeError):
        server.start()
    with WorkerServer() as running:
        assert running.port != 0
        with pytest.raises(RuntimeError):
            running.start()
    running.stop()


# --- TLS --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def tls_files(ca: trustme.CA, tmp_path: Path) -> tuple[Path, Path, Path]:
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert_path, key_path, ca_path = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    cert.private_key_pem.write_to_path(str(key_path))
    for i, blob in enumerate(cert.cert_chain_pems):
        blob.write_to_path(str(cert_path), append=i > 0)
    ca.cert_pem.write_to_path(str(ca_path))
    return cert_path, key_path, ca_path


def test_tls_serves_https_verified_by_the_ca(
    make_server: MakeServer, ca: trustme.CA, tls_files: tuple[Path, Path, Path]
) -> None:
    """With a certificate, the worker serves HTTPS that a client trusting the CA verifies."""
    cert, key, _ = tls_files
    server = make_server(tls_cert=cert, tls_key=key)
    assert server.url == f"https://127.0.0.1:{server.port}"
    context = ssl.create_default_context()
    ca.configure_trust(context)
    conn = http.client.HTTPSConnection("127.0.0.1", server.port, timeout=10, context=context)
    try:
        first = infer(server, connection=conn)
        second = call(server, "GET", "/health", connection=conn)
    finally:
        conn.close()
    assert first.status == 200 and second.status == 200
    with pytest.raises(ConnectionError):
        infer(server)  # plain HTTP on the TLS port is not answered


def test_tls_client_ca_requires_a_client_certificate(
    make_server: MakeServer, ca: trustme.CA, tls_files: tuple[Path, Path, Path]
) -> None:
    """With tls_client_ca, a client without a certificate is refused, one with it served."""
    cert, key, ca_path = tls_files
    server = make_server(tls_cert=cert, tls_key=key, tls_client_ca=ca_path)

    def https_health(context: ssl.SSLContext) -> int:
        conn = http.client.HTTPSConnection("127.0.0.1", server.port, timeout=10, context=context)
        try:
            return call(server, "GET", "/health", connection=conn).status
        finally:
            conn.close()

    anonymous = ssl.create_default_context()
    ca.configure_trust(anonymous)
    with pytest.raises((ssl.SSLError, ConnectionError)):
        https_health(anonymous)
    identified = ssl.create_default_context()
    ca.configure_trust(identified)
    ca.issue_cert("client@example.com").configure_cert(identified)
    assert https_health(identified) == 200


# --- models (the Linux protocol) --------------------------------------------------------------


def test_models_lists_loaded_models_in_autobots_shape(make_server: MakeServer) -> None:
    """GET /models answers AutoBot's shape: npu_available, optimal_device, loaded_models
    with device, inference_count and loaded_at per model, available_devices."""
    clock = FakeClock(wall=1_750_000_000.0)
    server = make_server(models=("a", "b"), clock=clock)
    call(server, "POST", "/inference", {"model_id": "a", "input_text": "x"})
    reply = call(server, "GET", "/models")
    assert reply.status == 200
    assert set(reply.json) == {
        "npu_available",
        "optimal_device",
        "loaded_models",
        "available_devices",
    }
    assert reply.json["npu_available"] is True
    assert reply.json["optimal_device"] == DEVICE
    assert reply.json["available_devices"] == [DEVICE, CPU_DEVICE]
    loaded = reply.json["loaded_models"]
    assert list(loaded) == ["a", "b"]
    assert loaded["a"] == {
        "device": DEVICE,
        "inference_count": 1,
        "loaded_at": "2025-06-15T15:06:40+00:00",
    }
    assert loaded["b"]["inference_count"] == 0


def test_linux_health_gives_a_model_count_npu_and_optimal_device(make_server: MakeServer) -> None:
    """Linux /health carries AutoBot's loaded_models count, npu_available, optimal_device."""
    server = make_server(models=("a", "b", "*"))
    health = call(server, "GET", "/health").json
    assert health["loaded_models"] == 2
    assert health["npu_available"] is True
    assert health["optimal_device"] == DEVICE
    assert health["models"] == ["a", "b", "*"]


def test_load_takes_the_load_delay_and_then_serves(make_server: MakeServer) -> None:
    """POST /models/load waits load_delay_ms on the clock, then the model serves."""
    clock = FakeClock()
    server = make_server(models=(), clock=clock, behaviour=WorkerBehaviour(load_delay_ms=1500))
    assert infer(server).json == {"detail": "Model default not loaded"}
    before = clock.monotonic()
    reply = call(server, "POST", "/models/load", {"model_id": "default", "model_config": {}})
    assert reply.status == 200 and reply.json == {"status": "success", "model_id": "default"}
    assert clock.monotonic() - before == pytest.approx(1.5)
    assert infer(server).status == 200
    again = clock.monotonic()
    assert call(server, "POST", "/models/load", {"model_id": "default"}).status == 200
    assert clock.monotonic() == again  # already loaded: instant
    assert server.stats()["loads"] == 1


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"model_id": ""},
        {"model_id": 3},
        {"model_id": "*"},
        {"model_id": "a", "model_config": 1},
    ],
)
def test_load_rejects_a_bad_request(make_server: MakeServer, body: object) -> None:
    """A load without a usable model_id, or with a non-object model_config, answers 422."""
    server = make_server()
    reply = call(server, "POST", "/models/load", body)
    assert reply.status == 422 and reply.json["detail"]
    assert server.models == ["default"]


def test_delete_unloads_a_model_and_404s_an_unknown_one(make_server: MakeServer) -> None:
    """DELETE /models/{id} unloads (the model then answers "not loaded"); unknown is 404."""
    server = make_server(models=("default", "my model"))
    assert call(server, "DELETE", "/models/my%20model").json == {
        "status": "success",
        "model_id": "my model",
    }
    assert call(server, "DELETE", "/models/my%20model").status == 404
    assert call(server, "DELETE", "/models/default").status == 200
    assert infer(server).json == {"detail": "Model default not loaded"}
    assert call(server, "GET", "/models").json["loaded_models"] == {}
    assert server.stats()["requests"]["/models/{model_id}"] == 3


def test_star_loads_a_model_on_first_use(make_server: MakeServer) -> None:
    """Under "*" a model is loaded on first use, taking the load delay once, and listed."""
    clock = FakeClock()
    server = make_server(models=("*",), clock=clock, behaviour=WorkerBehaviour(load_delay_ms=800))
    first = call(server, "POST", "/inference", {"model_id": "phi", "input_text": "x"})
    second = call(server, "POST", "/inference", {"model_id": "phi", "input_text": "x"})
    assert first.json["inference_time_ms"] == pytest.approx(800.0)
    assert second.json["inference_time_ms"] == pytest.approx(0.0)
    assert list(call(server, "GET", "/models").json["loaded_models"]) == ["phi"]
    assert server.models == ["phi", "*"]


def test_models_change_at_run_time_through_update_and_control(make_server: MakeServer) -> None:
    """update(models=...) and /_control {"models": [...]} load and unload at once."""
    server = make_server(models=("a",))
    server.update(models=["b", "c"])
    assert server.models == ["b", "c"]
    assert call(server, "POST", "/inference", {"model_id": "a", "input_text": "x"}).status == 500
    reply = call(server, "POST", "/_control", {"models": ["a"], "latency_ms": 1})
    assert reply.status == 200 and reply.json["models"] == ["a"]
    assert reply.json["latency_ms"] == 1
    assert call(server, "POST", "/inference", {"model_id": "a", "input_text": "x"}).status == 200


@pytest.mark.parametrize("models", ["a", [""], [3], ["x\n"], None])
def test_bad_models_setting_changes_nothing(make_server: MakeServer, models: object) -> None:
    """A models setting that is not a list of printable ids answers 422; nothing changes."""
    server = make_server(models=("a",))
    reply = call(server, "POST", "/_control", {"models": models, "latency_ms": 5})
    assert reply.status == 422 and "models" in reply.json["detail"]
    assert server.models == ["a"]
    assert server.behaviour.latency_ms == 0.0


def test_npu_fallback_is_reported_everywhere(make_server: MakeServer) -> None:
    """With npu_available off, health, /models, /devices and answers name the CPU."""
    server = make_server(models=("a",))
    server.update(npu_available=False)
    health = call(server, "GET", "/health").json
    assert (health["npu_available"], health["optimal_device"]) == (False, CPU_DEVICE)
    models = call(server, "GET", "/models").json
    assert models["npu_available"] is False and models["available_devices"] == [CPU_DEVICE]
    assert call(server, "GET", "/devices").json == {
        "npu_available": False,
        "optimal_device": CPU_DEVICE,
        "available_devices": [CPU_DEVICE],
    }
    answer = call(server, "POST", "/inference", {"model_id": "a", "input_text": "x"}).json
    assert answer["device"] == CPU_DEVICE
    server.update(models=["a", "b"])
    assert call(server, "GET", "/models").json["loaded_models"]["b"]["device"] == CPU_DEVICE


# --- the Windows protocol ---------------------------------------------------------------------


def test_windows_inference_answers_completed_with_a_result(make_server: MakeServer) -> None:
    """A Windows task answers 200 {task_id, status: completed, result, processing_time_ms}."""
    server = make_server(protocol="windows", worker_id="win")
    reply = call(server, "POST", "/inference", win_task(priority=1, timeout_seconds=30),
                 headers={"X-NPU-Task-Id": "t-1"})  # fmt: skip
    assert reply.status == 200
    assert reply.json["status"] == "completed" and reply.json["task_id"] == "t-1"
    assert reply.json["worker_id"] == "win"
    result = reply.json["result"]
    assert result["model_used"] == "default" and result["device"] == DEVICE
    assert len(result["embedding"]) == 8 and all(-1 <= x <= 1 for x in result["embedding"])
    again = call(server, "POST", "/inference", win_task())
    other = call(server, "POST", "/inference", win_task(text="other"))
    assert again.json["result"]["embedding"] == result["embedding"]
    assert other.json["result"]["embedding"] != result["embedding"]
    assert again.json["task_id"] != "t-1"


@pytest.mark.parametrize(
    ("setup", "task", "error"),
    [
        ({"behaviour": WorkerBehaviour(failure_rate=1.0)}, win_task(), "simulated failure"),
        ({"behaviour": WorkerBehaviour(fail_all=True)}, win_task(), "simulated failure"),
        ({}, {**win_task(), "task_type": "poetry"}, "Unsupported task type: poetry"),
        ({}, win_task(model="phi"), "Model phi not loaded"),
        ({}, {**win_task(), "input_data": {"text": 5}}, "input_data.text: must be a string"),
    ],
)
def test_windows_failures_answer_200_status_failed(
    make_server: MakeServer, setup: dict[str, Any], task: dict[str, Any], error: str
) -> None:
    """Simulated failures, unknown task types and missing models answer HTTP 200
    {"status": "failed", "error"}, as AutoBot's Windows worker does."""
    server = make_server(protocol="windows", **setup)
    reply = call(server, "POST", "/inference", task)
    assert reply.status == 200
    assert reply.json["status"] == "failed" and reply.json["error"] == error
    assert server.stats()["failed_tasks"] == 1
    assert server.stats()["inference_count"] == 0


@pytest.mark.parametrize(
    "body",
    [
        {"model_name": "default", "input_data": {}},
        {"task_type": "embedding_generation", "input_data": {}},
        {"task_type": "embedding_generation", "model_name": "default"},
        {**win_task(), "priority": "high"},
        {"model_id": "default", "input_text": "linux-shaped"},
        [1],
    ],
)
def test_windows_malformed_task_is_422(make_server: MakeServer, body: object) -> None:
    """A task missing task_type, model_name or input_data (or mistyped) answers 422."""
    reply = call(make_server(protocol="windows"), "POST", "/inference", body)
    assert reply.status == 422 and reply.json["detail"]


def test_windows_health_lists_models_and_platform(make_server: MakeServer) -> None:
    """Windows /health lists loaded_models by name and says platform windows."""
    server = make_server(protocol="windows", models=("nomic", "bge", "*"))
    health = call(server, "GET", "/health").json
    assert health["status"] == "healthy" and health["platform"] == "windows"
    assert health["loaded_models"] == ["nomic", "bge"]
    assert health["npu_available"] is True
    assert "models" not in health and "optimal_device" not in health


def test_windows_loads_on_demand_under_star(make_server: MakeServer) -> None:
    """Under "*" the Windows worker loads an unknown model on first use, as AutoBot's does."""
    server = make_server(protocol="windows", models=("*",))
    assert call(server, "POST", "/inference", win_task(model="e5")).json["status"] == "completed"
    assert call(server, "GET", "/health").json["loaded_models"] == ["e5"]


def test_windows_model_optimize_loads_a_model(make_server: MakeServer) -> None:
    """POST /model/optimize?model_name=X loads X (taking the load delay); no name is 422."""
    clock = FakeClock()
    server = make_server(
        protocol="windows", models=(), clock=clock, behaviour=WorkerBehaviour(load_delay_ms=2000)
    )
    before = clock.monotonic()
    reply = call(server, "POST", "/model/optimize?model_name=bge%20small&optimization_level=speed")
    assert reply.status == 200
    assert reply.json == {
        "status": "success",
        "model": "bge small",
        "optimization_level": "speed",
        "optimized_for_npu": True,
    }
    assert clock.monotonic() - before == pytest.approx(2.0)
    assert server.models == ["bge small"]
    assert call(server, "POST", "/model/optimize").status == 422


def test_each_protocol_serves_only_its_own_routes(make_server: MakeServer) -> None:
    """Linux has no /model/optimize; Windows has no /models, /models/load or DELETE."""
    linux = make_server()
    windows = make_server(protocol="windows")
    assert call(linux, "POST", "/model/optimize?model_name=a").status == 404
    assert call(windows, "GET", "/models").status == 404
    assert call(windows, "POST", "/models/load", {"model_id": "a"}).status == 404
    assert call(windows, "DELETE", "/models/default").status == 404
    with pytest.raises(ValueError, match="protocol"):
        WorkerServer(protocol="macos")


def test_worker_and_protocol_objects_agree(make_server: MakeServer) -> None:
    """Tasks mapped by each protocol run on its reference worker and classify as the
    worker meant: success, failure, "not loaded"; health and models parse."""
    for protocol, kind in ((LINUX, "linux"), (WINDOWS, "windows")):
        server = make_server(protocol=kind, models=("a",))
        task = {"model_id": "a", "input_text": "hi"}

        def send(payload: object, server: WorkerServer = server) -> Response:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            try:
                conn.request("POST", "/inference", body=json.dumps(payload).encode())
                answer = conn.getresponse()
                return Response(answer.status, {}, answer.read())
            finally:
                conn.close()

        ok = protocol.classify(send(protocol.request_body(task)))
        assert ok.kind is Kind.SUCCESS, (kind, ok)
        missing = protocol.classify(send(protocol.request_body({**task, "model_id": "zz"})))
        assert protocol.not_loaded_model(missing) == "zz", kind
        server.update(fail_all=True)
        failed = protocol.classify(send(protocol.request_body(task)))
        assert failed.kind is Kind.FAILURE, kind
        health = protocol.parse_health(call(server, "GET", "/health").json)
        assert health.healthy and health.npu_available is True
        if protocol.models_path is None:
            assert health.models == frozenset({"a"})
        else:
            models = protocol.parse_models(call(server, "GET", protocol.models_path).json)
            assert models is not None and models.models == frozenset({"a"})
        method, path, body = protocol.load_request("b c")
        assert call(server, method, path, body).status == 200
        assert server.models == ["a", "b c"]


# --- authentication ---------------------------------------------------------------------------
def test_hmac_signed_requests_verify_on_every_endpoint(make_server: MakeServer) -> None:
    """Requests signed by HmacAuth with the shared secret are served, query strings too."""
    linux = make_server(hmac_auth=SERVICE)
    windows = make_server(hmac_auth=SERVICE, protocol="windows")
    assert signed_call(linux, "GET", "/health").status == 200
    assert signed_call(linux, "POST", "/inference", {"input_text": "x"}).status == 200
    assert signed_call(linux, "GET", "/models").status == 200
    assert signed_call(linux, "DELETE", "/models/default").status == 200
    assert signed_call(windows, "POST", "/inference", win_task()).status == 200
    assert signed_call(windows, "POST", "/model/optimize?model_name=x").status == 200


def test_hmac_refuses_wrong_secret_replay_and_missing_headers(make_server: MakeServer) -> None:
    """A wrong secret, a timestamp older than 300 s, another service id or a missing
    header answers 401 with a reason, and the task never runs."""
    clock = FakeClock()
    server = make_server(hmac_auth=SERVICE, clock=clock)
    task = {"input_text": "x"}
    wrong_secret = HmacAuth(SERVICE[0], "nope", clock=clock.time)
    wrong = signed_call(server, "POST", "/inference", task, auth=wrong_secret)
    assert (wrong.status, wrong.json) == (401, {"detail": "bad signature"})
    replayed = HmacAuth(*SERVICE, clock=lambda: clock.time() - 301)
    old = signed_call(server, "POST", "/inference", task, auth=replayed)
    assert old.status == 401 and "timestamp" in old.json["detail"]
    other_id = HmacAuth("x", SERVICE[1], clock=clock.time)
    stranger = signed_call(server, "POST", "/inference", task, auth=other_id)
    assert (stranger.status, stranger.json["detail"]) == (401, "unknown service id")
    good = dict(HmacAuth(*SERVICE, clock=clock.time).headers("POST", "/inference"))
    for name in list(good):
        partial = {k: v for k, v in good.items() if k != name}
        reply = call(server, "POST", "/inference", task, headers=partial)
        assert (reply.status, reply.json["detail"]) == (401, f"missing {name} header")
    assert call(server, "POST", "/inference", task, headers=good).status == 200
    stats = server.stats()
    assert stats["inference_count"] == 1 and stats["responses"]["401"] == 6
    assert all(SERVICE[1] not in json.dumps(r) for r in (wrong.json, old.json))


def test_hmac_leaves_the_test_hooks_open(make_server: MakeServer) -> None:
    """/stats and /_control need no signature; /health and unknown paths do."""
    server = make_server(hmac_auth=SERVICE)
    assert call(server, "GET", "/stats").status == 200
    assert call(server, "POST", "/_control", {"latency_ms": 1}).status == 200
    assert call(server, "GET", "/health").status == 401
    assert call(server, "GET", "/nope").status == 401


def test_bearer_token_is_required_when_set(make_server: MakeServer) -> None:
    """With a bearer token, requests without it or with another get 401 + WWW-Authenticate."""
    server = make_server(bearer_token="tok-123")
    missing = call(server, "GET", "/health")
    assert missing.status == 401 and missing.headers["WWW-Authenticate"] == "Bearer"
    assert missing.json == {"detail": "missing bearer token"}
    wrong = call(server, "GET", "/health", headers={"Authorization": "Bearer tok-124"})
    assert (wrong.status, wrong.json) == (401, {"detail": "invalid bearer token"})
    headers = dict(BearerAuth("tok-123").headers("GET", "/health"))
    assert call(server, "GET", "/health", headers=headers).status == 200
    with pytest.raises(ValueError, match="bearer_token") as info:
        WorkerServer(bearer_token="a\nb")
    assert "a\nb" not in str(info.value)


# --- the subpackage's public face -------------------------------------------------------------


def test_the_subpackage_exports_the_worker_and_keeps_its_modules_private() -> None:
    """npu_sync.worker_server exports what it always did, each name defined, and every
    module behind it is private."""
    import npu_sync.worker_server as package

    assert set(package.__all__) == {
        "ANY_MODEL", "CPU_DEVICE", "DEVICE", "MAX_BODY_BYTES", "PROTOCOLS", "LocalWorker",
        "WorkerBehaviour", "WorkerServer", "build_arg_parser", "main", "serve",
    }  # fmt: skip
    assert all(getattr(package, name) is not None for name in package.__all__)
    assert (package.DEVICE, package.CPU_DEVICE) == (DEVICE, CPU_DEVICE)
    modules = {p.name for p in Path(package.__file__).parent.glob("*.py")}
    assert {"__init__.py", "__main__.py"} < modules
    assert all(name.startswith("_") for name in modules)
