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
            splits = sorted(path.stem for path in (directory / "qrels").glob("*.tsv"))
            there = f"; the splits here: {', '.join(splits)}" if required == qrels_file and splits else ""
            raise DatasetError(
                f"{required} is missing (BEIR layout: corpus.jsonl, queries.jsonl, qrels/SPLIT.tsv){there}"
            )
    corpus = _read_entries(corpus_file)
    queries: dict[str, str] = {}
    for query in _read_entries(queries_file):
        if queries.setdefault(query["_id"], query["text"]) != query["text"]:
            raise DatasetError(f"{queries_file}: query id {query['_id']!r} is repeated with another text")
    qrels = _read_qrels(qrels_file)
    unknown = [q for q in qrels if q not in queries]
    if unknown:
        raise DatasetError(
            f"{len(unknown)} queries judged in {qrels_file} are not in queries.jsonl, e.g. {unknown[0]!r}"
        )
    if not any(score > 0 for judged in qrels.values() for score in judged.values()):
        raise DatasetError(f"{qrels_file} judges no document relevant (a score above 0): nothing to measure")
    return BeirDataset(directory.name, split, corpus, queries, qrels)


QRELS_HEADER = ["query-id", "corpus-id", "score"]
TREC_ITERATIONS = ("0", "Q0")


def _read_qrels(path: Path) -> dict[str, dict[str, int]]:
    """query id -> document id -> score. BEIR writes ``query-id corpus-id score`` with tabs under that header line,
    and is read as BEIR reads it (its first three columns); without the header, three columns are read as BEIR's
    and four as TREC's ``query-id iteration corpus-id score`` when the iteration is 0 or Q0. A line with no tab is
    split at spaces. A line of another shape, a score that is no integer, or a pair judged twice with different
    scores is a DatasetError naming the line: such a line was once dropped without a word, and the numbers came
    out wrong (an evaluation tester's)."""
    qrels: dict[str, dict[str, int]] = {}
    headed: bool | None = None  # decided by the first line that holds anything
    with path.open(encoding="utf-8-sig", newline="") as lines:  # -sig: a byte order mark is no part of the header
        for number, line in enumerate(lines, start=1):
            fields = _qrels_fields(line)
            if not fields:
                continue
            first = headed is None
            if first:
                headed = fields[:2] == QRELS_HEADER[:2]
                if headed:
                    continue
            if headed:
                fields = fields[:3]
            elif len(fields) == 4 and fields[1] in TREC_ITERATIONS:
                fields = [fields[0], fields[2], fields[3]]
            if len(fields) != 3:
                raise DatasetError(
                    f"{path}:{number}: expected query-id, corpus-id and score (or TREC's four columns, with no header "
                    f"line), got {line.strip()!r}"
                )
            query, doc, score_text = fields
            try:
                score = int(score_text)
            except ValueError:
                header = " (a header line must be 'query-id corpus-id score')" if first else ""
                raise DatasetError(f"{path}:{number}: score {score_text!r} is no integer{header}") from None
            judged = qrels.setdefault(query, {})
            if judged.setdefault(doc, score) != score:
                raise DatasetError(
                    f"{path}:{number}: {query!r} and {doc!r} are judged twice, {judged[doc]} and {score}"
                )
    return qrels


def _qrels_fields(line: str) -> list[str]:
    """A qrels line's fields: tab-separated as BEIR writes them (quoted where a field needs it), else split at
    spaces; trailing empty fields (a trailing tab) dropped."""
    text = line.rstrip("\r\n")
    fields = next(csv.reader([text], delimiter="\t")) if "\t" in text else text.split()
    fields = [field.strip() for field in fields]
    while fields and not fields[-1]:
        fields.pop()
    return fields


def judged_outside(dataset: BeirDataset) -> list[tuple[str, str]]:
    """The (query, document) judgments of documents the corpus does not hold: they count against the measures
    (as trec_eval and BEIR count them), so a typo in a hand-made qrels file lowers every figure."""
    held = {entry["_id"] for entry in dataset.corpus}
    return [(q, d) for q, docs in dataset.qrels.items() for d in docs if d not in held]


def _read_entries(path: Path) -> list[dict[str, str]]:
    """The ``_id``, ``title`` and ``text`` of each JSON line, as text: some BEIR-layout writers emit numeric ids
    (qrels ids are always text) or null titles. A line that is no object with an ``_id`` is a DatasetError."""
    entries = []
    with path.open(encoding="utf-8-sig") as lines:  # -sig: a byte order mark is no part of the first line
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
