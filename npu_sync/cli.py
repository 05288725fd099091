"""The ``npu-sync`` command: ``check``, ``status``, ``dlq``, ``worker`` and ``demo``.

Exit codes are the same for every command: 0 success, 1 a failure (an unhealthy
worker, a replay that did not succeed, an I/O error), 2 a bad configuration or bad
usage, 130 interrupted. Errors are one-line messages on stderr, never tracebacks
(``--verbose`` logs the traceback of an unexpected one). See docs/cli.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, TextIO

from npu_sync.errors import (
    ConfigError,
    NpuSyncError,
    TaskFailed,
    TaskRejected,
    printable,
    scrub,
)

if TYPE_CHECKING:
    from npu_sync._deadletter import DeadLetterStore
    from npu_sync._fleet import FleetView
    from npu_sync._pool import WorkerPool
    from npu_sync._stats_types import ModelViewDict
    from npu_sync.config import PoolConfig

logger = logging.getLogger(__name__)

__all__ = [
    "main",
]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

DEFAULT_CONFIG = "npu_workers.yaml"
"""The configuration ``dlq`` reads when neither ``--config`` nor ``$NPU_SYNC_CONFIG`` is set."""

DLQ_REDIS_TIMEOUT = 5.0
"""The least connect and socket timeout of ``dlq``'s Redis calls, in seconds."""

_WATCH_INTERVAL = 2.0
_ERROR_WIDTH = 60
# An ambiguous id prefix names at most this many of the records it matches.
_AMBIGUOUS_SHOWN = 10
# Home the cursor, then erase the screen: each refresh redraws from the top.
_CLEAR_SCREEN = "\x1b[H\x1b[2J"

# How ``status --watch`` waits between refreshes; tests replace it to end the loop.
_pause: Callable[[float], None] = time.sleep


class _CommandError(Exception):
    """A command cannot go on; ``main`` prints the message and exits with ``code``."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``npu-sync`` command line.

    Args:
        argv: the arguments after the program name; ``sys.argv[1:]`` when None.

    Returns:
        The exit code: 0 success, 1 failure, 2 bad configuration or usage, 130 interrupted.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error argparse printed
        return _exit_code(exc.code)
    run: Callable[[argparse.Namespace], int] | None = getattr(args, "run", None)
    if run is None:
        # A command group named without its subcommand shows that group's help.
        help_parser: argparse.ArgumentParser = getattr(args, "help_parser", parser)
        help_parser.print_help()
        return EXIT_USAGE
    logging.basicConfig(
        level=logging.DEBUG if getattr(args, "verbose", False) else logging.ERROR,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return run(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except _CommandError as exc:
        _error(f"npu-sync {args.command}: {exc}")
        return exc.code
    except ConfigError as exc:
        _error(str(exc))
        return EXIT_USAGE
    except BrokenPipeError:
        # The reader went away (``npu-sync dlq list | head``): stop quietly, and keep
        # the interpreter's final flush from failing on the closed pipe again.
        _silence_stdout()
        return EXIT_FAILURE
    except (NpuSyncError, OSError, RuntimeError) as exc:
        _error(f"npu-sync: error: {exc}")
        return EXIT_FAILURE
    except Exception as exc:
        logger.debug("npu-sync %s failed", args.command, exc_info=True)
        _error(f"npu-sync: error: {type(exc).__name__}: {exc}")
        return EXIT_FAILURE


def _error(message: str) -> None:
    """Print an error for a person: no credential, no control character of a worker's."""
    lines = [printable(scrub(line)) for line in message.splitlines()]
    print("\n".join(lines), file=sys.stderr)


def _exit_code(code: object) -> int:
    if code is None:
        return EXIT_OK
    return code if isinstance(code, int) else EXIT_USAGE


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _parser() -> argparse.ArgumentParser:
    from npu_sync import __version__, worker_server

    parser = argparse.ArgumentParser(
        prog="npu-sync",
        description="Spread inference tasks over a pool of NPU workers.",
        epilog="Exit codes: 0 ok, 1 failure, 2 bad configuration or usage, 130 interrupted.",
    )
    parser.add_argument("--version", action="version", version=f"npu-sync {__version__}")
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
        description="Validate a configuration file and what start-up needs from the "
        "machine (an enabled worker, a usable dead-letter file and directory, readable "
        "certificates), creating nothing: exit 0 with a summary, or 2 with every error "
        "and its key path.",
    )
    check.add_argument("config", help="path to the YAML file")
    check.add_argument(
        "--probe",
        action="store_true",
        help="also ask every enabled worker, once: its health check, and whether its "
        "inference path is an NPU worker's (an empty task that no worker runs); a "
        "worker that is not one (404/405: a wrong port or base path) is an error",
    )
    check.set_defaults(run=_check)

    _add_status_parser(sub)
    _add_dlq_parser(sub)
    return parser


