"""Snapshots of a compacted delta stream, as stored: each workspace's fold (the last delta of each row, as the
stream stored it, and the event ids the fold handled) in the object store ``<prefix>_snapshots``, and the marker
naming the stream sequence they all cover. ``ontofabric compact`` writes them (services/ops/snapshots.py); a rebuild
and a projector filling an empty index read them before the stream's tail."""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ObjectInfo, ObjectStoreConfig, StorageType
from nats.js.errors import NotFoundError
from nats.js.object_store import ObjectStore

from ontofabric.shared.db import Connection
from ontofabric.shared.jetstream import server_answer_headers
from ontofabric.shared.logging import get_logger
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names, encode_token

from .runner import Projected, ProjectionRunner, project

log = get_logger(__name__)

FORMAT = 1
COMPACTION_LOCK = "ontofabric.compact"
"""The first key of the session advisory lock (second key 0) a compaction holds on each database for its whole run,
and a projector while it fills an index from nothing: the stream must not lose what such an index has yet to read."""


async def take_compaction_lock(conn: Connection) -> bool:
    """The compaction lock for ``conn``'s session, unless another session holds it (False). The session's end
    releases it."""
    return bool(await conn.fetchval("SELECT pg_try_advisory_lock(hashtext($1), 0)", COMPACTION_LOCK))


MARKER = "_compacted"
"""The object naming the sequence every snapshot covers (workspace objects are named by subject tokens, which
never start with ``_`` followed by a letter other than an escape)."""


@dataclass(frozen=True)
class StoredDelta:
    seq: int
    subject: str
    data: bytes
    headers: dict[str, str] | None = None
    """As the stream holds it (what tells a server's answer from a delta); not kept in a snapshot, which holds
    deltas only."""


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


MAX_META_MESSAGES = 1000
"""Messages of one object's meta subject read for the last one a compaction wrote, past those that are a server's
answer (:func:`read_object`); more is refused."""


class ForgedObject(Exception):
    """The snapshot store holds a part of an object that a NATS server's answer put there, or more such answers than
    are read past: nothing of it is believed."""


async def read_object(store: ObjectStore, name: str) -> bytes | None:
    """An object's bytes as the last compaction stored them; None when there is none. Read through the stream as
    stored, headers and all, where the object store's own reads see bodies alone: a red team's ingest user had a
    direct get of values of its own answered onto the store's subjects (a workspace's meta, chunks of its own), and
    a projector filling an index took that for the workspace's snapshot. A meta that is a server's answer is passed
    over for the one before it (a compaction's put rolls the subject up, such an answer does not); a chunk that is
    one, or a digest that does not match, raises ForgedObject."""
    js, bucket = store._js, store._name
    stream = f"OBJ_{bucket}"
    meta_subject = f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"
    meta, seq = None, 0
    for _ in range(MAX_META_MESSAGES):
        try:
            msg = await js.get_msg(stream, seq=seq + 1, subject=meta_subject, next=True)
        except NotFoundError:
            break
        seq = msg.seq or seq + 1
        if server_answer_headers(msg.headers):
            log.warning("snapshot_store_server_answer_ignored", object=name, seq=seq)
        else:
            meta = msg
    else:
        raise ForgedObject(f"object {name!r}: more than {MAX_META_MESSAGES} messages on its meta subject")
    if meta is None or not meta.data:
        return None
    info = ObjectInfo.from_response(json.loads(meta.data))
    if info.deleted:
        return None
    data, digest, seq = bytearray(), hashlib.sha256(), 0
    while len(data) < (info.size or 0):
        try:
            chunk = await js.get_msg(stream, seq=seq + 1, subject=f"$O.{bucket}.C.{info.nuid}", next=True)
        except NotFoundError:
            break
        if server_answer_headers(chunk.headers):
            raise ForgedObject(f"object {name!r}: a chunk is a NATS server's answer, not a compaction's")
        seq = chunk.seq or seq + 1
        data += chunk.data or b""
        digest.update(chunk.data or b"")
    expected = (info.digest or "").removeprefix("SHA-256=")
    if len(data) != (info.size or 0) or base64.urlsafe_b64encode(digest.digest()).decode() != expected:
        raise ForgedObject(f"object {name!r}: its chunks do not match its size and digest")
    return bytes(data)


async def load_snapshot(store: ObjectStore, workspace: str) -> Snapshot | None:
    data = await read_object(store, encode_token(workspace))
    return None if data is None else Snapshot.decode(data)


async def compacted_through(store: ObjectStore) -> int:
    """The stream sequence through which every workspace's deltas are in its snapshot (0: never compacted)."""
    return (await compaction_marker(store))[0]


async def compaction_marker(store: ObjectStore) -> tuple[int, str | None]:
    """What the last compaction wrote: the sequence the snapshots cover (0: never compacted), and when the stream
    they were folded from was made (ISO 8601; None when not said, as by a release before 2026-12-03)."""
    data = await read_object(store, MARKER)
    if data is None:
        return 0, None
    marker = json.loads(data or b"{}")
    made = marker.get("streamCreated")
    return int(marker.get("covers", 0)), made if isinstance(made, str) else None


async def stored_snapshots(store: ObjectStore) -> list[str]:
    """The names of the workspaces' snapshot objects (not the marker)."""
    try:
        infos = await store.list()
    except NotFoundError:
        return []
    return sorted(info.name for info in infos if info.name != MARKER and not info.deleted)


async def project_snapshot(
    nc: Client, names: Names, runner: ProjectionRunner, snapshot: Snapshot, batch_size: int
) -> AsyncIterator[tuple[int, Projected]]:
    """The snapshot's deltas through ``runner`` in batches, as a replay puts the stream's: each batch's size and
    what it left."""
    messages = snapshot.messages(nc, names.delta_stream)
    for first in range(0, len(messages), batch_size):
        batch = messages[first : first + batch_size]
        yield len(batch), await project(runner, batch)


async def restore_snapshots(
    nc: Client,
    names: Names,
    runner: ProjectionRunner,
    batch_size: int,
    holds: Callable[[str], bool] | None = None,
    handled: Callable[[str, Mapping[str, int]], Awaitable[None]] | None = None,
) -> int:
    """Every workspace's snapshot through ``runner`` (those whose subject token ``holds``: a partition's), for an
    index being filled from nothing while the stream starts after what compaction dropped (the consumer then reads
    the rest). ``handled`` records each snapshot's other handled events (workspace, event id -> sequence), so that
    a copy of one arriving later stays a no-op, as on the index the snapshot was folded from (an outside tester's:
    a copy of a superseded upsert brought a deleted document back). Returns the deltas restored."""
    store = await find_snapshot_store(nc.jetstream(), names)
    if store is None or await compacted_through(store) == 0:
        return 0
    restored = refused = 0
    for name in await stored_snapshots(store):  # each named by its workspace's subject token
        if holds is not None and not holds(name):
            continue
        data = await read_object(store, name)
        if data is None:  # a name only a server's answer gave (services/ops/snapshots.py writes every one)
            continue
        snapshot = Snapshot.decode(data)
        async for size, projected in project_snapshot(nc, names, runner, snapshot, batch_size):
            restored += size
            refused += len(projected.rejected)
        if handled is not None:
            await handled(snapshot.workspace, snapshot.handled)
    log.info("snapshots_restored", index=runner.sink.index, deltas=restored, refused=refused)
    return restored
