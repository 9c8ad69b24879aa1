"""Calibrated scores: Platt scaling fitted and applied (services/query/calibration.py), the fit over evaluation
points (services/ops/calibrate.py), and what an answer's scores then mean."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest

from ontofabric.contracts import QueryResponse
from ontofabric.services.ops.beir import BeirDataset, load_beir, write_beir
from ontofabric.services.ops.calibrate import Point, fit_models, read_points, write_points
from ontofabric.services.query.calibration import (
    POSITION_DEPTH,
    SIGNALS,
    Calibration,
    Platt,
    fit_monotone,
    fit_platt,
    judged,
    model_for,
    reliability,
    result_signals,
)
from ontofabric.services.query.client import QueryClient
from ontofabric.services.query.config import PipelineConfig
from ontofabric.services.query.core import Candidate
from ontofabric.services.query.fusion import SHORT_LIST
from ontofabric.services.query.symbols import ranked_places
from ontofabric.shared.embedder import Embedder

from .benchmarks.unanswerable_set import with_unanswerable
from .conftest import Deployment, Start


def _sample(weights: tuple[float, ...], bias: float, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 1, size=(n, len(weights)))
    p = 1 / (1 + np.exp(-(x @ np.array(weights) + bias)))
    return x, (rng.uniform(size=n) < p).astype(np.float64)


def test_fit_platt_recovers_the_model_that_made_the_labels() -> None:
    x, y = _sample((6.0, 3.0), -5.0, 20_000, seed=1)
    fitted = fit_platt(x, y)
    assert fitted.weights == pytest.approx((6.0, 3.0), abs=0.4)
    assert fitted.bias == pytest.approx(-5.0, abs=0.3)
    # Calibrated on new data drawn the same way: the expected calibration error is small.
    x2, y2 = _sample((6.0, 3.0), -5.0, 20_000, seed=2)
    error = reliability([fitted.probability(row) for row in x2], [bool(v) for v in y2])[1]
    assert error < 0.02


def test_fit_platt_stays_finite_on_separable_data() -> None:
    x = np.array([[0.1], [0.2], [0.8], [0.9]])
    fitted = fit_platt(x, np.array([0.0, 0.0, 1.0, 1.0]))
    assert all(math.isfinite(v) for v in fitted.coefficients())
    assert fitted.probability((0.9,)) > 0.5 > fitted.probability((0.1,))


def test_reliability_bins_and_expected_calibration_error() -> None:
    scores = [0.05, 0.05, 0.95, 0.95, 0.55, 1.0]
    labels = [False, True, True, True, False, True]
    table, error = reliability(scores, labels)
    assert [(b.low, b.count) for b in table] == [(0.0, 2), (0.5, 1), (0.9, 3)]
    assert table[0].observed == 0.5
    # (2 * |0.5 - 0.05| + 1 * |0 - 0.55| + 3 * |1 - 0.9667|) / 6
    assert error == pytest.approx((2 * 0.45 + 0.55 + 3 * (1 - (0.95 + 0.95 + 1.0) / 3)) / 6)


def test_which_model_judges_what() -> None:
    assert model_for(["dense", "keyword"], keyword_scaled=True) == "hybrid"
    assert model_for(["dense", "keyword"], keyword_scaled=False) == "dense"  # Azure: no keyword signal
    assert model_for(["keyword"], keyword_scaled=True) == "keyword"
    assert model_for(["keyword"], keyword_scaled=False) is None
    # The signals, then each times log2(1 + rank); keyword 0 when the keyword list did not return it.
    assert judged("hybrid", {"cosine": 0.5}, 1) == ("hybrid", (0.5, 0.0, 0.5, 0.0))
    assert judged("hybrid", {"cosine": 0.5, "keyword": 0.25}, 3) == ("hybrid", (0.5, 0.25, 1.0, 0.5))
    assert judged("hybrid", {"keyword": 0.7}, 1) == ("keyword", (0.7, 0.7))  # its cosine was not read
    assert judged("dense", {"keyword": 0.7}, 1) is None
    # Past the depth the points were taken at, a result is judged as the last of it.
    assert (
        judged("dense", {"cosine": 1.0}, 50) == judged("dense", {"cosine": 1.0}, 10) == ("dense", (1.0, math.log2(11)))
    )
    # A setting of the earlier form (a weight per signal, then the bias) does not read the rank.
    calibration = Calibration(Platt.of([10.0, -5.0], 1), Platt.of([4.0, -2.0], 1), Platt.of([10.0, 4.0, -7.0], 2))
    assert calibration.probability("dense", {"cosine": 0.5}, 1) == pytest.approx(0.5)
    assert calibration.probability("dense", {"cosine": 0.5}, 7) == pytest.approx(0.5)
    assert calibration.probability("hybrid", {"cosine": 0.5, "keyword": 0.5}, 4) == pytest.approx(0.5)
    assert calibration.probability("keyword", {"cosine": 0.9}, 1) is None
    with pytest.raises(ValueError, match="4 coefficients for 2 signal"):
        Platt.of([1.0, 2.0, 3.0, 4.0], 2)
    by_rank = Calibration(Platt.of([10.0, -4.0, -3.0], 1), Platt.of([4.0, -2.0], 1), Platt.of([10.0, 4.0, -7.0], 2))
    assert by_rank.model("dense").coefficients() == [10.0, -4.0, -3.0]
    assert by_rank.probability("dense", {"cosine": 0.5}, 1) == pytest.approx(1 / (1 + math.exp(-(5 - 2 - 3))))
    assert by_rank.probability("dense", {"cosine": 0.5}, 3) == pytest.approx(1 / (1 + math.exp(-(5 - 4 - 3))))
    # What fits the rank cannot lift a result without signal: nothing measured, nothing but the bias.
    assert by_rank.probability("dense", {"cosine": 0.0}, 1) == by_rank.probability("dense", {"cosine": 0.0}, 9)


def test_results_placed_first_are_no_places() -> None:
    found_by = [{"symbol"}, {"dense"}, {"keyword", "dense"}, {"caller"}, {"keyword"}]
    assert ranked_places(found_by) == [None, 1, 2, None, 3]


def test_results_placed_first_keep_the_place_the_retrievers_gave_them() -> None:
    """A tester's: a definition that was the retrievers' own first hit lifted the next result to place 1."""
    found_by = [{"symbol", "dense"}, {"dense"}, {"keyword"}, {"caller"}, {"keyword"}]
    # The definition was ranked second before it was placed first, the caller not at all.
    assert ranked_places(found_by, [1, 0, 2, None, 3]) == [None, 1, 3, None, 4]
    assert ranked_places(found_by, [0, 1, 2, None, 3]) == [None, 2, 3, None, 4]
    assert ranked_places(found_by, [None, 0, 1, None, 2]) == [None, 1, 2, None, 3]


def test_result_signals_take_cosines_from_both_sources_and_scale_keyword_scores() -> None:
    signals = result_signals(
        [Candidate("a", 0.61), Candidate("b", 0.4)],
        [Candidate("b", 6.0), Candidate("c", 3.0)],
        keyword_ceiling=12.0,
        other_cosines={"c": 0.2},
    )
    assert signals == {
        "a": {"cosine": 0.61},
        "b": {"cosine": 0.4, "keyword": 0.5},
        "c": {"cosine": 0.2, "keyword": 0.25},
    }
    assert result_signals(None, [Candidate("c", 3.0)], keyword_ceiling=None) == {}


def test_a_keyword_list_that_ran_out_gives_each_hit_the_strength_the_fusion_weighs_it_by() -> None:
    """After an outside tester's made-up word, written once in a long function: saturated at 0.014 by BM25's
    length normalisation, its one holder led the answer with a calibrated score under the second result's."""
    keyword = [Candidate("long", 0.14), Candidate("mention", 0.07)]
    coverage = {"long": 1.0, "mention": 0.5}
    assert result_signals(None, keyword, keyword_ceiling=10.0, keyword_coverage=coverage) == {
        "long": {"keyword": 1.0},
        "mention": {"keyword": 0.25},  # half the query's term weight, at half the top hit's score
    }
    # Coverage not stated, or a list as long as the fusion reads as not run out: the saturation.
    assert result_signals(None, keyword, keyword_ceiling=10.0) == {
        "long": {"keyword": 0.014},
        "mention": {"keyword": 0.007},
    }
    full = [Candidate(f"d{i}", 1.0) for i in range(SHORT_LIST)]
    assert result_signals(None, full, 10.0, keyword_coverage={c.id: 1.0 for c in full})["d0"] == {"keyword": 0.1}


