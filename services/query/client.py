"""A request-reply client of the query workers: ontology_query, a document by id, a workspace's status. What gateways
and the CLI use."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from weakref import WeakKeyDictionary

from nats.aio.client import NO_RESPONDERS_STATUS, Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from opentelemetry import propagate
from pydantic import BaseModel, ValidationError

from ontofabric.contracts import (
    MAX_TIMEOUT_MS,
    RECEIPT_HEADER,
    RECEIVED,
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

from .deadlines import RecentDelay, header_value

Reply = TypeVar("Reply", QueryResponse, DocumentReply, StatusReply)
log = get_logger(__name__)


FIRST_ATTEMPT_SHARE = 0.65
"""Of the caller's time, what an attempt gets when another still fits after it. A worker answers or refuses within
the timeout it is sent (its deadline timer), so silence past that means the request died with its worker
(killed, or its connection gone): the rest of the time goes to another worker."""
MIN_SECOND_ATTEMPT_S = 1.0
WAY_BACK_S = 0.25
"""Waited past an attempt's timeout header for its reply to arrive."""
RECEIPT_WAIT_S = 1.0
"""How long an attempt may go without its receipt (contracts RECEIPT_HEADER) before the request is sent again, at
least. A worker sends one as it reads a request, so an attempt silent that long is held by a worker that is frozen
(SIGSTOP, a paused VM) or gone without the server noticing yet; NATS keeps handing such a worker its share of the
queue group's requests until the server's pings time out, minutes later. The silent attempt stays open: its answer
is still taken if it comes first."""
RECEIPT_WAIT_FACTOR = 3.0
"""The wait is at least this many times the latest slow receipt on the connection: workers whose event loops run
late (on busy cores) are not sent more of the same work."""
MAX_SENDS = 8
"""Sends of one request in all, while a send still fits in the time left (MIN_SECOND_ATTEMPT_S). Within a queue
group each send goes to any worker, the frozen one too: with one of two frozen, a request fails only when every
send goes to it (1 in 256 with eight). A send to a frozen worker costs it nothing when it wakes (the request has
waited past its timeout: refused unopened)."""
NO_RESPONDER_RETRIES = 5
NO_RESPONDER_BACKOFF_S = 0.03
"""While no worker listens (a restart), a request is sent again NO_RESPONDER_RETRIES times, after 30 ms, 60 ms,
... (about a second in all)."""
STATUS_HEADER = "Status"
"""Where nats-py puts a server status line (503: no responders)."""
REQUEST_HEADER_ROOM_BYTES = 4096
"""Of the server's max_payload, what a request leaves for its headers (the timeout, trace context): the server
counts them in, nats-py checks the body alone."""


class RequestTooLarge(ValueError):
    """A request body that the NATS server would not take; nothing was sent."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"the request takes {size:,} bytes; this NATS server takes at most {limit:,}")
        self.size = size
        self.limit = limit


@dataclass
class Attempt:
    """One send of a request: when it went, until when its worker owes the reply, whether it said it has it."""

    sent_at: float
    due_at: float
    """The timeout it was sent with, and the way back."""
    receipt_asked: bool = True
    receipt_at: float | None = None
    done: bool = False
    """Answered or refused; nothing more is awaited from it."""

    def heard_until(self, receipt_wait_s: float) -> float:
        """Until when this attempt's silence is expected: a receipt comes within ``receipt_wait_s`` of the send,
        the reply by ``due_at``."""
        if self.receipt_at is not None or not self.receipt_asked:
            return self.due_at
        return min(self.due_at, self.sent_at + receipt_wait_s)


def send_again_at(attempts: Sequence[Attempt], receipt_wait_s: float) -> float | None:
    """When the request is to be sent again: once no open attempt can still be expected to answer. None when
    every attempt is done (nothing is awaited)."""
    open_attempts = [a.heard_until(receipt_wait_s) for a in attempts if not a.done]
    return max(open_attempts) if open_attempts else None


def attempt_timeout(left_s: float, sends_left: int) -> float:
    """What an attempt is given of the time left: all of it, or FIRST_ATTEMPT_SHARE when another send still fits
    after it."""
    another_fits = sends_left > 1 and left_s * (1 - FIRST_ATTEMPT_SHARE) >= MIN_SECOND_ATTEMPT_S
    return left_s * FIRST_ATTEMPT_SHARE if another_fits else left_s


def retryable_refusal(body: bytes) -> bool:
    """A worker's retryable error reply (overloaded, deadline_exceeded): another worker may still answer."""
    if not body.startswith(b'{"error"'):
        return False
    try:
        return ErrorReply.model_validate_json(body).error.retryable
    except ValidationError:
        return False


def request_headers(timeout_s: float, receipt: bool = True) -> dict[str, str]:
    """A request's headers: the timeout the worker is told (less the way back), when it was sent, the receipt
    asked for, and the trace context."""
    # The worker answers or refuses within the timeout it is told, and does no work once it has passed.
    told_s = max(timeout_s - WAY_BACK_S, timeout_s / 2)
    headers = {
        TIMEOUT_HEADER: str(max(1, min(MAX_TIMEOUT_MS, round(told_s * 1000)))),
        SENT_AT_HEADER: str(round(time.time() * 1000)),  # a worker that stalled does no work for us once gone
    }
    if receipt:
        headers[RECEIPT_HEADER] = "requested"
    propagate.inject(headers)
    return headers


