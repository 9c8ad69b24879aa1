"""Benchmark of embedding long texts in windows (ONTOFABRIC_EMBEDDING_WINDOWS) against reading only the first.

Batches of pieces of this project's own source, at several lengths from one that fits the model's 256 tokens to
ones that need eight windows, each embedded by the same model reading only the first window (the reference, what
sentence-transformers does) and reading up to ``--windows`` windows, interleaved so noise on the machine hits
each alike. Prints per-batch p50/p95 and the ratio to the reference at each length: what a long document costs
an ingester (a query is read the same way, so only a query longer than a window costs more).

Run: .venv/bin/python -m tests.benchmarks.bench_windows [--calls 10] [--batch 16] [--windows 4]
"""

from __future__ import annotations

import argparse
import time

from ontofabric.services.demo import project_root
from ontofabric.services.ops.measures import percentile
from ontofabric.shared.embedder import LocalSentenceTransformer
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.settings import Settings

from .bench_late_interaction import source_pieces

# Characters per piece: about 0.5, 1, 2, 4 and 8 windows of 256 tokens of Python source.
LENGTHS = (600, 1200, 2400, 4800, 9600)


def main(calls: int, batch: int, windows: int) -> None:
    settings = Settings()
    model = (settings.embedding_model, settings.resolved_model_path(), settings.embedding_dim)
    first_only = LocalSentenceTransformer(*model, windows=1)
    windowed = LocalSentenceTransformer(*model, windows=windows)
    tokenizer = windowed._model.tokenizer
    print(f"{calls} calls of {batch} pieces per length; up to {windows} windows of {windowed._model.max_seq_length}")
    print("| characters a piece | tokens a piece (p50) | first window only, p50 ms (reference) | p95 ms "
          f"| {windows} windows, p50 ms | p95 ms | p50 / reference |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for length in LENGTHS:
        pieces = source_pieces(project_root(), length)
        batches = [pieces[(n * batch) % (len(pieces) - batch) :][:batch] for n in range(calls)]
        tokens = [len(tokenizer(p, add_special_tokens=False, verbose=False)["input_ids"]) for b in batches for p in b]
        timings: dict[str, list[float]] = {"first": [], "windows": []}
        for texts in batches:
            for name, embedder in (("first", first_only), ("windows", windowed)):
                started = time.perf_counter()
                embedder.embed_documents(texts)
                timings[name].append((time.perf_counter() - started) * 1000)
        reference = percentile(timings["first"], 0.5)
        first, read = timings["first"], timings["windows"]
        print(
            f"| {length} | {percentile([float(t) for t in tokens], 0.5):.0f} | {reference:.1f} | "
            f"{percentile(first, 0.95):.1f} | {percentile(read, 0.5):.1f} | {percentile(read, 0.95):.1f} | "
            f"{percentile(read, 0.5) / reference:.2f} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--windows", type=int, default=Settings().embedding_windows)
    args = parser.parse_args()
    if args.calls < 1 or args.batch < 1 or args.windows < 2:
        parser.error("--calls and --batch must be at least 1, --windows at least 2")
    configure_logging("WARNING", "console")
    main(args.calls, args.batch, args.windows)
