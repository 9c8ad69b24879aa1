"""Postgres adapter of the projector: one transaction per batch, rows written exactly as the plan says."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

import asyncpg
import numpy as np

from ontofabric.contracts import (
    DocumentDeleted,
    EntityKind,
    LinkAdded,
    LinkRemoved,
    LinkReverted,
    NodeUpserted,
    split_link_key,
)
from ontofabric.contracts.deltas import LINK_KEY_SEPARATOR
from ontofabric.shared.db import STALL_MARGIN_S, Connection, index_model
from ontofabric.shared.logging import get_logger
from ontofabric.shared.placement import Placement

from .following import Followed, delta_mark
from .planning import (
    ANALYSIS_VERSION,
    Delta,
    EntityRef,
    Handled,
    HandledEvent,
    Plan,
    RowState,
    VersionState,
    embedded_by_another,
    entity_of,
    handled_event,
    own_name_repeats,
    plan_batch,
    search_text,
    state_after,
    upserted_document,
)
from .reembedding import ModelChanged
from .snapshots import COMPACTION_LOCK, take_compaction_lock

log = get_logger(__name__)

_SIGNED = 1 << 63


def signed64(value: int) -> int:
    """An unsigned 64-bit state hash as PostgreSQL's bigint stores it."""
    return value - (1 << 64) if value >= _SIGNED else value


def unsigned64(value: int) -> int:
    """A state hash read back from a bigint."""
    return value + (1 << 64) if value < 0 else value


@dataclass(frozen=True)
class VersionUpdate:
    workspace: str
    branch: str
    version: VersionState
    revision: int
    """Commits that changed this version so far: a later announcement always has a higher revision."""


@dataclass(frozen=True)
class BatchResult:
    plan: Plan
    versions: list[VersionUpdate]
    """Current version of every (workspace, branch) the batch touched, changed or not."""


UPSERT_DOCUMENT = f"""
INSERT INTO documents AS d (
    workspace, branch, id, deleted, content, object_type, source_domain, symbol_key, symbol_kind, symbol_fqn,
    content_hash, file_path, chunk_level, provenance, metadata, embedding, embedding_model, search_vector,
    doc_length, indexed_at, stream_seq, event_id, transparent, token_signs, second_vector, second_model, updated_at,
    analysis_version)
SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15::jsonb, $16, $17,
       v.name_repeats || v.tsv, (SELECT coalesce(sum(coalesce(cardinality(u.positions), 1)), 0) FROM unnest(v.tsv) u),
       $20, $21, $22, $23, $24, $25, $26, now(), {ANALYSIS_VERSION}
-- The own name's repeats ($27, planning.own_name_repeats) join the term frequencies but not the length.
FROM (SELECT index_tsvector($18::regconfig, $19) AS tsv, index_tsvector($18::regconfig, $27) AS name_repeats) v
ON CONFLICT (workspace, branch, id) DO UPDATE SET
    deleted = EXCLUDED.deleted, content = EXCLUDED.content, object_type = EXCLUDED.object_type,
    source_domain = EXCLUDED.source_domain, symbol_key = EXCLUDED.symbol_key, symbol_kind = EXCLUDED.symbol_kind,
    symbol_fqn = EXCLUDED.symbol_fqn, content_hash = EXCLUDED.content_hash, file_path = EXCLUDED.file_path,
    chunk_level = EXCLUDED.chunk_level, provenance = EXCLUDED.provenance, metadata = EXCLUDED.metadata,
    embedding = EXCLUDED.embedding, embedding_model = EXCLUDED.embedding_model,
    search_vector = EXCLUDED.search_vector, doc_length = EXCLUDED.doc_length, indexed_at = EXCLUDED.indexed_at,
    stream_seq = EXCLUDED.stream_seq,
    event_id = EXCLUDED.event_id, transparent = EXCLUDED.transparent, token_signs = EXCLUDED.token_signs,
    second_vector = EXCLUDED.second_vector, second_model = EXCLUDED.second_model, updated_at = now(),
    analysis_version = EXCLUDED.analysis_version
WHERE d.stream_seq < EXCLUDED.stream_seq
"""

# Each statement over the workspace-partitioned tables (documents, postings, term_statistics) also says which
# workspaces it reads, `workspace = ANY($1)`: the keys come from arrays joined in, which the planner cannot prune
# partitions by, and without it every statement was planned over, and locked, every workspace's partitions and
# indexes (an outside tester's: 22,000 locks a batch and 0.8 s of planning at 1,400 workspaces, then "out of
# shared memory"). Planned with the values (plan_cache_mode, shared/db.py), it reads the batch's alone.

# The keyword statistics of documents: live count and summed length per (workspace, branch).
_LIVE_LENGTHS = """
SELECT d.workspace, d.branch, count(*) AS docs, coalesce(sum(d.doc_length), 0) AS length
FROM unnest($1::text[], $2::text[], $3::text[]) AS k(workspace, branch, id)
JOIN documents d USING (workspace, branch, id)
WHERE NOT d.deleted AND d.workspace = ANY($1::text[])
GROUP BY d.workspace, d.branch
"""

