"""What a pool holds while workers come and go, and what a large fleet costs to start,
check and close: two source trees side by side.

    python benchmarks/bounded_resources.py /path/to/baseline .

Each tree is a directory holding the ``npu_sync`` package; each scenario runs in a
fresh interpreter with that tree first on ``sys.path`` and the soft open-file limit
at the default 1,024, against one worker process on many loopback ports
(``tests/idle_worker.py``). Three scenarios:

``failover``
    44 workers in 44 priority tiers, each serving 100 tasks and then answering 503, so
    that 32 callers fail over from worker to worker; the worker closes idle
    connections after 1 s (as uvicorn does after 5). Samples the process's
    descriptors every 0.25 s during the load and for 3 s after it.

``callers``
    10,000 workers, health checks on, 256 threads each running 20 tasks: descriptors
    at their peak and tasks or checks failed with ``EMFILE``.

``fleet``
    1,000 and 10,000 workers (on 50 ports): the time to build and start the pool, a
    health round (``check_health()``, health thread off), and ``close()`` right after
    start, while the thread's first round runs.

Prints a table per scenario. Not run by pytest: it measures, it asserts nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
IDLE_WORKER = os.path.join(HERE, os.pardir, "tests", "idle_worker.py")

COMMON = """
import json, os, resource, subprocess, sys, threading, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
from npu_sync import WorkerPool
from npu_sync.config import (BreakerConfig, HealthConfig, PoolConfig, PoolSettings,
    RetryConfig, TimeoutConfig, TransportConfig, worker_config)
from npu_sync.errors import NpuSyncError

