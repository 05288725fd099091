"""get_pool(): the process-wide default pool and its single-worker fallback."""

from __future__ import annotations

import logging

import pytest

import npu_sync._pool as pool_module
from npu_sync import WorkerPool, get_pool


@pytest.fixture(autouse=True)
def fresh_default(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NPU_SYNC_CONFIG", raising=False)
    monkeypatch.delenv("NPU_WORKER_URL", raising=False)
    monkeypatch.setattr(pool_module, "_default_pool", None)
    yield
    if pool_module._default_pool is not None:
        pool_module._default_pool.close()


def test_config_from_environment_variable(monkeypatch, tmp_path):
    """$NPU_SYNC_CONFIG names the YAML the default pool is built from."""
    path = tmp_path / "conf.yaml"
    path.write_text("npu_workers:\n  workers:\n    - {id: env-w, url: 'http://127.0.0.1:9001'}\n")
    monkeypatch.setenv("NPU_SYNC_CONFIG", str(path))
    pool = get_pool()
    assert [w["id"] for w in pool.workers()] == ["env-w"]
    assert get_pool() is pool


def test_npu_workers_yaml_in_the_working_directory(tmp_path):
    """Without the variable, ./npu_workers.yaml is used."""
    (tmp_path / "npu_workers.yaml").write_text(
        "npu_workers:\n  workers:\n    - {id: local-w, host: 127.0.0.1, port: 9002}\n"
    )
    assert [w["url"] for w in get_pool().workers()] == ["http://127.0.0.1:9002"]


def test_single_worker_compatibility_mode_is_logged(monkeypatch, caplog):
    """With no config at all, one worker at $NPU_WORKER_URL, and a warning says so."""
    monkeypatch.setenv("NPU_WORKER_URL", "http://127.0.0.1:9003")
    with caplog.at_level(logging.WARNING, logger="npu_sync._pool"):
        pool = get_pool()
    assert [w["url"] for w in pool.workers()] == ["http://127.0.0.1:9003"]
    assert "single worker at http://127.0.0.1:9003" in caplog.text


def test_fallback_mode_shows_in_stats_with_its_reason(monkeypatch):
    """A pool standing in for a missing config says so in stats(), and why."""
    monkeypatch.setenv("NPU_WORKER_URL", "http://127.0.0.1:9004")
    fallback = get_pool().stats()["fallback"]
    assert fallback["active"] is True
    assert "no configuration found" in fallback["reason"]
    assert "http://127.0.0.1:9004 ($NPU_WORKER_URL)" in fallback["reason"]


def test_a_configured_pool_is_not_in_fallback_mode(tmp_path):
    """A pool built from ./npu_workers.yaml reports fallback inactive, with no reason."""
    (tmp_path / "npu_workers.yaml").write_text(
        "npu_workers:\n  workers:\n    - {id: local-w, host: 127.0.0.1, port: 9002}\n"
    )
    assert get_pool().stats()["fallback"] == {"active": False, "reason": None}


def test_default_url_is_the_autobot_port():
    """The fallback worker defaults to http://127.0.0.1:8081."""
    assert [w["url"] for w in get_pool().workers()] == ["http://127.0.0.1:8081"]


def test_a_closed_default_pool_is_rebuilt():
    """After the default pool is closed, get_pool() builds a new one."""
    first = get_pool()
    first.close()
    second = get_pool()
    assert second is not first and isinstance(second, WorkerPool) and not second.closed
