"""HTTP/1.1 messages for the built-in transport: encoding requests, parsing answers.

Pure functions over strings and bytes, no I/O: the transport reads, these decide.
Parsing is strict where leniency would let a broken or hostile worker confuse the
framing (two lengths, a bad chunk size, an obsolete line fold) and bounded everywhere
(header lines, header bytes, interim answers, decoded size).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping

MAX_HEADER_LINES = 100
"""Header fields in one answer's head (the status line not counted)."""
MAX_HEAD_BYTES = 64 * 1024
"""Bytes in one answer's head, status line and blank line included."""
MAX_INTERIM = 16
"""1xx answers skipped before the final one."""
MAX_LINE_BYTES = 8 * 1024
"""Bytes in a chunk-size line (extensions included)."""

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Request targets: visible ASCII only (no spaces, controls or non-ASCII).
_BAD_TARGET = re.compile(r"[^\x21-\x7e]")
_HEX = re.compile(r"[0-9A-Fa-f]{1,15}")
# Headers the transport writes itself: a caller's copy would break the framing.
_FRAMING = frozenset({"content-length", "transfer-encoding"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_SAFE_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})


class MessageError(Exception):
    """A message is malformed (``kind`` ``protocol``) or too large (``too_large``)."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


class BadRequest(ValueError):
    """The request cannot be written as given; raised before any I/O."""


# Names already checked, by the name as written: their lower-case form. Requests and
# answers repeat the same few names, so each is checked (and lower-cased) once. The
# dicts are only ever added to or cleared; a race at worst checks a name twice.
_REQUEST_NAMES: dict[str, str] = {}
_ANSWER_NAMES: dict[str, str] = {}
_NAMES_MAX = 1024


def request_name(name: str) -> str:
    """The lower-case form of a request header name, checked.

    Raises:
        BadRequest: not a token, or a header the transport writes itself.
    """
    lower = _REQUEST_NAMES.get(name)
    if lower is None:
        if not isinstance(name, str) or not _TOKEN.fullmatch(name):
            raise BadRequest(f"invalid header name {name!r}")
        lower = name.lower()
        if lower in _FRAMING:
            raise BadRequest(f"header {name!r} is set by the transport")
        if len(_REQUEST_NAMES) >= _NAMES_MAX:
            _REQUEST_NAMES.clear()
        _REQUEST_NAMES[name] = lower
    return lower


def check_value(name: str, value: str) -> None:
    """Refuse a header value that could end its line (CR, LF, NUL) or is not text.

    Such a value would let a header start a header, or a request, of its own.
    """
    if not isinstance(value, str) or "\r" in value or "\n" in value or "\0" in value:
        # The value is not echoed: headers are where credentials live.
        raise BadRequest(f"invalid value for header {name!r} (CR, LF, NUL or not text)")


def header_lines(headers: Mapping[str, str]) -> str:
    """``Name: value\\r\\n`` lines for ``headers``, each checked.

    Raises:
        BadRequest: a name that is not a token, a value with CR, LF or NUL, or a
            header the transport writes itself (Content-Length, Transfer-Encoding).
    """
    out = []
    for name, value in headers.items():
        request_name(name)
        check_value(name, value)
        out.append(f"{name}: {value}\r\n")
    return "".join(out)


def check_target(method: str, path: str) -> None:
    """Refuse a method or path that cannot go into a request line unchanged."""
    if method not in _SAFE_METHODS and not _TOKEN.fullmatch(method):
        raise BadRequest(f"invalid HTTP method {method!r}")
    if _BAD_TARGET.search(path):
        raise BadRequest(f"invalid characters in path {path!r}")


def content_length_line(method: str, body: bytes | None) -> str:
    if body is not None:
        return f"Content-Length: {len(body)}\r\n"
    if method in BODY_METHODS:
        return "Content-Length: 0\r\n"
    return ""


def encode_head(text: str) -> bytes:
    """The request head as latin-1 bytes.

    Raises:
        BadRequest: a character outside latin-1 (in a header value, usually).
    """
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError as exc:
        line = text[: exc.start].rpartition("\r\n")[2].partition(":")[0]
        raise BadRequest(f"header {line!r} has a value that is not latin-1 text") from None


def parse_head(text: str) -> tuple[str, int, dict[str, str]]:
    """Parse an answer's head (without the blank line): version, status, headers.

    Header names are lower-cased; repeated headers are joined with ``", "``.

    Raises:
        MessageError: a malformed status line or header, or too many headers.
    """
    lines = text.split("\r\n")
    if len(lines) > MAX_HEADER_LINES + 1:
        raise MessageError("protocol", f"more than {MAX_HEADER_LINES} header lines")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if (
        version not in ("HTTP/1.1", "HTTP/1.0")
        or len(code) != 3
        or not (code.isascii() and code.isdigit())
        or (len(rest) > 3 and rest[3] != " ")
    ):
        raise MessageError("protocol", f"malformed status line {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    names = _ANSWER_NAMES
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        lower = names.get(name)
        if lower is None:
            # A name must be a token: empty names, names with spaces (or an obsolete
            # fold, which starts with one) and control characters are refused.
            if not sep or not _TOKEN.fullmatch(name):
                raise MessageError("protocol", f"malformed header line {line[:80]!r}")
            lower = name.lower()
            if len(names) >= _NAMES_MAX:
                names.clear()
            names[name] = lower
        name = lower
        value = value.strip(" \t")
        old = headers.get(name)
        headers[name] = value if old is None else f"{old}, {value}"
    return version, int(code), headers


def head_text(raw: bytes | bytearray | memoryview, lf_only: bool) -> str:
    """An answer's head as text with CRLF line ends (some servers send bare LF)."""
    text = str(raw, "latin-1")
    if lf_only:
        text = "\r\n".join(line.removesuffix("\r") for line in text.split("\n"))
    return text


