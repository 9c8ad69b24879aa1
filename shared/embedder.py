"""The Embedder port and its local adapter (sentence-transformers on CPU, offline).

Embedding is CPU-bound: callers in an event loop use :meth:`Embedder.embed_query_with_tokens_async`, which runs the
model on one dedicated thread so concurrent requests queue instead of fighting over the cores; other CPU-bound work
of a query (late interaction) queues on the same thread through :meth:`Embedder.on_model_thread`.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from .late_interaction import TokenMatrix
from .logging import get_logger
from .settings import Precision, Settings

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

log = get_logger(__name__)

Vector = npt.NDArray[np.float32]
T = TypeVar("T")


class EmbedderMismatch(Exception):
    """The model does not produce vectors of the deployment's dimension."""


class Embedder(Protocol):
    model_name: str
    cache_name: str
    """What the embedding cache keys vectors by: the model, and its arithmetic where that changes the vectors."""
    dimension: int

    def embed_documents(self, texts: Sequence[str], batch_size: int = 64) -> npt.NDArray[np.float32]:
        """One L2-normalised row per text."""
        ...

    def embed_with_tokens(
        self, texts: Sequence[str], batch_size: int = 64
    ) -> tuple[npt.NDArray[np.float32], list[TokenMatrix]]:
        """One pass of the model: the L2-normalised row of each text, and its tokens' vectors (unit rows, one per
        token the model read, for late interaction)."""
        ...

    def embed_query(self, text: str) -> Vector: ...

    async def embed_query_with_tokens_async(self, text: str) -> tuple[Vector, TokenMatrix]: ...

    async def on_model_thread(self, work: Callable[[], T]) -> T:
        """``work`` run on the thread the model runs on, queued behind the embeddings asked before it."""
        ...


def cpu_has_bfloat16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has native bfloat16 arithmetic (AVX-512 BF16 or AMX); Linux only, False elsewhere. Where
    it is emulated, bfloat16 is slower than float32."""
    try:
        flags = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return re.search(r"\b(avx512_bf16|amx_bf16)\b", flags) is not None


def unit_rows(matrix: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """Each row scaled to length one (an all-zero row stays zero)."""
    scaled: npt.NDArray[np.float32] = matrix / np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-12)
    return scaled


def wants_bfloat16(precision: Precision) -> bool:
    """A precision setting (`auto`, `float32`, `bfloat16`) resolved on this CPU."""
    return precision == "bfloat16" or (precision == "auto" and cpu_has_bfloat16())


def load_sentence_transformer(model_path: Path, bfloat16: bool) -> SentenceTransformer:
    """A sentence-transformers model from a local directory, on CPU, never touching the network."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from sentence_transformers import SentenceTransformer

    dtype = torch.bfloat16 if bfloat16 else torch.float32
    return SentenceTransformer(str(model_path), device="cpu", local_files_only=True, model_kwargs={"dtype": dtype})


class LocalSentenceTransformer:
    """A sentence-transformers model from a local directory; never touches the network."""

    def __init__(self, model_name: str, model_path: Path, expected_dimension: int, bfloat16: bool = False) -> None:
        self.model_name = model_name
        # bfloat16 vectors are near float32's but not equal: cached apart, so neither precision is served the other's.
        self.cache_name = f"{model_name}@bfloat16" if bfloat16 else model_name
        self._model = load_sentence_transformer(model_path, bfloat16)
        dimension = self._model.get_embedding_dimension()
        if dimension != expected_dimension:
            raise EmbedderMismatch(
                f"{model_name} at {model_path} makes {dimension}-dimensional vectors; "
                f"the deployment is set to {expected_dimension} (ONTOFABRIC_EMBEDDING_DIM)"
            )
        self.dimension = expected_dimension
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedder")
        log.info("embedder_loaded", model=model_name, path=str(model_path), dimension=dimension, bfloat16=bfloat16)

    def embed_documents(self, texts: Sequence[str], batch_size: int = 64) -> npt.NDArray[np.float32]:
        return self.embed_with_tokens(texts, batch_size)[0]

    def embed_with_tokens(
        self, texts: Sequence[str], batch_size: int = 64
    ) -> tuple[npt.NDArray[np.float32], list[TokenMatrix]]:
        encoded = self._model.encode(list(texts), batch_size=batch_size, output_value=None)
        if not encoded:
            return np.zeros((0, self.dimension), np.float32), []
        vectors = np.stack([np.asarray(e["sentence_embedding"].float(), np.float32) for e in encoded])
        # Batched rows are padded to the longest text: keep the tokens the attention mask says are real.
        tokens = [
            unit_rows(np.asarray(e["token_embeddings"][: int(e["attention_mask"].sum())].float(), np.float32))
            for e in encoded
        ]  # .float(): bfloat16 has no numpy dtype
        # Normalised here, in float32: normalised in bfloat16, lengths come out up to 0.2 % off one.
        return unit_rows(vectors), tokens

    def embed_query(self, text: str) -> Vector:
        row: Vector = self.embed_documents([text])[0]
        return row

    def _embed_query_with_tokens(self, text: str) -> tuple[Vector, TokenMatrix]:
        vectors, tokens = self.embed_with_tokens([text])
        return vectors[0], tokens[0]

    async def embed_query_with_tokens_async(self, text: str) -> tuple[Vector, TokenMatrix]:
        return await self.on_model_thread(lambda: self._embed_query_with_tokens(text))

    async def on_model_thread(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)


def build_embedder(settings: Settings) -> Embedder | None:
    """The deployment's embedder, or None when it is set to ``none`` (keyword-only answers)."""
    if settings.embedder == "none":
        return None
    return LocalSentenceTransformer(
        settings.embedding_model,
        settings.resolved_model_path(),
        settings.embedding_dim,
        wants_bfloat16(settings.embedding_precision),
    )
