"""A BEIR-layout set with queries its corpus cannot answer: a set as it is, plus queries drawn from another set,
each judged relevant to nothing. What `ontofabric calibrate` fits on, so that calibrated scores learn what an
off-topic question's leading results look like, and keep them low (docs/quality.md, "The rank as a signal"): the
judged sets alone hold only questions with an answer, and a fit on them takes an answer's first result for a
likely one whatever its signals.

Run: .venv/bin/python -m tests.benchmarks.unanswerable_set ../shared/eval/cosqa-dev dev \
         ../shared/eval/scifact-train train OUT_DIR [--queries 100] [--seed 7]
then: .venv/bin/ontofabric eval OUT_DIR --split dev --calibration-points FILE
"""

from __future__ import annotations

import argparse
import random
from dataclasses import replace
from pathlib import Path

from ontofabric.services.ops.beir import BeirDataset, load_beir, write_beir

UNANSWERABLE = "off-"
"""The prefix of the added queries' ids (which may repeat the set's own)."""


def with_unanswerable(dataset: BeirDataset, other: BeirDataset, queries: int, seed: int) -> BeirDataset:
    """``dataset`` with ``queries`` of ``other``'s judged queries added, each judged not relevant (0) to the
    corpus' first document and to nothing else, so that the evaluation counts it and finds nothing relevant."""
    drawn = random.Random(seed).sample(sorted(other.qrels), min(queries, len(other.qrels)))
    nothing = {dataset.corpus[0]["_id"]: 0}
    return replace(
        dataset,
        name=f"{dataset.name}+{len(drawn)} unanswerable",
        queries=dataset.queries | {UNANSWERABLE + q: other.queries[q] for q in drawn},
        qrels=dataset.qrels | {UNANSWERABLE + q: dict(nothing) for q in drawn},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", type=Path, help="The BEIR set whose corpus and judged queries are kept.")
    parser.add_argument("split", help="Its judgments: qrels/SPLIT.tsv (the output keeps the split's name).")
    parser.add_argument("other", type=Path, help="The BEIR set whose queries are added, judged unanswerable.")
    parser.add_argument("other_split", help="Its judgments, whose queries are drawn.")
    parser.add_argument("out", type=Path, help="Where to write the set (BEIR layout).")
    parser.add_argument("--queries", type=int, default=100, help="How many queries to add (default 100).")
    parser.add_argument("--seed", type=int, default=7, help="Which ones (default 7).")
    args = parser.parse_args()
    built = with_unanswerable(
        load_beir(args.dataset, args.split), load_beir(args.other, args.other_split), args.queries, args.seed
    )
    write_beir(built, args.out)
    print(f"wrote {args.out}: {len(built.corpus)} documents, {len(built.qrels)} judged queries ({built.name})")


if __name__ == "__main__":
    main()
