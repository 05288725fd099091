"""Four gunicorn processes behind one port, as a user deploys them: the Flask extension
with NPU_SYNC_PROMETHEUS, contrib/gunicorn.conf.py (multiprocess Prometheus, child_exit),
shared state in a real Redis. Scraped counters never go back, the fleet's totals equal the
tasks sent, a killed child drops out of the fleet after its TTL, and the status page shows
the fleet with its charts in Chromium."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import npu_sync

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = pathlib.Path(npu_sync.__file__).resolve().parent.parent
CONF = ROOT / "contrib" / "gunicorn.conf.py"
PREFIX = "/api/npu/pool"
PROCESSES = 4
TASKS = 240
TTL = 1.5

APP = """
import os

from flask import Flask, request

from npu_sync.flask import NpuSync, current_pool


def create_app():
    app = Flask(__name__)
    app.config["NPU_SYNC_CONFIG"] = os.environ["NPU_SYNC_CONFIG"]
    app.config["NPU_SYNC_WATCH"] = False
    app.config["NPU_SYNC_REFRESH_MS"] = 300
    NpuSync(app)

    @app.post("/analyze")
    def analyze():
        text = request.get_json()["text"]
        result = current_pool().execute({"model_id": "default", "input_text": text})
        return {"pid": os.getpid(), "worker": result["worker_id"]}

    return app
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, timeout: float = 10) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return bytes(response.read())


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return dict(json.loads(response.read()))


