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
from dataclasses import dataclass, field
from datetime import UTC, datetime

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig, StorageType
from nats.js.errors import NotFoundError, ObjectNotFoundError
from nats.js.object_store import ObjectStore

from ontofabric.services.projector.planning import Delta, Limits, StateFold, validate_delta
from ontofabric.shared.jetstream import projected_floor, read_in_order
from ontofabric.shared.logging import get_logger
from ontofabric.shared.progress import Progress
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names, decode_token, encode_token, workspace_token_of

from .verification import RowKey, row_key

log = get_logger(__name__)

FORMAT = 1
MARKER = "_compacted"
"""The object naming the sequence every snapshot covers (workspace objects are named by subject tokens, which
never start with ``_`` followed by a letter other than an escape)."""
FETCH_TIMEOUT_S = 5.0


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
            self.add(delta)

    def add(self, stored: StoredDelta) -> Delta | None:
        """Fold one delta (after every one before); the validated delta, or None when it could never apply (it
        was dead-lettered, and stays out of the snapshot)."""
        checked = validate_delta(stored.data, stored.subject, stored.seq, self._limits)
        self.covers = max(self.covers, stored.seq)
        if not isinstance(checked, Delta):
            return None
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
        return checked

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


class CompactionRefused(Exception):
    """The stream lost deltas no snapshot holds: compacting now would hide that."""


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
    """The stream sequence every index has settled: the Postgres projectors' lowest floor, and the Azure AI
    Search projector's when it has a consumer."""
    floor = await projected_floor(js, names, settings.projector_partitions)
    try:
        azure = await js.consumer_info(names.delta_stream, names.azure_projector_durable)
    except NotFoundError:
        return floor
    return min(floor, int(azure.ack_floor.stream_seq or 0) if azure.ack_floor else 0)


async def compact(nc: Client, names: Names, settings: Settings, progress: Progress) -> CompactionReport:
    """Snapshot every workspace through the index's position, then purge the stream below it."""
    js = nc.jetstream()
    store = await snapshot_store(js, names, settings)
    done = await compacted_through(store)
    upto = await index_position(js, names, settings)
    stream = await js.stream_info(names.delta_stream, subjects_filter=names.delta_subjects)
    report = CompactionReport(covers=max(done, upto), stream_bytes_before=int(stream.state.bytes or 0))
    if stream.state.first_seq > done + 1 and stream.state.messages:
        raise CompactionRefused(
            f"the stream starts at sequence {stream.state.first_seq} but the snapshots cover only {done}: deltas "
            "were removed before a snapshot held them (a limit shorter than the compaction interval?)"
        )
    if upto <= done:
        return report
    workspaces = sorted({w for s in (stream.state.subjects or {}) if (w := _workspace_of(s)) is not None})
    progress.stage("compact", len(workspaces))
    limits = Limits.from_settings(settings)
    for workspace in workspaces:
        token = encode_token(workspace)
        previous = await load_snapshot(store, workspace)
        fold = SnapshotFold(workspace, limits, previous)
        start = max(done, fold.covers) + 1
        read = await _fold_stream(nc, names, fold, start, upto)
        report.deltas_read += read
        if read:
            snapshot = fold.snapshot()
            data = snapshot.encode()
            await store.put(token, data)
            report.workspaces += 1
            report.rows += len(snapshot.deltas)
            report.snapshot_bytes += len(data)
        progress.advance("compact", 1)
    await store.put(MARKER, json.dumps({"covers": upto, "at": datetime.now(UTC).isoformat()}).encode())
    before = int(stream.state.messages or 0)
    await js.purge_stream(names.delta_stream, seq=upto + 1)
    after = await js.stream_info(names.delta_stream)
    report.purged = before - int(after.state.messages or 0)
    report.stream_bytes_after = int(after.state.bytes or 0)
    log.info("stream_compacted", covers=upto, workspaces=report.workspaces, purged=report.purged)
    return report


def _workspace_of(subject: str) -> str | None:
    """The workspace of a delta subject; None for a subject no workspace can have (its deltas were dead-lettered,
    and the dead letters keep them)."""
    try:
        return decode_token(workspace_token_of(subject) or "")
    except ValueError:
        return None


async def _fold_stream(nc: Client, names: Names, fold: SnapshotFold, start: int, upto: int) -> int:
    subjects = names.workspace_delta_subjects(fold.workspace)
    read = 0
    async with read_in_order(nc, names.delta_stream, subjects, start, upto, 256, FETCH_TIMEOUT_S) as batches:
        async for batch in batches:
            for msg in batch:
                fold.add(StoredDelta(msg.metadata.sequence.stream, msg.subject, msg.data))
            read += len(batch)
    return read
