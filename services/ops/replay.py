"""A rebuild's replay: one workspace's deltas read from the stream in order, and each batch put through the
projection runner (the projector's own validation and sink), a passing failure retried in place."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.aio.msg import Msg
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential

from ontofabric.services.projector.planning import Delta, Rejection
from ontofabric.services.projector.runner import ProjectionRunner
from ontofabric.shared.jetstream import SkippedMessages, read_in_order
from ontofabric.shared.logging import describe, get_logger
from ontofabric.shared.subjects import Names

from .shadow import RebuildFailed

log = get_logger(__name__)

APPLY_ATTEMPTS = 8
"""Tries of a batch the database refuses for a passing reason before the run stops (to be resumed later)."""
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


@dataclass
class Projected:
    """What a replayed batch left: the deltas now in the shadow (applied or already held), and those rejected."""

    done: list[Delta] = field(default_factory=list)
    rejected: list[tuple[int, Rejection]] = field(default_factory=list)


def _log_retry(state: RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome is not None else None
    log.warning("rebuild_apply_retry", error=describe(error) if error else None, attempt=state.attempt_number)


async def project(runner: ProjectionRunner, batch: list[Msg]) -> Projected:
    """The batch through the runner; what the sink could not write for a passing reason is tried again with
    backoff, and after APPLY_ATTEMPTS tries its error ends the replay."""
    projected, pending = Projected(), batch
    async for attempt in AsyncRetrying(
        retry=retry_if_exception(runner.sink.retryable),
        stop=stop_after_attempt(APPLY_ATTEMPTS),
        wait=wait_exponential(multiplier=0.5, max=10.0),
        before_sleep=_log_retry,
        reraise=True,
    ):
        with attempt:
            retry: list[Msg] = []
            error: BaseException | None = None
            async for outcome in runner.run(pending):
                projected.done += [delta for _, delta in outcome.done]
                projected.rejected += [
                    (msg.metadata.sequence.stream, rejection) for msg, rejection in outcome.invalid + outcome.refused
                ]
                retry += outcome.retry
                error = outcome.error or error
            if retry:
                assert error is not None
                pending = retry
                raise error
    return projected
