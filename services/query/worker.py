"""The query worker: request-reply ``ontology_query`` on per-workspace subjects, in a queue group.

Any request body may be malformed; the answer is then a structured :class:`ErrorReply` and the worker keeps
serving. Nothing a caller sends can crash it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar, get_args

import asyncpg
from azure.search.documents.aio import SearchClient
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import ConnectionClosedError, NoRespondersError, SlowConsumerError, StaleConnectionError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import ServiceUnavailableError
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from pydantic import ValidationError

from ontofabric.contracts import (
    CLOCK_ALLOWANCE_MS,
    RECEIPT_HEADER,
    RECEIVED,
    SENT_AT_HEADER,
    TIMEOUT_HEADER,
    DocumentRequest,
    ErrorDetail,
    ErrorReply,
    OntologyQuery,
    QueryError,
    StatusRequest,
)
from ontofabric.contracts.documents import WORKSPACE
from ontofabric.contracts.query import ErrorCode
from ontofabric.shared.azure_search import search_client
from ontofabric.shared.db import (
    READER_ROLE,
    create_pool,
    index_model,
    is_unavailable,
    migrate,
    once_the_database_serves,
    stalled_after_s,
    wait_until_migrated,
)
from ontofabric.shared.discovery import Announcement, Endpoint, announce
from ontofabric.shared.embedder import Embedder, ServedModel, Vector
from ontofabric.shared.jetstream import (
    ANY_SUBJECT,
    UNREADABLE_HEADERS,
    PermissionDenied,
    connect,
    ensure_jetstream,
    refused_promptly,
    subscriptions_visible,
)
from ontofabric.shared.jetstream import close as close_nats
from ontofabric.shared.logging import describe, get_logger
from ontofabric.shared.lru import LruCache
from ontofabric.shared.onnx_models import second_embedder
from ontofabric.shared.placement import Placement
from ontofabric.shared.runtime import with_login
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import OPERATIONS, Names, canonical_spelling, decode_token, workspace_token_of
from ontofabric.shared.tasks import cancel_and_wait, start_held, watch_lateness
from ontofabric.shared.telemetry import instruments, tracer
from ontofabric.shared.turns import TurnQueue

from .budget import BYTES_PER_TOKEN, TooLarge, fit_reply
from .cache import CacheKey, by_workspace, metered, unmetered
from .client import error_code, mark_reply
from .config import PipelineConfig
from .core import ModelChanged, Reranker, VectorBy
from .deadlines import (
    WORKSPACES_TIMED,
    Deadline,
    PacedReturns,
    RecentDelay,
    ServiceTime,
    deadline_of,
    header_value,
    longest_hopeless_ms,
    waited_before_receipt_s,
)
from .freshness import DeltaWatch
from .lookup import DocumentNotFound, Lookups, OffsetPastEnd, PositionUnavailable
from .pipeline import RETRIEVAL_RESERVE_S, QueryPipeline, RetrievalUnavailable
from .postgres import PlacedSnapshots, PostgresDocuments, PostgresSnapshots, Snapshots, refused_consumers
from .requests import read_request
from .retrievers import build_retrievers
from .stages import unused_fusion_parameter
from .turns import ahead_in_turn, displaced_by, runners_per_workspace, runners_serving
from .versions import VersionTracker

log = get_logger(__name__)


REQUEST_KIND: ContextVar[str] = ContextVar("request_kind", default="unknown")
"""The operation of the request being answered (``query``, ``document``, ``status``; ``unknown`` for a subject
naming none), set as its handling begins: an error reply is counted under it (``request``), so that the paging
error ratio reads the queries whose answers it counts (an auditor's two ``not_found`` of stale document ids read
as 67 % of requests failing)."""


def request_kind(names: Names, subject: str) -> str:
    """The operation a request subject names, as :data:`REQUEST_KIND` holds it."""
    return names.operation_of(subject) or "unknown"


def _handling(names: Names, subject: str) -> Token[str]:
    """The request on ``subject`` is being answered: its error replies are counted under its kind."""
    return REQUEST_KIND.set(request_kind(names, subject))


def error_reply(
    code: str,
    message: str,
    details: list[ErrorDetail] | None = None,
    retryable: bool = False,
    *,
    timeout_too_short: bool = False,
    retry_after_s: float = 0.0,
) -> bytes:
    """The error reply, counted by code; ``timeout_too_short``: a refusal for time of a request whose caller
    allowed less than any answer can be expected in, counted with ``timeout="shorter_than_service"`` (the paging
    error ratio leaves those out: see :meth:`QueryService._timeout_too_short`). ``retry_after_s``: the expected
    wait a busy worker's refusal states (``retryAfterMs``, in whole milliseconds rounded up), when there is one."""
    counted = {"code": code, "request": REQUEST_KIND.get()}
    counted |= {"timeout": "shorter_than_service"} if timeout_too_short else {}
    instruments().query_errors.add(1, counted)
    retry_after_ms = math.ceil(retry_after_s * 1000) if retry_after_s > 0 else None
    error = QueryError(
        code=code, message=message, retryable=retryable, details=details or [], retry_after_ms=retry_after_ms
    )
    return ErrorReply(error=error).model_dump_json().encode()


PACED_SAID_PAST_S = 0.5
"""How far past its wait a refusal's paced moment to come back is said in its message (see _overloaded)."""
PACED_ACROSS_TURNS = 4
"""Runners' turns a refusal may be paced past its wait behind other workspaces' refusals (see _paced)."""
LEAST_ANSWER_MS = RETRIEVAL_RESERVE_S * 1000
"""A stated timeout at or under this gives no retriever time (each must end that long before the deadline): the
least of the reserves, so a query asking only for dense (50 ms) may be told to retry below it and not above."""


def least_answer_ms(operation: str | None) -> float:
    """What any answer to ``operation`` needs at least: a query's retrievers their reserve; a document's or a
    status request, which run none, nothing this worker can say."""
    return LEAST_ANSWER_MS if operation == "query" else 0.0


def hopeless(deadline: Deadline, least_ms: float) -> bool:
    """Whether the caller's stated timeout, less the margin kept for the reply's way back, leaves what any answer
    needs (``least_ms``) no time: 21 to 25 ms were told to retry, where 20 ms was not (an outside tester's)."""
    # A document or a status request needs no retriever (least 0): refused for time, it may be tried again.
    return deadline.stated and least_ms > 0 and deadline.timeout_ms <= longest_hopeless_ms(least_ms)


def hopeless_reply(
    why: str, timeout_ms: int, least_ms: float, timeout_too_short: bool, details: list[ErrorDetail] | None = None
) -> bytes:
    """The ``deadline_exceeded`` reply to a request whose stated timeout gives the retrievers it asks for no time
    (:func:`hopeless`): not retryable, since the same again can only be answered from the cache (an outside
    tester's 20 ms requests, retryable, looped in a retrying client), and naming the header and what is needed."""
    longest = longest_hopeless_ms(least_ms)
    message = (
        f"{why}: a timeout of {timeout_ms} ms leaves the asked retrievers no time (each must end well before the "
        f"deadline, and a margin is kept for the reply); ask with more than {longest} ms, and an answer needs more "
        "still"
    )
    needed = ErrorDetail(field=f"header {TIMEOUT_HEADER}", message=f"more than {longest} ms needed")
    return error_reply("deadline_exceeded", message, [needed, *(details or [])], timeout_too_short=timeout_too_short)


