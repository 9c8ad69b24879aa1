"""The ``ontofabric`` command. Settings come from ONTOFABRIC_* environment variables (``ontofabric settings``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from datetime import UTC, datetime
from importlib.metadata import version as package_version
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import asyncpg
import nats.errors
import typer
from nats.aio.client import Client
from nats.js import JetStreamContext
from pydantic import TypeAdapter, ValidationError
from pydantic_settings import SettingsError
from rich.console import Console
from rich.markup import escape
from typer.core import TyperOption

from ontofabric.contracts import CHUNK_LEVELS, MAIN_BRANCH, PROVENANCES, ErrorReply, schema
from ontofabric.contracts.documents import BRANCH, WORKSPACE
from ontofabric.contracts.query import MAX_TOKENS_LIMIT, MIN_MAX_TOKENS
from ontofabric.shared.db import DeploymentMismatch, migrate
from ontofabric.shared.embedder import EmbedderMismatch, ModelMissing, build_embedder
from ontofabric.shared.embedding_cache import EmbeddingCache
from ontofabric.shared.http_embedder import EmbeddingApiError
from ontofabric.shared.jetstream import (
    ANY_SUBJECT,
    NATS_AWAY,
    ConnectionLost,
    NatsUnreachable,
    NotSetUp,
    PermissionDenied,
    connect,
    layouts_with_consumers,
    refused_promptly,
    stream_ends_before,
    wait_projected,
)
from ontofabric.shared.jetstream import close as close_nats
from ontofabric.shared.logging import configure_logging, describe, get_logger
from ontofabric.shared.manifest_store import ManifestChanged, ManifestMissing, ManifestUnavailable
from ontofabric.shared.nats_auth import NATS_ROLES, BadCredentials, NatsRole
from ontofabric.shared.onnx_models import second_embedder
from ontofabric.shared.placement import Placement
from ontofabric.shared.printable import printable
from ontofabric.shared.progress import Progress, ProjectionWatch
from ontofabric.shared.runtime import (
    NATS_USERS_FILE,
    RUNTIME_FILE,
    EmbeddedRuntime,
    Endpoints,
    RuntimeUnavailable,
    add_nkey_user,
    ensure_nats_users,
    nats_users,
    reload_running_nats,
    remove_nats_user,
    resolve_endpoints,
    resolve_nats_url,
    running_up,
    servers_moved,
    with_login,
)
from ontofabric.shared.settings import Settings, SettingsUnusable, redacted_url, unknown_variables
from ontofabric.shared.subjects import NO_WORKSPACE, PARTITION_COUNTS, Names
from ontofabric.shared.telemetry import MetricsUnservable, configure_telemetry

from .gateway.auth import ALL_WORKSPACES, TokenStore, TokensUnreadable
from .gateway.errors import StdioUnusable
from .gateway.link import NatsLink, NatsUnavailable
from .ingest.client import PublishFailed
from .ops.dead_letters import (
    DeadLetter,
    DeadLetterWatch,
    Redrive,
    Selection,
    SetAside,
    applied_through,
    dead_letters,
    parse_when,
    purge,
    redrive,
)
from .ops.quality_gate import MIN_EFFECT, BaselineMismatch
from .ops.quality_gate import Baseline as QualityBaseline
from .ops.status import DeploymentStatus
from .projector.consumer import REFUSED_BY_EVERY_PROCESS
from .projector.planning import refused_for_a_long_key
from .render import RichProgress, as_text, render_reply, render_status, whole_table

if TYPE_CHECKING:
    from .ingest.ingester import Ingester, IngestReport
    from .ops.adopt import Adopted

log = get_logger(__name__)


def _show_flags_bare() -> None:
    """Typer 0.29's help shows ``<bool>`` beside a flag, which reads as if it took a value (``--write true`` is
    then refused): a flag is shown bare. Older typer has no such method, and shows no type beside a flag."""
    typed = getattr(TyperOption, "display_type_rich", None)
    if typed is None:
        return

    def bare_flags(option: TyperOption, ctx: Any) -> str | None:
        shown: str | None = None if option.is_flag else typed(option, ctx)
        return shown

    TyperOption.display_type_rich = bare_flags  # type: ignore[method-assign,assignment]


_show_flags_bare()


def _help_width() -> None:
    """Help printed to no terminal (a pipe, a file, an agent's shell) is 120 columns wide, unless TERMINAL_WIDTH or
    COLUMNS says otherwise: at rich's 80, option names were cut (`--sample-documen…`, a docs tester's)."""
    from typer import rich_utils

    if not sys.stdout.isatty() and not os.environ.get("TERMINAL_WIDTH") and not os.environ.get("COLUMNS"):
        rich_utils.MAX_WIDTH = 120


_help_width()

app = typer.Typer(
    help="Event-driven indexing and hybrid query workers for ontology SemanticDocuments.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
errors = Console(stderr=True)
for _output in (console, errors):
    # Into a pipe or a file, a line is not cut at rich's 80 columns: an operator tester's paths and sentences broke
    # mid-word for grep (a table is still laid out at that width).
    _output.soft_wrap = not _output.is_terminal

DataDir = Annotated[
    Path | None,
    typer.Option(
        "--data-dir",
        help="Data directory of the embedded servers (env ONTOFABRIC_DATA_DIR; default .ontofabric in the current "
        "directory).",
    ),
]


def _print_version(asked: bool) -> None:
    if asked:
        console.print(f"ontofabric {package_version('ontofabric')}", highlight=False)
        raise typer.Exit()


@app.callback()
def _commands(
    version: Annotated[
        bool,
        typer.Option("--version", help="Print the installed version and exit.", callback=_print_version, is_eager=True),
    ] = False,
) -> None:
    """Event-driven indexing and hybrid query workers for ontology SemanticDocuments."""


LockTimeout = Annotated[
    float,
    typer.Option(min=0.1, help="Seconds the swap may wait for its locks; past that it gives up, and can be run again."),
]


def _settings(service: str, data_dir: Path | None = None, quiet: bool = False, worker: bool = False) -> Settings:
    """The settings; logging and telemetry set up. ``worker``: a long-running process, which serves its metrics
    for Prometheus when ``metrics_port`` is set."""
    settings = Settings()
    if data_dir is not None:
        settings = settings.model_copy(update={"data_dir": data_dir})
    # Interactive commands keep the terminal for their output unless a log level was asked for.
    # An empty one is unset, as for every setting (a configuration tester's `ONTOFABRIC_LOG_LEVEL=` logged INFO).
    level = settings.log_level if not quiet or os.environ.get("ONTOFABRIC_LOG_LEVEL") else "WARNING"
    configure_logging(level, settings.log_format)
    for variable, resembles in unknown_variables(os.environ).items():
        log.warning("unknown_setting", variable=variable, did_you_mean=resembles)
    serve = worker and settings.metrics_port is not None
    configure_telemetry(
        service,
        metrics_address=(settings.metrics_host, settings.metrics_port or 0) if serve else None,
        trace_clients=settings.trace_clients,
    )
    return settings


def _ingest_summary(report: IngestReport, started: float) -> str:
    """An ingest's counts, its time since ``started`` (``time.perf_counter``): printed whether or not its wait for
    the projection ended in time (an auditor's timed-out wait printed none of them)."""
    return (
        f"{report.files} files, {report.chunks} chunks: {report.upserts} upserts, {report.deletes} deletes, "
        f"{report.reverts} reverts, {report.unchanged} unchanged; {report.graph_changes} graph changes "
        f"({time.perf_counter() - started:.1f}s)"
    )


def _fail(message: str, code: int = 2) -> NoReturn:
    # The message as written: a path, a pattern or a dead letter's detail holding "[/x]" was read as markup.
    errors.print(f"[red]error:[/red] {as_text(message, lines=True)}")
    raise typer.Exit(code)


def _stop(settings: Settings, message: str, code: int = 2) -> NoReturn:
    """A long-running service's end: under ONTOFABRIC_LOG_FORMAT=json its stderr is a log stream, so the reason is
    logged as a JSON event (``stopped``), not printed as a line a log shipper cannot read (a new operator's)."""
    if settings.log_format != "json":
        _fail(message, code)
    log.error("stopped", reason=message, exit_code=code)
    raise typer.Exit(code)


_terminated = threading.Event()
"""Set by SIGTERM, which then ends a one-shot command as Ctrl-C does."""


def _raise_terminated(signum: int, frame: Any) -> None:
    """As Ctrl-C: asyncio.run's own SIGINT handler cancels the main task cleanly (raised anywhere, a background
    task's traceback was logged). Where it has none (SIGINT ignored, as a script's `cmd &` starts it), a running
    event loop raises KeyboardInterrupt between its callbacks: raised in the frame the signal came to, it was once
    swallowed in a weakref's callback (the rebuild went on and swapped) and once raised in nats-py's flusher (the
    ingest blamed the server), an operator tester's. Else KeyboardInterrupt where the main thread is."""
    _terminated.set()
    on_interrupt = signal.getsignal(signal.SIGINT)
    if callable(on_interrupt) and on_interrupt is not signal.default_int_handler:
        on_interrupt(signal.SIGINT, frame)
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # none runs: the command is between its steps
        raise KeyboardInterrupt from None
    loop.call_soon_threadsafe(_interrupt)


def _interrupt() -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """A supervisor's SIGTERM ends a one-shot command as Ctrl-C does, saying what became of its work (a model
    tester's: SIGTERM ended `reembed` without a word)."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupted() -> typer.Exit:
    """The exit a shell gives for the signal: 130 for Ctrl-C, 143 for SIGTERM."""
    return typer.Exit(143 if _terminated.is_set() else 130)


def _workspace_name(value: str | None) -> str | None:
    """A command's workspace, checked before any work (a usage error, not a traceback after embedding a tree)."""
    rule = "letters, digits, '.', '_', '-'; at most 128 characters"
    return None if value is None else _checked(WORKSPACE, value, rule)


def _branch_name(value: str | None) -> str | None:
    rule = "letters, digits, '.', '_', '-', '/'; at most 255 characters"
    return None if value is None else _checked(BRANCH, value, rule)


def _checked(adapter: TypeAdapter[str], value: str, rule: str) -> str:
    try:
        return adapter.validate_python(value)
    except ValidationError:
        raise typer.BadParameter(f"{value!r} is not a valid name: {rule}, starting with a letter or digit") from None


def _serve(
    settings: Settings,
    endpoints: Endpoints,
    roles: dict[str, bool],
    on_ready: Callable[[], Awaitable[None]] | None = None,
    exited: Callable[[], list[str]] | None = None,
) -> None:
    """Run workers (``roles``: :class:`~.app.Roles`' fields) until a signal; exit 1 when a NATS connection is lost
    for good, an embedded server ended, or the servers of the ``up`` they were found through moved (a supervisor
    restarts them)."""
    # Here, not at the top: the workers' modules (the model, the MCP SDK) took a second of every command's start,
    # `--help` too.
    from .app import Roles, ServersEnded, serve_until_signal

    if exited is None:
        exited = servers_moved(settings, endpoints)
    try:
        asyncio.run(serve_until_signal(settings, endpoints, Roles(**roles), on_ready, exited))
    except (ConnectionLost, ServersEnded) as error:
        _stop(settings, str(error), code=1)


def _endpoints(settings: Settings) -> Endpoints:
    try:
        return resolve_endpoints(settings)
    except RuntimeUnavailable as error:
        _fail(str(error))


def _nats_url(settings: Settings, role: NatsRole) -> str:
    """NATS alone, as ``role``, for a command that needs no database (``_endpoints`` wants both)."""
    try:
        return resolve_nats_url(settings, role)
    except RuntimeUnavailable as error:
        _fail(str(error))


@app.command()
def up(
    data_dir: DataDir = None,
    with_projector: Annotated[
        bool,
        typer.Option(
            "--projector/--no-projector",
            help="Run the projector (and the Azure one, where set up) in this process; without, `ontofabric "
            "projector` processes apply the deltas, and can be restarted or failed over alone.",
        ),
    ] = True,
    with_query_worker: Annotated[
        bool,
        typer.Option(
            "--query-worker/--no-query-worker",
            help="Run a query worker in this process; without, `ontofabric query-worker` processes answer.",
        ),
    ] = True,
) -> None:
    """Start embedded servers (unless URLs are set), the projector and a query worker; run until Ctrl-C/SIGTERM.
    With --no-projector --no-query-worker: the servers alone, for workers run as processes of their own."""
    # Without workers it serves no metrics: the port is theirs (a review's: the projector beside it failed to start).
    settings = _settings("ontofabric-up", data_dir, worker=with_projector or with_query_worker)
    if not (with_projector or with_query_worker) and settings.nats_url and settings.database_url:
        # A tester's: with both servers elsewhere it started nothing and sat there as if it served.
        _stop(
            settings,
            "nothing to run: --no-projector --no-query-worker runs the embedded servers alone, and "
            "ONTOFABRIC_NATS_URL and ONTOFABRIC_DATABASE_URL name servers of their own",
        )
    try:
        with EmbeddedRuntime(settings) as runtime:
            assert runtime.endpoints is not None
            endpoints = runtime.endpoints

            async def ready() -> None:
                credentials = runtime.data_dir / RUNTIME_FILE if endpoints.nats_logins else None
                if settings.log_format == "json":  # stderr is the log stream: a line a log reader can parse
                    log.info(
                        "ready", nats=redacted_url(endpoints.nats_url), database=redacted_url(endpoints.database_url),
                        read_replicas=[redacted_url(url) for url in endpoints.replica_urls],
                        credentials=str(credentials) if credentials else None,
                    )  # fmt: skip
                    return
                errors.print(
                    f"[green]ready[/green] nats={redacted_url(endpoints.nats_url)} "
                    f"database={redacted_url(endpoints.database_url)} (Ctrl-C stops)"
                )
                for replica_url in endpoints.replica_urls:
                    errors.print(f"read replica {redacted_url(replica_url)}")
                if credentials is not None:
                    errors.print(
                        f"NATS requires credentials; each role's are in {credentials} (owner "
                        "only): `ingest`, `query` and `mcp` read them there; another client takes the `client` "
                        "login (docs/security.md)"
                    )

            roles = {"projector": with_projector, "query": with_query_worker, "azure_projector": with_projector}
            _serve(settings, endpoints, roles, ready, runtime.exited)
    except RuntimeUnavailable as error:
        _stop(settings, str(error))


@app.command()
def projector(data_dir: DataDir = None) -> None:
    """Run only the Postgres projector. Another started beside it stands by and takes over if it goes away; to
    apply workspaces in parallel, divide them (ONTOFABRIC_PROJECTOR_PARTITIONS, ONTOFABRIC_PROJECTOR_PARTITION)."""
    settings = _settings("ontofabric-projector", data_dir, worker=True)
    endpoints = _endpoints(settings)
    _serve(settings, endpoints, {"projector": True, "query": False, "azure_projector": False})


@app.command("azure-projector")
def azure_projector(data_dir: DataDir = None) -> None:
    """Run only the Azure AI Search projector (ONTOFABRIC_AZURE_SEARCH_*): keeps the index in sync from a durable
    consumer of its own. Run one: Azure AI Search cannot order two writers' updates of one document."""
    settings = _settings("ontofabric-azure-projector", data_dir, worker=True)
    if settings.azure_search_endpoint is None:
        _fail("ONTOFABRIC_AZURE_SEARCH_ENDPOINT is not set")
    endpoints = _endpoints(settings)
    _serve(settings, endpoints, {"projector": False, "query": False, "azure_projector": True})


@app.command("query-worker")
def query_worker(data_dir: DataDir = None) -> None:
    """Run only a query worker (scale out by starting more: they form one queue group)."""
    settings = _settings("ontofabric-query", data_dir, worker=True)
    endpoints = _endpoints(settings)
    _serve(settings, endpoints, {"projector": False, "query": True, "azure_projector": False})


def _stalled_projection(floor: int, target: int, still_s: float) -> None:
    errors.print(
        f"[yellow]warning:[/yellow] the index has stayed at stream seq {floor} for {still_s:.0f} s (this ingest "
        f"ends at {target}): is a projector running, and following the stream? `ontofabric status` shows the "
        "projectors, their problems and the dead letters."
    )


def _source_tree(value: Path) -> Path:
    """A directory: a pipe or a device passed as PATH was read as an empty tree (an ingest tester's)."""
    if not value.is_dir():
        raise typer.BadParameter(f"{value} is not a directory")
    return value


@app.command()
def ingest(
    path: Annotated[
        Path,
        typer.Argument(
            exists=True,
            file_okay=False,
            help="Source tree to ingest: Python, TypeScript, JavaScript, Go, Rust and Java code, documents (.md, .rst, "
            ".txt), configuration and scripts (.yaml, .toml, .sql, .sh).",
            callback=_source_tree,
        ),
    ],
    workspace: Annotated[str, typer.Option(help="Workspace to publish into.", callback=_workspace_name)],
    branch: Annotated[str, typer.Option(help="Branch to publish into.", callback=_branch_name)] = MAIN_BRANCH,
    wait: Annotated[bool, typer.Option(help="Wait until the projector has applied every delta.")] = True,
    wait_timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            help="Seconds to wait for the projector before giving up with exit 1 (the deltas stay stored and are "
            "projected when a projector runs).",
        ),
    ] = 3600.0,
    package: Annotated[
        str | None,
        typer.Option(
            help="The tree's package name, which leads its modules' names (default: the directory's name when the "
            "tree holds __init__.py at its root; '' for none). Give the same for every checkout of one package."
        ),
    ] = None,
    exclude: Annotated[
        list[str] | None,
        typer.Option(
            metavar="PATTERN",
            help="Leave out what matches this shell pattern, as .gitignore reads one (repeatable): without `/` a "
            "file or directory name at any depth (`tests`, `'*_pb2.py'`), with `/` a path from the tree's root "
            "(`docs/*.md`). What an earlier ingest published of it is deleted (on a branch: hidden); give the same "
            "patterns to every ingest of a workspace and its branches (a note says when they differ from the last "
            "ingest's, or from main's).",
        ),
    ] = None,
    allow_empty: Annotated[
        bool,
        typer.Option(
            help="Ingest a tree with no source file even when that deletes every document the last ingest of the "
            "workspace and branch published (refused otherwise: a wrong path or a volume not mounted)."
        ),
    ] = False,
    gitignore: Annotated[
        bool,
        typer.Option(
            help="In a git work tree, leave out what .gitignore files leave out, as git reads them: the tree's own, "
            "those above it up to the work tree's top, and .git/info/exclude (a note counts what they left out; "
            "outside a work tree none applies, as for git). --no-gitignore indexes it too."
        ),
    ] = True,
    data_dir: DataDir = None,
) -> None:
    """Chunk a source tree and publish what changed since the last ingest of this workspace and branch.

    Its progress counts chunks embedded, deltas published, then stream sequences projected: from where the index
    stood at the first look to this ingest's last delta, other workspaces' deltas between included."""
    from .ingest.chunking import tree_package
    from .ingest.ingester import SOURCES_READ, EmptyTreeRefused, ExclusionRefused, Ingester, exclusion_patterns

    try:
        tree_package("", [], package)
        exclusion_patterns(path, exclude or ())  # refused before the model loads
    except ValueError as error:
        _fail(str(error))
    settings = _settings("ontofabric-ingest", data_dir, quiet=True)
    nats_url = _nats_url(settings, "ingest")
    names = Names(settings.subject_prefix)

    async def run() -> None:
        # Documents only, and loaded when the first text the embedding cache lacks is embedded: an ingest that
        # sends nothing new did wait ~5 s for it.
        embedder = build_embedder(settings, for_queries=False, on_demand=True)
        nc = await connect(nats_url, "ontofabric-ingest", settings)
        followed: list[tuple[str, Client]] = []

        async def moved() -> JetStreamContext | None:
            """A connection to where the NATS server is recorded now, when it moved (`up` restarted on other
            ports); None while it is where it was, or cannot be reached."""
            try:
                url = resolve_nats_url(settings, "ingest")
            except (RuntimeUnavailable, ValueError, OSError):  # none recorded, or a record not readable now
                return None
            if url == (followed[-1][0] if followed else nats_url):
                return None
            try:
                fresh = await connect(url, "ontofabric-ingest", settings)
            except (NatsUnreachable, PermissionDenied):
                return None
            followed.append((url, fresh))
            return fresh.jetstream()

        try:
            js = nc.jetstream()  # the streams are the projector's to create; an ingester may not even list them
            set_aside = await DeadLetterWatch.start(nc, names, workspace) if wait else None
            started = time.perf_counter()
            with progress:
                cache = EmbeddingCache(settings.cache_dir / "embeddings.sqlite")
                try:
                    second = await asyncio.to_thread(second_embedder, settings)
                    ingester = Ingester(
                        js, names, embedder, settings.max_content_bytes, progress, cache, settings.token_vectors,
                        second, settings.ingest_max_file_bytes,
                    )  # fmt: skip
                    try:
                        report = await ingester.ingest(
                            path.resolve(), workspace, branch, package, exclude or (), allow_empty, gitignore
                        )
                    except (ExclusionRefused, EmptyTreeRefused) as error:
                        _fail(str(error))
                    except PublishFailed as error:
                        if set_aside is not None and error.keys_by_sequence:
                            await _settle_stored(
                                js, nc, names, settings, set_aside, ingester, error, wait_timeout, workspace, branch,
                                progress,
                            )  # fmt: skip
                        raise
                    except ManifestMissing as error:
                        _fail(
                            f"{error}. Nothing was published. What this workspace and branch last ingested is unknown; "
                            'an operator removes the damaged key (docs/security.md, "Ingest manifests") and the '
                            "next ingest publishes every chunk again."
                        )
                finally:
                    cache.close()
                _note_exclusions(report, workspace, branch)  # before the wait, which may end the command
                if report.raced:  # a tester's: both exited 0, neither saying the branch was neither's result
                    errors.print(
                        _RACED.format(what="ingest", workspace=workspace, branch=branch), soft_wrap=True, markup=False
                    )
                if report.files == 0 and not allow_empty:  # a first ingest of a wrong path said only "0 files"
                    errors.print(
                        f"warning: {path} holds no source file this ingester reads ({SOURCES_READ}): nothing to index",
                        soft_wrap=True,
                        markup=False,
                    )
                awaited = report.awaited_sequence
                # Whose deltas the wait is for: this ingest's, main's last ingest's (a branch that sent nothing), or
                # the branch's earlier ingest's.
                for_main = awaited != report.last_sequence and awaited == report.main_pending_through

                # The partition layouts with consumers, read once: from a shell without the deployment's setting, an
                # ingest waited on consumers no projector makes, and blamed the projector (a tester's).
                layouts = await layouts_with_consumers(js, names, PARTITION_COUNTS) if wait else []
                if wait and awaited is not None and awaited != report.last_sequence:
                    gone = any([await stream_ends_before(js, names, count, awaited) for count in layouts])
                    if gone:  # a review's: such an ingest waited out its whole --wait-timeout, then exited 1
                        errors.print(
                            f"warning: the last ingest of {workspace}/{MAIN_BRANCH if for_main else branch} recorded "
                            f"its deltas up to stream seq "
                            f"{awaited}, past the end of the delta stream (made again since?): not waiting for them",
                            soft_wrap=True,
                            markup=False,
                        )
                        awaited = report.last_sequence
                if wait and awaited is not None:
                    first = min(report.published, default=None) if awaited == report.last_sequence else None
                    watch = ProjectionWatch(progress, awaited, _stalled_projection, first=first)
                    if settings.projector_partitions not in layouts and layouts:
                        errors.print(
                            f"note: the {settings.projector_partitions}-partition layout "
                            "ONTOFABRIC_PROJECTOR_PARTITIONS names has no consumers; waiting on those of the "
                            f"{' and '.join(map(str, layouts))}-partition layout (set it as the projectors have it)",
                            soft_wrap=True,
                            markup=False,
                        )
                    try:
                        await wait_projected(
                            js, names, settings.projector_partitions, awaited, wait_timeout, on_floor=watch, moved=moved
                        )
                    except TimeoutError:
                        console.print(_ingest_summary(report, started))  # what was sent, said as without a wait
                        if awaited == report.last_sequence:
                            whose = "this ingest's"
                        elif for_main:
                            whose = f"{MAIN_BRANCH}'s last ingest's (the branch reads its documents)"
                        else:
                            whose = "an earlier ingest's"
                        _fail(
                            f"not projected within {wait_timeout:g} s: the index is at stream seq {watch.floor}, "
                            f"{whose} last delta is {awaited}. The deltas are stored; a running projector applies "
                            "them (`ontofabric status` shows the projectors and dead letters).",
                            1,
                        )
            console.print(_ingest_summary(report, started))
            if report.unparsed:  # an agent tester's file, broken mid-edit, lost its symbols without a word
                shown = "; ".join(report.unparsed[:5]) + ("; ..." if len(report.unparsed) > 5 else "")
                errors.print(
                    f"warning: files that could not be parsed, or were too large to, so only their whole text is "
                    f"indexed (no symbols, sections, calls or graph of theirs until they parse): {shown}",
                    soft_wrap=True,
                    markup=False,
                )
            if report.unread:  # a directory not listed was dropped, its documents deleted (an ingest tester's)
                shown = ", ".join(report.unread[:5]) + (", ..." if len(report.unread) > 5 else "")
                errors.print(
                    f"warning: {len(report.unread)} paths could not be read (access denied?): {shown}. Nothing was "
                    "deleted, since what they held may still be there; give the ingester access to them, or "
                    "--exclude them, and ingest again",
                    soft_wrap=True,
                    markup=False,
                )
            if report.too_large:
                shown = ", ".join(report.too_large[:5]) + (", ..." if len(report.too_large) > 5 else "")
                errors.print(  # an operator tester's 4.2 MB file, under a content limit raised past a message's
                    f"{len(report.too_large)} documents were not published: as JSON their delta is larger than a "
                    "message of the stream may be (about 1 MiB, or the NATS server's max_payload if smaller). Keep "
                    f"ONTOFABRIC_MAX_CONTENT_BYTES ({settings.max_content_bytes:,}) well under it; text of control "
                    f"characters takes up to six bytes each as JSON. The next ingest tries them again: {shown}",
                    soft_wrap=True,
                    markup=False,
                )
            if set_aside is not None and report.awaited_sequence is not None and followed:
                errors.print(
                    "warning: the NATS server moved during the wait (`ontofabric up` restarted?), and this ingest's "
                    f"watch for dead letters with it: `ontofabric dlq list --workspace {workspace}` lists any",
                    soft_wrap=True,
                    markup=False,
                )
            elif set_aside is not None:
                await _fail_on_branch_dead_letters(nc, names, set_aside, ingester, report, workspace, branch)
            if set_aside is not None and report.main_pending_through is not None and not followed:
                # A branch waited for main's last ingest too: what of it was set aside meanwhile, it reads without.
                await _dead_letters_in(nc)
                subject = names.delta_subject(workspace, MAIN_BRANCH)
                mains = set_aside.on_subject_within(subject, report.main_pending_from or 0, report.main_pending_through)
                _fail_on_dead_letters(mains, None, workspace, f"deltas {MAIN_BRANCH}'s last ingest published")
            if report.too_large or report.raced:
                raise typer.Exit(1)
        finally:
            for _, connection in followed:
                await close_nats(connection)
            await close_nats(nc)

    progress = RichProgress(console)
    try:
        with _sigterm_as_interrupt():
            asyncio.run(run())
    except KeyboardInterrupt:  # a tester's: Ctrl-C ended it silently, leaving the operator to guess
        errors.print(
            "interrupted: the deltas published so far are stored and a running projector applies them; the same "
            "ingest again is safe (it sends again what it had begun to send)"
            if progress.begun("publish")
            else "interrupted before anything was published: the index is as it was; the same ingest again starts "
            "over (the chunks embedded so far are cached)",  # a tester's: said the same while chunking
            soft_wrap=True,
        )
        raise _interrupted() from None


