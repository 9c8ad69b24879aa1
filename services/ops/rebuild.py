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
import math
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import asyncpg
from nats.aio.client import Client
from nats.js import JetStreamContext

from ontofabric.services.projector.planning import Delta, Limits, VersionState, validate_delta
from ontofabric.services.projector.reembedding import Reembedder
from ontofabric.services.projector.runner import ProjectionRunner, project
from ontofabric.services.projector.snapshots import (
    COMPACTION_LOCK,
    Snapshot,
    compacted_through,
    find_snapshot_store,
    load_snapshot,
    project_snapshot,
)
from ontofabric.services.projector.store import unsigned64
from ontofabric.services.projector.versions import VersionPublisher, announce_records
from ontofabric.shared.db import (
    DeploymentMismatch,
    check_deployment,
    create_pool,
    index_model,
    migrate,
    migrations,
)
from ontofabric.shared.jetstream import close as close_nats
from ontofabric.shared.jetstream import connect, ensure_jetstream, projected_floor
from ontofabric.shared.logging import describe, get_logger
from ontofabric.shared.progress import Progress
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names
from ontofabric.shared.tasks import still_wanted
from ontofabric.shared.telemetry import tracer

from .replay import workspace_deltas
from .shadow import RebuildFailed, Shadow, drop_schema, retired_schema, shadow_schema
from .verification import ExpectedIndex, RowKey, row_key, unexplained_live_rows

__all__ = [
    "COMPACTION_LOCK",
    "Rebuild",
    "RebuildFailed",
    "RebuildReport",
    "pace_delay",
    "paced_batch_size",
    "replay_rate",
    "retired_schema",
    "running_compactions",
    "running_rebuilds",
    "shadow_schema",
]

log = get_logger(__name__)

CATCH_UP_ROUNDS = 5
"""Unlocked passes over what arrived during the replay, so that little is left for the swap's locked catch-up."""


REBUILD_LOCK = "ontofabric.rebuild"
"""The first key of the session advisory lock a rebuild (or discard) of a workspace holds for its whole run."""


async def running_rebuilds(conn: asyncpg.Connection) -> int:
    """How many rebuilds hold their lock on this database now (any session's)."""
    return await _holding(conn, REBUILD_LOCK)


async def running_compactions(conn: asyncpg.Connection) -> int:
    """How many compactions hold their lock on this database now (any session's)."""
    return await _holding(conn, COMPACTION_LOCK)


async def _holding(conn: asyncpg.Connection, first_key: str) -> int:
    """Sessions holding a two-key advisory lock whose first key is ``hashtext(first_key)``."""
    return int(
        await conn.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 AND granted"
            " AND classid::bigint = (hashtext($1)::bigint + 4294967296) % 4294967296",
            first_key,
        )
    )


@dataclass
class RebuildReport:
    workspace: str
    resumed_from: int
    """The last stream sequence a previous run had replayed (0 for a fresh rebuild)."""
    restored: int = 0
    """Deltas replayed from the workspace's snapshot (a compacted stream no longer holds them)."""
    replayed: int = 0
    changed: int = 0
    """Replayed deltas that changed a row (the others were repeats, or older than the row)."""
    rejected: Counter[str] = field(default_factory=Counter)
    dropped: list[str] = field(default_factory=list)
    """The live rows the replay cannot account for, which the swap (forced) drops, described."""
    rows: int = 0
    versions: dict[str, str] = field(default_factory=dict)
    swapped: bool = False
    replay_s: float = 0.0
    swap_lock_s: float = 0.0
    """How long the swap held off the live projectors, from asking for the lock to the commit."""
    parents_lock_s: float = 0.0
    """How long the swap held the live parents' exclusive lock, which queries of every workspace wait for."""


def replay_rate(max_rate: float | None) -> float | None:
    """A ``--max-rate`` as the replay keeps to it: None (or infinity, which the command line takes) for as fast as
    the database takes them; ValueError for one that is not a positive number (NaN included)."""
    if max_rate is None or max_rate == math.inf:
        return None
    if not max_rate > 0:
        raise ValueError("max_rate must be positive (or None: as fast as the database takes them)")
    return max_rate


