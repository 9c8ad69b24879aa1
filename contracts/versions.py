"""The ontologyVersion announcement: the value in the versions KV bucket and the event after each commit."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from ._base import WireModel


class OntologyVersionChanged(WireModel):
    workspace: str
    branch: str
    ontology_version: str = Field(description="'{streamSeq}-{stateHash}'; equal states have equal versions.")
    stream_seq: int = Field(description="Highest stream sequence applied to this workspace and branch.")
    updated_at: datetime
