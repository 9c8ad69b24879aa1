"""The embedding port over HTTP: an OpenAI-compatible ``POST {base}/embeddings`` (OpenAI, Azure OpenAI's v1 route,
vLLM, Ollama, Hugging Face TEI and others speak it).

Such an API returns one pooled vector per text and no token vectors, so documents embedded this way carry none and
late interaction finds nothing to compare for them (``_meta.skippedLateInteraction: no_token_vectors``). A text is
sent up to ``max_characters``, not in windows (the local model's windows are its tokenizer's, which this side does
not have); one the API refuses as too long (413, or 400/422 saying so) is sent again cut to half, down to
``MIN_CHARACTERS``. APIs limit input in tokens: OpenAI's 8,192, a TEI server 512 unless started with
``--auto-truncate``."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import httpx
import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ValidationError
from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_attempt

from .embedder import EmbedderMismatch, ModelThread, Vector, unit_rows
from .late_interaction import TokenMatrix
from .logging import get_logger

log = get_logger(__name__)

T = TypeVar("T")

RETRIED_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})
"""Answers worth asking again: rate limits and a server's passing trouble."""
REFUSED_STATUSES = frozenset({400, 413, 422})
"""Answers that may blame one text of a request: a request of several is split to find it."""
ATTEMPTS = 8
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 60.0
"""The longest wait between two attempts, a Retry-After's included."""
MIN_CHARACTERS = 500
TOO_LONG = re.compile(r"token|too long|length|context|maximum", re.IGNORECASE)


