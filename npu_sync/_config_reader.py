"""Reading a parsed YAML document into the configuration's dataclasses.

``_Reader`` walks a document of any of the three layouts (``npu_workers:``, AutoBot's
``npu:``, and the ``workers:``/``load_balancing:`` of AutoBot's admin UI), reading each
plain key from its declaration on the dataclass field, and the few keys that need code
of their own (addresses, headers, TLS, auth, the Redis URL) with methods of their own.
Every problem is collected, each named by its key path, and raised together as one
:class:`~npu_sync.errors.ConfigError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import ipaddress
import logging
import os
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any, Final, TypeVar
from urllib.parse import parse_qsl, urlsplit

from npu_sync import _redis_url
from npu_sync._config_types import (
    _AUTH_HEADERS,
    _AUTOBOT_PRIORITY,
    _PORT,
    DEFAULT_MAX_CONCURRENT,
    DEFAULT_PORT,
    DEFAULT_TLS_PORT,
    DEFAULT_WINDOWS_PORT,
    AuthConfig,
    ClassConfig,
    DeadLetterConfig,
    ModelPolicy,
    ModelsConfig,
    PoolConfig,
    PriorityConfig,
    SharedStateConfig,
    TLSConfig,
    TransportConfig,
    WorkerConfig,
    _no_headers,
    bad_label,
)
from npu_sync._schema import (
    Range,
    Spec,
    autobot_sources,
    default_of,
    keys,
    show,
    specs,
)
from npu_sync.errors import ConfigError, install_hint, printable

logger = logging.getLogger(__name__)


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
    capabilities: Collection[str] | None = None,
    tags: Mapping[str, str] | None = None,
    max_models: int | None = None,
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
        "capabilities": (
            list(capabilities)
            if isinstance(capabilities, Collection) and not isinstance(capabilities, str)
            else capabilities
        ),
        "tags": tags,
        "max_models": max_models,
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


def _autobot_section_keys() -> Mapping[str, Mapping[str, tuple[str, Spec]]]:
    """AutoBot's pool-level keys by section (``load_balancing``, ``health_monitoring``,
    ``circuit_breaker``): the npu_sync key each maps to, and its spec."""
    found: dict[str, dict[str, tuple[str, Spec]]] = {}
    for key in keys(PoolConfig):
        for source, _ in autobot_sources(key.spec):
            section_name, _, name = source.partition(".")
            if name:
                found.setdefault(section_name, {})[name] = (key.path, key.spec)
    return MappingProxyType({name: MappingProxyType(m) for name, m in found.items()})


_AUTOBOT_SECTIONS: Final = _autobot_section_keys()
# AutoBot keys that are read and checked but change nothing in npu_sync (see
# docs/configuration.md): the spec each is checked by, and, for the values that ask for
# something npu_sync does not do, the one warning line saying why.
_NO_EFFECT: Final[Mapping[str, Mapping[str, tuple[Spec, Callable[[object], str | None]]]]] = {
    "load_balancing": {"retry_failed_workers": (Spec("bool", ""), lambda value: None)},
    "circuit_breaker": {
        "enabled": (
            Spec("bool", ""),
            lambda value: (
                None
                if value
                else "false has no effect: npu_sync keeps a circuit breaker on every worker "
                "(without one a dead worker costs every task an attempt); tune "
                "circuit_breaker.fail_max and reset_timeout instead"
            ),
        ),
        "success_threshold": (
            Spec("int", "", limit=Range(1, 100, integer=True)),
            lambda value: (
                None
                if value == 1
                else f"{value} has no effect: one successful trial task closes an npu_sync "
                "breaker (a trial is a real task, and health checks vouch for the worker too)"
            ),
        ),
    },
}
# The AutoBot layouts (under npu:, or at the top level as the admin UI writes it) take
# AutoBot's load_balancing and health_monitoring sections next to npu_sync's own.
_ADMIN_KEYS: Final = _SECTION_KEYS | set(_AUTOBOT_SECTIONS)
_WORKER_KEYS: Final = _key_names(WorkerConfig)
# AutoBot spells capacity max_concurrent_tasks.
_AUTOBOT_WORKER_KEYS: Final = _WORKER_KEYS | {"max_concurrent_tasks"}
# Worker keys read by their specs alone; the others need code of their own.
_PLAIN_WORKER_KEYS: Final = ("enabled", "weight", "platform", "protocol")
# A secret in a file is a reference to the environment, and nothing else.
_ENV_ONLY = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}")
# Keys AutoBot's own tooling writes that say nothing npu_sync acts on.
_AUTOBOT_IGNORED_KEYS: Final = frozenset({"description", "device", "models", "assigned_models"})
_AUTOBOT_DEFAULT_PRIORITY: Final = 5
_TLS_KEYS: Final = _key_names(TLSConfig)
_MAX_MODELS: Final = Range(1, 10_000, integer=True)
_REPLICAS: Final = Range(0, 10_000, integer=True)
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
        self.warnings: list[str] = []
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
            if section is not None and "workers" not in section:
                # The admin UI always writes the list: a file of settings alone is a
                # fragment, or a file cut short, not a fleet of no workers.
                keys = ", ".join(sorted(str(key) for key in section))
                self.error("workers", f"required: the file has only {keys}; {_EXPECTED_TOP}")
                return PoolConfig()
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
            section = self.autobot_sections(section, prefix)

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
        custom_readers = {
            "dead_letter": self.dead_letter,
            "shared_state": self.shared_state,
            "priority": self.priority,
            "models": self.models,
        }
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
        if shared.backend == "redis" and not _installed("redis"):
            self.error(
                f"{prefix}shared_state.backend",
                f"'redis' needs the redis package, which is not installed: {install_hint('redis')}",
            )
        if dead_letter.backend == "redis" and shared.backend != "redis":
            self.error(
                f"{prefix}dead_letter.backend",
                "'redis' needs shared_state.backend: redis (it uses that connection)",
            )
        return PoolConfig(**found, layout=layout, warnings=tuple(self.warnings))

    def autobot_sections(self, section: Mapping[Any, Any], prefix: str) -> Mapping[Any, Any]:
        """``section`` with AutoBot's own keys (``load_balancing:``,
        ``health_monitoring:``, and its keys in ``circuit_breaker:``) moved to the
        npu_sync keys they map to (each npu_sync key names its AutoBot keys in the
        schema).

        Each value is checked here, under its AutoBot key path, by the npu_sync key's
        spec; a valid one is handed on as if the file had given the npu_sync key.
        """
        out = dict(section)
        for name, table in _AUTOBOT_SECTIONS.items():
            path = f"{prefix}{name}"
            no_effect = _NO_EFFECT.get(name, {})
            raw = out.get(name)
            if name in _SECTION_KEYS:
                # npu_sync's own section, holding AutoBot's keys beside its own.
                if not isinstance(raw, Mapping):
                    continue  # that section's own reader reports what is wrong
                mine = {k: v for k, v in raw.items() if k in table or k in no_effect}
                out[name] = {k: v for k, v in raw.items() if k not in mine}
                m: Mapping[Any, Any] | None = mine
            else:
                out.pop(name, None)
                m = self.section(raw, path, [*table, *no_effect])
            if m:
                self.autobot_keys(m, path, table, no_effect, out)
        return out

    def autobot_keys(
        self,
        m: Mapping[Any, Any],
        path: str,
        table: Mapping[str, tuple[str, Spec]],
        no_effect: Mapping[str, tuple[Spec, Callable[[object], str | None]]],
        out: dict[Any, Any],
    ) -> None:
        """Move the AutoBot keys of one section, ``m``, into ``out``'s npu_sync keys."""
        for key, (spec, why) in no_effect.items():
            if key in m:
                value = self.value_of(m, key, path, spec)
                note = None if value is _INVALID else why(value)
                if note:
                    self.warnings.append(f"{path}.{key}: {note}")
        for key, (target, spec) in table.items():
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
        try:
            return cls(**self.fields(m, path, cls))
        except ConfigError as exc:
            # A rule across keys, checked by the constructor, names the key from the
            # section's own name ("fleet.ttl: ..."): give it the file's whole path.
            parent = path.rpartition(".")[0]
            self.errors.extend(_join(parent, problem) for problem in exc.errors)
            return cls()

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

    def priority(self, raw: object, path: str) -> PriorityConfig:
        m = self.section(raw, path, _key_names(PriorityConfig))
        if m is None:
            return PriorityConfig()
        found = self.fields(m, path, PriorityConfig)
        mark = len(self.errors)
        if "classes" in m:
            classes = self.priority_classes(m["classes"], f"{path}.classes")
            if classes is not None:
                found["classes"] = classes
        if "default" in m:
            default = self.string(m["default"], f"{path}.default")
            if default is not None:
                found["default"] = default
        if len(self.errors) > mark:
            return PriorityConfig()
        try:
            return PriorityConfig(**found)
        except ConfigError as exc:
            parent = path.rpartition(".")[0]
            self.errors.extend(_join(parent, problem) for problem in exc.errors)
            return PriorityConfig()

    def priority_classes(self, raw: object, path: str) -> tuple[ClassConfig, ...] | None:
        """``[{name, reserve}, ...]``, or a bare name for a class reserving nothing."""
        if not isinstance(raw, list):
            self.error(path, f"must be a list of classes, got {show(raw)}")
            return None
        classes: list[ClassConfig] = []
        for i, item in enumerate(raw):
            item_path = f"{path}[{i}]"
            if isinstance(item, str):
                item = {"name": item}
            m = self.section(item, item_path, ("name", "reserve"))
            if m is None:
                continue
            if "name" not in m:
                self.error(f"{item_path}.name", "required")
                continue
            name = self.string(m["name"], f"{item_path}.name")
            reserve = m.get("reserve", 0.0)
            if (
                isinstance(reserve, bool)
                or not isinstance(reserve, (int, float))
                or not (0 <= reserve < 1)
            ):
                self.error(f"{item_path}.reserve", f"must be >= 0 and < 1, got {show(reserve)}")
                continue
            if name is None:
                continue
            if not name or not name.isprintable():
                self.error(f"{item_path}.name", f"must be a printable name, got {show(name)}")
                continue
            classes.append(ClassConfig(name, float(reserve)))
        return tuple(classes)

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
                elif "{" in text or "}" in text:
                    # Every key is `{namespace}:…`, one hash slot on a Cluster.
                    self.error(f"{path}.namespace", f"must not contain '{{' or '}}', got {text!r}")
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

        url, address_key = self.address(m, path, windows=_speaks_windows(m))
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
        max_models = self.optional_int(m, "max_models", path, _MAX_MODELS)
        capabilities = self.capabilities(m.get("capabilities"), f"{path}.capabilities")
        tags = self.tags(m.get("tags"), f"{path}.tags")
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
                capabilities=capabilities,
                tags=tags,
                max_models=max_models,
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

    def address(self, m: Mapping[Any, Any], path: str, *, windows: bool) -> tuple[str, str]:
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
            # AutoBot's Linux worker serves plain HTTP on 8081 and TLS on 8444, its
            # Windows worker plain HTTP on 8082.
            default_port = DEFAULT_WINDOWS_PORT if windows else DEFAULT_PORT
            if scheme == "https":
                default_port = DEFAULT_TLS_PORT
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

    def capabilities(self, raw: object, path: str) -> tuple[str, ...]:
        """A worker's capabilities: a list of names (a single name is refused, so that
        ``capabilities: llm, vision`` is not read as one capability)."""
        if raw is None:
            return ()
        if not isinstance(raw, list):
            self.error(path, f"must be a list of names, got {show(raw)}")
            return ()
        found: list[str] = []
        for index, item in enumerate(raw):
            value = self.scalar(item, f"{path}[{index}]")
            why = bad_label(value)
            if why:
                if value is not _INVALID:
                    self.error(f"{path}[{index}]", why)
                continue
            found.append(str(value))
        return tuple(sorted(set(found)))

    def tags(self, raw: object, path: str) -> Mapping[str, str]:
        """A worker's tags: a flat map of names to names (a number is read as its text,
        so ``cost: 1`` matches ``cost=1``)."""
        m = self.section(raw, path, ())
        if not m:
            return _no_headers()
        found: dict[str, str] = {}
        for key, item in m.items():
            item_path = f"{path}.{key}"
            why = bad_label(key)
            if why:
                self.error(item_path, f"the key {why}")
                continue
            value = self.scalar(item, item_path)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                value = str(value)
            why = bad_label(value)
            if why:
                if value is not _INVALID:
                    self.error(item_path, why)
                continue
            found[key] = str(value)
        return MappingProxyType(found)

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

    def optional_int(self, m: Mapping[Any, Any], key: str, path: str, limit: Range) -> int | None:
        """The integer at ``m[key]`` within ``limit``, or None when absent, null or invalid."""
        if m.get(key) is None:
            return None
        checked = self.bounded(m, key, path, limit)
        return None if checked is None else int(checked)

    def models(self, raw: object, path: str) -> ModelsConfig:
        """The ``models`` section: its plain keys by their specs, ``max_models`` and the
        ``catalog`` of per-model replica targets by code of their own."""
        m = self.section(raw, path, _key_names(ModelsConfig))
        if m is None:
            return ModelsConfig()
        found = self.fields(m, path, ModelsConfig)
        found["max_models"] = self.optional_int(m, "max_models", path, _MAX_MODELS)
        found["catalog"] = self.catalog(m.get("catalog"), f"{path}.catalog")
        try:
            return ModelsConfig(**found)
        except ConfigError as exc:  # a cross-field rule of the dataclass
            parent = path.rpartition(".")[0]
            self.errors.extend(_join(parent, problem) for problem in exc.errors)
            return ModelsConfig()

    def catalog(self, raw: object, path: str) -> Mapping[str, ModelPolicy]:
        m = self.section(raw, path, ())
        if not m:
            return MappingProxyType({})
        found: dict[str, ModelPolicy] = {}
        for model, entry in m.items():
            item_path = f"{path}.{model}"
            if (
                not isinstance(model, str)
                or not model
                or len(model) > 200
                or not model.isprintable()
            ):
                self.error(item_path, "the model id must be 1..200 printable characters")
                continue
            spec = self.section(entry, item_path, ("replicas",))
            if spec is None:
                continue
            replicas = self.section(spec.get("replicas"), f"{item_path}.replicas", ("min", "max"))
            if replicas is None:
                continue
            low = self.integer(replicas, "min", f"{item_path}.replicas", 0, limit=_REPLICAS)
            high = self.optional_int(replicas, "max", f"{item_path}.replicas", _REPLICAS)
            if high is not None and high < low:
                self.error(
                    f"{item_path}.replicas.max", f"must be >= replicas.min ({low}), got {high}"
                )
                continue
            found[model] = ModelPolicy(low, high)
        return MappingProxyType(found)

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


