"""A task's cost with OpenTelemetry importable and with it absent, side by side.

    python benchmarks/otel_absent_cost.py [tree] [rounds]

``tracing.opentelemetry`` is off in both (the default): the promise measured is that a
pool pays nothing for the package being there, nor for it missing. Each round runs, in
a fresh interpreter each and alternating which goes first, the pool of
``benchmarks/task_cost.py`` (one worker on a transport that answers at once, best of 5
runs of 20,000 plain ``execute`` calls):

* ``importable``: the interpreter as it is (``opentelemetry-api`` and ``-sdk``
  installed: the run stops if they are not);
* ``absent``: the same interpreter with every ``opentelemetry`` module hidden before
  anything is imported: the import machinery's path finder is replaced by one that
  does not find them, so ``import opentelemetry`` raises ``ModuleNotFoundError`` and
  ``importlib.util.find_spec`` returns None, exactly as when the package is not
  installed, with every other package the same.

Each round also times, in a fresh interpreter per side, importing the package and
building a first pool: what the package being installed may cost once, before any task
(a pool imports pybreaker, which imports redis when it is installed; redis 7 imports
OpenTelemetry when that is installed).

Printed: each side's median over the rounds, absent/importable and every round, for a
task (µs) and for the first pool (ms), and whether each side imported OpenTelemetry at
all. ``tree`` defaults to this checkout.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import subprocess
import sys
import textwrap

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from task_cost import _CHILD  # the pool and the loop task_cost.py measures

_HIDE = textwrap.dedent(
    """
    import sys
    from importlib.machinery import PathFinder

    class _WithoutOpenTelemetry(PathFinder):
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name.partition(".")[0] == "opentelemetry":
                return None
            return super().find_spec(name, path, target)

    sys.meta_path[:] = [
        _WithoutOpenTelemetry if finder is PathFinder else finder for finder in sys.meta_path
    ]
    try:
        import opentelemetry
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit("opentelemetry is still importable")
    """
)

# Importing the package and building a first pool, in a fresh interpreter.
_FIRST_POOL = textwrap.dedent(
    """
    import json, sys, time
    started = time.perf_counter()
    sys.path.insert(0, sys.argv[1])
    from npu_sync import WorkerPool
    from npu_sync.config import HealthConfig, PoolConfig, worker_config

    config = PoolConfig(
        workers=(worker_config("w", "http://127.0.0.1:9"),), health=HealthConfig(enabled=False)
    )
    WorkerPool(config).close()
    print(json.dumps({"plain": (time.perf_counter() - started) * 1e3}))
    """
)

# After the run: whether the pool (or anything it imported) loaded OpenTelemetry.
_LOADED = textwrap.dedent(
    """
    print(json.dumps({"opentelemetry imported": sys.modules.get("opentelemetry") is not None}))
    """
)

# Last (looking a submodule up imports its package): the packages are there to find.
_PRESENT = textwrap.dedent(
    """
    import importlib.util
    for name in ("opentelemetry.trace", "opentelemetry.sdk.trace"):
        if importlib.util.find_spec(name) is None:
            raise SystemExit(f"{name} is not installed: nothing to compare")
    """
)


def _run(tree: str, side: str, child: str = _CHILD) -> tuple[float, bool]:
    code = (_HIDE + child + _LOADED) if side == "absent" else (child + _LOADED + _PRESENT)
    out = subprocess.run(
        [sys.executable, "-c", code, tree], check=True, capture_output=True, text=True
    ).stdout.splitlines()
    cost = json.loads(out[-2])["plain"]
    loaded = json.loads(out[-1])["opentelemetry imported"]
    return float(cost), bool(loaded)


def main(argv: list[str]) -> int:
    tree = argv[0] if argv else str(pathlib.Path(__file__).resolve().parent.parent)
    rounds = int(argv[1]) if len(argv) > 1 else 9
    costs: dict[str, list[float]] = {"importable": [], "absent": []}
    firsts: dict[str, list[float]] = {"importable": [], "absent": []}
    loaded: dict[str, bool] = {"importable": False, "absent": False}
    for i in range(rounds):
        order = ["importable", "absent"] if i % 2 == 0 else ["absent", "importable"]
        for side in order:
            cost, imported = _run(tree, side)
            costs[side].append(cost)
            loaded[side] |= imported
            first, imported = _run(tree, side, _FIRST_POOL)
            firsts[side].append(first)
            loaded[side] |= imported
    for title, unit, found in (
        ("pool.execute, tracing.opentelemetry off", "µs", costs),
        ("import npu_sync and build a first pool", "ms", firsts),
    ):
        present, absent = (statistics.median(found[s]) for s in ("importable", "absent"))
        print(
            f"{title}: importable {present:.1f} {unit}, absent {absent:.1f} {unit}, "
            f"absent/importable {absent / present:.3f}"
        )
        for side, values in found.items():
            best = min(values)
            print(f"  {side} rounds (best {best:.1f}): " + " ".join(f"{v:.1f}" for v in values))
    print(
        "opentelemetry imported (key off): "
        + ", ".join(f"{side} {'yes' if was else 'no'}" for side, was in loaded.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
