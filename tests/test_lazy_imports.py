"""``import npu_sync`` stays light: the heavy libraries load when what needs them is built.

Each check runs in a fresh interpreter, since this test process has long imported
everything.
"""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

import npu_sync
from npu_sync.transport._base import user_agent
from npu_sync.worker_server import LocalWorker

ROOT = pathlib.Path(npu_sync.__file__).parent.parent

# Imported by npu_sync only when something that needs them is built or asked for.
DEFERRED = (
    "importlib.metadata",  # npu_sync.__version__, the transports' User-Agent
    "npu_sync._otel",  # a pool with tracing.opentelemetry on
    "opentelemetry",  # the same (and redis >= 7, which pybreaker imports, when installed)
    "pybreaker",  # the first breaker (a pool being built)
    "redis",  # pybreaker imports it when installed; shared state
    "requests",  # transport.client: requests
    "tenacity",  # the first retry policy (a pool being built)
    "urllib3",  # transport.client: urllib3 or requests
    "watchdog",  # a pool watching its file
    "yaml",  # reading a configuration file
)

REPORT = """
import json as _json, sys as _sys
print(_json.dumps({"loaded": [m for m in DEFERRED if m in _sys.modules],
                   "result": globals().get("result")}))
"""

POOL_FROM_YAML = """
import pathlib, sys, tempfile
import npu_sync
with tempfile.TemporaryDirectory() as scratch:
    path = pathlib.Path(scratch, "npu_workers.yaml")
    path.write_text(
        "npu_workers:\\n"
        f"  workers: [{{id: w1, url: '{sys.argv[1]}'}}]\\n"
        "  health: {enabled: false}\\n"
        + (f"  transport: {{client: {sys.argv[2]}}}\\n" if sys.argv[2] != "default" else "")
    )
    with npu_sync.WorkerPool.from_yaml(path) as pool:
        result = pool.execute({"model_id": "default", "input_text": "hi"})
"""


def fresh(code: str, *args: str) -> dict[str, object]:
    """Run ``code`` in a new interpreter; which of DEFERRED it loaded, and its
    ``result`` variable."""
    script = f"DEFERRED = {DEFERRED!r}\n" + textwrap.dedent(code) + REPORT
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return report


@pytest.fixture(scope="module")
def worker() -> Iterator[LocalWorker]:
    """One reference worker in its own process."""
    with LocalWorker(worker_id="w1").start() as local:
        yield local


def test_import_npu_sync_loads_none_of_the_heavy_libraries():
    """No HTTP client library, pybreaker, redis, tenacity, watchdog, PyYAML or
    importlib.metadata after ``import npu_sync``."""
    assert fresh("import npu_sync")["loaded"] == []


def test_the_modules_that_own_the_libraries_import_lightly():
    """breaker, retry, reload, config and transport, the homes of pybreaker, tenacity,
    watchdog, PyYAML and the HTTP clients, import without them (shared, the home of
    redis, is imported only with shared state)."""
    code = """
    import npu_sync._breaker, npu_sync.config, npu_sync._pool, npu_sync._reload
    import npu_sync._retry, npu_sync.transport
    """
    assert fresh(code)["loaded"] == []


def test_a_pool_on_the_default_client_never_loads_requests_or_urllib3(worker):
    """A pool built from a file on the built-in client runs a task without requests or
    urllib3; what the pool needs was loaded as it was built."""
    report = fresh(POOL_FROM_YAML, worker.url, "default")
    assert isinstance(report["result"], dict) and report["result"]["model_id"] == "default"
    loaded = set(report["loaded"])  # type: ignore[arg-type]
    assert loaded & {"requests", "urllib3", "npu_sync._otel"} == set()
    assert {"yaml", "pybreaker", "tenacity", "watchdog"} <= loaded


def test_a_pool_on_urllib3_loads_urllib3_and_not_requests(worker):
    """transport.client: urllib3 still works, and does not load requests."""
    report = fresh(POOL_FROM_YAML, worker.url, "urllib3")
    assert isinstance(report["result"], dict) and report["result"]["model_id"] == "default"
    loaded = set(report["loaded"])  # type: ignore[arg-type]
    assert "urllib3" in loaded
    assert "requests" not in loaded


def test_a_pool_on_requests_loads_requests(worker):
    """transport.client: requests still works once its module is imported on demand."""
    report = fresh(POOL_FROM_YAML, worker.url, "requests")
    assert isinstance(report["result"], dict) and report["result"]["model_id"] == "default"
    assert {"requests", "urllib3"} <= set(report["loaded"])  # type: ignore[arg-type]


def test_the_version_is_read_from_the_package_metadata_when_asked_for():
    """``npu_sync.__version__`` (and the User-Agent) is the installed distribution's
    version, read on first use: importlib.metadata is loaded by asking, not by
    importing."""
    code = """
    import sys
    import npu_sync
    assert "importlib.metadata" not in sys.modules
    result = npu_sync.__version__
    """
    report = fresh(code)
    version = importlib.metadata.version("npu_sync")
    assert report["result"] == version
    assert report["loaded"] == ["importlib.metadata"]
    assert npu_sync.__version__ == version
    assert user_agent() == f"npu-sync/{version}"


def test_the_urllib3_and_requests_classes_are_named_on_demand():
    """``npu_sync.transport.Urllib3Transport`` and ``RequestsTransport`` load their
    module when first named, and nothing else is an attribute by accident."""
    code = """
    import npu_sync.transport as transport
    result = [transport.Urllib3Transport.__module__]
    import sys
    result.append("requests" in sys.modules)
    result.append(transport.RequestsTransport.__module__)
    try:
        transport.Nothing
    except AttributeError:
        result.append("AttributeError")
    """
    assert fresh(code)["result"] == [
        "npu_sync.transport._urllib3",
        False,
        "npu_sync.transport._requests",
        "AttributeError",
    ]
