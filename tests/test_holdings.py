"""Unit tests of what one worker holds: model lists, "not loaded" answers, the pool's
own loads, device and NPU, in the terms of the worker's protocol."""

from __future__ import annotations

from typing import Any

import pytest

from npu_sync._health import HealthResult
from npu_sync._holdings import Holdings
from npu_sync.protocols import MAX_MODELS


def listed(*models: str, at: float = 0.0, **kw: Any) -> HealthResult:
    return HealthResult("a", True, 0.0, models=frozenset(models), models_at=at, **kw)


def unlisted(at: float = 0.0, **kw: Any) -> HealthResult:
    return HealthResult("a", True, 0.0, models_at=at, **kw)


def test_a_worker_with_no_list_lacks_nothing_it_has_not_refused():
    """Unknown list: every model may be there, except one answered "not loaded"."""
    held = Holdings()
    assert held.models is None and not held.lacks("m")
    assert held.model_not_loaded("m", now=1.0) is True  # news: it might have held it
    assert held.lacks("m") and not held.lacks("n")


def test_a_list_says_what_the_worker_lacks_and_reports_what_changed():
    """A first list adds its models; the next reports what came and went; the same list
    again is no change."""
    held = Holdings()
    assert held.apply_models(listed("a", "b")) == (frozenset({"a", "b"}), frozenset())
    assert held.lacks("c") and not held.lacks("a")
    assert held.apply_models(listed("b", "c")) == (frozenset({"c"}), frozenset({"a"}))
    assert held.apply_models(listed("b", "c")) is None
    assert held.models == frozenset({"b", "c"})


def test_a_worker_that_loads_on_demand_lacks_only_what_it_refused():
    """On demand, a list names what is loaded now, not what may be asked for."""
    held = Holdings(on_demand=True)
    held.apply_models(listed("a"))
    assert not held.lacks("z")
    assert held.model_not_loaded("z", now=1.0) is True
    assert held.lacks("z")


def test_not_loaded_is_news_only_when_the_worker_was_thought_to_hold_it():
    """A model the list already left out, or one refused before, is no news."""
    held = Holdings()
    held.apply_models(listed("a"))
    assert held.model_not_loaded("b", now=1.0) is False
    assert held.model_not_loaded("a", now=1.0) is True
    assert held.model_not_loaded("a", now=2.0) is False
    assert held.models == frozenset()


def test_a_not_loaded_answer_newer_than_the_list_outlives_it():
    """A list asked for before the answer does not bring the model back; a later one does."""
    held = Holdings()
    held.model_not_loaded("m", now=10.0)
    assert held.apply_models(listed("m", "n", at=9.0)) == (frozenset({"n"}), frozenset())
    assert held.lacks("m")
    held.apply_models(listed("m", "n", at=11.0))
    assert not held.lacks("m") and held.models == frozenset({"m", "n"})


def test_on_demand_a_refusal_gives_way_only_to_a_list_that_names_the_model():
    """For a worker that loads on demand, a later list without the model says nothing
    of whether it can serve it: the refusal stands until a list names it."""
    held = Holdings(on_demand=True)
    held.model_not_loaded("m", now=1.0)
    held.apply_models(listed("x", at=2.0))
    assert held.lacks("m")
    held.apply_models(listed("x", "m", at=3.0))
    assert not held.lacks("m")


def test_a_round_without_a_list_lets_older_refusals_expire():
    """No list this round: refusals from before it give way (one bounce per round at
    most), newer ones stand, and with no list known the expiry is reported as added."""
    held = Holdings()
    held.model_not_loaded("old", now=1.0)
    held.model_not_loaded("new", now=5.0)
    assert held.apply_models(unlisted(at=3.0)) == (frozenset({"old"}), frozenset())
    assert not held.lacks("old") and held.lacks("new")
    assert held.apply_models(unlisted(at=3.0)) is None


def test_a_round_without_a_list_keeps_the_last_list():
    """A list known: an expiring refusal is not reported, and the list stands."""
    held = Holdings()
    held.apply_models(listed("a"))
    held.model_not_loaded("a", now=1.0)
    assert held.apply_models(unlisted(at=2.0)) is None
    assert held.models == frozenset() and not held.not_loaded


def test_the_not_loaded_answers_kept_are_bounded():
    """Tasks naming ever new models never grow the refusals past the bound; the
    oldest goes first."""
    held = Holdings()
    for i in range(MAX_MODELS + 50):
        held.model_not_loaded(f"m{i}", now=float(i))
    assert len(held.not_loaded) == MAX_MODELS
    assert "m0" not in held.not_loaded and f"m{MAX_MODELS + 49}" in held.not_loaded


