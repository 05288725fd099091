"""A worker that quotes the credentials it was sent back in its errors: no configured
secret reaches an exception, workers(), the Flask endpoints, the log, the dead-letter
file or `npu-sync status`. Real reference workers on loopback ports."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from npu_sync import Task, TaskFailed, TaskRejected, WorkerPool
from npu_sync._redact import REDACTED
from npu_sync.cli import main
from npu_sync.errors import InvalidTask
from npu_sync.worker_server import WorkerBehaviour, WorkerServer
from tests.hostile import Hostile, answer, keep_answering

TOKEN = "echo-t0ken-5b1e9f3a7c"
PREFIX = "/api/npu/pool"


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("ECHO_TOKEN", TOKEN)
    return TOKEN


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.DEBUG)
    yield caplog


def log_text(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(
        r.getMessage() + str(r.__dict__) + (str(r.exc_info[1]) if r.exc_info else "")
        for r in caplog.records
    )


def write(tmp_path: Path, worker: str, *, extra: str = "") -> Path:
    path = tmp_path / "npu_workers.yaml"
    path.write_text(
        "npu_workers:\n"
        f"  workers:\n    - {worker}\n"
        f"  dead_letter: {{backend: sqlite, path: '{tmp_path / 'dead.sqlite3'}'}}\n"
        "  retry: {max_retries: 0}\n"
        "  health: {enabled: false}\n" + extra,
        encoding="utf-8",
    )
    return path


def flask_surfaces(pool: WorkerPool) -> dict[str, str]:
    """What the unauthenticated endpoints answer."""
    pytest.importorskip("flask")
    from flask import Flask

    from npu_sync.flask import NpuSync

    app = Flask(__name__)
    app.config.update(TESTING=True)
    NpuSync(app, pool=pool)
    client = app.test_client()
    return {
        name: client.get(f"{PREFIX}{name}").get_data(as_text=True)
        for name in ("/workers", "/dead-letters", "/stats")
    }


@pytest.mark.integration
def test_a_static_authorization_header_echoed_in_errors_reaches_no_surface(tmp_path, token, logs):
    """TaskFailed, its attempts, workers(), /workers, /dead-letters, the log and the SQLite
    file never hold a static header's token the worker quoted back."""
    behaviour = WorkerBehaviour(fail_all=True, echo_header="Authorization")
    with WorkerServer(worker_id="w", behaviour=behaviour) as server:
        path = write(
            tmp_path,
            f"{{id: w, url: '{server.url}', headers: {{Authorization: 'Bearer ${{ECHO_TOKEN}}'}}}}",
        )
        with WorkerPool.from_yaml(path, watch=False) as pool:
            with pytest.raises(TaskFailed) as failed:
                pool.execute(Task({"model_id": "default", "input_text": "x"}))
            surfaces = {
                "TaskFailed": str(failed.value),
                "attempts": repr([a.error for a in failed.value.attempts]),
                "workers()": json.dumps(pool.workers()),
                **flask_surfaces(pool),
            }
    # The worker did quote it: what is shown is the redaction, not a missing text.
    assert f"(Authorization: Bearer {REDACTED})" in surfaces["attempts"]
    surfaces["log"] = log_text(logs)
    surfaces["SQLite file"] = (tmp_path / "dead.sqlite3").read_bytes().decode("latin-1")
    assert "simulated failure" in surfaces["SQLite file"]
    for where, text in surfaces.items():
        assert token not in text, f"the token reached {where}"


@pytest.mark.integration
def test_a_bearer_token_echoed_by_an_unhealthy_worker_reaches_no_surface(
    tmp_path, token, logs, capsys
):
    """The health error in check_health(), workers(), /workers, `npu-sync status` and the
    log never holds an `auth: bearer` token the worker quoted back."""
    behaviour = WorkerBehaviour(health_status="degraded", echo_header="Authorization")
    with WorkerServer(worker_id="w", behaviour=behaviour, bearer_token=TOKEN) as server:
        path = write(
            tmp_path,
            f"{{id: w, url: '{server.url}', auth: {{type: bearer, token: '${{ECHO_TOKEN}}'}}}}",
        )
        with WorkerPool.from_yaml(path, watch=False) as pool:
            checked = pool.check_health()
            surfaces = {
                "check_health()": json.dumps(checked),
                "workers()": json.dumps(pool.workers()),
                **flask_surfaces(pool),
            }
        assert main(["status", str(path)]) == 1
        surfaces["npu-sync status"] = "".join(capsys.readouterr())
        assert main(["status", str(path), "--json"]) == 1
        surfaces["npu-sync status --json"] = "".join(capsys.readouterr())
    assert "degraded (Authorization: Bearer" in checked["w"]["error"]
    assert REDACTED in checked["w"]["error"]
    surfaces["log"] = log_text(logs)
    for where, text in surfaces.items():
        assert token not in text, f"the token reached {where}"


