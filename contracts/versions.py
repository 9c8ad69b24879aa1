"""The ontologyVersion announcement: the value in the versions KV bucket and the event after each commit."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from ._base import WireModel
from .documents import MAIN_BRANCH


def format_version(state_hash: int, stream_seq: int) -> str:
    """The ontologyVersion label: the highest stream sequence applied, then the 64-bit state hash in hex."""
    return f"{stream_seq}-{state_hash % (1 << 64):016x}"


NO_VERSION = format_version(0, 0)
"""The version of a workspace/branch nothing has been projected into."""


def overlay_version(main: str, branch: str, branch_version: str | None) -> str:
    """The ontologyVersion of what a query on ``branch`` reads: main's, or main's and the branch's delta's."""
    return main if branch == MAIN_BRANCH else f"{main}+{branch_version or NO_VERSION}"


def nothing_indexed(version: str) -> bool:
    """Whether an answer's ontologyVersion says its workspace and branch have no commit yet (a new workspace, or a
    name nobody has ingested into)."""
    return all(part == NO_VERSION for part in version.split("+"))


def main_only(version: str) -> bool:
    """Whether an answer on a branch read main alone: main has commits, the branch none of its own (a branch that
    nothing has been ingested into, or a misspelt name; the two look the same)."""
    parts = version.split("+")
    return len(parts) == 2 and parts[0] != NO_VERSION and parts[1] == NO_VERSION


class OntologyVersionChanged(WireModel):
    workspace: str
    branch: str
    ontology_version: str = Field(description="'{streamSeq}-{stateHash}'; equal states have equal versions.")
    stream_seq: int = Field(
        description="Highest stream sequence applied to this workspace and branch. Not a watermark: after a retry,"
        " lower sequences may still be pending; wait on the projector's consumer ack floor for read-your-writes."
    )
    revision: int = Field(description="Commits that changed this version; later announcements have higher ones.")
    updated_at: datetime
