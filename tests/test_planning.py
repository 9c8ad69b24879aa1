"""The projector's pure logic: validation outcomes and the fold that decides writes and versions."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from ontofabric.contracts import NO_VERSION, DeltaEnvelope, LinkAdded, NodeUpserted, OntologyLink, OntologyNode
from ontofabric.services.ingest.client import envelope
from ontofabric.services.projector.following import Followed, delta_mark, refusal
from ontofabric.services.projector.planning import (
    Delta,
    EntityRef,
    Handled,
    Limits,
    Rejection,
    RowState,
    VersionState,
    earlier_payload_digest,
    long_index_keys,
    payload_digest,
    plan_batch,
    upserted_document,
    validate_delta,
)
from ontofabric.shared.subjects import Names

from .factories import DEPLOYMENT_MODEL, delete, document, unit_vector, upsert

LIMITS = Limits(max_message_bytes=1 << 20, max_content_bytes=4096, embedding_dim=384, embedding_model=DEPLOYMENT_MODEL)
NAMES = Names("of")


def _raw(delta_json: str, workspace: str = "ws", branch: str = "main") -> tuple[bytes, str]:
    return delta_json.encode(), NAMES.delta_subject(workspace, branch)


def test_a_vector_of_no_named_model_is_not_used() -> None:
    """A tester's vectors of no named model were indexed as the deployment's. Not refused: such deltas were applied
    before, and replays and compactions judge the stream as the projector does."""
    delta = json.loads(upsert("ws", document("a", "alpha", embedding=unit_vector("a"))).model_dump_json())
    delta["payload"]["document"]["embeddingModel"] = None
    data, subject = _raw(json.dumps(delta))
    outcome = validate_delta(data, subject, 7, LIMITS)
    assert isinstance(outcome, Delta)
    assert outcome.unnamed_vector_dropped
    kept = outcome.envelope.payload.document  # type: ignore[union-attr]
    assert (kept.embedding, kept.content) == (None, "alpha")
    named = upsert("ws", document("a", "alpha", embedding=unit_vector("a")))
    checked = validate_delta(*_raw(named.model_dump_json()), 7, LIMITS)
    assert isinstance(checked, Delta)
    assert not checked.unnamed_vector_dropped
    assert checked.envelope == named


def test_valid_delta_is_accepted() -> None:
    delta = upsert("ws", document("a", "alpha", embedding=unit_vector("a")))
    data, subject = _raw(delta.model_dump_json())
    outcome = validate_delta(data, subject, 7, LIMITS)
    assert isinstance(outcome, Delta)
    assert outcome.seq == 7
    assert outcome.envelope == delta


def test_an_envelope_written_loosely_is_applied_as_before() -> None:
    """Epoch seconds, a time without offset, a version as text: the schema refuses them, the projector reads them
    as it always did, since a replay or compaction judges the deltas stored before as the projector does now."""
    good = json.loads(upsert("ws", document("a", "alpha", embedding=unit_vector("a"))).model_dump_json())
    for loose in ({"occurredAt": 1765000000}, {"occurredAt": "2026-12-07T08:00:00"}, {"schemaVersion": "1"}):
        outcome = validate_delta(*_raw(json.dumps({**good, **loose})), 7, LIMITS)
        assert isinstance(outcome, Delta), (loose, outcome)


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda d: "not json at all", "invalid_schema"),
        (lambda d: json.dumps({**d, "payload": {"type": "document.exploded"}}), "invalid_schema"),
        (lambda d: json.dumps({k: v for k, v in d.items() if k != "workspace"}), "invalid_schema"),
        (lambda d: json.dumps({**d, "workspace": "other"}), "subject_mismatch"),
        (lambda d: json.dumps({**d, "schemaVersion": 2}), "invalid_schema"),  # a later envelope than this reads
        (
            lambda d: json.dumps(
                {**d, "payload": {**d["payload"], "document": {**d["payload"]["document"], "content": "x" * 5000}}}
            ),
            "content_too_large",
        ),
        (
            lambda d: json.dumps(
                {**d, "payload": {**d["payload"], "document": {**d["payload"]["document"], "embedding": [0.5] * 12}}}
            ),
            "embedding_dimension_mismatch",
        ),
        (  # of no named model too: a vector of another width was refused so before (a review's)
            lambda d: json.dumps(
                {
                    **d,
                    "payload": {
                        **d["payload"],
                        "document": {**d["payload"]["document"], "embedding": [0.5] * 12, "embeddingModel": None},
                    },
                }
            ),
            "embedding_dimension_mismatch",
        ),
        (
            lambda d: json.dumps(
                {**d, "payload": {**d["payload"], "document": {**d["payload"]["document"], "embeddingModel": "other"}}}
            ),
            "embedding_model_mismatch",
        ),
        (
            lambda d: json.dumps(
                {**d, "payload": {**d["payload"], "document": {**d["payload"]["document"], "content": "nul\u0000byte"}}}
            ),
            "invalid_schema",
        ),
    ],
)
def test_rejections_name_their_reason(mutate: object, reason: str) -> None:
    good = json.loads(upsert("ws", document("a", "alpha", embedding=unit_vector("a"))).model_dump_json())
    data, subject = _raw(mutate(good))  # type: ignore[operator]
    outcome = validate_delta(data, subject, 1, LIMITS)
    assert isinstance(outcome, Rejection)
    assert outcome.reason == reason
    assert outcome.detail


def test_a_node_description_longer_than_a_documents_content_may_be_is_refused() -> None:
    """An operator's 900,000-byte description was stored whole; a document's content is bounded."""
    limit = LIMITS.max_content_bytes
    for size, refused in ((limit, False), (limit + 1, True)):
        node = OntologyNode(domain="pkg", name="Thing", kind="class", description="x" * size)
        delta = envelope("ws", NodeUpserted(node=node))
        outcome = validate_delta(*_raw(delta.model_dump_json()), 1, LIMITS)
        assert isinstance(outcome, Rejection) == refused
        if refused:
            assert (outcome.reason, outcome.detail) == (  # type: ignore[union-attr]
                "content_too_large",
                f"node description is {limit + 1} bytes, limit {limit}",
            )


@pytest.mark.parametrize("subject", ["of.delta.zz.ws.main", "of.delta.ws", "of.delta.delta.ws.main", "of.ws.main"])
def test_a_subject_that_is_not_exactly_the_deltas_workspace_and_branch_is_refused(subject: str) -> None:
    """Read from its end alone, of.delta.zz.ws.main passed as ws's, while placement and rebuilds read zz."""
    data = upsert("ws", document("a", "alpha", embedding=unit_vector("a"))).model_dump_json().encode()
    outcome = validate_delta(data, subject, 1, LIMITS)
    assert isinstance(outcome, Rejection)
    assert outcome.reason == "subject_mismatch"
    assert outcome.detail.endswith("whose subject ends .delta.ws.main")  # what to send it on