def _note_exclusions(report: IngestReport, workspace: str, branch: str) -> None:
    """Say when this ingest's --exclude patterns differ from the branch's last ingest's, or from main's, and when a
    branch's modules are named after main's package, not the tree's directory."""

    def shown(patterns: Sequence[str]) -> str:
        return shlex.join(patterns) if patterns else "nothing"

    now, notes = shown(report.exclusions), []
    if report.exclusions_before is not None:
        notes.append(
            f"the last ingest of {workspace}/{branch} excluded {shown(report.exclusions_before)}; this one excludes "
            f"{now}, and the index follows this one"
        )
    if report.main_exclusions is not None:
        notes.append(
            f"{workspace}/{MAIN_BRANCH} was last ingested excluding {shown(report.main_exclusions)}; this ingest of "
            f"{branch} excludes {now}, and what they differ in shows as the branch's own changes"
        )
    if report.main_never_ingested:
        notes.append(
            f"{workspace}/{MAIN_BRANCH} has no ingest manifest (not ingested by `ontofabric ingest`): {branch} holds "
            f"every file as its own, and none of main's later changes will show on it; ingest main first, then "
            f"{branch} again"
        )
    if report.ignored:
        more = len(report.ignored) - 5
        first = ", ".join(printable(path) for path in report.ignored[:5]) + (f" and {more} more" if more > 0 else "")
        notes.append(
            f"{len(report.ignored)} source files and directories left out as .gitignore files say ({first}); "
            "--no-gitignore indexes them"
        )
    if report.other_kinds:
        from .ingest.ingester import SOURCES_READ

        more = len(report.other_kinds) - 8
        kinds = ", ".join(f"{printable(kind)} {count}" for kind, count in report.other_kinds[:8])
        notes.append(
            f"{sum(count for _, count in report.other_kinds)} files of kinds this ingester does not read are not "
            f"indexed ({kinds}{f' and {more} more kinds' if more > 0 else ''}); it reads {SOURCES_READ}"
        )
    if report.package_before is not None:  # an upgrade tester's: a rename with no word, branches left behind
        before = report.package_before or "none"
        later = (
            f"; {workspace}'s branches ingested before keep the old names (and their calls to main's) until each is "
            "ingested again"
            if branch == MAIN_BRANCH
            else ""
        )
        notes.append(
            f"the last ingest of {workspace}/{branch} named the modules after {before}, this one after "
            f"{report.package or 'none'}: every module is published again under its new name{later}"
        )
    if report.package_from_imports is not None:
        notes.append(
            f"the modules are named after {report.package_from_imports}, as the tree's own files import them, not "
            f"after its directory; pass --package to name them otherwise"
        )
    if report.package_of_main is not None:
        notes.append(
            f"the modules are named after {report.package_of_main}, as {workspace}/{MAIN_BRANCH} names them, not after "
            f"this tree's directory; pass --package to name them otherwise"
        )
    for note in notes:
        errors.print(f"note: {note}", soft_wrap=True, markup=False)


