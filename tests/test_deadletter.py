"""Tests for npu_sync._deadletter: the stores, records and replay."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from npu_sync import WorkerPool
from npu_sync._deadletter import (
    SCHEMA_VERSION,
    DeadLetter,
    DeadLetterQueue,
    DeadLetterStore,
    MemoryDeadLetterStore,
    ReplayReport,
    SQLiteDeadLetterStore,
    open_store,
)
from npu_sync.errors import ConfigError, NpuSyncError, TaskFailed, TaskRejected
from npu_sync.task import Attempt, Task
from npu_sync.testing import FakeClock

REPO_ROOT = Path(__file__).resolve().parent.parent


def make_record(n: int = 0, *, payload: Any = None, now: float = 1_700_000_000.0) -> DeadLetter:
    task = Task(
        payload={"model_id": "default", "input_text": f"text {n}"} if payload is None else payload,
        timeout=5.0,
        idempotent=n % 2 == 0,
        task_id=f"task-{n}",
    )
    return DeadLetter.from_task(
        task,
        endpoint="/inference",
        error="retries exhausted: worker w2: timeout",
        attempts=[
            Attempt(worker_id="w1", error="timeout", duration=1.5, started_at=now - 3),
            Attempt(
                worker_id="w2", error="HTTP 503", duration=0.25, status=503, started_at=now - 1
            ),
        ],
        now=now + n,
        first_attempt_at=now - 3,
    )


@pytest.fixture(params=["memory", "sqlite"])
def store_factory(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[..., DeadLetterStore]]:
    made: list[DeadLetterStore] = []

    def factory(max_records: int = 10000) -> DeadLetterStore:
        store: DeadLetterStore
        if request.param == "memory":
            store = MemoryDeadLetterStore(max_records=max_records)
        else:
            store = SQLiteDeadLetterStore(tmp_path / "dlq.sqlite3", max_records=max_records)
        made.append(store)
        return store

    yield factory
    for store in made:
        store.close()


@pytest.fixture
def store(store_factory: Callable[..., DeadLetterStore]) -> DeadLetterStore:
    return store_factory()


# --- records ---------------------------------------------------------------------------


def test_from_task_copies_task_fields_and_gets_its_own_id() -> None:
    """from_task keeps the task's identity and options and gives the record a fresh id."""
    task = Task(payload={"x": 1}, timeout=2.5, idempotent=False, task_id="t-1")
    record = DeadLetter.from_task(
        task, endpoint="/inference", error="boom\n  second line", attempts=[], now=50.0
    )
    assert record.task_id == "t-1" and record.id != "t-1" and len(record.id) == 32
    assert (record.payload, record.endpoint, record.idempotent, record.timeout) == (
        {"x": 1},
        "/inference",
        False,
        2.5,
    )
    assert record.error == "boom second line"
    assert (record.first_attempt_at, record.last_attempt_at, record.created_at) == (50, 50, 50)
    assert record.replays == 0


def test_to_task_rebuilds_the_same_task() -> None:
    """to_task gives back the task id, payload, endpoint, timeout and idempotency."""
    record = make_record(3)
    task = record.to_task()
    assert task == Task(
        payload=record.payload,
        endpoint="/inference",
        timeout=5.0,
        idempotent=False,
        task_id="task-3",
    )


def test_to_dict_is_json_and_round_trips() -> None:
    """to_dict survives json.dumps/loads and from_dict rebuilds an equal record."""
    record = make_record(1)
    data = json.loads(json.dumps(record.to_dict()))
    assert DeadLetter.from_dict(data) == record


def test_from_dict_names_a_missing_key() -> None:
    """from_dict rejects a record without a required key, naming the key."""
    data = make_record().to_dict()
    del data["task_id"]
    with pytest.raises(ValueError, match="task_id"):
        DeadLetter.from_dict(data)


# --- both stores -----------------------------------------------------------------------


def test_add_get_and_len(store: DeadLetterStore) -> None:
    """An added record can be read back whole, and len counts it."""
    record = make_record(1)
    store.add(record)
    assert store.get(record.id) == record
    assert store.get("missing") is None
    assert len(store) == 1


def test_add_twice_is_an_error(store: DeadLetterStore) -> None:
    """Adding a record whose id is already stored raises instead of duplicating it."""
    record = make_record()
    store.add(record)
    with pytest.raises(ValueError, match=record.id):
        store.add(record)
    assert len(store) == 1


def test_list_is_oldest_first_with_limit_and_offset(store: DeadLetterStore) -> None:
    """list returns records in the order added and pages with limit/offset."""
    records = [make_record(n) for n in range(5)]
    for record in records:
        store.add(record)
    assert store.list() == records
    assert store.list(limit=2) == records[:2]
    assert store.list(limit=2, offset=3) == records[3:]
    assert store.list(offset=4) == records[4:]
    assert store.list(limit=0) == []
    with pytest.raises(ValueError):
        store.list(offset=-1)


def test_replace_updates_in_place(store: DeadLetterStore) -> None:
    """replace changes a record without moving it, and refuses an unknown id."""
    first, second = make_record(1), make_record(2)
    store.add(first)
    store.add(second)
    changed = DeadLetter.from_dict({**first.to_dict(), "replays": 2, "error": "again"})
    store.replace(changed)
    assert store.list() == [changed, second]
    with pytest.raises(KeyError):
        store.replace(make_record(9))


def test_remove_and_purge(store: DeadLetterStore) -> None:
    """remove deletes one record and says whether it existed; purge deletes and counts all."""
    records = [make_record(n) for n in range(3)]
    for record in records:
        store.add(record)
    assert store.remove(records[1].id) is True
    assert store.remove(records[1].id) is False
    assert store.list() == [records[0], records[2]]
    assert store.purge() == 2
    assert len(store) == 0 and store.list() == []


