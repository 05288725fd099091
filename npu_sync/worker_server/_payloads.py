"""Reading task requests: each protocol's body, validated into what the handler uses."""

from __future__ import annotations

import json
from typing import Any

from npu_sync.worker_server._models import MAX_MODEL_ID, valid_model_id


def parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        raise ValueError("request body is not valid JSON") from None


def parse_inference(body: bytes) -> tuple[str, str]:
    """Validate an inference request; return (model_id, input_text) or raise ValueError."""
    data = parse_json(body)
    if not isinstance(data, dict):
        raise ValueError("request body must be a JSON object")
    input_text = data.get("input_text")
    if not isinstance(input_text, str):
        raise ValueError("input_text: a string is required")
    model_id = data.get("model_id", "default")
    if not isinstance(model_id, str):
        raise ValueError("model_id: must be a string")
    max_tokens = data.get("max_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise ValueError("max_tokens: must be a positive integer")
    for name in ("temperature", "top_p"):
        value = data.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{name}: must be a number")
    return model_id, input_text


def checked_model_id(value: object, name: str) -> str:
    if not valid_model_id(value):
        raise ValueError(f"{name}: a printable string of 1..{MAX_MODEL_ID} characters is required")
    assert isinstance(value, str)
    return value


def parse_windows_task(body: bytes) -> tuple[str, str, dict[str, Any]]:
    """Validate a Windows-style task; return (task_type, model_name, input_data)."""
    data = parse_json(body)
    if not isinstance(data, dict):
        raise ValueError("request body must be a JSON object")
    task_type = data.get("task_type")
    if not isinstance(task_type, str):
        raise ValueError("task_type: a string is required")
    model = checked_model_id(data.get("model_name"), "model_name")
    input_data = data.get("input_data")
    if not isinstance(input_data, dict):
        raise ValueError("input_data: an object is required")
    for name in ("priority", "timeout_seconds"):
        value = data.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{name}: must be an integer")
    return task_type, model, input_data


def header_int(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        return None