def serve(*args):
    proc = subprocess.Popen([sys.executable, sys.argv[1], *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    return proc, json.loads(proc.stdout.readline())["ports"]

def fds():
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # EMFILE: every descriptor is taken
        return soft_limit
soft_limit = 1024
"""

FAILOVER = COMMON + textwrap.dedent(
    """
    proc, ports = serve("--ports", "44", "--idle-close", "1", "--good", "100")
    workers = tuple(
        worker_config(f"w{i}", f"http://127.0.0.1:{p}", priority=i + 1, max_concurrent=32)
        for i, p in enumerate(ports)
    )
    config = PoolConfig(
        workers=workers,
        health=HealthConfig(interval=1, timeout=2),
        circuit_breaker=BreakerConfig(fail_max=1, reset_timeout=3600),
        retry=RetryConfig(max_retries=3, backoff_initial=0.001, backoff_max=0.002),
        timeouts=TimeoutConfig(task=20),
        pool=PoolSettings(threads=32),
    )
    samples = []
    done = threading.Event()
    def sample():
        start = time.monotonic()
        while not done.wait(0.25):
            samples.append((round(time.monotonic() - start, 2), fds()))
    base = fds()
    out = {"start": base}
    try:
        pool = WorkerPool(config)
    except NpuSyncError as exc:
        out["error"] = str(exc)
    else:
        sampler = threading.Thread(target=sample); sampler.start()
        ok = failed = emfile = 0
        futures = [pool.submit({"input_text": str(i)}) for i in range(44 * 100)]
        for f in futures:
            try:
                f.result(60); ok += 1
            except Exception as exc:
                failed += 1
                emfile += "open files" in repr(exc) or "Too many" in repr(exc)
        out["load_end"] = fds()
        threading.Event().wait(3.0)  # the idle phase: what is held while nothing runs
        out["after_3s_idle"] = fds()
        done.set(); sampler.join()
        out.update(ok=ok, failed=failed, emfile=emfile, peak=max(n for _, n in samples))
        # One sample a second: the descriptors over time.
        out["per_second"] = [n for _, n in samples[3::4]]
        pool.close()
    proc.stdin.close(); proc.kill(); proc.wait()
    print(json.dumps(out))
    """
)

FLEET = COMMON + textwrap.dedent(
    """
    n = int(sys.argv[2])
    proc, ports = serve("--ports", "50", "--idle-close", "60")
    workers = tuple(
        worker_config(f"w{i}", f"http://127.0.0.1:{ports[i % 50]}") for i in range(n)
    )
    out = {"workers": n}
    def timed(fn):
        t = time.perf_counter(); r = fn(); return time.perf_counter() - t, r
    try:
        out["start_s"], pool = timed(lambda: WorkerPool(PoolConfig(
            workers=workers, health=HealthConfig(interval=30, timeout=2))))
    except NpuSyncError as exc:
        out["error"] = str(exc)
    else:
        threading.Event().wait(0.5)  # the first round under way, as in production
        out["close_s"], _ = timed(pool.close)
        quiet = WorkerPool(PoolConfig(workers=workers, health=HealthConfig(enabled=False)))
        out["round_s"], results = timed(quiet.check_health)
        out["round_failed"] = sum(not r["ok"] for r in results.values())
        out["round_emfile"] = sum("open files" in (r["error"] or "") for r in results.values())
        quiet.close()
    proc.stdin.close(); proc.kill(); proc.wait()
    print(json.dumps(out))
    """
)

CALLERS = COMMON + textwrap.dedent(
    """
    proc, ports = serve("--ports", "50", "--idle-close", "60")
    workers = tuple(
        worker_config(f"w{i}", f"http://127.0.0.1:{ports[i % 50]}") for i in range(10000)
    )
    out = {"start": fds()}
    peak = [0]
    done = threading.Event()
    def sample():
        while not done.wait(0.05):
            peak[0] = max(peak[0], fds())
    try:
        pool = WorkerPool(PoolConfig(workers=workers, health=HealthConfig(interval=30)))
    except NpuSyncError as exc:
        out["error"] = str(exc)
    else:
        sampler = threading.Thread(target=sample); sampler.start()
        failed, emfile = [0], [0]
        def caller(n):
            for i in range(20):
                try:
                    pool.execute({"input_text": f"{n}-{i}"})
                except Exception as exc:
                    failed[0] += 1
                    emfile[0] += "open files" in repr(exc)
        callers = [threading.Thread(target=caller, args=(n,)) for n in range(256)]
        for t in callers: t.start()
        for t in callers: t.join()
        done.set(); sampler.join()
        health = pool.check_health()
        out.update(tasks=256 * 20, failed=failed[0], emfile=emfile[0], peak_fds=peak[0],
                   health_emfile=sum("open files" in (r["error"] or "") for r in health.values()))
        pool.close()
    proc.stdin.close(); proc.kill(); proc.wait()
    print(json.dumps(out))
    """
)


def run(tree: str, code: str, *args: str) -> dict[str, object]:
    tree = os.path.abspath(tree)
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "NPU_SYNC_FLEET": "off"}
    # Run from the tree itself: ``python -c`` puts the working directory first on
    # sys.path, ahead of PYTHONPATH and of any installed copy.
    code = f"import npu_sync; assert npu_sync.__file__.startswith({tree!r})\n" + code
    done = subprocess.run(
        [sys.executable, "-c", code, os.path.abspath(IDLE_WORKER), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tree,
        timeout=900,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"exit": done.returncode, "stderr": done.stderr[-300:]}
    result: dict[str, object] = json.loads(lines[-1])
    return result


def main(trees: list[str]) -> None:
    print("failover: 44 workers failing over, 32 callers, idle connections closed after 1 s")
    for tree in trees:
        print(f"  {tree}: {run(tree, FAILOVER)}")
    print("callers: 256 threads, 20 tasks each, over 10,000 workers, health on")
    for tree in trees:
        print(f"  {tree}: {run(tree, CALLERS)}")
    for n in ("1000", "10000"):
        print(f"fleet of {n} workers")
        for tree in trees:
            print(f"  {tree}: {run(tree, FLEET, n)}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["."])
