"""A request-reply client of the query workers: ontology_query, a document by id, a workspace's status. What gateways
and the CLI use."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from weakref import WeakKeyDictionary

from nats.aio.client import NO_RESPONDERS_STATUS, Client
from nats.aio.msg import Msg
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import Header
from opentelemetry import propagate
from opentelemetry.trace import Span, SpanKind, StatusCode, get_current_span
from pydantic import BaseModel, ValidationError

from ontofabric.contracts import (
    MAX_REQUEST_BYTES,
    MAX_TIMEOUT_MS,
    RECEIPT_HEADER,
    RECEIVED,
    SENT_AT_HEADER,
    TIMEOUT_HEADER,
    DocumentReply,
    DocumentRequest,
    ErrorReply,
    OntologyQuery,
    QueryError,
    QueryResponse,
    StatusReply,
    StatusRequest,
)
from ontofabric.contracts.query import validation_details
from ontofabric.shared.jetstream import PermissionDenied, refused_promptly
from ontofabric.shared.logging import get_logger
from ontofabric.shared.subjects import Names, Operation
from ontofabric.shared.tasks import start_held
from ontofabric.shared.telemetry import meter, tracer

from .deadlines import RecentDelay, header_value

Reply = TypeVar("Reply", QueryResponse, DocumentReply, StatusReply)
log = get_logger(__name__)

_resent = meter().create_counter(
    "query.client.resent",
    description="requests the client sent again, by reason: no_receipt or no_reply (its worker went silent), "
    "waited_out (an overloaded refusal's stated wait), clock (a worker whose clock disagrees took the request for "
    "an old one)",
)
_not_retried = meter().create_counter(
    "query.client.retries_declined",
    description="refusals the client returned at once rather than sending again (a stated wait, a send time "
    "misread): its retry budget was spent",
)


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
"""The wait is at least this many times the latest slow receipt on the connection (late ones included, that came
after their request had its answer from elsewhere): workers whose event loops run late are not sent more of the
same work."""
MAX_RECEIPT_DELAY_S = 2.0
"""A receipt later than this counts as this late: a worker that was frozen for a while and wakes sends its receipts
late by the freeze, which would stop frozen workers being noticed for as long."""
RECEIPTLESS_HOLD_S = 60.0
"""Silence is taken for a frozen worker only on a connection that has had a receipt, and not for this long after a
reply that came without its receipt (a worker of an earlier release): such a worker would be sent every slow
request again and again."""
ENDED_KEPT_S = 10.0
"""How long a request's silent attempts are remembered after it had its answer, for their late receipts."""
MAX_SENDS = 8
"""Sends of one request in all, while a send still fits in the time left (MIN_SECOND_ATTEMPT_S). Within a queue
group each send goes to any worker, the frozen one too: with one of two frozen, a request fails only when every
send goes to it (1 in 256 with eight, which takes a timeout of a little over 8 s: seven fit in 8 s, four in 5 s)."""
NO_RESPONDER_RETRIES = 5
NO_RESPONDER_BACKOFF_S = 0.03
"""While no worker listens (a restart), a request is sent again NO_RESPONDER_RETRIES times, after 30 ms, 60 ms,
... (about a second in all); then no more."""
CLIENT_STALL_S = 0.1
"""A wait that ended this much later than it was due: the client's own event loop stalled, and receipts may be
waiting unread in its socket. Before deciding, the client gives its reader STALL_CATCH_UP_S to hand them over
(from the socket through nats-py's reader and the subscription's task: a few turns of the loop)."""
STALL_CATCH_UP_S = 0.02
SERVER_STALL_S = 0.5
"""A ping the server answered this much later than it was sent: the server itself was not reading (frozen, or its
host paused). What was sent before it reached the workers only then, so its receipts are waited for from then."""
PROBE_TIMEOUT_S = 600.0
"""How long a ping of the server is waited for at least: longer than nats-py's own pings take to call the connection
stale and reconnect (within six minutes at its defaults: two minutes apart, two left unanswered), which drops the
ping (see :func:`probe_timeout_s`). Never less: nats-py 2.16 cancels a timed-out flush's future but leaves it queued,
and the pong that comes later breaks the connection's reader."""
CLOSE_POLL_S = 0.1
"""How often a connection's waiting requests look whether it was closed (:meth:`ReplyInbox.wake_at_close`)."""
PROBE_POLL_S = 0.25
"""How often a ping under way, and a request waiting for it, look whether the connection was lost or replaced
meanwhile: nats-py then drops the ping without a word."""
PUSHBACK_MIN_LEFT_S = 0.5
"""A refusal's stated wait (``retryAfterMs``) is waited out and the request sent again only when this much of the
caller's time is left after it (the worker is told half of it, less the way back: about what one answer takes
under load); else the refusal is returned at once."""
PUSHBACK_JITTER = 0.2
"""The wait is stretched by up to this share at random, so that callers refused together do not all come back at the
same moment."""
RETRY_SHARE = 0.2
MIN_RETRIES_PER_S = 10.0
RETRY_WINDOW_S = 10.0
"""The retry budget (:class:`RetryBudget`): Finagle's defaults (20 % of requests on top of 10 retries a second,
each counted for 10 s)."""
CLOCK_DOUBT_S = 600.0
"""How long a connection sends no send time (SENT_AT_HEADER) after a worker read one as older than the request
really was: their clocks disagree (a tester's client 7 s behind had every request refused). Then it tries again,
in case the clocks were set right meanwhile."""
REQUEST_HEADER_ROOM_BYTES = 4096
"""Of the server's max_payload, what a request leaves for its headers (the timeout, trace context): the server
counts them in, nats-py checks the body alone."""


