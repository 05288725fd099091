"""One worker's state: behaviour, loaded models, counters, shared by its handler
threads."""

from __future__ import annotations

import collections
import contextlib
import datetime
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from npu_sync._clock import Clock
from npu_sync.worker_server._behaviour import BEHAVIOUR_FIELDS, WorkerBehaviour
from npu_sync.worker_server._models import (
    ANY_MODEL,
    LoadedModel,
    ModelCapacity,
    available_devices,
    check_models,
    valid_model_id,
)

_log = logging.getLogger("npu_sync.worker_server")  # one logger for the whole worker

_SEEN_TASK_IDS_LIMIT = 1_000_000
"""Task ids remembered for duplicate detection; the oldest are forgotten first."""
_TRACEPARENTS_LIMIT = 1_000
"""Trace contexts of task requests remembered for ``/stats``, the latest first kept."""

# update() and /_control so that a test can load or unload models at run time.
_MODELS_SETTING = "models"


class WorkerState:
    """Behaviour, counters and randomness of one worker, shared by its handler threads.

    Thread-safe: counters change under one condition variable, which also wakes
    hung handlers and ``wait_until`` callers. The behaviour is an immutable snapshot
    replaced whole, so handlers read it without the lock.
    """

    def __init__(
        self,
        *,
        worker_id: str,
        models: Sequence[str],
        max_concurrent: int,
        behaviour: WorkerBehaviour,
        seed: int | None,
        clock: Clock,
        protocol: str = "linux",
        slots: int | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.protocol = protocol
        self.max_concurrent = max_concurrent
        # Tasks inferred at once; the others queue (an NPU with so many parallel slots).
        self._slots = None if slots is None else threading.BoundedSemaphore(slots)
        self.clock = clock
        self.behaviour = behaviour
        self.closing = threading.Event()
        self._cond = threading.Condition(threading.Lock())
        self._rng = random.Random(seed)
        self.any_model = False
        self._loaded: dict[str, LoadedModel] = {}
        self._set_models_locked(check_models(list(models)))
        self._loads = 0
        self._failed_tasks = 0
        self._requests: dict[str, int] = {}
        self._responses: dict[int, int] = {}
        self._seen: dict[str, None] = {}
        self._task_ids_seen = 0
        # The trace contexts task requests came with, the latest _TRACEPARENTS_LIMIT.
        self._traceparents: collections.deque[dict[str, str | None]] = collections.deque(
            maxlen=_TRACEPARENTS_LIMIT
        )
        self._duplicates = 0
        self._in_flight = 0
        self._max_in_flight = 0
        self._inference_count = 0
        self._connections = 0

    def update(self, changes: Mapping[str, Any]) -> WorkerBehaviour:
        unknown = sorted(set(changes) - BEHAVIOUR_FIELDS - {_MODELS_SETTING})
        if unknown:
            raise ValueError(f"unknown setting(s): {', '.join(unknown)}")
        settings = dict(changes)
        models = None
        if _MODELS_SETTING in settings:
            models = check_models(settings.pop(_MODELS_SETTING))
        with self._cond:
            # Validated in full before anything changes: a bad value changes nothing.
            new = replace(self.behaviour, **settings)
            self.behaviour = new
            if models is not None:
                self._set_models_locked(models)
            self._cond.notify_all()
        _log.info("worker %s behaviour now %s", self.worker_id, new)
        if models is not None:
            _log.info("worker %s models now %s", self.worker_id, ", ".join(models) or "none")
        return new

    def _set_models_locked(self, models: Sequence[str]) -> None:
        """Load exactly ``models`` at once; models kept keep their counters."""
        device = self.behaviour.device
        loaded_at = self._now_iso()
        self.any_model = ANY_MODEL in models
        self._loaded = {
            model: self._loaded.get(model) or LoadedModel(device, loaded_at)
            for model in models
            if model != ANY_MODEL
        }

    def _now_iso(self) -> str:
        return datetime.datetime.fromtimestamp(self.clock.time(), datetime.timezone.utc).isoformat()

    def models(self) -> list[str]:
        """The loaded model ids, then ``"*"`` when any model is served."""
        with self._cond:
            return [*self._loaded, *([ANY_MODEL] if self.any_model else [])]

    def model_status(self) -> dict[str, Any]:
        """AutoBot's ``GET /models`` answer."""
        behaviour = self.behaviour
        with self._cond:
            loaded = {
                model: {
                    "device": info.device,
                    "inference_count": info.inference_count,
                    "loaded_at": info.loaded_at,
                }
                for model, info in self._loaded.items()
            }
        status: dict[str, Any] = {
            "npu_available": behaviour.npu_available,
            "optimal_device": behaviour.device,
            "loaded_models": loaded,
            "available_devices": available_devices(behaviour.npu_available),
        }
        if behaviour.max_models is not None:  # not AutoBot's: only when set
            status["max_models"] = behaviour.max_models
        return status

    def load(self, model: str) -> bool:
        """Load ``model``, taking the configured load delay; False when the server
        closes meanwhile. Loading a loaded model is instant.

        Raises:
            ModelCapacity: ``max_models`` are loaded already (checked before and after
                the delay).
        """
        with self._cond:
            if model in self._loaded:
                return True
            self._check_room_locked()
        delay = self.behaviour.load_delay_ms / 1000.0
        if delay > 0 and self.clock.wait(self.closing, delay):
            return False
        if self.closing.is_set():
            return False
        with self._cond:
            if model not in self._loaded:
                self._check_room_locked()
                self._loaded[model] = LoadedModel(self.behaviour.device, self._now_iso())
                self._loads += 1
            self._cond.notify_all()
        _log.info("worker %s loaded model %s", self.worker_id, model)
        return True

    def _check_room_locked(self) -> None:
        cap = self.behaviour.max_models
        if cap is not None and len(self._loaded) >= cap:
            raise ModelCapacity(
                f"model capacity reached: {len(self._loaded)} of {cap} loaded "
                f"({', '.join(sorted(self._loaded))}); unload one first"
            )

    def unload(self, model: str) -> bool:
        """Unload ``model``; False when it was not loaded."""
        with self._cond:
            found = self._loaded.pop(model, None) is not None
            self._cond.notify_all()
        return found

    def ensure_loaded(self, model: str) -> bool | None:
        """Whether ``model`` can serve now, loading it first under ``"*"``; None when
        the server closed during the load."""
        if not valid_model_id(model):
            return False
        with self._cond:
            if model in self._loaded:
                return True
            if not self.any_model:
                return False
        try:
            return True if self.load(model) else None
        except ModelCapacity:
            return False  # answered as a model that is not loaded

    def release(self) -> None:
        """Wake every hung handler and latency wait for shutdown."""
        with self._cond:
            self.closing.set()
            self._cond.notify_all()

    def wait_while_hung(self) -> bool:
        """Block while hang is on; return False when the server is closing instead."""
        with self._cond:
            while self.behaviour.hang and not self.closing.is_set():
                self._cond.wait()
            return not self.closing.is_set()

    def simulate_latency(self, model: str | None = None) -> bool:
        """Wait the configured latency (for ``model``, when the task names one); return
        False when the server closes meanwhile."""
        behaviour = self.behaviour
        delay_ms = behaviour.latency_for(model)
        if behaviour.jitter_ms:
            with self._cond:
                delay_ms += self._rng.uniform(-behaviour.jitter_ms, behaviour.jitter_ms)
        delay = max(0.0, delay_ms) / 1000.0
        slots = self._slots
        if slots is None:
            if delay == 0.0:
                return not self.closing.is_set()
            return not self.clock.wait(self.closing, delay)
        while not slots.acquire(timeout=0.1):  # queued behind the tasks in the slots
            if self.closing.is_set():
                return False
        try:
            if delay == 0.0:
                return not self.closing.is_set()
            return not self.clock.wait(self.closing, delay)
        finally:
            slots.release()

    def roll_failure(self, rate: float) -> bool:
        if rate <= 0.0:
            return False
        if rate >= 1.0:
            return True
        with self._cond:
            return self._rng.random() < rate

    def count_connection(self) -> None:
        with self._cond:
            self._connections += 1
            self._cond.notify_all()

    def count_request(self, path: str) -> None:
        with self._cond:
            self._requests[path] = self._requests.get(path, 0) + 1
            self._cond.notify_all()

    def count_response(self, status: int) -> None:
        with self._cond:
            self._responses[status] = self._responses.get(status, 0) + 1
            self._cond.notify_all()

    def count_inference(self, model: str) -> int:
        with self._cond:
            self._inference_count += 1
            info = self._loaded.get(model)
            if info is not None:  # unloaded meanwhile: the task still ran
                info.inference_count += 1
            self._cond.notify_all()
            return self._inference_count

    def count_failed_task(self) -> None:
        """A Windows-style ``200 {"status": "failed"}`` answer."""
        with self._cond:
            self._failed_tasks += 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def task(
        self, task_id: str | None, traceparent: str | None = None, attempt: str | None = None
    ) -> Iterator[None]:
        """Count one task request as in flight, and its task id as seen; remember the
        trace context it came with (W3C ``traceparent``), if any, as a traced worker
        would log it."""
        with self._cond:
            if traceparent is not None:
                self._traceparents.append(
                    {"task_id": task_id, "attempt": attempt, "traceparent": traceparent}
                )
            if task_id is not None:
                if task_id in self._seen:
                    self._duplicates += 1
                else:
                    self._task_ids_seen += 1
                    self._seen[task_id] = None
                    if len(self._seen) > _SEEN_TASK_IDS_LIMIT:
                        del self._seen[next(iter(self._seen))]
            self._in_flight += 1
            self._max_in_flight = max(self._max_in_flight, self._in_flight)
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    def _stats_locked(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "requests": dict(sorted(self._requests.items())),
            "responses": {str(code): n for code, n in sorted(self._responses.items())},
            "connections": self._connections,
            "task_ids_seen": self._task_ids_seen,
            "traceparents": list(self._traceparents),
            "duplicates": self._duplicates,
            "in_flight": self._in_flight,
            "max_in_flight": self._max_in_flight,
            "inference_count": self._inference_count,
            "failed_tasks": self._failed_tasks,
            "loads": self._loads,
            "protocol": self.protocol,
            "models": [*self._loaded, *([ANY_MODEL] if self.any_model else [])],
            "behaviour": self.behaviour.to_dict(),
        }

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return self._stats_locked()

    def wait_until(self, predicate: Callable[[dict[str, Any]], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self._stats_locked()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def health(self) -> dict[str, Any]:
        behaviour = self.behaviour
        models = self.models()
        loaded = [model for model in models if model != ANY_MODEL]
        common = {
            "status": behaviour.health_status,
            "worker_id": self.worker_id,
            "npu_available": behaviour.npu_available,
            "device": behaviour.device,
            "active_tasks": self._in_flight,
            "max_concurrent": self.max_concurrent,
            "draining": behaviour.draining,
            "inference_count": self._inference_count,
        }
        if self.protocol == "windows":
            # AutoBot's Windows worker lists its models here; it has no /models.
            return {**common, "platform": "windows", "loaded_models": loaded}
        # AutoBot's Linux worker gives a count here and the list at /models.
        return {
            **common,
            "loaded_models": len(loaded),
            "optimal_device": behaviour.device,
            "models": models,
        }
