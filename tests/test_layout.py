"""The package layout is the architecture: each third-party library has one home."""

from __future__ import annotations

import ast
import pathlib

import npu_sync

HOMES = {
    "yaml": {"_config_file"},  # the config's strict YAML loader
    "pybreaker": {"breaker"},
    "tenacity": {"retry"},
    "watchdog": {"reload"},
    "urllib3": {"transport"},
    "requests": {"transport"},
    "http": {"transport", "worker_server"},  # the reference worker is stdlib-only
    "prometheus_client": {"prometheus"},
    "redis": {"shared", "redis_client"},  # the state; building its client and durable write
    "flask": {"flask"},
    "werkzeug": {"flask"},
}


def test_each_third_party_library_is_imported_by_its_one_module():
    """yaml only in the config file reader, pybreaker only in breaker, and so on."""
    package = pathlib.Path(npu_sync.__file__).parent
    found: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        # A subpackage is one module of the architecture: transport/_base.py is "transport".
        home = path.relative_to(package).parts[0].removesuffix(".py")
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in HOMES:
                    found.setdefault(top, set()).add(home)
    for library, modules in found.items():
        assert modules <= HOMES[library], f"{library} imported by {sorted(modules)}"
