"""Benchmark of `ontofabric rebuild` on a workspace projected the way deployments before migration 0007 stored it.

A BEIR corpus is loaded through the real path (deltas on JetStream, the projector, Postgres) into a workspace whose
vectors are stored out of line, as pgvector's EXTERNAL storage left them before migration 0007. Then the
workspace is rebuilt from the stream twice: alone, then while requests keep arriving (4 in flight, cache off) and
deltas keep being published. Printed, all from the same run:
- replay throughput alone against the live projector's throughput on the same corpus (the load), as a ratio;
- query latency and errors during the second rebuild against the same queries before and after;
- how long the swap held the projectors and the queries off, and whether the deletes published meanwhile landed;
- how many vectors were out of line, and the worker's dense stage, before and after (the rebuild writes every
  vector anew, so it lands in its row).
The rebuild runs as `ontofabric rebuild` in a process of its own, as an operator would run it.

Run: .venv/bin/python -m tests.benchmarks.bench_rebuild ../shared/eval/cosqa-dev --split dev
     [--size N] [--copies K] [--max-rate R]
Compare ratios, not absolute times: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import re
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path

import asyncpg
from nats.js.api import PubAck
from rich.console import Console

from ontofabric.contracts import DeltaEnvelope, DocumentDeleted, ErrorReply
from ontofabric.services.app import Roles, start_workers
from ontofabric.services.ingest.client import DeltaPublisher, envelope
from ontofabric.services.ops.beir import BeirDataset, load_beir
from ontofabric.services.ops.evaluation import Evaluation
from ontofabric.services.ops.measures import percentile
from ontofabric.services.query.client import QueryClient
from ontofabric.services.render import RichProgress
from ontofabric.shared.embedding_cache import EmbeddingCache
from ontofabric.shared.jetstream import connect, wait_caught_up
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import Endpoints, embedded_servers
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names

from .bench_query_load import Measure, drive

OUT_OF_LINE = (
    "SELECT count(pg_column_toast_chunk_id(embedding)) FROM documents WHERE workspace = $1 AND embedding IS NOT NULL"
)
REPORT = re.compile(
    r"(\d+) deltas replayed in ([\d.]+)s.*holding the projectors off for (\d+) ms and queries for (\d+) ms", re.S
)


def delete_delta(workspace: str, doc_id: str) -> DeltaEnvelope:
    return envelope(workspace, DocumentDeleted(document_id=doc_id))


async def rebuild_command(endpoints: Endpoints, workspace: str, *options: str) -> tuple[str, float]:
    """`ontofabric rebuild` in a process of its own, as an operator runs it; its output and wall time."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONTOFABRIC_")}
    env |= {"ONTOFABRIC_NATS_URL": endpoints.nats_url_as("operator"), "ONTOFABRIC_DATABASE_URL": endpoints.database_url}
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "ontofabric"), "rebuild", workspace, *options,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    output, _ = await process.communicate()
    text = output.decode()
    if process.returncode != 0:
        raise SystemExit(f"ontofabric rebuild failed:\n{text}")
    return text, time.perf_counter() - started


