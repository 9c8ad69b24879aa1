"""Postgres adapter of the query worker: the dense (pgvector HNSW) and keyword (BM25) retrievers, and the document
store (documents, the dense score of given ids, representatives, the ontology graph, what a scope shows).

Both retrievers apply the same filters inside the index scan, so a filter never empties a top-k that the
unfiltered index would have filled (pgvector iterative scans keep walking the HNSW graph until enough rows pass).

A branch stores only its delta over main. A query on branch B reads main ⊕ B: B's rows, and main's rows that B
does not shadow (a B row with the same id, or with the same symbol key, hides main's; transparent B rows, left by a
revert, hide nothing). A query on main reads main's rows only.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol, TypeVar

import asyncpg

from ontofabric.contracts import MAIN_BRANCH, NO_VERSION, format_version, overlay_version
from ontofabric.contracts.lookup import MAX_OTHER_BRANCHES
from ontofabric.contracts.path_patterns import pattern_regex
from ontofabric.shared.analysis import analyse, compound_identifiers
from ontofabric.shared.checksums import CONTENT_MD5_SQL
from ontofabric.shared.db import Connection, is_unavailable
from ontofabric.shared.logging import describe, get_logger
from ontofabric.shared.lru import LruMemo
from ontofabric.shared.placement import Placement
from ontofabric.shared.telemetry import meter

from .core import (
    DENSE,
    EXPANSION_LEVELS,
    KEYWORD,
    NAMED_LISTED,
    Candidate,
    Definitions,
    Fetched,
    Hits,
    Representatives,
    Scope,
    SearchInput,
    StoredDocument,
    VectorBy,
    Visible,
    vector_for_index,
)
from .graph import GraphRows, LinkRow, NodeRow
from .names import PRIVATE_PART, last_part
from .symbols import FILE, FileChunk, pointed_into

log = get_logger(__name__)

MAIN_SQL = f"'{MAIN_BRANCH}'"
"""The main branch as an SQL literal."""


def folded_sql(expression: str) -> str:
    """``expression`` case-folded as :func:`shared.analysis.folded` folds a name in Python (Unicode's full case
    folding, a dotted capital I as ``i``: ``İŞLEM`` -> ``işlem``, ``Straße`` -> ``strasse``, ``ΛΌΓΟΣ`` -> ``λόγοσ``),
    where ``lower()`` in the C locale lowers ASCII alone (a Unicode tester's); a retest's ``STRASSE`` found its class
    by relation (Python) and not by name (SQL) while the two folded otherwise. PostgreSQL 18's casefold() by its
    builtin collation pg_unicode_fast."""
    return f"replace(casefold(({expression}) COLLATE pg_unicode_fast), 'i' || chr(775), 'i')"


SYMBOL_NAME_SQL = folded_sql("regexp_replace(symbol_fqn, '^.*[.]', '')")
"""The last dotted part of a document's qualified name, lower case: what a name is looked up by (the expression of
documents_symbol_name_folded, infra/migrations/0036)."""
MAX_CHAR = 0x10FFFF
"""The last code point: after every other in byte order, so ``p || chr(MAX_CHAR)`` ends the range of texts starting
with ``p``."""
PUBLISHED_SQL = f"regexp_replace(symbol_fqn, '{PRIVATE_PART}', '', 'g')"
"""The qualified name without its private parts (names.published_name)."""
LEVEL_OR_DOC = "coalesce(chunk_level, 'doc')"
"""A document's chunk level, where one of none (the contract's default) is a producer's document about its type as a
doc-level one is: a review's prose sent without a level was said to have no representative indexed."""
_DOTTED_SQL = "position('.' in btrim($2, '.')) > 0"
"""Whether the name in $2 is dotted (names.qualities_kept)."""
NAMES_SQL = (
    f"({folded_sql('symbol_fqn')} = {folded_sql('$2')}"
    f" OR right({folded_sql('symbol_fqn')}, length({folded_sql('$2')}) + 1) = '.' || {folded_sql('$2')}"
    f" OR {folded_sql(PUBLISHED_SQL)} = {folded_sql('$2')})"
)
"""The qualified name is the name in $2, or ends with "." and it, or is it without its private parts, ignoring
case (names.match_quality)."""


def where_clause(
    scope: Scope, first_parameter: int, shadowed: Sequence[str] = (), alias: str = ""
) -> tuple[str, list[Any]]:
    """SQL conditions selecting the visible, live, matching documents of a scope, with their parameters
    numbered from ``first_parameter``. ``shadowed``: main's ids the branch hides (see ``Snapshot``)."""
    parameters: list[Any] = []

    def parameter(value: Any) -> str:
        parameters.append(value)
        return f"${first_parameter + len(parameters) - 1}"

    conditions = [f"{alias}workspace = {parameter(scope.workspace)}", f"NOT {alias}deleted"]
    if scope.on_main:
        conditions.append(f"{alias}branch = {MAIN_SQL}")
    else:
        branch, hidden = parameter(scope.branch), parameter(list(shadowed))
        conditions.append(
            f"({alias}branch = {branch} OR ({alias}branch = {MAIN_SQL} AND NOT {alias}id = ANY({hidden}::text[])))"
        )
    if scope.object_types is not None:
        conditions.append(f"{alias}object_type = ANY({parameter(list(scope.object_types))}::text[])")
    for column, value in (
        ("chunk_level", scope.chunk_level),
        ("provenance", scope.provenance),
        ("symbol_kind", scope.symbol_kind),
    ):
        if value is not None:
            conditions.append(f"{alias}{column} = {parameter(value)}")
    # As the ingest reads a pattern (the same regular expression each way); a document of no file matches none.
    if scope.paths is not None:
        selecting = [pattern_regex(p) for p in scope.paths]
        conditions.append(f"{alias}file_path ~ ANY({parameter(selecting)}::text[])")
    if scope.exclude_paths is not None:
        leaving_out = [pattern_regex(p) for p in scope.exclude_paths]
        conditions.append(f"NOT coalesce({alias}file_path ~ ANY({parameter(leaving_out)}::text[]), false)")
    return " AND ".join(conditions), parameters


@dataclass(frozen=True)
class Snapshot:
    """One consistent read: its connection (in a read-only repeatable-read transaction), the ontologyVersion it
    sees, and main's document ids the branch hides in it (same id, or same symbol key, as a non-transparent row
    of the branch, or of a file the branch holds whole or deleted: ``_shadowed_ids``; none on main)."""

    conn: Connection
    version: str
    shadowed: list[str]
    stream_seqs: dict[str, int]
    """The highest stream sequence applied to each branch read (absent: nothing yet)."""
    revisions: dict[str, int]
    """The commits that changed each branch read's version so far (absent: none)."""
    model: str | None = None
    """The embedding model of the vectors it reads (None: the scope has no version yet, so no vectors)."""


@dataclass(frozen=True)
class BranchState:
    version: str
    documents: int
    updated_at: datetime
    hidden: int = 0
    """On a branch: its tombstones, each hiding main's document of its id."""


@dataclass(frozen=True)
class BranchStates:
    """A workspace's branches' version rows, by branch, and what its vectors are."""

    of: dict[str, BranchState]
    embedding_model: str
    embedding_dimension: int
    others: list[str]
    """The workspace's other branches holding rows of their own, the latest changed first (at most
    MAX_OTHER_BRANCHES and one: one more says there are more)."""


AnnouncedRevision = Callable[[str, str], int]
"""The highest revision of a (workspace, branch) version this worker has seen announced (0: none)."""

REPLICA_REST_S = 5.0
"""How long a read replica that could not serve a read is passed over: a dead host costs one read, not each."""

_reads = meter().create_counter(
    "query.database.reads", description="snapshots taken, by source (primary, replica) and why a replica was passed"
)


