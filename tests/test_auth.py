"""Tests of per-worker request auth: static headers, bearer tokens, AutoBot HMAC signing."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import hmac
import json
import logging
import threading
from typing import Any

import pytest

from npu_sync import TaskFailed, WorkerPool
from npu_sync.auth import (
    HMAC_WINDOW,
    NO_AUTH,
    BearerAuth,
    HmacAuth,
    HmacVerifier,
    StaticHeaders,
)
from npu_sync.config import PoolConfig, worker_config
from npu_sync.testing import FakeNetwork, FakeRequest, json_response
from npu_sync.transport import Response
from tests.modelkit import config, linux, w

SECRET = "s3cr3t-Value-9f8e7d"
TOKEN = "tok-5a4b3c2d1e"
NOW = 1_700_000_000.25


def autobot_signature(secret: str, service_id: str, method: str, path: str, ts: int) -> str:
    """The signature as AutoBot's service client computes it, written out independently."""
    message = f"{service_id}:{method}:{path}:{ts}"
    return hmac.new(secret.encode(), message.encode(), hashlib.sha256).hexdigest()


class Clock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# --- HmacAuth ---------------------------------------------------------------------------------


def test_hmac_headers_follow_autobots_formula() -> None:
    """The three headers carry the service id, whole-second timestamp and AutoBot's HMAC."""
    auth = HmacAuth("npu-pool", SECRET, clock=Clock())
    headers = auth.headers("POST", "/inference")
    assert set(headers) == {"X-Service-ID", "X-Service-Signature", "X-Service-Timestamp"}
    assert headers["X-Service-ID"] == "npu-pool"
    assert headers["X-Service-Timestamp"] == "1700000000"
    assert headers["X-Service-Signature"] == autobot_signature(
        SECRET, "npu-pool", "POST", "/inference", 1_700_000_000
    )


def test_hmac_signs_the_path_without_its_query_and_the_method_upper_cased() -> None:
    """A query string is not signed, and a lower-case method is signed upper-cased."""
    auth = HmacAuth("svc", SECRET, clock=Clock())
    headers = auth.headers("post", "/model/optimize?model_name=a%20b")
    assert headers["X-Service-Signature"] == autobot_signature(
        SECRET, "svc", "POST", "/model/optimize", 1_700_000_000
    )


def test_hmac_signature_changes_with_the_second_and_is_reused_within_it() -> None:
    """Within one second the same headers are reused; the next second signs anew."""
    clock = Clock()
    auth = HmacAuth("svc", SECRET, clock=clock)
    first = auth.headers("GET", "/health")
    clock.now += 0.5
    assert auth.headers("GET", "/health") is first
    clock.now += 0.5
    later = auth.headers("GET", "/health")
    assert later["X-Service-Timestamp"] == "1700000001"
    assert later["X-Service-Signature"] == autobot_signature(
        SECRET, "svc", "GET", "/health", 1_700_000_001
    )
    other_path = auth.headers("GET", "/models")
    assert other_path["X-Service-Signature"] != later["X-Service-Signature"]


def test_hmac_cache_stays_bounded_with_many_paths() -> None:
    """Signing thousands of distinct paths keeps every signature right and the cache small."""
    auth = HmacAuth("svc", SECRET, clock=Clock())
    for i in range(2000):
        path = f"/task/{i}"
        signature = auth.headers("POST", path)["X-Service-Signature"]
        assert signature == autobot_signature(SECRET, "svc", "POST", path, 1_700_000_000)
    assert len(auth._cache) <= 64


def test_hmac_headers_are_read_only() -> None:
    """The headers handed out cannot be changed by a caller (they are shared)."""
    headers = HmacAuth("svc", SECRET, clock=Clock()).headers("GET", "/health")
    with pytest.raises(TypeError):
        headers["X-Service-ID"] = "other"  # type: ignore[index]


