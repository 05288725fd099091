"""Tests for npu_sync.config: parsing, validation and the two YAML layouts."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from npu_sync.config import (
    AdmissionConfig,
    BalancingConfig,
    BreakerConfig,
    DeadLetterConfig,
    FleetConfig,
    HealthConfig,
    ModelsConfig,
    PoolConfig,
    PoolSettings,
    PriorityConfig,
    ReloadConfig,
    RetryConfig,
    SharedStateConfig,
    TimeoutConfig,
    TLSConfig,
    TransportConfig,
    WorkerConfig,
    check_reload,
    config_for_url,
    load_config,
    parse_config,
    parse_yaml,
    worker_config,
)
from npu_sync.errors import ConfigError

DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

DESIGN_YAML = """\
npu_workers:
  workers:
    - id: vm2-npu
      host: 172.16.168.22
      port: 8081
      priority: 1            # lower number = preferred tier
      max_concurrent: 8
    - id: windows-npu
      url: http://172.16.168.20:8082   # url or host+port
      priority: 2
      headers: {Authorization: "Bearer ${NPU_TOKEN}"}
  health:          {interval: 30, timeout: 2, unhealthy_threshold: 2, healthy_threshold: 1}
  circuit_breaker: {fail_max: 5, reset_timeout: 60, max_reset_timeout: 600}
  retry:           {max_retries: 3, backoff_initial: 0.05, backoff_max: 2.0}
  timeouts:        {connect: 2, read: 30}
  dead_letter:     {backend: sqlite, path: npu_dead_letters.sqlite3}
"""


def errors_of(data: Any, **kwargs: Any) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as info:
        parse_config(data, **kwargs)
    return info.value.errors


def native(**sections: Any) -> dict[str, Any]:
    return {"npu_workers": sections}


def one_worker(**fields: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"id": "w", "host": "127.0.0.1"}
    entry.update(fields)
    return native(workers=[entry])


def write(tmp_path: Path, text: str, name: str = "npu_workers.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


# -- the happy path ---------------------------------------------------------------------


def test_design_example_parses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented example configuration loads into the expected objects."""
    monkeypatch.setenv("NPU_TOKEN", "s3cret")
    cfg = load_config(write(tmp_path, DESIGN_YAML))
    vm2, win = cfg.workers
    assert vm2 == WorkerConfig(
        id="vm2-npu", url="http://172.16.168.22:8081", priority=1, max_concurrent=8
    )
    assert win.url == "http://172.16.168.20:8082"
    assert win.priority == 2
    assert dict(win.headers) == {"Authorization": "Bearer s3cret"}
    assert cfg.health == HealthConfig(interval=30.0, timeout=2.0)
    assert cfg.circuit_breaker == BreakerConfig()
    assert cfg.retry == RetryConfig()
    assert cfg.timeouts == TimeoutConfig(connect=2.0, read=30.0)
    assert cfg.dead_letter == DeadLetterConfig(
        backend="sqlite", path=str(tmp_path / "npu_dead_letters.sqlite3")
    )
    assert cfg.source == str(tmp_path / "npu_workers.yaml")


def test_docs_yaml_examples_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every YAML example in docs/configuration.md is a valid configuration."""
    monkeypatch.setenv("NPU_TOKEN", "t")
    monkeypatch.setenv("NPU_SERVICE_SECRET", "s")
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(encoding="utf-8"), re.S)
    assert len(blocks) >= 2
    for block in blocks:
        cfg = parse_config(yaml.safe_load(block), base_dir="/etc/npu")
        assert cfg.workers


def test_defaults_match_the_documented_values() -> None:
    """A config with no settings has exactly the documented defaults."""
    cfg = parse_config(native())
    assert cfg == PoolConfig()
    assert cfg.workers == ()
    assert cfg.health == HealthConfig(True, 30.0, 2.0, 2, 1, "/health")
    assert cfg.circuit_breaker == BreakerConfig(5, 60.0, 600.0)
    assert cfg.retry == RetryConfig(3, 0.05, 2.0)
    assert cfg.timeouts == TimeoutConfig(2.0, 20.0, 25.0)
    assert cfg.dead_letter == DeadLetterConfig("memory", None, 10000)
    assert cfg.transport == TransportConfig("builtin", 16 * 1024 * 1024, TLSConfig(True), 4.0)
    assert cfg.pool == PoolSettings(32, "/inference", 10.0)
    worker = parse_config(one_worker()).workers[0]
    assert (worker.priority, worker.max_concurrent, worker.enabled) == (1, 32, True)
    assert dict(worker.headers) == {}
    assert worker.tls is None
    assert worker.url == "http://127.0.0.1:8081"


def test_null_sections_mean_defaults() -> None:
    """A section left empty in YAML (null) takes its defaults instead of failing."""
    cfg = parse_config(yaml.safe_load("npu_workers:\n  workers:\n  health:\n  retry:\n"))
    assert cfg == PoolConfig()


def test_float_fields_accept_integers() -> None:
    """A number field takes an integer and stores it as a float."""
    cfg = parse_config(native(timeouts={"read": 45}))
    assert cfg.timeouts.read == 45.0
    assert isinstance(cfg.timeouts.read, float)


# -- one test per kind of mistake -------------------------------------------------------


def test_unknown_top_level_key() -> None:
    """A top-level key other than npu_workers/npu is reported by name."""
    assert errors_of({"npu_workers": {}, "extras": 1}) == ("extras: unknown key",)


def test_unknown_section_key_names_full_path() -> None:
    """An unknown key in a section is reported with its full path and a suggestion."""
    (message,) = errors_of(native(retry={"max_retriez": 1}))
    assert message.startswith("npu_workers.retry.max_retriez: unknown key")
    assert "did you mean 'max_retries'" in message


def test_unknown_sub_section() -> None:
    """A misspelt section name under npu_workers is an unknown key."""
    (message,) = errors_of(native(timeout={"read": 1}))
    assert message.startswith("npu_workers.timeout: unknown key")


def test_unknown_worker_key() -> None:
    """An unknown key in a worker entry names the entry's index."""
    (message,) = errors_of(one_worker(colour=3))
    assert message == "npu_workers.workers[0].colour: unknown key"


def test_wrong_type_names_path_and_value() -> None:
    """A string where a number belongs is reported with the value as written."""
    assert errors_of(native(timeouts={"read": "fast"})) == (
        "npu_workers.timeouts.read: must be a number, got 'fast'",
    )


def test_booleans_are_not_numbers() -> None:
    """true is rejected for integer and number fields alike."""
    errors = errors_of(
        native(workers=[{"id": "w", "host": "h", "port": True}], health={"interval": False})
    )
    assert errors == (
        "npu_workers.workers[0].port: must be an integer, got true",
        "npu_workers.health.interval: must be a number, got false",
    )


def test_integer_fields_reject_floats_and_strings() -> None:
    """An integer field refuses 8.0 and '8'."""
    errors = errors_of(native(retry={"max_retries": 3.0}, pool={"threads": "8"}))
    assert errors == (
        "npu_workers.retry.max_retries: must be an integer, got 3.0",
        "npu_workers.pool.threads: must be an integer, got '8'",
    )


def test_boolean_field_rejects_strings() -> None:
    """enabled must be a YAML boolean, not the string 'yes'."""
    (message,) = errors_of(one_worker(enabled="yes"))
    assert message == "npu_workers.workers[0].enabled: must be true or false, got 'yes'"


def test_non_finite_numbers_rejected() -> None:
    """.inf and .nan are not accepted as timeouts."""
    errors = errors_of(yaml.safe_load("npu_workers: {timeouts: {read: .inf, connect: .nan}}"))
    assert errors == (
        "npu_workers.timeouts.connect: must be a finite number, got nan",
        "npu_workers.timeouts.read: must be a finite number, got inf",
    )


