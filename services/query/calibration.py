"""Calibrated scores (pure): a result's score as the probability that it is relevant, from what the retrievers
measured of it, on one scale whatever ran.

The pipeline's own relevance is relative (fusion scales each list to its best hit, late interaction and rerankers
to the candidates they compare), so a lone weak hit would score 1. What is absolute is what each retriever
measured: the dense cosine similarity to the query, and the BM25 score over the best one the query could reach
(every query term matched as often as saturates, ``keyword``, in [0, 1]). Platt scaling (Platt, "Probabilistic
outputs for support vector machines", 1999) fits a logistic model over those signals per set of retrievers that
ran (dense, keyword, both), on judged queries: ``ontofabric eval --calibration-points`` collects them and
``ontofabric calibrate`` fits them (docs/quality.md, "Calibrated scores").

Each signal also enters multiplied by the result's place in the answer (``log2(1 + rank)``, ranks past
``POSITION_DEPTH`` counting as that one): the order holds what the signals alone do not (late interaction, the
fusion of both lists), so a result's estimate follows its rank more closely, while a weak match stays weak at any
rank, its signals being small (a place of its own would lift every answer's first result, an off-topic one too).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .core import DENSE, Candidate
from .core import KEYWORD as KEYWORD_RETRIEVER
from .fusion import SHORT_LIST, ran_out_scores

COSINE = "cosine"
KEYWORD = "keyword"
"""The signals' names, in ``SearchResult.signals`` and in the calibration points."""

MODELS = ("dense", "keyword", "hybrid")
"""One model per set of retrievers that ran; ``hybrid`` reads both signals, the others one each."""
SIGNALS = {"dense": 1, "keyword": 1, "hybrid": 2}
"""How many signals each model reads (each enters twice: alone and times the place)."""
POSITION_DEPTH = 10
"""How deep the calibration points go in each answer (``ontofabric eval``'s ``CALIBRATION_DEPTH``): a result past it
is judged as if at it, the fit knowing nothing deeper."""


@dataclass(frozen=True)
class Platt:
    """``sigmoid(weights · signals + bias)``."""

    weights: tuple[float, ...]
    bias: float

    def probability(self, signals: Sequence[float]) -> float:
        z = self.bias + sum(w * x for w, x in zip(self.weights, signals, strict=True))
        return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))

    @classmethod
    def of(cls, coefficients: Sequence[float], signals: int) -> Platt:
        """From a setting's list for a model of ``signals`` signals: the weights (each signal's, then each signal's
        times the place), then the bias. A list without the place's weights (as fitted before 2026-12-03) reads
        them as 0."""
        weights = tuple(coefficients[:-1])
        if len(weights) == signals:
            weights += (0.0,) * signals
        if len(weights) != 2 * signals:
            raise ValueError(f"{len(coefficients)} coefficients for {signals} signal(s): expected {2 * signals + 1}")
        return cls(weights, coefficients[-1])

    def coefficients(self) -> list[float]:
        return [*self.weights, self.bias]


@dataclass(frozen=True)
class Calibration:
    dense: Platt
    keyword: Platt
    hybrid: Platt

    def probability(self, model: str, signals: Mapping[str, float], rank: int) -> float | None:
        """The probability that a result at ``rank`` in its answer is relevant, by ``model`` (see :func:`model_for`
        and :func:`judged`); None when the signals it needs are not there."""
        judgement = judged(model, signals, rank)
        return None if judgement is None else self.model(judgement[0]).probability(judgement[1])

    def model(self, name: str) -> Platt:
        return {"dense": self.dense, "keyword": self.keyword, "hybrid": self.hybrid}[name]


@dataclass(frozen=True)
class Measured:
    """What the retrievers measured of an answer's candidates, and which model judges them (None: none can)."""

    model: str | None
    signals: dict[str, dict[str, float]]


