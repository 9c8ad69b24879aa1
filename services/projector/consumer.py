"""A projector: the projection runner over the batches of a durable pull consumer, each delta settled on JetStream.

What is in the sink is acked, and only then: a crash before the ack redelivers it, and the sink's idempotent write
makes the repeat a no-op. A delta that can never apply is dead-lettered with its reason, then terminated. What the
sink could not write for a passing reason is nak'd with a growing delay and comes back. The consumer's ack floor is
then the projector's position: every delta up to it is in the sink (or dead-lettered).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import get_args

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from opentelemetry import propagate
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import Link, get_current_span

from ontofabric.shared.jetstream import (
    MAX_NAK_DELAY_S,
    SERVER_ANSWER_HEADERS,
    BatchPuller,
    StreamReader,
    backoff_s,
    connection_of,
    last_sequence_on,
    nak_delay,
    refused_promptly,
)
from ontofabric.shared.logging import describe, get_logger
from ontofabric.shared.lru import LruCache
from ontofabric.shared.printable import printable
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import NO_WORKSPACE, Names, Partition, workspace_of, workspace_token_of
from ontofabric.shared.tasks import cancel_and_wait
from ontofabric.shared.telemetry import instruments, meter, trace_context_of, tracer

from .planning import SERVER_ANSWER, Rejection, RejectReason
from .runner import Outcome, ProjectionRunner

log = get_logger(__name__)

FIRST_PAUSE_S = 0.25
MAX_PAUSE_S = 5.0
"""The projector's pause after a batch the sink could not take, doubling while it cannot, at most this."""

FORGET_SENT_BACK_S = 120.0
"""How long a delta sent back for a retry holds later copies of its event without coming back to this process:
well past the longest nak delay (30 s) and ack wait, while one that failed again is sent back anew each time."""

MAX_SPAN_LINKS = 128
"""The OpenTelemetry SDK's default link limit per span; more are dropped."""

WATCH_EVERY_S = 5.0
"""How often a projector asks JetStream for its consumer's state (one request): what the gauges below report."""
MAX_WORKSPACES_WATCHED = 10_000
"""Workspaces whose lag a projector reports at most (the most recently published to): bounds the series."""


class WorkspaceLag:
    """How far a consumer is behind each workspace, in stream sequences: the newest delta the stream stored for the
    workspace minus the highest this consumer has settled there (applied or dead-lettered), or its ack floor when
    that is higher (another process of the same consumer, or a restart, settled them). Pure bookkeeping."""

    def __init__(self, max_workspaces: int = MAX_WORKSPACES_WATCHED) -> None:
        self._published: LruCache[str, int] = LruCache(max_workspaces)
        self._settled: LruCache[str, int] = LruCache(max_workspaces)
        self._floor = 0

    def published(self, workspace: str, seq: int) -> None:
        self._published.put(workspace, max(seq, self._published.peek(workspace) or 0))

    def settled(self, workspace: str, seq: int) -> None:
        self._settled.put(workspace, max(seq, self._settled.peek(workspace) or 0))
        self.published(workspace, seq)  # it was stored, even if its republished headers were missed

    def floor(self, seq: int) -> None:
        self._floor = max(self._floor, seq)

    def lags(self) -> dict[str, int]:
        return {
            workspace: max(newest - max(self._settled.peek(workspace) or 0, self._floor), 0)
            for workspace, newest in self._published.items()
        }


EventKey = tuple[str, str]
"""A delta's workspace (its subject's token) and event id."""


def event_key(subject: str, data: bytes) -> EventKey | None:
    """A delta's workspace and event id, read from its body; None when it has none (validation says why)."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        return None
    # The contract takes the field by its name too (validate_by_name), the wire name first.
    event = (body.get("eventId") or body.get("event_id")) if isinstance(body, dict) else None
    return (workspace_token_of(subject) or "", event) if isinstance(event, str) else None


class SentBack:
    """The deltas sent back for a retry, by event, so that a later copy of such an event (stored again past the
    duplicate window) waits until the copy sent back is in, as a replay folds them: a copy is a no-op wherever it
    comes second, so applied first it would take the earlier copy's place over the deltas between them. Other
    deltas need no wait: a document's row keeps the latest by stream sequence, whatever order they come in. Pure
    bookkeeping, of this process's deliveries, and at its start of what a crashed one held (:func:`remember_in_flight`;
    docs/reliability.md)."""

    def __init__(self) -> None:
        self._waiting: dict[EventKey, dict[int, float]] = {}
        """event -> sequence of a copy sent back -> when"""
        self._events: dict[int, EventKey] = {}

    def blocker(self, key: EventKey, in_hand: Iterable[int]) -> int | None:
        """The earliest copy of the event that was sent back and is not among ``in_hand``: every later copy
        waits for it."""
        waiting = self._waiting.get(key)
        if not waiting:
            return None
        held = set(in_hand)
        return min((seq for seq in waiting if seq not in held), default=None)

    def sent_back(self, key: EventKey, seq: int, now: float) -> None:
        self._waiting.setdefault(key, {})[seq] = now
        self._events[seq] = key

    def settled(self, seq: int) -> None:
        self._forget_one(seq)

    def floor(self, seq: int) -> None:
        """Everything up to the consumer's ack floor is settled (by any process of the consumer)."""
        for settled in [s for s in self._events if s <= seq]:
            self._forget_one(settled)

    def expire(self, now: float, after_s: float) -> None:
        """Forget what was sent back longer ago than ``after_s`` (another process took it, or it was deleted from
        the stream): a later copy never waits for good on a delta this process will not see again."""
        for seq in [s for s, key in self._events.items() if now - self._waiting[key][s] > after_s]:
            self._forget_one(seq)

    def _forget_one(self, seq: int) -> None:
        key = self._events.pop(seq, None)
        if key is not None:
            waiting = self._waiting[key]
            del waiting[seq]
            if not waiting:
                del self._waiting[key]

    def __len__(self) -> int:
        return len(self._events)


