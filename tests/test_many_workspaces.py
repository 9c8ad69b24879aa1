"""One workspace's work among many: a projector's batch and a query's reads lock that workspace's partitions, not
every workspace's. An outside tester's platform of 1,400 workspaces saw a batch's statements planned over (and
locking) every partition and index, 22,000 locks and 0.8 s of planning a batch, a branch query take 17,000 locks,
and answers and batches fail with "out of shared memory"."""

from __future__ import annotations

import hashlib

import asyncpg

from ontofabric.services.projector import store as store_module
from ontofabric.services.projector.planning import Delta
from ontofabric.services.projector.store import PostgresProjectionStore
from ontofabric.services.query.core import Scope, SearchInput
from ontofabric.services.query.postgres import PostgresDense, PostgresDocuments, PostgresSnapshots
from ontofabric.shared.db import create_pool, migrate

from .conftest import Deployment
from .factories import document, unit_vector, upsert

WORKSPACES = 30
PLANS = 7
"""Runs of each statement on one connection: PostgreSQL plans a prepared statement with its values five times,
then may switch to a generic plan, which covers every partition."""


def _suffix(workspace: str) -> str:
    return hashlib.md5(workspace.encode()).hexdigest()[:20]  # as ensure_workspace_partition names partitions


async def _others_locked(conn: asyncpg.Connection, workspace: str) -> list[str]:
    """The partitions and partition indexes of workspaces other than ``workspace`` this session holds locks on."""
    rows = await conn.fetch(
        "SELECT DISTINCT c.relname FROM pg_locks l JOIN pg_class c ON c.oid = l.relation"
        " LEFT JOIN pg_index i ON i.indexrelid = c.oid"  # an index's table: index names are cut at 63 bytes
        " JOIN pg_class t ON t.oid = coalesce(i.indrelid, c.oid)"
        " WHERE l.pid = pg_backend_pid() AND t.relname LIKE '%\\_ws\\_%' AND t.relname NOT LIKE '%\\_ws\\_' || $1",
        _suffix(workspace),
    )
    return sorted(r["relname"] for r in rows)


async def test_a_batch_and_a_query_lock_only_their_own_workspace_s_partitions(deployment: Deployment) -> None:
    await migrate(deployment.database_url, deployment.settings)
    pool = await create_pool(deployment.database_url, deployment.settings, min_size=1, max_size=1)
    try:
        store = PostgresProjectionStore(pool, "english")
        deltas = [
            upsert(f"w{n}", document("d", f"text of workspace {n}", embedding=unit_vector(f"w{n}")))
            for n in range(WORKSPACES)
        ]
        deltas.append(upsert("w0", document("b", "a branch's own text", embedding=unit_vector("b")), branch="feat"))
        await store.apply([Delta(seq, delta) for seq, delta in enumerate(deltas, 1)])

        keys = [["w0"], ["main"], ["d"]]
        async with pool.acquire() as conn, conn.transaction():  # a batch's statements, rolled back
            for _ in range(PLANS):
                await conn.fetch(store_module._CURRENT_DOCUMENTS, *keys)
                await conn.fetch(store_module._LIVE_LENGTHS, *keys)
                await conn.execute(store_module._DROP_POSTINGS, *keys)
                await conn.execute(store_module._ADD_POSTINGS, *keys)
            assert await _others_locked(conn, "w0") == []
            await conn.execute("ROLLBACK; BEGIN")

        snapshots = PostgresSnapshots(pool)
        dense, documents = PostgresDense(snapshots, 100), PostgresDocuments(snapshots)
        for scope in (Scope("w0", "main"), Scope("w0", "feat")):
            query = SearchInput("text", unit_vector("w0"), None)
            async with documents.session(scope):  # the reads of one answer share a snapshot, and its locks
                for _ in range(PLANS):
                    assert (await dense.search(scope, query, 10)).candidates
                    assert (await documents.fetch(scope, ["d"])).documents
                async with snapshots.read(scope) as snapshot:
                    assert await _others_locked(snapshot.conn, "w0") == [], scope
    finally:
        await pool.close()
