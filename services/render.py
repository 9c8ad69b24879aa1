"""Terminal rendering of query replies and progress (rich)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from ontofabric.contracts import ErrorReply, QueryResponse, main_only, nothing_indexed, source_place
from ontofabric.contracts.documents import NOT_FOLLOWING
from ontofabric.services.gateway.tools import answer_notes, pending_note
from ontofabric.services.ops.status import DeploymentStatus
from ontofabric.shared.discovery import (
    BUILD,
    INSTANCE,
    SCHEMA,
    Worker,
    held_elsewhere,
    postgres_partitions,
)
from ontofabric.shared.printable import printable, shown_time


def as_text(text: str, lines: bool = False) -> str:
    """``text`` for rich to print as it is: :func:`printable`, and its brackets not read as markup (a query or an
    id holding "[/dim]" stopped ``ontofabric query`` with a markup error, a review's)."""
    return escape(printable(text, lines))


def _snippet(text: str, width: int = 70) -> str:
    flat = printable(" ".join(text.split()))
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _parameter(name: str, value: Any) -> str:
    """A request's parameter as the header says it: ``relatedTo`` as ``--related-to`` takes it, other objects as
    JSON (a tester's header showed a Python dict: ``relatedTo={'relation': 'callers', 'symbol': 'to_se…``), its
    letters as written (a Unicode tester's ``paths=["名前"]`` showed as ``\\u540d\\u524d``)."""
    if name == "relatedTo" and isinstance(value, dict):
        return f"{name}={value.get('relation')}:{value.get('symbol')}"
    if isinstance(value, dict | list):
        return f"{name}={json.dumps(value, separators=(',', ':'), ensure_ascii=False)}"
    return f"{name}={value}"


def render_reply(console: Console, query: dict[str, Any], reply: QueryResponse | ErrorReply) -> None:
    # Everything from the request, the index or the worker is printed as_text.
    params = as_text(", ".join(_parameter(k, v) for k, v in query.items() if k != "semanticQuery"))
    asked = as_text(str(query.get("semanticQuery", "")))
    console.rule(f"[bold]{asked}[/bold]" + (f"  [dim]({params})[/dim]" if params else ""))
    if isinstance(reply, ErrorReply):
        console.print(f"[red]error[/red] {reply.error.code}: " + as_text(reply.error.message))
        for detail in reply.error.details:
            console.print(as_text(f"  {detail.field or '<body>'}: {detail.message}"))
        return
    table = Table(show_edge=False, pad_edge=False, expand=True)
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("score", no_wrap=True)
    table.add_column("level", no_wrap=True)
    table.add_column("found by", no_wrap=True)
    table.add_column("symbol / content", ratio=1, overflow="fold")
    for result in reply.results:
        symbol = result.metadata.get("symbolFqn") or result.object_type
        found = " ".join(f"{f.retriever}#{f.rank}" for f in result.found_by)
        level = as_text(str(result.metadata.get("chunkLevel", "")))
        where = as_text(source_place(result.metadata) or "")
        cell = f"[bold]{as_text(str(symbol))}[/bold]" + (f" {where}" if where else "")
        if not result.metadata.get("symbolFqn"):  # what get_document takes (a tester's BEIR rows were alike)
            cell += f" [dim]id {as_text(result.id)}[/dim]"
        if result.assigned_at_line is not None:
            cell += f" (assigned at line {result.assigned_at_line})"
        cell += f"\n[dim]{escape(_snippet(result.content or ''))}[/dim]"
        table.add_row(str(result.rank), f"{result.score:.3f}", level, found, cell)
    console.print(table)
    meta = reply.meta
    if nothing_indexed(meta.ontology_version):
        console.print(
            f"[yellow]nothing is indexed in workspace {escape(meta.workspace)!r}, branch {escape(meta.branch)!r}"
            "[/yellow] (check the name, or `ontofabric status`)"
        )
    elif main_only(meta.ontology_version):
        console.print(
            f"[yellow]branch {escape(meta.branch)!r} has nothing of its own indexed: these are main's results[/yellow] "
            "(check the branch's name, or `ontofabric status`)"
        )
    for note in answer_notes(reply, query):
        console.print(f"[yellow]{as_text(note)}[/yellow]")
    if (pending := pending_note(meta)) is not None:  # an operator tester's table did not say the index was behind
        console.print(f"[yellow]{escape(pending)}[/yellow]")
    if meta.freshness is not None and meta.freshness.stream_refused:
        console.print(f"[yellow]{escape(NOT_FOLLOWING)}[/yellow]")
    timings = " ".join(f"{stage}={ms:.1f}ms" for stage, ms in meta.timings_ms.items())
    console.print(
        f"[dim]_meta[/dim] ontologyVersion={meta.ontology_version} hybrid={meta.hybrid} reranked={meta.reranked}"
        f"{f' ({meta.reranker})' if meta.reranker else ''} "
        f"skippedRerank={meta.skipped_rerank} cacheHit={meta.cache_hit} degraded={meta.degraded} "
        f"couldBenefitFromLinkExpansion={meta.could_benefit_from_link_expansion} backend={meta.backend}"
    )
    if meta.fusion is not None:
        parameters = " ".join(f"{k}={v}" for k, v in meta.fusion.parameters.items())
        console.print(f"[dim]fusion[/dim] {meta.fusion.method} {parameters}")
    if meta.late_interaction is not None:
        interaction = meta.late_interaction
        console.print(
            f"[dim]lateInteraction[/dim] weight={interaction.weight} candidates={interaction.candidates} "
            f"withTokenVectors={interaction.with_token_vectors}"
        )
    elif meta.skipped_late_interaction:
        console.print(f"[dim]lateInteraction[/dim] skipped: {meta.skipped_late_interaction}")
    if meta.skipped_second_opinion:
        console.print(f"[dim]secondOpinion[/dim] skipped: {meta.skipped_second_opinion}")
    for context in meta.expanded_context:
        arrow = "->" if context.direction == "outgoing" else "<-"
        console.print(
            "[dim]context[/dim] "
            + as_text(
                f"{context.linked_from_type} {arrow}{context.link_name}{arrow} {context.linked_type}"
                f" (document {context.representative_document_id or 'none indexed'})"
            )
        )
    if meta.expanded_context_truncated:
        console.print("[dim]context[/dim] … more linked types than ONTOFABRIC_EXPANSION_MAX_TYPES allows")
    console.print(f"[dim]timings[/dim] {timings}")


PLAIN_PROGRESS_EVERY_S = 10.0
"""Where no terminal shows bars (a pipe, a log file, CI): how often a stage's progress is written as a line."""


class RichProgress:
    """The Progress port (shared/progress.py) drawn as rich progress bars on a terminal; elsewhere, where rich
    would draw them only once the command ends, a line per stage when it starts, at most every
    PLAIN_PROGRESS_EVERY_S as it advances, and when it is done."""

    def __init__(self, console: Console, clock: Callable[[], float] = time.monotonic) -> None:
        self._console = console
        self._plain = not console.is_terminal
        self._clock = clock
        self._progress = Progress(
            TextColumn("{task.description:>8}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self._tasks: dict[str, TaskID] = {}
        self._lines: dict[str, _PlainStage] = {}

    def __enter__(self) -> RichProgress:
        if not self._plain:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._plain:
            self._progress.stop()

    def stage(self, name: str, total: int) -> None:
        """A stage begins, of ``total`` steps; one begun before goes on with ``total`` more (a rebuild's replay
        rounds: a tester's rebuild showed its replay four times over)."""
        if self._plain:
            again = self._lines.get(name)
            if again is not None:
                again.total += total
                self._console.print(f"{name}: {again.done}/{again.total}", markup=False, highlight=False)
                return
            now = self._clock()
            self._lines[name] = _PlainStage(total, now, now)
            self._console.print(f"{name}: 0/{total}", markup=False, highlight=False)
            return
        task = self._tasks.get(name)
        if task is not None:
            done = next(shown.completed for shown in self._progress.tasks if shown.id == task)
            self._progress.update(task, total=done + total)
            return
        self._tasks[name] = self._progress.add_task(name, total=total)

    def begun(self, name: str) -> bool:
        """Whether the stage ``name`` has begun."""
        return name in self._tasks or name in self._lines

    def advance(self, name: str, amount: int = 1) -> None:
        if not self._plain:
            self._progress.advance(self._tasks[name], amount)
            return
        stage = self._lines[name]
        was_done = stage.done >= stage.total
        stage.done += amount
        now = self._clock()
        finished = stage.done >= stage.total and not was_done
        if finished or now - stage.said_at >= PLAIN_PROGRESS_EVERY_S:
            stage.said_at = now
            self._console.print(
                f"{name}: {stage.done}/{stage.total} ({now - stage.started:.0f} s)", markup=False, highlight=False
            )


@dataclass
class _PlainStage:
    total: int
    started: float
    said_at: float
    done: int = 0


def _size(count: int) -> str:
    """Bytes as an operator reads them: 1.5 MB, 230 KB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def whole_table(*headers: str) -> Table:
    """A table whose cells wrap rather than end in an ellipsis: piped, a console is 80 columns wide, and a tester's
    ``status`` showed versions and consumer names cut short (``915-d5a5…``)."""
    table = Table()
    for header in headers:
        table.add_column(header, overflow="fold")
    return table


def render_status(console: Console, status: DeploymentStatus) -> None:
    """``ontofabric status`` as tables."""
    for problem in status.problems:  # first: the rest of the report reads wrong without them
        console.print(f"[red]problem:[/red] {escape(problem)}")
    for note in status.notes:
        console.print(f"[yellow]note:[/yellow] {escape(note)}")
    branches = whole_table(
        "workspace", "branch", "ontologyVersion", "latest seq", "indexed to", "pending", "oldest pending"
    )
    for row in status.branches:
        waited = f"{row.oldest_pending_ms / 1000:.1f} s" if row.oldest_pending_ms is not None else "-"
        latest = str(row.latest_seq) if row.latest_seq else "-"
        if not row.latest_seq and row.announced_at:  # compacted away (or past the stream's age): "-" read as none
            latest = "not in stream"
        branches.add_row(
            escape(row.workspace), escape(row.branch), row.ontology_version if row.announced_at else "none yet",
            latest,
            str(row.position), str(row.pending_deltas), waited,
        )  # fmt: skip
    console.print(branches)
    letters = ", ".join(f"{escape(ws)} {count}" for ws, count in status.dead_letters.items()) or "none"
    console.print(f"dead letters: {letters}")
    consumers = whole_table(
        "projector consumer", "ack floor", "index position", "undelivered", "unacknowledged", "waiting pulls",
        "last active",
    )  # fmt: skip
    for consumer in status.consumers:
        name = consumer.name if consumer.configured else f"{consumer.name} (another layout)"
        position = "-" if consumer.index_position is None else str(consumer.index_position)
        consumers.add_row(
            name, str(consumer.ack_floor), position, str(consumer.undelivered), str(consumer.unacknowledged),
            str(consumer.waiting_pulls), shown_time(consumer.last_active) if consumer.last_active else "-",
        )  # fmt: skip
    console.print(consumers)
    streams = "; ".join(
        f"{stream.name} {stream.messages:,} messages, {_size(stream.bytes)}"
        + ("" if stream.max_bytes is None else f" of {_size(stream.max_bytes)} ({stream.bytes / stream.max_bytes:.0%})")
        for stream in status.streams
    )
    console.print(f"streams: {streams}")
    projectors = ", ".join(
        " ".join([f"{w.host}:{w.pid}", *_shown(w.details), f"(since {_started(w)}){standing_by(w, status.projectors)}"])
        for w in status.projectors
    )
    console.print(f"projectors: {projectors or 'none answering'}")
    workers = ", ".join(
        " ".join([f"{w.host}:{w.pid}", *_shown(w.details), f"(since {_started(w)})"]) for w in status.query_workers
    )
    workers = workers or "none answering"
    console.print(f"query workers: {workers}")
    analysis = status.analysis
    counts = analysis.documents_of_another_analysis
    other = ", ".join(f"{escape(ws)} {count:,}" for ws, count in counts.items())
    advice = " (`ontofabric rebuild WORKSPACE` indexes them again)" if other else ""
    nothing = "none counted" if analysis.unread else "none"
    # Which analysis the number is (an operator tester's "than 3" said nothing of it).
    console.print(
        f"documents indexed by another keyword analysis than this build's (version {analysis.version}): "
        f"{other or nothing}{advice}"
    )
    for unread in analysis.unread:
        console.print(f"  not counted on {escape(unread)}")


def _shown(details: dict[str, str]) -> list[str]:
    """A worker's details as status shows them (its embedding models, a projector's index and partitions): not the
    name of its worker object (an id for machines), nor an empty one."""
    named = (SCHEMA, BUILD)  # numbers and digests that say nothing without their names
    return [f"{key} {value}" if key in named else value for key, value in details.items() if key != INSTANCE and value]


def _started(worker: Worker) -> str:
    """When the worker began, as the other moments of status are shown; what it said as it said it when that is no
    ISO 8601 moment (another implementation of the discovery protocol)."""
    try:
        return shown_time(datetime.fromisoformat(worker.started or ""))
    except ValueError:
        return worker.started or "-"


def _schema(worker: Worker) -> int:
    """The latest migration the worker's release knows; 0 for a release that does not say."""
    schema = worker.details.get(SCHEMA, "")
    return int(schema) if schema.isdigit() else 0


def standing_by(worker: Worker, projectors: list[Worker]) -> str:
    """ ", standing by" for a Postgres projector whose partitions another that began before it applies (all, or
    the partitions named); "" for one that applies them. Which one applies is decided among processes of one
    release: one of an earlier release than the newest answering is said to be that (one from before the fences
    applies without taking part, an upgrade tester's)."""
    if _schema(worker) < max(map(_schema, projectors), default=0):
        return ", of an earlier release"
    announced = postgres_partitions(worker)
    if announced is None:
        return ""
    layout, partitions = announced
    held = held_elsewhere(worker.id, worker.started or "", layout, partitions, projectors)
    if not held:
        return ""
    return ", standing by" if held == partitions else f", standing by for {','.join(map(str, sorted(held)))}"