UNKNOWN_AFTER_S = 3 * WATCH_EVERY_S
"""How long a consumer's state may go unread before its gauges are left out, rather than report a last value."""


@dataclass
class ConsumerState:
    """What the gauges report for one (index, consumer)."""

    undelivered: int = 0
    unacked: int = 0
    workspaces: WorkspaceLag = field(default_factory=WorkspaceLag)
    unread_since: float | None = None
    """Since when (monotonic) JetStream has not told this consumer's state; None while it does."""

    def known(self, now: float) -> bool:
        """Whether the gauges may report it: while NATS is away its lag is not known, and a last value (0 after a
        quiet spell) read as all caught up (an operator tester's; the discovery alerts said NATS was away)."""
        return self.unread_since is None or now - self.unread_since < UNKNOWN_AFTER_S


_WATCHED: dict[tuple[str, str], ConsumerState] = {}
_STREAMS: dict[str, tuple[int, int, float]] = {}
"""What each stream the projectors read holds, in bytes, the most it may (-1: no limit), and when (monotonic) that
was last read: a reading older than ``UNKNOWN_AFTER_S`` is not reported, as a consumer's lag is not while NATS is
away (an ops tester's stream size stayed at its last value)."""


def _streams_known() -> dict[str, tuple[int, int]]:
    now = time.monotonic()
    return {stream: (held, most) for stream, (held, most, at) in _STREAMS.items() if now - at < UNKNOWN_AFTER_S}


def _per_consumer(value: Callable[[ConsumerState], int]) -> Callable[[CallbackOptions], list[Observation]]:
    def observe(_: CallbackOptions) -> list[Observation]:
        now = time.monotonic()
        return [
            Observation(value(state), {"index": index, "consumer": consumer})
            for (index, consumer), state in _WATCHED.items()
            if state.known(now)
        ]

    return observe


def _observe_workspace_lag(_: CallbackOptions) -> list[Observation]:
    now = time.monotonic()
    return [
        Observation(lag, {"index": index, "workspace": workspace})
        for (index, _consumer), state in _WATCHED.items()
        if state.known(now)
        for workspace, lag in state.workspaces.lags().items()
    ]


meter().create_observable_gauge(
    "projector.lag",
    callbacks=[_per_consumer(lambda s: s.undelivered)],
    description="deltas in the stream not yet delivered to the projector",
)
meter().create_observable_gauge(
    "projector.unacked",
    callbacks=[_per_consumer(lambda s: s.unacked)],
    description="deltas delivered and not yet settled",
)


def _observe_stream_bytes(_: CallbackOptions) -> list[Observation]:
    return [Observation(held, {"stream": stream}) for stream, (held, _most) in _streams_known().items()]


def _observe_stream_limits(_: CallbackOptions) -> list[Observation]:
    return [Observation(most, {"stream": stream}) for stream, (_held, most) in _streams_known().items() if most > 0]


meter().create_observable_gauge(
    "projector.stream.bytes",
    callbacks=[_observe_stream_bytes],
    description="what the delta and dead-letter streams hold",
)
meter().create_observable_gauge(
    "projector.stream.max_bytes",
    callbacks=[_observe_stream_limits],
    description="the most a stream may hold (ONTOFABRIC_DELTA_STREAM_MAX_BYTES); at it, it refuses new deltas",
)
meter().create_observable_gauge(
    "projector.workspace.lag",
    callbacks=[_observe_workspace_lag],
    description="stream sequences between a workspace's newest delta and the last the projector settled there",
)


def _ingest_links(messages: Sequence[Msg]) -> list[Link]:
    """A link to each ingest trace the batch's deltas carry in their headers: one batch span serves many traces.

    One ingest run puts its context on every delta it sends, so the same link repeats; each is kept once."""
    contexts = (get_current_span(propagate.extract(msg.headers or {})).get_span_context() for msg in messages)
    distinct = {(c.trace_id, c.span_id): c for c in contexts if c.is_valid}
    return [Link(context) for context in list(distinct.values())[:MAX_SPAN_LINKS]]


