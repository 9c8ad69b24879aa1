"""The projection runner: the one loop by which deltas reach an index, whatever the index.

For each batch read from the stream: validate every delta (a delta that can never apply is set aside with its
reason), write the valid ones through the sink in one go, and when the sink refuses the batch for a reason that
lies in the data, write them one by one so that one bad delta costs only itself. The runner decides nothing about
delivery: it says which deltas are in the sink, which can never be, and which must come back later, and its caller
(a durable consumer's projector, or a rebuild's replay) settles them.

A sink is an index kept from the stream: Postgres (live, or a rebuild's shadow tables) or Azure AI Search. Its
writes must be idempotent by stream sequence (an older or repeated delta changes nothing), so that anything
delivered again after a failure can simply be written again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from nats.aio.msg import Msg
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential

from ontofabric.shared.logging import describe, get_logger
from ontofabric.shared.subjects import workspace_token_of

from .planning import (
    Delta,
    Limits,
    Rejection,
    embedded_by_another,
    long_index_keys,
    upserted_document,
    validate_delta,
)
from .reembedding import ModelChanged, Reembedder

log = get_logger(__name__)


@dataclass(frozen=True)
class Written:
    """What a sink did with a batch."""

    applied: int
    """Deltas that changed the index."""
    noops: int
    """Deltas the index already held (repeats, older than its rows, or not its kind)."""
    refused: dict[int, Rejection] = field(default_factory=dict)
    """Deltas, by stream sequence, the index refused for good; every other delta of the batch is in."""


class Sink(Protocol):
    index: str
    """The index it keeps: a label on metrics and dead letters."""

    async def write(self, deltas: Sequence[Delta], redelivered: bool) -> Written:
        """Write the batch, or raise. ``redelivered``: some of it was delivered before (a retry, or a crash
        between the write and the acks), so what the write announces must be announced again."""
        ...

    def retryable(self, error: BaseException) -> bool:
        """True when a failed write is to be tried again later (the database or service away, throttled); False
        when the data is to blame, so that the batch is written one delta at a time."""
        ...

    async def settled(self) -> None:
        """After the written deltas were acknowledged: work that must never hold a batch back."""
        ...


@dataclass
class Outcome:
    """What became of each delta of a batch."""

    done: list[tuple[Msg, Delta]] = field(default_factory=list)
    """In the sink: applied or already held."""
    invalid: list[tuple[Msg, Rejection]] = field(default_factory=list)
    """Can never apply anywhere (validation)."""
    refused: list[tuple[Msg, Rejection]] = field(default_factory=list)
    """Valid, but this sink refused it for good."""
    retry: list[Msg] = field(default_factory=list)
    """Not written: the sink failed for a passing reason (``error``)."""
    error: BaseException | None = None
    applied: int = 0
    noops: int = 0


class ProjectionRunner:
    def __init__(self, sink: Sink, limits: Limits, reembedder: Reembedder | None = None) -> None:
        self.sink = sink
        self._limits = limits
        self._reembedder = reembedder
        """Embeds again what another model embedded (a model change); None: such a delta is refused."""

    async def run(self, messages: Sequence[Msg]) -> AsyncIterator[Outcome]:
        """What became of the batch's deltas, part by part, as each write ends: first those that can never apply,
        then each write's (the whole batch's, or while isolating, each delta's), so that its caller settles every
        part at once and a long isolation never holds the first deltas past their ack wait."""
        invalid: list[tuple[Msg, Rejection]] = []
        accepted: list[tuple[Msg, Delta]] = []
        limits = self._limits if self._reembedder is None else self._reembedder.limits(self._limits)
        for msg in messages:
            checked = validate_delta(msg.data, msg.subject, msg.metadata.sequence.stream, limits, msg.headers)
            if isinstance(checked, Rejection):
                invalid.append((msg, checked))
            else:
                accepted.append((msg, checked))
        unnamed = [delta for _, delta in accepted if delta.unnamed_vector_dropped]
        if unnamed:
            first = unnamed[0].envelope
            log.warning(
                "embedding_without_model_not_used", documents=len(unnamed), workspace=first.workspace,
                event_id=first.event_id, note="vectors must name their model (embeddingModel): found by keyword only",
            )  # fmt: skip
        if invalid:
            yield Outcome(invalid=invalid)
        # In stream order: a redelivery may bring a later delta first, and a write split in parts (halves, or one
        # delta at a time) goes in this order (a copy of an event written before an earlier copy would take its place).
        accepted.sort(key=lambda pair: pair[1].seq)
        if accepted and self._reembedder is not None:
            try:
                accepted = await self._reembedder.refresh(accepted)
            except Exception as error:  # the model would not load or run: nothing is lost, the batch comes back
                log.warning("embedding_again_failed", error=describe(error), size=len(accepted))
                yield Outcome(retry=[msg for msg, _ in accepted], error=error)
                return
        if accepted:
            async for part in self._write(accepted):
                yield part

    async def _write(self, accepted: list[tuple[Msg, Delta]]) -> AsyncIterator[Outcome]:
        redelivered = any(msg.metadata.num_delivered > 1 for msg, _ in accepted)
        try:
            written = await self.sink.write([delta for _, delta in accepted], redelivered)
        except Exception as error:
            if isinstance(error, ModelChanged):
                async for part in self._model_changed(accepted, error):
                    yield part
                return
            if too_long(error) and len(accepted) > 1:
                # The batch took longer than a statement may: sent back whole it would fail the same way every
                # time and hold every workspace behind it. Halves, in stream order, until each fits.
                half = len(accepted) // 2
                log.warning("batch_split", index=self.sink.index, error=describe(error), size=len(accepted))
                async for settled in self._in_turn([accepted[:half], accepted[half:]]):
                    yield settled
            elif self.sink.retryable(error):
                yield Outcome(retry=[msg for msg, _ in accepted], error=error)
            elif len(accepted) > 1:
                # One delta the index refuses must not hold back the others: write them one by one.
                log.warning("batch_isolating", index=self.sink.index, error=describe(error), size=len(accepted))
                async for part in self._in_turn([[one] for one in accepted]):
                    yield part
            else:
                msg, delta = accepted[0]
                yield Outcome(
                    refused=[(msg, Rejection("apply_failed", describe(error) + long_index_keys(delta, error)))]
                )
            return
        outcome = Outcome(applied=written.applied, noops=written.noops)
        for msg, delta in accepted:
            refusal = written.refused.get(delta.seq)
            if refusal is None:
                outcome.done.append((msg, delta))
            else:
                outcome.refused.append((msg, refusal))
        yield outcome

    async def _in_turn(self, parts: list[list[tuple[Msg, Delta]]]) -> AsyncIterator[Outcome]:
        """Each part written after the one before; once a write is sent back for a retry, a later copy of one of
        its events (stored again past the duplicate window) goes back with it instead of being written first
        (see ``SentBack`` in consumer.py)."""
        waiting: set[tuple[str, str]] = set()
        error: BaseException | None = None
        for part in parts:
            held = [msg for msg, delta in part if _event(msg, delta) in waiting]
            if held:
                yield Outcome(retry=held, error=error)
            rest = [(msg, delta) for msg, delta in part if _event(msg, delta) not in waiting]
            if rest:
                async for outcome in self._write(rest):
                    if outcome.retry:
                        sent_back = {msg.metadata.sequence.stream for msg in outcome.retry}
                        waiting |= {
                            _event(msg, delta) for msg, delta in rest if msg.metadata.sequence.stream in sent_back
                        }
                        error = outcome.error
                    yield outcome

    async def _model_changed(self, accepted: list[tuple[Msg, Delta]], error: ModelChanged) -> AsyncIterator[Outcome]:
        """The index changed model (``ontofabric reembed``): the batch comes back to be embedded again for it, or,
        where this process cannot, its documents of another model are set aside and the rest written."""
        if self._reembedder is not None and self._reembedder.follow(error.index):
            yield Outcome(retry=[msg for msg, _ in accepted], error=error)
            return
        model = error.index.model
        other = [(msg, delta) for msg, delta in accepted if _embedded_by_another(delta, model)]
        reason = f"{error}; this projector cannot embed by it (set its model, then re-drive this delta)"
        yield Outcome(refused=[(msg, Rejection("embedding_model_mismatch", reason)) for msg, _ in other])
        rest = [(msg, delta) for msg, delta in accepted if not _embedded_by_another(delta, model)]
        if rest:
            async for part in self._write(rest):
                yield part


STATEMENT_TIMEOUT_SQLSTATE = "57014"


def too_long(error: BaseException) -> bool:
    """A statement ended by the server's statement_timeout (or a cancel): too much work at once, not a bad delta."""
    return getattr(error, "sqlstate", None) == STATEMENT_TIMEOUT_SQLSTATE


def _event(msg: Msg, delta: Delta) -> tuple[str, str]:
    return workspace_token_of(msg.subject) or "", delta.envelope.event_id


def _embedded_by_another(delta: Delta, model: str) -> bool:
    document = upserted_document(delta.envelope)
    return document is not None and embedded_by_another(document, model)


APPLY_ATTEMPTS = 8
"""Tries of a batch the sink refuses for a passing reason before a run outside a consumer stops (to be resumed)."""


@dataclass
class Projected:
    """What a replayed batch left: the deltas now in the shadow (applied or already held), and those rejected."""

    done: list[Delta] = field(default_factory=list)
    rejected: list[tuple[int, Rejection]] = field(default_factory=list)


def _log_retry(state: RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome is not None else None
    log.warning("apply_retry", error=describe(error) if error else None, attempt=state.attempt_number)


async def project(runner: ProjectionRunner, batch: list[Msg]) -> Projected:
    """The batch through the runner, outside any consumer (a rebuild's replay, a snapshot's restore): what the
    sink could not write for a passing reason is tried again in place with backoff, and after APPLY_ATTEMPTS tries
    its error ends the run."""
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