@dataclass
class _Source:
    pool: asyncpg.Pool
    replica: bool
    resting_until: float = 0.0


class PostgresSnapshots:
    """Each read of the query worker is one snapshot (a read-only repeatable-read transaction) that knows its
    version; the retrievers and the document store share this.

    With read replicas, a read goes to one of them in turn, and is taken there only if the replica has applied
    every version of the scope this worker has seen announced (``announced``): otherwise, or when it cannot
    serve, the next replica and last the primary take it. So an answer never reads older than what was
    announced, and a lagging replica costs one extra snapshot, not a stale answer."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        acquire_timeout_s: float | None = None,
        *,
        replicas: Sequence[asyncpg.Pool] = (),
        announced: AnnouncedRevision | None = None,
        on_model: Callable[[str], object] | None = None,
    ) -> None:
        self._replicas = [_Source(replica, replica=True) for replica in replicas]
        self._primary = _Source(pool, replica=False)
        self._turn = 0
        self._announced = announced
        self._on_model = on_model
        """Told the embedding model of the index at every read: how a worker follows a model change."""
        self._acquire_timeout_s = acquire_timeout_s
        """How long a read waits for a connection: a stalled database is `unavailable`, not a hang."""
        # Main ids a branch hides, per (workspace, branch, version, revisions): computed once per version, inside a
        # snapshot (the first's, which the snapshots opened meanwhile wait for). The revisions tell a rebuilt index
        # (the same version) from the one it replaced.
        self._shadowed: LruMemo[tuple[str, str, str, tuple[int, ...]], list[str]] = LruMemo(64)

    def _sources(self) -> list[_Source]:
        """The replicas from the next one in turn (those resting last), then the primary."""
        self._turn = (self._turn + 1) % max(len(self._replicas), 1)
        ordered = self._replicas[self._turn :] + self._replicas[: self._turn]
        now = time.monotonic()
        return [*sorted(ordered, key=lambda source: source.resting_until > now), self._primary]

    @contextlib.asynccontextmanager
    async def session(self, scope: Scope) -> AsyncIterator[None]:
        """Reads of the scope's workspace and branch inside the block, in this task and the tasks it starts, share
        one snapshot, opened by the first of them and ended with the block: the reads see one state, and each is
        one statement on a held connection instead of a transaction of its own (four round trips). They take
        turns. After one fails or is cancelled (the transaction may be aborted), the rest read alone. The snapshot
        holds the partitioned parents' lock until the block ends: keep the block to the reads."""
        shared = _SharedRead(self, (scope.workspace, scope.branch))
        token = _SESSION.set(shared)
        try:
            yield
        finally:
            _SESSION.reset(token)
            async with shared.turn:  # after the read in hand; a task that outlives the block then reads alone
                await shared.end()

    @contextlib.asynccontextmanager
    async def read(self, scope: Scope, *, alone: bool = False) -> AsyncIterator[Snapshot]:
        """A snapshot of the scope: the session's, if one is open for it, else one of its own (``alone``: always),
        ended with the block."""
        shared = None if alone else _SESSION.get()
        if shared is not None and shared.owner is self and shared.key == (scope.workspace, scope.branch):
            async with shared.turn:
                if not shared.broken:
                    try:
                        if shared.snapshot is None:
                            shared.snapshot = await shared.held.enter_async_context(self._read_alone(scope))
                        yield shared.snapshot
                    except BaseException:
                        shared.broken = True
                        raise
                    return
                # Ended before this read goes alone: a snapshot of its own must not wait on a lock (a swap's,
                # queued behind the session's) that this same answer holds.
                await shared.end()
        async with self._read_alone(scope) as snapshot:
            yield snapshot

    @contextlib.asynccontextmanager
    async def _read_alone(self, scope: Scope) -> AsyncIterator[Snapshot]:
        for source in self._sources():
            async with contextlib.AsyncExitStack() as held:
                if not source.replica:
                    snapshot = await self._open(held, source.pool, scope)
                else:
                    try:
                        snapshot = await self._open(held, source.pool, scope)
                    except Exception as error:
                        if not is_unavailable(error):
                            raise
                        source.resting_until = time.monotonic() + REPLICA_REST_S
                        _reads.add(1, {"source": "replica", "passed": "unavailable"})
                        log.warning("replica_unavailable", error=describe(error))
                        continue
                    if self._behind(scope, snapshot):
                        _reads.add(1, {"source": "replica", "passed": "behind"})
                        continue
                _reads.add(1, {"source": "replica" if source.replica else "primary"})
                if snapshot.model is not None and self._on_model is not None:
                    self._on_model(snapshot.model)
                yield snapshot
                return

    def _behind(self, scope: Scope, snapshot: Snapshot) -> bool:
        if self._announced is None:
            return False
        return any(
            snapshot.revisions.get(branch, 0) < self._announced(scope.workspace, branch) for branch in scope.branches
        )

    async def _open(self, held: contextlib.AsyncExitStack, pool: asyncpg.Pool, scope: Scope) -> Snapshot:
        conn = await held.enter_async_context(pool.acquire(timeout=self._acquire_timeout_s))
        await held.enter_async_context(_read_only_transaction(conn))
        rows = await conn.fetch(
            "SELECT branch, state_hash, stream_seq, revision, (SELECT embedding_model FROM deployment) AS model"
            " FROM ontology_versions"
            " WHERE workspace = $1 AND branch = ANY($2::text[]) ORDER BY branch",
            scope.workspace,
            scope.branches,
        )
        versions = {r["branch"]: format_version(r["state_hash"], r["stream_seq"]) for r in rows}
        version = overlay_version(versions.get(MAIN_BRANCH, NO_VERSION), scope.branch, versions.get(scope.branch))
        shadowed: list[str] = []
        if not scope.on_main:
            key = (scope.workspace, scope.branch, version, tuple(r["revision"] for r in rows))
            shadowed = await self._shadowed.get(key, lambda: _shadowed_ids(conn, scope.workspace, scope.branch))
        model = rows[0]["model"] if rows else None
        return Snapshot(
            conn,
            version,
            shadowed,
            {r["branch"]: int(r["stream_seq"]) for r in rows},
            {r["branch"]: int(r["revision"]) for r in rows},
            model,
        )


# Before the snapshot is taken (LOCK takes none): a rebuild swapping the workspace's partitions in has committed, or
# waits for this read, so the snapshot never pairs the new partitions with an older version. Every partitioned
# parent at once, in the swap's order (by name). A hot standby allows this lock mode. One message, one round trip.
_BEGIN_READ = (
    "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY;"
    " LOCK TABLE ONLY documents, ONLY postings, ONLY term_statistics IN ACCESS SHARE MODE"
)


@contextlib.asynccontextmanager
async def _read_only_transaction(conn: Connection) -> AsyncIterator[None]:
    """A read-only repeatable-read transaction holding the partitioned parents against a swap; rolled back at the
    end (it wrote nothing)."""
    try:
        await conn.execute(_BEGIN_READ)
        yield
    finally:
        # Whatever happened: cancelled while the LOCK waited, the transaction is open though no answer came back
        # to say so (outside one, ROLLBACK only warns).
        if not _gone(conn):
            await _whole(conn.execute("ROLLBACK"))


def _gone(conn: Connection) -> bool:
    """Whether the connection is closed. One its server ended (a backend terminated) asyncpg's pool takes back at
    once, and every call on it then raises, ``is_closed()`` too: that error replaced the read's own, and the
    worker logged "released back to the pool" instead of why the read failed (a fault tester's)."""
    try:
        return conn.is_closed()
    except asyncpg.InterfaceError:
        return True


T = TypeVar("T")


