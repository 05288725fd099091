"""Writing the key tables of docs/configuration.md from the config schema.

Kept apart from :mod:`npu_sync._schema`, which :mod:`npu_sync.config` imports: the tables
need the config classes, and the schema must not import the module that uses it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from npu_sync._schema import autobot_table, pool_table, worker_table
from npu_sync.config import PoolConfig, WorkerConfig


def _tables() -> dict[str, str]:
    return {
        "pool-keys": pool_table(PoolConfig),
        "worker-keys": worker_table(WorkerConfig),
        "autobot-keys": autobot_table(PoolConfig, WorkerConfig),
    }


def _markers(name: str) -> tuple[str, str]:
    return (
        f"<!-- generated: {name} (python tools/config_docs.py --write-docs) -->",
        f"<!-- end generated: {name} -->",
    )


def render_tables(text: str) -> str:
    """``text`` (docs/configuration.md) with every generated table rewritten.

    Raises:
        ValueError: a table's markers are missing.
    """
    for name, table in _tables().items():
        begin, end = _markers(name)
        start = text.find(begin)
        stop = text.find(end, start)
        if start < 0 or stop < 0:
            raise ValueError(f"markers for {name!r} not found: {begin} ... {end}")
        text = text[: start + len(begin)] + "\n" + table + "\n" + text[stop:]
    return text


def main(argv: list[str], docs: Path) -> int:
    """``--write-docs`` rewrites the tables of ``docs`` in place; ``--check`` says whether
    they are current (exit status 1 when not).
    """
    if argv not in (["--write-docs"], ["--check"]):
        print("usage: python tools/config_docs.py --write-docs | --check", file=sys.stderr)
        return 2
    current = docs.read_text(encoding="utf-8")
    wanted = render_tables(current)
    if argv == ["--check"]:
        if wanted != current:
            print(f"{docs} is out of date: run python tools/config_docs.py --write-docs")
            return 1
        return 0
    if wanted != current:
        docs.write_text(wanted, encoding="utf-8")
        print(f"rewrote the key tables of {docs}")
    return 0
