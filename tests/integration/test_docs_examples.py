"""Every Python example in docs/ runs, so the docs cannot rot.

Each block runs in a fresh interpreter, in a directory holding an npu_workers.yaml
that points at two live reference workers (ids vm2-npu and backup-npu). Blocks that
define pytest tests are run with pytest.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def examples() -> list[pytest.param]:
    found = []
    for path in sorted(DOCS.glob("*.md")):
        for n, code in enumerate(BLOCK.findall(path.read_text()), 1):
            found.append(pytest.param(code, id=f"{path.name}#{n}"))
    return found


@pytest.fixture(scope="module")
def workers_yaml(tmp_path_factory):
    from npu_sync.worker_server import LocalWorker

    started = [LocalWorker(worker_id=i).start() for i in ("vm2-npu", "backup-npu")]
    directory = tmp_path_factory.mktemp("docs")
    (directory / "npu_workers.yaml").write_text(
        "npu_workers:\n  workers:\n"
        f"    - {{id: vm2-npu, url: '{started[0].url}', priority: 1}}\n"
        f"    - {{id: backup-npu, url: '{started[1].url}', priority: 2}}\n"
    )
    yield directory
    for worker in started:
        worker.stop()


@pytest.mark.parametrize("code", examples())
def test_documented_example_runs(code, workers_yaml, tmp_path):
    """The example exits cleanly (its tests pass, when it is a test module)."""
    env = {**os.environ, "NPU_SYNC_CONFIG": str(workers_yaml / "npu_workers.yaml")}
    if re.search(r"^def test_", code, re.M):
        module = tmp_path / "test_example.py"
        module.write_text(code)
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(module)]
    else:
        command = [sys.executable, "-c", code]
    proc = subprocess.run(
        command, cwd=workers_yaml, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
