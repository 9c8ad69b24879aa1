"""The projection runner's loop without servers: what becomes of each delta of a batch, part by part, over a sink
that succeeds, refuses for the data's sake, or fails for a passing reason. (Delivery on a real consumer: the
projector and Azure tests.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import asyncpg
import pytest
from nats.aio.msg import Msg

from ontofabric.services.projector import consumer
from ontofabric.services.projector.consumer import (
    DurableProjection,
    SentBack,
    WorkspaceLag,
    event_key,
    in_flight_candidates,
)
from ontofabric.services.projector.planning import Delta, Limits
from ontofabric.services.projector.runner import Outcome, ProjectionRunner, Written
from ontofabric.shared.db import is_transient
from ontofabric.shared.subjects import Names, Partition

from .factories import document, upsert

LIMITS = Limits(max_message_bytes=1 << 20, max_content_bytes=1000, embedding_dim=384, embedding_model="m")
SUBJECT = Names().delta_subject("acme", "main")


def _msg(seq: int, data: bytes, delivered: int = 1, subject: str = SUBJECT) -> Msg:
    """A JetStream delivery: its metadata is read from the ack subject, as from the server's."""
    return Msg(_client=None, subject=subject, reply=f"$JS.ACK.S.C.{delivered}.{seq}.{seq}.0.0", data=data)  # type: ignore[arg-type]


class Delivery(Msg):
    """A delivery whose acknowledgements are recorded instead of sent."""

    settled: ClassVar[list[tuple[str, int]]] = []

    async def ack(self) -> None:
        Delivery.settled.append(("ack", self.metadata.sequence.stream))

    async def nak(self, delay: float | None = None, **_: Any) -> None:
        Delivery.settled.append(("nak", self.metadata.sequence.stream))

    async def term(self, *_: Any, **__: Any) -> None:
        Delivery.settled.append(("term", self.metadata.sequence.stream))


def _delivery(seq: int, data: bytes, delivered: int = 1) -> Delivery:
    return Delivery(_client=None, subject=SUBJECT, reply=f"$JS.ACK.S.C.{delivered}.{seq}.{seq}.0.0", data=data)  # type: ignore[arg-type]


def _valid(seq: int, workspace: str = "acme", event_id: str | None = None) -> Msg:
    delta = upsert(workspace, document(f"d{seq}", f"text {seq}"), event_id=event_id).model_dump_json().encode()
    return _msg(seq, delta, subject=Names().delta_subject(workspace, "main"))


@dataclass
class ScriptedSink:
    """Refuses, for the data's sake, any batch holding a delta in ``bad``; fails for a passing reason while
    ``down``. Records each write it was asked for."""

    bad: set[int] = field(default_factory=set)
    down: bool = False
    index: str = "scripted"
    writes: list[list[int]] = field(default_factory=list)

    async def write(self, deltas: Sequence[Delta], redelivered: bool) -> Written:
        self.writes.append([d.seq for d in deltas])
        if self.down:
            raise ConnectionError("database away")
        if self.bad & {d.seq for d in deltas}:
            raise ValueError("the database refuses this value")
        return Written(applied=len(deltas), noops=0)

    def retryable(self, error: BaseException) -> bool:
        return isinstance(error, ConnectionError)

    async def settled(self) -> None:
        pass


async def _parts(runner: ProjectionRunner, sink: ScriptedSink, messages: list[Msg]) -> list[tuple[int, Outcome]]:
    """Each part the runner yields, with how many writes the sink had seen when it came."""
    return [(len(sink.writes), part) async for part in runner.run(messages)]


def _seqs(pairs: Sequence[tuple[Msg, object]]) -> list[int]:
    return [msg.metadata.sequence.stream for msg, _ in pairs]


async def test_an_isolated_batch_is_settled_delta_by_delta_as_each_write_ends() -> None:
    sink = ScriptedSink(bad={2})
    batch = [_valid(1), _msg(5, b"{not json"), _valid(2), _valid(3)]
    parts = await _parts(ProjectionRunner(sink, LIMITS), sink, batch)
    # The invalid delta first, before any write; then the batch write fails on delta 2 and each delta is written
    # alone, its part handed over before the next write begins.
    assert [(writes, _seqs(p.invalid), _seqs(p.done), _seqs(p.refused)) for writes, p in parts] == [
        (0, [5], [], []),
        (2, [], [1], []),
        (3, [], [], [2]),
        (4, [], [3], []),
    ]
    assert sink.writes == [[1, 2, 3], [1], [2], [3]]
    assert parts[0][1].invalid[0][1].reason == "invalid_schema"
    assert parts[2][1].refused[0][1].reason == "apply_failed"
    assert parts[2][1].refused[0][1].detail == "ValueError: the database refuses this value"


