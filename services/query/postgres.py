"""Postgres adapter of the query worker: dense (pgvector HNSW) and keyword (tsvector) retrieval, document fetch.

Both retrievers apply the same filters inside the index scan, so a filter never empties a top-k that the
unfiltered index would have filled (pgvector iterative scans keep walking the HNSW graph until enough rows pass).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from ontofabric.contracts import NO_VERSION
from ontofabric.shared.db import Connection
from ontofabric.shared.embedder import Vector

from .fusion import Candidate


@dataclass(frozen=True)
class Scope:
    workspace: str
    branch: str
    object_type: str | None = None
    chunk_level: str | None = None
    provenance: str | None = None


@dataclass(frozen=True)
class StoredDocument:
    id: str
    content: str
    object_type: str
    source_domain: str
    metadata: dict[str, Any]


def where_clause(scope: Scope, first_parameter: int) -> tuple[str, list[Any]]:
    """SQL conditions for a scope and their parameters, numbered from ``first_parameter``."""
    parameters: list[Any] = []

    def parameter(value: Any) -> str:
        parameters.append(value)
        return f"${first_parameter + len(parameters) - 1}"

    conditions = [f"workspace = {parameter(scope.workspace)}", f"branch = {parameter(scope.branch)}", "NOT deleted"]
    for column, value in (
        ("object_type", scope.object_type),
        ("chunk_level", scope.chunk_level),
        ("provenance", scope.provenance),
    ):
        if value is not None:
            conditions.append(f"{column} = {parameter(value)}")
    return " AND ".join(conditions), parameters


@dataclass(frozen=True)
class Hits:
    """A retriever's ranked candidates and the ontologyVersion of the data it read."""

    candidates: list[Candidate]
    version: str


@dataclass(frozen=True)
class Fetched:
    documents: dict[str, StoredDocument]
    version: str


# The version label of contracts.versions.format_version, computed where the data is.
_VERSION = """
SELECT stream_seq || '-' || lpad(to_hex(state_hash), 16, '0') FROM ontology_versions
WHERE workspace = $1 AND branch = $2"""


class PostgresRetrieval:
    """Each call reads one snapshot (a read-only repeatable-read transaction) and says which version it saw."""

    backend = "tsvector"

    def __init__(self, pool: asyncpg.Pool, text_search_config: str, ef_search: int) -> None:
        self._pool = pool
        self._config = text_search_config
        self._ef_search = ef_search

    @contextlib.asynccontextmanager
    async def _snapshot(self, scope: Scope) -> AsyncIterator[tuple[Connection, str]]:
        async with self._pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            version = await conn.fetchval(_VERSION, scope.workspace, scope.branch)
            yield conn, version or NO_VERSION

    async def dense(self, scope: Scope, vector: Vector, limit: int) -> Hits:
        where, parameters = where_clause(scope, 3)
        # relaxed_order iterative scans may return rows slightly out of order: re-sort the materialised top-k.
        sql = f"""
            WITH nearest AS MATERIALIZED (
                SELECT id, embedding <=> $1 AS distance FROM documents
                WHERE {where} AND embedding IS NOT NULL
                ORDER BY embedding <=> $1 LIMIT $2)
            SELECT id, 1 - distance AS score FROM nearest WHERE distance <> 'NaN'::float8 ORDER BY distance, id"""
        async with self._snapshot(scope) as (conn, version):
            if limit > self._ef_search:  # the HNSW candidate list must hold at least the rows asked for
                await conn.execute(f"SET LOCAL hnsw.ef_search = {int(limit)}")
            rows = await conn.fetch(sql, vector, limit, *parameters)
        return Hits([Candidate(r["id"], float(r["score"])) for r in rows], version)

    async def keyword(self, scope: Scope, text: str, limit: int) -> Hits:
        where, parameters = where_clause(scope, 4)
        # plainto_tsquery ANDs every term; a natural-language query should match documents with any of them.
        sql = f"""
            WITH q AS (SELECT replace(plainto_tsquery($1::regconfig, $2)::text, ' & ', ' | ')::tsquery AS query)
            SELECT id, ts_rank_cd(search_vector, q.query) AS score FROM documents, q
            WHERE {where} AND search_vector @@ q.query
            ORDER BY score DESC, id LIMIT $3"""
        async with self._snapshot(scope) as (conn, version):
            rows = await conn.fetch(sql, self._config, text, limit, *parameters)
        return Hits([Candidate(r["id"], float(r["score"])) for r in rows], version)

    async def fetch(self, scope: Scope, ids: Sequence[str]) -> Fetched:
        sql = """
            SELECT id, content, object_type, source_domain, metadata FROM documents
            WHERE workspace = $1 AND branch = $2 AND id = ANY($3::text[]) AND NOT deleted"""
        async with self._snapshot(scope) as (conn, version):
            rows = await conn.fetch(sql, scope.workspace, scope.branch, list(ids))
        documents = {
            r["id"]: StoredDocument(
                r["id"], r["content"], r["object_type"], r["source_domain"], json.loads(r["metadata"])
            )
            for r in rows
        }
        return Fetched(documents, version)
