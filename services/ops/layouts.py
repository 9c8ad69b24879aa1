"""``ontofabric forget-layout``: a partition layout given up, its consumers and its claims deleted.

Each layout (``ONTOFABRIC_PROJECTOR_PARTITIONS``) has durable consumers of its own and, in each database, a claim
row per consumer (``projection_fences``: its holder, its position, a refusal of the stream). Both stay after the
layout's projectors stop: a consumer left behind holds ``ontofabric compact`` back at its position, and a refusal
left in a claim row keeps ``ontofabric status`` reporting it (note 73). A projector of the layout started again
later claims anew and starts its consumers from the stream's first delta, as for a layout never run.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import asyncpg
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from ontofabric.shared.discovery import discover, postgres_layout
from ontofabric.shared.placement import Placement
from ontofabric.shared.settings import redacted_url
from ontofabric.shared.subjects import Names

LOCK_TIMEOUT = "30s"
"""How long deleting a database's claim rows waits for a batch holding one."""


class LayoutInUse(Exception):
    """Projectors of the layout asked to be forgotten still run."""


class ClaimsNotDeleted(Exception):
    """A database's claim rows could not be deleted: the message says what was."""


@dataclass(frozen=True)
class Forgotten:
    consumers: list[str]
    """The consumers deleted."""
    claims: int
    """The claim rows deleted, over every database."""


async def forget_layout(nc: Client, names: Names, placement: Placement, partitions: int) -> Forgotten:
    """Delete the consumers of the ``partitions`` layout and their claim rows in every database. Refused while a
    projector of that layout answers."""
    running = [w for w in await discover(nc, names.projector_service) if postgres_layout(w) == partitions]
    if running:
        raise LayoutInUse(f"{len(running)} projector(s) of that layout answer: stop them first")
    durables = names.postgres_projector_durables(partitions)
    js = nc.jetstream()
    consumers = []
    for durable in durables:
        with contextlib.suppress(NotFoundError):
            await js.delete_consumer(names.delta_stream, durable)
            consumers.append(durable)
    claims = 0
    for url in sorted(set(placement.databases)):
        try:
            conn = await asyncpg.connect(url)
            try:
                if await conn.fetchval("SELECT to_regclass('projection_fences')") is not None:
                    async with conn.transaction():
                        await conn.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
                        deleted = await conn.fetch(
                            "DELETE FROM projection_fences WHERE durable = ANY($1::text[]) RETURNING durable", durables
                        )
                    claims += len(deleted)
            finally:
                await conn.close()
        except (OSError, asyncpg.PostgresError) as error:
            raise ClaimsNotDeleted(
                f"deleted {', '.join(consumers) or 'no consumer'} and {claims} claim row(s) before, but the claim rows "
                f"on {redacted_url(url)} could not be deleted ({type(error).__name__}: {error}); run forget-layout "
                "again"
            ) from error
    return Forgotten(consumers, claims)
