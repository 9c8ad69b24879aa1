"""The pipeline's decisions that need no servers: version consistency across statements, caching, degradation.

Small in-memory retrievers and a document store stand in for Postgres here: the point is the pipeline's logic, not
SQL (which the end-to-end tests exercise against a real server).
"""

from __future__ import annotations

import asyncio
import gc
import math
import tracemalloc
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, field, replace
from random import Random
from typing import Any, ClassVar, TypeVar

import numpy as np
import pytest

from ontofabric.contracts import NO_VERSION, OntologyQuery, QueryMeta
from ontofabric.contracts.query import QueryOptions
from ontofabric.services.gateway.tools import render
from ontofabric.services.query.cache import CacheKey
from ontofabric.services.query.config import PipelineConfig
from ontofabric.services.query.core import (
    Candidate,
    Definitions,
    Fetched,
    Hits,
    Pending,
    Representatives,
    Retriever,
    Scope,
    SearchInput,
    StoredDocument,
)
from ontofabric.services.query.fusion import Fused
from ontofabric.services.query.graph import GraphRows, LinkRow, NodeRow
from ontofabric.services.query.hints import shape_of
from ontofabric.services.query.pipeline import QueryPipeline
from ontofabric.services.query.stages import code_before_its_docstring, collapse_nested, holds, nested
from ontofabric.services.query.versions import is_rebuild
from ontofabric.shared.embedder import Vector
from ontofabric.shared.lru import LruCache


@dataclass
class ScriptedRetriever:
    """A retriever answering with whatever its ``search`` function returns."""

    name: str
    backend: str
    needs_embedding: bool
    answer: Callable[[Scope, SearchInput, int], Awaitable[Hits]]

    async def search(self, scope: Scope, query: SearchInput, limit: int) -> Hits:
        return await self.answer(scope, query, limit)


@dataclass
class ScriptedRetrieval:
    """The dense and keyword retrievers (``retrievers()``) and the document store, scripted."""

    dense_version: str = "5-a"
    keyword_version: str = "5-a"
    fetch_version: str = "5-a"
    index_model: str | None = None
    """The embedding model the store says its vectors are of."""
    missing: set[str] = field(default_factory=set)
    token_signs: dict[str, bytes] = field(default_factory=dict)
    second_vectors: dict[str, tuple[str, bytes]] = field(default_factory=dict)
    """id -> (model, float16 bytes) of the documents that have a second vector."""
    second_asked: list[tuple[list[str], str | None]] = field(default_factory=list)
    """Each fetch's second-vector ids and model, as asked."""
    cosines: dict[str, float] = field(default_factory=dict)
    """What dense_scores answers: the cosine of documents the dense list did not return (none: they take the
    dense list's lowest)."""
    dense_scores_fail: bool = False
    dense_scores_version: str | None = None
    """The version dense_scores reads; by default the dense list's."""
    backend: str = "tsvector"

    def retrievers(self) -> list[Retriever]:
        return [
            ScriptedRetriever("dense", "pgvector", True, self.dense),
            ScriptedRetriever("keyword", self.backend, False, self.keyword),
        ]

    async def dense(self, scope: Scope, query: SearchInput, limit: int) -> Hits:
        assert query.vector is not None
        return Hits([Candidate("x", 0.9), Candidate("y", 0.8)], self.dense_version)

    async def keyword(self, scope: Scope, query: SearchInput, limit: int) -> Hits:
        return Hits([Candidate("y", 3.0), Candidate("z", 1.0)], self.keyword_version, ceiling=4.0)

    async def similarities(self, scope: Scope, vector: Vector, ids: Sequence[str], model: str | None = None) -> Hits:
        if self.dense_scores_fail:
            raise ConnectionError("database went away")
        return Hits(
            [Candidate(i, self.cosines[i]) for i in ids if i in self.cosines],
            self.dense_scores_version or self.dense_version,
        )

    async def fetch(
        self,
        scope: Scope,
        ids: Sequence[str],
        token_signs_of: Sequence[str] = (),
        second_vectors_of: Sequence[str] = (),
        second_model: str | None = None,
    ) -> Fetched:
        self.second_asked.append((list(second_vectors_of), second_model))

        def second(i: str) -> bytes | None:
            model, data = self.second_vectors.get(i, (None, None))
            return data if i in second_vectors_of and model == second_model else None

        documents = {
            i: StoredDocument(
                i,
                f"content {i}",
                "t.T",
                "tests",
                {},
                self.token_signs.get(i) if i in token_signs_of else None,
                second(i),
            )
            for i in ids
            if i not in self.missing
        }
        return Fetched(documents, self.fetch_version, self.index_model)

    async def graph_rows(self, workspace: str, branch: str) -> GraphRows:
        return GraphRows(nodes=[], links=[], version=self.fetch_version)

    def session(self, scope: Scope) -> AbstractAsyncContextManager[None]:
        return nullcontext()  # each scripted read stands alone

    async def representatives(
        self, scope: Scope, object_types: Sequence[str], levels: Sequence[str] = ()
    ) -> Representatives:
        return Representatives({}, self.fetch_version)

    async def definitions(self, scope: Scope, name: str, limit: int) -> Definitions:
        return Definitions({}, self.fetch_version)

    async def files(
        self, scope: Scope, path: str, limit: int, line: int | None = None, name: str | None = None
    ) -> Definitions:
        return Definitions({}, self.fetch_version, found_by="file")

    async def callers(self, scope: Scope, name: str, limit: int, named_on_main: bool = False) -> Definitions:
        return Definitions({}, self.fetch_version, found_by="caller")

    async def callees(self, scope: Scope, name: str, limit: int) -> Definitions:
        return Definitions({}, self.fetch_version, found_by="callee")


def pipeline_over(
    retrieval: ScriptedRetrieval,
    versions: Announced | None = None,
    config: PipelineConfig | None = None,
    reranker: Any = None,
    cache: LruCache[CacheKey, bytes] | None = None,
    embedder: Any = None,
    second: Any = None,
) -> QueryPipeline:
    """A pipeline over the scripted retrievers and store, with the fixed embedder, announcing 5-a by default."""
    return QueryPipeline(
        retrieval.retrievers(),
        retrieval,
        FixedEmbedder() if embedder is None else embedder,
        versions or Announced("5-a"),
        LruCache(0) if cache is None else cache,
        config or PipelineConfig(),
        reranker,
        second=second,
    )


T = TypeVar("T")

QUERY_TOKENS = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=np.float32)
"""The query's tokens: the first and second dimension."""


class FixedEmbedder:
    model_name = "fixed"
    cache_name = "fixed"
    vectors_name = "fixed"
    dimension = 3

    def embed_documents(self, texts: object, batch_size: int = 64) -> np.ndarray:  # type: ignore[type-arg]
        return np.ones((1, 3), dtype=np.float32)

    def embed_with_tokens(self, texts: list[str], batch_size: int = 64) -> tuple[np.ndarray, list[np.ndarray]]:  # type: ignore[type-arg]
        return np.ones((len(texts), 3), dtype=np.float32), [QUERY_TOKENS for _ in texts]

    def embed_query(self, text: str) -> Vector:
        return np.ones(3, dtype=np.float32)

    async def embed_query_with_tokens_async(self, text: str, turn: str = "") -> tuple[Vector, np.ndarray]:  # type: ignore[type-arg]
        return self.embed_query(text), QUERY_TOKENS

    async def on_model_thread(self, work: Callable[[], T], turn: str = "") -> T:
        return work()


class Announced:
    def __init__(self, version: str) -> None:
        self.version = version
        self.rebuilds = 0

    def current(self, workspace: str, branch: str) -> str:
        return self.version

    def generation(self, workspace: str) -> int:
        return self.rebuilds


