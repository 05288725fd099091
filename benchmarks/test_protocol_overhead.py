"""Per-call cost of the worker protocols and request auth, against encoding the task.

Every attempt will map the task (``request_body``), sign it (``auth.headers``) and
classify the answer (``classify``). Each is timed side by side with the one cost every
task already pays, encoding its payload as JSON (``Task.body()``), in interleaved
batches of calls so that machine noise hits all contenders alike.
"""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.conftest import interleave, report, summarise
from npu_sync._retry import classify_response
from npu_sync.auth import BearerAuth, HmacAuth
from npu_sync.protocols import LINUX, WINDOWS
from npu_sync.task import Task
from npu_sync.testing import json_response

PAYLOAD = {"model_id": "llama", "input_text": "benchmark text", "max_tokens": 64}
BATCH = 200


def batched(fn: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        for _ in range(BATCH):
            fn()

    return run


def test_protocol_and_auth_cost_per_call(benchmark):
    """Median µs per call of mapping, classifying and signing, and the ratio to Task.body()."""
    task = Task(PAYLOAD)
    linux_answer = json_response(200, {"model_id": "llama", "response": "r" * 200})
    windows_answer = json_response(
        200, {"task_id": "t", "status": "completed", "result": {"embedding": [0.1] * 8}}
    )
    windows_failed = json_response(200, {"task_id": "t", "status": "failed", "error": "boom"})
    hmac_auth = HmacAuth("npu-pool", "secret-value")
    paths = [f"/p{i}" for i in range(100)]
    counter = iter(range(10**12))
    bearer = BearerAuth("token-value")
    contenders = {
        "Task.body() (baseline)": task.body,
        "linux request_body": lambda: LINUX.request_body(PAYLOAD),
        "windows request_body": lambda: WINDOWS.request_body(PAYLOAD),
        "linux task_model": lambda: LINUX.task_model(PAYLOAD),
        "windows task_model": lambda: WINDOWS.task_model(PAYLOAD),
        "classify_response": lambda: classify_response(linux_answer),
        "linux classify": lambda: LINUX.classify(linux_answer),
        "windows classify (same answer)": lambda: WINDOWS.classify(linux_answer),
        "windows classify (completed)": lambda: WINDOWS.classify(windows_answer),
        "windows classify (failed)": lambda: WINDOWS.classify(windows_failed),
        "bearer headers": lambda: bearer.headers("POST", "/inference"),
        "hmac headers (same second)": lambda: hmac_auth.headers("POST", "/inference"),
        # A new path each call: the signature is computed every time.
        "hmac headers (signing)": lambda: hmac_auth.headers(
            "POST", paths[next(counter) % 100] + str(next(counter))
        ),
    }
    runs = {name: batched(fn) for name, fn in contenders.items()}
    interleave(runs, 20)
    figures = summarise(interleave(runs, 300))
    per_call = {name: f["median_us"] / BATCH for name, f in figures.items()}
    base = per_call["Task.body() (baseline)"]
    benchmark.pedantic(runs["windows request_body"], rounds=50)
    benchmark.extra_info.update({"per_call_us": per_call})
    report(
        "per-call cost, µs (median over batches), and ratio to Task.body()",
        [("call", "µs", "ratio")]
        + [(name, f"{us:.2f}", f"{us / base:.2f}") for name, us in per_call.items()],
    )
    # The pool's hot path must not grow by more than a JSON encoding per attempt.
    assert per_call["windows request_body"] < 3 * base
    assert per_call["hmac headers (same second)"] < base
