"""A rebuild's shadow schema: the tables it replays a workspace into (built by the same migrations as the live
ones, so the projector's SQL runs unchanged), its bookkeeping (how far the replay got, what it rejected), the checks
of what it holds, and the swap of its partitions into the live tables."""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass

import asyncpg
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from ontofabric.services.projector.planning import Rejection, VersionState
from ontofabric.services.projector.postgres import PostgresSink
from ontofabric.services.projector.store import PostgresProjectionStore, link_key_sql, unsigned64
from ontofabric.shared.checksums import CONTENT_MD5_SQL

from .verification import ExpectedIndex, RowFacts, RowKey, differences

BOUND_CHECK = "ontofabric_rebuild_bound"
"""A CHECK constraint equal to the partition bound: ATTACH PARTITION then trusts it instead of scanning the table
while it holds the lock."""
PARENT_LOCK_TRY_MS = 200
"""One try at the live parents' exclusive lock: below PostgreSQL's deadlock_timeout (1 s), so when a query and the
swap wait on each other, the swap gives way (and tries again) before the query is killed as a deadlock victim."""


class RebuildFailed(Exception):
    """The rebuild stopped before swapping; the live index is as it was."""

    def __init__(self, message: str, *, resumable: bool = True, shadow: bool = True, advice: str = "") -> None:
        super().__init__(message)
        self.resumable = resumable
        """Whether running again can succeed as things are (else the shadow differs, or the stream cannot serve)."""
        self.shadow = shadow
        """Whether shadow tables may have been made (refused before any was: nothing to discard)."""
        self.advice = advice
        """What to do, where neither resuming nor the default advice fits."""


SCHEMA_PREFIX = "ontofabric_rebuild_"


def shadow_schema(workspace: str) -> str:
    digest = hashlib.md5(workspace.encode("utf-8"), usedforsecurity=False).hexdigest()[:20]
    return f"{SCHEMA_PREFIX}{digest}"


@dataclass(frozen=True)
class LeftSchema:
    """A schema of a rebuild on a database: its shadow (the rebuild running, or interrupted) or the tables its swap
    retired and did not drop."""

    schema: str
    workspace: str | None
    """Read from its rows; None when it holds none yet (or is a swap's retired tables)."""
    size_bytes: int

    @property
    def retired(self) -> bool:
        return self.schema.endswith("_retired")


async def rebuild_schemas(conn: asyncpg.Connection) -> list[LeftSchema]:
    """The rebuilds' schemas this database holds, with their tables' sizes (status names them: an interrupted
    rebuild's shadow was said nowhere, and holds as much as the workspace's index)."""
    rows = await conn.fetch(
        "SELECT n.nspname AS schema,"
        " coalesce(sum(pg_total_relation_size(c.oid)) FILTER (WHERE c.relkind = 'r'), 0)::bigint AS size"
        " FROM pg_namespace n LEFT JOIN pg_class c ON c.relnamespace = n.oid"
        " WHERE starts_with(n.nspname, $1) GROUP BY n.nspname ORDER BY n.nspname",
        SCHEMA_PREFIX,
    )
    left = []
    for row in rows:
        try:
            workspace = await conn.fetchval(f'SELECT workspace FROM "{row["schema"]}".documents LIMIT 1')
        except asyncpg.UndefinedTableError:  # a swap's retired tables, or a shadow not yet migrated
            workspace = None
        left.append(LeftSchema(row["schema"], workspace, int(row["size"])))
    return left


def retired_schema(workspace: str) -> str:
    """Where the swap moves the live partitions it replaces, until it drops them after the commit."""
    return f"{shadow_schema(workspace)}_retired"


async def drop_schema(conn: asyncpg.Connection, schema: str) -> None:
    await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


_LINK_KEY = link_key_sql()