def test_fit_models_pools_datasets_and_holds_each_out(tmp_path: Path) -> None:
    rng = random.Random(5)
    points = []
    for dataset, shift in (("one", 0.0), ("two", 0.05)):
        for q in range(400):
            for rank in range(1, 4):
                cosine = rng.uniform(0, 1)
                relevant = rng.random() < 1 / (1 + math.exp(-(8 * (cosine + shift) - 5)))
                for config, signals in (("dense", {"cosine": cosine}), ("keyword", {"keyword": cosine})):
                    points.append(Point(dataset, config, f"q{q}", rank, signals, relevant, 0.5))
    write_points(tmp_path / "points.jsonl", points)
    assert read_points([tmp_path / "points.jsonl"]) == points
    flat = Calibration(Platt.of([0.0, 3.0], 1), Platt.of([0.0, 3.0], 1), Platt.of([0.0, 0.0, 3.0], 2))  # 0.95
    fits = {fit.model: fit for fit in fit_models(points, flat)}
    assert set(fits) == {"dense", "keyword"}  # no hybrid points
    dense = fits["dense"]
    assert dense.points == 2400
    assert dense.fitted.weights[0] == pytest.approx(8.0, abs=1.0)
    assert set(dense.error_held_out) == {"one", "two"}
    for dataset in ("one", "two"):
        assert dense.error_fitted[dataset] < dense.error_now[dataset]
        error, low, high = dense.error_held_out[dataset]
        assert low <= error <= high < dense.error_now[dataset]