class ReplyInbox:
    """Where a connection's QueryClient requests get their replies: one subscription for all of them, routed by
    reply subject (as nats-py's own request does), and how late their receipts came lately. A subscription per
    request would cost a SUB, an UNSUB and a task each. Holds no reference to its connection, which keys it in a
    WeakKeyDictionary."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._routes: dict[str, Callable[[Msg], None]] = {}
        self._subscribing = asyncio.Lock()
        self._subscribed = False
        self.receipt_delays = RecentDelay()

    async def open(self, nc: Client, route: Callable[[Msg], None]) -> str:
        """A new reply subject whose messages go to ``route`` until :meth:`close`."""
        async with self._subscribing:
            if not self._subscribed:
                await nc.subscribe(f"{self._prefix}*", cb=self._route)
                self._subscribed = True
        subject = f"{self._prefix}{uuid.uuid4().hex}"
        self._routes[subject] = route
        return subject

    def close(self, subject: str) -> None:
        self._routes.pop(subject, None)

    async def _route(self, msg: Msg) -> None:
        route = self._routes.get(msg.subject)
        if route is not None:  # else a reply to a request that has ended
            route(msg)


_INBOXES: WeakKeyDictionary[Client, ReplyInbox] = WeakKeyDictionary()


class QueryClient:
    def __init__(self, nc: Client, names: Names, timeout_s: float = 10.0, *, receipts: bool = True) -> None:
        """``receipts`` False: no receipt is asked for, and a request is sent again only when its worker stays
        silent past the timeout it was told (what tests/benchmarks/faults_frozen_worker.py compares against)."""
        self._nc = nc
        self._names = names
        self._timeout_s = timeout_s
        self._receipts = receipts

    async def send_raw(self, workspace: str, body: bytes, operation: Operation = "query") -> bytes:
        """Send a request body as is, within the client's timeout, and return the first reply. A request is sent
        again, while time is left, when no worker has it: its receipt did not come (the worker is frozen or gone)
        or its worker went silent past the timeout it was told (it died with the request). Earlier attempts stay
        open, and a retryable refusal is returned only when no other attempt answers. While no worker listens (a
        restart), it is retried for up to a second. Raises RequestTooLarge for a body the server would not take,
        NoRespondersError when no worker listens, nats' TimeoutError when no reply came in time."""
        limit = self._nc.max_payload - REQUEST_HEADER_ROOM_BYTES
        if len(body) > limit:
            raise RequestTooLarge(len(body), limit)
        subject = self._names.request_subject(operation, workspace)
        # A subject these credentials may not use fails at once, not after the timeout.
        return await refused_promptly(self._nc, subject, self._exchange(subject, body))

    async def _exchange(self, subject: str, body: bytes) -> bytes:
        loop = asyncio.get_running_loop()
        ends = loop.time() + self._timeout_s
        inbox = _INBOXES.get(self._nc) or _INBOXES.setdefault(self._nc, ReplyInbox(f"{self._nc.new_inbox()}."))
        delays = inbox.receipt_delays
        replies: asyncio.Queue[tuple[Attempt, Msg]] = asyncio.Queue()
        attempts: list[Attempt] = []
        reply_subjects: list[str] = []
        refused: bytes | None = None
        no_responders = 0

        async def send() -> None:
            now = loop.time()
            told_s = attempt_timeout(ends - now, MAX_SENDS - len(attempts))
            attempt = Attempt(sent_at=now, due_at=now + told_s, receipt_asked=self._receipts)
            reply_subject = await inbox.open(self._nc, lambda msg: replies.put_nowait((attempt, msg)))
            reply_subjects.append(reply_subject)
            attempts.append(attempt)
            await self._nc.publish(subject, body, reply=reply_subject, headers=request_headers(told_s, self._receipts))

        try:
            await send()
            while True:
                now = loop.time()
                receipt_wait_s = max(RECEIPT_WAIT_S, RECEIPT_WAIT_FACTOR * delays.seconds)
                again_at = send_again_at(attempts, receipt_wait_s)
                if refused is not None and (again_at is None or again_at <= now):
                    return refused  # no other attempt is expected to answer: the refusal is the answer
                if again_at is not None and again_at <= now:
                    if len(attempts) < MAX_SENDS and ends - now >= MIN_SECOND_ATTEMPT_S:
                        silent = "no receipt" if all(a.receipt_at is None for a in attempts) else "no reply"
                        log.warning("query_request_resent", subject=subject, sends=len(attempts) + 1, reason=silent)
                        await send()
                        continue
                    again_at = ends  # no room for another send: the open attempts have the rest
                wake = min(ends, again_at or ends)
                if wake <= now:
                    if refused is not None:
                        return refused
                    raise NatsTimeoutError
                try:
                    attempt, msg = await asyncio.wait_for(replies.get(), wake - now)
                except TimeoutError:
                    continue
                if header_value(msg.headers, RECEIPT_HEADER) == RECEIVED and not msg.data:
                    if attempt.receipt_at is None:
                        attempt.receipt_at = loop.time()
                        delays.observe(attempt.receipt_at - attempt.sent_at, attempt.receipt_at)
                    continue
                attempt.done = True
                if header_value(msg.headers, STATUS_HEADER) == NO_RESPONDERS_STATUS:
                    attempts.remove(attempt)  # it reached no worker: not a send of the budget
                    no_responders += 1
                    backoff_s = NO_RESPONDER_BACKOFF_S * 2 ** (no_responders - 1)
                    if no_responders <= NO_RESPONDER_RETRIES and loop.time() + backoff_s < ends:
                        await asyncio.sleep(backoff_s)
                        await send()
                    elif not attempts:
                        raise NoRespondersError
                    continue
                data = bytes(msg.data)
                if retryable_refusal(data) and (send_again_at(attempts, receipt_wait_s) or 0) > loop.time():
                    refused = data  # another attempt is still expected to answer
                    continue
                return data
        finally:
            for reply_subject in reply_subjects:
                inbox.close(reply_subject)

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