def _speaks_windows(m: Mapping[Any, Any]) -> bool:
    """Whether a worker's entry names AutoBot's Windows protocol, as WorkerConfig will
    settle it: ``protocol`` if given, else ``platform``."""
    protocol = m.get("protocol")
    if isinstance(protocol, str) and protocol:
        return protocol.strip().lower() == "autobot-windows"
    platform = m.get("platform")
    return isinstance(platform, str) and platform.strip().lower() == "windows"


def _installed(package: str) -> bool:
    """Whether ``package`` can be imported, found without importing it."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _redis_url_problem(text: str) -> str | None:
    """What is wrong with a Redis URL, without quoting it; None when usable."""
    try:
        target = _redis_url.parse(text)
    except _redis_url.RedisUrlError as exc:
        return str(exc)
    if target.kind != _redis_url.SERVER:
        if any(name == "db" for name, _ in target.query):
            where = "the path (/service/db)" if target.kind == _redis_url.SENTINEL else "none"
            return f"sets 'db' in its query: the database is in {where}"
        return _redis_query_problem("rediss" if target.tls else "redis", urlsplit(text).query)
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
    return _redis_query_problem(parts.scheme, parts.query)


# The query parameters redis-py reads from a URL that npu_sync leaves to the URL. Any
# other name reaches redis-py's connection as a keyword it does not take (a TypeError
# at start-up, after `npu-sync check` said the file was fine).
_REDIS_QUERY: Final = frozenset({"db", "client_name"})
_REDISS_QUERY: Final = frozenset(
    {"ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile",
     "ssl_check_hostname"}
)  # fmt: skip
# Timeouts and retries npu_sync sets itself, from shared_state.timeout: one bounds every
# Redis call a task may wait on, which a URL's own would undo.
_REDIS_OWN_QUERY: Final = frozenset(
    {"socket_timeout", "socket_connect_timeout", "timeout", "health_check_interval",
     "retry_on_timeout", "retry_on_error", "socket_keepalive", "max_connections"}
)  # fmt: skip


def _redis_query_problem(scheme: str, query: str) -> str | None:
    """What is wrong with a Redis URL's query parameters; values are never quoted."""
    for name, _ in parse_qsl(query, keep_blank_values=True):
        shown = printable(name[:40])
        if name in _REDIS_QUERY or (scheme == "rediss" and name in _REDISS_QUERY):
            continue
        if name in _REDISS_QUERY:
            return f"has TLS parameter {shown!r}, which only a rediss:// URL takes"
        if name in _REDIS_OWN_QUERY:
            return f"sets {shown!r}: npu_sync sets it from shared_state.timeout"
        known = sorted(_REDIS_QUERY | (_REDISS_QUERY if scheme == "rediss" else frozenset()))
        return f"has an unknown query parameter {shown!r} (known: {', '.join(known)})"
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