def test_hmac_signing_from_many_threads_gives_only_valid_signatures() -> None:
    """Threads signing while the clock moves each get a signature valid for their request."""
    clock = Clock()
    auth = HmacAuth("svc", SECRET, clock=clock)
    verifier = HmacVerifier("svc", SECRET, clock=clock)
    bad: list[str] = []
    start = threading.Barrier(8)

    def sign(n: int) -> None:
        start.wait()
        for i in range(1500):
            if n == 0 and i % 50 == 0:
                clock.now += 1
            path = f"/p{i % 80}"
            h = auth.headers("POST", path)
            reason = verifier.verify(
                "POST", path, h["X-Service-ID"], h["X-Service-Signature"], h["X-Service-Timestamp"]
            )
            if reason is not None:
                bad.append(reason)

    threads = [threading.Thread(target=sign, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []


@pytest.mark.parametrize(
    ("service_id", "secret", "match"),
    [
        ("", SECRET, "service id"),
        ("svc\n", SECRET, "service id"),
        ("svc", "", "secret"),
        ("svc", 12345, "secret"),
    ],
)
def test_hmac_rejects_unusable_settings(service_id: object, secret: object, match: str) -> None:
    """An empty or unsendable service id, or an empty or non-string secret, is a ValueError."""
    with pytest.raises(ValueError, match=match):
        HmacAuth(service_id, secret)  # type: ignore[arg-type]


def test_hmac_equality_compares_keys_without_showing_them() -> None:
    """Auths with the same id, secret and clock are equal; another secret is not."""
    clock = Clock()
    same = HmacAuth("svc", SECRET, clock=clock)
    assert same == HmacAuth("svc", SECRET, clock=clock)
    assert hash(same) == hash(HmacAuth("svc", SECRET, clock=clock))
    assert same != HmacAuth("svc", SECRET + "x", clock=clock)
    assert same != HmacAuth("other", SECRET, clock=clock)
    assert copy.deepcopy(same) is same and copy.copy(same) is same


# --- HmacVerifier -----------------------------------------------------------------------------


def signed(auth: HmacAuth, method: str, path: str) -> tuple[str, str, str]:
    h = auth.headers(method, path)
    return h["X-Service-ID"], h["X-Service-Signature"], h["X-Service-Timestamp"]


def test_verifier_accepts_a_correctly_signed_request() -> None:
    """A request signed with the shared secret within the window verifies."""
    verifier = HmacVerifier("svc", SECRET, clock=Clock())
    auth = HmacAuth("svc", SECRET, clock=Clock(NOW - HMAC_WINDOW + 1))
    assert verifier.verify("POST", "/inference", *signed(auth, "POST", "/inference")) is None


def test_verifier_accepts_a_signature_over_the_decoded_path() -> None:
    """A signature over the percent-decoded path verifies, as AutoBot checks it."""
    verifier = HmacVerifier("svc", SECRET, clock=Clock())
    auth = HmacAuth("svc", SECRET, clock=Clock())
    headers = signed(auth, "DELETE", "/models/my model")
    assert verifier.verify("DELETE", "/models/my%20model", *headers) is None


def test_hmac_signs_the_percent_decoded_path_as_autobots_verifier_reads_it() -> None:
    """``DELETE /models/a%20b`` is signed over ``/models/a b``: AutoBot's formula over
    the decoded path (its ASGI server decodes it), not over the path on the wire."""
    auth = HmacAuth("svc", SECRET, clock=Clock())
    headers = auth.headers("DELETE", "/models/a%20b?force=1")
    assert headers["X-Service-Signature"] == autobot_signature(
        SECRET, "svc", "DELETE", "/models/a b", 1_700_000_000
    )


def test_verifier_refuses_a_signature_over_the_raw_path() -> None:
    """The reference verifier checks only the decoded path, as AutoBot does, so a
    client signing the raw ``%20`` path is caught by the tests as AutoBot would."""
    verifier = HmacVerifier("svc", SECRET, clock=Clock())
    raw = autobot_signature(SECRET, "svc", "DELETE", "/models/a%20b", 1_700_000_000)
    assert verifier.verify("DELETE", "/models/a%20b", "svc", raw, "1700000000") == "bad signature"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"secret": "wrong-secret"}, "bad signature"),
        ({"service_id": "intruder"}, "unknown service id"),
        ({"skew": -(HMAC_WINDOW + 1)}, "timestamp"),
        ({"skew": HMAC_WINDOW + 1}, "timestamp"),
        ({"path": "/health"}, "bad signature"),
        ({"method": "GET"}, "bad signature"),
    ],
)
def test_verifier_refuses_wrong_secret_id_time_or_request(
    change: dict[str, object], reason: str
) -> None:
    """A wrong secret or service id, a timestamp outside the window (a replay), or a
    signature for another request is refused, with a reason."""
    verifier = HmacVerifier("svc", SECRET, clock=Clock())
    auth = HmacAuth(
        str(change.get("service_id", "svc")),
        str(change.get("secret", SECRET)),
        clock=Clock(NOW + float(change.get("skew", 0.0))),  # type: ignore[arg-type]
    )
    headers = signed(auth, str(change.get("method", "POST")), str(change.get("path", "/inference")))
    assert reason in (verifier.verify("POST", "/inference", *headers) or "")


