"""Running workers in one process until a signal: what ``up``, ``projector`` and ``query-worker`` share."""

from __future__ import annotations

import asyncio
import gc
import signal
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass

from ontofabric.shared.embedder import Embedder, build_embedder
from ontofabric.shared.jetstream import ConnectionLost, connection_lost
from ontofabric.shared.logging import get_logger
from ontofabric.shared.priority import lower_process_priority
from ontofabric.shared.runtime import Endpoints
from ontofabric.shared.settings import Settings
from ontofabric.shared.tasks import cancel_and_wait, still_wanted

from .projector.worker import AzureProjectorService, ProjectorService
from .query.rerankers import build_reranker
from .query.worker import QueryService

log = get_logger(__name__)


@dataclass(frozen=True)
class Roles:
    projector: bool = True
    query: bool = True
    azure_projector: bool = True
    """Runs only where ONTOFABRIC_AZURE_SEARCH_ENDPOINT is set."""


async def start_workers(
    stack: AsyncExitStack, settings: Settings, endpoints: Endpoints, roles: Roles, embedder: Embedder | None = None
) -> Embedder | None:
    """Start the chosen workers; ``stack`` stops them in reverse order. Returns the query embedder."""
    reranker = None
    if roles.query or roles.projector:
        warn_without_logins(settings, endpoints)
    if roles.query:
        # The models first: loading them holds the interpreter for seconds, and a projector started before them
        # missed its holding looks (a demo logged it away past its lease, and no answer to its own ping).
        if embedder is None and settings.embedder != "none":
            embedder = await asyncio.to_thread(build_embedder, settings)
        reranker = await asyncio.to_thread(build_reranker, settings)
    if roles.projector:
        projector = ProjectorService(
            settings,
            endpoints.nats_url_as("projector"),
            endpoints.database_url,
            writer_login=endpoints.database_logins.get("projector"),
        )
        await projector.start()
        stack.push_async_callback(projector.stop)
    if roles.azure_projector and settings.azure_search_endpoint is not None:
        azure = AzureProjectorService(settings, endpoints.nats_url_as("projector"))
        await azure.start()
        stack.push_async_callback(azure.stop)
    if roles.query:
        query = QueryService(
            settings,
            endpoints.nats_url_as("query"),
            endpoints.database_url,
            embedder,
            reranker,
            replica_urls=endpoints.replica_urls,
            reader_login=endpoints.database_logins.get("query"),
        )
        await query.start()
        stack.push_async_callback(query.stop)
    return embedder


def warn_without_logins(settings: Settings, endpoints: Endpoints) -> bool:
    """Warn, and say so, when workers are to use the embedded PostgreSQL of a running ``up`` that records no logins
    of their own (an earlier release's): they then connect as its superuser, acting as their roles (an upgrade
    tester's workers beside an earlier ``up`` did so unsaid)."""
    if settings.database_url is not None or endpoints.database_logins:
        return False
    log.warning(
        "database_logins_not_recorded",
        reason="the running `ontofabric up` records no PostgreSQL logins of the workers' own (an earlier release): "
        "these workers connect as the superuser, acting as their roles; upgrade up and start them again",
    )
    return True


def keep_out_of_collections() -> None:
    """What starting made (the models, the libraries: about 550,000 objects in a query worker) stays for the
    process's life; frozen, the garbage collector no longer walks it at every full collection. Measured in a query
    worker under load: a full collection took 370 ms of CPU before, with the event loop and the model thread
    stopped, and 2-4 ms after (docs/benchmarks.md, "Full garbage collections")."""
    gc.collect()
    gc.freeze()


class ServersEnded(Exception):
    """A server the workers depend on, started by this process, has ended."""


SERVER_WATCH_S = 1.0


async def _watch(exited: Callable[[], list[str]]) -> str:
    while not (ended := exited()):
        await asyncio.sleep(SERVER_WATCH_S)
    return ", ".join(ended)


async def serve_until_signal(
    settings: Settings,
    endpoints: Endpoints,
    roles: Roles,
    on_ready: Callable[[], Awaitable[None]] | None = None,
    exited: Callable[[], list[str]] | None = None,
) -> None:
    """Run the workers of ``roles`` until SIGINT or SIGTERM. Raises ConnectionLost, after stopping them, when one
    of their NATS connections closed for good: a worker that can no longer receive is better restarted than up.
    ``exited``: what has become of the servers the workers use, said in full: those this process started that
    have ended (EmbeddedRuntime.exited), or those of a running ``up`` that moved (``servers_moved`` in the CLI);
    when there is any, the workers stop and ServersEnded is raised, instead of retrying them for ever."""
    stop = asyncio.Event()
    lost = connection_lost()
    loop = asyncio.get_running_loop()
    # SIGHUP too: a terminal closed ended `up` at once, its workers not stopped, nothing logged (a stop tester's).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)

    async def run(stack: AsyncExitStack) -> None:
        if settings.query_niceness > 0 and roles.query and not roles.projector and not roles.azure_projector:
            # Before any thread starts: the model's threads inherit it. Where a projector shares the process, its
            # event loop is the queries' too, and only the database sessions are reniced (in the reader pools).
            threads, autogroup = lower_process_priority(settings.query_niceness)
            (log.info if autogroup in ("lowered", "not_leader", "unavailable") else log.warning)(
                "query_worker_priority", niceness=settings.query_niceness, threads=threads, autogroup=autogroup
            )
        await start_workers(stack, settings, endpoints, roles)
        still_wanted()  # a stop whose cancellation nats-py lost: not "ready" after it (a review's)
        keep_out_of_collections()
        if on_ready is not None:
            await on_ready()
        log.info("workers_running", projector=roles.projector, query=roles.query)
        await asyncio.Event().wait()

    async with AsyncExitStack() as stack:
        # Starting is watched too: a worker waits for its servers as long as it takes, and one may end meanwhile.
        running = asyncio.ensure_future(run(stack))
        watching = asyncio.ensure_future(_watch(exited) if exited is not None else asyncio.Event().wait())
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(lost.wait()), watching, running]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Each until it ends: a start whose cancellation nats-py lost (3.11's wait_for) went on to wait for
            # ever, a signal after it already taken (a review's).
            await asyncio.gather(*map(cancel_and_wait, waits), return_exceptions=True)
        failed = None if running.cancelled() else running.exception()
        if failed is not None:
            raise failed  # a worker that could not start
        ended = watching.result() if not watching.cancelled() else None
        reason = "signal" if stop.is_set() else "embedded_server_ended" if ended else "nats_connection_closed"
        if ended:
            log.error("embedded_server_ended", servers=ended)
        log.info("workers_stopping", reason=reason)
    if stop.is_set():
        return
    if ended:
        raise ServersEnded(f"{ended}; restart")
    raise ConnectionLost("a NATS connection closed for good (see the log's nats_connection_closed); restart")