async def test_a_passing_failure_sends_the_whole_batch_back_without_isolating() -> None:
    sink = ScriptedSink(down=True)
    [(_, part)] = await _parts(ProjectionRunner(sink, LIMITS), sink, [_valid(1), _valid(2)])
    assert [msg.metadata.sequence.stream for msg in part.retry] == [1, 2]
    assert isinstance(part.error, ConnectionError)
    assert sink.writes == [[1, 2]]


async def test_a_batch_too_long_for_a_statement_is_written_in_halves_until_each_fits() -> None:
    """A burst of large documents took longer than statement_timeout as one batch: sent back whole, it failed the
    same way on every delivery and held every workspace behind it."""

    class TimesOut(ScriptedSink):
        async def write(self, deltas: Sequence[Delta], redelivered: bool) -> Written:
            self.writes.append([d.seq for d in deltas])
            if len(deltas) > 2:
                raise asyncpg.QueryCanceledError("canceling statement due to statement timeout")
            return Written(applied=len(deltas), noops=0)

    sink = TimesOut()
    parts = await _parts(ProjectionRunner(sink, LIMITS), sink, [_valid(n) for n in range(1, 8)])
    assert sink.writes == [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3], [1], [2, 3], [4, 5, 6, 7], [4, 5], [6, 7]]
    assert [_seqs(p.done) for _, p in parts] == [[1], [2, 3], [4, 5], [6, 7]]
    assert not any(p.retry or p.refused for _, p in parts)

    class AlwaysTimesOut(TimesOut):
        async def write(self, deltas: Sequence[Delta], redelivered: bool) -> Written:
            self.writes.append([d.seq for d in deltas])
            raise asyncpg.QueryCanceledError("canceling statement due to statement timeout")

        def retryable(self, error: BaseException) -> bool:
            return is_transient(error)  # as the PostgreSQL sink decides

    slow = AlwaysTimesOut()  # one delta that takes too long alone is sent back to be tried again, not dead-lettered
    [(_, part)] = await _parts(ProjectionRunner(slow, LIMITS), slow, [_valid(1)])
    assert _seqs([(msg, None) for msg in part.retry]) == [1]
    assert not part.refused


async def test_while_writing_delta_by_delta_a_later_copy_of_an_event_sent_back_goes_back_with_it() -> None:
    """The database went away for one write in the middle of an isolation: a later copy of that delta's event
    (stored again past the duplicate window) is not written before it (it would take its place); other deltas,
    of the same workspace too, are."""

    class AwayOnce(ScriptedSink):
        async def write(self, deltas: Sequence[Delta], redelivered: bool) -> Written:
            self.down = len(self.writes) == 2  # the whole batch, then delta 1 alone; delta 2's write finds it away
            return await super().write(deltas, redelivered)

    sink = AwayOnce(bad={1})
    batch = [_valid(1), _valid(2, event_id="e"), _valid(3, "globex", "e"), _valid(4, event_id="e"), _valid(5)]
    parts = await _parts(ProjectionRunner(sink, LIMITS), sink, batch)
    assert [(_seqs(p.done), _seqs(p.refused), [m.metadata.sequence.stream for m in p.retry]) for _, p in parts] == [
        ([], [1], []),
        ([], [], [2]),
        ([3], [], []),  # another workspace's event of that id
        ([], [], [4]),  # not written: the copy of 2's event waits for it
        ([5], [], []),
    ]
    assert sink.writes == [[1, 2, 3, 4, 5], [1], [2], [3], [5]]