@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        ("health", "interval", 0, "must be > 0 and <= 86400, got 0"),
        ("health", "timeout", -1.5, "must be > 0 and <= 3600, got -1.5"),
        ("health", "unhealthy_threshold", 0, "must be 1..1000, got 0"),
        ("health", "healthy_threshold", 0, "must be 1..1000, got 0"),
        ("health", "endpoint", "health", "must be a path starting with '/', got 'health'"),
        ("circuit_breaker", "fail_max", 0, "must be 1..10000, got 0"),
        ("circuit_breaker", "reset_timeout", 0, "must be > 0 and <= 86400, got 0"),
        ("retry", "max_retries", -1, "must be 0..100, got -1"),
        ("retry", "backoff_initial", -0.1, "must be >= 0 and <= 3600, got -0.1"),
        ("timeouts", "connect", 0, "must be > 0 and <= 3600, got 0"),
        ("timeouts", "task", 0.0, "must be > 0 and <= 86400, got 0.0"),
        ("dead_letter", "max_records", 0, "must be 1..10000000, got 0"),
        (
            "dead_letter",
            "backend",
            "disk",
            "must be one of 'memory', 'sqlite', 'redis', got 'disk'",
        ),
        (
            "transport",
            "client",
            "httpx",
            "must be one of 'builtin', 'urllib3', 'requests', got 'httpx'",
        ),
        ("transport", "max_response_bytes", 0, "must be 1..1073741824, got 0"),
        ("transport", "idle_timeout", 0, "must be > 0 and <= 3600, got 0"),
        ("pool", "threads", 0, "must be 1..4096, got 0"),
        ("pool", "max_queue_wait", -1, "must be > 0 and <= 86400, got -1"),
        ("pool", "default_endpoint", "x", "must be a path starting with '/', got 'x'"),
    ],
)
def test_out_of_range_values(section: str, key: str, value: Any, expected: str) -> None:
    """Each pool-level range rule reports the key path and the bad value."""
    assert errors_of(native(**{section: {key: value}})) == (
        f"npu_workers.{section}.{key}: {expected}",
    )


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("port", 0, "must be 1..65535, got 0"),
        ("port", 65536, "must be 1..65535, got 65536"),
        ("priority", -1, "must be 0..1000000, got -1"),
        ("max_concurrent", 0, "must be 1..10000, got 0"),
        ("scheme", "ftp", "must be one of 'http', 'https', got 'ftp'"),
        ("host", "bad host", "must be a host name or IP address, got 'bad host'"),
        ("id", "", "must be 1..200 printable characters without spaces, got ''"),
        ("id", 7, "must be a string, got 7"),
    ],
)
def test_worker_field_errors(field: str, value: Any, expected: str) -> None:
    """Each per-worker rule reports workers[i].<key> and the bad value."""
    data = native(workers=[{"id": "ok", "host": "h1"}, {"id": "w2", "host": "h2", field: value}])
    assert errors_of(data) == (f"npu_workers.workers[1].{field}: {expected}",)


def test_duplicate_id_names_both_indexes() -> None:
    """Two workers with one id: the message names the second entry and the first."""
    data = native(
        workers=[
            {"id": "a", "host": "h1"},
            {"id": "b", "host": "h2"},
            {"id": "a", "host": "h3"},
        ]
    )
    assert errors_of(data) == ("npu_workers.workers[2].id: duplicate id 'a' (also workers[0])",)


def test_duplicate_normalised_address() -> None:
    """Two spellings of one address are caught after normalisation."""
    data = native(
        workers=[
            {"id": "a", "url": "HTTP://Box:8081/"},
            {"id": "b", "host": "box"},
        ]
    )
    assert errors_of(data) == (
        "npu_workers.workers[1].host: duplicate address http://box:8081 (also workers[0])",
    )


def test_url_and_host_together() -> None:
    """A worker may give url or host, not both."""
    data = native(workers=[{"id": "a", "url": "http://h:1", "host": "h"}])
    assert errors_of(data) == ("npu_workers.workers[0]: give url or host (with port), not both",)


def test_port_with_url_rejected() -> None:
    """port only goes with host; next to url it is an error."""
    data = native(workers=[{"id": "a", "url": "http://h:1", "port": 2}])
    assert errors_of(data) == (
        "npu_workers.workers[0].port: goes with host, not url: put it in the url",
    )


def test_missing_id() -> None:
    """A native worker without an id is reported at .id."""
    assert errors_of(native(workers=[{"host": "h"}])) == ("npu_workers.workers[0].id: required",)


def test_missing_address() -> None:
    """A worker with neither url nor host is reported at the entry."""
    assert errors_of(native(workers=[{"id": "a"}])) == (
        "npu_workers.workers[0]: needs a url, or a host (and port)",
    )


def test_worker_entry_must_be_a_mapping() -> None:
    """A bare string in the workers list is reported with its index."""
    assert errors_of(native(workers=["http://h:1"])) == (
        "npu_workers.workers[0]: must be a mapping, got 'http://h:1'",
    )


def test_workers_must_be_a_list() -> None:
    """workers as a mapping is a type error."""
    assert errors_of(native(workers={"a": 1})) == (
        "npu_workers.workers: must be a list of workers, got a mapping",
    )


def test_bad_url_scheme() -> None:
    """Only http and https URLs are accepted."""
    data = native(workers=[{"id": "a", "url": "ftp://h:21"}])
    assert errors_of(data) == (
        "npu_workers.workers[0].url: scheme must be 'http' or 'https', got 'ftp'",
    )


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("h:8081", "must be an http(s) URL such as http://host:8081, got 'h:8081'"),
        ("http://h:8081/v1?x=1", "with no query or fragment, got 'http://h:8081/v1?x=***'"),
        ("http://h:8081?x=1", "with no query or fragment"),
        ("http://h:8081/v1#top", "with no query or fragment"),
        ("http://h:8081/a/../b", "base path that is not plain /segments"),
        ("http://h:8081/a//b", "base path that is not plain /segments"),
        ("http://h:8081/a b", "base path that is not plain /segments"),
        ("http://h:99999", "has an invalid port, got 'http://h:99999'"),
        ("http://:8081", "has no host, got 'http://:8081'"),
    ],
)
def test_bad_urls(url: str, expected: str) -> None:
    """Malformed worker URLs are rejected with the reason."""
    (message,) = errors_of(native(workers=[{"id": "a", "url": url}]))
    assert message.startswith("npu_workers.workers[0].url: ")
    assert expected in message


@pytest.mark.parametrize(
    ("url", "normal", "base"),
    [
        ("http://h:8081/api/v1", "http://h:8081/api/v1", "/api/v1"),
        ("http://h:8081/api/v1/", "http://h:8081/api/v1", "/api/v1"),
        ("https://h/npu", "https://h:443/npu", "/npu"),
        ("http://h:8081/", "http://h:8081", ""),
    ],
)
def test_a_url_with_a_base_path_is_kept_without_its_trailing_slash(
    url: str, normal: str, base: str
) -> None:
    """A worker behind a path prefix keeps the prefix in url and base_path."""
    (worker,) = parse_config(native(workers=[{"id": "a", "url": url}])).workers
    assert (worker.url, worker.base_path) == (normal, base)


def test_url_credentials_rejected_without_echo() -> None:
    """A password in a URL is an error, and the message does not repeat it."""
    (message,) = errors_of(native(workers=[{"id": "a", "url": "http://u:hunter2@h:1"}]))
    assert message.startswith("npu_workers.workers[0].url: must not contain credentials")
    assert "hunter2" not in message


def test_header_rules() -> None:
    """Bad header names, reserved names and non-string values are each reported."""
    headers = {"Bad Name": "x", "X-NPU-Task-Id": "fixed", "X-Count": 5}
    errors = errors_of(one_worker(headers=headers))
    assert errors == (
        "npu_workers.workers[0].headers.Bad Name: is not a valid header name",
        "npu_workers.workers[0].headers.X-NPU-Task-Id: "
        "is set by npu_sync itself and cannot be configured",
        "npu_workers.workers[0].headers.X-Count: must be a string, got a number",
    )


def test_header_line_break_rejected_without_echo() -> None:
    """A header value with a line break is refused and never quoted."""
    (message,) = errors_of(one_worker(headers={"Authorization": "Bearer tok\r\nX: y"}))
    assert message == (
        "npu_workers.workers[0].headers.Authorization: "
        "must not contain line breaks or NUL characters"
    )


