"""What ``import npu_sync`` costs, as a ratio to ``import requests``.

Each figure is one import timed inside a fresh interpreter (its start-up excluded),
the contenders interleaved run by run with a rotating order, so that the machine's
drift hits them alike. Several source trees can be compared side by side (say a
checkout of main and this tree)::

    python benchmarks/import_cost.py [--runs 41] [--each] [--no-bytecode] [/path/to/baseline] .

Each tree is a directory holding the ``npu_sync`` package. Per tree it times
``import npu_sync`` alone, and ``import npu_sync`` followed by building a
``WorkerPool`` on the default (built-in) client, one worker, health checks off (what
a script pays before its first task). With ``--each``, also ``import npu_sync`` plus
each library it imports only when needed, in the last tree: what importing it with
the package would add. With ``--no-bytecode``, each tree's package is copied without
its bytecode caches and run with ``PYTHONDONTWRITEBYTECODE=1``: compiled on every
import, as a source checkout run that way is (the installed libraries keep theirs).
Prints the medians, their ratio to ``import requests`` (the yardstick) and which of
the heavy libraries each step loaded. Not run by pytest: it measures, it asserts
nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HEAVY = ("requests", "urllib3", "pybreaker", "redis", "asyncio", "importlib.metadata")

# What --each adds to ``import npu_sync``, one at a time: the libraries it defers.
DEFERRED = (
    "yaml",
    "watchdog.observers",
    "tenacity",
    "pybreaker",
    "importlib.metadata",
    "urllib3",
    "requests",
)

TIMED = """
import sys, time, json
start = time.perf_counter()
{code}
elapsed = time.perf_counter() - start
print(json.dumps([elapsed, [m for m in {heavy!r} if m in sys.modules]]))
"""

REQUESTS = "import requests"
IMPORT = "import npu_sync"
POOL = """
import npu_sync
from npu_sync.config import HealthConfig, PoolConfig, worker_config
config = PoolConfig(
    workers=(worker_config("w", "http://127.0.0.1:9"),), health=HealthConfig(enabled=False)
)
pool = npu_sync.WorkerPool(config)
"""


def _run(tree: str, code: str, bytecode: bool) -> tuple[float, list[str]]:
    tree = os.path.abspath(tree)
    # Run in the tree: ``python -c`` puts the working directory first on sys.path, ahead
    # of PYTHONPATH, so from anywhere else another npu_sync could be the one imported.
    # With ``bytecode`` the caches are written and used, as for an installed package
    # (pip compiles it); without, the package's own modules are compiled every time.
    done = subprocess.run(
        [sys.executable, "-c", TIMED.format(code=code, heavy=HEAVY)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=tree, PYTHONDONTWRITEBYTECODE="" if bytecode else "1"),
        cwd=tree,
        check=True,
    )
    elapsed, loaded = json.loads(done.stdout)
    return float(elapsed), list(loaded)


def measure(trees: dict[str, str], runs: int, each: bool, bytecode: bool) -> None:
    """Time every contender ``runs`` times, interleaved, and print the medians.

    ``trees`` maps the name shown for each tree to the directory it is run from.
    """
    paths = list(trees.values())
    contenders = {"import requests": (paths[0], REQUESTS)}
    for label, tree in trees.items():
        contenders[f"{label[-30:]}: import npu_sync"] = (tree, IMPORT)
        contenders[f"{label[-30:]}: + WorkerPool(builtin)"] = (tree, POOL)
    if each:
        label, last = list(trees.items())[-1]
        for library in DEFERRED:
            contenders[f"{label[-30:]}: + import {library}"] = (last, f"{IMPORT}, {library}")
    names = list(contenders)
    samples: dict[str, list[float]] = {name: [] for name in names}
    loaded: dict[str, list[str]] = {}
    for name in names:  # warm the bytecode caches (and the disk cache) before timing
        loaded[name] = _run(*contenders[name], bytecode)[1]
    for i in range(runs):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(_run(*contenders[name], bytecode)[0])
    yardstick = statistics.median(samples["import requests"])
    width = max(len(name) for name in names)
    caches = "with bytecode caches" if bytecode else "npu_sync without bytecode caches"
    print(f"{runs} fresh interpreters each, interleaved, {caches}; medians")
    print(f"{'':{width}} {'median':>10} {'vs requests':>12}  loaded")
    for name in names:
        median = statistics.median(samples[name])
        print(
            f"{name:{width}} {median * 1000:7.1f} ms {median / yardstick:12.2f}  "
            f"{', '.join(loaded[name]) or '-'}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=41, help="fresh interpreters per figure")
    parser.add_argument(
        "--each", action="store_true", help="also time import npu_sync plus each deferred library"
    )
    parser.add_argument(
        "--no-bytecode", action="store_true", help="copies of the trees, compiled every time"
    )
    parser.add_argument("trees", nargs="*", default=["."], help="directories holding npu_sync")
    args = parser.parse_args(argv)
    if not args.no_bytecode:
        measure({tree: tree for tree in args.trees}, args.runs, args.each, bytecode=True)
        return
    with tempfile.TemporaryDirectory(prefix="npu-import-") as scratch:
        copies = {}
        for i, tree in enumerate(args.trees):
            copy = os.path.join(scratch, str(i))
            shutil.copytree(
                os.path.join(tree, "npu_sync"),
                os.path.join(copy, "npu_sync"),
                ignore=shutil.ignore_patterns("__pycache__"),
            )
            copies[tree] = copy
        measure(copies, args.runs, args.each, bytecode=False)


if __name__ == "__main__":
    main()
