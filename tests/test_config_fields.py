"""The configuration fields the balancer, the worker protocols and request auth read."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from npu_sync.config import (
    AuthConfig,
    BalancingConfig,
    HedgeConfig,
    ModelsConfig,
    PoolConfig,
    RetryBudgetConfig,
    WorkerConfig,
    parse_config,
    worker_config,
)
from npu_sync.errors import ConfigError

SECRET = "s3cr3t-Value-9f8e"


def errors_of(data: Any) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value.errors


def one_worker(**fields: Any) -> dict[str, Any]:
    return {"npu_workers": {"workers": [{"id": "w", "host": "127.0.0.1", **fields}]}}


# -- balancing and models ----------------------------------------------------------------


def test_balancing_and_models_defaults() -> None:
    """Without the sections, the balancing knobs and model settings take their defaults."""
    cfg = parse_config({"npu_workers": {}})
    assert cfg.balancing == BalancingConfig(
        strategy="least-loaded",
        latency_aware=True,
        latency_decay=10.0,
        slow_start=10.0,
        retry_budget=RetryBudgetConfig(ratio=0.2, min_per_second=10.0),
        adaptive_concurrency=False,
        hedge=HedgeConfig(enabled=False, delay=None, percentile=0.95),
    )
    assert cfg.models == ModelsConfig(placement=False, refresh_on_health=True)


def test_balancing_section_is_read_with_its_nested_sections() -> None:
    """Every balancing key, nested ones included, is read from YAML."""
    text = """
    npu_workers:
      balancing:
        strategy: weighted
        latency_aware: false
        latency_decay: 3
        slow_start: 0
        retry_budget: {ratio: 0.5, min_per_second: 1}
        adaptive_concurrency: true
        hedge: {enabled: true, delay: 0.25, percentile: 0.99}
      models: {placement: true, refresh_on_health: false}
    """
    cfg = parse_config(yaml.safe_load(text))
    assert cfg.balancing == BalancingConfig(
        strategy="weighted",
        latency_aware=False,
        latency_decay=3.0,
        slow_start=0.0,
        retry_budget=RetryBudgetConfig(0.5, 1.0),
        adaptive_concurrency=True,
        hedge=HedgeConfig(True, 0.25, 0.99),
    )
    assert cfg.models == ModelsConfig(placement=True, refresh_on_health=False)


def test_hedge_delay_null_means_from_the_percentile() -> None:
    """hedge.delay: null is accepted and kept as None."""
    cfg = parse_config({"npu_workers": {"balancing": {"hedge": {"delay": None}}}})
    assert cfg.balancing.hedge.delay is None


def test_balancing_errors_name_the_nested_key_path() -> None:
    """Bad nested values are reported with their full path, value and range."""
    data = {
        "npu_workers": {
            "balancing": {
                "strategy": "fastest",
                "retry_budget": {"ratio": 1.5, "min_per_sec": 1},
                "hedge": {"delay": 0, "percentile": 0.3},
            },
            "models": {"placement": "yes"},
        }
    }
    assert errors_of(data) == (
        "npu_workers.balancing.strategy: must be one of 'least-loaded', 'round-robin', "
        "'weighted', 'priority', 'weighted-random', 'priority-failover', got 'fastest'",
        "npu_workers.balancing.retry_budget.min_per_sec: unknown key "
        "(did you mean 'min_per_second'?)",
        "npu_workers.balancing.retry_budget.ratio: must be >= 0 and <= 1, got 1.5",
        "npu_workers.balancing.hedge.delay: must be > 0 and <= 3600, got 0",
        "npu_workers.balancing.hedge.percentile: must be >= 0.5 and <= 0.999, got 0.3",
        "npu_workers.models.placement: must be true or false, got 'yes'",
    )


def test_nested_constructors_refuse_what_the_reader_refuses() -> None:
    """Built in code, a nested section names its dotted path in the error."""
    with pytest.raises(ConfigError) as info:
        HedgeConfig(percentile=1.0)
    assert info.value.errors == (
        "balancing.hedge.percentile: must be >= 0.5 and <= 0.999, got 1.0",
    )
    with pytest.raises(ConfigError) as info:
        RetryBudgetConfig(min_per_second=float("inf"))
    assert info.value.errors == (
        "balancing.retry_budget.min_per_second: must be a finite number, got inf",
    )


# -- per-worker fields -------------------------------------------------------------------


def test_new_worker_fields_default() -> None:
    """name is the id, weight 1, platform linux, protocol autobot-linux, no auth."""
    (worker,) = parse_config(one_worker()).workers
    assert (worker.name, worker.weight, worker.platform, worker.protocol) == (
        "w",
        1,
        "linux",
        "autobot-linux",
    )
    assert worker.auth == AuthConfig()
    built = WorkerConfig(id="x", url="http://h:1")
    assert (built.name, built.protocol) == ("x", "autobot-linux")


def test_protocol_follows_platform_unless_given() -> None:
    """windows defaults to autobot-windows; an explicit protocol wins over platform."""
    data = {
        "npu_workers": {
            "workers": [
                {"id": "a", "host": "h1", "platform": "windows"},
                {"id": "b", "host": "h2", "platform": "windows", "protocol": "autobot-linux"},
                {"id": "c", "host": "h3", "name": "C worker (spare)", "weight": 7},
            ]
        }
    }
    a, b, c = parse_config(data).workers
    assert (a.platform, a.protocol) == ("windows", "autobot-windows")
    assert (b.platform, b.protocol) == ("windows", "autobot-linux")
    assert (c.name, c.weight, c.id) == ("C worker (spare)", 7, "c")
    assert worker_config("d", host="h4", platform="windows").protocol == "autobot-windows"


def test_worker_field_errors_name_key_and_value() -> None:
    """weight, platform, protocol and name are each checked with key path and value."""
    errors = errors_of(one_worker(weight=0, platform="beos", protocol="grpc", name="tab\there"))
    assert errors == (
        "npu_workers.workers[0].name: must be 1..200 printable characters, got 'tab\\there'",
        "npu_workers.workers[0].weight: must be 1..100, got 0",
        "npu_workers.workers[0].platform: must be one of 'linux', 'windows', 'macos', got 'beos'",
        "npu_workers.workers[0].protocol: must be one of 'autobot-linux', "
        "'autobot-windows', got 'grpc'",
    )


@pytest.mark.parametrize(
    ("entry", "url"),
    [
        ({"host": "h", "scheme": "https"}, "https://h:8444"),
        ({"host": "h"}, "http://h:8081"),
        ({"host": "h", "scheme": "https", "port": 9443}, "https://h:9443"),
        ({"url": "https://h"}, "https://h:443"),
        ({"host": "h", "platform": "windows"}, "http://h:8082"),
        ({"host": "h", "protocol": "autobot-windows"}, "http://h:8082"),
        ({"host": "h", "platform": "windows", "protocol": "autobot-linux"}, "http://h:8081"),
        ({"host": "h", "platform": "windows", "scheme": "https"}, "https://h:8444"),
        ({"host": "h", "platform": "windows", "port": 9000}, "http://h:9000"),
    ],
)
def test_https_host_without_port_gets_autobots_tls_port(entry: dict[str, Any], url: str) -> None:
    """host with scheme https and no port means 8444; http stays 8081, or 8082 for a
    worker speaking AutoBot's Windows protocol (where its Windows worker listens); urls
    keep theirs."""
    data = {"npu_workers": {"workers": [{"id": "w", **entry}]}}
    assert parse_config(data).workers[0].url == url
    assert worker_config("w", **entry).url == url


# -- auth -------------------------------------------------------------------------------


def test_bearer_and_hmac_auth_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Secrets written as ${NAME} are read from the environment into AuthConfig."""
    monkeypatch.setenv("NPU_TOKEN", SECRET)
    monkeypatch.setenv("NPU_HMAC", SECRET + "-hmac")
    data = {
        "npu_workers": {
            "workers": [
                {"id": "a", "host": "h1", "auth": {"type": "bearer", "token": "${NPU_TOKEN}"}},
                {
                    "id": "b",
                    "host": "h2",
                    "auth": {"type": "hmac", "service_id": "backend", "secret": "${NPU_HMAC}"},
                },
            ]
        }
    }
    a, b = parse_config(data).workers
    assert a.auth == AuthConfig(type="bearer", token=SECRET)
    assert b.auth == AuthConfig(type="hmac", service_id="backend", secret=SECRET + "-hmac")
    assert a.auth.headers == {"authorization"}
    assert b.auth.headers == {"x-service-id", "x-service-signature", "x-service-timestamp"}


