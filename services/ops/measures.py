"""The evaluation's measures, as pure functions: ranking metrics from ir-measures (trec_eval underneath), the paired
bootstrap that says how far chance alone moves a difference, latency percentiles, and where the keyword-saturation
early exit may fire."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import ir_measures
import numpy as np
from ir_measures import RR, R, nDCG

MEASURES = {"nDCG@10": nDCG @ 10, "Recall@10": R @ 10, "Recall@100": R @ 100, "MRR@10": RR @ 10}


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
