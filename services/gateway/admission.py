"""What an HTTP gateway takes on: tool calls held at most so many at once (and at most half of them for one caller),
none while its event loop runs late, each call's time counted from its arrival. Refusals are answered before the
MCP SDK builds its per-request transport, which is where a gateway's time went under load (a tester's profile: the
SDK's stateless plumbing, not the calls).

Without them, a gateway sent more than its one loop could read fell behind for good: every call's timer started
seconds after its request came, answers reached clients that had given up, the calls held grew to thousands (RSS
145 -> 877 MB), and the NATS server dropped the gateway as a slow consumer (10 s unread), losing every reply in
flight (docs/benchmarks.md, "MCP gateway under sustained overload")."""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections import Counter, deque
from contextvars import ContextVar
from dataclasses import dataclass, field

from opentelemetry.metrics import CallbackOptions, Observation
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ontofabric.shared.logging import get_logger
from ontofabric.shared.tasks import LATENESS_TICK_S
from ontofabric.shared.telemetry import meter

from .auth import CALLER
from .bodies import peek_body, replaying

log = get_logger(__name__)

ARRIVED: ContextVar[float] = ContextVar("ontofabric_gateway_arrived")
"""The event loop's time when the HTTP request of the call under way reached the gateway: its time counts from then."""
READ_FROM: ContextVar[float | None] = ContextVar("ontofabric_gateway_read_from", default=None)
"""When a middleware before admission began to read the request (Batches): the request arrived then, not when
admission saw it (a review found a slow upload's time left out of its call's)."""

MIN_RETRY_AFTER_S = 1.0
"""What a refused caller is told to wait at least; more while the loop runs later than half of it."""
LATE_LOOKS = 3
"""How many looks in a row must find the loop late before calls are refused: a pause gone by (a collection, a large
reply written) does not refuse the requests that queued behind it, which still have most of their time."""
PEEKED_BYTES = 65536
"""Of a request's body, what is read while refusing to tell a tool call from the rest: a larger one is taken."""
BODY_READ_S = 10.0
"""How long a request's body may take to arrive whole; then it is taken for a client gone (a slow upload would
otherwise hold its place for as long as its client likes)."""

refused_requests = meter().create_counter(
    "gateway.requests.refused",
    description="tool calls the MCP gateway refused on arrival, by reason: held (its limit of requests held at "
    "once, or a caller's share of it), late (its event loop running late), waited (read after half its time)",
)


class LoopLag:
    """How late the event loop runs (fed by :func:`~ontofabric.shared.tasks.watch_lateness`): the least lateness of
    its last LATE_LOOKS looks, the one due and not yet run counting as late as it is overdue."""

    def __init__(self, tick_s: float = LATENESS_TICK_S) -> None:
        self._tick_s = tick_s
        self._looks: deque[float] = deque([0.0] * LATE_LOOKS, maxlen=LATE_LOOKS)
        self._at: float | None = None

    def observe(self, late_s: float, now: float) -> None:
        self._looks.append(late_s)
        self._at = now

    def late_s(self, now: float) -> float:
        if self._at is None:
            return 0.0
        *before, last = self._looks
        return min([*before, max(last, now - self._at - self._tick_s)])


