"""Hostile fleets against a real redis-server and a real headless Chromium: garbage and
markup in other processes' snapshots, many processes, long ids, a narrow window, Redis
killed while the pool publishes."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from npu_sync import WorkerPool
from npu_sync._fleet import monitor_of
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    RetryConfig,
    SharedStateConfig,
    worker_config,
)
from npu_sync.testing import FakeNetwork, FakeRequest, json_response
from npu_sync.transport import Response

from .test_status_page import (  # also skips the module without Chromium
    PAGE,
    By,
    chromium,
    no_sideways_scrolling,
    screenshot,
    serve,
    wait_for,
)

pytestmark = pytest.mark.integration

NAMESPACE = "attack-real"
XSS = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'


def answer(req: FakeRequest) -> Response:
    if req.path == "/health":
        return json_response(200, {"status": "healthy"})
    return json_response(200, {"worker_id": req.worker_id})


def hostile_ids(count: int) -> list[str]:
    """Worker ids as long as the configuration allows, with markup in them."""
    return [f'<b>"w{n:02d}"</b>&amp;' + "x" * 150 + f"-{n}" for n in range(count)]


def make_config(ids: list[str], url: str) -> PoolConfig:
    return PoolConfig(
        workers=tuple(
            worker_config(wid, f"http://127.0.0.1:{9500 + n}/{'p' * 60}", priority=n + 1)
            for n, wid in enumerate(ids)
        ),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=0),
        circuit_breaker=BreakerConfig(fail_max=1, reset_timeout=30),
        shared_state=SharedStateConfig(backend="redis", url=url, namespace=NAMESPACE),
    )


def plant(redis: Any, member: str, text: str) -> None:
    redis.set(f"{{{NAMESPACE}}}:fleet:process:{member}", text, ex=600)
    redis.zadd(f"{{{NAMESPACE}}}:fleet:index", {member: redis.time()[0]})


def other_process(base: dict[str, Any], n: int) -> dict[str, Any]:
    """``base`` as published by process ``n`` of a host whose name carries markup."""
    snap = json.loads(json.dumps(base))
    member = f"h{n}:{1000 + n}:x"
    snap["process"] = {**snap["process"], "id": member, "pid": 1000 + n,
                       "host": f"{XSS}-host-{n % 5}-" + "y" * 120}  # fmt: skip
    return snap


def strict_json(text: str) -> Any:
    """json.loads that refuses NaN and Infinity, as a browser's JSON.parse does."""

    def refuse(name: str) -> Any:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(autouse=True)
def manual(monkeypatch):
    """Samples are taken by the test (tick()), not on the wall clock."""
    monkeypatch.setenv("NPU_SYNC_FLEET", "manual")


