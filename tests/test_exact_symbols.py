"""Exact identifiers: a query that is a symbol's name gets the chunks that define it first, and a query for a symbol's
callers the chunks that call it (services/query/symbols.py), decided purely and then through the real path
(ingester, projector, query worker, Postgres)."""

from __future__ import annotations

import asyncio
import textwrap
import time
from pathlib import Path

import pytest

from ontofabric.contracts import QueryResponse
from ontofabric.contracts.deltas import NodeUpserted, OntologyNode
from ontofabric.contracts.query import RelationAsked
from ontofabric.services.gateway.tools import CALLS_READ, answer_notes, render
from ontofabric.services.ingest.client import envelope
from ontofabric.services.ingest.ingester import Ingester
from ontofabric.services.projector.worker import ProjectorService
from ontofabric.services.query import pipeline as pipeline_module
from ontofabric.services.query.client import QueryClient
from ontofabric.services.query.fusion import Fused, SourceHit
from ontofabric.services.query.names import match_quality, republished_as
from ontofabric.services.query.symbols import (
    BASE,
    CALLEE,
    CALLER,
    FILE,
    IMPORTED,
    IMPORTER,
    MESSAGE,
    SUBCLASS,
    SYMBOL,
    FileAsked,
    definitions_first,
    file_asked,
    identifier_of,
    kind_asked,
    related_first,
    relation_of,
)
from ontofabric.shared.embedder import Embedder

from .conftest import Deployment, Start


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("rich/console.py", "rich/console.py"),
        ("  `./docs/index.md` ", "docs/index.md"),
        ('"jinja2/filters.py"', "jinja2/filters.py"),
        ("src\\pkg\\mod.py", "src/pkg/mod.py"),  # as Windows writes it
        ("/usr/lib/python3/site-packages/rich/console.py", "usr/lib/python3/site-packages/rich/console.py"),
        ("C:/work/x/y.pyi", "work/x/y.pyi"),
        ("console.py", "console.py"),
        ("NOTES.txt", "NOTES.txt"),
        ("docs/usage.rst", "docs/usage.rst"),
        ("services/api/auth/middleware.go", "services/api/auth/middleware.go"),  # a monorepo tester's
        ("web/src/App.tsx", "web/src/App.tsx"),
        ("rich.console", None),  # a module's name: identifier_of's
        ("how does console.py work", None),  # other words: a question
        ("my file.py", None),
        (".py", None),
        ("rich/console.kt", None),  # no file an ingest reads
        ("x/" * 200 + "y.py", None),
        ('"/Users/John Doe/proj/x.py"', None),  # spaces: words, quoted or not (a review's quoted question)
        ('"explain the steps in docs/README.md"', None),
    ],
)
def test_file_asked_takes_a_whole_query_that_is_one_files_path(text: str, path: str | None) -> None:
    assert file_asked(text) == (None if path is None else FileAsked(path))


@pytest.mark.parametrize(
    ("text", "asked"),
    [
        ("rich/console.py:120", FileAsked("rich/console.py", 120)),
        ("`rich/console.py:120:8`", FileAsked("rich/console.py", 120)),  # and a column
        ("console.py#L12", FileAsked("console.py", 12)),
        ('File "/usr/lib/rich/console.py", line 1697, in print', FileAsked("usr/lib/rich/console.py", 1697, "print")),
        ('  File "x/y.py", line 3, in <module>', FileAsked("x/y.py", 3)),
        ('File "a.py", line 3', FileAsked("a.py", 3)),
        ('File "C:\\Program Files\\app\\x.py", line 3, in f', FileAsked("Program Files/app/x.py", 3, "f")),
        ("docs/guide.md:40", FileAsked("docs/guide.md", 40)),
        ("x.py:abc", None),
        ("how is x.py:3 read", None),
    ],
)
def test_file_asked_reads_a_line_and_a_tracebacks_frame(text: str, asked: FileAsked | None) -> None:
    assert file_asked(text) == asked


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("Retrying", "Retrying"),
        ("  tenacity.retry.Retrying ", "tenacity.retry.Retrying"),
        ("`Retrying.__call__`", "Retrying.__call__"),
        ("Retrying::__call__", "Retrying.__call__"),
        ("Retrying#__call__", "Retrying.__call__"),
        ("wait_fixed()", "wait_fixed"),
        ("retry", "retry"),
        ("how does retry work", None),  # a word, not a name as code writes one
        ("how does wait_fixed work", "wait_fixed"),  # what it is, as a whole: its definition first
        ("how does the retry loop work", None),
        ("retry.", None),
        ("3.14", None),
        ("a-b", None),
        ("", None),
        ("x" * 301, None),
        # Identifiers in any script, read as Python reads them (NFKC): a Unicode tester's were asked as words.
        ("获取连接", "获取连接"),
        ("préparer_café()", "préparer_café"),
        ("Re\u0301sume\u0301.ｆｕｌｌ", "Résumé.full"),
        ("｀Retrying：：__call__（）｀", "Retrying.__call__"),  # as Chinese and Japanese keyboards write them
        ("²x", None),
        # With the kind of symbol it names (an outside tester's `class retry_base` got the docstring first).
        ("class retry_base", "retry_base"),
        ("def `wraps()`", "wraps"),
        ("the Retrying class", "Retrying"),
        ("async def fetch", "fetch"),
        ("module tenacity.wait", "tenacity.wait"),
        ("class loader for plugins", None),
        ("the class", None),
        # Words that read as words, not a name with its kind (a review's).
        ("package manager", None),
        ("base class", None),
        ("class inheritance", None),
        ("module loading", None),
        ("function composition", None),
        ("async def", None),
        ("class Manager", "Manager"),
        # Asking where one is, or what it is, as a whole (an agent tester's `where is Console defined` ran no
        # lookup, and rich's Console was not in the top 10).
        ("where is Console defined", "Console"),
        ("Where is the Console class defined?", "Console"),
        ("where's `Text`", "Text"),
        ("where can I find typer.echo", "typer.echo"),
        ("find Console.print", "Console.print"),
        ("show me rich.console.Console", "rich.console.Console"),
        ("go to the definition of Retrying::copy", "Retrying.copy"),
        ("definition of Style", "Style"),
        ("Style definition", "Style"),
        ("what is Measurement.get?", "Measurement.get"),
        ("where is the retry loop defined", None),
        ("what is a good way to retry", None),
        ("where is it defined", None),
        ("what is this", None),
        ("find all callers", None),
        ("how is Syntax implemented", "Syntax"),
        # Questions in words, not names (a review's: each was looked up, and a module called errors came first).
        ("find errors", None),
        ("what is the purpose", None),
        ("what is the default", None),
        ("what is the base class", None),
        ("where is the package manager", None),
        ("what is class inheritance", None),
        ("how does the method resolution work", None),
        ("show me the tests", None),
        ("what's new", None),
        ("find the main function", None),
        ("find the `main` function", None),
        ("where is the print_json function", "print_json"),
        ("where is the Console class defined", "Console"),
        # Title case is no name's capital (a second review's); backticks and a call's () are code, a period ends.
        ("What Is The Purpose", None),
        ("Find Errors", "Errors"),  # two words: no telling title case from a capitalised name, which goes first
        ("Find The Errors", None),
        ("Where can I find Console?", "Console"),  # `I` is capitalised in any question (a third review's)
        ("Find Console", "Console"),
        ("Where's Console?", "Console"),
        ("Where is tenacity::retry defined?", "tenacity.retry"),
        ("crate::backoff::Backoff", "backoff.Backoff"),  # Rust's crate root: the path from it is an alias
        ("How Does Caching Work", None),
        ("Where Is Console Defined", None),  # every word capitalised: none tells the name
        ("where is `console` defined", "console"),
        ("what is `render`", "render"),
        ("where is render() defined", "render"),
        ("where is `render()` defined", "render"),
        ("where is Console defined.", "Console"),
        ("\u200f\u200bpass_context", "pass_context"),  # marks that show nothing (an agent tester's)
        ("where is Con\u200dsole defined", "Console"),
        # Dotted, a hyphenated part is a module's (client/auth-extensions.js); a hyphenated word alone is words.
        (
            "experimental.tasks.mcp-server.ExperimentalMcpServerTasks",
            "experimental.tasks.mcp-server.ExperimentalMcpServerTasks",
        ),
        ("well-known", None),
        # Names Python reads with combining marks or connectors, which \\w leaves out (a Unicode tester's).
        ("beyond.marks.नमस्ते", "beyond.marks.नमस्ते"),
        ("x‿y", "x‿y"),
        ("℘eier", "℘eier"),
        # JavaScript's and Java's names may hold $ (a retest's $query could not be asked); a price is no name.
        ("$query", "$query"),
        ("jsd.dollar.$query", "jsd.dollar.$query"),
        ("Outer$Inner", "Outer$Inner"),
        ("$100", None),
        ("$", None),
        ("$5M", None),  # a $ before a digit is a price (a review's were names)
        ("US$5", None),
        ("data$", "data$"),  # an observable's name
        ("℘", "℘"),  # a name without $ needs no letter (a review's)
    ],
)
def test_identifier_of_takes_a_whole_query_that_is_one_name(text: str, name: str | None) -> None:
    assert identifier_of(text) == name


