"""The Prometheus exporter: counters from start-up and events, gauges at scrape time,
registries, and prometheus_client's multiprocess mode."""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import pytest
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from npu_sync import ConfigError, TaskFailed, TaskRejected, WorkerPool
from npu_sync.config import BreakerConfig, HealthConfig, PoolConfig, RetryConfig, worker_config
from npu_sync.events import (
    AttemptFinished,
    BreakerStateChanged,
    ConfigReloaded,
    ConfigReloadFailed,
    Event,
    Hook,
    RetryScheduled,
    TaskCancelled,
    TaskDeadLettered,
    TaskFallback,
    TaskRejectedEvent,
    TaskStarted,
    TaskSucceeded,
    WorkerHealthChanged,
)
from npu_sync.prometheus import PrometheusExporter, instrument, metrics_text
from npu_sync.testing import FakeClock, FakeNetwork, FakeRequest, json_response
from npu_sync.transport import Response
from tests.test_install_hints import bare_installs

OK_SECONDS = 0.2  # in the le="0.25" bucket
BAD_SECONDS = 0.003  # in the le="0.005" bucket
DOWN_SECONDS = 1.5  # in the le="2.5" bucket


def make_config(*ids: str, **kw: Any) -> PoolConfig:
    """Workers in tiers by position, so the first one takes every task it can."""
    workers = tuple(
        worker_config(wid, f"http://127.0.0.1:{9300 + n}", priority=n + 1, max_concurrent=4)
        for n, wid in enumerate(ids)
    )
    kw.setdefault("health", HealthConfig(enabled=False))
    kw.setdefault("retry", RetryConfig(max_retries=2, backoff_initial=0.01, backoff_max=0.1))
    kw.setdefault("circuit_breaker", BreakerConfig(fail_max=1, reset_timeout=30))
    return PoolConfig(workers=workers, **kw)


def scripted(clock: FakeClock):
    """A worker that answers by the payload's ``kind``, taking a known time to do it."""

    def handler(req: FakeRequest) -> Response:
        if req.path == "/health":
            return json_response(200, {"status": "healthy"})
        kind = req.json()["kind"]
        if kind == "ok":
            clock.advance(OK_SECONDS)
            return json_response(200, {"worker_id": req.worker_id})
        if kind == "bad":
            clock.advance(BAD_SECONDS)
            return json_response(422, {"detail": "input_text missing"})
        clock.advance(DOWN_SECONDS)
        return json_response(503, {"detail": "overloaded"})

    return handler


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def net(clock: FakeClock) -> FakeNetwork:
    return FakeNetwork(scripted(clock))


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the registry's text output, parsed back: (name, labels) -> value."""
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def names(samples: dict) -> set[str]:
    return {name for name, _ in samples}


def run_mixed_load(pool: WorkerPool) -> None:
    """Three successes, one 422 rejection (from a, confirmed by b), one task that fails
    on all three workers."""
    for _ in range(3):
        pool.execute({"kind": "ok"})
    with pytest.raises(TaskRejected):
        pool.execute({"kind": "bad"})
    with pytest.raises(TaskFailed):
        pool.execute({"kind": "down"})


class RecordingPool:
    """Stands in for a pool: records hooks, reports fixed stats and workers."""

    def __init__(self, worker_ids: tuple[str, ...] = ()) -> None:
        self.hooks: list[Hook] = []
        self.removed: list[Hook] = []
        self.worker_ids = worker_ids
        self.closed = False

    def add_hook(self, hook: Hook) -> None:
        self.hooks.append(hook)

    def remove_hook(self, hook: Hook) -> None:
        self.removed.append(hook)
        self.hooks = [h for h in self.hooks if h is not hook]

    def stats(self) -> dict[str, Any]:
        return {"tasks": {"waiting": 0}, "dead_letters": {"pending": 0}}

    def workers(self) -> list[dict[str, Any]]:
        return [
            {
                "id": wid,
                "in_flight": 0,
                "capacity": 1,
                "healthy": True,
                "breaker": {"state": "closed"},
                "latency": {"ewma_ms": None},
                "failure_rate": None,
            }
            for wid in self.worker_ids
        ]

    def fire(self, event: Event) -> None:
        for hook in list(self.hooks):
            hook(event)


