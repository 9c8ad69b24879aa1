"""PostgreSQL: versioned migrations from ``infra/migrations``, the connection pool, error classification."""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import resources
from typing import TypeVar

import asyncpg
from asyncpg.pool import PoolConnectionProxy
from pgvector.asyncpg import register_vector

from .jetstream import backoff_s
from .logging import describe, get_logger
from .priority import lower_session_priority
from .settings import Settings, redacted_url

log = get_logger(__name__)

_MIGRATION_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")
_MIGRATION_LOCK = 0x6F6E746F  # pg_advisory_lock key shared by every migrator


Connection = asyncpg.Connection | PoolConnectionProxy
"""A plain connection or one borrowed from a pool."""


READER_ROLE = "ontofabric_reader"
"""The role query workers read as (migration 0011): it may SELECT, and nothing else."""
WRITER_ROLE = "ontofabric_writer"
"""The role projectors write as (migration 0012): rows of every table, a workspace's partitions through
``ensure_workspace_partition``; no other DDL."""

MIGRATION_WAIT_S = 120.0
"""How long a process that may not migrate waits for one that may (a projector, ``ontofabric migrate``)."""


class DeploymentMismatch(Exception):
    """The database was built for another embedding model or dimension, or is not migrated."""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def migrations() -> list[Migration]:
    found = []
    for entry in resources.files("ontofabric.migrations").iterdir():
        match = _MIGRATION_NAME.match(entry.name)
        if match:
            found.append(Migration(int(match.group(1)), entry.name, entry.read_text(encoding="utf-8")))
    return sorted(found, key=lambda m: m.version)


def _search_path(schema: str | None) -> dict[str, str]:
    """Server settings that make ``schema`` shadow ``public``: unqualified tables and functions are found (and
    created) there first, while the extension's types stay in ``public``. None keeps the server's default."""
    return {} if schema is None else {"search_path": f'"{schema}", public'}


MIN_SERVER_VERSION = 180000
"""PostgreSQL 18: migration 0036 indexes names by its casefold(), which 17 lacks."""


class UnsupportedServer(RuntimeError):
    """A PostgreSQL server older than the migrations need."""


def unsupported_server(version_num: int) -> str | None:
    """Why a server of ``server_version_num`` cannot hold this release's schema; None when it can. Said before any
    migration runs (a review's: on PostgreSQL 17 migration 0036 would fail with "function casefold does not
    exist")."""
    if version_num >= MIN_SERVER_VERSION:
        return None
    major = version_num // 10000
    return f"PostgreSQL {MIN_SERVER_VERSION // 10000} or later is needed; this server is PostgreSQL {major}"


async def migrate(database_url: str, settings: Settings, *, schema: str | None = None) -> list[str]:
    """Apply pending migrations (each in its own transaction) and check the deployment row. Idempotent.

    ``schema`` builds the whole schema in another namespace than ``public`` (a rebuild's shadow tables)."""
    conn = await asyncpg.connect(database_url, server_settings=_search_path(schema))
    try:
        problem = unsupported_server(int(await conn.fetchval("SHOW server_version_num")))
        if problem is not None:
            raise UnsupportedServer(problem)
        await conn.execute("SELECT pg_advisory_lock($1)", _MIGRATION_LOCK)
        try:
            if schema is not None:
                await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations ("
                " version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            applied = {r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")}
            known = migrations()
            if newer := sorted(applied - {migration.version for migration in known}):
                # Not refused: going back a release after a migration is an operator's way out of a bad upgrade,
                # and the migrations only add. But it should not pass unsaid (an upgrade tester's old release started
                # on a newer schema without a word, and its ingest later failed with a traceback).
                log.warning(
                    "database_of_a_newer_release",
                    unknown_migrations=newer,
                    latest_known=known[-1].version,
                    advice="run the newer release: this one writes rows without what its migrations added",
                )
            done: list[str] = []
            for migration in known:
                if migration.version in applied:
                    continue
                sql = migration.sql.replace("{{embedding_dim}}", str(settings.embedding_dim))
                try:
                    async with conn.transaction():
                        await conn.execute(sql)
                        await conn.execute(
                            "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)",
                            migration.version,
                            migration.name,
                        )
                except Exception as error:  # said with what stays applied: the ones before it (a review's)
                    log.error(
                        "migration_failed",
                        migration=migration.name,
                        error=f"{type(error).__name__}: {error}",
                        applied_this_run=len(done),
                        applied_in_all=len(applied) + len(done),
                        last_applied=done[-1] if done else max(applied, default=None),
                    )
                    raise
                log.info("migration_applied", migration=migration.name)
                done.append(migration.name)
            if done:  # one line for all: the log's limit per event kept 20 of a fresh database's 33 (a tester's)
                log.info("migrations_applied", count=len(done), first=done[0], last=done[-1])
            await check_deployment(conn, settings)
            return done
        finally:
            await conn.execute("SELECT pg_advisory_unlock($1)", _MIGRATION_LOCK)
    finally:
        await conn.close()


