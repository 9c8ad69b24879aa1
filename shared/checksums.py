"""The checksum by which a document's text is compared across indexes and against the stream."""

from __future__ import annotations

import hashlib

CONTENT_MD5_SQL = "md5(convert_to(content, 'UTF8'))"
"""The same checksum, computed by PostgreSQL over a ``documents`` row."""


def content_md5(content: str) -> str:
    """The MD5 of a document's content as UTF-8, in hexadecimal."""
    return hashlib.md5(content.encode("utf-8"), usedforsecurity=False).hexdigest()