# Postings follow their document: the old ones (found through the terms of the stored tsvector, before the
# document is overwritten) are dropped, the new ones built from the new tsvector (none for a tombstone). Each
# statement moves the terms' document frequencies (term_statistics, infra/migrations/0016) by what it wrote.
_DROP_POSTINGS = """
WITH dropped AS (
    DELETE FROM postings p
    USING (
        SELECT d.workspace, d.branch, d.id, u.lexeme
        FROM unnest($1::text[], $2::text[], $3::text[]) AS k(workspace, branch, id)
        JOIN documents d USING (workspace, branch, id)
        CROSS JOIN LATERAL unnest(d.search_vector) u
        WHERE d.workspace = ANY($1::text[])
    ) AS old
    WHERE p.workspace = old.workspace AND p.branch = old.branch AND p.term = old.lexeme AND p.doc_id = old.id
      AND p.workspace = ANY($1::text[])
    RETURNING p.workspace, p.branch, p.term),
counted AS (SELECT workspace, branch, term, count(*) AS documents FROM dropped GROUP BY workspace, branch, term),
-- A term no document holds any more loses its row: churn through new words must not grow the table for good.
gone AS (
    DELETE FROM term_statistics s USING counted c
    WHERE s.workspace = c.workspace AND s.branch = c.branch AND s.term = c.term AND s.df <= c.documents
      AND s.workspace = ANY($1::text[]))
UPDATE term_statistics s SET df = s.df - c.documents
FROM counted c
WHERE s.workspace = c.workspace AND s.branch = c.branch AND s.term = c.term AND s.df > c.documents
  AND s.workspace = ANY($1::text[])
"""
_ADD_POSTINGS = """
WITH added AS (
    INSERT INTO postings (workspace, branch, term, doc_id, tf, doc_length)
    SELECT d.workspace, d.branch, u.lexeme, d.id, coalesce(cardinality(u.positions), 1), d.doc_length
    FROM unnest($1::text[], $2::text[], $3::text[]) AS k(workspace, branch, id)
    JOIN documents d USING (workspace, branch, id)
    CROSS JOIN LATERAL unnest(d.search_vector) u
    WHERE NOT d.deleted AND d.workspace = ANY($1::text[])
    RETURNING workspace, branch, term)
INSERT INTO term_statistics AS s (workspace, branch, term, df)
SELECT workspace, branch, term, count(*) FROM added GROUP BY workspace, branch, term
ON CONFLICT (workspace, branch, term) DO UPDATE SET df = s.df + EXCLUDED.df
"""

_UPSERT_NODE = """
INSERT INTO ontology_nodes AS n (
    workspace, branch, object_type, deleted, domain, name, kind, interfaces, description, stream_seq, event_id,
    transparent)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
ON CONFLICT (workspace, branch, object_type) DO UPDATE SET
    deleted = EXCLUDED.deleted, domain = EXCLUDED.domain, name = EXCLUDED.name, kind = EXCLUDED.kind,
    interfaces = EXCLUDED.interfaces, description = EXCLUDED.description, stream_seq = EXCLUDED.stream_seq,
    event_id = EXCLUDED.event_id, transparent = EXCLUDED.transparent, updated_at = now()
WHERE n.stream_seq < EXCLUDED.stream_seq
"""

_UPSERT_LINK = """
INSERT INTO ontology_links AS l (
    workspace, branch, source_type, link_name, target_type, deleted, stream_seq, event_id, transparent)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
ON CONFLICT (workspace, branch, source_type, link_name, target_type) DO UPDATE SET
    deleted = EXCLUDED.deleted, stream_seq = EXCLUDED.stream_seq, event_id = EXCLUDED.event_id,
    transparent = EXCLUDED.transparent, updated_at = now()
WHERE l.stream_seq < EXCLUDED.stream_seq
"""


def link_key_sql(alias: str = "") -> str:
    """A link row's key (contracts ``link_key``) as an SQL expression over its columns."""
    separator = f"'{LINK_KEY_SEPARATOR}'"
    return f"{alias}source_type || {separator} || {alias}link_name || {separator} || {alias}target_type"


# Current sequence of the rows a batch touches, one query per entity kind, each a primary-key join.
_CURRENT_DOCUMENTS = """
SELECT d.workspace, d.branch, d.id AS key, d.stream_seq, d.deleted, d.transparent
FROM unnest($1::text[], $2::text[], $3::text[]) AS k(workspace, branch, id)
JOIN documents d USING (workspace, branch, id)
WHERE d.workspace = ANY($1::text[])
"""
_CURRENT_NODES = """
SELECT n.workspace, n.branch, n.object_type AS key, n.stream_seq, n.deleted, n.transparent
FROM unnest($1::text[], $2::text[], $3::text[]) AS k(workspace, branch, object_type)
JOIN ontology_nodes n USING (workspace, branch, object_type)
"""
_CURRENT_LINKS = f"""
SELECT l.workspace, l.branch, {link_key_sql("l.")} AS key, l.stream_seq, l.deleted, l.transparent
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[])
     AS k(workspace, branch, source_type, link_name, target_type)
JOIN ontology_links l USING (workspace, branch, source_type, link_name, target_type)
"""


