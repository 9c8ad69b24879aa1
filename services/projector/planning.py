"""Pure projection logic: which deltas a batch rejects, which it applies, and how ontologyVersions move.

No I/O here. The Postgres adapter reads the current row states, asks :func:`plan_batch` what to write, and
writes exactly that in one transaction.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field
from typing import Literal

from pydantic import ValidationError

from ontofabric.contracts import DeltaEnvelope, DocumentUpserted, EntityKind, SemanticDocument, format_version
from ontofabric.contracts.deltas import NodeUpserted
from ontofabric.contracts.query import clipped
from ontofabric.shared.analysis import analyse
from ontofabric.shared.half_characters import unreadable_text
from ontofabric.shared.jetstream import (
    MAX_DELTA_MESSAGE_BYTES,
    UNREADABLE_HEADERS,
    server_answer_headers,
)
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import encode_token

RejectReason = Literal[
    "oversized",
    "invalid_schema",
    "subject_mismatch",
    "content_too_large",
    "embedding_dimension_mismatch",
    "embedding_model_mismatch",
    "token_vectors_dimension_mismatch",
    "apply_failed",
    "index_refused",
    "event_id_reused",
]

_HASH_MOD = 1 << 64


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int
    max_content_bytes: int
    embedding_dim: int
    embedding_model: str
    reembeddable: frozenset[str] = frozenset()
    """Models whose documents are embedded again by the index's (services/projector/reembedding.py), not refused."""

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        """The deployment's limits: a delta outside them can never apply."""
        return cls(
            max_message_bytes=MAX_DELTA_MESSAGE_BYTES,
            max_content_bytes=settings.max_content_bytes,
            embedding_dim=settings.embedding_dim,
            embedding_model=settings.embedding_model,
        )


@dataclass(frozen=True)
class Delta:
    """A delta that passed validation, with the stream sequence that orders it."""

    seq: int
    envelope: DeltaEnvelope
    unnamed_vector_dropped: bool = False
    """Its document came with a vector of no named model, which is not used (:func:`validate_delta`)."""
    stored: tuple[str, bytes] | None = None
    """Its subject and bytes as the stream holds them: a batch records a digest of its last delta's
    (following.py)."""
    reembedded: str | None = None
    """The model that embedded its document again, the index's (a model change): its vectors are the projector's
    own, not the stream's, and made again they may differ in their last bits (reembedding.py)."""


@dataclass(frozen=True)
class Rejection:
    reason: RejectReason
    detail: str


def validate_delta(
    data: bytes, subject: str, seq: int, limits: Limits, headers: Mapping[str, str] | None = None
) -> Delta | Rejection:
    """Decide whether a raw message can ever apply. A Rejection is final: the message is dead-lettered (a server's
    answer stored on a delta subject, :data:`SERVER_ANSWER`, is dropped). ``headers``: the message's as stored."""
    if server_answer_headers(headers):
        return Rejection("invalid_schema", SERVER_ANSWER)
    if headers and UNREADABLE_HEADERS in headers:
        return Rejection("invalid_schema", f"its NATS headers cannot be read ({headers[UNREADABLE_HEADERS]})")
    if len(data) > limits.max_message_bytes:
        return Rejection("oversized", f"message is {len(data)} bytes, limit {limits.max_message_bytes}")
    try:
        envelope = DeltaEnvelope.model_validate_json(data)
    except ValidationError as error:
        if server_answer_body(data):
            return Rejection("invalid_schema", SERVER_ANSWER)
        return Rejection("invalid_schema", _unreadable_text(error, data) or _summarise(error))
    # Exactly <prefix>.delta.<workspace>.<branch>: a subject with more tokens between names another workspace
    # to whatever reads the tokens after "delta" (partition placement, a rebuild's replay).
    expected = f"{encode_token(envelope.workspace)}.{encode_token(envelope.branch)}"
    if subject.partition(".delta.")[2] != expected:
        return Rejection(
            "subject_mismatch",
            f"subject {subject!r} does not name workspace {envelope.workspace!r} / branch {envelope.branch!r}, "
            f"whose subject ends .delta.{expected}",
        )
    document = upserted_document(envelope)
    dropped = False
    if (
        document is not None
        and document.embedding is not None
        and document.embedding_model is None
        and len(document.embedding) == limits.embedding_dim  # another width is refused as ever (below)
    ):
        # Another model's vector of the same width could not be told from this one's (a tester's was indexed as
        # such): not used, and the document indexed as one sent without. Not refused: such deltas were applied
        # before, and a replay, a rebuild or a compaction judges the stream's deltas as the projector does now.
        document = document.model_copy(update={"embedding": None})
        envelope = envelope.model_copy(update={"payload": DocumentUpserted(document=document)})
        dropped = True
    if document is not None:
        problem = _document_problem(document, limits)
        if problem is not None:
            return problem
    if isinstance(envelope.payload, NodeUpserted) and envelope.payload.node.description is not None:
        # Bounded as a document's content is: an operator's 900,000-byte description was stored whole.
        size = len(envelope.payload.node.description.encode("utf-8"))
        if size > limits.max_content_bytes:
            return Rejection("content_too_large", f"node description is {size} bytes, limit {limits.max_content_bytes}")
    return Delta(seq=seq, envelope=envelope, unnamed_vector_dropped=dropped, stored=(subject, data))


