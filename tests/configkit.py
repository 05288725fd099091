"""Configuration files as an operator writes them, for the tests of a pool that reads
and reloads its file (tests/test_guard.py, tests/test_reload_fuzz.py): a file listing
workers on loopback ports, written in one go, and a worker that names itself."""

from __future__ import annotations

from npu_sync.testing import json_response


def echo(req):
    return json_response(200, {"worker_id": req.worker_id})


def workers_yaml(ids, *, extra: str = "", port0: int = 9600) -> str:
    lines = ["npu_workers:", "  health: {enabled: false}", "  workers:"]
    lines += [
        f"    - {{id: {wid}, url: 'http://127.0.0.1:{port0 + i}'}}" for i, wid in enumerate(ids)
    ]
    return "\n".join(lines) + "\n" + extra


def path_with(path, text: str):
    path.write_text(text)
    return path