REFUSED_BY_EVERY_PROCESS: frozenset[RejectReason] = frozenset({"invalid_schema", "subject_mismatch"})
"""Refusals the delta's bytes and subject decide alone. Another layout's floor also covers what it applied, and the
other refusals depend on a process's settings or its index (a content limit, the model, an event id handled): a
delta another layout applied and this one refuses is dead-lettered, never only terminated (a review, 2026-11-29)."""
LEFT_TO_THE_HOLDER_S = 1.0
"""How soon a batch this process no longer knows it may apply comes back (to whichever process applies it then)."""
SETTLED_ELSEWHERE_TTL_S = 5.0
"""How long a reading of where other layouts' consumers stand serves (read only when a delta is to be dead-lettered)."""


class DurableProjection:
    """Settles what the runner made of each batch on JetStream.

    ``dead_letters_invalid``: whether this projector dead-letters deltas no index can apply (one projector per
    stream does; the others only terminate them). ``min_retry_s``: the shortest wait before a nak'd delta comes
    back (an index whose reads lag its writes needs them visible first). ``partition``: the workspaces this
    consumer applies; the deltas of others are acked as they pass, so its ack floor stays the index's position
    for every workspace of its partition (None: every workspace). ``settled_elsewhere``: the stream sequence up to
    which other consumers of the same index settled every delta (another partition layout's); a delta at or below
    it that cannot apply was dead-lettered then (or its dead letter handled since), and is only terminated here."""

    def __init__(
        self,
        runner: ProjectionRunner,
        js: JetStreamContext,
        names: Names,
        durable: str,
        *,
        dead_letters_invalid: bool = True,
        min_retry_s: float = 0.0,
        partition: Partition | None = None,
        settled_elsewhere: Callable[[], Awaitable[int]] | None = None,
        held_back: Callable[[], str | None] | None = None,
    ) -> None:
        self._runner = runner
        self.durable = durable
        """The durable consumer whose batches this handles."""
        self._partition = partition
        self._index = runner.sink.index
        self._js = js
        self._names = names
        self._dead_letters_invalid = dead_letters_invalid
        self._min_retry_s = min_retry_s
        self._settled_elsewhere = settled_elsewhere
        self._held_back = held_back
        """Why this process does not apply the consumer's batches now, None while it does (worker.py)."""
        self._elsewhere: tuple[float, int] | None = None
        """The last reading of ``settled_elsewhere``, and when (monotonic)."""
        self._metrics = instruments()
        # Each reason's count is there from the start, at 0: a counter that first appears at 1 shows Prometheus no
        # increase, and the dead-letter alert missed a process's first dead letter of each reason.
        for reason in get_args(RejectReason):
            self._metrics.projector_deltas.add(0, {"outcome": "dead_lettered", "index": self._index, "reason": reason})
        self._failing = 0
        """Batches in a row whose sink write failed for a passing reason (the database away)."""
        self.failing_since: float | None = None
        """Since when (monotonic) every batch's write has failed for a passing reason; None while they go in."""
        self.sent_back = SentBack()
        self.forget_sent_back_s = FORGET_SENT_BACK_S
        """How long a copy waits for a delta sent back that does not come back here (see FORGET_SENT_BACK_S)."""
        self.state = _WATCHED.setdefault((self._index, durable), ConsumerState())

    def forget(self) -> None:
        """Stop reporting this consumer's gauges (it has stopped)."""
        _WATCHED.pop((self._index, self.durable), None)

    def holds(self, subject: str) -> bool:
        """Whether this consumer applies the deltas of the subject's workspace."""
        return self._partition is None or self._partition.holds(subject)

    def _settled(self, msg: Msg) -> None:
        self.sent_back.settled(msg.metadata.sequence.stream)
        workspace = workspace_of(msg.subject)
        if workspace is not None:
            self.state.workspaces.settled(workspace, msg.metadata.sequence.stream)

    def _in_order(self, messages: Sequence[Msg]) -> tuple[list[Msg], list[Msg]]:
        """The batch split into what may be written now and what waits: later copies of an event whose earlier
        copy was sent back for a retry (and is not in this batch). Bodies are read only while something waits."""
        self.sent_back.expire(time.monotonic(), self.forget_sent_back_s)
        if not self.sent_back:
            return list(messages), []
        in_hand = [msg.metadata.sequence.stream for msg in messages]
        now: list[Msg] = []
        later: list[Msg] = []
        for msg in messages:
            key = event_key(msg.subject, msg.data)
            blocker = None if key is None else self.sent_back.blocker(key, in_hand)
            (later if blocker is not None and msg.metadata.sequence.stream > blocker else now).append(msg)
        return now, later

    async def _send_back(self, messages: Sequence[Msg]) -> None:
        """Nak with backoff: each comes back after a growing delay (at least ``min_retry_s``); until then later
        copies of its event wait too."""
        moment = time.monotonic()
        for msg in messages:
            # Stored, though its republished headers may have come before this process did (a restart): a workspace
            # whose deltas keep failing is behind (an ops tester's: it was not, for the alert).
            if (workspace := workspace_of(msg.subject)) is not None:
                self.state.workspaces.published(workspace, msg.metadata.sequence.stream)
            key = event_key(msg.subject, msg.data)
            if key is not None:
                self.sent_back.sent_back(key, msg.metadata.sequence.stream, moment)
            await msg.nak(delay=max(self._min_retry_s, nak_delay(msg.metadata.num_delivered)))

    def held_back(self) -> str | None:
        """Why this process does not apply the consumer's batches now; None while it does."""
        return None if self._held_back is None else self._held_back()

    async def handle(self, messages: Sequence[Msg]) -> None:
        why = self.held_back()
        if why is not None:
            for msg in messages:  # back to the consumer, for the process applying it now (or after an adoption)
                await msg.nak(delay=LEFT_TO_THE_HOLDER_S)
            log.info("batch_sent_back", index=self._index, size=len(messages), reason=why)
            return
        started = time.perf_counter()
        for msg in messages:  # in hand, not settled: behind until it is (a batch the database holds up included)
            workspace = workspace_of(msg.subject)
            # Another partition's deltas are acked on sight and never settled here: counted, this consumer's 0
            # stood beside the right one's figure, and the gauge kept the last (a review's).
            if workspace is not None and self.holds(msg.subject):
                self.state.workspaces.published(workspace, msg.metadata.sequence.stream)
        if messages:
            self.state.undelivered = messages[-1].metadata.num_pending
        redelivered = sum(1 for msg in messages if msg.metadata.num_delivered > 1)
        if redelivered:
            self._metrics.projector_redeliveries.add(redelivered, {"index": self._index})
        if self._partition is not None:
            elsewhere = [msg for msg in messages if not self.holds(msg.subject)]
            for msg in elsewhere:  # another partition's consumer applies these
                await msg.ack()
            self._count(len(elsewhere), "other_partition")
            messages = [msg for msg in messages if self.holds(msg.subject)]
        messages, later = self._in_order(messages)
        if later:
            log.info(
                "copies_wait_for_earlier", index=self._index, size=len(later), first=later[0].metadata.sequence.stream
            )
            await self._send_back(later)
            self._count(len(later), "waiting")
        with tracer().start_as_current_span("projector.batch", links=_ingest_links(messages)) as span:
            span.set_attribute("batch.size", len(messages))
            span.set_attribute("index", self._index)
            settled = retried = False
            async for outcome in self._runner.run(messages):
                await self._settle(outcome)
                settled |= bool(outcome.done)
                retried |= bool(outcome.retry)
            if settled:
                await self._runner.sink.settled()
        duration_ms = (time.perf_counter() - started) * 1000
        self._metrics.projector_batch_duration.record(duration_ms, {"index": self._index})
        # The sink is away: the next batch would fail the same way at once. Wait before fetching it, longer each
        # time (the nak'd deltas come back on their own delays meanwhile).
        self._failing = self._failing + 1 if retried and not settled else 0
        self.failing_since = (self.failing_since or time.monotonic()) if self._failing else None
        if self._failing:
            await asyncio.sleep(backoff_s(self._failing, FIRST_PAUSE_S, MAX_PAUSE_S))

    async def _settle(self, outcome: Outcome) -> None:
        """Dead-letter (or terminate) what can never apply, nak what must come back, ack what is in the sink. A
        server's answer stored on a delta subject is terminated, counted and logged, not dead-lettered
        (:data:`planning.SERVER_ANSWER`): it is no tenant's delta, and in a tenant's share it pushed out its own."""
        for msg, rejection in outcome.invalid:
            if rejection.detail == SERVER_ANSWER:
                self._settled(msg)
                await msg.term()
                self._count(1, "server_answer_dropped")
                log.warning(
                    "delta_subject_server_answer_dropped", index=self._index, subject=msg.subject,
                    seq=msg.metadata.sequence.stream,
                    note="a client named this delta subject as a reply subject (the server's answer was stored "
                    f"here), or a producer set one of the headers {', '.join(SERVER_ANSWER_HEADERS)} on a delta",
                )  # fmt: skip
        rejected = [(msg, r) for msg, r in outcome.invalid if r.detail != SERVER_ANSWER]
        invalid = await self._not_dead_lettered_before(rejected)
        if self._dead_letters_invalid:
            for msg in await dead_letter(self._js, self._names, invalid, self._index):
                self._settled(msg)
        else:
            for msg, _ in invalid:
                self._settled(msg)
                await msg.term()
                self._count(1, "invalid")
                log.info("delta_invalid_skipped", index=self._index, seq=msg.metadata.sequence.stream)
        if outcome.retry:
            assert outcome.error is not None
            log.warning("batch_retry", index=self._index, error=describe(outcome.error), size=len(outcome.retry))
            await self._send_back(outcome.retry)
            self._count(len(outcome.retry), "retried")
        now = time.time()
        for msg, _ in outcome.done:
            await msg.ack()
            self._settled(msg)
            if outcome.applied and msg.metadata.timestamp is not None:  # in the index since the commit
                # Never below 0: a histogram refuses it, and a projector's clock behind the server's lost them all.
                stored_ms = max(0.0, (now - msg.metadata.timestamp.timestamp()) * 1000)
                self._metrics.projector_freshness.record(stored_ms, {"index": self._index})
        for msg in await dead_letter(
            self._js, self._names, await self._not_dead_lettered_before(outcome.refused), self._index
        ):
            self._settled(msg)
        self._count(outcome.applied, "applied")
        self._count(outcome.noops, "noop")

    async def _not_dead_lettered_before(
        self, rejected: Sequence[tuple[Msg, Rejection]]
    ) -> Sequence[tuple[Msg, Rejection]]:
        """Those of ``rejected`` to dead-letter here. One whose refusal its bytes decide alone, at or below where
        another layout's consumers settled everything, was dead-lettered by that layout: it is only terminated. A
        layout's new consumers replay the stream: past the DLQ's duplicate window their dead letters were stored
        again, and a dead letter an operator had purged or re-driven came back (a red team, 2026-11-29)."""
        if self._settled_elsewhere is None or all(r.reason not in REFUSED_BY_EVERY_PROCESS for _, r in rejected):
            return rejected
        if self._elsewhere is None or time.monotonic() - self._elsewhere[0] > SETTLED_ELSEWHERE_TTL_S:
            self._elsewhere = (time.monotonic(), await self._settled_elsewhere())
        floor = self._elsewhere[1]
        left = []
        for msg, rejection in rejected:
            seq = msg.metadata.sequence.stream
            if seq > floor or rejection.reason not in REFUSED_BY_EVERY_PROCESS:
                left.append((msg, rejection))
                continue
            await msg.term()
            self._settled(msg)
            self._count(1, "dead_lettered_before")
            log.info(
                "delta_dead_lettered_before", index=self._index, seq=seq, reason=rejection.reason, settled_to=floor
            )
        return left

    def _count(self, deltas: int, outcome: str) -> None:
        self._metrics.projector_deltas.add(deltas, {"outcome": outcome, "index": self._index})