@pytest.mark.parametrize("value", ["clé✓-secret", "tok\x1b[31m", "tok\tab"])
def test_header_value_that_cannot_be_sent_is_rejected_without_echo(value) -> None:
    """A header value that is not printable ASCII could never be sent: refused at load,
    naming the key, never quoting the value (it may be a credential)."""
    (message,) = errors_of(one_worker(headers={"Authorization": value}))
    assert message == (
        "npu_workers.workers[0].headers.Authorization: "
        "must be printable ASCII (the value is not shown)"
    )
    assert value not in message


def test_backoff_initial_above_backoff_max() -> None:
    """backoff_max below backoff_initial is reported on backoff_max."""
    assert errors_of(native(retry={"backoff_initial": 3, "backoff_max": 1})) == (
        "npu_workers.retry.backoff_max: must be >= backoff_initial (3), got 1",
    )


def test_max_reset_timeout_below_reset_timeout() -> None:
    """max_reset_timeout below reset_timeout is reported on max_reset_timeout."""
    data = native(circuit_breaker={"reset_timeout": 120, "max_reset_timeout": 60})
    assert errors_of(data) == (
        "npu_workers.circuit_breaker.max_reset_timeout: must be >= reset_timeout (120), got 60",
    )


def test_cross_field_check_skipped_when_a_field_is_invalid() -> None:
    """A broken field yields its own error only, not a spurious cross-field one."""
    assert errors_of(native(retry={"backoff_initial": "x", "backoff_max": 0.01})) == (
        "npu_workers.retry.backoff_initial: must be a number, got 'x'",
    )


def test_sqlite_without_path() -> None:
    """The sqlite backend needs a path."""
    assert errors_of(native(dead_letter={"backend": "sqlite"})) == (
        "npu_workers.dead_letter.path: required when backend is 'sqlite'",
    )


def test_path_with_memory_backend() -> None:
    """A dead-letter path with the memory backend is a mistake, not silently ignored."""
    assert errors_of(native(dead_letter={"path": "dl.sqlite3"})) == (
        "npu_workers.dead_letter.path: only used with backend 'sqlite'",
    )


def test_redis_dead_letters_need_the_shared_redis_connection() -> None:
    """dead_letter.backend: redis without shared_state.backend: redis is refused."""
    assert errors_of(native(dead_letter={"backend": "redis"})) == (
        "npu_workers.dead_letter.backend: 'redis' needs shared_state.backend: redis "
        "(it uses that connection)",
    )


def test_shared_state_section() -> None:
    """shared_state parses with defaults and checks its URL and namespace."""
    config = parse_config(
        native(
            shared_state={"backend": "redis", "url": "redis://10.0.0.5:6380/2", "namespace": "p1"},
            dead_letter={"backend": "redis"},
        )
    )
    assert config.shared_state.backend == "redis"
    assert config.shared_state.url == "redis://10.0.0.5:6380/2"
    assert config.shared_state.namespace == "p1" and config.shared_state.timeout == 0.05
    assert config.dead_letter.backend == "redis"
    assert errors_of(native(shared_state={"url": "http://x", "namespace": "a b"})) == (
        "npu_workers.shared_state.url: must start with redis://, rediss://, unix://, "
        "redis+sentinel:// or redis+cluster:// (rediss+ for TLS)",
        "npu_workers.shared_state.namespace: must be a word without spaces, got 'a b'",
    )


def test_tls_key_requires_cert() -> None:
    """A client key without a client certificate is an error."""
    assert errors_of(native(transport={"tls": {"key": "/k.pem"}})) == (
        "npu_workers.transport.tls.key: requires cert",
    )


def test_tls_verify_type() -> None:
    """verify must be a boolean or a path."""
    assert errors_of(native(transport={"tls": {"verify": 1}})) == (
        "npu_workers.transport.tls.verify: must be true, false or the path of a CA bundle, got 1",
    )


def test_all_errors_reported_together() -> None:
    """Problems in different sections come back together in one ConfigError."""
    data = native(
        workers=[{"id": "a", "host": "h", "port": 0}, {"host": "h2"}],
        retry={"max_retriez": 1},
        timeouts={"read": "fast"},
        dead_letter={"backend": "sqlite"},
    )
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="pool.yaml")
    assert info.value.errors == (
        "npu_workers.workers[0].port: must be 1..65535, got 0",
        "npu_workers.workers[1].id: required",
        "npu_workers.retry.max_retriez: unknown key (did you mean 'max_retries'?)",
        "npu_workers.timeouts.read: must be a number, got 'fast'",
        "npu_workers.dead_letter.path: required when backend is 'sqlite'",
    )
    assert info.value.source == "pool.yaml"
    assert str(info.value).startswith("invalid configuration in pool.yaml:")


def test_bad_worker_port_causes_no_false_duplicate() -> None:
    """An invalid port does not fall back to 8081 and collide with another worker."""
    data = native(workers=[{"id": "a", "host": "h"}, {"id": "b", "host": "h", "port": True}])
    assert errors_of(data) == ("npu_workers.workers[1].port: must be an integer, got true",)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({}, "the configuration is empty"),
        (["a"], "the configuration must be a mapping, got a list"),
        ({"npu_workers": {}, "npu": {}}, "npu: cannot be combined with npu_workers"),
        ({"npu_workers": ["x"]}, "npu_workers: must be a mapping, got a list"),
    ],
)
def test_document_shape_errors(data: Any, expected: str) -> None:
    """An empty, non-mapping or two-layout document is refused clearly."""
    (message,) = errors_of(data)
    assert message.startswith(expected)


# -- upper bounds -----------------------------------------------------------------------

