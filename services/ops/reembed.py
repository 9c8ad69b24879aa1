"""Change the embedding model, and its dimension, without downtime (``ontofabric reembed``).

1. **Columns.** Beside each document's vector, token signs and model, their next ones: ``embedding_next`` (of the
   next model's dimension), ``token_signs_next``, ``embedding_model_next``, and ``embedded_seq_next``, the stream
   sequence of the row they were made from. Adding them changes the catalog only: no row is rewritten.
2. **Fill.** Every live document with a vector is embedded again by the next model, from the text the ingester
   embedded (:func:`~ontofabric.shared.embedder.embedding_text`), in rounds: a row the projector rewrote meanwhile
   (its stream sequence moved on) is embedded again in the next round. Query workers answer with the current model
   all along, and projectors keep writing it. Each update is a new row version (the old vectors stay in it until
   VACUUM): the table needs about the room of its vectors again, and a VACUUM after the change.
3. **Index.** An HNSW index on the new vectors, built partition by partition without holding off writes.
4. **Swap.** One transaction holds off the live projectors (the versions table, as a rebuild's swap does), embeds
   what the last round left, checks that every live vector has its next one, renames the next columns over the
   current ones (queries wait for that lock only), records the new model in the deployment row and raises every
   version's revision. After the commit the revisions are announced, so that caches drop what the old model
   ranked, and the old columns are dropped.

Workers set up with both models (``ONTOFABRIC_NEXT_EMBEDDING_*``) follow the swap on their own: a projector's batch
reads the index's model inside its transaction and embeds again what an ingester still sends by the old model
(services/projector/reembedding.py); a query worker reads it with every snapshot and embeds queries by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg
from pgvector.asyncpg import register_vector
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from ontofabric.services.projector.versions import VersionPublisher, announce_records
from ontofabric.shared.db import PLANNED_WITH_VALUES, migrations
from ontofabric.shared.discovery import discover
from ontofabric.shared.embedder import Embedder, EmbedderMismatch, ModelMissing, embedding_text, load_embedder
from ontofabric.shared.jetstream import close as close_nats
from ontofabric.shared.jetstream import connect
from ontofabric.shared.late_interaction import pack_signs
from ontofabric.shared.logging import get_logger
from ontofabric.shared.progress import Progress
from ontofabric.shared.settings import Settings, redacted_url
from ontofabric.shared.subjects import Names
from ontofabric.shared.tasks import still_wanted
from ontofabric.shared.telemetry import tracer

from .rebuild import pace_delay, paced_batch_size, replay_rate, running_rebuilds
from .shadow import lock_exclusively

log = get_logger(__name__)

NEXT_EMBEDDING = "embedding_next"
"""The column of the next model's vectors while a change is under way."""
SWAPPED = (
    ("embedding", NEXT_EMBEDDING),
    ("token_signs", "token_signs_next"),
    ("embedding_model", "embedding_model_next"),
)
"""Each live column and the one that replaces it at the swap."""
EMBEDDED_SEQ = "embedded_seq_next"
NEXT_INDEX = "documents_embedding_next_hnsw"
LIVE_INDEX = "documents_embedding_hnsw"

CHANGE_LOCK = "ontofabric.reembed"
"""The session advisory lock a model change holds on a database for its whole run: one change at a time."""

FILL_ROUNDS = 5
"""Passes over what the projectors rewrote during the previous one, at most: what is left goes into the swap."""

_STALE = (
    "NOT deleted AND embedding IS NOT NULL"
    f" AND ({NEXT_EMBEDDING} IS NULL OR {EMBEDDED_SEQ} IS DISTINCT FROM stream_seq)"
)
"""The live documents whose next vector is missing or was made from an older version of the row."""

_LEFTOVERS = [*(following for _, following in SWAPPED), EMBEDDED_SEQ, *(f"{live}_retired" for live, _ in SWAPPED)]
"""Every column a change adds or retires: none is left once it has finished or been discarded."""

