"""Worker protocols: how one kind of worker is asked for work and how its answers read.

A worker protocol is one small immutable object per kind of worker. It maps the task's
canonical payload (AutoBot's Linux shape, ``{"model_id", "input_text", ...}``) to what
the worker takes, classifies the worker's answers into a :class:`~npu_sync._retry.Outcome`,
and reads its health and model-list answers. Two are built in:

* ``autobot-linux`` (the default): AutoBot's Linux NPU worker (port 8081, TLS 8444).
  Tasks go as they are; a model that is not loaded answers
  ``500 {"detail": "Model X not loaded"}``; ``GET /models`` lists the loaded models.
* ``autobot-windows``: AutoBot's Windows NPU worker (port 8082). Tasks go as
  ``{"task_type", "model_name", "input_data", ...}``; a failed task answers **HTTP 200**
  ``{"status": "failed", "error": ...}``; ``GET /health`` lists the loaded models; a
  model is loaded with ``POST /model/optimize?model_name=X``.

Who calls what (see docs/protocol.md): selection reads :meth:`WorkerProtocol.task_model`;
each attempt sends :meth:`~WorkerProtocol.request_body` and reads the answer with
:meth:`~WorkerProtocol.classify`; the health round reads :meth:`~WorkerProtocol.parse_health`
and, when :attr:`~WorkerProtocol.models_path` is set, :meth:`~WorkerProtocol.parse_models`;
placement sends :meth:`~WorkerProtocol.load_request`.

Nothing here does I/O or raises on a worker's answer: whatever a worker sends, the
parsers return a value (``None`` or an unhealthy verdict for garbage).
"""

from __future__ import annotations

import re
import reprlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple
from urllib.parse import quote

from npu_sync._retry import MAX_MODEL_ID as _MAX_MODEL_ID
from npu_sync._retry import Kind, Outcome, classify_response, not_loaded_model
from npu_sync.errors import printable
from npu_sync.transport import Response

__all__ = [
    "DEFAULT_PROTOCOL",
    "LINUX",
    "MAX_MODELS",
    "MAX_MODEL_ID",
    "WINDOWS",
    "HealthInfo",
    "LinuxProtocol",
    "LoadRequest",
    "ModelsInfo",
    "WindowsProtocol",
    "WorkerProtocol",
    "for_platform",
    "get_protocol",
    "protocol_names",
    "register_protocol",
]

MAX_MODELS = 1000
"""A model list longer than this is not believed: the worker's models count as unknown."""

MAX_MODEL_ID = _MAX_MODEL_ID
"""Model ids longer than this (or not printable) are left out of a worker's model list."""

# A max_models a worker reports above this (or below 1) is not believed: the
# configuration's own max_models may not exceed it either.
_MAX_CAP = 10_000

_MAX_DEVICE = 100
_WINDOWS_FAILED = frozenset({"failed", "error"})
_NO_DEVICES: Mapping[str, str] = MappingProxyType({})
_NO_COUNTS: Mapping[str, int] = MappingProxyType({})
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 200


@dataclass(frozen=True, slots=True)
class HealthInfo:
    """What a worker's health answer says. Immutable.

    Attributes:
        healthy: the body says ``status: "healthy"``. The HTTP status is the caller's
            to check as well (only a 200 is healthy).
        models: the models the answer lists as loaded, or ``None`` when it lists none
            (AutoBot's Linux worker gives only a count there: ask ``models_path``).
        npu_available: ``False`` when the worker fell back to CPU; ``None`` if not said.
        device: the device the worker reports (``optimal_device`` or ``device``),
            escaped for display.
        draining, max_concurrent, active_tasks: the load hints, when present and valid.
        max_models: the most models the worker says it may hold at once, when it says.
    """

    healthy: bool
    models: frozenset[str] | None = None
    npu_available: bool | None = None
    device: str | None = None
    draining: bool | None = None
    max_concurrent: int | None = None
    active_tasks: int | None = None
    max_models: int | None = None


_UNHEALTHY = HealthInfo(False)


