"""The status page in a real headless Chromium at 1280 px: rows, colours, charts, the
process it shows, a worker killed mid-test."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from flask import Flask
from werkzeug.serving import make_server

import npu_sync._pool as pool_module
from npu_sync import TaskFailed, WorkerPool
from npu_sync._fleet import monitor_of
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    ModelPolicy,
    ModelsConfig,
    PoolConfig,
    RetryConfig,
    SharedStateConfig,
    worker_config,
)
from npu_sync.flask import NpuSync
from npu_sync.testing import FakeClock, FakeNetwork, FakeRequest, json_response
from npu_sync.transport import Response
from tests.workerkit import call

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
PAGE = "/api/npu/pool/"

if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
    pytest.skip(
        f"the browser test needs {CHROMIUM} and {CHROMEDRIVER} "
        "(Debian packages chromium and chromium-driver)",
        allow_module_level=True,
    )

from selenium import webdriver  # noqa: E402 - only once the browser is known to exist
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@contextmanager
def serve(pool: WorkerPool, refresh_ms: int = 500) -> Iterator[str]:
    """Serve a Flask app with the extension on a loopback port; yields its base URL."""
    app = Flask(__name__)
    app.config["NPU_SYNC_REFRESH_MS"] = refresh_ms
    NpuSync(app, pool=pool)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, name="status-page-server")
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@contextmanager
def chromium(profile: pathlib.Path) -> Iterator[WebDriver]:
    """A headless Chromium driven by chromedriver; quit on exit."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--window-size=1280,900",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        driver.set_page_load_timeout(30)
        yield driver
    finally:
        driver.quit()


def rows(driver: WebDriver) -> dict[str, str]:
    """Worker id -> data-state of every row on the page."""
    return {
        row.get_attribute("data-worker"): row.get_attribute("data-state")
        for row in driver.find_elements(By.CSS_SELECTOR, "tr[data-worker]")
    }


def wait_for(driver: WebDriver, condition: Callable[[WebDriver], object], what: str) -> None:
    WebDriverWait(driver, 20, poll_frequency=0.1).until(condition, message=f"waiting for {what}")


def state_colour(driver: WebDriver, worker_id: str) -> tuple[int, int, int]:
    """The computed background colour of a worker's state cell, as (r, g, b)."""
    for row in driver.find_elements(By.CSS_SELECTOR, "tr[data-worker]"):
        if row.get_attribute("data-worker") == worker_id:
            css = row.find_element(By.CSS_SELECTOR, "td.c-state").value_of_css_property(
                "background-color"
            )
            r, g, b = (int(v) for v in re.findall(r"\d+", css)[:3])
            return r, g, b
    raise AssertionError(f"no row for worker {worker_id!r}")


def no_sideways_scrolling(driver: WebDriver) -> bool:
    """The page fits the window's width (1280 px): nothing to scroll sideways to."""
    width, inner = driver.execute_script(
        "return [document.documentElement.scrollWidth, window.innerWidth]"
    )
    return bool(width <= inner)


def chart_points(driver: WebDriver, worker_id: str) -> dict[str, int]:
    """Kind of chart -> steps with data, for one worker's row."""
    for row in driver.find_elements(By.CSS_SELECTOR, "tr[data-worker]"):
        if row.get_attribute("data-worker") == worker_id:
            return {
                spark.get_attribute("data-kind"): int(
                    spark.find_element(By.TAG_NAME, "svg").get_attribute("data-points")
                )
                for spark in row.find_elements(By.CSS_SELECTOR, ".spark")
            }
    raise AssertionError(f"no row for worker {worker_id!r}")


def is_red(rgb: tuple[int, int, int]) -> bool:
    r, g, b = rgb
    return r >= 150 and g <= 100 and b <= 100


def is_green(rgb: tuple[int, int, int]) -> bool:
    r, g, b = rgb
    return g >= 100 and r <= 100 and b <= 100


def is_amber(rgb: tuple[int, int, int]) -> bool:
    r, g, b = rgb
    return r >= 200 and 120 <= g <= 210 and b <= 80


def screenshot(driver: WebDriver, tmp_path: pathlib.Path, name: str) -> pathlib.Path:
    """Save a screenshot in the test's tmp dir, and in $NPU_SYNC_SCREENSHOT_DIR if set."""
    path = tmp_path / name
    assert driver.save_screenshot(str(path)), "screenshot failed"
    target = os.environ.get("NPU_SYNC_SCREENSHOT_DIR")
    if target:
        os.makedirs(target, exist_ok=True)
        shutil.copy(path, os.path.join(target, name))
    return path