SERVER_ANSWER = "a NATS server's answer to a request that named this subject as its reply, not a delta"
_ACKNOWLEDGEMENT_KEYS = frozenset({"stream", "seq", "domain", "duplicate", "error"})


def server_answer_body(data: bytes) -> bool:
    """Whether a body that is no delta is what JetStream answers a request with: a publish's acknowledgement (its
    error answer too, which a publish asks for with a header) or an API answer (a consumer's info). The server sends
    it to the reply subject the requester named, whatever that is, so no permission stops it: one tenant's
    publishes naming another's delta subject stored their acknowledgements there, and each, dead-lettered in that
    tenant's share, pushed out one of its own dead letters (an outside tester's). It holds nothing to keep.

    Parsed once, as a JSON object of at most 64 KiB: nested past what the parser reads it is none (100,000
    brackets stopped the batch with a RecursionError, the test suite's)."""
    if len(data) > 64 * 1024 or not data.lstrip().startswith(b"{"):
        return False
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        return False
    if not isinstance(body, dict):
        return False
    if str(body.get("type", "")).startswith("io.nats.jetstream.api.v1."):
        return True
    return (
        "stream" in body
        and body.keys() <= _ACKNOWLEDGEMENT_KEYS
        and isinstance(body["stream"], str)
        and (isinstance(body.get("seq"), int) or isinstance(body.get("error"), dict))
    )


def embedded_by_another(document: SemanticDocument, model: str) -> bool:
    """Whether the document carries vectors that another model than ``model`` made, by its own account."""
    return document.embedding is not None and document.embedding_model not in (None, model)


def upserted_document(envelope: DeltaEnvelope) -> SemanticDocument | None:
    """The document a delta writes, when it upserts one."""
    return envelope.payload.document if isinstance(envelope.payload, DocumentUpserted) else None


INDEX_KEY_BYTES = 2000
"""About what PostgreSQL's btree takes of one key (a third of a page, 2,704 bytes, after compression, with the
workspace and branch): a longer symbol key or qualified name may be refused when the statement runs."""


INDEX_ROW_TOO_LARGE = "54000"
"""PostgreSQL's SQLSTATE program_limit_exceeded: among others, an index entry larger than the index takes."""


