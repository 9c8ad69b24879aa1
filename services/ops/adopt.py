"""``ontofabric adopt-stream``: the Postgres index made to follow the delta stream as it is now.

A projector refuses a stream that is not the one its index read (services/projector/following.py): its store lost
and made again, or restored from a backup older than the database. Adopting it empties the index on every database,
deletes the Postgres projectors' consumers (of every partition layout) and their rows in ``projection_fences``; the
projectors, at their next look, find an index that holds nothing and fill it from nothing, as for a lost database:
the snapshots of a compacted stream, then the stream from its first delta, on consumers made again. Snapshots
folded from another stream (the stream restored or lost on its own, its snapshot store kept) are deleted: restored,
they would put the other history's sequences above the stream's. The versions the projectors announce are numbered
on from those the versions bucket holds, so query workers take them as a rebuild's and drop their cached answers. A
workspace the stream no longer holds is empty until it is ingested again.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import asyncpg
from nats.aio.client import Client
from nats.js.api import StreamInfo
from nats.js.errors import NotFoundError
from nats.js.object_store import ObjectStore

from ontofabric.services.ops.rebuild import running_rebuilds
from ontofabric.services.projector.snapshots import (
    compaction_marker,
    find_snapshot_store,
    stored_snapshots,
    take_compaction_lock,
)
from ontofabric.shared.placement import Placement
from ontofabric.shared.settings import redacted_url
from ontofabric.shared.subjects import Names, decode_token

INDEX_TABLES = (
    "documents",
    "postings",
    "term_statistics",
    "ontology_nodes",
    "ontology_links",
    "ontology_versions",
    "handled_events",
)
"""Everything the projectors wrote from the stream (the partitions of each workspace stay, empty)."""
LOCK_TIMEOUT = "30s"
"""How long emptying a database waits for the readers and writers of its tables."""


class AdoptRefused(Exception):
    """A compaction, a fill or a rebuild holds a database, or its tables could not be locked: the message says
    what was changed."""


@dataclass(frozen=True)
class Adopted:
    databases: int
    documents: int
    """The live documents the index held before it was emptied."""
    consumers: list[str]
    """The consumers deleted."""
    stream_first: int
    stream_last: int
    gone: list[str]
    """The workspaces the index held that neither the stream nor the snapshots hold: empty until ingested again (a
    tester's operator had to remember which)."""
    snapshots_dropped: int | None
    """Through which sequence the deleted snapshots of another stream covered; None: none deleted."""
    snapshots_kept: bool
    """Whether snapshots of this stream are there for the refill."""


async def adopt_stream(nc: Client, names: Names, placement: Placement) -> Adopted:
    """Empty every database's index and forget where its consumers were, so that the projectors fill it again from
    the stream as it is. Refused, with nothing changed, while a compaction, a fill or a rebuild holds a database
    (the compaction lock is held here until the end, so that no fill starts meanwhile)."""
    js = nc.jetstream()
    # The stream must be there: there is nothing to adopt else. Its subjects name the workspaces it holds.
    stream = await js.stream_info(names.delta_stream, subjects_filter=names.delta_subjects)
    snapshots = await find_snapshot_store(js, names)
    foreign = None if snapshots is None else await _of_another_stream(snapshots, stream)
    kept = {scope[0] for subject in stream.state.subjects or {} if (scope := names.scope_of_delta(subject))}
    if snapshots is not None and foreign is None:
        kept |= {decode_token(name) for name in await stored_snapshots(snapshots)}
    connections: dict[str, asyncpg.Connection] = {}
    try:
        for url in sorted(set(placement.databases)):
            conn = connections[url] = await asyncpg.connect(url)
            if not await take_compaction_lock(conn):
                raise AdoptRefused(f"a compaction or an index fill runs on {redacted_url(url)}: nothing was changed")
            if await running_rebuilds(conn):
                raise AdoptRefused(f"a rebuild runs on {redacted_url(url)}: nothing was changed")
        documents, held = 0, set()
        for emptied, (url, conn) in enumerate(connections.items()):
            try:
                async with conn.transaction():
                    await conn.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
                    # The claims first, in the order a batch locks: a batch holds its claim's row, then the
                    # versions (emptying the tables first deadlocked with it, a review's finding). A holder's next
                    # batch or look finds its claim gone and claims again; the new row follows this stream.
                    await conn.execute("DELETE FROM projection_fences")
                    held |= {
                        r["workspace"] for r in await conn.fetch("SELECT DISTINCT workspace FROM ontology_versions")
                    }
                    documents += await conn.fetchval("SELECT count(*) FROM documents WHERE NOT deleted")
                    await conn.execute(f"TRUNCATE {', '.join(INDEX_TABLES)}")
            except asyncpg.PostgresError as error:
                done = f"{emptied} of {len(connections)} databases were emptied" if emptied else "nothing was changed"
                raise AdoptRefused(
                    f"the index on {redacted_url(url)} could not be emptied ({type(error).__name__}: {error}): "
                    f"{done}; run adopt-stream again"
                ) from error
        deleted = []
        for durable in names.every_postgres_projector_durable:
            with contextlib.suppress(NotFoundError):
                await js.delete_consumer(names.delta_stream, durable)
                deleted.append(durable)
        if foreign is not None:
            await js.delete_object_store(names.snapshot_bucket)
    finally:
        for conn in connections.values():
            await conn.close()  # the session's end releases the compaction lock
    return Adopted(
        len(connections),
        documents,
        deleted,
        int(stream.state.first_seq or 0),
        int(stream.state.last_seq or 0),
        sorted(held - kept),
        foreign,
        snapshots is not None and foreign is None,
    )


async def _of_another_stream(snapshots: ObjectStore, stream: StreamInfo) -> int | None:
    """Through which sequence the snapshots cover when they were folded from another stream than ``stream``: they
    cover more than it ever held, or their marker names another stream's making. None: they are its own (or their
    marker does not say, as one written before 2026-12-03)."""
    covers, made = await compaction_marker(snapshots)
    if covers > int(stream.state.last_seq or 0):
        return covers
    if made is not None and stream.created is not None and made != stream.created.isoformat():
        return covers
    return None