def test_a_model_the_pool_loaded_is_held_at_once():
    """The pool's own load clears a refusal and joins the list, if one is known."""
    held = Holdings()
    held.model_placed("m")
    assert held.models is None
    held.apply_models(listed("a"))
    held.model_not_loaded("m", now=1.0)
    held.model_placed("m")
    assert not held.lacks("m") and held.models == frozenset({"a", "m"})


def test_a_list_is_swapped_whole_never_changed_in_place():
    """A reader holding the last list (stats() reads without a lock of its own) never
    sees it change under it."""
    held = Holdings()
    held.apply_models(listed("a", "b"))
    seen = held.models
    held.model_not_loaded("a", now=1.0)
    held.model_placed("c")
    assert seen == frozenset({"a", "b"}) and held.models == frozenset({"b", "c"})


def test_device_and_npu_come_from_the_check_that_said_them():
    """A check that does not say the device leaves the last one; the per-model devices
    follow the list."""
    held = Holdings()
    held.apply_models(listed("a", device="NPU", npu_available=True, model_devices={"a": "NPU"}))
    held.apply_models(unlisted())
    assert (held.device, held.npu_available, dict(held.model_devices)) == (
        "NPU",
        True,
        {"a": "NPU"},
    )
    held.apply_models(listed("a", npu_available=False))
    assert held.npu_available is False and held.device == "NPU" and not held.model_devices


def test_the_cap_comes_from_the_last_answer_that_lists_the_models():
    """A list with max_models sets the cap; a health answer alone with one does too; a
    list without one drops it (the worker no longer says)."""
    held = Holdings()
    assert held.max_models is None
    held.apply_models(listed("a", max_models=2))
    assert held.max_models == 2
    held.apply_models(unlisted(max_models=3))
    assert held.max_models == 3
    held.apply_models(unlisted())
    assert held.max_models == 3
    held.apply_models(listed("a"))
    assert held.max_models is None


def test_inference_counts_give_a_rate_between_two_lists():
    """Two lists 10 s apart: each model's inferences per second; a count that fell (the
    model was loaded again) gives no rate; a list within a second of the last one
    leaves the rates as they were; a list without counts clears them."""
    held = Holdings()
    held.apply_models(listed("a", "b", at=10.0, model_inferences={"a": 5, "b": 1}))
    assert dict(held.inferences) == {"a": 5, "b": 1} and not held.rates
    held.apply_models(listed("a", "b", at=20.0, model_inferences={"a": 25, "b": 1}))
    assert dict(held.rates) == {"a": 2.0, "b": 0.0}
    held.apply_models(unlisted(at=25.0))  # no list this round: counts and rates stand
    assert dict(held.rates) == {"a": 2.0, "b": 0.0}
    held.apply_models(listed("a", "b", at=30.0, model_inferences={"a": 3, "b": 4}))
    assert dict(held.rates) == {"b": 0.3} and dict(held.inferences) == {"a": 3, "b": 4}
    held.apply_models(listed("a", "b", at=30.5, model_inferences={"a": 9, "b": 4}))
    assert dict(held.rates) == {"b": 0.3} and held.inferences["a"] == 9  # too soon for a rate
    held.apply_models(listed("a", "b", at=40.0))
    assert not held.inferences and not held.rates


def test_another_protocol_forgets_the_models_but_not_the_device():
    """Lists read in another protocol's terms are dropped, refusals too; what the worker
    said of its device still holds. The new protocol's on-demand rule applies."""
    held = Holdings()
    held.apply_models(listed("a", device="NPU", npu_available=True))
    held.model_not_loaded("z", now=1.0)
    refusals = held.not_loaded
    held.forget_models(on_demand=True)
    assert held.models is None and not held.not_loaded and refusals == {"z": 1.0}
    assert (held.device, held.npu_available, held.on_demand) == ("NPU", True, True)


def test_a_move_forgets_everything_the_worker_held():
    """A new address: models, refusals, device and NPU are unknown again."""
    held = Holdings(on_demand=True)
    held.apply_models(listed("a", device="NPU", npu_available=False))
    held.model_not_loaded("z", now=1.0)
    held.apply_models(listed("a", at=1.0, max_models=2, model_inferences={"a": 1}))
    held.apply_models(listed("a", at=2.0, max_models=2, model_inferences={"a": 2}))
    held.forget()
    assert (held.models, held.not_loaded, held.device, held.npu_available) == (
        None,
        {},
        None,
        None,
    )
    assert (held.max_models, dict(held.inferences), dict(held.rates)) == (None, {}, {})
    assert held.on_demand is True and not held.lacks("z")


