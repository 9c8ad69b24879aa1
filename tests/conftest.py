"""Shared fixtures: one real nats-server and one real PostgreSQL per test session, isolated per test.

Each test gets its own subject prefix (so its own streams, consumers and buckets) and its own database. Set
ONTOFABRIC_TEST_NATS_URL and ONTOFABRIC_TEST_DATABASE_URL to run against servers you started yourself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import nats.errors
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ontofabric.contracts import DeltaEnvelope, DocumentDeleted, DocumentUpserted, QueryResponse, TokenVectors
from ontofabric.services.ingest.client import DeltaPublisher
from ontofabric.services.projector.worker import ProjectorService
from ontofabric.services.query.client import QueryClient
from ontofabric.services.query.core import Reranker
from ontofabric.services.query.worker import QueryService
from ontofabric.shared.embedder import Embedder, build_embedder
from ontofabric.shared.jetstream import connect, ensure_jetstream, wait_projected
from ontofabric.shared.late_interaction import pack_signs
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.nats_auth import NatsRole, NatsUser, render_config
from ontofabric.shared.runtime import (
    EmbeddedRuntime,
    Endpoints,
    ManagedProcess,
    _spawn,
    _wait_until,
    nats_server_binary,
    with_login,
)
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names
from ontofabric.shared.telemetry import configure_telemetry

from .factories import document, upsert

METRICS = InMemoryMetricReader()
SPANS = InMemorySpanExporter()


def pytest_configure(config: pytest.Config) -> None:
    configure_logging("WARNING", "console")
    configure_telemetry("ontofabric-tests", extra_readers=(METRICS,), extra_spans=(SimpleSpanProcessor(SPANS),))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The test tiers: a test that uses the session's servers (through any fixture) or starts its own (``slow``)
    is marked ``servers``; ``pytest -m 'not servers'`` runs the others alone."""
    for item in items:
        if "servers" in getattr(item, "fixturenames", ()) or item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.servers)


@pytest.fixture(scope="session")
def embedder() -> Embedder:
    """The real all-MiniLM-L6-v2, loaded once per session."""
    built = build_embedder(Settings(embedder="local"))
    assert built is not None
    return built


@pytest.fixture(scope="session")
def embedded() -> Iterator[EmbeddedRuntime | None]:
    """The session's embedded servers; None when ONTOFABRIC_TEST_NATS_URL and ONTOFABRIC_TEST_DATABASE_URL name
    servers started elsewhere (their URLs then carry whatever credentials they need)."""
    if os.environ.get("ONTOFABRIC_TEST_NATS_URL") and os.environ.get("ONTOFABRIC_TEST_DATABASE_URL"):
        yield None
        return
    # Not under pytest's base directory: pytest keeps it 0700 and resets it at every session's start, and the
    # embedded PostgreSQL, run as its own unprivileged user, would need o+x there.
    with (
        tempfile.TemporaryDirectory(prefix="ontofabric-test-servers-") as data_dir,
        EmbeddedRuntime(Settings(), Path(data_dir)) as runtime,
    ):
        yield runtime


@pytest.fixture(scope="session")
def servers(embedded: EmbeddedRuntime | None) -> Endpoints:
    """The servers' endpoints, with the embedded nats-server's logins of the default deployment ("ontofabric")."""
    if embedded is None:
        return Endpoints(os.environ["ONTOFABRIC_TEST_NATS_URL"], os.environ["ONTOFABRIC_TEST_DATABASE_URL"])
    assert embedded.endpoints is not None
    return embedded.endpoints


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


class RecordedProgress:
    """The Progress port of long runs (ingest, eval, rebuild), recording each stage's total and how far it got."""

    def __init__(self) -> None:
        self.totals: dict[str, int] = {}
        self.done: Counter[str] = Counter()

    def stage(self, name: str, total: int) -> None:
        self.totals[name] = total
        self.done[name] = 0

    def advance(self, name: str, amount: int = 1) -> None:
        self.done[name] += amount


