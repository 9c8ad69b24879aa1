"""A request-reply client of the query workers: ontology_query, a document by id, a workspace's status. What gateways
and the CLI use."""

from __future__ import annotations

import asyncio
import time
from typing import Any, TypeVar

from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from opentelemetry import propagate
from pydantic import BaseModel, ValidationError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from ontofabric.contracts import (
    MAX_TIMEOUT_MS,
    SENT_AT_HEADER,
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
from ontofabric.shared.logging import get_logger
from ontofabric.shared.subjects import Names, Operation

Reply = TypeVar("Reply", QueryResponse, DocumentReply, StatusReply)
log = get_logger(__name__)


FIRST_ATTEMPT_SHARE = 0.65
"""Of the caller's time, what the first attempt gets when a second still fits. A worker answers or refuses within
the timeout it is sent (its deadline timer), so silence past that means the request died with its worker
(killed, or its connection gone): the rest of the time goes to another worker."""
MIN_SECOND_ATTEMPT_S = 1.0
WAY_BACK_S = 0.25
"""Waited past an attempt's timeout header for its reply to arrive."""
REQUEST_HEADER_ROOM_BYTES = 4096
"""Of the server's max_payload, what a request leaves for its headers (the timeout, trace context): the server
counts them in, nats-py checks the body alone."""


class RequestTooLarge(ValueError):
    """A request body that the NATS server would not take; nothing was sent."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"the request takes {size:,} bytes; this NATS server takes at most {limit:,}")
        self.size = size
        self.limit = limit


class QueryClient:
    def __init__(self, nc: Client, names: Names, timeout_s: float = 10.0) -> None:
        self._nc = nc
        self._names = names
        self._timeout_s = timeout_s

    async def send_raw(self, workspace: str, body: bytes, operation: Operation = "query") -> bytes:
        """Send a request body as is, within the client's timeout. A request lost with the worker that held it is
        sent again when time is left (at most twice in all); while no worker listens (a restart), it is retried
        for up to a second. Raises RequestTooLarge for a body the server would not take."""
        limit = self._nc.max_payload - REQUEST_HEADER_ROOM_BYTES
        if len(body) > limit:
            raise RequestTooLarge(len(body), limit)
        subject = self._names.request_subject(operation, workspace)
        loop = asyncio.get_running_loop()
        ends = loop.time() + self._timeout_s
        second_fits = self._timeout_s * (1 - FIRST_ATTEMPT_SHARE) >= MIN_SECOND_ATTEMPT_S
        first_s = self._timeout_s * FIRST_ATTEMPT_SHARE if second_fits else self._timeout_s
        try:
            return await self._attempt(subject, body, first_s)
        except NatsTimeoutError:
            if not second_fits:
                raise
        log.warning("query_request_resent", subject=subject, after_s=round(first_s, 3), reason="no reply")
        return await self._attempt(subject, body, ends - loop.time())

    async def _attempt(self, subject: str, body: bytes, wait_s: float) -> bytes:
        # The worker answers or refuses within the timeout it is told, and does no work once it has passed.
        told_s = max(wait_s - WAY_BACK_S, wait_s / 2)
        headers = {
            TIMEOUT_HEADER: str(max(1, min(MAX_TIMEOUT_MS, round(told_s * 1000)))),
            SENT_AT_HEADER: str(round(time.time() * 1000)),  # a worker that stalled does no work for us once gone
        }
        propagate.inject(headers)
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(NoRespondersError),
            stop=stop_after_attempt(6),
            wait=wait_exponential(multiplier=0.03),
            reraise=True,
        ):
            with attempt:
                # A subject these credentials may not use fails at once, not after the timeout.
                reply = await refused_promptly(
                    self._nc, subject, self._nc.request(subject, body, timeout=wait_s, headers=headers)
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
