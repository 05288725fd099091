"""Configuration: a pool's YAML parsed and validated into frozen dataclasses.

Three layouts load: the native one under ``npu_workers:``, AutoBot's under ``npu:``,
and the one AutoBot's admin UI writes (``workers:`` and ``load_balancing:`` at the top
level). Every problem found is collected and raised together as one
:class:`~npu_sync.errors.ConfigError`, each message naming its key path, e.g.
``npu_workers.workers[2].port: must be 1..65535, got 0``. ``docs/configuration.md``
describes every key.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import logging
import os
import re
import stat
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Final, TypeVar
from urllib.parse import urlsplit

import yaml

from npu_sync._schema import (
    SPEC,
    Range,
    Spec,
    boolean,
    check_fields,
    choice,
    custom,
    default_of,
    endpoint,
    integer,
    keys,
    number,
    optional_number,
    section,
    show,
    specs,
)
from npu_sync.errors import ConfigError, scrub

__all__ = [
    "DEFAULT_MAX_CONCURRENT",
    "DEFAULT_PORT",
    "DEFAULT_TLS_PORT",
    "AuthConfig",
    "BalancingConfig",
    "BreakerConfig",
    "DeadLetterConfig",
    "HealthConfig",
    "HedgeConfig",
    "ModelsConfig",
    "PoolConfig",
    "PoolSettings",
    "ReloadConfig",
    "RetryBudgetConfig",
    "RetryConfig",
    "SharedStateConfig",
    "TLSConfig",
    "TimeoutConfig",
    "TransportConfig",
    "WorkerConfig",
    "check_reload",
    "config_for_url",
    "default_protocol",
    "load_config",
    "parse_config",
    "parse_yaml",
    "read_config_text",
    "worker_config",
]

logger = logging.getLogger(__name__)

DEFAULT_PORT: Final = 8081
"""The port a worker given by ``host`` listens on unless ``port`` says otherwise."""

DEFAULT_TLS_PORT: Final = 8444
"""The port of a worker given by ``host`` with ``scheme: https`` and no ``port``:
AutoBot's worker serves TLS there."""

DEFAULT_MAX_CONCURRENT: Final = 32
"""Tasks in flight on one worker at once unless its ``max_concurrent`` says otherwise."""

MAX_FILE_BYTES: Final = 1 << 20
"""The largest configuration file read (1 MiB): a real one is a few kilobytes."""

MAX_DEPTH: Final = 32
"""The deepest nesting of mappings and lists a configuration file may have."""

MAX_NODES: Final = 100_000
"""The most YAML nodes (keys, values, list items) a configuration file may have."""


_CLIENTS: Final = ("builtin", "urllib3", "requests")
_DAY: Final = 86400
# The upper bounds keep a valid file from sizing connection pools to millions, or
# handing a wait longer than the platform's threading.TIMEOUT_MAX (about 292 years) to a
# lock or an event, which raises OverflowError in whichever thread uses it.

# AutoBot priorities may be negative; they become tiers 1, 2, ... once read.
_AUTOBOT_PRIORITY: Final = Range(-1_000_000, 1_000_000, integer=True)
_PORT: Final = Range(1, 65535, integer=True)


def _no_headers() -> Mapping[str, str]:
    return MappingProxyType({})


_FILE = "str (file)"


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """How to talk TLS to https workers. Immutable, so thread-safe.

    ``verify`` is True/False or the path of a CA bundle; ``cert``/``key`` name a client
    certificate and its key (``key`` requires ``cert``). Paths are stored absolute.
    """

    verify: bool | str = custom(
        True,
        "verify server certificates (`true`), don't (`false`), or verify against this CA bundle",
        hot=False,
        type_text=f"bool or {_FILE}",
        default_text="`true`",
    )
    cert: str | None = custom(
        None, "client certificate, for mutual TLS", hot=False, type_text=_FILE
    )
    key: str | None = custom(
        None,
        "the client certificate's private key (when not inside `cert`)",
        hot=False,
        type_text=_FILE,
        allowed_text="requires `cert`",
    )


_PROTOCOLS: Final = ("autobot-linux", "autobot-windows")
_AUTH_TYPES: Final = ("none", "bearer", "hmac")
# The headers each kind of auth sets on every request: configuring them too is refused.
_AUTH_HEADERS: Final[Mapping[str, frozenset[str]]] = MappingProxyType(
    {
        "bearer": frozenset({"authorization"}),
        "hmac": frozenset({"x-service-id", "x-service-signature", "x-service-timestamp"}),
    }
)


