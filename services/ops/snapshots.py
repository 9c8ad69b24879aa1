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

import asyncio
import contextlib
import json
from collections.abc import Sequence, Set
from dataclasses import dataclass
from datetime import UTC, datetime

import asyncpg
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from pydantic import ValidationError

from ontofabric.contracts import DeltaEnvelope
from ontofabric.services.projector.consumer import event_key
from ontofabric.services.projector.planning import Delta, Limits, StateFold, validate_delta
from ontofabric.services.projector.reembedding import reembedder_for
from ontofabric.services.projector.snapshots import (
    MARKER,
    Snapshot,
    StoredDelta,
    compacted_through,
    load_snapshot,
    snapshot_store,
    take_compaction_lock,
)
from ontofabric.shared.jetstream import read_in_order
from ontofabric.shared.logging import get_logger
from ontofabric.shared.placement import Placement
from ontofabric.shared.progress import Progress
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names, encode_token, workspace_of
from ontofabric.shared.tasks import still_wanted

from .dead_letters import Selection, dead_letters
from .rebuild import running_rebuilds
from .verification import RowKey, row_key

log = get_logger(__name__)

FETCH_TIMEOUT_S = 5.0
POSITION_WAIT_S = 10.0
"""How long a compaction waits for a running projector to say its index's position (it does at every look, every
2 s) before it folds only up to the position its database holds."""
NEVER_APPLIES = frozenset({"oversized", "invalid_schema", "subject_mismatch"})
"""Rejections whatever the settings (the message limit is the stream's): this release applies no such delta. One
the index records handling of was applied by an earlier release, whose rules were looser (SnapshotFold keeps it)."""


class CompactionRefused(Exception):
    """Compacting now would lose or misstate what the index holds; nothing was dropped."""


@dataclass(frozen=True)
class Refused:
    """A delta this run's settings refuse, with no dead letter of it to say the projector refused it too."""

    seq: int
    event_id: str
    reason: str
    detail: str


