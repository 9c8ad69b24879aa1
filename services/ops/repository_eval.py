"""Retrieval evaluation on a source tree (``ontofabric eval TREE --judgments FILE``): the tree ingested by the
reference ingester, then two shapes of question asked through the real path, judged by symbol (``symbolFqn``) so
that the judgments survive re-chunking.

- **Concept** queries ("exponential backoff with a cap") come from the judgments file, each with the symbols that
  answer it; measured by nDCG@10, Recall@10 and MRR@10 over the answer's symbols (a symbol's chunks count once,
  at the first rank one of them holds).
- **Relationship** queries ("what calls to_seconds", "what subclasses wait_base", "what imports tenacity._utils",
  and the other way: "what does wraps call", "what does Retrying inherit from", "what does tenacity.wait import")
  are made here from a static analysis of the tree (:func:`relationship_queries`), not picked by hand; measured by
  Recall@10 over the answer's symbols together with the types ``_meta.expandedContext`` attaches, asked with
  ``followLinks`` off and on.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
from collections.abc import Collection, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from ontofabric.contracts import ErrorReply, QueryResponse
from ontofabric.contracts.query import MAX_TOKENS_LIMIT
from ontofabric.services.app import Roles, start_workers
from ontofabric.services.ingest.chunking import chunk_file, module_name
from ontofabric.services.ingest.ingester import Ingester, exclusion_patterns, imported_package, own_package, read_tree
from ontofabric.services.query.calibration import ReliabilityBin, reliability
from ontofabric.services.query.client import QueryClient
from ontofabric.services.query.symbols import places_of
from ontofabric.shared.jetstream import close, connect, wait_caught_up
from ontofabric.shared.onnx_models import second_embedder
from ontofabric.shared.progress import Progress
from ontofabric.shared.runtime import Endpoints
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names

from .calibrate import Point
from .eval_report import calibration_summary, json_without_points, retrieval_setup, setup_line
from .measures import compute_metrics, margin, per_query_ndcg

DEPTH = 10
WORKSPACE = "repository-eval"
RELATIONSHIP_KINDS = ("calls", "subclasses", "imports", "callees", "bases", "imported")
"""What calls f, subclasses C, imports M; what f calls, C derives from, M imports."""


class JudgmentsError(ValueError):
    pass


@dataclass(frozen=True)
class ConceptQuery:
    id: str
    text: str
    relevant: list[str]
    """The qualified names of the symbols that answer it."""


@dataclass(frozen=True)
class Judgments:
    project: str
    version: str
    """The project's version the judgments were written against (the tree's is checked, when it says)."""
    concepts: list[ConceptQuery]

    @property
    def dataset(self) -> str:
        """What reports, calibration points and quality-gate baselines call the judged tree: project and version."""
        return f"{self.project} {self.version}"

    @classmethod
    def read(cls, path: Path) -> Judgments:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            concepts = [ConceptQuery(q["id"], q["text"], list(q["relevant"])) for q in raw["concepts"]]
            return cls(raw["project"], raw["version"], concepts)
        except (ValueError, KeyError, TypeError) as error:
            raise JudgmentsError(f"{path}: not a judgments file ({error})") from error


def tree_version(tree: Path, project: str) -> str | None:
    """The version of ``project`` that ``tree`` is, read from the distribution installed beside it (in
    site-packages, or in a ``pip install --target`` directory); None where none is (a checkout). Not the version
    the running environment has installed: that may be another copy of the project."""
    wanted = _distribution_name(project)
    for distribution in metadata.distributions(path=[str(tree.resolve().parent)]):
        if _distribution_name(distribution.metadata["Name"] or "") == wanted:
            return distribution.version
    return None


def _distribution_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


@dataclass(frozen=True)
class RelationshipQuery:
    id: str
    kind: str
    """one of RELATIONSHIP_KINDS"""
    text: str
    relevant: list[str]


def _defined(tree: ast.Module, module: str) -> dict[str, str]:
    """Top-level names a module defines -> their qualified names."""
    names = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names[node.name] = f"{module}.{node.name}"
    return names


def _scopes(tree: ast.Module, module: str) -> list[tuple[str, ast.AST, str | None]]:
    """Each function and method (qualified name, node, its class's qualified name or None)."""
    found: list[tuple[str, ast.AST, str | None]] = []

    def visit(body: list[ast.stmt], prefix: str, owner: str | None) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}.{node.name}", f"{prefix}.{node.name}")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                found.append((f"{prefix}.{node.name}", node, owner))

    visit(tree.body, module, None)
    return found


