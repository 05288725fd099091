"""Tests of the worker protocols: AutoBot's Linux and Windows workers, and the registry."""

from __future__ import annotations

import json
import random
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from npu_sync import TaskFailed, WorkerPool, protocols
from npu_sync._retry import Kind, classify_response
from npu_sync.config import BreakerConfig
from npu_sync.protocols import (
    LINUX,
    MAX_MODEL_ID,
    MAX_MODELS,
    WINDOWS,
    HealthInfo,
    LoadRequest,
    ModelsInfo,
    WorkerProtocol,
    for_platform,
    get_protocol,
    protocol_names,
    register_protocol,
)
from npu_sync.testing import FakeNetwork, FakeRequest, json_response
from npu_sync.transport import Response
from tests.modelkit import config, w

TASK = {"model_id": "llama", "input_text": "hello", "max_tokens": 8, "temperature": 0.2}


# --- registry ---------------------------------------------------------------------------------


def test_both_autobot_protocols_are_registered_and_linux_is_the_default() -> None:
    """autobot-linux and autobot-windows are found by name; the default is Linux."""
    assert protocol_names() == ("autobot-linux", "autobot-windows")
    assert get_protocol("autobot-linux") is LINUX
    assert get_protocol("autobot-windows") is WINDOWS
    assert get_protocol(protocols.DEFAULT_PROTOCOL) is LINUX


def test_platform_selects_the_protocol() -> None:
    """platform linux/windows (any case) selects its protocol; none gives the default."""
    assert for_platform("linux") is LINUX
    assert for_platform("Windows") is WINDOWS
    assert for_platform(None) is LINUX


@pytest.mark.parametrize("call", [lambda: get_protocol("grpc"), lambda: for_platform("macos")])
def test_unknown_names_are_errors_listing_the_known_ones(call: Any) -> None:
    """An unknown protocol or platform raises ValueError naming the value and the choices."""
    with pytest.raises(ValueError, match=r"known: .*(autobot-linux|linux)") as info:
        call()
    assert "grpc" in str(info.value) or "macos" in str(info.value)


