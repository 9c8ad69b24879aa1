"""Benchmark of freshness: how long a delta takes from its publish to its ontologyVersion announcement.

Deltas are published one at a time at random gaps (seeded), as a trickle of edits arrives, to a projector on the
embedded servers with the deployment's ack wait. Each delta counts as projected when the first ontologyVersion
event with its stream sequence or a later one arrives. Two references read the same stream in the same run, each
a durable consumer with the same batch size and timeout that acks each batch and does nothing else: the
transport alone, with the projector's fetch loop (BatchPuller), and FastStream 0.7's batch pull subscriber, which
the projector used before.

What to look for: the tail. A delivery a consumer drops is redelivered only after the ack wait, so it shows as
an outlier near the ack wait and in the consumer's redelivery count.

Run: .venv/bin/python tests/benchmarks/bench_freshness.py [--deltas 400] [--max-gap-ms 100] [--seed 1]
Compare ratios, not absolute times: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
import uuid
from typing import Annotated

import numpy as np
from faststream import AckPolicy as FastStreamAckPolicy
from faststream import Context
from faststream.nats import JStream, NatsBroker, PullSub
from faststream.nats.message import NatsBatchMessage
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from ontofabric.contracts import DocumentUpserted, OntologyVersionChanged, SemanticDocument
from ontofabric.services.ingest.client import DeltaPublisher, envelope
from ontofabric.services.ops.measures import percentile
from ontofabric.services.projector.worker import ProjectorService
from ontofabric.shared.db import migrate
from ontofabric.shared.jetstream import BatchPuller, StreamReader, connect, ensure_jetstream
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import Endpoints, embedded_servers
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names

TRANSPORT_DURABLE = "bench-transport"
FASTSTREAM_DURABLE = "bench-faststream"


def document(n: int, rng: np.random.Generator) -> SemanticDocument:
    vector = rng.standard_normal(384)
    return SemanticDocument.model_validate(
        {
            "id": f"doc-{n}",
            "content": f"edit number {n} of a trickle of edits",
            "objectType": "bench.Edit",
            "sourceDomain": "bench",
            "metadata": {"chunkLevel": "method", "provenance": "ingested", "symbolKey": f"bench:{n}"},
            "embedding": [float(x) for x in vector / np.linalg.norm(vector)],
        }
    )


def first_at_or_after(events: list[tuple[int, float]], seq: int) -> float | None:
    """When the first event covering ``seq`` arrived (events in arrival order, sequences rising)."""
    return next((at for covered, at in events if covered >= seq), None)


def summary(name: str, latencies_s: list[float], expected: int, redelivered: int, ack_wait_s: float) -> str:
    ms = [x * 1000 for x in latencies_s]
    slow = sum(1 for x in latencies_s if x > ack_wait_s / 2)
    return (
        f"| {name} | {len(ms)}/{expected} | {percentile(ms, 0.5):.1f} | {percentile(ms, 0.95):.1f} | "
        f"{percentile(ms, 0.99):.1f} | {max(ms):.1f} | {slow} | {redelivered} |"
    )


async def run(endpoints: Endpoints, deltas: int, max_gap_s: float, seed: int) -> None:
    settings = Settings(nats_url=endpoints.nats_url_as("operator"), database_url=endpoints.database_url)
    names = Names(settings.subject_prefix)
    workspace = f"fresh-{uuid.uuid4().hex[:6]}"
    await migrate(endpoints.database_url, settings)
    nc = await connect(endpoints.nats_url_as("operator"), "bench-freshness")
    js = nc.jetstream()
    await ensure_jetstream(js, names, settings)
    first_seq = (await js.stream_info(names.delta_stream)).state.last_seq + 1

    announced: list[tuple[int, float]] = []

    async def on_version(msg: Msg) -> None:
        announced.append((OntologyVersionChanged.model_validate_json(msg.data).stream_seq, time.monotonic()))

    await nc.subscribe(names.version_event_subject(workspace, "main"), cb=on_version)

    delivered: dict[int, float] = {}

    async def on_transport_batch(messages: list[Msg], record: dict[int, float] = delivered) -> None:
        for msg in messages:
            record.setdefault(msg.metadata.sequence.stream, time.monotonic())
            await msg.ack()

    reader = StreamReader(
        await js.pull_subscribe(
            names.delta_subjects,
            durable=TRANSPORT_DURABLE,
            stream=names.delta_stream,
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=first_seq,
                ack_wait=settings.projector_ack_wait_s,
            ),
        ),
        name=TRANSPORT_DURABLE,
        connection=nc,
        batch_size=settings.projector_batch_size,
        fetch_timeout_s=settings.projector_batch_timeout_s,
    )
    transport = BatchPuller(reader, on_transport_batch)
    transport.start()

    faststream_delivered: dict[int, float] = {}
    broker = NatsBroker(endpoints.nats_url_as("operator"), logger=None)

    @broker.subscriber(
        names.delta_subjects,
        stream=JStream(names.delta_stream, declare=False),
        durable=FASTSTREAM_DURABLE,
        pull_sub=PullSub(
            batch_size=settings.projector_batch_size, timeout=settings.projector_batch_timeout_s, batch=True
        ),
        ack_policy=FastStreamAckPolicy.MANUAL,
        decoder=lambda message: [m.data for m in message.raw_message],
        config=ConsumerConfig(
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=first_seq,
            ack_wait=settings.projector_ack_wait_s,
        ),
    )
    async def on_faststream_batch(message: Annotated[NatsBatchMessage, Context("message")]) -> None:
        await on_transport_batch(message.raw_message, faststream_delivered)

    await broker.start()
    projector = ProjectorService(settings, endpoints.nats_url_as("projector"), endpoints.database_url)
    await projector.start()

    publisher = DeltaPublisher(js, names)
    gaps, vectors = random.Random(seed), np.random.default_rng(seed)
    published: dict[int, float] = {}
    print(f"publishing {deltas} deltas one at a time, gaps uniform in 0-{max_gap_s * 1000:.0f} ms ...", flush=True)
    for n in range(deltas):
        delta = envelope(workspace, DocumentUpserted(document=document(n, vectors)))
        sent = time.monotonic()
        ack = await publisher.publish(delta)
        published[ack.seq] = sent
        await asyncio.sleep(gaps.uniform(0, max_gap_s))
    # Up to past the ack wait, so a dropped delivery is seen as late rather than missing.
    deadline = time.monotonic() + settings.projector_ack_wait_s * 1.5 + 5
    while time.monotonic() < deadline and not (
        first_at_or_after(announced, max(published)) is not None
        and all(seq in delivered and seq in faststream_delivered for seq in published)
    ):
        await asyncio.sleep(0.1)

    projected = [at - published[seq] for seq in published if (at := first_at_or_after(announced, seq)) is not None]
    transported = [delivered[seq] - published[seq] for seq in published if seq in delivered]
    via_faststream = [faststream_delivered[seq] - published[seq] for seq in published if seq in faststream_delivered]
    redelivered = {
        durable: (await js.consumer_info(names.delta_stream, durable)).num_redelivered
        for durable in (names.postgres_projector_durable, TRANSPORT_DURABLE, FASTSTREAM_DURABLE)
    }
    await projector.stop()
    await transport.stop()
    await broker.stop()
    await nc.close()

    ack_wait = settings.projector_ack_wait_s
    print(f"\nack wait {ack_wait:.0f} s, batch timeout {settings.projector_batch_timeout_s * 1000:.0f} ms")
    print(f"| publish -> | handled | p50 ms | p95 ms | p99 ms | max ms | over {ack_wait / 2:.0f} s | redelivered |")
    print("|---|---|---|---|---|---|---|---|")
    print(summary("delivered (transport alone)", transported, deltas, redelivered[TRANSPORT_DURABLE], ack_wait))
    print(summary("delivered (FastStream 0.7 batch subscriber)", via_faststream, deltas,
                  redelivered[FASTSTREAM_DURABLE], ack_wait))  # fmt: skip
    print(summary("projected", projected, deltas, redelivered[names.postgres_projector_durable], ack_wait))
    ratio = percentile(projected, 0.5) / percentile(transported, 0.5)
    print(f"projected / delivered at p50: {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deltas", type=int, default=400, help="deltas published, one at a time")
    parser.add_argument("--max-gap-ms", type=float, default=100.0, help="longest random gap between two publishes")
    parser.add_argument("--seed", type=int, default=1, help="seed of the gaps and the vectors")
    args = parser.parse_args()
    configure_logging("WARNING", "console")
    with embedded_servers() as endpoints:
        asyncio.run(run(endpoints, args.deltas, args.max_gap_ms / 1000, args.seed))


if __name__ == "__main__":
    main()