def test_the_scope_a_delta_subject_names_is_read_only_from_a_whole_canonical_one() -> None:
    names = Names("of")
    assert names.scope_of_delta(names.delta_subject("ws", "dev.1")) == ("ws", "dev.1")
    for subject in ["of.delta.zz.ws.main", "of.delta.ws", "of.ws.main", "other.delta.ws.main", "of.delta.w%zz.main"]:
        assert names.scope_of_delta(subject) is None, subject


@pytest.mark.parametrize(
    ("domain", "name"),
    [
        ("my domain", "Foo Bar"),
        ("d" * 256, "n" * 256),
        ("", "9lives"),
        ("pkg", "a\u200bb"),
        ("pkg", "a\u202eb"),
        ("pkg", "a\u00a0b"),
        ("pkg", "a\u061cb"),
        ("pkg", "a\ufe0fb"),  # a space, a direction mark, a selector
    ],
)
def test_a_node_whose_names_make_no_object_type_is_refused_as_it_comes(domain: str, name: str) -> None:
    """A red team's finding: such a node was stored, and every removal, revert or link naming it was refused (its
    object type fails the pattern), so it stayed for good."""
    node = OntologyNode(domain="pkg", name="Fine", kind="class").model_dump(by_alias=True)
    delta = json.loads(upsert("ws", document("a", "alpha")).model_dump_json())
    delta["payload"] = {"type": "node.upserted", "node": {**node, "domain": domain, "name": name}}
    data, subject = _raw(json.dumps(delta))
    outcome = validate_delta(data, subject, 1, LIMITS)
    assert isinstance(outcome, Rejection)
    assert outcome.reason == "invalid_schema"
    # Named by the field whose pattern the schema states, or by the object type they make together.
    assert "node.name" in outcome.detail or "node.domain" in outcome.detail or "which is none" in outcome.detail


