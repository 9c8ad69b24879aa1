"""The Azure AI Search sink: a second projector, on a durable consumer of its own, keeps an Azure AI Search index of
the documents in step with the Postgres one (DESIGN.md, "Azure AI Search (optional)"; seed 000 §5.5).

Azure AI Search has no transactions and no conditional writes, so the rules that make the Postgres projector
idempotent are kept in the index itself: every document carries the stream sequence that wrote it, deletes and
branch reverts leave tombstones, and a delta applies only when it is newer than what the index holds (the
projector's own fold, :class:`StateFold`). A redelivered or older delta therefore changes nothing. An entry the
service refuses is dead-lettered and its document tombstoned at that sequence, so no older copy stays searchable.

One watermark entry holds the consumer's ack floor, recorded every second: every delta up to it has been taken in (or
refused, or could never apply). Readers compare it with the sequence of what Postgres shows, to tell whether the
index has caught up. A delta still being retried holds the floor back, for every workspace.

Only documents are indexed: graph nodes and links stay in Postgres. The index is written by one projector at a
time (a second one sharing the durable could reorder a document's writes across two batches in flight). Reads of
the index are near-real-time (about a second on the service), so a nak'd batch waits at least MIN_RETRY_S before
it comes back, by which time its later writes are visible to its lookup.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from azure.core.exceptions import HttpResponseError, ServiceRequestError, ServiceResponseError
from azure.search.documents.aio import SearchClient
from nats.js import JetStreamContext

from ontofabric.shared.azure_search import DOCUMENT, WATERMARK, WATERMARK_KEY, entry_key
from ontofabric.shared.checksums import content_md5
from ontofabric.shared.jetstream import ack_floor
from ontofabric.shared.logging import describe, get_logger
from ontofabric.shared.subjects import Names

from .consumer import restart_consumer
from .planning import Delta, EntityRef, Rejection, RowState, StateFold, entity_of, search_text, upserted_document
from .runner import Written

log = get_logger(__name__)

INDEX = "azure-ai-search"
"""The index this projector keeps: a label on its metrics and dead letters."""

MAX_KEYS_PER_LOOKUP = 1000
"""search.in over at most this many keys per request (the service pages results at 1,000)."""
MAX_REQUEST_BYTES = 8 * 1024 * 1024
"""Half the service's 16 MB request limit: headroom for the envelope."""
MAX_ENTRY_BYTES = 15 * 1024 * 1024
"""An entry larger than this, as the SDK sends it, cannot go in any request: it is refused before sending."""
WATERMARK_EVERY_S = 1.0
"""How often the watermark catches up with the ack floor between batches."""
MIN_RETRY_S = 2.0
"""Shortest wait before a nak'd batch comes back: past the service's refresh of what searches see."""
RETRIES = 2
"""The SDK's own retries of a failed call (429 with Retry-After, 5xx) before the batch is nak'd for later."""
READ_TIMEOUT_S = 30.0
"""How long the projector's calls wait for the service to send anything before the connection counts as lost
(and the call is retried): the SDK's default, 300 s, held a batch that long, three times over with its retries,
on a connection nothing answered on (an Azure path tester's), with no word said."""

# Statuses of a refused item that a later try can succeed with (throttling, the service busy or failing).
_TRANSIENT_STATUSES = frozenset({409, 422, 429, 500, 502, 503, 504})


def document_entry(ref: EntityRef, delta: Delta) -> dict[str, Any]:
    """The index entry a document delta leaves: the document, or a tombstone that remembers its sequence."""
    entry: dict[str, Any] = {
        "key": entry_key(ref.workspace, ref.branch, ref.key),
        "kind": DOCUMENT,
        "workspace": ref.workspace,
        "branch": ref.branch,
        "documentId": ref.key,
        "seq": delta.seq,
        "deleted": True,
        "content": "",
    }
    document = upserted_document(delta.envelope)
    if document is not None:
        meta = document.metadata
        entry |= {
            "deleted": False,
            "content": search_text(document),
            "contentMd5": content_md5(document.content),
            "objectType": document.object_type,
            "sourceDomain": document.source_domain,
            "symbolKey": meta.symbol_key,
            "symbolKind": meta.symbol_kind,
            "symbolFqn": meta.symbol_fqn,
            "contentHash": meta.content_hash,
            "filePath": meta.file_path,
            "chunkLevel": meta.chunk_level,
            "provenance": meta.provenance,
        }
    return entry


