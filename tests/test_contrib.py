"""What contrib/ ships stays true: the Grafana dashboard and the PromQL in
docs/prometheus.md query only what the exporter emits (every metric name, label and
outcome, in every panel, variable and annotation), and the gunicorn.conf.py the docs
show is the file in contrib/."""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Iterator
from typing import Any

import pytest

from npu_sync import TaskFailed, TaskRejected, WorkerPool
from npu_sync.config import BreakerConfig, HealthConfig, PoolConfig, RetryConfig, worker_config
from npu_sync.testing import FakeNetwork, FakeRequest, json_response
from npu_sync.transport import Response

prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from npu_sync.prometheus import instrument  # noqa: E402

CONTRIB = pathlib.Path(__file__).resolve().parent.parent / "contrib"
DASHBOARD = CONTRIB / "grafana" / "npu_sync_dashboard.json"

# PromQL's own words: functions, aggregations, keywords. Anything else is a metric name.
PROMQL = {
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group", "by", "without", "on", "ignoring", "group_left", "group_right",
    "and", "or", "unless", "bool", "offset", "rate", "irate", "increase", "delta", "idelta",
    "histogram_quantile", "label_values", "abs", "clamp_min", "clamp_max", "vector",
    "max_over_time", "min_over_time", "avg_over_time", "sum_over_time", "resets", "changes",
    "time", "timestamp", "absent", "round", "ceil", "floor", "scalar", "sort", "sort_desc",
    "inf", "nan", "le",
}  # fmt: skip


def expressions(node: Any) -> Iterator[str]:
    """Every PromQL string of the dashboard: targets' expr, variables' queries,
    annotations' expr, at any depth (rows hold panels too)."""
    if isinstance(node, dict):
        for key, value in node.items():
            promql = key in ("expr", "definition") or (key == "query" and "(" in str(value))
            if promql and isinstance(value, str):
                yield value
            else:
                yield from expressions(value)
    elif isinstance(node, list):
        for item in node:
            yield from expressions(item)


def values_in(expr: str) -> set[tuple[str, str]]:
    """(label, value) of every matcher on a literal: ``outcome="failed"``, and each
    alternative of ``outcome=~"succeeded|failed"``."""
    found = set()
    for label, op, value in re.findall(r'([a-zA-Z_]\w*)\s*(=~|=)\s*"([^"$]*)"', expr):
        alternatives = value.split("|") if op == "=~" else [value]
        if op == "=~" and not all(re.fullmatch(r"[\w-]+", a) for a in alternatives):
            continue  # a real pattern, not a list of values
        found |= {(label, a) for a in alternatives}
    return found


def names_in(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) an expression refers to."""
    labels: set[str] = set()
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\$\{?\w+\}?", "", text)  # Grafana variables ($worker, $__rate_interval)
    for matchers in re.findall(r"\{([^}]*)\}", text):
        labels |= set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", matchers))
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range selectors
    for clause in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", text):
        labels |= {name.strip() for name in clause.split(",") if name.strip()}
    text = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", text)
    variable = re.match(r"\s*label_values\(\s*([\w:]+)\s*,\s*(\w+)\s*\)", expr)
    if variable:
        labels.add(variable.group(2))
        return {variable.group(1)}, labels
    words = set(re.findall(r"[a-zA-Z_:][\w:]*", text))
    return {w for w in words if w.lower() not in PROMQL}, labels


def answer(req: FakeRequest) -> Response:
    if req.path == "/health":
        return json_response(200, {"status": "healthy"})
    kind = req.json()["kind"]
    if kind == "bad":
        return json_response(422, {"detail": "no input"})
    if kind == "down":
        return json_response(503, {"detail": "overloaded"})
    return json_response(200, {"ok": True})


@pytest.fixture(scope="module")
def emitted() -> tuple[set[str], set[str], set[tuple[str, str]]]:
    """The sample names and label names a pool's exporter emits, every kind of series
    filled (successes, a rejection, failures, a breaker trip, a reload)."""
    config = PoolConfig(
        workers=(
            worker_config("a", "http://127.0.0.1:9801", priority=1),
            worker_config("b", "http://127.0.0.1:9802", priority=2),
        ),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=1, backoff_initial=0.0, backoff_max=0.0),
        circuit_breaker=BreakerConfig(fail_max=1, reset_timeout=60),
    )
    registry = CollectorRegistry()
    pool = WorkerPool(config, transport_factory=FakeNetwork(answer).factory)
    with pool, instrument(pool, registry):
        pool.execute({"kind": "ok"})
        with pytest.raises(TaskRejected):
            pool.execute({"kind": "bad"})
        with pytest.raises(TaskFailed):
            pool.execute({"kind": "down"})
        pool.reload(config)
        text = generate_latest(registry).decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    pairs = {pair for s in samples for pair in s.labels.items()}
    return {s.name for s in samples}, {label for label, _ in pairs}, pairs


def test_the_dashboard_is_a_grafana_dashboard_with_queries():
    """Valid JSON, a uid and title, and every panel but a row has at least one query."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] == "npu_sync"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 8
    for panel in panels:
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), panel["title"]