class SnapshotFold:
    """A workspace's snapshot folded further with the deltas after it, by the projector's own rule (StateFold)."""

    def __init__(self, workspace: str, limits: Limits, previous: Snapshot | None = None) -> None:
        self.workspace = workspace
        self._limits = limits
        # A snapshot is one workspace's: its event ids are that workspace's.
        self._fold = StateFold(handled_events={(workspace, e) for e in previous.handled} if previous else frozenset())
        self._kept: dict[RowKey, tuple[StoredDelta, str]] = {}
        self._kept_events: set[str] = set()
        self._handled = dict(previous.handled) if previous else {}
        self.covers = previous.covers if previous else 0
        self.refused: list[Refused] = []
        """Deltas only this run's settings are known to refuse: see :meth:`check_refused`."""
        self.unreadable: dict[int, StoredDelta] = {}
        """Deltas the index applied that this release's contract refuses (an earlier release applied them, under
        looser rules): kept as they were stored, so that purging the stream drops nothing the index holds. A
        rebuild by this release refuses them, as its projector would, and its check of the live rows says so."""
        for delta in previous.deltas if previous else ():
            # Folded before, with the settings of that run: read as they are, not judged again by this run's.
            try:
                envelope = DeltaEnvelope.model_validate_json(delta.data)
            except ValidationError:  # kept by an earlier run as unreadable, or folded by an earlier release
                self.unreadable[delta.seq] = delta
                continue
            self._fold_delta(delta, Delta(delta.seq, envelope))

    def add(self, stored: StoredDelta, set_aside: Set[int] = frozenset(), applied: bool = False) -> None:
        """Fold one delta from the stream (after every one before). What the projector never applied stays out:
        a delta it dead-lettered (``set_aside``: the original sequences of its dead letters), and one no
        settings can apply (unreadable, or of another workspace than its subject), unless ``applied`` (the index
        records handling it at its own sequence): then an earlier release applied it, and it goes to
        ``unreadable``. A delta only this run's settings refuse stays out too, and is kept in ``refused``:
        :meth:`check_refused` decides."""
        self.covers = max(self.covers, stored.seq)
        if stored.seq in set_aside:
            return
        checked = validate_delta(stored.data, stored.subject, stored.seq, self._limits, stored.headers)
        if isinstance(checked, Delta):
            self._fold_delta(stored, checked)
        elif checked.reason in NEVER_APPLIES:
            # Stored bytes the index parsed once are UTF-8 JSON; anything else cannot be what it applied.
            if applied and _is_utf8(stored.data):
                self.unreadable[stored.seq] = stored
                log.warning(
                    "compaction_keeps_delta_this_release_refuses",
                    workspace=self.workspace,
                    seq=stored.seq,
                    reason=checked.reason,
                    detail=checked.detail,
                )
        else:  # it parsed: only settings refuse it
            event_id = DeltaEnvelope.model_validate_json(stored.data).event_id
            self.refused.append(Refused(stored.seq, event_id, checked.reason, checked.detail))

    def check_refused(self, handled: Set[tuple[str, int]] | None) -> None:
        """Raises CompactionRefused for a delta of ``refused`` that the projector handled: the index records its
        event at its own sequence (``handled``: the (event id, sequence) pairs the index records for these events,
        one per workspace row), so the projector's settings let it apply and the snapshot would not be what the
        index holds. One the index never handled was dead-lettered, its letter purged or re-driven since: it stays
        out. Without ``handled`` (the index not read), any is refused."""
        for refused in self.refused:
            if handled is None or (refused.event_id, refused.seq) in handled:
                raise CompactionRefused(
                    f"delta {refused.seq} of workspace {self.workspace!r} is refused with this command's settings "
                    f"({refused.reason}: {refused.detail}) but the projector applied it: run compact with the "
                    "projector's settings (ONTOFABRIC_EMBEDDING_MODEL, _EMBEDDING_DIM, _MAX_CONTENT_BYTES)"
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
        kept = [stored for stored, _ in self._kept.values()]
        deltas = sorted([*kept, *self.unreadable.values()], key=lambda d: d.seq)
        return Snapshot(self.workspace, self.covers, deltas, dict(self._handled))


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
    held_back_by: str | None = None
    """A consumer not of the configured Postgres layout whose position holds compaction back, if one does."""


async def index_floors(js: JetStreamContext, names: Names, settings: Settings) -> dict[str, int]:
    """The ack floor of every index consumer: the configured Postgres layout's durables (one missing has settled
    nothing: 0), any other layout's that exist (one being filled for a new layout, or one left behind by an old
    one), and the Azure AI Search projector's (missing, 0 too when an Azure AI Search endpoint is configured: its
    projector deletes it to fill a lost index again, and reads the snapshots meanwhile)."""
    configured = set(names.postgres_projector_durables(settings.projector_partitions))
    if settings.azure_search_endpoint:
        configured.add(names.azure_projector_durable)
    floors: dict[str, int] = {}
    for durable in [*names.every_postgres_projector_durable, names.azure_projector_durable]:
        try:
            info = await js.consumer_info(names.delta_stream, durable)
        except NotFoundError:
            if durable in configured:
                floors[durable] = 0
            continue
        floors[durable] = int(info.ack_floor.stream_seq or 0) if info.ack_floor else 0
    return floors


async def index_position(js: JetStreamContext, names: Names, settings: Settings) -> int:
    """The stream sequence every index consumer has settled: the lowest of :func:`index_floors`."""
    return min((await index_floors(js, names, settings)).values())


async def _purge_below(nc: Client, js: JetStreamContext, names: Names, seq: int, report: CompactionReport) -> None:
    """Purge the delta stream's messages below ``seq``, and report how many went, as the server counted them (the
    stream's size before and after also counts what was published meanwhile: a tester's compaction beside an
    ingest said "-870 deltas dropped"), and the stream's size after."""
    still_wanted()  # an interrupt nats-py lost on the way here does not purge (a stop tester's compaction did)
    reply = await nc.request(
        f"$JS.API.STREAM.PURGE.{names.delta_stream}", json.dumps({"seq": seq}).encode(), timeout=30
    )
    answer = json.loads(reply.data)
    if "error" in answer:
        raise CompactionRefused(f"the snapshots are stored, but the stream could not be purged: {answer['error']}")
    report.purged = int(answer.get("purged", 0))
    report.stream_bytes_after = int((await js.stream_info(names.delta_stream)).state.bytes or 0)


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
    return sorted({w for subject in subjects if (w := workspace_of(subject)) is not None})


async def compact(
    nc: Client, names: Names, settings: Settings, progress: Progress, placement: Placement | None = None
) -> CompactionReport:
    """Snapshot every workspace through the index's position, then purge the stream below it. Refused while a
    rebuild runs on one of ``placement``'s databases (it may not have read what would be dropped), or another
    compaction (two at once: one could write a workspace's snapshot over the other's later one, and the other
    purge what it alone held), and, without a placement, on meeting a delta only this run's settings refuse.
    Without a placement nothing is locked."""
    async with contextlib.AsyncExitStack() as held:
        for database_url in sorted(set(placement.databases)) if placement is not None else ():
            conn = await asyncpg.connect(database_url)
            held.push_async_callback(conn.close)  # the session's end releases its lock
            if not await take_compaction_lock(conn):
                raise CompactionRefused(
                    "another compaction, or a projector filling an index from nothing, is running: compact after it"
                    " finishes"
                )
        return await _compact(nc, names, settings, progress, placement)


async def _compact(
    nc: Client, names: Names, settings: Settings, progress: Progress, placement: Placement | None
) -> CompactionReport:
    limits = Limits.from_settings(settings)
    limits_of: dict[str, Limits] = {}
    """Per database: what its projectors let through, following the model its index holds (after ``reembed``,
    documents of the models it held before are embedded again, not refused)."""
    placed = placement.databases if placement is not None else ()
    for database_url in placed:
        assert placement is not None
        conn = await asyncpg.connect(database_url)
        try:
            running = await running_rebuilds(conn)  # after the lock: a rebuild starting now sees it and stops
            if running:
                raise CompactionRefused(f"{running} rebuild(s) running: compact after they finish")
            unfilled = await _unfilled(conn, names, settings, placement, database_url)
            if unfilled:
                raise CompactionRefused(
                    f"the index of consumer {unfilled[0]} has not been filled on its database (a new or lost "
                    "database its projector has yet to fill from the stream): compact once it has"
                )
            reembedder = await reembedder_for(settings, conn)
            limits_of[database_url] = reembedder.limits(limits) if reembedder is not None else limits
        finally:
            await conn.close()
    js = nc.jetstream()
    store = await snapshot_store(js, names, settings)
    done = await compacted_through(store)
    floors = await index_floors(js, names, settings)
    if placement is not None:
        floors = await _bounded_by_positions(names, settings, placement, floors)
    upto = min(floors.values())
    stream = (await js.stream_info(names.delta_stream)).state
    report = CompactionReport(covers=max(done, upto), stream_bytes_before=int(stream.bytes or 0))
    configured = names.postgres_projector_durables(settings.projector_partitions)
    others = {d: floor for d, floor in floors.items() if d not in configured and d != names.azure_projector_durable}
    if others and min(others.values()) == upto < min(floors[durable] for durable in configured):
        # A consumer of another layout (left behind by a layout tried and given up, or being filled for a new
        # one) holds the stream back: say which, or the stream grows with nothing to show why.
        report.held_back_by = min(others, key=lambda durable: others[durable])
    if stream.first_seq > done + 1:
        raise CompactionRefused(
            f"the stream starts at sequence {stream.first_seq} but the snapshots cover only up to {done}: deltas "
            "were removed before a snapshot held them (an age limit shorter than the compaction interval?)"
        )
    if upto <= done:
        if stream.messages and int(stream.first_seq or 0) <= done:
            # A run that stored its snapshots and marker and then could not purge (its purge refused, or it was
            # stopped there): what the snapshots hold goes now, not at the next run that finds new deltas to fold
            # (a review's: run again, as the error said, and nothing was dropped).
            await _purge_below(nc, js, names, done + 1, report)
        return report
    workspaces = await stream_workspaces(nc, names)
    progress.stage("compact", len(workspaces))
    set_aside = await _set_aside(nc, names)
    for workspace in workspaces:
        token = encode_token(workspace)
        previous = await load_snapshot(store, workspace)
        placed_on = placement.database_url_of(workspace) if placement is not None else ""
        fold = SnapshotFold(workspace, limits_of.get(placed_on, limits), previous)
        start = max(done, fold.covers) + 1
        recorded = None if placement is None else await asyncpg.connect(placement.database_url_of(workspace))
        try:
            read = await _fold_stream(nc, names, fold, start, upto, set_aside.get(workspace, set()), recorded)
        finally:
            if recorded is not None:
                await recorded.close()
        report.deltas_read += read
        if fold.refused:
            handled = None if placement is None else await _handled_at(placement, workspace, fold.refused)
            fold.check_refused(handled)
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
    # And the stream they were folded from (services/projector/following.py): `adopt-stream` drops snapshots of another.
    made = (await js.stream_info(names.delta_stream)).created
    marker = {"covers": upto, "at": datetime.now(UTC).isoformat(), "streamCreated": made and made.isoformat()}
    await store.put(MARKER, json.dumps(marker).encode())
    await _purge_below(nc, js, names, upto + 1, report)
    log.info("stream_compacted", covers=upto, workspaces=report.workspaces, purged=report.purged)
    return report


async def _unfilled(
    conn: asyncpg.Connection, names: Names, settings: Settings, placement: Placement, database_url: str
) -> list[str]:
    """The configured consumers placed on this database whose index is not known filled there: no projector has
    claimed them on it (a database replaced by an empty one), or its fill from nothing is not done. Their consumers'
    floors say what the lost index had read, not this one: compacting by them would purge what it has yet to read,
    and fold none of it, since this index handled none of it (infra/migrations/0026; a review's finding)."""
    if await conn.fetchval("SELECT to_regclass('projection_fences')") is None:  # not even migrated yet
        return names.postgres_projector_durables(settings.projector_partitions)
    here = _durables_on(names, settings, placement, database_url)
    rows = await conn.fetch("SELECT durable, fill FROM projection_fences WHERE durable = ANY($1::text[])", here)
    filled = {row["durable"] for row in rows if row["fill"] == "done"}
    return [durable for durable in here if durable not in filled]


async def _bounded_by_positions(
    names: Names, settings: Settings, placement: Placement, floors: dict[str, int]
) -> dict[str, int]:
    """The floors, each configured consumer's no further than where its index's database says it stands
    (infra/migrations/0027). A database that went back in time (a replica promoted without the last commits, a
    backup restored) no longer holds what the consumer acked: compacting by the floor would purge it from the
    stream, and fold none of it either, since the index records no handling of it (a review's finding). A position
    behind the floor is waited for while a projector says it (up to ``POSITION_WAIT_S``); a position not known (a
    row from before the migration) leaves the floor as it is."""
    bounded = dict(floors)
    for database_url in sorted(set(placement.databases)):
        here = _durables_on(names, settings, placement, database_url)
        conn = await asyncpg.connect(database_url)
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + POSITION_WAIT_S
            while True:
                rows = await conn.fetch(
                    "SELECT durable, position FROM projection_fences WHERE durable = ANY($1::text[])", here
                )
                behind = {
                    row["durable"]: int(row["position"])
                    for row in rows
                    if row["position"] is not None and row["position"] < floors.get(row["durable"], 0)
                }
                if not behind or loop.time() >= deadline:
                    break
                await asyncio.sleep(0.2)
        finally:
            await conn.close()
        for durable, position in behind.items():
            log.info("compaction_bounded_by_position", durable=durable, floor=floors[durable], position=position)
            bounded[durable] = position
    return bounded


def _durables_on(names: Names, settings: Settings, placement: Placement, database_url: str) -> list[str]:
    """The configured consumers whose partitions are placed on this database."""
    durables = names.postgres_projector_durables(settings.projector_partitions)
    return [
        d for i, d in enumerate(durables) if placement.databases[placement.database_of_partition(i)] == database_url
    ]


async def _set_aside(nc: Client, names: Names) -> dict[str, set[int]]:
    """Per workspace, the stream sequences of the deltas the Postgres projector dead-lettered: never applied there."""
    set_aside: dict[str, set[int]] = {}
    for letter in await dead_letters(nc, names, Selection()):
        if letter.index == "postgres" and letter.workspace is not None and letter.original_seq:
            set_aside.setdefault(letter.workspace, set()).add(letter.original_seq)
    return set_aside


async def _handled_at(placement: Placement, workspace: str, refused: Sequence[Refused]) -> set[tuple[str, int]]:
    """The (event id, sequence) pairs the workspace's index records for these deltas' events: its own rows and
    those from before events were kept per workspace (workspace '', infra/migrations/0019), each."""
    conn = await asyncpg.connect(placement.database_url_of(workspace))
    try:
        records = await conn.fetch(
            "SELECT event_id, stream_seq FROM handled_events WHERE workspace IN ($1, '') AND event_id = ANY($2)",
            workspace,
            sorted({r.event_id for r in refused}),
        )
    finally:
        await conn.close()
    return {(r["event_id"], r["stream_seq"]) for r in records}


async def _fold_stream(
    nc: Client,
    names: Names,
    fold: SnapshotFold,
    start: int,
    upto: int,
    set_aside: Set[int],
    index: asyncpg.Connection | None,
) -> int:
    """Fold the workspace's deltas in (start, upto]. With ``index`` (its database), a delta whose event the index
    never handled stays out too: the projector refused it when it came (``apply_failed``, ``index_refused``), and
    its dead letter, which said so, was purged or re-driven since. Folded in, it took the place of the delta the
    index holds, the stream lost that one, and every rebuild after refused its swap."""
    subjects = names.workspace_delta_subjects(fold.workspace)
    read = 0
    async with read_in_order(nc, names.delta_stream, subjects, start, upto, 256, FETCH_TIMEOUT_S) as batches:
        async for batch in batches:
            stored = [StoredDelta(msg.metadata.sequence.stream, msg.subject, msg.data, msg.headers) for msg in batch]
            never = set() if index is None else await _never_handled(index, fold.workspace, stored)
            for delta in stored:
                fold.add(delta, set_aside | never if never else set_aside, applied=index is not None)
            read += len(batch)
    return read


async def _never_handled(index: asyncpg.Connection, workspace: str, stored: Sequence[StoredDelta]) -> set[int]:
    """The sequences of those deltas the index records no handling of at their own sequence (its own rows, and
    those from before events were kept per workspace: infra/migrations/0019). By event id alone, a refused delta
    whose fix came later under the same event id counted as handled, was folded in place of the fix, and the fix
    was compacted away (a fault tester's finding). A repeat of an event handled in this workspace stays out too, as
    the projector applied nothing of it; so does a delta without a readable event id, which no index handled."""
    events = {delta.seq: key[1] if (key := event_key(delta.subject, delta.data)) else None for delta in stored}
    records = await index.fetch(
        "SELECT event_id, stream_seq FROM handled_events WHERE workspace IN ($1, '') AND event_id = ANY($2)",
        workspace,
        sorted({event for event in events.values() if event is not None}),
    )
    handled = {(r["event_id"], r["stream_seq"]) for r in records}
    return {seq for seq, event in events.items() if (event, seq) not in handled}


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
