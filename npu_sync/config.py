"""Configuration: a pool's YAML parsed and validated into frozen dataclasses.

Three layouts load: the native one under ``npu_workers:``, AutoBot's under ``npu:``,
and the one AutoBot's admin UI writes (``workers:`` and ``load_balancing:`` at the top
level). Every problem found is collected and raised together as one
:class:`~npu_sync.errors.ConfigError`, each message naming its key path, e.g.
``npu_workers.workers[2].port: must be 1..65535, got 0``. ``docs/configuration.md``
describes every key.

This module is the public face. Behind it: the dataclasses, each key declared once on
its field (``_config_types``); reading a file and its YAML strictly (``_config_file``);
reading a document of any layout into the dataclasses (``_config_reader``).

``_config_file`` is imported when a file is first read or parsed, not with this
module: it imports PyYAML, which would add about 15 % to ``import npu_sync``, and
a pool built from Python objects never needs it.
"""

from __future__ import annotations

import os

from npu_sync._config_reader import (
    parse_config,
    worker_config,
)
from npu_sync._config_types import (
    CONCURRENCY_LIMITS,
    DEFAULT_MAX_CONCURRENT,
    DEFAULT_PORT,
    DEFAULT_TLS_PORT,
    MAX_DEPTH,
    MAX_FILE_BYTES,
    MAX_NODES,
    STRATEGIES,
    AdmissionConfig,
    AuthConfig,
    BalancingConfig,
    BreakerConfig,
    ClassConfig,
    DeadLetterConfig,
    FleetConfig,
    HealthConfig,
    HedgeConfig,
    ModelPolicy,
    ModelsConfig,
    PoolConfig,
    PoolSettings,
    PriorityConfig,
    ReloadConfig,
    RetryBudgetConfig,
    RetryConfig,
    SharedStateConfig,
    StallConfig,
    TimeoutConfig,
    TLSConfig,
    TracingConfig,
    TransportConfig,
    TrialConfig,
    WorkerConfig,
    default_protocol,
)
from npu_sync._guard import ReloadGuard

__all__ = [
    "CONCURRENCY_LIMITS",
    "DEFAULT_MAX_CONCURRENT",
    "DEFAULT_PORT",
    "DEFAULT_TLS_PORT",
    "MAX_DEPTH",
    "MAX_FILE_BYTES",
    "MAX_NODES",
    "STRATEGIES",
    "AdmissionConfig",
    "AuthConfig",
    "BalancingConfig",
    "BreakerConfig",
    "ClassConfig",
    "DeadLetterConfig",
    "FleetConfig",
    "HealthConfig",
    "HedgeConfig",
    "ModelPolicy",
    "ModelsConfig",
    "PoolConfig",
    "PoolSettings",
    "PriorityConfig",
    "ReloadConfig",
    "RetryBudgetConfig",
    "RetryConfig",
    "SharedStateConfig",
    "StallConfig",
    "TLSConfig",
    "TimeoutConfig",
    "TracingConfig",
    "TransportConfig",
    "TrialConfig",
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


def read_config_text(path: str | os.PathLike[str]) -> str:
    """The text of a configuration file: a regular file of at most
    :data:`MAX_FILE_BYTES`, in UTF-8.

    Raises:
        ConfigError: the file cannot be read, is not a regular file, is too large or
            is not UTF-8.
    """
    from npu_sync import _config_file

    return _config_file.read_config_text(path)


def parse_yaml(text: str, *, source: str) -> PoolConfig:
    """Validate the YAML text of the configuration file at ``source``.

    Raises:
        ConfigError: the text is not valid YAML or fails validation.
    """
    from npu_sync import _config_file

    return _config_file.parse_yaml(text, source=source)


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


def check_reload(old: PoolConfig, new: PoolConfig, guard: ReloadGuard | None = None) -> None:
    """Refuse a reload that would empty a working pool or shrink most of it.

    The rules are :class:`~npu_sync._guard.ReloadGuard`'s, judged on the pool ``new``
    leaves; ``guard`` holds the pool's own settings (the defaults when None), and the
    keys the new file's ``reload`` section gives win over them.

    Raises:
        ConfigError: naming ``<layout>.workers``, what would be lost and the key that
            allows it.
    """
    (guard or ReloadGuard()).under(new.reload).check(old, new)


def config_for_url(url: str) -> PoolConfig:
    """A configuration of one worker, id ``default``, at ``url``; all else default.

    Used when there is no YAML file at all.

    Raises:
        ConfigError: the URL is not a valid worker address.
    """
    return PoolConfig(workers=(worker_config("default", url),))