async def retry_later(messages: Sequence[Msg], error: BaseException, index: str, min_delay_s: float = 0.0) -> None:
    """Nak with backoff: the deltas come back after a growing delay (at least ``min_delay_s``) and apply then."""
    log.warning("batch_retry", index=index, error=describe(error), size=len(messages))
    for msg in messages:
        await msg.nak(delay=max(min_delay_s, nak_delay(msg.metadata.num_delivered)))
    instruments().projector_deltas.add(len(messages), {"outcome": "retried", "index": index})


def _header_safe(text: str, limit: int = 1000) -> str:
    return " ".join(text.split())[:limit]


@dataclass(frozen=True)
class DeadLetter:
    """A delta as it goes to the DLQ stream: its body, with the reason in headers."""

    subject: str
    body: bytes
    headers: dict[str, str]


def _dead_letter_message(names: Names, msg: Msg, rejection: Rejection, index: str, max_payload: int) -> DeadLetter:
    seq = msg.metadata.sequence.stream
    headers = {
        "Nats-Msg-Id": f"dlq:{index}:{msg.metadata.stream}:{seq}",
        "Ontofabric-Reason": rejection.reason,
        "Ontofabric-Detail": _header_safe(rejection.detail),
        "Ontofabric-Index": index,
        # Escaped: a subject may hold a carriage return or a line feed, which would end the header's line.
        "Ontofabric-Original-Subject": printable(msg.subject),
        "Ontofabric-Original-Stream": msg.metadata.stream,
        "Ontofabric-Original-Sequence": str(seq),
        "Ontofabric-Delivered": str(msg.metadata.num_delivered),
        **trace_context_of(msg.headers),  # its re-drive, and the batch that applies it then, link to its ingest
    }
    body = msg.data
    # A delta stored before the stream kept room for these headers may not fit beside them: the server would refuse
    # the dead letter and nats-py would close the connection. It goes without its body, which stays in the stream.
    if len(body) + sum(len(k) + len(v) + 4 for k, v in headers.items()) + 64 > max_payload:
        headers["Ontofabric-Body-Omitted"] = f"{len(body)} bytes, over the server's max_payload with these headers"
        body = b""
    # Under the workspace's own token, when the subject names one canonically: a consistency tester's delta on
    # "tEab57_63" (not the token of any name) went to a dead-letter subject no workspace selects.
    token = workspace_token_of(msg.subject) if workspace_of(msg.subject) is not None else None
    return DeadLetter(names.dlq_subject(token or NO_WORKSPACE), body, headers)


