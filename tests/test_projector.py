"""The Postgres projector against a real nats-server and PostgreSQL: delivery, idempotence, dead letters."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import get_args
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import numpy as np
import pytest
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerInfo
from nats.js.errors import BadRequestError
from opentelemetry import trace

from ontofabric.contracts import OntologyVersionChanged, TokenVectors
from ontofabric.services.ops import status as status_module
from ontofabric.services.ops.status import NO_QUERY_WORKER, deployment_status
from ontofabric.services.projector import worker as projector_worker
from ontofabric.services.projector.planning import Delta, RejectReason, VersionState
from ontofabric.services.projector.store import (
    ANALYZE_THRESHOLD_ROWS,
    Fenced,
    PostgresProjectionStore,
    VersionUpdate,
)
from ontofabric.services.projector.versions import VersionPublisher
from ontofabric.services.projector.worker import HOLD_CHECK_S, ProjectorService
from ontofabric.shared.db import (
    WRITER_ROLE,
    DeploymentMismatch,
    create_pool,
    is_transient,
    migrate,
    wait_until_migrated,
)
from ontofabric.shared.jetstream import MAX_DELTA_MESSAGE_BYTES, ack_floor, projected_floor
from ontofabric.shared.late_interaction import pack_signs
from ontofabric.shared.placement import Placement
from ontofabric.shared.runtime import EmbeddedRuntime

from .conftest import SPANS, Deployment, cannot_become_the_superuser, metric_points
from .factories import delete, document, unit_vector, upsert


async def _live_rows(deployment: Deployment, workspace: str) -> dict[str, str]:
    rows = await deployment.fetch(
        "SELECT id, content FROM documents WHERE workspace = $1 AND NOT deleted ORDER BY id", workspace
    )
    return {r["id"]: r["content"] for r in rows}


async def test_deltas_are_projected_and_version_is_announced(
    deployment: Deployment, projector: ProjectorService
) -> None:
    events = await deployment.nc.subscribe(f"{deployment.names.prefix}.version.>")
    deltas = [upsert("acme", document(f"d{i}", f"content {i}", embedding=unit_vector(f"d{i}"))) for i in range(5)]
    acks = await deployment.publisher.publish_many(deltas)
    await deployment.wait_projected(acks[-1].seq)
    event = await events.next_msg(timeout=5)
    assert event.subject == deployment.names.version_event_subject("acme", "main")

    assert await _live_rows(deployment, "acme") == {f"d{i}": f"content {i}" for i in range(5)}
    version_row = (await deployment.fetch("SELECT stream_seq FROM ontology_versions WHERE workspace = 'acme'"))[0]
    assert version_row["stream_seq"] == acks[-1].seq
    kv = await deployment.js.key_value(deployment.names.version_bucket)
    entry = await kv.get(deployment.names.version_key("acme", "main"))
    assert entry.value is not None
    announced = OntologyVersionChanged.model_validate_json(entry.value)
    assert announced.stream_seq == acks[-1].seq
    assert announced.ontology_version.startswith(f"{acks[-1].seq}-")
    assert OntologyVersionChanged.model_validate_json(event.data).stream_seq <= announced.stream_seq
    partitions = await deployment.fetch("SELECT partition_name FROM workspaces WHERE workspace = 'acme'")
    assert len(partitions) == 1


async def test_a_consumer_deleted_behind_the_projectors_back_is_made_again_from_the_index(
    deployment: Deployment, projector: ProjectorService
) -> None:
    """A fault tester deleted the projector's durable consumer while `up` ran: projection stopped for every
    workspace, the fetches failing without naming why, and the index's position read as 0, until a restart."""
    first = await deployment.publisher.publish_many([upsert("acme", document(f"d{i}", f"one {i}")) for i in range(3)])
    await deployment.wait_projected(first[-1].seq)
    (durable,) = deployment.names.postgres_projector_durables(1)
    await deployment.js.delete_consumer(deployment.names.delta_stream, durable)
    second = await deployment.publisher.publish_many([upsert("acme", document("d9", "after the deletion"))])
    await deployment.wait_projected(second[-1].seq, timeout_s=30)
    assert await _live_rows(deployment, "acme") == {
        "d0": "one 0",
        "d1": "one 1",
        "d2": "one 2",
        "d9": "after the deletion",
    }


async def test_a_versions_bucket_deleted_behind_the_projectors_back_is_made_again_and_status_says_so(
    deployment: Deployment, projector: ProjectorService
) -> None:
    """A fault tester deleted the versions bucket while `up` ran: every batch was retried for ever as 'no response
    from stream', naming no bucket, and `ontofabric status` ended in a traceback (BucketNotFoundError)."""
    first = await deployment.publisher.publish_many(
        [upsert("acme", document("d0", "one")), upsert("globex", document("g0", "other"))]
    )
    await deployment.wait_projected(first[-1].seq)
    await deployment.js.delete_key_value(deployment.names.version_bucket)
    placement = Placement.of(deployment.settings, deployment.database_url)
    status = await deployment_status(deployment.nc, deployment.names, placement)
    assert any(f"the versions bucket {deployment.names.version_bucket} does not exist" in p for p in status.problems)
    second = await deployment.publisher.publish_many([upsert("acme", document("d1", "two"))])
    await deployment.wait_projected(second[-1].seq, timeout_s=30)
    kv = await deployment.js.key_value(deployment.names.version_bucket)
    entry = await kv.get(deployment.names.version_key("acme", "main"))
    assert OntologyVersionChanged.model_validate_json(entry.value or b"").stream_seq == second[-1].seq
    # And what the index holds of the others, announced again (a verifier's: globex read "none yet" for good).
    other = await kv.get(deployment.names.version_key("globex", "main"))
    assert OntologyVersionChanged.model_validate_json(other.value or b"").stream_seq == first[-1].seq
    assert (await deployment_status(deployment.nc, deployment.names, placement)).problems == [NO_QUERY_WORKER]


