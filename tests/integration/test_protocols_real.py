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

from npu_sync._retry import Kind, Outcome
from npu_sync.auth import BearerAuth, HmacAuth, RequestAuth, StaticHeaders
from npu_sync.config import TransportConfig, worker_config
from npu_sync.protocols import LINUX, WINDOWS, HealthInfo, WorkerProtocol
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
    """A Windows worker's HTTP 200 failures are suspect FAILUREs; an unknown type REJECTED."""
    c = client("windows", failure_rate=1.0)
    outcome = c.run({"model_id": "default", "input_text": "x"})
    assert outcome.kind is Kind.FAILURE and outcome.suspect
    assert outcome.status == 200 and outcome.error == "HTTP 200, status failed: simulated failure"
    unknown = c.run({"model_id": "default", "input_text": "x", "task_type": "poetry"})
    assert unknown.kind is Kind.REJECTED and not unknown.suspect
    assert unknown.error == "HTTP 200, status failed: Unsupported task type: poetry"
    search = c.run({"model_id": "default", "input_text": "x", "task_type": "semantic_search"})
    assert search.kind is Kind.FAILURE and search.suspect
    assert search.error == (
        "HTTP 200, status failed: 'WindowsNPUWorker' object has no attribute 'process_search_task'"
    )
    assert c.worker.stats()["failed_tasks"] == 3


def test_bad_tasks_mixed_with_good_ones_open_no_windows_breaker(start_worker) -> None:
    """50 bad tasks among 500 over two Windows workers: no breaker opens, no good task fails."""
    import concurrent.futures
    import random

    from npu_sync import Task, TaskFailed, TaskRejected, WorkerPool
    from npu_sync.config import BreakerConfig, HealthConfig, PoolConfig, RetryConfig

    workers = [start_worker(worker_id=f"win{i}", protocol="windows") for i in range(2)]
    config = PoolConfig(
        workers=tuple(
            worker_config(w.worker_id, w.url, protocol="autobot-windows") for w in workers
        ),
        health=HealthConfig(enabled=False),
        circuit_breaker=BreakerConfig(fail_max=5, reset_timeout=60),
        retry=RetryConfig(max_retries=3, backoff_initial=0.01, backoff_max=0.05),
    )
    good = [
        Task({"model_id": "default", "input_text": f"good {n}"}, task_id=f"good-{n}")
        for n in range(500)
    ]
    bad = [
        Task(
            {"model_id": "default", "input_text": f"{n}", "task_type": kind},
            task_id=f"bad-{kind}-{n}",
        )
        for n in range(25)
        for kind in ("poetry", "semantic_search")
    ]
    tasks = good + bad
    random.Random(22).shuffle(tasks)
    # The bad ones in a burst too: the breaker counts consecutive failures.
    tasks = bad[:12] + tasks
    outcomes: dict[str, list[str]] = {"good": [], "bad": []}
    trips: list[str] = []
    attempts: dict[str, int] = {}

    def hook(event: Any) -> None:
        name = getattr(event, "name", "")
        if name == "breaker.state_changed" and event.new == "open":
            trips.append(event.worker_id)
        elif name == "attempt.finished":
            attempts[event.task_id] = attempts.get(event.task_id, 0) + 1

    with WorkerPool(config) as pool:
        pool.add_hook(hook)

        def run(task: Task) -> tuple[str, str]:
            kind = task.task_id.split("-")[0]
            try:
                pool.execute(task, timeout=10)
            except TaskRejected:
                return kind, "rejected"
            except TaskFailed as exc:
                return kind, "failed: " + str(exc)
            return kind, "ok"

        with concurrent.futures.ThreadPoolExecutor(8) as callers:
            for kind, result in callers.map(run, tasks):
                outcomes[kind].append(result)
        rows = pool.workers()
    assert outcomes["good"] == ["ok"] * 500
    # No good task bounced or waited for a worker: each ran on its first attempt.
    assert all(attempts[t.task_id] == 1 for t in good)
    assert all(r == "rejected" or "taken as the task's fault" in r for r in outcomes["bad"])
    assert trips == [] and [r["breaker"]["state"] for r in rows] == ["closed", "closed"]
    assert all(r["breaker"]["failures"] == 0 for r in rows)


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
