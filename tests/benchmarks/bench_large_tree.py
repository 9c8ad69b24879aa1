"""Benchmark of what an ingest reads of a large Python tree before it embeds or sends anything: the files parsed,
cut into chunks, their calls and graph read (``ingester.read_sources``), as the ingest does it against two
references in the same run, each variant in a process of its own, in alternating rounds (bench_tree_reading
compares parsing once against each stage parsing, in one process):

- ``before``: as until 2026-12-06: Python's cycle collector running, and each function's nodes walked again by
  every reading of them (``graph._walked`` not kept);
- ``collector paused``: the collector paused while reading (``ingester.collector_paused``), the nodes walked again;
- ``now``: both, as an ingest reads.

Each prints the seconds of reading and the process's peak resident memory. An unchanged tree pays the reading on
every ingest: it is what an ingest that sends nothing costs.

Run: .venv/bin/python -m tests.benchmarks.bench_large_tree [TREE] [--rounds 2]
(TREE defaults to the installed sympy, which PyTorch brings: 1,534 files, 26 MB of Python.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

READ = """
import contextlib, functools, json, resource, sys, time
from pathlib import Path
from ontofabric.services.ingest import graph, ingester
from ontofabric.shared.settings import Settings

root, variant = Path(sys.argv[1]), sys.argv[2]
if variant == "before":
    ingester.collector_paused = contextlib.nullcontext
if variant in ("before", "collector paused"):
    graph._walked = functools.lru_cache(maxsize=0)(graph._walked.__wrapped__)  # kept for none
settings = Settings()
sources = ingester.read_tree(root, max_read_bytes=2 * settings.ingest_max_file_bytes + 1)
started = time.perf_counter()
chunks, (nodes, links), _ = ingester.read_sources(
    root, sources, None, settings.max_content_bytes, settings.ingest_max_file_bytes
)
seconds = time.perf_counter() - started
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"seconds": seconds, "peak_mb": peak, "files": len(sources), "chunks": len(chunks)}))
"""
VARIANTS = ("before", "collector paused", "now")


def read(tree: Path, variant: str) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", READ, str(tree), variant], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{variant}: {done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def default_tree() -> Path:
    try:
        import sympy  # type: ignore[import-untyped]
    except ImportError:
        sys.exit("sympy is not installed: name a tree to read")
    return Path(sympy.__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tree", nargs="?", type=Path, help="A Python tree (default: the installed sympy).")
    parser.add_argument("--rounds", type=int, default=2, help="Rounds of the three variants, alternating.")
    args = parser.parse_args()
    tree = args.tree or default_tree()
    runs: dict[str, list[dict[str, float]]] = {variant: [] for variant in VARIANTS}
    for round_number in range(args.rounds):
        for variant in VARIANTS:
            found = read(tree, variant)
            runs[variant].append(found)
            print(
                f"round {round_number + 1} {variant}: {found['seconds']:.1f} s, peak {found['peak_mb']:.0f} MB "
                f"({found['files']:.0f} files, {found['chunks']:.0f} chunks)",
                flush=True,
            )
    reference = statistics.median(run["seconds"] for run in runs["before"])
    for variant in VARIANTS:
        seconds = [run["seconds"] for run in runs[variant]]
        peaks = [run["peak_mb"] for run in runs[variant]]
        print(
            f"{variant}: reading {min(seconds):.1f}-{max(seconds):.1f} s (median {statistics.median(seconds):.1f}, "
            f"{statistics.median(seconds) / reference:.2f} of before), peak {min(peaks):.0f}-{max(peaks):.0f} MB"
        )


if __name__ == "__main__":
    main()
