"""The query pipeline (seed 000 §6): cache → retrievers in parallel → fusion → late interaction → (rerank) →
(graph expansion) → reply with an honest ``_meta``.

:meth:`QueryPipeline._retrieve` is the whole read path, one stage call after another over a :class:`QueryRun`.
Every failure of a part shows in ``_meta.degraded`` and the answer is the best of what still ran; only when no
retriever at all could run does the caller get an error (:class:`RetrievalUnavailable`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial

import numpy as np
import numpy.typing as npt

from ontofabric.contracts import IMPORTS, MAIN_BRANCH, OntologyQuery, QueryResponse, SearchResult, nothing_indexed
from ontofabric.contracts.query import (
    RELATIONS_READ,
    CollapsedResult,
    DistanceMetricReport,
    ExpandedContext,
    Freshness,
    FusionOptions,
    FusionReport,
    RelationAsked,
    SecondOpinionReport,
)
from ontofabric.shared.embedder import Embedder
from ontofabric.shared.logging import get_logger
from ontofabric.shared.lru import LruCache
from ontofabric.shared.onnx_models import OnnxEmbedder
from ontofabric.shared.telemetry import instruments, tracer

from .cache import CacheKey, drop_stale, drop_workspace, stable_hash
from .calibration import Measured, model_for, result_signals
from .config import PipelineConfig
from .core import (
    DEFINING_LEVELS,
    DENSE,
    KEYWORD,
    NAMED_LISTED,
    Definitions,
    DocumentStore,
    EmbeddedQuery,
    Fetched,
    FreshnessSource,
    Hits,
    Reranker,
    Retriever,
    Scope,
    SearchInput,
    StoredDocument,
    VersionSource,
    check_ranking,
)
from .fusion import Fused, fuse
from .graph import GraphCache, OntologyGraph, expand
from .hints import reads_as_relationship_question, shape_of
from .messages import MessageAsked, message_asked, message_order, raises, written_by
from .names import republished_as
from .run import QueryRun, milliseconds_since
from .stages import (
    CODE_LEVELS,
    Refinements,
    above_the_rest,
    code_before_its_docstring,
    collapse_nested,
    holds,
    keyword_signals,
    late_interaction,
    options_of,
    plan_refinements,
    rerank_text,
    reranked_order,
    second_opinion_order,
    second_opinion_weight,
    to_results,
)
from .symbols import (
    ASKED_RELATIONS,
    BASE,
    CALLEE,
    CALLER,
    CONSTRUCTORS,
    IMPORTED,
    IMPORTER,
    MESSAGE,
    NAMED,
    RELATION_ASKED,
    RELATIONS,
    SUBCLASS,
    SYMBOL,
    FileAsked,
    code_shaped,
    definitions_first,
    file_asked,
    identifier_of,
    kind_asked,
    ranked_places,
    related_first,
    relation_of,
    with_assignment_lines,
)

log = get_logger(__name__)


COSINE_ONLY = (
    "the vector index ranks by cosine distance; for unit-length vectors, which the embedder produces, inner product "
    "and L2 distance rank in the same order"
)


# Under a deadline, how long before it each optional part must end: what follows it still needs the time (the
# fetch of the documents and the reply after retrieval; retrieval itself after the query's embedding).
EMBED_RESERVE_S = 0.05
REFILL_MAX = 50
"""The most candidates read to fill an answer that collapsing left short of topK."""
MESSAGE_CANDIDATES = 50
"""The leading candidates of keyword search (of every retriever, where it did not run) whose code is read for a
pasted message's template."""
MESSAGE_READ_S = 0.1
"""The most CPU time spent reading those chunks' literals (about 10 ms at the median over three installed
libraries)."""
RETRIEVAL_RESERVE_S = 0.02
ON_MAIN = "onMain"
"""The part that looks on main, for a branch, for what the branch lacks (``_meta.indexedOnMain``,
``relation.definedOnMain``): named in ``_meta.degraded`` when it fails."""
REFINEMENT_RESERVE_S = 0.01

NO_DEFINITIONS = Definitions({}, "")
EXPANSION_POOL_FACTOR = 4
"""Linked types read for an expansion, as a multiple of ``expansion_max_types``: those a document defines are
chosen first among them."""
BASES_LOOKED_UP = 16
"""The most bases a member a class inherits is looked for in (one indexed statement each, nearest first)."""


def _earliest(*indexes: int | None) -> int | None:
    """The least of those known; None when none is."""
    return min((index for index in indexes if index is not None), default=None)


class RetrievalUnavailable(Exception):
    """No retriever could run; the caller gets a retryable error, unless its timeout could never leave one time."""

    def __init__(self, message: str, *, out_of_time: bool = False, least_ms: float = 0.0) -> None:
        super().__init__(message)
        self.out_of_time = out_of_time
        """The retrievers were cut for the request's deadline, not failed: its caller gave too little time."""
        self.least_ms = least_ms
        """The timeout at or under which none of the asked retrievers is given any time (each must end its reserve
        before the deadline, and one that reads the query's vector the embedding's reserve too)."""


def cache_key(query: OntologyQuery, workspace: str, version: str, generation: int = 0) -> CacheKey:
    params = query.model_dump(exclude={"semantic_query", "workspace", "branch"}, mode="json")
    return CacheKey(
        workspace, query.branch, version, stable_hash(query.semantic_query), stable_hash(params), generation
    )


RELATION_TYPES_READ = 20 * RELATIONS_READ
"""Types a relation question over the graph reads the chunks of, nearest first, to find RELATIONS_READ with one."""


