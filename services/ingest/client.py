"""The publishing client for upstream ingesters: typed deltas onto JetStream, deduplicated by event id."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from nats.js import JetStreamContext
from nats.js.api import PubAck
from opentelemetry import propagate

from ontofabric.contracts import MAIN_BRANCH, DeltaEnvelope, DeltaPayload
from ontofabric.shared.jetstream import connection_of, refused_promptly
from ontofabric.shared.subjects import Names

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


class DeltaPublisher:
    """Publishes deltas and waits until JetStream has stored them.

    A republished event id is dropped by JetStream within its duplicate window (``PubAck.duplicate``) and would
    be a no-op in the projector after it, so retrying a failed ``publish_many`` with the same envelopes is safe.
    """

    def __init__(self, js: JetStreamContext, names: Names, *, ack_timeout_s: float = 30.0) -> None:
        self._js = js
        self._names = names
        self._ack_timeout_s = ack_timeout_s

    def _message(self, delta: DeltaEnvelope) -> tuple[str, bytes, dict[str, str]]:
        headers = {"Nats-Msg-Id": delta.event_id, "Content-Type": "application/json"}
        propagate.inject(headers)  # the trace continues in the projector
        subject = self._names.delta_subject(delta.workspace, delta.branch)
        return subject, delta.model_dump_json(exclude_none=True).encode(), headers

    async def publish(self, delta: DeltaEnvelope) -> PubAck:
        subject, data, headers = self._message(delta)
        publishing = self._js.publish(subject, data, headers=headers, timeout=self._ack_timeout_s)
        return await refused_promptly(connection_of(self._js), subject, publishing)

    async def publish_many(
        self, deltas: Sequence[DeltaEnvelope], on_stored: Callable[[PubAck], None] | None = None
    ) -> list[PubAck]:
        """Publish in order (the stream keeps the input order) with many acknowledgements outstanding. A
        workspace these credentials may not publish to fails at once (PermissionDenied), not after the timeout."""
        subjects = {self._names.delta_subject(delta.workspace, delta.branch) for delta in deltas}
        return await refused_promptly(connection_of(self._js), subjects, self._publish_many(deltas, on_stored))

    async def _publish_many(
        self, deltas: Sequence[DeltaEnvelope], on_stored: Callable[[PubAck], None] | None
    ) -> list[PubAck]:
        pending: list[asyncio.Future[PubAck]] = []
        for delta in deltas:
            subject, data, headers = self._message(delta)
            pending.append(await self._js.publish_async(subject, data, headers=headers))
        acks = []
        for future in pending:
            ack = await asyncio.wait_for(future, self._ack_timeout_s)
            if on_stored is not None:
                on_stored(ack)
            acks.append(ack)
        return acks