async def test_status_names_a_consumer_that_settles_nothing_while_deltas_wait(
    deployment: Deployment, impatient_projector: ProjectorService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator tester's: with the projector up and answering but every write stuck behind a lock, `status`
    listed 1,226 deltas pending for 98 s and no problem, and exited 0; only the alert rules caught it, after 10
    minutes."""
    first = await deployment.publisher.publish(upsert("acme", document("d0", "one")))
    await deployment.wait_projected(first.seq)
    async with asyncio.timeout(10):  # the index's position as a look of the projector records it
        while (await deployment.fetch("SELECT position FROM projection_fences"))[0]["position"] != first.seq:
            await asyncio.sleep(0.1)
    monkeypatch.setattr(status_module, "STALLED_AFTER_S", 2.0)
    placement = Placement.of(deployment.settings, deployment.database_url)
    holder = await asyncpg.connect(deployment.database_url)
    try:
        async with holder.transaction():
            await holder.execute("LOCK TABLE handled_events IN ACCESS EXCLUSIVE MODE")
            stuck = await deployment.publisher.publish(upsert("acme", document("d1", "two")))
            await asyncio.sleep(4)
            status = await deployment_status(deployment.nc, deployment.names, placement)
        stalled = [problem for problem in status.problems if "has settled nothing for" in problem]
        assert len(stalled) == 1, status.problems
        assert deployment.names.postgres_projector_durable in stalled[0]
    finally:
        await holder.close()
    await deployment.wait_projected(stuck.seq, timeout_s=30)
    assert (await deployment_status(deployment.nc, deployment.names, placement)).problems == [NO_QUERY_WORKER]


async def test_the_batch_span_links_each_delta_to_its_ingest_trace(
    deployment: Deployment, projector: ProjectorService
) -> None:
    with trace.get_tracer("tests").start_as_current_span("ingest.run") as span:
        ack = await deployment.publisher.publish(upsert("acme", document("a", "alpha")))
    await deployment.wait_projected(ack.seq)
    await _a_batch_linked_to(span.get_span_context().trace_id)


async def _a_batch_linked_to(trace_id: int) -> None:
    """Until a projector's batch span links to the trace: it ends after the acks (statistics are refreshed in it),
    so the ack floor can pass first."""

    def linked() -> bool:
        batches = [s for s in SPANS.get_finished_spans() if s.name == "projector.batch"]
        return any(link.context.trace_id == trace_id for s in batches for link in s.links)

    async with asyncio.timeout(10):
        while not linked():
            await asyncio.sleep(0.02)


async def test_deltas_published_outside_any_span_carry_the_publishers_own(
    deployment: Deployment, projector: ProjectorService
) -> None:
    """An SRE's: `ontofabric ingest` has no span current, so its deltas carried no trace context and the batches
    that applied them linked to nothing."""
    assert not trace.get_current_span().get_span_context().is_valid
    acks = await deployment.publisher.publish_many([upsert("acme", document(f"t{i}", "alpha")) for i in range(3)])
    await deployment.wait_projected(acks[-1].seq)
    stored = [(await deployment.js.get_msg(deployment.names.delta_stream, ack.seq)).headers or {} for ack in acks]
    assert len({headers["traceparent"] for headers in stored}) == 1  # one publish, one span
    published = [s for s in SPANS.get_finished_spans() if s.name == "deltas publish"]
    trace_id = next(s.context.trace_id for s in published if f"{s.context.trace_id:032x}" in stored[0]["traceparent"])
    await _a_batch_linked_to(trace_id)


async def test_an_idle_projectors_renewals_make_no_traces(deployment: Deployment, projector: ProjectorService) -> None:
    """An SRE's: each statement of a renewal, every two seconds of an idle projector, was a trace of its own."""
    SPANS.clear()
    await asyncio.sleep(2.5 * HOLD_CHECK_S)
    statements = [s.attributes.get("db.statement", "") for s in SPANS.get_finished_spans() if s.attributes]
    assert not [statement for statement in statements if "projection_fences" in str(statement)]
    # while a batch's statements are still spans of its trace
    ack = await deployment.publisher.publish(upsert("acme", document("a", "alpha")))
    await deployment.wait_projected(ack.seq)
    await asyncio.sleep(0.2)
    assert any("db.statement" in (s.attributes or {}) for s in SPANS.get_finished_spans())


async def test_same_event_published_twice_changes_nothing(deployment: Deployment, projector: ProjectorService) -> None:
    delta = upsert("acme", document("a", "alpha"), event_id="evt-1")
    first = await deployment.publisher.publish(delta)
    second = await deployment.publisher.publish(delta)
    assert second.duplicate
    assert second.seq == first.seq
    await deployment.wait_projected(first.seq)
    rows = await deployment.fetch("SELECT stream_seq FROM documents WHERE id = 'a'")
    assert [r["stream_seq"] for r in rows] == [first.seq]


async def test_delete_leaves_a_tombstone_that_older_upserts_cannot_resurrect(
    deployment: Deployment, projector: ProjectorService
) -> None:
    acks = await deployment.publisher.publish_many(
        [upsert("acme", document("a", "alpha")), upsert("acme", document("b", "beta")), delete("acme", "a")]
    )
    await deployment.wait_projected(acks[-1].seq)
    assert await _live_rows(deployment, "acme") == {"b": "beta"}
    tombstone = (await deployment.fetch("SELECT deleted, stream_seq FROM documents WHERE id = 'a'"))[0]
    assert tombstone["deleted"]
    assert tombstone["stream_seq"] == acks[-1].seq


async def test_store_is_idempotent_for_redelivered_and_older_deltas(deployment: Deployment) -> None:
    await migrate(deployment.database_url, deployment.settings)
    pool = await create_pool(deployment.database_url, deployment.settings)
    try:
        store = PostgresProjectionStore(pool, "english")
        v1 = Delta(10, upsert("acme", document("a", "first")))
        v2 = Delta(20, upsert("acme", document("a", "second")))
        other = Delta(15, upsert("acme", document("b", "other")))
        result = await store.apply([v1, other, v2])
        version = result.versions[0].version
        snapshot = await _live_rows(deployment, "acme")
        assert snapshot == {"a": "second", "b": "other"}

        redelivered = await store.apply([v2, other])  # a whole batch delivered again
        older = await store.apply([v1])  # an older sequence after a newer one
        assert redelivered.plan.applied == []
        assert older.plan.applied == []
        assert redelivered.versions[0].version == version == older.versions[0].version
        assert await _live_rows(deployment, "acme") == snapshot
    finally:
        await pool.close()


async def test_a_store_whose_claim_on_its_consumer_was_overtaken_writes_nothing(deployment: Deployment) -> None:
    """The review of one process per consumer: a process frozen with a batch in hand, replaced meanwhile, committed
    that batch as it woke, beside the one that took over. Each batch now checks its claim in its transaction."""
    await migrate(deployment.database_url, deployment.settings)
    pool = await create_pool(deployment.database_url, deployment.settings)
    try:
        first, second = (PostgresProjectionStore(pool, "english", fence="projector-postgres") for _ in range(2))
        with pytest.raises(Fenced, match="not claimed"):  # a fencing store writes only once it has claimed
            await first.apply([Delta(1, upsert("acme", document("a", "never")))])
        assert await first.claim("first", lease_s=60, live=None) == "claimed"
        await first.apply([Delta(2, upsert("acme", document("a", "first's")))])
        # Another process takes it over only when the first's claim is not live: its process gone from discovery,
        # or, where discovery cannot be asked, its claim not renewed within the lease.
        assert await second.claim("second", lease_s=60, live={"first"}) == "held"
        assert await second.claim("second", lease_s=60, live=None) == "held"
        assert await first.renew()
        assert await second.claim("second", lease_s=0, live={"first"}) == "claimed"  # not renewed: up or not
        with pytest.raises(Fenced, match="claimed by second"):
            await first.apply([Delta(3, upsert("acme", document("a", "first's, later")))])
        assert first.fenced
        assert not await first.renew()
        assert await _live_rows(deployment, "acme") == {"a": "first's"}
        await second.apply([Delta(3, upsert("acme", document("a", "second's")))])
        assert await _live_rows(deployment, "acme") == {"a": "second's"}

        # A claim does not take a consumer from under a batch being written: it waits, then says so.
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT 1 FROM projection_fences WHERE durable = 'projector-postgres' FOR SHARE")
            assert await first.claim("first", lease_s=0, live=set()) == "busy"
        # Released, it is anyone's at once; the row deleted and claimed anew, no epoch comes back (a review: a
        # frozen process whose epoch 1 came round again committed its stale batch).
        await second.release()
        assert await first.claim("first", lease_s=60, live={"second"}) == "claimed"
        assert await second.claim("second", lease_s=60, live=set()) == "claimed"  # the first gone from discovery
        await pool.execute("DELETE FROM projection_fences")
        assert await first.claim("first", lease_s=60, live=None) == "claimed"  # the row's first claim
        await pool.execute("DELETE FROM projection_fences")
        assert await second.claim("second", lease_s=60, live=None) == "claimed"  # the row's first claim again
        with pytest.raises(Fenced):
            await first.apply([Delta(4, upsert("acme", document("a", "first's, stale")))])
        assert await _live_rows(deployment, "acme") == {"a": "second's"}
        # A database replaced by an empty one starts its epochs again: a claim is its epoch and its holder, so a
        # process frozen across the change does not pass for the holder of a new claim with its epoch (a review).
        assert await first.claim("first", lease_s=0, live=set()) == "claimed"
        await pool.execute("UPDATE projection_fences SET holder = 'second'")  # the same epoch, another holder
        assert not await first.renew()
        with pytest.raises(Fenced):
            await first.apply([Delta(5, upsert("acme", document("a", "first's, across the change")))])
        assert await _live_rows(deployment, "acme") == {"a": "second's"}
    finally:
        await pool.close()


async def test_the_largest_delta_the_stream_takes_is_dead_lettered_whole_and_projection_goes_on(
    deployment: Deployment, projector: ProjectorService
) -> None:
    """A delta filling the stream's limit, whose content is over the deployment's: its dead letter (the same bytes
    and its headers) still fits in a NATS message. When it did not, the server refused the dead letter and nats-py
    closed the projector's connection for good."""
    subject = deployment.names.delta_subject("acme", "main")
    big = json.loads(upsert("acme", document("huge", "x")).model_dump_json(by_alias=True))
    envelope = json.dumps(big)
    room = MAX_DELTA_MESSAGE_BYTES - 64  # the stream's limit counts the message id header too
    big["payload"]["document"]["content"] = "x" * (room - len(envelope.encode()) + 1)
    data = json.dumps(big).encode()
    assert len(data) == room
    await deployment.js.publish(subject, data, headers={"Nats-Msg-Id": "largest-1"})
    with pytest.raises(BadRequestError, match="exceeds maximum"):  # 64 bytes more: the stream refuses it
        await deployment.js.publish(subject, data + b" " * 64, headers={"Nats-Msg-Id": "largest-2"})
    last = await deployment.publisher.publish(upsert("acme", document("after-huge", "still projected")))
    await deployment.wait_projected(last.seq)

    assert (await _live_rows(deployment, "acme")).get("after-huge") == "still projected"
    dead = await deployment.js.subscribe(deployment.names.dlq_subjects, stream=deployment.names.dlq_stream)
    msg = await dead.next_msg(timeout=5)
    assert msg.headers is not None
    assert msg.headers["Ontofabric-Reason"] == "content_too_large"
    assert msg.data == data
    assert "Ontofabric-Body-Omitted" not in msg.headers


async def test_a_delta_whose_headers_leave_its_dead_letter_no_room_is_dead_lettered_and_projection_goes_on(
    deployment: Deployment, projector: ProjectorService
) -> None:
    """A fault tester's: a malformed delta with a 64 kB ``tracestate``, its letter carrying it on past the server's
    header limit, was refused on every try and held the index's position for every workspace. Such a header is not
    carried on."""
    subject = deployment.names.delta_subject("acme", "main")
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    headers = {"Nats-Msg-Id": "long-trace", "tracestate": "k=" + "v" * 65_370, "traceparent": traceparent}
    await deployment.js.publish(subject, b'{"not": "a delta"}', headers=headers)
    last = await deployment.publisher.publish(upsert("acme", document("after-trace", "still projected")))
    await deployment.wait_projected(last.seq, timeout_s=20)
    assert (await _live_rows(deployment, "acme")).get("after-trace") == "still projected"
    dead = await deployment.js.subscribe(deployment.names.dlq_subjects, stream=deployment.names.dlq_stream)
    msg = await dead.next_msg(timeout=5)
    assert msg.headers is not None
    assert msg.headers["Ontofabric-Reason"] == "invalid_schema"
    assert "tracestate" not in msg.headers
    assert msg.headers["traceparent"] == traceparent  # within the limit: carried on
    assert msg.data == b'{"not": "a delta"}'


async def test_poison_deltas_are_dead_lettered_and_later_deltas_apply(
    deployment: Deployment, projector: ProjectorService
) -> None:
    def dead_lettered(reason: str) -> int:
        points = metric_points("projector.deltas")
        return sum(
            int(p.value)
            for p in points
            if p.attributes.get("outcome") == "dead_lettered" and p.attributes.get("reason") == reason
        )

    def fresh_deltas() -> int:
        return sum(p.count for p in metric_points("projector.freshness_ms"))

    invalid_before, fresh_before = dead_lettered("invalid_schema"), fresh_deltas()
    subject = deployment.names.delta_subject("acme", "main")
    good_before = upsert("acme", document("before", "fine"))
    wrong_dim = upsert("acme", document("wrong", "bad vector", embedding=[0.1] * 8))
    narrow_tokens = TokenVectors.of_signs(8, b"\x0f\xf0")
    wrong_token_dim = upsert("acme", document("tokens", "bad token vectors", token_vectors=narrow_tokens))
    unknown_model = upsert(
        "acme", document("model", "whose tokens?", token_vectors=TokenVectors.of_signs(384, b"\x01" * 48))
    )
    oversized = upsert("acme", document("big", "x" * (deployment.settings.max_content_bytes + 1)))
    good_after = upsert("acme", document("after", "still fine"))

    await deployment.publisher.publish(good_before)
    await deployment.js.publish(subject, b"{not json", headers={"Nats-Msg-Id": "garbage-1"})
    await deployment.publisher.publish(wrong_dim)
    await deployment.publisher.publish(wrong_token_dim)
    await deployment.publisher.publish(unknown_model)
    await deployment.publisher.publish(oversized)
    last = await deployment.publisher.publish(good_after)
    await deployment.wait_projected(last.seq)

    assert await _live_rows(deployment, "acme") == {"after": "still fine", "before": "fine"}
    dead = await deployment.js.subscribe(deployment.names.dlq_subjects, stream=deployment.names.dlq_stream)
    reasons = []
    for _ in range(5):
        msg = await dead.next_msg(timeout=5)
        assert msg.headers is not None
        reasons.append(msg.headers["Ontofabric-Reason"])
        assert msg.headers["Ontofabric-Original-Subject"] == subject
        assert msg.headers["Ontofabric-Detail"]
        if msg.headers["Ontofabric-Reason"] == "invalid_schema":
            assert msg.data == b"{not json"  # the payload is kept as it was, for inspection or re-drive
    assert sorted(reasons) == [
        "content_too_large", "embedding_dimension_mismatch", "embedding_model_mismatch", "invalid_schema",
        "token_vectors_dimension_mismatch",
    ]  # fmt: skip
    assert dead_lettered("invalid_schema") == invalid_before + 1  # dead letters counted by reason
    assert fresh_deltas() >= fresh_before + 2  # the two that applied: stored in the stream -> in the index


async def test_a_new_partition_layout_does_not_dead_letter_again_what_the_old_one_did(
    deployment: Deployment, projector: ProjectorService
) -> None:
    """The scale-out red team: a new layout's consumers replay the stream, and past the DLQ's duplicate window they
    stored every dead letter again; one an operator had purged came back. What another layout settled is only
    terminated now."""
    names = deployment.names

    def counted(outcome: str) -> int:
        points = metric_points("projector.deltas")
        return sum(int(p.value) for p in points if p.attributes.get("outcome") == outcome)

    subject = names.delta_subject("acme", "main")
    await deployment.js.publish(subject, b"{not json", headers={"Nats-Msg-Id": "garbage-layouts"})
    # Applied by this layout; the next one, with a lower content limit, refuses it: not a refusal the delta
    # decides alone, so it is dead-lettered there, never only terminated (a review).
    await deployment.publisher.publish(upsert("acme", document("big", "x" * 2000)))
    last = await deployment.publisher.publish(upsert("acme", document("a", "alpha")))
    await deployment.wait_projected(last.seq)
    assert (await deployment.js.stream_info(names.dlq_stream)).state.messages == 1
    await deployment.js.purge_stream(names.dlq_stream)  # the operator handled it
    dead_lettered, before = counted("dead_lettered"), counted("dead_lettered_before")

    await projector.stop()  # the layout changes from 1 to 2 partitions
    changed = deployment.settings.model_copy(update={"projector_partitions": 2, "max_content_bytes": 1024})
    trial = ProjectorService(changed, deployment.nats_url_as("projector"), deployment.database_url)
    await trial.start()
    try:
        async with asyncio.timeout(30):
            while (await projected_floor(deployment.js, names, 2)) < last.seq:
                await asyncio.sleep(0.05)
        garbage = await deployment.js.publish(subject, b"{still not json", headers={"Nats-Msg-Id": "garbage-new"})
        async with asyncio.timeout(30):
            while (await projected_floor(deployment.js, names, 2)) < garbage.seq:
                await asyncio.sleep(0.05)
    finally:
        await trial.stop()
    # The old malformed delta: terminated, not stored again. The new one, and the one only this layout refuses:
    # dead-lettered.
    assert (counted("dead_lettered"), counted("dead_lettered_before")) == (dead_lettered + 2, before + 1)
    letters = await deployment.js.subscribe(names.dlq_subjects, stream=names.dlq_stream)
    stored = [await letters.next_msg(timeout=5) for _ in range(2)]
    assert sorted((m.headers or {})["Ontofabric-Reason"] for m in stored) == ["content_too_large", "invalid_schema"]
    with pytest.raises(NatsTimeoutError):
        await letters.next_msg(timeout=0.5)


async def test_a_dead_letter_the_dlq_refuses_keeps_its_delta_and_the_batchs_others_go_on(
    deployment: Deployment, projector: ProjectorService
) -> None:
    """The dead letters of a batch are published together; one the DLQ stream refuses leaves its delta to come
    back (never terminated unrecorded), while the others are recorded and the batch's good deltas apply."""
    names, js = deployment.names, deployment.js
    dlq = (await js.stream_info(names.dlq_stream)).config
    await js.update_stream(dataclasses.replace(dlq, max_msg_size=600))
    subject = deployment.names.delta_subject("acme", "main")
    for n, junk in enumerate([b"{}", b"[" + b" " * 1000 + b"]", b"null"]):
        await js.publish(subject, junk, headers={"Nats-Msg-Id": f"junk-{n}"})
    last = await deployment.publisher.publish(upsert("acme", document("after-junk", "applied")))

    async with asyncio.timeout(30):  # applied past the refused dead letter, out of order
        while "after-junk" not in await _live_rows(deployment, "acme"):
            await asyncio.sleep(0.05)
    dead = await js.subscribe(names.dlq_subjects, stream=names.dlq_stream)
    recorded = {(await dead.next_msg(timeout=5)).data for _ in range(2)}
    assert recorded == {b"{}", b"null"}
    assert await ack_floor(js, names.delta_stream, names.postgres_projector_durables(1)[0]) < last.seq

    await js.update_stream(dataclasses.replace(dlq, max_msg_size=dlq.max_msg_size or -1))
    await deployment.wait_projected(last.seq)  # the refused one came back and went to the DLQ
    assert (await dead.next_msg(timeout=5)).data == b"[" + b" " * 1000 + b"]"


async def test_every_dead_letter_reason_is_counted_from_zero(projector: ProjectorService) -> None:
    """An operator's finding: a count that first appeared at 1 showed Prometheus no increase, so the dead-letter
    alert missed a process's first dead letter of each reason."""
    # Stopped at once: a projector stopped within milliseconds of its start used to run on for ever (its consumer
    # watch lost its cancellation), and this test hung in teardown.
    counted = {
        p.attributes.get("reason")
        for p in metric_points("projector.deltas")
        if p.attributes.get("outcome") == "dead_lettered" and p.attributes.get("index") == "postgres"
    }
    assert set(get_args(RejectReason)) <= counted


async def test_a_document_keeps_its_vector_in_its_row(deployment: Deployment, projector: ProjectorService) -> None:
    # A typical chunk: a few hundred bytes of code, 120 tokens' signs (5.8 kB) and a 1.5 kB vector. Past the 2 kB
    # TOAST threshold something must leave the row; it must not be the vector every exact search reads.
    rng = np.random.default_rng(5)
    tokens = TokenVectors.of_signs(384, pack_signs(rng.standard_normal((120, 384))))
    content = "def handler(event):\n" + "\n".join(f"    step_{n}(event, {rng.integers(1 << 30)})" for n in range(25))
    doc = document(
        "chunk", content, embedding=unit_vector("chunk"), token_vectors=tokens,
        embedding_model=deployment.settings.embedding_model,
    )  # fmt: skip
    ack = await deployment.publisher.publish(upsert("acme", doc))
    await deployment.wait_projected(ack.seq)
    row = (
        await deployment.fetch(
            "SELECT pg_column_toast_chunk_id(embedding) AS vector_chunk,"
            " pg_column_toast_chunk_id(token_signs) AS signs_chunk FROM documents WHERE id = 'chunk'"
        )
    )[0]
    assert row["signs_chunk"] is not None  # the row did pass the threshold
    assert row["vector_chunk"] is None


async def test_token_vectors_are_stored_as_sent_and_follow_the_document(
    deployment: Deployment, projector: ProjectorService
) -> None:
    signs = pack_signs(np.random.default_rng(3).standard_normal((7, 384)))
    tokens = TokenVectors.of_signs(384, signs)
    model = deployment.settings.embedding_model
    await deployment.publisher.publish(
        upsert("acme", document("a", "alpha", token_vectors=tokens, embedding_model=model))
    )
    last = await deployment.publisher.publish(
        upsert("acme", document("b", "beta", token_vectors=tokens, embedding_model=model))
    )
    await deployment.wait_projected(last.seq)
    stored = {r["id"]: r["token_signs"] for r in await deployment.fetch("SELECT id, token_signs FROM documents")}
    assert stored == {"a": signs, "b": signs}
    # A new version without token vectors drops the old ones; a delete leaves none on the tombstone.
    await deployment.publisher.publish(upsert("acme", document("a", "alpha again")))
    last = await deployment.publisher.publish(delete("acme", "b"))
    await deployment.wait_projected(last.seq)
    stored = {r["id"]: r["token_signs"] for r in await deployment.fetch("SELECT id, token_signs FROM documents")}
    assert stored == {"a": None, "b": None}


async def test_deltas_trickling_in_are_each_projected_on_first_delivery(deployment: Deployment) -> None:
    # Deltas one at a time at random gaps: some arrive just as a fetch times out. None may wait for redelivery.
    # The ack wait outlasts the test, so a delivery the projector dropped would surface as a timeout below.
    settings = deployment.settings.model_copy(update={"projector_ack_wait_s": 120.0})
    projector = ProjectorService(settings, deployment.nats_url_as("projector"), deployment.database_url)
    await projector.start()
    try:
        rng = random.Random(11)
        for n in range(150):
            last = await deployment.publisher.publish(upsert("acme", document(f"d{n}", f"delta {n}")))
            await asyncio.sleep(rng.uniform(0, 0.08))
        await deployment.wait_projected(last.seq, timeout_s=60)
    finally:
        await projector.stop()
    assert (await _projector_consumer(deployment)).num_redelivered == 0
    assert len(await _live_rows(deployment, "acme")) == 150


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (asyncpg.exceptions.StringDataRightTruncationError("value too long"), False),  # the data's fault
        (asyncpg.exceptions.UniqueViolationError("duplicate key"), False),
        (asyncpg.exceptions.DeadlockDetectedError("deadlock"), True),
        (asyncpg.exceptions.CannotConnectNowError("starting up"), True),
        (ConnectionRefusedError(), True),
        (asyncpg.InterfaceError("connection is closed"), True),
        # Seen when the backend was killed under a pooled connection: asyncpg's state, not the delta's.
        (asyncpg.InternalClientError("cannot switch to state 15; another operation (2) is in progress"), True),
        (asyncpg.exceptions.ProtocolError("unexpected message"), False),
        (asyncpg.exceptions._base.DataError("invalid input for query argument $1"), False),  # client-side
        (ValueError("a bug that fails on this delta"), False),
    ],
)
def test_only_errors_that_blame_the_data_dead_letter(error: Exception, transient: bool) -> None:
    assert is_transient(error) is transient


