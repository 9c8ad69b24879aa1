"""Running workers in one process until a signal: what ``up``, ``projector`` and ``query-worker`` share."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass

from ontofabric.shared.embedder import Embedder, build_embedder
from ontofabric.shared.jetstream import ConnectionLost, connection_lost
from ontofabric.shared.logging import get_logger
from ontofabric.shared.runtime import Endpoints
from ontofabric.shared.settings import Settings

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
    if roles.projector:
        projector = ProjectorService(settings, endpoints.nats_url_as("projector"), endpoints.database_url)
        await projector.start()
        stack.push_async_callback(projector.stop)
    if roles.azure_projector and settings.azure_search_endpoint is not None:
        azure = AzureProjectorService(settings, endpoints.nats_url_as("projector"))
        await azure.start()
        stack.push_async_callback(azure.stop)
    if roles.query:
        if embedder is None and settings.embedder != "none":
            embedder = await asyncio.to_thread(build_embedder, settings)
        reranker = await asyncio.to_thread(build_reranker, settings)
        query = QueryService(
            settings,
            endpoints.nats_url_as("query"),
            endpoints.database_url,
            embedder,
            reranker,
            replica_urls=endpoints.replica_urls,
        )
        await query.start()
        stack.push_async_callback(query.stop)
    return embedder


async def serve_until_signal(
    settings: Settings,
    endpoints: Endpoints,
    roles: Roles,
    on_ready: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Run the workers of ``roles`` until SIGINT or SIGTERM. Raises ConnectionLost, after stopping them, when one
    of their NATS connections closed for good: a worker that can no longer receive is better restarted than up."""
    stop = asyncio.Event()
    lost = connection_lost()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with AsyncExitStack() as stack:
        await start_workers(stack, settings, endpoints, roles)
        if on_ready is not None:
            await on_ready()
        log.info("workers_running", projector=roles.projector, query=roles.query)
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(lost.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        log.info("workers_stopping", reason="signal" if stop.is_set() else "nats_connection_closed")
    if not stop.is_set():
        raise ConnectionLost("a NATS connection closed for good (see the log's nats_connection_closed); restart")
