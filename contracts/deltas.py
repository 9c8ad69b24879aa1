"""The delta envelope ingesters publish onto JetStream, one event per message.

An event id is unique within its workspace; ``<workspace>:<eventId>:<session>`` is the ``Nats-Msg-Id`` header, with
a random part the publisher draws once (JetStream dedupes across the whole stream, every workspace's deltas together,
and a foreseeable id could be taken by another tenant), so JetStream drops an event the same publisher sends again
inside its duplicate window; the projector's handled event ids make every other repeat a no-op.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, ClassVar, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator
from pydantic.config import JsonDict

from ._base import WireModel
from .documents import (
    MAIN_BRANCH,
    NAME_CHARACTER,
    NAME_START,
    OBJECT_TYPE,
    Branch,
    DocumentId,
    ObjectType,
    SemanticDocument,
    Text,
    Workspace,
)

SCHEMA_VERSION = 1

EntityKind = Literal["document", "node", "link"]
"""What a delta writes: a document, a graph node or a link (one row of a workspace's branch)."""
Effect = Literal["live", "removed", "reverted"]
"""What the row is after the delta: live, a tombstone, or (on a branch) transparent, letting main's show through."""


def _type_required(schema: JsonDict) -> None:
    """``type`` picks the payload's kind, so the wire needs it (a tester's ajv passed a payload without it, which the
    projector dead-lettered); in Python it defaults to the class's own."""
    required = schema.setdefault("required", [])
    assert isinstance(required, list)
    if "type" not in required:
        required.insert(0, "type")


class Payload(WireModel):
    """One kind of delta payload, told apart by ``type``."""

    model_config = ConfigDict(json_schema_extra=_type_required)


def _top_level_name_starts_as_an_object_type(schema: JsonDict) -> None:
    """Without a domain the name is the object type, which starts with a letter or _."""
    schema["if"] = {"anyOf": [{"not": {"required": ["domain"]}}, {"properties": {"domain": {"const": ""}}}]}
    schema["then"] = {"properties": {"name": {"pattern": f"^{NAME_START}"}}}


class OntologyNode(WireModel):
    """An object type of the ontology graph (a module, class, interface ...). Its objectType is ``domain.name`` (the
    name alone without a domain), at most 512 characters: a domain and name longer together are refused."""

    # The patterns say in the schema what the objectType's check refused unsaid: a producer validating by the
    # schema sent names with spaces and had them dead-lettered (a contract tester's).
    model_config = ConfigDict(json_schema_extra=_top_level_name_starts_as_an_object_type)

    domain: Text = Field(
        default="",
        max_length=256,
        pattern=f"^(?:{NAME_START}{NAME_CHARACTER}*)?$",
        description="Empty for a top-level type (its objectType is the name).",
    )
    name: Text = Field(
        min_length=1,
        max_length=256,
        pattern=f"^{NAME_CHARACTER}+$",
        description="Letters, digits, _ . $ - (ASCII), and characters past ASCII but controls, spaces, separators "
        "and what shows nothing (zero-width characters, direction marks, variation selectors); without a domain, a "
        "letter or _ first. With the domain, at most 511 characters.",
    )
    kind: Text = Field(min_length=1, max_length=64, description="class, interface, module, ...")
    interfaces: list[ObjectType] = Field(
        default_factory=list, description="Object types this type implements or derives from."
    )
    description: Text | None = None

    @property
    def object_type(self) -> str:
        return f"{self.domain}.{self.name}" if self.domain else self.name

    @model_validator(mode="after")
    def _names_an_object_type(self) -> OntologyNode:
        # Its row is keyed by the object type: one no removal, revert or link can name would stay for good.
        try:
            OBJECT_TYPE.validate_python(self.object_type)
        except ValidationError:
            raise ValueError(
                f"domain and name make the objectType {self.object_type[:100]!r}, which is none: a letter or _ "
                "first, then letters, digits, _ . $ -, and characters past ASCII but spaces, separators, controls and "
                "what shows nothing (at most 512)"
            ) from None
        return self


LINK_KEY_SEPARATOR = "|"
"""Between a link's source type, name and target type in its key (none of them can hold it)."""
INHERITS, IMPORTS, CALLS = "inherits", "imports", "calls"
"""Link names the reference ingester gives; a question for a module's importers follows the imports links."""


def link_key(source_type: str, name: str, target_type: str) -> str:
    """The key that identifies a link within a workspace and branch."""
    return LINK_KEY_SEPARATOR.join((source_type, name, target_type))


def split_link_key(key: str) -> tuple[str, str, str]:
    """(source type, name, target type) of a link key."""
    source_type, name, target_type = key.split(LINK_KEY_SEPARATOR, 2)
    return source_type, name, target_type


class OntologyLink(WireModel):
    source_type: ObjectType
    name: str = Field(
        pattern=r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$", description="Link name, e.g. inherits, imports, calls."
    )
    target_type: ObjectType

    @property
    def key(self) -> str:
        return link_key(self.source_type, self.name, self.target_type)


class DocumentUpserted(Payload):
    type: Literal["document.upserted"] = "document.upserted"
    document: SemanticDocument

    entity: ClassVar[EntityKind] = "document"
    effect: ClassVar[Effect] = "live"

    @property
    def entity_key(self) -> str:
        return self.document.id


class DocumentDeleted(Payload):
    type: Literal["document.deleted"] = "document.deleted"
    document_id: DocumentId
    deleted_file: Text | None = Field(
        default=None,
        min_length=1,
        max_length=4096,  # a path as long as Linux allows: each branch snapshot reads these back
        description="On a branch: the document's file (its filePath), which the branch deleted whole; a query on the "
        "branch then hides main's documents of that file, those main adds later too. Without it, a branch tombstone "
        "hides main's document of its id only. Ignored on main. An index key, as a document's filePath is.",
    )

    entity: ClassVar[EntityKind] = "document"
    effect: ClassVar[Effect] = "removed"

    @property
    def entity_key(self) -> str:
        return self.document_id


class DocumentReverted(Payload):
    """On a branch: the branch no longer changes this document, main's version shows through again.

    Unlike a delete (a tombstone that hides main's document on the branch), a revert leaves nothing on the branch.
    On main it removes the document like a delete.
    """

    type: Literal["document.reverted"] = "document.reverted"
    document_id: DocumentId

    entity: ClassVar[EntityKind] = "document"
    effect: ClassVar[Effect] = "reverted"

    @property
    def entity_key(self) -> str:
        return self.document_id


class NodeUpserted(Payload):
    type: Literal["node.upserted"] = "node.upserted"
    node: OntologyNode

    entity: ClassVar[EntityKind] = "node"
    effect: ClassVar[Effect] = "live"

    @property
    def entity_key(self) -> str:
        return self.node.object_type


class NodeRemoved(Payload):
    type: Literal["node.removed"] = "node.removed"
    object_type: ObjectType

    entity: ClassVar[EntityKind] = "node"
    effect: ClassVar[Effect] = "removed"

    @property
    def entity_key(self) -> str:
        return self.object_type


class NodeReverted(Payload):
    """On a branch: main's node shows through again (see DocumentReverted)."""

    type: Literal["node.reverted"] = "node.reverted"
    object_type: ObjectType

    entity: ClassVar[EntityKind] = "node"
    effect: ClassVar[Effect] = "reverted"

    @property
    def entity_key(self) -> str:
        return self.object_type


class LinkAdded(Payload):
    type: Literal["link.added"] = "link.added"
    link: OntologyLink

    entity: ClassVar[EntityKind] = "link"
    effect: ClassVar[Effect] = "live"

    @property
    def entity_key(self) -> str:
        return self.link.key


class LinkRemoved(Payload):
    type: Literal["link.removed"] = "link.removed"
    link: OntologyLink

    entity: ClassVar[EntityKind] = "link"
    effect: ClassVar[Effect] = "removed"

    @property
    def entity_key(self) -> str:
        return self.link.key


class LinkReverted(Payload):
    """On a branch: main's link (or its absence) shows through again (see DocumentReverted)."""

    type: Literal["link.reverted"] = "link.reverted"
    link: OntologyLink

    entity: ClassVar[EntityKind] = "link"
    effect: ClassVar[Effect] = "reverted"

    @property
    def entity_key(self) -> str:
        return self.link.key


DeltaPayload = Annotated[
    DocumentUpserted
    | DocumentDeleted
    | DocumentReverted
    | NodeUpserted
    | NodeRemoved
    | NodeReverted
    | LinkAdded
    | LinkRemoved
    | LinkReverted,
    Field(discriminator="type"),
]


class DeltaEnvelope(WireModel):
    event_id: Text = Field(
        min_length=1,
        max_length=128,
        description="Unique per event within its workspace; sent as Nats-Msg-Id <workspace>:<eventId>:<session>.",
    )
    workspace: Workspace
    branch: Branch = MAIN_BRANCH
    # Read loosely, as it always was (epoch seconds, a time without offset, "1" for the version): nothing reads the
    # time, and deltas a release stored before are judged again by a replay, a rebuild or a compaction, which would
    # refuse what the index holds (a contract tester found these applied; the schema states the strict form).
    occurred_at: datetime = Field(
        description="When the change happened, as RFC 3339 with its offset (2026-12-07T08:00:00Z). Informational: "
        "deltas apply in the order the stream stores them, whatever their occurredAt."
    )
    schema_version: int = Field(
        default=SCHEMA_VERSION,
        ge=1,
        le=SCHEMA_VERSION,
        description="The envelope's version; a later one than this build reads is refused (dead-lettered), not "
        "read as this one.",
    )
    producer: Text = Field(min_length=1, max_length=128, description="Who published the event.")
    payload: DeltaPayload