def _pipeline(
    retrieval: ScriptedRetrieval, announced: str | Announced = "5-a"
) -> tuple[QueryPipeline, LruCache[CacheKey, bytes]]:
    cache: LruCache[CacheKey, bytes] = LruCache(10)
    versions = announced if isinstance(announced, Announced) else Announced(announced)
    return pipeline_over(retrieval, versions, cache=cache), cache


QUERY = OntologyQuery(semantic_query="anything")


async def test_consistent_answer_is_cached_and_labelled_with_its_version() -> None:
    pipeline, cache = _pipeline(ScriptedRetrieval())
    first = await pipeline.answer(QUERY, "w")
    assert first.meta.ontology_version == "5-a"
    assert first.meta.degraded == []
    assert len(cache) == 1
    # Kept as one object the garbage collector does not track: a cache of models made full collections slow.
    assert [gc.is_tracked(kept) for _, kept in cache.items()] == [False]
    again = await pipeline.answer(QUERY, "w")
    assert again.meta.cache_hit is True
    assert again.results == first.results


async def test_each_retriever_is_asked_for_at_least_the_answer_s_length() -> None:
    """A settings audit's: candidates per retriever under topK cut an answer from one retriever, unsaid."""
    asked: list[int] = []
    retrieval = ScriptedRetrieval()

    async def counted(scope: Scope, query: SearchInput, limit: int) -> Hits:
        asked.append(limit)
        return Hits([Candidate(f"d{i}", 1.0 / (i + 1)) for i in range(limit)], retrieval.keyword_version)

    retrieval.keyword = counted  # type: ignore[method-assign]
    pipeline = pipeline_over(retrieval, config=PipelineConfig(retriever_top_k=5))
    keyword_alone = QueryOptions(retrievers=["keyword"])
    answer = await pipeline.answer(QUERY.model_copy(update={"top_k": 20, "options": keyword_alone}), "w")
    assert len(answer.results) == 20
    few = keyword_alone.model_copy(update={"candidates": 3})
    await pipeline.answer(QUERY.model_copy(update={"top_k": 8, "options": few}), "w")
    await pipeline.answer(QUERY.model_copy(update={"top_k": 2, "options": few}), "w")
    assert asked == [20, 8, 3]


async def test_an_answer_where_nothing_is_indexed_is_not_kept() -> None:
    """A workspace with nothing indexed (a name that does not exist) answers empty every time: kept, a flood of
    made-up names took the cache's places from real tenants' answers (a many-tenant tester's)."""
    nothing = ScriptedRetrieval(dense_version=NO_VERSION, keyword_version=NO_VERSION, fetch_version=NO_VERSION)
    pipeline, cache = _pipeline(nothing, NO_VERSION)
    assert (await pipeline.answer(QUERY, "nobody")).meta.ontology_version == NO_VERSION
    assert len(cache) == 0
    assert (await pipeline.answer(QUERY, "nobody")).meta.cache_hit is False
    overlaid = f"{NO_VERSION}+{NO_VERSION}"  # a branch's answer names main's version and the branch's
    pipeline, cache = _pipeline(ScriptedRetrieval(overlaid, overlaid, overlaid), overlaid)
    on_a_branch = QUERY.model_copy(update={"branch": "feature"})
    assert (await pipeline.answer(on_a_branch, "nobody")).meta.ontology_version == overlaid
    assert len(cache) == 0


async def test_the_same_question_asked_while_it_is_being_answered_waits_for_that_answer() -> None:
    """A stampede of one question (an agent retrying, many agents asking alike) does the work once."""

    @dataclass
    class Slow(ScriptedRetrieval):
        calls: ClassVar[int] = 0
        inside: ClassVar[int] = 0
        most_at_once: ClassVar[int] = 0
        fail: bool = False

        async def dense(self, scope: Scope, query: SearchInput, limit: int) -> Hits:
            Slow.calls += 1
            Slow.inside += 1
            Slow.most_at_once = max(Slow.most_at_once, Slow.inside)
            await asyncio.sleep(0.05)
            Slow.inside -= 1
            if self.fail:
                raise ConnectionError("database went away")
            return await super().dense(scope, query, limit)

    pipeline, _ = _pipeline(Slow())
    answers = await asyncio.gather(*(pipeline.answer(QUERY, "w") for _ in range(5)))
    assert Slow.calls == 1
    assert [a.meta.cache_hit for a in answers] == [False, True, True, True, True]
    assert all(a.results == answers[0].results for a in answers)
    # One not to be shared (degraded: dense failed) is not handed on: the next waiting makes its own, and the
    # rest wait for that one in turn, not all at once.
    Slow.calls = Slow.most_at_once = 0
    failing, _ = _pipeline(Slow(fail=True))
    answers = await asyncio.gather(*(failing.answer(QUERY, "w") for _ in range(3)))
    assert all("dense" in a.meta.degraded and not a.meta.cache_hit for a in answers)
    assert (Slow.calls, Slow.most_at_once) == (3, 1)
    assert not failing._in_flight
    # An answer due later than a caller's own is not waited for: that caller makes its own, in its time.
    Slow.calls = 0
    pipeline, _ = _pipeline(Slow())
    now = asyncio.get_running_loop().time()
    _, early = await asyncio.gather(pipeline.answer(QUERY, "w", now + 10), pipeline.answer(QUERY, "w", now + 1))
    assert Slow.calls == 2
    assert not early.meta.cache_hit
    _, later = await asyncio.gather(pipeline.answer(QUERY, "w2", now + 1), pipeline.answer(QUERY, "w2", now + 10))
    assert Slow.calls == 3  # one due sooner is waited for
    assert later.meta.cache_hit


async def test_an_answer_read_while_the_index_was_rebuilt_is_not_cached() -> None:
    """A rebuild keeps the version: only the generation tells an answer from the replaced index."""
    versions = Announced("5-a")

    class RebuiltMidQuery(ScriptedRetrieval):
        async def fetch(
            self, scope: Scope, ids: Sequence[str], token_signs_of: Sequence[str] = (), *second: Any
        ) -> Fetched:
            versions.rebuilds += 1  # the rebuild's announcement arrives while this query is reading
            return await super().fetch(scope, ids, token_signs_of, *second)

    pipeline, cache = _pipeline(RebuiltMidQuery(), versions)
    reply = await pipeline.answer(QUERY, "w")
    assert reply.meta.ontology_version == "5-a"
    assert reply.meta.degraded == []
    assert len(cache) == 0
    pipeline, cache = _pipeline(ScriptedRetrieval(), versions)
    await pipeline.answer(QUERY, "w")
    assert len(cache) == 1
    pipeline.invalidate("w", "main", "5-a", rebuilt=True)
    assert len(cache) == 0


async def test_statements_that_saw_different_versions_are_flagged_and_not_cached() -> None:
    pipeline, cache = _pipeline(ScriptedRetrieval(keyword_version="6-b", fetch_version="6-b"))
    reply = await pipeline.answer(QUERY, "w")
    assert "ontologyVersionChanged" in reply.meta.degraded
    assert reply.meta.ontology_version == "6-b"  # the version of the content it shows
    assert len(cache) == 0


async def test_a_document_deleted_before_fetch_is_flagged() -> None:
    pipeline, _ = _pipeline(ScriptedRetrieval(missing={"y"}))
    reply = await pipeline.answer(QUERY, "w")
    # Adaptive fusion: keyword gap (3 - 1) / 3, dense weight 1/3; y would lead, z (keyword 1/4, dense floor 0.8)
    # beats x (dense 0.9 only). y vanished before fetch.
    assert [r.id for r in reply.results] == ["z", "x"]
    assert "ontologyVersionChanged" in reply.meta.degraded