@dataclass
class Deployment:
    """One isolated deployment inside the shared servers."""

    settings: Settings
    names: Names
    nc: Client
    js: JetStreamContext
    publisher: DeltaPublisher

    nats_logins: dict[str, tuple[str, str]]

    @property
    def nats_url(self) -> str:
        """The operator's URL: what the tests themselves use (the settings carry it)."""
        assert self.settings.nats_url is not None
        return self.settings.nats_url

    def nats_url_as(self, role: NatsRole) -> str:
        """The URL a part playing ``role`` connects with: its own user, with only that role's permissions."""
        login = self.nats_logins.get(role)
        return self.nats_url if login is None else with_login(self.nats_url_of_server, *login)

    @property
    def nats_url_of_server(self) -> str:
        parts = urlsplit(self.nats_url)
        return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))

    @property
    def database_url(self) -> str:
        assert self.settings.database_url is not None
        return self.settings.database_url

    def env(self) -> dict[str, str]:
        """Environment for a worker subprocess of this deployment."""
        values = self.settings.model_dump(exclude_none=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("ONTOFABRIC_")}
        # As a variable is written: a list as JSON.
        env.update(
            {
                f"ONTOFABRIC_{k.upper()}": json.dumps(v) if isinstance(v, list | tuple) else str(v)
                for k, v in values.items()
            }
        )
        return env

    async def wait_projected(self, stream_seq: int, timeout_s: float = 30.0) -> None:
        await wait_projected(self.js, self.names, self.settings.projector_partitions, stream_seq, timeout_s)

    @contextlib.asynccontextmanager
    async def database_outage(self) -> AsyncIterator[None]:
        """The deployment's database refuses new connections and loses its open ones until the block ends."""
        database = self.settings.subject_prefix
        admin = await asyncpg.connect(with_database(self.database_url, "postgres"))
        try:
            await admin.execute(f'ALTER DATABASE "{database}" WITH ALLOW_CONNECTIONS false')
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
                database,
            )
            yield
        finally:
            await admin.execute(f'ALTER DATABASE "{database}" WITH ALLOW_CONNECTIONS true')
            await admin.close()

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[asyncpg.Connection]:
        """A connection of its own to the deployment's database, for holding locks or a transaction open."""
        conn = await asyncpg.connect(self.database_url)
        try:
            yield conn
        finally:
            await conn.close()

    async def fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        async with self.session() as conn:
            return list(await conn.fetch(query, *args))


Key = tuple[str, str]
"""A document's (workspace, id)."""
Row = tuple[bool, str, int]
"""A document's (deleted, content, stream sequence)."""


def fold(stored: Iterable[tuple[int, DeltaEnvelope]]) -> dict[Key, Row]:
    """Last writer per document over (stream sequence, delta) in stream order: what the index must hold."""
    expected: dict[Key, Row] = {}
    for seq, delta in stored:
        payload = delta.payload
        if isinstance(payload, DocumentUpserted):
            expected[(delta.workspace, payload.document.id)] = (False, payload.document.content, seq)
        else:
            assert isinstance(payload, DocumentDeleted)
            expected[(delta.workspace, payload.document_id)] = (True, "", seq)
    return expected


async def projected_rows(deployment: Deployment, where: str = "") -> dict[Key, Row]:
    """The documents table's rows (``where``: an SQL condition to narrow them), as :func:`fold` gives them."""
    rows = await deployment.fetch(f"SELECT workspace, id, deleted, content, stream_seq FROM documents {where}")
    return {(r["workspace"], r["id"]): (r["deleted"], r["content"], r["stream_seq"]) for r in rows}


@pytest.fixture
def deployment_prefix() -> str:
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def nats_logins(embedded: EmbeddedRuntime | None, deployment_prefix: str) -> dict[str, tuple[str, str]]:
    """This deployment's users on the embedded nats-server, one per role (added to the running server)."""
    return embedded.nats_logins(deployment_prefix) if embedded is not None else {}


@pytest.fixture
def deployment_settings(
    servers: Endpoints, deployment_prefix: str, nats_logins: dict[str, tuple[str, str]]
) -> Settings:
    prefix = deployment_prefix
    operator = nats_logins.get("operator")
    return Settings(
        nats_url=with_login(servers.nats_url, *operator) if operator is not None else servers.nats_url,
        database_url=with_database(servers.database_url, prefix),
        subject_prefix=prefix,
        projector_ack_wait_s=2.0,
        projector_batch_timeout_s=0.05,
        embedder="none",
        data_dir=Path(".ontofabric-test") / prefix,
    )