def relationship_queries(sources: Mapping[str, str], package: str | None) -> list[RelationshipQuery]:
    """Relationship questions about a Python tree with their answers, from its syntax alone: which modules import
    a module, which classes of the tree subclass a class of the tree (directly), which functions and methods call a
    function of the tree (by a name the caller's module defines or imports from the tree, or ``self.method`` within
    a class); and the same pairs the other way (what a module imports, what a class derives from directly, what a
    function calls). Only questions with at least one answer; names several symbols share are left out
    (ambiguous)."""
    modules: dict[str, ast.Module] = {}
    for path, text in sorted(sources.items()):
        if path.endswith(".py"):
            try:
                modules[module_name(path, package)] = ast.parse(text)
            except (SyntaxError, ValueError, RecursionError):  # nested deeper than the parser goes: not read
                continue
    defined = {module: _defined(tree, module) for module, tree in modules.items()}
    is_package = {module_name(p, package): p.endswith("__init__.py") for p in sources if p.endswith(".py")}

    def absolute(module: str, written: str | None, level: int) -> str:
        if level == 0:
            return written or ""
        parts = module.split(".") if is_package.get(module) else module.split(".")[:-1]
        base = parts[: len(parts) - (level - 1)]
        return ".".join([*base, written] if written else base)

    importers: dict[str, set[str]] = {}
    visible: dict[str, dict[str, str]] = {}  # module -> local name -> qualified name of a tree symbol
    for module, tree in modules.items():
        local = dict(defined[module])
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = absolute(module, node.module, node.level)
                if source in modules and source != module:
                    importers.setdefault(source, set()).add(module)
                for alias in node.names:
                    target = f"{source}.{alias.name}"
                    if target in modules and target != module:
                        importers.setdefault(target, set()).add(module)
                    elif alias.name in defined.get(source, {}):
                        local[alias.asname or alias.name] = defined[source][alias.name]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.name != module:
                        importers.setdefault(alias.name, set()).add(module)
        visible[module] = local

    known = {fqn for module, tree in modules.items() for fqn, _, _ in _scopes(tree, module)}
    known |= {_class_fqn(t, m, n) for m, t in modules.items() for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    subclasses: dict[str, set[str]] = {}
    callers: dict[str, set[str]] = {}
    for module, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for base in node.bases:
                    base_class = visible[module].get(base.id) if isinstance(base, ast.Name) else None
                    if base_class is not None:
                        # The subclass's own qualified name: found among the module's classes at any depth.
                        subclasses.setdefault(base_class, set()).add(_class_fqn(tree, module, node))
        for fqn, scope, owner in _scopes(tree, module):
            for part in ast.walk(scope):
                # A bare decorator calls what it names with what it decorates, as one with arguments does.
                bare = (
                    [d for d in part.decorator_list if not isinstance(d, ast.Call)]
                    if isinstance(part, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                    else []
                )
                for func in [part.func] if isinstance(part, ast.Call) else bare:
                    callee: str | None = None
                    if isinstance(func, ast.Name):
                        callee = visible[module].get(func.id)
                    elif (
                        isinstance(func, ast.Attribute)
                        and isinstance(func.value, ast.Name)
                        and func.value.id == "self"
                        and owner is not None
                    ):
                        callee = f"{owner}.{func.attr}"
                    # Only a symbol the tree defines there: an inherited method or a callable attribute is not
                    # resolved.
                    if callee in known and callee != fqn:
                        callers.setdefault(callee, set()).add(fqn)

    last_parts: dict[str, int] = {}
    for fqn in known:
        last_parts[fqn.rsplit(".", 1)[-1]] = last_parts.get(fqn.rsplit(".", 1)[-1], 0) + 1

    queries = []
    for kind, relation, template in (
        ("imports", importers, "what imports {}"),
        ("imported", _inverted(importers), "what does {} import"),
    ):
        for target, found in sorted(relation.items()):
            queries.append(RelationshipQuery(f"{kind}:{target}", kind, template.format(target), sorted(found)))
    for kind, relation, template in (
        ("subclasses", subclasses, "what subclasses {}"),
        ("calls", callers, "what calls {}"),
        ("bases", _inverted(subclasses), "what does {} inherit from"),
        ("callees", _inverted(callers), "what does {} call"),
    ):
        for target, found in sorted(relation.items()):
            name = target.rsplit(".", 1)[-1]
            if last_parts.get(name, 0) == 1 and found:
                queries.append(RelationshipQuery(f"{kind}:{target}", kind, template.format(name), sorted(found)))
    return queries


def _inverted(relation: Mapping[str, set[str]]) -> dict[str, set[str]]:
    """The same pairs the other way round (callers of each callee -> callees of each caller)."""
    inverted: dict[str, set[str]] = {}
    for target, found in relation.items():
        for source in found:
            inverted.setdefault(source, set()).add(target)
    return inverted


def _class_fqn(tree: ast.Module, module: str, wanted: ast.ClassDef) -> str:
    def find(body: list[ast.stmt], prefix: str) -> str | None:
        for node in body:
            if node is wanted:
                return f"{prefix}.{node.name}"
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                found = find(node.body, f"{prefix}.{node.name}")
                if found:
                    return found
        return None

    return find(tree.body, module) or f"{module}.{wanted.name}"


def symbols_of(reply: QueryResponse) -> list[str]:
    """The answer's symbols in rank order, each once (a class and its docstring are one symbol)."""
    seen: dict[str, None] = {}
    for result in reply.results:
        name = result.metadata.get("symbolFqn")
        if isinstance(name, str):
            seen.setdefault(name, None)
    return list(seen)


@dataclass
class ShapeResult:
    queries: int
    metrics: dict[str, float]
    interval: tuple[float, float]
    """95 % bootstrap interval of the headline measure's mean over queries."""
    per_query: dict[str, float] = field(default_factory=dict)
    errors: int = 0


@dataclass
class TreeReport:
    tree: str
    project: str
    version: str
    chunks: int
    concept: ShapeResult
    relationships: dict[str, ShapeResult]
    """followLinks off / on -> Recall@10 over all relationship queries"""
    by_kind: dict[str, dict[str, float]]
    """followLinks off / on -> kind -> mean Recall@10"""
    kinds: dict[str, int] = field(default_factory=dict)
    """kind -> relationship queries of it"""
    concept_run: dict[str, dict[str, float]] = field(default_factory=dict)
    """concept query id -> the answer's symbols in rank order, each with a score that descends (a TREC run)"""
    unknown_symbols: list[str] = field(default_factory=list)
    """Judged symbols no chunk of the tree carries (a typo, or another version's name): they can never be found."""
    concept_calibration_error: float | None = None
    """Expected calibration error of the concept answers' scores (every result, judged relevant when its symbol is
    one the query's judgments name)."""
    concept_reliability: list[ReliabilityBin] = field(default_factory=list)
    concept_uncalibrated: int = 0
    """Concept answers whose scores were not calibrated (_meta.calibrated false)."""
    calibration_points: list[Point] = field(default_factory=list)
    """Every result of the concept answers with its signals and judgment (``--calibration-points``; not in the
    JSON)."""
    setup: dict[str, str] = field(default_factory=dict)
    """What it ran with (:func:`eval_report.retrieval_setup`)."""

    def to_json(self) -> dict[str, Any]:
        return json_without_points(self)


def unknown_symbols(judgments: Judgments, sources: Mapping[str, str], package: str | None) -> list[str]:
    """The judged symbols that no chunk of the tree is named by, as the ingester names them."""
    named = {chunk.symbol_fqn for path, text in sources.items() for chunk in chunk_file(path, text, 1, package)}
    return sorted({name for query in judgments.concepts for name in query.relevant} - named)


def _recall(found: Sequence[str], relevant: Sequence[str]) -> float:
    return len(set(found) & set(relevant)) / len(relevant) if relevant else 0.0


def _shape(per_query: dict[str, float], metrics: dict[str, float], errors: int = 0) -> ShapeResult:
    # The mean's interval by the project's one bootstrap: a margin over a reference of zeros is the mean itself.
    m = margin("run", "zero", per_query, {q: 0.0 for q in per_query})
    interval = (m.ci_low, m.ci_high) if m is not None else (0.0, 0.0)
    return ShapeResult(len(per_query), metrics, interval, per_query, errors)


async def evaluate_tree(
    settings: Settings,
    endpoints: Endpoints,
    tree: Path,
    judgments: Judgments,
    progress: Progress,
    exclude: Collection[str] = (),
) -> TreeReport:
    """``exclude``: paths of the tree left out of the index and of the questions, as ``ingest --exclude`` reads
    them (a judged symbol in one is reported unknown)."""
    setup = retrieval_setup(settings)
    settings = settings.model_copy(update={"query_cache_entries": 0})
    names = Names(settings.subject_prefix)
    tree = await asyncio.to_thread(tree.resolve)
    patterns = exclusion_patterns(tree, exclude)
    if patterns:  # another set of documents: a baseline of another exclusion is another setup
        setup["exclude"] = " ".join(patterns)
    sources = await asyncio.to_thread(read_tree, tree, patterns)
    package = imported_package(tree, sources) or own_package(tree)  # as the ingester names them
    relationships = relationship_queries(sources, package)
    unknown = unknown_symbols(judgments, sources, package)
    async with AsyncExitStack() as stack:
        embedder = await start_workers(stack, settings, endpoints, Roles())
        nc = await connect(endpoints.nats_url_as("operator"), "ontofabric-eval", settings)
        stack.push_async_callback(close, nc)
        js = nc.jetstream()
        second = await asyncio.to_thread(second_embedder, settings)
        ingester = Ingester(
            js,
            names,
            embedder,
            settings.max_content_bytes,
            second=second,
            max_file_bytes=settings.ingest_max_file_bytes,
        )
        report = await ingester.ingest(tree, WORKSPACE, exclude=patterns)
        if report.awaited_sequence is not None:
            await wait_caught_up(
                js, names.delta_stream, names.postgres_projector_durable, report.awaited_sequence, 3600
            )
        await asyncio.sleep(0.5)  # the query worker's version watch catches up
        client = QueryClient(nc, names, timeout_s=60)

        async def ask(text: str, follow_links: bool = False) -> QueryResponse | None:
            request = {"semanticQuery": text, "topK": DEPTH, "includeContent": False, "followLinks": follow_links}
            reply = await client.query(WORKSPACE, {**request, "maxTokens": MAX_TOKENS_LIMIT})
            progress.advance("queries")
            return None if isinstance(reply, ErrorReply) else reply

        progress.stage("queries", len(judgments.concepts) + 2 * len(relationships))
        run: dict[str, dict[str, float]] = {}
        errors = uncalibrated = 0
        points: list[Point] = []
        for query in judgments.concepts:
            reply = await ask(query.text)
            errors += reply is None
            found = [] if reply is None else symbols_of(reply)
            run[query.id] = {name: float(DEPTH - rank) for rank, name in enumerate(found)}
            if reply is not None:
                uncalibrated += not reply.meta.calibrated
                points += [  # at the place each was scored at; one placed first was not scored
                    Point(judgments.dataset, "hybrid", query.id, place, r.signals,
                          r.metadata.get("symbolFqn") in query.relevant, r.score)
                    for r, place in zip(reply.results, places_of(reply.results), strict=True)
                    if place is not None
                ]  # fmt: skip
        qrels = {c.id: dict.fromkeys(c.relevant, 1) for c in judgments.concepts}
        concept = _shape(per_query_ndcg(qrels, run), compute_metrics(qrels, run), errors)

        shapes: dict[str, ShapeResult] = {}
        by_kind: dict[str, dict[str, float]] = {}
        for follow, label in ((False, "followLinks off"), (True, "followLinks on")):
            recalls: dict[str, float] = {}
            errors = 0
            for question in relationships:
                reply = await ask(question.text, follow)
                errors += reply is None
                found = [] if reply is None else symbols_of(reply)
                if reply is not None:
                    found += [context.linked_type for context in reply.meta.expanded_context]
                recalls[question.id] = _recall(found, question.relevant)
            mean = sum(recalls.values()) / len(recalls) if recalls else 0.0
            shapes[label] = _shape(recalls, {"Recall@10": mean}, errors)
            by_kind[label] = {
                kind: sum(recalls[q.id] for q in relationships if q.kind == kind)
                / max(1, sum(1 for q in relationships if q.kind == kind))
                for kind in RELATIONSHIP_KINDS
            }
    kinds = {kind: sum(1 for q in relationships if q.kind == kind) for kind in RELATIONSHIP_KINDS}
    table, calibration_error = reliability([p.score for p in points], [p.relevant for p in points])
    return TreeReport(
        str(tree), judgments.project, judgments.version, report.chunks, concept, shapes, by_kind, kinds, run, unknown,
        calibration_error if points else None, table, uncalibrated, points, setup,
    )  # fmt: skip


def render_tree_report(report: TreeReport) -> list[str]:
    c = report.concept
    lines = [
        f"{report.project} {report.version}: {report.chunks} chunks; {c.queries} concept queries, "
        f"{report.relationships['followLinks off'].queries} relationship queries (from static analysis)",
        *([setup_line(report.setup)] if report.setup else []),
        "| shape | measure | mean (95 % interval over queries) | other measures |",
        "|---|---|---|---|",
    ]
    if c.queries:
        lines.append(
            f"| concept | nDCG@10 | {c.metrics['nDCG@10']:.4f} ({c.interval[0]:.4f}-{c.interval[1]:.4f}) | "
            f"Recall@10 {c.metrics['Recall@10']:.4f}, MRR@10 {c.metrics['MRR@10']:.4f}, errors {c.errors} |"
        )
    for label, shape in report.relationships.items():
        kinds = ", ".join(
            f"{kind} {value:.4f} ({report.kinds.get(kind, 0)})" for kind, value in report.by_kind[label].items()
        )
        lines.append(
            f"| relationship, {label} | Recall@10 | {shape.metrics['Recall@10']:.4f} "
            f"({shape.interval[0]:.4f}-{shape.interval[1]:.4f}) | {kinds}; errors {shape.errors} |"
        )
    if report.concept_calibration_error is not None:
        lines.append(
            calibration_summary(
                "concept", report.concept_calibration_error, report.concept_reliability, report.concept_uncalibrated
            )
        )
    if report.unknown_symbols:
        shown = ", ".join(report.unknown_symbols[:5]) + (" ..." if len(report.unknown_symbols) > 5 else "")
        lines.append(
            f"warning: {len(report.unknown_symbols)} judged symbols name no chunk of the tree (they are never found): "
            f"{shown}"
        )
    return lines
