"""Configured secrets kept out of what a worker says: :class:`Scrubber`.

A worker may quote the request it refused ("invalid token Bearer abc…"), and what it
says reaches exceptions, ``workers()``, the Flask endpoints, logs, the dead-letter
store and ``npu-sync status``. The pool builds one :class:`Scrubber` from its
configuration's secrets and passes every text taken from a worker's answer through it
where the text enters the pool (see docs/operations.md#secrets-a-worker-echoes-back).

Which values count as secrets (docs/configuration.md#headers-and-secrets): every
configured header value except those of :data:`PLAIN_HEADERS` (of a value with a
scheme word, ``Bearer <token>``, the credentials after it) and, for ``Basic``, the
decoded ``user:password`` and password; ``auth.token`` and ``auth.secret``; the password of a
worker or Redis URL (as written and decoded, and ``user:password`` in base64).
"""

from __future__ import annotations

import base64
import binascii
import json
import string
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import quote, quote_plus, unquote, urlsplit

if TYPE_CHECKING:
    from npu_sync.config import PoolConfig

__all__ = [
    "MAX_BODY_SCANNED",
    "MAX_WORKER_TEXT",
    "MIN_PART_LENGTH",
    "MIN_SECRET_LENGTH",
    "NO_SCRUBBER",
    "PLAIN_HEADERS",
    "REDACTED",
    "Scrubber",
]

REDACTED: Final = "[redacted]"
"""What takes the place of a secret in a worker's text."""

MIN_SECRET_LENGTH: Final = 8
"""Secrets shorter than this are not looked for (a warning says so when a pool starts):
redacting every "abc" would garble messages without protecting anything."""

MIN_PART_LENGTH: Final = 12
"""The shortest piece of a longer secret that is redacted on its own, so a secret cut
short, or quoted in part, is caught too. Longer than the shortest secret: an 8-letter
run such as "applicat" in a secret ``application-key-42`` would otherwise redact every
``application/json`` of every message."""

MAX_BODY_SCANNED: Final = 64 * 1024
"""The most characters of a rejected answer's body that are scrubbed and kept
(``TaskRejected.body``): a longer one is kept as its first this-many characters, as a
string, so a worker's huge refusals cost bounded work."""

MAX_WORKER_TEXT: Final = 500
"""The most characters kept of one text from a worker (an error, a health verdict);
longer texts end with ``...``."""

PLAIN_HEADERS: Final = frozenset(
    {
        "accept",
        "accept-charset",
        "accept-encoding",
        "accept-language",
        "cache-control",
        "connection",
        "content-language",
        "content-type",
        "host",
        "pragma",
        "user-agent",
    }
)
"""Header names (lower case) whose configured values are not secrets. Every other
configured header's value is treated as one."""

# An Authorization-style value: a scheme word, then the credentials.
_SCHEMES: Final = frozenset({"basic", "bearer", "digest", "token", "apikey", "negotiate"})


def _variants(secret: str) -> set[str]:
    """How a worker may write ``secret`` back: as is, URL-encoded, JSON-escaped."""
    return {
        secret,
        quote(secret, safe=""),
        quote_plus(secret, safe=""),
        json.dumps(secret)[1:-1],
    }


def _basic_pair(user: str, password: str) -> list[str]:
    """``user:password`` as text and as a ``Basic`` header's base64 carries it."""
    pair = f"{user}:{password}"
    return [pair, base64.b64encode(pair.encode()).decode("ascii")]