async def run(endpoints: Endpoints, dataset: BeirDataset, per_phase: int, deletes: int, max_rate: float | None) -> None:
    settings = Settings(
        nats_url=endpoints.nats_url_as("operator"), database_url=endpoints.database_url, query_cache_entries=0
    )
    names = Names(settings.subject_prefix)
    queries = [text for text in dataset.queries.values() if text.strip()][:per_phase]
    async with AsyncExitStack() as stack:
        embedder = await start_workers(stack, settings, endpoints, Roles())
        assert embedder is not None, "the benchmark needs the embedder"
        pool = await asyncpg.create_pool(endpoints.database_url, min_size=1, max_size=4)
        stack.push_async_callback(pool.close)
        # As before migration 0007: pgvector's own storage, which moves a vector out of a row past 2 kB.
        await pool.execute("ALTER TABLE documents ALTER COLUMN embedding SET STORAGE EXTERNAL")
        nc = await connect(endpoints.nats_url_as("operator"), "bench-rebuild")
        stack.push_async_callback(nc.close)
        js = nc.jetstream()
        client = QueryClient(nc, names, timeout_s=60)
        cache = EmbeddingCache(settings.cache_dir / "embeddings.sqlite")
        stack.callback(cache.close)
        with RichProgress(Console()) as progress:
            loader = Evaluation(js, client, names, embedder, cache, progress, settings.token_vectors)
            started = time.perf_counter()
            workspace, _ = await loader.load(dataset)
            load_s = time.perf_counter() - started
        out_of_line_before = await pool.fetchval(OUT_OF_LINE, workspace)
        dense_ms: list[float] = []

        async def ask(text: str) -> bool:
            reply = await client.query(workspace, {"semanticQuery": text, "topK": 10})
            if isinstance(reply, ErrorReply):
                return False
            dense_ms.append(reply.meta.timings_ms.get("dense", float("nan")))
            return True

        baseline = await drive(queries, 4, ask)
        dense_before = percentile(dense_ms, 0.5)
        quiet, quiet_s = await rebuild_command(endpoints, workspace)  # nothing else running: the throughput
        out_of_line_after = await pool.fetchval(OUT_OF_LINE, workspace)
        paced = ("--max-rate", str(max_rate)) if max_rate else ()
        rebuilding = asyncio.create_task(rebuild_command(endpoints, workspace, *paced))
        publisher = DeltaPublisher(js, names)

        async def trickle() -> list[PubAck]:  # deletes over the rebuild: some replayed, some caught up with
            acks = []
            for entry in dataset.corpus[:deletes]:
                acks.append(await publisher.publish(delete_delta(workspace, entry["_id"])))
                await asyncio.sleep(0.2)
            return acks

        async def ask_until_rebuilt() -> Measure:
            during = Measure([], 0.0)
            while not rebuilding.done():
                more = await drive(queries, 4, ask)
                during = Measure(during.latencies_ms + more.latencies_ms, during.wall_s + more.wall_s,
                                 during.errors + more.errors)  # fmt: skip
            return during

        acks, during = await asyncio.gather(trickle(), ask_until_rebuilt())
        output, rebuild_s = await rebuilding
        await wait_caught_up(js, names.delta_stream, names.postgres_projector_durable, acks[-1].seq, 120)
        live = await pool.fetchval("SELECT count(*) FROM documents WHERE workspace = $1 AND NOT deleted", workspace)
        dense_ms.clear()
        after = await drive(queries, 4, ask)
        dense_after = percentile(dense_ms, 0.5)

    documents = len(dataset.corpus)
    print(f"\n{documents} documents of {dataset.name}")
    print("\n| | seconds | deltas/s |")
    print("|---|---|---|")
    print(f"| load through the live projector (embeddings cached) | {load_s:.1f} | {documents / load_s:.0f} |")
    loaded = "under query load" + (f", --max-rate {max_rate:g}" if max_rate else "")
    for label, text, wall_s in (("alone", quiet, quiet_s), (loaded, output, rebuild_s)):
        replayed, replay_s, *_ = _parsed(text)
        print(f"| `ontofabric rebuild` {label}: replay (whole command {wall_s:.1f} s) | {replay_s:.1f} | "
              f"{replayed / replay_s:.0f} |")  # fmt: skip
    replayed, replay_s, *_ = _parsed(quiet)
    print(f"replay alone / live projection throughput: {replayed / replay_s / (documents / load_s):.2f}")
    (_, _, quiet_projectors, quiet_queries), (_, _, projectors, queries_held) = _parsed(quiet), _parsed(output)
    print(f"swap held the projectors off {quiet_projectors} ms alone, {projectors} ms under load, and queries "
          f"{quiet_queries} / {queries_held} ms; "
          f"{deletes} deletes published during the second rebuild, one per 0.2 s: {live} live documents after "
          f"(expected {documents - deletes})")  # fmt: skip
    print("\n| queries, 4 in flight | p50 ms | p95 ms | queries/s | errors |")
    print("|---|---|---|---|---|")
    for label, measure in (
        ("before the first rebuild (vectors out of line)", baseline),
        ("during the second rebuild", during),
        ("after both (compare with the row above)", after),
    ):  # fmt: skip
        p50, p95, qps = measure.row()
        print(f"| {label} | {p50:.1f} | {p95:.1f} | {qps:.1f} | {measure.errors} |")
    print(f"\nvectors out of line: {out_of_line_before} before, {out_of_line_after} after the first rebuild; "
          f"worker dense stage p50 {dense_before:.1f} ms before, {dense_after:.1f} ms after")  # fmt: skip


def _parsed(output: str) -> tuple[int, float, int, int]:
    """Deltas replayed, replay seconds, and how long the swap held the projectors and the queries (ms), from the
    command's closing line."""
    found = REPORT.search(output)
    assert found is not None, output
    return int(found[1]), float(found[2]), int(found[3]), int(found[4])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", type=Path, help="a BEIR-layout directory (corpus.jsonl, queries.jsonl, qrels/)")
    parser.add_argument("--split", default="test", help="the qrels split (only its file's presence is checked)")
    parser.add_argument("--size", type=int, default=0, help="the first N documents only (default: all)")
    parser.add_argument(
        "--copies", type=int, default=1, help="the corpus K times, under new ids (more documents, embeddings cached)"
    )
    parser.add_argument("--queries", type=int, default=200, help="queries before, and again during, the rebuild")
    parser.add_argument("--deletes", type=int, default=100, help="deletes published during the rebuild")
    parser.add_argument("--max-rate", type=float, default=None, help="the rebuild under query load keeps to it")
    args = parser.parse_args()
    configure_logging("WARNING", "console")
    dataset = load_beir(args.dataset, args.split)
    if args.size:
        dataset = dataclasses.replace(dataset, corpus=dataset.corpus[: args.size])
    if args.copies > 1:
        copies = [{**entry, "_id": f"{entry['_id']}~{k}"} for k in range(args.copies) for entry in dataset.corpus]
        dataset = dataclasses.replace(dataset, corpus=copies)
    with embedded_servers() as endpoints:
        asyncio.run(run(endpoints, dataset, args.queries, args.deletes, args.max_rate))


if __name__ == "__main__":
    main()