def test_fit_models_reads_each_points_rank() -> None:
    """Where the order knows more than the signals (late interaction, the fusion), a result's rank says how much
    its signals count: the fit learns that from the points' ranks, and its estimates then fall with the rank."""
    rng = random.Random(11)
    points = []
    for q in range(600):
        for rank in range(1, 11):
            cosine = rng.uniform(0.2, 0.8)
            relevant = rng.random() < 1 / (1 + math.exp(-(9 * cosine - 2.5 * cosine * math.log2(1 + rank) - 4)))
            points.append(Point("one", "dense", f"q{q}", rank, {"cosine": cosine}, relevant, 0.5))
    (dense,) = [fit for fit in fit_models(points, PipelineConfig().calibration()) if fit.model == "dense"]
    assert dense.fitted.coefficients() == pytest.approx([9.0, -2.5, -4.0], abs=1.2)
    calibration = Calibration(dense.fitted, Platt.of([1.0, 0.0], 1), Platt.of([1.0, 1.0, 0.0], 2))
    estimates = [calibration.probability("dense", {"cosine": 0.6}, rank) for rank in range(1, 12)]
    assert estimates == sorted(estimates, reverse=True)
    assert estimates[0] > 2 * estimates[9]
    assert estimates[10] == estimates[9]  # past the points' depth, as at it


def _weights_by_place(platt: Platt, signals: int) -> list[float]:
    """Each signal's weight at each place 1..POSITION_DEPTH + 1."""
    w = platt.weights
    return [w[i] + w[signals + i] * math.log2(1 + min(r, POSITION_DEPTH)) for i in range(signals) for r in range(1, 12)]


def test_a_stronger_match_never_scores_lower_at_the_same_rank() -> None:
    """A review's: keyword alone's fitted weight turned negative from rank 9 (an exact match there scored below a
    weak one). The fit holds each signal's weight at or above 0 at every place; the defaults are such a fit."""
    rng = np.random.default_rng(3)
    n = 30_000
    signal, rank = rng.uniform(0, 1, n), rng.integers(1, 11, n)
    place = np.log2(1 + rank)
    # Relevance whose dependence on the signal fades, and reverses, with depth: a free fit follows it below 0.
    p = 1 / (1 + np.exp(-(9 * signal - 3.5 * signal * place - 3)))
    labels = (rng.uniform(size=n) < p).astype(np.float64)
    inputs = np.column_stack([signal, signal * place])
    free = fit_platt(inputs, labels)
    assert min(_weights_by_place(free, 1)) < -0.5  # the premise
    held = fit_monotone(inputs, labels, 1)
    assert min(_weights_by_place(held, 1)) >= -1e-9
    assert held.weights[0] > 5  # still a strong signal near the top
    defaults = PipelineConfig().calibration()
    for model in ("dense", "keyword", "hybrid"):
        assert min(_weights_by_place(defaults.model(model), SIGNALS[model])) >= -1e-9, model