def _from_header(value: str) -> list[str]:
    """The secrets in a header value: the value itself or, after a scheme word
    (``Bearer <token>``), the credentials alone, so the scheme's name stays readable."""
    scheme, _, credentials = value.strip().partition(" ")
    credentials = credentials.strip()
    if scheme.lower() not in _SCHEMES or not credentials:
        return [value]
    found = [credentials]
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(credentials, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            decoded = ""
        if decoded:
            found.append(decoded)
            found.append(decoded.partition(":")[2])
    return found


def _from_url(url: str) -> list[str]:
    """The password of a URL's userinfo: as written, decoded, and with the user."""
    try:
        parts = urlsplit(url)
        password = parts.password
        user = parts.username or ""
    except ValueError:
        return []
    if not password:
        return []
    return [password, unquote(password), *_basic_pair(unquote(user), unquote(password))]


def config_secrets(config: PoolConfig) -> tuple[list[str], list[str]]:
    """The secret values of ``config``, and where those too short to look for are.

    Returns:
        The secrets (with the pieces inside them), and for each configured secret
        shorter than :data:`MIN_SECRET_LENGTH` its place, e.g.
        ``worker vm2: header X-Api-Key`` (never its value).
    """
    found: list[str] = []
    short: list[str] = []

    def add(where: str, values: list[str]) -> None:
        if values and len(values[0]) < MIN_SECRET_LENGTH:
            short.append(where)
        found.extend(values)

    for worker in config.workers:
        for name, value in worker.headers.items():
            if name.lower() not in PLAIN_HEADERS:
                add(f"worker {worker.id}: header {name}", _from_header(value))
        auth = worker.auth
        if auth.token:
            add(f"worker {worker.id}: auth.token", [auth.token])
        if auth.secret:
            add(f"worker {worker.id}: auth.secret", [auth.secret])
        add(f"worker {worker.id}: url password", _from_url(worker.url))
    add("shared_state.url password", _from_url(config.shared_state.url))
    return found, short


# Matching ignores the case of ASCII letters (an echo upper-cased is still the
# secret), keeping every other character, so offsets in the folded text are offsets
# in the text.
_FOLD: Final = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


class Scrubber:
    """Replaces known secrets in a text with :data:`REDACTED`. Immutable, thread-safe.

    Each secret is looked for as written, URL-encoded and JSON-escaped, in any case of
    its ASCII letters; any run of at least :data:`MIN_PART_LENGTH` of its characters
    is redacted too, so a secret cut short or quoted in part goes as well. Secrets
    shorter than :data:`MIN_SECRET_LENGTH` are ignored.

    Args:
        secrets: the values to keep out of texts.
        kept: secrets of an earlier configuration still looked for (see
            :meth:`from_config`), not passed on to the next one.
    """

    __slots__ = ("_parts", "_whole", "own", "too_short")

    def __init__(self, secrets: Iterable[str] = (), *, kept: Iterable[str] = ()) -> None:
        own = frozenset(s for s in secrets if isinstance(s, str) and s)
        self.own: frozenset[str] = own
        self.too_short: tuple[str, ...] = ()
        k = MIN_PART_LENGTH
        parts: set[str] = set()
        whole: set[str] = set()
        for secret in own | frozenset(kept):
            for variant in _variants(secret):
                folded = variant.translate(_FOLD)
                if len(folded) >= k:
                    parts.update(folded[i : i + k] for i in range(len(folded) - k + 1))
                elif len(folded) >= MIN_SECRET_LENGTH:
                    whole.add(folded)  # too short to cut: caught only whole
        self._parts: frozenset[str] = frozenset(parts)
        self._whole: tuple[str, ...] = tuple(sorted(whole))

    @classmethod
    def from_config(cls, config: PoolConfig, previous: Scrubber | None = None) -> Scrubber:
        """The scrubber for ``config``'s secrets.

        Args:
            previous: the scrubber of the configuration it replaces: its own secrets
                are still looked for, since an answer to a request sent with an old
                secret may arrive after the reload. One generation only.
        """
        secrets, short = config_secrets(config)
        scrubber = cls(secrets, kept=() if previous is None else previous.own)
        scrubber.too_short = tuple(short)
        return scrubber

    def __bool__(self) -> bool:
        return bool(self._parts or self._whole)

    def __call__(self, text: str) -> str:
        """``text`` without secrets, at most :data:`MAX_WORKER_TEXT` characters long."""
        if len(text) > 4 * MAX_WORKER_TEXT:
            text = text[: 4 * MAX_WORKER_TEXT]  # bounded work; cut again below
        if self and len(text) >= MIN_SECRET_LENGTH:
            text = self._redact(text)
        if len(text) > MAX_WORKER_TEXT:
            text = text[: MAX_WORKER_TEXT - 3] + "..."
        return text

    def _redact(self, text: str) -> str:
        folded = text.translate(_FOLD)
        spans: list[tuple[int, int]] = []
        parts = self._parts
        if parts:
            k = MIN_PART_LENGTH
            for i in range(len(folded) - k + 1):
                if folded[i : i + k] in parts:
                    spans.append((i, i + k))
        for secret in self._whole:
            at = folded.find(secret)
            while at >= 0:
                spans.append((at, at + len(secret)))
                at = folded.find(secret, at + 1)
        if not spans:
            return text
        spans.sort()
        out: list[str] = []
        at = 0
        end = -1
        for start, stop in spans:
            if start <= end:  # overlaps the span being built: extend it
                end = max(end, stop)
                continue
            if end >= 0:
                out.append(REDACTED)
                at = end
            out.append(text[at:start])
            end = stop
        out.append(REDACTED)
        out.append(text[end:])
        return "".join(out)

    def value(self, value: Any) -> Any:
        """A decoded JSON answer with secrets redacted from its text, keys included.

        The value itself when it holds none; otherwise a new one (a string when the
        redacted JSON no longer reads back). Only the first :data:`MAX_BODY_SCANNED`
        characters of a larger one are kept, as a string.
        """
        if not self or value is None or isinstance(value, (bool, int, float)):
            return value
        if isinstance(value, str):
            if len(value) > MAX_BODY_SCANNED:
                value = value[:MAX_BODY_SCANNED] + "..."
            return self._redact(value)
        try:
            text = json.dumps(value)
        except (TypeError, ValueError, RecursionError):
            return value
        if len(text) > MAX_BODY_SCANNED:
            return self._redact(text[:MAX_BODY_SCANNED] + "...")
        clean = self._redact(text)
        if clean == text:
            return value
        try:
            return json.loads(clean)
        except (ValueError, RecursionError):
            return clean

    def __repr__(self) -> str:
        return f"<Scrubber of {len(self.own)} secret(s)>"


NO_SCRUBBER: Final = Scrubber()
"""Redacts nothing; still caps a text's length."""