NAK_EVIDENCE_S = 15.0
"""How soon the first redelivery must come for it to be the projector's nak (its first backoff is 0.5 s)."""


async def test_transient_database_failure_is_retried(deployment: Deployment) -> None:
    # An ack wait longer than NAK_EVIDENCE_S: a redelivery seen within that time comes from the projector's nak,
    # not from expiry.
    settings = deployment.settings.model_copy(update={"projector_ack_wait_s": 2 * NAK_EVIDENCE_S})
    projector = ProjectorService(settings, deployment.nats_url_as("projector"), deployment.database_url)
    await projector.start()
    try:
        await _outage_then_recovery(deployment)
    finally:
        await projector.stop()


async def _outage_then_recovery(deployment: Deployment) -> None:
    first = await deployment.publisher.publish(upsert("acme", document("a", "alpha")))
    await deployment.wait_projected(first.seq)

    async with deployment.database_outage():
        second = await deployment.publisher.publish(upsert("acme", document("b", "beta")))
        # Delivery attempts fail while the database is away; on a loaded machine the first nak's backoff can take
        # a while, so wait for a redelivery rather than a fixed time.
        async with asyncio.timeout(NAK_EVIDENCE_S):
            while (info := await _projector_consumer(deployment)).num_redelivered < 1:
                await asyncio.sleep(0.2)
        assert info.ack_floor.stream_seq < second.seq  # not acked while it could not be committed
        assert info.num_redelivered >= 1  # nak'd and delivered again, with backoff
    await deployment.wait_projected(second.seq, timeout_s=60)
    assert await _live_rows(deployment, "acme") == {"a": "alpha", "b": "beta"}
    dead = await deployment.js.stream_info(deployment.names.dlq_stream)
    assert dead.state.messages == 0


