"""The pipeline's decisions, as pure functions: what the keyword list says about a query, which refinements will
reorder the fused candidates, how late interaction and a reranker's answer are merged into the order, and what a
result looks like. No I/O here; ``pipeline.py`` runs them in order."""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from ontofabric.contracts import ErrorDetail, FoundBy, OntologyQuery, SearchResult
from ontofabric.contracts.query import (
    LateInteractionOptions,
    LateInteractionReport,
    QueryOptions,
    SecondOpinionOptions,
    SecondOpinionReport,
)
from ontofabric.shared.late_interaction import (
    TokenMatrix,
    blend_with_fused_relevance,
    max_similarities_of_signs,
    token_count,
)
from ontofabric.shared.onnx_models import unpack_half

from .config import PipelineConfig
from .core import Candidate, StoredDocument
from .fusion import Fused, keyword_gap

OVERSAMPLE = 1.5
"""Fused candidates kept per requested result, headroom for a reranker to reorder (seed 000 §6 step 4)."""
COLLAPSE_OVERSAMPLE = 2.0
"""With nested chunks collapsed, more: each symbol may take several candidates' places."""

EARLY_EXIT_MAX_TOKENS = 5
"""Only queries shorter than this (in words) skip the reranker when the keyword top hit is saturated."""


def options_of(query: OntologyQuery) -> QueryOptions:
    return query.options or QueryOptions()


def keyword_signals(
    keyword: Sequence[Candidate], ceiling: float | None, text: str, coverage: Mapping[str, float] | None = None
) -> dict[str, float]:
    """What the keyword list says about the query: its top hit's saturation (over every query term, also those no
    document has), its share of the query's term weight where the backend states it (``Hits.coverage``), and how
    far that hit stands out (as adaptive fusion reads it for a query that is not one identifier)."""
    signals = {"queryTokens": float(len(text.split()))}
    if keyword and ceiling:
        signals["keywordSaturation"] = round(keyword[0].score / ceiling, 4)
        if coverage is not None and keyword[0].id in coverage:
            signals["keywordCoverage"] = round(coverage[keyword[0].id], 4)
        signals["keywordGap"] = round(keyword_gap(keyword, ceiling, coverage), 4)
    return signals


def early_exit(signals: Mapping[str, float], threshold: float, max_tokens: int = EARLY_EXIT_MAX_TOKENS) -> bool:
    """Seed 000 §6 step 5: a short query whose keyword top hit is saturated needs no reranker."""
    return signals.get("keywordSaturation", 0.0) >= threshold and signals["queryTokens"] < max_tokens


@dataclass(frozen=True)
class Refinements:
    """What will reorder this query's fused candidates, decided before fusion so that it keeps enough of them."""

    rerank: bool
    skipped_rerank: str | None
    """Why no reranker runs although precision was asked (none when it was not asked)."""
    interaction_tokens: TokenMatrix | None
    """The query's tokens when late interaction runs; None when it does not."""
    interaction_weight: float
    interaction_depth: int
    skipped_late_interaction: str | None
    fused_limit: int
    second_weight: float = 0.0
    """The second opinion's weight; 0 when it does not run."""
    second_depth: int = 0

    @classmethod
    def none(cls, fused_limit: int) -> Refinements:
        """Nothing reorders the candidates (a listing)."""
        return cls(False, None, None, 0.0, 0, None, fused_limit)


def unused_fusion_parameter(query: OntologyQuery, default_method: str) -> ErrorDetail | None:
    """A fusion parameter the deployment's method would ignore, for a request that names no method (the contract
    refuses another method's parameter beside a method named): said rather than dropped in silence."""
    asked = options_of(query).fusion
    if asked is None or asked.method is not None:
        return None
    if default_method == "convex" and asked.rrf_k is not None:
        return ErrorDetail(
            field="options.fusion.rrfK",
            message="this deployment fuses by convex, which has no rrfK; name method rrf (or adaptive) to use it",
        )
    if default_method in ("rrf", "adaptive") and asked.dense_weight is not None:
        return ErrorDetail(
            field="options.fusion.denseWeight",
            message=f"this deployment fuses by {default_method}, which takes no denseWeight; name method convex "
            "to use it",
        )
    return None


def second_opinion_weight(query: OntologyQuery, config: PipelineConfig) -> float:
    """The second opinion's weight for this query: the request's, else the deployment's (0: it does not run)."""
    asked = options_of(query).second_opinion or SecondOpinionOptions()
    return config.second_opinion_weight if asked.weight is None else asked.weight