async def test_data_newer_than_the_announcement_is_answered_but_not_cached() -> None:
    pipeline, cache = _pipeline(
        ScriptedRetrieval(dense_version="7-c", keyword_version="7-c", fetch_version="7-c"), announced="5-a"
    )
    reply = await pipeline.answer(QUERY, "w")
    assert reply.meta.ontology_version == "7-c"
    assert reply.meta.degraded == []
    assert len(cache) == 0


async def test_request_options_choose_retrievers_and_fusion() -> None:
    pipeline, _ = _pipeline(ScriptedRetrieval())
    keyword_only = await pipeline.answer(
        OntologyQuery.model_validate({"semanticQuery": "q", "options": {"retrievers": ["keyword"]}}), "w"
    )
    assert keyword_only.meta.retrievers == ["keyword"]
    assert keyword_only.meta.hybrid is False
    assert keyword_only.meta.fusion is None
    assert keyword_only.meta.degraded == []  # not asked for is not failed
    assert [r.id for r in keyword_only.results] == ["y", "z"]

    rrf = await pipeline.answer(
        OntologyQuery.model_validate({"semanticQuery": "q", "options": {"fusion": {"method": "rrf", "rrfK": 10}}}), "w"
    )
    assert rrf.meta.fusion is not None
    assert (rrf.meta.fusion.method, rrf.meta.fusion.parameters) == ("rrf", {"k": 10})

    default = await pipeline.answer(OntologyQuery(semantic_query="a question"), "w")
    assert default.meta.fusion is not None
    assert default.meta.fusion.method == "adaptive"
    # Two keyword hits (3 and 1, the best reachable 4): the list ran out, so its gap is (3 - 1/9) / 3 over the
    # places it did not fill, bounded by the top hit's saturation, 3/4.
    assert default.meta.fusion.parameters == {
        "denseWeight": pytest.approx(1 / 4, abs=1e-3),
        "keywordGap": pytest.approx(3 / 4, abs=1e-3),
        "keywordHitsDenseScored": 0,
    }
    # A query that is one identifier written as code writes one: the keyword list, which holds it as written, leads.
    named = await pipeline.answer(OntologyQuery(semantic_query="any_thing"), "w")
    plain = await pipeline.answer(QUERY, "w")  # one plain word may be a question: weighed as any query
    assert plain.meta.fusion is not None
    assert plain.meta.fusion.parameters["denseWeight"] == pytest.approx(1 / 4, abs=1e-3)
    assert named.meta.fusion is not None
    assert named.meta.fusion.parameters["denseWeight"] == pytest.approx(0.05)
    assert default.meta.signals == {
        "queryTokens": 2.0,
        "keywordSaturation": 0.75,
        "keywordGap": pytest.approx(3 / 4, abs=1e-3),
    }


async def test_a_dense_list_that_found_nothing_near_weighs_less_for_the_model_its_bounds_are_of() -> None:
    @dataclass
    class Unrelated(ScriptedRetrieval):
        searched_by: str | None = None
        """The model the dense search embedded the query by again (an index of another model), if it did."""

        async def dense(self, scope: Scope, query: SearchInput, limit: int) -> Hits:
            hits = [Candidate("x", 0.3), Candidate("y", 0.25)]
            return Hits(hits, self.dense_version, embedding_model=self.searched_by)

    question = OntologyQuery(semantic_query="a question")
    fitted = PipelineConfig(fusion_dense_cosine_model=FixedEmbedder.model_name)
    trusting = (await pipeline_over(Unrelated(), config=fitted).answer(question, "w")).meta.fusion
    assert trusting is not None
    # The keyword gap alone gives dense 1/4 (as above); a top cosine of 0.3 keeps a third of it.
    assert trusting.parameters["denseShare"] == pytest.approx(1 / 3, abs=1e-3)
    assert trusting.parameters["denseWeight"] == pytest.approx(1 / 12, abs=1e-3)
    other = PipelineConfig(fusion_dense_cosine_model="another-model")  # not the cosines' scale: no bounds
    # Nor where the index is of another model than the query's, whose cosines the dense list then holds.
    for config, retrieval in ((other, Unrelated()), (fitted, Unrelated(searched_by="another-model"))):
        as_gapped = (await pipeline_over(retrieval, config=config).answer(question, "w")).meta.fusion
        assert as_gapped is not None
        assert "denseShare" not in as_gapped.parameters
        assert as_gapped.parameters["denseWeight"] == pytest.approx(1 / 4, abs=1e-3)


async def test_a_keyword_only_hit_is_fused_with_its_own_cosine() -> None:
    # Dense returned x (0.9) and y (0.8); keyword y (3.0) and z (1.0) of a best reachable 4.0, so the dense weight is
    # 1/4 (the keyword gap is y's saturation, 3/4). Taking dense's lowest cosine, z would score 0.8/4 + 3/16 = 0.39
    # and pass x (0.225); its own cosine 0.1 gives it 0.21, below x.
    off = OntologyQuery.model_validate(
        {"semanticQuery": "a question", "options": {"lateInteraction": {"weight": 0}}}  # no identifier: see below
    )
    pipeline, _ = _pipeline(ScriptedRetrieval(cosines={"z": 0.1}))
    scored = await pipeline.answer(off, "w")
    assert [r.id for r in scored.results] == ["y", "x", "z"]
    assert scored.results[2].signals == {"cosine": 0.1, "keyword": 0.25}  # its own cosine; 1.0 of 4.0
    assert "denseScores" in scored.meta.timings_ms

    assert scored.meta.fusion is not None
    assert scored.meta.fusion.parameters["keywordHitsDenseScored"] == 1

    # When reading the cosines fails, the answer comes with dense's lowest cosine for z, says so, and is not cached.
    pipeline, cache = _pipeline(ScriptedRetrieval(cosines={"z": 0.1}, dense_scores_fail=True))
    guessed = await pipeline.answer(off, "w")
    assert [r.id for r in guessed.results] == ["y", "z", "x"]
    assert guessed.meta.degraded == ["denseScores"]
    assert guessed.meta.fusion is not None
    assert "keywordHitsDenseScored" not in guessed.meta.fusion.parameters
    assert len(cache) == 0

    # Cosines read from a newer state than the lists: flagged like any other mixed read, and not cached.
    pipeline, cache = _pipeline(ScriptedRetrieval(cosines={"z": 0.1}, dense_scores_version="6-b"))
    mixed = await pipeline.answer(off, "w")
    assert "ontologyVersionChanged" in mixed.meta.degraded
    assert len(cache) == 0

    # Fusion methods that do not add cosines need none.
    rrf = OntologyQuery.model_validate({"semanticQuery": "q", "options": {"fusion": {"method": "rrf"}}})
    assert "denseScores" not in (await pipeline.answer(rrf, "w")).meta.timings_ms


async def test_min_relevance_drops_weak_results() -> None:
    pipeline, _ = _pipeline(ScriptedRetrieval())
    everything = await pipeline.answer(QUERY, "w")
    cut = (everything.results[0].score + everything.results[-1].score) / 2
    strict = await pipeline.answer(OntologyQuery(semantic_query="anything", min_relevance=cut), "w")
    assert 0 < len(strict.results) < len(everything.results)
    assert all(r.score >= cut for r in strict.results)
    # Said, so that an answer emptied by it is not read as nothing there (a tester's).
    assert strict.meta.below_min_relevance == len(everything.results) - len(strict.results)
    assert everything.meta.below_min_relevance == 0
    assert "left out: " in render(strict, {"semanticQuery": "anything", "minRelevance": cut})