STREAMS_LOOKED_FOR_EVERY_S = 1.0
"""How often a worker started before any projector looks for the streams it waits for."""

READ_TOO_SLOWLY = (
    ErrorReply(
        error=QueryError(
            code="overloaded",
            message="this worker is reading requests more slowly than they arrive; retry",
            retryable=True,
        )
    )
    .model_dump_json()
    .encode()
)
"""The refusal of a request turned away as it arrives (``QueryService._refuse_arriving``), made once: under a flood
it is sent as fast as requests are read."""

DEGRADED_PARTS_COUNTED = ("reranker", "embedder", "dense", "keyword", "lateInteraction", "deadline")
"""The degraded parts whose counts are there from the start (others appear when they first fail)."""


def count_from_zero() -> None:
    """Every error code's count, and the main degraded parts', there from the start at 0: a counter that first
    appears at 58 shows Prometheus no increase (an ops tester's first burst of 88 refusals raised no rate)."""
    counters = instruments()
    for code, request in itertools.product(get_args(ErrorCode), OPERATIONS):
        counters.query_errors.add(0, {"code": code, "request": request})
        counters.query_errors.add(0, {"code": code, "request": request, "timeout": "shorter_than_service"})
    for part in DEGRADED_PARTS_COUNTED:
        counters.degraded.add(0, {"sink": part})


TRACE_CONTEXT = TraceContextTextMapPropagator()
ADMISSION_SHARE = 0.8
"""A request is admitted when the expected wait and work fit in this share of its time left: the estimate is an
average, and the rest is room for the slower ones."""

UNREAD_MESSAGES = 4096
UNREAD_BYTES = 32 * 1024 * 1024
"""Requests delivered to a worker and not yet read, at most (its subscriptions' pending limits in nats-py). A red
team's tenant published queries at 10,000 a second without waiting for answers: the worker read them more slowly
than they came, and every other tenant's request waited behind the backlog for seconds after the flood ended,
neither answered nor refused. Read at tens of thousands a second, this many wait a tenth of a second; one more is
refused at once, ``overloaded`` (:meth:`QueryService._refuse_unread`)."""
ARRIVED_PER_WORKSPACE = 1024
"""Requests of one workspace read and not yet admitted, at most; one more is refused at once, ``overloaded``, without
a wait stated. They wait only while the worker reads faster than it admits: a burst that arrives in one read, which
admission then takes (beyond the places it holds, refused with the wait to come back after: a verifier's burst of
200 through QueryClient was answered whole only so), or a flood, whose excess costs the worker one prepared
refusal each."""
ADMISSION_SLICE_S = 0.005
"""The longest the admission runs before the worker reads, runs and times out other work again."""
ADMITTED_BETWEEN_READS = 64
"""Requests admitted one after another before the worker reads again: admitting a flood's requests without end, it
reads more slowly than they come, and every other workspace's requests wait unread behind them; reading after each
one, it admits one request per read. (Measured only under other load: docs/benchmarks.md, "A flood of one
workspace's requests".)"""
TURNED_AWAY_SAID_EVERY_S = 1.0
"""Requests turned away as they arrive are logged, and counted in the metrics, at most this often (TurnedAway)."""

_UNSTATED_WAIT = (
    f"a request without the {TIMEOUT_HEADER} header waits at most {{:.0f}} ms (its caller's timeout is unknown); "
    "retry, or send the header to wait longer"
)
_UNSTATED_DETAIL = ErrorDetail(
    field=f"header {TIMEOUT_HEADER}",
    message="not sent: the worker waits for a slot as if the caller's timeout were short",
)
"""Named in such a refusal, as a refusal for a timeout too short names it (a nats.js team's: ``details`` were empty)."""


def workspace_of_subject(subject: str) -> str | None:
    """The workspace a query subject names, or None when its token does not decode to a valid name."""
    try:
        return WORKSPACE.validate_python(decode_token(subject.rsplit(".", 1)[-1]))
    except (ValueError, ValidationError):
        return None


Request = TypeVar("Request", OntologyQuery, DocumentRequest, StatusRequest)


def parse_body(model: type[Request], body: bytes, workspace: str) -> Request | bytes:
    """The validated request, or the error reply to send instead."""
    request = read_request(model, body)
    if isinstance(request, QueryError):
        return error_reply(request.code, request.message, request.details)
    if request.workspace is not None and request.workspace != workspace:
        return error_reply(
            "invalid_request",
            "the body names another workspace than the subject it was sent to",
            [ErrorDetail(field="workspace", message=f"this subject serves workspace {workspace!r}")],
        )
    return request


def parse_request(body: bytes, workspace: str, max_query_chars: int) -> OntologyQuery | bytes:
    """The validated query, or the error reply to send instead."""
    query = parse_body(OntologyQuery, body, workspace)
    if isinstance(query, OntologyQuery) and query.semantic_query and len(query.semantic_query) > max_query_chars:
        return error_reply(
            "invalid_request",
            "the query is too long",
            # An agent tester pasted a 5,000-character traceback: its last lines are what is read of one.
            [
                ErrorDetail(
                    field="semanticQuery",
                    message=f"at most {max_query_chars} characters (of a traceback, send its last frames and the "
                    "exception's line)",
                )
            ],
        )
    return query


def answerable(reply: str) -> bool:
    """Whether a request's reply subject is a caller's inbox, the only place a worker answers to: under
    ``_INBOX.``, and a subject one can subscribe to and publish on, without a wildcard token (a fault harness's
    ``_INBOX.ontofabric~client.>`` was answered) or white space."""
    tokens = reply.split(".")
    return reply.startswith("_INBOX.") and all(t and t not in ("*", ">") and not _SPACE.search(t) for t in tokens)


_SPACE = re.compile(r"\s")


# Room kept free in a NATS message beside a reply: replies carry no headers now (_reply), so this is slack, kept
# rather than moving every budget (budget.fit_reply) by 16 KiB.
HEADER_ALLOWANCE_BYTES = 16 * 1024


def _unavailable(error: BaseException) -> bool:
    """A store this worker reads could not serve now (Postgres or JetStream away, overloaded, timing out): the
    caller may ask again, here or on another worker. Anything else is a failure of the request's own."""
    nats_away = (ConnectionClosedError, NoRespondersError, StaleConnectionError, ServiceUnavailableError)
    return is_unavailable(error) or isinstance(error, nats_away)


@dataclass
class TurnedAway:
    """Requests turned away as they arrive: the first said (``event``) and counted (as the error ``refused``, when
    they were refused) at once, those after it together every TURNED_AWAY_SAID_EVERY_S while they come. One by one,
    a flood would cost the worker more than the flood itself."""

    event: str
    refused: str | None = None
    """The error code they were refused with; None: nobody was answered."""
    counts: Counter[str] = field(default_factory=Counter)
    """By subject, since the last line."""
    due: asyncio.TimerHandle | None = None
    """The next line, while requests are turned away."""
    kind_of: Callable[[str], str] = lambda _subject: "unknown"
    """A subject's operation, which a refusal is counted under (:func:`request_kind`)."""

    def note(self, subject: str) -> None:
        self.counts[subject] += 1
        if self.due is None:
            self.say()

    def say(self, then_again: bool = True) -> None:
        """Those noted since the last line, in one; and again in TURNED_AWAY_SAID_EVERY_S, unless not
        ``then_again`` (the worker stops) or none came meanwhile."""
        if self.due is not None:
            self.due.cancel()
            self.due = None
        if not self.counts:
            return
        total, (busiest, most) = self.counts.total(), self.counts.most_common(1)[0]
        if self.refused is not None:
            by_kind = Counter[str]()
            for subject, count in self.counts.items():
                by_kind[self.kind_of(subject)] += count
            for kind, count in by_kind.items():
                instruments().query_errors.add(count, {"code": self.refused, "request": kind})
        log.warning(self.event, requests=total, subjects=len(self.counts), most_on=busiest, most=most)
        self.counts.clear()
        if then_again:
            self.due = asyncio.get_running_loop().call_later(TURNED_AWAY_SAID_EVERY_S, self.say)


