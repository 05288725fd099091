"""The configuration schema: every key declared once, on its dataclass field.

A config dataclass in :mod:`npu_sync.config` declares each field with one of the
helpers below (:func:`integer`, :func:`number`, :func:`boolean`, ...). The helper gives
the field its default and attaches a :class:`Spec`: the key's kind, bounds, a one-line
description, whether a reload applies it, and the AutoBot key it maps from. From that
one declaration:

- the YAML reader (``_config_reader._Reader``) reads and checks every plain key of a section;
- the constructors refuse out-of-range numbers (:func:`check_fields`);
- the key tables of ``docs/configuration.md`` are written from it
  (:mod:`npu_sync._config_docs`), and a test fails when the file and the schema disagree.

Run ``python tools/config_docs.py --write-docs`` after changing a key to rewrite the
tables, or ``--check`` to see whether they are current.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar, cast

from npu_sync.errors import ConfigError, scrub

__all__ = [
    "Range",
    "Spec",
    "boolean",
    "check_fields",
    "choice",
    "custom",
    "endpoint",
    "integer",
    "keys",
    "number",
    "optional_number",
    "section",
    "show",
    "specs",
]

SPEC: Final = "npu_sync.schema"
"""The key under which a field's :class:`Spec` sits in its ``dataclasses.field`` metadata."""

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Range:
    """The values a numeric key allows: ``lo..hi``, ``lo`` itself excluded when ``above``."""

    lo: float
    hi: float
    above: bool = False
    integer: bool = False

    def describe(self) -> str:
        if self.integer:
            return f"{bound(self.lo)}..{bound(self.hi)}"
        low = f"> {bound(self.lo)}" if self.above else f">= {bound(self.lo)}"
        return f"{low} and <= {bound(self.hi)}"

    def check(self, value: object) -> int | float | str:
        """``value`` if allowed (a float for a number key), else what is wrong with it.

        A problem reads as the start of a message, to be followed by ``, got <value>``.
        """
        if self.integer:
            if isinstance(value, bool) or not isinstance(value, int):
                return "must be an integer"
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            return "must be a number"
        elif isinstance(value, float) and not math.isfinite(value):
            return "must be a finite number"
        # Compared before any float(): an int too large for a float must not overflow.
        low_ok = value > self.lo if self.above else value >= self.lo
        if not (low_ok and value <= self.hi):
            return f"must be {self.describe()}"
        return value if self.integer else float(value)


@dataclass(frozen=True, slots=True)
class Spec:
    """How one key is read, checked and documented.

    ``kind`` is ``bool``, ``int``, ``number``, ``choice``, ``endpoint`` (a path starting
    with ``/``), ``section`` (a nested mapping read into its own dataclass) or ``custom``
    (read by code of its own in the reader; documented from the ``*_text`` fields).
    """

    kind: str
    doc: str
    limit: Range | None = None
    choices: tuple[str, ...] = ()
    # Whether a reload applies a change to the key (pool-level keys; workers always do).
    hot: bool = True
    # The AutoBot key it maps from, as docs/configuration.md writes it, and how.
    autobot: str = ""
    autobot_note: str = ""
    # More AutoBot keys that map to it, each with its note (AutoBot's files differ).
    autobot_also: tuple[tuple[str, str], ...] = ()
    # Documentation: the unit of a number, and overrides of the generated cells.
    unit: str = ""
    type_text: str = ""
    default_text: str = ""
    allowed_text: str = ""
    # A number key that may also be null (absent means the default, null means "none").
    nullable: bool = False
    # Cross-field rule: the value must be >= this other field of the same section.
    at_least: str = ""
    # The range the dataclass constructor accepts when it is wider than the YAML's (a
    # WorkerConfig holds the priority of either layout before tiers are assigned).
    code_limit: Range | None = None
    # Keys that stand in for this field in YAML (host, port and scheme make a url).
    inputs: tuple[tuple[str, Spec, object], ...] = ()
    # The nested dataclass of a ``section`` key.
    section: type | None = None


def _field(default: Any, spec: Spec) -> Any:
    return field(default=default, metadata={SPEC: spec})


def boolean(default: bool, doc: str, **options: Any) -> bool:
    """A ``true``/``false`` key."""
    return cast(bool, _field(default, Spec("bool", doc, **options)))


def integer(default: int, lo: int, hi: int, doc: str, **options: Any) -> int:
    """An integer key within ``lo..hi``, both included."""
    spec = Spec("int", doc, limit=Range(lo, hi, integer=True), **options)
    return cast(int, _field(default, spec))


def number(
    default: float, lo: float, hi: float, doc: str, *, above: bool = False, **options: Any
) -> float:
    """A finite number key in ``lo..hi`` (``lo`` excluded when ``above``), kept as a float."""
    return cast(float, _field(default, Spec("number", doc, limit=Range(lo, hi, above), **options)))