# A partition is analysed once more rows changed than 50 + 10 % of its rows: autovacuum's default rule.
ANALYZE_THRESHOLD_ROWS = 50
ANALYZE_SCALE = 0.1
# ANALYZE samples a bounded number of rows whatever the partition's size; this only stops a stuck one.
ANALYZE_TIMEOUT_S = 120


class Fenced(Exception):
    """Another process claimed the consumer after this one: the batch was not written (it goes back to the
    consumer), and this process is to leave the consumer to the other."""


CLAIM_LOCK_TIMEOUT = "1s"
"""How long a claim waits for a batch transaction holding the fence row (one frozen inside it holds the row until it
wakes or the server ends it): the next look tries again."""
RENEW_LOCK_TIMEOUT = "100ms"
"""How long a look's renewal waits for a batch of its own process: that batch renews the claim as it commits."""

# A claim is its epoch and its holder: epochs come from the database's sequence, which starts again on a database
# replaced by an empty one, where a process frozen across the change could otherwise pass for a new claim's holder.
# A batch's renewal counts its commit, on a row that holds every commit this claim made (infra/migrations/0027),
# and says the position its process last read (a look's own renewal waits only briefly for a batch's lock: under
# steady load it seldom gets it).
# A count ahead of this claim's is a commit whose answer was lost (the connection cut at COMMIT): adopted.
# It marks the batch's last delta too (following.py), unless one further on was marked before (a redelivery).
_RENEW_CLAIM_IN_BATCH = (
    "UPDATE projection_fences SET renewed_at = now(), commits = commits + 1, position = greatest(position, $5),"
    " advanced_at = CASE WHEN $5::bigint > coalesce(position, 0) THEN now() ELSE advanced_at END,"
    " mark_seq = CASE WHEN $6::bigint > coalesce(mark_seq, 0) THEN $6 ELSE mark_seq END,"
    " mark = CASE WHEN $6::bigint > coalesce(mark_seq, 0) THEN $7 ELSE mark END"
    " WHERE durable = $1 AND epoch = $2 AND holder = $3 AND commits >= $4 RETURNING commits"
)
# A look's: the position too. A batch committing meanwhile may have counted one more; a database gone back has fewer.
_RENEW_CLAIM_AT_A_LOOK = (
    "UPDATE projection_fences SET renewed_at = now(), position = greatest(position, $5),"
    " advanced_at = CASE WHEN $5::bigint > coalesce(position, 0) THEN now() ELSE advanced_at END"
    " WHERE durable = $1 AND epoch = $2 AND holder = $3 AND commits >= $4"
    " RETURNING position, stream_created, mark_seq, mark, refused"
)

Claim = Literal["claimed", "held", "busy"]
"""What a claim came to: the consumer is this process's now; another process holds a live claim on it; a batch of
the process it replaces is still being written."""