@pytest.mark.integration
def test_a_token_echoed_when_a_model_load_fails_is_not_in_the_rejection(tmp_path, token, logs):
    """A placement the worker refuses, quoting the bearer token: TaskRejected and the log
    say why without it."""
    behaviour = WorkerBehaviour(echo_header="Authorization")
    with WorkerServer(worker_id="w", behaviour=behaviour, bearer_token=TOKEN) as server:
        path = write(
            tmp_path,
            f"{{id: w, url: '{server.url}', auth: {{type: bearer, token: '${{ECHO_TOKEN}}'}}}}",
            extra="  models: {placement: true}\n",
        )
        with WorkerPool.from_yaml(path, watch=False) as pool:
            pool.check_health()  # reads the worker's model list
            # A model id the worker cannot load (too long): it answers 422, quoting.
            with pytest.raises(TaskRejected) as rejected:
                pool.execute(Task({"model_id": "m" * 300, "input_text": "x"}))
            shown = str(rejected.value) + json.dumps(pool.workers())
    assert "loading it on w failed: HTTP 422" in shown and REDACTED in shown
    for where, text in {"TaskRejected": shown, "log": log_text(logs)}.items():
        assert token not in text, f"the token reached {where}"


@pytest.mark.integration
def test_a_rejection_quoting_the_token_keeps_it_out_of_the_message_and_body(tmp_path, token):
    """A 4xx quoting the header: TaskRejected's message and body carry the redaction."""
    behaviour = WorkerBehaviour(status_code=422, echo_header="X-Api-Key")
    with WorkerServer(worker_id="w", behaviour=behaviour) as server:
        path = write(
            tmp_path, f"{{id: w, url: '{server.url}', headers: {{X-Api-Key: '${{ECHO_TOKEN}}'}}}}"
        )
        with (
            WorkerPool.from_yaml(path, watch=False) as pool,
            pytest.raises(TaskRejected) as rejected,
        ):
            pool.execute(Task({"model_id": "default", "input_text": "x"}))
    assert rejected.value.body == {"detail": f"forced (X-Api-Key: {REDACTED})"}
    assert token not in str(rejected.value)


@pytest.mark.integration
def test_model_names_a_worker_sends_are_bounded(tmp_path):
    """A "Model X not loaded" answer naming a huge model is not remembered by that name."""

    huge = "M" * 100_000

    def reply(seen):
        if seen.path.startswith("/models"):
            return answer(200, json.dumps({"loaded_models": []}).encode())
        if seen.path == "/health":
            return answer(200, b'{"status": "healthy"}')
        body = json.dumps({"detail": f"Model {huge} not loaded"}).encode()
        return answer(500, body)

    server = Hostile(keep_answering(reply))
    try:
        path = write(tmp_path, f"{{id: w, url: '{server.url()}'}}")
        with WorkerPool.from_yaml(path, watch=False) as pool:
            with pytest.raises((TaskFailed, TaskRejected)) as ended:
                pool.execute(Task({"input_text": "x"}))
            kept = [m for w in pool._state.workers.values() for m in w.held.not_loaded]
    finally:
        server.close()
    assert all(len(model) <= 256 for model in kept)
    assert len(str(ended.value)) < 2_000


def test_invalid_task_messages_escape_control_characters():
    """A caller's path with ESC, CR and LF is quoted escaped in InvalidTask."""
    with pytest.raises(InvalidTask) as info:
        Task({"x": 1}, endpoint="inference\x1b[2J\r\nX-Evil: 1")
    message = str(info.value)
    assert "\x1b" not in message and "\r" not in message and "\n" not in message
    assert str(InvalidTask("bad path /a\x1b[31m\r\n")) == "bad path /a\\x1b[31m\\r\\n"
