"""Benchmark of the spine on the demo corpus (this project's own source tree).

Prints, in one run on the embedded servers:
- projection throughput: deltas published to JetStream and applied by the projector (first publish -> caught up),
  beside a reference that writes the same rows with the same SQL in one transaction (no NATS, no planning);
- query latency over NATS request-reply with the cache off, beside the embedding time alone of the same queries.

Run: .venv/bin/python tests/benchmarks/bench_spine.py [--repeats 3] [--queries 300]
Compare ratios, not absolute times: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import asyncpg
from nats.aio.client import Client
from nats.js import JetStreamContext

from ontofabric.contracts import DocumentUpserted, QueryResponse
from ontofabric.services.app import Roles, start_workers
from ontofabric.services.demo import project_root
from ontofabric.services.ingest.chunking import Chunk
from ontofabric.services.ingest.client import DeltaPublisher, envelope
from ontofabric.services.ingest.ingester import ChunkEmbedding, Ingester, chunk_tree, to_document
from ontofabric.services.ops.measures import percentile
from ontofabric.services.projector.planning import Delta, EntityRef
from ontofabric.services.projector.store import UPSERT_DOCUMENT, PostgresProjectionStore
from ontofabric.services.projector.worker import ProjectorService
from ontofabric.services.query.client import QueryClient
from ontofabric.services.query.worker import QueryService
from ontofabric.shared.db import create_pool, migrate
from ontofabric.shared.embedder import Embedder, build_embedder
from ontofabric.shared.embedding_cache import EmbeddingCache, embed_with_signs
from ontofabric.shared.jetstream import connect, ensure_jetstream, wait_caught_up
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import Endpoints, embedded_servers
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names


def queries_from(chunks: list[Chunk], limit: int) -> list[str]:
    """Natural-language queries: first sentences of docstrings, then symbol names split into words."""
    found: list[str] = []
    for chunk in chunks:
        if chunk.symbol_kind == "docstring":
            sentence = chunk.content.strip().split("\n")[0].split(". ")[0][:200]
            if len(sentence.split()) >= 3:
                found.append(sentence)
    for chunk in chunks:
        if chunk.chunk_level == "method":
            found.append(chunk.symbol_fqn.rsplit(".", 1)[-1].replace("_", " ").strip())
    return found[:limit]


async def reference_insert(pool: asyncpg.Pool, workspace: str, deltas: list[Delta], config: str) -> float:
    """The same rows through the same INSERT, one transaction, no NATS and no planning."""
    store = PostgresProjectionStore(pool, config)
    rows = []
    for delta in deltas:
        payload = delta.envelope.payload
        assert isinstance(payload, DocumentUpserted)
        rows.append(store.document_row(EntityRef(workspace, "main", "document", payload.document.id), delta))
    async with pool.acquire() as conn:
        await conn.execute("SELECT ensure_workspace_partition($1)", workspace)
        started = time.perf_counter()
        async with conn.transaction():
            await conn.executemany(UPSERT_DOCUMENT, rows)
        return time.perf_counter() - started


async def run(endpoints: Endpoints, repeats: int, query_count: int) -> None:
    settings = Settings(
        nats_url=endpoints.nats_url_as("operator"), database_url=endpoints.database_url, query_cache_entries=0
    )
    names = Names(settings.subject_prefix)
    embedder: Embedder | None = build_embedder(settings)
    assert embedder is not None

    chunks = chunk_tree(project_root(), settings.max_content_bytes)
    started = time.perf_counter()
    embedded = embed_with_signs(embedder, [c.embedding_text for c in chunks])
    embed_s = time.perf_counter() - started
    print(f"corpus: {len(chunks)} chunks from {project_root().name}; embedding {len(chunks) / embed_s:.1f} chunks/s")

    await migrate(endpoints.database_url, settings)
    projector = ProjectorService(settings, endpoints.nats_url_as("projector"), endpoints.database_url)
    await projector.start()
    nc = await connect(endpoints.nats_url_as("operator"), "bench")
    js = nc.jetstream()
    await ensure_jetstream(js, names, settings)
    publisher = DeltaPublisher(js, names)
    pool = await create_pool(endpoints.database_url, settings)

    chunk_embeddings = ChunkEmbedding.of(embedded, embedder.dimension, token_vectors=True)
    projected, referenced = [], []
    for repeat in range(repeats):
        workspace = f"bench-{repeat}-{uuid.uuid4().hex[:6]}"
        # What the ingester sends: each chunk's vector and its tokens' signs.
        deltas = [
            envelope(workspace, DocumentUpserted(document=to_document(c, chunk_embedding, embedder.model_name)))
            for c, chunk_embedding in zip(chunks, chunk_embeddings, strict=True)
        ]
        began = time.perf_counter()
        acks = await publisher.publish_many(deltas)
        await wait_caught_up(js, names.delta_stream, names.postgres_projector_durable, acks[-1].seq, 600, 0.005)
        projected.append(len(deltas) / (time.perf_counter() - began))
        reference_s = await reference_insert(
            pool, f"ref-{workspace}", [Delta(a.seq, d) for a, d in zip(acks, deltas, strict=True)],
            settings.text_search_config,
        )  # fmt: skip
        referenced.append(len(deltas) / reference_s)
    p, r = statistics.median(projected), statistics.median(referenced)
    print(
        f"projection: {p:.0f} documents/s through JetStream + projector (median of {repeats}); "
        f"reference single-transaction INSERT {r:.0f} documents/s; ratio {p / r:.2f}"
    )

    query = QueryService(settings, endpoints.nats_url_as("query"), endpoints.database_url, embedder)
    await query.start()
    client = QueryClient(nc, names)
    texts = queries_from(chunks, query_count)
    ws = deltas[0].workspace  # the last workspace the projector filled
    for text in texts[:10]:  # warm up connections and the plan cache
        await client.query(ws, {"semanticQuery": text})
    latencies, stage_totals = [], []
    for text in texts:
        began = time.perf_counter()
        reply = await client.query(ws, {"semanticQuery": text})
        latencies.append((time.perf_counter() - began) * 1000)
        assert isinstance(reply, QueryResponse)
        assert not reply.meta.cache_hit
        stage_totals.append(reply.meta.timings_ms)
    embed_ms = []
    for text in texts:
        began = time.perf_counter()
        embedder.embed_query(text)
        embed_ms.append((time.perf_counter() - began) * 1000)
    q50, q95 = percentile(latencies, 0.5), percentile(latencies, 0.95)
    e50, e95 = percentile(embed_ms, 0.5), percentile(embed_ms, 0.95)
    print(
        f"query over NATS, cache off, {len(texts)} queries: p50 {q50:.1f} ms, p95 {q95:.1f} ms; "
        f"embedding alone p50 {e50:.1f} ms, p95 {e95:.1f} ms; ratio p50 {q50 / e50:.2f}, p95 {q95 / e95:.2f}"
    )
    stages = sorted({s for t in stage_totals for s in t})
    print("worker stage medians (ms): " + ", ".join(
        f"{s} {statistics.median(t[s] for t in stage_totals if s in t):.1f}" for s in stages
    ))  # fmt: skip

    await query.stop()
    await projector.stop()
    await pool.close()
    await nc.close()


@dataclass(frozen=True)
class Served:
    """Workers running, and an operator's connection with an ingester for a benchmark's corpus."""

    nc: Client
    js: JetStreamContext
    ingester: Ingester


async def serve_for_ingest(
    stack: AsyncExitStack,
    settings: Settings,
    endpoints: Endpoints,
    roles: Roles | None = None,
    embedder: Embedder | None = None,
) -> Served:
    """Start the workers (``roles``, default all) and an ingester; ``stack`` stops and closes them. ``embedder``:
    the model the ingester (and a query worker among the roles) uses; loaded when not given."""
    names = Names(settings.subject_prefix)
    embedder = await start_workers(stack, settings, endpoints, roles or Roles(), embedder)
    nc = await connect(endpoints.nats_url_as("operator"), "bench", settings)
    stack.push_async_callback(nc.close)
    cache = EmbeddingCache(settings.cache_dir / "embeddings.sqlite")
    stack.callback(cache.close)
    js = nc.jetstream()
    return Served(nc, js, Ingester(js, names, embedder, settings.max_content_bytes, cache=cache))


@dataclass(frozen=True)
class ServedCorpus:
    """A tree ingested into a new workspace and projected, and natural-language queries from its chunks."""

    served: Served
    embedder: Embedder | None
    workspace: str
    chunks: int
    texts: list[str]


async def serve_tree(
    stack: AsyncExitStack, settings: Settings, endpoints: Endpoints, prefix: str, tree: Path | None = None
) -> ServedCorpus:
    """The workers but a query worker (a benchmark starts its own), with ``tree`` (default: this project's source)
    ingested into a workspace named ``prefix`` and a random suffix, caught up; the model is loaded once, for the
    ingest and whichever query workers the benchmark starts in its process."""
    names = Names(settings.subject_prefix)
    tree = tree or project_root()
    workspace = f"{prefix}-{uuid.uuid4().hex[:6]}"
    embedder = await asyncio.to_thread(build_embedder, settings)
    served = await serve_for_ingest(stack, settings, endpoints, Roles(query=False), embedder)
    report = await served.ingester.ingest(tree, workspace)
    assert report.last_sequence is not None
    await wait_caught_up(served.js, names.delta_stream, names.postgres_projector_durable, report.last_sequence, 600)
    texts = queries_from(chunk_tree(tree, settings.max_content_bytes), 2000)
    return ServedCorpus(served, embedder, workspace, report.chunks, texts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="projection runs (fresh workspace each)")
    parser.add_argument("--queries", type=int, default=300, help="queries in the latency run")
    args = parser.parse_args()
    configure_logging("WARNING", "console")
    with embedded_servers() as endpoints:
        asyncio.run(run(endpoints, args.repeats, args.queries))


if __name__ == "__main__":
    main()
