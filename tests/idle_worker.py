"""A worker process on many ports that closes idle keep-alive connections, for the
descriptor tests and benchmarks.

``python tests/idle_worker.py --ports 44 --idle-close 1 --good 50`` listens on 44
loopback ports (one ThreadingHTTPServer each, HTTP/1.1 keep-alive), closes a
connection that stays idle ``--idle-close`` seconds (as uvicorn's keep-alive timeout
does), answers ``GET /health`` with ``{"status": "healthy"}``, ``GET /stats`` with the
connections it holds open, and ``POST /inference`` with a result for the first
``--good`` tasks of each port and 503 after (so that a pool fails over from worker to
worker). ``--hang`` accepts connections and never answers. Prints one JSON line
``{"ports": [...]}`` once listening, and runs until its stdin closes.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

OPEN = {"connections": 0}
LOCK = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    good = 0
    hang = False

    def setup(self) -> None:
        super().setup()
        with LOCK:
            OPEN["connections"] += 1

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            with LOCK:
                OPEN["connections"] -= 1

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _answer(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.hang:
            threading.Event().wait()
        if self.path == "/health":
            self._answer(200, {"status": "healthy"})
        elif self.path == "/stats":
            with LOCK:
                self._answer(200, dict(OPEN))
        else:
            self._answer(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        server: Server = self.server  # type: ignore[assignment]
        with LOCK:
            server.served += 1
            served = server.served
        if served <= self.good:
            self._answer(200, {"response": "ok", "port": server.server_address[1]})
        else:
            self._answer(503, {"detail": "overloaded"})


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024
    served = 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ports", type=int, default=1)
    parser.add_argument("--idle-close", type=float, default=1.0)
    parser.add_argument("--good", type=int, default=1 << 30)
    parser.add_argument("--hang", action="store_true")
    args = parser.parse_args()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    handler = type(
        "H",
        (Handler,),
        {"timeout": args.idle_close, "good": args.good, "hang": args.hang},
    )
    servers = [Server(("127.0.0.1", 0), handler) for _ in range(args.ports)]
    for server in servers:
        threading.Thread(target=server.serve_forever, args=(0.5,), daemon=True).start()
    print(json.dumps({"ports": [s.server_address[1] for s in servers]}), flush=True)
    sys.stdin.read()  # until the parent closes our stdin, or ends


if __name__ == "__main__":
    main()
