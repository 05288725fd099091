"""Attacks on the config, reload and secret-scrubbing guards, each with the file or the
text an operator (or a mistake) could really produce."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from npu_sync import ConfigError, Task, TaskFailed, WorkerPool
from npu_sync.cli import main
from npu_sync.config import parse_yaml
from npu_sync.errors import scrub
from npu_sync.testing import FakeNetwork, json_response
from tests.load import Load

SECRET = "Sup3rS3cretPassw0rd"


def echo(req):
    return json_response(200, {"worker_id": req.worker_id})


def workers_yaml(ids, *, extra: str = "", port0: int = 9600) -> str:
    lines = ["npu_workers:", "  health: {enabled: false}", "  workers:"]
    lines += [
        f"    - {{id: {wid}, url: 'http://127.0.0.1:{port0 + i}'}}" for i, wid in enumerate(ids)
    ]
    return "\n".join(lines) + "\n" + extra


def wait_for(condition, what: str, timeout: float = 20.0) -> None:
    pause = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        pause.wait(0.01)
    pytest.fail(f"timed out waiting for {what}")


# -- YAML that is small on disk and huge in memory ---------------------------------------

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


@pytest.mark.slow
def test_a_file_with_countless_errors_gives_a_bounded_error(tmp_path):
    """90,000 aliases of one broken worker make one short ConfigError, and stats() and
    the log carry that short text, not megabytes of it."""
    path = tmp_path / "pool.yaml"
    path.write_text(workers_yaml(["a", "b"]))
    broken = "w: &w {id: a, url: 'http://127.0.0.1:1'}\nnpu_workers:\n  workers: ["
    broken += ", ".join(["*w"] * 90_000) + "]\n"
    with WorkerPool.from_yaml(
        path, watch=False, transport_factory=FakeNetwork(echo).factory
    ) as pool:
        path.write_text(broken)
        with pytest.raises(ConfigError) as info:
            pool.reload()
        assert len(str(info.value)) < 100_000
        assert len(info.value.errors) <= 101
        assert "more" in info.value.errors[-1]
        assert len(json.dumps(pool.stats())) < 100_000
        assert [w["id"] for w in pool.workers()] == ["a", "b"]


# -- secrets in every shape a URL can take ------------------------------------------------

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


# -- reload decisions -------------------------------------------------------------------


def test_a_broken_file_is_counted_again_after_a_good_one_in_between(tmp_path):
    """Broken content, then good content, then the same broken content: the second
    break is counted and reported too (it is a new failure of the file on disk)."""
    path = tmp_path / "pool.yaml"
    good_a = workers_yaml(["a", "b"])
    good_b = workers_yaml(["a", "b", "c"])
    broken = "npu_workers: [broken\n"
    with WorkerPool.from_yaml(
        path_with(path, good_a), watch=False, transport_factory=FakeNetwork(echo).factory
    ) as pool:
        path.write_text(broken)
        pool._reload_if_changed()
        path.write_text(good_b)
        pool._reload_if_changed()
        assert pool.stats()["reloads"]["last_error"] is None
        path.write_text(broken)
        pool._reload_if_changed()
        reloads = pool.stats()["reloads"]
        assert (reloads["ok"], reloads["failed"]) == (1, 2)
        assert "YAML syntax error" in reloads["last_error"]


def path_with(path, text: str):
    path.write_text(text)
    return path


def test_the_old_files_reload_rules_do_not_let_a_new_file_empty_the_pool(tmp_path):
    """The running file allows emptying; a new file without a reload section does not
    inherit that: its own (default) rules refuse to empty the pool."""
    path = tmp_path / "pool.yaml"
    permissive = workers_yaml(
        ["a", "b", "c", "d"], extra="  reload: {allow_empty: true, max_removed_share: 1}\n"
    )
    with WorkerPool.from_yaml(
        path_with(path, permissive), watch=False, transport_factory=FakeNetwork(echo).factory
    ) as pool:
        path.write_text("npu_workers:\n  health: {enabled: false}\n  workers: []\n")
        with pytest.raises(ConfigError, match="no enabled worker"):
            pool.reload()
        path.write_text(workers_yaml(["z"], port0=9700))
        with pytest.raises(ConfigError, match="leaves 1 of the 4 enabled workers"):
            pool.reload()
        assert [w["id"] for w in pool.workers()] == ["a", "b", "c", "d"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            workers_yaml(["a", "b", "c", "d", "e"]).replace("'}", "', enabled: false}"),
            "no enabled worker",
        ),
        (workers_yaml(["a", "b"]), "leaves 2 of the 5 enabled workers"),
    ],
    ids=["all-disabled", "sixty-percent-removed"],
)
def test_disabling_all_or_removing_most_is_refused(tmp_path, text, message):
    """Every worker disabled, or 3 of 5 removed (60 % > 50 %): refused, pool unchanged."""
    path = tmp_path / "pool.yaml"
    with WorkerPool.from_yaml(
        path_with(path, workers_yaml(["a", "b", "c", "d", "e"])),
        watch=False,
        transport_factory=FakeNetwork(echo).factory,
    ) as pool:
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            pool.reload()
        assert len(pool.workers()) == 5
        assert pool.stats()["reloads"]["failed"] == 1


def test_the_same_workers_in_another_order_with_bom_and_crlf_remove_nothing(tmp_path):
    """Reordered workers, a UTF-8 BOM and CRLF line ends: same pool, nothing removed."""
    path = tmp_path / "pool.yaml"
    ids = ["a", "b", "c", "d"]
    with WorkerPool.from_yaml(
        path_with(path, workers_yaml(ids)), watch=False, transport_factory=FakeNetwork(echo).factory
    ) as pool:
        lines = workers_yaml(ids).splitlines()
        reordered = lines[:3] + list(reversed(lines[3:]))
        path.write_bytes(("\ufeff" + "\r\n".join(reordered) + "\r\n").encode("utf-8"))
        result = pool.reload()
        assert (result.added, result.removed, result.updated) == ((), (), ())
        assert sorted(result.unchanged) == ids


def test_a_tab_indented_file_is_refused_with_its_line(tmp_path):
    """A tab where YAML needs spaces: a syntax error naming the line, pool unchanged."""
    path = tmp_path / "pool.yaml"
    with WorkerPool.from_yaml(
        path_with(path, workers_yaml(["a", "b"])),
        watch=False,
        transport_factory=FakeNetwork(echo).factory,
    ) as pool:
        path.write_text(workers_yaml(["a", "b"]).replace("    - {id: b", "\t- {id: b"))
        with pytest.raises(ConfigError, match=r"line 5"):
            pool.reload()
        assert len(pool.workers()) == 2


# -- the real watcher against real writers ------------------------------------------------


def slow_answer(req):
    threading.Event().wait(0.0005)
    return json_response(200, {"worker_id": req.worker_id})


def test_a_file_written_one_byte_per_write_is_applied_only_whole(tmp_path):
    """A writer that flushes one byte at a time (faster than the debounce): the pool
    under load only ever applies the finished file, and no task fails."""
    path = tmp_path / "pool.yaml"
    old = workers_yaml(["w0", "w1", "w2"], extra="  reload: {max_removed_share: 0}\n")
    new = old + "    - {id: w3, url: 'http://127.0.0.1:9603'}\n"
    new = new.replace("  reload: {max_removed_share: 0}\n", "") + (
        "  reload: {max_removed_share: 0}\n"
    )
    applied: list[dict] = []

    def hook(event):
        if type(event).__name__ == "ConfigReloaded":
            applied.append(event.changes)

    with (
        WorkerPool.from_yaml(
            path_with(path, old),
            transport_factory=FakeNetwork(slow_answer).factory,
            poll_interval=3600,
            hooks=[hook],
        ) as pool,
        Load(pool) as load,
    ):
        wait_for(lambda: load.ok >= 20, "the load to get going")
        pace = threading.Event()
        with open(path, "wb", buffering=0) as fh:
            for byte in new.encode():
                fh.write(bytes([byte]))
                pace.wait(0.002)  # the writer's own pace, well under the debounce
        wait_for(lambda: "w3" in [w["id"] for w in pool.workers()], "the finished file")
    assert load.errors == []
    assert [c["added"] for c in applied] == [["w3"]]
    assert all(not c["removed"] for c in applied)


def test_a_file_truncated_then_rewritten_later_keeps_the_pool(tmp_path):
    """Truncated to nothing, left so past the debounce, then rewritten: the empty file
    is refused and counted, the rewrite applied, and no task fails meanwhile."""
    path = tmp_path / "pool.yaml"
    old = workers_yaml(["w0", "w1"])
    with (
        WorkerPool.from_yaml(
            path_with(path, old),
            transport_factory=FakeNetwork(slow_answer).factory,
            poll_interval=3600,
        ) as pool,
        Load(pool) as load,
    ):
        wait_for(lambda: load.ok >= 20, "the load to get going")
        with open(path, "wb"):
            pass
        wait_for(lambda: pool.stats()["reloads"]["failed"] == 1, "the empty file refused")
        assert [w["id"] for w in pool.workers()] == ["w0", "w1"]
        path.write_text(old + "    - {id: w2, url: 'http://127.0.0.1:9602'}\n")
        wait_for(lambda: len(pool.workers()) == 3, "the rewrite")
    assert load.errors == []
    assert pool.stats()["reloads"]["ok"] == 1


def test_a_configmap_swap_to_a_broken_file_is_refused_then_a_good_one_applied(tmp_path):
    """Kubernetes-style ..data symlink swapped to a directory whose file is broken,
    then to a good one: refused and counted, then applied; no task fails."""
    root = tmp_path / "config"
    root.mkdir()

    def version(name: str, text: str) -> None:
        directory = root / name
        directory.mkdir()
        (directory / "pool.yaml").write_text(text)
        link = root / "..data_tmp"
        os.symlink(name, link)
        os.replace(link, root / "..data")

    version("..v1", workers_yaml(["w0", "w1"]))
    os.symlink("..data/pool.yaml", root / "pool.yaml")
    with (
        WorkerPool.from_yaml(
            root / "pool.yaml",
            transport_factory=FakeNetwork(slow_answer).factory,
            poll_interval=3600,
        ) as pool,
        Load(pool) as load,
    ):
        wait_for(lambda: load.ok >= 20, "the load to get going")
        version("..v2", "npu_workers:\n  workers:\n    - {id: w0, url: 'http://127.0.0.1:\n")
        wait_for(lambda: pool.stats()["reloads"]["failed"] == 1, "the broken version refused")
        assert [w["id"] for w in pool.workers()] == ["w0", "w1"]
        version("..v3", workers_yaml(["w0", "w1", "w2"]))
        wait_for(lambda: len(pool.workers()) == 3, "the good version")
    assert load.errors == []


# -- secrets that a valid configuration holds ----------------------------------------------

HEADER_SECRET = "hdr-s3cret-value"
BEARER_SECRET = "bearer-s3cret-value"
REDIS_SECRET = "redis-s3cret-value"


def test_credentials_in_headers_and_the_redis_url_reach_no_surface_when_all_fails(
    tmp_path, caplog, capsys, monkeypatch
):
    """Header values (any name), a Bearer token from the environment and the Redis
    password in a valid file: with the worker unreachable and Redis down, none shows in
    TaskFailed, dead letters, logs, stats(), workers(), repr, the Flask endpoints, the
    status page, metrics or `npu-sync status`/`check`/`dlq list`."""
    pytest.importorskip("flask")
    pytest.importorskip("prometheus_client")
    import socket

    from flask import Flask

    from npu_sync.flask import NpuSync
    from npu_sync.prometheus import metrics_text

    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("NPU_TOKEN", BEARER_SECRET)
    with socket.socket() as s:  # a port nothing listens on, for the worker and Redis
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    store = tmp_path / "dead.sqlite3"
    path = tmp_path / "pool.yaml"
    path.write_text(
        "npu_workers:\n"
        "  workers:\n"
        f"    - id: a\n      url: 'http://127.0.0.1:{dead_port}'\n"
        "      headers:\n"
        f"        X-Api-Key: '{HEADER_SECRET}'\n"
        "        Authorization: 'Bearer ${NPU_TOKEN}'\n"
        "  health: {enabled: true, interval: 3600}\n"
        "  retry: {max_retries: 0}\n"
        f"  dead_letter: {{backend: sqlite, path: '{store}'}}\n"
        "  shared_state: {backend: redis, timeout: 0.2,"
        f" url: 'redis://user:{REDIS_SECRET}@127.0.0.1:{dead_port}/0'}}\n"
    )
    surfaces: dict[str, str] = {}
    with WorkerPool.from_yaml(path, watch=False) as pool:
        assert pool.config.workers[0].headers["X-Api-Key"] == HEADER_SECRET
        with pytest.raises(TaskFailed) as failed:
            pool.execute(Task({"input_text": "x"}))
        pool.check_health()
        record = pool.dead_letters.get(failed.value.dead_letter_id)
        surfaces.update(
            {
                "TaskFailed": str(failed.value) + repr(failed.value.attempts),
                "dead letter": json.dumps(record.to_dict()),
                "stats()": json.dumps(pool.stats()),
                "workers()": json.dumps(pool.workers()),
                "repr(config)": repr(pool.config) + repr(pool.config.workers[0]),
                "repr(pool)": repr(pool),
                "metrics": metrics_text(pool)[0].decode(),
            }
        )
        assert pool.stats()["shared_state"]["available"] is False  # Redis failed
        app = Flask(__name__)
        app.config.update(TESTING=True, NPU_SYNC_ADMIN_TOKEN="t")
        NpuSync(app, pool=pool)
        client = app.test_client()
        for route in ("/", "/stats", "/workers", "/dead-letters", "/metrics"):
            surfaces[f"GET {route}"] = client.get(f"/api/npu/pool{route}").get_data(as_text=True)
        surfaces["GET /dead-letters (admin)"] = client.get(
            "/api/npu/pool/dead-letters", headers={"Authorization": "Bearer t"}
        ).get_data(as_text=True)
    # The sqlite store is what the CLI lists; shared state needs no Redis for it.
    for argv in (
        ["status", str(path)],
        ["status", "--json", str(path)],
        ["check", str(path)],
        ["dlq", "list", "--config", str(path)],
        ["dlq", "show", record.id, "--config", str(path)],
    ):
        main(argv)
        out, err = capsys.readouterr()
        assert out, f"npu-sync {argv[0]} printed nothing"
        surfaces["npu-sync " + " ".join(argv[:2])] = out + err
    surfaces["logs"] = "\n".join(
        r.getMessage() + repr(r.args) + str(r.exc_text) for r in caplog.records
    )
    for where, text in surfaces.items():
        for secret in (HEADER_SECRET, BEARER_SECRET, REDIS_SECRET):
            assert secret not in text, f"{secret} leaked into {where}"


# -- records written by another tool or an older version ----------------------------------

HOSTILE = "\x1b]0;owned\x07\x1b[2J\r\b\u202e"


def test_hostile_text_stored_in_a_record_reaches_no_terminal_through_the_cli(tmp_path, capsys):
    """A record whose id, task id, error and attempts hold escape sequences (written
    into the file by an older npu_sync or another tool): `npu-sync dlq list`, `show`,
    `list --json` and `replay` print them escaped."""
    import sqlite3

    from npu_sync._deadletter import SQLiteDeadLetterStore

    store = tmp_path / "dead.sqlite3"
    SQLiteDeadLetterStore(store).close()
    with sqlite3.connect(store) as conn:
        conn.execute(
            "INSERT INTO dead_letters (id, task_id, payload, endpoint, idempotent, timeout,"
            " error, attempts, first_attempt_at, last_attempt_at, created_at)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (
                "id" + HOSTILE,
                "task" + HOSTILE,
                json.dumps({"input_text": HOSTILE}),
                "/inference",
                1,
                1.0,
                "error" + HOSTILE,
                json.dumps([{"worker_id": "w" + HOSTILE, "error": HOSTILE, "duration": 0.1}]),
                1.0,
                1.0,
                1.0,
            ),
        )
    conn.close()
    path = tmp_path / "pool.yaml"
    path.write_text(
        "npu_workers:\n  workers: [{id: w0, url: 'http://127.0.0.1:9'}]\n"
        "  health: {enabled: false}\n  retry: {max_retries: 0}\n"
        f"  dead_letter: {{backend: sqlite, path: '{store}'}}\n"
    )
    for argv in (
        ["dlq", "list"],
        ["dlq", "list", "--json"],
        ["dlq", "show", "id" + HOSTILE],
        ["dlq", "replay"],
    ):
        main([*argv, "--config", str(path)])
        out, err = capsys.readouterr()
        assert "id" in out, argv
        for char in ("\x1b", "\x07", "\r", "\b", "\u202e"):
            assert char not in out + err, f"{char!r} reached the terminal via {argv}"


# -- npu-sync check against what start-up refuses ------------------------------------------


def test_check_refuses_a_default_spool_directory_others_may_write_to(tmp_path, monkeypatch, capsys):
    """The default Redis spool's directory exists, world-writable: start-up refuses it,
    so `npu-sync check` must too (exit 2, the key named), not answer ok."""
    import tempfile

    from npu_sync._deadletter import default_spool_path

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    spool_dir = os.path.dirname(default_spool_path("npu_sync"))
    os.makedirs(spool_dir)
    os.chmod(spool_dir, 0o777)
    path = tmp_path / "pool.yaml"
    path.write_text(
        "npu_workers:\n  workers: [{id: w0, url: 'http://127.0.0.1:9'}]\n"
        "  shared_state: {backend: redis, url: 'redis://127.0.0.1:1/0'}\n"
        "  dead_letter: {backend: redis}\n"
    )
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "npu_workers.dead_letter.spool_path:" in err
    assert "others may write to it" in err
    os.chmod(spool_dir, 0o700)
    assert main(["check", str(path)]) == 0


def test_a_store_file_truncated_in_place_is_refused_not_written_into(tmp_path, caplog):
    """`: > dead.sqlite3` (or a copytruncate) while the pool runs: same inode, no
    header. Tasks then fail saying their record was not stored, each record is logged,
    rather than "succeeding" into a file that no longer opens."""
    from npu_sync.config import DeadLetterConfig, HealthConfig, PoolConfig, RetryConfig
    from npu_sync.config import worker_config as make_worker

    store = tmp_path / "dead.sqlite3"
    config = PoolConfig(
        workers=(make_worker("gone", "http://127.0.0.1:9"),),
        health=HealthConfig(enabled=False),
        retry=RetryConfig(max_retries=0),
        dead_letter=DeadLetterConfig(backend="sqlite", path=str(store)),
    )
    with WorkerPool(config) as pool:
        with pytest.raises(TaskFailed) as first:
            pool.execute(Task({"input_text": "x"}, task_id="before"))
        assert first.value.dead_letter_id is not None
        os.truncate(store, 0)
        with caplog.at_level(logging.ERROR), pytest.raises(TaskFailed) as after:
            pool.execute(Task({"input_text": "x"}, task_id="after"))
        assert after.value.dead_letter_id is None
        assert "truncated" in str(after.value)
        assert any('"task_id": "after"' in r.getMessage() for r in caplog.records)
        assert pool.stats()["dead_letters"]["pending"] is None


@pytest.mark.parametrize(
    "schema",
    ["CREATE TABLE users (id INTEGER PRIMARY KEY, email TEXT)", "CREATE TABLE dead_letters (x)"],
    ids=["other-tables", "same-table-name"],
)
def test_another_applications_database_is_neither_adopted_nor_passed_by_check(
    tmp_path, capsys, schema
):
    """dead_letter.path names another application's SQLite file: `npu-sync check` says
    so (exit 2), and the pool refuses it at start instead of writing task payloads into
    that database, or failing with a bare 'table already exists'."""
    import sqlite3

    store = tmp_path / "app.sqlite3"
    with sqlite3.connect(store) as conn:
        conn.execute(schema)
    conn.close()
    path = tmp_path / "pool.yaml"
    path.write_text(
        "npu_workers:\n  workers: [{id: w0, url: 'http://127.0.0.1:9'}]\n"
        f"  dead_letter: {{backend: sqlite, path: '{store}'}}\n"
    )
    assert main(["check", str(path)]) == 2
    assert "npu_workers.dead_letter.path:" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="a database of something else"):
        WorkerPool.from_yaml(path, watch=False)
    with sqlite3.connect(store) as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
    conn.close()
    assert "dead_letter_meta" not in tables


def test_workers_added_in_code_do_not_make_an_unchanged_worker_list_a_removal(tmp_path):
    """Two workers added with add_worker() to a one-worker file: editing another
    setting of the file still applies (the file removes nothing it named); the
    workers added in code go, as add_worker() documents."""
    path = tmp_path / "pool.yaml"
    with WorkerPool.from_yaml(
        path_with(path, workers_yaml(["a"])),
        watch=False,
        transport_factory=FakeNetwork(echo).factory,
    ) as pool:
        pool.add_worker(id="b", url="http://127.0.0.1:9702")
        pool.add_worker(id="c", url="http://127.0.0.1:9703")
        path.write_text(workers_yaml(["a"], extra="  retry: {max_retries: 1}\n"))
        result = pool.reload()
        assert result.removed == ("b", "c")
        assert pool.config.retry.max_retries == 1
        # The guard still holds for what the file itself named.
        path.write_text(workers_yaml(["a", "d", "e"], port0=9800))
        pool.reload()
        path.write_text(workers_yaml(["a"]))
        with pytest.raises(ConfigError, match="leaves 1 of the 3 enabled workers"):
            pool.reload()


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
