"""The publishing client for upstream ingesters: typed deltas onto JetStream, deduplicated by event id."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import PubAck
from opentelemetry import propagate
from opentelemetry.trace import SpanKind

from ontofabric.contracts import MAIN_BRANCH, DeltaEnvelope, DeltaPayload
from ontofabric.shared.jetstream import RETRY_FOR_S, RETRY_WAIT_S, RETRYABLE, connection_of, refused_promptly
from ontofabric.shared.logging import describe, get_logger
from ontofabric.shared.subjects import Names
from ontofabric.shared.tasks import still_wanted
from ontofabric.shared.telemetry import tracer

log = get_logger(__name__)

DEFAULT_PRODUCER = "ontofabric-ingest"


def envelope(
    workspace: str,
    payload: DeltaPayload,
    *,
    branch: str = MAIN_BRANCH,
    event_id: str | None = None,
    producer: str = DEFAULT_PRODUCER,
) -> DeltaEnvelope:
    """A delta ready to publish; without an ``event_id`` a random one is used (no deduplication across retries)."""
    return DeltaEnvelope(
        event_id=event_id or uuid.uuid4().hex,
        workspace=workspace,
        branch=branch,
        occurred_at=datetime.now(UTC),
        producer=producer,
        payload=payload,
    )


PUBLISH_WINDOW = 256
"""Acknowledgements outstanding at once (nats-py allows 4,000 per connection)."""


def message_id(delta: DeltaEnvelope, session: str) -> str:
    """The delta's ``Nats-Msg-Id``: JetStream dedupes on it across the whole stream, every workspace's deltas
    together, and an event id is unique within its workspace only. ``session``: the publisher's own random part.
    Event ids can be foreseen (an ingest's follow from the tree), and a tenant may publish under any message id on
    its own subjects: a message id another tenant can foresee lets it have the server drop that tenant's delta as a
    repeat (a red team did). A repeat from the same publisher, its resend after a lost acknowledgement, is still
    dropped by JetStream; one from another process (an interrupted ingest run again) is stored again and applied
    once by the projector, which keeps the event ids it handled."""
    return f"{delta.workspace}:{delta.event_id}:{session}"


class PublishFailed(Exception):
    """Some deltas could not be confirmed stored within the retry time. ``stored``: the acknowledgements of those
    that were, in input order (a prefix of the input); ``unconfirmed``: the event ids of the rest, which may or may
    not have landed. Publishing the same envelopes again is safe: JetStream drops a repeat from the same publisher,
    and the projector applies an event id once."""

    def __init__(
        self, stored: list[PubAck], unconfirmed: list[str], cause: BaseException, why: str | None = None
    ) -> None:
        self.stored = stored
        self.unconfirmed = unconfirmed
        self.keys_by_sequence: dict[int, str] = {}
        """The manifest keys of the deltas stored, by their stream sequence, where an ingest recorded them (the next
        one sends only the rest)."""
        super().__init__(
            f"{len(unconfirmed)} deltas could not be confirmed stored ({why or type(cause).__name__}), from event "
            f"id {unconfirmed[0]} on; {len(stored)} before it were. Publishing the same deltas again is safe."
        )


class StreamFull(PublishFailed):
    """The delta stream is at its size limit and refuses new deltas, whatever their workspace, until an operator
    makes room (``ontofabric compact``) or raises the limit; nothing it holds was dropped."""

    def __init__(self, stored: list[PubAck], unconfirmed: list[str], cause: BaseException) -> None:
        said = getattr(cause, "description", None) or cause
        why = f"the delta stream is full, {said}: an operator makes room with `ontofabric compact` or raises "
        super().__init__(stored, unconfirmed, cause, why + "ONTOFABRIC_DELTA_STREAM_MAX_BYTES")

    @staticmethod
    def said_by(error: BaseException) -> bool:
        """Whether JetStream refused a publish because the stream is at its size (or count) limit."""
        said = (getattr(error, "description", None) or "") if isinstance(error, nats.js.errors.APIError) else ""
        return said.startswith("maximum ") and said.endswith(" exceeded")


class DeltaPublisher:
    """Publishes deltas and waits until JetStream has stored them.

    An event id this publisher sends again is dropped by JetStream within its duplicate window
    (``PubAck.duplicate``, with the first copy's sequence) and would be a no-op in the projector after it; so across
    a disconnect, a server restart or a leader change the publisher sends again whatever it has no acknowledgement
    for, for up to ``retry_for_s``.
    What it still cannot confirm then is reported by event id (:class:`PublishFailed`); nothing is left pending.
    """

    def __init__(
        self, js: JetStreamContext, names: Names, *, ack_timeout_s: float = 10.0, retry_for_s: float = RETRY_FOR_S
    ) -> None:
        self._js = js
        self._names = names
        self._ack_timeout_s = ack_timeout_s
        self._retry_for_s = retry_for_s
        self._session = secrets.token_hex(8)

    def _message(self, delta: DeltaEnvelope) -> tuple[str, bytes, dict[str, str]]:
        headers = {"Nats-Msg-Id": message_id(delta, self._session), "Content-Type": "application/json"}
        propagate.inject(headers)  # the trace continues in the projector
        subject = self._names.delta_subject(delta.workspace, delta.branch)
        return subject, delta.model_dump_json(exclude_none=True).encode(), headers

    async def publish(self, delta: DeltaEnvelope) -> PubAck:
        return (await self.publish_many([delta]))[0]

    async def publish_many(
        self, deltas: Sequence[DeltaEnvelope], on_stored: Callable[[PubAck], None] | None = None
    ) -> list[PubAck]:
        """Publish in order with many acknowledgements outstanding; their acknowledgements, in input order. A
        workspace these credentials may not publish to fails at once (PermissionDenied), not after the timeout;
        what cannot be confirmed within the retry time raises :class:`PublishFailed`."""
        subjects = {self._names.delta_subject(delta.workspace, delta.branch) for delta in deltas}
        # A span of its own: each delta carries its context to the projector's batch, which links to it (with none
        # current, as in `ontofabric ingest`, the deltas carried none and the batches linked to nothing).
        with tracer().start_as_current_span("deltas publish", kind=SpanKind.PRODUCER) as span:
            span.set_attribute("messaging.system", "nats")
            span.set_attribute("messaging.batch.message_count", len(deltas))
            if len(subjects) == 1:
                span.set_attribute("messaging.destination.name", next(iter(subjects)))
            return await refused_promptly(connection_of(self._js), subjects, self._publish_many(deltas, on_stored))

    async def _publish_many(
        self, deltas: Sequence[DeltaEnvelope], on_stored: Callable[[PubAck], None] | None
    ) -> list[PubAck]:
        acks: list[PubAck] = []
        give_up_at = time.monotonic() + self._retry_for_s
        wait = RETRY_WAIT_S[0]
        while len(acks) < len(deltas):
            still_wanted()  # an interrupt nats-py lost in a flush it forced published on to the end (a review's)
            try:
                await self._publish_window(deltas[len(acks) : len(acks) + PUBLISH_WINDOW], acks, on_stored)
                wait = RETRY_WAIT_S[0]
            except RETRYABLE as error:
                if StreamFull.said_by(error):  # it will not pass in seconds: say so now
                    raise StreamFull(acks, [d.event_id for d in deltas[len(acks) :]], error) from error
                if time.monotonic() + wait > give_up_at:
                    # A server that stores nothing does not answer: a disk tester's full disk was named only so.
                    why = (
                        f"{type(error).__name__}: the NATS server did not answer; a server whose store cannot be "
                        "written (a full disk) stores nothing and says so only in its log"
                        if isinstance(error, TimeoutError)
                        else None
                    )
                    raise PublishFailed(acks, [d.event_id for d in deltas[len(acks) :]], error, why) from error
                log.warning("publish_retried", confirmed=len(acks), of=len(deltas), error=describe(error))
                await asyncio.sleep(wait)
                wait = min(RETRY_WAIT_S[1], wait * 2)
        return acks

    async def _publish_window(
        self, window: Sequence[DeltaEnvelope], acks: list[PubAck], on_stored: Callable[[PubAck], None] | None
    ) -> None:
        """Publish ``window`` and collect its acknowledgements into ``acks`` in order, up to the first that fails
        (raised); the rest are cancelled, so that nothing stays pending in the client.

        The first goes alone and is awaited: nats-py (2.x) never completes a ``publish_async`` future the stream
        answers with an error (a full stream, say), so the window would wait out its ack timeout and be retried as
        if the server were away; ``publish`` raises the server's error."""
        first, rest = window[0], window[1:]
        subject, data, headers = self._message(first)
        # The flush before each publish is bounded by the connection's flush timeout (shared/jetstream.py), the
        # answer by ack_timeout_s.
        ack = await self._js.publish(subject, data, timeout=self._ack_timeout_s, headers=headers)
        acks.append(ack)
        if on_stored is not None:
            on_stored(ack)
        pending: list[asyncio.Future[PubAck]] = []
        try:
            for delta in rest:
                subject, data, headers = self._message(delta)
                pending.append(await self._js.publish_async(subject, data, headers=headers))
            for future in pending:
                async with asyncio.timeout(self._ack_timeout_s):
                    ack = await asyncio.shield(future)
                acks.append(ack)
                if on_stored is not None:
                    on_stored(ack)
        finally:
            for future in pending:
                future.cancel()  # no-op on those done; frees nats-py's slot of those that are not
