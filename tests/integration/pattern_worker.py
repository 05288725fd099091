"""A worker process for the shared-breaker tests: fails exactly the tasks it is told to.

``python -m tests.integration.pattern_worker`` prints its port, then serves
``POST /inference`` in one of three modes (``POST /_mode {"mode": ...}``):

- ``answer``: 500 for a task whose ``input_text`` starts with ``fail``, 200 otherwise
  (a failure pattern the test chooses, so nothing depends on chance);
- ``fail``: 500 for every task (a worker that is down but still answers);
- ``hang``: holds every task until the mode changes (a worker gone silent).

``GET /_count`` gives the inference requests received so far, each with the wall-clock
time it arrived, counted when the request is read (so a frozen worker, once resumed,
still counts what queued up meanwhile).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class State:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.mode = "answer"
        self.arrivals: list[float] = []


STATE = State()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, {"status": "healthy"})
        elif self.path == "/_count":
            with STATE.cond:
                self._send(200, {"arrivals": list(STATE.arrivals)})
        else:
            self._send(404, {"detail": "not found"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if self.path == "/_mode":
            with STATE.cond:
                STATE.mode = str(body["mode"])
                STATE.cond.notify_all()
            self._send(200, {"mode": STATE.mode})
            return
        with STATE.cond:
            STATE.arrivals.append(time.time())
            if STATE.mode == "hang":
                STATE.cond.wait_for(lambda: STATE.mode != "hang", timeout=120)
            mode = STATE.mode
        text = str(body.get("input_text", ""))
        if mode == "fail" or text.startswith("fail"):
            self._send(500, {"detail": "simulated failure"})
        else:
            self._send(200, {"model_id": "default", "response": "ok", "inference_count": 1})


def main() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
