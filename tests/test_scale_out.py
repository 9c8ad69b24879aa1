"""Growing past one machine on existing engines: PostgreSQL streaming read replicas for the query workers, and
projectors dividing the workspaces between them."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import nats.errors
import pytest
import structlog

from ontofabric.contracts import QueryResponse
from ontofabric.services.ingest.client import DeltaPublisher
from ontofabric.services.ops import status as status_module
from ontofabric.services.ops.rebuild import Rebuild
from ontofabric.services.ops.status import deployment_status
from ontofabric.services.projector import worker as projector_worker
from ontofabric.services.projector.worker import ProjectorService
from ontofabric.services.query.client import QueryClient
from ontofabric.services.query.worker import QueryService
from ontofabric.services.render import standing_by
from ontofabric.shared.discovery import (
    DISCOVERY_WAIT_S,
    INSTANCE,
    Worker,
    discover,
    held_elsewhere,
    remembered_peers,
)
from ontofabric.shared.jetstream import ack_floor, projected_floor
from ontofabric.shared.placement import Placement
from ontofabric.shared.runtime import (
    EmbeddedRuntime,
    Endpoints,
    ManagedProcess,
    resolve_endpoints,
    start_postgres,
    start_postgres_replica,
    with_login,
)
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Partition
from ontofabric.shared.tasks import cancel_and_wait

from .conftest import Deployment, RecordedProgress, fold, metric_points, open_deployment, projected_rows, with_database
from .factories import delete, document, upsert

pytestmark = pytest.mark.servers


def _reads(source: str, passed: str | None = None) -> int:
    """Snapshots this process's query workers took from ``source``, or passed over there for ``passed``."""
    return sum(
        int(point.value)
        for point in metric_points("query.database.reads")
        if point.attributes.get("source") == source and point.attributes.get("passed") == passed
    )


@contextlib.asynccontextmanager
async def _primary_and_replica(
    servers: Endpoints, directory: Path, logins: dict[str, tuple[str, str]], prefix: str
) -> AsyncIterator[tuple[Deployment, ManagedProcess, str]]:
    """A deployment on a PostgreSQL primary of its own with one streaming replica (the embedded binaries')."""
    primary, primary_url = await asyncio.to_thread(start_postgres, directory / "primary")
    try:
        settings = Settings(
            nats_url=with_login(servers.nats_url, *logins["operator"]),
            database_url=with_database(primary_url, prefix),
            subject_prefix=prefix,
            projector_ack_wait_s=2.0,
            projector_batch_timeout_s=0.05,
            embedder="none",
            query_cache_entries=0,  # every answer read fresh
            data_dir=directory / "data",
        )
        async with open_deployment(settings, primary_url, logins) as deployment:
            replica, replica_url = await asyncio.to_thread(start_postgres_replica, directory / "replica", primary_url)
            try:
                yield deployment, replica, with_database(replica_url, prefix)
            finally:
                replica.stop()
    finally:
        primary.stop()


async def _ask(client: QueryClient, text: str) -> set[str]:
    reply = await client.query("acme", {"semanticQuery": text, "topK": 10, "precision": False})
    assert isinstance(reply, QueryResponse), reply
    return {result.id for result in reply.results}


async def test_a_replica_answers_only_what_it_has_applied_and_the_primary_covers_for_it(
    servers: Endpoints, runtime: EmbeddedRuntime, tmp_path: Path
) -> None:
    prefix = "t" + uuid.uuid4().hex[:12]
    logins = runtime.nats_logins(prefix)
    async with _primary_and_replica(servers, tmp_path, logins, prefix) as (deployment, replica, replica_url):
        projector = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
        await projector.start()
        query = QueryService(
            deployment.settings,
            deployment.nats_url_as("query"),
            deployment.database_url,
            None,
            replica_urls=[replica_url],
        )
        try:
            acks = await deployment.publisher.publish_many(
                [upsert("acme", document(f"old-{n}", f"archived parsley note {n}")) for n in range(5)]
            )
            await deployment.wait_projected(acks[-1].seq)
            await query.start()
            client = QueryClient(deployment.nc, deployment.names)

            # In step: the replica serves.
            served = _reads(source="replica")
            async with asyncio.timeout(20):
                while len(await _ask(client, "parsley note")) < 5:
                    await asyncio.sleep(0.1)
            assert _reads(source="replica") > served

            # The replica stops applying WAL; a new document is projected and announced. From the first answer
            # that shows it on, every answer shows it: the replica is passed over for the primary, never read stale.
            standby = await asyncpg.connect(replica_url)
            try:
                await standby.execute("SELECT pg_wal_replay_pause()")
                ack = await deployment.publisher.publish(upsert("acme", document("fresh", "fresh parsley note")))
                await deployment.wait_projected(ack.seq)
                behind = _reads(source="replica", passed="behind")
                async with asyncio.timeout(20):
                    while "fresh" not in await _ask(client, "parsley note"):
                        await asyncio.sleep(0.1)
                for _ in range(20):
                    assert "fresh" in await _ask(client, "parsley note")
                assert _reads(source="replica", passed="behind") > behind
                assert await standby.fetchval("SELECT count(*) FROM documents WHERE id = 'fresh'") == 0

                # Replay resumes: the replica catches up and serves again.
                await standby.execute("SELECT pg_wal_replay_resume()")
                async with asyncio.timeout(20):
                    while await standby.fetchval("SELECT count(*) FROM documents WHERE id = 'fresh'") == 0:
                        await asyncio.sleep(0.1)
            finally:
                await standby.close()
            served = _reads(source="replica")
            for _ in range(5):
                assert "fresh" in await _ask(client, "parsley note")
            assert _reads(source="replica") > served

            # The replica lost: answers keep coming, from the primary.
            replica.stop()
            unavailable, primary = _reads(source="replica", passed="unavailable"), _reads(source="primary")
            for _ in range(5):
                assert "fresh" in await _ask(client, "parsley note")
            assert _reads(source="replica", passed="unavailable") > unavailable
            assert _reads(source="primary") > primary
        finally:
            await query.stop()
            await projector.stop()