T = TypeVar("T")

DATABASE_RETRY_FIRST_S, DATABASE_RETRY_CAP_S = 0.5, 5.0
"""How often a worker starting tries its database again while it cannot serve: half a second, then twice that, ...
at most every 5 s (a server out of connection slots is not asked a hundred times a minute)."""
DATABASE_WAIT_SAID_EVERY_S = 30.0
"""How often a worker still waiting says so again: a host name mistyped looks like a database not up yet."""


def _misconfigured(error: BaseException) -> bool:
    """A failure to connect that waiting cannot mend: the URL or its TLS files are wrong (a review's: a mistyped
    scheme, ``sslmode`` or certificate path kept a worker waiting for ever)."""
    return isinstance(error, asyncpg.ClientConfigurationError | FileNotFoundError | PermissionError | ssl.SSLError)


async def once_the_database_serves(database_url: str, attempt: Callable[[], Awaitable[T]]) -> T:
    """``attempt()`` on ``database_url``, tried again while it fails because the database cannot serve now
    (:func:`is_unavailable`: away, starting up, every connection slot taken), as a worker waits for its NATS
    server; anything else (a wrong password, no such database, a URL or TLS setting that cannot work) is raised at
    once. A fault tester's: a worker or projector started while PostgreSQL refused new connections ("too many
    clients") ended with a traceback, and under a supervisor would have restarted in a loop."""
    loop = asyncio.get_running_loop()
    said, said_at, attempts = None, -DATABASE_WAIT_SAID_EVERY_S, 0
    while True:
        try:
            return await attempt()
        except Exception as error:
            if not is_unavailable(error) or _misconfigured(error):
                raise
            attempts += 1
            if describe(error) != said or loop.time() - said_at >= DATABASE_WAIT_SAID_EVERY_S:
                said, said_at = describe(error), loop.time()
                log.warning("database_not_serving", database=redacted_url(database_url), error=said, attempts=attempts)
        await asyncio.sleep(backoff_s(attempts, DATABASE_RETRY_FIRST_S, DATABASE_RETRY_CAP_S))


async def wait_until_migrated(
    database_url: str, settings: Settings, role: str = READER_ROLE, timeout_s: float = MIGRATION_WAIT_S
) -> None:
    """For a process that may not migrate: wait until the database is migrated to this build's latest migration
    and has its deployment row, then check the row, acting as ``role``. DeploymentMismatch after ``timeout_s``."""
    latest = migrations()[-1].version
    deadline = asyncio.get_running_loop().time() + timeout_s
    reason = None
    while True:
        try:
            conn = await asyncpg.connect(database_url, server_settings={"role": role})
            try:
                version = await conn.fetchval("SELECT max(version) FROM schema_migrations")
                if version is not None and version >= latest and await _deployment_row(conn) is not None:
                    await check_deployment(conn, settings, record=False)
                    return
                waiting_for = f"migration {latest} (the database is at {version})"
            finally:
                await conn.close()
        except (asyncpg.UndefinedTableError, asyncpg.InvalidSchemaNameError):
            waiting_for = f"migration {latest} (the database is not migrated)"
        except (asyncpg.InvalidParameterValueError, asyncpg.InsufficientPrivilegeError) as error:
            # The role does not exist before its migration, or the login is not granted it yet.
            waiting_for = f"the role {role} ({error})"
        if asyncio.get_running_loop().time() > deadline:
            raise DeploymentMismatch(
                f"still waiting for {waiting_for} after {timeout_s:.0f} s: start a projector or run "
                f"`ontofabric migrate`, and grant {role} to this process's login (docs/security.md)"
            )
        if waiting_for != reason:
            log.info("waiting_for_database", waiting_for=waiting_for)
            reason = waiting_for
        await asyncio.sleep(0.5)


async def _deployment_row(conn: Connection) -> asyncpg.Record | None:
    return await conn.fetchrow("SELECT embedding_model, embedding_dim, text_search_config FROM deployment")


@dataclass(frozen=True)
class IndexModel:
    """The embedding model the index's vectors were made by (the deployment row's), and those it held before."""

    model: str
    previous: tuple[str, ...] = ()


async def index_model(conn: Connection) -> IndexModel:
    row = await conn.fetchrow("SELECT embedding_model, previous_embedding_models FROM deployment")
    if row is None:
        raise DeploymentMismatch("the database has no deployment row: it is not migrated")
    return IndexModel(row["embedding_model"], tuple(row["previous_embedding_models"]))


