"""Install hints work from a clone: npu_sync is not on PyPI, so no message, docstring,
doc or README line tells anyone to ``pip install`` it by name (``npu_sync[prometheus]``
fails, or installs whatever someone published under that name)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_PIP_INSTALL = re.compile(r"\bpip[x3]?\s+install\b")
# A requirement by name: npu_sync / npu-sync / npu.sync, with extras or a version or not.
_BY_NAME = re.compile(r"npu[-_.]sync\s*(\[[^\]]*\])?\s*((==|>=|<=|~=|!=|<|>)\S*)?", re.I)
# What ends a command written in text: a code span, a shell separator, a comment, the end
# of a fenced line or of a paragraph (both marked with \0 by _fold).
_COMMAND_END = re.compile(r"[`;&|#\x00]")
_QUOTES = "'\"`"
# Words that end a command in prose: "pip install -e . from the root of a clone of npu_sync".
_PROSE = frozenset({"a", "an", "and", "for", "from", "if", "in", "into", "on", "or", "see"})
_PROSE |= {"the", "then", "to", "which", "with"}
_TRAILING = ".,:;)}"


def _fold(text: str, markdown: bool) -> str:
    """The text with each newline that ends a command replaced by \\0, same length.

    A fenced code line ends its command (unless continued with a backslash); in prose and
    in Python sources a command may wrap onto the next line (or the next string literal),
    but not past a blank line.
    """
    out = []
    fenced = False
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        if markdown and body.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            ends = True
        else:
            ends = not body.strip() or (fenced and not body.endswith("\\"))
        if ends and line != body:
            line = body + "\x00" * (len(line) - len(body))
        out.append(line)
    return "".join(out)


def bare_installs(text: str, markdown: bool = False) -> list[tuple[int, str]]:
    """Every ``pip install`` of npu_sync by name in text, as (line, requirement).

    Paths (``-e '.[prometheus]'``, ``dist/npu_sync-0.1.0-py3-none-any.whl[redis]``) and
    other packages pass.
    """
    folded = _fold(text, markdown)
    found = []
    for pip in _PIP_INSTALL.finditer(folded):
        end = _COMMAND_END.search(folded, pip.end())
        command = folded[pip.end() : end.start() if end else len(folded)]
        for word in re.finditer(r"\S+", command):
            if word.group().lower() in _PROSE or word.group().startswith("("):
                break
            token = word.group().strip(_QUOTES).rstrip(_TRAILING).strip(_QUOTES)
            if _BY_NAME.fullmatch(token):
                offset = pip.end() + word.start()
                found.append((text.count("\n", 0, offset) + 1, token))
            if len(word.group()) > 1 and word.group().rstrip(_QUOTES).endswith((".", ",")):
                break  # the end of a sentence
    return found


def scanned_files() -> list[Path]:
    package = sorted(p for p in (ROOT / "npu_sync").rglob("*") if p.is_file())
    texts = [p for p in package if p.suffix in {".py", ".md", ".html", ".txt", ".cfg", ".toml"}]
    return [*texts, *sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]


def test_no_install_hint_names_npu_sync_as_a_package_index_requirement():
    """No source, static file, doc or README line says pip install npu_sync[...] by name;
    each offender is named as file:line."""
    files = scanned_files()
    names = {p.relative_to(ROOT).as_posix() for p in files}
    # The files that carry install hints are scanned (a broken glob must not pass).
    assert {"npu_sync/flask.py", "npu_sync/prometheus.py", "docs/flask.md", "README.md"} <= names
    offenders = [
        f"{path.relative_to(ROOT).as_posix()}:{line}: pip install {requirement}"
        for path in files
        for line, requirement in bare_installs(path.read_text(), markdown=path.suffix == ".md")
    ]
    assert not offenders, (
        "npu_sync is not on PyPI: say pip install -e '.[extra]' from the clone's root, or "
        "the built wheel (README.md, Installing):\n" + "\n".join(offenders)
    )


FENCED_BY_NAME = "```\npip install -q NPU_SYNC[flask,redis] && npu-sync demo\n```"


@pytest.mark.parametrize(
    ("text", "markdown", "expected"),
    [
        ("pip install npu_sync", False, [(1, "npu_sync")]),
        ("run `pip install 'npu_sync[prometheus]'`", True, [(1, "npu_sync[prometheus]")]),
        ('"hint: pip install "\n    "\'npu_sync[x]\'"', False, [(2, "npu_sync[x]")]),
        ("x\n`python -m pip install -U npu-sync==0.1.0`.", True, [(2, "npu-sync==0.1.0")]),
        ('{"error": "need it:\npip install \'npu_sync[x]\'"}', True, [(2, "npu_sync[x]")]),
        (FENCED_BY_NAME, True, [(2, "NPU_SYNC[flask,redis]")]),
        ("pip install -e '.[prometheus]'", False, []),
        ("pip install 'dist/npu_sync-0.1.0-py3-none-any.whl[redis]'", False, []),
        ("pip install -e . && npu-sync demo", False, []),
        ("```\npip install -e '.[flask]'\nnpu-sync check npu_workers.yaml\n```", True, []),
        ("pip install -e .\n\nnpu_sync is a library", True, []),
        ("install it with pip install -e ., then npu_sync imports", True, []),
        ("pip install -e '.[x]' from the root of a clone of npu_sync, or", False, []),
        ("pip install -e '.[x]' (in npu_sync's clone)", True, []),
        ("pip install prometheus_client", False, []),
    ],
)
def test_the_scan_finds_installs_by_name_and_lets_paths_through(text, markdown, expected):
    """Installs by name are found in code spans, wrapped prose, concatenated literals and
    JSON; editable paths, wheels, other packages and the npu-sync command are not."""
    assert bare_installs(text, markdown) == expected
