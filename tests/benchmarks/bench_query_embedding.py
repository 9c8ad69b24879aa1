"""What a query's embedding costs on ONNX Runtime against PyTorch, in the same process, query by query in turn.

Two embedders of the same model as the query worker loads it (one CPU thread for queries), one with
``query_embedding_runtime=torch``, one with ``onnx``. Each query is embedded with its token vectors, the query
worker's own call on each embedder's model thread: alone (one request in flight), then in batches of ``--batch``
(what the worker's coalescer hands the model when requests queue). One warm-up call each is not counted. Printed:
p50 / p95 ms per query and per batch, the ratio of the p50s, and how far the two runtimes' vectors and token rows
are apart (largest 1 − cosine over every query).

Run: .venv/bin/python -m tests.benchmarks.bench_query_embedding ../shared/eval/cosqa-dev --split dev
     [--queries 200] [--batch 8]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

from ontofabric.services.ops.beir import load_beir
from ontofabric.services.ops.measures import percentile
from ontofabric.shared.embedder import LocalSentenceTransformer, load_embedder
from ontofabric.shared.settings import Settings


async def _ms(work: Callable[[], Awaitable[object]]) -> float:
    started = time.perf_counter()
    await work()
    return (time.perf_counter() - started) * 1000


def _row(name: str, torch_ms: list[float], onnx_ms: list[float]) -> str:
    t50, o50 = percentile(torch_ms, 0.5), percentile(onnx_ms, 0.5)
    return (
        f"| {name} | {t50:.2f} | {percentile(torch_ms, 0.95):.2f} | {o50:.2f} | {percentile(onnx_ms, 0.95):.2f} "
        f"| {o50 / t50:.2f} |"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", type=Path)
    parser.add_argument("--split", default="test")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    dataset = load_beir(args.dataset, args.split)
    queries = random.Random(args.seed).sample(sorted(dataset.queries.values()), min(args.queries, len(dataset.queries)))
    runtimes: dict[str, LocalSentenceTransformer] = {
        name: load_embedder(Settings(query_embedding_runtime=name)) for name in ("torch", "onnx")
    }
    if runtimes["onnx"].query_runtime != "onnx":
        raise SystemExit("the ONNX export could not be made or did not agree: see the log above")

    def on_thread(embedder: LocalSentenceTransformer, texts: list[str]) -> Callable[[], Awaitable[object]]:
        return lambda: embedder.on_model_thread(lambda: embedder._embed_queries(texts))

    for embedder in runtimes.values():
        await on_thread(embedder, queries[:1])()
    alone: dict[str, list[float]] = {name: [] for name in runtimes}
    batched: dict[str, list[float]] = {name: [] for name in runtimes}
    gap = 0.0
    for query in queries:
        for name, embedder in runtimes.items():
            alone[name].append(await _ms(on_thread(embedder, [query])))
        (tv, tt), (ov, ot) = (runtimes[name]._embed_queries([query])[0] for name in ("torch", "onnx"))
        gap = max(gap, 1 - float(tv @ ov), float(np.max(1 - np.sum(tt * ot, axis=1))))
    for start in range(0, len(queries) - args.batch + 1, args.batch):
        for name, embedder in runtimes.items():
            batched[name].append(await _ms(on_thread(embedder, queries[start : start + args.batch])))

    print("| call | PyTorch p50 ms | p95 | ONNX Runtime p50 ms | p95 | p50 ratio |")
    print("|---|---|---|---|---|---|")
    print(_row("one query", alone["torch"], alone["onnx"]))
    print(_row(f"a batch of {args.batch}", batched["torch"], batched["onnx"]))
    print(f"largest 1 - cosine between the runtimes' vectors and token rows, over {len(queries)} queries: {gap:.1e}")


if __name__ == "__main__":
    asyncio.run(main())
