"""docs/architecture.md matches the package: imports point the way its layers say, no
module imports one that imports it, and the life of one task names functions that exist."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re
import subprocess
import sys

import pytest

import npu_sync

PACKAGE = pathlib.Path(npu_sync.__file__).parent
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def modules() -> dict[str, pathlib.Path]:
    """Every module of the package by dotted name (``npu_sync.transport._base``)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts).removesuffix(".__init__")
        found[name] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Who imports whom inside the package: every import statement counts, at the top,
    under ``TYPE_CHECKING`` or inside a function, since each is a dependency a reader
    must follow (and a typing-only cycle is still a cycle between two modules)."""
    known = modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # "from npu_sync.transport import _http11" imports a submodule.
                targets = [
                    f"{node.module}.{alias.name}"
                    if f"{node.module}.{alias.name}" in known
                    else node.module
                    for alias in node.names
                ]
            graph[name].update(t for t in targets if t in known and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle():
    """The checker itself reports a two-module cycle and passes a chain."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle_among_the_package_modules():
    """No npu_sync module imports, directly or through others, one that imports it."""
    assert cycles(import_graph()) == []


def test_errors_and_task_import_each_other_no_more():
    """errors.py names Attempt without importing task.py, which imports errors.py."""
    graph = import_graph()
    assert "npu_sync.task" not in graph["npu_sync.errors"]
    assert "npu_sync.errors" in graph["npu_sync.task"]


@pytest.mark.slow
def test_every_module_imports_in_a_fresh_interpreter():
    """Each module imports first thing in a new process: no import order is needed."""
    names = sorted(n for n in modules() if not n.endswith("__main__"))  # that one runs the CLI
    script = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    for loaded in [m for m in sys.modules if m.startswith('npu_sync')]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module(name)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, *names],
        cwd=PACKAGE.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def section(title: str) -> str:
    """The text of one ``## title`` section of docs/architecture.md."""
    text = ARCHITECTURE.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def layers() -> tuple[dict[str, int], set[int]]:
    """From the docs' table: each module's layer, and the layers whose modules may
    import each other."""
    placed: dict[str, int] = {}
    mutual: set[int] = set()
    for line in section("Who may import whom").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0][:1].isdigit():
            continue
        layer = int(cells[0].split()[0])
        for name in re.findall(r"`([\w.]+)`", cells[1]):
            assert name not in placed, f"{name} is in two layers"
            placed[name] = layer
        if cells[2] == "may import each other":
            mutual.add(layer)
    return placed, mutual


def unit(module: str) -> str:
    """The architecture's name for a module: a subpackage counts as one
    (``npu_sync.transport._base`` is ``transport``), the package itself as ``npu_sync``."""
    if module == "npu_sync":
        return module
    return module.split(".")[1]


def test_every_module_has_a_layer_in_the_docs():
    """Each module of the package appears in the layer table, and the table names no
    module that does not exist."""
    placed, _ = layers()
    units = {unit(name) for name in modules()}
    assert units - set(placed) == set(), "give these modules a row in docs/architecture.md"
    assert set(placed) - units == set()


def test_imports_point_down_the_layers():
    """No module imports one of a higher layer, nor of its own where the docs say the
    layer's modules are independent."""
    placed, mutual = layers()
    wrong = []
    for importer, imported in sorted(import_graph().items()):
        for target in sorted(imported):
            a, b = unit(importer), unit(target)
            if a == b:
                continue  # inside the transport subpackage
            if placed[b] > placed[a] or (placed[b] == placed[a] and placed[a] not in mutual):
                wrong.append(f"{importer} imports {target}")
    assert wrong == []


def test_the_layer_check_catches_an_upward_import(monkeypatch):
    """An import from the task's life up into the pool would be reported."""
    graph = import_graph()
    graph["npu_sync._life.runner"] = {*graph["npu_sync._life.runner"], "npu_sync._pool"}
    monkeypatch.setattr(sys.modules[__name__], "import_graph", lambda: graph)
    upward = re.escape("npu_sync._life.runner imports npu_sync._pool")
    with pytest.raises(AssertionError, match=upward):
        test_imports_point_down_the_layers()


def test_the_life_of_one_task_names_functions_that_exist():
    """Every ``name()`` the docs' life of one task cites is a function of the package:
    ``Class.method()`` or ``module.function()``."""
    classes = {
        name: obj
        for module in modules()
        if not module.endswith("__main__")
        for name, obj in vars(importlib.import_module(module)).items()
        if inspect.isclass(obj) and obj.__module__.startswith("npu_sync")
    }
    cited = re.findall(r"`([A-Za-z_][\w.]*)\(\)`", section("The life of one task"))
    assert len(cited) > 20  # the section does name its steps
    missing = []
    for name in cited:
        owner, _, attribute = name.rpartition(".")
        if owner in classes:
            found = hasattr(classes[owner], attribute)
        else:
            found = False
            # A module is cited by its concept: ``outage.held_until()`` is in _outage.py.
            for dotted in (f"npu_sync.{owner}", f"npu_sync._{owner}"):
                try:
                    found = hasattr(importlib.import_module(dotted), attribute)
                except ImportError:
                    continue
                break
        if not found:
            missing.append(name)
    assert missing == []
