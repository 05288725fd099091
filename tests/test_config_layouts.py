"""AutoBot's two YAML layouts: the npu: one and the one its admin UI reads and writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from npu_sync import WorkerPool
from npu_sync.config import (
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    check_reload,
    load_config,
    parse_config,
)
from npu_sync.errors import ConfigError
from npu_sync.testing import FakeNetwork, json_response

# The shape of config/npu_workers.yaml as AutoBot's admin UI saves it (yaml.dump of its
# models: keys sorted, block style, workers first written by id). Values are made up.
ADMIN_UI = """\
load_balancing:
  health_check_interval: 45
  retry_cooldown_seconds: 90
  retry_failed_workers: true
  strategy: priority
  timeout_seconds: 8
workers:
- enabled: true
  id: npu-worker-linux-a
  max_concurrent_tasks: 6
  name: NPU Worker A (Linux VM)
  platform: linux
  priority: 7
  url: http://10.1.2.3:8081
  weight: 2
- enabled: false
  id: npu-worker-windows-b
  max_concurrent_tasks: 3
  name: Windows NPU Worker (Desk Machine)
  platform: windows
  priority: 2
  url: http://10.1.2.4:8082
  weight: 40
"""


def errors_of(data: Any) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value.errors


def test_the_admin_ui_file_loads_and_maps_every_key(tmp_path: Path) -> None:
    """Each key of the admin UI's file lands on its npu_sync field."""
    path = tmp_path / "npu_workers.yaml"
    path.write_text(ADMIN_UI, encoding="utf-8")
    cfg = load_config(path)
    a, b = cfg.workers
    assert (a.id, a.name, a.url, a.platform, a.protocol) == (
        "npu-worker-linux-a",
        "NPU Worker A (Linux VM)",
        "http://10.1.2.3:8081",
        "linux",
        "autobot-linux",
    )
    assert (a.enabled, a.max_concurrent, a.weight, a.priority) == (True, 6, 2, 1)
    assert (b.id, b.name, b.platform, b.protocol) == (
        "npu-worker-windows-b",
        "Windows NPU Worker (Desk Machine)",
        "windows",
        "autobot-windows",
    )
    # Priority 7 beats 2 in AutoBot (higher preferred): tiers 1 and 2 here.
    assert (b.enabled, b.max_concurrent, b.weight, b.priority) == (False, 3, 40, 2)
    assert cfg.balancing.strategy == "priority"
    assert (cfg.health.interval, cfg.health.timeout) == (45.0, 8.0)
    assert cfg.circuit_breaker.reset_timeout == 90.0
    assert cfg.layout == "" and cfg.key_path("workers") == "workers"
    # Everything the file does not say keeps npu_sync's defaults.
    defaults = PoolConfig()
    assert (cfg.retry, cfg.timeouts, cfg.transport) == (
        defaults.retry,
        defaults.timeouts,
        defaults.transport,
    )


def test_admin_ui_errors_name_autobots_own_keys() -> None:
    """A bad value in the admin-UI layout is reported under the key the file used."""
    data = yaml.safe_load(ADMIN_UI)
    data["load_balancing"].update(strategy="fastest", timeout_seconds=0)
    data["load_balancing"]["retry_failed_workers"] = "sometimes"
    data["workers"][1]["weight"] = 101
    data["workers"][0]["colour"] = "red"
    data["tags"] = 1
    assert errors_of(data) == (
        "tags: unknown key",
        "load_balancing.retry_failed_workers: must be true or false, got 'sometimes'",
        "load_balancing.timeout_seconds: must be > 0 and <= 3600, got 0",
        "load_balancing.strategy: must be one of 'least-loaded', 'round-robin', 'weighted', "
        "'priority', 'weighted-random', 'priority-failover', got 'fastest'",
        "workers[0].colour: unknown key",
        "workers[1].weight: must be 1..100, got 101",
    )


def test_a_load_balancing_key_and_its_npu_sync_key_together_are_refused() -> None:
    """health_check_interval and health.interval in one file: one must go."""
    data = yaml.safe_load(ADMIN_UI)
    data["health"] = {"interval": 10}
    assert errors_of(data) == (
        "load_balancing.health_check_interval: sets health.interval, which the file gives "
        "too: keep one",
    )


def test_npu_sync_sections_sit_beside_the_admin_ui_keys() -> None:
    """npu_sync's own sections may be added at the top level of the admin-UI layout."""
    data = yaml.safe_load(ADMIN_UI)
    data["retry"] = {"max_retries": 1}
    data["balancing"] = {"slow_start": 0}
    cfg = parse_config(data)
    assert cfg.retry.max_retries == 1
    assert (cfg.balancing.slow_start, cfg.balancing.strategy) == (0.0, "priority")


def test_the_npu_layout_takes_load_balancing_too() -> None:
    """Under npu:, load_balancing maps the same way, with npu. in its key paths."""
    data = {
        "npu": {
            "workers": [{"id": "a", "host": "h"}],
            "load_balancing": {"strategy": "round-robin", "health_check_interval": 5},
        }
    }
    cfg = parse_config(data)
    assert (cfg.balancing.strategy, cfg.health.interval) == ("round-robin", 5.0)
    data["npu"]["load_balancing"] = {"stratgy": "round-robin"}
    assert errors_of(data) == (
        "npu.load_balancing.stratgy: unknown key (did you mean 'strategy'?)",
    )


