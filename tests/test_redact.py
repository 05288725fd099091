"""The Scrubber: configured secrets taken out of what a worker says."""

from __future__ import annotations

import base64
import json
import logging
from urllib.parse import quote

import pytest

from npu_sync import ConfigError
from npu_sync._redact import (
    MAX_BODY_SCANNED,
    MAX_WORKER_TEXT,
    MIN_PART_LENGTH,
    MIN_SECRET_LENGTH,
    REDACTED,
    Scrubber,
)
from npu_sync.cli import main
from npu_sync.config import parse_config, parse_yaml
from npu_sync.errors import scrub

TOKEN = "tok-3f9a1c77e2b54d08"


def config(workers: str, extra: str = "") -> object:
    return parse_config(
        {"npu_workers": {"workers": json.loads(workers), **json.loads(extra or "{}")}}
    )


def test_a_secret_is_replaced_wherever_it_appears():
    """Every occurrence of the secret becomes [redacted]; the rest of the text stays."""
    scrub = Scrubber([TOKEN])
    assert scrub(f"HTTP 401: bad token {TOKEN}, again {TOKEN}.") == (
        f"HTTP 401: bad token {REDACTED}, again {REDACTED}."
    )


def test_a_text_without_secrets_is_unchanged():
    """Ordinary text, and a secret-free scrubber, leave a text as it was."""
    assert Scrubber([TOKEN])("HTTP 500: simulated failure") == "HTTP 500: simulated failure"
    assert Scrubber()("HTTP 500: " + TOKEN) == "HTTP 500: " + TOKEN


def test_a_secret_cut_short_or_quoted_in_part_is_redacted():
    """Any run of MIN_PART_LENGTH characters of a secret goes: a prefix, a middle."""
    scrub = Scrubber([TOKEN])
    assert scrub(f"token {TOKEN[:MIN_PART_LENGTH]}") == f"token {REDACTED}"
    assert TOKEN[3:18] not in scrub(f"saw ...{TOKEN[3:18]}...")
    # Shorter than that is not looked for: it cannot be told from ordinary text.
    assert scrub(f"token {TOKEN[: MIN_PART_LENGTH - 1]}") == f"token {TOKEN[: MIN_PART_LENGTH - 1]}"


def test_a_word_a_secret_shares_with_ordinary_text_is_not_redacted():
    """A secret holding a common word does not garble every message that has the word:
    only runs of MIN_PART_LENGTH of its characters count."""
    scrub = Scrubber(["application-secret-42"])
    assert scrub("Content-Type application/json") == "Content-Type application/json"
    assert scrub("key application-secret-42") == f"key {REDACTED}"


def test_a_secret_shorter_than_a_part_is_caught_whole_only():
    """A secret of MIN_SECRET_LENGTH to MIN_PART_LENGTH - 1 characters goes when whole."""
    secret = "k3y-5ecr3t"
    assert MIN_SECRET_LENGTH <= len(secret) < MIN_PART_LENGTH
    scrub = Scrubber([secret])
    assert scrub(f"bad key {secret}!") == f"bad key {REDACTED}!"
    assert scrub(f"bad key {secret[:-1]}") == f"bad key {secret[:-1]}"


def test_a_secret_echoed_in_another_case_is_redacted():
    """A worker that upper-cases what it quotes still does not show the secret."""
    scrub = Scrubber([TOKEN])
    assert scrub(f"TOKEN {TOKEN.upper()} REFUSED") == f"TOKEN {REDACTED} REFUSED"


def test_a_huge_rejected_body_costs_bounded_work_and_is_kept_in_part():
    """A refusal's body past MAX_BODY_SCANNED is kept as its scrubbed beginning."""
    scrub = Scrubber([TOKEN])
    body = {"detail": f"bad {TOKEN} " + "x" * (4 * MAX_BODY_SCANNED)}
    kept = scrub.value(body)
    assert isinstance(kept, str) and len(kept) <= MAX_BODY_SCANNED + len("...")
    assert TOKEN not in kept and REDACTED in kept