def plan_refinements(
    query: OntologyQuery,
    config: PipelineConfig,
    signals: Mapping[str, float],
    query_tokens: TokenMatrix | None,
    reranker_available: bool,
    collapsing: bool = False,
    second_opinion_available: bool = False,
) -> Refinements:
    rerank, skipped_rerank = False, None
    if query.precision:
        if not reranker_available:
            skipped_rerank = "no_reranker"
        elif early_exit(signals, config.early_exit_saturation):
            skipped_rerank = "bm25_saturation"
        else:
            rerank = True
    asked = options_of(query).late_interaction or LateInteractionOptions()
    weight = config.late_interaction_weight if asked.weight is None else asked.weight
    depth = asked.depth or config.late_interaction_depth
    tokens = query_tokens if weight > 0 else None  # none: late interaction does not run
    skipped = "not_embedded" if query_tokens is None and asked.weight else None  # asked for, and not possible
    if tokens is not None and len(tokens) > config.late_interaction_max_query_tokens and asked.weight is None:
        # On long queries it reordered the fused list worse than the fusion alone (docs/quality.md, "Late
        # interaction"); a request that sets its weight itself still gets it.
        tokens, skipped = None, "long_query"
    # Headroom over topK, and at least the depth of late interaction, of the second opinion and, when a reranker
    # will run, of the reranker, so each sees the number of candidates its defaults were measured with.
    second_weight = second_opinion_weight(query, config) if second_opinion_available else 0.0
    second_depth = (options_of(query).second_opinion or SecondOpinionOptions()).depth or config.second_opinion_depth
    oversample = COLLAPSE_OVERSAMPLE if collapsing else OVERSAMPLE
    limit = max(math.ceil(query.top_k * oversample), query.top_k, 0 if tokens is None else depth)
    limit = max(limit, second_depth if second_weight > 0 else 0)
    if rerank:
        limit = max(limit, config.reranker_depth)
    return Refinements(rerank, skipped_rerank, tokens, weight, depth, skipped, limit, second_weight, second_depth)


def above_the_rest(ranked: list[Fused], candidates: Sequence[Fused]) -> list[Fused]:
    """``ranked`` (a stage's order, best first, each with the relevance the stage gave it), then the candidates it
    did not rank, in their order, scaled under its lowest relevance: a score that says "lower", not "irrelevant"."""
    seen = {hit.id for hit in ranked}
    floor = ranked[-1].relevance if ranked else 0.0
    return ranked + [replace(hit, relevance=floor * hit.relevance) for hit in candidates if hit.id not in seen]


def late_interaction(
    query_tokens: TokenMatrix,
    candidates: list[Fused],
    documents: Mapping[str, StoredDocument],
    weight: float,
    depth: int,
) -> tuple[list[Fused], LateInteractionReport | None]:
    """The leading ``depth`` candidates reordered by their fused relevance blended with their MaxSim similarity to
    the query's tokens (over their stored token signs), each with the blend as its relevance; those after them
    keep their order, scaled under the lowest blended relevance. Unchanged (report None) when fewer than two
    leading candidates have token vectors: there is nothing to compare."""
    head = candidates[:depth]
    dimension = query_tokens.shape[1]
    stored: dict[int, bytes] = {}
    for position, hit in enumerate(head):
        signs = documents[hit.id].token_signs
        with contextlib.suppress(ValueError):  # not this model's width: rank it as fused rather than fail the query
            if signs and token_count(signs, dimension):
                stored[position] = signs
    if weight <= 0 or len(stored) < 2:
        return candidates, None
    found = dict(zip(stored, max_similarities_of_signs(query_tokens, list(stored.values()), dimension), strict=True))
    relevances = blend_with_fused_relevance(
        [found.get(position) for position in range(len(head))], [hit.relevance for hit in head], weight
    )
    order = sorted(range(len(head)), key=lambda i: (-relevances[i], i))
    ranked = [replace(head[i], relevance=relevances[i]) for i in order]
    report = LateInteractionReport(weight=weight, candidates=len(head), with_token_vectors=len(found))
    return above_the_rest(ranked, candidates), report


RRF_K = 60
"""Reciprocal rank fusion's constant (Cormack et al., 2009), as in the fusion."""


def second_opinion(cosines: Sequence[float | None], weight: float) -> list[float]:
    """Each candidate's relevance, in the candidates' order: reciprocal rank fusion of its place in that order
    and its place by ``cosines`` (ties keep the given order), scaled so that first in both scores 1. A candidate
    without a cosine (None) keeps its given place in both; the others share the remaining places by cosine."""
    known = [i for i, cosine in enumerate(cosines) if cosine is not None]
    by_cosine = sorted(known, key=lambda i: (-(cosines[i] or 0.0), i))
    place = {i: known_place for known_place, i in zip(sorted(known), by_cosine, strict=True)}
    best = (1.0 + weight) / RRF_K
    return [(1.0 / (RRF_K + i) + weight / (RRF_K + place.get(i, i))) / best for i in range(len(cosines))]


