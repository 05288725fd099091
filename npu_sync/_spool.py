"""Where a Redis dead-letter store keeps records Redis could not take: one SQLite file
per process, and the taking over of files whose process is gone.

A spool shared by every process of a host made a task wait behind other processes'
commits (and their moves to Redis) for the write lock, past the little time a task
that ran out of time has left, and the record was lost. Here each process writes only
its own file, and the records its threads store at once are committed together (see
:class:`~npu_sync._deadletter.SQLiteDeadLetterStore`): a record waits for this
process's own I/O, never for another process, and is never given up for the former.

Each file has a lock file beside it, held (``flock``) by its process for as long as
the file is in use. The lock is released by the kernel when the process ends, however
it ends, so a file whose lock can be taken belongs to nobody: another process of the
same app (or ``npu-sync dlq``) takes it over, moves its records to Redis and deletes
it. The kernel lock, not a process id, decides: a pid may be reused, a lock is never
left behind. A forked child gets a file of its own and lets go of its parent's lock.

The files are named by the spool's *base* path: ``<base>.<32 hex>`` for the records and
``<base>.<32 hex>.lock`` for the lock. The base is keyed by where the records go
(:func:`~npu_sync._deadletter.default_spool_path`), so processes of two apps on one
host never take over each other's records.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sqlite3
import uuid
from collections.abc import Iterator

from npu_sync._deadletter import SQLiteDeadLetterStore, default_spool_path, prepare_default_spool
from npu_sync.errors import NpuSyncError

try:
    import fcntl
except ImportError:  # Windows: no flock, so no taking over of other processes' files
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

_TOKEN = re.compile(r"[0-9a-f]{32}")
_SQLITE_SIDE_FILES = ("", "-wal", "-shm", "-journal")


class _Lock:
    """An exclusive ``flock`` on one lock file, held until :meth:`release`."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd

    @classmethod
    def take(cls, path: str, *, create: bool) -> _Lock | None:
        """The lock on ``path``, or None when another process holds it, the file is
        gone, or it was replaced (deleted by a process that took it over) meanwhile."""
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
        if create:
            flags |= os.O_CREAT | os.O_EXCL
        try:
            fd = os.open(path, flags, 0o600)
        except (FileExistsError, FileNotFoundError):
            return None
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # Whoever deletes a lock file does so holding its lock: a lock taken on a
            # file no longer at the path is a lock on nothing.
            if os.fstat(fd).st_ino != os.stat(path).st_ino:
                raise FileNotFoundError(path)
        except OSError:
            os.close(fd)
            return None
        return cls(path, fd)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


class SpoolFile:
    """One spool file and its lock, held by this process. Thread-safe (the store is).

    Args:
        base: the spool's base path.
        token: the file's 32-hex name part.
        lock: the lock, already held.
        max_records: the store's bound.
    """

    def __init__(
        self, base: str, token: str, lock: _Lock, *, max_records: int | None = None
    ) -> None:
        self.path = f"{base}.{token}"
        self._lock = lock
        self.store = SQLiteDeadLetterStore(self.path, max_records=max_records)

    def discard_if_empty(self) -> bool:
        """Close the store; delete the file when it holds no record. Then let go of the
        lock. Returns whether the file was deleted."""
        try:
            empty = self.store.counts()[0] == 0
        except (sqlite3.Error, NpuSyncError):
            empty = False  # unreadable: kept for the operator, and the lock let go
        finally:
            self.store.close()
        try:
            if empty:
                for suffix in _SQLITE_SIDE_FILES:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(self.path + suffix)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self._lock.path)
        finally:
            self._lock.release()
        return empty

    def after_fork(self) -> None:
        """In a child process: let go of the parent's file without touching it. The
        inherited descriptor is closed, which leaves the parent's lock held (an flock
        belongs to the open file, and the parent keeps its descriptor); the inherited
        SQLite connection is set aside, never used."""
        self.store.after_fork()
        self.store.close()
        self._lock.release()


class ProcessSpool:
    """This process's own spool file, created on construction, and the files of ended
    processes, taken over by :meth:`orphans`. Thread-safe.

    Args:
        base: the base path of the app's spool files (its directory must exist).
        max_records: the bound of this process's file.

    Raises:
        NpuSyncError: the file cannot be created.
    """

    def __init__(self, base: str, *, max_records: int | None = None) -> None:
        self.base = base
        self._max_records = max_records
        self.own = self._create()

    def _create(self) -> SpoolFile:
        for _ in range(8):  # another attempt only after a lock file vanished under us
            token = uuid.uuid4().hex
            lock = _Lock.take(f"{self.base}.{token}.lock", create=True)
            if lock is not None:
                self.token = token
                try:
                    return SpoolFile(self.base, token, lock, max_records=self._max_records)
                except BaseException:
                    lock.release()
                    raise
        raise NpuSyncError(f"cannot create a spool file beside {self.base}")

    def after_fork(self) -> None:
        """In a child process: a file of its own; the parent's stays the parent's."""
        self.own.after_fork()
        self.own = self._create()

    def orphans(self) -> Iterator[SpoolFile]:
        """The files of processes that ended, each locked by this process while the
        caller moves its records (and then calls :meth:`SpoolFile.discard_if_empty`).
        Files whose process still runs, or that another process is taking over, are
        passed over without waiting."""
        if fcntl is None:
            return
        directory = os.path.dirname(os.path.abspath(self.base))
        prefix = os.path.basename(self.base) + "."
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            return
        for name in names:
            if not (name.startswith(prefix) and name.endswith(".lock")):
                continue
            token = name[len(prefix) : -len(".lock")]
            if not _TOKEN.fullmatch(token) or token == self.token:
                continue
            lock = _Lock.take(os.path.join(directory, name), create=False)
            if lock is None:
                continue
            if not os.path.exists(f"{self.base}.{token}"):
                # A process that ended before creating its file: only the lock is left.
                with contextlib.suppress(FileNotFoundError):
                    os.remove(lock.path)
                lock.release()
                continue
            try:
                orphan = SpoolFile(self.base, token, lock)
            except (OSError, NpuSyncError) as exc:
                lock.release()
                log.error("cannot take over the dead-letter spool %s.%s: %s", self.base, token, exc)
                continue
            yield orphan

    def close(self) -> bool:
        """Close this process's file, deleting it when empty; True when deleted."""
        return self.own.discard_if_empty()


def default_base(namespace: str, url: str) -> str:
    """:func:`~npu_sync._deadletter.default_spool_path`, its directory created (0700)
    and checked private.

    Raises:
        NpuSyncError: the directory cannot be created or is not private.
    """
    base = default_spool_path(namespace, url)
    prepare_default_spool(base)
    return base
