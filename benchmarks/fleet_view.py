"""What the fleet view costs, and whether writing snapshots trips the shared state.

Runs each source tree given on the command line side by side, interleaved, against one
real ``redis-server`` on loopback, so that two versions (a checkout of main and this
tree) are measured in the same conditions::

    python benchmarks/fleet_view.py /path/to/baseline .

Each tree is a directory holding the ``npu_sync`` package; each child process runs
in its tree's directory, so that it imports that tree's package. Three measurements:

1. **One fleet read at 64 x 20**: 64 processes' snapshots (20 workers each, 120 points
   of history, on 8 hosts) are in Redis; a pool of 20 workers reads the fleet
   (``stats(scope="fleet")``). CPU of one read (median, a fresh read each time), CPU
   per request when 100 requests come in one interval (status pages, ``GET fleet``),
   and the peak Python memory of one read (``tracemalloc``).
2. **The same with 50 oversized members** (2 MiB each, as a hostile or broken
   process could write): the same figures, and whether the reader still shares its
   breakers afterwards (its shared state ``available``, its ``outages``).
3. **Outages at 64 processes writing snapshots**: 64 processes, each a pool of 20
   workers with ``shared_state.timeout`` 0.05 s and a snapshot every second, run for
   ``SECONDS``; the outages they counted in all, per round.

Not run by pytest: it measures, it asserts nothing. Needs ``redis-server`` on the PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

NAMESPACE = "bench-fleet"
PROCESSES = 64
WORKERS = 20
POINTS = 120
HOSTS = 8
OVERSIZED = 50
SECONDS = float(os.environ.get("FLEET_BENCH_SECONDS", "20"))
ROUNDS = int(os.environ.get("FLEET_BENCH_ROUNDS", "2"))
READS = os.environ.get("FLEET_BENCH_READS", "1") != "0"  # 0: the outage rounds only

READER = r"""
import json, os, sys, time, tracemalloc
from npu_sync import WorkerPool
from npu_sync.config import HealthConfig, PoolConfig, SharedStateConfig, worker_config
from npu_sync._fleet import monitor_of
from npu_sync.testing import FakeNetwork, json_response

