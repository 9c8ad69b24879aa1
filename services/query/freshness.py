"""How far an answer is behind the delta stream (``_meta.freshness``, and the status lookup).

The index's position is the Postgres projector's: its durable consumer's ack floor, the stream sequence up to which
every delta was acked (in the index) or terminated (dead-lettered). A branch's highest applied sequence would not do:
a delta waiting for a retry may lie below it. An answer reads the position before its first snapshot, so it holds
every delta up to it. Each partition layout has consumers of its own, each layout's lowest floor a position of the
index: the worker reads the configured layout's and those of the layouts the running projectors announce, and
takes the highest, so a worker configured with another layout than the projectors' still tells the truth.

What has been published past the position is counted from the headers the stream republishes for every delta it
stores (sequence and time), watched from the worker's start and forgotten a minute after a position passed them.
Below what was published before the watch began, what it did not see (a reconnection), what it had to forget to
stay bounded, and what it has forgotten, the count is asked of JetStream instead: a consumer made for it and
removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from datetime import datetime

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from ontofabric.shared.discovery import discover, running_layouts
from ontofabric.shared.jetstream import highest_known_floor, last_sequence_on
from ontofabric.shared.logging import describe, get_logger
from ontofabric.shared.lru import LruCache
from ontofabric.shared.subjects import Names, encode_token, partition_of_token
from ontofabric.shared.tasks import cancel_and_wait
from ontofabric.shared.telemetry import housekeeping

from .core import Pending

log = get_logger(__name__)

POSITION_TTL_S = 0.05
"""How long a read position serves later answers: an older one only understates what they hold."""
POSITION_UNKNOWN_WARN_S = 60.0
"""How long the position may be unknown for want of a projector consumer (a takeover takes seconds) before a
warning says so, once."""
POSITION_WAIT_S = 0.5
"""How long an answer waits for the position before it goes on without (JetStream slow or away)."""
EXACT_COUNT_TTL_S = 1.0
"""How long a count asked of JetStream serves the same branch's later answers."""
UNCOUNTED_RETRY_S = 5.0
"""After JetStream could not count a branch's deltas, how long its answers say they cannot tell without asking it
again (with the stream deleted, every answer asked and logged a warning: note 73)."""
MAX_WATCHED = 100_000
"""Deltas remembered past the position at most; past that the watch starts over from the newest it saw."""
FORGET_AFTER_S = 60.0
"""How long the deltas a position passed are remembered after it was read: an answer still working from that
position (a slow reranker, a deep query, a shared answer) counts past it. One older asks JetStream."""
LAYOUT_CHECK_S = 10.0
"""How often the worker asks which partition layouts the running projectors serve, and which refuse the stream."""