async def check_deployment(conn: Connection, settings: Settings, *, record: bool = True) -> Settings:
    """Record the deployment's model, dimension and text search configuration on first use (unless ``record`` is
    false: a reader may not). Returns the settings of the model the index holds: ``settings``, or their next
    model's once a model change has swapped (``ontofabric reembed``). DeploymentMismatch when it is neither, or
    when the index's keyword terms were made with another text search configuration."""
    # As the statements resolve it, on the search path; recorded unknown, it failed every batch for ever, each
    # retried (a configuration tester's).
    known = await conn.fetch("SELECT cfgname FROM pg_ts_config WHERE pg_ts_config_is_visible(oid) ORDER BY cfgname")
    if settings.text_search_config not in (row["cfgname"] for row in known):
        raise DeploymentMismatch(
            f"ONTOFABRIC_TEXT_SEARCH_CONFIG: PostgreSQL has no text search configuration "
            f"{settings.text_search_config!r}; it has {', '.join(row['cfgname'] for row in known)}"
        )
    if record:
        await conn.execute(
            "INSERT INTO deployment (embedding_model, embedding_dim) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            settings.embedding_model,
            settings.embedding_dim,
        )
        await conn.execute(
            "UPDATE deployment SET text_search_config = $1 WHERE text_search_config IS NULL",
            settings.text_search_config,
        )
    row = await _deployment_row(conn)
    assert row is not None
    recorded = row["text_search_config"]
    if recorded is not None and recorded != settings.text_search_config:
        raise DeploymentMismatch(
            f"the index's keyword terms were made with the text search configuration {recorded}, but this process "
            f"is set up for {settings.text_search_config}: fix ONTOFABRIC_TEXT_SEARCH_CONFIG (every part the same)"
        )
    for model in settings.models().values():
        if (row["embedding_model"], row["embedding_dim"]) == (model.embedding_model, model.embedding_dim):
            return model
    offered = " or ".join(f"{m.embedding_model} / {m.embedding_dim}" for m in settings.models().values())
    raise DeploymentMismatch(
        f"the database holds {row['embedding_model']} vectors of dimension {row['embedding_dim']}, "
        f"but this process is set up for {offered}; "
        "fix ONTOFABRIC_EMBEDDING_MODEL / ONTOFABRIC_EMBEDDING_DIM (or, while a model change is under way, "
        "ONTOFABRIC_NEXT_EMBEDDING_MODEL / _DIM: docs/reliability.md)"
    )


STALL_MARGIN_S = 1.0


def stalled_after_s(settings: Settings) -> float:
    """How long a statement may go unanswered before its server counts as stopped: the server's own
    ``statement_timeout`` and a second for the way. A server frozen by its host never applies its timeout, and a
    connection whose path lost its state (a firewall's, a load balancer's) never hears back at all."""
    return settings.statement_timeout_ms / 1000 + STALL_MARGIN_S


PLANNED_WITH_VALUES = {"plan_cache_mode": "force_custom_plan"}
"""For a session that runs a statement over the workspace-partitioned tables many times: every statement reads one
workspace's partitions, or a batch's few, and planned with its values the planner prunes the rest before locking
them. asyncpg prepares each statement, and PostgreSQL's generic plan for one (tried from its sixth run on) covers and
locks every workspace's partitions: 3.6 s binds and "out of shared memory" at 1,400 workspaces (an outside
tester's). Every pool's sessions are so."""