def test_a_custom_protocol_can_be_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A subclass registered by name is found; a taken name needs replace=True."""
    monkeypatch.setattr(protocols, "_registry", protocols._registry)

    class Echo(WorkerProtocol):
        __slots__ = ()
        name = "echo-v1"
        models_path = None

    echo = Echo()
    register_protocol(echo)
    assert get_protocol("echo-v1") is echo
    with pytest.raises(ValueError, match="already registered"):
        register_protocol(Echo())
    register_protocol(Echo(), replace=True)
    assert get_protocol("echo-v1") is not echo


def test_protocol_objects_are_immutable() -> None:
    """A protocol object has no state to change: setting an attribute fails."""
    for protocol in (LINUX, WINDOWS):
        with pytest.raises(AttributeError):
            protocol.models_path = "/x"  # type: ignore[misc]
    assert repr(WINDOWS) == "<worker protocol autobot-windows>"


# --- task_model and request_body --------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "linux", "windows"),
    [
        ({"model_id": "a", "input_text": "x"}, "a", "a"),
        ({"model_name": "b", "input_data": {}}, None, "b"),
        ({"model_name": "b", "model_id": "a"}, "a", "b"),
        ({"model_id": 5}, None, None),
        ({"input_text": "x"}, None, None),
        (["model_id", "a"], None, None),
        ("model_id", None, None),
        (None, None, None),
    ],
)
def test_task_model_reads_the_model_each_worker_kind_uses(
    payload: object, linux: str | None, windows: str | None
) -> None:
    """Linux reads model_id; Windows model_name, else model_id; anything else is None."""
    assert LINUX.task_model(payload) == linux
    assert WINDOWS.task_model(payload) == windows


def test_linux_sends_the_payload_itself() -> None:
    """The Linux protocol sends the canonical payload as it is: the same object."""
    assert LINUX.request_body(TASK) is TASK


def test_windows_maps_the_canonical_task_to_its_shape() -> None:
    """model_id/input_text become model_name/input_data.text, other fields go into
    input_data, the task type defaults to embedding_generation."""
    body = WINDOWS.request_body(TASK)
    assert body == {
        "task_type": "embedding_generation",
        "model_name": "llama",
        "input_data": {"text": "hello", "max_tokens": 8, "temperature": 0.2},
    }
    assert TASK == {"model_id": "llama", "input_text": "hello", "max_tokens": 8, "temperature": 0.2}


def test_windows_keeps_its_top_level_fields_and_a_given_task_type() -> None:
    """task_type, priority, timeout_seconds and optimization_level stay at the top level."""
    payload = {
        "model_id": "m",
        "input_text": "q",
        "task_type": "semantic_search",
        "priority": 3,
        "timeout_seconds": 10,
        "optimization_level": "speed",
        "top_k": 4,
    }
    assert WINDOWS.request_body(payload) == {
        "task_type": "semantic_search",
        "model_name": "m",
        "priority": 3,
        "timeout_seconds": 10,
        "optimization_level": "speed",
        "input_data": {"text": "q", "top_k": 4},
    }


@pytest.mark.parametrize(
    "payload",
    [
        {"task_type": "embedding_generation", "model_name": "m", "input_data": {"text": "x"}},
        [1, 2],
        "text",
        None,
    ],
)
def test_windows_passes_its_own_shape_and_non_dicts_unchanged(payload: object) -> None:
    """A payload that already has input_data, or is not a dict, is sent as it is."""
    assert WINDOWS.request_body(payload) is payload


def test_windows_mapping_without_model_or_text_leaves_them_out() -> None:
    """With no model and no input_text the mapped body names neither (the worker says 422)."""
    assert WINDOWS.request_body({"extra": 1}) == {
        "task_type": "embedding_generation",
        "input_data": {"extra": 1},
    }


# --- classify ---------------------------------------------------------------------------------


def raw(status: int, body: bytes, headers: dict[str, str] | None = None) -> Response:
    return Response(status, headers or {}, body)


LINUX_ANSWERS = [
    json_response(200, {"model_id": "m", "response": "r"}),
    json_response(422, {"detail": "input_text: required"}),
    json_response(500, {"detail": "Model phi not loaded"}),
    json_response(500, {"detail": "boom"}),
    json_response(503, {"detail": "busy"}, {"Retry-After": "3"}),
    raw(200, b"not json"),
    json_response(200, {"status": "failed", "error": "x"}),
]


@pytest.mark.parametrize("response", LINUX_ANSWERS)
def test_linux_classifies_as_the_worker_protocol_says(response: Response) -> None:
    """The Linux protocol's classification is classify_response's, answer for answer."""
    assert LINUX.classify(response, now=0.0) == classify_response(response, now=0.0)


def test_windows_200_failed_is_a_suspect_failure_with_the_workers_error() -> None:
    """HTTP 200 {"status": "failed"} is a FAILURE, suspect, carrying the error text."""
    body = {"task_id": "t", "status": "failed", "error": "out of device memory"}
    outcome = WINDOWS.classify(json_response(200, body))
    assert outcome.kind is Kind.FAILURE
    assert outcome.suspect is True and outcome.processed is True
    assert outcome.status == 200 and outcome.value == body
    assert outcome.error == "HTTP 200, status failed: out of device memory"
    assert outcome.retry_after is None


@pytest.mark.parametrize(
    "error", ["Unsupported task type: semantic_similarity", "unsupported task type: None"]
)
def test_windows_unsupported_task_type_is_the_tasks_fault(error: str) -> None:
    """The Windows protocol declares "Unsupported task type" a task fault: REJECTED, sure."""
    body = {"task_id": "t", "status": "failed", "error": error}
    outcome = WINDOWS.classify(json_response(200, body))
    assert outcome.kind is Kind.REJECTED and outcome.suspect is False
    assert outcome.processed is False and outcome.error == f"HTTP 200, status failed: {error}"


def test_only_the_windows_protocol_declares_task_faults() -> None:
    """Linux has no error-text task faults; Windows matches at the start of the text only."""
    assert LINUX.task_faults == ()
    body = {"status": "failed", "error": "model said: Unsupported task type"}
    assert WINDOWS.classify(json_response(200, body)).kind is Kind.FAILURE


@pytest.mark.parametrize("status", ["error", "FAILED", " Failed ", "ERROR"])
def test_windows_failed_in_other_words_or_casing_is_a_failure_too(status: str) -> None:
    """ "error" and other casings of "failed" are failures too, never a task's result."""
    outcome = WINDOWS.classify(json_response(200, {"status": status, "error": "boom"}))
    assert outcome.kind is Kind.FAILURE and outcome.suspect is True
    assert outcome.error is not None and outcome.error.endswith(": boom")