async def _whole(step: Awaitable[T]) -> T:
    """``step`` awaited to its end even when the task is cancelled again meanwhile (a deadline, then the answer
    given up), the cancellation passed on after. A ROLLBACK cut short gave the connection back to the pool inside
    its transaction, and asyncpg's reset said so at error level, once for every such answer under load."""
    running = asyncio.ensure_future(step)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(running)
            break
        except asyncio.CancelledError:
            if running.cancelled():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


class _SharedRead:
    """The snapshot a session's reads share (``PostgresSnapshots.session``)."""

    def __init__(self, owner: PostgresSnapshots, key: tuple[str, str]) -> None:
        self.owner = owner
        self.key = key
        """(workspace, branch): what a snapshot depends on; filters differ from read to read."""
        self.turn = asyncio.Lock()
        """One statement at a time on the one connection."""
        self.held = contextlib.AsyncExitStack()
        self.snapshot: Snapshot | None = None
        self.broken = False
        """A read failed or was cancelled (its transaction may be aborted), or the session ended: reads go alone."""

    async def end(self) -> None:
        """Ends the transaction and gives the connection back (again: nothing); later reads go alone."""
        self.broken = True
        try:
            await self.held.aclose()
        except Exception as error:  # what was read stands; the pool drops a connection that failed here
            log.warning("read_session_end_failed", error=describe(error))


_SESSION: contextvars.ContextVar[_SharedRead | None] = contextvars.ContextVar("ontofabric_read_session", default=None)


class Snapshots(Protocol):
    def read(self, scope: Scope, *, alone: bool = False) -> contextlib.AbstractAsyncContextManager[Snapshot]:
        """One consistent read of the scope's workspace (``PostgresSnapshots.read``)."""
        ...

    def session(self, scope: Scope) -> contextlib.AbstractAsyncContextManager[None]:
        """Reads of the scope inside the block share one snapshot (``PostgresSnapshots.session``)."""
        ...


class PlacedSnapshots:
    """Reads on the database each workspace is placed on (shared/placement.py), each database's own snapshots."""

    def __init__(self, placement: Placement, databases: Sequence[PostgresSnapshots]) -> None:
        assert len(databases) == len(placement.databases)
        self._placement = placement
        self._databases = list(databases)

    def read(self, scope: Scope, *, alone: bool = False) -> contextlib.AbstractAsyncContextManager[Snapshot]:
        return self._databases[self._placement.database_of(scope.workspace)].read(scope, alone=alone)

    def session(self, scope: Scope) -> contextlib.AbstractAsyncContextManager[None]:
        return self._databases[self._placement.database_of(scope.workspace)].session(scope)


class PostgresDense:
    """Nearest neighbours by cosine distance over the HNSW index, the request's filters applied inside the scan."""

    name = DENSE
    backend = "pgvector"
    needs_embedding = True

    def __init__(self, snapshots: Snapshots, ef_search: int, vector_by: VectorBy | None = None) -> None:
        self._snapshots = snapshots
        self._ef_search = ef_search
        self._vector_by = vector_by

    async def search(self, scope: Scope, query: SearchInput, limit: int) -> Hits:
        async with self._snapshots.read(scope) as snapshot:
            vector = await vector_for_index(query, snapshot.model, self._vector_by, scope.workspace)
            where, parameters = where_clause(scope, 3, snapshot.shadowed)
            # relaxed_order iterative scans may return rows slightly out of order: re-sort the materialised top-k.
            sql = f"""
                WITH nearest AS MATERIALIZED (
                    SELECT id, embedding <=> $1 AS distance FROM documents
                    WHERE {where} AND embedding IS NOT NULL
                    ORDER BY embedding <=> $1 LIMIT $2)
                SELECT id, 1 - distance AS score FROM nearest WHERE distance <> 'NaN'::float8 ORDER BY distance, id"""
            if limit > self._ef_search:  # the HNSW candidate list must hold at least the rows asked for
                await snapshot.conn.execute(f"SET LOCAL hnsw.ef_search = {int(limit)}")
            rows = await snapshot.conn.fetch(sql, vector, limit, *parameters)
        compared = snapshot.model if snapshot.model not in (None, query.model) else None
        return Hits([Candidate(r["id"], float(r["score"])) for r in rows], snapshot.version, embedding_model=compared)


RARE_SHARE = 0.1
"""A keyword list that holds every document having a query term is read as one of rare terms (``Hits.coverage``)
when those documents are at most this share of the workspace's."""


@dataclass(frozen=True)
class HiddenStatistics:
    """What main's documents a branch hides add to main's keyword statistics, for a search on the branch to take
    out: how many are live, their summed length, and per term how many of them hold it."""

    documents: int = 0
    length: int = 0
    frequencies: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    async def read(cls, conn: Connection, workspace: str, hidden: Sequence[str]) -> HiddenStatistics:
        """Of main's documents ``hidden``, read as the projector writes their postings (each term of a live
        document's tsvector: services/projector/store.py)."""
        documents, length = await conn.fetchrow(
            f"SELECT count(*), coalesce(sum(doc_length), 0) FROM documents"
            f" WHERE workspace = $1 AND branch = {MAIN_SQL} AND id = ANY($2::text[]) AND NOT deleted",
            workspace,
            hidden,
        ) or (0, 0)
        terms = await conn.fetch(
            f"SELECT u.lexeme AS term, count(*) AS df FROM documents d CROSS JOIN LATERAL unnest(d.search_vector) u"
            f" WHERE d.workspace = $1 AND d.branch = {MAIN_SQL} AND d.id = ANY($2::text[]) AND NOT d.deleted"
            " GROUP BY u.lexeme",
            workspace,
            hidden,
        )
        return cls(int(documents), int(length), {r["term"]: int(r["df"]) for r in terms})

    def of_terms(self, terms: Sequence[str]) -> HiddenStatistics:
        """The same, with the frequencies of ``terms`` only."""
        return HiddenStatistics(
            self.documents, self.length, {t: self.frequencies[t] for t in terms if t in self.frequencies}
        )


NOTHING_HIDDEN = HiddenStatistics()