@dataclass
class HubGraph(ScriptedRetrieval):
    """Every hit's type (t.T) imports forty others; the graph is read at ``graph_version``."""

    graph_version: str = "5-a"

    async def graph_rows(self, workspace: str, branch: str) -> GraphRows:
        links = [LinkRow("main", "t.T", "imports", f"t.M{i:02}", False, False) for i in range(40)]
        return GraphRows(nodes=[], links=links, version=self.graph_version)


async def test_expansion_is_bounded_and_says_so() -> None:
    pipeline = pipeline_over(HubGraph(), config=PipelineConfig(expansion_max_types=3))
    reply = await pipeline.answer(OntologyQuery(semantic_query="anything", follow_links=True), "w")
    assert [c.linked_type for c in reply.meta.expanded_context] == ["t.M00", "t.M01", "t.M02"]
    assert reply.meta.expanded_context_truncated is True
    assert reply.meta.degraded == []
    pipeline = pipeline_over(HubGraph(), config=PipelineConfig(expansion_max_types=40))
    whole = await pipeline.answer(OntologyQuery(semantic_query="anything", follow_links=True), "w")
    assert len(whole.meta.expanded_context) == 40
    assert whole.meta.expanded_context_truncated is False


async def test_expansion_gives_its_places_to_linked_types_a_document_defines_first() -> None:
    """A graph tester's 25 places went to types no document defines, named first, while 30 types with documents
    were left out: a name without a document gives an agent nothing to read."""

    @dataclass
    class SomeDefined(HubGraph):
        async def representatives(
            self, scope: Scope, object_types: Sequence[str], levels: Sequence[str] = ()
        ) -> Representatives:
            defined = {"t.M05": "doc-M05", "t.M10": "doc-M10"}
            return Representatives({t: defined[t] for t in object_types if t in defined}, self.fetch_version)

    pipeline = pipeline_over(SomeDefined(), config=PipelineConfig(expansion_max_types=3))
    reply = await pipeline.answer(OntologyQuery(semantic_query="anything", follow_links=True), "w")
    context = reply.meta.expanded_context
    assert [c.linked_type for c in context] == ["t.M05", "t.M10", "t.M00"]
    assert [c.representative_document_id for c in context] == ["doc-M05", "doc-M10", None]
    assert reply.meta.expanded_context_truncated is True


async def test_a_graph_newer_than_the_results_is_flagged_and_not_cached() -> None:
    pipeline, cache = _pipeline(HubGraph(graph_version="6-b"))
    reply = await pipeline.answer(OntologyQuery(semantic_query="anything", follow_links=True), "w")
    assert reply.meta.expanded_context  # the expansion still comes back
    assert "ontologyVersionChanged" in reply.meta.degraded
    assert len(cache) == 0


def test_only_the_same_version_at_a_higher_revision_is_a_rebuild() -> None:
    assert is_rebuild("5-a", 3, "5-a", 4)
    assert not is_rebuild(None, None, "5-a", 4)  # first sighting
    assert not is_rebuild("5-a", 3, "5-a", 3)  # the same announcement again
    assert not is_rebuild("5-a", 4, "5-a", 3)  # an older one
    assert not is_rebuild("5-a", 3, "6-b", 4)  # a change


async def test_an_answer_is_hybrid_only_when_both_retrievers_found_something() -> None:
    """An independent tester's finding: "the of and" (stop words alone: nothing for keyword search to look up)
    was answered from the dense list alone and said hybrid."""

    class NoTerms(ScriptedRetrieval):
        async def keyword(self, scope: Scope, query: SearchInput, limit: int) -> Hits:
            return Hits([], self.keyword_version)

    reply = await pipeline_over(NoTerms()).answer(QUERY, "w")
    assert reply.results
    assert reply.meta.retrievers == ["dense", "keyword"]  # both ran
    assert reply.meta.hybrid is False
    assert (await pipeline_over(ScriptedRetrieval()).answer(QUERY, "w")).meta.hybrid is True


async def test_a_third_retriever_is_run_fused_and_reported_by_its_name() -> None:
    """A retriever is a registered part: a toy one joins without any change to the pipeline."""
    retrieval = ScriptedRetrieval()
    calls: list[SearchInput] = []

    async def toy(scope: Scope, query: SearchInput, limit: int) -> Hits:
        calls.append(query)
        return Hits([Candidate("w", 7.0), Candidate("x", 5.0)], "5-a")

    retrievers = [*retrieval.retrievers(), ScriptedRetriever("toy", "memory", False, toy)]
    pipeline = QueryPipeline(retrievers, retrieval, FixedEmbedder(), Announced("5-a"), LruCache(0), PipelineConfig())
    reply = await pipeline.answer(QUERY, "w")
    assert calls == [SearchInput("anything", None)]  # it needs no embedding, so it gets none
    assert reply.meta.retrievers == ["dense", "keyword", "toy"]
    assert reply.meta.hybrid is True
    assert reply.meta.fusion is not None
    assert reply.meta.fusion.method == "rrf"  # adaptive fusion weighs a dense against a keyword list only
    found_by = {r.id: {f.retriever: f.rank for f in r.found_by} for r in reply.results}
    assert found_by["w"] == {"toy": 1}
    assert found_by["x"] == {"dense": 1, "toy": 2}
    assert reply.results[0].id == "x"  # first in two of the three lists
    assert "toy" in reply.meta.timings_ms

    async def broken(scope: Scope, query: SearchInput, limit: int) -> Hits:
        raise ConnectionError("toy index away")

    retrievers[-1] = ScriptedRetriever("toy", "memory", False, broken)
    pipeline = QueryPipeline(retrievers, retrieval, FixedEmbedder(), Announced("5-a"), LruCache(0), PipelineConfig())
    degraded = await pipeline.answer(QUERY, "w")
    assert degraded.meta.degraded == ["toy"]
    assert degraded.meta.retrievers == ["dense", "keyword"]
    assert degraded.meta.fusion is not None
    assert degraded.meta.fusion.method == "adaptive"


async def test_an_answer_without_the_embedder_is_cached_only_where_there_is_none() -> None:
    class FailingEmbedder(FixedEmbedder):
        async def embed_query_with_tokens_async(self, text: str, turn: str = "") -> tuple[Vector, np.ndarray]:  # type: ignore[type-arg]
            raise RuntimeError("model thread gone")

    failing: LruCache[CacheKey, bytes] = LruCache(10)
    reply = await pipeline_over(ScriptedRetrieval(), cache=failing, embedder=FailingEmbedder()).answer(QUERY, "w")
    assert reply.meta.degraded == ["embedder"]
    assert reply.meta.retrievers == ["keyword"]
    assert len(failing) == 0  # a failure this once: the next query may get the whole answer

    keyword_only: LruCache[CacheKey, bytes] = LruCache(10)
    pipeline = QueryPipeline(
        ScriptedRetrieval().retrievers(), ScriptedRetrieval(), None, Announced("5-a"), keyword_only, PipelineConfig()
    )
    reply = await pipeline.answer(QUERY, "w")
    assert reply.meta.degraded == ["embedder"]
    assert len(keyword_only) == 1  # a deployment without an embedder: as good as its answers get


def _chunk(doc_id: str, fqn: str, level: str, path: str = "pkg/a.py") -> StoredDocument:
    return StoredDocument(doc_id, "...", "t.T", "python", {"filePath": path, "symbolFqn": fqn, "chunkLevel": level})


