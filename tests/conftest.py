"""Shared fixtures: every test must leave no thread behind."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from tests.hostile import Hostile


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Fail a test that leaves a non-daemon or npu-sync thread running."""
    before = set(threading.enumerate())
    yield
    leaked = []
    for thread in set(threading.enumerate()) - before:
        thread.join(timeout=5)
        if thread.is_alive():
            leaked.append(thread.name)
    assert not leaked, f"threads left running: {leaked}"


@pytest.fixture
def servers() -> Iterator[list[Hostile]]:
    """Hostile servers a test starts (see ``tests.hostile.serve``), closed after it."""
    started: list[Hostile] = []
    yield started
    for server in started:
        server.close()