class ClientError(Exception):
    """What a request of :class:`QueryClient` raises when it gets no reply, whatever the cause: an application
    catches this one (it caught exceptions of four modules: nats', pydantic's, this one's and builtins). A refusal
    a worker sent is a reply (:class:`ErrorReply`), not this. Each kind is also the exception it replaces (nats'
    ``TimeoutError``, ``NoRespondersError``, ``ConnectionClosedError``, ``ValueError``), so code that caught those
    still does."""

    def __str__(self) -> str:  # nats' errors print a fixed text of their own, which would hide the message
        return Exception.__str__(self)


class RequestTooLarge(ClientError, ValueError):
    """A request body no worker would read (the protocol's limit) or the NATS server would not take; nothing was
    sent."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"the request takes {size:,} bytes as JSON; a request takes at most {limit:,}")
        self.size = size
        self.limit = limit


class RequestInvalid(ClientError, ValueError):
    """A request given as a dict that its contract refuses, with the fields named (``details``, as a worker's
    error reply names them); nothing was sent."""

    def __init__(self, model: type[BaseModel], error: ValidationError) -> None:
        self.details = validation_details(error.errors())
        problems = "; ".join(f"{d.field or '<body>'}: {d.message}" for d in self.details)
        super().__init__(f"the request is not a valid {model.__name__}: {problems}")


class RequestForbidden(ClientError, PermissionDenied):
    """The NATS server refused this connection's credentials the request's subject: another workspace's."""


class NoQueryWorker(ClientError, NoRespondersError):
    """No query worker listens on the workspace's subject (none runs, or all are restarting), after the second or
    so of sends again that a restart takes."""


class NoReplyInTime(ClientError, NatsTimeoutError):
    """No reply within the client's timeout: the workers were busy or slow, or it was lost with one."""


class ConnectionDown(NoReplyInTime):
    """No reply within the timeout, and the connection to NATS was down (reconnecting) at its end: a NATS server
    away, not a slow worker."""


class ConnectionEnded(ClientError, ConnectionClosedError):
    """The connection was closed while the request waited."""


@dataclass(eq=False)
class Attempt:
    """One send of a request: when it went, the time its worker was told, whether it said it has it."""

    sent_at: float
    told_s: float
    """The timeout it was sent with, and the way back."""
    receipt_asked: bool = True
    connection: int = 0
    """Which of the client's connections to the server it went out on (nats-py's count of reconnects)."""
    receipt_at: float | None = None
    done: bool = False
    """Answered or refused; nothing more is awaited from it."""
    listened_since: float = 0.0
    """Whence its receipt wait counts: the send, or when the client could hear again (its connection back, its
    event loop running after a stall)."""

    def __post_init__(self) -> None:
        self.listened_since = max(self.listened_since, self.sent_at)

    @property
    def due_at(self) -> float:
        """By when its worker owes the reply: the time it was told, from when it read the request (its receipt) or
        else from the send."""
        return (self.receipt_at if self.receipt_at is not None else self.sent_at) + self.told_s

    def heard_until(self, receipt_wait_s: float | None) -> float:
        """Until when this attempt's silence is expected: a receipt comes within ``receipt_wait_s`` of the send
        (None: receipts are not trusted on this connection), the reply by ``due_at``."""
        if self.receipt_at is not None or not self.receipt_asked or receipt_wait_s is None:
            return self.due_at
        return min(self.due_at, self.listened_since + receipt_wait_s)


def send_again_at(attempts: Sequence[Attempt], receipt_wait_s: float | None) -> float | None:
    """When the request is to be sent again: once no open attempt can still be expected to answer. None when
    every attempt is done (nothing is awaited)."""
    open_attempts = [a.heard_until(receipt_wait_s) for a in attempts if not a.done]
    return max(open_attempts) if open_attempts else None


