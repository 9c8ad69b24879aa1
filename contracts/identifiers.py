"""Identifiers in any script, as Python reads them (pure): the regular expressions a name is read by.

``re``'s ``\\w`` is a letter, a digit or ``_``; a Python identifier continues with combining marks, connector
punctuation and a few more (``नमस्ते``, ``สวัสดี``, ``كَتَبَ``, ``x‿y``), which ``\\w`` leaves out: a Unicode tester's
``subclasses नमस्ते`` was refused as no name, and a query of it looked up no symbol.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Iterable

OTHER_ID_START = "\u1885\u1886\u2118\u212e\u309b\u309c"
"""What starts a Python identifier that ``[^\\W\\d]`` does not take (Unicode's Other_ID_Start: ``℘``, ``℮``)."""
NAME_START = rf"(?:[^\W\d]|[{OTHER_ID_START}])"
"""A regular expression for an identifier's first character."""


def character_ranges(codes: Iterable[int]) -> str:
    """Code points (ascending) as the ranges of a regular expression's character class, each escaped."""
    out: list[str] = []
    start = previous = -2
    for code in (*codes, -1):
        if code == previous + 1:
            previous = code
            continue
        if start >= 0:
            out.append(re.escape(chr(start)) + (f"-{re.escape(chr(previous))}" if previous > start else ""))
        start = previous = code
    return "".join(out)


@functools.cache
def name_character() -> str:
    """A regular expression for any character of an identifier after its first: ``\\w``, or what continues a
    Python identifier besides (combining marks, connectors), read from this Python's Unicode database once per
    process (about 20 ms)."""
    word = re.compile(r"\w")
    planes = (*range(0x80, 0x20000), *range(0xE0100, 0xE01F0))  # the variation selectors past them
    continuing = (c for c in planes if not word.match(chr(c)) and ("a" + chr(c)).isidentifier())
    return rf"[\w{character_ranges(continuing)}]"


@functools.cache
def identifier() -> re.Pattern[str]:
    """An identifier, or identifiers joined by dots (``os.path.join``, ``café.prix``, ``beyond.marks.नमस्ते``)."""
    part = rf"{NAME_START}{name_character()}*"
    return re.compile(rf"{part}(?:\.{part})*")


CODE_DOLLAR = r"\$(?!\d)"
"""A ``$`` in a name of code, which JavaScript's and Java's names hold (a retest's ``$query`` could not be asked):
never before a digit, as in a price (``$5M``, ``US$5``: a review's were read as names)."""
CODE_NAME_START = rf"(?:{NAME_START}|{CODE_DOLLAR})"
"""An identifier's first character in code: a Python one's, or :data:`CODE_DOLLAR`."""


@functools.cache
def code_name() -> re.Pattern[str]:
    """A name of code, or names joined by dots: an :func:`identifier` that may also hold ``$`` (``$query``,
    ``Outer$Inner``)."""
    part = rf"{CODE_NAME_START}(?:{name_character()}|{CODE_DOLLAR})*"
    return re.compile(rf"{part}(?:\.{part})*")


@functools.cache
def hyphenated_name() -> re.Pattern[str]:
    """A dotted name of code whose parts may join words by hyphens, as a file's module is named
    (``client.auth-extensions``, ``lib.rfc-2616``)."""
    word = name_character()
    part = rf"{CODE_NAME_START}(?:{word}|{CODE_DOLLAR})*(?:-{word}+)*"
    return re.compile(rf"{part}(?:\.{part})*")


def as_python_reads(name: str) -> str:
    """A name in the form Python reads identifiers in (NFKC), as a query's name is read: composed accents where a
    file name (as macOS writes names) or the source had them decomposed, plain letters for ligatures. Each part
    between dots and slashes on its own, kept as it is where its form would hold one (``a／b``, ``a．b``: a review's
    made ``src/a．b.ts`` the module of ``src/a/b.ts``)."""
    return name if name.isascii() else _NAME_PART.sub(_part_as_read, name)


_NAME_PART = re.compile(r"[^./]+")


def _part_as_read(part: re.Match[str]) -> str:
    read = unicodedata.normalize("NFKC", part.group(0))
    return part.group(0) if "." in read or "/" in read else read
