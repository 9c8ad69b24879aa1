"""Benchmark of fitting an answer to its token budget (``services/query/budget.py``, ``fit_reply``) on the query
worker's event loop.

A red team's burst of heavy queries (topK 100, followLinks) showed ``fit_reply`` taking a sixth of a loaded worker's
event loop: finding how many results fit serialised the whole answer once per count tried. This builds an answer
of ``--results`` results the way the worker's look (content of a few hundred bytes, metadata, two retrievers'
ranks, expanded context), then times ``fit_reply`` to ``--max-tokens`` and, as the reference in the same run, one
serialisation of the whole answer; it prints the medians and their ratio.

Run: .venv/bin/python -m tests.benchmarks.bench_budget [--results 100] [--max-tokens 8000] [--repeats 50]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from ontofabric.contracts import ExpandedContext, QueryMeta, QueryResponse, SearchResult
from ontofabric.contracts.query import FoundBy
from ontofabric.services.query.budget import fit_reply


def answer(results: int) -> QueryResponse:
    code = "def step(self, attempt):\n    return self.wait(attempt) * 2  # back off\n" * 6
    hits = [
        SearchResult(
            id=f"python:pkg/module_{i}.py/Class{i}.method{i}().", score=1 - i / 200, rank=i + 1, content=code,
            object_type=f"pkg.module_{i}.Class{i}", source_domain="python",
            metadata={"filePath": f"pkg/module_{i}.py", "symbolFqn": f"pkg.module_{i}.Class{i}.method{i}",
                      "chunkLevel": "method", "provenance": "ingested", "symbolKind": "method"},
            found_by=[FoundBy(retriever="dense", rank=i + 1, score=0.5), FoundBy(retriever="keyword", rank=i + 3,
                                                                                   score=11.5)],
        )
        for i in range(results)
    ]  # fmt: skip
    context = [
        ExpandedContext(linked_type=f"pkg.base_{i}.Base{i}", link_name="inherits", direction="outgoing",
                        linked_from_type=f"pkg.module_{i}.Class{i}", linked_from_document_id=hits[i].id,
                        representative_document_id=f"python:pkg/base_{i}.py/Base{i}#")
        for i in range(min(results, 30))
    ]  # fmt: skip
    meta = QueryMeta(
        ontology_version="1-a", workspace="w", branch="main", hybrid=True, reranked=False, cache_hit=False,
        backend="postgres-bm25", retrievers=["dense", "keyword"], timings_ms={}, expanded_context=context,
    )  # fmt: skip
    return QueryResponse(results=hits, meta=meta)


def median_ms(repeats: int, work: Callable[[], object]) -> float:
    spent = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        spent.append((time.perf_counter() - started) * 1000)
    return statistics.median(spent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=int, default=100, help="results in the answer")
    parser.add_argument("--max-tokens", type=int, default=8000, help="the budget it is fitted to")
    parser.add_argument("--repeats", type=int, default=50, help="timings of each, the median printed")
    args = parser.parse_args()
    whole = answer(args.results)
    body = fit_reply(whole, args.max_tokens, 1_000_000)
    fitted = QueryResponse.model_validate_json(body)
    reference = median_ms(args.repeats, whole.model_dump_json)
    fitting = median_ms(args.repeats, lambda: fit_reply(whole, args.max_tokens, 1_000_000))
    print(
        f"answer of {args.results} results, {len(whole.model_dump_json().encode()):,} bytes, fitted to "
        f"{args.max_tokens} tokens: {len(body):,} bytes, {len(fitted.results)} results kept"
    )
    print(f"one serialisation of the whole answer (reference): {reference:.2f} ms")
    print(f"fit_reply: {fitting:.2f} ms, {fitting / reference:.1f}x the reference")


if __name__ == "__main__":
    main()
