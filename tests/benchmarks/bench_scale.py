"""Scale benchmark (issue #23): projection, query latency, freshness, memory, storage and cold start at 100,000
chunks or more, each against a reference measured in the same run.

The corpus is built from real texts: the documents of the BEIR-layout sets given, repeated until there are
``--documents`` of them. The first copy of each is the document as it is, with its real MiniLM vector and token
signs (from the embedding cache, computed on first use); each further copy drops about a tenth of its words,
appends a few words of another document, and carries the original's vector plus Gaussian noise (cosine about 0.93
to it) and the original's token signs. The deltas go onto JetStream first; then a projector starts and applies
them, so projection is timed apart from publishing.

In the same run:
(a) projection documents/s against COPY of the same rows into a table with the recipe's indexes (HNSW over the
    vectors, GIN over a tsvector PostgreSQL computes from the content);
(b) query latency p50/p95/p99 and queries/s over NATS to one query worker process with its cache off, at each
    ``--concurrency``, against the reference: the query embedded in this process, then pgvector-python's
    single-SQL RRF recipe (dense top 50 and ts_rank_cd top 50, k 60, hnsw.ef_search 100) over the same rows, with
    the GIN index it reads built on them for these runs only (the deployment keeps none);
(c) freshness, publish to ontologyVersion, while documents arrive at ``--rate`` a second and queries run
    ``--freshness-in-flight`` at a time (8);
(d) the query worker's peak RSS; PostgreSQL bytes per document, token signs' share of them, and the reference
    table's bytes per document;
(e) the query worker's cold start: from starting the process to its first answer.

Run: .venv/bin/python -m tests.benchmarks.bench_scale ../shared/eval/cosqa-dev ../shared/eval/scifact-train
     [--documents 100000] [--concurrency 1,8,32] [--queries 200] [--rate 200] [--freshness-seconds 30]
     [--freshness-in-flight 8] [--data-dir DIR]
--data-dir keeps the embedded servers' data in DIR: a later run with the same DIR and --documents (of this
benchmark or of bench_keyword) measures the corpus already projected there instead of loading it again (an hour
at 1,000,000 documents); projection is then not measured, and the COPY reference only when DIR has none yet.
Compare ratios, not absolute times: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import numpy as np
import numpy.typing as npt
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from pgvector.asyncpg import register_vector
from rich.console import Console

from ontofabric.contracts import DocumentUpserted, ErrorReply, OntologyVersionChanged, SemanticDocument
from ontofabric.contracts.documents import DocumentMetadata, TokenVectors
from ontofabric.services.app import Roles, start_workers
from ontofabric.services.ingest.client import DeltaPublisher, envelope
from ontofabric.services.ops.beir import document_text, load_beir
from ontofabric.services.ops.measures import percentile
from ontofabric.services.query.client import QueryClient
from ontofabric.services.render import RichProgress
from ontofabric.shared.db import migrate
from ontofabric.shared.embedder import Embedder, load_embedder
from ontofabric.shared.embedding_cache import EmbeddingCache
from ontofabric.shared.jetstream import ack_floor, connect, ensure_jetstream
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import EmbeddedRuntime, Endpoints
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names

from .bench_freshness import first_at_or_after
from .bench_query_load import RRF_RECIPE, Measure, answered, drive, recipe_index
from .faults_query import start_worker

NOISE_SIGMA = 0.02
"""Per dimension; a unit vector plus this noise over 384 dimensions keeps a cosine of about 0.93 to it."""
PUBLISH_BATCH = 1000
STALL_S = 300.0
"""The projection wait gives up when the projector applies nothing for this long."""
WORKSPACE = "scale"
"""The corpus's workspace, the same in every run, so that a kept data directory can be measured again."""

COPY_TABLE = """
CREATE TABLE scale_copy (
    id            text PRIMARY KEY,
    content       text NOT NULL,
    embedding     vector({dimension}),
    search_vector tsvector GENERATED ALWAYS AS (to_tsvector('{config}'::regconfig, content)) STORED
);
CREATE INDEX scale_copy_hnsw ON scale_copy USING hnsw (embedding vector_cosine_ops);
CREATE INDEX scale_copy_gin ON scale_copy USING gin (search_vector);
"""


@dataclass(frozen=True)
class Base:
    """The real documents the corpus repeats, with their real vectors and token signs."""

    texts: list[str]
    vectors: npt.NDArray[np.float32]
    signs: list[bytes]


