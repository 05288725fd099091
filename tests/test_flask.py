"""The Flask extension: endpoints, auth, errors as JSON, secrets, the status page's HTML."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import sys
import threading
import types

import pytest
from flask import Flask

import npu_sync.flask as npu_flask
from npu_sync import Task, TaskFailed, WorkerPool, npu_task
from npu_sync.config import HealthConfig, PoolConfig, RetryConfig, worker_config
from npu_sync.flask import NpuSync, current_pool
from npu_sync.testing import FakeClock, FakeNetwork, json_response
from tests.test_install_hints import bare_installs

TOKEN = "admin-t0ken-for-tests"
SECRET = "s3cret"
PREFIX = "/api/npu/pool"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

YAML = """\
npu_workers:
  workers:
{workers}
  health: {{enabled: false}}
  retry: {{max_retries: 2, backoff_initial: 0.01, backoff_max: 0.05}}
"""


def yaml_worker(worker_id: str, port: int) -> str:
    return f"    - {{id: {worker_id}, host: 127.0.0.1, port: {port}}}"


def failing(req):
    return json_response(503, {"detail": "overloaded"})


@pytest.fixture
def net():
    return FakeNetwork()


@pytest.fixture
def pool(net):
    workers = (
        worker_config("a", "http://127.0.0.1:9101"),
        worker_config("b", "http://127.0.0.1:9102", headers={"Authorization": f"Bearer {SECRET}"}),
    )
    config = PoolConfig(
        workers=workers,
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=2, backoff_initial=0.01, backoff_max=0.05),
    )
    with WorkerPool(config, transport_factory=net.factory, clock=FakeClock()) as pool:
        yield pool


@pytest.fixture
def yaml_pool(net, tmp_path):
    path = tmp_path / "npu_workers.yaml"
    path.write_text(YAML.format(workers=yaml_worker("a", 9101)))
    with WorkerPool.from_yaml(
        path, watch=False, transport_factory=net.factory, clock=FakeClock()
    ) as pool:
        yield pool


@pytest.fixture
def at_exit(monkeypatch):
    """Functions registered with atexit during the test (still registered for real)."""
    registered = []
    real = npu_flask.atexit.register

    def spy(func, *args, **kwargs):
        registered.append(func)
        return real(func, *args, **kwargs)

    monkeypatch.setattr(npu_flask.atexit, "register", spy)
    return registered


def make_app(pool=None, **config):
    app = Flask(__name__)
    app.config.update(TESTING=True, NPU_SYNC_ADMIN_TOKEN=TOKEN)
    app.config.update(config)
    NpuSync(app, pool=pool)
    return app


@pytest.fixture
def client(pool):
    return make_app(pool).test_client()


def dead_letter(pool, net) -> str:
    """Make a task fail on every worker; returns its dead-letter id."""
    net.route("a", failing)
    net.route("b", failing)
    with pytest.raises(TaskFailed) as info:
        pool.execute(Task({"input_text": "doomed"}))
    return info.value.dead_letter_id


# -- read endpoints ------------------------------------------------------------------------


def test_stats_returns_the_pools_counters_as_json(client, pool):
    """GET /stats is pool.stats(): it counts a task run through the pool."""
    pool.execute({"input_text": "hi"})
    response = client.get(f"{PREFIX}/stats")
    assert response.status_code == 200 and response.is_json
    body = response.get_json()
    assert body["tasks"]["submitted"] == 1 and body["tasks"]["succeeded"] == 1
    assert body["workers"] == {"total": 2, "available": 2, "healthy": 2, "open_breakers": 0}
    assert set(body) >= {"uptime_s", "dead_letters", "reloads", "health", "selection_us"}
    assert response.headers["Cache-Control"] == "no-store"


def test_workers_returns_one_row_per_worker_with_documented_fields(client, pool):
    """GET /workers wraps pool.workers(): ids in priority order, breaker and latency fields."""
    pool.execute({"input_text": "hi"})
    response = client.get(f"{PREFIX}/workers")
    assert response.status_code == 200
    rows = response.get_json()["workers"]
    assert [row["id"] for row in rows] == ["a", "b"]
    for row in rows:
        assert row["breaker"]["state"] == "closed"
        assert set(row["latency"]) == {"ewma_ms", "p50_ms", "p95_ms", "p99_ms"}
        assert set(row["tasks"]) == {
            "attempts",
            "succeeded",
            "failed",
            "rejected",
            "not_here",
            "abandoned",
        }
        assert {"in_flight", "capacity", "healthy", "enabled", "draining", "last_error"} <= set(row)
        assert "headers" not in row
    assert sum(row["tasks"]["succeeded"] for row in rows) == 1


def test_stats_and_workers_say_which_process_answered(client, pool):
    """Without shared state both answers name the one process (pid, host) they describe."""
    import os
    import socket

    for path in ("stats", "workers"):
        body = client.get(f"{PREFIX}/{path}").get_json()
        assert body["process"]["pid"] == os.getpid()
        assert body["process"]["host"] == socket.gethostname()
        assert body["note"].startswith(f"One process only: pid {os.getpid()} on ")


def test_fleet_answers_stats_of_scope_fleet(client, pool):
    """GET /fleet is pool.stats(scope="fleet"): totals, processes, history and local."""
    pool.execute({"input_text": "hi"})
    response = client.get(f"{PREFIX}/fleet")
    assert response.status_code == 200 and response.headers["Cache-Control"] == "no-store"
    body = response.get_json()
    assert body["scope"] == "fleet" and body["shared"] is False
    assert body["totals"]["tasks"]["succeeded"] == body["local"]["tasks"]["succeeded"] == 1
    assert [p["this_process"] for p in body["processes"]] == [True]
    assert set(body["history"]) == {"step_s", "points", "end_at", "tasks", "workers"}
    assert "One process only" in body["note"]


def unexport_everything() -> None:
    """Close every exporter on the default registry (earlier tests' apps attached some)."""
    import prometheus_client

    import npu_sync.prometheus as exporter_module

    for exporter in exporter_module._members(prometheus_client.REGISTRY):
        exporter.close()


def test_npu_sync_prometheus_instruments_the_pool_at_start_up(pool, net):
    """With the setting on, attempts before the first scrape are in the histogram too;
    without it the first scrape instruments, and the histogram starts there."""
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    def histogram_count(client) -> float:
        text = client.get(f"{PREFIX}/metrics").get_data(as_text=True)
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "npu_sync_attempt_duration_seconds_count"
        )

    late = make_app(pool).test_client()
    pool.execute({"input_text": "before any scrape"})
    assert histogram_count(late) == 0
    unexport_everything()

    eager = make_app(pool, NPU_SYNC_PROMETHEUS=True).test_client()
    pool.execute({"input_text": "before any scrape"})
    assert histogram_count(eager) == 1