def second_opinion_order(
    model: str,
    query_vector: npt.NDArray[np.float32],
    candidates: list[Fused],
    documents: Mapping[str, StoredDocument],
    weight: float,
    depth: int,
) -> tuple[list[Fused], SecondOpinionReport | None]:
    """The leading ``depth`` candidates reordered by :func:`second_opinion` of their order and their second
    vectors' cosines to the query's second vector, each with that fusion's relevance; those after them keep their
    order below, scaled under the lowest. Unchanged (report None) when fewer than two leading candidates have a
    second vector of the query's width: there is nothing to compare."""
    head = candidates[:depth]
    cosines: list[float | None] = []
    for hit in head:
        stored = documents[hit.id].second_vector
        vector = unpack_half(stored) if stored and len(stored) == 2 * len(query_vector) else None
        # A cosine whatever the sender's scale: the contract asks for a finite, non-zero vector, not a unit one.
        norm = 0.0 if vector is None else float(np.linalg.norm(vector) * np.linalg.norm(query_vector))
        cosines.append(float(vector @ query_vector) / norm if vector is not None and norm > 0 else None)
    found = sum(cosine is not None for cosine in cosines)
    if weight <= 0 or found < 2:
        return candidates, None
    relevances = second_opinion(cosines, weight)
    order = sorted(range(len(head)), key=lambda i: (-relevances[i], i))
    ranked = [replace(head[i], relevance=relevances[i]) for i in order]
    report = SecondOpinionReport(model=model, weight=weight, candidates=len(head), with_second_vectors=found)
    return above_the_rest(ranked, candidates), report


def rerank_text(document: StoredDocument, limit: int = 2000) -> str:
    """What a reranker reads of a document: its qualified name, then its content, cut at ``limit`` characters."""
    name = document.metadata.get("symbolFqn")
    text = f"{name}\n{document.content}" if name else document.content
    return text[:limit]


def reranked_order(
    ranking: Sequence[tuple[int, float]], sent: Sequence[Fused], candidates: Sequence[Fused]
) -> list[Fused]:
    """A reranker's checked ranking of the ``sent`` candidates, each with its relevance; the candidates past its
    depth follow below the ranked ones."""
    return above_the_rest([replace(sent[i], relevance=score) for i, score in ranking], candidates)


CODE_LEVELS = frozenset({"file", "type", "method"})
"""Chunk levels whose text is code, and so holds the chunks of what it defines."""


MAX_NESTED_NAME_CHARS = 4096
"""A qualified name longer than this is none that nesting is read from (the reference ingester's are at most 512
characters): each of its dotted prefixes is looked up, and an audit's name of 60,000 dots took 1.8 GB and 3 s of
every query that found it."""
MAX_NESTED_DEPTH = 64
"""At most this many of a name's outermost dotted prefixes are looked up as what may hold it."""


def _symbol_of(document: StoredDocument) -> tuple[str, str, str] | None:
    """(file, qualified name, chunk level) of a chunk that says where it is; None when it does not."""
    meta = document.metadata
    path, fqn, level = meta.get("filePath"), meta.get("symbolFqn"), meta.get("chunkLevel")
    if not (path and fqn and level) or len(fqn) > MAX_NESTED_NAME_CHARS:
        return None
    return path, fqn, level


def holds(outer: StoredDocument, inner: StoredDocument) -> bool:
    """Whether ``inner``'s text lies inside ``outer``'s: ``outer`` is code (a file, a class, a function), in the
    same file, and ``inner`` is something it defines (a method of the class, a class of the module) or its own
    docstring. A docstring or a document's section holds nothing: a module's docstring is not its classes."""
    a, b = _symbol_of(outer), _symbol_of(inner)
    if a is None or b is None or a[0] != b[0] or a[2] not in CODE_LEVELS:
        return False
    return b[1].startswith(a[1] + ".") or (b[1] == a[1] and b[2] == "doc")


def nested(one: StoredDocument, other: StoredDocument) -> bool:
    """One of the two chunks holds the other (see :func:`holds`)."""
    return holds(one, other) or holds(other, one)


def _dot_prefixes(name: str) -> list[str]:
    """Every ``prefix`` of ``name`` with ``name.startswith(prefix + ".")``: the names that define it."""
    return [name[:i] for i in itertools.islice((i for i, char in enumerate(name) if char == "."), MAX_NESTED_DEPTH)]