async def create_pool(
    database_url: str,
    settings: Settings,
    *,
    min_size: int = 2,
    max_size: int = 10,
    schema: str | None = None,
    role: str | None = None,
    command_timeout_s: float | None = None,
    keep_session: bool = False,
    idle_in_transaction_s: float | None = None,
    niceness: int = 0,
) -> asyncpg.Pool:
    """A pool whose connections speak pgvector and search HNSW with filters applied (iterative scans).

    ``schema``: the connections read and write that schema's tables in place of ``public``'s (see :func:`migrate`).
    ``role``: the role the connections act as from the start (:data:`READER_ROLE` for the query workers,
    :data:`WRITER_ROLE` for the projectors). ``command_timeout_s``: the client's own limit per statement, for a
    server that stops answering (``statement_timeout`` runs on the server, and a frozen one never applies it).
    ``keep_session``: a released connection is not reset on the server (asyncpg's RESET ALL and friends, a round
    trip each time), for users that change no session state: only ``SET LOCAL``, no advisory locks, no LISTEN.
    An open transaction is still rolled back. ``idle_in_transaction_s``: the server ends a session whose open
    transaction has waited that long for its client's next statement (a client frozen or cut off mid-transaction
    keeps its row locks until then; for users whose transactions never wait on anything but the database).
    Every session has TCP keepalives, so the server finds a client that went away without closing (a half-open
    connection keeps its locks until then: two hours by Linux's defaults) in about a minute. ``niceness`` above
    0: each session's server process runs at that niceness where the server runs on this host
    (:func:`~ontofabric.shared.priority.lower_session_priority`)."""

    async def keep(_: asyncpg.Connection) -> None:
        return None

    said_unchanged = False  # a session left at its priority is logged once, not at every connection

    async def init(conn: asyncpg.Connection) -> None:
        nonlocal said_unchanged
        await register_vector(conn)
        if niceness > 0:
            try:
                became: str = await lower_session_priority(conn, niceness)
            except Exception as error:  # a best effort: never a reason to lose the connection
                became = describe(error)
            if became != "lowered" and not said_unchanged:
                said_unchanged = True
                # Refused: the server runs as another user, and this process may not renice its processes.
                (log.warning if became != "remote" else log.info)(
                    "database_session_priority_unchanged", niceness=niceness, reason=became
                )

    pool = await asyncpg.create_pool(
        database_url,
        min_size=min_size,
        max_size=max_size,
        init=init,
        command_timeout=command_timeout_s,
        reset=keep if keep_session else None,
        server_settings={
            "hnsw.ef_search": str(settings.hnsw_ef_search),
            # pgvector >= 0.8: keep scanning the graph until enough rows pass the filters.
            "hnsw.iterative_scan": "relaxed_order",
            "statement_timeout": str(settings.statement_timeout_ms),
            **PLANNED_WITH_VALUES,
            "tcp_keepalives_idle": "30",
            "tcp_keepalives_interval": "10",
            "tcp_keepalives_count": "3",
            **(
                {"idle_in_transaction_session_timeout": str(round(idle_in_transaction_s * 1000))}
                if idle_in_transaction_s is not None
                else {}
            ),
            "application_name": "ontofabric",
            **_search_path(schema),
            **({"role": role} if role is not None else {}),
        },
    )
    assert pool is not None
    return pool


# SQLSTATE classes that blame the data of one statement: data exception, integrity violation, program limit
# (e.g. a tsvector too long). Retrying those can never succeed; every other database error may pass later.
_DATA_SQLSTATE_CLASSES = ("22", "23", "54")
_CONNECTION_STATE_SIGNS = ("cannot switch to state", "not connected")


def is_transient(error: BaseException) -> bool:
    """True unless the error blames the data being written.

    Errors while connecting (database away, refusing connections, starting up, wrong password) and lost
    connections, deadlocks and timeouts all count as transient: what fails for those reasons must be retried,
    never dead-lettered.
    """
    if isinstance(error, asyncpg.PostgresError):
        sqlstate = getattr(error, "sqlstate", None) or ""
        return sqlstate[:2] not in _DATA_SQLSTATE_CLASSES
    if isinstance(error, ValueError):  # asyncpg's client-side DataError too: a value it cannot encode
        return False
    if isinstance(error, asyncpg.InternalClientError):
        # Only asyncpg's connection state going wrong, as when its backend is killed mid-query; its other
        # internal errors (protocol, codecs) would fail the same way on every retry.
        return any(sign in str(error) for sign in _CONNECTION_STATE_SIGNS)
    return isinstance(error, OSError | asyncpg.InterfaceError | asyncio.TimeoutError | ConnectionError)


# SQLSTATEs of a server that cannot serve now but may soon: connection exceptions, insufficient resources, shutting
# down (57P01-57P05), a statement timeout or cancel, a serialization failure or deadlock, a lock not available.
_UNAVAILABLE_SQLSTATE_CLASSES = ("08", "53")
_UNAVAILABLE_SQLSTATES = ("57P01", "57P02", "57P03", "57P04", "57P05", "57014", "40001", "40P01", "55P03")


def is_unavailable(error: BaseException) -> bool:
    """True when a read failed because the database could not serve it now (away, overloaded, shutting down, a
    timeout or conflict), so that asking again later may succeed; False for what would fail the same way again
    (a bug in a statement, a value it cannot take). Narrower than :func:`is_transient`, which a writer uses to
    never lose a delta to a doubtful error."""
    if isinstance(error, asyncpg.PostgresError):
        sqlstate = getattr(error, "sqlstate", None) or ""
        return sqlstate[:2] in _UNAVAILABLE_SQLSTATE_CLASSES or sqlstate in _UNAVAILABLE_SQLSTATES
    if isinstance(error, asyncpg.InternalClientError):
        return any(sign in str(error) for sign in _CONNECTION_STATE_SIGNS)
    return isinstance(error, OSError | asyncpg.InterfaceError | asyncio.TimeoutError | ConnectionError)