def test_oversized_message_is_rejected_before_parsing() -> None:
    outcome = validate_delta(b"x" * 100, "of.delta.ws.main", 1, Limits(50, 4096, 384, "m"))
    assert isinstance(outcome, Rejection)
    assert outcome.reason == "oversized"


def test_unknown_fields_are_ignored() -> None:
    good = json.loads(upsert("ws", document("a", "alpha")).model_dump_json())
    good["futureField"] = {"anything": 1}
    good["payload"]["document"]["alsoNew"] = True
    data, subject = _raw(json.dumps(good))
    assert isinstance(validate_delta(data, subject, 1, LIMITS), Delta)


def _deltas(*items: tuple[int, object]) -> list[Delta]:
    return [Delta(seq, env) for seq, env in items]  # type: ignore[arg-type]


def test_repeated_and_older_deltas_are_noops() -> None:
    v1 = upsert("ws", document("a", "one"))
    v2 = upsert("ws", document("a", "two"))
    first = plan_batch(_deltas((1, v1), (2, v2)), {}, {})
    assert [d.seq for d in first.applied] == [1, 2]
    ref = EntityRef("ws", "main", "document", "a")
    assert first.writes[ref].seq == 2
    # The row now holds sequence 2; seeing 2 again (redelivery) or 1 (older) changes nothing.
    rows = {ref: RowState(2, False)}
    again = plan_batch(_deltas((2, v2), (1, v1)), rows, first.versions)
    assert again.writes == {}
    assert [d.seq for d in again.noops] == [1, 2]
    assert again.versions == {}


def test_batch_order_does_not_matter_within_a_batch() -> None:
    v1, v2 = upsert("ws", document("a", "one")), upsert("ws", document("a", "two"))
    forward = plan_batch(_deltas((1, v1), (2, v2)), {}, {})
    backward = plan_batch(_deltas((2, v2), (1, v1)), {}, {})
    assert forward.versions == backward.versions
    assert forward.writes == backward.writes


def test_version_depends_on_state_not_on_batching() -> None:
    deltas = _deltas(
        (1, upsert("ws", document("a", "one"))),
        (2, upsert("ws", document("b", "two"))),
        (3, delete("ws", "a")),
        (4, upsert("ws", document("c", "three"))),
        (5, upsert("ws", document("b", "two again"))),
    )
    whole = plan_batch(deltas, {}, {})
    # The same stream in batches of two, carrying state between batches.
    rows: dict[EntityRef, RowState] = {}
    versions: dict[tuple[str, str], VersionState] = {}
    for start in range(0, len(deltas), 2):
        plan = plan_batch(deltas[start : start + 2], rows, versions)
        for ref, delta in plan.writes.items():
            rows[ref] = RowState(delta.seq, delta.envelope.payload.type.endswith("deleted"))
        versions.update(plan.versions)
    assert versions == whole.versions
    assert whole.versions[("ws", "main")].stream_seq == 5
    assert whole.versions[("ws", "main")].label != NO_VERSION


def test_versions_are_per_workspace_and_branch() -> None:
    plan = plan_batch(
        _deltas(
            (1, upsert("ws", document("a", "x"))),
            (2, upsert("ws", document("a", "x"), branch="feature/x")),
            (3, upsert("other", document("a", "x"))),
        ),
        {},
        {},
    )
    assert set(plan.versions) == {("ws", "main"), ("ws", "feature/x"), ("other", "main")}
    assert len({v.label for v in plan.versions.values()}) == 3


def test_graph_deltas_are_entities_too() -> None:
    node = envelope("ws", NodeUpserted(node=OntologyNode(domain="pkg", name="Base", kind="class")))
    link = envelope(
        "ws", LinkAdded(link=OntologyLink(source_type="pkg.Child", name="inherits", target_type="pkg.Base"))
    )
    plan = plan_batch(_deltas((1, node), (2, link)), {}, {})
    assert set(plan.writes) == {
        EntityRef("ws", "main", "node", "pkg.Base"),
        EntityRef("ws", "main", "link", "pkg.Child|inherits|pkg.Base"),
    }


