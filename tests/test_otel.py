"""Unit tests of the OpenTelemetry spans (npu_sync._otel) on a fake network: how each
end of a task shows, and that tracing never breaks a task."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import propagate
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace import StatusCode

from npu_sync import TaskRejected, WorkerPool
from npu_sync._otel import ATTEMPT_SPAN, TASK_SPAN
from npu_sync.config import (
    HealthConfig,
    PoolConfig,
    RetryConfig,
    TracingConfig,
    worker_config,
)
from npu_sync.testing import FakeClock, FakeNetwork, FakeRequest, json_response
from tests.otelkit import by_name, spans

__all__ = ["spans"]  # the fixture


def make_pool(net: FakeNetwork, *ids: str, tracing: bool = True, **options: Any) -> WorkerPool:
    cfg = PoolConfig(
        workers=tuple(
            worker_config(w, f"http://127.0.0.1:{9100 + n}", priority=n + 1)
            for n, w in enumerate(ids)
        ),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=3, backoff_initial=0.0, backoff_max=0.0),
        tracing=TracingConfig(opentelemetry=tracing),
    )
    return WorkerPool(cfg, transport_factory=net.factory, clock=FakeClock(), **options)


def ok(req: FakeRequest) -> Any:
    return json_response(200, {"ok": True})


def test_a_rejected_task_is_an_error_span_charged_to_the_task(spans) -> None:
    """A 400 from the only worker: the task span is an error, outcome rejected; its one
    attempt span says, as the routing trace does, that the worker was not charged."""
    net = FakeNetwork()
    net.route("a", lambda req: json_response(400, {"detail": "bad input"}))
    with make_pool(net, "a") as pool, pytest.raises(TaskRejected):
        pool.execute({"model_id": "m1", "input_text": "x"})
    (task_span,) = by_name(spans, TASK_SPAN)
    (attempt,) = by_name(spans, ATTEMPT_SPAN)
    assert task_span.status.status_code is StatusCode.ERROR
    assert task_span.attributes["npu_sync.outcome"] == "rejected"
    assert task_span.attributes["error.type"] == "TaskRejected"
    assert attempt.attributes["npu_sync.outcome"] == "rejected"
    assert (
        attempt.attributes["npu_sync.charged"] == "held: a only if another worker answers the task"
    )
    assert attempt.attributes["npu_sync.model"] == "m1"


def test_a_fallback_answer_shows_as_the_tasks_outcome(spans) -> None:
    """Every worker fails and the caller's fallback answers: the task span is not an
    error, its outcome is fallback, and both attempts are charged to their workers."""
    net = FakeNetwork()
    net.route("a", lambda req: json_response(503, {"detail": "busy"}))
    net.route("b", lambda req: json_response(503, {"detail": "busy"}))
    with make_pool(net, "a", "b") as pool:
        assert pool.execute({"x": 1}, fallback=lambda: "local") == "local"
    (task_span,) = by_name(spans, TASK_SPAN)
    assert task_span.attributes["npu_sync.outcome"] == "fallback"
    assert task_span.status.status_code is not StatusCode.ERROR
    charged = {s.attributes["npu_sync.charged"] for s in by_name(spans, ATTEMPT_SPAN)}
    assert charged == {"a", "b"}


class _Broken(TextMapPropagator):
    """A propagator that fails on every call."""

    def inject(self, carrier: Any, context: Any = None, setter: Any = None) -> None:
        raise RuntimeError("propagator broke")

    def extract(self, carrier: Any, context: Any = None, getter: Any = None) -> Any:
        raise RuntimeError("propagator broke")

    @property
    def fields(self) -> set[str]:
        return set()


def test_a_broken_propagator_never_breaks_the_task(spans, monkeypatch) -> None:
    """Tracing's own failure (here the propagator) is logged; the task is answered, with
    the pool's own headers only, and its spans still end."""
    monkeypatch.setattr(propagate, "get_global_textmap", lambda: _Broken())
    monkeypatch.setattr(propagate, "_HTTP_TEXT_FORMAT", _Broken(), raising=False)
    net = FakeNetwork()
    net.route("a", ok)
    with make_pool(net, "a") as pool:
        assert pool.execute({"x": 1}) == {"ok": True}
    (request,) = net.requests()
    assert "traceparent" not in request.headers
    assert request.headers["X-NPU-Attempt"] == "1"
    assert len(by_name(spans, TASK_SPAN)) == 1


