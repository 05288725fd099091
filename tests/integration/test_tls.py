"""HTTPS workers: verified with a CA the test generates, refused without it."""

from __future__ import annotations

import pytest

from npu_sync import NoWorkerAvailable, TaskFailed, WorkerPool
from npu_sync.config import HealthConfig, PoolConfig, RetryConfig, TLSConfig, worker_config

trustme = pytest.importorskip("trustme")
pytestmark = pytest.mark.integration


@pytest.fixture
def https_worker(start_worker, tmp_path):
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert_path, key_path, ca_path = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    cert.cert_chain_pems[0].write_to_path(str(cert_path))
    cert.private_key_pem.write_to_path(str(key_path))
    ca.cert_pem.write_to_path(str(ca_path))
    worker = start_worker(worker_id="tls", tls_cert=cert_path, tls_key=key_path)
    return worker, str(ca_path)


def _pool(worker, tls: TLSConfig) -> WorkerPool:
    config = PoolConfig(
        workers=(worker_config("tls", worker.url, tls=tls),),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=0),
    )
    return WorkerPool(config)


def test_https_worker_verified_with_the_generated_ca(https_worker):
    """A pool trusting the test's CA runs tasks on the HTTPS worker."""
    worker, ca_path = https_worker
    assert worker.url.startswith("https://")
    with _pool(worker, TLSConfig(verify=ca_path)) as pool:
        assert pool.execute({"input_text": "secure"})["worker_id"] == "tls"


def test_https_worker_refused_when_its_certificate_is_not_trusted(https_worker):
    """With the system CAs only, the self-signed chain fails the task into dead letters."""
    worker, _ = https_worker
    with _pool(worker, TLSConfig(verify=True)) as pool:
        with pytest.raises(TaskFailed) as info:
            pool.execute({"input_text": "secure"})
        assert not isinstance(info.value, NoWorkerAvailable)
        assert (
            "tls" in (info.value.attempts[0].error or "").lower()
            or "certificate" in (info.value.attempts[0].error or "").lower()
        )
        assert len(pool.dead_letters) == 1
