"""How a reference worker behaves: the settings a test changes at run time."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from npu_sync.worker_server._models import CPU_DEVICE, DEVICE

FORCEABLE_STATUS = range(400, 600)


def check_number(name: str, value: object, *, upper: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
    if upper is not None and number > upper:
        raise ValueError(f"{name}: must be <= {upper:g}, got {value!r}")
    return number


@dataclass(frozen=True)
class WorkerBehaviour:
    """How a reference worker behaves. Immutable, so safe to share between threads.

    Attributes:
        latency_ms: time every task endpoint takes before answering.
        model_latency_ms: per model id, the time a task for that model takes instead
            of ``latency_ms`` (None: every model takes ``latency_ms``): a worker fast
            for one model and slow for another. Jitter applies as to ``latency_ms``.
        jitter_ms: uniform +/- spread around ``latency_ms`` (the delay never goes below 0).
        failure_rate: probability in [0, 1] that an inference answers
            ``500 {"detail": "simulated failure"}`` after the latency.
        health_status: the ``status`` in ``/health``; anything but ``"healthy"`` answers 503.
        fail_all: every inference answers 500 while ``/health`` still reports the
            configured status (a worker that lies about its health).
        hang: task endpoints and ``/health`` read requests but answer only once hang is
            turned off; on shutdown their connections are dropped unanswered.
        draining: reported in ``/health`` as a load hint; requests are still served.
        status_code: when set (400..599), every inference answers it at once with
            ``{"detail": "forced"}``.
        retry_after: seconds sent as ``Retry-After`` with a forced 429 or 503.
        npu_available: reported in ``/health`` and ``/models``; when off, the worker
            has "fallen back to CPU" and names :data:`CPU_DEVICE` as its device.
        load_delay_ms: time loading a model takes (``/models/load``,
            ``/model/optimize``, or a first use under ``"*"``).
        max_models: the most models loaded at once (None: no limit); a load beyond it
            answers ``507 {"detail": "..."}`` and loads nothing (the pool unloads one
            first). Reported as ``max_models`` in ``GET /models``.
        load_status: when set (400..599), every load request answers it at once with
            ``{"detail": "forced"}`` and loads nothing.
        echo_header: the name of a request header this worker quotes, value and all,
            in every error it answers (``detail``, a failed task's ``error``, an
            unhealthy ``/health``'s ``status``): a careless worker that leaks the
            credentials it was sent back into its error texts.
    """

    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    failure_rate: float = 0.0
    health_status: str = "healthy"
    fail_all: bool = False
    hang: bool = False
    draining: bool = False
    status_code: int | None = None
    retry_after: float | None = None
    npu_available: bool = True
    load_delay_ms: float = 0.0
    echo_header: str | None = None
    max_models: int | None = None
    load_status: int | None = None
    model_latency_ms: dict[str, float] | None = None

    def __post_init__(self) -> None:
        if self.model_latency_ms is not None:
            if not isinstance(self.model_latency_ms, dict):
                raise ValueError(
                    "model_latency_ms: must be null or a map of model id to milliseconds, "
                    f"got {self.model_latency_ms!r}"
                )
            checked = {}
            for model, ms in self.model_latency_ms.items():
                if not isinstance(model, str) or not model:
                    raise ValueError(f"model_latency_ms: model ids must be text, got {model!r}")
                checked[model] = check_number(f"model_latency_ms.{model}", ms)
            # A copy: the caller's dict may change later; this behaviour may not.
            object.__setattr__(self, "model_latency_ms", checked)
        if self.max_models is not None and (
            isinstance(self.max_models, bool)
            or not isinstance(self.max_models, int)
            or self.max_models < 1
        ):
            raise ValueError(f"max_models: must be null or >= 1, got {self.max_models!r}")
        if self.load_status is not None and (
            isinstance(self.load_status, bool)
            or not isinstance(self.load_status, int)
            or self.load_status not in FORCEABLE_STATUS
        ):
            raise ValueError(f"load_status: must be null or 400..599, got {self.load_status!r}")
        check_number("latency_ms", self.latency_ms)
        check_number("load_delay_ms", self.load_delay_ms)
        check_number("jitter_ms", self.jitter_ms)
        check_number("failure_rate", self.failure_rate, upper=1.0)
        if not isinstance(self.health_status, str) or not self.health_status:
            raise ValueError(
                f"health_status: must be a non-empty string, got {self.health_status!r}"
            )
        for name in ("fail_all", "hang", "draining", "npu_available"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        if self.status_code is not None and (
            isinstance(self.status_code, bool)
            or not isinstance(self.status_code, int)
            or self.status_code not in FORCEABLE_STATUS
        ):
            raise ValueError(f"status_code: must be null or 400..599, got {self.status_code!r}")
        if self.retry_after is not None:
            check_number("retry_after", self.retry_after)
        if self.echo_header is not None and (
            not isinstance(self.echo_header, str) or not self.echo_header.strip()
        ):
            raise ValueError(
                f"echo_header: must be null or a header name, got {self.echo_header!r}"
            )

    def latency_for(self, model: str | None) -> float:
        """The milliseconds a task for ``model`` takes (before jitter)."""
        per_model = self.model_latency_ms
        if per_model is None or model is None:
            return self.latency_ms
        return per_model.get(model, self.latency_ms)

    @property
    def device(self) -> str:
        """The device answers name: the NPU, or the CPU it fell back to."""
        return DEVICE if self.npu_available else CPU_DEVICE

    def to_dict(self) -> dict[str, Any]:
        """The settings as a JSON-serialisable dict."""
        return asdict(self)


BEHAVIOUR_FIELDS = frozenset(f.name for f in fields(WorkerBehaviour))