class EmbeddingApiError(Exception):
    """The embedding API refused or failed: its status and what it said, never the key."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


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
        self._key = (api_key or "").strip()
        headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        self._client = httpx.Client(headers=headers, timeout=timeout_s, transport=transport)
        self._async_client = httpx.AsyncClient(headers=headers, timeout=timeout_s, transport=async_transport)
        self._thread = ModelThread(ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedder"))

    @property
    def model_name(self) -> str:
        return self._model

    @property
    def cache_name(self) -> str:
        # What makes the vectors: the model, the length asked for, and how much of a text it reads.
        return f"{self._model}@api/{self._dimension}d/{self._max_characters}c"

    @property
    def vectors_name(self) -> str:
        return self.cache_name

    @property
    def dimension(self) -> int:
        return self._dimension

    def _body(self, texts: Sequence[str], characters: int | None = None) -> dict[str, Any]:
        cut = characters or self._max_characters
        body: dict[str, Any] = {"model": self._model, "input": [t[:cut] or " " for t in texts]}
        if self._send_dimensions:
            body["dimensions"] = self._dimension
        return body

    def _said(self, response: httpx.Response) -> str:
        text = response.text[:300]
        return text.replace(self._key, "***") if self._key else text

    def _vectors(self, response: httpx.Response, count: int) -> npt.NDArray[np.float32]:
        """The answer's vectors in the order asked, unit length, checked against the deployment's dimension."""
        if response.status_code != 200:
            raise EmbeddingApiError(
                f"embedding API answered {response.status_code}: {self._said(response)}", response.status_code
            )
        try:
            items = _Answer.model_validate_json(response.content).data
        except ValidationError as error:
            problems = error.error_count()
            raise EmbeddingApiError(f"embedding API answered a malformed body: {problems} problems") from None
        if sorted(item.index for item in items) != list(range(count)):
            raise EmbeddingApiError(f"embedding API answered {len(items)} vectors for {count} texts")
        rows = [item.embedding for item in sorted(items, key=lambda item: item.index)]
        if wrong := next((len(row) for row in rows if len(row) != self._dimension), None):
            raise EmbedderMismatch(
                f"embedding API model {self._model} makes {wrong}-dimensional vectors; the deployment's are "
                f"{self._dimension} (ONTOFABRIC_EMBEDDING_DIM; or ONTOFABRIC_EMBEDDING_API_DIMENSIONS=true where the "
                "model shortens its vectors on request)"
            )
        matrix = np.asarray(rows, np.float32)
        # Checked before anything keeps them (the embedding cache would serve a zero vector for good).
        if not np.isfinite(matrix).all() or (np.linalg.norm(matrix, axis=1) < 1e-6).any():
            raise EmbeddingApiError("embedding API answered a vector that is not finite, or zero")
        return unit_rows(matrix)

    def _post(self, texts: Sequence[str], characters: int | None = None) -> npt.NDArray[np.float32]:
        """One request, asked again on a rate limit or a passing failure (its Retry-After heeded, with backoff)."""

        def attempt() -> httpx.Response:
            response = self._client.post(self._url, json=self._body(texts, characters))
            if response.status_code in RETRIED_STATUSES:
                raise _Passing(response)
            return response

        retrying = Retrying(
            retry=retry_if_exception_type((httpx.TransportError, _Passing)),
            stop=stop_after_attempt(ATTEMPTS),
            wait=_backoff,
            before_sleep=_log_retry,
            reraise=True,
        )
        try:
            response = retrying(attempt)
        except _Passing as passing:  # the last attempt's answer: said as the API said it
            response = passing.response
        except httpx.TransportError as error:
            raise _unreachable(error) from None
        return self._vectors(response, len(texts))

    def _embed(self, texts: Sequence[str], characters: int | None = None) -> npt.NDArray[np.float32]:
        """``texts`` embedded; a request refused for one of them is split until the one it blames is alone, and a
        text refused as too long is sent again cut to half, down to MIN_CHARACTERS."""
        try:
            return self._post(texts, characters)
        except EmbeddingApiError as error:
            if error.status not in REFUSED_STATUSES:
                raise
            if len(texts) > 1:
                half = len(texts) // 2
                return np.concatenate([self._embed(texts[:half], characters), self._embed(texts[half:], characters)])
            length = min(len(texts[0]), characters or self._max_characters)
            too_long = error.status == 413 or TOO_LONG.search(str(error)) is not None
            if not too_long or length <= MIN_CHARACTERS:
                raise EmbeddingApiError(f"{error} (a text of {len(texts[0])} characters)", error.status) from None
            log.warning("embedding_api_text_cut", characters=length // 2)
            return self._embed(texts, max(MIN_CHARACTERS, length // 2))

    def check(self) -> None:
        """One text embedded once, at start: vectors of another dimension than the deployment's stop the process
        (EmbedderMismatch), where every query would have gone keyword-only; an API that does not answer now is
        logged, and asked again by each query and document."""
        try:
            self._vectors(_reached(lambda: self._client.post(self._url, json=self._body(["check"]))), 1)
        except EmbeddingApiError as error:
            log.warning("embedding_api_unchecked", url=self._url, error=str(error))

    def embed_documents(self, texts: Sequence[str], batch_size: int = 64) -> npt.NDArray[np.float32]:
        """One unit row per text, in requests of ``embedding_api_batch`` texts (``batch_size``, the local model's
        memory bound, does not apply to a remote one)."""
        size = self._batch_size
        parts = [self._embed(texts[start : start + size]) for start in range(0, len(texts), size)]
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
            raise _unreachable(error) from None
        return self._vectors(response, 1)[0], self._no_tokens()

    async def on_model_thread(self, work: Callable[[], T], turn: str = "") -> T:
        return await self._thread.run(work, turn)

    def _no_tokens(self) -> TokenMatrix:
        return np.zeros((0, self._dimension), np.float32)

    async def aclose(self) -> None:
        await asyncio.to_thread(self._client.close)
        await self._async_client.aclose()


class _Passing(Exception):
    """An answer worth asking again for (RETRIED_STATUSES)."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def _backoff(state: RetryCallState) -> float:
    """Doubling from FIRST_BACKOFF_S, or as long as a Retry-After asks, up to MAX_BACKOFF_S."""
    wait: float = FIRST_BACKOFF_S * 2.0 ** (state.attempt_number - 1)
    failure = state.outcome.exception() if state.outcome is not None else None
    if isinstance(failure, _Passing):
        wait = max(wait, _retry_after_s(failure.response))
    return min(MAX_BACKOFF_S, wait)


def _log_retry(state: RetryCallState) -> None:
    wait = state.next_action.sleep if state.next_action is not None else 0.0
    log.warning("embedding_api_retried", attempt=state.attempt_number, wait_s=round(wait, 1))


def _retry_after_s(response: httpx.Response) -> float:
    """The seconds a Retry-After header (in seconds) asks for; 0 without one."""
    try:
        return max(0.0, float(response.headers.get("retry-after", "0")))
    except ValueError:
        return 0.0


def _unreachable(error: httpx.TransportError) -> EmbeddingApiError:
    """A request that got no answer, said by its kind alone (the exception's text may carry the URL's secrets)."""
    return EmbeddingApiError(f"embedding API unreachable: {type(error).__name__}")


def _reached(post: Callable[[], httpx.Response]) -> httpx.Response:
    """``post``'s answer, or the EmbeddingApiError that it got none."""
    try:
        return post()
    except httpx.TransportError as error:
        raise _unreachable(error) from None
