"""Rerankers: the Cohere-API adapter against a real local HTTP server answering in Cohere's shape, for success
and every failure class; a local cross-encoder built inside the test (random weights), also exported to ONNX;
and the pipeline keeping the fused order whenever a reranker fails."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from ontofabric.contracts import OntologyQuery
from ontofabric.services.query.config import PipelineConfig
from ontofabric.services.query.core import RerankerError, check_ranking
from ontofabric.services.query.pipeline import QueryPipeline
from ontofabric.services.query.rerankers import (
    CohereReranker,
    LocalCrossEncoder,
    OnnxCrossEncoder,
    SecondEmbedder,
    build_reranker,
)
from ontofabric.services.query.stages import second_opinion
from ontofabric.shared.onnx_models import BUNDLED_CROSS_ENCODER, BUNDLED_SECOND_EMBEDDER, OnnxEmbedder, bundled_model
from ontofabric.shared.runtime import free_port
from ontofabric.shared.settings import Settings, SettingsUnusable

from .conftest import SPANS, metric_points
from .test_pipeline import ScriptedRetrieval, pipeline_over


class CohereLike(BaseHTTPRequestHandler):
    """Answers POST /<behaviour>/v2/rerank; the behaviour is the first path segment."""

    requests: ClassVar[list[dict[str, Any]]] = []

    def log_message(self, format: str, *args: object) -> None:  # keep test output clean
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        CohereLike.requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
        behaviour = self.path.split("/")[1]
        if behaviour == "slow":
            time.sleep(1.0)
        if behaviour in ("ok", "slow"):
            # Rank by how many query words each document contains, best first.
            words = set(body["query"].lower().split())
            scores = [len(words & set(d.lower().split())) / (len(words) or 1) for d in body["documents"]]
            ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[: body["top_n"]]
            self._send(200, {"id": "x", "results": [{"index": i, "relevance_score": scores[i]} for i in ranked]})
        elif behaviour == "ratelimited":
            self._send(429, {"message": "too many requests"})
        elif behaviour == "broken":
            self._send(503, {"message": "unavailable"})
        elif behaviour == "malformed":
            self._send(200, {"results": [{"index": "zero"}]})
        elif behaviour == "outofrange":
            self._send(200, {"results": [{"index": 99, "relevance_score": 0.9}]})
        elif behaviour == "duplicate":
            self._send(200, {"results": [{"index": 0, "relevance_score": 0.9}, {"index": 0, "relevance_score": 0.8}]})
        elif behaviour == "nan":
            self._send(200, {"results": [{"index": 0, "relevance_score": float("nan")}]})
        elif behaviour == "negative":
            self._send(
                200, {"results": [{"index": i, "relevance_score": -3.0 * i} for i in range(len(body["documents"]))]}
            )
        elif behaviour == "empty":
            self._send(200, {"results": []})
        elif behaviour == "partial":  # ranks only the last document it was sent
            last = len(body["documents"]) - 1
            self._send(200, {"results": [{"index": last, "relevance_score": 0.9}]})

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def cohere_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), CohereLike)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


DOCS = ["a recipe for bread", "postgres full text search", "search engines rank text", "nothing relevant here"]


async def test_cohere_adapter_ranks_and_sends_the_api_shape(cohere_server: str) -> None:
    reranker = CohereReranker(f"{cohere_server}/ok/v2/rerank", "secret", "rerank-v3.5", timeout_s=2)
    try:
        ranked = await reranker.rerank("full text search", DOCS, top_n=2)
    finally:
        await reranker.close()
    assert [i for i, _ in ranked] == [1, 2]
    sent = CohereLike.requests[-1]
    assert sent["auth"] == "Bearer secret"
    assert sent["body"] == {"model": "rerank-v3.5", "query": "full text search", "documents": DOCS, "top_n": 2}
    # the call is a client span (OpenTelemetry's httpx instrumentation), and the key is not in it
    calls = [s for s in SPANS.get_finished_spans() if "/ok/v2/rerank" in str(s.attributes.get("http.url", ""))]
    assert calls
    assert calls[-1].attributes.get("http.status_code") == 200
    assert "secret" not in calls[-1].to_json()


@pytest.mark.parametrize(
    ("behaviour", "error"),
    [
        ("ratelimited", "429"),
        ("broken", "503"),
        ("malformed", "malformed"),
    ],
)
async def test_cohere_adapter_raises_on_every_failure_class(cohere_server: str, behaviour: str, error: str) -> None:
    reranker = CohereReranker(f"{cohere_server}/{behaviour}/v2/rerank", None, "m", timeout_s=2)
    try:
        with pytest.raises(RerankerError, match=error):
            await reranker.rerank("q", DOCS, top_n=4)
    finally:
        await reranker.close()


def _pipeline(reranker: Any, timeout_s: float = 1.5, saturation: float = 0.8, depth: int = 20) -> QueryPipeline:
    config = PipelineConfig(  # scores as the stages gave them: what these tests look at
        reranker_timeout_ms=round(timeout_s * 1000),
        early_exit_saturation=saturation,
        reranker_depth=depth,
        calibrated_scores=False,
    )
    return pipeline_over(ScriptedRetrieval(), config=config, reranker=reranker)


QUERY = OntologyQuery(semantic_query="content z please")


async def test_pipeline_uses_the_reranker_order(cohere_server: str) -> None:
    reranker = CohereReranker(f"{cohere_server}/ok/v2/rerank", None, "m", timeout_s=2)
    reply = await _pipeline(reranker).answer(QUERY, "w")
    await reranker.close()
    assert reply.meta.reranked is True
    assert reply.meta.reranker == "cohere"
    assert reply.meta.degraded == []
    assert reply.results[0].id == "z"  # "content z" matches the query best
    assert "rerank" in reply.meta.timings_ms


async def test_each_rerank_call_records_its_duration_and_its_cost_at_the_configured_prices(cohere_server: str) -> None:
    reranker = CohereReranker(f"{cohere_server}/ok/v2/rerank", None, "m", timeout_s=2)
    config = PipelineConfig(reranker_cost_per_call_usd=0.002, reranker_cost_per_document_usd=0.0001)

    def spent() -> float:
        points = metric_points("retrieval.rerank.cost_usd")
        return sum(p.value for p in points if p.attributes == {"workspace": "priced", "reranker": "cohere"})

    def calls() -> int:
        return sum(p.count for p in metric_points("retrieval.rerank.duration_ms"))

    before, called = spent(), calls()
    reply = await pipeline_over(ScriptedRetrieval(), config=config, reranker=reranker).answer(QUERY, "priced")
    await reranker.close()
    assert reply.meta.reranked is True
    assert spent() - before == pytest.approx(0.002 + 3 * 0.0001)  # one call, the three candidates sent
    assert calls() == called + 1
    # A call that failed (an error status; nothing listening) is timed, not charged (an operator's finding).
    for url in (f"{cohere_server}/broken/v2/rerank", f"http://127.0.0.1:{free_port()}/v2/rerank"):
        failing = CohereReranker(url, None, "m", timeout_s=2)
        before, called = spent(), calls()
        reply = await pipeline_over(ScriptedRetrieval(), config=config, reranker=failing).answer(QUERY, "priced")
        await failing.close()
        assert reply.meta.degraded == ["reranker"]
        assert (spent(), calls()) == (pytest.approx(before), called + 1)


async def test_a_reranker_that_ranks_some_of_the_candidates_is_a_failed_call(cohere_server: str) -> None:
    """Before 2026-11-30 its one ranked candidate (fused last) went first, above two it was never compared with,
    and the answer said reranked (an independent tester's finding): now the fused order, and degraded says so."""
    reranker = CohereReranker(f"{cohere_server}/partial/v2/rerank", None, "m", timeout_s=2)
    fused = await _pipeline(None).answer(QUERY, "w")
    reply = await _pipeline(reranker).answer(QUERY, "w")
    await reranker.close()
    assert reply.meta.reranked is False
    assert reply.meta.degraded == ["reranker"]
    assert [r.id for r in reply.results] == [r.id for r in fused.results]


async def test_only_the_first_candidates_up_to_the_depth_are_reranked(cohere_server: str) -> None:
    reranker = CohereReranker(f"{cohere_server}/ok/v2/rerank", None, "m", timeout_s=2)
    fused = await _pipeline(None).answer(QUERY, "w")
    before = len(CohereLike.requests)
    reply = await _pipeline(reranker, depth=2).answer(QUERY, "w")
    await reranker.close()
    assert [r.id for r in fused.results] == ["y", "z", "x"]
    assert CohereLike.requests[before]["body"]["documents"] == ["content y", "content z"]  # x, fused last, is not
    assert reply.meta.reranked is True
    assert [r.id for r in reply.results] == ["z", "y", "x"]  # "content z" matches the query best
    tail = reply.results[2].score
    # Past the depth: below every reranked relevance, and still a relevance, not a zero that min_relevance drops.
    assert 0.0 < tail < reply.results[1].score
    assert tail == pytest.approx(reply.results[1].score * fused.results[2].score, abs=1e-4)


async def test_a_min_relevance_keeps_the_results_past_the_depth(cohere_server: str) -> None:
    reranker = CohereReranker(f"{cohere_server}/ok/v2/rerank", None, "m", timeout_s=2)
    query = QUERY.model_copy(update={"min_relevance": 0.01})
    reply = await _pipeline(reranker, depth=2).answer(query, "w")
    await reranker.close()
    assert [r.id for r in reply.results] == ["z", "y", "x"]  # x was never reranked, and is still an answer


async def test_a_reranker_sees_its_full_depth_even_for_a_small_top_k(cohere_server: str) -> None:
    reranker = CohereReranker(f"{cohere_server}/ok/v2/rerank", None, "m", timeout_s=2)
    before = len(CohereLike.requests)
    reply = await _pipeline(reranker, depth=3).answer(QUERY.model_copy(update={"top_k": 1, "precision": True}), "w")
    await reranker.close()
    assert len(CohereLike.requests[before]["body"]["documents"]) == 3  # 1.5 x topK alone would have sent 2
    assert [r.id for r in reply.results] == ["z"]


@pytest.mark.parametrize(
    "behaviour",
    ["ratelimited", "broken", "malformed", "outofrange", "duplicate", "nan", "negative", "empty", "slow", "refused"],
)
async def test_pipeline_keeps_the_fused_order_when_the_reranker_fails(cohere_server: str, behaviour: str) -> None:
    url = "http://127.0.0.1:9/v2/rerank" if behaviour == "refused" else f"{cohere_server}/{behaviour}/v2/rerank"
    reranker = CohereReranker(url, None, "m", timeout_s=5)
    fused = await _pipeline(None).answer(QUERY, "w")
    reply = await _pipeline(reranker, timeout_s=0.3).answer(QUERY, "w")
    await reranker.close()
    assert reply.meta.reranked is False
    assert reply.meta.reranker is None
    assert reply.meta.degraded == ["reranker"]
    assert [r.id for r in reply.results] == [r.id for r in fused.results]


def test_the_port_promise_is_checked_whatever_the_adapter() -> None:
    assert check_ranking([(1, 0.2), (0, 0.9)], 2) == [(0, 0.9), (1, 0.2)]
    for ranking, error in [
        ([], "none"),
        ([(2, 0.5)], "outside"),
        ([(-1, 0.5)], "outside"),
        ([(0, 0.5), (0, 0.4)], "repeated"),
        ([(0, float("nan"))], "number"),
        ([(0, float("inf"))], "number"),
        ([(0, 1.5)], "number"),
        ([(1, 0.9)], "ranked 1 of the 2 documents sent"),  # an independent tester's fake Cohere: moved to the top
    ]:
        with pytest.raises(RerankerError, match=error):
            check_ranking(ranking, 2)


async def test_saturated_short_query_skips_the_reranker(cohere_server: str) -> None:
    reranker = CohereReranker(f"{cohere_server}/ok/v2/rerank", None, "m", timeout_s=2)
    before = len(CohereLike.requests)
    reply = await _pipeline(reranker, saturation=0.01).answer(OntologyQuery(semantic_query="short query"), "w")
    await reranker.close()
    assert reply.meta.skipped_rerank == "bm25_saturation"
    assert reply.meta.reranked is False
    assert len(CohereLike.requests) == before


async def test_local_cross_encoder_loads_batches_and_orders(tiny_cross_encoder: Path) -> None:
    small_batches = LocalCrossEncoder(tiny_cross_encoder, batch_size=1)
    one_batch = LocalCrossEncoder(tiny_cross_encoder, batch_size=32)
    try:
        first = await small_batches.rerank("search text", DOCS, top_n=4)
        second = await one_batch.rerank("search text", DOCS, top_n=4)
        top_two = await one_batch.rerank("search text", DOCS, top_n=2)
    finally:
        await small_batches.close()
        await one_batch.close()
    assert sorted(i for i, _ in first) == [0, 1, 2, 3]
    assert [i for i, _ in first] == [i for i, _ in second]  # batching does not change the ranking
    assert [s for _, s in first] == pytest.approx([s for _, s in second], abs=1e-5)
    assert [s for _, s in first] == sorted((s for _, s in first), reverse=True)
    assert all(0.0 <= s <= 1.0 for _, s in first)
    assert top_two == first[:2]


async def test_onnx_cross_encoder_scores_as_the_same_model_in_pytorch(
    tiny_cross_encoder: Path, tiny_onnx_cross_encoder: Path
) -> None:
    """The ONNX path tokenizes pairs, pads each batch and applies the sigmoid as sentence-transformers does: the
    same model gives the same scores and order, whatever the batch size."""
    pytorch = LocalCrossEncoder(tiny_cross_encoder)
    small_batches = OnnxCrossEncoder(tiny_onnx_cross_encoder, batch_size=1)
    default_batches = OnnxCrossEncoder(tiny_onnx_cross_encoder)
    one_batch = OnnxCrossEncoder(tiny_onnx_cross_encoder, batch_size=32, max_length=16)
    long_docs = [d * 20 for d in DOCS]
    try:
        expected = await pytorch.rerank("search text", DOCS + long_docs, top_n=8)
        first = await small_batches.rerank("search text", DOCS + long_docs, top_n=8)
        second = await default_batches.rerank("search text", DOCS + long_docs, top_n=8)
        truncated = await one_batch.rerank("search text", long_docs, top_n=4)
    finally:
        for reranker in (pytorch, small_batches, default_batches, one_batch):
            await reranker.close()
    assert [i for i, _ in first] == [i for i, _ in expected] == [i for i, _ in second]
    assert [s for _, s in first] == pytest.approx([s for _, s in expected], abs=1e-5)
    assert all(0.0 <= s <= 1.0 for _, s in first)
    assert len(truncated) == 4  # pairs past max_length are cut, not refused


@pytest.mark.parametrize(
    ("reranker", "bundled", "adapter"),
    [("onnx", BUNDLED_CROSS_ENCODER, OnnxCrossEncoder), ("second-embedder", BUNDLED_SECOND_EMBEDDER, SecondEmbedder)],
)
def test_onnx_rerankers_load_the_configured_model_or_say_what_is_missing(
    tiny_onnx_cross_encoder: Path, tiny_onnx_embedder: Path, reranker: Any, bundled: str, adapter: type
) -> None:
    path = tiny_onnx_cross_encoder if adapter is OnnxCrossEncoder else tiny_onnx_embedder
    assert isinstance(build_reranker(Settings(reranker=reranker, reranker_model_path=path)), adapter)
    if bundled_model(bundled) is None:
        with pytest.raises(ValueError, match="ONTOFABRIC_RERANKER_MODEL_PATH"):
            build_reranker(Settings(reranker=reranker))


def test_a_reranker_directory_without_its_model_is_refused_when_the_worker_builds_it(tmp_path: Path) -> None:
    """A configuration tester's: a directory holding no model ended the worker in a traceback of the library. Said
    by the query worker alone: a projector sharing its settings has no need of the model (a review's)."""
    with pytest.raises(SettingsUnusable, match=r"RERANKER_MODEL_PATH .*: no config\.json in it"):
        build_reranker(Settings(reranker="local", reranker_model_path=tmp_path))
    with pytest.raises(SettingsUnusable, match=r"RERANKER_MODEL_PATH .*: no model\.onnx or tokenizer\.json in it"):
        build_reranker(Settings(reranker="onnx", reranker_model_path=tmp_path))
    with pytest.raises(SettingsUnusable, match=r"RERANKER_MODEL_PATH .*: no such directory"):
        build_reranker(Settings(reranker="second-embedder", reranker_model_path=tmp_path / "model.onnx"))
    assert build_reranker(Settings(reranker="none", reranker_model_path=tmp_path / "elsewhere")) is None


def test_second_opinion_fuses_the_given_order_with_the_second_models() -> None:
    # Agreement keeps the order, and first in both scores 1.
    agreeing = second_opinion([0.9, 0.8, 0.7], weight=0.5)
    assert agreeing[0] == pytest.approx(1.0)
    assert agreeing == sorted(agreeing, reverse=True)
    # A candidate the second model puts first rises past its neighbour, not past a clear lead.
    moved = second_opinion([0.5, 0.4, 0.3, 0.9], weight=0.5)
    assert moved[3] > moved[2]
    assert moved[0] > moved[3]
    # With a weight far above the order's, the second model decides.
    decided = second_opinion([0.1, 0.2, 0.3], weight=10)
    assert decided[2] > decided[1] > decided[0]
    # Ties in the cosine keep the given order; every relevance is in (0, 1].
    tied = second_opinion([0.5, 0.5, 0.5], weight=0.5)
    assert tied == sorted(tied, reverse=True)
    assert all(0 < r <= 1 for r in tied)


async def test_second_embedder_ranks_by_its_own_cosines_fused_with_the_order(tiny_onnx_embedder: Path) -> None:
    """On a tiny BERT whose [CLS] vector is the embedding: the ranking is the fusion of the given order with the
    model's own cosines."""
    reranker = SecondEmbedder(tiny_onnx_embedder, weight=10, batch_size=2)
    try:
        ranked = await reranker.rerank("search text", DOCS, top_n=len(DOCS))
        vectors = OnnxEmbedder(tiny_onnx_embedder, "tiny").embed(["search text", *DOCS], batch_size=2)
    finally:
        await reranker.close()
    cosines = (vectors[1:] @ vectors[0]).tolist()
    expected = second_opinion(cosines, 10)
    assert [i for i, _ in ranked] == sorted(range(len(DOCS)), key=lambda i: (-expected[i], i))
    assert [s for _, s in ranked] == pytest.approx(sorted(expected, reverse=True))
    assert vectors.shape == (len(DOCS) + 1, 32)
    assert float(abs((vectors**2).sum(axis=1) - 1).max()) < 1e-5  # unit vectors
    assert len(set(cosines)) == len(DOCS)  # the model tells the documents apart, so the order is its own


def test_second_embedder_refuses_a_model_that_is_not_an_embedder(tiny_onnx_cross_encoder: Path) -> None:
    with pytest.raises(ValueError, match="not an embedder"):
        SecondEmbedder(tiny_onnx_cross_encoder)


class SlowCrossEncoder(LocalCrossEncoder):
    """The tiny model, taking 0.5 s per call: a model still running when the pipeline stops waiting."""

    def _score(self, query: str, documents: Sequence[str]) -> list[float]:
        time.sleep(0.5)
        return super()._score(query, documents)


async def test_local_cross_encoder_past_its_timeout_degrades_and_queries_do_not_queue(
    tiny_cross_encoder: Path,
) -> None:
    reranker = SlowCrossEncoder(tiny_cross_encoder)
    try:
        late = await _pipeline(reranker, timeout_s=0.1).answer(QUERY, "w")
        started = time.perf_counter()
        busy = await _pipeline(reranker, timeout_s=5).answer(QUERY, "w")  # the first call is still running
        busy_ms = (time.perf_counter() - started) * 1000
        await asyncio.sleep(0.6)
        ok = await _pipeline(reranker, timeout_s=5).answer(QUERY, "w")
    finally:
        await reranker.close()
    assert late.meta.degraded == ["reranker"]
    assert busy.meta.degraded == ["reranker"]
    assert busy_ms < 300  # skipped at once instead of waiting behind the running call
    assert ok.meta.reranked is True