def test_counters_and_histogram_count_attempts_and_tasks_by_worker_and_outcome(
    net, clock, registry
):
    """Successes, a 422 and a dead-lettered failure land in the right counter series."""
    with WorkerPool(make_config("a", "b", "c"), transport_factory=net.factory, clock=clock) as pool:
        exporter = instrument(pool, registry)
        run_mixed_load(pool)
        samples = scrape(registry)
        exporter.close()

    expected_attempts = {
        ("a", "succeeded"): 3,
        ("a", "rejected"): 1,
        ("b", "rejected"): 1,  # a second worker's refusal makes it the task's
        ("a", "failed"): 1,
        ("b", "failed"): 1,
        ("c", "failed"): 1,
    }
    for wid in "abc":
        for outcome in ("succeeded", "rejected", "not_here", "failed", "abandoned"):
            assert value(
                samples, "npu_sync_attempts_total", worker=wid, outcome=outcome
            ) == expected_attempts.get((wid, outcome), 0), (wid, outcome)
    tasks = {"succeeded": 3, "rejected": 1, "failed": 1, "fallback": 0, "cancelled": 0}
    for outcome, n in tasks.items():
        assert value(samples, "npu_sync_tasks_total", outcome=outcome) == n
    # The failing task was retried after a's and b's failures; c's was its last.
    assert value(samples, "npu_sync_retries_total") == 2
    # fail_max=1: each worker's one failure opened its breaker.
    assert [value(samples, "npu_sync_breaker_trips_total", worker=w) for w in "abc"] == [1, 1, 1]
    assert value(samples, "npu_sync_reloads_total", result="ok") == 0


def test_histogram_buckets_count_and_sum_match_the_attempts(net, clock, registry):
    """Each attempt is observed once, in the bucket of its duration; _count equals attempts."""
    pool = WorkerPool(make_config("a", "b", "c"), transport_factory=net.factory, clock=clock)
    with pool, instrument(pool, registry):
        run_mixed_load(pool)
        samples = scrape(registry)

    hist = "npu_sync_attempt_duration_seconds"
    for wid in "abc":
        attempts = sum(
            value(samples, "npu_sync_attempts_total", worker=wid, outcome=o)
            for o in ("succeeded", "rejected", "not_here", "failed", "abandoned")
        )
        assert value(samples, f"{hist}_count", worker=wid) == attempts
        assert value(samples, f"{hist}_bucket", worker=wid, le="+Inf") == attempts
    buckets_a = {
        le: value(samples, f"{hist}_bucket", worker="a", le=le)
        for le in ("0.001", "0.005", "0.1", "0.25", "1.0", "2.5", "60.0")
        if (f"{hist}_bucket", (("le", le), ("worker", "a"))) in samples
    }
    assert buckets_a == {"0.005": 1, "0.1": 1, "0.25": 4, "1.0": 4, "2.5": 5, "60.0": 5}
    assert value(samples, f"{hist}_sum", worker="a") == pytest.approx(
        3 * OK_SECONDS + BAD_SECONDS + DOWN_SECONDS
    )
    assert value(samples, f"{hist}_sum", worker="b") == pytest.approx(BAD_SECONDS + DOWN_SECONDS)
    assert value(samples, f"{hist}_bucket", worker="b", le="1.0") == 1  # its refusal


