"""Check that the hill climbing's phases behave as the class they replaced, call for call.

    python tools/limits_differential.py <tree with npu_sync/limits.py> [runs] [answers]

Loads ``HillClimbingLimit`` from the old tree's ``npu_sync/limits.py`` (a module of the
standard library alone) and the current one from ``npu_sync._balancing.limits``, and
feeds both the same random runs: random ceilings, starts, round sizes and hold periods;
a simulated worker with random slots and task-time noise that change during the run;
drops, ceiling changes, resets and meaningless samples. After every call the current
value, the knee and ``stats()`` (less the new ``algorithm`` key) must be equal. Prints
the count of runs by the mode they ended in; exits 1 at the first difference.
"""

from __future__ import annotations

import collections
import heapq
import importlib.util
import pathlib
import random
import sys
from typing import Any

from npu_sync._balancing.limits import HillClimbingLimit


def _old_class(tree: str) -> Any:
    path = pathlib.Path(tree) / "npu_sync" / "limits.py"
    spec = importlib.util.spec_from_file_location("old_limits", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"no {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HillClimbingLimit


def _same(old: Any, new: HillClimbingLimit, where: tuple[Any, ...]) -> None:
    a, b = old.stats(), new.stats()
    b.pop("algorithm")
    if a != b or old.current != new.current or old.limit != new.limit:
        raise SystemExit(f"differ at {where}: old {a}, new {b}")


def _run(cls: Any, seed: int, answers: int) -> str:
    rng = random.Random(seed)
    kw = {
        "initial": rng.choice([1, 4, 8, 30]),
        "min_round": rng.choice([1, 4, 16]),
        "hold_rounds": rng.choice([1, 2, 4]),
    }
    ceiling = rng.choice([1, 2, 3, 4, 5, 8, 16, 64])
    old, new = cls(ceiling, **kw), HillClimbingLimit(ceiling, **kw)
    sigma = rng.choice([0.0, 0.05, 0.15, 0.3])
    p_drop = rng.choice([0.0, 0.001, 0.004, 0.02])
    now = 0.0
    free_at = [0.0] * rng.choice([1, 2, 3, 8, 16, 32])
    in_flight: list[tuple[float, float, int]] = []
    for i in range(answers):
        while len(in_flight) < old.current:
            slot = min(range(len(free_at)), key=free_at.__getitem__)
            free_at[slot] = max(now, free_at[slot]) + 0.02 * rng.lognormvariate(0, sigma)
            heapq.heappush(in_flight, (free_at[slot], now, len(in_flight) + 1))
        ends, started, level = heapq.heappop(in_flight)
        now = ends
        roll = rng.random()
        if roll < p_drop:
            args: tuple[float, int, bool] = (ends - started, level, True)
        elif roll < p_drop + 0.002:
            ceiling = rng.choice([1, 2, 3, 5, 8, 16, 64])
            old.set_ceiling(ceiling)
            new.set_ceiling(ceiling)
            _same(old, new, (seed, i, "set_ceiling"))
            continue
        elif roll < p_drop + 0.0025:
            old.reset()
            new.reset()
            _same(old, new, (seed, i, "reset"))
            continue
        elif roll < p_drop + 0.004:
            wanted = rng.choice([1, 2, 3, 8, 16, 32])
            free_at = sorted(free_at)[:wanted] + [now] * max(0, wanted - len(free_at))
            continue
        elif roll < p_drop + 0.005:
            odd = rng.choice([0.0, -1.0, float("nan"), float("inf")])
            args = (odd, level, False)
        else:
            args = (ends - started, level, False)
        if old.on_sample(*args) != new.on_sample(*args):
            raise SystemExit(f"on_sample returned differently at {(seed, i)}")
        _same(old, new, (seed, i))
    return str(new.stats()["mode"])


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    cls = _old_class(argv[0])
    runs = int(argv[1]) if len(argv) > 1 else 100
    answers = int(argv[2]) if len(argv) > 2 else 5000
    ended = collections.Counter(_run(cls, seed, answers) for seed in range(runs))
    print(f"{runs} runs of {answers} answers: the same after every call; ended in {dict(ended)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
