"""A rebuild's replay: one workspace's deltas read from the stream in order (each batch then goes through the
projection runner in place: :func:`~ontofabric.services.projector.runner.project`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from nats.aio.client import Client
from nats.aio.msg import Msg

from ontofabric.shared.jetstream import SkippedMessages, read_in_order
from ontofabric.shared.subjects import Names

from .shadow import RebuildFailed

FETCH_TIMEOUT_S = 5.0


@contextlib.asynccontextmanager
async def workspace_deltas(
    nc: Client, names: Names, workspace: str, start: int, upto: int, batch_size: int
) -> AsyncIterator[AsyncIterator[list[Msg]]]:
    """The workspace's deltas from stream sequence ``start`` through ``upto``, in batches (the replay keeps its
    position in the shadow schema); a gap in the read ends the run like any other stop, to be resumed."""
    subjects = names.workspace_delta_subjects(workspace)
    async with read_in_order(nc, names.delta_stream, subjects, start, upto, batch_size, FETCH_TIMEOUT_S) as batches:
        yield _resumable(batches)


async def _resumable(batches: AsyncIterator[list[Msg]]) -> AsyncIterator[list[Msg]]:
    """A gap in the read ends the run like any other stop of the replay: the next run resumes."""
    try:
        async for batch in batches:
            yield batch
    except SkippedMessages as error:
        raise RebuildFailed(str(error)) from error