def test_a_chunk_nested_in_a_better_ranked_one_of_its_symbol_is_left_out() -> None:
    documents = {
        d.id: d
        for d in (
            _chunk("method", "pkg.a.A.f", "method"),
            _chunk("doc", "pkg.a.A.f", "doc"),  # the method's docstring: inside the method
            _chunk("class", "pkg.a.A", "type"),  # holds the method
            _chunk("other", "pkg.a.A.g", "method"),  # a sibling: apart
            _chunk("getter", "pkg.a.A.p", "method"),
            _chunk("setter", "pkg.a.A.p", "method"),  # same name, same level: a property's two halves, apart
            _chunk("elsewhere", "pkg.a.A.f", "method", path="pkg/b.py"),  # another file: apart
            _chunk("prefix", "pkg.a.Ab", "type"),  # a longer name, not a member of A: apart
            StoredDocument("plain", "...", "t.T", "beir", {}),  # says nothing of its symbol: apart
        )
    }
    order = ["doc", "other", "method", "class", "getter", "setter", "elsewhere", "prefix", "plain"]
    candidates = [Fused(i, 1.0, 1.0) for i in order]
    kept, left_out = collapse_nested(candidates, documents)
    assert [k.id for k in kept] == ["doc", "other", "getter", "setter", "elsewhere", "prefix", "plain"]
    # The method holds its docstring, ranked first; the class holds the docstring too.
    assert left_out == [("method", "doc"), ("class", "doc")]
    # Chunks standing in a relation asked stay, whatever holds them (an agent tester's module calling Typer()
    # at its own level went into its function that calls it too: "2 of the 3").
    kept, left_out = collapse_nested(candidates, documents, kept_whole={"method", "class"})
    assert [k.id for k in kept][:4] == ["doc", "other", "method", "class"]
    assert left_out == [("getter", "class"), ("setter", "class")]  # the class, kept, holds the others as before


def test_a_docstring_ranked_above_its_own_code_gives_the_code_its_place() -> None:
    """A tester's agent got NativeTemplate.render's docstring first and the method itself, which holds it, only as
    an id in _meta. A class's or a module's docstring stays: its code holds every method of it, and may be long."""
    documents = {
        d.id: d
        for d in (
            _chunk("f doc", "pkg.a.A.f", "doc"),
            _chunk("other", "pkg.a.B", "type"),
            _chunk("B doc", "pkg.a.B.g", "doc"),
            _chunk("f", "pkg.a.A.f", "method"),
            _chunk("class doc", "pkg.a.A", "doc"),
            _chunk("class", "pkg.a.A", "type"),
            _chunk("g", "pkg.a.B.g", "method"),
        )
    }
    order = ["f doc", "other", "B doc", "f", "class doc", "class", "g"]
    candidates = [Fused(i, 1.0, 1.0 - n / 10) for n, i in enumerate(order)]
    moved, stands_for = code_before_its_docstring(candidates, documents)
    assert [hit.id for hit in moved] == ["f", "f doc", "other", "g", "B doc", "class doc", "class"]
    assert stands_for == {"f": "f doc", "g": "B doc"}
    assert (moved[0].relevance, moved[3].relevance) == (1.0, 0.8)  # each docstring's place and relevance
    kept, left_out = collapse_nested(moved, documents)
    assert [hit.id for hit in kept] == ["f", "other", "class doc"]
    # B holds g, ranked above it; the class holds f, and its own docstring.
    assert left_out == [("f doc", "f"), ("g", "other"), ("B doc", "other"), ("class", "f")]


def test_a_docstring_or_a_section_holds_nothing() -> None:
    module_doc = _chunk("module doc", "pkg.a", "doc")  # a module's docstring is not its classes
    class_doc = _chunk("class doc", "pkg.a.A", "doc")
    parts = [_chunk("class", "pkg.a.A", "type"), _chunk("method", "pkg.a.A.f", "method")]
    section = _chunk("1.2", "CHANGES.md > Releases > 1.2", "doc", path="CHANGES.md")
    subsection = _chunk("1.2.1", "CHANGES.md > Releases > 1.2.1", "doc", path="CHANGES.md")
    documents = {d.id: d for d in (module_doc, class_doc, *parts, section, subsection)}
    order = ["module doc", "class doc", "class", "method", "1.2", "1.2.1"]
    kept, left_out = collapse_nested([Fused(i, 1.0, 1.0) for i in order], documents)
    # Only the class holds something here: its own docstring, ranked above it. The method is not inside the
    # class's docstring, and the module's docstring holds neither.
    assert left_out == [("class", "class doc")]
    assert [k.id for k in kept] == ["module doc", "class doc", "method", "1.2", "1.2.1"]
    assert holds(parts[0], parts[1])
    assert not holds(parts[1], parts[0])
    assert not holds(module_doc, parts[0])


def test_collapse_keeps_what_comparing_every_pair_keeps() -> None:
    # The indexed collapse against its definition: a candidate goes if it nests with any better-ranked kept one,
    # and is reported against the best-ranked of those.
    names = ["p", "p.a", "p.a.A", "p.a.A.f", "p.a.A.g", "p.a.Ab", "p..x", "p.a.A.f.inner"]
    random = Random(7)
    for _ in range(300):
        documents = {
            f"c{i}": _chunk(
                f"c{i}",
                random.choice(names),
                random.choice(["file", "type", "method", "doc"]),
                path=random.choice(["a.py", "b.py"]),
            )
            for i in range(random.randint(1, 30))
        }
        candidates = [Fused(i, 1.0, 1.0) for i in documents]
        expected_kept: list[Fused] = []
        expected_left_out: list[tuple[str, str]] = []
        for hit in candidates:
            holder = next((k for k in expected_kept if nested(documents[hit.id], documents[k.id])), None)
            if holder is None:
                expected_kept.append(hit)
            else:
                expected_left_out.append((hit.id, holder.id))
        assert collapse_nested(candidates, documents) == (expected_kept, expected_left_out)


async def test_the_answer_says_what_it_left_out_and_a_request_can_keep_everything() -> None:
    class OneSymbol(ScriptedRetrieval):
        async def fetch(
            self, scope: Scope, ids: Sequence[str], token_signs_of: Sequence[str] = (), *second: Any
        ) -> Fetched:
            fetched = await super().fetch(scope, ids, token_signs_of, *second)
            levels = {"x": "method", "y": "doc", "z": "type"}
            fqns = {"x": "m.C.f", "y": "m.C.f", "z": "m.Other"}
            return Fetched(
                {i: replace(d, metadata={"filePath": "m.py", "symbolFqn": fqns[i], "chunkLevel": levels[i]})
                 for i, d in fetched.documents.items()},
                fetched.version,
            )  # fmt: skip

    pipeline = pipeline_over(OneSymbol())
    collapsed = await pipeline.answer(QUERY, "w")
    everything = await pipeline.answer(
        OntologyQuery.model_validate({"semanticQuery": "anything", "options": {"collapseNested": False}}), "w"
    )
    assert sorted(r.id for r in everything.results) == ["x", "y", "z"]
    # The method holds its docstring and keeps the better place of the two, whichever it was, and the better score
    # (a review's: with its own lower one, minRelevance could drop the symbol whose docstring it stood for).
    first, second = "x", "y"
    assert sorted(r.id for r in collapsed.results) == sorted([first, "z"])
    assert [(c.id, c.into) for c in collapsed.meta.collapsed] == [(second, first)]
    alone = {r.id: r.score for r in everything.results}
    assert next(r.score for r in collapsed.results if r.id == "x") == max(alone["x"], alone["y"]), alone
    assert collapsed.meta.calibrated
    assert everything.meta.collapsed == []
    # Only what the answer would have shown is reported: with topK 1, the docstring when it was first.
    one = (await pipeline.answer(QUERY.model_copy(update={"top_k": 1}), "w")).meta.collapsed
    shown_first = everything.results[0].id
    assert [(c.id, c.into) for c in one] == ([("y", "x")] if shown_first == "y" else [])
    # Nor one that went into a result minRelevance dropped (an agent tester's: `into` named no result).
    held = next(r.score for r in collapsed.results if r.id == first)
    above = await pipeline.answer(QUERY.model_copy(update={"min_relevance": held + 1e-6}), "w")
    assert first not in {r.id for r in above.results}
    assert above.meta.collapsed == []
    off = pipeline_over(OneSymbol(), config=PipelineConfig(collapse_nested=False))
    assert len((await off.answer(QUERY, "w")).results) == 3


