"""The embedding port over HTTP: an OpenAI-compatible ``POST {base}/embeddings`` (OpenAI, Azure OpenAI's v1 route,
vLLM, Ollama, Hugging Face TEI and others speak it).

Such an API returns one pooled vector per text and no token vectors, so documents embedded this way carry none and
late interaction finds nothing to compare for them (``_meta.skippedLateInteraction: no_token_vectors``). Texts are
sent whole up to ``max_characters`` (the API reads what its own limit allows; a text past ours is cut, not read in
windows: the local model's windows are its tokenizer's, which this side does not have)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import httpx
import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ValidationError

from .embedder import EmbedderMismatch, ModelThread, Vector, unit_rows
from .late_interaction import TokenMatrix
from .logging import get_logger

log = get_logger(__name__)

T = TypeVar("T")

RETRIED_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})
"""Answers worth asking again: rate limits and a server's passing trouble."""
ATTEMPTS = 4
FIRST_BACKOFF_S = 0.5


class EmbeddingApiError(Exception):
    """The embedding API refused or failed: its status and what it said, never the key."""


class _Item(BaseModel):
    index: int
    embedding: list[float]


class _Answer(BaseModel):
    data: list[_Item]


class HttpEmbedder:
    """An :class:`~.embedder.Embedder` over an OpenAI-compatible embeddings endpoint."""

    def __init__(
        self,
        base_url: str,
        model: str,
        dimension: int,
        api_key: str | None = None,
        *,
        batch_size: int = 64,
        max_characters: int = 8000,
        timeout_s: float = 30.0,
        send_dimensions: bool = False,
        transport: httpx.BaseTransport | None = None,
        async_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._url = base_url.rstrip("/") + "/embeddings"
        self._model = model
        self._dimension = dimension
        self._batch_size = batch_size
        self._max_characters = max_characters
        self._send_dimensions = send_dimensions
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(headers=headers, timeout=timeout_s, transport=transport)
        self._async_client = httpx.AsyncClient(headers=headers, timeout=timeout_s, transport=async_transport)
        self._thread = ModelThread(ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedder"))

    @property
    def model_name(self) -> str:
        return self._model

    @property
    def cache_name(self) -> str:
        return f"{self._model}@api"

    @property
    def vectors_name(self) -> str:
        return f"{self._model}@api"

    @property
    def dimension(self) -> int:
        return self._dimension

    def _body(self, texts: Sequence[str]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self._model, "input": [t[: self._max_characters] or " " for t in texts]}
        if self._send_dimensions:
            body["dimensions"] = self._dimension
        return body

    def _vectors(self, response: httpx.Response, count: int) -> npt.NDArray[np.float32]:
        """The answer's vectors in the order asked, unit length, checked against the deployment's dimension."""
        if response.status_code != 200:
            raise EmbeddingApiError(f"embedding API answered {response.status_code}: {response.text[:300]}")
        try:
            items = _Answer.model_validate_json(response.content).data
        except ValidationError as error:
            problems = error.error_count()
            raise EmbeddingApiError(f"embedding API answered a malformed body: {problems} problems") from None
        if sorted(item.index for item in items) != list(range(count)):
            raise EmbeddingApiError(f"embedding API answered {len(items)} vectors for {count} texts")
        rows = [item.embedding for item in sorted(items, key=lambda item: item.index)]
        if any(len(row) != self._dimension for row in rows):
            raise EmbedderMismatch(
                f"embedding API model {self._model} makes {len(rows[0])}-dimensional vectors; the deployment's are "
                f"{self._dimension} (ONTOFABRIC_EMBEDDING_DIM; or ONTOFABRIC_EMBEDDING_API_DIMENSIONS=true where the "
                "model shortens its vectors on request)"
            )
        return unit_rows(np.asarray(rows, np.float32))

    def _post(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        for attempt in range(ATTEMPTS):
            try:
                response = self._client.post(self._url, json=self._body(texts))
            except httpx.TransportError as error:
                if attempt == ATTEMPTS - 1:
                    raise EmbeddingApiError(f"embedding API unreachable: {type(error).__name__}") from None
            else:
                if response.status_code not in RETRIED_STATUSES or attempt == ATTEMPTS - 1:
                    return self._vectors(response, len(texts))
            log.warning("embedding_api_retried", attempt=attempt + 1)
            time.sleep(FIRST_BACKOFF_S * 2**attempt)
        raise AssertionError("unreachable")

    def embed_documents(self, texts: Sequence[str], batch_size: int = 64) -> npt.NDArray[np.float32]:
        """One unit row per text, in requests of at most the smaller of ``batch_size`` and the adapter's own."""
        size = max(1, min(batch_size, self._batch_size))
        parts = [self._post(texts[start : start + size]) for start in range(0, len(texts), size)]
        return np.concatenate(parts) if parts else np.zeros((0, self._dimension), np.float32)

    def embed_with_tokens(
        self, texts: Sequence[str], batch_size: int = 64
    ) -> tuple[npt.NDArray[np.float32], list[TokenMatrix]]:
        """The texts' vectors, and for each no token vectors (the API makes none)."""
        return self.embed_documents(texts, batch_size), [self._no_tokens() for _ in texts]

    def embed_query(self, text: str) -> Vector:
        vector: Vector = self.embed_documents([text])[0]
        return vector

    async def embed_query_with_tokens_async(self, text: str, turn: str = "") -> tuple[Vector, TokenMatrix]:
        # One attempt: a query's deadline is shorter than a backoff, and the pipeline answers keyword-only without it.
        try:
            response = await self._async_client.post(self._url, json=self._body([text]))
        except httpx.TransportError as error:
            raise EmbeddingApiError(f"embedding API unreachable: {type(error).__name__}") from None
        return self._vectors(response, 1)[0], self._no_tokens()

    async def on_model_thread(self, work: Callable[[], T], turn: str = "") -> T:
        return await self._thread.run(work, turn)

    def _no_tokens(self) -> TokenMatrix:
        return np.zeros((0, self._dimension), np.float32)

    async def aclose(self) -> None:
        await asyncio.to_thread(self._client.close)
        await self._async_client.aclose()
