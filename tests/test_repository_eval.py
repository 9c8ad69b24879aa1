"""Retrieval evaluation on a source tree: relationship questions from a static analysis, concept queries judged by
symbol, through the real path (services/ops/repository_eval.py)."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from ontofabric.services.ingest.chunking import tree_package
from ontofabric.services.ingest.ingester import read_tree
from ontofabric.services.ops.repository_eval import (
    Judgments,
    JudgmentsError,
    evaluate_tree,
    relationship_queries,
    render_tree_report,
    unknown_symbols,
)
from ontofabric.shared.runtime import Endpoints
from ontofabric.shared.settings import Settings

from .conftest import RecordedProgress

SHAPES = {
    "__init__.py": "from .base import Shape\nfrom .round import Circle\n",
    "base.py": '''
        class Shape:
            """Something with an area."""

            def area(self):
                raise NotImplementedError

            def describe(self):
                return f"{type(self).__name__} of area {self.area()}"
        ''',
    "round.py": '''
        from .base import Shape
        from .units import to_metres


        class Circle(Shape):
            """A round shape measured by its radius."""

            def __init__(self, radius):
                self.radius = to_metres(radius)

            def area(self):
                return 3.14159 * self.radius * self.radius
        ''',
    "square.py": """
        from . import units
        from .base import Shape


        class Square(Shape):
            def __init__(self, side):
                self.side = units.to_metres(side)
        """,
    "units.py": '''
        def to_metres(value):
            """Convert centimetres to metres."""
            return value / 100
        ''',
}


def _tree(root: Path) -> Path:
    tree = root / "shapes"
    tree.mkdir()
    for name, text in SHAPES.items():
        (tree / name).write_text(textwrap.dedent(text))
    return tree


def test_relationship_questions_and_their_answers_come_from_the_syntax(tmp_path: Path) -> None:
    sources = {name: textwrap.dedent(text) for name, text in SHAPES.items()}
    questions = {q.text: (q.kind, q.relevant) for q in relationship_queries(sources, "shapes")}
    assert questions["what subclasses Shape"] == ("subclasses", ["shapes.round.Circle", "shapes.square.Square"])
    assert questions["what imports shapes.base"] == ("imports", ["shapes", "shapes.round", "shapes.square"])
    # `from . import units` imports the module too.
    assert questions["what imports shapes.units"] == ("imports", ["shapes.round", "shapes.square"])
    # A call by the name imported, and `self.area()` within the class that defines area.
    assert questions["what calls to_metres"] == ("calls", ["shapes.round.Circle.__init__"])
    # `area` is defined twice (Shape.area, Circle.area): ambiguous by name, so not asked.
    assert "what calls area" not in questions
    # `units.to_metres(...)` through a module attribute is not resolved: the answer lists only what is certain.
    assert "shapes.square.Square.__init__" not in questions["what calls to_metres"][1]
    # The other direction, from the same pairs.
    assert questions["what does Circle inherit from"] == ("bases", ["shapes.base.Shape"])
    assert questions["what does shapes.square import"] == ("imported", ["shapes", "shapes.base", "shapes.units"])
    assert questions["what does describe call"] == ("callees", ["shapes.base.Shape.area"])
    assert "what does __init__ call" not in questions  # two __init__ methods: ambiguous
    # A bare decorator calls what it names, as one with arguments does (an agent tester's pytest `@fixture`).
    decorated = {
        "marks.py": "def fixture(f=None, scope=None): ...\n",
        "use.py": "from .marks import fixture\n\n@fixture\ndef tmp(): ...\n\n@fixture(scope=1)\ndef s(): ...\n",
    }
    asked = {q.text: q.relevant for q in relationship_queries(decorated, "pkg")}
    assert asked["what calls fixture"] == ["pkg.use.s", "pkg.use.tmp"]


def test_a_judgments_file_that_is_not_one_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"project": "x", "concepts": []}')
    with pytest.raises(JudgmentsError, match=r"bad\.json"):
        Judgments.read(bad)


@pytest.mark.slow
async def test_a_tree_evaluated_through_the_real_path(
    tmp_path: Path,
    deployment_settings: Settings,
    servers: Endpoints,
    deployment: object,
    nats_logins: dict[str, tuple[str, str]],
) -> None:
    tree = _tree(tmp_path)
    # Left out by --exclude: none of its chunks is indexed, none of its relations asked.
    (tree / "tests").mkdir()
    (tree / "tests" / "test_round.py").write_text(
        "from shapes.base import Shape\nfrom shapes.round import Circle\nfrom shapes.units import to_metres\n\n\n"
        "class Disc(Shape):\n    pass\n\n\ndef test_a_round_shape_with_a_radius():\n"
        "    assert Circle(to_metres(100)).area() > 0\n"
    )
    judgments_file = tmp_path / "judgments.json"
    judgments_file.write_text(
        json.dumps(
            {
                "project": "shapes",
                "version": "0",
                "concepts": [
                    {"id": "c1", "text": "convert centimetres into metres", "relevant": ["shapes.units.to_metres"]},
                    {"id": "c2", "text": "a round shape with a radius", "relevant": ["shapes.round.Circle"]},
                    {"id": "c3", "text": "no symbol answers this", "relevant": ["shapes.nowhere"]},
                    {"id": "c4", "text": "a disc", "relevant": ["shapes.tests.test_round.Disc"]},
                ],
            }
        )
    )
    settings = deployment_settings.model_copy(update={"embedder": "local", "cache_dir": tmp_path / "cache"})
    endpoints = Endpoints(servers.nats_url, deployment_settings.database_url or "", nats_logins)
    report = await evaluate_tree(
        settings, endpoints, tree, Judgments.read(judgments_file), RecordedProgress(), exclude=["tests"]
    )
    assert report.chunks > 5
    assert report.setup["exclude"] == "tests"  # in the report and a baseline written from it
    assert report.concept.queries == 4
    assert not any(".tests." in symbol for run in report.concept_run.values() for symbol in run)
    assert report.concept.errors == 0
    assert report.concept.per_query["c1"] == pytest.approx(1.0)  # its one symbol first
    assert report.concept.per_query["c3"] == 0.0
    assert next(iter(report.concept_run["c1"])) == "shapes.units.to_metres"  # what --runs writes, in rank order
    assert report.unknown_symbols == ["shapes.nowhere", "shapes.tests.test_round.Disc"]
    assert any("shapes.nowhere" in line for line in render_tree_report(report))
    assert list(report.concept_run["c2"].values()) == sorted(report.concept_run["c2"].values(), reverse=True)
    assert report.concept.metrics["Recall@10"] == pytest.approx(2 / 4)
    # The answers' scores against the judgments: every result counted, c1's and c2's symbols relevant among them.
    assert report.concept_uncalibrated == 0
    assert sum(b.count for b in report.concept_reliability) >= sum(len(run) for run in report.concept_run.values())
    assert sum(b.count * b.observed for b in report.concept_reliability) >= 2 - 1e-9
    assert report.concept_calibration_error is not None
    assert 0.0 <= report.concept_calibration_error <= 1.0
    assert any(line.startswith("concept: expected calibration error") for line in render_tree_report(report))
    # The same results as points for `ontofabric calibrate` (--calibration-points), each with the signals it reads.
    points = report.calibration_points
    assert len(points) == sum(b.count for b in report.concept_reliability)
    assert sum(p.relevant for p in points) == round(sum(b.count * b.observed for b in report.concept_reliability))
    assert {p.dataset for p in points} == {"shapes 0"}
    assert {p.query for p in points} <= {"c1", "c2", "c3", "c4"}
    assert all(p.signals for p in points)
    assert [p.rank for p in points if p.query == "c1"][:2] == [1, 2]
    assert "calibration_points" not in report.to_json()
    off, on = report.relationships["followLinks off"], report.relationships["followLinks on"]
    assert off.queries == on.queries == len(relationship_queries(
        {name: textwrap.dedent(text) for name, text in SHAPES.items()}, "shapes"
    ))  # fmt: skip
    assert off.errors == on.errors == 0
    assert 0.0 < off.metrics["Recall@10"] <= 1.0
    assert on.metrics["Recall@10"] >= off.metrics["Recall@10"]  # what expansion attaches only adds
    assert off.interval[0] <= off.metrics["Recall@10"] <= off.interval[1]
    # What `ontofabric eval TREE --json` writes: the report with each query's measure.
    written = json.loads(json.dumps(report.to_json()))
    assert written["concept"]["per_query"]["c1"] == pytest.approx(1.0)


@pytest.mark.parametrize("judgments_file", sorted((Path(__file__).parent / "quality").glob("*-concepts.json")))
def test_every_symbol_the_committed_judgments_name_is_in_the_project_judged(
    judgments_file: Path, judged_tree: Callable[[str, str], Path]
) -> None:
    """A judged name with a typo would score zero for ever, silently."""
    judgments = Judgments.read(judgments_file)
    tree = judged_tree(judgments.project, judgments.version)
    sources = read_tree(tree)
    assert unknown_symbols(judgments, sources, tree_package(tree.name, sources)) == []
    assert len({query.id for query in judgments.concepts}) == len(judgments.concepts)