async def test_up_starts_streaming_replicas_and_records_them_for_query_workers(
    servers: Endpoints, tmp_path: Path
) -> None:
    settings = Settings(nats_url=servers.nats_url, postgres_read_replicas=1, data_dir=tmp_path)
    with EmbeddedRuntime(settings, tmp_path) as runtime:
        assert runtime.endpoints is not None
        (replica_url,) = runtime.endpoints.replica_urls
        assert resolve_endpoints(settings).replica_urls == (replica_url,)  # what `ontofabric query-worker` reads
        primary = await asyncpg.connect(runtime.endpoints.database_url)
        standby = await asyncpg.connect(replica_url)
        try:
            await primary.execute("CREATE TABLE seen (n int)")
            await primary.execute("INSERT INTO seen VALUES (1)")
            assert await standby.fetchval("SELECT pg_is_in_recovery()")
            async with asyncio.timeout(20):
                while await standby.fetchval("SELECT to_regclass('seen') IS NULL"):
                    await asyncio.sleep(0.05)
                while await standby.fetchval("SELECT count(*) FROM seen") == 0:
                    await asyncio.sleep(0.05)
            with pytest.raises(asyncpg.ReadOnlySQLTransactionError):
                await standby.execute("INSERT INTO seen VALUES (2)")
        finally:
            await primary.close()
            await standby.close()


def _spread_workspaces(partitions: int, per_partition: int) -> list[str]:
    """Workspace names, ``per_partition`` in each partition (the hash decides where a name lands)."""
    chosen: dict[int, list[str]] = {index: [] for index in range(partitions)}
    for n in itertools.count():
        name = f"team-{n}"
        holder = next(i for i in range(partitions) if Partition(i, partitions).holds(f"x.delta.{name}.main"))
        if len(chosen[holder]) < per_partition:
            chosen[holder].append(name)
        if all(len(names) == per_partition for names in chosen.values()):
            return [name for names in chosen.values() for name in names]
    raise AssertionError("unreachable")


def test_partition_layouts_are_checked() -> None:
    with pytest.raises(ValueError, match="one of 1, 2, 4, 8, 16"):
        Settings(projector_partitions=3)
    with pytest.raises(ValueError, match="not one of the 4 partitions"):
        Settings(projector_partitions=4, projector_partition=4)
    assert {Partition(i, 4).holds("x.delta.acme.main") for i in range(4)} == {True, False}


async def test_partitioned_projectors_apply_their_own_workspaces_each_in_stream_order(
    deployment_settings: Settings, servers: Endpoints, nats_logins: dict[str, tuple[str, str]]
) -> None:
    settings = deployment_settings.model_copy(update={"projector_partitions": 4})
    workspaces = _spread_workspaces(4, per_partition=2)
    partition_of = {ws: next(i for i in range(4) if Partition(i, 4).holds(f"x.delta.{ws}.main")) for ws in workspaces}
    rng = random.Random(7)
    deltas = []
    for n in range(600):  # the same ids written and deleted over and over: only stream order gives the fold
        workspace, doc_id = rng.choice(workspaces), f"doc-{rng.randrange(15)}"
        deltas.append(
            delete(workspace, doc_id)
            if rng.random() < 0.25
            else upsert(workspace, document(doc_id, f"{workspace} {doc_id} revision {n}"))
        )
    async with open_deployment(settings, servers.database_url, nats_logins) as deployment:
        url = deployment.nats_url_as("projector")
        projectors = [ProjectorService(settings, url, deployment.database_url, partitions=[i]) for i in range(4)]
        try:
            for projector in projectors[:3]:  # partition 3's projector is not running yet
                await projector.start()
            acks = await deployment.publisher.publish_many(deltas)
            last = acks[-1].seq
            expected = fold(zip((ack.seq for ack in acks), deltas, strict=True))
            durables = deployment.names.postgres_projector_durables(4)
            async with asyncio.timeout(60):
                for durable in durables[:3]:
                    while await ack_floor(deployment.js, deployment.names.delta_stream, durable) < last:
                        await asyncio.sleep(0.05)
            rows = await projected_rows(deployment)
            assert rows == {key: row for key, row in expected.items() if partition_of[key[0]] != 3}
            # The index's position waits for the partition that is behind.
            assert await projected_floor(deployment.js, deployment.names, 4) < last

            await projectors[3].start()
            await deployment.wait_projected(last, timeout_s=60)
            assert await projected_rows(deployment) == expected
        finally:
            for projector in projectors:
                await projector.stop()


