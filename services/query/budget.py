"""Bounded answers (pure): a reply cut to fit the caller's budget and the message size, saying what was cut.

An agent's client refuses or truncates a tool result past a size of its own (Claude Code: 25,000 tokens), and NATS
refuses a message past its maximum payload. So the worker fits every reply: results keep their rank order; each
result's content is kept whole while it fits, the first that does not is cut at a line near the limit, and the
rest go without content (their ids, scores and metadata still listed); only when even those do not fit are the
lowest-ranked results left out (and a result too large to list even alone, by its metadata, on its own), but
for a slice of the best-ranked result's content (MIN_SLICE_BYTES), whose room is held first. What
``_meta`` says about the results (the chunks collapsed into them, the context linked from them) comes last, in
their rank order, as far as room is left: a result with many nested chunks is never left out for their sake.
Tokens are estimated at BYTES_PER_TOKEN bytes of the reply's JSON each.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ontofabric.contracts import QueryResponse, SearchResult
from ontofabric.contracts.query import BudgetReport, CollapsedResult, ExpandedContext, QueryMeta

from .symbols import NAMED, RELATIONS

BYTES_PER_TOKEN = 4
"""About what tokenizers of English text and code average; an estimate, not a count."""
MIN_SLICE_BYTES = 400
"""A content cut shorter than this is not worth its place: the result goes without content instead."""
RESERVE_BYTES = 512
"""Room kept for what the cutting itself adds to ``_meta`` (the budget report, the ids of cut contents)."""
NOTES_SHARE = 4
"""Of the room left for contents, at most 1 in this many bytes is kept for what ``_meta`` says about the results
listed (linked context, collapsed chunks)."""
WIDEST_ESTIMATE = 99_999_999
"""Sizes are measured with this in ``estimatedTokens``: the real figure, written last, is never wider."""
VARYING_META_BYTES = 768
"""Room held for what two answers to one question differ by in ``_meta``: the timings, ``cacheHit`` and the
freshness. Whether and where to cut is decided without them, so that a question asked again gets the results it got
the first time, from the cache or not (a property tester's: a cached answer listed a result more than the first,
its ``_meta`` holding one timing where the first held twelve). Twelve timings take about 300 bytes."""


class TooLarge(Exception):
    """Even an answer without results does not fit: the budget is smaller than the answer's ``_meta``."""


def json_size(text: str) -> int:
    """The bytes ``text`` takes as a JSON string, its quotes included, as pydantic and the MCP SDK write it (UTF-8,
    escapes where JSON needs them)."""
    return len(json.dumps(text, ensure_ascii=False).encode("utf-8", "surrogatepass"))


def cut_to(text: str, max_bytes: int) -> str:
    """The longest start of ``text`` whose JSON string takes at most ``max_bytes``, ended at a line break when one
    lies in its last quarter; ``text`` itself when it fits (a tester's docstrings lost their last line, and were
    said to be cut, in 81 of 333 documents read)."""
    low, high = 0, len(text)
    while low < high:  # the longest prefix that fits
        middle = (low + high + 1) // 2
        low, high = (middle, high) if json_size(text[:middle]) <= max_bytes else (low, middle - 1)
    if low == len(text):
        return text
    head = text[:low]
    line_end = head.rfind("\n")
    return head[: line_end + 1] if line_end >= len(head) * 3 // 4 else head


_LINE_END = re.compile(r"\r\n|\r|\n")
"""A line's end, as the ingester counts lines (``chunking.file_lines``)."""


def slice_lines(metadata: Mapping[str, Any], text: str, offset: int, length: int) -> list[int] | None:
    """The file's lines ``text[offset : offset + length]`` spans, counted from the document's ``startLine``; None
    when it states none, when its text is not the file's own (a docstring's is cleaned), or for an empty slice. An
    outside tester's agent read a slice 100,000 characters into a section as starting at the section's first line."""
    start, end = metadata.get("startLine"), metadata.get("endLine")
    if type(start) is not int or start < 1 or metadata.get("symbolKind") == "docstring" or length <= 0:
        return None
    first = start + len(_LINE_END.findall(text, 0, offset))
    last = first + len(_LINE_END.findall(text, offset, offset + length - 1))  # a final end ends its line, opens none
    return [first, min(last, end) if type(end) is int and end >= first else last]


