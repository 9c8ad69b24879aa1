"""The Azure AI Search projector: a second durable consumer of the delta stream keeps an Azure AI Search index of
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
import contextlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from azure.core.exceptions import (
    AzureError,
    HttpResponseError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.search.documents.aio import SearchClient
from azure.search.documents.indexes.aio import SearchIndexClient
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from ontofabric.contracts import DocumentUpserted
from ontofabric.shared.azure_search import (
    DOCUMENT,
    WATERMARK,
    WATERMARK_KEY,
    content_md5,
    entry_key,
    index_client,
    index_definition,
    read_watermark,
    search_client,
)
from ontofabric.shared.jetstream import BatchPuller, connect, ensure_jetstream
from ontofabric.shared.logging import get_logger
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names
from ontofabric.shared.telemetry import instruments, tracer

from .planning import Delta, EntityRef, Rejection, RowState, StateFold, entity_of, search_text, validate_delta
from .worker import dead_letter, limits_from, retry_later, start_delta_puller

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
    payload = delta.envelope.payload
    if isinstance(payload, DocumentUpserted):
        document, meta = payload.document, payload.document.metadata
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


def is_transient(error: BaseException) -> bool:
    """A failure a later try can get past: the connection, a timeout, throttling or a 5xx. A 4xx says the request
    itself is wrong (a bad key, a missing index) and is not retried as if it were the data's fault either."""
    if isinstance(error, HttpResponseError) and error.status_code is not None:
        return error.status_code in _TRANSIENT_STATUSES
    return isinstance(error, ServiceRequestError | ServiceResponseError | asyncio.TimeoutError | OSError)


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


class AzureProjector:
    """Validates each batch as the Postgres projector does, folds it onto what the index holds, uploads the entries
    that apply and acks; every second it records the ack floor as the watermark. A delta the index refuses is
    dead-lettered with the service's reason; a delta no projector can apply is left to the Postgres projector's
    dead letter (it sees the same stream), and only terminated here."""

    def __init__(
        self, index: AzureSearchIndex, js: JetStreamContext, names: Names, settings: Settings, watermark: int = 0
    ) -> None:
        self._index = index
        self._js = js
        self._names = names
        self._limits = limits_from(settings)
        self._metrics = instruments()
        self._watermark = watermark

    async def handle(self, messages: Sequence[Msg]) -> None:
        started = time.perf_counter()
        with tracer().start_as_current_span("projector.azure.batch") as span:
            span.set_attribute("batch.size", len(messages))
            accepted: list[tuple[Msg, Delta]] = []
            for msg in messages:
                outcome = validate_delta(msg.data, msg.subject, msg.metadata.sequence.stream, self._limits)
                if isinstance(outcome, Rejection):
                    await msg.term()
                    self._metrics.projector_deltas.add(1, {"outcome": "invalid", "index": INDEX})
                    log.info("delta_invalid_skipped", index=INDEX, seq=msg.metadata.sequence.stream)
                else:
                    accepted.append((msg, outcome))
            if accepted:
                await self._apply(accepted)
        self._metrics.projector_batch_duration.record((time.perf_counter() - started) * 1000, {"index": INDEX})

    async def _apply(self, accepted: list[tuple[Msg, Delta]]) -> None:
        deltas = [delta for _, delta in accepted]
        try:
            refs = [entity_of(d.envelope) for d in deltas]
            stored = await self._index.stored(sorted({r for r in refs if r.kind == "document"}))
            plan = plan_index_batch(deltas, stored)
            refused = await self._index.upload([entry for _, entry in plan.entries])
            retry = {key for key, (status, _) in refused.items() if status in _TRANSIENT_STATUSES}
            if retry:  # some entries were throttled: the whole batch comes back (what applied is a no-op then)
                raise HttpResponseError(message=f"{len(retry)} entries throttled, e.g. {refused[next(iter(retry))]}")
            # A refused document must not stay searchable in an older version: a tombstone at its sequence.
            stones = [tombstone(entry) for _, entry in plan.entries if entry["key"] in refused]
            if await self._index.upload(stones):
                raise HttpResponseError(message="the tombstones of refused entries were refused too")
        except Exception as error:
            await self._failed([msg for msg, _ in accepted], error)
            return
        refused_seqs = {delta.seq: refused[entry["key"]] for delta, entry in plan.entries if entry["key"] in refused}
        for msg, delta in accepted:
            if delta.seq in refused_seqs:
                status, message = refused_seqs[delta.seq]
                await dead_letter(self._js, self._names, msg, Rejection("index_refused", f"{status}: {message}"), INDEX)
            else:
                await msg.ack()
        applied = len(plan.entries) - len(refused_seqs)
        self._metrics.projector_deltas.add(applied, {"outcome": "applied", "index": INDEX})
        self._metrics.projector_deltas.add(len(plan.noops), {"outcome": "noop", "index": INDEX})
        log.info("batch_indexed", index=INDEX, applied=applied, noops=len(plan.noops), refused=len(refused_seqs))

    async def keep_watermark(self, every_s: float = WATERMARK_EVERY_S) -> None:
        """Every ``every_s``, off the batch path: the index may look behind by that long after a batch."""
        while True:
            await asyncio.sleep(every_s)
            await self._advance_watermark()

    async def _advance_watermark(self) -> None:
        """Record the consumer's ack floor: it passes a delta only once it was acked or terminated, so it never
        claims one still waiting for a retry."""
        try:
            info = await self._js.consumer_info(self._names.delta_stream, self._names.azure_projector_durable)
            floor = info.ack_floor.stream_seq if info.ack_floor and info.ack_floor.stream_seq else 0
            if floor > self._watermark:
                await self._index.set_watermark(floor)
                self._watermark = floor
        except Exception as error:  # the next batch tries again; a lagging watermark only understates
            log.warning("watermark_not_advanced", index=INDEX, error=f"{type(error).__name__}: {error}")

    async def _failed(self, messages: list[Msg], error: BaseException) -> None:
        """Every failure of a whole request is retried later: a transient one will pass, and one that is not (a
        wrong key, a deleted index) must not cost the deltas; it is logged as an error so someone looks."""
        if not is_transient(error):
            log.error("azure_request_failed", index=INDEX, error=f"{type(error).__name__}: {error}")
        await retry_later(messages, error, INDEX, MIN_RETRY_S)


