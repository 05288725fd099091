"""A transport's optional features, declared once (``TransportFeatures``): read with
``features_of``, defaulting to none for a transport that declares nothing, and each
declared feature used where the pool can use it."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Any

import pytest

from npu_sync import WorkerPool
from npu_sync._health import probe
from npu_sync.config import (
    HealthConfig,
    ModelPolicy,
    ModelsConfig,
    PoolConfig,
    RetryConfig,
    StallConfig,
    TransportConfig,
    worker_config,
)
from npu_sync.testing import FakeTransport, json_response
from npu_sync.transport import (
    NO_FEATURES,
    Cancel,
    IdleBudget,
    IdleReaper,
    Response,
    TransportFeatures,
    features_of,
    make_transport,
)

ALL = TransportFeatures(cancellable=True, silences=True, shares_idle=True)


class Plain:
    """A user's transport as the docs show it: request() and close(), nothing more.
    Its request() takes no ``cancel=`` nor ``silence=``: handing it either fails."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, str]] = []
        self.models: list[str] = []

    def request(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float,
        connect_timeout: float | None = None,
        replayable: bool = False,
    ) -> Response:
        with self.lock:
            self.calls.append((method, path))
        return answer(self.models, self.lock, method, path, body)

    def close(self) -> None:
        pass


class Declared(Plain):
    """A transport that declares every feature, and only through ``features``; it
    records what each request was handed."""

    features = ALL

    def __init__(self) -> None:
        super().__init__()
        self.options: list[tuple[str, dict[str, Any]]] = []
        self.budget: IdleBudget | None = None
        self.idle_connections = 0

    def request(  # type: ignore[override]
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float,
        connect_timeout: float | None = None,
        replayable: bool = False,
        **options: Any,
    ) -> Response:
        with self.lock:
            self.options.append((path, options))
        return super().request(method, path, body=body, timeout=timeout)

    def share_idle(self, budget: IdleBudget) -> None:
        self.budget = budget

    def reap(self, now: float) -> int:
        return 0

    def given(self, path: str, option: str) -> list[Any]:
        """What each request to ``path`` was handed as ``option`` (None: nothing)."""
        with self.lock:
            return [options.get(option) for p, options in self.options if p == path]


def answer(
    models: list[str], lock: threading.Lock, method: str, path: str, body: bytes | None
) -> Response:
    """A Linux worker in a few lines: healthy, lists and loads models, runs tasks."""
    if path == "/health":
        return json_response(200, {"status": "healthy"})
    if path == "/models" and method == "GET":
        with lock:
            return json_response(200, {"loaded_models": {m: {} for m in models}})
    if path == "/models/load":
        import json

        model = json.loads(body or b"{}")["model_id"]
        with lock:
            models.append(model)
        return json_response(200, {"status": "success", "model_id": model})
    return json_response(200, {"ok": True})


def pool_config(**changes: Any) -> PoolConfig:
    return dataclasses.replace(
        PoolConfig(
            workers=(worker_config("w", "http://127.0.0.1:9"),),
            health=HealthConfig(enabled=False),
        ),
        **changes,
    )


# -- reading a declaration ---------------------------------------------------------


def test_a_transport_that_declares_nothing_has_no_features():
    """features_of() of a plain transport is the defaults: every feature off."""
    assert features_of(Plain()) is NO_FEATURES
    assert TransportFeatures() == NO_FEATURES
    assert not (NO_FEATURES.cancellable or NO_FEATURES.silences or NO_FEATURES.shares_idle)


def test_a_declaration_is_read_as_given_and_cannot_change():
    """features_of() returns the declared object; a declaration is frozen."""
    transport = Declared()
    assert features_of(transport) is ALL
    with pytest.raises(dataclasses.FrozenInstanceError):
        ALL.cancellable = False  # type: ignore[misc]


def test_the_older_attributes_still_declare_their_features():
    """A transport written to the older docs — a true ``cancellable`` or ``silences``
    attribute, a ``share_idle`` method — gets those features, and only those."""

    class Older(Plain):
        cancellable = True

    class Silent(Plain):
        silences = True
        cancellable = False

    class Sharing(Plain):
        def share_idle(self, budget: IdleBudget) -> None:
            pass

    assert features_of(Older()) == TransportFeatures(cancellable=True)
    assert features_of(Silent()) == TransportFeatures(silences=True)
    assert features_of(Sharing()) == TransportFeatures(shares_idle=True)


def test_a_malformed_declaration_is_refused_naming_the_transport_and_the_value():
    """``features = {...}`` is a TypeError naming the class and what it holds, and a
    pool built on such a transport fails as its worker is built."""

    class Wrong(Plain):
        features = ("cancellable",)

    with pytest.raises(TypeError, match=r"Wrong\.features: must be a TransportFeatures, got "):
        features_of(Wrong())
    with pytest.raises(TypeError, match=r"\('cancellable',\)"):
        WorkerPool(pool_config(), transport_factory=lambda *a, **k: Wrong())


