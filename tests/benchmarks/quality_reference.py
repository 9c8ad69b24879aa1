"""References outside the pipeline, for comparison with `ontofabric eval` on the same BEIR dataset.

Prints nDCG@10 (and Recall@10, Recall@100, MRR@10) of:
- BM25 with bm25s (English stemming and stopwords), as the issue's reference;
- BM25 with bm25s over text whose identifiers (camelCase, snake_case, dotted) are followed by their parts;
- dense all-MiniLM-L6-v2 by exact cosine (numpy, every document): over each document's first window, as
  sentence-transformers reads it and as the issue's reference did, and over the pipeline's own vectors (a long
  document read in ONTOFABRIC_EMBEDDING_WINDOWS windows), which is what HNSW is compared with;
- plain RRF k=60 of the first and the third.

Run: .venv/bin/python tests/benchmarks/quality_reference.py DATASET_DIR --split SPLIT
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import bm25s
import numpy as np
import Stemmer

from ontofabric.services.ops.beir import document_text, load_beir
from ontofabric.services.ops.measures import compute_metrics
from ontofabric.services.query.core import Candidate
from ontofabric.services.query.fusion import reciprocal_rank_fusion
from ontofabric.shared.embedder import build_embedder
from ontofabric.shared.embedding_cache import EmbeddingCache
from ontofabric.shared.settings import Settings

DEPTH = 100
_PART = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")


def split_identifiers(text: str) -> str:
    def expand(match: re.Match[str]) -> str:
        token = match.group(0)
        parts = [p for p in _PART.findall(token) if len(p) > 1]
        return f"{token} {' '.join(parts)}" if len(parts) > 1 else token

    return re.sub(r"[A-Za-z_][A-Za-z0-9_]*", expand, text)


def bm25_lists(texts: list[str], queries: list[str], ids: list[str]) -> list[list[Candidate]]:
    stemmer = Stemmer.Stemmer("english")
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(texts, stopwords="en", stemmer=stemmer, show_progress=False), show_progress=False)
    tokens = bm25s.tokenize(queries, stopwords="en", stemmer=stemmer, show_progress=False)
    results, scores = retriever.retrieve(tokens, k=DEPTH, show_progress=False)
    return [
        [Candidate(ids[i], float(s)) for i, s in zip(r, sc, strict=True) if s > 0]
        for r, sc in zip(results, scores, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", type=Path)
    parser.add_argument("--split", default="test")
    args = parser.parse_args()
    dataset = load_beir(args.dataset, args.split)
    settings = Settings().model_copy(update={"embedder": "local"})
    cache = EmbeddingCache(settings.cache_dir / "embeddings.sqlite")
    ids = [d["_id"] for d in dataset.corpus]
    texts = [document_text(d) for d in dataset.corpus]
    judged = [q for q in dataset.qrels if q in dataset.queries]
    query_texts = [dataset.queries[q] for q in judged]

    def exact_dense(windows: int) -> list[list[Candidate]]:
        embedder = build_embedder(settings.model_copy(update={"embedding_windows": windows}))
        assert embedder is not None
        similarity = cache.embed(embedder, query_texts).vectors @ cache.embed(embedder, texts).vectors.T
        return [[Candidate(ids[i], float(row[i])) for i in np.argsort(-row)[:DEPTH]] for row in similarity]

    dense = exact_dense(1)
    lists = {
        "bm25 (bm25s)": bm25_lists(texts, query_texts, ids),
        "bm25 + identifier splitting (bm25s)": bm25_lists(
            [split_identifiers(t) for t in texts], [split_identifiers(q) for q in query_texts], ids
        ),
        "dense exact cosine, first window (sentence-transformers as is)": dense,
    }
    if settings.embedding_windows > 1:
        lists[f"dense exact cosine, up to {settings.embedding_windows} windows (the pipeline's vectors)"] = exact_dense(
            settings.embedding_windows
        )
    bm25 = lists["bm25 (bm25s)"]
    lists["rrf k=60 (bm25, dense)"] = [
        [Candidate(f.id, f.score) for f in reciprocal_rank_fusion({"dense": d, "keyword": k}, k=60)]
        for d, k in zip(dense, bm25, strict=True)
    ]
    print(f"{dataset.name} ({dataset.split}): {len(ids)} documents, {len(judged)} judged queries")
    print("| reference | nDCG@10 | Recall@10 | Recall@100 | MRR@10 |\n|---|---|---|---|---|")
    for name, ranked in lists.items():
        run = {q: {c.id: float(DEPTH - r) for r, c in enumerate(hits)} for q, hits in zip(judged, ranked, strict=True)}
        metrics = compute_metrics({q: dataset.qrels[q] for q in judged}, run)
        print(f"| {name} | " + " | ".join(f"{v:.4f}" for v in metrics.values()) + " |")


if __name__ == "__main__":
    main()
