"""The reload guard: judged on the pool a reload leaves, settings from file, code or env."""

from __future__ import annotations

import dataclasses

import pytest

from npu_sync._guard import ENV_VARS, ReloadGuard
from npu_sync.config import PoolConfig, ReloadConfig, check_reload, parse_config, worker_config
from npu_sync.errors import ConfigError


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
