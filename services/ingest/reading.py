"""Reading a tree's files: regular files only, no link followed, decoded as Python and editors read them."""

from __future__ import annotations

import codecs
import io
import os
import re
import stat
import tokenize
from pathlib import Path

from ontofabric.shared.logging import get_logger

from .chunking import FileStart

log = get_logger(__name__)


def read_regular_file(path: Path, max_read_bytes: int = 0, name: str | None = None) -> str:
    """The text of the file at ``path`` when it is a regular file and no symbolic link; OSError otherwise. Decoded
    by :func:`decoded` (a tester's file with a byte-order mark was taken for unparsable, one in Latin-1 with its
    coding line skipped). A link may lead out of the tree, into another workspace's files
    or the deployment's secrets (runtime.json), which were then indexed for whoever reads the workspace (a tenant
    tester's finding); a device or a pipe under a source suffix may never end. Opened without following a link
    and checked on the open file, so that the file itself cannot be swapped for a link in between (a directory
    above it swapped for one while the ingest walks the tree is not guarded against). Of a file over
    ``max_read_bytes`` (0: none is), its first ``max_read_bytes`` as a :class:`FileStart`, ended at a whole
    character. ``name``: what errors and warnings call the file (its path in the tree; by default its name)."""
    name = name or path.name
    if path.is_symlink():
        raise OSError(f"{name}: a symbolic link (links are not followed)")
    if not stat.S_ISREG(path.lstat().st_mode):  # said so before opening: a socket's open failed "no such device"
        raise OSError(f"{name}: not a regular file")
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(descriptor, "rb") as opened:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise OSError(f"{name}: not a regular file")
        data = opened.read(max_read_bytes) if max_read_bytes and status.st_size > max_read_bytes else opened.read()
        if len(data) == max_read_bytes and status.st_size > max_read_bytes:
            if not data.startswith(tuple(mark for mark, _ in UNICODE_MARKS)):
                start = without_cut_character(data)
                return FileStart(decoded(start, python=path.suffix == ".py", name=name), status.st_size)
            # UTF-16 or UTF-32: its size as UTF-8, which the limit is of, is another; read whole, as before (rare).
            data += opened.read()
    return decoded(data, python=path.suffix == ".py", name=name)


def without_cut_character(data: bytes) -> bytes:
    """``data`` without a UTF-8 character cut short at its end (the start of a longer file)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # the last character's first byte: ASCII, or the lead of a sequence
            length = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            return data[:-back] if length > back else data
    return data


UNICODE_MARKS = (
    (codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"),
)  # fmt: skip
"""Byte-order marks of the encodings besides UTF-8 a file is read in by its mark alone (UTF-32's first: its
little-endian mark begins with UTF-16's)."""


NOT_TEXT_SHARE = 0.1
"""A file of which more than this share of characters cannot be read in its encoding is not text (a verifier's
binary file without NUL was indexed as noise); Latin-1 prose without a coding line stays well under it."""


def decoded(data: bytes, python: bool, name: str = "") -> str:
    """A source file's text, newlines as ``Path.read_text`` reads them: in the encoding its byte-order mark names
    (UTF-8, UTF-16 or UTF-32), else as Python decodes a source file (``python``: what a ``coding`` line names) or
    UTF-8, a UTF-8 byte-order mark dropped. A file that is not valid in that encoding (a stray Windows-1252 byte,
    a coding line naming no text codec) is read in its mark's encoding, or UTF-8, with each byte that is not
    replaced by U+FFFD, logged: a text with a bad byte, not a file gone; one that is mostly 8-bit text (Latin-1
    without a coding line) as Windows-1252 (:data:`_UTF8_SEQUENCE`). It was
    skipped, and so deleted from the index, at the first bad byte (a tester's 62 KB page, for one byte at its end).
    UnicodeError when more than NOT_TEXT_SHARE of it would be replaced: not text."""
    marked = next((codec for mark, codec in UNICODE_MARKS if data.startswith(mark)), None)
    encoding = marked
    try:
        if encoding is None and python:  # SyntaxError: a coding line naming no codec, or lines that are no UTF-8
            encoding = tokenize.detect_encoding(io.BytesIO(data).readline)[0]
        return io.TextIOWrapper(io.BytesIO(data), encoding=encoding or "utf-8-sig").read()
    except (SyntaxError, UnicodeError, LookupError) as error:  # LookupError: a codec that is no text codec
        text = io.TextIOWrapper(io.BytesIO(data), encoding=marked or "utf-8-sig", errors="replace").read()
        # More bytes that are no UTF-8 than characters that are: 8-bit text (`É”` in Windows-1252 reads as one
        # UTF-8 character, a review's; a UTF-8 page with one stray byte holds many of its own).
        eight_bit = marked is None and len(_UTF8_SEQUENCE.findall(data)) < text.count("\ufffd")
        if eight_bit:
            text = io.TextIOWrapper(io.BytesIO(data), encoding="cp1252", errors="replace").read()
        if "\0" in text:  # not text: skipped as such (read_tree)
            return text
        replaced = text.count("\ufffd")  # with any the file held already
        # Read as Windows-1252 every byte is a character: what is no text holds control characters instead.
        unreadable = replaced + (len(_CONTROL.findall(text)) if eight_bit else 0)
        if unreadable > NOT_TEXT_SHARE * len(text):
            raise UnicodeError(
                f"{name}: not text ({unreadable} of its {len(text)} characters could not be read)"
            ) from None
        log.warning(
            "ingest_file_not_utf8" if marked is None else "ingest_file_not_valid",
            path=name,
            encoding="windows-1252" if eight_bit else encoding or "utf-8",
            error=str(error)[:200],
            replaced=replaced,
            reason=f"read as {marked or 'UTF-8'}, with U+FFFD for each byte that is not"
            if not eight_bit
            else "read as Windows-1252 (a superset of Latin-1): no character in it is UTF-8",
        )
        return text


_CONTROL = re.compile("[\x01-\x08\x0b\x0e-\x1f\x7f]")
"""Control characters no text holds (tabs, line ends and form feeds aside)."""
_UTF8_SEQUENCE = re.compile(rb"[\xc2-\xdf][\x80-\xbf]|[\xe0-\xef][\x80-\xbf]{2}|[\xf0-\xf4][\x80-\xbf]{3}")
"""A character of UTF-8 beyond ASCII. A file not valid as UTF-8 that holds fewer of them than bytes that are not is
in an 8-bit encoding, read as Windows-1252, as a browser reads a page naming none (a tester's Latin-1 changelog read
"Am\ufffdlioration"); one that holds more is UTF-8 with a stray byte."""
