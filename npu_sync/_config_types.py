"""The configuration's frozen dataclasses, each key declared once on its field.

Every field says its type, default, bounds, a one-line description and the AutoBot key
it maps from (see :mod:`npu_sync._schema`); the YAML reader, the constructors' checks
and the key tables of ``docs/configuration.md`` all come from these declarations.
Import the classes from :mod:`npu_sync.config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final, cast
from urllib.parse import urlsplit

from npu_sync._schema import (
    SPEC,
    Range,
    Spec,
    boolean,
    check_fields,
    choice,
    custom,
    endpoint,
    integer,
    number,
    optional_boolean,
    optional_number,
    section,
    show,
)
from npu_sync.errors import ConfigError, scrub

DEFAULT_PORT: Final = 8081
"""The port a worker given by ``host`` listens on unless ``port`` says otherwise."""

DEFAULT_TLS_PORT: Final = 8444
DEFAULT_WINDOWS_PORT: Final = 8082  # AutoBot's Windows worker
"""The port of a worker given by ``host`` with ``scheme: https`` and no ``port``:
AutoBot's worker serves TLS there."""

DEFAULT_MAX_CONCURRENT: Final = 32
"""Tasks in flight on one worker at once unless its ``max_concurrent`` says otherwise."""

MAX_LABEL: Final = 100
"""The longest capability, tag key or tag value, in characters."""

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
                    default_text=(
                        "`8081`; `8082` for the Windows protocol; `8444` with `scheme: https`"
                    ),
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
    capabilities: tuple[str, ...] = custom(
        (),
        "what the worker can run (`llm`, `vision`, `audio`, ...): a task that `requires` "
        "one goes only to workers that list it",
        type_text="list of str",
        default_text="`[]`",
        allowed_text=f"names of 1..{MAX_LABEL} printable characters, no spaces, no `=`",
        autobot="capabilities",
        autobot_note="as is",
    )
    # Unhashable, so it takes no part in hash(); equality still compares it.
    tags: Mapping[str, str] = field(
        default_factory=_no_headers,
        hash=False,
        metadata={
            SPEC: Spec(
                "custom",
                "labels a task can require or prefer as `key=value` (`location: lab`, `cost: low`)",
                type_text="map str → str",
                default_text="`{}`",
                allowed_text=f"keys and values of 1..{MAX_LABEL} printable characters, no "
                "spaces, no `=`; numbers are read as their text",
                autobot="tags",
                autobot_note="as is",
            )
        },
    )

    max_models: int | None = custom(
        None,
        "models this worker may hold at once (placement evicts the coldest first); it wins "
        "over the `max_models` the worker's `GET /models` (or health) answer reports; null: "
        "that reported cap, else one learnt from a `507` to a load, else `models.max_models`",
        type_text="int or null",
        default_text="null",
        allowed_text="`1..10000`",
    )

    def __post_init__(self) -> None:
        # A caller's dict must not be able to change a frozen config behind its back.
        if not isinstance(self.headers, MappingProxyType):
            object.__setattr__(self, "headers", MappingProxyType(dict(self.headers)))
        _freeze_labels(self)
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


def bad_label(value: object) -> str | None:
    """Why ``value`` cannot be a capability, tag key or tag value; None when it can."""
    if not isinstance(value, str):
        return f"must be a string, got {type(value).__name__}"
    if not 0 < len(value) <= MAX_LABEL:
        return f"must be 1..{MAX_LABEL} characters, got {len(value)}"
    if not value.isprintable() or any(ch.isspace() for ch in value) or "=" in value:
        return f"must be printable, without spaces or '=', got {value!r}"
    return None


