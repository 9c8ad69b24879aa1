"""The query worker: request-reply ``ontology_query`` on per-workspace subjects, in a queue group.

Any request body may be malformed; the answer is then a structured :class:`ErrorReply` and the worker keeps
serving. Nothing a caller sends can crash it.
"""

from __future__ import annotations

import asyncpg
from azure.search.documents.aio import SearchClient
from faststream.nats import NatsBroker, NatsMessage
from faststream.nats.opentelemetry import NatsTelemetryMiddleware
from pydantic import TypeAdapter, ValidationError

from ontofabric.contracts import ErrorDetail, ErrorReply, OntologyQuery, QueryError, QueryResponse
from ontofabric.contracts.documents import Workspace
from ontofabric.shared.azure_search import search_client
from ontofabric.shared.db import create_pool, migrate
from ontofabric.shared.embedder import Embedder
from ontofabric.shared.jetstream import ensure_jetstream, subscriptions_visible
from ontofabric.shared.logging import get_logger
from ontofabric.shared.lru import LruCache
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names, decode_token
from ontofabric.shared.telemetry import instruments

from .config import PipelineConfig
from .core import Reranker
from .pipeline import QueryPipeline, RetrievalUnavailable
from .postgres import PostgresDocuments, PostgresSnapshots
from .retrievers import build_retrievers
from .versions import VersionTracker

log = get_logger(__name__)


def error_reply(code: str, message: str, details: list[ErrorDetail] | None = None, retryable: bool = False) -> bytes:
    instruments().query_errors.add(1, {"code": code})
    reply = ErrorReply(error=QueryError(code=code, message=message, retryable=retryable, details=details or []))
    return reply.model_dump_json().encode()


def validation_details(error: ValidationError) -> list[ErrorDetail]:
    details = []
    for problem in error.errors():
        location = ".".join(str(part) for part in problem["loc"]) or None
        message = problem["msg"]
        if problem["type"] == "extra_forbidden":
            message = "unknown parameter"
        details.append(ErrorDetail(field=location, message=message))
    return details


_WORKSPACE = TypeAdapter(Workspace)


def workspace_of_subject(subject: str) -> str | None:
    """The workspace a query subject names, or None when its token does not decode to a valid name."""
    try:
        return _WORKSPACE.validate_python(decode_token(subject.rsplit(".", 1)[-1]))
    except (ValueError, ValidationError):
        return None


def parse_request(body: bytes, workspace: str, max_query_chars: int) -> OntologyQuery | bytes:
    """The validated query, or the error reply to send instead."""
    try:
        query = OntologyQuery.model_validate_json(body)
    except ValidationError as error:
        return error_reply("invalid_request", "the request does not match ontology_query", validation_details(error))
    if len(query.semantic_query) > max_query_chars:
        return error_reply(
            "invalid_request",
            "the query is too long",
            [ErrorDetail(field="semanticQuery", message=f"at most {max_query_chars} characters")],
        )
    if query.workspace is not None and query.workspace != workspace:
        return error_reply(
            "invalid_request",
            "the body names another workspace than the subject it was sent to",
            [ErrorDetail(field="workspace", message=f"this subject serves workspace {workspace!r}")],
        )
    return query


# Room left in a NATS message for the reply's headers (correlation, content type, trace context).
HEADER_ALLOWANCE_BYTES = 16 * 1024


def encode_within(response: QueryResponse, limit: int) -> bytes:
    """The reply as JSON in at most ``limit`` bytes. Results that do not fit are left out from the lowest rank
    up and ``_meta.degraded`` says ``replySize``: an answer NATS would refuse to carry leaves the caller waiting."""
    whole = response.model_dump_json().encode()
    if len(whole) <= limit:
        return whole
    meta = response.meta.model_copy(update={"degraded": [*response.meta.degraded, "replySize"]})

    def encoded(count: int) -> bytes:
        return (
            response.model_copy(update={"results": response.results[:count], "meta": meta}).model_dump_json().encode()
        )

    fits, too_many = 0, len(response.results)  # binary search for the most results that fit
    while too_many - fits > 1:
        middle = (fits + too_many) // 2
        fits, too_many = (middle, too_many) if len(encoded(middle)) <= limit else (fits, middle)
    body = encoded(fits)
    if len(body) > limit:
        return error_reply("internal", f"even an answer without results exceeds the {limit} bytes a reply may have")
    return body


