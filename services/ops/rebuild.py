"""Rebuild one workspace's Postgres index from the delta stream while the live projector keeps running.

1. **Replay.** A consumer of the workspace's deltas from sequence 1 applies them, through the projector's own
   validation and store, to shadow tables: a schema of their own (``ontofabric_rebuild_<hash>``) built by the same
   migrations, so the projector's SQL runs unchanged against it. A delta the projector would dead-letter is
   recorded in the shadow schema, not published again.
2. **Verify.** The shadow must hold what the stream folds to (:mod:`.verification`): the same rows with the same
   sequences, tombstones and reverts, the same content checksums and ontologyVersions, and keyword statistics that
   agree with its documents.
3. **Swap.** One transaction holds off the live projectors (they wait on the versions table; queries read on),
   lets the shadow catch up with the stream's tail, verifies it again, and puts its partitions and rows in place
   of the live ones. The new ontologyVersions are then announced with a higher revision.

The live tables are untouched until that transaction commits, so a rebuild is never half-swapped. An interrupted
rebuild leaves its shadow schema behind: the next run resumes from it, ``--discard`` drops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import asyncpg
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from ontofabric.services.ingest.ingester import Progress
from ontofabric.services.projector.planning import Delta, Limits, Rejection, VersionState, validate_delta
from ontofabric.services.projector.store import PostgresProjectionStore, VersionUpdate, _to_unsigned
from ontofabric.services.projector.worker import VersionPublisher, limits_from
from ontofabric.shared.db import create_pool, is_transient, migrate
from ontofabric.shared.jetstream import backoff_s, connect, ensure_jetstream
from ontofabric.shared.logging import get_logger
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names
from ontofabric.shared.telemetry import tracer

from .verification import ExpectedIndex, RowFacts, RowKey, differences

log = get_logger(__name__)

BOUND_CHECK = "ontofabric_rebuild_bound"
"""A CHECK constraint equal to the partition bound: ATTACH PARTITION then trusts it instead of scanning the table
while it holds the lock."""
APPLY_ATTEMPTS = 8
"""Tries of a batch the database refuses for a transient reason before the run stops (to be resumed later)."""


class RebuildFailed(Exception):
    """The rebuild stopped before swapping; the live index is as it was, the shadow is kept for a resume."""


@dataclass
class RebuildReport:
    workspace: str
    resumed_from: int
    """The last stream sequence a previous run had replayed (0 for a fresh rebuild)."""
    replayed: int = 0
    applied: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    rows: int = 0
    versions: dict[str, str] = field(default_factory=dict)
    swapped: bool = False
    replay_s: float = 0.0
    swap_lock_s: float = 0.0
    """How long the swap held off the live projectors, catching up included."""


def shadow_schema(workspace: str) -> str:
    return f"ontofabric_rebuild_{_suffix(workspace)}"


def _suffix(workspace: str) -> str:
    """As ensure_workspace_partition names a workspace's partitions (infra/migrations/0002)."""
    return hashlib.md5(workspace.encode("utf-8"), usedforsecurity=False).hexdigest()[:20]


