"""The protocol and auth objects against real reference workers, over real transports.

Each test drives the calls the pool makes (health, model list, placement, tasks,
classification), with the protocol and auth of the worker, against LocalWorker child
processes speaking AutoBot's Linux or Windows protocol.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from npu_sync.auth import BearerAuth, HmacAuth, RequestAuth, StaticHeaders
from npu_sync.config import TransportConfig, worker_config
from npu_sync.protocols import LINUX, WINDOWS, HealthInfo, WorkerProtocol
from npu_sync.retry import Kind, Outcome
from npu_sync.transport import Response, Transport, make_transport
from npu_sync.worker_server import CPU_DEVICE, LocalWorker

pytestmark = pytest.mark.integration

SERVICE = ("npu-pool", "integration-secret-77")
PROTOCOLS = {"linux": LINUX, "windows": WINDOWS}


class Client:
    """One worker as the pool sees it: transport, protocol and auth."""

    def __init__(self, worker: LocalWorker, protocol: WorkerProtocol, auth: RequestAuth) -> None:
        self.worker = worker
        self.protocol = protocol
        self.auth = auth
        self.transport: Transport = make_transport(
            worker_config(worker.worker_id, worker.url), TransportConfig()
        )

    def send(self, method: str, path: str, body: Any = None) -> Response:
        data = None if body is None else json.dumps(body).encode()
        return self.transport.request(
            method, path, body=data, headers=self.auth.headers(method, path), timeout=10.0
        )

    def run(self, payload: dict[str, Any]) -> Outcome:
        response = self.send("POST", "/inference", self.protocol.request_body(payload))
        return self.protocol.classify(response)

    def health(self) -> HealthInfo:
        response = self.send("GET", "/health")
        info = self.protocol.parse_health(response.json())
        assert response.status == 200 or not info.healthy
        return info

    def models(self) -> frozenset[str] | None:
        path = self.protocol.models_path
        if path is None:
            return self.health().models
        info = self.protocol.parse_models(self.send("GET", path).json())
        return None if info is None else info.models

    def place(self, model: str) -> int:
        method, path, body = self.protocol.load_request(model)
        return self.send(method, path, body).status


@pytest.fixture
def client() -> Iterator[Callable[..., Client]]:
    made: list[Client] = []

    def make(kind: str, *, auth: RequestAuth | None = None, **options: Any) -> Client:
        worker = LocalWorker(worker_id=f"{kind}-{len(made)}", protocol=kind, **options).start()
        made.append(Client(worker, PROTOCOLS[kind], auth or StaticHeaders()))
        return made[-1]

    yield make
    for c in made:
        c.transport.close()
        c.worker.stop()


@pytest.mark.parametrize("kind", ["linux", "windows"])
def test_models_are_learned_placed_and_unloaded_mid_run(
    client: Callable[..., Client], kind: str
) -> None:
    """The model list reads right; a placed model serves; a model unloaded mid-run
    answers "not loaded" naming it, and the list then no longer holds it."""
    c = client(kind, models=("a",), load_delay_ms=50, hmac_auth=SERVICE, auth=HmacAuth(*SERVICE))
    health = c.health()
    assert health.healthy and health.npu_available is True
    assert c.models() == frozenset({"a"})
    assert c.run({"model_id": "a", "input_text": "x"}).kind is Kind.SUCCESS
    missing = c.run({"model_id": "b", "input_text": "x"})
    assert c.protocol.not_loaded_model(missing) == "b"
    assert c.place("b") == 200
    assert c.models() == frozenset({"a", "b"})
    assert c.run({"model_id": "b", "input_text": "x"}).kind is Kind.SUCCESS
    c.worker.control(models=["b"])
    gone = c.run({"model_id": "a", "input_text": "x"})
    assert gone.kind is Kind.NOT_HERE and gone.model == "a" and not gone.processed
    assert c.models() == frozenset({"b"})


def test_windows_failures_classify_as_suspect_failures(client: Callable[..., Client]) -> None:
    """A Windows worker's HTTP 200 failures are FAILURE outcomes, suspect, with its error."""
    c = client("windows", failure_rate=1.0)
    outcome = c.run({"model_id": "default", "input_text": "x"})
    assert outcome.kind is Kind.FAILURE and outcome.suspect
    assert outcome.status == 200 and outcome.error == "HTTP 200, status failed: simulated failure"
    unknown = c.run({"model_id": "default", "input_text": "x", "task_type": "poetry"})
    assert unknown.kind is Kind.FAILURE
    assert unknown.error == "HTTP 200, status failed: Unsupported task type: poetry"
    assert c.worker.stats()["failed_tasks"] == 2


def test_cpu_fallback_shows_in_health_and_models(client: Callable[..., Client]) -> None:
    """A worker started with --no-npu reports npu_available false and the CPU device."""
    c = client("linux", npu_available=False)
    health = c.health()
    assert health.npu_available is False and health.device == CPU_DEVICE
    info = c.protocol.parse_models(c.send("GET", "/models").json())
    assert info is not None and info.npu_available is False
    assert dict(info.devices) == {"default": CPU_DEVICE}


def test_wrong_credentials_are_refused_over_the_wire(client: Callable[..., Client]) -> None:
    """Requests signed with another secret, or with no bearer token, answer 401 and run
    no task (a configuration error, neither the task's nor the worker's sickness); the
    right credentials succeed."""
    signed = client("linux", hmac_auth=SERVICE, auth=HmacAuth(SERVICE[0], "not-the-secret"))
    refused = signed.run({"model_id": "default", "input_text": "x"})
    assert refused.kind is Kind.MISCONFIGURED and refused.status == 401
    assert not refused.processed
    assert refused.error == "credentials refused: HTTP 401: bad signature"
    signed.auth = HmacAuth(*SERVICE)
    assert signed.run({"model_id": "default", "input_text": "x"}).kind is Kind.SUCCESS
    bearer = client("windows", bearer_token="tok-abc")
    assert bearer.run({"model_id": "default", "input_text": "x"}).status == 401
    bearer.auth = BearerAuth("tok-abc")
    assert bearer.run({"model_id": "default", "input_text": "x"}).kind is Kind.SUCCESS
    assert signed.worker.stats()["inference_count"] == 1


def test_a_signed_unload_of_a_model_id_with_a_space_is_accepted(
    client: Callable[..., Client],
) -> None:
    """``DELETE /models/a%20b`` signed with the right secret is not refused: the
    signature covers the decoded path the worker (like AutoBot) verifies."""
    c = client("linux", models=("a b", "c"), hmac_auth=SERVICE, auth=HmacAuth(*SERVICE))
    response = c.send("DELETE", "/models/a%20b")
    assert response.status != 401, response.body
    assert c.models() == frozenset({"c"})