def test_gauges_are_read_from_workers_and_stats_at_scrape_time(net, clock, registry):
    """In-flight, capacity, health, breaker one-hot, EWMA, failure rate match workers()."""
    entered, release = threading.Event(), threading.Event()
    ok = scripted(clock)

    def slow(req: FakeRequest) -> Response:
        entered.set()
        release.wait(timeout=10)
        return ok(req)

    pool = WorkerPool(make_config("a", "b", "c"), transport_factory=net.factory, clock=clock)
    with pool, instrument(pool, registry):
        run_mixed_load(pool)  # a, b and c now have open breakers
        pool.reload(make_config("a", "b", "c", "d"))
        net.route("d", slow)
        future = pool.submit({"kind": "ok"})
        assert entered.wait(timeout=10)
        samples = scrape(registry)
        workers = pool.workers()
        stats = pool.stats()
        release.set()
        assert future.result(timeout=10) == {"worker_id": "d"}

    assert value(samples, "npu_sync_worker_in_flight", worker="d") == 1
    for w in workers:
        wid = w["id"]
        expected_in_flight = 1 if wid == "d" else w["in_flight"]
        assert value(samples, "npu_sync_worker_in_flight", worker=wid) == expected_in_flight
        assert value(samples, "npu_sync_worker_capacity", worker=wid) == w["capacity"] == 4
        assert value(samples, "npu_sync_worker_healthy", worker=wid) == 1
        for state in ("closed", "open", "half-open"):
            expected = 1 if w["breaker"]["state"] == state else 0
            got = value(samples, "npu_sync_worker_breaker_state", worker=wid, state=state)
            assert got == expected, (wid, state)
        if w["latency"]["ewma_ms"] is None:
            assert ("npu_sync_worker_latency_ewma_seconds", (("worker", wid),)) not in samples
        else:
            assert value(
                samples, "npu_sync_worker_latency_ewma_seconds", worker=wid
            ) == pytest.approx(w["latency"]["ewma_ms"] / 1000)
        if w["failure_rate"] is None:
            assert ("npu_sync_worker_failure_ratio", (("worker", wid),)) not in samples
        else:
            assert value(samples, "npu_sync_worker_failure_ratio", worker=wid) == pytest.approx(
                w["failure_rate"]
            )
    assert value(samples, "npu_sync_worker_breaker_state", worker="b", state="open") == 1
    assert value(samples, "npu_sync_worker_failure_ratio", worker="c") == 1
    assert value(samples, "npu_sync_tasks_waiting") == stats["tasks"]["waiting"] == 0
    assert value(samples, "npu_sync_dead_letters_pending") == stats["dead_letters"]["pending"] == 1
    assert value(samples, "npu_sync_reloads_total", result="ok") == 1


def test_an_unhealthy_worker_reports_healthy_zero(net, clock, registry):
    """The healthy gauge follows the health-check thresholds."""
    net.route("b", lambda req: json_response(503, {"status": "starting"}))
    health = HealthConfig(enabled=False, unhealthy_threshold=1)
    pool = WorkerPool(make_config("a", "b", health=health), transport_factory=net.factory)
    with pool, instrument(pool, registry):
        pool.check_health()
        samples = scrape(registry)
    assert value(samples, "npu_sync_worker_healthy", worker="a") == 1
    assert value(samples, "npu_sync_worker_healthy", worker="b") == 0


def test_fallbacks_and_file_reloads_are_counted(net, clock, registry, tmp_path):
    """A task answered by its fallback and a rejected reload each bump their counter."""
    path = tmp_path / "npu_workers.yaml"
    path.write_text(
        "npu_workers:\n"
        "  workers:\n"
        "    - {id: a, url: 'http://127.0.0.1:9401'}\n"
        "  health: {enabled: false}\n"
        "  retry: {max_retries: 0}\n"
    )
    pool = WorkerPool.from_yaml(path, watch=False, transport_factory=net.factory, clock=clock)
    with pool, instrument(pool, registry):
        assert pool.execute({"kind": "down"}, fallback=lambda: {"local": True}) == {"local": True}
        path.write_text("npu_workers:\n  workers: []\n  bogus: 1\n")
        with pytest.raises(ConfigError):
            pool.reload()
        samples = scrape(registry)
    assert value(samples, "npu_sync_tasks_total", outcome="fallback") == 1
    assert value(samples, "npu_sync_tasks_total", outcome="failed") == 0
    assert value(samples, "npu_sync_reloads_total", result="failed") == 1
    assert value(samples, "npu_sync_reloads_total", result="ok") == 0