@dataclass
class IndexPlan:
    """What one batch writes to the index."""

    entries: list[tuple[Delta, dict[str, Any]]] = field(default_factory=list)
    """The last applying delta of each touched document, with the entry it uploads."""
    noops: list[Delta] = field(default_factory=list)


def plan_index_batch(deltas: Sequence[Delta], stored: Mapping[EntityRef, RowState]) -> IndexPlan:
    """Fold a batch onto what the index holds for the documents it touches (``stored``: their sequence and
    whether they are tombstones), with the projector's rule: only a newer delta applies."""
    plan = IndexPlan()
    fold = StateFold(stored)
    last: dict[EntityRef, Delta] = {}
    for delta in sorted(deltas, key=lambda d: d.seq):
        ref = entity_of(delta.envelope)
        if ref.kind != "document":
            continue  # graph rows live in Postgres only
        if fold.add(delta):
            last[ref] = delta
        else:
            plan.noops.append(delta)
    plan.entries = [(delta, document_entry(ref, delta)) for ref, delta in last.items()]
    return plan


def sent_size(entry: dict[str, Any]) -> int:
    """An entry's size in a request as the SDK writes it (JSON with non-ASCII characters escaped)."""
    return len(json.dumps(entry))


def upload_chunks(entries: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Entries in consecutive requests of at most 1,000 actions and about MAX_REQUEST_BYTES each: the service
    refuses larger ones (16 MB), and the SDK's own splitting of a refused request fails (azure-search-documents
    12.0.0, async client). An entry over MAX_REQUEST_BYTES goes alone."""
    chunks: list[list[dict[str, Any]]] = []
    size = 0
    for entry in entries:
        entry_size = sent_size(entry)
        if not chunks or len(chunks[-1]) >= MAX_KEYS_PER_LOOKUP or size + entry_size > MAX_REQUEST_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(entry)
        size += entry_size
    return chunks


def tombstone(entry: dict[str, Any]) -> dict[str, Any]:
    """The entry a refused document leaves: its identity and sequence, nothing searchable."""
    return {name: entry[name] for name in ("key", "kind", "workspace", "branch", "documentId", "seq")} | {
        "deleted": True,
        "content": "",
    }


class EntriesThrottled(Exception):
    """Some entries of a batch were answered with a status a later try can get past (a 207 whose items say 429 or
    503): the batch goes back, as for a throttled request."""


def is_transient(error: BaseException) -> bool:
    """A failure a later try can get past: the connection, a timeout, throttling or a 5xx. A 4xx says the request
    itself is wrong (a bad key, a missing index) and is not retried as if it were the data's fault either."""
    if isinstance(error, HttpResponseError) and error.status_code is not None:
        return error.status_code in _TRANSIENT_STATUSES
    transient = (EntriesThrottled, ServiceRequestError, ServiceResponseError, asyncio.TimeoutError, OSError)
    return isinstance(error, transient)


class AzureSearchIndex:
    """The adapter: reads what the index holds for a batch's documents, writes entries and the watermark."""

    def __init__(self, client: SearchClient) -> None:
        self._client = client

    async def stored(self, refs: Sequence[EntityRef]) -> dict[EntityRef, RowState]:
        by_key = {entry_key(r.workspace, r.branch, r.key): r for r in refs}
        found: dict[EntityRef, RowState] = {}
        keys = list(by_key)
        for start in range(0, len(keys), MAX_KEYS_PER_LOOKUP):
            chunk = keys[start : start + MAX_KEYS_PER_LOOKUP]
            results = await self._client.search(
                search_text="*",
                filter=f"search.in(key, '{','.join(chunk)}', ',')",  # keys never hold a comma or a quote
                select=["key", "seq", "deleted"],
                top=len(chunk),
            )
            async for row in results:
                found[by_key[row["key"]]] = RowState(seq=int(row["seq"]), deleted=bool(row["deleted"]))
        return found

    async def upload(self, entries: Sequence[dict[str, Any]]) -> dict[str, tuple[int, str]]:
        """Upload whole entries, in requests the service accepts; returns the refused ones: key -> (status,
        message). Raises when a whole request fails."""
        refused: dict[str, tuple[int, str]] = {}
        fitting = []
        for entry in entries:
            size = sent_size(entry)
            if size > MAX_ENTRY_BYTES:  # no request could carry it: the service would answer 413 for ever
                refused[entry["key"]] = (413, f"the entry is {size} bytes; a request may carry at most 16 MB")
            else:
                fitting.append(entry)
        for chunk in upload_chunks(fitting):
            results = await self._client.upload_documents(documents=chunk)
            refused |= {r.key: (r.status_code, r.error_message or "") for r in results if not r.succeeded}
        return refused

    async def set_watermark(self, seq: int) -> None:
        entry = {"key": WATERMARK_KEY, "kind": WATERMARK, "seq": seq, "deleted": True}
        refused = await self.upload([entry])
        if refused:
            status, message = refused[WATERMARK_KEY]
            raise HttpResponseError(message=f"watermark refused ({status}): {message}")