@dataclass(frozen=True)
class Synthetic:
    id: str
    text: str
    vector: npt.NDArray[np.float32]
    signs: bytes


def synthesize(base: Base, start: int, count: int) -> Iterator[Synthetic]:
    """Documents ``start`` to ``start + count`` of the repeated corpus; the same number gives the same document."""
    size = len(base.texts)
    for n in range(start, start + count):
        original, copy = n % size, n // size
        if copy == 0:
            yield Synthetic(f"s{n}", base.texts[original], base.vectors[original], base.signs[original])
            continue
        rng = np.random.default_rng(n)
        words = base.texts[original].split(" ")
        kept = [w for w, keep in zip(words, rng.random(len(words)) > 0.1, strict=True) if keep] or words
        donor = base.texts[int(rng.integers(size))].split(" ")
        text = " ".join(kept + donor[:8])
        vector = base.vectors[original] + np.asarray(rng.normal(0.0, NOISE_SIGMA, base.vectors.shape[1]), np.float32)
        yield Synthetic(f"s{n}", text, vector / np.linalg.norm(vector), base.signs[original])


def as_document(item: Synthetic, model: str) -> SemanticDocument:
    return SemanticDocument(
        id=item.id,
        content=item.text,
        object_type="bench.Document",
        source_domain="scale",
        metadata=DocumentMetadata(chunk_level="doc", provenance="ingested"),
        embedding=[float(x) for x in item.vector],
        embedding_model=model,
        token_vectors=TokenVectors.of_signs(len(item.vector), item.signs),
    )


def load_base(
    datasets: Sequence[Path], settings: Settings, embedder: Embedder, progress: RichProgress
) -> tuple[Base, list[str]]:
    """The sets' documents embedded (from the cache where it has them) and their queries, shuffled."""
    texts: list[str] = []
    queries: list[str] = []
    for directory in datasets:
        split = sorted((directory / "qrels").glob("*.tsv"))[0].stem
        dataset = load_beir(directory, split)
        texts.extend(document_text(entry) for entry in dataset.corpus)
        queries.extend(text for text in dataset.queries.values() if text.strip())
    cache = EmbeddingCache(settings.cache_dir / "embeddings.sqlite")
    try:
        progress.stage("embed the originals", len(texts))
        embedded = cache.embed(embedder, texts, on_progress=lambda n: progress.advance("embed the originals", n))
    finally:
        cache.close()
    random.Random(1).shuffle(queries)
    return Base(texts, embedded.vectors, embedded.token_signs), queries


async def publish(
    js: JetStreamContext, names: Names, workspace: str, base: Base, count: int, model: str, progress: RichProgress
) -> int:
    """Every document as an upsert delta; the last stream sequence."""
    publisher = DeltaPublisher(js, names)
    progress.stage("publish", count)
    last = 0
    for start in range(0, count, PUBLISH_BATCH):
        batch = min(PUBLISH_BATCH, count - start)
        deltas = [
            envelope(workspace, DocumentUpserted(document=as_document(item, model)), producer="bench-scale")
            for item in synthesize(base, start, batch)
        ]
        acks = await publisher.publish_many(deltas)
        last = max(last, *(a.seq for a in acks))
        progress.advance("publish", batch)
    return last


async def projected_by(js: JetStreamContext, names: Names, last_seq: int, count: int, progress: RichProgress) -> None:
    """Wait until the projector has applied every delta up to ``last_seq``, showing how far it is."""
    first = last_seq - count
    progress.stage("project", count)
    done, moved = 0, time.monotonic()
    while done < count:
        await asyncio.sleep(0.5)
        now = max(0, await ack_floor(js, names.delta_stream, names.postgres_projector_durable) - first)
        if now > done:
            moved = time.monotonic()
        elif time.monotonic() - moved > STALL_S:
            raise SystemExit(f"the projector applied nothing for {STALL_S:.0f} s at {done} of {count} deltas")
        progress.advance("project", now - done)
        done = now


async def projected_documents(database_url: str, wanted: int) -> int:
    """Live documents of the benchmark's workspace in a kept data directory: 0 when there are none, else at least
    ``wanted`` (more: those an earlier freshness run added); fewer stops the run."""
    conn = await asyncpg.connect(database_url)
    try:
        if await conn.fetchval("SELECT to_regclass('ontology_versions')") is None:
            return 0
        count = await conn.fetchval("SELECT sum(doc_count) FROM ontology_versions WHERE workspace = $1", WORKSPACE)
    finally:
        await conn.close()
    if 0 < int(count or 0) < wanted:
        raise SystemExit(f"the data directory holds {count} documents, fewer than {wanted}")
    return int(count or 0)


