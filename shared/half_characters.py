"""Lone UTF-16 surrogates in JSON: half of a character, as a JavaScript client cutting an emoji in two writes it
(``"\\ud83d"``). JSON's grammar allows the escape, no Unicode text may hold it, and pydantic's parser refuses the
whole message without saying where; Python's parser reads it, so the field can be named. Pure logic."""

from __future__ import annotations

import codecs
import json
import re

from pydantic import ValidationError

from ontofabric.contracts._base import JsonWalk

HALF_CHARACTER = "not valid Unicode: half of a character (a lone surrogate)"
"""What is wrong with such a field, as every part that refuses one says it."""

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""The escape of a surrogate, paired or not: a cheap test before parsing."""


def surrogate_field(body: bytes) -> str | None:
    """Where a body that JSON's grammar allows holds a lone UTF-16 surrogate: the field's dotted path (list
    positions as numbers), or None."""
    if not _SURROGATE_ESCAPE.search(body):
        return None
    try:
        found = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return _field_holding_surrogate(found)


NOT_UTF8 = "not valid UTF-8"
"""What is wrong with a field whose bytes are no UTF-8 (text a client sent in another encoding)."""


def not_utf8(body: bytes) -> tuple[object, str] | None:
    """A JSON object whose bytes are not all UTF-8, which JSON must be: the object read with each stray byte kept
    apart (as a lone surrogate), and the dotted path of the first field holding one ("" for a key); None when
    the body is UTF-8 or is no JSON object even so."""
    try:
        body.decode()
        return None
    except UnicodeDecodeError:
        pass
    try:
        found = json.loads(body.decode(errors="surrogateescape"))
    except (ValueError, RecursionError):
        return None
    if not isinstance(found, dict):
        return None
    return found, _field_holding_surrogate(found) or ""


def _field_holding_surrogate(found: object) -> str | None:
    if isinstance(found, dict):
        walk = JsonWalk(list(found.items()))
    elif isinstance(found, list):
        walk = JsonWalk(list(enumerate(found)))
    else:
        return None
    for place, value in walk:
        if isinstance(value, str) and any("\ud800" <= c <= "\udfff" for c in value):
            return walk.place(place, brackets=False) or None  # a key's "": none to name
    return None


BYTE_ORDER_MARK = "a UTF-8 byte-order mark before the JSON, which a sender must not add (RFC 8259)"


def unreadable_text(body: bytes, error: ValidationError) -> tuple[str | None, str] | None:
    """For a body pydantic refused as no JSON (``error``): where it holds what no JSON text may, and what that is
    (the field's dotted path, "" for a key, None for the body; and why): a byte-order mark before it, half a
    character, or bytes of another encoding. None for anything else (JSON malformed otherwise, or a body pydantic
    read and refused for what it says)."""
    if not any(e["type"] == "json_invalid" for e in error.errors(include_url=False, include_input=False)):
        return None
    if body.startswith(codecs.BOM_UTF8):
        return None, BYTE_ORDER_MARK
    field = surrogate_field(body)
    if field is not None:
        return field, HALF_CHARACTER
    if _half_character_in_a_key(body):
        return "", HALF_CHARACTER
    stray = not_utf8(body)
    return None if stray is None else (stray[1], NOT_UTF8)


def _half_character_in_a_key(body: bytes) -> bool:
    """Whether a key of the body holds a lone surrogate (:func:`surrogate_field` reads the values): once read by
    Python's parser, any surrogate left is a lone one, since an escaped pair is read as one character."""
    if not _SURROGATE_ESCAPE.search(body):
        return False
    try:
        found = json.loads(body)
        text = json.dumps(found, ensure_ascii=False)
    except (ValueError, RecursionError):
        return False
    return any("\ud800" <= c <= "\udfff" for c in text)