def paced_batch_size(batch_size: int, max_rate: float | None) -> int:
    """The batches of a replay kept to ``max_rate`` a second: a second's worth at most, so that the database gets
    them spread out. A minute's worth went in at full speed, then the replay slept (an operator tester's: 120 of
    ``--max-rate 2`` in the first 5 s)."""
    return batch_size if max_rate is None else min(batch_size, max(1, int(max_rate)))


def pace_delay(done: int, elapsed_s: float, max_rate: float | None) -> float:
    """How long to wait so that ``done`` items in ``elapsed_s`` seconds keep to ``max_rate`` per second."""
    if max_rate is None:
        return 0.0
    return max(done / max_rate - elapsed_s, 0.0)


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
        max_rate = replay_rate(max_rate)
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
        self._limits = Limits.from_settings(settings)
        self._reembedder = Reembedder(settings) if settings.embedder != "none" else None
        """Embeds again what the stream holds of another model than the index's (after a model change)."""

    async def discard(self) -> bool:
        """Drop an interrupted rebuild's shadow schema. False when there was none."""
        nc = await connect(self._nats_url, "ontofabric-rebuild", self._settings)
        conn = await asyncpg.connect(self._database_url)
        try:
            async with self._exclusive(conn):
                await self._announce(nc, conn)
                existed = await self._shadow_exists(conn)
                await drop_schema(conn, self._schema)
                await drop_schema(conn, retired_schema(self._workspace))
                return existed
        finally:
            await conn.close()
            await close_nats(nc)

    async def run(self) -> RebuildReport:
        with tracer().start_as_current_span("ops.rebuild") as span:
            span.set_attribute("workspace", self._workspace)
            nc = await connect(self._nats_url, "ontofabric-rebuild", self._settings)
            admin = await asyncpg.connect(self._database_url)
            try:
                async with self._exclusive(admin):
                    # Each takes its own lock, then looks for the other's: of two that start together, at least
                    # one sees the other. A compaction running may purge what this replay has yet to read.
                    if await running_compactions(admin):
                        raise RebuildFailed(
                            "a compaction, or a projector filling an index from nothing, is running: rebuild after it"
                            " finishes"
                        )
                    return await self._run(nc, admin)
            finally:
                await admin.close()
                await close_nats(nc)

    async def _run(self, nc: Client, admin: asyncpg.Connection) -> RebuildReport:
        js = nc.jetstream()
        await ensure_jetstream(js, self._names, self._settings)
        await self._check_live_schema(admin)
        await self._follow_model(admin)
        await self._announce(nc, admin)
        # What a run that committed its swap and stopped before dropping the partitions it replaced left behind.
        await drop_schema(admin, retired_schema(self._workspace))
        snapshot, compacted = await self._check_stream(js)
        resumed = await self._shadow_exists(admin)
        await migrate(self._database_url, self._settings, schema=self._schema)
        await Shadow.create_bookkeeping(admin, self._schema)
        pool = await create_pool(self._database_url, self._settings, schema=self._schema)
        try:
            shadow = Shadow(admin, pool, self._schema, self._workspace, self._settings.text_search_config)
            await pool.execute("SELECT ensure_workspace_partition($1)", self._workspace)
            report = RebuildReport(self._workspace, resumed_from=await shadow.replayed_seq() if resumed else 0)
            log.info(
                "rebuild_started", workspace=self._workspace, schema=self._schema, resumed_from=report.resumed_from
            )
            expected = ExpectedIndex(self._workspace)
            started = time.perf_counter()
            start = max(compacted, snapshot.covers if snapshot else 0)  # the stream's part is read after it
            if report.resumed_from and report.resumed_from >= start:
                await self._refold(nc, shadow, expected, snapshot, start, report.resumed_from)
            elif start:  # a fresh run, or one resumed from before a compaction that dropped where it had got to
                await self._restore(nc, shadow, expected, report, snapshot, start)
            # The replay, then what arrived meanwhile. Each pass goes on from where the last one read to, not from
            # the workspace's last delta: with other workspaces' deltas after it, every pass read those again, and
            # all five ran whatever arrived (a tester's: 22,802 sequences counted over a stream of 5,398).
            through = await shadow.replayed_seq()
            for round_ in range(CATCH_UP_ROUNDS):
                last = await self._stream_last(js)
                if round_ > 0 and last - through < self._settings.projector_batch_size:
                    break
                await self._replay(nc, shadow, expected, report, through + 1, last, "replay")
                through = max(through, last)
            report.replay_s = time.perf_counter() - started
            await shadow.prepare_for_swap()
            covered = await shadow.replayed_seq()
            problems = await shadow.verify(expected)
            if problems:
                raise RebuildFailed(
                    "the shadow tables differ from the stream: " + " | ".join(problems), resumable=False
                )
            report.rejected = await shadow.rejections()  # this run's, and those of the run it resumes
            unexplained = unexplained_live_rows(await shadow.live_row_seqs(), expected.rows(), covered)
            report.dropped = unexplained  # what --force swaps away
            if unexplained and not self._force:
                # A row whose delta this replay rejected: a setting other than the projector's, or a check newer
                # than the release that stored it.
                rejected = ", ".join(f"{count} {reason}" for reason, count in sorted(report.rejected.items()))
                raise RebuildFailed(
                    "not swapping, the swap would lose them: " + " | ".join(unexplained) + " (this replay rejected "
                    f"{rejected or 'no delta'}; check the rejected deltas and that this command runs with the "
                    "projector's settings, and after changing them run it with --discard first: the shadow tables "
                    "keep what this replay rejected; --force swaps anyway)",
                    resumable=False,
                )
            still_wanted()  # an interrupt nats-py lost on the way here does not swap
            await self._swap(js, nc, shadow, expected, report)
            return report
        finally:
            await pool.close()

    async def _stream_last(self, js: JetStreamContext) -> int:
        return int((await js.stream_info(self._names.delta_stream)).state.last_seq)

    async def _check_stream(self, js: JetStreamContext) -> tuple[Snapshot | None, int]:
        """Refuse, before any shadow table exists, a stream that cannot rebuild the workspace. Returns the
        workspace's snapshot, if the stream was compacted, and the sequence compaction covered (0: never)."""
        snapshot, compacted = None, 0
        store = await find_snapshot_store(js, self._names)
        if store is not None:
            compacted = await compacted_through(store)
            snapshot = await load_snapshot(store, self._workspace)
        subjects = self._names.workspace_delta_subjects(self._workspace)
        state = (await js.stream_info(self._names.delta_stream, subjects_filter=subjects)).state
        if state.first_seq > compacted + 1:
            covered = f"; snapshots cover only up to {compacted}" if compacted else ""
            raise RebuildFailed(
                f"the stream {self._names.delta_stream} starts at sequence {state.first_seq}: the deltas before it "
                f"were removed{covered}, and an index rebuilt without them would lose what they wrote",
                resumable=False,
            )
        if not state.subjects and snapshot is None:
            raise RebuildFailed(
                f"the stream holds no deltas of workspace {self._workspace!r}", resumable=False, shadow=False
            )
        return snapshot, compacted

    async def _check_live_schema(self, conn: asyncpg.Connection) -> None:
        """The shadow is built by this command's migrations for its model: the live schema must be their twin."""
        if await conn.fetchval("SELECT to_regclass('public.schema_migrations')") is None:
            raise RebuildFailed("the database holds no ontofabric index to rebuild", resumable=False, shadow=False)
        live = await conn.fetchval("SELECT max(version) FROM public.schema_migrations")
        ours = max(m.version for m in migrations())
        if live != ours:
            raise RebuildFailed(
                f"the live schema is at migration {live}, this command's at {ours}: run `ontofabric migrate` or "
                "the same version of ontofabric as the workers",
                resumable=False,
            )

    async def _follow_model(self, conn: asyncpg.Connection) -> None:
        """After a model change, the settings rebuilt with are the next model's: the shadow's vectors are that
        dimension, and the stream's deltas of the model before are embedded again."""
        if await conn.fetchval("SELECT next_embedding_model FROM public.deployment") is not None:
            raise RebuildFailed(
                "an embedding model change is under way (`ontofabric reembed`): rebuild when it has swapped, or "
                "after `ontofabric reembed --discard`",
                resumable=False,  # nothing of this rebuild to resume (an operator tester's)
                shadow=False,
            )
        try:
            held = await check_deployment(conn, self._settings)
        except DeploymentMismatch as error:
            raise RebuildFailed(str(error), resumable=False) from error
        if held.embedding_model != self._settings.embedding_model:
            self._settings = held
            self._limits = Limits.from_settings(held)
        if self._reembedder is not None:
            self._reembedder.follow(await index_model(conn))

    async def _restore(
        self,
        nc: Client,
        shadow: Shadow,
        expected: ExpectedIndex,
        report: RebuildReport,
        snapshot: Snapshot | None,
        covers: int,
    ) -> None:
        """A fresh run on a compacted stream: the snapshot's deltas through the projection runner, as the replay
        puts the stream's, and the events it handled; the replay goes on from ``covers + 1``."""
        self._progress.stage("snapshot", len(snapshot.deltas) if snapshot else 0)
        runner = ProjectionRunner(shadow.sink, self._limits, self._reembedder)
        rejected = []
        if snapshot is not None:
            # Kept to --max-rate as the replay is: after a compaction (daily, as advised) the snapshot holds nearly
            # all of a workspace, and went in at full speed (an operator tester's: 1,226 rows in 2 s at 5 a second).
            batch = paced_batch_size(self._settings.projector_batch_size, self._max_rate)
            began = time.monotonic()
            async for size, projected in project_snapshot(nc, self._names, runner, snapshot, batch):
                for delta in projected.done:
                    report.changed += expected.add(delta)
                rejected += projected.rejected
                report.restored += size
                self._progress.advance("snapshot", size)
                await asyncio.sleep(pace_delay(report.restored, time.monotonic() - began, self._max_rate))
        if snapshot is not None:
            await shadow.add_handled_events(snapshot.handled)
            expected.mark_handled(snapshot.handled.keys())
        await shadow.record(covers, rejected)
        report.rejected.update(rejection.reason for _, rejection in rejected)
        await shadow.sink.settled()

    async def _refold(
        self, nc: Client, shadow: Shadow, expected: ExpectedIndex, snapshot: Snapshot | None, start: int, upto: int
    ) -> None:
        """After a resume: fold what the previous run replayed (the snapshot's deltas, then the stream's after
        ``start``), so the verification covers the whole history."""
        failed = await shadow.rejected()
        self._progress.stage("refold", upto)
        done = 0
        # Read as the projection runner reads them: a document of the model the index held before was embedded
        # again by the previous run (an operator's resume after a model change found its rows "not in the stream").
        reembedder = self._reembedder
        limits = self._limits if reembedder is None else reembedder.limits(self._limits)

        def fold(stored: bytes, subject: str, seq: int, headers: dict[str, str] | None = None) -> None:
            checked = validate_delta(stored, subject, seq, limits, headers)
            if isinstance(checked, Delta) and checked.seq not in failed:
                if reembedder is not None and reembedder.stale(checked):
                    checked = replace(checked, reembedded=reembedder.model)
                expected.add(checked)

        if snapshot is not None:
            for delta in snapshot.deltas:
                fold(delta.data, delta.subject, delta.seq)
            expected.mark_handled(snapshot.handled.keys())
        async with workspace_deltas(
            nc, self._names, self._workspace, start + 1, upto, self._settings.projector_batch_size
        ) as batches:
            async for batch in batches:
                for msg in batch:
                    fold(msg.data, msg.subject, msg.metadata.sequence.stream, msg.headers)
                last = batch[-1].metadata.sequence.stream
                self._progress.advance("refold", last - done)
                done = last
        self._progress.advance("refold", upto - done)

    async def _replay(
        self,
        nc: Client,
        shadow: Shadow,
        expected: ExpectedIndex,
        report: RebuildReport,
        start: int,
        upto: int,
        stage: str,
    ) -> set[RowKey]:
        """Apply the workspace's deltas from ``start`` up to stream sequence ``upto`` to the shadow, through the
        projection runner; returns the rows they wrote. A delta the projector would dead-letter is recorded with
        its reason. Progress counts stream sequences, the other workspaces' deltas in between included.

        Outside the swap the replay keeps to ``max_rate``; the swap's catch-up, which holds the projectors off,
        never waits."""
        self._progress.stage(stage, max(upto - start + 1, 0))
        first, touched = start, set()
        paced = stage != "catch up"
        began, replayed = time.monotonic(), 0
        batch_size = self._settings.projector_batch_size
        if paced:
            batch_size = paced_batch_size(batch_size, self._max_rate)
        runner = ProjectionRunner(shadow.sink, self._limits, self._reembedder)
        async with workspace_deltas(nc, self._names, self._workspace, start, upto, batch_size) as batches:
            async for batch in batches:
                projected = await project(runner, batch)
                for delta in projected.done:
                    report.changed += expected.add(delta)
                    touched.add(row_key(delta))
                last = batch[-1].metadata.sequence.stream
                await shadow.record(last, projected.rejected)
                # Planner statistics, as the projector keeps them: else each batch is planned against an empty,
                # growing partition.
                await shadow.sink.settled()
                report.replayed += len(batch)
                report.rejected.update(rejection.reason for _, rejection in projected.rejected)
                self._progress.advance(stage, last - start + 1)
                start = last + 1
                replayed += len(batch)
                if paced:
                    await asyncio.sleep(pace_delay(replayed, time.monotonic() - began, self._max_rate))
        self._progress.advance(stage, max(upto - max(start, first) + 1, 0))
        return touched

    async def _swap(
        self, js: JetStreamContext, nc: Client, shadow: Shadow, expected: ExpectedIndex, report: RebuildReport
    ) -> None:
        conn = await asyncpg.connect(self._database_url)
        handled_floor = await projected_floor(js, self._names, self._settings.projector_partitions)
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
                    nc, shadow, expected, report, tail_from, await self._stream_last(js), "catch up"
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
            await drop_schema(shadow.admin, retired_schema(self._workspace))
        except Exception as error:
            log.warning("rebuild_retired_not_dropped", schema=retired_schema(self._workspace), error=describe(error))
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
        await announce_records(publisher, [{**r, "workspace": self._workspace} for r in rows])
        return {r["branch"]: VersionState(unsigned64(r["state_hash"]), r["stream_seq"]).label for r in rows}

    async def _shadow_exists(self, conn: asyncpg.Connection) -> bool:
        return bool(await conn.fetchval("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", self._schema))

    @contextlib.asynccontextmanager
    async def _exclusive(self, conn: asyncpg.Connection) -> AsyncIterator[None]:
        """One rebuild (or discard) of a workspace at a time, held for the whole run by one session."""
        lock = f"hashtext('{REBUILD_LOCK}'), hashtext($1)"
        if not await conn.fetchval(f"SELECT pg_try_advisory_lock({lock})", self._workspace):
            # Nothing of this run was made, and there is nothing to resume (a tester read "run again to resume").
            raise RebuildFailed(
                f"another rebuild of workspace {self._workspace!r} is running",
                advice="this one did nothing: wait for that one to end",
            )
        try:
            yield
        finally:
            # The session's end releases it too: a broken connection must not hide the error that broke the run.
            with contextlib.suppress(Exception):
                await conn.execute(f"SELECT pg_advisory_unlock({lock})", self._workspace)
