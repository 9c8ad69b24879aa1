"""Benchmark of graph expansion and the branch overlay on the demo corpus (this project's own source tree).

Prints, in one run on the embedded servers, with the query cache off:
- graph expansion (followLinks) stage time p50/p95 over the queries, beside the same queries' total time;
- query latency p50/p95 on a branch (main ⊕ a delta of changed files) beside the same queries on main.

Run: .venv/bin/python -m tests.benchmarks.bench_graph [--queries 200] [--changed-files 20]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

from ontofabric.contracts import QueryResponse
from ontofabric.services.demo import project_root
from ontofabric.services.ingest.ingester import discover
from ontofabric.services.ops.measures import percentile
from ontofabric.services.query.client import QueryClient
from ontofabric.shared.jetstream import wait_caught_up
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import EmbeddedRuntime, Endpoints
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names

from .bench_spine import queries_from, serve_for_ingest

WORKSPACE = "bench"


async def run(endpoints: Endpoints, settings: Settings, query_count: int, changed_files: int) -> None:
    names = Names(settings.subject_prefix)
    async with AsyncExitStack() as stack:
        served = await serve_for_ingest(stack, settings, endpoints)
        nc, js, ingester = served.nc, served.js, served.ingester
        root = project_root()
        main = await ingester.ingest(root, WORKSPACE)
        # A branch: a copy of the tree with some files changed, ingested as the branch's delta over main.
        with tempfile.TemporaryDirectory() as scratch:
            copy = Path(scratch) / "tree"
            shutil.copytree(root, copy, ignore=shutil.ignore_patterns(".*", "__pycache__", "*.egg-info"))
            for path in [p for p in discover(copy) if p.suffix == ".py"][:changed_files]:
                path.write_text(path.read_text() + "\n\ndef branch_helper():\n    return 'changed on the branch'\n")
            branch = await ingester.ingest(copy, WORKSPACE, "feature/bench")
        last = max(s for s in (main.last_sequence, branch.last_sequence) if s is not None)
        await wait_caught_up(js, names.delta_stream, names.postgres_projector_durable, last, 600)
        await asyncio.sleep(0.5)  # the query worker's KV watch catches up
        print(
            f"corpus: {main.chunks} chunks, {main.graph_changes} graph deltas on main; branch delta: "
            f"{branch.upserts} upserts, {branch.deletes} tombstones, {branch.graph_changes} graph deltas"
        )

        from ontofabric.services.ingest.ingester import chunk_tree

        texts = queries_from(chunk_tree(root, settings.max_content_bytes), query_count)
        client = QueryClient(nc, names)

        async def ask(text: str, **params: object) -> tuple[float, dict[str, float]]:
            began = time.perf_counter()
            reply = await client.query(WORKSPACE, {"semanticQuery": text, "precision": False, **params})
            elapsed = (time.perf_counter() - began) * 1000
            assert isinstance(reply, QueryResponse)
            assert not reply.meta.degraded, reply.meta.degraded
            return elapsed, reply.meta.timings_ms

        variants: dict[str, dict[str, object]] = {
            "main": {}, "followLinks": {"followLinks": True}, "branch": {"branch": "feature/bench"}
        }  # fmt: skip
        for text in texts[:10]:  # warm up connections and plans of every variant
            for params in variants.values():
                await ask(text, **params)
        measured: dict[str, list[tuple[float, dict[str, float]]]] = {name: [] for name in variants}
        for n, text in enumerate(texts):
            # The variants take turns in a rotating order, so none profits from going first.
            turn = list(variants)[n % 3 :] + list(variants)[: n % 3]
            for name in turn:
                measured[name].append(await ask(text, **variants[name]))
        plain, plain_stages = [m[0] for m in measured["main"]], [m[1] for m in measured["main"]]
        expanded = [m[0] for m in measured["followLinks"]]
        expansion = [m[1]["expansion"] for m in measured["followLinks"] if "expansion" in m[1]]
        on_branch, branch_stages = [m[0] for m in measured["branch"]], [m[1] for m in measured["branch"]]
        print(
            f"expansion stage over {len(expansion)} queries: p50 {percentile(expansion, 0.5):.2f} ms, "
            f"p95 {percentile(expansion, 0.95):.2f} ms; whole query with followLinks p50 "
            f"{percentile(expanded, 0.5):.1f} ms vs {percentile(plain, 0.5):.1f} ms without"
        )
        print(
            f"branch vs main, {len(texts)} queries: p50 {percentile(on_branch, 0.5):.1f} vs "
            f"{percentile(plain, 0.5):.1f} ms (ratio {percentile(on_branch, 0.5) / percentile(plain, 0.5):.2f}), "
            f"p95 {percentile(on_branch, 0.95):.1f} vs {percentile(plain, 0.95):.1f} ms "
            f"(ratio {percentile(on_branch, 0.95) / percentile(plain, 0.95):.2f})"
        )
        for name, stages in (("main", plain_stages), ("branch", branch_stages)):
            medians = {
                k: statistics.median(s[k] for s in stages if k in s) for k in ("embed", "dense", "keyword", "fetch")
            }
            print(f"stage medians on {name} (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in medians.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--changed-files", type=int, default=20)
    args = parser.parse_args()
    configure_logging("WARNING", "console")
    with tempfile.TemporaryDirectory(prefix="ontofabric-bench-") as data_dir:
        Path(data_dir).chmod(0o755)
        settings = Settings(query_cache_entries=0, data_dir=Path(data_dir))
        with EmbeddedRuntime(settings, Path(data_dir)) as runtime:
            assert runtime.endpoints is not None
            asyncio.run(run(runtime.endpoints, settings, args.queries, args.changed_files))


if __name__ == "__main__":
    main()