def _epoch(stamp: str) -> float:
    """An RFC 3339 time with up to nanoseconds, as nats-server writes it, in seconds since the epoch."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    seconds = datetime.fromisoformat(whole + "+00:00").timestamp()
    return seconds + (float(f"0.{fraction}") if fraction else 0.0)


def age_ms(stored_at: float) -> float:
    """How long ago the NATS server stored a message, by this host's clock; never below 0: a clock behind the
    server's made it a negative age (a clock tester's status said a delta had been pending for -276 s)."""
    return max(0.0, round((time.time() - stored_at) * 1000, 1))


async def published_after(js: JetStreamContext, stream: str, subject: str, seq: int, name: str) -> Pending:
    """The subject's messages stored after ``seq``, and how long ago the first was: a consumer of its own named
    ``name``, made and removed here, counts them. Named, because the create request of an unnamed consumer could
    name a projector's durable and reconfigure it; NATS permissions allow this worker only named creates
    (shared/nats_auth.py)."""
    consumer = await js.add_consumer(
        stream,
        ConsumerConfig(
            name=name,
            filter_subject=subject,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=seq + 1,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=10.0,  # the server removes it if the delete below never arrives
            mem_storage=True,
        ),
    )
    try:
        count = int(consumer.num_pending or 0)
    finally:
        assert consumer.name is not None
        try:
            await js.delete_consumer(stream, consumer.name)
        except Exception as error:  # the inactivity threshold removes it
            log.info("count_consumer_not_deleted", error=describe(error))
    if count == 0:
        return Pending(0, None)
    try:
        first = await js.get_msg(stream, seq=seq + 1, subject=subject, next=True)
    except NotFoundError:  # removed since (the stream's limits): the count stands, its age is unknown
        return Pending(count, None)
    assert first.time is not None
    return Pending(count, age_ms(first.time.timestamp()))


async def published_past(js: JetStreamContext, names: Names, subject: str, position: int) -> tuple[int | None, Pending]:
    """The last delta on ``subject`` (None: none in the stream) and those published past ``position``, counted only
    when the last is past it: counting makes and removes a consumer, and ``ontofabric status`` made 1,400 of them
    for workspaces every one of them indexed (6 s)."""
    latest = await last_sequence_on(js, names.delta_stream, subject) or None
    if latest is None or latest <= position:
        return latest, Pending(0, None)
    return latest, await published_after(js, names.delta_stream, subject, position, names.count_consumer())


class DeltaWatch:
    """The index's position, and the deltas published past it, for every answer of this worker."""

    def __init__(
        self,
        nc: Client,
        names: Names,
        partitions: int = 1,
        refusals: Callable[[], Awaitable[frozenset[str] | None]] | None = None,
    ) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._names = names
        self._partitions = partitions
        """The configured partition layout of the Postgres projectors, whose consumers' lowest ack floor is a position
        of the index."""
        self._layouts: frozenset[int] = frozenset({partitions})
        """The layouts whose positions are read: the configured one and those running projectors announce."""
        self._refusals = refusals
        """Reads the durable consumers whose projector refuses the delta stream (the databases' claim rows)."""
        self._refused: frozenset[tuple[int, int]] = frozenset()
        """The partitions, as (layout, partition), of the layouts read whose projector refused the delta stream, as
        of the last look."""
        self._following: asyncio.Task[None] | None = None
        self._subscription: Subscription | None = None
        self._published: dict[tuple[str, str], deque[tuple[int, float]]] = {}
        self._watched = 0
        self._complete_after = 0
        """The watch has seen every delta published after this sequence."""
        self._position: tuple[float, int] | None = None
        """The last position read, and when (monotonic)."""
        self._unknown_since: float | None = None
        """Since when the position could not be read for want of a consumer (None: it was, last time)."""
        self._unknown_said = False
        self._read: deque[tuple[float, int]] = deque()
        """Positions read, with when, until FORGET_AFTER_S has passed."""
        self._forgotten_to = 0
        """The deltas up to this sequence are no longer remembered: a position below it is counted by JetStream."""
        self._last_seen = 0
        self._reading: asyncio.Task[int] | None = None
        self._counted: LruCache[tuple[str, int], tuple[float, Pending]] = LruCache(4096)
        self._uncounted_until: LruCache[str, float] = LruCache(4096)
        """Per branch's subject: until when a count JetStream failed is not asked again."""

    async def start(self) -> None:
        self._subscription = await self._nc.subscribe(self._names.published_subjects, cb=self._seen)
        # Subscribed first: a delta stored between the two is seen by the watch and also below this sequence.
        info = await self._js.stream_info(self._names.delta_stream)
        self._complete_after = int(info.state.last_seq or 0)
        await self.follow_refusals()  # before the first answer: a worker started beside a refusal says it at once
        # In the background: a discovery ping gathers answers for half a second, which a start need not wait for.
        self._following = asyncio.create_task(self._follow_layouts())

    async def stop(self) -> None:
        if self._following is not None:
            # Ended before it returns: a look still running read the databases' pools as they closed (a warning at
            # every interrupted demo). Until it ends: a discovery's answer arriving with the cancellation made
            # nats-py lose it, and the loop went round for ever (a review's).
            with contextlib.suppress(Exception):  # logged by the loop
                await cancel_and_wait(self._following)
            self._following = None
        if self._subscription is not None:
            await self._subscription.unsubscribe()
            self._subscription = None

    async def position(self, wait_s: float = POSITION_WAIT_S, or_last: bool = True) -> int | None:
        """The Postgres projector's position, at most ``POSITION_TTL_S`` old. Not read within ``wait_s`` (the read
        goes on, for the next caller): the last one read, up to ``FORGET_AFTER_S`` old (``or_last``), which only
        understates what an answer holds (a flake hunter's: under load, answers lost their freshness); else None."""
        if self._position is not None and time.monotonic() - self._position[0] < POSITION_TTL_S:
            return self._position[1]
        if self._reading is None:  # one read at a time, shared by every answer waiting for it
            self._reading = asyncio.create_task(self._read_position())
            self._reading.add_done_callback(self._read_done)
        try:
            async with asyncio.timeout(wait_s):
                return await asyncio.shield(self._reading)
        except Exception as error:
            log.warning("position_unreadable", error=describe(error))
            last = self._position
            return last[1] if or_last and last is not None and time.monotonic() - last[0] < FORGET_AFTER_S else None

    def _read_done(self, task: asyncio.Task[int]) -> None:
        self._reading = None
        if not task.cancelled() and task.exception() is None:
            self._advance(task.result())

    async def _follow_layouts(self) -> None:
        while True:
            try:
                await self.follow_layouts()
            except Exception as error:  # NATS away: the layouts known stay
                log.info("projector_layouts_unknown", error=describe(error))
            await self.follow_refusals()
            await asyncio.sleep(LAYOUT_CHECK_S)

    async def follow_layouts(self) -> None:
        """Read, from here on, the positions of the layouts the running Postgres projectors announce, beside the
        configured one; with none answering, the configured one's alone."""
        workers = await discover(self._nc, self._names.projector_service)
        running = running_layouts(workers)
        layouts = frozenset({self._partitions, *running})
        if layouts == self._layouts:
            return
        if running and self._partitions not in running:
            log.warning(
                "projector_layout_differs",
                configured=self._partitions,
                running=sorted(running),
                hint="set ONTOFABRIC_PROJECTOR_PARTITIONS alike on every part; freshness reads the running layout's",
            )
        self._layouts = layouts

    async def follow_refusals(self) -> None:
        """Read which partitions of the layouts read refuse the delta stream; as they were when that cannot be read."""
        if self._refusals is None:
            return
        with housekeeping():  # every few seconds, beside the answers
            refused = await self._refusals()
        if refused is None:
            return
        self._refused = frozenset(
            (layout, partition)
            for layout in self._layouts
            for partition, durable in enumerate(self._names.postgres_projector_durables(layout))
            if durable in refused
        )

    def stream_refused(self, workspace: str) -> bool:
        """Whether the projector of the workspace's partition refused the delta stream (as of the last look, at most
        LAYOUT_CHECK_S ago): its index then no longer follows it, until an operator adopts the stream."""
        if not self._refused:  # on every answer: nothing to work out while no projector refuses
            return False
        token = encode_token(workspace)
        return any(partition_of_token(token, layout) == partition for layout, partition in self._refused)

    async def _read_position(self) -> int:
        """The highest of the layouts' positions: each layout's consumers together apply every delta, so all up to
        any layout's lowest floor is in the index."""
        started = time.monotonic()
        floor = await highest_known_floor(self._js, self._names, self._layouts)
        if floor is None:
            # No consumer to read it from: one taking over makes its consumer again, and read meanwhile as 0 a
            # rolling-restart tester's answers said 13,074 deltas and 11 minutes pending while the index was current.
            # What was read last stays true (every delta acked was committed first); before any, 0, as no projector
            # has applied anything this worker has seen.
            floor = self._position[1] if self._position is not None else 0
            self._unknown_since = self._unknown_since or started
            if started - self._unknown_since > POSITION_UNKNOWN_WARN_S and not self._unknown_said:
                self._unknown_said = True  # longer than a takeover: no projector made its consumer (a review's)
                log.warning("position_unknown", for_s=round(started - self._unknown_since), kept=floor)
        else:
            self._unknown_since, self._unknown_said = None, False
        self._position = (started, floor)
        return floor

    def _advance(self, floor: int, now: float | None = None) -> None:
        """Forget what every position read more than FORGET_AFTER_S ago passed. Before, what the position before
        the last one passed went, and an answer that read its position two reads ago (100 ms: one with a reranker,
        or a shared one) was told nothing was pending while deltas were."""
        now = time.monotonic() if now is None else now
        if not self._read or self._read[-1][1] != floor:
            self._read.append((now, floor))
        sweep_to = self._forgotten_to
        while self._read and now - self._read[0][0] > FORGET_AFTER_S:
            sweep_to = max(sweep_to, self._read.popleft()[1])
        if sweep_to <= self._forgotten_to:
            return
        self._forgotten_to = sweep_to
        for scope in list(self._published):
            published = self._published[scope]
            while published and published[0][0] <= sweep_to:
                published.popleft()
                self._watched -= 1
            if not published:
                del self._published[scope]

    async def _seen(self, msg: Msg) -> None:
        try:
            headers = msg.headers or {}
            scope = self._names.scope_of_published(msg.subject)
            seq, at = int(headers["Nats-Sequence"]), _epoch(headers["Nats-Time-Stamp"])
        except (KeyError, ValueError) as error:
            log.warning("published_header_unreadable", subject=msg.subject, error=describe(error))
            return
        # The delta stream's own republish of a delta of that scope: a red team had a direct get of a value of its
        # own answered onto another tenant's subject here, whose answers then read one delta pending for good.
        stream, stored_on = headers.get("Nats-Stream"), headers.get("Nats-Subject")
        if stream != self._names.delta_stream or stored_on != self._names.delta_subject(*scope):
            log.warning("published_not_a_delta", subject=msg.subject[:200], stream=str(stream)[:200])
            return
        if self._last_seen and seq > self._last_seen + 1:
            # Deltas stored meanwhile went by unseen (the connection lost and back, or a slow subscriber's dropped
            # messages): below this one, JetStream counts until the position passes it.
            log.info("published_deltas_unseen", after=self._last_seen, before=seq)
            self._complete_after = max(self._complete_after, seq - 1)
        self._last_seen = max(self._last_seen, seq)
        if seq <= self._forgotten_to:
            return
        if self._watched >= MAX_WATCHED:  # the rest is counted by JetStream until the position passes seq
            self._published.clear()
            self._watched, self._complete_after = 0, seq
            return
        self._published.setdefault(scope, deque()).append((seq, at))
        self._watched += 1

    async def pending(self, workspace: str, branches: list[str], position: int) -> Pending | None:
        """The deltas of the workspace's branches published past ``position``; None when that cannot be told."""
        if self._subscription is None:
            return None
        if position < max(self._complete_after, self._forgotten_to):
            return await self._count(workspace, branches, position)
        count, oldest = 0, None
        for branch in branches:
            published = self._published.get((workspace, branch), ())
            covered = 0  # in stream order: what the position passed comes first
            for seq, at in published:
                if seq > position:
                    oldest = at if oldest is None else min(oldest, at)
                    break
                covered += 1
            count += len(published) - covered
        return Pending(count, None if oldest is None else age_ms(oldest))

    async def _count(self, workspace: str, branches: list[str], position: int) -> Pending | None:
        """What the watch may have missed, asked of JetStream, each branch's count reused for a while; None when
        JetStream cannot count it (the stream deleted under a running NATS: a tester's queries failed `internal`)."""
        total, oldest_ms = 0, None
        for branch in branches:
            subject = self._names.delta_subject(workspace, branch)
            counted = self._counted.get((subject, position))
            if counted is None or time.monotonic() - counted[0] > EXACT_COUNT_TTL_S:
                if time.monotonic() < (self._uncounted_until.get(subject) or 0.0):
                    return None
                try:
                    counted = (time.monotonic(), await self.published_after(subject, position))
                except Exception as error:  # the answer says it cannot tell, and is answered
                    self._uncounted_until.put(subject, time.monotonic() + UNCOUNTED_RETRY_S)
                    log.warning(
                        "pending_deltas_uncounted", subject=subject, error=describe(error), retry_in_s=UNCOUNTED_RETRY_S
                    )
                    return None
                self._counted.put((subject, position), counted)
            pending = counted[1]
            total += pending.deltas
            if pending.oldest_ms is not None:
                oldest_ms = max(oldest_ms or 0.0, pending.oldest_ms)
        return Pending(total, oldest_ms)

    async def published_after(self, subject: str, seq: int) -> Pending:
        return await published_after(self._js, self._names.delta_stream, subject, seq, self._names.count_consumer())