async def copy_reference(pool: asyncpg.Pool, base: Base, count: int, config: str, progress: RichProgress) -> float:
    """Seconds COPY takes to write the same rows into the reference table (building the rows is not counted)."""
    async with pool.acquire() as conn:
        await conn.execute(COPY_TABLE.format(dimension=base.vectors.shape[1], config=config))
        progress.stage("COPY reference", count)
        spent = 0.0
        for start in range(0, count, PUBLISH_BATCH):
            batch = min(PUBLISH_BATCH, count - start)
            rows = [(s.id, s.text, s.vector) for s in synthesize(base, start, batch)]
            began = time.perf_counter()
            await conn.copy_records_to_table("scale_copy", records=rows, columns=["id", "content", "embedding"])
            spent += time.perf_counter() - began
            progress.advance("COPY reference", batch)
    return spent


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


async def storage(pool: asyncpg.Pool, workspace: str, documents: int, reference_rows: int) -> str:
    """PostgreSQL's bytes per document for the deployment's tables (``documents`` in the workspace), the token
    signs' share, and the reference table's (``reference_rows`` in it)."""
    ours = int(
        await pool.fetchval(
            "SELECT sum(pg_total_relation_size(oid)) FROM pg_class"
            " WHERE relkind = 'r' AND relnamespace = 'public'::regnamespace AND relname <> 'scale_copy'"
        )
    )
    largest = await pool.fetch(
        "SELECT relname, pg_total_relation_size(oid) AS bytes FROM pg_class"
        " WHERE relkind = 'r' AND relnamespace = 'public'::regnamespace AND relname <> 'scale_copy'"
        " ORDER BY bytes DESC LIMIT 4"
    )
    signs = await pool.fetchval(
        "SELECT sum(pg_column_size(token_signs)) FROM documents WHERE workspace = $1", workspace
    )
    # Per row of its own: a kept corpus may hold more documents than the reference table.
    reference = await pool.fetchval("SELECT pg_total_relation_size('scale_copy')") / reference_rows * documents
    parts = ", ".join(f"{r['relname']} {r['bytes'] / documents / 1024:.1f}" for r in largest)
    return (
        f"storage per document: {ours / documents / 1024:.1f} KB (largest tables, KB per document: {parts}); "
        f"token signs {signs / documents / 1024:.1f} KB ({signs / ours:.0%}); "
        f"reference table {reference / documents / 1024:.1f} KB; ratio {ours / reference:.2f}"
    )


async def cold_start(client: QueryClient, workspace: str, started: float) -> float:
    """Seconds from ``started`` to the worker's first answer."""
    while True:
        try:
            reply = await client.query(workspace, {"semanticQuery": "warm up", "topK": 1})
            if not isinstance(reply, ErrorReply):
                return time.perf_counter() - started
        except (TimeoutError, NoRespondersError):  # not listening yet
            pass
        await asyncio.sleep(0.1)