async def test_a_later_copy_of_an_event_waits_for_the_first_copy_sent_back_for_a_retry(
    deployment: Deployment, impatient_projector: ProjectorService
) -> None:
    """A fault harness's finding: the first copy of an event was sent back for a retry, and a later copy (the same
    event id stored again past the duplicate window, under another message id) was applied meanwhile, in the
    first copy's place over the delta published between them; a replay keeps the first copy and the delta after
    it. A later copy of an event now waits for the copy that was sent back."""
    other = await deployment.publisher.publish(upsert("acme", document("z", "zeta")))
    await deployment.wait_projected(other.seq)
    first_copy = upsert("acme", document("a", "first"), event_id="evt-first")
    async with deployment.session() as conn, conn.transaction():
        await conn.execute("SELECT 1 FROM ontology_versions WHERE workspace = 'acme' FOR UPDATE")
        await deployment.publisher.publish(first_copy)
        async with asyncio.timeout(30):
            while (await _projector_consumer(deployment)).num_redelivered < 1:
                await asyncio.sleep(0.1)
        await asyncio.sleep(4.0)  # sent back again and again: its next delivery is seconds away
    await deployment.publisher.publish(upsert("acme", document("a", "second"), event_id="evt-second"))
    copy = await deployment.js.publish(
        deployment.names.delta_subject("acme", "main"),
        first_copy.model_dump_json(exclude_none=True).encode(),
        headers={"Nats-Msg-Id": "acme:evt-first:stored-again"},
    )
    await deployment.wait_projected(copy.seq, timeout_s=60)
    # As the stream folds: the first copy, then the delta after it; the later copy changes nothing.
    assert await _live_rows(deployment, "acme") == {"a": "second", "z": "zeta"}