def test_secrets_never_appear_in_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    """repr() of the worker and of the whole config shows *** for token and secret."""
    monkeypatch.setenv("NPU_TOKEN", SECRET)
    cfg = parse_config(one_worker(auth={"type": "bearer", "token": "${NPU_TOKEN}"}))
    assert SECRET not in repr(cfg)
    assert "token='***'" in repr(cfg.workers[0])
    hmac = AuthConfig(type="hmac", service_id="svc", secret=SECRET)
    assert SECRET not in repr(hmac) and SECRET not in str(hmac)


def test_a_secret_written_in_the_file_is_refused_without_echo() -> None:
    """A literal token or secret is an error that names the key and never the value."""
    errors = errors_of(
        {
            "npu_workers": {
                "workers": [
                    {"id": "a", "host": "h1", "auth": {"type": "bearer", "token": SECRET}},
                    {
                        "id": "b",
                        "host": "h2",
                        "auth": {
                            "type": "hmac",
                            "service_id": "svc",
                            "secret": f"{SECRET}${{NPU_X:-}}",
                        },
                    },
                ]
            }
        }
    )
    assert errors == (
        "npu_workers.workers[0].auth.token: must come from the environment, written as "
        "${NAME} (the value is not shown): a secret is not kept in the file",
        "npu_workers.workers[1].auth.secret: must come from the environment, written as "
        "${NAME} (the value is not shown): a secret is not kept in the file",
    )
    assert not any(SECRET in message for message in errors)


