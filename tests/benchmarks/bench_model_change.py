"""Benchmark of an embedding model change (`ontofabric reembed`) under query load.

N documents of a BEIR corpus are embedded by all-MiniLM-L6-v2 and published through the real path (JetStream,
the projector, Postgres). A query worker set up for the change answers the corpus's queries one at a time (answer
cache off) before, during and after the change to a second model of another dimension (MiniLM followed by a
fixed random projection to 256 dimensions, made at the start). In the same run, the reference: the same texts
embedded by the next model alone, in the same batches.

Printed: the change's documents/s against the reference's, the time to index and the time the swap held the
projectors off; query latency p50/p95 before, during and after, each with its ratio to before; answers that ran
without their dense leg. Compare ratios, not absolute times: the machines are shared and noisy.

Run: .venv/bin/python -m tests.benchmarks.bench_model_change ../shared/eval/scifact-train --split train
     [--documents 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

from rich.console import Console

from ontofabric.contracts import ErrorReply, TokenVectors
from ontofabric.services.app import Roles, start_workers
from ontofabric.services.ingest.client import DeltaPublisher
from ontofabric.services.ops.beir import load_beir
from ontofabric.services.ops.reembed import ModelChange
from ontofabric.services.query.client import QueryClient
from ontofabric.services.render import RichProgress
from ontofabric.shared.embedder import embedding_text, load_embedder
from ontofabric.shared.jetstream import connect, wait_projected
from ontofabric.shared.late_interaction import pack_signs
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import Endpoints, embedded_servers
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names
from tests.factories import document, projected_minilm, upsert

WORKSPACE = "bench-model-change"
NEXT, NEXT_DIM = "minilm-projected-256", 256
BATCH = 64


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(endpoints: Endpoints, texts: list[str], queries: list[str], model_dir: Path) -> None:
    settings = Settings(
        nats_url=endpoints.nats_url_as("operator"),
        database_url=endpoints.database_url,
        query_cache_entries=0,
        next_embedding_model=NEXT,
        next_embedding_model_path=model_dir,
        next_embedding_dim=NEXT_DIM,
    )
    names = Names(settings.subject_prefix)
    console = Console()
    current = load_embedder(settings)
    following = settings.next_model()
    assert following is not None
    next_embedder = load_embedder(following)

    started = time.perf_counter()
    for first in range(0, len(texts), BATCH):
        next_embedder.embed_with_tokens(texts[first : first + BATCH])
    reference_s = time.perf_counter() - started

    async with AsyncExitStack() as stack:
        await start_workers(stack, settings, endpoints, Roles())
        nc = await connect(endpoints.nats_url_as("operator"), "bench-model-change")
        stack.push_async_callback(nc.close)
        js = nc.jetstream()
        publisher = DeltaPublisher(js, names)
        last = 0
        for first in range(0, len(texts), BATCH):
            batch = texts[first : first + BATCH]
            vectors, tokens = await asyncio.to_thread(current.embed_with_tokens, batch)  # the workers share the loop
            deltas = [
                upsert(WORKSPACE, document(
                    f"doc{first + n}", text, embedding=[float(x) for x in vector], embedding_model=current.model_name,
                    token_vectors=TokenVectors.of_signs(current.dimension, pack_signs(signs)),
                ))
                for n, (text, vector, signs) in enumerate(zip(batch, vectors, tokens, strict=True))
            ]  # fmt: skip
            last = (await publisher.publish_many(deltas))[-1].seq
        await wait_projected(js, names, settings.projector_partitions, last, 3600)

        client = QueryClient(nc, names)
        turn = 0

        async def ask() -> tuple[float, bool]:
            nonlocal turn
            text = queries[turn % len(queries)]
            turn += 1
            asked = time.perf_counter()
            reply = await client.query(WORKSPACE, {"semanticQuery": text, "topK": 10})
            assert not isinstance(reply, ErrorReply), reply
            return (time.perf_counter() - asked) * 1000, "dense" in reply.meta.retrievers

        before = [(await ask())[0] for _ in range(60)]
        during: list[tuple[float, bool]] = []
        stop = asyncio.Event()

        async def keep_asking() -> None:
            while not stop.is_set():
                during.append(await ask())

        asker = asyncio.create_task(keep_asking())
        try:
            with RichProgress(console) as progress:
                job = ModelChange(settings, endpoints.nats_url_as("operator"), endpoints.database_url, progress)
                report = await job.run()
        finally:
            stop.set()
            await asker
        after = [(await ask())[0] for _ in range(60)]

    assert report.swapped
    print(f"{len(texts)} documents, {current.model_name} (384) -> {NEXT} ({NEXT_DIM}), 2-core machine")
    reference_rate = len(texts) / reference_s
    fill_rate = report.embedded / report.fill_s
    print("| | seconds | documents/s | ratio to the reference |")
    print("|---|---|---|---|")
    print(f"| next model alone (reference) | {reference_s:.1f} | {reference_rate:.1f} | 1.00 |")
    print(f"| change: embed ({report.rounds} rounds, {report.embedded} documents) | {report.fill_s:.1f} | "
          f"{fill_rate:.1f} | {fill_rate / reference_rate:.2f} |")  # fmt: skip
    print(f"| change: index | {report.index_s:.1f} | | |")
    print(f"swap held the projectors off for {report.swap_lock_s * 1000:.0f} ms")
    base = statistics.median(before)
    print("| queries | answers | p50 ms | p95 ms | p50 ratio to before | without dense |")
    print("|---|---|---|---|---|---|")
    for label, latencies, dense in (
        ("before", before, [True] * len(before)),
        ("during", [ms for ms, _ in during], [d for _, d in during]),
        ("after", after, [True] * len(after)),
    ):
        p50 = statistics.median(latencies)
        print(f"| {label} | {len(latencies)} | {p50:.1f} | {percentile(latencies, 0.95):.1f} | {p50 / base:.2f} | "
              f"{dense.count(False)} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", type=Path, help="a BEIR-layout directory: its corpus and queries")
    parser.add_argument("--split", default="test")
    parser.add_argument("--documents", type=int, default=1000)
    args = parser.parse_args()
    configure_logging("WARNING", "console")
    dataset = load_beir(args.dataset, args.split)
    texts = [
        embedding_text(f"{entry.get('title', '')} {entry['text']}".strip(), None)
        for entry in dataset.corpus[: args.documents]
    ]
    queries = list(dataset.queries.values())
    with tempfile.TemporaryDirectory() as scratch, embedded_servers() as endpoints:
        model_dir = projected_minilm(Path(scratch) / NEXT, NEXT_DIM)
        asyncio.run(run(endpoints, texts, queries, model_dir))


if __name__ == "__main__":
    main()
