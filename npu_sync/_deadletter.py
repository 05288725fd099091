"""Dead letters: durable records of tasks that could not succeed, and their replay.

The pool stores a record here *before* it raises ``TaskFailed``. Operators list,
inspect, replay and purge records through :class:`DeadLetterQueue` (``pool.dead_letters``).
Two stores ship: a bounded in-memory one and a SQLite file; both follow the small
:class:`DeadLetterStore` protocol so other backends can be added.
"""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import inspect
import json
import logging
import os
import sqlite3
import stat
import tempfile
import threading
import time
import types
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import parse_qs, urlsplit

from npu_sync._clock import SYSTEM_CLOCK, Clock
from npu_sync.errors import (
    ConfigError,
    InvalidTask,
    NpuSyncError,
    TaskFailed,
    TaskRejected,
    printable,
)
from npu_sync.task import Attempt, Task

if TYPE_CHECKING:
    from npu_sync.config import DeadLetterConfig, PoolConfig

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
"""The SQLite schema this module writes, kept in ``PRAGMA user_version``."""

_MAX_ERROR_CHARS = 1000

CLAIM_SECONDS = 120.0
"""How long a replay's claim on a record lasts if its process dies before releasing it."""

STORE_WAIT_FLOOR = 0.25
"""The least time storing a dead letter may wait for a store another process holds
(the SQLite file's write lock), even for a task whose deadline has already passed:
without it, a record would be lost to a momentary lock held by another process's
commit. This process's own commits are always waited for. See docs/reliability.md."""


def _one_line(text: str) -> str:
    """Collapse ``text`` to one bounded line of printable characters, so listings stay
    readable and an escape sequence from a worker cannot reach a terminal."""
    line = printable(" ".join(str(text).split()))
    if len(line) > _MAX_ERROR_CHARS:
        line = line[: _MAX_ERROR_CHARS - 3] + "..."
    return line