@pytest.mark.slow
def test_a_hostile_fleet_renders_escaped_and_fits_1280_and_800_px(
    redis_server, tmp_path
):  # fmt: skip
    """20 workers with long markup ids, 50 processes with markup in their host names, a
    NaN snapshot and a 50 MB one: the page keeps updating, runs none of the markup, lists
    the processes and scrolls sideways neither at 1280 px nor at 800 px."""
    import redis as redis_module

    redis = redis_module.Redis.from_url(redis_server.url)
    ids = hostile_ids(20)
    net = FakeNetwork(answer)
    with WorkerPool(make_config(ids, redis_server.url), transport_factory=net.factory) as pool:
        for _ in range(5):
            pool.execute({})
        monitor = monitor_of(pool)
        monitor.tick()
        base = json.loads(redis.get(f"{{{NAMESPACE}}}:fleet:process:{monitor.process['id']}"))
        for n in range(50):
            plant(redis, f"h{n}:{1000 + n}:x", json.dumps(other_process(base, n)))
        nan = other_process(base, 99)
        nan["history"]["end_at"] = "__NAN__"
        plant(redis, nan["process"]["id"], json.dumps(nan).replace('"__NAN__"', "NaN"))
        big = other_process(base, 98)
        big["pad"] = "z" * (50 * 1024 * 1024)
        plant(redis, big["process"]["id"], json.dumps(big))
        del big

        with serve(pool, refresh_ms=250) as root, chromium(tmp_path / "profile") as driver:
            fleet = strict_json(_get(root + PAGE + "fleet"))
            assert fleet["totals"]["processes"] == 51
            driver.get(root + PAGE)
            # A row per host (five hostile ones and this one), this host's process listed.
            wait_for(
                driver,
                lambda d: len(d.find_elements(By.CSS_SELECTOR, "tr[data-host]")) == 6,
                "6 host rows",
            )
            host_names = [
                r.find_element(By.CSS_SELECTOR, "td span").get_attribute("textContent")
                for r in driver.find_elements(By.CSS_SELECTOR, "tr[data-host]")
            ]
            assert sum(h.startswith(XSS) for h in host_names) == 5
            assert len(driver.find_elements(By.CSS_SELECTOR, "tr[data-process]")) == 1
            # Picking a hostile host lists its ten processes, markup and all as text.
            hostile = next(
                r for r in driver.find_elements(By.CSS_SELECTOR, "tr[data-host]")
                if r.get_attribute("data-host").startswith(XSS)
            )  # fmt: skip
            hostile.click()
            wait_for(
                driver,
                lambda d: len(d.find_elements(By.CSS_SELECTOR, "tr[data-process]")) == 10,
                "the picked host's 10 process rows",
            )
            wait_for(
                driver,
                lambda d: d.find_element(By.ID, "conn").get_attribute("data-state") == "ok",
                "a successful refresh",
            )
            assert len(driver.find_elements(By.CSS_SELECTOR, "tr[data-worker]")) == 20
            assert driver.execute_script("return window.__pwned === undefined")
            assert driver.find_elements(By.CSS_SELECTOR, "main img, main b, main script") == []
            hosts = [
                r.find_element(By.CSS_SELECTOR, "td span").get_attribute("textContent")
                for r in driver.find_elements(By.CSS_SELECTOR, "tr[data-process]")
            ]
            assert sum(h.startswith(XSS) for h in hosts) == 10
            shown_ids = {
                r.find_element(By.CSS_SELECTOR, ".wid").get_attribute("textContent")
                for r in driver.find_elements(By.CSS_SELECTOR, "tr[data-worker]")
            }
            assert shown_ids == set(ids)
            assert no_sideways_scrolling(driver), "sideways scrolling at 1280 px"
            screenshot(driver, tmp_path, "hostile-fleet-1280.png")
            driver.set_window_size(800, 900)
            wait_for(driver, lambda d: d.execute_script("return window.innerWidth") <= 800,
                     "an 800 px window")  # fmt: skip
            assert no_sideways_scrolling(driver), "sideways scrolling at 800 px"
            screenshot(driver, tmp_path, "hostile-fleet-800.png")
            assert driver.execute_script("return window.__pwned === undefined")


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode("utf-8")


def test_redis_killed_while_publishing_neither_fails_a_sample_nor_close(redis_server):
    """Redis dies between samples: the next sample is taken and kept locally, the fleet
    view says Redis is unavailable, tasks go on, and close() returns."""
    ids = ["a", "b"]
    net = FakeNetwork(answer)
    pool = WorkerPool(make_config(ids, redis_server.url), transport_factory=net.factory)
    try:
        monitor = monitor_of(pool)
        pool.execute({})
        monitor.tick()
        assert pool.stats(scope="fleet")["available"] is True
        redis_server.kill()
        # A failed snapshot is not an outage: the sync thread is the one to find out.
        deadline = time.monotonic() + 30
        while pool.stats()["shared_state"]["available"] and time.monotonic() < deadline:
            threading.Event().wait(0.01)
        pool.execute({})
        ticks = monitor.ticks
        monitor.tick()
        assert monitor.ticks == ticks + 1
        assert monitor.history()["tasks"]["succeeded"][-1] == 2
        fleet = pool.stats(scope="fleet")
        assert fleet["available"] is False and "unavailable" in fleet["note"]
        assert fleet["totals"]["tasks"]["succeeded"] == 2
        pool.execute({})
    finally:
        closed = threading.Event()
        closer = threading.Thread(target=lambda: (pool.close(), closed.set()))
        closer.start()
        closer.join(30)
    assert closed.is_set(), "close() hung with Redis gone"