def test_a_not_loaded_answer_from_a_workers_old_address_teaches_its_new_one_nothing():
    """Worker a moves to a new address by a reload while a task for model m is on its
    old one; the old address then answers "m not loaded". The new address's models are
    unknown (a move forgets them), so a later task for m is sent there and served,
    rather than refused with "no live worker serves model 'm'"."""
    import contextlib
    import threading

    from npu_sync import TaskFailed, TaskRejected, WorkerPool
    from npu_sync.config import HealthConfig, PoolConfig, RetryConfig, worker_config
    from npu_sync.testing import FakeNetwork, FakeRequest, json_response

    entered, release = threading.Event(), threading.Event()
    old_asked: list[bool] = []

    def handler(req: FakeRequest) -> Any:
        if req.path.endswith("/models"):
            return json_response(404, {"detail": "Not Found"})
        if req.json().get("input_text") == "on the old address" and not old_asked:
            old_asked.append(True)
            entered.set()
            assert release.wait(10.0)
            return json_response(500, {"detail": "Model m not loaded"})
        return json_response(200, {"worker": req.worker_id})

    def config(port: int) -> PoolConfig:
        return PoolConfig(
            workers=(worker_config("a", f"http://127.0.0.1:{port}"),),
            health=HealthConfig(enabled=False),
            retry=RetryConfig(max_retries=3, backoff_initial=0.0, backoff_max=0.0),
        )

    net = FakeNetwork(handler)
    with WorkerPool(config(9700), transport_factory=net.factory) as pool:
        old = pool.submit({"model_id": "m", "input_text": "on the old address"})
        try:
            assert entered.wait(10.0)
            pool.reload(config(9701))
        finally:
            release.set()
        with contextlib.suppress(TaskFailed, TaskRejected):  # the old task ends either way
            old.result(10.0)
        assert not pool._state.workers["a"].held.lacks("m")
        assert pool.execute({"model_id": "m", "input_text": "x"}) == {"worker": "a"}


def test_not_loaded_answers_from_the_old_address_are_ignored_but_the_new_ones_are_heard():
    """Several tasks for m are on a's old address (slow to answer) when a reload moves
    a; each then answers "m not loaded", and a still is not known to lack m. Once the
    new address itself says "m not loaded", that is recorded: the next task for m is
    refused at once, naming it."""
    import contextlib
    import threading

    from npu_sync import TaskFailed, TaskRejected, WorkerPool
    from npu_sync.config import HealthConfig, PoolConfig, RetryConfig, worker_config
    from npu_sync.testing import FakeNetwork, FakeRequest, json_response

    entered = threading.Semaphore(0)
    release = threading.Event()

    def handler(req: FakeRequest) -> Any:
        if req.path.endswith("/models"):
            return json_response(404, {"detail": "Not Found"})
        where = req.headers.get("X-Where")
        if where == "old":
            entered.release()
            assert release.wait(10.0)
        return json_response(500, {"detail": "Model m not loaded"})

    def config(port: int, where: str) -> PoolConfig:
        return PoolConfig(
            workers=(
                worker_config(
                    "a", f"http://127.0.0.1:{port}", max_concurrent=4, headers={"X-Where": where}
                ),
            ),
            health=HealthConfig(enabled=False),
            retry=RetryConfig(max_retries=3, backoff_initial=0.0, backoff_max=0.0),
        )

    net = FakeNetwork(handler)
    with WorkerPool(config(9710, "old"), transport_factory=net.factory) as pool:
        old = [pool.submit({"model_id": "m", "input_text": str(i)}) for i in range(4)]
        try:
            for _ in old:
                assert entered.acquire(timeout=10.0)
            pool.reload(config(9711, "new"))
        finally:
            release.set()
        for future in old:
            with contextlib.suppress(TaskFailed, TaskRejected):
                future.result(10.0)
        worker = pool._state.workers["a"]
        assert not worker.held.lacks("m") and not worker.held.not_loaded
        with contextlib.suppress(TaskRejected):
            pool.execute({"model_id": "m", "input_text": "to the new address"})
        assert worker.held.lacks("m")
        with pytest.raises(TaskRejected, match="no live worker serves model 'm'"):
            pool.execute({"model_id": "m", "input_text": "refused at once"})
    assert not any(
        r.headers.get("X-Where") == "new" and r.json().get("input_text") == "refused at once"
        for r in net.requests("a")
        if r.body is not None
    )
