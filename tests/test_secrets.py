"""Credentials and terminal escapes never reach an operator's eyes, on any surface."""

from __future__ import annotations

import json
import logging

import pytest

from npu_sync import ConfigError, Task, TaskFailed, TaskRejected, WorkerPool
from npu_sync.cli import main
from npu_sync.config import load_config
from npu_sync.errors import printable, scrub
from npu_sync.testing import FakeClock, FakeNetwork, json_response

TOKEN = "admin-t0ken-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PREFIX = "/api/npu/pool"
# One per place a credential can hide in a configuration.
SECRETS = ("userinfo-pw-1", "query-token-2", "redis-pw-3", "bare-userinfo-4")

GOOD = """\
npu_workers:
  workers:
    - {id: a, url: 'http://127.0.0.1:9101'}
  health: {enabled: false}
"""

# Every URL below is invalid *and* carries a secret: a bad port, a query, no scheme.
LEAKY = f"""\
npu_workers:
  workers:
    - {{id: a, url: 'http://127.0.0.1:9101'}}
    - {{id: b, url: 'http://admin:{SECRETS[0]}@127.0.0.1:99999'}}
    - {{id: c, url: 'http://127.0.0.1:9103/?token={SECRETS[1]}'}}
    - {{id: d, url: 'admin:{SECRETS[3]}@127.0.0.1:9104'}}
  shared_state: {{backend: none, url: 'redis://:{SECRETS[2]}@127.0.0.1:70000/0'}}
  health: {{enabled: false}}
"""


def assert_clean(text: str, where: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret} leaked into {where}"


def test_scrub_masks_each_form_of_credential():
    """userinfo (with or without a scheme), query values and Authorization values."""
    assert scrub("http://u:pw@h:1 and redis://:pw@h:2/0") == "http://***@h:1 and redis://***@h:2/0"
    assert scrub("got 'u:pw@host:8081'") == "got '***@host:8081'"
    assert scrub("http://h/x?token=abc&sig=def#frag") == "http://h/x?token=***&sig=***#frag"
    assert scrub("Authorization: Bearer abc.def") == "Authorization: Bearer ***"
    assert scrub("write to ops@example.com about basic checks") == (
        "write to ops@example.com about basic checks"
    )


def test_printable_escapes_what_a_terminal_would_obey():
    """ESC, BEL, CR, bidi overrides are shown as escapes; printable text is untouched."""
    assert printable("ok \u00e9\u4e2d") == "ok \u00e9\u4e2d"
    assert printable("a\x1b[2Jb\x07\r\u202ec") == "a\\x1b[2Jb\\x07\\r\\u202ec"


def test_a_credential_in_a_rejected_reload_reaches_no_surface(tmp_path, caplog, capsys):
    """Errors, logs, stats(), the Flask endpoints and status page, Prometheus metrics, the
    CLI and repr(): none shows a credential from a bad file."""
    pytest.importorskip("flask")
    pytest.importorskip("prometheus_client")
    from flask import Flask

    from npu_sync.flask import NpuSync
    from npu_sync.prometheus import metrics_text

    caplog.set_level(logging.DEBUG)
    path = tmp_path / "npu_workers.yaml"
    path.write_text(GOOD)
    net = FakeNetwork()
    with WorkerPool.from_yaml(
        path, watch=False, transport_factory=net.factory, clock=FakeClock()
    ) as pool:
        path.write_text(LEAKY)
        with pytest.raises(ConfigError) as info:
            pool.reload()
        # Each secret-bearing key was reported (so its absence below means something).
        assert [e.split(":")[0] for e in info.value.errors] == [
            "npu_workers.workers[1].url",
            "npu_workers.workers[2].url",
            "npu_workers.workers[3].url",
            "npu_workers.shared_state.url",
        ]
        surfaces = {
            "the exception": str(info.value) + repr(info.value.errors),
            "stats()": json.dumps(pool.stats()),
            "metrics": metrics_text(pool)[0].decode(),
        }
        app = Flask(__name__)
        app.config.update(TESTING=True, NPU_SYNC_ADMIN_TOKEN=TOKEN)
        NpuSync(app, pool=pool)
        client = app.test_client()
        reload = client.post(f"{PREFIX}/reload", headers=AUTH)
        assert reload.status_code == 400
        for name, response in {
            "POST /reload": reload,
            "GET /stats": client.get(f"{PREFIX}/stats"),
            "the status page": client.get(f"{PREFIX}/"),
            "GET /metrics": client.get(f"{PREFIX}/metrics"),
        }.items():
            surfaces[name] = response.get_data(as_text=True)
        assert "Last reload rejected" in surfaces["the status page"]  # the banner's source
        assert pool.stats()["reloads"]["last_error"].count("***") >= 3
    assert main(["check", str(path)]) == 2
    out, err = capsys.readouterr()
    surfaces["npu-sync check"] = out + err
    assert "npu_workers.workers[1].url" in err
    surfaces["logs"] = "\n".join(r.getMessage() + str(r.__dict__) for r in caplog.records)
    assert "config.reload_failed" in surfaces["logs"]
    for where, text in surfaces.items():
        assert_clean(text, where)