_STALE_ROWS = f"""
SELECT workspace, branch, id, content, symbol_fqn, stream_seq, token_signs IS NOT NULL AS had_signs
  FROM public.documents
 WHERE {_STALE} AND (workspace, branch, id) > ($1, $2, $3)
 ORDER BY workspace, branch, id LIMIT $4
"""

# Only the row version that was read: one the projector rewrote since keeps its staleness for the next round.
_VERSIONS = "SELECT workspace, branch, state_hash, stream_seq, revision FROM public.ontology_versions"

_WRITE_NEXT = f"""
UPDATE public.documents
   SET {NEXT_EMBEDDING} = $5, token_signs_next = $6, embedding_model_next = $7, {EMBEDDED_SEQ} = $4
 WHERE workspace = $1 AND branch = $2 AND id = $3 AND stream_seq = $4
"""


class ChangeRefused(Exception):
    """The model change cannot start or swap as things are; the live index is unchanged."""


@dataclass
class ModelChangeReport:
    database: str
    previous_model: str
    model: str
    embedded: int = 0
    """Documents embedded by the next model, counting those embedded again after the projector rewrote them."""
    rounds: int = 0
    swapped: bool = False
    already: bool = False
    """The database held the next model already (an earlier run swapped)."""
    fill_s: float = 0.0
    index_s: float = 0.0
    swap_lock_s: float = 0.0
    """How long the swap held off the live projectors."""
    versions: int = 0
    """Versions announced again after the swap."""


