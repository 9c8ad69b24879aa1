"""Rebuilding a workspace from the stream, against a real nats-server and PostgreSQL, with the projector running."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import numpy as np
import pytest
import structlog
from nats.js.api import AckPolicy, ConsumerConfig

from ontofabric.contracts import (
    DeltaEnvelope,
    DocumentReverted,
    LinkAdded,
    NodeUpserted,
    OntologyLink,
    OntologyNode,
    OntologyVersionChanged,
    SecondVector,
    TokenVectors,
)
from ontofabric.services.ingest.client import envelope
from ontofabric.services.ops import rebuild as rebuild_module
from ontofabric.services.ops import shadow as shadow_module
from ontofabric.services.ops import snapshots as snapshots_module
from ontofabric.services.ops.dead_letters import Selection, dead_letters
from ontofabric.services.ops.rebuild import (
    Rebuild,
    RebuildFailed,
    pace_delay,
    paced_batch_size,
    replay_rate,
    retired_schema,
    running_compactions,
    running_rebuilds,
    shadow_schema,
)
from ontofabric.services.ops.snapshots import CompactionRefused, SnapshotFold, compact
from ontofabric.services.ops.status import analysis_status
from ontofabric.services.ops.verification import MADE_HERE, ExpectedIndex, RowFacts, differences, document_facts
from ontofabric.services.projector import worker as projector_worker
from ontofabric.services.projector.planning import (
    Delta,
    EntityRef,
    Handled,
    Limits,
    RowState,
    StateFold,
    VersionState,
    payload_digest,
    plan_batch,
    validate_delta,
)
from ontofabric.services.projector.snapshots import (
    Snapshot,
    StoredDelta,
    find_snapshot_store,
    load_snapshot,
    take_compaction_lock,
)
from ontofabric.services.projector.store import PostgresProjectionStore
from ontofabric.services.projector.worker import ProjectorService
from ontofabric.shared.checksums import content_md5
from ontofabric.shared.db import create_pool, migrate
from ontofabric.shared.late_interaction import pack_signs
from ontofabric.shared.placement import Placement
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names

from .conftest import Deployment, RecordedProgress, with_database
from .factories import delete, document, unit_vector, upsert

DOCUMENT_STATE = (
    "SELECT branch, id, deleted, transparent, stream_seq, content, embedding::text AS embedding,"
    " search_vector::text AS terms, doc_length, token_signs, second_vector, second_model FROM documents"
    " WHERE workspace = $1 ORDER BY branch, id"
)


def _rebuild(
    deployment: Deployment,
    workspace: str = "acme",
    progress: RecordedProgress | None = None,
    *,
    settings: Settings | None = None,
    **options: Any,
) -> Rebuild:
    """A rebuild of the deployment, with its settings unless others are given."""
    return Rebuild(
        settings or deployment.settings, deployment.nats_url, deployment.database_url, workspace,
        progress or RecordedProgress(), **options,
    )  # fmt: skip


def _upsert(workspace: str, doc_id: str, content: str, branch: str = "main") -> DeltaEnvelope:
    return upsert(workspace, document(doc_id, content, embedding=unit_vector(content)), branch=branch)


async def _publish_history(deployment: Deployment) -> int:
    """A workspace with upserts, overwrites, a delete, a branch and its revert, graph nodes and links; and another
    workspace beside it. Returns the last stream sequence."""
    signs = TokenVectors.of_signs(384, pack_signs(np.random.default_rng(7).standard_normal((9, 384))))
    second = SecondVector.of_half("second-model", np.random.default_rng(8).standard_normal(384).astype("<f2").tobytes())
    acme = [_upsert("acme", f"d{i}", f"parse the config file {i}") for i in range(12)]
    acme += [
        _upsert("acme", "d3", "parse the config file, rewritten"),
        delete("acme", "d4"),
        _upsert("acme", "d5", "a branch's own parser: naïve café ✓ 解析", branch="feature/x"),
        _upsert("acme", "d6", "changed on the branch", branch="feature/x"),
        envelope("acme", DocumentReverted(document_id="d6"), branch="feature/x"),
        upsert("acme", document("signed", "with token signs", embedding=unit_vector("signed"), token_vectors=signs,
                                embedding_model=deployment.settings.embedding_model, second_vector=second)),
        envelope("acme", NodeUpserted(node=OntologyNode(domain="demo", name="Parser", kind="class", interfaces=[]))),
        envelope("acme", LinkAdded(link=OntologyLink(source_type="demo.Parser", name="uses", target_type="demo.Cfg"))),
    ]  # fmt: skip
    other = [_upsert("other", f"o{i}", f"other workspace {i}") for i in range(4)]
    acks = await deployment.publisher.publish_many([*acme[:8], *other, *acme[8:]])
    await deployment.wait_projected(acks[-1].seq)
    return acks[-1].seq


def test_the_expected_index_is_the_fold_the_projector_applies_batch_by_batch() -> None:
    envelopes = [
        _upsert("acme", "a", "first"),
        _upsert("acme", "b", "second"),
        _upsert("acme", "a", "first, again"),
        delete("acme", "b"),
        _upsert("acme", "c", "on a branch", branch="dev"),
    ]
    deltas = [Delta(seq, e) for seq, e in enumerate(envelopes, start=1)]
    repeated = Delta(9, envelopes[0])  # the same event republished later: a no-op
    expected = ExpectedIndex("acme")
    assert [expected.add(d) for d in [*deltas, repeated]] == [True, True, True, True, True, False]

    assert expected.rows() == {
        ("main", "document", "a"): document_facts(3, envelopes[2].payload.document),  # type: ignore[union-attr]
        ("main", "document", "b"): RowFacts(4, True, False),
        ("dev", "document", "c"): document_facts(5, envelopes[4].payload.document),  # type: ignore[union-attr]
    }
    assert expected.rows()[("main", "document", "a")].content_md5 == content_md5("first, again")
    # The projector, two batches: the same versions.
    first = plan_batch(deltas[:2], {}, {})
    handled = {
        (d.envelope.workspace, d.envelope.event_id): Handled(d.seq, payload_digest(d.envelope)) for d in deltas[:2]
    }
    second = plan_batch([*deltas[2:], repeated], _rows_after(deltas[:2]), first.versions, handled)
    assert expected.versions() == {branch: v for (_, branch), v in {**first.versions, **second.versions}.items()}
    with pytest.raises(ValueError, match="workspace 'other'"):
        expected.add(Delta(10, _upsert("other", "x", "elsewhere")))


def _rows_after(deltas: list[Delta]) -> dict[EntityRef, RowState]:
    fold = StateFold()
    for delta in deltas:
        fold.add(delta)
    return fold.rows


def test_a_vector_embedded_again_agrees_with_any_of_its_model_and_with_nothing_else() -> None:
    """Made again in another batch, a vector differs in its last bits: its row is vouched for by its content,
    state and sequence, and its vector by its model (a review's: one of another model, or none, agreed too)."""
    made_here = RowFacts(3, False, False, content_md5("x"), MADE_HERE, MADE_HERE, vector_model="next")
    expected = {("main", "document", "d"): made_here}
    versions = {"main": VersionState(3, 1)}

    def found(vector: str | None, signs: str | None, model: str | None, content: str = "x") -> list[str]:
        row = RowFacts(3, False, False, content_md5(content), vector, signs, vector_model=model)
        return differences(expected, {("main", "document", "d"): row}, versions, versions)

    assert found("a1", "b1", "next") == []
    assert found("a2", None, "next") == []  # the model's tokens may be narrower than its vectors: no signs then
    assert found("a1", "b1", "current") != []  # another model's vector
    assert found(None, None, None) != []  # no vector at all
    assert found("a1", "b1", "next", content="y") != []  # other content


def test_differences_name_each_row_and_version_that_differs() -> None:
    live = RowFacts(3, False, False, content_md5("x"))
    expected = {("main", "document", f"d{i}"): live for i in range(14)}
    actual = {**{k: v for k, v in expected.items() if k[2] not in {"d0", "d1"}}, ("main", "node", "demo.T"): live}
    actual[("main", "document", "d2")] = RowFacts(3, False, False, content_md5("y"))
    versions = {"main": VersionState(7, 3)}

    assert differences(expected, expected, versions, versions) == []
    problems = differences(expected, actual, versions, {"main": VersionState(8, 3), "dev": VersionState()}, limit=1)
    assert problems == [
        "2 rows missing: document 'd0' on 'main' (+1 more)",
        "1 rows not in the stream: node 'demo.T' on 'main'",
        f"1 rows different: document 'd2' on 'main' (index seq 3 live, content {content_md5('y')[:8]},"
        f" stream seq 3 live, content {content_md5('x')[:8]})",
        f"branch 'main': ontologyVersion {VersionState(8, 3).label}, the stream folds to {VersionState(7, 3).label}",
    ]


async def _state(deployment: Deployment, workspace: str) -> dict[str, Any]:
    return {
        "documents": [dict(r) for r in await deployment.fetch(DOCUMENT_STATE, workspace)],
        "postings": [
            tuple(r)
            for r in await deployment.fetch(
                "SELECT branch, term, doc_id, tf, doc_length FROM postings WHERE workspace = $1 ORDER BY 1, 2, 3",
                workspace,
            )
        ],
        "nodes": [
            tuple(r)
            for r in await deployment.fetch(
                "SELECT branch, object_type, deleted, name, stream_seq FROM ontology_nodes WHERE workspace = $1",
                workspace,
            )
        ],
        "links": [
            tuple(r)
            for r in await deployment.fetch(
                "SELECT branch, source_type, link_name, target_type, deleted, stream_seq FROM ontology_links"
                " WHERE workspace = $1",
                workspace,
            )
        ],
        "versions": {
            r["branch"]: (r["state_hash"], r["stream_seq"], r["doc_count"], r["total_length"])
            for r in await deployment.fetch("SELECT * FROM ontology_versions WHERE workspace = $1", workspace)
        },
    }


async def _revisions(deployment: Deployment, workspace: str) -> dict[str, int]:
    rows = await deployment.fetch("SELECT branch, revision FROM ontology_versions WHERE workspace = $1", workspace)
    return {r["branch"]: r["revision"] for r in rows}


async def _indexes(deployment: Deployment) -> list[tuple[str, str]]:
    rows = await deployment.fetch(
        "SELECT tablename, indexdef FROM pg_indexes WHERE schemaname = 'public' AND tablename LIKE '%_ws_%'"
        " ORDER BY 1, 2"
    )
    return [(r["tablename"], r["indexdef"]) for r in rows]


async def _schemas(deployment: Deployment) -> list[str]:
    rows = await deployment.fetch("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'ontofabric_rebuild_%'")
    return [r["nspname"] for r in rows]


async def test_a_corrupted_workspace_is_rebuilt_and_the_projector_carries_on(
    deployment: Deployment, projector: ProjectorService
) -> None:
    await _publish_history(deployment)
    before, other_before = await _state(deployment, "acme"), await _state(deployment, "other")
    revisions_before, indexes_before = await _revisions(deployment, "acme"), await _indexes(deployment)
    # What a bad migration or a hand-made fix could leave behind: wrong content, a lost vector, a lost row, lost
    # postings, a lost graph node.
    await deployment.fetch("UPDATE documents SET content = 'garbage', embedding = NULL WHERE id = 'd1'")
    await deployment.fetch("DELETE FROM documents WHERE workspace = 'acme' AND id = 'd2'")
    await deployment.fetch("DELETE FROM postings WHERE workspace = 'acme' AND doc_id = 'd7'")
    await deployment.fetch("DELETE FROM ontology_nodes WHERE workspace = 'acme'")
    # And what an upgrade leaves: documents a projector of an earlier release indexed (another keyword analysis).
    await deployment.fetch("UPDATE documents SET analysis_version = 0 WHERE id IN ('d8', 'd9', 'o1')")
    placement = Placement.of(deployment.settings, deployment.database_url)
    assert (await analysis_status(placement)).documents_of_another_analysis == {"acme": 2, "other": 1}
    assert await _state(deployment, "acme") != before

    progress = RecordedProgress()
    report = await _rebuild(deployment, progress=progress).run()

    assert (report.swapped, report.resumed_from, report.replayed, report.rejected) == (True, 0, 20, Counter())
    assert await _state(deployment, "acme") == before
    assert await _state(deployment, "other") == other_before
    stale = (await analysis_status(placement)).documents_of_another_analysis
    assert stale == {"other": 1}  # acme's indexed again, by this analysis
    assert await _indexes(deployment) == indexes_before  # ATTACH adopted the shadow's indexes, built none anew
    assert await _schemas(deployment) == []
    assert await deployment.fetch("SELECT conname FROM pg_constraint WHERE conname LIKE 'ontofabric_rebuild%'") == []
    revisions = await _revisions(deployment, "acme")
    assert all(revisions[b] > revisions_before[b] for b in revisions_before)
    kv = await deployment.js.key_value(deployment.names.version_bucket)
    for branch in ("main", "feature/x"):
        entry = await kv.get(deployment.names.version_key("acme", branch))
        assert entry.value is not None
        announced = OntologyVersionChanged.model_validate_json(entry.value)
        assert (announced.revision, announced.ontology_version) == (revisions[branch], report.versions[branch])
    assert all(progress.done[stage] == total for stage, total in progress.totals.items()), progress.done

    # The live projector writes into the swapped-in partition, from the revision the rebuild left.
    ack = await deployment.publisher.publish(upsert("acme", document("d99", "after the rebuild")))
    await deployment.wait_projected(ack.seq)
    rows = await deployment.fetch("SELECT content FROM documents WHERE workspace = 'acme' AND id = 'd99'")
    assert [r["content"] for r in rows] == ["after the rebuild"]
    postings = await deployment.fetch("SELECT count(*) AS n FROM postings WHERE doc_id = 'd99'")
    assert postings[0]["n"] > 0
    assert (await _revisions(deployment, "acme"))["main"] == revisions["main"] + 1


async def test_the_replay_reads_the_stream_once_when_other_workspaces_deltas_follow_the_last_of_its_own(
    deployment: Deployment, projector: ProjectorService
) -> None:
    """Each pass went on from the workspace's last delta, so with more of another workspace's after it than a
    batch, every one of the five passes read them again (a tester's progress: 22,802 over a stream of 5,398)."""
    await _publish_history(deployment)
    acks = await deployment.publisher.publish_many([_upsert("other", f"later{i}", f"later {i}") for i in range(10)])
    await deployment.wait_projected(acks[-1].seq)

    class Stages(RecordedProgress):
        def __init__(self) -> None:
            super().__init__()
            self.started: Counter[str] = Counter()

        def stage(self, name: str, total: int) -> None:
            super().stage(name, total)
            self.started[name] += 1

    progress = Stages()
    settings = deployment.settings.model_copy(update={"projector_batch_size": 4})
    report = await _rebuild(deployment, progress=progress, settings=settings).run()
    assert report.swapped
    assert progress.started["replay"] == 1
    assert progress.totals["replay"] == acks[-1].seq  # the whole stream, once


async def test_deltas_published_during_the_rebuild_are_in_the_swapped_index(
    deployment: Deployment, projector: ProjectorService, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _publish_history(deployment)
    late: list[int] = []
    prepare = shadow_module.Shadow.prepare_for_swap

    async def publish_then_prepare(shadow: shadow_module.Shadow) -> None:
        # Between the replay and the swap: the live projector applies these, the swap must catch up with them.
        acks = await deployment.publisher.publish_many(
            [upsert("acme", document("late", "published mid-rebuild")), delete("acme", "d0")]
        )
        await deployment.wait_projected(acks[-1].seq)
        late.append(acks[-1].seq)
        await prepare(shadow)

    monkeypatch.setattr(shadow_module.Shadow, "prepare_for_swap", publish_then_prepare)
    live = await _rebuild(deployment).run()
    assert live.swapped
    assert len(late) == 1
    rows = await deployment.fetch("SELECT id, deleted FROM documents WHERE id IN ('late', 'd0')")
    assert {r["id"]: r["deleted"] for r in rows} == {"late": False, "d0": True}
    versions = await deployment.fetch("SELECT branch, stream_seq FROM ontology_versions WHERE workspace = 'acme'")
    assert {r["branch"]: r["stream_seq"] for r in versions}["main"] == late[0]


async def test_a_shadow_that_differs_from_the_stream_is_never_swapped_in(
    deployment: Deployment, projector: ProjectorService, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _publish_history(deployment)
    before = await _state(deployment, "acme")
    prepare = shadow_module.Shadow.prepare_for_swap
    schema = shadow_schema("acme")

    async def corrupt_then_prepare(shadow: shadow_module.Shadow) -> None:
        await deployment.fetch(f"UPDATE \"{schema}\".documents SET content = 'lost' WHERE id = 'd1'")
        await deployment.fetch(f"DELETE FROM \"{schema}\".postings WHERE doc_id = 'd8'")
        await deployment.fetch(f"UPDATE \"{schema}\".documents SET embedding = embedding + embedding WHERE id = 'd3'")
        await deployment.fetch(f"UPDATE \"{schema}\".documents SET second_vector = NULL WHERE id = 'signed'")
        await prepare(shadow)

    monkeypatch.setattr(shadow_module.Shadow, "prepare_for_swap", corrupt_then_prepare)
    with pytest.raises(RebuildFailed) as failure:
        await _rebuild(deployment).run()
    message = str(failure.value)
    assert "3 rows different: document 'd1' on 'main'" in message
    assert "postings for" in message
    assert "document 'd3' on 'main' (index seq" in message  # its vector, though its content is right
    assert "document 'signed' on 'main' (index seq" in message  # its second vector, gone
    assert await _state(deployment, "acme") == before
    assert await _schemas(deployment) == [schema]  # kept for inspection
    assert await _rebuild(deployment).discard() is True
    assert await _schemas(deployment) == []
    assert await _rebuild(deployment).discard() is False


async def test_an_interrupted_rebuild_resumes_and_verifies_the_whole_stream(
    deployment: Deployment, projector: ProjectorService, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _publish_history(deployment)
    before = await _state(deployment, "acme")
    settings = deployment.settings.model_copy(update={"projector_batch_size": 5})
    record = shadow_module.Shadow.record
    calls = 0

    async def crash_after_two_batches(shadow: shadow_module.Shadow, *args: Any) -> None:
        nonlocal calls
        calls += 1
        if calls > 2:
            raise ConnectionResetError("the operator's laptop went to sleep")
        await record(shadow, *args)

    monkeypatch.setattr(shadow_module.Shadow, "record", crash_after_two_batches)
    interrupted = _rebuild(deployment, settings=settings)
    with pytest.raises(ConnectionResetError):
        await interrupted.run()
    assert await _state(deployment, "acme") == before
    monkeypatch.setattr(shadow_module.Shadow, "record", record)

    progress = RecordedProgress()
    resumed = await _rebuild(deployment, progress=progress, settings=settings).run()
    assert resumed.swapped
    assert resumed.resumed_from > 0
    assert progress.totals["refold"] == resumed.resumed_from
    assert resumed.replayed < 20
    assert await _state(deployment, "acme") == before


async def test_rejected_deltas_are_counted_and_not_dead_lettered_again(
    deployment: Deployment, projector: ProjectorService
) -> None:
    await _publish_history(deployment)
    subject = deployment.names.delta_subject("acme", "main")
    ack = await deployment.js.publish(subject, b'{"not": "a delta"}')
    await deployment.wait_projected(ack.seq)
    dead_letters = (await deployment.js.stream_info(deployment.names.dlq_stream)).state.messages
    assert dead_letters == 1

    report = await _rebuild(deployment).run()
    assert report.rejected == Counter({"invalid_schema": 1})
    assert (await deployment.js.stream_info(deployment.names.dlq_stream)).state.messages == dead_letters


async def test_a_stream_that_lost_its_first_deltas_is_refused(
    deployment: Deployment, projector: ProjectorService
) -> None:
    await _publish_history(deployment)
    before = await _state(deployment, "acme")
    await deployment.js.purge_stream(deployment.names.delta_stream, seq=3)  # drops sequences 1 and 2
    with pytest.raises(RebuildFailed, match="starts at sequence 3"):
        await _rebuild(deployment).run()
    assert await _state(deployment, "acme") == before
    assert await _schemas(deployment) == []


async def test_a_workspace_with_no_deltas_is_refused(deployment: Deployment, projector: ProjectorService) -> None:
    await _publish_history(deployment)
    with pytest.raises(RebuildFailed, match="no deltas of workspace 'nobody'"):
        await _rebuild(deployment, "nobody").run()
    assert await _schemas(deployment) == []


async def test_each_schema_s_writer_analyses_its_own_partitions(deployment: Deployment) -> None:
    """A shadow's partitions have the live ones' names: each store must find and analyse those of its schema."""
    schema = shadow_schema("busy")
    await migrate(deployment.database_url, deployment.settings)
    await migrate(deployment.database_url, deployment.settings, schema=schema)
    live_pool = await create_pool(deployment.database_url, deployment.settings)
    shadow_pool = await create_pool(deployment.database_url, deployment.settings, schema=schema)
    try:
        live, shadow = PostgresProjectionStore(live_pool, "english"), PostgresProjectionStore(shadow_pool, "english")
        await live.apply([Delta(1, upsert("busy", document("first", "text")))])
        assert len(await live.refresh_statistics(["busy"])) == 0  # one row: not stale yet
        await shadow.apply([Delta(i, upsert("busy", document(f"d{i}", f"text {i}"))) for i in range(1, 81)])
        assert await live.refresh_statistics(["busy"]) == []  # only the shadow's partitions changed
        analysed = await shadow.refresh_statistics(["busy"])
        assert [name.split("_ws_")[0] for name in analysed] == ["documents", "postings", "term_statistics"]
        rows = await deployment.fetch(
            "SELECT schemaname, last_analyze IS NOT NULL AS analysed FROM pg_stat_user_tables"
            " WHERE relname LIKE 'documents_ws_%'"
        )
        assert {r["schemaname"]: r["analysed"] for r in rows} == {"public": False, schema: True}
    finally:
        await live_pool.close()
        await shadow_pool.close()


async def test_a_delta_published_while_the_swap_holds_the_lock_lands_after_it(
    deployment: Deployment, projector: ProjectorService, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _publish_history(deployment)
    swap_into = shadow_module.Shadow.swap_into
    published: list[int] = []

    async def publish_then_swap(shadow: shadow_module.Shadow, *args: Any) -> float:
        # Past the catch-up, with the projectors held off: only the live projector, after the commit, can apply it.
        published.append((await deployment.publisher.publish(_upsert("acme", "locked", "during the swap"))).seq)
        return await swap_into(shadow, *args)

    monkeypatch.setattr(shadow_module.Shadow, "swap_into", publish_then_swap)
    assert (await _rebuild(deployment).run()).swapped
    await deployment.wait_projected(published[0])
    rows = await deployment.fetch("SELECT content FROM documents WHERE workspace = 'acme' AND id = 'locked'")
    assert [r["content"] for r in rows] == ["during the swap"]


async def test_a_query_holding_one_parent_and_waiting_for_the_other_is_not_deadlocked(
    deployment: Deployment, projector: ProjectorService
) -> None:
    """A keyword statement reads postings, then documents: the swap must give way, not close a lock cycle."""
    await _publish_history(deployment)
    async with deployment.session() as reader:
        async with reader.transaction(isolation="repeatable_read", readonly=True):
            await reader.fetch("SELECT count(*) FROM postings WHERE workspace = 'other'")
            rebuilding = asyncio.create_task(_rebuild(deployment).run())
            await asyncio.sleep(1.5)  # the swap is asking for the parents by now
            other = await reader.fetch("SELECT id FROM documents WHERE workspace = 'other'")
        report = await rebuilding
    assert len(other) == 4
    assert report.swapped


async def test_a_swap_that_cannot_get_its_locks_gives_up_and_can_be_run_again(
    deployment: Deployment, projector: ProjectorService
) -> None:
    await _publish_history(deployment)
    before = await _state(deployment, "acme")
    # What a long transaction writing versions would hold.
    async with deployment.session() as blocker, blocker.transaction():
        await blocker.execute("LOCK TABLE ontology_versions IN ROW EXCLUSIVE MODE")
        job = _rebuild(deployment, lock_timeout_s=0.5)
        with pytest.raises(RebuildFailed, match="could not take its locks") as failure:
            await job.run()
    assert failure.value.resumable
    assert await _state(deployment, "acme") == before
    assert await _schemas(deployment) == [shadow_schema("acme")]
    resumed = await _rebuild(deployment).run()
    assert resumed.swapped
    assert resumed.replayed == 0  # everything was replayed by the first run
    assert await _state(deployment, "acme") == before


async def test_a_second_rebuild_of_the_same_workspace_is_refused(
    deployment: Deployment, projector: ProjectorService
) -> None:
    await _publish_history(deployment)
    async with deployment.session() as holder:
        await holder.execute("SELECT pg_advisory_lock(hashtext('ontofabric.rebuild'), hashtext('acme'))")
        with pytest.raises(RebuildFailed, match="another rebuild of workspace 'acme' is running") as refused:
            await _rebuild(deployment).run()
        # Nothing to resume: what to do is to wait (a tester read "run again to resume").
        assert refused.value.advice == "this one did nothing: wait for that one to end"
        assert (await _rebuild(deployment, "other").run()).swapped  # another workspace may go meanwhile
    assert await _schemas(deployment) == []


async def test_live_rows_the_stream_does_not_account_for_stop_the_swap(
    deployment: Deployment, projector: ProjectorService
) -> None:
    """Run with other limits than the projector's, the rebuild would reject deltas the live index holds."""
    await _publish_history(deployment)
    before = await _state(deployment, "acme")
    stricter = deployment.settings.model_copy(update={"max_content_bytes": 25})
    job = _rebuild(deployment, settings=stricter)
    with pytest.raises(RebuildFailed, match=r"not swapping.* live rows the stream does not account for") as failure:
        await job.run()
    assert not failure.value.resumable
    assert "document 'd3' on 'main'" in str(failure.value)  # the rows that would be lost, and why: the rejections
    assert "this replay rejected 2 content_too_large" in str(failure.value)
    assert await _state(deployment, "acme") == before
    assert await _rebuild(deployment).discard() is True
    other_model = deployment.settings.model_copy(update={"embedding_model": "another-model"})
    job = _rebuild(deployment, settings=other_model)
    with pytest.raises(RebuildFailed, match=r"database holds .* vectors .* set up for another-model"):
        await job.run()
    assert await _schemas(deployment) == []
    newest = max(r["version"] for r in await deployment.fetch("SELECT version FROM schema_migrations"))
    await deployment.fetch("DELETE FROM schema_migrations WHERE version = $1", newest)  # workers one version behind
    with pytest.raises(RebuildFailed, match=f"live schema is at migration {newest - 1}, this command's at {newest}"):
        await _rebuild(deployment).run()
    assert await _schemas(deployment) == []


async def test_a_forced_swap_says_what_it_dropped_and_what_the_run_it_resumes_rejected(
    deployment: Deployment, projector: ProjectorService
) -> None:
    """An upgrade tester's `rebuild --force`, after a run that refused to swap, said "rejected: none" and nothing
    of the live rows it dropped."""
    await _publish_history(deployment)
    stricter = deployment.settings.model_copy(update={"max_content_bytes": 25})
    with pytest.raises(RebuildFailed, match="not swapping"):
        await _rebuild(deployment, settings=stricter).run()
    forced = await _rebuild(deployment, settings=stricter, force=True).run()
    assert forced.swapped
    assert forced.resumed_from > 0
    assert forced.rejected == Counter({"content_too_large": 2})
    assert len(forced.dropped) == 1
    assert "document 'd3' on 'main'" in forced.dropped[0]


async def test_a_branch_only_the_live_index_has_keeps_announcing(
    deployment: Deployment, projector: ProjectorService
) -> None:
    await _publish_history(deployment)
    await deployment.fetch(
        "INSERT INTO ontology_versions (workspace, branch, state_hash, stream_seq, revision)"
        " VALUES ('acme', 'ghost', 42, 7, 5)"
    )
    report = await _rebuild(deployment).run()
    assert report.versions["ghost"] == VersionState().label
    rows = await deployment.fetch(
        "SELECT state_hash, stream_seq, revision FROM ontology_versions WHERE branch = 'ghost'"
    )
    assert [tuple(r) for r in rows] == [(0, 0, 6)]
    kv = await deployment.js.key_value(deployment.names.version_bucket)
    entry = await kv.get(deployment.names.version_key("acme", "ghost"))
    assert entry.value is not None
    assert OntologyVersionChanged.model_validate_json(entry.value).revision == 6


async def test_a_swap_committed_but_never_announced_is_announced_by_the_next_run(
    deployment: Deployment, projector: ProjectorService, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _publish_history(deployment)
    kv = await deployment.js.key_value(deployment.names.version_bucket)
    key = deployment.names.version_key("acme", "main")

    async def announced() -> int:
        entry = await kv.get(key)
        assert entry.value is not None
        return OntologyVersionChanged.model_validate_json(entry.value).revision

    before = await announced()
    swap = rebuild_module.Rebuild._swap
    announce = rebuild_module.Rebuild._announce

    async def swap_then_stop(job: Rebuild, *args: Any) -> None:
        async def stop(*_: Any) -> dict[str, str]:
            raise ConnectionResetError("stopped between the commit and the announcement")

        monkeypatch.setattr(rebuild_module.Rebuild, "_announce", stop)
        await swap(job, *args)

    monkeypatch.setattr(rebuild_module.Rebuild, "_swap", swap_then_stop)
    with pytest.raises(ConnectionResetError):
        await _rebuild(deployment).run()
    # Committed: nothing to resume, only the replaced partitions, which were to be dropped after the announcement.
    assert await _schemas(deployment) == [retired_schema("acme")]
    assert await announced() == before
    monkeypatch.setattr(rebuild_module.Rebuild, "_announce", announce)
    assert await _rebuild(deployment).discard() is False
    assert await announced() == (await _revisions(deployment, "acme"))["main"] == before + 1
    assert await _schemas(deployment) == []


async def test_a_projector_behind_the_rebuild_finds_its_deltas_already_applied(
    deployment: Deployment, projector: ProjectorService
) -> None:
    await _publish_history(deployment)
    await projector.stop()  # down while more deltas arrive: the rebuild gets ahead of it
    late = await deployment.publisher.publish_many(
        [_upsert("acme", "late", "while the projector was down"), delete("acme", "d9")]
    )
    report = await _rebuild(deployment).run()
    assert report.swapped
    ahead = await _state(deployment, "acme")
    assert {d["id"]: d["deleted"] for d in ahead["documents"]}["late"] is False
    handled = await deployment.fetch(
        "SELECT stream_seq FROM handled_events WHERE stream_seq = ANY($1::bigint[])", [ack.seq for ack in late]
    )
    assert len(handled) == 2  # so even a copy republished later is a no-op for the projector
    restarted = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
    await restarted.start()
    try:
        await deployment.wait_projected(late[-1].seq)
    finally:
        await restarted.stop()
    assert await _state(deployment, "acme") == ahead  # its deltas were no-ops: the events were handled


def test_the_replay_waits_only_as_long_as_its_rate_asks() -> None:
    assert pace_delay(100, 0.5, None) == 0.0
    assert pace_delay(100, 0.5, 100.0) == pytest.approx(0.5)  # 100 done in half the second they were allowed
    assert pace_delay(100, 2.0, 100.0) == 0.0  # behind already: no wait
    assert pace_delay(0, 0.0, 10.0) == 0.0


def test_a_replay_rate_is_a_positive_number_or_none() -> None:
    assert replay_rate(None) is None
    assert replay_rate(float("inf")) is None  # the command line takes it: as fast as the database takes them
    assert replay_rate(2.5) == 2.5
    for wrong in (0.0, -1.0, float("nan")):  # NaN divided every pause (a review's)
        with pytest.raises(ValueError, match="max_rate must be positive"):
            replay_rate(wrong)


def test_a_paced_replay_goes_a_seconds_worth_at_a_time() -> None:
    assert paced_batch_size(500, None) == 500
    assert paced_batch_size(500, 2.0) == 2  # a minute's worth (120) went in at once, then the replay slept
    assert paced_batch_size(500, 0.5) == 1
    assert paced_batch_size(100, 1000.0) == 100


async def test_a_paced_rebuild_spreads_its_writes_over_the_time_its_rate_asks(
    deployment: Deployment, projector: ProjectorService
) -> None:
    """An operator tester's: `rebuild --max-rate 2` replayed 120 deltas in its first 5 s, then sat for a minute."""
    await _publish_history(deployment)
    progress = RecordedProgress()
    rebuilding = asyncio.create_task(_rebuild(deployment, progress=progress, max_rate=4.0).run())
    seen: list[int] = []
    while not rebuilding.done():
        seen.append(progress.done["replay"])
        await asyncio.sleep(0.05)
    assert (await rebuilding).swapped
    steps = [after - before for before, after in itertools.pairwise(seen) if after > before]
    # Four of acme's deltas a step, with at most the other workspace's four between them (progress counts stream
    # sequences); the whole history (24 sequences) had come in one step.
    assert len(steps) >= 4, steps
    assert max(steps) <= 8, steps
    # And from a snapshot, after a compaction (daily, as advised): it had gone in at full speed whatever the rate.
    await compact(deployment.nc, deployment.names, deployment.settings, RecordedProgress())
    progress = RecordedProgress()
    rebuilding = asyncio.create_task(_rebuild(deployment, progress=progress, max_rate=4.0).run())
    seen = []
    while not rebuilding.done():
        seen.append(progress.done["snapshot"])
        await asyncio.sleep(0.05)
    report = await rebuilding
    assert report.swapped
    assert report.restored >= 12
    steps = [after - before for before, after in itertools.pairwise(seen) if after > before]
    assert len(steps) >= 3, steps
    assert max(steps) <= 4, steps


async def test_a_paced_rebuild_rebuilds_the_same_index(deployment: Deployment, projector: ProjectorService) -> None:
    await _publish_history(deployment)
    before = await _state(deployment, "acme")
    await deployment.fetch("DELETE FROM documents WHERE workspace = 'acme' AND id = 'd2'")
    settings = deployment.settings.model_copy(update={"projector_batch_size": 5})
    job = _rebuild(deployment, settings=settings, max_rate=40.0)
    assert (await job.run()).swapped
    assert await _state(deployment, "acme") == before
    with pytest.raises(ValueError, match="max_rate must be positive"):
        _rebuild(deployment, max_rate=0)


async def test_a_live_row_written_during_the_swap_s_catch_up_is_not_lost(
    deployment: Deployment, projector: ProjectorService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The live projector applies a delta after the check before the lock, which this rebuild (other limits)
    rejects in its catch-up: the swap must refuse, not drop the row."""
    await _publish_history(deployment)
    prepare = shadow_module.Shadow.prepare_for_swap

    async def publish_then_prepare(shadow: shadow_module.Shadow) -> None:
        ack = await deployment.publisher.publish(_upsert("acme", "large", "x" * 3000))
        await deployment.wait_projected(ack.seq)
        await prepare(shadow)

    monkeypatch.setattr(shadow_module.Shadow, "prepare_for_swap", publish_then_prepare)
    stricter = deployment.settings.model_copy(update={"max_content_bytes": 1024})
    job = _rebuild(deployment, settings=stricter)
    with pytest.raises(RebuildFailed, match=r"not swapping.*document 'large' on 'main'"):
        await job.run()
    rows = await deployment.fetch("SELECT length(content) AS n FROM documents WHERE id = 'large'")
    assert [r["n"] for r in rows] == [3000]


async def test_the_swap_waits_for_no_other_workspace_s_maintenance(
    deployment: Deployment, projector: ProjectorService
) -> None:
    """VACUUM or ANALYZE of another workspace's partition holds a lock the swap must not need."""
    await _publish_history(deployment)
    other = (await deployment.fetch("SELECT partition_name FROM workspaces WHERE workspace = 'other'"))[0][0]
    async with deployment.session() as maintenance, maintenance.transaction():
        await maintenance.execute(f'LOCK TABLE "{other}" IN SHARE UPDATE EXCLUSIVE MODE')
        job = _rebuild(deployment, lock_timeout_s=2.0)
        assert (await job.run()).swapped


def _random_history(rng: random.Random, length: int) -> list[StoredDelta]:
    """Upserts, deletes, branch reverts, repeats of earlier events and undecodable deltas, in stream order."""
    names = Names()
    stored: list[StoredDelta] = []
    sent: list[DeltaEnvelope] = []
    for seq in range(1, length + 1):
        roll, doc_id, branch = rng.random(), rng.choice("abcde"), rng.choice(["main", "main", "dev"])
        if roll < 0.1 and sent:
            env = rng.choice(sent)  # the same event again (a copy published after the duplicate window)
        elif roll < 0.15:
            stored.append(StoredDelta(seq, names.delta_subject("acme", branch), b"{not json"))
            continue
        elif roll < 0.35:
            env = delete("acme", doc_id, branch=branch)
        elif roll < 0.45 and branch == "dev":
            env = envelope("acme", DocumentReverted(document_id=doc_id), branch="dev")
        else:
            env = _upsert("acme", doc_id, f"{doc_id} at {seq}", branch=branch)
        sent.append(env)
        data = env.model_dump_json(exclude_none=True).encode()
        stored.append(StoredDelta(seq, names.delta_subject("acme", env.branch), data))
    return stored


def _expected(deltas: list[StoredDelta], snapshot: Snapshot | None = None) -> ExpectedIndex:
    limits = Limits.from_settings(Settings())
    expected = ExpectedIndex("acme")
    for stored in snapshot.deltas if snapshot else ():
        checked = validate_delta(stored.data, stored.subject, stored.seq, limits)
        assert isinstance(checked, Delta)
        assert expected.add(checked)  # each kept delta applies: it is its row's last
    if snapshot:
        expected.mark_handled(snapshot.handled.keys())
    for stored in deltas:
        checked = validate_delta(stored.data, stored.subject, stored.seq, limits)
        if isinstance(checked, Delta):
            expected.add(checked)
    return expected


@pytest.mark.parametrize("seed", range(30))
def test_a_snapshot_and_the_stream_after_it_fold_to_what_the_whole_stream_folds_to(seed: int) -> None:
    rng = random.Random(seed)
    history = _random_history(rng, 80)
    first_cut, second_cut = sorted(rng.sample(range(1, 80), 2))
    limits = Limits.from_settings(Settings())
    # compacted twice: the second fold goes on from the first snapshot (stored and read back)
    fold = SnapshotFold("acme", limits)
    for stored in history[:first_cut]:
        fold.add(stored)
    first = Snapshot.decode(fold.snapshot().encode())
    fold = SnapshotFold("acme", limits, first)
    for stored in history[first_cut:second_cut]:
        fold.add(stored)
    second = fold.snapshot()
    assert second.covers == second_cut
    assert len(second.deltas) <= 10  # one per row: five ids on two branches
    whole = _expected(history)
    for snapshot, tail in ((first, history[first_cut:]), (second, history[second_cut:])):
        rebuilt = _expected(tail, snapshot)
        assert rebuilt.rows() == whole.rows()
        assert rebuilt.versions() == whole.versions()


async def test_a_compacted_stream_is_rebuilt_from_the_snapshots_and_the_deltas_after_them(
    deployment: Deployment, projector: ProjectorService
) -> None:
    last = await _publish_history(deployment)
    names = deployment.names
    stream_before = (await deployment.js.stream_info(names.delta_stream)).state
    # a consumer of another partition layout that has applied nothing yet holds the compaction back
    await deployment.js.add_consumer(
        names.delta_stream,
        ConsumerConfig(durable_name=names.postgres_projector_durables(2)[0], ack_policy=AckPolicy.EXPLICIT),
    )
    held = await compact(deployment.nc, names, deployment.settings, RecordedProgress())
    assert (held.covers, held.purged) == (0, 0)
    await deployment.js.delete_consumer(names.delta_stream, names.postgres_projector_durables(2)[0])
    report = await compact(deployment.nc, names, deployment.settings, RecordedProgress())
    assert (report.covers, report.workspaces, report.deltas_read) == (last, 2, stream_before.messages)
    assert report.snapshot_bytes < stream_before.bytes
    state = (await deployment.js.stream_info(names.delta_stream)).state
    assert (state.messages, state.first_seq) == (0, last + 1)  # bounded: only what comes after the snapshots
    # the tail: an overwrite, a delete and a new document of acme
    acks = await deployment.publisher.publish_many(
        [_upsert("acme", "d3", "parse it once more"), delete("acme", "d5"), _upsert("acme", "new", "after it")]
    )
    await deployment.wait_projected(acks[-1].seq)
    before, other_before = await _state(deployment, "acme"), await _state(deployment, "other")
    await deployment.fetch("UPDATE documents SET content = 'garbage' WHERE workspace = 'acme' AND id = 'd1'")
    await deployment.fetch("DELETE FROM ontology_links WHERE workspace = 'acme'")

    rebuilt = await _rebuild(deployment).run()

    assert rebuilt.swapped
    assert (rebuilt.restored, rebuilt.replayed) == (len(await _snapshot_deltas(deployment, "acme")), 3)
    assert await _state(deployment, "acme") == before
    assert await _state(deployment, "other") == other_before
    # a second compaction folds the tail onto the snapshot; the rebuild after it reads the snapshot alone
    again = await compact(deployment.nc, names, deployment.settings, RecordedProgress())
    assert (again.covers, again.workspaces, again.deltas_read) == (acks[-1].seq, 1, 3)
    assert (await _rebuild(deployment).run()).replayed == 0
    assert await _state(deployment, "acme") == before


async def test_a_compaction_counts_the_deltas_it_dropped_while_others_are_published(
    deployment: Deployment, projector: ProjectorService
) -> None:
    """A tester's compaction beside an ingest said "-870 deltas dropped": it counted the stream's messages before
    and after, and the ingest's went in between."""
    last = await _publish_history(deployment)
    through = (await deployment.js.stream_info(deployment.names.delta_stream)).state.messages
    published: list[asyncio.Task[object]] = []

    class PublishingMeanwhile(RecordedProgress):
        def advance(self, name: str, amount: int = 1) -> None:
            super().advance(name, amount)
            deltas = [_upsert("later", f"l{i}", "published during the compaction") for i in range(20)]
            published.append(asyncio.get_running_loop().create_task(deployment.publisher.publish_many(deltas)))

    report = await compact(deployment.nc, deployment.names, deployment.settings, PublishingMeanwhile())
    await asyncio.gather(*published)
    assert report.covers == last
    assert report.purged == through


async def test_a_compaction_whose_purge_failed_is_purged_by_the_next_run(
    deployment: Deployment, projector: ProjectorService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review's: a run whose purge failed after its snapshots and marker were stored said to run again, and the
    next run, finding nothing new to fold, dropped nothing."""
    last = await _publish_history(deployment)
    through = (await deployment.js.stream_info(deployment.names.delta_stream)).state.messages

    async def refused(*_: object) -> None:
        raise CompactionRefused("the stream could not be purged")

    purge = snapshots_module._purge_below
    monkeypatch.setattr(snapshots_module, "_purge_below", refused)
    with pytest.raises(CompactionRefused):
        await compact(deployment.nc, deployment.names, deployment.settings, RecordedProgress())
    monkeypatch.setattr(snapshots_module, "_purge_below", purge)
    again = await compact(deployment.nc, deployment.names, deployment.settings, RecordedProgress())
    assert (again.covers, again.purged) == (last, through)
    state = (await deployment.js.stream_info(deployment.names.delta_stream)).state
    assert (state.messages, state.first_seq) == (0, last + 1)


async def _snapshot_deltas(deployment: Deployment, workspace: str) -> list[StoredDelta]:
    store = await find_snapshot_store(deployment.js, deployment.names)
    assert store is not None
    snapshot = await load_snapshot(store, workspace)
    assert snapshot is not None
    return snapshot.deltas


async def test_a_stream_that_lost_deltas_no_snapshot_holds_is_refused_by_compaction_and_rebuild(
    deployment: Deployment, projector: ProjectorService
) -> None:
    await _publish_history(deployment)
    await compact(deployment.nc, deployment.names, deployment.settings, RecordedProgress())
    acks = await deployment.publisher.publish_many([_upsert("acme", f"late{i}", "later") for i in range(3)])
    await deployment.wait_projected(acks[-1].seq)
    # what an age limit shorter than the compaction interval would do: deltas gone before a snapshot held them
    await deployment.js.purge_stream(deployment.names.delta_stream, seq=acks[1].seq)
    with pytest.raises(CompactionRefused, match=f"starts at sequence {acks[1].seq}"):
        await compact(deployment.nc, deployment.names, deployment.settings, RecordedProgress())
    with pytest.raises(RebuildFailed, match=f"snapshots cover only up to {acks[0].seq - 1}"):
        await _rebuild(deployment).run()


def test_a_fold_leaves_out_what_the_projector_set_aside_and_refuses_what_only_its_own_settings_refuse() -> None:
    names = Names()
    subject = names.delta_subject("acme", "main")
    first, big = _upsert("acme", "a", "short"), _upsert("acme", "a", "x" * 2000)
    stored = [StoredDelta(seq, subject, env.model_dump_json().encode()) for seq, env in ((1, first), (2, big))]
    tight = Limits.from_settings(Settings(max_content_bytes=1024))
    fold = SnapshotFold("acme", tight)
    fold.add(stored[0])
    fold.add(stored[1], set_aside={2})  # the projector dead-lettered it: the row stays at the first
    assert [d.seq for d in fold.snapshot().deltas] == [1]
    refusing = SnapshotFold("acme", tight)
    refusing.add(stored[1])  # refused by these settings, with no dead letter of it
    assert [r.seq for r in refusing.refused] == [2]
    with pytest.raises(CompactionRefused, match=r"delta 2 .*content_too_large"):
        refusing.check_refused({(big.event_id, 2)})  # handled at its own sequence: the projector applied it
    with pytest.raises(CompactionRefused, match=r"delta 2 .*content_too_large"):
        refusing.check_refused({(big.event_id, 7), (big.event_id, 2)})  # a legacy row and a later copy's: either
    with pytest.raises(CompactionRefused, match=r"delta 2 "):
        refusing.check_refused(None)  # the index not read: no telling
    refusing.check_refused(set())  # the index never handled it: dead-lettered, its letter purged since
    refusing.check_refused({(big.event_id, 7)})  # handled as another copy of the event, not this one
    assert refusing.snapshot().deltas == []
    # a snapshot folded with looser settings is not judged again by tighter ones
    loose = SnapshotFold("acme", Limits.from_settings(Settings()))
    for delta in stored:
        loose.add(delta)
    assert [d.seq for d in SnapshotFold("acme", tight, loose.snapshot()).snapshot().deltas] == [2]


def test_a_fold_keeps_as_stored_a_delta_the_index_applied_that_this_release_cannot_read() -> None:
    """A delta an earlier release applied under looser rules (here a NUL in its metadata, refused since) was left
    out of the snapshot as never applied, and the stream then purged of it: the row the index holds lost its only
    source. A snapshot holding such a delta made the next compaction raise a ValidationError."""
    names = Names()
    subject = names.delta_subject("acme", "main")
    fine = _upsert("acme", "a", "fine")
    body = json.loads(_upsert("acme", "b", "older").model_dump_json())
    body["payload"]["document"]["metadata"] = {"note": "a\u0000b"}
    stored = [
        StoredDelta(1, subject, fine.model_dump_json().encode()),
        StoredDelta(2, subject, json.dumps(body).encode()),
        StoredDelta(3, subject, b'{"eventId": "x", "payload": "\xff"}'),  # no UTF-8: nothing an index parsed
    ]
    limits = Limits.from_settings(Settings())
    fold = SnapshotFold("acme", limits)
    for delta in stored:
        fold.add(delta, applied=True)
    snapshot = Snapshot.decode(fold.snapshot().encode())
    assert [(d.seq, d.data) for d in snapshot.deltas] == [(1, stored[0].data), (2, stored[1].data)]
    unknown = SnapshotFold("acme", limits)  # the index not read: no telling, and nothing this release applies
    for delta in stored:
        unknown.add(delta)
    assert [d.seq for d in unknown.snapshot().deltas] == [1]
    # Folded on by a later run: read from the snapshot, kept, not judged again
    again = SnapshotFold("acme", limits, snapshot)
    again.add(StoredDelta(4, subject, _upsert("acme", "a", "edited").model_dump_json().encode()), applied=True)
    assert [d.seq for d in again.snapshot().deltas] == [2, 4]


async def test_a_rebuild_interrupted_before_a_compaction_resumes_from_the_snapshot(
    deployment: Deployment, projector: ProjectorService, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _publish_history(deployment)
    settings = deployment.settings.model_copy(update={"projector_batch_size": 5})
    record = shadow_module.Shadow.record

    async def crash_after_one_batch(shadow: shadow_module.Shadow, replayed: int, *args: Any) -> None:
        await record(shadow, replayed, *args)
        raise ConnectionResetError("interrupted")

    monkeypatch.setattr(shadow_module.Shadow, "record", crash_after_one_batch)
    with pytest.raises(ConnectionResetError):
        await _rebuild(deployment, settings=settings).run()
    monkeypatch.setattr(shadow_module.Shadow, "record", record)
    # compaction drops what the interrupted run had not replayed yet
    acks = await deployment.publisher.publish_many([_upsert("acme", "d3", "changed meanwhile")])
    await deployment.wait_projected(acks[-1].seq)
    await compact(deployment.nc, deployment.names, deployment.settings, RecordedProgress())
    before = await _state(deployment, "acme")

    resumed = await _rebuild(deployment, settings=settings).run()

    assert resumed.swapped
    assert 0 < resumed.resumed_from < acks[-1].seq
    assert resumed.restored > 0
    assert await _state(deployment, "acme") == before


async def _compaction_refused_unfilled(deployment: Deployment) -> None:
    placement = Placement.of(deployment.settings, deployment.database_url)
    with pytest.raises(CompactionRefused, match="has not been filled on its database"):
        await compact(deployment.nc, deployment.names, deployment.settings, RecordedProgress(), placement)


@pytest.mark.parametrize("compacted", [False, True], ids=["stream", "compacted-stream"])
async def test_a_projector_fills_a_database_lost_and_replaced_by_an_empty_one_from_nothing(
    deployment: Deployment, compacted: bool
) -> None:
    """The database behind a consumer that had delivered was lost and replaced by an empty one: the projector read
    on from the consumer's position, and the new index never held what came before (on a compacted stream, what
    only the snapshots hold). It now fills it from the snapshots and the stream's first delta."""
    url = deployment.database_url
    first = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), url)
    await first.start()
    try:
        await _publish_history(deployment)
        # A copy of d4's upsert, which a delete superseded, as a producer's retry past the duplicate window sends it.
        copy = await _superseded_upsert(deployment, "d4")
        if compacted:
            placement = Placement.of(deployment.settings, url)
            await compact(deployment.nc, deployment.names, deployment.settings, RecordedProgress(), placement)
        malformed = await deployment.js.publish(deployment.names.delta_subject("acme", "main"), b"{not json")
        acks = await deployment.publisher.publish_many([_upsert("acme", "late", "written after the compaction")])
        await deployment.wait_projected(acks[-1].seq)
        before = {workspace: await _state(deployment, workspace) for workspace in ("acme", "other")}
        handled_before = await _handled_events(deployment)
        letters = await dead_letters(deployment.nc, deployment.names, Selection())
        assert [letter.original_seq for letter in letters] == [malformed.seq]
    finally:
        await first.stop()
    database = deployment.settings.subject_prefix
    admin = await asyncpg.connect(with_database(url, "postgres"))
    try:
        await admin.execute(f'DROP DATABASE "{database}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{database}"')
    finally:
        await admin.close()
    # The consumer's floor says what the lost index had read: compacting by it would purge all this one lacks.
    await _compaction_refused_unfilled(deployment)
    second = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), url)
    compacting = await asyncpg.connect(url)  # as a compaction running then holds it: the fill waits for it
    try:
        assert await take_compaction_lock(compacting)
        await second.start()
        await asyncio.sleep(1.0)
        assert await deployment.fetch("SELECT 1 FROM ontology_versions") == []
    finally:
        await compacting.close()
    try:
        with structlog.testing.capture_logs() as logged:
            async with asyncio.timeout(30):  # the next look fills it
                while await deployment.fetch("SELECT 1 FROM projection_fences WHERE fill <> 'done'"):
                    await asyncio.sleep(0.1)
            await deployment.wait_projected(acks[-1].seq)
        after = {workspace: await _state(deployment, workspace) for workspace in ("acme", "other")}
        # The events the snapshots say were handled are handled on the new index too (an outside tester's: the
        # copy of a superseded event brought a deleted document back, and rebuild then refused for good).
        assert await _handled_events(deployment) == handled_before
        again = await deployment.js.publish(deployment.names.delta_subject("acme", "main"), copy)
        await deployment.wait_projected(again.seq)
        assert await _state(deployment, "acme") == before["acme"]
    finally:
        await second.stop()
    assert after == before
    # The malformed delta, read again, keeps its one dead letter (the stream's duplicate window aside).
    events = [entry["event"] for entry in logged]
    assert "delta_dead_lettered_before" in events
    assert "delta_dead_lettered" not in events
    assert await dead_letters(deployment.nc, deployment.names, Selection()) == letters
    assert len(after["acme"]["documents"]) > 10
    async with deployment.session() as conn:  # as a fill stopped half-way leaves it
        await conn.execute("UPDATE projection_fences SET fill = 'pending'")
    await _compaction_refused_unfilled(deployment)


async def _superseded_upsert(deployment: Deployment, doc_id: str) -> bytes:
    """The stored message of the first upsert of ``doc_id`` that the index handled."""
    records = await deployment.fetch("SELECT stream_seq FROM handled_events WHERE workspace = 'acme' ORDER BY 1")
    for record in records:
        message = await deployment.js.get_msg(deployment.names.delta_stream, record["stream_seq"])
        if f'"id":"{doc_id}"' in (message.data or b"").decode():
            return message.data or b""
    raise AssertionError(f"no upsert of {doc_id}")


async def _handled_events(deployment: Deployment) -> set[tuple[str, str]]:
    records = await deployment.fetch("SELECT workspace, event_id FROM handled_events")
    return {(r["workspace"], r["event_id"]) for r in records}


@contextlib.asynccontextmanager
async def _database_copies(deployment: Deployment) -> AsyncIterator[tuple[Callable[[], Awaitable[None]], ...]]:
    """Two steps on the deployment's database, as a backup restored (or a replica promoted without the last commits)
    takes it back in time: take a copy of it, then put the copy in its place. Its connections are cut at each."""
    url, database = deployment.database_url, deployment.settings.subject_prefix
    admin = await asyncpg.connect(with_database(url, "postgres"))

    async def take() -> None:
        async with deployment.database_outage():
            await admin.execute(f'CREATE DATABASE "{database}_copy" TEMPLATE "{database}"')

    async def put_back() -> None:
        async with deployment.database_outage():
            await admin.execute(f'DROP DATABASE "{database}" WITH (FORCE)')
            await admin.execute(f'CREATE DATABASE "{database}" TEMPLATE "{database}_copy"')

    try:
        yield take, put_back
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{database}_copy"')
        await admin.close()


async def _position_reaches(deployment: Deployment, seq: int) -> None:
    """Until the projector has said, at a look, that the index holds everything up to ``seq``."""
    async with asyncio.timeout(30):
        while (await deployment.fetch("SELECT position FROM projection_fences"))[0]["position"] != seq:
            await asyncio.sleep(0.1)


def _new_projector(deployment: Deployment) -> ProjectorService:
    return ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)


async def _gone_back_while_stopped(
    deployment: Deployment,
    projector: ProjectorService,
    take_copy: Callable[[], Awaitable[None]],
    put_copy_back: Callable[[], Awaitable[None]],
) -> tuple[int, dict[str, Any]]:
    """History projected and said, a copy taken, one more delta projected, the projector stopped, the copy put
    back: the index lacks that delta. Returns the history's last sequence and acme's state before the copy went
    back."""
    last = await _publish_history(deployment)
    await _position_reaches(deployment, last)
    await take_copy()
    after = await deployment.publisher.publish(_upsert("acme", "after", "written after the copy"))
    await deployment.wait_projected(after.seq)
    before = await _state(deployment, "acme")
    await projector.stop()
    await put_copy_back()
    return last, before


async def _state_becomes(deployment: Deployment, workspace: str, expected: dict[str, Any]) -> None:
    async with asyncio.timeout(30):
        while await _state(deployment, workspace) != expected:
            await asyncio.sleep(0.2)


@pytest.mark.parametrize("running", [True, False], ids=["under-a-running-projector", "while-none-runs"])
async def test_a_projector_reads_again_what_its_database_lost_by_going_back_in_time(
    deployment: Deployment, running: bool
) -> None:
    """A replica promoted without the last commits, or a backup restored: the database went back under a consumer
    that had acked deltas it no longer holds. The projector read on from the consumer's position, and the index
    never held them again; it now reads the stream again from the index's own position, kept in the database,
    without dead-lettering again what it had dead-lettered. A workspace new since the copy is made again (a
    running holder remembered its partition as made, and dead-lettered its documents), and the versions go on
    being announced (the database numbered them from an earlier count, which the versions bucket refused)."""
    workspaces = ("acme", "other", "fresh")
    projector = _new_projector(deployment)
    await projector.start()
    try:
        async with _database_copies(deployment) as (take_copy, put_copy_back):
            await _position_reaches(deployment, await _publish_history(deployment))
            await take_copy()
            later = await deployment.publisher.publish_many(
                [_upsert("acme", "after", "written after the copy"), _upsert("acme", "d1", "changed after the copy")]
            )
            for i in range(3):  # a batch each: the new workspace's version is announced at revisions 1, 2, 3
                fresh = await deployment.publisher.publish(_upsert("fresh", f"f{i}", f"a workspace new since {i}"))
                await deployment.wait_projected(fresh.seq)
            malformed = await deployment.js.publish(deployment.names.delta_subject("acme", "main"), b"{not json")
            last_of_all = await deployment.publisher.publish(delete("acme", "d2"))
            await deployment.wait_projected(last_of_all.seq)
            before = {workspace: await _state(deployment, workspace) for workspace in workspaces}
            letters = await dead_letters(deployment.nc, deployment.names, Selection())
            assert [letter.original_seq for letter in letters] == [malformed.seq]
            assert later[-1].seq < malformed.seq
            if not running:
                await projector.stop()
            with structlog.testing.capture_logs() as logged:
                await put_copy_back()
                assert await _state(deployment, "acme") != before["acme"]  # gone back
                if not running:
                    projector = _new_projector(deployment)
                    await projector.start()
                await _state_becomes(deployment, "acme", before["acme"])
            assert {workspace: await _state(deployment, workspace) for workspace in workspaces} == before
            kv = await deployment.js.key_value(deployment.names.version_bucket)
            for workspace in ("acme", "fresh"):  # the re-read counted fewer commits than were announced
                newest = await deployment.publisher.publish(_upsert(workspace, "newest", "after the reading again"))
                await deployment.wait_projected(newest.seq)
                async with asyncio.timeout(10):  # announced after the commit
                    while True:
                        entry = await kv.get(deployment.names.version_key(workspace, "main"))
                        if OntologyVersionChanged.model_validate_json(entry.value or b"").stream_seq == newest.seq:
                            break
                        await asyncio.sleep(0.1)
    finally:
        await projector.stop()
    events = [entry["event"] for entry in logged]
    assert ("projector_database_went_back" in events) == running
    (reading_again,) = [entry for entry in logged if entry["event"] == "projector_reads_again"]
    assert reading_again["went_back"] == running
    assert "delta_dead_lettered_before" in events  # the malformed one, read again, is not dead-lettered again
    assert "delta_dead_lettered" not in events
    assert await dead_letters(deployment.nc, deployment.names, Selection()) == letters


async def test_a_claim_whose_reading_again_failed_half_way_says_no_position_as_it_stops(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review: a claim on a database gone back whose reading again did not get through (NATS away as the
    consumer was to be made anew) left the consumer as it was; a stop before the next look then wrote the
    consumer's floor as the index's position, and what the database had lost was never read again."""
    projector = _new_projector(deployment)
    await projector.start()
    try:
        async with _database_copies(deployment) as (take_copy, put_copy_back):
            last, before = await _gone_back_while_stopped(deployment, projector, take_copy, put_copy_back)

            async def nats_away(*_: object) -> None:
                raise TimeoutError("nats: timeout")

            monkeypatch.setattr(projector_worker, "restart_consumer", nats_away)
            projector = _new_projector(deployment)
            await projector.start()  # its first look claims; reading again waits for the next look
            await projector.stop()
            monkeypatch.undo()
            assert (await deployment.fetch("SELECT position FROM projection_fences"))[0]["position"] == last
            projector = _new_projector(deployment)
            await projector.start()
            await _state_becomes(deployment, "acme", before)
    finally:
        await projector.stop()


async def test_a_compaction_folds_no_further_than_a_database_gone_back_holds(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review: a compaction run after the database went back (before its projector read again) purged by the
    consumer's floor what the index no longer held, and folded none of it either (the index records no handling
    of it): no index, stream or snapshot held those deltas any more. It now folds no further than the position the
    index's database says."""
    monkeypatch.setattr(snapshots_module, "POSITION_WAIT_S", 1.0)  # no projector runs to say another
    projector = _new_projector(deployment)
    await projector.start()
    try:
        async with _database_copies(deployment) as (take_copy, put_copy_back):
            last, before = await _gone_back_while_stopped(deployment, projector, take_copy, put_copy_back)
            placement = Placement.of(deployment.settings, deployment.database_url)
            report = await compact(deployment.nc, deployment.names, deployment.settings, RecordedProgress(), placement)
            assert report.covers == last
            projector = _new_projector(deployment)
            with structlog.testing.capture_logs() as logged:
                await projector.start()
                await _state_becomes(deployment, "acme", before)
    finally:
        await projector.stop()
    assert "projector_index_behind_the_stream" not in [entry["event"] for entry in logged]


async def test_a_compaction_and_a_rebuild_each_refuse_to_start_while_a_compaction_runs(
    deployment: Deployment, projector: ProjectorService
) -> None:
    """Two compactions at once could each write a workspace's snapshot over the other's later one, and one purge
    what only the overwritten snapshot held; a rebuild starting during a compaction could miss what it purges.
    The lock a compaction holds on each database refuses both."""
    last = await _publish_history(deployment)
    placement = Placement.of(deployment.settings, deployment.database_url)
    other = await asyncpg.connect(deployment.database_url)  # as a compaction running elsewhere holds it
    try:
        assert await take_compaction_lock(other)
        assert await running_compactions(other) == 1
        with pytest.raises(CompactionRefused, match="another compaction, or a projector filling"):
            await compact(deployment.nc, deployment.names, deployment.settings, RecordedProgress(), placement)
        with pytest.raises(RebuildFailed, match="a compaction, or a projector filling"):
            await _rebuild(deployment).run()
        assert (await deployment.js.stream_info(deployment.names.delta_stream)).state.first_seq == 1  # none dropped
    finally:
        await other.close()
    report = await compact(deployment.nc, deployment.names, deployment.settings, RecordedProgress(), placement)
    assert report.covers == last
    conn = await asyncpg.connect(deployment.database_url)
    try:
        assert await running_compactions(conn) == 0  # released when it ends
    finally:
        await conn.close()
    assert (await _rebuild(deployment).run()).swapped


async def test_compaction_waits_for_a_running_rebuild_and_runs_as_a_command(
    deployment: Deployment, projector: ProjectorService
) -> None:
    last = await _publish_history(deployment)
    rebuilding = asyncio.create_task(_rebuild(deployment, max_rate=4.0).run())  # about five seconds of replay
    conn = await asyncpg.connect(deployment.database_url)
    try:
        async with asyncio.timeout(10):
            while not await running_rebuilds(conn):
                await asyncio.sleep(0.05)
    finally:
        await conn.close()
    with pytest.raises(CompactionRefused, match="1 rebuild"):
        await compact(
            deployment.nc, deployment.names, deployment.settings, RecordedProgress(),
            Placement.of(deployment.settings, deployment.database_url),
        )  # fmt: skip
    assert (await rebuilding).swapped
    assert (await deployment.js.stream_info(deployment.names.delta_stream)).state.first_seq == 1  # nothing dropped

    def compact_command() -> subprocess.CompletedProcess[str]:
        command = [str(Path(sys.executable).parent / "ontofabric"), "compact", "--yes"]
        return subprocess.run(command, env=deployment.env(), capture_output=True, text=True, check=False, timeout=120)

    done = await asyncio.to_thread(compact_command)
    assert done.returncode == 0, done.stderr
    assert f"through sequence {last}" in done.stdout
    said = " ".join(done.stdout.split())  # whose each figure is: this run's reading, the snapshots', the stream's
    assert "deltas read and folded into 2 workspaces' snapshots, which now hold" in said, said
    assert "folded by this run or an earlier one" in said
    assert (await deployment.js.stream_info(deployment.names.delta_stream)).state.first_seq == last + 1


async def test_a_claim_reads_again_what_an_earlier_holder_took_and_did_not_settle(deployment: Deployment) -> None:
    """A fault tester's lost changes: a holder took a batch and was fenced (or froze) before settling it, and the
    next holder read on from where the consumer was: the batch came back only after its ack wait (nothing else was
    delivered meanwhile), or, sent back by a fenced holder, behind a later copy of its first event (published again
    under another message id), which the next holder then applied first; the change between the two copies was
    older than the row, and lost for good. A claim now reads the stream again from the index's position while the
    consumer holds deltas delivered and not settled."""
    settings = deployment.settings.model_copy(update={"projector_ack_wait_s": 60.0})
    earlier = ProjectorService(settings, deployment.nats_url_as("projector"), deployment.database_url)
    await earlier.start()
    try:
        warm = await deployment.publisher.publish(_upsert("acme", "warm", "the consumer exists"))
        await deployment.wait_projected(warm.seq)
    finally:
        await earlier.stop()
    first = _upsert("acme", "c", "version one")
    second = _upsert("acme", "c", "version two")
    await deployment.publisher.publish(first)
    changed = await deployment.publisher.publish(second)
    await deployment.js.publish(  # the first event again, stored anew: another publisher session's retry
        deployment.names.delta_subject("acme", "main"),
        first.model_dump_json(by_alias=True).encode(),
        headers={"Nats-Msg-Id": "another-session"},
    )
    # The earlier holder's batch in hand: delivered, never settled; and its claim not released (it crashed).
    await deployment.fetch(
        "UPDATE projection_fences SET holder = 'crashed', released = false,"
        " renewed_at = now() - interval '1 hour' WHERE durable = $1 RETURNING 1",
        deployment.names.postgres_projector_durable,
    )
    taken = await deployment.js.pull_subscribe_bind(
        deployment.names.postgres_projector_durable, deployment.names.delta_stream
    )
    in_hand = await taken.fetch(2, timeout=5)
    assert [msg.metadata.sequence.stream for msg in in_hand] == [changed.seq - 1, changed.seq]
    later = ProjectorService(settings, deployment.nats_url_as("projector"), deployment.database_url)
    with structlog.testing.capture_logs() as logged:
        await later.start()
        try:
            row = "SELECT content, stream_seq FROM documents WHERE workspace = 'acme' AND id = 'c'"
            async with asyncio.timeout(20):  # not after the ack wait: read again at once
                while not (found := await deployment.fetch(row)) or found[0]["stream_seq"] < changed.seq:
                    await asyncio.sleep(0.1)
            await asyncio.sleep(1)  # the copy, after it, changes nothing
            assert (await deployment.fetch(row))[0]["content"] == "version two"
        finally:
            await later.stop()
            await taken.unsubscribe()
    (reading_again,) = [entry for entry in logged if entry["event"] == "projector_reads_again"]
    assert reading_again["unsettled"] == 2