# Every numeric pool-level key: its range as messages and the docs write it, its largest
# allowed value, and the section's other keys that the largest value needs (a cross-field
# rule would refuse it otherwise).
POOL_BOUNDS: list[tuple[str, str, int, dict[str, Any]]] = [
    ("health.interval", "> 0 and <= 86400", 86400, {}),
    ("health.timeout", "> 0 and <= 3600", 3600, {}),
    ("health.unhealthy_threshold", "1..1000", 1000, {}),
    ("health.healthy_threshold", "1..1000", 1000, {}),
    ("health.concurrency", "1..4096", 4096, {}),
    ("circuit_breaker.fail_max", "1..10000", 10000, {}),
    ("circuit_breaker.reset_timeout", "> 0 and <= 86400", 86400, {"max_reset_timeout": 86400}),
    ("circuit_breaker.max_reset_timeout", "> 0 and <= 604800", 604800, {}),
    ("retry.max_retries", "0..100", 100, {}),
    ("retry.backoff_initial", ">= 0 and <= 3600", 3600, {"backoff_max": 3600}),
    ("retry.backoff_max", ">= 0 and <= 3600", 3600, {}),
    ("timeouts.connect", "> 0 and <= 3600", 3600, {}),
    ("timeouts.read", "> 0 and <= 86400", 86400, {}),
    ("timeouts.task", "> 0 and <= 86400", 86400, {}),
    ("dead_letter.max_records", "1..10000000", 10_000_000, {}),
    ("transport.max_response_bytes", "1..1073741824", 1 << 30, {}),
    ("transport.idle_timeout", "> 0 and <= 3600", 3600, {}),
    ("transport.max_idle_connections", "0..1000000", 1_000_000, {}),
    ("pool.threads", "1..4096", 4096, {}),
    ("pool.max_queue_wait", "> 0 and <= 86400", 86400, {}),
    ("shared_state.timeout", "> 0 and <= 60", 60, {}),
    ("shared_state.sync_interval", "> 0 and <= 3600", 3600, {}),
    ("reload.max_removed_share", ">= 0 and <= 1", 1, {}),
    ("reload.handover_timeout", "> 0 and <= 86400", 86400, {}),
    ("balancing.latency_decay", "> 0 and <= 3600", 3600, {}),
    ("balancing.slow_start", ">= 0 and <= 3600", 3600, {}),
    ("balancing.peak_hold", ">= 0 and <= 3600", 3600, {}),
    ("fleet.interval", ">= 0.05 and <= 3600", 3600, {}),
    ("fleet.ttl", "> 0 and <= 86400", 86400, {}),
    ("fleet.points", "2..10000", 10_000, {}),
    ("fleet.timeout", ">= 0.05 and <= 30", 30, {}),
    ("fleet.cache", ">= 0 and <= 3600", 3600, {}),
    ("fleet.silent_for", ">= 0 and <= 86400", 86400, {}),
    ("fleet.max_processes", "1..5000", 5000, {}),
    ("fleet.max_snapshot_bytes", "16384..8388608", 8_388_608, {}),
    ("admission.deadline_margin", ">= 1 and <= 100", 100, {}),
    ("admission.min_samples", "1..1000000", 1_000_000, {}),
    ("priority.aging", ">= 0 and <= 86400", 86400, {}),
    ("models.latency_models", "1..10000", 10_000, {}),
    ("models.interval", "> 0 and <= 3600", 3600, {}),
    ("models.hold", ">= 0 and <= 86400", 86400, {}),
    ("models.idle", "> 0 and <= 86400", 86400, {}),
    ("models.scale_up", "> 0 and <= 1", 1, {}),
    ("models.scale_down", ">= 0 and <= 1", 1, {}),
    ("models.max_models", "1..10000", 10_000, {}),
    ("models.loads_per_round", "1..1000", 1000, {}),
]
WORKER_BOUNDS: list[tuple[str, str, int]] = [
    ("port", "1..65535", 65535),
    ("priority", "0..1000000", 1_000_000),
    ("max_concurrent", "1..10000", 10_000),
    ("weight", "1..100", 100),
    ("max_models", "1..10000", 10_000),
]
# Keys of sections nested one level further (balancing.retry_budget.ratio), with their
# ranges; tests/test_config_fields.py checks them.
NESTED_BOUNDS: dict[str, str] = {
    "balancing.retry_budget.ratio": ">= 0 and <= 1",
    "balancing.retry_budget.min_per_second": ">= 0 and <= 10000",
    "balancing.hedge.delay": "> 0 and <= 3600",
    "balancing.hedge.percentile": ">= 0.5 and <= 0.999",
    "retry.stall.multiplier": ">= 1 and <= 1000",
    "retry.stall.percentile": ">= 0.5 and <= 0.999",
    "retry.stall.floor": "> 0 and <= 3600",
    "retry.stall.unknown": "> 0 and <= 86400",
    "retry.stall.declared_share": ">= 0 and <= 1",
    "circuit_breaker.trial.multiplier": ">= 1 and <= 1000",
    "circuit_breaker.trial.floor": "> 0 and <= 3600",
    "circuit_breaker.trial.cap": "> 0 and <= 3600",
}
SECTION_CLASSES: dict[str, Any] = {
    "models": ModelsConfig,
    "health": HealthConfig,
    "circuit_breaker": BreakerConfig,
    "retry": RetryConfig,
    "timeouts": TimeoutConfig,
    "dead_letter": DeadLetterConfig,
    "transport": TransportConfig,
    "pool": PoolSettings,
    "shared_state": SharedStateConfig,
    "reload": ReloadConfig,
    "balancing": BalancingConfig,
    "fleet": FleetConfig,
    "admission": AdmissionConfig,
    "priority": PriorityConfig,
}


@pytest.mark.parametrize(("key", "allowed", "limit", "extra"), POOL_BOUNDS)
def test_upper_bound_rejected_naming_key_value_and_range(
    key: str, allowed: str, limit: int, extra: dict[str, Any]
) -> None:
    """A value just past a key's upper bound is refused with the key, the value and the range."""
    section, name = key.split(".")
    value = limit + 1 if ".." in allowed else limit + 0.5
    assert errors_of(native(**{section: {name: value}})) == (
        f"npu_workers.{key}: must be {allowed}, got {value!r}",
    )


@pytest.mark.parametrize(("key", "allowed", "limit", "extra"), POOL_BOUNDS)
def test_upper_bound_itself_accepted(
    key: str, allowed: str, limit: int, extra: dict[str, Any]
) -> None:
    """The largest allowed value of each key loads and is kept as given."""
    section, name = key.split(".")
    cfg = parse_config(native(**{section: {name: limit, **extra}}))
    assert getattr(getattr(cfg, section), name) == limit


@pytest.mark.parametrize(("key", "allowed", "limit", "extra"), POOL_BOUNDS)
def test_constructors_refuse_what_the_reader_refuses(
    key: str, allowed: str, limit: int, extra: dict[str, Any]
) -> None:
    """A section built in code with a number past its bound raises naming field and value."""
    section, name = key.split(".")
    value = limit + 1 if ".." in allowed else limit + 0.5
    with pytest.raises(ConfigError) as info:
        SECTION_CLASSES[section](**{name: value})
    assert info.value.errors == (f"{key}: must be {allowed}, got {value!r}",)
    built = SECTION_CLASSES[section](**{name: limit, **extra})
    assert getattr(built, name) == limit


@pytest.mark.parametrize(("key", "allowed", "limit"), WORKER_BOUNDS)
def test_worker_upper_bounds(key: str, allowed: str, limit: int) -> None:
    """Per-worker numbers past their bound are refused in YAML and in worker_config()."""
    assert errors_of(one_worker(**{key: limit + 1})) == (
        f"npu_workers.workers[0].{key}: must be {allowed}, got {limit + 1}",
    )
    assert getattr(parse_config(one_worker(**{key: limit})).workers[0], key) == limit
    with pytest.raises(ConfigError) as info:
        worker_config("w", host="h", **{key: limit + 1})
    assert info.value.errors == (f"worker.{key}: must be {allowed}, got {limit + 1}",)
    assert getattr(worker_config("w", host="h", **{key: limit}), key) == limit


def test_reproduced_huge_values_are_refused() -> None:
    """The values that hung or crashed a running pool are refused at load time."""
    errors = errors_of(
        native(
            workers=[{"id": "w", "host": "h", "max_concurrent": 100_000_000}],
            timeouts={"task": 9.3e9},
            health={"interval": 1e10},
        )
    )
    assert errors == (
        "npu_workers.workers[0].max_concurrent: must be 1..10000, got 100000000",
        "npu_workers.health.interval: must be > 0 and <= 86400, got 10000000000.0",
        "npu_workers.timeouts.task: must be > 0 and <= 86400, got 9300000000.0",
    )


def test_integers_too_large_for_a_float_are_refused_not_overflowed() -> None:
    """A number key given 10**400 reports a range error instead of raising OverflowError."""
    (message,) = errors_of(native(timeouts={"read": 10**400}))
    assert message.startswith("npu_workers.timeouts.read: must be > 0 and <= 86400, got 1000")
    with pytest.raises(ConfigError) as info:
        worker_config("w", host="h", max_concurrent=10**5000)  # too long for repr()
    assert info.value.errors == (
        "worker.max_concurrent: must be 1..10000, got a very large integer",
    )


def test_autobot_priority_range() -> None:
    """AutoBot priorities may be negative, down to -1000000, and no further either way."""
    workers = [{"host": "h1", "priority": -1_000_000}, {"host": "h2", "priority": 1_000_000}]
    cfg = parse_config({"npu": {"workers": workers}})
    assert [w.priority for w in cfg.workers] == [2, 1]
    data = {"npu": {"workers": [{"host": "h1", "priority": -1_000_001}]}}
    assert errors_of(data) == ("npu.workers[0].priority: must be -1000000..1000000, got -1000001",)


@pytest.mark.parametrize("key", [key for key, allowed, *_ in POOL_BOUNDS if ".." not in allowed])
@pytest.mark.parametrize("text", [".nan", ".inf", "-.inf"])
def test_every_number_key_refuses_nan_and_infinities(key: str, text: str) -> None:
    """NaN and infinities are refused by every number key, in YAML and in code."""
    section, name = key.split(".")
    value = yaml.safe_load(text)
    assert errors_of(native(**{section: {name: value}})) == (
        f"npu_workers.{key}: must be a finite number, got {value!r}",
    )
    with pytest.raises(ConfigError) as info:
        SECTION_CLASSES[section](**{name: value})
    assert info.value.errors == (f"{key}: must be a finite number, got {value!r}",)


