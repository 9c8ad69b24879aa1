"""Benchmark of a query worker's start (issue #23, item 1e): from starting the process to its first answer, its
peak memory after some answers, and whether it loaded PyTorch, two ways in turn over this project's source:

- **on PyTorch first**: the cache holds the model's ONNX export but not PyTorch's reference embeddings beside it,
  so the worker loads PyTorch and the model, checks the export against them and keeps the reference: how every
  worker started until 2026-12-04;
- **on the checked export**: the reference is there, and the worker starts with the export alone.

Each worker is a process of its own (`ontofabric query-worker`), the query cache off, with a cache directory of the
benchmark's own; the first start (which also makes the export) is not counted.

Run: .venv/bin/python -m tests.benchmarks.bench_worker_start [--rounds 5] [--queries 50]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

from ontofabric.services.ops.measures import percentile
from ontofabric.services.query.client import QueryClient
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import EmbeddedRuntime
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names

from .bench_scale import cold_start, peak_rss_mb
from .bench_spine import serve_tree
from .faults_query import start_worker, stop_workers

WAYS = ("on PyTorch first", "on the checked export")


def loaded_pytorch(pid: int) -> bool:
    """Whether the process has PyTorch's library mapped (late interaction computes with it, so a worker that
    embeds on the export still imports PyTorch itself, without sentence-transformers, transformers or the model)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


async def run(runtime: EmbeddedRuntime, rounds: int, queries: int) -> None:
    endpoints = runtime.endpoints
    assert endpoints is not None
    settings = Settings(nats_url=endpoints.nats_url_as("operator"), database_url=endpoints.database_url)
    cache_dir = runtime.data_dir / "cache"
    worker_env = {"ONTOFABRIC_CACHE_DIR": str(cache_dir)}
    found: dict[str, list[tuple[float, float, bool]]] = {way: [] for way in WAYS}
    async with AsyncExitStack() as stack:
        corpus = await serve_tree(stack, settings, endpoints, "start")
        client = QueryClient(corpus.served.nc, Names(settings.subject_prefix), timeout_s=60)
        for turn in range(rounds + 1):
            for way in WAYS:
                if way == WAYS[0]:
                    for reference in (cache_dir / "onnx").glob("*.reference.npz"):
                        reference.unlink()
                started = time.perf_counter()
                worker = start_worker(endpoints, runtime.data_dir / "worker", worker_env)
                try:
                    first = await cold_start(client, corpus.workspace, started)
                    for text in corpus.texts[:queries]:
                        await client.query(corpus.workspace, {"semanticQuery": text})
                    measured = (first, peak_rss_mb(worker.pid), loaded_pytorch(worker.pid))
                finally:
                    stop_workers([worker])
                if turn:  # the first round made the export
                    found[way].append(measured)
                    print(f"round {turn}, {way}: first answer {measured[0]:.2f} s, peak RSS {measured[1]:.0f} MB, "
                          f"PyTorch loaded: {measured[2]}", flush=True)  # fmt: skip
    print(f"\n{corpus.chunks} chunks; {queries} queries before the peak memory is read; {rounds} rounds in turn")
    print("| worker starts | first answer s, by round | median | peak RSS MB, by round | median | libtorch mapped |")
    print("|---|---|---|---|---|---|")
    for way, rows in found.items():
        firsts, peaks = [r[0] for r in rows], [r[1] for r in rows]
        print(
            f"| {way} | {' / '.join(f'{f:.2f}' for f in firsts)} | {percentile(firsts, 0.5):.2f} | "
            f"{' / '.join(f'{p:.0f}' for p in peaks)} | {percentile(peaks, 0.5):.0f} | "
            f"{', '.join(sorted({str(r[2]) for r in rows}))} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the two ways, in turn")
    parser.add_argument("--queries", type=int, default=50, help="queries each worker answers after its first")
    args = parser.parse_args()
    if args.rounds < 1 or args.queries < 0:
        parser.error("--rounds must be at least 1, --queries at least 0")
    configure_logging("WARNING", "console")
    with (
        tempfile.TemporaryDirectory(prefix="bench-worker-start-") as data_dir,
        EmbeddedRuntime(Settings(), Path(data_dir)) as runtime,
    ):
        asyncio.run(run(runtime, args.rounds, args.queries))


if __name__ == "__main__":
    main()