def _freeze_labels(config: WorkerConfig) -> None:
    """Check and freeze a worker's capabilities (sorted, unique) and tags."""
    caps = config.capabilities
    if isinstance(caps, str):
        raise ConfigError(f"worker.capabilities: must be a list of names, got {caps!r}")
    for cap in caps:
        why = bad_label(cap)
        if why:
            raise ConfigError(f"worker.capabilities: {why}")
    object.__setattr__(config, "capabilities", tuple(sorted(set(caps))))
    most = config.max_models
    if most is not None and (
        isinstance(most, bool) or not isinstance(most, int) or not 0 < most <= 10_000
    ):
        raise ConfigError(f"worker.max_models: must be 1..10000, got {most!r}")
    for key, value in config.tags.items():
        why = bad_label(key) or bad_label(value)
        if why:
            raise ConfigError(f"worker.tags.{key}: {why}")
    if not isinstance(config.tags, MappingProxyType):
        object.__setattr__(config, "tags", MappingProxyType(dict(config.tags)))


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """The health checker's settings. Immutable, so thread-safe."""

    enabled: bool = boolean(
        True,
        "run the background health checker (a reload can turn it on or off)",
        autobot="health_monitoring.enabled",
        autobot_note="as is",
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
        autobot_also=(("health_monitoring.check_interval", "as is (seconds)"),),
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
        autobot_also=(("health_monitoring.timeout", "as is (seconds)"),),
    )
    unhealthy_threshold: int = integer(
        2,
        1,
        1000,
        "consecutive failed checks that mark a worker unhealthy",
        autobot="health_monitoring.failure_threshold",
        autobot_note="as is: consecutive failed checks",
    )
    healthy_threshold: int = integer(
        1, 1, 1000, "consecutive passed checks that mark it healthy again"
    )
    endpoint: str = endpoint("/health", "path of the health check (`GET`)")
    concurrency: int = integer(
        32,
        1,
        4096,
        "checks in flight at once: the threads, and the sockets, health checks use. Each "
        "worker is checked once per `interval` at an offset of its own, so the checks of "
        "a large fleet spread over the interval (see "
        "[operations.md](operations.md#health-checks-of-a-large-fleet))",
    )

    def __post_init__(self) -> None:
        check_fields(self, "health")