def attempt_timeout(left_s: float, sends_left: int) -> float:
    """What an attempt is given of the time left: all of it, or FIRST_ATTEMPT_SHARE when another send still fits
    after it."""
    another_fits = sends_left > 1 and left_s * (1 - FIRST_ATTEMPT_SHARE) >= MIN_SECOND_ATTEMPT_S
    return left_s * FIRST_ATTEMPT_SHARE if another_fits else left_s


def retryable_refusal(body: bytes) -> QueryError | None:
    """A worker's retryable error reply (overloaded, deadline_exceeded), read: another worker may still answer, or
    the same one after the wait it states."""
    if not body.startswith(b'{"error"'):
        return None
    try:
        error = ErrorReply.model_validate_json(body).error
    except ValidationError:
        return None
    return error if error.retryable else None


class RetryBudget:
    """Whether a refusal's stated wait may be waited out and the request sent again: Finagle's retry budget. Over
    the last ``window_s``, retries may number ``share`` of the requests asked plus ``min_per_s`` a second. A burst
    that passes is retried; while the workers refuse more than that (sustained overload), the callers do not add
    their retries to the load. Counted by the second, so its memory does not grow with the request rate."""

    def __init__(
        self, share: float = RETRY_SHARE, min_per_s: float = MIN_RETRIES_PER_S, window_s: float = RETRY_WINDOW_S
    ) -> None:
        self._share = share
        self._reserve = min_per_s * window_s
        self._seconds = math.ceil(window_s)
        self._counts: deque[list[int]] = deque()
        """[second, requests asked, retries taken] for each second of the window that had any."""

    def asked(self, now: float) -> None:
        """A request was asked (its first send)."""
        self._this_second(now)[1] += 1

    def take_retry(self, now: float) -> bool:
        """Whether a retry may go now; if so, it is counted."""
        counts = self._this_second(now)
        asked = sum(c[1] for c in self._counts)
        if sum(c[2] for c in self._counts) >= self._reserve + self._share * asked:
            return False
        counts[2] += 1
        return True

    def _this_second(self, now: float) -> list[int]:
        second = math.floor(now)
        while self._counts and self._counts[0][0] <= second - self._seconds:
            self._counts.popleft()
        if not self._counts or self._counts[-1][0] != second:
            self._counts.append([second, 0, 0])
        return self._counts[-1]


def is_receipt(msg: Msg) -> bool:
    return header_value(msg.headers, RECEIPT_HEADER) == RECEIVED and not msg.data


