"""Fixtures that start real reference workers as child processes on loopback ports."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from npu_sync.worker_server import LocalWorker


@pytest.fixture
def private_temp_dir(tmp_path, monkeypatch) -> None:
    """Default dead-letter spools, in this process and its children, go under tmp_path
    (a test file opts in with ``pytest.mark.usefixtures("private_temp_dir")``)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@pytest.fixture
def start_worker() -> Iterator[Callable[..., LocalWorker]]:
    """Start a LocalWorker; every one started is stopped at teardown."""
    started: list[LocalWorker] = []

    def start(**kwargs: Any) -> LocalWorker:
        worker = LocalWorker(**kwargs).start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


class RedisServer:
    """A real redis-server on a free loopback port, which tests may kill and restart."""

    def __init__(self, directory: str, *options: str) -> None:
        """``options`` are more redis-server arguments (``"--appendonly", "yes"``), which
        override the defaults and stay in force across a kill and restart."""
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.directory = directory
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.options = options
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [
                shutil.which("redis-server") or "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.directory,
                "--protected-mode",
                "yes",
                *self.options,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5)
        # Generous: on a loaded machine a server can take seconds to answer its first
        # ping; one that exits is reported by the wait on its process below.
        deadline = time.monotonic() + 60
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited with code {self.proc.returncode}"
                    ) from None
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                threading.Event().wait(0.02)
        client.close()
        return self

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def flush(self) -> None:
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port)
        client.flushall()
        client.close()


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    """A fresh redis-server for one test (skipped when redis-server is not installed)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/run installs Debian's redis-server)")
    pytest.importorskip("redis")
    server = RedisServer(str(tmp_path)).start()
    yield server
    server.kill()
