"""Per-task cost of the fleet view: pools publishing their snapshots to Redis against the
same shared state without snapshots, side by side.

Four pools on the same three reference workers, all with ``shared_state: redis`` (a
real redis-server on loopback): fleet snapshots off (the baseline), off again (a
control: the spread between two identical pools is the noise floor of the run), on at
the default interval (5 s), and on every 50 ms (a hundred times as often, so that the
run holds many samples). Calls are interleaved one by one, then the same pools run a burst on
eight threads each, in turns. The cost of one sample is also timed on its own, and
spread over the tasks an interval holds at the measured rate.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import statistics
import tempfile
import time

import pytest

from benchmarks.conftest import interleave, report, summarise
from npu_sync import WorkerPool
from npu_sync._fleet import monitor_of
from npu_sync.config import HealthConfig, PoolConfig, SharedStateConfig, worker_config
from npu_sync.worker_server import LocalWorker

PAYLOAD = {"model_id": "default", "input_text": "benchmark"}
STRESS_INTERVAL = 0.05


def build(config: PoolConfig, monkeypatch: pytest.MonkeyPatch, **env: str) -> WorkerPool:
    """A pool built with the fleet settings of ``env`` (read when a pool is built)."""
    for name in ("NPU_SYNC_FLEET", "NPU_SYNC_FLEET_INTERVAL", "NPU_SYNC_FLEET_TTL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return WorkerPool(config)


def burst(pool: WorkerPool, tasks: int, threads: int = 8) -> float:
    """Seconds to run ``tasks`` tasks on ``threads`` caller threads."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as callers:
        for future in [callers.submit(pool.execute, PAYLOAD) for _ in range(tasks)]:
            future.result()
    return time.perf_counter() - start


def test_task_latency_with_fleet_snapshots_vs_shared_state_without(benchmark, monkeypatch):
    """Median and p99 per task, and burst throughput: snapshots off, every 5 s, every 50 ms."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    from tests.integration.conftest import RedisServer

    with tempfile.TemporaryDirectory() as directory:
        server = RedisServer(directory).start()
        workers = [LocalWorker(worker_id=f"r{i}", max_concurrent=64).start() for i in range(3)]
        try:
            config = PoolConfig(
                workers=tuple(worker_config(w.worker_id, w.url) for w in workers),
                health=HealthConfig(enabled=False),
                shared_state=SharedStateConfig(backend="redis", url=server.url, namespace="b"),
            )
            interval = str(STRESS_INTERVAL)
            with (
                build(config, monkeypatch, NPU_SYNC_FLEET="off") as off,
                build(config, monkeypatch, NPU_SYNC_FLEET="off") as control,
                build(config, monkeypatch) as default,
                build(config, monkeypatch, NPU_SYNC_FLEET_INTERVAL=interval) as often,
            ):
                contenders = {
                    "snapshots off": lambda: off.execute(PAYLOAD),
                    "off again (control)": lambda: control.execute(PAYLOAD),
                    "every 5 s (default)": lambda: default.execute(PAYLOAD),
                    "every 50 ms": lambda: often.execute(PAYLOAD),
                }
                interleave(contenders, 200)
                ticks_before = monitor_of(often).ticks
                started = time.perf_counter()
                figures = summarise(interleave(contenders, 3000))
                seconds = time.perf_counter() - started
                ticks = monitor_of(often).ticks - ticks_before
                assert ticks >= seconds / STRESS_INTERVAL / 2, (ticks, seconds)
                pools = {"snapshots off": off, "off again (control)": control}
                pools |= {"every 5 s (default)": default, "every 50 ms": often}
                bursts: dict[str, list[float]] = {name: [] for name in pools}
                for turn in range(24):
                    names = list(pools)
                    names = names[turn % 4 :] + names[: turn % 4]
                    for name in names:
                        bursts[name].append(burst(pools[name], 1000))
                # One sample on its own: read the pool, record, publish to Redis.
                monitor = monitor_of(default)
                tick_s = []
                for _ in range(300):
                    t0 = time.perf_counter()
                    monitor.tick()
                    tick_s.append(time.perf_counter() - t0)
                snapshot = often.stats(scope="fleet")
                benchmark.pedantic(lambda: often.execute(PAYLOAD), rounds=200)
            assert snapshot["available"] and snapshot["totals"]["processes"] == 2  # not "off"
            base = figures["snapshots off"]["median_us"]
            throughput = {name: 1000 / statistics.median(t) for name, t in bursts.items()}
            tick_us = statistics.median(tick_s) * 1e6
            # The default interval's sample, spread over the tasks of one interval at the
            # burst rate measured: its share of a task's time.
            rate = throughput["snapshots off"]
            per_task_us = tick_us / (5.0 * rate)
            share = per_task_us / (1e6 / rate)
            ratios = {
                name: {
                    "median_ratio": f["median_us"] / base,
                    "throughput_ratio": throughput["snapshots off"] / throughput[name],
                }
                for name, f in figures.items()
            }
            benchmark.extra_info.update(
                {
                    "figures": figures,
                    "throughput_tasks_per_s": throughput,
                    "ratios": ratios,
                    "tick_us": tick_us,
                    "ticks_in_interleaved_run": ticks,
                    "default_sample_us_per_task": per_task_us,
                    "default_sample_share_of_a_task": share,
                }
            )
            report(
                "per-task cost of fleet snapshots, against shared state without them",
                [("pool", "median µs", "p99 µs", "median ratio", "tasks/s (8 thr)", "time ratio")]
                + [
                    (
                        name,
                        f"{f['median_us']:.0f}",
                        f"{f['p99_us']:.0f}",
                        f"{ratios[name]['median_ratio']:.3f}",
                        f"{throughput[name]:.0f}",
                        f"{ratios[name]['throughput_ratio']:.3f}",
                    )
                    for name, f in figures.items()
                ],
            )
            print(
                f"  one sample (3 workers, read + record + publish): {tick_us:.0f} µs; at the "
                f"default 5 s and {rate:.0f} tasks/s: {per_task_us * 1000:.1f} ns a task "
                f"({share:.4%} of one); {ticks} samples in the 50 ms pool's interleaved run"
            )
        finally:
            for w in workers:
                w.stop()
            server.kill()