def counters(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every counter and histogram-count sample of a scrape: (name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        if family.type in ("counter", "histogram")
        for s in family.samples
        if s.name.endswith(("_total", "_count", "_bucket"))
    }


def until(condition: Callable[[], Any], what: str, timeout: float = 20) -> Any:
    """Poll ``condition`` until it returns something true; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        threading.Event().wait(0.05)


@pytest.fixture
def gunicorn(tmp_path, redis_server, start_worker) -> Iterator[dict[str, Any]]:
    """gunicorn with contrib/gunicorn.conf.py, four processes, on a loopback port."""
    workers = [start_worker(worker_id=f"npu-{n}", latency_ms=2) for n in range(3)]
    config = tmp_path / "npu_workers.yaml"
    config.write_text(
        "npu_workers:\n  workers:\n"
        + "".join(f"    - {{id: {w.worker_id}, url: '{w.url}'}}\n" for w in workers)
        + "  health: {interval: 1, timeout: 1}\n"
        + f"  shared_state: {{backend: redis, url: '{redis_server.url}', namespace: gfleet}}\n"
    )
    (tmp_path / "fleet_app.py").write_text(textwrap.dedent(APP))
    metrics_dir = tmp_path / "prometheus"
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "NPU_SYNC_CONFIG": str(config),
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
        "GUNICORN_BIND": f"127.0.0.1:{port}",
        "GUNICORN_WORKERS": str(PROCESSES),
        "GUNICORN_THREADS": "4",
        "NPU_SYNC_FLEET_INTERVAL": "0.25",
        "NPU_SYNC_FLEET_TTL": str(TTL),
        "TMPDIR": str(tmp_path),  # the dead-letter spool's default directory
    }
    env.pop("NPU_SYNC_PROMETHEUS", None)  # the conf file's default must do it
    log_path = tmp_path / "gunicorn.log"
    log = log_path.open("w")
    master = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "-c", str(CONF), "--chdir", str(tmp_path),
         "fleet_app:create_app()"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"

    def fleet() -> dict[str, Any]:
        return dict(json.loads(get(base + PREFIX + "/fleet")))

    def answering() -> dict[str, Any] | None:
        assert master.poll() is None, log_path.read_text()
        try:
            view = fleet()
        except OSError:
            return None
        return view if view["totals"]["processes"] == PROCESSES else None

    try:
        until(answering, f"gunicorn to start and its {PROCESSES} processes to publish", 60)
        yield {
            "base": base,
            "master": master,
            "fleet": fleet,
            "metrics_dir": metrics_dir,
            "log": log_path,
        }
    finally:
        if master.poll() is None:
            master.send_signal(signal.SIGTERM)
            try:
                master.wait(timeout=30)
            except subprocess.TimeoutExpired:
                master.kill()
                master.wait()
        log.close()


def test_gunicorn_fleet_metrics_and_status_page(gunicorn, tmp_path):
    """Under load, every scrape's counters are at least the previous scrape's; after it,
    the scrape and the fleet both count exactly the tasks sent; a SIGKILLed child leaves
    the fleet after its TTL while its counters stay; the page shows the fleet's charts."""
    base, fleet = gunicorn["base"], gunicorn["fleet"]
    scrapes: list[dict] = []
    stop = threading.Event()

    def scrape_forever() -> None:
        while not stop.is_set():
            scrapes.append(counters(get(base + PREFIX + "/metrics").decode()))

    scraper = threading.Thread(target=scrape_forever, name="scraper")
    scraper.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as callers:
            answers = list(
                callers.map(lambda n: post(base + "/analyze", {"text": f"task {n}"}), range(TASKS))
            )
    finally:
        stop.set()
        scraper.join(timeout=30)
    served_by = {a["pid"] for a in answers}
    assert len(served_by) >= 2, served_by  # the tasks really were spread over processes

    final = counters(get(base + PREFIX + "/metrics").decode())
    scrapes.append(final)
    assert len(scrapes) >= 5
    for before, after in itertools.pairwise(scrapes):
        went_back = {k: (v, after.get(k)) for k, v in before.items() if after.get(k, 0) < v}
        assert not went_back, went_back
    succeeded = ("npu_sync_tasks_total", (("outcome", "succeeded"),))
    assert final[succeeded] == TASKS
    attempts = sum(
        v for (name, labels), v in final.items()
        if name == "npu_sync_attempts_total" and ("outcome", "succeeded") in labels
    )  # fmt: skip
    assert attempts == TASKS

    view = until(
        lambda: (v := fleet())["totals"]["tasks"]["succeeded"] == TASKS and v,
        "the fleet's totals to count every task",
    )
    assert view["shared"] and view["available"]
    assert view["totals"]["processes"] == PROCESSES
    assert sum(p["tasks"]["succeeded"] for p in view["processes"]) == TASKS
    assert sum(p["this_process"] for p in view["processes"]) == 1
    pids = {p["process"]["pid"] for p in view["processes"]}
    assert served_by <= pids and gunicorn["master"].pid not in pids

    # SIGKILL: the child cannot close its pool nor withdraw its snapshot.
    victim = next(p for p in view["processes"] if p["tasks"]["succeeded"] > 0)
    victim_pid = victim["process"]["pid"]
    os.kill(victim_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    gone = until(
        lambda: (
            (v := fleet()) and victim_pid not in {p["process"]["pid"] for p in v["processes"]} and v
        ),
        "the killed child to drop out of the fleet",
        timeout=TTL + 15,
    )
    assert time.monotonic() - killed_at >= TTL - 0.5  # its snapshot lived out its TTL
    survivors = [p for p in gone["processes"] if p["process"]["pid"] != victim_pid]
    assert gone["totals"]["tasks"]["succeeded"] == sum(p["tasks"]["succeeded"] for p in survivors)
    # gunicorn's child_exit marked it dead: its gauges are gone, its counters stay.
    until(
        lambda: not list(gunicorn["metrics_dir"].glob(f"gauge_live*_{victim_pid}.db")),
        "child_exit to remove the killed child's gauge files",
    )
    assert list(gunicorn["metrics_dir"].glob(f"counter_{victim_pid}.db"))
    after_kill = counters(get(base + PREFIX + "/metrics").decode())
    assert after_kill[succeeded] == TASKS
    # gunicorn replaces the child; the new process joins the fleet.
    until(
        lambda: fleet()["totals"]["processes"] == PROCESSES,
        "the replacement child to join the fleet",
    )

    check_status_page(base, tmp_path)


def check_status_page(base: str, tmp_path: pathlib.Path) -> None:
    """The page at 1280 px: the fleet's processes listed, every worker charted, no
    sideways scrolling."""
    if not (os.path.exists("/usr/bin/chromium") and os.path.exists("/usr/bin/chromedriver")):
        pytest.skip("the browser check needs /usr/bin/chromium and /usr/bin/chromedriver")
    from selenium.webdriver.common.by import By

    from tests.integration import test_status_page as page

    with page.chromium(tmp_path / "profile") as driver:
        driver.get(base + PREFIX + "/")
        page.wait_for(
            driver,
            lambda d: (
                len(d.find_elements(By.CSS_SELECTOR, "#processes tr[data-process]")) == PROCESSES
            ),
            f"{PROCESSES} processes listed",
        )
        scope = driver.find_element(By.ID, "scope")
        assert scope.get_attribute("data-shared") == "true"
        assert scope.text.startswith(f"fleet · {PROCESSES} processes")
        assert not driver.find_element(By.ID, "scope-note").is_displayed()
        this_page = driver.find_elements(By.CSS_SELECTOR, '#processes tr[data-this="true"]')
        assert len(this_page) == 1
        badges = driver.find_elements(By.CSS_SELECTOR, "#processes .badge")
        assert [b.is_displayed() for b in badges].count(True) == 1
        assert set(page.rows(driver)) == {"npu-0", "npu-1", "npu-2"}
        page.wait_for(
            driver,
            lambda d: all(
                page.chart_points(d, wid)["rate"] >= 2 for wid in ("npu-0", "npu-1", "npu-2")
            ),
            "every worker's tasks/s chart to have steps",
        )
        assert page.no_sideways_scrolling(driver)
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1280, height + 120)
        page.screenshot(driver, tmp_path, "status-fleet.png")