def test_the_hook_counts_constructed_events_and_ignores_the_rest(registry):
    """Each event type moves only its own counter; breaker moves other than to open don't."""
    pool = RecordingPool()
    with PrometheusExporter(pool, registry):
        for event in (
            TaskStarted(0.0, "t", "/inference"),
            WorkerHealthChanged(0.0, "a", False, "refused"),
            BreakerStateChanged(0.0, "a", "open", "half-open"),
            BreakerStateChanged(0.0, "a", "half-open", "closed"),
            Event(0.0),
        ):
            pool.fire(event)
        assert names(scrape(registry)) == {
            "npu_sync_tasks_total",
            "npu_sync_retries_total",
            "npu_sync_reloads_total",
            "npu_sync_model_placements_total",
            "npu_sync_model_load_seconds_total",
            "npu_sync_tasks_waiting",
            "npu_sync_dead_letters_pending",
        }
        assert set(scrape(registry).values()) == {0}

        for event in (
            AttemptFinished(0.0, "t", "a", 1, "not_here", 500, "Model x not loaded", 0.02),
            AttemptFinished(0.0, "t", "a", 2, "failure", None, "timeout", 61.0),
            RetryScheduled(0.0, "t", "a", 2, 0.1, "timeout"),
            BreakerStateChanged(0.0, "a", "closed", "open"),
            BreakerStateChanged(0.0, "a", "half-open", "open"),
            TaskSucceeded(0.0, "t", "b", 3, 1.0),
            TaskRejectedEvent(0.0, "t", None, 500, "no worker serves model 'x'"),
            TaskDeadLettered(0.0, "t", "dl-1", 3, "all failed"),
            TaskFallback(0.0, "t", "all failed"),
            TaskCancelled(0.0, "t"),
            ConfigReloaded(0.0, None, {"added": ["c"]}),
            ConfigReloadFailed(0.0, None, "npu_workers.workers[0].port: bad"),
        ):
            pool.fire(event)
        samples = scrape(registry)

    assert value(samples, "npu_sync_attempts_total", worker="a", outcome="not_here") == 1
    assert value(samples, "npu_sync_attempts_total", worker="a", outcome="failed") == 1
    hist = "npu_sync_attempt_duration_seconds"
    assert value(samples, f"{hist}_bucket", worker="a", le="0.025") == 1
    assert value(samples, f"{hist}_bucket", worker="a", le="60.0") == 1  # 61 s is past the last
    assert value(samples, f"{hist}_bucket", worker="a", le="+Inf") == 2
    assert value(samples, "npu_sync_retries_total") == 1
    assert value(samples, "npu_sync_breaker_trips_total", worker="a") == 2
    for outcome in ("succeeded", "rejected", "failed", "fallback", "cancelled"):
        assert value(samples, "npu_sync_tasks_total", outcome=outcome) == 1
    assert value(samples, "npu_sync_reloads_total", result="ok") == 1
    assert value(samples, "npu_sync_reloads_total", result="failed") == 1


