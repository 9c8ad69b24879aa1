"""The Azure AI Search projector and keyword backend: pure planning, then a real nats-server and PostgreSQL with the
real azure-search-documents clients against a local server speaking the service's REST API (no Azure service here).
"""

from __future__ import annotations

import asyncio
import base64
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from nats.js.api import ConsumerInfo
from pydantic import SecretStr

from ontofabric.contracts import NodeUpserted, OntologyNode, QueryResponse
from ontofabric.services.ingest.client import envelope
from ontofabric.services.projector.azure import AzureProjectorService, plan_index_batch, upload_chunks
from ontofabric.services.projector.planning import Delta, EntityRef, RowState
from ontofabric.services.projector.worker import ProjectorService
from ontofabric.services.query.azure import escape_query, scope_filter
from ontofabric.services.query.client import QueryClient
from ontofabric.services.query.postgres import Scope
from ontofabric.services.query.worker import QueryService
from ontofabric.shared.azure_search import entry_key
from ontofabric.shared.settings import Settings

from .azure_search_server import AzureSearchServer
from .conftest import Deployment
from .factories import delete, document, upsert

KEY = "test-admin-key"
NODE = OntologyNode(domain="demo", name="Thing", kind="class")

# ---------------------------------------------------------------------------------------------------- pure logic


def _delta(seq: int, env: Any) -> Delta:
    return Delta(seq=seq, envelope=env)


def test_a_batch_applies_only_what_is_newer_than_the_index() -> None:
    ref = EntityRef("acme", "main", "document", "a")
    deltas = [
        _delta(5, upsert("acme", document("a", "old copy"))),  # older than the index's row: a no-op
        _delta(8, upsert("acme", document("b", "first"))),
        _delta(9, delete("acme", "b")),  # the last delta of a row decides what it holds
        _delta(10, envelope("acme", NodeUpserted(node=NODE), branch="dev")),
    ]
    plan = plan_index_batch(deltas, {ref: RowState(seq=7, deleted=False)})
    assert [d.seq for d in plan.noops] == [5]
    [(delta, entry)] = plan.entries
    assert (delta.seq, entry["documentId"], entry["deleted"], entry["seq"], entry["content"]) == (9, "b", True, 9, "")
    # Every delta kind moves its branch's watermark, graph deltas too (they live in Postgres only).
    assert plan.watermarks == {("acme", "main"): 9, ("acme", "dev"): 10}
    # The same batch again (a redelivery) changes nothing once the index holds it.
    held = {ref: RowState(7, False), EntityRef("acme", "main", "document", "b"): RowState(9, True)}
    again = plan_index_batch(deltas, held)
    assert again.entries == []
    assert len(again.noops) == 3


def test_an_upserted_entry_carries_the_documents_metadata() -> None:
    doc = document("x", "def read_csv(path): ...", symbol_fqn="io.read_csv", chunk_level="method")
    [(_, entry)] = plan_index_batch([_delta(3, upsert("acme", doc, branch="feature/x"))], {}).entries
    assert entry["deleted"] is False
    assert (entry["branch"], entry["chunkLevel"], entry["symbolFqn"]) == ("feature/x", "method", "io.read_csv")
    assert entry["content"].startswith("io.read_csv")  # the same analysed text Postgres indexes
    assert "read csv" in entry["content"]  # identifier parts appended


def test_entry_keys_are_valid_and_distinct_for_any_id() -> None:
    ids = ["a", "a/b.py::f", "ünïcode id", "x" * 512, "a\x1fb"]
    keys = {entry_key("acme", branch, i) for i in ids for branch in ("main", "feature/x")} | {
        entry_key("acme", "main", None)
    }
    assert len(keys) == 2 * len(ids) + 1
    assert all(re.fullmatch(r"[A-Za-z0-9_=-]{1,1024}", key) for key in keys)
    assert base64.urlsafe_b64decode(entry_key("acme", "main", "a/b")).decode() == "acme\x1fmain\x1fd:a/b"


def test_uploads_are_cut_by_count_and_size() -> None:
    small = [{"key": str(i), "content": "x"} for i in range(2500)]
    assert [len(chunk) for chunk in upload_chunks(small)] == [1000, 1000, 500]
    big = [{"key": str(i), "content": "y" * (3 * 1024 * 1024)} for i in range(5)]
    assert [len(chunk) for chunk in upload_chunks(big)] == [2, 2, 1]
    assert upload_chunks([]) == []


def test_a_query_is_a_bag_of_terms_on_azure() -> None:
    assert escape_query('C++ "exact" -flag a|b (x)') == r"C\+\+ \"exact\" \-flag a\|b \(x\)"
    assert escape_query("readCsvFile") == "readCsvFile read Csv File"  # analysed as the index was


