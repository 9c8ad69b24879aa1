"""Dead letters for operators: list and show what the projectors set aside, send it through them again, purge it.

A dead letter is the original delta's bytes on ``<prefix>.dlq.<workspace>`` with headers saying why (projector
consumer.py). Re-driving publishes those bytes again on the delta's own subject, as a new delta (a new stream
sequence) that every projector reads; the dead letter is deleted once the stream has stored it. A delta whose
document the index already holds at a later sequence is not re-driven (it would bring back an older state), unless
forced.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import asyncpg
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import MaxPayloadError
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import APIError, NotFoundError
from pydantic import ValidationError

from ontofabric.contracts import DeltaEnvelope
from ontofabric.contracts.deltas import split_link_key
from ontofabric.services.projector.planning import REUSED_DETAIL, earlier_payload_digest, payload_digest
from ontofabric.shared.jetstream import last_sequence_on, read_in_order, server_answer_headers, subscriptions_visible
from ontofabric.shared.logging import describe, get_logger
from ontofabric.shared.placement import Placement
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import NO_WORKSPACE, Names, encode_token
from ontofabric.shared.tasks import still_wanted
from ontofabric.shared.telemetry import trace_context_of

log = get_logger(__name__)

READ_BATCH = 256
FETCH_TIMEOUT_S = 5.0

SERVER_ANSWER_REASON = "server_answer"
SERVER_ANSWER_DETAIL = (
    "not a dead letter: a NATS server's answer to a request that named this subject as its reply (a direct get, "
    "say); it names no delta and is never re-driven: purge it"
)

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def parse_when(text: str, now: datetime) -> datetime:
    """A point in time: ISO 8601 (``2026-11-24T10:00``, UTC unless it says otherwise), or an age before ``now``
    (``30m``, ``2h``, ``7d``). ValueError for anything else."""
    match = _DURATION.match(text.strip())
    if match:
        return now - timedelta(**{_UNITS[match.group(2)]: float(match.group(1))})
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is neither an ISO 8601 time nor an age such as 30m, 2h or 7d") from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


@dataclass(frozen=True)
class DeadLetter:
    seq: int
    """Its sequence in the dead-letter stream."""
    stored_at: datetime
    workspace: str | None
    """None when the delta's subject named no workspace."""
    reason: str
    detail: str
    index: str
    """The index that set it aside (postgres, azure-search)."""
    original_subject: str
    original_seq: int | None
    delivered: int | None
    data: bytes
    body_omitted: bool = False
    """Stored without the delta: it did not fit beside the headers (services/projector/consumer.py)."""
    trace: Mapping[str, str] = field(default_factory=dict)
    """The trace context the delta carried: a re-drive sends it on."""

    @classmethod
    def of(cls, msg: Msg) -> DeadLetter:
        headers = msg.headers or {}
        timestamp = msg.metadata.timestamp
        why = SetAside.of(msg)
        return cls(
            seq=msg.metadata.sequence.stream,
            stored_at=timestamp if timestamp is not None else datetime.fromtimestamp(0, UTC),
            workspace=Names.workspace_of_dlq_subject(msg.subject),
            reason=why.reason,
            detail=why.detail,
            index=why.index,
            original_subject=why.original_subject,
            original_seq=why.original_seq,
            delivered=_int(headers.get("Ontofabric-Delivered")),
            data=bytes(msg.data),
            body_omitted="Ontofabric-Body-Omitted" in headers,
            trace=trace_context_of(headers),
        )

    def summary(self) -> dict[str, object]:
        """What a listing shows of it (not the delta itself)."""
        return {
            "seq": self.seq,
            "storedAt": self.stored_at.isoformat(),
            "workspace": self.workspace or NO_WORKSPACE,  # as the filters and the contract name it
            "reason": self.reason,
            "detail": self.detail,
            "index": self.index,
            "originalSubject": self.original_subject,
            "originalSeq": self.original_seq,
            "delivered": self.delivered,
            "bytes": len(self.data),
            "bodyOmitted": self.body_omitted,
        }


