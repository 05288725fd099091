"""The request step alone (npu_sync._life.transport), on a fake network."""

from __future__ import annotations

import contextlib
import json
import ssl
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import trustme

from npu_sync import WorkerPool
from npu_sync._life.context import FIRST, Try
from npu_sync._life.ledger import record
from npu_sync._life.transport import Send
from npu_sync._retry import Kind, Outcome
from npu_sync.config import TLSConfig
from npu_sync.errors import InvalidTask
from npu_sync.testing import FakeNetwork, FakeRequest, json_response
from npu_sync.transport import Cancel, Response
from tests.hostile import (
    CLIENTS,
    MARGIN,
    PAYLOAD,
    READ,
    TASK,
    Hostile,
    Peer,
    PoolRun,
    answer,
    concurrently,
    tls_handshake_stalling,
)
from tests.lifekit import OK, begin, config, network_pool


def _send(net: FakeNetwork, check: Any = None, cancel: object = None) -> tuple[Outcome, Try]:
    with network_pool(net) as p:
        state = p._state
        send = Send(state, state.config, state.retry, check)
        ctx = begin(p)
        lease = state.dispatcher.try_acquire(())
        assert lease is not None
        at = Try(lease, FIRST, cancel)
        at.t0 = state.clock.monotonic()
        at.remaining = 10.0
        at.body = ctx.body
        at.headers = ctx.headers
        try:
            return send(ctx, at), at
        finally:
            record(state, lease, OK, 0.0, 0.0, retry=False)


def test_send_classifies_the_answer_in_the_worker_protocol() -> None:
    """2xx JSON is a success carrying the body; a 503 is the worker's failure."""
    net = FakeNetwork(lambda req: json_response(200, {"response": "hi"}))
    outcome, _ = _send(net)
    assert outcome.kind is Kind.SUCCESS and outcome.value == {"response": "hi"}
    failing = FakeNetwork(lambda req: json_response(503, {"detail": "busy"}))
    assert _send(failing)[0].kind is Kind.FAILURE


def test_send_turns_a_refused_result_check_into_a_failure() -> None:
    """The pool's result_check raising makes the answer that worker's failure."""

    def check(value: object) -> None:
        raise ValueError("no 'response' key")

    net = FakeNetwork(lambda req: json_response(200, {"other": 1}))
    outcome, _ = _send(net, check)
    assert outcome.kind is Kind.FAILURE and "result check refused" in (outcome.error or "")


def test_send_hands_its_cancel_handle_to_a_cancellable_transport() -> None:
    """One request call: the attempt's cancel handle reaches the transport."""
    got: list[object] = []
    cancel = Cancel()

    class Spy:
        cancellable = True

        def request(self, method: str, path: str, **kw: Any) -> Response:
            got.append(kw.get("cancel"))
            return json_response(200, {})

        def close(self) -> None:
            pass

    with WorkerPool(config("a"), transport_factory=lambda *a, **k: Spy()) as p:
        state = p._state
        send = Send(state, state.config, state.retry, None)
        ctx = begin(p)
        lease = state.dispatcher.try_acquire(())
        assert lease is not None
        at = Try(lease, FIRST, cancel)
        at.t0 = state.clock.monotonic()
        at.remaining = 10.0
        at.body = ctx.body
        at.headers = ctx.headers
        send(ctx, at)
        record(state, lease, OK, 0.0, 0.0, retry=False)
    assert got == [cancel]


def test_send_raises_invalid_task_for_a_header_nothing_could_send() -> None:
    """An error before any byte was sent is the task's: InvalidTask, nobody charged."""

    def handler(req: FakeRequest) -> Response:
        raise InvalidTask("bad header value")

    with pytest.raises(InvalidTask):
        _send(FakeNetwork(handler))


# -- Outcomes ------------------------------------------------------------------------


# Attacks: the pool's promises against hostile workers on loopback, through every client.
#
# Each scenario runs tasks through WorkerPool.execute against raw-socket workers that
# misbehave on purpose, and checks what the pool promises whatever a worker does:
#
# 1. every task ends by its deadline (plus a generous margin) with a result,
#    TaskRejected, or TaskFailed whose dead letter was stored;
# 2. a breaker measures only its worker: an attempt cut short by the caller's deadline,
#    or a keep-alive connection found stale, charges nobody, while a worker that fails
#    within its own timeouts is charged;
# 3. nothing is left behind: no slot in flight, no active task, no npu-sync thread once
#    close() has returned, which it does promptly.
#
# Timeouts are short (a task 1.2 s, an attempt 0.8 s) so that a worker holding a call
# shows at once; margins are a second, since the point is "bounded", not milliseconds.