def test_counts_stay_exact_under_concurrent_events(registry):
    """Events fired from many threads at once are all counted."""
    pool = RecordingPool()
    threads, per_thread = 8, 2000
    start = threading.Barrier(threads)

    def fire(n: int) -> None:
        start.wait()
        for i in range(per_thread):
            pool.fire(AttemptFinished(0.0, f"t{n}-{i}", f"w{n % 2}", 1, "success", 200, None, 0.1))

    with PrometheusExporter(pool, registry):
        workers = [threading.Thread(target=fire, args=(n,)) for n in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        samples = scrape(registry)
    for wid in ("w0", "w1"):
        expected = threads // 2 * per_thread
        assert (
            value(samples, "npu_sync_attempts_total", worker=wid, outcome="succeeded") == expected
        )
        assert value(samples, "npu_sync_attempt_duration_seconds_count", worker=wid) == expected


def test_close_removes_the_hook_and_unregisters_and_is_idempotent(registry):
    """After close() the pool no longer calls the exporter and the registry is empty."""
    pool = RecordingPool(("a",))
    exporter = PrometheusExporter(pool, registry)
    assert len(pool.hooks) == 1
    assert "npu_sync_worker_in_flight" in names(scrape(registry))
    exporter.close()
    exporter.close()
    assert pool.hooks == [] and len(pool.removed) == 1
    assert scrape(registry) == {}
    # Nothing is left registered under these names: the same pool can be exported again.
    with PrometheusExporter(pool, registry):
        assert "npu_sync_worker_in_flight" in names(scrape(registry))
    assert scrape(registry) == {}


def test_close_detaches_from_a_real_pool(net, clock, registry):
    """A closed exporter stops counting the pool's tasks."""
    with WorkerPool(make_config("a"), transport_factory=net.factory, clock=clock) as pool:
        exporter = instrument(pool, registry)
        pool.execute({"kind": "ok"})
        exporter.close()
        pool.execute({"kind": "ok"})
        assert exporter._counts.tasks["succeeded"] == 1


def test_a_failing_hook_never_fails_a_task_nor_stops_the_exporter(net, clock, registry):
    """A hook that raises is skipped; the task succeeds and later hooks still count it."""

    def broken(event: Event) -> None:
        raise RuntimeError("instrumentation bug")

    pool = WorkerPool(make_config("a"), transport_factory=net.factory, clock=clock, hooks=[broken])
    with pool, instrument(pool, registry):
        assert pool.execute({"kind": "ok"}) == {"worker_id": "a"}
        samples = scrape(registry)
    assert value(samples, "npu_sync_tasks_total", outcome="succeeded") == 1


def test_a_pool_whose_state_cannot_be_read_does_not_break_the_scrape(registry):
    """If workers() raises, the scrape still returns the event counters."""

    class Broken(RecordingPool):
        def workers(self) -> list[dict[str, Any]]:
            raise RuntimeError("store gone")

    pool = Broken()
    with PrometheusExporter(pool, registry):
        pool.fire(TaskSucceeded(0.0, "t", "a", 1, 0.1))
        samples = scrape(registry)
    assert value(samples, "npu_sync_tasks_total", outcome="succeeded") == 1
    assert "npu_sync_worker_in_flight" not in names(samples)


def test_two_pools_share_a_registry_with_distinct_const_labels(registry):
    """Pools labelled apart appear as separate series of one family each."""
    chat, embed = RecordingPool(("a",)), RecordingPool(("a", "b"))
    first = PrometheusExporter(chat, registry, const_labels={"pool": "chat"})
    second = PrometheusExporter(embed, registry, const_labels={"pool": "embed"})
    chat.fire(TaskSucceeded(0.0, "t", "a", 1, 0.1))
    embed.fire(TaskDeadLettered(0.0, "t", "dl", 1, "x"))
    samples = scrape(registry)
    assert value(samples, "npu_sync_tasks_total", pool="chat", outcome="succeeded") == 1
    assert value(samples, "npu_sync_tasks_total", pool="chat", outcome="failed") == 0
    assert value(samples, "npu_sync_tasks_total", pool="embed", outcome="failed") == 1
    assert value(samples, "npu_sync_worker_capacity", pool="embed", worker="b") == 1
    # Current workers have zero series before any event, so rate() works from the start.
    assert (
        value(samples, "npu_sync_attempts_total", pool="embed", worker="b", outcome="failed") == 0
    )
    assert value(samples, "npu_sync_attempt_duration_seconds_count", pool="embed", worker="b") == 0
    assert ("npu_sync_worker_capacity", (("pool", "chat"), ("worker", "b"))) not in samples
    first.close()
    samples = scrape(registry)
    assert {dict(labels).get("pool") for _, labels in samples} == {"embed"}
    second.close()
    assert scrape(registry) == {}


def test_const_labels_given_in_any_order_share_a_family(registry):
    """Label names are sorted, so {pool, env} and {env, pool} are the same label set."""
    with (
        PrometheusExporter(RecordingPool(), registry, const_labels={"pool": "x", "env": "a"}),
        PrometheusExporter(RecordingPool(), registry, const_labels={"env": "b", "pool": "y"}),
    ):
        samples = scrape(registry)
    assert value(samples, "npu_sync_tasks_waiting", pool="x", env="a") == 0
    assert value(samples, "npu_sync_tasks_waiting", pool="y", env="b") == 0


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (None, None),
        ({"pool": "x"}, {"pool": "x"}),
        ({"pool": "x"}, {"cluster": "y"}),
        ({"pool": "x"}, None),
    ],
)
def test_pools_that_would_collide_on_a_registry_are_refused(registry, first, second):
    """A second pool with no distinct labels, or other label names, raises ValueError."""
    with PrometheusExporter(RecordingPool(), registry, const_labels=first):
        other = RecordingPool()
        with pytest.raises(ValueError, match="const_labels"):
            PrometheusExporter(other, registry, const_labels=second)
        assert other.hooks == []
        assert value(scrape(registry), "npu_sync_tasks_total", outcome="failed", **first or {}) == 0


def test_the_exporter_of_a_closed_pool_makes_way_for_a_new_pool(net, clock, registry):
    """A pool built after another was closed can be exported on the same registry."""
    with WorkerPool(make_config("a"), transport_factory=net.factory, clock=clock) as old:
        metrics_text(old, registry)
        old.execute({"kind": "ok"})
    with WorkerPool(make_config("b"), transport_factory=net.factory, clock=clock) as new:
        body, _ = metrics_text(new, registry)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(body.decode())
        for s in f.samples
    }
    assert value(samples, "npu_sync_tasks_total", outcome="succeeded") == 0
    assert ("npu_sync_worker_capacity", (("worker", "b"),)) in samples
    assert ("npu_sync_worker_capacity", (("worker", "a"),)) not in samples


