"""pool.execute against a bare call with the same HTTP client, side by side.

For each client the pool can use (the built-in transport, the default, and urllib3),
the bare call sends the same request as the pool (same body, same headers) and decodes
the JSON answer, so the difference is the pool's own work in the client. Calls are
interleaved one by one so that machine noise hits every contender alike; the figures
that matter are the ratios of medians, printed and stored in the benchmark's
extra_info.

``test_execute_overhead_by_fleet`` does the same on the default transport for four
fleets: a worker that answers at once (``benchmarks/instant_worker.py``) and the
reference worker, one of each and ten of each, timing each contender's wall clock and
then, in a second interleaved pass, the calling thread's CPU time. With ten workers
the bare call is timed three ways: spread round-robin over the ten (the anchor: what
a caller spreading tasks by hand would do), on one worker only, and on the worker that
answered the pool's last task (the same spread as the pool's, so the same wake-ups of
worker processes: what is left is the pool's work in the client).
"""

from __future__ import annotations

import gc
import json
import time

import requests
import urllib3

from benchmarks.conftest import FLEET, interleave, report, summarise
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


def _round_robin(calls: list):
    turn = 0

    def call() -> dict:
        nonlocal turn
        fn = calls[turn]
        turn = (turn + 1) % len(calls)
        return fn()

    return call


def _spread(pool: WorkerPool) -> list[int]:
    """Attempts per worker, most used first."""
    return sorted((row["tasks"]["attempts"] for row in pool.workers()), reverse=True)


FLEETS = {
    "instant, 1 worker": ("instant_fleet", 1),
    "instant, 10 workers": ("instant_fleet", FLEET),
    "reference, 1 worker": ("reference_fleet", 1),
    "reference, 10 workers": ("reference_fleet", FLEET),
}


def _fleet_contenders(pool: WorkerPool, bare: list) -> dict:
    """The contenders for one fleet: the pool, and the bare calls beside it."""
    contenders = {"bare, one worker": bare[0]}
    if len(bare) > 1:
        # Each worker names itself in its answers: the bare call to the worker that
        # answered the pool's last task.
        by_id = {call()["worker_id"]: call for call in bare}
        last = [next(iter(by_id))]

        def execute() -> dict:
            result = pool.execute(PAYLOAD)
            last[0] = result["worker_id"]
            return result

        contenders["bare, round-robin"] = _round_robin(bare)
        contenders["bare, the pool's worker"] = lambda: by_id[last[0]]()
        contenders["pool.execute"] = execute
    else:
        contenders["pool.execute"] = lambda: pool.execute(PAYLOAD)
    return contenders


def _fleet_case(urls: list[str]) -> dict:
    """Wall clock and the caller's CPU of each contender on the workers at ``urls``."""
    config = PoolConfig(
        workers=tuple(worker_config(f"w{i}", url, max_concurrent=8) for i, url in enumerate(urls)),
        health=HealthConfig(enabled=False),
    )
    bare = [_bare_builtin(url) for url in urls]
    with WorkerPool(config) as pool:
        contenders = _fleet_contenders(pool, [call for call, _ in bare])
        interleave(contenders, 200)  # warm connections and code paths
        before = _spread(pool)
        wall = summarise(interleave(contenders, ROUNDS))
        spread = [a - b for a, b in zip(_spread(pool), before, strict=True)]
        cpu = summarise(interleave(contenders, ROUNDS, time.thread_time))
    for _, close in bare:
        close()
    return {"wall": wall, "cpu": cpu, "pool_attempts_per_worker": sorted(spread, reverse=True)}


def test_execute_overhead_by_fleet(benchmark, request):
    """pool.execute over a bare built-in call, wall clock and the caller's CPU, on a
    worker that answers at once and on the reference worker, with 1 and 10 workers."""
    summary: list[tuple[str, ...]] = [
        (
            "fleet",
            "bare µs",
            "pool µs",
            "pool ÷ bare",
            "÷ bare on 1",
            "÷ bare, pool's worker",
            "CPU bare",
            "CPU pool",
        )
    ]
    results: dict[str, dict] = {}
    for case, (fixture, size) in FLEETS.items():
        result = results[case] = _fleet_case(request.getfixturevalue(fixture)[:size])
        wall = {k: f["median_us"] for k, f in result["wall"].items()}
        cpu = {k: f["median_us"] for k, f in result["cpu"].items()}
        anchor = "bare, round-robin" if size > 1 else "bare, one worker"
        pool = wall["pool.execute"]
        result["pool_over_bare"] = pool / wall[anchor]
        result["pool_over_bare_one_worker"] = pool / wall["bare, one worker"]
        if size > 1:
            result["pool_over_bare_same_worker"] = pool / wall["bare, the pool's worker"]
        report(
            f"{case}: median µs (the pool's attempts per worker, most used first: "
            f"{result['pool_attempts_per_worker']})",
            [("contender", "wall", "p99", "CPU", "wall - CPU", f"÷ {anchor}")]
            + [
                (
                    k,
                    f"{f['median_us']:.0f}",
                    f"{f['p99_us']:.0f}",
                    f"{cpu[k]:.0f}",
                    f"{f['median_us'] - cpu[k]:.0f}",
                    f"{f['median_us'] / wall[anchor]:.3f}",
                )
                for k, f in result["wall"].items()
            ],
        )
        summary.append(
            (
                case,
                f"{wall[anchor]:.0f}",
                f"{pool:.0f}",
                f"{result['pool_over_bare']:.3f}",
                f"{result['pool_over_bare_one_worker']:.3f}" if size > 1 else "",
                f"{result['pool_over_bare_same_worker']:.3f}" if size > 1 else "",
                f"{cpu[anchor]:.0f}",
                f"{cpu['pool.execute']:.0f}",
            )
        )
    benchmark.extra_info.update({"fleets": results})
    report("pool.execute over a bare built-in call (with 10 workers: round-robin)", summary)
    config = PoolConfig(
        workers=(worker_config("w", request.getfixturevalue("reference_fleet")[0]),),
        health=HealthConfig(enabled=False),
    )
    with WorkerPool(config) as pool:
        benchmark.pedantic(lambda: pool.execute(PAYLOAD), rounds=500, warmup_rounds=50)


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