@pytest.mark.parametrize(
    ("client", "declared"),
    [
        ("builtin", ALL),
        ("urllib3", TransportFeatures(cancellable=True, shares_idle=True)),
        ("requests", TransportFeatures(shares_idle=True)),
    ],
)
def test_each_built_in_transport_declares_what_it_does(client, declared):
    """The three clients declare their features once; each shares idle connections
    (and has share_idle), and the older attribute spellings agree."""
    transport = make_transport(
        worker_config("w", "http://127.0.0.1:9"), TransportConfig(client=client)
    )
    try:
        features = features_of(transport)
        assert features == declared
        assert callable(transport.share_idle)  # type: ignore[attr-defined]
        assert getattr(transport, "cancellable", False) == features.cancellable
        assert getattr(transport, "silences", False) == features.silences
    finally:
        transport.close()


def test_the_fake_transport_declares_that_it_can_be_cancelled():
    """npu_sync.testing.FakeTransport declares ``cancellable`` (and honours it)."""
    cancel = Cancel()
    cancel.cancel()
    fake = FakeTransport("w", lambda req: json_response(200, {}))
    assert features_of(fake) == TransportFeatures(cancellable=True)
    with pytest.raises(Exception, match="cancel"):
        fake.request("GET", "/health", timeout=1.0, cancel=cancel)  # type: ignore[call-arg]


# -- a transport that declares nothing still works ----------------------------------


def test_a_pool_on_a_transport_that_declares_nothing_runs_tasks_checks_and_placement():
    """Tasks (with the stall limit on), health checks and a placement round all work
    on a transport whose request() takes neither ``cancel=`` nor ``silence=``, and the
    idle-connection cap leaves it alone."""
    transport = Plain()
    cfg = pool_config(
        retry=RetryConfig(stall=StallConfig(unknown=5.0)),
        models=ModelsConfig(
            balance=True, placement=True, interval=3600, catalog={"m": ModelPolicy(1, None)}
        ),
    )
    with WorkerPool(cfg, transport_factory=lambda *a, **k: transport) as pool:
        pool.check_health()
        pool.check_placement()
        assert transport.models == ["m"]
        assert pool.execute({"model_id": "m", "input_text": "x"}) == {"ok": True}
        assert pool.stats()["connections"]["idle"] == 0
    assert ("GET", "/health") in transport.calls
    assert ("POST", "/models/load") in transport.calls
    assert ("POST", "/inference") in transport.calls


# -- a declared transport gets each feature used -----------------------------------


def test_a_health_check_hands_its_cancel_to_a_cancellable_transport_only():
    """probe(cancel=...) passes the Cancel on when the transport declares
    ``cancellable``, and not to one that does not (which would fail on it)."""
    declared, plain, cancel = Declared(), Plain(), Cancel()
    assert probe("w", declared, HealthConfig(), cancel=cancel).ok
    assert declared.given("/health", "cancel") == [cancel]
    assert probe("w", plain, HealthConfig(), cancel=cancel).ok


def test_a_placement_round_makes_its_load_cancellable_on_a_declared_transport():
    """A round's model load carries a Cancel (what close() cuts it short with) when
    the transport declares ``cancellable``."""
    transport = Declared()
    cfg = pool_config(
        models=ModelsConfig(
            balance=True, placement=True, interval=3600, catalog={"m": ModelPolicy(1, None)}
        )
    )
    with WorkerPool(cfg, transport_factory=lambda *a, **k: transport) as pool:
        pool.check_health()
        pool.check_placement()
    (handed,) = transport.given("/models/load", "cancel")
    assert isinstance(handed, Cancel)


def test_a_transport_declaring_shares_idle_joins_the_pools_idle_budget():
    """IdleReaper.adopt() hands a declared transport the budget; one that does not
    declare it is left alone, share_idle or not; every transport a pool builds is
    adopted."""
    reaper = IdleReaper(4, 1.0)
    declared = Declared()
    assert reaper.adopt(declared) is declared and declared.budget is reaper.budget
    plain = Plain()
    assert reaper.adopt(plain) is plain

    class Declines(Declared):
        features = TransportFeatures(cancellable=True)  # has share_idle, declares it not

    declines = Declines()
    assert reaper.adopt(declines) is declines and declines.budget is None
    built: list[Declared] = []

    def factory(*args: Any, **kwargs: Any) -> Declared:
        built.append(Declared())
        return built[-1]

    with WorkerPool(pool_config(), transport_factory=factory):
        assert len(built) == 2  # the task transport and the health transport
        assert built[0].budget is not None and built[0].budget is built[1].budget


def test_a_tasks_attempt_hands_silence_to_a_transport_declaring_silences():
    """With the stall limit on and nothing known of the worker, an attempt on a
    transport declaring ``silences`` is handed ``silence=`` (the limit)."""
    transport = Declared()
    cfg = pool_config(retry=RetryConfig(stall=StallConfig(unknown=5.0)))
    with WorkerPool(cfg, transport_factory=lambda *a, **k: transport) as pool:
        pool.execute({"model_id": "m", "input_text": "x"})
    assert transport.given("/inference", "silence") == [5.0]
