"""Without an optional package, a configuration or module that needs it says which extra
to install, instead of failing later with a bare ModuleNotFoundError."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Hides the named packages from every import and look-up, as if they were not installed.
HIDE = textwrap.dedent(
    """
    import importlib.abc, sys

    class Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in {hidden!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, Hide())
    """
)


def run_without(hidden: set[str], code: str, tmp_path: Path) -> dict[str, object]:
    script = HIDE.format(hidden=sorted(hidden)) + textwrap.dedent(code)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
        check=True,
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_check_names_the_redis_extra_when_redis_is_missing(tmp_path):
    """`npu-sync check` refuses shared_state.backend: redis without the redis package,
    naming the key and the install that works from a clone; the file otherwise loads."""
    (tmp_path / "npu.yaml").write_text(
        "npu_workers:\n"
        "  workers: [{id: a, url: 'http://127.0.0.1:9'}]\n"
        "  shared_state: {backend: redis, url: 'redis://127.0.0.1:6379/0'}\n"
    )
    (tmp_path / "plain.yaml").write_text(
        "npu_workers:\n  workers: [{id: a, url: 'http://127.0.0.1:9'}]\n"
    )
    result = run_without(
        {"redis"},
        """
        import contextlib, io, json
        from npu_sync.cli import main
        codes, outs = [], []
        for name in ("npu.yaml", "plain.yaml"):
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                codes.append(main(["check", name]))
            outs.append(out.getvalue())
        print(json.dumps({"codes": codes, "out": outs[0]}))
        """,
        tmp_path,
    )
    assert result["codes"] == [2, 0]  # 2: the file is invalid
    out = str(result["out"])
    assert "shared_state.backend: 'redis' needs the redis package" in out
    assert "pip install -e '.[redis]'" in out
    assert "ModuleNotFoundError" not in out


def test_importing_the_flask_extension_names_the_flask_extra(tmp_path):
    """`import npu_sync.flask` without Flask raises ImportError naming the extra."""
    result = run_without(
        {"flask", "werkzeug"},
        """
        import json
        try:
            import npu_sync.flask
        except ImportError as exc:
            print(json.dumps({"error": str(exc)}))
        else:
            print(json.dumps({"error": None}))
        """,
        tmp_path,
    )
    assert str(result["error"]).startswith("npu_sync.flask needs Flask: pip install -e '.[flask]'")