def test_a_republished_event_is_a_noop_even_with_a_newer_sequence() -> None:
    upserted = upsert("ws", document("a", "one"), event_id="evt-a")
    deleted = delete("ws", "a", event_id="evt-del")
    first = plan_batch(_deltas((1, upserted), (2, deleted)), {}, {})
    ref = EntityRef("ws", "main", "document", "a")
    # The upsert comes back after JetStream's duplicate window, with a new sequence: it must not resurrect "a".
    handled = {("ws", "evt-a"): Handled(1, payload_digest(upserted)), ("ws", "evt-del"): Handled(2, None)}
    again = plan_batch(_deltas((9, upserted)), {ref: RowState(2, True)}, first.versions, handled)
    assert again.writes == {}
    assert [d.seq for d in again.noops] == [9]
    # Within one batch the second copy of an event is a no-op as well.
    twice = plan_batch(_deltas((1, upserted), (5, upserted)), {}, {})
    assert [d.seq for d in twice.applied] == [1]
    assert [d.seq for d in twice.noops] == [5]


def test_an_event_id_another_workspace_used_is_no_repeat() -> None:
    """Event ids are unique within a workspace: a tenant's delta is not dropped because another used its id."""
    ours = upsert("ours", document("a", "one"), event_id="evt-1")
    theirs = upsert("theirs", document("a", "two"), event_id="evt-1")
    together = plan_batch(_deltas((1, ours), (2, theirs)), {}, {})
    assert [d.seq for d in together.applied] == [1, 2]
    later = plan_batch(_deltas((3, theirs)), {}, {}, {("ours", "evt-1"): Handled(1, payload_digest(ours))})
    assert [d.seq for d in later.applied] == [3]


def test_another_payload_under_a_handled_event_id_is_set_aside_not_dropped_as_a_repeat() -> None:
    """Before, a producer that reused an event id for another change lost that change without a trace."""
    first = upsert("ws", document("a", "one"), event_id="evt-a")
    reused = upsert("ws", document("a", "two"), event_id="evt-a")
    handled = {("ws", "evt-a"): Handled(1, payload_digest(first))}
    later = plan_batch(_deltas((7, reused)), {}, {}, handled)
    assert (later.applied, later.noops, later.reused) == ([], [], {7: Handled(1, payload_digest(first))})
    # Within one batch too; the first of the two applies.
    together = plan_batch(_deltas((1, first), (2, reused)), {}, {})
    assert ([d.seq for d in together.applied], list(together.reused)) == ([1], [2])
    # Another branch is another change.
    elsewhere = plan_batch(
        _deltas((7, upsert("ws", document("a", "one"), branch="dev", event_id="evt-a"))), {}, {}, handled
    )
    assert list(elsewhere.reused) == [7]
    # An event handled before the index kept digests: a later delta under its id stays a no-op.
    unknown = plan_batch(_deltas((7, reused)), {}, {}, {("ws", "evt-a"): Handled(1, None)})
    assert ([d.seq for d in unknown.noops], unknown.reused) == ([7], {})
    # The same message redelivered, its digest made by an earlier release (a field added since): a repeat.
    redelivered = plan_batch(_deltas((1, reused)), {}, {}, handled)
    assert ([d.seq for d in redelivered.noops], redelivered.reused) == ([1], {})


def test_a_copy_another_client_serialised_is_still_a_copy() -> None:
    """A delivery-order tester's copies of events, their free metadata's keys in another order or a whole number
    written as JavaScript writes it (``1`` for ``1.0``), were dead-lettered ``event_id_reused``; re-driven, they put
    an older change over a newer row. JSON tells neither apart (RFC 8259)."""
    body = upsert("ws", document("a", "one", team="core", owner="ana", weight=1.0, nested={"b": 2, "a": 1}))
    wire = body.model_dump(mode="json", by_alias=True)
    sent = DeltaEnvelope.model_validate_json(json.dumps(wire))
    again = json.loads(json.dumps(wire, sort_keys=True).replace('"weight": 1.0', '"weight": 1'))
    assert again["payload"]["document"]["metadata"]["weight"] == 1
    again["payload"]["document"]["metadata"]["note"] = None  # a null member, which the index does not store
    copy = DeltaEnvelope.model_validate_json(json.dumps(again))
    assert payload_digest(copy) == payload_digest(sent)
    handled = {("ws", sent.event_id): Handled(1, payload_digest(sent))}
    later = plan_batch(_deltas((9, copy)), {}, {}, handled)
    assert ([d.seq for d in later.noops], later.reused) == ([9], {})
    # A copy of an event an earlier release handled, its digest made as that release made it.
    earlier = {("ws", sent.event_id): Handled(1, earlier_payload_digest(sent))}
    assert [d.seq for d in plan_batch(_deltas((9, sent)), {}, {}, earlier).noops] == [9]
    # Another value is another payload still.
    other = DeltaEnvelope.model_validate_json(json.dumps(wire).replace('"ana"', '"bo"'))
    assert list(plan_batch(_deltas((9, other)), {}, {}, handled).reused) == [9]


