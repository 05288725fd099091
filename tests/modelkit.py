"""Fake Linux-protocol workers holding models over a FakeNetwork, and the pool
configuration around them: the helpers of the attacks on model routing and placement for
a task (tests/test_life_models.py), Windows answers (tests/test_protocols.py) and request
auth (tests/test_auth.py). A worker listed with None serves every model."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    RetryConfig,
    WorkerConfig,
    worker_config,
)
from npu_sync.testing import FakeNetwork, FakeRequest, json_response
from npu_sync.transport import Response


def linux(
    models: Iterable[str] | None,
    *,
    task: Callable[[FakeRequest], Response] | None = None,
    load: Callable[[FakeRequest], Response] | None = None,
) -> Callable[[FakeRequest], Response]:
    """A Linux-protocol worker holding ``models``, a live list; None: /models is 404 and
    every model is served."""

    def handle(req: FakeRequest) -> Response:
        if req.path == "/health":
            return json_response(200, {"status": "healthy", "npu_available": True})
        if req.path == "/models":
            if models is None:
                return json_response(404, {"detail": "Not Found"})
            return json_response(200, {"loaded_models": {m: {"device": "NPU"} for m in models}})
        if req.path == "/models/load":
            assert load is not None
            return load(req)
        if task is not None:
            return task(req)
        model = req.json().get("model_id")
        if model is not None and models is not None and model not in models:
            return json_response(500, {"detail": f"Model {model} not loaded"})
        return json_response(200, {"worker": req.worker_id, "model_id": model})

    return handle


def config(*workers: WorkerConfig, **kw: Any) -> PoolConfig:
    kw.setdefault("health", HealthConfig(enabled=False, unhealthy_threshold=1))
    kw.setdefault("retry", RetryConfig(max_retries=3, backoff_initial=0.0, backoff_max=0.0))
    kw.setdefault("circuit_breaker", BreakerConfig(fail_max=1, reset_timeout=60))
    return PoolConfig(workers=workers, **kw)


def w(wid: str, n: int, **kw: Any) -> WorkerConfig:
    return worker_config(wid, f"http://127.0.0.1:{9400 + n}", **kw)


def tasks_to(net: FakeNetwork, wid: str) -> list[FakeRequest]:
    return [r for r in net.requests(wid) if r.method == "POST" and r.path == "/inference"]
