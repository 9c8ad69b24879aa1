"""What second vectors cost, against the project's embedder (MiniLM) in the same process and in turn:

- at ingest: documents/s of the second model (``ONTOFABRIC_SECOND_VECTORS_MODEL_PATH``, by default bge-small from
  the extra `rerank`) against MiniLM's, over the same ``--documents`` texts of a BEIR set, each on every core;
- per query: the query's second vector (one thread, as the query worker makes it) against the query's MiniLM
  embedding with its tokens (the query worker's own call, on its model thread).

One warm-up call each is not counted. Printed: documents/s and their ratio; p50 / p95 ms per query and the ratio
of the p50s.

Run: .venv/bin/python -m tests.benchmarks.bench_second_vectors ../shared/eval/cosqa-dev --split dev
     [--documents 512] [--queries 100]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from ontofabric.services.ops.beir import document_text, load_beir
from ontofabric.services.ops.measures import percentile
from ontofabric.shared.embedder import load_embedder
from ontofabric.shared.onnx_models import second_embedder
from ontofabric.shared.settings import Settings


def _seconds(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", type=Path)
    parser.add_argument("--split", default="test")
    parser.add_argument("--documents", type=int, default=512)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    dataset = load_beir(args.dataset, args.split)
    rng = random.Random(args.seed)
    texts = [document_text(d) for d in rng.sample(dataset.corpus, min(args.documents, len(dataset.corpus)))]
    queries = rng.sample(sorted(dataset.queries.values()), min(args.queries, len(dataset.queries)))

    settings = Settings(second_vectors=True)
    embedder = load_embedder(settings)
    documents_model = second_embedder(settings)
    query_model = second_embedder(settings, threads=1)
    if documents_model is None or query_model is None:
        raise SystemExit("no second model: install the extra `rerank` or set ONTOFABRIC_SECOND_VECTORS_MODEL_PATH")

    embedder.embed_documents(texts[:8])
    documents_model.embed(texts[:8])
    reference_s = _seconds(lambda: embedder.embed_documents(texts))
    second_s = _seconds(lambda: documents_model.embed(texts))
    print(f"{len(texts)} documents of {dataset.name}")
    print(f"  MiniLM (reference)        {len(texts) / reference_s:8.1f} documents/s")
    print(f"  {documents_model.name:<25} {len(texts) / second_s:8.1f} documents/s  ({reference_s / second_s:.2f}×)")

    await embedder.embed_query_with_tokens_async(queries[0])
    query_model.embed([queries[0]])
    timings: dict[str, list[float]] = {"query embedding (reference)": [], "second vector": []}
    for text in queries:  # in turn, so both see the same machine
        started = time.perf_counter()
        await embedder.embed_query_with_tokens_async(text)
        timings["query embedding (reference)"].append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        await asyncio.to_thread(query_model.embed, [text])
        timings["second vector"].append((time.perf_counter() - started) * 1000)
    reference = statistics.median(timings["query embedding (reference)"])
    print(f"{len(queries)} queries")
    for name, values in timings.items():
        p50 = statistics.median(values)
        print(f"  {name:<28} p50 {p50:7.1f} ms  p95 {percentile(values, 0.95):7.1f} ms  ({p50 / reference:.2f}×)")


if __name__ == "__main__":
    asyncio.run(main())