def long_index_keys(delta: Delta, error: BaseException) -> str:
    """When the database refused an upserted document for an index entry too large, and its symbol key or the
    last part of its qualified name (what infra/migrations/0014 indexes) is longer than an index key may be: what
    to say beside the refusal, which names no field (a fault tester's 12 kB name); '' otherwise. Not refused before
    the statement: names as long that compress well were applied, and are in streams and snapshots."""
    document = upserted_document(delta.envelope)
    if document is None or getattr(error, "sqlstate", None) != INDEX_ROW_TOO_LARGE:
        return ""
    fqn = document.metadata.symbol_fqn
    keys = {
        "metadata.symbolKey": document.metadata.symbol_key,
        "metadata.symbolFqn's last part": None if fqn is None else fqn.rsplit(".", 1)[-1],
    }
    sizes = {name: len(key.encode("utf-8")) for name, key in keys.items() if key is not None}
    named = [f"{name} is {size} bytes" for name, size in sizes.items() if size > INDEX_KEY_BYTES]
    if not named:
        return ""
    return f" ({', '.join(named)}: {LONG_INDEX_KEY_NOTE} {INDEX_KEY_BYTES} bytes at most)"


LONG_INDEX_KEY_NOTE = "an index key takes about"
"""What :func:`long_index_keys` says: an ``apply_failed`` dead letter whose detail holds it was refused for what
its delta holds, and a re-drive of the same bytes is refused again."""


def refused_for_a_long_key(reason: str, detail: str | None) -> bool:
    """Whether a dead letter was refused for a name longer than an index key takes (:func:`long_index_keys`)."""
    return reason == "apply_failed" and detail is not None and LONG_INDEX_KEY_NOTE in detail


def _document_problem(document: SemanticDocument, limits: Limits) -> Rejection | None:
    size = len(document.content.encode("utf-8"))
    if size > limits.max_content_bytes:
        return Rejection("content_too_large", f"content is {size} bytes, limit {limits.max_content_bytes}")
    if embedded_by_another(document, limits.embedding_model) and document.embedding_model in limits.reembeddable:
        return None  # its vectors are replaced before it is written
    if document.embedding is not None and len(document.embedding) != limits.embedding_dim:
        return Rejection(
            "embedding_dimension_mismatch",
            f"embedding has {len(document.embedding)} dimensions, the deployment uses {limits.embedding_dim}",
        )
    if document.embedding is not None and document.embedding_model != limits.embedding_model:
        return Rejection(
            "embedding_model_mismatch",
            f"embedding made by {document.embedding_model!r}, the deployment uses {limits.embedding_model!r}",
        )
    tokens = document.token_vectors
    if tokens is not None and tokens.dimension != limits.embedding_dim:
        return Rejection(
            "token_vectors_dimension_mismatch",
            f"token vectors have {tokens.dimension} dimensions, the deployment uses {limits.embedding_dim}",
        )
    if tokens is not None and document.embedding_model != limits.embedding_model:
        # Another model's tokens of the same width would be compared with this model's query tokens: noise.
        made_by = "of no named model" if document.embedding_model is None else f"made by {document.embedding_model!r}"
        return Rejection(
            "embedding_model_mismatch",
            f"token vectors {made_by} (embeddingModel), the deployment uses {limits.embedding_model!r}",
        )
    return None


def _unreadable_text(error: ValidationError, data: bytes) -> str | None:
    """Where a delta that is no JSON pydantic reads holds text no JSON may (``unreadable_text``): a JavaScript
    client's lone surrogate was dead-lettered as "unexpected end of hex escape", though the JSON's grammar allows
    it; None for anything else."""
    found = unreadable_text(data, error)
    if found is None:
        return None
    place = "<body>" if found[0] is None else clipped(found[0]) or "<a key>"
    return f"{place}: {found[1]}"


def _summarise(error: ValidationError, limit: int = 5) -> str:
    problems = [f"{_place(e['loc']) or '<body>'}: {e['msg']}" for e in error.errors()[:limit]]
    more = error.error_count() - len(problems)
    return "; ".join(problems) + (f" (+{more} more)" if more > 0 else "")


