"""Helpers for the reference worker's tests: plain HTTP calls to a WorkerServer or a
LocalWorker, and the Windows task and HMAC service they use."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Callable
from typing import Any

from npu_sync.auth import HmacAuth
from npu_sync.worker_server import LocalWorker, WorkerServer


class Reply:
    def __init__(self, response: http.client.HTTPResponse) -> None:
        self.status = response.status
        self.headers = response.headers
        raw = response.read()
        self.json: Any = json.loads(raw) if raw else None


def call(
    server: WorkerServer | LocalWorker,
    method: str,
    path: str,
    body: object = None,
    *,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
    connection: http.client.HTTPConnection | None = None,
) -> Reply:
    conn = connection or http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers=headers or {})
        return Reply(conn.getresponse())
    finally:
        if connection is None:
            conn.close()


def infer(server: WorkerServer | LocalWorker, text: str = "hello npu", **kwargs: Any) -> Reply:
    return call(server, "POST", "/inference", {"model_id": "default", "input_text": text}, **kwargs)


def in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run fn in a thread; the dict gets its result or exception."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = fn()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="test-client")
    thread.start()
    return thread, outcome


def win_task(model: str = "default", text: str = "hello", **extra: Any) -> dict[str, Any]:
    return {
        "task_type": "embedding_generation",
        "model_name": model,
        "input_data": {"text": text},
        **extra,
    }


SERVICE = ("npu-pool", "hmac-Secret-42")


def signed_call(
    server: WorkerServer | LocalWorker,
    method: str,
    path: str,
    body: object = None,
    *,
    auth: HmacAuth | None = None,
) -> Reply:
    auth = auth or HmacAuth(*SERVICE)
    return call(server, method, path, body, headers=dict(auth.headers(method, path)))