class AzureSink:
    """Folds each batch onto what the index holds and uploads the entries that apply. A delta the index refuses is
    refused for good (its document tombstoned, so no older copy stays searchable); a throttled entry sends the
    whole batch back for later (what applied is then a no-op)."""

    index = INDEX

    def __init__(self, index: AzureSearchIndex) -> None:
        self._index = index

    async def write(self, deltas: Sequence[Delta], redelivered: bool) -> Written:
        try:
            return await self._write(deltas)
        except Exception as error:
            if not is_transient(error):  # a wrong key, a deleted index: retried like the rest, but someone must look
                log.error("azure_request_failed", index=INDEX, error=describe(error))
            raise

    async def _write(self, deltas: Sequence[Delta]) -> Written:
        refs = {entity_of(d.envelope) for d in deltas}
        stored = await self._index.stored(sorted(r for r in refs if r.kind == "document"))
        plan = plan_index_batch(deltas, stored)
        refused = await self._index.upload([entry for _, entry in plan.entries])
        retry = {key for key, (status, _) in refused.items() if status in _TRANSIENT_STATUSES}
        if retry:
            # Not an error someone must look at (logged as one until an Azure path tester's): the service is busy.
            raise EntriesThrottled(f"{len(retry)} entries throttled, e.g. {refused[next(iter(retry))]}")
        # A refused document must not stay searchable in an older version: a tombstone at its sequence.
        if await self._index.upload([tombstone(entry) for _, entry in plan.entries if entry["key"] in refused]):
            raise HttpResponseError(message="the tombstones of refused entries were refused too")
        refusals = {
            delta.seq: Rejection("index_refused", "{}: {}".format(*refused[entry["key"]]))
            for delta, entry in plan.entries
            if entry["key"] in refused
        }
        applied = len(plan.entries) - len(refusals)
        log.info("batch_indexed", index=INDEX, applied=applied, noops=len(plan.noops), refused=len(refusals))
        return Written(applied=applied, noops=len(plan.noops), refused=refusals)

    def retryable(self, error: BaseException) -> bool:
        """Every failure of a whole request is retried later: a transient one will pass, and one that is not (a
        wrong key, a deleted index) must not cost the deltas."""
        return True

    async def settled(self) -> None:
        pass


class Watermark:
    """Keeps the index's watermark at the Azure consumer's position (its ack floor), every second, off the batch
    path: readers of the index compare it with what Postgres shows to tell whether the index has caught up."""

    def __init__(self, index: AzureSearchIndex, js: JetStreamContext, names: Names, recorded: int) -> None:
        self._index = index
        self._js = js
        self._names = names
        self._recorded = recorded

    async def keep(self, every_s: float = WATERMARK_EVERY_S) -> None:
        while True:
            await asyncio.sleep(every_s)
            await self.advance()

    async def advance(self) -> None:
        """The ack floor passes a delta only once it was acked or terminated, so it never claims one still
        waiting for a retry."""
        try:
            floor = await ack_floor(self._js, self._names.delta_stream, self._names.azure_projector_durable)
            if floor > self._recorded:
                await self._index.set_watermark(floor)
                self._recorded = floor
        except Exception as error:  # the next round tries again; a lagging watermark only understates
            log.warning("watermark_not_advanced", index=INDEX, error=describe(error))


async def replay_if_index_lost(js: JetStreamContext, names: Names) -> None:
    """An index without a watermark behind a consumer that has delivered deltas was lost (deleted, or recreated
    empty), or never got its first watermark: the consumer starts over from the stream's first delta, which the
    sequence rule makes safe to apply again (on a compacted stream, after the snapshots: worker.py)."""
    delivered = await restart_consumer(js, names, names.azure_projector_durable)
    if delivered:
        log.warning("azure_index_lost_replaying", index=INDEX, delivered=delivered)
