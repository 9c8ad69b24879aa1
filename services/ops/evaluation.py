"""Retrieval evaluation through the real path: a BEIR dataset published as deltas, projected, queried over NATS.

Metrics come from ir-measures (trec_eval underneath): nDCG@10, Recall@10, Recall@100 and MRR@10, plus the
client-side latency of each query.
"""

from __future__ import annotations

import asyncio
import csv
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import asyncpg
import ir_measures
import numpy as np
from ir_measures import RR, R, nDCG
from nats.js import JetStreamContext
from pydantic import ValidationError

from ontofabric.contracts import (
    DocumentMetadata,
    DocumentUpserted,
    ErrorReply,
    QueryMeta,
    SearchResult,
    SemanticDocument,
)
from ontofabric.services.app import Roles, start_workers
from ontofabric.services.ingest.client import DeltaPublisher, envelope
from ontofabric.services.ingest.ingester import ChunkEmbedding
from ontofabric.services.query.client import QueryClient
from ontofabric.shared.azure_search import read_watermark, search_client
from ontofabric.shared.embedder import Embedder
from ontofabric.shared.embedding_cache import EmbeddingCache
from ontofabric.shared.jetstream import connect, wait_caught_up
from ontofabric.shared.progress import Progress
from ontofabric.shared.runtime import Endpoints
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names

MEASURES = {"nDCG@10": nDCG @ 10, "Recall@10": R @ 10, "Recall@100": R @ 100, "MRR@10": RR @ 10}
DEPTH = 100  # results per query: Recall@100 needs a hundred

# Request parameters of each configuration. Only the retrievers, late interaction and reranking differ: candidate
# depth and fusion are the deployment's defaults, so the figures are those of the settings the workers run with.
# dense and keyword are each retriever alone; hybrid is a request with no options, what a gateway gets by default;
# hybrid-rerank is the same with precision asked. The last two take the default request apart: its fusion without
# the late-interaction stage, and that stage over the dense list alone.
_NO_LATE_INTERACTION = {"lateInteraction": {"weight": 0.0}}
CONFIGS: dict[str, dict[str, Any]] = {
    "dense": {"precision": False, "options": {"retrievers": ["dense"], **_NO_LATE_INTERACTION}},
    "keyword": {"precision": False, "options": {"retrievers": ["keyword"]}},
    "hybrid": {"precision": False},
    "hybrid-rerank": {"precision": True},
    "hybrid-fusion-only": {"precision": False, "options": _NO_LATE_INTERACTION},
    "dense-late-interaction": {"precision": False, "options": {"retrievers": ["dense"]}},
}
DEFAULT_REQUEST = "hybrid"


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


@dataclass
class ConfigResult:
    metrics: dict[str, float] = field(default_factory=dict)
    latency_p50_ms: float = 0.0
    latency_p95_ms: float = 0.0
    errors: int = 0
    degraded: int = 0
    """Answers whose _meta.degraded was not empty (a part failed: the numbers are not the configuration's)."""
    skipped: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    """What _meta said on the first query (fusion, retrievers, reranking): the configuration as it ran."""
    stages_p50_ms: dict[str, float] = field(default_factory=dict)
    """Median worker-side time of each pipeline stage (_meta.timingsMs) over the queries where it ran."""
    late_interaction_skipped: int = 0
    """Answers that went without late interaction for the query's length (_meta.skippedLateInteraction)."""


@dataclass(frozen=True)
class ExitPoint:
    """One hybrid answer, as the early exit sees it."""

    saturation: float
    tokens: int
    top_relevant: bool
    query_id: str = ""


@dataclass
class EarlyExitCalibration:
    configured_threshold: float
    fires_at_configured: float
    """Share of queries for which the configured threshold would skip the reranker."""
    precision_at_configured: float | None
    """How often the top answer was already relevant when it fires."""
    suggested_threshold: float | None
    """The lowest threshold at which at least ``min_support`` queries fire and their top answer is right at least
    ``target`` of the time; None when no threshold gets there."""
    target_precision: float
    overall_precision: float
    rerank_gain_when_fired: float | None = None
    """Mean nDCG@10 of hybrid-rerank minus hybrid over the queries it fires for: what skipping costs. Measured only
    when a reranker ran."""


