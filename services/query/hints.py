"""The could-benefit-from-link-expansion hint (seed 000 §6): does the query read as a relationship question?

A caller-visible signal only; it never changes results.
"""

from __future__ import annotations

import re
from typing import Literal

from ontofabric.contracts import OntologyQuery, QueryMeta

from .symbols import relation_of

# "where is X used" within 200 characters: unbounded, each "where is" of a long text scanned to its end (an
# audit's 100,000 characters of them took 1 s).
_RELATIONSHIP = re.compile(
    r"\b("
    r"references?|referenced|uses|used by|using|usages?|callers?|calls|called by|what calls|who calls|"
    r"implements?|implementations?|implementors?|depends on|dependen(?:ts|cies|cy)|inherits?|subclass(?:es)?|"
    r"derived from|extends|imports?|imported by|impact of|affected by|where is .{1,200}? used|relationship"
    r")\b",
    re.IGNORECASE,
)


def reads_as_relationship_question(text: str) -> bool:
    """A mention of a relation anywhere in the text, or a whole relation question the lookups answer
    (``symbols.relation_of``: "what does f call", "base classes of C")."""
    return _RELATIONSHIP.search(text) is not None or relation_of(text) is not None


QueryShape = Literal["listing", "relationship", "identifier", "concept"]


def shape_of(query: OntologyQuery, meta: QueryMeta) -> QueryShape:
    """Seed 000's query shapes (the `shape` label of ``retrieval.query.duration_ms``), told from the pipeline's own
    signals, no classifier of its own: a listing (filters, no text); a relationship question (links followed, a
    relation asked by structure, or the text reads as one); an exact identifier (the query named a symbol, which
    placed its definitions first, or a precision request's keyword top hit was saturated); otherwise a concept
    query. (Only the second used to count: with no reranker, the default, no query was ever an identifier.)"""
    if meta.listing:
        return "listing"
    if query.follow_links or query.related_to is not None or meta.could_benefit_from_link_expansion:
        return "relationship"
    if meta.exact_symbol_matches or meta.skipped_rerank == "bm25_saturation":
        return "identifier"
    return "concept"