def test_the_same_pool_cannot_be_exported_twice_on_one_registry(registry):
    """Exporting a pool twice would count every event twice: ValueError."""
    pool = RecordingPool()
    with PrometheusExporter(pool, registry):
        with pytest.raises(ValueError, match="already exported"):
            PrometheusExporter(pool, registry, const_labels={"pool": "again"})
        assert len(pool.hooks) == 1


def test_a_pool_refusing_the_hook_leaves_the_registry_as_it_was(registry):
    """If add_hook raises, the collector is unregistered again and the error propagates."""

    class Refusing(RecordingPool):
        def add_hook(self, hook: Hook) -> None:
            raise RuntimeError("pool is closed")

    with pytest.raises(RuntimeError, match="closed"):
        PrometheusExporter(Refusing(), registry)
    assert scrape(registry) == {}
    with PrometheusExporter(RecordingPool(), registry):
        assert "npu_sync_tasks_total" in names(scrape(registry))


def test_a_name_clash_with_other_metrics_is_refused(registry):
    """Registering over a user's own metric of the same name raises, leaving no hook."""
    from prometheus_client import Counter

    Counter("npu_sync_tasks", "someone else's", registry=registry)
    pool = RecordingPool()
    with pytest.raises(ValueError, match="npu_sync_tasks"):
        PrometheusExporter(pool, registry)
    assert pool.hooks == []
    # A namespace of its own avoids the clash.
    with PrometheusExporter(pool, registry, namespace="inference"):
        assert "inference_tasks_total" in names(scrape(registry))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"namespace": "npu-sync"},
        {"buckets": []},
        {"buckets": [1.0, 0.5]},
        {"buckets": [0.1, 0.1]},
        {"buckets": [float("nan")]},
        {"const_labels": {"worker": "x"}},
        {"const_labels": {"__pool": "x"}},
        {"const_labels": {"bad-name": "x"}},
        {"const_labels": {"pool": 3}},
    ],
)
def test_invalid_arguments_are_refused(registry, kwargs):
    """Bad namespaces, buckets and labels raise ValueError and register nothing."""
    pool = RecordingPool()
    with pytest.raises(ValueError):
        PrometheusExporter(pool, registry, **kwargs)
    assert pool.hooks == [] and scrape(registry) == {}


def test_custom_buckets_and_namespace_are_used(registry):
    """The histogram uses the given bounds plus +Inf, under the given namespace."""
    pool = RecordingPool()
    with PrometheusExporter(pool, registry, namespace="npu", buckets=[0.5, 2.0, float("inf")]):
        for seconds in (0.5, 1.0, 3.0):  # a bound is inclusive: 0.5 is in le="0.5"
            pool.fire(AttemptFinished(0.0, "t", "a", 1, "success", 200, None, seconds))
        samples = scrape(registry)
    les = {
        dict(labels)["le"]: v
        for (name, labels), v in samples.items()
        if name == "npu_attempt_duration_seconds_bucket"
    }
    assert les == {"0.5": 1, "2.0": 2, "+Inf": 3}


def test_metrics_text_instruments_a_pool_once_and_returns_the_text_format(net, clock, registry):
    """The first call attaches an exporter; later calls reuse it (no double counting)."""
    with WorkerPool(make_config("a"), transport_factory=net.factory, clock=clock) as pool:
        body, content_type = metrics_text(pool, registry)
        assert content_type == CONTENT_TYPE_LATEST
        assert b"npu_sync_worker_in_flight" in body
        pool.execute({"kind": "ok"})
        body, _ = metrics_text(pool, registry)
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(body.decode())
            for s in f.samples
        }
        assert value(samples, "npu_sync_tasks_total", outcome="succeeded") == 1


def test_metrics_text_keeps_an_exporter_the_user_configured(registry):
    """An existing exporter for the pool, in any namespace, is not joined by a second one."""
    pool = RecordingPool()
    with PrometheusExporter(pool, registry, namespace="inference"):
        body, _ = metrics_text(pool, registry)
        assert len(pool.hooks) == 1
        assert b"inference_tasks_total" in body and b"npu_sync_" not in body