def calibrate_early_exit(
    points: Sequence[ExitPoint],
    configured: float,
    queries: int,
    rerank_gain: Mapping[str, float] | None = None,
    target: float = 0.8,
    max_tokens: int = 5,
    min_support: int = 10,
) -> EarlyExitCalibration:
    """Where the keyword-saturation early exit may fire without skipping a reranker that had work to do.

    ``queries``: all judged queries (the firing rate's denominator). ``rerank_gain``: per query, nDCG@10 with the
    reranker minus without, when one ran.
    """
    short = [p for p in points if p.tokens < max_tokens]

    def fired(threshold: float) -> list[ExitPoint]:
        return [p for p in short if p.saturation >= threshold]

    def precision(group: list[ExitPoint]) -> float | None:
        return sum(p.top_relevant for p in group) / len(group) if group else None

    suggested = None
    for threshold in sorted({round(p.saturation, 2) for p in short}):
        group = fired(threshold)
        value = precision(group)
        if value is not None and value >= target and len(group) >= min_support:
            suggested = threshold
            break
    firing = fired(configured)
    gains = [rerank_gain[p.query_id] for p in firing if rerank_gain and p.query_id in rerank_gain]
    return EarlyExitCalibration(
        configured_threshold=configured,
        fires_at_configured=len(firing) / queries if queries else 0.0,
        precision_at_configured=precision(firing),
        suggested_threshold=suggested,
        target_precision=target,
        overall_precision=precision(list(points)) or 0.0,
        rerank_gain_when_fired=sum(gains) / len(gains) if gains else None,
    )


_TIE = 1e-9
"""Per-query differences within this are float noise: a tie."""


@dataclass(frozen=True)
class Margin:
    """One configuration against another on nDCG@10, query by query, with how far chance alone could move it."""

    config: str
    against: str
    difference: float
    """Mean per-query nDCG@10 of ``config`` minus that of ``against`` (equal to the difference of the means)."""
    ci_low: float
    ci_high: float
    """The 95 % interval of ``difference`` by the paired bootstrap: queries resampled with replacement."""
    better: int
    worse: int
    equal: int
    """Queries where ``config`` scored higher, lower, or the same (within ``_TIE``) as ``against``."""


def margin(
    config: str,
    against: str,
    scores: Mapping[str, float],
    reference: Mapping[str, float],
    resamples: int = 10_000,
    seed: int = 0,
) -> Margin | None:
    """``config``'s per-query ``scores`` against ``reference``'s over the same queries (a query missing from
    either counts 0 there); None without queries."""
    queries = sorted(set(scores) | set(reference))
    if not queries:
        return None
    differences = np.array([scores.get(q, 0.0) - reference.get(q, 0.0) for q in queries])
    rng = np.random.default_rng(seed)
    means = []
    for done in range(0, resamples, 1000):  # in chunks: all resamples' indices at once are GBs for 10k queries
        drawn = rng.integers(0, len(differences), (min(1000, resamples - done), len(differences)))
        means.append(differences[drawn].mean(axis=1))
    low, high = np.percentile(np.concatenate(means), [2.5, 97.5])
    return Margin(
        config=config,
        against=against,
        difference=float(differences.mean()),
        ci_low=float(low),
        ci_high=float(high),
        better=int((differences > _TIE).sum()),
        worse=int((differences < -_TIE).sum()),
        equal=int((np.abs(differences) <= _TIE).sum()),
    )


