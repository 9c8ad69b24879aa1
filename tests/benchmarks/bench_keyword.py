"""Keyword retrieval at scale (issue #23): bounded BM25 against exact BM25 over the same postings, in one run.

The corpus is bench_scale's (the sets' texts repeated with variation, ``--documents`` of them), published and
projected through the real path. Then every variant answers the same queries through the query worker's keyword
retriever (``PostgresKeyword.search``, one snapshot each, depth 100 as the worker asks): exact BM25 (every term read
in full) and each ``--budgets`` × ``--depths`` pair of ``bm25_full_read_postings`` and ``bm25_completion_depth``.
The variants take turns query by query, so the machine's noise falls on all of them alike.

Printed per variant: latency p50 / p95 / mean, and how much of exact BM25's top 10 and top 100 it returns (mean
over the queries with a 95 % bootstrap interval, and the worst query), and the share of queries it pruned. Past
100,000 documents every text has dozens of near copies whose scores nearly tie, so which copies make a top 10
says little; judged recall says what matters: the share of a query's judged documents (from the sets' qrels) of
which the top 10 holds the document or one of its copies, and each variant's difference from exact BM25 with its
paired-bootstrap 95 % interval.

Run: .venv/bin/python -m tests.benchmarks.bench_keyword ../shared/eval/cosqa-dev ../shared/eval/scifact-train
     [--documents 100000] [--queries 300] [--budgets 5000,10000,20000,40000] [--depths 400,1000] [--data-dir DIR]
--data-dir keeps the embedded servers' data in DIR: a later run with the same DIR and --documents reads the corpus
already projected there instead of loading it again (an hour at 1,000,000 documents).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path

import asyncpg
from rich.console import Console

from ontofabric.services.app import Roles, start_workers
from ontofabric.services.ops.beir import load_beir
from ontofabric.services.ops.measures import margin, percentile
from ontofabric.services.query.core import Scope, SearchInput
from ontofabric.services.query.postgres import PostgresKeyword, PostgresSnapshots
from ontofabric.services.render import RichProgress
from ontofabric.shared.db import create_pool, migrate
from ontofabric.shared.embedder import load_embedder
from ontofabric.shared.jetstream import connect, ensure_jetstream
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import EmbeddedRuntime, Endpoints
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names

from .bench_scale import WORKSPACE, load_base, projected_by, projected_documents, publish

DEPTH = 100
"""Candidates the worker asks of each retriever (retriever_top_k)."""
EXACT = "exact"


def judged_originals(datasets: Sequence[Path]) -> dict[str, set[int]]:
    """Each judged query's text, with the positions of its relevant documents among the originals the corpus
    repeats (in ``load_base``'s order: the sets' corpora one after another)."""
    judged: dict[str, set[int]] = {}
    offset = 0
    for directory in datasets:
        split = sorted((directory / "qrels").glob("*.tsv"))[0].stem
        dataset = load_beir(directory, split)
        position = {entry["_id"]: offset + n for n, entry in enumerate(dataset.corpus)}
        for query_id, relevant in dataset.qrels.items():
            text = dataset.queries.get(query_id, "")
            wanted = {position[doc] for doc, grade in relevant.items() if grade > 0 and doc in position}
            if text.strip() and wanted:
                judged.setdefault(text, set()).update(wanted)
        offset += len(dataset.corpus)
    return judged


def judged_recall(found: list[str], relevant: set[int], originals: int) -> float:
    """Share of the relevant originals whose document or a copy of it is in ``found``'s top 10 (ids ``s<n>``: the
    n-th document repeats original n mod ``originals``)."""
    held = {int(doc_id[1:]) % originals for doc_id in found[:10]}
    return len(relevant & held) / len(relevant)


def overlap(found: list[str], exact: list[str], k: int) -> float:
    """Share of exact BM25's top ``k`` that ``found``'s top ``k`` holds (1 when exact found nothing)."""
    wanted = set(exact[:k])
    return len(wanted & set(found[:k])) / len(wanted) if wanted else 1.0


async def run(endpoints: Endpoints, args: argparse.Namespace) -> None:
    settings = Settings(nats_url=endpoints.nats_url_as("operator"), database_url=endpoints.database_url)
    names = Names(settings.subject_prefix)
    workspace = WORKSPACE
    async with AsyncExitStack() as stack:
        progress = stack.enter_context(RichProgress(Console()))
        embedder = load_embedder(settings)
        base, queries = await asyncio.to_thread(load_base, args.datasets, settings, embedder, progress)
        already = await projected_documents(endpoints.database_url, args.documents)
        if already == 0:
            await migrate(endpoints.database_url, settings)
            nc = await connect(endpoints.nats_url_as("operator"), "bench-keyword")
            stack.push_async_callback(nc.close)
            js = nc.jetstream()
            await ensure_jetstream(js, names, settings)
            last_seq = await publish(js, names, workspace, base, args.documents, settings.embedding_model, progress)
            await start_workers(stack, settings, endpoints, Roles(query=False, azure_projector=False))
            await projected_by(js, names, last_seq, args.documents, progress)
        pool = await create_pool(endpoints.database_url, settings)
        stack.push_async_callback(pool.close)
        conn = await asyncpg.connect(endpoints.database_url)  # without the pool's statement timeout
        try:
            await conn.execute("VACUUM ANALYZE")
        finally:
            await conn.close()

        snapshots = PostgresSnapshots(pool)
        bm25 = (settings.text_search_config, settings.bm25_k1, settings.bm25_b, settings.bm25_k3)
        variants = {EXACT: PostgresKeyword(snapshots, *bm25)}
        for budget in args.budgets:
            for depth in args.depths:
                variants[f"budget {budget}, depth {depth}"] = PostgresKeyword(snapshots, *bm25, budget, depth)
        scope = Scope(workspace, "main")
        asked = queries[: args.queries]
        for text in asked[:10]:  # warm: plans cached, pages in shared buffers
            for keyword in variants.values():
                await keyword.search(scope, SearchInput(text), DEPTH)

        spent: dict[str, list[float]] = {name: [] for name in variants}
        top10: dict[str, dict[str, float]] = {name: {} for name in variants}
        top100: dict[str, dict[str, float]] = {name: {} for name in variants}
        recall: dict[str, dict[str, float]] = {name: {} for name in variants}
        judged = judged_originals(args.datasets)
        pruned = dict.fromkeys(variants, 0)
        progress.stage("queries", len(asked))
        for number, text in enumerate(asked):
            found: dict[str, list[str]] = {}
            for name, keyword in variants.items():
                began = time.perf_counter()
                hits = await keyword.search(scope, SearchInput(text), DEPTH)
                spent[name].append((time.perf_counter() - began) * 1000)
                found[name] = [c.id for c in hits.candidates]
                pruned[name] += hits.pruned
            for name, ids in found.items():
                top10[name][str(number)] = overlap(ids, found[EXACT], 10)
                top100[name][str(number)] = overlap(ids, found[EXACT], DEPTH)
                if text in judged:
                    recall[name][str(number)] = judged_recall(ids, judged[text], len(base.texts))
            progress.advance("queries", 1)

    print(f"{args.documents} documents, {len(asked)} queries, depth {DEPTH}")
    print("| variant | p50 ms | p95 ms | mean ms | exact top 10 held (95 % interval; worst) | exact top 100 held "
          "(95 % interval; worst) | queries pruned |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    everything = dict.fromkeys(top10[EXACT], 1.0)
    for name in variants:
        times = spent[name]
        cells = []
        for held in (top10[name], top100[name]):
            interval = margin(name, EXACT, held, everything)
            assert interval is not None
            cells.append(
                f"{1 + interval.difference:.4f} ({1 + interval.ci_low:.4f}–{1 + interval.ci_high:.4f}; "
                f"{min(held.values()):.2f})"
            )
        print(
            f"| {name} | {percentile(times, 0.5):.1f} | {percentile(times, 0.95):.1f} | {sum(times) / len(times):.1f} "
            f"| {cells[0]} | {cells[1]} | {pruned[name]} of {len(asked)} |"
        )
    print(f"\njudged recall@10 (documents or their copies), {len(recall[EXACT])} judged queries:")
    print("| variant | judged recall@10 | difference from exact (95 % interval) |")
    print("|---|---|---|")
    for name in variants:
        difference = margin(name, EXACT, recall[name], recall[EXACT])
        assert difference is not None
        print(
            f"| {name} | {sum(recall[name].values()) / len(recall[name]):.4f} | {difference.difference:+.4f} "
            f"({difference.ci_low:+.4f} … {difference.ci_high:+.4f}) |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("datasets", type=Path, nargs="+", help="BEIR-layout directories whose texts are repeated")
    parser.add_argument("--documents", type=int, default=100_000, help="documents in the corpus (default 100000)")
    parser.add_argument("--queries", type=int, default=300, help="queries asked of every variant")

    def numbers(text: str) -> list[int]:
        return [int(n) for n in text.split(",")]

    parser.add_argument("--budgets", type=numbers, default=[5000, 10000, 20000, 40000], help="full-read budgets")
    parser.add_argument("--depths", type=numbers, default=[400, 1000], help="completion depths")
    parser.add_argument("--data-dir", type=Path, help="keep the servers' data here, and reuse a corpus loaded there")
    args = parser.parse_args()
    configure_logging("WARNING", "console")
    with tempfile.TemporaryDirectory(prefix="bench-keyword-") as scratch:
        runtime = EmbeddedRuntime(Settings(), args.data_dir or Path(scratch))
        with runtime:
            assert runtime.endpoints is not None
            asyncio.run(run(runtime.endpoints, args))


if __name__ == "__main__":
    main()