@pytest.mark.parametrize(("value", "on"), [("1", True), ("off", False), ("", False)])
def test_npu_sync_prometheus_comes_from_the_environment_too(pool, monkeypatch, value, on):
    """The environment variable NPU_SYNC_PROMETHEUS is read when app.config lacks the key."""
    pytest.importorskip("prometheus_client")
    import prometheus_client

    import npu_sync.prometheus as exporter_module

    monkeypatch.setenv("NPU_SYNC_PROMETHEUS", value)
    unexport_everything()
    make_app(pool)
    exported = [e.pool for e in exporter_module._members(prometheus_client.REGISTRY)]
    assert (pool in exported) is on


def test_an_unusable_npu_sync_prometheus_fails_at_init_app(pool):
    """A value that is not a yes or a no raises ValueError naming the key."""
    with pytest.raises(ValueError, match="NPU_SYNC_PROMETHEUS must be true or false"):
        make_app(pool, NPU_SYNC_PROMETHEUS="sometimes")


def test_npu_sync_prometheus_without_the_client_fails_at_init_app(pool, monkeypatch):
    """Asked for metrics without prometheus_client installed: an ImportError naming the extra,
    to install from a clone."""
    monkeypatch.setitem(sys.modules, "npu_sync.prometheus", None)
    with pytest.raises(ImportError, match=re.escape("pip install -e '.[prometheus]'")) as caught:
        make_app(pool, NPU_SYNC_PROMETHEUS=True)
    assert bare_installs(str(caught.value)) == []


