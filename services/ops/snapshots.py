"""Bounded retention: each workspace's fold kept as a snapshot, so the delta stream can drop what it covers.

``ontofabric compact`` folds every workspace's deltas up to the index's position (the lowest ack floor of the
index consumers: nothing an index still needs is dropped) onto that workspace's previous snapshot, stores the new
snapshots in the object store ``<prefix>_snapshots``, records the sequence they all cover (``compacted through``),
and only then purges the stream below it. A snapshot holds, for each row, the last delta that applied to it, as it
was stored (subject, sequence and bytes, so replaying it writes the same row with the same sequence), and the event
ids of the other deltas the fold handled (a copy of one of them arriving later is a no-op, as in the live index).

A rebuild then replays a workspace's snapshot and the stream after it (:mod:`.rebuild`), and verifies the result
against the same fold. A crash between the snapshots and the purge loses nothing: the next run folds on from each
workspace's own snapshot.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Set
from dataclasses import dataclass, field
from datetime import UTC, datetime

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig, StorageType
from nats.js.errors import NotFoundError, ObjectNotFoundError
from nats.js.object_store import ObjectStore

from ontofabric.contracts import DeltaEnvelope
from ontofabric.services.projector.planning import Delta, Limits, StateFold, validate_delta
from ontofabric.shared.jetstream import projected_floor, read_in_order
from ontofabric.shared.logging import get_logger
from ontofabric.shared.progress import Progress
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names, decode_token, encode_token, workspace_token_of

from .dead_letters import Selection, dead_letters
from .verification import RowKey, row_key

log = get_logger(__name__)

FORMAT = 1
MARKER = "_compacted"
"""The object naming the sequence every snapshot covers (workspace objects are named by subject tokens, which
never start with ``_`` followed by a letter other than an escape)."""
FETCH_TIMEOUT_S = 5.0
NEVER_APPLIES = frozenset({"oversized", "invalid_schema", "subject_mismatch"})
"""Rejections whatever the settings (the message limit is the stream's): such a delta never reached an index."""


class CompactionRefused(Exception):
    """Compacting now would lose or misstate what the index holds; nothing was dropped."""


@dataclass(frozen=True)
class StoredDelta:
    seq: int
    subject: str
    data: bytes


@dataclass
class Snapshot:
    """One workspace's fold through stream sequence ``covers``."""

    workspace: str
    covers: int
    deltas: list[StoredDelta] = field(default_factory=list)
    """The last delta that applied to each row, in stream order."""
    handled: dict[str, int] = field(default_factory=dict)
    """Every other event id the fold handled, with its sequence."""

    def encode(self) -> bytes:
        document = {
            "format": FORMAT,
            "workspace": self.workspace,
            "covers": self.covers,
            "deltas": [[d.seq, d.subject, d.data.decode("utf-8")] for d in self.deltas],
            "handled": self.handled,
        }
        return zlib.compress(json.dumps(document, separators=(",", ":")).encode("utf-8"), level=6)

    @classmethod
    def decode(cls, data: bytes) -> Snapshot:
        document = json.loads(zlib.decompress(data))
        if document.get("format") != FORMAT:
            raise ValueError(f"snapshot format {document.get('format')!r}, this version reads {FORMAT}")
        return cls(
            workspace=document["workspace"],
            covers=int(document["covers"]),
            deltas=[StoredDelta(int(seq), subject, text.encode("utf-8")) for seq, subject, text in document["deltas"]],
            handled={event: int(seq) for event, seq in document["handled"].items()},
        )

    def messages(self, nc: Client, stream: str) -> list[Msg]:
        """The deltas as the messages they were stored as (never acked: a replay reads without acks)."""
        when = datetime.fromtimestamp(0, UTC)
        return [
            Msg(
                nc,
                subject=delta.subject,
                data=delta.data,
                _metadata=Msg.Metadata(
                    sequence=Msg.Metadata.SequencePair(consumer=n, stream=delta.seq),
                    num_pending=len(self.deltas) - n,
                    num_delivered=1,
                    timestamp=when,
                    stream=stream,
                    consumer="snapshot",
                ),
            )
            for n, delta in enumerate(self.deltas, start=1)
        ]


class SnapshotFold:
    """A workspace's snapshot folded further with the deltas after it, by the projector's own rule (StateFold)."""

    def __init__(self, workspace: str, limits: Limits, previous: Snapshot | None = None) -> None:
        self.workspace = workspace
        self._limits = limits
        self._fold = StateFold(handled_events=set(previous.handled) if previous else frozenset())
        self._kept: dict[RowKey, tuple[StoredDelta, str]] = {}
        self._kept_events: set[str] = set()
        self._handled = dict(previous.handled) if previous else {}
        self.covers = previous.covers if previous else 0
        for delta in previous.deltas if previous else ():
            # Folded before, with the settings of that run: read as they are, not judged again by this run's.
            self._fold_delta(delta, Delta(delta.seq, DeltaEnvelope.model_validate_json(delta.data)))

    def add(self, stored: StoredDelta, set_aside: Set[int] = frozenset()) -> None:
        """Fold one delta from the stream (after every one before). What the projector never applied stays out:
        a delta it dead-lettered (``set_aside``: the original sequences of its dead letters), and one no
        settings can apply (unreadable, or of another workspace than its subject). Raises CompactionRefused for
        a delta only this run's settings refuse: the snapshot would not be what the index holds."""
        self.covers = max(self.covers, stored.seq)
        if stored.seq in set_aside:
            return
        checked = validate_delta(stored.data, stored.subject, stored.seq, self._limits)
        if isinstance(checked, Delta):
            self._fold_delta(stored, checked)
        elif checked.reason not in NEVER_APPLIES:
            raise CompactionRefused(
                f"delta {stored.seq} of workspace {self.workspace!r} is refused with this command's settings "
                f"({checked.reason}: {checked.detail}) but the projector has no dead letter of it: run compact "
                "with the projector's settings (ONTOFABRIC_EMBEDDING_MODEL, _EMBEDDING_DIM, _MAX_CONTENT_BYTES)"
            )

    def _fold_delta(self, stored: StoredDelta, checked: Delta) -> None:
        event_id = checked.envelope.event_id
        if self._fold.add(checked):
            key = row_key(checked)
            replaced = self._kept.get(key)
            if replaced is not None:
                self._handled[replaced[1]] = replaced[0].seq
                self._kept_events.discard(replaced[1])
            self._kept[key] = (stored, event_id)
            self._kept_events.add(event_id)
        elif event_id not in self._kept_events:  # a stale delta, or a repeat of a superseded one
            self._handled.setdefault(event_id, stored.seq)

    def snapshot(self) -> Snapshot:
        deltas = sorted((stored for stored, _ in self._kept.values()), key=lambda d: d.seq)
        return Snapshot(self.workspace, self.covers, deltas, dict(self._handled))


async def snapshot_store(js: JetStreamContext, names: Names, settings: Settings) -> ObjectStore:
    try:
        return await js.object_store(names.snapshot_bucket)
    except NotFoundError:
        config = ObjectStoreConfig(
            bucket=names.snapshot_bucket,
            storage=StorageType.FILE,
            replicas=settings.nats_replicas,
            description="each workspace's fold of the compacted delta stream",
        )
        return await js.create_object_store(names.snapshot_bucket, config)


async def find_snapshot_store(js: JetStreamContext, names: Names) -> ObjectStore | None:
    """The snapshots, when the stream was ever compacted."""
    try:
        return await js.object_store(names.snapshot_bucket)
    except NotFoundError:
        return None


async def load_snapshot(store: ObjectStore, workspace: str) -> Snapshot | None:
    try:
        result = await store.get(encode_token(workspace))
    except ObjectNotFoundError:
        return None
    assert result.data is not None
    return Snapshot.decode(result.data)


async def compacted_through(store: ObjectStore) -> int:
    """The stream sequence through which every workspace's deltas are in its snapshot (0: never compacted)."""
    try:
        result = await store.get(MARKER)
    except ObjectNotFoundError:
        return 0
    return int(json.loads(result.data or b"{}").get("covers", 0))


@dataclass
class CompactionReport:
    covers: int
    """The stream sequence the snapshots now cover; the stream keeps what comes after it."""
    workspaces: int = 0
    """Workspaces whose snapshot changed."""
    deltas_read: int = 0
    rows: int = 0
    snapshot_bytes: int = 0
    purged: int = 0
    stream_bytes_before: int = 0
    stream_bytes_after: int = 0


async def index_position(js: JetStreamContext, names: Names, settings: Settings) -> int:
    """The stream sequence every index consumer has settled: the lowest ack floor of the configured Postgres
    layout's durables, of any other layout's that exist (one being filled for a new layout), and of the Azure AI
    Search projector's."""
    floors = [await projected_floor(js, names, settings.projector_partitions)]
    for durable in [*names.every_postgres_projector_durable, names.azure_projector_durable]:
        try:
            info = await js.consumer_info(names.delta_stream, durable)
        except NotFoundError:
            continue
        floors.append(int(info.ack_floor.stream_seq or 0) if info.ack_floor else 0)
    return min(floors)


async def stream_workspaces(nc: Client, names: Names) -> list[str]:
    """Every workspace with deltas in the stream, read page by page (the server lists at most 100,000 subjects
    in one answer)."""
    subjects: set[str] = set()
    while True:
        reply = await nc.request(
            f"$JS.API.STREAM.INFO.{names.delta_stream}",
            json.dumps({"subjects_filter": names.delta_subjects, "offset": len(subjects)}).encode(),
            timeout=30,
        )
        answer = json.loads(reply.data)
        if "error" in answer:
            raise CompactionRefused(f"cannot list the stream's subjects: {answer['error']}")
        page = answer.get("state", {}).get("subjects") or {}
        subjects |= set(page)
        if not page or len(subjects) >= int(answer.get("total", 0)):
            break
    return sorted({w for subject in subjects if (w := _workspace_of(subject)) is not None})


async def compact(nc: Client, names: Names, settings: Settings, progress: Progress) -> CompactionReport:
    """Snapshot every workspace through the index's position, then purge the stream below it. Run one at a
    time: two at once could each purge past the other's snapshots."""
    js = nc.jetstream()
    store = await snapshot_store(js, names, settings)
    done = await compacted_through(store)
    upto = await index_position(js, names, settings)
    stream = (await js.stream_info(names.delta_stream)).state
    report = CompactionReport(covers=max(done, upto), stream_bytes_before=int(stream.bytes or 0))
    if stream.first_seq > done + 1:
        raise CompactionRefused(
            f"the stream starts at sequence {stream.first_seq} but the snapshots cover only up to {done}: deltas "
            "were removed before a snapshot held them (an age limit shorter than the compaction interval?)"
        )
    if upto <= done:
        return report
    workspaces = await stream_workspaces(nc, names)
    progress.stage("compact", len(workspaces))
    limits = Limits.from_settings(settings)
    for workspace in workspaces:
        token = encode_token(workspace)
        previous = await load_snapshot(store, workspace)
        fold = SnapshotFold(workspace, limits, previous)
        start = max(done, fold.covers) + 1
        set_aside = await _set_aside(nc, names, workspace)
        read = await _fold_stream(nc, names, fold, start, upto, set_aside)
        report.deltas_read += read
        if read:
            snapshot = fold.snapshot()
            data = snapshot.encode()
            await store.put(token, data)
            report.workspaces += 1
            report.rows += len(snapshot.deltas)
            report.snapshot_bytes += len(data)
        progress.advance("compact", 1)
    if await compacted_through(store) > upto:
        raise CompactionRefused("another compaction ran meanwhile and got further: nothing was dropped by this one")
    await store.put(MARKER, json.dumps({"covers": upto, "at": datetime.now(UTC).isoformat()}).encode())
    await js.purge_stream(names.delta_stream, seq=upto + 1)
    after = await js.stream_info(names.delta_stream)
    report.purged = int(stream.messages or 0) - int(after.state.messages or 0)
    report.stream_bytes_after = int(after.state.bytes or 0)
    log.info("stream_compacted", covers=upto, workspaces=report.workspaces, purged=report.purged)
    return report


async def _set_aside(nc: Client, names: Names, workspace: str) -> set[int]:
    """The stream sequences of the workspace's deltas the Postgres projector dead-lettered: never applied there."""
    letters = await dead_letters(nc, names, Selection(workspace=workspace))
    return {letter.original_seq for letter in letters if letter.index == "postgres" and letter.original_seq}


def _workspace_of(subject: str) -> str | None:
    """The workspace of a delta subject; None for a subject no workspace can have (its deltas were dead-lettered,
    and the dead letters keep them)."""
    try:
        return decode_token(workspace_token_of(subject) or "")
    except ValueError:
        return None


async def _fold_stream(nc: Client, names: Names, fold: SnapshotFold, start: int, upto: int, set_aside: Set[int]) -> int:
    subjects = names.workspace_delta_subjects(fold.workspace)
    read = 0
    async with read_in_order(nc, names.delta_stream, subjects, start, upto, 256, FETCH_TIMEOUT_S) as batches:
        async for batch in batches:
            for msg in batch:
                fold.add(StoredDelta(msg.metadata.sequence.stream, msg.subject, msg.data), set_aside)
            read += len(batch)
    return read
