"""SemanticDocument: one retrievable chunk of an ontology, as ingesters publish it."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

import numpy as np
from pydantic import AfterValidator, ConfigDict, Field, StringConstraints

from ._base import WireModel

ChunkLevel = Literal["file", "type", "method", "doc"]
CHUNK_LEVELS: tuple[ChunkLevel, ...] = ("file", "type", "method", "doc")
Provenance = Literal["hand-authored", "ingested"]
PROVENANCES: tuple[Provenance, ...] = ("hand-authored", "ingested")

Workspace = Annotated[
    str,
    StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"),
    Field(description="Workspace (tenant) name: letters, digits, '.', '_', '-'; at most 128 characters."),
]
Branch = Annotated[
    str,
    StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$"),
    Field(description="Branch name, git style (may contain '/' and '.'); 'main' is the trunk."),
]
ObjectType = Annotated[
    str,
    StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_.$-]{0,511}$"),
    Field(description="Ontology object type, '{domain}.{typeName}' (a top-level type may have no domain)."),
]
DocumentId = Annotated[
    str,
    StringConstraints(pattern=r"^[^\x00-\x1f\x7f]{1,512}$"),
    Field(description="Stable document identifier (no control characters, at most 512 characters)."),
]


def _no_nul(value: str) -> str:
    # PostgreSQL text cannot hold NUL; refusing it here turns a later database error into a clear rejection.
    if "\x00" in value:
        raise ValueError("text must not contain NUL characters")
    return value


Text = Annotated[str, AfterValidator(_no_nul)]


def _finite_nonzero(vector: list[float]) -> list[float]:
    if not vector:
        raise ValueError("embedding must not be empty")
    # Vectors are stored as float32: check what will be stored, not the float64 that arrived.
    stored = np.asarray(vector, dtype=np.float32)
    if not np.isfinite(stored).all():
        raise ValueError("embedding must contain only finite float32 numbers")
    if float(np.linalg.norm(stored)) < 1e-12:
        raise ValueError("embedding must not be (nearly) the zero vector: cosine distance is undefined")
    return vector


Embedding = Annotated[list[float], AfterValidator(_finite_nonzero)]


class DocumentMetadata(WireModel):
    """Metadata used for filtering and identity; free extra keys are kept as they are."""

    model_config = ConfigDict(extra="allow")

    symbol_key: Text | None = Field(default=None, description="Refactor-stable symbol identity.")
    symbol_kind: Text | None = Field(default=None, description="module, class, function, method, section, ...")
    symbol_fqn: Text | None = Field(default=None, description="Human-readable fully qualified name.")
    content_hash: Text | None = Field(default=None, description="sha256 of the content, hex.")
    file_path: Text | None = Field(default=None, description="Source path relative to the ingested root.")
    chunk_level: ChunkLevel | None = None
    provenance: Provenance | None = None


class SemanticDocument(WireModel):
    id: DocumentId
    content: Text
    object_type: ObjectType
    source_domain: Text = Field(min_length=1, max_length=256)
    metadata: DocumentMetadata = Field(default_factory=DocumentMetadata)
    embedding: Embedding | None = Field(
        default=None, description="Dense vector; its length must equal the deployment's dimension."
    )
    embedding_model: Text | None = Field(
        default=None, description="Model that produced the embedding; checked against the deployment's model."
    )
    indexed_at: datetime | None = None
