"""The pool's own work per task, two trees side by side, and what tracing and classes cost.

    python benchmarks/task_cost.py <old tree> <new tree> [rounds]

Each round runs, in a fresh interpreter per tree (alternating which goes first), a
one-worker pool on a transport that answers at once (what is left is the pool's own
work) and reports the best of 5 runs of 20,000 tasks. Printed: each tree's median over
the rounds and the ratio new/old. Then, in the new tree only, calls interleaved in one
process: ``execute`` plain, with ``trace=Trace()``, a task naming a class, and a pool
with ``tracing.opentelemetry`` on, first with no tracer provider set (the API's no-op
spans), then, in another process, with the SDK's provider (spans recorded, exported
nowhere).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent(
    """
    import gc, json, sys, time
    sys.path.insert(0, sys.argv[1])
    from npu_sync import WorkerPool, Task
    from npu_sync.config import HealthConfig, PoolConfig, worker_config
    from npu_sync.transport import Response

    ANSWER = Response(200, {"content-type": "application/json"}, b'{"ok":true}')

    class Instant:
        cancellable = False
        def request(self, method, path, *, body=None, headers=None, timeout, **options):
            return ANSWER
        def close(self):
            pass

    config = PoolConfig(
        workers=(worker_config("w", "http://127.0.0.1:9", max_concurrent=8),),
        health=HealthConfig(enabled=False),
    )
    payload = {"model_id": "default", "input_text": "x"}
    extra = sys.argv[2] if len(sys.argv) > 2 else ""
    with WorkerPool(config, transport_factory=lambda *a, **k: Instant()) as pool:
        calls = {"plain": lambda: pool.execute(payload)}
        if extra == "extra":
            from npu_sync.trace import Trace
            calls["trace=Trace()"] = lambda: pool.execute(payload, trace=Trace())
            calls["priority='batch'"] = lambda: pool.execute(Task(payload, priority="batch"))
        if extra in ("extra", "sdk"):
            import dataclasses
            from npu_sync.config import TracingConfig
            if extra == "sdk":
                from opentelemetry import trace as otel_trace
                from opentelemetry.sdk.trace import TracerProvider
                otel_trace.set_tracer_provider(TracerProvider())
            traced = dataclasses.replace(config, tracing=TracingConfig(opentelemetry=True))
            otel_pool = WorkerPool(traced, transport_factory=lambda *a, **k: Instant())
            name = "tracing.opentelemetry, " + ("SDK" if extra == "sdk" else "no SDK")
            calls[name] = lambda: otel_pool.execute(payload)
        best = {}
        for name, call in calls.items():
            for _ in range(2000):
                call()
        for name in calls:
            best[name] = []
        for _ in range(5):
            for name, call in calls.items():
                gc.collect()
                t0 = time.perf_counter()
                for _ in range(20000):
                    call()
                best[name].append((time.perf_counter() - t0) / 20000 * 1e6)
    if extra in ("extra", "sdk"):
        otel_pool.close()
    print(json.dumps({name: min(v) for name, v in best.items()}))
    """
)


def _run(tree: str, extra: str = "") -> dict[str, float]:
    args = [sys.executable, "-c", _CHILD, tree] + ([extra] if extra else [])
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out))


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    old, new = argv[0], argv[1]
    rounds = int(argv[2]) if len(argv) > 2 else 5
    olds: list[float] = []
    news: list[float] = []
    for i in range(rounds):
        order = [(old, olds), (new, news)] if i % 2 == 0 else [(new, news), (old, olds)]
        for tree, into in order:
            into.append(_run(tree)["plain"])
    o, n = statistics.median(olds), statistics.median(news)
    print(f"pool.execute, instant transport: old {o:.1f} µs, new {n:.1f} µs, new/old {n / o:.3f}")
    print("  old rounds: " + " ".join(f"{v:.1f}" for v in olds))
    print("  new rounds: " + " ".join(f"{v:.1f}" for v in news))
    for mode in ("extra", "sdk"):
        _inside(new, mode)
    return 0


def _inside(new: str, mode: str) -> None:
    inside = [_run(new, mode) for _ in range(3)]
    for name in inside[0]:
        if mode == "sdk" and name == "plain":
            continue
        values = [r[name] for r in inside]
        base = [r["plain"] for r in inside]
        ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
        print(f"new tree, {name}: {statistics.median(values):.1f} µs ({ratio:.3f}x plain)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