@contextlib.asynccontextmanager
async def open_deployment(
    settings: Settings, servers_database_url: str, nats_logins: dict[str, tuple[str, str]]
) -> AsyncIterator[Deployment]:
    """A deployment named by ``settings.subject_prefix``: its own database on the PostgreSQL server of
    ``servers_database_url``, its streams and buckets made as its parts make them; all removed afterwards."""
    database = settings.subject_prefix
    admin = await asyncpg.connect(with_database(servers_database_url, "postgres"))
    await admin.execute(f'CREATE DATABASE "{database}"')
    assert settings.nats_url is not None
    nc = await connect(settings.nats_url, "tests")
    js = nc.jetstream()
    names = Names(settings.subject_prefix)
    await ensure_jetstream(js, names, settings)
    try:
        yield Deployment(settings, names, nc, js, DeltaPublisher(js, names), nats_logins)
    finally:
        for stream in await js.streams_info():
            if stream.config.name in names.streams:
                await js.delete_stream(stream.config.name)
        await nc.close()
        await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        await admin.close()


@pytest.fixture
async def deployment(
    deployment_settings: Settings, servers: Endpoints, nats_logins: dict[str, tuple[str, str]]
) -> AsyncIterator[Deployment]:
    async with open_deployment(deployment_settings, servers.database_url, nats_logins) as opened:
        yield opened


@pytest.fixture
async def projector(deployment: Deployment) -> AsyncIterator[ProjectorService]:
    """The deployment's projector, running in this process."""
    service = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


@pytest.fixture
async def impatient_projector(deployment: Deployment) -> AsyncIterator[ProjectorService]:
    """A projector whose writes give up on a lock after 300 ms: a delta behind a held lock is sent back for a retry."""
    settings = deployment.settings.model_copy(update={"statement_timeout_ms": 300})
    service = ProjectorService(settings, deployment.nats_url_as("projector"), deployment.database_url)
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


