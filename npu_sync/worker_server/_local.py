"""A reference worker in a child process, driven from Python: :class:`LocalWorker`."""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import selectors
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

_log = logging.getLogger("npu_sync.worker_server")  # one logger for the whole worker

_READY_LINE = re.compile(r"^npu-sync worker (\S+) listening on (https?)://(\S+):(\d+)\s*$")

# The directory npu_sync is in (npu_sync/worker_server/_local.py -> its grandparent's parent).
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
# How LocalWorker hands its child the secrets: environment variables, which other users
# cannot read, unlike a command line.
_CHILD_HMAC_ENV = "NPU_SYNC_LOCAL_WORKER_HMAC_SECRET"
_CHILD_BEARER_ENV = "NPU_SYNC_LOCAL_WORKER_BEARER_TOKEN"


class LocalWorker:
    """A reference worker in a child process, for tests, benchmarks and the demo.

    Not thread-safe: start, stop, kill, pause and restart it from one thread.
    ``control`` and ``stats`` open their own connection and may run in any thread.

    Args:
        port: port to bind; 0 picks a free one, which ``restart`` then reuses.
        worker_id: reported in the worker's answers.
        latency_ms, jitter_ms, failure_rate: initial behaviour; see WorkerBehaviour.
        models: model ids served; ``"*"`` serves any.
        max_concurrent: the load hint reported by ``/health``.
        protocol: ``"linux"`` or ``"windows"`` (see :class:`WorkerServer`).
        load_delay_ms, npu_available, max_models: initial behaviour; see WorkerBehaviour.
        slots: tasks inferred at once, the rest queued (see :class:`WorkerServer`).
        hmac_auth: ``(service_id, secret)`` the worker requires signatures with; the
            secret reaches the child through its environment, not its command line.
        bearer_token: the bearer token the worker requires (passed the same way).
        tls_cert, tls_key: serve HTTPS with these PEM files.
        extra_args: more command-line flags (see :func:`build_arg_parser`).
        startup_timeout: seconds to wait for the worker to report it is listening.
        client_ssl_context: used by ``control`` and ``stats`` over HTTPS; by default
            the worker's certificate is not verified (it is this process's own child).
    """

    def __init__(
        self,
        port: int = 0,
        *,
        worker_id: str = "worker",
        latency_ms: float = 0.0,
        jitter_ms: float = 0.0,
        failure_rate: float = 0.0,
        models: Sequence[str] = ("default",),
        max_concurrent: int = 64,
        protocol: str = "linux",
        load_delay_ms: float = 0.0,
        npu_available: bool = True,
        slots: int | None = None,
        max_models: int | None = None,
        hmac_auth: tuple[str, str] | None = None,
        bearer_token: str | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 60.0,
        client_ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if isinstance(models, str):
            models = (models,)
        self.worker_id = worker_id
        self.protocol = protocol
        self._port = port
        self._scheme = "https" if tls_cert is not None else "http"
        self._args = [
            "--host", "127.0.0.1",
            "--worker-id", worker_id,
            "--latency-ms", repr(float(latency_ms)),
            "--jitter-ms", repr(float(jitter_ms)),
            "--failure-rate", repr(float(failure_rate)),
            "--models", ",".join(models),
            "--max-concurrent", str(max_concurrent),
            "--protocol", protocol,
            "--load-delay-ms", repr(float(load_delay_ms)),
        ]  # fmt: skip
        if not npu_available:
            self._args.append("--no-npu")
        if slots is not None:
            self._args += ["--slots", str(slots)]
        if max_models is not None:
            self._args += ["--max-models", str(max_models)]
        self._secrets: dict[str, str] = {}
        if hmac_auth is not None:
            self._args += ["--hmac-service-id", hmac_auth[0], "--hmac-secret-env", _CHILD_HMAC_ENV]
            self._secrets[_CHILD_HMAC_ENV] = hmac_auth[1]
        if bearer_token is not None:
            self._args += ["--bearer-token-env", _CHILD_BEARER_ENV]
            self._secrets[_CHILD_BEARER_ENV] = bearer_token
        if tls_cert is not None:
            self._args += ["--tls-cert", os.fspath(tls_cert)]
        if tls_key is not None:
            self._args += ["--tls-key", os.fspath(tls_key)]
        self._args += list(extra_args)
        self._startup_timeout = startup_timeout
        self._client_ssl_context = client_ssl_context
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None
        self._paused = False
        self.returncode: int | None = None
        """Exit code of the last child that ended (negative: killed by that signal)."""

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"{self._scheme}://127.0.0.1:{self._port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> LocalWorker:
        """Spawn the worker and wait until it listens.

        Returns:
            self.

        Raises:
            RuntimeError: if it is already running, or did not report listening within
                ``startup_timeout`` (the message carries the child's stderr).
        """
        if self.running:
            raise RuntimeError(f"worker {self.worker_id} is already running")
        self._reap()
        command = [
            sys.executable, "-m", "npu_sync.worker_server", "--port", str(self._port), *self._args
        ]  # fmt: skip
        env = dict(os.environ)
        # The child must import this same npu_sync, installed or not.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p
        )
        env.update(self._secrets)
        # Outlives this call: it holds the child's stderr until the child is reaped.
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115
        self._paused = False
        self._proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._stderr, env=env
        )
        try:
            line = self._read_ready_line(self._proc)
        except RuntimeError:
            self._proc.kill()
            self._proc.wait()
            self._reap()
            raise
        match = _READY_LINE.match(line)
        if match is None:  # pragma: no cover - the child prints exactly this line
            self.stop()
            raise RuntimeError(f"worker {self.worker_id} printed an unexpected line: {line!r}")
        self._scheme = match.group(2)
        self._port = int(match.group(4))
        _log.debug("worker %s (pid %d) listening on %s", self.worker_id, self._proc.pid, self.url)
        return self

    def _read_ready_line(self, proc: subprocess.Popen[bytes]) -> str:
        assert proc.stdout is not None
        deadline = time.monotonic() + self._startup_timeout
        buffer = b""
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(proc.stdout, selectors.EVENT_READ)
                while b"\n" not in buffer:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise RuntimeError(self._startup_failure("did not start in time"))
                    if not selector.select(remaining):
                        continue
                    chunk = os.read(proc.stdout.fileno(), 4096)
                    if not chunk:
                        proc.wait()
                        raise RuntimeError(
                            self._startup_failure(f"exited with code {proc.returncode}")
                        )
                    buffer += chunk
        finally:
            # The worker prints nothing after the ready line, so the pipe is done with.
            proc.stdout.close()
        return buffer.partition(b"\n")[0].decode(errors="replace")

    def _startup_failure(self, what: str) -> str:
        return f"worker {self.worker_id} {what}; stderr:\n{self._stderr_text()}"

    def _stderr_text(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def _reap(self) -> None:
        if self._proc is not None and self._proc.returncode is not None:
            self.returncode = self._proc.returncode
            self._proc = None
        if self._proc is None and self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def kill(self) -> None:
        """SIGKILL the worker and reap it."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._reap()

    def pause(self) -> None:
        """Freeze the worker (SIGSTOP): connections are accepted by the kernel, not answered."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGSTOP)
            self._paused = True
            # The signal is delivered when the child is next scheduled: on a loaded
            # machine it could still answer a request sent right after this returns.
            # Wait until the kernel reports it stopped (or gone), reaping nothing.
            if hasattr(os, "waitid"):
                os.waitid(os.P_PID, self._proc.pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)

    def resume(self) -> None:
        """Thaw a frozen worker (SIGCONT)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)
        self._paused = False

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM the worker and wait; SIGKILL it after ``timeout``. Idempotent."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            if self._paused:
                self.resume()
            self._proc.terminate()
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _log.warning("worker %s ignored SIGTERM; killing it", self.worker_id)
                self._proc.kill()
                self._proc.wait()
        self._reap()

    def restart(self) -> LocalWorker:
        """Stop the worker if running and start it again on the same port.

        Returns:
            self.
        """
        self.stop()
        return self.start()

    def _request(self, method: str, path: str, body: object = None, timeout: float = 10.0) -> Any:
        connection: http.client.HTTPConnection
        if self._scheme == "https":
            context = self._client_ssl_context
            if context is None:
                context = ssl.create_default_context()
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            connection = http.client.HTTPSConnection(
                "127.0.0.1", self._port, timeout=timeout, context=context
            )
        else:
            connection = http.client.HTTPConnection("127.0.0.1", self._port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if data is not None else {}
            connection.request(method, path, body=data, headers=headers)
            response = connection.getresponse()
            payload = json.loads(response.read())
        finally:
            connection.close()
        if response.status == 422:
            raise ValueError(payload.get("detail", payload))
        if response.status != 200:
            raise RuntimeError(f"worker {self.worker_id}: {method} {path} -> {response.status}")
        return payload

    def control(self, **changes: Any) -> dict[str, Any]:
        """Change the running worker's behaviour (see WorkerBehaviour).

        Returns:
            The worker's new settings.

        Raises:
            ValueError: on an unknown setting or invalid value.
        """
        result: dict[str, Any] = self._request("POST", "/_control", changes)
        return result

    def stats(self) -> dict[str, Any]:
        """The worker's counters (``GET /stats``)."""
        result: dict[str, Any] = self._request("GET", "/stats")
        return result

    def __enter__(self) -> LocalWorker:
        if not self.running:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalWorker(worker_id={self.worker_id!r}, url={self.url!r}, pid={self.pid})"
