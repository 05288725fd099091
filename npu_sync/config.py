"""Configuration: a pool's YAML parsed and validated into frozen dataclasses.

Two layouts load: the native one under ``npu_workers:`` and the AutoBot one under
``npu:``. Every problem found is collected and raised together as one
:class:`~npu_sync.errors.ConfigError`, each message naming its key path, e.g.
``npu_workers.workers[2].port: must be 1..65535, got 0``. ``docs/configuration.md``
describes every key.
"""

from __future__ import annotations

import difflib
import ipaddress
import logging
import math
import os
import re
import stat
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Final
from urllib.parse import urlsplit

import yaml

from npu_sync.errors import ConfigError, scrub

__all__ = [
    "DEFAULT_MAX_CONCURRENT",
    "DEFAULT_PORT",
    "BreakerConfig",
    "DeadLetterConfig",
    "HealthConfig",
    "PoolConfig",
    "PoolSettings",
    "ReloadConfig",
    "RetryConfig",
    "SharedStateConfig",
    "TLSConfig",
    "TimeoutConfig",
    "TransportConfig",
    "WorkerConfig",
    "check_reload",
    "config_for_url",
    "load_config",
    "parse_config",
    "parse_yaml",
    "read_config_text",
    "worker_config",
]

logger = logging.getLogger(__name__)

DEFAULT_PORT: Final = 8081
"""The port a worker given by ``host`` listens on unless ``port`` says otherwise."""

DEFAULT_MAX_CONCURRENT: Final = 32
"""Tasks in flight on one worker at once unless its ``max_concurrent`` says otherwise."""

MAX_FILE_BYTES: Final = 1 << 20
"""The largest configuration file read (1 MiB): a real one is a few kilobytes."""

MAX_DEPTH: Final = 32
"""The deepest nesting of mappings and lists a configuration file may have."""

MAX_NODES: Final = 100_000
"""The most YAML nodes (keys, values, list items) a configuration file may have."""


@dataclass(frozen=True, slots=True)
class _Range:
    """The values a numeric key allows: ``lo..hi``, ``lo`` itself excluded when ``above``."""

    lo: float
    hi: float
    above: bool = False
    integer: bool = False

    def describe(self) -> str:
        if self.integer:
            return f"{_bound(self.lo)}..{_bound(self.hi)}"
        low = f"> {_bound(self.lo)}" if self.above else f">= {_bound(self.lo)}"
        return f"{low} and <= {_bound(self.hi)}"

    def check(self, value: object) -> int | float | str:
        """``value`` if allowed (a float for a number key), else what is wrong with it.

        A problem reads as the start of a message, to be followed by ``, got <value>``.
        """
        if self.integer:
            if isinstance(value, bool) or not isinstance(value, int):
                return "must be an integer"
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            return "must be a number"
        elif isinstance(value, float) and not math.isfinite(value):
            return "must be a finite number"
        # Compared before any float(): an int too large for a float must not overflow.
        low_ok = value > self.lo if self.above else value >= self.lo
        if not (low_ok and value <= self.hi):
            return f"must be {self.describe()}"
        return value if self.integer else float(value)


