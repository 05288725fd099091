"""The stack of steps (npu_sync._life.stack): built once per configuration, only what it needs."""

from __future__ import annotations

import threading

from npu_sync import WorkerPool
from npu_sync.testing import FakeNetwork, json_response
from tests.lifekit import config, network_pool
from tests.stubs import NoTransport


def test_the_stack_is_built_once_per_configuration_not_per_task() -> None:
    """Tasks share one Stack; a reload that changes the configuration builds another."""
    net = FakeNetwork(lambda req: json_response(200, {}))
    with network_pool(net) as p:
        p.execute({"x": 1})
        first = p._runner.stack()
        for _ in range(20):
            p.execute({"x": 1})
        assert p._runner.stack() is first
        new = config("a", pool=type(p._state.config.pool)(max_queue_wait=2.5))
        p.reload(new)
        p.execute({"x": 1})
        second = p._runner.stack()
        assert second is not first and second.config is p._state.config


def test_a_configuration_without_hedging_has_no_hedge_step() -> None:
    """The steps a configuration does not need are not in its stack."""
    with WorkerPool(config("a"), transport_factory=lambda *a, **k: NoTransport()) as p:
        names = [type(s).__name__ for s in p._runner.stack().steps]
    assert "Hedge" not in names and "FleetTrial" not in names and "ModelCount" not in names
    assert names[0] == "Retry" and names[-3:] == ["Record", "Compose", "Send"]


def test_many_threads_share_one_stack_without_mixing_their_tasks() -> None:
    """Steps keep no per-task state: 8 threads' tasks each get their own answer."""
    net = FakeNetwork(lambda req: json_response(200, {"echo": req.json()["n"]}))
    errors: list[BaseException] = []
    with network_pool(net) as p:

        def run(n: int) -> None:
            try:
                for i in range(50):
                    assert p.execute({"n": n * 1000 + i})["echo"] == n * 1000 + i
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert errors == [] and not any(t.is_alive() for t in threads)
