"""The reference worker served from threads of this process."""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from npu_sync._clock import SYSTEM_CLOCK, Clock
from npu_sync.auth import HmacVerifier
from npu_sync.worker_server._behaviour import WorkerBehaviour
from npu_sync.worker_server._handler import WorkerHTTPServer
from npu_sync.worker_server._models import PROTOCOLS, check_models
from npu_sync.worker_server._state import WorkerState

_log = logging.getLogger("npu_sync.worker_server")  # one logger for the whole worker


def _server_ssl_context(
    cert: str | os.PathLike[str],
    key: str | os.PathLike[str] | None,
    client_ca: str | os.PathLike[str] | None,
) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    if client_ca is not None:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class WorkerServer:
    """A reference worker served from threads of this process.

    Thread-safe: ``update``, ``stats``, ``wait_until`` and ``stop`` may be called from
    any thread while requests are served.

    Args:
        host: address to bind; loopback by default.
        port: port to bind; 0 picks a free one (read it from ``port`` after ``start``).
        worker_id: reported in every answer.
        models: model ids served; ``"*"`` serves any.
        max_concurrent: the load hint reported by ``/health``.
        behaviour: initial behaviour; change it later with ``update``.
        seed: seeds jitter and simulated failures, for repeatable runs.
        tls_cert: PEM certificate chain (may include the key); serves HTTPS when given.
        tls_key: PEM private key, when not in ``tls_cert``.
        tls_client_ca: PEM CA bundle; when given, clients must present a certificate.
        clock: the clock latency and loads are waited on, and signatures checked
            against; a FakeClock makes latency instant.
        verbose: log one line per request to stderr.
        protocol: ``"linux"`` or ``"windows"``: which AutoBot worker to simulate.
        hmac_auth: ``(service_id, secret)``: every request but ``/stats`` and
            ``/_control`` must carry a valid AutoBot HMAC signature, or gets 401.
        bearer_token: every request but ``/stats`` and ``/_control`` must carry
            ``Authorization: Bearer <token>``, or gets 401.
        slots: at most this many tasks run their latency at once, the others queue
            for a slot (an NPU with that many parallel slots); None: no limit.

    Raises:
        ValueError: on an invalid argument.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        worker_id: str = "worker",
        models: Sequence[str] = ("default",),
        max_concurrent: int = 8,
        behaviour: WorkerBehaviour | None = None,
        seed: int | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_client_ca: str | os.PathLike[str] | None = None,
        clock: Clock | None = None,
        verbose: bool = False,
        protocol: str = "linux",
        hmac_auth: tuple[str, str] | None = None,
        bearer_token: str | None = None,
        slots: int | None = None,
    ) -> None:
        if isinstance(models, str):
            models = (models,)
        if slots is not None and (
            isinstance(slots, bool) or not isinstance(slots, int) or slots < 1
        ):
            raise ValueError(f"slots: must be an integer >= 1, got {slots!r}")
        if not all(isinstance(m, str) and m for m in models):
            raise ValueError(f"models: must be non-empty strings, got {models!r}")
        models = check_models(list(models))
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol: must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        if isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int):
            raise ValueError(f"max_concurrent: must be an integer, got {max_concurrent!r}")
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent: must be >= 1, got {max_concurrent}")
        if not 0 <= port <= 65535:
            raise ValueError(f"port: must be 0..65535, got {port}")
        if (tls_key is not None or tls_client_ca is not None) and tls_cert is None:
            raise ValueError("tls_key and tls_client_ca need tls_cert")
        clock = clock or SYSTEM_CLOCK
        self._verifier = None
        if hmac_auth is not None:
            service_id, secret = hmac_auth
            self._verifier = HmacVerifier(service_id, secret, clock=clock.time)
        if bearer_token is not None and (
            not isinstance(bearer_token, str)
            or not bearer_token
            or not (bearer_token.isascii() and bearer_token.isprintable())
        ):
            # The token itself is never quoted.
            raise ValueError("bearer_token: must be a non-empty printable ASCII string")
        self._bearer = bearer_token
        self._host = host
        self._port = port
        self._tls = (tls_cert, tls_key, tls_client_ca)
        self._verbose = verbose
        self._state = WorkerState(
            worker_id=worker_id,
            models=models,
            max_concurrent=max_concurrent,
            behaviour=behaviour or WorkerBehaviour(),
            seed=seed,
            clock=clock,
            protocol=protocol,
            slots=slots,
        )
        self._server: WorkerHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lifecycle = threading.Lock()
        self._stopped = False

    @property
    def worker_id(self) -> str:
        return self._state.worker_id

    @property
    def port(self) -> int:
        """The bound port once started; until then the port asked for."""
        return self._port

    @property
    def scheme(self) -> str:
        return "https" if self._tls[0] is not None else "http"

    @property
    def url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{self.scheme}://{host}:{self._port}"

    @property
    def behaviour(self) -> WorkerBehaviour:
        return self._state.behaviour

    @property
    def protocol(self) -> str:
        return self._state.protocol

    @property
    def models(self) -> list[str]:
        """The loaded model ids, then ``"*"`` if any model is loaded on first use."""
        return self._state.models()

    def start(self) -> None:
        """Bind and serve in a named daemon thread.

        Raises:
            RuntimeError: if already started or stopped.
            OSError: if the address cannot be bound.
            ssl.SSLError: if the TLS files cannot be loaded.
        """
        with self._lifecycle:
            if self._server is not None or self._stopped:
                raise RuntimeError(f"worker {self.worker_id} was already started")
            cert, key, client_ca = self._tls
            context = _server_ssl_context(cert, key, client_ca) if cert is not None else None
            name = f"npu-sync-worker-{self.worker_id}"
            server = WorkerHTTPServer(
                (self._host, self._port),
                state=self._state,
                ssl_context=context,
                verbose=self._verbose,
                thread_name=name,
                verifier=self._verifier,
                bearer=self._bearer,
            )
            self._port = server.server_port
            # A short poll interval so that stop() returns within tens of milliseconds.
            self._thread = threading.Thread(
                target=server.serve_forever, kwargs={"poll_interval": 0.05}, name=name, daemon=True
            )
            self._server = server
            self._thread.start()
        _log.info("worker %s listening on %s", self.worker_id, self.url)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving: drop hung and open connections and join every thread. Idempotent."""
        with self._lifecycle:
            self._stopped = True
            server, thread = self._server, self._thread
            self._server = self._thread = None
        if server is None or thread is None:
            return
        deadline = time.monotonic() + timeout
        self._state.release()
        server.shutdown()
        connection_threads = server.close_connections()
        server.server_close()
        for t in [thread, *connection_threads]:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                _log.warning("worker %s: thread %s did not stop in time", self.worker_id, t.name)

    def update(self, **changes: Any) -> WorkerBehaviour:
        """Change the behaviour of the running worker.

        Besides the :class:`WorkerBehaviour` fields, ``models=[...]`` loads exactly those
        models at once (``"*"`` included), unloading the others.

        Returns:
            The new behaviour.

        Raises:
            ValueError: on an unknown setting or an invalid value; nothing changes then.
        """
        return self._state.update(changes)

    def stats(self) -> dict[str, Any]:
        """Counters: requests by path, responses by status, task ids and duplicates seen,
        in flight and the most in flight at once, connections, inference count."""
        return self._state.stats()

    def wait_until(self, predicate: Callable[[dict[str, Any]], bool], timeout: float) -> bool:
        """Block until ``predicate(self.stats())`` holds, re-checking on every counter change.

        Returns:
            Whether it held before ``timeout`` seconds passed.
        """
        return self._state.wait_until(predicate, timeout)

    def __enter__(self) -> WorkerServer:
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
        return f"WorkerServer(worker_id={self.worker_id!r}, url={self.url!r})"
