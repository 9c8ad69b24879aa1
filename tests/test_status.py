"""`ontofabric status` against a running deployment: versions, what is pending past the index, dead letters, the
projectors' consumers and the query workers that answer discovery."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import structlog
from nats.js.api import DiscardPolicy
from rich.console import Console

from ontofabric.contracts import NO_VERSION
from ontofabric.services.ops import status as status_module
from ontofabric.services.ops.shadow import retired_schema, shadow_schema
from ontofabric.services.ops.snapshots import compact
from ontofabric.services.ops.status import NO_QUERY_WORKER, DeploymentStatus, analysis_status, deployment_status
from ontofabric.services.projector.planning import ANALYSIS_VERSION
from ontofabric.services.projector.worker import ProjectorService
from ontofabric.services.query import freshness as freshness_module
from ontofabric.services.query.core import Pending
from ontofabric.services.query.freshness import published_after
from ontofabric.services.render import render_status, standing_by
from ontofabric.shared.db import migrate
from ontofabric.shared.discovery import BUILD, INSTANCE, SCHEMA, announce, release_build, release_schema
from ontofabric.shared.jetstream import close as close_nats
from ontofabric.shared.jetstream import connect, projected_floor
from ontofabric.shared.placement import Placement
from ontofabric.shared.printable import shown_time
from ontofabric.shared.runtime import free_port
from ontofabric.shared.settings import Settings

from .conftest import Deployment, RecordedProgress, Start
from .factories import delete, document, upsert

ONTOFABRIC = str(Path(sys.executable).parent / "ontofabric")


async def test_status_tells_versions_pending_deltas_dead_letters_and_workers(
    deployment: Deployment, start_query_worker: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = deployment.settings.model_copy(update={"max_content_bytes": 100})
    projector = ProjectorService(settings, deployment.nats_url_as("projector"), deployment.database_url)
    await projector.start()
    acks = await deployment.publisher.publish_many(
        [
            upsert("acme", document("a", "alpha")),
            upsert("acme", document("b", "beta"), branch="feature/x"),
            upsert("globex", document("big", "x" * 200)),  # dead-lettered: content_too_large
        ]
    )
    await deployment.wait_projected(acks[-1].seq)
    first_worker = await start_query_worker(None)
    second = await start_query_worker(None)
    placement = Placement.of(deployment.settings, deployment.database_url)

    counted: list[str] = []  # a consumer made and removed per branch counted: 6 s at 1,400 workspaces

    async def counting(js: object, stream: str, subject: str, seq: int, name: str) -> Pending:
        counted.append(subject)
        return await published_after(js, stream, subject, seq, name)  # type: ignore[arg-type]

    monkeypatch.setattr(freshness_module, "published_after", counting)
    status = await deployment_status(deployment.nc, deployment.names, placement)
    assert counted == []  # every branch indexed to its last delta: nothing to count
    rows = {(row.workspace, row.branch): row for row in status.branches}
    assert set(rows) == {("acme", "main"), ("acme", "feature/x"), ("globex", "main")}
    assert (rows[("globex", "main")].ontology_version, rows[("globex", "main")].announced_at) == (NO_VERSION, None)
    assert rows[("globex", "main")].latest_seq == acks[2].seq  # its one delta was dead-lettered: nothing indexed
    assert rows[("acme", "main")].latest_seq == acks[0].seq
    assert rows[("acme", "main")].ontology_version.startswith(f"{acks[0].seq}-")
    assert all(row.pending_deltas == 0 and row.position == acks[-1].seq for row in rows.values())
    assert status.dead_letters == {"globex": 1}
    (consumer,) = status.consumers
    assert (consumer.name, consumer.ack_floor) == (deployment.names.postgres_projector_durable, acks[-1].seq)
    async with asyncio.timeout(30):  # the projector says its index's position at its looks
        while (await deployment_status(deployment.nc, deployment.names, placement)).consumers[0].index_position != (
            acks[-1].seq
        ):
            await asyncio.sleep(0.2)
    assert len({worker.id for worker in status.query_workers}) == 2
    assert (status.analysis.documents_of_another_analysis, status.analysis.unread) == (
        {},
        [],
    )  # every document by this build's analysis
    (running,) = status.projectors  # it answers service discovery too, saying what it projects and embeds with
    assert standing_by(running, status.projectors) == ""
    assert running.details.pop(INSTANCE)  # its worker object, the same when it answers anew
    assert running.details.pop(SCHEMA) == release_schema()  # the latest migration its release knows
    assert running.details.pop(BUILD) == release_build()  # and its code's digest
    assert running.details == {"index": "postgres", "partitions": "all", "models": ""}  # no embedder
    assert not status.problems

    # A projector of another release beside it: the package's version number does not tell them apart, and one of
    # an earlier release applied batches while status said it stood by (an upgrade tester's).
    details = {"index": "postgres", "partitions": "all", SCHEMA: "27"}
    as_projector = await connect(deployment.nats_url_as("projector"), "an-earlier-release", deployment.settings)
    earlier = await announce(as_projector, deployment.names.projector_service, "ontofabric Postgres projector", details)
    try:
        status = await deployment_status(deployment.nc, deployment.names, placement)
        (problem,) = status.problems
        assert "more than one release" in problem
        assert f"schema 27, build {release_build()}: " in problem
        assert f"schema {release_schema()}, build {release_build()}: " in problem
        older = next(worker for worker in status.projectors if worker.details[SCHEMA] == "27")
        assert standing_by(older, status.projectors) == ", of an earlier release"
    finally:
        await earlier.stop()
        await close_nats(as_projector)
    # Of the same schema and another build (an upgrade tester's query workers of two releases ranked apart).
    same_schema = {"index": "postgres", "partitions": "all", SCHEMA: release_schema(), BUILD: "0123456789ab"}
    as_projector = await connect(deployment.nats_url_as("projector"), "another-build", deployment.settings)
    other = await announce(
        as_projector, deployment.names.projector_service, "ontofabric Postgres projector", same_schema
    )
    try:
        (problem,) = (await deployment_status(deployment.nc, deployment.names, placement)).problems
        assert f"schema {release_schema()}, build 0123456789ab: " in problem
    finally:
        await other.stop()
        await close_nats(as_projector)
    await second.stop()
    assert len((await deployment_status(deployment.nc, deployment.names, placement)).query_workers) == 1

    # The projector stopped: what is published waits, and the status says how many and since when.
    await projector.stop()
    later = await deployment.publisher.publish(upsert("acme", document("c", "gamma")))
    status = await deployment_status(deployment.nc, deployment.names, placement, workspace="acme")
    main = next(row for row in status.branches if row.branch == "main")
    assert (main.latest_seq, main.position, main.pending_deltas) == (later.seq, acks[-1].seq, 1)
    assert counted == [deployment.names.delta_subject("acme", "main")]
    assert main.oldest_pending_ms is not None
    assert status.dead_letters == {}  # globex's, not asked for
    assert status.projectors == []
    # A problem for a health check (an ops tester's exited 0 over it).
    assert status.problems == ["no Postgres projector answers for 1 pending delta: applied once one runs"]
    # A workspace whose every delta is pending has no version yet, and is listed all the same.
    first = await deployment.publisher.publish(upsert("initech", document("d", "delta"), branch="dev.1"))
    status = await deployment_status(deployment.nc, deployment.names, placement)
    new = next(row for row in status.branches if row.workspace == "initech")
    assert (new.branch, new.ontology_version, new.announced_at) == ("dev.1", NO_VERSION, None)
    assert (new.latest_seq, new.pending_deltas) == (first.seq, 1)

    def status_command(*args: str) -> subprocess.CompletedProcess[str]:  # in a thread: the worker answers pings
        command = [ONTOFABRIC, "status", *args]
        return subprocess.run(command, env=deployment.env(), capture_output=True, text=True, check=False, timeout=60)

    # A document projected by an earlier release (before its keyword analysis changed) is counted, with the advice.
    await deployment.fetch("UPDATE documents SET analysis_version = 0 WHERE workspace = 'acme' AND id = 'a'")
    shown = await asyncio.to_thread(status_command, "--json")
    assert shown.returncode == 1, shown.stderr  # deltas pending, no projector
    report = json.loads(shown.stdout)
    assert report["analysis"] == {
        "version": ANALYSIS_VERSION, "documents_of_another_analysis": {"acme": 1}, "unread": [], "model_changes": [],
        "rebuild_schemas": {},
    }  # fmt: skip
    assert report["dead_letters"] == {"globex": 1}
    assert {(b["workspace"], b["branch"], b["pending_deltas"]) for b in report["branches"]} == {
        ("acme", "main", 1), ("acme", "feature/x", 0), ("globex", "main", 0), ("initech", "dev.1", 1)
    }  # fmt: skip
    assert len(report["query_workers"]) == 1
    # Times in ISO 8601, as the other commands write them (an auditor's had a space between date and time).
    announced = [b["announced_at"] for b in report["branches"] if b["announced_at"] is not None]
    assert announced
    assert all(datetime.fromisoformat(t) and "T" in t for t in announced), announced
    table = await asyncio.to_thread(status_command)
    assert table.returncode == 1, table.stderr
    assert "no Postgres projector answers for 2 pending deltas" in table.stdout + table.stderr
    assert "dead letters: globex 1" in table.stdout
    # Each query worker with its release (and its embedding models, none here): before, only where it ran.
    (workers_line,) = [line for line in table.stdout.splitlines() if line.startswith("query workers: ")]
    assert f" schema {release_schema()} build {release_build()} (since " in workers_line
    assert f"{deployment.names.dlq_stream} 1 messages" in table.stdout
    delta_stream = next(stream for stream in report["streams"] if stream["name"] == deployment.names.delta_stream)
    assert (delta_stream["messages"], delta_stream["max_bytes"]) == (later.seq + 1, None)  # initech's after it
    assert delta_stream["bytes"] > 0
    assert "none yet" in table.stdout  # initech's version
    said = f"documents indexed by another keyword analysis than this build's (version {ANALYSIS_VERSION}): acme 1"
    assert f"{said} (`ontofabric rebuild" in table.stdout
    globex_only = await deployment_status(deployment.nc, deployment.names, placement, workspace="globex")
    assert globex_only.analysis.documents_of_another_analysis == {}
    # A workspace nothing was published to is said to be so (an ops tester's misspelt name got empty tables).
    misspelt = await asyncio.to_thread(status_command, "--workspace", "globexx")
    assert "nothing was ever published to workspace 'globexx'" in " ".join(misspelt.stderr.split())
    named = await asyncio.to_thread(status_command, "--workspace", "globex")
    assert "nothing was ever published" not in named.stderr
    # A status that lists problems exits 1, for a health check (note 70: it exited 0).
    unread_env = deployment.env() | {"ONTOFABRIC_DATABASE_URL": f"postgresql://nobody@127.0.0.1:{free_port()}/none"}
    command = [ONTOFABRIC, "status"]
    unread = await asyncio.to_thread(
        subprocess.run, command, env=unread_env, capture_output=True, text=True, check=False, timeout=60
    )
    assert unread.returncode == 1, unread.stderr
    assert "could not be read" in " ".join(unread.stdout.split())
    # No query worker answering: every query goes unanswered, and a health check hears of it (an operator tester's
    # status exited 0 over it).
    assert NO_QUERY_WORKER not in (await deployment_status(deployment.nc, deployment.names, placement)).problems
    await first_worker.stop()
    assert NO_QUERY_WORKER in (await deployment_status(deployment.nc, deployment.names, placement)).problems


async def test_a_rebuilds_shadow_and_retired_tables_are_noted_with_what_to_run(
    deployment: Deployment, projector: ProjectorService
) -> None:
    """A shadow schema an interrupted rebuild left (as large as the workspace's index) was said nowhere; nor the
    tables a swap retired and failed to drop."""
    ack = await deployment.publisher.publish(upsert("acme", document("a", "alpha")))
    await deployment.wait_projected(ack.seq)
    placement = Placement.of(deployment.settings, deployment.database_url)
    shadow, retired = shadow_schema("acme"), retired_schema("globex")
    await migrate(deployment.database_url, deployment.settings, schema=shadow)
    await deployment.fetch(f'CREATE SCHEMA "{retired}"')
    await deployment.fetch(f'CREATE TABLE "{retired}".documents_p0 (x int)')
    try:
        notes = (await deployment_status(deployment.nc, deployment.names, placement)).notes
        (resumable,) = [note for note in notes if shadow in note and retired not in note]
        assert "a rebuild of workspace 'acme' is running or was interrupted" in resumable
        assert "`ontofabric rebuild acme` resumes it, `ontofabric rebuild acme --discard` drops it" in resumable
        (swapped,) = [note for note in notes if retired in note]
        assert "a rebuild of a workspace not known here swapped out were not dropped" in swapped
        asked = await deployment_status(deployment.nc, deployment.names, placement, workspace="acme")
        assert [note for note in asked.notes if "ontofabric_rebuild_" in note] == [resumable]
    finally:
        await deployment.fetch(f'DROP SCHEMA IF EXISTS "{shadow}" CASCADE')
        await deployment.fetch(f'DROP SCHEMA IF EXISTS "{retired}" CASCADE')
    assert not [note for note in (await deployment_status(deployment.nc, deployment.names, placement)).notes
                if "ontofabric_rebuild_" in note]  # fmt: skip


async def test_a_layout_given_up_is_shown_holds_compaction_back_and_can_be_forgotten(
    deployment: Deployment, projector: ProjectorService
) -> None:
    """A red team tried 4 partitions and went back to 1: the 4-partition consumers stayed, compaction stopped at
    their position for good and said nothing, and `status` did not list them."""
    names, placement = deployment.names, Placement.of(deployment.settings, deployment.database_url)
    tried = deployment.settings.model_copy(update={"projector_partitions": 2})
    trial = ProjectorService(tried, deployment.nats_url_as("projector"), deployment.database_url)
    await trial.start()
    first = await deployment.publisher.publish(upsert("acme", document("a", "alpha")))
    await deployment.wait_projected(first.seq)
    async with asyncio.timeout(30):  # the trial's consumers pass it too
        while (await projected_floor(deployment.js, names, 2)) < first.seq:
            await asyncio.sleep(0.05)
    await trial.stop()  # given up
    later = await deployment.publisher.publish(upsert("acme", document("b", "beta")))
    await deployment.wait_projected(later.seq)

    status = await deployment_status(deployment.nc, names, placement)
    others = {c.name: c.ack_floor for c in status.consumers if not c.configured}
    assert others == {durable: first.seq for durable in names.postgres_projector_durables(2)}
    report = await compact(deployment.nc, names, deployment.settings, RecordedProgress(), placement)
    assert report.covers == first.seq
    assert report.held_back_by in names.postgres_projector_durables(2)

    def forget(*args: str) -> subprocess.CompletedProcess[str]:
        command = [ONTOFABRIC, "forget-layout", *args, "--yes"]
        return subprocess.run(command, env=deployment.env(), capture_output=True, text=True, check=False, timeout=60)

    refused = await asyncio.to_thread(forget, "1")
    assert refused.returncode == 2
    assert "configured layout" in refused.stderr
    # A refusal of the stream left in the given-up layout's claim row stayed in status after forget-layout (note
    # 73): its claim rows go with its consumers.
    trial_durables = names.postgres_projector_durables(2)
    await deployment.fetch(
        "UPDATE projection_fences SET refused = 'a test refusal' WHERE durable = $1", trial_durables[0]
    )
    assert any("a test refusal" in p for p in (await deployment_status(deployment.nc, names, placement)).problems)
    forgotten = await asyncio.to_thread(forget, "2")
    assert forgotten.returncode == 0, forgotten.stderr
    assert "; 2 claim row(s)" in forgotten.stdout
    claims = await deployment.fetch(
        "SELECT durable FROM projection_fences WHERE durable = ANY($1::text[])", trial_durables
    )
    assert claims == []
    status = await deployment_status(deployment.nc, names, placement)
    assert [c.name for c in status.consumers] == [names.postgres_projector_durable]
    assert status.problems == [NO_QUERY_WORKER]  # no query worker runs here, and status says so
    report = await compact(deployment.nc, names, deployment.settings, RecordedProgress(), placement)
    assert (report.covers, report.held_back_by) == (later.seq, None)
    # The branch's deltas are in its snapshot now: "-" read as nothing ever published (a docs tester's).
    status = await deployment_status(deployment.nc, names, placement)
    (compacted,) = status.branches
    assert compacted.latest_seq is None
    shown = Console(record=True, width=200)
    render_status(shown, status)
    text = shown.export_text()
    assert "not in stream" in text
    # A consumer's last activity as the JSON writes it, to the second (it printed Python's str of the datetime).
    (consumer,) = status.consumers
    assert consumer.last_active is not None
    assert shown_time(consumer.last_active) in text
    assert "+00:00" not in text
    assert status.problems == [NO_QUERY_WORKER]  # no query worker runs here, and status says so
    # The snapshots lost (their object store deleted): what the stream no longer holds is nowhere, and status says
    # so (a disaster recovery tester's: nothing named it, and rebuild and compact refused with sequences).
    await deployment.js.delete_object_store(names.snapshot_bucket)
    problem, no_query_worker = (await deployment_status(deployment.nc, names, placement)).problems
    assert no_query_worker == NO_QUERY_WORKER
    assert f"starts at sequence {later.seq + 1}" in problem
    assert "snapshots cover nothing" in problem


async def test_status_reads_the_layout_the_projectors_run_whatever_its_own_settings_say(
    deployment: Deployment,
) -> None:
    """A tester's: with the projectors on 2 partitions and status run from a shell without the setting, it said
    every workspace indexed to 0, no projector answering, and exited 1; and with two layouts at once that left a
    partition out, it said no projector answered while two did, and named no workspace."""
    names, placement = deployment.names, Placement.of(deployment.settings, deployment.database_url)
    two = deployment.settings.model_copy(update={"projector_partitions": 2})
    in_two = Placement.of(two, deployment.database_url)
    assert in_two.partition_of("acme") != in_two.partition_of("wayne")  # the test's premise
    projector = ProjectorService(two, deployment.nats_url_as("projector"), deployment.database_url)
    await projector.start()
    try:
        acks = await deployment.publisher.publish_many(
            [upsert("acme", document("a", "alpha")), upsert("wayne", document("w", "wayne"))]
        )
        async with asyncio.timeout(30):
            while (await projected_floor(deployment.js, names, 2)) < acks[-1].seq:
                await asyncio.sleep(0.05)
        status = await deployment_status(deployment.nc, names, placement)
    finally:
        await projector.stop()
    assert status.problems == [NO_QUERY_WORKER]  # no query worker runs here
    assert {(b.workspace, b.position, b.pending_deltas) for b in status.branches} == {
        ("acme", acks[-1].seq, 0),
        ("wayne", acks[-1].seq, 0),
    }
    (note,) = status.notes
    assert "run 2 partition(s)" in note
    assert "says 1" in note

    # One partition of 2 applied, and none of the other: the workspace left out is named.
    held = ProjectorService(
        two, deployment.nats_url_as("projector"), deployment.database_url, [in_two.partition_of("acme")]
    )
    await held.start()
    try:
        late = await deployment.publisher.publish_many(
            [upsert("acme", document("b", "beta")), upsert("wayne", document("x", "wayne again"))]
        )
        async with asyncio.timeout(30):
            while (await deployment_status(deployment.nc, names, placement, "acme")).branches[0].pending_deltas:
                await asyncio.sleep(0.1)
        status = await deployment_status(deployment.nc, names, placement)
    finally:
        await held.stop()
    (problem,) = [p for p in status.problems if p != NO_QUERY_WORKER]
    assert problem.startswith("no Postgres projector applies the partition of wayne (1 pending delta)")
    assert late[-1].seq > acks[-1].seq


async def test_an_ingest_waits_on_the_layout_the_projectors_run(deployment: Deployment, tmp_path: Path) -> None:
    """A tester's: with the projectors on 2 partitions, an ingest from a shell without the setting waited on a
    consumer no projector reads, said the index had stayed at 0 and asked whether a projector ran, and exited 1."""
    (tmp_path / "geometry.py").write_text("def circle_area(radius):\n    return 3.14159 * radius ** 2\n")
    two = deployment.settings.model_copy(update={"projector_partitions": 2})
    command = [ONTOFABRIC, "ingest", str(tmp_path), "--workspace", "geo", "--wait-timeout", "30"]
    env = {**deployment.env(), "ONTOFABRIC_EMBEDDER": "none"}

    def ingest() -> subprocess.CompletedProcess[str]:
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)

    projector = ProjectorService(two, deployment.nats_url_as("projector"), deployment.database_url)
    await projector.start()
    try:
        ingested = await asyncio.to_thread(ingest)
        assert ingested.returncode == 0, ingested.stderr
        assert "2 upserts" in ingested.stdout
        assert "waiting on those of the 2-partition layout" in " ".join(ingested.stderr.split())
        # The configured layout's consumer left behind by a projector given up (a review's): it stopped below what
        # this ingest publishes, and the running layout's position ends the wait.
        given_up = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
        await given_up.start()
        await given_up.stop()
        (tmp_path / "geometry.py").write_text("def circle_area(r):\n    return 3.14159 * r ** 2\n")
        again = await asyncio.to_thread(ingest)
    finally:
        await projector.stop()
    assert again.returncode == 0, again.stderr
    assert "projected: 2/2" in again.stdout


async def test_documents_of_another_analysis_are_counted_by_workspace_and_an_unreachable_database_is_named(
    deployment: Deployment, projector: ProjectorService
) -> None:
    acks = await deployment.publisher.publish_many(
        [upsert("acme", document(f"d{n}", f"text {n}")) for n in range(3)] + [upsert("wayne", document("w", "w"))]
    )
    await deployment.wait_projected(acks[-1].seq)
    placement = Placement.of(deployment.settings, deployment.database_url)

    async def counted(workspace: str | None = None) -> dict[str, int]:
        return (await analysis_status(placement, workspace)).documents_of_another_analysis

    assert await counted() == {}
    # Rows of an earlier release read 0; a later release's read more: both are another analysis than this one's.
    await deployment.fetch("UPDATE documents SET analysis_version = 0 WHERE id IN ('d0', 'd1', 'd2')")
    await deployment.fetch(f"UPDATE documents SET analysis_version = {ANALYSIS_VERSION + 1} WHERE id = 'w'")
    assert await counted() == {"acme": 3, "wayne": 1}
    assert await counted("wayne") == {"wayne": 1}
    # A document projected again is indexed by this analysis; a deleted one has no index to redo.
    again = await deployment.publisher.publish_many(
        [upsert("acme", document("d1", "text 1, again")), delete("acme", "d0")]
    )
    await deployment.wait_projected(again[-1].seq)
    assert await counted() == {"acme": 1, "wayne": 1}
    # A projector of an earlier release rewrites a row's keyword index, saying nothing of its analysis: the row is
    # counted (migration 0024 kept its label, and 180 such rows read current after a downgrade: an upgrade tester's).
    # A write that leaves the keyword index as it is (a model change's) keeps the label.
    await deployment.fetch(
        "UPDATE documents SET content = 'text 1 earlier', search_vector = to_tsvector('simple', 'text 1 earlier')"
        " WHERE id = 'd1'"
    )
    await deployment.fetch("UPDATE documents SET updated_at = now() WHERE id = 'd2'")
    assert await counted() == {"acme": 2, "wayne": 1}
    later = await deployment.publisher.publish(upsert("acme", document("d1", "text 1, later")))
    await deployment.wait_projected(later.seq)
    assert await counted() == {"acme": 1, "wayne": 1}

    # The projector says so, beside its start, for the workspaces it applies.
    two = deployment.settings.model_copy(update={"projector_partitions": 2})
    partition = Placement.of(two, deployment.database_url).partition_of("acme")
    assert Placement.of(two, deployment.database_url).partition_of("wayne") != partition  # the test's premise
    for partitions, expected in (([0, 1], {"acme": 1, "wayne": 1}), ([partition], {"acme": 1})):
        with structlog.testing.capture_logs() as logged:
            partitioned = ProjectorService(
                two, deployment.nats_url_as("projector"), deployment.database_url, partitions
            )
            await partitioned.start()
            async with asyncio.timeout(10):
                while not any(e["event"] == "documents_of_another_analysis" for e in logged):
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # any other workspace's line follows at once
            await partitioned.stop()
        warned = {e["workspace"]: e["documents"] for e in logged if e["event"] == "documents_of_another_analysis"}
        assert warned == expected

    nowhere = Placement.of(deployment.settings, "postgresql://nobody:secret@127.0.0.1:9/none")
    unread = await analysis_status(nowhere)
    assert unread.documents_of_another_analysis == {}
    (reason,) = unread.unread
    assert "127.0.0.1:9" in reason
    assert "secret" not in reason  # the URL's password is not shown
    # Said first, as a problem: the positions below are missing (a fault tester's, every connection slot taken).
    problems = (await deployment_status(deployment.nc, deployment.names, nowhere)).problems
    assert [p for p in problems if "could not be read" in p] == [
        f"a database could not be read ({reason}): its index positions and counts are missing"
    ]


async def test_a_database_that_never_answers_costs_status_its_wait_and_no_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def accept_and_say_nothing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(3600)

    silent = await asyncio.start_server(accept_and_say_nothing, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    monkeypatch.setattr(status_module, "DATABASE_WAIT_S", 0.5)
    placement = Placement.of(Settings(), f"postgresql://nobody@127.0.0.1:{port}/none")
    try:
        async with asyncio.timeout(5):
            status = await analysis_status(placement)
    finally:
        silent.close()
    assert status.unread == [f"postgresql://nobody@127.0.0.1:{port}/none: no answer within 0.5 s"]


async def test_status_with_a_login_of_another_role_is_refused_at_once(deployment: Deployment) -> None:
    """A configuration tester's `status` with a client's login waited about 7 s and ended in a traceback."""
    env = deployment.env() | {"ONTOFABRIC_NATS_URL": deployment.nats_url_as("client")}
    ended = await asyncio.to_thread(
        subprocess.run, [ONTOFABRIC, "status"], env=env, capture_output=True, text=True, check=False, timeout=60
    )
    assert ended.returncode == 2
    assert "refused these credentials on the subject" in " ".join(ended.stderr.split())
    assert "Traceback" not in ended.stderr


async def test_status_of_a_deployment_whose_streams_were_deleted_says_so(deployment: Deployment) -> None:
    """A tester deleted the delta stream while NATS ran: `ontofabric status` ended in a traceback (stream not found)
    where it lists what is wrong. Each stream missing is a problem; the rest is shown."""
    placement = Placement.of(deployment.settings, deployment.database_url)
    await deployment.publisher.publish(upsert("acme", document("a", "alpha")))
    names = deployment.names
    for stream in (names.delta_stream, names.dlq_stream):
        await deployment.js.delete_stream(stream)
    status = await deployment_status(deployment.nc, names, placement)
    lost = next(problem for problem in status.problems if f"stream {names.delta_stream} does not exist" in problem)
    assert "adopt-stream" in lost
    assert any(f"stream {names.dlq_stream} does not exist" in problem for problem in status.problems)
    assert (status.branches, status.streams, status.dead_letters) == ([], [], {})
    shown = Console(record=True, width=400)
    render_status(shown, status)  # and it renders
    assert "adopt-stream" in shown.export_text()


async def test_a_capped_delta_stream_nearly_full_is_a_problem(deployment: Deployment) -> None:
    """An operator's: status exited 0 with no problem at 100 % of ONTOFABRIC_DELTA_STREAM_MAX_BYTES, while the stream
    refused every tenant's deltas (the alert fired; status said nothing)."""
    placement = Placement.of(deployment.settings, deployment.database_url)
    for n in range(20):
        await deployment.publisher.publish(upsert("acme", document(f"a{n}", "alpha " * 200)))
    names, js = deployment.names, deployment.js

    def full(status: DeploymentStatus) -> list[str]:
        return [p for p in status.problems if f"stream {names.delta_stream} is" in p]

    assert full(await deployment_status(deployment.nc, names, placement)) == []  # not capped
    held = (await js.stream_info(names.delta_stream)).state.bytes
    config = (await js.stream_info(names.delta_stream)).config
    await js.update_stream(dataclasses.replace(config, max_bytes=held * 4))
    assert full(await deployment_status(deployment.nc, names, placement)) == []  # a quarter full
    await js.update_stream(dataclasses.replace(config, max_bytes=held + 100))  # dropping its oldest when full
    assert full(await deployment_status(deployment.nc, names, placement)) == []
    await js.update_stream(dataclasses.replace(config, max_bytes=int(held / 0.9), discard=DiscardPolicy.NEW))
    (problem,) = full(await deployment_status(deployment.nc, names, placement))
    assert "is 90% full: once full, it refuses every new message (by bytes); run `ontofabric compact`" in problem
    # Refusing, it never reaches its cap: full once a message of its mean size no longer fits (a fault tester's,
    # 279 bytes short, read "100% nearly full" while every delta was refused).
    await js.update_stream(dataclasses.replace(config, max_bytes=held + 100, discard=DiscardPolicy.NEW))
    (problem,) = full(await deployment_status(deployment.nc, names, placement))
    assert "is full: it refuses new messages (by bytes); run `ontofabric compact`" in problem
    # Capped by count too (a retest's DLQ, capped so, stalled every projection unsaid).
    messages = (await js.stream_info(names.delta_stream)).state.messages
    by_count = dataclasses.replace(config, max_msgs=messages, discard=DiscardPolicy.NEW)
    await js.update_stream(by_count)
    (problem,) = full(await deployment_status(deployment.nc, names, placement))
    assert "is full: it refuses new messages (by messages); raise its max_msgs" in problem


async def test_a_consumers_last_activity_is_its_index_moving_when_nats_has_forgotten_its_deliveries(
    deployment: Deployment,
) -> None:
    """An operator tester's: after every restart of `up` each consumer read "last active -" until a delta came,
    NATS forgetting its deliveries; its index's last move (the database's) says it too."""
    from nats.js.api import AckPolicy, ConsumerConfig

    projector = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
    await projector.start()
    try:
        ack = await deployment.publisher.publish(upsert("acme", document("a", "alpha")))
        await deployment.wait_projected(ack.seq)
    finally:
        await projector.stop()
    names, js = deployment.names, deployment.js
    durable = names.postgres_projector_durable
    info = await js.consumer_info(names.delta_stream, durable)
    await js.delete_consumer(names.delta_stream, durable)  # as a server that lost its state has it: no delivery
    await js.add_consumer(names.delta_stream, ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT))
    assert info.delivered is not None
    assert info.delivered.last_active is not None
    placement = Placement.of(deployment.settings, deployment.database_url)
    (consumer,) = (await deployment_status(deployment.nc, names, placement)).consumers
    assert consumer.last_active is not None
    assert abs((consumer.last_active - info.delivered.last_active).total_seconds()) < 5