async def dead_letter(
    js: JetStreamContext, names: Names, rejected: Sequence[tuple[Msg, Rejection]], index: str
) -> list[Msg]:
    """Publish each delta with its reason to the DLQ stream, then terminate it; a delta whose DLQ publish failed is
    nak'd for another try. The publishes go out together and their acknowledgements are awaited together: one
    tenant's flood of malformed deltas holds every other tenant's deltas behind it for as long as this takes.
    Returns the deltas dead-lettered."""
    letters = [_dead_letter_message(names, msg, rejection, index, js._nc.max_payload) for msg, rejection in rejected]
    stored = await asyncio.gather(
        *(js.publish(letter.subject, letter.body, headers=letter.headers) for letter in letters),
        return_exceptions=True,
    )
    done: list[Msg] = []
    for (msg, rejection), ack in zip(rejected, stored, strict=True):
        if isinstance(ack, BaseException):  # the dead letter is not safe yet: keep the original for another try
            if not isinstance(ack, Exception):
                raise ack
            await retry_later([msg], ack, index)
            continue
        await msg.term()
        done.append(msg)
        if ack.duplicate:
            # Stored before, by this process or the one it took over from (a crash after the dead letter, before
            # the batch's end: the delta is read again): one letter, so counted and said once (an operator tester
            # counted 6 dead letters for 3 across the two processes).
            instruments().projector_deltas.add(1, {"outcome": "dead_lettered_before", "index": index})
            log.info(
                "delta_dead_lettered_before", index=index, seq=msg.metadata.sequence.stream, dlq_seq=ack.seq,
                reason=rejection.reason,
            )  # fmt: skip
            continue
        instruments().projector_deltas.add(1, {"outcome": "dead_lettered", "index": index, "reason": rejection.reason})
        # dlq_seq: what `ontofabric dlq show` takes; seq is the delta's own, in the delta stream. Its workspace and
        # branch as its subject names them, if it does (an auditor could not tell whose a letter was from the log).
        workspace, branch = names.scope_of_delta(msg.subject) or (None, None)
        log.warning(
            "delta_dead_lettered", index=index, seq=msg.metadata.sequence.stream, dlq_seq=ack.seq,
            reason=rejection.reason, detail=rejection.detail[:300], workspace=workspace, branch=branch,
        )  # fmt: skip
    return done