@pytest.mark.parametrize("status", ["completed", "queued", 3, None, ["failed"]])
def test_windows_other_statuses_are_the_tasks_result(status: object) -> None:
    """Any other status (or none of text type) reads as the worker's answer."""
    body = {"status": status, "result": {"x": 1}}
    outcome = WINDOWS.classify(json_response(200, body))
    assert outcome.kind is Kind.SUCCESS and outcome.value == body


def test_windows_failure_text_is_escaped_and_bounded() -> None:
    """Control characters in the worker's error are escaped; the text is cut to 300."""
    outcome = WINDOWS.classify(
        json_response(200, {"status": "failed", "error": "\x1b[2Jgone\n" + "y" * 1000})
    )
    assert outcome.error is not None
    assert "\x1b" not in outcome.error and "\\x1b[2Jgone\\n" in outcome.error
    assert len(outcome.error) < 400


@pytest.mark.parametrize(
    "error",
    [
        b"null",
        b'{"code": 7, "message": "bad"}',
        json.dumps(list(range(100_000))).encode(),
        b"9" * 4000,
        b"[" * 50 + b"]" * 50,
    ],
    ids=["null", "object", "huge-list", "huge-int", "deep"],
)
def test_windows_failure_with_an_odd_error_value_still_classifies(error: bytes) -> None:
    """A failed answer whose error is missing, an object or huge gives a short error."""
    outcome = WINDOWS.classify(raw(200, b'{"status": "failed", "error": ' + error + b"}"))
    assert outcome.kind is Kind.FAILURE and outcome.suspect
    assert outcome.error is not None and outcome.error.startswith("HTTP 200, status failed")
    assert len(outcome.error) < 400


def test_windows_completed_is_a_success_with_the_whole_body() -> None:
    """HTTP 200 {"status": "completed"} is a SUCCESS whose value is the decoded body."""
    body = {"task_id": "t", "status": "completed", "result": {"embedding": [0.1]}}
    outcome = WINDOWS.classify(json_response(200, body))
    assert outcome.kind is Kind.SUCCESS and outcome.value == body


def test_windows_not_loaded_failure_names_the_model() -> None:
    """A failed answer saying "Model X not loaded" is NOT_HERE naming X, like Linux's 500."""
    outcome = WINDOWS.classify(
        json_response(200, {"status": "failed", "error": "Model e5 not loaded"})
    )
    assert outcome.kind is Kind.NOT_HERE and outcome.model == "e5"
    assert outcome.processed is False
    assert WINDOWS.not_loaded_model(outcome) == "e5"
    assert LINUX.not_loaded_model(LINUX.classify(LINUX_ANSWERS[2])) == "phi"
    assert LINUX.not_loaded_model(LINUX.classify(LINUX_ANSWERS[3])) is None


@pytest.mark.parametrize("response", LINUX_ANSWERS[:-1])
def test_windows_classifies_other_answers_as_linux_does(response: Response) -> None:
    """Answers other than a 200 with a status are classified as by the Linux protocol."""
    assert WINDOWS.classify(response, now=0.0) == classify_response(response, now=0.0)


# --- parse_health -----------------------------------------------------------------------------


def test_linux_health_gives_no_model_list_but_device_and_npu() -> None:
    """AutoBot Linux health: a model count (so models None), npu_available, optimal_device."""
    info = LINUX.parse_health(
        {"status": "healthy", "npu_available": True, "loaded_models": 2, "optimal_device": "NPU"}
    )
    assert info == HealthInfo(healthy=True, models=None, npu_available=True, device="NPU")