def test_a_killed_worker_turns_red_on_the_status_page(start_worker, tmp_path, monkeypatch):
    """The page lists every worker as up with its charts, says it shows this process only,
    fits 1280 px; a worker killed mid-test turns down and red."""
    monkeypatch.setenv("NPU_SYNC_FLEET_INTERVAL", "0.2")
    workers = [start_worker(worker_id=wid) for wid in ("vm2-npu", "windows-npu", "backup-npu")]
    config = PoolConfig(
        workers=tuple(
            worker_config(w.worker_id, w.url, priority=1 if n < 2 else 2)
            for n, w in enumerate(workers)
        ),
        health=HealthConfig(interval=0.2, timeout=0.5, unhealthy_threshold=1),
    )
    with WorkerPool(config) as pool:
        for i in range(12):
            pool.execute({"model_id": "default", "input_text": f"warm-up {i}"})
        with serve(pool) as base, chromium(tmp_path / "profile") as driver:
            driver.get(base + PAGE)
            everyone_up = {"vm2-npu": "up", "windows-npu": "up", "backup-npu": "up"}
            wait_for(driver, lambda d: rows(d) == everyone_up, "every worker to be shown up")
            assert is_green(state_colour(driver, "windows-npu"))
            assert driver.find_element(By.CSS_SELECTOR, '[data-total="tasks.succeeded"]').text == (
                "12"
            )
            note = driver.find_element(By.ID, "scope-note")
            assert note.is_displayed()
            assert note.text.startswith(f"One process only: pid {os.getpid()} on ")
            for i in range(12, 40):
                pool.execute({"model_id": "default", "input_text": f"charted {i}"})
            wait_for(
                driver,
                lambda d: chart_points(d, "vm2-npu")["rate"] >= 3,
                "a few steps of vm2-npu's tasks/s chart",
            )
            assert set(chart_points(driver, "windows-npu")) == {"rate", "p99", "fail"}
            assert no_sideways_scrolling(driver)

            workers[1].kill()
            wait_for(driver, lambda d: rows(d).get("windows-npu") == "down", "windows-npu down")
            assert rows(driver) == {**everyone_up, "windows-npu": "down"}
            assert is_red(state_colour(driver, "windows-npu")), state_colour(driver, "windows-npu")
            assert is_green(state_colour(driver, "vm2-npu"))
            row = next(
                r
                for r in driver.find_elements(By.CSS_SELECTOR, "tr[data-worker]")
                if r.get_attribute("data-worker") == "windows-npu"
            )
            assert "unhealthy" in row.find_element(By.CSS_SELECTOR, "td.c-state").text
            screenshot(driver, tmp_path, "status.png")


def test_states_colours_and_escaping_on_a_fake_network(tmp_path, monkeypatch):
    """Up is green, disabled amber, open breaker red (a red band on its charts too); ids and
    errors render as text only."""
    monkeypatch.setenv("NPU_SYNC_FLEET_INTERVAL", "0.2")
    evil = "<img/src=x/onerror=alert(1)>"
    net = FakeNetwork()
    net.route(evil, lambda req: json_response(503, {"detail": '<b id="injected">boom</b>'}))
    config = PoolConfig(
        workers=(
            worker_config(evil, "http://127.0.0.1:9101"),
            worker_config("fine", "http://127.0.0.1:9102", priority=2),
            worker_config("off", "http://127.0.0.1:9103", enabled=False),
        ),
        health=HealthConfig(enabled=False),
        circuit_breaker=BreakerConfig(fail_max=1),
        retry=RetryConfig(max_retries=0),
    )
    with WorkerPool(config, transport_factory=net.factory, clock=FakeClock()) as pool:
        with pytest.raises(TaskFailed):
            pool.execute({"input_text": "x"})
        with serve(pool, refresh_ms=250) as base, chromium(tmp_path / "profile") as driver:
            driver.get(base + PAGE)
            expected = {evil: "down", "fine": "up", "off": "degraded"}
            wait_for(driver, lambda d: rows(d) == expected, "three rows in their states")
            assert is_red(state_colour(driver, evil))
            assert is_green(state_colour(driver, "fine"))
            assert is_amber(state_colour(driver, "off")), state_colour(driver, "off")
            assert driver.find_elements(By.TAG_NAME, "img") == []
            assert driver.find_elements(By.ID, "injected") == []
            ids = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "td.c-id .wid")]
            assert evil in ids
            wait_for(
                driver,
                lambda d: d.find_elements(By.CSS_SELECTOR, "tr[data-state=down] .band-open"),
                "the open breaker's band on its charts",
            )
            errors = " ".join(e.text for e in driver.find_elements(By.CSS_SELECTOR, "td.c-error"))
            assert '<b id="injected">boom</b>' in errors
            failed = driver.find_element(By.CSS_SELECTOR, '[data-total="tasks.failed"]')
            assert failed.text == "1" and "bad" in failed.get_attribute("class")


