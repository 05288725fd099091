"""OpenTelemetry spans of tasks run on real reference workers: one span per task and per
attempt, the routing trace as events, and the ``traceparent`` each worker received."""

from __future__ import annotations

import sys
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import StatusCode

from npu_sync import ConfigError, Task, TaskFailed, WorkerPool
from npu_sync._otel import ATTEMPT_SPAN, TASK_SPAN
from npu_sync.config import parse_config
from npu_sync.trace import Trace
from tests.otelkit import by_name, spans

__all__ = ["spans"]  # the fixture

TOKEN = "tok-otel-never-shown-4f1c9a"
PAYLOAD_TEXT = "payload-text-never-shown-77e2"


def pool_for(*workers: tuple[str, str, int], tracing: bool = True, **sections: Any) -> WorkerPool:
    config = parse_config(
        {
            "npu_workers": {
                "workers": [
                    {
                        "id": wid,
                        "url": url,
                        "priority": priority,
                        "headers": {"Authorization": f"Bearer {TOKEN}"},
                    }
                    for wid, url, priority in workers
                ],
                "health": {"enabled": False},
                "retry": {"max_retries": 3, "backoff_initial": 0.001, "backoff_max": 0.01},
                "tracing": {"opentelemetry": tracing},
                **sections,
            }
        }
    )
    return WorkerPool(config)


def ids(span: ReadableSpan) -> tuple[str, str]:
    """The span's trace id and span id as a traceparent writes them."""
    ctx = span.get_span_context()
    assert ctx is not None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


def parent_seen(seen: dict[str, str]) -> tuple[str, str]:
    """The trace id and parent id of the traceparent a worker received."""
    version, trace_id, parent_id, flags = seen["traceparent"].split("-")
    assert version == "00" and int(flags, 16) & 1  # sampled
    return trace_id, parent_id


def no_secret_anywhere(exporter: Any) -> None:
    for span in exporter.get_finished_spans():
        texts = [repr(dict(span.attributes or {})), span.status.description or ""]
        texts += [repr(dict(e.attributes or {})) for e in span.events]
        for text in texts:
            assert TOKEN not in text, (span.name, text)
            assert PAYLOAD_TEXT not in text, (span.name, text)
            assert "Authorization" not in text, (span.name, text)


def test_a_task_retried_after_a_503_is_one_span_with_two_attempt_spans(start_worker, spans):
    """A 503 then a success: one task span (child of the caller's span), two attempt
    spans under it, the first charged to its worker, the second a success; each worker
    received a traceparent naming the task's trace and that attempt's span."""
    busy = start_worker(worker_id="busy", bearer_token=TOKEN)
    good = start_worker(worker_id="good", bearer_token=TOKEN)
    busy.control(status_code=503)
    caller_tracer = trace.get_tracer("test")
    with (
        pool_for(("busy", busy.url, 1), ("good", good.url, 2)) as pool,
        caller_tracer.start_as_current_span("caller") as caller,
    ):
        out = pool.execute({"model_id": "default", "input_text": PAYLOAD_TEXT})
    assert out["worker_id"] == "good"

    (task_span,) = by_name(spans, TASK_SPAN)
    attempts = sorted(by_name(spans, ATTEMPT_SPAN), key=lambda s: s.attributes["npu_sync.attempt"])
    assert task_span.parent is not None
    assert task_span.parent.span_id == caller.get_span_context().span_id
    assert task_span.context.trace_id == caller.get_span_context().trace_id
    assert task_span.attributes["npu_sync.outcome"] == "success"
    assert task_span.attributes["npu_sync.worker.id"] == "good"
    assert task_span.attributes["npu_sync.model"] == "default"
    assert task_span.attributes["npu_sync.attempts"] == 2
    assert task_span.status.status_code is not StatusCode.ERROR

    first, second = attempts
    for attempt in attempts:
        assert attempt.parent is not None and attempt.parent.span_id == task_span.context.span_id
        assert attempt.context.trace_id == task_span.context.trace_id
    assert first.attributes["npu_sync.worker.id"] == "busy"
    assert first.attributes["npu_sync.outcome"] == "failure"
    assert first.attributes["npu_sync.charged"] == "busy"
    assert first.attributes["http.response.status_code"] == 503
    assert first.status.status_code is StatusCode.ERROR
    assert second.attributes["npu_sync.worker.id"] == "good"
    assert second.attributes["npu_sync.outcome"] == "success"
    assert second.attributes["npu_sync.charged"] == "nobody"

    # The worker saw the attempt span as its parent, in the task's trace.
    (seen_busy,) = busy.stats()["traceparents"]
    (seen_good,) = good.stats()["traceparents"]
    assert parent_seen(seen_busy) == ids(first)
    assert parent_seen(seen_good) == ids(second)
    assert (seen_busy["attempt"], seen_good["attempt"]) == ("1", "2")

    # The routing trace's steps are the task span's events, in order.
    kinds = [e.name for e in task_span.events]
    assert kinds == [
        "npu_sync.choice",
        "npu_sync.attempt",
        "npu_sync.choice",
        "npu_sync.attempt",
    ]
    assert task_span.events[1].attributes["charged"] == "busy"
    # An attempt span lasts what the attempt did, as its step says.
    took = task_span.events[1].attributes["duration"]
    assert (first.end_time - first.start_time) / 1e9 == pytest.approx(took, abs=1e-3)
    considered = task_span.events[2].attributes["considered"]
    assert "busy: excluded: already tried by this task" in considered
    no_secret_anywhere(spans)


