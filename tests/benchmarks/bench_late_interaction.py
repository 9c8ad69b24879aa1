"""Benchmark of late interaction and of the embedder's precisions.

Late interaction from stored token signs (what the query worker does for the leading fused candidates: MaxSim
over the packed signs, blend) against encoding those candidates at query time, which is what late interaction cost
before the signs were stored. The embedder's pass over the same documents in float32 (the reference) and bfloat16.
Documents are pieces of this project's own source, ``--depth`` of them per call (ONTOFABRIC_LATE_INTERACTION_DEPTH
by default). Prints per-call p50/p95 and their ratio to the reference, and how closely MaxSim over the signs orders
the documents as MaxSim over float32 token vectors does (Spearman's rank correlation, and the same first document).

Run: .venv/bin/python -m tests.benchmarks.bench_late_interaction [--calls 30] [--depth N]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from ontofabric.services.demo import project_root
from ontofabric.services.ops.measures import percentile
from ontofabric.services.query.core import StoredDocument
from ontofabric.services.query.fusion import Fused
from ontofabric.services.query.stages import late_interaction
from ontofabric.shared.embedder import LocalSentenceTransformer, cpu_has_bfloat16
from ontofabric.shared.late_interaction import max_similarities, max_similarities_of_signs, pack_signs, unpack_signs
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


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation of two score lists (no ties expected among MaxSim floats)."""
    ranks_a, ranks_b = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ranks_a, ranks_b)[0, 1])


def main(calls: int, depth: int) -> None:
    settings = Settings()
    pieces = source_pieces(project_root())
    batches = [pieces[(n * depth) % (len(pieces) - depth) :][:depth] for n in range(calls)]
    embedders = {
        bfloat16: LocalSentenceTransformer(
            settings.embedding_model,
            settings.resolved_model_path(),
            settings.embedding_dim,
            bfloat16=bfloat16,
            windows=settings.embedding_windows,
        )
        for bfloat16 in (False, True)
    }
    full = embedders[False]
    _, piece_tokens = full.embed_with_tokens(sorted({p for b in batches for p in b}))
    stored = dict(zip(sorted({p for b in batches for p in b}), (pack_signs(t) for t in piece_tokens), strict=True))
    timings: dict[str, list[float]] = {
        "embedding, float32 (reference)": [],
        "embedding, bfloat16": [],
        "candidates encoded at query time, float32 (late interaction before)": [],
        "late interaction from stored signs": [],
        "one query embedded with its tokens, float32": [],
        "the same, right after the stage": [],
        "the same, right after MaxSim in numpy (how the stage computed it at first)": [],
    }
    correlations: list[float] = []
    same_first = 0
    for n, batch in enumerate(batches):
        # Interleaved, so noise on the machine hits each alike.
        for bfloat16, embedder in embedders.items():
            started = time.perf_counter()
            embedder.embed_documents(batch)
            timings[f"embedding, {'bfloat16' if bfloat16 else 'float32 (reference)'}"].append(
                (time.perf_counter() - started) * 1000
            )
        started = time.perf_counter()
        _, query_tokens = full.embed_with_tokens([QUERIES[n % len(QUERIES)]])
        timings["one query embedded with its tokens, float32"].append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        _, batch_tokens = full.embed_with_tokens(batch)
        floats = max_similarities(query_tokens[0], batch_tokens)
        timings["candidates encoded at query time, float32 (late interaction before)"].append(
            (time.perf_counter() - started) * 1000
        )
        candidates = [Fused(str(i), 1.0, 1.0) for i in range(len(batch))]
        documents = {str(i): StoredDocument(str(i), p, "t", "bench", {}, stored[p]) for i, p in enumerate(batch)}
        started = time.perf_counter()
        late_interaction(query_tokens[0], candidates, documents, 1.0, depth)
        timings["late interaction from stored signs"].append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        full.embed_with_tokens([QUERIES[n % len(QUERIES)]])
        timings["the same, right after the stage"].append((time.perf_counter() - started) * 1000)
        # numpy's BLAS threads spin on after a product, and the model's threads then wait for the cores.
        [(query_tokens[0] @ unpack_signs(stored[p], full.dimension).T).max(axis=1).mean() for p in batch]
        started = time.perf_counter()
        full.embed_with_tokens([QUERIES[n % len(QUERIES)]])
        timings["the same, right after MaxSim in numpy (how the stage computed it at first)"].append(
            (time.perf_counter() - started) * 1000
        )
        signs = max_similarities_of_signs(query_tokens[0], [stored[p] for p in batch], full.dimension)
        correlations.append(spearman(floats, signs))
        same_first += int(np.argmax(floats)) == int(np.argmax(signs))
    reference = percentile(timings["embedding, float32 (reference)"], 0.5)
    print(f"{calls} calls of {depth} documents; CPU has native bfloat16: {cpu_has_bfloat16()}")
    print("| measure | p50 ms | p95 ms | p50 / reference |")
    print("|---|---|---|---|")
    for name, values in timings.items():
        p50, p95 = percentile(values, 0.5), percentile(values, 0.95)
        print(f"| {name} | {p50:.2f} | {p95:.2f} | {p50 / reference:.3f} |")
    print(
        f"MaxSim over the signs against MaxSim over float32 token vectors: Spearman p50 "
        f"{percentile(correlations, 0.5):.3f}, min {min(correlations):.3f}; same first document in "
        f"{same_first}/{calls} calls"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--depth", type=int, default=Settings().late_interaction_depth)
    args = parser.parse_args()
    if args.calls < 1 or args.depth < 2:
        parser.error("--calls must be at least 1 and --depth at least 2")
    configure_logging("WARNING", "console")
    main(args.calls, args.depth)
