"""The lookups beside ontology_query: one document by id (or a slice of its content), and how far a workspace's
index is behind its delta stream. Documents come from Postgres; the index's position and what was published past it
from JetStream."""

from __future__ import annotations

from nats.js import JetStreamContext
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
from ontofabric.contracts.documents import MAX_LINE
from ontofabric.contracts.lookup import MAX_OTHER_BRANCHES
from ontofabric.shared.subjects import Names, encode_token

from .budget import BYTES_PER_TOKEN, cut_to, json_size, slice_lines
from .core import Scope
from .freshness import DeltaWatch, published_past
from .postgres import BranchState, PostgresDocuments


class DocumentNotFound(Exception):
    """No live document of that id on the branch."""


class OffsetPastEnd(ValueError):
    """A slice that starts after the content ends (at its end is an empty slice, the last page's follower)."""


class PositionUnavailable(Exception):
    """JetStream did not say how far the index is: the caller may try again."""


STATUS_POSITION_WAIT_S = 5.0
"""How long a status answer waits for the index's position, which is what it reports: a query goes on without it
after half a second, but a status that gave up as soon failed on a loaded machine (a CI run's, with the read slow)."""

MIN_DEFAULT_SLICE_BYTES = 1_000
"""The least of a document's text a slice without maxChars carries, however much its metadata takes."""


class Lookups:
    def __init__(
        self,
        documents: PostgresDocuments,
        freshness: DeltaWatch,
        js: JetStreamContext,
        names: Names,
        default_bytes: int,
    ) -> None:
        self._documents = documents
        self._freshness = freshness
        self._js = js
        self._names = names
        self._default_bytes = default_bytes
        """A slice asked for without maxChars takes at most this much of the reply, as JSON."""

    async def document(self, workspace: str, request: DocumentRequest) -> DocumentReply:
        fetched = await self._documents.fetch(Scope(workspace, request.branch), [request.id])
        document = fetched.documents.get(request.id)
        if document is None:
            said = f"no document {request.id!r} in workspace {workspace!r} on {request.branch!r}"
            if request.branch != MAIN_BRANCH and await self._on_main(workspace, request.id):
                # The branch deleted it, or its file: an agent on the branch read "no document" for one it had
                # just been given from main's answers (an outside tester's).
                said += (
                    "; the branch does not hold it (deleted on the branch, or added to main after the branch's "
                    "version of its file), and main does"
                    f" (ask with branch {MAIN_BRANCH!r})"
                )
            raise DocumentNotFound(said)
        if request.offset > len(document.content):
            raise OffsetPastEnd(
                f"offset {request.offset} is past the end of {request.id!r}: {len(document.content)} characters"
            )
        rest = document.content[request.offset :]
        reply = DocumentReply(
            id=document.id,
            object_type=document.object_type,
            source_domain=document.source_domain,
            metadata=document.metadata,
            content="",
            offset=request.offset,
            content_length=len(document.content),
            truncated=False,
            ontology_version=fetched.version,
            slice_lines=[MAX_LINE, MAX_LINE],  # its largest, measured in the envelope below; set after
        )
        content = rest[: request.max_chars] if request.max_chars else rest
        if request.max_tokens or not request.max_chars:
            # What the rest of the reply leaves of the budget (a tester's reply was 530 bytes over it); an MCP
            # gateway states one with a maxChars given alone: a maxChars of 200,000 made a 102,000-token result.
            budget = request.max_tokens * BYTES_PER_TOKEN if request.max_tokens else self._default_bytes
            envelope = len(reply.model_dump_json(by_alias=True).encode("utf-8")) - json_size("")
            content = cut_to(content, max(MIN_DEFAULT_SLICE_BYTES, budget - envelope))
        return reply.model_copy(
            update={
                "content": content,
                "truncated": len(content) < len(rest),
                "slice_lines": slice_lines(document.metadata, document.content, request.offset, len(content)),
            }
        )

    async def _on_main(self, workspace: str, document_id: str) -> bool:
        fetched = await self._documents.fetch(Scope(workspace, MAIN_BRANCH), [document_id])
        return document_id in fetched.documents

    async def status(self, workspace: str, request: StatusRequest) -> StatusReply:
        branches = [MAIN_BRANCH] if request.branch == MAIN_BRANCH else [MAIN_BRANCH, request.branch]
        # Before the versions, which hold every delta up to it; read now, not the last one: what a status reports.
        position = await self._freshness.position(STATUS_POSITION_WAIT_S, or_last=False)
        if position is None:
            raise PositionUnavailable("the index's position could not be read from JetStream")
        states = await self._documents.branch_states(workspace, branches)
        reports = [await self._branch_status(workspace, branch, states.of.get(branch), position) for branch in branches]
        versions = {r.branch: r.ontology_version for r in reports}
        own = versions.get(request.branch) if request.branch != MAIN_BRANCH else None
        return StatusReply(
            workspace=workspace,
            branch=request.branch,
            ontology_version=overlay_version(versions[MAIN_BRANCH], request.branch, own),
            indexed_seq=position,
            branches=reports,
            pending_deltas=sum(r.pending_deltas for r in reports),
            stream_refused=self._freshness.stream_refused(workspace),
            dead_letters=await self._dead_letters(workspace),
            embedding_model=states.embedding_model,
            embedding_dimension=states.embedding_dimension,
            other_branches=states.others[:MAX_OTHER_BRANCHES],
            more_branches=len(states.others) > MAX_OTHER_BRANCHES,
        )

    async def _branch_status(
        self, workspace: str, branch: str, state: BranchState | None, position: int
    ) -> BranchStatus:
        subject = self._names.delta_subject(workspace, branch)
        latest, pending = await published_past(self._js, self._names, subject, position)
        return BranchStatus(
            branch=branch,
            ontology_version=state.version if state is not None else NO_VERSION,
            documents=state.documents if state is not None else 0,
            hidden=state.hidden if state is not None else 0,
            latest_seq=latest,
            pending_deltas=pending.deltas,
            pending_ms=pending.oldest_ms,
            last_change=state.updated_at if state is not None else None,
        )

    async def _dead_letters(self, workspace: str) -> int:
        subject = self._names.dlq_subject(encode_token(workspace))
        try:
            state = (await self._js.stream_info(self._names.dlq_stream, subjects_filter=subject)).state
        except NotFoundError:  # the stream deleted under a running NATS: it holds none (`ontofabric status` says so)
            return 0
        return int((state.subjects or {}).get(subject, 0))
