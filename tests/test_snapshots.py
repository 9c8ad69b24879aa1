"""The query worker's reads: a session's reads share one snapshot on one connection, taking turns; a failed read
leaves the rest of the session reading alone; outside a session every read is a snapshot of its own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg
import numpy as np
import pytest

from ontofabric.services.projector.planning import Delta
from ontofabric.services.projector.store import PostgresProjectionStore
from ontofabric.services.query.core import Scope, SearchInput
from ontofabric.services.query.postgres import PostgresDense, PostgresDocuments, PostgresKeyword, PostgresSnapshots
from ontofabric.shared.db import create_pool, is_unavailable, migrate

from .conftest import Deployment
from .factories import document, unit_vector, upsert

SCOPE = Scope("acme", "main")
IDLE_IN_TRANSACTION = (
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state LIKE 'idle in transaction%'"
)


@pytest.fixture
async def pool(deployment: Deployment) -> AsyncIterator[asyncpg.Pool]:
    await migrate(deployment.database_url, deployment.settings)
    pool = await create_pool(deployment.database_url, deployment.settings, keep_session=True)
    yield pool
    await pool.close()


@dataclass(frozen=True)
class Reads:
    """A store with document "a" projected, and the query worker's snapshots and document reads over it."""

    pool: asyncpg.Pool
    store: PostgresProjectionStore
    snapshots: PostgresSnapshots
    documents: PostgresDocuments

    async def write(self, seq: int, doc_id: str, text: str) -> None:
        await self.store.apply([Delta(seq, upsert("acme", document(doc_id, text, embedding=unit_vector(doc_id))))])


@pytest.fixture
async def reads(pool: asyncpg.Pool) -> Reads:
    snapshots = PostgresSnapshots(pool)
    reads = Reads(pool, PostgresProjectionStore(pool, "english"), snapshots, PostgresDocuments(snapshots))
    await reads.write(1, "a", "alpha parser")
    return reads


async def _backends(pool: asyncpg.Pool) -> int:
    """Connections of ontofabric's pools to this test's database."""
    sql = "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'ontofabric' AND datname = current_database()"
    return int(await pool.fetchval(sql))


async def test_reads_in_a_session_share_one_snapshot_and_take_turns(reads: Reads) -> None:
    pool, snapshots, documents = reads.pool, reads.snapshots, reads.documents
    dense = PostgresDense(snapshots, 100)
    query = SearchInput("parser", np.asarray(unit_vector("a"), dtype=np.float32))
    async with snapshots.session(SCOPE):
        first = await documents.fetch(SCOPE, ["a", "b"])
        await reads.write(2, "b", "beta parser")  # committed while the session reads
        # At once, as the pipeline's stages may: they take turns on the session's one connection.
        near, scored, second = await asyncio.gather(
            dense.search(SCOPE, query, 10),
            documents.similarities(SCOPE, query, ["a", "b"]),
            documents.fetch(SCOPE, ["a", "b"]),
        )
        assert [c.id for c in near.candidates] == [c.id for c in scored.candidates] == ["a"]
        assert set(second.documents) == set(first.documents) == {"a"}
        assert near.version == scored.version == second.version == first.version
        held = await _backends(pool)
        # The keyword retriever reads alone (it runs while the query is embedded): it sees the new document.
        keyword = PostgresKeyword(snapshots, "english", 1.2, 0.85, 2.0)
        alone = await keyword.search(SCOPE, query, 10)
        assert sorted(c.id for c in alone.candidates) == ["a", "b"]
        assert alone.version != first.version
    after = await documents.fetch(SCOPE, ["a", "b"])
    assert set(after.documents) == {"a", "b"}
    assert after.version == alone.version
    # The pool's connection for counting, and the session's: none of the reads at once opened another.
    assert held == 2