def test_windows_health_lists_the_loaded_models() -> None:
    """AutoBot Windows health: loaded_models is a list, read as a frozenset."""
    info = WINDOWS.parse_health(
        {
            "status": "healthy",
            "platform": "windows",
            "npu_available": False,
            "loaded_models": ["nomic-embed-text", "bge-small"],
        }
    )
    assert info.healthy and info.npu_available is False
    assert info.models == frozenset({"nomic-embed-text", "bge-small"})


def test_health_load_hints_are_read_when_valid() -> None:
    """draining, max_concurrent and active_tasks are read; invalid values are None."""
    good = LINUX.parse_health(
        {"status": "healthy", "draining": True, "max_concurrent": 4, "active_tasks": 0}
    )
    assert (good.draining, good.max_concurrent, good.active_tasks) == (True, 4, 0)
    bad = LINUX.parse_health(
        {"status": "healthy", "draining": "yes", "max_concurrent": 0, "active_tasks": True}
    )
    assert (bad.draining, bad.max_concurrent, bad.active_tasks) == (None, None, None)


@pytest.mark.parametrize(
    "body",
    [None, [], "healthy", 1, {"status": "degraded"}, {"status": ["healthy"]}, {}],
)
def test_health_that_is_not_a_healthy_object_is_unhealthy(body: object) -> None:
    """A body that is not an object, or whose status is not "healthy", is unhealthy."""
    for protocol in (LINUX, WINDOWS):
        assert protocol.parse_health(body).healthy is False


def test_health_wrong_types_are_ignored_not_trusted() -> None:
    """npu_available, loaded_models and device of the wrong type read as unknown."""
    info = WINDOWS.parse_health(
        {
            "status": "healthy",
            "npu_available": "false",
            "loaded_models": "a,b",
            "optimal_device": 5,
            "device": ["NPU"],
        }
    )
    assert (info.npu_available, info.models, info.device) == (None, None, None)


def test_health_model_ids_that_are_not_usable_are_left_out() -> None:
    """Non-strings, empty, over-long and non-printable ids are dropped from the list."""
    info = WINDOWS.parse_health(
        {
            "status": "healthy",
            "loaded_models": ["ok", 3, None, "", "x" * (MAX_MODEL_ID + 1), "bad\x1b", {"a": 1}],
        }
    )
    assert info.models == frozenset({"ok"})


@pytest.mark.parametrize(
    "loaded",
    [[{"id": "m1"}, {"id": "m2"}], [1, 2], {"": {"device": "NPU"}}],
    ids=["objects", "numbers", "empty-name"],
)
def test_a_model_list_with_no_usable_id_is_unknown_not_empty(loaded: object) -> None:
    """A list naming its models in a form npu_sync does not read knows no models (None),
    rather than claiming the worker holds none; an empty list still means none."""
    assert LINUX.parse_health({"status": "healthy", "loaded_models": loaded}).models is None
    assert LINUX.parse_models({"loaded_models": loaded}) is None
    assert LINUX.parse_health({"status": "healthy", "loaded_models": []}).models == frozenset()


def test_health_with_a_huge_model_list_knows_no_models() -> None:
    """A model list over MAX_MODELS is not believed: models is None, the rest is read."""
    info = WINDOWS.parse_health(
        {"status": "healthy", "loaded_models": [f"m{i}" for i in range(MAX_MODELS + 1)]}
    )
    assert info.healthy and info.models is None


def test_health_device_is_escaped_and_bounded() -> None:
    """A device string with control characters is escaped and cut short for display."""
    info = LINUX.parse_health({"status": "healthy", "optimal_device": "\x1b[31mNPU" + "z" * 500})
    assert info.device is not None
    assert info.device.startswith("\\x1b[31mNPU") and len(info.device) < 150


# --- parse_models -----------------------------------------------------------------------------

