"""The step that turns a task into one worker's request: body, headers, auth.

:class:`Compose` puts on the attempt (``Try.body``, ``Try.headers``) what the worker's
protocol sends: the body encoded once per task (or once per protocol that maps the
payload), ``X-NPU-Task-Id`` and ``X-NPU-Attempt``, the worker's auth headers, and an
observer's headers for this attempt (a trace context), which never override the others.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from npu_sync._life.context import HEDGE, TaskContext, Try
from npu_sync._retry import Outcome
from npu_sync.errors import InvalidTask
from npu_sync.protocols import WorkerProtocol


class Compose:
    """Builds an attempt's request, then hands it to the next step. Stateless;
    thread-safe."""

    __slots__ = ()

    def __call__(
        self, ctx: TaskContext, at: Try, next: Callable[[TaskContext, Try], Outcome]
    ) -> Outcome:
        """Raises:
        InvalidTask: the protocol's body of the payload is not JSON (nothing sent)."""
        worker = at.lease.worker
        headers = ctx.headers
        if at.side == HEDGE:
            headers = {**headers, "X-NPU-Attempt": "2"}
        elif ctx.attempts:
            headers["X-NPU-Attempt"] = str(len(ctx.attempts) + 1)
        protocol = worker.protocol
        if protocol.plain_requests:
            body = ctx.body
        else:
            payload = ctx.task.payload
            mapped = protocol.request_body(payload)
            body = ctx.body if mapped is payload else body_for(ctx, protocol, mapped)
        auth = worker.auth
        if auth is not None:
            headers = {**headers, **auth.headers("POST", worker.base_path + ctx.path)}
        if ctx.extra_headers is not None:  # never over the pool's own or the auth's
            headers = {**ctx.extra_headers(worker.id, int(headers["X-NPU-Attempt"])), **headers}
        at.body = body
        at.headers = headers
        return next(ctx, at)


def body_for(ctx: TaskContext, protocol: WorkerProtocol, mapped: Any) -> bytes:
    """The body ``protocol`` maps the payload to, encoded once per task."""
    bodies = ctx.bodies
    if bodies is None:
        bodies = ctx.bodies = {}
    body = bodies.get(protocol)
    if body is None:
        try:
            body = json.dumps(mapped, separators=(",", ":"), allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            task_id = ctx.task.task_id
            raise InvalidTask(f"task {task_id}: {protocol.name} body: {exc}") from None
        bodies[protocol] = body
    return body