def test_views_reach_the_pool_through_current_pool(pool, net):
    """current_pool() in a view is the extension's pool; @npu_task(current_pool()) runs on it."""
    app = make_app(pool)
    net.route("a", lambda req: json_response(200, {"echo": req.json()["input_text"]}))
    net.route("b", lambda req: json_response(200, {"echo": req.json()["input_text"]}))

    @app.post("/analyze")
    def analyze():
        return current_pool().execute({"input_text": "direct"})

    @app.post("/shout")
    def shout():
        @npu_task(current_pool())
        def build(text: str) -> dict:
            return {"input_text": text.upper()}

        return build("quiet")

    client = app.test_client()
    assert client.post("/analyze").get_json() == {"echo": "direct"}
    assert client.post("/shout").get_json() == {"echo": "QUIET"}
    with app.app_context():
        assert current_pool() is pool


def test_current_pool_outside_a_registered_app_is_a_clear_error():
    """current_pool() on an app without the extension names what to do."""
    app = Flask(__name__)
    with app.app_context(), pytest.raises(RuntimeError, match="init_app"):
        current_pool()


# -- reload --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("configured", "headers", "status"),
    [
        (None, AUTH, 403),
        ("", AUTH, 403),
        (TOKEN, {}, 401),
        (TOKEN, {"Authorization": "Bearer wrong"}, 401),
        (TOKEN, {"Authorization": f"Basic {TOKEN}"}, 401),
        (TOKEN, {"Authorization": "Bearer "}, 401),
        (TOKEN, AUTH, 200),
        (TOKEN, {"Authorization": f"bearer {TOKEN}"}, 200),
    ],
)
def test_reload_requires_the_admin_token(yaml_pool, configured, headers, status):
    """No token configured: 403; missing or wrong: 401 with WWW-Authenticate; right: 200."""
    client = make_app(yaml_pool, NPU_SYNC_ADMIN_TOKEN=configured).test_client()
    response = client.post(f"{PREFIX}/reload", headers=headers)
    assert response.status_code == status
    assert response.is_json
    if status == 401:
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
    else:
        assert "WWW-Authenticate" not in response.headers


def test_replay_requires_the_admin_token(client):
    """The other mutating endpoint refuses a request without the token."""
    response = client.post(f"{PREFIX}/dead-letters/replay")
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"].startswith("Bearer")


def test_reload_applies_the_file_and_says_what_changed(yaml_pool, tmp_path):
    """POST /reload re-reads the YAML: a worker added there is reported and in the pool."""
    (tmp_path / "npu_workers.yaml").write_text(
        YAML.format(workers=yaml_worker("a", 9101) + "\n" + yaml_worker("c", 9103))
    )
    client = make_app(yaml_pool).test_client()
    response = client.post(f"{PREFIX}/reload", headers=AUTH)
    assert response.status_code == 200
    body = response.get_json()
    assert body["changed"] is True
    assert body["added"] == ["c"] and body["unchanged"] == ["a"] and body["removed"] == []
    assert [w["id"] for w in yaml_pool.workers()] == ["a", "c"]