@dataclass(frozen=True)
class SetAside:
    """Which delta a dead letter holds and why, from its headers alone (as a subscriber sees it go by)."""

    original_seq: int | None
    reason: str
    detail: str
    index: str
    original_subject: str = ""

    @classmethod
    def of(cls, msg: Msg) -> SetAside:
        headers = msg.headers or {}
        if server_answer_headers(headers):
            # A red team's: a tenant had a direct get of a value of its own, with headers of a dead letter, answered
            # onto another's dead-letter subject; re-driven, it wrote into that tenant's index, and an ingest
            # watching counted it as its own delta set aside. Nothing of such a message is believed.
            return cls(None, SERVER_ANSWER_REASON, SERVER_ANSWER_DETAIL, "")
        return cls(
            original_seq=_int(headers.get("Ontofabric-Original-Sequence")),
            reason=headers.get("Ontofabric-Reason", "unknown"),
            detail=headers.get("Ontofabric-Detail", ""),
            index=headers.get("Ontofabric-Index", ""),
            original_subject=headers.get("Ontofabric-Original-Subject", ""),
        )


class DeadLetterWatch:
    """The dead letters of one workspace as the projectors set them aside. An ingester subscribes before it
    publishes, so that once its deltas are projected it can say which of them never reached the index."""

    def __init__(self) -> None:
        self._seen: list[SetAside] = []

    @classmethod
    async def start(cls, nc: Client, names: Names, workspace: str) -> DeadLetterWatch:
        watch = cls()

        async def seen(msg: Msg) -> None:
            letter = SetAside.of(msg)
            if letter.reason != SERVER_ANSWER_REASON:
                watch._seen.append(letter)

        await nc.subscribe(names.dlq_subject(encode_token(workspace)), cb=seen)
        await subscriptions_visible(nc)  # subscribed at the server before the first delta goes out
        return watch

    def of(self, sequences: Set[int]) -> list[SetAside]:
        """Those of the deltas stored at ``sequences``, in the order they were set aside, each delta once (one set
        aside again, delivered twice across a projector's restart, is one delta: a red team's ingest read "57 of
        the 20 deltas published were dead-lettered")."""
        first: dict[int | None, SetAside] = {}
        for letter in self._seen:
            if letter.original_seq in sequences:
                first.setdefault(letter.original_seq, letter)
        return list(first.values())

    def on_subject_within(self, subject: str, first: int, last: int) -> list[SetAside]:
        """Those of the deltas stored on ``subject`` (a branch's) from ``first`` to ``last``: an earlier ingest's,
        whose sequences this one knows only as a range, set aside while it waited."""
        return [
            letter
            for letter in self._seen
            if letter.original_subject == subject
            and letter.original_seq is not None
            and first <= letter.original_seq <= last
        ]


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


@dataclass(frozen=True)
class Selection:
    """Which dead letters a command acts on: all that match every filter given."""

    workspace: str | None = None
    reason: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    sequences: frozenset[int] = field(default_factory=frozenset)

    @property
    def everything(self) -> bool:
        return self == Selection()

    def matches(self, letter: DeadLetter) -> bool:
        return (
            (self.workspace is None or (letter.workspace or NO_WORKSPACE) == self.workspace)
            and (self.reason is None or letter.reason == self.reason)
            and (self.since is None or letter.stored_at >= self.since)
            and (self.until is None or letter.stored_at < self.until)
            and (not self.sequences or letter.seq in self.sequences)
        )


async def dead_letters(nc: Client, names: Names, selection: Selection) -> list[DeadLetter]:
    """The selected dead letters, oldest first."""
    js = nc.jetstream()
    state = (await js.stream_info(names.dlq_stream)).state
    first, last = int(state.first_seq or 0), int(state.last_seq or 0)
    if selection.sequences:
        first, last = max(first, min(selection.sequences)), min(last, max(selection.sequences))
    subjects = names.dlq_subjects  # those of no workspace too: an earlier version filed some under odd tokens
    if selection.workspace not in (None, NO_WORKSPACE):
        subjects = names.dlq_subject(encode_token(selection.workspace))
    found: list[DeadLetter] = []
    if state.messages == 0 or first > last:
        return found
    async with read_in_order(nc, names.dlq_stream, subjects, first, last, READ_BATCH, FETCH_TIMEOUT_S) as batches:
        async for batch in batches:
            found += [letter for letter in map(DeadLetter.of, batch) if selection.matches(letter)]
    return found