def test_a_set_with_unanswerable_queries_judges_them_relevant_to_nothing(tmp_path: Path) -> None:
    """What the calibration is fitted on (tests/benchmarks/unanswerable_set.py): another set's questions added,
    each judged, none with anything relevant, the set's own kept as they were."""
    code = BeirDataset("code", "dev", [{"_id": "f", "title": "", "text": "def f(): ..."}], {"q": "a function"},
                       {"q": {"f": 1}})  # fmt: skip
    science = BeirDataset("science", "train", [], {"1": "cells divide", "2": "stars burn", "3": "x"},
                          {"1": {"d": 1}, "2": {"e": 1}})  # fmt: skip
    built = load_beir(write_beir(with_unanswerable(code, science, 5, seed=1), tmp_path / "set"), "dev")
    assert built.queries == {"q": "a function", "off-1": "cells divide", "off-2": "stars burn"}
    assert built.qrels == {"q": {"f": 1}, "off-1": {"f": 0}, "off-2": {"f": 0}}


OFF_TOPIC = ("chocolate cake recipe with fresh strawberries", "qzxv plokm wrtyb fnargle")
ON_TOPIC = "Read a CSV file into rows with the csv module and return a list of dictionaries."
CONFIGURATIONS: dict[str, tuple[dict[str, object], float]] = {  # request, the least its on-topic top hit scores
    "default": ({}, 0.5),
    "dense alone": ({"options": {"retrievers": ["dense"]}}, 0.5),
    # BM25 measures the document's text against every query term saturated: a long query is never near it.
    "keyword alone": ({"options": {"retrievers": ["keyword"]}}, 0.1),
}


async def test_off_topic_and_random_queries_keep_their_top_scores_low(
    seeded: int, deployment: Deployment, embedder: Embedder, start_query_worker: Start
) -> None:
    calibrated = await start_query_worker(embedder, query_cache_entries=0)
    client = QueryClient(deployment.nc, deployment.names)

    async def ask(text: str, **params: object) -> QueryResponse:
        reply = await client.query("acme", {"semanticQuery": text, **params})
        assert isinstance(reply, QueryResponse), reply
        return reply

    for name, (params, likely) in CONFIGURATIONS.items():
        on_topic = await ask(ON_TOPIC, **params)
        assert on_topic.meta.calibrated, name
        assert on_topic.results[0].id == "csv", name
        assert on_topic.results[0].score > likely, name
        # minRelevance keeps exactly the results scored at or above it, wherever they rank.
        kept = await ask(ON_TOPIC, minRelevance=0.01, **params)
        assert [r.id for r in kept.results] == [r.id for r in on_topic.results if r.score >= 0.01], name
        assert on_topic.results[0].signals, name  # what it was scored from
        for text in OFF_TOPIC:
            off = await ask(text, **params)
            assert off.meta.calibrated or not off.results, (name, text)
            assert all(r.score < 0.05 for r in off.results), (name, text, [r.score for r in off.results])
            # minRelevance now means what it says: nothing off-topic is likely relevant.
            assert (await ask(text, minRelevance=likely, **params)).results == [], (name, text)
        assert [r.id for r in (await ask(ON_TOPIC, minRelevance=likely, **params)).results] == ["csv"], name

    # A deployment that turns calibration off gets the relative relevance back: a lone weak hit scores 1.
    await start_query_worker(embedder, query_cache_entries=0, calibrated_scores=False)
    await calibrated.stop()
    relative = await ask(OFF_TOPIC[0], options={"retrievers": ["dense"]})
    assert not relative.meta.calibrated
    assert relative.results[0].score == 1.0
