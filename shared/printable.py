"""Text made to be shown: what a tenant wrote, safe on one line or in a terminal, and moments as people read them
(pure; no I/O)."""

from __future__ import annotations

import re
from datetime import UTC, datetime

ACTED_ON = "\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069"
"""Characters a terminal acts on rather than shows, as a regular expression's class: C0 and C1 controls but tab and
newline (escape sequences clear the screen, set the window's title, write the clipboard) and the bidirectional
overrides (which reorder the text shown)."""
_ACTED_ON_IN_LINES = re.compile(f"[{ACTED_ON}]")
_ACTED_ON_IN_A_LINE = re.compile(f"[{ACTED_ON}\t\n\u2028\u2029\u200b\u200e\u200f\u2060-\u2064\ufeff]")
"""On one line, also what breaks it (the line and paragraph separators; a tab, which a listing's columns are
separated by: a review's dead letter's detail shifted them) and what shows nothing and belongs to no
word (the zero-width space, direction marks, invisible operators, the byte-order mark): a Unicode tester's pasted
zero-width space in a path, the reason it matched nothing, was no longer seen once the header showed letters as
written. The joiners and tags stay: Persian spelling and emoji sequences hold them (a review's, and a second's:
Scotland's flag is tags)."""


def printable(text: str, lines: bool = False) -> str:
    """``text`` with each character a terminal would act on written as its escape (``\\x1b``, ``\\u202e``), and
    each line break and character that shows nothing too unless ``lines``: what a tenant sent (a dead letter's
    body and the reason quoting it, a document's content) reached an operator's terminal as it came, and could
    clear it or set its title (an outside tester's); a file's name with line breaks wrote result lines of its own
    into the text an agent reads (another's)."""
    found = _ACTED_ON_IN_LINES if lines else _ACTED_ON_IN_A_LINE
    return found.sub(lambda match: repr(match.group())[1:-1], text)


def shown_time(moment: datetime) -> str:
    """``moment`` in UTC to the second, as ISO 8601 with ``Z``: the texts printed Python's ``str`` of it
    (``2026-12-06 09:23:20.738003+00:00``) beside JSON that writes ``2026-12-06T09:23:20.738003Z`` (a tester's)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