@dataclass
class Redrive:
    """What became of each dead letter asked for."""

    sent: list[tuple[DeadLetter, int]] = field(default_factory=list)
    """Re-published, with the delta's new stream sequence (the dead letter is deleted)."""
    superseded: list[tuple[DeadLetter, int]] = field(default_factory=list)
    """Not sent: the index holds the document at this later sequence."""
    waiting: list[tuple[DeadLetter, int]] = field(default_factory=list)
    """Not sent: its branch has a later delta in the stream (this sequence, the last) that the index has not applied
    yet, which may be a later state of the document: the index cannot tell yet."""
    outdone: list[tuple[DeadLetter, DeadLetter]] = field(default_factory=list)
    """Not sent: another dead letter of the run, sent in its place, holds a later state of its row."""
    bodiless: list[DeadLetter] = field(default_factory=list)
    """Not sent: stored without its delta, too large for the stream to take again."""
    nowhere: list[DeadLetter] = field(default_factory=list)
    """Not sent: its subject names no workspace, so the projector would set it aside again (a review's), or the
    subject it came from is none of its workspace's delta subjects (missing, or another workspace's): there is no
    place of its own to send it back to."""
    refused: list[tuple[DeadLetter, str]] = field(default_factory=list)
    """Not sent: the stream refused it (too large now, say), with why; the dead letter stays."""


_HELD_AT = {
    "document": "SELECT stream_seq FROM documents WHERE workspace = $1 AND branch = $2 AND id = $3",
    "node": "SELECT stream_seq FROM ontology_nodes WHERE workspace = $1 AND branch = $2 AND object_type = $3",
    "link": "SELECT stream_seq FROM ontology_links WHERE workspace = $1 AND branch = $2"
    " AND source_type = $3 AND link_name = $4 AND target_type = $5",
}
"""The sequence at which the index holds a row of each kind (tombstones and reverts keep theirs)."""


def row_of(letter: DeadLetter) -> tuple[str, str, str, str] | None:
    """The index row a dead letter's delta writes: (workspace, branch, kind, key); None for a body that is no
    delta, or names another workspace than the subject it came on (a review's: another tenant's letter, keyed by
    what its body claims, left the named tenant's own letter unsent)."""
    try:
        delta = DeltaEnvelope.model_validate_json(letter.data)
    except ValidationError:
        return None
    if letter.workspace is None or delta.workspace != letter.workspace:
        return None
    return delta.workspace, delta.branch, delta.payload.entity, delta.payload.entity_key


async def held_sequence(database_url: str, row: tuple[str, str, str, str]) -> int | None:
    """The stream sequence at which the index holds a dead letter's row (:func:`row_of`: a document, a graph node
    or link, on the letter's branch); None when it holds none. Documents alone were checked, and a fault tester's
    redrive brought back a removed node and link, and a revert over a later branch edit."""
    workspace, branch, entity, key = row
    columns = split_link_key(key) if entity == "link" else (key,)
    conn = await asyncpg.connect(database_url)
    try:
        held = await conn.fetchval(_HELD_AT[entity], workspace, branch, *columns)
    finally:
        await conn.close()
    return None if held is None else int(held)


REDRIVEN_ORIGIN_HEADER = "Ontofabric-Redriven-Origin"
"""On a re-driven delta: the stream sequence its change was first published at, kept through re-drives of
re-drives. A re-drive is a later message, not a later state: a verifier re-drove an older change's letter alone,
and the newer change's letter was then left for it."""


async def _origin(js: JetStreamContext, names: Names, seq: int) -> int:
    """The stream sequence the change stored at ``seq`` was first published at: ``seq``, or a re-drive's origin,
    never after ``seq`` (a tenant may put any header on its own deltas: one is read as a count of up to 19 ASCII
    digits, or not at all; a review's "²" made int() fail the whole redrive)."""
    try:
        stored = await js.get_msg(names.delta_stream, seq)
    except NotFoundError:  # compacted away: a change of its own, as far as can be told
        return seq
    said = str((stored.headers or {}).get(REDRIVEN_ORIGIN_HEADER, ""))  # text other than ASCII comes as a Header
    return min(int(said), seq) if said.isascii() and said.isdigit() and len(said) <= 19 else seq


_HANDLED_AT = re.compile(re.escape(REUSED_DETAIL).replace(re.escape("{seq}"), r"(\d{1,19})"))
"""The projector's ``event_id_reused`` detail, the sequence the event id was handled at read back from it."""


async def _first_handled(js: JetStreamContext, names: Names, letter: DeadLetter, origin: int) -> int:
    """The sequence a letter's change is taken to be first published at: for one set aside as ``event_id_reused``
    that is a copy of the event whose id it reused (the same payload, as :func:`payload_digest` reads it), where
    that event was; otherwise ``origin``. Re-driven as a change of its own, such a copy put an older state back over
    the row's later ones (a delivery-order tester's: three documents went back to older content); a real reuse of
    an id, another change, keeps its own time (a review's)."""
    said = _HANDLED_AT.search(letter.detail) if letter.reason == "event_id_reused" and origin else None
    if said is None or int(said[1]) >= origin:
        return origin
    try:
        handled = await js.get_msg(names.delta_stream, int(said[1]))
        first, copy = (DeltaEnvelope.model_validate_json(data) for data in (handled.data or b"", letter.data))
    except (NotFoundError, ValidationError):  # compacted away, or not a delta this release reads
        return origin
    same = payload_digest(first) == payload_digest(copy) or earlier_payload_digest(first) == earlier_payload_digest(
        copy
    )
    return int(said[1]) if same else origin


