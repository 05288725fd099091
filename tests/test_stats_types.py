"""The TypedDicts of stats()/workers()/stats(scope="fleet"), the dicts a running pool
returns and docs/metrics.md name the same keys, recursively."""

from __future__ import annotations

import dataclasses
import json
import re
import time
import types
import typing
from pathlib import Path
from typing import Any

import pytest

from npu_sync import PoolStatsDict, WorkerPool, WorkerRow
from npu_sync._stats_types import (
    FleetStatsDict,
    PoolTaskStats,
    PoolWorkerCounts,
    SharedStateStats,
)
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    RetryConfig,
    SharedStateConfig,
    worker_config,
)
from npu_sync.testing import FakeClock, FakeNetwork, json_response

DOCS = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"


def typed_leaves(td: type, prefix: str = "") -> set[str]:
    """Dotted paths of the keys of a TypedDict whose values are not TypedDicts."""
    leaves: set[str] = set()
    for key, tp in typing.get_type_hints(td).items():
        nested = [a for a in _branches(tp) if typing.is_typeddict(a)]
        path = f"{prefix}{key}"
        leaves |= typed_leaves(nested[0], path + ".") if nested else {path}
    return leaves


def _branches(tp: Any) -> tuple[Any, ...]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def conform(value: Any, tp: Any, path: str = "") -> set[str]:
    """Assert ``value`` has type ``tp``; return the leaf paths it holds."""
    errors = []
    for branch in _branches(tp):
        try:
            return _conform_one(value, branch, path)
        except AssertionError as exc:
            errors.append(str(exc))
    raise AssertionError(f"{path or '<root>'}: {value!r} is not {tp}: {errors}")


def _conform_one(value: Any, tp: Any, path: str) -> set[str]:
    if tp is type(None):
        assert value is None, path
        return {path.rstrip(".")} if path else set()
    if typing.is_typeddict(tp):
        assert isinstance(value, dict), path
        hints = typing.get_type_hints(tp)
        missing = tp.__required_keys__ - value.keys()
        extra = value.keys() - hints.keys()
        assert not missing and not extra, f"{path}: missing {missing}, not typed {extra}"
        leaves: set[str] = set()
        for key, item in value.items():
            leaves |= conform(item, hints[key], f"{path}{key}.")
        return leaves
    origin = typing.get_origin(tp)
    if origin is list:
        (item_type,) = typing.get_args(tp)
        assert isinstance(value, list), path
        found = {path.rstrip(".")}
        for item in value:
            found |= conform(item, item_type, path)
        return found
    elif tp is float:  # a type checker lets an int stand for a float
        assert isinstance(value, (int, float)) and not isinstance(value, bool), path
    elif tp is int:
        assert isinstance(value, int) and not isinstance(value, bool), path
    else:
        assert isinstance(value, tp), path
    return {path.rstrip(".")}


def documented(section: str) -> set[str]:
    """The leaf keys a docs/metrics.md table names (``a.b`` / ``c`` / ``.d`` shorthands)."""
    text = DOCS.read_text(encoding="utf-8")
    body = text.split(f"## `{section}`", 1)[1].split("\n## ", 1)[0]
    paths: set[str] = set()
    for line in body.splitlines():
        if not line.startswith("| `"):
            continue
        names = re.findall(r"`([^`]+)`", line.split("|")[1])
        prefix = names[0].rpartition(".")[0]
        for name in names:
            if name.startswith("."):
                name = prefix + name
            elif "." not in name and prefix:
                name = f"{prefix}.{name}"
            paths.add(name)
    # A row for a dict itself (``health``) stands beside the rows for its keys.
    return {p for p in paths if not any(q.startswith(p + ".") for q in paths)}


def _network() -> FakeNetwork:
    net = FakeNetwork()
    net.route(
        "good",
        lambda req: json_response(
            200,
            {"status": "ok", "draining": False, "max_concurrent": 4, "active_tasks": 0}
            if req.path == "/health"
            else {"ok": True},
        ),
    )
    net.route("bad", lambda req: json_response(500, {"detail": "boom"}))
    return net


