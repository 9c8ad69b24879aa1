"""The same judged queries through both keyword backends, in one run (seed 000 §5.5, acceptance (e)): the path of
`ontofabric eval` (deltas, projectors, request-reply), once with the keyword path on Postgres and once on Azure AI
Search, same requests, same query worker code.

No Azure service is reachable from this machine. Unless ONTOFABRIC_AZURE_SEARCH_ENDPOINT and
ONTOFABRIC_AZURE_SEARCH_API_KEY are set, the Azure side is tests/azure_search_server.py, whose BM25 (k1 1.2, b 0.75,
a lower-case split analyzer without stemming or stop words) is not the service's `en.lucene`. Against it the
figures measure the adapter (the Azure projector, the filters, the check against Postgres, fusion without a
ceiling) and its cost, not the relevance the real service would give.

Run: .venv/bin/python -m tests.benchmarks.bench_azure_backend ../shared/eval/scifact-train --split train
"""

from __future__ import annotations

import argparse
import asyncio
import os
from contextlib import AsyncExitStack
from pathlib import Path

from pydantic import SecretStr
from rich.console import Console

from ontofabric.services.ops.beir import BeirDataset, load_beir
from ontofabric.services.ops.eval_report import EvalReport, render_table
from ontofabric.services.ops.evaluation import evaluate
from ontofabric.services.render import RichProgress
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import Endpoints, embedded_servers
from ontofabric.shared.settings import Settings
from tests.azure_search_server import AzureSearchServer

CONFIGS = ["keyword", "hybrid"]


async def run(endpoints: Endpoints, dataset: BeirDataset, console: Console) -> dict[str, EvalReport]:
    settings = Settings()
    async with AsyncExitStack() as stack:
        if settings.azure_search_endpoint is None:
            server = await stack.enter_async_context(AzureSearchServer(api_key="bench"))
            azure = {
                "azure_search_endpoint": server.endpoint,
                "azure_search_api_key": SecretStr("bench"),
                "insecure_http_secrets": True,  # the local stand-in speaks plain HTTP
            }
        else:
            azure = {}
        reports = {}
        for backend in ("postgres", "azure-ai-search"):
            extra = azure if backend != "postgres" else {}
            chosen = settings.model_copy(update={"keyword_backend": backend, **extra})
            with RichProgress(console) as progress:
                reports[backend] = await evaluate(chosen, endpoints, dataset, CONFIGS, progress)
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", type=Path, help="a BEIR-layout directory (corpus.jsonl, queries.jsonl, qrels/)")
    parser.add_argument("--split", default="test", help="the qrels split")
    args = parser.parse_args()
    configure_logging("WARNING", "console")
    console = Console()
    dataset = load_beir(args.dataset, args.split)
    with embedded_servers() as endpoints:
        reports = asyncio.run(run(endpoints, dataset, console))
    service = "the Azure service" if os.environ.get("ONTOFABRIC_AZURE_SEARCH_ENDPOINT") else "the local test server"
    for backend, report in reports.items():
        console.rule(f"keyword backend {backend}" + (f" ({service})" if backend != "postgres" else ""))
        console.print(f"load (embedding cached, projectors caught up): {report.load_seconds:.1f} s")
        render_table(report, lambda line: console.print(line, soft_wrap=True, markup=False))


if __name__ == "__main__":
    main()
