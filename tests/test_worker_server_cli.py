"""Tests of the reference worker's command line: its flags, their defaults and checks,
and serve() refusing what it cannot run."""

from __future__ import annotations

import pytest

from npu_sync.worker_server import build_arg_parser


def test_arg_parser_reads_every_flag() -> None:
    """build_arg_parser accepts every documented flag with the right types and defaults."""
    parser = build_arg_parser()
    defaults = parser.parse_args([])
    assert (defaults.host, defaults.port, defaults.models) == ("127.0.0.1", 8081, "default")
    argv = [
        "--host", "127.0.0.1", "--port", "0", "--worker-id", "w",
        "--latency-ms", "5", "--jitter-ms", "1.5", "--failure-rate", "0.25",
        "--health-status", "sick", "--models", "a,*", "--max-concurrent", "4", "--seed", "3",
        "--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem",
        "--verbose",
    ]  # fmt: skip
    args = parser.parse_args(argv)
    assert args.port == 0 and args.worker_id == "w"
    assert (args.latency_ms, args.jitter_ms, args.failure_rate) == (5.0, 1.5, 0.25)
    assert (args.health_status, args.models, args.max_concurrent, args.seed) == (
        "sick",
        "a,*",
        4,
        3,
    )
    assert (args.tls_cert, args.tls_key, args.tls_client_ca, args.verbose) == (
        "c.pem",
        "k.pem",
        "ca.pem",
        True,
    )


@pytest.mark.parametrize(
    "argv", [["--failure-rate", "1.5"], ["--latency-ms", "-1"], ["--port", "70000"]]
)
def test_arg_parser_rejects_bad_values(argv: list[str]) -> None:
    """Out-of-range flag values are usage errors."""
    with pytest.raises(SystemExit):
        build_arg_parser().parse_args(argv)


def test_help_gives_every_option_a_default() -> None:
    """'worker --help' states a default for every option, and units for the timings."""
    from npu_sync.worker_server import build_arg_parser

    parser = build_arg_parser()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert "default" in (action.help or ""), action.option_strings
    text = " ".join(parser.format_help().split())
    assert "--latency-ms MS simulated latency per task, in milliseconds (default 0)" in text
    assert "in milliseconds (default 0)" in text.split("--jitter-ms MS", 1)[1]
    assert "port to bind; 0 picks a free one (default 8081)" in text


def test_arg_parser_reads_the_protocol_model_and_auth_flags() -> None:
    """--protocol, --load-delay-ms, --no-npu and the auth flags parse, with defaults."""
    parser = build_arg_parser()
    defaults = parser.parse_args([])
    assert (defaults.protocol, defaults.load_delay_ms, defaults.npu_available) == (
        "linux",
        0.0,
        True,
    )
    assert (defaults.hmac_service_id, defaults.bearer_token_env) == (None, None)
    assert defaults.hmac_secret_env == "NPU_SYNC_WORKER_HMAC_SECRET"
    args = parser.parse_args(
        ["--protocol", "windows", "--load-delay-ms", "250", "--no-npu",
         "--hmac-service-id", "svc", "--hmac-secret-env", "S", "--bearer-token-env", "T"]
    )  # fmt: skip
    assert (args.protocol, args.load_delay_ms, args.npu_available) == ("windows", 250.0, False)
    assert (args.hmac_service_id, args.hmac_secret_env, args.bearer_token_env) == ("svc", "S", "T")
    with pytest.raises(SystemExit):
        parser.parse_args(["--protocol", "grpc"])


def test_serve_refuses_hmac_without_its_secret(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--hmac-service-id with the secret variable unset exits 2 naming the variable."""
    from npu_sync.worker_server import serve

    monkeypatch.delenv("NO_SUCH_SECRET", raising=False)
    args = build_arg_parser().parse_args(
        ["--port", "0", "--hmac-service-id", "svc", "--hmac-secret-env", "NO_SUCH_SECRET"]
    )
    assert serve(args) == 2
    assert "$NO_SUCH_SECRET" in capsys.readouterr().err
