"""pool.execute against a bare call with the same HTTP client, side by side.

For each client the pool can use (the built-in transport, the default, and urllib3),
the bare call sends the same request as the pool (same body, same headers) and decodes
the JSON answer, so the difference is the pool's own work in the client. Calls are
interleaved one by one so that machine noise hits every contender alike; the figures
that matter are the ratios of medians, printed and stored in the benchmark's
extra_info.
"""

from __future__ import annotations

import gc
import json
import time

import requests
import urllib3

from benchmarks.conftest import interleave, report, summarise
from npu_sync import WorkerPool
from npu_sync.config import HealthConfig, PoolConfig, TransportConfig, worker_config
from npu_sync.testing import FakeNetwork
from npu_sync.transport import Response, make_transport

PAYLOAD = {"model_id": "default", "input_text": "benchmark", "max_tokens": 16}
ROUNDS = 3000
OWN_TASKS = 20000  # per run of the pool's own work
OWN_RUNS = 5


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


def _bare_builtin(url: str):
    transport = make_transport(worker_config("bare", url, max_concurrent=4), TransportConfig())
    headers = {"X-NPU-Task-Id": "0" * 32, "X-NPU-Attempt": "1"}

    def call() -> dict:
        body = json.dumps(PAYLOAD).encode()
        response = transport.request(
            "POST", "/inference", body=body, headers=headers, timeout=20.0, connect_timeout=2.0
        )
        return json.loads(response.body)

    return call, transport.close


def _bare_requests(url: str):
    session = requests.Session()

    def call() -> dict:
        return session.post(url + "/inference", json=PAYLOAD, timeout=(2.0, 30.0)).json()

    return call, session.close


def test_execute_overhead_vs_bare_client(benchmark, fast_worker):
    """Median latency of pool.execute over a bare call with the same client."""

    def config(client: str) -> PoolConfig:
        return PoolConfig(
            workers=(worker_config("bench", fast_worker.url, max_concurrent=8),),
            health=HealthConfig(enabled=False),
            transport=TransportConfig(client=client),
        )

    bare_builtin, close_builtin = _bare_builtin(fast_worker.url)
    bare_urllib3, close_urllib3 = _bare_urllib3(fast_worker.url)
    session_call, close_session = _bare_requests(fast_worker.url)
    with WorkerPool(config("builtin")) as pool, WorkerPool(config("urllib3")) as pool3:
        contenders = {
            "bare builtin": bare_builtin,
            "pool.execute (builtin)": lambda: pool.execute(PAYLOAD),
            "bare urllib3": bare_urllib3,
            "pool.execute (urllib3)": lambda: pool3.execute(PAYLOAD),
            "requests.Session": session_call,
        }
        interleave(contenders, 200)  # warm connections and code paths
        figures = summarise(interleave(contenders, ROUNDS))
        median = {k: f["median_us"] for k, f in figures.items()}
        base = median["bare builtin"]
        ratios = {
            "pool_over_bare_builtin": median["pool.execute (builtin)"] / base,
            "pool_over_bare_urllib3": median["pool.execute (urllib3)"] / median["bare urllib3"],
            "pool_over_requests_session": median["pool.execute (builtin)"]
            / median["requests.Session"],
        }
        benchmark.extra_info.update({"figures": figures, **ratios})
        same_client = {
            "pool.execute (builtin)": "bare builtin",
            "pool.execute (urllib3)": "bare urllib3",
        }
        report(
            "pool.execute vs bare clients (one loopback worker, latency 0)",
            [("client", "median µs", "p99 µs", "vs bare builtin", "vs same bare client")]
            + [
                (
                    k,
                    f"{f['median_us']:.0f}",
                    f"{f['p99_us']:.0f}",
                    f"{f['median_us'] / base:.3f}",
                    f"{f['median_us'] / median[same_client[k]]:.3f}" if k in same_client else "",
                )
                for k, f in figures.items()
            ],
        )
        benchmark.pedantic(lambda: pool.execute(PAYLOAD), rounds=500, warmup_rounds=50)
    close_builtin()
    close_urllib3()
    close_session()


_ANSWER = Response(
    200,
    {"content-type": "application/json"},
    json.dumps(
        {
            "model_id": "default",
            "device": "NPU",
            "response": "benchmark",
            "inference_time_ms": 0.0,
            "inference_count": 1,
        }
    ).encode(),
)


class _Instant:
    """A transport that answers at once, doing nothing: what is left is the pool's."""

    cancellable = False

    def request(self, method, path, *, body=None, headers=None, timeout, **options):
        return _ANSWER

    def close(self) -> None:
        pass


def _per_task_us(call, tasks: int) -> float:
    gc.collect()
    t0 = time.perf_counter()
    for _ in range(tasks):
        call()
    return (time.perf_counter() - t0) / tasks * 1e6


def test_the_pools_own_work_per_task(benchmark):
    """The pool's own work per task, on a transport that answers at once (best of 5
    runs): an instant transport of our own, and the FakeNetwork of npu_sync.testing
    (which records every request); against a bare call's encoding and decoding."""
    config = PoolConfig(
        workers=(worker_config("bench", "http://127.0.0.1:9", max_concurrent=8),),
        health=HealthConfig(enabled=False),
    )

    def bare() -> dict:
        body = json.dumps(PAYLOAD).encode()
        return json.loads(_Instant().request("POST", "/inference", body=body, timeout=1.0).body)

    network = FakeNetwork()
    with (
        WorkerPool(config, transport_factory=lambda *a, **k: _Instant()) as pool,
        WorkerPool(config, transport_factory=network.factory) as faked,
    ):
        contenders = {
            "bare: encode + decode": bare,
            "pool.execute, instant transport": lambda: pool.execute(PAYLOAD),
            "pool.execute, FakeNetwork": lambda: faked.execute(PAYLOAD),
        }
        for call in contenders.values():
            _per_task_us(call, 2000)  # warm up
        runs: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(OWN_RUNS):
            for name, call in contenders.items():
                runs[name].append(_per_task_us(call, OWN_TASKS))
        best = {name: min(values) for name, values in runs.items()}
        benchmark.extra_info.update({"own_work_best_us": best})
        report(
            "the pool's own work per task (transport answering at once, best of 5)",
            [("contender", "µs a task", "runs")]
            + [
                (name, f"{best[name]:.1f}", " ".join(f"{v:.1f}" for v in runs[name]))
                for name in contenders
            ],
        )
        benchmark.pedantic(lambda: pool.execute(PAYLOAD), rounds=2000, warmup_rounds=100)
