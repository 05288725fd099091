"""The package layout is the architecture: each third-party library has one home, and the
reference worker (the ``worker_server`` subpackage) stands apart from the library."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import npu_sync

HOMES = {
    "yaml": {"_config_file"},  # the config's strict YAML loader
    "pybreaker": {"_breaker"},
    "tenacity": {"_retry"},
    "watchdog": {"_reload"},
    "urllib3": {"transport"},
    "requests": {"transport"},
    # The reference worker, a subpackage, is stdlib-only: see WORKER_SERVER_MAY_IMPORT.
    "http": {"transport", "worker_server"},
    "prometheus_client": {"prometheus"},
    "redis": {"_shared", "_redis_client"},  # the state; building its client and durable write
    "flask": {"flask"},
    "werkzeug": {"flask"},
}

PACKAGE = pathlib.Path(npu_sync.__file__).parent
WORKER_SERVER = PACKAGE / "worker_server"

# What the reference worker may take from npu_sync: the HMAC check it shares with the
# pool's signing, and the injectable clock. Everything else it needs is the stdlib's.
WORKER_SERVER_MAY_IMPORT = {"npu_sync.auth", "npu_sync._clock"}


def imports(path: pathlib.Path) -> list[tuple[str, ast.stmt, bool]]:
    """Every module ``path`` imports by absolute name, with the statement and whether
    it is at the module's top level (relative imports are not used in the package)."""
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(node) for node in tree.body}
    found: list[tuple[str, ast.stmt, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}: relative import"
            assert node.module is not None
            found.append((node.module, node, id(node) in top_level))
    return found


def test_the_reference_worker_imports_only_the_stdlib_and_two_library_modules():
    """Each module of npu_sync/worker_server/ imports the standard library, its own
    subpackage, npu_sync.auth and npu_sync._clock, and nothing else."""
    paths = sorted(WORKER_SERVER.rglob("*.py"))
    assert len(paths) > 5  # the subpackage is there, split by concern
    wrong = []
    for path in paths:
        for name, _, _ in imports(path):
            top = name.split(".")[0]
            if top == "npu_sync":
                if name.startswith("npu_sync.worker_server") or name in WORKER_SERVER_MAY_IMPORT:
                    continue
            elif top in sys.stdlib_module_names or top == "__future__":
                continue
            wrong.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert wrong == []


def test_the_library_imports_the_reference_worker_only_lazily_from_the_cli():
    """No module of the library imports npu_sync.worker_server, but cli.py inside its
    functions (the ``worker`` command's flags, the demo's local workers)."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if WORKER_SERVER in path.parents:
            continue
        for name, node, top_level in imports(path):
            named = name == "npu_sync.worker_server" or name.startswith("npu_sync.worker_server.")
            if isinstance(node, ast.ImportFrom) and name == "npu_sync":
                named = any(alias.name == "worker_server" for alias in node.names)
            if not named:
                continue
            if path.name == "cli.py" and path.parent == PACKAGE and not top_level:
                continue  # inside a function: imported when the command runs
            wrong.append(f"{path.relative_to(PACKAGE)} line {node.lineno}")
    assert wrong == []


def test_a_pool_never_loads_the_reference_worker():
    """Importing npu_sync and running a pool leave npu_sync.worker_server unloaded (a
    fresh interpreter: this one has long imported it)."""
    script = (
        "import sys\n"
        "import npu_sync\n"
        "from npu_sync.config import HealthConfig, PoolConfig, worker_config\n"
        "from npu_sync.testing import FakeNetwork\n"
        "config = PoolConfig(workers=(worker_config('w', 'http://127.0.0.1:9'),),\n"
        "                    health=HealthConfig(enabled=False))\n"
        "with npu_sync.WorkerPool(config, transport_factory=FakeNetwork().factory) as pool:\n"
        "    pool.execute({'input_text': 'x'})\n"
        "print(sorted(m for m in sys.modules if m.startswith('npu_sync.worker_server')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=PACKAGE.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_each_third_party_library_is_imported_by_its_one_module():
    """yaml only in the config file reader, pybreaker only in breaker, and so on."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        # A subpackage is one module of the architecture: transport/_base.py is "transport",
        # worker_server/_handler.py is "worker_server".
        home = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
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
