"""Units of the per-process dead-letter spool: its own file, and taking over the files of
processes that ended (never of one that runs)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from npu_sync._deadletter import DeadLetter, default_spool_path
from npu_sync._spool import ProcessSpool
from npu_sync.task import Attempt, Task

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock")


def record(n: int) -> DeadLetter:
    task = Task({"n": n}, task_id=f"task-{n}")
    return DeadLetter.from_task(
        task, endpoint="/inference", error="down", attempts=[Attempt("w", "x", 0.1)], now=1000.0 + n
    )


def test_each_process_spool_writes_a_file_of_its_own(tmp_path):
    """Two spools on one base write two files; neither takes over the other's."""
    base = str(tmp_path / "app.spool")
    one, two = ProcessSpool(base), ProcessSpool(base)
    one.own.store.add(record(1))
    assert one.own.path != two.own.path
    assert list(two.orphans()) == [] and list(one.orphans()) == []
    assert len(one.own.store) == 1 and len(two.own.store) == 0


def test_the_file_of_an_ended_process_is_taken_over_and_deleted_once_empty(tmp_path):
    """A process that wrote a record and was killed leaves its file; the next spool
    takes it over, and deleting it once empty leaves no file behind."""
    base = str(tmp_path / "app.spool")
    script = (
        "import os, sys\n"
        "from npu_sync._spool import ProcessSpool\n"
        "from tests.test_spool import record\n"
        "spool = ProcessSpool(sys.argv[1])\n"
        "spool.own.store.add(record(7))\n"
        "os._exit(0)  # no close: as if killed\n"
    )
    subprocess.run([sys.executable, "-c", script, base], check=True, timeout=60)
    survivor = ProcessSpool(base)
    (orphan,) = survivor.orphans()
    assert [r.task_id for r in orphan.store.list()] == ["task-7"]
    orphan.store.remove(orphan.store.list()[0].id)
    assert orphan.discard_if_empty() is True
    survivor.close()
    assert os.listdir(tmp_path) == []


def test_a_taken_over_file_that_still_holds_records_is_kept(tmp_path):
    """An orphan whose records could not all be moved stays for the next attempt."""
    base = str(tmp_path / "app.spool")
    dead = ProcessSpool(base)
    dead.own.store.add(record(1))
    dead.own._lock.release()  # what the kernel does when the process ends
    survivor = ProcessSpool(base)
    (orphan,) = survivor.orphans()
    assert orphan.discard_if_empty() is False
    (again,) = survivor.orphans()
    assert len(again.store) == 1


def test_a_file_being_taken_over_is_passed_over_by_another_process(tmp_path):
    """While one process moves an orphan's records, another does not take it too."""
    base = str(tmp_path / "app.spool")
    dead = ProcessSpool(base)
    dead.own.store.add(record(1))
    dead.own._lock.release()
    first, second = ProcessSpool(base), ProcessSpool(base)
    taking = first.orphans()
    orphan = next(taking)
    assert list(second.orphans()) == []
    orphan.discard_if_empty()


def test_a_lock_left_without_its_file_is_cleaned_up(tmp_path):
    """A process that ended between creating its lock and its file leaves only the
    lock, which the next spool removes."""
    base = str(tmp_path / "app.spool")
    stray = f"{base}.{'a' * 32}.lock"
    open(stray, "w").close()
    spool = ProcessSpool(base)
    assert list(spool.orphans()) == []
    assert not os.path.exists(stray)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_writes_its_own_file_and_leaves_the_parents_locked(tmp_path):
    """After fork the child spools to a new file; the parent's stays locked (never taken
    over) even once the child has let go of its inherited copy and ended."""
    base = str(tmp_path / "app.spool")
    parent = ProcessSpool(base)
    parent.own.store.add(record(1))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery from here on
        code = 1
        try:
            parent.after_fork()
            parent.own.store.add(record(2))
            os.write(write, parent.own.path.encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    child_path = os.read(read, 4096).decode()
    os.close(read)
    assert os.waitpid(pid, 0)[1] == 0
    assert child_path != parent.own.path
    other = ProcessSpool(base)
    orphans = list(other.orphans())
    assert [o.path for o in orphans] == [child_path]  # the child's, not the parent's
    assert [r.task_id for r in orphans[0].store.list()] == ["task-2"]
    assert [r.task_id for r in parent.own.store.list()] == ["task-1"]


def test_the_default_spool_is_keyed_by_where_records_go_never_by_the_password():
    """Two Redis servers, or two namespaces, get two spools; a password does not."""
    a = default_spool_path("ns", "redis://10.0.0.1:6379/0")
    assert default_spool_path("ns", "redis://10.0.0.2:6379/0") != a
    assert default_spool_path("ns", "redis://10.0.0.1:6379/1") != a
    assert default_spool_path("other", "redis://10.0.0.1:6379/0") != a
    assert default_spool_path("ns", "redis://:secret@10.0.0.1:6379/0") == a
    assert "secret" not in default_spool_path("ns", "redis://:secret@10.0.0.1:6379/0")
