"""BEIR-layout datasets: ``corpus.jsonl``, ``queries.jsonl`` and ``qrels/SPLIT.tsv``, read and written."""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, replace
from pathlib import Path


class DatasetError(Exception):
    """The directory is not a readable BEIR dataset; the message says what is missing."""


@dataclass(frozen=True)
class BeirDataset:
    name: str
    split: str
    corpus: list[dict[str, str]]
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]
    """query id -> document id -> relevance; only queries with judgments are evaluated."""


def load_beir(directory: Path, split: str) -> BeirDataset:
    corpus_file, queries_file = directory / "corpus.jsonl", directory / "queries.jsonl"
    qrels_file = directory / "qrels" / f"{split}.tsv"
    for required in (corpus_file, queries_file, qrels_file):
        if not required.is_file():
            raise DatasetError(f"{required} is missing (BEIR layout: corpus.jsonl, queries.jsonl, qrels/SPLIT.tsv)")
    corpus = _read_entries(corpus_file)
    queries = {q["_id"]: q["text"] for q in _read_entries(queries_file)}
    qrels: dict[str, dict[str, int]] = {}
    with qrels_file.open(encoding="utf-8") as rows:
        reader = csv.reader(rows, delimiter="\t")
        header = next(reader, None)
        if header is None or header[:2] != ["query-id", "corpus-id"]:
            raise DatasetError(f"{qrels_file} must start with the header 'query-id corpus-id score'")
        for row in reader:
            if len(row) >= 3:
                try:
                    qrels.setdefault(row[0], {})[row[1]] = int(row[2])
                except ValueError:
                    raise DatasetError(f"{qrels_file}:{reader.line_num}: score {row[2]!r} is no integer") from None
    unknown = [q for q in qrels if q not in queries]
    if unknown:
        raise DatasetError(f"{len(unknown)} judged queries are not in queries.jsonl, e.g. {unknown[0]!r}")
    return BeirDataset(directory.name, split, corpus, queries, qrels)


def _read_entries(path: Path) -> list[dict[str, str]]:
    """The ``_id``, ``title`` and ``text`` of each JSON line, as text: some BEIR-layout writers emit numeric ids
    (qrels ids are always text) or null titles. A line that is no object with an ``_id`` is a DatasetError."""
    entries = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as error:
                raise DatasetError(f"{path}:{number}: not JSON ({error.msg})") from None
            if not isinstance(entry, dict) or entry.get("_id") is None:
                raise DatasetError(f"{path}:{number}: expected a JSON object with an _id")
            entries.append({key: "" if entry.get(key) is None else str(entry[key]) for key in ("_id", "title", "text")})
    return entries


def write_beir(dataset: BeirDataset, directory: Path) -> Path:
    """The dataset in the BEIR layout that :func:`load_beir` reads: corpus.jsonl, queries.jsonl, qrels/SPLIT.tsv."""
    (directory / "qrels").mkdir(parents=True, exist_ok=True)
    with (directory / "corpus.jsonl").open("w", encoding="utf-8") as out:
        out.writelines(json.dumps(entry) + "\n" for entry in dataset.corpus)
    with (directory / "queries.jsonl").open("w", encoding="utf-8") as out:
        out.writelines(json.dumps({"_id": q, "text": text}) + "\n" for q, text in dataset.queries.items())
    with (directory / "qrels" / f"{dataset.split}.tsv").open("w", encoding="utf-8") as out:
        out.write("query-id\tcorpus-id\tscore\n")
        out.writelines(f"{q}\t{d}\t{score}\n" for q, docs in dataset.qrels.items() for d, score in docs.items())
    return directory


def document_text(entry: dict[str, str]) -> str:
    title = (entry.get("title") or "").strip()
    return f"{title}\n{entry['text']}" if title else entry["text"]


def sample_dataset(dataset: BeirDataset, queries: int, documents: int, seed: int = 0) -> BeirDataset:
    """A smaller dataset drawn from ``dataset``, the same for the same arguments: ``queries`` of its judged queries
    (all if fewer), every document judged for them, and other documents drawn from the corpus up to ``documents``
    in all (more when the judged ones alone are more). Its name says how it was drawn."""
    rng = random.Random(seed)
    judged = sorted(q for q in dataset.qrels if q in dataset.queries)
    chosen = sorted(rng.sample(judged, min(queries, len(judged))))
    needed = {d for q in chosen for d in dataset.qrels[q]}
    others = [e["_id"] for e in dataset.corpus if e["_id"] not in needed]
    kept = needed | set(rng.sample(others, max(0, min(documents - len(needed), len(others)))))
    return replace(
        dataset,
        name=f"{dataset.name}[{len(chosen)} queries, {len(kept)} documents, seed {seed}]",
        corpus=[e for e in dataset.corpus if e["_id"] in kept],
        queries={q: dataset.queries[q] for q in chosen},
        qrels={q: dataset.qrels[q] for q in chosen},
    )
