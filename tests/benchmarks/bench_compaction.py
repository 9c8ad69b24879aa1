"""Benchmark of bounded retention: what `ontofabric compact` keeps, and a rebuild from snapshot + tail against one
from the whole stream.

A workspace's history is published through the real path (JetStream, the projector, Postgres): N documents from a
BEIR corpus's texts, each upserted V times (the text changed each time, a 384-dimension vector of its own), and a
fraction of them deleted at the end. Then, in the same run and on the same servers:
- the workspace is rebuilt from the whole stream, twice;
- the stream is compacted: its size before and after, the snapshots' size, the time taken;
- the workspace is rebuilt from its snapshot, twice.
Printed: sizes per document, and each rebuild's time with the ratio to the median rebuild from the whole stream.

Run: .venv/bin/python -m tests.benchmarks.bench_compaction ../shared/eval/scifact-train --split train
     [--documents 2000] [--versions 5] [--deleted 0.1]
Compare ratios, not absolute times: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from contextlib import AsyncExitStack
from pathlib import Path

from rich.console import Console

from ontofabric.contracts import DeltaEnvelope
from ontofabric.services.app import Roles, start_workers
from ontofabric.services.ingest.client import DeltaPublisher
from ontofabric.services.ops.beir import load_beir
from ontofabric.services.ops.rebuild import Rebuild
from ontofabric.services.ops.snapshots import compact
from ontofabric.services.render import RichProgress
from ontofabric.shared.jetstream import connect, wait_projected
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import Endpoints, embedded_servers
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names
from tests.factories import delete, document, unit_vector, upsert

WORKSPACE = "bench-compaction"


def history(texts: list[str], versions: int, deleted: float, rng: random.Random) -> list[DeltaEnvelope]:
    deltas = []
    for version in range(versions):
        for n, text in enumerate(texts):
            content = f"{text} (revision {version})"
            deltas.append(upsert(WORKSPACE, document(f"doc{n}", content, embedding=unit_vector(content))))
    gone = rng.sample(range(len(texts)), int(len(texts) * deleted))
    deltas += [delete(WORKSPACE, f"doc{n}") for n in gone]
    return deltas


async def run(endpoints: Endpoints, texts: list[str], versions: int, deleted: float) -> None:
    settings = Settings(nats_url=endpoints.nats_url_as("operator"), database_url=endpoints.database_url)
    names = Names(settings.subject_prefix)
    console = Console()
    async with AsyncExitStack() as stack:
        await start_workers(stack, settings, endpoints, Roles(query=False))
        nc = await connect(endpoints.nats_url_as("operator"), "bench-compaction")
        stack.push_async_callback(nc.close)
        js = nc.jetstream()
        publisher = DeltaPublisher(js, names)
        deltas = history(texts, versions, deleted, random.Random(7))
        last = 0
        for first in range(0, len(deltas), 500):
            acks = await publisher.publish_many(deltas[first : first + 500])
            last = acks[-1].seq
        await wait_projected(js, names, settings.projector_partitions, last, 3600)

        async def rebuild() -> tuple[float, int, int]:
            with RichProgress(console) as progress:
                job = Rebuild(settings, endpoints.nats_url_as("operator"), endpoints.database_url, WORKSPACE, progress)
                started = time.perf_counter()
                report = await job.run()
            assert report.swapped
            return time.perf_counter() - started, report.restored, report.replayed

        whole = [await rebuild() for _ in range(2)]
        stream_bytes = (await js.stream_info(names.delta_stream)).state.bytes
        with RichProgress(console) as progress:
            started = time.perf_counter()
            compacted = await compact(nc, names, settings, progress)
            compact_s = time.perf_counter() - started
        from_snapshot = [await rebuild() for _ in range(2)]

    reference = statistics.median(seconds for seconds, _, _ in whole)
    documents = len(texts)
    print(f"{documents} documents x {versions} versions, {deleted:.0%} deleted: {len(deltas)} deltas")
    print("| | bytes | per document |")
    print("|---|---|---|")
    print(f"| stream before compaction | {stream_bytes:,} | {stream_bytes / documents:,.0f} |")
    print(f"| stream after | {compacted.stream_bytes_after:,} | {compacted.stream_bytes_after / documents:,.0f} |")
    print(f"| snapshot ({compacted.rows} rows) | {compacted.snapshot_bytes:,} | "
          f"{compacted.snapshot_bytes / documents:,.0f} |")  # fmt: skip
    print(f"compaction: {compact_s:.1f} s for {compacted.deltas_read} deltas, {compacted.purged} dropped")
    print("| rebuild | from the snapshot | from the stream | seconds | ratio to the whole stream's median |")
    print("|---|---|---|---|---|")
    for label, runs in (("whole stream", whole), ("snapshot + tail", from_snapshot)):
        for seconds, restored, replayed in runs:
            print(f"| {label} | {restored} | {replayed} | {seconds:.1f} | {seconds / reference:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", type=Path, help="a BEIR-layout directory: its corpus gives the texts")
    parser.add_argument("--split", default="test")
    parser.add_argument("--documents", type=int, default=2000)
    parser.add_argument("--versions", type=int, default=5, help="upserts of each document")
    parser.add_argument("--deleted", type=float, default=0.1, help="the fraction of documents deleted at the end")
    args = parser.parse_args()
    configure_logging("WARNING", "console")
    dataset = load_beir(args.dataset, args.split)
    texts = [f"{entry.get('title', '')} {entry['text']}".strip() for entry in dataset.corpus[: args.documents]]
    with embedded_servers() as endpoints:
        asyncio.run(run(endpoints, texts, args.versions, args.deleted))


if __name__ == "__main__":
    main()
