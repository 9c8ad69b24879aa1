"""The lookups beside ontology_query: one document by id (or a slice of its content), and how far a workspace's
index is behind its delta stream. Documents and positions come from Postgres, what was published from JetStream."""

from __future__ import annotations

from datetime import UTC, datetime

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from ontofabric.contracts import (
    MAIN_BRANCH,
    NO_VERSION,
    BranchStatus,
    DocumentReply,
    DocumentRequest,
    StatusReply,
    StatusRequest,
    overlay_version,
)
from ontofabric.shared.subjects import Names, encode_token

from .core import Scope
from .postgres import BranchState, PostgresDocuments


class DocumentNotFound(Exception):
    """No live document of that id on the branch."""


class Lookups:
    def __init__(self, documents: PostgresDocuments, js: JetStreamContext, names: Names, default_chars: int) -> None:
        self._documents = documents
        self._js = js
        self._names = names
        self._default_chars = default_chars

    async def document(self, workspace: str, request: DocumentRequest) -> DocumentReply:
        fetched = await self._documents.fetch(Scope(workspace, request.branch), [request.id])
        document = fetched.documents.get(request.id)
        if document is None:
            raise DocumentNotFound(f"no document {request.id!r} in workspace {workspace!r} on {request.branch!r}")
        end = request.offset + (request.max_chars or self._default_chars)
        return DocumentReply(
            id=document.id,
            object_type=document.object_type,
            source_domain=document.source_domain,
            metadata=document.metadata,
            content=document.content[request.offset : end],
            offset=request.offset,
            content_length=len(document.content),
            truncated=end < len(document.content),
            ontology_version=fetched.version,
        )

    async def status(self, workspace: str, request: StatusRequest) -> StatusReply:
        branches = [MAIN_BRANCH] if request.branch == MAIN_BRANCH else [MAIN_BRANCH, request.branch]
        states = await self._documents.branch_states(workspace, branches)
        reports = [await self._branch_status(workspace, branch, states.get(branch)) for branch in branches]
        versions = {r.branch: r.ontology_version for r in reports}
        own = versions.get(request.branch) if request.branch != MAIN_BRANCH else None
        return StatusReply(
            workspace=workspace,
            branch=request.branch,
            ontology_version=overlay_version(versions[MAIN_BRANCH], request.branch, own),
            branches=reports,
            pending_deltas=sum(r.pending_deltas for r in reports),
            dead_letters=await self._dead_letters(workspace),
        )

    async def _branch_status(self, workspace: str, branch: str, state: BranchState | None) -> BranchStatus:
        indexed = state.handled_seq if state is not None else 0
        subject = self._names.delta_subject(workspace, branch)
        latest = await self._last_seq(subject)
        pending, oldest = await self._published_after(subject, indexed) if (latest or 0) > indexed else (0, None)
        return BranchStatus(
            branch=branch,
            ontology_version=state.version if state is not None else NO_VERSION,
            documents=state.documents if state is not None else 0,
            indexed_seq=indexed,
            latest_seq=latest,
            pending_deltas=pending,
            pending_ms=None if oldest is None else round((datetime.now(UTC) - oldest).total_seconds() * 1000, 1),
            last_change=state.updated_at if state is not None else None,
        )

    async def _last_seq(self, subject: str) -> int | None:
        try:
            return (await self._js.get_last_msg(self._names.delta_stream, subject)).seq
        except NotFoundError:
            return None

    async def _published_after(self, subject: str, seq: int) -> tuple[int, datetime | None]:
        """How many of the subject's deltas follow ``seq`` in the stream, and when the first was published: a
        consumer of its own, made and removed here, counts them."""
        stream = self._names.delta_stream
        first = await self._js.get_msg(stream, seq=seq + 1, subject=subject, next=True)
        consumer = await self._js.add_consumer(
            stream,
            ConsumerConfig(
                filter_subject=subject,
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=seq + 1,
                ack_policy=AckPolicy.NONE,
                inactive_threshold=10.0,
                mem_storage=True,
            ),
        )
        try:
            return int(consumer.num_pending or 0), first.time
        finally:
            assert consumer.name is not None
            await self._js.delete_consumer(stream, consumer.name)

    async def _dead_letters(self, workspace: str) -> int:
        subject = self._names.dlq_subject(encode_token(workspace))
        state = (await self._js.stream_info(self._names.dlq_stream, subjects_filter=subject)).state
        return int((state.subjects or {}).get(subject, 0))