async def freshness(
    nc: Client,
    js: JetStreamContext,
    names: Names,
    workspace: str,
    base: Base,
    first: int,
    model: str,
    rate: float,
    seconds: float,
    client: QueryClient,
    queries: list[str],
    in_flight: int,
) -> str:
    """Publish at ``rate`` documents/s for ``seconds`` with ``in_flight`` queries in flight (0: none);
    publish → ontologyVersion."""
    announced: list[tuple[int, float]] = []

    async def on_version(msg: Msg) -> None:
        announced.append((OntologyVersionChanged.model_validate_json(msg.data).stream_seq, time.monotonic()))

    subscription = await nc.subscribe(names.version_event_subject(workspace, "main"), cb=on_version)
    publisher = DeltaPublisher(js, names)
    published: dict[int, float] = {}
    done = asyncio.Event()

    stages: dict[str, list[float]] = {}

    async def ask(text: str) -> bool:
        return answered(await client.query(workspace, {"semanticQuery": text, "topK": 10}), stages)

    async def query_load() -> Measure:
        measures = Measure([], 0.0)
        began = time.perf_counter()
        cursor = 0
        while in_flight and not done.is_set():
            measure = await drive(queries[cursor : cursor + in_flight], in_flight, ask)
            cursor = (cursor + in_flight) % max(len(queries) - in_flight, 1)
            measures.latencies_ms.extend(measure.latencies_ms)
            measures.errors += measure.errors
        measures.wall_s = time.perf_counter() - began
        return measures

    load = asyncio.ensure_future(query_load())
    count = int(rate * seconds)
    began = time.monotonic()
    for k, item in enumerate(synthesize(base, first, count)):
        await asyncio.sleep(max(0.0, began + k / rate - time.monotonic()))
        delta = envelope(workspace, DocumentUpserted(document=as_document(item, model)), producer="bench-scale")
        sent = time.monotonic()
        (ack,) = await publisher.publish_many([delta])
        published[ack.seq] = sent
    achieved = count / (time.monotonic() - began)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (announced and announced[-1][0] >= max(published)):
        await asyncio.sleep(0.05)
    done.set()
    queried = await load
    await subscription.unsubscribe()
    waits = [(at - published[seq]) * 1000 for seq in published if (at := first_at_or_after(announced, seq))]
    if not waits:
        return f"freshness: none of {count} documents was announced within 60 s of the last publish"
    report = (
        f"freshness at {achieved:.0f} documents/s ({len(waits)} of {count} announced): p50 "
        f"{percentile(waits, 0.5):.1f} ms, p95 {percentile(waits, 0.95):.1f} ms, max {max(waits):.1f} ms"
    )
    if not in_flight:
        return f"{report}; no queries meanwhile"
    p50, p95, _ = queried.row()
    return (
        f"{report}; queries meanwhile, {in_flight} in flight: p50 {p50:.1f} ms, p95 {p95:.1f} ms "
        f"({queried.errors} errors)"
    )


def latency_row(level: int, ours: Measure, recipe: Measure) -> str:
    def figures(m: Measure) -> tuple[float, float, float, float]:
        return (
            percentile(m.latencies_ms, 0.5),
            percentile(m.latencies_ms, 0.95),
            percentile(m.latencies_ms, 0.99),
            len(m.latencies_ms) / m.wall_s,
        )

    (p50, p95, p99, qps), (r50, r95, r99, rqps) = figures(ours), figures(recipe)
    errors = f" ({ours.errors} errors)" if ours.errors else ""
    return (
        f"| {level} | {p50:.1f} | {p95:.1f} | {p99:.1f} | {qps:.1f}{errors} | {r50:.1f} | {r95:.1f} | {r99:.1f} | "
        f"{rqps:.1f} | {p50 / r50:.2f} | {p95 / r95:.2f} | {qps / rqps:.2f} |"
    )


