"""Benchmark of nested chunks in answers over a code repository: how often a top-10 answer holds a chunk together with
a chunk nested in it for the same symbol (a class and its method, a function and its docstring), with collapsing
off and on.

A source tree (default: this project's own) is ingested by the reference ingester on the embedded servers; the
queries are its docstrings' first sentences and its method names split into words (as in bench_spine). Each query
is asked with `options.collapseNested` false and with the default, cache off, topK 10. Printed per setting: queries
with at least one nested pair in their top 10, nested chunks per query (mean, with a 95 % bootstrap interval), and
the files the top 10 covers; and the p50 latency of each, beside each other.

Run: .venv/bin/python -m tests.benchmarks.bench_nested [--tree PATH] [--queries 300]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from contextlib import AsyncExitStack
from pathlib import Path

import numpy as np

from ontofabric.contracts import QueryResponse, SearchResult
from ontofabric.services.demo import project_root
from ontofabric.services.ingest.chunking import chunk_file
from ontofabric.services.ingest.ingester import discover
from ontofabric.services.ops.measures import percentile
from ontofabric.services.query.client import QueryClient
from ontofabric.services.query.core import StoredDocument
from ontofabric.services.query.stages import nested
from ontofabric.shared.jetstream import wait_caught_up
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import Endpoints, embedded_servers
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names

from .bench_spine import queries_from, serve_for_ingest

WORKSPACE = "bench"


def nested_count(results: list[SearchResult]) -> int:
    """Results nested in (or holding) a better-ranked result of the same answer."""
    chunks = [StoredDocument(r.id, "", r.object_type, r.source_domain, r.metadata) for r in results]
    return sum(any(nested(chunk, earlier) for earlier in chunks[:n]) for n, chunk in enumerate(chunks))


def mean_interval(values: list[int], resamples: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    data = np.array(values, dtype=float)
    drawn = np.random.default_rng(seed).integers(0, len(data), (resamples, len(data)))
    low, high = np.percentile(data[drawn].mean(axis=1), [2.5, 97.5])
    return float(data.mean()), float(low), float(high)


async def run(endpoints: Endpoints, settings: Settings, tree: Path, query_count: int) -> None:
    names = Names(settings.subject_prefix)
    async with AsyncExitStack() as stack:
        served = await serve_for_ingest(stack, settings, endpoints)
        nc, js = served.nc, served.js
        report = await served.ingester.ingest(tree, WORKSPACE)
        assert report.last_sequence is not None
        await wait_caught_up(js, names.delta_stream, names.postgres_projector_durable, report.last_sequence, 1800)
        await asyncio.sleep(0.5)  # the query worker's KV watch catches up
        chunks = [
            chunk
            for path in discover(tree)
            for chunk in chunk_file(str(path.relative_to(tree)), path.read_text(errors="replace"), 1 << 20)
        ]
        texts = queries_from(chunks, query_count)
        print(f"tree {tree}: {len(chunks)} chunks; {len(texts)} queries, topK 10, cache off")
        client = QueryClient(nc, names, timeout_s=60)
        print(
            "| collapseNested | queries with a nested pair | nested chunks per query (95 % interval) "
            "| files in top 10 | answers short of 10 | answers filled | p50 ms |"
        )
        print("|---|---|---|---|---|---|---|")
        for collapse in (False, True):
            counts, files, latencies, short, filled = [], [], [], 0, 0
            for text in texts:
                request = {"semanticQuery": text, "topK": 10, "precision": False}
                if not collapse:
                    request["options"] = {"collapseNested": False}
                started = time.perf_counter()
                reply = await client.query(WORKSPACE, request)
                latencies.append((time.perf_counter() - started) * 1000)
                assert isinstance(reply, QueryResponse), reply
                counts.append(nested_count(reply.results))
                files.append(len({r.metadata.get("filePath") for r in reply.results}))
                short += len(reply.results) < 10
                filled += "refill" in reply.meta.timings_ms  # collapsing left it short: later candidates read
            mean, low, high = mean_interval(counts)
            with_pair = sum(1 for c in counts if c)
            share = 100 * with_pair / len(counts)
            print(
                f"| {str(collapse).lower()} | {with_pair} of {len(counts)} ({share:.1f} %) | {mean:.2f} "
                f"({low:.2f}-{high:.2f}) | {sum(files) / len(files):.2f} | {short} | {filled} "
                f"| {percentile(latencies, 0.5):.1f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=None, help="source tree to ingest (default: this project's)")
    parser.add_argument("--queries", type=int, default=300, help="queries asked with each setting")
    args = parser.parse_args()
    configure_logging("WARNING", "console")
    with embedded_servers() as endpoints:
        settings = Settings(
            nats_url=endpoints.nats_url_as("operator"),
            database_url=endpoints.database_url,
            query_cache_entries=0,
        )
        tree = (args.tree or project_root()).resolve()
        asyncio.run(run(endpoints, settings, tree, args.queries))


if __name__ == "__main__":
    main()
