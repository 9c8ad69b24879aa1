"""Benchmark: one tenant's malformed deltas, and how long another tenant's delta waits behind them.

A tenant may publish anything on its own delta subjects. Each malformed delta is dead-lettered with its reason,
and the Postgres projector reads the stream in order, so another tenant's delta published right after a flood
waits until the flood is dead-lettered. Each round starts a projector process (`ontofabric projector`) on a fresh
deployment, publishes ``--junk`` deltas of ``{}`` on one workspace and then one valid delta (a deletion) on
another, and times:

- the flood's rate through the projector: junk deltas over the time from the first publish until the index's
  position passes the last of them;
- the victim's wait: from its publish until the index's position passes it;
- the reference, in the same round: a bare pull consumer over the same stream that fetches in batches of the
  projector's size and acks each message, the floor any consumer of this stream pays per message.

Run: .venv/bin/python -m tests.benchmarks.bench_dead_letters [--junk 20000] [--rounds 3]
Compare the ratios within one run: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from ontofabric.contracts import DocumentDeleted
from ontofabric.services.ingest.client import DeltaPublisher, envelope
from ontofabric.shared.jetstream import projected_floor
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import EmbeddedRuntime
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names

from .bench_partitions import ONTOFABRIC, FreshDeployment, fresh_deployment

PUBLISH_WINDOW = 2_000
"""Junk publishes awaited together: a tenant's flood is pipelined, as nats-py's publish_async makes it."""


async def flood(js: JetStreamContext, subject: str, count: int) -> int:
    """Publish ``count`` junk deltas; the stream sequence of the last."""
    last = 0
    for start in range(0, count, PUBLISH_WINDOW):
        size = min(PUBLISH_WINDOW, count - start)
        acks = await asyncio.gather(*(js.publish(subject, b"{}") for _ in range(size)))
        last = acks[-1].seq
    return last


async def bare_consumer_s(js: JetStreamContext, names: Names, last_seq: int, batch: int) -> float:
    """Seconds a pull consumer that only acks takes from sequence 1 to ``last_seq``."""
    durable = "bench-bare-" + uuid.uuid4().hex[:8]
    await js.add_consumer(names.delta_stream, ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT))
    subscription = await js.pull_subscribe_bind(durable, names.delta_stream)
    began = time.perf_counter()
    seen = 0
    while seen < last_seq:
        for msg in await subscription.fetch(batch, timeout=5):
            await msg.ack()
            seen = msg.metadata.sequence.stream
    elapsed = time.perf_counter() - began
    await subscription.unsubscribe()
    await js.delete_consumer(names.delta_stream, durable)
    return elapsed


async def one_round(runtime: EmbeddedRuntime, base: Settings, junk: int) -> tuple[float, float, float]:
    """Junk deltas/s through the projector, the victim's wait in seconds, and the bare consumer's deltas/s."""
    async with fresh_deployment(runtime, base, "d" + uuid.uuid4().hex[:10]) as deployment:
        return await _flood_and_wait(deployment, junk)


async def _flood_and_wait(deployment: FreshDeployment, junk: int) -> tuple[float, float, float]:
    js, names, settings, env = deployment.js, deployment.names, deployment.settings, deployment.projector_env
    projector = await asyncio.create_subprocess_exec(ONTOFABRIC, "projector", env=env)
    try:
        durable = names.postgres_projector_durables(1)[0]
        async with asyncio.timeout(120):  # its consumer made: the process is up
            while durable not in {c.name for c in await js.consumers_info(names.delta_stream)}:
                await asyncio.sleep(0.1)
        began = time.perf_counter()
        last_junk = await flood(js, names.delta_subject("flooder", "main"), junk)
        victim = envelope("victim", DocumentDeleted(document_id="victim-doc"))
        published = time.perf_counter()
        (ack,) = await DeltaPublisher(js, names).publish_many([victim])
        junk_done = 0.0
        async with asyncio.timeout(1800):
            while (floor := await projected_floor(js, names, 1)) < ack.seq:
                if floor >= last_junk and not junk_done:
                    junk_done = time.perf_counter()
                await asyncio.sleep(0.01)
        settled = time.perf_counter()
        junk_rate = junk / ((junk_done or settled) - began)
        bare_s = await bare_consumer_s(js, names, ack.seq, settings.projector_batch_size)
    finally:
        projector.terminate()
        await asyncio.wait_for(projector.wait(), 30)
    return junk_rate, settled - published, ack.seq / bare_s


async def run(runtime: EmbeddedRuntime, rounds: int, junk: int) -> None:
    base = Settings()
    rates, waits, bares = [], [], []
    for round_ in range(rounds):
        rate, wait, bare = await one_round(runtime, base, junk)
        rates.append(rate)
        waits.append(wait)
        bares.append(bare)
        print(
            f"round {round_ + 1}: {junk} junk deltas at {rate:.0f}/s through the projector, the victim waited "
            f"{wait:.1f} s; a bare consumer acks {bare:.0f}/s ({rate / bare:.2f}x)",
            flush=True,
        )
    rate, bare = statistics.median(rates), statistics.median(bares)
    ratio = statistics.median(r / b for r, b in zip(rates, bares, strict=True))
    print(
        f"median: {rate:.0f} junk deltas/s, victim's wait {statistics.median(waits):.1f} s; bare consumer "
        f"{bare:.0f}/s; projector against bare consumer {ratio:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--junk", type=int, default=20_000, help="malformed deltas published by one workspace")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each on a fresh deployment")
    args = parser.parse_args()
    configure_logging("WARNING", "console")
    with (
        tempfile.TemporaryDirectory(prefix="ontofabric-bench-") as data_dir,
        EmbeddedRuntime(Settings(), Path(data_dir)) as runtime,
    ):
        asyncio.run(run(runtime, args.rounds, args.junk))


if __name__ == "__main__":
    main()