@pytest.mark.parametrize("missing", [0, 1, 2])
def test_verifier_refuses_a_missing_header(missing: int) -> None:
    """A request without one of the three headers is refused, naming the header."""
    verifier = HmacVerifier("svc", SECRET, clock=Clock())
    headers: list[str | None] = list(signed(HmacAuth("svc", SECRET, clock=Clock()), "GET", "/"))
    headers[missing] = None
    names = ["X-Service-ID", "X-Service-Signature", "X-Service-Timestamp"]
    assert verifier.verify("GET", "/", *headers) == f"missing {names[missing]} header"


@pytest.mark.parametrize("timestamp", ["soon", "1.5e9", "-1700000000", "\u00b2", "9" * 40])
def test_verifier_refuses_a_timestamp_that_is_not_unix_seconds(timestamp: str) -> None:
    """A timestamp that is not whole Unix seconds is refused without raising."""
    verifier = HmacVerifier("svc", SECRET, clock=Clock())
    reason = verifier.verify("GET", "/", "svc", "00" * 32, timestamp)
    assert reason is not None and "X-Service-Timestamp" in reason


def test_verifier_refuses_a_non_ascii_signature_without_raising() -> None:
    """A signature with non-ASCII characters is a bad signature, not an exception."""
    verifier = HmacVerifier("svc", SECRET, clock=Clock())
    assert verifier.verify("GET", "/", "svc", "é" * 64, str(int(NOW))) == "bad signature"


# --- bearer and static headers ----------------------------------------------------------------


def test_bearer_sends_the_authorization_header() -> None:
    """BearerAuth adds 'Authorization: Bearer <token>' to every request."""
    auth = BearerAuth(TOKEN)
    assert dict(auth.headers("POST", "/inference")) == {"Authorization": f"Bearer {TOKEN}"}
    assert auth.headers("GET", "/health") is auth.headers("POST", "/x")
    assert auth == BearerAuth(TOKEN) and auth != BearerAuth(TOKEN + "x")


@pytest.mark.parametrize("token", ["", f"{TOKEN}\r\nX-Evil: 1", f"{TOKEN} more", f"{TOKEN}é"])
def test_bearer_rejects_tokens_that_cannot_be_a_header_without_quoting_them(token: str) -> None:
    """A token that is empty or would break the header is refused; the error hides it."""
    with pytest.raises(ValueError, match="bearer token") as info:
        BearerAuth(token)
    if token:
        assert TOKEN not in str(info.value)


def test_static_headers_are_sent_as_given_and_shown_by_name_only() -> None:
    """StaticHeaders sends its headers unchanged; repr lists names, not values."""
    auth = StaticHeaders({"Authorization": f"Basic {TOKEN}", "X-Team": "npu"})
    assert dict(auth.headers("GET", "/health")) == {
        "Authorization": f"Basic {TOKEN}",
        "X-Team": "npu",
    }
    assert repr(auth) == "StaticHeaders(names=['Authorization', 'X-Team'])"
    assert dict(NO_AUTH.headers("GET", "/")) == {}
    with pytest.raises(ValueError, match="header 'X-Bad'"):
        StaticHeaders({"X-Bad": f"{TOKEN}\n"})
    with pytest.raises(ValueError, match="header name"):
        StaticHeaders({"Bad Name": "x"})


# --- secrets stay secret ----------------------------------------------------------------------


