"""``ontofabric demo``: everything on a fresh data directory, the project's own source as the corpus."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

import ontofabric.services
from ontofabric.contracts import ErrorReply
from ontofabric.shared.embedding_cache import EmbeddingCache
from ontofabric.shared.jetstream import connect, wait_projected
from ontofabric.shared.onnx_models import second_embedder
from ontofabric.shared.runtime import EmbeddedRuntime, Endpoints
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names

from .app import Roles, start_workers
from .ingest.ingester import Ingester, IngestReport
from .query.client import QueryClient
from .render import RichProgress, render_reply

WORKSPACE = "ontofabric"

QUERIES: list[dict[str, Any]] = [
    {"semanticQuery": "how are deltas that can never apply dead-lettered", "topK": 5},
    {"semanticQuery": "reciprocal rank fusion of dense and keyword results", "topK": 5},
    {"semanticQuery": "start an embedded PostgreSQL server as an unprivileged user", "topK": 5, "chunkLevel": "method"},
    {"semanticQuery": "how do I run the tests", "topK": 3, "chunkLevel": "doc"},
    {"semanticQuery": "what uses the embedder", "topK": 5},
    {"semanticQuery": "what uses the embedder", "topK": 3, "followLinks": True},
    {"semanticQuery": "query options for fusion", "topK": 3, "objectType": "contracts._base.StrictRequest"},
]


def project_root() -> Path:
    """The tree the demo ingests: the checkout in a development install, the installed package otherwise."""
    return Path(ontofabric.services.__file__).resolve().parent.parent


DEMO_EXCLUDE = ("tests",)
"""What the demo leaves out of a checkout (any directory named so): the test suite, which no demo query asks about,
was 37 % of the chunks to embed on a fresh machine (docs/benchmarks.md, "Demo wall time"), and grows with every
change."""


@dataclass(frozen=True)
class DemoTimings:
    total_s: float
    ingest: IngestReport
    caught_up_s: float
    """From the first publish until the projector had applied the last delta."""


async def _run(settings: Settings, endpoints: Endpoints, console: Console) -> DemoTimings:
    started = time.perf_counter()
    names = Names(settings.subject_prefix)
    async with AsyncExitStack() as stack:
        embedder = await start_workers(stack, settings, endpoints, Roles())
        # As the roles a deployment would use: the ingester publishes, a client asks (docs/security.md).
        nc = await connect(endpoints.nats_url_as("ingest"), "ontofabric-demo-ingest", settings)
        stack.push_async_callback(nc.close)
        asking = await connect(endpoints.nats_url_as("client"), "ontofabric-demo-client", settings)
        stack.push_async_callback(asking.close)
        js = nc.jetstream()
        root = project_root()
        console.print(f"[bold]Ingesting[/bold] {root} into workspace [cyan]{WORKSPACE}[/cyan]")
        with RichProgress(console) as progress:
            cache = EmbeddingCache(settings.cache_dir / "embeddings.sqlite")
            stack.callback(cache.close)
            second = await asyncio.to_thread(second_embedder, settings)
            ingester = Ingester(
                js, names, embedder, settings.max_content_bytes, progress, cache, settings.token_vectors, second,
                settings.ingest_max_file_bytes,
            )  # fmt: skip
            report = await ingester.ingest(root, WORKSPACE, exclude=DEMO_EXCLUDE)
        wait_started = time.perf_counter()
        if report.awaited_sequence is not None:
            await wait_projected(js, names, settings.projector_partitions, report.awaited_sequence, timeout_s=600)
        caught_up_s = report.publish_s + time.perf_counter() - wait_started
        console.print(
            f"{report.files} files → {report.chunks} chunks, embedded in {report.embed_s:.1f}s; "
            f"{report.upserts} upserts and {report.deletes} deletes projected {caught_up_s:.2f}s after the "
            "first publish"
        )
        await asyncio.sleep(0.2)  # let the query worker see the new ontologyVersion through its KV watch
        client = QueryClient(asking, names)
        for query in [*QUERIES, QUERIES[0]]:  # the repeat shows a cache hit
            reply = await client.query(WORKSPACE, query)
            render_reply(console, query, reply)
            if isinstance(reply, ErrorReply):
                raise SystemExit(f"demo query failed: {reply.error.message}")
    return DemoTimings(time.perf_counter() - started, report, caught_up_s)


def run_demo(settings: Settings, console: Console, keep: bool) -> DemoTimings:
    data_dir = Path(tempfile.mkdtemp(prefix="ontofabric-demo-"))
    data_dir.chmod(0o755)  # our own scratch directory: an unprivileged embedded postgres may traverse it
    demo_settings = settings.model_copy(update={"nats_url": None, "database_url": None, "data_dir": data_dir})
    console.print(f"[bold]Fresh data directory[/bold] {data_dir}")
    try:
        with EmbeddedRuntime(demo_settings, data_dir) as runtime:
            assert runtime.endpoints is not None
            return asyncio.run(_run(demo_settings, runtime.endpoints, console))
    finally:
        if keep:
            console.print(f"kept {data_dir}")
        else:
            shutil.rmtree(data_dir, ignore_errors=True)
