"""What the scale benchmark's reference finds (issue #23): pgvector-python's single-SQL RRF recipe (dense top 50 and
``ts_rank_cd`` over ``plainto_tsquery`` top 50, k 60, the same statement ``bench_scale`` times) against
ontofabric's configurations, over the same rows of one evaluation set, loaded through the real path, in one run.

For each: nDCG@10, Recall@10 and MRR@10, the nDCG@10 difference from the recipe query by query with its paired
bootstrap 95 % interval, and the p50 latency at one request in flight (the recipe's query embedded in this process
by the same model; ontofabric's over NATS to its query worker, cache off). The scale benchmark says how much faster
the recipe answers; this says what it answers.

Run: .venv/bin/python -m tests.benchmarks.bench_recipe_quality ../shared/eval/cosqa-dev --split dev
     [--config hybrid,hybrid-fusion-only,dense,keyword] [--sample-queries N]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

import asyncpg
from pgvector.asyncpg import register_vector
from rich.console import Console

from ontofabric.services.app import Roles, start_workers
from ontofabric.services.ops.beir import BeirDataset, load_beir, sample_dataset
from ontofabric.services.ops.evaluation import CONFIGS, Evaluation
from ontofabric.services.ops.measures import compute_metrics, margin, per_query_ndcg, percentile
from ontofabric.services.query.client import QueryClient
from ontofabric.services.render import RichProgress
from ontofabric.shared.embedder import Embedder
from ontofabric.shared.embedding_cache import EmbeddingCache
from ontofabric.shared.jetstream import connect
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import EmbeddedRuntime, Endpoints
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names

from .bench_query_load import RRF_RECIPE, recipe_index

RECIPE = "recipe"
MEASURED = ("nDCG@10", "Recall@10", "MRR@10")


async def recipe_run(
    pool: asyncpg.Pool, embedder: Embedder, dataset: BeirDataset, workspace: str, text_search_config: str
) -> tuple[dict[str, dict[str, float]], list[float]]:
    """The recipe's top 10 for every judged query (a result with the query's own id dropped, as BEIR does), and
    each query's time: its embedding, then the statement."""
    run: dict[str, dict[str, float]] = {}
    latencies: list[float] = []
    for query_id in (q for q in dataset.qrels if q in dataset.queries):
        text = dataset.queries[query_id]
        started = time.perf_counter()
        vector = await embedder.on_model_thread(functools.partial(embedder.embed_query, text))
        rows = await pool.fetch(RRF_RECIPE, workspace, vector, text, text_search_config)
        latencies.append((time.perf_counter() - started) * 1000)
        hits = [row["id"] for row in rows if row["id"] != query_id]
        run[query_id] = {doc: float(len(hits) - n) for n, doc in enumerate(hits)}
    return run, latencies


async def measure(endpoints: Endpoints, dataset: BeirDataset, configs: list[str]) -> None:
    settings = Settings(
        nats_url=endpoints.nats_url_as("operator"),
        database_url=endpoints.database_url,
        query_cache_entries=0,
        max_query_chars=100_000,
    )
    names = Names(settings.subject_prefix)
    async with AsyncExitStack() as stack:
        progress = stack.enter_context(RichProgress(Console()))
        embedder = await start_workers(stack, settings, endpoints, Roles(azure_projector=False))
        assert embedder is not None, "the recipe needs the query embedder"
        nc = await connect(endpoints.nats_url_as("operator"), "bench-recipe-quality", settings)
        stack.push_async_callback(nc.close)
        cache = EmbeddingCache(settings.cache_dir / "embeddings.sqlite")
        stack.callback(cache.close)
        evaluation = Evaluation(
            nc.jetstream(), QueryClient(nc, names, timeout_s=60), names, embedder, cache, progress,
            settings.token_vectors,
        )  # fmt: skip
        workspace, refused = await evaluation.load(dataset)
        pool = await asyncpg.create_pool(
            endpoints.database_url, min_size=1, max_size=2, init=register_vector,
            server_settings={"hnsw.ef_search": str(settings.hnsw_ef_search)},
        )  # fmt: skip
        stack.push_async_callback(pool.close)
        runs: dict[str, dict[str, dict[str, float]]] = {}
        latencies: dict[str, list[float]] = {}
        async with recipe_index(pool):
            runs[RECIPE], latencies[RECIPE] = await recipe_run(
                pool, embedder, dataset, workspace, settings.text_search_config
            )
        for config in configs:
            result, runs[config] = await evaluation.run(dataset, workspace, config)
            latencies[config] = [result.latency_p50_ms]
    judged = {q: dataset.qrels[q] for q in dataset.qrels if q in dataset.queries}
    ndcg = {name: per_query_ndcg(judged, run) for name, run in runs.items()}
    print(f"{dataset.name} ({dataset.split}): {len(dataset.corpus)} documents ({len(refused)} refused), "
          f"{len(judged)} judged queries")  # fmt: skip
    print("| | nDCG@10 | Recall@10 | MRR@10 | nDCG@10 against the recipe (95 % interval) | won / lost | p50 ms |")
    print("|---|---|---|---|---|---|---|")
    for name, run in runs.items():
        metrics = compute_metrics(judged, run)
        figures = " | ".join(f"{metrics[m]:.4f}" for m in MEASURED)
        p50 = percentile(latencies[name], 0.5)
        against = margin(name, RECIPE, ndcg[name], ndcg[RECIPE]) if name != RECIPE else None
        if against is None:
            print(f"| {name} | {figures} | | | {p50:.1f} |")
            continue
        interval = f"{against.difference:+.4f} ({against.ci_low:+.4f} … {against.ci_high:+.4f})"
        print(f"| {name} | {figures} | {interval} | {against.better} / {against.worse} | {p50:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", type=Path, help="a BEIR-layout evaluation set")
    parser.add_argument("--split", default="test", help="judgments to use: qrels/SPLIT.tsv")
    parser.add_argument("--config", default="hybrid,hybrid-fusion-only,dense,keyword", help="ontofabric's, as eval's")
    parser.add_argument("--sample-queries", type=int, help="this many judged queries (and 2,000 documents)")
    args = parser.parse_args()
    configs = args.config.split(",")
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configuration {', '.join(unknown)}; one of {', '.join(CONFIGS)}")
    dataset = load_beir(args.dataset, args.split)
    if args.sample_queries:
        dataset = sample_dataset(dataset, args.sample_queries, 2000)
    configure_logging("WARNING", "console")
    with (
        tempfile.TemporaryDirectory(prefix="bench-recipe-quality-") as scratch,
        EmbeddedRuntime(Settings(), Path(scratch) / "data") as runtime,
    ):
        assert runtime.endpoints is not None
        asyncio.run(measure(runtime.endpoints, dataset, configs))


if __name__ == "__main__":
    main()