def test_a_copy_whose_vectors_differ_in_the_last_bits_is_still_a_copy() -> None:
    """The same text embedded again (another batch, another runtime) may give other last bits: still one event."""
    vector = [0.1, 0.2, 0.3]
    once = upsert("ws", document("a", "one", embedding=vector, embedding_model="m"), event_id="evt-a")
    nudged = [x + 1e-7 for x in vector]
    again = upsert("ws", document("a", "one", embedding=nudged, embedding_model="m"), event_id="evt-a")
    assert payload_digest(again) == payload_digest(once)
    twice = plan_batch(_deltas((1, once), (2, again)), {}, {})
    assert ([d.seq for d in twice.applied], [d.seq for d in twice.noops], twice.reused) == ([1], [2], {})


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"metadata": {"extra": "a\u0000b"}}, "metadata 'extra'"),  # free keys go to jsonb, which holds no NUL
        ({"metadata": {"nested": {"k\u0000": 1}}}, "metadata 'nested.k\\x00'"),
        ({"metadata": {"list": ["ok", ["x\u0000"]]}}, "metadata 'list[1][0]'"),
        ({"metadata": {"weight": float("nan")}}, "metadata 'weight': numbers must be finite"),  # stored as null
        ({"metadata": {"n": [1e300] * 240}}, "metadata is over"),  # 2.4 kB as sent, 72 kB as jsonb writes it
        ({"metadata": {"calls": ["m.f" * 300] * 80}}, "metadata is over"),  # declared keys count too
        ({"indexedAt": "0001-01-01T00:00:00+14:00"}, "indexedAt"),  # valid ISO; before year 1 in UTC
        ({"indexedAt": "9999-12-31T23:59:59-14:00"}, "indexedAt"),
        ({"embedding": [3e38] * 384}, "squared norm overflows"),  # finite, but its cosine would be NaN
        ({"embedding": ["0.1"] * 384}, "embedding"),  # numbers, as the schema says (a fault harness's)
        ({"embedding": [True] * 384}, "embedding"),
        ({"metadata": {"endLine": 3}}, "metadata endLine: only with startLine"),
        ({"metadata": {"startLine": 5, "endLine": 3}}, "not before it"),
        ({"metadata": {"startLine": 0}}, "startLine"),
        ({"metadata": {"startLine": 2**31}}, "startLine"),
        ({"metadata": {"startLine": True}}, "startLine"),  # a line number, not true nor "12"
        ({"metadata": {"startLine": "12"}}, "startLine"),
    ],
)
def test_what_the_database_cannot_store_is_refused_naming_the_field(change: dict[str, object], named: str) -> None:
    """Each was stored, or dead-lettered as apply_failed with a database error naming no field (a fault harness)."""
    delta = json.loads(upsert("ws", document("a", "alpha", embedding=unit_vector("a"))).model_dump_json())
    delta["payload"]["document"].update(change)
    data, subject = _raw(json.dumps(delta))
    outcome = validate_delta(data, subject, 1, LIMITS)
    assert isinstance(outcome, Rejection)
    assert outcome.reason == "invalid_schema"
    assert named in outcome.detail


def test_a_line_number_written_with_a_point_is_the_whole_number() -> None:
    """JSON Schema counts 12.0 an integer; a nats.js tester's delta written by a library that writes every number
    with a point was dead-lettered though the schema takes it."""
    delta = json.loads(upsert("ws", document("a", "alpha", embedding=unit_vector("a"))).model_dump_json())
    delta["payload"]["document"]["metadata"].update({"startLine": 12.0, "endLine": 14.0})
    data, subject = _raw(json.dumps(delta))
    outcome = validate_delta(data, subject, 1, LIMITS)
    assert isinstance(outcome, Delta)
    document_read = upserted_document(outcome.envelope)
    assert document_read is not None
    assert (document_read.metadata.start_line, document_read.metadata.end_line) == (12, 14)
    delta["payload"]["document"]["metadata"]["startLine"] = 12.5  # a fraction is no line
    outcome = validate_delta(*_raw(json.dumps(delta)), 1, LIMITS)
    assert isinstance(outcome, Rejection)
    assert "startLine" in outcome.detail


