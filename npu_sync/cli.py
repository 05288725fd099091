"""The ``npu-sync`` command: ``demo``, ``worker`` and ``check``."""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from npu_sync.errors import ConfigError, NpuSyncError, TaskFailed, TaskRejected


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    logging.basicConfig(
        level=logging.DEBUG if getattr(args, "verbose", False) else logging.ERROR,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        code: int = args.run(args)
    except KeyboardInterrupt:
        return 130
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    except (NpuSyncError, OSError, RuntimeError) as exc:
        print(f"npu-sync: error: {exc}", file=sys.stderr)
        return 1
    return code


def _parser() -> argparse.ArgumentParser:
    from npu_sync import worker_server

    parser = argparse.ArgumentParser(
        prog="npu-sync", description="Spread inference tasks over a pool of NPU workers."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="run 1,000 tasks over three local workers, killing one midway",
        description="Start three local reference workers, run tasks through a pool, kill "
        "one worker a third of the way and restart it later, then print a summary. "
        "Exits 1 if any task was lost.",
    )
    demo.add_argument("--tasks", type=int, default=1000, help="how many tasks (default 1000)")
    demo.add_argument("--threads", type=int, default=16, help="caller threads (default 16)")
    demo.add_argument(
        "--latency-ms", type=float, default=40.0, help="simulated inference time (default 40)"
    )
    demo.add_argument("--no-kill", action="store_true", help="do not kill a worker")
    demo.add_argument("--verbose", action="store_true", help="log what the pool does")
    demo.set_defaults(run=_demo)

    worker = sub.add_parser(
        "worker",
        help="serve a simulated NPU worker (the reference worker)",
        description="A simulated NPU worker speaking the npu_sync worker protocol.",
    )
    worker_server.build_arg_parser(worker)
    worker.set_defaults(run=worker_server.serve)

    check = sub.add_parser(
        "check",
        help="validate a YAML configuration",
        description="Validate a configuration file: exit 0 with a summary, or 2 with "
        "every error and its key path.",
    )
    check.add_argument("config", help="path to the YAML file")
    check.set_defaults(run=_check)
    return parser


def _check(args: argparse.Namespace) -> int:
    from npu_sync.config import load_config

    config = load_config(args.config)
    tiers = sorted({w.priority for w in config.workers})
    print(
        f"{args.config}: ok — {len(config.workers)} worker(s) in {len(tiers)} priority "
        f"tier(s), dead letters: {config.dead_letter.backend}"
    )
    return 0


class _Progress:
    def __init__(self, total: int, out: TextIO) -> None:
        self.total = total
        self.out = out
        self.tty = out.isatty()
        self._last_tenth = -1

    def update(self, done: int, note: str = "") -> None:
        if self.tty:
            width = 40
            filled = width * done // self.total
            bar = "#" * filled + "." * (width - filled)
            self.out.write(f"\r[{bar}] {done}/{self.total} {note:<30}")
            self.out.flush()
        else:
            tenth = 10 * done // self.total
            if tenth != self._last_tenth or note:
                self._last_tenth = tenth
                self.out.write(f"  {done}/{self.total} tasks{' ' + note if note else ''}\n")
                self.out.flush()

    def finish(self) -> None:
        if self.tty:
            self.out.write("\n")


def _demo(args: argparse.Namespace) -> int:
    from npu_sync.config import (
        BreakerConfig,
        HealthConfig,
        PoolConfig,
        PoolSettings,
        RetryConfig,
        TimeoutConfig,
        worker_config,
    )
    from npu_sync.pool import WorkerPool
    from npu_sync.worker_server import LocalWorker

    if args.tasks < 1 or args.threads < 1:
        print("npu-sync demo: --tasks and --threads must be >= 1", file=sys.stderr)
        return 2
    out = sys.stdout
    workers = [
        LocalWorker(worker_id=f"npu-{i}", latency_ms=args.latency_ms, jitter_ms=args.latency_ms / 4)
        for i in (1, 2, 3)
    ]
    try:
        for w in workers:
            w.start()
            out.write(f"started worker {w.worker_id} at {w.url}\n")
        config = PoolConfig(
            workers=tuple(
                worker_config(w.worker_id, w.url, priority=1, max_concurrent=16) for w in workers
            ),
            health=HealthConfig(enabled=False),
            circuit_breaker=BreakerConfig(fail_max=3, reset_timeout=0.5, max_reset_timeout=4.0),
            retry=RetryConfig(max_retries=3, backoff_initial=0.02, backoff_max=0.5),
            timeouts=TimeoutConfig(connect=0.5, read=5.0, task=30.0),
            pool=PoolSettings(threads=args.threads),
        )
        victim = workers[1]
        kill_at = args.tasks // 3
        restart_at = 2 * args.tasks // 3
        outcomes = {"succeeded": 0, "rejected": 0, "dead-lettered": 0, "unexplained": 0}
        out.write(f"running {args.tasks} tasks from {args.threads} threads\n")
        progress = _Progress(args.tasks, out)
        started = time.monotonic()
        with WorkerPool(config) as pool:
            futures = [
                pool.submit({"model_id": "default", "input_text": f"demo task {i}"})
                for i in range(args.tasks)
            ]
            for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
                note = ""
                try:
                    future.result()
                    outcomes["succeeded"] += 1
                except TaskRejected:
                    outcomes["rejected"] += 1
                except TaskFailed as exc:
                    known = exc.dead_letter_id and pool.dead_letters.store.get(exc.dead_letter_id)
                    outcomes["dead-lettered" if known else "unexplained"] += 1
                except Exception:
                    outcomes["unexplained"] += 1
                if done == kill_at and not args.no_kill:
                    victim.kill()
                    note = f"killed {victim.worker_id} (SIGKILL)"
                elif done == restart_at and not args.no_kill:
                    victim.restart()
                    note = f"restarted {victim.worker_id}"
                progress.update(done, note)
            progress.finish()
            elapsed = time.monotonic() - started
            rows = pool.workers()
        lost = args.tasks - sum(outcomes.values()) + outcomes["unexplained"]
        _print_summary(out, rows, outcomes, args.tasks, elapsed, lost)
        return 1 if lost else 0
    finally:
        for w in workers:
            w.stop()


def _print_summary(
    out: TextIO,
    rows: list[dict[str, object]],
    outcomes: dict[str, int],
    total: int,
    elapsed: float,
    lost: int,
) -> None:
    def ms(value: object) -> str:
        return "-" if value is None else f"{value:.1f}"

    out.write(
        f"\n{'worker':<8} {'tasks':>6} {'failures':>8} {'trips':>5} {'breaker':>9} "
        f"{'p50 ms':>7} {'p99 ms':>7}\n"
    )
    for row in rows:
        tasks = row["tasks"]
        breaker = row["breaker"]
        latency = row["latency"]
        assert isinstance(tasks, dict) and isinstance(breaker, dict) and isinstance(latency, dict)
        out.write(
            f"{row['id']!s:<8} {tasks['succeeded']:>6} {tasks['failed']:>8} "
            f"{breaker['trips']:>5} {breaker['state']:>9} "
            f"{ms(latency['p50_ms']):>7} {ms(latency['p99_ms']):>7}\n"
        )
    ok = outcomes["succeeded"]
    out.write(
        f"\n{ok}/{total} tasks succeeded ({100 * ok / total:.2f} %) in {elapsed:.1f}s "
        f"({total / elapsed:.0f} tasks/s); rejected {outcomes['rejected']}, "
        f"dead-lettered {outcomes['dead-lettered']}, lost {lost}\n"
    )