def test_no_secret_in_repr_str_errors_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    """repr, str, format and log lines of every auth object, and the errors they raise,
    never contain the secret or token."""
    objects = [
        HmacAuth("svc", SECRET),
        HmacVerifier("svc", SECRET),
        BearerAuth(TOKEN),
        StaticHeaders({"Authorization": f"Bearer {TOKEN}"}),
    ]
    texts = [text for obj in objects for text in (repr(obj), str(obj), f"{obj}", f"{obj!r}")]
    errors = []
    for bad in (f"{SECRET}\n", f"{SECRET} x"):
        try:
            BearerAuth(bad)
        except ValueError as exc:
            errors.append(str(exc))
            errors.append(repr(exc))
    try:
        HmacAuth(f"{SECRET}\n", SECRET)
    except ValueError as exc:
        errors.append(str(exc))
    verifier = HmacVerifier("svc", SECRET, clock=Clock())
    expected = HmacAuth("svc", SECRET, clock=Clock()).headers("GET", "/")["X-Service-Signature"]
    reasons = [
        verifier.verify("GET", "/", "svc", "0" * 64, str(int(NOW))),
        verifier.verify("GET", "/other", "svc", expected, str(int(NOW))),
    ]
    with caplog.at_level(logging.DEBUG):
        log = logging.getLogger("npu_sync.test")
        for obj in objects:
            log.info("auth %s / %r", obj, obj)
        HmacAuth("svc", SECRET).headers("GET", "/health")
    everything = "\n".join([*texts, *errors, *map(str, reasons), caplog.text])
    assert len(errors) == 5 and all(reasons)
    assert SECRET not in everything
    assert TOKEN not in everything
    assert expected not in everything
    assert "***" in repr(objects[0]) and "***" in repr(objects[2])


# Attacks on request auth through a pool: a reload rotating the HMAC secret, a worker
# that echoes the bearer token it refused.


SECRET_OLD, SECRET_NEW = "old-hmac-secret-aa1", "new-hmac-secret-bb2"


def _signed_with(secret: str, req: FakeRequest) -> bool:
    stamp = req.headers["X-Service-Timestamp"]
    message = f"pool:{req.method}:{req.path}:{stamp}".encode()
    expected = hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, req.headers["X-Service-Signature"])


def test_a_reload_rotating_the_hmac_secret_signs_every_later_request_with_the_new_one():
    """After a reload that changes only the secret, no request (task, health, /models)
    carries a signature made with the old one."""
    net = FakeNetwork()
    net.route("a", linux(["m"]))

    def cfg(secret: str) -> PoolConfig:
        auth = {"type": "hmac", "service_id": "pool", "secret": secret}
        return config(worker_config("a", "http://127.0.0.1:9500", auth=auth))

    with WorkerPool(cfg(SECRET_OLD), transport_factory=net.factory) as pool:
        pool.check_health()
        pool.execute({"model_id": "m"})
        before = len(net.requests("a"))
        assert all(_signed_with(SECRET_OLD, r) for r in net.requests("a"))
        pool.reload(cfg(SECRET_NEW))
        pool.check_health()
        pool.execute({"model_id": "m"})
        after = net.requests("a")[before:]
        shown = repr(pool.config) + json.dumps([pool.workers(), pool.stats()])
    assert [r.path for r in after] == ["/health", "/models", "/inference"]
    assert all(_signed_with(SECRET_NEW, r) for r in after)
    assert SECRET_OLD not in shown and SECRET_NEW not in shown


def test_a_token_the_worker_echoes_in_its_401_is_never_shown(caplog: pytest.LogCaptureFixture):
    """A worker that quotes the bearer token it refused: the token appears in no error,
    dead letter, stats, workers() row, event or log record."""
    events: list[Any] = []

    def echo(req: FakeRequest) -> Response:
        given = req.headers.get("Authorization", "")
        return json_response(401, {"detail": f"token refused: {given!r}"})

    net = FakeNetwork()
    net.route("a", linux(None, task=echo))
    cfg = config(w("a", 0, auth={"type": "bearer", "token": TOKEN}))
    caplog.set_level(logging.DEBUG, logger="npu_sync")
    with WorkerPool(cfg, transport_factory=net.factory, hooks=[events.append]) as pool:
        with pytest.raises(TaskFailed) as info:
            pool.execute({"x": 1})
        letter = pool.dead_letters.get(info.value.dead_letter_id)
        assert letter is not None
        shown = "\n".join(
            [
                str(info.value),
                repr(info.value.attempts),
                json.dumps(letter.to_dict(), default=repr),
                json.dumps([pool.stats(), pool.workers()], default=repr),
                repr([dataclasses.asdict(e) for e in events]),
                caplog.text,
            ]
        )
    assert "token refused" in shown  # the worker's words are kept...
    assert TOKEN not in shown  # ...without the token
