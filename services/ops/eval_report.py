"""What ``ontofabric eval`` reports: per configuration its measures and latency, the margins, the early exit's
calibration; as a table, as JSON, and as TREC run files."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ontofabric.contracts import QueryMeta, SearchResult
from ontofabric.services.query.calibration import ReliabilityBin
from ontofabric.shared.embedder import wants_bfloat16
from ontofabric.shared.settings import Settings

from .calibrate import Point
from .measures import MEASURES, EarlyExitCalibration, Margin
from .quality_gate import Verdict

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_NOT_A_SETUP = ("url", "urls", "endpoint", "file", "dir", "path", "token", "tokens", "key", "seed", "password")
"""Ends of setting names that say where a process runs or what it logs in with, not how it retrieves."""
_NOT_A_SETUP_PART = ("log", "metrics", "trace", "subject")
"""Starts of the names of its logs, metrics, traces and subjects, which do not change an answer either."""


def retrieval_setup(settings: Settings) -> dict[str, str]:
    """What a measurement ran with, for its report and its quality-gate baseline: the embedding model and the
    precision it computed in on this CPU, the second vectors and reranker, and every other setting this run
    changed from its default (where it runs and its credentials left out), so two runs can be told apart."""
    setup = {
        "embeddingModel": settings.embedding_model,
        "embeddingPrecision": "bfloat16" if wants_bfloat16(settings.embedding_precision) else "float32",
        "secondVectors": "on" if settings.second_vectors else "off",
        "reranker": settings.reranker,
    }
    told = {"embedding_model", "embedding_precision", "second_vectors", "reranker"}
    for name, spec in Settings.model_fields.items():
        value = getattr(settings, name)
        where = name.rsplit("_", 1)[-1] in _NOT_A_SETUP or name.split("_", 1)[0] in _NOT_A_SETUP_PART
        if spec.default_factory is not None or value == spec.default or where or name in told:
            continue
        if isinstance(value, bool | int | float | str):
            setup[name] = str(value)
    return setup


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
    uncalibrated: int = 0
    """Answers whose scores were not calibrated (_meta.calibrated false)."""
    calibration_error: float | None = None
    """Expected calibration error of the scores of each query's leading results (evaluation.CALIBRATION_DEPTH)."""
    reliability: list[ReliabilityBin] = field(default_factory=list)


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
    per_query: dict[str, dict[str, float]] = field(default_factory=dict)
    """configuration -> query id -> nDCG@10: what a quality gate compares (services/ops/quality_gate.py)."""
    calibration_points: list[Point] = field(default_factory=list)
    """Each query's leading results with their signals and judgments (``--calibration-points``; not in the JSON)."""
    setup: dict[str, str] = field(default_factory=dict)
    """What it ran with (:func:`retrieval_setup`)."""
    over_query_limit: int = 0
    """Judged queries longer than the deployment's ``max_query_chars``: the evaluation answers them (some BEIR sets'
    queries are paragraphs), a deployment refuses them."""

    def to_json(self) -> dict[str, Any]:
        return json_without_points(self)


def setup_line(setup: dict[str, str]) -> str:
    """:func:`retrieval_setup` as a line of a report."""
    head = ("embeddingModel", "embeddingPrecision", "secondVectors", "reranker")
    changed = ", ".join(f"{name}={value}" for name, value in setup.items() if name not in head)
    return (
        f"run with {setup.get('embeddingModel')} in {setup.get('embeddingPrecision')}, second vectors "
        f"{setup.get('secondVectors')}, reranker {setup.get('reranker')}; settings changed: {changed or 'none'}"
    )


def json_without_points(report: DataclassInstance) -> dict[str, Any]:
    """A report as JSON without its ``calibration_points``, which ``--calibration-points`` writes apart."""
    fields = asdict(report)
    del fields["calibration_points"]
    return fields


def run_file_scores(results: Sequence[SearchResult], meta: QueryMeta, single_retriever: bool) -> dict[str, float]:
    """The score a run file keeps for each judged result, in the answer's order: the retriever's own where one
    retriever ran and no later stage reordered its list, else one that falls with the rank (the answer's scores
    may tie: calibrated ones are pooled to descend), so a tool that sorts the file by score sees the order that
    was judged (up to the retriever's own ties, which such tools break by document id)."""
    own = single_retriever and meta.late_interaction is None and not meta.reranked
    return {
        r.id: r.found_by[0].score if own and len(r.found_by) == 1 else float(len(results) - n)
        for n, r in enumerate(results)
    }


def run_file_stem(dataset: str) -> str:
    """A dataset's name as a run file's name begins: a sample's name (``scifact[60 queries, ...]``) held spaces,
    commas and brackets, awkward to hand to trec_eval or a shell (an evaluation tester's)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", dataset).strip("-") or "dataset"


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
    if report.setup:
        write(setup_line(report.setup))
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
    if report.over_query_limit:
        # An outside tester's 2,500-character query was answered here and refused by the deployment it measured.
        write(
            f"note: {report.over_query_limit} judged queries are longer than ONTOFABRIC_MAX_QUERY_CHARS: answered "
            "here, refused by a deployment with that setting"
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
    for name, result in report.configs.items():
        if result.calibration_error is not None and result.reliability:
            write(calibration_summary(name, result.calibration_error, result.reliability, result.uncalibrated))
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


def render_verdicts(verdicts: Sequence[Verdict], min_effect: float) -> str:
    """The quality gate's table: each configuration against the baseline, and the verdict."""
    lines = ["| quality gate | baseline nDCG@10 | this run | difference (95 % interval) | better / worse | verdict |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for v in verdicts:
        m = v.margin
        lines.append(
            f"| {v.config} | {v.baseline:.4f} | {v.baseline + m.difference:.4f} | {m.difference:+.4f} "
            f"({m.ci_low:+.4f} … {m.ci_high:+.4f}) | {m.better} / {m.worse} | {'REGRESSED' if v.regressed else 'ok'} |"
        )
    if not verdicts:
        lines.append("no configuration of the baseline was measured: nothing to judge (failed)")
    failed = [v.config for v in verdicts if v.regressed]
    lines.append(
        f"gate: {'failed' if failed or not verdicts else 'passed'}"
        + (f" ({', '.join(failed)} lower by more than {min_effect} with an interval below zero)" if failed else "")
    )
    return "\n".join(lines)


def calibration_summary(name: str, error: float, table: list[ReliabilityBin], uncalibrated: int) -> str:
    """One line: the expected calibration error of the scores of each query's leading results, and the
    reliability table."""
    counted = sum(b.count for b in table)
    not_calibrated = f" ({uncalibrated} answers not calibrated)" if uncalibrated else ""
    return (
        f"{name}: expected calibration error {error:.4f} over {counted} results (each query's leading ones)"
        f"{not_calibrated}; reliability (score bin: results, mean score, share relevant): "
        + "; ".join(f"{b.low:.1f}-{b.high:.1f}: {b.count}, {b.mean_score:.3f}, {b.observed:.3f}" for b in table)
    )