class RunningProjection:
    """A projection's pull loop, and the watch that keeps its gauges current: the consumer's state, asked of
    JetStream every few seconds (so an idle or stuck consumer reports too), and the newest delta of each of its
    workspaces, from the headers the delta stream republishes."""

    def __init__(
        self,
        projection: DurableProjection,
        puller: BatchPuller,
        watching: asyncio.Task[None],
        published: Subscription,
        js: JetStreamContext,
        names: Names,
    ) -> None:
        self._projection = projection
        self._puller = puller
        self._watching = watching
        self._published = published
        self._js = js
        self._streams = _join_stream_watch(js, names)

    @property
    def failing_since(self) -> float | None:
        """Since when every batch's write has failed for a passing reason (monotonic); None while they go in."""
        return self._projection.failing_since

    async def stop(self) -> None:
        await cancel_and_wait(self._watching)
        await _leave_stream_watch(self._streams, self._js)
        with contextlib.suppress(Exception):  # the connection may be closing already
            await self._published.unsubscribe()
        await self._puller.stop()
        self._projection.forget()


async def _watch_consumer(js: JetStreamContext, names: Names, projection: DurableProjection) -> None:
    state = projection.state
    newest_known = False
    while True:
        try:
            info = await js.consumer_info(names.delta_stream, projection.durable)
        except Exception as error:  # JetStream away: the gauges keep their last values a while (ConsumerState.known)
            log.debug("consumer_watch_failed", consumer=projection.durable, error=describe(error))
            if state.unread_since is None:
                state.unread_since = time.monotonic()
            newest_known = False  # what was published meanwhile was not heard of
        else:
            state.unread_since = None
            state.undelivered = info.num_pending or 0
            state.unacked = info.num_ack_pending or 0
            if info.ack_floor is not None:
                state.workspaces.floor(info.ack_floor.stream_seq or 0)
                projection.sent_back.floor(info.ack_floor.stream_seq or 0)
            delivered = info.delivered.stream_seq if info.delivered is not None else None
            newest_known = newest_known or await _newest_per_workspace(js, names, projection, delivered or 0)
        await asyncio.sleep(WATCH_EVERY_S)