def test_repr_of_a_loaded_config_hides_the_redis_password(tmp_path):
    """A valid file with a Redis password: repr(PoolConfig) masks it."""
    path = tmp_path / "npu_workers.yaml"
    path.write_text(GOOD + f"  shared_state: {{url: 'redis://user:{SECRETS[2]}@h:6379/0'}}\n")
    config = load_config(path)
    assert SECRETS[2] in config.shared_state.url
    assert_clean(repr(config), "repr(PoolConfig)")
    assert_clean(repr(config.shared_state), "repr(SharedStateConfig)")


ESCAPE = "\x1b]0;owned\x07\x1b[2J\x1b[31mred\u202e"


def hostile(req):
    return json_response(500, {"detail": f"boom {ESCAPE}"})


def test_escape_sequences_from_a_worker_reach_no_message_log_or_listing(tmp_path, caplog, capsys):
    """A worker's error text is escaped in TaskFailed, TaskRejected, the logs, stats()
    and `npu-sync dlq list`."""
    caplog.set_level(logging.DEBUG)
    store = tmp_path / "dead.sqlite3"
    path = tmp_path / "npu_workers.yaml"
    path.write_text(
        GOOD.replace("  health:", f"  dead_letter: {{backend: sqlite, path: '{store}'}}\n  health:")
        + "  retry: {max_retries: 0}\n"
    )
    net = FakeNetwork(hostile)
    with WorkerPool.from_yaml(
        path, watch=False, transport_factory=net.factory, clock=FakeClock()
    ) as pool:
        with pytest.raises(TaskFailed) as failed:
            pool.execute(Task({"input_text": "x"}))
        net.route("a", lambda req: json_response(422, {"detail": ESCAPE}))
        with pytest.raises(TaskRejected) as rejected:
            pool.execute(Task({"input_text": "y"}))
        texts = {
            "TaskFailed": str(failed.value) + repr([a.error for a in failed.value.attempts]),
            "TaskRejected": str(rejected.value),
            "stats()": json.dumps(pool.workers()),
        }
    assert "\\x1b]0;owned\\x07" in texts["TaskFailed"]  # shown, but as text
    assert main(["dlq", "list", "--config", str(path)]) == 0
    texts["dlq list"] = capsys.readouterr().out
    assert "boom" in texts["dlq list"]
    texts["logs"] = "\n".join(r.getMessage() for r in caplog.records)
    for where, text in texts.items():
        for char in ("\x1b", "\x07", "\u202e"):
            assert char not in text, f"{char!r} reached {where}"


# Attacks: credentials in headers and in the Redis URL when everything fails.


HEADER_SECRET = "hdr-s3cret-value"


BEARER_SECRET = "bearer-s3cret-value"


REDIS_SECRET = "redis-s3cret-value"