async def test_an_answer_collapsing_left_short_of_top_k_is_filled_from_the_candidates_after_those_fetched() -> None:
    # An independent tester's LRUCache question got 1 result of the 10 asked: the class held the other candidates
    # fetched, and those after them were never read.
    methods = [f"m{i}" for i in range(60)]
    others = [f"o{i}" for i in range(10)]

    class OneClassFirst(ScriptedRetrieval):
        fetches: int = 0
        later_version: str | None = None

        async def dense(self, scope: Scope, query: SearchInput, limit: int) -> Hits:
            ranked = ["c", *methods, *others]
            return Hits([Candidate(i, 1.0 - n / 100) for n, i in enumerate(ranked)], self.dense_version)

        async def keyword(self, scope: Scope, query: SearchInput, limit: int) -> Hits:
            return Hits([], self.keyword_version)

        async def fetch(
            self, scope: Scope, ids: Sequence[str], token_signs_of: Sequence[str] = (), *second: Any
        ) -> Fetched:
            fetched = await super().fetch(scope, ids, token_signs_of, *second)
            self.fetches += 1
            version = self.later_version if self.fetches > 1 and self.later_version else fetched.version

            def where(i: str) -> dict[str, Any]:
                if i.startswith("o"):
                    return {"filePath": f"{i}.py", "symbolFqn": i, "chunkLevel": "type"}
                fqn, level = ("m.C", "type") if i == "c" else (f"m.C.{i}", "method")
                return {"filePath": "m.py", "symbolFqn": fqn, "chunkLevel": level}

            return Fetched({i: replace(d, metadata=where(i)) for i, d in fetched.documents.items()}, version)

    query = QUERY.model_copy(update={"top_k": 5})
    filled = await pipeline_over(OneClassFirst()).answer(query, "w")
    assert [r.id for r in filled.results] == ["c", *others[:4]]
    assert "refill" in filled.meta.timings_ms
    assert filled.meta.ontology_version == "5-a"
    # Read at another version than the answer's, they would mix two states: the answer stays short.
    later = OneClassFirst()
    later.later_version = "6-b"
    moved = await pipeline_over(later).answer(query, "w")
    assert [r.id for r in moved.results] == ["c"]
    # Nothing to fill: no second read.
    enough = OneClassFirst()
    await pipeline_over(enough).answer(QUERY.model_copy(update={"top_k": 1}), "w")
    assert enough.fetches == 1


@pytest.mark.parametrize(
    ("query", "meta", "shape"),
    [
        ({"objectType": "io.Files"}, {"listing": True}, "listing"),
        ({"semanticQuery": "zip", "followLinks": True}, {}, "relationship"),
        ({"semanticQuery": "what calls zip"}, {"couldBenefitFromLinkExpansion": True}, "relationship"),
        ({"semanticQuery": "ZipArchive", "precision": True}, {"skippedRerank": "bm25_saturation"}, "identifier"),
        ({"semanticQuery": "fit_reply"}, {"exactSymbolMatches": 1}, "identifier"),
        ({"semanticQuery": "compress a directory"}, {}, "concept"),
    ],
)
def test_the_shape_label_comes_from_the_pipelines_signals(
    query: dict[str, Any], meta: dict[str, Any], shape: str
) -> None:
    base = {"ontologyVersion": "v", "workspace": "w", "branch": "main", "hybrid": True, "reranked": False,
            "cacheHit": False, "backend": "b", "retrievers": [], "timingsMs": {}}  # fmt: skip
    assert shape_of(OntologyQuery.model_validate(query), QueryMeta.model_validate(base | meta)) == shape


async def test_scores_are_calibrated_over_the_answer_for_the_model_they_were_fitted_for() -> None:
    config = PipelineConfig()
    calibration = config.calibration()
    query = OntologyQuery.model_validate(
        {"semanticQuery": "q", "topK": 2, "options": {"lateInteraction": {"weight": 0}}}
    )
    reply = await pipeline_over(ScriptedRetrieval()).answer(query, "w")
    assert reply.meta.calibrated
    # Each scored from its own signals and its rank by the hybrid model (a keyword hit without a cosine by the
    # keyword one), in the pipeline's order.
    assert reply.results[0].signals == {"cosine": 0.8, "keyword": 0.75}  # y: dense 0.8, keyword 3.0 of 4.0
    estimates = [calibration.probability("hybrid", r.signals, r.rank) for r in reply.results]
    assert all(e is not None for e in estimates)
    assert [r.score for r in reply.results] == pytest.approx(estimates, abs=1e-6)
    # A deployment's setting of the form fitted before the rank was read (a weight per signal, then the bias).
    earlier = PipelineConfig(calibration_hybrid=(5.140, 5.505, -6.923))
    reply = await pipeline_over(ScriptedRetrieval(), config=earlier).answer(query, "w")
    signals = reply.results[0].signals
    assert reply.results[0].score == pytest.approx(
        1 / (1 + math.exp(-(5.140 * signals["cosine"] + 5.505 * signals["keyword"] - 6.923))), abs=1e-6
    )
    # An index of another embedding model: the cosine weights do not hold, the scores stay relative.
    other = await pipeline_over(ScriptedRetrieval(cosines={"z": 0.1}, index_model="another-model")).answer(query, "w")
    assert not other.meta.calibrated
    assert [r.score for r in other.results] != [r.score for r in reply.results]  # the fused relevance
    # Keyword alone does not read cosines: calibrated whatever the model.
    keyword = query.model_copy(update={"options": QueryOptions(retrievers=["keyword"])})
    assert (await pipeline_over(ScriptedRetrieval(index_model="another-model")).answer(keyword, "w")).meta.calibrated


async def test_definitions_placed_first_do_not_lower_the_scores_of_the_results_after_them() -> None:
    """A review's: each definition placed first counted as a place in the calibration, so every result after it
    scored as if one place lower (a strong one after four definitions: 0.19 where it scored 0.97 first)."""

    @dataclass
    class WithDefinition(ScriptedRetrieval):
        async def definitions(self, scope: Scope, name: str, limit: int) -> Definitions:
            return Definitions({"d": "shapes.circle_area"}, self.fetch_version)

    query = OntologyQuery.model_validate(
        {"semanticQuery": "circle_area", "topK": 3, "options": {"lateInteraction": {"weight": 0}}}
    )
    reply = await pipeline_over(WithDefinition()).answer(query, "w")
    assert [r.id for r in reply.results][:1] == ["d"]
    assert reply.results[0].score == 1.0
    assert len(reply.results) == 3
    calibration = PipelineConfig().calibration()
    for place, result in enumerate(reply.results[1:], start=1):
        expected = calibration.probability("hybrid", result.signals, place)
        assert result.score == pytest.approx(expected, abs=1e-6), (result.id, place)