@dataclass(frozen=True, slots=True)
class ModelsInfo:
    """A worker's model list (AutoBot's ``GET /models``). Immutable.

    Attributes:
        models: ids of the loaded models.
        devices: the device each model runs on, where the answer says (escaped).
        npu_available: ``False`` when the worker fell back to CPU; ``None`` if not said.
        optimal_device: the device the worker prefers (escaped), if said.
        max_models: the most models the worker says it may hold at once (``max_models``,
            1..10000), if said. AutoBot's worker says nothing of it; the
            reference worker does when started with ``--max-models``.
        inferences: per model, the inferences the worker ran with it since it loaded
            it (``inference_count`` in AutoBot's map), where the answer says.
    """

    models: frozenset[str]
    devices: Mapping[str, str] = field(default_factory=lambda: _NO_DEVICES, hash=False)
    npu_available: bool | None = None
    optimal_device: str | None = None
    max_models: int | None = None
    inferences: Mapping[str, int] = field(default_factory=lambda: _NO_COUNTS, hash=False)


class LoadRequest(NamedTuple):
    """The request that asks a worker to load a model: ``body`` is JSON, or no body."""

    method: str
    path: str
    body: Any


class WorkerProtocol:
    """How npu_sync talks to one kind of worker. Immutable and stateless: thread-safe.

    This base class is AutoBot's Linux worker protocol; a protocol for another kind of
    worker subclasses it, overrides what differs, and is registered with
    :func:`register_protocol`.
    """

    __slots__ = ()

    name: str = "autobot-linux"
    """The name a configuration selects it by (``protocol:``)."""

    models_path: str | None = "/models"
    """Where ``GET`` lists the loaded models (see :meth:`parse_models`); ``None`` when
    the health answer lists them instead."""

    loads_on_demand: bool = False
    """The worker loads a model the first time a task names it: the pool counts it as
    able to serve any model but those it answered "not loaded" for."""

    task_faults: tuple[re.Pattern[str], ...] = ()
    """Error texts of failed-task answers that are the task's fault whatever worker
    runs it (a task type the worker does not know): such an answer is ``REJECTED``,
    not suspect, so the task ends at once in ``TaskRejected`` and nobody is charged.
    Failures no pattern matches are suspect: a second worker's answer decides."""

    # Whether the class keeps this base class's request_body (the payload sent as
    # it is): the pool then skips calling it on every attempt. Set for each subclass
    # as it is defined.
    plain_requests: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.plain_requests = cls.request_body is WorkerProtocol.request_body

    def task_model(self, payload: Any) -> str | None:
        """The model a task names, or ``None`` (no model, or not a dict payload)."""
        if type(payload) is dict:
            model = payload.get("model_id")
            if type(model) is str:
                return model
        return None

    def request_body(self, payload: Any) -> Any:
        """The JSON value to send for a task with this canonical payload.

        Returns the payload itself (the same object) when nothing needs mapping, so a
        caller can reuse an encoding it already has.
        """
        return payload

    def classify(self, response: Response, *, now: float | None = None) -> Outcome:
        """Classify a worker's HTTP answer to a task.

        Args:
            response: the answer.
            now: wall-clock seconds, to read a ``Retry-After`` date.
        """
        return classify_response(response, now=now)

    def not_loaded_model(self, outcome: Outcome) -> str | None:
        """The model a "not loaded" answer named: the worker does not hold it."""
        return outcome.model if outcome.kind is Kind.NOT_HERE else None

    def parse_health(self, body: Any) -> HealthInfo:
        """Read a decoded health answer. Never raises: garbage is unhealthy."""
        if type(body) is not dict:
            return _UNHEALTHY
        try:
            return HealthInfo(
                healthy=body.get("status") == "healthy",
                models=_model_ids(body.get("loaded_models")),
                npu_available=_bool(body.get("npu_available")),
                device=_device(body.get("optimal_device"), body.get("device")),
                draining=_bool(body.get("draining")),
                max_concurrent=_int(body.get("max_concurrent"), allow_zero=False),
                active_tasks=_int(body.get("active_tasks"), allow_zero=True),
                max_models=_cap(body.get("max_models")),
            )
        except Exception:  # an answer no rule foresaw: unhealthy, nothing worse
            return _UNHEALTHY

    def parse_models(self, body: Any) -> ModelsInfo | None:
        """Read a decoded model-list answer; ``None`` when it is not one (never raises).

        ``loaded_models`` may map ids to ``{"device", "inference_count", ...}``
        (AutoBot) or list ids. A list longer than :data:`MAX_MODELS` gives ``None``:
        better to know nothing than to route by a list cut short. A ``max_models``
        beside it is the worker's cap on loaded models.
        """
        if type(body) is not dict:
            return None
        try:
            loaded = body.get("loaded_models")
            models = _model_ids(loaded)
            if models is None:
                return None
            devices: Mapping[str, str] = _NO_DEVICES
            inferences: Mapping[str, int] = _NO_COUNTS
            if type(loaded) is dict:
                found = {}
                counts = {}
                for model in models:
                    info = loaded[model]
                    if type(info) is dict:
                        device = _device(info.get("device"))
                        if device is not None:
                            found[model] = device
                        count = _int(info.get("inference_count"), allow_zero=True)
                        if count is not None:
                            counts[model] = count
                devices = MappingProxyType(found)
                inferences = MappingProxyType(counts) if counts else _NO_COUNTS
            return ModelsInfo(
                models,
                devices,
                _bool(body.get("npu_available")),
                _device(body.get("optimal_device")),
                _cap(body.get("max_models")),
                inferences,
            )
        except Exception:
            return None

    def load_request(self, model_id: str) -> LoadRequest:
        """The request that asks the worker to load ``model_id``."""
        return LoadRequest("POST", "/models/load", {"model_id": model_id, "model_config": {}})

    def __repr__(self) -> str:
        return f"<worker protocol {self.name}>"