async def _projector_consumer(deployment: Deployment) -> ConsumerInfo:
    return await deployment.js.consumer_info(deployment.names.delta_stream, deployment.names.postgres_projector_durable)


async def test_kv_carries_json_a_late_reader_can_parse(deployment: Deployment, projector: ProjectorService) -> None:
    ack = await deployment.publisher.publish(upsert("acme", document("a", "alpha"), branch="feature/x.y"))
    await deployment.wait_projected(ack.seq)
    kv = await deployment.js.key_value(deployment.names.version_bucket)
    keys = await kv.keys()
    assert keys == [deployment.names.version_key("acme", "feature/x.y")]
    assert deployment.names.parse_version_key(keys[0]) == ("acme", "feature/x.y")
    entry = await kv.get(keys[0])
    assert entry.value is not None
    assert json.loads(entry.value)["branch"] == "feature/x.y"


async def test_an_event_republished_after_the_duplicate_window_is_a_noop(deployment: Deployment) -> None:
    await migrate(deployment.database_url, deployment.settings)
    pool = await create_pool(deployment.database_url, deployment.settings)
    try:
        store = PostgresProjectionStore(pool, "english")
        created = upsert("acme", document("a", "first"), event_id="evt-create")
        removed = delete("acme", "a", event_id="evt-delete")
        await store.apply([Delta(1, created), Delta(2, removed)])
        version = (await store.apply([Delta(3, upsert("acme", document("b", "other")))])).versions[0]
        # JetStream forgot the event id long ago; the copy arrives with a new, higher sequence.
        again = await store.apply([Delta(40, created)])
        assert again.plan.applied == []
        assert again.versions[0].version == version.version
        assert await _live_rows(deployment, "acme") == {"b": "other"}
    finally:
        await pool.close()


async def test_two_workspaces_may_use_the_same_event_id(deployment: Deployment, projector: ProjectorService) -> None:
    """Through the stream and the store: neither JetStream's dedupe nor the handled events take one tenant's delta
    for a repeat of another's."""
    ours = await deployment.publisher.publish(upsert("ours", document("a", "alpha"), event_id="evt-shared"))
    theirs = await deployment.publisher.publish(upsert("theirs", document("a", "beta"), event_id="evt-shared"))
    assert not theirs.duplicate
    await deployment.wait_projected(theirs.seq)
    assert await _live_rows(deployment, "ours") == {"a": "alpha"}
    assert await _live_rows(deployment, "theirs") == {"a": "beta"}
    assert ours.seq < theirs.seq


async def test_another_change_under_an_event_id_already_handled_is_dead_lettered_not_dropped(
    deployment: Deployment, projector: ProjectorService
) -> None:
    """Before, a producer that reused an event id for another change (past the duplicate window) lost that change
    without a trace: it was taken for a copy of the first and acked as a no-op."""
    subject = deployment.names.delta_subject("acme", "main")
    first = await deployment.publisher.publish(upsert("acme", document("a", "first"), event_id="evt-reused"))
    await deployment.wait_projected(first.seq)
    stored_again: list[int] = []
    for n, content in enumerate(["first", "second"]):  # a true copy, then another change under the same id
        body = upsert("acme", document("a", content), event_id="evt-reused").model_dump_json(exclude_none=True)
        ack = await deployment.js.publish(subject, body.encode(), headers={"Nats-Msg-Id": f"acme:evt-reused:{n}"})
        stored_again.append(ack.seq)
    await deployment.wait_projected(stored_again[-1])
    assert await _live_rows(deployment, "acme") == {"a": "first"}
    dead = await deployment.js.subscribe(deployment.names.dlq_subjects, stream=deployment.names.dlq_stream)
    letter = await dead.next_msg(timeout=5)
    assert letter.headers is not None
    assert letter.headers["Ontofabric-Reason"] == "event_id_reused"
    assert letter.headers["Ontofabric-Original-Sequence"] == str(stored_again[1])
    assert f"handled at stream seq {first.seq} with another payload" in letter.headers["Ontofabric-Detail"]
    with pytest.raises(NatsTimeoutError):  # the true copy was a no-op, not a dead letter
        await dead.next_msg(timeout=1)