async def test_workspaces_placed_on_two_primaries_are_written_read_and_rebuilt_where_they_live(
    deployment_settings: Settings, servers: Endpoints, nats_logins: dict[str, tuple[str, str]], tmp_path: Path
) -> None:
    second, second_server = await asyncio.to_thread(start_postgres, tmp_path / "second")
    prefix = deployment_settings.subject_prefix
    try:
        admin = await asyncpg.connect(with_database(second_server, "postgres"))
        await admin.execute(f'CREATE DATABASE "{prefix}"')
        await admin.close()
        first_url, second_url = with_database(servers.database_url, prefix), with_database(second_server, prefix)
        settings = deployment_settings.model_copy(
            update={"projector_partitions": 2, "partition_databases": f"{first_url},{second_url}"}
        )
        workspaces = _spread_workspaces(2, per_partition=2)  # the first two in partition 0, the others in 1
        async with open_deployment(settings, servers.database_url, nats_logins) as deployment:
            projector = ProjectorService(settings, deployment.nats_url_as("projector"), first_url)
            query = QueryService(settings, deployment.nats_url_as("query"), first_url, None)
            try:
                await projector.start()
                acks = await deployment.publisher.publish_many(
                    [upsert(ws, document(f"{ws}-{n}", f"{ws} thyme note {n}")) for ws in workspaces for n in range(3)]
                )
                await deployment.wait_projected(acks[-1].seq)
                for url, placed in ((first_url, workspaces[:2]), (second_url, workspaces[2:])):
                    conn = await asyncpg.connect(url)
                    try:
                        held = {r["workspace"] for r in await conn.fetch("SELECT DISTINCT workspace FROM documents")}
                    finally:
                        await conn.close()
                    assert held == set(placed)

                await query.start()
                client = QueryClient(deployment.nc, deployment.names)
                for workspace in workspaces:
                    reply = await client.query(workspace, {"semanticQuery": "thyme note", "topK": 10})
                    assert isinstance(reply, QueryResponse), reply
                    assert {r.id for r in reply.results} == {f"{workspace}-{n}" for n in range(3)}

                # A rebuild of a workspace on the second server replays it there (the CLI routes by the map).
                moved = workspaces[3]
                assert Placement.of(settings, first_url).database_url_of(moved) == second_url
                report = await Rebuild(
                    settings, deployment.nats_url, second_url, moved, RecordedProgress(), lock_timeout_s=10
                ).run()
                assert report.swapped

                # Status reads each consumer's row on its own partition's database: a stale row of partition 1
                # left on the first one (a partition moved since) is not its row (a review's).
                durables = deployment.names.postgres_projector_durables(2)
                stale = await asyncpg.connect(first_url)
                try:
                    await stale.execute(
                        "INSERT INTO projection_fences (durable, epoch, holder, fill, position, refused)"
                        " VALUES ($1, nextval('projection_fence_epochs'), 'gone', 'done', 999999, 'a stale row')",
                        durables[1],
                    )
                finally:
                    await stale.close()
                status = await deployment_status(deployment.nc, deployment.names, Placement.of(settings, first_url))
                assert not [problem for problem in status.problems if "a stale row" in problem], status.problems
                positions = {consumer.name: consumer.index_position for consumer in status.consumers}
                assert positions[durables[1]] != 999999
            finally:
                await query.stop()
                await projector.stop()
    finally:
        second.stop()