def _add_status_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    status = sub.add_parser(
        "status",
        help="probe every worker once and show its health",
        description="Probe every configured worker's health endpoint once, in parallel, "
        "and print one row per worker: id, url, priority, latency and health. With "
        "shared state in Redis, also show the fleet: every process running a pool, its "
        "tasks, and the totals per worker. "
        "Exits 0 when every enabled worker is healthy, 1 when any is not (or none is "
        "enabled), 2 for a bad configuration.",
    )
    status.add_argument(
        "config",
        nargs="?",
        default=None,
        metavar="CONFIG",
        help=f"path to the YAML file (default $NPU_SYNC_CONFIG, else ./{DEFAULT_CONFIG})",
    )
    status.add_argument(
        "--json", action="store_true", help="print a JSON list of rows (JSON Lines with --watch)"
    )
    status.add_argument(
        "--fleet",
        action="store_true",
        help="show the fleet even without shared state (which then says so); with --json, "
        'print {"workers": rows, "fleet": ...} instead of the list',
    )
    detail = status.add_mutually_exclusive_group()
    detail.add_argument(
        "--processes",
        action="store_true",
        help="list every process of the fleet, not only one row per host (the default "
        "when the fleet runs on more than one host)",
    )
    detail.add_argument(
        "--host",
        default=None,
        metavar="HOST",
        help="list the processes of one host of the fleet",
    )
    status.add_argument(
        "--watch",
        nargs="?",
        type=_seconds,
        const=_WATCH_INTERVAL,
        default=None,
        metavar="SECONDS",
        help=f"probe again every SECONDS (default {_WATCH_INTERVAL:g}) until Ctrl-C",
    )
    status.add_argument("--verbose", action="store_true", help="log what the probes do")
    status.set_defaults(run=_status)


def _add_dlq_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    config_help = (
        f"the pool's YAML file (default $NPU_SYNC_CONFIG, else ./{DEFAULT_CONFIG}); "
        "its dead_letter section names the store"
    )
    dlq = sub.add_parser(
        "dlq",
        help="inspect, replay or purge the dead-letter store",
        description="Work with the dead-letter store the configuration names: list "
        "records, show one, replay them on the pool, or purge them. Only a sqlite store "
        "can be read from outside the process that wrote it.",
    )
    dlq.add_argument("--config", default=None, metavar="CONFIG", help=config_help)
    dlq.add_argument("--verbose", action="store_true", help="log what the pool does")
    dlq.set_defaults(help_parser=dlq)
    # The same options after the subcommand; SUPPRESS keeps a value given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=argparse.SUPPRESS, metavar="CONFIG", help=config_help)
    common.add_argument(
        "--verbose", action="store_true", default=argparse.SUPPRESS, help="log what the pool does"
    )
    actions = dlq.add_subparsers(dest="dlq_command", metavar="ACTION")

    listing = actions.add_parser(
        "list",
        parents=[common],
        help="list stored records, oldest first",
        description="Print one row per record, oldest first: id, task id, created (UTC), "
        "attempts, replays and the error (truncated).",
    )
    listing.add_argument("--json", action="store_true", help="print the full records as JSON")
    listing.add_argument(
        "--limit", type=_count, default=None, metavar="N", help="show at most N records"
    )
    listing.add_argument(
        "--offset", type=_count, default=0, metavar="N", help="skip the N oldest records"
    )
    listing.set_defaults(run=_dlq_list)

    show = actions.add_parser(
        "show",
        parents=[common],
        help="print one record as JSON",
        description="Print the whole record, every attempt included, as JSON.",
    )
    show.add_argument(
        "id", metavar="ID", help="the record's id from 'dlq list', or a unique prefix of it"
    )
    show.set_defaults(run=_dlq_show)

    replay = actions.add_parser(
        "replay",
        parents=[common],
        help="run stored tasks again on the pool",
        description="Build a pool from the configuration and run the stored tasks again "
        "(one record, or all of them oldest first) with their original task ids. A record "
        "is removed only once its task succeeds. Exits 0 when every replayed task "
        "succeeded, 1 otherwise.",
    )
    replay.add_argument(
        "id",
        nargs="?",
        default=None,
        metavar="ID",
        help="replay only this record (its id or a unique prefix of it)",
    )
    replay.add_argument("--json", action="store_true", help="print the report as JSON")
    replay.set_defaults(run=_dlq_replay)

    purge = actions.add_parser(
        "purge",
        parents=[common],
        help="delete every stored record",
        description="Delete every record in the store. Asks for confirmation on a "
        "terminal; without one, --yes is required (exit 2 otherwise).",
    )
    purge.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    purge.set_defaults(run=_dlq_purge)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds > 0, got {text!r} (give CONFIG before --watch)"
        )
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return value


