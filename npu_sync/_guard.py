"""The reload guard: whether the pool a reload of the file would leave is one to run.

A file read half-written, cut short or emptied is often valid YAML naming fewer
workers. :class:`ReloadGuard` judges the *resulting* pool, not the edit: a reload that
leaves no enabled worker, or shrinks the running pool's enabled workers by more than a
share, is refused. Replacing workers by others (AutoBot's admin UI saving ``w4`` where
``w1`` was) shrinks nothing and is allowed; the pool then hands tasks over
make-before-break (:mod:`npu_sync._handover`).

The guard's settings come, per key, from the new file's ``reload:`` section when it
gives the key, else from the pool (its ``reload_guard`` argument, else the
``NPU_SYNC_RELOAD_*`` environment, read when the pool is built), else the defaults.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from npu_sync._config_types import PoolConfig, ReloadConfig
from npu_sync.errors import ConfigError

ENV_VARS: dict[str, str] = {
    "allow_empty": "NPU_SYNC_RELOAD_ALLOW_EMPTY",
    "max_removed_share": "NPU_SYNC_RELOAD_MAX_REMOVED_SHARE",
    "handover_timeout": "NPU_SYNC_RELOAD_HANDOVER_TIMEOUT",
}
"""The environment variable of each setting."""

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True, slots=True)
class ReloadGuard:
    """What a reload of the pool's file may do. Immutable, so thread-safe.

    Args:
        allow_empty: let a reload leave no enabled worker.
        max_removed_share: the largest share (``0..1``) by which one reload may shrink
            the number of enabled workers the file named.
        handover_timeout: seconds removed workers keep serving while none of the
            workers a reload added has passed a health check (see
            :class:`npu_sync._handover.Handover`).

    Raises:
        ConfigError: a value out of range, naming ``reload.<field>``.
    """

    allow_empty: bool = False
    max_removed_share: float = 0.5
    handover_timeout: float = 120.0

    def __post_init__(self) -> None:
        problems = []
        share = self.max_removed_share
        if isinstance(share, bool) or not (isinstance(share, (int, float)) and 0 <= share <= 1):
            problems.append(f"reload.max_removed_share: must be >= 0 and <= 1, got {share!r}")
        bound = self.handover_timeout
        if (
            isinstance(bound, bool)
            or not isinstance(bound, (int, float))
            or not (math.isfinite(bound) and 0 < bound <= 86400)
        ):
            problems.append(f"reload.handover_timeout: must be > 0 and <= 86400, got {bound!r}")
        if not isinstance(self.allow_empty, bool):
            problems.append(f"reload.allow_empty: must be true or false, got {self.allow_empty!r}")
        if problems:
            raise ConfigError(problems)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ReloadGuard:
        """The defaults, with each ``NPU_SYNC_RELOAD_*`` variable that is set.

        Raises:
            ConfigError: a variable's value is invalid, naming the variable and value.
        """
        found: dict[str, object] = {}
        problems = []
        for name, var in ENV_VARS.items():
            raw = environ.get(var)
            if raw is None or not raw.strip():
                continue
            text = raw.strip().lower()
            if name == "allow_empty":
                if text in _TRUE | _FALSE:
                    found[name] = text in _TRUE
                    continue
                problems.append(f"{var}: must be true or false, got {raw!r}")
                continue
            try:
                found[name] = float(text)
            except ValueError:
                problems.append(f"{var}: must be a number, got {raw!r}")
        if problems:
            raise ConfigError(problems)
        try:
            return cls(**found)  # type: ignore[arg-type]
        except ConfigError as exc:
            names = {f"reload.{n}": v for n, v in ENV_VARS.items()}
            raise ConfigError([_rename(problem, names) for problem in exc.errors]) from None

    def under(self, file: ReloadConfig) -> ReloadGuard:
        """These settings, with the keys the file's ``reload:`` section gives instead."""
        given = {
            f.name: getattr(file, f.name)
            for f in dataclasses.fields(file)
            if getattr(file, f.name) is not None
        }
        return dataclasses.replace(self, **given) if given else self

    def check(self, old: PoolConfig, new: PoolConfig) -> None:
        """Refuse ``new`` if the pool it leaves is not one to run in place of ``old``.

        ``old`` holds the running pool's workers that the file named. Refused: no
        enabled worker in ``new`` (unless ``allow_empty``), or fewer enabled workers
        than ``old`` by more than ``max_removed_share`` of ``old``'s. A pool with no
        enabled worker to begin with has nothing to protect.

        Raises:
            ConfigError: naming ``<layout>.workers``, what would be lost and the
                setting that allows it.
        """
        before = [w.id for w in old.workers if w.enabled]
        if not before:
            return
        after = {w.id for w in new.workers if w.enabled}
        path = new.key_path("workers")
        if not after:
            if self.allow_empty:
                return
            raise ConfigError(
                f"{path}: the new configuration has no enabled worker (the running one "
                f"has {len(before)}); refused so that a half-written or mistyped file "
                "cannot empty the pool: set reload.allow_empty: true if that is what you "
                "mean",
                source=new.source,
            )
        shrink = len(before) - len(after)
        if shrink <= 0 or shrink / len(before) <= self.max_removed_share:
            return
        lost = [wid for wid in before if wid not in after]
        shown = ", ".join(lost[:5]) + (", ..." if len(lost) > 5 else "")
        raise ConfigError(
            f"{path}: the new configuration leaves {len(after)} of the {len(before)} "
            f"enabled workers (without {shown}), a loss of more than "
            f"reload.max_removed_share ({self.max_removed_share:g}); refused so that a "
            "file cut short cannot shrink the pool: raise reload.max_removed_share if "
            "that is what you mean",
            source=new.source,
        )


def _rename(problem: str, names: Mapping[str, str]) -> str:
    key, sep, rest = problem.partition(": ")
    return f"{names.get(key, key)}{sep}{rest}"
