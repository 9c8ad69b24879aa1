"""A request-reply client of the query workers: ontology_query, a document by id, a workspace's status. What gateways
and the CLI use."""

from __future__ import annotations

from typing import Any, TypeVar

from nats.aio.client import Client
from nats.errors import NoRespondersError
from opentelemetry import propagate
from pydantic import BaseModel, ValidationError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from ontofabric.contracts import (
    MAX_TIMEOUT_MS,
    TIMEOUT_HEADER,
    DocumentReply,
    DocumentRequest,
    ErrorReply,
    OntologyQuery,
    QueryResponse,
    StatusReply,
    StatusRequest,
)
from ontofabric.shared.jetstream import refused_promptly
from ontofabric.shared.subjects import Names, Operation

Reply = TypeVar("Reply", QueryResponse, DocumentReply, StatusReply)


class QueryClient:
    def __init__(self, nc: Client, names: Names, timeout_s: float = 10.0) -> None:
        self._nc = nc
        self._names = names
        self._timeout_s = timeout_s

    async def send_raw(self, workspace: str, body: bytes, operation: Operation = "query") -> bytes:
        """Send a request body as is. While no worker listens (a restart), retry for up to a second."""
        # The worker answers or refuses within our timeout, and does no work for us once we have given up.
        headers = {TIMEOUT_HEADER: str(max(1, min(MAX_TIMEOUT_MS, round(self._timeout_s * 1000))))}
        propagate.inject(headers)
        subject = self._names.request_subject(operation, workspace)
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(NoRespondersError),
            stop=stop_after_attempt(6),
            wait=wait_exponential(multiplier=0.03),
            reraise=True,
        ):
            with attempt:
                # A subject these credentials may not use fails at once, not after the timeout.
                reply = await refused_promptly(
                    self._nc, subject, self._nc.request(subject, body, timeout=self._timeout_s, headers=headers)
                )
        return bytes(reply.data)

    async def query(self, workspace: str, query: OntologyQuery | dict[str, Any]) -> QueryResponse | ErrorReply:
        return parse_reply(await self._send(workspace, OntologyQuery, query, "query"), QueryResponse)

    async def document(self, workspace: str, request: DocumentRequest | dict[str, Any]) -> DocumentReply | ErrorReply:
        return parse_reply(await self._send(workspace, DocumentRequest, request, "document"), DocumentReply)

    async def status(self, workspace: str, request: StatusRequest | dict[str, Any]) -> StatusReply | ErrorReply:
        return parse_reply(await self._send(workspace, StatusRequest, request, "status"), StatusReply)

    async def _send(
        self, workspace: str, model: type[BaseModel], request: BaseModel | dict[str, Any], operation: Operation
    ) -> bytes:
        validated = request if isinstance(request, model) else model.model_validate(request)
        return await self.send_raw(workspace, validated.model_dump_json(exclude_none=True).encode(), operation)


def parse_reply(data: bytes, reply: type[Reply] = QueryResponse) -> Reply | ErrorReply:  # type: ignore[assignment]
    try:
        return reply.model_validate_json(data)
    except ValidationError:
        return ErrorReply.model_validate_json(data)