def _check(args: argparse.Namespace) -> int:
    from npu_sync._deadletter import check_store
    from npu_sync.config import load_config

    config = load_config(args.config)
    # What start-up would fail on, or run without: checked without creating anything.
    problems = _pool_problems(config) + check_store(config) + _tls_problems(config)
    if args.probe and not problems:
        problems = _probe_problems(config)
    if problems:
        raise ConfigError(problems, source=config.source)
    for warning in config.warnings:
        print(f"{args.config}: warning: {printable(warning)}")
    tiers = sorted({w.priority for w in config.workers})
    print(
        f"{args.config}: ok — {len(config.workers)} worker(s) in {len(tiers)} priority "
        f"tier(s), dead letters: {config.dead_letter.backend}"
    )
    return 0


def _pool_problems(config: PoolConfig) -> list[str]:
    if any(w.enabled for w in config.workers):
        return []
    from npu_sync._guard import ReloadGuard

    try:
        allowed = ReloadGuard.from_env(os.environ).under(config.reload).allow_empty
    except ConfigError as exc:
        return list(exc.errors)
    if allowed:
        return []
    what = "no worker" if not config.workers else "no enabled worker"
    return [
        f"{config.layout}.workers: {what}: the pool could run no task (set "
        "reload.allow_empty: true if an empty pool is meant)"
    ]


def _probe_problems(config: PoolConfig) -> list[str]:
    """What the enabled workers answer that no NPU worker would, by key path: a health
    check that fails, or an inference path that is not a worker's (404/405)."""
    from npu_sync._retry import NOT_A_WORKER
    from npu_sync.config import RetryConfig
    from npu_sync.errors import NpuSyncError
    from npu_sync.task import Task

    problems = []
    with _probe_pool(config) as probing:
        health = _probe(probing, config)
    checked = {row["id"]: row for row in health}
    timeout = config.timeouts.connect + config.health.timeout
    for i, entry in enumerate(config.workers):
        if not entry.enabled:
            continue
        where = f"{config.layout}.workers[{i}] ({entry.id}, {entry.url})"
        row = checked.get(entry.id)
        if row is not None and not row["ok"]:
            problems.append(f"{where}: health check failed: {row['error']}")
        # An empty task: a worker refuses it (400/422) without running anything; only
        # something that is not a worker answers 404 or 405 to the inference path.
        alone = dataclasses.replace(config, workers=(entry,), retry=RetryConfig(max_retries=0))
        pool = _probe_pool(alone)
        try:
            pool.execute(Task({}), timeout=timeout)
        except NpuSyncError:
            pass  # refused, or failed: the health check above says why it may be down
        finally:
            (worker,) = pool.workers()
            pool.close()
        error = worker["last_error"]
        if isinstance(error, str) and error.startswith(NOT_A_WORKER):
            problems.append(f"{where}: {error}")
    return problems


def _tls_problems(config: PoolConfig) -> list[str]:
    """Certificate files that are missing or unreadable, by key path."""
    from npu_sync.config import TLSConfig

    settings: list[tuple[str, TLSConfig]] = [
        (f"{config.layout}.transport.tls", config.transport.tls)
    ]
    settings += [
        (f"{config.layout}.workers[{i}].tls", w.tls)
        for i, w in enumerate(config.workers)
        if w.tls is not None and w.tls != config.transport.tls
    ]
    problems = []
    for path, tls in settings:
        files = {"verify": tls.verify, "cert": tls.cert, "key": tls.key}
        for key, value in files.items():
            if isinstance(value, str) and not os.access(value, os.R_OK):
                reason = "does not exist" if not os.path.exists(value) else "is not readable"
                problems.append(f"{path}.{key}: {value} {reason}")
    return problems


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
    from npu_sync._pool import WorkerPool
    from npu_sync.config import (
        BreakerConfig,
        HealthConfig,
        PoolConfig,
        PoolSettings,
        RetryConfig,
        TimeoutConfig,
        worker_config,
    )
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
    rows: Sequence[Mapping[str, object]],
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
    # The failures column counts attempts, not tasks: say so next to the success rate,
    # or "6 failures" reads as contradicting "100 % succeeded".
    attempts = sum(_failed_attempts(row) for row in rows)
    if attempts:
        fate = "all retried on another worker" if ok == total else "retried on another worker"
        out.write(f"{attempts} failed attempt(s), {fate}\n")