url, workers = sys.argv[1], int(sys.argv[2])
net = FakeNetwork(lambda req: json_response(200, {"ok": True}))
config = PoolConfig(
    workers=tuple(
        worker_config(f"npu-{n:02d}", f"http://127.0.0.1:{9000 + n}") for n in range(workers)
    ),
    health=HealthConfig(enabled=False),
    shared_state=SharedStateConfig(backend="redis", url=url, namespace=os.environ["NS"]),
)
with WorkerPool(config, transport_factory=net.factory) as pool:
    for _ in range(20):
        pool.execute({})
    monitor = monitor_of(pool)
    monitor.tick()
    cached = hasattr(monitor, "_view")

    def cold():
        if cached:
            monitor._view.clear()  # a fresh read, as when the interval has passed
        start = time.process_time()
        view = pool.stats(scope="fleet")
        return time.process_time() - start, view

    cold()  # warm imports and connections
    cpu = sorted(cold()[0] for _ in range(5))
    view = cold()[1]
    if cached:
        monitor._view.clear()
    start = time.process_time()
    for _ in range(100):  # 100 requests within one interval
        pool.stats(scope="fleet")
    per_request = (time.process_time() - start) / 100
    if cached:
        monitor._view.clear()
    tracemalloc.start()
    traced = pool.stats(scope="fleet")
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    traced_processes = traced["totals"]["processes"]
    del traced
    shared = pool.stats()["shared_state"]
    print(json.dumps({
        "cpu_ms": cpu[len(cpu) // 2] * 1000,
        "per_request_ms": per_request * 1000,
        "peak_mb": peak / 1e6,
        "kept_mb": kept / 1e6,
        "traced_processes": traced_processes,
        "processes": view["totals"]["processes"],
        "available": shared["available"],
        "outages": shared["outages"],
        "last_error": shared["last_error"],
        "note": view["note"][:160],
    }))
"""

WRITER = r"""
import json, os, sys, time
from npu_sync import WorkerPool
from npu_sync.config import HealthConfig, PoolConfig, SharedStateConfig, worker_config
from npu_sync.testing import FakeNetwork, json_response

url, workers = sys.argv[1], int(sys.argv[2])
start_at, seconds = float(sys.argv[3]), float(sys.argv[4])
net = FakeNetwork(lambda req: json_response(200, {"ok": True}))
config = PoolConfig(
    workers=tuple(
        worker_config(f"npu-{n:02d}", f"http://127.0.0.1:{9000 + n}") for n in range(workers)
    ),
    health=HealthConfig(enabled=False),
    shared_state=SharedStateConfig(backend="redis", url=url, namespace=os.environ["NS"]),
)
# Which path marked Redis unavailable, each time it did: a snapshot, the sync thread…
import npu_sync._shared as shared_module
causes = {}
PATHS = ("publish_snapshot", "withdraw_snapshot", "read_snapshots", "report_failure",
         "report_success", "announce", "counts", "_run", "start")
original = shared_module.SharedState.lost
def lost(self, error):
    if self.available:
        frame, names = sys._getframe(1), []
        while frame is not None and len(names) < 8:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        cause = next((n for n in names if n in PATHS), names[0] if names else "?")
        causes[cause] = causes.get(cause, 0) + 1
    return original(self, error)
shared_module.SharedState.lost = lost
time.sleep(max(0.0, start_at - time.time()))
with WorkerPool(config, transport_factory=net.factory) as pool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pool.execute({})
        time.sleep(0.05)
    shared = pool.stats()["shared_state"]
print(json.dumps({"outages": shared["outages"], "causes": causes,
                  "snapshot_failures": shared.get("fleet_snapshots", {}).get("write_failed")}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(directory: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
         "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", directory],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.ping()
            break
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    client.close()
    return proc, port


def snapshot(n: int, now: float) -> dict[str, object]:
    """Process ``n``'s snapshot, as a pool of 20 busy workers publishes it."""
    host = f"host-{n % HOSTS}"
    step = 5.0
    end_at = (now // step) * step
    rows = []
    series = []
    for w in range(WORKERS):
        rows.append({
            "id": f"npu-{w:02d}", "breaker": "closed", "healthy": True, "in_flight": w % 3,
            "capacity": 8, "attempts": 10_000 + w, "succeeded": 9_900 + w, "failed": 100,
            "rejected": 0, "not_here": 0, "abandoned": 0, "trips": 1,
            "p50_ms": 12.5, "p95_ms": 40.25, "p99_ms": 88.75,
        })  # fmt: skip
        series.append(
            {
                "id": f"npu-{w:02d}",
                "succeeded": [50 + (i + w) % 7 for i in range(POINTS)],
                "failed": [(i * w) % 3 for i in range(POINTS)],
                "p99_ms": [80.5 + (i % 11) for i in range(POINTS)],
                "breaker": "c" * POINTS,
            }
        )
    tasks = dict.fromkeys(("submitted", "succeeded", "rejected", "failed", "fallbacks",
                           "retries", "active", "in_flight", "waiting"), 1000)  # fmt: skip
    return {
        "v": 1,
        "process": {
            "id": f"{host}:{1000 + n}:ab{n:02x}",
            "pid": 1000 + n,
            "host": host,
            "started_at": now - 3600,
        },
        "published_at": now,
        "uptime_s": 3600.0,
        "tasks": tasks,
        "workers": rows,
        "history": {
            "step_s": step,
            "points": POINTS,
            "end_at": end_at,
            "tasks": {"succeeded": [900] * POINTS, "failed": [3] * POINTS},
            "workers": series,
        },
    }


def populate(port: int, *, oversized: int) -> int:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    client.flushall()
    now = time.time()
    pipe = client.pipeline(transaction=False)
    size = 0
    for n in range(PROCESSES):
        snap = snapshot(n, now)
        text = json.dumps(snap, separators=(",", ":"))
        size = len(text)
        member = snap["process"]["id"]  # type: ignore[index]
        pipe.set(f"{NAMESPACE}:fleet:process:{member}", text, ex=3600)
        pipe.zadd(f"{NAMESPACE}:fleet:index", {member: now})
    pad = "x" * (2 * 1024 * 1024)
    for n in range(oversized):
        member = f"big:{5000 + n}:ff"
        pipe.set(f"{NAMESPACE}:fleet:process:{member}", '{"v":1,"pad":"' + pad + '"}', ex=3600)
        pipe.zadd(f"{NAMESPACE}:fleet:index", {member: now})
    pipe.execute()
    client.close()
    return size


def run(tree: str, code: str, *args: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "NS": NAMESPACE,
           "NPU_SYNC_FLEET": "manual"}  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env, cwd=os.path.abspath(tree), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"{tree}: {out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def outages(tree: str, port: int) -> tuple[int, int, dict[str, int]]:
    """64 writer processes for SECONDS: the outages (and the path that marked each: a
    snapshot write, ``_run`` the sync thread, …) and failed snapshot writes counted."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "NS": NAMESPACE,
           "NPU_SYNC_FLEET": "on", "NPU_SYNC_FLEET_INTERVAL": "1"}  # fmt: skip
    start_at = time.time() + 25  # every process imported and waiting by then
    url = f"redis://127.0.0.1:{port}/0"
    command = [sys.executable, "-c", WRITER, url, str(WORKERS), repr(start_at), repr(SECONDS)]
    procs = [
        subprocess.Popen(
            command,
            env=env,
            cwd=os.path.abspath(tree),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(PROCESSES)
    ]
    total = failed = 0
    causes: dict[str, int] = {}
    for p in procs:
        out, err = p.communicate(timeout=600)
        if p.returncode:
            raise RuntimeError(err[-2000:])
        data = json.loads(out.strip().splitlines()[-1])
        total += int(data["outages"])
        failed += int(data["snapshot_failures"] or 0)
        for cause, count in data["causes"].items():
            causes[cause] = causes.get(cause, 0) + int(count)
    return total, failed, causes


def _sharing(result: dict[str, object]) -> bool:
    return bool(result["available"]) and not result["outages"]


def main(trees: list[str]) -> None:
    with tempfile.TemporaryDirectory() as directory:
        proc, port = start_redis(directory)
        url = f"redis://127.0.0.1:{port}/0"
        try:
            cases = (("64 x 20", 0), (f"64 x 20 + {OVERSIZED} of 2 MiB", OVERSIZED))
            for label, oversized in cases if READS else ():
                size = populate(port, oversized=oversized)
                print(f"\n## one fleet read, {label} (snapshots of {size / 1024:.0f} KiB)")
                results: dict[str, list[dict[str, object]]] = {t: [] for t in trees}
                for _ in range(3):  # interleaved
                    for tree in trees:
                        populate(port, oversized=oversized)  # fresh: none aged out of the index
                        results[tree].append(run(tree, READER, url, str(WORKERS)))
                for tree in trees:
                    runs = "; ".join(
                        f"{float(r['cpu_ms']):.0f} ms CPU, {float(r['per_request_ms']):.2f} ms "  # type: ignore[arg-type]
                        f"per request, peak {float(r['peak_mb']):.1f} MB "  # type: ignore[arg-type]
                        f"(kept {float(r['kept_mb']):.1f} MB, {r['traced_processes']} read), "  # type: ignore[arg-type]
                        f"{r['processes']} shown, {'sharing' if _sharing(r) else 'NOT SHARING'}"
                        for r in results[tree]
                    )
                    print(f"{tree}: {runs}")
                    errors = {str(r["last_error"]) for r in results[tree] if r["last_error"]}
                    if errors:
                        print(f"    shared state errors: {sorted(errors)}")
                    print(f"    note: {results[tree][-1]['note']}")
            print(f"\n## outages, {PROCESSES} processes writing snapshots every 1 s, {SECONDS:g} s")
            for n in range(ROUNDS):
                for tree in trees:
                    populate(port, oversized=0)
                    total, failed, causes = outages(tree, port)
                    by = ", ".join(f"{k} {v}" for k, v in sorted(causes.items())) or "none"
                    print(
                        f"round {n + 1} {tree}: {total} outages (by path: {by}), "
                        f"{failed} failed snapshot writes counted"
                    )
        finally:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
