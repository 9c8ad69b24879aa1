"""The azure-ai-search keyword backend (seed 000 §5.5): keyword candidates from the Azure AI Search index the Azure
projector keeps, everything else (dense search, what is visible, documents, the graph) from Postgres.

Postgres stays the source of truth. Every Azure hit is checked against a Postgres snapshot, so a document deleted,
reverted or shadowed by a branch there is never answered from an index that has not caught up, and the hits carry
that snapshot's ontologyVersion, as the dense list does. When the index's watermark is behind the snapshot the hits
say so (``lagging``), the answer reports ``keywordIndexBehind`` in ``_meta.degraded`` and is not cached.

BM25 scores from Azure have no known ceiling (the service does not say what a query could reach), so adaptive fusion
divides them by the top hit's and the keyword-saturation early exit does not fire on this backend.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence

from azure.search.documents.aio import SearchClient

from ontofabric.shared.analysis import analyse
from ontofabric.shared.azure_search import DOCUMENT, WATERMARK
from ontofabric.shared.embedder import Vector

from .fusion import Candidate
from .graph import GraphRows
from .postgres import MAIN, Fetched, Hits, PostgresRetrieval, Representatives, Scope

# Characters the simple query syntax reads as operators; escaped, a query is a bag of terms as on Postgres.
_OPERATORS = re.compile(r'([+\-&|!(){}\[\]^"~*?:\\/])')


def escape_query(text: str) -> str:
    """The analysed query (identifier parts appended, as the index holds them) with every operator escaped."""
    return _OPERATORS.sub(r"\\\1", analyse(text))


def _quoted(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _any_of(field: str, values: Sequence[str]) -> str:
    """``field`` equal to one of ``values``: ``search.in`` with a delimiter none of them holds, else ``or``."""
    for delimiter in ("|", ",", "\x1f"):
        if not any(delimiter in value for value in values):
            return f"search.in({field}, {_quoted(delimiter.join(values))}, {_quoted(delimiter)})"
    return "(" + " or ".join(f"{field} eq {_quoted(value)}" for value in values) + ")"


def scope_filter(scope: Scope) -> str:
    """OData filter of the live documents a scope may see: its workspace, main and its branch (shadowing is
    resolved against Postgres afterwards), and the request's filters."""
    conditions = [
        f"kind eq '{DOCUMENT}'",
        "deleted eq false",
        f"workspace eq {_quoted(scope.workspace)}",
        _any_of("branch", scope.branches),
    ]
    if scope.object_types is not None:
        conditions.append(_any_of("objectType", scope.object_types) if scope.object_types else "false")
    if scope.chunk_level is not None:
        conditions.append(f"chunkLevel eq {_quoted(scope.chunk_level)}")
    if scope.provenance is not None:
        conditions.append(f"provenance eq {_quoted(scope.provenance)}")
    return " and ".join(conditions)


class AzureKeywordRetrieval:
    """The query worker's retrieval with the keyword path on Azure AI Search; the rest is the Postgres adapter's."""

    backend = "azure-ai-search"

    def __init__(self, postgres: PostgresRetrieval, client: SearchClient, timeout_s: float) -> None:
        self._postgres = postgres
        self._client = client
        self._timeout_s = timeout_s

    async def keyword(self, scope: Scope, text: str, limit: int) -> Hits:
        # A branch's hits may include main's copies it shadows: ask for more, Postgres drops them.
        top = min(limit if scope.branch == MAIN else 2 * limit, 1000)
        async with asyncio.timeout(self._timeout_s):
            hits, marks = await asyncio.gather(self._search(scope, text, top), self._watermarks(scope))
        visible = await self._postgres.visible(scope, list({document_id for document_id, _, _ in hits}))
        candidates: list[Candidate] = []
        seen: set[str] = set()
        for document_id, branch, score in hits:
            if (document_id, branch) in visible.rows and document_id not in seen:
                seen.add(document_id)
                candidates.append(Candidate(document_id, score))
        lagging = any(marks.get(branch, 0) < seq for branch, seq in visible.stream_seqs.items())
        return Hits(candidates[:limit], visible.version, lagging=lagging)

    async def _search(self, scope: Scope, text: str, top: int) -> list[tuple[str, str, float]]:
        results = await self._client.search(
            search_text=escape_query(text),
            filter=scope_filter(scope),
            select=["documentId", "branch"],
            top=top,
        )
        return [(row["documentId"], row["branch"], float(row["@search.score"])) async for row in results]

    async def _watermarks(self, scope: Scope) -> dict[str, int]:
        results = await self._client.search(
            search_text="*",
            filter=f"kind eq '{WATERMARK}' and workspace eq {_quoted(scope.workspace)} and "
            + _any_of("branch", scope.branches),
            select=["branch", "seq"],
        )
        return {row["branch"]: int(row["seq"]) async for row in results}

    # Everything but the keyword path reads Postgres.

    async def dense(self, scope: Scope, vector: Vector, limit: int) -> Hits:
        return await self._postgres.dense(scope, vector, limit)

    async def dense_scores(self, scope: Scope, vector: Vector, ids: Sequence[str]) -> Hits:
        return await self._postgres.dense_scores(scope, vector, ids)

    async def fetch(self, scope: Scope, ids: list[str], token_signs_of: Sequence[str] = ()) -> Fetched:
        return await self._postgres.fetch(scope, ids, token_signs_of)

    async def graph_rows(self, workspace: str, branch: str) -> GraphRows:
        return await self._postgres.graph_rows(workspace, branch)

    async def representatives(self, scope: Scope, object_types: Sequence[str]) -> Representatives:
        return await self._postgres.representatives(scope, object_types)
