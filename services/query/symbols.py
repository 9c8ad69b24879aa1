"""Exact identifiers (pure): a query that is a symbol's name or qualified name gets the chunks defining that symbol
first, whatever the retrievers made of it.

A name is one token to the keyword analyser and a word among others to the embedding, so a chunk that mentions
``RetryCallState`` ten times outranks the class that defines it (docs/quality.md, "Exact identifiers"). Matching
the stored ``symbolFqn`` does not guess: the query either is the symbol's name, or its last parts, or it is not.
The lookup itself is the document store's (``DocumentStore.definitions``).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

from .fusion import Fused, SourceHit
from .stages import above_the_rest

SYMBOL = "symbol"
"""The name this match goes by in ``foundBy``."""

MAX_IDENTIFIER_CHARS = 300
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_SEPARATOR = re.compile(r"::|#")


def identifier_of(text: str) -> str | None:
    """The dotted name a query asks for when the whole query is one identifier: ``Retrying``,
    ``tenacity.retry.Retrying``, ``Retrying.__call__`` (also as ``Retrying::__call__`` or ``Retrying#__call__``), in
    backticks or with a call's ``()``. None for any other text: words around a name make it a question, not a name."""
    name = _SEPARATOR.sub(".", text.strip().strip("`").strip().removesuffix("()"))
    return name if len(name) <= MAX_IDENTIFIER_CHARS and _IDENTIFIER.fullmatch(name) else None


def last_part(name: str) -> str:
    """What the store looks a name up by: its last dotted part (``__call__`` of ``Retrying.__call__``)."""
    return name.rsplit(".", 1)[-1]


def match_quality(symbol_fqn: str, name: str) -> int | None:
    """How well a symbol's qualified name matches the asked ``name``, best first: 0 it is the name, 1 it ends with
    it (the name's parts are its last parts), 2 and 3 the same ignoring case; None when neither."""
    for ignoring_case, (fqn, asked) in enumerate(((symbol_fqn, name), (symbol_fqn.lower(), name.lower()))):
        if fqn == asked:
            return 2 * ignoring_case
        if fqn.endswith("." + asked):
            return 2 * ignoring_case + 1
    return None


def definitions_first(
    name: str,
    definitions: Mapping[str, str],
    candidates: Sequence[Fused],
    limit: int,
    modules: Collection[str] = frozenset(),
) -> list[Fused]:
    """The chunks whose qualified name matches ``name`` (``definitions``: id -> symbolFqn, as looked up), at most
    ``limit``, ahead of the other candidates, each scoring 1 and found by ``symbol`` besides what found it before.
    Matches ignoring case count only when none matches as written. Among themselves: the better match first, then
    classes and functions before modules (``modules``: ids of whole files; a module would hold, and so hide, its
    function of the same name), then the order the pipeline gave them, then the shorter name. The other
    candidates keep their order and scores. Unchanged when nothing matches."""
    position = {hit.id: i for i, hit in enumerate(candidates)}
    matched = sorted(
        (quality, doc_id in modules, position.get(doc_id, len(candidates)), len(fqn), fqn, doc_id)
        for doc_id, fqn in definitions.items()
        if (quality := match_quality(fqn, name)) is not None
    )
    if not matched:
        return list(candidates)
    if matched[0][0] <= 1:  # names that match as written: those ignoring case are other symbols
        matched = [m for m in matched if m[0] <= 1]
    existing = {hit.id: hit for hit in candidates}
    first = []
    for rank, (*_, doc_id) in enumerate(matched[:limit], start=1):
        hit = existing.get(doc_id) or Fused(doc_id, 0.0, 1.0)
        first.append(replace(hit, relevance=1.0, found_by={**hit.found_by, SYMBOL: SourceHit(rank, 1.0)}))
    return above_the_rest(first, candidates)
