"""A request-reply client for ``ontology_query``: what gateways and the CLI use."""

from __future__ import annotations

from typing import Any

from nats.aio.client import Client
from nats.errors import NoRespondersError
from opentelemetry import propagate
from pydantic import ValidationError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from ontofabric.contracts import ErrorReply, OntologyQuery, QueryResponse
from ontofabric.shared.subjects import Names


class QueryClient:
    def __init__(self, nc: Client, names: Names, timeout_s: float = 10.0) -> None:
        self._nc = nc
        self._names = names
        self._timeout_s = timeout_s

    async def send_raw(self, workspace: str, body: bytes) -> bytes:
        """Send a request body as is. While no worker listens (a restart), retry for up to a second."""
        headers: dict[str, str] = {}
        propagate.inject(headers)
        subject = self._names.query_subject(workspace)
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(NoRespondersError),
            stop=stop_after_attempt(6),
            wait=wait_exponential(multiplier=0.03),
            reraise=True,
        ):
            with attempt:
                reply = await self._nc.request(subject, body, timeout=self._timeout_s, headers=headers)
        return bytes(reply.data)

    async def query(self, workspace: str, query: OntologyQuery | dict[str, Any]) -> QueryResponse | ErrorReply:
        body = (
            query.model_dump_json(exclude_none=True).encode()
            if isinstance(query, OntologyQuery)
            else OntologyQuery.model_validate(query).model_dump_json(exclude_none=True).encode()
        )
        return parse_reply(await self.send_raw(workspace, body))


def parse_reply(data: bytes) -> QueryResponse | ErrorReply:
    try:
        return QueryResponse.model_validate_json(data)
    except ValidationError:
        return ErrorReply.model_validate_json(data)