class Rebuild:
    def __init__(
        self,
        settings: Settings,
        nats_url: str,
        database_url: str,
        workspace: str,
        progress: Progress,
        *,
        lock_timeout_s: float = 10.0,
    ) -> None:
        self._settings = settings
        self._names = Names(settings.subject_prefix)
        self._nats_url = nats_url
        self._database_url = database_url
        self._workspace = workspace
        self._schema = shadow_schema(workspace)
        self._progress = progress
        self._lock_timeout_s = lock_timeout_s
        self._limits: Limits = limits_from(settings)

    async def discard(self) -> bool:
        """Drop an interrupted rebuild's shadow schema. False when there was none."""
        conn = await asyncpg.connect(self._database_url)
        try:
            async with self._exclusive(conn):
                existed = await self._shadow_exists(conn)
                await conn.execute(f'DROP SCHEMA IF EXISTS "{self._schema}" CASCADE')
                return existed
        finally:
            await conn.close()

    async def run(self) -> RebuildReport:
        with tracer().start_as_current_span("ops.rebuild") as span:
            span.set_attribute("workspace", self._workspace)
            nc = await connect(self._nats_url, "ontofabric-rebuild")
            admin = await asyncpg.connect(self._database_url)
            try:
                async with self._exclusive(admin):
                    return await self._run(nc, admin)
            finally:
                await admin.close()
                await nc.close()

    async def _run(self, nc: Client, admin: asyncpg.Connection) -> RebuildReport:
        js = nc.jetstream()
        await ensure_jetstream(js, self._names, self._settings)
        await self._check_stream(js)
        resumed = await self._shadow_exists(admin)
        await migrate(self._database_url, self._settings, schema=self._schema)
        await admin.execute(
            f'CREATE TABLE IF NOT EXISTS "{self._schema}".rebuild_progress ('
            " singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton), replayed_seq bigint NOT NULL)"
        )
        await admin.execute(
            f'CREATE TABLE IF NOT EXISTS "{self._schema}".rebuild_rejections ('
            " seq bigint PRIMARY KEY, reason text NOT NULL, detail text NOT NULL)"
        )
        pool = await create_pool(self._database_url, self._settings, schema=self._schema)
        try:
            shadow = _Shadow(admin, pool, self._schema, self._workspace, self._settings.text_search_config)
            await pool.execute("SELECT ensure_workspace_partition($1)", self._workspace)
            report = RebuildReport(self._workspace, resumed_from=await shadow.replayed_seq() if resumed else 0)
            log.info(
                "rebuild_started", workspace=self._workspace, schema=self._schema, resumed_from=report.resumed_from
            )
            expected = ExpectedIndex(self._workspace)
            started = time.perf_counter()
            await self._refold(js, shadow, expected, report.resumed_from)
            last = (await js.stream_info(self._names.delta_stream)).state.last_seq
            await self._replay(js, shadow, expected, report, report.resumed_from + 1, last, "replay")
            report.replay_s = time.perf_counter() - started
            await shadow.prepare_for_swap()
            problems = await shadow.verify(expected)
            if problems:
                raise RebuildFailed("the shadow tables differ from the stream: " + " | ".join(problems))
            await self._swap(js, nc, shadow, expected, report)
            return report
        finally:
            await pool.close()

    async def _check_stream(self, js: JetStreamContext) -> None:
        """Refuse, before any shadow table exists, a stream that cannot rebuild the workspace."""
        subjects = self._names.workspace_delta_subjects(self._workspace)
        state = (await js.stream_info(self._names.delta_stream, subjects_filter=subjects)).state
        if state.first_seq > 1:
            raise RebuildFailed(
                f"the stream {self._names.delta_stream} starts at sequence {state.first_seq}: the deltas before it "
                "were removed, and an index rebuilt without them would lose what they wrote"
            )
        if not state.subjects:
            raise RebuildFailed(f"the stream holds no deltas of workspace {self._workspace!r}")

    async def _refold(self, js: JetStreamContext, shadow: _Shadow, expected: ExpectedIndex, upto: int) -> None:
        """After a resume: fold what the previous run replayed, so the verification covers the whole stream."""
        if upto == 0:
            return
        failed = await shadow.failed_to_apply()
        self._progress.stage("refold", upto)
        done = 0
        async for batch in _read(js, self._names, self._workspace, 1, upto, self._settings.projector_batch_size):
            for msg in batch:
                outcome = self._validate(msg)
                if isinstance(outcome, Delta) and outcome.seq not in failed:
                    expected.add(outcome)
            last = batch[-1].metadata.sequence.stream
            self._progress.advance("refold", last - done)
            done = last
        self._progress.advance("refold", upto - done)

    async def _replay(
        self,
        js: JetStreamContext,
        shadow: _Shadow,
        expected: ExpectedIndex,
        report: RebuildReport,
        start: int,
        upto: int,
        stage: str,
    ) -> None:
        """Apply the workspace's deltas from ``start`` up to stream sequence ``upto`` to the shadow.

        Progress counts stream sequences, the other workspaces' deltas in between included."""
        self._progress.stage(stage, max(upto - start + 1, 0))
        first = start
        async for batch in _read(js, self._names, self._workspace, start, upto, self._settings.projector_batch_size):
            accepted: list[Delta] = []
            rejections: list[tuple[int, Rejection]] = []
            for msg in batch:
                outcome = self._validate(msg)
                if isinstance(outcome, Rejection):
                    rejections.append((msg.metadata.sequence.stream, outcome))
                else:
                    accepted.append(outcome)
            applied = await self._apply(shadow, accepted, rejections)
            for delta in applied:
                report.applied += expected.add(delta)
            if applied:  # as the projector does: else each batch is planned against an empty, growing partition
                await shadow.store.refresh_statistics([self._workspace])
            last = batch[-1].metadata.sequence.stream
            await shadow.record(last, rejections)
            report.replayed += len(batch)
            report.rejected.update(rejection.reason for _, rejection in rejections)
            self._progress.advance(stage, last - start + 1)
            start = last + 1
        self._progress.advance(stage, max(upto - max(start, first) + 1, 0))

    def _validate(self, msg: Msg) -> Delta | Rejection:
        return validate_delta(msg.data, msg.subject, msg.metadata.sequence.stream, self._limits)

    async def _apply(
        self, shadow: _Shadow, deltas: list[Delta], rejections: list[tuple[int, Rejection]]
    ) -> list[Delta]:
        """Apply as the projector does: a batch the database refuses is applied one delta at a time, and a delta
        it still refuses is rejected as the projector would dead-letter it. Returns the deltas that went in."""
        if not deltas:
            return []
        refusal: Exception | None = None
        for attempt in range(1, APPLY_ATTEMPTS + 1):
            try:
                await shadow.store.apply(deltas)
                return deltas
            except Exception as error:
                if not is_transient(error):
                    refusal = error
                    break
                if attempt == APPLY_ATTEMPTS:
                    raise
                log.warning("rebuild_apply_retry", error=f"{type(error).__name__}: {error}", attempt=attempt)
                await asyncio.sleep(backoff_s(attempt, 0.5, 10.0))
        if len(deltas) == 1:
            detail = f"{type(refusal).__name__}: {refusal}"
            rejections.append((deltas[0].seq, Rejection("apply_failed", detail)))
            return []
        applied: list[Delta] = []
        for delta in deltas:
            applied += await self._apply(shadow, [delta], rejections)
        return applied

    async def _swap(
        self, js: JetStreamContext, nc: Client, shadow: _Shadow, expected: ExpectedIndex, report: RebuildReport
    ) -> None:
        conn = await asyncpg.connect(self._database_url)
        try:
            async with conn.transaction():
                await conn.execute(f"SET LOCAL lock_timeout = '{int(self._lock_timeout_s * 1000)}ms'")
                # Live projectors write the versions table first in every batch: they wait here until the swap
                # commits, and then find the new tables. Readers are not held off by this lock.
                await conn.execute("LOCK TABLE public.ontology_versions IN EXCLUSIVE MODE")
                locked = time.perf_counter()
                tail_from = await shadow.replayed_seq() + 1
                last = (await js.stream_info(self._names.delta_stream)).state.last_seq
                await self._replay(js, shadow, expected, report, tail_from, last, "catch up")
                problems = await shadow.verify(expected)
                if problems:
                    raise RebuildFailed("the shadow tables differ from the stream: " + " | ".join(problems))
                revisions = await shadow.swap_into(conn)
                report.swap_lock_s = time.perf_counter() - locked
        finally:
            await conn.close()
        report.swapped = True
        report.rows = len(expected.rows())
        publisher = VersionPublisher(nc, await js.key_value(self._names.version_bucket), self._names)
        for branch, version in expected.versions().items():
            report.versions[branch] = version.label
            await publisher.publish(VersionUpdate(self._workspace, branch, version, revisions[branch]))
        log.info(
            "rebuild_swapped",
            workspace=self._workspace,
            replayed=report.replayed,
            rows=report.rows,
            lock_ms=round(report.swap_lock_s * 1000, 1),
            versions=report.versions,
        )

    async def _shadow_exists(self, conn: asyncpg.Connection) -> bool:
        return bool(await conn.fetchval("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", self._schema))

    def _exclusive(self, conn: asyncpg.Connection) -> _AdvisoryLock:
        return _AdvisoryLock(conn, self._workspace)


