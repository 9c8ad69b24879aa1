"""Measurement of exact-identifier queries over a code repository (issue #24, item 3): a query that is a symbol's
name or its fully qualified name should return the chunk that defines the symbol in the top 3.

A source tree (default: the tenacity package as installed, a pinned public Python project) is ingested by the
reference ingester on the embedded servers. Every class, function and method the chunker finds is asked for twice,
by its fully qualified name (`tenacity.retry.retry_if_exception`) and by its name alone (`retry_if_exception`),
with a request that has no options (the default a gateway sends), topK 3, cache off, and again with the exact-symbol
match turned off (`options.exactSymbols: false`), the reference in the same run. A name several symbols share
(`__init__`) is counted apart: there, any of its definitions in the top 3 counts. Printed: the share found in the
top 3 and at rank 1, with 95 % Wilson intervals, the query latency of both, and the misses of each kind.

With ``--relations``, the relationship questions the repository evaluation derives from the tree's syntax instead
("what calls f", "what subclasses C", "what imports M"), topK 10, in the same two modes: Recall@10 over the answer's
symbols by kind, and the latency of both.

Run: .venv/bin/python -m tests.benchmarks.exact_identifiers [--tree PATH] [--show 10] [--relations]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Coroutine
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from ontofabric.contracts import QueryResponse
from ontofabric.services.ingest.chunking import Chunk, tree_package
from ontofabric.services.ingest.ingester import chunk_tree, read_tree
from ontofabric.services.ops.repository_eval import relationship_queries, symbols_of
from ontofabric.services.query.client import QueryClient
from ontofabric.shared.jetstream import wait_caught_up
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import Endpoints, embedded_servers
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names

from .bench_spine import Served, serve_for_ingest

WORKSPACE = "identifiers"
TOP = 3
MODES: dict[str, dict[str, object]] = {"exact symbols": {}, "off (reference)": {"options": {"exactSymbols": False}}}


def wilson(successes: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of a proportion."""
    if total == 0:
        return 0.0, 0.0
    p = successes / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return centre - half, centre + half


def symbols(chunks: list[Chunk]) -> list[Chunk]:
    """The chunks that define a class, function or method."""
    return [c for c in chunks if c.chunk_level in ("type", "method") and c.symbol_kind != "docstring"]


async def ingested(
    stack: AsyncExitStack, settings: Settings, endpoints: Endpoints, tree: Path, workspace: str
) -> Served:
    """The workers started (``stack`` stops them), the tree ingested into ``workspace`` and projected, and the
    query worker caught up."""
    names = Names(settings.subject_prefix)
    served = await serve_for_ingest(stack, settings, endpoints)
    report = await served.ingester.ingest(tree, workspace)
    assert report.last_sequence is not None
    await wait_caught_up(served.js, names.delta_stream, names.postgres_projector_durable, report.last_sequence, 1800)
    await asyncio.sleep(0.5)  # the query worker's KV watch catches up
    return served