async def _dead_letters_in(nc: Client) -> None:
    """Flushed, so that every dead letter published before its delta counted as projected has reached the watch;
    exit 1, saying so, when NATS went away meanwhile (a fault tester's ingest printed its success and then ended in
    a FlushTimeoutError traceback)."""
    try:
        await nc.flush()
    except (*NATS_AWAY, nats.errors.FlushTimeoutError, nats.errors.ConnectionClosedError) as error:
        _fail(
            f"the deltas are projected, but whether a projector set any aside could not be read: NATS went away "
            f"({describe(error)}); `ontofabric status` counts the dead letters per workspace",
            code=1,
        )


_RACED = (
    "warning: another ingest or delete-branch of {workspace}/{branch} published at the same time as this {what}: the "
    "index holds a mix of the two, and the changes they disagree on are recorded unknown. Run the one whose result "
    "you want again, once the other is done."
)


SETTLE_STORED_WAIT_S = 120.0
"""The longest a command whose publish failed part way waits for what it stored to be projected."""
NATS_FLUSH_S = 5
"""How long a flush (a round trip to the server, so that what it sent before has arrived) may take."""


async def _settle_stored(
    js: JetStreamContext,
    nc: Client,
    names: Names,
    settings: Settings,
    set_aside: DeadLetterWatch,
    ingester: Ingester,
    failed: PublishFailed,
    wait_timeout: float,
    workspace: str,
    branch: str,
    progress: Progress,
    held_or_not: bool = False,
) -> None:
    """After a publish that failed part way, whose stored deltas the manifest records as sent: wait (within the
    command's wait, and SETTLE_STORED_WAIT_S) until they are projected, and record unknown again those a projector
    set aside, so that the next run, which sends only the rest, sends them too (``held_or_not``:
    :meth:`Ingester.forget`'s). Said before it waits: a review's full stream behind a projector's backlog held the
    command silent for its whole wait."""
    stored = failed.keys_by_sequence
    limit = min(wait_timeout, SETTLE_STORED_WAIT_S)
    errors.print(
        f"publishing failed part way ({len(failed.unconfirmed)} deltas not confirmed stored; the error follows): "
        f"waiting up to {limit:g} s for the {len(stored)} stored to be projected, to learn whether a projector set "
        "any aside",
        soft_wrap=True,
        markup=False,
    )
    # A stalled index said as it stalls.
    watch = ProjectionWatch(progress, max(stored), _stalled_projection, first=min(stored))
    try:
        await wait_projected(js, names, settings.projector_partitions, max(stored), limit, on_floor=watch)
        await nc.flush(timeout=NATS_FLUSH_S)  # what was set aside meanwhile reached the watch
    except Exception as error:  # the publish's own error is what the command ends with
        why = (
            f"the index at stream seq {watch.floor} after {limit:g} s" if isinstance(error, TimeoutError) else None
        )  # a retest's said "TimeoutError: " and nothing more
        errors.print(
            f"warning: the {len(stored)} deltas stored before the failure were not seen projected "
            f"({why or describe(error)}): `ontofabric compact` makes room only of what a projector has applied, so "
            "one must be running; any of them set aside is not sent again by the next run (`ontofabric dlq list "
            f"--workspace {workspace}` lists them)",
            soft_wrap=True,
            markup=False,
        )
        return
    letters = set_aside.of(set(stored))
    refused = [stored[a.original_seq] for a in letters if a.original_seq in stored]
    await ingester.forget(workspace, branch, refused, held_or_not=held_or_not)
    if letters:
        errors.print(
            f"warning: {len(letters)} of the {len(stored)} deltas stored before the failure were set aside by a "
            "projector: the next run sends them again with the rest",
            soft_wrap=True,
            markup=False,
        )


async def _fail_on_branch_dead_letters(
    nc: Client,
    names: Names,
    set_aside: DeadLetterWatch,
    ingester: Ingester,
    report: IngestReport,
    workspace: str,
    branch: str,
    earlier: str = "deltas an earlier ingest published",
    held_or_not: bool = False,
) -> None:
    """Exit 1 when a projector set aside deltas this run published, recorded unknown in the branch's manifest so
    that the next run sends them again (``held_or_not``: :meth:`Ingester.forget`'s); or, when it published none,
    deltas of the earlier run it waited for (``earlier`` says whose), which are not in the index either (a review's:
    a retry exited 0 over them). Any set aside before this run began, it cannot see."""
    if not report.published and report.pending_through is None:
        return
    await _dead_letters_in(nc)
    if report.published:
        letters = set_aside.of(report.published)
        refused = [report.keys_by_sequence[a.original_seq] for a in letters if a.original_seq is not None]
        await ingester.forget(workspace, branch, refused, held_or_not=held_or_not)  # not "unchanged" next time
        _fail_on_dead_letters(letters, len(report.published), workspace)
        return
    assert report.pending_through is not None
    subject = names.delta_subject(workspace, branch)
    letters = set_aside.on_subject_within(subject, report.pending_from or 0, report.pending_through)
    _fail_on_dead_letters(letters, None, workspace, earlier)


def _fail_on_dead_letters(
    letters: Sequence[SetAside],
    published: int | None,
    workspace: str,
    whose: str = "deltas an earlier ingest published",
) -> None:
    """Exit 1 when a projector set aside some of this ingest's deltas (``published`` of them), or of an earlier
    ingest's it waited for (None; ``whose`` says which): they are not in the index."""
    if not letters:
        return
    reasons = Counter(letter.reason for letter in letters)
    first = letters[0]
    whose = f"of the {published} deltas published" if published is not None else whose
    _fail(
        f"{len(letters)} {whose} were dead-lettered, not indexed "
        f"({', '.join(f'{reason}: {count}' for reason, count in reasons.most_common())}); the first: "
        f"{first.detail or first.reason}. `ontofabric dlq list --workspace {workspace}` shows them; after "
        "a fix, `ontofabric dlq redrive` sends them again.",
        1,
    )


@app.command("delete-branch")
def delete_branch(
    workspace: Annotated[str, typer.Option(help="The branch's workspace.", callback=_workspace_name)],
    branch: Annotated[str, typer.Option(help="The branch to delete (not main).", callback=_branch_name)],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    wait: Annotated[bool, typer.Option(help="Wait until the projector has applied every revert.")] = True,
    wait_timeout: Annotated[
        float, typer.Option(min=0.1, help="Seconds to wait for the projector before giving up with exit 1.")
    ] = 3600.0,
    data_dir: DataDir = None,
) -> None:
    """Take back everything the branch's ingests published, for a branch merged or given up: it then reads as
    main does.

    Publishes a revert for every document, tombstone and graph row the branch's ingest manifest holds, and leaves
    the manifest empty (a later ingest of the branch starts afresh). The index keeps of each row only the stream
    sequence that keeps older deltas out; the branch's version stays, and `ontofabric status` lists it. Deltas
    published to the branch by other producers than `ontofabric ingest` are not in its manifest, and are not
    taken back, and neither are the changes of an ingest of the branch running at the same time: run it again
    after that ingest. Needs the ingest role only: a user confined to the workspace may delete its branches."""
    from .ingest.ingester import Ingester

    if branch == MAIN_BRANCH:
        _fail(f"{MAIN_BRANCH} is no branch of another: only a branch can be deleted (it then reads as {MAIN_BRANCH})")
    settings = _settings("ontofabric-delete-branch", data_dir, quiet=True)
    nats_url = _nats_url(settings, "ingest")
    names = Names(settings.subject_prefix)

    async def run() -> None:
        nc = await connect(nats_url, "ontofabric-delete-branch", settings)
        try:
            js = nc.jetstream()
            ingester = Ingester(js, names, None, settings.max_content_bytes, progress)
            held = (await ingester.load_manifest(workspace, branch)).entries
            documents = sum(1 for key in held if key.startswith("d:"))
            asked = f"take back {documents} documents and {len(held) - documents} graph rows of {workspace}/{branch}"
            if held and not yes and not await asyncio.to_thread(typer.confirm, f"{asked}, so that it reads as main?"):
                raise typer.Exit(1)
            set_aside = await DeadLetterWatch.start(nc, names, workspace) if wait else None
            started = time.perf_counter()
            with progress:
                try:
                    report = await ingester.revert_branch(workspace, branch)
                except PublishFailed as error:  # a revert set aside leaves its row the branch's: sent again next time
                    if set_aside is not None and error.keys_by_sequence:
                        await _settle_stored(
                            js, nc, names, settings, set_aside, ingester, error, wait_timeout, workspace, branch,
                            progress, held_or_not=True,
                        )  # fmt: skip
                    raise
                if report.raced:  # said before the wait, which may end the command
                    errors.print(
                        _RACED.format(what="delete-branch", workspace=workspace, branch=branch),
                        soft_wrap=True,
                        markup=False,
                    )
                # This run's reverts, or an earlier run's when none is left to send: a run again after a wait that
                # timed out said "nothing to take back" at once, exit 0, over reverts not applied (a tester's).
                awaited = report.awaited_sequence
                if wait and awaited is not None:
                    watch = ProjectionWatch(progress, awaited, _stalled_projection)
                    try:
                        await wait_projected(
                            js, names, settings.projector_partitions, awaited, wait_timeout, on_floor=watch
                        )
                    except TimeoutError:
                        _fail(
                            f"not projected within {wait_timeout:g} s: the index is at stream seq {watch.floor}, the "
                            f"last revert is {awaited}. The reverts are stored; a running projector applies them.",
                            1,
                        )
            took = f"({time.perf_counter() - started:.1f}s)"
            applied = f"it reads as {MAIN_BRANCH}" if wait else "a running projector applies them"
            if report.published:
                console.print(
                    f"{workspace}/{branch}: {report.reverts} documents and {report.graph_changes} graph rows taken "
                    f"back; {applied} {took}"
                )
            elif not report.recorded:  # a misspelt name, most likely: said as such, not as done
                errors.print(
                    f"warning: no ingest of {workspace}/{branch} is recorded (check the names): nothing to take back",
                    soft_wrap=True,
                    markup=False,
                )
            else:
                done = f"; {applied}" if awaited is not None else ""
                console.print(f"{workspace}/{branch} was taken back already: nothing left to send{done} {took}")
            if set_aside is not None:
                # A revert set aside leaves its row the branch's: kept in the emptied manifest, the same command
                # again sends it again (a review's: it said "nothing to take back" over them).
                await _fail_on_branch_dead_letters(
                    nc, names, set_aside, ingester, report, workspace, branch, "reverts an earlier run published",
                    held_or_not=True,
                )  # fmt: skip
            if report.raced:
                raise typer.Exit(1)
        finally:
            await close_nats(nc)

    progress = RichProgress(console)
    try:
        with _sigterm_as_interrupt():
            asyncio.run(run())
    except KeyboardInterrupt:
        errors.print(
            "interrupted: the reverts published so far are stored and a running projector applies them; the same "
            "command again is safe (it sends again what it had begun to send)",
            soft_wrap=True,
        )
        raise _interrupted() from None