@pytest.mark.parametrize(
    ("text", "asked"),
    [
        ("what calls to_seconds", (CALLER, "to_seconds")),
        ("What calls to_seconds.", (CALLER, "to_seconds")),  # a period ends it too
        ("What calls `to_seconds`?", (CALLER, "to_seconds")),
        ("who calls Retrying::wraps", (CALLER, "Retrying.wraps")),
        ("which functions call the method BaseRetrying.begin", (CALLER, "BaseRetrying.begin")),
        ("what code uses wait_fixed()", (CALLER, "wait_fixed")),
        ("who instantiates the class RetryCallState", (CALLER, "RetryCallState")),
        ("callers of tenacity.wait.wait_base", (CALLER, "tenacity.wait.wait_base")),
        ("find all call sites of retry()", (CALLER, "retry")),
        ("usages of sleep", (CALLER, "sleep")),
        ("where is sleep called from?", (CALLER, "sleep")),
        ("functions that call sleep", (CALLER, "sleep")),
        ("to_seconds callers", (CALLER, "to_seconds")),
        ("what subclasses wait_base", (SUBCLASS, "wait_base")),
        ("which classes inherit from the class wait_base?", (SUBCLASS, "wait_base")),
        ("what implements Reranker", (SUBCLASS, "Reranker")),
        ("list all implementations of the interface Reranker", (SUBCLASS, "Reranker")),
        ("subclasses of tenacity.wait.wait_base", (SUBCLASS, "tenacity.wait.wait_base")),
        ("classes that extend BaseRetrying", (SUBCLASS, "BaseRetrying")),
        ("what imports tenacity._utils", (IMPORTER, "tenacity._utils")),
        ("which modules import the module tenacity._utils", (IMPORTER, "tenacity._utils")),
        ("where is tenacity._utils imported?", (IMPORTER, "tenacity._utils")),
        ("importers of _utils", (IMPORTER, "_utils")),
        ("files that import _utils", (IMPORTER, "_utils")),
        # The other direction.
        ("what does wraps call", (CALLEE, "wraps")),
        ("what functions does Retrying.wraps call?", (CALLEE, "Retrying.wraps")),
        ("callees of to_seconds", (CALLEE, "to_seconds")),
        ("what is called by begin", (CALLEE, "begin")),
        ("what does Retrying inherit from", (BASE, "Retrying")),
        ("which classes does Retrying extend", (BASE, "Retrying")),
        ("base classes of Retrying", (BASE, "Retrying")),
        ("what is Retrying's superclass", (BASE, "Retrying")),
        ("what does tenacity.wait import", (IMPORTED, "tenacity.wait")),
        ("what is imported by tenacity._utils", (IMPORTED, "tenacity._utils")),
        ("dependencies of tenacity.wait", (IMPORTED, "tenacity.wait")),
        # Asked as a question (a tester's "what are the base classes of Live" was no lookup).
        ("what are the base classes of Live", (BASE, "Live")),
        ("what are the callers of cell_len?", (CALLER, "cell_len")),
        ("which are the subclasses of JupyterMixin", (SUBCLASS, "JupyterMixin")),
        ("what is the superclass of Live", (BASE, "Live")),
        # The symbol called by its kind, words and all (an agent tester's were searched in words).
        ("who calls the async context manager _start_hooks_context", (CALLER, "_start_hooks_context")),
        ("which modules import the AckPolicy enum", (IMPORTER, "AckPolicy")),
        ("what implements the ParserProto protocol?", (SUBCLASS, "ParserProto")),
        ("who uses the decorator retry_if", (CALLER, "retry_if")),
        # A word called by another kind is no name (a retest's: each was asked of the word, at score 1).
        ("what implements the parser protocol", None),
        ("who calls the exception handler", None),
        ("which modules import the message protocol", None),
        ("what uses the property cache", None),
        ("what calls the function retry", (CALLER, "retry")),  # a plain kind names any
        ("who calls the async function fetch", (CALLER, "fetch")),  # with a word before it (a review's)
        ("what subclasses the base class handler", (SUBCLASS, "handler")),
        ("what implements the `parser` protocol", (SUBCLASS, "parser")),  # in backticks: code
        ("what subclasses नमस्ते", (SUBCLASS, "नमस्ते")),  # a name with combining marks (a Unicode tester's)
        ("what calls كَتَبَ", (CALLER, "كَتَبَ")),
        ("what calls $query", (CALLER, "$query")),
        # Not a lookup: another question, words besides the name, no name.
        ("how does backoff work", None),
        ("what calls to_seconds and why", None),
        ("what calls the retry loop", None),
        ("what does the retry loop call", None),
        ("what calls 3.14", None),
        ("what does Foo import from", None),
        ("calls to sleep", (CALLER, "sleep")),
        ("calls made by sleep", (CALLEE, "sleep")),
        ("calls of sleep", None),  # which way is unclear
        # Raising an exception calls its class: an agent tester's "where is X raised" had X's definition first.
        ("what raises WebSocketDisconnect", (CALLER, "WebSocketDisconnect")),
        ("which functions raise HTTPException?", (CALLER, "HTTPException")),
        ("where is starlette.exceptions.HTTPException raised", (CALLER, "starlette.exceptions.HTTPException")),
        ("where does ClientDisconnect get thrown from?", (CALLER, "ClientDisconnect")),
        ("RangeNotSatisfiable raised", (CALLER, "RangeNotSatisfiable")),
        ("errors raised", None),  # words, not an exception's name (a review's)
        ("Errors raised", None),
        ("Nothing raised?", None),
        ("what raises timeout", None),
        ("what raises the exception", None),
        ("what raises socket.timeout", (CALLER, "socket.timeout")),
        ("to_seconds", None),
        # A module of a hyphenated file name (an agent tester's JavaScript package); hyphens joining no words are not.
        ("what imports nats-base-client.util", (IMPORTER, "nats-base-client.util")),
        ("importers of auth-extensions", (IMPORTER, "auth-extensions")),
        ("what calls well-known code", None),
        ("callers of foo-", None),
        ("what imports -x", None),
        # A file's path, where imports are asked: its module's name (an agent tester's were searched in words).
        ("what imports src/clock.rs", (IMPORTER, "src.clock")),
        ("what imports `click/_compat.py`", (IMPORTER, "click._compat")),
        ("what imports _compat.py", (IMPORTER, "_compat")),
        ("what does pkg/__init__.py import", (IMPORTED, "pkg")),
        ("what calls src/clock.rs", None),
        ("what imports docs/guide.md", None),
    ],
)
def test_relation_of_takes_a_whole_query_that_asks_one_relation_of_one_name(
    text: str, asked: tuple[str, str] | None
) -> None:
    assert relation_of(text) == asked


def test_related_chunks_go_first_functions_before_modules_then_pipeline_order() -> None:
    candidates = [
        Fused("definition", 0.9, 0.9, {"keyword": SourceHit(1, 7.0)}),
        Fused("late", 0.5, 0.6, {"dense": SourceHit(2, 0.5)}),
        Fused("early", 0.6, 0.7, {"dense": SourceHit(1, 0.6)}),
    ]
    callers = {"module": "pkg.app", "late": "pkg.app.b", "early": "pkg.app.c", "unranked": "pkg.app.a"}
    ordered = related_first(callers, candidates, 10, CALLER, modules={"module"})
    assert [hit.id for hit in ordered] == ["late", "early", "unranked", "module", "definition"]
    assert [hit.relevance for hit in ordered][:4] == [1.0] * 4
    assert ordered[0].found_by == {"dense": SourceHit(2, 0.5), CALLER: SourceHit(1, 1.0)}
    assert [hit.id for hit in related_first(callers, candidates, 1, SUBCLASS)] == ["late", "definition", "early"]
    # Nearer before farther (a subclass before its own subclasses), whatever the pipeline thought of them.
    far = related_first(callers, candidates, 10, SUBCLASS, {"module"}, distances={"late": 1, "early": 1})
    assert [hit.id for hit in far][:4] == ["unranked", "module", "late", "early"]


def test_code_shaped_names_are_those_only_code_writes() -> None:
    from ontofabric.services.query.symbols import code_shaped

    for name in ("DEFAULT_TIMEOUT", "httpx.Client", "utf8", "getValue", "HTTPError", "_private", "get_数据"):
        assert code_shaped(name), name
    # A phrase of Chinese or Japanese is written without spaces: with a name or a number in it, it is still words
    # (a review's: such questions had the keyword list lead the fusion).
    for name in ("pagination", "Retrying", "authentication", "x", "如何使用Redis缓存", "配置3个工作进程"):
        assert not code_shaped(name), name


def test_the_line_assigning_a_name_is_its_least_indented_assignment() -> None:
    from ontofabric.services.query.symbols import assignment_line

    module = 'import re\n\nFILTERS = {\n    "a": 1,\n}\nclass Chain:\n    FILTERS = ()\nSEEN = FILTERS == {}\n'
    assert assignment_line(module, "FILTERS", 1) == 3  # not the class's, nor a comparison
    assert assignment_line("class Outline:\n    stroke: int = 1\n", "stroke", 40) == 41  # annotated, in a class
    assert assignment_line("first = DEFAULT = 3\n", "DEFAULT", 7) == 7  # chained
    assert assignment_line("x = 1\n", "FILTERS", 1) is None
    # A review's: an example in a docstring, a keyword argument, unpacking, an annotation alone, a nested class.
    documented = '"""Example:\n\nFILTERS = 3\n"""\nimport x\nif x:\n    FILTERS = {}\n'
    assert assignment_line(documented, "FILTERS", 1) == 7
    assert assignment_line("setup(\n    FILTERS=1,\n)\nif True:\n    FILTERS = 2\n", "FILTERS", 1) == 5
    assert assignment_line("A, FILTERS = 1, 2\n", "FILTERS", 1) == 1
    assert assignment_line("class O:\n    stroke: int\n", "stroke", 5) == 6
    assert assignment_line("    class Inner:\n        x = 1\n", "x", 10) == 11
    assert assignment_line("handlers = {}\nhandlers[DEFAULT] = 1\nDEFAULT = 2\n", "DEFAULT", 1) == 3  # an item's
    assert assignment_line("FILTERS = (\n" + "1,\n" * 60_000, "FILTERS", 1) == 1  # cut, too long to parse
    # A module published under another name (pytest.mark for MARK_GEN): a class's `mark` is not it.
    marked = "class MarkDecorator:\n    mark: int\nMARK_GEN = 1\n"
    assert assignment_line(marked, "mark", 1) == 2
    assert assignment_line(marked, "mark", 1, top_only=True) is None
    assert assignment_line("class C:\n    mark = (\n" + "1,\n" * 60_000, "mark", 1, top_only=True) is None
    assert assignment_line("mark = 1\n", "mark", 1, top_only=True) == 1