async def test_events_handled_before_the_table_knew_workspaces_stay_handled_in_every_one(
    deployment: Deployment,
) -> None:
    await migrate(deployment.database_url, deployment.settings)
    pool = await create_pool(deployment.database_url, deployment.settings)
    try:
        store = PostgresProjectionStore(pool, "english")
        created = upsert("acme", document("a", "first"), event_id="evt-old")
        async with pool.acquire() as conn:  # as infra/migrations/0019 leaves a row written before it
            await conn.execute("INSERT INTO handled_events (workspace, event_id, stream_seq) VALUES ('', 'evt-old', 1)")
        again = await store.apply([Delta(40, created)])
        assert again.plan.applied == []
        fresh = await store.apply([Delta(41, upsert("acme", document("b", "second"), event_id="evt-new"))])
        assert [d.seq for d in fresh.plan.applied] == [41]
    finally:
        await pool.close()


async def test_version_announcements_never_go_back(deployment: Deployment) -> None:
    kv = await deployment.js.key_value(deployment.names.version_bucket)
    publisher = VersionPublisher(deployment.nc, kv, deployment.names)
    newer = VersionUpdate("acme", "main", VersionState(state_hash=7, stream_seq=10), revision=5)
    older = VersionUpdate("acme", "main", VersionState(state_hash=9, stream_seq=10), revision=4)
    await publisher.publish(newer)
    await publisher.publish(older)  # a slower worker announcing an earlier commit
    entry = await kv.get(deployment.names.version_key("acme", "main"))
    assert entry.value is not None
    assert OntologyVersionChanged.model_validate_json(entry.value).revision == 5


async def test_a_new_workspace_is_analysed_as_it_is_written(
    deployment: Deployment, projector: ProjectorService
) -> None:
    # Autovacuum analyses a partition a minute or more after the writes; until then it is planned as an empty table.
    acks = await deployment.publisher.publish_many([upsert("fresh", document(f"d{i}", f"text {i}")) for i in range(80)])
    await deployment.wait_projected(acks[-1].seq)

    async def analysed() -> dict[str, float]:
        rows = await deployment.fetch(
            "SELECT c.relname, c.reltuples FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid"
            " WHERE s.last_analyze IS NOT NULL AND c.relname IN"
            " (SELECT prefix || substr(md5('fresh'), 1, 20)"
            "    FROM unnest(ARRAY['documents_ws_', 'postings_ws_', 'term_statistics_ws_']) AS prefix)"
        )
        return {r["relname"].split("_ws_")[0]: r["reltuples"] for r in rows}

    for _ in range(50):  # the projector analyses after acking, so right after the wait it may still be at it
        if len(found := await analysed()) == 3:
            break
        await asyncio.sleep(0.1)
    assert set(found) == {"documents", "postings", "term_statistics"}
    # The 80 deltas may come in more than one batch (62 and 18 in one CI run): the partition is analysed once more
    # rows changed than the threshold, and again only when the rest passes autovacuum's rule (50 + 10 %).
    assert ANALYZE_THRESHOLD_ROWS < found["documents"] <= 80


async def test_a_partition_being_analysed_elsewhere_is_skipped_not_waited_for(deployment: Deployment) -> None:
    await migrate(deployment.database_url, deployment.settings)
    pool = await create_pool(deployment.database_url, deployment.settings)
    other = await asyncpg.connect(deployment.database_url)
    try:
        store = PostgresProjectionStore(pool, "english")
        await store.apply([Delta(i, upsert("busy", document(f"d{i}", f"text {i}"))) for i in range(1, 81)])
        documents_partition = await other.fetchval("SELECT partition_name FROM workspaces WHERE workspace = 'busy'")
        async with other.transaction():  # what a concurrent ANALYZE or autovacuum holds
            await other.execute(f"LOCK TABLE {documents_partition} IN SHARE UPDATE EXCLUSIVE MODE")
            busy = await asyncio.wait_for(store.refresh_statistics(["busy"]), timeout=5)
        assert [p.split("_ws_")[0] for p in busy] == ["postings", "term_statistics"]
        assert await store.refresh_statistics(["busy"]) == [documents_partition]  # still stale, so next time
        assert await store.refresh_statistics(["busy"]) == []
    finally:
        await other.close()
        await pool.close()


async def test_a_new_workspace_s_partitions_keep_no_reader_waiting(deployment: Deployment) -> None:
    """A reader holding the partitioned parents (a slow query, an operator's transaction) does not hold up a new
    workspace's partitions, and they do not queue the readers after it. Made with CREATE TABLE ... PARTITION OF,
    the partitions waited for the first reader with ACCESS EXCLUSIVE asked, and every read after them waited too
    (an outside tester's: answers of 2-5 s at 1,400 workspaces). The new partitions are whole: indexed as the
    parents are, and written through."""
    await migrate(deployment.database_url, deployment.settings)
    pool = await create_pool(deployment.database_url, deployment.settings)
    slow, later = await asyncpg.connect(deployment.database_url), await asyncpg.connect(deployment.database_url)
    parents = "LOCK TABLE ONLY documents, ONLY postings, ONLY term_statistics IN ACCESS SHARE MODE"  # as a read does
    try:
        store = PostgresProjectionStore(pool, "english")
        await store.apply([Delta(1, upsert("first", document("a", "alpha beta")))])
        async with slow.transaction():
            await slow.execute(parents)
            await slow.fetchval("SELECT count(*) FROM documents")
            await asyncio.wait_for(store.apply([Delta(2, upsert("second", document("b", "gamma delta")))]), 10)
            async with later.transaction():
                await later.execute("SET LOCAL lock_timeout = '2s'")
                await later.execute(parents)
        async with deployment.session() as conn:
            indexes = {
                table: await conn.fetchval(
                    "SELECT count(*) FROM pg_indexes WHERE tablename = (SELECT partition_name FROM workspaces"
                    " WHERE workspace = $1)",
                    workspace,
                )
                for table, workspace in (("old", "first"), ("new", "second"))
            }
            found = await conn.fetch("SELECT workspace, id FROM documents ORDER BY workspace")
        assert indexes["new"] == indexes["old"] > 1
        assert [(r["workspace"], r["id"]) for r in found] == [("first", "a"), ("second", "b")]
    finally:
        await slow.close()
        await later.close()
        await pool.close()


