"""The azure-ai-search keyword backend (seed 000 §5.5): keyword candidates from the Azure AI Search index the Azure
projector keeps, everything else (dense search, what is visible, documents, the graph) from Postgres.

Postgres stays the source of truth. Every Azure hit is checked against a Postgres snapshot, so a document deleted,
reverted or shadowed by a branch there is never answered from an index that has not caught up, and the hits carry
that snapshot's ontologyVersion, as the dense list does; a hit counts only when its entry holds the text Postgres
shows (same branch, same content MD5), so an entry older or newer than Postgres's row, or written by a republished
event Postgres ignored, is never answered. When the index's watermark is behind the snapshot the hits say so
(``lagging``), the answer reports ``keywordIndexBehind`` in ``_meta.degraded`` and is not cached.

BM25 scores from Azure have no known ceiling (the service does not say what a query could reach), so adaptive fusion
divides them by the top hit's and the keyword-saturation early exit does not fire on this backend.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence

from azure.search.documents.aio import SearchClient

from ontofabric.contracts import MAIN_BRANCH
from ontofabric.shared.analysis import analyse
from ontofabric.shared.azure_search import DOCUMENT, read_watermark
from ontofabric.shared.logging import get_logger

from .core import KEYWORD, Candidate, Hits, Scope, SearchInput, Visibility

MAX_HIDDEN_IN_FILTER = 1000
"""Main's ids a branch hides that go into the search filter, at most (the service limits a filter's size)."""

log = get_logger(__name__)

# Characters the simple query syntax reads as operators; escaped, a query is a bag of terms as on Postgres.
_OPERATORS = re.compile(r'([+\-&|!(){}\[\]^"~*?:\\/])')


def escape_query(text: str) -> str:
    """The analysed query (identifier parts appended, as the index holds them) with every operator escaped."""
    return _OPERATORS.sub(r"\\\1", analyse(text, catenate=False))


def _quoted(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _any_of(field: str, values: Sequence[str]) -> str:
    """``field`` equal to one of ``values``: ``search.in`` with a delimiter none of them holds, else ``or``."""
    for delimiter in ("|", ",", "\x1f"):
        if not any(delimiter in value for value in values):
            return f"search.in({field}, {_quoted(delimiter.join(values))}, {_quoted(delimiter)})"
    return "(" + " or ".join(f"{field} eq {_quoted(value)}" for value in values) + ")"


def scope_filter(scope: Scope, hidden: Sequence[str] = ()) -> str:
    """OData filter of the live documents a scope may see: its workspace, its branch and main's documents the
    branch does not hide (``hidden``, from Postgres), and the request's filters."""
    conditions = [
        f"kind eq '{DOCUMENT}'",
        "deleted eq false",
        f"workspace eq {_quoted(scope.workspace)}",
    ]
    if scope.on_main:
        conditions.append(f"branch eq '{MAIN_BRANCH}'")
    else:
        mains = f"branch eq '{MAIN_BRANCH}'" + (f" and not {_any_of('documentId', hidden)}" if hidden else "")
        conditions.append(f"(branch eq {_quoted(scope.branch)} or ({mains}))")
    if scope.object_types is not None:
        conditions.append(_any_of("objectType", scope.object_types) if scope.object_types else "false")
    if scope.chunk_level is not None:
        conditions.append(f"chunkLevel eq {_quoted(scope.chunk_level)}")
    if scope.provenance is not None:
        conditions.append(f"provenance eq {_quoted(scope.provenance)}")
    if scope.symbol_kind is not None:
        conditions.append(f"symbolKind eq {_quoted(scope.symbol_kind)}")
    return " and ".join(conditions)


class AzureKeyword:
    """The keyword retriever on Azure AI Search; its hits are checked against the document store."""

    name = KEYWORD
    backend = "azure-ai-search"
    needs_embedding = False

    def __init__(self, visibility: Visibility, client: SearchClient, timeout_s: float) -> None:
        self._visibility = visibility
        self._client = client
        self._timeout_s = timeout_s

    async def search(self, scope: Scope, query: SearchInput, limit: int) -> Hits:
        # Outside the Azure budget: Postgres has its own statement timeout, and a slow read there is not Azure's.
        hidden, hidden_at = await self._visibility.shadowed(scope) if not scope.on_main else ([], None)
        where, top = scope_filter(scope, hidden), limit
        if len(hidden) > MAX_HIDDEN_IN_FILTER:  # too long a filter: ask for more, the Postgres check drops them
            where, top = scope_filter(scope), 1000
        if scope.paths is not None or scope.exclude_paths is not None:  # no filter says them: the check does
            top = 1000
        async with asyncio.timeout(self._timeout_s):
            # The watermark first: what the search then sees is at least what the watermark vouches for.
            watermark = await read_watermark(self._client) or 0
            hits = await self._search(where, query.text, min(top, 1000))
        visible = await self._visibility.visible(scope, list({document_id for document_id, _, _, _ in hits}))
        candidates: list[Candidate] = []
        seen: set[str] = set()
        stale = 0
        for document_id, branch, md5, score in hits:
            shown = visible.rows.get((document_id, branch))
            if shown is not None and shown != md5:
                stale += 1  # another text than Postgres shows (older, newer, or a republished event's)
            elif shown is not None and document_id not in seen:
                seen.add(document_id)
                candidates.append(Candidate(document_id, score))
        if stale:
            log.info("azure_hits_stale", workspace=scope.workspace, branch=scope.branch, stale=stale)
        lagging = watermark < max(visible.stream_seqs.values(), default=0)
        # Hidden ids read in another snapshot than the visibility: report that one, so the answer shows a mixed read.
        version = hidden_at if hidden_at is not None and hidden_at != visible.version else visible.version
        return Hits(candidates[:limit], version, lagging=lagging)

    async def _search(self, where: str, text: str, top: int) -> list[tuple[str, str, str, float]]:
        results = await self._client.search(
            search_text=escape_query(text), filter=where, select=["documentId", "branch", "contentMd5"], top=top
        )
        return [(r["documentId"], r["branch"], r["contentMd5"], float(r["@search.score"])) async for r in results]
