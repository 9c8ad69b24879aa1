"""What an HTTP gateway takes on: at most so many requests held at once, none while its event loop runs late, and a
call's time counted from its arrival. Refusals are answered before the MCP SDK builds its per-request transport,
which is where a gateway's time went under load (a tester's profile: the SDK's stateless plumbing, not the calls).

Without them, a gateway sent more than its one loop could read fell behind for good: every call's timer started
seconds after its request came, answers reached clients that had given up, the calls held grew to thousands (RSS
145 -> 877 MB), and the NATS server dropped the gateway as a slow consumer (10 s unread), losing every reply in
flight (docs/benchmarks.md, "MCP gateway under sustained overload")."""

from __future__ import annotations

import asyncio
import json
from collections import deque
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ontofabric.shared.tasks import LATENESS_TICK_S
from ontofabric.shared.telemetry import meter

ARRIVED: ContextVar[float] = ContextVar("ontofabric_gateway_arrived")
"""The event loop's time when the HTTP request of the call under way reached the gateway: its time counts from then."""

MIN_RETRY_AFTER_S = 1.0
"""What a refused caller is told to wait at least; more while the loop runs later than half of it."""
PEEKED_BYTES = 65536
"""Of a refused request's body, what is read to find its id: a larger one is answered without it."""
OVERLOADED = -32003
"""The JSON-RPC error code of a refused request that is not a tool call (implementation-defined server error range)."""

refused_requests = meter().create_counter(
    "gateway.requests.refused",
    description="HTTP requests the MCP gateway refused on arrival, by reason: held (its limit of requests held at "
    "once), late (its event loop running late), waited (a call read after half its time)",
)


class LoopLag:
    """How late the event loop runs now (fed by :func:`~ontofabric.shared.tasks.watch_lateness`): as late as its
    last look found, or later, while the next look is overdue. Only the present counts: a pause gone by (a
    collection, a large reply written) refuses nothing once the loop has caught up."""

    def __init__(self, tick_s: float = LATENESS_TICK_S) -> None:
        self._tick_s = tick_s
        self._late_s = 0.0
        self._at: float | None = None

    def observe(self, late_s: float, now: float) -> None:
        self._late_s, self._at = late_s, now

    def late_s(self, now: float) -> float:
        return 0.0 if self._at is None else max(self._late_s, now - self._at - self._tick_s)


@dataclass
class Intake:
    """Whether a request is taken (pure: the held count is kept by its caller)."""

    max_held: int
    max_late_s: float
    held: int = 0

    def refusal(self, late_s: float) -> tuple[str, str] | None:
        """The reason (a metric's) and the words of a refusal, or None to take the request."""
        if self.held >= self.max_held:
            return "held", f"this gateway holds {self.held} requests, its limit (ONTOFABRIC_GATEWAY_MAX_HELD)"
        if late_s > self.max_late_s:
            return "late", f"this gateway's event loop runs {late_s * 1000:.0f} ms late"
        return None

    def retry_after_ms(self, late_s: float) -> int:
        return round(max(MIN_RETRY_AFTER_S, 2 * late_s) * 1000)


class AdmitRequests:
    """ASGI middleware, outermost: POSTs beyond the Intake are answered at once. A tool call gets a retryable tool
    error (``error overloaded (retryable: try again in about N ms)``, as a worker's refusal reads), another request
    HTTP 503 with ``Retry-After`` and a JSON-RPC error under its id; a notification (a cancellation among them) is
    taken whatever the load. Each request taken has its arrival time in ARRIVED."""

    def __init__(self, app: ASGIApp, intake: Intake, lag: LoopLag) -> None:
        self._app = app
        self._intake = intake
        self._lag = lag

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self._app(scope, receive, send)
            return
        now = asyncio.get_running_loop().time()
        late_s = self._lag.late_s(now)
        refusal = self._intake.refusal(late_s)
        if refusal is not None:
            read: deque[Message] = deque()
            request = await _peek(receive, read)
            if request is None or "id" in request:
                reason, words = refusal
                refused_requests.add(1, {"reason": reason})
                await _refuse(send, request, words, self._intake.retry_after_ms(late_s))
                return

            async def replay() -> Message:
                return read.popleft() if read else await receive()

            receive = replay
        self._intake.held += 1
        arrived = ARRIVED.set(now)
        try:
            await self._app(scope, receive, send)
        finally:
            ARRIVED.reset(arrived)
            self._intake.held -= 1


async def _peek(receive: Receive, read: deque[Message]) -> dict[str, Any] | None:
    """The request's JSON-RPC object, read from its first PEEKED_BYTES (kept in ``read`` to replay); None when it is
    not one, or longer."""
    size, complete = 0, False
    while not complete and size <= PEEKED_BYTES:
        message = await receive()
        read.append(message)
        if message["type"] != "http.request":
            return None
        size += len(message.get("body", b""))
        complete = not message.get("more_body", False)
    if not complete:
        return None
    try:
        parsed = json.loads(b"".join(m.get("body", b"") for m in read))
    except (ValueError, RecursionError):
        return None
    return parsed if isinstance(parsed, dict) else None


async def _refuse(send: Send, request: dict[str, Any] | None, words: str, retry_after_ms: int) -> None:
    text = f"error overloaded (retryable: try again in about {retry_after_ms} ms): {words}"
    request_id = request.get("id") if request is not None else None
    if request is not None and request.get("method") == "tools/call":
        status, headers = 200, []
        reply: dict[str, Any] = {"result": {"content": [{"type": "text", "text": text}], "isError": True}}
    else:
        status = 503
        headers = [(b"retry-after", str(max(1, round(retry_after_ms / 1000))).encode())]
        reply = {"error": {"code": OVERLOADED, "message": text}}
    body = json.dumps({"jsonrpc": "2.0", "id": request_id, **reply}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [_JSON, *headers]})
    await send({"type": "http.response.body", "body": body})


_JSON = (b"content-type", b"application/json")
