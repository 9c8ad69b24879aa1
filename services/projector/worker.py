"""The Postgres projector: a durable JetStream pull consumer that applies batches of deltas.

Per batch: rejected messages are dead-lettered with their reason, then terminated; the rest are applied in one
transaction; only after commit are they acked and the new ontologyVersions announced. A transient database
failure naks the batch with backoff; a delta that fails for any other reason is isolated and dead-lettered, and
the deltas after it still apply.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from datetime import UTC, datetime

import asyncpg
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from opentelemetry import propagate
from opentelemetry.metrics import Observation
from opentelemetry.trace import Link, get_current_span

from ontofabric.contracts import OntologyVersionChanged
from ontofabric.shared.db import create_pool, is_transient, migrate
from ontofabric.shared.jetstream import (
    MAX_DELTA_MESSAGE_BYTES,
    BatchHandler,
    BatchPuller,
    connect,
    ensure_jetstream,
    nak_delay,
)
from ontofabric.shared.logging import get_logger
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names, workspace_token_of
from ontofabric.shared.telemetry import instruments, meter, tracer

from .planning import Delta, Limits, Rejection, validate_delta
from .store import BatchResult, PostgresProjectionStore, VersionUpdate

log = get_logger(__name__)


def _header_safe(text: str, limit: int = 1000) -> str:
    return " ".join(text.split())[:limit]


INDEX = "postgres"
"""The index this projector keeps: a label on its metrics and dead letters."""

MAX_SPAN_LINKS = 128
"""The OpenTelemetry SDK's default link limit per span; more are dropped."""


def _ingest_links(messages: Sequence[Msg]) -> list[Link]:
    """A link to each ingest trace the batch's deltas carry in their headers: one batch span serves many traces.

    One ingest run puts its context on every delta it sends, so the same link repeats; each is kept once."""
    contexts = (get_current_span(propagate.extract(msg.headers or {})).get_span_context() for msg in messages)
    distinct = {(c.trace_id, c.span_id): c for c in contexts if c.is_valid}
    return [Link(context) for context in list(distinct.values())[:MAX_SPAN_LINKS]]


class VersionNotAnnounced(Exception):
    """The KV compare-and-set never succeeded; the batch is retried (its deltas are no-ops then)."""


class VersionPublisher:
    """Puts the latest ontologyVersion per (workspace, branch) in the KV bucket and on the event subject.

    Compare-and-set on the KV revision, so two projector workers can never leave an older version behind.
    """

    def __init__(self, nc: Client, kv: KeyValue, names: Names) -> None:
        self._nc = nc
        self._kv = kv
        self._names = names

    async def publish(self, update: VersionUpdate) -> None:
        record = OntologyVersionChanged(
            workspace=update.workspace,
            branch=update.branch,
            ontology_version=update.version.label,
            stream_seq=update.version.stream_seq,
            revision=update.revision,
            updated_at=datetime.now(UTC),
        )
        data = record.model_dump_json().encode()
        key = self._names.version_key(update.workspace, update.branch)
        for _ in range(20):
            try:
                entry = await self._kv.get(key)
            except KeyNotFoundError:
                entry = None
            try:
                if entry is None or entry.value is None:
                    await self._kv.create(key, data)
                else:
                    known = OntologyVersionChanged.model_validate_json(entry.value)
                    if known.revision >= record.revision:
                        return  # this version, or a newer one, is announced already
                    await self._kv.update(key, data, last=entry.revision)
                break
            except KeyWrongLastSequenceError:
                continue  # another worker wrote in between: re-read and compare again
        else:
            raise VersionNotAnnounced(f"{key}: the versions bucket kept changing under 20 compare-and-set tries")
        await self._nc.publish(self._names.version_event_subject(update.workspace, update.branch), data)