def test_reload_of_a_broken_file_is_a_400_naming_the_key_path(yaml_pool, tmp_path):
    """A bad YAML gives 400 with every error's key path; the running config is kept."""
    (tmp_path / "npu_workers.yaml").write_text(YAML.format(workers=yaml_worker("a", 0)))
    client = make_app(yaml_pool).test_client()
    response = client.post(f"{PREFIX}/reload", headers=AUTH)
    assert response.status_code == 400
    body = response.get_json()
    assert "invalid configuration" in body["error"]
    assert any(e.startswith("npu_workers.workers[0].port:") for e in body["errors"]), body
    assert [w["url"] for w in yaml_pool.workers()] == ["http://127.0.0.1:9101"]
    assert yaml_pool.stats()["reloads"]["failed"] == 1


def test_reload_of_a_pool_without_a_file_is_a_409(client):
    """A pool built in code has nothing to reload: 409 with a message, not a 500."""
    response = client.post(f"{PREFIX}/reload", headers=AUTH)
    assert response.status_code == 409
    assert "not built from a YAML file" in response.get_json()["error"]


# -- dead letters --------------------------------------------------------------------------


def test_dead_letters_lists_failed_tasks_with_paging(client, pool, net):
    """GET /dead-letters shows stored records, oldest first, with limit and offset."""
    first, second = dead_letter(pool, net), dead_letter(pool, net)
    body = client.get(f"{PREFIX}/dead-letters", headers=AUTH).get_json()
    assert body["total"] == 2 and body["limit"] == 100 and body["offset"] == 0
    assert [r["id"] for r in body["dead_letters"]] == [first, second]
    record = body["dead_letters"][0]
    assert body["payloads"] is True and record["payload"] == {"input_text": "doomed"}
    assert {a["worker_id"] for a in record["attempts"]} == {"a", "b"}
    page = client.get(f"{PREFIX}/dead-letters?limit=1&offset=1").get_json()
    assert [r["id"] for r in page["dead_letters"]] == [second]
    assert page["total"] == 2 and page["limit"] == 1 and page["offset"] == 1


def test_dead_letter_payloads_need_the_admin_token(client, pool, net):
    """Without Authorization the records come without payloads; a wrong token is a 401,
    and with no token configured any Authorization is a 403."""
    dead_letter(pool, net)
    body = client.get(f"{PREFIX}/dead-letters").get_json()
    assert body["payloads"] is False and body["total"] == 1
    (record,) = body["dead_letters"]
    assert "payload" not in record and record["attempts"]
    assert "doomed" not in client.get(f"{PREFIX}/dead-letters").get_data(as_text=True)
    wrong = client.get(f"{PREFIX}/dead-letters", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "doomed" not in wrong.get_data(as_text=True)
    closed = make_app(pool, NPU_SYNC_ADMIN_TOKEN=None).test_client()
    assert closed.get(f"{PREFIX}/dead-letters", headers=AUTH).status_code == 403
    assert closed.get(f"{PREFIX}/dead-letters").get_json()["payloads"] is False


@pytest.mark.parametrize(
    ("query", "name"),
    [
        ("limit=-1", "limit"),
        ("limit=abc", "limit"),
        ("limit=1.5", "limit"),
        ("limit=", "limit"),
        ("limit=1001", "limit"),
        ("limit=1&limit=2", "limit"),
        ("offset=-3", "offset"),
        ("offset=%EF%BC%91", "offset"),  # a full-width digit
        ("offset=99999999999999999999", "offset"),
    ],
)
def test_bad_paging_parameters_are_a_400_naming_the_parameter(client, query, name):
    """limit/offset must be small whole numbers; anything else is refused by name."""
    response = client.get(f"{PREFIX}/dead-letters?{query}")
    assert response.status_code == 400
    assert response.get_json()["error"].startswith(f"{name}:")


def test_replay_of_one_record_runs_it_and_removes_it(client, pool, net):
    """POST /dead-letters/replay {"id"} re-runs that task; on success the record is gone."""
    record_id = dead_letter(pool, net)
    net.route("a", lambda req: json_response(200, {"ok": "again"}))
    net.route("b", lambda req: json_response(200, {"ok": "again"}))
    response = client.post(f"{PREFIX}/dead-letters/replay", json={"id": record_id}, headers=AUTH)
    assert response.status_code == 200
    assert response.get_json() == {
        "succeeded": [record_id],
        "failed": [],
        "rejected": [],
        "results": {record_id: {"ok": "again"}},
    }
    assert len(pool.dead_letters) == 0


def test_replay_without_a_body_replays_every_record(client, pool, net):
    """An empty body replays all; records that fail again stay stored and are listed."""
    first, second = dead_letter(pool, net), dead_letter(pool, net)
    response = client.post(f"{PREFIX}/dead-letters/replay", headers=AUTH)
    assert response.status_code == 200
    assert response.get_json()["failed"] == [first, second]
    assert len(pool.dead_letters) == 2


def test_replay_of_an_unknown_id_is_a_404(client, pool, net):
    """Replaying an id that is not stored answers 404 and runs nothing."""
    dead_letter(pool, net)
    before = len(net.requests())
    response = client.post(f"{PREFIX}/dead-letters/replay", json={"id": "nope"}, headers=AUTH)
    assert response.status_code == 404
    assert response.get_json()["id"] == "nope"
    assert len(net.requests()) == before


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"[1, 2]", b'{"id": 5}', b'{"id": ""}', b'{"id": "x", "path": "/etc"}'],
)
def test_replay_refuses_a_malformed_body(client, body):
    """The body is optional, but when given it must be {"id": "<non-empty string>"}."""
    response = client.post(
        f"{PREFIX}/dead-letters/replay",
        data=body,
        headers={**AUTH, "Content-Type": "application/json"},
    )
    assert response.status_code == 400 and response.is_json


