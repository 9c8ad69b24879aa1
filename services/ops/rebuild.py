"""Rebuild one workspace's Postgres index from the delta stream while the live projector keeps running.

1. **Replay.** A consumer of the workspace's deltas from sequence 1 applies them, through the projector's own
   validation and store, to shadow tables: a schema of their own (``ontofabric_rebuild_<hash>``) built by the same
   migrations, so the projector's SQL runs unchanged against it. A delta the projector would dead-letter is
   recorded in the shadow schema, not published again.
2. **Verify.** The shadow must hold what the stream folds to (:mod:`.verification`): the same rows with the same
   sequences, tombstones and reverts, the same checksums of each document's content, vector and token signs, the
   same ontologyVersions, and keyword statistics that agree with its documents.
   Before the swap it must also account for every live row: a live row the stream does not explain means the
   rebuild read the stream differently from the projector (other limits, another model) or that deltas were
   removed from it, and swapping would lose the row.
3. **Swap.** One transaction holds off the live projectors (they wait on the versions table), lets the shadow
   catch up with the stream's tail, checks what the tail changed, moves the rows and versions over, and only then
   takes the live parents' exclusive lock, for the partition swap itself: briefly, and giving way to queries
   rather than deadlocking with them. The new ontologyVersions are then announced with a higher revision.

The live tables are untouched until that transaction commits, so a rebuild is never half-swapped. An interrupted
rebuild leaves its shadow schema behind: the next run resumes from it, ``--discard`` drops it. Each run first
announces the workspace's current versions, in case the last one committed its swap and stopped before that.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Collection
from dataclasses import dataclass, field

import asyncpg
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from ontofabric.services.ingest.ingester import Progress
from ontofabric.services.projector.planning import Delta, Limits, Rejection, VersionState, validate_delta
from ontofabric.services.projector.store import PostgresProjectionStore, VersionUpdate, unsigned64
from ontofabric.services.projector.worker import VersionPublisher, limits_from
from ontofabric.shared.db import DeploymentMismatch, check_deployment, create_pool, is_transient, migrate, migrations
from ontofabric.shared.jetstream import backoff_s, connect, ensure_jetstream
from ontofabric.shared.logging import get_logger
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names
from ontofabric.shared.telemetry import tracer

from .verification import ExpectedIndex, RowFacts, RowKey, differences, row_key, unexplained_live_rows

log = get_logger(__name__)

BOUND_CHECK = "ontofabric_rebuild_bound"
"""A CHECK constraint equal to the partition bound: ATTACH PARTITION then trusts it instead of scanning the table
while it holds the lock."""
APPLY_ATTEMPTS = 8
"""Tries of a batch the database refuses for a transient reason before the run stops (to be resumed later)."""
CATCH_UP_ROUNDS = 5
"""Unlocked passes over what arrived during the replay, so that little is left for the swap's locked catch-up."""
PARENT_LOCK_TRY_MS = 200
"""One try at the live parents' exclusive lock: below PostgreSQL's deadlock_timeout (1 s), so when a query and the
swap wait on each other, the swap gives way (and tries again) before the query is killed as a deadlock victim."""


class RebuildFailed(Exception):
    """The rebuild stopped before swapping; the live index is as it was."""

    def __init__(self, message: str, *, resumable: bool = True) -> None:
        super().__init__(message)
        self.resumable = resumable
        """Whether running again can succeed as things are (else the shadow differs, or the stream cannot serve)."""


@dataclass
class RebuildReport:
    workspace: str
    resumed_from: int
    """The last stream sequence a previous run had replayed (0 for a fresh rebuild)."""
    replayed: int = 0
    changed: int = 0
    """Replayed deltas that changed a row (the others were repeats, or older than the row)."""
    rejected: Counter[str] = field(default_factory=Counter)
    rows: int = 0
    versions: dict[str, str] = field(default_factory=dict)
    swapped: bool = False
    replay_s: float = 0.0
    swap_lock_s: float = 0.0
    """How long the swap held off the live projectors, from asking for the lock to the commit."""
    parents_lock_s: float = 0.0
    """How long the swap held the live parents' exclusive lock, which queries of every workspace wait for."""


