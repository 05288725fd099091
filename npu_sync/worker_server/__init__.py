"""The reference NPU worker: a simulated inference server that speaks the worker protocols.

It runs in three ways:

* in-process, as :class:`WorkerServer` (unit tests);
* as a program, ``python -m npu_sync.worker_server`` or ``npu-sync worker``;
* as a child process driven from Python, :class:`LocalWorker` (integration tests,
  benchmarks and the demo), which can kill, freeze, slow or restart it.

It speaks either of AutoBot's worker protocols (see docs/protocol.md):

* ``linux`` (the default): ``POST /inference`` takes ``{"model_id", "input_text", ...}``;
  ``GET /models``, ``POST /models/load``, ``DELETE /models/{id}`` and ``GET /devices``
  manage models; a model that is not loaded answers ``500 {"detail": "Model X not
  loaded"}``.
* ``windows``: ``POST /inference`` takes ``{"task_type", "model_name", "input_data",
  ...}`` and answers HTTP 200 with ``"status": "completed"`` or ``"failed"``;
  ``GET /health`` lists the loaded models; ``POST /model/optimize?model_name=X`` loads one.

Both also serve ``POST /echo`` (a task endpoint), ``GET /health``, ``GET /stats`` and
``POST /_control``, which changes a running worker's behaviour (latency, failures, a
lying or hanging worker, forced status codes, loaded models, NPU or CPU). Requests may be
required to carry an AutoBot HMAC signature or a bearer token; ``/stats`` and
``/_control`` never are, being test hooks that a real deployment does not have.
Standard library only, and apart from the library: it imports nothing of npu_sync but
the HMAC verifier and the clock, and npu_sync imports it only from its command line
(``npu-sync``, whose ``worker`` command takes its flags from here and whose ``demo``
starts local workers), never from a pool.

Its modules, by concern: ``_models`` (the simulated NPU: devices, model ids, answers),
``_behaviour`` (:class:`WorkerBehaviour`), ``_state`` (one worker's models and
counters), ``_payloads`` (reading task requests), ``_handler`` (HTTP: handler, routes,
listening server), ``_server`` (:class:`WorkerServer`), ``_cli`` (flags and
:func:`serve`), ``_local`` (:class:`LocalWorker`).
"""

from __future__ import annotations

from npu_sync.worker_server._behaviour import WorkerBehaviour
from npu_sync.worker_server._cli import build_arg_parser, main, serve
from npu_sync.worker_server._handler import MAX_BODY_BYTES
from npu_sync.worker_server._local import LocalWorker
from npu_sync.worker_server._models import ANY_MODEL, CPU_DEVICE, DEVICE, PROTOCOLS
from npu_sync.worker_server._server import WorkerServer

__all__ = [
    "ANY_MODEL",
    "CPU_DEVICE",
    "DEVICE",
    "MAX_BODY_BYTES",
    "PROTOCOLS",
    "LocalWorker",
    "WorkerBehaviour",
    "WorkerServer",
    "build_arg_parser",
    "main",
    "serve",
]