def test_url_encoded_and_json_escaped_forms_are_redacted():
    """A secret written URL-encoded or JSON-escaped by the worker is caught too."""
    secret = 'p@ss/w"rd\\+1 2'
    scrub = Scrubber([secret])
    for form in (quote(secret, safe=""), json.dumps(secret)[1:-1]):
        assert secret not in scrub(f"got {form}") and REDACTED in scrub(f"got {form}")


def test_secrets_shorter_than_the_minimum_are_ignored():
    """A 3-character secret would redact every 'abc' of every message: it is not used."""
    assert Scrubber(["abc"])("abc abcabc") == "abc abcabc"


def test_a_long_text_is_capped():
    """What is kept of one worker text is at most MAX_WORKER_TEXT characters."""
    text = Scrubber([TOKEN])("x" * 100_000)
    assert len(text) == MAX_WORKER_TEXT and text.endswith("...")


def test_from_config_takes_header_values_but_not_plain_headers():
    """Authorization's token, X-Api-Key and a custom header are secrets; Content-Type is not."""
    cfg = config(
        json.dumps(
            [
                {
                    "id": "a",
                    "url": "http://127.0.0.1:9",
                    "headers": {
                        "Authorization": f"Bearer {TOKEN}",
                        "X-Api-Key": "key-0123456789",
                        "X-Tenant": "tenant-secretish",
                        "Content-Type": "application/json",
                    },
                }
            ]
        )
    )
    scrub = Scrubber.from_config(cfg)
    text = scrub(f"{TOKEN} key-0123456789 tenant-secretish application/json")
    assert text == f"{REDACTED} {REDACTED} {REDACTED} application/json"


def test_from_config_decodes_basic_credentials():
    """For Basic auth, the base64 value, the decoded user:password and the password go."""
    pair = "admin:hunter2-long-pw"
    encoded = base64.b64encode(pair.encode()).decode()
    cfg = config(
        json.dumps(
            [
                {
                    "id": "a",
                    "url": "http://127.0.0.1:9",
                    "headers": {"Authorization": f"Basic {encoded}"},
                }
            ]
        )
    )
    scrub = Scrubber.from_config(cfg)
    for shown in (encoded, pair, "hunter2-long-pw"):
        assert scrub(f"echo {shown}") == f"echo {REDACTED}"


def test_from_config_takes_auth_secrets_and_the_redis_password(monkeypatch):
    """The bearer token, the HMAC secret, and the Redis URL's password (raw, decoded and
    as Basic base64) are secrets."""
    monkeypatch.setenv("TOK", TOKEN)
    monkeypatch.setenv("SEC", "hmac-key-9c2e71d0")
    cfg = config(
        json.dumps(
            [
                {
                    "id": "a",
                    "url": "http://127.0.0.1:9",
                    "auth": {"type": "bearer", "token": "${TOK}"},
                },
                {
                    "id": "b",
                    "url": "http://127.0.0.1:10",
                    "auth": {"type": "hmac", "service_id": "svc", "secret": "${SEC}"},
                },
            ]
        ),
        json.dumps({"shared_state": {"url": "redis://user:r%40dis-pass-77@h:6379/0"}}),
    )
    scrub = Scrubber.from_config(cfg)
    basic = base64.b64encode(b"user:r@dis-pass-77").decode()
    for shown in (TOKEN, "hmac-key-9c2e71d0", "r%40dis-pass-77", "r@dis-pass-77", basic):
        assert scrub(f"echo {shown}") == f"echo {REDACTED}", shown


def test_after_a_reload_the_previous_secrets_are_still_redacted_one_generation_only():
    """An answer to a request sent with the old secret may arrive after the reload."""
    first = Scrubber.from_config(
        config('[{"id": "a", "url": "http://h:1", "headers": {"X-K": "alpha-token-1111"}}]')
    )
    second = Scrubber.from_config(
        config('[{"id": "a", "url": "http://h:1", "headers": {"X-K": "bravo-key-22222"}}]'), first
    )
    third = Scrubber.from_config(
        config('[{"id": "a", "url": "http://h:1", "headers": {"X-K": "charlie-pass-333"}}]'), second
    )
    assert second("alpha-token-1111 bravo-key-22222") == f"{REDACTED} {REDACTED}"
    assert third("alpha-token-1111") == "alpha-token-1111"