def pace_delay(done: int, elapsed_s: float, max_rate: float | None) -> float:
    """How long to wait so that ``done`` items in ``elapsed_s`` seconds keep to ``max_rate`` per second."""
    if max_rate is None:
        return 0.0
    return max(done / max_rate - elapsed_s, 0.0)


def shadow_schema(workspace: str) -> str:
    digest = hashlib.md5(workspace.encode("utf-8"), usedforsecurity=False).hexdigest()[:20]
    return f"ontofabric_rebuild_{digest}"


def retired_schema(workspace: str) -> str:
    """Where the swap moves the live partitions it replaces, until it drops them after the commit."""
    return f"{shadow_schema(workspace)}_retired"


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
        force: bool = False,
        max_rate: float | None = None,
    ) -> None:
        if lock_timeout_s <= 0:
            raise ValueError("lock_timeout_s must be positive (PostgreSQL reads 0 as: wait forever)")
        if max_rate is not None and max_rate <= 0:
            raise ValueError("max_rate must be positive (or None: as fast as the database takes them)")
        self._settings = settings
        self._names = Names(settings.subject_prefix)
        self._nats_url = nats_url
        self._database_url = database_url
        self._workspace = workspace
        self._schema = shadow_schema(workspace)
        self._progress = progress
        self._lock_timeout_s = lock_timeout_s
        self._force = force
        self._max_rate = max_rate
        self._limits: Limits = limits_from(settings)

    async def discard(self) -> bool:
        """Drop an interrupted rebuild's shadow schema. False when there was none."""
        nc = await connect(self._nats_url, "ontofabric-rebuild")
        conn = await asyncpg.connect(self._database_url)
        try:
            async with self._exclusive(conn):
                await self._announce(nc, conn)
                existed = await self._shadow_exists(conn)
                await _drop_schema(conn, self._schema)
                await _drop_schema(conn, retired_schema(self._workspace))
                return existed
        finally:
            await conn.close()
            await nc.close()

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
        await self._check_live_schema(admin)
        await self._announce(nc, admin)
        # What a run that committed its swap and stopped before dropping the partitions it replaced left behind.
        await _drop_schema(admin, retired_schema(self._workspace))
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
            for round_ in range(CATCH_UP_ROUNDS):  # the replay, then what arrived meanwhile
                replayed, last = await shadow.replayed_seq(), await self._stream_last(js)
                if round_ > 0 and last - replayed < self._settings.projector_batch_size:
                    break
                await self._replay(js, shadow, expected, report, replayed + 1, last, "replay")
            report.replay_s = time.perf_counter() - started
            await shadow.prepare_for_swap()
            covered = await shadow.replayed_seq()
            problems = await shadow.verify(expected)
            if problems:
                raise RebuildFailed(
                    "the shadow tables differ from the stream: " + " | ".join(problems), resumable=False
                )
            unexplained = unexplained_live_rows(await shadow.live_row_seqs(), expected.rows(), covered)
            if unexplained and not self._force:
                raise RebuildFailed(
                    "not swapping, the swap would lose them: " + " | ".join(unexplained) + " (check the rejected "
                    "deltas and that this command runs with the projector's settings; --force swaps anyway)",
                    resumable=False,
                )
            await self._swap(js, nc, shadow, expected, report)
            return report
        finally:
            await pool.close()

    async def _stream_last(self, js: JetStreamContext) -> int:
        return int((await js.stream_info(self._names.delta_stream)).state.last_seq)

    async def _check_stream(self, js: JetStreamContext) -> None:
        """Refuse, before any shadow table exists, a stream that cannot rebuild the workspace."""
        subjects = self._names.workspace_delta_subjects(self._workspace)
        state = (await js.stream_info(self._names.delta_stream, subjects_filter=subjects)).state
        if state.first_seq > 1:
            raise RebuildFailed(
                f"the stream {self._names.delta_stream} starts at sequence {state.first_seq}: the deltas before it "
                "were removed, and an index rebuilt without them would lose what they wrote",
                resumable=False,
            )
        if not state.subjects:
            raise RebuildFailed(f"the stream holds no deltas of workspace {self._workspace!r}", resumable=False)

    async def _check_live_schema(self, conn: asyncpg.Connection) -> None:
        """The shadow is built by this command's migrations for its model: the live schema must be their twin."""
        if await conn.fetchval("SELECT to_regclass('public.schema_migrations')") is None:
            raise RebuildFailed("the database holds no ontofabric index to rebuild", resumable=False)
        live = await conn.fetchval("SELECT max(version) FROM public.schema_migrations")
        ours = max(m.version for m in migrations())
        if live != ours:
            raise RebuildFailed(
                f"the live schema is at migration {live}, this command's at {ours}: run `ontofabric migrate` or "
                "the same version of ontofabric as the workers",
                resumable=False,
            )
        try:
            await check_deployment(conn, self._settings)
        except DeploymentMismatch as error:
            raise RebuildFailed(str(error), resumable=False) from error

    async def _refold(self, js: JetStreamContext, shadow: _Shadow, expected: ExpectedIndex, upto: int) -> None:
        """After a resume: fold what the previous run replayed, so the verification covers the whole stream."""
        if upto == 0:
            return
        failed = await shadow.failed_to_apply()
        self._progress.stage("refold", upto)
        done = 0
        batches = _read(js, self._names, self._workspace, 1, upto, self._settings.projector_batch_size)
        async with contextlib.aclosing(batches):
            async for batch in batches:
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
    ) -> set[RowKey]:
        """Apply the workspace's deltas from ``start`` up to stream sequence ``upto`` to the shadow; returns the
        rows they wrote. Progress counts stream sequences, the other workspaces' deltas in between included.

        Outside the swap the replay keeps to ``max_rate``; the swap's catch-up, which holds the projectors off,
        never waits."""
        self._progress.stage(stage, max(upto - start + 1, 0))
        first, touched = start, set()
        paced = stage != "catch up"
        began, replayed = time.monotonic(), 0
        batch_size = self._settings.projector_batch_size
        if paced and self._max_rate is not None:  # a minute's worth at most: the consumer must not sit idle long
            batch_size = min(batch_size, max(1, int(self._max_rate * 60)))
        batches = _read(js, self._names, self._workspace, start, upto, batch_size)
        async with contextlib.aclosing(batches):
            async for batch in batches:
                outcomes = [(msg.metadata.sequence.stream, self._validate(msg)) for msg in batch]
                rejections = [(seq, o) for seq, o in outcomes if isinstance(o, Rejection)]
                applied, refused = await self._apply(shadow, [o for _, o in outcomes if isinstance(o, Delta)])
                rejections += refused
                for delta in applied:
                    report.changed += expected.add(delta)
                    touched.add(row_key(delta))
                if applied:  # as the projector does: else each batch is planned against an empty, growing partition
                    await shadow.store.refresh_statistics([self._workspace])
                last = batch[-1].metadata.sequence.stream
                await shadow.record(last, rejections)
                report.replayed += len(batch)
                report.rejected.update(rejection.reason for _, rejection in rejections)
                self._progress.advance(stage, last - start + 1)
                start = last + 1
                replayed += len(batch)
                if paced:
                    await asyncio.sleep(pace_delay(replayed, time.monotonic() - began, self._max_rate))
        self._progress.advance(stage, max(upto - max(start, first) + 1, 0))
        return touched

    def _validate(self, msg: Msg) -> Delta | Rejection:
        return validate_delta(msg.data, msg.subject, msg.metadata.sequence.stream, self._limits)

    async def _apply(self, shadow: _Shadow, deltas: list[Delta]) -> tuple[list[Delta], list[tuple[int, Rejection]]]:
        """Apply as the projector does: a batch the database refuses is applied one delta at a time, and a delta
        it still refuses is rejected as the projector would dead-letter it. Returns what went in, what did not."""
        if not deltas:
            return [], []
        for attempt in range(1, APPLY_ATTEMPTS + 1):
            try:
                await shadow.store.apply(deltas)
                return deltas, []
            except Exception as error:
                if not is_transient(error):
                    if len(deltas) == 1:
                        return [], [(deltas[0].seq, Rejection("apply_failed", f"{type(error).__name__}: {error}"))]
                    break
                if attempt == APPLY_ATTEMPTS:
                    raise
                log.warning("rebuild_apply_retry", error=f"{type(error).__name__}: {error}", attempt=attempt)
                await asyncio.sleep(backoff_s(attempt, 0.5, 10.0))
        applied: list[Delta] = []
        refused: list[tuple[int, Rejection]] = []
        for delta in deltas:
            went_in, not_in = await self._apply(shadow, [delta])
            applied += went_in
            refused += not_in
        return applied, refused

    async def _swap(
        self, js: JetStreamContext, nc: Client, shadow: _Shadow, expected: ExpectedIndex, report: RebuildReport
    ) -> None:
        conn = await asyncpg.connect(self._database_url)
        handled_floor = await self._projector_ack_floor(js)
        try:
            async with conn.transaction():
                await conn.execute(f"SET LOCAL lock_timeout = '{int(self._lock_timeout_s * 1000)}ms'")
                # Before holding anyone off: the events the live projector has handled are in the live table
                # already (this restores any lost), so no live writer waits on these rows.
                await shadow.copy_handled_events(conn, after=0, upto=handled_floor)
                asked = time.perf_counter()
                # Live projectors write the versions table first in every batch: they wait here until the swap
                # commits, and then find the new tables. Readers are not held off by this lock.
                await conn.execute("LOCK TABLE public.ontology_versions IN EXCLUSIVE MODE")
                await shadow.check_same_migrations(conn)
                tail_from = await shadow.replayed_seq() + 1
                tail = await self._replay(
                    js, shadow, expected, report, tail_from, await self._stream_last(js), "catch up"
                )
                problems = await shadow.verify(expected, only=tail)
                if problems:
                    raise RebuildFailed(
                        "the shadow's catch-up differs from the stream: " + " | ".join(problems), resumable=False
                    )
                # What the live projector wrote since the check before the lock must be accounted for too.
                since = await shadow.live_row_seqs(after=tail_from - 1)
                unexplained = unexplained_live_rows(since, expected.rows(since), covered_seq=2**63 - 1)
                if unexplained and not self._force:
                    raise RebuildFailed(
                        "not swapping, the swap would lose them: " + " | ".join(unexplained), resumable=False
                    )
                await shadow.copy_handled_events(conn, after=min(handled_floor, tail_from - 1), upto=None)
                parents_locked = await shadow.swap_into(conn, self._lock_timeout_s)
            report.swap_lock_s = time.perf_counter() - asked
            report.parents_lock_s = time.perf_counter() - parents_locked
        except (asyncpg.LockNotAvailableError, asyncpg.DeadlockDetectedError) as error:
            raise RebuildFailed(
                f"the swap could not take its locks within {self._lock_timeout_s:g} s ({type(error).__name__}); "
                "run again when the database is less busy, or with a longer --lock-timeout"
            ) from error
        finally:
            await conn.close()
        report.swapped = True
        report.rows = len(expected)
        report.versions = await self._announce(nc, shadow.admin)
        try:  # the replaced partitions, after the commit (unlinking files takes time); else the next run drops them
            await _drop_schema(shadow.admin, retired_schema(self._workspace))
        except Exception as error:
            log.warning("rebuild_retired_not_dropped", schema=retired_schema(self._workspace), error=str(error))
        log.info(
            "rebuild_swapped",
            workspace=self._workspace,
            replayed=report.replayed,
            rows=report.rows,
            lock_ms=round(report.swap_lock_s * 1000, 1),
            parents_lock_ms=round(report.parents_lock_s * 1000, 1),
            versions=report.versions,
        )

    async def _announce(self, nc: Client, conn: asyncpg.Connection) -> dict[str, str]:
        """Announce the workspace's live versions; the KV keeps a newer one it already has. Returns them by branch.

        After a swap this is what tells query workers; before a run it repairs a swap whose run stopped before."""
        if await conn.fetchval("SELECT to_regclass('public.ontology_versions')") is None:
            return {}
        rows = await conn.fetch(
            "SELECT branch, state_hash, stream_seq, revision FROM public.ontology_versions WHERE workspace = $1",
            self._workspace,
        )
        publisher = VersionPublisher(nc, await nc.jetstream().key_value(self._names.version_bucket), self._names)
        versions = {}
        for r in rows:
            version = VersionState(unsigned64(r["state_hash"]), r["stream_seq"])
            await publisher.publish(VersionUpdate(self._workspace, r["branch"], version, r["revision"]))
            versions[r["branch"]] = version.label
        return versions

    async def _projector_ack_floor(self, js: JetStreamContext) -> int:
        """The stream sequence up to which the live projector has handled every delta (0 if it never ran)."""
        try:
            info = await js.consumer_info(self._names.delta_stream, self._names.postgres_projector_durable)
        except NotFoundError:
            return 0
        return int(info.ack_floor.stream_seq or 0) if info.ack_floor is not None else 0

    async def _shadow_exists(self, conn: asyncpg.Connection) -> bool:
        return bool(await conn.fetchval("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", self._schema))

    @contextlib.asynccontextmanager
    async def _exclusive(self, conn: asyncpg.Connection) -> AsyncIterator[None]:
        """One rebuild (or discard) of a workspace at a time, held for the whole run by one session."""
        lock = "hashtext('ontofabric.rebuild'), hashtext($1)"
        if not await conn.fetchval(f"SELECT pg_try_advisory_lock({lock})", self._workspace):
            raise RebuildFailed(f"another rebuild of workspace {self._workspace!r} is running")
        try:
            yield
        finally:
            # The session's end releases it too: a broken connection must not hide the error that broke the run.
            with contextlib.suppress(Exception):
                await conn.execute(f"SELECT pg_advisory_unlock({lock})", self._workspace)