def test_the_attempt_header_never_overrides_the_pools_own_or_the_auth_headers(spans) -> None:
    """The trace context is added to each attempt's headers; the task id, attempt
    number and a worker's Authorization still go as the pool sets them."""
    net = FakeNetwork()
    net.route("a", ok)
    with make_pool(net, "a") as pool:
        pool.execute({"x": 1})
    (request,) = net.requests()
    (task_span,) = by_name(spans, TASK_SPAN)
    assert request.headers["traceparent"].split("-")[1] == f"{task_span.context.trace_id:032x}"
    assert request.headers["X-NPU-Task-Id"] == task_span.attributes["npu_sync.task.id"]


def test_a_hook_that_runs_a_task_from_inside_a_task_gives_a_nested_span(spans) -> None:
    """A hook that calls back into the pool while a task runs (on the task's thread):
    the inner task's span is a child of the current span there, and both end."""
    net = FakeNetwork()
    net.route("a", ok)
    inner_done = threading.Event()
    holder: dict[str, WorkerPool] = {}

    def hook(event: Any) -> None:
        if type(event).__name__ == "TaskSucceeded" and not inner_done.is_set():
            inner_done.set()
            holder["pool"].execute({"inner": True})

    with make_pool(net, "a", hooks=[hook]) as pool:
        holder["pool"] = pool
        pool.execute({"outer": True})
    assert inner_done.is_set()
    tasks = by_name(spans, TASK_SPAN)
    assert len(tasks) == 2
    assert len(by_name(spans, ATTEMPT_SPAN)) == 2
    assert all(s.end_time is not None for s in tasks)


def test_tracing_off_adds_no_header_and_builds_no_observer(spans) -> None:
    """A pool with tracing off has no observer: its requests carry no trace context."""
    net = FakeNetwork()
    net.route("a", ok)
    with make_pool(net, "a", tracing=False) as pool:
        pool.execute({"x": 1})
        assert pool._state.observer is None
    (request,) = net.requests()
    assert "traceparent" not in request.headers
    assert spans.get_finished_spans() == ()


def test_the_tracing_key_is_read_and_checked() -> None:
    """tracing.opentelemetry defaults to off and accepts only true or false."""
    assert TracingConfig().opentelemetry is False
    assert dataclasses.replace(TracingConfig(), opentelemetry=True).opentelemetry


def test_concurrent_tasks_never_mix_their_spans(spans) -> None:
    """Tasks run from many threads at once (map on the pool's threads): each attempt span
    is the child of its own task's span, and each request carries its own task's trace."""
    net = FakeNetwork()
    net.route("a", ok)
    with make_pool(net, "a") as pool:
        assert list(pool.map([{"n": n} for n in range(64)])) == [{"ok": True}] * 64
    tasks = {s.attributes["npu_sync.task.id"]: s for s in by_name(spans, TASK_SPAN)}
    attempts = by_name(spans, ATTEMPT_SPAN)
    assert len(tasks) == len(attempts) == 64
    for attempt in attempts:
        task_span = tasks[attempt.attributes["npu_sync.task.id"]]
        assert attempt.parent is not None
        assert attempt.parent.span_id == task_span.context.span_id
    for request in net.requests():
        task_span = tasks[request.headers["X-NPU-Task-Id"]]
        _, trace_id, _, _ = request.headers["traceparent"].split("-")
        assert trace_id == f"{task_span.context.trace_id:032x}"
    assert len({s.context.trace_id for s in tasks.values()}) == 64  # no caller span: roots


def test_an_awaited_task_on_the_async_pool_is_a_child_of_the_coroutines_span(spans) -> None:
    """AsyncWorkerPool runs the task on a thread of its own: the task span is still the
    child of the span current in the awaiting coroutine."""
    import asyncio

    from opentelemetry import trace

    from npu_sync._aio import AsyncWorkerPool

    net = FakeNetwork()
    net.route("a", ok)

    async def main() -> int:
        async with AsyncWorkerPool(make_pool(net, "a"), close_pool=True) as apool:
            with trace.get_tracer("test").start_as_current_span("handler") as handler:
                assert await apool.execute({"x": 1}) == {"ok": True}
            span_id: int = handler.get_span_context().span_id
            return span_id

    handler_span_id = asyncio.run(main())
    (task_span,) = by_name(spans, TASK_SPAN)
    assert task_span.parent is not None and task_span.parent.span_id == handler_span_id