class PostgresKeyword:
    """BM25 (Lucene's idf) over the postings the projector keeps; filters apply before the top-k is cut.

    A query term repeated n times weighs (k3 + 1)·n / (k3 + n), Okapi's query-term saturation: long queries
    (a paragraph, an argument) say what matters by repeating it, short ones rarely repeat a word on purpose.

    Bounded work, after MaxScore (Turtle & Flood, 1995): the terms are taken rarest first and read in full while
    their postings add up to at most ``full_read_postings`` (the rarest always); every document found there is a
    candidate. The other, commoner terms are looked up only for the ``completion_depth`` leading candidates, which
    then rank by their whole score. What is left out is a document holding none of the rare terms, or one outside
    the leading candidates: both can only gain the common terms, whose idf is the lowest of the query's. Within
    the budget the scores are exact BM25; ``Hits.pruned`` says when they were not.

    On a branch, N, the average length and document frequencies add up main's and the branch's rows, less main's
    rows the branch hides (:class:`HiddenStatistics`): the statistics of the tree the branch shows, as a fresh
    ingest of it would have them (an outside tester's branch ranked otherwise than such an ingest).
    """

    name = KEYWORD
    backend = "postgres-bm25"
    needs_embedding = False

    def __init__(
        self,
        snapshots: Snapshots,
        text_search_config: str,
        bm25_k1: float,
        bm25_b: float,
        bm25_k3: float,
        full_read_postings: int = 1_000_000_000,
        completion_depth: int = 0,
    ) -> None:
        self._snapshots = snapshots
        self._config = text_search_config
        self._k1 = bm25_k1
        self._b = bm25_b
        self._k3 = bm25_k3
        self._full_read_postings = full_read_postings
        self._completion_depth = completion_depth
        # Per (workspace, branch, version, revisions), as many as the hidden ids are (PostgresSnapshots): made once
        # per version, by the first keyword search of it, which those arriving meanwhile wait for.
        self._hidden: LruMemo[tuple[str, str, str, tuple[tuple[str, int], ...]], HiddenStatistics] = LruMemo(64)

    async def search(self, scope: Scope, query: SearchInput, limit: int) -> Hits:
        # Alone: it runs while the query is embedded, and a session's snapshot opened now would hold the parents'
        # lock (which a rebuild's swap waits for) across the embedding.
        async with self._snapshots.read(scope, alone=True) as snapshot:
            hidden = await self._hidden_statistics(scope, snapshot)
            if hidden.frequencies:  # only the query's terms' go with the statement: the hidden may hold thousands
                lexemes = await snapshot.conn.fetchval(
                    "SELECT array(SELECT lexeme FROM unnest(index_tsvector($1::regconfig, $2)))",
                    self._config,
                    analyse(query.text, catenate=False),
                )
                hidden = hidden.of_terms(lexemes)
            rows = await snapshot.conn.fetch(*self._sql(scope, query.text, limit, snapshot.shadowed, hidden))
        first = rows[0] if rows else None
        # Every document holding a query term is here only when nothing filtered or pruned the list and it is
        # shorter than asked; and they are rare only when few against the workspace (in one of eight documents,
        # five holders are no rare word: a review's). Only then does a hit's coverage say what it should.
        rare = (
            first is not None
            and not first["pruned"]
            and not scope.filtered
            and len(rows) < limit
            and len(rows) <= RARE_SHARE * float(first["documents"])
        )
        return Hits(
            [Candidate(r["id"], float(r["score"])) for r in rows],
            snapshot.version,
            None if first is None else float(first["ceiling"]),
            None if first is None else float(first["query_ceiling"]),
            pruned=first is not None and first["pruned"],
            coverage={r["id"]: min(1.0, float(r["coverage"])) for r in rows if math.isfinite(r["coverage"])}
            if rare
            else None,
        )

    async def _hidden_statistics(self, scope: Scope, snapshot: Snapshot) -> HiddenStatistics:
        if not snapshot.shadowed:
            return NOTHING_HIDDEN
        key = (scope.workspace, scope.branch, snapshot.version, tuple(sorted(snapshot.revisions.items())))
        return await self._hidden.get(
            key, lambda: HiddenStatistics.read(snapshot.conn, scope.workspace, snapshot.shadowed)
        )

    def _sql(
        self, scope: Scope, text: str, limit: int, shadowed: list[str], hidden: HiddenStatistics = NOTHING_HIDDEN
    ) -> list[Any]:
        terms, frequencies = zip(*hidden.frequencies.items(), strict=True) if hidden.frequencies else ((), ())
        parameters: list[Any] = [
            self._config, analyse(text, catenate=False), limit, scope.workspace, scope.branches, self._k1, self._b,
            shadowed, self._k3, self._full_read_postings, max(self._completion_depth, limit),
            list(terms), list(frequencies), hidden.documents, hidden.length, *compound_identifiers(text),
        ]  # fmt: skip
        filtered = ""
        if scope.filtered:
            where, more = where_clause(scope, len(parameters) + 1, shadowed)
            parameters += more
            filtered = f"AND EXISTS (SELECT 1 FROM documents WHERE id = s.id AND {where})"

        def scores(terms: str, postings: str = "") -> str:
            """BM25 per document over the matched terms selected by ``terms``, reading only the postings that
            ``postings`` also selects. Every postings read is an index range scan on (workspace, branch, term):
            LATERAL, kept from being flattened into a join by OFFSET 0, makes it so even before the planner has
            statistics of a partition. $6 is k1, $7 b; main's rows the branch hides ($8) do not count. ``held``:
            the weight of the query terms the document holds, whatever their counts."""
            return f"""
                SELECT p.doc_id AS id,
                       sum(m.weight * p.tf * ($6::float8 + 1)
                           / (p.tf + $6::float8 * (1 - $7::float8 + $7::float8 * p.doc_length / st.avgdl))) AS score,
                       sum(m.weight) AS held
                FROM matched m CROSS JOIN stats st
                CROSS JOIN LATERAL (
                    SELECT branch, doc_id, tf, doc_length FROM postings p
                    WHERE p.workspace = $4 AND p.branch = ANY($5::text[]) AND p.term = m.term {postings}
                    OFFSET 0) p
                WHERE {terms} AND NOT (p.branch = {MAIN_SQL} AND p.doc_id = ANY($8::text[]))
                GROUP BY p.doc_id"""

        # Parameters are cast: an untyped $n beside an integer literal is inferred as integer, and asyncpg would
        # round k1, b and k3 without a word.
        sql = f"""
            WITH terms AS (
                SELECT lexeme AS term, coalesce(cardinality(positions), 1) AS qtf
                FROM unnest(index_tsvector($1::regconfig, $2))),
            -- Less main's documents the branch hides: $14 of them, $15 long in all.
            stats AS (
                SELECT greatest(sum(doc_count) - $14::bigint, 1)::float8 AS n,
                       greatest(sum(total_length) - $15::bigint, 1)::float8
                           / greatest(sum(doc_count) - $14::bigint, 1) AS avgdl
                FROM ontology_versions WHERE workspace = $4 AND branch = ANY($5::text[])),
            -- weight: idf times the query term's saturated repeat count ($9 is k3).
            term_weight AS (
                SELECT t.term, f.df,
                       ($9::float8 + 1) * t.qtf / ($9::float8 + t.qtf)
                       * ln(1 + (st.n - f.df + 0.5) / (f.df + 0.5)) AS weight
                FROM terms t CROSS JOIN stats st
                CROSS JOIN LATERAL (
                    SELECT greatest(coalesce(sum(s.df), 0) - coalesce((
                               SELECT h.df FROM unnest($12::text[], $13::int[]) AS h(term, df) WHERE h.term = t.term
                           ), 0), 0) AS df
                    FROM term_statistics s
                    WHERE s.workspace = $4 AND s.branch = ANY($5::text[]) AND s.term = t.term) f),
            -- $16: the query's compound identifiers whole, $17 their parts. A whole word no document holds, and
            -- no part, stands for its parts: not it, they are what a match misses (the weight it is over).
            standing_in AS (
                SELECT lexeme FROM unnest(index_tsvector($1::regconfig, $16))
                EXCEPT SELECT lexeme FROM unnest(index_tsvector($1::regconfig, $17))),
            query_weight AS (
                SELECT sum(weight) AS total FROM term_weight
                WHERE df > 0 OR term NOT IN (SELECT lexeme FROM standing_in)),
            -- Rarest first: a term is read in full while the postings read so far stay within $10, the first always.
            matched AS (
                SELECT term, weight,
                       sum(df) OVER (ORDER BY df, term ROWS UNBOUNDED PRECEDING)
                           <= greatest($10::bigint, min(df) OVER ()) AS in_full
                FROM term_weight WHERE df > 0),
            found AS ({scores("m.in_full")}),
            -- As deep as the completion needs ($11) when a term was left out, else the answer's depth ($3):
            -- sorting and carrying 3,000 leaders where nothing completes them cost an unpruned query a seventh.
            leaders AS (
                SELECT s.id, s.score, s.held FROM found s
                WHERE true {filtered}
                ORDER BY s.score DESC, s.id
                LIMIT CASE WHEN EXISTS (SELECT 1 FROM matched WHERE NOT in_full) THEN $11::bigint ELSE $3::bigint END),
            -- The commoner terms, looked up by (term, document) for the leading candidates only.
            completed AS ({scores("NOT m.in_full", "AND p.doc_id = ANY(ARRAY(SELECT id FROM leaders))")})
            -- The best score a document could reach: over the terms some document has (ceiling), and over every
            -- query term (query_ceiling: a term no document has still counts as missing from every match, unless
            -- it is a compound identifier's whole word, standing for its parts).
            -- Summed, not joined: the planner cannot know how many leaders the LIMIT above keeps, and with a
            -- guess too low it joined the two by a nested loop, 3,000 × 2,000 comparisons (0.3 s).
            SELECT l.id, l.score, l.held / (SELECT total FROM query_weight) AS coverage,
                   (SELECT n FROM stats) AS documents,
                   (SELECT sum(weight) FROM matched) * ($6::float8 + 1) AS ceiling,
                   (SELECT total FROM query_weight) * ($6::float8 + 1) AS query_ceiling,
                   EXISTS (SELECT 1 FROM matched WHERE NOT in_full) AS pruned
            FROM (SELECT id, sum(score) AS score, sum(held) AS held
                  FROM (SELECT id, score, held FROM leaders UNION ALL SELECT id, score, held FROM completed) parts
                  GROUP BY id) l
            ORDER BY score DESC, l.id LIMIT $3"""
        return [sql, *parameters]


