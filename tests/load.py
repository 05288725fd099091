"""Caller threads that keep a pool busy while a test does something else to it."""

from __future__ import annotations

import threading

from npu_sync import WorkerPool


class Load:
    """Caller threads running tasks until stopped, collecting every error."""

    def __init__(self, pool: WorkerPool, threads: int = 4) -> None:
        self.pool = pool
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.ok = 0
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run) for _ in range(threads)]

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.pool.execute({"input_text": "x"})
            except Exception as exc:
                with self.lock:
                    self.errors.append(exc)
            else:
                with self.lock:
                    self.ok += 1

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)