class LinuxProtocol(WorkerProtocol):
    """AutoBot's Linux NPU worker (FastAPI, port 8081; TLS 8444). Thread-safe."""

    __slots__ = ()


# Fields the Windows worker reads at the top level of a task, next to input_data.
_WINDOWS_TOP = frozenset({"priority", "timeout_seconds", "optimization_level"})
_WINDOWS_MOVED = frozenset({"model_id", "model_name", "input_text", "task_type"}) | _WINDOWS_TOP


class WindowsProtocol(WorkerProtocol):
    """AutoBot's Windows NPU worker (port 8082). Thread-safe.

    A canonical task ``{"model_id", "input_text", ...rest}`` is sent as
    ``{"task_type", "model_name", "input_data": {"text": input_text, ...rest}}`` with
    ``priority``, ``timeout_seconds`` and ``optimization_level`` kept at the top level;
    ``task_type`` defaults to ``"embedding_generation"``. A payload that already has
    ``input_data`` is sent unchanged.
    """

    __slots__ = ()

    name = "autobot-windows"
    models_path = None
    loads_on_demand = True
    # AutoBot's worker raises ValueError(f"Unsupported task type: {task_type}") for a
    # task_type it does not handle, and answers it as a failed task.
    task_faults = (re.compile(r"^Unsupported task type\b", re.IGNORECASE),)

    def task_model(self, payload: Any) -> str | None:
        if type(payload) is dict:
            model = payload.get("model_name")
            if type(model) is str:
                return model
            model = payload.get("model_id")
            if type(model) is str:
                return model
        return None

    def request_body(self, payload: Any) -> Any:
        if type(payload) is not dict or "input_data" in payload:
            return payload
        get = payload.get
        body: dict[str, Any] = {"task_type": get("task_type", "embedding_generation")}
        model = get("model_name", get("model_id"))
        if model is not None:
            body["model_name"] = model
        input_data: dict[str, Any] = {}
        if "input_text" in payload:
            input_data["text"] = payload["input_text"]
        for key, value in payload.items():
            if key in _WINDOWS_MOVED:
                if key in _WINDOWS_TOP:
                    body[key] = value
            else:
                input_data[key] = value
        body["input_data"] = input_data
        return body

    def classify(self, response: Response, *, now: float | None = None) -> Outcome:
        outcome = classify_response(response, now=now)
        if outcome.kind is not Kind.SUCCESS:
            return outcome
        body = outcome.value
        if type(body) is not dict:
            return outcome
        status = body.get("status")
        # AutoBot writes "failed"; "error" and other casings say the same thing.
        if type(status) is not str or status.strip().lower() not in _WINDOWS_FAILED:
            return outcome
        error = body.get("error")
        if isinstance(error, str):
            named = not_loaded_model(error)
            if named is not None:
                return Outcome(
                    Kind.NOT_HERE, body, response.status, named[0], model=named[1], processed=False
                )
        # The worker's own words, escaped where they enter npu_sync.
        described = _describe_error(error)
        text = f"HTTP {response.status}, status {printable(status[:40])}" + (
            f": {described}" if described else ""
        )
        if isinstance(error, str) and any(p.match(error) for p in self.task_faults):
            return Outcome(Kind.REJECTED, body, response.status, text, processed=False)
        # Any other failed task may be the task's doing (bad input) as much as the
        # worker's: suspect, a second worker decides (npu_sync._blame).
        return Outcome(Kind.FAILURE, body, response.status, text, suspect=True)

    def load_request(self, model_id: str) -> LoadRequest:
        return LoadRequest("POST", "/model/optimize?model_name=" + quote(model_id, safe=""), None)