@dataclass
class Admitted:
    """A request taken into the queue: answered by a runner, or refused when its deadline comes first."""

    msg: Msg
    received: float
    deadline: Deadline
    workspace: str = ""
    """The workspace's subject token: whose turn it waits for."""
    place_freed: bool = False
    """Its place was freed before a runner took it: given to another workspace's request (refused, ``overloaded``),
    or left when it was refused unopened at its deadline."""
    waits_until: float | None = None
    """When a request that states no timeout stops waiting for a free slot (refused, ``overloaded``)."""
    replied: bool = False
    expiry: asyncio.TimerHandle | None = None
    taken_at: float | None = None
    """When a runner took it."""
    request: OntologyQuery | DocumentRequest | StatusRequest | None = None
    """Its body, read at admission as its operation's (None: a subject naming no operation or workspace)."""
    from_cache: bool = False
    """Answered from the answer cache: no measure of the work its workspace's requests take."""

    def late(self, now: float) -> str:
        """Why it is refused at its deadline."""
        before = self.deadline.waited_before_s * 1000
        sent = (
            f"; it was sent {before + CLOCK_ALLOWANCE_MS:.0f} ms before this worker read it (by its {SENT_AT_HEADER} "
            f"header: a clock behind this worker's by more than {CLOCK_ALLOWANCE_MS} ms reads as that)"
            if before
            else ""
        )  # a tester's: a send time far in the past read "waited 0 ms for a free slot", naming no header
        if self.taken_at is None:
            waited = (now - self.received) * 1000
            return f"waited {waited:.0f} ms for a free slot, past the request's {self.deadline.timeout_ms} ms{sent}"
        waited = (self.taken_at - self.received) * 1000
        # Which wait it was: "(waited 1 ms)" read as giving up after 1 ms (a fault tester's, its database frozen).
        return (
            f"no answer within the request's {self.deadline.timeout_ms} ms: its work ran out of time after a wait of "
            f"{waited:.0f} ms for a free slot{sent}"
        )

    def refused_late(self, now: float, timeout_too_short: bool, least_ms: float = 0.0) -> bytes:
        """The ``deadline_exceeded`` reply; when the send time took part, a detail names its header: a caller that
        reads the reply with time left knows its clock and this worker's disagree (QueryClient then sends the
        request again without it). ``least_ms``: what any answer to its operation needs (:func:`least_answer_ms`);
        a stated timeout that leaves it no time (:func:`hopeless`) is refused as :func:`hopeless_reply`."""
        before = self.deadline.waited_before_s
        sent_ms = before * 1000 + CLOCK_ALLOWANCE_MS  # as the message says it
        details = (
            [ErrorDetail(field=f"header {SENT_AT_HEADER}", message=f"read as sent {sent_ms:.0f} ms before")]
            if before
            else None
        )
        late = self.late(now)
        if hopeless(self.deadline, least_ms):
            # Refused before any retriever was asked: 1 to 8 ms were told to retry, where 10 ms, refused by the
            # pipeline, was not (a tester's).
            return hopeless_reply(late, self.deadline.timeout_ms, least_ms, timeout_too_short, details)
        return error_reply("deadline_exceeded", late, details, retryable=True, timeout_too_short=timeout_too_short)


