"""The quality gate: this build's retrieval quality against a committed baseline, query by query.

A baseline holds, for each configuration, the nDCG@10 of every judged query of one dataset (or one sample of it,
``beir.sample_dataset``), as ``ontofabric eval --write-baseline`` measured it. A later run regresses when its mean
nDCG@10 is lower by more than ``min_effect`` **and** the 95 % paired-bootstrap interval of the difference lies
below zero: a drop that chance alone (which queries happen to move) is unlikely to explain, and big enough to
matter. Rankings wobble a little between runs (HNSW graphs built in another order, another CPU's float rounding);
the effect floor keeps such wobble from failing a build. Every judged query of the baseline counts, so one that
now fails, or is missing, scores 0.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .measures import Margin, margin

MIN_EFFECT = 0.005
"""The smallest drop of mean nDCG@10 the gate fails on, however sure the interval."""


class BaselineMismatch(Exception):
    """The baseline was measured on another dataset, split or sample than this run."""


@dataclass(frozen=True)
class Baseline:
    dataset: str
    """The dataset's name, with the sample it was drawn as (``beir.sample_dataset``)."""
    split: str
    per_query: dict[str, dict[str, float]]
    """configuration -> query id -> nDCG@10."""
    setup: dict[str, str] | None = None
    """What it was measured with (``eval_report.retrieval_setup``); None in baselines written before it was kept."""

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        document: dict[str, object] = {"dataset": self.dataset, "split": self.split, "ndcg@10": self.per_query}
        if self.setup is not None:
            document["setup"] = self.setup
        path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n", encoding="utf-8")

    def check(self, dataset: str, split: str) -> None:
        """Raise BaselineMismatch unless this baseline was measured on ``dataset`` (``split``)."""
        if (self.dataset, self.split) != (dataset, split):
            raise BaselineMismatch(
                f"the baseline was measured on {self.dataset} ({self.split}), this run on {dataset} ({split})"
            )

    @classmethod
    def read(cls, path: Path) -> Baseline:
        document = json.loads(path.read_text(encoding="utf-8"))
        return cls(document["dataset"], document["split"], document["ndcg@10"], document.get("setup"))

    def setup_differences(self, setup: Mapping[str, str]) -> list[str]:
        """How ``setup`` (this run's) differs from the baseline's, one ``name: baseline -> run`` each: a gate
        compares the builds of two runs, and a setting that differs makes another comparison."""
        if self.setup is None:
            return []
        names = sorted(set(self.setup) | set(setup))
        default = "(default)"
        return [
            f"{name}: {self.setup.get(name, default)} -> {setup.get(name, default)}"
            for name in names
            if self.setup.get(name) != setup.get(name)
        ]


@dataclass(frozen=True)
class Verdict:
    config: str
    baseline: float
    """Mean nDCG@10 of the baseline."""
    margin: Margin
    """This run against the baseline, over the baseline's queries."""
    regressed: bool


def judge(
    baseline: Baseline,
    dataset: str,
    split: str,
    per_query: Mapping[str, Mapping[str, float]],
    min_effect: float = MIN_EFFECT,
) -> list[Verdict]:
    """A verdict for every configuration both the baseline and this run measured."""
    baseline.check(dataset, split)
    verdicts = []
    for config, reference in sorted(baseline.per_query.items()):
        if config not in per_query or not reference:
            continue
        scores = {q: per_query[config].get(q, 0.0) for q in reference}
        found = margin(config, "baseline", scores, reference)
        assert found is not None
        regressed = found.difference < -min_effect and found.ci_high < 0
        verdicts.append(Verdict(config, sum(reference.values()) / len(reference), found, regressed))
    return verdicts
