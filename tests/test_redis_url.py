"""The spellings of ``shared_state.url``: one server, Sentinel, Cluster (npu_sync._redis_url)."""

from __future__ import annotations

import pytest

from npu_sync import _redis_url
from npu_sync.config import parse_config
from npu_sync.errors import ConfigError

SECRET = "hunter2-secret"


def errors_of(shared_state: dict[str, object]) -> tuple[str, ...]:
    raw = {
        "npu_workers": {
            "workers": [{"id": "w", "url": "http://127.0.0.1:1"}],
            "shared_state": shared_state,
        }
    }
    try:
        parse_config(raw)
    except ConfigError as exc:
        return tuple(exc.errors)
    return ()


def test_a_sentinel_url_names_its_sentinels_service_database_and_credentials() -> None:
    """Every sentinel, the service, the database and the data nodes' credentials are read."""
    target = _redis_url.parse(
        f"redis+sentinel://app:{SECRET}@10.0.0.1:26380,sentinel-b,[::1]:26381/mymaster/2"
    )
    assert target.kind == _redis_url.SENTINEL
    assert target.nodes == (("10.0.0.1", 26380), ("sentinel-b", 26379), ("::1", 26381))
    assert (target.service, target.db, target.username, target.password, target.tls) == (
        "mymaster",
        2,
        "app",
        SECRET,
        False,
    )
    assert SECRET not in repr(target)


def test_a_cluster_url_names_its_start_up_nodes() -> None:
    """A Cluster URL lists start-up nodes (6379 by default), TLS with rediss+."""
    target = _redis_url.parse(f"rediss+cluster://:{SECRET}@n1:7000,n2?client_name=app")
    assert target.kind == _redis_url.CLUSTER
    assert target.nodes == (("n1", 7000), ("n2", 6379))
    assert target.tls and target.password == SECRET and target.query == (("client_name", "app"),)


def test_the_one_server_urls_are_left_to_redis_py() -> None:
    """redis://, rediss:// and unix:// keep meaning one server, as before."""
    for url, tls in (("redis://h:6379/0", False), ("rediss://h", True), ("unix:///r.sock", False)):
        target = _redis_url.parse(url)
        assert (target.kind, target.tls, target.nodes) == (_redis_url.SERVER, tls, ())


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        (f"redis+sentinel://:{SECRET}@h1:26379,h2:26379", "needs the service name"),
        (f"redis+sentinel://:{SECRET}@h1:26379/", "needs the service name"),
        (f"redis+sentinel://:{SECRET}@h1/mymaster/zero", "has a database that is not a number"),
        (f"redis+sentinel://:{SECRET}@h1/mymaster/0/1", "has more than /service/db"),
        (f"redis+sentinel://:{SECRET}@h1:0/mymaster", "has an invalid port (must be 1..65535)"),
        (f"redis+sentinel://:{SECRET}@h1:70000/mymaster", "has an invalid port"),
        (f"redis+sentinel://:{SECRET}@h1,,h2/mymaster", "has an empty host in its list"),
        (f"redis+sentinel://:{SECRET}@[::1/mymaster", "without its closing ']'"),
        (f"redis+sentinel://:{SECRET}@h1/mymaster?db=1", "sets 'db' in its query"),
        (f"redis+cluster://:{SECRET}@h1:7000/0", "has a path: a Cluster has no database"),
        (f"redis+cluster://:{SECRET}@h1:7000?db=1", "sets 'db' in its query"),
        (f"redis+cluster://:{SECRET}@h1:7000?foo={SECRET}", "has an unknown query parameter"),
        (f"redis+cluster://:{SECRET}@h1?ssl_ca_certs=/ca", "which only a rediss:// URL takes"),
        (f"redis+cluster://:{SECRET}@h1?socket_timeout=3", "npu_sync sets it from shared_state"),
        (f"sentinel://:{SECRET}@h1:26379/mymaster", "must start with redis://"),
    ],
)
def test_a_bad_sentinel_or_cluster_url_is_refused_naming_the_key_never_the_password(
    url: str, problem: str
) -> None:
    """The error names shared_state.url and what is wrong, and never quotes the URL."""
    errors = errors_of({"backend": "redis", "url": url})
    assert len(errors) == 1, errors
    assert errors[0].startswith("npu_workers.shared_state.url: ")
    assert problem in errors[0]
    assert SECRET not in errors[0]


def test_good_sentinel_and_cluster_urls_load() -> None:
    """Well-formed Sentinel and Cluster URLs load, and repr() masks their password."""
    for url in (
        f"redis+sentinel://:{SECRET}@127.0.0.1:26379,127.0.0.1:26380/mymaster/0",
        "rediss+sentinel://127.0.0.1/mymaster?ssl_ca_certs=/ca.pem",
        f"redis+cluster://:{SECRET}@127.0.0.1:7000,127.0.0.1:7001",
    ):
        raw = {
            "npu_workers": {
                "workers": [{"id": "w", "url": "http://127.0.0.1:1"}],
                "shared_state": {"backend": "redis", "url": url},
            }
        }
        config = parse_config(raw)
        assert config.shared_state.url == url
        assert SECRET not in repr(config.shared_state)


@pytest.mark.parametrize("namespace", ["{app}", "a{b", "b}"])
def test_a_namespace_with_a_brace_is_refused(namespace: str) -> None:
    """A brace would break the key's hash tag (one Cluster slot per namespace)."""
    errors = errors_of({"backend": "redis", "namespace": namespace})
    assert errors == (
        f"npu_workers.shared_state.namespace: must not contain '{{' or '}}', got {namespace!r}",
    )