def _check_page(limit: int | None, offset: int) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be None or an int >= 0, got {limit!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be an int >= 0, got {offset!r}")


def _check_max_records(max_records: int | None, *, allow_none: bool) -> None:
    if max_records is None and allow_none:
        return
    if isinstance(max_records, bool) or not isinstance(max_records, int) or max_records < 1:
        raise ValueError(f"max_records must be an int >= 1, got {max_records!r}")


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One task that could not succeed, with everything needed to inspect and replay it.

    Immutable and so safe to share between threads.
    """

    id: str
    task_id: str
    payload: Any
    endpoint: str
    idempotent: bool
    timeout: float | None
    error: str
    attempts: tuple[Attempt, ...]
    first_attempt_at: float
    last_attempt_at: float
    created_at: float
    replays: int = 0
    # The task's routing trace (npu_sync.trace.Trace.to_dict()), when it was kept.
    trace: dict[str, Any] | None = None

    def to_task(self) -> Task:
        """The task to run again: the same task id, so a worker can de-duplicate it.

        Raises:
            InvalidTask: the stored fields no longer make a valid task.
        """
        return Task(
            payload=self.payload,
            endpoint=self.endpoint,
            timeout=self.timeout,
            idempotent=self.idempotent,
            task_id=self.task_id,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (as long as the payload is, which a sent task's is)."""
        return {
            "id": self.id,
            "task_id": self.task_id,
            "payload": self.payload,
            "endpoint": self.endpoint,
            "idempotent": self.idempotent,
            "timeout": self.timeout,
            "error": self.error,
            "attempts": [attempt.to_dict() for attempt in self.attempts],
            "first_attempt_at": self.first_attempt_at,
            "last_attempt_at": self.last_attempt_at,
            "created_at": self.created_at,
            "replays": self.replays,
            **({} if self.trace is None else {"trace": self.trace}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeadLetter:
        """Rebuild a record from :meth:`to_dict` output.

        Raises:
            ValueError: a required key is missing or has the wrong type.
        """
        try:
            timeout = data.get("timeout")
            return cls(
                id=_need_str(data, "id"),
                task_id=_need_str(data, "task_id"),
                payload=data["payload"],
                endpoint=_need_str(data, "endpoint"),
                idempotent=bool(data["idempotent"]),
                timeout=None if timeout is None else float(timeout),
                error=str(data["error"]),
                attempts=tuple(Attempt.from_dict(dict(a)) for a in data.get("attempts", ())),
                first_attempt_at=float(data["first_attempt_at"]),
                last_attempt_at=float(data["last_attempt_at"]),
                created_at=float(data["created_at"]),
                replays=int(data.get("replays", 0)),
                trace=dict(data["trace"]) if isinstance(data.get("trace"), Mapping) else None,
            )
        except KeyError as exc:
            raise ValueError(f"dead letter record is missing key {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"dead letter record is malformed: {exc}") from None

    @classmethod
    def from_task(
        cls,
        task: Task,
        *,
        endpoint: str,
        error: str,
        attempts: Sequence[Attempt],
        now: float,
        first_attempt_at: float | None = None,
        trace: dict[str, Any] | None = None,
    ) -> DeadLetter:
        """Build the record for a task that just failed.

        Args:
            task: the task that failed.
            endpoint: the endpoint it was sent to (the pool's default when the task named none).
            error: why it failed; collapsed to one line.
            attempts: every attempt made, in order.
            now: wall-clock epoch seconds; becomes ``created_at`` and ``last_attempt_at``.
            first_attempt_at: when the first attempt started (epoch seconds); ``now`` if unknown.

        Returns:
            A new record with a fresh id.
        """
        return cls(
            id=uuid.uuid4().hex,
            task_id=task.task_id,
            payload=task.payload,
            endpoint=endpoint,
            idempotent=task.idempotent,
            timeout=task.timeout,
            error=_one_line(error),
            attempts=tuple(attempts),
            first_attempt_at=now if first_attempt_at is None else first_attempt_at,
            last_attempt_at=now,
            created_at=now,
            trace=trace,
        )


def _need_str(data: Mapping[str, Any], key: str) -> str:
    value = data[key]
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key} must be a non-empty string, got {value!r}")
    return value


class DeadLetterStore(Protocol):
    """Where dead letters live. Implementations must be thread-safe.

    ``add`` returns only once the record is durable for that backend; a store that can
    block (on a lock, a disk) should accept ``timeout=`` seconds as the most it may wait
    and raise :class:`~npu_sync.errors.NpuSyncError` when that runs out. ``list``
    returns records oldest first (in the order they were added). At ``max_records`` the
    oldest record is evicted and counted in ``dropped``.

    Optional methods the queue uses when present: ``counts()`` → ``(records, dropped)``
    without waiting (for ``stats()``), and ``claim(id, run_time=)``/``release_claim(id)``
    for replays that exclude each other across processes (``run_time``, the seconds the
    replay may run, is passed only to a ``claim`` that accepts it).
    """

    def add(self, record: DeadLetter) -> None: ...

    def get(self, record_id: str) -> DeadLetter | None: ...

    def list(self, *, limit: int | None = None, offset: int = 0) -> builtins.list[DeadLetter]: ...

    def replace(self, record: DeadLetter) -> None: ...

    def remove(self, record_id: str) -> bool: ...

    def purge(self) -> int: ...

    def __len__(self) -> int: ...

    def close(self) -> None: ...

    @property
    def dropped(self) -> int: ...


class MemoryDeadLetterStore:
    """Dead letters in process memory, bounded. Thread-safe.

    Records are lost when the process exits. At ``max_records`` the oldest record is
    evicted, counted in :attr:`dropped` and logged as a warning.

    Args:
        max_records: how many records to keep, >= 1.

    Raises:
        ValueError: ``max_records`` is not an int >= 1.
    """

    def __init__(self, max_records: int = 10000) -> None:
        _check_max_records(max_records, allow_none=False)
        self._max_records = max_records
        self._lock = threading.Lock()
        self._records: OrderedDict[str, DeadLetter] = OrderedDict()
        self._dropped = 0

    def after_fork(self) -> None:
        """In a child process: a fresh lock and no records. The parent's records stay
        the parent's; a copy here could be replayed by both processes."""
        self._lock = threading.Lock()
        self._records = OrderedDict()
        self._dropped = 0

    @property
    def max_records(self) -> int:
        return self._max_records

    @property
    def dropped(self) -> int:
        with self._lock:
            return self._dropped

    def add(self, record: DeadLetter, *, timeout: float | None = None) -> None:
        """Store ``record``, evicting the oldest when full. ``timeout`` is accepted for
        the protocol's sake: nothing here waits for longer than a dict update.

        Raises:
            ValueError: a record with the same id is already stored.
        """
        evicted: builtins.list[DeadLetter] = []
        with self._lock:
            if record.id in self._records:
                raise ValueError(f"dead letter {record.id} is already stored")
            self._records[record.id] = record
            while len(self._records) > self._max_records:
                evicted.append(self._records.popitem(last=False)[1])
            self._dropped += len(evicted)
        for old in evicted:
            logger.warning(
                "dead-letter store full (%d records): evicted record %s of task %s",
                self._max_records,
                old.id,
                old.task_id,
            )

    def get(self, record_id: str) -> DeadLetter | None:
        with self._lock:
            return self._records.get(record_id)

    def list(self, *, limit: int | None = None, offset: int = 0) -> builtins.list[DeadLetter]:
        _check_page(limit, offset)
        with self._lock:
            records = builtins.list(self._records.values())
        end = None if limit is None else offset + limit
        return records[offset:end]

    def replace(self, record: DeadLetter) -> None:
        """Update a stored record in place; it keeps its position.

        Raises:
            KeyError: no record with that id is stored.
        """
        with self._lock:
            if record.id not in self._records:
                raise KeyError(f"no dead letter with id {record.id!r}")
            self._records[record.id] = record

    def remove(self, record_id: str) -> bool:
        with self._lock:
            return self._records.pop(record_id, None) is not None

    def purge(self) -> int:
        with self._lock:
            count = len(self._records)
            self._records.clear()
            return count

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def counts(self) -> tuple[int | None, int | None]:
        """``(records, dropped)``; the lock is only ever held for a dict operation."""
        with self._lock:
            return len(self._records), self._dropped

    def close(self) -> None:
        """Nothing to release; the records stay readable."""


_SCHEMA = """
CREATE TABLE dead_letters (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    task_id TEXT NOT NULL,
    payload TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    idempotent INTEGER NOT NULL,
    timeout REAL,
    error TEXT NOT NULL,
    attempts TEXT NOT NULL,
    first_attempt_at REAL NOT NULL,
    last_attempt_at REAL NOT NULL,
    created_at REAL NOT NULL,
    replays INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX dead_letters_task_id ON dead_letters (task_id);
CREATE TABLE dead_letter_meta (
    key TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
INSERT INTO dead_letter_meta (key, value) VALUES ('dropped', 0);
"""

# Added to schema 1 files on open (readers of plain schema 1 ignore it): a replay's claim
# on a record, held by one store object of one process until released or expired.
_CLAIMS = """
CREATE TABLE IF NOT EXISTS dead_letter_claims (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    expires_at REAL NOT NULL
)
"""

_COLUMNS = (
    "id, task_id, payload, endpoint, idempotent, timeout, error, attempts,"
    " first_attempt_at, last_attempt_at, created_at, replays, trace"
)

# Added to schema 1 files on open, like the claims table: a record's routing trace
# (JSON), NULL when none was kept. Readers that name their columns ignore it.
_TRACE_COLUMN = "ALTER TABLE dead_letters ADD COLUMN trace TEXT"


_INHERITED: list[sqlite3.Connection] = []
"""SQLite connections inherited through fork(): never used, never closed."""


class _StayedLocked(NpuSyncError):
    """The file's write lock stayed with another connection until a deadline."""


@dataclass(eq=False, slots=True)
class _Waiting:
    """A record waiting to be committed by whichever thread writes next. Its fields
    change under the store's ``_turn`` condition only."""

    row: tuple[Any, ...]
    until: float | None
    """Its thread's deadline (``time.monotonic()``), None for no deadline."""
    taken: bool = False
    """In a transaction under way: its thread waits for that transaction's outcome."""
    done: bool = False
    error: BaseException | None = None


class SQLiteDeadLetterStore:
    """Dead letters in a SQLite file that survives restarts and process kills. Thread-safe.

    ``add`` returns once the record is committed (WAL journal, ``synchronous=FULL``).
    Several store objects, threads and processes may use one file at once: every write
    is a ``BEGIN IMMEDIATE`` transaction, which waits up to ``busy_timeout`` for the
    file's write lock instead of failing with "database is locked".

    Each store holds one connection guarded by a lock rather than one per thread: SQLite
    runs one writer at a time anyway, pool threads come and go (per-thread connections
    would outlive them and could not be closed from :meth:`close`), and a single
    connection makes ``close`` deterministic.

    Records are committed in groups: threads calling :meth:`add` while another thread
    uses the connection do not queue for it one commit (one ``fsync``) each. They leave
    their record in a list and wait on a condition; the next thread to hold the
    connection (a thread adding, or any other call) first writes every record waiting
    at that moment in one transaction, and wakes their threads once it is committed. A
    record thus waits for the I/O under way in this process and its own group's commit,
    however many threads store at once, and is never given up for that: a deadline
    ends only a wait for *another connection's* write lock (another process). A thread
    whose deadline has come while that lock keeps its record waiting takes it back,
    unwritten (and raises); one whose record is already in a transaction waits for that
    transaction's outcome, even when interrupted, so every record is either committed
    and acknowledged or not written.

    ``dropped`` is kept in the file, so it counts evictions by every process that used it.

    Replays claim a record in the file itself (:meth:`claim`, a row of the
    ``dead_letter_claims`` table written in a ``BEGIN IMMEDIATE`` transaction), so two
    processes replaying the same file never run one record twice; a claim whose
    process died expires after :data:`CLAIM_SECONDS`.

    The file is checked before each use: if it (or its directory) was deleted,
    replaced or truncated while the store was open, every call raises ``NpuSyncError``
    rather than write into a file nobody can read again.

    Args:
        path: the database file. Its directory must exist; the file is created (mode
            0600, as payloads may hold user data) if missing. ``":memory:"`` keeps the
            records in this store object only, which is mostly useful in tests.
        max_records: how many records to keep, >= 1; ``None`` for no bound.
        busy_timeout: seconds to wait for another connection's write lock.

    Raises:
        FileNotFoundError: the file's directory does not exist.
        NpuSyncError: the file is not a SQLite database, is another application's
            database, or was written by a newer schema.
        ValueError: ``max_records`` is not None or an int >= 1.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_records: int | None = None,
        busy_timeout: float = 30.0,
    ) -> None:
        _check_max_records(max_records, allow_none=True)
        self._path = os.fspath(path)
        self._max_records = max_records
        # The connection: held by one thread at a time, for its own I/O (the store's
        # single writer); records to add wait on _turn, never on this lock.
        self._lock = threading.Lock()
        self._turn = threading.Condition(threading.Lock())
        self._waiting: builtins.list[_Waiting] = []
        # Whether the connection's holder is waiting for another connection's write
        # lock (under _turn): the one wait a record's deadline may cut short.
        self._held_off = False
        self._in_memory = self._path == ":memory:"
        if not self._in_memory:
            directory = os.path.dirname(os.path.abspath(self._path))
            if not os.path.isdir(directory):
                raise FileNotFoundError(
                    f"dead-letter store {self._path}: directory {directory} does not exist"
                )
            if not os.path.exists(self._path):
                os.close(os.open(self._path, os.O_CREAT | os.O_WRONLY, 0o600))
        self._busy_timeout = busy_timeout
        self._owner = _owner_id()
        self._counts: tuple[int | None, int | None] = (None, None)
        self._identity: tuple[int, int] | None = None
        self._lost: str | None = None
        try:
            self._conn = self._connect()
        except sqlite3.Error as exc:
            raise NpuSyncError(f"cannot open dead-letter store {self._path}: {exc}") from exc
        self._closed = False
        try:
            self._setup()
            if not self._in_memory:
                info = os.stat(self._path)
                self._identity = (info.st_dev, info.st_ino)
        except BaseException:
            self._conn.close()
            self._closed = True
            raise

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: the sqlite3 module must not open transactions behind
        # our back; each write below opens its own BEGIN IMMEDIATE.
        return sqlite3.connect(
            self._path, timeout=self._busy_timeout, isolation_level=None, check_same_thread=False
        )

    def after_fork(self) -> None:
        """In a child process: a connection of its own.

        SQLite connections must not cross ``fork()``, and closing the inherited one
        could release or checkpoint the parent's database state, so it is kept open,
        unused, for the child's lifetime.
        """
        self._owner = _owner_id()  # the parent's claims stay the parent's
        self._turn = threading.Condition(threading.Lock())
        self._waiting = []  # the parent's waiting threads are not in this process
        self._held_off = False
        if self._closed or self._in_memory:
            self._lock = threading.Lock()
            return
        _INHERITED.append(self._conn)
        self._lock = threading.Lock()
        self._conn = self._connect()

    def _setup(self) -> None:
        try:
            mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal" and not self._in_memory:
                logger.warning(
                    "dead-letter store %s: journal mode is %s, not wal", self._path, mode
                )
            self._conn.execute("PRAGMA synchronous=FULL")
            with self._write():
                version = self._conn.execute("PRAGMA user_version").fetchone()[0]
                if version == 0 and _has_tables(self._conn):
                    raise NpuSyncError(
                        f"dead-letter store {self._path} is a database of something else "
                        "(it has tables, and no npu_sync schema version): name a file of "
                        "its own"
                    )
                if version == 0:
                    for statement in _SCHEMA.split(";"):
                        if statement.strip():
                            self._conn.execute(statement)
                    self._conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                elif version != SCHEMA_VERSION:
                    raise NpuSyncError(
                        f"dead-letter store {self._path} has schema version {version}; "
                        f"this npu_sync reads version {SCHEMA_VERSION}"
                    )
                self._conn.execute(_CLAIMS)
                columns = {row[1] for row in self._conn.execute("PRAGMA table_info(dead_letters)")}
                if "trace" not in columns:
                    self._conn.execute(_TRACE_COLUMN)
                # Known from the start, so stats() has numbers even if its first look
                # finds the store busy.
                (records,) = self._conn.execute("SELECT COUNT(*) FROM dead_letters").fetchone()
                (dropped,) = self._conn.execute(
                    "SELECT value FROM dead_letter_meta WHERE key = 'dropped'"
                ).fetchone()
                self._counts = (int(records), int(dropped))
        except sqlite3.Error as exc:
            raise NpuSyncError(f"cannot open dead-letter store {self._path}: {exc}") from exc

    @property
    def path(self) -> str:
        return self._path

    @property
    def max_records(self) -> int | None:
        return self._max_records

    @contextmanager
    def _write(self, until: float | None = None) -> Iterator[sqlite3.Connection]:
        """One write transaction; the caller holds ``self._lock``.

        BEGIN IMMEDIATE takes the write lock up front: a deferred transaction that
        reads first and then writes can fail at once with SQLITE_BUSY in WAL mode,
        without the busy handler ever waiting. When another connection holds the lock,
        the wait for it ends at ``until`` (a ``time.monotonic()`` value) if given, else
        after ``busy_timeout``; meanwhile threads whose records wait for this store
        may give up at their own deadline (see :meth:`_join`).
        """
        self._conn.execute("PRAGMA busy_timeout = 0")
        try:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc):
                    raise
                wait = self._busy_timeout if until is None else until - time.monotonic()
                self._conn.execute(f"PRAGMA busy_timeout = {max(0, int(wait * 1000))}")
                self._hold_off(True)
                try:
                    self._conn.execute("BEGIN IMMEDIATE")
                except sqlite3.OperationalError as again:
                    if until is not None and "locked" in str(again):
                        raise _StayedLocked(
                            f"dead-letter store {self._path} stayed locked by another "
                            f"connection until the task's deadline: {again}"
                        ) from again
                    raise
                finally:
                    self._hold_off(False)
        finally:
            self._conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout * 1000)}")
        try:
            yield self._conn
        except BaseException:
            # Some errors (a full disk, an I/O error) have already rolled back.
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            raise
        try:
            self._conn.execute("COMMIT")
        except BaseException:
            # A COMMIT that failed (or was interrupted before it ran) leaves the
            # transaction open, and the next BEGIN would fail.
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            raise

    @contextmanager
    def _locked(self) -> Iterator[sqlite3.Connection]:
        """The connection, under this store's lock, once the records other threads
        left waiting for it are written."""
        evicted: builtins.list[tuple[str, str]] = []
        self._lock.acquire()
        try:
            if self._waiting:
                evicted = self._write_waiting(None)
            self._check_open()
            yield self._conn
        finally:
            self._release()
            self._log_evicted(evicted)

    def _hold_off(self, waiting: bool) -> None:
        """Say whether the connection's holder waits for another connection's lock;
        the threads whose records wait are woken to look at their deadline."""
        with self._turn:
            self._held_off = waiting
            if waiting and self._waiting:
                self._turn.notify_all()

    def _check_open(self) -> None:
        """Called with ``self._lock`` held."""
        if self._closed:
            raise NpuSyncError(f"dead-letter store {self._path} is closed")
        self._check_file()

    def _release(self) -> None:
        """Let go of the connection, and wake the records waiting for it: one of their
        threads writes them all."""
        self._lock.release()
        with self._turn:
            if self._waiting:
                self._turn.notify_all()

    def _check_file(self) -> None:
        """Refuse to go on once the file was deleted or replaced under the store.

        SQLite keeps writing into a deleted file's inode, and every one of those
        "committed" records would be lost with the last open connection. Called with
        ``self._lock`` held; a stat() costs microseconds.
        """
        if self._identity is None:
            return
        if self._lost is None:
            try:
                info = os.stat(self._path)
            except OSError as exc:
                directory = os.path.dirname(os.path.abspath(self._path))
                gone = "its directory was deleted" if not os.path.isdir(directory) else None
                self._lost = gone or f"the file is gone ({exc.strerror or exc})"
            else:
                if (info.st_dev, info.st_ino) != self._identity:
                    self._lost = "the file was replaced by another one"
                elif info.st_size < _SQLITE_HEADER_BYTES:
                    # Truncated in place (": > file", a copytruncate): SQLite would go
                    # on committing into its WAL, and the file would not open again.
                    self._lost = "the file was truncated"
            if self._lost is not None:
                logger.error(
                    "dead-letter store %s can no longer be used: %s while it was open. "
                    "Records cannot be stored until the pool is restarted; each failed "
                    "task's record is logged instead",
                    self._path,
                    self._lost,
                )
        if self._lost is not None:
            raise NpuSyncError(f"dead-letter store {self._path}: {self._lost} while in use")

    @property
    def dropped(self) -> int:
        with self._locked() as conn:
            row = conn.execute(
                "SELECT value FROM dead_letter_meta WHERE key = 'dropped'"
            ).fetchone()
        return int(row[0]) if row else 0

    def add(self, record: DeadLetter, *, timeout: float | None = None) -> None:
        """Store ``record`` and commit it, evicting the oldest records when full.

        The record is committed with every other record added meanwhile, by the
        next thread to hold the connection (see the class docstring).

        Args:
            record: the record.
            timeout: the most seconds to wait for the file's write lock while another
                connection holds it (``busy_timeout`` when None). The I/O of this
                store's other threads, and the commit the record is part of, are
                waited for whatever the time.

        Raises:
            ValueError: a record with the same id is already stored.
            InvalidTask: the payload is not JSON-serialisable.
            NpuSyncError: another connection kept the file locked for ``timeout``,
                the store is closed, or its file was deleted.
        """
        until = None if timeout is None else time.monotonic() + timeout
        entry = _Waiting(self._row(record), until)
        with self._turn:
            self._waiting.append(entry)
        # Written by another thread, or by this one; again when another connection's
        # lock held this thread's group back for an earlier deadline than its own.
        while not entry.done and self._join(entry):
            try:
                evicted = self._write_waiting(entry)
            finally:
                self._release()
            self._log_evicted(evicted)
        if entry.error is not None:
            raise entry.error

    def _log_evicted(self, evicted: builtins.list[tuple[str, str]]) -> None:
        for record_id, task_id in evicted:
            logger.warning(
                "dead-letter store %s full (%d records): evicted record %s of task %s",
                self._path,
                self._max_records,
                record_id,
                task_id,
            )

    def _join(self, entry: _Waiting) -> bool:
        """Wait with the records waiting until another thread wrote ``entry`` (False)
        or this one got the connection to write them all (True, lock held).

        Raises:
            NpuSyncError: the deadline came while another connection's write lock kept
                the record waiting (it is taken back, not written).
            BaseException: an interrupt while waiting; raised once the record is taken
                back or, if a transaction already holds it, once that one ended.
        """
        with self._turn:
            while not entry.done:
                if not entry.taken and self._lock.acquire(blocking=False):
                    return True
                left = None if entry.until is None else entry.until - time.monotonic()
                late = left is not None and left <= 0
                if late and not entry.taken and self._held_off:
                    self._waiting.remove(entry)
                    raise _StayedLocked(
                        f"dead-letter store {self._path} stayed locked by another "
                        "connection until the task's deadline"
                    )
                try:
                    # Past its deadline a record still waits for this process's own I/O
                    # (woken when it ends, or when the holder starts waiting for another
                    # connection), and one in a transaction for that one's outcome.
                    self._turn.wait(None if entry.taken or late else left)
                except BaseException:
                    if not entry.taken and not entry.done:
                        self._waiting.remove(entry)
                        raise
                    while not entry.done:
                        self._turn.wait()
                    raise
            return False

    def _write_waiting(self, own: _Waiting | None) -> builtins.list[tuple[str, str]]:
        """Write every waiting record in one transaction; called holding ``self._lock``
        and leaving it held. Each record's outcome is set on its entry (``own`` is the
        calling thread's, if any). Returns the ``(record id, task id)`` of records
        evicted to make room.

        Raises:
            BaseException: an interrupt of this thread, once the others' records are
                settled: committed, or waiting again for another thread to write them.
        """
        with self._turn:
            group, self._waiting = self._waiting, []
            for entry in group:
                entry.taken = True
        again: builtins.list[_Waiting] = []
        evicted: builtins.list[tuple[str, str]] = []
        try:
            try:
                self._check_open()
                again, evicted = self._insert(group)
            except Exception as exc:
                for entry in group:
                    if entry.error is None:
                        entry.error = exc if entry is own else self._copy(exc)
        except BaseException as interrupt:
            again = self._after_interrupt(group, own, interrupt)
            raise
        finally:
            with self._turn:
                for entry in group:
                    if entry in again:
                        entry.taken = False
                    else:
                        entry.done = True
                self._waiting[:0] = again
                self._turn.notify_all()
        return evicted

    def _insert(
        self, group: builtins.list[_Waiting]
    ) -> tuple[builtins.list[_Waiting], builtins.list[tuple[str, str]]]:
        """The transaction of one group. The file's write lock (held by another
        connection) is waited for until the earliest deadline in the group: then those
        records fail, and the others are handed back to wait again. Returns the records
        handed back and the ``(record id, task id)`` of those evicted."""
        deadlines = [entry.until for entry in group if entry.until is not None]
        until = min(deadlines) if deadlines else None
        evicted: builtins.list[tuple[str, str]] = []
        try:
            with self._write(until) as conn:
                for entry in group:
                    try:
                        conn.execute(
                            f"INSERT INTO dead_letters ({_COLUMNS}) "
                            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                            entry.row,
                        )
                    except sqlite3.IntegrityError:
                        # Only this statement is undone; the group's others stand.
                        entry.error = ValueError(f"dead letter {entry.row[0]} is already stored")
                if self._max_records is not None:
                    evicted = self._evict(conn, self._max_records)
        except _StayedLocked as exc:
            assert until is not None  # only a wait with a deadline stops short
            again = []
            for entry in group:
                if entry.until is not None and entry.until <= until:
                    entry.error = _StayedLocked(str(exc))
                else:
                    again.append(entry)
            return again, []
        return [], evicted

    @staticmethod
    def _evict(conn: sqlite3.Connection, bound: int) -> builtins.list[tuple[str, str]]:
        (count,) = conn.execute("SELECT COUNT(*) FROM dead_letters").fetchone()
        excess = count - bound
        if excess <= 0:
            return []
        rows = conn.execute(
            "SELECT seq, id, task_id FROM dead_letters ORDER BY seq LIMIT ?", (excess,)
        ).fetchall()
        conn.execute("DELETE FROM dead_letters WHERE seq <= ?", (rows[-1][0],))
        conn.execute(
            "UPDATE dead_letter_meta SET value = value + ? WHERE key = 'dropped'", (len(rows),)
        )
        return [(row[1], row[2]) for row in rows]

    def _after_interrupt(
        self, group: builtins.list[_Waiting], own: _Waiting | None, interrupt: BaseException
    ) -> builtins.list[_Waiting]:
        """This thread was interrupted while writing ``group`` (the transaction is
        rolled back unless COMMIT had returned). Look in the file: when the records
        are there they stand, acknowledged; when not, the other threads' records are
        handed back to wait for the next writer. Returns those handed back."""
        probe = next((entry for entry in group if entry.error is None), None)
        try:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            committed = probe is not None and (
                self._conn.execute(
                    "SELECT 1 FROM dead_letters WHERE id = ?", (probe.row[0],)
                ).fetchone()
                is not None
            )
        except BaseException as exc:  # not knowing: no thread may say it is stored
            for entry in group:
                if entry.error is None:
                    entry.error = NpuSyncError(
                        f"dead-letter store {self._path}: the thread writing this record "
                        f"was interrupted ({type(interrupt).__name__}) and whether it was "
                        f"committed cannot be read ({type(exc).__name__}: {exc})"
                    )
            return []
        if committed:
            return []
        if own is not None:
            own.error = NpuSyncError(f"dead-letter store {self._path}: interrupted, not stored")
        return [entry for entry in group if entry is not own and entry.error is None]

    def _copy(self, exc: Exception) -> Exception:
        """The error of a group's transaction, for each of the group's other threads:
        an exception object of its own (a traceback belongs to one thread)."""
        if type(exc) is NpuSyncError:
            copy = NpuSyncError(*exc.args)
        else:
            copy = NpuSyncError(
                f"dead-letter store {self._path}: the commit failed: {type(exc).__name__}: {exc}"
            )
        copy.__cause__ = exc
        return copy

    def get(self, record_id: str) -> DeadLetter | None:
        with self._locked() as conn:
            row = conn.execute(
                f"SELECT {_COLUMNS} FROM dead_letters WHERE id = ?", (record_id,)
            ).fetchone()
        return None if row is None else self._record(row)

    def list(self, *, limit: int | None = None, offset: int = 0) -> builtins.list[DeadLetter]:
        _check_page(limit, offset)
        with self._locked() as conn:
            rows = conn.execute(
                f"SELECT {_COLUMNS} FROM dead_letters ORDER BY seq LIMIT ? OFFSET ?",
                (-1 if limit is None else limit, offset),
            ).fetchall()
        return [self._record(row) for row in rows]

    def replace(self, record: DeadLetter) -> None:
        """Update a stored record in place; it keeps its position.

        Raises:
            KeyError: no record with that id is stored.
        """
        values = self._row(record)
        with self._locked() as conn, self._write():
            cursor = conn.execute(
                "UPDATE dead_letters SET task_id = ?, payload = ?, endpoint = ?, idempotent = ?,"
                " timeout = ?, error = ?, attempts = ?, first_attempt_at = ?,"
                " last_attempt_at = ?, created_at = ?, replays = ?, trace = ? WHERE id = ?",
                (*values[1:], record.id),
            )
            if cursor.rowcount == 0:
                raise KeyError(f"no dead letter with id {record.id!r}")

    def remove(self, record_id: str) -> bool:
        with self._locked() as conn, self._write():
            cursor = conn.execute("DELETE FROM dead_letters WHERE id = ?", (record_id,))
        return cursor.rowcount > 0

    def remove_many(self, record_ids: Sequence[str]) -> int:
        """Delete several records in one transaction (one commit for all); returns how
        many were stored."""
        if not record_ids:
            return 0
        with self._locked() as conn, self._write():
            cursor = conn.executemany(
                "DELETE FROM dead_letters WHERE id = ?", [(rid,) for rid in record_ids]
            )
        return cursor.rowcount

    def purge(self) -> int:
        with self._locked() as conn, self._write():
            cursor = conn.execute("DELETE FROM dead_letters")
        return cursor.rowcount

    def __len__(self) -> int:
        with self._locked() as conn:
            (count,) = conn.execute("SELECT COUNT(*) FROM dead_letters").fetchone()
        return int(count)

    def counts(self) -> tuple[int | None, int | None]:
        """``(records, dropped)`` without waiting: for ``stats()``, which must answer
        while another thread or process holds the store. When the store is busy the
        last values read are returned; ``(None, None)`` once it is closed or lost."""
        if not self._lock.acquire(blocking=False):
            return self._counts
        try:
            if self._closed:
                return None, None
            try:
                self._check_file()
            except NpuSyncError:
                return None, None
            self._conn.execute("PRAGMA busy_timeout = 0")
            try:
                (records,) = self._conn.execute("SELECT COUNT(*) FROM dead_letters").fetchone()
                row = self._conn.execute(
                    "SELECT value FROM dead_letter_meta WHERE key = 'dropped'"
                ).fetchone()
            except sqlite3.OperationalError:  # locked (a journal that is not WAL)
                return self._counts
            finally:
                self._conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout * 1000)}")
            self._counts = (int(records), int(row[0]) if row else 0)
            return self._counts
        finally:
            self._release()

    def claim(self, record_id: str, *, run_time: float = 0.0) -> bool:
        """Claim a record for one replay, across every process using this file.

        Args:
            record_id: the record.
            run_time: how long the replay may run, in seconds; the claim lasts that
                long plus :data:`CLAIM_SECONDS`, so it cannot expire while the replay
                still runs, only after its process died.

        Returns:
            True when this store now holds the claim; False when another store object
            (in this process or another) holds an unexpired one.
        """
        now = time.time()  # wall clock: leases are compared between processes
        with self._locked() as conn, self._write():
            conn.execute(
                "DELETE FROM dead_letter_claims WHERE id = ? AND expires_at <= ?",
                (record_id, now),
            )
            cursor = conn.execute(
                "INSERT OR IGNORE INTO dead_letter_claims (id, owner, expires_at) VALUES (?,?,?)",
                (record_id, self._owner, now + CLAIM_SECONDS + max(0.0, run_time)),
            )
            return cursor.rowcount == 1

    def release_claim(self, record_id: str) -> None:
        """Give a claim back; only this store's own (an expired one may be another's)."""
        with self._locked() as conn, self._write():
            conn.execute(
                "DELETE FROM dead_letter_claims WHERE id = ? AND owner = ?",
                (record_id, self._owner),
            )

    def close(self) -> None:
        """Close the connection, once the records waiting for it are written; later
        calls raise NpuSyncError. Idempotent."""
        evicted: builtins.list[tuple[str, str]] = []
        self._lock.acquire()
        try:
            if self._waiting and not self._closed:
                evicted = self._write_waiting(None)
            if not self._closed:
                self._closed = True
                self._conn.close()
        finally:
            self._release()
            self._log_evicted(evicted)

    def _row(self, record: DeadLetter) -> tuple[Any, ...]:
        try:
            payload = json.dumps(record.payload, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidTask(
                f"dead letter {record.id} (task {record.task_id}): payload is not "
                f"JSON-serialisable: {exc}"
            ) from None
        attempts = json.dumps([a.to_dict() for a in record.attempts], separators=(",", ":"))
        return (
            record.id,
            record.task_id,
            payload,
            record.endpoint,
            int(record.idempotent),
            record.timeout,
            record.error,
            attempts,
            record.first_attempt_at,
            record.last_attempt_at,
            record.created_at,
            record.replays,
            None if record.trace is None else json.dumps(record.trace, separators=(",", ":")),
        )

    @staticmethod
    def _record(row: Sequence[Any]) -> DeadLetter:
        return DeadLetter(
            id=row[0],
            task_id=row[1],
            payload=json.loads(row[2]),
            endpoint=row[3],
            idempotent=bool(row[4]),
            timeout=row[5],
            error=row[6],
            attempts=tuple(Attempt.from_dict(a) for a in json.loads(row[7])),
            first_attempt_at=row[8],
            last_attempt_at=row[9],
            created_at=row[10],
            replays=row[11],
            trace=None if row[12] is None else json.loads(row[12]),
        )


def open_store(config: DeadLetterConfig) -> DeadLetterStore:
    """Build the store a dead-letter configuration names.

    Args:
        config: ``backend`` is ``"memory"`` or ``"sqlite"``; a sqlite ``path`` is used as given.

    Returns:
        A new, open store.

    Raises:
        ConfigError: an unknown backend, sqlite without a path, or a sqlite path that
            cannot be used (no directory, not a database, a newer schema), naming
            ``dead_letter.path``.
    """
    if config.backend == "memory":
        return MemoryDeadLetterStore(max_records=config.max_records)
    if config.backend == "sqlite":
        if not config.path:
            raise ConfigError("dead_letter.path: required when backend is sqlite")
        try:
            return SQLiteDeadLetterStore(config.path, max_records=config.max_records)
        except (OSError, NpuSyncError) as exc:
            raise ConfigError(f"dead_letter.path: {exc}") from exc
    raise ConfigError(f"dead_letter.backend: must be 'memory' or 'sqlite', got {config.backend!r}")


def _has_tables(conn: sqlite3.Connection) -> bool:
    """Whether the database holds anything: a file of version 0 is ours only if empty
    (every file this module ever wrote has its schema version set)."""
    return conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchone() is not None


def _takes(function: Callable[..., Any], parameter: str) -> bool:
    """Whether ``function`` accepts the keyword ``parameter`` (stores predating it do not)."""
    try:
        return parameter in inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature
        return False


def _owner_id() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex}"


_SQLITE_MAGIC = b"SQLite format 3\x00"
_SQLITE_HEADER_BYTES = 100  # no database file, once written, is smaller


def check_store(config: PoolConfig) -> builtins.list[str]:
    """What would stop the configured dead-letter store from opening, without opening it.

    For ``npu-sync check``: a sqlite path whose directory is missing or not writable, a
    file there that is not a SQLite database (or is of a newer schema); for redis, a
    spool directory that cannot be created or written. Nothing is created.

    Returns:
        One message per problem, each starting with its key path.
    """
    settings = config.dead_letter
    key = f"{config.layout}.dead_letter"
    if settings.backend == "sqlite" and settings.path and settings.path != ":memory:":
        return [f"{key}.path: {p}" for p in _file_problems(settings.path)]
    if settings.backend == "redis":
        spool = settings.spool_path or default_spool_path(
            config.shared_state.namespace, config.shared_state.url
        )
        problems = _file_problems(spool, creates_directory=settings.spool_path is None)
        if settings.spool_path is None and not problems:
            shared = _shared_directory_problem(os.path.dirname(os.path.abspath(spool)))
            problems = [shared] if shared else []
        return [f"{key}.spool_path: {p}" for p in problems]
    return []


def _file_problems(path: str, *, creates_directory: bool = False) -> builtins.list[str]:
    """Why a SQLite file at ``path`` could not be opened or created; [] when it could."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        if os.path.exists(directory):
            return [f"{directory} is not a directory"]
        if not creates_directory:
            return [f"directory {directory} does not exist"]
        parent = directory
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.access(parent, os.W_OK | os.X_OK):
            return [f"directory {directory} cannot be created: {parent} is not writable"]
        return []
    if not os.access(directory, os.W_OK | os.X_OK):
        return [f"directory {directory} is not writable (the file and its journal go there)"]
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return []  # created on first use
    except OSError as exc:
        return [f"cannot be read: {exc.strerror or exc}"]
    if not stat.S_ISREG(info.st_mode):
        return [f"{path} is not a regular file"]
    if info.st_size == 0:
        return []  # created but never written: becomes a database on first use
    try:
        with open(path, "rb") as fh:
            magic = fh.read(len(_SQLITE_MAGIC))
    except OSError as exc:
        return [f"cannot be read: {exc.strerror or exc}"]
    if magic != _SQLITE_MAGIC:
        return [f"{path} is not a SQLite database"]
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1.0)
        try:
            (version,) = conn.execute("PRAGMA user_version").fetchone()
            foreign = version == 0 and _has_tables(conn)
        finally:
            conn.close()
    except sqlite3.Error as exc:
        return [f"{path} cannot be read as a database: {exc}"]
    if foreign:
        return [
            f"{path} is a database of something else (it has tables, and no npu_sync "
            "schema version)"
        ]
    if version not in (0, SCHEMA_VERSION):
        return [
            f"{path} has schema version {version}; this npu_sync reads version {SCHEMA_VERSION}"
        ]
    return []