def _config(**kw: Any) -> PoolConfig:
    return PoolConfig(
        workers=(
            worker_config("bad", "http://127.0.0.1:9101", priority=1),
            worker_config("good", "http://127.0.0.1:9102", priority=2),
        ),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=3, backoff_initial=0.01, backoff_max=0.1),
        circuit_breaker=BreakerConfig(fail_max=5, reset_timeout=30, max_reset_timeout=60),
        **kw,
    )


def _exercise(pool: WorkerPool) -> tuple[PoolStatsDict, list[WorkerRow]]:
    """Tasks that fail on one worker and succeed on the other, a health round, a reload:
    every optional part of the output is filled."""
    for n in range(3):
        assert pool.execute({"n": n}) == {"ok": True}
    pool.check_health()
    pool.reload(pool.config)
    rows = pool.workers()
    # A replacement awaiting its first health check: reloads.handover is filled.
    cfg = pool.config
    spare = worker_config("spare", "http://127.0.0.1:9103")
    pool.reload(dataclasses.replace(cfg, workers=(*cfg.workers, spare)))
    pool.reload(
        dataclasses.replace(
            cfg,
            health=HealthConfig(interval=3600),
            workers=(*cfg.workers, worker_config("spare2", "http://127.0.0.1:9104")),
        )
    )
    return pool.stats(), rows


@pytest.fixture
def outputs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[PoolStatsDict, list[WorkerRow]]]:
    """stats() and workers() of a pool without shared state and, if fakeredis is
    installed, of one sharing its state through Redis."""
    runs = []
    with WorkerPool(_config(), transport_factory=_network().factory, clock=FakeClock()) as pool:
        runs.append(_exercise(pool))
    try:
        import fakeredis
    except ImportError:
        return runs
    import redis

    server = fakeredis.FakeServer()
    monkeypatch.setattr(redis.Redis, "from_url", lambda *a, **k: fakeredis.FakeRedis(server=server))
    shared = SharedStateConfig(backend="redis", namespace="types")
    with WorkerPool(
        _config(shared_state=shared), transport_factory=_network().factory, clock=FakeClock()
    ) as pool:
        runs.append(_exercise(pool))
    return runs


def test_the_typed_keys_are_the_documented_keys():
    """Every key of PoolStatsDict/WorkerRow has a row in docs/metrics.md, and no more."""
    assert typed_leaves(PoolStatsDict) == documented("pool.stats()")
    assert typed_leaves(WorkerRow) == documented("pool.workers()")


def test_a_running_pool_returns_exactly_the_typed_shapes(outputs):
    """stats()/workers() of real pools conform to the TypedDicts, with no key untyped,
    and between them show every typed key (a failing worker and a healthy one)."""
    stats_seen: set[str] = set()
    rows_seen: set[str] = set()
    for stats, rows in outputs:
        stats_seen |= conform(stats, PoolStatsDict)
        assert {row["id"] for row in rows} == {"bad", "good"}
        for row in rows:
            rows_seen |= conform(row, WorkerRow)
        bad = next(row for row in rows if row["id"] == "bad")
        assert bad["tasks"]["failed"] >= 1 and bad["last_error"]
    assert stats_seen == typed_leaves(PoolStatsDict)
    assert rows_seen == typed_leaves(WorkerRow)


def test_shared_state_keys_appear_only_with_redis(outputs):
    """shared_state holds only ``backend`` without Redis; with it, every typed key."""
    if len(outputs) < 2:
        pytest.skip("fakeredis is not installed")
    (off, _), (on, _) = outputs
    assert off["shared_state"] == {"backend": "none"}
    assert set(on["shared_state"]) == set(typing.get_type_hints(SharedStateStats))
    assert on["shared_state"]["available"] is True  # fakeredis answered, not a real server


def test_the_checker_notices_a_key_the_types_do_not_have():
    """An extra or missing key, or a value of the wrong type, fails conform()."""
    row: dict[str, Any] = {"total": 1, "available": 1, "healthy": 1, "open_breakers": 0}
    conform(row, PoolWorkerCounts)
    with pytest.raises(AssertionError):
        conform({**row, "spare": 0}, PoolWorkerCounts)
    with pytest.raises(AssertionError):
        conform({**row, "total": "1"}, PoolWorkerCounts)
    del row["healthy"]
    with pytest.raises(AssertionError):
        conform(row, PoolWorkerCounts)