async def test_a_definition_the_retrievers_ranked_first_keeps_the_next_result_in_second_place() -> None:
    """A tester's: the result after a definition the retrievers had ranked first scored as if in first place (0.63)
    with exact symbols on, and 0.34 with them off. Its score is now the same either way."""

    @dataclass
    class RankedDefinition(ScriptedRetrieval):
        async def definitions(self, scope: Scope, name: str, limit: int) -> Definitions:
            return Definitions({"y": "shapes.circle_area"}, self.fetch_version)  # the fused first

    asked = {"semanticQuery": "circle_area", "topK": 3, "options": {"lateInteraction": {"weight": 0}}}
    exact = OntologyQuery.model_validate(asked)
    without = OntologyQuery.model_validate(
        {**asked, "options": {"lateInteraction": {"weight": 0}, "exactSymbols": False}}
    )
    placed = await pipeline_over(RankedDefinition()).answer(exact, "w")
    ranked = await pipeline_over(RankedDefinition()).answer(without, "w")
    assert [r.id for r in placed.results] == [r.id for r in ranked.results] == ["y", "z", "x"]
    assert placed.results[0].score == 1.0
    assert [r.score for r in placed.results[1:]] == pytest.approx([r.score for r in ranked.results[1:]], abs=1e-9)


async def test_code_moved_to_its_docstrings_place_is_ranked_there_beside_a_definition_placed_first() -> None:
    """A review's: code moved up to its docstring's place kept its own, later index, so it counted a definition
    placed first that it had not been ranked below (two results at place 2, none at 1)."""

    @dataclass
    class DocstringDefinitionCode(ScriptedRetrieval):
        async def dense(self, scope: Scope, query: SearchInput, limit: int) -> Hits:
            ranked = [Candidate("f doc", 0.9), Candidate("other", 0.7), Candidate("d", 0.6), Candidate("f", 0.5)]
            return Hits(ranked, self.dense_version)

        async def keyword(self, scope: Scope, query: SearchInput, limit: int) -> Hits:
            return Hits([], self.keyword_version)

        async def fetch(self, scope: Scope, ids: Sequence[str], *args: Any, **kwargs: Any) -> Fetched:
            chunks = (_chunk("f doc", "pkg.a.A.f", "doc"), _chunk("f", "pkg.a.A.f", "method"),
                      _chunk("other", "pkg.a.B", "type"), _chunk("d", "pkg.b.d", "method", "pkg/b.py"))  # fmt: skip
            return Fetched({c.id: c for c in chunks if c.id in ids}, self.fetch_version, self.index_model)

        async def definitions(self, scope: Scope, name: str, limit: int) -> Definitions:
            return Definitions({"d": "pkg.b.d"}, self.fetch_version)

    query = OntologyQuery.model_validate(
        {"semanticQuery": "pkg.b.d", "topK": 3, "options": {"lateInteraction": {"weight": 0}}}
    )
    reply = await pipeline_over(DocstringDefinitionCode()).answer(query, "w")
    assert [r.id for r in reply.results] == ["d", "f", "other"]
    calibration = PipelineConfig().calibration()
    model = "hybrid" if reply.meta.hybrid else "dense"  # keyword found nothing: dense's model
    for place, result in enumerate(reply.results[1:], start=1):
        expected = calibration.probability(model, result.signals, place)
        assert result.score == pytest.approx(expected, abs=1e-6), (result.id, place)


async def test_a_filter_hiding_a_class_s_own_member_lets_no_base_s_stand_in_for_it() -> None:
    """A review's: with the override a class defines hidden by the request's filter, the base's definition was
    placed first as the definition of the member asked."""

    @dataclass
    class Overridden(ScriptedRetrieval):
        async def graph_rows(self, workspace: str, branch: str) -> GraphRows:
            nodes = [NodeRow("main", "pkg.Base", "class", (), False, False),
                     NodeRow("main", "pkg.Sub", "class", ("pkg.Base",), False, False)]  # fmt: skip
            return GraphRows(nodes=nodes, links=[], version=self.fetch_version)

        async def definitions(self, scope: Scope, name: str, limit: int) -> Definitions:
            defined = {"pkg.Sub.copy": ("x", "hand-authored"), "pkg.Base.copy": ("y", "ingested")}
            for fqn, (doc_id, provenance) in defined.items():
                if fqn.endswith(name) and scope.provenance in (None, provenance):
                    return Definitions({doc_id: fqn}, self.fetch_version)
            return Definitions({}, self.fetch_version)

    filtered = OntologyQuery.model_validate({"semanticQuery": "Sub.copy", "topK": 3, "provenance": "ingested"})
    reply = await pipeline_over(Overridden()).answer(filtered, "w")
    assert not any("symbol" in {f.retriever for f in r.found_by} for r in reply.results)
    # Without the filter, the class's own. (tests/test_exact_symbols.py: a member only the base defines.)
    own = await pipeline_over(Overridden()).answer(OntologyQuery(semantic_query="Sub.copy"), "w")
    assert own.results[0].id == "x"


async def test_code_scored_from_its_docstring_shows_the_docstrings_signals() -> None:
    """A tester's: a method that took its docstring's place scored from the docstring's signals (the better of the
    two) but showed its own, so its score could not be worked out from what the answer said."""

    @dataclass
    class MethodAndDocstring(ScriptedRetrieval):
        async def dense(self, scope: Scope, query: SearchInput, limit: int) -> Hits:
            return Hits([Candidate("f doc", 0.9), Candidate("other", 0.7), Candidate("f", 0.5)], self.dense_version)

        async def keyword(self, scope: Scope, query: SearchInput, limit: int) -> Hits:
            return Hits([Candidate("f doc", 3.0)], self.keyword_version, ceiling=4.0)

        async def fetch(self, scope: Scope, ids: Sequence[str], *args: Any, **kwargs: Any) -> Fetched:
            chunks = (_chunk("f doc", "pkg.a.A.f", "doc"), _chunk("f", "pkg.a.A.f", "method"),
                      _chunk("other", "pkg.a.B", "type"))  # fmt: skip
            return Fetched({c.id: c for c in chunks if c.id in ids}, self.fetch_version, self.index_model)

    query = OntologyQuery.model_validate(
        {"semanticQuery": "what does f do", "topK": 3, "options": {"lateInteraction": {"weight": 0}}}
    )
    reply = await pipeline_over(MethodAndDocstring()).answer(query, "w")
    assert [r.id for r in reply.results] == ["f", "other"]  # the docstring folded into its method, in its place
    method = reply.results[0]
    assert method.signals == {"cosine": 0.9, "keyword": 0.75}  # the docstring's, which it was scored from
    calibration = PipelineConfig().calibration()
    for result in reply.results:
        assert result.score == pytest.approx(calibration.probability("hybrid", result.signals, result.rank), abs=1e-6)


async def test_meta_says_when_the_keyword_list_was_pruned() -> None:
    class Pruned(ScriptedRetrieval):
        async def keyword(self, scope: Scope, query: SearchInput, limit: int) -> Hits:
            return replace(await super().keyword(scope, query, limit), pruned=True)

    assert (await pipeline_over(ScriptedRetrieval()).answer(QUERY, "w")).meta.keyword_pruned is False
    answer = await pipeline_over(Pruned()).answer(QUERY, "w")
    assert answer.meta.keyword_pruned is True
    assert answer.meta.model_dump(by_alias=True)["keywordPruned"] is True


@dataclass
class MovingStream:
    """A freshness source whose position and published deltas the test moves (DeltaWatch's answers, scripted)."""

    at: int
    published: dict[str, list[int]] = field(default_factory=dict)
    refused: bool = False

    async def position(self) -> int | None:
        return self.at

    def stream_refused(self, workspace: str) -> bool:
        return self.refused

    async def pending(self, workspace: str, branches: list[str], position: int) -> Pending | None:
        seqs = [seq for branch in branches for seq in self.published.get(branch, []) if seq > position]
        return Pending(len(seqs), 10.0 if seqs else None)