def test_match_quality_ranks_the_whole_name_then_its_last_parts_then_case() -> None:
    assert match_quality("tenacity.retry.Retrying", "tenacity.retry.Retrying") == 0
    assert match_quality("tenacity.retry.Retrying", "retry.Retrying") == 1
    assert match_quality("tenacity.retry.Retrying", "Retrying") == 1
    assert match_quality("tenacity.retry.Retrying", "TENACITY.retry.retrying") == 3
    assert match_quality("tenacity.retry.Retrying", "retrying") == 4
    # A private module's class by the name its package re-exports it under (an agent tester's `httpx.Client`).
    assert match_quality("httpx._client.Client", "httpx.Client") == 2
    assert match_quality("httpx._client.AsyncClient.send", "httpx.AsyncClient.send") == 2
    assert match_quality("httpx._client.Client", "HTTPX.client") == 5
    assert match_quality("httpx._client._Private", "httpx._Private") == 2  # the last part is the name asked
    assert match_quality("jinja2.ext._TranslationsBasic.gettext", "jinja2.ext.gettext") is None  # a class's part
    assert match_quality("httpx.__about__.x", "httpx.x") is None  # a dunder part is not private
    assert match_quality("_pkg.mod.C", "mod.C") == 1
    assert match_quality("tenacity.retry.Retrying", "ry.Retrying") is None  # parts match whole, not by letters
    assert match_quality("tenacity.retry.Retrying", "tenacity") is None


def test_republished_as_is_a_python_name_shorter_than_the_symbols_own_as_imported() -> None:
    assert republished_as("anyio._core._eventloop.sleep", ["anyio.sleep"], "python") == "anyio.sleep"
    assert republished_as("anyio.abc._eventloop.AsyncBackend.sleep", [], "python") is None
    # A src layout names every chunk by its import name too: that alone publishes nothing (a review's).
    aliases = ["shapes.timing.pause", "src.shapes.pause", "shapes.pause"]
    assert republished_as("src.shapes.timing.pause", aliases, "python") == "shapes.pause"
    assert republished_as("src.shapes.backends.Backend.pause", ["shapes.backends.Backend.pause"], "python") is None
    # Other languages name every declaration by its package (a review's Go `package main`) or crate.
    assert republished_as("tools.gen.render", ["main.render"], "go") is None
    assert republished_as("", ["x"], "python") is None


def test_definitions_go_first_in_match_then_pipeline_order_and_the_rest_keep_theirs() -> None:
    candidates = [
        Fused("mentions", 0.9, 0.8, {"keyword": SourceHit(1, 7.0)}),
        Fused("method", 0.5, 0.6, {"dense": SourceHit(2, 0.5)}),
        Fused("other", 0.4, 0.5),
    ]
    definitions = {
        "function": "pkg.util.area",  # not among the candidates
        "method": "pkg.shapes.Circle.area",
        "upper": "pkg.Area",  # only ignoring case
    }
    ordered = definitions_first("area", definitions, candidates, limit=10)
    assert [hit.id for hit in ordered] == ["method", "function", "mentions", "other"]
    assert [hit.relevance for hit in ordered] == [1.0, 1.0, 0.8, 0.5]
    assert ordered[0].found_by == {"dense": SourceHit(2, 0.5), SYMBOL: SourceHit(1, 1.0)}
    assert ordered[1].found_by == {SYMBOL: SourceHit(2, 1.0)}
    # The code before its module's declaration file (an agent tester's lookups had the `.d.ts` signature first).
    files = {"method": "pkg/shapes.d.ts", "function": "pkg/util.js"}
    typed = definitions_first("area", definitions, candidates, limit=10, files=files)
    assert [hit.id for hit in typed][:2] == ["function", "method"]
    # At most ``limit`` are placed first; one past it keeps its place among the rest.
    limited = definitions_first("area", definitions, candidates, limit=1)
    assert [hit.id for hit in limited] == ["method", "mentions", "other"]
    # A qualified name narrows: only the method ends with Circle.area.
    assert [hit.id for hit in definitions_first("Circle.area", definitions, candidates, 10)][:2] == [
        "method",
        "mentions",
    ]
    # Ignoring case only when nothing matches as written.
    assert [hit.id for hit in definitions_first("AREA", definitions, candidates, 10)][:3] == [
        "method",
        "upper",  # the shorter name
        "function",
    ]
    assert definitions_first("volume", definitions, candidates, 10) == candidates
    # A dotted name that is a symbol's whole qualified name is that symbol alone: not also a private module's
    # published as it, nor one ending with it (an agent tester's faststream.types took faststream._internal.types).
    collide = {"public": "pkg.types", "private": "pkg._internal.types", "deeper": "vendor.pkg.types"}
    assert [hit.id for hit in definitions_first("pkg.types", collide, [], 10)] == ["public"]
    assert [hit.id for hit in definitions_first("pkg.Types", collide, [], 10)] == ["public"]  # ignoring case too
    assert [hit.id for hit in definitions_first("types", collide, [], 10)] == ["public", "deeper", "private"]
    del collide["public"]  # without it, the others are what the name is
    assert [hit.id for hit in definitions_first("pkg.types", collide, [], 10)] == ["deeper", "private"]
    # At the same match, a class or function before a module (which holds it).
    module_first = definitions_first("area", {"mod": "pkg.area", "fn": "pkg.area.area"}, [], 10, modules={"mod"})
    assert [hit.id for hit in module_first] == ["fn", "mod"]
    # Of the kind asked first (an agent tester's `def cell_len`: the property first, the function second).
    kinds = {"function": "function", "method": "method"}
    asked = definitions_first("area", definitions, candidates, 10, kind="function", kinds=kinds)
    assert [hit.id for hit in asked][:2] == ["function", "method"]
    asked = definitions_first("area", definitions, candidates, 10, kind="module", kinds=kinds)
    assert [hit.id for hit in asked][:2] == ["method", "function"]  # none of it: as before
    # What its package publishes before what it does not (an agent tester's `sleep`: a backend's method ahead of
    # anyio.sleep), after the kind asked.
    public = definitions_first("area", definitions, candidates, 10, published={"function"})
    assert [hit.id for hit in public][:2] == ["function", "method"]
    asked = definitions_first("area", definitions, candidates, 10, kind="method", kinds=kinds, published={"function"})
    assert [hit.id for hit in asked][:2] == ["method", "function"]
    # What defines it before what assigns it (an agent tester's click `Context`, annotating `command: Command`, went
    # before the method `Group.command`).
    assigned = definitions_first("area", definitions, candidates, 10, assigning={"method"})
    assert [hit.id for hit in assigned][:2] == ["function", "method"]
    # Before what its package publishes too: the class annotating it was click's published `Context` (a review's).
    assigned = definitions_first("area", definitions, candidates, 10, published={"method"}, assigning={"method"})
    assert [hit.id for hit in assigned][:2] == ["function", "method"]


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("def cell_len", "function"),
        ("cell_len function", "function"),
        ("where is the print_json function defined", "function"),
        ("the Console class", "class"),
        ("module rich.console", "module"),
        ("method Console.print", "method"),
        ("cell_len", None),
        ("where is cell_len defined", None),
        ("constant DEFAULT", None),
        ("class inheritance", None),  # words, not a name
    ],
)
def test_kind_asked_is_the_kind_of_symbol_a_query_names(text: str, kind: str | None) -> None:
    assert kind_asked(text) == kind


SHAPES = {
    "__init__.py": '"""Shapes and their areas."""\nfrom ._base import Outline\nfrom .circle import Circle\n'
    "from .timing import pause\n"
    "Round = Circle\n"  # another name for it (attrs' `s = attrs`)
    "from .square import UNIT\n"  # a module's constant, published (pytest.skip for _pytest.outcomes.skip)
    "from ._base import WIDTH as stroke\n",  # under another name (pytest.mark for MARK_GEN)
    # Every public name of another module, taken by `*` (attrs.validators is `from attr.validators import *`).
    "everything.py": "from .square import *\n",
    # A class of the same name in another private module, which the package does not publish (anyio's backends'
    # Event beside anyio.Event).
    "_drafts.py": """
        class Outline:
            pass
        """,
    # A function the package publishes, and a method of the same name that says it more often (anyio.sleep beside
    # its backends' sleep).
    "timing.py": """
        def pause(seconds):
            return seconds
        """,
    "backends.py": """
        class Backend:
            def pause(self, seconds):
                \"\"\"Pause the backend: a pause of the backend until its pause ends.\"\"\"
                return seconds
        """,
    # A private class's member: no module publishes it.
    "pens.py": """
        class _Pen:
            def width(self):
                return 2
        """,
    # A private module's class, which the package re-exports.
    "_base.py": """
        class Outline:
            stroke = 1
        WIDTH = 2
        """,
    "circle.py": '''
        class Circle:
            """A round shape."""

            def area(self, radius):
                return 3.14159 * radius * radius
        ''',
    "square.py": """
        UNIT = "cm"  # a module constant: no chunk of its own


        def area(side):
            return side * side
        """,
    # A module and its function of the same name: the function is what a name asks for.
    "volume.py": """
        def volume(side):
            return side**3
        """,
    # Callers: through a module imported under its name, and of a class imported from its module.
    "report.py": """
        from . import square
        from .circle import Circle

        def describe(side):
            return f"a square of area {square.area(side)}"

        def round_one():
            return Circle()

        class Ring(Circle):
            hole = 0.5
        """,
    # A constructor a subclass inherits: calling the subclass runs it.
    "makers.py": """
        class Base:
            def __init__(self, key):
                self.key = key

        class Sub(Base):
            pass

        class Other(Base):
            def __init__(self):
                super().__init__(3)

        def make_sub():
            return Sub(1)

        def make_base():
            return Base(2)

        def make_other():
            return Other()

        class Mixin:
            def __init__(self):
                pass

        class Mixed(Mixin, Base):
            pass

        def make_mixed():
            return Mixed()
        """,
    # A function assigned, not defined (jinja2's `concat = "".join`), beside a class of the same name in another
    # case: an agent tester's callers of concat were Concat's.
    "strings.py": """
        concat = "".join


        class Concat:
            pass
        """,
    "writer.py": """
        from . import strings
        from .strings import concat

        def joined(parts):
            return concat(parts)

        def node():
            return strings.Concat()
        """,
    # A chunk that says Circle far more often than the class does: what keyword search would rank first.
    "gallery.py": """
        def draw_circles(canvas):
            # Circle after Circle: a Circle per row, each Circle red, the Circle radius from the Circle list.
            for circle in canvas.circles:
                canvas.paint(circle, "Circle", "Circle outline", "Circle fill")
        """,
}