def fit_reply(response: QueryResponse, max_tokens: int, max_payload_bytes: int) -> bytes:
    """The reply as JSON within ``max_tokens`` (estimated) and ``max_payload_bytes``; ``_meta.budget`` says what was
    cut, and ``replySize`` in ``_meta.degraded`` when the message size, not the budget, made the cut. Raises
    TooLarge when nothing fits."""
    budget_bytes = max_tokens * BYTES_PER_TOKEN
    limit = min(budget_bytes, max_payload_bytes)
    fitted = _with_meta(response, budget=_report(max_tokens))
    size = len(_encoded(fitted))  # measured once: every reply passes here
    if size > limit or len(_encoded(_steady(fitted))) + VARYING_META_BYTES > limit:
        if max_payload_bytes < budget_bytes:
            response = _with_meta(response, degraded=[*response.meta.degraded, "replySize"])
        fitted = _cut_steadily(response, limit, max_tokens)
        size = len(_encoded(fitted))
    assert fitted.meta.budget is not None
    tokens = _tokens_of_itself(size)
    return _encoded(_with_meta(fitted, budget=fitted.meta.budget.model_copy(update={"estimated_tokens": tokens})))


def _tokens_of_itself(measured: int) -> int:
    """``estimatedTokens`` of a reply measured ``measured`` bytes long with WIDEST_ESTIMATE in that field: the reply
    holding the figure it states, which differs from the measured one by that number's digits alone (the contract
    says the reply's size / 4, rounded up, and a tester's replies came 1 or 2 tokens under what they said)."""
    rest = measured - len(str(WIDEST_ESTIMATE))
    tokens = math.ceil(measured / BYTES_PER_TOKEN)
    while (fewer := math.ceil((rest + len(str(tokens))) / BYTES_PER_TOKEN)) != tokens:
        tokens = fewer  # only ever fewer, so this ends
    return tokens


def _report(
    max_tokens: int, cut: list[str] | None = None, omitted: int = 0, dropped: int = 0, notes: tuple[int, int] = (0, 0)
) -> BudgetReport:
    return BudgetReport(
        max_tokens=max_tokens,
        estimated_tokens=WIDEST_ESTIMATE,
        contents_cut=cut or [],
        contents_omitted=omitted,
        results_dropped=dropped,
        collapsed_dropped=notes[0],
        context_dropped=notes[1],
    )


def _encoded(response: QueryResponse) -> bytes:
    return response.model_dump_json().encode()


def _with_meta(response: QueryResponse, **update: object) -> QueryResponse:
    return response.model_copy(update={"meta": response.meta.model_copy(update=update)})


@dataclass(frozen=True)
class Notes:
    """What ``_meta`` says about the results, kept with a cut reply: entries of ``collapsed`` and of
    ``expandedContext``."""

    collapsed: tuple[CollapsedResult, ...] = ()
    context: tuple[ExpandedContext, ...] = ()

    def dropped(self, meta: QueryMeta) -> tuple[int, int]:
        return len(meta.collapsed) - len(self.collapsed), len(meta.expanded_context) - len(self.context)


NO_NOTES = Notes()


def _with_budget(
    response: QueryResponse, report: BudgetReport, results: list[SearchResult], notes: Notes
) -> QueryResponse:
    """``response`` with ``report``, only ``results`` and, of what ``_meta`` says about results, only ``notes``; the
    counts of results placed first, of those left (a tester saw 50 exact matches said of an answer holding 3)."""
    kept = {result.id for result in results}
    dropped = [result for result in response.results if result.id not in kept]

    def placed_in(dropped_results: list[SearchResult], counted: int, names: frozenset[str]) -> int:
        return max(0, counted - sum(any(f.retriever in names for f in r.found_by) for r in dropped_results))

    meta = response.meta
    fitted = _with_meta(
        response, budget=report, collapsed=list(notes.collapsed), expanded_context=list(notes.context),
        exact_symbol_matches=placed_in(dropped, meta.exact_symbol_matches, NAMED),
        relation_matches=placed_in(dropped, meta.relation_matches, RELATIONS),
    )  # fmt: skip
    return fitted.model_copy(update={"results": results})