def _caching_pipeline(stream: MovingStream) -> QueryPipeline:
    """A pipeline with a cache, its freshness read from ``stream``."""
    cache: LruCache[CacheKey, bytes] = LruCache(10)
    return QueryPipeline(
        ScriptedRetrieval().retrievers(), ScriptedRetrieval(), FixedEmbedder(), Announced("5-a"), cache,
        PipelineConfig(), freshness=stream,
    )  # fmt: skip


async def test_an_answer_made_before_claims_the_position_now_only_when_its_branch_did_not_move() -> None:
    """A red team's finding: a cached (or shared) answer claimed the position read when it was handed out, past
    deltas of its branch applied since whose version this worker had not yet been told of."""
    stream = MovingStream(at=10)
    pipeline = _caching_pipeline(stream)
    made = await pipeline.answer(QUERY, "w")
    assert made.meta.freshness is not None
    assert made.meta.freshness.indexed_seq == 10
    # Another workspace's delta (11) is applied: the branch did not move, the answer holds 11 too.
    stream.at, stream.published["elsewhere"] = 11, [11]
    again = await pipeline.answer(QUERY, "w")
    assert again.meta.cache_hit is True
    assert again.meta.freshness is not None
    assert (again.meta.freshness.indexed_seq, again.meta.freshness.pending_deltas) == (11, 0)
    # A delta of its branch (12) is applied, its version not yet announced: the cached answer holds up to 11
    # only, so it is made anew (its own snapshot holds 12; a real index's version would then differ from the one
    # announced, and that answer would not be cached under the old key).
    stream.at, stream.published["main"] = 12, [12]
    anew = await pipeline.answer(QUERY, "w")
    assert anew.meta.cache_hit is False
    assert anew.meta.freshness is not None
    assert (anew.meta.freshness.indexed_seq, anew.meta.freshness.pending_deltas) == (12, 0)


async def test_a_cached_answer_whose_pending_deltas_were_settled_since_is_made_anew() -> None:
    """An independent tester's finding: an answer made right after the projector applied a delta, before it acked
    it, read the position below it; cached, it said "1 pending" with a growing pendingMs until the next version,
    and a client waiting for indexedSeq to pass its write waited as long."""
    stream = MovingStream(at=10, published={"main": [11]})  # 11 applied and announced, not yet acked
    pipeline = _caching_pipeline(stream)
    made = await pipeline.answer(QUERY, "w")
    assert made.meta.freshness is not None
    assert (made.meta.freshness.indexed_seq, made.meta.freshness.pending_deltas) == (10, 1)
    again = await pipeline.answer(QUERY, "w")  # nothing moved: the cached answer, as it was
    assert again.meta.cache_hit is True
    assert again.meta.freshness == made.meta.freshness
    stream.at = 11  # acked
    anew = await pipeline.answer(QUERY, "w")
    assert anew.meta.cache_hit is False
    assert anew.meta.freshness is not None
    assert (anew.meta.freshness.indexed_seq, anew.meta.freshness.pending_deltas) == (11, 0)
    cached = await pipeline.answer(QUERY, "w")  # and cached so
    assert cached.meta.cache_hit is True
    assert cached.meta.freshness == anew.meta.freshness


async def test_every_answer_says_while_the_index_does_not_follow_the_stream_also_from_the_cache() -> None:
    """A disaster recovery tester's: while a projector refused a replaced stream, answers said only that pending
    deltas grew. Each answer says it, a cached one too, and stops saying it once the stream is adopted."""
    stream = MovingStream(at=10)
    pipeline = _caching_pipeline(stream)
    made = await pipeline.answer(QUERY, "w")
    assert made.meta.freshness is not None
    assert made.meta.freshness.stream_refused is False
    stream.refused = True
    cached = await pipeline.answer(QUERY, "w")
    assert cached.meta.cache_hit is True
    assert cached.meta.freshness is not None
    assert cached.meta.freshness.stream_refused is True
    assert cached.meta.model_dump(by_alias=True)["freshness"]["streamRefused"] is True
    stream.refused = False
    again = await pipeline.answer(QUERY, "w")
    assert again.meta.freshness is not None
    assert again.meta.freshness.stream_refused is False


def test_a_fusion_parameter_the_deployment_s_method_ignores_is_named() -> None:
    """A second honesty tester's finding: without a method, denseWeight under the default adaptive fusion (or rrfK
    under convex) was accepted and ignored; with a method the contract refuses it."""
    from ontofabric.services.query.stages import unused_fusion_parameter

    def asked(fusion: dict[str, object]) -> OntologyQuery:
        return OntologyQuery.model_validate({"semanticQuery": "q", "options": {"fusion": fusion}})

    weight = unused_fusion_parameter(asked({"denseWeight": 0.9}), "adaptive")
    assert weight is not None
    assert weight.field == "options.fusion.denseWeight"
    assert "fuses by adaptive" in weight.message
    assert unused_fusion_parameter(asked({"denseWeight": 0.9}), "convex") is None
    k = unused_fusion_parameter(asked({"rrfK": 5}), "convex")
    assert k is not None
    assert k.field == "options.fusion.rrfK"
    assert unused_fusion_parameter(asked({"rrfK": 5}), "adaptive") is None  # its fall-back to rrf reads it
    assert unused_fusion_parameter(asked({"method": "convex", "denseWeight": 0.9}), "adaptive") is None
    assert unused_fusion_parameter(OntologyQuery(semantic_query="q"), "adaptive") is None


def test_a_name_of_many_dots_costs_collapsing_little() -> None:
    """An audit's: every dotted prefix of a stored name was made, so a symbolFqn of 60,000 dots took 1.8 GB and
    3 s of every query that found its document. Such a name is read as no symbol; a deep real one keeps its
    outermost prefixes."""
    dots = _chunk("dots", "m" + "." * 60_000, "method")
    deep = _chunk("deep", ".".join(f"p{i}" for i in range(100)), "method")
    holder = _chunk("holder", ".".join(f"p{i}" for i in range(10)), "type")
    documents = {d.id: d for d in (dots, deep, holder)}
    tracemalloc.start()
    kept, left_out = collapse_nested([Fused(i, 1.0, 1.0) for i in ("dots", "holder", "deep")], documents)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 5_000_000, peak
    assert ([k.id for k in kept], left_out) == (["dots", "holder"], [("deep", "holder")])


async def test_dense_and_keyword_search_run_at_once() -> None:
    """Seed 000 §6: the two retrievers run in parallel. Each search here waits until the other has begun: run one
    after the other, the first would wait out its deadline and the answer would lack it."""

    @dataclass
    class Meeting(ScriptedRetrieval):
        begun: dict[str, asyncio.Event] = field(
            default_factory=lambda: {"dense": asyncio.Event(), "keyword": asyncio.Event()}
        )

        async def _meet(self, mine: str, other: str) -> None:
            self.begun[mine].set()
            await asyncio.wait_for(self.begun[other].wait(), 2.0)

        async def dense(self, scope: Scope, query: SearchInput, limit: int) -> Hits:
            await self._meet("dense", "keyword")
            return await super().dense(scope, query, limit)

        async def keyword(self, scope: Scope, query: SearchInput, limit: int) -> Hits:
            await self._meet("keyword", "dense")
            return await super().keyword(scope, query, limit)

    pipeline, _ = _pipeline(Meeting())
    answer = await pipeline.answer(QUERY, "w")
    assert answer.meta.degraded == []
    assert set(answer.meta.retrievers) == {"dense", "keyword"}