def test_load_balancing_is_not_a_native_key() -> None:
    """npu_workers: keeps its own names: load_balancing there is an unknown key."""
    (message,) = errors_of({"npu_workers": {"load_balancing": {"strategy": "priority"}}})
    assert message == "npu_workers.load_balancing: unknown key (did you mean 'balancing'?)"


def test_names_with_spaces_become_unique_slugs_in_the_npu_layout() -> None:
    """A worker named for people gets a safe, de-duplicated id; the name stays for display."""
    data = {
        "npu": {
            "workers": [
                {"name": "Windows NPU Worker (Main Machine)", "host": "h1"},
                {"name": "Windows NPU Worker (Main Machine)", "host": "h2"},
                {"id": "vm2-npu", "name": "VM2 NPU", "host": "h3"},
                {"name": "VM2  NPU", "host": "h4"},
                {"name": "plain-name", "host": "h5"},
            ]
        }
    }
    workers = parse_config(data).workers
    assert [(w.id, w.name) for w in workers] == [
        ("windows-npu-worker-main-machine", "Windows NPU Worker (Main Machine)"),
        ("windows-npu-worker-main-machine-2", "Windows NPU Worker (Main Machine)"),
        ("vm2-npu", "VM2 NPU"),
        ("vm2-npu-2", "VM2  NPU"),  # the id written in the file keeps its own
        ("plain-name", "plain-name"),
    ]


def test_a_name_without_spaces_is_still_the_id_and_duplicates_stay_errors() -> None:
    """Two workers with the same space-free name are a duplicate id, as before."""
    data = {"npu": {"workers": [{"name": "w", "host": "h1"}, {"name": "w", "host": "h2"}]}}
    assert errors_of(data) == ("npu.workers[1].id: duplicate id 'w' (also workers[0])",)


def test_a_reload_refusal_names_the_admin_ui_key() -> None:
    """check_reload's message uses the admin-UI key path, without a layout prefix."""
    old = parse_config(yaml.safe_load(ADMIN_UI))
    data = yaml.safe_load(ADMIN_UI)
    data["workers"] = []
    with pytest.raises(ConfigError) as info:
        check_reload(old, parse_config(data))
    assert info.value.errors[0].startswith("workers: the new configuration has no enabled worker")


def echo(req: Any) -> Any:
    return json_response(200, {"worker_id": req.worker_id})


def test_an_admin_ui_file_rewritten_with_a_changed_worker_reloads(tmp_path: Path) -> None:
    """After the UI rewrites the file, pool.reload() applies the changed and added workers."""
    path = tmp_path / "npu_workers.yaml"
    path.write_text(ADMIN_UI, encoding="utf-8")
    net = FakeNetwork(echo)
    with WorkerPool.from_yaml(path, watch=False, transport_factory=net.factory) as pool:
        data = yaml.safe_load(ADMIN_UI)
        data["workers"][0].update(max_concurrent_tasks=9, weight=5)
        data["workers"][1]["enabled"] = True
        data["workers"].append(
            {
                "enabled": True,
                "id": "npu-worker-linux-c",
                "max_concurrent_tasks": 2,
                "name": "NPU Worker C",
                "platform": "linux",
                "priority": 7,
                "url": "http://10.1.2.5:8081",
                "weight": 1,
            }
        )
        data["load_balancing"]["health_check_interval"] = 60
        # As the UI writes it: yaml.dump, keys sorted, block style.
        path.write_text(yaml.dump(data, default_flow_style=False), encoding="utf-8")
        result = pool.reload()
        assert result.added == ("npu-worker-linux-c",)
        assert set(result.updated) == {"npu-worker-linux-a", "npu-worker-windows-b"}
        rows = {row["id"]: row for row in pool.workers()}
        assert set(rows) == {"npu-worker-linux-a", "npu-worker-windows-b", "npu-worker-linux-c"}
        assert rows["npu-worker-windows-b"]["enabled"] is True
        result = pool.execute({"x": 1})
        assert result["worker_id"] in {"npu-worker-linux-a", "npu-worker-linux-c"}


def test_the_admin_ui_shape_is_what_autobot_writes() -> None:
    """The test file has the admin UI's keys exactly: workers and load_balancing."""
    data = yaml.safe_load(ADMIN_UI)
    assert set(data) == {"workers", "load_balancing"}
    assert set(data["load_balancing"]) == {
        "strategy",
        "health_check_interval",
        "timeout_seconds",
        "retry_failed_workers",
        "retry_cooldown_seconds",
    }
    for worker in data["workers"]:
        assert set(worker) == {
            "id",
            "name",
            "url",
            "platform",
            "enabled",
            "priority",
            "weight",
            "max_concurrent_tasks",
        }
    # The mapping test would prove nothing if these were npu_sync's defaults anyway.
    assert HealthConfig().interval != 45 and BreakerConfig().reset_timeout != 90