def test_a_bad_secret_from_the_environment_is_refused_without_echo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A token with a space or a line break is refused; the message does not quote it."""
    monkeypatch.setenv("NPU_TOKEN", SECRET + " \r\nX-Injected: 1")
    monkeypatch.delenv("NPU_UNSET", raising=False)
    errors = errors_of(
        {
            "npu_workers": {
                "workers": [
                    {"id": "a", "host": "h1", "auth": {"type": "bearer", "token": "${NPU_TOKEN}"}},
                    {"id": "b", "host": "h2", "auth": {"type": "bearer", "token": "${NPU_UNSET}"}},
                ]
            }
        }
    )
    assert errors == (
        "npu_workers.workers[0].auth.token: must be printable ASCII without spaces "
        "(the value is not shown)",
        "npu_workers.workers[1].auth.token: environment variable NPU_UNSET is not set",
    )
    assert not any(SECRET in message for message in errors)


def test_auth_keys_must_match_the_type(monkeypatch: pytest.MonkeyPatch) -> None:
    """Missing keys are required, keys of another type are refused, the type is checked."""
    monkeypatch.setenv("NPU_TOKEN", SECRET)
    errors = errors_of(
        {
            "npu_workers": {
                "workers": [
                    {"id": "a", "host": "h1", "auth": {"type": "bearer"}},
                    {"id": "b", "host": "h2", "auth": {"type": "hmac", "token": "${NPU_TOKEN}"}},
                    {"id": "c", "host": "h3", "auth": {"type": "basic"}},
                ]
            }
        }
    )
    assert errors == (
        "npu_workers.workers[0].auth.token: required when type is 'bearer'",
        "npu_workers.workers[1].auth.token: not used with type 'hmac'",
        "npu_workers.workers[1].auth.service_id: required when type is 'hmac'",
        "npu_workers.workers[1].auth.secret: required when type is 'hmac'",
        "npu_workers.workers[2].auth.type: must be one of 'none', 'bearer', 'hmac', got 'basic'",
    )


def test_auth_and_headers_may_not_set_the_same_header(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bearer auth next to an Authorization header is ambiguous and refused."""
    monkeypatch.setenv("NPU_TOKEN", SECRET)
    data = one_worker(
        headers={"Authorization": "Bearer ${NPU_TOKEN}"},
        auth={"type": "bearer", "token": "${NPU_TOKEN}"},
    )
    assert errors_of(data) == (
        "npu_workers.workers[0].auth.type: 'bearer' sets the Authorization header, which "
        "headers sets too: keep one",
    )


def test_worker_config_takes_auth_literally() -> None:
    """In code there is no file to keep secrets out of: worker_config takes them as given."""
    worker = worker_config("w", host="h", auth=AuthConfig(type="bearer", token=SECRET))
    assert worker.auth.token == SECRET
    mapped = worker_config("w", host="h", auth={"type": "hmac", "service_id": "s", "secret": "k"})
    assert mapped.auth == AuthConfig(type="hmac", service_id="s", secret="k")


def test_pool_config_carries_the_new_sections() -> None:
    """PoolConfig() has the default balancing and models sections."""
    assert PoolConfig().balancing == BalancingConfig()
    assert PoolConfig().models == ModelsConfig()
