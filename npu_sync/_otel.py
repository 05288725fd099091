"""OpenTelemetry spans for tasks (the ``otel`` extra: ``opentelemetry-api``).

The only module that imports OpenTelemetry, and imported only by a pool built with
``tracing.opentelemetry: true`` (see docs/tracing.md). Each task is a span, child of
the caller's current span; each attempt a client span under it, whose context goes
to the worker in the ``traceparent`` header (through the globally configured
propagator, W3C trace context by default), so the worker's own spans join the trace
under the attempt that reached it. The routing trace's steps are the task span's
events.

What a span carries: ids (task, worker, dead letter), the model's name, the attempt's
number, outcome, HTTP status and who it was charged to, and the error text the pool
already shows in ``TaskFailed`` (scrubbed of the configuration's secrets). Never a
payload, a header or an answer's body.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import propagate
from opentelemetry import trace as otel_trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from npu_sync._version import installed_version
from npu_sync.errors import TaskFailed, TaskRejected
from npu_sync.task import Task
from npu_sync.trace import Trace, TraceStep

__all__ = ["ATTEMPT_SPAN", "TASK_SPAN", "TaskSpans", "TracingObserver"]

log = logging.getLogger(__name__)

TASK_SPAN = "npu_sync.task"
ATTEMPT_SPAN = "npu_sync.attempt"
_MAX_TEXT = 500  # an error text in an attribute or a status, cut to this


class TracingObserver:
    """Starts a :class:`TaskSpans` for each task a pool runs. Thread-safe.

    Args:
        model_of: the model a payload names (the pool's reading of it), or None.
        tracer_provider: where spans go; default the global one, looked up at each
            span, so a provider set after the pool was built is used.
    """

    def __init__(
        self,
        model_of: Callable[[Any], str | None],
        tracer_provider: otel_trace.TracerProvider | None = None,
    ) -> None:
        self._model_of = model_of
        self._tracer = otel_trace.get_tracer("npu_sync", installed_version(), tracer_provider)

    def __call__(self, task: Task) -> TaskSpans:
        return TaskSpans(self._tracer, task, self._model_of)


class _SpanTrace(Trace):
    """A routing trace that hands every step to its task's spans as it is added, and
    to the caller's own trace, if the task was given one."""

    __slots__ = ("_inner", "_spans")

    def __init__(self, spans: TaskSpans, inner: Trace | None, task_id: str) -> None:
        super().__init__(task_id)
        self._spans = spans
        self._inner = inner

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (a TaskFailed crossing processes) as the plain trace it is: the
        # spans stay here, and the other side need not have OpenTelemetry.
        return (Trace, (), self.__getstate__())

    def add(self, step: TraceStep) -> None:
        super().add(step)
        if self._inner is not None:
            self._inner.add(step)
        self._spans.step(step)


class TaskSpans:
    """The spans of one task: its own and its attempts'. Thread-safe: a hedged task's
    two attempts start and end on two threads. Never raises into the task: a failure
    of the tracing is logged and the task goes on."""

    def __init__(
        self, tracer: otel_trace.Tracer, task: Task, model_of: Callable[[Any], str | None]
    ) -> None:
        self._tracer = tracer
        self._lock = threading.Lock()
        # Attempts not yet ended: worker id, span, start (ns since the epoch).
        self._open: list[tuple[str, otel_trace.Span, int]] = []
        self._trace = _SpanTrace(self, task.trace, task.task_id)
        self._attempts = 0
        self._answered_by: str | None = None
        self._model: str | None = None
        attributes: dict[str, str] = {"npu_sync.task.id": task.task_id}
        try:
            self._model = model_of(task.payload)
        except Exception:
            log.debug("no model read for the span of task %s", task.task_id, exc_info=True)
        if self._model is not None:
            attributes["npu_sync.model"] = self._model
        if task.endpoint is not None:
            attributes["npu_sync.endpoint"] = task.endpoint
        if task.priority is not None:
            attributes["npu_sync.priority"] = task.priority
        # The caller's current span, if any, is the parent (the current context).
        try:
            self.span = tracer.start_span(TASK_SPAN, kind=SpanKind.INTERNAL, attributes=attributes)
        except Exception:  # the tracing's failure is not the task's
            log.warning("could not start the span of task %s", task.task_id, exc_info=True)
            self.span = otel_trace.INVALID_SPAN
        self._context = otel_trace.set_span_in_context(self.span)

    @property
    def trace(self) -> Trace:
        return self._trace

    def attempt_headers(self, worker_id: str, attempt: int) -> Mapping[str, str]:
        """Start the attempt's span; its context, to send to the worker."""
        carrier: dict[str, str] = {}
        try:
            attributes: dict[str, str | int] = {
                "npu_sync.task.id": self._trace.task_id or "",
                "npu_sync.worker.id": worker_id,
                "npu_sync.attempt": attempt,
            }
            if self._model is not None:
                attributes["npu_sync.model"] = self._model
            start = time.time_ns()
            span = self._tracer.start_span(
                ATTEMPT_SPAN,
                context=self._context,
                kind=SpanKind.CLIENT,
                attributes=attributes,
                start_time=start,
            )
            with self._lock:
                self._open.append((worker_id, span, start))
                self._attempts += 1
            propagate.inject(carrier, context=otel_trace.set_span_in_context(span))
        except Exception:
            log.warning("could not start the span of an attempt on %s", worker_id, exc_info=True)
        return carrier

    def step(self, step: TraceStep) -> None:
        """One step of the routing trace: an event of the task's span; an attempt's
        step also ends that attempt's span with its outcome and charge."""
        try:
            self.span.add_event(f"npu_sync.{step.kind}", _event_attributes(step))
            if step.kind == "attempt" and step.worker_id is not None:
                self._end_attempt(step)
        except Exception:
            log.warning("could not trace a step of task %s", self._trace.task_id, exc_info=True)

    def _end_attempt(self, step: TraceStep) -> None:
        with self._lock:
            span = None
            start = 0
            for i, (worker_id, _, _) in enumerate(self._open):
                if worker_id == step.worker_id:
                    _, span, start = self._open.pop(i)
                    break
            if step.outcome == "success":
                self._answered_by = step.worker_id
        if span is None:
            return
        if step.outcome is not None:
            span.set_attribute("npu_sync.outcome", step.outcome)
        if step.charged is not None:
            span.set_attribute("npu_sync.charged", step.charged)
        if step.status is not None:
            span.set_attribute("http.response.status_code", step.status)
        if step.outcome != "success":
            span.set_status(Status(StatusCode.ERROR, _cut(step.error or step.outcome or "")))
        # Ended when the attempt did, not when its step was added (a hedge's failed
        # side is noted once the other side ends).
        end = time.time_ns()
        if step.duration is not None and step.duration >= 0:
            end = min(end, start + int(step.duration * 1e9))
        span.end(end_time=end)

    def end(self, error: BaseException | None) -> None:
        """The task is over: attempts still open (a hedge cancelled by the other's
        answer, an attempt stopped) end as abandoned; then the task's span."""
        try:
            self._end(error)
        except Exception:
            log.warning("could not end the span of task %s", self._trace.task_id, exc_info=True)

    def _end(self, error: BaseException | None) -> None:
        with self._lock:
            left, self._open = self._open, []
            attempts = self._attempts
            answered_by = self._answered_by
        for _, span, _ in left:
            span.set_attribute("npu_sync.outcome", "abandoned")
            span.set_attribute("npu_sync.charged", "nobody")
            span.end()
        span = self.span
        span.set_attribute("npu_sync.attempts", attempts)
        if error is None:
            if answered_by is not None:
                span.set_attribute("npu_sync.outcome", "success")
                span.set_attribute("npu_sync.worker.id", answered_by)
            else:
                span.set_attribute("npu_sync.outcome", "fallback")
        else:
            if isinstance(error, TaskFailed):
                outcome = "failed"
                if error.dead_letter_id:
                    span.set_attribute("npu_sync.dead_letter.id", error.dead_letter_id)
            elif isinstance(error, TaskRejected):
                outcome = "rejected"
            else:
                outcome = "error"
            span.set_attribute("npu_sync.outcome", outcome)
            span.set_attribute("error.type", type(error).__name__)
            span.set_status(Status(StatusCode.ERROR, _cut(str(error))))
        span.end()


def _event_attributes(step: TraceStep) -> dict[str, str | int | float | list[str]]:
    attributes: dict[str, str | int | float | list[str]] = {}
    for name in ("worker_id", "outcome", "status", "duration", "charged", "text"):
        value = getattr(step, name)
        if value is not None:
            attributes[name] = value
    if step.error is not None:
        attributes["error"] = _cut(step.error)
    if step.considered:
        attributes["considered"] = [f"{w}: {why}" for w, why in step.considered]
    return attributes


def _cut(text: str) -> str:
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 1] + "…"