AUTOBOT_MODELS = {
    "npu_available": True,
    "optimal_device": "NPU",
    "loaded_models": {
        "llama-3.2-1b": {"device": "NPU", "inference_count": 12, "loaded_at": "2025-01-01"},
        "phi-3": {"device": "CPU", "inference_count": 0, "loaded_at": "2025-01-02"},
        "odd": "not a dict",
    },
    "available_devices": ["CPU", "NPU"],
}


def test_models_reads_autobots_answer() -> None:
    """GET /models: the ids, the device and inference count of each, npu_available and
    optimal_device; AutoBot's answer reports no cap."""
    info = LINUX.parse_models(AUTOBOT_MODELS)
    assert info == ModelsInfo(
        frozenset({"llama-3.2-1b", "phi-3", "odd"}),
        {"llama-3.2-1b": "NPU", "phi-3": "CPU"},
        npu_available=True,
        optimal_device="NPU",
        inferences={"llama-3.2-1b": 12, "phi-3": 0},
    )
    assert info is not None and info.max_models is None
    assert LINUX.models_path == "/models" and WINDOWS.models_path is None


def test_models_accepts_a_plain_list_and_an_empty_map() -> None:
    """loaded_models as a list of ids, or an empty map (nothing loaded), is understood."""
    listed = LINUX.parse_models({"loaded_models": ["a", "b"]})
    assert listed is not None and listed.models == frozenset({"a", "b"})
    assert dict(listed.devices) == {}
    empty = LINUX.parse_models({"loaded_models": {}})
    assert empty is not None and empty.models == frozenset()


@pytest.mark.parametrize(
    ("value", "cap"),
    [(2, 2), (1, 1), (10_000, 10_000), (0, None), (-1, None), (10_001, None), (True, None),
     ("2", None), (2.0, None), (None, None)],
)  # fmt: skip
def test_models_and_health_read_the_cap_a_worker_reports(value: object, cap: int | None) -> None:
    """max_models beside the list (or in the health answer) is the worker's cap when it
    is a whole number from 1 to 10000; anything else says nothing."""
    info = LINUX.parse_models({"loaded_models": {}, "max_models": value})
    assert info is not None and info.max_models == cap
    assert LINUX.parse_health({"status": "healthy", "max_models": value}).max_models == cap


def test_models_inference_counts_of_the_wrong_type_are_left_out() -> None:
    """An inference count is a whole number >= 0; others, and those of a plain list of
    ids, are not read."""
    info = LINUX.parse_models(
        {
            "loaded_models": {
                "a": {"inference_count": 3},
                "b": {"inference_count": -1},
                "c": {"inference_count": True},
                "d": {"inference_count": "7"},
                "e": {"inference_count": 1.5},
            }
        }
    )
    assert info is not None and dict(info.inferences) == {"a": 3}
    listed = LINUX.parse_models({"loaded_models": ["a"]})
    assert listed is not None and dict(listed.inferences) == {}


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        "models",
        {},
        {"loaded_models": 3},
        {"loaded_models": "a"},
        {"loaded_models": None},
        {"loaded_models": {f"m{i}": {} for i in range(MAX_MODELS + 1)}},
    ],
)
def test_models_garbage_is_none(body: object) -> None:
    """Anything but an object with a sane loaded_models list or map gives None."""
    assert LINUX.parse_models(body) is None


def test_models_devices_are_escaped_and_the_wrong_types_ignored() -> None:
    """A device string is escaped; a non-string device, npu_available or optimal_device
    is left out."""
    info = LINUX.parse_models(
        {
            "npu_available": "yes",
            "optimal_device": {"name": "NPU"},
            "loaded_models": {"a": {"device": "N\x07PU"}, "b": {"device": 3}},
        }
    )
    assert info is not None
    assert dict(info.devices) == {"a": "N\\x07PU"}
    assert (info.npu_available, info.optimal_device) == (None, None)