@app.command()
def query(
    text: Annotated[
        str | None,
        # Optional so that a relation can be asked alone (an agent tester could not).
        typer.Argument(
            help="The semantic query; may be left out with --related-to or a filter, as the contract allows."
        ),
    ] = None,
    workspace: Annotated[str, typer.Option(help="Workspace to query.", callback=_workspace_name)] = "ontofabric",
    branch: Annotated[str, typer.Option(help="Branch to query.", callback=_branch_name)] = MAIN_BRANCH,
    top_k: Annotated[int, typer.Option("--top-k", min=1, max=100, help="Number of results.")] = 10,
    offset: Annotated[
        int,
        typer.Option(min=0, help="A listing's (no TEXT) results to skip: the next page of what the filters select."),
    ] = 0,
    object_type: Annotated[str | None, typer.Option(help="Only this objectType.")] = None,
    chunk_level: Annotated[str | None, typer.Option(help=f"Only one of {', '.join(CHUNK_LEVELS)}.")] = None,
    provenance: Annotated[str | None, typer.Option(help=f"Only one of {', '.join(PROVENANCES)}.")] = None,
    max_tokens: Annotated[
        int | None,
        typer.Option(
            min=MIN_MAX_TOKENS,
            max=MAX_TOKENS_LIMIT,
            help="The reply's budget in estimated tokens (default: the worker's, 8,000): results past it are "
            "dropped and said so in _meta.budget.",
        ),
    ] = None,
    content: Annotated[
        bool, typer.Option(help="With each result's text; --no-content for ids, scores and metadata alone.")
    ] = True,
    symbol_kind: Annotated[str | None, typer.Option(help="Only symbols of this kind (class, function, ...).")] = None,
    path: Annotated[
        list[str] | None,
        typer.Option(
            metavar="PATTERN",
            help="Only files matching this pattern, as --exclude of ingest reads one (repeatable): `services/query`, "
            "`*.md`.",
        ),
    ] = None,
    exclude_path: Annotated[
        list[str] | None,
        typer.Option(metavar="PATTERN", help="Leave out files matching this pattern (repeatable): `tests`."),
    ] = None,
    min_relevance: Annotated[
        float | None,
        typer.Option(min=0.0, max=1.0, help="Only results scoring at least this (0 to 1; see the contract's score)."),
    ] = None,
    follow_links: Annotated[bool, typer.Option(help="Attach the types one link away from the top hits.")] = False,
    related_to: Annotated[
        str | None,
        typer.Option(
            metavar="RELATION:SYMBOL",
            help="Ask a relation of a symbol by structure (callers, callees, subclasses, bases, importers or "
            "imports), e.g. callers:to_seconds; TEXT then ranks the rest.",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw JSON reply.")] = False,
    data_dir: DataDir = None,
) -> None:
    """Send one ontology_query request and print the ranked results and _meta."""
    from .query.client import (
        ClientError,
        ConnectionDown,
        NoQueryWorker,
        NoReplyInTime,
        QueryClient,
        parse_reply,
        request_json,
    )

    settings = _settings("ontofabric-cli", data_dir, quiet=True)
    nats_url = _nats_url(settings, "client")
    request: dict[str, Any] = {"topK": top_k, "branch": branch}
    if text is not None:
        request["semanticQuery"] = text
    asked = (("objectType", object_type), ("chunkLevel", chunk_level), ("provenance", provenance))
    # The request's other options as the contract names them (an agent tester could not try them from the CLI);
    # the worker checks them and names what it refuses.
    more = (
        ("symbolKind", symbol_kind), ("paths", path or None), ("excludePaths", exclude_path or None),
        ("minRelevance", min_relevance), ("followLinks", follow_links or None), ("offset", offset or None),
    )  # fmt: skip
    for key, value in (*asked, *more, ("maxTokens", max_tokens), ("includeContent", None if content else False)):
        if value is not None:
            request[key] = value
    if related_to is not None:
        relation, _, symbol = related_to.partition(":")
        if not symbol:
            raise typer.BadParameter("RELATION:SYMBOL, e.g. callers:to_seconds", param_hint="--related-to")
        request["relatedTo"] = {"relation": relation, "symbol": symbol}

    async def run() -> bytes:
        nc = await connect(nats_url, "ontofabric-cli", settings)
        try:
            return await QueryClient(nc, Names(settings.subject_prefix)).send_raw(workspace, request_json(request))
        finally:
            await close_nats(nc)

    try:
        raw = asyncio.run(run())
    except PermissionDenied as error:
        _fail(f"{error} (workspace {workspace!r})")
    except ConnectionDown as error:
        _fail(f"{error}: is the NATS server at {redacted_url(nats_url)} running?")
    except (NoQueryWorker, NoReplyInTime) as error:
        _fail(f"{error}: is `ontofabric up` running, or with --no-query-worker, an `ontofabric query-worker`?")
    except ClientError as error:  # too large, invalid, the connection ended
        _fail(str(error))
    reply = parse_reply(raw)
    if as_json:
        console.print_json(raw.decode())
    else:
        render_reply(console, request, reply)
    if isinstance(reply, ErrorReply):
        raise typer.Exit(1)


@app.command()
def mcp(
    workspace: Annotated[
        str | None,
        typer.Option(
            help="Workspace the tools read when a call names none (env ONTOFABRIC_GATEWAY_WORKSPACE).",
            callback=_workspace_name,
        ),
    ] = None,
    http: Annotated[
        str | None,
        typer.Option(metavar="HOST:PORT", help="Serve streamable HTTP at http://HOST:PORT/mcp instead of stdio."),
    ] = None,
    data_dir: DataDir = None,
) -> None:
    """Run the MCP gateway: ontology_query, get_document and ontology_status for coding agents, over stdio (the
    default, for an agent's local configuration) or streamable HTTP; it forwards every call to the query workers."""
    from .gateway.admission import Intake
    from .gateway.server import ListenRefused, is_loopback, serve

    # Over stdio it keeps quiet unless asked (a client shows its stderr); over HTTP it is a server and logs as one
    # (a soak tester's gateway wrote nothing in 26 minutes of dropped connections and cancelled calls).
    settings = _settings("ontofabric-mcp", data_dir, quiet=http is None, worker=True)
    if workspace is None and settings.gateway_workspace is not None:
        # Refused now: a gateway started with a bad name would answer every call with an error no agent can mend.
        try:
            _workspace_name(settings.gateway_workspace)
        except typer.BadParameter as error:
            _fail(f"ONTOFABRIC_GATEWAY_WORKSPACE: {error}")
    address = None
    if http is not None:
        host, _, port = http.rpartition(":")
        if not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
            _fail(f"--http takes HOST:PORT (a port from 1 to 65535), not {http!r}")
        address = (host.strip("[]"), int(port))
    tokens = TokenStore(settings.resolved_gateway_tokens_file())
    if address is not None:
        tokens.grants()  # a tokens file that cannot be read is said now (TokensUnreadable), not at the first call
    if address is not None and not tokens.path.exists():
        if not is_loopback(address[0]):
            _fail(
                f"an HTTP gateway on {address[0]} needs bearer tokens ({tokens.path} does not exist): issue one "
                "with `ontofabric gateway-token add CLIENT --workspace W`"
            )
        # A log line, as JSON where the logs are: printed as text it broke the JSON lines on stderr (an SRE's).
        log.warning(
            "gateway_without_tokens",
            tokens_file=str(tokens.path),
            note="any local process may call until a token is issued (ontofabric gateway-token add)",
        )
    # A call waits this long at most for a connection; the gateway starts without one (services/gateway/link.py).
    linking = settings.model_copy(update={"nats_connect_timeout_s": min(3.0, settings.nats_connect_timeout_s)})

    async def run() -> None:
        link = NatsLink(
            lambda: resolve_nats_url(settings, "client"),
            lambda url: connect(url, "ontofabric-mcp", linking),
            close_nats,
        )

        async def warm_up() -> None:
            try:
                await link.client()
            except NatsUnavailable as error:
                log.warning("gateway_nats_unavailable", error=str(error))

        warming = asyncio.create_task(warm_up())
        try:
            await serve(
                link, Names(settings.subject_prefix), workspace or settings.gateway_workspace,
                settings.gateway_timeout_s, address, tokens,
                Intake(settings.gateway_max_held, settings.gateway_max_late_ms / 1000), settings.allowed_origins(),
                settings.answer_max_tokens,
            )  # fmt: skip
        finally:
            warming.cancel()
            await link.close()

    try:
        asyncio.run(run())
    except ListenRefused as error:
        _fail(str(error))


gateway_token = typer.Typer(help="Bearer tokens of the HTTP gateway: who may call it, and which workspaces.")
app.add_typer(gateway_token, name="gateway-token")


def _token_store(data_dir: Path | None) -> TokenStore:
    settings = _settings("ontofabric-cli", data_dir, quiet=True)
    return TokenStore(settings.resolved_gateway_tokens_file())


@gateway_token.command("add")
def gateway_token_add(
    client: Annotated[
        str,
        typer.Argument(
            help="Who the token is for: a name of letters, digits and . _ @ + - (issuing again replaces its token)."
        ),
    ],
    workspace: Annotated[
        list[str], typer.Option("--workspace", "-w", help="A workspace it may read (repeat; '*' for all).")
    ],
    data_dir: DataDir = None,
) -> None:
    """Issue a token and print it once (only its SHA-256 is kept). Gateways pick it up on their next request."""
    for name in workspace:
        if name != ALL_WORKSPACES:
            try:
                WORKSPACE.validate_python(name)
            except ValidationError:
                _fail(f"{name!r} is not a workspace name")
    store = _token_store(data_dir)
    earlier = next((grant for grant in store.grants() if grant.client == client), None)
    try:
        token = store.add(client, workspace)
    except ValueError as refused:
        _fail(str(refused))
    if earlier is not None:  # a tenant tester's old token stopped working with nothing said
        errors.print(
            f"replaced the earlier token of {client!r} (for {', '.join(earlier.workspaces)}): it works no more"
        )
    errors.print(f"token of {client!r} for {', '.join(sorted(set(workspace)))} (kept hashed in {store.path}):")
    print(token)


@gateway_token.command("list")
def gateway_token_list(data_dir: DataDir = None) -> None:
    """The clients holding a token, and their workspaces."""
    for grant in _token_store(data_dir).grants():
        print(f"{grant.client}\t{','.join(grant.workspaces)}")


@gateway_token.command("revoke")
def gateway_token_revoke(
    client: Annotated[str, typer.Argument(help="The client whose token stops working.")], data_dir: DataDir = None
) -> None:
    """Revoke a client's token; running gateways refuse it from their next request."""
    if not _token_store(data_dir).revoke(client):
        _fail(f"no token of {client!r}")
    errors.print(f"revoked the token of {client!r}")


T = TypeVar("T")

dlq = typer.Typer(help="Dead letters: deltas a projector set aside, with the reason; list, show, re-drive, purge.")
app.add_typer(dlq, name="dlq")

SequenceArgs = Annotated[list[int] | None, typer.Argument(help="Dead letters by their sequence (all when none).")]


def _workspace_filter(value: str | None) -> str | None:
    """A workspace's name, or the one dead letters of no workspace are listed under (a verifier's: refused)."""
    return value if value == NO_WORKSPACE else _workspace_name(value)


WorkspaceFilter = Annotated[
    str | None, typer.Option("--workspace", "-w", help="Only this workspace's.", callback=_workspace_name)
]
LettersOf = Annotated[
    str | None,
    typer.Option(
        "--workspace",
        "-w",
        help=f"Only this workspace's ({NO_WORKSPACE}: those whose subject names no workspace).",
        callback=_workspace_filter,
    ),
]


def _known_reason(value: str | None) -> str | None:
    """A reason a projector sets letters aside for: an operator tester's typo selected nothing, and purge said it
    deleted none, exit 0."""
    from typing import get_args

    from .projector.planning import RejectReason

    known = (*get_args(RejectReason), "unknown")
    if value is not None and value not in known:
        raise typer.BadParameter(f"{value!r} is no reason a projector gives: one of {', '.join(known)}")
    return value


ReasonFilter = Annotated[
    str | None,
    typer.Option(help="Only this reason's (invalid_schema, apply_failed, ...).", callback=_known_reason),
]
SinceFilter = Annotated[str | None, typer.Option(help="Only those stored since: ISO 8601, or an age (30m, 2h, 7d).")]
UntilFilter = Annotated[str | None, typer.Option(help="Only those stored before: ISO 8601, or an age.")]


def _selection(
    sequences: list[int] | None, workspace: str | None, reason: str | None, since: str | None, until: str | None
) -> Selection:
    now = datetime.now(UTC)
    try:
        return Selection(
            workspace=workspace,
            reason=reason,
            since=parse_when(since, now) if since else None,
            until=parse_when(until, now) if until else None,
            sequences=frozenset(sequences or ()),
        )
    except ValueError as error:
        _fail(str(error))


def _as_operator(data_dir: Path | None, job: Callable[[Client, Names, Settings, Endpoints], Awaitable[T]]) -> T:
    """Run ``job`` on a connection as the deployment's operator."""
    settings = _settings("ontofabric-dlq", data_dir, quiet=True)
    endpoints = _endpoints(settings)

    async def run() -> T:
        nc = await connect(endpoints.nats_url_as("operator"), "ontofabric-dlq", settings)
        try:
            return await refused_promptly(nc, ANY_SUBJECT, job(nc, Names(settings.subject_prefix), settings, endpoints))
        finally:
            await close_nats(nc)

    return asyncio.run(run())


@dlq.command("list")
def dlq_list(
    sequences: SequenceArgs = None,
    workspace: LettersOf = None,
    reason: ReasonFilter = None,
    since: SinceFilter = None,
    until: UntilFilter = None,
    limit: Annotated[int, typer.Option(min=1, help="Show at most this many (the oldest first).")] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
    data_dir: DataDir = None,
) -> None:
    """The dead letters that match, oldest first: sequence, time, workspace, branch, reason and its detail."""
    selection = _selection(sequences, workspace, reason, since, until)

    async def listed(nc: Client, names: Names, *_: object) -> list[tuple[DeadLetter, str]]:
        """Each with its delta's branch (an auditor could not tell main's letters from a branch's but by --json's
        encoded subject); ``_unknown`` for a subject naming none."""
        found = await dead_letters(nc, names, selection)
        return [(letter, (names.scope_of_delta(letter.original_subject) or ("", NO_WORKSPACE))[1]) for letter in found]

    letters = _as_operator(data_dir, listed)
    for letter, branch in letters[:limit]:
        if as_json:
            print(json.dumps({**letter.summary(), "branch": branch}))
        else:
            stamp = letter.stored_at.strftime("%Y-%m-%d %H:%M:%S")
            detail = _letter_detail(letter)
            shown = f"{letter.workspace or NO_WORKSPACE}\t{printable(branch)}"
            print(f"{letter.seq}\t{stamp}\t{shown}\t{printable(letter.reason)}\t{detail}")
    if len(letters) > limit:
        errors.print(f"{len(letters) - limit} more (--limit)")
    if not as_json:
        errors.print(f"{len(letters)} dead letter(s)")


@dlq.command("show")
def dlq_show(
    sequence: Annotated[int, typer.Argument(help="The dead letter's sequence (from `dlq list`).")],
    data_dir: DataDir = None,
) -> None:
    """One dead letter: why it was set aside, and the delta itself."""
    selection = Selection(sequences=frozenset({sequence}))
    letters = _as_operator(data_dir, lambda nc, names, *_: dead_letters(nc, names, selection))
    if not letters:
        _fail(f"no dead letter at sequence {sequence}")
    (letter,) = letters
    _print_json(json.dumps(letter.summary()))
    try:
        _print_json(letter.data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # shown as it is: not JSON, or too deep
        print(printable(letter.data.decode("utf-8", "replace")[:10_000], lines=True))


def _print_json(text: str) -> None:
    """``text``, JSON, indented; with every character escaped when it holds half of one (valid JSON, as a malformed
    delta may be), which no terminal can print: the command stopped half-way with a traceback; or one a terminal
    acts on that JSON leaves as it is (a C1 control, a bidirectional override: :func:`printable`)."""
    try:
        shown = json.dumps(json.loads(text), ensure_ascii=False)
        shown.encode()
    except UnicodeEncodeError:
        console.print_json(text, ensure_ascii=True)
        return
    console.print_json(text, ensure_ascii=printable(shown, lines=True) != shown)


def _confirm(what: str, selection: Selection, yes: bool) -> None:
    if not yes and not typer.confirm(f"{what} {'every dead letter' if selection.everything else 'these'}?"):
        raise typer.Exit(1)


@dlq.command("redrive")
def dlq_redrive(
    sequences: SequenceArgs = None,
    workspace: LettersOf = None,
    reason: ReasonFilter = None,
    since: SinceFilter = None,
    until: UntilFilter = None,
    force: Annotated[
        bool,
        typer.Option(
            help="Also those whose row the index holds at a later sequence (the older state wins), and those whose "
            "branch has deltas the projector has not applied yet (one of which may be a later state)."
        ),
    ] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    data_dir: DataDir = None,
) -> None:
    """Publish the matching dead letters' deltas again, so the projectors apply them (after a fix), and delete the
    dead letters. A delta whose row (document, graph node or link) the index already holds at a later sequence is
    left unless --force, and so is one whose branch has deltas the projector has not applied yet."""
    selection = _selection(sequences, workspace, reason, since, until)

    async def job(nc: Client, names: Names, settings: Settings, endpoints: Endpoints) -> Redrive:
        letters = await dead_letters(nc, names, selection)
        _all_named_found(selection, letters, "re-driven")
        _list_letters(letters)
        if not letters:
            return Redrive()
        refused_as_sent = Counter(letter.reason for letter in letters if letter.reason in REFUSED_BY_EVERY_PROCESS)
        if refused_as_sent:  # an operator tester's: re-driven without a word, and set aside again at once
            errors.print(
                f"{refused_as_sent.total()} of them ({', '.join(sorted(refused_as_sent))}) were refused for what "
                "their delta holds, whatever a projector's settings: re-driven, the same bytes are set aside again "
                "unless the projectors read the contract differently since (an upgrade). Publish a corrected delta "
                "from its producer instead, and purge these."
            )
        long_keys = sum(1 for letter in letters if refused_for_a_long_key(letter.reason, letter.detail))
        if long_keys:  # apply_failed is a passing database error too: only these are said to come back
            errors.print(
                f"{long_keys} of them (apply_failed) were refused for a name longer than an index key takes (`dlq "
                "show` says which field): re-driven, the same bytes are set aside again. Publish the document "
                "under a shorter name from its producer instead, and purge these."
            )
        _confirm(f"re-drive {len(letters)}:", selection, yes)
        placement = Placement.of(settings, endpoints.database_url)
        if force:
            return await redrive(nc, names, letters, None)
        workspaces = {letter.workspace for letter in letters if letter.workspace is not None}
        floors = await applied_through(nc.jetstream(), names, settings, placement, workspaces)
        return await redrive(nc, names, letters, placement.database_url_of, floors)

    outcome = _as_operator(data_dir, job)
    for letter, seq in outcome.superseded:
        errors.print(f"left {letter.seq}: the index holds its document at the later sequence {seq} (--force)")
    for letter, latest in outcome.outdone:
        errors.print(f"left {letter.seq}: dead letter {latest.seq} holds a later state of its row (--force)")
    for letter, seq in outcome.waiting:
        errors.print(
            f"left {letter.seq}: its branch has deltas up to {seq} its Postgres projector has not applied yet, one "
            "of which may be a later state of its document: re-drive once it has caught up (ontofabric status)"
        )
    for letter in outcome.bodiless:
        errors.print(f"left {letter.seq}: stored without its delta, which was too large to send again")
    for letter in outcome.nowhere:
        if letter.workspace is None:
            errors.print(
                f"left {letter.seq}: its subject names no workspace, so it would be set aside again (dlq purge)"
            )
        else:
            came_from = printable(letter.original_subject) or "none"
            errors.print(
                f"left {letter.seq}: the subject it came from ({came_from}) is none of {letter.workspace}'s delta "
                "subjects, so there is nowhere to send it back to (dlq purge)",
                markup=False,
            )
    for letter, why in outcome.refused:
        errors.print(f"left {letter.seq}: the delta stream refused it: {why}")
    left = len(outcome.superseded) + len(outcome.outdone) + len(outcome.waiting)
    left += len(outcome.bodiless) + len(outcome.nowhere) + len(outcome.refused)
    errors.print(f"re-drove {len(outcome.sent)} dead letter(s), left {left}")


@dlq.command("purge")
def dlq_purge(
    sequences: SequenceArgs = None,
    workspace: LettersOf = None,
    reason: ReasonFilter = None,
    since: SinceFilter = None,
    until: UntilFilter = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    data_dir: DataDir = None,
) -> None:
    """Delete the matching dead letters for good (every one when no filter is given)."""
    selection = _selection(sequences, workspace, reason, since, until)

    async def job(nc: Client, names: Names, *_: object) -> int:
        # Listed first, as redrive lists: the question said "these?" and showed none (an operator tester's).
        letters = await dead_letters(nc, names, selection)
        _all_named_found(selection, letters, "deleted")
        _list_letters(letters)
        if not letters:
            return 0
        _confirm(f"delete {len(letters)}:", selection, yes)
        return await purge(nc, names, selection, letters)  # those listed: one stored since was not shown

    deleted = _as_operator(data_dir, job)
    errors.print(f"deleted {deleted} dead letter(s)")


LETTERS_LISTED = 50
"""How many dead letters ``redrive`` and ``purge`` list before asking; ``dlq list`` shows the rest."""


def _all_named_found(selection: Selection, letters: Sequence[DeadLetter], doing: str) -> None:
    """Fail, doing nothing, when a sequence named on the command line is none of ``letters``: a typo re-drove or
    deleted "0" and exited 0, where `dlq show` of the same number exits 2 (an ops tester's)."""
    missing = sorted(selection.sequences - {letter.seq for letter in letters})
    if missing:
        filtered = dataclasses.replace(selection, sequences=frozenset()) != Selection()
        _fail(
            f"no dead letter at sequence {', '.join(map(str, missing))}"
            + (" matching the filters given" if filtered else "")
            + f": nothing {doing}"
        )


LETTER_DETAIL_SHOWN = 120
"""Characters of a dead letter's detail a listing shows; `dlq show SEQ` shows it whole."""


def _letter_detail(letter: DeadLetter) -> str:
    """A letter's detail on one line, an ellipsis where it was cut (a producer tester read a cut detail as whole)."""
    detail = letter.detail
    if len(detail) > LETTER_DETAIL_SHOWN:
        detail = detail[: LETTER_DETAIL_SHOWN - 1] + "…"
    return printable(detail)


def _list_letters(letters: Sequence[DeadLetter]) -> None:
    for letter in letters[:LETTERS_LISTED]:
        # A subject that names no workspace is the contract's _unknown, not Python's None (a verifier's).
        reason, detail = printable(letter.reason), _letter_detail(letter)
        print(f"{letter.seq}\t{letter.workspace or NO_WORKSPACE}\t{reason}\t{detail}")
    if len(letters) > LETTERS_LISTED:
        print(f"... and {len(letters) - LETTERS_LISTED} more (ontofabric dlq list)")
    if not letters:
        errors.print("no dead letter matches")


@app.command()
def status(
    workspace: WorkspaceFilter = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole status as JSON.")] = False,
    data_dir: DataDir = None,
) -> None:
    """Per workspace and branch: the announced version, the deltas not yet in the index and how long the oldest has
    waited; dead letters per workspace; the projectors' consumers; the query workers answering; per workspace, the
    documents another keyword analysis than this build's indexed (`ontofabric rebuild W` indexes them again).

    Exits 1 when it lists problems, 2 when it cannot be read at all. The problems: a stream, a projector consumer or
    the versions bucket missing; a projector consumer refusing the stream; a database that could not be read; deltas
    pending with no projector applying their partition, or with one whose consumer has settled nothing for a minute;
    no query worker answering; workers of more than one release answering; deltas neither in the stream nor in a
    snapshot; the delta stream, where capped, over 85 % full or full (it then refuses every new delta)."""
    from .ops.status import deployment_status

    def job(nc: Client, names: Names, settings: Settings, endpoints: Endpoints) -> Awaitable[DeploymentStatus]:
        return deployment_status(nc, names, Placement.of(settings, endpoints.database_url), workspace)

    try:
        report = _as_operator(data_dir, job)
    except NatsUnreachable as error:  # nothing read: not the problems a health check reads as exit 1
        errors.print(f"[red]error:[/red] {error}: is it running, and is ONTOFABRIC_NATS_URL right?")
        raise typer.Exit(2) from error
    if as_json:
        print(report.to_json())
    else:
        render_status(console, report)
    if workspace is not None and not report.problems and not report.branches and not report.dead_letters.get(workspace):
        # Empty tables said nothing of a misspelt name (an ops tester's), where `query` says to check it.
        errors.print(
            f"nothing was ever published to workspace {workspace!r} (check the name; `ontofabric status` lists them)",
            markup=False,
        )
    if report.problems:  # for a health check: the status could be read, and says something is wrong
        raise typer.Exit(1)


nats_user = typer.Typer(help="Users of the embedded nats-server: a role, confined to one workspace or not.")
app.add_typer(nats_user, name="nats-user")


def _nats_directory(data_dir: Path | None) -> tuple[Settings, Path]:
    settings = _settings("ontofabric-cli", data_dir, quiet=True)
    directory = settings.data_dir.absolute() / "nats"
    if not (directory / NATS_USERS_FILE).exists():
        _fail(f"no embedded nats-server's users in {directory}: start `ontofabric up` on that data directory once")
    return settings, directory


def _reload(settings: Settings) -> None:
    try:
        running = reload_running_nats(settings)
    except RuntimeUnavailable as error:
        _fail(str(error))
    errors.print("the running server has it now" if running else "it takes effect at the next `ontofabric up`")


@nats_user.command("add")
def nats_user_add(
    role: Annotated[str, typer.Argument(help=f"One of {', '.join(NATS_ROLES)}.")],
    workspace: Annotated[str | None, typer.Option(help="Confine an ingest or client user to this workspace.")] = None,
    nkey: Annotated[
        bool, typer.Option("--nkey", help="A new user that logs in with an nkey seed file, not a password.")
    ] = False,
    data_dir: DataDir = None,
) -> None:
    """Add a user (or show the one on record) and print its NATS URL, password included: hand that to the tenant.

    A second add of the same user prints it again, from the owner-only record in the data directory. With --nkey:
    a new user each time, whose seed is written to an owner-only file (the record keeps only its public key); hand
    the file over, to be named by ONTOFABRIC_NATS_NKEY_SEED."""
    if role not in NATS_ROLES:
        _fail(f"{role!r} is not a role: one of {', '.join(NATS_ROLES)}")
    if workspace is not None:
        if role not in ("ingest", "client"):
            _fail("only ingest and client users are confined to a workspace")
        try:
            WORKSPACE.validate_python(workspace)
        except ValidationError:
            _fail(f"{workspace!r} is not a workspace name")
    settings, directory = _nats_directory(data_dir)
    server = running_up(settings).get("natsUrl", "nats://HOST:PORT")
    confined = f" of {workspace}" if workspace else ""
    if nkey:
        public, seed_file = add_nkey_user(directory, settings.subject_prefix, role, workspace)
        _reload(settings)
        errors.print(f"user {public} ({role}{confined}); log in with:")
        print(f"ONTOFABRIC_NATS_URL={server} ONTOFABRIC_NATS_NKEY_SEED={seed_file}")
        return
    logins, created = ensure_nats_users(directory, settings.subject_prefix, [role], workspace)
    user, password = logins[role]
    if created:
        _reload(settings)
    errors.print(f"user {user!r} ({role}{confined}); its URL:")
    print(with_login(server, user, password))


@nats_user.command("list")
def nats_user_list(data_dir: DataDir = None) -> None:
    """The users on record: name, role, workspace (no passwords)."""
    _, directory = _nats_directory(data_dir)
    for user in nats_users(directory):
        print(f"{user.name}\t{user.role}\t{user.workspace or '*'}")


@nats_user.command("revoke")
def nats_user_revoke(
    name: Annotated[str, typer.Argument(help="The user, as `nats-user list` names it.")], data_dir: DataDir = None
) -> None:
    """Take a user off; the running server refuses it from its reload on (and closes its connections)."""
    settings, directory = _nats_directory(data_dir)
    if any(name == f"{settings.subject_prefix}~{role}" for role in NATS_ROLES):
        _fail(f"{name!r} is one of the roles `ontofabric up` itself connects as")
    if not remove_nats_user(directory, name):
        _fail(f"no user {name!r}")
    _reload(settings)


@app.command()
def demo(
    keep: Annotated[bool, typer.Option(help="Keep the demo's data directory instead of deleting it.")] = False,
) -> None:
    """On a fresh data directory: start everything, ingest this project's source, run queries, exit."""
    from .demo import run_demo

    settings = _settings("ontofabric-demo", quiet=True)
    try:
        with _sigterm_as_interrupt():  # a supervisor's stop, as Ctrl-C: servers stopped, the directory removed
            timings = run_demo(settings, console, keep)
    except KeyboardInterrupt:
        kept = "kept (--keep)" if keep else "removed"
        errors.print(f"interrupted: the demo's servers are stopped and its data directory {kept}", soft_wrap=True)
        raise _interrupted() from None
    report = timings.ingest
    console.rule("[bold]summary[/bold]")
    console.print(
        f"demo wall time {timings.total_s:.1f}s: {report.chunks} chunks embedded in {report.embed_s:.1f}s, "
        f"projected {timings.caught_up_s:.2f}s after the first publish "
        f"({report.upserts / max(timings.caught_up_s, 1e-9):.0f} documents/s)"
    )


@app.command("eval")
def eval_command(
    dataset_dir: Annotated[
        Path,
        typer.Argument(
            exists=True, file_okay=False, help="A BEIR-layout dataset directory, or with --judgments a source tree."
        ),
    ],
    split: Annotated[str, typer.Option(help="Judgments to use: qrels/SPLIT.tsv.")] = "test",
    config: Annotated[
        str,
        typer.Option(
            help="dense, keyword (each retriever alone), hybrid (a request with no options), hybrid-rerank (the "
            "same with precision), hybrid-fusion-only, dense-late-interaction and hybrid-no-second-opinion (the "
            "default request's stages apart), or all (comma-separate several)."
        ),
    ] = "all",
    json_file: Annotated[Path | None, typer.Option("--json", help="Also write the report as JSON here.")] = None,
    runs: Annotated[
        Path | None,
        typer.Option(
            help="Write a TREC run file per configuration into this folder (for a source tree, concept.run: the "
            "concept queries' symbols)."
        ),
    ] = None,
    keep_identical_ids: Annotated[
        bool, typer.Option(help="Count a result whose id is the query's own (BEIR drops those by default).")
    ] = False,
    sample_queries: Annotated[
        int | None,
        typer.Option(min=1, help="Measure this many judged queries, drawn with --seed (and their judged documents)."),
    ] = None,
    sample_documents: Annotated[
        int, typer.Option(min=1, help="With --sample-queries: documents in all, the judged ones and others drawn.")
    ] = 2000,
    seed: Annotated[int, typer.Option(help="What the sample is drawn with.")] = 0,
    baseline: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            dir_okay=False,
            help="The quality gate: compare each configuration (with --judgments, the concept queries) with this "
            "baseline, query by query, and exit 1 when one is worse beyond the bootstrap noise (docs/quality.md, "
            '"Quality gate").',
        ),
    ] = None,
    write_baseline: Annotated[
        Path | None, typer.Option(dir_okay=False, help="Write this run's per-query nDCG@10 here, as a baseline.")
    ] = None,
    min_effect: Annotated[
        float, typer.Option(min=0.0, help="The smallest drop of mean nDCG@10 the gate fails on.")
    ] = MIN_EFFECT,
    calibration_points: Annotated[
        Path | None,
        typer.Option(
            dir_okay=False,
            help="Write each query's leading results (signals, judgment, score) here, for `ontofabric calibrate`.",
        ),
    ] = None,
    judgments: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            dir_okay=False,
            help="Evaluate DATASET_DIR as a source tree: concept queries judged by symbol from this file, and "
            'relationship queries from a static analysis of the tree (docs/quality.md, "Repository evaluation").',
        ),
    ] = None,
    exclude: Annotated[
        list[str] | None,
        typer.Option(
            metavar="PATTERN",
            help="With --judgments: leave out of the index and of the relationship questions what matches this "
            "shell pattern, as `ingest --exclude` reads one (repeatable; `tests`, `'*_pb2.py'`, `docs/*.md`).",
        ),
    ] = None,
) -> None:
    """Load a BEIR dataset through the real path and report nDCG@10, Recall@10/@100, MRR@10 and latency, and each
    hybrid configuration's margin over the stronger retriever with a 95 % paired-bootstrap interval. With
    --baseline, it is also a quality gate."""
    from .ops.beir import DatasetError, judged_outside, load_beir, sample_dataset
    from .ops.eval_report import render_table
    from .ops.evaluation import CONFIGS, evaluate

    settings = _settings("ontofabric-eval", quiet=True)
    if exclude and judgments is None:
        _fail("--exclude applies to a source tree with --judgments, not to a BEIR dataset")
    if judgments is not None:
        beir_only = {"--config": config != "all", "--split": split != "test",
                     "--sample-queries": sample_queries is not None,
                     "--keep-identical-ids": keep_identical_ids, "--seed": seed != 0,
                     "--sample-documents": sample_documents != 2000}  # fmt: skip
        given = [name for name, set_ in beir_only.items() if set_]
        if given:
            _fail(f"{given[0]} applies to a BEIR dataset, not to a source tree with --judgments")
        _evaluate_tree(
            settings, dataset_dir, judgments, json_file, runs, (baseline, write_baseline, min_effect),
            calibration_points, exclude or (),
        )  # fmt: skip
        return
    chosen = list(CONFIGS) if config == "all" else [c.strip() for c in config.split(",")]
    unknown = [c for c in chosen if c not in CONFIGS]
    if unknown:
        _fail(f"unknown configuration {unknown[0]!r}; choose from {', '.join(CONFIGS)} or all")
    try:
        dataset = load_beir(dataset_dir, split)
    except DatasetError as error:
        _fail(str(error))
    if outside := judged_outside(dataset):
        query, doc = outside[0]
        errors.print(
            f"warning: {len(outside)} judgments name documents corpus.jsonl does not hold (e.g. {query!r} → "
            f"{doc!r}): each counts as a relevant document never found, as trec_eval and BEIR count it"
        )
    if sample_queries is not None:
        dataset = sample_dataset(dataset, sample_queries, sample_documents, seed)
    reference = _baseline_for(baseline, dataset.name, dataset.split, "draw the same sample")
    report = _on_scratch_servers(
        settings,
        lambda endpoints, progress: evaluate(
            settings, endpoints, dataset, chosen, progress, runs, not keep_identical_ids
        ),
    )
    render_table(report, lambda line: console.print(line, soft_wrap=True, markup=False))
    if json_file is not None:
        json_file.write_text(json.dumps(report.to_json(), indent=2) + "\n")
        console.print(f"wrote {json_file}")
    if write_baseline is not None:
        QualityBaseline(report.dataset, report.split, report.per_query, report.setup).write(write_baseline)
        console.print(f"wrote {write_baseline}")
    if calibration_points is not None:
        from .ops.calibrate import write_points

        write_points(calibration_points, report.calibration_points)
        console.print(f"wrote {len(report.calibration_points)} calibration points to {calibration_points}")
    if reference is not None:
        _gate(reference, report.dataset, report.split, report.per_query, min_effect, report.setup)