async def test_a_projector_with_a_writer_login_writes_rows_and_its_partitions_and_no_other_ddl(
    deployment: Deployment,
) -> None:
    # A login that holds ontofabric_writer and nothing else (docs/security.md). It cannot migrate: the projector
    # waits for `migrate` as the owner, then projects a new workspace, whose partitions only the owner may create.
    login = f"{deployment.settings.subject_prefix}_projector"
    async with deployment.session() as admin:
        await admin.execute(f'CREATE ROLE "{login}" LOGIN')
    settings = deployment.settings.model_copy(
        update={"projector_database_url": deployment.database_url.replace("postgres@", f"{login}@", 1)}
    )
    service = ProjectorService(settings, deployment.nats_url_as("projector"), deployment.database_url)
    try:
        starting = asyncio.create_task(service.start())
        await asyncio.sleep(1.0)
        assert not starting.done()  # waiting for the schema
        await migrate(deployment.database_url, deployment.settings)
        async with deployment.session() as admin:
            await admin.execute(f'GRANT {WRITER_ROLE} TO "{login}"')
        await asyncio.wait_for(starting, 30)
        ack = await deployment.publisher.publish(upsert("acme", document("a", "alpha beta")))
        await deployment.wait_projected(ack.seq)
        assert await _live_rows(deployment, "acme") == {"a": "alpha beta"}
        (pool,) = service._pools.values()
        async with pool.acquire() as conn:
            assert await conn.fetchval("SELECT current_user") == WRITER_ROLE
            for statement in (
                "CREATE TABLE planted (x int)",
                "DROP TABLE documents",
                "ALTER TABLE documents ADD COLUMN planted int",
                "TRUNCATE documents",
                "CREATE FUNCTION planted() RETURNS int LANGUAGE sql AS 'SELECT 1'",
            ):
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await conn.execute(statement)
            partition = await conn.fetchval("SELECT partition_name FROM workspaces WHERE workspace = 'acme'")
            await conn.execute(f"ANALYZE {partition}")  # the projector's statistics refresh
            analysed = await conn.fetchval(
                "SELECT last_analyze IS NOT NULL FROM pg_stat_user_tables WHERE relname = $1", partition
            )
            assert analysed
    finally:
        await service.stop()
        async with deployment.session() as admin:
            await admin.execute(f'DROP OWNED BY "{login}"')
            await admin.execute(f'DROP ROLE IF EXISTS "{login}"')


async def test_the_embedded_projector_writes_through_a_login_that_cannot_become_the_superuser(
    deployment: Deployment, runtime: EmbeddedRuntime
) -> None:
    """As the query worker's (a security tester's): acting as the writer from the superuser's login, a session
    could leave the role (`SET ROLE NONE`) and run programs on the host. The embedded PostgreSQL's projector
    writes through a login of its own; the owner's URL only migrates."""
    assert runtime.endpoints is not None
    writer_login = runtime.endpoints.database_logins["projector"]
    service = ProjectorService(
        deployment.settings, deployment.nats_url_as("projector"), deployment.database_url, writer_login=writer_login
    )
    await service.start()
    try:
        ack = await deployment.publisher.publish(upsert("acme", document("a", "alpha beta")))
        await deployment.wait_projected(ack.seq)
        assert await _live_rows(deployment, "acme") == {"a": "alpha beta"}  # a new workspace's partitions too
        (pool,) = service._pools.values()
        await cannot_become_the_superuser(pool, writer_login[0], WRITER_ROLE, "DROP TABLE documents")
    finally:
        await service.stop()


def _postgres_batches() -> int:
    """Batches the Postgres projector has handled in this process (its batch-duration histogram's count)."""
    points = metric_points("projector.batch.duration_ms")
    return sum(point.count for point in points if point.attributes.get("index") == "postgres")


async def test_while_the_database_is_away_the_projector_backs_off_instead_of_churning(
    deployment: Deployment, projector: ProjectorService
) -> None:
    # Each fetched batch fails at once while the database is away; fetching the next straight away only fails it
    # too (and logs it). The projector waits, longer each time, before it fetches again.
    async with deployment.database_outage():
        acks = await deployment.publisher.publish_many(
            [upsert("acme", document(f"d{i}", f"text {i}")) for i in range(600)]
        )
        before = _postgres_batches()
        await asyncio.sleep(4.0)
        failed = _postgres_batches() - before
    await deployment.wait_projected(acks[-1].seq, timeout_s=60)
    assert await _live_rows(deployment, "acme") == {f"d{i}": f"text {i}" for i in range(600)}
    print(f"batches tried during 4 s of outage: {failed}")
    assert failed <= 8  # pauses of 0.25, 0.5, 1 and 2 s: about five tries


def _gauge(name: str, **labels: str) -> float | None:
    values = [p.value for p in metric_points(name) if all(p.attributes.get(k) == v for k, v in labels.items())]
    return max(values) if values else None


async def _until(condition: Callable[[], bool], timeout_s: float = 15.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.1)