def redis_destination(url: str) -> str:
    """Where a Redis URL's records go, without its credentials: scheme, host, port,
    socket path and database. Two URLs with the same destination share records."""
    parts = urlsplit(url)
    db = parse_qs(parts.query).get("db", [""])[0]
    try:
        port: int | str = parts.port or ""
    except ValueError:
        port = ""
    return f"{parts.scheme}://{parts.hostname or ''}:{port}{parts.path}?db={db}"


def default_spool_path(namespace: str, url: str = "") -> str:
    """The base path of a Redis store's spool files, by default:
    ``<temp dir>/npu_sync-<user>/<namespace>-<key>.spool``, where ``key`` is a hash of
    the Redis destination (:func:`redis_destination`, never the password) and the
    namespace. Each process's file is this path with a suffix of its own (see
    :mod:`npu_sync._spool`). Apps sharing a Redis and a namespace share their dead
    letters anyway; the spools of any other two apps on one host never mix."""
    user = str(os.getuid()) if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    key = hashlib.sha256(f"{redis_destination(url)}\0{namespace}".encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"npu_sync-{user}", f"{namespace}-{key}.spool")


def prepare_default_spool(path: str) -> None:
    """Create the default spool's directory (mode 0700) if missing, and refuse one that
    another user owns or may write to: it sits in the shared temporary directory, and
    the records in it hold task payloads.

    Raises:
        NpuSyncError: the directory cannot be created or is not private.
    """
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise NpuSyncError(f"cannot create {directory}: {exc.strerror or exc}") from exc
    problem = _shared_directory_problem(directory)
    if problem:
        raise NpuSyncError(problem)