def hybrid_margins(per_query: Mapping[str, Mapping[str, float]]) -> list[Margin]:
    """Each hybrid configuration that ran against the stronger (by mean nDCG@10) of dense and keyword, the target
    of docs/quality.md, and the default request also against dense with late interaction: what the keyword list and
    the fusion add once both have that stage.

    The stronger retriever is picked on the same queries the interval resamples, which the interval ignores; on a
    tie it is dense.
    """

    def mean(config: str) -> float:
        values = per_query[config].values()
        return sum(values) / len(values) if values else 0.0

    pairs = [(DEFAULT_REQUEST, "dense-late-interaction")]
    if "dense" in per_query and "keyword" in per_query:
        stronger = "keyword" if mean("keyword") > mean("dense") else "dense"
        pairs = [(config, stronger) for config in (DEFAULT_REQUEST, "hybrid-rerank", "hybrid-fusion-only")] + pairs
    found = [margin(c, a, per_query[c], per_query[a]) for c, a in pairs if c in per_query and a in per_query]
    return [m for m in found if m is not None]


@dataclass
class EvalReport:
    dataset: str
    split: str
    documents: int
    """Entries in corpus.jsonl."""
    documents_loaded: int
    """Documents the projector holds after loading; fewer when entries were dead-lettered or repeated an id."""
    queries: int
    configs: dict[str, ConfigResult]
    load_seconds: float
    refused_documents: list[tuple[str, str]] = field(default_factory=list)
    """(id, why) of each corpus entry the document contract refused, e.g. text with a NUL character."""
    early_exit: EarlyExitCalibration | None = None
    margins: list[Margin] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def compute_metrics(qrels: dict[str, dict[str, int]], run: dict[str, dict[str, float]]) -> dict[str, float]:
    """nDCG@10, Recall@10, Recall@100 and MRR@10 averaged over the judged queries (missing runs score 0)."""
    judged = {q: docs for q, docs in qrels.items()}
    scores = ir_measures.calc_aggregate(list(MEASURES.values()), judged, {q: run.get(q, {}) for q in judged})
    return {name: float(scores[measure]) for name, measure in MEASURES.items()}


def per_query_ndcg(qrels: dict[str, dict[str, int]], run: dict[str, dict[str, float]]) -> dict[str, float]:
    scores = {q: 0.0 for q in qrels}
    for metric in ir_measures.iter_calc([nDCG @ 10], qrels, {q: run.get(q, {}) for q in qrels}):
        scores[metric.query_id] = float(metric.value)
    return scores


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


