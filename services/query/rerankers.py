"""Reranker adapters (the port is in ``core``): a local cross-encoder (sentence-transformers or ONNX Runtime), a
second embedder's opinion (ONNX Runtime) and an HTTP client of the Cohere rerank API.

An adapter raises on any failure; the pipeline turns a failure or a timeout into ``_meta.degraded: ["reranker"]``
and keeps the fused order, so a caller never sees a reranker error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from pydantic import BaseModel, Field, ValidationError

from ontofabric.shared.logging import get_logger
from ontofabric.shared.onnx_models import (
    BUNDLED_CROSS_ENCODER,
    BUNDLED_SECOND_EMBEDDER,
    OnnxEmbedder,
    OnnxModel,
    bundled_model,
    embedder_name,
)
from ontofabric.shared.settings import Settings, SettingsUnusable

from .core import Reranker, RerankerError
from .stages import second_opinion

log = get_logger(__name__)


class _LocalModel:
    """A reranker whose model scores on CPU, on one thread of its own. A call that finds the model busy fails at
    once: queued behind a call still running (maybe past its timeout), it would only time out too."""

    name: str

    def __init__(self) -> None:
        self._busy = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reranker")

    def _score(self, query: str, documents: Sequence[str]) -> list[float]:
        """One relevance in [0, 1] per document, in the documents' order."""
        raise NotImplementedError

    async def rerank(self, query: str, documents: Sequence[str], top_n: int) -> list[tuple[int, float]]:
        if not documents:
            return []
        if self._busy:
            raise RerankerError(f"the {self.name} reranker is busy with another query")
        self._busy = True
        # The thread's own future clears the flag when the model is done, even if the caller gave up waiting.
        running = self._executor.submit(self._score, query, documents)
        running.add_done_callback(self._idle)
        scores = await asyncio.wrap_future(running)
        ranked = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        return [(i, scores[i]) for i in ranked[:top_n]]

    def _idle(self, _: object) -> None:
        self._busy = False

    async def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class LocalCrossEncoder(_LocalModel):
    """A sentence-transformers CrossEncoder on CPU, run on its own thread."""

    name = "cross-encoder"

    def __init__(self, model_path: Path, batch_size: int = 32, max_length: int = 512) -> None:
        import torch
        from sentence_transformers import CrossEncoder

        super().__init__()
        self._model = CrossEncoder(str(model_path), device="cpu", max_length=max_length, local_files_only=True)
        self._batch_size = batch_size
        self._sigmoid = torch.nn.Sigmoid()
        log.info("reranker_loaded", kind=self.name, path=str(model_path))

    def _score(self, query: str, documents: Sequence[str]) -> list[float]:
        # Sigmoid whatever the model's own configuration says: many cross-encoders ship an identity activation,
        # and a result's score promises a relevance in [0, 1].
        scores = self._model.predict(
            [(query, d) for d in documents], batch_size=self._batch_size, activation_fn=self._sigmoid
        )
        return [float(s) for s in scores]


class OnnxCrossEncoder(_LocalModel):
    """A cross-encoder exported to ONNX: each (query, document) pair's logit through a sigmoid."""

    name = "onnx-cross-encoder"

    def __init__(self, model_path: Path, batch_size: int = 32, max_length: int = 512, threads: int = 0) -> None:
        super().__init__()
        self._model = OnnxModel(model_path, max_length, threads)
        self._batch_size = batch_size
        log.info("reranker_loaded", kind=self.name, path=str(model_path))

    def _score(self, query: str, documents: Sequence[str]) -> list[float]:
        scores: list[float] = []
        for start in range(0, len(documents), self._batch_size):
            logits = self._model.first_output([(query, d) for d in documents[start : start + self._batch_size]])
            # A sigmoid, as for the sentence-transformers model: a result's score promises a relevance in [0, 1].
            scores.extend(float(s) for s in 1.0 / (1.0 + np.exp(-logits.astype(np.float64).reshape(-1))))
        return scores