def test_bounded_store_evicts_oldest_and_counts_it(
    store_factory: Callable[..., DeadLetterStore], caplog: pytest.LogCaptureFixture
) -> None:
    """At max_records the oldest record goes, is counted in dropped and logged by id and task."""
    store = store_factory(max_records=3)
    records = [make_record(n) for n in range(5)]
    with caplog.at_level(logging.WARNING, logger="npu_sync._deadletter"):
        for record in records:
            store.add(record)
    assert store.list() == records[2:]
    assert store.dropped == 2
    evicted = [r for r in caplog.records if "evicted" in r.getMessage()]
    assert len(evicted) == 2
    assert records[0].id in evicted[0].getMessage() and "task-0" in evicted[0].getMessage()


def test_max_records_must_be_positive() -> None:
    """A store bound below one record is refused."""
    with pytest.raises(ValueError):
        MemoryDeadLetterStore(max_records=0)


# --- SQLite ------------------------------------------------------------------------------


def test_sqlite_records_survive_a_new_store_object(tmp_path: Path) -> None:
    """Records written by one store object are read by the next one on the same file."""
    path = tmp_path / "dlq.sqlite3"
    records = [make_record(n) for n in range(3)]
    first = SQLiteDeadLetterStore(path)
    for record in records:
        first.add(record)
    first.close()
    second = SQLiteDeadLetterStore(path)
    try:
        assert second.list() == records
    finally:
        second.close()