def test_the_default_registry_is_used_when_none_is_given():
    """Without a registry argument the exporter registers on prometheus_client.REGISTRY."""
    pool = RecordingPool(("a",))
    # A namespace of its own, so that no other exporter on the global registry interferes.
    with PrometheusExporter(pool, namespace="npu_sync_default_test") as exporter:
        assert exporter.registry is REGISTRY
        sample = REGISTRY.get_sample_value("npu_sync_default_test_worker_capacity", {"worker": "a"})
        assert sample == 1
    assert (
        REGISTRY.get_sample_value("npu_sync_default_test_worker_capacity", {"worker": "a"}) is None
    )


def test_import_npu_sync_does_not_need_or_load_prometheus_client():
    """npu_sync imports without prometheus_client; npu_sync.prometheus names the extra, to
    install from a clone."""
    code = (
        "import sys\n"
        "sys.modules['prometheus_client'] = None\n"  # makes any import of it fail
        "import npu_sync\n"
        "from npu_sync import WorkerPool\n"
        "try:\n"
        "    import npu_sync.prometheus\n"
        "except ImportError as exc:\n"
        "    print('refused:', exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "refused:" in out.stdout and "pip install -e '.[prometheus]'" in out.stdout
    assert bare_installs(out.stdout) == []

    code = "import sys, npu_sync; print('prometheus_client' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"


# -- counting from the pool's start-up -----------------------------------------------------


def test_counters_count_from_the_pools_start_up_not_from_attaching(net, clock, registry):
    """An exporter attached after tasks ran reports them: attempts, tasks, retries, trips."""
    with WorkerPool(make_config("a", "b", "c"), transport_factory=net.factory, clock=clock) as pool:
        run_mixed_load(pool)
        pool.reload(pool.config)
        with instrument(pool, registry):
            samples = scrape(registry)
            pool.reload(pool.config)
            after = scrape(registry)
    assert value(samples, "npu_sync_attempts_total", worker="a", outcome="succeeded") == 3
    assert value(samples, "npu_sync_attempts_total", worker="a", outcome="rejected") == 1
    for wid in "abc":
        assert value(samples, "npu_sync_attempts_total", worker=wid, outcome="failed") == 1
        assert value(samples, "npu_sync_breaker_trips_total", worker=wid) == 1
    tasks = {"succeeded": 3, "rejected": 1, "failed": 1, "fallback": 0}
    for outcome, n in tasks.items():
        assert value(samples, "npu_sync_tasks_total", outcome=outcome) == n
    assert value(samples, "npu_sync_retries_total") == 2
    assert value(samples, "npu_sync_reloads_total", result="ok") == 1
    # From there on the events move the counters, once each.
    assert value(after, "npu_sync_reloads_total", result="ok") == 2
    assert value(after, "npu_sync_tasks_total", outcome="succeeded") == 3
    # The histogram needs each attempt's duration, which the pool does not keep.
    assert value(samples, "npu_sync_attempt_duration_seconds_count", worker="a") == 0


def test_the_first_scrape_of_a_busy_pool_reports_everything_since_start_up(net, clock, registry):
    """metrics_text() instrumenting on first use still starts from the pool's totals."""
    with WorkerPool(make_config("a"), transport_factory=net.factory, clock=clock) as pool:
        for _ in range(4):
            pool.execute({"kind": "ok"})
        body, _ = metrics_text(pool, registry)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(body.decode())
        for s in f.samples
    }
    assert value(samples, "npu_sync_tasks_total", outcome="succeeded") == 4
    assert value(samples, "npu_sync_attempts_total", worker="a", outcome="succeeded") == 4


def test_no_metric_name_or_label_value_uses_the_old_spellings(net, clock, registry):
    """Attempts say succeeded/failed like tasks; the failure share is a _ratio."""
    pool = WorkerPool(make_config("a", "b", "c"), transport_factory=net.factory, clock=clock)
    with pool, instrument(pool, registry):
        run_mixed_load(pool)
        text = generate_latest(registry).decode()
    assert 'outcome="succeeded"' in text and 'outcome="failed"' in text
    assert "npu_sync_worker_failure_ratio" in text
    for old in ('"success"', '"failure"', "failure_rate"):
        assert old not in text, old


# -- multiprocess mode ----------------------------------------------------------------------


