"""Benchmark of an ingest's reading of a whole tree (chunks, calls, exports, graph) against the same reading with
every stage parsing the tree on its own, as the ingester did until 2026-12-04, and against one ``ast.parse`` of
every file (the floor), alternating in one process. The two readings must make as many chunks, and the same
nodes and links.

Run: .venv/bin/python -m tests.benchmarks.bench_tree_reading TREE [TREE ...]  (--rounds 3)
"""

from __future__ import annotations

import argparse
import ast
import gc
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import structlog

from ontofabric.services.ingest.chunking import chunk_file
from ontofabric.services.ingest.graph import python_calls, python_exports, python_graph, read_python
from ontofabric.services.ingest.ingester import chunk_sources, exclusion_patterns, own_package, read_tree

MAX_CONTENT_BYTES = 64_000


def _parse_only(sources: Mapping[str, str]) -> object:
    return [ast.parse(text) for path, text in sources.items() if path.endswith(".py")]


def _ways(root: Path) -> tuple[int, dict[str, Callable[[], object]]]:
    """The tree's file count, and its three readings."""
    sources = read_tree(root, exclusion_patterns(root, ()), [])
    package = own_package(root, None)

    def each_stage_parsing() -> object:
        chunks = [c for path, text in sources.items() for c in chunk_file(path, text, MAX_CONTENT_BYTES, package)]
        python_calls(sources, package)
        python_exports(sources, package)
        return len(chunks), python_graph(sources, package)

    def parsed_once() -> object:
        python = read_python(sources, package)
        return len(chunk_sources(root, sources, MAX_CONTENT_BYTES, package or "", python)), python_graph(python)

    return len(sources), {"parse": lambda: _parse_only(sources), "each": each_stage_parsing, "once": parsed_once}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="+", type=Path, help="source trees, read as `ontofabric ingest` reads them")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the three ways")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))  # cut chunks are logged: not here
    print(
        "| tree | files | chunks | ast.parse s | each stage parsing s | parsed once s | speed-up | once / ast.parse |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for tree in args.trees:
        root = tree.resolve()
        files, ways = _ways(root)
        seconds: dict[str, list[float]] = {name: [] for name in ways}
        made: dict[str, object] = {}
        for _ in range(args.rounds):
            for name, way in ways.items():
                gc.collect()
                started = time.perf_counter()
                made[name] = way()
                seconds[name].append(time.perf_counter() - started)
        if made["each"] != made["once"]:  # the chunk count, the nodes and the links
            raise SystemExit(f"{root.name}: the two readings differ")
        median = {name: statistics.median(values) for name, values in seconds.items()}
        chunks = made["once"][0] if isinstance(made["once"], tuple) else 0
        print(
            f"| {root.name} | {files} | {chunks} | {median['parse']:.2f} | {median['each']:.2f} "
            f"({', '.join(f'{s:.2f}' for s in seconds['each'])}) | {median['once']:.2f} "
            f"({', '.join(f'{s:.2f}' for s in seconds['once'])}) | {median['each'] / median['once']:.2f}x "
            f"| {median['once'] / median['parse']:.2f} |"
        )


if __name__ == "__main__":
    main()