def test_a_replayed_dead_letter_is_traced_as_a_task_of_its_own(spans) -> None:
    """A failed task is dead-lettered; replayed once its worker answers, the replay is a
    second task span, with the same task id, ending in success."""
    from npu_sync import Task, TaskFailed

    net = FakeNetwork()
    net.route("a", lambda req: json_response(503, {"detail": "busy"}))
    with make_pool(net, "a") as pool:
        with pytest.raises(TaskFailed) as failed:
            pool.execute(Task({"x": 1}, task_id="again"))
        net.route("a", ok)
        assert pool.dead_letters.replay().succeeded == (failed.value.dead_letter_id,)
    first, replayed = sorted(by_name(spans, TASK_SPAN), key=lambda s: s.start_time or 0)
    assert first.attributes["npu_sync.outcome"] == "failed"
    assert replayed.attributes["npu_sync.task.id"] == "again"
    assert replayed.attributes["npu_sync.outcome"] == "success"
    replay_attempts = [
        s for s in by_name(spans, ATTEMPT_SPAN) if s.parent.span_id == replayed.context.span_id
    ]
    assert [s.attributes["npu_sync.outcome"] for s in replay_attempts] == ["success"]


def test_a_traced_tasks_failure_pickles_with_a_plain_trace(spans) -> None:
    """TaskFailed from a traced pool crosses processes: its trace unpickles as a plain
    Trace with every step, needing nothing of OpenTelemetry."""
    import pickle

    from npu_sync import TaskFailed
    from npu_sync.trace import Trace

    net = FakeNetwork()
    net.route("a", lambda req: json_response(503, {"detail": "busy"}))
    with make_pool(net, "a") as pool, pytest.raises(TaskFailed) as failed:
        pool.execute({"x": 1})
    copy = pickle.loads(pickle.dumps(failed.value))
    assert type(copy.trace) is Trace
    assert copy.trace.to_dict() == failed.value.trace.to_dict()
    assert copy.trace.workers == ["a"] * len(failed.value.attempts)


def test_a_tracer_that_fails_to_start_a_span_never_breaks_the_task(spans) -> None:
    """The tracer raises on every span: the task is still answered, with no trace
    context sent."""
    net = FakeNetwork()
    net.route("a", ok)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("tracer broke")

    with make_pool(net, "a") as pool:
        observer = pool._state.observer
        assert observer is not None
        observer._tracer = type("Broken", (), {"start_span": staticmethod(broken)})()  # type: ignore[attr-defined]
        assert pool.execute({"x": 1}) == {"ok": True}
    (request,) = net.requests()
    assert "traceparent" not in request.headers
    assert spans.get_finished_spans() == ()


def test_the_tracing_page_names_only_modules_and_objects_that_exist() -> None:
    """Every `npu_sync.x` docs/tracing.md quotes is a span, event or attribute name the
    spans carry, or a module (or an object in one) that can be imported: a module
    renamed or made private shows here, not to a reader looking for it."""
    import ast
    import importlib
    import inspect
    import pathlib
    import re

    from npu_sync import _otel

    emitted = {
        node.value
        for node in ast.walk(ast.parse(inspect.getsource(_otel)))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    # The routing trace's steps are events named after their kind.
    emitted |= {f"npu_sync.{kind}" for kind in ("choice", "attempt", "hedge", "note")}
    assert "npu_sync.task.id" in emitted

    def exists(dotted: str) -> bool:
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                found: object = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for name in parts[cut:]:
                    found = getattr(found, name)
            except AttributeError:
                return False
            return True
        return False

    page = pathlib.Path(__file__).parent.parent / "docs" / "tracing.md"
    quoted = set(re.findall(r"`(npu_sync(?:\.\w+)+)(?:\(\))?`", page.read_text()))
    assert quoted  # the pattern still finds the page's names
    assert sorted(n for n in quoted if n not in emitted and not exists(n)) == []
