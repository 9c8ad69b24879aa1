"""Benchmark of MaxSim over packed sign bits: the lookup the query worker uses against unpacking and multiplying.

Late interaction scores each leading fused candidate by MaxSim between the query's token vectors and the
candidate's stored token signs (``shared/late_interaction.py``). ``max_similarities_of_signs`` sums each token's
q·bits from a table of what every value of every byte adds; the reference is how it computed them before: every
candidate's bits unpacked into a float matrix, one product. Both run on one torch thread, as on the worker's model
thread, alternately call by call, over real token signs (documents of the evaluation sets, embedded here) and real
queries of the same sets, ``--depth`` candidates per call (ONTOFABRIC_LATE_INTERACTION_DEPTH by default). Prints
p50/p95 per call, the ratio to the reference, the largest difference between the two scores and how often the two
order a call's candidates alike.

Run: .venv/bin/python -m tests.benchmarks.bench_sign_lookup ../shared/eval/cosqa-dev [../shared/eval/scifact-train]
     [--documents 300] [--calls 200] [--depth N]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ontofabric.services.ops.measures import percentile
from ontofabric.shared.embedder import LocalSentenceTransformer
from ontofabric.shared.late_interaction import TokenMatrix, max_similarities_of_signs, pack_signs, token_count
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.settings import Settings


def unpacked_and_multiplied(query_tokens: TokenMatrix, documents: Sequence[bytes], dimension: int) -> list[float]:
    """The reference: MaxSim over sign bits unpacked into a float matrix and multiplied by the query's tokens."""
    counts = [token_count(data, dimension) for data in documents]
    rows = np.frombuffer(b"".join(documents), dtype=np.uint8).reshape(sum(counts), -1)
    bits = torch.from_numpy(np.unpackbits(rows, axis=1, count=dimension)).to(torch.float32)
    query = torch.from_numpy(np.ascontiguousarray(query_tokens, dtype=np.float32))
    on_bits = query @ bits.T
    best = torch.stack([part.max(dim=1).values for part in torch.split(on_bits, counts, dim=1)], dim=1)
    cosines = (2 * best - query.sum(dim=1, keepdim=True)) / math.sqrt(dimension)
    return [float(value) for value in cosines.mean(dim=0)]


def read_texts(dataset: Path, name: str, field: str) -> list[str]:
    with (dataset / name).open(encoding="utf-8") as lines:
        return [json.loads(line)[field] for line in lines]


def main(datasets: list[Path], documents: int, calls: int, depth: int) -> None:
    torch.set_num_threads(1)
    settings = Settings()
    embedder = LocalSentenceTransformer(
        settings.embedding_model, settings.resolved_model_path(), settings.embedding_dim, windows=1
    )
    rng = random.Random(7)
    corpus = [text for d in datasets for text in read_texts(d, "corpus.jsonl", "text")]
    queries = [text for d in datasets for text in read_texts(d, "queries.jsonl", "text")]
    chosen = rng.sample(corpus, min(documents, len(corpus)))
    started = time.perf_counter()
    _, tokens = embedder.embed_with_tokens(chosen)
    signs = [pack_signs(t) for t in tokens]
    print(f"{len(signs)} documents embedded in {time.perf_counter() - started:.1f} s")
    timings: dict[str, list[float]] = {"unpacked and multiplied (reference)": [], "lookup (the worker's)": []}
    largest, same_order = 0.0, 0
    for n in range(calls):
        _, query_tokens = embedder.embed_with_tokens([rng.choice(queries)])
        batch = rng.sample(signs, depth)
        results: dict[str, list[float]] = {}
        order = list(timings) if n % 2 == 0 else list(reversed(timings))
        for name in order:
            function = unpacked_and_multiplied if name.startswith("unpacked") else max_similarities_of_signs
            started = time.perf_counter()
            results[name] = function(query_tokens[0], batch, embedder.dimension)
            timings[name].append((time.perf_counter() - started) * 1000)
        reference, lookup = results.values()
        largest = max(largest, max(abs(a - b) for a, b in zip(reference, lookup, strict=True)))
        same_order += list(np.argsort(reference, kind="stable")) == list(np.argsort(lookup, kind="stable"))
    reference_p50 = percentile(timings["unpacked and multiplied (reference)"], 0.5)
    print(f"{calls} calls of {depth} candidates, one torch thread")
    print("| MaxSim over sign bits | p50 ms | p95 ms | p50 / reference |")
    print("|---|---|---|---|")
    for name, values in timings.items():
        p50, p95 = percentile(values, 0.5), percentile(values, 0.95)
        print(f"| {name} | {p50:.3f} | {p95:.3f} | {p50 / reference_p50:.2f} |")
    print(f"largest difference between the two scores: {largest:.2e}")
    print(f"calls whose candidates the two order alike: {same_order}/{calls}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("datasets", type=Path, nargs="+", help="BEIR-layout directories (corpus.jsonl, queries.jsonl)")
    parser.add_argument("--documents", type=int, default=300, help="documents embedded for their token signs")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--depth", type=int, default=Settings().late_interaction_depth)
    args = parser.parse_args()
    if args.calls < 1 or args.depth < 2 or args.documents < args.depth:
        parser.error("--calls must be at least 1, --depth at least 2 and --documents at least --depth")
    configure_logging("WARNING", "console")
    main(args.datasets, args.documents, args.calls, args.depth)
