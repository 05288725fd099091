"""Capabilities and tags: what a task requires and prefers, and who may serve it."""

from __future__ import annotations

import threading

import pytest
import yaml

from npu_sync import ConfigError, InvalidTask, Task, TaskRejected, WorkerPool, npu_task
from npu_sync._capability import CapabilityFilter, meets
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    RetryConfig,
    WorkerConfig,
    parse_config,
    worker_config,
)
from npu_sync.events import Event, TaskRejectedEvent
from npu_sync.testing import FakeNetwork, FakeRequest, json_response
from npu_sync.transport import Response
from npu_sync.worker_server import LocalWorker


def answer(req: FakeRequest) -> Response:
    if req.path.endswith("/health"):
        return json_response(200, {"status": "healthy"})
    return json_response(200, {"worker": req.worker_id})


def w(wid: str, n: int, **kw: object) -> WorkerConfig:
    return worker_config(wid, f"http://127.0.0.1:{9300 + n}", **kw)


def config(*workers: WorkerConfig) -> PoolConfig:
    return PoolConfig(
        workers=workers,
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=2, backoff_initial=0.0, backoff_max=0.0),
        circuit_breaker=BreakerConfig(fail_max=1, reset_timeout=60),
    )


def fleet() -> tuple[FakeNetwork, PoolConfig]:
    net = FakeNetwork()
    for wid in ("text", "eye", "lab"):
        net.route(wid, answer)
    cfg = config(
        w("text", 0, capabilities=("llm",), tags={"location": "dc", "cost": "high"}),
        w("eye", 1, capabilities=("llm", "vision"), tags={"location": "dc"}),
        w("lab", 2, capabilities=("llm",), tags={"location": "lab", "cost": "low"}),
    )
    return net, cfg


def inference(net: FakeNetwork, wid: str) -> int:
    return sum(1 for r in net.requests(wid) if r.path.endswith("/inference"))


# -- the filter --------------------------------------------------------------------


def test_meets_matches_capabilities_by_name_and_tags_by_key_and_value() -> None:
    """A capability must be listed; a tag must map its key to exactly that value."""
    worker = w("a", 0, capabilities=("llm", "vision"), tags={"location": "lab", "cost": "1"})
    assert meets(worker, ("llm", "vision", "location=lab", "cost=1"))
    assert not meets(worker, ("audio",))
    assert not meets(worker, ("location=dc",))
    assert not meets(worker, ("vision=lab",))  # a tag, not the capability
    assert not meets(worker, ("location",))  # a capability, not the tag's key


def test_unfit_is_worked_out_once_per_configuration_and_again_after_a_change() -> None:
    """The same needs on the same configuration are one lookup; a new configuration
    (a reload) is judged afresh."""
    _, cfg = fleet()
    capabilities = CapabilityFilter()
    first = capabilities.unfit(cfg, frozenset({"vision"}))
    assert first == {"text", "lab"}
    assert capabilities.unfit(cfg, frozenset({"vision"})) is first
    assert capabilities.unfit(cfg, ["vision"]) is first  # any collection, same key
    changed = PoolConfig(workers=(w("text", 0, capabilities=("vision",)),))
    assert capabilities.unfit(changed, frozenset({"vision"})) == frozenset()


def test_missing_names_what_nobody_has_or_what_each_lacks() -> None:
    """A rejection says which need no worker has, or, when each has some, who lacks what."""
    _, cfg = fleet()
    capabilities = CapabilityFilter()
    assert capabilities.missing(cfg, {"audio", "llm"}) == "no worker has capability 'audio'"
    assert capabilities.missing(cfg, {"location=mars"}) == "no worker has tag location=mars"
    both = capabilities.missing(cfg, {"vision", "location=lab"})
    assert both.startswith("no worker has them all: ")
    assert "eye lacks tag location=lab" in both and "lab lacks capability 'vision'" in both


# -- configuration -----------------------------------------------------------------


def test_capabilities_and_tags_are_read_in_both_layouts() -> None:
    """npu_workers and AutoBot's admin-UI layout both keep capabilities and tags; a
    number tag is its text."""
    native = parse_config(
        yaml.safe_load(
            """
npu_workers:
  workers:
    - {id: a, url: "http://10.0.0.1:8081", capabilities: [vision, llm, llm],
       tags: {location: lab, cost: 2}}
"""
        )
    )
    (a,) = native.workers
    assert a.capabilities == ("llm", "vision") and dict(a.tags) == {"location": "lab", "cost": "2"}
    admin = parse_config(
        yaml.safe_load(
            """
workers:
  - {name: b, url: "http://10.0.0.2:8081", capabilities: [audio], tags: {site: lab}}
"""
        )
    )
    (b,) = admin.workers
    assert b.capabilities == ("audio",) and dict(b.tags) == {"site": "lab"}


