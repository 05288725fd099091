"""Tasks: validation with clear messages, ids, encoding; and the public surface."""

from __future__ import annotations

import dataclasses
import os
import pickle
import threading
import uuid

import pytest

import npu_sync
from npu_sync.errors import InvalidTask, NpuSyncError
from npu_sync.task import Attempt, Task, as_task, new_task_id


def test_task_ids_are_random_version_4_uuids():
    """Default task ids are distinct uuid4 hex strings."""
    ids = {new_task_id() for _ in range(2000)}
    assert len(ids) == 2000
    for value in list(ids)[:200]:
        parsed = uuid.UUID(hex=value)
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122 and parsed.hex == value


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"endpoint": "inference"}, "endpoint must be a path"),
        ({"timeout": 0}, "timeout must be > 0"),
        ({"timeout": float("nan")}, "timeout must be > 0"),
        ({"timeout": "5"}, "timeout must be a number"),
        ({"timeout": True}, "timeout must be a number"),
        ({"task_id": ""}, "task_id must be a non-empty string"),
        ({"task_id": "a\nb"}, "task_id must be printable"),
    ],
)
def test_bad_task_options_say_what_is_wrong(kwargs, message):
    """Each bad option raises InvalidTask naming the option and the value."""
    with pytest.raises(InvalidTask, match=message):
        Task({"x": 1}, **kwargs)


def test_body_is_compact_json_and_rejects_what_json_cannot_carry():
    """The payload is encoded once, compactly; NaN and objects are refused by name."""
    assert Task({"a": [1, 2]}).body() == b'{"a":[1,2]}'
    with pytest.raises(InvalidTask, match="not JSON-serialisable"):
        Task({"a": float("nan")}).body()
    with pytest.raises(InvalidTask, match="not JSON-serialisable"):
        Task({"a": {1, 2}}).body()


def test_as_task_wraps_payloads_and_passes_tasks_through():
    """A bare payload becomes a Task; a Task is used as it is."""
    task = Task({"x": 1}, task_id="fixed")
    assert as_task(task) is task
    wrapped = as_task({"y": 2})
    assert wrapped.payload == {"y": 2} and wrapped.endpoint is None and wrapped.idempotent


@pytest.mark.parametrize("payload", [{"input_text": "hi"}, [1, 2], "text", None, 0, 1.5])
@pytest.mark.parametrize("scope_entered_before", [False, True])
def test_a_bare_payloads_task_is_the_checked_constructors_field_by_field(
    payload, scope_entered_before, monkeypatch
):
    from npu_sync import task as task_module

    # Whatever ran before in this process: with no scope entered, and with one entered
    # and left (a Flask route's), a bare payload outside any scope takes the fast path.
    monkeypatch.setattr(task_module, "_scopes_used", scope_entered_before)
    made_by = []
    fast = task_module.plain_task
    monkeypatch.setattr(task_module, "plain_task", lambda p: made_by.append(p) or fast(p))
    made = as_task(payload)
    assert made_by == [payload]
    assert type(made) is Task
    checked = Task(payload=payload, task_id=made.task_id)
    for f in dataclasses.fields(Task):
        mine, theirs = getattr(made, f.name), getattr(checked, f.name)
        assert type(mine) is type(theirs) and (mine is theirs or mine == theirs), f.name
    assert made == checked and repr(made) == repr(checked)
    assert pickle.dumps(made) == pickle.dumps(checked)
    if not isinstance(payload, (dict, list)):
        assert hash(made) == hash(checked)
    assert made.body() == checked.body()
    # The checks the fast path skips would change nothing on its task.
    before = pickle.dumps(made)
    made.__post_init__()
    assert pickle.dumps(made) == before
    assert uuid.UUID(made.task_id).version == 4
    assert as_task(payload).task_id != made.task_id
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.payload = "changed"  # type: ignore[misc]


def test_inside_a_scope_a_bare_payload_takes_the_scopes_class():
    from npu_sync.task import priority_scope

    with priority_scope("batch"):
        assert as_task({"x": 1}).priority == "batch"
    assert as_task({"x": 1}).priority is None


def test_the_fast_constructor_refuses_a_task_field_without_a_default(monkeypatch):
    from npu_sync import task as task_module

    fields = dataclasses.fields(Task)
    needed = dataclasses.field()
    needed.name = "needed"
    monkeypatch.setattr(task_module.dataclasses, "fields", lambda cls: (*fields, needed))
    with pytest.raises(TypeError, match=r"Task\.needed has no plain default"):
        task_module._plain_task_maker()


def test_attempt_round_trips_through_a_dict():
    """Attempt records survive to_dict/from_dict (dead letters store them so)."""
    attempt = Attempt("w1", "timeout: read", 1.5, None, 1700000000.0)
    assert Attempt.from_dict(attempt.to_dict()) == attempt


def test_invalid_task_is_an_npu_sync_error_and_a_value_error():
    """Callers can catch bad tasks as NpuSyncError or ValueError."""
    assert issubclass(InvalidTask, NpuSyncError) and issubclass(InvalidTask, ValueError)


def test_public_surface_is_sorted_and_importable():
    """__all__ is sorted, every name in it exists, and nothing private leaks."""
    names = npu_sync.__all__
    assert names == sorted(names)
    for name in names:
        assert hasattr(npu_sync, name), name
    public = {n for n in dir(npu_sync) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(npu_sync, n)).__name__ == "module"}
    assert public - modules == set(names) - {"__version__"}


def test_every_exception_derives_from_the_root():
    """One exception root: every exported exception class is an NpuSyncError."""
    exported = [getattr(npu_sync, name) for name in npu_sync.__all__]
    errors = [e for e in exported if isinstance(e, type) and issubclass(e, BaseException)]
    assert len(errors) == 8
    assert all(issubclass(e, NpuSyncError) for e in errors)


def test_task_ids_are_distinct_across_threads():
    """Ids drawn from many threads at once, across batch refills, never repeat."""
    drawn: list[list[str]] = [[] for _ in range(8)]
    start = threading.Barrier(8)

    def draw(out: list[str]) -> None:
        start.wait()
        for _ in range(1500):
            out.append(new_task_id())

    threads = [threading.Thread(target=draw, args=(out,)) for out in drawn]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ids = [value for out in drawn for value in out]
    assert len(set(ids)) == len(ids) == 8 * 1500


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_never_repeats_its_parents_task_ids():
    """A child forked while its parent holds unused random bits draws ids of its own."""
    new_task_id()  # the parent now holds a batch of bits not yet used
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read)
            os.write(write, "".join(new_task_id() for _ in range(50)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        text = pipe.read().decode()
    os.waitpid(pid, 0)
    child = {text[i : i + 32] for i in range(0, len(text), 32)}
    parent = {new_task_id() for _ in range(600)}
    assert len(child) == 50
    assert not child & parent