async def _replay_if_index_lost(js: JetStreamContext, names: Names) -> None:
    """An index without a watermark behind a consumer that has delivered deltas was lost (deleted, or recreated
    empty), or never got its first watermark: the consumer starts over from the stream's first delta, which the
    sequence rule makes safe to apply again."""
    try:
        info = await js.consumer_info(names.delta_stream, names.azure_projector_durable)
    except NotFoundError:
        return
    # Delivered, not acked: with the first delta still being retried the ack floor stays 0 while later ones went in.
    if info.delivered is not None and (info.delivered.stream_seq or 0) > 0:
        log.warning("azure_index_lost_replaying", index=INDEX, delivered=info.delivered.stream_seq)
        await js.delete_consumer(names.delta_stream, names.azure_projector_durable)


class AzureProjectorService:
    """The Azure projector worker: creates or updates the index, then pulls from a durable consumer of its own."""

    def __init__(self, settings: Settings, nats_url: str) -> None:
        self.settings = settings
        self.names = Names(settings.subject_prefix)
        self._nats_url = nats_url
        self._nc: Client | None = None
        self._puller: BatchPuller | None = None
        self._clients: tuple[SearchIndexClient, SearchClient] | None = None
        self._watermarking: asyncio.Task[None] | None = None

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        settings, names = self.settings, self.names
        indexes, documents = self._clients = index_client(settings, RETRIES), search_client(settings, RETRIES)
        try:
            await indexes.create_or_update_index(index_definition(settings.azure_search_index))
        except AzureError as error:
            name = settings.azure_search_index
            raise RuntimeError(f"cannot create the Azure AI Search index {name!r}: {error}") from error
        nc = self._nc = await connect(self._nats_url, "ontofabric-projector-azure-search")
        js = nc.jetstream()
        await ensure_jetstream(js, names, settings)
        index = AzureSearchIndex(documents)
        watermark = await read_watermark(documents)
        if watermark is None:
            await _replay_if_index_lost(js, names)
        projector = AzureProjector(index, js, names, settings, watermark or 0)
        self._puller = await start_delta_puller(
            nc, names, settings, names.azure_projector_durable, projector.handle,
            min(settings.projector_batch_size, MAX_KEYS_PER_LOOKUP),
        )  # fmt: skip
        self._watermarking = asyncio.create_task(projector.keep_watermark(), name="azure-watermark")
        log.info("azure_projector_started", durable=names.azure_projector_durable, index=settings.azure_search_index)

    async def stop(self) -> None:
        puller, nc, clients, watermarking = self._puller, self._nc, self._clients, self._watermarking
        self._puller, self._nc, self._clients, self._watermarking = None, None, None, None
        if watermarking is not None:
            watermarking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watermarking
        async with contextlib.AsyncExitStack() as closing:
            for client in clients or ():
                closing.push_async_callback(client.close)
            if nc is not None:
                closing.push_async_callback(nc.close)
            if puller is not None:
                await puller.stop()
        log.info("azure_projector_stopped")
