"""Benchmark of ingest embedding: chunks a second, in one process, against the way the ingester embedded before.

The same texts (this project's own source as the ingester chunks it, or a BEIR corpus's documents) embedded with
their token signs, as an ingest does, in calls of the ingester's batch, three ways, round after round so noise on
the machine hits each alike:

- the reference: float32, the texts in the order they come (file order), what the ingester did until 2026-11-30;
- float32, longest first (what the ingester and the embedding cache do now): the same vectors, less padding;
- bfloat16, longest first: what `ONTOFABRIC_EMBEDDING_PRECISION=auto` gives on a CPU with native bfloat16;
- float32 on ONNX Runtime, longest first: the model's export, as an ingest runs it where it finds one checked
  (`ONTOFABRIC_DOCUMENT_EMBEDDING_RUNTIME=onnx`, the default).

Prints chunks a second per way and round, the ratio to the reference's round, and each way's vectors against the
reference's (cosine: mean, 1st percentile, lowest). Then, with --startup N, the seconds from a new process's start
to its first vectors of one short text, as an ingest loads the model on demand, on PyTorch and on ONNX Runtime in
turn, N rounds.

Run: .venv/bin/python -m tests.benchmarks.bench_ingest_embedding [BEIR_DIR ...] [--texts 1500] [--rounds 3]
     [--startup 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from ontofabric.services.demo import project_root
from ontofabric.services.ingest.ingester import EMBED_BATCH, chunk_sources, read_tree
from ontofabric.services.ops.beir import document_text, load_beir
from ontofabric.services.ops.measures import percentile
from ontofabric.shared.embedder import Embedder, LoadedOnDemand, LocalSentenceTransformer, cpu_has_bfloat16
from ontofabric.shared.embedding_cache import embed_with_signs, longest_first
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.settings import Settings


def corpus_texts(source: Path | None, limit: int) -> tuple[str, list[str]]:
    """The first ``limit`` texts an ingest of ``source`` would embed (None: this project's own tree)."""
    if source is None:
        root = project_root()
        chunks = chunk_sources(root, read_tree(root), Settings().max_content_bytes)
        return "this project's source", [c.embedding_text for c in chunks][:limit]
    dataset = load_beir(source, next(p.stem for p in sorted((source / "qrels").glob("*.tsv"))))
    return dataset.name, [document_text(d) for d in dataset.corpus[:limit]]


def embed_in_order(
    embedder: Embedder, texts: Sequence[str], order: Sequence[int]
) -> tuple[float, npt.NDArray[np.float32]]:
    """Seconds to embed ``texts`` in ``order``, in calls of the ingester's batch; the vectors in the texts' order."""
    vectors = np.zeros((len(texts), embedder.dimension), np.float32)
    started = time.perf_counter()
    for start in range(0, len(order), EMBED_BATCH):
        indexes = list(order[start : start + EMBED_BATCH])
        vectors[indexes] = embed_with_signs(embedder, [texts[i] for i in indexes]).vectors
    return time.perf_counter() - started, vectors


def main(sources: list[Path | None], limit: int, rounds: int) -> None:
    settings = Settings()
    model = (settings.embedding_model, settings.resolved_model_path(), settings.embedding_dim)
    # Made with its queries on ONNX Runtime, so that the export and PyTorch's reference are in the cache.
    full = LocalSentenceTransformer(
        *model, windows=settings.embedding_windows, query_runtime="onnx", cache_dir=settings.cache_dir
    )
    half = LocalSentenceTransformer(*model, bfloat16=True, windows=settings.embedding_windows)
    exported = LoadedOnDemand(settings.model_copy(update={"document_embedding_runtime": "onnx"}))
    print(f"native bfloat16 on this CPU: {cpu_has_bfloat16()}; calls of {EMBED_BATCH} texts; {rounds} rounds")
    for source in sources:
        name, texts = corpus_texts(source, limit)
        tokens = [len(ids) for ids in full._model.tokenizer(texts, verbose=False)["input_ids"]]
        print(
            f"\n{name}: {len(texts)} texts, tokens p50 {percentile([float(t) for t in tokens], 0.5):.0f}, "
            f"{sum(t > full._model.max_seq_length for t in tokens) / len(texts):.0%} longer than one window"
        )
        given, longest = list(range(len(texts))), longest_first(texts)
        ways: dict[str, tuple[Embedder, list[int]]] = {
            "float32, order given (reference)": (full, given),
            "float32, longest first": (full, longest),
            "bfloat16, longest first": (half, longest),
            "float32 on ONNX Runtime, longest first": (exported, longest),
        }
        for embedder, _ in ways.values():
            embed_with_signs(embedder, texts[:EMBED_BATCH])  # load and warm
        if not exported.on_onnx:
            raise SystemExit("no checked ONNX export in the cache: is onnxruntime installed?")
        rates: dict[str, list[float]] = {way: [] for way in ways}
        reference_vectors: npt.NDArray[np.float32] | None = None
        agreement: dict[str, npt.NDArray[np.float32]] = {}
        for _ in range(rounds):
            for way, (embedder, order) in ways.items():
                seconds, vectors = embed_in_order(embedder, texts, order)
                rates[way].append(len(texts) / seconds)
                if reference_vectors is None:
                    reference_vectors = vectors
                agreement[way] = np.sum(vectors * reference_vectors, axis=1)
        reference = rates["float32, order given (reference)"]
        print("| way | texts/s by round | ratio to the reference by round | cosine to the reference: mean / p1 / min |")
        print("|---|---|---|---|")
        for way, rate in rates.items():
            ratios = [r / base for r, base in zip(rate, reference, strict=True)]
            cosine = agreement[way]
            print(
                f"| {way} | {' / '.join(f'{r:.1f}' for r in rate)} | {' / '.join(f'{r:.2f}' for r in ratios)} | "
                f"{cosine.mean():.5f} / {np.percentile(cosine, 1):.5f} / {cosine.min():.5f} |"
            )


FIRST_VECTORS = """
import sys, time
started = float(sys.argv[1])
from ontofabric.shared.embedder import LoadedOnDemand
from ontofabric.shared.settings import Settings
embedder = LoadedOnDemand(Settings())
embedder.embed_with_tokens(["def area(radius):\\n    return 3.14159 * radius ** 2"])
print(time.time() - started, embedder.on_onnx)
"""


def startup(rounds: int) -> None:
    """Seconds from a new process's start to its first vectors, on PyTorch and on ONNX Runtime in turn."""
    seconds: dict[str, list[float]] = {"torch": [], "onnx": []}
    for _ in range(rounds):
        for runtime, found in seconds.items():
            env = {**os.environ, "ONTOFABRIC_DOCUMENT_EMBEDDING_RUNTIME": runtime, "ONTOFABRIC_LOG_LEVEL": "WARNING"}
            out = subprocess.run(
                [sys.executable, "-c", FIRST_VECTORS, str(time.time())],
                env=env, capture_output=True, text=True, check=True,
            ).stdout.split()  # fmt: skip
            if (out[-1] == "True") != (runtime == "onnx"):
                raise SystemExit(f"the {runtime} round ran on the other runtime: {out}")
            found.append(float(out[-2]))
    print(f"\nfrom a process's start to its first vectors, {rounds} rounds in turn (seconds)")
    print("| runtime | by round | median |")
    print("|---|---|---|")
    for runtime, found in seconds.items():
        print(f"| {runtime} | {' / '.join(f'{s:.2f}' for s in found)} | {percentile(found, 0.5):.2f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("beir", nargs="*", type=Path, help="BEIR directories (default: this project's source)")
    parser.add_argument("--texts", type=int, default=1500, help="texts of each corpus, its first")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--with-source", action="store_true", help="this project's source too, with BEIR_DIRs")
    parser.add_argument("--startup", type=int, default=0, help="rounds of the start-to-first-vectors measure")
    args = parser.parse_args()
    if args.texts < EMBED_BATCH or args.rounds < 1:
        parser.error(f"--texts must be at least {EMBED_BATCH}, --rounds at least 1")
    configure_logging("WARNING", "console")
    chosen: list[Path | None] = [None] if args.with_source or not args.beir else []
    main(chosen + list(args.beir), args.texts, args.rounds)
    if args.startup:
        startup(args.startup)