def test_a_failed_task_span_has_error_status_and_its_dead_letter_id(start_worker, spans):
    """Every attempt fails: the task span's status is an error and it names the dead
    letter the TaskFailed carries; every attempt span is charged to its worker."""
    one = start_worker(worker_id="one", bearer_token=TOKEN)
    two = start_worker(worker_id="two", bearer_token=TOKEN)
    one.control(status_code=503)
    two.control(status_code=503)
    with (
        pool_for(("one", one.url, 1), ("two", two.url, 1)) as pool,
        pytest.raises(TaskFailed) as failed,
    ):
        pool.execute({"model_id": "default", "input_text": PAYLOAD_TEXT})
    dead_letter_id = failed.value.dead_letter_id
    assert dead_letter_id

    (task_span,) = by_name(spans, TASK_SPAN)
    assert task_span.status.status_code is StatusCode.ERROR
    assert task_span.attributes["npu_sync.dead_letter.id"] == dead_letter_id
    assert task_span.attributes["npu_sync.outcome"] == "failed"
    assert task_span.attributes["error.type"] == "TaskFailed"
    assert task_span.parent is None  # no caller span: a root
    attempts = by_name(spans, ATTEMPT_SPAN)
    assert len(attempts) == failed.value.attempts.__len__() >= 2
    for attempt in attempts:
        assert attempt.attributes["npu_sync.outcome"] == "failure"
        assert attempt.attributes["npu_sync.charged"] == attempt.attributes["npu_sync.worker.id"]
    assert task_span.events[-1].name == "npu_sync.note"
    assert task_span.events[-1].attributes["text"].startswith("gave up:")
    # The trace the exception carries is the one the spans were built from.
    assert failed.value.trace is not None
    assert len(failed.value.trace.workers) == len(attempts)
    no_secret_anywhere(spans)


def test_a_hedged_task_gives_two_attempt_spans(start_worker, spans):
    """An idempotent task whose first worker is slow is hedged to another: two attempt
    spans under the task's, each worker having received its own attempt's traceparent;
    the loser's span ends too, charged to nobody."""
    slow = start_worker(worker_id="slow", bearer_token=TOKEN, latency_ms=3000)
    fast = start_worker(worker_id="fast", bearer_token=TOKEN)
    with pool_for(
        ("slow", slow.url, 1),
        ("fast", fast.url, 2),
        balancing={"hedge": {"enabled": True, "delay": 0.05}},
    ) as pool:
        task = Task({"model_id": "default", "input_text": PAYLOAD_TEXT}, idempotent=True)
        out = pool.execute(task)
    assert out["worker_id"] == "fast"

    (task_span,) = by_name(spans, TASK_SPAN)
    attempts = {s.attributes["npu_sync.worker.id"]: s for s in by_name(spans, ATTEMPT_SPAN)}
    assert set(attempts) == {"slow", "fast"}
    for attempt in attempts.values():
        assert attempt.parent is not None and attempt.parent.span_id == task_span.context.span_id
    assert attempts["fast"].attributes["npu_sync.outcome"] == "success"
    assert attempts["fast"].attributes["npu_sync.attempt"] == 2
    assert attempts["slow"].attributes["npu_sync.outcome"] == "abandoned"
    assert attempts["slow"].attributes["npu_sync.charged"] == "nobody"
    assert "npu_sync.hedge" in [e.name for e in task_span.events]
    (seen_slow,) = slow.stats()["traceparents"]
    (seen_fast,) = fast.stats()["traceparents"]
    assert parent_seen(seen_slow) == ids(attempts["slow"])
    assert parent_seen(seen_fast) == ids(attempts["fast"])
    no_secret_anywhere(spans)