async def test_after_a_read_fails_the_rest_of_the_session_reads_alone(reads: Reads) -> None:
    pool, snapshots, documents = reads.pool, reads.snapshots, reads.documents
    wrong = SearchInput("parser", np.ones(3, dtype=np.float32))  # not the index's dimension
    async with snapshots.session(SCOPE):
        await documents.fetch(SCOPE, ["a"])
        with pytest.raises(asyncpg.DataError):
            await documents.similarities(SCOPE, wrong, ["a"])  # aborts the session's transaction
        await reads.write(2, "b", "beta parser")
        # A snapshot of its own now: it sees what committed since.
        assert set((await documents.fetch(SCOPE, ["a", "b"])).documents) == {"a", "b"}
        # The session's aborted transaction ended before that read went alone: its locks were not held meanwhile.
        assert await pool.fetchval(IDLE_IN_TRANSACTION) == 0
    assert await pool.fetchval(IDLE_IN_TRANSACTION) == 0


async def test_a_task_that_outlives_its_session_reads_alone(reads: Reads) -> None:
    pool, snapshots, documents = reads.pool, reads.snapshots, reads.documents
    go = asyncio.Event()

    async def late_read() -> set[str]:
        await go.wait()
        return set((await documents.fetch(SCOPE, ["a", "b"])).documents)

    async with snapshots.session(SCOPE):
        await documents.fetch(SCOPE, ["a"])
        straggler = asyncio.ensure_future(late_read())  # carries the session in its context
    await reads.write(2, "b", "beta parser")
    go.set()
    assert await straggler == {"a", "b"}
    assert await pool.fetchval(IDLE_IN_TRANSACTION) == 0


async def test_a_session_of_another_branch_does_not_hold_this_ones_reads(reads: Reads) -> None:
    snapshots, documents = reads.snapshots, reads.documents
    async with snapshots.session(Scope("acme", "feature")):
        before = await documents.fetch(SCOPE, ["a", "b"])
        await reads.write(2, "b", "beta parser")
        assert set((await documents.fetch(SCOPE, ["a", "b"])).documents) == {"a", "b"}
        assert set(before.documents) == {"a"}


async def test_a_read_cancelled_twice_still_ends_its_transaction(reads: Reads) -> None:
    """A red team saw asyncpg report, at error level, connections given back to the pool inside their transaction
    under load: a read cancelled (its deadline), then cancelled again while its ROLLBACK ran (its answer given up)."""
    reported: list[str] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: reported.append(str(context.get("message"))))
    try:
        for _ in range(3):

            async def slow() -> None:
                async with reads.snapshots.read(SCOPE) as snapshot:
                    await snapshot.conn.fetch("SELECT pg_sleep(2)")

            read = asyncio.ensure_future(slow())
            await asyncio.sleep(0.2)
            read.cancel()
            await asyncio.sleep(0)  # into its ROLLBACK
            read.cancel()
            with pytest.raises(asyncio.CancelledError):
                await read
    finally:
        loop.set_exception_handler(None)
    assert reported == []
    assert await reads.pool.fetchval(IDLE_IN_TRANSACTION) == 0
    assert set((await reads.documents.fetch(SCOPE, ["a"])).documents) == {"a"}


async def test_a_read_whose_backend_is_terminated_fails_with_its_own_error(reads: Reads) -> None:
    """Not with the one its clean-up met: asyncpg's pool takes a connection its server ended back at once, and
    every call on it raises then, the clean-up's ``is_closed()`` too (a fault tester's log said "released back to
    the pool" for reads that had failed for the server's reason)."""

    async def read_after_its_backend_ended() -> None:
        async with reads.snapshots.read(SCOPE, alone=True) as snapshot:
            terminated = await reads.pool.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = current_database()"
                " AND state LIKE 'idle in transaction%'"
            )
            assert terminated == 1
            await asyncio.sleep(0.2)  # asyncpg has heard of it
            await snapshot.conn.fetchval("SELECT 1")

    # Which error the statement meets depends on when asyncpg hears of the end.
    with pytest.raises(Exception) as failed:  # noqa: PT011
        await read_after_its_backend_ended()
    assert "is_closed" not in str(failed.value)
    assert is_unavailable(failed.value)  # answered `unavailable`, retryable
    assert set((await reads.documents.fetch(SCOPE, ["a"])).documents) == {"a"}  # a new connection serves