class Projector:
    def __init__(
        self,
        store: PostgresProjectionStore,
        js: JetStreamContext,
        versions: VersionPublisher,
        names: Names,
        limits: Limits,
    ) -> None:
        self._store = store
        self._js = js
        self._versions = versions
        self._names = names
        self._limits = limits
        self._metrics = instruments()
        self._lag = 0
        meter().create_observable_gauge(
            "projector.lag",
            callbacks=[lambda _: [Observation(self._lag)]],
            description="deltas in the stream not yet delivered to the projector's consumer",
        )

    async def handle(self, messages: Sequence[Msg]) -> None:
        started = time.perf_counter()
        with tracer().start_as_current_span("projector.batch", links=_ingest_links(messages)) as span:
            span.set_attribute("batch.size", len(messages))
            accepted: list[tuple[Msg, Delta]] = []
            for msg in messages:
                outcome = validate_delta(msg.data, msg.subject, msg.metadata.sequence.stream, self._limits)
                if isinstance(outcome, Rejection):
                    await self._dead_letter(msg, outcome)
                else:
                    accepted.append((msg, outcome))
            if accepted:
                await self._apply(accepted)
        if messages:
            self._lag = messages[-1].metadata.num_pending
        self._metrics.projector_batch_duration.record((time.perf_counter() - started) * 1000)

    async def _apply(self, accepted: list[tuple[Msg, Delta]]) -> None:
        try:
            result = await self._store.apply([delta for _, delta in accepted])
        except Exception as error:
            if is_transient(error):
                await self._retry_later([msg for msg, _ in accepted], error)
            elif len(accepted) > 1:
                # One delta the database refuses must not hold back the others: apply them one by one.
                log.warning("batch_isolating", error=str(error), size=len(accepted))
                for one in accepted:
                    await self._apply([one])
            else:
                msg = accepted[0][0]
                await self._dead_letter(msg, Rejection("apply_failed", f"{type(error).__name__}: {error}"))
            return
        redelivered = any(msg.metadata.num_delivered > 1 for msg, _ in accepted)
        try:
            await self._announce(result, redelivered)
        except Exception as error:
            # Committed but not announced: the redelivered batch is all no-ops and announces again.
            await self._retry_later([msg for msg, _ in accepted], error)
            return
        for msg, _ in accepted:
            await msg.ack()
        if result.plan.applied:
            await self._refresh_statistics({delta.envelope.workspace for delta in result.plan.applied})
        self._metrics.projector_deltas.add(len(result.plan.applied), {"outcome": "applied", "index": INDEX})
        self._metrics.projector_deltas.add(len(result.plan.noops), {"outcome": "noop", "index": INDEX})
        log.info(
            "batch_projected",
            applied=len(result.plan.applied),
            noops=len(result.plan.noops),
            versions={f"{v.workspace}/{v.branch}": v.version.label for v in result.versions},
        )

    async def _refresh_statistics(self, workspaces: set[str]) -> None:
        """After the acks: fresh planner statistics are an optimisation, never a reason to retry a batch."""
        try:
            analysed = await self._store.refresh_statistics(workspaces)
        except Exception as error:
            log.warning("statistics_refresh_failed", error=f"{type(error).__name__}: {error}")
            return
        if analysed:
            log.info("partitions_analysed", partitions=analysed)

    async def _announce(self, result: BatchResult, redelivered: bool) -> None:
        # A redelivered batch may follow a crash between commit and announcement: announce it again then.
        changed = {(w, b) for w, b in result.plan.versions}
        for update in result.versions:
            if redelivered or (update.workspace, update.branch) in changed:
                await self._versions.publish(update)

    async def _retry_later(self, messages: list[Msg], error: BaseException) -> None:
        await retry_later(messages, error, INDEX)

    async def _dead_letter(self, msg: Msg, rejection: Rejection) -> None:
        await dead_letter(self._js, self._names, msg, rejection, INDEX)


async def retry_later(messages: Sequence[Msg], error: BaseException, index: str, min_delay_s: float = 0.0) -> None:
    """Nak with backoff: the deltas come back after a growing delay (at least ``min_delay_s``) and apply then."""
    log.warning("batch_retry", index=index, error=f"{type(error).__name__}: {error}", size=len(messages))
    for msg in messages:
        await msg.nak(delay=max(min_delay_s, nak_delay(msg.metadata.num_delivered)))
    instruments().projector_deltas.add(len(messages), {"outcome": "retried", "index": index})