def test_integer_keys_refuse_nan() -> None:
    """An integer key given NaN is refused as not an integer."""
    assert errors_of(one_worker(max_concurrent=float("nan"))) == (
        "npu_workers.workers[0].max_concurrent: must be an integer, got nan",
    )
    with pytest.raises(ConfigError) as info:
        WorkerConfig(id="w", url="http://h:1", max_concurrent=float("nan"))  # type: ignore[arg-type]
    assert info.value.errors == ("worker.max_concurrent: must be an integer, got nan",)


def test_env_expanded_numbers_are_bounded_without_echoing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bound applies to a value from the environment; the message quotes it as written."""
    monkeypatch.setenv("NPU_TASK", "1e12")
    assert errors_of(native(timeouts={"task": "${NPU_TASK}"})) == (
        "npu_workers.timeouts.task: must be > 0 and <= 86400, got '${NPU_TASK}'",
    )


def test_read_timeout_above_task_deadline_is_accepted() -> None:
    """timeouts.read may exceed timeouts.task: the deadline caps each attempt instead."""
    cfg = parse_config(native(timeouts={"read": 60, "task": 5}))
    assert (cfg.timeouts.read, cfg.timeouts.task) == (60.0, 5.0)


def test_new_keys_parse() -> None:
    """pool.max_queue_wait, transport.idle_timeout and the builtin client load from YAML."""
    cfg = parse_config(
        native(pool={"max_queue_wait": 2.5}, transport={"idle_timeout": 1, "client": "builtin"})
    )
    assert cfg.pool.max_queue_wait == 2.5
    assert cfg.transport.idle_timeout == 1.0
    assert cfg.transport.client == "builtin"


def _docs_ranges() -> dict[str, str]:
    """Each numeric key of the docs' tables and the range its 'allowed' column gives."""
    found: dict[str, str] = {}
    for line in DOCS.read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[1].startswith(("int", "number")):
            allowed = re.match(r"`([^`]+)`", cells[3])
            assert allowed, f"no range in docs for {cells[0]}"
            found[cells[0].strip("`")] = allowed.group(1)
    return found


def test_docs_give_every_range() -> None:
    """docs/configuration.md lists each numeric key with the range the code enforces."""
    expected = {key: allowed for key, allowed, *_ in POOL_BOUNDS}
    expected.update({key: allowed for key, allowed, _ in WORKER_BOUNDS})
    expected.update(NESTED_BOUNDS)
    assert _docs_ranges() == expected


# -- environment expansion --------------------------------------------------------------


def test_env_expansion_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    """${NAME}, ${NAME:-default} and $$ expand as documented."""
    monkeypatch.setenv("NPU_TOKEN", "tok")
    monkeypatch.setenv("NPU_EMPTY", "")
    monkeypatch.delenv("NPU_UNSET", raising=False)
    headers = {
        "A": "Bearer ${NPU_TOKEN}",
        "B": "${NPU_UNSET:-fallback}",
        "C": "${NPU_EMPTY:-used-when-empty}",
        "D": "cost: $$5 and pa$word",
        "E": "[${NPU_EMPTY}]",
    }
    worker = parse_config(one_worker(headers=headers)).workers[0]
    assert dict(worker.headers) == {
        "A": "Bearer tok",
        "B": "fallback",
        "C": "used-when-empty",
        "D": "cost: $5 and pa$word",
        "E": "[]",
    }


def test_env_unset_variable_names_key_and_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unset variable without default is an error naming the key and the variable."""
    monkeypatch.delenv("NPU_TOKEN", raising=False)
    data = one_worker(headers={"Authorization": "Bearer ${NPU_TOKEN}"})
    assert errors_of(data) == (
        "npu_workers.workers[0].headers.Authorization: environment variable NPU_TOKEN is not set",
    )


def test_env_values_never_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad value that came from the environment is quoted as written, not expanded."""
    monkeypatch.setenv("NPU_URL", "http://admin:topsecret@h:1/path")
    monkeypatch.setenv("NPU_READ", "topsecret")
    data = native(workers=[{"id": "a", "url": "${NPU_URL}"}], timeouts={"read": "${NPU_READ}"})
    errors = errors_of(data)
    assert len(errors) == 2
    assert errors[1] == "npu_workers.timeouts.read: must be a number, got '${NPU_READ}'"
    assert not any("topsecret" in message for message in errors)


def test_env_reference_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unterminated ${ or an invalid variable name is an error."""
    errors = errors_of(one_worker(headers={"A": "${OOPS", "B": "${1BAD}"}))
    assert errors == (
        "npu_workers.workers[0].headers.A: unterminated '${' (write '$$' for a literal '$')",
        "npu_workers.workers[0].headers.B: invalid variable reference '${1BAD}'",
    )


def test_env_fills_typed_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ${...} string in an int/number/bool field is read as a scalar after expansion."""
    monkeypatch.setenv("NPU_PORT", "9000")
    monkeypatch.setenv("NPU_ON", "false")
    monkeypatch.delenv("NPU_READ", raising=False)
    data = native(
        workers=[{"id": "a", "host": "h", "port": "${NPU_PORT}", "enabled": "${NPU_ON}"}],
        timeouts={"read": "${NPU_READ:-12.5}"},
    )
    cfg = parse_config(data)
    assert cfg.workers[0].port == 9000
    assert cfg.workers[0].enabled is False
    assert cfg.timeouts.read == 12.5


def test_env_expands_urls_and_paths(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Expansion applies to every string value, urls and file paths included."""
    monkeypatch.setenv("NPU_HOST", "box")
    monkeypatch.setenv("NPU_DIR", str(tmp_path))
    data = native(
        workers=[{"id": "a", "url": "http://${NPU_HOST}:9"}],
        dead_letter={"backend": "sqlite", "path": "${NPU_DIR}/dl.sqlite3"},
    )
    cfg = parse_config(data)
    assert cfg.workers[0].url == "http://box:9"
    assert cfg.dead_letter.path == str(tmp_path / "dl.sqlite3")


# -- the AutoBot layout -----------------------------------------------------------------


AUTOBOT_YAML = """\
npu:
  workers:
    - id: npu-worker-vm2
      host: 172.16.168.22
      port: 8081
      priority: 10
      enabled: true
      max_concurrent_tasks: 4
    - name: windows-npu-worker
      host: 172.16.168.20
      port: 8082
      priority: 5
      enabled: false
      description: laptop NPU
      capabilities: [llm]
      weight: 50
    - url: http://172.16.168.23:8081
      priority: 10
    - host: 172.16.168.24
  retry: {max_retries: 1}
"""


def test_autobot_layout_mapping() -> None:
    """The AutoBot layout maps ids, capacity and inverts priority into dense tiers."""
    cfg = parse_config(yaml.safe_load(AUTOBOT_YAML))
    assert [(w.id, w.priority, w.max_concurrent, w.enabled) for w in cfg.workers] == [
        ("npu-worker-vm2", 1, 4, True),
        ("windows-npu-worker", 2, 32, False),
        ("172.16.168.23:8081", 1, 32, True),
        ("172.16.168.24:8081", 2, 32, True),  # AutoBot's default priority is 5
    ]
    assert cfg.retry.max_retries == 1


def test_autobot_priority_inversion_is_dense() -> None:
    """Priorities 10, 5, 10, 1 become tiers 1, 2, 1, 3."""
    workers = [
        {"id": f"w{i}", "host": f"h{i}", "priority": p} for i, p in enumerate([10, 5, 10, 1])
    ]
    cfg = parse_config({"npu": {"workers": workers}})
    assert [w.priority for w in cfg.workers] == [1, 2, 1, 3]


def test_autobot_unknown_worker_key_is_error() -> None:
    """Keys outside AutoBot's known set are still errors, with the npu. prefix."""
    data = {"npu": {"workers": [{"id": "a", "host": "h", "colour": "red", "models": ["x"]}]}}
    assert errors_of(data) == ("npu.workers[0].colour: unknown key",)


def test_autobot_both_capacity_keys_is_error() -> None:
    """max_concurrent and max_concurrent_tasks together are ambiguous."""
    data = {"npu": {"workers": [{"host": "h", "max_concurrent": 2, "max_concurrent_tasks": 3}]}}
    assert errors_of(data) == (
        "npu.workers[0]: give max_concurrent or max_concurrent_tasks, not both",
    )


def test_autobot_only_keys_rejected_in_native_layout() -> None:
    """max_concurrent_tasks and description are AutoBot's, unknown under npu_workers."""
    errors = errors_of(one_worker(description="x", max_concurrent_tasks=2))
    assert errors == (
        "npu_workers.workers[0].description: unknown key",
        "npu_workers.workers[0].max_concurrent_tasks: unknown key (did you mean 'max_concurrent'?)",
    )


# -- files ------------------------------------------------------------------------------


def test_yaml_syntax_error_shows_line(tmp_path: Path) -> None:
    """A YAML syntax error is a ConfigError naming the line and column."""
    path = write(
        tmp_path,
        """\
        npu_workers:
          workers:
            - id: a
              host: h
             port: 1
        """,
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (message,) = info.value.errors
    assert message.startswith("YAML syntax error at line 5, column ")
    assert info.value.source == str(path)


def test_load_missing_file(tmp_path: Path) -> None:
    """A missing file is a ConfigError naming the path."""
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.errors == (f"cannot read {path}: No such file or directory",)


def test_load_empty_file(tmp_path: Path) -> None:
    """An empty file is refused with a message saying what was expected."""
    path = write(tmp_path, "# nothing here\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.errors == (
        f"{path} is empty: expected a top-level 'npu_workers:' (or AutoBot 'npu:', or the "
        "'workers:' of AutoBot's admin UI) mapping",
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("npu_workers: {pool: {threads: 2024-13-01}}", "YAML error: month must be in 1..12"),
        (
            "npu_workers: {pool: {threads: " + "9" * 5000 + "}}",
            "YAML error: Exceeds the limit (4300 digits) for integer string conversion",
        ),
    ],
)
def test_yaml_values_python_cannot_build_are_config_errors(
    tmp_path: Path, text: str, expected: str
) -> None:
    """A date that does not exist or a 5000-digit integer is a ConfigError, not ValueError."""
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text + "\n"))
    (message,) = info.value.errors
    assert message.startswith(expected)


