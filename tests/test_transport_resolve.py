"""The bounded resolver: waits no longer than the caller's budget, caches, shares."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from npu_sync.transport._resolve import BoundedResolver, ResolveError, ResolveTimeout

ADDRESS = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 8081))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Lookups:
    """A lookup that counts its calls and can be held until released."""

    def __init__(self, *, hold: bool = False, fail: bool = False) -> None:
        self.calls: list[str] = []
        self.release = threading.Event()
        self.started = threading.Event()
        if not hold:
            self.release.set()
        self.fail = fail

    def __call__(self, host: str, port: int) -> list[Any]:
        self.calls.append(host)
        self.started.set()
        self.release.wait(5)
        if self.fail:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [ADDRESS]


def far() -> float:
    return time.monotonic() + 5.0


def test_ip_literals_are_never_looked_up():
    """IPv4 and IPv6 addresses come back at once without calling the lookup."""
    lookup = Lookups()
    resolver = BoundedResolver(lookup)
    (v4,) = resolver.resolve("10.1.2.3", 80, far())
    (v6,) = resolver.resolve("::1", 443, far())
    assert (v4[0], v4[4]) == (socket.AF_INET, ("10.1.2.3", 80))
    assert (v6[0], v6[4][:2]) == (socket.AF_INET6, ("::1", 443))
    assert lookup.calls == []


def test_answers_are_cached_until_the_ttl_passes():
    """A name is looked up once per TTL; after it expires, once more."""
    lookup = Lookups()
    clock = Clock()
    resolver = BoundedResolver(lookup, ttl=10.0, clock=clock)
    assert resolver.resolve("npu", 8081, far()) == [ADDRESS]
    clock.now += 9.0
    assert resolver.resolve("npu", 8081, far()) == [ADDRESS]
    assert lookup.calls == ["npu"]
    clock.now += 2.0
    resolver.resolve("npu", 8081, far())
    assert lookup.calls == ["npu", "npu"]


def test_failures_are_not_cached():
    """A failed lookup raises ResolveError and the next call asks again."""
    lookup = Lookups(fail=True)
    resolver = BoundedResolver(lookup)
    for _ in range(2):
        with pytest.raises(ResolveError) as info:
            resolver.resolve("nowhere", 80, far())
        assert isinstance(info.value.cause, socket.gaierror)
    assert lookup.calls == ["nowhere", "nowhere"]


def test_a_slow_lookup_gives_up_at_the_deadline_and_still_fills_the_cache():
    """The caller stops waiting at its deadline; the answer, when it comes, is kept."""
    lookup = Lookups(hold=True)
    resolver = BoundedResolver(lookup)
    with pytest.raises(ResolveTimeout):
        resolver.resolve("slow", 80, time.monotonic() + 0.05)
    lookup.release.set()
    assert resolver.resolve("slow", 80, far()) == [ADDRESS]
    assert lookup.calls == ["slow"]


def test_callers_asking_for_the_same_name_share_one_lookup():
    """Concurrent callers for one name wait on the same lookup instead of each asking."""
    lookup = Lookups(hold=True)
    resolver = BoundedResolver(lookup)
    results: list[Any] = []
    callers = [
        threading.Thread(target=lambda: results.append(resolver.resolve("npu", 80, far())))
        for _ in range(4)
    ]
    for caller in callers:
        caller.start()
    assert lookup.started.wait(5)
    lookup.release.set()
    for caller in callers:
        caller.join()
    assert results == [[ADDRESS]] * 4
    assert lookup.calls == ["npu"]


def test_an_empty_answer_is_a_failure():
    """A lookup that returns no address is a ResolveError, not an empty list."""
    resolver = BoundedResolver(lambda host, port: [])
    with pytest.raises(ResolveError):
        resolver.resolve("empty", 80, far())
