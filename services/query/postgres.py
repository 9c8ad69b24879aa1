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
from ontofabric.shared.analysis import analyse
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
    ceiling: float | None = None
    """Keyword only: the highest score any document could reach for this query (every term, saturated)."""


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

    backend = "postgres-bm25"

    def __init__(
        self, pool: asyncpg.Pool, text_search_config: str, ef_search: int, bm25_k1: float = 1.2, bm25_b: float = 0.8
    ) -> None:
        self._pool = pool
        self._config = text_search_config
        self._ef_search = ef_search
        self._k1 = bm25_k1
        self._b = bm25_b

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
        """BM25 (Lucene's idf) over the postings the projector keeps; filters apply before the top-k is cut."""
        filtered, parameters = "", list[Any]()
        if scope.object_type or scope.chunk_level or scope.provenance:
            where, parameters = where_clause(scope, 8)
            filtered = f"AND EXISTS (SELECT 1 FROM documents WHERE id = s.id AND {where})"
        # Every postings read is an index range scan on (workspace, branch, term): LATERAL, kept from being
        # flattened into a join by OFFSET 0, makes it so even before the planner has statistics of a partition.
        # Parameters are cast: an untyped $n beside an integer literal is inferred as integer, and asyncpg would
        # round k1 and b without a word.
        sql = f"""
            WITH terms AS (SELECT lexeme AS term FROM unnest(index_tsvector($1::regconfig, $2))),
            stats AS (
                SELECT greatest(doc_count, 1)::float8 AS n,
                       greatest(total_length, 1)::float8 / greatest(doc_count, 1) AS avgdl
                FROM ontology_versions WHERE workspace = $4 AND branch = $5),
            idf AS (
                SELECT t.term, ln(1 + (st.n - f.df + 0.5) / (f.df + 0.5)) AS idf
                FROM terms t CROSS JOIN stats st
                CROSS JOIN LATERAL (
                    SELECT count(*) AS df FROM postings p
                    WHERE p.workspace = $4 AND p.branch = $5 AND p.term = t.term) f
                WHERE f.df > 0),
            scored AS (
                SELECT p.doc_id AS id,
                       sum(i.idf * p.tf * ($6::float8 + 1)
                           / (p.tf + $6::float8 * (1 - $7::float8 + $7::float8 * p.doc_length / st.avgdl))) AS score
                FROM idf i CROSS JOIN stats st
                CROSS JOIN LATERAL (
                    SELECT doc_id, tf, doc_length FROM postings p
                    WHERE p.workspace = $4 AND p.branch = $5 AND p.term = i.term
                    OFFSET 0) p
                GROUP BY p.doc_id)
            SELECT s.id, s.score, (SELECT sum(idf) FROM idf) * ($6::float8 + 1) AS ceiling
            FROM scored s
            WHERE true {filtered}
            ORDER BY s.score DESC, s.id LIMIT $3"""
        analysed = analyse(text)
        async with self._snapshot(scope) as (conn, version):
            rows = await conn.fetch(
                sql, self._config, analysed, limit, scope.workspace, scope.branch, self._k1, self._b, *parameters
            )
        ceiling = float(rows[0]["ceiling"]) if rows else None
        return Hits([Candidate(r["id"], float(r["score"])) for r in rows], version, ceiling)

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