def _failed_attempts(row: Mapping[str, object]) -> int:
    tasks = row["tasks"]
    assert isinstance(tasks, Mapping)
    return int(tasks["failed"])


# -- status ------------------------------------------------------------------------------


def _status(args: argparse.Namespace) -> int:
    try:
        config = _config_from(args.config, "CONFIG")
    except _CommandError:
        if args.config:
            raise
        # What get_pool() would run: one worker at $NPU_WORKER_URL. Say so, since an
        # operator reading this expects the fleet of a configuration file.
        from npu_sync._pool import fallback_config

        config, reason = fallback_config(os.environ)
        sys.stderr.write(f"fallback mode: {reason}\n")
    # With shared state, the fleet is read from Redis too; without, only on request.
    fleet = args.fleet or config.shared_state.backend == "redis"
    pool = _probe_pool(config)
    try:
        out = sys.stdout
        if args.watch is None:
            rows = _probe(pool, config)
            view = _read_fleet(config) if fleet else None
            _print_status(
                out, rows, as_json=args.json, compact=False, fleet=view, keyed=args.fleet,
                detail=_detail(args), per_model=pool.stats()["models"]["per_model"],
            )  # fmt: skip
            return _status_code(rows)
        tty = out.isatty() and not args.json
        while True:
            rows = _probe(pool, config)
            view = _read_fleet(config) if fleet else None
            if tty:
                out.write(_CLEAR_SCREEN)
            if not args.json:
                out.write(
                    f"{config.source}: every {args.watch:g}s, "
                    f"{_iso(time.time())} (Ctrl-C to stop)\n\n"
                )
            _print_status(
                out, rows, as_json=args.json, compact=True, fleet=view, keyed=args.fleet,
                detail=_detail(args), per_model=pool.stats()["models"]["per_model"],
            )  # fmt: skip
            out.flush()
            _pause(args.watch)
    finally:
        pool.close()


def _probe_pool(config: PoolConfig) -> WorkerPool:
    """A pool that only probes: no health thread, no placement round (it would load and
    unload models on the workers it looks at), no dead-letter file touched, and no
    place in the fleet."""
    from npu_sync._deadletter import MemoryDeadLetterStore
    from npu_sync._pool import WorkerPool
    from npu_sync.config import SharedStateConfig

    # The health thread would probe on a schedule of its own; the rounds here are
    # driven by this command. The dead-letter store is never used by a probe, and
    # opening the configured one could create a file as a side effect. Without shared
    # state the probe does not publish itself as a process of the fleet it reports on.
    quiet = dataclasses.replace(
        config,
        health=dataclasses.replace(config.health, enabled=False),
        shared_state=SharedStateConfig(),
        models=dataclasses.replace(config.models, balance=False, placement=False),
    )
    return WorkerPool(quiet, dead_letter_store=MemoryDeadLetterStore(max_records=1))


def _read_fleet(config: PoolConfig) -> FleetView:
    from npu_sync._fleet import FleetSettings, read_fleet

    settings = FleetSettings.from_config(config.fleet, os.environ)
    return read_fleet(config.shared_state, settings=settings)


