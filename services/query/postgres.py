"""Postgres adapter of the query worker: dense (pgvector HNSW) and keyword (tsvector) retrieval, document fetch.

Both retrievers apply the same filters inside the index scan, so a filter never empties a top-k that the
unfiltered index would have filled (pgvector iterative scans keep walking the HNSW graph until enough rows pass).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

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


class PostgresRetrieval:
    backend = "tsvector"

    def __init__(self, pool: asyncpg.Pool, text_search_config: str) -> None:
        self._pool = pool
        self._config = text_search_config

    async def dense(self, scope: Scope, vector: Vector, limit: int) -> list[Candidate]:
        where, parameters = where_clause(scope, 3)
        # relaxed_order iterative scans may return rows slightly out of order: re-sort the materialised top-k.
        sql = f"""
            WITH nearest AS MATERIALIZED (
                SELECT id, embedding <=> $1 AS distance FROM documents
                WHERE {where} AND embedding IS NOT NULL
                ORDER BY embedding <=> $1 LIMIT $2)
            SELECT id, 1 - distance AS score FROM nearest ORDER BY distance, id"""
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(sql, vector, limit, *parameters)
        return [Candidate(r["id"], float(r["score"])) for r in rows]

    async def keyword(self, scope: Scope, text: str, limit: int) -> list[Candidate]:
        where, parameters = where_clause(scope, 4)
        # plainto_tsquery ANDs every term; a natural-language query should match documents with any of them.
        sql = f"""
            WITH q AS (SELECT replace(plainto_tsquery($1::regconfig, $2)::text, ' & ', ' | ')::tsquery AS query)
            SELECT id, ts_rank_cd(search_vector, q.query) AS score FROM documents, q
            WHERE {where} AND search_vector @@ q.query
            ORDER BY score DESC, id LIMIT $3"""
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(sql, self._config, text, limit, *parameters)
        return [Candidate(r["id"], float(r["score"])) for r in rows]

    async def fetch(self, scope: Scope, ids: Sequence[str]) -> dict[str, StoredDocument]:
        sql = """
            SELECT id, content, object_type, source_domain, metadata FROM documents
            WHERE workspace = $1 AND branch = $2 AND id = ANY($3::text[]) AND NOT deleted"""
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(sql, scope.workspace, scope.branch, list(ids))
        return {
            r["id"]: StoredDocument(
                r["id"], r["content"], r["object_type"], r["source_domain"], json.loads(r["metadata"])
            )
            for r in rows
        }
