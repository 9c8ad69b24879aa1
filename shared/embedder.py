"""The Embedder port and its local adapter (sentence-transformers on CPU, offline).

Embedding is CPU-bound: callers in an event loop use :meth:`Embedder.embed_query_async`, which runs the model on
one dedicated thread so concurrent requests queue instead of fighting over the cores.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt

from .logging import get_logger
from .settings import Settings

log = get_logger(__name__)

Vector = npt.NDArray[np.float32]


class EmbedderMismatch(Exception):
    """The model does not produce vectors of the deployment's dimension."""


class Embedder(Protocol):
    model_name: str
    dimension: int

    def embed_documents(self, texts: Sequence[str], batch_size: int = 64) -> npt.NDArray[np.float32]:
        """One L2-normalised row per text."""
        ...

    def embed_query(self, text: str) -> Vector: ...

    async def embed_query_async(self, text: str) -> Vector: ...


class LocalSentenceTransformer:
    """A sentence-transformers model from a local directory; never touches the network."""

    def __init__(self, model_name: str, model_path: Path, expected_dimension: int) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        self.model_name = model_name
        self._model = SentenceTransformer(str(model_path), device="cpu")
        dimension = self._model.get_embedding_dimension()
        if dimension != expected_dimension:
            raise EmbedderMismatch(
                f"{model_name} at {model_path} makes {dimension}-dimensional vectors; "
                f"the deployment is set to {expected_dimension} (ONTOFABRIC_EMBEDDING_DIM)"
            )
        self.dimension = expected_dimension
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedder")
        log.info("embedder_loaded", model=model_name, path=str(model_path), dimension=dimension)

    def embed_documents(self, texts: Sequence[str], batch_size: int = 64) -> npt.NDArray[np.float32]:
        vectors = self._model.encode(
            list(texts), batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True
        )
        return np.asarray(vectors, dtype=np.float32)

    def embed_query(self, text: str) -> Vector:
        row: Vector = self.embed_documents([text])[0]
        return row

    async def embed_query_async(self, text: str) -> Vector:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.embed_query, text)


def build_embedder(settings: Settings) -> Embedder | None:
    """The deployment's embedder, or None when it is set to ``none`` (keyword-only answers)."""
    if settings.embedder == "none":
        return None
    return LocalSentenceTransformer(settings.embedding_model, settings.resolved_model_path(), settings.embedding_dim)