def _shared_directory_problem(directory: str) -> str | None:
    """Why the default spool's directory is not private to this user; None when it is,
    or does not exist yet (it is then created 0700)."""
    try:
        info = os.stat(directory)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot use {directory}: {exc.strerror or exc}"
    if hasattr(os, "getuid") and (info.st_uid != os.getuid() or info.st_mode & 0o022):
        return (
            f"{directory} belongs to another user or others may write to it: set "
            "dead_letter.spool_path to a file in a directory of your own"
        )
    return None


@dataclass(frozen=True)
class ReplayReport:
    """What one :meth:`DeadLetterQueue.replay` call did. Immutable.

    ``succeeded`` records ran and were removed; their results are in ``results``.
    ``failed`` records failed again and stay stored with ``replays`` incremented (unless
    someone removed them during the replay, which is logged). ``rejected`` records were
    refused by a worker as bad tasks and stay stored for an operator to decide on.
    """

    succeeded: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    rejected: tuple[str, ...] = ()
    results: Mapping[str, Any] = field(default_factory=lambda: types.MappingProxyType({}))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (results are the workers' JSON bodies)."""
        return {
            "succeeded": builtins.list(self.succeeded),
            "failed": builtins.list(self.failed),
            "rejected": builtins.list(self.rejected),
            "results": dict(self.results),
        }


class DeadLetterQueue:
    """The dead letters of one pool: what users see as ``pool.dead_letters``. Thread-safe.

    Concurrent :meth:`replay` calls never run the same record at the same time: each
    claims a record before running it and skips records another call has claimed.

    Args:
        store: where the records live.
        run: runs one task on the pool without dead-lettering it again; returns the
            result or raises ``TaskRejected`` or ``TaskFailed``.
        clock: the source of wall-clock time and durations for replay attempts.
        run_time: the most seconds ``run`` may take for a record (its task's
            deadline); a store's claim on the record is made to outlast it.
        hold: entered around each record's replay, from its claim to the release of
            the claim; the pool counts it as running work there, so that closing the
            pool waits for the replay's outcome to be stored.
    """

    def __init__(
        self,
        store: DeadLetterStore,
        run: Callable[[Task], Any],
        *,
        clock: Clock = SYSTEM_CLOCK,
        run_time: Callable[[DeadLetter], float] | None = None,
        hold: Callable[[], AbstractContextManager[object]] = nullcontext,
    ) -> None:
        self._store = store
        self._run = run
        self._clock = clock
        self._run_time = run_time
        self._hold = hold
        self._lock = threading.Lock()
        self._replaying: set[str] = set()
        self._add_timeout = _takes(store.add, "timeout")
        claim = getattr(store, "claim", None)
        self._claim_run_time = claim is not None and _takes(claim, "run_time")

    def after_fork(self) -> None:
        """In a child process: fresh locks, and the store's own ``after_fork`` if any."""
        self._lock = threading.Lock()
        self._replaying = set()
        reset = getattr(self._store, "after_fork", None)
        if reset is not None:
            reset()

    @property
    def store(self) -> DeadLetterStore:
        return self._store

    def add(self, record: DeadLetter, *, timeout: float | None = None) -> None:
        """Store ``record``; durable when this returns.

        Args:
            record: the record.
            timeout: the task's remaining time: the most the store may wait for a lock
                another process holds (never less than :data:`STORE_WAIT_FLOOR`). None
                waits as the store does by default. Ignored by a store whose ``add``
                takes no timeout.

        Raises:
            NpuSyncError: the store could not take the record within that time.
        """
        if timeout is None or not self._add_timeout:
            self._store.add(record)
            return
        self._store.add(record, timeout=max(timeout, STORE_WAIT_FLOOR))  # type: ignore[call-arg]

    def counts(self) -> tuple[int | None, int | None]:
        """``(records stored, records dropped)`` without waiting on the store: the last
        known numbers while it is busy, None for what cannot be known (closed, lost)."""
        counts = getattr(self._store, "counts", None)
        try:
            if counts is not None:
                records, dropped = counts()
                return records, dropped
            return len(self._store), self._store.dropped
        except NpuSyncError:
            return None, None

    def list(self, *, limit: int | None = None, offset: int = 0) -> builtins.list[DeadLetter]:
        """Stored records, oldest first.

        Raises:
            ValueError: ``limit`` or ``offset`` is negative.
        """
        return self._store.list(limit=limit, offset=offset)

    def get(self, record_id: str) -> DeadLetter:
        """The record with ``record_id``.

        Raises:
            KeyError: no such record.
        """
        record = self._store.get(record_id)
        if record is None:
            raise KeyError(f"no dead letter with id {record_id!r}")
        return record

    def remove(self, record_id: str) -> bool:
        """Delete one record; returns whether it was stored."""
        return self._store.remove(record_id)

    def purge(self) -> int:
        """Delete every record; returns how many were removed."""
        return self._store.purge()

    def __len__(self) -> int:
        return len(self._store)

    def close(self) -> None:
        """Close the store."""
        self._store.close()

    def replay(self, record_id: str | None = None) -> ReplayReport:
        """Run dead-lettered tasks again, one record or all of them oldest first.

        A record is removed only after its task succeeded. Records another replay is
        running are skipped. An exception other than TaskFailed or TaskRejected from the
        pool stops the replay and propagates, leaving the current record untouched.

        Args:
            record_id: the record to replay; ``None`` replays every stored record.

        Returns:
            Which records succeeded, failed again or were rejected, and the results.

        Raises:
            KeyError: ``record_id`` names no stored record.
            NpuSyncError: ``record_id`` is being replayed by another call right now.
        """
        succeeded: builtins.list[str] = []
        failed: builtins.list[str] = []
        rejected: builtins.list[str] = []
        results: dict[str, Any] = {}
        if record_id is not None:
            found = self._store.get(record_id)
            if found is None:
                raise KeyError(f"no dead letter with id {record_id!r}")
            listed = [found]
        else:
            listed = self._store.list()
        for listed_record in listed:
            rid = listed_record.id
            with self._hold():
                if not self._claim(listed_record):
                    if record_id is not None:
                        raise NpuSyncError(f"dead letter {rid} is already being replayed")
                    continue
                try:
                    # Read again after claiming: another replay may have finished and
                    # removed this record since the listing above, and must not run it
                    # twice.
                    current = self._store.get(rid)
                    if current is None:
                        if record_id is not None:
                            raise KeyError(f"no dead letter with id {rid!r}")
                        continue
                    outcome, result = self._replay_one(current)
                finally:
                    self._release(rid)
            if outcome == "succeeded":
                succeeded.append(rid)
                results[rid] = result
            elif outcome == "failed":
                failed.append(rid)
            else:
                rejected.append(rid)
        return ReplayReport(
            succeeded=tuple(succeeded),
            failed=tuple(failed),
            rejected=tuple(rejected),
            results=types.MappingProxyType(results),
        )

    def _claim(self, record: DeadLetter) -> bool:
        record_id = record.id
        with self._lock:
            if record_id in self._replaying:
                return False
            self._replaying.add(record_id)
        # A store shared by processes (SQLite, Redis) also claims across processes, with
        # a lease that expires if this process dies mid-replay, and not before the
        # replay's own deadline: a lease shorter than the task let another process run
        # it a second time while the first run was still waiting for its answer.
        claim = getattr(self._store, "claim", None)
        try:
            if claim is None:
                claimed = True
            elif self._claim_run_time and self._run_time is not None:
                claimed = bool(claim(record_id, run_time=self._run_time(record)))
            else:
                claimed = bool(claim(record_id))
        except BaseException:
            claimed = False
            raise
        finally:
            if not claimed:
                with self._lock:
                    self._replaying.discard(record_id)
        return claimed

    def _release(self, record_id: str) -> None:
        try:
            release = getattr(self._store, "release_claim", None)
            if release is not None:
                release(record_id)
        finally:
            with self._lock:
                self._replaying.discard(record_id)

    def _replay_one(self, record: DeadLetter) -> tuple[str, Any]:
        started_wall = self._clock.time()
        started = self._clock.monotonic()
        try:
            result = self._run(record.to_task())
        except (TaskRejected, InvalidTask) as exc:
            attempt = Attempt(
                worker_id=getattr(exc, "worker_id", None),
                error=_one_line(str(exc)),
                duration=self._clock.monotonic() - started,
                status=getattr(exc, "status", None),
                started_at=started_wall,
            )
            updated = dataclasses.replace(
                record,
                error=_one_line(f"rejected on replay: {exc}"),
                attempts=(*record.attempts, attempt),
                last_attempt_at=self._clock.time(),
            )
            logger.warning(
                "replay of dead letter %s (task %s) rejected: %s", record.id, record.task_id, exc
            )
            self._keep(updated)
            return "rejected", None
        except TaskFailed as exc:
            updated = dataclasses.replace(
                record,
                error=_one_line(f"replay failed: {exc}"),
                attempts=(*record.attempts, *exc.attempts),
                last_attempt_at=self._clock.time(),
                replays=record.replays + 1,
            )
            logger.warning(
                "replay %d of dead letter %s (task %s) failed: %s",
                updated.replays,
                record.id,
                record.task_id,
                exc,
            )
            self._keep(updated)
            return "failed", None
        self._store.remove(record.id)
        logger.info("replayed dead letter %s (task %s)", record.id, record.task_id)
        return "succeeded", result

    def _keep(self, record: DeadLetter) -> None:
        try:
            self._store.replace(record)
        except KeyError:
            logger.warning(
                "dead letter %s (task %s) was removed during its replay; its new outcome "
                "is not stored",
                record.id,
                record.task_id,
            )
