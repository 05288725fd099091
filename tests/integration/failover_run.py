"""A failover of the shared-state primary under load from many processes, measured:
what the failover tests assert and ``benchmarks/failover.py`` reports.

Each process (``failover_client.py``) runs a pool with shared state on the topology's
primary, on real workers; every ``doom_every``-th task has a deadline its worker cannot
meet, so it fails into a dead letter whatever Redis does. The primary is failed over
(``SENTINEL FAILOVER``) or SIGKILLed while they run. Afterwards the dead letters are
listed, by a fresh process, and compared with the ids the TaskFailed exceptions named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from npu_sync.worker_server import LocalWorker
from tests.integration.redis_topology import Sentinel

CLIENT = os.path.join(os.path.dirname(__file__), "failover_client.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LIST = textwrap.dedent(
    """
    import json, sys
    from npu_sync import WorkerPool
    with WorkerPool.from_yaml(sys.argv[1], watch=False) as pool:
        print(json.dumps([r.id for r in pool.dead_letters.list()]))
    """
)


@dataclass
class Figures:
    """What one failover run did."""

    raised: int = 0  # dead letters TaskFailed named
    listed: int = 0  # of those, found by a listing afterwards
    lost: int = 0
    lost_ids: list[str] = field(default_factory=list)
    duplicated: int = 0  # ids listed more than once
    unnamed: int = 0  # TaskFailed with no dead-letter id at all
    succeeded: int = 0
    unexpected: list[str] = field(default_factory=list)
    flips: int = 0  # outages, all processes together
    resume: float | None = None  # seconds from the promotion to the last process's resume
    still_down: int = 0  # processes whose last word was "unavailable"


def yaml_for(workers: list[LocalWorker], url: str, namespace: str, timeout: float) -> str:
    lines = ["npu_workers:", "  workers:"]
    lines += [f"    - {{id: {w.worker_id}, url: '{w.url}', max_concurrent: 16}}" for w in workers]
    lines += [
        "  health: {enabled: false}",
        "  retry: {max_retries: 2, backoff_initial: 0.01, backoff_max: 0.02}",
        "  dead_letter: {backend: redis}",
        f"  shared_state: {{backend: redis, url: '{url}', namespace: {namespace}, "
        f"timeout: {timeout}, sync_interval: 0.5}}",
    ]
    return "\n".join(lines) + "\n"


def run(
    topology: Sentinel,
    workers: list[LocalWorker],
    directory: str,
    *,
    mode: str,
    processes: int = 8,
    threads: int = 2,
    doom_every: int = 4,
    before: float = 2.0,
    after: float = 4.0,
    url: str | None = None,
    code: str | None = None,
    timeout: float = 0.25,
) -> Figures:
    """Fail the primary over (``mode`` "failover" or "kill") under load; the figures.

    ``url`` is what the processes are given (the topology's Sentinel URL by default; a
    ``redis://`` URL of the primary is what a deployment could give before Sentinel
    was understood); ``code`` a checkout whose ``npu_sync`` they import instead.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (code, ROOT, env.get("PYTHONPATH")) if p)
    env["TMPDIR"] = directory  # every default spool of this run, and only this run's
    config = os.path.join(directory, "npu_workers.yaml")
    given = url or topology.url
    with open(config, "w", encoding="utf-8") as f:
        f.write(yaml_for(workers, given, "failover", timeout))
    log = open(os.path.join(directory, "clients.log"), "ab")  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [sys.executable, CLIENT, config, str(threads), str(doom_every)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=directory,  # not this checkout: `code`'s npu_sync must be the one imported
            stderr=log,
        )
        for _ in range(processes)
    ]
    figures = Figures()
    try:
        for p in procs:
            assert p.stdout is not None and p.stdin is not None
            line = p.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"a client did not start: {line!r}")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        threading.Event().wait(before)  # load before the failover: a duration, not a sync
        old = topology.primary_port()
        if mode == "failover":
            topology.failover()
        elif mode == "kill":
            topology.kill_primary()
        if mode == "none":
            new, promoted = old, time.time()
        else:
            new, promoted = topology.wait_promoted(old)
        threading.Event().wait(after)
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("stop\n")
            p.stdin.flush()
        results: list[dict[str, Any]] = []
        for p in procs:
            assert p.stdout is not None
            results.append(json.loads(p.stdout.readline()))
            p.wait(60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            for stream in (p.stdin, p.stdout):
                if stream is not None:
                    stream.close()
        log.close()
    # Listed by a fresh process: a `redis://` URL is pointed at the new primary, where a
    # deployment would look after the failover.
    if url is not None and url.startswith("redis://"):
        with open(config, "w", encoding="utf-8") as f:
            f.write(yaml_for(workers, f"redis://127.0.0.1:{new}/0", "failover", timeout))
    listing = subprocess.run(
        [sys.executable, "-c", LIST, config],
        env=env,
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if listing.returncode != 0:
        raise RuntimeError(f"listing the dead letters failed: {listing.stderr[-2000:]}")
    listed_ids: list[str] = json.loads(listing.stdout.strip().splitlines()[-1])
    raised = [i for r in results for i in r["doomed"]]
    figures.raised = len(raised)
    figures.listed = len(set(raised) & set(listed_ids))
    figures.lost_ids = sorted(set(raised) - set(listed_ids))
    figures.lost = len(figures.lost_ids)
    figures.duplicated = len(listed_ids) - len(set(listed_ids))
    figures.unnamed = sum(int(r["missing"]) for r in results)
    figures.succeeded = sum(int(r["succeeded"]) for r in results)
    figures.unexpected = [u for r in results for u in r["unexpected"]]
    figures.flips = sum(int(r["outages"] or 0) for r in results)
    resumes = []
    for r in results:
        seen = r["transitions"]
        if seen and seen[-1][0] == "down":
            figures.still_down += 1
        ups = [at for kind, at in seen if kind == "up" and at >= promoted - 5.0]
        if any(kind == "down" for kind, _ in seen):
            resumes.append(max(0.0, (ups[-1] if ups else time.time()) - promoted))
    figures.resume = max(resumes) if resumes else 0.0
    return figures