async def test_projectors_sharing_a_consumer_never_apply_a_later_copy_of_an_event_before_its_first(
    deployment: Deployment, projector: ProjectorService
) -> None:
    """A red team (churn): three projector processes on one durable consumer, and per document E, then F, then a copy
    of E stored again by another publisher session (an ingest run again). Each went to another process; when the
    copy committed first it applied, F was then older than the row and E's first copy a repeat: F was lost for good
    in 9 of 50 documents, while _meta said the index held it."""
    others = [
        ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
        for _ in range(2)
    ]
    for other in others:
        await other.start()
    again = DeltaPublisher(deployment.js, deployment.names)
    try:
        for n in range(40):
            first = upsert("acme", document(f"x{n}", f"text a{n}"), event_id=f"x{n}-a")
            await deployment.publisher.publish(first)
            await deployment.publisher.publish(upsert("acme", document(f"x{n}", f"text b{n}"), event_id=f"x{n}-b"))
            last = await again.publish(first)
            await asyncio.sleep(0.05)
        await deployment.wait_projected(last.seq, timeout_s=60)
    finally:
        for other in others:
            await other.stop()
    rows = await deployment.fetch("SELECT id, content FROM documents WHERE workspace = 'acme' AND NOT deleted")
    stale = sorted(r["id"] for r in rows if not r["content"].startswith("text b"))
    assert (len(rows), stale) == (40, [])


async def test_a_projector_standing_by_takes_over_when_the_one_applying_stops(
    deployment: Deployment, projector: ProjectorService
) -> None:
    standby = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
    await standby.start()
    try:
        first = await deployment.publisher.publish(upsert("acme", document("a", "alpha")))
        await deployment.wait_projected(first.seq)
        assert not standby._projections  # the fixture's projector began first: it applies the consumer
        placement = Placement.of(deployment.settings, deployment.database_url)
        status = await deployment_status(deployment.nc, deployment.names, placement)
        said = [standing_by(worker, status.projectors) for worker in status.projectors]
        assert sorted(said) == ["", ", standing by"]  # as `ontofabric status` shows them
        await projector.stop()
        later = await deployment.publisher.publish(upsert("acme", document("b", "beta")))
        await deployment.wait_projected(later.seq, timeout_s=30)  # HOLDER_LEASE_S and a look later
        assert list(standby._projections) == [0]
    finally:
        await standby.stop()


def test_each_consumer_is_left_to_the_process_that_began_applying_it_first() -> None:
    mine = ("b", "2026-11-29T10:00:01+00:00")

    def peer(worker_id: str, started: str, partitions: str, index: str = "postgres") -> Worker:
        return Worker(worker_id, "", None, None, started, {"index": index, "partitions": partitions})

    earlier, later = "2026-11-29T10:00:00+00:00", "2026-11-29T10:00:02+00:00"
    assert held_elsewhere(*mine, 1, [0], [peer("b", mine[1], "all")]) == set()  # itself
    assert held_elsewhere(*mine, 1, [0], [peer("c", earlier, "all")]) == {0}
    assert held_elsewhere(*mine, 1, [0], [peer("a", later, "all")]) == set()
    assert held_elsewhere(*mine, 1, [0], [peer("a", mine[1], "all")]) == {0}  # a tie: the lower id
    assert held_elsewhere(*mine, 4, [0, 1, 2, 3], [peer("c", earlier, "1,3 of 4")]) == {1, 3}
    assert held_elsewhere(*mine, 4, [0, 1], [peer("c", earlier, "0,1 of 2")]) == set()  # another layout's consumers
    assert held_elsewhere(*mine, 1, [0], [peer("c", earlier, "", index="azure-ai-search")]) == set()