class PostgresDocuments:
    """The document store: documents, the dense score of given ids, representatives and the graph, and what a
    scope shows (which other indexes' hits are checked against)."""

    def __init__(self, snapshots: Snapshots, vector_by: VectorBy | None = None) -> None:
        self._snapshots = snapshots
        self._vector_by = vector_by

    def session(self, scope: Scope) -> contextlib.AbstractAsyncContextManager[None]:
        return self._snapshots.session(scope)

    async def fetch(
        self,
        scope: Scope,
        ids: Sequence[str],
        token_signs_of: Sequence[str] = (),
        second_vectors_of: Sequence[str] = (),
        second_model: str | None = None,
    ) -> Fetched:
        async with self._snapshots.read(scope) as snapshot:
            where, parameters = where_clause(scope.unfiltered, 5, snapshot.shadowed)
            # Token signs (kilobytes a document) only where late interaction will read them; second vectors only
            # where the second opinion will, and only of its model.
            sql = f"""
                SELECT id, content, object_type, source_domain, metadata,
                       CASE WHEN id = ANY($2::text[]) THEN token_signs END AS token_signs,
                       CASE WHEN id = ANY($3::text[]) AND second_model = $4 THEN second_vector END AS second_vector
                FROM documents
                WHERE id = ANY($1::text[]) AND {where}"""
            rows = await snapshot.conn.fetch(
                sql, list(ids), list(token_signs_of), list(second_vectors_of), second_model, *parameters
            )
        documents = {
            r["id"]: StoredDocument(
                r["id"],
                r["content"],
                r["object_type"],
                r["source_domain"],
                json.loads(r["metadata"]),
                r["token_signs"],
                r["second_vector"],
            )
            for r in rows
        }
        return Fetched(documents, snapshot.version, snapshot.model)

    async def similarities(self, scope: Scope, query: SearchInput, ids: Sequence[str]) -> Hits:
        """The dense score (cosine similarity) of each of ``ids`` the dense search could have returned, unordered:
        for keyword hits the dense top-k did not reach, so fusion weighs what they are, not a guess."""
        async with self._snapshots.read(scope) as snapshot:
            vector = await vector_for_index(query, snapshot.model, self._vector_by, scope.workspace)
            where, parameters = where_clause(scope, 3, snapshot.shadowed)
            sql = f"""
                SELECT id, 1 - (embedding <=> $1) AS score FROM documents
                WHERE id = ANY($2::text[]) AND {where} AND embedding IS NOT NULL"""
            rows = await snapshot.conn.fetch(sql, vector, list(ids), *parameters)
        return Hits(
            [Candidate(r["id"], float(r["score"])) for r in rows if not math.isnan(r["score"])], snapshot.version
        )

    async def representatives(
        self, scope: Scope, object_types: Sequence[str], levels: Sequence[str] = EXPANSION_LEVELS
    ) -> Representatives:
        if not object_types:
            return Representatives({}, None)
        # Alone: a relation question reads it beside the retrievers (see graph_rows). A type declared in a module's
        # code and in its declaration file (x.js, x.d.ts; code.is_declaration_file's suffixes) is the code's: an agent
        # tester's subclasses were stubs.
        async with self._snapshots.read(scope, alone=True) as snapshot:
            where, parameters = where_clause(scope, 3, snapshot.shadowed)
            sql = f"""
                SELECT DISTINCT ON (object_type) object_type, id FROM documents
                WHERE object_type = ANY($1::text[]) AND {LEVEL_OR_DOC} = ANY($2::text[]) AND {where}
                ORDER BY object_type, array_position($2::text[], {LEVEL_OR_DOC}),
                    coalesce(file_path ~ '\\.d\\.[cm]?ts$', false), id"""
            rows = await snapshot.conn.fetch(sql, list(object_types), list(levels), *parameters)
        return Representatives({r["object_type"]: r["id"] for r in rows}, snapshot.version)

    async def listing(self, scope: Scope, limit: int, offset: int = 0) -> Hits:
        async with self._snapshots.read(scope) as snapshot:
            where, parameters = where_clause(scope, 3, snapshot.shadowed)
            rows = await snapshot.conn.fetch(
                f"SELECT id FROM documents WHERE {where}"
                " ORDER BY file_path NULLS LAST, symbol_fqn NULLS LAST, id LIMIT $1 OFFSET $2",
                limit,
                offset,
                *parameters,
            )
        return Hits([Candidate(r["id"], 1.0) for r in rows], snapshot.version)

    async def definitions(self, scope: Scope, name: str, limit: int) -> Definitions:
        found = await self._definitions(scope, name, limit)
        if found.symbols or name.count(".") < 2:
            return found
        # A member under the name its class is published by (click.Option.param_type_name for
        # click.core.Option.param_type_name; a tester's were said not to exist): named as asked.
        owner, member = name.rsplit(".", 1)
        published = (await self._definitions(scope.unfiltered, owner, 1)).published_as
        if published is None:
            return found
        inner = await self._definitions(scope, f"{published}.{member}", limit)
        named = {doc_id: name for doc_id in inner.symbols}
        return Definitions(
            named,
            inner.version,
            inner.modules,
            published_as=f"{published}.{member}",
            assigning=inner.assigning,
            publishing=inner.publishing,
        )

    async def _definitions(self, scope: Scope, name: str, limit: int) -> Definitions:
        async with self._snapshots.read(scope, alone=True) as snapshot:  # beside the retrievers: as the keyword's
            where, parameters = where_clause(scope, 4, snapshot.shadowed)
            # Looked up by the name's last part through documents_symbol_name_folded (migration 0036), then
            # matched whole: the qualified name is the name, or ends with "." and the name.
            rows = await snapshot.conn.fetch(
                f"""SELECT id, symbol_fqn, chunk_level FROM documents
                    WHERE {SYMBOL_NAME_SQL} = {folded_sql("$1")}
                      AND {NAMES_SQL} AND chunk_level IS DISTINCT FROM 'doc' AND {where}
                    ORDER BY symbol_fqn = $2 DESC, right(symbol_fqn, length($2) + 1) = '.' || $2 DESC,
                             {PUBLISHED_SQL} = $2 DESC, chunk_level = 'file', length(symbol_fqn), id
                    LIMIT $3""",
                last_part(name),
                name,
                limit,
                *parameters,
            )
            # And the chunks assigning the name at their level (a module's constant, a class's attribute: no
            # chunk of their own), through documents_defines (0028), named as the name under its chunk's.
            # Matched as written (a jsonb key is): the name under the chunk's is the asked one, ends with it, or is
            # it without private parts, as symbols match (NAMES_SQL); so a qualified name is not lost among the
            # many modules assigning a common last part (log, logger), nor a misspelt one taken for known.
            assigning = await snapshot.conn.fetch(
                f"""SELECT id, named AS symbol_fqn, chunk_level
                    FROM (SELECT id, chunk_level, symbol_fqn || '.' || $1 AS named FROM documents
                          WHERE metadata ? 'defines' AND metadata -> 'defines' ? $1 AND symbol_fqn IS NOT NULL
                            AND chunk_level IS DISTINCT FROM 'doc' AND {where}) assigned
                    WHERE named = $2 OR right(named, length($2) + 1) = '.' || $2
                          OR regexp_replace(named, '{PRIVATE_PART}', '', 'g') = $2
                    ORDER BY named = $2 DESC, right(named, length($2) + 1) = '.' || $2 DESC, length(named), id
                    LIMIT $3""",
                last_part(name),
                name,
                limit,
                *parameters,
            )
            # And the chunks whose symbol a package publishes under the name (metadata.aliases, through
            # documents_aliases, 0028), as written: named by it, so they match it whole.
            where, parameters = where_clause(scope, 3, snapshot.shadowed)
            published = await snapshot.conn.fetch(
                f"""SELECT id, $1::text AS symbol_fqn, symbol_fqn AS own, chunk_level, source_domain FROM documents
                    WHERE metadata ? 'aliases' AND metadata -> 'aliases' ? $1
                      AND chunk_level IS DISTINCT FROM 'doc' AND {where}
                    ORDER BY id
                    LIMIT $2""",
                name,
                limit,
                *parameters,
            )
        if published:  # a name bound to a symbol (`s = attrs`) is answered by its definition, not by the binding
            assigning = [r for r in assigning if r["symbol_fqn"] != name]
        # A symbol's own name wins over a name it assigns, and a class's or function's name its package publishes
        # it under over both: an agent tester's anyio.Event (anyio._core._synchronization.Event) matched, by its
        # own name without its private parts, only as well as the backends' anyio._backends._asyncio.Event. Not a
        # module's: a Go package's file named by the package would go before a function of that name (a review's).
        found = {r["id"]: r["symbol_fqn"] for r in [*published, *assigning, *rows]}
        found |= {r["id"]: r["symbol_fqn"] for r in published if r["chunk_level"] != "file"}
        modules = frozenset(r["id"] for r in [*rows, *assigning, *published] if r["chunk_level"] == "file")
        own = next((r["own"] for r in published if r["chunk_level"] != "file"), None)
        # A Rust module's file is named by its path in the crate, a TypeScript or JavaScript index file by its
        # directory, a Go package's stand-in file by its package; a Python module's alias publishes a name it
        # assigns. Only one module so named, and none named so itself (a review's: `src/http.ts` beside
        # `src/http/index.ts`, or two Go packages `store`, had the question asked of one picked by its id).
        named_modules = {
            r["own"]
            for r in published
            if r["chunk_level"] == "file" and r["source_domain"] in ("rust", "typescript", "javascript", "go")
        }
        own_module = any(r["chunk_level"] == "file" for r in rows)
        module = next(iter(named_modules)) if len(named_modules) == 1 and not own_module else None
        # A module's chunk published under the name publishes a name it assigns (pytest.skip): where, as assigning.
        publishing = frozenset(r["id"] for r in published if r["chunk_level"] == "file")
        assigned = frozenset(r["id"] for r in assigning) | publishing
        own_rows = {r["id"] for r in rows}
        return Definitions(
            found,
            snapshot.version,
            modules,
            published_as=own,
            module_named=module,
            assigning=assigned - own_rows,
            publishing=publishing - own_rows,
        )

    async def files(
        self, scope: Scope, path: str, limit: int, line: int | None = None, name: str | None = None
    ) -> Definitions:
        parts = path.split("/")
        # The file stored under the path itself; else every file stored under a path ending with it (a tree
        # ingested from above the asker's root), the shortest first, by the path read backwards (migration 0032:
        # the range of reversed paths starting with the asked one's, "/" before it); else under the longest path
        # it ends with (one ingested from inside: `console.py` for `rich/console.py`), by documents_file_path
        # (0031). In that order: a review's `docs/guide.md` was answered by a root `guide.md` alone, where
        # `blog/docs/guide.md` was stored. Each pass: (condition, its $1, the length's sign, one file).
        passes = (
            ("file_path = $1::text", path, 1, True),
            (f'reverse(file_path) COLLATE "C" >= $1 AND reverse(file_path) COLLATE "C" < $1 || chr({MAX_CHAR})',
             ("/" + path)[::-1], 1, False),
            ("file_path = ANY($1::text[])", ["/".join(parts[i:]) for i in range(1, len(parts))], -1, True),
        )  # fmt: skip
        start, end = "(metadata ->> 'startLine')::int", "(metadata ->> 'endLine')::int"
        holds_line = f"coalesce({start} <= $4 AND {end} >= $4, false)"
        named = f"coalesce({SYMBOL_NAME_SQL} = {folded_sql('$5')}, false)"
        async with self._snapshots.read(scope, alone=True) as snapshot:
            # The branches read, said apart from the overlay's condition: the index's range on the path's end
            # needs the branch as a condition of its own (a review's PostgreSQL 17 read the workspace's every entry).
            where, parameters = where_clause(scope, 7, snapshot.shadowed)
            one_file = True
            for condition, asked, longest, names_one in passes:
                # The file's chunk or its sections; with a line, the chunks holding it, the innermost first; with
                # a frame's function, the chunks of that name (symbols.pointed_into keeps one).
                rows = await snapshot.conn.fetch(
                    f"""SELECT id, coalesce(symbol_fqn, file_path) AS symbol_fqn, file_path, {named} AS named,
                               {holds_line} AS holds, {start} AS start
                        FROM documents
                        WHERE {condition} AND branch = ANY($6::text[]) AND {where}
                          AND (chunk_level = 'file' OR symbol_kind = 'section'
                               OR (symbol_kind IS DISTINCT FROM 'docstring' AND ({holds_line} OR {named})))
                        ORDER BY length(file_path) * $3, file_path, {named} AND {holds_line} DESC, {named} DESC,
                                 {holds_line} DESC, CASE WHEN {holds_line} THEN {end} - {start} END,
                                 abs({start} - $4), chunk_level = 'file' DESC, {start} NULLS FIRST, id
                        LIMIT $2""",
                    asked,
                    limit,
                    longest,
                    line,
                    name,
                    list(scope.branches),
                    *parameters,
                )
                one_file = names_one
                if rows:
                    break
        pointed = pointed_into(
            [FileChunk(r["id"], r["symbol_fqn"], r["file_path"], r["named"], r["holds"], r["start"]) for r in rows],
            line,
            # A path stored ones end with may be any of them, unless a line or a function points into one.
            one_file=one_file or line is not None or name is not None,
        )
        return Definitions(
            {chunk.id: chunk.symbol_fqn for chunk in pointed},
            snapshot.version,
            found_by=FILE,
            distances={chunk.id: place for place, chunk in enumerate(pointed)},
        )

    async def callers(self, scope: Scope, name: str, limit: int, named_on_main: bool = False) -> Definitions:
        # The chunks whose calls name one of the symbols, through documents_calls (infra/migrations/0017), whose
        # predicate the statement repeats.
        return await self._calls(
            scope,
            name,
            limit,
            "",
            "metadata ? 'calls' AND metadata -> 'calls' ?| ARRAY(SELECT symbol_fqn FROM named_symbols)",
            "caller",
            named_on_main,
        )

    async def callees(self, scope: Scope, name: str, limit: int) -> Definitions:
        # The classes and functions the symbols' calls name, through documents_symbol_name_folded (0036).
        return await self._calls(
            scope,
            name,
            limit,
            """, called AS (
                SELECT DISTINCT jsonb_array_elements_text(calls) AS fqn FROM named_symbols WHERE calls IS NOT NULL)""",
            # And the module assigning a name called (`concat = "".join`), through documents_defines (0028): a
            # review's "what does joined call" found nothing where its calls held the name. A module's alone: a
            # Java class's field named as a method it has (`packageName`) made the class a callee (a retest's).
            f"""(({SYMBOL_NAME_SQL} = ANY(ARRAY(SELECT {folded_sql("regexp_replace(fqn, '^.*[.]', '')")} FROM called))
                  AND symbol_fqn IN (SELECT fqn FROM called) AND chunk_level IN ('type', 'method'))
                 OR (chunk_level = 'file' AND metadata ? 'defines'
                     AND metadata -> 'defines' ?| ARRAY(SELECT regexp_replace(fqn, '^.*[.]', '') FROM called)
                     AND EXISTS (SELECT FROM called
                                 WHERE fqn = documents.symbol_fqn || '.' || regexp_replace(fqn, '^.*[.]', '')
                                   AND documents.metadata -> 'defines' ? regexp_replace(fqn, '^.*[.]', ''))))""",
            "callee",
        )

    async def _calls(
        self,
        scope: Scope,
        name: str,
        limit: int,
        more_ctes: str,
        condition: str,
        found_by: str,
        named_on_main: bool = False,
    ) -> Definitions:
        """The chunks of the scope meeting ``condition``, given ``named_symbols``: the symbols ``name`` names (the
        qualified name, its calls), looked up across the branch (``named_on_main``: on main alone) (a filter
        selects the answer, not the symbol it is about) and matched as definitions match them, ignoring case only
        when nothing matches as written."""
        async with self._snapshots.read(scope, alone=True) as snapshot:  # beside the retrievers, as definitions
            named_in, hidden = (
                (Scope(scope.workspace, MAIN_BRANCH), []) if named_on_main else (scope.unfiltered, snapshot.shadowed)
            )
            anywhere, anywhere_parameters = where_clause(named_in, 4, hidden)
            where, parameters = where_clause(scope, 4 + len(anywhere_parameters), snapshot.shadowed)
            # A name a chunk assigns at its level (jinja2's `concat = "".join`) is a symbol too, matched as
            # written, as definitions match it: an agent tester's "what calls concat" took the class Concat,
            # which matched only ignoring case, and answered its callers at 1.0; jinja2.utils.concat found none.
            # A dotted name that is a symbol's whole name, as written or ignoring case alone, names it alone
            # (names.qualities_kept: a review's faststream.types also named faststream._internal.types here).
            rows = await snapshot.conn.fetch(
                f"""WITH matched AS (
                        SELECT DISTINCT symbol_fqn, metadata -> 'calls' AS calls,
                               symbol_fqn = $2 OR right(symbol_fqn, length($2) + 1) = '.' || $2
                                   OR {PUBLISHED_SQL} = $2 AS as_written,
                               symbol_fqn = $2 AS whole, {folded_sql("symbol_fqn")} = {folded_sql("$2")} AS whole_folded
                        FROM documents
                        WHERE {SYMBOL_NAME_SQL} = {folded_sql("$1")}
                          AND {NAMES_SQL} AND chunk_level IS DISTINCT FROM 'doc' AND {anywhere}
                        UNION
                        SELECT named, NULL, true, named = $2, {folded_sql("named")} = {folded_sql("$2")}
                        FROM (SELECT symbol_fqn || '.' || $1 AS named FROM documents
                              WHERE metadata ? 'defines' AND metadata -> 'defines' ? $1 AND symbol_fqn IS NOT NULL
                                AND chunk_level IS DISTINCT FROM 'doc' AND {anywhere}) assigned
                        WHERE named = $2 OR right(named, length($2) + 1) = '.' || $2
                              OR regexp_replace(named, '{PRIVATE_PART}', '', 'g') = $2),
                    named_symbols AS (
                        SELECT symbol_fqn, calls FROM matched
                        WHERE CASE
                            WHEN {_DOTTED_SQL} AND EXISTS (SELECT FROM matched WHERE whole) THEN whole
                            WHEN {_DOTTED_SQL} AND NOT EXISTS (SELECT FROM matched WHERE as_written)
                                 AND EXISTS (SELECT FROM matched WHERE whole_folded) THEN whole_folded
                            ELSE as_written OR NOT EXISTS (SELECT FROM matched WHERE as_written) END){more_ctes}
                    SELECT id, symbol_fqn, chunk_level,
                           ARRAY(SELECT DISTINCT symbol_fqn FROM named_symbols ORDER BY 1 LIMIT {NAMED_LISTED + 1})
                               AS named
                    FROM documents
                    WHERE {condition} AND chunk_level IS DISTINCT FROM 'doc' AND {where}
                    ORDER BY chunk_level = 'file', symbol_fqn, id
                    LIMIT $3""",
                last_part(name),
                name,
                limit,
                *anywhere_parameters,
                *parameters,
            )
        modules = frozenset(r["id"] for r in rows if r["chunk_level"] == "file")
        named = tuple(rows[0]["named"]) if rows else ()
        return Definitions(
            {r["id"]: r["symbol_fqn"] for r in rows}, snapshot.version, modules, found_by=found_by, named=named
        )

    async def branch_states(self, workspace: str, branches: Sequence[str]) -> BranchStates:
        """The version row of each of the workspace's ``branches`` that has one, and the model and dimension of the
        vectors its database holds (the deployment row), read in one snapshot."""
        async with self._snapshots.read(Scope(workspace, MAIN_BRANCH)) as snapshot:
            rows = await snapshot.conn.fetch(
                "SELECT v.branch, v.state_hash, v.stream_seq, v.doc_count, v.updated_at,"
                f" CASE WHEN v.branch = {MAIN_SQL} THEN 0 ELSE (SELECT count(*) FROM documents d"
                "  WHERE d.workspace = $1 AND d.branch = v.branch AND d.deleted AND NOT d.transparent"
                # What it hides: main's live documents of its tombstones' ids (an auditor's branch said 7 hidden
                # where 2 of its tombstones named ids main never indexed: their deltas were dead-lettered).
                f"  AND EXISTS (SELECT 1 FROM documents m WHERE m.workspace = $1 AND m.branch = {MAIN_SQL}"
                "  AND m.id = d.id AND NOT m.deleted)) END AS hidden"
                " FROM ontology_versions v WHERE v.workspace = $1 AND v.branch = ANY($2::text[])",
                workspace,
                list(branches),
            )
            # The branches with rows of their own, the latest changed first: by name, a hundred merged branches
            # named before a live one hid it, and a branch deleted (every row transparent) stayed named for good
            # (an agent tester's). Each test is a probe of a partial index of branch rows (migration 0035).
            own = " WHERE {0}.workspace = $1 AND {0}.branch = v.branch AND {0}.branch <> {1} AND NOT {0}.transparent"
            others = await snapshot.conn.fetch(
                "SELECT v.branch FROM ontology_versions v WHERE v.workspace = $1 AND NOT v.branch = ANY($2::text[])"
                f" AND (EXISTS (SELECT 1 FROM documents d{own.format('d', MAIN_SQL)})"
                f"      OR EXISTS (SELECT 1 FROM ontology_nodes n{own.format('n', MAIN_SQL)})"
                f"      OR EXISTS (SELECT 1 FROM ontology_links l{own.format('l', MAIN_SQL)}))"
                " ORDER BY v.updated_at DESC, v.branch LIMIT $3",
                workspace,
                list(branches),
                MAX_OTHER_BRANCHES + 1,  # one more: whether there are more is said
            )
            deployment = await snapshot.conn.fetchrow("SELECT embedding_model, embedding_dim FROM deployment")
        assert deployment is not None  # the first migration writes it
        states = {
            r["branch"]: BranchState(
                format_version(r["state_hash"], r["stream_seq"]), r["doc_count"], r["updated_at"], r["hidden"]
            )
            for r in rows
        }
        return BranchStates(
            states, deployment["embedding_model"], deployment["embedding_dim"], [r["branch"] for r in others]
        )

    async def graph_rows(self, workspace: str, branch: str) -> GraphRows:
        """Every node and link row of main and the branch, for the in-memory graph (overlaid in Python). Read
        alone, not in the answer's session: a relation question loads it beside the retrievers, and a read that
        opened the session's snapshot there would hold its lock while they read alone (a rebuild's swap queued
        behind it would hold them up); the graph is kept per version, so this is rarely read."""
        scope = Scope(workspace, branch)
        async with self._snapshots.read(scope, alone=True) as snapshot:
            conn, branches = snapshot.conn, scope.branches
            nodes = await conn.fetch(
                "SELECT branch, object_type, kind, interfaces, deleted, transparent FROM ontology_nodes"
                " WHERE workspace = $1 AND branch = ANY($2::text[])",
                workspace,
                branches,
            )
            links = await conn.fetch(
                "SELECT branch, source_type, link_name, target_type, deleted, transparent FROM ontology_links"
                " WHERE workspace = $1 AND branch = ANY($2::text[])",
                workspace,
                branches,
            )
            whole: list[asyncpg.Record] = []
            if not scope.on_main:  # the modules of the files it holds whole: whose graph it holds whole too
                held = await _files_held(conn, workspace, await _branch_rows(conn, workspace, branch))
                whole = await conn.fetch(
                    "SELECT DISTINCT symbol_fqn FROM documents WHERE workspace = $1 AND branch = ANY($2::text[])"
                    " AND symbol_kind = 'module' AND file_path = ANY($3::text[]) AND symbol_fqn IS NOT NULL",
                    workspace,
                    branches,
                    held,
                )
        return GraphRows(
            nodes=[
                NodeRow(r["branch"], r["object_type"], r["kind"], tuple(r["interfaces"] or ()), r["deleted"],
                        r["transparent"])
                for r in nodes
            ],
            links=[
                LinkRow(r["branch"], r["source_type"], r["link_name"], r["target_type"], r["deleted"],
                        r["transparent"])
                for r in links
            ],
            version=snapshot.version,
            whole_modules=frozenset(r["symbol_fqn"] for r in whole),
        )  # fmt: skip

    async def visible(self, scope: Scope, ids: Sequence[str]) -> Visible:
        """Which of ``ids`` are live and visible in the scope, on which branch and with which content: what another
        index's hits are checked against, so only the text shown here is ever answered from there."""
        async with self._snapshots.read(scope, alone=True) as snapshot:  # beside the embedding, as keyword search
            where, parameters = where_clause(scope, 2, snapshot.shadowed)
            rows = await snapshot.conn.fetch(
                f"SELECT id, branch, {CONTENT_MD5_SQL} AS content_md5 FROM documents"
                f" WHERE {where} AND id = ANY($1::text[])",
                list(ids),
                *parameters,
            )
        found = {(r["id"], r["branch"]): r["content_md5"] for r in rows}
        return Visible(found, snapshot.version, snapshot.stream_seqs)

    async def shadowed(self, scope: Scope) -> tuple[list[str], str]:
        """Main's ids the scope's branch hides (none on main), and the version of the snapshot that says so."""
        async with self._snapshots.read(scope, alone=True) as snapshot:  # beside the embedding, as keyword search
            return snapshot.shadowed, snapshot.version