def test_every_query_names_only_metrics_and_labels_the_exporter_emits(emitted):
    """Each expression names at least one metric; all of them, and all its labels, are
    in a scrape of a real pool's exporter."""
    names, labels, pairs = emitted
    dashboard = json.loads(DASHBOARD.read_text())
    found = list(expressions(dashboard))
    assert len(found) >= 15
    for expr in found:
        metrics, used_labels = names_in(expr)
        assert metrics, f"names no metric: {expr}"
        assert metrics <= names, f"{sorted(metrics - names)} not emitted, in: {expr}"
        assert used_labels <= labels, f"labels {sorted(used_labels - labels)} not emitted: {expr}"
        assert values_in(expr) <= pairs, f"{sorted(values_in(expr) - pairs)} not emitted: {expr}"


def test_the_checker_catches_an_old_or_misspelt_name(emitted):
    """The renamed gauge, an old outcome value, a typo and a made-up label are caught."""
    names, labels, pairs = emitted
    for expr in (
        'max by (worker) (npu_sync_worker_failure_rate{worker=~"$worker"})',
        'sum(rate(npu_sync_attempts_total{outcome=~"success|failure"}[5m]))',
        "sum(rate(npu_sync_task_total[5m]))",
        "sum by (instance_id) (npu_sync_worker_in_flight)",
    ):
        metrics, used = names_in(expr)
        assert not (metrics <= names and used <= labels and values_in(expr) <= pairs), expr
    assert names_in("histogram_quantile(0.99, sum by (le) (rate(x_bucket[5m])))") == (
        {"x_bucket"},
        {"le"},
    )


def test_the_promql_in_the_docs_names_only_emitted_metrics(emitted):
    """docs/prometheus.md's example queries and alerts use today's names too."""
    names, labels, pairs = emitted
    docs = CONTRIB.parent / "docs" / "prometheus.md"
    blocks = re.findall(r"^```promql\n(.*?)^```$", docs.read_text(), re.S | re.M)
    assert blocks
    for block in blocks:
        code = "\n".join(line.split("#", 1)[0] for line in block.splitlines())
        metrics, used = names_in(code)
        assert metrics and metrics <= names, f"{sorted(metrics - names)} in: {block}"
        assert used <= labels, f"labels {sorted(used - labels)} in: {block}"
        assert values_in(code) <= pairs, f"{sorted(values_in(code) - pairs)} in: {block}"


def test_the_docs_show_contribs_gunicorn_conf_as_it_is():
    """docs/prometheus.md quotes contrib/gunicorn.conf.py whole, so the two cannot drift."""
    conf = (CONTRIB / "gunicorn.conf.py").read_text()
    docs = (CONTRIB.parent / "docs" / "prometheus.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", docs, re.S | re.M)
    assert conf in blocks


def load_conf(monkeypatch, tmp_path, **env: str) -> dict[str, Any]:
    """contrib/gunicorn.conf.py as gunicorn reads it, in an environment of its own."""
    import runpy
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for name in (
        "PROMETHEUS_MULTIPROC_DIR",
        "NPU_SYNC_CONFIG",
        "NPU_SYNC_APP",
        "NPU_SYNC_PROMETHEUS",
    ):
        # Set, then removed: monkeypatch then restores the variable as it was, also
        # when the file itself sets it (os.environ.setdefault), so none leaks into
        # later tests of this process (it would turn Prometheus on in their apps).
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return runpy.run_path(str(CONTRIB / "gunicorn.conf.py"))


def test_two_apps_on_one_host_keep_their_own_prometheus_counters(monkeypatch, tmp_path):
    """Two apps (two configuration files) get two metrics directories, and the second
    starting does not remove the first one's counters."""
    first = load_conf(monkeypatch, tmp_path, NPU_SYNC_CONFIG=str(tmp_path / "a" / "npu.yaml"))
    first["on_starting"](None)
    counters = pathlib.Path(first["prometheus_dir"]) / "counter_123.db"
    counters.write_bytes(b"first app's counts")
    second = load_conf(monkeypatch, tmp_path, NPU_SYNC_CONFIG=str(tmp_path / "b" / "npu.yaml"))
    second["on_starting"](None)
    assert second["prometheus_dir"] != first["prometheus_dir"]
    assert counters.read_bytes() == b"first app's counts"
    named = load_conf(monkeypatch, tmp_path, NPU_SYNC_APP="billing")
    assert named["prometheus_dir"] not in (first["prometheus_dir"], second["prometheus_dir"])
    assert (pathlib.Path(first["prometheus_dir"]).parent.stat().st_mode & 0o077) == 0
