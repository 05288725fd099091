"""The worker as a program: its command-line flags, and serving until a signal."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

from npu_sync.worker_server._behaviour import WorkerBehaviour, check_number
from npu_sync.worker_server._models import PROTOCOLS
from npu_sync.worker_server._server import WorkerServer

HMAC_SECRET_ENV = "NPU_SYNC_WORKER_HMAC_SECRET"
"""Where ``npu-sync worker --hmac-service-id`` reads the HMAC secret by default."""


def _non_negative(text: str) -> float:
    try:
        return check_number("value", float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None


def _rate(text: str) -> float:
    try:
        return check_number("value", float(text), upper=1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535, got {text!r}")
    return value


def build_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the worker's command-line flags to ``parser`` (a new one when None).

    Returns:
        The parser.
    """
    if parser is None:
        parser = argparse.ArgumentParser(
            prog="python -m npu_sync.worker_server",
            description="Run a simulated NPU worker that speaks the npu_sync worker protocol.",
        )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    parser.add_argument(
        "--port",
        type=_port,
        default=8081,
        help="port to bind; 0 picks a free one (default %(default)s)",
    )
    parser.add_argument(
        "--worker-id", default=None, help="id reported in answers (default: worker-<port>)"
    )
    parser.add_argument(
        "--latency-ms",
        type=_non_negative,
        default=0.0,
        metavar="MS",
        help="simulated latency per task, in milliseconds (default %(default)g)",
    )
    parser.add_argument(
        "--jitter-ms",
        type=_non_negative,
        default=0.0,
        metavar="MS",
        help="uniform +/- jitter on the latency, in milliseconds (default %(default)g)",
    )
    parser.add_argument(
        "--failure-rate",
        type=_rate,
        default=0.0,
        metavar="P",
        help="probability, 0 to 1, that a task answers a simulated 500 (default %(default)g)",
    )
    parser.add_argument(
        "--health-status",
        default="healthy",
        help="status reported by /health (default %(default)s)",
    )
    parser.add_argument(
        "--models",
        default="default",
        help='comma-separated model ids loaded at start; "*" loads any model on first use '
        "(default %(default)s)",
    )
    parser.add_argument(
        "--max-models",
        type=int,
        default=None,
        metavar="N",
        help="the most models loaded at once; a load beyond answers 507 (default: no limit)",
    )
    parser.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="linux",
        help="which AutoBot worker to simulate; AutoBot's Windows worker listens on 8082 "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--load-delay-ms",
        type=_non_negative,
        default=0.0,
        metavar="MS",
        help="time loading a model takes, in milliseconds (default %(default)g)",
    )
    parser.add_argument(
        "--no-npu",
        dest="npu_available",
        action="store_false",
        help="report npu_available: false, as a worker fallen back to CPU "
        "(default: the NPU is available)",
    )
    parser.add_argument(
        "--hmac-service-id",
        default=None,
        metavar="ID",
        help="require AutoBot HMAC-signed requests from this service id; the secret is "
        "read from the environment variable named by --hmac-secret-env (default: no check)",
    )
    parser.add_argument(
        "--hmac-secret-env",
        default=HMAC_SECRET_ENV,
        metavar="VAR",
        help="environment variable holding the HMAC secret (default %(default)s)",
    )
    parser.add_argument(
        "--bearer-token-env",
        default=None,
        metavar="VAR",
        help="require 'Authorization: Bearer <token>' with the token read from this "
        "environment variable (default: no check)",
    )
    parser.add_argument(
        "--max-concurrent",
        type=_positive_int,
        default=8,
        metavar="N",
        help="load hint reported by /health, in tasks (default %(default)s)",
    )
    parser.add_argument(
        "--slots",
        type=_positive_int,
        default=None,
        metavar="N",
        help="run at most N tasks at once and queue the rest, as an NPU with N parallel "
        "slots (default: no limit)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed for jitter and failures (default: a fresh one each run)",
    )
    parser.add_argument(
        "--tls-cert", default=None, help="PEM certificate (chain); serves HTTPS (default: HTTP)"
    )
    parser.add_argument(
        "--tls-key", default=None, help="PEM private key (default: read from --tls-cert)"
    )
    parser.add_argument(
        "--tls-client-ca",
        default=None,
        help="PEM CA bundle; require client certificates (default: none required)",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="log every request to stderr (default: off)"
    )
    return parser


class _StopServing(Exception):
    """Raised by the signal handler to leave the wait in serve()."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    # Raising, rather than setting an Event, cannot deadlock on a lock the interrupted
    # main thread already holds.
    raise _StopServing(signum)


def serve(args: argparse.Namespace, *, stop: threading.Event | None = None) -> int:
    """Run a worker until SIGTERM or SIGINT (or ``stop`` is set), then stop it gracefully.

    Prints one line to stdout once it accepts connections:
    ``npu-sync worker <worker_id> listening on <scheme>://<host>:<port>``.

    Args:
        args: parsed by a parser from :func:`build_arg_parser`.
        stop: an event that also ends serving (for embedding in other threads).

    Returns:
        The exit code: 0 after a graceful stop, 1 when the worker could not start,
        2 on invalid arguments.
    """
    models = tuple(m.strip() for m in str(args.models).split(",") if m.strip())
    try:
        hmac_auth = bearer = None
        # Secrets come from the environment: a command line is visible to every user.
        if args.hmac_service_id is not None:
            secret = os.environ.get(args.hmac_secret_env)
            if not secret:
                raise ValueError(
                    f"--hmac-service-id needs the secret in ${args.hmac_secret_env}, "
                    "which is unset or empty"
                )
            hmac_auth = (args.hmac_service_id, secret)
        if args.bearer_token_env is not None:
            bearer = os.environ.get(args.bearer_token_env)
            if not bearer:
                raise ValueError(f"${args.bearer_token_env} (the bearer token) is unset or empty")
        behaviour = WorkerBehaviour(
            latency_ms=args.latency_ms,
            jitter_ms=args.jitter_ms,
            failure_rate=args.failure_rate,
            health_status=args.health_status,
            npu_available=args.npu_available,
            load_delay_ms=args.load_delay_ms,
            max_models=args.max_models,
        )
        server = WorkerServer(
            args.host,
            args.port,
            worker_id=args.worker_id or f"worker-{args.port}",
            models=models,
            max_concurrent=args.max_concurrent,
            behaviour=behaviour,
            seed=args.seed,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
            verbose=args.verbose,
            protocol=args.protocol,
            hmac_auth=hmac_auth,
            bearer_token=bearer,
            slots=args.slots,
        )
    except ValueError as exc:
        print(f"npu-sync worker: {exc}", file=sys.stderr)
        return 2
    stop = stop or threading.Event()
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.Signals.SIGTERM, signal.Signals.SIGINT):
            previous[signum] = signal.signal(signum, _raise_stop)
    try:
        try:
            server.start()
        except (OSError, RuntimeError) as exc:
            print(
                f"npu-sync worker: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr
            )
            return 1
        print(f"npu-sync worker {server.worker_id} listening on {server.url}", flush=True)
        stop.wait()
    except _StopServing:
        pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        server.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m npu_sync.worker_server``; returns the exit code."""
    args = build_arg_parser().parse_args(None if argv is None else list(argv))
    return serve(args)