async def _drop_schema(conn: asyncpg.Connection, schema: str) -> None:
    await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


_ROWS = """
SELECT branch, 'document' AS kind, id AS key, stream_seq, deleted, transparent,
       CASE WHEN deleted THEN NULL ELSE md5(convert_to(content, 'UTF8')) END AS content_md5,
       CASE WHEN deleted THEN NULL ELSE md5(vector_send(embedding)) END AS vector_md5,
       CASE WHEN deleted THEN NULL ELSE md5(token_signs) END AS signs_md5
  FROM {schema}.documents WHERE workspace = $1 {documents}
UNION ALL
SELECT branch, 'node', object_type, stream_seq, deleted, transparent, NULL, NULL, NULL
  FROM {schema}.ontology_nodes WHERE workspace = $1 {nodes}
UNION ALL
SELECT branch, 'link', source_type || '|' || link_name || '|' || target_type, stream_seq, deleted, transparent,
       NULL, NULL, NULL
  FROM {schema}.ontology_links WHERE workspace = $1 {links}
"""
# Restricting each part to given (branch, key) pairs: $2 the branches, $3 the keys (a link's as one string).
_ONLY = {
    "documents": "AND (branch, id) IN (SELECT * FROM unnest($2::text[], $3::text[]))",
    "nodes": "AND (branch, object_type) IN (SELECT * FROM unnest($2::text[], $3::text[]))",
    "links": "AND (branch, source_type || '|' || link_name || '|' || target_type)"
    " IN (SELECT * FROM unnest($2::text[], $3::text[]))",
}