def _baseline_for(path: Path | None, dataset: str, split: str, hint: str) -> QualityBaseline | None:
    """The baseline at ``path``, read before the run (which may write over it), refused unless it was measured on
    ``dataset`` (``split``)."""
    if path is None:
        return None
    reference = QualityBaseline.read(path)
    try:
        reference.check(dataset, split)
    except BaselineMismatch as error:
        _fail(f"{error}: {hint}")
    return reference


def _gate(
    reference: QualityBaseline,
    dataset: str,
    split: str,
    per_query: dict[str, dict[str, float]],
    min_effect: float,
    setup: dict[str, str],
) -> None:
    """The quality gate's verdicts printed; exit 1 when a configuration regressed (or none could be judged)."""
    from .ops.eval_report import render_verdicts
    from .ops.quality_gate import judge

    try:
        verdicts = judge(reference, dataset, split, per_query, min_effect)
    except BaselineMismatch as error:
        _fail(str(error))
    for difference in reference.setup_differences(setup):
        errors.print(f"note: the baseline ran with another setup: {difference}", soft_wrap=True, markup=False)
    for config, judged in reference.per_query.items():
        missing, new = set(judged) - set(per_query.get(config, {})), set(per_query.get(config, {})) - set(judged)
        if missing or new:  # missing ones score 0 in the verdict; new ones are not judged until the baseline has them
            errors.print(
                f"note: {config}: {len(missing)} queries of the baseline were not measured (they count as 0), "
                f"{len(new)} measured queries are not in the baseline (not judged)",
                soft_wrap=True,
                markup=False,
            )
    console.print(render_verdicts(verdicts, min_effect), soft_wrap=True, markup=False)
    if not verdicts or any(v.regressed for v in verdicts):
        raise typer.Exit(1)


