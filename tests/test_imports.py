"""The package's import graph: no cycles, and every import points the way the layers do."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import npu_sync

PACKAGE = pathlib.Path(npu_sync.__file__).parent


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