class Evaluation:
    """Loads one dataset into a fresh workspace and runs configurations against it."""

    def __init__(
        self,
        js: JetStreamContext,
        client: QueryClient,
        names: Names,
        embedder: Embedder | None,
        cache: EmbeddingCache,
        progress: Progress,
        token_vectors: bool = True,
        projectors: Sequence[str] = (),
        watermark: Callable[[], Awaitable[int | None]] | None = None,
    ) -> None:
        self._token_vectors = token_vectors
        self._projectors = list(projectors) or [names.postgres_projector_durable]
        """The durables of the projectors the load waits for: every index a configuration may read."""
        self._watermark = watermark
        """The Azure index's watermark, when there is one: the load also waits for it, so no answer is marked
        keywordIndexBehind for the moment it trails the acks."""
        self._js = js
        self._client = client
        self._names = names
        self._embedder = embedder
        self._cache = cache
        self._progress = progress

    async def load(self, dataset: BeirDataset, batch: int = 1000) -> tuple[str, list[tuple[str, str]]]:
        """Publish the corpus as deltas into a new workspace; once the projector has applied them, return the
        workspace and the (id, why) of each entry the document contract refused (those are not in the index).

        The corpus goes in batches (embed, publish), so a large one never sits in memory as deltas all at once.
        """
        workspace = f"eval-{uuid.uuid4().hex[:10]}"
        refused: list[tuple[str, str]] = []
        model = self._embedder.model_name if self._embedder is not None else None
        publisher = DeltaPublisher(self._js, self._names)
        self._progress.stage("load", len(dataset.corpus))
        last_seq = 0
        for start in range(0, len(dataset.corpus), batch):
            entries = dataset.corpus[start : start + batch]
            texts = [document_text(d) for d in entries]
            embeddings: list[ChunkEmbedding | None] = [None] * len(texts)
            if self._embedder is not None:  # on a thread: the projector and the query worker share this loop
                embedded = await asyncio.to_thread(self._cache.embed, self._embedder, texts)
                embeddings = list(ChunkEmbedding.of(embedded, self._embedder.dimension, self._token_vectors))
            deltas = []
            for entry, text, embedding in zip(entries, texts, embeddings, strict=True):
                try:
                    document = SemanticDocument(
                        id=entry["_id"],
                        content=text,
                        object_type="beir.Document",
                        source_domain=dataset.name,
                        metadata=DocumentMetadata(chunk_level="doc", provenance="ingested"),
                        embedding=embedding.vector if embedding else None,
                        embedding_model=model if embedding else None,
                        token_vectors=embedding.token_vectors if embedding else None,
                    )
                except ValidationError as error:  # reported, not fatal: the rest of the corpus is still measured
                    why = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
                    refused.append((entry["_id"], why))
                    continue
                deltas.append(envelope(workspace, DocumentUpserted(document=document), producer="ontofabric-eval"))
            acks = await publisher.publish_many(deltas) if deltas else []
            last_seq = max([last_seq, *(a.seq for a in acks)])
            self._progress.advance("load", len(entries))
        for durable in self._projectors if last_seq else ():
            await wait_caught_up(self._js, self._names.delta_stream, durable, last_seq, 3600)
        while self._watermark is not None and (await self._watermark() or 0) < last_seq:
            await asyncio.sleep(0.1)
        return workspace, refused

    async def run(
        self,
        dataset: BeirDataset,
        workspace: str,
        config: str,
        runs_dir: Path | None = None,
        exit_points: list[ExitPoint] | None = None,
        ignore_identical_ids: bool = True,
    ) -> tuple[ConfigResult, dict[str, dict[str, float]]]:
        request_base = CONFIGS[config]
        judged = [q for q in dataset.qrels if q in dataset.queries]
        self._progress.stage(config, len(judged))
        run: dict[str, dict[str, float]] = {}
        raw: dict[str, dict[str, float]] = {}
        single = len(request_base.get("options", {}).get("retrievers") or ["dense", "keyword"]) == 1
        latencies: list[float] = []
        stages: dict[str, list[float]] = {}
        result = ConfigResult()
        for query_id in judged:
            if not dataset.queries[query_id].strip():  # no query the contract accepts: it scores zero, as an error
                self._progress.advance(config)
                result.errors += 1
                continue
            # Ids are what is judged: without content, a hundred long documents still fit in one reply.
            request = {
                "semanticQuery": dataset.queries[query_id],
                "topK": DEPTH,
                "includeContent": False,
                **request_base,
            }
            started = time.perf_counter()
            reply = await self._client.query(workspace, request)
            latencies.append((time.perf_counter() - started) * 1000)
            self._progress.advance(config)
            if isinstance(reply, ErrorReply):
                result.errors += 1
                continue
            if reply.meta.degraded:
                result.degraded += 1
            if reply.meta.skipped_late_interaction:
                result.late_interaction_skipped += 1
            for stage, ms in reply.meta.timings_ms.items():
                stages.setdefault(stage, []).append(ms)
            if exit_points is not None and "keywordSaturation" in reply.meta.signals:
                top = reply.results[0].id if reply.results else None
                exit_points.append(
                    ExitPoint(
                        saturation=reply.meta.signals["keywordSaturation"],
                        tokens=int(reply.meta.signals["queryTokens"]),
                        top_relevant=top is not None and dataset.qrels[query_id].get(top, 0) > 0,
                        query_id=query_id,
                    )
                )
            if not result.meta:
                result.meta = reply.meta.model_dump(
                    mode="json",
                    include={
                        "hybrid",
                        "reranked",
                        "reranker",
                        "retrievers",
                        "fusion",
                        "late_interaction",
                        "degraded",
                        "backend",
                    },
                )
            # Ranks decide, not scores. As BEIR does, a document with the query's own id is no answer (ArguAna).
            hits = [r for r in reply.results if not (ignore_identical_ids and r.id == query_id)]
            run[query_id] = {r.id: float(DEPTH - n) for n, r in enumerate(hits)}
            raw[query_id] = run_file_scores(hits, reply.meta, single)
        result.metrics = compute_metrics({q: dataset.qrels[q] for q in judged}, run)
        result.latency_p50_ms = percentile(latencies, 0.5)
        result.latency_p95_ms = percentile(latencies, 0.95)
        result.stages_p50_ms = {stage: round(percentile(times, 0.5), 2) for stage, times in stages.items()}
        if runs_dir is not None:
            write_trec_run(runs_dir / f"{dataset.name}.{config}.run", raw, config)
        return result, run


