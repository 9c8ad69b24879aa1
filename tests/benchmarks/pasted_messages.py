"""Measurement of pasted error messages over a code repository: an agent pastes what the program printed
(``click.exceptions.UsageError: No such option: --colour``) and asks, in effect, where it comes from.

A source tree (default: click as installed) is ingested by the reference ingester on the embedded servers. Every
``raise SomeError(<message>)`` in a function or method whose message is written in the source (a string, an
f-string, ``"...".format(...)``, ``"..." % ...``, or one of those inside a call such as ``_()``) becomes a paste:
the message as a run would print it, its fields filled with values drawn from a fixed list (a quoted name, a
number, a path, a word), after the exception's name, as Python prints the last line of a traceback. Messages whose
own words are fewer than 16 characters are left out. Each paste is asked with a request that has no options (the
default a gateway sends), topK 10, cache off, and again with ``options.exactSymbols: false`` (no lookup: what the
retrievers alone make of it), the reference in the same run, interleaved. The chunk wanted is the function or
method raising it (any of them where several raise the same message, which the fillers, drawn by the
message's own words, then fill alike). Printed: the share at rank 1, in the top 3
and in the top 10, with 95 % Wilson intervals, the latency of both, and the misses.

Run: .venv/bin/python -m tests.benchmarks.pasted_messages [--tree PATH] [--show 10] [--limit N]
"""

from __future__ import annotations

import argparse
import ast
import re
import statistics
import textwrap
import time
import zlib
from collections import Counter, defaultdict
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

from ontofabric.contracts import QueryResponse
from ontofabric.services.ingest.chunking import Chunk
from ontofabric.services.ingest.ingester import chunk_tree
from ontofabric.services.query.client import QueryClient
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import Endpoints
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names

from .exact_identifiers import ingested, on_embedded_servers, wilson

WORKSPACE = "messages"
TOP = 10
MIN_WORDS_CHARS = 16
FILLERS = ("'colour'", "42", "/srv/app/config.toml", "eggs", "'GET'", "3.5", "<Request GET /items>")
MODES: dict[str, dict[str, object]] = {"message lookup": {}, "off (reference)": {"options": {"exactSymbols": False}}}


@dataclass(frozen=True)
class Paste:
    text: str
    wanted: frozenset[str]


def _filler(key: str, index: int) -> str:
    return FILLERS[(zlib.crc32(key.encode()) + index) % len(FILLERS)]


def printed(node: ast.expr, key: str) -> tuple[str, int] | None:
    """The message a run prints for the expression, its fields filled, and the characters of its own words; None
    for a message the source does not write (a variable, a call of anything else)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value, len(node.value)
    if isinstance(node, ast.JoinedStr):
        parts, own = [], 0
        for index, value in enumerate(node.values):
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                parts.append(value.value)
                own += len(value.value)
            else:
                parts.append(_filler(key, index))
        return "".join(parts), own
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        inner = printed(node.func.value, key) if isinstance(node.func.value, ast.expr) else None
        if inner is None:
            return None
        text, _ = inner
        filled, own, index, depth = [], 0, 0, 0
        for char in text:  # each {...} field by a filler
            if char == "{":
                depth += 1
                if depth == 1:
                    filled.append(_filler(key, index))
                    index += 1
            elif char == "}":
                depth = max(0, depth - 1)
            elif depth == 0:
                filled.append(char)
                own += 1
        return "".join(filled), own
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        inner = printed(node.left, key)
        if inner is None:
            return None
        text, _ = inner
        fields = re.compile(r"%(?:\([^)]*\))?[#0\- +]*\d*(?:\.\d+)?[diouxXeEfFgGcrsa]")
        return fields.sub(lambda m: _filler(key, m.start()), text), len(fields.sub("", text))
    if isinstance(node, ast.Call) and node.args and not node.keywords and len(node.args) == 1:
        return printed(node.args[0], key)  # _("..."), gettext("...")
    return None


def pastes(chunks: list[Chunk]) -> list[Paste]:
    """A paste for each distinct message the functions and methods of the tree raise."""
    wanted: dict[str, set[str]] = defaultdict(set)
    for chunk in chunks:
        if chunk.chunk_level != "method" or chunk.symbol_kind == "docstring":
            continue
        try:
            tree = ast.parse(textwrap.dedent(chunk.content))
        except SyntaxError:
            continue
        own = _own_nodes(tree)
        for node in own:
            if not isinstance(node, ast.Raise) or not isinstance(node.exc, ast.Call) or not node.exc.args:
                continue
            name = node.exc.func
            exception = (
                name.id if isinstance(name, ast.Name) else name.attr if isinstance(name, ast.Attribute) else None
            )
            # Filled by what the template itself says, so that functions raising the same message (several
            # protocol implementations) make one paste, which any of them answers.
            template = printed(node.exc.args[0], "")
            message = printed(node.exc.args[0], template[0]) if template is not None else None
            if exception is None or message is None or message[1] < MIN_WORDS_CHARS:
                continue
            wanted[f"{exception}: {' '.join(message[0].split())}"].add(chunk.document_id)
    return [Paste(text, frozenset(ids)) for text, ids in wanted.items()]


def _own_nodes(tree: ast.Module) -> list[ast.AST]:
    """The nodes of the chunk's own function, not of functions or classes defined inside it."""
    top = tree.body[0] if tree.body else None
    found: list[ast.AST] = []
    stack: list[ast.AST] = list(ast.iter_child_nodes(top)) if top is not None else []
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


