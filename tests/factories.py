"""Builders for test deltas."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from ontofabric.contracts import (
    DeltaEnvelope,
    DocumentDeleted,
    DocumentMetadata,
    DocumentUpserted,
    SecondVector,
    SemanticDocument,
    TokenVectors,
)
from ontofabric.services.ingest.client import envelope
from ontofabric.shared.settings import Settings

DEPLOYMENT_MODEL: str = Settings.model_fields["embedding_model"].default
"""The model a test's vectors are said to come from, unless it names another: vectors name theirs."""


def unit_vector(seed: str, dim: int = 384) -> list[float]:
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "big"))
    vector = rng.standard_normal(dim)
    return [float(x) for x in vector / np.linalg.norm(vector)]


def document(
    doc_id: str,
    content: str,
    *,
    object_type: str = "demo.Thing",
    chunk_level: str | None = "method",
    provenance: str = "ingested",
    embedding: list[float] | None = None,
    token_vectors: TokenVectors | None = None,
    embedding_model: str | None = None,
    second_vector: SecondVector | None = None,
    **metadata: object,
) -> SemanticDocument:
    return SemanticDocument.model_validate(
        {
            "id": doc_id,
            "content": content,
            "objectType": object_type,
            "sourceDomain": "tests",
            "metadata": DocumentMetadata.model_validate(
                {"chunkLevel": chunk_level, "provenance": provenance, "symbolKey": f"test:{doc_id}", **metadata}
            ),
            "embedding": embedding,
            "tokenVectors": token_vectors,
            "embeddingModel": embedding_model or (DEPLOYMENT_MODEL if embedding is not None else None),
            "secondVector": second_vector,
        }
    )


def upsert(
    workspace: str, doc: SemanticDocument, *, branch: str = "main", event_id: str | None = None
) -> DeltaEnvelope:
    return envelope(workspace, DocumentUpserted(document=doc), branch=branch, event_id=event_id)


def delete(workspace: str, doc_id: str, *, branch: str = "main", event_id: str | None = None) -> DeltaEnvelope:
    return envelope(workspace, DocumentDeleted(document_id=doc_id), branch=branch, event_id=event_id)


def projected_minilm(path: Path, dimension: int, seed: int = 7) -> Path:
    """A second embedding model of another dimension: the bundled all-MiniLM-L6-v2 followed by a fixed random
    orthogonal projection to ``dimension``, saved as a sentence-transformers model. It ranks much as MiniLM does
    (a random projection keeps cosines roughly), and its vectors are not MiniLM's."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize

    from ontofabric.shared.settings import Settings

    base = SentenceTransformer(str(Settings().resolved_model_path()), device="cpu", local_files_only=True)
    torch.manual_seed(seed)
    projection = Dense(384, dimension, bias=False, activation_function=torch.nn.Identity())
    torch.nn.init.orthogonal_(projection.linear.weight)
    SentenceTransformer(modules=[base[0], base[1], projection, Normalize()], device="cpu").save(str(path))
    return path


class LosesOneCancellation:
    """Waits as nats-py does where it loses a cancellation (3.11's wait_for with a reply arriving alongside, a flush
    it forces): the first cancellation is lost, and the caller goes on with ``then``; later ones are not."""

    lost = False

    async def wait(self, then: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        if not self.lost:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:  # not passed on, and not withdrawn either (uncancel)
                self.lost = True
        return await then(*args)