class ModelChange:
    def __init__(
        self,
        settings: Settings,
        nats_url: str,
        database_url: str,
        progress: Progress,
        *,
        lock_timeout_s: float = 10.0,
        max_rate: float | None = None,
        batch_size: int = 64,
        force: bool = False,
    ) -> None:
        if lock_timeout_s <= 0:
            raise ValueError("lock_timeout_s must be positive")
        self._settings = settings
        self._following = settings.next_model()
        self._nats_url = nats_url
        self._database_url = database_url
        self._progress = progress
        self._lock_timeout_s = lock_timeout_s
        self._max_rate = replay_rate(max_rate)
        self._batch_size = batch_size
        self._force = force
        self._embedder: Embedder | None = None
        self._signs_for_all = False
        """Every document gets token signs by the next model, not only those that had them: the index holds none,
        since the current model made none (a model whose tokens are wider than its vectors)."""

    @property
    def _next(self) -> Settings:
        if self._following is None:
            raise ChangeRefused(
                "no next model is set: set ONTOFABRIC_NEXT_EMBEDDING_MODEL, _DIM and _MODEL_PATH here and on every "
                "projector and query worker first (docs/reliability.md)"
            )
        return self._following

    async def run(self) -> ModelChangeReport:
        following = self._next  # refused here, before connecting to anything, when no next model is set
        with tracer().start_as_current_span("ops.reembed") as span:
            span.set_attribute("model", following.embedding_model)
            async with self._connection() as conn:
                return await self._run(conn)

    async def discard(self) -> bool:
        """Drop an unfinished change's columns and index, and whatever a finished one left; the live index is
        untouched. Needs no next model. False when there was nothing to drop."""
        async with self._connection() as conn:
            existed = await _column_type(conn, NEXT_EMBEDDING) is not None
            await self._drop_columns(conn, _LEFTOVERS)
            await conn.execute("UPDATE deployment SET next_embedding_model = NULL, next_embedding_dim = NULL")
            return existed

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[asyncpg.Connection]:
        # It writes every document's next vector by one statement, run for each (shared/db.py).
        conn = await asyncpg.connect(self._database_url, server_settings=PLANNED_WITH_VALUES)
        try:
            await register_vector(conn)
            if not await conn.fetchval("SELECT pg_try_advisory_lock(hashtext($1))", CHANGE_LOCK):
                raise ChangeRefused(f"another model change runs on {redacted_url(self._database_url)}")
            yield conn
        finally:
            await conn.close()

    async def _run(self, conn: asyncpg.Connection) -> ModelChangeReport:
        held, planned = await self._check(conn)
        report = ModelChangeReport(redacted_url(self._database_url), held, self._next.embedding_model)
        if held == self._next.embedding_model:  # swapped by an earlier run, which may have stopped before the end
            report.already = True
            await self._drop_columns(conn, [f"{live}_retired" for live, _ in SWAPPED] + [EMBEDDED_SEQ])
            report.versions = await self._announce(await conn.fetch(_VERSIONS))
            return report
        if planned is None:  # no change under way: whatever columns an earlier one left are stale
            await self._drop_columns(conn, _LEFTOVERS)
        await self._check_workers()
        await self._model()  # before anything is written: a model that cannot load leaves no change half begun
        await self._add_columns(conn)
        # Without this, changing back from a model that made no token signs left late interaction off for good.
        self._signs_for_all = self._settings.token_vectors and not await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM public.documents WHERE NOT deleted AND token_signs IS NOT NULL)"
        )
        started = time.perf_counter()
        for _ in range(FILL_ROUNDS):  # until what the projectors rewrote meanwhile is little enough for the swap
            report.rounds += 1
            embedded = await self._embed_stale(conn, f"embed (round {report.rounds})")
            report.embedded += embedded
            if embedded < self._batch_size:
                break
        report.fill_s = time.perf_counter() - started
        started = time.perf_counter()
        await self._build_index(conn)
        report.index_s = time.perf_counter() - started
        report.embedded += await self._embed_stale(conn, "catch up")
        await self._check_workers()
        still_wanted()  # an interrupt nats-py lost on the way here does not swap
        await self._swap(conn, report)
        report.swapped = True
        try:  # after the commit; else the next run drops them
            await self._drop_columns(conn, [f"{live}_retired" for live, _ in SWAPPED] + [EMBEDDED_SEQ])
        except (ChangeRefused, asyncpg.PostgresError) as error:
            log.warning("model_change_retired_not_dropped", error=str(error))
        log.info(
            "model_changed",
            database=report.database,
            previous=held,
            model=report.model,
            embedded=report.embedded,
            rounds=report.rounds,
            lock_ms=round(report.swap_lock_s * 1000, 1),
        )
        return report

    async def _check(self, conn: asyncpg.Connection) -> tuple[str, str | None]:
        """The model the index holds, which must be this command's current or next one, and the one a change under
        way moves to (None: none is)."""
        if await conn.fetchval("SELECT to_regclass('public.schema_migrations')") is None:
            raise ChangeRefused("the database holds no ontofabric index")
        live = await conn.fetchval("SELECT max(version) FROM public.schema_migrations")
        if live != migrations()[-1].version:
            raise ChangeRefused(f"the database is at migration {live}: run `ontofabric migrate` first")
        row = await conn.fetchrow("SELECT embedding_model, next_embedding_model FROM deployment")
        if row is None:
            raise ChangeRefused("the database holds no ontofabric index")
        held = str(row["embedding_model"])
        if held not in (self._settings.embedding_model, self._next.embedding_model):
            raise ChangeRefused(
                f"the index holds {held} vectors, neither ONTOFABRIC_EMBEDDING_MODEL nor the next model: check the "
                "settings"
            )
        planned = row["next_embedding_model"]
        started = await _column_type(conn, NEXT_EMBEDDING)
        wanted = f"vector({self._next.embedding_dim})"
        if held != self._next.embedding_model and (
            (planned is not None and planned != self._next.embedding_model) or started not in (None, wanted)
        ):
            raise ChangeRefused(
                f"an earlier change to {planned} ({started}) did not finish: `ontofabric reembed --discard` drops it"
            )
        if await running_rebuilds(conn):
            raise ChangeRefused("a rebuild is running: change the model when it has finished")
        shadows = await conn.fetchval(
            "SELECT count(*) FROM pg_namespace"
            " WHERE nspname LIKE 'ontofabric\\_rebuild\\_%' AND nspname NOT LIKE '%\\_retired'"
        )
        if shadows:
            raise ChangeRefused(
                f"{shadows} interrupted rebuilds left their shadow tables, built for the current model: resume them "
                "(`ontofabric rebuild W`) or drop them (`--discard`) first"
            )
        return held, planned

    async def _check_workers(self) -> None:
        """Every running projector and query worker must be able to serve the next model (each says which models it
        has when discovered), or after the swap a query worker would answer without dense search and a projector
        would hold its batches until restarted. Unless ``force``."""
        names = Names(self._settings.subject_prefix)
        nc = await connect(self._nats_url, "ontofabric-reembed", self._settings)
        try:
            projectors = [
                w for w in await discover(nc, names.projector_service) if w.details.get("index") == "postgres"
            ]
            workers = [*projectors, *await discover(nc, names.query_service)]
        finally:
            await close_nats(nc)
        # A query worker without an embedder answers by keywords whatever the model; a projector without one could
        # not embed again what an ingester still sends by the old model.
        workers = [w for w in workers if w in projectors or w.details.get("models")]
        lacking = [w for w in workers if self._next.embedding_model not in w.details.get("models", "").split(",")]
        if lacking and not self._force:
            listed = ", ".join(f"{w.host}:{w.pid} ({w.details.get('models') or 'no embedder'})" for w in lacking)
            raise ChangeRefused(
                f"{len(lacking)} running workers cannot serve {self._next.embedding_model}: {listed}; restart them "
                "with ONTOFABRIC_NEXT_EMBEDDING_* set (the vectors made so far are kept), or --force"
            )

    async def _exclusively(self, conn: asyncpg.Connection) -> None:
        """Inside a transaction: the whole documents table (every partition) for a catalog change. Autovacuum first
        (a lock that waits for it past deadlock_timeout cancels it; the exclusive lock's short tries would not),
        then the exclusive lock in short tries that give way to queries."""
        await conn.execute(f"SET LOCAL lock_timeout = '{int(self._lock_timeout_s * 1000)}ms'")
        await conn.execute("LOCK TABLE public.documents IN SHARE UPDATE EXCLUSIVE MODE")
        await lock_exclusively(conn, ["public.documents"], self._lock_timeout_s)

    async def _drop_columns(self, conn: asyncpg.Connection, columns: list[str]) -> None:
        present = [column for column in columns if await _column_type(conn, column) is not None]
        if not present:
            return
        try:
            async with conn.transaction():
                await self._exclusively(conn)
                await conn.execute(
                    "ALTER TABLE public.documents " + ", ".join(f"DROP COLUMN {column}" for column in present)
                )
        except (asyncpg.LockNotAvailableError, asyncpg.DeadlockDetectedError) as error:
            raise ChangeRefused(
                f"could not drop {', '.join(present)}: the table stayed busy ({error}); run again"
            ) from error

    async def _add_columns(self, conn: asyncpg.Connection) -> None:
        async with conn.transaction():
            await self._exclusively(conn)
            await conn.execute(
                f"ALTER TABLE public.documents"
                f" ADD COLUMN IF NOT EXISTS {NEXT_EMBEDDING} vector({self._next.embedding_dim}),"
                " ADD COLUMN IF NOT EXISTS token_signs_next bytea,"
                " ADD COLUMN IF NOT EXISTS embedding_model_next text,"
                f" ADD COLUMN IF NOT EXISTS {EMBEDDED_SEQ} bigint,"
                # In the row, as migration 0007 keeps the live vectors: the planner does not count reads from TOAST.
                f" ALTER COLUMN {NEXT_EMBEDDING} SET STORAGE MAIN"
            )
            await conn.execute(
                "UPDATE deployment SET next_embedding_model = $1, next_embedding_dim = $2",
                self._next.embedding_model,
                self._next.embedding_dim,
            )

    async def _model(self) -> Embedder:
        if self._embedder is None:
            try:
                self._embedder = await asyncio.to_thread(load_embedder, self._next, False)  # documents only
            except (EmbedderMismatch, ModelMissing, OSError, ValueError) as error:
                # A model tester's: a traceback naming the live dimension's setting, and the change left begun.
                said = str(error).replace("(ONTOFABRIC_EMBEDDING_DIM)", "(ONTOFABRIC_NEXT_EMBEDDING_DIM)")
                raise ChangeRefused(
                    f"the next model cannot be loaded: {said} (ONTOFABRIC_NEXT_EMBEDDING_MODEL_PATH must hold a "
                    "sentence-transformers model with its weights, ONTOFABRIC_NEXT_EMBEDDING_DIM its dimension); "
                    "nothing was changed"
                ) from error
        return self._embedder

    def _signed(self, had_signs: bool, token_width: int, embedder: Embedder) -> bool:
        """Whether a document's next vector comes with token signs: where it had them (an ingester sends them unless
        told not to) or the index holds none, and where the next model's tokens are as wide as its vectors."""
        return (had_signs or self._signs_for_all) and token_width == embedder.dimension

    async def _embed_stale(self, conn: asyncpg.Connection, stage: str, *, held: bool = False) -> int:
        """Embed every stale live document by the next model, in batches; returns how many. ``held``: inside the
        swap, holding the projectors off, so neither counted first nor paced, and in one transaction."""
        embedder = await self._model()
        total = 0 if held else await conn.fetchval(f"SELECT count(*) FROM public.documents WHERE {_STALE}")
        self._progress.stage(stage, total)
        after, done, started = ("", "", ""), 0, time.perf_counter()
        size = self._batch_size if held else paced_batch_size(self._batch_size, self._max_rate)
        while rows := await conn.fetch(_STALE_ROWS, *after, size):
            texts = [embedding_text(r["content"], r["symbol_fqn"]) for r in rows]
            vectors, tokens = await asyncio.to_thread(embedder.embed_with_tokens, texts)
            writes = [
                (
                    r["workspace"], r["branch"], r["id"], r["stream_seq"], vector,
                    pack_signs(signs) if self._signed(r["had_signs"], signs.shape[1], embedder) else None,
                    embedder.model_name,
                )
                for r, vector, signs in zip(rows, vectors, tokens, strict=True)
            ]  # fmt: skip
            if held:  # no writer but this one
                await conn.executemany(_WRITE_NEXT, writes)
            else:
                async for attempt in AsyncRetrying(  # a projector's batch may hold some rows, in another order
                    retry=retry_if_exception_type((asyncpg.DeadlockDetectedError, asyncpg.SerializationError)),
                    stop=stop_after_attempt(5),
                    wait=wait_exponential(multiplier=0.1, max=2.0),
                    reraise=True,
                ):
                    with attempt:
                        await conn.executemany(_WRITE_NEXT, writes)
            after = (rows[-1]["workspace"], rows[-1]["branch"], rows[-1]["id"])
            done += len(rows)
            self._progress.advance(stage, len(rows))
            if not held:
                await asyncio.sleep(pace_delay(done, time.perf_counter() - started, self._max_rate))
        return done

    async def _build_index(self, conn: asyncpg.Connection) -> None:
        """HNSW over the next vectors: the parent's index first (partitions created from now on get theirs with
        it), then each partition's, built concurrently with writes and attached to it. Each partition's is named
        for the model, so a later change's never meets this one's."""
        token = hashlib.md5(self._next.embedding_model.encode(), usedforsecurity=False).hexdigest()[:8]
        await conn.execute(f"SET lock_timeout = '{int(self._lock_timeout_s * 1000)}ms'")  # the DDL's locks
        await conn.execute(
            f"CREATE INDEX IF NOT EXISTS {NEXT_INDEX} ON ONLY public.documents"
            f" USING hnsw ({NEXT_EMBEDDING} vector_cosine_ops)"
        )
        partitions = [
            r["relname"]
            for r in await conn.fetch(
                "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
                " WHERE i.inhparent = 'public.documents'::regclass ORDER BY 1"
            )
        ]
        self._progress.stage("index", len(partitions))
        for partition in partitions:
            index = await conn.fetchval(
                "SELECT i.indexrelid::regclass::text FROM pg_index i"
                " JOIN pg_inherits h ON h.inhrelid = i.indexrelid AND h.inhparent = $1::regclass"
                " WHERE i.indrelid = $2::regclass",
                f"public.{NEXT_INDEX}",
                f'public."{partition}"',
            )
            if index is None:
                name = f"{partition}_{token}_hnsw"
                # One an interrupted run left unattached is built again (it may be invalid, half built).
                await conn.execute(f'DROP INDEX CONCURRENTLY IF EXISTS public."{name}"')
                await conn.execute(
                    f'CREATE INDEX CONCURRENTLY "{name}" ON public."{partition}"'
                    f" USING hnsw ({NEXT_EMBEDDING} vector_cosine_ops)"
                )
                await conn.execute(f'ALTER INDEX public.{NEXT_INDEX} ATTACH PARTITION public."{name}"')
            self._progress.advance("index", 1)
        await conn.execute("RESET lock_timeout")

    async def _swap(self, conn: asyncpg.Connection, report: ModelChangeReport) -> None:
        asked = time.perf_counter()
        try:
            async with conn.transaction():
                await conn.execute(f"SET LOCAL lock_timeout = '{int(self._lock_timeout_s * 1000)}ms'")
                # Live projectors write the versions table first in every batch: they wait here until the commit,
                # then read the new model. Readers are not held off by this lock.
                await conn.execute("LOCK TABLE public.ontology_versions IN EXCLUSIVE MODE")
                # With the projectors held off, what is read here is all there is: every stale row gets its vector.
                report.embedded += await self._embed_stale(conn, "swap", held=True)
                # A tombstone, or a row written without a vector since it was embedded, keeps no next one either.
                await conn.execute(
                    f"UPDATE public.documents SET {NEXT_EMBEDDING} = NULL, token_signs_next = NULL,"
                    " embedding_model_next = NULL"
                    f" WHERE {NEXT_EMBEDDING} IS NOT NULL AND (deleted OR embedding IS NULL)"
                )
                await self._exclusively(conn)
                for live, following in SWAPPED:
                    await conn.execute(f"ALTER TABLE public.documents RENAME COLUMN {live} TO {live}_retired")
                    await conn.execute(f"ALTER TABLE public.documents RENAME COLUMN {following} TO {live}")
                await conn.execute(f"ALTER INDEX public.{LIVE_INDEX} RENAME TO documents_embedding_retired_hnsw")
                await conn.execute(f"ALTER INDEX public.{NEXT_INDEX} RENAME TO {LIVE_INDEX}")
                await conn.execute(
                    "UPDATE deployment SET embedding_model = $1, embedding_dim = $2, next_embedding_model = NULL,"
                    " next_embedding_dim = NULL, model_changed_at = now(), previous_embedding_models ="
                    " array_append(array_remove(previous_embedding_models, $1), embedding_model)",
                    self._next.embedding_model,
                    self._next.embedding_dim,
                )
                await conn.execute("UPDATE public.ontology_versions SET revision = revision + 1, updated_at = now()")
                versions = await conn.fetch(_VERSIONS)
        except (asyncpg.LockNotAvailableError, asyncpg.DeadlockDetectedError) as error:
            raise ChangeRefused(
                f"the swap could not take its locks within {self._lock_timeout_s:g} s ({type(error).__name__}); "
                "run again (the vectors made so far are kept), or with a longer --lock-timeout"
            ) from error
        report.swap_lock_s = time.perf_counter() - asked
        report.versions = await self._announce(versions)

    async def _announce(self, versions: list[asyncpg.Record]) -> int:
        """The same versions with a higher revision: to a query worker, the index was rebuilt (its cache of the
        workspace goes). The KV keeps a newer one it already has, so announcing again is harmless."""
        names = Names(self._settings.subject_prefix)
        nc = await connect(self._nats_url, "ontofabric-reembed", self._settings)
        try:
            publisher = VersionPublisher(nc, await nc.jetstream().key_value(names.version_bucket), names)
            await announce_records(publisher, [dict(r) for r in versions])
        finally:
            await close_nats(nc)
        return len(versions)


async def _column_type(conn: asyncpg.Connection, column: str) -> str | None:
    """The type of a column of the live documents table (None: it has none of that name)."""
    found: str | None = await conn.fetchval(
        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute"
        " WHERE attrelid = 'public.documents'::regclass AND attname = $1 AND NOT attisdropped",
        column,
    )
    return found
