"""What the fleet tests share: a wall clock that starts on a step, manual sampling, and
one in-memory Redis behind every client built from a URL."""

from __future__ import annotations

from typing import Any

import pytest

from npu_sync.testing import FakeClock

STEP = 5.0
WALL = 1_700_000_000.0  # a multiple of STEP: the FakeClock's wall time starts on a step


@pytest.fixture(autouse=True)
def manual(monkeypatch: pytest.MonkeyPatch) -> None:
    """Samples are taken by the test (tick()), not by a thread on the real clock."""
    monkeypatch.setenv("NPU_SYNC_FLEET", "manual")
    for name in ("NPU_SYNC_FLEET_INTERVAL", "NPU_SYNC_FLEET_TTL", "NPU_SYNC_FLEET_POINTS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(wall=WALL)


@pytest.fixture
def redis_server(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Every redis client built from a URL talks to one in-memory fakeredis server."""
    fakeredis = pytest.importorskip("fakeredis")
    import redis

    server = fakeredis.FakeServer()
    monkeypatch.setattr(redis.Redis, "from_url", lambda *a, **k: fakeredis.FakeRedis(server=server))
    return server


def client(server: Any) -> Any:
    import fakeredis

    return fakeredis.FakeRedis(server=server)