class QueryService:
    """The query worker process: pool, embedder, version watch, and a subscription to every workspace's query
    subject in the workers' queue group.

    Admission: nats-py hands a subscription's messages to its callback one at a time; the callback (``_intake``)
    only puts each in its workspace's turn, so that a workspace sending faster than the worker reads waits behind
    its own requests, not in front of the others' (at most UNREAD_MESSAGES wait unread, and ARRIVED_PER_WORKSPACE of
    a workspace in turn: beyond either, a request is refused at once, ``overloaded``). One task admits
    them in turn: each is queued (``query_queue_limit`` at most; beyond it refused at once, ``overloaded``), so the
    subscription never backs up where nobody sees the wait. ``query_concurrency`` runners take requests from the
    queue; one whose deadline has passed while it waited is refused (``deadline_exceeded``) without any work, and
    every answer is bounded by its request's deadline."""

    def __init__(
        self,
        settings: Settings,
        nats_url: str,
        database_url: str,
        embedder: Embedder | None,
        reranker: Reranker | None = None,
        replica_urls: Sequence[str] | None = None,
        reader_login: tuple[str, str] | None = None,
    ) -> None:
        """``reader_login``: a login (user, password) of the database's servers that holds the reader role and
        nothing more, which the pools read through (the embedded PostgreSQL's); ``database_url`` then only
        migrates."""
        self.settings = settings
        self.names = Names(settings.subject_prefix)
        self._nats_url = nats_url
        self._database_url = database_url
        self._reader_login = reader_login
        self._replica_urls = tuple(replica_urls if replica_urls is not None else settings.replica_urls())
        self._embedder = embedder
        self._reranker = reranker
        self._nc: Client | None = None
        self._subscriptions: list[Subscription] = []
        self._service: Announcement | None = None
        self._endpoints: dict[str, Endpoint] = {}
        """How ``ontofabric status`` finds this worker: NATS service discovery."""
        self._pools: list[asyncpg.Pool] = []
        """Reader pools of the databases the workspaces are placed on (shared/placement.py), in its order."""
        self._replica_pools: list[asyncpg.Pool] = []
        self._versions: VersionTracker | None = None
        self._azure: SearchClient | None = None
        self._pipeline: QueryPipeline | None = None
        self._cache: LruCache[CacheKey, bytes] | None = None
        self._freshness: DeltaWatch | None = None
        self._lookups: Lookups | None = None
        self._arrived: TurnQueue[tuple[Msg, float, float | ErrorDetail]] = TurnQueue()
        """Requests read and not yet admitted, with when each was read and how long it had waited before (its send
        time's header read then: ``waited_before_receipt_s``), in turn by workspace (``_intake``)."""
        self._waiting: TurnQueue[Admitted] = TurnQueue()
        self._expiries: set[asyncio.Task[None]] = set()
        self._service_time = ServiceTime()
        # Per workspace: one tenant's flood told every tenant to come back in about 11 s (a load tester's); and
        # across them, within a shorter bound (_paced).
        self._returns: LruCache[str, PacedReturns] = LruCache(WORKSPACES_TIMED)
        self._returns_across = PacedReturns()
        self._lag = RecentDelay()
        self._held = 0
        """Requests at work or waiting: at most query_concurrency + query_queue_limit."""
        self._held_by: Counter[str] = Counter()
        """The same by workspace token (``_displace_for``)."""
        self._running: Counter[str] = Counter()
        """Requests at work, by workspace token: at most ``runners_per_workspace`` each."""
        self._runners_per_workspace = runners_per_workspace(settings.query_concurrency)
        self._runners: list[asyncio.Task[None]] = []
        self.handled = 0
        """Requests this worker worked on (errors included; not those refused unopened)."""
        self._request_subscriptions: list[Subscription] = []
        """The request subscriptions, kept until they are drained (``_refuse_unread``)."""
        self._without_reply = TurnedAway("query_without_reply_subject_dropped")
        kind_of = partial(request_kind, self.names)
        self._refused_unread = TurnedAway("query_requests_refused_unread", refused="overloaded", kind_of=kind_of)
        self._refused_arriving = TurnedAway("query_requests_refused_arriving", refused="overloaded", kind_of=kind_of)
        # Every `overloaded` refusal of an admitted or arriving request but those above: counted in the metrics as
        # each reply is made (error_reply), said here once a second at most (an outside tester's storm had 500,000
        # refused with nothing in the log).
        self._refused_busy = TurnedAway("query_requests_refused_busy")

    async def start(self) -> None:
        count_from_zero()
        try:
            await self._start()
        except BaseException:
            await self.stop()  # whatever started before the failure
            raise

    @property
    def connection(self) -> Client | None:
        """Its NATS connection while it runs (which server it is on: ``connection.connected_url``)."""
        return self._nc

    async def _start(self) -> None:
        settings, names = self.settings, self.names
        # Past it, a database that stopped answering is `unavailable`.
        stalled_s = stalled_after_s(settings)
        placement = Placement.of(settings, self._database_url)
        for database_url in placement.databases:
            self._pools.append(await self._reader_pool(database_url, stalled_s))
        for replica_url in self._replica_urls:
            self._replica_pools.append(await self._reader_pool(replica_url, stalled_s, replica=True))
        nc = self._nc = await connect(
            self._nats_url, "ontofabric-query", settings, wait_for_server=True, on_unread=self._refuse_unread
        )
        js = nc.jetstream()
        await self._streams_made(nc, settings)
        tracker = VersionTracker(js, await js.key_value(names.version_bucket), names)
        refusals = partial(refused_consumers, self._pools)
        self._freshness = DeltaWatch(nc, names, settings.projector_partitions, refusals)
        await self._freshness.start()
        cache: LruCache[CacheKey, bytes] = metered(
            LruCache(settings.query_cache_entries, settings.query_cache_bytes, len, owner=by_workspace)
        )
        self._cache = cache
        served = self._embedder if isinstance(self._embedder, ServedModel) else None
        on_model, vector_by = None, None
        if served is not None:  # set up for a model change: it serves the model the index holds
            on_model, vector_by = following_model(served, cache), vectors_by(served)
            async with self._pools[0].acquire() as conn:
                on_model((await index_model(conn)).model)
        placed = [
            PostgresSnapshots(
                pool,
                acquire_timeout_s=stalled_s,
                replicas=self._replica_pools,
                announced=tracker.revision,
                on_model=on_model,
            )
            for pool in self._pools
        ]
        snapshots: Snapshots = placed[0] if len(placed) == 1 else PlacedSnapshots(placement, placed)
        documents = PostgresDocuments(snapshots, vector_by)
        if settings.keyword_backend == "azure-ai-search":
            # No SDK retries: a query has a budget (the timeout), and a failed keyword path degrades, not fails.
            self._azure = search_client(settings, retries=0)
        # One thread: a query is a few tokens, and the retrievers run beside it.
        second = await asyncio.to_thread(second_embedder, settings, 1)
        if second is not None and self._reranker is not None and self._reranker.name == "second-embedder":
            # Measured each alone (docs/quality.md): together a precision request counts one opinion twice.
            log.warning("second_opinion_twice", reranker=self._reranker.name, second_vectors=second.name)
        self._pipeline = QueryPipeline(
            build_retrievers(settings, snapshots, documents, self._azure, vector_by),
            documents,
            self._embedder,
            tracker,
            cache,
            PipelineConfig.from_settings(settings),
            self._reranker,
            self._freshness,
            second,
        )
        tracker.set_listener(self._pipeline.invalidate)
        self._versions = tracker
        await tracker.start()
        self._lookups = Lookups(documents, self._freshness, js, names, settings.answer_max_tokens * BYTES_PER_TOKEN)
        self._runners = [
            asyncio.create_task(self._run(), name=f"query-runner-{i}") for i in range(settings.query_concurrency)
        ]
        self._runners.append(asyncio.create_task(watch_lateness(self._lag.observe), name="query-loop-lag"))
        self._runners.append(asyncio.create_task(self._admit_in_turn(), name="query-admission"))
        subjects = names.request_subjects
        self._subscriptions = self._request_subscriptions = [
            await nc.subscribe(
                subject,
                queue=names.query_queue,
                cb=self._intake,
                pending_msgs_limit=UNREAD_MESSAGES,
                pending_bytes_limit=UNREAD_BYTES,
            )
            for subject in subjects
        ]
        models = ",".join(settings.models()) if self._embedder is not None else ""
        self._endpoints = {
            operation: Endpoint(operation, subject, names.query_queue)
            for operation, subject in zip(OPERATIONS, subjects, strict=True)
        }
        self._service = await announce(
            nc, names.query_service, "ontofabric query worker", {"models": models}, list(self._endpoints.values())
        )
        await subscriptions_visible(nc)
        log.info("query_worker_started", subjects=subjects, queue=names.query_queue)

    async def _streams_made(self, nc: Client, settings: Settings) -> None:
        """The deployment's streams and buckets, made where missing, or, where this worker's NATS user may not
        make them (docs/security.md), waited for until a projector has: a worker started before any projector
        stopped with a traceback (a servers-alone `up`'s test)."""
        said = False
        while True:
            try:
                await refused_promptly(nc, ANY_SUBJECT, ensure_jetstream(nc.jetstream(), self.names, settings))
                return
            except (PermissionDenied, NatsTimeoutError) as error:
                if not said:
                    log.warning(
                        "query_worker_waiting_for_streams", reason="no projector has made them", error=describe(error)
                    )
                    said = True
                await asyncio.sleep(STREAMS_LOOKED_FOR_EVERY_S)

    async def _intake(self, msg: Msg) -> None:
        """A request as it is read: into its workspace's turn, or refused at once when ARRIVED_PER_WORKSPACE of that
        workspace wait there. As little as possible here: this is as fast as the worker reads."""
        now = asyncio.get_running_loop().time()
        if not msg.reply:  # a publish, not a request: there is no one to answer, so no work to hold a place for
            self._without_reply.note(msg.subject)
            return
        if header_value(msg.headers, RECEIPT_HEADER) is not None and answerable(msg.reply):
            # First, before any refusal or work: silence then tells the caller this worker is frozen or gone.
            await self._reply(msg, b"", {RECEIPT_HEADER: RECEIVED})
        workspace = workspace_token_of(msg.subject) or ""
        if self._arrived.waiting(workspace) >= ARRIVED_PER_WORKSPACE:
            await self._refuse_arriving(msg, self._refused_arriving)
            return
        self._arrived.put_nowait(workspace, (msg, now, waited_before_receipt_s(msg.headers, time.time())))

    async def _refuse_unread(self, dropped: SlowConsumerError) -> bool:
        """A request nats-py dropped unread, UNREAD_MESSAGES (or UNREAD_BYTES) waiting before it: refused at once.
        False for a message of another subscription."""
        if dropped.sub not in self._request_subscriptions or self._nc is None:
            return False
        msg = Msg(self._nc, dropped.subject, dropped.reply)
        if not msg.reply:
            self._without_reply.note(msg.subject)
        elif answerable(msg.reply):
            # Its headers are gone with it: a receipt first, whether asked for or not (one not asked for is
            # ignored), or the caller's client takes the refusal for a worker of a release that sends none, and
            # stops watching for frozen workers for a minute (a review's finding).
            await self._reply(msg, b"", {RECEIPT_HEADER: RECEIVED})
            await self._refuse_arriving(msg, self._refused_unread)
        return True

    async def _refuse_arriving(self, msg: Msg, tally: TurnedAway) -> None:
        """Refused as cheaply as it can be, not through ``_reply``: the service-discovery stats do not count it."""
        if answerable(msg.reply) and self._nc is not None:
            tally.note(msg.subject)
            with contextlib.suppress(Exception):  # the connection went away: the caller times out and retries
                await self._nc.publish(msg.reply, READ_TOO_SLOWLY)

    async def _admit_in_turn(self) -> None:
        """Each workspace's requests in turn, the worker reading between any ADMITTED_BETWEEN_READS of them, and
        at least every ADMISSION_SLICE_S (each body is read here: 64 long ones held the loop for a second)."""
        loop = asyncio.get_running_loop()
        slice_began = loop.time()
        for admitted in itertools.count(1):
            msg, received, waited_before = await self._arrived.get()
            try:
                await self._admit(msg, received, waited_before)
            except Exception:  # nothing one request does may end the admission
                log.exception("request_failed_outside_its_handler", subject=msg.subject)
                # Nor leave its caller to its timeout: the failure came before the request took a place (past
                # that, only another request's refusal is made and sent). Nor may answering it end the admission.
                with contextlib.suppress(Exception):
                    failed = "the request could not be admitted; see the worker log"
                    await self._reply(msg, error_reply("internal", failed, retryable=True))
            finally:
                self._arrived.task_done()
            if admitted % ADMITTED_BETWEEN_READS == 0 or loop.time() - slice_began > ADMISSION_SLICE_S:
                await asyncio.sleep(0)  # get() takes the next at once while one waits
                slice_began = loop.time()

    async def _admit(self, msg: Msg, received: float, waited_before: float | ErrorDetail) -> None:
        _handling(self.names, msg.subject)
        if msg.headers and UNREADABLE_HEADERS in msg.headers:  # the client read on (shared.jetstream.SturdyClient)
            detail = ErrorDetail(field="headers", message=f"cannot be read: {msg.headers[UNREADABLE_HEADERS]}")
            await self._reply(msg, error_reply("invalid_request", "the request's headers are not valid", [detail]))
            return
        if isinstance(waited_before, ErrorDetail):
            await self._reply(
                msg, error_reply("invalid_request", "the request's send time is not valid", [waited_before])
            )
            return
        default_ms = self.settings.query_default_timeout_ms
        deadline = deadline_of(msg.headers, received, default_ms, self._lag.seconds, waited_before)
        if isinstance(deadline, ErrorDetail):
            await self._reply(msg, error_reply("invalid_request", "the request's timeout is not valid", [deadline]))
            return
        # Read before any place is taken: a body that cannot be answered is answered so at once, under load too
        # (two load testers: refused "overloaded", retryable, or queued for seconds before its error).
        request = self._parsed(msg)
        if isinstance(request, bytes):
            self.handled += 1  # errors included, as a runner counts them
            await self._reply(msg, request, received=received)
            return
        concurrency = self.settings.query_concurrency
        places = concurrency + self.settings.query_queue_limit
        workspace = workspace_token_of(msg.subject) or ""
        if deadline.left(received) <= 0:  # spent before it reached this worker (a NATS server frozen, say)
            # Before the admission's estimate: with the workspace's requests held, any work is more than 80 % of
            # nothing, and it was refused "overloaded ... retry with a longer timeout" (an MCP fault tester's).
            await self._reply(msg, self._refused_late(Admitted(msg, received, deadline, workspace), received))
            return
        least = least_answer_ms(self.names.operation_of(msg.subject))
        own = self._held_by[workspace]
        ahead, runners = self._turn_of(workspace)
        timed_as = self._timed_as(msg, workspace)
        expected = self._service_time.expected_finish(ahead, runners, timed_as)
        wait = self._service_time.expected_wait(ahead, runners)
        # Refused now, not when the caller has given up. Never by an idle worker, nor when the workspace holds
        # nothing: its average may be of a slow spell that is over (a database frozen for seconds), and only its
        # answered requests bring it down again (a busy worker is seldom idle; a review's finding).
        if self._held and own and expected > ADMISSION_SHARE * deadline.left(received):
            if hopeless(deadline, least):  # no retry makes its timeout enough: said so, as an idle worker says it
                why = "this worker is busy, and the request's timeout is too short for any answer but a cached one"
                short = self._timeout_too_short(deadline)
                await self._reply(msg, hopeless_reply(why, deadline.timeout_ms, least, short))
                return
            # Its parts and the share they are held to (a load tester read "about 129 ms, past the deadline" of a
            # 200 ms request as a contradiction).
            busy = (
                f"this worker would answer in about {expected * 1000:.0f} ms ({wait * 1000:.0f} ms waiting for a "
                f"runner, then about {self._service_time.own(timed_as) * 1000:.0f} ms of this workspace's work), "
                f"more than {ADMISSION_SHARE:.0%} of the {deadline.left(received) * 1000:.0f} ms the request has left; "
                + ("retry" if wait > 0 else "retry with a longer timeout")
            )
            short = self._timeout_too_short(deadline)
            await self._reply(msg, self._overloaded(msg, busy, wait, runners, timeout_too_short=short))
            return
        max_wait_s = self.settings.query_unstated_max_wait_ms / 1000
        if not deadline.stated and self._held and wait > max_wait_s:
            busy = f"this worker would start this request in about {wait * 1000:.0f} ms; {_UNSTATED_WAIT}"
            unstated = busy.format(max_wait_s * 1000)
            await self._reply(msg, self._overloaded(msg, unstated, wait, runners, details=[_UNSTATED_DETAIL]))
            return
        displaced = self._displace_for(workspace) if self._held >= places else None
        if self._held >= places:
            busy = f"this worker is at capacity ({concurrency} at work, its queue full); retry"
            await self._reply(msg, self._overloaded(msg, busy, wait, runners))
            return
        self._held += 1
        self._held_by[workspace] += 1
        admitted = Admitted(msg, received, deadline, workspace, request=request)
        if not deadline.stated:
            admitted.waits_until = min(deadline.at, received + max_wait_s)
        # The caller hears back by its deadline even when no runner gets to the request in time, or the one that
        # has it is stuck (a database frozen under a statement, a cleanup that waits on it); one that states no
        # timeout, when no runner has taken it by waits_until.
        due = deadline.at if admitted.waits_until is None else admitted.waits_until
        admitted.expiry = asyncio.get_running_loop().call_at(due, self._expire, admitted)
        self._waiting.put_nowait(workspace, admitted)
        if displaced is not None:
            busy = "this worker is at capacity and gave this request's place to a workspace holding less; retry"
            paced = self._wait_of(displaced.workspace)
            self._refused_busy.note(displaced.msg.subject)
            # Counted as the displaced request's kind, not the newcomer's (a review's: a document read displacing a
            # query hid the query's refusal from the paging ratio).
            kind = _handling(self.names, displaced.msg.subject)
            try:
                await self._reply_once(
                    displaced, partial(error_reply, "overloaded", busy, retryable=True, retry_after_s=paced)
                )
            finally:
                REQUEST_KIND.reset(kind)

    def _timed_as(self, msg: Msg, workspace: str) -> str:
        """Whose average work a request is judged by and counts in: its workspace's, per operation (a review's: a
        document read of a few ms was refused by its workspace's queries' average of seconds)."""
        return f"{workspace} {self.names.operation_of(msg.subject) or ''}"

    def _turn_of(self, workspace: str) -> tuple[int, int]:
        """For a request of ``workspace`` arriving now: how many of those held go before it, and through how many
        runners they leave."""
        own = self._held_by[workspace]
        workspaces = len(self._held_by) + (0 if own else 1)
        return ahead_in_turn(own, workspaces, self._held), runners_serving(workspaces, self.settings.query_concurrency)

    def _wait_of(self, workspace: str) -> float:
        """The wait to state to a request of ``workspace`` refused now: how long one arriving now would wait for a
        runner, by what the worker holds, paced behind the waits stated before (PacedReturns)."""
        ahead, runners = self._turn_of(workspace)
        return self._paced(self._service_time.expected_wait(ahead, runners), runners, workspace)

    def _overloaded(
        self,
        msg: Msg,
        busy: str,
        wait: float,
        runners: int,
        *,
        timeout_too_short: bool = False,
        details: list[ErrorDetail] | None = None,
    ) -> bytes:
        """An ``overloaded`` refusal saying ``busy``, and when to come back (``retryAfterMs``, paced behind those told
        before). When the pacing puts that well past the wait itself, the message says why: an outside tester's
        storm was told 10.6 s beside "this worker would answer in about 758 ms"."""
        self._refused_busy.note(msg.subject)
        paced = self._paced(wait, runners, workspace_token_of(msg.subject) or "")
        if paced > max(2 * wait, wait + PACED_SAID_PAST_S):
            busy += f"; told to come back in about {paced * 1000:.0f} ms, after the requests refused before this one"
        return error_reply(
            "overloaded", busy, details, retryable=True, timeout_too_short=timeout_too_short, retry_after_s=paced
        )

    def _paced(self, wait: float, runners: int, workspace: str) -> float:
        """``wait`` as stated to a request of ``workspace`` refused now: see PacedReturns, paced behind the
        workspace's own refusals, and behind every workspace's by at most its wait again or PACED_ACROSS_TURNS
        runners' turns (a review's: a burst of 12 workspaces' requests, each refused first in its workspace, were
        all told the same moment). Nothing before a request has been answered (no time to pace by)."""
        if wait <= 0:
            return wait
        # No later than a request is worked on by default: the callers told so far may never come back.
        horizon = self.settings.query_default_timeout_ms / 1000
        turn = self._service_time.seconds / runners
        returns = self._returns.get(workspace)
        if returns is None:
            returns = PacedReturns()
            self._returns.put(workspace, returns)
        now = asyncio.get_running_loop().time()
        own = returns.stated_wait(now, wait, turn, horizon)
        across = self._returns_across.stated_wait(now, wait, turn, min(horizon, max(wait, PACED_ACROSS_TURNS * turn)))
        return max(own, across)

    def _displace_for(self, workspace: str) -> Admitted | None:
        """A full worker gives the place of the newest waiting request of the workspace holding the most to
        ``workspace``, when that holds at least two more (``displaced_by``); that one is to be refused,
        ``overloaded``, as it would have been had it come after (once the newcomer has the place: nothing else
        may take it meanwhile). None when no request gives its place."""
        largest = displaced_by(self._held_by, workspace)
        victim = (
            None
            if largest is None
            else self._waiting.newest(largest, lambda held: not held.replied and not held.place_freed)
        )
        if victim is not None:
            victim.place_freed = True
            self._release(victim)
        return victim

    def _release(self, admitted: Admitted) -> None:
        self._held -= 1
        self._held_by[admitted.workspace] -= 1
        if not self._held_by[admitted.workspace]:
            del self._held_by[admitted.workspace]

    def _expire(self, admitted: Admitted) -> None:
        if admitted.replied:
            return
        loop = asyncio.get_running_loop()
        if admitted.waits_until is not None and loop.time() < admitted.deadline.at:  # only its wait ended
            if admitted.taken_at is not None:  # a runner has it in time: its deadline bounds the work
                admitted.expiry = loop.call_at(admitted.deadline.at, self._expire, admitted)
                return
            refusal = self._refuse_waited(admitted)
        else:
            refusal = self._refuse_late(admitted)
        if admitted.taken_at is None and not admitted.place_freed:
            # Answered unopened: its place is free now, not when a runner gets to it (one of its workspace's, which
            # may all be at work: the others' runners do not take its requests).
            admitted.place_freed = True
            self._release(admitted)
        start_held(refusal, self._expiries)

    def _timeout_too_short(self, deadline: Deadline) -> bool:
        """Whether the caller stated a timeout under ``query_short_timeout_ms``. Refused for time, such a request is
        the caller's choice, not the service failing: a soak whose clients sent 3 % of their requests with 30 ms
        put the paging error ratio at 2 % while the service was healthy. A fixed figure, not the worker's measured
        service time: that rises in the very slow spell that should page, and would excuse its refusals."""
        return deadline.stated and deadline.timeout_ms < self.settings.query_short_timeout_ms

    async def _refuse_late(self, admitted: Admitted) -> None:
        await self._reply_once(admitted, partial(self._refused_late, admitted, asyncio.get_running_loop().time()))

    def _refused_late(self, admitted: Admitted, now: float) -> bytes:
        """Its ``deadline_exceeded`` reply (:meth:`Admitted.refused_late`), by what its operation needs at least."""
        least = least_answer_ms(self.names.operation_of(admitted.msg.subject))
        return admitted.refused_late(now, self._timeout_too_short(admitted.deadline), least)

    async def _refuse_waited(self, admitted: Admitted, *, runner_free: bool = False) -> None:
        """``runner_free``: a runner took it just past its wait, so one is free now and no wait is stated; else the
        wait of a request arriving now, by what the worker holds once this one's place is freed."""
        waited = (asyncio.get_running_loop().time() - admitted.received) * 1000
        busy = f"waited {waited:.0f} ms for a free slot; {_UNSTATED_WAIT}"
        limit = self.settings.query_unstated_max_wait_ms
        retry_after_s = 0.0 if runner_free else self._wait_of(admitted.workspace)
        if not admitted.replied:  # counted only when this refusal is what the caller gets
            self._refused_busy.note(admitted.msg.subject)
        await self._reply_once(
            admitted,
            partial(
                error_reply,
                "overloaded",
                busy.format(limit),
                [_UNSTATED_DETAIL],
                retryable=True,
                retry_after_s=retry_after_s,
            ),
        )

    async def _reply_once(self, admitted: Admitted, body: bytes | Callable[[], bytes]) -> None:
        """The first reply to an admitted request goes out; a later one (the work ending after the deadline's
        refusal) is dropped. ``body``: the reply, or what makes it, only when it is sent: an error reply is
        counted as it is made (an operator's: ``deadline_exceeded`` was counted twice, by the deadline's timer and
        by the runner its deadline cut)."""
        if admitted.replied:
            return
        made = body if isinstance(body, bytes) else body()  # first: should it fail, the request's timer answers
        admitted.replied = True
        if admitted.expiry is not None:
            admitted.expiry.cancel()
        await self._reply(admitted.msg, made, received=admitted.received)

    def _may_run(self, workspace: str) -> bool:
        return self._running[workspace] < self._runners_per_workspace

    async def _run(self) -> None:
        while True:
            admitted = await self._waiting.get(self._may_run)
            self._running[admitted.workspace] += 1
            started = asyncio.get_running_loop().time()
            try:
                finished = await self._serve(admitted)
                # A cached answer's millisecond is no measure of its workspace's work: averaged in, it let a
                # workspace asking one question over and over have its other questions taken in, to fail at their
                # deadlines (a load tester's). Its runner did come free at once: the worker's average counts it.
                if finished is not None:
                    ended = asyncio.get_running_loop().time()
                    workspace = self._timed_as(admitted.msg, admitted.workspace)
                    self._service_time.record(
                        ended - started, workspace, cut=not finished, now=ended, of_its_work=not admitted.from_cache
                    )
            except asyncio.CancelledError:
                raise
            except BaseException:  # nothing one request does may end a runner (a BaseException from a library)
                log.exception("request_failed_outside_its_handler", subject=admitted.msg.subject)
            finally:
                if not admitted.place_freed:  # one whose place was freed early gave it back then
                    self._release(admitted)
                self._running[admitted.workspace] -= 1
                if not self._running[admitted.workspace]:
                    del self._running[admitted.workspace]
                self._waiting.task_done()

    async def _serve(self, admitted: Admitted) -> bool | None:
        """Answer an admitted request: True when its work finished, False when its deadline cut it, None when it
        was refused unopened (its deadline passed while it waited, or too little of it is left)."""
        msg, received, deadline = admitted.msg, admitted.received, admitted.deadline
        _handling(self.names, msg.subject)
        loop = asyncio.get_running_loop()
        waited_ms = round((loop.time() - received) * 1000, 3)
        if admitted.replied or deadline.left(loop.time()) <= 0:  # its caller has given up: no work for nobody
            await self._refuse_late(admitted)
            return None
        if admitted.waits_until is not None and loop.time() > admitted.waits_until:  # its timer is yet to run
            await self._refuse_waited(admitted, runner_free=True)
            return None
        left, own = deadline.left(loop.time()), self._service_time.own(self._timed_as(msg, admitted.workspace))
        if self._held_by[admitted.workspace] > 1 and own > left:
            # Taken up with less time left than its workspace's work takes: refused now rather than worked on
            # until its deadline cuts it (a load tester's: taken up with 170 ms of 2 s left, for work of 1 s),
            # while others wait for the runner. Only while its workspace holds more (as on arrival): one holding
            # nothing else is worked on, so that an average from a slow spell comes down again.
            busy = (
                f"taken up with {left * 1000:.0f} ms of the request's {deadline.timeout_ms} ms left, less than its "
                f"workspace's requests take here (about {own * 1000:.0f} ms); retry"
            )
            paced = self._wait_of(admitted.workspace)
            short = self._timeout_too_short(deadline)
            self._refused_busy.note(admitted.msg.subject)
            await self._reply_once(
                admitted,
                partial(error_reply, "overloaded", busy, retryable=True, timeout_too_short=short, retry_after_s=paced),
            )
            return None
        admitted.taken_at = loop.time()
        finished = True
        body: bytes | Callable[[], bytes]
        try:
            # The caller's trace continues here: its context travels in the request's headers. Only the trace
            # context is read: baggage is not used, and its parser logs every oversized header a caller sends.
            context = TRACE_CONTEXT.extract(msg.headers or {})
            with tracer().start_as_current_span(
                msg.subject.split(".")[1], context=context, kind=SpanKind.SERVER
            ) as span:
                span.set_attribute("messaging.destination.name", msg.subject)
                span.set_attribute("ontofabric.queue_ms", waited_ms)
                try:
                    async with asyncio.timeout_at(deadline.at):
                        body = await self._answer(admitted, waited_ms)
                except TimeoutError:  # its timer may have refused it already: counted as sent (_reply_once)
                    body = partial(self._refused_late, admitted, loop.time())
                    finished = False
                    span.set_attribute("error.type", "deadline_exceeded")
                    if not self._timeout_too_short(deadline):  # the caller's own short timeout is no fault here
                        span.set_status(StatusCode.ERROR, "deadline_exceeded")
                else:  # an error reply says so on the span too: a tracing backend found no failed answer
                    mark_reply(span, body)
        except Exception:  # a caller waiting for a reply gets one, whatever failed (its span ended marked ERROR)
            log.exception("query_failed", subject=msg.subject)
            body = partial(error_reply, "internal", "the query failed unexpectedly; see the worker log", retryable=True)
        await self._reply_once(admitted, body)
        return finished

    async def _reply(
        self, msg: Msg, body: bytes, headers: dict[str, str] | None = None, received: float | None = None
    ) -> None:
        """``received``: when the request arrived, for the service-discovery stats (a refusal at arrival: now)."""
        endpoint = self._endpoints.get(self.names.operation_of(msg.subject) or "")
        if endpoint is not None and headers is None:  # an answer, not the receipt
            took = 0.0 if received is None else asyncio.get_running_loop().time() - received
            endpoint.record(took, error_code(body))
        if not answerable(msg.reply):
            # Answers go to callers' inboxes only: a reply subject naming a stream's or a bucket's subject would
            # make this worker write there (NATS permissions allow it no other subject, docs/security.md).
            if msg.reply:
                log.warning("reply_refused", reply=msg.reply[:200], reason="not an inbox")
            return
        assert self._nc is not None, "a request arrived, so the worker is connected"
        try:
            # Not msg.respond: it sends the request's headers back with the reply, and a caller's large headers
            # would then make the reply exceed max_payload, on which the server ends this worker's connection.
            await self._nc.publish(msg.reply, body, headers=headers)
        except Exception as error:  # the connection went away: the caller times out and retries elsewhere
            log.warning("reply_failed", error=describe(error))

    def _parsed(self, msg: Msg) -> OntologyQuery | DocumentRequest | StatusRequest | bytes | None:
        """The request's body read as its operation's, or the error reply to send instead; None for a subject
        naming no operation or workspace (a runner answers so)."""
        workspace, operation = workspace_of_subject(msg.subject), self.names.operation_of(msg.subject)
        if workspace is None or operation is None:
            return None
        if operation == "query":
            query = parse_request(msg.data, workspace, self.settings.max_query_chars)
            unused = None if isinstance(query, bytes) else unused_fusion_parameter(query, self.settings.fusion_method)
            return query if unused is None else error_reply("invalid_request", unused.message, [unused])
        if operation == "document":
            return parse_body(DocumentRequest, msg.data, workspace)
        return parse_body(StatusRequest, msg.data, workspace)

    async def _answer(self, admitted: Admitted, waited_ms: float = 0.0) -> bytes:
        """The reply to a request on {prefix}.{query|document|status}.{workspace}; ``waited_ms``: how long it
        waited for a runner."""
        self.handled += 1
        msg, deadline, request = admitted.msg, admitted.deadline, admitted.request
        workspace = workspace_of_subject(msg.subject)
        operation = self.names.operation_of(msg.subject)
        if workspace is None or operation is None:
            token = msg.subject.rsplit(".", 1)[-1]
            canonical = canonical_spelling(token)
            served = canonical is not None and workspace_of_subject(f"{msg.subject[: -len(token)]}{canonical}")
            spelled = f": its workspace is written {canonical!r}, with lower-case hex escapes" if served else ""
            return error_reply(
                "invalid_request",
                "the subject does not name an operation and a valid workspace",
                [ErrorDetail(field=None, message=f"subject {msg.subject!r}{spelled}")],
            )
        try:
            if isinstance(request, OntologyQuery):
                return await self._query(admitted, workspace, request, waited_ms)
            if isinstance(request, DocumentRequest):
                return await self._document(workspace, request)
            assert isinstance(request, StatusRequest), request
            return await self._status(workspace, request)
        except RetrievalUnavailable as error:
            if not error.out_of_time:
                return error_reply("unavailable", str(error), retryable=True)
            short = self._timeout_too_short(deadline)
            if hopeless(deadline, error.least_ms):
                return hopeless_reply(str(error), deadline.timeout_ms, error.least_ms, short)
            return error_reply("deadline_exceeded", str(error), retryable=True, timeout_too_short=short)
        except PositionUnavailable as error:
            return error_reply("unavailable", str(error), retryable=True)
        except Exception as error:
            if _unavailable(error):  # the database or JetStream away: another try, maybe on another worker
                log.warning("request_unavailable", workspace=workspace, error=describe(error))
                return error_reply("unavailable", f"a store could not be read ({type(error).__name__})", retryable=True)
            log.exception("query_failed", workspace=workspace)
            return error_reply("internal", "the request failed unexpectedly; see the worker log", retryable=True)

    async def _query(self, admitted: Admitted, workspace: str, query: OntologyQuery, waited_ms: float = 0.0) -> bytes:
        assert self._pipeline is not None
        assert self._nc is not None
        response = await self._pipeline.answer(query, workspace, admitted.deadline.at, waited_ms)
        admitted.from_cache = response.meta.cache_hit
        budget = query.max_tokens or self.settings.answer_max_tokens
        try:
            return fit_reply(response, budget, self._nc.max_payload - HEADER_ALLOWANCE_BYTES)
        except TooLarge as error:  # the answer's _meta alone outgrew the budget asked for
            return error_reply(
                "invalid_request",
                str(error),
                [ErrorDetail(field="maxTokens", message=f"{budget} is too small for this answer; ask for more")],
            )

    async def _document(self, workspace: str, request: DocumentRequest) -> bytes:
        assert self._lookups is not None
        assert self._nc is not None
        try:
            reply = (await self._lookups.document(workspace, request)).model_dump_json().encode()
        except DocumentNotFound as error:
            return error_reply("not_found", str(error), [ErrorDetail(field="id", message="no such document")])
        except OffsetPastEnd as error:
            return error_reply("invalid_request", str(error), [ErrorDetail(field="offset", message=str(error))])
        if len(reply) > self._nc.max_payload - HEADER_ALLOWANCE_BYTES:
            # The field that made it so large: maxTokens when only that was given (a review's).
            field = "maxTokens" if request.max_tokens is not None and request.max_chars is None else "maxChars"
            return error_reply(
                "invalid_request",
                "the slice asked for exceeds a message",
                [ErrorDetail(field=field, message="ask for less")],
            )
        return reply

    async def _status(self, workspace: str, request: StatusRequest) -> bytes:
        assert self._lookups is not None
        return (await self._lookups.status(workspace, request)).model_dump_json().encode()

    async def _reader_pool(self, database_url: str, stalled_s: float, *, replica: bool = False) -> asyncpg.Pool:
        """A pool acting as the reader role, whatever the URL's own rights: no query path can write. A replica's
        connects on first use: one that is down is passed over by the reads, not fatal here."""
        settings, url = self.settings, database_url
        if not replica:  # each step waits while its database cannot serve yet (every slot taken, not up yet)
            if settings.query_database_url is not None and not settings.partition_database_urls():
                url = settings.query_database_url  # a login of the reader role only: it waits for a migrator
            else:
                await once_the_database_serves(database_url, partial(migrate, database_url, settings))
            await once_the_database_serves(url, partial(wait_until_migrated, url, settings))
        if self._reader_login is not None and url == database_url:
            url = with_login(url, *self._reader_login)
        pool = partial(
            create_pool,
            url,
            settings,
            min_size=0 if replica else 2,
            max_size=max(4, 2 * settings.query_concurrency),
            role=READER_ROLE,
            command_timeout_s=stalled_s,
            keep_session=True,  # reads only: transactions and SET LOCAL
            niceness=settings.query_niceness,
        )
        return await (pool() if replica else once_the_database_serves(url, pool))

    async def stop(self, timeout_s: float = 10.0) -> None:
        """No new requests; those already received are answered (for up to ``timeout_s``), the rest cancelled,
        then everything closes."""
        subscriptions, self._subscriptions = self._subscriptions, []
        service, self._service = self._service, None
        if service is not None:
            with contextlib.suppress(Exception):
                await service.stop()
        for subscription in subscriptions:
            with contextlib.suppress(Exception):  # the connection may be gone already
                async with asyncio.timeout(timeout_s):
                    await subscription.drain()  # type: ignore[no-untyped-call]
        self._request_subscriptions = []
        for tally in (self._without_reply, self._refused_unread, self._refused_arriving, self._refused_busy):
            tally.say(then_again=False)
        with contextlib.suppress(TimeoutError):  # those received are answered; past the timeout, cancelled
            async with asyncio.timeout(timeout_s):
                await self._arrived.join()
            async with asyncio.timeout(timeout_s):
                await self._waiting.join()
        runners, self._runners = self._runners, []
        # Cancelled until they end: one cut in a NATS request may go on to wait for the next request, for ever.
        await asyncio.gather(*map(cancel_and_wait, runners), *self._expiries, return_exceptions=True)
        if self._versions is not None:
            await self._versions.stop()
            self._versions = None
        if self._freshness is not None:
            with contextlib.suppress(Exception):
                await self._freshness.stop()
            self._freshness = None
        if self._nc is not None:
            await close_nats(self._nc)
            self._nc = None
        pools, self._pools, self._replica_pools = [*self._pools, *self._replica_pools], [], []
        for pool in pools:
            await pool.close()
        if self._azure is not None:
            await self._azure.close()
            self._azure = None
        if self._reranker is not None:
            await self._reranker.close()
        if self._cache is not None:
            unmetered(self._cache)
            self._cache = None
        log.info("query_worker_stopped")


def following_model(served: ServedModel, cache: LruCache[CacheKey, bytes]) -> Callable[[str], None]:
    """What a read calls with the index's model: the worker embeds queries by it from then on, and forgets the
    answers the other model ranked (their versions are the same: the change did not change the documents)."""

    def follow(model: str) -> None:
        before = served.model_name
        served.observe(model)
        if served.model_name != before:
            cache.drop_where(lambda _: True)

    return follow


def vectors_by(served: ServedModel) -> VectorBy:
    """A query's vector by another model than the worker embeds by now, for a read of an index that holds it."""

    async def vector(model: str, text: str, workspace: str) -> Vector:
        embedder = served.embedder_of(model)
        if embedder is None:
            raise ModelChanged(f"the index holds {model} vectors, a model this worker does not have")
        found, _ = await embedder.embed_query_with_tokens_async(text, workspace)
        return found

    return vector