async def _shadowed_ids(conn: Connection, workspace: str, branch: str) -> list[str]:
    """Main's ids the branch hides: its rows' ids, main's rows with the symbol key of one of its rows, and main's
    rows of a file the branch holds whole (:func:`_files_held`), so that main's later changes to that file (moved
    lines, new chunks, the file deleted) do not show through on the branch. Documents without the mark (another
    producer's, or sent before it existed) hide by id and symbol key only."""
    rows = await _branch_rows(conn, workspace, branch)
    ids = [r["id"] for r in rows]
    keys = [r["symbol_key"] for r in rows if r["symbol_key"] is not None]
    found = await conn.fetch(
        f"""
        SELECT id FROM documents WHERE workspace = $1 AND branch = {MAIN_SQL} AND id = ANY($2::text[])
        UNION SELECT id FROM documents WHERE workspace = $1 AND branch = {MAIN_SQL} AND symbol_key = ANY($3::text[])
        UNION SELECT id FROM documents WHERE workspace = $1 AND branch = {MAIN_SQL} AND file_path = ANY($4::text[])""",
        workspace,
        ids,
        keys,
        await _files_held(conn, workspace, rows),
    )
    return sorted(r["id"] for r in found)


async def _branch_rows(conn: Connection, workspace: str, branch: str) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT id, symbol_key, file_path, deleted, metadata @> '{\"wholeFile\": true}' AS whole_file FROM documents"
        " WHERE workspace = $1 AND branch = $2 AND NOT transparent",
        workspace,
        branch,
    )


