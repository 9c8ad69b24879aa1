"""Second vectors: a second embedding model's vector per document, sent by the ingester, stored by the projector,
and read by the query worker for its leading candidates, whose order the second model's opinion is fused into."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from pydantic import ValidationError

from ontofabric.contracts import OntologyQuery, SecondVector
from ontofabric.services.ingest.ingester import ChunkEmbedding, SecondVectors
from ontofabric.services.projector.planning import Delta
from ontofabric.services.projector.store import PostgresProjectionStore
from ontofabric.services.query.config import PipelineConfig
from ontofabric.services.query.core import Scope, StoredDocument
from ontofabric.services.query.fusion import Fused, SourceHit
from ontofabric.services.query.postgres import PostgresDocuments, PostgresSnapshots
from ontofabric.services.query.stages import second_opinion, second_opinion_order
from ontofabric.shared.db import create_pool, migrate
from ontofabric.shared.embedding_cache import Embedded, EmbeddingCache
from ontofabric.shared.onnx_models import OnnxEmbedder, embedder_name, pack_half, second_embedder, unpack_half
from ontofabric.shared.settings import Settings

from .conftest import Deployment
from .factories import document, upsert
from .test_pipeline import ScriptedRetrieval, pipeline_over

QUERY = np.array([1.0, 0.0, 0.0], dtype=np.float32)


def _half(*values: float) -> bytes:
    vector = np.array(values, dtype=np.float32)
    return pack_half(vector / np.linalg.norm(vector))


def test_float16_round_trip_keeps_a_unit_vector_s_cosines() -> None:
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((20, 384)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    restored = np.stack([unpack_half(pack_half(v)) for v in vectors])
    assert len(pack_half(vectors[0])) == 768
    assert float(np.abs(restored @ vectors[0] - vectors @ vectors[0]).max()) < 1e-3


def test_a_second_vector_must_be_whole_finite_and_not_zero() -> None:
    assert SecondVector.of_half("m", _half(1, 2, 3)).dimension == 3
    with pytest.raises(ValidationError, match="not a float16 vector of 3 dimensions"):
        SecondVector(model="m", dimension=3, data=base64.b64encode(b"\x00" * 5))
    with pytest.raises(ValidationError, match="finite and not zero"):
        SecondVector.of_half("m", np.zeros(4, dtype="<f2").tobytes())
    with pytest.raises(ValidationError, match="finite and not zero"):
        SecondVector.of_half("m", np.array([1, np.nan], dtype="<f2").tobytes())
    with pytest.raises(ValidationError, match="base64"):
        SecondVector.model_validate({"model": "m", "dimension": 2, "data": "AQI!"})
    with pytest.raises(ValidationError, match="model"):
        SecondVector.model_validate({"model": "", "dimension": 1, "data": base64.b64encode(_half(1)).decode()})


def test_a_candidate_without_a_cosine_keeps_its_place_in_both_opinions() -> None:
    # a, c, d have cosines and share places 0, 2, 3 by them (d, c, a); b has none and keeps place 1 in both.
    relevances = second_opinion([0.1, None, 0.5, 0.9], weight=1.0)
    assert relevances[1] == pytest.approx((2 / 61) / (2 / 60))
    assert relevances[2] == pytest.approx((2 / 62) / (2 / 60))
    assert relevances[0] == pytest.approx(relevances[3])  # places 0 and 3 against 3 and 0
    # With no cosine at all the order given stands, scored as if both opinions agreed.
    assert second_opinion([None, None, None], weight=1.0) == pytest.approx([1.0, 60 / 61, 60 / 62])


def _hit(doc_id: str, relevance: float) -> Fused:
    return Fused(doc_id, relevance, relevance, {"dense": SourceHit(1, relevance)})


def _stored(vectors: dict[str, bytes | None]) -> dict[str, StoredDocument]:
    return {i: StoredDocument(i, i, "t.T", "tests", {}, None, v) for i, v in vectors.items()}


def test_the_stage_reorders_the_leading_candidates_by_both_opinions() -> None:
    candidates = [_hit("a", 0.9), _hit("b", 0.8), _hit("c", 0.7), _hit("d", 0.6)]
    documents = _stored({"a": _half(0, 1, 0), "b": _half(1, 0.1, 0), "c": _half(1, 0, 0), "d": _half(1, 0, 0)})
    order, report = second_opinion_order("m", QUERY, candidates, documents, weight=5.0, depth=3)
    assert report is not None
    assert (report.model, report.candidates, report.with_second_vectors) == ("m", 3, 3)
    assert [h.id for h in order] == ["c", "b", "a", "d"]  # d is past the depth: it stays last, scaled below
    assert order[-1].relevance < order[-2].relevance
    # Nothing to compare: one vector, or vectors of another width, or weight 0.
    one = _stored({"a": _half(1, 0, 0), "b": None, "c": None, "d": None})
    assert second_opinion_order("m", QUERY, candidates, one, 1.0, 3) == (candidates, None)
    other_width = _stored({i: _half(1, 0) for i in "abcd"})
    assert second_opinion_order("m", QUERY, candidates, other_width, 1.0, 3) == (candidates, None)
    assert second_opinion_order("m", QUERY, candidates, documents, 0.0, 3) == (candidates, None)
    # Cosines, not dot products: a sender that scales its vectors moves nothing.
    scaled = {
        i: StoredDocument(i, i, "t.T", "tests", {}, None, pack_half(unpack_half(d.second_vector or b"") * (n + 1) * 7))
        for n, (i, d) in enumerate(documents.items())
    }
    assert second_opinion_order("m", QUERY, candidates, scaled, 5.0, 3) == (order, report)


class FixedSecondModel:
    """A second embedder whose every query vector is QUERY."""

    name = "second-test"

    def __init__(self, fails: bool = False) -> None:
        self.calls = 0
        self.fails = fails

    async def embed_query(self, text: str) -> npt.NDArray[np.float32]:
        self.calls += 1
        if self.fails:
            raise RuntimeError("the second model is gone")
        return QUERY


async def test_the_pipeline_asks_for_its_model_s_vectors_and_says_what_ran() -> None:
    # y leads the fused order (both retrievers found it), then x, then z; z's vector is the query's own.
    vectors = {"x": ("second-test", _half(0, 1, 0)), "y": ("second-test", _half(0, 0, 1))}
    vectors["z"] = ("second-test", _half(1, 0, 0))
    retrieval = ScriptedRetrieval(second_vectors=vectors)
    plain = await pipeline_over(retrieval).answer(OntologyQuery(semantic_query="q"), "w")
    assert plain.meta.second_opinion is None
    assert plain.meta.skipped_second_opinion is None  # not asked for
    assert retrieval.second_asked[-1] == ([], None)
    # Asked for where no second model runs: said, not dropped in silence (an independent tester's finding).
    asked = OntologyQuery.model_validate({"semanticQuery": "q", "options": {"secondOpinion": {"weight": 5}}})
    unheard = await pipeline_over(retrieval).answer(asked, "w")
    assert (unheard.meta.second_opinion, unheard.meta.skipped_second_opinion) == (None, "not_configured")
    model = FixedSecondModel()
    config = PipelineConfig(second_opinion_weight=10.0)
    reply = await pipeline_over(retrieval, config=config, second=model).answer(OntologyQuery(semantic_query="q"), "w")
    assert reply.meta.second_opinion is not None
    assert reply.meta.skipped_second_opinion is None
    assert reply.meta.second_opinion.model == "second-test"
    assert reply.meta.second_opinion.with_second_vectors == 3
    assert "secondOpinion" in reply.meta.timings_ms
    assert sorted(retrieval.second_asked[-1][0]) == ["x", "y", "z"]
    assert retrieval.second_asked[-1][1] == "second-test"
    assert reply.results[0].id == "z" != plain.results[0].id
    # A request that turns it off is not embedded twice, and keeps the order of the plain pipeline.
    asked_off = OntologyQuery.model_validate({"semanticQuery": "q", "options": {"secondOpinion": {"weight": 0}}})
    calls = model.calls
    off = await pipeline_over(retrieval, config=config, second=model).answer(asked_off, "w")
    assert (off.meta.second_opinion, model.calls) == (None, calls)
    assert [r.id for r in off.results] == [r.id for r in plain.results]
    # Vectors of another model are never compared.
    retrieval.second_vectors = {i: ("another", data) for i, (_, data) in vectors.items()}
    other = await pipeline_over(retrieval, config=config, second=model).answer(OntologyQuery(semantic_query="q"), "w")
    assert other.meta.second_opinion is None
    assert [r.id for r in other.results] == [r.id for r in plain.results]


async def test_second_vectors_are_fetched_as_deep_as_late_interaction_reaches() -> None:
    # Late interaction runs first and may lift a candidate from its own depth into the second opinion's.
    retrieval = ScriptedRetrieval()
    model = FixedSecondModel()
    both = PipelineConfig(second_opinion_depth=2, late_interaction_depth=3, late_interaction_weight=0.2)
    await pipeline_over(retrieval, config=both, second=model).answer(OntologyQuery(semantic_query="q"), "w")
    assert len(retrieval.second_asked[-1][0]) == 3
    without = PipelineConfig(second_opinion_depth=2, late_interaction_weight=0.0)
    await pipeline_over(retrieval, config=without, second=model).answer(OntologyQuery(semantic_query="q"), "w")
    assert len(retrieval.second_asked[-1][0]) == 2


async def test_a_keyword_only_request_gets_the_second_opinion_without_waiting_for_an_embedding() -> None:
    vectors = {"y": ("second-test", _half(0, 1, 0)), "z": ("second-test", _half(1, 0, 0))}
    retrieval = ScriptedRetrieval(second_vectors=vectors)
    keyword_only = OntologyQuery.model_validate({"semanticQuery": "q", "options": {"retrievers": ["keyword"]}})
    config = PipelineConfig(second_opinion_weight=10.0)
    reply = await asyncio.wait_for(
        pipeline_over(retrieval, config=config, second=FixedSecondModel()).answer(keyword_only, "w"), 5
    )
    assert reply.meta.second_opinion is not None
    assert reply.meta.second_opinion.with_second_vectors == 2
    assert [r.id for r in reply.results] == ["z", "y"]  # keyword put y first; the second model prefers z


async def test_a_second_model_that_fails_degrades_to_the_order_before_it() -> None:
    vectors = {i: ("second-test", _half(1, n, 0)) for n, i in enumerate("xyz")}
    retrieval = ScriptedRetrieval(second_vectors=vectors)
    plain = await pipeline_over(retrieval).answer(OntologyQuery(semantic_query="q"), "w")
    failing = FixedSecondModel(fails=True)
    reply = await pipeline_over(retrieval, second=failing).answer(OntologyQuery(semantic_query="q"), "w")
    assert reply.meta.degraded == ["secondOpinion"]
    assert reply.meta.second_opinion is None
    assert [(r.id, r.score) for r in reply.results] == [(r.id, r.score) for r in plain.results]


async def test_postgres_stores_second_vectors_and_reads_them_only_where_asked(deployment: Deployment) -> None:
    await migrate(deployment.database_url, deployment.settings)
    pool = await create_pool(deployment.database_url, deployment.settings)
    try:
        halves = {i: _half(1, n + 1, 0) for n, i in enumerate("abc")}
        deltas = [
            upsert("acme", document(i, i, second_vector=SecondVector.of_half("m2", h))) for i, h in halves.items()
        ]
        deltas.append(upsert("acme", document("d", "d")))  # sent without one
        await PostgresProjectionStore(pool, "english").apply([Delta(n + 1, d) for n, d in enumerate(deltas)])
        documents = PostgresDocuments(PostgresSnapshots(pool))
        scope = Scope("acme", "main")
        asked = await documents.fetch(scope, ["a", "b", "c", "d"], ["a"], ["a", "b", "d"], "m2")
        other_model = await documents.fetch(scope, ["a", "b"], [], ["a", "b"], "m3")
        none_asked = await documents.fetch(scope, ["a", "b"])
    finally:
        await pool.close()
    assert {i: d.second_vector for i, d in asked.documents.items()} == {
        "a": halves["a"], "b": halves["b"], "c": None, "d": None
    }  # fmt: skip
    assert {d.second_vector for d in other_model.documents.values()} == {None}
    assert {d.second_vector for d in none_asked.documents.values()} == {None}


def test_the_ingester_sends_the_second_model_s_vectors_and_caches_them(
    tiny_onnx_embedder: Path, tmp_path: Path
) -> None:
    model = OnnxEmbedder(tiny_onnx_embedder, "tiny-second")
    texts = ["def parse(text): return json.loads(text)", "a recipe for bread", "def parse(text): ..."]
    cache = EmbeddingCache(tmp_path / "cache.sqlite")
    try:
        second = SecondVectors.of(model, texts, cache)
        assert second is not None

        def nothing_computed(batch: object) -> npt.NDArray[np.float32]:
            raise AssertionError("cached vectors were computed again")

        again = cache.vectors("tiny-second", nothing_computed, texts)
    finally:
        cache.close()
    direct = model.embed(texts)
    assert np.allclose(second.vectors, direct, atol=1e-6)
    assert np.array_equal(again, second.vectors)
    embedded = Embedded(np.eye(3, 4, dtype=np.float32), [b"", b"", b""])
    wire = ChunkEmbedding.of(embedded, 4, token_vectors=False, second=second)
    assert [w.second_vector.model for w in wire if w.second_vector] == ["tiny-second"] * 3
    first = wire[0].second_vector
    assert first is not None
    assert first.dimension == direct.shape[1]
    assert np.allclose(unpack_half(first.data), direct[0], atol=1e-3)
    assert SecondVectors.of(None, texts) is None


def test_settings_load_the_second_model_only_when_asked(tiny_onnx_embedder: Path) -> None:
    assert second_embedder(Settings()) is None
    loaded = second_embedder(Settings(second_vectors=True, second_vectors_model_path=tiny_onnx_embedder))
    assert loaded is not None
    # Named by its folder and its weights: a model replaced in place, or another in a folder of the same name, is
    # another model.
    assert loaded.name == embedder_name(tiny_onnx_embedder)
    assert loaded.name.startswith(f"{tiny_onnx_embedder.name}-")
    assert len(loaded.name) == len(tiny_onnx_embedder.name) + 13
    with pytest.raises(ValueError, match=r"no model\.onnx or tokenizer\.json there"):
        second_embedder(Settings(second_vectors=True, second_vectors_model_path=tiny_onnx_embedder / "absent"))


async def test_queries_arriving_together_are_embedded_as_each_alone(tiny_onnx_embedder: Path) -> None:
    model = OnnxEmbedder(tiny_onnx_embedder, "tiny-second")
    texts = ["parse json", "retry with exponential backoff", "open a file"]
    together = await asyncio.gather(*(model.embed_query(t) for t in texts))
    for text, vector in zip(texts, together, strict=True):
        assert np.allclose(vector, model.embed([text])[0], atol=1e-5)