def test_bad_capabilities_and_tags_are_refused_naming_the_key_and_value() -> None:
    """Every bad entry is reported at once, under its key path, with its value."""
    with pytest.raises(ConfigError) as info:
        parse_config(
            {
                "npu_workers": {
                    "workers": [
                        {
                            "id": "a",
                            "url": "http://10.0.0.1:8081",
                            "capabilities": "llm, vision",
                        },
                        {
                            "id": "b",
                            "url": "http://10.0.0.2:8081",
                            "capabilities": ["llm", "big model", 7],
                            "tags": {"cost": "a=b", "site": ["x"], "": "y"},
                        },
                    ]
                }
            }
        )
    text = str(info.value)
    assert "npu_workers.workers[0].capabilities: must be a list of names, got 'llm, vision'" in text
    assert "npu_workers.workers[1].capabilities[1]: must be printable" in text
    assert "'big model'" in text
    assert "npu_workers.workers[1].capabilities[2]: must be a string, got int" in text
    assert "npu_workers.workers[1].tags.cost: must be printable, without spaces or '='" in text
    assert "npu_workers.workers[1].tags.site: must be a string, got list" in text
    assert "npu_workers.workers[1].tags.: the key must be 1..100 characters" in text


def test_a_worker_built_in_code_is_checked_and_frozen() -> None:
    """WorkerConfig refuses a bad capability and freezes its tags."""
    with pytest.raises(ConfigError, match=r"worker.capabilities\[0\]: must be printable"):
        w("a", 0, capabilities=("has space",))
    with pytest.raises(ConfigError, match=r"worker\.capabilities: must be a list"):
        w("a", 0, capabilities="llm")
    with pytest.raises(ConfigError, match=r"worker\.capabilities: must be printable"):
        WorkerConfig(id="a", url="http://10.0.0.1:8081", capabilities=("has space",))
    with pytest.raises(ConfigError, match=r"worker\.tags\.k: must be printable"):
        WorkerConfig(id="a", url="http://10.0.0.1:8081", tags={"k": "a=b"})
    tags = {"location": "lab"}
    worker = w("a", 0, tags=tags)
    tags["location"] = "dc"
    assert worker.tags["location"] == "lab"


# -- tasks -------------------------------------------------------------------------


def test_task_needs_are_checked_and_frozen() -> None:
    """A bare name is one need; malformed needs raise InvalidTask naming the value."""
    assert Task({}, requires="vision").requires == frozenset({"vision"})
    assert Task({}, prefers=["location=lab", "llm"]).prefers == {"location=lab", "llm"}
    assert Task({}).requires == frozenset() and Task({}).prefers == frozenset()
    for bad in (["two words"], ["=lab"], ["location="], ["a=b=c"], [7], 7):
        with pytest.raises(InvalidTask, match="task requires"):
            Task({}, requires=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidTask, match="at most 32"):
        Task({}, prefers=[f"c{i}" for i in range(33)])


def test_a_task_goes_only_to_workers_meeting_its_requires() -> None:
    """Vision tasks reach only the vision worker; lab tasks only the lab worker."""
    net, cfg = fleet()
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        for _ in range(12):
            assert pool.execute(Task({"x": 1}, requires={"vision"}))["worker"] == "eye"
            assert pool.execute(Task({"x": 1}, requires={"llm", "location=lab"}))["worker"] == "lab"
    assert inference(net, "eye") == inference(net, "lab") == 12
    assert inference(net, "text") == 0


def test_a_task_nobody_can_serve_is_rejected_at_once_and_nothing_is_sent() -> None:
    """A capability no worker has: TaskRejected saying so, no request, no dead letter."""
    net, cfg = fleet()
    events: list[Event] = []
    with WorkerPool(cfg, transport_factory=net.factory, hooks=[events.append]) as pool:
        with pytest.raises(TaskRejected) as info:
            pool.execute(Task({"x": 1}, requires={"audio", "llm"}))
        assert "no worker meets the task's requires (audio, llm)" in str(info.value)
        assert "no worker has capability 'audio'" in str(info.value)
        assert pool.dead_letters.list() == []
        assert pool.stats()["tasks"]["rejected"] == 1
    assert net.requests() == [] or all(not r.path.endswith("/inference") for r in net.requests())
    assert any(isinstance(e, TaskRejectedEvent) and "audio" in e.reason for e in events)