async def dead_letter(js: JetStreamContext, names: Names, msg: Msg, rejection: Rejection, index: str) -> None:
    """Publish the delta with its reason to the DLQ stream, then terminate it; if the DLQ publish fails, nak."""
    seq = msg.metadata.sequence.stream
    headers = {
        "Nats-Msg-Id": f"dlq:{index}:{msg.metadata.stream}:{seq}",
        "Ontofabric-Reason": rejection.reason,
        "Ontofabric-Detail": _header_safe(rejection.detail),
        "Ontofabric-Index": index,
        "Ontofabric-Original-Subject": msg.subject,
        "Ontofabric-Original-Stream": msg.metadata.stream,
        "Ontofabric-Original-Sequence": str(seq),
        "Ontofabric-Delivered": str(msg.metadata.num_delivered),
    }
    subject = names.dlq_subject(workspace_token_of(msg.subject) or "_unknown")
    try:
        await js.publish(subject, msg.data, headers=headers)
    except Exception as error:  # the dead letter is not safe yet: keep the original for another try
        await retry_later([msg], error, index)
        return
    await msg.term()
    instruments().projector_deltas.add(1, {"outcome": "dead_lettered", "index": index})
    log.warning("delta_dead_lettered", index=index, seq=seq, reason=rejection.reason, detail=rejection.detail[:300])


def limits_from(settings: Settings) -> Limits:
    return Limits(
        max_message_bytes=MAX_DELTA_MESSAGE_BYTES,
        max_content_bytes=settings.max_content_bytes,
        embedding_dim=settings.embedding_dim,
        embedding_model=settings.embedding_model,
    )


async def start_delta_puller(
    nc: Client, names: Names, settings: Settings, durable: str, handle: BatchHandler, batch_size: int
) -> BatchPuller:
    """A projector's durable pull consumer of every delta, from the stream's first, and its fetch loop, started.
    Deltas are acked one by one after they applied; an unacked one comes back after the ack wait, for ever."""
    subscription = await nc.jetstream().pull_subscribe(
        names.delta_subjects,
        durable=durable,
        stream=names.delta_stream,
        config=ConsumerConfig(
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=settings.projector_ack_wait_s,
            max_deliver=-1,
            max_ack_pending=max(4 * settings.projector_batch_size, 1000),
        ),
    )
    puller = BatchPuller(
        subscription,
        handle,
        batch_size=batch_size,
        fetch_timeout_s=settings.projector_batch_timeout_s,
        consumer=durable,
        connection=nc,
    )
    puller.start()
    return puller


class ProjectorService:
    """The projector worker process: migrations, pool, NATS set-up and the durable batch pull consumer."""

    def __init__(self, settings: Settings, nats_url: str, database_url: str) -> None:
        self.settings = settings
        self.names = Names(settings.subject_prefix)
        self._nats_url = nats_url
        self._database_url = database_url
        self._nc: Client | None = None
        self._puller: BatchPuller | None = None
        self._pool: asyncpg.Pool | None = None

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()  # whatever started before the failure
            raise

    async def _start(self) -> None:
        settings, names = self.settings, self.names
        await migrate(self._database_url, settings)
        self._pool = await create_pool(self._database_url, settings)
        nc = self._nc = await connect(self._nats_url, "ontofabric-projector")
        js = nc.jetstream()
        await ensure_jetstream(js, names, settings)
        kv = await js.key_value(names.version_bucket)
        projector = Projector(
            PostgresProjectionStore(self._pool, settings.text_search_config),
            js,
            VersionPublisher(nc, kv, names),
            names,
            limits_from(settings),
        )
        self._puller = await start_delta_puller(
            nc, names, settings, names.postgres_projector_durable, projector.handle, settings.projector_batch_size
        )
        log.info("projector_started", durable=names.postgres_projector_durable, stream=names.delta_stream)

    async def stop(self) -> None:
        puller, nc, pool = self._puller, self._nc, self._pool
        self._puller, self._nc, self._pool = None, None, None
        async with contextlib.AsyncExitStack() as closing:  # each closes, whatever the one before raised
            if pool is not None:
                closing.push_async_callback(pool.close)
            if nc is not None:
                closing.push_async_callback(nc.close)
            if puller is not None:
                await puller.stop()  # the batch in hand is finished and acked before the connection goes
        log.info("projector_stopped")
