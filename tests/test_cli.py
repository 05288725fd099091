"""The npu-sync command: exit codes and messages."""

from __future__ import annotations

import subprocess
import sys

import pytest

from npu_sync.cli import main


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