def test_credentials_in_headers_and_the_redis_url_reach_no_surface_when_all_fails(
    tmp_path, caplog, capsys, monkeypatch
):
    """Header values (any name), a Bearer token from the environment and the Redis
    password in a valid file: with the worker unreachable and Redis down, none shows in
    TaskFailed, dead letters, logs, stats(), workers(), repr, the Flask endpoints, the
    status page, metrics or `npu-sync status`/`check`/`dlq list`."""
    pytest.importorskip("flask")
    pytest.importorskip("prometheus_client")
    import socket

    from flask import Flask

    from npu_sync.flask import NpuSync
    from npu_sync.prometheus import metrics_text

    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("NPU_TOKEN", BEARER_SECRET)
    with socket.socket() as s:  # a port nothing listens on, for the worker and Redis
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    store = tmp_path / "dead.sqlite3"
    path = tmp_path / "pool.yaml"
    path.write_text(
        "npu_workers:\n"
        "  workers:\n"
        f"    - id: a\n      url: 'http://127.0.0.1:{dead_port}'\n"
        "      headers:\n"
        f"        X-Api-Key: '{HEADER_SECRET}'\n"
        "        Authorization: 'Bearer ${NPU_TOKEN}'\n"
        "  health: {enabled: true, interval: 3600}\n"
        "  retry: {max_retries: 0}\n"
        f"  dead_letter: {{backend: sqlite, path: '{store}'}}\n"
        "  shared_state: {backend: redis, timeout: 0.2,"
        f" url: 'redis://user:{REDIS_SECRET}@127.0.0.1:{dead_port}/0'}}\n"
    )
    surfaces: dict[str, str] = {}
    with WorkerPool.from_yaml(path, watch=False) as pool:
        assert pool.config.workers[0].headers["X-Api-Key"] == HEADER_SECRET
        with pytest.raises(TaskFailed) as failed:
            pool.execute(Task({"input_text": "x"}))
        pool.check_health()
        record = pool.dead_letters.get(failed.value.dead_letter_id)
        surfaces.update(
            {
                "TaskFailed": str(failed.value) + repr(failed.value.attempts),
                "dead letter": json.dumps(record.to_dict()),
                "stats()": json.dumps(pool.stats()),
                "workers()": json.dumps(pool.workers()),
                "repr(config)": repr(pool.config) + repr(pool.config.workers[0]),
                "repr(pool)": repr(pool),
                "metrics": metrics_text(pool)[0].decode(),
            }
        )
        assert pool.stats()["shared_state"]["available"] is False  # Redis failed
        app = Flask(__name__)
        app.config.update(TESTING=True, NPU_SYNC_ADMIN_TOKEN="t")
        NpuSync(app, pool=pool)
        client = app.test_client()
        for route in ("/", "/stats", "/workers", "/dead-letters", "/metrics"):
            surfaces[f"GET {route}"] = client.get(f"/api/npu/pool{route}").get_data(as_text=True)
        surfaces["GET /dead-letters (admin)"] = client.get(
            "/api/npu/pool/dead-letters", headers={"Authorization": "Bearer t"}
        ).get_data(as_text=True)
    # The sqlite store is what the CLI lists; shared state needs no Redis for it.
    for argv in (
        ["status", str(path)],
        ["status", "--json", str(path)],
        ["check", str(path)],
        ["dlq", "list", "--config", str(path)],
        ["dlq", "show", record.id, "--config", str(path)],
    ):
        main(argv)
        out, err = capsys.readouterr()
        assert out, f"npu-sync {argv[0]} printed nothing"
        surfaces["npu-sync " + " ".join(argv[:2])] = out + err
    surfaces["logs"] = "\n".join(
        r.getMessage() + repr(r.args) + str(r.exc_text) for r in caplog.records
    )
    for where, text in surfaces.items():
        for secret in (HEADER_SECRET, BEARER_SECRET, REDIS_SECRET):
            assert secret not in text, f"{secret} leaked into {where}"
