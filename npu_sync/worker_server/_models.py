"""The simulated NPU: its devices, the protocols it speaks, model ids and loaded
models, and what an inference answers."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

DEVICE = "NPU (simulated)"
"""The ``device`` the reference worker's answers name while its NPU is available."""

CPU_DEVICE = "CPU (simulated)"
"""The ``device`` named instead once ``npu_available`` is turned off (CPU fallback)."""

PROTOCOLS = ("linux", "windows")
"""The worker protocols the reference worker speaks: AutoBot's Linux and Windows workers."""

ANY_MODEL = "*"
"""In ``models``, serves every model id, loading it on first use (as AutoBot's Windows
worker does)."""

MAX_MODEL_ID = 200
WINDOWS_TASK_TYPES = frozenset({"embedding_generation"})
# Task types AutoBot's Windows worker routes but cannot run, with the error it answers:
# its semantic_search calls a method the worker does not have, so every such task
# fails the same way on every Windows worker.
WINDOWS_BROKEN_TASK_TYPES = {
    "semantic_search": "'WindowsNPUWorker' object has no attribute 'process_search_task'"
}
_EMBEDDING_DIM = 8


class ModelCapacity(Exception):
    """A load asked of a worker that has ``max_models`` loaded already."""


def check_models(value: object) -> tuple[str, ...]:
    """Validated model ids (``"*"`` allowed); raises ValueError naming ``models``."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"models: must be a list of model ids, got {value!r:.100}")
    for model in value:
        if not valid_model_id(model) and model != ANY_MODEL:
            raise ValueError(
                f"models: each must be a printable string of 1..{MAX_MODEL_ID} "
                f"characters, got {model!r:.100}"
            )
    return tuple(dict.fromkeys(value))


def valid_model_id(model: object) -> bool:
    return (
        isinstance(model, str)
        and 0 < len(model) <= MAX_MODEL_ID
        and model.isprintable()
        and model != ANY_MODEL
    )


@dataclass
class LoadedModel:
    """One loaded model. Changed only under the worker state's lock."""

    device: str
    loaded_at: str
    inference_count: int = 0


def available_devices(npu_available: bool) -> list[str]:
    """The devices a worker lists: the NPU while it is available, and the CPU."""
    return [DEVICE, CPU_DEVICE] if npu_available else [CPU_DEVICE]


def embedding(model: str, text: str) -> list[float]:
    """A small deterministic stand-in for an embedding of ``text`` by ``model``."""
    digest = hashlib.sha256(f"{model}\0{text}".encode("utf-8", "surrogatepass")).digest()
    return [round(byte / 127.5 - 1.0, 4) for byte in digest[:_EMBEDDING_DIM]]


def response_text(model_id: str, input_text: str) -> str:
    digest = hashlib.sha256(input_text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    words = len(input_text.split())
    return f"[{model_id}] {words} word(s), digest {digest}: {input_text[:80]}"