async def test_a_projector_frozen_inside_its_batch_transaction_does_not_stop_the_others(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A red team froze one of three projectors (SIGSTOP) inside its batch transaction: it kept its workspaces'
    version rows locked, and no workspace was projected for as long as the freeze lasted. The server now ends a
    projector's transaction that waits on its client for IDLE_IN_TRANSACTION_S. Here a session of the projector's
    own pool stands for the frozen one: it locks a version row and waits."""
    monkeypatch.setattr(projector_worker, "IDLE_IN_TRANSACTION_S", 2.0)
    service = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
    await service.start()
    try:
        first = await deployment.publisher.publish(upsert("acme", document("a", "before the freeze")))
        await deployment.wait_projected(first.seq)
        (pool,) = service._pools.values()
        async with pool.acquire() as frozen:
            holding = frozen.transaction()
            await holding.start()
            await frozen.execute("SELECT 1 FROM ontology_versions WHERE workspace = 'acme' FOR UPDATE")
            later = await deployment.publisher.publish(upsert("acme", document("b", "during the freeze")))
            await deployment.wait_projected(later.seq, timeout_s=20)  # without the limit: never, while it waits
            with pytest.raises((asyncpg.PostgresConnectionError, asyncpg.InterfaceError)):
                await frozen.execute("SELECT 1")  # the server ended the frozen session
            with contextlib.suppress(Exception):
                await holding.rollback()
        assert (await _live_rows(deployment, "acme"))["b"] == "during the freeze"
    finally:
        await service.stop()


class SeveringProxy:
    """A TCP path to a server that can lose its connections' state, as a firewall or a load balancer that forgets
    a flow does: the connections it held stay open at both ends and nothing sent on them arrives any more (no
    reset, no close); connections made after pass."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._live: list[list[bool]] = []
        """Per connection held, a flag: whether its bytes still pass."""
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self._ends: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    def sever(self) -> None:
        for passing in self._live:
            passing[0] = False

    async def close(self) -> None:
        """Close every connection, severed or not: both ends hear it."""
        assert self._server is not None
        self._server.close()
        for pipe in self._pipes:
            pipe.cancel()
        for end in self._ends:
            end.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(*self._target)
        self._ends += [writer, upstream_writer]
        passing = [True]
        self._live.append(passing)

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await source.read(65536):
                    if passing[0]:  # severed: read and dropped, as a path that lost the flow drops its packets
                        sink.write(data)
                        await sink.drain()
            if passing[0]:  # one end closed: the other hears it, unless the path lost the flow
                sink.close()

        for task in (pipe(reader, upstream_writer), pipe(upstream_reader, writer)):
            self._pipes.add(asyncio.ensure_future(task))


async def test_a_projector_whose_database_connections_lost_their_path_goes_on_over_new_ones(
    deployment: Deployment,
) -> None:
    """A connection whose path lost its state (a firewall's, a load balancer's) never hears back: a statement sent
    on it waited for ever, with the consumer's batch, and its deltas, in hand (the projector kept telling JetStream
    it was working on them). A statement unanswered past the server's own limit is now given up, its connection
    replaced, and the batch sent back."""
    url = urlsplit(deployment.database_url)
    proxy = SeveringProxy(url.hostname or "127.0.0.1", url.port or 5432)
    port = await proxy.start()
    proxied = urlunsplit(url._replace(netloc=f"{url.netloc.rpartition('@')[0]}@127.0.0.1:{port}"))
    settings = deployment.settings.model_copy(update={"database_url": proxied, "statement_timeout_ms": 1000})
    service = ProjectorService(settings, deployment.nats_url_as("projector"), proxied)
    await service.start()
    try:
        first = await deployment.publisher.publish(upsert("acme", document("a", "before")))
        await deployment.wait_projected(first.seq)
        proxy.sever()
        later = await deployment.publisher.publish(upsert("acme", document("b", "after the path was lost")))
        await deployment.wait_projected(later.seq, timeout_s=30)  # before: never
        assert (await _live_rows(deployment, "acme"))["b"] == "after the path was lost"
    finally:
        stopping = asyncio.ensure_future(service.stop())
        stopped, _ = await asyncio.wait({stopping}, timeout=30)
        await proxy.close()  # a stop held by a connection that never hears back ends as the connection closes
        await stopping
        assert stopped, "the projector's stop waited on a connection that never hears back"


async def test_gauges_say_what_the_streams_hold_and_the_most_a_capped_one_may(deployment: Deployment) -> None:
    """A capped delta stream refuses every tenant's new deltas when full: the alert that warns first needs both."""
    capped = deployment.settings.model_copy(update={"delta_stream_max_bytes": 8 * 1024 * 1024})
    service = ProjectorService(capped, deployment.nats_url_as("projector"), deployment.database_url)
    await service.start()  # its start caps the stream
    try:
        names = deployment.names
        ack = await deployment.publisher.publish(upsert("acme", document("a", "x" * 10_000)))
        await deployment.wait_projected(ack.seq)
        await _until(lambda: (_gauge("projector.stream.bytes", stream=names.delta_stream) or 0) > 10_000)
        await _until(lambda: _gauge("projector.stream.max_bytes", stream=names.delta_stream) is not None)
        assert _gauge("projector.stream.max_bytes", stream=names.delta_stream) == 8 * 1024 * 1024
        assert _gauge("projector.stream.bytes", stream=names.dlq_stream) is not None
        assert _gauge("projector.stream.max_bytes", stream=names.dlq_stream) is None  # no limit in bytes
    finally:
        await service.stop()
    # A stopped projector's last reading is not reported as if it were current (a review).
    assert _gauge("projector.stream.bytes", stream=names.delta_stream) is None


async def test_gauges_say_how_far_each_workspace_and_the_consumer_are_behind(
    deployment: Deployment, projector: ProjectorService
) -> None:
    durable = deployment.names.postgres_projector_durable
    caught_up = await deployment.publisher.publish(upsert("steady", document("a", "alpha")))
    await deployment.wait_projected(caught_up.seq)
    # Acked too, not only applied: otherwise it still counts as unacked below, and the floor the lag is measured
    # from may not have reached it yet.
    async with asyncio.timeout(30):
        while await ack_floor(deployment.js, deployment.names.delta_stream, durable) < caught_up.seq:
            await asyncio.sleep(0.05)
    async with deployment.database_outage():
        behind = [await deployment.publisher.publish(upsert("stalled", document(f"d{i}", "beta"))) for i in range(3)]
        first_stalled_seq = behind[0].seq
        # the stalled workspace's newest delta is ahead of what the projector settled there; the steady one is not
        await _until(lambda: (_gauge("projector.workspace.lag", workspace="stalled") or 0) >= 1)
        assert _gauge("projector.workspace.lag", workspace="steady") == 0
        # delivered, not acked: the consumer's own state, asked of JetStream
        await _until(lambda: (_gauge("projector.unacked", consumer=durable) or 0) >= 1)
        # Counted from the ack floor as the projector last read it from JetStream: a reading from before the steady
        # delta's ack counts that one too until the next (it failed once so, beside a busy suite).
        stalled_since_floor = behind[-1].seq - caught_up.seq
        await _until(lambda: _gauge("projector.workspace.lag", workspace="stalled") == stalled_since_floor)
        assert first_stalled_seq > caught_up.seq
    await deployment.wait_projected(behind[-1].seq, timeout_s=60)
    await _until(lambda: _gauge("projector.workspace.lag", workspace="stalled") == 0)
    await _until(lambda: _gauge("projector.unacked", consumer=durable) == 0)


async def test_a_backlog_made_while_no_projector_ran_is_each_workspace_lag_from_its_start(
    deployment: Deployment,
) -> None:
    """An ops tester's: a projector learnt a workspace's newest delta only from the headers republished while it
    ran, so a backlog made while it was down showed no lag (or the few deltas it had sent back) for the workspace
    alert, while its batch could not be written."""
    backlog = [await deployment.publisher.publish(upsert("backlog", document(f"b{i}", "text"))) for i in range(5)]
    floor = await ack_floor(deployment.js, deployment.names.delta_stream, deployment.names.postgres_projector_durable)
    await migrate(deployment.database_url, deployment.settings)  # as the projector's start would, before the lock
    held = await asyncpg.connect(deployment.database_url)
    service = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
    try:
        async with held.transaction():
            await held.execute("LOCK TABLE documents IN SHARE MODE")  # reads go on; no batch is written
            await service.start()
            await _until(lambda: _gauge("projector.workspace.lag", workspace="backlog") == backlog[-1].seq - floor)
        await deployment.wait_projected(backlog[-1].seq, timeout_s=60)
        await _until(lambda: _gauge("projector.workspace.lag", workspace="backlog") == 0)
    finally:
        await service.stop()
        await held.close()


async def test_a_part_set_up_for_another_text_search_configuration_is_refused(deployment: Deployment) -> None:
    """A red team started a second query worker with ONTOFABRIC_TEXT_SEARCH_CONFIG=simple beside an index made
    with english: the same keyword query found the document in 12 of 20 answers, by which worker took it."""
    other = deployment.settings.model_copy(update={"text_search_config": "simple"})
    await migrate(deployment.database_url, deployment.settings)  # the first projector's start records english
    recorded = await deployment.fetch("SELECT text_search_config FROM deployment")
    assert [r["text_search_config"] for r in recorded] == [deployment.settings.text_search_config]
    with pytest.raises(DeploymentMismatch, match="ONTOFABRIC_TEXT_SEARCH_CONFIG"):
        await migrate(deployment.database_url, other)  # a projector's start
    with pytest.raises(DeploymentMismatch, match="made with the text search configuration english"):
        await wait_until_migrated(deployment.database_url, other, timeout_s=5)  # a query worker's
    # A configuration tester's fresh deployment took a name PostgreSQL does not know, and every batch failed.
    unknown = deployment.settings.model_copy(update={"text_search_config": "nosuchconfig"})
    with pytest.raises(DeploymentMismatch, match=r"no text search configuration 'nosuchconfig'; it has .*english"):
        await migrate(deployment.database_url, unknown)
    with pytest.raises(DeploymentMismatch, match="no text search configuration 'nosuchconfig'"):
        await wait_until_migrated(deployment.database_url, unknown, timeout_s=5)
    env = deployment.env() | {"ONTOFABRIC_TEXT_SEARCH_CONFIG": "nosuchconfig"}  # `ontofabric migrate` says it too
    command = [str(Path(sys.executable).parent / "ontofabric"), "migrate"]
    ended = await asyncio.to_thread(subprocess.run, command, env=env, capture_output=True, text=True, timeout=120)
    assert ended.returncode == 2
    assert "no text search configuration 'nosuchconfig'" in " ".join(ended.stderr.split())
    assert "Traceback" not in ended.stderr
