"""Benchmark: projection throughput with 1, 2 and 4 Postgres projector processes dividing 8 workspaces.

Each round starts a fresh database and deployment, starts the projector processes (`ontofabric projector` with
ONTOFABRIC_PROJECTOR_PARTITIONS=n and each its ONTOFABRIC_PROJECTOR_PARTITION), publishes the demo corpus (this
project's source tree, real embeddings) once into each of 8 workspaces, and times first publish -> the index's
position (the lowest ack floor of the partitions' consumers) past the last delta. Layouts take turns, round after
round, so that the machine's noise falls on each alike; the ratios compare each layout's median with one projector's.

Run: .venv/bin/python -m tests.benchmarks.bench_partitions [--rounds 3] [--layouts 1,2,4]
On a machine with few cores the projectors and PostgreSQL share them: read the ratios with the core count.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
from nats.js import JetStreamContext

from ontofabric.contracts import DeltaEnvelope, DocumentUpserted
from ontofabric.services.demo import project_root
from ontofabric.services.ingest.client import DeltaPublisher, envelope
from ontofabric.services.ingest.ingester import ChunkEmbedding, chunk_tree, to_document
from ontofabric.shared.db import migrate
from ontofabric.shared.embedder import build_embedder
from ontofabric.shared.embedding_cache import embed_with_signs
from ontofabric.shared.jetstream import connect, ensure_jetstream, projected_floor
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import EmbeddedRuntime, with_login
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names, Partition

WORKSPACES = 8
ONTOFABRIC = str(Path(sys.executable).parent / "ontofabric")


def corpus(settings: Settings) -> list[DocumentUpserted]:
    """The demo corpus as upserts, embedded once for every round."""
    embedder = build_embedder(settings)
    assert embedder is not None
    chunks = chunk_tree(project_root(), settings.max_content_bytes)
    embedded = embed_with_signs(embedder, [c.embedding_text for c in chunks])
    vectors = ChunkEmbedding.of(embedded, embedder.dimension, token_vectors=settings.token_vectors)
    return [
        DocumentUpserted(document=to_document(chunk, vector, embedder.model_name))
        for chunk, vector in zip(chunks, vectors, strict=True)
    ]


def _with_database(url: str, name: str) -> str:
    base, _, _ = url.rpartition("/")
    return f"{base}/{name}"


@dataclass
class FreshDeployment:
    settings: Settings
    names: Names
    js: JetStreamContext
    """The operator's."""
    projector_env: dict[str, str]
    """The environment of an `ontofabric projector` process of this deployment."""


@contextlib.asynccontextmanager
async def fresh_deployment(
    runtime: EmbeddedRuntime, base: Settings, prefix: str, **updates: Any
) -> AsyncIterator[FreshDeployment]:
    """A deployment of its own on the runtime's servers: its database (dropped after), its streams, an operator's
    connection, and what a projector process of it needs. ``updates``: settings besides ``base``."""
    assert runtime.endpoints is not None
    logins = runtime.nats_logins(prefix)
    server_url = runtime.endpoints.database_url
    admin = await asyncpg.connect(_with_database(server_url, "postgres"))
    await admin.execute(f'CREATE DATABASE "{prefix}"')
    database_url = _with_database(server_url, prefix)
    settings = base.model_copy(update={"subject_prefix": prefix, "database_url": database_url, **updates})
    await migrate(database_url, settings)
    names = Names(prefix)
    nats_server = runtime.endpoints.nats_url
    nc = await connect(with_login(nats_server, *logins["operator"]), "bench")
    try:
        js = nc.jetstream()
        await ensure_jetstream(js, names, settings)
        env = {k: v for k, v in os.environ.items() if not k.startswith("ONTOFABRIC_")} | {
            "ONTOFABRIC_NATS_URL": with_login(nats_server, *logins["projector"]),
            "ONTOFABRIC_DATABASE_URL": database_url,
            "ONTOFABRIC_SUBJECT_PREFIX": prefix,
            "ONTOFABRIC_PROJECTOR_PARTITIONS": str(settings.projector_partitions),
            "ONTOFABRIC_LOG_LEVEL": "WARNING",
        }
        yield FreshDeployment(settings, names, js, env)
    finally:
        await nc.close()
        await admin.execute(f'DROP DATABASE IF EXISTS "{prefix}" WITH (FORCE)')
        await admin.close()