def _on_scratch_servers(settings: Settings, work: Callable[[Endpoints, Progress], Coroutine[Any, Any, T]]) -> T:
    """``work``'s result, run on embedded servers of a scratch data directory that is deleted afterwards (an
    evaluation must not touch the deployment's data), with a progress display."""
    data_dir = Path(tempfile.mkdtemp(prefix="ontofabric-eval-"))
    data_dir.chmod(0o755)  # our own scratch directory: an unprivileged embedded postgres may traverse it
    try:
        with EmbeddedRuntime(settings, data_dir) as runtime, RichProgress(console) as progress:
            assert runtime.endpoints is not None
            return asyncio.run(work(runtime.endpoints, progress))
    except RuntimeUnavailable as error:
        _fail(str(error))
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def _evaluate_tree(
    settings: Settings,
    tree: Path,
    judgments_file: Path,
    json_file: Path | None,
    runs: Path | None,
    gate: tuple[Path | None, Path | None, float],
    calibration_points: Path | None,
    exclude: Sequence[str],
) -> None:
    """``gate``: the baseline to judge the concept queries' nDCG@10 against, where to write this run's, and the
    smallest drop that fails. ``calibration_points``: where to write the concept answers' results for
    ``ontofabric calibrate``. ``exclude``: as ``ingest --exclude``."""
    from .ingest.ingester import ExclusionRefused, exclusion_patterns
    from .ops.eval_report import write_trec_run
    from .ops.repository_eval import Judgments, JudgmentsError, evaluate_tree, render_tree_report, tree_version

    try:
        judgments = Judgments.read(judgments_file)
        exclusion_patterns(tree, exclude)  # refused before the servers start
    except (JudgmentsError, ExclusionRefused) as error:
        _fail(str(error))
    version = tree_version(tree, judgments.project)
    baseline, write_baseline, min_effect = gate
    if version is not None and version != judgments.version:
        said = f"the judgments are of {judgments.project} {judgments.version}; the tree is {version}"
        if baseline is not None or write_baseline is not None:  # a gate compares like with like only
            _fail(said)
        errors.print(f"warning: {said}")
    # The default request's concept queries are what is gated, under the configuration name a BEIR run gives it.
    dataset, split = judgments.dataset, "concept"
    reference = _baseline_for(baseline, dataset, split, "use the judgments it was measured with")
    try:
        report = _on_scratch_servers(
            settings,
            lambda endpoints, progress: evaluate_tree(settings, endpoints, tree, judgments, progress, exclude),
        )
    except ExclusionRefused as error:  # it left out every source file
        _fail(str(error))
    for line in render_tree_report(report):
        console.print(line, soft_wrap=True, markup=False)
    if json_file is not None:  # per query too, for paired comparisons between runs
        json_file.write_text(json.dumps(report.to_json(), indent=2) + "\n")
        console.print(f"wrote {json_file}")
    if runs is not None:
        write_trec_run(runs / "concept.run", report.concept_run, "concept")
        console.print(f"wrote {runs / 'concept.run'}")
    if calibration_points is not None:
        from .ops.calibrate import write_points

        write_points(calibration_points, report.calibration_points)
        console.print(f"wrote {len(report.calibration_points)} calibration points to {calibration_points}")
    measured = {"hybrid": report.concept.per_query}
    if write_baseline is not None:
        QualityBaseline(dataset, split, measured, report.setup).write(write_baseline)
        console.print(f"wrote {write_baseline}")
    if reference is not None:
        _gate(reference, dataset, split, measured, min_effect, report.setup)