async def test_a_projector_whose_discovery_ping_reaches_nobody_says_so(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not even its own announcement answering: a NATS login without $SRV.PING.<prefix>-projector (a deployment's
    own permissions), and the process cannot know whether another applies the same consumers."""

    async def nobody_answers(*_: object, **__: object) -> list[Worker]:
        return []

    monkeypatch.setattr(projector_worker, "discover", nobody_answers)
    service = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
    with structlog.testing.capture_logs() as logged:
        await service.start()
        await service.stop()
    assert [entry["event"] for entry in logged].count("projector_peers_unknown") == 1


async def test_a_projector_whose_own_answer_is_late_once_asks_again_before_it_says_so(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh-install tester's demo said `projector_peers_unknown` once in six runs: its own answer came after
    the ping's half second, its event loop busy embedding. The first ping here hears nobody, the next hears all."""
    real = projector_worker.discover
    pings: list[float] = []

    async def first_late(nc: object, name: str, wait_s: float = DISCOVERY_WAIT_S) -> list[Worker]:
        pings.append(wait_s)
        return [] if len(pings) == 1 else await real(nc, name, wait_s)  # type: ignore[arg-type]

    monkeypatch.setattr(projector_worker, "discover", first_late)
    service = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
    with structlog.testing.capture_logs() as logged:
        await service.start()
        await service.stop()
    assert pings[:2] == [DISCOVERY_WAIT_S, 2 * DISCOVERY_WAIT_S]
    assert "projector_peers_unknown" not in [entry["event"] for entry in logged]


async def test_discovery_keeps_the_answers_already_read_when_its_loop_ran_past_the_wait(
    deployment: Deployment, projector: ProjectorService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flake hunter's reading: an event loop that stalls past the ping's wait found the answers queued and
    dropped them. Here the answers are read off the socket while the wait runs out, before discovery takes one."""
    nc = deployment.nc
    subscribe = nc.subscribe

    async def stalling_subscription(*args: Any, **kwargs: Any) -> Any:
        subscription = await subscribe(*args, **kwargs)

        async def late(**_: Any) -> Any:  # woken past its wait, the answers queued meanwhile
            await asyncio.sleep(0.3)
            raise nats.errors.TimeoutError

        subscription.next_msg, taken = late, subscription.next_msg  # type: ignore[method-assign]

        def restored(*_: Any) -> None:
            subscription.next_msg = taken  # type: ignore[method-assign]

        asyncio.get_running_loop().call_later(0.2, restored)
        return subscription

    monkeypatch.setattr(nc, "subscribe", stalling_subscription)
    workers = await discover(nc, deployment.names.projector_service, wait_s=0.1)
    assert len(workers) == 1


@contextlib.asynccontextmanager
async def _standing_by(deployment: Deployment) -> AsyncIterator[ProjectorService]:
    """A second projector process beside the running one, standing by once a first delta is projected."""
    standby = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
    await standby.start()
    try:
        first = await deployment.publisher.publish(upsert("acme", document("a", "alpha")))
        await deployment.wait_projected(first.seq)
        assert not standby._projections
        yield standby
    finally:
        await standby.stop()


async def test_a_projector_away_past_its_lease_leaves_its_consumer_to_the_standby(
    deployment: Deployment, projector: ProjectorService
) -> None:
    """A review: a holder frozen past the lease (SIGSTOP) took its consumer back as it woke, being the oldest, and
    applied new batches beside the standby that had taken over: an update was lost in 2 of 3 tries. Now a process
    away that long applies nothing until it has looked again, and then answers discovery as the newest."""
    async with _standing_by(deployment) as standby:
        assert projector._last_look is not None
        projector._last_look -= projector_worker.HOLDER_LEASE_S + 1  # as if frozen that long since its last look
        assert not projector.holding()  # no batch is applied until it has looked again
        async with asyncio.timeout(20):  # its next look gives its seniority up, and the standby takes over
            while projector._projections or not standby._projections:
                await asyncio.sleep(0.1)
        later = await deployment.publisher.publish(upsert("acme", document("b", "beta")))
        await deployment.wait_projected(later.seq)
        assert projector.holding()  # back, standing by


async def test_a_projector_woken_past_its_lease_fetches_nothing_until_it_has_looked_again(
    deployment: Deployment, projector: ProjectorService
) -> None:
    """A review: a holder woken from a freeze fetched from the consumer before its next look. Its successor may
    have made that consumer again; the batch went back behind the deltas the successor read next, so an older
    copy of an event could come after a newer one. Until it has looked, it now leaves the consumer's deltas where
    they are."""
    first = await deployment.publisher.publish(upsert("acme", document("a", "alpha")))
    await deployment.wait_projected(first.seq)
    holding = projector._holding
    assert holding is not None
    assert projector._last_look is not None
    await cancel_and_wait(holding)  # its next look is not due yet: woken, it has not looked
    projector._last_look -= projector_worker.HOLDER_LEASE_S + 1
    # A frozen process's pull request ran out on the server meanwhile: so does the one it had out here.
    await asyncio.sleep(deployment.settings.projector_batch_timeout_s + 0.5)
    durable = deployment.names.postgres_projector_durable
    with structlog.testing.capture_logs() as logged:
        later = await deployment.publisher.publish(upsert("acme", document("a", "beta")))
        await asyncio.sleep(3 * projector_worker.HOLD_CHECK_S)
        info = await deployment.js.consumer_info(deployment.names.delta_stream, durable)
    assert info.delivered.stream_seq < later.seq  # never fetched, so never sent back
    assert "batch_sent_back" not in [entry["event"] for entry in logged]
    projector._holding = asyncio.create_task(projector._keep_holding())  # it looks, and takes the consumer again
    await deployment.wait_projected(later.seq, timeout_s=30)


async def test_a_projector_whose_consumer_another_process_claimed_leaves_it_and_its_batch(
    deployment: Deployment, projector: ProjectorService
) -> None:
    """Discovery decides which process should apply a consumer; the database decides which one may. A claim by
    another process (here only a claim, by a process that is not up) fences the holder: its next batch goes back
    unwritten, it leaves that consumer, and claims it back at its next look, the claimant not being up."""
    first = await deployment.publisher.publish(upsert("acme", document("a", "alpha")))
    await deployment.wait_projected(first.seq)
    durable = deployment.names.postgres_projector_durable
    pool = await asyncpg.create_pool(deployment.database_url, min_size=1, max_size=2)
    try:
        await pool.execute(
            "UPDATE projection_fences SET epoch = nextval('projection_fence_epochs'), holder = 'unseen',"
            " renewed_at = now() WHERE durable = $1",
            durable,
        )
        with structlog.testing.capture_logs() as logged:
            later = await deployment.publisher.publish(upsert("acme", document("a", "beta")))
            await deployment.wait_projected(later.seq, timeout_s=30)
        refused = [entry for entry in logged if entry["event"] == "batch_retry"]
        assert refused
        assert "claimed by unseen" in refused[0]["error"]  # the batch in hand was not written
        events = [entry["event"] for entry in logged]
        assert events.index("projector_consumer_claimed_elsewhere") < events.index("projector_started")
        assert "projector_away_past_its_lease" not in events  # its seniority is kept: only that consumer was left
        row = await pool.fetchrow("SELECT holder, released FROM projection_fences WHERE durable = $1", durable)
        assert row["holder"] != "unseen"
        content = await pool.fetchval("SELECT content FROM documents WHERE workspace = 'acme' AND id = 'a'")
        assert content == "beta"
    finally:
        await pool.close()


async def test_a_projector_that_cannot_see_the_others_does_not_take_a_renewed_consumer(
    deployment: Deployment, projector: ProjectorService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review: a projector whose discovery ping reached nobody (a login without the ping) claimed the consumer
    at every look while the others claimed it back; each takeover sent a batch back behind later deltas, and 7 of
    400 documents kept an older update for good. It now takes only a consumer whose claim nobody renews."""
    blind = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
    seeing = projector_worker.discover

    async def unless_blind(nc: object, name: str, *args: object) -> list[Worker]:
        return [] if nc is blind._nc else await seeing(nc, name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(projector_worker, "discover", unless_blind)
    durable = deployment.names.postgres_projector_durable
    await blind.start()
    try:
        epoch = (await deployment.fetch("SELECT epoch FROM projection_fences WHERE durable = $1", durable))[0]["epoch"]
        for n in range(8):  # four looks of each
            ack = await deployment.publisher.publish(upsert("acme", document(f"d{n}", f"text {n}")))
            await asyncio.sleep(1)
        await deployment.wait_projected(ack.seq)
        assert not blind._projections
        rows = await deployment.fetch("SELECT epoch FROM projection_fences WHERE durable = $1", durable)
        assert rows[0]["epoch"] == epoch  # nobody claimed it from the holder

        await projector.stop()  # released: the blind process takes it over
        later = await deployment.publisher.publish(upsert("acme", document("z", "after")))
        await deployment.wait_projected(later.seq, timeout_s=30)
        assert blind._projections
    finally:
        await blind.stop()


async def test_a_newer_process_that_claimed_without_hearing_the_holder_gives_the_consumer_back(
    deployment: Deployment, projector: ProjectorService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A re-test of the fence: a process whose first look missed the holder's answer claimed the consumer, then
    heard the older process and stood by, keeping its claim; the older one, fenced, found the claim of a process
    that was up and stood by too. Nothing was applied for as long as both ran (112 s in the re-test). Standing by
    for an earlier process now releases the claim, and a claim not renewed within the lease is not live."""
    newer = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
    hearing = projector_worker.discover
    looks = 0

    async def deaf_at_first(nc: object, name: str, *args: object) -> list[Worker]:
        nonlocal looks
        answered = await hearing(nc, name, *args)  # type: ignore[arg-type]
        if nc is not newer._nc:
            return answered
        looks += 1
        return answered if looks > 1 else [w for w in answered if newer._service and w.id == newer._service.id]

    monkeypatch.setattr(projector_worker, "discover", deaf_at_first)
    await newer.start()
    try:
        assert newer._projections  # it claimed at its first look, the holder unheard
        for n in range(6):
            ack = await deployment.publisher.publish(upsert("acme", document(f"d{n}", f"text {n}")))
            await asyncio.sleep(0.5)
        await deployment.wait_projected(ack.seq, timeout_s=30)
        async with asyncio.timeout(20):  # the earlier process applies again, the newer one stands by
            while newer._projections or not projector._projections:
                await asyncio.sleep(0.1)
    finally:
        await newer.stop()


async def test_a_consumer_claimed_elsewhere_leaves_the_process_s_other_partitions_applied(
    deployment_settings: Settings, servers: Endpoints, nats_logins: dict[str, tuple[str, str]]
) -> None:
    """A review: fencing one partition's consumer made the process give every consumer up and answer anew, and the
    workspaces of its other partitions waited 7.5 s. Only the claimed consumer is left now."""
    settings = deployment_settings.model_copy(update={"projector_partitions": 2})
    held_elsewhere_ws, own_ws = _spread_workspaces(2, per_partition=1)
    async with open_deployment(settings, servers.database_url, nats_logins) as deployment:
        service = ProjectorService(settings, deployment.nats_url_as("projector"), deployment.database_url)
        await service.start()
        try:
            durables = deployment.names.postgres_projector_durables(2)
            first = await deployment.publisher.publish_many(
                [upsert(held_elsewhere_ws, document("a", "alpha")), upsert(own_ws, document("a", "alpha"))]
            )
            await deployment.wait_projected(first[-1].seq)
            claim = (
                "UPDATE projection_fences SET epoch = nextval('projection_fence_epochs'), holder = 'unseen',"
                " renewed_at = now() WHERE durable = $1"
            )
            await deployment.fetch(claim + " RETURNING 1", durables[0])
            with structlog.testing.capture_logs() as logged:
                blocked = await deployment.publisher.publish(upsert(held_elsewhere_ws, document("b", "beta")))
                for n in range(4):  # the other claim renewed for 4 s; the other partition goes on meanwhile
                    ack = await deployment.publisher.publish(upsert(own_ws, document(f"d{n}", f"text {n}")))
                    await asyncio.sleep(1)
                    await deployment.fetch(
                        "UPDATE projection_fences SET renewed_at = now() WHERE durable = $1 RETURNING 1", durables[0]
                    )
                assert await ack_floor(deployment.js, deployment.names.delta_stream, durables[1]) >= ack.seq
                await deployment.wait_projected(blocked.seq, timeout_s=30)  # taken back once not renewed
            events = [entry["event"] for entry in logged]
            assert "projector_consumer_claimed_elsewhere" in events
            assert "projector_away_past_its_lease" not in events
            assert 1 in service._projections
        finally:
            await service.stop()


def test_an_announcement_past_its_lease_or_answered_anew_is_not_stood_by_for() -> None:
    def worker(worker_id: str, started: str, instance: str = "1") -> Worker:
        return Worker(
            worker_id, "", "host", "7", started, {"index": "postgres", "partitions": "all", INSTANCE: instance}
        )

    old, new, other = worker("old", "10:00"), worker("new", "10:05"), worker("other", "09:00", instance="2")
    peers, gone = remembered_peers({}, [old, other], now=0.0, lease_s=6.0, gone=set())
    assert set(peers) == {"old", "other"}
    assert gone == set()
    # The same process answers under a new id (it gave its seniority up): its old announcement is not waited for.
    peers, gone = remembered_peers(peers, [old, new, other], now=1.0, lease_s=6.0, gone=set())
    assert set(peers) == {"new", "other"}
    assert gone == {"old"}
    # Silent past the lease: gone, and not taken back when it answers again (it gives its seniority up as it wakes).
    peers, gone = remembered_peers(peers, [new], now=8.0, lease_s=6.0, gone={"old"})
    assert set(peers) == {"new"}
    assert gone == {"other"}
    peers, gone = remembered_peers(peers, [new, other], now=9.0, lease_s=6.0, gone={"old", "other"})
    assert set(peers) == {"new"}


async def test_a_projector_that_stops_hands_its_consumer_over_without_the_lease(
    deployment: Deployment, projector: ProjectorService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder stopped (SIGTERM, a rolling upgrade) released its claim as it stopped: the standby takes the
    consumer over at its next look, not once the holder has been silent for the discovery lease (6 s of no
    projection at every restart). The lease is made long here so that waiting it out would show."""
    monkeypatch.setattr(projector_worker, "HOLDER_LEASE_S", 60.0)
    async with _standing_by(deployment) as standby:
        stopped = time.monotonic()
        await projector.stop()
        released = await deployment.fetch("SELECT released FROM projection_fences")
        assert [row["released"] for row in released] == [True]
        later = await deployment.publisher.publish(upsert("acme", document("b", "beta")))
        await deployment.wait_projected(later.seq, timeout_s=30)
        assert standby._projections
        assert time.monotonic() - stopped < 30  # within a few looks; the lease alone would take 60 s
        assert [row["released"] for row in await deployment.fetch("SELECT released FROM projection_fences")] == [False]


async def test_a_projector_that_cannot_write_leaves_its_consumer_to_a_standby_that_can(
    deployment: Deployment, projector: ProjectorService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder whose database is unreachable from it alone (its own network, its pool gone) still answers
    discovery: its standby waited for ever while nothing was applied. After FAILING_HANDOVER_S of failed writes
    it leaves its consumers to the standby."""
    monkeypatch.setattr(projector_worker, "FAILING_HANDOVER_S", 1.0)
    async with _standing_by(deployment) as standby:
        for pool in projector._pools.values():
            pool.terminate()  # as if this process alone had lost the database
        with structlog.testing.capture_logs() as logged:
            later = await deployment.publisher.publish(upsert("acme", document("b", "beta")))
            await deployment.wait_projected(later.seq, timeout_s=40)
        assert "projector_failing_hands_over" in [entry["event"] for entry in logged]
        assert standby._projections
        assert not projector._projections


async def test_a_spell_without_discovery_makes_no_peer_gone_for_good(
    deployment: Deployment, projector: ProjectorService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault tester's: both servers restarted, and nothing answered discovery for longer than the lease, not even
    a process's own announcement. Each process marked the other gone for good, so neither stood by for the other
    once they answered again: the two took the consumer from each other every second or two (epochs past 180),
    and copies of events applied out of turn lost changes. A silence heard while blind is no departure now."""
    newer = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
    hearing = projector_worker.discover
    blind = False

    async def sometimes_blind(nc: object, name: str, *args: object) -> list[Worker]:
        return [] if blind else await hearing(nc, name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(projector_worker, "discover", sometimes_blind)
    await newer.start()
    try:
        async with asyncio.timeout(20):  # the earlier process applies, the newer one stands by
            while newer._projections or not projector._projections:
                await asyncio.sleep(0.1)
        blind = True
        await asyncio.sleep(projector_worker.HOLDER_LEASE_S + 2 * projector_worker.HOLD_CHECK_S)
        blind = False
        assert projector._service is not None
        assert newer._service is not None
        assert projector._service.id not in newer._departed  # each stands by for the other again, as before
        assert newer._service.id not in projector._departed
        await asyncio.sleep(2 * projector_worker.HOLD_CHECK_S)  # both heard again, whatever they did meanwhile
        epoch = "SELECT epoch FROM projection_fences WHERE durable = $1"
        durable = deployment.names.postgres_projector_durable
        before = (await deployment.fetch(epoch, durable))[0]["epoch"]
        await asyncio.sleep(4 * projector_worker.HOLD_CHECK_S)
        assert (await deployment.fetch(epoch, durable))[0]["epoch"] == before  # no claim changed hands
        assert bool(projector._projections) != bool(newer._projections)  # one applies
        ack = await deployment.publisher.publish(upsert("acme", document("after", "after the spell")))
        await deployment.wait_projected(ack.seq, timeout_s=30)
    finally:
        await newer.stop()


async def test_status_names_the_partition_whose_writes_hang_while_the_other_partition_goes_on(
    deployment_settings: Settings,
    servers: Endpoints,
    nats_logins: dict[str, tuple[str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A review: a partition's consumer acks the other partitions' deltas as it passes them, so its last ack moved
    while its own writes failed, and status, reading the last ack, saw nothing wrong. Its index position does not
    move: that is read now."""
    settings = deployment_settings.model_copy(update={"projector_partitions": 2, "statement_timeout_ms": 300})
    stuck, flowing = _spread_workspaces(2, per_partition=1)
    async with open_deployment(settings, servers.database_url, nats_logins) as deployment:
        service = ProjectorService(settings, deployment.nats_url_as("projector"), deployment.database_url)
        await service.start()
        holder = await asyncpg.connect(deployment.database_url)
        try:
            durables = deployment.names.postgres_projector_durables(2)
            first = await deployment.publisher.publish_many(
                [upsert(stuck, document("a", "alpha")), upsert(flowing, document("a", "alpha"))]
            )
            await deployment.wait_projected(first[-1].seq)
            async with asyncio.timeout(10):  # each index position as its projector's look records it
                while (
                    len(await deployment.fetch("SELECT 1 FROM projection_fences WHERE position >= $1", first[-1].seq))
                    < 2
                ):
                    await asyncio.sleep(0.1)
            monkeypatch.setattr(status_module, "STALLED_AFTER_S", 2.0)
            placement = Placement.of(settings, deployment.database_url)
            async with holder.transaction():  # the stuck workspace's row held: its update waits, and times out
                await holder.execute("SELECT 1 FROM documents WHERE workspace = $1 AND id = 'a' FOR UPDATE", stuck)
                await deployment.publisher.publish(upsert(stuck, document("a", "beta")))
                for n in range(5):  # the other partition goes on, and the stuck consumer acks these as it passes
                    ack = await deployment.publisher.publish(upsert(flowing, document(f"d{n}", f"text {n}")))
                    await asyncio.sleep(1)
                assert await ack_floor(deployment.js, deployment.names.delta_stream, durables[1]) >= ack.seq
                status = await deployment_status(deployment.nc, deployment.names, placement)
            stalled = [problem for problem in status.problems if "has settled nothing for" in problem]
            assert len(stalled) == 1, status.problems
            assert durables[0] in stalled[0]
        finally:
            await holder.close()
            await service.stop()