async def _projected(
    deployment: Deployment, embedder: Embedder, tree: Path, files: dict[str, str], package: str
) -> None:
    """``files`` written under ``tree``, ingested as the package ``package`` into the workspace of that name, and
    projected."""
    for name, text in files.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(textwrap.dedent(text))
    ingester = Ingester(deployment.js, deployment.names, embedder, deployment.settings.max_content_bytes)
    report = await ingester.ingest(tree, package, package=package)
    assert report.last_sequence is not None
    await deployment.wait_projected(report.last_sequence)


async def _served(
    deployment: Deployment, embedder: Embedder, start: Start, tree: Path, files: dict[str, str], package: str
) -> QueryClient:
    """``files`` projected as :func:`_projected` does, a query worker started over them, and a client of it."""
    await _projected(deployment, embedder, tree, files, package)
    await start(embedder, query_cache_entries=0)
    return QueryClient(deployment.nc, deployment.names)


async def _ask(client: QueryClient, text: str, workspace: str = "shapes", **params: object) -> QueryResponse:
    reply = await client.query(workspace, {"semanticQuery": text, "topK": 5, **params})
    assert isinstance(reply, QueryResponse), reply
    return reply


def _found_by(reply: QueryResponse, retriever: str, key: str = "symbolFqn") -> list[object]:
    """The ``key`` of each result the ``retriever`` found (a relation's: caller, callee, subclass...), in order."""
    return [r.metadata[key] for r in reply.results if retriever in {f.retriever for f in r.found_by}]


def _names(reply: QueryResponse) -> list[str]:
    """Each result's qualified name and chunk level: a docstring has its owner's name."""
    return [f"{r.metadata.get('symbolFqn')} ({r.metadata.get('chunkLevel')})" for r in reply.results]