# AutoBot's committed example file (npu: layout, with health_monitoring and its own
# circuit_breaker and load_balancing keys), reproduced in shape with values of our own.
EXAMPLE_FILE = """\
npu:
  load_balancing:
    strategy: "weighted-random"
    max_retries: 2
    request_timeout: 120
  health_monitoring:
    enabled: true
    check_interval: 15
    timeout: 4
    failure_threshold: 3
  circuit_breaker:
    enabled: true
    failure_threshold: 6
    success_threshold: 2
    retry_timeout: 45
  workers:
    - id: "lab-npu-1"
      name: "Lab NPU Worker"
      host: "10.9.8.7"
      port: 8081
      enabled: true
      priority: 9
      weight: 60
      max_concurrent: 6
      capabilities: ["llm", "vision"]
      tags: {site: "lab", cost: "low"}
    - id: "lab-npu-2"
      name: "Lab NPU Worker Two"
      host: "10.9.8.8"
      port: 8082
      enabled: false
      priority: 3
      weight: 15
      max_concurrent: 2
      capabilities: ["llm"]
      tags: {site: "lab"}
"""


def test_autobots_example_file_loads_and_maps_every_key(tmp_path: Path) -> None:
    """health_monitoring.*, load_balancing.max_retries/request_timeout and AutoBot's
    circuit_breaker keys become npu_sync's; success_threshold 2 is one warning line."""
    path = tmp_path / "npu_workers.yaml"
    path.write_text(EXAMPLE_FILE)
    cfg = load_config(path)
    assert cfg.balancing.strategy == "weighted-random"
    assert (cfg.retry.max_retries, cfg.timeouts.read) == (2, 120.0)
    health = cfg.health
    assert (health.enabled, health.interval, health.timeout, health.unhealthy_threshold) == (
        True,
        15.0,
        4.0,
        3,
    )
    assert (cfg.circuit_breaker.fail_max, cfg.circuit_breaker.reset_timeout) == (6, 45.0)
    assert [(w.id, w.priority, w.weight, w.max_concurrent, w.enabled) for w in cfg.workers] == [
        ("lab-npu-1", 1, 60, 6, True),
        ("lab-npu-2", 2, 15, 2, False),
    ]
    (warning,) = cfg.warnings
    assert warning.startswith("npu.circuit_breaker.success_threshold: 2 has no effect: ")


def test_autobots_example_keys_are_checked_under_their_own_paths() -> None:
    """A bad AutoBot value names its AutoBot key; giving one and its npu_sync key is refused."""
    data = yaml.safe_load(EXAMPLE_FILE)
    data["npu"]["health_monitoring"]["check_interval"] = 0
    data["npu"]["circuit_breaker"]["fail_max"] = 3
    data["npu"]["circuit_breaker"]["enabled"] = "yes"
    data["npu"]["load_balancing"]["strategy"] = "fastest"
    errors = errors_of(data)
    assert "npu.health_monitoring.check_interval: must be > 0 and <= 86400, got 0" in errors
    assert (
        "npu.circuit_breaker.failure_threshold: sets circuit_breaker.fail_max, which the file "
        "gives too: keep one"
    ) in errors
    assert "npu.circuit_breaker.enabled: must be true or false, got 'yes'" in errors
    assert any(e.startswith("npu.load_balancing.strategy: must be one of") for e in errors)


def test_a_breaker_turned_off_is_a_warning_not_an_error() -> None:
    """circuit_breaker.enabled: false loads, with the one line saying why it does nothing."""
    data = yaml.safe_load(EXAMPLE_FILE)
    data["npu"]["circuit_breaker"] = {"enabled": False}
    (warning,) = parse_config(data).warnings
    assert warning.startswith("npu.circuit_breaker.enabled: false has no effect: ")


@pytest.mark.parametrize("strategy", ["weighted-random", "priority-failover"])
def test_the_admin_ui_layout_takes_autobots_documented_strategies(strategy: str) -> None:
    """Both strategy names of AutoBot's example are accepted in the admin-UI layout too."""
    data = {
        "workers": [{"id": "a", "url": "http://h:8081"}],
        "load_balancing": {"strategy": strategy},
    }
    assert parse_config(data).balancing.strategy == strategy


@pytest.mark.parametrize(
    "data",
    [
        {"load_balancing": {"strategy": "round_robin"}},
        {"health_monitoring": {"enabled": True}, "circuit_breaker": {"failure_threshold": 3}},
    ],
    ids=["load_balancing only", "settings only"],
)
def test_an_admin_ui_file_without_its_workers_list_is_refused(data: dict[str, Any]) -> None:
    """AutoBot's admin UI always writes workers:; a file of its settings alone (a fragment,
    or a save cut short) is refused naming the missing key, not loaded as an empty pool."""
    (error,) = errors_of(data)
    assert error.startswith("workers: required: the file has only ")


def test_an_admin_ui_file_with_an_empty_workers_list_still_loads() -> None:
    """An explicit workers: [] is a fleet of none, for the reload guard to judge."""
    assert parse_config({"workers": [], "load_balancing": {}}).workers == ()