def test_replay_refuses_an_oversized_body(client):
    """A body over 64 KiB is refused with 413 before it is parsed."""
    body = json.dumps({"id": "x" * 70_000})
    response = client.post(
        f"{PREFIX}/dead-letters/replay",
        data=body,
        headers={**AUTH, "Content-Type": "application/json"},
    )
    assert response.status_code == 413 and response.is_json


# -- metrics -------------------------------------------------------------------------------


def test_metrics_serves_prometheus_text_when_installed(client, pool):
    """GET /metrics answers the exposition format, parseable, with the pool's metrics."""
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    pool.execute({"input_text": "hi"})
    response = client.get(f"{PREFIX}/metrics")
    assert response.status_code == 200
    assert response.mimetype == "text/plain"
    names = {family.name for family in text_string_to_metric_families(response.text)}
    assert any(name.startswith("npu_sync") for name in names), sorted(names)


def test_metrics_is_a_501_when_prometheus_is_not_installed(client, monkeypatch):
    """Without the exporter module importable, /metrics says what to install, in a form that
    works from a clone or a built wheel: npu_sync is not on PyPI, so never by name."""
    monkeypatch.setitem(sys.modules, "npu_sync.prometheus", None)
    response = client.get(f"{PREFIX}/metrics")
    assert response.status_code == 501
    error = response.get_json()["error"]
    assert "pip install -e '.[prometheus]' from the root of a clone of npu_sync" in error
    assert "pip install 'dist/npu_sync-<version>-py3-none-any.whl[prometheus]'" in error
    assert bare_installs(error) == []


def test_metrics_is_a_501_when_the_exporter_cannot_import_its_client(client, monkeypatch):
    """An ImportError raised by metrics_text itself is also a 501, not a 500."""
    fake = types.ModuleType("npu_sync.prometheus")

    def metrics_text(pool):
        raise ImportError("No module named 'prometheus_client'")

    fake.metrics_text = metrics_text
    monkeypatch.setitem(sys.modules, "npu_sync.prometheus", fake)
    response = client.get(f"{PREFIX}/metrics")
    assert response.status_code == 501
    assert "pip install -e '.[prometheus]'" in response.get_json()["error"]


