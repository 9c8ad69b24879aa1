"""Rerankers: the Cohere-API adapter against a real local HTTP server answering in Cohere's shape, for success
and every failure class; a local cross-encoder built inside the test (random weights); and the pipeline keeping
the fused order whenever a reranker fails."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from ontofabric.contracts import OntologyQuery
from ontofabric.services.query.cache import VersionedCache
from ontofabric.services.query.pipeline import PipelineConfig, QueryPipeline
from ontofabric.services.query.rerankers import (
    CohereReranker,
    LateInteraction,
    LocalCrossEncoder,
    RerankerError,
    blend_with_fused_position,
    build_reranker,
    check_ranking,
    max_similarity,
)
from ontofabric.shared.embedder import wants_bfloat16
from ontofabric.shared.settings import Settings

from .test_pipeline import Announced, FixedEmbedder, ScriptedRetrieval


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
    config = PipelineConfig(rerank_timeout_s=timeout_s, early_exit_saturation=saturation, rerank_depth=depth)
    return QueryPipeline(ScriptedRetrieval(), FixedEmbedder(), Announced("5-a"), VersionedCache(0), config, reranker)  # type: ignore[arg-type]


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


async def test_candidates_a_reranker_leaves_out_follow_in_fused_order(cohere_server: str) -> None:
    reranker = CohereReranker(f"{cohere_server}/partial/v2/rerank", None, "m", timeout_s=2)
    fused = await _pipeline(None).answer(QUERY, "w")
    reply = await _pipeline(reranker).answer(QUERY, "w")
    await reranker.close()
    assert reply.meta.reranked is True
    expected_first = fused.results[-1].id  # the partial reranker put the last fused candidate first
    assert [r.id for r in reply.results] == [expected_first] + [r.id for r in fused.results if r.id != expected_first]
    scores = [r.score for r in reply.results]
    assert scores[0] == pytest.approx(0.9)
    assert scores == sorted(scores, reverse=True)  # the unranked ones below every ranked one


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


@pytest.fixture(scope="module")
def tiny_cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer BERT cross-encoder with random weights and the MiniLM tokenizer, saved like a real model."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    torch.manual_seed(7)
    tokenizer = AutoTokenizer.from_pretrained(str(Settings().resolved_model_path()))
    config = BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, num_labels=1,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("cross-encoder")
    model = BertForSequenceClassification(config)
    with torch.no_grad():
        model.classifier.bias.fill_(-5.0)  # logits far below zero: only a sigmoid keeps the scores in [0, 1]
    # Configured like many published cross-encoders: no activation of its own.
    model.config.sentence_transformers = {"activation_fn": "torch.nn.modules.linear.Identity"}
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


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


def test_max_similarity_takes_each_query_tokens_best_match() -> None:
    query = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    matches_both = np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], dtype=np.float32)
    matches_one = np.array([[1.0, 0.0], [1.0, 0.0]], dtype=np.float32)
    assert max_similarity(query, matches_both) == pytest.approx(1.0)
    assert max_similarity(query, matches_one) == pytest.approx(0.5)  # (1 + 0) / 2: a repeat earns nothing more


def test_blending_similarity_into_the_fused_position() -> None:
    similarities = [0.1, 0.2, 0.9, 0.3]
    kept = blend_with_fused_position(similarities, weight=0.0)
    assert kept == sorted(kept, reverse=True)  # weight 0: the fused order as it was
    assert len(set(kept)) == 4
    followed = blend_with_fused_position(similarities, weight=1.0)
    assert max(range(4), key=lambda i: followed[i]) == 2  # weight 1: the similarity alone
    assert all(0.0 < v < 1.0 for v in kept + followed)
    assert blend_with_fused_position([0.4, 0.4, 0.4], 1.0) == [0.5, 0.5, 0.5]  # no spread: no signal
    assert blend_with_fused_position([0.7], 0.2) == [0.5]
    assert blend_with_fused_position([], 0.2) == []


def test_at_the_deployment_weight_a_strong_match_climbs_but_does_not_jump_the_queue() -> None:
    similarities = [0.3, 0.31, 0.29, 0.3, 0.32, 0.9, 0.3, 0.28, 0.31, 0.3]
    relevance = blend_with_fused_position(similarities, Settings().late_interaction_weight)
    order = sorted(range(10), key=lambda i: -relevance[i])
    assert order.index(5) == 2  # from sixth to third
    assert order[:2] == [0, 1]
    assert [i for i in order if i != 5] == [0, 1, 2, 3, 4, 6, 7, 8, 9]  # the rest keep their fused order


CODE_DOCS = [
    "def add_user(name): users.append(name)",
    "a recipe for bread with flour and water",
    "def parse_json(text):\n    return json.loads(text)",
    "the weather is sunny today",
]


@pytest.fixture(scope="module")
def late_interaction() -> Iterator[LateInteraction]:
    settings = Settings(reranker="late-interaction", late_interaction_weight=1.0)
    reranker = build_reranker(settings)
    assert isinstance(reranker, LateInteraction)
    yield reranker
    asyncio.run(reranker.close())


async def test_late_interaction_scores_with_the_embedding_model(late_interaction: LateInteraction) -> None:
    ranking = await late_interaction.rerank("parse a json string", CODE_DOCS, top_n=4)
    assert ranking[0][0] == 2  # the embedding model itself finds the JSON parser, from fused position 3
    assert sorted(i for i, _ in ranking) == [0, 1, 2, 3]
    assert check_ranking(ranking, 4) == ranking
    assert (await late_interaction.rerank("parse a json string", CODE_DOCS, top_n=2)) == ranking[:2]
    assert await late_interaction.rerank("parse a json string", [], top_n=2) == []


async def test_late_interaction_at_the_deployment_weight_lifts_a_clear_match() -> None:
    unrelated = ["the weather is sunny today", "a recipe for bread with flour and water", "football results",
                 "a poem about the sea", "train timetables for monday", "how to knit a scarf",
                 "the history of the roman empire", "gardening in spring", "a song about love"]  # fmt: skip
    fused_order = [unrelated[0], "def parse_json(text):\n    return json.loads(text)", *unrelated[1:]]
    reranker = build_reranker(Settings(reranker="late-interaction"))
    assert isinstance(reranker, LateInteraction)
    try:
        ranking = await reranker.rerank("parse a json string", fused_order, top_n=10)
    finally:
        await reranker.close()
    assert [i for i, _ in ranking][:2] == [1, 0]  # the parser, second in fused order, overtakes the weather
    assert [i for i, _ in ranking][2:] == list(range(2, 10))


async def test_late_interaction_spares_the_model_when_there_is_nothing_to_reorder(
    late_interaction: LateInteraction, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_model(texts: Sequence[str]) -> list[Any]:
        raise AssertionError("the model ran for a single candidate")

    monkeypatch.setattr(late_interaction, "_tokens", no_model)
    assert await late_interaction.rerank("parse a json string", CODE_DOCS[:1], top_n=1) == [(0, 0.5)]


@pytest.mark.parametrize(("precision", "dtype"), [("float32", "torch.float32"), ("bfloat16", "torch.bfloat16")])
async def test_the_reranker_precision_setting_reaches_the_model(precision: str, dtype: str) -> None:
    reranker = build_reranker(Settings(reranker="late-interaction", reranker_precision=precision))
    assert isinstance(reranker, LateInteraction)
    try:
        assert str(next(reranker._model.parameters()).dtype) == dtype
    finally:
        await reranker.close()


async def test_late_interaction_reranks_through_the_pipeline(late_interaction: LateInteraction) -> None:
    fused = await _pipeline(None).answer(QUERY, "w")
    reply = await _pipeline(late_interaction).answer(QUERY, "w")
    assert reply.meta.reranked is True
    assert reply.meta.reranker == "late-interaction"
    assert reply.meta.degraded == []
    assert "rerank" in reply.meta.timings_ms
    assert sorted(r.id for r in reply.results) == sorted(r.id for r in fused.results)
    assert all(0.0 <= r.score <= 1.0 for r in reply.results)


async def test_late_interaction_orders_alike_in_bfloat16_and_float32(late_interaction: LateInteraction) -> None:
    """bfloat16 is chosen by the CPU; whichever the fixture got, the other precision ranks the same."""
    settings = Settings()
    fixture_bfloat16 = wants_bfloat16(settings.reranker_precision)
    other = LateInteraction(settings.resolved_model_path(), weight=1.0, bfloat16=not fixture_bfloat16)
    try:
        ours = await late_interaction.rerank("parse a json string", CODE_DOCS, top_n=4)
        theirs = await other.rerank("parse a json string", CODE_DOCS, top_n=4)
    finally:
        await other.close()
    assert [i for i, _ in ours] == [i for i, _ in theirs]
    assert [s for _, s in ours] == pytest.approx([s for _, s in theirs], abs=0.02)
