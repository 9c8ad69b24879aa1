"""``ontofabric adopt-stream``: the Postgres index made to follow the delta stream as it is now.

A projector refuses a stream that is not the one its index read (services/projector/following.py): its store lost
and made again, or restored from a backup older than the database. Adopting it empties the index on every database,
deletes the Postgres projectors' consumers (of every partition layout) and their rows in ``projection_fences``; the
projectors, at their next look, find an index that holds nothing and fill it from nothing, as for a lost database:
the snapshots of a compacted stream, then the stream from its first delta, on consumers made again. The versions
they announce are numbered on from those the versions bucket holds, so query caches move on. A workspace the stream
no longer holds is empty until it is ingested again.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import asyncpg
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from ontofabric.services.projector.snapshots import take_compaction_lock
from ontofabric.shared.placement import Placement
from ontofabric.shared.settings import redacted_url
from ontofabric.shared.subjects import Names

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


class AdoptRefused(Exception):
    """A compaction or an index fill holds a database: nothing was changed."""


@dataclass(frozen=True)
class Adopted:
    databases: int
    documents: int
    """The live documents the index held before it was emptied."""
    consumers: list[str]
    """The consumers deleted."""
    stream_first: int
    stream_last: int


async def adopt_stream(nc: Client, names: Names, placement: Placement) -> Adopted:
    """Empty every database's index and forget where its consumers were, so that the projectors fill it again from
    the stream as it is. Refused, with nothing changed, while a compaction or a fill holds a database's lock (held
    here until the end, so neither starts meanwhile)."""
    js = nc.jetstream()
    stream = await js.stream_info(names.delta_stream)  # the stream must be there: there is nothing to adopt else
    connections: list[asyncpg.Connection] = []
    try:
        for url in sorted(set(placement.databases)):
            conn = await asyncpg.connect(url)
            connections.append(conn)
            if not await take_compaction_lock(conn):
                raise AdoptRefused(
                    f"a compaction or an index fill runs on {redacted_url(url)}: nothing was changed; try again "
                    "after it"
                )
        deleted = []
        for durable in names.every_postgres_projector_durable:
            with contextlib.suppress(NotFoundError):
                await js.delete_consumer(names.delta_stream, durable)
                deleted.append(durable)
        documents = 0
        for conn in connections:
            async with conn.transaction():
                documents += await conn.fetchval("SELECT count(*) FROM documents WHERE NOT deleted")
                await conn.execute(f"TRUNCATE {', '.join(INDEX_TABLES)}")
                # A holder's next batch or look finds its claim gone and claims the consumer again; the new row
                # follows whichever stream it then reads.
                await conn.execute("DELETE FROM projection_fences")
    finally:
        for conn in connections:
            await conn.close()  # the session's end releases the compaction lock
    return Adopted(
        len(connections), documents, deleted, int(stream.state.first_seq or 0), int(stream.state.last_seq or 0)
    )
