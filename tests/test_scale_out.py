"""Growing past one machine on existing engines: PostgreSQL streaming read replicas for the query workers."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from ontofabric.contracts import QueryResponse
from ontofabric.services.projector.worker import ProjectorService
from ontofabric.services.query.client import QueryClient
from ontofabric.services.query.worker import QueryService
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

from .conftest import Deployment, metric_points, open_deployment, with_database
from .factories import document, upsert

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