def _probe(pool: WorkerPool, config: PoolConfig) -> list[dict[str, Any]]:
    results = pool.check_health()
    # What the round learnt of each worker: its models, device, protocol, display name.
    learnt = {row["id"]: row for row in pool.workers()}
    rows: list[dict[str, Any]] = []
    for worker in sorted(config.workers, key=lambda w: (w.priority, w.id)):
        result = results.get(worker.id) or {"ok": False, "error": "not checked"}
        rows.append(
            {
                "id": worker.id,
                "url": worker.url,
                "priority": worker.priority,
                "enabled": worker.enabled,
                "ok": bool(result.get("ok")),
                "status": result.get("status"),
                "latency_ms": result.get("latency_ms"),
                "error": result.get("error"),
                "draining": result.get("draining"),
                "active_tasks": result.get("active_tasks"),
                "max_concurrent": result.get("max_concurrent"),
                "checked_at": result.get("checked_at"),
                "name": worker.name,
                "protocol": worker.protocol,
                "models": learnt[worker.id]["models"] if worker.id in learnt else None,
                "max_models": learnt[worker.id]["max_models"] if worker.id in learnt else None,
                "device": learnt[worker.id]["device"] if worker.id in learnt else None,
                "npu_available": (
                    learnt[worker.id]["npu_available"] if worker.id in learnt else None
                ),
            }
        )
    return rows


def _status_code(rows: list[dict[str, Any]]) -> int:
    enabled = [row for row in rows if row["enabled"]]
    # A pool with no enabled worker can run nothing: that is not a healthy pool.
    return EXIT_OK if enabled and all(row["ok"] for row in enabled) else EXIT_FAILURE


def _print_status(
    out: TextIO,
    rows: list[dict[str, Any]],
    *,
    as_json: bool,
    compact: bool,
    fleet: FleetView | None = None,
    keyed: bool = False,
    detail: str | None = None,
    per_model: Sequence[ModelViewDict] = (),
) -> None:
    if as_json:
        data: Any = rows
        if keyed:
            data = {
                "workers": rows,
                "models": list(per_model),
                "fleet": None if fleet is None else _fleet_dict(fleet),
            }
        out.write(json.dumps(data, indent=None if compact else 2) + "\n")
        return
    table = [
        [
            row["id"],
            row["url"],
            str(row["priority"]),
            "-" if row["latency_ms"] is None else f"{row['latency_ms']:.1f}",
            _health_text(row),
        ]
        for row in rows
    ]
    out.write(_table(["ID", "URL", "PRIORITY", "LATENCY_MS", "HEALTH"], table, right={2, 3}))
    enabled = [row for row in rows if row["enabled"]]
    healthy = sum(1 for row in enabled if row["ok"])
    summary = f"{healthy}/{len(enabled)} enabled worker(s) healthy"
    if len(enabled) < len(rows):
        summary += f", {len(rows) - len(enabled)} disabled"
    out.write(f"\n{summary}\n" if rows else "no workers configured\n")
    described = [row for row in rows if row.get("name") is not None]
    if described:
        # Indented, after the summary: lines that start with an id stay the health rows.
        about = _table(["ID", "NAME", "PROTOCOL", "DEVICE", "MODELS"], _about(described))
        out.write("\nmodels and devices:\n" + "".join(f"  {line}\n" for line in about.splitlines()))
    models = _per_model(per_model, rows)
    if models:
        headers = ["MODEL", "REPLICAS", "MIN", "MAX", "INFERENCES", "PER_S", "WORKERS"]
        table_text = _table(headers, models, right={1, 2, 3, 4, 5})
        out.write("\nper model:\n" + "".join(f"  {line}\n" for line in table_text.splitlines()))

    if fleet is not None:
        _print_fleet(out, fleet, detail)


def _detail(args: argparse.Namespace) -> str | None:
    """Which processes ``status`` lists: ``"*"`` all, a host's name, None the default."""
    if args.processes:
        return "*"
    host: str | None = args.host
    return host


def _fleet_dict(fleet: FleetView) -> dict[str, Any]:
    return {
        "shared": fleet.shared,
        "available": fleet.available,
        "note": fleet.note,
        "totals": fleet.totals,
        "hosts": fleet.hosts,
        "processes": fleet.processes,
        "silent": fleet.silent,
        "skipped": fleet.skipped,
    }


def _print_hosts(out: TextIO, fleet: FleetView) -> None:
    """One row per host: what an operator of many hosts looks at first."""
    now = time.time()
    table = []
    for h in fleet.hosts:
        if h["state"] == "silent":
            state = f"silent {_span(now - (h['silent_since'] or now))}"
        else:
            state = "live"
        t = h["tasks"]
        table.append(
            [
                h["host"],
                state,
                str(h["processes"]),
                str(h["silent_processes"]),
                f"{h['workers'] - h['workers_down']}/{h['workers']}",
                str(t["succeeded"]),
                str(t["failed"]),
                str(t["in_flight"]),
                str(h["errors"]),
            ]
        )
    headers = ["HOST", "STATE", "PROCESSES", "SILENT", "WORKERS_UP", "SUCCEEDED", "FAILED"]
    headers += ["IN_FLIGHT", "ERRORS"]
    out.write("\n" + _table(headers, table, right={2, 3, 4, 5, 6, 7, 8}))