def run_file_scores(results: Sequence[SearchResult], meta: QueryMeta, single_retriever: bool) -> dict[str, float]:
    """The score a run file keeps for each judged result, in the answer's order: the retriever's own where one
    retriever ran and no later stage reordered its list, else the score the results were ranked by (a reordering
    stage's relevance, or the fused one), so a tool that sorts the file by score sees the order that was judged
    (up to ties, which such tools break by document id)."""
    own = single_retriever and meta.late_interaction is None and not meta.reranked
    return {r.id: r.found_by[0].score if own and len(r.found_by) == 1 else r.score for r in results}


def write_trec_run(path: Path, run: dict[str, dict[str, float]], tag: str) -> None:
    """One line per result, each query's results in the order given, ranked from 1."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for query_id, docs in run.items():
            for rank, (doc_id, score) in enumerate(docs.items(), start=1):
                out.write(f"{query_id} Q0 {doc_id} {rank} {score:.6f} {tag}\n")


def render_table(report: EvalReport, write: Callable[[str], None]) -> None:
    header = ["config", *MEASURES, "p50 ms", "p95 ms", "degraded", "errors"]
    write(f"{report.dataset} ({report.split}): {report.documents} documents, {report.queries} judged queries")
    if report.refused_documents:
        first, why = report.refused_documents[0]
        write(
            f"warning: {len(report.refused_documents)} corpus entries were refused by the document contract and not"
            f" loaded, e.g. {first!r}: {why}"
        )
    if report.documents_loaded + len(report.refused_documents) != report.documents:
        write(
            f"warning: only {report.documents_loaded} documents were loaded (dead-lettered entries or repeated ids;"
            " see the DLQ stream)"
        )
    write("| " + " | ".join(header) + " |")
    write("|" + "---|" * len(header))
    for name, result in report.configs.items():
        if result.skipped:
            write(f"| {name} | skipped: {result.skipped} |")
            continue
        cells = [f"{result.metrics[m]:.4f}" for m in MEASURES]
        cells += [
            f"{result.latency_p50_ms:.1f}",
            f"{result.latency_p95_ms:.1f}",
            str(result.degraded),
            str(result.errors),
        ]
        write(f"| {name} | " + " | ".join(cells) + " |")
    for name, result in report.configs.items():
        if result.late_interaction_skipped:
            write(f"{name}: late interaction skipped for {result.late_interaction_skipped} long queries")
        if result.stages_p50_ms:
            stages = ", ".join(f"{stage} {ms:.1f}" for stage, ms in result.stages_p50_ms.items())
            write(f"{name}, worker-side p50 ms per stage: {stages}")
    for m in report.margins:
        difference = round(m.difference, 4) + 0.0  # + 0.0: a rounding of -1e-17 prints +0.0000, not -0.0000
        write(
            f"{m.config} over {m.against}: {difference:+.4f} nDCG@10, 95% interval {m.ci_low:+.4f} to "
            f"{m.ci_high:+.4f} (paired bootstrap over {m.better + m.worse + m.equal} queries); better on {m.better}, "
            f"worse on {m.worse}, equal on {m.equal}"
        )
    calibration = report.early_exit
    if calibration is not None:
        fired = calibration.precision_at_configured
        write(
            f"early exit at keyword saturation >= {calibration.configured_threshold}: fires for "
            f"{100 * calibration.fires_at_configured:.1f}% of queries; top answer relevant when it fires: "
            f"{'n/a' if fired is None else f'{fired:.2f}'} (all queries: {calibration.overall_precision:.2f}); "
            f"lowest threshold with >= {calibration.target_precision} precision: {calibration.suggested_threshold}"
            + (
                ""
                if calibration.rerank_gain_when_fired is None
                else f"; reranking gains {calibration.rerank_gain_when_fired:+.4f} nDCG@10 on those queries"
            )
        )


async def evaluate(
    settings: Settings,
    endpoints: Endpoints,
    dataset: BeirDataset,
    configs: Sequence[str],
    progress: Progress,
    runs_dir: Path | None = None,
    ignore_identical_ids: bool = True,
) -> EvalReport:
    """Start a projector and a query worker (cache off), load the dataset, run each configuration."""
    # Cache off (every query measured), and queries as long as some BEIR sets have (ArguAna's are paragraphs).
    settings = settings.model_copy(
        update={"query_cache_entries": 0, "max_query_chars": max(settings.max_query_chars, 100_000)}
    )
    names = Names(settings.subject_prefix)
    async with AsyncExitStack() as stack:
        embedder = await start_workers(stack, settings, endpoints, Roles())
        nc = await connect(endpoints.nats_url, "ontofabric-eval")
        stack.push_async_callback(nc.close)
        js = nc.jetstream()
        cache = EmbeddingCache(settings.cache_dir / "embeddings.sqlite")
        stack.callback(cache.close)
        projectors = [names.postgres_projector_durable]
        watermark = None
        if settings.azure_search_endpoint is not None:
            projectors.append(names.azure_projector_durable)
            client = search_client(settings, retries=3)
            stack.push_async_callback(client.close)
            watermark = partial(read_watermark, client)
        evaluation = Evaluation(
            js,
            QueryClient(nc, names, timeout_s=60),
            names,
            embedder,
            cache,
            progress,
            settings.token_vectors,
            projectors,
            watermark,
        )
        started = time.perf_counter()
        workspace, refused = await evaluation.load(dataset)
        load_seconds = time.perf_counter() - started
        results: dict[str, ConfigResult] = {}
        runs: dict[str, dict[str, dict[str, float]]] = {}
        exit_points: list[ExitPoint] = []
        for config in configs:
            if config == "hybrid-rerank" and settings.reranker == "none":
                results[config] = ConfigResult(skipped="no reranker configured (ONTOFABRIC_RERANKER)")
                continue
            points = exit_points if config == DEFAULT_REQUEST else None
            results[config], runs[config] = await evaluation.run(
                dataset, workspace, config, runs_dir, points, ignore_identical_ids
            )
        loaded = await _live_documents(endpoints.database_url, workspace)
    judged = {q: dataset.qrels[q] for q in dataset.qrels if q in dataset.queries}
    per_query = {config: per_query_ndcg(judged, run) for config, run in runs.items()}
    gain = None
    if DEFAULT_REQUEST in runs and "hybrid-rerank" in runs:
        # The same request but for precision: what the reranker adds.
        with_reranker, without = per_query["hybrid-rerank"], per_query[DEFAULT_REQUEST]
        gain = {q: with_reranker[q] - without[q] for q in judged}
    return EvalReport(
        dataset=dataset.name,
        split=dataset.split,
        documents=len(dataset.corpus),
        documents_loaded=loaded,
        queries=len(judged),
        configs=results,
        load_seconds=load_seconds,
        refused_documents=refused,
        early_exit=(
            calibrate_early_exit(exit_points, settings.early_exit_saturation, len(judged), gain)
            if exit_points
            else None
        ),
        margins=hybrid_margins(per_query),
    )


async def _live_documents(database_url: str, workspace: str) -> int:
    """Documents the projector holds for the workspace: fewer than the corpus means some were dead-lettered or
    shared an id."""
    conn = await asyncpg.connect(database_url)
    try:
        count = await conn.fetchval(
            "SELECT doc_count FROM ontology_versions WHERE workspace = $1 AND branch = 'main'", workspace
        )
        return int(count or 0)
    finally:
        await conn.close()
