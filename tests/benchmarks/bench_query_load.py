"""Benchmark of query latency and throughput at several corpus sizes and concurrencies, and of cache hits.

For each corpus size (the first N documents of a BEIR-layout dataset, loaded through the real path into a fresh
workspace), the dataset's queries are sent as default requests (`topK` 10, content included) over NATS
request-reply to one query worker, with 1, 4 and 16 requests in flight; each concurrency gets queries of its own,
so every one is a cache miss. Then the first level's queries are asked again: cache hits.

Reference, in the same run, on the same tables and at the same concurrency: the usual recipe in one process
without NATS, i.e. the query embedded on the same model thread, then one SQL statement that fuses the HNSW top 50
and the `ts_rank_cd` top 50 with RRF (k 60) and returns the top 10 with their content.

Run: .venv/bin/python tests/benchmarks/bench_query_load.py ../shared/eval/cosqa-dev --split dev
     [--sizes 1000,all] [--concurrency 1,4,16] [--queries 120]
(ONTOFABRIC_SECOND_VECTORS=true: the corpus and the query worker with second vectors; the recipe is the same)
Compare ratios, not absolute times: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import asyncpg
from pgvector.asyncpg import register_vector
from rich.console import Console

from ontofabric.contracts import ErrorReply, QueryResponse
from ontofabric.services.app import Roles, start_workers
from ontofabric.services.ops.beir import BeirDataset, load_beir
from ontofabric.services.ops.evaluation import Evaluation
from ontofabric.services.ops.measures import percentile
from ontofabric.services.query.client import QueryClient
from ontofabric.services.render import RichProgress
from ontofabric.shared.embedder import Embedder
from ontofabric.shared.embedding_cache import EmbeddingCache
from ontofabric.shared.jetstream import connect
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.onnx_models import second_embedder
from ontofabric.shared.runtime import Endpoints, embedded_servers
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names


@asynccontextmanager
async def recipe_index(pool: asyncpg.Pool) -> AsyncIterator[None]:
    """The GIN index the recipe's keyword half reads, built for the block. The deployment keeps none (its BM25
    reads the postings; migration 0015), and without it the reference would scan the table, flattering every
    ratio. Dropped after, so that nothing measured later pays for its upkeep."""
    await pool.execute("CREATE INDEX IF NOT EXISTS recipe_search_gin ON documents USING gin (search_vector)")
    await pool.execute("ANALYZE documents")
    try:
        yield
    finally:
        await pool.execute("DROP INDEX IF EXISTS recipe_search_gin")


# The recipe as pgvector's hybrid-search example writes it, on ontofabric's tables.
RRF_RECIPE = """
WITH dense AS (
    SELECT id, row_number() OVER (ORDER BY embedding <=> $2) AS rank
    FROM documents WHERE workspace = $1 AND branch = 'main' AND NOT deleted
    ORDER BY embedding <=> $2 LIMIT 50
), keyword AS (
    SELECT id, row_number() OVER (ORDER BY ts_rank_cd(search_vector, query) DESC) AS rank
    FROM documents, plainto_tsquery($4::text::regconfig, $3) AS query
    WHERE workspace = $1 AND branch = 'main' AND NOT deleted AND search_vector @@ query
    ORDER BY ts_rank_cd(search_vector, query) DESC LIMIT 50
), fused AS (
    SELECT coalesce(dense.id, keyword.id) AS id,
           coalesce(1.0 / (60 + dense.rank), 0) + coalesce(1.0 / (60 + keyword.rank), 0) AS score
    FROM dense FULL OUTER JOIN keyword ON dense.id = keyword.id
    ORDER BY score DESC LIMIT 10
)
SELECT fused.id, fused.score, documents.content
FROM fused JOIN documents ON documents.workspace = $1 AND documents.branch = 'main' AND documents.id = fused.id
ORDER BY fused.score DESC
"""


@dataclasses.dataclass
class Measure:
    latencies_ms: list[float]
    wall_s: float
    errors: int = 0

    def row(self) -> tuple[float, float, float]:
        return (
            percentile(self.latencies_ms, 0.5),
            percentile(self.latencies_ms, 0.95),
            len(self.latencies_ms) / self.wall_s,
        )


def answered(reply: QueryResponse | ErrorReply, stages: dict[str, list[float]]) -> bool:
    """Whether ``reply`` is an answer; an answer's stage timings (``_meta.timingsMs``) go into ``stages``."""
    if isinstance(reply, ErrorReply):
        return False
    for stage, ms in reply.meta.timings_ms.items():
        stages.setdefault(stage, []).append(ms)
    return True


async def drive(queries: Sequence[str], concurrency: int, ask: Callable[[str], Awaitable[bool]]) -> Measure:
    """Ask every query with ``concurrency`` requests in flight; latency per request, throughput over the wall."""
    pending = list(queries)
    latencies: list[float] = []
    errors = 0

    async def worker() -> None:
        nonlocal errors
        while pending:
            text = pending.pop()
            started = time.perf_counter()
            ok = await ask(text)
            latencies.append((time.perf_counter() - started) * 1000)
            errors += not ok

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Measure(latencies, time.perf_counter() - started, errors)


