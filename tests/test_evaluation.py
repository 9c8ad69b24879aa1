"""The evaluation harness: dataset loading, metrics against trec_eval's, early-exit calibration, and a small
dataset through the real path."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ontofabric.contracts import FoundBy, QueryMeta, QueryResponse, SearchResult
from ontofabric.contracts.query import LateInteractionReport
from ontofabric.services.ops.beir import BeirDataset, DatasetError, judged_outside, load_beir, write_beir
from ontofabric.services.ops.eval_report import run_file_scores, run_file_stem, write_trec_run
from ontofabric.services.ops.evaluation import CONFIGS, evaluate, hybrid_margins
from ontofabric.services.ops.measures import ExitPoint, Margin, calibrate_early_exit, compute_metrics, margin
from ontofabric.shared.onnx_models import embedder_name
from ontofabric.shared.runtime import Endpoints
from ontofabric.shared.settings import Settings

from .conftest import RecordedProgress


def _write_dataset(
    root: Path, corpus: list[dict[str, str]], queries: dict[str, str], qrels: list[tuple[str, str]]
) -> Path:
    judged: dict[str, dict[str, int]] = {}
    for query_id, doc_id in qrels:
        judged.setdefault(query_id, {})[doc_id] = 1
    return write_beir(BeirDataset(root.name, "test", corpus, queries, judged), root)


def test_metrics_match_hand_computed_values() -> None:
    qrels = {"q1": {"d1": 1}, "q2": {"d2": 1, "d3": 1}}
    run = {"q1": {"x": 3.0, "d1": 2.0, "y": 1.0}, "q2": {"d3": 2.0, "z": 1.0}}
    metrics = compute_metrics(qrels, run)
    ndcg_q1 = (1 / math.log2(3)) / 1.0
    ndcg_q2 = 1.0 / (1.0 + 1 / math.log2(3))
    assert metrics["nDCG@10"] == pytest.approx((ndcg_q1 + ndcg_q2) / 2)
    assert metrics["Recall@10"] == pytest.approx((1.0 + 0.5) / 2)
    assert metrics["MRR@10"] == pytest.approx((0.5 + 1.0) / 2)
    # A judged query the run does not answer counts as zero, not as missing.
    assert compute_metrics({"q1": {"d1": 1}, "q9": {"d9": 1}}, {"q1": {"d1": 1.0}})["nDCG@10"] == pytest.approx(0.5)


def test_dataset_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"corpus\.jsonl is missing"):
        load_beir(tmp_path, "test")
    root = _write_dataset(tmp_path / "ok", [{"_id": "d", "title": "", "text": "t"}], {"q": "x"}, [("q", "d")])
    assert load_beir(root, "test").qrels == {"q": {"d": 1}}
    (root / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq-unknown\td\t1\n")
    with pytest.raises(DatasetError, match=r"not in queries\.jsonl"):
        load_beir(root, "test")
    # Numeric ids are read as the text the qrels use; a missing or null title or text is empty.
    (root / "corpus.jsonl").write_text('{"_id": 7, "text": "no title"}\n{"_id": "8", "title": null}\n')
    (root / "queries.jsonl").write_text('{"_id": 1, "text": "x"}\n{"_id": 2, "text": null}\n')
    (root / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n1\t7\t1\n")
    dataset = load_beir(root, "test")
    assert dataset.corpus == [{"_id": "7", "title": "", "text": "no title"}, {"_id": "8", "title": "", "text": ""}]
    assert (dataset.queries, dataset.qrels) == ({"1": "x", "2": ""}, {"1": {"7": 1}})
    # A line that is no object with an _id, or a score that is no integer, names its place.
    for bad, error in (("[1, 2]", r"corpus\.jsonl:2: expected a JSON object"), ('{"text": "t"}', r"corpus\.jsonl:2"),
                       ("{oops", r"corpus\.jsonl:2: not JSON")):  # fmt: skip
        (root / "corpus.jsonl").write_text('{"_id": "7", "text": "t"}\n' + bad + "\n")
        with pytest.raises(DatasetError, match=error):
            load_beir(root, "test")
    (root / "corpus.jsonl").write_text('{"_id": "7", "text": "t"}\n')
    (root / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n1\t7\t1.5\n")
    with pytest.raises(DatasetError, match=r"test\.tsv:2: score '1\.5' is no integer"):
        load_beir(root, "test")


def test_qrels_in_the_shapes_real_sets_have_are_read_and_others_named(tmp_path: Path) -> None:
    """An evaluation tester's: a row separated by spaces was dropped without a word (its query gone, the numbers
    wrong); a byte order mark or a file without the header line was refused, the first with a misleading message."""
    corpus = [{"_id": "7", "title": "", "text": "t"}, {"_id": "8", "title": "", "text": "u"}]
    root = _write_dataset(tmp_path, corpus, {"1": "x", "2": "y"}, [("1", "7")])
    qrels, queries = root / "qrels" / "test.tsv", root / "queries.jsonl"
    expected = {"1": {"7": 1, "8": 0}, "2": {"8": 2}}
    for shape in (
        "query-id\tcorpus-id\tscore\n1\t7\t1\n1 8 0\n2\t8\t2\t\n",  # spaces on one line, a trailing tab
        "\ufeffquery-id\tcorpus-id\tscore\r\n1\t7\t1\r\n1\t8\t0\r\n2\t8\t2\r\n\r\n",  # BOM, CRLF, a blank end
        "1\t7\t1\n1\t8\t0\n2\t8\t2\n",  # no header line
        "1 0 7 1\n1 0 8 0\n2 0 8 2\n",  # TREC's four columns
        "query-id\tcorpus-id\tscore\titeration\n1\t7\t1\t0\n1\t8\t0\t0\n2\t8\t2\t0\n",  # an extra column
        'query-id\tcorpus-id\tscore\n"1"\t"7"\t1\n1\t8\t0\n2\t8\t2\n',  # quoted, as csv writes a field
    ):
        qrels.write_text(shape, encoding="utf-8")
        assert load_beir(root, "test").qrels == expected, shape
    queries.write_text('\ufeff{"_id": "1", "text": "x"}\n{"_id": "2", "text": "y"}\n', encoding="utf-8")
    assert load_beir(root, "test").queries == {"1": "x", "2": "y"}
    for shape, error in (
        ("1\t7\n", r"test\.tsv:1: expected query-id, corpus-id and score"),
        ("1\t7\t1\n1\t7\t0\n", r"test\.tsv:2: '1' and '7' are judged twice, 1 and 0"),
        ("query-id\tcorpus-id\tscore\n", r"judges no document relevant"),
        ("1\t7\t0\n", r"judges no document relevant"),
        ("q 1 7 1\n", r"test\.tsv:1: expected query-id, corpus-id and score"),  # an id with a space: not TREC's
        ("query_id\tdoc_id\trelevance\n1\t7\t1\n", r"test\.tsv:1: score 'relevance' is no integer \(a header"),
    ):
        qrels.write_text(shape, encoding="utf-8")
        with pytest.raises(DatasetError, match=error):
            load_beir(root, "test")
    qrels.write_text("1\t7\t1\n1\t7\t1\n1\tgone\t1\n", encoding="utf-8")  # the same judgment twice is one
    dataset = load_beir(root, "test")
    assert dataset.qrels == {"1": {"7": 1, "gone": 1}}
    assert judged_outside(dataset) == [("1", "gone")]
    queries.write_text('{"_id": "1", "text": "x"}\n{"_id": "1", "text": "another"}\n', encoding="utf-8")
    with pytest.raises(DatasetError, match=r"query id '1' is repeated with another text"):
        load_beir(root, "test")
    with pytest.raises(DatasetError, match=r"the splits here: test"):
        load_beir(root, "dev")


def _answer(found: list[tuple[str, float, float]], late_interaction: bool) -> QueryResponse:
    """A dense-only answer: (id, the result's score, the cosine dense found it with), in the answer's order."""
    results = [
        SearchResult(id=doc_id, score=score, rank=rank, content=None, object_type="t.T", source_domain="t",
                     metadata={}, found_by=[FoundBy(retriever="dense", rank=rank, score=cosine)])
        for rank, (doc_id, score, cosine) in enumerate(found, start=1)
    ]  # fmt: skip
    report = LateInteractionReport(weight=0.2, candidates=2, with_token_vectors=2) if late_interaction else None
    meta = QueryMeta(
        ontology_version="1-a", workspace="w", branch="main", hybrid=False, reranked=False, cache_hit=False,
        backend="postgres-bm25", retrievers=["dense"], timings_ms={}, late_interaction=report,
    )  # fmt: skip
    return QueryResponse(results=results, _meta=meta)


def test_a_run_file_keeps_the_order_that_was_judged(tmp_path: Path) -> None:
    # Late interaction put "b" first although dense found "a" with the higher cosine.
    reordered = _answer([("b", 0.8, 0.41), ("a", 0.2, 0.52)], late_interaction=True)
    # Its scores may tie (calibrated ones are pooled to descend): the file keeps the rank, not the score.
    assert run_file_scores(reordered.results, reordered.meta, single_retriever=True) == {"b": 2.0, "a": 1.0}
    as_found = _answer([("a", 0.9, 0.52), ("b", 0.7, 0.41)], late_interaction=False)
    assert run_file_scores(as_found.results, as_found.meta, single_retriever=True) == {"a": 0.52, "b": 0.41}
    assert run_file_stem("scifact-train[60 queries, 1500 documents, seed 0]") == (
        "scifact-train-60-queries-1500-documents-seed-0"
    )
    write_trec_run(tmp_path / "x.run", {"q": {"b": 0.5, "a": 0.5, "c": 0.7}}, "tag")
    lines = (tmp_path / "x.run").read_text().splitlines()
    assert [line.split()[2:4] for line in lines] == [["b", "1"], ["a", "2"], ["c", "3"]]  # as given, not re-sorted


def test_early_exit_calibration() -> None:
    confident = [ExitPoint(0.9, 2, True)] * 12
    noisy = [ExitPoint(0.7, 2, i % 2 == 0) for i in range(12)]
    long_queries = [ExitPoint(0.95, 9, False)] * 5
    calibration = calibrate_early_exit(confident + noisy + long_queries, configured=0.8, queries=40)
    assert calibration.suggested_threshold == 0.9
    assert calibration.fires_at_configured == pytest.approx(12 / 40)  # over every judged query
    assert calibration.precision_at_configured == pytest.approx(1.0)
    assert calibration.rerank_gain_when_fired is None
    assert calibrate_early_exit(noisy, configured=0.8, queries=12).suggested_threshold is None
    fired = [ExitPoint(0.9, 2, True, query_id=f"q{i}") for i in range(3)]
    gains = {"q0": 0.1, "q1": -0.1, "q2": 0.3, "other": 5.0}
    assert calibrate_early_exit(fired, 0.8, 3, gains).rerank_gain_when_fired == pytest.approx(0.1)


def test_margin_over_queries_with_a_paired_bootstrap_interval() -> None:
    def measured(scores: dict[str, float], reference: dict[str, float]) -> Margin:
        found = margin("hybrid", "dense", scores, reference)
        assert found is not None
        return found

    # The same gain on every query, whatever the query's own score: paired, there is nothing to doubt.
    reference = {f"q{n}": n / 100 for n in range(100)}
    steady = measured({q: v + 0.01 for q, v in reference.items()}, reference)
    assert (steady.better, steady.worse, steady.equal) == (100, 0, 0)
    for value in (steady.difference, steady.ci_low, steady.ci_high):
        assert value == pytest.approx(0.01)
    # Half the queries gain 0.2, half lose 0.2: the 95 % interval is about ±1.96·0.2/√100 = ±0.039 (unpaired,
    # it would be ±0.028).
    scores = {f"q{n}": 0.2 if n % 2 else 0.0 for n in range(100)}
    split = measured(scores, {f"q{n}": 0.0 if n % 2 else 0.2 for n in range(100)})
    assert split.difference == pytest.approx(0.0)
    assert split.ci_low == pytest.approx(-0.039, abs=0.005)
    assert split.ci_high == pytest.approx(0.039, abs=0.005)
    assert (split.better, split.worse, split.equal) == (50, 50, 0)
    # A query only one side answered counts zero on the other; a tie in float noise is a tie.
    partial = measured({"a": 1.0, "b": 0.1 + 0.2}, {"b": 0.3, "c": 0.25})
    assert (partial.better, partial.worse, partial.equal) == (1, 1, 1)
    assert partial.difference == pytest.approx((1.0 - 0.25) / 3)
    assert margin("hybrid", "dense", {}, {}) is None


def test_hybrid_margins_compare_with_the_stronger_retriever() -> None:
    per_query = {
        "dense": {"q1": 0.5, "q2": 0.5},
        "keyword": {"q1": 1.0, "q2": 0.5},  # the stronger one here
        "hybrid": {"q1": 0.5, "q2": 1.0},
        "hybrid-rerank": {"q1": 0.0, "q2": 1.0},
        "hybrid-fusion-only": {"q1": 1.0, "q2": 1.0},
        "dense-late-interaction": {"q1": 0.5, "q2": 0.0},
    }
    found = [(m.config, m.against, m.difference) for m in hybrid_margins(per_query)]
    assert found == [
        ("hybrid", "keyword", pytest.approx(0.0)),
        ("hybrid-rerank", "keyword", pytest.approx(-0.25)),
        ("hybrid-fusion-only", "keyword", pytest.approx(0.25)),
        ("hybrid", "dense-late-interaction", pytest.approx(0.5)),
    ]
    per_query["dense"] = {"q1": 1.0, "q2": 1.0}  # now dense is
    assert [(m.config, m.against) for m in hybrid_margins(per_query)][:3] == [
        ("hybrid", "dense"), ("hybrid-rerank", "dense"), ("hybrid-fusion-only", "dense"),
    ]  # fmt: skip
    # Without a keyword run only the default request's pair with dense late interaction is left.
    del per_query["keyword"]
    assert [(m.config, m.against) for m in hybrid_margins(per_query)] == [("hybrid", "dense-late-interaction")]


@pytest.mark.slow
async def test_a_small_dataset_through_the_real_path(
    tmp_path: Path,
    deployment_settings: Settings,
    servers: Endpoints,
    deployment: object,
    tiny_cross_encoder: Path,
    tiny_onnx_embedder: Path,
    nats_logins: dict[str, tuple[str, str]],
) -> None:
    corpus = [
        {"_id": "py", "title": "Python", "text": "Python is a programming language with dynamic typing."},
        {"_id": "pg", "title": "PostgreSQL", "text": "PostgreSQL is a relational database with full-text search."},
        {"_id": "nats", "title": "NATS", "text": "NATS is a messaging system; JetStream adds persistence."},
        {
            "_id": "bm25",
            "title": "BM25",
            "text": "BM25 ranks documents by term frequency and inverse document frequency.",
        },
        # A document with a query's own id and text (as in ArguAna): BEIR does not count it as an answer.
        {"_id": "q2", "title": "", "text": "a message broker with persistence"},
        # The contract refuses NUL characters: the entry is reported and left out, the rest is measured.
        {"_id": "nul", "title": "", "text": "a NUL \x00 in the text"},
    ]
    queries = {
        "q1": "which database has full text search",
        "q2": "a message broker with persistence",
        "q3": "ranking function with term frequency",
        "blank": "  ",  # no query the contract accepts: it scores zero and counts as an error, the run goes on
    }
    judged = [("q1", "pg"), ("q2", "nats"), ("q3", "bm25"), ("blank", "py")]
    root = _write_dataset(tmp_path / "tiny", corpus, queries, judged)
    settings = deployment_settings.model_copy(
        update={
            "embedder": "local",
            "cache_dir": tmp_path / "cache",
            "reranker": "local",
            "reranker_model_path": tiny_cross_encoder,
            # Second vectors by a random tiny model, weighed too little to move any answer: the path is measured.
            "second_vectors": True,
            "second_vectors_model_path": tiny_onnx_embedder,
            "second_opinion_weight": 0.01,
            # q1 and q3 are longer: a deployment would refuse them, the evaluation answers them and says so.
            "max_query_chars": 34,
        }
    )
    endpoints = Endpoints(servers.nats_url, deployment_settings.database_url or "", nats_logins)
    configs = list(CONFIGS)
    report = await evaluate(settings, endpoints, load_beir(root, "test"), configs, RecordedProgress())
    assert report.documents == 6
    assert report.documents_loaded == 5
    [(refused_id, why)] = report.refused_documents
    assert refused_id == "nul"
    assert "NUL" in why
    assert (report.queries, report.over_query_limit) == (4, 2)
    for config in configs:
        result = report.configs[config]
        assert result.errors == 1
        assert result.degraded == 0
        if config != "hybrid-rerank":  # its cross-encoder has random weights
            assert result.metrics["MRR@10"] == pytest.approx(0.75), config  # three of four right at rank 1
    assert report.configs["hybrid"].meta["fusion"]["method"] == "adaptive"
    assert report.configs["hybrid-fusion-only"].meta["fusion"]["method"] == "adaptive"
    assert report.configs["hybrid"].meta["reranked"] is False  # a reranker is set up, but precision was not asked
    assert report.configs["hybrid-rerank"].meta["reranked"] is True
    assert report.configs["hybrid-rerank"].meta["reranker"] == "cross-encoder"  # the worker built the configured one
    assert report.configs["keyword"].meta["retrievers"] == ["keyword"]
    # Token vectors went with the deltas, through the projector, to the query worker; only the configurations
    # that measure the retrievers alone and the fusion alone go without late interaction.
    for config in ("hybrid", "hybrid-rerank", "dense-late-interaction"):
        assert report.configs[config].meta["lateInteraction"] == {
            "weight": settings.late_interaction_weight, "candidates": 5, "withTokenVectors": 5,
        }, config  # fmt: skip
    for config in ("dense", "keyword", "hybrid-fusion-only"):
        assert report.configs[config].meta["lateInteraction"] is None, config
        assert "lateInteraction" not in report.configs[config].stages_p50_ms
    assert report.configs["hybrid"].stages_p50_ms["lateInteraction"] > 0
    # Second vectors went the same way; the configurations that turn the second opinion off go without it.
    for config in ("hybrid", "hybrid-rerank"):
        assert report.configs[config].meta["secondOpinion"] == {
            "model": embedder_name(tiny_onnx_embedder), "weight": 0.01, "candidates": 5, "withSecondVectors": 5,
        }, config  # fmt: skip
    for config in ("dense", "keyword", "hybrid-fusion-only", "dense-late-interaction", "hybrid-no-second-opinion"):
        assert report.configs[config].meta["secondOpinion"] is None, config
    assert report.configs["hybrid"].late_interaction_skipped == 0  # short queries
    assert (tmp_path / "cache" / "embeddings.sqlite").exists()  # a second run would not embed again
    # Scores calibrated, measured over each answered query's leading results, whose points are kept for
    # `ontofabric calibrate`.
    for config in ("dense", "keyword", "hybrid"):
        assert report.configs[config].uncalibrated == 0, config
        error = report.configs[config].calibration_error
        assert error is not None
        assert 0.0 <= error <= 1.0
        points = [p for p in report.calibration_points if p.config == config]
        assert {p.query for p in points} == {"q1", "q2", "q3"}
        assert all(p.signals for p in points)
        assert sum(p.relevant for p in points) == 3
        # At the place the answer scored each at: q2's own document, left out as BEIR does, took the first.
        places = {q: [p.rank for p in points if p.query == q] for q in ("q1", "q2", "q3")}
        assert places["q2"] == list(range(2, 2 + len(places["q2"]))), (config, places)
        assert places["q1"] == list(range(1, 1 + len(places["q1"]))), (config, places)
    assert "calibration_points" not in report.to_json()
    # Every hybrid configuration against the stronger retriever, over the four judged queries; here every
    # configuration but the random cross-encoder answers each query alike, a tie, where dense counts as stronger.
    assert [(m.config, m.against) for m in report.margins] == [
        ("hybrid", "dense"), ("hybrid-rerank", "dense"), ("hybrid-fusion-only", "dense"),
        ("hybrid", "dense-late-interaction"), ("hybrid", "hybrid-no-second-opinion"),
    ]  # fmt: skip
    for m in report.margins:
        assert m.better + m.worse + m.equal == 4
        if m.config != "hybrid-rerank":
            assert (m.difference, m.equal) == (pytest.approx(0.0), 4)


def test_report_table_names_the_early_exit_calibration() -> None:
    from ontofabric.services.ops.eval_report import ConfigResult, EvalReport, render_table

    report = EvalReport(
        dataset="tiny",
        split="test",
        documents=5,
        documents_loaded=4,
        queries=3,
        configs={
            "hybrid": ConfigResult(
                metrics={"nDCG@10": 0.5, "Recall@10": 1.0, "Recall@100": 1.0, "MRR@10": 0.5},
                stages_p50_ms={"embed": 10.25, "total": 30.0},
                late_interaction_skipped=2,
            ),
            "hybrid-rerank": ConfigResult(skipped="no reranker configured"),
        },
        load_seconds=1.0,
        early_exit=calibrate_early_exit([ExitPoint(0.9, 2, True)], configured=0.8, queries=1),
        margins=hybrid_margins(  # q1 differs by float noise only (-5.6e-17): a tie, and no "-0.0000" printed
            {
                "dense": {"q1": 0.1 + 0.2, "q2": 0.5, "q3": 1.0},
                "keyword": {},
                "hybrid": {"q1": 0.3, "q2": 1.0, "q3": 0.5},
            }
        ),
    )
    lines: list[str] = []
    render_table(report, lines.append)
    assert lines[1].startswith("warning: only 4 documents were loaded")  # none refused: the projector lost one
    assert lines[4].startswith("| hybrid | 0.5000 | 1.0000 | 1.0000 | 0.5000 |")
    assert lines[5] == "| hybrid-rerank | skipped: no reranker configured |"
    assert lines[6] == "hybrid: late interaction skipped for 2 long queries"
    assert lines[7] == "hybrid, worker-side p50 ms per stage: embed 10.2, total 30.0"
    assert lines[8].startswith("hybrid over dense: +0.0000 nDCG@10, 95% interval -0.")
    assert lines[8].endswith("(paired bootstrap over 3 queries); better on 1, worse on 1, equal on 1")
    assert lines[9].startswith("early exit at keyword saturation >= 0.8: fires for 100.0% of queries")


def test_report_table_tells_refused_entries_from_lost_ones() -> None:
    from ontofabric.services.ops.eval_report import EvalReport, render_table

    def warnings(loaded: int) -> list[str]:
        report = EvalReport(
            dataset="tiny", split="test", documents=5, documents_loaded=loaded, queries=1, configs={},
            load_seconds=1.0, refused_documents=[("nul", "content: text must not contain NUL characters")],
        )  # fmt: skip
        lines: list[str] = []
        render_table(report, lines.append)
        return [line for line in lines if line.startswith("warning")]

    refused = "warning: 1 corpus entries were refused by the document contract and not loaded, e.g. 'nul': content"
    long_queries = EvalReport(
        dataset="tiny", split="test", documents=5, documents_loaded=5, queries=3, configs={}, load_seconds=1.0,
        over_query_limit=2,
    )  # fmt: skip
    lines: list[str] = []
    render_table(long_queries, lines.append)
    assert "note: 2 judged queries are longer than ONTOFABRIC_MAX_QUERY_CHARS: answered here, refused by" in lines[1]
    assert [w[: len(refused)] for w in warnings(4)] == [refused]  # the other four all arrived
    assert warnings(3)[1].startswith("warning: only 3 documents were loaded")