def _rows_sql(schema: str, only: bool) -> str:
    """Every row of a workspace with the facts verification compares; ``only``: restricted to given (branch, key)
    pairs, $2 the branches and $3 the keys (a link's as one string)."""
    pairs = " IN (SELECT * FROM unnest($2::text[], $3::text[]))"

    def restricted(key: str) -> str:
        return f"AND (branch, {key}){pairs}" if only else ""

    return f"""
        SELECT branch, 'document' AS kind, id AS key, stream_seq, deleted, transparent,
               CASE WHEN deleted THEN NULL ELSE {CONTENT_MD5_SQL} END AS content_md5,
               CASE WHEN deleted THEN NULL ELSE md5(vector_send(embedding)) END AS vector_md5,
               CASE WHEN deleted THEN NULL ELSE md5(token_signs) END AS signs_md5,
               CASE WHEN deleted THEN NULL
                    ELSE md5(convert_to(second_model, 'UTF8') || decode('00', 'hex') || second_vector)
               END AS second_md5,
               CASE WHEN deleted THEN NULL ELSE embedding_model END AS vector_model
          FROM {schema}.documents WHERE workspace = $1 {restricted("id")}
        UNION ALL
        SELECT branch, 'node', object_type, stream_seq, deleted, transparent, NULL, NULL, NULL, NULL, NULL
          FROM {schema}.ontology_nodes WHERE workspace = $1 {restricted("object_type")}
        UNION ALL
        SELECT branch, 'link', {_LINK_KEY}, stream_seq, deleted, transparent, NULL, NULL, NULL, NULL, NULL
          FROM {schema}.ontology_links WHERE workspace = $1 {restricted(_LINK_KEY)}"""


