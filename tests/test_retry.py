"""Unit tests of outcome classification and the backoff policy."""

from __future__ import annotations

import json

import pytest

from npu_sync._retry import Kind, RetryPolicy, classify_error, classify_response, parse_retry_after
from npu_sync.config import RetryConfig
from npu_sync.transport import Response, TransportError


def resp(
    status: int,
    body: object = None,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
):
    data = raw if raw is not None else json.dumps(body).encode()
    return Response(status=status, headers=headers or {}, body=data)


def test_2xx_json_is_success_with_the_decoded_body():
    """A 200 with JSON is a success carrying the decoded body."""
    outcome = classify_response(resp(200, {"response": "hi"}))
    assert outcome.kind is Kind.SUCCESS and outcome.value == {"response": "hi"}


def test_2xx_non_json_is_a_worker_failure():
    """A 200 whose body is not JSON counts against the worker."""
    outcome = classify_response(resp(200, raw=b"<html>"))
    assert outcome.kind is Kind.FAILURE and "non-JSON" in (outcome.error or "")


@pytest.mark.parametrize("status", [400, 404, 413, 422])
def test_4xx_rejects_the_task(status):
    """4xx other than 401/403/408/429 means the task is bad."""
    outcome = classify_response(resp(status, {"detail": "bad input"}))
    assert outcome.kind is Kind.REJECTED and "bad input" in (outcome.error or "")


@pytest.mark.parametrize("status", [401, 403])
def test_refused_credentials_are_the_operators_fault_and_not_processed(status):
    """401/403 say the worker refused our credentials: a configuration error (neither
    the task's nor the worker's sickness), the task never ran, and the error says so."""
    outcome = classify_response(resp(status, {"detail": "bad signature"}))
    assert outcome.kind is Kind.MISCONFIGURED and not outcome.processed
    assert outcome.error == f"credentials refused: HTTP {status}: bad signature"


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504])
def test_408_429_and_5xx_are_worker_failures(status):
    """408, 429 and 5xx count against the worker and are retried elsewhere."""
    assert classify_response(resp(status, {"detail": "x"})).kind is Kind.FAILURE


def test_model_not_loaded_is_not_this_worker():
    """The AutoBot worker's 'Model X not loaded' names the model and blames nobody."""
    outcome = classify_response(resp(500, {"detail": "Model llama-7b not loaded"}))
    assert outcome.kind is Kind.NOT_HERE and outcome.model == "llama-7b"
    assert outcome.processed is False


def test_retry_after_seconds_and_http_date_are_parsed():
    """Retry-After as delta-seconds or an HTTP date becomes seconds from now."""
    assert classify_response(resp(503, {}, {"retry-after": "7"})).retry_after == 7.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == pytest.approx(
        10.0
    )
    assert parse_retry_after("soon") is None
    assert parse_retry_after("-3") == 0.0


def test_429_and_503_mean_the_task_was_not_processed():
    """Only 429/503 (and unsent requests) say the worker did not run the task."""
    assert classify_response(resp(503, {})).processed is False
    assert classify_response(resp(429, {})).processed is False
    assert classify_response(resp(500, {})).processed is True


def test_transport_errors_are_failures_that_remember_whether_anything_was_sent():
    """A connect error is unsent; a read timeout may have reached the worker."""
    refused = classify_error(TransportError("connect", "refused", sent=False))
    timeout = classify_error(TransportError("timeout", "read timed out", sent=True))
    assert refused.kind is timeout.kind is Kind.FAILURE
    assert refused.processed is False and timeout.processed is True
    assert "connect" in (refused.error or "")


def test_backoff_grows_within_jittered_bounds_and_is_capped():
    """The n-th wait lies in [initial*2**(n-1), that+initial], never above backoff_max."""
    policy = RetryPolicy(RetryConfig(max_retries=10, backoff_initial=0.05, backoff_max=0.3))
    for n in range(1, 11):
        base = 0.05 * 2 ** (n - 1)
        for _ in range(50):
            wait = policy.next_wait(n, 0.0)
            assert wait is not None
            assert min(base, 0.3) <= wait <= min(base + 0.05, 0.3) + 1e-9


def test_no_wait_after_the_last_allowed_attempt():
    """With max_retries=2 the third failure stops the task."""
    policy = RetryPolicy(RetryConfig(max_retries=2, backoff_initial=0.01, backoff_max=1))
    assert policy.next_wait(1, 0) is not None
    assert policy.next_wait(2, 0) is not None
    assert policy.next_wait(3, 0) is None


def test_jitter_spreads_the_waits():
    """Two callers failing together do not wait exactly the same time."""
    policy = RetryPolicy(RetryConfig(max_retries=3, backoff_initial=0.05, backoff_max=2))
    assert len({policy.next_wait(1, 0) for _ in range(20)}) > 1


@pytest.mark.parametrize("kind", ["connect", "timeout", "too_large", "protocol"])
def test_an_outcome_without_an_answer_carries_the_transport_errors_kind(kind: str) -> None:
    """Callers tell failures apart by ``error_kind``, never by parsing ``error``'s text:
    a message that happens to start like another kind changes nothing."""
    outcome = classify_error(TransportError(kind, "timeout-like text: too_large", sent=True))
    assert outcome.error_kind == kind
    assert outcome.suspect is (kind == "too_large")
    cut = classify_error(TransportError(kind, "x", sent=True), cut_by_caller=True)
    assert cut.error_kind == kind
    assert cut.kind is (Kind.ABANDONED if kind == "timeout" else Kind.FAILURE)
    answered = classify_response(Response(503, {}, b"{}"))
    assert answered.error_kind is None
