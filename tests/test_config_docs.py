"""The key tables of docs/configuration.md are generated from the config schema."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from npu_sync import _config_docs, _schema
from npu_sync.config import PoolConfig, WorkerConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "configuration.md"


def test_the_docs_tables_are_what_the_schema_generates() -> None:
    """docs/configuration.md holds exactly the tables the schema renders today."""
    text = DOCS.read_text(encoding="utf-8")
    assert _config_docs.render_tables(text) == text, (
        "docs/configuration.md disagrees with the config schema: "
        "run python tools/config_docs.py --write-docs"
    )


def test_a_changed_default_is_caught_as_drift() -> None:
    """Editing one default in the docs makes the rendered text differ, and render restores it."""
    text = DOCS.read_text(encoding="utf-8")
    row = "| `health.interval` | number (s) | `30.0` |"
    assert row in text
    drifted = text.replace(row, "| `health.interval` | number (s) | `15.0` |")
    assert _config_docs.render_tables(drifted) == text


def test_every_declared_key_has_a_row() -> None:
    """Each pool-level and per-worker key of the schema appears in its docs table."""
    text = DOCS.read_text(encoding="utf-8")
    for key in _schema.keys(PoolConfig):
        assert f"| `{key.path}` |" in text, key.path
    for key in _schema.keys(WorkerConfig):
        assert f"| `{key.path}` |" in text, key.path


def test_missing_markers_are_reported() -> None:
    """A docs file without a table's markers is an error naming the table."""
    with pytest.raises(ValueError, match="pool-keys"):
        _config_docs.render_tables("# Configuration\n\nno tables here\n")


def test_the_command_checks_and_rewrites(tmp_path: Path) -> None:
    """tools/config_docs.py --check fails on stale tables and --write-docs repairs them."""
    stale = tmp_path / "configuration.md"
    text = DOCS.read_text(encoding="utf-8")
    row = "| `health.interval` | number (s) | `30.0` |"
    stale.write_text(text.replace(row, row.replace("30.0", "15.0")), encoding="utf-8")
    assert _config_docs.main(["--check"], stale) == 1
    assert _config_docs.main(["--write-docs"], stale) == 0
    assert stale.read_text(encoding="utf-8") == text
    assert _config_docs.main(["--check"], stale) == 0
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "config_docs.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_config_field_is_declared_or_internal() -> None:
    """Each field of a config dataclass carries a schema spec, except bookkeeping ones."""
    internal = {("PoolConfig", "source"), ("PoolConfig", "layout"), ("PoolConfig", "warnings")}
    seen: set[type] = set()

    def walk(cls: type) -> None:
        if cls in seen:
            return
        seen.add(cls)
        for item in dataclasses.fields(cls):
            spec = item.metadata.get(_schema.SPEC)
            if spec is None:
                assert (cls.__name__, item.name) in internal, f"{cls.__name__}.{item.name}"
            elif spec.section is not None:
                walk(spec.section)

    walk(PoolConfig)
    walk(WorkerConfig)