# -- errors, prefix, registration ----------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "status", "allow"),
    [
        ("GET", "/nope", 404, None),
        ("POST", "/dead-letters/nope", 404, None),
        ("GET", "/reload", 405, "POST"),
        ("DELETE", "/dead-letters", 405, "GET, HEAD"),
        ("POST", "/stats", 405, "GET, HEAD"),
        ("PUT", "/", 405, "GET, HEAD"),
    ],
)
def test_errors_under_the_prefix_are_json(client, method, path, status, allow):
    """Unknown paths and wrong methods get JSON errors, never Flask's HTML pages."""
    response = client.open(f"{PREFIX}{path}", method=method)
    assert response.status_code == status
    assert response.is_json and "error" in response.get_json()
    assert response.headers.get("Allow") == allow


def test_the_prefix_comes_from_the_config(pool):
    """NPU_SYNC_URL_PREFIX moves every endpoint; the default prefix then serves nothing."""
    client = make_app(pool, NPU_SYNC_URL_PREFIX="/ops/npu/").test_client()
    assert client.get("/ops/npu/stats").status_code == 200
    assert client.get("/ops/npu/").status_code == 200
    assert client.get(f"{PREFIX}/stats").status_code == 404


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("NPU_SYNC_URL_PREFIX", "api/npu"),
        ("NPU_SYNC_URL_PREFIX", "/"),
        ("NPU_SYNC_URL_PREFIX", "/a b"),
        ("NPU_SYNC_URL_PREFIX", 5),
        ("NPU_SYNC_REFRESH_MS", 10),
        ("NPU_SYNC_REFRESH_MS", "2000"),
        ("NPU_SYNC_ADMIN_TOKEN", 1234),
    ],
)
def test_unusable_settings_fail_at_init_app_naming_the_key(pool, key, value):
    """A bad NPU_SYNC_* value is refused when the app is set up, not on a request."""
    app = Flask(__name__)
    app.config[key] = value
    with pytest.raises(ValueError, match=key):
        NpuSync(app, pool=pool)
    assert "npu_sync" not in app.extensions


def test_registering_twice_on_one_app_is_an_error(pool):
    """A second init_app on the same app raises instead of registering twice."""
    app = Flask(__name__)
    ext = NpuSync(app, pool=pool)
    with pytest.raises(RuntimeError, match="already registered"):
        ext.init_app(app)
    with pytest.raises(RuntimeError, match="already registered"):
        NpuSync(app, pool=pool)


def test_one_extension_serves_several_apps_from_a_factory(pool):
    """The app-factory pattern: one NpuSync, init_app per app, state per app."""
    ext = NpuSync(pool=pool)
    apps = []
    for prefix in ("/one", "/two"):
        app = Flask(__name__)
        app.config["NPU_SYNC_URL_PREFIX"] = prefix
        ext.init_app(app)
        apps.append(app)
    assert apps[0].test_client().get("/one/stats").status_code == 200
    assert apps[1].test_client().get("/two/stats").status_code == 200
    assert apps[0].extensions["npu_sync"] is not apps[1].extensions["npu_sync"]


# -- which pool, and who closes it ---------------------------------------------------------


def test_a_pool_passed_in_is_not_closed_by_the_extension(pool, at_exit):
    """The user's pool is theirs to close: nothing is registered to close it."""
    make_app(pool).test_client().get(f"{PREFIX}/stats")
    assert all(getattr(func, "__self__", None) is not pool for func in at_exit)
    assert not pool.closed