@dataclass
class Intake:
    """Whether a tool call is taken (pure: the counts are kept by its caller)."""

    max_held: int
    max_late_s: float
    held_by: Counter[str] = field(default_factory=Counter)
    """Requests held per caller (a token's client name; "" without tokens)."""

    @property
    def held(self) -> int:
        return sum(self.held_by.values())

    @property
    def share(self) -> int:
        """The most one caller may hold: half, so that one agent's flood leaves room for the others."""
        return max(1, self.max_held // 2)

    def refusal(self, caller: str, late_s: float) -> tuple[str, str] | None:
        """The reason (a metric's) and the words of a refusal, or None to take the call."""
        if self.held >= self.max_held:
            return "held", f"this gateway holds {self.held} requests, its limit (ONTOFABRIC_GATEWAY_MAX_HELD)"
        if caller and self.held_by[caller] >= self.share:
            # Held counts every request it sent, its initialize and lists too, which are always taken: it may hold
            # more than the share (a load tester read 199 as the share).
            held = self.held_by[caller]
            return "held", f"the token of {caller!r} holds {held} requests, its share of this gateway is {self.share}"
        if late_s > self.max_late_s:
            return "late", f"this gateway's event loop runs {late_s * 1000:.0f} ms late"
        return None

    def retry_after_ms(self, late_s: float) -> int:
        return round(max(MIN_RETRY_AFTER_S, 2 * late_s) * 1000)


class AdmitRequests:
    """ASGI middleware, after the bearer check (a request without a token is told so, not to come back later): a
    tool call beyond the Intake is answered at once with a retryable tool error (``error overloaded (retryable: try
    again in about N ms)``, as a worker's refusal reads). Other requests (initialize, ping, tools/list,
    notifications such as a cancellation) are brief, and taken whatever the load: a client refused its
    ``initialize`` would not connect at all (the TypeScript SDK throws on a 503). Each request taken has its arrival
    time in ARRIVED, and its body must arrive within BODY_READ_S."""

    def __init__(self, app: ASGIApp, intake: Intake, lag: LoopLag) -> None:
        self._app = app
        self.intake = intake
        self.lag = lag
        _SERVING.add(self)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self._app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        read_from = READ_FROM.get()
        now = loop.time() if read_from is None else read_from
        grant = CALLER.get()
        caller = grant.client if grant is not None else ""
        receive = body_within(receive, now + BODY_READ_S)
        late_s = self.lag.late_s(now)
        refusal = self.intake.refusal(caller, late_s)
        if refusal is not None:
            read, body = await peek_body(receive, PEEKED_BYTES)
            request_id = None if body is None else _tool_call_id(body)
            if request_id is not None:
                reason, words = refusal
                refused_requests.add(1, {"reason": reason})
                log.warning("gateway_call_refused", reason=reason, held=self.intake.held, late_ms=round(late_s * 1000))
                await _refuse(send, request_id, words, self.intake.retry_after_ms(late_s))
                return
            receive = replaying(read, receive)
        self.intake.held_by[caller] += 1
        arrived = ARRIVED.set(now)
        try:
            await self._app(scope, receive, send)
        finally:
            ARRIVED.reset(arrived)
            self.intake.held_by[caller] -= 1
            if not self.intake.held_by[caller]:
                del self.intake.held_by[caller]


_SERVING: weakref.WeakSet[AdmitRequests] = weakref.WeakSet()
"""The gateways of this process (one in a deployment), for their gauges."""


def _observe_held(_: CallbackOptions) -> list[Observation]:
    return [Observation(sum(admit.intake.held for admit in _SERVING))]


def _observe_late(_: CallbackOptions) -> list[Observation]:
    now = time.monotonic()  # the event loop's clock, read from the metric reader's thread
    return [Observation(max((admit.lag.late_s(now) for admit in _SERVING), default=0.0) * 1000)]


meter().create_observable_gauge(
    "gateway.requests.held",
    callbacks=[_observe_held],
    description="requests the MCP gateway holds (read and not yet answered)",
)
meter().create_observable_gauge(
    "gateway.loop.late_ms",
    unit="ms",
    callbacks=[_observe_late],
    description="how late the MCP gateway's event loop runs, as its tool calls are refused by",
)


def body_within(receive: Receive, deadline: float) -> Receive:
    """``receive``, with a body that has not arrived whole by ``deadline`` read as the client gone."""
    whole = False

    async def receiving() -> Message:
        nonlocal whole
        if whole:  # what comes after the body (the client leaving) may take as long as the answer does
            return await receive()
        try:
            async with asyncio.timeout_at(deadline):
                message = await receive()
        except TimeoutError:
            whole = True
            return {"type": "http.disconnect"}
        whole = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    return receiving


def _tool_call_id(body: bytes) -> int | str | None:
    """The id of the request if it is a tool call; None for anything else, or a body ill-formed (the SDK's to
    answer)."""
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(request, dict) or request.get("method") != "tools/call":
        return None
    request_id = request.get("id")
    return request_id if isinstance(request_id, int | str) and not isinstance(request_id, bool) else None


async def _refuse(send: Send, request_id: int | str, words: str, retry_after_ms: int) -> None:
    text = f"error overloaded (retryable: try again in about {retry_after_ms} ms): {words}"
    result = {"content": [{"type": "text", "text": text}], "isError": True}
    body = json.dumps({"jsonrpc": "2.0", "id": request_id, "result": result}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})