def optional_boolean(doc: str, **options: Any) -> bool | None:
    """A ``true``/``false`` key that defaults to None (``null`` in YAML) when not given."""
    return cast("bool | None", _field(None, Spec("bool", doc, nullable=True, **options)))


def optional_number(
    lo: float, hi: float, doc: str, *, above: bool = False, **options: Any
) -> float | None:
    """A number key that defaults to None (``null`` in YAML) when not given."""
    spec = Spec("number", doc, limit=Range(lo, hi, above), nullable=True, **options)
    return cast("float | None", _field(None, spec))


def choice(default: str, options_: tuple[str, ...], doc: str, **options: Any) -> str:
    """A string key that takes one of ``options_``."""
    return cast(str, _field(default, Spec("choice", doc, choices=options_, **options)))


def endpoint(default: str, doc: str, **options: Any) -> str:
    """A request path starting with ``/``."""
    return cast(str, _field(default, Spec("endpoint", doc, **options)))


def section(factory: Callable[[], _T], doc: str, **options: Any) -> _T:
    """A nested mapping read into the dataclass ``factory`` builds by default."""
    spec = Spec("section", doc, section=cast(type, factory), **options)
    return field(default_factory=factory, metadata={SPEC: spec})


def custom(
    default: Any, doc: str, *, factory: Callable[[], Any] | None = None, **options: Any
) -> Any:
    """A key the reader handles with code of its own; the spec documents it."""
    spec = Spec("custom", doc, **options)
    if factory is not None:
        return field(default_factory=factory, metadata={SPEC: spec})
    return _field(default, spec)


def specs(cls: type) -> Iterator[tuple[str, Spec, dataclasses.Field[Any]]]:
    """The declared keys of a config dataclass, in field order: (name, spec, field)."""
    for item in dataclasses.fields(cls):
        spec = item.metadata.get(SPEC)
        if spec is not None:
            yield item.name, spec, item


def default_of(item: dataclasses.Field[Any]) -> Any:
    """A field's default value, built afresh when it has a factory."""
    if item.default_factory is not dataclasses.MISSING:
        return item.default_factory()
    return None if item.default is dataclasses.MISSING else item.default


def check_fields(config: object, section_path: str) -> None:
    """Refuse a config built in code with a number the YAML reader would refuse.

    Raises:
        ConfigError: naming each bad field as ``<section_path>.<field>``.
    """
    problems = []
    for name, spec, _ in specs(type(config)):
        limit = spec.code_limit or spec.limit
        if limit is None:
            continue
        value = getattr(config, name)
        if value is None and spec.nullable:
            continue
        checked = limit.check(value)
        if isinstance(checked, str):
            problems.append(f"{section_path}.{name}: {checked}, got {show(value)}")
    if problems:
        raise ConfigError(problems)


def bound(value: float) -> str:
    """A limit as messages and docs write it: 86400, not 86400.0."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def show(value: object) -> str:
    """A value as an error message quotes it: YAML words for YAML types, short."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    try:
        # Scrubbed before it is cut: a cut before a URL's '@' would leave its password
        # for ConfigError's own scrub to miss.
        text = scrub(repr(value))
    except ValueError:  # an int beyond sys.get_int_max_str_digits()
        return "a very large integer"
    return text if len(text) <= 80 else text[:77] + "..."


# ---------------------------------------------------------------------------------------
# Reloads


@dataclass(frozen=True, slots=True)
class HotMerge:
    """What a reload does with a new configuration, by each key's ``hot`` declaration.

    ``config`` is the new configuration with every key that is not hot (``hot=False`` on
    the key or on a section above it) kept at its running value; ``cold`` names the keys
    a reload changed but cannot apply (they take effect on restart), ``hot`` those it
    applies, both as dotted paths.
    """

    config: Any
    cold: tuple[str, ...]
    hot: tuple[str, ...]


def hot_merge(old: _T, new: _T, *, skip: frozenset[str] = frozenset()) -> HotMerge:
    """Merge ``new`` into the running ``old`` by the declared ``hot`` of each key.

    Top-level fields named in ``skip`` are taken from ``new`` as they are and reported
    in neither list (the caller compares them itself: the workers). Fields without a
    spec are taken from ``new``.
    """
    cold: list[str] = []
    hot: list[str] = []
    merged = _merge(old, new, "", skip, cold, hot)
    return HotMerge(merged, tuple(cold), tuple(hot))


