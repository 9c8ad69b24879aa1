"""The embedding port over an OpenAI-compatible embeddings API (``embedder=openai``), against a real HTTP server
that speaks the API: each text's vector is its words hashed into buckets, so texts sharing words are near."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest
from pydantic import SecretStr

from ontofabric.contracts import QueryResponse
from ontofabric.services.projector.worker import ProjectorService
from ontofabric.services.query.client import QueryClient
from ontofabric.services.query.worker import QueryService
from ontofabric.shared import http_embedder as http_module
from ontofabric.shared.embedder import EmbedderMismatch, build_embedder
from ontofabric.shared.http_embedder import EmbeddingApiError, HttpEmbedder
from ontofabric.shared.settings import Settings

from .conftest import Deployment, corpus_deltas

MODEL = "hashed-words"
DIMENSION = 384


def hashed_words(text: str, dimension: int) -> list[float]:
    vector = np.zeros(dimension)
    for word in text.lower().split():
        vector[int(hashlib.sha256(word.strip(".,?").encode()).hexdigest(), 16) % dimension] += 1.0
    return [float(x) for x in vector * 3.0]  # not unit length: the adapter makes it so


@dataclass
class FakeApi:
    """What the server was asked, and what it answers next."""

    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    keys: list[str | None] = field(default_factory=list)
    failures: list[int] = field(default_factory=list)
    """Statuses to answer, one a request, before answering well."""
    dimension: int = DIMENSION
    longest: int | None = None
    """Texts longer than this are refused with 413, as a TEI server refuses more tokens than it reads."""
    broken: str | None = None
    """``nan`` or ``zero``: the vectors answered are that."""
    retry_after: str | None = None
    """A Retry-After header sent with the failures."""


@pytest.fixture
def api() -> Iterator[FakeApi]:
    fake = FakeApi()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            fake.bodies.append(body)
            fake.keys.append(self.headers.get("Authorization"))
            if self.path != "/v1/embeddings":
                status, answer = 404, {"error": {"message": f"no route {self.path}"}}
            elif fake.failures:
                status = fake.failures.pop(0)
                # A server that quotes the key it was given back (some do, in their 401s).
                answer = {"error": {"message": f"slow down {self.headers.get('Authorization')}"}}
            elif fake.longest is not None and any(len(text) > fake.longest for text in body["input"]):
                status, answer = 413, {"error": "Input validation error: inputs must have less than 512 tokens"}
            elif body.get("model") != MODEL:
                status, answer = 400, {"error": {"message": f"model {body.get('model')} does not exist"}}
            else:
                size = body.get("dimensions", fake.dimension)
                made = {"nan": lambda _: [float("nan")] * size, "zero": lambda _: [0.0] * size}
                embed = made.get(fake.broken or "", lambda text: hashed_words(text, size))
                data = [
                    {"object": "embedding", "index": i, "embedding": embed(text)}
                    for i, text in enumerate(body["input"])
                ]
                status, answer = 200, {"object": "list", "data": data[::-1], "model": MODEL}  # any order
            payload = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            if status != 200 and fake.retry_after is not None:
                self.send_header("Retry-After", fake.retry_after)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    fake.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()


def _settings(api: FakeApi, **more: object) -> Settings:
    return Settings(
        embedder="openai", embedding_model=MODEL, embedding_api_url=api.url, insecure_http_secrets=True, **more
    )


def test_documents_and_queries_are_embedded_by_the_api(api: FakeApi, monkeypatch: pytest.MonkeyPatch) -> None:
    embedder = build_embedder(_settings(api, embedding_api_key=SecretStr("sk-test"), embedding_api_batch=2))
    assert isinstance(embedder, HttpEmbedder)
    assert [body["input"] for body in api.bodies] == [["check"]]  # its dimension, checked as it is made
    api.bodies.clear()
    texts = ["sort a list", "read a csv file", "x" * 9000]
    vectors, tokens = embedder.embed_with_tokens(texts)
    assert vectors.shape == (3, DIMENSION)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0)  # unit rows, as the local model's
    expected = np.asarray(hashed_words("sort a list", DIMENSION))
    assert np.allclose(vectors[0], expected / np.linalg.norm(expected))  # in the order asked
    assert [len(t) for t in tokens] == [0, 0, 0]  # no token vectors: late interaction has nothing to read
    assert [len(body["input"]) for body in api.bodies] == [2, 1]  # in requests of embedding_api_batch
    assert len(api.bodies[1]["input"][0]) == 8000  # cut to embedding_api_max_characters
    assert set(api.keys) == {"Bearer sk-test"}
    assert "dimensions" not in api.bodies[0]

    api.failures = [429, 503]  # a rate limit and a passing outage: asked again, with backoff
    monkeypatch.setattr(http_module, "FIRST_BACKOFF_S", 0.01)
    assert embedder.embed_query("sort a list").shape == (DIMENSION,)
    assert len(api.bodies) == 5

    api.failures, api.retry_after = [503], "0.3"  # a Retry-After longer than the backoff is heeded
    started = time.monotonic()
    assert embedder.embed_query("sort a list").shape == (DIMENSION,)
    assert time.monotonic() - started >= 0.3
    api.retry_after = None
    monkeypatch.setattr(http_module, "ATTEMPTS", 3)
    api.failures = [503, 429, 503, 503]  # still failing at the last attempt: said with the API's last status
    with pytest.raises(EmbeddingApiError, match="503") as outage:
        embedder.embed_documents(["sort"])
    assert outage.value.status == 503
    assert api.failures == [503]  # three attempts, no more
    api.failures.clear()

    api.failures = [401]  # not retried: said, with the API's words, but never the key
    with pytest.raises(EmbeddingApiError, match=r"401.*slow down Bearer \*\*\*") as refused:
        embedder.embed_documents(["sort"])
    assert "sk-test" not in str(refused.value)


def test_one_text_the_api_refuses_neither_sinks_its_batch_nor_is_kept_wrong(api: FakeApi) -> None:
    embedder = build_embedder(_settings(api, embedding_api_batch=100))
    assert isinstance(embedder, HttpEmbedder)
    api.bodies.clear()
    assert len(embedder.embed_documents(["word"] * 150)) == 150
    assert [len(body["input"]) for body in api.bodies] == [100, 50]  # the setting's size, not the local model's 64

    api.bodies.clear()
    api.longest = 1000  # a server reading fewer tokens than the texts hold
    texts = ["sort a list", "y " * 2000, "read a csv file"]
    vectors = embedder.embed_documents(texts)
    expected = np.asarray(hashed_words("read a csv file", DIMENSION))
    assert np.allclose(vectors[2], expected / np.linalg.norm(expected))  # the others as if alone
    # The three refused; each half asked apart; the long one alone, then cut to half its length until it fits.
    assert [[len(text) for text in body["input"]] for body in api.bodies] == [
        [11, 4000, 15], [11], [4000, 15], [4000], [2000], [1000], [15],
    ]  # fmt: skip

    api.longest, api.broken = None, "zero"  # refused before anything (the embedding cache) keeps it
    with pytest.raises(EmbeddingApiError, match="not finite, or zero"):
        embedder.embed_documents(["sort"])
    api.broken = "nan"
    with pytest.raises(EmbeddingApiError, match="not finite, or zero"):
        embedder.embed_documents(["sort"])


def test_the_api_s_dimension_is_checked_and_can_be_asked_for(api: FakeApi) -> None:
    api.dimension = 1536
    with pytest.raises(EmbedderMismatch, match=r"1536-dimensional.*384"):  # at start, not at every query
        build_embedder(_settings(api))
    # An API away at start is no reason not to start: each query and document asks it again.
    away = Settings(embedder="openai", embedding_model=MODEL, embedding_api_url="http://127.0.0.1:9/v1")
    assert isinstance(build_embedder(away), HttpEmbedder)
    shortened = build_embedder(_settings(api, embedding_api_dimensions=True))
    assert shortened is not None
    assert shortened.embed_documents(["sort"]).shape == (1, DIMENSION)
    assert api.bodies[-1]["dimensions"] == DIMENSION
    with pytest.raises(ValueError, match="embedder=openai needs embedding_api_url"):
        Settings(embedder="openai")
    with pytest.raises(ValueError, match="less than or equal to 2000"):  # pgvector's HNSW index holds no more
        _settings(api, embedding_dim=3072)
    with pytest.raises(ValueError, match="cannot take part in a model change"):
        _settings(api, next_embedding_model="m2", next_embedding_dim=8, next_embedding_model_path="m2")
    # Vectors of other lengths, or of other texts, are not taken from the embedding cache for these.
    api.dimension = DIMENSION
    names = {
        build_embedder(_settings(api, **more)).cache_name
        for more in (
            {},
            {"embedding_dim": 256, "embedding_api_dimensions": True},
            {"embedding_api_max_characters": 100},
        )
    }  # type: ignore[union-attr,arg-type]
    assert len(names) == 3
    with pytest.raises(ValueError, match="embedding_api_url is not https"):
        Settings(embedder="openai", embedding_api_url=api.url, embedding_api_key=SecretStr("sk"))


@pytest.fixture
def deployment_settings(deployment_settings: Settings, api: FakeApi) -> Settings:
    return deployment_settings.model_copy(
        update={"embedder": "openai", "embedding_model": MODEL, "embedding_api_url": api.url}
    )


async def test_a_deployment_on_the_api_answers_by_its_vectors_and_without_it_by_keywords(
    api: FakeApi, deployment: Deployment, projector: ProjectorService
) -> None:
    embedder = build_embedder(deployment.settings)
    assert isinstance(embedder, HttpEmbedder)
    acks = await deployment.publisher.publish_many(corpus_deltas(embedder, embedding_model=MODEL))
    await deployment.wait_projected(acks[-1].seq)  # the projector took the API model's vectors
    service = QueryService(deployment.settings, deployment.nats_url_as("query"), deployment.database_url, embedder)
    await service.start()
    client = QueryClient(deployment.nc, deployment.names)
    try:
        reply = await client.query("acme", {"semanticQuery": "compress directory archive", "topK": 3})
        assert isinstance(reply, QueryResponse), reply
        assert reply.results[0].id == "zip"
        assert "dense" in reply.meta.retrievers
        assert reply.meta.degraded == []
        assert reply.meta.embedding_model == MODEL
        assert reply.meta.skipped_late_interaction == "no_token_vectors"
        asked = len(api.bodies)

        api.failures = [500]  # the API fails a query: answered by keywords, and said so
        reply = await client.query("acme", {"semanticQuery": "sort numbers descending", "topK": 3})
        assert isinstance(reply, QueryResponse), reply
        assert len(api.bodies) == asked + 1  # a query's embedding is asked once: its deadline has no room to wait
        assert reply.results[0].id == "sort"
        assert "embedder" in reply.meta.degraded
        assert "dense" not in reply.meta.retrievers
    finally:
        await service.stop()
        await embedder.aclose()
