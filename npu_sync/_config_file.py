"""Reading a configuration file safely and parsing its YAML strictly.

Only a regular file of at most ``MAX_FILE_BYTES`` is read; the YAML loader refuses
duplicate keys (PyYAML would keep the last silently), nesting deeper than ``MAX_DEPTH``
and more than ``MAX_NODES`` nodes, merge keys included.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from typing import Any, Final

import yaml

from npu_sync._config_reader import (
    _EXPECTED_TOP,
    parse_config,
)
from npu_sync._config_types import (
    MAX_DEPTH,
    MAX_FILE_BYTES,
    MAX_NODES,
    PoolConfig,
)
from npu_sync.errors import ConfigError

logger = logging.getLogger(__name__)


def read_config_text(path: str | os.PathLike[str]) -> str:
    """The text of a configuration file.

    Only a regular file (or a symlink to one) is read, and at most
    :data:`MAX_FILE_BYTES` of it: a FIFO, a device or a directory is refused at once,
    without opening it, rather than blocking the caller or the reload thread.

    Raises:
        ConfigError: the file cannot be read, is not a regular file, is too large or
            is not UTF-8.
    """
    name = os.fspath(path)
    source = os.path.abspath(name)

    def fail(problem: str) -> ConfigError:
        return ConfigError(f"cannot read {name}: {problem}", source=source)

    try:
        info = os.stat(name)
        if not stat.S_ISREG(info.st_mode):
            raise fail(f"not a regular file ({_file_kind(info.st_mode)})")
        # O_NONBLOCK: should the path be swapped for a FIFO after the stat above, the
        # open returns at once instead of waiting for a writer; fstat then refuses it.
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
        fd = os.open(name, flags)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise fail(f"not a regular file ({_file_kind(info.st_mode)})")
            data = _read_at_most(fd, MAX_FILE_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as exc:
        raise fail(exc.strerror or str(exc)) from None
    if len(data) > MAX_FILE_BYTES:
        raise fail(f"larger than {MAX_FILE_BYTES} bytes; a configuration is a few kilobytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise fail(f"not UTF-8 text (byte {exc.start})") from None


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = os.read(fd, min(65536, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _file_kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    for test, kind in kinds:
        if test(mode):
            return kind
    return "not a file"


def parse_yaml(text: str, *, source: str) -> PoolConfig:
    """Validate the YAML text of the configuration file at ``source``.

    Reloads read the file once, hash those bytes and parse them with this, so the
    configuration applied is exactly the content that was compared.

    Raises:
        ConfigError: the text is not valid YAML or fails validation.
    """
    name = source
    if len(text) > MAX_FILE_BYTES:
        raise ConfigError(
            f"{name} is larger than {MAX_FILE_BYTES} characters; a configuration is a few "
            "kilobytes",
            source=source,
        )
    loader: _StrictLoader | _FastStrictLoader | None = None
    try:
        # The reader checks every character as the loader is built: inside the try.
        try:
            loader = _FastStrictLoader(text) if yaml.__with_libyaml__ else _StrictLoader(text)
            data = loader.get_single_data()
        except yaml.MarkedYAMLError as exc:
            if not isinstance(loader, _FastStrictLoader) or "nesting" not in str(exc.problem):
                raise
            # libyaml stops at 1,000 levels while scanning ahead, before the composer's
            # limit of 32 could name where: PyYAML's own parser gets that far and says.
            loader.dispose()
            loader = _StrictLoader(text)
            data = loader.get_single_data()
    except _TooLarge as exc:
        raise ConfigError(str(exc), source=source) from None
    except RecursionError:
        # Kept for safety: the depth limit above is meant to make this unreachable.
        raise ConfigError(f"nested deeper than {MAX_DEPTH} levels", source=source) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = exc.problem or exc.context or "invalid YAML"
        raise ConfigError(f"YAML syntax error{where}: {problem}", source=source) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"YAML error: {' '.join(str(exc).split())}", source=source) from None
    except ValueError as exc:
        # PyYAML's constructors raise plain ValueError for a date such as 2024-13-01,
        # a float tag on a non-number, or an integer of more than 4300 digits. What
        # follows a colon quotes the value (int('...')), which may be a credential.
        problem = " ".join(str(exc).split()).partition(": ")[0]
        raise ConfigError(f"YAML error: {problem}", source=source) from None
    except (KeyError, AttributeError, TypeError):
        # Others fail outright on a value their explicit tag cannot hold (!!bool maybe,
        # !!timestamp soon), naming the value if anything.
        raise ConfigError(
            "YAML error: a value does not fit its explicit tag (such as !!bool or !!timestamp)",
            source=source,
        ) from None
    finally:
        if loader is not None:
            loader.dispose()
    if loader.duplicates:
        raise ConfigError(sorted(loader.duplicates), source=source)
    if data is None:
        raise ConfigError(f"{name} is empty: {_EXPECTED_TOP}", source=source)
    config = parse_config(data, source=source, base_dir=os.path.dirname(source))
    logger.debug("loaded %d worker(s) from %s", len(config.workers), source)
    return config


class _TooLarge(Exception):
    """The document is nested too deeply or has too many nodes."""


_MERGE_TAG: Final = "tag:yaml.org,2002:merge"
_SURROGATE: Final = re.compile("[\ud800-\udfff]")


class _StrictChecks(yaml.composer.Composer, yaml.constructor.SafeConstructor):
    """``yaml.safe_load`` with duplicate keys reported and the document's size bounded.

    PyYAML keeps the last of two equal keys without a word: a file with ``workers:``
    twice silently loses the first list. Keys are checked as mappings are composed,
    where the path to each is known; nesting is bounded there too, before PyYAML's
    recursive composer could exhaust the interpreter's stack, and so are the pairs
    merge keys copy, before they are copied.
    """

    def _start(self) -> None:
        self.duplicates: list[str] = []
        self._path: list[str] = []
        self._depth = 0
        self._nodes = 0
        self._merged = 0
        # Pairs each flattened mapping stands for, merges expanded; nodes live as long
        # as the loader, so their ids stay theirs.
        self._expanded: dict[int, int] = {}

    # The signatures follow types-PyYAML's stubs; at run time index is a key node or
    # an int, and anchor a string or None.
    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise _TooLarge(f"more than {MAX_NODES} YAML nodes; a configuration has far fewer")
        self._depth += 1
        if self._depth > MAX_DEPTH:
            where = _join_path(self._path) or "the document"
            if len(where) > 60:
                where = where[:57] + "..."
            raise _TooLarge(f"{where}: nested deeper than {MAX_DEPTH} levels")
        key: object = index
        if isinstance(key, yaml.ScalarNode):
            self._path.append(str(key.value))
        elif isinstance(key, int):
            self._path.append(f"[{index}]")
        else:
            self._path.append("")  # the document itself, or a mapping's key
        try:
            return super().compose_node(parent, index)
        finally:
            self._path.pop()
            self._depth -= 1

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        # A merge key (<<) copies the merged mapping's pairs into this one, and a merged
        # mapping may merge others in turn: 600 bytes of "<<: [*a, *a, ...]" nested a few
        # levels deep expand to billions of pairs. Count the pairs the merges name before
        # PyYAML copies them; each merged mapping is flattened (and counted) first, once.
        # The count is the merge as YAML 1.1 writes it, every alias copied in full, not
        # what a given PyYAML keeps: 6.0.4 drops repeated keys while it copies, earlier
        # versions copy them all, and such a file is refused for its size under either.
        if id(node) in self._expanded:
            return  # its merge keys are gone already: nothing left to copy
        merged = 0
        own = 0
        for key, value in node.value:
            if key.tag != _MERGE_TAG:
                own += 1
                continue
            sources = value.value if isinstance(value, yaml.SequenceNode) else [value]
            for source in sources:
                if isinstance(source, yaml.MappingNode):
                    self.flatten_mapping(source)
                    merged += self._expanded[id(source)]
        self._merged += merged
        if self._merged > MAX_NODES:
            raise _TooLarge(
                f"merge keys (<<) copy more than {MAX_NODES} YAML nodes; a configuration "
                "has far fewer"
            )
        super().flatten_mapping(node)
        self._expanded[id(node)] = own + merged

    def compose_mapping_node(self, anchor: dict[Any, yaml.Node]) -> yaml.MappingNode:
        node = super().compose_mapping_node(anchor)
        seen: dict[tuple[str, str], yaml.Mark] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == _MERGE_TAG:
                continue
            first = seen.get((key.tag, key.value))
            if first is None:
                seen[(key.tag, key.value)] = key.start_mark
                continue
            again = key.start_mark
            where = f"lines {first.line + 1} and {again.line + 1}"
            if first.line == again.line:
                where = f"line {again.line + 1}, columns {first.column + 1} and {again.column + 1}"
            path = _join_path([*self._path, str(key.value)])
            self.duplicates.append(
                f"{path}: duplicate key ({where}); YAML would silently keep only the last one"
            )
        return node


class _StrictLoader(_StrictChecks, yaml.SafeLoader):
    """The checks on PyYAML's pure-Python scanner and parser."""

    def __init__(self, text: str) -> None:
        yaml.SafeLoader.__init__(self, text)
        self._start()

    def scan_flow_scalar_non_spaces(self, double: bool, start_mark: yaml.Mark) -> list[str]:
        # An escape naming no character (a lone surrogate, beyond U+10FFFF) is refused
        # as libyaml refuses it, not read as a string nothing can encode or a bare
        # ValueError: both parsers accept the same files.
        try:
            chunks: list[str] = super().scan_flow_scalar_non_spaces(double, start_mark)
            if not any(_SURROGATE.search(chunk) for chunk in chunks):
                return chunks
        except ValueError:
            pass
        raise yaml.scanner.ScannerError(
            "while scanning a double-quoted scalar",
            start_mark,
            "found invalid Unicode character escape code",
            self.get_mark(),
        )


if yaml.__with_libyaml__:
    from yaml._yaml import CParser as _CParser
else:  # pragma: no cover - PyYAML built without libyaml: parse_yaml never builds the class
    _CParser = yaml.parser.Parser  # type: ignore[assignment,misc]


class _FastStrictLoader(_StrictChecks, _CParser, yaml.resolver.Resolver):
    """The checks on libyaml's scanner and parser, with PyYAML's own composer (listed
    before the parser, so the checks run on every node as it is composed).

    Scanning and parsing are where PyYAML spends its time: in C, a file refused for its
    size (100,000 nodes in under a megabyte) costs a fifth of the CPU it costs in
    Python, time a reload would otherwise take from the pool's threads.
    """

    def __init__(self, text: str) -> None:
        _CParser.__init__(self, text)
        yaml.composer.Composer.__init__(self)
        yaml.constructor.SafeConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)
        self._start()


def _join_path(parts: list[str]) -> str:
    out = ""
    for part in parts:
        if not part:
            continue
        out = out + part if part.startswith("[") or not out else f"{out}.{part}"
    return out