def test_the_scope_filter_says_what_a_query_may_see() -> None:
    assert scope_filter(Scope("acme", "main")) == (
        "kind eq 'document' and deleted eq false and workspace eq 'acme' and search.in(branch, 'main', '|')"
    )
    narrowed = scope_filter(Scope("o'neil", "feature/x", ("a.B", "a.C|D"), "method", "ingested"))
    assert "workspace eq 'o''neil'" in narrowed
    assert "search.in(branch, 'main|feature/x', '|')" in narrowed
    assert "search.in(objectType, 'a.B,a.C|D', ',')" in narrowed  # a delimiter no value holds
    assert narrowed.endswith("chunkLevel eq 'method' and provenance eq 'ingested'")
    assert scope_filter(Scope("acme", "main", ())).endswith(" and false")  # no type matches: nothing may match


# ------------------------------------------------------------------------------------- against the real servers


@pytest.fixture
async def azure() -> AsyncIterator[AzureSearchServer]:
    async with AzureSearchServer(api_key=KEY) as server:
        yield server


def _settings(deployment: Deployment, azure: AzureSearchServer, **overrides: object) -> Settings:
    return deployment.settings.model_copy(
        update={"azure_search_endpoint": azure.endpoint, "azure_search_api_key": SecretStr(KEY), **overrides}
    )


@pytest.fixture
async def azure_projector(deployment: Deployment, azure: AzureSearchServer) -> AsyncIterator[AzureProjectorService]:
    service = AzureProjectorService(_settings(deployment, azure), deployment.nats_url)
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


async def _wait_indexed(deployment: Deployment, stream_seq: int, timeout_s: float = 30.0) -> ConsumerInfo:
    durable = deployment.names.azure_projector_durable
    async with asyncio.timeout(timeout_s):
        while True:
            info = await deployment.js.consumer_info(deployment.names.delta_stream, durable)
            if info.ack_floor is not None and (info.ack_floor.stream_seq or 0) >= stream_seq:
                return info
            await asyncio.sleep(0.05)


def _entry(azure: AzureSearchServer, doc_id: str, branch: str = "main") -> dict[str, Any] | None:
    return azure.documents("ontofabric-documents").get(entry_key("acme", branch, doc_id))


async def test_deltas_reach_the_index_with_tombstones_and_a_watermark(
    deployment: Deployment, azure: AzureSearchServer, azure_projector: AzureProjectorService
) -> None:
    acks = await deployment.publisher.publish_many(
        [
            upsert("acme", document("csv", "read a csv file into rows")),
            upsert("acme", document("zip", "compress files into a zip archive")),
            upsert("acme", document("zip", "extract a zip archive"), branch="feature/x"),
            delete("acme", "csv"),
            envelope("acme", NodeUpserted(node=NODE)),
        ]
    )
    await _wait_indexed(deployment, acks[-1].seq)
    csv, zip_main, zip_branch = _entry(azure, "csv"), _entry(azure, "zip"), _entry(azure, "zip", "feature/x")
    assert csv is not None
    assert (csv["deleted"], csv["seq"]) == (True, acks[3].seq)
    assert zip_main is not None
    assert (zip_main["deleted"], zip_main["content"]) == (
        False,
        "compress files into a zip archive",
    )
    assert zip_branch is not None
    assert zip_branch["content"] == "extract a zip archive"
    marks = azure.documents("ontofabric-documents")
    assert marks[entry_key("acme", "main", None)]["seq"] == acks[-1].seq  # the graph delta moved it too
    assert marks[entry_key("acme", "feature/x", None)]["seq"] == acks[2].seq


async def test_a_failing_service_loses_nothing_and_the_retry_changes_nothing_twice(
    deployment: Deployment, azure: AzureSearchServer, azure_projector: AzureProjectorService
) -> None:
    azure.fail_next(3, 503)  # the SDK's two retries and the first try: the batch is nak'd and comes back
    first = await deployment.publisher.publish_many([upsert("acme", document(f"d{i}", f"text {i}")) for i in range(3)])
    await _wait_indexed(deployment, first[-1].seq)
    # Three failed lookups, then the redelivered batch's lookup and its watermark read.
    assert azure.requests["search"] >= 5
    assert {k: v["seq"] for k, v in azure.documents("ontofabric-documents").items() if v["kind"] == "document"} == {
        entry_key("acme", "main", f"d{i}"): first[i].seq for i in range(3)
    }
    # A delete, then the throttled upload of a newer batch: the old copy never comes back.
    azure.fail_next(3, 429, retry_after=0)
    later = await deployment.publisher.publish_many([delete("acme", "d0"), upsert("acme", document("d1", "new"))])
    await _wait_indexed(deployment, later[-1].seq)
    d0, d1 = _entry(azure, "d0"), _entry(azure, "d1")
    assert d0 is not None
    assert d0["deleted"] is True
    assert d1 is not None
    assert (d1["content"], d1["seq"]) == ("new", later[1].seq)