def test_requires_met_only_by_a_down_worker_fails_as_an_outage_not_a_rejection() -> None:
    """The only vision worker is failing: the task is tried there and fails (a dead
    letter), never sent to a worker without vision."""
    net, cfg = fleet()
    net.route("eye", lambda req: json_response(503, {"detail": "busy"}))
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        with pytest.raises(Exception) as info:
            pool.execute(Task({"x": 1}, requires={"vision"}, timeout=5))
        assert not isinstance(info.value, TaskRejected)
        assert len(pool.dead_letters.list()) == 1
    assert inference(net, "text") == inference(net, "lab") == 0


def test_prefers_picks_a_preferred_worker_with_room_else_any_other() -> None:
    """A preferred worker is chosen while it has room; full, the task goes elsewhere
    at once instead of waiting for it."""
    release = threading.Event()
    entered = threading.Event()

    def lab(req: FakeRequest) -> Response:
        if req.path.endswith("/inference") and req.json().get("hold"):
            entered.set()
            release.wait(10)
        return answer(req)

    net = FakeNetwork()
    net.route("dc1", answer)
    net.route("dc2", answer)
    net.route("lab", lab)
    cfg = config(
        w("dc1", 0, tags={"location": "dc"}),
        w("dc2", 1, tags={"location": "dc"}),
        w("lab", 2, tags={"location": "lab"}, max_concurrent=1),
    )
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        for _ in range(6):
            assert pool.execute(Task({"x": 1}, prefers={"location=lab"}))["worker"] == "lab"
        held = pool.submit(Task({"hold": True}, prefers={"location=lab"}))
        assert entered.wait(10)
        others = {
            pool.execute(Task({"x": 1}, prefers={"location=lab"}))["worker"] for _ in range(4)
        }
        assert others <= {"dc1", "dc2"} and others
        release.set()
        assert held.result(10)["worker"] == "lab"


def test_a_reload_that_adds_a_capability_serves_tasks_it_rejected() -> None:
    """Needs are judged on the configuration in force: after a reload gives a worker
    vision, vision tasks go there."""
    net, _ = fleet()
    cfg = config(w("text", 0, capabilities=("llm",)), w("lab", 2))
    with WorkerPool(cfg, transport_factory=net.factory) as pool:
        with pytest.raises(TaskRejected, match="capability 'vision'"):
            pool.execute(Task({}, requires={"vision"}))
        pool.reload(
            config(w("text", 0, capabilities=("llm",)), w("lab", 2, capabilities=("vision",)))
        )
        assert pool.execute(Task({}, requires={"vision"}))["worker"] == "lab"
        pool.reload(config(w("text", 0, capabilities=("llm",)), w("lab", 2)))
        with pytest.raises(TaskRejected):
            pool.execute(Task({}, requires={"vision"}))


def test_the_decorator_passes_requires_and_prefers_and_checks_them_early() -> None:
    """@npu_task(requires=...) routes like Task(requires=...); a bad need fails at
    decoration."""
    net, cfg = fleet()
    with WorkerPool(cfg, transport_factory=net.factory) as pool:

        @npu_task(pool, requires=["vision"])
        def look(url: str) -> dict[str, str]:
            return {"image": url}

        assert {look("x")["worker"] for _ in range(5)} == {"eye"}
        with pytest.raises(InvalidTask):
            npu_task(pool, prefers=["bad need"])(lambda: {})


def test_real_workers_only_the_capable_one_gets_vision_tasks() -> None:
    """Two reference worker processes; 40 vision tasks all reach the one listing vision,
    and an audio task is refused without a request."""
    with LocalWorker(worker_id="txt").start() as txt, LocalWorker(worker_id="cam").start() as cam:
        cfg = config(
            worker_config("txt", txt.url, capabilities=("llm",)),
            worker_config("cam", cam.url, capabilities=("llm", "vision")),
        )
        with WorkerPool(cfg) as pool:
            futures = [
                pool.submit(Task({"model_id": "default", "input_text": "x"}, requires={"vision"}))
                for _ in range(40)
            ]
            for future in futures:
                future.result(30)
            with pytest.raises(TaskRejected, match="capability 'audio'"):
                pool.execute(Task({"model_id": "default"}, requires={"audio"}))
            rows = {row["id"]: row for row in pool.workers()}
            assert rows["cam"]["tasks"]["succeeded"] == 40
            assert rows["txt"]["tasks"]["attempts"] == 0