async def run(endpoints: Endpoints, settings: Settings, tree: Path, show: int, limit: int | None) -> None:
    names = Names(settings.subject_prefix)
    async with AsyncExitStack() as stack:
        served = await ingested(stack, settings, endpoints, tree, WORKSPACE)
        chunks = chunk_tree(tree, 1 << 20)  # named as the ingester names them
        asked = pastes(chunks)[:limit]
        client = QueryClient(served.nc, names, timeout_s=60)
        ranks: dict[str, list[int | None]] = defaultdict(list)
        latency: dict[str, list[float]] = defaultdict(list)
        placed: Counter[str] = Counter()
        misses: dict[str, list[str]] = defaultdict(list)
        stage: list[float] = []
        for paste in asked:
            for mode, options in MODES.items():  # interleaved, so both see the same machine
                started = time.perf_counter()
                reply = await client.query(WORKSPACE, {"semanticQuery": paste.text, "topK": TOP, **options})
                latency[mode].append((time.perf_counter() - started) * 1000)
                assert isinstance(reply, QueryResponse), reply
                if "exactMessage" in reply.meta.timings_ms:
                    stage.append(reply.meta.timings_ms["exactMessage"])
                ids = [r.id for r in reply.results]
                rank = next((i for i, doc_id in enumerate(ids, start=1) if doc_id in paste.wanted), None)
                ranks[mode].append(rank)
                placed[mode] += any(f.retriever == "message" for r in reply.results for f in r.found_by)
                if rank != 1:
                    misses[mode].append(f"{paste.text[:90]} (rank {rank})")
    total = len(asked)
    print(f"tree {tree}: {len(chunks)} chunks, {total} pasted messages, topK {TOP}, cache off")
    print("| mode | at rank 1 (95 % interval) | top 3 | top 10 | a chunk placed by the message |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        row = []
        for cut in (1, 3, 10):
            hits = sum(rank is not None and rank <= cut for rank in ranks[mode])
            low, high = wilson(hits, total)
            row.append(f"{hits} ({hits / total:.3f}, {low:.3f}-{high:.3f})")
        print(f"| {mode} | {' | '.join(row)} | {placed[mode]} |")
    for mode, times in latency.items():
        print(f"{mode}: client-side p50 {statistics.median(times):.1f} ms over {len(times)} queries")
    if stage:
        print(f"the lookup's own stage (exactMessage): p50 {statistics.median(stage):.1f} ms over {len(stage)} queries")
    for mode, texts in misses.items():
        print(f"not at rank 1 ({mode}, {len(texts)}):")
        for text in texts[:show]:
            print(f"  {text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=None, help="source tree (default: click as installed)")
    parser.add_argument("--show", type=int, default=10, help="misses listed per mode")
    parser.add_argument("--limit", type=int, default=None, help="ask at most this many pastes")
    args = parser.parse_args()
    configure_logging("WARNING", "console")
    if args.tree is None:
        import click

        args.tree = Path(click.__file__).parent
    on_embedded_servers(
        lambda endpoints, settings: run(endpoints, settings, args.tree.resolve(), args.show, args.limit)
    )


if __name__ == "__main__":
    main()