def _without_content(result: SearchResult) -> SearchResult:
    if result.content is None:
        return result
    return result.model_copy(update={"content": None, "content_length": len(result.content)})


def _notes_in_room(meta: QueryMeta, results: list[SearchResult], room: int) -> Notes:
    """Of ``meta``'s entries about ``results``, in the results' rank order, as many as ``room`` bytes take."""
    rank = {result.id: position for position, result in enumerate(results)}
    entries: list[tuple[int, CollapsedResult | ExpandedContext]] = [
        (rank[entry.into], entry) for entry in meta.collapsed if entry.into in rank
    ]
    linked = meta.expanded_context
    entries += [(rank[e.linked_from_document_id], e) for e in linked if e.linked_from_document_id in rank]
    collapsed: list[CollapsedResult] = []
    context: list[ExpandedContext] = []
    for _, entry in sorted(entries, key=lambda ranked: ranked[0]):
        cost = _entry_cost(entry)
        if cost > room:
            break
        room -= cost
        if isinstance(entry, CollapsedResult):
            collapsed.append(entry)
        else:
            context.append(entry)
    return Notes(tuple(collapsed), tuple(context))


def _entry_cost(entry: CollapsedResult | ExpandedContext) -> int:
    """The bytes one of ``_meta``'s entries about results takes in an answer, and a comma."""
    return len(entry.model_dump_json().encode()) + 1


def _notes_size(notes: Notes) -> int:
    """The bytes ``notes`` take in an answer."""
    return sum(map(_entry_cost, notes.collapsed)) + sum(map(_entry_cost, notes.context))


def _steady(response: QueryResponse) -> QueryResponse:
    """``response`` without what another answer to the same question may say otherwise (VARYING_META_BYTES)."""
    return _with_meta(response, cache_hit=False, timings_ms={}, freshness=None)


def _cut_steadily(response: QueryResponse, limit: int, max_tokens: int) -> QueryResponse:
    """``response`` cut as its steady part (:func:`_steady`) is cut to ``limit`` less VARYING_META_BYTES; cut to
    ``limit`` as it is when what varies outgrows that room (timings of stages minutes long, say). Its report says
    what room was kept free (``reservedTokens``: an agent read content left out "for size" beside an estimate well
    under its budget, a tester's)."""
    try:
        steady = _cut(_steady(response), limit - VARYING_META_BYTES, max_tokens)
    except TooLarge:
        return _reserving(_cut(response, limit, max_tokens), RESERVE_BYTES)
    assert steady.meta.budget is not None
    notes = Notes(tuple(steady.meta.collapsed), tuple(steady.meta.expanded_context))
    fitted = _with_budget(response, steady.meta.budget, steady.results, notes)
    if len(_encoded(fitted)) > limit:
        return _reserving(_cut(response, limit, max_tokens), RESERVE_BYTES)
    return _reserving(fitted, RESERVE_BYTES + VARYING_META_BYTES)


def _reserving(fitted: QueryResponse, reserved_bytes: int) -> QueryResponse:
    assert fitted.meta.budget is not None
    reserved = math.ceil(reserved_bytes / BYTES_PER_TOKEN)
    return _with_meta(fitted, budget=fitted.meta.budget.model_copy(update={"reserved_tokens": reserved}))