async def _newest_per_workspace(
    js: JetStreamContext, names: Names, projection: DurableProjection, delivered: int
) -> bool:
    """The newest delta the stream holds of each workspace this projection applies, where the consumer has not
    delivered it yet (``delivered``: the last it did), as its lag counts from: the republished headers it hears
    tell only of those stored since it started (an ops tester's: a backlog made while the projector was down
    showed no lag, or a few deltas, for the workspace alert). One delivered before may have been settled, which a
    process started since cannot tell (above an ack floor held back by another delta, it would count as behind: a
    review's); those delivered again are counted as they come (``handle``). One read a subject; whether read."""
    try:
        held = await js.stream_info(names.delta_stream, subjects_filter=names.delta_subjects)
        for subject in list(held.state.subjects or {})[:MAX_WORKSPACES_WATCHED]:
            workspace = workspace_of(subject)
            if workspace is not None and projection.holds(subject):
                newest = await last_sequence_on(js, names.delta_stream, subject)
                if newest > delivered:
                    projection.state.workspaces.published(workspace, newest)
    except Exception as error:  # read again at the next watch
        log.debug("newest_per_workspace_unread", consumer=projection.durable, error=describe(error))
        return False
    return True


@dataclass
class _StreamWatch:
    """One watch of the streams' bytes per process, whatever the projections in it (each partition's consumer asked
    both streams' info before: 2n requests every few seconds for n partitions). It asks through the connection of
    the projection that joined last, and ends, its gauges with it, when the last one stops."""

    streams: tuple[str, ...]
    joined: list[JetStreamContext] = field(default_factory=list)
    task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        while self.joined:
            for stream in self.streams:
                try:
                    held = await self.joined[-1].stream_info(stream)
                except Exception as error:
                    log.debug("stream_watch_failed", stream=stream, error=describe(error))
                else:
                    _STREAMS[stream] = (held.state.bytes or 0, held.config.max_bytes or -1, time.monotonic())
            await asyncio.sleep(WATCH_EVERY_S)


_STREAM_WATCHES: dict[tuple[str, ...], _StreamWatch] = {}


def _join_stream_watch(js: JetStreamContext, names: Names) -> _StreamWatch:
    streams = (names.delta_stream, names.dlq_stream)
    watch = _STREAM_WATCHES.setdefault(streams, _StreamWatch(streams))
    watch.joined.append(js)
    if watch.task is None or watch.task.done() or watch.task.get_loop() is not asyncio.get_running_loop():
        watch.task = asyncio.create_task(watch.run(), name=f"watch:{names.delta_stream}")
    return watch


async def _leave_stream_watch(watch: _StreamWatch, js: JetStreamContext) -> None:
    watch.joined.remove(js)
    if watch.joined or watch.task is None:
        return
    _STREAM_WATCHES.pop(watch.streams, None)
    await cancel_and_wait(watch.task)
    watch.task = None
    for stream in watch.streams:
        _STREAMS.pop(stream, None)


IN_FLIGHT_LOOKBACK = 1000
"""Delivered sequences a starting projector reads back from the last its consumer delivered (the default bound of
unacked deltas), to learn what a process before it had in hand."""


IN_FLIGHT_READS_AT_ONCE = 16
"""Stored deltas a starting projector asks for at a time while it reads back what was in flight: 16 of the
largest (1 MiB, a third more as the server's JSON) stay well under a connection's pending limit (64 MB)."""


def in_flight_candidates(floor: int, delivered: int, lookback: int = IN_FLIGHT_LOOKBACK) -> list[int]:
    """The sequences that may be in hand unacked: the one just past the ack floor (unacked by definition), and the
    last ``lookback`` delivered (a crashed process's batch sits at the top, not at the floor)."""
    if delivered <= floor:
        return []
    top = range(max(floor + 1, delivered - lookback + 1), delivered + 1)
    return ([floor + 1] if floor + 1 < top.start else []) + list(top)


