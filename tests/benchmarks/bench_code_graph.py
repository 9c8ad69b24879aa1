"""Benchmark of reading the calls and graph of code in languages other than Python (``code_graph.read_code``) against
chunking the same files (``code.chunk_code``) in the same process, alternating, over a tree's TypeScript,
JavaScript, Go, Java and Rust files: what the calls add to an ingest's reading, which every ingest pays, one that
sends nothing too. Prints each round's seconds, their ratio, the edges read, and how far the process's resident
memory rose while the calls were read (the files are parsed twice rather than held: all of zod's trees held took
182 MB).

Run: .venv/bin/python -m tests.benchmarks.bench_code_graph [TREE] [--rounds 3]
(TREE defaults to the zod package the Node tests install: tests/node/node_modules/zod, 828 files, 5.7 MB.)
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from pathlib import Path

from ontofabric.services.ingest.code import CODE_SUFFIXES, chunk_code
from ontofabric.services.ingest.code_graph import read_code

DEFAULT_TREE = Path(__file__).resolve().parents[1] / "node" / "node_modules" / "zod"


def resident_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


def watch(peak: list[float], done: threading.Event) -> None:
    """Keeps the highest resident memory seen in ``peak[0]`` until ``done``."""
    while not done.wait(0.01):
        peak[0] = max(peak[0], resident_mb())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tree", nargs="?", type=Path, default=DEFAULT_TREE)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # a syntax error's warning a file, not the figures
    sources = {
        str(path.relative_to(args.tree)): path.read_text(errors="replace")
        for path in sorted(args.tree.rglob("*"))
        if path.is_file() and path.name.endswith(CODE_SUFFIXES)
    }
    if not sources:  # the default tree before `npm install --prefix tests/node`
        raise SystemExit(f"{args.tree}: no TypeScript, JavaScript, Go, Java or Rust file to read")
    size = sum(len(text.encode()) for text in sources.values())
    print(f"{args.tree}: {len(sources):,} files, {size / 2**20:.1f} MB")
    for round_ in range(1, args.rounds + 1):
        started = time.perf_counter()
        chunks = sum(len(chunk_code(path, text, 20_000)) for path, text in sources.items())
        chunking = time.perf_counter() - started
        before = resident_mb()
        peak, done = [before], threading.Event()
        watcher = threading.Thread(target=watch, args=(peak, done))
        watcher.start()
        started = time.perf_counter()
        calls = read_code(sources).calls
        reading = time.perf_counter() - started
        done.set()
        watcher.join()
        edges = sum(len(names) for names in calls.values())
        print(
            f"round {round_}: chunking {chunking:.2f} s ({chunks:,} chunks), calls {reading:.2f} s "
            f"({len(calls):,} chunks calling, {edges:,} edges): {reading / chunking:.2f}x; "
            f"memory +{peak[0] - before:.0f} MB while reading calls"
        )


if __name__ == "__main__":
    main()