def test_a_pool_built_from_npu_sync_config_is_closed_at_exit(tmp_path, at_exit):
    """NPU_SYNC_CONFIG builds the app's pool once; it is closed at exit, not per request."""
    path = tmp_path / "npu_workers.yaml"
    path.write_text(YAML.format(workers=yaml_worker("a", 9101)))
    app = make_app(NPU_SYNC_CONFIG=str(path), NPU_SYNC_WATCH=False)
    with app.app_context():
        built = current_pool()
    try:
        client = app.test_client()
        assert client.get(f"{PREFIX}/workers").get_json()["workers"][0]["id"] == "a"
        assert client.get(f"{PREFIX}/stats").status_code == 200
        assert not built.closed
        (close,) = [f for f in at_exit if getattr(f, "__self__", None) is built]
        with app.app_context():
            assert current_pool() is built
        close()
        assert built.closed
    finally:
        built.close()


def test_a_pool_built_from_npu_sync_config_watches_its_file(tmp_path):
    """By default the app's pool reloads its file on change (NPU_SYNC_WATCH defaults on)."""
    path = tmp_path / "npu_workers.yaml"
    path.write_text(YAML.format(workers=yaml_worker("a", 9101)))
    app = make_app(NPU_SYNC_CONFIG=str(path))
    with app.app_context():
        built = current_pool()
    try:
        path.write_text(YAML.format(workers=yaml_worker("a", 9101) + "\n" + yaml_worker("c", 9103)))
        gate, waited = threading.Event(), 0.0
        while len(built.workers()) < 2 and waited < 10:
            waited += 0.02
            gate.wait(0.02)
        assert [w["id"] for w in built.workers()] == ["a", "c"]
    finally:
        built.close()


def test_a_broken_npu_sync_config_fails_at_init_app(tmp_path):
    """A bad YAML named by NPU_SYNC_CONFIG raises ConfigError with the key path at setup."""
    from npu_sync import ConfigError

    path = tmp_path / "npu_workers.yaml"
    path.write_text(YAML.format(workers=yaml_worker("a", 0)))
    app = Flask(__name__)
    app.config["NPU_SYNC_CONFIG"] = str(path)
    with pytest.raises(ConfigError, match=r"npu_workers\.workers\[0\]\.port"):
        NpuSync(app)
    assert "npu_sync" not in app.extensions


def test_without_a_pool_or_config_the_default_pool_is_used(pool, monkeypatch):
    """No pool and no NPU_SYNC_CONFIG: get_pool() is looked up on each use."""
    calls = []

    def fake_get_pool():
        calls.append(1)
        return pool

    monkeypatch.setattr(npu_flask, "get_pool", fake_get_pool)
    app = make_app()
    assert calls == []
    assert app.test_client().get(f"{PREFIX}/stats").status_code == 200
    assert calls == [1]


# -- secrets -------------------------------------------------------------------------------


def test_no_response_or_log_line_contains_a_secret(yaml_pool, pool, net, tmp_path, caplog):
    """Worker headers and the admin token appear in no body, header or log record."""
    caplog.set_level(logging.DEBUG)
    record_id = dead_letter(pool, net)
    responses = []
    client = make_app(pool).test_client()
    for path in ("/", "/stats", "/workers", "/dead-letters", "/metrics", "/nope"):
        responses.append(client.get(f"{PREFIX}{path}"))
    for headers in (AUTH, {}, {"Authorization": "Bearer wrong"}):
        responses.append(client.post(f"{PREFIX}/reload", headers=headers))
        responses.append(
            client.post(f"{PREFIX}/dead-letters/replay", json={"id": record_id}, headers=headers)
        )
    # A reload error mentioning the headers section, from a file-backed pool.
    (tmp_path / "npu_workers.yaml").write_text(
        YAML.format(
            workers=f"    - {{id: a, host: 127.0.0.1, port: 9101, "
            f'headers: {{Authorization: "Bearer {SECRET}\\n"}}}}'
        )
    )
    yaml_client = make_app(yaml_pool).test_client()
    broken = yaml_client.post(f"{PREFIX}/reload", headers=AUTH)
    assert broken.status_code == 400
    assert any("headers.Authorization" in e for e in broken.get_json()["errors"])
    responses += [broken, yaml_client.get(f"{PREFIX}/stats")]
    # Prove the secret really was on the wire, so its absence below means something.
    assert any(req.headers.get("Authorization") == f"Bearer {SECRET}" for req in net.requests("b"))
    for response in responses:
        text = response.get_data(as_text=True) + str(response.headers)
        assert SECRET not in text and TOKEN not in text, response.request.path
    for record in caplog.records:
        assert SECRET not in record.getMessage() and TOKEN not in record.getMessage()


