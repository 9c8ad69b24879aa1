"""Benchmark of the local models in float32 and bfloat16: the late-interaction reranker's call over the candidates
a query sends it, and the embedder's pass over the same documents, against embedding them in float32 (the
reference: what ingest paid before bfloat16).

Documents are pieces of this project's own source; every call sends ``--depth`` of them (the deployment's
ONTOFABRIC_RERANKER_DEPTH by default). Prints per-call p50/p95 for each precision, their ratio to the reference,
and how often the two precisions order the documents alike by MaxSim alone.

Run: .venv/bin/python -m tests.benchmarks.bench_rerank [--calls 30] [--depth N]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from ontofabric.services.demo import project_root
from ontofabric.services.ops.evaluation import percentile
from ontofabric.services.query.rerankers import LateInteraction
from ontofabric.shared.embedder import LocalSentenceTransformer, cpu_has_bfloat16
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.settings import Settings

QUERIES = [
    "start an embedded postgres server",
    "how are deltas dead-lettered when malformed",
    "fuse dense and keyword candidates",
    "invalidate the cache when the ontology version moves",
    "parse a python file into chunks",
]


def source_pieces(root: Path, size: int = 1500) -> list[str]:
    """The project's Python source cut into pieces of about ``size`` characters: long enough to fill 256 tokens."""
    pieces: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if ".venv" in path.parts:
            continue
        text = path.read_text(encoding="utf-8")
        pieces += [text[i : i + size] for i in range(0, len(text), size) if len(text[i : i + size]) > size // 2]
    return pieces


async def main(calls: int, depth: int) -> None:
    settings = Settings()
    pieces = source_pieces(project_root())
    batches = [pieces[(n * depth) % (len(pieces) - depth) :][:depth] for n in range(calls)]
    embedders = {
        bfloat16: LocalSentenceTransformer(
            settings.embedding_model, settings.resolved_model_path(), settings.embedding_dim, bfloat16=bfloat16
        )
        for bfloat16 in (False, True)
    }
    # Weight 1: the orders compared below are MaxSim's alone, not diluted by the fused-position prior (the time
    # does not depend on the weight).
    rerankers = {
        "float32": LateInteraction(settings.resolved_model_path(), weight=1.0, bfloat16=False),
        "bfloat16": LateInteraction(settings.resolved_model_path(), weight=1.0, bfloat16=True),
    }
    timings: dict[str, list[float]] = {"embedding, float32 (reference)": [], "embedding, bfloat16": []}
    timings |= {f"late-interaction reranker, {name}": [] for name in rerankers}
    timings |= {"one query embedded, float32": [], "one query embedded, bfloat16": []}
    orders: dict[str, list[list[int]]] = {name: [] for name in rerankers}
    for n, batch in enumerate(batches):
        query = QUERIES[n % len(QUERIES)]
        # Interleaved, so noise on the machine hits each alike.
        for bfloat16, embedder in embedders.items():
            started = time.perf_counter()
            embedder.embed_documents(batch)
            timings[f"embedding, {'bfloat16' if bfloat16 else 'float32 (reference)'}"].append(
                (time.perf_counter() - started) * 1000
            )
        for name, reranker in rerankers.items():
            started = time.perf_counter()
            ranking = await reranker.rerank(query, batch, len(batch))
            timings[f"late-interaction reranker, {name}"].append((time.perf_counter() - started) * 1000)
            orders[name].append([i for i, _ in ranking])
    for reranker in rerankers.values():
        await reranker.close()
    for _ in range(20):  # one query at a time, as the query worker embeds them
        for query in QUERIES:
            for bfloat16, embedder in embedders.items():
                started = time.perf_counter()
                embedder.embed_query(query)
                timings[f"one query embedded, {'bfloat16' if bfloat16 else 'float32'}"].append(
                    (time.perf_counter() - started) * 1000
                )
    reference = percentile(timings["embedding, float32 (reference)"], 0.5)
    print(f"{calls} calls of {depth} documents; CPU has native bfloat16: {cpu_has_bfloat16()}")
    print("| measure | p50 ms | p95 ms | p50 / reference |")
    print("|---|---|---|---|")
    for name, values in timings.items():
        p50, p95 = percentile(values, 0.5), percentile(values, 0.95)
        print(f"| {name} | {p50:.1f} | {p95:.1f} | {p50 / reference:.2f} |")
    alike = sum(a == b for a, b in zip(orders["float32"], orders["bfloat16"], strict=True))
    top_alike = sum(a[:10] == b[:10] for a, b in zip(orders["float32"], orders["bfloat16"], strict=True))
    print(
        f"by MaxSim alone, bfloat16 orders alike float32: {alike}/{calls} calls in full, "
        f"{top_alike}/{calls} in the first ten"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--depth", type=int, default=Settings().reranker_depth)
    args = parser.parse_args()
    if args.calls < 1 or args.depth < 2:
        parser.error("--calls must be at least 1 and --depth at least 2")
    configure_logging("WARNING", "console")
    asyncio.run(main(args.calls, args.depth))
