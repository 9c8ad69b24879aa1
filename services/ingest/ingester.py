"""The reference ingester: chunk a source tree, publish only what changed since the last ingest.

The last ingest of each (workspace, branch) is remembered as a manifest (document id -> content hash) in a
JetStream object store, so any machine can ingest incrementally. Manifests are written only after every delta
is stored; an interrupted run publishes the same event ids again, which JetStream deduplicates.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from nats.js import JetStreamContext
from nats.js.errors import ObjectNotFoundError

from ontofabric.contracts import (
    DeltaEnvelope,
    DocumentDeleted,
    DocumentMetadata,
    DocumentUpserted,
    SemanticDocument,
)
from ontofabric.shared.embedder import Embedder
from ontofabric.shared.logging import get_logger
from ontofabric.shared.subjects import Names, encode_token

from .chunking import Chunk, chunk_file
from .client import DeltaPublisher, envelope

log = get_logger(__name__)

SKIPPED_DIRECTORIES = {
    "__pycache__", "node_modules", "build", "dist", "site-packages", "venv", ".venv", ".git", ".tox", ".eggs",
}  # fmt: skip
SOURCE_SUFFIXES = (".py", ".md")
EMBED_BATCH = 64


class Progress(Protocol):
    """Where a long run reports how far it got (the CLI draws progress bars from this)."""

    def stage(self, name: str, total: int) -> None: ...

    def advance(self, name: str, amount: int = 1) -> None: ...


class _Silent:
    def stage(self, name: str, total: int) -> None:
        pass

    def advance(self, name: str, amount: int = 1) -> None:
        pass


def discover(root: Path) -> Iterator[Path]:
    """Source files under ``root``, in a stable order, skipping hidden and generated directories."""
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = sorted(
            d for d in subdirectories if not d.startswith(".") and d not in SKIPPED_DIRECTORIES
            and not d.endswith(".egg-info")
        )  # fmt: skip
        for name in sorted(files):
            if name.endswith(SOURCE_SUFFIXES):
                yield Path(directory) / name


def chunk_tree(root: Path, max_content_bytes: int) -> list[Chunk]:
    chunks: list[Chunk] = []
    for path in discover(root):
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError) as error:
            log.warning("ingest_file_skipped", path=str(path), error=str(error))
            continue
        chunks.extend(chunk_file(path.relative_to(root).as_posix(), source, max_content_bytes))
    return chunks


# ---------------------------------------------------------------------------------------------- diff


@dataclass(frozen=True)
class Manifest:
    """What the last ingest published: document id -> content hash."""

    entries: dict[str, str] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.entries, sort_keys=True).encode()).hexdigest()

    def to_json(self) -> bytes:
        return json.dumps({"version": 1, "entries": self.entries}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        return cls(dict(json.loads(data)["entries"]))


@dataclass(frozen=True)
class IngestPlan:
    upserts: list[Chunk]
    deletes: list[str]
    unchanged: int
    manifest: Manifest
    """The manifest once this plan is published."""


def plan_ingest(previous: Manifest, chunks: Sequence[Chunk]) -> IngestPlan:
    current = {c.document_id: c for c in chunks}
    upserts = [c for doc_id, c in current.items() if previous.entries.get(doc_id) != c.content_hash]
    deletes = sorted(set(previous.entries) - set(current))
    manifest = Manifest({doc_id: c.content_hash for doc_id, c in current.items()})
    return IngestPlan(upserts, deletes, len(current) - len(upserts), manifest)


def event_id(workspace: str, branch: str, base: Manifest, document_id: str, content_hash: str | None) -> str:
    """Deterministic for a rerun from the same manifest (JetStream drops the repeat), new after any change."""
    material = "|".join([workspace, branch, base.digest, document_id, content_hash or "deleted"])
    return hashlib.sha256(material.encode()).hexdigest()[:40]


def to_document(chunk: Chunk, embedding: list[float] | None, embedding_model: str | None) -> SemanticDocument:
    return SemanticDocument(
        id=chunk.document_id,
        content=chunk.content,
        object_type=chunk.object_type,
        source_domain=chunk.source_domain,
        metadata=DocumentMetadata(
            symbol_key=chunk.symbol_key,
            symbol_kind=chunk.symbol_kind,
            symbol_fqn=chunk.symbol_fqn,
            content_hash=chunk.content_hash,
            file_path=chunk.file_path,
            chunk_level=chunk.chunk_level,
            provenance="ingested",
        ),
        embedding=embedding,
        embedding_model=embedding_model if embedding is not None else None,
    )


# --------------------------------------------------------------------------------------------- run


@dataclass(frozen=True)
class IngestReport:
    files: int
    chunks: int
    upserts: int
    deletes: int
    unchanged: int
    last_sequence: int | None
    """Stream sequence of the last delta published; None when nothing changed."""
    embed_s: float
    publish_s: float


class Ingester:
    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        embedder: Embedder | None,
        max_content_bytes: int,
        progress: Progress | None = None,
    ) -> None:
        self._js = js
        self._names = names
        self._embedder = embedder
        self._max_content_bytes = max_content_bytes
        self._progress = progress or _Silent()

    def _manifest_name(self, workspace: str, branch: str) -> str:
        return f"{encode_token(workspace)}/{encode_token(branch)}"

    async def load_manifest(self, workspace: str, branch: str) -> Manifest:
        store = await self._js.object_store(self._names.ingest_state_bucket)
        try:
            result = await store.get(self._manifest_name(workspace, branch))
        except ObjectNotFoundError:
            return Manifest()
        return Manifest.from_json(result.data or b'{"entries": {}}')

    async def ingest(self, root: Path, workspace: str, branch: str = "main") -> IngestReport:
        files = sum(1 for _ in discover(root))
        chunks = await asyncio.to_thread(chunk_tree, root, self._max_content_bytes)
        previous = await self.load_manifest(workspace, branch)
        plan = plan_ingest(previous, chunks)
        log.info(
            "ingest_planned", workspace=workspace, branch=branch, files=files, chunks=len(chunks),
            upserts=len(plan.upserts), deletes=len(plan.deletes), unchanged=plan.unchanged,
        )  # fmt: skip
        embed_started = time.perf_counter()
        vectors = await self._embed(plan.upserts)
        embed_s = time.perf_counter() - embed_started
        model = self._embedder.model_name if self._embedder is not None else None
        deltas: list[DeltaEnvelope] = [
            envelope(
                workspace,
                DocumentUpserted(document=to_document(chunk, vector, model)),
                branch=branch,
                event_id=event_id(workspace, branch, previous, chunk.document_id, chunk.content_hash),
            )
            for chunk, vector in zip(plan.upserts, vectors, strict=True)
        ]
        deltas += [
            envelope(
                workspace,
                DocumentDeleted(document_id=doc_id),
                branch=branch,
                event_id=event_id(workspace, branch, previous, doc_id, None),
            )
            for doc_id in plan.deletes
        ]
        publish_started = time.perf_counter()
        self._progress.stage("publish", len(deltas))
        acks = await DeltaPublisher(self._js, self._names).publish_many(
            deltas, on_stored=lambda _: self._progress.advance("publish")
        )
        publish_s = time.perf_counter() - publish_started
        if deltas:
            store = await self._js.object_store(self._names.ingest_state_bucket)
            await store.put(self._manifest_name(workspace, branch), plan.manifest.to_json())
        return IngestReport(
            files=files,
            chunks=len(chunks),
            upserts=len(plan.upserts),
            deletes=len(plan.deletes),
            unchanged=plan.unchanged,
            last_sequence=max((a.seq for a in acks), default=None),
            embed_s=embed_s,
            publish_s=publish_s,
        )

    async def _embed(self, chunks: Sequence[Chunk]) -> list[list[float] | None]:
        if self._embedder is None:
            return [None] * len(chunks)
        embedder = self._embedder
        self._progress.stage("embed", len(chunks))
        vectors: list[list[float] | None] = []
        for start in range(0, len(chunks), EMBED_BATCH):
            batch = [c.embedding_text for c in chunks[start : start + EMBED_BATCH]]
            rows = await asyncio.to_thread(embedder.embed_documents, batch)
            vectors.extend([float(x) for x in row] for row in rows)
            self._progress.advance("embed", len(batch))
        return vectors