async def test_a_batch_that_comes_back_after_a_newer_one_changes_nothing(
    deployment: Deployment, azure: AzureSearchServer, azure_projector: AzureProjectorService
) -> None:
    # The first batch's document goes in, then its watermark write fails every try: the batch is nak'd, and the
    # next batch (a delete of the same document) applies before it comes back. Azure has no conditional writes:
    # only the sequence the index keeps stops the old copy from returning.
    azure.fail_next(3, 503, route="index_documents", after=1)
    first = await deployment.publisher.publish_many([upsert("acme", document("d", "old copy"))])
    async with asyncio.timeout(30):
        while azure.requests["index_documents"] < 4:
            await asyncio.sleep(0.05)
    second = await deployment.publisher.publish_many([delete("acme", "d")])
    await _wait_indexed(deployment, second[-1].seq)  # the ack floor passes both: the first came back and was acked
    entry = _entry(azure, "d")
    assert entry is not None
    assert (entry["deleted"], entry["seq"]) == (True, second[-1].seq)
    assert first[-1].seq < second[-1].seq


async def test_a_document_the_index_refuses_is_dead_lettered_with_the_services_reason(
    deployment: Deployment, azure: AzureSearchServer, azure_projector: AzureProjectorService
) -> None:
    dead = await deployment.js.subscribe(f"{deployment.names.prefix}.dlq.>")
    # A filterable field holds one term, which the service caps at 32,766 bytes; Postgres has no such limit.
    acks = await deployment.publisher.publish_many(
        [
            upsert("acme", document("ok-1", "fine")),
            upsert("acme", document("huge", "fine too", symbol_fqn="q" * 40_000)),
            upsert("acme", document("ok-2", "fine as well")),
        ]
    )
    await _wait_indexed(deployment, acks[-1].seq)
    message = await dead.next_msg(timeout=10)
    assert message.headers is not None
    assert message.headers["Ontofabric-Reason"] == "index_refused"
    assert message.headers["Ontofabric-Index"] == "azure-ai-search"
    assert message.headers["Ontofabric-Original-Sequence"] == str(acks[1].seq)
    assert "too large" in message.headers["Ontofabric-Detail"]
    assert _entry(azure, "huge") is None
    assert _entry(azure, "ok-1") is not None
    assert _entry(azure, "ok-2") is not None


async def test_a_delta_no_projector_can_apply_is_left_to_the_postgres_dead_letter(
    deployment: Deployment, azure: AzureSearchServer, azure_projector: AzureProjectorService
) -> None:
    bad = await deployment.js.publish(deployment.names.delta_subject("acme", "main"), b"{not json")
    good = await deployment.publisher.publish_many([upsert("acme", document("d", "text"))])
    await _wait_indexed(deployment, good[-1].seq)
    info = await deployment.js.consumer_info(deployment.names.delta_stream, deployment.names.azure_projector_durable)
    assert (info.ack_floor.stream_seq or 0) >= bad.seq
    assert info.num_ack_pending == 0
    dlq = await deployment.js.stream_info(deployment.names.dlq_stream)
    assert dlq.state.messages == 0  # the Postgres projector, not this one, dead-letters it
    assert _entry(azure, "d") is not None


# -------------------------------------------------------------------------------------- the keyword backend

Ask = Callable[..., Awaitable[QueryResponse]]


@pytest.fixture
async def ask_azure(deployment: Deployment, azure: AzureSearchServer) -> AsyncIterator[Ask]:
    """A query worker on the azure-ai-search keyword backend (keyword-only answers: no embedder)."""
    service = QueryService(
        _settings(deployment, azure, keyword_backend="azure-ai-search", query_cache_entries=100),
        deployment.nats_url,
        deployment.database_url,
        None,
    )
    await service.start()
    client = QueryClient(deployment.nc, deployment.names)

    async def ask(text: str, **params: object) -> QueryResponse:
        reply = await client.query("acme", {"semanticQuery": text, "options": {"retrievers": ["keyword"]}, **params})
        assert isinstance(reply, QueryResponse), reply
        return reply

    try:
        yield ask
    finally:
        await service.stop()


CORPUS = {
    "csv": "read a csv file into rows with the csv module",
    "zip": "compress files into a zip archive",
    "http": "send an http request and read the response",
    "fib": "compute fibonacci numbers recursively",
}


async def _seed(deployment: Deployment) -> int:
    acks = await deployment.publisher.publish_many([upsert("acme", document(i, text)) for i, text in CORPUS.items()])
    await deployment.wait_projected(acks[-1].seq)
    await _wait_indexed(deployment, acks[-1].seq)
    return acks[-1].seq