class PostgresProjectionStore:
    """Writes batches of deltas into one database. With ``fence`` (a durable consumer's name), only while this
    store's claim on that consumer is the latest (:meth:`claim`, infra/migrations/0023)."""

    def __init__(self, pool: asyncpg.Pool, text_search_config: str, fence: str | None = None) -> None:
        self._pool = pool
        self._text_search_config = text_search_config
        self._known_workspaces: set[str] = set()
        self._fence = fence
        self._epoch: int | None = None
        """The epoch of this store's claim on ``fence``; None before a claim, or once another claimed it."""
        self._holder = ""
        """The process that made this store's claim (its discovery id)."""
        self._fill = "done"
        """What its row says of filling the index from nothing (infra/migrations/0026), as of its last claim."""
        self._commits = 0
        """The batches committed under the consumer's row, as this claim counts them (infra/migrations/0027)."""
        self.position: int | None = None
        """Where its row says the index stands on the consumer's stream, as of its last claim or renewal (None: not
        known)."""
        self.followed = Followed()
        """What its row says of the stream the index follows (following.py), as of its last claim or renewal."""
        self.refused: str | None = None
        """Why its row says the stream is refused (following.py), as of its last claim or renewal: it stands until
        an operator adopts the stream."""
        self.read_before = 0
        """The highest floor the consumer had reached before it was last made to read again behind it."""
        self.went_back = False
        """Whether a batch or a look found the row behind this claim's commits: the database went back in time
        (until the consumer is claimed again and its reading again is logged)."""
        self.in_step = False
        """Whether the consumer reads from this index's position, as checked after this claim (worker.py): only
        then is its ack floor the index's position. Before (a check that failed half-way), it may be past what
        the database holds."""
        self._floor: int | None = None
        """The consumer's ack floor as last read for a renewal, written by the batches too."""

    @property
    def fenced(self) -> bool:
        """Whether this store may not write: it fences and has no current claim."""
        return self._fence is not None and self._epoch is None

    async def claim(self, holder: str, lease_s: float, live: Collection[str] | None) -> Claim:
        """Claim the consumer for ``holder`` unless another process holds a live claim on it: from then on every
        earlier claim's batches are refused. A claim is live while it is not released, was renewed within
        ``lease_s`` (by the database's clock), and its process is among ``live`` (those discovery shows; None when
        discovery cannot be asked)."""
        assert self._fence is not None
        try:
            async with self._pool.acquire() as conn, conn.transaction():
                await conn.execute(f"SET LOCAL lock_timeout = '{CLAIM_LOCK_TIMEOUT}'")
                current = await conn.fetchrow(
                    "SELECT holder, released, renewed_at >= now() - make_interval(secs => $2::float8) AS renewed"
                    " FROM projection_fences WHERE durable = $1 FOR UPDATE",
                    self._fence,
                    lease_s,
                )
                if current is not None and _held_by_another(current, holder, live):
                    return "held"
                claimed = await conn.fetchrow(
                    "INSERT INTO projection_fences AS f (durable, epoch, holder, fill)"
                    " VALUES ($1, nextval('projection_fence_epochs'), $2, 'unknown')"
                    " ON CONFLICT (durable) DO UPDATE SET epoch = EXCLUDED.epoch, holder = EXCLUDED.holder,"
                    " claimed_at = now(), renewed_at = now(), released = false"
                    " RETURNING epoch, fill, commits, position, read_before, stream_created, mark_seq, mark, refused",
                    self._fence,
                    holder,
                )
                assert claimed is not None  # an upsert returns its row
                self._epoch, self._holder, self._fill = claimed["epoch"], holder, claimed["fill"]
                self._commits, self.position, self.read_before = (
                    claimed["commits"], claimed["position"], claimed["read_before"]
                )  # fmt: skip
                self.followed = Followed(claimed["stream_created"], claimed["mark_seq"], claimed["mark"])
                self.refused = claimed["refused"]
                self.in_step, self._floor = False, None
                # A database gone back may lack partitions this process made since: each is made again as needed.
                self._known_workspaces.clear()
        except asyncpg.LockNotAvailableError:
            return "busy"
        return "claimed"

    async def needs_filling(self, holds: Callable[[str], bool]) -> bool:
        """After a claim: whether the index is to be filled from nothing before the consumer reads on (see
        infra/migrations/0026). Decided once, when the consumer's row is new, by whether the index holds a version
        of any workspace ``holds`` (the consumer's partition); a fill stopped half-way stays to do."""
        if self._fill == "unknown":
            async with self._pool.acquire() as conn:
                workspaces = await conn.fetch("SELECT DISTINCT workspace FROM ontology_versions")
                self._fill = "done" if any(holds(row["workspace"]) for row in workspaces) else "pending"
                await self._set_on_claim("fill", self._fill, conn)
        return self._fill == "pending"

    @contextlib.asynccontextmanager
    async def compactions_held_off(self) -> AsyncIterator[bool]:
        """The compaction lock on this database, held within the block when it could be taken (a compaction
        running holds it: False)."""
        async with self._pool.acquire() as conn:
            taken = await take_compaction_lock(conn)
            try:
                yield taken
            finally:
                if taken:  # before the connection goes back to the pool; a broken one's session ends with it
                    with contextlib.suppress(Exception):
                        await conn.execute("SELECT pg_advisory_unlock(hashtext($1), 0)", COMPACTION_LOCK)

    async def filled(self) -> None:
        await self._set_on_claim("fill", "done")
        self._fill = "done"

    async def add_handled_events(self, workspace: str, events: Mapping[str, int]) -> None:
        """Events a snapshot of the workspace says were handled, though the stream no longer holds them (their
        payloads' digests unknown: a copy of one is taken as a copy)."""
        async with self._pool.acquire() as conn:
            await conn.executemany(
                "INSERT INTO handled_events (workspace, event_id, stream_seq) VALUES ($1, $2, $3)"
                " ON CONFLICT DO NOTHING",
                [(workspace, event_id, seq) for event_id, seq in events.items()],
            )

    async def read_again(self, position: int, floor: int = 0) -> None:
        """Say, before the consumer is made to read the stream again from just after ``position``, where it had
        got to (``floor``): what it settled up to there needs no dead letter again."""
        async with self._pool.acquire() as conn:
            await conn.execute(
                "UPDATE projection_fences SET position = $4, read_before = greatest(read_before, $5)"
                " WHERE durable = $1 AND epoch = $2 AND holder = $3",
                self._fence,
                self._epoch,
                self._holder,
                position,
                floor,
            )
        self.position, self.read_before = position, max(self.read_before, floor)

    async def renew(self, floor: int | None = None) -> bool:
        """Renew this store's claim, and with the consumer's ack floor (read from JetStream before this call) say
        that the index holds everything up to it; False when another process has claimed the consumer since, or
        the database went back behind this claim's commits (the store is fenced then). A batch being written
        holds the row: that is this process at work, renewing the claim too."""
        if self._fence is None or self._epoch is None:
            return False
        floor = self._floor = floor if self.in_step else None
        try:
            async with self._pool.acquire() as conn, conn.transaction():
                await conn.execute(f"SET LOCAL lock_timeout = '{RENEW_LOCK_TIMEOUT}'")
                renewed = await conn.fetchrow(
                    _RENEW_CLAIM_AT_A_LOOK, self._fence, self._epoch, self._holder, self._commits, floor
                )
                if renewed is None:
                    await self._lost_claim(conn)
                    return False
        except asyncpg.LockNotAvailableError:
            return True
        self.position = renewed["position"]
        self.followed = Followed(renewed["stream_created"], renewed["mark_seq"], renewed["mark"])
        self.refused = renewed["refused"]
        return True

    async def follow(self, created: datetime | None) -> None:
        """Record the stream the index follows (made at ``created``), as checked after a claim or at a look
        (following.py)."""
        await self._set_on_claim("stream_created", created)
        self.followed = dataclasses.replace(self.followed, created=created)

    async def refuse(self, reason: str) -> None:
        """Say why the index does not read the stream (`ontofabric status` shows it): until an operator adopts the
        stream, which deletes the row."""
        await self._set_on_claim("refused", reason)

    async def _set_on_claim(
        self, column: Literal["fill", "stream_created", "refused"], value: object, conn: Connection | None = None
    ) -> None:
        """One column of the consumer's row, while this store's claim is the latest."""
        sql = f"UPDATE projection_fences SET {column} = $4 WHERE durable = $1 AND epoch = $2 AND holder = $3"
        if conn is not None:
            await conn.execute(sql, self._fence, self._epoch, self._holder, value)
            return
        async with self._pool.acquire() as acquired:
            await acquired.execute(sql, self._fence, self._epoch, self._holder, value)

    async def release(self, floor: int | None = None) -> None:
        """Say that this store's claim ends (its process stopped applying the consumer), so that a process standing
        by need not wait out the lease, and where the index stands (the consumer's ack floor once its batches are
        settled): the next holder reads on from there. Nothing when another claimed it since."""
        epoch, self._epoch = self._epoch, None
        if self._fence is None or epoch is None:
            return
        floor = floor if self.in_step else None
        await self._pool.execute(
            "UPDATE projection_fences SET released = true, position = greatest(position, $5)"
            " WHERE durable = $1 AND epoch = $2 AND holder = $3 AND commits >= $4",
            self._fence,
            epoch,
            self._holder,
            self._commits,
            floor,
        )

    async def released_by(self) -> str | None:
        """The process whose claim on the consumer ended with a release, if the latest claim did."""
        assert self._fence is not None
        holder: str | None = await self._pool.fetchval(
            "SELECT holder FROM projection_fences WHERE durable = $1 AND released", self._fence
        )
        return holder

    async def raise_revisions(self, revisions: dict[tuple[str, str], int]) -> None:
        """Number these versions at least so far (a database gone back numbers them from an earlier count, and may
        hold no row of a branch made since: one is made, empty, as a batch makes it)."""
        if not revisions:
            return
        scopes = sorted(revisions)  # in the order batches lock them
        async with self._pool.acquire() as conn:
            await conn.execute(
                "INSERT INTO ontology_versions AS v (workspace, branch, revision)"
                " SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])"
                " ON CONFLICT (workspace, branch) DO UPDATE SET revision = greatest(v.revision, EXCLUDED.revision)",
                [workspace for workspace, _ in scopes],
                [branch for _, branch in scopes],
                [revisions[scope] for scope in scopes],
            )

    async def _check_fence(self, conn: Connection, deltas: Sequence[Delta]) -> int | None:
        """First in a batch's transaction: the claim is still the latest, and stays so until the commit (the row
        is locked; a claim waits for it). The batch renews the claim too: a holder busy with batches one after
        another may find no moment between them for the renewal of its look. Returns the row's count of commits
        with this batch's (None: no fence)."""
        if self._fence is None:
            return None
        if self._epoch is None:
            raise Fenced(f"consumer {self._fence} is not claimed by this process")
        # Hashed here, for the batch's last delta only: not at every delta's validation.
        last = max(deltas, key=lambda delta: delta.seq, default=None)
        mark_seq, mark = (last.seq, delta_mark(*last.stored)) if last and last.stored else (None, None)
        commits: int | None = await conn.fetchval(
            _RENEW_CLAIM_IN_BATCH, self._fence, self._epoch, self._holder, self._commits, self._floor, mark_seq, mark
        )
        if commits is None:
            raise Fenced(await self._lost_claim(conn))
        return commits

    async def _lost_claim(self, conn: Connection) -> str:
        """This store's claim no longer stands: fence the store, and say why (logged when the database went back)."""
        row = await conn.fetchrow(
            "SELECT epoch, holder, commits FROM projection_fences WHERE durable = $1", self._fence
        )
        mine, self._epoch = self._epoch, None
        if row is not None and (row["epoch"], row["holder"]) == (mine, self._holder):
            self.went_back = True
            log.warning(
                "projector_database_went_back", durable=self._fence, commits=self._commits, found=row["commits"],
                action="the consumer is claimed again and reads the stream again from the index's position",
            )  # fmt: skip
            return f"the database of consumer {self._fence} went back: it holds {row['commits']} of this claim's " \
                f"{self._commits} batches"  # fmt: skip
        holder = "nobody" if row is None else f"{row['holder']} (epoch {row['epoch']})"
        return f"consumer {self._fence} was claimed by {holder} after this process (epoch {mine})"

    async def apply(self, deltas: Sequence[Delta]) -> BatchResult:
        """Apply a batch atomically. Raises on any database error; nothing is written then."""
        refs = sorted({_ref(d) for d in deltas})
        scopes = sorted({(r.workspace, r.branch) for r in refs})
        async with self._pool.acquire() as conn:
            # A new partition locks the parent table: do it in its own short transaction, never in the batch's.
            for workspace in sorted({w for w, _ in scopes} - self._known_workspaces):
                await conn.execute("SELECT ensure_workspace_partition($1)", workspace)
                self._known_workspaces.add(workspace)
            async with conn.transaction():
                commits = await self._check_fence(conn, deltas)
                # The changed-row counters reach the statistics views as this commit returns, not a second
                # later: refresh_statistics right after sees this batch. And the analysis its rows are written by,
                # which an earlier release does not say (infra/migrations/0030).
                await conn.execute(
                    "SELECT pg_stat_force_next_flush(), set_config('ontofabric.analysis_version', $1, true)",
                    str(ANALYSIS_VERSION),
                )
                versions, revisions = await self._lock_versions(conn, scopes)
                await _check_model(conn, deltas)
                rows = await self._current_rows(conn, refs)
                handled = await self._handled_events(conn, {handled_event(d) for d in deltas})
                plan = plan_batch(deltas, rows, versions, handled)
                await self._write(conn, plan)
                await conn.executemany(
                    "INSERT INTO handled_events (workspace, event_id, stream_seq, payload_digest)"
                    " VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
                    [(*handled_event(d), d.seq, plan.digests[d.seq]) for d in [*plan.applied, *plan.noops]],
                )
                for (workspace, branch), version in plan.versions.items():
                    revisions[(workspace, branch)] = await conn.fetchval(
                        "UPDATE ontology_versions SET state_hash = $3, stream_seq = $4, revision = revision + 1,"
                        " updated_at = now() WHERE workspace = $1 AND branch = $2 RETURNING revision",
                        workspace,
                        branch,
                        signed64(version.state_hash),
                        version.stream_seq,
                    )
            if commits is not None:  # committed, with its count
                self._commits = commits
        current = {**versions, **plan.versions}
        return BatchResult(
            plan=plan,
            versions=[VersionUpdate(w, b, current[(w, b)], revisions[(w, b)]) for w, b in scopes],
        )

    async def refresh_statistics(self, workspaces: Iterable[str]) -> list[str]:
        """ANALYZE the partitions of these workspaces that changed much since their last ANALYZE (autovacuum's
        rule, without its delay: infra/migrations/0004). Returns the partitions analysed."""
        analysed: list[str] = []
        async with self._pool.acquire() as conn:
            stale = await conn.fetch(
                "SELECT stale_workspace_partitions($1::text[], $2, $3) AS partition",
                sorted(set(workspaces)),
                ANALYZE_THRESHOLD_ROWS,
                ANALYZE_SCALE,
            )
            for row in stale:
                try:
                    # One partition per transaction, ANALYZE last in it: a failure undoes no other partition's
                    # statistics. One already being analysed (another projector, autovacuum) is skipped, not
                    # waited for.
                    async with conn.transaction():
                        await conn.execute("SET LOCAL lock_timeout = '100ms'")
                        await conn.execute(f"SET LOCAL statement_timeout = '{ANALYZE_TIMEOUT_S}s'")
                        await conn.execute(f"ANALYZE {row['partition']}", timeout=ANALYZE_TIMEOUT_S + STALL_MARGIN_S)
                except asyncpg.LockNotAvailableError:
                    continue
                analysed.append(row["partition"])
        return analysed

    async def _handled_events(self, conn: Connection, events: set[HandledEvent]) -> dict[HandledEvent, Handled]:
        """Those of ``events`` handled before, and how. A row of workspace '' was handled before the table knew
        workspaces (infra/migrations/0019) and counts in every workspace."""
        workspaces, event_ids = [w for w, _ in events], [e for _, e in events]
        records = await conn.fetch(
            "SELECT h.workspace, h.event_id, h.stream_seq, h.payload_digest"
            " FROM unnest($1::text[], $2::text[]) AS e(workspace, event_id)"
            " JOIN handled_events h ON h.event_id = e.event_id AND h.workspace IN (e.workspace, '')",
            workspaces,
            event_ids,
        )
        found = {(r["workspace"], r["event_id"]): Handled(r["stream_seq"], r["payload_digest"]) for r in records}
        handled = {(w, e): found.get((w, e)) or found.get(("", e)) for w, e in events}
        return {event: how for event, how in handled.items() if how is not None}

    async def _lock_versions(
        self, conn: Connection, scopes: list[tuple[str, str]]
    ) -> tuple[dict[tuple[str, str], VersionState], dict[tuple[str, str], int]]:
        """Lock the version row of every (workspace, branch) in the batch, in a fixed order (no deadlocks).

        Every writer of a scope holds this lock until commit, so the rows read next cannot change under us.
        """
        workspaces, branches = [s[0] for s in scopes], [s[1] for s in scopes]
        await conn.execute(
            "INSERT INTO ontology_versions (workspace, branch)"
            " SELECT * FROM unnest($1::text[], $2::text[]) ON CONFLICT DO NOTHING",
            workspaces,
            branches,
        )
        records = await conn.fetch(
            "SELECT workspace, branch, state_hash, stream_seq, revision FROM ontology_versions"
            " WHERE (workspace, branch) IN (SELECT * FROM unnest($1::text[], $2::text[]))"
            " ORDER BY workspace, branch FOR UPDATE",
            workspaces,
            branches,
        )
        versions = {
            (r["workspace"], r["branch"]): VersionState(unsigned64(r["state_hash"]), r["stream_seq"]) for r in records
        }
        revisions = {(r["workspace"], r["branch"]): int(r["revision"]) for r in records}
        return versions, revisions

    async def _current_rows(self, conn: Connection, refs: list[EntityRef]) -> dict[EntityRef, RowState]:
        by_kind: dict[EntityKind, list[EntityRef]] = {"document": [], "node": [], "link": []}
        for ref in refs:
            by_kind[ref.kind].append(ref)
        rows: dict[EntityRef, RowState] = {}
        queries: tuple[tuple[EntityKind, str], ...] = (("document", _CURRENT_DOCUMENTS), ("node", _CURRENT_NODES))
        for kind, query in queries:
            if by_kind[kind]:
                keys = by_kind[kind]
                records = await conn.fetch(
                    query, [r.workspace for r in keys], [r.branch for r in keys], [r.key for r in keys]
                )
                rows.update(_states(kind, records))
        if by_kind["link"]:
            keys = by_kind["link"]
            parts = [split_link_key(r.key) for r in keys]
            records = await conn.fetch(
                _CURRENT_LINKS,
                [r.workspace for r in keys],
                [r.branch for r in keys],
                [p[0] for p in parts],
                [p[1] for p in parts],
                [p[2] for p in parts],
            )
            rows.update(_states("link", records))
        return rows

    async def _write(self, conn: Connection, plan: Plan) -> None:
        documents, nodes, links = [], [], []
        for ref, delta in plan.writes.items():
            if ref.kind == "document":
                documents.append(self.document_row(ref, delta))
            elif ref.kind == "node":
                nodes.append(_node_row(ref, delta))
            else:
                links.append(_link_row(ref, delta))
        if documents:
            keys = [[str(row[i]) for row in documents] for i in range(3)]  # workspace, branch, id columns
            before = await conn.fetch(_LIVE_LENGTHS, *keys)
            await conn.execute(_DROP_POSTINGS, *keys)
            await conn.executemany(UPSERT_DOCUMENT, documents)
            after = await conn.fetch(_LIVE_LENGTHS, *keys)
            await conn.execute(_ADD_POSTINGS, *keys)
            await self._update_statistics(conn, before, after)
        if nodes:
            await conn.executemany(_UPSERT_NODE, nodes)
        if links:
            await conn.executemany(_UPSERT_LINK, links)

    async def _update_statistics(
        self, conn: Connection, before: list[asyncpg.Record], after: list[asyncpg.Record]
    ) -> None:
        change: dict[tuple[str, str], list[int]] = {}
        for records, sign in ((before, -1), (after, 1)):
            for r in records:
                totals = change.setdefault((r["workspace"], r["branch"]), [0, 0])
                totals[0] += sign * r["docs"]
                totals[1] += sign * r["length"]
        for (workspace, branch), (docs, length) in change.items():
            await conn.execute(
                "UPDATE ontology_versions SET doc_count = doc_count + $3, total_length = total_length + $4"
                " WHERE workspace = $1 AND branch = $2",
                workspace,
                branch,
                docs,
                length,
            )

    def document_row(self, ref: EntityRef, delta: Delta) -> tuple[object, ...]:
        event_id = delta.envelope.event_id
        doc = upserted_document(delta.envelope)
        if doc is None:  # a tombstone or revert keeps identity and sequence only, and the file a branch deleted
            payload = delta.envelope.payload
            deleted_file = payload.deleted_file if isinstance(payload, DocumentDeleted) else None
            return (
                ref.workspace, ref.branch, ref.key, True, "", None, None, None, None, None, None, deleted_file, None,
                None, "{}", None, None, self._text_search_config, "", None, delta.seq, event_id,
                state_after(delta).transparent, None, None, None, "",
            )  # fmt: skip
        meta = doc.metadata
        embedding = np.asarray(doc.embedding, dtype=np.float32) if doc.embedding is not None else None
        second = doc.second_vector
        return (
            ref.workspace, ref.branch, doc.id, False, doc.content, doc.object_type, doc.source_domain,
            meta.symbol_key, meta.symbol_kind, meta.symbol_fqn, meta.content_hash, meta.file_path,
            meta.chunk_level, meta.provenance, json.dumps(meta.model_dump(mode="json", exclude_none=True)),
            embedding, doc.embedding_model, self._text_search_config, search_text(doc), doc.indexed_at,
            delta.seq, event_id, False, doc.token_vectors.data if doc.token_vectors is not None else None,
            second.data if second is not None else None, second.model if second is not None else None,
            own_name_repeats(doc),
        )  # fmt: skip