class _AdvisoryLock:
    """One rebuild (or discard) of a workspace at a time, held for the whole run by one session."""

    def __init__(self, conn: asyncpg.Connection, workspace: str) -> None:
        self._conn = conn
        self._workspace = workspace

    async def __aenter__(self) -> None:
        taken = await self._conn.fetchval(
            "SELECT pg_try_advisory_lock(hashtext('ontofabric.rebuild'), hashtext($1))", self._workspace
        )
        if not taken:
            raise RebuildFailed(f"another rebuild of workspace {self._workspace!r} is running")

    async def __aexit__(self, *exc: object) -> None:
        await self._conn.execute(
            "SELECT pg_advisory_unlock(hashtext('ontofabric.rebuild'), hashtext($1))", self._workspace
        )


class _Shadow:
    """The shadow schema of one workspace: its projection store, its bookkeeping, its checks and the swap."""

    def __init__(
        self, admin: asyncpg.Connection, pool: asyncpg.Pool, schema: str, workspace: str, text_search_config: str
    ) -> None:
        self._admin = admin
        self._schema = schema
        self._workspace = workspace
        self.store = PostgresProjectionStore(pool, text_search_config)

    def _table(self, name: str) -> str:
        return f'"{self._schema}"."{name}"'

    async def replayed_seq(self) -> int:
        seq = await self._admin.fetchval(f"SELECT replayed_seq FROM {self._table('rebuild_progress')}")
        return int(seq or 0)

    async def failed_to_apply(self) -> set[int]:
        records = await self._admin.fetch(
            f"SELECT seq FROM {self._table('rebuild_rejections')} WHERE reason = 'apply_failed'"
        )
        return {r["seq"] for r in records}

    async def record(self, replayed_seq: int, rejections: list[tuple[int, Rejection]]) -> None:
        async with self._admin.transaction():
            await self._admin.executemany(
                f"INSERT INTO {self._table('rebuild_rejections')} (seq, reason, detail) VALUES ($1, $2, $3)"
                " ON CONFLICT DO NOTHING",
                [(seq, rejection.reason, rejection.detail) for seq, rejection in rejections],
            )
            await self._admin.execute(
                f"INSERT INTO {self._table('rebuild_progress')} (replayed_seq) VALUES ($1)"
                " ON CONFLICT (singleton) DO UPDATE SET replayed_seq = EXCLUDED.replayed_seq",
                replayed_seq,
            )

    async def prepare_for_swap(self) -> None:
        """Outside the swap's lock: planner statistics, and the partition-bound checks ATTACH will trust."""
        literal = await self._admin.fetchval("SELECT quote_literal($1)", self._workspace)
        for partition in _partitioned_tables(self._workspace).values():
            await self._admin.execute(f"ANALYZE {self._table(partition)}")
            await self._admin.execute(
                f"ALTER TABLE {self._table(partition)} DROP CONSTRAINT IF EXISTS {BOUND_CHECK},"
                f" ADD CONSTRAINT {BOUND_CHECK} CHECK (workspace = {literal})"
            )

    async def verify(self, expected: ExpectedIndex) -> list[str]:
        """How the shadow differs from the fold of the stream, and whether its keyword statistics add up."""
        records = await self._admin.fetch(
            f"""
            SELECT branch, 'document' AS kind, id AS key, stream_seq, deleted, transparent,
                   CASE WHEN deleted THEN NULL ELSE md5(content) END AS content_md5
              FROM {self._table("documents")} WHERE workspace = $1
            UNION ALL
            SELECT branch, 'node', object_type, stream_seq, deleted, transparent, NULL
              FROM {self._table("ontology_nodes")} WHERE workspace = $1
            UNION ALL
            SELECT branch, 'link', source_type || '|' || link_name || '|' || target_type, stream_seq, deleted,
                   transparent, NULL
              FROM {self._table("ontology_links")} WHERE workspace = $1
            """,
            self._workspace,
        )
        actual_rows: dict[RowKey, RowFacts] = {
            (r["branch"], r["kind"], r["key"]): RowFacts(
                r["stream_seq"], r["deleted"], r["transparent"], r["content_md5"]
            )
            for r in records
        }
        versions = await self._admin.fetch(
            f"SELECT branch, state_hash, stream_seq FROM {self._table('ontology_versions')} WHERE workspace = $1",
            self._workspace,
        )
        actual_versions = {r["branch"]: VersionState(_to_unsigned(r["state_hash"]), r["stream_seq"]) for r in versions}
        problems = differences(expected.rows(), actual_rows, expected.versions(), actual_versions)
        return problems + await self._keyword_statistics_problems()

    async def _keyword_statistics_problems(self) -> list[str]:
        """BM25 reads postings and per-branch counts: each must agree with the documents they were made from."""
        problems = []
        postings = await self._admin.fetchval(
            f"SELECT count(*) FROM {self._table('postings')} WHERE workspace = $1", self._workspace
        )
        terms = await self._admin.fetchval(
            f"SELECT coalesce(sum(length(search_vector)), 0) FROM {self._table('documents')}"
            " WHERE workspace = $1 AND NOT deleted",
            self._workspace,
        )
        if postings != terms:
            problems.append(f"{postings} postings for {terms} distinct terms of live documents")
        mismatched = await self._admin.fetch(
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

    async def swap_into(self, conn: asyncpg.Connection) -> dict[str, int]:
        """Inside the swap's transaction: the shadow's partitions and rows replace the live ones, and the shadow
        schema is dropped. Returns the new revision of each branch's ontologyVersion."""
        workspace = self._workspace
        literal = await conn.fetchval("SELECT quote_literal($1)", workspace)
        # The lock ensure_workspace_partition takes: a live projector cannot create the partition meanwhile.
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext('ontofabric.partition'), hashtext($1))", workspace)
        live = await conn.fetchval("SELECT partition_name FROM public.workspaces WHERE workspace = $1", workspace)
        for parent, partition in _partitioned_tables(workspace).items():
            if live is not None:
                await conn.execute(f'ALTER TABLE public."{parent}" DETACH PARTITION public."{partition}"')
                await conn.execute(f'DROP TABLE public."{partition}"')
            await conn.execute(f"ALTER TABLE {self._table(parent)} DETACH PARTITION {self._table(partition)}")
            await conn.execute(f"ALTER TABLE {self._table(partition)} SET SCHEMA public")
            # The partition's indexes match the parent's, so ATTACH adopts them rather than building new ones.
            await conn.execute(
                f'ALTER TABLE public."{parent}" ATTACH PARTITION public."{partition}" FOR VALUES IN ({literal})'
            )
            await conn.execute(f'ALTER TABLE public."{partition}" DROP CONSTRAINT {BOUND_CHECK}')
        await conn.execute(
            "INSERT INTO public.workspaces (workspace, partition_name) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            workspace,
            _partitioned_tables(workspace)["documents"],
        )
        for table in ("ontology_nodes", "ontology_links"):
            columns = await self._columns(conn, table)
            await conn.execute(f"DELETE FROM public.{table} WHERE workspace = $1", workspace)
            await conn.execute(
                f"INSERT INTO public.{table} ({columns}) SELECT {columns} FROM {self._table(table)}"
                " WHERE workspace = $1",
                workspace,
            )
        await conn.execute(
            f"INSERT INTO public.handled_events (event_id, stream_seq)"
            f" SELECT event_id, stream_seq FROM {self._table('handled_events')} ON CONFLICT DO NOTHING"
        )
        revisions = await self._swap_versions(conn)
        await conn.execute(f'DROP SCHEMA "{self._schema}" CASCADE')
        return revisions

    async def _swap_versions(self, conn: asyncpg.Connection) -> dict[str, int]:
        """The shadow's versions, each with a revision above the live one: announcements only ever move forward."""
        old = {
            r["branch"]: r["revision"]
            for r in await conn.fetch(
                "DELETE FROM public.ontology_versions WHERE workspace = $1 RETURNING branch, revision", self._workspace
            )
        }
        rows = await conn.fetch(
            f"""
            INSERT INTO public.ontology_versions
                   (workspace, branch, state_hash, stream_seq, revision, doc_count, total_length)
            SELECT s.workspace, s.branch, s.state_hash, s.stream_seq,
                   greatest(coalesce(o.revision, 0), s.revision) + 1, s.doc_count, s.total_length
              FROM {self._table("ontology_versions")} s
              LEFT JOIN unnest($2::text[], $3::bigint[]) AS o(branch, revision) USING (branch)
             WHERE s.workspace = $1
            RETURNING branch, revision
            """,
            self._workspace,
            list(old),
            list(old.values()),
        )
        revisions = {r["branch"]: int(r["revision"]) for r in rows}
        return revisions

    async def _columns(self, conn: asyncpg.Connection, table: str) -> str:
        names = await conn.fetchval(
            "SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum) FROM pg_attribute"
            " WHERE attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped",
            f"public.{table}",
        )
        return str(names)