def _cut(response: QueryResponse, limit: int, max_tokens: int) -> QueryResponse:
    bare = [_without_content(r) for r in response.results]

    def size(results: list[SearchResult]) -> int:
        return len(_encoded(_with_budget(response, _report(max_tokens), results, NO_NOTES)))

    # The results without their contents, as many (best ranked first) as fit with room for the report: counted
    # from the size of the answer with none and of each result, where trying each count serialised the whole
    # answer again (100 results: up to a hundred times, a sixth of a loaded worker's event loop), then checked whole.
    # A result too large to list even alone (metadata of any size is valid) is left out, not every result below it
    # with it: a tester's first hit with a 40 kB metadata field emptied the whole answer.
    alone = limit - RESERVE_BYTES - size([])
    # Room held, once a result is listed, for a slice of its content: a caller asking for many results on a small
    # budget got every result listed and not one content, the first's included (a tester's). Held only after the
    # first result listed: held before it, a first result that fitted alone but not beside the slice emptied the
    # answer (an agent tester's 1,000-token budget over a class of 745 lines).
    room, kept = alone, list[int]()
    for position, result in enumerate(bare):
        cost = len(result.model_dump_json().encode())
        if cost > alone:
            continue
        room -= cost + (1 if kept else 0)  # and the comma before it
        if room < 0:
            break
        if not kept and (first := response.results[position].content) is not None:
            room -= min(json_size(first) - len("null"), MIN_SLICE_BYTES)
        kept.append(position)
    skeleton = size([bare[k] for k in kept])
    while kept and skeleton + RESERVE_BYTES > limit:
        kept.pop()
        skeleton = size([bare[k] for k in kept])
    if skeleton > limit:
        raise TooLarge(f"even an answer without results exceeds the {limit} bytes it may have")
    # Then contents, in rank order, in the room left: once one is cut or left out, so is every one ranked below it
    # (a tester saw the first result's content left out and the second's kept, which fitted the little room left).
    spare = limit - skeleton - RESERVE_BYTES
    # Up to a share of it kept for what _meta says about the listed results (the context their links lead to, the
    # chunks collapsed into them): a large first content took it all, and an agent that asked followLinks got none
    # of the 17 small entries (an agent tester's).
    said = _notes_in_room(response.meta, [bare[k] for k in kept], spare)
    held_for_notes = min(_notes_size(said), spare // NOTES_SHARE)
    spare -= held_for_notes
    results: list[SearchResult] = []
    whole = True  # every content so far kept whole
    for position in kept:
        original, stripped = response.results[position], bare[position]
        content = original.content
        cost = 0 if content is None else json_size(content) - len("null")
        if content is None or (whole and cost <= spare):
            results.append(original)
            spare -= cost
        elif whole and spare >= MIN_SLICE_BYTES:
            results.append(stripped.model_copy(update={"content": cut_to(content, spare), "content_truncated": True}))
            spare, whole = 0, False
        else:
            results.append(stripped)
            whole = False
    # Then what _meta says about them, in the room still left and the room kept for them.
    notes = _notes_in_room(response.meta, results, spare + held_for_notes)
    # The reserve is an estimate: should the report outgrow it, the notes go, then contents from the lowest rank up.
    for kept_notes in (notes, NO_NOTES):
        fitted = _with_budget(
            response, _cut_report(max_tokens, response, kept, results, kept_notes), results, kept_notes
        )
        if len(_encoded(fitted)) <= limit:
            return fitted
    for index in reversed(range(len(results))):
        results[index] = bare[kept[index]]
        fitted = _with_budget(response, _cut_report(max_tokens, response, kept, results, NO_NOTES), results, NO_NOTES)
        if len(_encoded(fitted)) <= limit:
            return fitted
    raise TooLarge(f"the answer's report does not fit in {limit} bytes")


def _cut_report(
    max_tokens: int, response: QueryResponse, kept: list[int], results: list[SearchResult], notes: Notes
) -> BudgetReport:
    """``results``: what is left of the results at positions ``kept`` of ``response``'s."""
    originals = response.results
    cut = [r.id for r in results if r.content_truncated]
    omitted = sum(
        1 for k, r in zip(kept, results, strict=True) if originals[k].content is not None and r.content is None
    )
    return _report(max_tokens, cut, omitted, len(originals) - len(results), notes.dropped(response.meta))