async def remember_in_flight(js: JetStreamContext, names: Names, projection: DurableProjection) -> int:
    """Deltas the consumer had delivered and not settled when a process of it ended (a crash) come back after the
    ack wait, behind deltas never delivered: each is recorded as sent back, so that a later copy of its event waits
    for it in this process too. Returns how many were recorded. One the consumer had settled meanwhile (acked past
    a gap) is forgotten once the ack floor passes it."""
    try:
        info = await js.consumer_info(names.delta_stream, projection.durable)
    except Exception as error:  # an aid to order: the projector starts anyway
        log.warning("in_flight_unread", consumer=projection.durable, error=describe(error))
        return 0
    floor, delivered = info.ack_floor.stream_seq or 0, info.delivered.stream_seq or 0
    if not info.num_ack_pending:
        return 0
    moment, recorded = time.monotonic(), 0
    nc, subject = connection_of(js), f"$JS.API.STREAM.MSG.GET.{names.delta_stream}"
    candidates = in_flight_candidates(floor, delivered)
    # Read a group at a time: one by one, the round trips of a full lookback held the start up (a second on a
    # server a millisecond away).
    for start in range(0, len(candidates), IN_FLIGHT_READS_AT_ONCE):
        group = candidates[start : start + IN_FLIGHT_READS_AT_ONCE]
        reads = [refused_promptly(nc, subject, js.get_msg(names.delta_stream, seq)) for seq in group]
        failed = False
        for seq, stored in zip(group, await asyncio.gather(*reads, return_exceptions=True), strict=True):
            if isinstance(stored, asyncio.CancelledError):
                raise stored
            if isinstance(stored, NotFoundError):  # deleted from the stream (compacted, purged)
                continue
            if isinstance(stored, BaseException):  # as above (a permission refused is said at once)
                log.warning("in_flight_unread", consumer=projection.durable, seq=seq, error=describe(stored))
                failed = True
                break
            key = event_key(stored.subject or "", stored.data or b"")
            if key is not None and projection.holds(stored.subject or ""):
                projection.sent_back.sent_back(key, seq, moment)
                recorded += 1
        if failed:
            break
    log.info("in_flight_remembered", consumer=projection.durable, deltas=recorded, floor=floor, delivered=delivered)
    return recorded


async def restart_consumer(js: JetStreamContext, names: Names, durable: str) -> int:
    """Delete the durable consumer when it has delivered deltas, so that the next start reads the stream again,
    from its first delta or where :func:`start_projection` is told (the sequence rule makes a delta applied twice
    harmless). Returns the stream sequence it had delivered up to (0: nothing to restart)."""
    try:
        info = await js.consumer_info(names.delta_stream, durable)
    except NotFoundError:
        return 0
    # Delivered, not acked: with the first delta still being retried the ack floor stays 0 while later ones went in.
    delivered = int((info.delivered.stream_seq or 0) if info.delivered is not None else 0)
    if delivered:
        await js.delete_consumer(names.delta_stream, durable)
    return delivered


async def start_projection(
    nc: Client,
    names: Names,
    settings: Settings,
    projection: DurableProjection,
    batch_size: int,
    start_seq: int | None = None,
) -> RunningProjection:
    """A projector's durable pull consumer of every delta, from the stream's first (or, made anew, from
    ``start_seq``), read and handed to ``projection`` in a task of its own. Deltas are acked one by one after they
    are in the sink; an unacked one comes back after the ack wait (kept from running out while its batch is being
    handled), for ever."""
    js = nc.jetstream()
    durable = projection.durable
    try:  # where an existing consumer starts cannot be changed: kept as it is
        start = (await js.consumer_info(names.delta_stream, durable)).config.opt_start_seq
    except NotFoundError:
        start = start_seq
    config = ConsumerConfig(
        name=durable,  # with the name, nats-py creates through CONSUMER.CREATE.<stream>.<name>.<filter>
        durable_name=durable,
        filter_subject=names.delta_subjects,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL if not start else DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=start or None,
        ack_wait=settings.projector_ack_wait_s,
        max_deliver=-1,
        max_ack_pending=max(4 * settings.projector_batch_size, 1000),
        num_replicas=settings.nats_replicas,
    )
    # Create, or bring an existing durable up to this configuration (a shorter ack wait than an older version's).
    await js.add_consumer(names.delta_stream, config)
    # A delta sent back comes back within its nak delay, or after a crash within the ack wait.
    projection.forget_sent_back_s = max(FORGET_SENT_BACK_S, 2 * (settings.projector_ack_wait_s + MAX_NAK_DELAY_S))
    await remember_in_flight(js, names, projection)
    subscription = await js.pull_subscribe_bind(durable, names.delta_stream)
    reader = StreamReader(
        subscription,
        name=durable,
        connection=nc,
        batch_size=batch_size,
        fetch_timeout_s=settings.projector_batch_timeout_s,
        # A holder woken past its lease fetches nothing until it has looked again: fetched from the consumer its
        # successor may have made again, the batch went back behind what the successor read next (a review's).
        paused=lambda: projection.held_back() is not None,
    )
    # The server hears that a batch is in hand a few times per ack wait, so the wait can be short: after a crash
    # its deltas come back within it.
    puller = BatchPuller(reader, projection.handle, progress_every_s=settings.projector_ack_wait_s / 3)
    workspaces = projection.state.workspaces

    async def published(msg: Msg) -> None:
        subject, seq = (msg.headers or {}).get("Nats-Subject", ""), (msg.headers or {}).get("Nats-Sequence", "")
        workspace = workspace_of(subject)
        if workspace is not None and seq.isdigit() and projection.holds(subject):
            workspaces.published(workspace, int(seq))

    watch = await nc.subscribe(names.published_subjects, cb=published)
    puller.start()
    watching = asyncio.create_task(_watch_consumer(js, names, projection), name=f"watch:{durable}")
    return RunningProjection(projection, puller, watching, watch, js, names)
