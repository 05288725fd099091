"""The idle-connection cap over all transports, the sweep, and the open-file check."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from npu_sync._fdlimit import RESERVE, check, need
from npu_sync.config import (
    HealthConfig,
    PoolConfig,
    PoolSettings,
    TLSConfig,
    TransportConfig,
    worker_config,
)
from npu_sync.errors import ConfigError
from npu_sync.transport import BuiltinTransport, IdleBudget, IdleReaper, reap_interval
from tests.hostile import Hostile, answer


def test_the_budget_counts_takes_and_gives_and_refuses_beyond_its_limit():
    """take() succeeds up to the limit, then refuses (and counts the refusal)."""
    budget = IdleBudget(2)
    assert budget.take() and budget.take()
    assert not budget.take() and budget.refused == 1
    budget.give()
    assert budget.take()
    budget.give(5)
    assert budget.held == 0
    with pytest.raises(ValueError, match="limit must be >= 0, got -1"):
        IdleBudget(-1)


def test_the_sweep_interval_follows_a_short_idle_timeout_within_bounds():
    """Every second, or a quarter of a shorter idle_timeout, never under 50 ms."""
    assert reap_interval(4.0) == 1.0
    assert reap_interval(2.0) == 0.5
    assert reap_interval(0.001) == 0.05


def ok(_seen: object) -> bytes:
    return answer(200, b'{"ok": true}')


def transports(reaper: IdleReaper, url: str, count: int) -> list[BuiltinTransport]:
    built = []
    for i in range(count):
        t = BuiltinTransport(
            worker_config(f"w{i}", url),
            tls=TLSConfig(),
            max_response_bytes=1 << 20,
            maxsize=8,
            idle_timeout=30,
        )
        built.append(reaper.adopt(t))
    return built


def concurrently(transport: BuiltinTransport, count: int) -> None:
    """``count`` requests at once on one transport: ``count`` connections."""
    gate = threading.Barrier(count)

    def one() -> None:
        gate.wait(10)
        transport.request("GET", "/health", timeout=10)

    threads = [threading.Thread(target=one) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)


def meeting(size: int, connections: int):
    """A worker whose first answer on each of its first ``connections`` connections
    waits until ``size`` requests have arrived: requests sent together overlap, and
    hold ``size`` connections, however loaded the machine is."""
    gate = threading.Barrier(size)
    count = [0]
    lock = threading.Lock()

    def behaviour(peer):
        with lock:
            count[0] += 1
            first = count[0] <= connections
        while (seen := peer.request()) is not None:
            if first:
                gate.wait(10)
                first = False
            peer.send(ok(seen))
        peer.hold()

    return behaviour


def test_the_cap_holds_over_many_transports_and_the_sweep_frees_it(servers):
    """Ten transports, four connections each, a cap of 12: never more than 12 idle;
    a sweep past idle_timeout closes them all and frees the budget."""
    server = Hostile(meeting(4, 40))
    servers.append(server)
    reaper = IdleReaper(12, 1.0)
    built = transports(reaper, server.url(), 10)
    try:
        for t in built:
            concurrently(t, 4)
            assert sum(x.idle_connections for x in built) <= 12
        assert reaper.budget.held == sum(x.idle_connections for x in built) == 12
        assert reaper.budget.refused > 0  # released beyond the cap: closed
        assert reaper.sweep(time.monotonic()) == 0  # none expired, none closed
        assert reaper.sweep(time.monotonic() + 31) == 12
        assert reaper.budget.held == 0 and sum(x.idle_connections for x in built) == 0
        assert not reaper.budget.holders
        concurrently(built[0], 3)  # usable again, and counted again
        # Up to 3 connections: on a loaded machine one request may end before another
        # starts, and reuse its connection. Whatever the count, the budget agrees.
        assert 1 <= reaper.budget.held == built[0].idle_connections <= 3
    finally:
        for t in built:
            t.close()
    assert reaper.budget.held == 0


def test_a_connection_the_worker_closed_is_swept_but_one_with_bytes_waiting_is_left(
    servers,
):
    """The sweep closes an idle connection whose worker closed it (TCP state), and
    leaves one on which the worker merely wrote: that one is for the next request's
    own check to drop."""
    peers = []
    got = threading.Semaphore(0)
    # Neither first answer leaves before both requests have arrived: the two requests
    # overlap, so they hold two connections however loaded the machine is.
    both_asked = threading.Barrier(2)

    def remember(peer):
        peers.append(peer)
        first = len(peers) <= 2  # the third connection, at the end, waits for no one
        while (seen := peer.request()) is not None:
            if first:
                both_asked.wait(10)
                first = False
            peer.send(ok(seen))
            got.release()
        peer.hold()

    s = Hostile(remember)
    servers.append(s)
    reaper = IdleReaper(8, 1.0)
    (t,) = transports(reaper, s.url(), 1)
    try:
        concurrently(t, 2)
        assert got.acquire(timeout=5) and got.acquire(timeout=5)
        assert t.idle_connections == 2
        peers[0].send(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")  # a stray answer
        peers[0].flushed()
        peers[1].sock.shutdown(socket.SHUT_WR)  # the worker closes its end
        deadline = time.monotonic() + 10
        while t.idle_connections == 2 and time.monotonic() < deadline:
            reaper.sweep()
        assert t.idle_connections == 1
        # The stray bytes still disqualify the other at its next use: a fresh one serves.
        before = s.connections
        assert t.request("GET", "/health", timeout=5).status == 200
        assert s.connections == before + 1
    finally:
        t.close()


def test_a_release_sweeps_when_a_sweep_is_due_without_any_thread():
    """A pool with no health thread still sweeps: keeping a connection idle runs the
    sweep once the interval has passed."""
    calls: list[float] = []
    budget = IdleBudget(4, interval=1.0, sweep=calls.append)
    budget.next_sweep = 10.0
    budget.holding(object(), 5.0)
    assert calls == []
    budget.holding(object(), 10.0)
    assert calls == [10.0] and budget.next_sweep == 11.0


# -- the open-file limit --------------------------------------------------------------------


def config(workers: int = 3, **kw: object) -> PoolConfig:
    ws = tuple(
        worker_config(f"w{i}", "http://127.0.0.1:9000", max_concurrent=8) for i in range(workers)
    )
    return PoolConfig(workers=ws, **kw)  # type: ignore[arg-type]


def test_what_a_configuration_may_open_adds_up_from_its_keys():
    """Idle cap + health concurrency + tasks in flight (bounded by pool.threads) + reserve."""
    c = config(
        workers=3,
        transport=TransportConfig(max_idle_connections=50),
        health=HealthConfig(concurrency=7),
        pool=PoolSettings(threads=100),
    )
    assert need(c).total == 50 + 7 + 24 + RESERVE
    assert need(config(workers=1000)).tasks == 32  # pool.threads, not 8,000
    assert need(config(health=HealthConfig(enabled=False))).health == 0


def test_a_soft_limit_too_low_names_the_limit_the_figure_and_the_keys():
    """The error says which limit, its value, what to raise it to, and how to need less."""
    c = config()
    wanted = need(c).total
    with pytest.raises(ConfigError) as caught:
        check(c, lambda: (100, 4096))
    text = str(caught.value)
    assert "RLIMIT_NOFILE" in text and "is 100" in text
    assert f"raise it to at least {wanted}" in text
    assert "transport.max_idle_connections" in text and "health.concurrency" in text
    with pytest.raises(
        ConfigError, match=f"the hard limit is 150: raise both to at least {wanted}"
    ):
        check(c, lambda: (100, 150))
    assert check(c, lambda: (wanted, wanted)).total == wanted
    assert check(c, lambda: (-1, -1)).total == wanted  # unlimited
    assert check(c, lambda: None).total == wanted  # no such limit here