def judged(model: str, signals: Mapping[str, float], rank: int) -> tuple[str, tuple[float, ...]] | None:
    """The model that judges a result at ``rank`` and its inputs: the signals, then each times the place. Under
    ``hybrid`` a result the keyword list did not return counts as keyword 0, and one whose cosine is unknown (a
    keyword hit whose similarity could not be read) goes to the keyword model. None when the signals a model needs
    are not there."""
    cosine, keyword = signals.get(COSINE), signals.get(KEYWORD)
    if model == "hybrid" and cosine is not None:
        return model, _with_place((cosine, keyword or 0.0), rank)
    if model in ("hybrid", "keyword") and keyword is not None:
        return "keyword", _with_place((keyword,), rank)
    if model == "dense" and cosine is not None:
        return model, _with_place((cosine,), rank)
    return None


def _with_place(signals: tuple[float, ...], rank: int) -> tuple[float, ...]:
    place = math.log2(1 + min(max(rank, 1), POSITION_DEPTH))
    return signals + tuple(value * place for value in signals)


def model_for(ran: Iterable[str], keyword_scaled: bool) -> str | None:
    """Which model judges an answer's results, from the retrievers that ran; ``keyword_scaled``: the keyword list
    knows the best score the query could reach (a backend without it, Azure AI Search, gives no keyword signal)."""
    ran = set(ran)
    if {DENSE, KEYWORD_RETRIEVER} <= ran:
        return "hybrid" if keyword_scaled else "dense"
    if DENSE in ran:
        return "dense"
    if KEYWORD_RETRIEVER in ran and keyword_scaled:
        return "keyword"
    return None


def result_signals(
    dense: Sequence[Candidate] | None,
    keyword: Sequence[Candidate] | None,
    keyword_ceiling: float | None,
    other_cosines: Mapping[str, float] | None = None,
    keyword_coverage: Mapping[str, float] | None = None,
) -> dict[str, dict[str, float]]:
    """Each candidate's signals: its cosine (from the dense list, else ``other_cosines``, read for keyword hits
    the dense list did not return) and its keyword score over the query's ceiling.

    A keyword list that ran out, where the backend states each hit's ``keyword_coverage``, gives each hit the
    strength the fusion weighs it by (``ran_out_scores``): read by its saturation, a made-up word written once in
    a long function scored 0.011 at the top of its answer, under the second result's 0.021, and ``minRelevance``
    dropped the one result that held the word."""
    found: dict[str, dict[str, float]] = {}
    for candidate in dense or ():
        found.setdefault(candidate.id, {}).setdefault(COSINE, round(candidate.score, 6))
    for doc_id, cosine in (other_cosines or {}).items():
        found.setdefault(doc_id, {}).setdefault(COSINE, round(cosine, 6))
    if keyword_ceiling and keyword:
        ran_out = keyword_coverage if len(keyword) < SHORT_LIST else None
        for doc_id, strength in ran_out_scores(keyword, keyword_ceiling, ran_out).items():
            found.setdefault(doc_id, {}).setdefault(KEYWORD, round(strength, 6))
    return found


def fit_platt(signals: np.ndarray, labels: np.ndarray, l2: float = 1e-4, iterations: int = 100) -> Platt:
    """Logistic regression by Newton's method on Platt's smoothed targets ((N+ + 1) / (N+ + 2) for a relevant
    point, 1 / (N- + 2) for the rest), which keeps a separable set from pushing the weights to infinity; ``l2``
    (not on the bias) steadies the rest."""
    x = np.hstack([np.asarray(signals, dtype=np.float64), np.ones((len(signals), 1))])
    y = np.asarray(labels, dtype=np.float64)
    positives, negatives = float(y.sum()), float(len(y) - y.sum())
    target = np.where(y > 0, (positives + 1) / (positives + 2), 1 / (negatives + 2))
    penalty = np.diag([l2] * (x.shape[1] - 1) + [0.0]) * len(y)
    w = np.zeros(x.shape[1])
    for _ in range(iterations):
        p = 1.0 / (1.0 + np.exp(-np.clip(x @ w, -40, 40)))
        gradient = x.T @ (p - target) + penalty @ w
        hessian = (x * (p * (1 - p))[:, None]).T @ x + penalty + 1e-9 * np.eye(x.shape[1])
        step = np.linalg.solve(hessian, gradient)
        w -= step
        if float(np.abs(step).max()) < 1e-10:
            break
    return Platt(tuple(round(float(v), 4) for v in w[:-1]), round(float(w[-1]), 4))


