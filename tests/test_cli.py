"""The npu-sync command: exit codes and messages."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from npu_sync import ConfigError, WorkerPool, cli
from npu_sync import _holdings as holdings
from npu_sync._deadletter import DeadLetter, SQLiteDeadLetterStore
from npu_sync.cli import main
from npu_sync.task import Attempt, Task
from npu_sync.worker_server import LocalWorker
from tests.workerkit import call


def test_check_accepts_a_valid_file(tmp_path, capsys):
    """'check' exits 0 with a one-line summary."""
    path = tmp_path / "ok.yaml"
    path.write_text(
        "npu_workers:\n  workers:\n"
        "    - {id: a, host: 127.0.0.1, port: 8081}\n"
        "    - {id: b, url: 'http://127.0.0.1:8082', priority: 2}\n"
    )
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ok" in out and "2 worker(s)" in out and "2 priority tier(s)" in out


def test_check_says_in_one_line_why_an_autobot_key_has_no_effect(tmp_path, capsys):
    """AutoBot's circuit_breaker.success_threshold loads, with one warning line."""
    path = tmp_path / "npu_workers.yaml"
    path.write_text(
        "npu:\n  circuit_breaker: {enabled: true, success_threshold: 3, retry_timeout: 30}\n"
        "  health_monitoring: {enabled: true, check_interval: 20}\n"
        "  workers:\n    - {id: a, host: 127.0.0.1, port: 8081, tags: {site: lab}}\n"
    )
    assert main(["check", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "ok" in lines[1]
    assert lines[0].startswith(
        f"{path}: warning: npu.circuit_breaker.success_threshold: 3 has no effect: "
    )


def test_check_allows_an_empty_pool_when_the_environment_says_so(tmp_path, capsys, monkeypatch):
    """NPU_SYNC_RELOAD_ALLOW_EMPTY=true is the pool's rule: check accepts no worker."""
    monkeypatch.setenv("NPU_SYNC_RELOAD_ALLOW_EMPTY", "true")
    path = tmp_path / "pool.yaml"
    path.write_text("npu_workers:\n  workers: []\n")
    assert main(["check", str(path)]) == 0


def test_check_lists_every_error_with_its_key_path(tmp_path, capsys):
    """'check' exits 2 and names each bad key, without a traceback."""
    path = tmp_path / "bad.yaml"
    path.write_text(
        "npu_workers:\n  workers:\n    - {id: a, host: 127.0.0.1, port: 0}\n"
        "  retry: {max_retriez: 3}\n"
    )
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "npu_workers.workers[0].port" in err and "npu_workers.retry.max_retriez" in err
    assert "Traceback" not in err


def check_errors(path, capsys) -> list[str]:
    """The error lines of 'check' (exit 2 asserted), without the heading."""
    assert main(["check", str(path)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"invalid configuration in {path}:"
    return [line.strip() for line in lines[1:]]


ONE_WORKER = "npu_workers:\n  workers:\n    - {id: a, url: 'http://127.0.0.1:8081'}\n"


@pytest.mark.parametrize(
    ("workers", "what"),
    [("[]", "no worker"), ("[{id: a, url: 'http://h:1', enabled: false}]", "no enabled worker")],
)
def test_check_refuses_a_pool_that_could_run_nothing(tmp_path, capsys, workers, what):
    """An empty or all-disabled worker list is exit 2, unless the file says it is meant."""
    path = tmp_path / "pool.yaml"
    path.write_text(f"npu_workers:\n  workers: {workers}\n")
    assert check_errors(path, capsys) == [
        f"npu_workers.workers: {what}: the pool could run no task (set reload.allow_empty: "
        "true if an empty pool is meant)"
    ]
    path.write_text(f"npu_workers:\n  workers: {workers}\n  reload: {{allow_empty: true}}\n")
    assert main(["check", str(path)]) == 0


def test_check_catches_a_dead_letter_path_start_up_would_fail_on(tmp_path, capsys):
    """A missing directory and a file that is no database are exit 2 with the key path;
    nothing is created."""
    path = tmp_path / "pool.yaml"
    missing = tmp_path / "nope" / "dead.sqlite3"
    path.write_text(ONE_WORKER + f"  dead_letter: {{backend: sqlite, path: '{missing}'}}\n")
    assert check_errors(path, capsys) == [
        f"npu_workers.dead_letter.path: directory {missing.parent} does not exist"
    ]
    junk = tmp_path / "junk.sqlite3"
    junk.write_text("a text file, not a database")
    path.write_text(ONE_WORKER + f"  dead_letter: {{backend: sqlite, path: '{junk}'}}\n")
    assert check_errors(path, capsys) == [
        f"npu_workers.dead_letter.path: {junk} is not a SQLite database"
    ]
    fresh = tmp_path / "fresh.sqlite3"
    path.write_text(ONE_WORKER + f"  dead_letter: {{backend: sqlite, path: '{fresh}'}}\n")
    assert main(["check", str(path)]) == 0
    assert not fresh.exists()


def test_check_catches_a_bad_redis_url_and_missing_certificates(tmp_path, capsys):
    """A Redis port out of range and a certificate that is not there, by key path."""
    path = tmp_path / "pool.yaml"
    path.write_text(
        ONE_WORKER + "  shared_state: {backend: redis, url: 'redis://:pw@127.0.0.1:123456/0'}\n"
    )
    assert check_errors(path, capsys) == [
        "npu_workers.shared_state.url: has an invalid port (must be 1..65535)"
    ]
    path.write_text(ONE_WORKER + "  transport: {tls: {cert: client.pem, key: client.key}}\n")
    assert check_errors(path, capsys) == [
        f"npu_workers.transport.tls.cert: {tmp_path / 'client.pem'} does not exist",
        f"npu_workers.transport.tls.key: {tmp_path / 'client.key'} does not exist",
    ]


def test_check_of_a_fifo_or_a_deep_file_exits_2_at_once(tmp_path, capsys):
    """A FIFO does not block 'check'; absurd nesting is a config error, not a crash."""
    import os

    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    assert check_errors(fifo, capsys) == [f"cannot read {fifo}: not a regular file (a FIFO)"]
    deep = tmp_path / "deep.yaml"
    deep.write_text("npu_workers: " + "[" * 10000 + "]" * 10000 + "\n")
    (error,) = check_errors(deep, capsys)
    assert error.endswith("nested deeper than 32 levels")


def test_check_of_a_missing_file_is_a_message(tmp_path, capsys):
    """A missing file is reported by name with exit code 2."""
    assert main(["check", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_no_command_prints_help(capsys):
    """Bare 'npu-sync' shows the commands and exits 2."""
    assert main([]) == 2
    out = capsys.readouterr().out
    assert "demo" in out and "worker" in out and "check" in out


@pytest.mark.integration
def test_demo_runs_kills_a_worker_and_loses_nothing():
    """'python -m npu_sync demo' finishes every task despite the kill and exits 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "npu_sync", "demo", "--tasks", "150", "--latency-ms", "10"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "killed npu-2 (SIGKILL)" in proc.stdout and "restarted npu-2" in proc.stdout
    assert "lost 0" in proc.stdout
    assert "150/150 tasks succeeded" in proc.stdout


# -- helpers -------------------------------------------------------------------------------


def _refused_url() -> str:
    """A loopback URL where nothing listens: a port bound once and released."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _write_config(
    path: Path,
    workers: list[tuple[str, str]] | None = None,
    *,
    dead_letter: str = "{backend: memory}",
    disabled: tuple[str, ...] = (),
    shared_state: str | None = None,
) -> Path:
    """A pool configuration with fast timeouts, so failures show up at once."""
    if workers is None:
        workers = [("a", _refused_url())]
    lines = ["npu_workers:", "  workers:"]
    for worker_id, url in workers:
        enabled = "false" if worker_id in disabled else "true"
        lines.append(f"    - {{id: '{worker_id}', url: '{url}', enabled: {enabled}}}")
    lines += [
        "  health: {timeout: 1.0}",
        "  retry: {max_retries: 1, backoff_initial: 0.0, backoff_max: 0.0}",
        "  timeouts: {connect: 1.0, read: 5.0, task: 10.0}",
        f"  dead_letter: {dead_letter}",
    ]
    if shared_state is not None:
        lines.append(f"  shared_state: {shared_state}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _sqlite_config(tmp_path: Path, workers: list[tuple[str, str]] | None = None) -> Path:
    store = tmp_path / "dead.sqlite3"
    return _write_config(
        tmp_path / "pool.yaml", workers, dead_letter=f"{{backend: sqlite, path: '{store}'}}"
    )


def _add_records(path: Path, count: int, *, error: str = "timeout: no answer") -> list[DeadLetter]:
    """Store ``count`` dead letters in the SQLite file at ``path``, oldest first."""
    store = SQLiteDeadLetterStore(path)
    records = []
    try:
        for i in range(count):
            task = Task(payload={"model_id": "default", "input_text": f"task {i}"})
            record = DeadLetter.from_task(
                task,
                endpoint="/inference",
                error=error,
                attempts=[Attempt(worker_id="a", error=error, duration=0.1)],
                now=1_700_000_000.0 + i,
            )
            store.add(record)
            records.append(record)
    finally:
        store.close()
    return records


def _stored_ids(path: Path) -> list[str]:
    store = SQLiteDeadLetterStore(path)
    try:
        return [record.id for record in store.list()]
    finally:
        store.close()


class _Terminal(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


# -- help ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["check"],
        ["status"],
        ["dlq"],
        ["dlq", "list"],
        ["dlq", "show"],
        ["dlq", "replay"],
        ["dlq", "purge"],
        ["worker"],
        ["demo"],
    ],
    ids=lambda argv: " ".join(argv) or "npu-sync",
)
def test_help_on_every_command_exits_0(argv, capsys):
    """'--help' on every command and subcommand prints its usage and exits 0."""
    assert main([*argv, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {' '.join(['npu-sync', *argv])}")


def test_help_lists_the_new_commands(capsys):
    """The top-level help names 'status' and 'dlq' next to the older commands."""
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "status" in out and "dlq" in out


def test_dlq_without_an_action_shows_its_help(capsys):
    """Bare 'npu-sync dlq' shows the dlq actions and exits 2."""
    assert main(["dlq"]) == 2
    out = capsys.readouterr().out
    assert all(action in out for action in ("list", "show", "replay", "purge"))


def test_a_usage_error_returns_2_without_a_traceback(capsys):
    """An unknown flag is a usage message and exit 2, returned rather than raised."""
    assert main(["status", "x.yaml", "--bogus"]) == 2
    err = capsys.readouterr().err
    assert "--bogus" in err and "Traceback" not in err


def test_help_through_the_module_entry_point_exits_0():
    """'python -m npu_sync dlq purge --help' exits 0 in a real process."""
    proc = subprocess.run(
        [sys.executable, "-m", "npu_sync", "dlq", "purge", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--yes" in proc.stdout


# -- status --------------------------------------------------------------------------------


@pytest.mark.integration
def test_status_shows_each_workers_name_protocol_device_and_models_never_its_secret(
    tmp_path, capsys, monkeypatch
):
    """'status' reads each worker's models and device, signed; the secret is not shown."""
    secret = "cli-status-hmac-secret-5"
    monkeypatch.setenv("NPU_STATUS_SECRET", secret)
    with (
        (
            LocalWorker(worker_id="lin", models=("phi", "e5"), hmac_auth=("pool", secret)).start()
        ) as lin,
        LocalWorker(
            worker_id="win", protocol="windows", models=("nomic",), npu_available=False
        ).start() as win,
    ):
        config = tmp_path / "pool.yaml"
        config.write_text(
            "npu_workers:\n  workers:\n"
            f"    - {{id: lin, name: 'Linux NPU Worker', url: '{lin.url}',"
            " auth: {type: hmac, service_id: pool, secret: '${NPU_STATUS_SECRET}'}}\n"
            f"    - {{id: win, url: '{win.url}', platform: windows}}\n",
            encoding="utf-8",
        )
        assert main(["status", str(config)]) == 0
        out = capsys.readouterr().out
        assert main(["status", str(config), "--json"]) == 0
        rows = {row["id"]: row for row in json.loads(capsys.readouterr().out)}
    assert secret not in out
    about = out.split("models and devices:", 1)[1]
    assert "Linux NPU Worker" in about and "autobot-linux" in about and "e5, phi" in about
    assert "autobot-windows" in about and "(no NPU)" in about and "nomic" in about
    assert rows["lin"]["models"] == ["e5", "phi"] and rows["win"]["npu_available"] is False
    assert rows["win"]["protocol"] == "autobot-windows" and rows["lin"]["device"]


def _per_model_blocks(out: str) -> list[dict[str, list[str]]]:
    """Each 'per model:' table of the output: model -> its cells."""
    blocks = []
    for chunk in out.split("per model:\n")[1:]:
        lines = [line.split() for line in chunk.split("\n\n", 1)[0].strip().splitlines()]
        blocks.append({cells[0]: cells for cells in lines[1:]})
    return blocks


@pytest.mark.integration
def test_status_shows_each_models_load_beside_its_holders_and_replicas(
    tmp_path, capsys, monkeypatch
):
    """Per model, 'status' prints the holders' inference counts, and with --watch the
    inferences per second between two probes, beside its replicas and who holds it;
    '--fleet --json' carries the same rows under "models"."""
    monkeypatch.setattr(holdings, "RATE_SPAN", 0.0)  # probes a moment apart give a rate

    def run(worker: LocalWorker, model: str, times: int) -> None:
        for _ in range(times):
            body = {"model_id": model, "input_text": "x"}
            assert call(worker, "POST", "/inference", body).status == 200

    with (
        LocalWorker(worker_id="a", models=("llama", "e5")).start() as a,
        LocalWorker(worker_id="b", models=("e5",)).start() as b,
    ):
        run(a, "llama", 3)
        run(a, "e5", 2)
        run(b, "e5", 1)
        config = _write_config(tmp_path / "pool.yaml", [("a", a.url), ("b", b.url)])
        assert main(["status", str(config), "--fleet", "--json"]) == 0
        models = {row["model"]: row for row in json.loads(capsys.readouterr().out)["models"]}
        rounds = iter([lambda: run(a, "llama", 4), None])

        def pause(_seconds: float) -> None:
            step = next(rounds)
            if step is None:
                raise KeyboardInterrupt
            step()

        monkeypatch.setattr(cli, "_pause", pause)
        assert main(["status", str(config), "--watch", "1"]) == 130
    assert (models["llama"]["workers"], models["llama"]["inferences"]) == (["a"], 3)
    assert (models["e5"]["workers"], models["e5"]["replicas"], models["e5"]["inferences"]) == (
        ["a", "b"],
        2,
        3,
    )
    first, second = _per_model_blocks(capsys.readouterr().out)
    assert first["llama"] == ["llama", "1", "0", "-", "3", "-", "a"]
    assert first["e5"] == ["e5", "2", "0", "-", "3", "-", "a,", "b"]
    assert second["llama"][:5] == ["llama", "1", "0", "-", "7"] and float(second["llama"][5]) > 0
    assert second["e5"][:6] == ["e5", "2", "0", "-", "3", "0.00"]


def test_the_status_probe_runs_no_placement_round():
    """With models.balance in the file, the probe's pool still places nothing: a round
    would load and unload models on the workers it only looks at."""
    from npu_sync.config import HealthConfig, ModelPolicy, ModelsConfig, PoolConfig, worker_config

    config = PoolConfig(
        workers=(worker_config("a", _refused_url()),),
        health=HealthConfig(enabled=False),
        models=ModelsConfig(balance=True, interval=0.01, catalog={"m": ModelPolicy(1, None)}),
    )
    with cli._probe_pool(config) as pool:
        assert pool.stats()["models"]["balance"] is False
        with pytest.raises(RuntimeError, match="placement is off"):
            pool.check_placement()


@pytest.mark.integration
def test_status_of_healthy_workers_exits_0_with_a_row_each(tmp_path, capsys):
    """'status' prints one 'ok' row per worker and exits 0 when all are healthy."""
    with LocalWorker(worker_id="a").start() as a, LocalWorker(worker_id="b").start() as b:
        config = _write_config(tmp_path / "pool.yaml", [("a", a.url), ("b", b.url)])
        assert main(["status", str(config)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("a ", "b "))}
    assert set(rows) == {"a", "b"}
    assert rows["a"].split()[1] == a.url and rows["a"].rstrip().endswith("ok")
    assert rows["b"].split()[1] == b.url and rows["b"].rstrip().endswith("ok")
    assert "2/2 enabled worker(s) healthy" in out


@pytest.mark.integration
def test_status_with_a_killed_worker_exits_1_and_shows_its_error(tmp_path, capsys):
    """A killed worker makes 'status' exit 1, and its row carries the connection error."""
    with LocalWorker(worker_id="a").start() as a, LocalWorker(worker_id="b").start() as b:
        config = _write_config(tmp_path / "pool.yaml", [("a", a.url), ("b", b.url)])
        b.kill()
        assert main(["status", str(config)]) == 1
    out = capsys.readouterr().out
    row_a = next(line for line in out.splitlines() if line.startswith("a "))
    row_b = next(line for line in out.splitlines() if line.startswith("b "))
    assert row_a.rstrip().endswith("ok")
    assert "connect" in row_b and "refused" in row_b.lower()
    assert "1/2 enabled worker(s) healthy" in out


@pytest.mark.integration
def test_status_json_is_a_list_of_rows(tmp_path, capsys):
    """'status --json' prints a parseable list with id, url, priority, health and latency."""
    with LocalWorker(worker_id="a").start() as a, LocalWorker(worker_id="b").start() as b:
        config = _write_config(tmp_path / "pool.yaml", [("a", a.url), ("b", b.url)])
        b.kill()
        assert main(["status", str(config), "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)
    assert [row["id"] for row in rows] == ["a", "b"]
    a_row, b_row = rows
    assert a_row["url"] == a.url and a_row["priority"] == 1 and a_row["enabled"] is True
    assert a_row["ok"] is True and a_row["status"] == 200 and a_row["error"] is None
    assert a_row["latency_ms"] > 0
    assert b_row["ok"] is False and b_row["latency_ms"] is None and "connect" in b_row["error"]


@pytest.mark.integration
def test_status_ignores_disabled_workers_for_the_exit_code(tmp_path, capsys):
    """A disabled worker that is down is shown as disabled and does not fail 'status'."""
    with LocalWorker(worker_id="a").start() as a:
        config = _write_config(
            tmp_path / "pool.yaml", [("a", a.url), ("spare", _refused_url())], disabled=("spare",)
        )
        assert main(["status", str(config)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("spare "))
    assert "[disabled] connect" in row
    assert "1/1 enabled worker(s) healthy, 1 disabled" in out


def test_status_with_no_enabled_worker_exits_1(tmp_path, capsys):
    """A pool whose only worker is disabled can run nothing, so 'status' exits 1."""
    config = _write_config(tmp_path / "pool.yaml", [("spare", _refused_url())], disabled=("spare",))
    assert main(["status", str(config)]) == 1
    assert "0/0 enabled worker(s) healthy" in capsys.readouterr().out


def test_status_of_a_bad_config_exits_2_with_every_key_path(tmp_path, capsys):
    """'status' on an invalid file exits 2 and names each bad key, without a traceback."""
    path = tmp_path / "bad.yaml"
    path.write_text(
        "npu_workers:\n  workers:\n    - {id: a, host: 127.0.0.1, port: 0}\n"
        "  health: {intervall: 3}\n"
    )
    assert main(["status", str(path)]) == 2
    err = capsys.readouterr().err
    assert "npu_workers.workers[0].port" in err and "npu_workers.health.intervall" in err
    assert "Traceback" not in err


def test_status_of_a_missing_config_exits_2(tmp_path, capsys):
    """'status' on a file that does not exist names it and exits 2."""
    assert main(["status", str(tmp_path / "absent.yaml")]) == 2
    assert "absent.yaml" in capsys.readouterr().err


def test_status_does_not_create_the_dead_letter_file(tmp_path, capsys):
    """Probing never opens (and so never creates) the configured SQLite dead-letter file."""
    config = _sqlite_config(tmp_path)
    assert main(["status", str(config)]) == 1
    assert not (tmp_path / "dead.sqlite3").exists()


def test_status_watch_refreshes_until_ctrl_c(tmp_path, capsys, monkeypatch):
    """'--watch N' probes again after each pause of N seconds; Ctrl-C ends it with 130."""
    pauses: list[float] = []

    def pause(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_pause", pause)
    config = _write_config(tmp_path / "pool.yaml")
    assert main(["status", str(config), "--watch", "0.5"]) == 130
    out = capsys.readouterr().out
    assert pauses == [0.5, 0.5]
    assert out.count("0/1 enabled worker(s) healthy") == 2
    assert "\x1b[" not in out  # not a terminal: no screen clearing


def test_status_watch_clears_the_screen_only_on_a_terminal(tmp_path, monkeypatch):
    """On a TTY each refresh starts by clearing the screen; the default interval is 2 s."""
    pauses: list[float] = []

    def pause(seconds: float) -> None:
        pauses.append(seconds)
        raise KeyboardInterrupt

    terminal = _Terminal()
    monkeypatch.setattr(cli, "_pause", pause)
    monkeypatch.setattr(sys, "stdout", terminal)
    config = _write_config(tmp_path / "pool.yaml")
    assert main(["status", str(config), "--watch"]) == 130
    assert pauses == [2.0]
    assert terminal.getvalue().startswith("\x1b[H\x1b[2J")


def test_status_watch_json_prints_one_line_per_round(tmp_path, capsys, monkeypatch):
    """'--watch --json' writes each round as one JSON line and never clears the screen."""
    rounds = iter([None, KeyboardInterrupt])

    def pause(_seconds: float) -> None:
        if next(rounds) is KeyboardInterrupt:
            raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_pause", pause)
    monkeypatch.setattr(sys, "stdout", _Terminal())
    config = _write_config(tmp_path / "pool.yaml")
    assert main(["status", str(config), "--json", "--watch", "1"]) == 130
    lines = sys.stdout.getvalue().splitlines()
    assert len(lines) == 2
    assert all(json.loads(line)[0]["id"] == "a" for line in lines)


def test_status_watch_before_config_is_a_clear_usage_error(capsys):
    """'--watch CONFIG' (a file where seconds belong) exits 2 saying to put CONFIG first."""
    assert main(["status", "--watch", "pool.yaml"]) == 2
    assert "give CONFIG before --watch" in capsys.readouterr().err


# -- status: the fleet ----------------------------------------------------------------------


@pytest.fixture
def fleet_redis(monkeypatch):
    """One fakeredis server behind every Redis client; fleet samples taken by hand."""
    fakeredis = pytest.importorskip("fakeredis")
    import redis

    server = fakeredis.FakeServer()
    monkeypatch.setattr(redis.Redis, "from_url", lambda *a, **k: fakeredis.FakeRedis(server=server))
    monkeypatch.setenv("NPU_SYNC_FLEET", "manual")
    return server


def _fleet_of(count: int, namespace: str) -> list:
    """Pools on a fake network, each as if in a process of its own, sampled once."""
    from npu_sync import WorkerPool
    from npu_sync._fleet import monitor_of
    from npu_sync.config import HealthConfig, PoolConfig, SharedStateConfig, worker_config
    from npu_sync.testing import FakeNetwork, json_response

    net = FakeNetwork(lambda req: json_response(200, {"ok": True}))
    config = PoolConfig(
        workers=(worker_config("a", "http://127.0.0.1:9701"),),
        health=HealthConfig(enabled=False),
        shared_state=SharedStateConfig(backend="redis", namespace=namespace),
    )
    pools = [WorkerPool(config, transport_factory=net.factory) for _ in range(count)]
    for n, pool in enumerate(pools):
        for _ in range(n + 1):
            pool.execute({})
        monitor_of(pool).tick()
    return pools


def test_status_with_shared_state_lists_the_fleet_and_its_totals(tmp_path, capsys, fleet_redis):
    """With Redis configured, 'status' shows every process, a total row and each worker's
    totals; the probe itself does not join the fleet."""
    pools = _fleet_of(2, "cli-fleet")
    try:
        config = _write_config(
            tmp_path / "pool.yaml", shared_state="{backend: redis, namespace: cli-fleet}"
        )
        assert main(["status", str(config)]) == 1  # the configured worker is refused
    finally:
        for pool in pools:
            pool.close()
    out = capsys.readouterr().out
    assert "fleet: 2 processes on 1 host publish to Redis namespace 'cli-fleet'." in out
    lines = out.splitlines()
    host_rows = [line for line in lines if line.startswith(socket.gethostname() + " ")]
    # One fleet host: its row, then its processes (listed by default on a single host).
    assert len(host_rows) == 3 and host_rows[0].split()[1:3] == ["live", "2"]
    total = next(line for line in lines if line.startswith("total "))
    assert total.split()[1:5] == ["2", "proc", "3", "3"]  # 1 + 2 tasks submitted, succeeded
    worker = next(line for line in lines if line.startswith("a ") and "ok" in line.split()[-1])
    assert worker.split()[1:4] == ["3", "3", "0"]


def _plant_other_host(namespace: str, server: Any, base_of: Any) -> None:
    """A live process on host ``far`` (a copy of ``base_of``'s snapshot) and a silent one on
    host ``gone`` (in the index, its snapshot expired)."""
    import json as json_

    import fakeredis

    from npu_sync._fleet import monitor_of

    redis = fakeredis.FakeRedis(server=server)
    mine = monitor_of(base_of).process["id"]
    snap = json_.loads(redis.get(f"{{{namespace}}}:fleet:process:{mine}"))
    snap["process"] = {**snap["process"], "id": "far:77:aa", "pid": 77, "host": "far"}
    redis.set(f"{{{namespace}}}:fleet:process:far:77:aa", json_.dumps(snap), ex=600)
    now = time.time()
    redis.zadd(f"{{{namespace}}}:fleet:index", {"far:77:aa": now, "gone:8:bb": now - 20})


def test_status_of_many_hosts_shows_a_row_per_host_and_processes_on_demand(
    tmp_path, capsys, fleet_redis
):
    """On several hosts 'status' lists hosts (a silent one as such) and no process rows;
    --host lists one host's processes, --processes every one."""
    pools = _fleet_of(2, "cli-hosts")
    try:
        _plant_other_host("cli-hosts", fleet_redis, pools[0])
        config = _write_config(
            tmp_path / "pool.yaml", shared_state="{backend: redis, namespace: cli-hosts}"
        )
        main(["status", str(config)])
        plain = capsys.readouterr().out.splitlines()
        main(["status", str(config), "--host", "far"])
        far = capsys.readouterr().out.splitlines()
        main(["status", str(config), "--processes"])
        every = capsys.readouterr().out.splitlines()
        main(["status", str(config), "--fleet", "--json"])
        body = json.loads(capsys.readouterr().out)
    finally:
        for pool in pools:
            pool.close()
    me = socket.gethostname()
    listed = [line.split() for line in plain if line.startswith(("far ", "gone ", me + " "))]
    rows = {cells[0]: cells[1:] for cells in listed}
    assert rows["far"][:3] == ["live", "1", "0"] and rows[me][:3] == ["live", "2", "0"]
    assert rows["gone"][0] == "silent" and rows["gone"][2:4] == ["0", "1"]  # 0 live, 1 silent
    assert len(listed) == 3  # no process rows by default on several hosts
    assert any(line.startswith("per process: npu-sync status --processes") for line in plain)
    assert [line.split()[1] for line in far if line.startswith("far ")] == ["live", "77"]
    assert len([line for line in every if line.startswith((me + " ", "far "))]) == 2 + 3
    assert [h["host"] for h in body["fleet"]["hosts"]] == [*sorted(["far", me]), "gone"]
    assert body["fleet"]["silent"][0]["id"] == "gone:8:bb"


def test_status_fleet_json_and_a_pool_without_shared_state(tmp_path, capsys, fleet_redis):
    """--fleet --json prints workers and fleet in one object; without Redis the fleet says
    plainly that nothing is shared."""
    config = _write_config(tmp_path / "pool.yaml")
    assert main(["status", str(config), "--fleet", "--json"]) == 1
    body = json.loads(capsys.readouterr().out)
    assert [row["id"] for row in body["workers"]] == ["a"]
    assert body["fleet"]["shared"] is False and body["fleet"]["processes"] == []
    assert body["fleet"]["note"].startswith("Not shared (shared_state.backend: none)")
    assert main(["status", str(config), "--fleet"]) == 1
    assert "fleet: Not shared" in capsys.readouterr().out
    assert main(["status", str(config)]) == 1
    assert "fleet:" not in capsys.readouterr().out


def test_status_says_when_the_shared_state_does_not_answer(tmp_path, capsys, fleet_redis):
    """An unreachable Redis is a line about the fleet, not a failure of 'status'."""
    fleet_redis.connected = False
    config = _write_config(
        tmp_path / "pool.yaml", shared_state="{backend: redis, namespace: cli-fleet}"
    )
    assert main(["status", str(config)]) == 1
    out = capsys.readouterr().out
    assert "fleet: Shared state unavailable (" in out


# -- dlq -----------------------------------------------------------------------------------


def test_dlq_list_prints_a_row_per_record(tmp_path, capsys):
    """'dlq list' shows id, task id, ISO creation time, attempts and a truncated error."""
    config = _sqlite_config(tmp_path)
    records = _add_records(tmp_path / "dead.sqlite3", 2, error="timeout: " + "x" * 200)
    assert main(["dlq", "list", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "TASK_ID", "CREATED", "ATTEMPTS", "REPLAYS", "ERROR"]
    first = lines[1].split()
    assert first[:5] == [records[0].id, records[0].task_id, "2023-11-14T22:13:20Z", "1", "0"]
    assert lines[1].endswith("...") and "x" * 200 not in out
    assert lines[2].split()[0] == records[1].id
    assert "1-2 of 2 record(s)" in out


def test_dlq_list_json_limit_and_offset(tmp_path, capsys):
    """'dlq list --json --limit --offset' prints that page of full records as JSON."""
    config = _sqlite_config(tmp_path)
    records = _add_records(tmp_path / "dead.sqlite3", 4)
    assert main(["dlq", "list", "--config", str(config), "--json", "--limit", "2"]) == 0
    page = json.loads(capsys.readouterr().out)
    assert page == [records[0].to_dict(), records[1].to_dict()]
    argv = ["dlq", "list", "--config", str(config), "--json", "--offset", "3"]
    assert main(argv) == 0
    assert [r["id"] for r in json.loads(capsys.readouterr().out)] == [records[3].id]


def test_dlq_list_of_an_empty_store(tmp_path, capsys):
    """An empty store lists as a message naming the file, with exit 0."""
    config = _sqlite_config(tmp_path)
    _add_records(tmp_path / "dead.sqlite3", 0)
    assert main(["dlq", "list", "--config", str(config)]) == 0
    assert f"no dead letters in {tmp_path / 'dead.sqlite3'}" in capsys.readouterr().out


def test_dlq_list_does_not_create_a_missing_store(tmp_path, capsys):
    """Listing a store whose file does not exist yet reports no records and leaves no file."""
    config = _sqlite_config(tmp_path)
    assert main(["dlq", "list", "--config", str(config)]) == 0
    out, err = capsys.readouterr()
    assert "no dead letters" in out and "does not exist yet" in err
    assert not (tmp_path / "dead.sqlite3").exists()


def test_dlq_config_is_accepted_before_the_action(tmp_path, capsys):
    """'dlq --config X list' reads the same store as 'dlq list --config X'."""
    config = _sqlite_config(tmp_path)
    (record,) = _add_records(tmp_path / "dead.sqlite3", 1)
    assert main(["dlq", "--config", str(config), "list"]) == 0
    assert record.id in capsys.readouterr().out


def test_dlq_reads_the_config_named_by_the_environment(tmp_path, capsys, monkeypatch):
    """Without --config, 'dlq' uses $NPU_SYNC_CONFIG."""
    config = _sqlite_config(tmp_path)
    (record,) = _add_records(tmp_path / "dead.sqlite3", 1)
    monkeypatch.setenv("NPU_SYNC_CONFIG", str(config))
    assert main(["dlq", "list"]) == 0
    assert record.id in capsys.readouterr().out


def test_dlq_falls_back_to_npu_workers_yaml(tmp_path, capsys, monkeypatch):
    """Without --config or $NPU_SYNC_CONFIG, 'dlq' reads ./npu_workers.yaml."""
    store = tmp_path / "dead.sqlite3"
    _write_config(
        tmp_path / "npu_workers.yaml", dead_letter=f"{{backend: sqlite, path: '{store}'}}"
    )
    (record,) = _add_records(store, 1)
    monkeypatch.delenv("NPU_SYNC_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["dlq", "list"]) == 0
    assert record.id in capsys.readouterr().out


def test_dlq_without_any_config_exits_2(tmp_path, capsys, monkeypatch):
    """No --config, no $NPU_SYNC_CONFIG and no ./npu_workers.yaml: exit 2 saying so."""
    monkeypatch.delenv("NPU_SYNC_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["dlq", "list"]) == 2
    err = capsys.readouterr().err
    assert "no configuration" in err and "npu_workers.yaml" in err and "Traceback" not in err


def test_dlq_with_a_missing_config_file_exits_2(tmp_path, capsys):
    """'dlq --config' naming a file that does not exist exits 2 and names it."""
    assert main(["dlq", "list", "--config", str(tmp_path / "gone.yaml")]) == 2
    assert "gone.yaml" in capsys.readouterr().err


@pytest.mark.parametrize("action", [["list"], ["show", "abc"], ["replay"], ["purge", "--yes"]])
def test_dlq_on_a_memory_store_explains_there_is_nothing_to_inspect(tmp_path, capsys, action):
    """Every 'dlq' action on a memory backend exits 2, saying the records live in-process."""
    config = _write_config(tmp_path / "pool.yaml", dead_letter="{backend: memory}")
    assert main(["dlq", *action, "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "memory" in err and "only inside the running process" in err
    assert "backend: sqlite" in err


def test_dlq_on_a_file_that_is_not_a_database_is_a_message(tmp_path, capsys):
    """A store path holding something else is a configuration error naming the key."""
    config = _sqlite_config(tmp_path)
    (tmp_path / "dead.sqlite3").write_bytes(b"this is not a database" * 100)
    assert main(["dlq", "list", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[1].startswith("  dead_letter.path: cannot open dead-letter store")
    assert err.splitlines()[1].endswith("file is not a database")


def test_dlq_show_prints_the_whole_record(tmp_path, capsys):
    """'dlq show ID' prints the record, attempts included, as JSON."""
    config = _sqlite_config(tmp_path)
    _, record = _add_records(tmp_path / "dead.sqlite3", 2)
    assert main(["dlq", "show", record.id, "--config", str(config)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown == record.to_dict()
    assert shown["attempts"][0]["worker_id"] == "a"


def test_dlq_show_of_an_unknown_id_exits_1(tmp_path, capsys):
    """'dlq show' of an id not in the store exits 1 and names the id."""
    config = _sqlite_config(tmp_path)
    _add_records(tmp_path / "dead.sqlite3", 1)
    assert main(["dlq", "show", "feedface", "--config", str(config)]) == 1
    assert "no dead letter with id 'feedface'" in capsys.readouterr().err


def test_dlq_show_accepts_a_unique_id_prefix(tmp_path, capsys):
    """'dlq show' of the first characters of one record's id prints that record."""
    config = _sqlite_config(tmp_path)
    first, second = _add_records(tmp_path / "dead.sqlite3", 2)
    prefix = next(
        second.id[:n] for n in range(1, len(second.id)) if not first.id.startswith(second.id[:n])
    )
    assert main(["dlq", "show", prefix, "--config", str(config)]) == 0
    assert json.loads(capsys.readouterr().out) == second.to_dict()


def test_dlq_show_of_an_ambiguous_prefix_exits_2_naming_the_matches(tmp_path, capsys):
    """A prefix two ids share is a usage error (exit 2) that lists both ids."""
    store = tmp_path / "dead.sqlite3"
    config = _sqlite_config(tmp_path)
    _add_records(store, 0)
    kept = SQLiteDeadLetterStore(store)
    try:
        for record_id in ("abc123", "abc456", "def789"):
            task = Task(payload={"model_id": "default"})
            record = DeadLetter.from_task(
                task, endpoint="/inference", error="e", attempts=[], now=1_700_000_000.0
            )
            kept.add(dataclasses.replace(record, id=record_id))
    finally:
        kept.close()
    assert main(["dlq", "show", "abc", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "'abc' is ambiguous" in err and "abc123" in err and "abc456" in err
    assert "def789" not in err
    assert main(["dlq", "replay", "abc", "--config", str(config)]) == 2
    assert "'abc' is ambiguous" in capsys.readouterr().err


@pytest.mark.integration
def test_dlq_replay_accepts_a_unique_id_prefix(tmp_path, capsys):
    """'dlq replay PREFIX' replays the one record whose id starts with PREFIX."""
    store = tmp_path / "dead.sqlite3"
    first, second = _add_records(store, 2)
    prefix = next(
        second.id[:n] for n in range(1, len(second.id)) if not first.id.startswith(second.id[:n])
    )
    with LocalWorker(worker_id="a").start() as a:
        config = _sqlite_config(tmp_path, [("a", a.url)])
        assert main(["dlq", "replay", prefix, "--config", str(config), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["succeeded"] == [second.id]
    assert _stored_ids(store) == [first.id]


def test_status_reads_the_config_named_by_the_environment(tmp_path, capsys, monkeypatch):
    """'status' without CONFIG probes the pool $NPU_SYNC_CONFIG names."""
    config = _write_config(tmp_path / "pool.yaml")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NPU_SYNC_CONFIG", str(config))
    assert main(["status", "--json"]) == 1
    assert [row["id"] for row in json.loads(capsys.readouterr().out)] == ["a"]


def test_status_falls_back_to_npu_workers_yaml(tmp_path, capsys, monkeypatch):
    """Without CONFIG or $NPU_SYNC_CONFIG, 'status' reads ./npu_workers.yaml."""
    _write_config(tmp_path / "npu_workers.yaml")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NPU_SYNC_CONFIG", raising=False)
    assert main(["status", "--json"]) == 1
    assert [row["id"] for row in json.loads(capsys.readouterr().out)] == ["a"]


def test_status_without_any_config_probes_the_fallback_worker_and_says_so(
    tmp_path, capsys, monkeypatch
):
    """Without CONFIG, $NPU_SYNC_CONFIG or ./npu_workers.yaml, 'status' probes what
    get_pool() would run, the single worker at $NPU_WORKER_URL, and says it is the
    fallback mode and why."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NPU_SYNC_CONFIG", raising=False)
    with LocalWorker(worker_id="solo").start() as solo:
        monkeypatch.setenv("NPU_WORKER_URL", solo.url)
        assert main(["status"]) == 0
    captured = capsys.readouterr()
    assert "fallback mode: no configuration found" in captured.err
    assert solo.url in captured.err and "$NPU_WORKER_URL" in captured.err
    assert solo.url in captured.out and "1/1 enabled worker(s) healthy" in captured.out


def test_demo_summary_says_failures_were_retried_attempts():
    """The demo's summary counts failed attempts and says they were retried elsewhere."""
    out = io.StringIO()
    rows = [
        {
            "id": worker_id,
            "tasks": {"succeeded": 500, "failed": failed},
            "breaker": {"trips": 1, "state": "closed"},
            "latency": {"p50_ms": 1.0, "p99_ms": 2.0},
        }
        for worker_id, failed in (("a", 4), ("b", 2))
    ]
    outcomes = {"succeeded": 1000, "rejected": 0, "dead-lettered": 0, "unexplained": 0}
    cli._print_summary(out, rows, outcomes, 1000, 2.0, 0)
    assert "6 failed attempt(s), all retried on another worker" in out.getvalue()


@pytest.mark.integration
def test_dlq_replay_on_a_live_worker_empties_the_store(tmp_path, capsys):
    """'dlq replay' runs every record on the pool, exits 0 and leaves the store empty."""
    store = tmp_path / "dead.sqlite3"
    records = _add_records(store, 3)
    with LocalWorker(worker_id="a").start() as a:
        config = _sqlite_config(tmp_path, [("a", a.url)])
        assert main(["dlq", "replay", "--config", str(config)]) == 0
        served = a.stats()
    out = capsys.readouterr().out
    assert "replayed 3 dead letter(s): 3 succeeded, 0 failed, 0 rejected" in out
    assert all(f"succeeded  {record.id}" in out for record in records)
    assert _stored_ids(store) == []
    assert served["inference_count"] == 3


@pytest.mark.integration
def test_dlq_replay_of_one_id_leaves_the_others(tmp_path, capsys):
    """'dlq replay ID' replays that record only."""
    store = tmp_path / "dead.sqlite3"
    first, second = _add_records(store, 2)
    with LocalWorker(worker_id="a").start() as a:
        config = _sqlite_config(tmp_path, [("a", a.url)])
        assert main(["dlq", "replay", second.id, "--config", str(config), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["succeeded"] == [second.id] and report["failed"] == []
    assert report["results"][second.id]["model_id"] == "default"
    assert _stored_ids(store) == [first.id]


def test_dlq_replay_that_fails_again_exits_1_and_keeps_the_record(tmp_path, capsys):
    """A replay on a pool with no live worker exits 1; the record stays, its replays counted."""
    store = tmp_path / "dead.sqlite3"
    (record,) = _add_records(store, 1)
    config = _sqlite_config(tmp_path)
    assert main(["dlq", "replay", "--config", str(config)]) == 1
    out = capsys.readouterr().out
    assert "0 succeeded, 1 failed, 0 rejected" in out and f"failed     {record.id}" in out
    kept = SQLiteDeadLetterStore(store)
    try:
        assert kept.get(record.id).replays == 1
    finally:
        kept.close()


def test_dlq_replay_of_an_unknown_id_exits_1(tmp_path, capsys):
    """'dlq replay ID' of an id not in the store exits 1 without building a pool."""
    config = _sqlite_config(tmp_path)
    _add_records(tmp_path / "dead.sqlite3", 1)
    assert main(["dlq", "replay", "feedface", "--config", str(config)]) == 1
    assert "no dead letter with id 'feedface'" in capsys.readouterr().err


def test_dlq_replay_of_an_empty_store_exits_0(tmp_path, capsys):
    """Replaying an empty store is a message and exit 0."""
    config = _sqlite_config(tmp_path)
    _add_records(tmp_path / "dead.sqlite3", 0)
    assert main(["dlq", "replay", "--config", str(config)]) == 0
    assert "no dead letters to replay" in capsys.readouterr().out


def test_dlq_purge_yes_deletes_every_record(tmp_path, capsys):
    """'dlq purge --yes' removes every record without asking and exits 0."""
    store = tmp_path / "dead.sqlite3"
    _add_records(store, 3)
    config = _sqlite_config(tmp_path)
    assert main(["dlq", "purge", "--yes", "--config", str(config)]) == 0
    assert "purged 3 record(s)" in capsys.readouterr().out
    assert _stored_ids(store) == []


def test_dlq_purge_without_yes_and_no_terminal_refuses(tmp_path, capsys, monkeypatch):
    """Without --yes and with no TTY to ask on, 'purge' exits 2 and deletes nothing."""
    store = tmp_path / "dead.sqlite3"
    records = _add_records(store, 2)
    config = _sqlite_config(tmp_path)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    assert main(["dlq", "purge", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "refusing to purge 2 record(s)" in err and "--yes" in err
    assert _stored_ids(store) == [r.id for r in records]


@pytest.mark.parametrize(("answer", "code", "left"), [("y\n", 0, 0), ("n\n", 1, 2), ("", 1, 2)])
def test_dlq_purge_asks_on_a_terminal(tmp_path, capsys, monkeypatch, answer, code, left):
    """On a TTY 'purge' asks 'purge N records? [y/N]'; only yes deletes."""
    store = tmp_path / "dead.sqlite3"
    _add_records(store, 2)
    config = _sqlite_config(tmp_path)
    monkeypatch.setattr(sys, "stdin", _Terminal(answer))
    assert main(["dlq", "purge", "--config", str(config)]) == code
    assert "purge 2 records? [y/N]" in capsys.readouterr().out
    assert len(_stored_ids(store)) == left


def test_check_probe_reports_an_entry_that_is_not_an_npu_worker(tmp_path, capsys):
    """'check --probe': a wrong base path is named, with both answers; a good entry is not."""
    with LocalWorker(worker_id="a").start() as worker:
        path = tmp_path / "fleet.yaml"
        path.write_text(
            "npu_workers:\n  workers:\n"
            f"    - {{id: good, url: '{worker.url}'}}\n"
            f"    - {{id: wrong, url: '{worker.url}/npu'}}\n"
        )
        assert main(["check", str(path)]) == 0  # the file itself is fine
        capsys.readouterr()
        assert main(["check", "--probe", str(path)]) == 2
        worker_stats = worker.stats()
    err = capsys.readouterr().err
    wrong = f"npu_workers.workers[1] (wrong, {worker.url}/npu): "
    assert (
        f"{wrong}health check failed: not an NPU worker at this URL: GET /npu/health → 404" in err
    )
    assert f"{wrong}not an NPU worker at this URL: POST /npu/inference → 404" in err
    assert "workers[0]" not in err
    assert worker_stats["inference_count"] == 0  # the probe's empty task runs nothing


# Attacks on the CLI: hostile text in a stored record, a spool directory others may write
# to, another application's database.


HOSTILE = "\x1b]0;owned\x07\x1b[2J\r\b\u202e"


def test_hostile_text_stored_in_a_record_reaches_no_terminal_through_the_cli(tmp_path, capsys):
    """A record whose id, task id, error and attempts hold escape sequences (written
    into the file by an older npu_sync or another tool): `npu-sync dlq list`, `show`,
    `list --json` and `replay` print them escaped."""
    import sqlite3

    from npu_sync._deadletter import SQLiteDeadLetterStore

    store = tmp_path / "dead.sqlite3"
    SQLiteDeadLetterStore(store).close()
    with sqlite3.connect(store) as conn:
        conn.execute(
            "INSERT INTO dead_letters (id, task_id, payload, endpoint, idempotent, timeout,"
            " error, attempts, first_attempt_at, last_attempt_at, created_at)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (
                "id" + HOSTILE,
                "task" + HOSTILE,
                json.dumps({"input_text": HOSTILE}),
                "/inference",
                1,
                1.0,
                "error" + HOSTILE,
                json.dumps([{"worker_id": "w" + HOSTILE, "error": HOSTILE, "duration": 0.1}]),
                1.0,
                1.0,
                1.0,
            ),
        )
    conn.close()
    path = tmp_path / "pool.yaml"
    path.write_text(
        "npu_workers:\n  workers: [{id: w0, url: 'http://127.0.0.1:9'}]\n"
        "  health: {enabled: false}\n  retry: {max_retries: 0}\n"
        f"  dead_letter: {{backend: sqlite, path: '{store}'}}\n"
    )
    for argv in (
        ["dlq", "list"],
        ["dlq", "list", "--json"],
        ["dlq", "show", "id" + HOSTILE],
        ["dlq", "replay"],
    ):
        main([*argv, "--config", str(path)])
        out, err = capsys.readouterr()
        assert "id" in out, argv
        for char in ("\x1b", "\x07", "\r", "\b", "\u202e"):
            assert char not in out + err, f"{char!r} reached the terminal via {argv}"


def test_check_refuses_a_default_spool_directory_others_may_write_to(tmp_path, monkeypatch, capsys):
    """The default Redis spool's directory exists, world-writable: start-up refuses it,
    so `npu-sync check` must too (exit 2, the key named), not answer ok."""
    import tempfile

    from npu_sync._deadletter import default_spool_path

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    spool_dir = os.path.dirname(default_spool_path("npu_sync"))
    os.makedirs(spool_dir)
    os.chmod(spool_dir, 0o777)
    path = tmp_path / "pool.yaml"
    path.write_text(
        "npu_workers:\n  workers: [{id: w0, url: 'http://127.0.0.1:9'}]\n"
        "  shared_state: {backend: redis, url: 'redis://127.0.0.1:1/0'}\n"
        "  dead_letter: {backend: redis}\n"
    )
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "npu_workers.dead_letter.spool_path:" in err
    assert "others may write to it" in err
    os.chmod(spool_dir, 0o700)
    assert main(["check", str(path)]) == 0


@pytest.mark.parametrize(
    "schema",
    ["CREATE TABLE users (id INTEGER PRIMARY KEY, email TEXT)", "CREATE TABLE dead_letters (x)"],
    ids=["other-tables", "same-table-name"],
)
def test_another_applications_database_is_neither_adopted_nor_passed_by_check(
    tmp_path, capsys, schema
):
    """dead_letter.path names another application's SQLite file: `npu-sync check` says
    so (exit 2), and the pool refuses it at start instead of writing task payloads into
    that database, or failing with a bare 'table already exists'."""
    import sqlite3

    store = tmp_path / "app.sqlite3"
    with sqlite3.connect(store) as conn:
        conn.execute(schema)
    conn.close()
    path = tmp_path / "pool.yaml"
    path.write_text(
        "npu_workers:\n  workers: [{id: w0, url: 'http://127.0.0.1:9'}]\n"
        f"  dead_letter: {{backend: sqlite, path: '{store}'}}\n"
    )
    assert main(["check", str(path)]) == 2
    assert "npu_workers.dead_letter.path:" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="a database of something else"):
        WorkerPool.from_yaml(path, watch=False)
    with sqlite3.connect(store) as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
    conn.close()
    assert "dead_letter_meta" not in tables