def _partitioned_tables(workspace: str) -> dict[str, str]:
    """The workspace's partition of each partitioned table, by parent."""
    suffix = _suffix(workspace)
    return {"documents": f"documents_ws_{suffix}", "postings": f"postings_ws_{suffix}"}


async def _read(
    js: JetStreamContext, names: Names, workspace: str, start: int, upto: int, batch_size: int
) -> AsyncIterator[list[Msg]]:
    """The workspace's deltas from stream sequence ``start`` through ``upto``, in batches, through a consumer of
    its own (no acks: progress is kept in the shadow schema)."""
    if start > upto:
        return
    subscription = await js.pull_subscribe(
        names.workspace_delta_subjects(workspace),
        stream=names.delta_stream,
        config=ConsumerConfig(
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start,
            inactive_threshold=300.0,  # the server removes it if this process dies
            mem_storage=True,
        ),
    )
    info = await subscription.consumer_info()
    consumer, pending, finished = info.name, info.num_pending or 0, False
    try:
        while pending > 0 and not finished:
            # One fetch returns what reached the client so far, often a few messages: gather a whole batch, so
            # the shadow is written in transactions as large as the projector's.
            batch: list[Msg] = []
            while len(batch) < batch_size and pending > 0 and not finished:
                try:
                    batch += await subscription.fetch(batch_size - len(batch), timeout=5.0)
                except (NatsTimeoutError, TimeoutError):
                    pending = (await subscription.consumer_info()).num_pending or 0  # what is left, server-side
                    continue
                last = batch[-1].metadata
                pending, finished = last.num_pending or 0, last.sequence.stream >= upto
            within = [msg for msg in batch if msg.metadata.sequence.stream <= upto]
            if within:
                yield within
    finally:
        await subscription.unsubscribe()
        with contextlib.suppress(Exception):  # else the server removes it after inactive_threshold
            await js.delete_consumer(names.delta_stream, consumer)