async def test_a_name_finds_its_definition_first_through_the_real_path(
    deployment: Deployment, projector: ProjectorService, embedder: Embedder, start_query_worker: Start, tmp_path: Path
) -> None:
    # A package checked out under another directory name, ingested as the package it is: its modules are shapes.*
    client = await _served(deployment, embedder, start_query_worker, tmp_path / "shapes-worktree", SHAPES, "shapes")

    circle = await _ask(client, "Circle")
    assert _names(circle)[0] == "shapes.circle.Circle (type)"
    assert _names(await _ask(client, "class Circle"))[0] == "shapes.circle.Circle (type)"  # with its kind
    # Asked for as a whole in words (an agent tester's `where is Console defined`: no lookup, not in the top 10).
    for text in ("where is the Circle class defined?", "definition of Circle", "what is Circle"):
        asked = await _ask(client, text)
        assert (_names(asked)[0], asked.meta.exact_symbol_matches) == ("shapes.circle.Circle (type)", 1), text
    assert circle.results[0].score == 1.0
    assert circle.meta.exact_symbol_matches == 1
    assert SYMBOL in {f.retriever for f in circle.results[0].found_by}
    assert "exactSymbol" in circle.meta.timings_ms
    assert not circle.meta.degraded

    # Qualified, partly qualified, or written as other languages write members: the method.
    for text in ("shapes.circle.Circle.area", "Circle.area", "Circle::area", "`Circle.area()`", "def Circle.area"):
        assert _names(await _ask(client, text))[0] == "shapes.circle.Circle.area (method)", text
    # By the name its package publishes it under: without the private module; re-exported from a public one (a
    # tester's click.Option for click.core.Option).
    published = await _ask(client, "shapes.Outline")
    assert (_names(published)[0], published.meta.exact_symbol_matches) == ("shapes._base.Outline (type)", 1)
    exported = await _ask(client, "shapes.Circle")
    assert (_names(exported)[0], exported.meta.exact_symbol_matches) == ("shapes.circle.Circle (type)", 1)
    # A bare name: what the package publishes before a method of that name (an agent tester's `sleep`).
    paused = await _ask(client, "pause")
    assert _names(paused)[:2] == ["shapes.timing.pause (method)", "shapes.backends.Backend.pause (method)"]
    assert "defines the name asked, published as shapes.pause\n" in render(paused)  # why it came first
    # And its relations by that name (a tester's callers of click.echo: "no symbol named ... is indexed").
    assert _names(await _ask(client, "what calls shapes.Circle"))[0] == "shapes.report.round_one (method)"
    assert _names(await _ask(client, "what subclasses shapes.Circle"))[0] == "shapes.report.Ring (type)"
    # A member by its class's published name (a tester's click.Group.command "not indexed").
    member = await _ask(client, "shapes.Circle.area")
    assert (_names(member)[0], member.meta.exact_symbol_matches) == ("shapes.circle.Circle.area (method)", 1)
    # By a name bound to it, and by a name a module takes with `*` (an agent tester's attr.s and
    # attrs.validators.instance_of: "no chunk defining a symbol named ... is indexed").
    bound = await _ask(client, "shapes.Round")
    assert (_names(bound)[0], bound.meta.exact_symbol_matches) == ("shapes.circle.Circle (type)", 1)
    starred = await _ask(client, "shapes.everything.area")
    assert (_names(starred)[0], starred.meta.exact_symbol_matches) == ("shapes.square.area (method)", 1)
    # A private class's member is no name its module publishes (the same tester's jinja2.ext.gettext, answered at
    # 1.0 by jinja2.ext._TranslationsBasic.gettext); as written it is found.
    assert (await _ask(client, "shapes.pens.width")).meta.exact_symbol_matches == 0
    as_written = await _ask(client, "_Pen.width")
    assert (_names(as_written)[0], as_written.meta.exact_symbol_matches) == ("shapes.pens._Pen.width (method)", 1)
    unused = await _ask(client, "who calls shapes.Circle.area")
    assert unused.meta.relation == RelationAsked(relation="callers", symbol="shapes.Circle.area", symbol_indexed=True)
    # A module's constant and a class's attribute, which have no chunk of their own: the chunk assigning them (an
    # agent tester's DEFAULT_TIMEOUT_CONFIG), by the name alone or under its module's or class's.
    # With the line assigning it (an agent tester's FILTERS: a module of 1,873 lines, cut before its line).
    for text in ("UNIT", "square.UNIT", "shapes.square.UNIT", "shapes.UNIT"):
        constant = await _ask(client, text)
        assert (_names(constant)[0], constant.meta.exact_symbol_matches) == ("shapes.square (file)", 1), text
        assert constant.results[0].assigned_at_line == 2, text
        assert "defines the name asked · assigns it at line 2\n" in render(constant)
    for text in ("stroke", "Outline.stroke", "shapes.Outline.stroke"):
        attribute = await _ask(client, text)
        assert _names(attribute)[0] == "shapes._base.Outline (type)", text
        assert attribute.results[0].assigned_at_line == 3, text
    assert circle.results[0].assigned_at_line is None  # a class's own chunk: its lines say where it is
    # Published under another name: its module, and no line of a class's attribute of that name (line 3).
    renamed = await _ask(client, "shapes.stroke")
    assert (_names(renamed)[0], renamed.meta.exact_symbol_matches) == ("shapes._base (file)", 1)
    assert renamed.results[0].assigned_at_line is None
    assert (await _ask(client, "circle.UNIT")).meta.exact_symbol_matches == 0  # another module's name
    # A review's: a misspelt module before an assigned name is no known symbol.
    misspelt = await _ask(client, "what calls nosuchmodule.UNIT")
    assert misspelt.meta.relation is not None
    assert not misspelt.meta.relation.symbol_indexed
    # A name two symbols share: both first, the shorter name leading when nothing else tells them apart.
    area = await _ask(client, "area")
    assert set(_names(area)[:2]) == {"shapes.circle.Circle.area (method)", "shapes.square.area (method)"}
    assert area.meta.exact_symbol_matches == 2
    # Case: the module circle matches as written, so the class Circle, which matches only ignoring case, is not
    # placed first; a name no symbol is written as matches ignoring case.
    lower = await _ask(client, "circle")
    assert (_names(lower)[0], lower.meta.exact_symbol_matches) == ("shapes.circle (file)", 1)
    upper = await _ask(client, "CIRCLE", options={"collapseNested": False})  # else the module holds the class
    assert set(_names(upper)[:2]) == {"shapes.circle (file)", "shapes.circle.Circle (type)"}
    # The request's filters hold: a class is no method.
    methods = await _ask(client, "Circle", chunkLevel="method")
    assert "shapes.circle.Circle (type)" not in _names(methods)
    assert methods.meta.exact_symbol_matches == 0
    # The function volume before its module shapes.volume, which would otherwise hold (and hide) it; counted in the
    # answer, after the module is collapsed into the function.
    volume = await _ask(client, "volume")
    assert _names(volume)[0] == "shapes.volume.volume (method)"
    assert volume.meta.exact_symbol_matches == 1
    # A question is not a name, and the option turns the match off.
    other = await _ask(client, "which shape is round")
    assert (other.meta.exact_symbol_matches, other.meta.relation_matches, other.meta.relation) == (0, 0, None)
    assert circle.meta.relation is None  # a name is no relation
    off = await _ask(client, "Circle", options={"exactSymbols": False})
    assert off.meta.exact_symbol_matches == 0
    assert all(SYMBOL not in {f.retriever for f in r.found_by} for r in off.results)
    assert "exactSymbol" not in off.meta.timings_ms

    # Callers, from what the ingester read of the code: the chunks calling the symbol first, scoring 1.
    circle_callers = await _ask(client, "what calls Circle?")
    assert _names(circle_callers)[0] == "shapes.report.round_one (method)"
    assert circle_callers.results[0].score == 1.0
    assert CALLER in {f.retriever for f in circle_callers.results[0].found_by}
    assert (circle_callers.meta.relation_matches, circle_callers.meta.exact_symbol_matches) == (1, 0)
    assert circle_callers.meta.relation == RelationAsked(relation="callers", symbol="Circle", symbol_indexed=True)
    # A class's constructor is called by calling the class (an agent tester's callers of Console.__init__: none).
    for text in ("what calls Circle.__init__", "what calls shapes.Circle.__init__"):  # by its published name too
        made = await _ask(client, text)
        assert (_names(made)[0], made.meta.relation_matches) == ("shapes.report.round_one (method)", 1), text
        assert made.meta.relation is not None
        assert made.meta.relation.symbol_indexed, text
    # The class as asked, not the base whose constructor it inherits (a review's: Base(...)'s callers), and no
    # second symbol said to be named so.
    inherited = await _ask(client, "what calls Sub.__init__")
    callers = {r.metadata["symbolFqn"] for r in inherited.results if CALLER in {f.retriever for f in r.found_by}}
    assert "shapes.makers.make_sub" in callers
    assert not {"shapes.makers.make_base", "shapes.makers.Other.__init__"} & callers, callers  # the base's
    assert inherited.meta.relation is not None
    assert inherited.meta.relation.symbols_named is None
    # A subclass that defines no constructor runs the base's: calling it calls the base's constructor (a tester's
    # callers of h11's ProtocolError.__init__ were none); one that defines its own runs that one.
    based = await _ask(client, "what calls Base.__init__", topK=20)
    callers = {r.metadata["symbolFqn"] for r in based.results if CALLER in {f.retriever for f in r.found_by}}
    assert {"shapes.makers.make_base", "shapes.makers.make_sub", "shapes.makers.Other.__init__"} <= callers, callers
    assert "shapes.makers.make_other" not in callers
    assert "shapes.makers.make_mixed" not in callers  # Mixin's constructor comes first (a review's)
    # A name two symbols share: the callers of either; a qualified name: of that one only (Circle.area has none).
    shared = await _ask(client, "callers of area")
    assert _names(shared)[0] == "shapes.report.describe (method)"
    # Said so (an agent tester's callers of three get_command, merged unsaid); a qualified name names one.
    assert shared.meta.relation is not None
    assert shared.meta.relation.symbols_named == ["shapes.circle.Circle.area", "shapes.square.area"]
    assert "'area' names more than one symbol (shapes.circle.Circle.area, shapes.square.area)" in render(shared)
    assert circle_callers.meta.relation.symbols_named is None
    # Callers found say what they may miss (an agent tester read a lone caller as the whole list).
    assert f"callers are read from the code's syntax ({CALLS_READ})" in render(circle_callers)
    assert _names(await _ask(client, "where is square.area used"))[0] == "shapes.report.describe (method)"
    uncalled = await _ask(client, "who calls Circle.area")
    assert (uncalled.meta.relation_matches, uncalled.meta.relation) == (
        0,
        RelationAsked(relation="callers", symbol="Circle.area", symbol_indexed=True),
    )
    # A name a module assigns is a symbol as written: its callers, not those of a class matching it ignoring case.
    for text in ("what calls concat", "what calls shapes.strings.concat"):
        joined = await _ask(client, text)
        found = _found_by(joined, CALLER)
        assert found == ["shapes.writer.joined"], (text, found)
    assert _names(await _ask(client, "what calls Concat"))[0] == "shapes.writer.node (method)"
    called = await _ask(client, "what does shapes.writer.joined call")  # the module assigning it (a review's)
    assert _found_by(called, CALLEE) == ["shapes.strings"]
    # A name nothing defines is told apart from a symbol nothing calls: a misspelling, not an answer.
    misspelt = await _ask(client, "who calls Circel")
    assert (misspelt.meta.relation_matches, misspelt.meta.relation) == (
        0,
        RelationAsked(relation="callers", symbol="Circel", symbol_indexed=False),
    )
    assert misspelt.results
    assert not misspelt.meta.degraded
    # The request's filters select callers (a function is no class); the option turns the lookup off.
    assert (await _ask(client, "what calls Circle", chunkLevel="type")).meta.relation_matches == 0
    unasked = await _ask(client, "what calls Circle", options={"exactSymbols": False})
    assert (unasked.meta.relation_matches, unasked.meta.relation) == (0, None)
    assert all(CALLER not in {f.retriever for f in r.found_by} for r in unasked.results)

    # Subclasses and importers, from the graph, by the chunk that defines each: the class's, the module's file.
    ring = await _ask(client, "what subclasses Circle")
    assert (_names(ring)[0], ring.meta.relation_matches) == ("shapes.report.Ring (type)", 1)
    assert SUBCLASS in {f.retriever for f in ring.results[0].found_by}
    assert "read from the code's syntax" not in render(ring)  # the graph's links: all there are
    importers = await _ask(client, "which modules import shapes.circle?")
    assert set(_names(importers)[:2]) == {"shapes (file)", "shapes.report (file)"}
    assert (importers.meta.relation_matches, importers.meta.relation_found) == (2, 2)
    # Fewer shown than found: the answer says how many there are (an agent tester's "3 of 13").
    one = await _ask(client, "which modules import shapes.circle?", topK=1)
    assert (one.meta.relation_matches, one.meta.relation_found) == (1, 2)
    assert "1 of the 2 chunks standing in relation 'importers' to 'shapes.circle' shown" in render(one)
    assert all(IMPORTER in {f.retriever for f in r.found_by} for r in importers.results[:2])
    filtered = await _ask(client, "what imports square", chunkLevel="type")
    # The filter selects no importer (a module is no type) and hides the module square itself: it is still known.
    assert (filtered.meta.relation_matches, filtered.meta.relation) == (
        0,
        RelationAsked(relation="importers", symbol="square", symbol_indexed=True),
    )

    # Asked by structure rather than in words: no text needed, and the option for names does not turn it off.
    structured = await client.query(
        "shapes",
        {"relatedTo": {"relation": "callers", "symbol": "Circle"}, "topK": 5, "options": {"exactSymbols": False}},
    )
    assert isinstance(structured, QueryResponse), structured
    assert (_names(structured)[0], structured.meta.relation_matches) == ("shapes.report.round_one (method)", 1)
    bases = await _ask(client, "a round shape", relatedTo={"relation": "bases", "symbol": "shapes.report.Ring"})
    assert (_names(bases)[0], bases.meta.relation_matches) == ("shapes.circle.Circle (type)", 1)
    unknown = await _ask(client, "a round shape", relatedTo={"relation": "subclasses", "symbol": "Elipse"})
    assert unknown.meta.relation == RelationAsked(relation="subclasses", symbol="Elipse", symbol_indexed=False)
    # A function has no subclasses, but it is indexed.
    none = await _ask(client, "a round shape", relatedTo={"relation": "subclasses", "symbol": "describe"})
    assert none.meta.relation == RelationAsked(relation="subclasses", symbol="describe", symbol_indexed=True)
    # A type the graph names is known although no chunk defines it (an ingester's node without a chunk).
    ghost = await deployment.publisher.publish(
        envelope("shapes", NodeUpserted(node=OntologyNode(domain="shapes.ghost", name="Ghost", kind="class")))
    )
    await deployment.wait_projected(ghost.seq)
    for _ in range(50):  # until the worker has the version announced
        known = await _ask(client, "a round shape", relatedTo={"relation": "subclasses", "symbol": "Ghost"})
        if known.meta.relation is not None and known.meta.relation.symbol_indexed:
            break
        await asyncio.sleep(0.1)
    assert known.meta.relation == RelationAsked(relation="subclasses", symbol="Ghost", symbol_indexed=True)

    # The other direction: what a function calls, what a class derives from, what a module imports.
    called = await _ask(client, "what does describe call?")
    assert (_names(called)[0], called.meta.relation_matches) == ("shapes.square.area (method)", 1)
    assert CALLEE in {f.retriever for f in called.results[0].found_by}
    bases = await _ask(client, "what does Ring inherit from")
    assert (_names(bases)[0], bases.meta.relation_matches) == ("shapes.circle.Circle (type)", 1)
    assert BASE in {f.retriever for f in bases.results[0].found_by}
    imported = await _ask(client, "what does shapes.report import")
    assert set(_names(imported)[:3]) == {"shapes (file)", "shapes.circle (file)", "shapes.square (file)"}
    assert imported.meta.relation_matches == 3
    assert all(IMPORTED in {f.retriever for f in r.found_by} for r in imported.results[:3])


RETRYING = {
    "__init__.py": """
        class BaseRetrying:
            def copy(self):
                return type(self)()


        class Retrying(BaseRetrying):
            def again(self):
                return self.copy()


        def fresh(retrying: Retrying):
            return BaseRetrying.copy(retrying)
        """,
}


