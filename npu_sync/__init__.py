"""npu_sync: spread inference tasks over a pool of NPU workers from synchronous code."""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

from npu_sync.config import PoolConfig, WorkerConfig, load_config, parse_config
from npu_sync.deadletter import DeadLetter, DeadLetterQueue, ReplayReport
from npu_sync.decorator import NpuTask, npu_task
from npu_sync.errors import (
    ConfigError,
    InvalidTask,
    NoWorkerAvailable,
    NpuSyncError,
    PoolClosed,
    TaskFailed,
    TaskRejected,
)
from npu_sync.pool import ReloadResult, WorkerPool, get_pool
from npu_sync.stats_types import PoolStatsDict, WorkerRow
from npu_sync.task import Attempt, Task

try:
    __version__ = _version("npu_sync")
except _PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "Attempt",
    "ConfigError",
    "DeadLetter",
    "DeadLetterQueue",
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