@app.command()
def calibrate(
    points: Annotated[
        list[Path],
        typer.Argument(exists=True, dir_okay=False, help="Files `ontofabric eval --calibration-points` wrote."),
    ],
) -> None:
    """Fit the score calibration (Platt scaling per set of retrievers, over each result's signals and its place in
    the answer) on evaluation points, pooled over their datasets: print each model's coefficients as settings, and
    the expected calibration error per dataset with the current settings, with the fit, and with a fit on the other
    datasets alone."""
    from .ops.calibrate import PointsError, fit_models, read_points, render_fits
    from .query.config import PipelineConfig

    settings = _settings("ontofabric-calibrate", quiet=True)
    try:
        read = read_points(points)
    except PointsError as error:
        _fail(str(error))
    fits = fit_models(read, PipelineConfig.from_settings(settings).calibration())
    if not fits:
        _fail("no calibration points of the dense, keyword or hybrid configuration")
    for line in render_fits(fits):
        console.print(line, soft_wrap=True, markup=False)


@app.command()
def rebuild(
    workspace: Annotated[
        str, typer.Argument(help="The workspace whose Postgres index to rebuild.", callback=_workspace_name)
    ],
    discard: Annotated[
        bool, typer.Option(help="Drop an interrupted rebuild's shadow tables instead (the live index is untouched).")
    ] = False,
    lock_timeout: LockTimeout = 10.0,
    force: Annotated[
        bool,
        typer.Option(help="Swap even when live rows exist that the stream does not account for (they are lost)."),
    ] = False,
    max_rate: Annotated[
        float | None,
        typer.Option(min=1.0, help="Replay at most this many deltas per second, to leave the database to queries."),
    ] = None,
    data_dir: DataDir = None,
) -> None:
    """Rebuild a workspace's index from the delta stream while the projector keeps running.

    Replays the workspace's deltas from sequence 1 into shadow tables, checks them against the fold of the stream,
    then swaps them in, in one transaction, and announces the ontologyVersions. An interrupted rebuild resumes
    where it stopped when run again.

    Its progress counts stream sequences, other workspaces' deltas between this one's included; the closing line
    counts this workspace's deltas."""
    from .ops.rebuild import Rebuild, RebuildFailed

    settings = _settings("ontofabric-rebuild", data_dir, quiet=True)
    endpoints = _endpoints(settings)
    try:
        with _sigterm_as_interrupt(), RichProgress(console) as progress:
            job = Rebuild(
                settings,
                endpoints.nats_url_as("operator"),
                Placement.of(settings, endpoints.database_url).database_url_of(workspace),
                workspace,
                progress,
                lock_timeout_s=lock_timeout,
                force=force,
                max_rate=max_rate,
            )
            if discard:
                dropped = asyncio.run(job.discard())
                console.print("shadow tables dropped" if dropped else f"no rebuild of {workspace!r} to discard")
                return
            report = asyncio.run(job.run())
    except RebuildFailed as error:
        advice = "run again to resume" if error.resumable else "running again will not help as things are"
        if not error.resumable and error.shadow:
            advice += "; --discard drops the shadow tables"
        advice = error.advice or advice
        _fail(f"{error}\nthe live index is unchanged; {advice}")
    except (asyncpg.InterfaceError, ConnectionResetError) as error:  # the database went away under it
        _fail(f"the rebuild was interrupted: {describe(error)}\nthe live index is unchanged; run again to resume")
    except KeyboardInterrupt:  # an operator tester's: exit 130 without a word of what became of it
        errors.print(
            f"interrupted: the swap into the live index happens whole or not at all; run `ontofabric rebuild "
            f"{workspace}` again to resume, or with --discard to drop what was replayed",
            soft_wrap=True,
        )
        raise _interrupted() from None
    resumed = f", resumed after sequence {report.resumed_from}" if report.resumed_from else ""
    rejected = ", ".join(f"{n} {reason}" for reason, n in sorted(report.rejected.items())) or "none"
    # After a compaction most rows come from the snapshot: "0 deltas replayed, 972 changed a row" read as a puzzle.
    restored = f"{report.restored} from its snapshot and " if report.restored else ""
    console.print(
        f"rebuilt {workspace!r}: {restored}{report.replayed} deltas replayed in {report.replay_s:.1f}s{resumed}, "
        f"{report.changed} changed a row, rejected: {rejected}; {report.rows} rows verified against the stream; "
        f"swapped in holding the projectors off for {report.swap_lock_s * 1000:.0f} ms "
        f"and queries for {report.parents_lock_s * 1000:.0f} ms",
        soft_wrap=True,
    )
    for rows_lost in report.dropped:
        console.print(f"  dropped (--force): {rows_lost}", soft_wrap=True)
    for branch, version in sorted(report.versions.items()):
        console.print(f"  {branch}: ontologyVersion {version}")


@app.command()
def reembed(
    discard: Annotated[
        bool, typer.Option(help="Drop an unfinished change's columns and index instead (the live index is untouched).")
    ] = False,
    lock_timeout: LockTimeout = 10.0,
    max_rate: Annotated[
        float | None,
        typer.Option(min=1.0, help="Embed at most this many documents per second, to leave the database to queries."),
    ] = None,
    force: Annotated[
        bool,
        typer.Option(help="Swap even when running workers say they cannot serve the next model."),
    ] = False,
    data_dir: DataDir = None,
) -> None:
    """Change the embedding model (and dimension) of every database's index without downtime.

    Embeds every live document again by ONTOFABRIC_NEXT_EMBEDDING_MODEL beside its current vector, indexes the new
    vectors, then swaps them in, in one transaction, and announces the new revisions. Query workers answer with the
    current model until the swap. Set the next model on every projector and query worker first
    (docs/reliability.md, "Changing the embedding model"); an interrupted change resumes when run again."""
    from .ops.reembed import ChangeRefused, ModelChange

    settings = _settings("ontofabric-reembed", data_dir, quiet=True)
    endpoints = _endpoints(settings)
    placement = Placement.of(settings, endpoints.database_url)
    database, changed = "", 0
    try:
        with _sigterm_as_interrupt(), RichProgress(console) as progress:
            jobs = [
                ModelChange(settings, endpoints.nats_url_as("operator"), url, progress, lock_timeout_s=lock_timeout,
                            max_rate=max_rate, force=force)
                for url in placement.databases
            ]  # fmt: skip
            for url, job in zip(placement.databases, jobs, strict=True):
                database = redacted_url(url)
                if discard:
                    dropped = asyncio.run(job.discard())
                    console.print(f"{database}: " + ("change discarded" if dropped else "no unfinished change"))
                    continue
                report = asyncio.run(job.run())
                if report.already:
                    console.print(f"{report.database}: holds {report.model} vectors already")
                    continue
                console.print(
                    f"{report.database}: {report.previous_model} → {report.model}: {report.embedded} documents "
                    f"embedded in {report.rounds} rounds ({report.fill_s:.1f}s), indexed in {report.index_s:.1f}s, "
                    f"swapped in holding the projectors off for {report.swap_lock_s * 1000:.0f} ms; "
                    f"{report.versions} versions announced",
                    soft_wrap=True,
                )
                changed += 1
    except ChangeRefused as error:
        others = f"the {changed} listed above have changed" if changed else "no other database has changed"
        _fail(f"{database}: {error}\nthis database's index still answers with the model it held ({others})")
    except KeyboardInterrupt:
        errors.print(
            "interrupted: each database's swap happens whole or not at all; run `ontofabric reembed` again to resume, "
            "or with --discard to drop the unfinished change",
            soft_wrap=True,
        )
        raise _interrupted() from None


@app.command()
def compact(
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    data_dir: DataDir = None,
) -> None:
    """Fold every workspace's deltas up to the index's position into its snapshot, then drop them from the stream.

    Bounds the stream: a rebuild then replays a workspace's snapshot and the deltas after it. When
    ONTOFABRIC_DELTA_MAX_AGE_DAYS is set (deltas removed by age), run it more often than that. The old deltas
    themselves are gone afterwards (their folds remain), so it asks first."""
    from .ops.snapshots import CompactionRefused
    from .ops.snapshots import compact as compact_stream

    settings = _settings("ontofabric-compact", data_dir, quiet=True)
    endpoints = _endpoints(settings)
    if not yes and not typer.confirm("drop every delta the snapshots will cover from the stream?"):
        raise typer.Exit(1)

    async def run() -> None:
        nc = await connect(endpoints.nats_url_as("operator"), "ontofabric-compact", settings)
        try:
            with RichProgress(console) as progress:
                placement = Placement.of(settings, endpoints.database_url)
                report = await compact_stream(nc, Names(settings.subject_prefix), settings, progress, placement)
        finally:
            await close_nats(nc)
        console.print(
            # Whose each figure is (an operator tester read "856 deltas into 856 rows; 1712 dropped" as a puzzle).
            f"snapshots cover the stream through sequence {report.covers}: {report.deltas_read} deltas read and "
            f"folded into {report.workspaces} workspaces' snapshots, which now hold {report.rows} rows "
            f"({report.snapshot_bytes / 1e6:.1f} MB); {report.purged} deltas dropped from the stream (those the "
            f"snapshots cover, folded by this run or an earlier one), the stream "
            f"{report.stream_bytes_before / 1e6:.1f} MB -> {report.stream_bytes_after / 1e6:.1f} MB",
            soft_wrap=True,
        )
        if report.held_back_by is not None:
            errors.print(
                f"[yellow]held back[/yellow] by the consumer {report.held_back_by}, not of the configured layout "
                f"(ONTOFABRIC_PROJECTOR_PARTITIONS={settings.projector_partitions}): a layout being filled, or "
                "one given up, whose consumers stay until deleted (`ontofabric status` lists them; "
                "`ontofabric forget-layout N` deletes a layout's)",
                soft_wrap=True,
            )

    try:
        with _sigterm_as_interrupt():
            asyncio.run(run())
    except CompactionRefused as error:
        _fail(str(error))
    except (nats.errors.Error, asyncpg.InterfaceError, ConnectionResetError) as error:
        # An operator tester's servers went away mid-run: a traceback said nothing of what was kept. (One not
        # reached at all is said by main(), as for every command.)
        _fail(f"the compaction was interrupted: {describe(error)}\n{_COMPACTION_RESUMES}", code=1)
    except KeyboardInterrupt:
        errors.print(f"interrupted: {_COMPACTION_RESUMES}", soft_wrap=True)
        raise _interrupted() from None


