"""Lookups beside ``ontology_query``, answered by query workers over request-reply on per-workspace subjects: one
document by id (or a slice of it), and how far a workspace's index is behind its delta stream."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import Field

from ._base import StrictRequest, WireModel
from .documents import MAIN_BRANCH, STREAM_REFUSED, Branch, DocumentId, Workspace
from .query import MAX_TOKENS_LIMIT, MIN_MAX_TOKENS

MAX_OTHER_BRANCHES = 100
"""How many of a workspace's other branches a status reply names at most."""
MAX_SLICE_CHARS = 1_000_000


class DocumentRequest(StrictRequest):
    """One document as a query on the branch sees it (main ⊕ branch), whole or a slice of its content."""

    id: DocumentId = Field(description="The document's id, as a result of ontology_query gives it.")
    branch: Branch = Field(default=MAIN_BRANCH, description="Branch to read: main, or main overlaid with the branch.")
    offset: int = Field(
        default=0,
        ge=0,
        description="First character of the content to return; at most the content's length. Characters here are "
        "Unicode code points, as JSON Schema's maxLength counts them, not UTF-16 code units (a JavaScript string's "
        "length counts a character outside the BMP, an emoji, twice: count with Array.from(text).length).",
    )
    max_chars: int | None = Field(
        default=None,
        ge=1,
        le=MAX_SLICE_CHARS,
        description="Characters of content to return at most; default: as many as fit the answer budget (maxTokens), "
        "cut at a line's end.",
    )
    max_tokens: int | None = Field(
        default=None,
        ge=MIN_MAX_TOKENS,
        le=MAX_TOKENS_LIMIT,
        description="Size budget of the reply, in tokens (estimated at 4 bytes of JSON each): the content is cut at a "
        "line's end to fit it, with maxChars or without. Default: without maxChars, the deployment's "
        "(ONTOFABRIC_ANSWER_MAX_TOKENS, 8,000 unless set); with maxChars, none.",
    )
    workspace: Workspace | None = Field(
        default=None, description="Defaults to the workspace of the subject the request was sent to."
    )


class DocumentReply(WireModel):
    id: str
    object_type: str
    source_domain: str
    metadata: dict[str, Any]
    content: str = Field(description="The content from offset, at most maxChars characters (code points).")
    offset: int
    content_length: int = Field(
        description="The whole content's length in characters (code points); the next slice starts at offset plus "
        "content's length in code points."
    )
    truncated: bool = Field(description="True when content stops before the end of the text.")
    ontology_version: str = Field(description="Version of the data the document was read from.")
    slice_lines: list[int] | None = Field(
        default=None,
        min_length=2,
        max_length=2,
        description="The first and last line of the file that content spans (the last perhaps in part), when the "
        "document states its lines (metadata startLine) and its text is the file's own (not a docstring's); "
        "null otherwise, or for an empty slice.",
    )


class StatusRequest(StrictRequest):
    branch: Branch = Field(default=MAIN_BRANCH, description="Branch to report on (main is always reported too).")
    workspace: Workspace | None = Field(
        default=None, description="Defaults to the workspace of the subject the request was sent to."
    )


class BranchStatus(WireModel):
    """One branch's own deltas against the index's position."""

    branch: str
    ontology_version: str = Field(description="The branch's own version ('{streamSeq}-{stateHash}').")
    documents: int = Field(description="Live documents the branch itself holds (on a branch: its own rows).")
    hidden: int = Field(
        default=0,
        description="On a branch: main's live documents its tombstones hide, each by its id (a tombstone of an id "
        "main does not hold hides nothing). A file deleted on the branch hides main's later chunks of it too, which "
        "are not counted here. 0 on main, and from a worker older than this field.",
    )
    latest_seq: int | None = Field(description="The stream sequence of its last published delta; null when none.")
    pending_deltas: int = Field(description="Its deltas published past indexedSeq: not yet in the index.")
    pending_ms: float | None = Field(description="How long ago the oldest of them was published; null when none.")
    last_change: datetime | None = Field(description="When the projector last changed the branch's version.")


class StatusReply(WireModel):
    workspace: str
    branch: str
    ontology_version: str = Field(
        description="What a query on the branch reads now (main's, or main's + the branch's)."
    )
    indexed_seq: int = Field(
        description="The index's position: every delta up to this stream sequence (of any workspace) is in it, or "
        "dead-lettered."
    )
    branches: list[BranchStatus] = Field(description="main, and the branch when it is not main.")
    other_branches: list[str] = Field(
        default_factory=list,
        description="The workspace's other branches holding changes of their own, the latest changed first (the "
        f"first {MAX_OTHER_BRANCHES}): ask with one as branch to see it. A branch deleted (`ontofabric "
        "delete-branch`) is not named. Empty from a worker older than this field.",
    )
    more_branches: bool = Field(default=False, description="The workspace has more branches than otherBranches names.")
    pending_deltas: int = Field(description="Deltas of those branches not yet in the index.")
    stream_refused: bool = Field(default=False, description=STREAM_REFUSED)
    dead_letters: int = Field(
        description="The workspace's deltas dead-lettered and not re-driven or purged (all branches)."
    )
    embedding_model: str | None = Field(
        default=None,
        description="The model that made the vectors the index holds: a delta's embedding and tokenVectors must "
        "name it as embeddingModel (another is dead-lettered embedding_model_mismatch). Null from a worker "
        "older than this field.",
    )
    embedding_dimension: int | None = Field(
        default=None,
        description="Their dimension: an embedding's length and tokenVectors.dimension (another is dead-lettered "
        "embedding_dimension_mismatch, or token_vectors_dimension_mismatch). Null from a worker older than this field.",
    )