async def run(endpoints: Endpoints, settings: Settings, tree: Path, show: int, relations: bool) -> None:
    names = Names(settings.subject_prefix)
    async with AsyncExitStack() as stack:
        served = await ingested(stack, settings, endpoints, tree, WORKSPACE)
        if relations:
            await ask_relations(QueryClient(served.nc, names, timeout_s=60), tree)
            return
        chunks = chunk_tree(tree, 1 << 20)  # named as the ingester names them
        defined = symbols(chunks)
        by_name: dict[str, set[str]] = defaultdict(set)
        for chunk in defined:
            by_name[chunk.symbol_fqn.rsplit(".", 1)[-1]].add(chunk.document_id)
        client = QueryClient(served.nc, names, timeout_s=60)
        found: Counter[tuple[str, str]] = Counter()
        first: Counter[tuple[str, str]] = Counter()
        asked: Counter[str] = Counter()
        latency: dict[str, list[float]] = defaultdict(list)
        misses: dict[tuple[str, str], list[str]] = defaultdict(list)
        for chunk in defined:
            name = chunk.symbol_fqn.rsplit(".", 1)[-1]
            kinds = [("fqn", chunk.symbol_fqn, {chunk.document_id})]
            kinds.append(("unique name" if len(by_name[name]) == 1 else "shared name", name, by_name[name]))
            for kind, text, wanted in kinds:
                asked[kind] += 1
                for mode, options in MODES.items():  # interleaved, so both see the same machine
                    started = time.perf_counter()
                    reply = await client.query(WORKSPACE, {"semanticQuery": text, "topK": TOP, **options})
                    latency[mode].append((time.perf_counter() - started) * 1000)
                    assert isinstance(reply, QueryResponse), reply
                    ids = [r.id for r in reply.results]
                    found[mode, kind] += bool(wanted & set(ids))
                    first[mode, kind] += bool(ids) and ids[0] in wanted
                    if not wanted & set(ids):
                        misses[mode, kind].append(text)
    print(f"tree {tree}: {len(chunks)} chunks, {len(defined)} symbols ({len(by_name)} names), topK {TOP}, cache off")
    print("| query | asked | mode | defining chunk in top 3 (95 % interval) | at rank 1 |")
    print("|---|---|---|---|---|")
    for kind in ("fqn", "unique name", "shared name"):
        for mode in MODES:
            if asked[kind]:
                low, high = wilson(found[mode, kind], asked[kind])
                print(
                    f"| {kind} | {asked[kind]} | {mode} | {found[mode, kind] / asked[kind]:.3f} ({low:.3f}-{high:.3f}) "
                    f"| {first[mode, kind] / asked[kind]:.3f} |"
                )
    for mode, times in latency.items():
        print(f"{mode}: client-side p50 {statistics.median(times):.1f} ms over {len(times)} queries")
    for (mode, kind), texts in misses.items():
        print(f"missed ({mode}, {kind}, {len(texts)}): {', '.join(texts[:show])}")


async def ask_relations(client: QueryClient, tree: Path) -> None:
    sources = read_tree(tree)
    questions = relationship_queries(sources, tree_package(tree.name, sources))
    recall: dict[tuple[str, str], list[float]] = defaultdict(list)
    latency: dict[str, list[float]] = defaultdict(list)
    for question in questions:
        for mode, options in MODES.items():  # interleaved, so both see the same machine
            started = time.perf_counter()
            reply = await client.query(WORKSPACE, {"semanticQuery": question.text, "topK": 10, **options})
            latency[mode].append((time.perf_counter() - started) * 1000)
            assert isinstance(reply, QueryResponse), reply
            found = set(symbols_of(reply)) & set(question.relevant)
            recall[mode, question.kind].append(len(found) / len(question.relevant))
    print(f"tree {tree}: {len(questions)} relationship questions, topK 10, cache off, followLinks off")
    print("| kind | questions | mode | Recall@10 |")
    print("|---|---|---|---|")
    for (mode, kind), values in sorted(recall.items(), key=lambda item: (item[0][1], item[0][0])):
        print(f"| {kind} | {len(values)} | {mode} | {statistics.mean(values):.4f} |")
    for mode, times in latency.items():
        ordered = sorted(times)
        p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
        print(f"{mode}: client-side p50 {statistics.median(times):.1f} ms, p95 {p95:.1f} ms over {len(times)} queries")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=None, help="source tree (default: tenacity as installed)")
    parser.add_argument("--show", type=int, default=10, help="misses listed per kind")
    parser.add_argument("--relations", action="store_true", help="ask the tree's relationship questions instead")
    args = parser.parse_args()
    configure_logging("WARNING", "console")
    if args.tree is None:
        import tenacity

        args.tree = Path(tenacity.__file__).parent
    on_embedded_servers(
        lambda endpoints, settings: run(endpoints, settings, args.tree.resolve(), args.show, args.relations)
    )


def on_embedded_servers(run_with: Callable[[Endpoints, Settings], Coroutine[Any, Any, None]]) -> None:
    """Run a measurement on fresh embedded servers, the query cache off."""
    with embedded_servers() as endpoints:
        settings = Settings(
            nats_url=endpoints.nats_url_as("operator"), database_url=endpoints.database_url, query_cache_entries=0
        )
        asyncio.run(run_with(endpoints, settings))


if __name__ == "__main__":
    main()