@pytest.mark.parametrize(
    ("spoil", "detail"),
    [
        (lambda data: data.replace(b'"alpha"', b'"al\\ud800pha"'), "payload.document.content: not valid Unicode"),
        (
            lambda data: data.replace(b'"alpha"', '"café"'.encode("latin-1")),
            "payload.document.content: not valid UTF-8",
        ),
        (lambda data: b"\xef\xbb\xbf" + data, "<body>: a UTF-8 byte-order mark before the JSON"),
        # pydantic's checks name the field as these do, without the payload's type (a fault harness's).
        (lambda data: data.replace(b'"alpha"', b'"al\\u0000pha"'), "payload.document.content: Value error, text"),
        # In a free metadata key (a review's: one said <body>, the other pydantic's message).
        (lambda data: data.replace(b'"metadata":{', b'"metadata":{"caf\xe9":1,'), "<a key>: not valid UTF-8"),
        (lambda data: data.replace(b'"metadata":{', b'"metadata":{"k\\ud800":1,'), "<a key>: not valid Unicode"),
    ],
)
def test_text_no_json_may_hold_is_named_by_its_field(spoil: Callable[[bytes], bytes], detail: str) -> None:
    """A nats.js tester's lone surrogate was dead-lettered as "Invalid JSON: unexpected end of hex escape", though
    JSON's grammar allows the escape and the query side names the field for the same text."""
    delta = upsert("ws", document("a", "alpha", embedding=unit_vector("a"))).model_dump_json()
    data, subject = _raw(delta)
    outcome = validate_delta(spoil(data), subject, 1, LIMITS)
    assert isinstance(outcome, Rejection)
    assert outcome.reason == "invalid_schema"
    assert outcome.detail.startswith(detail), outcome.detail


def test_tiny_embeddings_that_vanish_in_float32_are_rejected() -> None:
    good = json.loads(upsert("ws", document("a", "alpha", embedding=unit_vector("a"))).model_dump_json())
    good["payload"]["document"]["embedding"] = [1e-46] * 384
    data, subject = _raw(json.dumps(good))
    outcome = validate_delta(data, subject, 1, LIMITS)
    assert isinstance(outcome, Rejection)
    assert outcome.reason == "invalid_schema"
    assert "zero vector" in outcome.detail


def test_a_long_name_is_named_only_beside_the_databases_refusal_of_an_index_entry() -> None:
    class IndexEntryTooLarge(Exception):
        sqlstate = "54000"  # as asyncpg's ProgramLimitExceededError carries it

    long = Delta(1, upsert("ws", document("a", "x", symbolFqn="pkg." + "n" * 3000)))
    hint = long_index_keys(long, IndexEntryTooLarge())
    assert "metadata.symbolFqn's last part is 3000 bytes" in hint
    assert "symbolKey" not in hint
    assert long_index_keys(long, ValueError("another refusal")) == ""  # not blamed for what it did not cause
    indexed_part_short = Delta(2, upsert("ws", document("b", "x", symbolFqn="p" * 3000 + ".short")))
    assert long_index_keys(indexed_part_short, IndexEntryTooLarge()) == ""


