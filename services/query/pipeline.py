"""The query pipeline (seed 000 §6): cache → dense ∥ keyword → fusion → late interaction → (rerank) → reply with an
honest ``_meta``.

Every failure of a part shows in ``_meta.degraded`` and the answer is the best of what still ran; only when no
retriever at all could run does the caller get an error (:class:`RetrievalUnavailable`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Protocol, TypeVar

from ontofabric.contracts import FoundBy, OntologyQuery, QueryMeta, QueryResponse, SearchResult
from ontofabric.contracts.query import (
    ExpandedContext,
    FusionOptions,
    FusionReport,
    LateInteractionOptions,
    LateInteractionReport,
    QueryOptions,
)
from ontofabric.shared.embedder import Embedder, Vector
from ontofabric.shared.late_interaction import TokenMatrix, blend_with_fused_position, max_similarities, unpack_signs
from ontofabric.shared.logging import get_logger
from ontofabric.shared.telemetry import instruments, tracer

from .cache import CacheKey, VersionedCache, stable_hash
from .fusion import Candidate, Fused, fuse, keyword_gap
from .graph import GraphCache, GraphRows, expand
from .hints import reads_as_relationship_question
from .postgres import Fetched, Hits, Representatives, Scope, StoredDocument
from .rerankers import Reranker, check_ranking

log = get_logger(__name__)

T = TypeVar("T")

# Fused candidates kept per requested result, headroom for a reranker to reorder (seed 000 §6 step 4).
OVERSAMPLE = 1.5


class RetrievalUnavailable(Exception):
    """No retriever could run; the caller gets a retryable error."""


class Retrieval(Protocol):
    backend: str

    async def dense(self, scope: Scope, vector: Vector, limit: int) -> Hits: ...

    async def keyword(self, scope: Scope, text: str, limit: int) -> Hits: ...

    async def dense_scores(self, scope: Scope, vector: Vector, ids: Sequence[str]) -> Hits:
        """The dense score of each of ``ids`` live in the scope, in no particular order."""
        ...

    async def fetch(self, scope: Scope, ids: list[str], token_signs_of: Sequence[str] = ()) -> Fetched:
        """The documents of ``ids`` that are live in the scope, with token signs for those in ``token_signs_of``."""
        ...

    async def graph_rows(self, workspace: str, branch: str) -> GraphRows: ...

    async def representatives(self, scope: Scope, object_types: Sequence[str]) -> Representatives: ...


class VersionSource(Protocol):
    def current(self, workspace: str, branch: str) -> str: ...

    def generation(self, workspace: str) -> int: ...


@dataclass(frozen=True)
class PipelineConfig:
    retriever_top_k: int = 100
    fusion_method: str = "adaptive"
    rrf_k: int = 60
    dense_weight: float = 0.5
    early_exit_saturation: float = 0.8
    rerank_timeout_s: float = 1.5
    rerank_depth: int = 20
    late_interaction_weight: float = 0.2
    late_interaction_depth: int = 30
    late_interaction_max_query_tokens: int = 64
    expansion_max_types: int = 25


@dataclass
class _Answer:
    """What a cache entry holds: the results and the facts about how they were made."""

    results: list[SearchResult]
    version: str
    """ontologyVersion of the data the results were read from."""
    hybrid: bool
    retrievers: list[str]
    degraded: list[str]
    skipped_rerank: str | None
    could_benefit: bool
    fusion: FusionReport | None
    late_interaction: LateInteractionReport | None = None
    skipped_late_interaction: str | None = None
    reranked: bool = False
    reranker: str | None = None
    signals: dict[str, float] = field(default_factory=dict)
    expanded: list[ExpandedContext] = field(default_factory=list)
    expansion_truncated: bool = False


def above_the_rest(ranked: list[Fused], candidates: Sequence[Fused]) -> list[Fused]:
    """``ranked`` (a stage's order, best first, each with the relevance the stage gave it), then the candidates it
    did not rank, in their order, scaled under its lowest relevance: a score that says "lower", not "irrelevant"."""
    seen = {hit.id for hit in ranked}
    floor = ranked[-1].relevance if ranked else 0.0
    return ranked + [replace(hit, relevance=floor * hit.relevance) for hit in candidates if hit.id not in seen]


def keyword_signals(keyword: list[Candidate], ceiling: float | None, text: str) -> dict[str, float]:
    """What the keyword list says about the query: its top hit's saturation (over every query term, also those no
    document has) and how far that hit stands out."""
    signals = {"queryTokens": float(len(text.split()))}
    if keyword and ceiling:
        signals["keywordSaturation"] = round(keyword[0].score / ceiling, 4)
        signals["keywordGap"] = round(keyword_gap(keyword, ceiling), 4)
    return signals


def early_exit(signals: dict[str, float], text: str, threshold: float, max_tokens: int = 5) -> bool:
    """Seed 000 §6 step 5: a short query whose keyword top hit is saturated needs no reranker."""
    return signals.get("keywordSaturation", 0.0) >= threshold and signals["queryTokens"] < max_tokens


def late_interaction(
    query_tokens: TokenMatrix,
    candidates: list[Fused],
    documents: Mapping[str, StoredDocument],
    weight: float,
    depth: int,
) -> tuple[list[Fused], LateInteractionReport | None]:
    """The leading ``depth`` candidates reordered by their fused position blended with their MaxSim similarity to
    the query's tokens (over their stored token signs), each with the blend as its relevance; those after them
    keep their order, scaled under the lowest blended relevance. Unchanged (report None) when fewer than two
    leading candidates have token vectors: there is nothing to compare."""
    head = candidates[:depth]
    unpacked: dict[int, TokenMatrix] = {}
    for position, hit in enumerate(head):
        signs = documents[hit.id].token_signs
        with contextlib.suppress(ValueError):  # not this model's width: rank it as fused rather than fail the query
            if signs:
                unpacked[position] = unpack_signs(signs, query_tokens.shape[1])
    if weight <= 0 or len(unpacked) < 2:
        return candidates, None
    found = dict(zip(unpacked, max_similarities(query_tokens, list(unpacked.values())), strict=True))
    relevances = blend_with_fused_position([found.get(position) for position in range(len(head))], weight)
    order = sorted(range(len(head)), key=lambda i: (-relevances[i], i))
    ranked = [replace(head[i], relevance=relevances[i]) for i in order]
    report = LateInteractionReport(weight=weight, candidates=len(head), with_token_vectors=len(found))
    return above_the_rest(ranked, candidates), report


def _rerank_text(document: StoredDocument, limit: int = 2000) -> str:
    name = document.metadata.get("symbolFqn")
    text = f"{name}\n{document.content}" if name else document.content
    return text[:limit]


@dataclass
class _Stopwatch:
    timings: dict[str, float] = field(default_factory=dict)

    async def time(self, stage: str, work: Awaitable[T]) -> T:
        started = time.perf_counter()
        try:
            return await work
        finally:
            self.timings[stage] = round((time.perf_counter() - started) * 1000, 3)


def cache_key(query: OntologyQuery, workspace: str, version: str, generation: int = 0) -> CacheKey:
    params = query.model_dump(exclude={"semantic_query", "workspace", "branch"}, mode="json")
    return CacheKey(
        workspace, query.branch, version, stable_hash(query.semantic_query), stable_hash(params), generation
    )


class QueryPipeline:
    def __init__(
        self,
        retrieval: Retrieval,
        embedder: Embedder | None,
        versions: VersionSource,
        cache: VersionedCache[_Answer],
        config: PipelineConfig,
        reranker: Reranker | None = None,
    ) -> None:
        self._retrieval = retrieval
        self._graphs = GraphCache(retrieval.graph_rows)
        self._reranker = reranker
        self._embedder = embedder
        self._versions = versions
        self._cache = cache
        self._config = config
        self._metrics = instruments()

    async def answer(self, query: OntologyQuery, workspace: str) -> QueryResponse:
        started = time.perf_counter()
        clock = _Stopwatch()
        announced = self._versions.current(workspace, query.branch)
        generation = self._versions.generation(workspace)
        key = cache_key(query, workspace, announced, generation)
        cached = self._cache.get(key)
        if cached is not None:
            self._metrics.cache_hit.add(1)
            return self._respond(query, workspace, cached, True, clock, started)
        self._metrics.cache_miss.add(1)

        with tracer().start_as_current_span("query.retrieve"):
            answer = await self._retrieve(query, workspace, clock)
        # Cache only what is known to be the announced version's answer, read from the index that is still in
        # place (a rebuild keeps the version but replaces the index); a newer commit whose announcement is
        # still on its way is answered truthfully (its own version in _meta) but not cached under the old key.
        current = answer.version == announced and self._versions.generation(workspace) == generation
        if current and not set(answer.degraded) - {"embedder"}:
            self._cache.put(key, answer)
        return self._respond(query, workspace, answer, False, clock, started)

    async def _retrieve(self, query: OntologyQuery, workspace: str, clock: _Stopwatch) -> _Answer:
        degraded: list[str] = []
        read_versions: set[str] = set()  # of every snapshot this answer read: more than one means mixed states
        object_types = None
        if query.object_type is not None:
            object_types = await clock.time("narrowing", self._narrow(query, workspace, degraded, read_versions))
        scope = Scope(workspace, query.branch, object_types, query.chunk_level, query.provenance)
        options = query.options or QueryOptions()
        wanted = set(options.retrievers or ("dense", "keyword"))
        k = options.candidates or self._config.retriever_top_k
        query_tokens: TokenMatrix | None = None
        query_vector: Vector | None = None

        async def dense() -> Hits | None:
            nonlocal query_tokens, query_vector
            if "dense" not in wanted:
                return None
            if self._embedder is None:
                degraded.append("embedder")
                return None
            try:
                embedding = self._embedder.embed_query_with_tokens_async(query.semantic_query)
                vector, query_tokens = await clock.time("embed", embedding)
            except Exception as error:
                log.warning("embedder_failed", error=str(error))
                degraded.append("embedder")
                return None
            query_vector = vector
            return await _guarded("dense", clock.time("dense", self._retrieval.dense(scope, vector, k)), degraded)

        async def keyword() -> Hits | None:
            if "keyword" not in wanted:
                return None
            work = clock.time("keyword", self._retrieval.keyword(scope, query.semantic_query, k))
            hits = await _guarded("keyword", work, degraded)
            if hits is not None and hits.lagging:  # its index is behind the version read: say so, do not cache
                degraded.append("keywordIndexBehind")
            return hits

        dense_hits, keyword_hits = await asyncio.gather(dense(), keyword())
        lists = {name: hits for name, hits in (("dense", dense_hits), ("keyword", keyword_hits)) if hits is not None}
        if not lists:
            raise RetrievalUnavailable(f"no retriever could run ({', '.join(degraded)})")
        ranked = {name: hits.candidates for name, hits in lists.items()}
        self._metrics.candidates_dense.add(len(ranked.get("dense", [])))
        self._metrics.candidates_sparse.add(len(ranked.get("keyword", [])))

        asked = options.fusion or FusionOptions()
        method = asked.method or self._config.fusion_method
        keyword_hits_dense: dict[str, float] | None = None
        if method == "adaptive" and query_vector is not None and dense_hits is not None and keyword_hits is not None:
            # Adaptive fusion adds cosines on their own scale: a keyword hit dense did not return gets its real one.
            returned = {c.id for c in dense_hits.candidates}
            others = [c.id for c in keyword_hits.candidates if c.id not in returned]
            keyword_hits_dense = {}
            if others:
                scoring = clock.time("denseScores", self._retrieval.dense_scores(scope, query_vector, others))
                scored = await _guarded("denseScores", scoring, degraded)
                if scored is None:
                    keyword_hits_dense = None
                else:
                    read_versions.add(scored.version)
                    keyword_hits_dense = {c.id: c.score for c in scored.candidates}

        fusion_started = time.perf_counter()
        ceiling = lists["keyword"].ceiling if "keyword" in lists else None
        query_ceiling = lists["keyword"].query_ceiling if "keyword" in lists else None
        signals = keyword_signals(ranked.get("keyword", []), query_ceiling or ceiling, query.semantic_query)
        reranker, skipped_rerank = self._rerank_plan(query, signals)
        interaction = options.late_interaction or LateInteractionOptions()
        li_weight = self._config.late_interaction_weight if interaction.weight is None else interaction.weight
        li_depth = interaction.depth or self._config.late_interaction_depth
        interaction_tokens = query_tokens if li_weight > 0 else None  # none: late interaction does not run
        skipped_late_interaction = None
        too_long = (
            interaction_tokens is not None and len(interaction_tokens) > self._config.late_interaction_max_query_tokens
        )
        if too_long and interaction.weight is None:
            # On long queries it reordered the fused list worse than the fusion alone (docs/quality.md, "Late
            # interaction"); a request that sets its weight itself still gets it.
            interaction_tokens, skipped_late_interaction = None, "long_query"
        fused, fusion = fuse(
            ranked,
            method,
            rrf_k=asked.rrf_k or self._config.rrf_k,
            dense_weight=self._config.dense_weight if asked.dense_weight is None else asked.dense_weight,
            keyword_ceiling=ceiling,
            limit=self._fused_limit(query, reranker is not None, 0 if interaction_tokens is None else li_depth),
            query_ceiling=query_ceiling,
            keyword_hits_dense=keyword_hits_dense,
        )
        fusion_ms = (time.perf_counter() - fusion_started) * 1000
        clock.timings["fusion"] = round(fusion_ms, 3)
        self._metrics.fusion_duration.record(fusion_ms)

        compared = [] if interaction_tokens is None else [f.id for f in fused[:li_depth]]
        fetched = await clock.time("fetch", self._retrieval.fetch(scope, [f.id for f in fused], compared))
        documents = fetched.documents
        candidates = [f for f in fused if f.id in documents]
        interaction_report = None
        if interaction_tokens is not None and self._embedder is not None:
            # A few milliseconds of arithmetic, queued with the model's on its thread, off the event loop.
            work = partial(late_interaction, interaction_tokens, candidates, documents, li_weight, li_depth)
            try:
                candidates, interaction_report = await clock.time(
                    "lateInteraction", self._embedder.on_model_thread(work)
                )
            except Exception as error:  # keep the fused order: a query never fails for want of a refinement
                log.warning("late_interaction_failed", error=f"{type(error).__name__}: {error}")
                degraded.append("lateInteraction")
        reranked = False
        if reranker is not None:
            candidates, reranked = await self._rerank(reranker, query, candidates, documents, clock, degraded)
        kept = [hit for hit in candidates if query.min_relevance is None or hit.relevance >= query.min_relevance]
        results = [
            _result(rank, hit, documents[hit.id], query.include_content)
            for rank, hit in enumerate(kept[: query.top_k], start=1)
        ]
        expanded: list[ExpandedContext] = []
        truncated = False
        if query.follow_links and results:
            expanded, truncated = await clock.time(
                "expansion", self._expand(scope, fetched.version, results, degraded, read_versions)
            )
        read_versions |= {hits.version for hits in lists.values()} | {fetched.version}
        if len(read_versions) > 1 or len(documents) < len(fused):
            # A commit landed between the statements: the answer mixes two states. Say so; it is not cached.
            degraded.append("ontologyVersionChanged")
        for sink in degraded:
            self._metrics.degraded.add(1, {"sink": sink})
        return _Answer(
            results=results,
            version=fetched.version,
            hybrid=len(ranked) == 2,
            reranked=reranked,
            reranker=reranker.name if reranked and reranker is not None else None,
            retrievers=list(ranked),
            degraded=degraded,
            skipped_rerank=skipped_rerank,
            could_benefit=not query.follow_links and reads_as_relationship_question(query.semantic_query),
            fusion=FusionReport(method=fusion.method, parameters=fusion.parameters) if fusion else None,
            late_interaction=interaction_report,
            skipped_late_interaction=skipped_late_interaction,
            signals=signals,
            expanded=expanded,
            expansion_truncated=truncated,
        )

    async def _narrow(
        self, query: OntologyQuery, workspace: str, degraded: list[str], read_versions: set[str]
    ) -> tuple[str, ...]:
        """The requested objectType and, through the graph, its subtypes and implementors."""
        assert query.object_type is not None
        try:
            announced = self._versions.current(workspace, query.branch)
            graph = await self._graphs.get(workspace, query.branch, announced, self._versions.generation(workspace))
        except Exception as error:
            log.warning("graph_load_failed", error=f"{type(error).__name__}: {error}")
            degraded.append("objectTypeNarrowing")
            return (query.object_type,)
        read_versions.add(graph.version)
        return tuple(sorted(graph.with_subtypes(query.object_type)))

    async def _expand(
        self, scope: Scope, version: str, results: list[SearchResult], degraded: list[str], read_versions: set[str]
    ) -> tuple[list[ExpandedContext], bool]:
        """1-hop graph expansion (seed 000 DR-6): linked types of the hits' types, each with a representative, at
        most ``expansion_max_types`` of them (and whether there were more)."""
        bound = self._config.expansion_max_types
        try:
            generation = self._versions.generation(scope.workspace)
            graph = await self._graphs.get(scope.workspace, scope.branch, version, generation)
            # One past the bound, to know whether there were more.
            expansions = expand(graph, [(r.id, r.object_type) for r in results], limit=bound + 1)
            truncated, expansions = len(expansions) > bound, expansions[:bound]
            representatives = await self._retrieval.representatives(scope, [e.linked_type for e in expansions])
        except Exception as error:
            log.warning("graph_expansion_failed", error=f"{type(error).__name__}: {error}")
            degraded.append("graphExpansion")
            return [], False
        read_versions.add(graph.version)
        if representatives.version is not None:
            read_versions.add(representatives.version)
        return [
            ExpandedContext(
                linked_type=e.linked_type,
                link_name=e.link_name,
                direction=e.direction,
                linked_from_type=e.linked_from_type,
                linked_from_document_id=e.linked_from_document_id,
                representative_document_id=representatives.documents.get(e.linked_type),
            )
            for e in expansions
        ], truncated

    def _rerank_plan(self, query: OntologyQuery, signals: dict[str, float]) -> tuple[Reranker | None, str | None]:
        """The reranker that will run, or None and why not (no reason when precision was not asked)."""
        if not query.precision:
            return None, None
        if self._reranker is None:
            return None, "no_reranker"
        if early_exit(signals, query.semantic_query, self._config.early_exit_saturation):
            return None, "bm25_saturation"
        return self._reranker, None

    def _fused_limit(self, query: OntologyQuery, reranks: bool, interaction_depth: int) -> int:
        """Candidates kept after fusion: headroom over ``topK``, and at least the depth of late interaction and,
        when a reranker will run, of the reranker, so each sees the number of candidates its defaults were
        measured with."""
        limit = max(math.ceil(query.top_k * OVERSAMPLE), query.top_k, interaction_depth)
        return max(limit, self._config.rerank_depth) if reranks else limit

    async def _rerank(
        self,
        reranker: Reranker,
        query: OntologyQuery,
        candidates: list[Fused],
        documents: dict[str, StoredDocument],
        clock: _Stopwatch,
        degraded: list[str],
    ) -> tuple[list[Fused], bool]:
        """The reranker's order over the candidates, each with its relevance; the order given, and ``reranker`` in
        ``degraded``, when it fails."""
        sent = candidates[: self._config.rerank_depth]
        texts = [_rerank_text(documents[f.id]) for f in sent]
        started = time.perf_counter()
        try:
            ranking = await asyncio.wait_for(
                reranker.rerank(query.semantic_query, texts, len(texts)), self._config.rerank_timeout_s
            )
            ranked = [replace(sent[i], relevance=score) for i, score in check_ranking(ranking, len(sent))]
        except Exception as error:  # timeouts, HTTP failures, malformed answers: keep the order given
            log.warning("reranker_failed", reranker=reranker.name, error=f"{type(error).__name__}: {error}")
            degraded.append("reranker")
            return candidates, False
        finally:
            clock.timings["rerank"] = round((time.perf_counter() - started) * 1000, 3)
        # Candidates past the depth, or that the reranker left out, follow below the ranked ones.
        return above_the_rest(ranked, candidates), True

    def _respond(
        self,
        query: OntologyQuery,
        workspace: str,
        answer: _Answer,
        cache_hit: bool,
        clock: _Stopwatch,
        started: float,
    ) -> QueryResponse:
        total_ms = (time.perf_counter() - started) * 1000
        clock.timings["total"] = round(total_ms, 3)
        meta = QueryMeta(
            ontology_version=answer.version,
            workspace=workspace,
            branch=query.branch,
            hybrid=answer.hybrid,
            reranked=answer.reranked,
            reranker=answer.reranker,
            skipped_rerank=answer.skipped_rerank,
            cache_hit=cache_hit,
            degraded=list(answer.degraded),
            could_benefit_from_link_expansion=answer.could_benefit,
            expanded_context=answer.expanded,
            expanded_context_truncated=answer.expansion_truncated,
            backend=self._retrieval.backend,
            retrievers=answer.retrievers,
            fusion=answer.fusion,
            late_interaction=answer.late_interaction,
            skipped_late_interaction=answer.skipped_late_interaction,
            signals=answer.signals,
            timings_ms=clock.timings,
        )
        self._metrics.query_duration.record(
            total_ms,
            {
                "hybrid": answer.hybrid,
                "reranked": answer.reranked,
                "cacheHit": cache_hit,
                "backend": self._retrieval.backend,
                "followLinks": query.follow_links,
            },
        )
        return QueryResponse(results=answer.results, meta=meta)

    def invalidate(self, workspace: str, branch: str, version: str, rebuilt: bool = False) -> None:
        """A version moved: drop the workspace's answers and graphs that no longer match (main moves them all).
        After a rebuild every one of them was read from the replaced index: all go."""

        def current(of_branch: str) -> str:
            return self._versions.current(workspace, of_branch)

        if rebuilt:
            dropped, graphs = self._cache.drop_workspace(workspace), self._graphs.drop_workspace(workspace)
        else:
            dropped, graphs = (
                self._cache.invalidate_stale(workspace, current),
                self._graphs.drop_stale(workspace, current),
            )
        if dropped or graphs:
            log.info(
                "cache_invalidated", workspace=workspace, branch=branch, entries=dropped, graphs=graphs, rebuilt=rebuilt
            )


async def _guarded(name: str, work: Awaitable[Hits], degraded: list[str]) -> Hits | None:
    try:
        return await work
    except Exception as error:
        log.warning("retriever_failed", retriever=name, error=f"{type(error).__name__}: {error}")
        degraded.append(name)
        return None


def _result(rank: int, hit: Fused, document: StoredDocument, include_content: bool) -> SearchResult:
    """``hit.relevance`` is its score: the fused relevance, or the last stage's that reordered it."""
    return SearchResult(
        id=hit.id,
        score=round(hit.relevance, 6),
        rank=rank,
        content=document.content if include_content else None,
        object_type=document.object_type,
        source_domain=document.source_domain,
        metadata=document.metadata,
        found_by=[
            FoundBy(retriever=name, rank=source.rank, score=round(source.score, 6))
            for name, source in hit.found_by.items()
        ],
    )