@pytest.fixture(scope="session")
def tiny_cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer BERT cross-encoder with random weights and the MiniLM tokenizer, saved like a real model."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    torch.manual_seed(7)
    tokenizer = AutoTokenizer.from_pretrained(str(Settings().resolved_model_path()))
    config = BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, num_labels=1,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("cross-encoder")
    model = BertForSequenceClassification(config)
    with torch.no_grad():
        model.classifier.bias.fill_(-5.0)  # logits far below zero: only a sigmoid keeps the scores in [0, 1]
    # Configured like many published cross-encoders: no activation of its own.
    model.config.sentence_transformers = {"activation_fn": "torch.nn.modules.linear.Identity"}
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _export_onnx(model: Any, tokenizer_from: Path, path: Path) -> Path:
    """``model``'s first output exported to ONNX with a tokenizer.json beside it, as shipped ONNX models are."""
    import shutil

    import torch

    class FirstOutput(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
            output = self.model(input_ids=ids, attention_mask=mask, token_type_ids=types)
            return output[0]  # type: ignore[no-any-return]

    names = ["input_ids", "attention_mask", "token_type_ids"]
    example = torch.ones((2, 8), dtype=torch.long)
    torch.onnx.export(
        FirstOutput(), (example, example, torch.zeros_like(example)), str(path / "model.onnx"), input_names=names,
        output_names=["output"], dynamic_axes={n: {0: "batch", 1: "sequence"} for n in names}, dynamo=False,
    )  # fmt: skip
    shutil.copy(tokenizer_from / "tokenizer.json", path / "tokenizer.json")
    return path


@pytest.fixture(scope="session")
def tiny_onnx_cross_encoder(tiny_cross_encoder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny cross-encoder exported to ONNX: its logits."""
    from transformers import BertForSequenceClassification

    model = BertForSequenceClassification.from_pretrained(str(tiny_cross_encoder)).eval()
    return _export_onnx(model, tiny_cross_encoder, tmp_path_factory.mktemp("onnx-cross-encoder"))


@pytest.fixture(scope="session")
def tiny_onnx_embedder(tiny_cross_encoder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny cross-encoder's BERT exported to ONNX as an embedder: its last hidden state."""
    from transformers import BertModel

    model = BertModel.from_pretrained(str(tiny_cross_encoder)).eval()
    return _export_onnx(model, tiny_cross_encoder, tmp_path_factory.mktemp("onnx-embedder"))


@pytest.fixture
def runtime(embedded: EmbeddedRuntime | None) -> EmbeddedRuntime:
    if embedded is None:
        pytest.skip("adds users to the embedded nats-server; servers started elsewhere keep their own")
    return embedded


async def connect_as(
    deployment: Deployment, runtime: EmbeddedRuntime, role: NatsRole, workspace: str | None = None
) -> Client:
    """A connection as the deployment's ``role`` (of ``workspace`` only, for ingest and client)."""
    login = runtime.nats_logins(deployment.names.prefix, [role], workspace)[role]
    return await connect(with_login(deployment.nats_url_of_server, *login), f"test-{role}")


CORPUS = {  # seven short documents of different kinds, projected into acme by `seeded`
    "csv": ("Read a CSV file into rows with the csv module and return a list of dictionaries.", "io.Files", "method"),
    "json": ("Serialise a Python object to a JSON string with indentation.", "io.Serialisation", "method"),
    "http": ("Send an HTTP GET request and return the decoded response body.", "net.Http", "method"),
    "sort": ("Sort a list of numbers in descending order using sorted with reverse=True.", "algo.Sorting", "method"),
    "fib": ("Compute the Fibonacci sequence recursively with memoisation.", "algo.Recursion", "method"),
    "zip": ("Compress a directory into a zip archive.", "io.Files", "type"),
    "guide": ("How to install the package and run the tests.", "docs.Guide", "doc"),
}


async def answered_once_up(
    client: QueryClient, workspace: str, query: dict[str, Any], within_s: float, *, with_results: bool = False
) -> QueryResponse:
    """The first answer of a query worker starting meanwhile (in another process): asked every half second while
    none listens, or none answers (with results, if ``with_results``), for up to ``within_s``."""
    async with asyncio.timeout(within_s):
        while True:
            with contextlib.suppress(nats.errors.NoRespondersError):
                reply = await client.query(workspace, query)
                if isinstance(reply, QueryResponse) and (reply.results or not with_results):
                    return reply
            await asyncio.sleep(0.5)


def corpus_deltas(
    embedder: Embedder, workspace: str = "acme", embedding_model: str | None = None, token_signs: bool = False
) -> list[DeltaEnvelope]:
    """CORPUS as upserts into ``workspace``, embedded by ``embedder`` (recorded as ``embedding_model``, with the
    tokens' sign bits when ``token_signs``)."""
    ids = list(CORPUS)
    vectors, tokens = embedder.embed_with_tokens([CORPUS[i][0] for i in ids])
    return [
        upsert(
            workspace,
            document(
                i,
                CORPUS[i][0],
                object_type=CORPUS[i][1],
                chunk_level=CORPUS[i][2],
                provenance="hand-authored" if i == "guide" else "ingested",
                embedding=[float(x) for x in vector],
                embedding_model=embedding_model,
                token_vectors=TokenVectors.of_signs(embedder.dimension, pack_signs(signs)) if token_signs else None,
                symbolKind="class" if CORPUS[i][2] == "type" else "function",
            ),
        )
        for i, vector, signs in zip(ids, vectors, tokens, strict=True)
    ]


@pytest.fixture
async def seeded(deployment: Deployment, projector: ProjectorService, embedder: Embedder) -> int:
    """CORPUS projected into workspace acme; the stream sequence of its last delta."""
    deltas = corpus_deltas(embedder)
    acks = await deployment.publisher.publish_many(deltas)
    await deployment.wait_projected(acks[-1].seq)
    return acks[-1].seq


NODE_CLIENTS = Path(__file__).parent / "node"


def node_script(name: str, package: str) -> Path:
    """A client script of tests/node that imports the npm ``package`` (CI installs tests/node's packages; done
    here when missing). Skips without Node.js and npm."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip(f"Node.js and npm are not installed: {name} cannot run")
    if not (NODE_CLIENTS / "node_modules" / package).is_dir():
        subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--no-package-lock"], cwd=NODE_CLIENTS, check=True,
            capture_output=True, timeout=600,
        )  # fmt: skip
    return NODE_CLIENTS / name


@pytest.fixture(scope="session")
def judged_tree(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """The source tree of a project at the version its judgments were written against: the installed one when it is
    that version, else that version installed apart (``pip install --target``, no dependencies), so a newer release
    in the registry cannot turn the judged tests into skips. Without the registry they skip, or fail under
    ONTOFABRIC_TEST_REQUIRE_TOOLS."""
    from importlib import import_module

    from ontofabric.services.ops.repository_eval import tree_version

    made: dict[tuple[str, str], Path] = {}

    def tree(project: str, version: str) -> Path:
        installed = Path(import_module(project).__file__ or "").parent
        if tree_version(installed, project) == version:
            return installed
        if (project, version) not in made:
            target = tmp_path_factory.mktemp(f"{project}-{version}")
            result = subprocess.run(
                [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                 f"{project}=={version}"], capture_output=True, text=True, timeout=300, check=False,
            )  # fmt: skip
            if result.returncode != 0:
                if os.environ.get("ONTOFABRIC_TEST_REQUIRE_TOOLS"):
                    pytest.fail(f"{project} {version} could not be installed: {result.stderr}")
                pytest.skip(f"{project} {version} could not be installed: {result.stderr.strip()[-200:]}")
            made[project, version] = target / project
        return made[project, version]

    return tree


def spawn_nats(
    directory: Path, port: int, users: dict[str, NatsUser], extra: dict[str, Any] | None = None
) -> ManagedProcess:
    """A nats-server of a test's own (JetStream in ``directory``, ``users``, ``extra`` configuration such as TLS),
    listening on ``port`` when this returns; the same directory and port start it again after a kill."""
    config = json.loads(render_config("127.0.0.1", port, str(directory / "js"), users))
    config.update(extra or {})
    (directory / "nats.conf").write_text(json.dumps(config))
    argv = [str(nats_server_binary()), "--config", str(directory / "nats.conf")]
    server = _spawn("nats-server", argv, directory / "nats.log", signal.SIGTERM)

    def listening() -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", port)) == 0

    _wait_until(listening, server, timeout=30)
    return server


def metric_points(name: str) -> list[Any]:
    """The data points this process has recorded for the metric ``name`` (none before anything was recorded)."""
    data = METRICS.get_metrics_data()
    if data is None:
        return []
    return [
        point
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == name
        for point in metric.data.data_points
    ]


Start = Callable[..., Awaitable[QueryService]]
"""start(embedder, reranker=None, **settings overrides): a query worker of the deployment, stopped after the test."""


@pytest.fixture
async def start_query_worker(deployment: Deployment) -> AsyncIterator[Start]:
    started: list[QueryService] = []

    async def start(embedder: Embedder | None, reranker: Reranker | None = None, **overrides: object) -> QueryService:
        settings = deployment.settings.model_copy(update=overrides)
        url = deployment.nats_url_as("query")
        service = QueryService(settings, url, deployment.database_url, embedder, reranker)
        await service.start()
        started.append(service)
        return service

    yield start
    for service in started:
        await service.stop()


async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    """Pass what ``source`` reads on to ``sink`` until it ends, then close ``sink``: one direction of a TCP path."""
    with contextlib.suppress(ConnectionError):
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
    sink.close()


async def cannot_become_the_superuser(pool: Any, login: str, role: str, statement: str) -> None:
    """A connection of ``pool`` logged in as ``login``, acting as ``role``: leaving the role (as a session may, a
    security tester's `set_config('role', 'none', false)`) leaves it ``login``, no superuser, refused a program on
    the host, ``statement`` and the superuser's role."""
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT current_user") == role
        assert await conn.fetchval("SELECT set_config('role', 'none', false)") == "none"
        assert await conn.fetchval("SELECT current_user") == login
        assert not await conn.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        for refused in (
            "CREATE TEMP TABLE taken (line text); COPY taken FROM PROGRAM 'id'",
            statement,
            "SET ROLE postgres",
        ):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(refused)
        await conn.execute(f"SET ROLE {role}")