_COMPACTION_RESUMES = (
    "the stream is purged only below what stored snapshots hold, so nothing is lost; run `ontofabric compact` "
    "again to go on (once what the error names is mended, if it says more than a server gone away)"
)


@app.command("forget-layout")
def forget_layout(
    partitions: Annotated[int, typer.Argument(help="The layout whose consumers go: its number of partitions.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    data_dir: DataDir = None,
) -> None:
    """Delete the Postgres projectors' durable consumers of a partition layout no longer used, and their claims.

    Each layout (ONTOFABRIC_PROJECTOR_PARTITIONS) has consumers of its own, and they stay after its projectors
    stop: one left behind holds `ontofabric compact` back at its position for good. Its claim rows in the
    databases go too (a refusal of the stream left in one kept `ontofabric status` reporting it). Refused for the
    configured layout, and while a projector of that layout answers."""

    from .ops.layouts import ClaimsNotDeleted, Forgotten, LayoutInUse
    from .ops.layouts import forget_layout as forget

    if partitions not in PARTITION_COUNTS:
        _fail(f"layouts have {', '.join(map(str, PARTITION_COUNTS))} partitions, not {partitions}")
    settings = _settings("ontofabric-forget-layout", data_dir, quiet=True)
    if partitions == settings.projector_partitions:
        _fail(f"{partitions} is the configured layout (ONTOFABRIC_PROJECTOR_PARTITIONS): its consumers are in use")
    if not yes and not typer.confirm(
        f"delete the consumers of the {partitions}-partition layout and their claim rows?"
    ):
        raise typer.Exit(1)

    async def job(nc: Client, names: Names, settings: Settings, endpoints: Endpoints) -> Forgotten:
        return await forget(nc, names, Placement.of(settings, endpoints.database_url), partitions)

    try:
        forgotten = _as_operator(data_dir, job)
    except (LayoutInUse, ClaimsNotDeleted) as error:
        _fail(str(error))
    console.print(
        f"deleted {', '.join(forgotten.consumers) or 'nothing (no consumer of that layout)'}; "
        f"{forgotten.claims} claim row(s)",
        soft_wrap=True,
    )


@app.command("adopt-stream")
def adopt_stream(
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    data_dir: DataDir = None,
) -> None:
    """Empty the Postgres index and have the projectors fill it again from the delta stream as it is now.

    For a projector that refuses the stream (`ontofabric status` says why): its JetStream store was lost and made
    again, or restored from a backup older than the database. Running projectors refill the index within seconds
    (the snapshots of a compacted stream, then the stream from its first delta); answers are partial meanwhile. A
    workspace the stream no longer holds stays empty until it is ingested again. The Azure AI Search index is not
    touched."""
    from ontofabric.shared.discovery import discover, postgres_partitions

    from .ops.adopt import AdoptRefused
    from .ops.adopt import adopt_stream as adopt

    if not yes and not typer.confirm("empty the index and fill it again from the delta stream as it is now?"):
        raise typer.Exit(1)

    async def job(nc: Client, names: Names, settings: Settings, endpoints: Endpoints) -> tuple[Adopted, bool]:
        adopted = await adopt(nc, names, Placement.of(settings, endpoints.database_url))
        projectors = await discover(nc, names.projector_service)
        return adopted, any(postgres_partitions(worker) is not None for worker in projectors)

    try:
        adopted, filling = _as_operator(data_dir, job)
    except AdoptRefused as error:
        _fail(str(error))
    snapshots = "the snapshots and " if adopted.snapshots_kept else ""
    console.print(
        f"emptied the index on {adopted.databases} database(s) ({adopted.documents} documents) and deleted "
        f"{len(adopted.consumers)} consumer(s): Postgres projectors fill it again from {snapshots}the stream's "
        f"sequences {adopted.stream_first}..{adopted.stream_last}; `ontofabric status` shows their progress.",
        soft_wrap=True,
    )
    if not filling:  # a tester's operator read "running projectors" with none running
        errors.print("no Postgres projector answers: the index stays empty until one starts", soft_wrap=True)
    if adopted.snapshots_dropped is not None:
        errors.print(
            f"deleted the snapshots through sequence {adopted.snapshots_dropped}: they were folded from another "
            "stream than this one",
            soft_wrap=True,
        )
    if adopted.gone:
        errors.print(
            f"the stream no longer holds {len(adopted.gone)} workspace(s) the index held, empty until ingested "
            f"again: {', '.join(escape(workspace) for workspace in adopted.gone)}",
            soft_wrap=True,
        )


@app.command("migrate")
def migrate_command(data_dir: DataDir = None) -> None:
    """Apply pending database migrations to every database the workspaces are placed on (workers also do this
    when they start)."""
    settings = _settings("ontofabric-migrate", data_dir)
    # The database alone: a deployment migrates before any other part runs, NATS included (docs/security.md).
    primary = settings.database_url or _endpoints(settings).database_url
    for database_url in Placement.of(settings, primary).databases:
        applied = asyncio.run(migrate(database_url, settings))
        console.print(f"{redacted_url(database_url)}: applied {', '.join(applied) or 'nothing (up to date)'}")


@app.command()
def contracts(
    write: Annotated[
        bool, typer.Option("--write", help="Rewrite contracts/schemas and contracts/asyncapi.json from the models.")
    ] = False,
) -> None:
    """Check (or rewrite) the committed JSON Schemas of the wire contracts and the AsyncAPI document."""
    from ontofabric.shared import asyncapi

    if write:
        if not (schema.SCHEMA_DIR.parent.parent / "pyproject.toml").is_file():
            # An installed package's copy: rewriting it changes nothing anyone commits, and a reinstall undoes it.
            _fail(f"--write rewrites a checkout's contracts; {schema.SCHEMA_DIR.parent} is an installed copy (run it "
                  "from an editable install of the checkout)")  # fmt: skip
        for path in [*schema.write(), asyncapi.write()]:
            console.print(f"wrote {path}")
        return
    drifted = schema.drift() + (["asyncapi.json"] if asyncapi.drifted() else [])
    if drifted:
        _fail(f"contracts differ from the models: {', '.join(drifted)} (run `ontofabric contracts --write`)")
    console.print("schemas and the AsyncAPI document match the models")


@app.command("settings")
def show_settings(
    markdown: Annotated[bool, typer.Option("--markdown", help="Print defaults as a Markdown table.")] = False,
) -> None:
    """Print every setting with its environment variable, effective value and meaning."""
    if markdown:
        print("| variable | default | meaning |\n|---|---|---|")
        for name, field in Settings.model_fields.items():
            value = field.default
            # As the variable is written: a list as JSON.
            shown = json.dumps(list(value)) if isinstance(value, tuple | list) else value
            default = "(computed)" if field.default_factory is not None else f"`{shown}`"
            print(f"| `ONTOFABRIC_{name.upper()}` | {default} | {field.description or ''} |")
        return
    settings = Settings()
    rows = [(f"ONTOFABRIC_{name.upper()}", _shown_setting(getattr(settings, name)), field.description or "")
            for name, field in Settings.model_fields.items()]  # fmt: skip
    if not console.is_terminal:
        # Piped, a line a setting, tab-separated: a table wrapped URLs and paths at 13 columns, which could be
        # neither copied nor grepped (a configuration tester's).
        for row in rows:
            print("\t".join(part.replace("\t", " ").replace("\n", " ") for part in row))
        _warn_unknown_variables()
        return
    table = whole_table("variable", "value", "meaning")
    # Whole on one line, to be copied: piped at 80 columns, 80 of 103 names ended in an ellipsis (a tester's).
    table.columns[0].no_wrap = True
    table.columns[0].min_width = max(len(f"ONTOFABRIC_{name}") for name in Settings.model_fields)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    _warn_unknown_variables()


def _shown_setting(value: object) -> str:
    """A setting's value fit to print: a URL without its secrets, SecretStr masked, a list as the variable would be
    written (JSON)."""
    if isinstance(value, str):
        return redacted_url(value)
    return json.dumps(list(value)) if isinstance(value, tuple | list) else str(value)


def _warn_unknown_variables() -> None:
    for variable, resembles in unknown_variables(os.environ).items():
        guess = f" (did you mean {resembles}?)" if resembles else ""
        errors.print(f"[yellow]warning:[/yellow] {escape(variable)} is set but is no setting; ignored{guess}")


DATABASE_UNREACHABLE = (OSError, TimeoutError, asyncpg.PostgresConnectionError, asyncpg.ClientConfigurationError)
"""What connecting to a database an operator's command reads (rebuild, compact, dlq redrive) raises when it is
away, frozen or misnamed: said in a line, not a traceback (when asyncpg raised it: NATS has its own)."""


def _raised_in_asyncpg(error: BaseException) -> bool:
    frames = traceback.extract_tb(error.__traceback__)
    return isinstance(error, asyncpg.PostgresConnectionError) or any(
        f"{os.sep}asyncpg{os.sep}" in frame.filename for frame in frames
    )


_SETTING_NAME = re.compile(
    r"(?<![\w'-])(" + "|".join(sorted(Settings.model_fields, key=len, reverse=True)) + r")(?![\w'-])"
)
"""A setting's field name standing alone: not a word of a value (an operator tester's 'second-embedder' read
'second-ONTOFABRIC_EMBEDDER' in the list of the reranker's values)."""


def _as_variables(message: str) -> str:
    """A settings check's message with each setting named as the variable an operator sets."""
    return _SETTING_NAME.sub(lambda named: f"ONTOFABRIC_{named.group(1).upper()}", message)


def _summaries_on_one_line(*groups: typer.Typer) -> None:
    """Typer's rich help shows a command's docstring with its line breaks kept, which cuts sentences mid-line in
    `--help` (a tester's: "made / again"); each paragraph is joined instead, and the summary is the first."""
    for group in groups:
        for command in group.registered_commands:
            text = command.help or (command.callback.__doc__ if command.callback else None)
            if not text:
                continue
            paragraphs = [" ".join(paragraph.split()) for paragraph in inspect.cleandoc(text).split("\n\n")]
            command.help = "\n\n".join(paragraphs)
            if command.short_help is None:
                command.short_help = paragraphs[0]


_summaries_on_one_line(app, gateway_token, dlq, nats_user)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
    except (
        PermissionDenied, BadCredentials, NotSetUp, TokensUnreadable, StdioUnusable, ModelMissing, DeploymentMismatch,
        EmbedderMismatch, EmbeddingApiError,
    ) as error:  # fmt: skip
        errors.print(f"[red]error:[/red] {error}")
        sys.exit(2)
    except NatsUnreachable as error:
        errors.print(f"[red]error:[/red] {error}: is it running, and is ONTOFABRIC_NATS_URL right?")
        sys.exit(1)
    except (PublishFailed, ManifestUnavailable, ManifestChanged) as error:  # the same command again is safe
        errors.print(f"[red]error:[/red] {escape(str(error))}")
        sys.exit(1)
    except (asyncpg.InvalidAuthorizationSpecificationError, asyncpg.InvalidCatalogNameError) as error:
        # A wrong password, an unknown user or database: a traceback of 59 lines (a security tester's). The server's
        # message names the user or the database, never the password.
        errors.print(
            f"[red]error:[/red] PostgreSQL refused the connection ({type(error).__name__}: {escape(str(error))}): "
            "are the user, password and database of its URL right (ONTOFABRIC_DATABASE_URL, or the worker's own)?"
        )
        sys.exit(2)
    except DATABASE_UNREACHABLE as error:
        if not _raised_in_asyncpg(error):
            raise
        said = str(error) or "no answer in time"
        errors.print(
            f"[red]error:[/red] PostgreSQL could not be reached ({type(error).__name__}: {said}): is it running, "
            "and is ONTOFABRIC_DATABASE_URL right?"
        )
        sys.exit(1)
    except ValidationError as error:
        if error.title != Settings.__name__:
            raise
        # Without the input: a value that failed may be a secret. Escaped: a pattern's brackets are no markup.
        for problem in error.errors(include_input=False, include_url=False):
            variable = "".join(f"ONTOFABRIC_{str(part).upper()}" for part in problem["loc"][:1]) or "settings"
            said = problem["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's ValueError
            errors.print(f"[red]error:[/red] {variable}: {escape(_as_variables(said))}")
        sys.exit(2)
    except (MetricsUnservable, SettingsUnusable) as error:
        errors.print(f"[red]error:[/red] {escape(str(error))}")
        sys.exit(2)
    except SettingsError as error:  # a list setting that is not JSON, before any value is checked
        named = re.search(r'field "(\w+)"', str(error))
        variable = f"ONTOFABRIC_{named.group(1).upper()}" if named else "settings"
        errors.print(f"[red]error:[/red] {variable}: not valid JSON (a list setting is written as JSON: [1, 2])")
        sys.exit(2)
