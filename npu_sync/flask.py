"""Flask integration: the ``NpuSync`` extension, its JSON endpoints and the status page.

The only module that imports Flask (the ``flask`` extra: ``pip install -e '.[flask]'``
from a clone). See docs/flask.md.
"""

from __future__ import annotations

import atexit
import base64
import difflib
import functools
import hashlib
import hmac
import importlib.resources
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, ParamSpec, TypeVar

from npu_sync.errors import ConfigError, NpuSyncError, PoolClosed, install_hint, printable

try:
    from flask import Blueprint, Flask, Response, current_app, jsonify, request
    from werkzeug.exceptions import HTTPException
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(f"npu_sync.flask needs Flask: {install_hint('flask')}") from exc
from npu_sync._fleet import monitor_of
from npu_sync._pool import WorkerPool, adopt_default_pool, get_pool
from npu_sync.task import Task, priority_scope

log = logging.getLogger(__name__)

__all__ = [
    "NpuSync",
    "current_pool",
    "npu_priority",
]

EXTENSION_KEY = "npu_sync"
"""The key of the extension's state in ``app.extensions``; also the blueprint's name."""

DEFAULT_URL_PREFIX = "/api/npu/pool"
DEFAULT_REFRESH_MS = 2000
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000

_MAX_BODY_BYTES = 64 * 1024
_ALL_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")
_DIGITS = re.compile(r"[0-9]{1,9}")
_PREFIX = re.compile(r"(/[A-Za-z0-9._~-]+)+")
_NO_STORE = {"Cache-Control": "no-store"}
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})
_PROMETHEUS_HINT = install_hint("prometheus")

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class _State:
    """What one app's extension holds in ``app.extensions["npu_sync"]``. Immutable."""

    pool: WorkerPool | None
    url_prefix: str
    refresh_ms: int
    prometheus: bool = False

    def get_pool(self) -> WorkerPool:
        return self.pool if self.pool is not None else get_pool()


