"""Retrieval evaluation through the real path: a BEIR dataset published as deltas, projected, queried over NATS,
each configuration's answers measured (measures.py) and reported (eval_report.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path
from typing import Any

import asyncpg
from nats.js import JetStreamContext
from pydantic import ValidationError

from ontofabric.contracts import (
    MAIN_BRANCH,
    DocumentMetadata,
    DocumentUpserted,
    ErrorReply,
    SemanticDocument,
)
from ontofabric.contracts.query import MAX_TOKENS_LIMIT
from ontofabric.services.app import Roles, start_workers
from ontofabric.services.ingest.client import DeltaPublisher, envelope
from ontofabric.services.ingest.ingester import ChunkEmbedding, SecondVectors
from ontofabric.services.query.calibration import POSITION_DEPTH, reliability
from ontofabric.services.query.client import QueryClient
from ontofabric.services.query.symbols import places_of
from ontofabric.shared.azure_search import read_watermark, search_client
from ontofabric.shared.embedder import Embedder
from ontofabric.shared.embedding_cache import EmbeddingCache
from ontofabric.shared.jetstream import connect, wait_caught_up
from ontofabric.shared.onnx_models import OnnxEmbedder, second_embedder
from ontofabric.shared.placement import Placement
from ontofabric.shared.progress import Progress
from ontofabric.shared.runtime import Endpoints
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names

from .beir import BeirDataset, document_text
from .calibrate import Point
from .eval_report import ConfigResult, EvalReport, retrieval_setup, run_file_scores, run_file_stem, write_trec_run
from .measures import ExitPoint, Margin, calibrate_early_exit, compute_metrics, margin, per_query_ndcg, percentile

DEPTH = 100  # results per query: Recall@100 needs a hundred
CALIBRATION_DEPTH = POSITION_DEPTH
"""The results per query whose scores the calibration is measured (and fitted) on: those an agent reads."""

# Request parameters of each configuration. Only the retrievers, the refinements and reranking differ: candidate
# depth and fusion are the deployment's defaults, so the figures are those of the settings the workers run with.
# dense and keyword are each retriever alone; hybrid is a request with no options, what a gateway gets by default;
# hybrid-rerank is the same with precision asked. The others take the default request apart: its fusion without the
# refinements after it, late interaction over the dense list alone, and the default request without the second
# opinion (the same as hybrid where the deployment stores no second vectors).
_NO_SECOND_OPINION = {"secondOpinion": {"weight": 0.0}}
_NO_REFINEMENTS = {"lateInteraction": {"weight": 0.0}, **_NO_SECOND_OPINION}
CONFIGS: dict[str, dict[str, Any]] = {
    "dense": {"precision": False, "options": {"retrievers": ["dense"], **_NO_REFINEMENTS}},
    "keyword": {"precision": False, "options": {"retrievers": ["keyword"], **_NO_SECOND_OPINION}},
    "hybrid": {"precision": False},
    "hybrid-rerank": {"precision": True},
    "hybrid-fusion-only": {"precision": False, "options": _NO_REFINEMENTS},
    "dense-late-interaction": {"precision": False, "options": {"retrievers": ["dense"], **_NO_SECOND_OPINION}},
    "hybrid-no-second-opinion": {"precision": False, "options": _NO_SECOND_OPINION},
}
DEFAULT_REQUEST = "hybrid"


def hybrid_margins(per_query: Mapping[str, Mapping[str, float]]) -> list[Margin]:
    """Each hybrid configuration that ran against the stronger (by mean nDCG@10) of dense and keyword, the target
    of docs/quality.md, and the default request also against dense with late interaction (what the keyword list and
    the fusion add once both have that stage, and the second opinion where the deployment stores second vectors)
    and against itself without the second opinion (what that adds).

    The stronger retriever is picked on the same queries the interval resamples, which the interval ignores; on a
    tie it is dense.
    """

    def mean(config: str) -> float:
        values = per_query[config].values()
        return sum(values) / len(values) if values else 0.0

    pairs = [(DEFAULT_REQUEST, "dense-late-interaction"), (DEFAULT_REQUEST, "hybrid-no-second-opinion")]
    if "dense" in per_query and "keyword" in per_query:
        stronger = "keyword" if mean("keyword") > mean("dense") else "dense"
        pairs = [(config, stronger) for config in (DEFAULT_REQUEST, "hybrid-rerank", "hybrid-fusion-only")] + pairs
    found = [margin(c, a, per_query[c], per_query[a]) for c, a in pairs if c in per_query and a in per_query]
    return [m for m in found if m is not None]


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
        second: OnnxEmbedder | None = None,
    ) -> None:
        self._token_vectors = token_vectors
        self._second = second
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
                second = await asyncio.to_thread(SecondVectors.of, self._second, texts, self._cache)
                embeddings = list(ChunkEmbedding.of(embedded, self._embedder.dimension, self._token_vectors, second))
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
                        second_vector=embedding.second_vector if embedding else None,
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
        points: list[Point] | None = None,
    ) -> tuple[ConfigResult, dict[str, dict[str, float]]]:
        """One configuration over the judged queries: its measures, its run, and (into ``points``) each query's
        leading results with their signals and whether they are relevant, for the calibration."""
        request_base = CONFIGS[config]
        judged = [q for q in dataset.qrels if q in dataset.queries]
        self._progress.stage(config, len(judged))
        run: dict[str, dict[str, float]] = {}
        raw: dict[str, dict[str, float]] = {}
        single = len(request_base.get("options", {}).get("retrievers") or ["dense", "keyword"]) == 1
        latencies: list[float] = []
        stages: dict[str, list[float]] = {}
        result = ConfigResult()
        collected: list[Point] = []
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
                "maxTokens": MAX_TOKENS_LIMIT,  # every result counts: no budget may cut the list
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
            if reply.meta.skipped_late_interaction == "long_query":
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
                        "second_opinion",
                        "degraded",
                        "backend",
                    },
                )
            # Ranks decide, not scores. As BEIR does, a document with the query's own id is no answer (ArguAna).
            hits = [r for r in reply.results if not (ignore_identical_ids and r.id == query_id)]
            run[query_id] = {r.id: float(DEPTH - n) for n, r in enumerate(hits)}
            if not reply.meta.calibrated:
                result.uncalibrated += 1
            judgments = dataset.qrels[query_id]
            # Each at the place the answer scored it at (its own id dropped or not); one placed first (a definition
            # the query names) was not scored by the calibration, and is no point of it.
            places = dict(zip((r.id for r in reply.results), places_of(reply.results), strict=True))
            scored = [(r, place) for r in hits if (place := places[r.id]) is not None]
            collected += [
                Point(dataset.name, config, query_id, place, r.signals, judgments.get(r.id, 0) > 0, r.score)
                for r, place in scored[:CALIBRATION_DEPTH]
            ]
            raw[query_id] = run_file_scores(hits, reply.meta, single)
        result.metrics = compute_metrics({q: dataset.qrels[q] for q in judged}, run)
        result.reliability, result.calibration_error = reliability(
            [p.score for p in collected], [p.relevant for p in collected]
        )
        if points is not None:
            points += collected
        result.latency_p50_ms = percentile(latencies, 0.5)
        result.latency_p95_ms = percentile(latencies, 0.95)
        result.stages_p50_ms = {stage: round(percentile(times, 0.5), 2) for stage, times in stages.items()}
        if runs_dir is not None:
            write_trec_run(runs_dir / f"{run_file_stem(dataset.name)}.{config}.run", raw, config)
        return result, run


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
    setup = retrieval_setup(settings)
    judged = {q: dataset.qrels[q] for q in dataset.qrels if q in dataset.queries}
    over_query_limit = sum(len(dataset.queries[q]) > settings.max_query_chars for q in judged)
    # Cache off (every query measured), and queries as long as some BEIR sets have (ArguAna's are paragraphs).
    settings = settings.model_copy(
        update={"query_cache_entries": 0, "max_query_chars": max(settings.max_query_chars, 100_000)}
    )
    names = Names(settings.subject_prefix)
    async with AsyncExitStack() as stack:
        embedder = await start_workers(stack, settings, endpoints, Roles())
        nc = await connect(endpoints.nats_url_as("operator"), "ontofabric-eval", settings)
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
            await asyncio.to_thread(second_embedder, settings),
        )
        started = time.perf_counter()
        workspace, refused = await evaluation.load(dataset)
        load_seconds = time.perf_counter() - started
        results: dict[str, ConfigResult] = {}
        runs: dict[str, dict[str, dict[str, float]]] = {}
        exit_points: list[ExitPoint] = []
        calibration_points: list[Point] = []
        for config in configs:
            if config == "hybrid-rerank" and settings.reranker == "none":
                results[config] = ConfigResult(skipped="no reranker configured (ONTOFABRIC_RERANKER)")
                continue
            points = exit_points if config == DEFAULT_REQUEST else None
            results[config], runs[config] = await evaluation.run(
                dataset, workspace, config, runs_dir, points, ignore_identical_ids, calibration_points
            )
        loaded = await _live_documents(
            Placement.of(settings, endpoints.database_url).database_url_of(workspace), workspace
        )
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
        per_query=per_query,
        calibration_points=calibration_points,
        setup=setup,
        over_query_limit=over_query_limit,
    )


async def _live_documents(database_url: str, workspace: str) -> int:
    """Documents the projector holds for the workspace: fewer than the corpus means some were dead-lettered or
    shared an id."""
    conn = await asyncpg.connect(database_url)
    try:
        count = await conn.fetchval(
            "SELECT doc_count FROM ontology_versions WHERE workspace = $1 AND branch = $2", workspace, MAIN_BRANCH
        )
        return int(count or 0)
    finally:
        await conn.close()
