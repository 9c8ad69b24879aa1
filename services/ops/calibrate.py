"""Fitting the score calibration (``ontofabric calibrate``) on what ``ontofabric eval --calibration-points`` saw:
each judged query's leading results, their signals, and whether they are relevant.

Each calibration model learns from the configuration that runs it (dense alone, keyword alone, the default
hybrid request), pooled over every dataset given. Each dataset is also held out in turn (the model fitted on the
others): the error there is what a collection the fit has not seen can expect.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ontofabric.services.query.calibration import (
    MODELS,
    SIGNALS,
    Calibration,
    Platt,
    fit_monotone,
    judged,
    reliability,
)

CONFIG_OF_MODEL = {"dense": "dense", "keyword": "keyword", "hybrid": "hybrid"}
"""The ``ontofabric eval`` configuration whose results each calibration model judges."""


@dataclass(frozen=True)
class Point:
    dataset: str
    config: str
    query: str
    rank: int
    signals: dict[str, float]
    relevant: bool
    score: float
    """The score the answer gave it (with the calibration the eval ran with)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def write_points(path: Path, points: Iterable[Point]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        out.writelines(point.to_json() + "\n" for point in points)


class PointsError(ValueError):
    pass


def read_points(paths: Sequence[Path]) -> list[Point]:
    points = []
    for path in paths:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                points.append(Point(**json.loads(line)))
            except (ValueError, TypeError) as error:
                raise PointsError(f"{path}:{number}: not a calibration point ({error})") from error
    return points


@dataclass(frozen=True)
class _Judged:
    """The points one model judges: their inputs, labels, and queries (what a bootstrap resamples)."""

    signals: np.ndarray
    labels: np.ndarray
    queries: list[str]


def _inputs(model: str, points: Sequence[Point]) -> _Judged:
    """The points ``model`` judges (as ``Calibration.probability`` chooses)."""
    rows, labels, queries = [], [], []
    for point in points:
        judgement = judged(model, point.signals, point.rank)
        if judgement is not None and judgement[0] == model:
            rows.append(judgement[1])
            labels.append(point.relevant)
            queries.append(f"{point.dataset}/{point.query}")
    width = 2 * SIGNALS[model]  # the signals, and each times the place
    return _Judged(np.array(rows, dtype=np.float64).reshape(-1, width), np.array(labels, dtype=np.float64), queries)


def _probabilities(platt: Platt, judged_points: _Judged) -> np.ndarray:
    return np.array([platt.probability(row) for row in judged_points.signals])


def _error(platt: Platt, judged_points: _Judged) -> float:
    return reliability(_probabilities(platt, judged_points), judged_points.labels)[1]


def error_interval(
    probabilities: np.ndarray, labels: np.ndarray, queries: Sequence[str], resamples: int = 200, seed: int = 0
) -> tuple[float, float]:
    """A 95 % bootstrap interval of the expected calibration error, resampling queries (a query's results are
    not independent of each other)."""
    groups: dict[str, list[int]] = {}
    for index, query in enumerate(queries):
        groups.setdefault(query, []).append(index)
    members = [np.array(indices) for indices in groups.values()]
    rng = np.random.default_rng(seed)
    errors = []
    for _ in range(resamples):
        chosen = np.concatenate([members[i] for i in rng.integers(0, len(members), len(members))])
        errors.append(reliability(probabilities[chosen], labels[chosen])[1])
    low, high = np.percentile(errors, [2.5, 97.5])
    return float(low), float(high)


@dataclass(frozen=True)
class ModelFit:
    model: str
    fitted: Platt
    points: int
    relevant: int
    error_now: dict[str, float]
    """Expected calibration error per dataset with the coefficients given (the settings')."""
    error_fitted: dict[str, float]
    """The same with the pooled fit (on data it was fitted on)."""
    error_held_out: dict[str, tuple[float, float, float]]
    """The same with a fit on the other datasets only, with its 95 % interval; absent with a single dataset."""


def fit_models(points: Sequence[Point], current: Calibration) -> list[ModelFit]:
    fits = []
    datasets = sorted({p.dataset for p in points})
    for model in MODELS:
        mine = [p for p in points if p.config == CONFIG_OF_MODEL[model]]
        pooled = _inputs(model, mine)
        if not len(pooled.labels):
            continue
        fitted = fit_monotone(pooled.signals, pooled.labels, SIGNALS[model])
        now, in_sample, held_out = {}, {}, {}
        for dataset in datasets:
            own = _inputs(model, [p for p in mine if p.dataset == dataset])
            others = _inputs(model, [p for p in mine if p.dataset != dataset])
            if not len(own.labels):
                continue
            now[dataset] = _error(current.model(model), own)
            in_sample[dataset] = _error(fitted, own)
            if len(others.labels) and others.labels.sum() > 0:
                probabilities = _probabilities(fit_monotone(others.signals, others.labels, SIGNALS[model]), own)
                error = reliability(probabilities, own.labels)[1]
                held_out[dataset] = (error, *error_interval(probabilities, own.labels, own.queries))
        fits.append(ModelFit(model, fitted, len(pooled.labels), int(pooled.labels.sum()), now, in_sample, held_out))
    return fits


def render_fits(fits: Sequence[ModelFit]) -> list[str]:
    lines = ["| model | points (relevant) | weights, bias | dataset | ECE now | ECE fitted | ECE held out (95 %) |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for fit in fits:
        for dataset, now in fit.error_now.items():
            held = fit.error_held_out.get(dataset)
            out = "n/a" if held is None else f"{held[0]:.4f} ({held[1]:.4f}-{held[2]:.4f})"
            lines.append(
                f"| {fit.model} | {fit.points} ({fit.relevant}) | {fit.fitted.coefficients()} | {dataset} | {now:.4f} "
                f"| {fit.error_fitted[dataset]:.4f} | {out} |"
            )
    lines.append("settings:")
    lines += [f"ONTOFABRIC_CALIBRATION_{fit.model.upper()}='{json.dumps(fit.fitted.coefficients())}'" for fit in fits]
    return lines