async def run(endpoints: Endpoints, dataset: BeirDataset, sizes: list[int], levels: list[int], per_level: int) -> None:
    settings = Settings(nats_url=endpoints.nats_url_as("operator"), database_url=endpoints.database_url)
    names = Names(settings.subject_prefix)
    queries = [text for text in dataset.queries.values() if text.strip()]
    needed = per_level * len(levels)
    if len(queries) < needed:
        raise SystemExit(f"{len(queries)} queries, {needed} needed: lower --queries")
    async with AsyncExitStack() as stack:
        embedder = await start_workers(stack, settings, endpoints, Roles())
        assert embedder is not None, "the benchmark needs the embedder"
        nc = await connect(endpoints.nats_url_as("operator"), "bench-query-load")
        stack.push_async_callback(nc.close)
        client = QueryClient(nc, names, timeout_s=60)
        cache = EmbeddingCache(settings.cache_dir / "embeddings.sqlite")
        stack.callback(cache.close)
        progress = stack.enter_context(RichProgress(Console()))
        # With ONTOFABRIC_SECOND_VECTORS set, the documents carry second vectors, as the query worker expects.
        second = await asyncio.to_thread(second_embedder, settings)
        loader = Evaluation(
            nc.jetstream(), client, names, embedder, cache, progress, settings.token_vectors, second=second
        )
        pool = await asyncpg.create_pool(endpoints.database_url, min_size=2, max_size=20, init=register_vector)
        stack.push_async_callback(pool.close)

        for size in sizes:
            subset = dataclasses.replace(dataset, corpus=dataset.corpus[:size])
            print(f"\ncorpus: {len(subset.corpus)} documents of {dataset.name}", flush=True)
            workspace, _ = await loader.load(subset)
            async with recipe_index(pool):
                await report(workspace, queries, levels, per_level, client, pool, embedder, settings.text_search_config)


async def report(
    workspace: str,
    queries: list[str],
    levels: list[int],
    per_level: int,
    client: QueryClient,
    pool: asyncpg.Pool,
    embedder: Embedder,
    text_search_config: str,
) -> None:
    stages: dict[str, list[float]] = {}

    async def ask_ontofabric(text: str) -> bool:
        return answered(await client.query(workspace, {"semanticQuery": text, "topK": 10}), stages)

    hits = 0

    async def ask_again(text: str) -> bool:
        nonlocal hits
        reply = await client.query(workspace, {"semanticQuery": text, "topK": 10})
        hits += not isinstance(reply, ErrorReply) and reply.meta.cache_hit
        return not isinstance(reply, ErrorReply)

    async def ask_recipe(text: str) -> bool:
        vector = await embedder.on_model_thread(lambda: embedder.embed_query(text))
        rows = await pool.fetch(RRF_RECIPE, workspace, vector, text, text_search_config)
        return bool(rows)

    print("| in flight | ontofabric p50 ms | p95 ms | queries/s | recipe p50 ms | p95 ms | queries/s | p50 ratio | "
          "throughput ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    inside: dict[int, str] = {}
    for n, level in enumerate(levels):
        batch = queries[n * per_level : (n + 1) * per_level]
        stages.clear()
        # The recipe first: its SQL never fills ontofabric's cache, so ontofabric's requests stay misses.
        recipe = await drive(batch, level, ask_recipe)
        ours = await drive(batch, level, ask_ontofabric)
        (p50, p95, qps), (r50, r95, rqps) = ours.row(), recipe.row()
        errors = f" ({ours.errors} errors)" if ours.errors else ""
        print(f"| {level} | {p50:.1f} | {p95:.1f} | {qps:.1f}{errors} | {r50:.1f} | {r95:.1f} | {rqps:.1f} | "
              f"{p50 / r50:.2f} | {qps / rqps:.2f} |")  # fmt: skip
        inside[level] = ", ".join(f"{stage} {percentile(ms, 0.5):.1f}" for stage, ms in sorted(stages.items()))
    for level, medians in inside.items():
        print(f"worker stage medians (ms), {level} in flight: {medians}")
    again = await drive(queries[:per_level], 1, ask_again)
    p50, p95, qps = again.row()
    print(f"cache hits ({hits} of {per_level} asked again, 1 in flight): p50 {p50:.2f} ms, p95 {p95:.2f} ms, "
          f"{qps:.0f} queries/s")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", type=Path, help="a BEIR-layout directory (corpus.jsonl, queries.jsonl, qrels/)")
    parser.add_argument("--split", default="test", help="the qrels split (only its file's presence is checked)")
    parser.add_argument("--sizes", default="1000,all", help="corpus sizes, comma-separated; 'all' is the whole")
    parser.add_argument("--concurrency", default="1,4,16", help="requests in flight, comma-separated")
    parser.add_argument("--queries", type=int, default=120, help="queries per concurrency level (distinct)")
    args = parser.parse_args()
    configure_logging("WARNING", "console")
    dataset = load_beir(args.dataset, args.split)
    sizes = [len(dataset.corpus) if s == "all" else min(int(s), len(dataset.corpus)) for s in args.sizes.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    with embedded_servers() as endpoints:
        asyncio.run(run(endpoints, dataset, sizes, levels, args.queries))


if __name__ == "__main__":
    main()