def code_before_its_docstring(
    candidates: Sequence[Fused], documents: Mapping[str, StoredDocument]
) -> tuple[list[Fused], dict[str, str]]:
    """The candidates in their order, but a function's or method's code ranked below its own docstring moved up to
    just before it, with the docstring's relevance when that is higher: collapsing then keeps the code, whose text
    holds the docstring, where it kept the docstring and left the code out (a tester's agent got a method's
    docstring, and the method itself only as an id in ``_meta``); and, for each code moved, the docstring it
    stands for (its score is the better of the two: one symbol). A class's or a module's docstring stays before
    its code: that holds every method of it, would fold those ranked below into itself, and may be long enough
    for the answer's budget to cut the one asked about."""
    code_at: dict[tuple[str, str], int] = {}
    for position, hit in enumerate(candidates):
        symbol = _symbol_of(documents[hit.id])
        if symbol is not None and symbol[2] == "method":
            code_at.setdefault((symbol[0], symbol[1]), position)
    moved: set[int] = set()
    order: list[Fused] = []
    stands_for: dict[str, str] = {}
    for position, hit in enumerate(candidates):
        if position in moved:
            continue
        symbol = _symbol_of(documents[hit.id])
        code = code_at.get((symbol[0], symbol[1])) if symbol is not None and symbol[2] == "doc" else None
        if code is not None and code > position and code not in moved:
            moved.add(code)
            order.append(replace(candidates[code], relevance=max(candidates[code].relevance, hit.relevance)))
            stands_for[candidates[code].id] = hit.id
        order.append(hit)
    return order, stands_for


def collapse_nested(
    candidates: Sequence[Fused], documents: Mapping[str, StoredDocument], kept_whole: Collection[str] = ()
) -> tuple[list[Fused], list[tuple[str, str]]]:
    """The candidates in their order without any whose text is inside, or holds, a better-ranked one's (see
    :func:`nested`); and (left out, kept) for each left out. ``kept_whole``: candidates that stay whatever holds
    them (the chunks standing in a relation asked: a module's own statements call, and so does its function).
    Kept chunks are indexed by file and name, so each candidate costs a lookup per level of its name rather than a
    comparison with every kept one."""
    kept: list[Fused] = []
    left_out: list[tuple[str, str]] = []
    # (file, name) -> position in ``kept`` of the best-ranked kept chunk that is code of that name, that is
    # named below that name, or that is the docstring of that name.
    code_named: dict[tuple[str, str], int] = {}
    named_below: dict[tuple[str, str], int] = {}
    doc_named: dict[tuple[str, str], int] = {}
    for hit in candidates:
        symbol = _symbol_of(documents[hit.id])
        if symbol is None:
            kept.append(hit)
            continue
        path, name, level = symbol
        holders = [code_named.get((path, prefix)) for prefix in _dot_prefixes(name)]
        if level == "doc":
            holders.append(code_named.get((path, name)))
        if level in CODE_LEVELS:
            holders += [named_below.get((path, name)), doc_named.get((path, name))]
        found = [position for position in holders if position is not None]
        if found and hit.id not in kept_whole:
            left_out.append((hit.id, kept[min(found)].id))
            continue
        position = len(kept)
        kept.append(hit)
        if level in CODE_LEVELS:
            code_named.setdefault((path, name), position)
        if level == "doc":
            doc_named.setdefault((path, name), position)
        for prefix in _dot_prefixes(name):
            named_below.setdefault((path, prefix), position)
    return kept, left_out


def to_results(
    query: OntologyQuery,
    candidates: Sequence[Fused],
    documents: Mapping[str, StoredDocument],
    scores: Mapping[str, float] | None = None,
    signals: Mapping[str, Mapping[str, float]] | None = None,
) -> list[SearchResult]:
    """The answer: candidates at or above ``minRelevance``, the first ``topK`` of them. Each one's score is its
    calibrated one from ``scores`` (which then holds every candidate the answer may take), or without them its
    ``relevance``: the fused one, or the last stage's that reordered it. ``signals``: what each was scored from."""

    def score(hit: Fused) -> float:
        return scores[hit.id] if scores is not None else hit.relevance

    scored = candidates if scores is None else [hit for hit in candidates if hit.id in scores]
    kept = [hit for hit in scored if query.min_relevance is None or score(hit) >= query.min_relevance]
    return [
        SearchResult(
            id=hit.id,
            score=round(score(hit), 6),
            rank=rank,
            content=documents[hit.id].content if query.include_content else None,
            # Left out, its length is said as the contract says (a tester found it null).
            content_length=None if query.include_content else len(documents[hit.id].content),
            object_type=documents[hit.id].object_type,
            source_domain=documents[hit.id].source_domain,
            metadata=documents[hit.id].metadata,
            found_by=[
                FoundBy(retriever=name, rank=source.rank, score=round(source.score, 6))
                for name, source in hit.found_by.items()
            ],
            signals=dict((signals or {}).get(hit.id, {})),
        )
        for rank, hit in enumerate(kept[: query.top_k], start=1)
    ]