# -- the status page -----------------------------------------------------------------------


def test_status_page_is_one_self_contained_html_page(client):
    """GET / is HTML with inline CSS and JS only, relative fetches and the refresh setting."""
    response = client.get(f"{PREFIX}/")
    assert response.status_code == 200 and response.mimetype == "text/html"
    html = response.get_data(as_text=True)
    assert 'data-refresh-ms="2000"' in html
    assert '? "fleet" : "fleet?host=" + encodeURIComponent(' in html
    assert "fetchJson(fleetUrl)" in html and 'fetchJson("workers")' in html
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)
    assert not re.search(r"<(script|link)[^>]+(src|href)=[\"'](?!data:)", html)
    assert "innerHTML" not in html and "insertAdjacentHTML" not in html


def test_status_page_refresh_interval_is_configurable(pool):
    """NPU_SYNC_REFRESH_MS sets the page's refresh interval."""
    client = make_app(pool, NPU_SYNC_REFRESH_MS=500).test_client()
    assert 'data-refresh-ms="500"' in client.get(f"{PREFIX}/").get_data(as_text=True)


def test_status_page_csp_allows_exactly_its_own_inline_script_and_style(client):
    """The CSP hashes match the page's inline script and style; nothing else may load."""
    response = client.get(f"{PREFIX}/")
    html = response.get_data(as_text=True)
    csp = dict(
        part.strip().split(" ", 1)
        for part in response.headers["Content-Security-Policy"].split(";")
    )
    for tag, directive in (("script", "script-src"), ("style", "style-src")):
        (content,) = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
        digest = base64.b64encode(hashlib.sha256(content.encode()).digest()).decode()
        assert csp[directive] == f"'sha256-{digest}'"
    assert csp["default-src"] == "'none'" and csp["connect-src"] == "'self'"
    assert response.headers["X-Content-Type-Options"] == "nosniff"


def test_the_prefix_without_a_slash_redirects_to_the_page(client):
    """/api/npu/pool redirects to /api/npu/pool/ so the page's relative fetches resolve."""
    response = client.get(PREFIX)
    assert response.status_code in (301, 308)
    assert response.headers["Location"].endswith(f"{PREFIX}/")


def test_a_misspelt_setting_is_warned_about_with_a_suggestion(pool, caplog):
    """NPU_SYNC_CONFG is not silently ignored: a warning names it and suggests the key."""
    caplog.set_level(logging.WARNING, logger="npu_sync.flask")
    make_app(pool, NPU_SYNC_CONFG="/etc/npu_workers.yaml", NPU_SYNC_REFRESH_MS=1000)
    warned = [r.getMessage() for r in caplog.records if r.name == "npu_sync.flask"]
    assert warned == [
        "unknown Flask setting NPU_SYNC_CONFG is ignored (did you mean NPU_SYNC_CONFIG?)"
    ]


def test_known_settings_and_other_keys_are_not_warned_about(pool, caplog):
    """Every setting the extension reads, and keys of other extensions, pass quietly."""
    caplog.set_level(logging.WARNING, logger="npu_sync.flask")
    settings = {key: None for key in npu_flask.SETTINGS if key != "NPU_SYNC_ADMIN_TOKEN"}
    settings.update(NPU_SYNC_URL_PREFIX="/npu", NPU_SYNC_REFRESH_MS=1000, SQLALCHEMY_URI="x")
    settings.pop("NPU_SYNC_CONFIG")
    make_app(pool, **settings)
    assert not [r for r in caplog.records if r.name == "npu_sync.flask"]