_ANOTHER_ANALYSIS = (
    "SELECT workspace, count(*) AS documents FROM documents"
    " WHERE NOT deleted AND (analysis_version < $1 OR analysis_version > $1)"  # two ranges of the index
    " AND ($2::text IS NULL OR workspace = $2) GROUP BY workspace ORDER BY workspace"
)


async def documents_of_another_analysis(
    conn: Connection,
    placement: Placement,
    database: int,
    workspace: str | None = None,
    among: Callable[[str], bool] | None = None,
) -> dict[str, int]:
    """Per workspace placed on ``database`` (the connection's; or of ``workspace`` only), the live documents whose
    keyword index another analysis than this build's made (:data:`ANALYSIS_VERSION`): what was projected before
    an upgrade, until ``ontofabric rebuild``. A workspace placed elsewhere is left out: a layout change may have
    left rows of it behind that no rebuild of it reaches. ``among``: only the workspaces it takes, each counted by
    a statement of its own (outside a transaction: its locks go with it), as a projector counts at start; one
    statement over every workspace locks all their partitions and indexes (17,665 locks at 1,440 workspaces:
    three of four projectors starting together ran PostgreSQL out of lock memory, a many-tenant tester's)."""
    if among is None:
        records = await conn.fetch(_ANOTHER_ANALYSIS, ANALYSIS_VERSION, workspace)
    else:
        names = [r["workspace"] for r in await conn.fetch("SELECT workspace FROM workspaces ORDER BY workspace")]
        records = [
            record
            for name in names
            if among(name) and placement.database_of(name) == database
            for record in await conn.fetch(_ANOTHER_ANALYSIS, ANALYSIS_VERSION, name)
        ]
    return {r["workspace"]: r["documents"] for r in records if placement.database_of(r["workspace"]) == database}


