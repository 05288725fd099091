"""pool.execute against a bare call with the same HTTP client, side by side.

The bare call sends the same request as the pool (same body, same headers), so the
difference is the pool's own work in the client. Calls are interleaved one by one
(bare, pool, requests, bare, pool, …) so that machine noise hits every contender
alike; the figure that matters is the ratio of medians, printed and stored in
the benchmark's extra_info.
"""

from __future__ import annotations

import json

import requests
import urllib3

from benchmarks.conftest import interleave, report, summarise
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
        interleave(contenders, 200)  # warm connections and code paths
        figures = summarise(interleave(contenders, ROUNDS))
        base = figures["bare urllib3"]["median_us"]
        pool_median = figures["pool.execute"]["median_us"]
        benchmark.extra_info.update(
            {
                "figures": figures,
                "pool_over_bare_urllib3": pool_median / base,
                "pool_over_requests_session": pool_median
                / figures["requests.Session"]["median_us"],
            }
        )
        report(
            "pool.execute vs bare clients (one loopback worker, latency 0)",
            [("client", "median µs", "p99 µs", "vs bare urllib3")]
            + [
                (k, f"{f['median_us']:.0f}", f"{f['p99_us']:.0f}", f"{f['median_us'] / base:.3f}")
                for k, f in figures.items()
            ],
        )
        benchmark.pedantic(lambda: pool.execute(PAYLOAD), rounds=500, warmup_rounds=50)
    close_bare()
    close_session()