def test_a_stream_is_followed_only_while_it_is_the_one_the_index_read() -> None:
    made = datetime(2026, 12, 1, tzinfo=UTC)
    data = json.dumps({"workspace": "acme", "eventId": "e40", "payload": {}}).encode()
    followed = Followed(made, 40, delta_mark("t.delta.acme.main", data))
    # The same event id with other bytes (an ingester that derives ids from what it publishes) is another delta.
    assert delta_mark("t.delta.acme.main", data + b" ") != followed.mark
    assert delta_mark("t.delta.acme.other", data) != followed.mark
    # The same stream, read on; its mark compacted away or deleted (found None): nothing says otherwise.
    assert refusal(followed, 40, made, 65, followed.mark) is None
    assert refusal(followed, 40, made, 65, None) is None
    # Nothing recorded yet (a new index, or one from before the check): followed from here on.
    assert refusal(Followed(), None, made, 0, None) is None
    assert refusal(Followed(), 12, made, 12, None) is None
    # Made again (a lost store), even once written past the index's position.
    assert "was made at" in str(refusal(followed, 40, made + timedelta(hours=1), 65, None))
    # Behind what the index read: by its position, or by its mark.
    assert "ends at sequence 20, before the 40" in str(refusal(followed, 40, made, 20, None))
    assert "ends at sequence 30, before the 40" in str(refusal(Followed(made, 40, "m"), 35, made, 30, None))
    # Another delta where the index applied its last: an older backup restored, then written to.
    assert "sequence 40 is not the one" in str(refusal(followed, 40, made, 65, delta_mark("t.delta.acme.main", b"{}")))


def test_a_validated_delta_carries_its_bytes_for_the_mark() -> None:
    data, subject = _raw(upsert("ws", document("a", "alpha")).model_dump_json())
    delta = validate_delta(data, subject, 7, LIMITS)
    assert isinstance(delta, Delta)
    assert delta.stored == (subject, data)  # a batch's last is marked by delta_mark(subject, data)


def test_a_servers_answer_on_a_delta_subject_is_told_from_a_delta() -> None:
    """What a NATS server answers a request with, when the request named a delta subject as its reply (a tenant's
    way into another's subject, two reviews'): an ack, an error ack, an API answer, or anything with the headers the
    server sets; not a delta, nor junk that merely parses, nor a body nested past what the parser reads (the suite
    found 100,000 brackets stopping a batch with a RecursionError)."""
    from ontofabric.services.projector.planning import SERVER_ANSWER
    from ontofabric.shared.jetstream import STORED_STATUS, UNREADABLE_HEADERS

    subject = "t.delta.bob.main"
    answers = [
        (b'{"stream":"ONTOFABRIC_DELTAS","seq":12}', None),
        (b'{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 1"},"stream":"D","seq":0}', None),
        (b'{"type":"io.nats.jetstream.api.v1.consumer_info_response","stream_name":"D"}', None),
        (
            upsert("bob", document("planted", "x")).model_dump_json().encode(),
            {"Nats-Stream": "KV_m", "Nats-Sequence": "3"},
        ),
        (b"", {"Status": "404", "Description": "Message Not Found"}),
        (b"", {STORED_STATUS: "404 Message Not Found"}),  # a stored one's, as our client hands it over
    ]
    for data, headers in answers:
        rejected = validate_delta(data, subject, 1, LIMITS, headers)
        assert isinstance(rejected, Rejection), data
        assert rejected.detail == SERVER_ANSWER
    for junk in (b"[" * 100_000, b'{"a":' * 100_000, b'{"stream": 1, "seq": 2}', b'{"seq": 2}', b"{}"):
        rejected = validate_delta(junk, subject, 1, LIMITS)
        assert isinstance(rejected, Rejection)
        assert rejected.detail != SERVER_ANSWER
    delta = upsert("bob", document("own", "x")).model_dump_json().encode()
    assert isinstance(validate_delta(delta, subject, 1, LIMITS, {"Nats-Msg-Id": "bob:1"}), Delta)
    # Headers our client could not read (shared.jetstream.SturdyClient): set aside, saying so.
    unread = validate_delta(delta, subject, 1, LIMITS, {UNREADABLE_HEADERS: "UnicodeDecodeError: ..."})
    assert isinstance(unread, Rejection)
    assert unread.detail.startswith("its NATS headers cannot be read")


def test_a_long_key_over_a_long_list_costs_validation_little() -> None:
    """An audit's: every item's place was made as text before the size check, copying the key into each, and a
    delta of 240 KB (a key of 80,000 characters over a list of 80,000 items) took over 3 GB. It is refused for its
    size, having cost about what it weighs."""
    delta = json.loads(upsert("ws", document("a", "alpha", embedding=unit_vector("a"))).model_dump_json())
    delta["payload"]["document"]["metadata"]["k" * 40_000] = [0] * 40_000
    data, subject = _raw(json.dumps(delta))
    tracemalloc.start()
    rejected = validate_delta(data, subject, 1, LIMITS)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert isinstance(rejected, Rejection)
    assert "metadata is over" in rejected.detail
    assert peak < 50_000_000, peak
