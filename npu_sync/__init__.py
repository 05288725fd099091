"""npu_sync: spread inference tasks over a pool of NPU workers from synchronous code."""

from typing import TYPE_CHECKING as _TYPE_CHECKING

from npu_sync._deadletter import DeadLetter, DeadLetterQueue, ReplayReport
from npu_sync._decorator import NpuTask, npu_task
from npu_sync._pool import ReloadResult, WorkerPool, get_pool
from npu_sync._stats_types import FleetStatsDict, PoolStatsDict, WorkerRow
from npu_sync._version import installed_version as _installed_version
from npu_sync.config import PoolConfig, WorkerConfig, load_config, parse_config
from npu_sync.errors import (
    AdmissionRefused,
    ConfigError,
    InvalidTask,
    NoWorkerAvailable,
    NpuSyncError,
    PoolClosed,
    TaskFailed,
    TaskRejected,
)
from npu_sync.task import Attempt, Task

if _TYPE_CHECKING:
    from npu_sync._aio import AsyncWorkerPool

__version__: str  # declared only: __getattr__ below reads it when first asked for

# Public names imported when first asked for: asyncio costs more to import than most of
# the package, and synchronous callers never need it.
_LAZY = {"AsyncWorkerPool": "npu_sync._aio"}


def __getattr__(name: str) -> object:
    # The version comes from the package metadata, read on first use: importing
    # importlib.metadata costs more than most of the package's own modules.
    if name == "__version__":
        version = _installed_version() or "0.0.0"  # "0.0.0": a source tree, not installed
        globals()["__version__"] = version
        return version
    module = _LAZY.get(name)
    if module is not None:
        import importlib

        value: object = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "__version__", *_LAZY})


__all__ = [
    "AdmissionRefused",
    "AsyncWorkerPool",
    "Attempt",
    "ConfigError",
    "DeadLetter",
    "DeadLetterQueue",
    "FleetStatsDict",
    "InvalidTask",
    "NoWorkerAvailable",
    "NpuSyncError",
    "NpuTask",
    "PoolClosed",
    "PoolConfig",
    "PoolStatsDict",
    "ReloadResult",
    "ReplayReport",
    "Task",
    "TaskFailed",
    "TaskRejected",
    "WorkerConfig",
    "WorkerPool",
    "WorkerRow",
    "__version__",
    "get_pool",
    "load_config",
    "npu_task",
    "parse_config",
]