def test_a_submitted_task_keeps_the_callers_span_and_fills_the_callers_trace(start_worker, spans):
    """submit() runs the task on a pool thread: its span is still the child of the span
    current where submit() was called, and a Trace the caller gave is filled too."""
    good = start_worker(worker_id="good", bearer_token=TOKEN)
    given = Trace()
    with pool_for(("good", good.url, 1)) as pool:
        with trace.get_tracer("test").start_as_current_span("caller") as caller:
            future = pool.submit({"model_id": "default", "input_text": "x"}, trace=given)
        future.result(timeout=30)
    (task_span,) = by_name(spans, TASK_SPAN)
    assert task_span.parent is not None
    assert task_span.parent.span_id == caller.get_span_context().span_id
    assert given.workers == ["good"]
    assert [e.name for e in task_span.events] == [f"npu_sync.{s.kind}" for s in given.steps]


def test_tracing_off_sends_no_traceparent_and_makes_no_span(start_worker, spans):
    """Without tracing.opentelemetry, a task run inside a caller's span makes no span of
    the pool's and sends the worker no trace context."""
    good = start_worker(worker_id="good", bearer_token=TOKEN)
    with (
        pool_for(("good", good.url, 1), tracing=False) as pool,
        trace.get_tracer("test").start_as_current_span("caller"),
    ):
        pool.execute({"model_id": "default", "input_text": "x"})
    assert [s.name for s in spans.get_finished_spans()] == ["caller"]
    assert good.stats()["traceparents"] == []


def test_tracing_on_without_the_package_is_a_config_error_naming_the_key(monkeypatch):
    """tracing.opentelemetry: true with opentelemetry-api missing fails when the pool is
    built, naming the key and the extra to install."""
    monkeypatch.setitem(sys.modules, "npu_sync._otel", None)  # as if the import failed
    config = parse_config({"npu_workers": {"workers": [], "tracing": {"opentelemetry": True}}})
    with pytest.raises(ConfigError, match=r"npu_workers\.tracing\.opentelemetry: true needs"):
        WorkerPool(config)


def test_a_hanging_worker_cut_short_by_the_deadline_is_charged_to_nobody(start_worker, spans):
    """A worker that reads the request and never answers: the task's deadline cuts the
    attempt short; its span ends abandoned and charged to nobody, the worker having
    received its traceparent, and the task span ends failed with its dead letter."""
    stuck = start_worker(worker_id="stuck", bearer_token=TOKEN)
    stuck.control(hang=True)
    with (
        pool_for(("stuck", stuck.url, 1)) as pool,
        pytest.raises(TaskFailed) as failed,
    ):
        pool.execute({"model_id": "default", "input_text": PAYLOAD_TEXT}, timeout=0.5)
    (task_span,) = by_name(spans, TASK_SPAN)
    (attempt,) = by_name(spans, ATTEMPT_SPAN)
    assert attempt.attributes["npu_sync.outcome"] == "abandoned"
    assert attempt.attributes["npu_sync.charged"].startswith("nobody")
    assert task_span.attributes["npu_sync.dead_letter.id"] == failed.value.dead_letter_id
    assert task_span.status.status_code is StatusCode.ERROR
    (seen,) = stuck.stats()["traceparents"]
    assert parent_seen(seen) == ids(attempt)
    no_secret_anywhere(spans)