def _place(loc: tuple[int | str, ...]) -> str:
    """A field's dotted path as the delta writes it: without the payload's type, which pydantic puts in after
    ``payload`` (``payload.document.upserted.document.content``, where the checks of text named
    ``payload.document.content``: a fault harness's); a payload's type has a dot, a field's name none."""
    parts = [str(part) for part in loc]
    if len(parts) > 1 and parts[0] == "payload" and "." in parts[1]:
        del parts[1]
    return ".".join(parts)


# ----------------------------------------------------------------------------------------- planning


@dataclass(frozen=True, order=True)
class EntityRef:
    """The row a delta writes: a document, a graph node or a link, within one workspace and branch."""

    workspace: str
    branch: str
    kind: EntityKind
    key: str


@dataclass(frozen=True)
class RowState:
    seq: int
    deleted: bool
    transparent: bool = False
    """A reverted branch row: invisible, and it hides nothing of main (it only remembers its sequence)."""


def entity_of(envelope: DeltaEnvelope) -> EntityRef:
    """The row a delta writes (each payload type says which: contracts/deltas.py)."""
    payload = envelope.payload
    return EntityRef(envelope.workspace, envelope.branch, payload.entity, payload.entity_key)


HandledEvent = tuple[str, str]
"""(workspace, event id): an event id is unique within its workspace only; two tenants may use the same one."""


def handled_event(delta: Delta) -> HandledEvent:
    return delta.envelope.workspace, delta.envelope.event_id


@dataclass(frozen=True)
class Handled:
    """How an event was handled: the stream sequence of the delta that carried it, and that delta's
    :func:`payload_digest` (None for events handled before the index kept digests: infra/migrations/0020)."""

    seq: int
    digest: str | None


_DERIVED_FIELDS = {"embedding", "embedding_model", "token_vectors", "second_vector", "indexed_at"}
"""A document's fields made from the rest (the same text embedded twice may differ in the last bits) or said
about it: two copies of one event may differ in them."""


REUSED_DETAIL = (
    "its event id was handled at stream seq {seq} with another payload: a copy of an event repeats it; the producer "
    "reused the id"
)
"""An ``event_id_reused`` dead letter's detail; a re-drive reads the sequence back from it
(services/ops/dead_letters.py)."""


def payload_digest(envelope: DeltaEnvelope) -> str:
    """What an event changes: its branch and payload, without a document's derived fields, as JSON reads it: free
    metadata's keys in any order, a whole number written ``1.0`` or ``1`` (RFC 8259 tells neither apart), a null
    member or none. A copy
    of an event (the same id stored again) carries the same, whichever client serialised it; another payload under
    a handled id is an id reused. A delivery-order tester's copies, their free keys sorted or their numbers written
    by JavaScript, were dead-lettered ``event_id_reused``."""
    payload = envelope.payload
    exclude = {"document": _DERIVED_FIELDS} if isinstance(payload, DocumentUpserted) else None
    read = _as_json_reads(payload.model_dump(mode="json", by_alias=True, exclude=exclude))
    text = f"{envelope.branch}\n{json.dumps(read, sort_keys=True, separators=(',', ':'), ensure_ascii=False)}"
    return hashlib.sha256(text.encode(errors="surrogatepass")).hexdigest()[:32]


