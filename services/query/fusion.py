"""Fusing ranked lists: Reciprocal Rank Fusion and convex combination of normalised scores (pure functions).

RRF (Cormack, Clarke and Buettcher, SIGIR 2009): score(d) = sum over lists of 1 / (k + rank). It ignores scores,
so a weak retriever pulls the fusion down as much as a strong one lifts it. A convex combination of min-max
normalised scores (Bruch, Gai and Ingber, TOIS 2023) lets the stronger retriever weigh more.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .core import DENSE, KEYWORD, Candidate

SHORT_LIST = 10
"""The places a keyword list's gap is read over: a list with fewer hits ran out of documents holding any query
term, within what it was asked (filters, depth)."""


@dataclass(frozen=True)
class SourceHit:
    rank: int
    score: float


@dataclass(frozen=True)
class Fused:
    id: str
    score: float
    """The fused score the list is sorted by (the RRF sum, or the convex combination)."""
    relevance: float
    """``score`` on a 0-1 scale: for RRF, 1.0 means ranked first by every list that ran. A later stage that
    reorders the candidates (late interaction, a reranker) replaces it with its own."""
    found_by: Mapping[str, SourceHit] = field(default_factory=dict)

    @property
    def best_rank(self) -> int:
        return min(hit.rank for hit in self.found_by.values())


def reciprocal_rank_fusion(
    ranked_lists: Mapping[str, Sequence[Candidate]], k: int = 60, limit: int | None = None
) -> list[Fused]:
    """Fuse ranked lists by name. One list comes back in its own order; ties break by best rank, then id."""
    if k < 1:
        raise ValueError("k must be at least 1")
    scores: dict[str, float] = {}
    found_by: dict[str, dict[str, SourceHit]] = {}
    for name, candidates in ranked_lists.items():
        seen: set[str] = set()
        for position, candidate in enumerate(candidates, start=1):
            if candidate.id in seen:  # a retriever listing a document twice counts once, at its best rank
                continue
            seen.add(candidate.id)
            scores[candidate.id] = scores.get(candidate.id, 0.0) + 1.0 / (k + position)
            found_by.setdefault(candidate.id, {})[name] = SourceHit(position, candidate.score)
    ceiling = len(ranked_lists) / (k + 1) if ranked_lists else 1.0
    fused = [Fused(doc_id, score, score / ceiling, found_by[doc_id]) for doc_id, score in scores.items()]
    fused.sort(key=lambda f: (-f.score, f.best_rank, f.id))
    return fused if limit is None else fused[:limit]


def min_max(candidates: Sequence[Candidate]) -> dict[str, float]:
    """Scores mapped onto [0, 1] within one list (all 1.0 when every score is equal)."""
    if not candidates:
        return {}
    scores = [c.score for c in candidates]
    low, high = min(scores), max(scores)
    span = high - low
    return {c.id: (c.score - low) / span if span > 0 else 1.0 for c in candidates}


def convex_fusion(
    ranked_lists: Mapping[str, Sequence[Candidate]], weights: Mapping[str, float], limit: int | None = None
) -> list[Fused]:
    """Weighted sum of min-max normalised scores; a document missing from a list scores 0 there.

    ``relevance`` is the weighted sum divided by the weights of the lists that ran, so it stays in [0, 1].
    """
    total_weight = sum(weights.get(name, 0.0) for name in ranked_lists) or 1.0
    combined: dict[str, float] = {}
    found_by: dict[str, dict[str, SourceHit]] = {}
    for name, candidates in ranked_lists.items():
        weight = weights.get(name, 0.0)
        normalised = min_max(candidates)
        for position, candidate in enumerate(candidates, start=1):
            if name in found_by.get(candidate.id, {}):
                continue
            combined[candidate.id] = combined.get(candidate.id, 0.0) + weight * normalised[candidate.id]
            found_by.setdefault(candidate.id, {})[name] = SourceHit(position, candidate.score)
    fused = [Fused(i, s, s / total_weight, found_by[i]) for i, s in combined.items()]
    fused.sort(key=lambda f: (-f.score, f.best_rank, f.id))
    return fused if limit is None else fused[:limit]


def keyword_gap(
    keyword: Sequence[Candidate], ceiling: float | None, coverage: Mapping[str, float] | None = None
) -> float:
    """How far the keyword top hit stands out, in [0, 1]: (s1 - mean(s2..s10)) / s1.

    A list shorter than ``SHORT_LIST`` ran out of documents holding any query term. Read over the places it did not
    fill too (as 0), it stands out further, up to its top hit's strength (its saturation, or its ``coverage`` where
    the backend states one: ``ran_out_scores``), so a few weak matches do not take the weight a decisive one would;
    that is its gap where it is more than the gap over the hits there are. A lone hit's gap is that strength. (Read
    over the hits there were alone, five documents that alone hold a rare word, equally, stood out by nothing: the
    weight went to dense, whose cosine cannot reach a document sent without vectors, and none of the five was in
    the answer: an outside tester's.) Without a ceiling or a coverage (a keyword backend that states neither)
    nothing bounds the zero places, and the gap is over the hits.
    """
    if not keyword or keyword[0].score <= 0:
        return 0.0
    top = keyword[0].score
    strength = ran_out_scores(keyword[:1], ceiling, coverage)[keyword[0].id]
    if len(keyword) == 1:
        return max(0.0, strength)
    rest = [c.score for c in keyword[1:SHORT_LIST]]
    over_the_hits = (top - sum(rest) / len(rest)) / top
    if len(keyword) < SHORT_LIST:
        with_the_places_unfilled = (top - sum(rest) / (SHORT_LIST - 1)) / top
        over_the_hits = max(over_the_hits, min(with_the_places_unfilled, strength))
    return max(0.0, min(1.0, over_the_hits))


def ran_out_scores(
    keyword: Sequence[Candidate], ceiling: float | None, coverage: Mapping[str, float] | None
) -> dict[str, float]:
    """What each hit of a list that ran out weighs, in [0, 1]: its saturation (its score over ``ceiling``), or, where
    the backend states each hit's ``coverage`` (``Hits.coverage`` says when), the share of the query's term weight
    the hit holds, times its score over the top hit's, where that is more.

    Every document that has a query term being among a handful, every query term is rare in the workspace, and then
    which of them a document holds is the evidence, not how often for its length: BM25's length normalisation
    scored one made-up word written once in a 90 KB function at 0.014 of its ceiling, dense took 0.95 of the weight
    with cosines for a word it never learned, and no holder was in the top 5 (an outside tester's). The score ratio
    keeps BM25's order among hits holding the same terms, where dense's cosines would otherwise decide it."""
    top = max((hit.score for hit in keyword), default=0.0)
    scores = {}
    for hit in keyword:
        strength = min(1.0, hit.score / ceiling) if ceiling and ceiling > 0 else 0.0
        held = None if coverage is None or top <= 0 else coverage.get(hit.id)
        by_terms = 0.0 if held is None else max(0.0, min(1.0, held * hit.score / top))
        scores[hit.id] = max(strength, by_terms)
    return scores


def adaptive_fusion(
    dense: Sequence[Candidate],
    keyword: Sequence[Candidate],
    keyword_ceiling: float | None,
    limit: int | None = None,
    query_ceiling: float | None = None,
    keyword_hits_dense: Mapping[str, float] | None = None,
    lexical: bool = False,
    keyword_coverage: Mapping[str, float] | None = None,
    dense_trust: tuple[float, float] | None = None,
) -> tuple[list[Fused], float, float]:
    """Convex fusion whose dense weight is set per query: ``1 - keyword_gap``, clamped to [0.05, 0.95], and
    lowered where the dense list found nothing near (``dense_trust``).

    ``lexical``: the query is one identifier written as code writes one (``symbols.code_shaped``), which a keyword
    hit holds as written: the keyword list leads (a gap of 1) whenever it has hits. Its top hit's saturation says
    little there: one rare name written once in a long file scores low by BM25's length normalisation, and took a
    weight of 0.08 against dense, whose cosine for a name it never learned is noise (an agent tester's name, found
    only in one file, came 34th).

    Scores are used on absolute scales, not stretched per list: cosine similarity for dense, and BM25 divided by
    the best score any document could reach for the query (its saturation) for keyword. A keyword list whose top
    hit barely beats the next nine (terms every candidate shares) then weighs little, one with a decisive top
    hit weighs much. Evidence: docs/quality.md. Returns the fused list, the dense weight and the gap.

    ``keyword_ceiling`` counts the query terms some document has; ``query_ceiling`` every query term, for the lone
    hit's saturation (a query term no document has makes a lone match weaker evidence).

    ``keyword_hits_dense``: the cosine of keyword hits the dense list did not return, when they were looked up; a
    hit still without one (it has no embedding) then takes the lowest cosine of all. Not looked up, every
    keyword-only hit takes the dense list's lowest cosine, an upper bound that lets them crowd out its tail.

    ``keyword_coverage``: each keyword hit's share of the query's term weight, where the backend states it (the
    query's terms are rare: ``Hits.coverage``). A list that ran out is then weighed and scored by it
    (``ran_out_scores``).

    ``dense_trust``: (unrelated, trusted) cosines of the dense list's model. Under ``trusted`` the dense list's top
    cosine says dense found nothing near: its weight shrinks in proportion (:func:`dense_share`), since the gap says
    only how sure keyword is, and where neither is, dense's order of documents unrelated to the query decided (an
    outside tester's rare number, first by keyword, came 75th).
    """
    gap = 1.0 if lexical and keyword else keyword_gap(keyword, query_ceiling or keyword_ceiling, keyword_coverage)
    weight = weight_by_gap(gap)
    if dense_trust is not None and dense and keyword:
        weight = max(0.05, weight * dense_share(dense[0].score, *dense_trust))
    top = max((c.score for c in keyword), default=0.0)
    ceiling = keyword_ceiling if keyword_ceiling and keyword_ceiling > 0 else (top if top > 0 else 1.0)
    dense_scores = {**(keyword_hits_dense or {}), **{c.id: c.score for c in dense}}
    dense_floor = min(dense_scores.values(), default=0.0)
    keyword_scores = {c.id: c.score / ceiling for c in keyword}
    if len(keyword) < SHORT_LIST and keyword_coverage is not None:
        keyword_scores = ran_out_scores(keyword, ceiling, keyword_coverage)
    found_by: dict[str, dict[str, SourceHit]] = {}
    for name, candidates in ((DENSE, dense), (KEYWORD, keyword)):
        for position, candidate in enumerate(candidates, start=1):
            found_by.setdefault(candidate.id, {}).setdefault(name, SourceHit(position, candidate.score))
    fused = []
    for doc_id, sources in found_by.items():
        score = weight * dense_scores.get(doc_id, dense_floor) + (1 - weight) * keyword_scores.get(doc_id, 0.0)
        fused.append(Fused(doc_id, score, max(0.0, min(1.0, score)), sources))
    fused.sort(key=lambda f: (-f.score, f.best_rank, f.id))
    return (fused if limit is None else fused[:limit]), weight, gap


def weight_by_gap(gap: float) -> float:
    """The dense weight the keyword list's gap gives, clamped to [0.05, 0.95]."""
    return min(0.95, max(0.05, 1.0 - gap))


def dense_share(top_cosine: float, unrelated: float, trusted: float) -> float:
    """How much of its weight a dense list keeps, in [0, 1], by its top cosine: all of it at ``trusted`` and over,
    none at ``unrelated`` and under, in proportion between."""
    if top_cosine >= trusted:
        return 1.0
    if top_cosine <= unrelated:
        return 0.0
    return (top_cosine - unrelated) / (trusted - unrelated)


@dataclass(frozen=True)
class FusionChoice:
    method: str
    parameters: dict[str, float]


def convex_weights(names: Sequence[str], dense_weight: float) -> dict[str, float]:
    """The dense list weighs ``dense_weight`` and the others share the rest; without a dense list all weigh alike."""
    others = [name for name in names if name != DENSE]
    if DENSE not in names:
        return {name: 1.0 / len(others) for name in others}
    return {DENSE: dense_weight} | {name: (1.0 - dense_weight) / len(others) for name in others}


def fuse(
    ranked_lists: Mapping[str, Sequence[Candidate]],
    method: str,
    *,
    rrf_k: int,
    dense_weight: float,
    keyword_ceiling: float | None = None,
    limit: int | None = None,
    query_ceiling: float | None = None,
    keyword_hits_dense: Mapping[str, float] | None = None,
    lexical: bool = False,
    keyword_coverage: Mapping[str, float] | None = None,
    dense_trust: tuple[float, float] | None = None,
) -> tuple[list[Fused], FusionChoice | None]:
    """Fuse with the chosen method; a single list keeps its order and needs no fusion (choice None).

    Adaptive fusion weighs a dense list against a keyword list; any other set of lists is fused by RRF, and the
    choice says so."""
    if len(ranked_lists) < 2:
        return reciprocal_rank_fusion(ranked_lists, k=rrf_k, limit=limit), None
    if method == "adaptive" and set(ranked_lists) == {DENSE, KEYWORD}:
        fused, weight, gap = adaptive_fusion(
            ranked_lists[DENSE],
            ranked_lists[KEYWORD],
            keyword_ceiling,
            limit,
            query_ceiling,
            keyword_hits_dense,
            lexical,
            keyword_coverage,
            dense_trust,
        )
        parameters = {"denseWeight": round(weight, 4), "keywordGap": round(gap, 4)}
        by_gap = weight_by_gap(gap)
        if weight < by_gap:  # dense found nothing near: it kept this share of what the gap gave it
            parameters["denseShare"] = round(weight / by_gap, 4)
        if keyword_hits_dense is not None:
            parameters["keywordHitsDenseScored"] = len(keyword_hits_dense)
        return fused, FusionChoice("adaptive", parameters)
    if method in ("rrf", "adaptive"):
        return reciprocal_rank_fusion(ranked_lists, k=rrf_k, limit=limit), FusionChoice("rrf", {"k": rrf_k})
    if method == "convex":
        weights = convex_weights(list(ranked_lists), dense_weight)
        return convex_fusion(ranked_lists, weights, limit), FusionChoice("convex", {"denseWeight": dense_weight})
    raise ValueError(f"unknown fusion method {method!r}")