class SecondEmbedder(_LocalModel):
    """A second opinion from another embedder, exported to ONNX with [CLS] pooling (as BGE models are): the
    candidates in the order they came, each moved by reciprocal rank fusion of its place there and its place by
    this embedder's cosine to the query, the second weighed ``weight``. The order it was given counts, so a
    second model that is weaker alone can still correct the first where they disagree."""

    name = "second-embedder"

    def __init__(
        self, model_path: Path, weight: float = 1.0, batch_size: int = 32, max_length: int = 256, threads: int = 0
    ) -> None:
        super().__init__()
        self._embedder = OnnxEmbedder(model_path, embedder_name(model_path), max_length, threads)
        self._weight = weight
        self._batch_size = batch_size
        log.info("reranker_loaded", kind=self.name, path=str(model_path), weight=weight)

    def _score(self, query: str, documents: Sequence[str]) -> list[float]:
        vectors = self._embedder.embed([query, *documents], self._batch_size)
        cosines = vectors[1:] @ vectors[0]
        return second_opinion(cosines.tolist(), self._weight)


class _CohereResult(BaseModel):
    index: int = Field(ge=0)
    relevance_score: float


class _CohereResponse(BaseModel):
    results: list[_CohereResult]


class CohereReranker:
    """Speaks the Cohere rerank API: Cohere's ``/v2/rerank`` and Azure AI Foundry serverless ``/v1/rerank``."""

    name = "cohere"

    def __init__(self, url: str, api_key: str | None, model: str, timeout_s: float) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._url = url
        self._model = model
        self._client = httpx.AsyncClient(headers=headers, timeout=timeout_s)

    async def rerank(self, query: str, documents: Sequence[str], top_n: int) -> list[tuple[int, float]]:
        if not documents:
            return []
        body = {"model": self._model, "query": query, "documents": list(documents), "top_n": top_n}
        response = await self._client.post(self._url, json=body)
        if response.status_code != 200:
            raise RerankerError(f"rerank endpoint answered {response.status_code}: {response.text[:200]}")
        try:
            parsed = _CohereResponse.model_validate_json(response.content)
        except ValidationError as error:
            raise RerankerError(f"rerank endpoint answered a malformed body: {error.error_count()} problems") from None
        ranked = sorted(((r.index, r.relevance_score) for r in parsed.results), key=lambda pair: -pair[1])
        return ranked[:top_n]

    async def close(self) -> None:
        await self._client.aclose()


def model_missing(reranker: str, path: Path | None) -> str | None:
    """What a reranker's model directory lacks, or None: sentence-transformers reads a directory with its
    `config.json`, the ONNX rerankers `model.onnx` and `tokenizer.json` in one."""
    if path is None or reranker in ("none", "cohere"):
        return None
    if not path.is_dir():
        return "no such directory"
    needed = ("config.json",) if reranker == "local" else ("model.onnx", "tokenizer.json")
    missing = [name for name in needed if not (path / name).is_file()]
    return f"no {' or '.join(missing)} in it" if missing else None


def build_reranker(settings: Settings) -> Reranker | None:
    if settings.reranker == "none":
        return None
    # Here, not in the settings: only a query worker reads it, and a projector sharing its environment has no
    # need of the model on its disk (a review's). A directory holding no model ended the worker in a traceback of
    # the library (a configuration tester's).
    missing = model_missing(settings.reranker, settings.reranker_model_path)
    if missing is not None:
        raise SettingsUnusable(f"ONTOFABRIC_RERANKER_MODEL_PATH {settings.reranker_model_path}: {missing}")
    if settings.reranker == "local":
        if settings.reranker_model_path is None:
            raise SettingsUnusable("ONTOFABRIC_RERANKER=local needs ONTOFABRIC_RERANKER_MODEL_PATH")
        return LocalCrossEncoder(settings.reranker_model_path)
    if settings.reranker in ("onnx", "second-embedder"):
        bundled = BUNDLED_CROSS_ENCODER if settings.reranker == "onnx" else BUNDLED_SECOND_EMBEDDER
        path = settings.reranker_model_path or bundled_model(bundled)
        if path is None:
            raise SettingsUnusable(
                f"ONTOFABRIC_RERANKER={settings.reranker} needs ONTOFABRIC_RERANKER_MODEL_PATH,"
                " or the extra `rerank` installed"
            )
        if settings.reranker == "onnx":
            return OnnxCrossEncoder(path)
        return SecondEmbedder(path, settings.second_embedder_weight)
    if settings.reranker_url is None:
        raise SettingsUnusable("ONTOFABRIC_RERANKER=cohere needs ONTOFABRIC_RERANKER_URL")
    return CohereReranker(
        settings.reranker_url,
        settings.reranker_api_key.get_secret_value() if settings.reranker_api_key else None,
        settings.reranker_model,
        settings.reranker_timeout_ms / 1000,
    )
