"""pool.execute against a bare call with the same HTTP client, side by side.

The bare call sends the same request as the pool (same body, same headers), so the
difference is the pool's own work in the client. Calls are interleaved one by one
(bare, pool, requests, bare, pool, …) so that machine noise hits every contender
alike; the figure that matters is the ratio of medians, printed and stored in
the benchmark's extra_info.
"""

from __future__ import annotations

import json
import statistics
import time

import requests
import urllib3

from benchmarks.conftest import report
from npu_sync import WorkerPool
from npu_sync.config import HealthConfig, PoolConfig, worker_config

PAYLOAD = {"model_id": "default", "input_text": "benchmark", "max_tokens": 16}
ROUNDS = 3000


def _bare_urllib3(url: str):
    host, port = url.removeprefix("http://").split(":")
    http = urllib3.HTTPConnectionPool(host, int(port), maxsize=4, retries=False)
    # The same request the pool sends (its headers cost the worker time to parse),
    # so that the difference is what the pool adds in the client.
    headers = {
        "User-Agent": "npu-sync",
        "Content-Type": "application/json",
        "X-NPU-Task-Id": "0" * 32,
        "X-NPU-Attempt": "1",
    }
    timeout = urllib3.Timeout(connect=2.0, read=30.0)

    def call() -> dict:
        body = json.dumps(PAYLOAD).encode()
        response = http.urlopen(
            "POST", "/inference", body=body, headers=headers, timeout=timeout, redirect=False
        )
        return json.loads(response.data)

    return call, http.close


def _bare_requests(url: str):
    session = requests.Session()

    def call() -> dict:
        return session.post(url + "/inference", json=PAYLOAD, timeout=(2.0, 30.0)).json()

    return call, session.close


def test_execute_overhead_vs_bare_client(benchmark, fast_worker):
    """Median latency of pool.execute over a bare urllib3 call and a requests.Session call."""
    config = PoolConfig(
        workers=(worker_config("bench", fast_worker.url, max_concurrent=8),),
        health=HealthConfig(enabled=False),
    )
    bare, close_bare = _bare_urllib3(fast_worker.url)
    session_call, close_session = _bare_requests(fast_worker.url)
    with WorkerPool(config) as pool:
        contenders = {
            "bare urllib3": bare,
            "pool.execute": lambda: pool.execute(PAYLOAD),
            "requests.Session": session_call,
        }
        samples: dict[str, list[float]] = {name: [] for name in contenders}
        for fn in contenders.values():  # warm connections and code paths
            for _ in range(200):
                fn()
        clock = time.perf_counter
        for _ in range(ROUNDS):
            for name, fn in contenders.items():
                t0 = clock()
                fn()
                samples[name].append(clock() - t0)
        medians = {name: statistics.median(v) for name, v in samples.items()}
        p99 = {name: statistics.quantiles(v, n=100)[98] for name, v in samples.items()}
        ratio = medians["pool.execute"] / medians["bare urllib3"]
        ratio_requests = medians["pool.execute"] / medians["requests.Session"]
        benchmark.extra_info.update(
            {
                "median_us": {k: v * 1e6 for k, v in medians.items()},
                "p99_us": {k: v * 1e6 for k, v in p99.items()},
                "pool_over_bare_urllib3": ratio,
                "pool_over_requests_session": ratio_requests,
            }
        )
        report(
            "pool.execute vs bare clients (one loopback worker, latency 0)",
            [("client", "median µs", "p99 µs", "vs bare urllib3")]
            + [
                (
                    k,
                    f"{medians[k] * 1e6:.0f}",
                    f"{p99[k] * 1e6:.0f}",
                    f"{medians[k] / medians['bare urllib3']:.3f}",
                )
                for k in contenders
            ],
        )
        benchmark.pedantic(lambda: pool.execute(PAYLOAD), rounds=500, warmup_rounds=50)
    close_bare()
    close_session()
