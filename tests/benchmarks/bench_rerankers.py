"""What a `precision` request's reranker costs: each local reranker's call over a query's candidates, against the
query's own embedding by the project's embedder (MiniLM), the reference, in the same process and in turn.

For each of ``--queries`` queries of a BEIR set (seeded), the candidates are ``--depth`` documents of its corpus
(the judged ones first, then others drawn), cut as the pipeline cuts them for a reranker (``rerank_text``). Each
adapter is called through its ``rerank`` as the pipeline calls it; one warm-up call each is not counted.
Printed: p50 / p95 ms per call and the ratio of each p50 to the reference's.

Run: .venv/bin/python -m tests.benchmarks.bench_rerankers ../shared/eval/cosqa-dev --split dev
     [--queries 50] [--depth 20] [--models onnx,second-embedder] [--threads 0]
(the models come from the extra `rerank`)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Awaitable
from pathlib import Path

from ontofabric.services.ops.beir import document_text, load_beir
from ontofabric.services.ops.measures import percentile
from ontofabric.services.query.core import Reranker, StoredDocument
from ontofabric.services.query.rerankers import OnnxCrossEncoder, SecondEmbedder
from ontofabric.services.query.stages import rerank_text
from ontofabric.shared.embedder import load_embedder
from ontofabric.shared.onnx_models import BUNDLED_CROSS_ENCODER, BUNDLED_SECOND_EMBEDDER, bundled_model
from ontofabric.shared.settings import Settings


def _build(model: str, settings: Settings, threads: int) -> Reranker:
    bundled = BUNDLED_CROSS_ENCODER if model == "onnx" else BUNDLED_SECOND_EMBEDDER
    path = bundled_model(bundled)
    if path is None:
        raise SystemExit(f"{model}: install the extra `rerank`")
    if model == "onnx":
        return OnnxCrossEncoder(path, threads=threads)
    return SecondEmbedder(path, settings.second_embedder_weight, threads=threads)


async def _timed(call: Awaitable[object]) -> float:
    started = time.perf_counter()
    await call
    return (time.perf_counter() - started) * 1000


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", type=Path)
    parser.add_argument("--split", default="test")
    parser.add_argument("--queries", type=int, default=50)
    parser.add_argument("--depth", type=int, default=20)
    parser.add_argument("--models", default="onnx,second-embedder")
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime's threads (0: every core).")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    dataset = load_beir(args.dataset, args.split)
    rng = random.Random(args.seed)
    corpus = {entry["_id"]: entry for entry in dataset.corpus}
    ids = sorted(q for q in dataset.qrels if q in dataset.queries)
    work: list[tuple[str, list[str]]] = []
    for query_id in rng.sample(ids, min(args.queries, len(ids))):
        judged = [d for d in dataset.qrels[query_id] if d in corpus]
        others = [d for d in rng.sample(sorted(corpus), 2 * args.depth) if d not in judged]
        # The text a reranker reads of a stored document (``rerank_text``): here the document is all there is.
        texts = [rerank_text(_stored(corpus[d])) for d in (judged + others)[: args.depth]]
        work.append((dataset.queries[query_id], texts))

    settings = Settings()
    embedder = load_embedder(settings)
    rerankers = {name: _build(name, settings, args.threads) for name in args.models.split(",") if name}
    timings: dict[str, list[float]] = {"query embedding (reference)": [], **{name: [] for name in rerankers}}
    try:
        for call, (query, texts) in enumerate([work[0], *work]):
            reference = await _timed(asyncio.to_thread(embedder.embed_query, query))
            samples = {"query embedding (reference)": reference}
            for name, reranker in rerankers.items():
                samples[name] = await _timed(reranker.rerank(query, texts, len(texts)))
            if call:  # the first is a warm-up
                for name, ms in samples.items():
                    timings[name].append(ms)
    finally:
        for reranker in rerankers.values():
            await reranker.close()

    reference_p50 = statistics.median(timings["query embedding (reference)"])
    print(f"{dataset.name}: {len(work)} queries, {args.depth} candidates each, ONNX Runtime threads {args.threads}")
    print("| call | p50 ms | p95 ms | p50 against the reference |")
    print("|---|---|---|---|")
    for name, values in timings.items():
        p50 = statistics.median(values)
        print(f"| {name} | {p50:.1f} | {percentile(values, 0.95):.1f} | {p50 / reference_p50:.1f}x |")


def _stored(entry: dict[str, str]) -> StoredDocument:
    return StoredDocument(entry["_id"], document_text(entry), "Document", "eval", {})


if __name__ == "__main__":
    asyncio.run(main())