def test_a_later_copy_of_an_event_waits_for_its_copy_sent_back_until_that_settles() -> None:
    sent_back = SentBack()
    event = ("acme", "e")
    assert sent_back.blocker(event, []) is None
    sent_back.sent_back(event, 5, now=100.0)
    sent_back.sent_back(event, 9, now=100.0)
    assert sent_back.blocker(event, [7, 8]) == 5  # a copy at 7 waits; so would any after 5
    assert sent_back.blocker(event, [5, 9]) is None  # both back in hand: written in stream order
    assert sent_back.blocker(event, [9]) == 5
    assert sent_back.blocker(("globex", "e"), [9]) is None
    assert sent_back.blocker(("acme", "other"), [9]) is None
    sent_back.settled(5)
    assert sent_back.blocker(event, [10]) == 9
    sent_back.floor(9)  # settled by any process of the consumer
    assert sent_back.blocker(event, [10]) is None
    assert len(sent_back) == 0
    sent_back.sent_back(event, 12, now=100.0)
    sent_back.expire(now=150.0, after_s=60.0)
    assert sent_back.blocker(event, [13]) == 12
    sent_back.expire(now=161.0, after_s=60.0)  # never came back here: a copy does not wait for good
    assert sent_back.blocker(event, [13]) is None


async def test_a_batch_delivered_out_of_stream_order_is_written_in_stream_order() -> None:
    """A redelivery may bring a later copy of an event before the earlier one: written one delta at a time in the
    order delivered, the later copy would take the earlier one's place."""
    sink = ScriptedSink(bad={7})
    batch = [_valid(9, event_id="e"), _valid(7), _valid(4, event_id="e")]
    parts = await _parts(ProjectionRunner(sink, LIMITS), sink, batch)
    assert sink.writes == [[4, 7, 9], [4], [7], [9]]
    assert [_seqs(p.done) for _, p in parts] == [[4], [], [9]]


async def test_a_copy_waits_only_while_its_earlier_copy_is_out_and_waiting_is_no_reason_to_pause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pauses: list[float] = []

    async def pause(seconds: float) -> None:
        pauses.append(seconds)

    monkeypatch.setattr(consumer.asyncio, "sleep", pause)
    sink = ScriptedSink()
    runner = ProjectionRunner(sink, LIMITS)
    projection = DurableProjection(runner, None, Names(), "p", dead_letters_invalid=False)  # type: ignore[arg-type]
    by_name = json.loads(upsert("acme", document("a", "first"), event_id="e").model_dump_json())
    by_name["event_id"] = by_name.pop("eventId")  # the contract takes the field's name too
    copy = json.dumps(by_name).encode()
    Delivery.settled = []
    sink.down = True
    await projection.handle([_delivery(5, copy)])  # sent back: the database is away
    sink.down = False
    pauses.clear()
    await projection.handle([_delivery(9, copy), _delivery(10, b"[" * 100_000)])  # the later copy; a poison
    assert Delivery.settled == [("nak", 5), ("nak", 9), ("term", 10)]  # the copy waits; the poison is refused
    assert pauses == []  # the database is there: the next batch is fetched at once
    await projection.handle([_delivery(5, copy, delivered=2)])
    await projection.handle([_delivery(9, copy, delivered=2)])
    assert sink.writes == [[5], [5], [9]]
    assert Delivery.settled[-2:] == [("ack", 5), ("ack", 9)]
    assert len(projection.sent_back) == 0
    assert event_key(SUBJECT, b"[" * 100_000) is None


def test_a_starting_projector_reads_back_the_top_of_what_was_delivered_and_the_delta_past_the_floor() -> None:
    assert in_flight_candidates(floor=10, delivered=10) == []
    assert in_flight_candidates(floor=10, delivered=14, lookback=100) == [11, 12, 13, 14]
    # A crashed process's batch sits at the top; the one past the floor is unacked by definition.
    assert in_flight_candidates(floor=0, delivered=2610, lookback=10) == [1, *range(2601, 2611)]


async def test_a_redelivered_batch_says_so_to_the_sink() -> None:
    seen: list[bool] = []

    class Recording(ScriptedSink):
        async def write(self, deltas: Sequence[Delta], redelivered: bool) -> Written:
            seen.append(redelivered)
            return await super().write(deltas, redelivered)

    runner = ProjectionRunner(Recording(), LIMITS)
    assert [p.applied async for p in runner.run([_valid(1), _valid(2)])] == [2]
    assert [p.applied async for p in runner.run([_valid(1), _msg(2, _valid(2).data, delivered=2)])] == [2]
    assert seen == [False, True]