SHORT = 0.4  # a caller's deadline, shorter than the worker's own timeout


DRIP = 0.05  # seconds between two bytes from a dripping worker


@pytest.fixture(params=CLIENTS)
def client(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def runs() -> Iterator[Callable[..., PoolRun]]:
    built: list[PoolRun] = []

    def build(*args: Any, **kw: Any) -> PoolRun:
        run = PoolRun(*args, **kw)
        built.append(run)
        return run

    yield build
    for run in built:
        run.close()


@dataclass
class Certs:
    """A test CA, a server context for 127.0.0.1, and the client settings trusting it."""

    server: ssl.SSLContext
    client: TLSConfig


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    path = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return Certs(server, TLSConfig(verify=str(path)))


def serve(servers: list[Hostile], behaviour: Any, **kw: Any) -> Hostile:
    kw.setdefault("nodelay", True)
    server = Hostile(behaviour, **kw)
    servers.append(server)
    return server


def seq_of(body: bytes) -> int:
    return int(json.loads(body)["input_text"])


def _chunked_answer() -> tuple[bytes, dict[str, int]]:
    """A chunked answer with a trailer, and where each of its parts starts."""
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Pad: " + b"p" * 80 + b"\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    body = b'{"pad": "' + b"x" * 80 + b'"}'
    size = b"%x;pad=%s\r\n" % (len(body), b"e" * 80)
    trailer = b"X-Trailer: " + b"t" * 80 + b"\r\n"
    full = head + size + body + b"\r\n0\r\n" + trailer + b"\r\n"
    return full, {
        "status line": 0,
        "a header": head.index(b"X-Pad"),
        "a chunk size": len(head),
        "chunk data": len(head) + len(size),
        "a trailer": full.index(b"X-Trailer"),
        "the last CRLF": len(full) - 2,
    }


CHUNKED, PHASES = _chunked_answer()


def drip_from(at: int) -> Any:
    """Send the answer up to ``at`` at once, then a byte every DRIP s, never the last."""

    def behaviour(peer: Peer) -> None:
        if (
            peer.request() is not None
            and peer.send(CHUNKED[:at])
            and peer.drip(CHUNKED[at:-1], DRIP)
        ):
            peer.hold()

    return behaviour


def short_body(peer: Peer) -> None:
    """Promise 1000 bytes of body, send 10, stall."""
    if peer.request() is not None:
        peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10)
        peer.hold()


def interim_forever(peer: Peer) -> None:
    """Answer ``100 Continue`` after ``100 Continue``, one every DRIP s, forever."""
    if peer.request() is not None:
        peer.drip_forever(b"", lambda n: b"HTTP/1.1 100 Continue\r\n\r\n", DRIP)


def huge_head_slowly(peer: Peer) -> None:
    """A status line, then 1 KiB header lines, one every DRIP s, without end."""
    if peer.request() is not None:
        line = b"h" * 1024
        peer.drip_forever(b"HTTP/1.1 200 OK\r\n", lambda n: b"X-%d: %s\r\n" % (n, line), DRIP)


STALLS: dict[str, Any] = {
    **{f"drips {phase}": drip_from(at) for phase, at in PHASES.items()},
    "sends less body than its Content-Length": short_body,
    "sends 1xx after 1xx": interim_forever,
    "sends a huge head slowly": huge_head_slowly,
}


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_stalling_worker_holds_no_task_past_its_deadline(client, servers, runs, certs, scheme):
    """Whatever phase a worker stalls in, a task ends by its deadline and is dead-lettered;
    a caller's short deadline charges nothing, the worker's own timeout charges once.
    Over TLS too."""
    tls = certs.server if scheme == "https" else None

    def scenario(behaviour: Any) -> Callable[[], None]:
        run = runs(client, [serve(servers, behaviour, tls=tls)], scheme=scheme, tls=certs.client)

        def check() -> None:
            cut = run.execute(SHORT)
            assert cut.kind == "failed"
            assert (run.charged(), run.abandoned()) == (0, 1)
            ended = run.execute(TASK)
            assert ended.kind == "failed"
            # The first attempt used the worker's whole budget: charged. The re-try had
            # only the task's remaining time, shorter than that: not charged.
            assert (run.charged(), run.abandoned()) == (1, 2)
            assert run.breaker() == "closed"

        return check

    concurrently({name: scenario(behaviour) for name, behaviour in STALLS.items()})