LINUX: WorkerProtocol = LinuxProtocol()
WINDOWS: WorkerProtocol = WindowsProtocol()

DEFAULT_PROTOCOL = LINUX.name
"""The protocol of a worker whose configuration names none."""

_PLATFORMS: Mapping[str, str] = MappingProxyType({"linux": LINUX.name, "windows": WINDOWS.name})
_registry_lock = threading.Lock()
# Replaced whole on registration, so lookups read it without the lock.
_registry: Mapping[str, WorkerProtocol] = MappingProxyType(
    {LINUX.name: LINUX, WINDOWS.name: WINDOWS}
)


def get_protocol(name: str) -> WorkerProtocol:
    """The protocol registered as ``name``.

    Raises:
        ValueError: no protocol has that name; the message lists the known ones.
    """
    protocol = _registry.get(name)
    if protocol is None:
        known = ", ".join(sorted(_registry))
        raise ValueError(f"unknown worker protocol {printable(repr(name)[:80])}; known: {known}")
    return protocol


def for_platform(platform: str | None) -> WorkerProtocol:
    """The protocol for an AutoBot ``platform`` (``linux``/``windows``, any case);
    ``None`` gives the default.

    Raises:
        ValueError: an unknown platform; the message lists the known ones.
    """
    if platform is None:
        return _registry[DEFAULT_PROTOCOL]
    name = _PLATFORMS.get(platform.lower()) if isinstance(platform, str) else None
    if name is None:
        known = ", ".join(_PLATFORMS)
        raise ValueError(
            f"unknown worker platform {printable(repr(platform)[:80])}; known: {known}"
        )
    return _registry[name]


def protocol_names() -> tuple[str, ...]:
    """The names of every registered protocol, sorted."""
    return tuple(sorted(_registry))


def register_protocol(protocol: WorkerProtocol, *, replace: bool = False) -> None:
    """Make ``protocol`` selectable by its ``name``. Thread-safe.

    Raises:
        ValueError: the name is taken and ``replace`` is false, or it is not a
            non-empty string.
    """
    global _registry
    name = protocol.name
    if not isinstance(name, str) or not name:
        raise ValueError(f"a worker protocol needs a non-empty name, got {name!r}")
    with _registry_lock:
        if name in _registry and not replace:
            raise ValueError(f"worker protocol {name!r} is already registered")
        _registry = MappingProxyType({**_registry, name: protocol})


def _model_ids(value: object) -> frozenset[str] | None:
    """The model ids a ``loaded_models`` list or map names; None when it is neither
    (a count, say), too long to believe, or names models in no form npu_sync reads.

    Entries that are not usable ids (numbers, unprintable strings) are left out; but a
    non-empty list with no usable id at all (``[{"id": "m"}]``) is unknown, not empty:
    read as "holds nothing" it would reject every task that names a model. Unknown, the
    worker is tried for any model and its "not loaded" answers teach the pool what it
    lacks.
    """
    if not isinstance(value, (dict, list)) or len(value) > MAX_MODELS:
        return None
    models = frozenset(
        model
        for model in value
        if type(model) is str and 0 < len(model) <= MAX_MODEL_ID and model.isprintable()
    )
    return None if value and not models else models


def _device(*values: object) -> str | None:
    for value in values:
        if type(value) is str and value:
            return printable(value[:_MAX_DEVICE])
    return None


def _bool(value: object) -> bool | None:
    return value if type(value) is bool else None


def _int(value: object, *, allow_zero: bool) -> int | None:
    if type(value) is not int:
        return None
    return value if value > 0 or (allow_zero and value == 0) else None


def _cap(value: object) -> int | None:
    found = _int(value, allow_zero=False)
    return found if found is not None and found <= _MAX_CAP else None


def _describe_error(error: object) -> str:
    if error is None:
        return ""
    if isinstance(error, str):
        return printable(error[:300])
    try:
        # Bounded however large or deep the worker's value is.
        text = _REPR.repr(error)
    except Exception:  # an int beyond the digit limit, say
        text = type(error).__name__
    return printable(text[:300])