def earlier_payload_digest(envelope: DeltaEnvelope) -> str:
    """:func:`payload_digest` as releases before 2026-12-05 made it (the payload's keys as they came, its numbers as
    written), which the index holds for the events they handled: a copy of one of those is still a copy."""
    payload = envelope.payload
    exclude = {"document": _DERIVED_FIELDS} if isinstance(payload, DocumentUpserted) else None
    text = f"{envelope.branch}\n{payload.model_dump_json(by_alias=True, exclude=exclude)}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _as_json_reads(value: object) -> object:
    """``value`` with every whole number a float holds as an int (``1.0`` as ``1``), and an object's null members
    left out, as the index stores them (a client that leaves nulls out sends the same event; a review's); objects
    are sorted where they are written out."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: _as_json_reads(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_as_json_reads(item) for item in value]
    return value


def state_after(delta: Delta) -> RowState:
    """The row a delta leaves behind: live, a tombstone, or (a revert) a transparent marker."""
    effect = delta.envelope.payload.effect
    return RowState(seq=delta.seq, deleted=effect != "live", transparent=effect == "reverted")


def row_hash(ref: EntityRef, state: RowState) -> int:
    digest = hashlib.sha256(
        json.dumps([ref.kind, ref.key, state.seq, state.deleted, state.transparent], separators=(",", ":")).encode()
    ).digest()
    return int.from_bytes(digest[:8], "big")


@dataclass(frozen=True)
class VersionState:
    """What an ontologyVersion is made of: a hash of the projected rows and the highest sequence applied."""

    state_hash: int = 0
    stream_seq: int = 0

    @property
    def label(self) -> str:
        return format_version(self.state_hash, self.stream_seq)


@dataclass
class Plan:
    writes: dict[EntityRef, Delta] = field(default_factory=dict)
    """The last applying delta of each touched row: what the row holds after the batch."""
    applied: list[Delta] = field(default_factory=list)
    noops: list[Delta] = field(default_factory=list)
    reused: dict[int, Handled] = field(default_factory=dict)
    """Deltas by stream sequence whose event id was handled with another payload (how it was), left out of the
    fold: set aside, not dropped as repeats."""
    digests: dict[int, str] = field(default_factory=dict)
    """The :func:`payload_digest` of every applied and no-op delta, by stream sequence."""
    versions: dict[tuple[str, str], VersionState] = field(default_factory=dict)
    """New version of every (workspace, branch) whose state changed."""


class StateFold:
    """Folds deltas, in stream order, onto row states: the one rule by which a delta applies or is a no-op.

    A delta applies only when its event was never handled before and its sequence is newer than the row's, so a
    repeated, redelivered, republished or older delta changes nothing. The state hash is a sum of row hashes
    modulo 2**64: it depends only on which rows exist with which sequence, never on how the deltas were batched,
    so a replay reproduces every version. A batch folds onto the rows it touches (:func:`plan_batch`); a rebuild
    folds a whole stream from nothing, to check what it wrote.
    """

    def __init__(
        self,
        rows: Mapping[EntityRef, RowState] | None = None,
        versions: Mapping[tuple[str, str], VersionState] | None = None,
        handled_events: Set[HandledEvent] = frozenset(),
    ) -> None:
        self.rows: dict[EntityRef, RowState] = dict(rows or {})
        self.changed_versions: dict[tuple[str, str], VersionState] = {}
        """The version of every (workspace, branch) whose state changed since the fold began."""
        self._base_versions = versions or {}
        self._seen = set(handled_events)

    def mark_handled(self, events: Set[HandledEvent]) -> None:
        """Events handled before the fold began (a compacted stream's): a later copy of one is a no-op."""
        self._seen |= events

    def add(self, delta: Delta) -> bool:
        """Fold one delta (later in the stream than every one before); True when it applied."""
        ref = entity_of(delta.envelope)
        previous = self.rows.get(ref)
        event = handled_event(delta)
        if event in self._seen or (previous is not None and delta.seq <= previous.seq):
            self._seen.add(event)
            return False
        self._seen.add(event)
        new = state_after(delta)
        self.rows[ref] = new
        scope = (ref.workspace, ref.branch)
        version = self.changed_versions.get(scope) or self._base_versions.get(scope) or VersionState()
        change = row_hash(ref, new) - (row_hash(ref, previous) if previous is not None else 0)
        self.changed_versions[scope] = VersionState(
            state_hash=(version.state_hash + change) % _HASH_MOD,
            stream_seq=max(version.stream_seq, delta.seq),
        )
        return True


def plan_batch(
    deltas: Iterable[Delta],
    current_rows: Mapping[EntityRef, RowState],
    current_versions: Mapping[tuple[str, str], VersionState],
    handled_events: Mapping[HandledEvent, Handled] | None = None,
) -> Plan:
    """Fold a batch onto the current state of the rows it touches, in stream order (see :class:`StateFold`). A
    delta whose event was handled (before, or earlier in the batch) with another payload is not a copy of it: it
    goes to ``reused`` instead of being folded as a repeat. The same stream sequence is the same message, a
    redelivery, whatever its digest reads now: a release that adds a field to a payload changes the digests of
    the events a release before it handled (a reviewer's: a batch redelivered across the upgrade was set aside)."""
    plan = Plan()
    handled = dict(handled_events or {})
    fold = StateFold(current_rows, current_versions, handled.keys())
    for delta in sorted(deltas, key=lambda d: d.seq):
        digest = payload_digest(delta.envelope)
        first = handled.setdefault(handled_event(delta), Handled(delta.seq, digest))
        if (
            first.digest is not None
            and first.digest != digest
            and first.seq != delta.seq
            and first.digest != earlier_payload_digest(delta.envelope)
        ):
            plan.reused[delta.seq] = first
            continue
        plan.digests[delta.seq] = digest
        if fold.add(delta):
            plan.writes[entity_of(delta.envelope)] = delta
            plan.applied.append(delta)
        else:
            plan.noops.append(delta)
    plan.versions = fold.changed_versions
    return plan


def search_text(document: SemanticDocument) -> str:
    """The text the keyword index is built from: the symbol's qualified name, then the content, analysed. The
    Postgres index reads it after :func:`own_name_repeats`; the Azure index reads it alone."""
    name = document.metadata.symbol_fqn or ""
    return analyse(f"{name}\n{document.content}" if name else document.content, catenate=True)


ANALYSIS_VERSION = 4
"""What the projector derives from a document for the keyword index (:func:`search_text`, :func:`own_name_repeats`),
by version: raised with every change to it, so that the documents indexed before can be counted (``ontofabric
status``) and brought up to date (``ontofabric rebuild``). 1: the own name weighed (2026-11-30); 2: text other than
ASCII made comparable and case-folded (shared/analysis.py, 2026-12-02: a document all ASCII is indexed as under 1);
3: a hyphenated word's parts also written together (2026-12-05: a document without one is indexed as under 2); 4:
punctuation, symbols and enclosing marks past ASCII read as spaces, variation selectors dropped, a hyphen past ASCII
read as ``-``, identifiers with combining marks whole (2026-12-07: a document without any is indexed as under 3); 0 is
what rows written before the version was recorded read (infra/migrations/0024)."""

NAME_REPEATS = 8
"""Times the keyword index reads a code symbol's own name besides its qualified name and content: a weight for the
name, after BM25F's weighted title field. The repeats add to the name's term frequencies, not to the document's
length, so the other words of a named symbol score as they would without them (docs/quality.md, "Held-out concept
queries")."""
NAMED_KINDS = frozenset({"module", "class", "function", "method", "docstring"})
"""The kinds of symbol whose own name is weighed: those the Python ingester makes, on which it was measured (a
docstring's is its owner's, a module's its file's). Other kinds (a document section, an external ingester's page
or member) need not end in a name (``docs/setup.md``, ``Send(System.Net.Http.HttpRequestMessage)``)."""


def own_name_repeats(document: SemanticDocument) -> str:
    """The repeats of a code symbol's own name that :data:`NAME_REPEATS` adds to its keyword index, analysed, or
    the empty string for any other document, and for a last part that is not an identifier (a member named with
    its parameters, a name cut short to a digest by the ingester)."""
    name = document.metadata.symbol_fqn
    if not name or document.metadata.symbol_kind not in NAMED_KINDS:
        return ""
    own = name.rsplit(".", 1)[-1]
    return analyse("\n".join([own] * NAME_REPEATS), catenate=True) if own.isidentifier() else ""