def _print_fleet(out: TextIO, fleet: FleetView, detail: str | None = None) -> None:
    """The hosts of the fleet, its processes (all, one host's, or — by default — all
    when it runs on one host) and the totals per worker, under the probe's table."""
    out.write(f"\nfleet: {fleet.note}\n")
    if fleet.hosts:
        _print_hosts(out, fleet)
    processes = fleet.processes
    if detail is not None and detail != "*":
        processes = [p for p in processes if p["process"]["host"] == detail]
        if not processes:
            out.write(f"\nno live process on host {detail!r}\n")
    elif detail is None and len(fleet.hosts) > 1:
        processes = []
        out.write("\nper process: npu-sync status --processes, or --host HOST\n")
    if not fleet.processes:
        return
    now = time.time()
    table = [
        [
            p["process"]["host"],
            str(p["process"]["pid"]),
            _iso(p["process"]["started_at"]),
            _span(p["uptime_s"]),
            str(p["tasks"]["submitted"]),
            str(p["tasks"]["succeeded"]),
            str(p["tasks"]["failed"]),
            str(p["tasks"]["in_flight"]),
            f"{max(0.0, now - p['published_at']):.1f}s",
        ]
        for p in processes
    ]
    totals = fleet.totals
    t = totals["tasks"]
    table.append(
        [
            "total",
            f"{totals['processes']} proc",
            "",
            "",
            str(t["submitted"]),
            str(t["succeeded"]),
            str(t["failed"]),
            str(t["in_flight"]),
            "",
        ]
    )
    headers = ["HOST", "PID", "STARTED", "UPTIME", "SUBMITTED", "SUCCEEDED", "FAILED"]
    headers += ["IN_FLIGHT", "SNAPSHOT_AGE"]
    out.write("\n" + _table(headers, table, right={1, 4, 5, 6, 7, 8}))
    workers = [
        [
            w["id"],
            str(w["attempts"]),
            str(w["succeeded"]),
            str(w["failed"]),
            f"{w['in_flight']}/{w['capacity']}",
            "-" if w["p99_ms"] is None else f"{w['p99_ms']:.1f}",
            _breakers(w),
        ]
        for w in totals["workers"]
    ]
    headers = ["WORKER", "ATTEMPTS", "SUCCEEDED", "FAILED", "IN_FLIGHT", "P99_MS", "STATE"]
    out.write("\n" + _table(headers, workers, right={1, 2, 3, 4, 5}))


def _breakers(w: Mapping[str, Any]) -> str:
    """The worker over the fleet: ``ok``, or in how many processes its breaker is open or
    half-open, or it is unhealthy."""
    n = w["processes"]
    parts = [
        f"{label} in {count}/{n}"
        for label, count in (
            ("open", w["open_in"]),
            ("half-open", w["half_open_in"]),
            ("unhealthy", w["unhealthy_in"]),
        )
        if count
    ]
    return ", ".join(parts) or "ok"


def _span(seconds: float) -> str:
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _about(rows: list[dict[str, Any]]) -> list[list[str]]:
    """Who each worker is and what it holds: never its headers or auth secrets."""
    table = []
    for row in rows:
        device = row["device"] or "-"
        if row["npu_available"] is False:
            device += " (no NPU)"
        models = row["models"]
        shown = "unknown" if models is None else ", ".join(models) or "none"
        if row["max_models"] is not None:
            shown += f" (at most {row['max_models']})"
        table.append([row["id"], row["name"], row["protocol"], device, shown])
    return table


def _per_model(per_model: Sequence[ModelViewDict], rows: list[dict[str, Any]]) -> list[list[str]]:
    """Per model held or named in ``models.catalog`` (the probe pool's
    ``stats()["models"]["per_model"]``): its live replicas and targets, its load as the
    holders count it (inferences since each loaded it, and per second between two
    probes: ``--watch``), and who holds it; a holder that is not healthy and enabled
    says so, and so does a model below its ``min``."""
    up = {row["id"] for row in rows if row["ok"] and row["enabled"]}
    table = []
    for row in per_model:
        shown = ", ".join(w if w in up else f"{w} (down)" for w in row["workers"]) or "none"
        if row["replicas"] < row["min"]:
            shown += f" (below min {row['min']})"
        inferences, rate, high = row["inferences"], row["rate"], row["max"]
        table.append(
            [
                row["model"],
                str(row["replicas"]),
                str(row["min"]),
                "-" if high is None else str(high),
                "-" if inferences is None else str(inferences),
                "-" if rate is None else f"{rate:.2f}",
                shown,
            ]
        )
    return table