def request_json(request: dict[str, Any]) -> bytes:
    """A request written as JSON in UTF-8, as the worker measures it against its size limit: escaping every other
    character as ``\\uXXXX`` made a request of 12,000 CJK characters twice its size (a tester's finding). A lone half
    of a character (from a client, or an argument of undecodable bytes) stays escaped, for the worker to name its
    field."""
    try:
        return json.dumps(request, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(request).encode()


def request_headers(timeout_s: float, receipt: bool = True, sent_at: bool = True) -> dict[str, str]:
    """A request's headers: the timeout the worker is told (less the way back), when it was sent (unless
    ``sent_at`` is False: the clocks disagree), the receipt asked for, and the trace context."""
    # The worker answers or refuses within the timeout it is told, and does no work once it has passed.
    told_s = max(timeout_s - WAY_BACK_S, timeout_s / 2)
    headers = {TIMEOUT_HEADER: str(max(1, min(MAX_TIMEOUT_MS, round(told_s * 1000))))}
    if sent_at:  # a worker that stalled does no work for us once gone
        headers[SENT_AT_HEADER] = str(round(time.time() * 1000))
    if receipt:
        headers[RECEIPT_HEADER] = "requested"
    propagate.inject(headers)
    return headers


class ServerReads:
    """What pings said of the server a connection talks to: what it has read of what was sent, and when it came
    back after not reading (frozen, its host paused)."""

    def __init__(self) -> None:
        self._read_until = -math.inf
        """What this connection sent before this moment the server has read: a ping sent then had its pong."""
        self.back_at = -math.inf
        """When the server last answered a ping SERVER_STALL_S late or later: it had not been reading till then."""
        self._probing: int | None = None
        """The connection a ping of the server is out on, if one is."""
        self._probe_waiters: set[Callable[[], None]] = set()
        """Who waits for the ping under way: each exchange's wake once, until it ends."""
        self._unasked_at = -math.inf
        """When a ping of the server last failed."""

    def has_read(self, nc: Client, attempt: Attempt, wake: Callable[[], None]) -> bool:
        """Whether the server has read ``attempt``: a ping sent after it had its pong (the server reads a connection
        in order; a message it sent meanwhile says nothing of what it has read). An attempt out on an earlier
        connection may have been lost with it, and one out before a ping failed cannot be asked about: True.
        Otherwise a ping goes out, unless one is out already (one at a time, so a frozen server gets one), and
        ``wake`` is called when it is answered, fails or is dropped with its connection: a request is not sent
        again into a frozen server, whose socket would hand every copy to the workers when it wakes."""
        connection = nc.stats["reconnects"]
        if attempt.connection != connection or max(self._read_until, self._unasked_at) >= attempt.sent_at:
            return True
        self._probe_waiters.add(wake)
        if self._probing != connection:  # none out, or out on an earlier connection, which dropped it
            self._probing = connection
            start_held(self._probe(nc, connection), _PROBES)
        return False

    def forget(self, wake: Callable[[], None]) -> None:
        self._probe_waiters.discard(wake)

    async def _probe(self, nc: Client, connection: int) -> None:
        loop = asyncio.get_running_loop()
        sent = loop.time()
        try:
            # nats-py writes the ping ahead of publishes it still holds back, as it does only while the socket is
            # full: the pong then comes late, and the receipt waits start again from it (back_at).
            flush = loop.create_task(nc.flush(timeout=probe_timeout_s(nc)))  # type: ignore[arg-type]
            while not flush.done():
                await asyncio.wait({flush}, timeout=PROBE_POLL_S)
                if not flush.done() and (nc.is_closed or nc.stats["reconnects"] != connection):
                    # nats-py dropped the connection's pings with it: this pong will not come, and no later one
                    # can find the cancelled ping's future (the trap of PROBE_TIMEOUT_S).
                    flush.cancel()
                    return
            flush.result()
        except Exception:  # closed, or no pong in the probe's time: the server cannot be asked; judged as before
            self._unasked_at = loop.time()
        else:
            # nats-py's flush returns at once, without a ping, while it reconnects: that says nothing.
            if nc.is_connected and nc.stats["reconnects"] == connection:
                now = loop.time()
                self._read_until = max(self._read_until, sent)
                if now - sent >= SERVER_STALL_S:
                    self.back_at = now
        finally:
            if self._probing == connection:
                self._probing = None
            waiters, self._probe_waiters = self._probe_waiters, set()
            for wake in waiters:
                wake()


class ReplyInbox:
    """Where a connection's QueryClient requests get their replies: one subscription for all of them, routed by
    reply subject (as nats-py's own request does), what their receipts said of the workers lately, and what pings
    said of the server (:class:`ServerReads`). A subscription per request would cost a SUB, an UNSUB and a task
    each. Holds no reference to its connection, which keys it in a WeakKeyDictionary (a ping under way does, until
    it ends)."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._routes: dict[str, tuple[Attempt, Callable[[Msg], None]]] = {}
        self._ended: OrderedDict[str, tuple[Attempt, float]] = OrderedDict()
        """Silent attempts of requests that had their answer, until when they are kept: their late receipts count."""
        self._subscribing = asyncio.Lock()
        self._subscribed = False
        self._receipt_delays = RecentDelay()
        self._receipt_seen = False
        self._receiptless_at: float | None = None
        self.server = ServerReads()
        self.retries = RetryBudget()
        """Shared by every request on the connection, as Finagle's is by every request of a client."""
        self.clock_doubted_until = 0.0
        """Until when requests go without a send time (CLOCK_DOUBT_S)."""
        self._woken_at_close: set[Callable[[], None]] = set()
        self._close_watch: asyncio.Task[None] | None = None

    def doubt_clocks(self, now: float, read_as: str) -> None:
        if now >= self.clock_doubted_until:
            log.warning(
                "query_clocks_disagree", read_as=read_as, for_s=CLOCK_DOUBT_S,
                note=f"a worker took a request for older than it was: sent without {SENT_AT_HEADER} meanwhile; "
                "synchronise the clocks (NTP)",
            )  # fmt: skip
        self.clock_doubted_until = now + CLOCK_DOUBT_S

    def receipt_wait_s(self, now: float) -> float | None:
        """How long an attempt may go without its receipt; None while silence is not to be taken for a frozen
        worker on this connection: no receipt yet, or a reply without one lately."""
        if not self._receipt_seen or (
            self._receiptless_at is not None and now - self._receiptless_at <= RECEIPTLESS_HOLD_S
        ):
            return None
        return max(RECEIPT_WAIT_S, RECEIPT_WAIT_FACTOR * self._receipt_delays.at(now))

    def heard(self, attempt: Attempt, msg: Msg, now: float, *, ended: bool = False) -> None:
        """What a message says of the workers: how late a receipt came, or that a worker sends none (not said by a
        reply to a request that had its answer elsewhere: its receipt may have been dropped with the request)."""
        if is_receipt(msg):
            self._receipt_seen = True
            if attempt.receipt_at is None:
                attempt.receipt_at = now
                # From when the client could hear it: its own outages and stalls, and the server's, are not the
                # worker's delay.
                since = max(attempt.listened_since, self.server.back_at)
                self._receipt_delays.observe(min(now - since, MAX_RECEIPT_DELAY_S), now)
        elif (
            not ended
            and attempt.receipt_asked
            and attempt.receipt_at is None
            and header_value(msg.headers, Header.STATUS) is None
        ):
            self._receiptless_at = now

    def wake_at_close(self, nc: Client, wake: Callable[[], None]) -> None:
        """Call ``wake`` when ``nc`` is closed: a request waiting for its answer then ends at once. They waited for
        their next timer, up to 0.65 of their timeout (a tester's application closing its connection). One look
        every CLOSE_POLL_S a connection, while requests wait: nats-py tells no one but its own callback."""
        self._woken_at_close.add(wake)
        if self._close_watch is None or self._close_watch.done():
            self._close_watch = asyncio.get_running_loop().create_task(self._watch_close(nc))

    def forget_at_close(self, wake: Callable[[], None]) -> None:
        self._woken_at_close.discard(wake)

    async def _watch_close(self, nc: Client) -> None:
        while self._woken_at_close:  # ends with the last request: the connection is not held after
            if nc.is_closed:
                for wake in list(self._woken_at_close):
                    wake()
                return
            await asyncio.sleep(CLOSE_POLL_S)

    async def open(self, nc: Client, attempt: Attempt, route: Callable[[Msg], None]) -> str:
        """A new reply subject whose messages go to ``route`` until :meth:`close`."""
        async with self._subscribing:
            if not self._subscribed:
                await nc.subscribe(f"{self._prefix}*", cb=self._route)
                self._subscribed = True
        subject = f"{self._prefix}{uuid.uuid4().hex}"
        self._routes[subject] = (attempt, route)
        return subject

    def close(self, subject: str, now: float) -> None:
        opened = self._routes.pop(subject, None)
        if opened is not None:
            attempt = opened[0]
            if attempt.receipt_asked and attempt.receipt_at is None and not attempt.done:
                self._ended[subject] = (attempt, min(attempt.due_at, now + ENDED_KEPT_S))
        while self._ended and next(iter(self._ended.values()))[1] <= now:  # kept at most ENDED_KEPT_S: in order
            self._ended.popitem(last=False)

    async def _route(self, msg: Msg) -> None:
        opened = self._routes.get(msg.subject)
        if opened is not None:
            opened[1](msg)
            return
        ended = self._ended.pop(msg.subject, None)
        if ended is not None:  # a receipt after its request had its answer from elsewhere: the worker was slow
            self.heard(ended[0], msg, asyncio.get_running_loop().time(), ended=True)


def probe_timeout_s(nc: Client) -> float:
    """PROBE_TIMEOUT_S, or longer for a connection whose own pings would take longer to call it stale."""
    options = nc.options
    return float(max(PROBE_TIMEOUT_S, options["ping_interval"] * (options["max_outstanding_pings"] + 2)))


_INBOXES: WeakKeyDictionary[Client, ReplyInbox] = WeakKeyDictionary()
_PROBES: set[asyncio.Task[None]] = set()
"""Pings of the server under way (asyncio keeps only weak references to tasks)."""


SERVER_FAULTS = frozenset({"internal", "unavailable", "deadline_exceeded"})
"""The error codes that mark a request's spans as failed: the service could not answer. A request refused as
invalid, for an id not found, or for load (to be sent again later) is an answer, as for an RPC's server span."""


def error_code(body: bytes) -> str | None:
    """The code of an error reply (:class:`ErrorReply`); None for an answer, and for a reply that cannot be read
    (a worker of another version, a broken reply: its reader says so; a review's `{"error": "boom"}` raised here)."""
    if not body.startswith(b'{"error":'):
        return None
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None


def mark_reply(span: Span, body: bytes) -> None:
    """An error reply said on the request's span, the client's or the worker's: its code as ``error.type``, and
    ERROR for the service's faults (:data:`SERVER_FAULTS`)."""
    code = error_code(body)
    if code is not None:
        span.set_attribute("error.type", code)
        if code in SERVER_FAULTS:
            span.set_status(StatusCode.ERROR, code)


class QueryClient:
    def __init__(
        self, nc: Client, names: Names, timeout_s: float = 10.0, *, receipts: bool = True, pushback: bool = True
    ) -> None:
        """``receipts`` False: no receipt is asked for, and a request is sent again only when its worker stays
        silent past the timeout it was told (what tests/benchmarks/faults_frozen_worker.py compares against).
        ``pushback`` False: an ``overloaded`` refusal is returned as it comes, its stated wait not waited out."""
        if not (0 < timeout_s < math.inf):  # NaN too: refused here, not by a header made of it at the first send
            raise ValueError(f"timeout_s must be a positive number of seconds, not {timeout_s!r}")
        self._nc = nc
        self._names = names
        self._timeout_s = timeout_s
        self._receipts = receipts
        self._pushback = pushback

    async def send_raw(self, workspace: str, body: bytes, operation: Operation = "query") -> bytes:
        """Send a request body as is, within the client's timeout, and return the first reply. A request is sent
        again, while time is left, when no worker has it: its receipt did not come (the worker is frozen or gone)
        or its worker went silent past the timeout it was told (it died with the request). Earlier attempts stay
        open, and a retryable refusal is returned only when no other attempt is still expected to answer. A refusal
        that states a wait (``retryAfterMs``) is waited out and the request sent again, when the time left allows
        and the connection's RetryBudget does. While no worker listens (a restart), it is retried for up to a
        second. Raises RequestTooLarge for a body the server would not take or no worker would read,
        NoRespondersError when no worker listens, nats' TimeoutError when no reply came in time."""
        # One limit whatever the size: the gateway once quoted the server's for 2 MB and the worker's for 100 kB.
        limit = min(self._nc.max_payload - REQUEST_HEADER_ROOM_BYTES, MAX_REQUEST_BYTES)
        if len(body) > limit:
            raise RequestTooLarge(len(body), limit)
        subject = self._names.request_subject(operation, workspace)
        # A span of its own, whose context each send carries: with none current (`ontofabric query`), the worker's
        # span began a trace of its own; and a gateway's trace showed no request, nor its sends again.
        with tracer().start_as_current_span(f"{operation} request", kind=SpanKind.CLIENT) as span:
            span.set_attribute("messaging.system", "nats")
            span.set_attribute("messaging.destination.name", subject)
            # A subject these credentials may not use fails at once, not after the timeout.
            try:
                answer = await refused_promptly(self._nc, subject, self._exchange(subject, body))
            except PermissionDenied as error:
                raise RequestForbidden(str(error)) from None
            mark_reply(span, answer)
            return answer

    async def _exchange(self, subject: str, body: bytes) -> bytes:
        inbox = _INBOXES.get(self._nc) or _INBOXES.setdefault(self._nc, ReplyInbox(f"{self._nc.new_inbox()}."))
        exchange = Exchange(self._nc, inbox, subject, body, self._timeout_s, self._receipts, self._pushback)
        return await exchange.run()

    async def query(self, workspace: str, query: OntologyQuery | dict[str, Any]) -> QueryResponse | ErrorReply:
        return parse_reply(await self._send(workspace, OntologyQuery, query, "query"), QueryResponse)

    async def document(self, workspace: str, request: DocumentRequest | dict[str, Any]) -> DocumentReply | ErrorReply:
        return parse_reply(await self._send(workspace, DocumentRequest, request, "document"), DocumentReply)

    async def status(self, workspace: str, request: StatusRequest | dict[str, Any]) -> StatusReply | ErrorReply:
        return parse_reply(await self._send(workspace, StatusRequest, request, "status"), StatusReply)

    async def _send(
        self, workspace: str, model: type[BaseModel], request: BaseModel | dict[str, Any], operation: Operation
    ) -> bytes:
        try:
            validated = request if isinstance(request, model) else model.model_validate(request)
        except ValidationError as error:
            raise RequestInvalid(model, error) from None
        return await self.send_raw(workspace, validated.model_dump_json(exclude_none=True).encode(), operation)


class Exchange:
    """One request's sends and what came back for them, until its answer (:meth:`QueryClient.send_raw`)."""

    def __init__(
        self,
        nc: Client,
        inbox: ReplyInbox,
        subject: str,
        body: bytes,
        timeout_s: float,
        receipts: bool,
        pushback: bool = True,
    ) -> None:
        self._nc = nc
        self._inbox = inbox
        self._subject = subject
        self._body = body
        self._receipts = receipts
        self._pushback = pushback
        self._resend_at: float | None = None
        """When a refusal's stated wait is over and the request goes out again."""
        self._resend_reason = "waited_out"
        self._pushed_back: bytes | None = None
        """The last refusal whose wait was waited out: returned when the sends after it have no answer in the
        caller's time. Once no worker listens any more, NoRespondersError says so instead."""
        self._loop = asyncio.get_running_loop()
        self._timeout_s = timeout_s
        self._ends = self._loop.time() + timeout_s
        self._replies: deque[tuple[Attempt, Msg]] = deque()
        self._arrived = asyncio.Event()
        self._attempts: list[Attempt] = []
        self._reply_subjects: list[str] = []
        self._refused: bytes | None = None
        """A retryable refusal held back while another attempt is still expected to answer."""
        self._no_responders = 0
        self._may_send = True
        """False once "no responders" came too often: no worker listens, and no send more is made."""

    async def run(self) -> bytes:
        try:
            self._inbox.retries.asked(self._loop.time())
            self._inbox.wake_at_close(self._nc, self._arrived.set)
            await self._send()
            while True:
                self._listen_since(self._inbox.server.back_at)
                if self._replies:
                    answer = await self._take(*self._replies.popleft())
                    if answer is not None:
                        return answer
                    continue
                if self._nc.is_closed:
                    raise ConnectionEnded("the connection to NATS was closed while the request waited")
                now = self._loop.time()
                if now >= self._ends:
                    return self._out_of_time()
                if not self._nc.is_connected:
                    await self._wait_for_connection(now)
                    continue
                again_at = send_again_at(self._attempts, self._inbox.receipt_wait_s(now))
                if again_at is None and self._resend_at is not None:  # refused, with a wait to wait out
                    if now < self._resend_at:
                        await self._wait(now, self._resend_at)
                        continue
                    self._resend_at = None
                    if self._ends - now < PUSHBACK_MIN_LEFT_S:  # the wait ran late (a stall, a reconnection)
                        assert self._pushed_back is not None
                        return self._pushed_back
                    await self._send_again(self._resend_reason)
                    continue
                if again_at is None or again_at <= now:  # no attempt is open, or none is expected to answer
                    if self._refused is not None:
                        return self._refused
                    if not self._may_send:  # no worker listens: any that had it, or refused it, is gone
                        raise NoQueryWorker(f"no query worker listens on {self._subject}")
                    if again_at is None:  # the first send, or the next after "no responders"
                        await self._send()
                        continue
                    if len(self._attempts) < MAX_SENDS and self._ends - now >= MIN_SECOND_ATTEMPT_S:
                        if not self._inbox.server.has_read(self._nc, self._attempts[-1], self._arrived.set):
                            await self._wait(now, min(self._ends, now + PROBE_POLL_S))  # the ping's answer
                            continue
                        open_attempts = [a for a in self._attempts if not a.done]  # a refused one said nothing of this
                        silent = "no_receipt" if all(a.receipt_at is None for a in open_attempts) else "no_reply"
                        await self._send_again(silent)
                        continue
                    again_at = self._ends  # no room for another send: the open attempts have the rest
                await self._wait(now, min(self._ends, again_at))
        except ConnectionClosedError as error:  # a send on a connection closed meanwhile (nats-py's, at publish)
            if isinstance(error, ClientError):
                raise
            raise ConnectionEnded("the connection to NATS was closed while the request waited") from None
        finally:
            self._close()

    def _out_of_time(self) -> bytes:
        """At the client's timeout: a retryable refusal held back for an attempt that never answered, or else
        NoReplyInTime (ConnectionDown when the connection to NATS is down at the end)."""
        refused = self._refused or self._pushed_back
        if refused is not None:
            return refused
        if not self._nc.is_connected:
            raise ConnectionDown(
                f"no reply within {self._timeout_s:g} s: the connection to NATS is down (reconnecting), so the "
                "request may not have reached a worker"
            )
        raise NoReplyInTime(f"no reply from a query worker on {self._subject} within {self._timeout_s:g} s")

    async def _send_again(self, reason: str) -> None:
        """Another send of the request, logged and counted: its worker went silent (``no_receipt``, ``no_reply``:
        a warning), it was refused with a wait now waited out (``waited_out``), or for a send time misread
        (``clock``)."""
        level = log.info if reason in ("waited_out", "clock") else log.warning
        level("query_request_resent", subject=self._subject, sends=len(self._attempts) + 1, reason=reason)
        get_current_span().add_event("resent", {"reason": reason, "sends": len(self._attempts) + 1})
        _resent.add(1, {"reason": reason})
        await self._send()

    async def _send(self) -> None:
        now = self._loop.time()
        told_s = attempt_timeout(self._ends - now, MAX_SENDS - len(self._attempts))
        attempt = Attempt(now, told_s, receipt_asked=self._receipts)

        def route(msg: Msg) -> None:
            self._replies.append((attempt, msg))
            self._arrived.set()

        self._reply_subjects.append(await self._inbox.open(self._nc, attempt, route))
        self._attempts.append(attempt)
        headers = request_headers(told_s, self._receipts, sent_at=now >= self._inbox.clock_doubted_until)
        # Read with nothing awaited before the publish; sent while reconnecting, it goes out on the next connection.
        attempt.connection = self._nc.stats["reconnects"] + (0 if self._nc.is_connected else 1)
        await self._nc.publish(self._subject, self._body, reply=self._reply_subjects[-1], headers=headers)

    async def _take(self, attempt: Attempt, msg: Msg) -> bytes | None:
        """The answer to return, or None: a receipt, "no responders", or a refusal held back."""
        self._inbox.heard(attempt, msg, self._loop.time())
        if is_receipt(msg):
            return None
        attempt.done = True
        if header_value(msg.headers, Header.STATUS) == NO_RESPONDERS_STATUS:
            self._attempts.remove(attempt)  # it reached no worker: not a send of the budget
            self._no_responders += 1
            backoff_s = NO_RESPONDER_BACKOFF_S * 2 ** (self._no_responders - 1)
            if self._no_responders <= NO_RESPONDER_RETRIES and self._loop.time() + backoff_s < self._ends:
                await asyncio.sleep(backoff_s)  # then sent again, once nothing is open
            else:
                self._may_send = False
            return None
        answer = bytes(msg.data)
        refusal = retryable_refusal(answer)
        if refusal is None:
            return answer
        now = self._loop.time()
        again_at = send_again_at(self._attempts, self._inbox.receipt_wait_s(now))
        read_as = _sent_at_misread(refusal, attempt, now)
        if read_as is not None:
            self._inbox.doubt_clocks(now, read_as)  # the next sends go without the header, whatever comes of this
            if again_at is None and self._may_resend(now, now):
                self._pushed_back, self._resend_at, self._resend_reason = answer, now, "clock"
                return None
        if again_at is not None and again_at > now:
            self._refused = answer  # another attempt is still expected to answer
            return None
        if again_at is None and (resend_at := self._pushed_back_until(refusal, now)) is not None:
            self._pushed_back, self._resend_at, self._resend_reason = answer, resend_at, "waited_out"
            return None
        return answer

    def _pushed_back_until(self, refusal: QueryError, now: float) -> float | None:
        """When to send the request again after a refusal stating its wait, or None (:meth:`_may_resend`)."""
        if refusal.retry_after_ms is None:
            return None
        resend_at = now + refusal.retry_after_ms / 1000 * (1 + PUSHBACK_JITTER * random.random())
        return resend_at if self._may_resend(resend_at, now) else None

    def _may_resend(self, resend_at: float, now: float) -> bool:
        """Whether a refused request may go again at ``resend_at`` (after a stated wait, or at once without a send
        time misread): asked to, a send left, enough of the caller's time left after it, and the connection's
        retry budget not spent (requests in flight when the clocks are found to disagree are refused alike)."""
        if not self._pushback or not self._may_send or len(self._attempts) >= MAX_SENDS:
            return False
        if self._ends - resend_at < PUSHBACK_MIN_LEFT_S:
            return False
        if not self._inbox.retries.take_retry(now):
            _not_retried.add(1)
            return False
        return True

    async def _wait_for_connection(self, now: float) -> None:
        """Nothing can be heard while the connection is down, and sends would wait in its buffer to reach the
        workers all at once when it is back; the silent attempts' receipt waits start again when it is."""
        await asyncio.sleep(min(CLIENT_STALL_S, self._ends - now))
        self._listen_since(self._loop.time())

    def _listen_since(self, moment: float) -> None:
        """The attempts' receipt waits count from ``moment`` at the earliest: till then nothing could be heard (the
        connection was down, or the server was not reading)."""
        for attempt in self._attempts:
            attempt.listened_since = max(attempt.listened_since, moment)

    async def _wait(self, now: float, wake: float) -> None:
        """Until a reply or a receipt arrives (or the ping waited for ends), or ``wake``."""
        self._arrived.clear()
        try:
            async with asyncio.timeout(wake - now):
                await self._arrived.wait()
        except TimeoutError:
            if self._loop.time() - wake > CLIENT_STALL_S:  # this loop stalled: receipts may wait unread
                await asyncio.sleep(STALL_CATCH_UP_S)

    def _close(self) -> None:
        self._inbox.server.forget(self._arrived.set)
        self._inbox.forget_at_close(self._arrived.set)
        now = self._loop.time()
        for attempt, msg in self._replies:  # arrived with the answer, unread: what they say of the workers counts
            self._inbox.heard(attempt, msg, now, ended=True)
        for reply_subject in self._reply_subjects:
            self._inbox.close(reply_subject, now)


def _sent_at_misread(refusal: QueryError, attempt: Attempt, now: float) -> str | None:
    """What a worker read the send time as, when it refused the attempt for time that, by this client's own clock,
    it still had: the two clocks disagree (a worker ahead, or this host behind). None otherwise."""
    if refusal.code != "deadline_exceeded" or now - attempt.sent_at >= attempt.told_s / 2:
        return None
    field = f"header {SENT_AT_HEADER}"
    return next((detail.message for detail in refusal.details if detail.field == field), None)


def parse_reply(data: bytes, reply: type[Reply] = QueryResponse) -> Reply | ErrorReply:  # type: ignore[assignment]
    try:
        return reply.model_validate_json(data)
    except ValidationError:
        return ErrorReply.model_validate_json(data)