async def test_the_azure_backend_answers_like_postgres_through_the_same_request(
    deployment: Deployment, azure_projector: AzureProjectorService, projector: ProjectorService, ask_azure: Ask
) -> None:
    seq = await _seed(deployment)
    reply = await ask_azure("read a zip archive", topK=4)
    assert reply.meta.backend == "azure-ai-search"
    assert reply.meta.degraded == []
    assert reply.meta.ontology_version.startswith(f"{seq}-")  # the Postgres snapshot's version
    assert next(r.id for r in reply.results) == "zip"
    assert {r.id for r in reply.results} == {"zip", "csv", "http"}  # "read" or "zip" or "archive"; fib shares none
    # The same request to a Postgres-backed worker finds the same documents.
    postgres = QueryService(deployment.settings, deployment.nats_url, deployment.database_url, None)
    await postgres.start()
    try:
        await asyncio.sleep(0.2)  # both in the queue group; ask until the Postgres one answers
        for _ in range(20):
            other = await QueryClient(deployment.nc, deployment.names).query(
                "acme", {"semanticQuery": "read a zip archive", "topK": 4, "options": {"retrievers": ["keyword"]}}
            )
            assert isinstance(other, QueryResponse)
            if other.meta.backend == "postgres-bm25":
                break
        assert other.meta.backend == "postgres-bm25"
        assert {r.id for r in other.results} == {r.id for r in reply.results}
    finally:
        await postgres.stop()


async def test_an_index_behind_postgres_never_answers_a_deleted_document_and_says_it_is_behind(
    deployment: Deployment,
    azure: AzureSearchServer,
    azure_projector: AzureProjectorService,
    projector: ProjectorService,
    ask_azure: Ask,
) -> None:
    await _seed(deployment)
    await azure_projector.stop()  # the index stops taking deltas in; Postgres goes on
    acks = await deployment.publisher.publish_many([delete("acme", "zip")])
    await deployment.wait_projected(acks[-1].seq)
    assert _entry(azure, "zip") is not None
    assert _entry(azure, "zip")["deleted"] is False
    first = await ask_azure("zip archive")
    assert "zip" not in [r.id for r in first.results]
    assert "keywordIndexBehind" in first.meta.degraded
    # Checked against the snapshot before fusion, not dropped at fetch: the answer is one state, not a mixed read.
    assert "ontologyVersionChanged" not in first.meta.degraded
    assert (await ask_azure("zip archive")).meta.cache_hit is False  # an answer known to be incomplete is not kept
    await azure_projector.start()
    await _wait_indexed(deployment, acks[-1].seq)
    caught_up = await ask_azure("compress files")
    assert caught_up.meta.degraded == []


async def test_a_branch_sees_its_own_copy_not_mains(
    deployment: Deployment, azure_projector: AzureProjectorService, projector: ProjectorService, ask_azure: Ask
) -> None:
    await _seed(deployment)
    acks = await deployment.publisher.publish_many(
        [upsert("acme", document("zip", "tar and gzip a directory"), branch="feature/x")]
    )
    await deployment.wait_projected(acks[-1].seq)
    await _wait_indexed(deployment, acks[-1].seq)
    on_branch = await ask_azure("zip archive", branch="feature/x")
    assert "zip" not in [r.id for r in on_branch.results]  # main's copy matches, but the branch shadows it
    assert [r.id for r in (await ask_azure("gzip directory", branch="feature/x")).results] == ["zip"]
    assert "zip" in [r.id for r in (await ask_azure("zip archive")).results]  # main still has its own


async def test_a_failing_service_degrades_the_keyword_path_and_the_caller_gets_a_clear_answer(
    deployment: Deployment,
    azure: AzureSearchServer,
    azure_projector: AzureProjectorService,
    projector: ProjectorService,
    ask_azure: Ask,
) -> None:
    await _seed(deployment)
    azure.fail_next(2, 503)  # the search and the watermark read, sent together
    reply = await QueryClient(deployment.nc, deployment.names).query(
        "acme", {"semanticQuery": "zip archive", "options": {"retrievers": ["keyword"]}}
    )
    # No retriever could run (no embedder here): a retryable error, not a hang or a crash.
    assert not isinstance(reply, QueryResponse)
    assert reply.error.code == "unavailable"
    assert reply.error.retryable is True
    azure.delay_s = 3.0  # slower than the 1.5 s budget
    slow = await QueryClient(deployment.nc, deployment.names, timeout_s=10).query(
        "acme", {"semanticQuery": "zip archive", "options": {"retrievers": ["keyword"]}}
    )
    assert not isinstance(slow, QueryResponse)
    assert slow.error.code == "unavailable"