@dataclass(frozen=True, slots=True)
class TrialConfig:
    """How long a half-open breaker's trial may take: the trial deadline (see
    :class:`npu_sync._stall.TrialDeadline`). Immutable, so thread-safe."""

    multiplier: float = number(
        5.0,
        1,
        1000,
        "the trial deadline, as a multiple of the worker's p99 latency before it opened",
    )
    floor: float = number(
        1.0,
        0,
        3600,
        "the shortest trial deadline",
        above=True,
        unit="s",
    )
    cap: float = number(
        10.0,
        0,
        3600,
        "the longest trial deadline (never more than `timeouts.read`), and the deadline "
        "of a worker whose latency is not known, nor its tier's",
        above=True,
        unit="s",
        at_least="floor",
    )

    def __post_init__(self) -> None:
        check_fields(self, "circuit_breaker.trial")


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """Per-worker circuit breaker settings. Immutable, so thread-safe."""

    fail_max: int = integer(
        5,
        1,
        10_000,
        "consecutive worker failures, in one process, that open a worker's breaker (with "
        "`shared_state`, the opening is shared, never the count)",
        autobot="circuit_breaker.failure_threshold",
        autobot_note="as is: consecutive failures that open the breaker",
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
        autobot_also=(
            ("circuit_breaker.retry_timeout", "as is: the time open before a trial task"),
        ),
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
    trial: TrialConfig = section(
        TrialConfig, "the deadline of the one trial a half-open worker gets"
    )

    def __post_init__(self) -> None:
        check_fields(self, "circuit_breaker")


@dataclass(frozen=True, slots=True)
class StallConfig:
    """When an attempt that has gone silent is ended and retried elsewhere (see
    :mod:`npu_sync._stall`). Immutable, so thread-safe."""

    enabled: bool = boolean(
        True,
        "end an attempt whose worker has sent no byte of its answer for far longer than "
        "its recent latency, and retry it elsewhere",
    )
    multiplier: float = number(
        5.0,
        1,
        1000,
        "the silence allowed, as a multiple of the worker's recent `percentile` latency",
    )
    percentile: float = number(
        0.99, 0.5, 0.999, "the percentile of the worker's recent successful attempts"
    )
    floor: float = number(
        1.0,
        0,
        3600,
        "the least silence ever allowed",
        above=True,
        unit="s",
    )
    unknown: float | None = optional_number(
        0,
        _DAY,
        "the silence allowed while no latency is known for a worker nor its tier (a "
        "pool's first tasks); null: only `timeouts.read` cuts such an attempt",
        above=True,
        unit="s",
    )
    declared_share: float = number(
        0.5,
        0,
        1,
        "a task that declares its own timeout may be silent for this share of it (the "
        "rest leaves time to retry); `0` ignores declared timeouts",
    )

    def __post_init__(self) -> None:
        check_fields(self, "retry.stall")


@dataclass(frozen=True, slots=True)
class RetryConfig:
    """Retry settings; ``max_retries`` counts attempts after the first. Immutable."""

    max_retries: int = integer(
        3,
        0,
        100,
        "attempts after the first, each on a worker not yet tried",
        autobot="load_balancing.max_retries",
        autobot_note="as is: retries when a worker fails, each on another worker",
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
    stall: StallConfig = section(StallConfig, "ending attempts that have gone silent")

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
        autobot="load_balancing.request_timeout",
        autobot_note="as is: the budget of one request to a worker. A task's whole deadline "
        "is still `timeouts.task` (25 s by default): raise it too for longer requests",
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
    # redis only: the base path of the local SQLite files (one per process) holding
    # records while Redis cannot take them; None puts them under the system's temporary
    # directory, keyed by the Redis address and namespace (see docs/deployment.md).
    spool_path: str | None = custom(
        None,
        "where records wait, durably, while Redis cannot take them: each process writes "
        "the SQLite file `<spool_path>.<32 hex>` of its own beside this path (and moves "
        "a file here left by earlier versions); see "
        "[deployment.md](deployment.md#when-redis-fails)",
        hot=False,
        type_text=_FILE,
        default_text="`<tmp>/npu_sync-<uid>/<namespace>-<key>.spool`, `key` a hash of "
        "the Redis address and namespace",
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
        allowed_text="`redis://`, `rediss://`, `unix://`, `redis+sentinel://` (`host:port,…"
        "/service[/db]`), `redis+cluster://` (`host:port,…`), and `rediss+` for TLS; port "
        "`1..65535`, database a number",
    )
    namespace: str = custom(
        "npu_sync",
        "key prefix: pools with the same namespace share state, others are apart",
        hot=False,
        allowed_text="no spaces, no `{` or `}`",
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
    names far fewer workers. The rules (:class:`npu_sync._guard.ReloadGuard`) judge the
    pool a reload would leave: no enabled worker, or fewer than the running pool's
    enabled workers by more than ``max_removed_share``, is refused. A key left out
    (None) takes the pool's own setting: the ``reload_guard`` argument of the pool,
    else the ``NPU_SYNC_RELOAD_*`` environment, else the built-in default; a key the
    new file gives wins for that reload.
    """

    allow_empty: bool | None = optional_boolean(
        "let a reload of the file leave the pool with no enabled worker; without it such a "
        "reload is refused (see [operations.md](operations.md#what-a-reload-refuses))",
        default_text="the pool's setting, else `false`",
    )
    max_removed_share: float | None = optional_number(
        0,
        1,
        "the largest share by which one reload of the file may shrink the running pool's "
        "enabled workers (those the file named); more is refused. Replacing a worker by "
        "another is no loss. `0` refuses any shrinking, `1` allows any",
        default_text="the pool's setting, else `0.5`",
    )
    handover_timeout: float | None = optional_number(
        0,
        86400,
        "how long workers a reload removed keep taking tasks while none of the workers it "
        "added has passed a health check; after it, the removed workers drain as soon as "
        "one new worker passes (see [operations.md](operations.md#replacing-workers))",
        above=True,
        unit="s",
        default_text="the pool's setting, else `120`",
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
    # Go's net/http keeps 100 idle connections in all (MaxIdleConns); with the health
    # checks' sockets, the tasks' and a process's own files this stays under the
    # 1024 descriptors of a default `ulimit -n`.
    max_idle_connections: int = integer(
        128,
        0,
        1_000_000,
        "idle keep-alive connections kept for reuse across all workers together; a "
        "connection released beyond it is closed. Idle connections are also closed when "
        "`idle_timeout` passes or the worker closes them (swept every second; see "
        "[transport.md](transport.md#idle-connections))",
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


STRATEGIES: Final = (
    "least-loaded",
    "round-robin",
    "weighted",
    "priority",
    "weighted-random",
    "priority-failover",
)
"""The ways to pick a worker within a tier (``balancing.strategy``), declared once."""

CONCURRENCY_LIMITS: Final = ("fixed", "hill-climbing", "aimd", "gradient2")
"""The limits a worker's concurrency may follow (``balancing.concurrency_limit``)."""


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
        STRATEGIES,
        "how a worker is chosen within the preferred tier",
        autobot="load_balancing.strategy",
        autobot_note="as is: AutoBot's `least-loaded`, `round-robin`, `priority`, `weighted`, "
        "and the example file's `weighted-random` and `priority-failover` (see "
        "[balancing.md](balancing.md#strategies))",
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
    peak_hold: float = number(
        1.0,
        0,
        3600,
        "seconds a slow answer's peak is held after a worker's last answer; then an idle "
        "worker's estimate falls back to its typical latency (the median of its recent "
        "answers). `0`: only the decay lowers it",
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
    # Read as None when the file does not give it, so that a file giving both keys is
    # judged on what it says; always a bool once built.
    adaptive_concurrency: bool = cast(
        bool,
        optional_boolean(
            "find each worker's concurrency from its throughput; `max_concurrent` becomes "
            "a ceiling. The older spelling of `concurrency_limit: hill-climbing`: `true` "
            "with another `concurrency_limit`, or `false` with `hill-climbing`, is refused",
            default_text="`false`",
        ),
    )
    hedge: HedgeConfig = section(HedgeConfig, "hedged requests")
    # None when not given, as adaptive_concurrency; always one of the names once built.
    concurrency_limit: str = choice(
        cast(str, None),
        CONCURRENCY_LIMITS,
        "how many tasks each worker may have in flight: `fixed`, its `max_concurrent`; "
        "`hill-climbing`, `aimd` or `gradient2`, a limit learned from its answers under "
        "`max_concurrent` (see [balancing.md](balancing.md#choosing-a-limit))",
        nullable=True,
        default_text="`fixed`",
    )

    def __post_init__(self) -> None:
        check_fields(self, "balancing")
        # adaptive_concurrency is the older spelling of hill-climbing: true means it,
        # false means another limit (fixed unless concurrency_limit names one). Built,
        # the two always agree, so that dataclasses.replace() builds them again.
        limit = cast("str | None", self.concurrency_limit)
        adaptive = cast("bool | None", self.adaptive_concurrency)
        if limit is not None and limit not in CONCURRENCY_LIMITS:
            raise ConfigError(
                f"balancing.concurrency_limit: must be one of {', '.join(CONCURRENCY_LIMITS)}, "
                f"got {show(limit)}"
            )
        if adaptive is not None and not isinstance(adaptive, bool):
            raise ConfigError(
                f"balancing.adaptive_concurrency: must be true or false, got {show(adaptive)}"
            )
        if limit is None:
            limit = "hill-climbing" if adaptive else "fixed"
        elif adaptive is not None and adaptive != (limit == "hill-climbing"):
            raise ConfigError(
                f"balancing.adaptive_concurrency: {show(adaptive)} contradicts "
                f"balancing.concurrency_limit: {limit} (adaptive_concurrency: true means "
                "hill-climbing): give concurrency_limit alone"
            )
        object.__setattr__(self, "adaptive_concurrency", limit == "hill-climbing")
        object.__setattr__(self, "concurrency_limit", limit)


@dataclass(frozen=True, slots=True)
class ModelPolicy:
    """Placement targets of one model (``models.catalog.<id>``). Immutable.

    ``min_replicas``/``max_replicas`` are written ``replicas: {min: 1, max: 3}``:
    how many workers should hold the model at least and at most. ``max_replicas``
    None: as many as the load asks for."""

    min_replicas: int = 0
    max_replicas: int | None = None

    def __post_init__(self) -> None:
        for name, value in (("min", self.min_replicas), ("max", self.max_replicas)):
            if value is None and name == "max":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 10_000:
                raise ConfigError(f"replicas.{name}: must be an integer 0..10000, got {value!r}")
        if self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise ConfigError(
                f"replicas.max: must be >= replicas.min ({self.min_replicas}), "
                f"got {self.max_replicas}"
            )


def _no_catalog() -> Mapping[str, ModelPolicy]:
    return MappingProxyType({})


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
    model_latency: bool = boolean(
        True,
        "learn each worker's latency per model (and per unit of a task's `size`) and send "
        "a task naming a model to the worker fastest for it",
        hot=False,
    )
    latency_models: int = integer(
        32,
        1,
        10_000,
        "models whose latency is remembered per worker; the least recently used is forgotten",
        hot=False,
    )

    balance: bool = boolean(
        False,
        "run placement rounds: keep each model between its replica targets, add a "
        "replica where load outgrows the ones it has, drop one gone cold, evict the "
        "coldest model of a full worker (see [placement.md](placement.md))",
        hot=False,
    )
    interval: float = number(
        10.0, 0, 3600, "seconds between placement rounds (jittered)", above=True, unit="s"
    )
    hold: float = number(
        60.0,
        0,
        _DAY,
        "a model is not unloaded within this time of being loaded on a worker (no thrash)",
        unit="s",
    )
    idle: float = number(
        120.0,
        0,
        _DAY,
        "a replica that served no task for this long is cold: removed down to the model's `min`",
        above=True,
        unit="s",
    )
    scale_up: float = number(
        0.75,
        0,
        1,
        "add a replica when a model's tasks in flight reach this share of its replicas' capacity",
        above=True,
    )
    scale_down: float = number(
        0.25,
        0,
        1,
        "drop a replica when the model's tasks in flight would fit in one fewer at this share",
    )
    max_models: int | None = custom(
        None,
        "models one worker may hold at once, for a worker with no `max_models` of its own, "
        "none reported in its `GET /models` (or health) answer and none learnt from a `507` "
        "to a load; null: no limit until a `507` teaches one",
        type_text="int or null",
        default_text="null",
        allowed_text="`1..10000`",
    )
    loads_per_round: int = integer(
        1, 1, 1000, "the most loads one placement round starts (the rest wait for the next)"
    )
    # Unhashable, so it takes no part in hash(); equality still compares it.
    catalog: Mapping[str, ModelPolicy] = field(
        default_factory=_no_catalog,
        hash=False,
        metadata={
            SPEC: Spec(
                "custom",
                "per model id, its replica targets: `{llama-3b: {replicas: {min: 1, max: 3}}}`",
                type_text="map model id → `{replicas: {min, max}}`",
                default_text="`{}`",
                allowed_text="`min` `0..10000` (default 0), `max` `min..10000` or null (default)",
            )
        },
    )

    def __post_init__(self) -> None:
        check_fields(self, "models")
        if self.max_models is not None and (
            isinstance(self.max_models, bool)
            or not isinstance(self.max_models, int)
            or not 1 <= self.max_models <= 10_000
        ):
            raise ConfigError(f"models.max_models: must be 1..10000, got {self.max_models!r}")
        if not isinstance(self.catalog, MappingProxyType):
            object.__setattr__(self, "catalog", MappingProxyType(dict(self.catalog)))

    def policy(self, model: str) -> ModelPolicy:
        """The targets of ``model``: its catalog entry, else no minimum and no maximum."""
        return self.catalog.get(model) or _ANY_POLICY


_ANY_POLICY: Final = ModelPolicy()


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """How a pool samples its last minutes and, with shared state in Redis, publishes
    its snapshot for the fleet view (see docs/metrics.md). Immutable, so thread-safe.
    The ``NPU_SYNC_FLEET*`` environment variables override these keys."""

    mode: str = choice(
        "on",
        ("on", "manual", "off"),
        "`on`: sample on a thread of its own; `manual`: only when `tick()` is called; "
        "`off`: no history and no snapshot",
        hot=False,
    )
    interval: float = number(
        5.0, 0.05, 3600, "seconds between samples (and snapshots)", unit="s", hot=False
    )
    ttl: float | None = optional_number(
        0,
        86400,
        "seconds a snapshot outlives its process; null: three times `interval`",
        above=True,
        unit="s",
        hot=False,
    )
    points: int = integer(120, 2, 10_000, "samples kept per worker", hot=False)
    timeout: float = number(
        1.0,
        0.05,
        30,
        "seconds one snapshot write or read may take; a late one is counted, never taken "
        "for a Redis outage",
        unit="s",
        hot=False,
    )
    cache: float | None = optional_number(
        0,
        3600,
        "seconds one read of the fleet serves every reader of this process (status pages, "
        '`GET fleet`, `stats(scope="fleet")`); null: `interval`',
        unit="s",
        hot=False,
    )
    silent_for: float = number(
        600,
        0,
        86400,
        "seconds a process (and a host) that stopped publishing without closing its pool "
        "stays listed as silent",
        unit="s",
        hot=False,
    )
    max_processes: int = integer(
        200, 1, 5000, "processes one read lists, the most recently published first", hot=False
    )
    max_snapshot_bytes: int = integer(
        512 * 1024,
        16 * 1024,
        8 * 1024 * 1024,
        "largest snapshot, in bytes: a larger one is trimmed (or not written) by its process "
        "and left out by readers",
        hot=False,
    )

    def __post_init__(self) -> None:
        check_fields(self, "fleet")
        if self.ttl is not None and self.ttl <= self.interval:
            # A snapshot that expires before the next is written would make a live
            # process blink in and out of the fleet.
            raise ConfigError(
                f"fleet.ttl: must be more than fleet.interval ({self.interval:g}), got {self.ttl:g}"
            )


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Whether a task is let in to wait for a worker at all (see docs/priority.md).
    Immutable, so thread-safe."""

    deadline_aware: bool = boolean(
        True,
        "refuse at once (`AdmissionRefused`, or the fallback) a task that would wait for a "
        "worker when its expected wait plus service time is confidently past its deadline",
    )
    deadline_margin: float = number(
        1.25,
        1,
        100,
        "refuse only when the expectation exceeds the time left by this factor",
    )
    min_samples: int = integer(
        5,
        1,
        1_000_000,
        "answers every worker must have given before an expectation is formed; until then "
        "tasks are let in",
    )

    def __post_init__(self) -> None:
        check_fields(self, "admission")


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """Whether tasks are traced with OpenTelemetry (see docs/tracing.md). Immutable, so
    thread-safe."""

    opentelemetry: bool = boolean(
        False,
        "a span per task and per attempt, the routing trace as span events, and the W3C "
        "`traceparent` header sent to the worker on each attempt; needs `opentelemetry-api` "
        "(the `otel` extra)",
        hot=False,
    )

    def __post_init__(self) -> None:
        check_fields(self, "tracing")


@dataclass(frozen=True, slots=True)
class ClassConfig:
    """One priority class: its name, and the share of the pool's capacity kept for it
    (and the classes above it). Immutable, so thread-safe."""

    name: str
    reserve: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or not self.name.isprintable():
            raise ConfigError(
                f"priority.classes: a class name must be a printable string, got {self.name!r}"
            )
        reserve = self.reserve
        if (
            isinstance(reserve, bool)
            or not isinstance(reserve, (int, float))
            or not 0 <= reserve < 1
        ):
            raise ConfigError(
                f"priority.classes[{self.name}].reserve: must be >= 0 and < 1, got {reserve!r}"
            )


DEFAULT_CLASSES: Final = (ClassConfig("interactive"), ClassConfig("standard"), ClassConfig("batch"))
"""The classes of a pool that names none: ``standard`` is every task's unless it says."""


@dataclass(frozen=True, slots=True)
class PriorityConfig:
    """Priority classes: who of the tasks waiting for a worker is served first, and the
    capacity kept for each (see docs/priority.md). Immutable, so thread-safe."""

    classes: tuple[ClassConfig, ...] = custom(
        DEFAULT_CLASSES,
        "the classes, highest first, each `{name, reserve}`; `reserve` is the share of the "
        "pool's capacity that only it and the classes above it may use",
        type_text="list of classes",
        default_text="`interactive`, `standard`, `batch`, none reserving",
        allowed_text="distinct names; reserves adding up to less than 1",
    )
    default: str = custom(
        "standard",
        "the class of a task that names none",
        type_text="string",
        default_text="`standard`",
        allowed_text="one of `classes`",
    )
    aging: float = number(
        10.0,
        0,
        86400,
        "a waiting task moves up one class for every this many seconds it has waited, so "
        "a lower class is never starved; `0` turns it off",
        unit="s",
    )

    def __post_init__(self) -> None:
        check_fields(self, "priority")
        names = [c.name for c in self.classes]
        if not names:
            raise ConfigError("priority.classes: must name at least one class")
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ConfigError(
                f"priority.classes: names must be distinct, got {', '.join(twice)} twice"
            )
        total = sum(c.reserve for c in self.classes)
        if total >= 1:
            raise ConfigError(
                f"priority.classes: reserves must add up to less than 1, got {total:g}"
            )
        if self.default not in names:
            raise ConfigError(
                f"priority.default: must be one of the classes ({', '.join(names)}), "
                f"got {self.default!r}"
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
    fleet: FleetConfig = section(FleetConfig, "history and the fleet view")
    admission: AdmissionConfig = section(AdmissionConfig, "who may wait for a worker")
    priority: PriorityConfig = section(PriorityConfig, "priority classes")
    tracing: TracingConfig = section(TracingConfig, "OpenTelemetry tracing")
    source: str | None = None
    # The top-level key the file used (npu_workers or npu; "" for the admin-UI layout,
    # which has none), for key paths in messages: see key_path().
    layout: str = field(default="npu_workers", compare=False)
    # Keys read and without effect, one line each saying why: logged when a pool is
    # built or reloaded from the file, and shown by npu-sync check.
    warnings: tuple[str, ...] = field(default=(), compare=False)

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