# -- stats(scope="fleet") ------------------------------------------------------------------

FLEET = 'pool.stats(scope="fleet")'
# Shapes documented elsewhere (stats()["tasks"], stats()) are one row in the fleet tables.
FLEET_STOPS = (PoolTaskStats, PoolStatsDict)


def fleet_leaves(td: type, prefix: str = "") -> set[str]:
    """Dotted paths of a TypedDict's leaves, ``[]`` marking the items of a list."""
    leaves: set[str] = set()
    for key, tp in typing.get_type_hints(td).items():
        path = f"{prefix}{key}"
        if typing.is_typeddict(tp) and tp not in FLEET_STOPS:
            leaves |= fleet_leaves(tp, path + ".")
        elif typing.get_origin(tp) is list and typing.is_typeddict(typing.get_args(tp)[0]):
            leaves |= fleet_leaves(typing.get_args(tp)[0], path + "[].")
        else:
            leaves.add(path)
    return leaves


def documented_fleet() -> set[str]:
    """The keys the fleet section's tables name, each ``### `prefix` `` table's rows
    under its prefix (``processes[i]`` becomes ``processes[].``)."""
    text = DOCS.read_text(encoding="utf-8")
    body = text.split(f"## `{FLEET}`", 1)[1].split("\n## ", 1)[0]
    paths: set[str] = set()
    for n, chunk in enumerate(body.split("\n### ")):
        prefix = ""
        if n:
            heading = re.match(r"`([^`]+)`", chunk)
            assert heading, chunk[:40]
            prefix = re.sub(r"\[[a-z]\]", "[]", heading.group(1)) + "."
        for line in chunk.splitlines():
            if not line.startswith("| `"):
                continue
            names = [
                re.sub(r"\[[a-z]\]", "[]", n) for n in re.findall(r"`([^`]+)`", line.split("|")[1])
            ]
            first = names[0].rpartition(".")[0]
            for name in names:
                if name.startswith("."):
                    name = first + name
                elif "." not in name and first:
                    name = f"{first}.{name}"
                paths.add(prefix + name)
    return {p for p in paths if not any(q.startswith((p + ".", p + "[].")) for q in paths)}


def test_the_fleet_keys_are_the_documented_keys():
    """Every key of FleetStatsDict, nested lists included, has a row in docs/metrics.md."""
    assert fleet_leaves(FleetStatsDict) == documented_fleet()


def test_a_fleet_view_returns_exactly_the_typed_shape(monkeypatch):
    """stats(scope="fleet") of pools sharing fakeredis conforms to FleetStatsDict, every
    typed key shown."""
    fakeredis = pytest.importorskip("fakeredis")
    import redis

    from npu_sync._fleet import monitor_of

    server = fakeredis.FakeServer()
    monkeypatch.setattr(redis.Redis, "from_url", lambda *a, **k: fakeredis.FakeRedis(server=server))
    monkeypatch.setenv("NPU_SYNC_FLEET", "manual")
    shared = SharedStateConfig(backend="redis", namespace="fleet-types")
    config = _config(shared_state=shared)
    with (
        WorkerPool(config, transport_factory=_network().factory, clock=FakeClock()) as one,
        WorkerPool(config, transport_factory=_network().factory, clock=FakeClock()) as two,
    ):
        _exercise(one)
        _exercise(two)
        monitor_of(one).tick()
        monitor_of(two).tick()
        # A process listed in the index whose snapshot has expired: a silent one.
        redis.Redis.from_url("").zadd("{fleet-types}:fleet:index", {"gone:123:ab": time.time()})
        fleet = one.stats(scope="fleet")
    json.dumps(fleet)  # JSON-serialisable
    assert [s["host"] for s in fleet["silent"]] == ["gone"]
    seen = conform(fleet, FleetStatsDict)
    for leaf in fleet_leaves(FleetStatsDict):
        flat = leaf.replace("[]", "")
        assert any(s == flat or s.startswith(flat + ".") for s in seen), leaf
    assert len(fleet["processes"]) == 2 and fleet["history"]["workers"]
