"""A worker behind a path prefix: every request path is joined to its base path."""

from __future__ import annotations

import json

import pytest

from npu_sync import WorkerPool
from npu_sync.config import HealthConfig, PoolConfig, TransportConfig, worker_config
from tests.hostile import CLIENTS, Seen, answer, keep_answering, serve

TIMEOUTS = {"timeout": 5.0, "connect_timeout": 2.0}


def under_prefix(seen: Seen) -> bytes:
    """Answer only below /api/v1, like a worker behind a reverse proxy; 404 elsewhere."""
    if seen.path == "/api/v1/health":
        return answer(200, b'{"status": "healthy"}')
    if seen.path.startswith("/api/v1/"):
        return answer(200, json.dumps({"path": seen.path}).encode())
    return answer(404, b'{"detail": "Not Found"}')


@pytest.mark.parametrize("client", CLIENTS)
def test_tasks_and_health_checks_reach_the_prefixed_paths(client, servers):
    """Task endpoints and the health endpoint are both joined to the worker's base path."""
    server = serve(servers, keep_answering(under_prefix))
    config = PoolConfig(
        workers=(worker_config("proxied", server.url() + "/api/v1/"),),
        transport=TransportConfig(client=client),
        health=HealthConfig(enabled=False),
    )
    with WorkerPool(config) as pool:
        assert pool.workers()[0]["url"] == server.url() + "/api/v1"
        assert pool.execute({"input_text": "x"}) == {"path": "/api/v1/inference"}
        assert pool.check_health()["proxied"]["ok"] is True
    assert [seen.path for seen in server.seen] == [
        "/api/v1/inference",
        "/api/v1/health",
        "/api/v1/models",
    ]


@pytest.mark.parametrize("client", CLIENTS)
def test_a_worker_at_the_root_gets_the_bare_paths(client, servers):
    """Without a base path the request paths are sent unchanged."""
    server = serve(servers, keep_answering(lambda seen: answer(200, b"{}")))
    config = PoolConfig(
        workers=(worker_config("root", server.url()),),
        transport=TransportConfig(client=client),
        health=HealthConfig(enabled=False),
    )
    with WorkerPool(config) as pool:
        pool.execute({"input_text": "x"})
        pool.check_health()
    assert [seen.path for seen in server.seen] == ["/inference", "/health"]
