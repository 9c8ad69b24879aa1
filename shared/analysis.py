"""Code-aware text analysis applied before PostgreSQL's text search parser, to documents and queries alike.

PostgreSQL keeps ``writeBoolean``, ``base64`` and ``os.path.join`` as single tokens, and ``low-density`` as a
compound beside its parts. Code search needs the parts of identifiers: each compound identifier is kept and
followed by its parts, so an exact identifier still matches as a whole and ``write boolean`` finds it as well
(``read_file``, which the parser splits itself, gets its parts once more, which weighs identifier words up).
Hyphens between word characters become spaces, so hyphenated words count as their parts only. Lexemes of one
character are dropped in SQL (``index_tsvector`` in the migrations).
"""

from __future__ import annotations

import re

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_PART = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")
_INNER_HYPHEN = re.compile(r"(?<=\w)-(?=\w)")


def identifier_parts(identifier: str) -> list[str]:
    """``getHTTPResponse`` -> [get, HTTP, Response]; ``os.path.join`` -> [os, path, join]; parts of 2+ chars."""
    parts: list[str] = []
    for piece in re.split(r"[._]+", identifier):
        parts.extend(p for p in _PART.findall(piece) if len(p) > 1)
    return parts


def expand_identifiers(text: str) -> str:
    """``text`` with the parts of every compound identifier appended after it."""

    def expand(match: re.Match[str]) -> str:
        token = match.group(0)
        parts = identifier_parts(token)
        return f"{token} {' '.join(parts)}" if len(parts) > 1 else token

    return _IDENTIFIER.sub(expand, text)


def analyse(text: str) -> str:
    """The text the keyword index (and a keyword query) is built from."""
    return expand_identifiers(_INNER_HYPHEN.sub(" ", text))
