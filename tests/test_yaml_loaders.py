"""libyaml's parser under the strict checks reads every file as PyYAML's own parser does:
same data, same duplicates, same refusals; only the cost differs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from npu_sync import _config_file
from npu_sync.config import parse_yaml
from npu_sync.errors import ConfigError

pytestmark = pytest.mark.skipif(not yaml.__with_libyaml__, reason="PyYAML without libyaml")

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"^```yaml\n(.*?)^```$", re.S | re.M)

TRICKY = [
    "a: &x {k: 1}\nb: {<<: *x, j: 2}\n",
    "a: &x {k: 1}\nb:\n  <<: [*x, {k: 3, m: 4}]\n  k: 9\n",
    "workers: 1\nworkers: 2\n",
    "a:\n  b: 1\n  b: 2\nc: [1, 2, {d: 1, d: 2}]\n",
    "x: 'quoted: ${ENV}'\ny: \"esc \\t \\u00e9\"\nz: |\n  block\n  text\n",
    "n: [0x1f, 0o17, 1_000, .inf, -.nan, ~, null, yes, No, 2024-01-02]\n",
    "? complex key\n: value\n",
    "---\na: 1\n...\n",
    "",
    "# only a comment\n",
    # Byte order mark, CRLF line ends, a duplicate found across them.
    "\ufeffa: 1\r\nb: {c: 2}\r\n",
    "\ufeffx:\r\n  a: 1\r\n  a: 2\r\n",
    "{\u00e9: 1, \u00e9: 2}\n",
    # Escapes, odd line breaks, tags.
    'a: "\\U0001F600 \\x85 \\N \\_ \\L \\P \\/ \\e \\0 \\t"\n',
    "a: 'x\u2029y'\nb: x\ufeffy\n",
    "a: !!binary aGVsbG8=\nb: !!binary |\n  aGVs\n  bG8=\n",
    "a: !<tag:yaml.org,2002:str> 1\nb: !!str\n",
    "- &a a\n- *a\n- &a b\n- *a\n",
    # A duplicate inside a merged mapping, and one beside a merge.
    "a: &x {k: 1, k: 2}\nb: {<<: *x, j: 1, j: 2}\n",
    "a: &x {k: 1}\nb: {<<: [*x, *x], k: 2}\n",
    # Long scalars and keys (a simple key stops at 1024 characters in both).
    "a: " + "v" * 200_000 + "\n",
    "k" * 1100 + ": 1\n",
]
BROKEN = [
    "a: [1, 2\n",
    "a: b: c\n",
    "\tkey: tab-indented\n",
    "a: *nowhere\n",
    "a: !!python/object:os.system {}\n",
    "- a\nb: c\n",
    "a: '\x07'\n",
    "a: 1\n\x00",
    "a: \x85b\x7f\n",
    "---\na: &x 1\n---\nb: *x\n",
    "a: 1\n\ufeff---\nb: 2\n",
    '"a": "\\U00110000"\n',
    # A lone surrogate is no character: libyaml refuses the escape, so must the other.
    'a: "\\ud800"\n',
    'a: "\\uDC00 \\uD83D"\n',
]


def load(loader_class: type, text: str) -> tuple[str, Any, list[str]]:
    loader = None
    try:
        loader = loader_class(text)  # the reader checks characters as it is built
        return "ok", loader.get_single_data(), sorted(loader.duplicates)
    except yaml.YAMLError as exc:
        return "error", type(exc).__mro__[1].__name__, []
    finally:
        if loader is not None:
            loader.dispose()


def documented_yaml() -> list[str]:
    return [
        m.group(1) for path in sorted(DOCS.glob("*.md")) for m in BLOCK.finditer(path.read_text())
    ]


@pytest.mark.parametrize("text", TRICKY + documented_yaml())
def test_both_parsers_read_the_same_data_and_duplicates(text):
    """Anchors, merges, duplicates, tags, scalars and every YAML block of the docs."""
    fast = load(_config_file._FastStrictLoader, text)
    pure = load(_config_file._StrictLoader, text)
    assert fast == pure


@pytest.mark.parametrize("text", BROKEN)
def test_both_parsers_refuse_the_same_broken_files(text):
    """A file either parser refuses, the other refuses too."""
    assert load(_config_file._FastStrictLoader, text)[0] == "error"
    assert load(_config_file._StrictLoader, text)[0] == "error"


def test_a_configuration_is_read_without_pythons_scanner(monkeypatch):
    """With libyaml, PyYAML's pure-Python scanner never runs: the costly part is in C."""
    scanned = []
    real = yaml.scanner.Scanner.fetch_more_tokens

    def counting(self):
        scanned.append(1)
        return real(self)

    monkeypatch.setattr(yaml.scanner.Scanner, "fetch_more_tokens", counting)
    config = parse_yaml(
        "npu_workers:\n  workers:\n    - {id: a, url: 'http://127.0.0.1:9'}\n", source="/x.yaml"
    )
    assert [w.id for w in config.workers] == ["a"] and scanned == []
    deep = "npu_workers:\n  workers: " + "[" * 2000 + "]" * 2000 + "\n"
    with pytest.raises(ConfigError, match="nested deeper than 32 levels"):
        parse_yaml(deep, source="/x.yaml")
    # Past the nesting limit some libyaml builds have (1,000 levels), PyYAML's own parser
    # names where the text is too deep; a libyaml without that limit hands the text to
    # the composer, whose depth check names it without the Python scanner.
    assert bool(scanned) == _libyaml_limits_nesting(deep)