async def run(endpoints: Endpoints, runtime_dir: Path, args: argparse.Namespace) -> None:
    settings = Settings(nats_url=endpoints.nats_url_as("operator"), database_url=endpoints.database_url)
    names = Names(settings.subject_prefix)
    workspace = WORKSPACE
    levels = [int(c) for c in args.concurrency.split(",")]
    async with AsyncExitStack() as stack:
        progress = stack.enter_context(RichProgress(Console()))
        embedder = load_embedder(settings)  # embeds the originals, then the reference's queries
        base, queries = await asyncio.to_thread(load_base, args.datasets, settings, embedder, progress)
        needed = args.queries * len(levels)
        if len(queries) < needed + 8:
            raise SystemExit(f"{len(queries)} queries, {needed + 8} needed: lower --queries")
        documents = await projected_documents(endpoints.database_url, args.documents)
        model = settings.embedding_model
        await migrate(endpoints.database_url, settings)
        nc = await connect(endpoints.nats_url_as("operator"), "bench-scale")
        stack.push_async_callback(nc.close)
        js = nc.jetstream()
        await ensure_jetstream(js, names, settings)
        pool = await asyncpg.create_pool(
            endpoints.database_url,
            min_size=2,
            max_size=max(levels) + 2,
            init=register_vector,
            server_settings={"hnsw.ef_search": str(settings.hnsw_ef_search)},
        )
        stack.push_async_callback(pool.close)

        projection_s, last_seq = None, 0
        if documents == 0:
            began = time.perf_counter()
            last_seq = await publish(js, names, workspace, base, args.documents, model, progress)
            print(f"published {args.documents} deltas in {time.perf_counter() - began:.0f} s", flush=True)
        await start_workers(stack, settings, endpoints, Roles(query=False, azure_projector=False))
        if documents == 0:
            began = time.perf_counter()
            await projected_by(js, names, last_seq, args.documents, progress)
            projection_s = time.perf_counter() - began
            documents = args.documents
        else:
            print(f"the data directory's {documents} documents, projected in an earlier run: projection not measured")
        if await pool.fetchval("SELECT to_regclass('scale_copy')") is None:
            copy_s = await copy_reference(pool, base, args.documents, settings.text_search_config, progress)
            copied = args.documents / copy_s
            print(f"COPY into the reference table: {copied:.0f} documents/s ({copy_s:.0f} s)", flush=True)
            if projection_s is not None:
                projected = args.documents / projection_s
                print(f"projection: {projected:.0f} documents/s ({projection_s:.0f} s); ratio {projected / copied:.2f}")
        await pool.execute("VACUUM ANALYZE")
        print(await storage(pool, workspace, documents, args.documents), flush=True)

        client = QueryClient(nc, names, timeout_s=60)
        started = time.perf_counter()
        worker_env = dict(pair.split("=", 1) for pair in args.worker_env)
        worker = start_worker(endpoints, runtime_dir / "query-worker", worker_env)
        stack.callback(worker.wait, 30)
        stack.callback(worker.terminate)
        print(f"query worker cold start to its first answer: {await cold_start(client, workspace, started):.1f} s",
              flush=True)  # fmt: skip

        stages: dict[str, list[float]] = {}

        async def ask_ontofabric(text: str) -> bool:
            return answered(await client.query(workspace, {"semanticQuery": text, "topK": 10}), stages)

        async def ask_recipe(text: str) -> bool:
            vector = await embedder.on_model_thread(lambda: embedder.embed_query(text))
            return bool(await pool.fetch(RRF_RECIPE, workspace, vector, text, settings.text_search_config))

        print("| in flight | p50 ms | p95 ms | p99 ms | queries/s | recipe p50 | p95 | p99 | queries/s | p50 ratio | "
              "p95 ratio | throughput ratio |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        inside: dict[int, str] = {}
        async with recipe_index(pool):
            for n, level in enumerate(levels):
                batch = queries[n * args.queries : (n + 1) * args.queries]
                stages.clear()
                recipe = await drive(batch, level, ask_recipe)
                ours = await drive(batch, level, ask_ontofabric)
                print(latency_row(level, ours, recipe), flush=True)
                inside[level] = ", ".join(f"{stage} {percentile(ms, 0.5):.1f}" for stage, ms in sorted(stages.items()))
        for level, medians in inside.items():
            print(f"worker stage medians (ms), {level} in flight: {medians}")
        print(f"query worker peak RSS: {peak_rss_mb(worker.pid):.0f} MB", flush=True)
        report = await freshness(
            nc, js, names, workspace, base, args.documents, model, args.rate, args.freshness_seconds, client,
            queries[needed:], args.freshness_in_flight,
        )  # fmt: skip
        print(report, flush=True)
        print(f"query worker peak RSS after the freshness run: {peak_rss_mb(worker.pid):.0f} MB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("datasets", type=Path, nargs="+", help="BEIR-layout directories whose texts are repeated")
    parser.add_argument("--documents", type=int, default=100_000, help="documents in the corpus (default 100000)")
    parser.add_argument("--concurrency", default="1,8,32", help="requests in flight, comma-separated")
    parser.add_argument("--queries", type=int, default=200, help="distinct queries per concurrency level")
    parser.add_argument("--rate", type=float, default=200.0, help="documents/s during the freshness run")
    parser.add_argument("--freshness-seconds", type=float, default=30.0, help="how long the freshness run lasts")
    parser.add_argument(
        "--freshness-in-flight", type=int, default=8, help="queries in flight during the freshness run (0: none)"
    )
    parser.add_argument(
        "--worker-env", action="append", default=[], metavar="NAME=VALUE",
        help="an environment variable for the query worker only (a lever to measure); repeatable",
    )  # fmt: skip
    parser.add_argument("--data-dir", type=Path, help="keep the servers' data here, and reuse a corpus loaded there")
    args = parser.parse_args()
    if args.freshness_in_flight < 0:
        parser.error("--freshness-in-flight is 0 or more")
    configure_logging("WARNING", "console")
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as scratch:
        runtime_dir = Path(scratch)
        with EmbeddedRuntime(Settings(), args.data_dir or runtime_dir / "data") as runtime:
            assert runtime.endpoints is not None
            asyncio.run(run(runtime.endpoints, runtime_dir, args))


if __name__ == "__main__":
    main()