def test_relative_sqlite_path_resolved_against_yaml_dir(tmp_path: Path) -> None:
    """A relative dead-letter path is made absolute against the YAML file's directory."""
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    path = write(conf_dir, "npu_workers: {dead_letter: {backend: sqlite, path: data/dl.db}}\n")
    cfg = load_config(os.path.relpath(path))
    assert cfg.dead_letter.path == str(conf_dir / "data" / "dl.db")


def test_paths_without_file_resolve_against_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """parse_config without base_dir resolves against the working directory; with it, there."""
    monkeypatch.chdir(tmp_path)
    data = native(dead_letter={"backend": "sqlite", "path": "dl.db"})
    assert parse_config(data).dead_letter.path == str(tmp_path / "dl.db")
    assert parse_config(data, base_dir="/srv/npu").dead_letter.path == "/srv/npu/dl.db"
    memory = native(dead_letter={"backend": "sqlite", "path": ":memory:"})
    assert parse_config(memory).dead_letter.path == ":memory:"
    absolute = native(dead_letter={"backend": "sqlite", "path": "/var/dl.db"})
    assert parse_config(absolute, base_dir="/srv").dead_letter.path == "/var/dl.db"


# -- TLS --------------------------------------------------------------------------------


def test_worker_tls_inherits_from_transport() -> None:
    """A worker's tls overrides only what it names; cert and key inherit as a pair."""
    data = native(
        workers=[
            {"id": "a", "host": "a", "tls": {"cert": "/c/a.pem", "key": "/c/a.key"}},
            {"id": "b", "host": "b", "tls": {"verify": False}},
            {"id": "c", "host": "c"},
        ],
        transport={"tls": {"verify": "/c/ca.pem", "cert": "/c/pool.pem", "key": "/c/pool.key"}},
    )
    cfg = parse_config(data)
    a, b, c = cfg.workers
    assert a.tls == TLSConfig(verify="/c/ca.pem", cert="/c/a.pem", key="/c/a.key")
    assert b.tls == TLSConfig(verify=False, cert="/c/pool.pem", key="/c/pool.key")
    assert c.tls is None
    assert cfg.tls_for(c) is cfg.transport.tls
    assert cfg.tls_for(a) is a.tls


def test_tls_paths_resolved_against_yaml_dir(tmp_path: Path) -> None:
    """CA bundle and client cert paths are stored absolute."""
    path = write(tmp_path, "npu_workers: {transport: {tls: {verify: ca.pem, cert: c.pem}}}\n")
    tls = load_config(path).transport.tls
    assert tls == TLSConfig(verify=str(tmp_path / "ca.pem"), cert=str(tmp_path / "c.pem"))


# -- objects ----------------------------------------------------------------------------