def _libyaml_limits_nesting(text: str) -> bool:
    """Whether this machine's libyaml refuses ``text`` for its nesting."""
    try:
        yaml.load(text, Loader=yaml.CSafeLoader)
    except yaml.YAMLError as exc:
        return "nesting" in str(exc)
    return False


@pytest.mark.xfail(
    strict=True,
    reason="PyYAML's scanner refuses a tab before any token, where libyaml takes it for "
    "the blank YAML allows (after a value, in flow collections): a file with a trailing "
    "tab loads with libyaml and is refused without it. Agreeing means porting libyaml's "
    "tab rules into PyYAML's scanner (scan_to_next_token, plain scalars)",
)
@pytest.mark.parametrize(
    "text", ["a: 1\t\n", "a:\n  b: x\t# c\n", "a: {b: 1,\tc: 2}\n", "a: b\tc\n"]
)
def test_tabs_libyaml_allows_are_read_alike(text):
    """A tab where YAML allows blanks: both parsers read the same data."""
    assert load(_config_file._FastStrictLoader, text) == load(_config_file._StrictLoader, text)


@pytest.mark.xfail(
    strict=True,
    reason="libyaml skips a byte order mark at the start of any line before a token, "
    "PyYAML's reader only the first: a second one becomes part of the key",
)
def test_a_second_byte_order_mark_is_read_alike():
    """Two BOMs (a file saved twice by a BOM-adding editor): the same key in both."""
    text = "\ufeff\n\ufeffnpu_workers: 1\n"
    assert load(_config_file._FastStrictLoader, text) == load(_config_file._StrictLoader, text)


def test_a_duplicate_under_bom_and_crlf_names_its_key_path_and_lines():
    """The refusal of a duplicate key in a BOM, CRLF file names its path and both lines."""
    text = (
        "\ufeffnpu_workers:\r\n  workers:\r\n    - {id: a, url: 'http://127.0.0.1:9'}\r\n"
        "  health:\r\n    interval: 5\r\n    interval: 6\r\n"
    )
    with pytest.raises(
        ConfigError, match=r"npu_workers\.health\.interval: duplicate key \(lines 5 and 6\)"
    ):
        parse_yaml(text, source="/x.yaml")