def test_a_workspaces_lag_is_its_newest_delta_past_what_was_settled_there_or_the_floor() -> None:
    lag = WorkspaceLag(max_workspaces=2)
    lag.published("acme", 10)
    lag.published("beta", 12)
    lag.settled("acme", 7)
    assert lag.lags() == {"acme": 3, "beta": 12}
    lag.published("acme", 9)  # an older one's headers, late: the newest stays
    lag.floor(11)  # everything up to 11 settled (by another process, or before a restart)
    assert lag.lags() == {"acme": 0, "beta": 1}
    lag.settled("gamma", 20)  # settled before its headers arrived: stored all the same
    assert lag.lags() == {"acme": 0, "gamma": 0}  # beta, the least recently published to, is forgotten


async def test_a_workspace_whose_deltas_fail_since_before_a_start_shows_its_lag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An ops tester's: a projector knew a workspace only from headers republished since it started, so one whose
    deltas kept failing across a restart was not behind at all for the workspace alert."""

    async def no_pause(_: float) -> None:
        pass

    monkeypatch.setattr(consumer.asyncio, "sleep", no_pause)
    sink = ScriptedSink(down=True)
    runner = ProjectionRunner(sink, LIMITS)
    projection = DurableProjection(runner, None, Names(), "restarted", dead_letters_invalid=False)  # type: ignore[arg-type]
    await projection.handle([_delivery(40, _valid(40).data, delivered=3)])  # sent back: the database is away
    assert projection.state.workspaces.lags() == {"acme": 40}


async def test_deltas_in_hand_count_behind_for_the_partition_that_applies_them_alone() -> None:
    """An ops tester's backlog, held up by a lock on the table, showed no lag; and a review's: counted by every
    partition's consumer (each receives every delta), the one that acks another partition's on sight said 0 beside
    the right one's figure, and the gauge kept the last."""
    release = asyncio.Event()

    class Held(ScriptedSink):
        async def write(self, deltas: Sequence[Delta], redelivered: bool) -> Written:
            await release.wait()
            return await super().write(deltas, redelivered)

    names = Names()
    holder = next(i for i in range(2) if Partition(i, 2).holds(names.delta_subject("acme", "main")))
    projections = [
        DurableProjection(
            ProjectionRunner(Held(), LIMITS), None, names, f"p{i}", dead_letters_invalid=False,  # type: ignore[arg-type]
            partition=Partition(i, 2),
        )
        for i in (holder, 1 - holder)
    ]  # fmt: skip
    handling = [asyncio.create_task(p.handle([_delivery(40, _valid(40).data)])) for p in projections]
    await asyncio.sleep(0.05)
    mine, theirs = (p.state.workspaces.lags() for p in projections)
    assert (mine, theirs) == ({"acme": 40}, {})
    release.set()
    await asyncio.gather(*handling)
    assert projections[0].state.workspaces.lags() == {"acme": 0}