def test_configs_are_frozen() -> None:
    """Config objects and worker headers cannot be changed after loading."""
    cfg = parse_config(one_worker(headers={"A": "1"}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.retry.max_retries = 9  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.workers[0].priority = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.workers[0].headers["A"] = "2"  # type: ignore[index]
    assert isinstance(cfg.workers, tuple)


def test_worker_constructor_copies_headers() -> None:
    """A dict passed to WorkerConfig cannot change the worker afterwards."""
    headers = {"A": "1"}
    worker = WorkerConfig(id="w", url="http://h:1", headers=headers)
    headers["A"] = "2"
    assert worker.headers == {"A": "1"}
    assert isinstance(worker.headers, Mapping)


def test_configs_hash_and_compare() -> None:
    """Equal configs compare equal and hash alike, headers included in equality."""
    first = parse_config(one_worker(headers={"A": "1"}))
    second = parse_config(one_worker(headers={"A": "1"}))
    third = parse_config(one_worker(headers={"A": "2"}))
    assert first == second
    assert hash(first) == hash(second)
    assert first != third


def test_headers_not_in_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's repr leaves out its headers, which carry credentials."""
    monkeypatch.setenv("NPU_TOKEN", "s3cret-token")
    cfg = parse_config(one_worker(headers={"Authorization": "Bearer ${NPU_TOKEN}"}))
    assert "s3cret-token" not in repr(cfg)


def test_worker_lookup() -> None:
    """PoolConfig.worker finds by id and raises KeyError otherwise."""
    cfg = parse_config(native(workers=[{"id": "a", "host": "h1"}, {"id": "b", "host": "h2"}]))
    assert cfg.worker("b").url == "http://h2:8081"
    with pytest.raises(KeyError):
        cfg.worker("zzz")


@pytest.mark.parametrize(
    ("entry", "url", "scheme", "host", "port"),
    [
        ({"url": "https://NPU.example"}, "https://npu.example:443", "https", "npu.example", 443),
        ({"url": "http://[::1]:9000/"}, "http://[::1]:9000", "http", "::1", 9000),
        ({"host": "::1"}, "http://[::1]:8081", "http", "::1", 8081),
        ({"host": "h", "scheme": "https", "port": 8443}, "https://h:8443", "https", "h", 8443),
    ],
)
def test_address_normalisation(
    entry: dict[str, Any], url: str, scheme: str, host: str, port: int
) -> None:
    """Addresses normalise to scheme://host:port and the properties parse them back."""
    worker = parse_config(native(workers=[{"id": "w", **entry}])).workers[0]
    assert (worker.url, worker.scheme, worker.host, worker.port) == (url, scheme, host, port)


# -- programmatic constructors ----------------------------------------------------------


def test_worker_config_validates_and_normalises() -> None:
    """worker_config builds the same worker a YAML entry would."""
    worker = worker_config("vm3", host="Box", port=9000, priority=2, headers={"A": "b"})
    assert worker == WorkerConfig(id="vm3", url="http://box:9000", priority=2, headers={"A": "b"})
    tls = TLSConfig(verify=False)
    assert worker_config("x", "https://h:1", tls=tls).tls == tls


def test_worker_config_errors_use_worker_prefix() -> None:
    """worker_config reports every problem under the 'worker' path."""
    with pytest.raises(ConfigError) as info:
        worker_config("", "http://h:1", port=5, max_concurrent=0)
    assert info.value.errors == (
        "worker.id: must be 1..200 printable characters without spaces, got ''",
        "worker.port: goes with host, not url: put it in the url",
        "worker.max_concurrent: must be 1..10000, got 0",
    )


def test_worker_config_does_not_expand_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Values given in code are literal: ${...} stays as written."""
    monkeypatch.setenv("NPU_TOKEN", "tok")
    worker = worker_config("w", "http://h:1", headers={"A": "${NPU_TOKEN}"})
    assert worker.headers["A"] == "${NPU_TOKEN}"


def test_config_for_url() -> None:
    """config_for_url gives one worker named default and all other defaults."""
    cfg = config_for_url("http://127.0.0.1:8081/")
    assert cfg.workers == (WorkerConfig(id="default", url="http://127.0.0.1:8081"),)
    assert cfg.workers[0].max_concurrent == 32
    assert dataclasses.replace(cfg, workers=()) == PoolConfig()
    with pytest.raises(ConfigError) as info:
        config_for_url("127.0.0.1:8081")
    assert info.value.errors[0].startswith("worker.url: must be an http(s) URL")


# -- what the file reader refuses -------------------------------------------------------


def yaml_errors(text: str) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as info:
        parse_yaml(textwrap.dedent(text), source="/etc/npu/pool.yaml")
    return info.value.errors


def test_a_duplicated_key_is_refused_with_its_path_and_both_lines() -> None:
    """PyYAML would keep the second workers: list; the file is refused instead."""
    errors = yaml_errors(
        """\
        npu_workers:
          workers:
            - {id: a, url: 'http://127.0.0.1:9001'}
            - {id: b, url: 'http://127.0.0.1:9002'}
          health: {interval: 5}
          workers: []
        """
    )
    assert errors == (
        "npu_workers.workers: duplicate key (lines 2 and 6); YAML would silently keep "
        "only the last one",
    )


def test_duplicates_are_found_at_every_depth_and_all_reported() -> None:
    """A duplicate inside a worker entry and one on a single line are both named."""
    errors = yaml_errors(
        """\
        npu_workers:
          workers:
            - id: a
              url: 'http://127.0.0.1:9001'
              id: b
          retry: {max_retries: 1, max_retries: 2}
        """
    )
    assert errors == (
        "npu_workers.retry.max_retries: duplicate key (line 6, columns 11 and 27); YAML "
        "would silently keep only the last one",
        "npu_workers.workers[0].id: duplicate key (lines 3 and 5); YAML would silently "
        "keep only the last one",
    )


def test_merge_keys_are_not_duplicates() -> None:
    """A YAML merge (<<: *a) overridden by the entry's own keys is not a duplicate."""
    cfg = parse_yaml(
        textwrap.dedent(
            """\
            npu_workers:
              workers:
                - &a {id: a, url: 'http://127.0.0.1:9001', max_concurrent: 4}
                - {<<: *a, id: b, url: 'http://127.0.0.1:9002'}
            """
        ),
        source="/x.yaml",
    )
    assert [(w.id, w.max_concurrent) for w in cfg.workers] == [("a", 4), ("b", 4)]


@pytest.mark.parametrize("depth", [40, 5000, 100_000])
def test_deep_nesting_is_a_config_error_not_a_recursion_error(depth: int) -> None:
    """[[[[...]]]] of any depth is refused as too deep, naming where."""
    errors = yaml_errors("npu_workers:\n  workers: " + "[" * depth + "]" * depth + "\n")
    assert len(errors) == 1
    assert errors[0].startswith("npu_workers.workers[0][0]")
    assert errors[0].endswith(": nested deeper than 32 levels")


def test_nesting_within_the_limit_is_judged_by_the_schema() -> None:
    """Thirty levels parse; the schema then reports the odd value as usual."""
    errors = yaml_errors("npu_workers:\n  workers: " + "[" * 30 + "]" * 30 + "\n")
    assert errors == ("npu_workers.workers[0]: must be a mapping, got a list",)


def test_a_file_with_too_many_nodes_is_refused() -> None:
    """An absurdly long flat list stops at the node limit, not after building it all."""
    text = "npu_workers:\n  workers: [" + "1," * 150_000 + "1]\n"
    (error,) = yaml_errors(text)
    assert error == "more than 100000 YAML nodes; a configuration has far fewer"


def test_an_oversized_file_is_refused_before_parsing(tmp_path: Path) -> None:
    """A file over 1 MiB is refused by the reader, naming the limit."""
    path = tmp_path / "big.yaml"
    path.write_text("npu_workers:\n" + "#" * (1 << 20) + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.errors == (
        f"cannot read {path}: larger than 1048576 bytes; a configuration is a few kilobytes",
    )


def test_a_fifo_is_refused_at_once_without_blocking(tmp_path: Path) -> None:
    """A FIFO as the config path is an error, not a read that waits for a writer."""
    fifo = tmp_path / "pool.yaml"
    os.mkfifo(fifo)
    result: list[BaseException] = []

    def load() -> None:
        try:
            load_config(fifo)
        except BaseException as exc:
            result.append(exc)

    import threading

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():  # unblock the reader so the test process can end
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        pytest.fail("load_config blocked on a FIFO")
    assert isinstance(result[0], ConfigError)
    assert result[0].errors == (f"cannot read {fifo}: not a regular file (a FIFO)",)


@pytest.mark.parametrize(
    ("path", "kind"), [("/dev/null", "a character device"), ("/", "a directory")]
)
def test_devices_and_directories_are_refused(path: str, kind: str) -> None:
    """Only regular files are configuration files."""
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.errors == (f"cannot read {path}: not a regular file ({kind})",)


def test_a_symlink_to_a_regular_file_is_read(tmp_path: Path) -> None:
    """Regular means what the link points at: ConfigMap mounts are symlinks."""
    target = write(tmp_path, "npu_workers:\n  workers: []\n", name="real.yaml")
    link = tmp_path / "pool.yaml"
    link.symlink_to(target.name)
    assert load_config(link).workers == ()


# -- secrets in messages and repr --------------------------------------------------------

SECRET = "hunter2-secret"


@pytest.mark.parametrize(
    "url",
    [
        f"http://admin:{SECRET}@127.0.0.1:99999",  # credentials and a bad port
        f"admin:{SECRET}@127.0.0.1:8081",  # no scheme
        f"http://127.0.0.1:8081/?token={SECRET}",  # a token in the query
        f"http://127.0.0.1:8081/x?a=1&access_token={SECRET}",
        f"ftp://u:{SECRET}@h:21",
    ],
)
def test_a_worker_url_with_a_credential_is_never_quoted(url: str) -> None:
    """The message names the key and the problem, with the credential masked."""
    errors = errors_of(native(workers=[{"id": "w", "url": url}]))
    assert len(errors) == 1 and errors[0].startswith("npu_workers.workers[0].url: ")
    assert SECRET not in errors[0]
    assert SECRET not in str(ConfigError(errors))


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        (f"redis://:{SECRET}@127.0.0.1:99999/0", "has an invalid port (must be 1..65535)"),
        (f"redis://:{SECRET}@127.0.0.1:0/0", "has an invalid port (must be 1..65535)"),
        (f"redis://:{SECRET}@127.0.0.1:port/0", "has an invalid port (must be 1..65535)"),
        (
            f"redis://:{SECRET}@127.0.0.1:6379/zero",
            "has a database that is not a number (the path is the database, e.g. /0)",
        ),
        (f"redis://:{SECRET}@:6379/0", "has no host"),
        (
            f"http://:{SECRET}@127.0.0.1:6379",
            "must start with redis://, rediss://, unix://, redis+sentinel:// or "
            "redis+cluster:// (rediss+ for TLS)",
        ),
        ("unix://", "needs the socket's path (unix:///run/redis.sock)"),
    ],
)
def test_a_bad_redis_url_is_refused_at_load_without_quoting_it(url: str, problem: str) -> None:
    """A Redis URL start-up would fail on is a ConfigError naming the key, not the URL."""
    assert errors_of(native(shared_state={"backend": "redis", "url": url})) == (
        f"npu_workers.shared_state.url: {problem}",
    )


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        (
            f"redis://:{SECRET}@127.0.0.1:6379/0?foo={SECRET}",
            "has an unknown query parameter 'foo' (known: client_name, db)",
        ),
        (
            f"redis://:{SECRET}@127.0.0.1:6379/0?ssl_ca_certs=/ca.pem",
            "has TLS parameter 'ssl_ca_certs', which only a rediss:// URL takes",
        ),
        (
            f"rediss://:{SECRET}@127.0.0.1:6379/0?socket_timeout=30",
            "sets 'socket_timeout': npu_sync sets it from shared_state.timeout",
        ),
    ],
)
def test_a_redis_url_query_redis_py_would_choke_on_is_refused_at_load(url, problem) -> None:
    """A query parameter redis-py passes on as a keyword its connection does not take (a
    TypeError at start-up) is a ConfigError naming the parameter, never its value."""
    assert errors_of(native(shared_state={"backend": "redis", "url": url})) == (
        f"npu_workers.shared_state.url: {problem}",
    )


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0?db=2&client_name=web",
        "rediss://127.0.0.1:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/ca.pem"
        "&ssl_check_hostname=true",
        "unix:///run/redis.sock?db=1",
    ],
)
def test_redis_url_queries_redis_py_takes_still_load(url) -> None:
    """The parameters left to the URL (database, client name, TLS files) load, and
    redis-py builds a client from them without complaint."""
    redis = pytest.importorskip("redis")
    config = parse_config(native(shared_state={"backend": "redis", "url": url}))
    assert config.shared_state.url == url
    client = redis.Redis.from_url(url, socket_timeout=0.1)
    client.connection_pool.make_connection().disconnect()  # built, never connected
    client.close()


