"""Benchmark of a full garbage collection in a query worker's process, with what starting made frozen or not.

A full collection walks every object the collector tracks. A query worker starts with about 550,000 of them (the
models, torch, ONNX Runtime, pydantic's schemas) and keeps them for its life; the worker freezes them once it has
started (``services/app.py``, ``keep_out_of_collections``). This builds the same set in this process (the worker's
imports, its embedder loaded and one query embedded), adds ``--live`` objects made after starting (as answers in
flight hold), then times ``gc.collect()`` in CPU time, first as they are and then after ``gc.freeze()``, and prints
p50/max of each and their ratio.

Run: .venv/bin/python -m tests.benchmarks.bench_gc [--collections 5] [--live 20000]
"""

from __future__ import annotations

import argparse
import gc
import time

from ontofabric.services.ops.measures import percentile
from ontofabric.services.query.worker import QueryService  # noqa: F401 - its imports are part of the set
from ontofabric.shared.embedder import build_embedder
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.settings import Settings


def collections_ms(count: int) -> list[float]:
    """CPU milliseconds of ``count`` full collections."""
    spent = []
    for _ in range(count):
        started = time.thread_time()
        gc.collect()
        spent.append((time.thread_time() - started) * 1000)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collections", type=int, default=5, help="full collections timed each way")
    parser.add_argument("--live", type=int, default=20_000, help="objects made after starting, kept alive")
    args = parser.parse_args()
    configure_logging("WARNING")
    embedder = build_embedder(Settings())
    if embedder is None:
        parser.error("no embedder is set up (ONTOFABRIC_EMBEDDER=none): the set to freeze would not be a worker's")
    embedder.embed_query("a query, as the worker's warm-up asks")
    started = len(gc.get_objects())
    before = collections_ms(args.collections)
    gc.freeze()
    live = [{"id": f"d{i}", "scores": [i, i + 1]} for i in range(args.live)]  # made after: never frozen
    after = collections_ms(args.collections)
    print(f"tracked at start: {started:,}; made after: {len(live):,} dicts (and their lists)")
    print("| full collection | p50 ms CPU | max ms CPU |")
    print("|---|---|---|")
    print(f"| as started | {percentile(before, 0.5):.1f} | {max(before):.1f} |")
    print(f"| start frozen | {percentile(after, 0.5):.1f} | {max(after):.1f} |")
    print(f"ratio frozen/as started (p50): {percentile(after, 0.5) / percentile(before, 0.5):.3f}")


if __name__ == "__main__":
    main()