def fit_monotone(inputs: np.ndarray, labels: np.ndarray, signals: int) -> Platt:
    """Platt scaling over a model's inputs (its ``signals``, then each times the place), such that each signal's
    weight at every place, ``w + v * log2(1 + rank)``, stays at or above 0: a stronger match never scores lower at
    the same rank. The free fit can break that (a review's: keyword alone weighed its score negatively from rank 9
    on, so an exact match there scored below a weak one); a signal whose weight falls below 0 at one end of the
    places is refitted with its weight held at 0 there (linear in the place, it is then at or above 0 throughout),
    and one still negative is left out."""
    ends = {"first": 1.0, "deepest": math.log2(1 + POSITION_DEPTH)}
    held: dict[int, str | None] = {}  # signal -> the end its weight is held at 0 at; None: left out
    while True:
        columns: list[np.ndarray] = []
        layout: list[tuple[int, str | None]] = []
        for i in range(signals):
            alone, placed = inputs[:, i], inputs[:, signals + i]
            if i not in held:
                columns += [alone, placed]
                layout.append((i, None))
            elif (end := held[i]) is not None:  # w * signal + v * signal * place with v = -w / place_at_end
                columns.append(alone - placed / ends[end])
                layout.append((i, end))
        fitted = fit_platt(np.column_stack(columns) if columns else np.zeros((len(labels), 0)), labels)
        weights, placed_weights, k = [0.0] * signals, [0.0] * signals, 0
        for i, end in layout:
            if end is None:
                weights[i], placed_weights[i] = fitted.weights[k], fitted.weights[k + 1]
                k += 2
            else:
                # Rounded toward 0, so that the weight at that end is not below 0 by a rounding (a review's).
                weights[i], placed_weights[i] = (
                    fitted.weights[k],
                    math.trunc(-fitted.weights[k] / ends[end] * 1e4) / 1e4,
                )
                k += 1
        broken: dict[int, str | None] = {}
        for i in range(signals):
            at = {end: weights[i] + placed_weights[i] * place for end, place in ends.items()}
            if min(at.values()) < -1e-9:
                broken[i] = None if i in held else min(at, key=lambda end: at[end])
        if not broken:
            return Platt((*weights, *placed_weights), fitted.bias)
        held |= broken


@dataclass(frozen=True)
class ReliabilityBin:
    low: float
    high: float
    count: int
    mean_score: float
    observed: float
    """The share of the bin's results that are relevant."""


def reliability(
    scores: Sequence[float] | np.ndarray, labels: Sequence[bool] | np.ndarray, bins: int = 10
) -> tuple[list[ReliabilityBin], float]:
    """The reliability table (equal-width score bins, a score of 1 in the last; empty ones left out) and the
    expected calibration error: the bins' |share relevant - mean score|, weighted by their counts (Naeini, Cooper
    and Hauskrecht, AAAI 2015)."""
    score = np.asarray(scores, dtype=np.float64)
    relevant = np.asarray(labels, dtype=np.float64)
    if not len(score):
        return [], 0.0
    which = np.minimum((score * bins).astype(np.int64), bins - 1)
    counts = np.bincount(which, minlength=bins)
    score_sums = np.bincount(which, weights=score, minlength=bins)
    relevant_sums = np.bincount(which, weights=relevant, minlength=bins)
    table = [
        ReliabilityBin(
            b / bins, (b + 1) / bins, int(counts[b]), score_sums[b] / counts[b], relevant_sums[b] / counts[b]
        )
        for b in range(bins)
        if counts[b]
    ]
    return table, float(np.abs(relevant_sums - score_sums).sum() / len(score))
