"""The reload guard: judged on the pool a reload leaves, settings from file, code or env."""

from __future__ import annotations

import dataclasses
import json

import pytest

from npu_sync import WorkerPool
from npu_sync._guard import ENV_VARS, ReloadGuard
from npu_sync.config import PoolConfig, ReloadConfig, check_reload, parse_config, worker_config
from npu_sync.errors import ConfigError
from npu_sync.testing import FakeNetwork
from tests.configkit import echo, path_with, workers_yaml


def pool(*ids: str, **reload: object) -> PoolConfig:
    return PoolConfig(
        workers=tuple(
            worker_config(wid, f"http://127.0.0.1:{9000 + n}") for n, wid in enumerate(ids)
        ),
        reload=ReloadConfig(**reload),  # type: ignore[arg-type]
    )


def test_replacing_the_only_worker_is_allowed() -> None:
    """w1 replaced by w4 leaves one enabled worker of one: no loss, no refusal."""
    ReloadGuard().check(pool("w1"), pool("w4"))
    ReloadGuard(max_removed_share=0).check(pool("w1"), pool("w4"))


def test_replacing_every_worker_is_allowed() -> None:
    """Four workers replaced by four others: the resulting pool is as large."""
    ReloadGuard(max_removed_share=0).check(pool("a", "b", "c", "d"), pool("e", "f", "g", "h"))


def test_a_file_cut_short_is_still_refused() -> None:
    """A prefix of the running workers (a file cut short) is a loss the share judges."""
    with pytest.raises(ConfigError, match=r"leaves 1 of the 4 enabled workers \(without b, c, d\)"):
        ReloadGuard().check(pool("a", "b", "c", "d"), pool("a"))
    ReloadGuard().check(pool("a", "b", "c", "d"), pool("a", "b"))  # half: allowed at 0.5
    with pytest.raises(ConfigError, match="leaves 3 of the 4"):
        ReloadGuard(max_removed_share=0).check(pool("a", "b", "c", "d"), pool("a", "b", "c"))


def test_replacing_some_and_dropping_more_counts_the_net_loss() -> None:
    """Two of four dropped and one added: three left of four, 25 %, within 0.5."""
    ReloadGuard().check(pool("a", "b", "c", "d"), pool("a", "b", "x"))
    with pytest.raises(ConfigError, match="leaves 1 of the 4"):
        ReloadGuard().check(pool("a", "b", "c", "d"), pool("x"))


def test_disabling_counts_like_removing() -> None:
    """A worker listed but disabled is not in the resulting pool's enabled workers."""
    new = pool("a", "b", "c", "d")
    disabled = dataclasses.replace(
        new,
        workers=(new.workers[0], *(dataclasses.replace(w, enabled=False) for w in new.workers[1:])),
    )
    with pytest.raises(ConfigError, match="leaves 1 of the 4"):
        ReloadGuard().check(new, disabled)


def test_no_enabled_worker_is_refused_unless_allowed() -> None:
    """An empty result is refused; allow_empty from the guard lets it through."""
    with pytest.raises(ConfigError, match="no enabled worker"):
        ReloadGuard().check(pool("a"), pool())
    ReloadGuard(allow_empty=True).check(pool("a"), pool())
    ReloadGuard().check(pool(), pool())  # nothing running to protect


def test_the_files_keys_win_over_the_pools_settings() -> None:
    """A key the new file gives wins for that reload; one it leaves out is the pool's."""
    strict = ReloadGuard(max_removed_share=0, handover_timeout=5)
    assert strict.under(ReloadConfig()) == strict
    loose = strict.under(ReloadConfig(max_removed_share=1))
    assert (loose.max_removed_share, loose.handover_timeout, loose.allow_empty) == (1, 5, False)
    check_reload(pool("a", "b"), pool("a", max_removed_share=1), strict)
    with pytest.raises(ConfigError):
        check_reload(pool("a", "b"), pool("a"), strict)


def test_the_guard_reads_the_environment() -> None:
    """NPU_SYNC_RELOAD_* set the pool's settings; unset or blank ones keep the defaults."""
    env = {
        ENV_VARS["allow_empty"]: "true",
        ENV_VARS["max_removed_share"]: "0.25",
        ENV_VARS["handover_timeout"]: " ",
    }
    assert ReloadGuard.from_env(env) == ReloadGuard(allow_empty=True, max_removed_share=0.25)
    assert ReloadGuard.from_env({}) == ReloadGuard()


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        ("NPU_SYNC_RELOAD_ALLOW_EMPTY", "maybe", "must be true or false, got 'maybe'"),
        ("NPU_SYNC_RELOAD_MAX_REMOVED_SHARE", "half", "must be a number, got 'half'"),
        ("NPU_SYNC_RELOAD_MAX_REMOVED_SHARE", "2", "must be >= 0 and <= 1, got 2.0"),
        ("NPU_SYNC_RELOAD_HANDOVER_TIMEOUT", "0", "must be > 0 and <= 86400, got 0.0"),
    ],
)
def test_a_bad_environment_value_names_the_variable(var: str, value: str, message: str) -> None:
    """The error names the variable and the value as written."""
    with pytest.raises(ConfigError) as info:
        ReloadGuard.from_env({var: value})
    assert info.value.errors == (f"{var}: {message}",)


def test_the_reload_section_may_leave_every_key_to_the_pool() -> None:
    """reload: keys default to null (the pool's); written ones are checked and kept."""
    data = {"npu_workers": {"workers": [], "reload": {"handover_timeout": 30}}}
    assert parse_config(data).reload == ReloadConfig(handover_timeout=30.0)
    bad = {"npu_workers": {"workers": [], "reload": {"handover_timeout": 0}}}
    with pytest.raises(ConfigError, match=r"reload\.handover_timeout: must be > 0 and <= 86400"):
        parse_config(bad)


# Attacks on what a reload of the file may do, with the files an operator (or a mistake)
# could really produce: countless errors, a broken file again after a good one, the old
# file's rules, reorderings, BOM and CRLF, tabs, workers added in code.


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