def _health_text(row: dict[str, Any]) -> str:
    if row["ok"]:
        text = "ok, draining" if row["draining"] else "ok"
    else:
        text = str(row["error"] or "unhealthy")
    return text if row["enabled"] else f"[disabled] {text}"


def _table(headers: list[str], rows: list[list[str]], *, right: Collection[int] = ()) -> str:
    """Rows under headers in aligned columns; the last column is never padded."""
    if not rows:
        return ""
    # Cells may quote a worker's answer or error: nothing in them may drive the terminal.
    headers = [printable(cell) for cell in headers]
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers) - 1)]
    lines = []
    for r in [headers, *rows]:
        cells = [
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(r[:-1], widths, strict=True))
        ]
        lines.append("  ".join([*cells, r[-1]]).rstrip())
    return "\n".join(lines) + "\n"


# -- dlq -----------------------------------------------------------------------------------


def _dlq_config(args: argparse.Namespace) -> PoolConfig:
    return _config_from(args.config, "--config")


def _config_from(given: str | None, option: str) -> PoolConfig:
    """The configuration named on the command line, else $NPU_SYNC_CONFIG, else the default."""
    from npu_sync.config import load_config

    path = given or os.environ.get("NPU_SYNC_CONFIG") or None
    if path is None:
        if not os.path.exists(DEFAULT_CONFIG):
            raise _CommandError(
                f"no configuration: {option} not given, $NPU_SYNC_CONFIG not set and "
                f"./{DEFAULT_CONFIG} does not exist"
            )
        path = DEFAULT_CONFIG
    return load_config(path)


def _open_dlq(config: PoolConfig) -> DeadLetterStore:
    """The store the configuration names, or an empty stand-in when its file is missing.

    Raises:
        _CommandError: the store is in memory, so only its own process can see it.
    """
    from npu_sync._deadletter import MemoryDeadLetterStore, open_store

    settings = config.dead_letter
    if settings.backend == "memory":
        raise _CommandError(
            f"{config.source} keeps dead letters in memory (dead_letter.backend: memory): "
            "those records live only inside the running process that stored them, so "
            "there is nothing here to inspect; use backend: sqlite to keep them in a file"
        )
    if settings.backend == "sqlite" and settings.path and not os.path.exists(settings.path):
        # Reading must not create the file (or fail on a missing directory): no file
        # simply means nothing was ever dead-lettered there.
        print(
            f"npu-sync dlq: {settings.path} does not exist yet; no dead letters",
            file=sys.stderr,
        )
        return MemoryDeadLetterStore(max_records=1)
    if settings.backend == "redis":
        from npu_sync._shared import SharedState

        # The pool's short timeout is for task threads that must not wait on Redis; an
        # operator's command may, and on a busy host Redis can answer later than 50 ms.
        patient = dataclasses.replace(
            config.shared_state, timeout=max(config.shared_state.timeout, DLQ_REDIS_TIMEOUT)
        )
        shared = SharedState(patient, lambda *changes: None)
        return shared.dead_letter_store(settings.max_records, spool_path=settings.spool_path)
    return open_store(settings)


def _store_name(config: PoolConfig) -> str:
    return config.dead_letter.path or config.dead_letter.backend


def _dlq_list(args: argparse.Namespace) -> int:
    config = _dlq_config(args)
    store = _open_dlq(config)
    try:
        records = store.list(limit=args.limit, offset=args.offset)
        total = len(store)
    finally:
        store.close()
    if args.json:
        print(json.dumps([record.to_dict() for record in records], indent=2))
        return EXIT_OK
    if not records:
        print(f"no dead letters in {_store_name(config)}" + (" at this offset" if total else ""))
        return EXIT_OK
    table = [
        [
            record.id,
            record.task_id,
            _iso(record.created_at),
            str(len(record.attempts)),
            str(record.replays),
            _truncate(record.error, _ERROR_WIDTH),
        ]
        for record in records
    ]
    headers = ["ID", "TASK_ID", "CREATED", "ATTEMPTS", "REPLAYS", "ERROR"]
    sys.stdout.write(_table(headers, table, right={3, 4}))
    first = args.offset + 1
    print(f"\n{first}-{args.offset + len(records)} of {total} record(s), oldest first")
    return EXIT_OK


