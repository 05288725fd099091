"""The public surface is what the docs say: the documented modules and names, each
public module's ``__all__`` importable, every other module private (``_name``)."""

from __future__ import annotations

import importlib
import pathlib
import pkgutil

import pytest

import npu_sync

PUBLIC_MODULES = {
    "npu_sync",
    "npu_sync.auth",
    "npu_sync.cli",
    "npu_sync.config",
    "npu_sync.errors",
    "npu_sync.events",
    "npu_sync.flask",
    "npu_sync.prometheus",
    "npu_sync.protocols",
    "npu_sync.task",
    "npu_sync.testing",
    "npu_sync.trace",
    "npu_sync.transport",
    "npu_sync.worker_server",
}
"""The modules a user may import (docs/api.md lists what each offers)."""

DOCS = pathlib.Path(npu_sync.__file__).parent.parent / "docs"


def public_modules() -> set[str]:
    """Every module of the package whose dotted name has no part starting with ``_``."""
    found = {"npu_sync"}
    for info in pkgutil.walk_packages(npu_sync.__path__, "npu_sync."):
        if not any(part.startswith("_") for part in info.name.split(".")[1:]):
            found.add(info.name)
    return found


def test_only_the_documented_modules_look_public():
    """A module that is not part of the API is private: a new public one is a decision
    to write down here and in docs/api.md, not an accident."""
    assert public_modules() == PUBLIC_MODULES


@pytest.mark.parametrize("name", sorted(PUBLIC_MODULES - {"npu_sync.cli"}))
def test_each_public_module_says_what_it_exports_and_each_name_exists(name):
    """``__all__`` has no duplicate, and every name in it can be imported."""
    module = importlib.import_module(name)
    exported = list(module.__all__)
    assert len(set(exported)) == len(exported)
    for member in exported:
        assert getattr(module, member) is not None


def test_the_api_page_names_every_public_module():
    """docs/api.md speaks of each public module, so a user finds it."""
    text = (DOCS / "api.md").read_text()
    missing = [m for m in sorted(PUBLIC_MODULES - {"npu_sync"}) if f"`{m}`" not in text]
    assert missing == []


def test_the_docs_import_only_from_public_modules():
    """No example in the docs or the README imports a private module."""
    import re

    pattern = re.compile(r"(?:from|import) (npu_sync(?:\.\w+)+)")
    private = set()
    for path in [*DOCS.glob("*.md"), DOCS.parent / "README.md"]:
        for dotted in pattern.findall(path.read_text()):
            if any(part.startswith("_") for part in dotted.split(".")[1:]):
                private.add(f"{path.name}: {dotted}")
    assert private == set()


def test_the_api_page_names_every_name_the_package_exports():
    """Each name in ``npu_sync.__all__`` is on docs/api.md."""
    text = (DOCS / "api.md").read_text()
    assert [name for name in npu_sync.__all__ if f"`{name}`" not in text] == []