def default_protocol(platform: str) -> str:
    """The worker protocol a platform speaks unless ``protocol`` says otherwise."""
    return "autobot-windows" if platform == "windows" else "autobot-linux"


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """How each request to one worker is authenticated. Immutable, so thread-safe.

    ``type`` is ``none``; ``bearer`` (``Authorization: Bearer <token>``); or ``hmac``,
    AutoBot's service-to-service signature: HMAC-SHA256 keyed with ``secret`` over the
    method, path and timestamp, sent as ``X-Service-ID`` (``service_id``),
    ``X-Service-Signature`` and ``X-Service-Timestamp``. In a file, ``token`` and
    ``secret`` must come from the environment (``${NAME}``). Neither is ever shown:
    ``repr()`` writes ``***``, and no error message quotes them.
    """

    type: str = choice("none", _AUTH_TYPES, "how each request proves who sends it")
    token: str | None = custom(
        None,
        "the bearer token, sent as `Authorization: Bearer <token>`",
        allowed_text="`bearer` only, and required there; written as `${NAME}`; "
        "printable ASCII without spaces; never shown",
    )
    service_id: str | None = custom(
        None,
        "who signs: sent as `X-Service-ID`",
        allowed_text="`hmac` only, and required there; printable ASCII without spaces",
    )
    secret: str | None = custom(
        None,
        "the HMAC-SHA256 key the signature is made with",
        allowed_text="`hmac` only, and required there; written as `${NAME}`; never shown",
    )

    def __repr__(self) -> str:
        token = None if self.token is None else "***"
        secret = None if self.secret is None else "***"
        return (
            f"AuthConfig(type={self.type!r}, token={token!r}, "
            f"service_id={self.service_id!r}, secret={secret!r})"
        )

    @property
    def headers(self) -> frozenset[str]:
        """The request headers (lower case) this auth sets."""
        return _AUTH_HEADERS.get(self.type, frozenset())


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One worker as configured. Immutable, so thread-safe.

    ``url`` is normalised to ``scheme://host:port``, followed by the worker's base path
    when it sits behind a path prefix (``http://host:8081/api/v1``, no trailing slash);
    every request path is joined to it. Build one with :func:`worker_config`
    to have it validated; the constructor itself only freezes ``headers``, fills an
    empty ``name`` with the id and an empty ``protocol`` from ``platform``, and checks
    that ``priority``, ``max_concurrent`` and ``weight`` are within range (raising
    :class:`~npu_sync.errors.ConfigError`). ``headers`` is left out of ``repr()``
    because it usually carries credentials; ``auth`` shows its secrets as ``***``.
    """

    id: str = custom(
        "",
        "the worker's name in logs, stats, `remove_worker()`",
        type_text="str",
        default_text="required",
        allowed_text="1..200 printable characters, no spaces; unique",
        autobot="id",
        autobot_note="as is; without an `id`, from `name` (see below)",
    )
    url: str = custom(
        "",
        "where the worker is (give `url` or `host`, not both); with a base path, every "
        "request path (the task endpoints and `health.endpoint`) is joined to it: "
        "`/api/v1` + `/inference`",
        default_text="",
        allowed_text="`http://` or `https://`, host, optional port, optional base path "
        "(`http://host:8081/api/v1`: plain `/segments`, a trailing `/` is dropped); no "
        "query, fragment or credentials",
        autobot="url",
        autobot_note="as is (`host`, `port`, `scheme` are accepted too)",
        inputs=(
            (
                "host",
                Spec(
                    "custom",
                    "where the worker is, with `port` and `scheme`",
                    default_text="",
                    allowed_text="host name, IPv4, or IPv6 (brackets optional)",
                ),
                "",
            ),
            (
                "port",
                Spec(
                    "int",
                    "the worker's port",
                    limit=_PORT,
                    default_text="`8081`; `8444` with `scheme: https`",
                    allowed_text="only with `host`",
                ),
                None,
            ),
            (
                "scheme",
                Spec("choice", "", choices=("http", "https"), allowed_text="only with `host`"),
                "http",
            ),
        ),
    )
    priority: int = integer(
        1,
        0,
        1_000_000,
        "tier: workers in the lowest-numbered tier with room are used first; others only "
        "when it has none",
        allowed_text="(AutoBot layouts: `-1000000..1000000`, higher preferred)",
        code_limit=_AUTOBOT_PRIORITY,
        autobot="priority",
        autobot_note="AutoBot 1..10, higher preferred: inverted into tiers (see below); default 5",
    )
    max_concurrent: int = integer(
        DEFAULT_MAX_CONCURRENT,
        1,
        10_000,
        "tasks in flight on this worker at once; also its connection pool size",
        autobot="max_concurrent_tasks",
        autobot_note="as is (`max_concurrent` is accepted too, not both)",
    )
    enabled: bool = boolean(
        True,
        "a disabled worker stays configured but gets no tasks",
        autobot="enabled",
        autobot_note="as is",
    )
    # Unhashable, so it takes no part in hash(); equality still compares it.
    headers: Mapping[str, str] = field(
        default_factory=_no_headers,
        hash=False,
        repr=False,
        metadata={
            SPEC: Spec(
                "custom",
                "extra headers on every request to this worker, e.g. `Authorization`",
                type_text="map str → str",
                default_text="`{}`",
                allowed_text="valid header names; values without line breaks; no "
                "`X-NPU-Task-Id`, `X-NPU-Attempt`, `Content-Length`, `Transfer-Encoding` "
                "(npu_sync sets those)",
            )
        },
    )
    tls: TLSConfig | None = custom(
        None,
        "TLS settings for this worker",
        type_text="map",
        default_text="none (use `transport.tls`)",
        allowed_text="keys `verify`, `cert`, `key` as in `transport.tls`",
    )
    name: str = custom(
        "",
        "the display name in `workers()`, `stats()`, the status page and logs",
        default_text="the `id`",
        allowed_text="1..200 printable characters; spaces allowed",
        autobot="name",
        autobot_note="kept for display; spaces allowed",
    )
    weight: int = integer(
        1,
        1,
        100,
        "the worker's share of load against others in its tier: a worker of weight 2 is "
        "given twice the tasks in flight of one of weight 1",
        autobot="weight",
        autobot_note="as is, `1..100`",
    )
    platform: str = choice(
        "linux",
        ("linux", "windows", "macos"),
        "the worker's operating system; it chooses the default `protocol`",
        autobot="platform",
        autobot_note="as is; chooses `protocol` (`windows` → `autobot-windows`)",
    )
    protocol: str = choice(
        "",
        _PROTOCOLS,
        "how requests and answers are spoken: AutoBot's Linux worker (FastAPI, the "
        "reference worker's protocol) or its Windows worker",
        default_text="`autobot-windows` for `platform: windows`, else `autobot-linux`",
    )
    auth: AuthConfig = section(AuthConfig, "how each request is authenticated")

    def __post_init__(self) -> None:
        # A caller's dict must not be able to change a frozen config behind its back.
        if not isinstance(self.headers, MappingProxyType):
            object.__setattr__(self, "headers", MappingProxyType(dict(self.headers)))
        if not self.name:
            object.__setattr__(self, "name", self.id)
        if not self.protocol:
            object.__setattr__(self, "protocol", default_protocol(self.platform))
        check_fields(self, "worker")

    @property
    def scheme(self) -> str:
        """``http`` or ``https``."""
        return urlsplit(self.url).scheme

    @property
    def host(self) -> str:
        """The host name or IP address (IPv6 without brackets)."""
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        """The TCP port."""
        parts = urlsplit(self.url)
        if parts.port is not None:
            return parts.port
        return 443 if parts.scheme == "https" else 80

    @property
    def base_path(self) -> str:
        """The path prefix every request path is joined to: ``""`` or ``/api/v1``."""
        return urlsplit(self.url).path.rstrip("/")


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """The health checker's settings. Immutable, so thread-safe."""

    enabled: bool = boolean(
        True, "run the background health checker (a reload can turn it on or off)"
    )
    interval: float = number(
        30.0,
        0,
        _DAY,
        "time between checks of each worker (jittered)",
        above=True,
        unit="s",
        autobot="load_balancing.health_check_interval",
        autobot_note="as is (seconds)",
    )
    timeout: float = number(
        2.0,
        0,
        3600,
        "time allowed for one whole check, connecting included",
        above=True,
        unit="s",
        autobot="load_balancing.timeout_seconds",
        autobot_note="as is: AutoBot uses it as its health-check timeout",
    )
    unhealthy_threshold: int = integer(
        2, 1, 1000, "consecutive failed checks that mark a worker unhealthy"
    )
    healthy_threshold: int = integer(
        1, 1, 1000, "consecutive passed checks that mark it healthy again"
    )
    endpoint: str = endpoint("/health", "path of the health check (`GET`)")

    def __post_init__(self) -> None:
        check_fields(self, "health")


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """Per-worker circuit breaker settings. Immutable, so thread-safe."""

    fail_max: int = integer(
        5, 1, 10_000, "consecutive worker failures that open a worker's breaker"
    )
    reset_timeout: float = number(
        60.0,
        0,
        _DAY,
        "how long a breaker stays open before one trial call",
        above=True,
        unit="s",
        autobot="load_balancing.retry_cooldown_seconds",
        autobot_note="as is: the rest a failed worker gets before one trial task",
    )
    max_reset_timeout: float = number(
        600.0,
        0,
        7 * _DAY,
        "ceiling for the open time, which grows exponentially on repeated trips",
        above=True,
        unit="s",
        at_least="reset_timeout",
    )

    def __post_init__(self) -> None:
        check_fields(self, "circuit_breaker")


@dataclass(frozen=True, slots=True)
class RetryConfig:
    """Retry settings; ``max_retries`` counts attempts after the first. Immutable."""

    max_retries: int = integer(
        3, 0, 100, "attempts after the first, each on a worker not yet tried"
    )
    backoff_initial: float = number(
        0.05,
        0,
        3600,
        "first wait between attempts (jittered, grows exponentially)",
        unit="s",
    )
    backoff_max: float = number(
        2.0, 0, 3600, "longest wait between attempts", unit="s", at_least="backoff_initial"
    )

    def __post_init__(self) -> None:
        check_fields(self, "retry")


@dataclass(frozen=True, slots=True)
class TimeoutConfig:
    """Timeouts in seconds. Immutable, so thread-safe.

    ``task`` is a task's whole default deadline; ``read`` is the budget of one whole
    attempt, from its start to the last byte of the answer (connecting included);
    ``connect`` is the most of that budget that establishing a connection may take.
    The defaults keep a task inside gunicorn's default 30 s worker timeout.
    """

    connect: float = number(
        2.0,
        0,
        3600,
        "the most of an attempt's budget (`timeouts.read`) that establishing a new "
        "connection, TCP and TLS, may take",
        above=True,
        unit="s",
    )
    read: float = number(
        20.0,
        0,
        _DAY,
        "the budget of one whole attempt, from its start to the last byte of the answer: "
        "name resolution, connecting, TLS, sending, waiting and reading all come out of "
        "it. Cut to the time left before the task's deadline, so it may be larger than "
        "`timeouts.task`",
        above=True,
        unit="s",
    )
    task: float = number(
        25.0,
        0,
        _DAY,
        "a task's whole default deadline: all attempts, backoff and waiting for capacity; "
        "`Task.timeout` overrides it. See [aligning with gunicorn](#aligning-with-gunicorn)",
        above=True,
        unit="s",
    )

    def __post_init__(self) -> None:
        check_fields(self, "timeouts")


@dataclass(frozen=True, slots=True)
class DeadLetterConfig:
    """Where failed tasks are recorded. Immutable, so thread-safe.

    ``path`` (sqlite only) is stored absolute, or as ``:memory:``.
    """

    backend: str = choice(
        "memory",
        ("memory", "sqlite", "redis"),
        "where failed tasks are recorded; `redis` needs `shared_state.backend: redis` and "
        "uses its connection",
        hot=False,
    )
    path: str | None = custom(
        None,
        "the SQLite file; `:memory:` is allowed; see [paths](#file-paths)",
        hot=False,
        type_text=_FILE,
        allowed_text="required for `sqlite`, rejected for `memory`",
    )
    max_records: int = integer(10000, 1, 10_000_000, "most records kept", hot=False)
    # redis only: the local SQLite file holding records while Redis is unreachable;
    # None puts it under the system's temporary directory (see docs/deployment.md).
    spool_path: str | None = custom(
        None,
        "the local SQLite file where records wait, durably, while Redis is unreachable; "
        "shared by the processes of one host; see "
        "[deployment.md](deployment.md#when-redis-fails)",
        hot=False,
        type_text=_FILE,
        default_text="`<tmp>/npu_sync-<uid>/<namespace>.spool.sqlite3`",
        allowed_text="`redis` only",
    )

    def __post_init__(self) -> None:
        check_fields(self, "dead_letter")


@dataclass(frozen=True, slots=True)
class SharedStateConfig:
    """State shared by every process using the same workers. Immutable, so thread-safe.

    ``backend`` is ``"none"`` (each process on its own) or ``"redis"``. The Redis URL
    may come from the environment (``url: ${NPU_SYNC_REDIS_URL}``).
    """

    backend: str = choice(
        "none",
        ("none", "redis"),
        "share breakers (and, with `dead_letter.backend: redis`, dead letters) between "
        "processes; see [deployment.md](deployment.md)",
        hot=False,
    )
    url: str = custom(
        "redis://127.0.0.1:6379/0",
        "the Redis server; typically `${NPU_SYNC_REDIS_URL}`. Never quoted in messages, "
        "and shown with its password as `***` in `repr()`",
        hot=False,
        allowed_text="`redis://`, `rediss://`, `unix://`; port `1..65535`, database a number",
    )
    namespace: str = custom(
        "npu_sync",
        "key prefix: pools with the same namespace share state, others are apart",
        hot=False,
        allowed_text="no spaces",
    )
    timeout: float = number(
        0.05,
        0,
        60,
        "connect and socket timeout of every Redis call",
        above=True,
        unit="s",
        hot=False,
    )
    sync_interval: float = number(
        1.0,
        0,
        3600,
        "how often the full shared state is re-read (changes also arrive at once by "
        "pub/sub), and how often an unavailable Redis is probed",
        above=True,
        unit="s",
        hot=False,
    )

    def __post_init__(self) -> None:
        check_fields(self, "shared_state")

    def __repr__(self) -> str:
        # The URL usually carries the Redis password.
        return (
            f"SharedStateConfig(backend={self.backend!r}, url={scrub(self.url)!r}, "
            f"namespace={self.namespace!r}, timeout={self.timeout!r}, "
            f"sync_interval={self.sync_interval!r})"
        )


@dataclass(frozen=True, slots=True)
class ReloadConfig:
    """What a reload of the file may do to a running pool. Immutable, so thread-safe.

    A file read mid-edit, or with a duplicated or mistyped key, can be valid YAML that
    names far fewer workers. A reload that would leave no enabled worker is refused
    unless ``allow_empty``; one that would remove or disable more than
    ``max_removed_share`` of the enabled workers is refused too. Both rules are read
    from the *new* file, so the file itself must say a drastic change is meant.
    """

    allow_empty: bool = boolean(
        False,
        "let a reload of the file leave the pool with no enabled worker; without it such a "
        "reload is refused (see [operations.md](operations.md#what-a-reload-refuses))",
    )
    max_removed_share: float = number(
        0.5,
        0,
        1,
        "the largest share of the running pool's enabled workers (those the file named) "
        "one reload of the file may remove or disable; more is refused. `0` refuses any "
        "removal, `1` allows any",
    )

    def __post_init__(self) -> None:
        check_fields(self, "reload")


@dataclass(frozen=True, slots=True)
class TransportConfig:
    """The HTTP client and its limits. Immutable, so thread-safe."""

    client: str = choice(
        "builtin",
        _CLIENTS,
        "HTTP client used for every worker (see [transport.md](transport.md))",
        hot=False,
    )
    max_response_bytes: int = integer(
        16 * 1024 * 1024,
        1,
        1 << 30,
        "largest response body accepted from a worker",
        hot=False,
        default_text="`16777216` (16 MiB)",
        allowed_text="(1 GiB)",
    )
    tls: TLSConfig = section(TLSConfig, "TLS settings of every https worker", hot=False)
    # Below the 5 s keep-alive of uvicorn, which the AutoBot worker runs: a connection
    # idle for longer may be closed by the worker just as a request is sent on it.
    idle_timeout: float = number(
        4.0,
        0,
        3600,
        "how long an idle keep-alive connection may be reused; keep it below the worker's "
        "own keep-alive timeout (uvicorn's, which the AutoBot worker runs, is 5 s)",
        above=True,
        unit="s",
        hot=False,
    )

    def __post_init__(self) -> None:
        check_fields(self, "transport")


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """The pool's own settings. Immutable, so thread-safe."""

    threads: int = integer(
        32, 1, 4096, "size of the pool's own thread pool for `submit()` / `map()`", hot=False
    )
    default_endpoint: str = endpoint(
        "/inference", "path a task is POSTed to unless it names its own", hot=False
    )
    max_queue_wait: float = number(
        10.0,
        0,
        _DAY,
        "how long a task may wait for a worker with room, within its deadline, before it "
        "fails into the dead-letter queue",
        above=True,
        unit="s",
        hot=False,
    )

    def __post_init__(self) -> None:
        check_fields(self, "pool")


_STRATEGIES: Final = ("least-loaded", "round-robin", "weighted", "priority")


@dataclass(frozen=True, slots=True)
class RetryBudgetConfig:
    """How many retries the pool allows itself, pool-wide. Immutable, so thread-safe."""

    ratio: float = number(
        0.2, 0, 1, "retries allowed as a share of the first attempts of the last seconds"
    )
    min_per_second: float = number(
        10.0,
        0,
        10_000,
        "retries allowed per second on top of the share, so a quiet pool can still retry",
        unit="per s",
    )

    def __post_init__(self) -> None:
        check_fields(self, "balancing.retry_budget")


@dataclass(frozen=True, slots=True)
class HedgeConfig:
    """When to send a slow idempotent task to a second worker. Immutable, so thread-safe."""

    enabled: bool = boolean(
        False,
        "send an idempotent task to a second worker when the first is slow to answer; the "
        "first answer wins and the hedge counts against the retry budget",
    )
    delay: float | None = optional_number(
        0,
        3600,
        "a fixed wait before hedging; null waits for `percentile` of recent latency",
        above=True,
        unit="s",
    )
    percentile: float = number(
        0.95,
        0.5,
        0.999,
        "the latency percentile to wait for before hedging, when `delay` is null",
    )

    def __post_init__(self) -> None:
        check_fields(self, "balancing.hedge")


@dataclass(frozen=True, slots=True)
class BalancingConfig:
    """How tasks are spread among the workers of a tier. Immutable, so thread-safe."""

    strategy: str = choice(
        "least-loaded",
        _STRATEGIES,
        "how a worker is chosen within the preferred tier",
        autobot="load_balancing.strategy",
        autobot_note="as is: the same four words",
    )
    latency_aware: bool = boolean(
        True, "weigh each worker's tasks in flight by its recent latency (peak-EWMA)"
    )
    latency_decay: float = number(
        10.0,
        0,
        3600,
        "how fast a latency estimate forgets: its time constant",
        above=True,
        unit="s",
    )
    slow_start: float = number(
        10.0,
        0,
        3600,
        "a worker that recovers or joins ramps up to its full share over this window; `0` "
        "turns it off",
        unit="s",
    )
    retry_budget: RetryBudgetConfig = section(RetryBudgetConfig, "the pool-wide retry budget")
    adaptive_concurrency: bool = boolean(
        False,
        "find each worker's concurrency from its latency; `max_concurrent` becomes a ceiling",
    )
    hedge: HedgeConfig = section(HedgeConfig, "hedged requests")

    def __post_init__(self) -> None:
        check_fields(self, "balancing")


@dataclass(frozen=True, slots=True)
class ModelsConfig:
    """What the pool learns and does about the models each worker holds. Immutable."""

    placement: bool = boolean(
        False,
        "when no worker holds the model a task names, ask the least-loaded worker to load it",
    )
    refresh_on_health: bool = boolean(
        True, "re-read each worker's models (`GET /models`) with every health round"
    )


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """A whole, validated pool configuration. Immutable, so thread-safe."""

    workers: tuple[WorkerConfig, ...] = custom(
        (),
        "the workers; see [per-worker keys](#per-worker-keys)",
        type_text="list of workers",
        default_text="`[]`",
        allowed_text="may be empty, but `npu-sync check` and reloads then need "
        "`reload.allow_empty`",
    )
    health: HealthConfig = section(HealthConfig, "the health checker")
    circuit_breaker: BreakerConfig = section(BreakerConfig, "per-worker circuit breakers")
    retry: RetryConfig = section(RetryConfig, "retries and backoff")
    timeouts: TimeoutConfig = section(TimeoutConfig, "timeouts")
    dead_letter: DeadLetterConfig = section(DeadLetterConfig, "the dead-letter store")
    transport: TransportConfig = section(TransportConfig, "the HTTP client")
    pool: PoolSettings = section(PoolSettings, "the pool's own settings")
    shared_state: SharedStateConfig = section(SharedStateConfig, "state shared by processes")
    reload: ReloadConfig = section(ReloadConfig, "what a reload may do")
    balancing: BalancingConfig = section(BalancingConfig, "how tasks are spread")
    models: ModelsConfig = section(ModelsConfig, "the models workers hold")
    source: str | None = None
    # The top-level key the file used (npu_workers or npu; "" for the admin-UI layout,
    # which has none), for key paths in messages: see key_path().
    layout: str = field(default="npu_workers", compare=False)

    def key_path(self, key: str) -> str:
        """``key`` as this configuration's file writes it, for messages:
        ``npu_workers.dead_letter.path``, ``npu.workers`` or, in the layout AutoBot's
        admin UI writes (no top-level key), ``workers``.
        """
        return f"{self.layout}.{key}" if self.layout else key

    def worker(self, worker_id: str) -> WorkerConfig:
        """The worker with this id.

        Raises:
            KeyError: no worker has that id.
        """
        for worker in self.workers:
            if worker.id == worker_id:
                return worker
        raise KeyError(worker_id)

    def tls_for(self, worker: WorkerConfig) -> TLSConfig:
        """The TLS settings that apply to ``worker``: its own, else the transport's."""
        return worker.tls if worker.tls is not None else self.transport.tls


# ---------------------------------------------------------------------------------------
# Public entry points


def load_config(path: str | os.PathLike[str]) -> PoolConfig:
    """Read and validate a YAML configuration file.

    Relative file paths inside it are resolved against the file's directory.

    Args:
        path: the YAML file.

    Returns:
        The validated configuration, with ``source`` set to the file's absolute path.

    Raises:
        ConfigError: the file cannot be read, is not valid YAML, or fails validation.
    """
    source = os.path.abspath(os.fspath(path))
    return parse_yaml(read_config_text(path), source=source)


def read_config_text(path: str | os.PathLike[str]) -> str:
    """The text of a configuration file.

    Only a regular file (or a symlink to one) is read, and at most
    :data:`MAX_FILE_BYTES` of it: a FIFO, a device or a directory is refused at once,
    without opening it, rather than blocking the caller or the reload thread.

    Raises:
        ConfigError: the file cannot be read, is not a regular file, is too large or
            is not UTF-8.
    """
    name = os.fspath(path)
    source = os.path.abspath(name)

    def fail(problem: str) -> ConfigError:
        return ConfigError(f"cannot read {name}: {problem}", source=source)

    try:
        info = os.stat(name)
        if not stat.S_ISREG(info.st_mode):
            raise fail(f"not a regular file ({_file_kind(info.st_mode)})")
        # O_NONBLOCK: should the path be swapped for a FIFO after the stat above, the
        # open returns at once instead of waiting for a writer; fstat then refuses it.
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
        fd = os.open(name, flags)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise fail(f"not a regular file ({_file_kind(info.st_mode)})")
            data = _read_at_most(fd, MAX_FILE_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as exc:
        raise fail(exc.strerror or str(exc)) from None
    if len(data) > MAX_FILE_BYTES:
        raise fail(f"larger than {MAX_FILE_BYTES} bytes; a configuration is a few kilobytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise fail(f"not UTF-8 text (byte {exc.start})") from None


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = os.read(fd, min(65536, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _file_kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    for test, kind in kinds:
        if test(mode):
            return kind
    return "not a file"


def parse_yaml(text: str, *, source: str) -> PoolConfig:
    """Validate the YAML text of the configuration file at ``source``.

    Reloads read the file once, hash those bytes and parse them with this, so the
    configuration applied is exactly the content that was compared.

    Raises:
        ConfigError: the text is not valid YAML or fails validation.
    """
    name = source
    if len(text) > MAX_FILE_BYTES:
        raise ConfigError(
            f"{name} is larger than {MAX_FILE_BYTES} characters; a configuration is a few "
            "kilobytes",
            source=source,
        )
    loader: _StrictLoader | None = None
    try:
        # The reader checks every character as the loader is built: inside the try.
        loader = _StrictLoader(text)
        data = loader.get_single_data()
    except _TooLarge as exc:
        raise ConfigError(str(exc), source=source) from None
    except RecursionError:
        # Kept for safety: the depth limit above is meant to make this unreachable.
        raise ConfigError(f"nested deeper than {MAX_DEPTH} levels", source=source) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = exc.problem or exc.context or "invalid YAML"
        raise ConfigError(f"YAML syntax error{where}: {problem}", source=source) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"YAML error: {' '.join(str(exc).split())}", source=source) from None
    except ValueError as exc:
        # PyYAML's constructors raise plain ValueError for a date such as 2024-13-01,
        # a float tag on a non-number, or an integer of more than 4300 digits. What
        # follows a colon quotes the value (int('...')), which may be a credential.
        problem = " ".join(str(exc).split()).partition(": ")[0]
        raise ConfigError(f"YAML error: {problem}", source=source) from None
    except (KeyError, AttributeError, TypeError):
        # Others fail outright on a value their explicit tag cannot hold (!!bool maybe,
        # !!timestamp soon), naming the value if anything.
        raise ConfigError(
            "YAML error: a value does not fit its explicit tag (such as !!bool or !!timestamp)",
            source=source,
        ) from None
    finally:
        if loader is not None:
            loader.dispose()
    if loader.duplicates:
        raise ConfigError(sorted(loader.duplicates), source=source)
    if data is None:
        raise ConfigError(f"{name} is empty: {_EXPECTED_TOP}", source=source)
    config = parse_config(data, source=source, base_dir=os.path.dirname(source))
    logger.debug("loaded %d worker(s) from %s", len(config.workers), source)
    return config


class _TooLarge(Exception):
    """The document is nested too deeply or has too many nodes."""


_MERGE_TAG: Final = "tag:yaml.org,2002:merge"


class _StrictLoader(yaml.SafeLoader):
    """``yaml.safe_load`` with duplicate keys reported and the document's size bounded.

    PyYAML keeps the last of two equal keys without a word: a file with ``workers:``
    twice silently loses the first list. Keys are checked as mappings are composed,
    where the path to each is known; nesting is bounded there too, before PyYAML's
    recursive composer could exhaust the interpreter's stack, and so are the pairs
    merge keys copy, before they are copied.
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.duplicates: list[str] = []
        self._path: list[str] = []
        self._depth = 0
        self._nodes = 0
        self._merged = 0
        self._flattened: set[int] = set()  # nodes live as long as the loader: ids stay theirs

    # The signatures follow types-PyYAML's stubs; at run time index is a key node or
    # an int, and anchor a string or None.
    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise _TooLarge(f"more than {MAX_NODES} YAML nodes; a configuration has far fewer")
        self._depth += 1
        if self._depth > MAX_DEPTH:
            where = _join_path(self._path) or "the document"
            if len(where) > 60:
                where = where[:57] + "..."
            raise _TooLarge(f"{where}: nested deeper than {MAX_DEPTH} levels")
        key: object = index
        if isinstance(key, yaml.ScalarNode):
            self._path.append(str(key.value))
        elif isinstance(key, int):
            self._path.append(f"[{index}]")
        else:
            self._path.append("")  # the document itself, or a mapping's key
        try:
            return super().compose_node(parent, index)
        finally:
            self._path.pop()
            self._depth -= 1

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        # A merge key (<<) copies the merged mapping's pairs into this one, and a merged
        # mapping may merge others in turn: 600 bytes of "<<: [*a, *a, ...]" nested a few
        # levels deep expand to billions of pairs. Count the pairs before PyYAML copies
        # them; each merged mapping is flattened (and counted) first, once.
        if id(node) in self._flattened:
            return  # its merge keys are gone already: nothing left to copy
        merged = 0
        for key, value in node.value:
            if key.tag != _MERGE_TAG:
                continue
            sources = value.value if isinstance(value, yaml.SequenceNode) else [value]
            for source in sources:
                if isinstance(source, yaml.MappingNode):
                    self.flatten_mapping(source)
                    merged += len(source.value)
        self._merged += merged
        if self._merged > MAX_NODES:
            raise _TooLarge(
                f"merge keys (<<) copy more than {MAX_NODES} YAML nodes; a configuration "
                "has far fewer"
            )
        super().flatten_mapping(node)
        self._flattened.add(id(node))

    def compose_mapping_node(self, anchor: dict[Any, yaml.Node]) -> yaml.MappingNode:
        node = super().compose_mapping_node(anchor)
        seen: dict[tuple[str, str], yaml.Mark] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == _MERGE_TAG:
                continue
            first = seen.get((key.tag, key.value))
            if first is None:
                seen[(key.tag, key.value)] = key.start_mark
                continue
            again = key.start_mark
            where = f"lines {first.line + 1} and {again.line + 1}"
            if first.line == again.line:
                where = f"line {again.line + 1}, columns {first.column + 1} and {again.column + 1}"
            path = _join_path([*self._path, str(key.value)])
            self.duplicates.append(
                f"{path}: duplicate key ({where}); YAML would silently keep only the last one"
            )
        return node


def _join_path(parts: list[str]) -> str:
    out = ""
    for part in parts:
        if not part:
            continue
        out = out + part if part.startswith("[") or not out else f"{out}.{part}"
    return out


def check_reload(old: PoolConfig, new: PoolConfig) -> None:
    """Refuse a reload that would empty a working pool or remove most of it.

    The limits come from the new file's ``reload`` section (see :class:`ReloadConfig`):
    a half-written file, or one whose ``workers:`` key is duplicated, reads as valid
    YAML naming fewer workers, and must not take the running pool down with it.

    Raises:
        ConfigError: naming ``<layout>.workers``, what would be lost and the key that
            allows it.
    """
    before = [w.id for w in old.workers if w.enabled]
    if not before:
        return  # nothing working to protect
    after = {w.id for w in new.workers if w.enabled}
    path = new.key_path("workers")
    if not after:
        if new.reload.allow_empty:
            return
        raise ConfigError(
            f"{path}: the new configuration has no enabled worker (the running one has "
            f"{len(before)}); refused so that a half-written or mistyped file cannot empty "
            "the pool: set reload.allow_empty: true if that is what you mean",
            source=new.source,
        )
    lost = [wid for wid in before if wid not in after]
    share = len(lost) / len(before)
    limit = new.reload.max_removed_share
    if share > limit:
        shown = ", ".join(lost[:5]) + (", ..." if len(lost) > 5 else "")
        raise ConfigError(
            f"{path}: the new configuration removes or disables {len(lost)} of the "
            f"{len(before)} enabled workers ({shown}), more than reload.max_removed_share "
            f"({limit:g}) allows; refused: raise reload.max_removed_share if that is what "
            "you mean",
            source=new.source,
        )


def parse_config(
    data: Mapping[str, Any], *, source: str | None = None, base_dir: str | None = None
) -> PoolConfig:
    """Validate an already-parsed YAML document.

    Args:
        data: the document: a mapping with a ``npu_workers:`` or ``npu:`` key.
        source: where it came from, kept in ``PoolConfig.source`` and error messages.
        base_dir: directory relative file paths are resolved against; the current
            directory when None.

    Returns:
        The validated configuration.

    Raises:
        ConfigError: listing every problem found.
    """
    reader = _Reader(expand=True, base_dir=base_dir)
    config = reader.document(data)
    if reader.errors:
        raise ConfigError(reader.errors, source=source)
    return replace(config, source=source)


def config_for_url(url: str) -> PoolConfig:
    """A configuration of one worker, id ``default``, at ``url``; all else default.

    Used when there is no YAML file at all.

    Raises:
        ConfigError: the URL is not a valid worker address.
    """
    return PoolConfig(workers=(worker_config("default", url),))


def worker_config(
    id: str,
    url: str | None = None,
    *,
    host: str | None = None,
    port: int | None = None,
    scheme: str | None = None,
    priority: int = 1,
    max_concurrent: int = DEFAULT_MAX_CONCURRENT,
    enabled: bool = True,
    headers: Mapping[str, str] | None = None,
    tls: TLSConfig | Mapping[str, Any] | None = None,
    name: str | None = None,
    weight: int = 1,
    platform: str = "linux",
    protocol: str | None = None,
    auth: AuthConfig | Mapping[str, Any] | None = None,
) -> WorkerConfig:
    """Build a validated worker, with the same rules as a YAML worker entry.

    Give ``url`` or ``host`` (with ``port``, default 8081, or 8444 with
    ``scheme="https"``, and ``scheme``, default http), not both. Values are taken
    literally: no ``${ENV}`` expansion, so ``auth`` secrets are given as they are.

    Returns:
        The worker, its url normalised.

    Raises:
        ConfigError: naming each bad argument as ``worker.<name>``.
    """
    raw: dict[str, Any] = {
        "id": id,
        "priority": priority,
        "max_concurrent": max_concurrent,
        "enabled": enabled,
        "weight": weight,
        "platform": platform,
    }
    optional = {
        "url": url,
        "host": host,
        "port": port,
        "scheme": scheme,
        "headers": headers,
        "tls": _tls_mapping(tls) if isinstance(tls, TLSConfig) else tls,
        "name": name,
        "protocol": protocol,
        "auth": _auth_mapping(auth) if isinstance(auth, AuthConfig) else auth,
    }
    raw.update((key, value) for key, value in optional.items() if value is not None)
    reader = _Reader(expand=False, base_dir=None)
    worker, _, _ = reader.worker(raw, "worker", autobot=False, tls_base=TLSConfig())
    if reader.errors or worker is None:
        raise ConfigError(reader.errors or ["worker: invalid"])
    return worker


# ---------------------------------------------------------------------------------------
# Validation

_EXPECTED_TOP = (
    "expected a top-level 'npu_workers:' (or AutoBot 'npu:', or the 'workers:' of "
    "AutoBot's admin UI) mapping"
)
_LAYOUTS: Final = ("npu_workers", "npu")
_C = TypeVar("_C")


def _key_names(cls: type) -> frozenset[str]:
    """The YAML keys a section of ``cls`` allows: its declared fields and their inputs."""
    names = set()
    for name, spec, _ in specs(cls):
        names.add(name)
        names.update(input_name for input_name, _, _ in spec.inputs)
    return frozenset(names)


def _field_default(cls: type, name: str) -> Any:
    return default_of(next(item for item in dataclasses.fields(cls) if item.name == name))


def _worker_limit(name: str) -> Range:
    spec = next(spec for key, spec, _ in specs(WorkerConfig) if key == name)
    assert spec.limit is not None
    return spec.limit


_SECTION_KEYS: Final = _key_names(PoolConfig)


def _load_balancing_keys() -> Mapping[str, tuple[str, Spec]]:
    """AutoBot's ``load_balancing`` keys: the npu_sync key each maps to, and its spec."""
    found = {}
    for key in keys(PoolConfig):
        section_name, _, name = key.spec.autobot.partition(".")
        if section_name == "load_balancing":
            found[name] = (key.path, key.spec)
    return MappingProxyType(found)


_LOAD_BALANCING: Final = _load_balancing_keys()
_NO_EFFECT: Final = "retry_failed_workers"
# The AutoBot layouts (under npu:, or at the top level as the admin UI writes it) take
# AutoBot's load_balancing section next to npu_sync's own.
_ADMIN_KEYS: Final = _SECTION_KEYS | {"load_balancing"}
_WORKER_KEYS: Final = _key_names(WorkerConfig)
# AutoBot spells capacity max_concurrent_tasks.
_AUTOBOT_WORKER_KEYS: Final = _WORKER_KEYS | {"max_concurrent_tasks"}
# Worker keys read by their specs alone; the others need code of their own.
_PLAIN_WORKER_KEYS: Final = ("enabled", "weight", "platform", "protocol")
# A secret in a file is a reference to the environment, and nothing else.
_ENV_ONLY = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}")
# Keys AutoBot's own tooling writes that say nothing npu_sync acts on.
_AUTOBOT_IGNORED_KEYS: Final = frozenset(
    {"description", "device", "models", "capabilities", "tags", "assigned_models"}
)
_AUTOBOT_DEFAULT_PRIORITY: Final = 5
_TLS_KEYS: Final = _key_names(TLSConfig)
# Set by the transport per request; a configured value would break de-duplication or framing.
_RESERVED_HEADERS: Final = frozenset(
    {"x-npu-task-id", "x-npu-attempt", "content-length", "transfer-encoding"}
)

_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HOST_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]*[A-Za-z0-9_])?")
_INVALID: Final = object()


class _Reader:
    """Walks raw YAML data, building config objects and collecting every error."""

    def __init__(self, *, expand: bool, base_dir: str | None) -> None:
        self.errors: list[str] = []
        self.expand = expand
        self.base_dir = base_dir

    def error(self, path: str, message: str) -> None:
        self.errors.append(f"{path}: {message}" if path else message)

    # -- the document --------------------------------------------------------------

    def document(self, data: object) -> PoolConfig:
        if not isinstance(data, Mapping):
            self.error(
                "", f"the configuration must be a mapping, got {show(data)}: {_EXPECTED_TOP}"
            )
            return PoolConfig()
        present = [key for key in _LAYOUTS if key in data]
        if not present and any(key in _ADMIN_KEYS for key in data):
            # AutoBot's admin UI writes workers: and load_balancing: at the top level.
            layout = ""
            section = self.section(data, "", _ADMIN_KEYS)
        else:
            for key in data:
                if key not in _LAYOUTS:
                    self.error(str(key), _unknown(key, _LAYOUTS))
            if not present:
                if not data:
                    self.error("", f"the configuration is empty: {_EXPECTED_TOP}")
                return PoolConfig()
            if len(present) > 1:
                self.error("npu", "cannot be combined with npu_workers: use one layout")
                return PoolConfig()
            layout = present[0]
            allowed = _ADMIN_KEYS if layout == "npu" else _SECTION_KEYS
            section = self.section(data[layout], layout, allowed)
        if section is None:
            return PoolConfig()
        prefix = f"{layout}." if layout else ""
        autobot = layout != "npu_workers"
        if autobot:
            section = self.load_balancing(section, prefix)

        # Workers inherit verify from transport.tls, so it is read first; its errors are
        # moved after the sections before it so messages follow the usual key order.
        mark = len(self.errors)
        transport = self.transport(section.get("transport"), f"{prefix}transport")
        transport_errors = self.errors[mark:]
        del self.errors[mark:]

        workers = self.workers(
            section.get("workers"), f"{prefix}workers", autobot=autobot, tls_base=transport.tls
        )
        found: dict[str, Any] = {"workers": workers, "transport": transport}
        custom_readers = {"dead_letter": self.dead_letter, "shared_state": self.shared_state}
        for name, spec, _ in specs(PoolConfig):
            if name in found or spec.section is None:
                if name == "transport":
                    self.errors.extend(transport_errors)
                continue
            read = custom_readers.get(name)
            raw, item_path = section.get(name), f"{prefix}{name}"
            found[name] = (
                read(raw, item_path) if read else self.section_of(raw, item_path, spec.section)
            )
        dead_letter, shared = found["dead_letter"], found["shared_state"]
        if dead_letter.backend == "redis" and shared.backend != "redis":
            self.error(
                f"{prefix}dead_letter.backend",
                "'redis' needs shared_state.backend: redis (it uses that connection)",
            )
        return PoolConfig(**found, layout=layout)

    def load_balancing(self, section: Mapping[Any, Any], prefix: str) -> Mapping[Any, Any]:
        """``section`` with AutoBot's ``load_balancing:`` keys moved to the npu_sync keys
        they map to (each npu_sync key names its AutoBot key in the schema).

        Each value is checked here, under its AutoBot key path, by the npu_sync key's
        spec; a valid one is handed on as if the file had given the npu_sync key.
        """
        path = f"{prefix}load_balancing"
        m = self.section(section.get("load_balancing"), path, [*_LOAD_BALANCING, _NO_EFFECT])
        if not m:
            return section
        # AutoBot declares it but acts on it nowhere; npu_sync always retries a failed
        # worker after the cool-down (circuit_breaker.reset_timeout).
        self.boolean(m, _NO_EFFECT, path, True)
        out = {key: value for key, value in section.items() if key != "load_balancing"}
        for key, (target, spec) in _LOAD_BALANCING.items():
            if key not in m:
                continue
            name, _, field_name = target.partition(".")
            own = out.get(name)
            if own is not None and not isinstance(own, Mapping):
                continue  # that section's own error says enough
            if own and field_name in own:
                self.error(
                    f"{path}.{key}",
                    f"sets {target}, which the file gives too: keep one",
                )
                continue
            value = self.value_of(m, key, path, spec)
            if value is not _INVALID:
                out[name] = {**(own or {}), field_name: value}
        return out

    # -- sections --------------------------------------------------------------------

    def fields(self, m: Mapping[Any, Any], path: str, cls: type) -> dict[str, Any]:
        """Every plain key of ``cls`` given in ``m``, read and checked by its spec.

        Keys left out (absent, invalid, or of kind ``custom``) take the field's default
        when ``cls(**result)`` is built; invalid ones have their error recorded.
        """
        found: dict[str, Any] = {}
        mark = len(self.errors)
        for name, spec, _ in specs(cls):
            item_path = f"{path}.{name}"
            if spec.kind == "section" and spec.section is not None:
                if name in m:
                    found[name] = self.section_of(m[name], item_path, spec.section)
                continue
            if name not in m or spec.kind == "custom":
                continue
            value = self.value_of(m, name, path, spec)
            if value is not _INVALID:
                found[name] = value
        if len(self.errors) == mark:
            # Cross-field rules only between valid values: a broken field says enough.
            for name, spec, item in specs(cls):
                if not spec.at_least:
                    continue
                value = found.get(name, default_of(item))
                other = found.get(spec.at_least, _field_default(cls, spec.at_least))
                if value < other:
                    self.error(
                        f"{path}.{name}",
                        f"must be >= {spec.at_least} ({other:g}), got {value:g}",
                    )
        return found

    def value_of(self, m: Mapping[Any, Any], name: str, path: str, spec: Spec) -> object:
        """The value of the plain key ``m[name]`` read by ``spec``; _INVALID when it is
        invalid (the error is recorded).
        """
        item_path = f"{path}.{name}"
        if spec.nullable and m[name] is None:
            return None
        if spec.kind == "bool":
            return self.boolean(m, name, path, _INVALID)
        if spec.kind in ("int", "number"):
            checked = self.bounded(m, name, path, spec.limit)
            return _INVALID if checked is None else checked
        if spec.kind == "choice":
            text = self.string(m[name], item_path)
            if text is None:
                return _INVALID
            return self.choice(text, m[name], item_path, spec.choices, _INVALID)
        if spec.kind == "endpoint":
            return self.endpoint(m, name, path, _INVALID)
        return _INVALID

    def section_of(self, raw: object, path: str, cls: type[_C]) -> _C:
        """A section made only of plain keys, every one read by its spec."""
        m = self.section(raw, path, _key_names(cls))
        if m is None:
            return cls()
        return cls(**self.fields(m, path, cls))

    def dead_letter(self, raw: object, path: str) -> DeadLetterConfig:
        m = self.section(raw, path, _key_names(DeadLetterConfig))
        if m is None:
            return DeadLetterConfig()
        found = self.fields(m, path, DeadLetterConfig)
        # None when the key is given but invalid: no follow-on errors about it.
        backend = (
            found.get("backend") if "backend" in m else _field_default(DeadLetterConfig, "backend")
        )
        file_path = self.file_path(m, "path", path, None)
        if backend == "sqlite" and m.get("path") is None:
            self.error(f"{path}.path", "required when backend is 'sqlite'")
        elif backend in ("memory", "redis") and m.get("path") is not None:
            self.error(f"{path}.path", "only used with backend 'sqlite'")
        spool = self.file_path(m, "spool_path", path, None)
        if spool == ":memory:":
            self.error(f"{path}.spool_path", "must be a file: it keeps records across a crash")
            spool = None
        if backend != "redis" and m.get("spool_path") is not None:
            self.error(f"{path}.spool_path", "only used with backend 'redis'")
        return DeadLetterConfig(**found, path=file_path, spool_path=spool)

    def shared_state(self, raw: object, path: str) -> SharedStateConfig:
        m = self.section(raw, path, _key_names(SharedStateConfig))
        if m is None:
            return SharedStateConfig()
        found = self.fields(m, path, SharedStateConfig)
        if "url" in m:
            text = self.string(m["url"], f"{path}.url", show_value=False)
            if text is not None:
                # The URL is never quoted: it usually holds the Redis password.
                problem = _redis_url_problem(text)
                if problem:
                    self.error(f"{path}.url", problem)
                else:
                    found["url"] = text
        if "namespace" in m:
            text = self.string(m["namespace"], f"{path}.namespace")
            if text is not None:
                if not text or any(c.isspace() for c in text):
                    self.error(f"{path}.namespace", f"must be a word without spaces, got {text!r}")
                else:
                    found["namespace"] = text
        return SharedStateConfig(**found)

    def transport(self, raw: object, path: str) -> TransportConfig:
        m = self.section(raw, path, _key_names(TransportConfig))
        if m is None:
            return TransportConfig()
        # tls is read by self.tls below: it inherits and resolves file paths.
        found = self.fields({k: v for k, v in m.items() if k != "tls"}, path, TransportConfig)
        tls = self.tls(m["tls"], f"{path}.tls", TLSConfig()) if "tls" in m else None
        if tls is not None:
            found["tls"] = tls
        return TransportConfig(**found)

    def tls(self, raw: object, path: str, base: TLSConfig) -> TLSConfig | None:
        """TLS settings over ``base``: verify inherits alone, cert and key as a pair."""
        if raw is None:
            return None
        m = self.section(raw, path, _TLS_KEYS)
        if m is None:
            return None
        verify = base.verify
        if "verify" in m:
            value = m["verify"]
            if isinstance(value, bool):
                verify = value
            elif isinstance(value, str):
                bundle = self.file_path(m, "verify", path, None)
                if bundle is not None:
                    verify = bundle
            else:
                self.error(
                    f"{path}.verify",
                    f"must be true, false or the path of a CA bundle, got {show(value)}",
                )
        cert, key = base.cert, base.key
        if "cert" in m or "key" in m:
            cert = self.file_path(m, "cert", path, None)
            key = self.file_path(m, "key", path, None)
            if key is not None and m.get("cert") is None:
                self.error(f"{path}.key", "requires cert")
        return TLSConfig(verify=verify, cert=cert, key=key)

    # -- workers ---------------------------------------------------------------------

    def workers(
        self, raw: object, path: str, *, autobot: bool, tls_base: TLSConfig
    ) -> tuple[WorkerConfig, ...]:
        if raw is None:
            return ()
        if not isinstance(raw, list):
            self.error(path, f"must be a list of workers, got {show(raw)}")
            return ()
        read: list[tuple[int, WorkerConfig, str, bool]] = []
        for index, item in enumerate(raw):
            item_path = f"{path}[{index}]"
            worker, address_key, slugged = self.worker(
                item, item_path, autobot=autobot, tls_base=tls_base
            )
            if worker is not None:
                read.append((index, worker, address_key, slugged))
        read = _unique_slugs(read)
        built: list[WorkerConfig] = []
        ids: dict[str, int] = {}
        urls: dict[str, int] = {}
        for index, worker, address_key, _ in read:
            item_path = f"{path}[{index}]"
            if worker.id:
                if worker.id in ids:
                    self.error(
                        f"{item_path}.id",
                        f"duplicate id {worker.id!r} (also workers[{ids[worker.id]}])",
                    )
                else:
                    ids[worker.id] = index
            if worker.url:
                if worker.url in urls:
                    self.error(
                        f"{item_path}.{address_key}",
                        f"duplicate address {worker.url} (also workers[{urls[worker.url]}])",
                    )
                else:
                    urls[worker.url] = index
            built.append(worker)
        if autobot:
            built = _autobot_tiers(built)
        return tuple(built)

    def worker(
        self, raw: object, path: str, *, autobot: bool, tls_base: TLSConfig
    ) -> tuple[WorkerConfig | None, str, bool]:
        """One worker entry, the key its address came from (``url`` or ``host``), and
        whether its id was made from a display name with spaces (to be de-duplicated).

        Invalid fields are recorded as errors and left empty, so the caller can still
        check the rest of the list; such a worker is never returned to users.
        """
        allowed = _AUTOBOT_WORKER_KEYS if autobot else _WORKER_KEYS
        ignored = _AUTOBOT_IGNORED_KEYS if autobot else frozenset()
        if raw is None:
            self.error(path, "must be a mapping, got null")
            return None, "url", False
        m = self.section(raw, path, allowed, ignored)
        if m is None:
            return None, "url", False
        skipped = sorted(str(key) for key in m if key in ignored)
        if skipped:
            logger.debug("%s: ignoring AutoBot key(s) %s", path, ", ".join(skipped))

        name = self.display_name(m["name"], f"{path}.name") if "name" in m else ""
        worker_id, slugged = "", False
        if "id" in m:
            worker_id = self.identifier(m["id"], f"{path}.id")
        elif autobot and name:
            # AutoBot names a worker for people ("Windows NPU Worker (Main Machine)"):
            # the id becomes a slug of it, and the name stays for display.
            slugged = any(ch.isspace() for ch in name)
            worker_id = _slug(name) if slugged else name
        elif not autobot:
            self.error(f"{path}.id", "required")

        url, address_key = self.address(m, path)
        if not worker_id and autobot and "id" not in m and "name" not in m and url:
            worker_id = urlsplit(url).netloc

        if autobot:
            priority = self.integer(
                m, "priority", path, _AUTOBOT_DEFAULT_PRIORITY, limit=_AUTOBOT_PRIORITY
            )
            if "max_concurrent" in m and "max_concurrent_tasks" in m:
                self.error(path, "give max_concurrent or max_concurrent_tasks, not both")
            capacity_key = (
                "max_concurrent_tasks" if "max_concurrent_tasks" in m else "max_concurrent"
            )
        else:
            priority = self.integer(m, "priority", path, 1, limit=_worker_limit("priority"))
            capacity_key = "max_concurrent"
        max_concurrent = self.integer(
            m, capacity_key, path, DEFAULT_MAX_CONCURRENT, limit=_worker_limit("max_concurrent")
        )
        # The plain keys (enabled, weight, platform, protocol), read by their specs.
        plain = self.fields(
            {key: m[key] for key in _PLAIN_WORKER_KEYS if key in m}, path, WorkerConfig
        )
        headers = self.headers(m.get("headers"), f"{path}.headers")
        tls = self.tls(m.get("tls"), f"{path}.tls", tls_base)
        auth = self.auth(m.get("auth"), f"{path}.auth", headers)
        return (
            WorkerConfig(
                id=worker_id,
                url=url,
                priority=priority,
                max_concurrent=max_concurrent,
                headers=headers,
                tls=tls,
                name=name,
                auth=auth,
                **plain,
            ),
            address_key,
            slugged,
        )

    def display_name(self, raw: object, path: str) -> str:
        value = self.string(raw, path)
        if value is None:
            return ""
        if not value.strip() or len(value) > 200 or not value.isprintable():
            self.error(path, f"must be 1..200 printable characters, got {show(raw)}")
            return ""
        return value

    def auth(self, raw: object, path: str, headers: Mapping[str, str]) -> AuthConfig:
        """A worker's request auth. Secrets are never quoted, and in a file must come
        from the environment, so that the file itself (often rewritten by an admin UI,
        copied into tickets, committed) never holds them.
        """
        m = self.section(raw, path, _key_names(AuthConfig))
        if not m:
            return AuthConfig()
        found = self.fields(m, path, AuthConfig)
        kind = found.get("type") if "type" in m else "none"
        needed = {"bearer": ("token",), "hmac": ("service_id", "secret")}.get(str(kind), ())
        values: dict[str, Any] = {}
        for key in ("token", "service_id", "secret"):
            if key not in m:
                if key in needed:
                    self.error(f"{path}.{key}", f"required when type is {kind!r}")
                continue
            if kind is not None and key not in needed:
                self.error(f"{path}.{key}", f"not used with type {kind!r}")
                continue
            values[key] = self.credential(m[key], f"{path}.{key}", secret=key != "service_id")
        if kind in _AUTH_HEADERS:
            for header in headers:
                if header.lower() in _AUTH_HEADERS[str(kind)]:
                    self.error(
                        f"{path}.type",
                        f"{kind!r} sets the {header} header, which headers sets too: keep one",
                    )
        return AuthConfig(**found, **values)

    def credential(self, raw: object, path: str, *, secret: bool) -> str | None:
        """A token, secret or service id: printable ASCII without spaces. A secret is
        never quoted, and in a file must be a ``${NAME}`` reference.
        """
        if secret and self.expand and not (isinstance(raw, str) and _ENV_ONLY.fullmatch(raw)):
            self.error(
                path,
                "must come from the environment, written as ${NAME} (the value is not "
                "shown): a secret is not kept in the file",
            )
            return None
        value = self.string(raw, path, show_value=not secret)
        if value is None:
            return None
        if not value or not value.isascii() or not value.isprintable() or " " in value:
            shown = "the value is not shown" if secret else f"got {show(raw)}"
            self.error(path, f"must be printable ASCII without spaces ({shown})")
            return None
        return value

    def identifier(self, raw: object, path: str) -> str:
        value = self.string(raw, path)
        if value is None:
            return ""
        if (
            not value
            or len(value) > 200
            or any(ch.isspace() or not ch.isprintable() for ch in value)
        ):
            self.error(
                path,
                f"must be 1..200 printable characters without spaces, got {show(raw)}",
            )
            return ""
        return value

    def address(self, m: Mapping[Any, Any], path: str) -> tuple[str, str]:
        """The worker's normalised URL ('' when invalid) and the key it came from."""
        if "url" in m and "host" in m:
            self.error(path, "give url or host (with port), not both")
            return "", "url"
        if "url" in m:
            for key in ("port", "scheme"):
                if key in m:
                    self.error(f"{path}.{key}", "goes with host, not url: put it in the url")
            raw = m["url"]
            text = self.string(raw, f"{path}.url")
            if text is None:
                return "", "url"
            url, problem = _normalise_url(text)
            if problem:
                self.error(f"{path}.url", problem.replace("{got}", show(raw)))
            return url, "url"
        if "host" in m:
            mark = len(self.errors)
            raw = m["host"]
            host = self.string(raw, f"{path}.host")
            scheme = "http"
            if "scheme" in m:
                value = self.string(m["scheme"], f"{path}.scheme")
                if value is not None:
                    scheme = self.choice(
                        value.lower(), m["scheme"], f"{path}.scheme", ("http", "https")
                    )
            # AutoBot's worker serves plain HTTP on 8081 and TLS on 8444.
            default_port = DEFAULT_TLS_PORT if scheme == "https" else DEFAULT_PORT
            port = self.integer(m, "port", path, default_port, limit=_PORT)
            if host is None:
                return "", "host"
            normal, problem = _normalise_host(host)
            if problem:
                self.error(f"{path}.host", problem.replace("{got}", show(raw)))
            # A fallback port or scheme would make a false duplicate-address error.
            if len(self.errors) > mark:
                return "", "host"
            return f"{scheme}://{normal}:{port}", "host"
        self.error(path, "needs a url, or a host (and port)")
        return "", "url"

    def headers(self, raw: object, path: str) -> Mapping[str, str]:
        m = self.section(raw, path, ())
        if not m:
            return _no_headers()
        found: dict[str, str] = {}
        seen: dict[str, str] = {}
        for name, value in m.items():
            item_path = f"{path}.{name}"
            if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
                self.error(item_path, "is not a valid header name")
                continue
            lowered = name.lower()
            if lowered in _RESERVED_HEADERS:
                self.error(item_path, "is set by npu_sync itself and cannot be configured")
                continue
            if lowered in seen:
                self.error(item_path, f"duplicate header (also {seen[lowered]!r})")
                continue
            seen[lowered] = name
            text = self.string(value, item_path, show_value=False)
            if text is None:
                continue
            if any(ch in text for ch in "\r\n\0"):
                # The value is never echoed: headers are where credentials live.
                self.error(item_path, "must not contain line breaks or NUL characters")
                continue
            if not text.isascii() or not text.isprintable():
                # It could not be sent (HTTP header values are bytes, and workers decode
                # anything past ASCII differently): every task would be refused for it.
                self.error(item_path, "must be printable ASCII (the value is not shown)")
                continue
            found[name] = text
        return MappingProxyType(found)

    # -- leaves ----------------------------------------------------------------------

    def section(
        self,
        raw: object,
        path: str,
        allowed: Collection[str],
        ignored: Collection[str] = (),
    ) -> Mapping[Any, Any] | None:
        """The mapping at ``path`` (an absent or null one is empty), unknown keys reported.

        An empty ``allowed`` accepts any key (free-form maps such as headers).
        """
        if raw is None:
            return {}
        if not isinstance(raw, Mapping):
            self.error(path, f"must be a mapping, got {show(raw)}")
            return None
        if allowed:
            for key in raw:
                if key not in allowed and key not in ignored:
                    self.error(_join(path, key), _unknown(key, allowed))
        return raw

    def expand_text(self, text: str, path: str) -> str | None:
        if not self.expand:
            return text
        value, problems = _expand(text, os.environ)
        for problem in problems:
            self.error(path, problem)
        return None if problems else value

    def string(self, raw: object, path: str, *, show_value: bool = True) -> str | None:
        if not isinstance(raw, str):
            got = show(raw) if show_value else _kind(raw)
            self.error(path, f"must be a string, got {got}")
            return None
        return self.expand_text(raw, path)

    def scalar(self, raw: object, path: str) -> object:
        """``raw``, or for a string holding ``${...}`` its expansion read as a YAML scalar.

        That lets ``port: ${NPU_PORT:-8081}`` be an integer; returns _INVALID when the
        expansion itself failed (the error is recorded).
        """
        if not (self.expand and isinstance(raw, str) and "${" in raw):
            return raw
        text = self.expand_text(raw, path)
        if text is None:
            return _INVALID
        return _scalar(text)

    def integer(
        self, m: Mapping[Any, Any], key: str, path: str, default: int, *, limit: Range
    ) -> int:
        """The integer at ``m[key]`` within ``limit``; ``default`` when absent or invalid."""
        checked = self.bounded(m, key, path, limit)
        return default if checked is None else int(checked)

    def bounded(
        self, m: Mapping[Any, Any], key: str, path: str, limit: Range | None
    ) -> int | float | None:
        """``m[key]`` checked against ``limit``; None when it is absent or invalid (the
        error is recorded).
        """
        if key not in m or limit is None:
            return None
        item_path, raw = f"{path}.{key}", m[key]
        value = self.scalar(raw, item_path)
        if value is _INVALID:
            return None
        checked = limit.check(value)
        if isinstance(checked, str):
            self.error(item_path, f"{checked}, got {show(raw)}")
            return None
        return checked

    # The leaves below return ``default`` for an absent or invalid value; the generic
    # reader passes _INVALID to tell the two apart, hence ``Any``.
    def boolean(self, m: Mapping[Any, Any], key: str, path: str, default: Any) -> Any:
        if key not in m:
            return default
        item_path, raw = f"{path}.{key}", m[key]
        value = self.scalar(raw, item_path)
        if value is _INVALID:
            return default
        if not isinstance(value, bool):
            self.error(item_path, f"must be true or false, got {show(raw)}")
            return default
        return value

    def choice(
        self, value: str, raw: object, path: str, options: tuple[str, ...], default: Any = None
    ) -> Any:
        if value in options:
            return value
        self.error(path, f"must be one of {', '.join(map(repr, options))}, got {show(raw)}")
        return options[0] if default is None else default

    def endpoint(self, m: Mapping[Any, Any], key: str, path: str, default: Any) -> Any:
        if key not in m:
            return default
        raw = m[key]
        value = self.string(raw, f"{path}.{key}")
        if value is None:
            return default
        if not value.startswith("/") or any(ch.isspace() for ch in value):
            self.error(f"{path}.{key}", f"must be a path starting with '/', got {show(raw)}")
            return default
        return value

    def file_path(
        self, m: Mapping[Any, Any], key: str, path: str, default: str | None
    ) -> str | None:
        """An optional file path, stored absolute (``:memory:`` is kept as is)."""
        if key not in m or m[key] is None:
            return default
        raw = m[key]
        value = self.string(raw, f"{path}.{key}")
        if value is None:
            return default
        if not value:
            self.error(f"{path}.{key}", "must be a non-empty path")
            return default
        if value == ":memory:":
            return value
        value = os.path.expanduser(value)
        if not os.path.isabs(value):
            value = os.path.join(self.base_dir or os.getcwd(), value)
        return os.path.abspath(value)


# ---------------------------------------------------------------------------------------
# Helpers


def _slug(name: str) -> str:
    """A worker id made from a display name: ``Windows NPU Worker (Main)`` becomes
    ``windows-npu-worker-main``."""
    slug = re.sub(r"[^a-z0-9._]+", "-", name.lower()).strip("-.")
    return slug[:200] or "worker"


def _unique_slugs(
    read: list[tuple[int, WorkerConfig, str, bool]],
) -> list[tuple[int, WorkerConfig, str, bool]]:
    """Give each id made from a display name a numbered suffix when it is taken.

    Ids written in the file keep precedence: a duplicate among those stays an error.
    """
    taken = {worker.id for _, worker, _, slugged in read if not slugged}
    out = []
    for index, worker, key, slugged in read:
        if slugged:
            wanted, n = worker.id, 2
            while wanted in taken:
                wanted, n = f"{worker.id[:195]}-{n}", n + 1
            taken.add(wanted)
            worker = replace(worker, id=wanted)
        out.append((index, worker, key, slugged))
    return out


def _autobot_tiers(workers: list[WorkerConfig]) -> list[WorkerConfig]:
    """Map AutoBot priorities (higher preferred) onto tiers 1, 2, ... (lower preferred)."""
    ranked = sorted({worker.priority for worker in workers}, reverse=True)
    tier = {priority: index for index, priority in enumerate(ranked, start=1)}
    return [replace(worker, priority=tier[worker.priority]) for worker in workers]


def _expand(text: str, environ: Mapping[str, str]) -> tuple[str, list[str]]:
    """Replace ``${NAME}``, ``${NAME:-default}`` and ``$$`` in ``text``.

    Returns the expanded text and the problems found. A ``$`` followed by anything
    else is kept as is. Problems name variables, never their values.
    """
    out: list[str] = []
    problems: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        following = text[i + 1] if i + 1 < n else ""
        if ch != "$" or following not in ("$", "{"):
            out.append(ch)
            i += 1
            continue
        if following == "$":
            out.append("$")
            i += 2
            continue
        end = text.find("}", i + 2)
        if end < 0:
            problems.append("unterminated '${' (write '$$' for a literal '$')")
            break
        body = text[i + 2 : end]
        name, has_default, default = body.partition(":-")
        i = end + 1
        if not _VAR_NAME.fullmatch(name):
            problems.append(f"invalid variable reference '${{{body}}}'")
            continue
        value = environ.get(name)
        if has_default and not value:
            out.append(default)
        elif value is None:
            problems.append(f"environment variable {name} is not set")
        else:
            out.append(value)
    return "".join(out), problems


def _scalar(text: str) -> object:
    """Read an expanded string the way YAML reads a plain scalar: bool, int, float or str."""
    stripped = text.strip()
    lowered = stripped.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(stripped)
        except ValueError:
            pass
    return text


def _normalise_url(text: str) -> tuple[str, str | None]:
    """``scheme://host:port[/base/path]`` for a worker URL, or ('', problem with a {got} slot)."""
    if "://" not in text:
        return "", "must be an http(s) URL such as http://host:8081, got {got}"
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        return "", "has an invalid port, got {got}"
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        return "", f"scheme must be 'http' or 'https', got {show(parts.scheme)}"
    if parts.username is not None or parts.password is not None:
        # Not echoed: it holds a credential. Headers are the place for those.
        return "", "must not contain credentials (set an Authorization header instead)"
    if parts.query or parts.fragment or "?" in text or "#" in text:
        return "", "must be scheme://host:port[/base/path] with no query or fragment, got {got}"
    base = parts.path.rstrip("/")
    if base and not _BASE_PATH.fullmatch(base):
        return "", (
            "has a base path that is not plain /segments (letters, digits, - . _ ~ and "
            "%XX escapes; no . or .. segments), got {got}"
        )
    host = parts.hostname
    if not host:
        return "", "has no host, got {got}"
    normal, problem = _normalise_host(host)
    if problem:
        return "", problem
    if port is None:
        port = 443 if scheme == "https" else 80
    if not 1 <= port <= 65535:
        return "", "port must be 1..65535, got {got}"
    return f"{scheme}://{normal}:{port}{base}", None


# A base path is sent as it is, ahead of every request path: nothing a worker or a
# proxy could read two ways (no empty, . or .. segments, nothing to escape).
_BASE_PATH = re.compile(r"(?:/(?!\.{1,2}(?:/|$))(?:[A-Za-z0-9\-._~]|%[0-9A-Fa-f]{2})+)+")


def _redis_url_problem(text: str) -> str | None:
    """What is wrong with a Redis URL, without quoting it; None when usable."""
    if not text.startswith(("redis://", "rediss://", "unix://")):
        return "must start with redis://, rediss:// or unix://"
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        return "has an invalid port (must be 1..65535)"
    if parts.scheme == "unix":
        return None if parts.path else "needs the socket's path (unix:///run/redis.sock)"
    if port is not None and not 1 <= port <= 65535:
        return "has an invalid port (must be 1..65535)"
    if not parts.hostname:
        return "has no host"
    db = parts.path.strip("/")
    if db and not db.isdigit():
        return "has a database that is not a number (the path is the database, e.g. /0)"
    return None


def _normalise_host(host: str) -> tuple[str, str | None]:
    """The host as it goes in a URL (IPv6 bracketed, lower case), or ('', problem)."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if ":" in bare:
        try:
            address = ipaddress.IPv6Address(bare)
        except ValueError:
            return "", "must be a host name or IP address, got {got}"
        return f"[{address.compressed}]", None
    labels = bare.rstrip(".").split(".")
    if len(bare) > 253 or not all(
        len(label) <= 63 and _HOST_NAME.fullmatch(label) for label in labels
    ):
        return "", "must be a host name or IP address, got {got}"
    return bare.lower(), None


def _auth_mapping(auth: AuthConfig) -> dict[str, Any]:
    found = {"type": auth.type, "token": auth.token}
    found.update(service_id=auth.service_id, secret=auth.secret)
    return {key: value for key, value in found.items() if value is not None}


def _tls_mapping(tls: TLSConfig) -> dict[str, Any]:
    return {"verify": tls.verify, "cert": tls.cert, "key": tls.key}


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _unknown(key: object, allowed: Collection[str]) -> str:
    message = "unknown key"
    if isinstance(key, str):
        close = difflib.get_close_matches(key, sorted(allowed), n=1)
        if close:
            message += f" (did you mean {close[0]!r}?)"
    return message


def _kind(value: object) -> str:
    """What sort of value this is, for messages that must not quote it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return f"a {type(value).__name__}"
