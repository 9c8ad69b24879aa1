"""The quality gate: `ontofabric eval --baseline` against the committed baselines in tests/quality/, on samples of
the shared evaluation sets, through the real pipeline; and the gate's rules on made-up scores.

The evaluation data is read from ONTOFABRIC_EVAL_DATA, else from `shared/eval` beside the checkout; without it the
end-to-end cases skip. A baseline is made again, after a change that moves quality on purpose, with the command in
docs/quality.md ("Quality gate").
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ontofabric.services.ops.beir import BeirDataset, sample_dataset
from ontofabric.services.ops.eval_report import retrieval_setup, setup_line
from ontofabric.services.ops.quality_gate import Baseline, BaselineMismatch, judge
from ontofabric.shared.settings import Settings

ONTOFABRIC = str(Path(sys.executable).parent / "ontofabric")
BASELINES = Path(__file__).parent / "quality"
EVAL_DATA = Path(os.environ.get("ONTOFABRIC_EVAL_DATA") or Path(__file__).resolve().parents[2] / "shared" / "eval")

# What CI measures: a sample of each set, small enough for minutes, the same every run.
GATED = {
    "cosqa-dev": ("dev", 150, 1500),
    "scifact-train": ("train", 100, 600),
}
GATED_CONFIGS = "hybrid,dense,keyword"


def gate_command(name: str) -> list[str]:
    split, queries, documents = GATED[name]
    return [
        ONTOFABRIC, "eval", str(EVAL_DATA / name), "--split", split, "--config", GATED_CONFIGS,
        "--sample-queries", str(queries), "--sample-documents", str(documents),
    ]  # fmt: skip


def _dataset() -> BeirDataset:
    corpus = [{"_id": f"d{n}", "title": "", "text": f"text {n}"} for n in range(50)]
    queries = {f"q{n}": f"query {n}" for n in range(20)}
    qrels = {f"q{n}": {f"d{n}": 1, f"d{n + 20}": 1} for n in range(20)}
    return BeirDataset("toy", "test", corpus, queries, qrels)


def test_a_sample_is_the_same_for_the_same_seed_and_keeps_every_judged_document() -> None:
    dataset = _dataset()
    sample = sample_dataset(dataset, queries=5, documents=15, seed=3)
    assert sample == sample_dataset(dataset, queries=5, documents=15, seed=3)
    assert sample != sample_dataset(dataset, queries=5, documents=15, seed=4)
    assert len(sample.queries) == len(sample.qrels) == 5
    kept = {entry["_id"] for entry in sample.corpus}
    assert len(kept) == 15
    assert {d for judged in sample.qrels.values() for d in judged} <= kept
    assert sample.name == "toy[5 queries, 15 documents, seed 3]"
    everything = sample_dataset(dataset, queries=100, documents=5, seed=0)  # the judged documents come first
    assert len(everything.queries) == 20
    assert len(everything.corpus) == 40


def test_the_gate_fails_a_drop_beyond_noise_and_passes_wobble() -> None:
    scores = {f"q{n}": 0.2 + 0.6 * (n % 5) / 4 for n in range(200)}
    baseline = Baseline("toy", "test", {"hybrid": scores, "dense": scores})

    def verdicts(hybrid: dict[str, float]) -> dict[str, bool]:
        return {v.config: v.regressed for v in judge(baseline, "toy", "test", {"hybrid": hybrid, "dense": scores})}

    assert verdicts(scores) == {"dense": False, "hybrid": False}
    wobble = {**scores, "q1": scores["q1"] - 0.3, "q2": scores["q2"] + 0.1}  # one query moved: within the floor
    assert verdicts(wobble) == {"dense": False, "hybrid": False}
    lower = {q: s - 0.02 for q, s in scores.items()}  # every query a little worse: sure, and past the floor
    assert verdicts(lower) == {"dense": False, "hybrid": True}
    missing = {q: s for q, s in scores.items() if q not in {f"q{n}" for n in range(0, 200, 10)}}  # 20 lost: 0
    assert verdicts(missing)["hybrid"]
    noisy = {q: s + (0.3 if n % 2 else -0.32) for n, (q, s) in enumerate(scores.items())}  # lower, but by chance
    assert not verdicts(noisy)["hybrid"]
    with pytest.raises(BaselineMismatch, match="measured on toy"):
        judge(baseline, "toy[5 queries]", "test", {"hybrid": scores})


def test_the_gate_says_when_the_baseline_and_the_run_judge_other_queries(capsys: pytest.CaptureFixture[str]) -> None:
    from ontofabric.services.cli import _gate

    reference = Baseline("d", "s", {"hybrid": {"a": 1.0, "b": 0.5}})
    _gate(reference, "d", "s", {"hybrid": {"a": 1.0, "b": 0.5, "c": 0.2}}, 0.005, {})  # passes: nothing lost
    captured = capsys.readouterr()
    assert "0 queries of the baseline were not measured" in captured.err
    assert "1 measured queries are not in the baseline" in captured.err
    assert "gate: passed" in captured.out
    assert "another setup" not in captured.err  # a baseline that kept none says nothing of it


def test_the_gate_names_each_setting_the_baseline_ran_with_otherwise(capsys: pytest.CaptureFixture[str]) -> None:
    from ontofabric.services.cli import _gate

    measured_with = retrieval_setup(Settings())
    reference = Baseline("d", "s", {"hybrid": {"a": 1.0}}, measured_with)
    _gate(reference, "d", "s", {"hybrid": {"a": 1.0}}, 0.005, measured_with)
    assert "another setup" not in capsys.readouterr().err
    changed = retrieval_setup(Settings(embedding_precision="bfloat16", late_interaction_weight=0.0))
    _gate(reference, "d", "s", {"hybrid": {"a": 1.0}}, 0.005, changed)
    notes = [line for line in capsys.readouterr().err.splitlines() if "another setup" in line]
    assert notes == [
        "note: the baseline ran with another setup: embeddingPrecision: float32 -> bfloat16",
        "note: the baseline ran with another setup: late_interaction_weight: (default) -> 0.0",
    ]


def test_a_setup_names_what_changes_answers_and_not_where_the_run_was() -> None:
    setup = retrieval_setup(
        Settings(
            late_interaction_weight=0.0, database_url="postgresql://u:secret@db/x", log_level="DEBUG",
            data_dir=Path("elsewhere"), second_vectors=False,
        )
    )  # fmt: skip
    assert setup == {
        "embeddingModel": Settings().embedding_model, "embeddingPrecision": "float32", "secondVectors": "off",
        "reranker": "none", "late_interaction_weight": "0.0",
    }  # fmt: skip
    assert setup_line(setup).endswith("settings changed: late_interaction_weight=0.0")


def test_a_baseline_reads_back_as_written(tmp_path: Path) -> None:
    baseline = Baseline("toy", "test", {"hybrid": {"q1": 0.5, "q2": 1.0}})
    baseline.write(tmp_path / "b.json")
    assert Baseline.read(tmp_path / "b.json") == baseline
    with_setup = Baseline("toy", "test", {"hybrid": {"q1": 0.5}}, {"embeddingModel": "m", "reranker": "none"})
    with_setup.write(tmp_path / "c.json")
    assert Baseline.read(tmp_path / "c.json") == with_setup


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GATED))
def test_this_build_passes_the_quality_gate(name: str, tmp_path: Path) -> None:
    if not (EVAL_DATA / name / "corpus.jsonl").is_file():
        pytest.skip(f"no evaluation data at {EVAL_DATA / name} (set ONTOFABRIC_EVAL_DATA)")
    measured = tmp_path / "measured.json"
    result = subprocess.run(
        [*gate_command(name), "--baseline", str(BASELINES / f"{name}.json"), "--write-baseline", str(measured)],
        capture_output=True,
        text=True,
        check=False,
        timeout=1200,
    )
    assert "quality gate" in result.stdout, result.stdout + result.stderr
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gate: passed" in result.stdout
    # The same gate fails a build whose every query came out a little worse than this one.
    run = Baseline.read(measured)
    better = Baseline(
        run.dataset, run.split, {c: {q: s + 0.05 for q, s in qs.items()} for c, qs in run.per_query.items()}
    )
    assert all(v.regressed for v in judge(better, run.dataset, run.split, run.per_query))


@pytest.mark.slow
@pytest.mark.parametrize("project", ["tenacity", "structlog", "httpx"])
def test_this_build_passes_the_quality_gate_on_source_trees(
    project: str, tmp_path: Path, judged_tree: Callable[[str, str], Path]
) -> None:
    """Concept queries over three projects at the versions they were judged on (docs/quality.md, "Held-out concept
    queries"), gated as the BEIR samples are: a change that loses them quality fails the build."""
    judgments = BASELINES / f"{project}-concepts.json"
    baseline = BASELINES / f"{project}-baseline.json"
    tree = judged_tree(project, Baseline.read(baseline).dataset.split()[-1])
    measured = tmp_path / "measured.json"
    command = [ONTOFABRIC, "eval", str(tree), "--judgments", str(judgments), "--baseline", str(baseline)]
    result = subprocess.run(
        [*command, "--write-baseline", str(measured)], capture_output=True, text=True, check=False, timeout=1200
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gate: passed" in result.stdout
    # A baseline every query of which was better fails the same run.
    run = Baseline.read(measured)
    assert run.dataset == Baseline.read(baseline).dataset
    assert run.setup is not None
    assert run.setup["embeddingModel"] == Settings().embedding_model
    assert setup_line(run.setup) in result.stdout
    assert all(v.regressed for v in judge(
        Baseline(run.dataset, run.split, {c: {q: s + 0.05 for q, s in qs.items()} for c, qs in run.per_query.items()}),
        run.dataset, run.split, run.per_query,
    ))  # fmt: skip