class QueryService:
    """The query worker process: pool, embedder, version watch and the request-reply subscriber."""

    def __init__(
        self,
        settings: Settings,
        nats_url: str,
        database_url: str,
        embedder: Embedder | None,
        reranker: Reranker | None = None,
    ) -> None:
        self.settings = settings
        self.names = Names(settings.subject_prefix)
        self._nats_url = nats_url
        self._database_url = database_url
        self._embedder = embedder
        self._reranker = reranker
        self._broker: NatsBroker | None = None
        self._pool: asyncpg.Pool | None = None
        self._versions: VersionTracker | None = None
        self._azure: SearchClient | None = None
        self.handled = 0
        """Requests this worker answered (errors included)."""

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()  # whatever started before the failure
            raise

    async def _start(self) -> None:
        settings, names = self.settings, self.names
        await migrate(self._database_url, settings)
        self._pool = await create_pool(self._database_url, settings, max_size=max(4, 2 * settings.query_concurrency))
        broker = self._broker = NatsBroker(
            self._nats_url, name="ontofabric-query", logger=None, middlewares=[NatsTelemetryMiddleware()]
        )
        await broker.connect()
        js = broker.connection.jetstream()
        await ensure_jetstream(js, names, settings)
        tracker = VersionTracker(await js.key_value(names.version_bucket), names)
        snapshots = PostgresSnapshots(self._pool)
        documents = PostgresDocuments(snapshots)
        if settings.keyword_backend == "azure-ai-search":
            # No SDK retries: a query has a budget (the timeout), and a failed keyword path degrades, not fails.
            self._azure = search_client(settings, retries=0)
        pipeline = QueryPipeline(
            build_retrievers(settings, snapshots, documents, self._azure),
            documents,
            self._embedder,
            tracker,
            LruCache(settings.query_cache_entries),
            PipelineConfig.from_settings(settings),
            self._reranker,
        )
        tracker.set_listener(pipeline.invalidate)
        self._versions = tracker
        await tracker.start()

        async def raw_body(message: NatsMessage) -> bytes:
            return bytes(message.body)

        @broker.subscriber(
            names.query_subjects,
            queue=names.query_queue,
            decoder=raw_body,
            max_workers=settings.query_concurrency,
        )
        async def on_query(message: NatsMessage) -> bytes:
            self.handled += 1
            workspace = workspace_of_subject(message.raw_message.subject)
            if workspace is None:
                return error_reply(
                    "invalid_request",
                    "the subject does not name a valid workspace",
                    [ErrorDetail(field=None, message=f"subject {message.raw_message.subject!r}")],
                )
            parsed = parse_request(bytes(message.body), workspace, settings.max_query_chars)
            if isinstance(parsed, bytes):
                return parsed
            try:
                response = await pipeline.answer(parsed, workspace)
            except RetrievalUnavailable as error:
                return error_reply("unavailable", str(error), retryable=True)
            except Exception:
                log.exception("query_failed", workspace=workspace)
                return error_reply("internal", "the query failed unexpectedly; see the worker log", retryable=True)
            return encode_within(response, broker.connection.max_payload - HEADER_ALLOWANCE_BYTES)

        await broker.start()
        await subscriptions_visible(broker.connection)
        log.info("query_worker_started", subjects=names.query_subjects, queue=names.query_queue)

    async def stop(self) -> None:
        if self._broker is not None:
            await self._broker.stop()
            self._broker = None
        if self._versions is not None:
            await self._versions.stop()
            self._versions = None
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
        if self._azure is not None:
            await self._azure.close()
            self._azure = None
        if self._reranker is not None:
            await self._reranker.close()
        log.info("query_worker_stopped")