def _merge(
    old: Any, new: Any, prefix: str, skip: frozenset[str], cold: list[str], hot: list[str]
) -> Any:
    changes: dict[str, Any] = {}
    for name, spec, _item in specs(type(new)):
        path = f"{prefix}{name}"
        if path in skip:
            continue
        before, after = getattr(old, name), getattr(new, name)
        if before == after:
            continue
        if not spec.hot:
            cold.append(path)
            changes[name] = before
        elif spec.kind == "section" and dataclasses.is_dataclass(after):
            merged = _merge(before, after, f"{path}.", skip, cold, hot)
            if merged is not after:
                changes[name] = merged
        else:
            hot.append(path)
    return dataclasses.replace(new, **changes) if changes else new


# ---------------------------------------------------------------------------------------
# Documentation


@dataclass(frozen=True, slots=True)
class Key:
    """One row of a key table: the dotted key, its spec and its default."""

    path: str
    spec: Spec
    default: object


def keys(cls: type, prefix: str = "") -> Iterator[Key]:
    """Every documented key under ``cls``, nested sections flattened to dotted paths."""
    for name, spec, item in specs(cls):
        path = f"{prefix}{name}"
        if spec.kind == "section" and spec.section is not None:
            for key in keys(spec.section, f"{path}."):
                # A key inside a section a reload keeps is kept with it.
                yield (
                    key
                    if spec.hot
                    else Key(key.path, dataclasses.replace(key.spec, hot=False), key.default)
                )
            continue
        yield Key(path, spec, default_of(item))
        for input_name, input_spec, input_default in spec.inputs:
            yield Key(f"{prefix}{input_name}", input_spec, input_default)


def type_text(spec: Spec) -> str:
    if spec.type_text:
        return spec.type_text
    kind = {"bool": "bool", "int": "int", "number": "number", "choice": "str"}
    text = kind.get(spec.kind, "str")
    if spec.unit:
        text += f" ({spec.unit})"
    if spec.nullable:
        text += " or null"
    return text


def default_text(spec: Spec, default: object) -> str:
    if spec.default_text:
        return spec.default_text
    if default is None:
        return "none"
    if default == "":
        return ""  # required in another way, which the allowed column says
    if isinstance(default, bool):
        return f"`{'true' if default else 'false'}`"
    return f"`{default}`"


def allowed_text(spec: Spec) -> str:
    parts = []
    if spec.limit is not None:
        parts.append(f"`{spec.limit.describe()}`")
    if spec.choices:
        parts.append(", ".join(f"`{option}`" for option in spec.choices))
    if spec.kind == "endpoint":
        parts.append("starts with `/`")
    text = ", ".join(parts)
    if spec.at_least:
        text += f", and >= `{spec.at_least}`"
    extra = spec.allowed_text
    if extra:
        # A parenthesis qualifies the range before it; anything else is a rule of its own.
        text = (
            f"{text} {extra}" if extra.startswith("(") else "; ".join(filter(None, [text, extra]))
        )
    return text


def _row(cells: list[str]) -> str:
    return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"


def pool_table(root: type) -> str:
    """The table of pool-level keys: every key of ``root`` but the workers' own."""
    lines = [
        _row(["key", "type", "default", "allowed", "hot", "what it does"]),
        _row(["---"] * 6),
    ]
    for key in keys(root):
        hot = "yes" if key.spec.hot else "no"
        cells = [f"`{key.path}`", type_text(key.spec), default_text(key.spec, key.default)]
        lines.append(_row([*cells, allowed_text(key.spec), hot, key.spec.doc]))
    return "\n".join(lines)


def worker_table(worker: type) -> str:
    """The table of per-worker keys."""
    lines = [_row(["key", "type", "default", "allowed", "what it does"]), _row(["---"] * 5)]
    for key in keys(worker):
        cells = [f"`{key.path}`", type_text(key.spec), default_text(key.spec, key.default)]
        lines.append(_row([*cells, allowed_text(key.spec), key.spec.doc]))
    return "\n".join(lines)


def autobot_table(root: type, worker: type) -> str:
    """The keys of AutoBot's admin-UI file and the npu_sync keys they become."""
    lines = [_row(["AutoBot key", "becomes", "how"]), _row(["---"] * 3)]
    rows = [(key, f"workers[].{key.path}") for key in keys(worker) if key.spec.autobot]
    rows += [(key, key.path) for key in keys(root) if key.spec.autobot]
    for key, target in rows:
        for source, how in autobot_sources(key.spec):
            source = source if "." in source else f"workers[].{source}"
            lines.append(_row([f"`{source}`", f"`{target}`", how or "as is"]))
    return "\n".join(lines)


def autobot_sources(spec: Spec) -> list[tuple[str, str]]:
    """Every AutoBot key that maps to the key of ``spec``, with its note."""
    if not spec.autobot:
        return []
    return [(spec.autobot, spec.autobot_note), *spec.autobot_also]
