"""Wire contracts of ontofabric (pydantic v2). JSON Schema for each message lives in ``schemas/``."""

from .deltas import (
    SCHEMA_VERSION,
    DeltaEnvelope,
    DeltaPayload,
    DocumentDeleted,
    DocumentUpserted,
    LinkAdded,
    LinkRemoved,
    NodeRemoved,
    NodeUpserted,
    OntologyLink,
    OntologyNode,
)
from .documents import CHUNK_LEVELS, PROVENANCES, ChunkLevel, DocumentMetadata, Provenance, SemanticDocument
from .query import (
    ErrorDetail,
    ErrorReply,
    ExpandedContext,
    FoundBy,
    OntologyQuery,
    QueryError,
    QueryMeta,
    QueryResponse,
    SearchResult,
)
from .versions import OntologyVersionChanged

__all__ = [
    "CHUNK_LEVELS",
    "PROVENANCES",
    "SCHEMA_VERSION",
    "ChunkLevel",
    "DeltaEnvelope",
    "DeltaPayload",
    "DocumentDeleted",
    "DocumentMetadata",
    "DocumentUpserted",
    "ErrorDetail",
    "ErrorReply",
    "ExpandedContext",
    "FoundBy",
    "LinkAdded",
    "LinkRemoved",
    "NodeRemoved",
    "NodeUpserted",
    "OntologyLink",
    "OntologyNode",
    "OntologyQuery",
    "OntologyVersionChanged",
    "Provenance",
    "QueryError",
    "QueryMeta",
    "QueryResponse",
    "SearchResult",
    "SemanticDocument",
]