_DAY: Final = 86400
# Every numeric key's allowed range. The upper bounds keep a valid file from sizing
# connection pools to millions, or handing a wait longer than the platform's
# threading.TIMEOUT_MAX (about 292 years) to a lock or an event, which raises
# OverflowError in whichever thread uses it. docs/configuration.md has the same table.
_LIMITS: Final[Mapping[str, _Range]] = MappingProxyType(
    {
        "health.interval": _Range(0, _DAY, above=True),
        "health.timeout": _Range(0, 3600, above=True),
        "health.unhealthy_threshold": _Range(1, 1000, integer=True),
        "health.healthy_threshold": _Range(1, 1000, integer=True),
        "circuit_breaker.fail_max": _Range(1, 10_000, integer=True),
        "circuit_breaker.reset_timeout": _Range(0, _DAY, above=True),
        "circuit_breaker.max_reset_timeout": _Range(0, 7 * _DAY, above=True),
        "retry.max_retries": _Range(0, 100, integer=True),
        "retry.backoff_initial": _Range(0, 3600),
        "retry.backoff_max": _Range(0, 3600),
        "timeouts.connect": _Range(0, 3600, above=True),
        "timeouts.read": _Range(0, _DAY, above=True),
        "timeouts.task": _Range(0, _DAY, above=True),
        "dead_letter.max_records": _Range(1, 10_000_000, integer=True),
        "transport.max_response_bytes": _Range(1, 1 << 30, integer=True),
        "transport.idle_timeout": _Range(0, 3600, above=True),
        "pool.threads": _Range(1, 4096, integer=True),
        "pool.max_queue_wait": _Range(0, _DAY, above=True),
        "shared_state.timeout": _Range(0, 60, above=True),
        "shared_state.sync_interval": _Range(0, 3600, above=True),
        "reload.max_removed_share": _Range(0, 1),
        "worker.port": _Range(1, 65535, integer=True),
        "worker.priority": _Range(0, 1_000_000, integer=True),
        "worker.max_concurrent": _Range(1, 10_000, integer=True),
    }
)
# AutoBot priorities may be negative; they become tiers 1, 2, ... once read.
_AUTOBOT_PRIORITY: Final = _Range(-1_000_000, 1_000_000, integer=True)
# A WorkerConfig may hold either layout's priority, so its constructor allows both.
_WORKER_FIELD_LIMITS: Final[Mapping[str, _Range]] = MappingProxyType(
    {"priority": _AUTOBOT_PRIORITY, "max_concurrent": _LIMITS["worker.max_concurrent"]}
)


def _check_limits(config: object, section: str, fields: Mapping[str, _Range]) -> None:
    """Refuse a config built in code with a number the YAML reader would refuse.

    Raises:
        ConfigError: naming each bad field as ``<section>.<field>``.
    """
    problems = []
    for name, limit in fields.items():
        value = getattr(config, name)
        checked = limit.check(value)
        if isinstance(checked, str):
            problems.append(f"{section}.{name}: {checked}, got {_show(value)}")
    if problems:
        raise ConfigError(problems)


def _section_limits() -> dict[str, Mapping[str, _Range]]:
    sections: dict[str, dict[str, _Range]] = {}
    for key, limit in _LIMITS.items():
        section, _, name = key.partition(".")
        sections.setdefault(section, {})[name] = limit
    return {section: MappingProxyType(fields) for section, fields in sections.items()}


_SECTION_LIMITS: Final = _section_limits()


