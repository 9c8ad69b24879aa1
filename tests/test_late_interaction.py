"""Late interaction: packing token vectors into sign bits and back, MaxSim and its blend with the fused order, the
pipeline stage that applies it to the leading candidates, and the embedding model's own tokens ranking a clear
match higher from their stored signs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from ontofabric.contracts import OntologyQuery, TokenVectors
from ontofabric.services.projector.planning import Delta
from ontofabric.services.projector.store import PostgresProjectionStore
from ontofabric.services.query import pipeline as pipeline_module
from ontofabric.services.query.config import PipelineConfig
from ontofabric.services.query.core import Scope, StoredDocument
from ontofabric.services.query.fusion import Fused, SourceHit
from ontofabric.services.query.pipeline import QueryPipeline
from ontofabric.services.query.postgres import PostgresDocuments, PostgresSnapshots
from ontofabric.services.query.stages import late_interaction
from ontofabric.shared.db import create_pool, migrate
from ontofabric.shared.embedder import build_embedder
from ontofabric.shared.late_interaction import (
    blend_with_fused_relevance,
    max_similarities,
    max_similarities_of_signs,
    pack_signs,
    token_count,
    unpack_signs,
)
from ontofabric.shared.settings import Settings

from .conftest import Deployment
from .factories import document, upsert
from .test_pipeline import QUERY_TOKENS, ScriptedRetrieval, pipeline_over


def test_sign_bits_round_trip_to_unit_rows_of_the_same_signs() -> None:
    tokens = np.random.default_rng(7).standard_normal((5, 384)).astype(np.float32)
    packed = pack_signs(tokens)
    assert len(packed) == 5 * 48
    assert token_count(packed, 384) == 5
    unpacked = unpack_signs(packed, 384)
    assert unpacked.shape == (5, 384)
    assert np.array_equal(np.sign(unpacked), np.where(tokens > 0, 1.0, -1.0))
    assert np.linalg.norm(unpacked, axis=1) == pytest.approx(1.0)
    odd = unpack_signs(pack_signs(tokens[:, :13]), 13)  # a width that is no multiple of 8: padding bits ignored
    assert np.array_equal(np.sign(odd), np.where(tokens[:, :13] > 0, 1.0, -1.0))


@pytest.mark.parametrize("size", [0, 47, 49])
def test_bytes_that_are_no_whole_number_of_tokens_are_refused(size: int) -> None:
    with pytest.raises(ValueError, match="whole number"):
        unpack_signs(b"\x00" * size, 384)


def test_max_similarity_takes_each_query_tokens_best_match_in_each_document() -> None:
    query = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    matches_both = np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], dtype=np.float32)
    matches_one = np.array([[1.0, 0.0], [1.0, 0.0]], dtype=np.float32)
    shorter = np.array([[0.6, 0.8]], dtype=np.float32)
    assert max_similarities(query, [matches_both, matches_one, shorter]) == pytest.approx(
        [1.0, 0.5, 0.7]  # matches_one: (1 + 0) / 2, a repeat earns nothing more; shorter: (0.6 + 0.8) / 2
    )
    assert max_similarities(query, []) == []


@pytest.mark.parametrize("dimension", [384, 13])
def test_max_similarity_over_packed_signs_equals_it_over_their_unpacked_rows(dimension: int) -> None:
    rng = np.random.default_rng(11)
    query = rng.standard_normal((7, dimension)).astype(np.float32)
    query /= np.linalg.norm(query, axis=1, keepdims=True)
    packed = [pack_signs(rng.standard_normal((n, dimension)).astype(np.float32)) for n in (1, 40, 3, 256)]
    expected = max_similarities(query, [unpack_signs(p, dimension) for p in packed])
    assert max_similarities_of_signs(query, packed, dimension) == pytest.approx(expected, abs=1e-6)
    assert len(set(expected)) == len(expected)  # distinct documents: a mix-up of documents would show
    assert max_similarities_of_signs(query, [], dimension) == []
    with pytest.raises(ValueError, match="whole number"):
        max_similarities_of_signs(query, [packed[0], b"\x00" * 3], dimension)


EVENLY = [1.0 - n / 10 for n in range(10)]
"""Fused relevances one step apart, as fused positions are."""


def test_blending_similarity_into_the_fused_relevance() -> None:
    similarities: list[float | None] = [0.1, 0.2, 0.9, 0.3]
    kept = blend_with_fused_relevance(similarities, EVENLY[:4], weight=0.0)
    assert kept == sorted(kept, reverse=True)  # weight 0: the fused order as it was
    assert len(set(kept)) == 4
    followed = blend_with_fused_relevance(similarities, EVENLY[:4], weight=1.0)
    assert max(range(4), key=lambda i: followed[i]) == 2  # weight 1: the similarity alone
    assert all(0.0 < v < 1.0 for v in kept + followed)
    assert blend_with_fused_relevance([0.4, 0.4, 0.4], [0.5, 0.5, 0.5], 1.0) == [0.5, 0.5, 0.5]  # no signal
    assert blend_with_fused_relevance([0.7], [0.3], 0.2) == [0.5]
    assert blend_with_fused_relevance([], [], 0.2) == []


def test_a_candidate_without_token_vectors_is_neither_lifted_nor_sunk() -> None:
    """Before 2026-11-30 it took the mean similarity: the fusion's first, found first by both retrievers but sent
    without token vectors, fell to fourth below three the fusion scored near zero (an independent tester)."""
    relevances = [0.72, 0.05, 0.04, 0.03, 0.02]
    similarities: list[float | None] = [None, 0.6, 0.7, 0.65, 0.2]
    blended = blend_with_fused_relevance(similarities, relevances, weight=1.0)
    assert max(range(5), key=lambda i: blended[i]) == 0
    fused_only = blend_with_fused_relevance(similarities, relevances, weight=0.0)
    assert blended[0] == pytest.approx(fused_only[0])  # its own fused standing, whatever the weight
    # Equal similarities say nothing: the fused order stands (the review's case: the first fell below the second).
    level = blend_with_fused_relevance([0.5, None, 0.5, 0.5], [0.9, 0.85, 0.1, 0.1], 0.2)
    assert level == pytest.approx(blend_with_fused_relevance([0.5, None, 0.5, 0.5], [0.9, 0.85, 0.1, 0.1], 0.0))


def test_a_candidate_far_ahead_in_the_fusion_is_not_overtaken_for_its_tokens_alone() -> None:
    """Positions alone hid how far ahead the first was: a keyword match scored 0.9 by the fusion fell below a
    candidate it scored near zero whose tokens matched the query better (an independent tester's finding)."""
    relevances = [0.9, 0.06, 0.05, 0.05, 0.04, 0.04, 0.03, 0.03, 0.02, 0.02]
    similarities: list[float | None] = [0.1, 0.3, 0.3, 0.9, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3]
    relevance = blend_with_fused_relevance(similarities, relevances, Settings().late_interaction_weight)
    order = sorted(range(10), key=lambda i: -relevance[i])
    assert order[0] == 0
    assert order[1] == 3  # among the near-equals, the strong token match leads
    # Second in the fusion, a strong match overtakes a first it is level with, not one far ahead of it (by
    # positions alone it overtook both).
    similarities = [0.1, 0.9, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3]
    level = blend_with_fused_relevance(similarities, [0.5, 0.49, 0.2, 0.19, 0.18, 0.17, 0.16, 0.15, 0.14, 0.13], 0.2)
    assert max(range(10), key=lambda i: level[i]) == 1
    behind = blend_with_fused_relevance(similarities, relevances, 0.2)
    assert max(range(10), key=lambda i: behind[i]) == 0


def test_at_the_deployment_weight_a_strong_match_climbs_but_does_not_jump_the_queue() -> None:
    similarities: list[float | None] = [0.3, 0.31, 0.29, 0.3, 0.32, 0.9, 0.3, 0.28, 0.31, 0.3]
    relevance = blend_with_fused_relevance(similarities, EVENLY, Settings().late_interaction_weight)
    order = sorted(range(10), key=lambda i: -relevance[i])
    assert order.index(5) == 3  # from sixth to fourth
    assert order[:3] == [0, 1, 2]
    assert [i for i in order if i != 5] == [0, 1, 2, 3, 4, 6, 7, 8, 9]  # the rest keep their fused order


def _fused(ids: list[str]) -> list[Fused]:
    return [Fused(i, 1.0 - n / 10, 1.0 - n / 10, {"dense": SourceHit(n + 1, 0.5)}) for n, i in enumerate(ids)]


def _stored(signs: dict[str, bytes | None]) -> dict[str, StoredDocument]:
    return {i: StoredDocument(i, i, "t.T", "tests", {}, s) for i, s in signs.items()}


def test_the_stage_reorders_the_leading_candidates_and_scales_the_rest_under_them() -> None:
    query = np.array([[1.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    off = pack_signs(np.array([[-1.0, 1.0, 1.0, 1.0]]))
    on = pack_signs(np.array([[1.0, -1.0, -1.0, -1.0]]))
    candidates = _fused(["a", "b", "c", "d"])
    documents = _stored({"a": off, "b": off, "c": on, "d": on})
    ordered, report = late_interaction(query, candidates, documents, weight=1.0, depth=3)
    assert [f.id for f in ordered] == ["c", "a", "b", "d"]  # c lifted; d past the depth stays last
    assert report is not None
    assert (report.candidates, report.with_token_vectors, report.weight) == (3, 3, 1.0)
    relevances = [f.relevance for f in ordered]
    assert relevances == sorted(relevances, reverse=True)
    assert ordered[3].relevance == pytest.approx(min(relevances[:3]) * candidates[3].relevance)
    assert [f.found_by for f in ordered] == [candidates[i].found_by for i in (2, 0, 1, 3)]


def test_the_stage_leaves_the_order_alone_when_there_is_nothing_to_compare() -> None:
    query = np.array([[1.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    candidates = _fused(["a", "b", "c"])
    one_with = _stored({"a": None, "b": None, "c": pack_signs(np.ones((1, 4)))})
    assert late_interaction(query, candidates, one_with, weight=0.5, depth=3) == (candidates, None)
    wide_query = np.eye(1, 16, dtype=np.float32)
    wrong_width = _stored({i: b"\x00" * 5 for i in "abc"})  # no whole number of 16-dimensional tokens (2 bytes)
    assert late_interaction(wide_query, candidates, wrong_width, weight=0.5, depth=3) == (candidates, None)
    every = _stored({i: pack_signs(np.ones((1, 4))) for i in "abc"})
    assert late_interaction(query, candidates, every, weight=0.0, depth=3) == (candidates, None)


def _pipeline(retrieval: ScriptedRetrieval, config: PipelineConfig | None = None) -> QueryPipeline:
    return pipeline_over(retrieval, config=config)


async def test_the_pipeline_runs_it_on_what_it_fetched_and_says_so() -> None:
    # x leads the fusion, y and z follow; z's tokens match the query's (QUERY_TOKENS), x's and y's do not.
    signs = {
        "x": pack_signs(-np.ones((2, 3))),
        "y": pack_signs(-np.ones((2, 3))),
        "z": pack_signs(QUERY_TOKENS - 0.5),
    }
    retrieval = ScriptedRetrieval(token_signs=signs)
    fused = await _pipeline(retrieval).answer(
        OntologyQuery.model_validate({"semanticQuery": "q", "options": {"lateInteraction": {"weight": 0}}}), "w"
    )
    assert fused.meta.late_interaction is None
    reply = await _pipeline(retrieval, PipelineConfig(late_interaction_weight=0.9)).answer(
        OntologyQuery(semantic_query="q"), "w"
    )
    assert reply.meta.late_interaction is not None
    assert reply.meta.late_interaction.with_token_vectors == 3
    assert "lateInteraction" in reply.meta.timings_ms
    assert reply.results[0].id == "z" != fused.results[0].id
    assert sorted(r.id for r in reply.results) == sorted(r.id for r in fused.results)
    keyword_only = await _pipeline(retrieval).answer(
        OntologyQuery.model_validate({"semanticQuery": "q", "options": {"retrievers": ["keyword"]}}), "w"
    )
    assert keyword_only.meta.late_interaction is None  # no embedding pass, no query tokens
    assert keyword_only.meta.skipped_late_interaction is None  # not asked for: nothing to say
    asked_alone = OntologyQuery.model_validate(
        {"semanticQuery": "q", "options": {"retrievers": ["keyword"], "lateInteraction": {"weight": 0.9}}}
    )
    unheard = await _pipeline(retrieval).answer(asked_alone, "w")  # an independent tester's finding: said nothing
    assert unheard.meta.late_interaction is None
    assert unheard.meta.skipped_late_interaction == "not_embedded"
    # Nothing to compare: no leading candidate has token vectors (a second tester's finding: said nothing).
    bare = await _pipeline(ScriptedRetrieval(token_signs={})).answer(OntologyQuery(semantic_query="q"), "w")
    assert bare.meta.late_interaction is None
    assert bare.meta.skipped_late_interaction == "no_token_vectors"
    assert reply.meta.skipped_late_interaction is None
    # A query of more tokens than the deployment compares keeps the fused order, and says why.
    shorter = PipelineConfig(late_interaction_weight=0.9, late_interaction_max_query_tokens=len(QUERY_TOKENS) - 1)
    long_query = await _pipeline(retrieval, shorter).answer(OntologyQuery(semantic_query="q"), "w")
    assert long_query.meta.skipped_late_interaction == "long_query"
    assert long_query.meta.late_interaction is None
    assert [r.id for r in long_query.results] == [r.id for r in fused.results]
    # A query of exactly as many tokens still gets it; so does a long one whose request sets the weight itself.
    exactly = PipelineConfig(late_interaction_weight=0.9, late_interaction_max_query_tokens=len(QUERY_TOKENS))
    assert (await _pipeline(retrieval, exactly).answer(OntologyQuery(semantic_query="q"), "w")).results[0].id == "z"
    asked = OntologyQuery.model_validate({"semanticQuery": "q", "options": {"lateInteraction": {"weight": 0.9}}})
    insisted = await _pipeline(retrieval, shorter).answer(asked, "w")
    assert insisted.meta.skipped_late_interaction is None
    assert insisted.results[0].id == "z"


class EchoReranker:
    """Keeps the order it is given and remembers it."""

    name = "echo"

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def rerank(self, query: str, documents: Sequence[str], top_n: int) -> list[tuple[int, float]]:
        self.seen = list(documents)
        return [(i, 1.0 - i / len(documents)) for i in range(min(top_n, len(documents)))]

    async def close(self) -> None:
        pass


async def test_a_reranker_gets_the_candidates_in_the_order_late_interaction_left() -> None:
    signs = {"x": pack_signs(-np.ones((2, 3))), "y": pack_signs(-np.ones((2, 3))), "z": pack_signs(QUERY_TOKENS - 0.5)}
    reranker = EchoReranker()
    pipeline = pipeline_over(
        ScriptedRetrieval(token_signs=signs), config=PipelineConfig(late_interaction_weight=0.9), reranker=reranker
    )
    reply = await pipeline.answer(OntologyQuery(semantic_query="q", precision=True), "w")
    assert reply.meta.late_interaction is not None
    assert reply.meta.reranked is True
    assert reranker.seen[0] == "content z"  # lifted by late interaction before the reranker saw the list
    assert reply.results[0].id == "z"


async def test_a_failing_stage_degrades_the_answer_to_the_fused_order(monkeypatch: pytest.MonkeyPatch) -> None:
    signs = {i: pack_signs(QUERY_TOKENS - 0.5) for i in "xyz"}
    fused = await _pipeline(ScriptedRetrieval(token_signs=signs)).answer(
        OntologyQuery.model_validate({"semanticQuery": "q", "options": {"lateInteraction": {"weight": 0}}}), "w"
    )

    def broken(*args: object) -> object:
        raise RuntimeError("no arithmetic today")

    monkeypatch.setattr(pipeline_module, "late_interaction", broken)
    reply = await _pipeline(ScriptedRetrieval(token_signs=signs)).answer(OntologyQuery(semantic_query="q"), "w")
    assert reply.meta.degraded == ["lateInteraction"]
    assert reply.meta.late_interaction is None
    assert [(r.id, r.score) for r in reply.results] == [(r.id, r.score) for r in fused.results]


async def test_token_signs_of_another_model_than_the_querys_are_not_compared_and_the_answer_says_why() -> None:
    """At a model change's swap, the index's signs are the new model's and the query's tokens the old one's: not
    compared, and said why (a model-change tester's answer said only that lateInteraction degraded)."""
    signs = {i: pack_signs(QUERY_TOKENS - 0.5) for i in "xyz"}
    swapped = ScriptedRetrieval(token_signs=signs, index_model="another-model")
    reply = await _pipeline(swapped).answer(OntologyQuery(semantic_query="q"), "w")
    assert reply.meta.degraded == ["lateInteraction"]
    assert reply.meta.skipped_late_interaction == "model_changed"
    assert reply.meta.late_interaction is None


def test_stored_signs_of_the_model_s_own_tokens_find_the_match() -> None:
    """With the deployment's model: from the signs alone, MaxSim puts the JSON parser first, as float MaxSim does."""
    embedder = build_embedder(Settings())
    assert embedder is not None
    documents = [
        "def add_user(name): users.append(name)",
        "a recipe for bread with flour and water",
        "def parse_json(text):\n    return json.loads(text)",
        "the weather is sunny today",
    ]
    _, tokens = embedder.embed_with_tokens(documents)
    _, (query,) = embedder.embed_with_tokens(["parse a json string"])
    from_signs = max_similarities(query, [unpack_signs(pack_signs(t), embedder.dimension) for t in tokens])
    from_floats = max_similarities(query, tokens)
    assert int(np.argmax(from_signs)) == int(np.argmax(from_floats)) == 2


async def test_postgres_fetch_reads_token_signs_only_where_asked(deployment: Deployment) -> None:
    await migrate(deployment.database_url, deployment.settings)
    pool = await create_pool(deployment.database_url, deployment.settings)
    try:
        signs = {i: pack_signs(np.random.default_rng(n).standard_normal((3, 384))) for n, i in enumerate("abc")}
        deltas = [
            upsert("acme", document(i, i, token_vectors=TokenVectors.of_signs(384, s), embedding_model="m"))
            for i, s in signs.items()
        ]
        branch_signs = pack_signs(np.ones((2, 384)))
        override = document("b", "b on the branch", token_vectors=TokenVectors.of_signs(384, branch_signs))
        deltas.append(upsert("acme", override, branch="feature"))
        await PostgresProjectionStore(pool, "english").apply([Delta(n + 1, d) for n, d in enumerate(deltas)])
        retrieval = PostgresDocuments(PostgresSnapshots(pool))
        on_main = await retrieval.fetch(Scope("acme", "main"), ["a", "b", "c"], ["a", "c"])
        on_branch = await retrieval.fetch(Scope("acme", "feature"), ["a", "b", "c"], ["b", "c"])
    finally:
        await pool.close()
    assert {i: d.token_signs for i, d in on_main.documents.items()} == {"a": signs["a"], "b": None, "c": signs["c"]}
    # On the branch its own b shadows main's, signs included; the parameters after the signs' list line up.
    assert {i: d.token_signs for i, d in on_branch.documents.items()} == {"a": None, "b": branch_signs, "c": signs["c"]}
    assert on_branch.documents["b"].content == "b on the branch"