def test_fallback_mode_shows_a_banner_with_its_reason(tmp_path, monkeypatch):
    """A default pool standing in for a missing config says so on the page, and why."""
    monkeypatch.chdir(tmp_path)  # no ./npu_workers.yaml here
    fallback = pool_module._build_default({"NPU_WORKER_URL": "http://127.0.0.1:9105"})
    configured = WorkerPool(
        PoolConfig(
            workers=(worker_config("w", "http://127.0.0.1:9106"),),
            health=HealthConfig(enabled=False),
        )
    )
    with fallback, configured, chromium(tmp_path / "profile") as driver:
        with serve(fallback, refresh_ms=250) as base:
            driver.get(base + PAGE)
            banner = driver.find_element(By.ID, "fallback")
            wait_for(driver, lambda d: banner.is_displayed(), "the fallback banner")
            assert banner.text.startswith("Fallback mode: no configuration found")
            assert "http://127.0.0.1:9105 ($NPU_WORKER_URL)" in banner.text
        with serve(configured, refresh_ms=250) as base:
            driver.get(base + PAGE)
            wait_for(driver, lambda d: rows(d) == {"w": "up"}, "the configured worker")
            assert not driver.find_element(By.ID, "fallback").is_displayed()


def test_each_worker_shows_its_name_device_and_models(start_worker, tmp_path, monkeypatch):
    """Under each worker's id the page shows its display name, its device (marked when the
    worker fell back to CPU) and the models it holds, as learnt from the workers."""
    monkeypatch.setenv("NPU_SYNC_FLEET_INTERVAL", "0.2")
    linux = start_worker(worker_id="vm2-npu", models=("llama", "phi"))
    windows = start_worker(
        worker_id="win", protocol="windows", models=("minilm",), npu_available=False
    )
    config = PoolConfig(
        workers=(
            worker_config("vm2-npu", linux.url),
            worker_config("win", windows.url, name="Windows NPU Worker (Main)", platform="windows"),
        ),
        health=HealthConfig(interval=0.2, timeout=0.5),
    )
    with WorkerPool(config) as pool:
        pool.check_health()
        with serve(pool) as base, chromium(tmp_path / "profile") as driver:
            driver.get(base + PAGE)

            def about(d: WebDriver) -> dict[str, str]:
                return {
                    str(r.get_attribute("data-worker")): r.find_element(
                        By.CSS_SELECTOR, "td.c-id small.about"
                    ).text
                    for r in d.find_elements(By.CSS_SELECTOR, "tr[data-worker]")
                }

            wait_for(
                driver,
                lambda d: (
                    "llama, phi" in about(d).get("vm2-npu", "")
                    and "minilm" in about(d).get("win", "")
                ),
                "the workers' models on the page",
            )
            shown = about(driver)
            assert "Windows NPU Worker (Main)" in shown["win"]
            assert "no NPU" in shown["win"]
            assert "no NPU" not in shown["vm2-npu"]
            assert no_sideways_scrolling(driver)
            screenshot(driver, tmp_path, "status-models.png")


def model_table(driver: WebDriver) -> dict[str, dict[str, str]]:
    """Model id -> the text of each cell of its row in the models table (by its class),
    and whether the row is marked below its min."""
    table = {}
    for row in driver.find_elements(By.CSS_SELECTOR, "#models tr[data-model]"):
        cells = {
            str(td.get_attribute("class")).split()[0].removeprefix("c-"): td.text
            for td in row.find_elements(By.TAG_NAME, "td")
        }
        cells["below"] = str(row.get_attribute("data-below"))
        table[str(row.get_attribute("data-model"))] = cells
    return table