def test_repr_of_a_config_never_shows_the_redis_password() -> None:
    """repr(PoolConfig) and repr(SharedStateConfig) mask the URL's userinfo."""
    shared = SharedStateConfig(backend="redis", url=f"redis://user:{SECRET}@127.0.0.1:6379/0")
    cfg = PoolConfig(shared_state=shared)
    for text in (repr(shared), repr(cfg), str(cfg)):
        assert SECRET not in text
        assert "redis://***@127.0.0.1:6379/0" in text
    assert cfg.shared_state.url.endswith(f"{SECRET}@127.0.0.1:6379/0")  # still usable


def test_config_error_escapes_control_characters() -> None:
    """An escape sequence in a value quoted by a message cannot reach a terminal."""
    (error,) = errors_of(one_worker(id="w\x1b[2Jx"))
    assert "\x1b" not in error and "\\x1b[2J" in error


# -- the reload section and what a reload may do --------------------------------------


def test_the_reload_section_is_read_and_checked() -> None:
    """reload.allow_empty and reload.max_removed_share load; nonsense is refused."""
    cfg = parse_config(native(reload={"allow_empty": True, "max_removed_share": 0.25}))
    assert cfg.reload == ReloadConfig(allow_empty=True, max_removed_share=0.25)
    assert parse_config(native()).reload == ReloadConfig()
    assert errors_of(native(reload={"allow_empty": "yes", "max_removed": 1})) == (
        "npu_workers.reload.max_removed: unknown key (did you mean 'max_removed_share'?)",
        "npu_workers.reload.allow_empty: must be true or false, got 'yes'",
    )


def pool_of(n: int, **reload: Any) -> PoolConfig:
    return PoolConfig(
        workers=tuple(worker_config(f"w{i}", f"http://127.0.0.1:{9000 + i}") for i in range(n)),
        reload=ReloadConfig(**reload),
    )


def test_a_reload_to_no_enabled_worker_is_refused_unless_allowed() -> None:
    """Empty or all-disabled: refused naming the key that allows it."""
    old = pool_of(3)
    disabled = PoolConfig(workers=tuple(dataclasses.replace(w, enabled=False) for w in old.workers))
    for new in (PoolConfig(), disabled):
        with pytest.raises(ConfigError) as info:
            check_reload(old, new)
        assert info.value.errors == (
            "npu_workers.workers: the new configuration has no enabled worker (the running "
            "one has 3); refused so that a half-written or mistyped file cannot empty the "
            "pool: set reload.allow_empty: true if that is what you mean",
        )
    check_reload(old, PoolConfig(reload=ReloadConfig(allow_empty=True)))
    check_reload(PoolConfig(), PoolConfig())  # nothing to protect


def test_a_reload_removing_more_than_the_share_is_refused() -> None:
    """Losing 3 of 4 is refused at the default 0.5; half is allowed; the file may raise it."""
    old = pool_of(4)
    with pytest.raises(ConfigError) as info:
        check_reload(old, pool_of(1))
    assert info.value.errors == (
        "npu_workers.workers: the new configuration leaves 1 of the 4 enabled workers "
        "(without w1, w2, w3), a loss of more than reload.max_removed_share (0.5); refused "
        "so that a file cut short cannot shrink the pool: raise reload.max_removed_share "
        "if that is what you mean",
    )
    check_reload(old, pool_of(2))
    check_reload(old, pool_of(1, max_removed_share=0.75))
    with pytest.raises(ConfigError):
        check_reload(old, pool_of(3, max_removed_share=0))


def test_the_autobot_layout_names_its_own_key_path() -> None:
    """Messages about the npu: layout say npu.workers."""
    new = parse_config({"npu": {"workers": []}})
    with pytest.raises(ConfigError, match=r"^invalid configuration:\n  npu\.workers: "):
        check_reload(pool_of(1), new)


def test_a_control_character_in_the_file_is_a_config_error() -> None:
    """PyYAML's reader refuses NUL while the loader is built: still a ConfigError."""
    (error,) = yaml_errors("npu_workers:\x00\n")
    assert error.startswith("YAML error: unacceptable character #x0000")


# Attacks on YAML that is small on disk and huge in memory: merge-key bombs.


# Each level merges nine copies of the one before: 9**9 key/value pairs from 600 bytes.
MERGE_BOMB = "\n".join(
    ["a0: &a0 {k0: 0, k1: 1, k2: 2, k3: 3, k4: 4, k5: 5, k6: 6, k7: 7, k8: 8}"]
    + [f"a{i}: &a{i} {{<<: [{', '.join([f'*a{i - 1}'] * 9)}]}}" for i in range(1, 10)]
    + ["npu_workers:", "  workers: []", ""]
)


# One merge of many aliases to one wide mapping: 3,000 x 3,000 pairs from 40 kB.
WIDE_MERGE = (
    "a: &a {" + ", ".join(f"k{i}: {i}" for i in range(3_000)) + "}\n"
    "b: {<<: [" + ", ".join(["*a"] * 3_000) + "]}\n"
    "npu_workers:\n  workers: []\n"
)


PARSE_IN_A_BOX = textwrap.dedent(
    """
    import resource, sys
    # A regression must fail this test, not exhaust the machine running it.
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    from npu_sync.config import parse_yaml
    from npu_sync.errors import ConfigError
    try:
        parse_yaml(sys.stdin.read(), source="/bomb.yaml")
    except ConfigError as exc:
        print("refused:", exc)
    except MemoryError:
        print("MemoryError")
    """
)


@pytest.mark.parametrize("text", [MERGE_BOMB, WIDE_MERGE], ids=["nested", "wide"])
def test_a_yaml_merge_key_bomb_is_refused_as_too_large(text):
    """Merge keys (<<) copy pairs at load time: a tiny file that expands to billions of
    pairs is a ConfigError about its size, not a MemoryError or a hung reload."""
    assert len(text) < 1 << 20
    run = subprocess.run(
        [sys.executable, "-c", PARSE_IN_A_BOX],
        input=text,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("refused:"), run.stdout[:500]
    assert "YAML nodes" in run.stdout or "merge" in run.stdout


def test_plain_merge_keys_still_load():
    """The size guard leaves ordinary anchors and merges alone."""
    text = (
        "npu_workers:\n  workers:\n"
        "    - &d {id: a, url: 'http://127.0.0.1:9601', max_concurrent: 4, priority: 2}\n"
        "    - {<<: [*d], id: b, url: 'http://127.0.0.1:9602', priority: 1}\n"
    )
    config = parse_yaml(text, source="/x.yaml")
    assert [(w.id, w.priority, w.max_concurrent) for w in config.workers] == [
        ("a", 2, 4),
        ("b", 1, 4),
    ]
