"""Tests of LocalWorker: the reference worker in a real child process, killed, frozen,
restarted, driven over HTTP, and keeping its secrets off its command line."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from npu_sync.worker_server import LocalWorker
from tests.workerkit import SERVICE, call, in_background, infer, signed_call, win_task


@pytest.mark.integration
def test_local_worker_kill_and_restart_on_the_same_port() -> None:
    """A LocalWorker serves, dies on kill() (reaped), and restarts on the same port."""
    worker = LocalWorker(worker_id="lw1", latency_ms=1.0)
    with worker:
        assert worker.running and worker.pid is not None
        first = infer(worker)
        assert first.status == 200 and first.json["worker_id"] == "lw1"
        port = worker.port
        assert worker.url == f"http://127.0.0.1:{port}"
        pid = worker.pid
        worker.kill()
        assert not worker.running and worker.pid is None
        assert worker.returncode == -9
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped, not a zombie
        with pytest.raises(ConnectionRefusedError):
            infer(worker)
        worker.restart()
        assert worker.port == port
        assert infer(worker).json["inference_count"] == 1  # a fresh process
    assert not worker.running
    assert worker.returncode == 0  # SIGTERM is a graceful stop


@pytest.mark.integration
def test_local_worker_pause_freezes_until_resume() -> None:
    """A paused worker answers nothing; a request sent meanwhile completes after resume."""
    with LocalWorker(worker_id="lw2") as worker:
        assert infer(worker).status == 200
        worker.pause()
        pending, outcome = in_background(lambda: infer(worker, timeout=30))
        with pytest.raises(TimeoutError):
            call(worker, "GET", "/health", timeout=0.3)
        assert pending.is_alive()
        worker.resume()
        pending.join(30)
        assert outcome["result"].status == 200


@pytest.mark.integration
@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_local_worker_pause_returns_once_the_child_is_stopped() -> None:
    """SIGSTOP takes effect when the child is next scheduled; pause() returns only once
    the kernel reports it stopped, so no request sent after it is answered. Checked
    on each of twenty pause/resume cycles, right after pause() returns."""

    def state(pid: int) -> str:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]

    with LocalWorker(worker_id="lw5") as worker:
        assert infer(worker).status == 200
        pid = worker.pid
        for _ in range(20):
            worker.pause()
            assert state(pid) in ("T", "t")
            worker.resume()
        assert infer(worker).status == 200


@pytest.mark.integration
def test_local_worker_control_and_stats() -> None:
    """control() changes the child's behaviour and stats() reads its counters."""
    with LocalWorker(worker_id="lw3", models=("*",)) as worker:
        settings = worker.control(fail_all=True)
        assert settings["fail_all"] is True
        assert infer(worker).status == 500
        assert call(worker, "GET", "/health").status == 200
        with pytest.raises(ValueError, match="failure_rate"):
            worker.control(failure_rate=3)
        stats = worker.stats()
        assert stats["worker_id"] == "lw3"
        assert stats["responses"] == {"200": 2, "422": 1, "500": 1}


@pytest.mark.integration
def test_local_worker_reports_startup_failure_with_stderr() -> None:
    """A worker that cannot start raises RuntimeError carrying the child's stderr."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        worker = LocalWorker(taken.getsockname()[1], worker_id="lw4")
        with pytest.raises(RuntimeError, match="cannot serve") as info:
            worker.start()
    assert "lw4" in str(info.value)
    assert not worker.running


@pytest.mark.integration
def test_local_worker_speaks_windows_with_hmac_and_keeps_the_secret_off_argv() -> None:
    """A LocalWorker child speaks the Windows protocol, verifies HMAC with the secret from
    its environment (never its command line), and unloads models on control()."""
    with LocalWorker(
        worker_id="lw-win", protocol="windows", models=("a", "b"), hmac_auth=SERVICE
    ) as worker:
        assert worker.pid is not None
        cmdline = Path(f"/proc/{worker.pid}/cmdline").read_bytes()
        assert SERVICE[1].encode() not in cmdline
        assert call(worker, "POST", "/inference", win_task(model="a")).status == 401
        done = signed_call(worker, "POST", "/inference", win_task(model="a"))
        assert done.json["status"] == "completed"
        assert worker.control(models=["b"])["models"] == ["b"]
        gone = signed_call(worker, "POST", "/inference", win_task(model="a"))
        assert gone.json == {**gone.json, "status": "failed", "error": "Model a not loaded"}
        health = signed_call(worker, "GET", "/health").json
        assert health["loaded_models"] == ["b"] and health["platform"] == "windows"


@pytest.mark.integration
def test_local_worker_child_imports_this_same_npu_sync() -> None:
    """The child's path starts with the directory this process's npu_sync is in, so a
    LocalWorker runs the tree under test, installed or not, from wherever it lives."""
    import npu_sync

    with LocalWorker(worker_id="lw-tree") as worker:
        assert worker.pid is not None
        environ = Path(f"/proc/{worker.pid}/environ").read_bytes().split(b"\0")
        path = next(v for v in environ if v.startswith(b"PYTHONPATH=")).split(b"=", 1)[1]
        first = Path(os.fsdecode(path).split(os.pathsep)[0])
        assert first == Path(npu_sync.__file__).resolve().parent.parent
        assert infer(worker).status == 200
