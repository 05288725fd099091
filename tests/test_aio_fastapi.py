"""The FastAPI example of docs/async.md, run as written through an ASGI client."""

from __future__ import annotations

import asyncio
import pathlib
import re
import threading
from typing import Any

import pytest

from npu_sync.worker_server import LocalWorker

fastapi = pytest.importorskip(
    "fastapi", reason="FastAPI is not installed (pip install -e '.[test]')"
)
httpx = pytest.importorskip("httpx", reason="httpx is not installed (pip install -e '.[test]')")

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "async.md"


def example() -> str:
    """The first Python block after the "## FastAPI" heading of docs/async.md."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("\n## FastAPI\n", 1)[1]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found is not None, "docs/async.md has no FastAPI example"
    return found.group(1)


def load_app() -> Any:
    namespace: dict[str, Any] = {"__name__": "npu_fastapi_example"}
    exec(compile(example(), str(DOC), "exec"), namespace)
    return namespace["app"]


def test_the_fastapi_example_answers_from_a_worker_and_maps_failures(tmp_path, monkeypatch):
    """The documented app answers from a real worker, returns 503 naming the dead
    letter when no worker answers, shares one pool's stats, and closes its pool and
    threads with the application's lifespan."""
    with LocalWorker(worker_id="vm2-npu").start() as worker:
        monkeypatch.chdir(tmp_path)
        (tmp_path / "npu_workers.yaml").write_text(
            "npu_workers:\n"
            f"  workers: [{{id: vm2-npu, url: '{worker.url}', max_concurrent: 4}}]\n"
            "  health: {enabled: false}\n"
            "  retry: {max_retries: 1, backoff_initial: 0.01, backoff_max: 0.01}\n"
            "  dead_letter: {backend: memory}\n"
        )
        app = load_app()

        async def main() -> dict[str, Any]:
            transport = httpx.ASGITransport(app=app)
            client = httpx.AsyncClient(transport=transport, base_url="http://npu")
            async with app.router.lifespan_context(app), client:
                ok = await client.post("/analyze", json={"text": "hello world"})
                assert ok.status_code == 200, ok.text
                assert ok.json()["worker"] == "vm2-npu"
                assert ok.json()["response"].endswith(": hello world")
                many = await asyncio.gather(
                    *(client.post("/analyze", json={"text": f"t{i}"}) for i in range(20))
                )
                assert [r.status_code for r in many] == [200] * 20
                worker.kill()
                down = await client.post("/analyze", json={"text": "x"})
                stats = (await client.get("/npu/stats")).json()
                pool = app.state.npu.pool
            assert pool.closed and app.state.npu.closed
            return {"down": down, "stats": stats}

        ended = asyncio.run(main())
    down = ended["down"]
    assert down.status_code == 503
    assert "dead letter" in down.json()["detail"]
    tasks = ended["stats"]["tasks"]
    assert tasks["succeeded"] == 21 and tasks["failed"] == 1
    assert not [t for t in threading.enumerate() if t.name.startswith("npu-sync")]
