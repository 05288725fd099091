"""Fixtures that start real reference workers as child processes on loopback ports."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from npu_sync.worker_server import LocalWorker


@pytest.fixture
def start_worker() -> Iterator[Callable[..., LocalWorker]]:
    """Start a LocalWorker; every one started is stopped at teardown."""
    started: list[LocalWorker] = []

    def start(**kwargs: Any) -> LocalWorker:
        worker = LocalWorker(**kwargs).start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()