def test_the_models_table_shows_holders_load_replicas_and_targets(
    start_worker, tmp_path, monkeypatch
):
    """Per model held or in the catalog the page shows the workers holding it, its
    inferences as they count them and their rate, its live replicas and targets (below
    min marked), and each worker's reported cap; a model id with markup is text, and a
    worker's credentials never reach the page."""
    monkeypatch.setenv("NPU_SYNC_FLEET_INTERVAL", "0.2")
    evil = '<img src=x onerror="window.__pwned=1">'
    secret = "status-page-bearer-secret-26"
    a = start_worker(worker_id="a", models=("llama", "e5", evil), max_models=3)
    b = start_worker(worker_id="b", models=("e5",), bearer_token=secret)
    config = PoolConfig(
        workers=(
            worker_config("a", a.url),
            worker_config("b", b.url, auth={"type": "bearer", "token": secret}),
        ),
        health=HealthConfig(interval=0.2, timeout=0.5),
        models=ModelsConfig(catalog={"llama": ModelPolicy(2, 3), "whisper": ModelPolicy(1, None)}),
    )
    with WorkerPool(config) as pool:
        pool.check_health()
        for i in range(4):
            pool.execute({"model_id": "e5", "input_text": f"e5 {i}"})
        stop = threading.Event()

        def busy() -> None:
            while not stop.is_set():
                pool.execute({"model_id": "llama", "input_text": "busy"})

        caller = threading.Thread(target=busy, name="llama-caller")
        caller.start()
        try:
            with serve(pool) as base, chromium(tmp_path / "profile") as driver:
                driver.get(base + PAGE)
                wait_for(
                    driver,
                    lambda d: (
                        model_table(d).get("llama", {}).get("rate", "").endswith("/s")
                        and model_table(d)["llama"]["rate"] != "0.00/s"
                    ),
                    "a rate for llama while its tasks run",
                )
                stop.set()
                caller.join(30)
                counted = call(a, "GET", "/models").json["loaded_models"]
                llama = str(counted["llama"]["inference_count"])
                wait_for(
                    driver,
                    lambda d: model_table(d)["llama"]["inferences"] == llama,
                    f"llama's {llama} inferences on the page",
                )
                table = model_table(driver)
                assert set(table) == {"llama", "e5", "whisper", evil}
                assert table["llama"] == {
                    "model": "llama",
                    "holders": "a",
                    "inflight": "\u2013",  # counted with models.balance only
                    "inferences": llama,
                    "rate": table["llama"]["rate"],
                    "replicas": "1",
                    "targets": "min 2 \u00b7 max 3 \u00b7 below min",
                    "below": "true",
                }
                assert (table["e5"]["holders"], table["e5"]["replicas"]) == ("a, b", "2")
                assert table["e5"]["targets"] == "\u2013" and table["e5"]["below"] == "false"
                assert (table["whisper"]["holders"], table["whisper"]["inferences"]) == (
                    "none",
                    "\u2013",
                )
                assert table["whisper"]["targets"] == "min 1 \u00b7 below min"
                assert table[evil]["model"] == evil and table[evil]["holders"] == "a"
                assert driver.find_elements(By.CSS_SELECTOR, "main img") == []
                assert driver.execute_script("return window.__pwned === undefined")
                about = next(
                    r.find_element(By.CSS_SELECTOR, "small.about").text
                    for r in driver.find_elements(By.CSS_SELECTOR, "tr[data-worker]")
                    if r.get_attribute("data-worker") == "a"
                )
                assert "at most 3 models" in about
                assert secret not in driver.page_source
                assert secret not in _get(base + PAGE + "stats")
                assert no_sideways_scrolling(driver)
                screenshot(driver, tmp_path, "status-per-model.png")
        finally:
            stop.set()
            caller.join(30)


# Attacks: a hostile fleet against a real redis-server and the page — garbage and markup in
# other processes' snapshots, many processes, long ids, a narrow window.


NAMESPACE = "attack-real"


XSS = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'


@pytest.fixture
def manual(monkeypatch):
    """Samples are taken by the test (tick()), not on the wall clock (the attacks below ask
    for it; the page's own tests sample on the wall clock)."""
    monkeypatch.setenv("NPU_SYNC_FLEET", "manual")


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


@pytest.mark.slow
@pytest.mark.usefixtures("manual")
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


# Attacks: Redis killed while the pool publishes its snapshots.


@pytest.mark.usefixtures("manual")
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