class Shadow:
    """The shadow schema of one workspace: its projection store, its bookkeeping, its checks and the swap."""

    def __init__(
        self, admin: asyncpg.Connection, pool: asyncpg.Pool, schema: str, workspace: str, text_search_config: str
    ) -> None:
        self.admin = admin
        self._schema = schema
        self._workspace = workspace
        self.sink = PostgresSink(PostgresProjectionStore(pool, text_search_config), None, index="postgres-shadow")
        """The projector's own sink over the shadow's tables; the swap announces the versions."""

    @staticmethod
    async def create_bookkeeping(admin: asyncpg.Connection, schema: str) -> None:
        """The replay's position (every delta of the workspace up to it is in the shadow, or rejected) and the
        deltas it rejected, beside the tables they describe."""
        await admin.execute(
            f'CREATE TABLE IF NOT EXISTS "{schema}".rebuild_progress ('
            " singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton), replayed_seq bigint NOT NULL)"
        )
        await admin.execute(
            f'CREATE TABLE IF NOT EXISTS "{schema}".rebuild_rejections ('
            " seq bigint PRIMARY KEY, reason text NOT NULL, detail text NOT NULL)"
        )

    def _table(self, name: str) -> str:
        return f'"{self._schema}"."{name}"'

    @property
    def _retired(self) -> str:
        return retired_schema(self._workspace)

    async def copy_handled_events(self, conn: asyncpg.Connection, after: int, upto: int | None) -> None:
        """Into the live table, the shadow's handled events of stream sequences in (after, upto], as the workspace's:
        the shadow holds no other, and rows it kept from before infra/migrations/0019 (a rebuild resumed across
        the upgrade) say ''."""
        await conn.execute(
            "INSERT INTO public.handled_events (workspace, event_id, stream_seq, payload_digest)"
            f" SELECT $3, event_id, stream_seq, payload_digest FROM {self._table('handled_events')}"
            " WHERE stream_seq > $1 AND ($2::bigint IS NULL OR stream_seq <= $2) ON CONFLICT DO NOTHING",
            after,
            upto,
            self._workspace,
        )

    async def add_handled_events(self, events: dict[str, int]) -> None:
        """Events a snapshot (of this workspace) says were handled, though the shadow never replays them (the
        stream dropped them)."""
        await self.admin.executemany(
            f"INSERT INTO {self._table('handled_events')} (workspace, event_id, stream_seq) VALUES ($1, $2, $3)"
            " ON CONFLICT DO NOTHING",
            [(self._workspace, event_id, seq) for event_id, seq in events.items()],
        )

    async def replayed_seq(self) -> int:
        seq = await self.admin.fetchval(f"SELECT replayed_seq FROM {self._table('rebuild_progress')}")
        return int(seq or 0)

    async def rejected(self) -> set[int]:
        """The sequences of the deltas the replay rejected so far, whatever the reason: those refused after they
        passed validation (the store's refusals, another embedding model than this process has) as well as the
        rest (a review's: a resumed run folded all but apply_failed's, and found their rows missing)."""
        records = await self.admin.fetch(f"SELECT seq FROM {self._table('rebuild_rejections')}")
        return {r["seq"] for r in records}

    async def rejections(self) -> Counter[str]:
        """The deltas this rebuild's replay rejected so far, by reason: a resumed run's report counts those of the
        run it resumes too (a tester's `--force` said "rejected: none" of the two its first run had rejected)."""
        records = await self.admin.fetch(
            f"SELECT reason, count(*) AS n FROM {self._table('rebuild_rejections')} GROUP BY reason"
        )
        return Counter({r["reason"]: int(r["n"]) for r in records})

    async def record(self, replayed_seq: int, rejections: list[tuple[int, Rejection]]) -> None:
        async with self.admin.transaction():
            await self.admin.executemany(
                f"INSERT INTO {self._table('rebuild_rejections')} (seq, reason, detail) VALUES ($1, $2, $3)"
                " ON CONFLICT DO NOTHING",
                [(seq, rejection.reason, rejection.detail) for seq, rejection in rejections],
            )
            await self.admin.execute(
                f"INSERT INTO {self._table('rebuild_progress')} (replayed_seq) VALUES ($1)"
                " ON CONFLICT (singleton) DO UPDATE SET replayed_seq = EXCLUDED.replayed_seq",
                replayed_seq,
            )

    async def partitions(self) -> list[tuple[str, str]]:
        """(parent, partition) of the shadow's partitioned tables; the live partitions have the same names."""
        records = await self.admin.fetch(
            "SELECT parent.relname AS parent, child.relname AS partition FROM pg_inherits i"
            " JOIN pg_class parent ON parent.oid = i.inhparent JOIN pg_class child ON child.oid = i.inhrelid"
            " WHERE parent.relnamespace = $1::regnamespace AND parent.relkind = 'p' ORDER BY 1",  # tables, not indexes
            self._schema,
        )
        return [(r["parent"], r["partition"]) for r in records]

    async def prepare_for_swap(self) -> None:
        """Outside the swap's lock: vacuumed pages (index-only scans over postings need them all-visible),
        planner statistics, and the partition-bound checks ATTACH will trust."""
        literal = await self.admin.fetchval("SELECT quote_literal($1)", self._workspace)
        for _, partition in await self.partitions():
            await self.admin.execute(f"VACUUM (ANALYZE) {self._table(partition)}")
            await self.admin.execute(
                f"ALTER TABLE {self._table(partition)} DROP CONSTRAINT IF EXISTS {BOUND_CHECK},"
                f" ADD CONSTRAINT {BOUND_CHECK} CHECK (workspace = {literal})"
            )

    async def rows(self, only: Collection[RowKey] | None = None) -> dict[RowKey, RowFacts]:
        """The workspace's rows in the shadow, all or only the given ones."""
        args: list[object] = [self._workspace]
        if only is not None:
            args += [[branch for branch, _, _ in only], [key for _, _, key in only]]
        records = await self.admin.fetch(_rows_sql(f'"{self._schema}"', only is not None), *args)
        rows = {
            (r["branch"], r["kind"], r["key"]): RowFacts(
                r["stream_seq"],
                r["deleted"],
                r["transparent"],
                r["content_md5"],
                r["vector_md5"],
                r["signs_md5"],
                r["second_md5"],
                r["vector_model"],
            )
            for r in records
        }
        return rows if only is None else {k: v for k, v in rows.items() if k in only}

    async def live_row_seqs(self, after: int = 0) -> dict[RowKey, int]:
        """The sequence that wrote each of the workspace's live rows, of those written after ``after``."""
        records = await self.admin.fetch(
            "SELECT branch, 'document' AS kind, id AS key, stream_seq FROM public.documents"
            " WHERE workspace = $1 AND stream_seq > $2"
            " UNION ALL SELECT branch, 'node', object_type, stream_seq FROM public.ontology_nodes"
            " WHERE workspace = $1 AND stream_seq > $2"
            f" UNION ALL SELECT branch, 'link', {_LINK_KEY}, stream_seq"
            " FROM public.ontology_links WHERE workspace = $1 AND stream_seq > $2",
            self._workspace,
            after,
        )
        return {(r["branch"], r["kind"], r["key"]): r["stream_seq"] for r in records}

    async def verify(self, expected: ExpectedIndex, only: Collection[RowKey] | None = None) -> list[str]:
        """How the shadow differs from the fold of the stream (all rows, or only the given ones), and whether its
        versions and keyword statistics add up (checked on the whole, which only ``only=None`` does)."""
        wanted = expected.rows(only)
        versions = await self.admin.fetch(
            f"SELECT branch, state_hash, stream_seq FROM {self._table('ontology_versions')} WHERE workspace = $1",
            self._workspace,
        )
        actual_versions = {r["branch"]: VersionState(unsigned64(r["state_hash"]), r["stream_seq"]) for r in versions}
        problems = differences(wanted, await self.rows(only), expected.versions(), actual_versions)
        return problems if only is not None else problems + await self._keyword_statistics_problems()

    async def _keyword_statistics_problems(self) -> list[str]:
        """BM25 reads postings, their terms' document frequencies and per-branch counts: each must agree with what it
        was made from."""
        problems = []
        postings = await self.admin.fetchval(
            f"SELECT count(*) FROM {self._table('postings')} WHERE workspace = $1", self._workspace
        )
        terms = await self.admin.fetchval(
            f"SELECT coalesce(sum(length(search_vector)), 0) FROM {self._table('documents')}"
            " WHERE workspace = $1 AND NOT deleted",
            self._workspace,
        )
        if postings != terms:
            problems.append(f"{postings} postings for {terms} distinct terms of live documents")
        miscounted = await self.admin.fetchval(
            f"""
            SELECT count(*)
              FROM (SELECT branch, term, count(*) AS df FROM {self._table("postings")} WHERE workspace = $1
                     GROUP BY branch, term) p
              FULL JOIN (SELECT branch, term, df FROM {self._table("term_statistics")}
                          WHERE workspace = $1 AND df <> 0) s USING (branch, term)
             WHERE p.df IS DISTINCT FROM s.df
            """,
            self._workspace,
        )
        if miscounted:
            problems.append(f"{miscounted} terms whose document frequency is not their postings' count")
        mismatched = await self.admin.fetch(
            f"""
            SELECT v.branch, v.doc_count, v.total_length, coalesce(d.docs, 0) AS docs, coalesce(d.length, 0) AS length
              FROM {self._table("ontology_versions")} v
              LEFT JOIN (SELECT branch, count(*) AS docs, sum(doc_length) AS length
                           FROM {self._table("documents")} WHERE workspace = $1 AND NOT deleted GROUP BY branch) d
                     USING (branch)
             WHERE v.workspace = $1 AND (v.doc_count, v.total_length) <> (coalesce(d.docs, 0), coalesce(d.length, 0))
            """,
            self._workspace,
        )
        problems += [
            f"branch {r['branch']!r}: statistics count {r['doc_count']} documents of total length {r['total_length']},"
            f" the table holds {r['docs']} of {r['length']}"
            for r in mismatched
        ]
        return problems

    async def check_same_migrations(self, conn: asyncpg.Connection) -> None:
        """The shadow's parents must be the live ones' twins, or ATTACH would build the indexes the shadow lacks
        while it holds the live parents' lock."""
        live = await conn.fetchval("SELECT max(version) FROM public.schema_migrations")
        shadow = await conn.fetchval(f"SELECT max(version) FROM {self._table('schema_migrations')}")
        if live != shadow:
            raise RebuildFailed(
                f"the live schema is at migration {live}, the shadow at {shadow}: run the rebuild with the same "
                "version of ontofabric as the workers",
                resumable=False,
            )

    async def swap_into(self, conn: asyncpg.Connection, lock_timeout_s: float) -> float:
        """Inside the swap's transaction: the shadow's rows, versions and partitions replace the live ones, and the
        shadow schema is dropped. The live parents' exclusive lock comes last and is held the least time; returns
        when it was taken (``time.perf_counter``)."""
        workspace = self._workspace
        partitions = await self.partitions()
        # The lock ensure_workspace_partition takes: a live projector cannot create the partition meanwhile.
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext('ontofabric.partition'), hashtext($1))", workspace)
        for table in ("ontology_nodes", "ontology_links"):
            columns = await conn.fetchval(
                "SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum) FROM pg_attribute"
                " WHERE attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped",
                f"public.{table}",
            )
            await conn.execute(f"DELETE FROM public.{table} WHERE workspace = $1", workspace)
            await conn.execute(
                f"INSERT INTO public.{table} ({columns}) SELECT {columns} FROM {self._table(table)}"
                " WHERE workspace = $1",
                workspace,
            )
        await self._swap_versions(conn)
        await conn.execute(
            "INSERT INTO public.workspaces (workspace, partition_name)"
            f" SELECT workspace, partition_name FROM {self._table('workspaces')} WHERE workspace = $1"
            " ON CONFLICT DO NOTHING",
            workspace,
        )
        for parent, partition in partitions:
            await conn.execute(f"ALTER TABLE {self._table(parent)} DETACH PARTITION {self._table(partition)}")
        await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{self._retired}"')
        # Everything the rest needs, with the whole budget, before the live parents are held: the shadow's tables
        # (dropped at the end) and the live partitions against VACUUM and ANALYZE (which queries do not conflict
        # with, and autovacuum gives way to).
        shadow_tables = await conn.fetchval(
            "SELECT string_agg(format('%I.%I', n.nspname, c.relname), ', ') FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relkind IN ('r', 'p')",
            self._schema,
        )
        await conn.execute(f"LOCK TABLE {shadow_tables} IN ACCESS EXCLUSIVE MODE")
        live = [
            name
            for name in (f'public."{partition}"' for _, partition in partitions)
            if await conn.fetchval("SELECT to_regclass($1)", name) is not None
        ]
        if live:
            await conn.execute(f"LOCK TABLE {', '.join(live)} IN SHARE UPDATE EXCLUSIVE MODE")
        parents = [f'ONLY public."{parent}"' for parent, _ in partitions]
        await lock_exclusively(conn, parents + live, lock_timeout_s)
        locked = time.perf_counter()
        literal = await conn.fetchval("SELECT quote_literal($1)", workspace)
        for parent, partition in partitions:
            if f'public."{partition}"' in live:
                await conn.execute(f'ALTER TABLE public."{parent}" DETACH PARTITION public."{partition}"')
                # Retired, dropped after the commit: a DROP here would unlink its files inside the lock.
                await conn.execute(f'ALTER TABLE public."{partition}" SET SCHEMA "{self._retired}"')
            await conn.execute(f"ALTER TABLE {self._table(partition)} SET SCHEMA public")
            # The partition's indexes match the parent's, so ATTACH adopts them rather than building new ones.
            await conn.execute(
                f'ALTER TABLE public."{parent}" ATTACH PARTITION public."{partition}" FOR VALUES IN ({literal})'
            )
            await conn.execute(f'ALTER TABLE public."{partition}" DROP CONSTRAINT {BOUND_CHECK}')
        await drop_schema(conn, self._schema)
        return locked

    async def _swap_versions(self, conn: asyncpg.Connection) -> None:
        """The shadow's versions, each with a revision above the live one: announcements only ever move forward.
        A branch only the live index has is emptied the same way, so its next change is announced too."""
        old = {
            r["branch"]: r["revision"]
            for r in await conn.fetch(
                "DELETE FROM public.ontology_versions WHERE workspace = $1 RETURNING branch, revision", self._workspace
            )
        }
        await conn.execute(
            f"""
            INSERT INTO public.ontology_versions
                   (workspace, branch, state_hash, stream_seq, revision, doc_count, total_length)
            SELECT $1, branch, coalesce(s.state_hash, 0), coalesce(s.stream_seq, 0),
                   greatest(coalesce(o.revision, 0), coalesce(s.revision, 0)) + 1,
                   coalesce(s.doc_count, 0), coalesce(s.total_length, 0)
              FROM (SELECT * FROM {self._table("ontology_versions")} WHERE workspace = $1) s
              FULL JOIN unnest($2::text[], $3::bigint[]) AS o(branch, revision) USING (branch)
            """,
            self._workspace,
            list(old),
            list(old.values()),
        )