def _dlq_show(args: argparse.Namespace) -> int:
    config = _dlq_config(args)
    store = _open_dlq(config)
    try:
        record_id = _resolve_id(store, args.id, config)
        record = store.get(record_id)
    finally:
        store.close()
    if record is None:  # removed since it was resolved, by a replay or a purge
        raise _CommandError(
            f"no dead letter with id {args.id!r} in {_store_name(config)}", EXIT_FAILURE
        )
    print(json.dumps(record.to_dict(), indent=2))
    return EXIT_OK


def _resolve_id(store: DeadLetterStore, prefix: str, config: PoolConfig) -> str:
    """The one stored id that is, or starts with, prefix.

    Raises:
        _CommandError: exit 1 when no id matches, 2 when several do (naming them).
    """
    if store.get(prefix) is not None:
        return prefix
    matches = [record.id for record in store.list() if record.id.startswith(prefix)]
    if not matches:
        raise _CommandError(
            f"no dead letter with id {prefix!r} in {_store_name(config)}", EXIT_FAILURE
        )
    if len(matches) > 1:
        shown = ", ".join(printable(match) for match in matches[:_AMBIGUOUS_SHOWN])
        more = len(matches) - _AMBIGUOUS_SHOWN
        raise _CommandError(
            f"id prefix {prefix!r} is ambiguous in {_store_name(config)}: it matches "
            f"{len(matches)} records ({shown}{f', and {more} more' if more > 0 else ''}); "
            "give more characters"
        )
    return matches[0]


def _dlq_replay(args: argparse.Namespace) -> int:
    from npu_sync._pool import WorkerPool

    config = _dlq_config(args)
    with contextlib.ExitStack() as resources:
        store = _open_dlq(config)
        # Closing twice is harmless: the pool closes the store it was given, too.
        resources.callback(store.close)
        if args.id is not None:
            args.id = _resolve_id(store, args.id, config)
        if len(store) == 0:
            print(f"no dead letters to replay in {_store_name(config)}")
            return EXIT_OK
        # Replays are a handful of tasks run now: no health thread to start and stop.
        quiet = dataclasses.replace(
            config, health=dataclasses.replace(config.health, enabled=False)
        )
        pool = resources.enter_context(WorkerPool(quiet, dead_letter_store=store))
        try:
            report = pool.dead_letters.replay(args.id)
        except KeyError:  # removed since the check above, by another replay or a purge
            raise _CommandError(
                f"no dead letter with id {args.id!r} in {_store_name(config)}", EXIT_FAILURE
            ) from None
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        total = len(report.succeeded) + len(report.failed) + len(report.rejected)
        print(
            f"replayed {total} dead letter(s): {len(report.succeeded)} succeeded, "
            f"{len(report.failed)} failed, {len(report.rejected)} rejected"
        )
        for outcome, ids in (
            ("succeeded", report.succeeded),
            ("failed", report.failed),
            ("rejected", report.rejected),
        ):
            for record_id in ids:
                # Ids come from the store, which an older version or another tool wrote.
                print(f"{outcome:<9}  {printable(record_id)}")
    return EXIT_FAILURE if report.failed or report.rejected else EXIT_OK


def _dlq_purge(args: argparse.Namespace) -> int:
    config = _dlq_config(args)
    store = _open_dlq(config)
    try:
        count = len(store)
        if count == 0:
            print(f"no dead letters to purge in {_store_name(config)}")
            return EXIT_OK
        if not args.yes:
            if not sys.stdin.isatty():
                raise _CommandError(
                    f"refusing to purge {count} record(s) without confirmation: stdin is "
                    "not a terminal (pass --yes)"
                )
            if not _confirm(f"purge {count} record{'s' if count != 1 else ''}? [y/N] "):
                print("not purged")
                return EXIT_FAILURE
        removed = store.purge()
    finally:
        store.close()
    print(f"purged {removed} record(s) from {_store_name(config)}")
    return EXIT_OK


def _confirm(prompt: str) -> bool:
    try:
        answer = input(prompt)
    except EOFError:
        return False
    return answer.strip().lower() in ("y", "yes")


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _truncate(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