class FakePids:
    """Stands in for os.getpid in prometheus_client's multiprocess values, so that one
    test process can write the files of several gunicorn children."""

    def __init__(self) -> None:
        self.pid = 101

    def __call__(self) -> int:
        return self.pid


@pytest.fixture
def multiprocess(tmp_path, monkeypatch) -> tuple[FakePids, str]:
    """prometheus_client in multiprocess mode on a fresh directory, as under gunicorn."""
    from prometheus_client import values

    import npu_sync.prometheus as exporter_module

    directory = tmp_path / "prometheus"
    directory.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
    monkeypatch.setenv("NPU_SYNC_FLEET", "manual")
    pids = FakePids()
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue(pids))
    monkeypatch.setattr(exporter_module, "_files_by_namespace", {})
    monkeypatch.setattr(exporter_module, "_private_registry", None)
    yield pids, str(directory)
    close = getattr(values, "close_all_multiprocess_files", None)
    if close is not None:
        close()


def parse(body: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(body.decode())
        for s in f.samples
    }


def test_multiprocess_mode_sums_every_process_and_keeps_a_dead_ones_counters(
    net, clock, multiprocess
):
    """Two processes' counters add up in every scrape; once one dies (child_exit's
    mark_process_dead) its counters stay and its gauges go."""
    from prometheus_client.multiprocess import mark_process_dead

    pids, directory = multiprocess
    first = WorkerPool(make_config("a"), transport_factory=net.factory, clock=clock)
    with first:
        exporter = instrument(first)
        assert exporter.multiprocess
        for _ in range(3):
            first.execute({"kind": "ok"})
        one = parse(metrics_text(first)[0])
        exporter.close()
    assert value(one, "npu_sync_tasks_total", outcome="succeeded") == 3
    assert value(one, "npu_sync_worker_capacity", worker="a") == 4

    pids.pid = 102  # another gunicorn child
    second = WorkerPool(make_config("a"), transport_factory=net.factory, clock=clock)
    with second, instrument(second):
        for _ in range(2):
            second.execute({"kind": "ok"})
        both = parse(metrics_text(second)[0])
        mark_process_dead(101, directory)
        after = parse(metrics_text(second)[0])
    assert value(both, "npu_sync_tasks_total", outcome="succeeded") == 5
    assert value(both, "npu_sync_attempts_total", worker="a", outcome="succeeded") == 5
    assert value(both, "npu_sync_attempt_duration_seconds_count", worker="a") == 5
    assert value(both, "npu_sync_worker_capacity", worker="a") == 8  # livesum over both
    assert value(after, "npu_sync_tasks_total", outcome="succeeded") == 5
    assert value(after, "npu_sync_worker_capacity", worker="a") == 4


def test_multiprocess_gauges_are_written_on_each_fleet_monitor_sample(net, clock, multiprocess):
    """Another process's gauges are in the files without that process being scraped."""
    from prometheus_client import CollectorRegistry as Registry
    from prometheus_client.multiprocess import MultiProcessCollector

    from npu_sync._fleet import monitor_of

    _, directory = multiprocess
    pool = WorkerPool(make_config("a", "b"), transport_factory=net.factory, clock=clock)
    with pool, instrument(pool):
        everyone = Registry()
        MultiProcessCollector(everyone, directory)
        assert everyone.get_sample_value("npu_sync_worker_healthy", {"worker": "b"}) is None
        monitor_of(pool).tick()
        assert everyone.get_sample_value("npu_sync_worker_healthy", {"worker": "b"}) == 1
        assert everyone.get_sample_value("npu_sync_worker_capacity", {"worker": "a"}) == 4
        # Counter series exist from the start, at zero.
        attempts = everyone.get_sample_value(
            "npu_sync_attempts_total", {"worker": "b", "outcome": "failed"}
        )
        assert attempts == 0


def test_multiprocess_mode_refuses_a_registry_and_mismatched_buckets(multiprocess):
    """The metrics live in files there: a registry argument is a mistake, and so are
    buckets that differ from those already written under the namespace."""
    with pytest.raises(ValueError, match="multiprocess"):
        PrometheusExporter(RecordingPool(), CollectorRegistry())
    with (
        PrometheusExporter(RecordingPool(), const_labels={"pool": "x"}),
        pytest.raises(ValueError, match="buckets"),
    ):
        PrometheusExporter(RecordingPool(), const_labels={"pool": "y"}, buckets=[1.0])