def content_length(value: str) -> int:
    """The body length from a Content-Length value (repeats must agree).

    Raises:
        MessageError: not a non-negative decimal, or repeats that differ.
    """
    if "," in value:
        values = {v.strip(" \t") for v in value.split(",")}
        if len(values) != 1:
            raise MessageError("protocol", f"conflicting Content-Length {value[:80]!r}")
        value = values.pop()
    if not (value.isascii() and value.isdigit()) or len(value) > 18:
        raise MessageError("protocol", f"malformed Content-Length {value[:80]!r}")
    return int(value)


def is_chunked(value: str) -> bool:
    """Whether a Transfer-Encoding value is plain ``chunked``.

    Raises:
        MessageError: any other transfer coding (none was offered in the request).
    """
    if value.strip(" \t").lower() == "chunked":
        return True
    raise MessageError("protocol", f"unsupported Transfer-Encoding {value[:80]!r}")


def chunk_size(line: bytes | bytearray) -> int:
    """The size from a chunk-size line (without its line end); extensions ignored.

    Raises:
        MessageError: not a hexadecimal size.
    """
    size = bytes(line).partition(b";")[0].strip(b" \t")
    text = size.decode("latin-1")
    if not _HEX.fullmatch(text):
        raise MessageError("protocol", f"malformed chunk size {bytes(line)[:40]!r}")
    return int(text, 16)


def keeps_alive(version: str, headers: Mapping[str, str]) -> bool:
    """Whether the connection may carry another request after this answer."""
    connection = headers.get("connection")
    if version == "HTTP/1.1":
        return connection is None or not _has_token(connection, "close")
    return connection is not None and _has_token(connection, "keep-alive")


def _has_token(value: str, token: str) -> bool:
    return any(part.strip(" \t").lower() == token for part in value.split(","))


def keep_alive_timeout(value: str) -> float | None:
    """The ``timeout=N`` of a Keep-Alive header, or None."""
    for part in value.split(","):
        name, _, number = part.partition("=")
        if name.strip(" \t").lower() == "timeout":
            try:
                return float(number.strip(" \t"))
            except ValueError:
                return None
    return None


_DECODERS = {"gzip": zlib.MAX_WBITS | 16, "x-gzip": zlib.MAX_WBITS | 16, "deflate": zlib.MAX_WBITS}


def decodable(value: str) -> list[str] | None:
    """The content codings to undo, last applied first; None if one is unknown."""
    codings = [c.strip(" \t").lower() for c in value.split(",")]
    codings = [c for c in codings if c and c != "identity"]
    if any(c not in _DECODERS for c in codings):
        return None
    codings.reverse()
    return codings


def decode(body: bytes, codings: list[str], limit: int) -> bytes:
    """Undo content codings, never producing more than ``limit`` bytes.

    Raises:
        MessageError: ``too_large`` past the limit; ``protocol`` for corrupt data.
    """
    for coding in codings:
        body = _inflate(body, _DECODERS[coding], limit)
    return body


def _inflate(data: bytes, wbits: int, limit: int) -> bytes:
    out: list[bytes] = []
    size = 0
    while True:
        decoder = zlib.decompressobj(wbits)
        try:
            # One byte past the limit proves the excess; max_length stops a bomb there.
            piece = decoder.decompress(data, limit + 1 - size)
        except zlib.error as exc:
            if wbits == zlib.MAX_WBITS and not out:
                # "deflate" is meant to be zlib-wrapped, but some servers send it raw.
                wbits = -zlib.MAX_WBITS
                continue
            raise MessageError("protocol", f"undecodable body: {exc}") from None
        size += len(piece)
        if size > limit:
            raise MessageError("too_large", f"answer larger than {limit} bytes")
        out.append(piece)
        if not decoder.eof:
            raise MessageError("protocol", "compressed body is truncated")
        data = decoder.unused_data
        # gzip allows several members one after another; anything else left is junk.
        if not data or wbits != zlib.MAX_WBITS | 16:
            break
    return b"".join(out)