class _Shadow:
    """The shadow schema of one workspace: its projection store, its bookkeeping, its checks and the swap."""

    def __init__(
        self, admin: asyncpg.Connection, pool: asyncpg.Pool, schema: str, workspace: str, text_search_config: str
    ) -> None:
        self.admin = admin
        self._schema = schema
        self._workspace = workspace
        self.store = PostgresProjectionStore(pool, text_search_config)

    def _table(self, name: str) -> str:
        return f'"{self._schema}"."{name}"'

    @property
    def _retired(self) -> str:
        return retired_schema(self._workspace)

    async def copy_handled_events(self, conn: asyncpg.Connection, after: int, upto: int | None) -> None:
        """Into the live table, the shadow's handled events of stream sequences in (after, upto]."""
        await conn.execute(
            "INSERT INTO public.handled_events (event_id, stream_seq)"
            f" SELECT event_id, stream_seq FROM {self._table('handled_events')}"
            " WHERE stream_seq > $1 AND ($2::bigint IS NULL OR stream_seq <= $2) ON CONFLICT DO NOTHING",
            after,
            upto,
        )

    async def replayed_seq(self) -> int:
        seq = await self.admin.fetchval(f"SELECT replayed_seq FROM {self._table('rebuild_progress')}")
        return int(seq or 0)

    async def failed_to_apply(self) -> set[int]:
        records = await self.admin.fetch(
            f"SELECT seq FROM {self._table('rebuild_rejections')} WHERE reason = 'apply_failed'"
        )
        return {r["seq"] for r in records}

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
        parts = {"documents": "", "nodes": "", "links": ""}
        args: list[object] = [self._workspace]
        if only is not None:
            parts = _ONLY
            args += [[branch for branch, _, _ in only], [key for _, _, key in only]]
        records = await self.admin.fetch(_ROWS.format(schema=f'"{self._schema}"', **parts), *args)
        rows = {
            (r["branch"], r["kind"], r["key"]): RowFacts(
                r["stream_seq"], r["deleted"], r["transparent"], r["content_md5"], r["vector_md5"], r["signs_md5"]
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
            " UNION ALL SELECT branch, 'link', source_type || '|' || link_name || '|' || target_type, stream_seq"
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
        """BM25 reads postings and per-branch counts: each must agree with the documents they were made from."""
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
        await _lock_exclusively(conn, parents + live, lock_timeout_s)
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
        await _drop_schema(conn, self._schema)
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


async def _lock_exclusively(conn: asyncpg.Connection, tables: list[str], budget_s: float) -> None:
    """ACCESS EXCLUSIVE on the live parents (ONLY: not every workspace's partitions) and the workspace's own
    partitions, in short tries: a query holding one parent and waiting for the other would otherwise deadlock with
    the swap, and every query would queue behind a long wait. Inside the swap's transaction, whose lock timeout it
    leaves as it found it; each failed try is rolled back to, and released from, one savepoint."""
    budget = await conn.fetchval("SHOW lock_timeout")
    deadline = time.monotonic() + budget_s
    await conn.execute(f"SET LOCAL lock_timeout = '{PARENT_LOCK_TRY_MS}ms'")
    try:
        for attempt in range(1, 1_000_000):
            await conn.execute("SAVEPOINT exclusive_try")
            try:
                await conn.execute(f"LOCK TABLE {', '.join(tables)} IN ACCESS EXCLUSIVE MODE")
            except asyncpg.LockNotAvailableError:
                await conn.execute("ROLLBACK TO SAVEPOINT exclusive_try")
                await conn.execute("RELEASE SAVEPOINT exclusive_try")
                if time.monotonic() + PARENT_LOCK_TRY_MS / 1000 > deadline:
                    raise
                await asyncio.sleep(backoff_s(attempt, 0.05, 1.0))
                continue
            await conn.execute("RELEASE SAVEPOINT exclusive_try")
            return
    finally:
        await conn.execute(f"SET LOCAL lock_timeout = '{budget}'")


async def _read(
    js: JetStreamContext, names: Names, workspace: str, start: int, upto: int, batch_size: int
) -> AsyncGenerator[list[Msg], None]:
    """The workspace's deltas from stream sequence ``start`` through ``upto``, in batches, through a consumer of
    its own (no acks: progress is kept in the shadow schema). Close it (``contextlib.aclosing``) to remove the
    consumer when the caller stops early."""
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
    consumer, pending, received, finished = info.name, info.num_pending or 0, 0, False
    try:
        while pending > 0 and not finished:
            # One fetch returns what reached the client so far, often a few messages: gather a whole batch, so
            # the shadow is written in transactions as large as the projector's.
            batch: list[Msg] = []
            while len(batch) < batch_size and pending > 0 and not finished:
                try:
                    batch += await subscription.fetch(batch_size - len(batch), timeout=5.0)
                except (NatsTimeoutError, TimeoutError):
                    # What is left: not yet delivered, or delivered and still on its way to us.
                    info = await subscription.consumer_info()
                    delivered = info.delivered.consumer_seq if info.delivered is not None else 0
                    pending = (info.num_pending or 0) + (delivered or 0) - received - len(batch)
                    continue
                last = batch[-1].metadata
                if last.sequence.consumer != received + len(batch):
                    raise RebuildFailed(
                        f"the read of the stream skipped messages before sequence {last.sequence.stream}"
                    )
                pending, finished = last.num_pending or 0, last.sequence.stream >= upto
            received += len(batch)
            within = [msg for msg in batch if msg.metadata.sequence.stream <= upto]
            if within:
                yield within
    finally:
        with contextlib.suppress(Exception):
            await subscription.unsubscribe()
        with contextlib.suppress(Exception):  # else the server removes it after inactive_threshold
            await js.delete_consumer(names.delta_stream, consumer)