async def lock_exclusively(conn: asyncpg.Connection, tables: list[str], budget_s: float) -> None:
    """ACCESS EXCLUSIVE on the live parents (ONLY: not every workspace's partitions) and the workspace's own
    partitions, in short tries: a query holding one parent and waiting for the other would otherwise deadlock with
    the swap, and every query would queue behind a long wait. Inside the swap's transaction, whose lock timeout it
    leaves as it found it when it succeeds; each failed try is rolled back to, and released from, one savepoint.
    No try starts that could end past ``budget_s``."""
    budget = await conn.fetchval("SHOW lock_timeout")
    try_s = PARENT_LOCK_TRY_MS / 1000

    def out_of_budget(state: RetryCallState) -> bool:
        return (state.seconds_since_start or 0.0) + try_s > budget_s  # another try could end past the budget

    await conn.execute(f"SET LOCAL lock_timeout = '{PARENT_LOCK_TRY_MS}ms'")
    async for attempt in AsyncRetrying(
        retry=retry_if_exception_type(asyncpg.LockNotAvailableError),
        wait=wait_exponential(multiplier=0.05, max=1.0),
        stop=out_of_budget,
        reraise=True,
    ):
        with attempt:
            await conn.execute("SAVEPOINT exclusive_try")
            try:
                await conn.execute(f"LOCK TABLE {', '.join(tables)} IN ACCESS EXCLUSIVE MODE")
            except asyncpg.LockNotAvailableError:
                await conn.execute("ROLLBACK TO SAVEPOINT exclusive_try")
                await conn.execute("RELEASE SAVEPOINT exclusive_try")
                raise
            await conn.execute("RELEASE SAVEPOINT exclusive_try")
    # Only on success: a failure ends the swap's transaction, and a statement in an aborted one would hide why.
    await conn.execute(f"SET LOCAL lock_timeout = '{budget}'")
