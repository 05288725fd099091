"""The README's example runs as written (ports swapped for free ones)."""

from __future__ import annotations

import pathlib
import re
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_ten_lines_run_against_two_reference_workers(start_worker, tmp_path):
    """The YAML and Python of the README work against two live workers."""
    (yaml_text,) = blocks("yaml")
    (code,) = blocks("python")
    primary = start_worker(worker_id="vm2-npu")
    backup = start_worker(worker_id="backup-npu")
    yaml_text = yaml_text.replace("port: 8081", f"port: {primary.port}")
    yaml_text = yaml_text.replace("127.0.0.1:8082", f"127.0.0.1:{backup.port}")
    (tmp_path / "npu_workers.yaml").write_text(yaml_text)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "'worker_id': 'vm2-npu'" in lines[0]  # priority 1 is preferred
    assert lines[1].count("'response'") == 3
    # execute, three from map, the non-idempotent task and shout: six successes
    assert "'succeeded': 6" in lines[-1]
    assert (tmp_path / "npu_dead_letters.sqlite3").exists()


def test_readme_ten_lines_with_the_workers_stopped_take_both_failure_branches(tmp_path):
    """With no worker listening, the README's code dead-letters, prints it and falls back."""
    (yaml_text,) = blocks("yaml")
    (code,) = blocks("python")
    with socket.socket() as one, socket.socket() as two:
        # Bound but never listening: connections to these ports are refused.
        one.bind(("127.0.0.1", 0))
        two.bind(("127.0.0.1", 0))
        yaml_text = yaml_text.replace("port: 8081", f"port: {one.getsockname()[1]}")
        yaml_text = yaml_text.replace("127.0.0.1:8082", f"127.0.0.1:{two.getsockname()[1]}")
        (tmp_path / "npu_workers.yaml").write_text(yaml_text)
        logging_on = "import logging; logging.basicConfig(level=logging.INFO)\n"
        proc = subprocess.run(
            [sys.executable, "-c", logging_on + code],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("dead letter ") and "connection refused" in lines[0].lower()
    assert lines[-1].startswith("{'response': 'HELLO'}")
    assert "'failed': 1" in lines[-1] and "'fallbacks': 1" in lines[-1]
    assert "task.dead_lettered" in proc.stderr and "task.fallback" in proc.stderr