class NpuSync:
    """The npu_sync Flask extension: JSON endpoints and a status page for a pool.

    Thread-safe: the object keeps no per-app state (that lives in
    ``app.extensions["npu_sync"]``), so one instance may serve several apps.

    The pool is, in order: the one passed here (never closed by the extension); one
    built from ``app.config["NPU_SYNC_CONFIG"]`` (closed when the process exits); else
    the process-wide :func:`npu_sync.get_pool`, looked up on each use.

    Args:
        app: initialise this app now; or call :meth:`init_app` later.
        pool: the pool to serve, shared by every app this extension initialises.
    """

    def __init__(self, app: Flask | None = None, pool: WorkerPool | None = None) -> None:
        self._pool = pool
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Register the endpoints on ``app`` and attach its pool.

        Reads ``NPU_SYNC_CONFIG``, ``NPU_SYNC_WATCH``, ``NPU_SYNC_URL_PREFIX``,
        ``NPU_SYNC_REFRESH_MS``, ``NPU_SYNC_ADMIN_TOKEN`` and ``NPU_SYNC_PROMETHEUS``
        from ``app.config`` (the last also from the environment variable of that name).
        With ``NPU_SYNC_PROMETHEUS`` on, the pool is instrumented here, at start-up.

        Raises:
            RuntimeError: the extension is already registered on ``app``.
            ValueError: a ``NPU_SYNC_*`` setting has an unusable value.
            ConfigError: the YAML file named by ``NPU_SYNC_CONFIG`` is invalid.
            ImportError: ``NPU_SYNC_PROMETHEUS`` is on and prometheus_client is missing.
        """
        if EXTENSION_KEY in app.extensions:
            raise RuntimeError(
                "npu_sync is already registered on this app: call NpuSync(app) or "
                "init_app(app) once per app"
            )
        _warn_unknown_settings(app.config)
        prefix = _url_prefix(app.config.get("NPU_SYNC_URL_PREFIX", DEFAULT_URL_PREFIX))
        refresh_ms = _refresh_ms(app.config.get("NPU_SYNC_REFRESH_MS", DEFAULT_REFRESH_MS))
        token = app.config.get("NPU_SYNC_ADMIN_TOKEN")
        if token is not None and not isinstance(token, str):
            raise ValueError("NPU_SYNC_ADMIN_TOKEN must be a string or None")
        prometheus = _switch(
            "NPU_SYNC_PROMETHEUS",
            app.config.get("NPU_SYNC_PROMETHEUS", os.environ.get("NPU_SYNC_PROMETHEUS")),
        )
        if prometheus:
            try:
                from npu_sync.prometheus import exporter_for
            except ImportError as exc:
                raise ImportError(
                    "NPU_SYNC_PROMETHEUS is on but prometheus_client is not installed: "
                    + _PROMETHEUS_HINT
                ) from exc
        pool, owned = self._pool, False
        if pool is None:
            path = app.config.get("NPU_SYNC_CONFIG")
            if path:
                watch = bool(app.config.get("NPU_SYNC_WATCH", True))
                pool = WorkerPool.from_yaml(path, watch=watch)
                owned = True
                # @npu_task() and get_pool() in this process then use this same pool,
                # the one the endpoints, the status page and /metrics show.
                adopt_default_pool(pool, f"NPU_SYNC_CONFIG ({printable(str(path))})")
        try:
            app.register_blueprint(_blueprint(), url_prefix=prefix)
        except BaseException:
            if owned and pool is not None:
                pool.close()
            raise
        if owned and pool is not None:
            # The pool outlives requests and app contexts; it ends with the process.
            atexit.register(pool.close)
        state = _State(pool, prefix, refresh_ms, prometheus)
        if prometheus:
            # Now rather than at the first scrape: in multiprocess mode a process that is
            # never scraped must still write its metrics, and the histogram counts from here.
            exporter_for(state.get_pool())
        app.extensions[EXTENSION_KEY] = state


SETTINGS: frozenset[str] = frozenset(
    {
        "NPU_SYNC_CONFIG",
        "NPU_SYNC_WATCH",
        "NPU_SYNC_URL_PREFIX",
        "NPU_SYNC_REFRESH_MS",
        "NPU_SYNC_ADMIN_TOKEN",
        "NPU_SYNC_PROMETHEUS",
    }
)
"""The ``app.config`` keys the extension reads."""


def _warn_unknown_settings(config: Mapping[str, object]) -> None:
    # A misspelt key is otherwise silently ignored: NPU_SYNC_CONFG runs the app on the
    # process-wide default pool instead of the file it names.
    for key in sorted(k for k in config if isinstance(k, str) and k.startswith("NPU_SYNC_")):
        if key in SETTINGS:
            continue
        close = difflib.get_close_matches(key, sorted(SETTINGS), n=1)
        hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(sorted(SETTINGS))}"
        log.warning("unknown Flask setting %s is ignored (%s)", printable(key[:80]), hint)


def current_pool() -> WorkerPool:
    """The pool of the current Flask app, for use in views.

    Raises:
        RuntimeError: outside an app context, or the app has no NpuSync extension.
    """
    return _state().get_pool()


def npu_priority(name: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Give the tasks a view runs the priority class ``name`` (unless a task names its
    own): ``@app.get("/search") @npu_priority("interactive") def search(): ...``.

    Put it under the route decorator. Tasks handed to the pool while the view runs
    (``execute``, ``submit``, ``map``, decorated functions) take the class; see
    docs/priority.md.
    """
    Task({}, priority=name)  # a name of the wrong form fails at decoration

    def decorate(view: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(view)
        def scoped(*args: P.args, **kwargs: P.kwargs) -> R:
            with priority_scope(name):
                return view(*args, **kwargs)

        return scoped

    return decorate


def _state() -> _State:
    state = current_app.extensions.get(EXTENSION_KEY)
    if not isinstance(state, _State):
        raise RuntimeError(
            "npu_sync is not registered on this app: call NpuSync(app) or init_app(app)"
        )
    return state


def _url_prefix(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"NPU_SYNC_URL_PREFIX must be a string, got {type(value).__name__}")
    prefix = value.rstrip("/")
    if not _PREFIX.fullmatch(prefix):
        raise ValueError(
            "NPU_SYNC_URL_PREFIX must be a path such as /api/npu/pool "
            f"(segments of letters, digits, '.', '_', '~', '-'), got {value!r}"
        )
    return prefix


def _switch(key: str, value: object) -> bool:
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{key} must be true or false (or 1/0, yes/no, on/off), got {value!r}")


def _refresh_ms(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 250 <= value <= 3_600_000:
        raise ValueError(f"NPU_SYNC_REFRESH_MS must be an int from 250 to 3600000, got {value!r}")
    return value


# -- errors --------------------------------------------------------------------------------


class _ApiError(Exception):
    """Ends a request with a JSON error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        headers: Mapping[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})
        self.extra = extra


def _json(data: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    response = jsonify(data)
    response.status_code = status
    response.headers.update(_NO_STORE)
    if headers:
        response.headers.update(headers)
    return response


def _api_error(exc: _ApiError) -> Response:
    return _json({"error": exc.message, **exc.extra}, exc.status, exc.headers)


def _http_error(exc: HTTPException) -> Response:
    # Keep headers such as Allow, drop the HTML content type of werkzeug's page.
    headers = {k: v for k, v in exc.get_headers() if k.lower() != "content-type"}
    return _json({"error": exc.description or exc.name}, exc.code or 500, headers)


# -- auth ----------------------------------------------------------------------------------


def _admin_only(view: Callable[P, R]) -> Callable[P, R]:
    """Require ``Authorization: Bearer <NPU_SYNC_ADMIN_TOKEN>``; no token configured: 403."""

    @functools.wraps(view)
    def guarded(*args: P.args, **kwargs: P.kwargs) -> R:
        _check_admin()
        log.info("admin request %s %s from %s", request.method, request.path, request.remote_addr)
        return view(*args, **kwargs)

    return guarded


def _check_admin() -> None:
    expected = current_app.config.get("NPU_SYNC_ADMIN_TOKEN")
    if not expected or not isinstance(expected, str):
        log.warning(
            "refused %s %s from %s: NPU_SYNC_ADMIN_TOKEN is not set",
            request.method,
            request.path,
            request.remote_addr,
        )
        raise _ApiError(
            403, "admin endpoints are disabled: set NPU_SYNC_ADMIN_TOKEN to enable them"
        )
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    given = given.strip()
    if scheme.lower() != "bearer" or not given:
        log.warning(
            "refused %s %s from %s: no bearer token",
            request.method,
            request.path,
            request.remote_addr,
        )
        raise _ApiError(
            401,
            "this endpoint needs Authorization: Bearer <admin token>",
            headers={"WWW-Authenticate": 'Bearer realm="npu_sync"'},
        )
    # Digests of equal length, so the comparison does not reveal the token's length.
    if not hmac.compare_digest(_digest(given), _digest(expected)):
        log.warning(
            "refused %s %s from %s: wrong bearer token",
            request.method,
            request.path,
            request.remote_addr,
        )
        raise _ApiError(
            401,
            "invalid admin token",
            headers={"WWW-Authenticate": 'Bearer realm="npu_sync", error="invalid_token"'},
        )


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()


# -- request parsing -----------------------------------------------------------------------


def _query_int(name: str, default: int, *, maximum: int | None = None) -> int:
    values = request.args.getlist(name)
    if not values:
        return default
    if len(values) > 1:
        raise _ApiError(400, f"{name}: give it once")
    text = values[0]
    if not _DIGITS.fullmatch(text):
        raise _ApiError(400, f"{name}: must be a whole number >= 0")
    value = int(text)
    if maximum is not None and value > maximum:
        raise _ApiError(400, f"{name}: must be at most {maximum}")
    return value


def _json_body(allowed: Iterable[str]) -> dict[str, Any]:
    """The request's JSON object, or {} for an empty body."""
    length = request.content_length
    if length is not None and length > _MAX_BODY_BYTES:
        raise _ApiError(413, f"request body larger than {_MAX_BODY_BYTES} bytes")
    raw = request.stream.read(_MAX_BODY_BYTES + 1)
    if len(raw) > _MAX_BODY_BYTES:
        raise _ApiError(413, f"request body larger than {_MAX_BODY_BYTES} bytes")
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise _ApiError(400, "request body must be JSON") from None
    if not isinstance(body, dict):
        raise _ApiError(400, "request body must be a JSON object")
    unknown = sorted(str(key) for key in body if key not in set(allowed))
    if unknown:
        raise _ApiError(400, f"unknown keys in request body: {', '.join(unknown)}")
    return body


# -- views ---------------------------------------------------------------------------------


def _stats() -> Response:
    pool = current_pool()
    return _json({**pool.stats(), **_answered_by(pool)})


def _workers() -> Response:
    pool = current_pool()
    return _json({"workers": pool.workers(), **_answered_by(pool)})


_MAX_HOST_CHARS = 255


def _fleet() -> Response:
    """The fleet: every host, and the processes of one host — this process's unless
    ``?host=NAME`` names another — or of every host with ``?processes=all``. On a fleet
    of many hosts a page then carries a row per host and one host's processes, not
    every process of the fleet every two seconds."""
    hosts = request.args.getlist("host")
    which = request.args.getlist("processes")
    if len(hosts) > 1 or len(which) > 1:
        raise _ApiError(400, f"{'host' if len(hosts) > 1 else 'processes'}: give it once")
    if which and which[0] != "all":
        raise _ApiError(400, f"processes: must be 'all', got {which[0][:40]!r}")
    if hosts and which:
        raise _ApiError(400, "host, processes: give one or the other")
    if hosts and not 0 < len(hosts[0]) <= _MAX_HOST_CHARS:
        raise _ApiError(400, f"host: must be 1 to {_MAX_HOST_CHARS} characters")
    fleet = current_pool().stats(scope="fleet")
    if which:
        return _json({**fleet, "processes_of": "all"})
    host = hosts[0] if hosts else fleet["this_process"]["host"]
    shown = [p for p in fleet["processes"] if p["process"]["host"] == host]
    return _json({**fleet, "processes": shown, "processes_of": host})


def _answered_by(pool: WorkerPool) -> dict[str, Any]:
    """Which process an answer describes, in data and in words: behind gunicorn each
    request may reach another one."""
    monitor = monitor_of(pool)
    process: dict[str, Any] = dict(monitor.process) if monitor is not None else {}
    where = f"pid {process.get('pid', os.getpid())} on {process.get('host', '?')}"
    if pool.config.shared_state.backend == "redis":
        note = f"One process: {where}, the one that answered. GET fleet for every process."
    else:
        note = (
            f"One process only: {where}. Processes share nothing without Redis "
            "(shared_state.backend: redis), so each shows only itself."
        )
    return {"process": process, "note": note}


@_admin_only
def _reload() -> Response:
    pool = current_pool()
    if pool.config.source is None:
        raise _ApiError(409, "this pool was not built from a YAML file: there is nothing to reload")
    try:
        result = pool.reload()
    except ConfigError as exc:
        # The pool logged the error already; the running configuration is kept.
        raise _ApiError(
            400,
            "invalid configuration; the running configuration is kept",
            errors=list(exc.errors),
        ) from None
    except NpuSyncError as exc:
        raise _ApiError(409, str(exc)) from None
    return _json({"changed": result.changed, **result.to_dict()})


def _dead_letters() -> Response:
    limit = _query_int("limit", DEFAULT_PAGE_SIZE, maximum=MAX_PAGE_SIZE)
    offset = _query_int("offset", 0)
    # Payloads are user data (the SQLite store is 0600 for that reason): only the admin
    # token shows them. A request without Authorization gets the records without their
    # payloads; one with a wrong token is refused, not quietly shown less.
    payloads = "Authorization" in request.headers
    if payloads:
        _check_admin()
    queue = current_pool().dead_letters
    try:
        records = queue.list(limit=limit, offset=offset)
        total = len(queue)
    except NpuSyncError as exc:
        raise _ApiError(503, f"the dead-letter store is unavailable: {exc}") from None
    rows = []
    for record in records:
        row = record.to_dict()
        if not payloads:
            del row["payload"]
        rows.append(row)
    return _json(
        {
            "total": total,
            "limit": limit,
            "offset": offset,
            "payloads": payloads,
            "dead_letters": rows,
        }
    )


@_admin_only
def _replay() -> Response:
    record_id = _json_body(("id",)).get("id")
    if record_id is not None and (not isinstance(record_id, str) or not record_id):
        raise _ApiError(400, "id: must be a non-empty string")
    try:
        report = current_pool().dead_letters.replay(record_id)
    except KeyError:
        raise _ApiError(404, "no dead letter with that id", id=record_id) from None
    except PoolClosed:
        raise _ApiError(503, "the pool is closed") from None
    except NpuSyncError as exc:
        raise _ApiError(409, str(exc)) from None
    return _json(report.to_dict())


def _metrics() -> Response:
    unavailable = "Prometheus metrics need prometheus_client: " + _PROMETHEUS_HINT
    try:
        from npu_sync.prometheus import metrics_text
    except ImportError:
        raise _ApiError(501, unavailable) from None
    try:
        body, content_type = metrics_text(current_pool())
    except ImportError:
        raise _ApiError(501, unavailable) from None
    return Response(body, content_type=content_type, headers=_NO_STORE)


def _status_page() -> Response:
    page = _page()
    html = page.html.replace("__REFRESH_MS__", str(_state().refresh_ms))
    return Response(
        html,
        mimetype="text/html",
        headers={
            **_NO_STORE,
            "Content-Security-Policy": page.csp,
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "X-Frame-Options": "DENY",
        },
    )


def _not_found(rest: str) -> NoReturn:
    raise _ApiError(404, "no such endpoint")


def _not_allowed(allowed: tuple[str, ...]) -> Callable[[], NoReturn]:
    def not_allowed() -> NoReturn:
        raise _ApiError(
            405,
            f"method {request.method} not allowed; use {', '.join(allowed)}",
            headers={"Allow": ", ".join(allowed)},
        )

    return not_allowed


def _blueprint() -> Blueprint:
    """A fresh blueprint per app: a registered blueprint cannot gain routes later."""
    bp = Blueprint(EXTENSION_KEY, __name__)
    routes: list[tuple[str, Callable[..., Response], tuple[str, ...]]] = [
        ("/", _status_page, ("GET",)),
        ("/stats", _stats, ("GET",)),
        ("/workers", _workers, ("GET",)),
        ("/fleet", _fleet, ("GET",)),
        ("/reload", _reload, ("POST",)),
        ("/dead-letters", _dead_letters, ("GET",)),
        ("/dead-letters/replay", _replay, ("POST",)),
        ("/metrics", _metrics, ("GET",)),
    ]
    for rule, view, methods in routes:
        endpoint = view.__name__.lstrip("_")
        bp.add_url_rule(rule, endpoint, view, methods=list(methods))
        # Other methods on a known path get a JSON 405 here instead of Flask's HTML one.
        allowed = (*methods, "HEAD") if "GET" in methods else methods
        others = [m for m in _ALL_METHODS if m not in allowed]
        bp.add_url_rule(
            rule,
            f"{endpoint}_not_allowed",
            _not_allowed(allowed),
            methods=others,
            provide_automatic_options=False,
        )
    # Unknown paths under the prefix get a JSON 404 (the static rules above win over this).
    bp.add_url_rule("/<path:rest>", "not_found", _not_found, methods=list(_ALL_METHODS))
    bp.register_error_handler(_ApiError, _api_error)
    bp.register_error_handler(HTTPException, _http_error)
    return bp


# -- the status page -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Page:
    html: str
    csp: str


@functools.cache
def _page() -> _Page:
    html = importlib.resources.files("npu_sync").joinpath("static/status.html").read_text("utf-8")
    # The inline script and style are allowed by hash, so nothing else on the page can run.
    scripts = re.findall(r"<script>(.*?)</script>", html, flags=re.S)
    styles = re.findall(r"<style>(.*?)</style>", html, flags=re.S)
    csp = "; ".join(
        [
            "default-src 'none'",
            "script-src " + " ".join(_csp_hash(s) for s in scripts),
            "style-src " + " ".join(_csp_hash(s) for s in styles),
            "connect-src 'self'",
            "img-src data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )
    return _Page(html, csp)


def _csp_hash(text: str) -> str:
    digest = base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")
    return f"'sha256-{digest}'"