def test_sqlite_record_survives_sigkill_right_after_add(tmp_path: Path) -> None:
    """A record whose add() returned is in the file even if the process is then SIGKILLed."""
    path = tmp_path / "dlq.sqlite3"
    code = textwrap.dedent(
        f"""
        import sys
        from npu_sync._deadletter import DeadLetter, SQLiteDeadLetterStore
        from npu_sync.task import Task
        store = SQLiteDeadLetterStore({str(path)!r})
        record = DeadLetter.from_task(
            Task(payload={{"n": 1}}, task_id="killed-task"),
            endpoint="/inference", error="retries exhausted", attempts=[], now=1.0,
        )
        store.add(record)
        print("added", record.id, flush=True)
        sys.stdin.read()
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    ) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline().split()
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert line[0] == "added"
    store = SQLiteDeadLetterStore(path)
    try:
        record = store.get(line[1])
        assert record is not None and record.task_id == "killed-task"
    finally:
        store.close()


def test_sqlite_two_stores_in_threads_lose_nothing(tmp_path: Path) -> None:
    """Two store objects on one file, written by many threads at once, keep every record."""
    path = tmp_path / "dlq.sqlite3"
    stores = [SQLiteDeadLetterStore(path, busy_timeout=30), SQLiteDeadLetterStore(path)]
    threads_per_store, per_thread = 4, 25
    start = threading.Barrier(len(stores) * threads_per_store)
    errors: list[BaseException] = []
    added: list[str] = []
    added_lock = threading.Lock()

    def writer(store: SQLiteDeadLetterStore, base: int) -> None:
        try:
            start.wait()
            for n in range(per_thread):
                record = make_record(base + n)
                store.add(record)
                with added_lock:
                    added.append(record.id)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=writer, args=(store, (i * threads_per_store + j) * 1000))
        for i, store in enumerate(stores)
        for j in range(threads_per_store)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert errors == []
        assert sorted(r.id for r in stores[0].list()) == sorted(added)
        assert len(stores[1]) == len(stores) * threads_per_store * per_thread
    finally:
        for store in stores:
            store.close()


def test_sqlite_eviction_is_shared_across_store_objects(tmp_path: Path) -> None:
    """Two bounded store objects on one file keep the bound and share the dropped count."""
    path = tmp_path / "dlq.sqlite3"
    a = SQLiteDeadLetterStore(path, max_records=4)
    b = SQLiteDeadLetterStore(path, max_records=4)
    try:
        for n in range(10):
            (a if n % 2 else b).add(make_record(n))
        assert [r.task_id for r in a.list()] == [f"task-{n}" for n in range(6, 10)]
        assert a.dropped == b.dropped == 6
    finally:
        a.close()
        b.close()


def test_sqlite_schema_version_and_wal_are_set(tmp_path: Path) -> None:
    """A new file carries the schema version in user_version and uses the WAL journal."""
    path = tmp_path / "dlq.sqlite3"
    SQLiteDeadLetterStore(path).close()
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 1
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


def test_sqlite_refuses_a_newer_schema(tmp_path: Path) -> None:
    """A file written by a newer schema version is refused with a message naming it."""
    path = tmp_path / "dlq.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(NpuSyncError, match=f"schema version {SCHEMA_VERSION + 1}"):
        SQLiteDeadLetterStore(path)


def test_sqlite_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    """A path in a directory that does not exist fails naming the directory, creating nothing."""
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        SQLiteDeadLetterStore(missing / "dlq.sqlite3")
    assert not missing.exists()


def test_sqlite_refuses_a_file_that_is_not_a_database(tmp_path: Path) -> None:
    """Opening a file that is not SQLite fails with NpuSyncError naming the path."""
    path = tmp_path / "notes.txt"
    path.write_text("not a database, just some text that is long enough " * 20)
    with pytest.raises(NpuSyncError, match=r"notes\.txt"):
        SQLiteDeadLetterStore(path)


def test_sqlite_new_file_is_private(tmp_path: Path) -> None:
    """A new store file is readable by its owner only, as payloads may hold user data."""
    path = tmp_path / "dlq.sqlite3"
    SQLiteDeadLetterStore(path).close()
    assert path.stat().st_mode & 0o077 == 0


def test_sqlite_memory_path_creates_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ":memory:" path keeps records in memory and leaves no file behind."""
    monkeypatch.chdir(tmp_path)
    store = SQLiteDeadLetterStore(":memory:")
    try:
        store.add(make_record())
        assert len(store) == 1
    finally:
        store.close()
    assert list(tmp_path.iterdir()) == []


def test_sqlite_closed_store_refuses_calls(tmp_path: Path) -> None:
    """After close() a store raises NpuSyncError rather than a bare sqlite error."""
    store = SQLiteDeadLetterStore(tmp_path / "dlq.sqlite3")
    store.close()
    store.close()
    with pytest.raises(NpuSyncError, match="closed"):
        store.add(make_record())


# --- open_store -----------------------------------------------------------------------


def test_open_store_builds_each_backend(tmp_path: Path) -> None:
    """open_store maps the config's backend, path and max_records onto a store."""
    from npu_sync.config import DeadLetterConfig

    memory = open_store(DeadLetterConfig(backend="memory", max_records=7))
    assert isinstance(memory, MemoryDeadLetterStore) and memory.max_records == 7
    path = tmp_path / "x.sqlite3"
    sqlite_store = open_store(DeadLetterConfig(backend="sqlite", path=str(path), max_records=3))
    try:
        assert isinstance(sqlite_store, SQLiteDeadLetterStore)
        assert sqlite_store.path == str(path) and sqlite_store.max_records == 3
        assert path.exists()
    finally:
        sqlite_store.close()
    with pytest.raises(ConfigError, match="path"):
        open_store(DeadLetterConfig(backend="sqlite", path=None))


# --- replay ------------------------------------------------------------------------------


class FakeRun:
    """A stand-in for the pool's run(): outcomes by task id, calls counted."""

    def __init__(self, outcomes: dict[str, Any] | None = None) -> None:
        self.outcomes = outcomes or {}
        self.calls: Counter[str] = Counter()
        self.lock = threading.Lock()

    def __call__(self, task: Task) -> Any:
        with self.lock:
            self.calls[task.task_id] += 1
        outcome = self.outcomes.get(task.task_id, {"response": task.task_id})
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def failed(task_id: str) -> TaskFailed:
    return TaskFailed(
        "retries exhausted: worker w3: HTTP 503",
        task_id=task_id,
        dead_letter_id="ignored",
        attempts=[Attempt(worker_id="w3", error="HTTP 503", duration=0.5, status=503)],
    )


def test_replay_success_removes_and_returns_result(store: DeadLetterStore) -> None:
    """A replay that succeeds removes the record and reports the worker's result."""
    record = make_record(1)
    store.add(record)
    run = FakeRun()
    report = DeadLetterQueue(store, run).replay(record.id)
    assert report.succeeded == (record.id,) and report.failed == report.rejected == ()
    assert report.results == {record.id: {"response": "task-1"}}
    assert store.get(record.id) is None
    assert run.calls == {"task-1": 1}


def test_replay_sends_the_same_task(store: DeadLetterStore) -> None:
    """The task replayed has the record's task id, payload, endpoint and options."""
    record = make_record(2)
    store.add(record)
    seen: list[Task] = []

    def run(task: Task) -> dict[str, str]:
        seen.append(task)
        return {}

    DeadLetterQueue(store, run).replay(record.id)
    assert seen == [record.to_task()]


def test_replay_failure_keeps_record_with_history(store: DeadLetterStore) -> None:
    """A failed replay keeps the record, counts the replay and appends its attempts."""
    record = make_record(1)
    store.add(record)
    clock = FakeClock()
    dlq = DeadLetterQueue(store, FakeRun({"task-1": failed("task-1")}), clock=clock)
    report = dlq.replay(record.id)
    assert report.failed == (record.id,) and report.succeeded == () and report.results == {}
    kept = dlq.get(record.id)
    assert kept.replays == 1
    assert kept.attempts == (*record.attempts, *failed("task-1").attempts)
    assert "HTTP 503" in kept.error and "\n" not in kept.error
    assert kept.last_attempt_at == clock.time()
    dlq.replay(record.id)
    assert dlq.get(record.id).replays == 2


def test_replay_rejected_keeps_record_for_operator(store: DeadLetterStore) -> None:
    """A replay the worker rejects keeps the record, reports it rejected and records why."""
    record = make_record(1)
    store.add(record)
    rejection = TaskRejected("HTTP 422: bad input", task_id="task-1", status=422, worker_id="w1")
    report = DeadLetterQueue(store, FakeRun({"task-1": rejection})).replay(record.id)
    assert report.rejected == (record.id,) and report.succeeded == report.failed == ()
    kept = store.get(record.id)
    assert kept is not None
    assert "HTTP 422: bad input" in kept.error and kept.replays == 0
    assert kept.attempts[-1].status == 422 and kept.attempts[-1].worker_id == "w1"


def test_replay_all_mixes_outcomes_oldest_first(store: DeadLetterStore) -> None:
    """replay() runs every record oldest first and sorts each into its outcome."""
    records = [make_record(n) for n in range(4)]
    for record in records:
        store.add(record)
    order: list[str] = []
    fake = FakeRun(
        {
            "task-1": failed("task-1"),
            "task-2": TaskRejected("HTTP 400", task_id="task-2", status=400),
        }
    )

    def run(task: Task) -> Any:
        order.append(task.task_id)
        return fake(task)

    report = DeadLetterQueue(store, run).replay()
    assert order == ["task-0", "task-1", "task-2", "task-3"]
    assert report.succeeded == (records[0].id, records[3].id)
    assert report.failed == (records[1].id,)
    assert report.rejected == (records[2].id,)
    assert [r.id for r in store.list()] == [records[1].id, records[2].id]
    assert json.loads(json.dumps(report.to_dict()))["results"] == {
        records[0].id: {"response": "task-0"},
        records[3].id: {"response": "task-3"},
    }


def test_replay_missing_id_raises_key_error(store: DeadLetterStore) -> None:
    """Replaying an id that is not stored raises KeyError naming it and runs nothing."""
    run = FakeRun()
    dlq = DeadLetterQueue(store, run)
    with pytest.raises(KeyError, match="no-such-id"):
        dlq.replay("no-such-id")
    with pytest.raises(KeyError, match="no-such-id"):
        dlq.get("no-such-id")
    assert run.calls == {}


def test_replay_of_empty_queue_reports_nothing(store: DeadLetterStore) -> None:
    """replay() with nothing stored returns an empty report."""
    assert DeadLetterQueue(store, FakeRun()).replay() == ReplayReport()


def test_concurrent_replay_all_runs_each_record_once(store: DeadLetterStore) -> None:
    """Two replay() calls overlapping in time run every record exactly once between them."""
    records = [make_record(n) for n in range(4)]
    for record in records:
        store.add(record)
    release = threading.Event()
    started = threading.Semaphore(0)
    fake = FakeRun()

    def run(task: Task) -> Any:
        started.release()
        assert release.wait(10)
        return fake(task)

    dlq = DeadLetterQueue(store, run)
    reports: list[ReplayReport] = []

    def replay_all() -> None:
        reports.append(dlq.replay())

    first = threading.Thread(target=replay_all)
    second = threading.Thread(target=replay_all)
    first.start()
    assert started.acquire(timeout=10)  # the first call is inside run() for the oldest record
    second.start()
    assert started.acquire(timeout=10)  # the second call is inside run() for another record
    release.set()
    first.join()
    second.join()
    assert fake.calls == {f"task-{n}": 1 for n in range(4)}
    succeeded = [rid for report in reports for rid in report.succeeded]
    assert sorted(succeeded) == sorted(r.id for r in records)
    assert len(store) == 0


def test_replay_skips_a_record_finished_after_it_was_listed(store: DeadLetterStore) -> None:
    """A record another replay finished after this call listed it is not run again."""
    record = make_record(1)
    store.add(record)
    fake = FakeRun()
    dlq = DeadLetterQueue(store, fake)
    real_list = store.list

    def list_then_let_another_replay_finish(**kwargs: Any) -> list[DeadLetter]:
        listed = real_list(**kwargs)
        dlq.replay(record.id)  # completes and removes the record before this call proceeds
        return listed

    slow = DeadLetterQueue(_ListWrapper(store, list_then_let_another_replay_finish), fake)
    report = slow.replay()
    assert report == ReplayReport()
    assert fake.calls == {"task-1": 1}


class _ListWrapper:
    """A store whose list() is replaced, to interleave a second replay deterministically."""

    def __init__(self, inner: DeadLetterStore, list_fn: Callable[..., list[DeadLetter]]) -> None:
        self._inner = inner
        self.list = list_fn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_replay_of_an_id_already_being_replayed_is_refused(store: DeadLetterStore) -> None:
    """replay(id) while another call is replaying that id raises instead of running it twice."""
    record = make_record(1)
    store.add(record)
    inner_errors: list[BaseException] = []

    def run(task: Task) -> Any:
        try:
            dlq.replay(record.id)
        except NpuSyncError as exc:
            inner_errors.append(exc)
        return {}

    dlq = DeadLetterQueue(store, run)
    report = dlq.replay(record.id)
    assert report.succeeded == (record.id,)
    assert len(inner_errors) == 1 and "already being replayed" in str(inner_errors[0])


def test_replay_failure_after_purge_is_not_resurrected(
    store: DeadLetterStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A record purged while its replay ran stays gone when the replay fails."""
    record = make_record(1)
    store.add(record)

    def run(task: Task) -> Any:
        dlq.purge()
        raise failed(task.task_id)

    dlq = DeadLetterQueue(store, run)
    with caplog.at_level(logging.WARNING, logger="npu_sync._deadletter"):
        report = dlq.replay()
    assert report.failed == (record.id,)
    assert len(dlq) == 0
    assert any("removed during its replay" in r.getMessage() for r in caplog.records)


def test_unexpected_error_leaves_record_and_releases_claim(store: DeadLetterStore) -> None:
    """An unexpected error from run() propagates, keeps the record and lets it be replayed later."""
    record = make_record(1)
    store.add(record)
    outcomes: list[Any] = [RuntimeError("pool closed"), {"ok": True}]

    def run(task: Task) -> Any:
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    dlq = DeadLetterQueue(store, run)
    with pytest.raises(RuntimeError):
        dlq.replay(record.id)
    assert dlq.get(record.id) == record
    assert dlq.replay(record.id).results == {record.id: {"ok": True}}


def test_queue_delegates_to_store(store: DeadLetterStore) -> None:
    """add/list/remove/purge/len on the queue act on its store."""
    dlq = DeadLetterQueue(store, FakeRun())
    assert dlq.store is store
    records = [make_record(n) for n in range(3)]
    for record in records:
        dlq.add(record)
    assert len(dlq) == 3 and dlq.list(limit=1, offset=1) == [records[1]]
    assert dlq.remove(records[0].id) is True
    assert dlq.purge() == 2 and len(store) == 0


# --- claims across store objects and processes ---------------------------------------


def test_sqlite_claims_hold_across_store_objects_until_released(tmp_path: Path) -> None:
    """A claim taken through one connection refuses every other until given back."""
    path = tmp_path / "dlq.sqlite3"
    one, two = SQLiteDeadLetterStore(path), SQLiteDeadLetterStore(path)
    try:
        one.add(make_record(1))
        assert one.claim("x") is True
        assert two.claim("x") is False
        assert one.claim("x") is False  # a claim is not re-entrant either
        two.release_claim("x")  # not two's to give back
        assert two.claim("x") is False
        one.release_claim("x")
        assert two.claim("x") is True
    finally:
        one.close()
        two.close()


def test_sqlite_a_claim_whose_owner_died_expires(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After its lease a claim may be taken over; the old owner's release is then a no-op."""
    import npu_sync._deadletter as deadletter

    path = tmp_path / "dlq.sqlite3"
    one, two = SQLiteDeadLetterStore(path), SQLiteDeadLetterStore(path)
    try:
        monkeypatch.setattr(deadletter, "CLAIM_SECONDS", -1.0)  # every lease already over
        assert one.claim("x") is True
        monkeypatch.setattr(deadletter, "CLAIM_SECONDS", 120.0)
        assert two.claim("x") is True
        one.release_claim("x")
        assert one.claim("x") is False
    finally:
        one.close()
        two.close()


def test_sqlite_a_file_from_before_claims_gets_the_claims_table(tmp_path: Path) -> None:
    """Opening a schema-1 file without the claims table adds it; records are kept."""
    path = tmp_path / "dlq.sqlite3"
    store = SQLiteDeadLetterStore(path)
    store.add(make_record(1))
    store.close()
    conn = sqlite3.connect(path)
    conn.execute("DROP TABLE dead_letter_claims")
    conn.commit()
    conn.close()
    store = SQLiteDeadLetterStore(path)
    try:
        assert store.claim(make_record(1).id) is True
        assert len(store) == 1
    finally:
        store.close()


def test_queue_replays_claim_through_the_sqlite_file(tmp_path: Path) -> None:
    """A record claimed by another store object of the same file is skipped by replay()."""
    path = tmp_path / "dlq.sqlite3"
    mine, theirs = SQLiteDeadLetterStore(path), SQLiteDeadLetterStore(path)
    try:
        records = [make_record(n) for n in range(3)]
        for record in records:
            mine.add(record)
        assert theirs.claim(records[1].id)
        run = FakeRun()
        report = DeadLetterQueue(mine, run).replay()
        assert report.succeeded == (records[0].id, records[2].id)
        assert set(run.calls) == {"task-0", "task-2"}
        assert [r.id for r in mine.list()] == [records[1].id]
    finally:
        mine.close()
        theirs.close()


# --- a store that is busy or gone --------------------------------------------------------


def hold_write_lock(path: Path) -> sqlite3.Connection:
    """Another connection holding the file's write lock, as another process would."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("BEGIN IMMEDIATE")
    return conn


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_sqlite_add_waits_for_a_locked_file_no_longer_than_its_timeout(tmp_path: Path) -> None:
    """With the write lock held elsewhere, add(timeout=) gives up while it is still held."""
    path = tmp_path / "dlq.sqlite3"
    store = SQLiteDeadLetterStore(path)  # busy_timeout 30 s
    blocker = hold_write_lock(path)
    try:
        thread, result = in_thread(lambda: store.add(make_record(1), timeout=0.2))
        thread.join(10)  # far below the 30 s busy timeout the call would otherwise wait
        assert not thread.is_alive(), "add() waited past its timeout"
        assert isinstance(result[0], NpuSyncError)
        assert "stayed locked by another connection until the task's deadline" in str(result[0])
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    store.add(make_record(2), timeout=0.2)  # and the connection is usable again
    assert len(store) == 1
    store.close()


def test_counts_answer_while_another_thread_waits_on_the_store(tmp_path: Path) -> None:
    """counts() never waits: an add() stuck behind a locked file does not hold it up."""
    path = tmp_path / "dlq.sqlite3"
    store = SQLiteDeadLetterStore(path)
    store.add(make_record(1))
    assert store.counts() == (1, 0)
    blocker = hold_write_lock(path)
    try:
        stuck, _ = in_thread(lambda: store.add(make_record(2)))  # holds the store's lock
        queue = DeadLetterQueue(store, FakeRun())
        pause = threading.Event()
        for _ in range(1000):  # until the add() holds the store's lock
            if store._lock.locked():
                break
            pause.wait(0.01)
        assert store._lock.locked()
        assert queue.counts() == (1, 0)  # the last known numbers, at once
        assert stuck.is_alive()
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    stuck.join(10)
    assert store.counts() == (2, 0)
    store.close()
    assert store.counts() == (None, None)


def test_sqlite_a_deleted_directory_fails_loudly_instead_of_writing_nowhere(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Once the file's directory is deleted, add() raises rather than commit to an
    unlinked file; reads fail the same way."""
    import shutil

    directory = tmp_path / "state"
    directory.mkdir()
    store = SQLiteDeadLetterStore(directory / "dlq.sqlite3")
    store.add(make_record(1))
    shutil.rmtree(directory)
    with caplog.at_level(logging.ERROR, logger="npu_sync._deadletter"):
        for n in (2, 3):
            with pytest.raises(NpuSyncError, match="its directory was deleted while in use"):
                store.add(make_record(n))
    with pytest.raises(NpuSyncError, match="its directory was deleted"):
        store.list()
    assert store.counts() == (None, None)
    # Said once in the log, with what to do.
    assert len(caplog.records) == 1 and "until the pool is restarted" in caplog.text
    store.close()


def test_sqlite_a_file_replaced_under_the_store_is_refused(tmp_path: Path) -> None:
    """A file deleted (or swapped for another) while open is detected by its inode."""
    path = tmp_path / "dlq.sqlite3"
    store = SQLiteDeadLetterStore(path)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    with pytest.raises(NpuSyncError, match="the file is gone"):
        store.add(make_record(1))
    store.close()
    store = SQLiteDeadLetterStore(path)
    os.replace(SQLiteDeadLetterStore(tmp_path / "other.sqlite3").path, path)
    with pytest.raises(NpuSyncError, match="replaced by another one"):
        store.get("x")
    store.close()


# --- many threads storing at once: one commit for all that wait ------------------------
# Attacks on "TaskFailed only once its record is durable, within the task's deadline":
# many threads of one process fail tasks at once while each commit (the fsync) is slow,
# and threads are interrupted or run out of time while their record waits or is being
# committed.


class SlowCommits:
    """A store's connection whose every COMMIT is first held by ``hold(n)`` (n counts
    the commits from 1) and then followed by ``after(n)``: a slow disk, or a commit
    stopped where a test wants it. ``groups`` has how many records each commit wrote."""

    def __init__(
        self,
        store: SQLiteDeadLetterStore,
        hold: Callable[[int], object] = lambda n: None,
        after: Callable[[int], object] = lambda n: None,
    ) -> None:
        self._real = store._conn
        self._hold = hold
        self._after = after
        self._stored = len(store)
        self.groups: list[int] = []
        store._conn = self  # type: ignore[assignment]

    def execute(self, sql: str, *args: Any) -> Any:
        if sql != "COMMIT":
            return self._real.execute(sql, *args)
        (count,) = self._real.execute("SELECT COUNT(*) FROM dead_letters").fetchone()
        self.groups.append(count - self._stored)
        n = len(self.groups)
        self._hold(n)
        result = self._real.execute(sql, *args)
        self._stored = count
        self._after(n)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class Interrupted(BaseException):
    """What a signal handler raises in the thread it interrupts (as KeyboardInterrupt)."""


class Turn(threading.Condition):
    """A store's condition through which a test interrupts a thread waiting on it: the
    thread raises Interrupted on waking, holding the condition's lock, as it does when
    a signal's handler raises during ``wait()``."""

    def __init__(self) -> None:
        super().__init__(threading.Lock())
        self.target: str | None = None
        self.raised = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        woken = super().wait(timeout)
        if self.target is not None and self.target == threading.current_thread().name:
            self.target = None
            self.raised.set()
            raise Interrupted
        return woken

    def interrupt(self, name: str) -> None:
        with self:
            self.target = name
            self.notify_all()


def waiting_records(store: SQLiteDeadLetterStore, count: int) -> None:
    """Until ``count`` records wait for the connection (their threads have queued)."""
    pause = threading.Event()
    for _ in range(3000):
        with store._turn:
            if len(store._waiting) >= count:
                return
        pause.wait(0.01)
    raise AssertionError(f"{count} records never waited for the store")


def store_in_use(store: SQLiteDeadLetterStore) -> None:
    """Until some thread holds the store's connection."""
    pause = threading.Event()
    for _ in range(3000):
        if store._lock.locked():
            return
        pause.wait(0.01)
    raise AssertionError("no thread took the store")


def adding(
    store: SQLiteDeadLetterStore, n: int, timeout: float = 30.0
) -> tuple[threading.Thread, list[Any]]:
    """A thread named ``task-<n>`` adding record n: its outcome (None or the exception)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(store.add(make_record(n), timeout=timeout))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, name=f"task-{n}", daemon=True)
    thread.start()
    return thread, outcome


def stored(store: SQLiteDeadLetterStore) -> list[str]:
    return sorted(record.task_id for record in store.list())


def test_threads_storing_while_a_commit_is_slow_are_committed_together_in_time(
    tmp_path: Path,
) -> None:
    """16 threads store a record at once and each commit takes 0.15 s: every record is
    stored within its 1 s deadline, in a few commits (one commit each, one after
    another, would take 2.4 s and leave most threads out of time)."""
    threads = 16
    store = SQLiteDeadLetterStore(tmp_path / "spool.sqlite3")
    started = threading.Semaphore(0)
    everyone = threading.Event()

    def slow_disk(n: int) -> None:
        if n == 1:  # the first commit begins once every thread has called add()
            for _ in range(threads):
                started.acquire()
            everyone.set()
        threading.Event().wait(0.15)  # the disk's time, not a synchronisation

    commits = SlowCommits(store, slow_disk)
    errors: list[BaseException] = []

    late: list[float] = []

    def fail_a_task(n: int) -> None:
        started.release()
        deadline = time.monotonic() + 1.0
        try:
            store.add(make_record(n), timeout=1.0)
        except BaseException as exc:
            errors.append(exc)
        if time.monotonic() > deadline:
            late.append(time.monotonic() - deadline)

    runners = [threading.Thread(target=fail_a_task, args=(n,)) for n in range(threads)]
    for runner in runners:
        runner.start()
    for runner in runners:
        runner.join(30)
    assert everyone.is_set()
    assert errors == [] and late == []
    assert len(store) == threads
    assert sum(commits.groups) == threads and len(commits.groups) <= 4, commits.groups
    store.close()


def test_a_record_kept_waiting_by_another_connection_past_its_deadline_is_taken_back(
    tmp_path: Path,
) -> None:
    """Another connection (another process) holds the file's lock while this process's
    writer waits for it: a thread out of time meanwhile leaves with an error, and its
    record is never written later by anyone."""
    path = tmp_path / "dlq.sqlite3"
    store = SQLiteDeadLetterStore(path)
    blocker = hold_write_lock(path)
    try:
        first, first_outcome = adding(store, 1)  # waits for the file's lock
        store_in_use(store)
        with pytest.raises(NpuSyncError, match="stayed locked by another connection"):
            store.add(make_record(2), timeout=0.05)
        assert first.is_alive()
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    first.join(30)
    assert first_outcome == [None]
    store.add(make_record(3), timeout=1.0)  # nor does a later commit carry it
    assert stored(store) == ["task-1", "task-3"]
    store.close()


def test_a_record_past_its_deadline_behind_this_process_own_commit_is_stored(
    tmp_path: Path,
) -> None:
    """A thread whose deadline passes while another thread's commit (a slow disk)
    holds the store keeps waiting: its record goes in the next commit and is
    acknowledged, never given up to this process's own I/O."""
    store = SQLiteDeadLetterStore(tmp_path / "spool.sqlite3")
    deadline: list[float] = []
    second_waits = threading.Event()

    def slow_first_commit(n: int) -> None:
        if n == 1:
            second_waits.wait(30)
            # The disk's time: past the waiting record's deadline.
            threading.Event().wait(max(0.0, deadline[0] - time.monotonic()) + 0.1)

    commits = SlowCommits(store, slow_first_commit)
    first, first_outcome = adding(store, 1)
    store_in_use(store)
    deadline.append(time.monotonic() + 0.05)
    second, second_outcome = adding(store, 2, timeout=0.05)
    waiting_records(store, 1)
    second_waits.set()
    for thread in (first, second):
        thread.join(30)
    assert time.monotonic() > deadline[0]
    assert (first_outcome, second_outcome) == ([None], [None])
    assert commits.groups == [1, 1]
    assert stored(store) == ["task-1", "task-2"]
    store.close()


def test_other_calls_on_the_store_write_the_waiting_records_first(tmp_path: Path) -> None:
    """A record waiting while another call (a listing, a removal) holds the store is
    written by that call's thread before its own work, not after it."""
    store = SQLiteDeadLetterStore(tmp_path / "spool.sqlite3")
    store._lock.acquire()  # another thread's I/O: the next record waits
    waiter, outcome = adding(store, 1)
    waiting_records(store, 1)
    store._lock.release()  # without waking it: the listing below comes first
    assert [r.task_id for r in store.list()] == ["task-1"]
    waiter.join(30)
    assert outcome == [None]
    store.close()


def test_a_record_in_a_commit_under_way_is_acknowledged_even_past_its_deadline(
    tmp_path: Path,
) -> None:
    """A thread whose record another thread is committing waits for that commit, slow
    as it is, then returns: stored and acknowledged, never stored and called lost."""
    store = SQLiteDeadLetterStore(tmp_path / "spool.sqlite3")
    late: list[float] = []
    commits = SlowCommits(
        store, lambda n: threading.Event().wait(max(0.0, late[0] - time.monotonic()))
    )
    store._lock.acquire()  # another thread's I/O: the next record waits
    short, short_outcome = adding(store, 1, timeout=1.0)
    waiting_records(store, 1)
    late.append(time.monotonic() + 1.2)  # a commit slower than that record's deadline
    # Let go without waking it: the next thread to come writes both records.
    store._lock.release()
    writer, writer_outcome = adding(store, 2)
    for thread in (short, writer):
        thread.join(30)
    assert time.monotonic() >= late[0]
    assert (short_outcome, writer_outcome) == ([None], [None])
    assert commits.groups == [2]
    assert stored(store) == ["task-1", "task-2"]
    store.close()


def test_a_locked_file_fails_only_the_records_out_of_time_and_the_others_wait_on(
    tmp_path: Path,
) -> None:
    """Another connection holds the file's lock while a group is written: the group
    waits until its earliest deadline, that record fails, and the others (the writing
    thread's own too) wait on for the lock up to their own deadline, and are stored."""
    path = tmp_path / "dlq.sqlite3"
    store = SQLiteDeadLetterStore(path)
    blocker = hold_write_lock(path)
    try:
        store._lock.acquire()  # another thread's I/O: the next record waits
        short, short_outcome = adding(store, 1, timeout=0.3)
        waiting_records(store, 1)
        store._lock.release()  # without waking it: the next thread writes both
        long, long_outcome = adding(store, 2)
        short.join(30)
        assert isinstance(short_outcome[0], NpuSyncError)
        assert "stayed locked by another connection" in str(short_outcome[0])
        long.join(0.2)
        assert long.is_alive()  # still waiting for the file's lock
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    long.join(30)
    assert long_outcome == [None]
    assert stored(store) == ["task-2"]
    store.close()


def test_a_thread_interrupted_while_its_record_waits_leaves_it_unwritten(
    tmp_path: Path,
) -> None:
    """Interrupted while waiting behind another thread's commit: the interrupt is
    raised at once, and the record is taken back, never written."""
    store = SQLiteDeadLetterStore(tmp_path / "spool.sqlite3")
    store._turn = turn = Turn()
    release = threading.Event()
    SlowCommits(store, lambda n: n == 1 and release.wait(30))
    first, first_outcome = adding(store, 1)
    try:
        store_in_use(store)
        second, second_outcome = adding(store, 2)
        waiting_records(store, 1)
        turn.interrupt("task-2")
        second.join(30)
        assert isinstance(second_outcome[0], Interrupted)
        assert first.is_alive()  # raised while the other commit still held the store
    finally:
        release.set()
        first.join(30)
    assert first_outcome == [None]
    store.add(make_record(3), timeout=1.0)
    assert stored(store) == ["task-1", "task-3"]
    store.close()


def test_a_thread_interrupted_while_its_record_is_committed_waits_for_the_commit(
    tmp_path: Path,
) -> None:
    """Interrupted while another thread commits its record: the interrupt is raised
    only once that commit ended (before, it could not say whether the record is
    stored), and the record is stored."""
    store = SQLiteDeadLetterStore(tmp_path / "spool.sqlite3")
    store._turn = turn = Turn()
    finish = threading.Event()

    def interrupt_the_other(n: int) -> None:
        turn.interrupt("task-1")
        turn.raised.wait(30)
        finish.wait(30)

    SlowCommits(store, interrupt_the_other)
    store._lock.acquire()  # another thread's I/O: the next record waits
    waiter, waiter_outcome = adding(store, 1)
    waiting_records(store, 1)
    store._lock.release()  # without waking it: the next thread writes both
    writer, writer_outcome = adding(store, 2)
    try:
        assert turn.raised.wait(30)
        waiter.join(0.3)  # it would end here if the interrupt did not wait
        still_waiting = waiter.is_alive()
    finally:
        finish.set()
        for thread in (waiter, writer):
            thread.join(30)
    assert still_waiting
    assert isinstance(waiter_outcome[0], Interrupted)
    assert writer_outcome == [None]
    assert stored(store) == ["task-1", "task-2"]
    store.close()


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_thread_interrupted_while_committing_others_records_leaves_them_settled(
    tmp_path: Path, when: str
) -> None:
    """The thread writing a group is interrupted before or after its COMMIT: the other
    thread's record is stored either way (by that commit, or written again by its own
    thread) and acknowledged; the interrupted thread's own is stored only if the
    commit ran."""
    store = SQLiteDeadLetterStore(tmp_path / "spool.sqlite3")

    def interrupt(n: int) -> None:
        if n == 1:
            raise Interrupted

    SlowCommits(
        store,
        interrupt if when == "before" else lambda n: None,
        after=interrupt if when == "after" else lambda n: None,
    )
    store._lock.acquire()
    waiter, waiter_outcome = adding(store, 1)
    waiting_records(store, 1)
    store._lock.release()
    writer, writer_outcome = adding(store, 2)
    for thread in (waiter, writer):
        thread.join(30)
    assert isinstance(writer_outcome[0], Interrupted)
    assert waiter_outcome == [None]
    assert stored(store) == (["task-1"] if when == "before" else ["task-1", "task-2"])
    store.add(make_record(3), timeout=1.0)  # and the store goes on
    store.close()


# --- what npu-sync check looks at ---------------------------------------------------------


def sqlite_config(path: Any) -> Any:
    from npu_sync.config import DeadLetterConfig, PoolConfig

    return PoolConfig(dead_letter=DeadLetterConfig(backend="sqlite", path=str(path)))


def test_check_store_reports_what_opening_would_fail_on(tmp_path: Path) -> None:
    """Missing directory, not writable, not a database: each with its key path; nothing
    is created."""
    from npu_sync._deadletter import check_store

    assert check_store(sqlite_config(tmp_path / "new.sqlite3")) == []
    assert not (tmp_path / "new.sqlite3").exists()
    missing = tmp_path / "nope" / "dlq.sqlite3"
    assert check_store(sqlite_config(missing)) == [
        f"npu_workers.dead_letter.path: directory {missing.parent} does not exist"
    ]
    junk = tmp_path / "junk.sqlite3"
    junk.write_bytes(b"not a database at all")
    assert check_store(sqlite_config(junk)) == [
        f"npu_workers.dead_letter.path: {junk} is not a SQLite database"
    ]
    assert check_store(sqlite_config(tmp_path)) == [
        f"npu_workers.dead_letter.path: {tmp_path} is not a regular file"
    ]
    newer = tmp_path / "newer.sqlite3"
    conn = sqlite3.connect(newer)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    assert check_store(sqlite_config(newer)) == [
        f"npu_workers.dead_letter.path: {newer} has schema version {SCHEMA_VERSION + 1}; "
        f"this npu_sync reads version {SCHEMA_VERSION}"
    ]
    good = SQLiteDeadLetterStore(tmp_path / "good.sqlite3")
    good.close()
    assert check_store(sqlite_config(good.path)) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_check_store_reports_an_unwritable_directory(tmp_path: Path) -> None:
    """A directory the process cannot write is reported before start-up fails on it."""
    from npu_sync._deadletter import check_store

    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        assert check_store(sqlite_config(locked / "dlq.sqlite3")) == [
            f"npu_workers.dead_letter.path: directory {locked} is not writable "
            "(the file and its journal go there)"
        ]
    finally:
        locked.chmod(0o700)


def test_open_store_names_the_key_when_the_path_is_unusable(tmp_path: Path) -> None:
    """Start-up fails with dead_letter.path in the message, not a bare FileNotFoundError."""
    from npu_sync.config import DeadLetterConfig

    missing = tmp_path / "nope" / "dlq.sqlite3"
    with pytest.raises(ConfigError) as info:
        open_store(DeadLetterConfig(backend="sqlite", path=str(missing)))
    assert info.value.errors == (
        f"dead_letter.path: dead-letter store {missing}: directory {missing.parent} does not exist",
    )


# Attacks: a dead-letter file truncated in place while the pool runs.


def test_a_store_file_truncated_in_place_is_refused_not_written_into(tmp_path, caplog):
    """`: > dead.sqlite3` (or a copytruncate) while the pool runs: same inode, no
    header. Tasks then fail saying their record was not stored, each record is logged,
    rather than "succeeding" into a file that no longer opens."""
    from npu_sync.config import DeadLetterConfig, HealthConfig, PoolConfig, RetryConfig
    from npu_sync.config import worker_config as make_worker

    store = tmp_path / "dead.sqlite3"
    config = PoolConfig(
        workers=(make_worker("gone", "http://127.0.0.1:9"),),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=0),
        dead_letter=DeadLetterConfig(backend="sqlite", path=str(store)),
    )
    with WorkerPool(config) as pool:
        with pytest.raises(TaskFailed) as first:
            pool.execute(Task({"input_text": "x"}, task_id="before"))
        assert first.value.dead_letter_id is not None
        os.truncate(store, 0)
        with caplog.at_level(logging.ERROR), pytest.raises(TaskFailed) as after:
            pool.execute(Task({"input_text": "x"}, task_id="after"))
        assert after.value.dead_letter_id is None
        assert "truncated" in str(after.value)
        assert any('"task_id": "after"' in r.getMessage() for r in caplog.records)
        assert pool.stats()["dead_letters"]["pending"] is None