def random_json(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["int", "str", "none", "bool", "float"]
    if depth < 4:
        kinds += ["list", "dict", "dict"]
    kind = rng.choice(kinds)
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == "dict":
        keys = ["status", "loaded_models", "npu_available", "device", "optimal_device",
                "error", "max_concurrent", "healthy", "x"]  # fmt: skip
        return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randrange(5))}
    return {
        "int": lambda: rng.randrange(-5, 10**6),
        "str": lambda: rng.choice(["healthy", "failed", "completed", "NPU", "\x00", ""]),
        "none": lambda: None,
        "bool": lambda: rng.random() < 0.5,
        "float": lambda: rng.random(),
    }[kind]()


def test_parsers_and_classify_never_raise_on_random_answers() -> None:
    """Random JSON values and bytes never make a parser or classify raise."""
    rng = random.Random(1234)
    for _ in range(3000):
        value = random_json(rng)
        for protocol in (LINUX, WINDOWS):
            assert isinstance(protocol.parse_health(value), HealthInfo)
            models = protocol.parse_models(value)
            assert models is None or isinstance(models, ModelsInfo)
            status = rng.choice([200, 201, 400, 404, 422, 429, 500, 503])
            body = json.dumps(value).encode() if rng.random() < 0.8 else rng.randbytes(20)
            assert protocol.classify(Response(status, {}, body)).kind in Kind


# --- load_request -----------------------------------------------------------------------------


def test_linux_loads_with_post_models_load() -> None:
    """Linux placement: POST /models/load {"model_id", "model_config": {}}."""
    assert LINUX.load_request("llama") == LoadRequest(
        "POST", "/models/load", {"model_id": "llama", "model_config": {}}
    )


def test_windows_loads_with_model_optimize_and_a_quoted_name() -> None:
    """Windows placement: POST /model/optimize?model_name=<quoted>, no body."""
    request = WINDOWS.load_request("org/model a&b=c")
    assert (request.method, request.body) == ("POST", None)
    parts = urlsplit(request.path)
    assert parts.path == "/model/optimize"
    assert parse_qs(parts.query) == {"model_name": ["org/model a&b=c"]}


# Attacks on the Windows protocol's answers through a pool: a failed task charges no
# worker, a status of another type is the task's result.


def test_one_bad_windows_task_charges_none_of_three_healthy_workers():
    """A task every Windows worker answers 200 {"status": "failed"} for is dead-lettered
    after two workers agree, charging nobody: no breaker opens, and the next good task
    runs on the first worker tried."""

    def windows(req: FakeRequest) -> Response:
        if req.path == "/health":
            return json_response(200, {"status": "healthy", "loaded_models": []})
        data = req.json()["input_data"]
        if data.get("text") == "poison":
            return json_response(200, {"status": "failed", "error": "bad input"})
        return json_response(200, {"status": "completed", "result": req.worker_id})

    net = FakeNetwork()
    for wid in ("w1", "w2", "w3"):
        net.route(wid, windows)
    cfg = config(
        *(w(wid, n, platform="windows") for n, wid in enumerate(("w1", "w2", "w3"))),
        circuit_breaker=BreakerConfig(fail_max=2, reset_timeout=60),
    )
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        with pytest.raises(TaskFailed) as info:
            pool.execute({"model_id": "m", "input_text": "poison"})
        tried = [a.worker_id for a in info.value.attempts]
        assert len(tried) == len(set(tried)) == 2
        rows = {r["id"]: r for r in pool.workers()}
        assert all(r["breaker"]["state"] == "closed" for r in rows.values())
        assert all(r["breaker"]["failures"] == 0 for r in rows.values())
        assert pool.execute({"model_id": "m", "input_text": "fine"})["status"] == "completed"


@pytest.mark.parametrize(
    "body",
    [
        {"status": ["failed"]},
        {"status": None},
        {"status": 0},
        {"status": {"failed": True}},
        {"status": "completed"},
    ],
)
def test_windows_status_values_of_other_types_are_returned_as_results(body: Any):
    """A 200 whose status is not the string "failed" is the task's result, as sent."""
    net = FakeNetwork()
    net.route("win", lambda req: json_response(200, body))
    cfg = config(w("win", 0, platform="windows"))
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        assert pool.execute({"model_id": "m", "input_text": "x"}) == body