async def one_round(
    runtime: EmbeddedRuntime, base: Settings, documents: list[DocumentUpserted], projectors: int
) -> tuple[float, int]:
    """Documents/s projected by ``projectors`` processes, and the deltas published."""
    prefix = "b" + uuid.uuid4().hex[:10]
    async with fresh_deployment(runtime, base, prefix, projector_partitions=projectors) as deployment:
        return await _project(deployment, documents, projectors)


async def _project(
    deployment: FreshDeployment, documents: list[DocumentUpserted], projectors: int
) -> tuple[float, int]:
    js, names, env = deployment.js, deployment.names, deployment.projector_env
    processes = [
        await asyncio.create_subprocess_exec(
            ONTOFABRIC, "projector", env=env | {"ONTOFABRIC_PROJECTOR_PARTITION": str(index)}
        )
        for index in range(projectors)
    ]
    try:
        durables = names.postgres_projector_durables(projectors)
        async with asyncio.timeout(120):  # every consumer made: the processes are up
            while len({c.name for c in await js.consumers_info(names.delta_stream)} & set(durables)) < projectors:
                await asyncio.sleep(0.1)
        workspaces = [f"team-{n}" for n in range(WORKSPACES)]
        deltas: list[DeltaEnvelope] = [envelope(ws, upsert) for ws in workspaces for upsert in documents]
        began = time.perf_counter()
        acks = await DeltaPublisher(js, names).publish_many(deltas)
        async with asyncio.timeout(1800):
            while await projected_floor(js, names, projectors) < acks[-1].seq:
                await asyncio.sleep(0.01)
        rate = len(deltas) / (time.perf_counter() - began)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            await asyncio.wait_for(process.wait(), 30)
    return rate, len(deltas)


async def run(runtime: EmbeddedRuntime, rounds: int, layouts: list[int]) -> None:
    base = Settings()
    documents = corpus(base)
    print(f"corpus: {len(documents)} chunks of {project_root().name} in each of {WORKSPACES} workspaces")
    for count in layouts:
        spread = Counter(
            next(i for i in range(count) if Partition(i, count).holds(f"x.delta.team-{n}.main"))
            for n in range(WORKSPACES)
        )
        print(f"{count} partition(s): workspaces per partition {[spread[i] for i in range(count)]}")
    rates: dict[int, list[float]] = {count: [] for count in layouts}
    for round_ in range(rounds):
        for count in layouts:
            rate, deltas = await one_round(runtime, base, documents, count)
            rates[count].append(rate)
            print(f"round {round_ + 1}: {count} projector(s): {deltas} deltas, {rate:.0f} documents/s", flush=True)
    one = statistics.median(rates[layouts[0]])
    for count in layouts:
        median = statistics.median(rates[count])
        runs = ", ".join(f"{r:.0f}" for r in rates[count])
        print(f"{count} projector(s): median {median:.0f} documents/s ({runs}); {median / one:.2f}x of {layouts[0]}")
    print(f"cores: {os.cpu_count()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs every layout once")
    parser.add_argument("--layouts", default="1,2,4", help="projector counts, separated by commas")
    args = parser.parse_args()
    configure_logging("WARNING", "console")
    with (
        tempfile.TemporaryDirectory(prefix="ontofabric-bench-") as data_dir,
        EmbeddedRuntime(Settings(), Path(data_dir)) as runtime,
    ):
        asyncio.run(run(runtime, args.rounds, [int(n) for n in args.layouts.split(",")]))


if __name__ == "__main__":
    main()