async def test_a_files_path_finds_that_file_first_through_the_real_path(
    deployment: Deployment, projector: ProjectorService, embedder: Embedder, start_query_worker: Start, tmp_path: Path
) -> None:
    # An agent tester's `rich/console.py` found no chunk of that file first. The tree is ingested from inside the
    # package, so its paths are `circle.py`, `sub/circle.py`: what an agent writes has more in front, or less.
    files = {
        **SHAPES,
        "sub/__init__.py": "",
        "sub/circle.py": "def circle(radius):\n    return radius\n",
        "docs/guide.md": "# Guide\n\nWhat the shapes are.\n\n## Drawing\n\nHow to draw a circle.\n",
        "docs/README.md": "# Docs\n\nWhere the guides are.\n",
        "blog/guide.md": "# Blog guide\n\nWhat was written.\n",
        "notes.md": "# Notes\n\nThe root's.\n",
        "blog/docs/notes.md": "# Blog notes\n\nThe blog's docs.\n",
        "README.md": "# Shapes\n\nA package of shapes.\n",
        # Three methods of one name in one file: a frame names one of them by the line.
        "many.py": "class A:\n    def __init__(self):\n        self.a = 1\n\n\n"
        "class B:\n    def __init__(self):\n        self.b = 2\n\n\n"
        "class C:\n    def __init__(self):\n        self.c = 3\n",
    }
    client = await _served(deployment, embedder, start_query_worker, tmp_path / "shapes", files, "shapes")

    def found(reply: QueryResponse) -> list[str]:
        return [str(r.metadata.get("symbolFqn")) for r in reply.results if FILE in {f.retriever for f in r.found_by}]

    for text, first in [
        ("shapes/circle.py", "shapes.circle"),  # asked from the package's parent: the path ends with the stored one
        ("circle.py", "shapes.circle"),  # as stored, before `sub/circle.py`, which ends with it
        ("`./sub/circle.py`", "shapes.sub.circle"),
        ("/home/someone/checkout/shapes/sub/circle.py", "shapes.sub.circle"),  # the longer stored path first
        ("shapes\\__init__.py", "shapes"),
    ]:
        reply = await _ask(client, text)
        assert reply.results[0].metadata.get("symbolFqn") == first, (text, _names(reply))
        assert (reply.results[0].score, reply.meta.exact_symbol_matches) == (1.0, len(found(reply))), text
        assert reply.results[0].metadata.get("chunkLevel") == "file", text  # the module's chunk: the whole file
    assert found(await _ask(client, "shapes/circle.py")) == ["shapes.circle"]  # not the other one ending so

    # A line, or a traceback's frame: the chunks holding the line, the innermost first; the function it names
    # first, wherever the file indexed has it (another version of the file); then the file.
    area_line = 6  # `return 3.14159 * radius * radius` in circle.py, inside Circle.area inside Circle
    expected = ["shapes.circle.Circle.area", "shapes.circle.Circle", "shapes.circle"]
    assert found(await _ask(client, f"shapes/circle.py:{area_line}")) == expected
    assert found(await _ask(client, f'File "/srv/app/shapes/circle.py", line {area_line}, in area')) == expected
    drifted = await _ask(client, 'File "/srv/app/shapes/circle.py", line 1, in area')
    assert found(drifted)[0] == "shapes.circle.Circle.area"
    assert found(await _ask(client, "circle.py:1")) == ["shapes.circle"]  # in no class or function: the file
    # Of the functions a frame names, the one holding its line; none holds it: the nearest alone (a review's: all
    # three __init__ came first).
    for text in ('File "/Users/John Doe/shapes/many.py", line 8, in __init__', "many.py:8"):
        assert found(await _ask(client, text)) == ["shapes.many.B.__init__", "shapes.many.B", "shapes.many"], text
    assert found(await _ask(client, 'File "many.py", line 4, in __init__'))[:1] == ["shapes.many.A.__init__"]
    assert found(await _ask(client, 'File "many.py", line 4, in __init__')).count("shapes.many.B.__init__") == 0

    # One file: the one the path names, not another whose path it ends with (a review's: the root README too).
    assert found(await _ask(client, "docs/README.md")) == ["docs/README.md > Docs"]
    assert found(await _ask(client, "/home/me/shapes/docs/README.md")) == ["docs/README.md > Docs"]
    assert found(await _ask(client, "README.md")) == ["README.md > Shapes"]

    # A document's sections, in their order; a shorter path than the stored ones finds every file ending so.
    guide = ["docs/guide.md > Guide", "docs/guide.md > Guide > Drawing"]
    assert found(await _ask(client, "docs/guide.md")) == guide
    assert found(await _ask(client, "guide.md")) == ["blog/guide.md > Blog guide", *guide]
    # A stored path ending with all that is asked before one the asked path ends with (a third review's: the root
    # notes.md alone answered docs/notes.md).
    assert found(await _ask(client, "docs/notes.md")) == ["blog/docs/notes.md > Blog notes"]
    assert found(await _ask(client, "notes.md")) == ["notes.md > Notes"]

    # No such file: nothing placed first, and the MCP text says so rather than showing search results as the file.
    missing = await _ask(client, "shapes/missing.py")
    assert (found(missing), missing.meta.exact_symbol_matches) == ([], 0)
    assert "exactFile" in missing.meta.timings_ms  # what the note is said from: a worker that looked the file up
    assert any("no file at a path 'shapes/missing.py'" in note for note in answer_notes(missing, {
        "semanticQuery": "shapes/missing.py"
    }))  # fmt: skip
    # A filter leaving out the file's chunks: said as such, not as no file.
    methods = await _ask(client, "shapes/circle.py", chunkLevel="method")
    notes = answer_notes(methods, {"semanticQuery": "shapes/circle.py", "chunkLevel": "method"})
    assert any("with chunks within the filters" in note for note in notes), notes


async def test_a_member_a_class_inherits_is_found_through_its_base(
    deployment: Deployment, projector: ProjectorService, embedder: Embedder, start_query_worker: Start, tmp_path: Path
) -> None:
    """An outside tester's: "callers of Retrying.copy", the tool description's own example, was told no symbol of
    that name is indexed, as tenacity's Retrying inherits copy from BaseRetrying."""
    client = await _served(deployment, embedder, start_query_worker, tmp_path / "retrying", RETRYING, "retrying")

    async def ask(text: str, **params: object) -> QueryResponse:
        return await _ask(client, text, "retrying", **params)

    named = await ask("Retrying.copy")
    assert named.results[0].metadata.get("symbolFqn") == "retrying.BaseRetrying.copy"
    assert named.meta.exact_symbol_matches == 1
    by_structure = {"relatedTo": {"relation": "callers", "symbol": "Retrying.copy"}}
    for callers in (await ask("callers of Retrying.copy"), await ask("a copy", **by_structure)):
        found = {r.metadata.get("symbolFqn") for r in callers.results if CALLER in {f.retriever for f in r.found_by}}
        assert found == {"retrying.Retrying.again", "retrying.fresh"}
        assert callers.meta.relation is not None
        assert callers.meta.relation.symbol_indexed
    # A member neither the class nor a base defines is no symbol.
    missing = await ask("who calls Retrying.paste")
    assert missing.meta.relation is not None
    assert not missing.meta.relation.symbol_indexed


ERRORS = {
    "server.py": """
        import logging

        logger = logging.getLogger(__name__)


        class Protocol:
            def send(self, message):
                message_type = message["type"]
                if message_type != "http.response.start":
                    raise RuntimeError(f"Expected ASGI message 'http.response.start', but got {message_type!r}.")

            def start(self, port):
                logger.info("Started server process [%d] on port %s", 1, port)


        def connect(host, retries):
            if retries < 0:
                raise ValueError("retries must be a positive number, got {}".format(retries))
            if not host:
                raise Unreachable(host)
            return host


        class Unreachable(Exception):
            pass
        """,
    # Every word of the messages, many times over: what keyword search alone ranks first.
    "notes.py": '''
        def explain(message, server, process, port):
            """Expected message types, the ASGI message the server process got, a message and a port and a
            positive number of retries: each message is expected, started, and got; a message, a message."""
            return [message, "expected", "ASGI message", "got", "but got", "message type", "server process",
                    "started", "port", "positive number", "retries", "http.response.start", "message", "message"]
        ''',
}


async def test_a_pasted_message_finds_the_code_writing_it_through_the_real_path(
    deployment: Deployment, projector: ProjectorService, embedder: Embedder, start_query_worker: Start, tmp_path: Path
) -> None:
    """An agent pastes what the program printed; the code holds it as a template whose fields the run filled."""
    client = await _served(deployment, embedder, start_query_worker, tmp_path / "errors", ERRORS, "errors")

    async def ask(text: str, **params: object) -> QueryResponse:
        return await _ask(client, text, "errors", **params)

    def placed(reply: QueryResponse) -> list[str]:
        return [str(r.metadata.get("symbolFqn")) for r in reply.results if MESSAGE in {f.retriever for f in r.found_by}]

    for text, writer in [
        ("RuntimeError: Expected ASGI message 'http.response.start', but got 'http.response.body'.", "send"),
        ("INFO:     Started server process [4242] on port 8000", "start"),
        (
            'Traceback (most recent call last):\n  File "/srv/app/errors/server.py", line 20, in connect\n'
            "    raise ValueError(...)\nValueError: retries must be a positive number, got -1",
            "connect",
        ),
    ]:
        reply = await ask(text)
        fqn = "errors.server.connect" if writer == "connect" else f"errors.server.Protocol.{writer}"
        # The method alone: its class and module hold the same literal, and go into it.
        assert placed(reply) == [fqn], (text, _names(reply))
        assert (reply.results[0].score, reply.meta.exact_symbol_matches) == (1.0, 1), text
        assert "exactMessage" in reply.meta.timings_ms
        assert "writes the message asked" in render(reply), text
    # What raises an exception: what calls its class, said so in the text.
    raisers = await ask("where is Unreachable raised?")
    assert [r.metadata.get("symbolFqn") for r in raisers.results][:1] == ["errors.server.connect"]
    assert raisers.meta.relation is not None
    assert raisers.meta.relation.relation == "callers"
    notes = answer_notes(raisers, {"semanticQuery": "where is Unreachable raised?"})
    assert any("is read as what calls it" in note for note in notes), notes
    # A question about the message, a message no code writes, or the lookups turned off: nothing placed first.
    for text, params in [
        ("why do I get Expected ASGI message 'http.response.start'?", {}),
        ("RuntimeError: Expected a websocket frame from the server process", {}),
        ("why do I get RuntimeError: Expected ASGI message 'http.response.start', but got 'x'.", {}),
        (
            "RuntimeError: Expected ASGI message 'http.response.start', but got 'x'.",
            {"options": {"exactSymbols": False}},
        ),
    ]:
        reply = await ask(text, **params)
        assert (placed(reply), reply.meta.exact_symbol_matches) == ([], 0), (text, _names(reply))


