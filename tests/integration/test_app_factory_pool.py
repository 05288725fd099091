"""The app-factory pattern of docs/deployment.md: one pool per process, whoever asks."""

from __future__ import annotations

import logging

import pytest
from flask import Flask

import npu_sync._pool as pool_module
from npu_sync import WorkerPool, get_pool, npu_task
from npu_sync.flask import NpuSync, current_pool

pytestmark = pytest.mark.integration


@pytest.fixture
def no_default(monkeypatch):
    """This test's own process-wide default pool, closed after it."""
    monkeypatch.setattr(pool_module, "_default_pool", None)
    yield
    if pool_module._default_pool is not None:
        pool_module._default_pool.close()


def write_config(tmp_path, worker) -> str:
    path = tmp_path / "npu_workers.yaml"
    path.write_text(f"npu_workers:\n  workers:\n    - {{id: w, url: '{worker.url}'}}\n")
    return str(path)


@npu_task()
def analyze(text: str) -> dict[str, object]:
    return {"model_id": "default", "input_text": text}


def create_app(path: str) -> Flask:
    app = Flask(__name__)
    app.config.update(NPU_SYNC_CONFIG=path, NPU_SYNC_WATCH=False)
    NpuSync(app)

    @app.get("/analyze")
    def view() -> dict[str, object]:
        return analyze("hello")

    return app


def test_npu_task_without_a_pool_runs_on_the_pool_the_app_built(start_worker, tmp_path, no_default):
    """With NPU_SYNC_CONFIG, @npu_task() and get_pool() use the extension's pool, so the
    decorator's tasks show on the app's status page and metrics; no second pool."""
    worker = start_worker(worker_id="w")
    app = create_app(write_config(tmp_path, worker))
    with app.app_context():
        built = current_pool()
    try:
        client = app.test_client()
        for _ in range(3):
            assert client.get("/analyze").get_json()["worker_id"] == "w"
        assert get_pool() is built
        assert built.stats()["tasks"]["succeeded"] == 3
    finally:
        built.close()


def test_a_default_pool_built_first_is_kept_and_the_second_pool_is_warned_about(
    start_worker, tmp_path, no_default, caplog
):
    """When get_pool() built the default before the app loaded its file, the default is
    left alone and a warning says the process has two pools."""
    worker = start_worker(worker_id="w")
    path = write_config(tmp_path, worker)
    first = WorkerPool.from_yaml(path, watch=False)
    pool_module._default_pool = first
    caplog.set_level(logging.WARNING, logger="npu_sync._pool")
    app = create_app(path)
    with app.app_context():
        built = current_pool()
    try:
        assert built is not first and get_pool() is first
        (warning,) = [r.getMessage() for r in caplog.records if r.name == "npu_sync._pool"]
        assert warning.startswith("this process has two pools:")
        assert "NPU_SYNC_CONFIG" in warning
    finally:
        built.close()