async def _files_held(conn: Connection, workspace: str, rows: Sequence[asyncpg.Record]) -> list[str]:
    """The files a branch (its ``rows``: :func:`_branch_rows`) holds whole: of a document of its marked
    ``wholeFile`` (the reference ingester sends every document of a file a branch changes: ``plan_ingest``), or
    deleted (a tombstone naming it ``deletedFile``, or the module's chunk tombstoned). A tombstone's row holds a
    file only when it names one."""
    files = {r["file_path"] for r in rows if r["file_path"] is not None and (r["whole_file"] or r["deleted"])}
    # A file the branch deleted: its module's chunk (one per Python file) tombstoned.
    deleted = await conn.fetch(
        f"SELECT file_path FROM documents WHERE workspace = $1 AND branch = {MAIN_SQL} AND id = ANY($2::text[])"
        " AND symbol_kind = 'module' AND file_path IS NOT NULL",
        workspace,
        [r["id"] for r in rows if r["deleted"]],
    )
    return sorted(files | {r["file_path"] for r in deleted})


REFUSALS_WAIT_S = 2.0
"""How long the read of the refused consumers waits for a database: past it, that database's are not known."""


async def refused_consumers(pools: Sequence[asyncpg.Pool]) -> frozenset[str] | None:
    """The durable consumers whose projector refuses the delta stream as not the one its index read, as the
    databases' claim rows say (services/projector/following.py): a refusal stands there until an operator adopts
    the stream, whether or not a projector is running. None when a database does not answer in time (a review:
    read as none refused, a pool busy for 2 s said the index followed)."""

    async def read(pool: asyncpg.Pool) -> list[str] | None:
        try:
            async with asyncio.timeout(REFUSALS_WAIT_S), pool.acquire() as conn:
                rows = await conn.fetch("SELECT durable FROM projection_fences WHERE refused IS NOT NULL")
        except Exception as error:  # a database away, or busy: the next look asks again
            log.warning("refusals_unread", error=describe(error))
            return None
        return [str(row["durable"]) for row in rows]

    read_each = await asyncio.gather(*map(read, pools))
    if any(durables is None for durables in read_each):
        return None
    return frozenset(durable for durables in read_each if durables is not None for durable in durables)