def test_short_secrets_are_named_never_shown(caplog):
    """A configured secret too short to look for is reported by place, when a pool starts."""
    from npu_sync import WorkerPool
    from npu_sync.testing import FakeNetwork

    caplog.set_level(logging.WARNING)
    cfg = config(
        '[{"id": "a", "url": "http://h:1", "headers": {"X-Api-Key": "k3y"}}]',
        '{"health": {"enabled": false}}',
    )
    with WorkerPool(cfg, transport_factory=FakeNetwork().factory):
        pass
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("worker a: header X-Api-Key is shorter than" in w for w in warnings)
    assert not any("k3y" in w for w in warnings)


def test_value_redacts_inside_a_json_answer():
    """A rejected answer's body keeps its shape with the secret's text replaced."""
    scrub = Scrubber([TOKEN])
    body = {"detail": [{"msg": "bad", "input": {"auth": f"Bearer {TOKEN}"}}]}
    assert scrub.value(body) == {
        "detail": [{"msg": "bad", "input": {"auth": f"Bearer {REDACTED}"}}]
    }
    clean = {"detail": "fine"}
    assert scrub.value(clean) is clean


# Attacks on hiding secrets with what an operator could really write: credentials in any
# shape of URL, a value under a wrong explicit tag, ordinary text left alone.


SECRET = "Sup3rS3cretPassw0rd"


LEAKY_URLS = [
    # The quote is cut at 80 characters: the '@' falls past the cut.
    f"http://a-rather-long-service-account-name-for-the-npu-pool:{SECRET}@npu.example.com:99999",
    f"a-rather-long-service-account-name-for-the-npu-workers-here:{SECRET}@host:8081",
    # Characters a password may hold that end a URL's authority.
    f"http://user:pa/{SECRET}@127.0.0.1:8081",
    f"http://user:{SECRET}#x@127.0.0.1:8081",
    f"http://user:{SECRET}?x@127.0.0.1:8081",
    # A token in a fragment, as OAuth's implicit flow puts it.
    f"http://127.0.0.1:8081/#access_token={SECRET}",
    # A scheme with one slash: still a credential.
    f"http:/user:{SECRET}@127.0.0.1:8081",
]


@pytest.mark.parametrize("url", LEAKY_URLS)
def test_no_shape_of_a_credential_in_a_worker_url_is_quoted(url):
    """Whatever the URL's shape, the ConfigError names the key and hides the secret."""
    with pytest.raises(ConfigError) as info:
        parse_yaml(f"npu_workers:\n  workers:\n    - {{id: a, url: '{url}'}}\n", source="/x.yaml")
    assert "npu_workers.workers[0].url" in str(info.value)
    assert SECRET not in str(info.value)
    assert SECRET[:6] not in str(info.value)


def test_scrub_still_leaves_ordinary_text_alone():
    """Masking to the last '@' and fragments does not eat e-mail addresses or prose."""
    assert scrub("mail ops@example.com, see http://host/x#section") == (
        "mail ops@example.com, see http://host/x#section"
    )
    assert scrub("http://h:1/a and http://u:p@h:2/b") == "http://h:1/a and http://***@h:2/b"


@pytest.mark.parametrize("tag", ["!!int", "!!float", "!!timestamp", "!!bool", "!!binary"])
def test_a_value_under_a_wrong_explicit_tag_is_a_config_error_that_hides_it(tmp_path, tag):
    """A header value tagged !!int (or !!timestamp, !!bool ...) it cannot be: a
    ConfigError (exit 2 from check, counted by reload), never KeyError/AttributeError,
    and the value itself is not quoted."""
    path = tmp_path / "pool.yaml"
    path.write_text(
        "npu_workers:\n  workers:\n"
        f"    - {{id: a, url: 'http://127.0.0.1:9601', headers: {{X-Key: {tag} {SECRET}}}}}\n"
    )
    assert main(["check", str(path)]) == 2
    with pytest.raises(ConfigError) as info:
        parse_yaml(path.read_text(), source=str(path))
    assert "YAML" in str(info.value)
    assert SECRET not in str(info.value)