MAX_EVENT_ID_HEAD = 96
"""How much of the original event id a re-driven delta's id keeps, so that the suffix fits the contract's 128."""


def redriven(data: bytes, dlq_seq: int) -> bytes:
    """The dead letter's delta under an event id of its own (``<id>~redriven:<dlq seq>``). With the original id,
    a rebuild or a compaction, replaying under the fixed settings, applied the original at its sequence and took
    the copy for a repeat, so the row disagreed with the index (which holds the copy's) and the rebuild refused to
    swap, for good. A body that is not a delta with an event id goes as it is (the projector sets it aside again)."""
    try:
        delta = json.loads(data)
    except (ValueError, RecursionError):  # not JSON, or nested too deep to read
        return data
    # Under either name the contract reads: left under its field name, a delta kept its id and a replay took it for
    # a repeat of the original.
    names = [name for name in ("eventId", "event_id") if isinstance(delta, dict) and isinstance(delta.get(name), str)]
    if not names:
        return data
    for name in names:
        delta[name] = f"{delta[name][:MAX_EVENT_ID_HEAD]}~redriven:{dlq_seq}"
    try:  # as UTF-8, as it came: escaped, text other than ASCII would take up to twice the bytes
        return json.dumps(delta, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:  # half a character in it, which UTF-8 cannot carry: escaped
        return json.dumps(delta, separators=(",", ":")).encode()


async def redrive(
    nc: Client,
    names: Names,
    letters: Sequence[DeadLetter],
    database_url_of: Callable[[str], str] | None,
    floors: Mapping[str, int] | None = None,
) -> Redrive:
    """Publish each dead letter's delta again on its own subject (:func:`redriven`), then delete the dead letter. With
    ``database_url_of`` (workspace -> its database), a delta whose document the index held at a later state when
    the run began (a change first published later; a re-drive is of its change's time) is left where it is, and
    so is each of the run's letters of one row but the latest; with ``floors`` too (workspace ->
    :func:`applied_through`), so is one whose branch has deltas after it that the index has not applied yet (one
    may be a later state of its document, which the index check cannot see yet). Re-driving the same dead letter
    twice within the stream's duplicate window stores it once (its message id is the dead letter's)."""
    js = nc.jetstream()
    outcome = Redrive()
    last_on: dict[str, int] = {}
    held_later: dict[int, int | None] = {}
    # Both read before this run publishes anything: read as it went, the index held a document at the sequence of
    # this run's own re-drive of an older change, and the newer change's letter was left for it (a consistency
    # tester's; the older change won).
    latest: dict[tuple[str, str, str, str], DeadLetter] = {}
    origins = {
        letter.seq: await _first_handled(
            js, names, letter, await _origin(js, names, letter.original_seq) if letter.original_seq else 0
        )
        for letter in letters
        if not letter.body_omitted
    }
    rows = {letter.seq: row_of(letter) for letter in letters if not letter.body_omitted}
    if database_url_of is not None:
        for letter in letters:
            row = rows.get(letter.seq)
            if row is None or letter.workspace is None:
                continue
            held = await held_sequence(database_url_of(letter.workspace), row)
            newer = held is not None and await _origin(js, names, held) > origins[letter.seq]
            held_later[letter.seq] = held if newer else None
            # Of the run's letters of one row, the latest state alone goes: sent in the order of the dead letters,
            # one set aside again after a first re-drive came after the newer (a review's).
            if row not in latest or _later(letter, latest[row], origins):
                latest[row] = letter
    if database_url_of is not None and floors is not None:
        for subject in {letter.original_subject for letter in letters if letter.original_subject}:
            last_on[subject] = await last_sequence_on(js, names.delta_stream, subject)
    for letter in letters:
        still_wanted()  # an interrupt nats-py lost stops at the next letter
        if letter.body_omitted:
            outcome.bodiless.append(letter)
            continue
        came_from = names.scope_of_delta(letter.original_subject)
        if letter.workspace is None or came_from is None or came_from[0] != letter.workspace:
            # Published as it says, a letter with no such header crashed the re-drive (an empty subject), and
            # one naming another workspace's subject would have written into that workspace.
            outcome.nowhere.append(letter)
            continue
        if database_url_of is not None and letter.workspace is not None:
            row = rows[letter.seq]
            if row is not None and latest[row] is not letter:
                outcome.outdone.append((letter, latest[row]))
                continue
            later = held_later.get(letter.seq)
            if later is not None:
                outcome.superseded.append((letter, later))
                continue
            last = last_on.get(letter.original_subject, 0)
            if floors is not None and last > max(floors.get(letter.workspace, 0), letter.original_seq or 0):
                outcome.waiting.append((letter, last))
                continue
        body = redriven(letter.data, letter.seq)
        message_id = f"redrive:{names.dlq_stream}:{letter.seq}"
        try:
            origin = origins[letter.seq]
            ack = await _publish_again(js, names, letter, body, message_id, origin)
            if ack.duplicate and not await _stored_as(js, names, ack.seq, letter.original_subject, body):
                # Another message holds this id (a tenant can publish under any id on its own subjects): taken
                # for a repeat, the delta was not stored, and its dead letter would have gone with it.
                log.warning("redrive_message_id_taken", dlq_seq=letter.seq, message_id=message_id, holder=ack.seq)
                retried_id = f"{message_id}:{secrets.token_hex(8)}"
                ack = await _publish_again(js, names, letter, body, retried_id, origin)
        except (MaxPayloadError, APIError) as error:  # this one cannot go; the rest still may
            outcome.refused.append((letter, describe(error)))
            continue
        await js.delete_msg(names.dlq_stream, letter.seq)
        log.info("dead_letter_redriven", dlq_seq=letter.seq, seq=ack.seq, reason=letter.reason)
        outcome.sent.append((letter, ack.seq))
    return outcome


def _later(letter: DeadLetter, than: DeadLetter, origins: Mapping[int, int]) -> bool:
    """Whether ``letter``'s change came after ``than``'s (by when each was first published)."""
    return (origins[letter.seq], letter.seq) > (origins[than.seq], than.seq)


async def _publish_again(
    js: JetStreamContext, names: Names, letter: DeadLetter, body: bytes, message_id: str, origin: int
) -> PubAck:
    headers = {"Nats-Msg-Id": message_id, "Ontofabric-Redriven-From": str(letter.seq), **letter.trace}
    if origin:
        headers[REDRIVEN_ORIGIN_HEADER] = str(origin)
    return await js.publish(letter.original_subject, body, stream=names.delta_stream, headers=headers)


async def _stored_as(js: JetStreamContext, names: Names, seq: int, subject: str, body: bytes) -> bool:
    """Whether the delta stream holds ``body`` on ``subject`` at ``seq``: an earlier run's re-drive of the letter."""
    try:
        stored = await js.get_msg(names.delta_stream, seq)
    except NotFoundError:  # gone since (a compaction): not ours to vouch for
        return False
    return stored.subject == subject and stored.data == body


async def applied_through(
    js: JetStreamContext, names: Names, settings: Settings, placement: Placement, workspaces: Set[str]
) -> dict[str, int]:
    """Per workspace, the ack floor of the configured Postgres projector consumer that applies it (0 while it does
    not exist): every delta of the workspace up to it is in the index, or dead-lettered."""
    durables = names.postgres_projector_durables(settings.projector_partitions)
    floors: dict[str, int] = {}
    for durable in {durables[placement.partition_of(workspace)] for workspace in workspaces}:
        try:
            info = await js.consumer_info(names.delta_stream, durable)
        except NotFoundError:
            floors[durable] = 0
            continue
        floors[durable] = int(info.ack_floor.stream_seq or 0) if info.ack_floor else 0
    return {workspace: floors[durables[placement.partition_of(workspace)]] for workspace in workspaces}


async def purge(nc: Client, names: Names, selection: Selection, letters: Sequence[DeadLetter] | None = None) -> int:
    """Delete the selected dead letters (``letters``: those already read of them, and no later one); how many."""
    js = nc.jetstream()
    if selection.everything and letters is None:
        state = (await js.stream_info(names.dlq_stream)).state
        await js.purge_stream(names.dlq_stream)
        return int(state.messages or 0)
    if selection.everything and letters:  # up to the last one read, at once: one stored since stays
        await js.purge_stream(names.dlq_stream, seq=max(letter.seq for letter in letters) + 1)
        return len(letters)
    if letters is None:
        letters = await dead_letters(nc, names, selection)
    for letter in letters:
        await js.delete_msg(names.dlq_stream, letter.seq)
    return len(letters)
