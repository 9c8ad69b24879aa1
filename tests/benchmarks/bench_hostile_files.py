"""Benchmark of the ingester's reading of files written to be costly: what chunking, the graph and the calls take
against parsing the same file once (``ast.parse``, the floor every reading of Python starts from), in the same
process. An audit found files of a few kilobytes that took tens of seconds, or stopped the ingest; each case here is
one of its shapes, at two sizes, so that the ratio says whether the cost grows with the file or faster.

Run: .venv/bin/python -m tests.benchmarks.bench_hostile_files [--scale 1.0]
"""

from __future__ import annotations

import argparse
import ast
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from ontofabric.services.ingest.graph import python_calls, python_graph
from ontofabric.services.ingest.ingester import chunk_sources


def _dotted(parts: int) -> str:
    return ".".join(["a"] * parts)


def _chain(classes: int) -> str:
    bases = "".join(f"class C{i}(C{i - 1}): pass\n" for i in range(1, classes))
    calls = "        self.missing()\n" * classes
    return f"class C0: pass\n{bases}class D(C{classes - 1}):\n    def m(self):\n{calls}"


CASES: dict[str, Callable[[int], str]] = {
    "a dotted import of n parts, its name called 2,000 times": lambda n: (
        f"from {_dotted(n)} import f\n" + "f()\n" * 2000
    ),
    "n classes each deriving from the last, n self.missing() calls": _chain,
    "n top-level statements": lambda n: "x = 1\n" * n,
    "a base written as a chain of n names": lambda n: f"import a\nclass C({_dotted(n)}): pass\n",
}
SIZES = {
    "a dotted import of n parts, its name called 2,000 times": (500, 2000),
    "n classes each deriving from the last, n self.missing() calls": (2000, 8000),
    "n top-level statements": (30_000, 300_000),
    "a base written as a chain of n names": (500, 2000),
}


def _seconds(step: Callable[[dict[str, str]], object], sources: dict[str, str]) -> float:
    started = time.perf_counter()
    step(sources)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every size by this")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))  # cut chunks are logged: not here
    print("| case | n | bytes | ast.parse s | chunks s | graph s | calls s | all three / ast.parse |")
    print("|---|---|---|---|---|---|---|---|")
    for name, make in CASES.items():
        for size in SIZES[name]:
            n = max(2, round(size * args.scale))
            sources = {"m.py": make(n)}
            floor = _seconds(lambda given: ast.parse(given["m.py"]), sources)
            chunks = _seconds(lambda given: chunk_sources(Path("."), given, 1 << 20), sources)
            graph = _seconds(python_graph, sources)
            calls = _seconds(python_calls, sources)
            ratio = (chunks + graph + calls) / floor
            print(
                f"| {name} | {n:,} | {len(sources['m.py']):,} | {floor:.3f} | {chunks:.2f} | {graph:.2f} | "
                f"{calls:.2f} | {ratio:.0f} |"
            )


if __name__ == "__main__":
    main()