def test_a_flood_of_interim_answers_fails_fast_and_charges_the_worker(client, servers, runs):
    """A worker answering only 1xx answers, as fast as it can, is charged for each try."""

    def flood(peer: Peer) -> None:
        while peer.request() is not None:
            if not peer.send(b"HTTP/1.1 102 Processing\r\n\r\n" * 200):
                return
            peer.hold()

    run = runs(client, [serve(servers, flood)], fail_max=2)
    ended = run.execute()
    assert ended.kind == "failed"
    assert run.charged() == 2 and run.breaker() == "open"


def reset_after_accepting(peer: Peer) -> None:
    peer.reset()


def reset_mid_request(peer: Peer) -> None:
    if peer.receive():  # some of the request, not necessarily all
        peer.reset()


def reset_after_the_status_line(peer: Peer) -> None:
    if peer.request() is not None:
        peer.send(b"HTTP/1.1 200 OK\r\n")
        peer.reset()


def reset_mid_body(peer: Peer) -> None:
    if peer.request() is not None:
        peer.send(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"a": ')
        peer.reset()


def half_close_before_answering(peer: Peer) -> None:
    if peer.request() is not None:
        peer.half_close()
        peer.hold()


BROKEN: dict[str, Any] = {
    "resets after accepting": reset_after_accepting,
    "resets mid-request": reset_mid_request,
    "resets after the status line": reset_after_the_status_line,
    "resets mid-body": reset_mid_body,
    "half-closes before answering": half_close_before_answering,
}


@pytest.mark.parametrize("scheme", ["http", "https"])
@pytest.mark.parametrize("behaviour", BROKEN.values(), ids=BROKEN.keys())
def test_a_worker_that_breaks_every_fresh_connection_is_charged(
    client, servers, runs, certs, behaviour, scheme
):
    """Resetting or half-closing every new connection is the worker's fault: charged at
    once, retried, and its breaker opens; the task still ends by its deadline. Over TLS
    too, after the handshake."""
    tls = certs.server if scheme == "https" else None
    run = runs(
        client, [serve(servers, behaviour, tls=tls)], scheme=scheme, tls=certs.client, fail_max=2
    )
    ended = run.execute()
    assert ended.kind == "failed"
    assert ended.elapsed < READ  # each failure was immediate, not a timeout
    assert run.charged() == 2 and run.breaker() == "open"
    assert run.abandoned() == 0


def reset_after_the_last_byte(peer: Peer) -> None:
    if (seen := peer.request()) is not None:
        peer.send(answer(200, b'{"n": %d}' % seq_of(seen.body)))
        peer.reset()


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_reset_right_after_a_whole_answer_loses_nothing(client, servers, runs, certs, scheme):
    """An answer followed at once by a reset is the task's result; nobody is charged.
    Over TLS too."""
    server = serve(
        servers, reset_after_the_last_byte, tls=certs.server if scheme == "https" else None
    )
    run = runs(client, [server], scheme=scheme, tls=certs.client)
    for n in range(20):
        ended = run.execute(payload={**PAYLOAD, "input_text": str(n)})
        assert (ended.kind, ended.value) == ("result", {"n": n})
    assert run.charged() == 0
    assert len(server.seen) == 20


@pytest.mark.parametrize("scheme", ["http", "https"])
@pytest.mark.parametrize("status", [413, 200])
def test_an_answer_before_the_body_was_read_is_the_answer(
    client, servers, runs, certs, status, scheme
):
    """A worker that answers before reading a large body, then closes, is understood:
    a 413 rejects the task (nobody charged), a 200 is its result. Over TLS too."""
    answered = threading.Event()

    def early(peer: Peer) -> None:
        if peer.head() is not None:
            peer.send(answer(status, b'{"detail": "early"}', {"Connection": "close"}))
            answered.set()
            peer.reset()  # unread body: closing resets the connection anyway

    tls = certs.server if scheme == "https" else None
    run = runs(client, [serve(servers, early, tls=tls)], scheme=scheme, tls=certs.client)
    ended = run.execute(payload={**PAYLOAD, "input_text": "x" * (16 << 20)})
    assert answered.is_set()
    assert ended.kind == ("rejected" if status == 413 else "result"), ended.error
    assert run.charged() == 0


def close_when_the_next_request_arrives(peer: Peer) -> None:
    """Answer one request, then close (a reset: the next request is unread) the moment
    the next one arrives: the worker never reads it."""
    if (seen := peer.request()) is not None:
        peer.send(answer(200, b'{"n": %d}' % seq_of(seen.body)))
        if peer.wait_readable():
            peer.reset()


def close_right_after_answering(peer: Peer) -> None:
    """Answer one request, then close at once without saying ``Connection: close``."""
    if (seen := peer.request()) is not None:
        peer.send(answer(200, b'{"n": %d}' % seq_of(seen.body)))


STALE: dict[str, Any] = {
    "closed as the next request arrives": close_when_the_next_request_arrives,
    "closed right after answering": close_right_after_answering,
}


@pytest.mark.parametrize("scheme", ["http", "https"])
@pytest.mark.parametrize("idempotent", [True, False], ids=["replayable", "not-replayable"])
@pytest.mark.parametrize("behaviour", STALE.values(), ids=STALE.keys())
def test_stale_keep_alive_connections_never_charge_the_worker(
    client, servers, runs, certs, behaviour, idempotent, scheme
):
    """A hundred tasks on connections the worker closes under them: replayable ones all
    succeed, the others succeed or fail dead-lettered, and the breaker is never touched.
    Over TLS too."""
    server = serve(servers, behaviour, tls=certs.server if scheme == "https" else None)
    run = runs(client, [server], scheme=scheme, tls=certs.client, fail_max=1)
    results = []
    for n in range(100):
        ended = run.execute(payload={**PAYLOAD, "input_text": str(n)}, idempotent=idempotent)
        assert ended.kind in ("result", "failed")
        assert run.charged() == 0, ended.error
        if ended.kind == "result":
            assert ended.value == {"n": n}
            results.append(n)
    assert run.charged() == 0 and run.breaker() == "closed"
    if idempotent:
        assert len(results) == 100
    # Every task the worker answered is one it read; none was run twice.
    ran = [seq_of(seen.body) for seen in server.seen]
    assert sorted(set(ran)) == sorted(ran)
    assert set(results) <= set(ran)


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_second_answer_to_one_request_is_never_the_next_tasks_result(
    client, servers, runs, certs, scheme
):
    """A worker that answers every request twice: each task still gets its own answer,
    never the stray one waiting on the connection from the task before."""
    stray_arrived = threading.Event()

    def twice(peer: Peer) -> None:
        while (seen := peer.request()) is not None:
            n = seq_of(seen.body)
            peer.send(answer(200, b'{"n": %d}' % n))
            peer.send(answer(200, b'{"stray": %d}' % n))
            # Both answers are in the client's socket before its next task starts.
            peer.flushed()
            stray_arrived.set()

    tls = certs.server if scheme == "https" else None
    server = serve(servers, twice, tls=tls)
    run = runs(client, [server], scheme=scheme, tls=certs.client)
    for n in range(30):
        stray_arrived.clear()
        ended = run.execute(payload={**PAYLOAD, "input_text": str(n)})
        assert (ended.kind, ended.value) == ("result", {"n": n})
        assert stray_arrived.wait(5)
    assert run.charged() == 0
    assert [seq_of(seen.body) for seen in server.seen] == list(range(30))


def test_a_tls_close_notify_on_an_idle_connection_costs_no_task(client, servers, runs, certs):
    """A TLS worker that ends the session (close_notify) on an idle connection, keeping
    TCP open: the next task, even one that cannot be re-sent, goes out on a new one."""
    notified = threading.Event()

    def answer_then_close_notify(peer: Peer) -> None:
        if (seen := peer.request()) is None:
            return
        peer.send(answer(200, b'{"n": %d}' % seq_of(seen.body)))
        sock = peer.sock
        assert isinstance(sock, ssl.SSLSocket)
        sock.setblocking(False)
        with contextlib.suppress(ssl.SSLWantReadError, OSError):
            sock.unwrap()  # sends close_notify, then would wait for the client's
        sock.setblocking(True)
        peer.flushed()
        notified.set()
        peer.hold()

    server = serve(servers, answer_then_close_notify, tls=certs.server)
    run = runs(client, [server], scheme="https", tls=certs.client)
    for n in range(5):
        notified.clear()
        ended = run.execute(payload={**PAYLOAD, "input_text": str(n)}, idempotent=False)
        assert (ended.kind, ended.value) == ("result", {"n": n})
        assert notified.wait(5)
    assert (run.charged(), run.abandoned()) == (0, 0)
    assert server.connections == 5


HANDSHAKE_STEPS = ("client hello", "server flight", "drip", "finished")


def test_a_tls_handshake_stalled_at_any_step_holds_no_task(client, servers, runs, certs):
    """Whatever step a TLS worker stalls its handshake at, a task ends by its deadline;
    a caller's short deadline charges nothing, the worker's own timeout charges once."""

    def scenario(step: str) -> Callable[[], None]:
        server = serve(servers, tls_handshake_stalling(certs.server, step))
        run = runs(client, [server], scheme="https", tls=certs.client)

        def check() -> None:
            assert run.execute(SHORT).kind == "failed"
            assert (run.charged(), run.abandoned()) == (0, 1)
            assert run.execute(TASK).kind == "failed"
            assert (run.charged(), run.abandoned()) == (1, 2)

        return check

    concurrently({step: scenario(step) for step in HANDSHAKE_STEPS})


def test_a_tls_close_notify_mid_body_is_the_workers_failure(client, servers, runs, certs):
    """A TLS worker ending the session in the middle of a body is charged at once."""

    def close_notify_mid_body(peer: Peer) -> None:
        if peer.request() is None:
            return
        peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
        sock = peer.sock
        assert isinstance(sock, ssl.SSLSocket)
        sock.setblocking(False)
        with contextlib.suppress(ssl.SSLWantReadError, OSError):
            sock.unwrap()
        sock.setblocking(True)
        peer.hold()

    server = serve(servers, close_notify_mid_body, tls=certs.server)
    run = runs(client, [server], scheme="https", tls=certs.client, fail_max=2)
    ended = run.execute()
    assert ended.kind == "failed" and ended.elapsed < READ
    assert run.charged() == 2 and run.breaker() == "open"


def test_a_connect_budget_longer_than_the_attempts_still_charges_a_stalled_handshake(
    client, servers, runs, certs
):
    """With timeouts.connect above timeouts.read, a handshake that uses up the attempt's
    own budget is the worker's failure, not the caller's deadline."""
    server = serve(servers, tls_handshake_stalling(certs.server, "client hello"))
    run = runs(client, [server], scheme="https", tls=certs.client, connect=2 * TASK)
    assert run.execute(TASK).kind == "failed"
    assert (run.charged(), run.abandoned()) == (1, 1)


def test_many_callers_over_a_mix_of_hostile_workers(client, servers, runs):
    """Sixty tasks at once over one healthy worker and four hostile ones: each ends by its
    deadline in one of the three ways, with its own answer; the healthy worker is never
    charged, and nothing is left in flight."""

    def echo(peer: Peer) -> None:
        while (seen := peer.request()) is not None:
            if not peer.send(answer(200, b'{"n": %d}' % seq_of(seen.body))):
                return

    hostile = [
        drip_from(0),
        reset_after_accepting,
        close_right_after_answering,
        half_close_before_answering,
    ]
    healthy = serve(servers, echo)
    # Breakers that never open keep the hostile workers in the rotation.
    run = runs(
        client, [healthy, *(serve(servers, b) for b in hostile)], fail_max=1000, max_retries=4
    )
    waits = [run.submit(payload={**PAYLOAD, "input_text": str(n)}) for n in range(60)]
    ended = [wait() for wait in waits]
    for n, one in enumerate(ended):
        assert one.kind in ("result", "failed"), one.error
        if one.kind == "result":
            assert one.value == {"n": n}
    assert sum(one.kind == "result" for one in ended) >= 30
    run.check_quiet()
    assert run.charged("w0") == 0 and run.breaker("w0") == "closed"
    assert all(run.charged(f"w{i}") > 0 for i in (1, 2))  # the dripper and the resetter


def test_close_during_a_storm_waits_only_for_the_tasks_deadlines(client, servers, runs):
    """close() with twenty tasks held by a dripping worker returns once their deadlines
    have passed, every task dead-lettered, and no thread of the pool left."""
    run = runs(client, [serve(servers, drip_from(0))])
    waits = [run.submit() for _ in range(20)]
    run.close(within=TASK + MARGIN)
    assert all(wait().kind == "failed" for wait in waits)