def test_a_streams_size_is_left_out_once_its_reading_is_old(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ops tester's: with NATS killed the lag gauges went after about 20 s, and the stream's size stayed at its
    last value, which the stream-filling alert then read as current."""
    clock = [5000.0]
    monkeypatch.setattr(consumer.time, "monotonic", lambda: clock[0])
    monkeypatch.setitem(consumer._STREAMS, "OLD_TEST_STREAM", (900, 1000, clock[0]))

    def seen() -> dict[str, tuple[float, ...]]:
        sizes = [o for o in consumer._observe_stream_bytes(None) if o.attributes]  # type: ignore[arg-type]
        limits = [o for o in consumer._observe_stream_limits(None) if o.attributes]  # type: ignore[arg-type]
        found: dict[str, tuple[float, ...]] = {}
        for observation in [*sizes, *limits]:
            assert observation.attributes is not None
            stream = str(observation.attributes["stream"])
            found[stream] = (*found.get(stream, ()), observation.value)
        return {stream: values for stream, values in found.items() if stream == "OLD_TEST_STREAM"}

    assert seen() == {"OLD_TEST_STREAM": (900, 1000)}
    clock[0] += consumer.UNKNOWN_AFTER_S - 1
    assert seen() == {"OLD_TEST_STREAM": (900, 1000)}
    clock[0] += 1
    assert seen() == {}


async def test_a_consumers_gauges_are_left_out_while_jetstream_cannot_tell_its_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An operator tester's: with NATS away the lag gauges kept their last value, 0, as if all were caught up."""
    clock = [1000.0]
    answers: list[bool] = [True, False, False, False, False, True]

    class Watched:
        async def consumer_info(self, stream: str, durable: str) -> Any:
            if not answers.pop(0):
                raise TimeoutError("no answer")
            info = {
                "num_pending": 7,
                "num_ack_pending": 2,
                "ack_floor": {"stream_seq": 3},
                "delivered": {"stream_seq": 5},
            }
            return json.loads(json.dumps(info), object_hook=lambda d: type("Info", (), d))

    seen: list[tuple[list[int], dict[str, int]]] = []

    def gauges() -> tuple[list[int], dict[str, int]]:
        lag = [int(o.value) for o in consumer._per_consumer(lambda s: s.undelivered)(None) if o.attributes
               and o.attributes["consumer"] == "unread"]  # fmt: skip
        workspaces = {
            str(o.attributes["workspace"]): int(o.value)
            for o in consumer._observe_workspace_lag(None)  # type: ignore[arg-type]
            if o.attributes and o.attributes["workspace"] == "unread-ws"
        }
        return lag, workspaces

    async def one_watch_period(_: float) -> None:
        seen.append(gauges())
        clock[0] += consumer.WATCH_EVERY_S
        if not answers:
            raise asyncio.CancelledError

    monkeypatch.setattr(consumer.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(consumer.asyncio, "sleep", one_watch_period)
    projection = DurableProjection(
        ProjectionRunner(ScriptedSink(), LIMITS), None, Names(), "unread", dead_letters_invalid=False
    )  # type: ignore[arg-type]
    projection.state.workspaces.published("unread-ws", 9)
    with pytest.raises(asyncio.CancelledError):
        await consumer._watch_consumer(Watched(), Names(), projection)  # type: ignore[arg-type]
    seen.append(gauges())
    told, unknown = ([7], {"unread-ws": 6}), ([], {})
    # Read; unread for 0, 5 and 10 s (the last values kept through a passing failure), then for 15 s (left out);
    # read again.
    assert seen == [told, told, told, told, unknown, told, told]


@dataclass
class _StoredDeltas:
    """A JetStream context's reads of stored deltas, as remember_in_flight makes them: the group logic alone (what
    the server stores and delivers is tests/test_crash_recovery.py's)."""

    floor: int
    delivered: int
    failing: int | None = None
    gone: int | None = None
    asked: list[int] = field(default_factory=list)
    _nc: object = field(default_factory=lambda: type("Connection", (), {})())  # made by no connect(): no refusals

    async def consumer_info(self, stream: str, durable: str) -> Any:
        info = {"ack_floor": {"stream_seq": self.floor}, "delivered": {"stream_seq": self.delivered}}
        return json.loads(json.dumps(info), object_hook=lambda d: type("Info", (), {**d, "num_ack_pending": 1}))

    async def get_msg(self, stream: str, seq: int) -> Any:
        self.asked.append(seq)
        if seq == self.gone:
            raise consumer.NotFoundError
        if seq == self.failing:
            raise TimeoutError("no answer")
        body = json.dumps(upsert("acme", document(f"d{seq}", "text")).model_dump(mode="json", by_alias=True))
        return type("Stored", (), {"subject": "p.delta.acme.main", "data": body.encode()})


@pytest.mark.parametrize(("failing", "recorded"), [(None, 39), (30, 28)])
async def test_in_flight_deltas_are_read_back_in_groups_until_the_first_that_fails(
    failing: int | None, recorded: int
) -> None:
    stored = _StoredDeltas(floor=0, delivered=40, failing=failing, gone=7)  # 40 candidates: three groups of 16
    remembered: list[int] = []

    class Projection:
        durable = "d"

        class sent_back:
            @staticmethod
            def sent_back(key: Any, seq: int, now: float) -> None:
                remembered.append(seq)

        @staticmethod
        def holds(subject: str) -> bool:
            return True

    count = await consumer.remember_in_flight(stored, Names("p"), Projection)  # type: ignore[arg-type]
    assert count == recorded == len(remembered)
    expected = [seq for seq in range(1, 41) if seq != 7 and (failing is None or seq < failing)]
    assert remembered == expected  # in stream order, the deleted one skipped, none past the failure
    assert max(stored.asked) == (40 if failing is None else 32)  # the failing one's group is the last asked