async def test_a_pasted_message_is_read_within_a_budget_of_cpu_not_of_wall_time(
    deployment: Deployment,
    projector: ProjectorService,
    embedder: Embedder,
    start_query_worker: Start,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flake hunter's: the read of the candidates' literals stopped at 100 ms of wall time, so a loaded host (the
    thread waiting for a core) left the writer unread when others came first. Here the first chunk read stalls the
    thread for longer than the budget, without spending it: the others are read all the same."""
    await _projected(deployment, embedder, tmp_path / "errors", ERRORS, "errors")
    await start_query_worker(embedder, query_cache_entries=0)
    read = pipeline_module.written_by
    names_read: list[str] = []

    def stalling(message: str, source: str, name: str = "", until: float | None = None) -> float:
        if not names_read:
            time.sleep(1.5 * pipeline_module.MESSAGE_READ_S)  # waiting, as for a core: no CPU spent
        names_read.append(name)
        return read(message, source, name, until)

    monkeypatch.setattr(pipeline_module, "written_by", stalling)
    text = "RuntimeError: Expected ASGI message 'http.response.start', but got 'http.response.body'."
    reply = await _ask(QueryClient(deployment.nc, deployment.names), text, "errors")
    assert {"errors.notes.explain", "errors.server.Protocol.send"} <= set(names_read)
    writers = [str(r.metadata.get("symbolFqn")) for r in reply.results if MESSAGE in {f.retriever for f in r.found_by}]
    assert writers == ["errors.server.Protocol.send"], _names(reply)


async def test_a_relation_shows_as_many_as_the_largest_top_k_asks(
    deployment: Deployment, projector: ProjectorService, embedder: Embedder, start_query_worker: Start, tmp_path: Path
) -> None:
    """The contract says a larger topK shows more of a relation; a graph tester's 200 importers stopped at 50, all
    a lookup read, under topK 100."""
    files = {"__init__.py": "", "target.py": "def target():\n    return 1\n"}
    files |= {
        f"user{i:02}.py": f"from .target import target\n\n\ndef use{i:02}():\n    return target()\n" for i in range(70)
    }
    client = await _served(deployment, embedder, start_query_worker, tmp_path / "many", files, "many")
    asked = await _ask(client, "what calls target", workspace="many", topK=100, maxTokens=100_000)
    callers = {r.metadata["symbolFqn"] for r in asked.results if CALLER in {f.retriever for f in r.found_by}}
    assert asked.meta.relation_found == 70
    assert callers == {f"many.user{i:02}.use{i:02}" for i in range(70)}


async def test_a_relation_reads_past_the_nearest_types_that_have_no_chunk_within_the_filters(
    deployment: Deployment, projector: ProjectorService, embedder: Embedder, start_query_worker: Start, tmp_path: Path
) -> None:
    """A fault tester's: only the nearest 100 types were read, so types without a chunk (there, or within the
    request's paths) took every place and a subclass further away was not found."""
    near = "from .base import Base\n" + "".join(f"\n\nclass Near{i:03}(Base):\n    pass\n" for i in range(110))
    files = {
        "__init__.py": "",
        "base.py": "class Base:\n    pass\n",
        "near.py": near,
        "deep/__init__.py": "",
        "deep/far.py": "from ..near import Near000\n\n\nclass Far(Near000):\n    pass\n",
    }
    client = await _served(deployment, embedder, start_query_worker, tmp_path / "chain", files, "chain")
    asked = await _ask(
        client, "x", workspace="chain", relatedTo={"relation": "subclasses", "symbol": "Base"}, paths=["deep/*"]
    )
    assert _found_by(asked, SUBCLASS) == ["chain.deep.far.Far"]
    assert asked.meta.relation_found == 1
    # Unfiltered, the nearest hundred are the direct subclasses, the farther one past them.
    every = await _ask(
        client, "x", workspace="chain", relatedTo={"relation": "subclasses", "symbol": "Base"}, topK=100,
        maxTokens=100_000,
    )  # fmt: skip
    assert every.meta.relation_found == 100
    assert "chain.deep.far.Far" not in _found_by(every, SUBCLASS)


async def test_code_other_than_python_is_found_by_its_names_and_paths_through_the_real_path(
    deployment: Deployment, projector: ProjectorService, embedder: Embedder, start_query_worker: Start, tmp_path: Path
) -> None:
    """A monorepo tester's 12 questions about Go, TypeScript, YAML and SQL found nothing: none of it was read."""
    files = {
        # An index file, imported by its directory (an agent tester's importers of src.http were "not indexed").
        "web/src/http/index.ts": "export function retry() { return 1; }\n",
        "web/src/http/client.ts": "import { retry } from '.';\nexport function get() { return retry(); }\n",
        "web/src/pages/Orders.tsx": "import { retry } from '../http';\nexport function Orders() { return retry(); }\n",
        # A file named as a directory's index beside it is what its name asks (a review's: the index was taken).
        "web/src/net.ts": "export function dial() { return 1; }\n",
        "web/src/net/index.ts": "export function listen() { return 2; }\n",
        "web/src/pages/Dial.tsx": "import { dial } from '../net';\nexport function Dial() { return dial(); }\n",
        "web/src/pages/Listen.tsx": "import { listen } from '../net/index';\n"
        "export function Listen() { return listen(); }\n",
        "web/src/hooks/useCurrentUser.ts": """
            /** The signed-in user, fetched once and kept. */
            export function useCurrentUser() {
              return useQuery(["me"], () => apiFetch("/me"));
            }
            """,
        "services/api/auth/middleware.go": """
            package auth

            // RequireJWT rejects a request without a valid bearer token.
            func RequireJWT(next http.Handler) http.Handler {
            \treturn next
            }
            """,
        "migrations/0003_invoices_paid_at.sql": "ALTER TABLE invoices ADD COLUMN paid_at timestamptz;\n",
        "app.py": "def main():\n    return 1\n",
        # Their callers, in the files' own languages (a monorepo tester heard that calls were read in Python alone).
        "web/src/pages/Profile.tsx": """
            import { useCurrentUser } from '../hooks/useCurrentUser';

            export function Profile() {
              const user = useCurrentUser();
              return user.name;
            }
            """,
        "services/api/router.go": """
            package api

            import "example.com/mono/services/api/auth"

            func Routes(h http.Handler) http.Handler {
            \treturn auth.RequireJWT(h)
            }
            """,
        # A Go interface, satisfied without saying so, and called through (an agent tester's were neither).
        "services/api/auth/verify.go": "package auth\n\ntype Verifier interface {\n\tVerify(t string) bool\n}\n\n"
        'type JWT struct{}\n\nfunc (j JWT) Verify(t string) bool { return t != "" }\n\n'
        'func Check(v Verifier) bool { return v.Verify("t") }\n',
        "billing/src/com/acme/Ledger.java": "package com.acme;\n\npublic abstract class Ledger {}\n",
        "billing/src/com/acme/InvoiceLedger.java": "package com.acme;\n\nclass InvoiceLedger extends Ledger {}\n",
        # A field named as the method the caller calls: the class is no callee (a retest's JavaFile.emit).
        "billing/src/com/acme/Rates.java": "package com.acme;\n\nclass Rates {\n  double rate;\n"
        "  double rate() { return rate; }\n}\n",
        "billing/src/com/acme/Billing.java": "package com.acme;\n\nclass Billing {\n"
        "  double charge(Rates rates) { return rates.rate(); }\n}\n",
        "billing/src/com/acme/audit/Audit.java": "package com.acme.audit;\n\nimport com.acme.Ledger;\n\n"
        "class Audit {\n  Ledger ledger;\n}\n",
        # A Rust crate: its trait implemented, its modules asked by their paths in the crate (agent testers').
        "limits/Cargo.toml": '[package]\nname = "throttle"\n',
        "limits/src/lib.rs": "pub mod bucket;\npub mod clock;\n\npub fn bucket() {}\n",
        "limits/src/bucket/mod.rs": "use crate::clock::Clock;\n\npub struct Bucket;\n",
        "limits/src/clock.rs": "pub trait Clock {}\n\npub struct System;\n\nimpl Clock for System {}\n",
    }
    client = await _served(deployment, embedder, start_query_worker, tmp_path / "mono", files, "mono")
    found = await _ask(client, "useCurrentUser", "mono")
    assert _names(found)[0] == "web.src.hooks.useCurrentUser.useCurrentUser (method)"
    assert (found.results[0].metadata["startLine"], found.results[0].metadata["endLine"]) == (2, 5)
    assert _names(await _ask(client, "RequireJWT", "mono"))[0] == "services.api.auth.middleware.RequireJWT (method)"
    # By its Go package's name: a retest's package names were made, then lost on the way to the index.
    by_package = await _ask(client, "auth.RequireJWT", "mono")
    assert _names(by_package)[0] == "services.api.auth.middleware.RequireJWT (method)"
    assert by_package.results[0].metadata["aliases"] == ["auth.RequireJWT"]
    by_path = await _ask(client, "services/api/auth/middleware.go", "mono")
    assert by_path.results[0].metadata["filePath"] == "services/api/auth/middleware.go"
    for question, caller in (
        ("what calls useCurrentUser", "web.src.pages.Profile.Profile"),
        ("who calls auth.RequireJWT", "services.api.router.Routes"),
    ):
        asked = await _ask(client, question, "mono")
        callers = _found_by(asked, CALLER)
        assert callers == [caller], (question, _names(asked))
        assert f"callers are read from the code's syntax ({CALLS_READ})" in render(asked)
    # And the graph: a Java class's subclasses, a TypeScript module's importers.
    subclasses = await _ask(client, "what subclasses Ledger", "mono")
    assert _found_by(subclasses, SUBCLASS) == ["billing.src.com.acme.InvoiceLedger.InvoiceLedger"]
    assert "names more than one symbol" not in render(subclasses)  # Ledger.java and its class Ledger: one
    # A Java class's importers by the name its import spells (an agent tester's were none): its file's.
    for question in ("what imports com.acme.Ledger", "what imports Ledger"):
        java_importers = await _ask(client, question, "mono")
        assert _found_by(java_importers, IMPORTER, "filePath") == ["billing/src/com/acme/audit/Audit.java"], question
    net_importers = await _ask(client, "what imports web.src.net", "mono")
    assert _found_by(net_importers, IMPORTER, "filePath") == ["web/src/pages/Dial.tsx"]
    http_importers = await _ask(client, "what imports web.src.http", "mono")
    assert "web/src/pages/Orders.tsx" in _found_by(http_importers, IMPORTER, "filePath")
    assert _names(await _ask(client, "web.src.http.retry", "mono"))[0] == "web.src.http.index.retry (method)"
    importers = await _ask(client, "what imports web.src.hooks.useCurrentUser", "mono")
    assert _found_by(importers, IMPORTER, "filePath") == ["web/src/pages/Profile.tsx"]
    # A Go package of no file named as it is, by its directory and its name (a retest's were "not indexed").
    for question in ("what imports services.api.auth", "what imports auth"):
        auth_importers = await _ask(client, question, "mono")
        assert _found_by(auth_importers, IMPORTER, "filePath") == ["services/api/router.go"], question
    go_implementing = await _ask(client, "what implements auth.Verifier", "mono")
    assert _found_by(go_implementing, SUBCLASS) == ["services.api.auth.verify.JWT"]
    go_callers = await _ask(client, "what calls Verifier.Verify", "mono")
    assert _found_by(go_callers, CALLER) == ["services.api.auth.verify.Check"]
    for question in ("what implements crate::clock::Clock", "what implements throttle::clock::Clock"):
        implementing = await _ask(client, question, "mono")
        assert _found_by(implementing, SUBCLASS) == ["limits.src.clock.System"], question
    for question in ("what imports crate::clock", "what imports throttle::clock", "what imports limits/src/clock.rs"):
        clock_importers = await _ask(client, question, "mono")
        assert "limits/src/bucket/mod.rs" in _found_by(clock_importers, IMPORTER, "filePath"), question
    # The module, not the crate root's function of its name, where imports are asked.
    bucket_imports = await _ask(client, "what does throttle::bucket import", "mono")
    assert _found_by(bucket_imports, IMPORTED, "filePath") == ["limits/src/clock.rs"]
    charged = await _ask(client, "what does Billing.charge call", "mono")
    assert _found_by(charged, CALLEE) == ["billing.src.com.acme.Rates.Rates.rate"]
    called = await _ask(client, "what does Routes call", "mono")
    assert _found_by(called, CALLEE) == ["services.api.auth.middleware.RequireJWT"]
    migration = await _ask(client, "which migration adds the paid_at column to invoices", "mono")
    assert migration.results[0].metadata["filePath"] == "migrations/0003_invoices_paid_at.sql"


async def test_a_published_javascript_package_answers_its_relations_by_its_code_and_hyphenated_modules(
    deployment: Deployment, projector: ProjectorService, embedder: Embedder, start_query_worker: Start, tmp_path: Path
) -> None:
    """An agent tester over the MCP SDK as published (each module an `x.js` and its types' `x.d.ts`): `what
    subclasses Transport` found none of the nine classes implementing it (written in the declarations alone),
    importers were `export {};` stubs, and a module of a hyphenated file name could not be asked at all."""
    files = {
        "pkg/auth-extensions.js": "export function sign() { return 1; }\n",
        "pkg/auth-extensions.d.ts": "export declare function sign(): number;\n",
        "pkg/transport.d.ts": "export interface Transport { go(): void; }\n",
        "pkg/transport.js": "export {};\n",
        "pkg/client.js": "import { sign } from './auth-extensions.js';\nexport class Client { go() { sign(); } }\n",
        "pkg/client.d.ts": "import { Transport } from './transport.js';\n"
        "export declare class Client implements Transport { go(): void; }\n",
        "pkg/example.d.ts": "export {};\n",
        "pkg/example.js": "import { Client } from './client.js';\nnew Client().go();\n",
    }
    client = await _served(deployment, embedder, start_query_worker, tmp_path / "npm", files, "npm")
    subclasses = await _ask(client, "what subclasses Transport", "npm")
    assert _found_by(subclasses, SUBCLASS, "filePath") == ["pkg/client.js"]
    for asked in (
        await _ask(client, "what imports pkg.auth-extensions", "npm"),
        await _ask(client, "x", "npm", relatedTo={"relation": "importers", "symbol": "pkg.auth-extensions"}),
    ):
        assert asked.meta.relation is not None
        assert _found_by(asked, IMPORTER, "filePath") == ["pkg/client.js"], _names(asked)
    importers = await _ask(client, "what imports pkg.client", "npm")
    assert _found_by(importers, IMPORTER, "filePath") == ["pkg/example.js"]
    # A name's code first, its declaration second (every lookup had the `.d.ts` signature first).
    named = await _ask(client, "pkg.client.Client", "npm")
    assert [r.metadata["filePath"] for r in named.results[:2]] == ["pkg/client.js", "pkg/client.d.ts"]


async def test_a_name_in_any_script_is_found_ignoring_its_case_through_the_real_path(
    deployment: Deployment, projector: ProjectorService, embedder: Embedder, start_query_worker: Start, tmp_path: Path
) -> None:
    """A Unicode tester's ``İŞLEM``, ``ПОЛЬЗОВАТЕЛЬ`` and ``işlem`` found no definition: PostgreSQL's lower() in the
    C locale lowers ASCII alone, and callers of İŞLEM said the symbol was not indexed."""
    files = {
        "__init__.py": "",
        "turk.py": "class İşlem:\n    pass\n\n\ndef пользователь():\n    return İşlem()\n",
        "greek.py": "class Λόγος:\n    pass\n\n\nclass Straße:\n    pass\n\n\ndef build():\n    return Straße()\n",
        "dollar.js": "export function $query() { return 1; }\n",
    }
    client = await _served(deployment, embedder, start_query_worker, tmp_path / "intl", files, "intl")
    for asked, found in (
        ("İŞLEM", "intl.turk.İşlem (type)"), ("işlem", "intl.turk.İşlem (type)"),
        ("ПОЛЬЗОВАТЕЛЬ", "intl.turk.пользователь (method)"), ("intl.turk.İŞLEM", "intl.turk.İşlem (type)"),
        # Folded as the graph folds names (a retest's STRASSE was found by relation and not by name).
        ("ΛΌΓΟΣ", "intl.greek.Λόγος (type)"), ("STRASSE", "intl.greek.Straße (type)"),
        ("$query", "dollar.$query (method)"),  # a JavaScript name holding $ (a retest's could not be asked)
    ):  # fmt: skip
        reply = await _ask(client, asked, workspace="intl")
        assert (_names(reply)[0], reply.meta.exact_symbol_matches) == (found, 1), asked
    callers = await _ask(client, "x", workspace="intl", relatedTo={"relation": "callers", "symbol": "İŞLEM"})
    assert _found_by(callers, "caller") == ["intl.turk.пользователь"]
    folded = await _ask(client, "x", workspace="intl", relatedTo={"relation": "callers", "symbol": "STRASSE"})
    assert _found_by(folded, "caller") == ["intl.greek.build"]


async def test_callers_of_a_whole_dotted_name_are_its_own_alone_through_the_real_path(
    deployment: Deployment, projector: ProjectorService, embedder: Embedder, start_query_worker: Start, tmp_path: Path
) -> None:
    """A review's: callers pooled a private module's function published under the name asked with the one that is
    it (faststream.types beside faststream._internal.types), where definitions and importers no longer did."""
    files = {
        "__init__.py": "",
        "_internal/__init__.py": "",
        "_internal/types.py": "def pack():\n    return 1\n",
        "types.py": "def pack():\n    return 2\n",
        "a.py": "from ._internal.types import pack as inner\n\n\ndef use_internal():\n    return inner()\n",
        "b.py": "from .types import pack\n\n\ndef use_public():\n    return pack()\n",
    }
    client = await _served(deployment, embedder, start_query_worker, tmp_path / "fsx", files, "fsx")
    for asked in ("fsx.types.pack", "fsx.TYPES.pack"):  # as written, and ignoring case alone
        reply = await _ask(client, "x", workspace="fsx", relatedTo={"relation": "callers", "symbol": asked})
        assert _found_by(reply, "caller") == ["fsx.b.use_public"], asked
    pooled = await _ask(client, "x", workspace="fsx", relatedTo={"relation": "callers", "symbol": "types.pack"})
    assert sorted(_found_by(pooled, "caller")) == ["fsx.a.use_internal", "fsx.b.use_public"]  # a suffix: both
