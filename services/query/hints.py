"""The could-benefit-from-link-expansion hint (seed 000 §6): does the query read as a relationship question?

A caller-visible signal only; it never changes results.
"""

from __future__ import annotations

import re

_RELATIONSHIP = re.compile(
    r"\b("
    r"references?|referenced|uses|used by|using|usages?|callers?|calls|called by|what calls|who calls|"
    r"implements?|implementations?|implementors?|depends on|dependen(?:ts|cies|cy)|inherits?|subclass(?:es)?|"
    r"derived from|extends|imports?|imported by|impact of|affected by|where is .+ used|relationship"
    r")\b",
    re.IGNORECASE,
)


def reads_as_relationship_question(text: str) -> bool:
    return _RELATIONSHIP.search(text) is not None