def _no_headers() -> Mapping[str, str]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """How to talk TLS to https workers. Immutable, so thread-safe.

    ``verify`` is True/False or the path of a CA bundle; ``cert``/``key`` name a client
    certificate and its key (``key`` requires ``cert``). Paths are stored absolute.
    """

    verify: bool | str = True
    cert: str | None = None
    key: str | None = None


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One worker as configured. Immutable, so thread-safe.

    ``url`` is normalised to ``scheme://host:port``, followed by the worker's base path
    when it sits behind a path prefix (``http://host:8081/api/v1``, no trailing slash);
    every request path is joined to it. Build one with :func:`worker_config`
    to have it validated; the constructor itself only freezes ``headers`` and checks
    that ``priority`` and ``max_concurrent`` are within range (raising
    :class:`~npu_sync.errors.ConfigError`). ``headers`` is left out of ``repr()``
    because it usually carries credentials.
    """

    id: str
    url: str
    priority: int = 1
    max_concurrent: int = DEFAULT_MAX_CONCURRENT
    enabled: bool = True
    # Unhashable, so it takes no part in hash(); equality still compares it.
    headers: Mapping[str, str] = field(default_factory=_no_headers, hash=False, repr=False)
    tls: TLSConfig | None = None

    def __post_init__(self) -> None:
        # A caller's dict must not be able to change a frozen config behind its back.
        if not isinstance(self.headers, MappingProxyType):
            object.__setattr__(self, "headers", MappingProxyType(dict(self.headers)))
        _check_limits(self, "worker", _WORKER_FIELD_LIMITS)

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

    enabled: bool = True
    interval: float = 30.0
    timeout: float = 2.0
    unhealthy_threshold: int = 2
    healthy_threshold: int = 1
    endpoint: str = "/health"

    def __post_init__(self) -> None:
        _check_limits(self, "health", _SECTION_LIMITS["health"])


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """Per-worker circuit breaker settings. Immutable, so thread-safe."""

    fail_max: int = 5
    reset_timeout: float = 60.0
    max_reset_timeout: float = 600.0

    def __post_init__(self) -> None:
        _check_limits(self, "circuit_breaker", _SECTION_LIMITS["circuit_breaker"])


@dataclass(frozen=True, slots=True)
class RetryConfig:
    """Retry settings; ``max_retries`` counts attempts after the first. Immutable."""

    max_retries: int = 3
    backoff_initial: float = 0.05
    backoff_max: float = 2.0

    def __post_init__(self) -> None:
        _check_limits(self, "retry", _SECTION_LIMITS["retry"])


@dataclass(frozen=True, slots=True)
class TimeoutConfig:
    """Timeouts in seconds. Immutable, so thread-safe.

    ``task`` is a task's whole default deadline; ``read`` is the budget of one whole
    attempt, from its start to the last byte of the answer (connecting included);
    ``connect`` is the most of that budget that establishing a connection may take.
    The defaults keep a task inside gunicorn's default 30 s worker timeout.
    """

    connect: float = 2.0
    read: float = 20.0
    task: float = 25.0

    def __post_init__(self) -> None:
        _check_limits(self, "timeouts", _SECTION_LIMITS["timeouts"])


@dataclass(frozen=True, slots=True)
class DeadLetterConfig:
    """Where failed tasks are recorded. Immutable, so thread-safe.

    ``path`` (sqlite only) is stored absolute, or as ``:memory:``.
    """

    backend: str = "memory"
    path: str | None = None
    max_records: int = 10000
    # redis only: the local SQLite file holding records while Redis is unreachable;
    # None puts it under the system's temporary directory (see docs/deployment.md).
    spool_path: str | None = None

    def __post_init__(self) -> None:
        _check_limits(self, "dead_letter", _SECTION_LIMITS["dead_letter"])


@dataclass(frozen=True, slots=True)
class SharedStateConfig:
    """State shared by every process using the same workers. Immutable, so thread-safe.

    ``backend`` is ``"none"`` (each process on its own) or ``"redis"``. The Redis URL
    may come from the environment (``url: ${NPU_SYNC_REDIS_URL}``).
    """

    backend: str = "none"
    url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "npu_sync"
    timeout: float = 0.05  # seconds: connect and socket timeout of every Redis call
    sync_interval: float = 1.0  # seconds between full re-reads of the shared state

    def __post_init__(self) -> None:
        _check_limits(self, "shared_state", _SECTION_LIMITS["shared_state"])

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

    allow_empty: bool = False
    max_removed_share: float = 0.5

    def __post_init__(self) -> None:
        _check_limits(self, "reload", _SECTION_LIMITS["reload"])


@dataclass(frozen=True, slots=True)
class TransportConfig:
    """The HTTP client and its limits. Immutable, so thread-safe."""

    client: str = "builtin"
    max_response_bytes: int = 16 * 1024 * 1024
    tls: TLSConfig = field(default_factory=TLSConfig)
    # Below the 5 s keep-alive of uvicorn, which the AutoBot worker runs: a connection
    # idle for longer may be closed by the worker just as a request is sent on it.
    idle_timeout: float = 4.0

    def __post_init__(self) -> None:
        _check_limits(self, "transport", _SECTION_LIMITS["transport"])


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """The pool's own settings. Immutable, so thread-safe."""

    threads: int = 32
    default_endpoint: str = "/inference"
    max_queue_wait: float = 10.0  # seconds a task may wait for a worker with room

    def __post_init__(self) -> None:
        _check_limits(self, "pool", _SECTION_LIMITS["pool"])


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """A whole, validated pool configuration. Immutable, so thread-safe."""

    workers: tuple[WorkerConfig, ...] = ()
    health: HealthConfig = field(default_factory=HealthConfig)
    circuit_breaker: BreakerConfig = field(default_factory=BreakerConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    dead_letter: DeadLetterConfig = field(default_factory=DeadLetterConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    pool: PoolSettings = field(default_factory=PoolSettings)
    shared_state: SharedStateConfig = field(default_factory=SharedStateConfig)
    reload: ReloadConfig = field(default_factory=ReloadConfig)
    source: str | None = None
    # The top-level key the file used (npu_workers or npu), for key paths in messages.
    layout: str = field(default="npu_workers", compare=False)

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
    path = f"{new.layout}.workers"
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
) -> WorkerConfig:
    """Build a validated worker, with the same rules as a YAML worker entry.

    Give ``url`` or ``host`` (with ``port``, default 8081, and ``scheme``, default
    http), not both. Values are taken literally: no ``${ENV}`` expansion.

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
    }
    optional = {
        "url": url,
        "host": host,
        "port": port,
        "scheme": scheme,
        "headers": headers,
        "tls": _tls_mapping(tls) if isinstance(tls, TLSConfig) else tls,
    }
    raw.update((key, value) for key, value in optional.items() if value is not None)
    reader = _Reader(expand=False, base_dir=None)
    worker, _ = reader.worker(raw, "worker", autobot=False, tls_base=TLSConfig())
    if reader.errors or worker is None:
        raise ConfigError(reader.errors or ["worker: invalid"])
    return worker


# ---------------------------------------------------------------------------------------
# Validation

_EXPECTED_TOP = "expected a top-level 'npu_workers:' (or AutoBot 'npu:') mapping"
_LAYOUTS: Final = ("npu_workers", "npu")
_SECTION_KEYS: Final = frozenset(
    {
        "workers",
        "health",
        "circuit_breaker",
        "retry",
        "timeouts",
        "dead_letter",
        "transport",
        "pool",
        "shared_state",
        "reload",
    }
)
_WORKER_KEYS: Final = frozenset(
    {
        "id",
        "url",
        "host",
        "port",
        "scheme",
        "priority",
        "max_concurrent",
        "enabled",
        "headers",
        "tls",
    }
)
# AutoBot spells capacity max_concurrent_tasks and may name a worker instead of giving an id.
_AUTOBOT_WORKER_KEYS: Final = _WORKER_KEYS | {"name", "max_concurrent_tasks"}
# Keys AutoBot's own tooling writes that say nothing npu_sync acts on.
_AUTOBOT_IGNORED_KEYS: Final = frozenset(
    {"description", "device", "models", "capabilities", "weight", "platform", "assigned_models"}
)
_AUTOBOT_DEFAULT_PRIORITY: Final = 5
_CLIENTS: Final = ("builtin", "urllib3", "requests")
_TLS_KEYS: Final = frozenset({"verify", "cert", "key"})
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
                "", f"the configuration must be a mapping, got {_show(data)}: {_EXPECTED_TOP}"
            )
            return PoolConfig()
        for key in data:
            if key not in _LAYOUTS:
                self.error(str(key), _unknown(key, _LAYOUTS))
        present = [key for key in _LAYOUTS if key in data]
        if not present:
            if not data:
                self.error("", f"the configuration is empty: {_EXPECTED_TOP}")
            return PoolConfig()
        if len(present) > 1:
            self.error("npu", "cannot be combined with npu_workers: use one layout")
            return PoolConfig()
        layout = present[0]
        section = self.section(data[layout], layout, _SECTION_KEYS)
        if section is None:
            return PoolConfig()

        # Workers inherit verify from transport.tls, so it is read first; its errors are
        # moved after the sections before it so messages follow the usual key order.
        mark = len(self.errors)
        transport = self.transport(section.get("transport"), f"{layout}.transport")
        transport_errors = self.errors[mark:]
        del self.errors[mark:]

        workers = self.workers(
            section.get("workers"),
            f"{layout}.workers",
            autobot=layout == "npu",
            tls_base=transport.tls,
        )
        health = self.health(section.get("health"), f"{layout}.health")
        breaker = self.breaker(section.get("circuit_breaker"), f"{layout}.circuit_breaker")
        retry = self.retry(section.get("retry"), f"{layout}.retry")
        timeouts = self.timeouts(section.get("timeouts"), f"{layout}.timeouts")
        dead_letter = self.dead_letter(section.get("dead_letter"), f"{layout}.dead_letter")
        self.errors.extend(transport_errors)
        pool = self.pool(section.get("pool"), f"{layout}.pool")
        shared = self.shared_state(section.get("shared_state"), f"{layout}.shared_state")
        reload = self.reload(section.get("reload"), f"{layout}.reload")
        if dead_letter.backend == "redis" and shared.backend != "redis":
            self.error(
                f"{layout}.dead_letter.backend",
                "'redis' needs shared_state.backend: redis (it uses that connection)",
            )
        return PoolConfig(
            shared_state=shared,
            workers=workers,
            health=health,
            circuit_breaker=breaker,
            retry=retry,
            timeouts=timeouts,
            dead_letter=dead_letter,
            transport=transport,
            pool=pool,
            reload=reload,
            layout=layout,
        )

    # -- sections --------------------------------------------------------------------

    def health(self, raw: object, path: str) -> HealthConfig:
        d = HealthConfig()
        m = self.section(raw, path, HealthConfig.__dataclass_fields__)
        if m is None:
            return d
        return HealthConfig(
            enabled=self.boolean(m, "enabled", path, d.enabled),
            interval=self.number(m, "interval", path, d.interval),
            timeout=self.number(m, "timeout", path, d.timeout),
            unhealthy_threshold=self.integer(m, "unhealthy_threshold", path, d.unhealthy_threshold),
            healthy_threshold=self.integer(m, "healthy_threshold", path, d.healthy_threshold),
            endpoint=self.endpoint(m, "endpoint", path, d.endpoint),
        )

    def reload(self, raw: object, path: str) -> ReloadConfig:
        d = ReloadConfig()
        m = self.section(raw, path, ReloadConfig.__dataclass_fields__)
        if m is None:
            return d
        return ReloadConfig(
            allow_empty=self.boolean(m, "allow_empty", path, d.allow_empty),
            max_removed_share=self.number(m, "max_removed_share", path, d.max_removed_share),
        )

    def breaker(self, raw: object, path: str) -> BreakerConfig:
        d = BreakerConfig()
        m = self.section(raw, path, BreakerConfig.__dataclass_fields__)
        if m is None:
            return d
        mark = len(self.errors)
        config = BreakerConfig(
            fail_max=self.integer(m, "fail_max", path, d.fail_max),
            reset_timeout=self.number(m, "reset_timeout", path, d.reset_timeout),
            max_reset_timeout=self.number(m, "max_reset_timeout", path, d.max_reset_timeout),
        )
        if len(self.errors) == mark and config.max_reset_timeout < config.reset_timeout:
            self.error(
                f"{path}.max_reset_timeout",
                f"must be >= reset_timeout ({config.reset_timeout:g}), "
                f"got {config.max_reset_timeout:g}",
            )
        return config

    def retry(self, raw: object, path: str) -> RetryConfig:
        d = RetryConfig()
        m = self.section(raw, path, RetryConfig.__dataclass_fields__)
        if m is None:
            return d
        mark = len(self.errors)
        config = RetryConfig(
            max_retries=self.integer(m, "max_retries", path, d.max_retries),
            backoff_initial=self.number(m, "backoff_initial", path, d.backoff_initial),
            backoff_max=self.number(m, "backoff_max", path, d.backoff_max),
        )
        if len(self.errors) == mark and config.backoff_max < config.backoff_initial:
            self.error(
                f"{path}.backoff_max",
                f"must be >= backoff_initial ({config.backoff_initial:g}), "
                f"got {config.backoff_max:g}",
            )
        return config

    def timeouts(self, raw: object, path: str) -> TimeoutConfig:
        d = TimeoutConfig()
        m = self.section(raw, path, TimeoutConfig.__dataclass_fields__)
        if m is None:
            return d
        return TimeoutConfig(
            connect=self.number(m, "connect", path, d.connect),
            read=self.number(m, "read", path, d.read),
            task=self.number(m, "task", path, d.task),
        )

    def dead_letter(self, raw: object, path: str) -> DeadLetterConfig:
        d = DeadLetterConfig()
        m = self.section(raw, path, DeadLetterConfig.__dataclass_fields__)
        if m is None:
            return d
        backend: str | None = d.backend
        if "backend" in m:
            backend = self.string(m["backend"], f"{path}.backend")
            if backend is not None:
                backend = self.choice(
                    backend, m["backend"], f"{path}.backend", ("memory", "sqlite", "redis")
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
        return DeadLetterConfig(
            backend=backend or d.backend,
            path=file_path,
            max_records=self.integer(m, "max_records", path, d.max_records),
            spool_path=spool,
        )

    def shared_state(self, raw: object, path: str) -> SharedStateConfig:
        d = SharedStateConfig()
        m = self.section(raw, path, SharedStateConfig.__dataclass_fields__)
        if m is None:
            return d
        backend: str | None = d.backend
        if "backend" in m:
            backend = self.string(m["backend"], f"{path}.backend")
            if backend is not None:
                backend = self.choice(backend, m["backend"], f"{path}.backend", ("none", "redis"))
        url = d.url
        if "url" in m:
            text = self.string(m["url"], f"{path}.url", show_value=False)
            if text is not None:
                # The URL is never quoted: it usually holds the Redis password.
                problem = _redis_url_problem(text)
                if problem:
                    self.error(f"{path}.url", problem)
                else:
                    url = text
        namespace = d.namespace
        if "namespace" in m:
            text = self.string(m["namespace"], f"{path}.namespace")
            if text is not None:
                if not text or any(c.isspace() for c in text):
                    self.error(f"{path}.namespace", f"must be a word without spaces, got {text!r}")
                else:
                    namespace = text
        return SharedStateConfig(
            backend=backend or d.backend,
            url=url,
            namespace=namespace,
            timeout=self.number(m, "timeout", path, d.timeout),
            sync_interval=self.number(m, "sync_interval", path, d.sync_interval),
        )

    def transport(self, raw: object, path: str) -> TransportConfig:
        d = TransportConfig()
        m = self.section(raw, path, TransportConfig.__dataclass_fields__)
        if m is None:
            return d
        client = d.client
        if "client" in m:
            value = self.string(m["client"], f"{path}.client")
            if value is not None:
                client = self.choice(value, m["client"], f"{path}.client", _CLIENTS)
        tls = self.tls(m["tls"], f"{path}.tls", TLSConfig()) if "tls" in m else None
        return TransportConfig(
            client=client,
            max_response_bytes=self.integer(m, "max_response_bytes", path, d.max_response_bytes),
            tls=tls or d.tls,
            idle_timeout=self.number(m, "idle_timeout", path, d.idle_timeout),
        )

    def pool(self, raw: object, path: str) -> PoolSettings:
        d = PoolSettings()
        m = self.section(raw, path, PoolSettings.__dataclass_fields__)
        if m is None:
            return d
        return PoolSettings(
            threads=self.integer(m, "threads", path, d.threads),
            default_endpoint=self.endpoint(m, "default_endpoint", path, d.default_endpoint),
            max_queue_wait=self.number(m, "max_queue_wait", path, d.max_queue_wait),
        )

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
                    f"must be true, false or the path of a CA bundle, got {_show(value)}",
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
            self.error(path, f"must be a list of workers, got {_show(raw)}")
            return ()
        built: list[WorkerConfig] = []
        ids: dict[str, int] = {}
        urls: dict[str, int] = {}
        for index, item in enumerate(raw):
            item_path = f"{path}[{index}]"
            worker, address_key = self.worker(item, item_path, autobot=autobot, tls_base=tls_base)
            if worker is None:
                continue
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
    ) -> tuple[WorkerConfig | None, str]:
        """One worker entry, and the key its address came from (``url`` or ``host``).

        Invalid fields are recorded as errors and left empty, so the caller can still
        check the rest of the list; such a worker is never returned to users.
        """
        allowed = _AUTOBOT_WORKER_KEYS if autobot else _WORKER_KEYS
        ignored = _AUTOBOT_IGNORED_KEYS if autobot else frozenset()
        if raw is None:
            self.error(path, "must be a mapping, got null")
            return None, "url"
        m = self.section(raw, path, allowed, ignored)
        if m is None:
            return None, "url"
        skipped = sorted(str(key) for key in m if key in ignored)
        if skipped:
            logger.debug("%s: ignoring AutoBot key(s) %s", path, ", ".join(skipped))

        worker_id = ""
        if "id" in m:
            worker_id = self.identifier(m["id"], f"{path}.id")
        elif autobot and "name" in m:
            worker_id = self.identifier(m["name"], f"{path}.name")
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
            priority = self.integer(m, "priority", path, 1, limit=_LIMITS["worker.priority"])
            capacity_key = "max_concurrent"
        return (
            WorkerConfig(
                id=worker_id,
                url=url,
                priority=priority,
                max_concurrent=self.integer(
                    m,
                    capacity_key,
                    path,
                    DEFAULT_MAX_CONCURRENT,
                    limit=_LIMITS["worker.max_concurrent"],
                ),
                enabled=self.boolean(m, "enabled", path, True),
                headers=self.headers(m.get("headers"), f"{path}.headers"),
                tls=self.tls(m.get("tls"), f"{path}.tls", tls_base),
            ),
            address_key,
        )

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
                f"must be 1..200 printable characters without spaces, got {_show(raw)}",
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
                self.error(f"{path}.url", problem.replace("{got}", _show(raw)))
            return url, "url"
        if "host" in m:
            mark = len(self.errors)
            raw = m["host"]
            host = self.string(raw, f"{path}.host")
            port = self.integer(m, "port", path, DEFAULT_PORT, limit=_LIMITS["worker.port"])
            scheme = "http"
            if "scheme" in m:
                value = self.string(m["scheme"], f"{path}.scheme")
                if value is not None:
                    scheme = self.choice(
                        value.lower(), m["scheme"], f"{path}.scheme", ("http", "https")
                    )
            if host is None:
                return "", "host"
            normal, problem = _normalise_host(host)
            if problem:
                self.error(f"{path}.host", problem.replace("{got}", _show(raw)))
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
            self.error(path, f"must be a mapping, got {_show(raw)}")
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
            got = _show(raw) if show_value else _kind(raw)
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
        self,
        m: Mapping[Any, Any],
        key: str,
        path: str,
        default: int,
        *,
        limit: _Range | None = None,
    ) -> int:
        """The integer at ``m[key]`` within ``limit``, by default the key's own range."""
        checked = self.bounded(m, key, path, limit)
        return default if checked is None else int(checked)

    def number(self, m: Mapping[Any, Any], key: str, path: str, default: float) -> float:
        """The finite number at ``m[key]`` within the key's range, as a float."""
        checked = self.bounded(m, key, path, None)
        return default if checked is None else float(checked)

    def bounded(
        self, m: Mapping[Any, Any], key: str, path: str, limit: _Range | None
    ) -> int | float | None:
        """``m[key]`` checked against ``limit`` (else ``_LIMITS`` for the key's path);
        None when it is absent or invalid (the error is recorded).
        """
        if key not in m:
            return None
        item_path, raw = f"{path}.{key}", m[key]
        if limit is None:
            # The limits are keyed by section and key: npu_workers.health.interval
            # is health.interval.
            limit = _LIMITS[item_path.partition(".")[2]]
        value = self.scalar(raw, item_path)
        if value is _INVALID:
            return None
        checked = limit.check(value)
        if isinstance(checked, str):
            self.error(item_path, f"{checked}, got {_show(raw)}")
            return None
        return checked

    def boolean(self, m: Mapping[Any, Any], key: str, path: str, default: bool) -> bool:
        if key not in m:
            return default
        item_path, raw = f"{path}.{key}", m[key]
        value = self.scalar(raw, item_path)
        if value is _INVALID:
            return default
        if not isinstance(value, bool):
            self.error(item_path, f"must be true or false, got {_show(raw)}")
            return default
        return value

    def choice(self, value: str, raw: object, path: str, options: tuple[str, ...]) -> str:
        if value in options:
            return value
        self.error(path, f"must be one of {', '.join(map(repr, options))}, got {_show(raw)}")
        return options[0]

    def endpoint(self, m: Mapping[Any, Any], key: str, path: str, default: str) -> str:
        if key not in m:
            return default
        raw = m[key]
        value = self.string(raw, f"{path}.{key}")
        if value is None:
            return default
        if not value.startswith("/") or any(ch.isspace() for ch in value):
            self.error(f"{path}.{key}", f"must be a path starting with '/', got {_show(raw)}")
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
        return "", f"scheme must be 'http' or 'https', got {_show(parts.scheme)}"
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


def _show(value: object) -> str:
    """A value as an error message quotes it: YAML words for YAML types, short."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    try:
        # Scrubbed before it is cut: a cut before a URL's '@' would leave its password
        # for ConfigError's own scrub to miss.
        text = scrub(repr(value))
    except ValueError:  # an int beyond sys.get_int_max_str_digits()
        return "a very large integer"
    return text if len(text) <= 80 else text[:77] + "..."


def _bound(value: float) -> str:
    """A limit as messages and docs write it: 86400, not 86400.0."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