def _held_by_another(fence: asyncpg.Record, holder: str, live: Collection[str] | None) -> bool:
    """Whether a fence row is another process's live claim: not released, renewed within the lease, and its process
    up in discovery (or discovery not asked)."""
    return (
        fence["holder"] != holder
        and not fence["released"]
        and fence["renewed"]
        and (live is None or fence["holder"] in live)
    )


async def _check_model(conn: Connection, deltas: Sequence[Delta]) -> None:
    """Vectors of one model only: a model change swapped in commits while no batch holds a version lock, so the
    model read here holds until this batch commits."""
    documents = [d for d in map(upserted_document, (delta.envelope for delta in deltas)) if d is not None]
    if any(d.embedding is not None for d in documents):
        held = await index_model(conn)
        if any(embedded_by_another(d, held.model) for d in documents):
            raise ModelChanged(held)


def _ref(delta: Delta) -> EntityRef:
    return entity_of(delta.envelope)


def _states(kind: EntityKind, records: list[asyncpg.Record]) -> dict[EntityRef, RowState]:
    return {
        EntityRef(r["workspace"], r["branch"], kind, r["key"]): RowState(
            r["stream_seq"], r["deleted"], r["transparent"]
        )
        for r in records
    }


def _node_row(ref: EntityRef, delta: Delta) -> tuple[object, ...]:
    payload = delta.envelope.payload
    state = state_after(delta)
    if isinstance(payload, NodeUpserted):
        node = payload.node
        return (
            ref.workspace, ref.branch, ref.key, False, node.domain, node.name, node.kind, list(node.interfaces),
            node.description, delta.seq, delta.envelope.event_id, False,
        )  # fmt: skip
    return (
        ref.workspace, ref.branch, ref.key, True, None, None, None, [], None, delta.seq, delta.envelope.event_id,
        state.transparent,
    )  # fmt: skip


def _link_row(ref: EntityRef, delta: Delta) -> tuple[object, ...]:
    payload = delta.envelope.payload
    assert isinstance(payload, LinkAdded | LinkRemoved | LinkReverted)
    link, state = payload.link, state_after(delta)
    return (
        ref.workspace, ref.branch, link.source_type, link.name, link.target_type, state.deleted, delta.seq,
        delta.envelope.event_id, state.transparent,
    )  # fmt: skip