class QueryPipeline:
    def __init__(
        self,
        retrievers: Sequence[Retriever],
        documents: DocumentStore,
        embedder: Embedder | None,
        versions: VersionSource,
        cache: LruCache[CacheKey, bytes],
        config: PipelineConfig,
        reranker: Reranker | None = None,
        freshness: FreshnessSource | None = None,
        second: OnnxEmbedder | None = None,
    ) -> None:
        if not retrievers or len({r.name for r in retrievers}) != len(retrievers):
            raise ValueError("the pipeline needs retrievers, each with a name of its own")
        self._retrievers = list(retrievers)
        self._documents = documents
        self._graphs = GraphCache(documents.graph_rows)
        self._reranker = reranker
        self._second = second
        """The second embedding model, when the deployment stores second vectors: the query's own is made here."""
        self._freshness_source = freshness
        self._embedder = embedder
        self._versions = versions
        self._cache = cache
        self._in_flight: dict[CacheKey, tuple[asyncio.Future[QueryResponse | None], float | None]] = {}
        """Answers being made, by key, with their deadline: the same question asked meanwhile waits for it instead
        of making its own, when that answer is due no later than its own."""
        self._config = config
        self._calibration = config.calibration()
        self._metrics = instruments()
        # _meta.backend names the keyword retriever's.
        self.backend = next((r.backend for r in retrievers if r.name == KEYWORD), retrievers[0].backend)

    async def answer(
        self, query: OntologyQuery, workspace: str, deadline: float | None = None, queued_ms: float = 0.0
    ) -> QueryResponse:
        """``deadline``: when the reply is due (the event loop's clock); optional parts that cannot finish before
        it are skipped and named in ``_meta.degraded`` with ``deadline``. ``queued_ms``: how long the request
        waited in the worker before this, counted in the duration metric (``_meta.timingsMs.queue``)."""
        run = QueryRun(query, workspace, deadline=deadline)
        if queued_ms:
            run.timings["queue"] = round(queued_ms, 3)
        announced = self._versions.current(workspace, query.branch)
        generation = self._versions.generation(workspace)
        key = cache_key(query, workspace, announced, generation)
        raw = self._cache.get(key)
        shared = QueryResponse.model_validate_json(raw) if raw is not None else None
        if shared is not None:
            freshness, settled_since = await self._shared_freshness(workspace, query.branch, shared.meta.freshness)
            if settled_since:
                # Its maker read the position before the projector had acked deltas the answer may well hold (the
                # version's own, announced before its ack): a client waiting for indexedSeq to pass its write would
                # wait for the next version. Made anew once, it reads the position now.
                shared = None
        while shared is None and (making := self._in_flight.get(key)) is not None:
            # Asked again while being answered (a stampede of one question): wait for that answer, if it is due
            # no later than this one (else this one's deadline would pass waiting); one not fit to share (None)
            # hands on to whichever of the waiting makes it next.
            being_made, due = making
            if deadline is not None and (due is None or due > deadline):
                break
            shared = await asyncio.shield(being_made)
            if shared is not None:
                freshness, _ = await self._shared_freshness(workspace, query.branch, shared.meta.freshness)
        if shared is not None:
            self._metrics.cache_hit.add(1)
            # The stages as the run that made the answer timed them (what ran: a note on a name no chunk defines
            # read them, and went missing from a repeated question, an agent tester's); queue and total this one's.
            stages = {stage: ms for stage, ms in shared.meta.timings_ms.items() if stage not in ("queue", "total")}
            timings = stages | run.timings | {"total": milliseconds_since(run.started)}
            meta = shared.meta.model_copy(update={"cache_hit": True, "timings_ms": timings, "freshness": freshness})
            return self._recorded(query, shared.model_copy(update={"meta": meta}))
        self._metrics.cache_miss.add(1)
        if key in self._in_flight:  # one due later than this one is being made: its own, alongside
            return await self._make(run, query, key, announced, generation)
        made: asyncio.Future[QueryResponse | None] = asyncio.get_running_loop().create_future()
        self._in_flight[key] = (made, deadline)
        response = None
        try:
            response = await self._make(run, query, key, announced, generation)
            return response
        finally:
            del self._in_flight[key]
            made.set_result(response if response is not None and self._shareable(run) else None)

    def _shareable(self, run: QueryRun) -> bool:
        """What may answer the same question again: the announced version's answer, not degraded (a deployment
        without an embedder answers keyword-only every time: those are as good as it gets)."""
        cacheable = {"embedder"} if self._embedder is None else set()
        return set(run.degraded) <= cacheable

    async def _make(
        self, run: QueryRun, query: OntologyQuery, key: CacheKey, announced: str, generation: int
    ) -> QueryResponse:
        """The answer, made; kept in the cache when it is the announced version's."""
        # No stack trace recorded: no retriever running in time is a caller's short deadline as often as a fault,
        # and its span's status says it.
        with tracer().start_as_current_span("query.retrieve", record_exception=False) as span:
            results = await self._retrieve(run)
            if run.degraded:  # an answer with parts missing: found by its span, not by its metrics alone
                span.set_attribute("ontofabric.degraded", list(run.degraded))
        for part in run.degraded:
            self._metrics.degraded.add(1, {"sink": part})
        response = self._recorded(query, QueryResponse(results=results, meta=run.meta(self.backend)))
        # Cache only what is known to be the announced version's answer, read from the index that is still in
        # place (a rebuild keeps the version but replaces the index); a newer commit whose announcement is
        # still on its way is answered truthfully (its own version in _meta) but not cached under the old key.
        current = response.meta.ontology_version == announced and self._versions.generation(run.workspace) == generation
        # Nothing indexed there (a workspace that does not exist, or not yet): not kept, where a flood of made-up
        # names took the places of real tenants' answers (a many-tenant tester's).
        indexed = not nothing_indexed(response.meta.ontology_version)
        if current and indexed and self._shareable(run) and self._cache.keeps:
            # As JSON: one untracked object, where the answer's models are thousands the garbage collector would
            # walk at every full collection (a full cache made those take 400-900 ms, the worker stopped meanwhile).
            self._cache.put(key, response.model_dump_json().encode())
        return response

    async def _retrieve(self, run: QueryRun) -> list[SearchResult]:
        """The read path, stage by stage."""
        position = await self._position()  # before the first read: the answer holds every delta up to it
        scope = await self._scope(run)
        second_vector = self._second_query_vector(run)
        try:
            return await self._retrieve_in(run, scope, position, second_vector)
        finally:
            if second_vector is not None:
                second_vector.cancel()

    async def _retrieve_in(
        self,
        run: QueryRun,
        scope: Scope,
        position: int | None,
        second_vector: asyncio.Future[npt.NDArray[np.float32]] | None,
    ) -> list[SearchResult]:
        # Retrieval's reads up to the fetch share one snapshot where the store can; the refinements after it (late
        # interaction, the second opinion, a reranker's call) do not hold it.
        async with self._documents.session(scope):
            embedded, definitions, measured = None, NO_DEFINITIONS, Measured(None, {})
            reserve: list[Fused] = []
            if run.query.listing:
                fused, refinements = await self._list(run, scope)
            else:
                lookup = asyncio.ensure_future(self._definitions(run, scope))  # beside the retrievers
                try:
                    lists, embedded = await self._search(run, scope)
                    definitions = await lookup
                finally:
                    lookup.cancel()  # when no retriever could run, its snapshot is not held for nothing
                if not definitions.symbols:
                    definitions = await self._message_writers(run, scope, lists)
                refinements = self._plan(run, lists, embedded)
                fused, measured = await self._fuse(run, scope, lists, embedded)
                fused, reserve = fused[: refinements.fused_limit], fused[refinements.fused_limit :]
            fetched = await self._fetch(run, scope, fused, refinements, definitions)
        if (
            embedded is not None
            and fetched.model not in (None, embedded.model)
            and refinements.interaction_tokens is not None
        ):
            # The token signs read are another model's than the query's tokens (a model change swapped meanwhile);
            # said why, as every other skip is (a model-change tester's answer said lateInteraction degraded only).
            refinements = dataclasses.replace(refinements, interaction_tokens=None)
            run.degrade("lateInteraction")
            run.report(skipped_late_interaction="model_changed")
        documents = fetched.documents
        candidates = [hit for hit in fused if hit.id in documents]
        candidates = await self._late_interaction(run, refinements, candidates, documents)
        candidates = await self._second_opinion(run, refinements, candidates, documents, second_vector)
        candidates = await self._rerank(run, refinements, candidates, documents)
        ranked_before = {hit.id: index for index, hit in enumerate(candidates)}
        candidates = self._definitions_first(run, definitions, candidates, documents)
        ordered = candidates
        candidates, collapsed, stands_for = self._collapse(run, ordered, documents, definitions)
        if len(candidates) < run.query.top_k and reserve:
            # Collapsed below topK: the fused candidates after those fetched fill the answer (an independent
            # tester's LRUCache question got 1 result of 10 asked, its class holding the other 29 fetched).
            refill = await self._refill(run, scope, reserve, fetched.version)
            if refill:
                documents = {**documents, **refill}
                fused = fused + [hit for hit in reserve if hit.id in refill]
                ordered = above_the_rest(ordered, [hit for hit in reserve if hit.id in refill])
                candidates, collapsed, stands_for = self._collapse(run, ordered, documents, definitions)
        scores, scored_from = self._calibrated_scores(
            run, measured, candidates, fetched.model, ranked_before, stands_for
        )
        signals = measured.signals
        if scored_from:  # a result scored from its docstring's shows those (a tester's: scores not reproducible)
            signals = signals | {hit: signals.get(doc, {}) for hit, doc in scored_from.items()}
        results = to_results(run.query, candidates, documents, scores, signals)
        if definitions.assigning and (name := identifier_of(run.text)) is not None:
            contents = {doc_id: documents[doc_id].content for doc_id in definitions.assigning if doc_id in documents}
            # Parsed in a thread: the loop goes on serving others meanwhile (a review's: tens of ms a chunk).
            results = await asyncio.to_thread(
                with_assignment_lines, results, definitions.assigning, name, contents, definitions.publishing
            )
        if run.query.min_relevance is not None:  # a tester's agent read "0 results" as nothing there
            scored = len(candidates) if scores is None else sum(hit.id in scores for hit in candidates)
            run.report(below_min_relevance=max(0, min(run.query.top_k, scored) - len(results)))
        if collapsed:  # into a result the answer holds: minRelevance may have dropped the one it went into
            shown = {result.id for result in results}
            run.report(collapsed=[CollapsedResult(id=left, into=into) for left, into in collapsed if into in shown])
        if definitions.symbols:  # counted in the answer: after collapsing, the cut to topK and minRelevance
            placed = sum(any(f.retriever == definitions.found_by for f in r.found_by) for r in results)
            run.report(**{"exact_symbol_matches" if definitions.found_by in NAMED else "relation_matches": placed})
        if definitions.found_by in RELATIONS:
            run.report(relation_found=len(definitions.symbols))
        await self._expand(run, scope, fetched.version, results)
        run.settle(consistent=len(documents) == len({f.id for f in fused} | definitions.symbols.keys()))
        run.report(freshness=await self._freshness(run.workspace, run.query.branch, position))
        return results

    async def _scope(self, run: QueryRun) -> Scope:
        """The request's filters; an objectType widened, through the graph, to its subtypes and implementors."""
        query = run.query
        object_types: tuple[str, ...] | None = None
        if query.object_type is not None:
            object_types = (query.object_type,)
            work = self._announced_graph(run.workspace, query.branch)
            graph = await run.guarded("objectTypeNarrowing", work, stage="narrowing")
            if graph is not None:
                run.read(graph.version)
                object_types = tuple(sorted(graph.with_subtypes(query.object_type)))
        return Scope(
            run.workspace, query.branch, object_types, query.chunk_level, query.provenance, query.symbol_kind,
            tuple(query.paths) if query.paths else None, tuple(query.exclude_paths) if query.exclude_paths else None,
        )  # fmt: skip

    async def _list(self, run: QueryRun, scope: Scope) -> tuple[list[Fused], Refinements]:
        """No query text: what the filters select, in a stable order; nothing ranks or reorders it."""
        hits = await run.timed("listing", self._documents.listing(scope, run.query.top_k, run.query.offset))
        run.read(hits.version)
        run.report(
            listing=True,
            retrievers=[],
            hybrid=False,
            skipped_rerank="listing" if run.query.precision else None,
        )
        return [Fused(c.id, c.score, c.score) for c in hits.candidates], Refinements.none(len(hits.candidates))

    async def _search(self, run: QueryRun, scope: Scope) -> tuple[dict[str, Hits], EmbeddedQuery | None]:
        """Every asked retriever at once (all registered ones by default); the query is embedded once, for
        those that need it. Raises RetrievalUnavailable when none returned a list."""
        options = options_of(run.query)
        asked = set(options.retrievers or (r.name for r in self._retrievers))
        wanted = [r for r in self._retrievers if r.name in asked]
        # Never fewer than the answer's length: a single retriever's list would cut it, unsaid (a settings audit's).
        limit = max(options.candidates or self._config.retriever_top_k, run.query.top_k)
        embedding = asyncio.ensure_future(self._embed(run)) if any(r.needs_embedding for r in wanted) else None
        if embedding is None:
            run.embedded.set()
        else:
            embedding.add_done_callback(lambda _: run.embedded.set())

        async def search(retriever: Retriever) -> Hits | None:
            vector, model = None, None
            if retriever.needs_embedding:
                assert embedding is not None
                embedded = await embedding
                if embedded is None:
                    return None  # said once, as the embedder
                vector, model = embedded.vector, embedded.model
            work = retriever.search(scope, SearchInput(run.text, vector, model), limit)
            hits = await run.guarded(retriever.name, work, stage=retriever.name, reserve_s=RETRIEVAL_RESERVE_S)
            if hits is not None and hits.lagging:  # its index is behind the version read: say so, do not cache
                run.degrade(f"{retriever.name}IndexBehind")
            if hits is not None and hits.pruned:
                run.report(keyword_pruned=True)
            return hits

        try:
            found = await asyncio.gather(*(search(retriever) for retriever in wanted))
            embedded = await embedding if embedding is not None else None
        finally:
            if embedding is not None:
                embedding.cancel()
        lists = {r.name: hits for r, hits in zip(wanted, found, strict=True) if hits is not None}
        if not lists:
            # Only when time is all that was missing: each retriever cut, or the embedding it waited for.
            out_of_time = all(
                r.name in run.out_of_time or (r.needs_embedding and "embedder" in run.out_of_time) for r in wanted
            )
            reserves = (EMBED_RESERVE_S if r.needs_embedding else RETRIEVAL_RESERVE_S for r in wanted)
            least_s = min(reserves, default=RETRIEVAL_RESERVE_S)
            # Out of time, the stores did not answer in it (a fault tester's frozen database read "no retriever could
            # run (deadline, keyword, dense)").
            said = (
                f"no retriever answered in time: {', '.join(sorted(run.out_of_time))} did not answer within the "
                "request's time (slow, or not answering)"
                if out_of_time
                else f"no retriever could run ({', '.join(run.degraded)})"
            )
            raise RetrievalUnavailable(said, out_of_time=out_of_time, least_ms=least_s * 1000)
        for name, hits in lists.items():
            run.read(hits.version)
            if hits.embedding_model is not None:  # embedded again by the index's model: that one ranked it
                run.report(embedding_model=hits.embedding_model)
            self._metrics.candidates(name).add(len(hits.candidates))
        return lists, embedded

    async def _embed(self, run: QueryRun) -> EmbeddedQuery | None:
        if self._embedder is None:
            run.degrade("embedder")
            return None
        # The model's name together with the call that embeds by it: a model change may switch the embedder.
        model, embedding_call = (
            self._embedder.model_name,
            self._embedder.embed_query_with_tokens_async(run.text, run.workspace),
        )
        embedding = await run.guarded("embedder", embedding_call, stage="embed", reserve_s=EMBED_RESERVE_S)
        if embedding is None:
            return None
        requested = run.query.distance_metric
        note = None if requested == "cosine" else COSINE_ONLY
        run.report(
            distance_metric=DistanceMetricReport(requested=requested, ran="cosine", note=note), embedding_model=model
        )
        return EmbeddedQuery(*embedding, model=model)

    def _plan(self, run: QueryRun, lists: dict[str, Hits], embedded: EmbeddedQuery | None) -> Refinements:
        keyword = lists.get(KEYWORD)
        ceiling = None if keyword is None else keyword.query_ceiling or keyword.ceiling
        signals = keyword_signals(
            keyword.candidates if keyword else [], ceiling, run.text, keyword.coverage if keyword else None
        )
        tokens = None if embedded is None else embedded.tokens
        refinements = plan_refinements(
            run.query,
            self._config,
            signals,
            tokens,
            self._reranker is not None,
            self._collapses(run.query),
            second_opinion_available=self._second is not None,
        )
        second_asked = options_of(run.query).second_opinion
        run.report(
            signals=signals,
            skipped_rerank=refinements.skipped_rerank,
            skipped_late_interaction=refinements.skipped_late_interaction,
            skipped_second_opinion=(
                "not_configured" if second_asked and second_asked.weight and self._second is None else None
            ),
            could_benefit_from_link_expansion=not run.query.follow_links and reads_as_relationship_question(run.text),
        )
        return refinements

    async def _fuse(
        self, run: QueryRun, scope: Scope, lists: dict[str, Hits], embedded: EmbeddedQuery | None
    ) -> tuple[list[Fused], Measured]:
        """The fused candidates, all of them, and what each retriever measured of them (for their calibrated
        scores)."""
        asked = options_of(run.query).fusion or FusionOptions()
        method = asked.method or self._config.fusion_method
        # Adaptive fusion adds cosines on their own scale: a keyword hit dense did not return gets its real one.
        keyword_hits_dense = None
        if method == "adaptive" and embedded is not None and lists.keys() == {DENSE, KEYWORD}:
            keyword_hits_dense = await self._keyword_hits_dense(run, scope, lists, embedded)
        keyword = lists.get(KEYWORD)
        started = time.perf_counter()
        fused, choice = fuse(
            {name: hits.candidates for name, hits in lists.items()},
            method,
            rrf_k=asked.rrf_k or self._config.rrf_k,
            dense_weight=self._config.fusion_dense_weight if asked.dense_weight is None else asked.dense_weight,
            keyword_ceiling=keyword.ceiling if keyword else None,
            query_ceiling=keyword.query_ceiling if keyword else None,
            keyword_hits_dense=keyword_hits_dense,
            lexical=(name := identifier_of(run.text)) is not None and code_shaped(name),
            keyword_coverage=keyword.coverage if keyword else None,
            dense_trust=self._dense_trust(lists.get(DENSE), embedded),
        )
        run.timings["fusion"] = milliseconds_since(started)
        self._metrics.fusion_duration.record(run.timings["fusion"])
        run.report(
            retrievers=list(lists),
            # Fused only when both found something: a query of stop words alone gives keyword nothing to search.
            hybrid=all(name in lists and lists[name].candidates for name in (DENSE, KEYWORD)),
            fusion=FusionReport(method=choice.method, parameters=choice.parameters) if choice else None,
        )
        dense, ceiling = lists.get(DENSE), None if keyword is None else keyword.query_ceiling or keyword.ceiling
        measured = Measured(
            model_for(lists, keyword_scaled=bool(ceiling)),
            result_signals(
                None if dense is None else dense.candidates,
                None if keyword is None else keyword.candidates,
                ceiling,
                keyword_hits_dense,
                keyword.coverage if keyword else None,
            ),
        )
        return fused, measured

    def _dense_trust(self, dense: Hits | None, embedded: EmbeddedQuery | None) -> tuple[float, float] | None:
        """The cosines bounding how far the fusion trusts a dense list (``adaptive_fusion``): only for the model
        they were measured with, whose cosine scale they are. The list's model is the index's: the query's own
        where the index holds it, else the one the dense search embedded the query by again (a review's)."""
        config = self._config
        if dense is None or embedded is None:
            return None
        if (dense.embedding_model or embedded.model) != config.fusion_dense_cosine_model:
            return None
        return config.fusion_dense_unrelated_cosine, config.fusion_dense_trusted_cosine

    async def _keyword_hits_dense(
        self, run: QueryRun, scope: Scope, lists: dict[str, Hits], embedded: EmbeddedQuery
    ) -> dict[str, float] | None:
        """The cosine of each keyword hit the dense list did not return; None when they could not be read."""
        returned = {c.id for c in lists[DENSE].candidates}
        others = [c.id for c in lists[KEYWORD].candidates if c.id not in returned]
        if not others:
            return {}
        work = self._documents.similarities(scope, SearchInput(run.text, embedded.vector, embedded.model), others)
        scored = await run.guarded("denseScores", work, stage="denseScores", reserve_s=RETRIEVAL_RESERVE_S)
        if scored is None:
            return None
        run.read(scored.version)
        return {c.id: c.score for c in scored.candidates}

    async def _definitions(self, run: QueryRun, scope: Scope) -> Definitions:
        """When the query is one identifier: the chunks defining a symbol of that name; when it is a file's path
        (``symbols.file_asked``): that file's chunks; when it asks one relation of a named symbol
        (``symbols.relation_of``): the chunks standing in that relation to it."""
        related_to = run.query.related_to
        asked = options_of(run.query).exact_symbols
        if related_to is None and not (self._config.exact_symbols if asked is None else asked):
            return NO_DEFINITIONS
        relation = (
            relation_of(run.text) if related_to is None else (ASKED_RELATIONS[related_to.relation], related_to.symbol)
        )
        name = identifier_of(run.text) if related_to is None else None
        path = file_asked(run.text) if related_to is None else None
        if path is not None:
            work = self._file_or_name(scope, path, name)
        elif name is not None:
            work = self._definitions_of(scope, name)
        elif relation is not None:
            work = self._related(run, scope, *relation)
        else:
            return NO_DEFINITIONS
        if name is None and relation is not None:
            work = self._checking_the_name(scope, relation[1], work)
        # A file's lookup under a name of its own: the gateway says "no such file" only where one ran (a tester's
        # gateway, newer than its worker, said it of files the worker had not looked up).
        part = "exactFile" if path is not None else "exactSymbol"
        found = await run.guarded(part, work, stage=part, reserve_s=RETRIEVAL_RESERVE_S)
        if found is None:
            return NO_DEFINITIONS
        run.read(found.version)
        # A name or path the branch deleted, renamed or moved: said, as for a relation's name below (an agent
        # tester's read "not indexed" of what main still holds).
        if not found.symbols and not scope.on_main and await self._indexed_on_main(run, scope, path, name):
            run.report(indexed_on_main=True)
        if name is None and relation is not None:
            # A name the branch deleted or renamed: not to be taken for a misspelt one (an agent tester's, asking
            # what still called the class it had renamed); its callers are what still calls main's.
            on_main = (
                not found.symbol_indexed and not scope.on_main and await self._defined_on_main(run, scope, relation[1])
            )
            if on_main and relation[0] == CALLER:
                found = await self._still_calling(run, scope, relation[1]) or found
            several = len(found.named) > 1  # an agent tester's callers of three get_command, merged unsaid
            run.report(
                relation=RelationAsked(
                    relation=RELATION_ASKED[relation[0]],
                    symbol=relation[1],
                    symbol_indexed=bool(found.symbol_indexed),
                    symbols_named=list(found.named[:NAMED_LISTED]) if several else None,
                    more_symbols_named=len(found.named) > NAMED_LISTED or None,
                    defined_on_main=on_main or None,
                )
            )
        return found

    async def _message_writers(self, run: QueryRun, scope: Scope, lists: Mapping[str, Hits]) -> Definitions:
        """When the query pastes an error or log message (``messages.message_asked``): the chunks of code among the
        retrievers' leading candidates whose string literals write it (``messages.written_by``), the innermost of
        those holding one another (the method, not its class and module, which hold the same literal)."""
        asked = options_of(run.query).exact_symbols
        if run.query.related_to is not None or not (self._config.exact_symbols if asked is None else asked):
            return NO_DEFINITIONS
        message = message_asked(run.text)
        if message is None:
            return NO_DEFINITIONS
        # Keyword search's: the message's own words are what it matches, the filled-in values aside; a long
        # function writing it ranks low by its meaning (an agent tester's: keyword 1st, dense 87th). Read every
        # list only where it did not run.
        named = [KEYWORD] if KEYWORD in lists else list(lists)
        ids = list(dict.fromkeys(c.id for n in named for c in lists[n].candidates[:MESSAGE_CANDIDATES]))
        found = await run.guarded(
            "exactMessage",
            self._writers(scope, message, ids),
            stage="exactMessage",
            reserve_s=RETRIEVAL_RESERVE_S,
        )
        if found is None:
            return NO_DEFINITIONS
        run.read(found.version)
        return found

    async def _writers(self, scope: Scope, message: MessageAsked, ids: Sequence[str]) -> Definitions:
        fetched = await self._documents.fetch(scope, ids)
        # In the retriever's order: within the budget below, its leading candidates are read first.
        documents = fetched.documents
        code = {
            doc_id: documents[doc_id]
            for doc_id in ids
            if doc_id in documents and documents[doc_id].metadata.get("chunkLevel") in CODE_LEVELS
        }

        def read() -> dict[str, float]:
            # Within a budget of this thread's CPU: a thread cannot be cut at the deadline, and holds the
            # interpreter's lock between its own waits (the chunks read past it are not looked at). Not of wall
            # time: on a loaded host the time waited for a core or the lock would cut the read short.
            until, shares = time.thread_time() + MESSAGE_READ_S, {}
            for doc_id, document in code.items():
                if time.thread_time() > until:
                    break
                shares[doc_id] = written_by(
                    message.text, document.content, str(document.metadata.get("symbolFqn") or ""), until
                )
            return shares

        # Up to 50 chunks' code read: in a thread, the loop serving others meanwhile.
        shares = await asyncio.to_thread(read)
        writing = {doc_id: share for doc_id, share in shares.items() if share > 0}
        innermost = {
            doc_id: share
            for doc_id, share in writing.items()
            if not any(other != doc_id and holds(code[doc_id], code[other]) for other in writing)
        }
        raised = message.raised
        raising = {doc_id for doc_id in innermost if raised is not None and raises(code[doc_id].content, raised)}
        return Definitions(
            {doc_id: str(code[doc_id].metadata.get("symbolFqn") or code[doc_id].object_type) for doc_id in innermost},
            fetched.version,
            modules=frozenset(d for d in innermost if code[d].metadata.get("chunkLevel") == "file"),
            found_by=MESSAGE,
            distances=message_order(innermost, raising),
        )

    async def _file_or_name(self, scope: Scope, asked: FileAsked, name: str | None) -> Definitions:
        """The file the query is the path of; when none is indexed and the path reads as a dotted name too
        (``console.py``), the definitions of a symbol of that name."""
        found = await self._documents.files(scope, asked.path, RELATIONS_READ, asked.line, asked.name)
        if found.symbols or name is None:
            return found
        return await self._definitions_of(scope, name)

    async def _definitions_of(self, scope: Scope, name: str) -> Definitions:
        """The chunks defining the symbol ``name`` names; for a member its class inherits (``Retrying.copy``), the
        member's definition in the nearest base defining it, named as asked."""
        found = await self._documents.definitions(scope, name, RELATIONS_READ)
        if found.symbols or "." not in name:  # only a member's name can be inherited
            return found
        if scope.filtered and (await self._documents.definitions(scope.unfiltered, name, 1)).symbols:
            return found  # the class's own, which a filter hides: no base's stands in for it (a review's)
        inherited = await self._inherited(scope, name)
        if inherited is None:
            return found
        through = await self._documents.definitions(scope, inherited, RELATIONS_READ)
        return dataclasses.replace(through, symbols={doc_id: name for doc_id in through.symbols})

    async def _announced_graph(self, workspace: str, branch: str) -> OntologyGraph:
        """The branch's graph at its announced version (or the newer one the load read: its version says)."""
        version = self._versions.current(workspace, branch)
        return await self._graphs.get(workspace, branch, version, self._versions.generation(workspace))

    async def _inherited(self, scope: Scope, name: str) -> str | None:
        """The qualified name of what ``Class.member`` names through the class's bases in the graph, the first
        defining it in their resolution order (:meth:`OntologyGraph.resolution_order`), when the class does not
        define it itself; None otherwise. An outside tester's "callers
        of Retrying.copy" (the tool description's own example) was told no such symbol is indexed: tenacity's
        ``Retrying`` inherits ``copy`` from ``BaseRetrying``."""
        owner, dot, member = name.rpartition(".")
        if not dot or not owner or not member:
            return None
        graph = await self._announced_graph(scope.workspace, scope.branch)
        bases = [base for named in graph.named(owner) for base in graph.resolution_order(named)]
        for base in list(dict.fromkeys(bases))[:BASES_LOOKED_UP]:
            if (await self._documents.definitions(scope.unfiltered, f"{base}.{member}", 1)).symbols:
                return f"{base}.{member}"
        return None

    async def _inheriting(self, scope: Scope, class_name: str, member: str) -> list[str]:
        """The subclasses of the class that run its ``member`` as their own, nearest first: those that derive from
        it alone and do not define it, and theirs; at most BASES_LOOKED_UP subclasses looked at (one indexed
        statement each). A subclass of several bases is left out: another base before it may define the member (a
        review's mixin)."""
        graph = await self._announced_graph(scope.workspace, scope.branch)
        inheriting: list[str] = []
        frontier, looked = graph.named(class_name), 0
        while frontier and looked < BASES_LOOKED_UP:
            below = [
                subclass
                for parent in frontier
                for subclass in graph.derived(parent)
                if len(graph.interfaces.get(subclass, ())) == 1
            ]
            frontier = []
            for subclass in below[: BASES_LOOKED_UP - looked]:
                looked += 1
                if not (await self._documents.definitions(scope.unfiltered, f"{subclass}.{member}", 1)).symbols:
                    inheriting.append(subclass)
                    frontier.append(subclass)
        return list(dict.fromkeys(inheriting))

    async def _related(self, run: QueryRun, scope: Scope, relation: str, name: str) -> Definitions:
        """The chunks standing in ``relation`` to the symbol ``name`` names; a dotted name a package publishes a
        symbol under (``click.echo``: ``click.utils.echo``) stands for that symbol (a tester's callers of
        click.echo were told no such symbol is indexed), and a member a class inherits for the base's."""
        # A class is called to make one: an agent tester's callers of Console.__init__ found none, though
        # Console(...) is called in many places. The class as asked (by the name its package publishes it under,
        # its own), before a base's constructor stands in for an inherited one (a review's: callers of
        # Sub.__init__ were Base(...)'s; another's: pkg.Widget.__init__, published so, found none).
        made_by, inherited = None, None
        imports = relation in (IMPORTER, IMPORTED)
        if "." in name or imports:
            # Imports are of modules: a Rust module's path in its crate names its file (a function of that name in
            # the crate root, `pub fn backoff`, is published under it too: a retest's).
            published = await self._documents.definitions(scope.unfiltered, name, RELATIONS_READ if imports else 1)
            name = (published.module_named if imports else None) or published.published_as or name
            owner, _, member = name.rpartition(".")
            made_by = owner if relation == CALLER and member in CONSTRUCTORS else None
            if not published.symbols and relation in (CALLER, CALLEE):
                inherited = await self._inherited(scope, name)
                name = inherited or name
        if relation in (CALLER, CALLEE):
            calls = self._documents.callers if relation == CALLER else self._documents.callees
            if made_by is None:
                return await calls(scope, name, RELATIONS_READ)
            made = await calls(scope, made_by, RELATIONS_READ)
            if inherited is not None:  # the base's constructor's callers are its other subclasses' (a review's)
                return made
            # And a subclass's call runs the constructor it inherits (a tester's callers of h11's
            # ProtocolError.__init__ were none, where LocalProtocolError(...) is called 23 times).
            for subclass in await self._inheriting(scope, made_by, name.rpartition(".")[2]):
                more = await calls(scope, subclass, RELATIONS_READ)
                made = dataclasses.replace(
                    made, symbols=made.symbols | more.symbols, modules=made.modules | more.modules
                )
            found = await calls(scope, name, RELATIONS_READ)
            return dataclasses.replace(
                found,
                symbols=found.symbols | made.symbols,
                modules=found.modules | made.modules,
                symbol_indexed=found.symbol_indexed or made.symbol_indexed,
                # The classes named so: a constructor is its class's, not a second symbol.
                named=tuple(dict.fromkeys([*(n.rpartition(".")[0] for n in found.named), *made.named])),
            )
        return await self._related_in_graph(run, scope, relation, name)

    async def _still_calling(self, run: QueryRun, scope: Scope, name: str) -> Definitions | None:
        """The branch's chunks that still call main's symbol of that name, which the branch deleted or renamed:
        those it left unchanged (main's calls name it) and those it changed (an ingest keeps a call of a name the
        tree's module no longer binds, :meth:`graph._Resolver.unbound`); a constructor's are its class's (a
        review's). None when there are none or the lookup failed."""
        owner, _, member = name.rpartition(".")
        found: Definitions | None = None
        for called in [name, owner] if owner and member in CONSTRUCTORS else [name]:
            work = self._documents.callers(scope, called, RELATIONS_READ, named_on_main=True)
            more = await run.guarded("exactSymbol", work, reserve_s=RETRIEVAL_RESERVE_S)
            if more is None:
                return None
            run.read(more.version)
            found = more if found is None else dataclasses.replace(
                found, symbols=found.symbols | more.symbols, modules=found.modules | more.modules
            )  # fmt: skip
        if found is None or not found.symbols:
            return None
        return dataclasses.replace(found, symbol_indexed=False)

    async def _indexed_on_main(self, run: QueryRun, scope: Scope, path: FileAsked | None, name: str | None) -> bool:
        """Whether main holds, within the scope's filters, a chunk of the file or defining the symbol the query
        names (False when the lookup failed or ran out of time)."""
        on_main = dataclasses.replace(scope, branch=MAIN_BRANCH)
        if path is not None:
            work = self._file_or_name(on_main, path, name)
        elif name is not None:
            work = self._definitions_of(on_main, name)
        else:
            return False
        # A part of its own: failing, it is no failure of the branch's lookup, whose note then still shows.
        found = await run.guarded(ON_MAIN, work, reserve_s=RETRIEVAL_RESERVE_S)
        return found is not None and bool(found.symbols)

    async def _defined_on_main(self, run: QueryRun, scope: Scope, name: str) -> bool:
        """Whether a chunk of main defines a symbol of that name (False when the lookup failed or ran out of time)."""
        work = self._documents.definitions(Scope(scope.workspace, MAIN_BRANCH), name, 1)
        found = await run.guarded(ON_MAIN, work, reserve_s=RETRIEVAL_RESERVE_S)
        return found is not None and bool(found.symbols)

    async def _checking_the_name(self, scope: Scope, name: str, lookup: Awaitable[Definitions]) -> Definitions:
        """A relation's lookup; when it finds nothing, whether any chunk defines a symbol of that name (a filter
        may hide it, not undefine it): nothing for a name nothing defines is a misspelt name, not a symbol without
        that relation."""
        found = await lookup
        if found.symbols or found.symbol_indexed:
            return dataclasses.replace(found, symbol_indexed=True)
        defined = bool((await self._documents.definitions(scope.unfiltered, name, 1)).symbols)
        return dataclasses.replace(found, symbol_indexed=defined or await self._inherited(scope, name) is not None)

    async def _related_in_graph(self, run: QueryRun, scope: Scope, relation: str, name: str) -> Definitions:
        """The subclasses or bases (nearest first), the importers or the imported modules of the types the name
        names, from the graph at the announced version, each by its defining chunk (a class's own, a module's
        file)."""
        graph = await self._announced_graph(scope.workspace, scope.branch)
        run.read(graph.version)
        distance: dict[str, int] = {}
        levels_of: dict[str, Callable[[str], list[list[str]]]] = {
            SUBCLASS: graph.subtypes,
            BASE: graph.supertypes,
            IMPORTER: lambda named: [graph.linked(named, IMPORTS, "incoming")],
            IMPORTED: lambda named: [graph.linked(named, IMPORTS, "outgoing")],
        }
        types_named = graph.as_files_or_types(graph.named(name), files=relation in (IMPORTER, IMPORTED))
        for named in types_named:
            for level, types in enumerate(levels_of[relation](named)):
                for object_type in types:
                    distance[object_type] = min(level, distance.get(object_type, level))
        # Read past the nearest RELATIONS_READ types, which may have no chunk within the request's filters (or none
        # at all: a fault tester's chain of types with a class every 500 answered no subclass), then keep the
        # nearest RELATIONS_READ that have.
        nearest = sorted(distance, key=lambda t: (distance[t], t))[:RELATION_TYPES_READ]
        found = await self._documents.representatives(scope, nearest, DEFINING_LEVELS)
        kept = sorted(found.documents, key=lambda t: (distance[t], t))[:RELATIONS_READ]
        symbols = {found.documents[object_type]: object_type for object_type in kept}
        distances = {doc_id: distance[object_type] for doc_id, object_type in symbols.items()}
        # A type the graph names is known, whether or not a chunk defines it by that name (an ingester's nodes
        # without symbolFqn).
        known = True if types_named else None
        return Definitions(
            symbols, found.version or graph.version, found_by=relation, distances=distances, symbol_indexed=known,
            named=tuple(sorted(types_named)[: NAMED_LISTED + 1]),
        )  # fmt: skip

    async def _refill(
        self, run: QueryRun, scope: Scope, reserve: list[Fused], version: str
    ) -> dict[str, StoredDocument]:
        """The documents of the candidates after the fetched ones (the first REFILL_MAX), read at the answer's
        version; none when the index has moved on since (they would be another state's) or the read failed."""
        work = self._documents.fetch(scope, [hit.id for hit in reserve[:REFILL_MAX]])
        more = await run.guarded("refill", work, stage="refill", reserve_s=RETRIEVAL_RESERVE_S)
        return more.documents if more is not None and more.version == version else {}

    async def _fetch(
        self, run: QueryRun, scope: Scope, fused: list[Fused], refinements: Refinements, definitions: Definitions
    ) -> Fetched:
        """The documents of the fused candidates and of the definitions found; their snapshot's version is the
        answer's."""
        # Token signs (kilobytes a document) only of the candidates late interaction compares.
        depth = 0 if refinements.interaction_tokens is None else refinements.interaction_depth
        ids = list(dict.fromkeys([*(f.id for f in fused), *definitions.symbols]))
        # Second vectors only of the candidates the second opinion may see: its depth, or deeper where late
        # interaction, which runs first, may lift a candidate from as far down as its own depth.
        second = self._second if refinements.second_weight > 0 else None
        second_of = [] if second is None else [f.id for f in fused[: max(refinements.second_depth, depth)]]
        signs_of = [f.id for f in fused[:depth]]
        fetching = self._documents.fetch(scope, ids, signs_of, second_of, second.name if second else None)
        fetched = await run.timed("fetch", fetching)
        run.read(fetched.version)
        run.report(ontology_version=fetched.version)
        return fetched

    async def _position(self) -> int | None:
        return None if self._freshness_source is None else await self._freshness_source.position()

    async def _shared_freshness(
        self, workspace: str, branch: str, made: Freshness | None
    ) -> tuple[Freshness | None, bool]:
        """An answer made before (cached, or made for the same question asked meanwhile) holds every delta up to
        the position its maker read; up to the position now only when none of the branches' deltas was published
        between the two. Before, it claimed the position now, also past deltas of its branch applied since (their
        version not yet announced to this worker). Also whether some of the branches' deltas pending past the
        maker's position are settled now: whether the answer holds them, only a new answer can tell."""
        if made is None:
            return None, False
        then = await self._freshness(workspace, branch, made.indexed_seq)
        position = await self._position()
        if then is None or then.pending_deltas is None or position is None or position <= made.indexed_seq:
            return then, False
        now = await self._freshness(workspace, branch, position)
        if now is not None and now.pending_deltas == then.pending_deltas:
            return now, False
        return then, now is not None and now.pending_deltas is not None

    async def _freshness(self, workspace: str, branch: str, position: int | None) -> Freshness | None:
        """The position an answer read, and what was published past it on the branches it read; None when the
        worker could not read the position."""
        if self._freshness_source is None or position is None:
            return None
        pending = await self._freshness_source.pending(workspace, Scope(workspace, branch).branches, position)
        refused = self._freshness_source.stream_refused(workspace)
        if pending is None:
            return Freshness(indexed_seq=position, stream_refused=refused)
        return Freshness(
            indexed_seq=position, pending_deltas=pending.deltas, pending_ms=pending.oldest_ms, stream_refused=refused
        )

    async def _late_interaction(
        self, run: QueryRun, refinements: Refinements, candidates: list[Fused], documents: dict[str, StoredDocument]
    ) -> list[Fused]:
        tokens = refinements.interaction_tokens
        if tokens is None or self._embedder is None:
            return candidates
        # A few milliseconds of arithmetic, queued with the model's on its thread, off the event loop.
        work = partial(
            late_interaction,
            tokens,
            candidates,
            documents,
            refinements.interaction_weight,
            refinements.interaction_depth,
        )
        refined = await run.guarded(  # on failure keep the fused order: a query never fails for want of a refinement
            "lateInteraction",
            self._embedder.on_model_thread(work, run.workspace),
            stage="lateInteraction",
            reserve_s=REFINEMENT_RESERVE_S,
        )
        if refined is None:
            return candidates
        reordered, report = refined
        run.report(late_interaction=report)
        if report is None and candidates:  # asked for, and fewer than two leading candidates had token vectors
            run.report(skipped_late_interaction="no_token_vectors")
        return reordered

    def _second_query_vector(self, run: QueryRun) -> asyncio.Future[npt.NDArray[np.float32]] | None:
        """The query's vector by the second model, started beside retrieval when its opinion will be asked."""
        second = self._second
        if second is None or run.query.listing or second_opinion_weight(run.query, self._config) <= 0:
            return None

        async def after_the_embedding() -> npt.NDArray[np.float32]:
            # On two cores, made beside the query's own embedding it slowed that and the keyword search; after it,
            # it runs while the dense search and the fetch wait on the database.
            await run.embedded.wait()
            return await second.embed_query(run.text)

        return asyncio.ensure_future(after_the_embedding())

    async def _second_opinion(
        self,
        run: QueryRun,
        refinements: Refinements,
        candidates: list[Fused],
        documents: dict[str, StoredDocument],
        query_vector: asyncio.Future[npt.NDArray[np.float32]] | None,
    ) -> list[Fused]:
        """The second model's opinion fused into the order of the leading candidates; the order given, and
        ``secondOpinion`` in ``degraded``, when the query's second vector could not be made in time."""
        second = self._second
        if second is None or query_vector is None or refinements.second_weight <= 0:
            return candidates

        async def reordered() -> tuple[list[Fused], SecondOpinionReport | None]:
            vector = await asyncio.shield(query_vector)  # a timeout here leaves the cancelling to _retrieve
            weight, depth = refinements.second_weight, refinements.second_depth
            return second_opinion_order(second.name, vector, candidates, documents, weight, depth)

        refined = await run.guarded("secondOpinion", reordered(), stage="secondOpinion", reserve_s=REFINEMENT_RESERVE_S)
        if refined is None:
            return candidates
        order, report = refined
        run.report(second_opinion=report)
        return order

    async def _rerank(
        self, run: QueryRun, refinements: Refinements, candidates: list[Fused], documents: dict[str, StoredDocument]
    ) -> list[Fused]:
        """The reranker's order over the leading candidates; the order given, and ``reranker`` in ``degraded``,
        when it fails (a timeout, an HTTP failure, a malformed answer)."""
        run.report(reranked=False)
        reranker = self._reranker
        if not refinements.rerank or reranker is None:
            return candidates
        sent = candidates[: self._config.reranker_depth]
        texts = [rerank_text(documents[f.id]) for f in sent]

        failed = False  # the reranker raised: no connection, an error status, a body it could not read

        async def ranking() -> list[tuple[int, float]]:
            nonlocal failed
            try:
                async with asyncio.timeout(self._config.reranker_timeout_ms / 1000):
                    answer = await reranker.rerank(run.text, texts, len(texts))
            except Exception as error:
                failed = not isinstance(error, TimeoutError)
                raise
            return check_ranking(answer, len(sent))

        ranked = await run.guarded("reranker", ranking(), stage="rerank", reserve_s=REFINEMENT_RESERVE_S)
        if "rerank" in run.timings:  # it was called
            self._metrics.rerank_duration.record(run.timings["rerank"], {"reranker": reranker.name})
        if "rerank" in run.timings and not failed:
            # Charged when it answered, or was cut by time (the provider may have served it): not when it failed
            # (an operator's: a reranker nobody listened at was charged for every call).
            cost = self._config.reranker_cost_per_call_usd + self._config.reranker_cost_per_document_usd * len(sent)
            self._metrics.rerank_cost.add(cost, {"workspace": run.workspace, "reranker": reranker.name})
        if ranked is None:
            return candidates
        run.report(reranked=True, reranker=reranker.name)
        return reranked_order(ranked, sent, candidates)

    def _definitions_first(
        self, run: QueryRun, definitions: Definitions, candidates: list[Fused], documents: dict[str, StoredDocument]
    ) -> list[Fused]:
        """The definitions of the symbol the query names, the file whose path it is (in the order looked up), or
        the chunks in the relation to it the query asks about, ahead of everything else
        (``symbols.definitions_first``, ``symbols.related_first``)."""
        if not definitions.symbols:
            return candidates
        found = {doc_id: fqn for doc_id, fqn in definitions.symbols.items() if doc_id in documents}
        if definitions.found_by != SYMBOL:
            return related_first(
                found, candidates, run.query.top_k, definitions.found_by, definitions.modules, definitions.distances
            )
        name = identifier_of(run.text)
        assert name is not None  # definitions are looked up for identifiers only
        kind = kind_asked(run.text)
        kinds = {doc_id: str(documents[doc_id].metadata.get("symbolKind")) for doc_id in found} if kind else None
        files = {doc_id: str(documents[doc_id].metadata.get("filePath") or "") for doc_id in found}
        published = {
            doc_id
            for doc_id in found
            if republished_as(
                str(documents[doc_id].metadata.get("symbolFqn") or ""),
                documents[doc_id].metadata.get("aliases") or [],
                documents[doc_id].source_domain,
            )
        }
        return definitions_first(
            name,
            found,
            candidates,
            run.query.top_k,
            definitions.modules,
            kind,
            kinds,
            files,
            published,
            definitions.assigning,
        )

    def _calibrated_scores(
        self,
        run: QueryRun,
        measured: Measured,
        candidates: list[Fused],
        index_model: str | None,
        ranked_before: Mapping[str, int],
        stands_for: Mapping[str, str] | None = None,
    ) -> tuple[dict[str, float] | None, dict[str, str]]:
        """The probability that each result of the answer (the first topK candidates) is relevant, from its
        signals and its place in the answer (1 for a definition of the symbol the query names, or a chunk in the
        relation to it the query asks about; ``ranked_before``: each candidate's index before those were placed
        first, where the places are counted). Each is its own estimate: one ranked lower can score higher where its
        signals are much stronger (pooled to descend, a weak result shared a strong one's score, and minRelevance
        kept the one and dropped the other: an independent tester's finding). None, and the relative relevance
        kept, when the deployment turned calibration off, when there is nothing to score, when the index's embedding
        model is not the one the cosine weights were fitted for, or when some result has no signal a model could
        judge (a listing; a keyword backend without a ceiling, alone). ``stands_for``: a function's code in its
        docstring's place (``code_before_its_docstring``) scores the better of the two, as one symbol; the second
        mapping holds each result scored from its docstring's signals, and that docstring."""
        answer = candidates[: run.query.top_k]
        fitted_for = self._config.calibration_embedding_model
        other_model = measured.model in ("dense", "hybrid") and index_model not in (None, fitted_for)
        if not self._config.calibrated_scores or not answer or other_model:
            run.report(calibrated=False)
            return None, {}
        estimates, scored_from = [], {}
        # Code moved to its docstring's place was ranked there (a review's: by its own index, it counted a
        # definition placed first that it had not been ranked below).
        moved_to = {code: ranked_before.get(docstring) for code, docstring in (stands_for or {}).items()}
        before = [_earliest(ranked_before.get(hit.id), moved_to.get(hit.id)) for hit in answer]
        places = ranked_places((hit.found_by for hit in answer), before)
        for hit, rank in zip(answer, places, strict=True):
            estimate: float | None = 1.0  # the query names its symbol, or asks a relation of it
            if rank is not None:
                estimate = self._probability(measured, hit.id, rank)
                docstring = (stands_for or {}).get(hit.id)
                if estimate is not None and docstring is not None:
                    own_docstring = self._probability(measured, docstring, rank)
                    if own_docstring is not None and own_docstring > estimate:
                        estimate, scored_from[hit.id] = own_docstring, docstring
            if estimate is None:
                run.report(calibrated=False)
                return None, {}
            estimates.append(estimate)
        run.report(calibrated=True)
        return dict(zip((hit.id for hit in answer), estimates, strict=True)), scored_from

    def _probability(self, measured: Measured, doc_id: str, rank: int) -> float | None:
        """The calibrated probability that the candidate at ``rank`` is relevant, from its signals; None when none
        applies."""
        signals = measured.signals.get(doc_id, {})
        return None if measured.model is None else self._calibration.probability(measured.model, signals, rank)

    def _collapse(
        self, run: QueryRun, candidates: list[Fused], documents: dict[str, StoredDocument], definitions: Definitions
    ) -> tuple[list[Fused], list[tuple[str, str]], dict[str, str]]:
        """One symbol, one place: a chunk nested in a better-ranked one of the same symbol, or holding it, goes.
        Also the chunks left out that would have been in the answer (within its first topK without collapsing),
        each with the one it went into; and each function's code moved to its docstring's place, with it. A chunk
        standing in the relation asked stays: an agent tester's module calling ``Typer()`` at its own level went
        into its function that calls it too, and the answer said "2 of the 3, ask with a larger topK"."""
        if run.query.listing or not self._collapses(run.query):  # a listing's order says nothing of rank
            return candidates, [], {}
        moved, stands_for = code_before_its_docstring(candidates, documents)
        related = definitions.symbols if definitions.found_by != SYMBOL else {}
        kept, left_out = collapse_nested(moved, documents, related)
        answer = {hit.id for hit in candidates[: run.query.top_k]}
        return kept, [(left, holder) for left, holder in left_out if left in answer], stands_for

    def _collapses(self, query: OntologyQuery) -> bool:
        asked = options_of(query).collapse_nested
        return self._config.collapse_nested if asked is None else asked

    async def _expand(self, run: QueryRun, scope: Scope, version: str, results: list[SearchResult]) -> None:
        """1-hop graph expansion (seed 000 DR-6): linked types of the hits' types, each with a representative, at
        most ``expansion_max_types`` of them (``expandedContextTruncated`` when there were more)."""
        if not run.query.follow_links or not results:
            return
        work = self._linked_context(run, scope, version, results)
        expanded = await run.guarded("graphExpansion", work, stage="expansion", reserve_s=REFINEMENT_RESERVE_S)
        if expanded is not None:
            context, truncated = expanded
            run.report(expanded_context=context, expanded_context_truncated=truncated)

    async def _linked_context(
        self, run: QueryRun, scope: Scope, version: str, results: list[SearchResult]
    ) -> tuple[list[ExpandedContext], bool]:
        bound = self._config.expansion_max_types
        graph = await self._graphs.get(
            scope.workspace, scope.branch, version, self._versions.generation(scope.workspace)
        )
        # More than the bound, so that linked types a document defines go first: a type no document defines (a
        # module outside the tree, a document deleted while links name its type) is a name without anything to read,
        # and a graph tester's 25 places went to such names while 30 types with documents were left out.
        pool = expand(graph, [(r.id, r.object_type) for r in results], limit=EXPANSION_POOL_FACTOR * bound + 1)
        # A linked type is context whatever the request's filters select.
        representatives = await self._documents.representatives(scope.unfiltered, [e.linked_type for e in pool])
        defined = [e for e in pool if e.linked_type in representatives.documents]
        truncated = len(pool) > bound
        expansions = (defined + [e for e in pool if e.linked_type not in representatives.documents])[:bound]
        run.read(graph.version)
        run.read(representatives.version)
        context = [
            ExpandedContext(
                linked_type=e.linked_type,
                link_name=e.link_name,
                direction=e.direction,
                linked_from_type=e.linked_from_type,
                linked_from_document_id=e.linked_from_document_id,
                representative_document_id=representatives.documents.get(e.linked_type),
            )
            for e in expansions
        ]
        return context, truncated

    def _recorded(self, query: OntologyQuery, response: QueryResponse) -> QueryResponse:
        meta = response.meta
        attributes: dict[str, bool | str] = {
            "hybrid": meta.hybrid,
            "reranked": meta.reranked,
            "cacheHit": meta.cache_hit,
            "backend": meta.backend,
            "followLinks": query.follow_links,
            "shape": shape_of(query, meta),
        }
        # From the worker's receipt: a worker at capacity shows in the wait, and the latency alert must see it.
        self._metrics.query_duration.record(meta.timings_ms.get("queue", 0.0) + meta.timings_ms["total"], attributes)
        if "expansion" in meta.timings_ms and not meta.cache_hit:  # a cached answer's is its maker's, counted then
            self._metrics.graph_expansion_duration.record(meta.timings_ms["expansion"])
        return response

    def invalidate(self, workspace: str, branch: str, version: str, rebuilt: bool = False) -> None:
        """A version moved: drop the workspace's answers and graphs that no longer match (main moves them all).
        After a rebuild every one of them was read from the replaced index: all go."""

        def current(of_branch: str) -> str:
            return self._versions.current(workspace, of_branch)

        if rebuilt:
            dropped, graphs = drop_workspace(self._cache, workspace), self._graphs.drop_workspace(workspace)
        else:
            dropped, graphs = drop_stale(self._cache, workspace, current), self._graphs.drop_stale(workspace, current)
        if dropped or graphs:
            log.info(
                "cache_invalidated", workspace=workspace, branch=branch, entries=dropped, graphs=graphs, rebuilt=rebuilt
            )
