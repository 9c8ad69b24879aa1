"""The Azure AI Search projector and keyword backend: pure planning, then a real nats-server and PostgreSQL with the
real azure-search-documents clients against a local server speaking the service's REST API (no Azure service here).
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from nats.js.api import ConsumerInfo
from pydantic import SecretStr

from ontofabric.contracts import DeltaEnvelope, NodeUpserted, OntologyNode, QueryResponse
from ontofabric.services.ingest.client import envelope
from ontofabric.services.ops.snapshots import compact
from ontofabric.services.projector import azure as azure_sink
from ontofabric.services.projector.azure import (
    AzureSearchIndex,
    EntriesThrottled,
    is_transient,
    plan_index_batch,
    tombstone,
    upload_chunks,
)
from ontofabric.services.projector.planning import Delta, EntityRef, RowState
from ontofabric.services.projector.worker import AzureProjectorService, ProjectorService
from ontofabric.services.query import azure as azure_backend
from ontofabric.services.query.azure import escape_query, scope_filter
from ontofabric.services.query.client import QueryClient
from ontofabric.services.query.core import Scope
from ontofabric.services.query.worker import QueryService
from ontofabric.shared.azure_search import (
    WATERMARK_KEY,
    entry_key,
    index_client,
    index_definition,
    search_client,
)
from ontofabric.shared.settings import Settings

from .azure_search_server import AzureSearchServer
from .conftest import Deployment, RecordedProgress
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
    # The longest a contract allows: 128-character workspaces, 255-character branches, 512-character ids.
    long_ids = ["文" * 512, "x" * 512]
    ids = ["a", "a/b.py::f", "ünïcode id", "a\x1fb", *long_ids]
    keys = {entry_key(w, b, i) for i in ids for b in ("main", "feature/x", "b" * 255) for w in ("acme", "w" * 128)}
    assert len(keys) == len(ids) * 3 * 2
    assert all(re.fullmatch(r"[A-Za-z0-9_=-]{1,1024}", key) for key in keys | {WATERMARK_KEY})
    assert WATERMARK_KEY not in keys


def test_uploads_are_cut_by_count_and_size_as_the_sdk_sends_them() -> None:
    small = [{"key": str(i), "content": "x"} for i in range(2500)]
    assert [len(chunk) for chunk in upload_chunks(small)] == [1000, 1000, 500]
    big = [{"key": str(i), "content": "y" * (3 * 1024 * 1024)} for i in range(5)]
    assert [len(chunk) for chunk in upload_chunks(big)] == [2, 2, 1]
    # Non-ASCII text goes out escaped (six bytes a character): 1 MB of Cyrillic is 6 MB in the request.
    cyrillic = [{"key": str(i), "content": "ж" * (1024 * 1024)} for i in range(3)]
    assert [len(chunk) for chunk in upload_chunks(cyrillic)] == [1, 1, 1]
    assert upload_chunks([]) == []


def test_a_refused_entry_leaves_a_tombstone_of_its_sequence() -> None:
    [(_, entry)] = plan_index_batch([_delta(4, upsert("acme", document("x", "text", symbol_fqn="m.x")))], {}).entries
    stone = tombstone(entry)
    assert (stone["key"], stone["seq"], stone["deleted"], stone["content"]) == (entry["key"], 4, True, "")
    assert "symbolFqn" not in stone


def test_a_query_is_a_bag_of_terms_on_azure() -> None:
    assert escape_query('C++ "exact" -flag a|b (x)') == r"c\+\+ \"exact\" \-flag a\|b \(x\)"
    assert escape_query("readCsvFile") == "readcsvfile read csv file"  # analysed (and case-folded) as the index was


def test_the_scope_filter_says_what_a_query_may_see() -> None:
    assert scope_filter(Scope("acme", "main")) == (
        "kind eq 'document' and deleted eq false and workspace eq 'acme' and branch eq 'main'"
    )
    narrowed = scope_filter(Scope("o'neil", "feature/x", ("a.B", "a.C|D"), "method", "ingested"), ["m1", "m,2"])
    assert "workspace eq 'o''neil'" in narrowed
    # The branch's own documents, and main's that it does not hide (a delimiter none of the ids holds).
    assert "(branch eq 'feature/x' or (branch eq 'main' and not search.in(documentId, 'm1|m,2', '|')))" in narrowed
    assert "search.in(objectType, 'a.B,a.C|D', ',')" in narrowed
    assert narrowed.endswith("chunkLevel eq 'method' and provenance eq 'ingested'")
    assert "not" not in scope_filter(Scope("acme", "feature/x"))  # hiding nothing
    assert scope_filter(Scope("acme", "main", ())).endswith(" and false")  # no type matches: nothing may match
    assert scope_filter(Scope("acme", "main", symbol_kind="class")).endswith(" and symbolKind eq 'class'")


# ------------------------------------------------------------------------------------- against the real servers


@pytest.fixture
async def azure() -> AsyncIterator[AzureSearchServer]:
    async with AzureSearchServer(api_key=KEY) as server:
        yield server


def _settings(deployment: Deployment, azure: AzureSearchServer, **overrides: object) -> Settings:
    return deployment.settings.model_copy(
        update={
            "azure_search_endpoint": azure.endpoint,
            "azure_search_api_key": SecretStr(KEY),
            "insecure_http_secrets": True,  # the local stand-in speaks plain HTTP
            **overrides,
        }
    )


@pytest.fixture
async def azure_projector(deployment: Deployment, azure: AzureSearchServer) -> AsyncIterator[AzureProjectorService]:
    service = AzureProjectorService(_settings(deployment, azure), deployment.nats_url_as("projector"))
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


async def _delete_index(deployment: Deployment, azure: AzureSearchServer) -> None:
    indexes = index_client(_settings(deployment, azure), retries=0)
    try:
        await indexes.delete_index("ontofabric-documents")
    finally:
        await indexes.close()


async def _republish(deployment: Deployment, azure: AzureSearchServer, delta: DeltaEnvelope, message_id: str) -> int:
    """The delta again under another message id (as past JetStream's duplicate window), taken in by both
    projectors and the watermark; returns its new sequence."""
    again = await deployment.js.publish(
        deployment.names.delta_subject("acme", "main"),
        delta.model_dump_json().encode(),
        headers={"Nats-Msg-Id": message_id},
    )
    await deployment.wait_projected(again.seq)
    await _wait_indexed(deployment, again.seq)
    await _wait_watermark(azure, again.seq)
    return again.seq


async def _wait_watermark(azure: AzureSearchServer, seq: int) -> None:
    async with asyncio.timeout(10):
        while _watermark(azure) < seq:
            await asyncio.sleep(0.05)


def _watermark(azure: AzureSearchServer) -> int:
    entry = azure.documents("ontofabric-documents").get(WATERMARK_KEY)
    return 0 if entry is None else int(entry["seq"])


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
    # The watermark follows the ack floor, graph deltas included (they live in Postgres only), soon after a batch.
    await _wait_watermark(azure, acks[-1].seq)


async def test_a_failing_service_loses_nothing_and_the_retry_changes_nothing_twice(
    deployment: Deployment, azure: AzureSearchServer, azure_projector: AzureProjectorService
) -> None:
    azure.fail_next(3, 503)  # the SDK's two retries and the first try: the batch is nak'd and comes back
    first = await deployment.publisher.publish_many([upsert("acme", document(f"d{i}", f"text {i}")) for i in range(3)])
    await _wait_indexed(deployment, first[-1].seq)
    # The first delivery's lookup failed three times (the SDK's tries): only the redelivery can have indexed them.
    assert azure.requests["search"] >= 4
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


async def test_a_call_the_service_never_answers_is_given_up_and_tried_again(
    deployment: Deployment, azure: AzureSearchServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An Azure path tester's: a connection nothing answered on held the batch for the SDK's 300 s read timeout,
    three times over with its retries, without a word."""
    monkeypatch.setattr(azure_sink, "READ_TIMEOUT_S", 1.0)
    service = AzureProjectorService(_settings(deployment, azure), deployment.nats_url_as("projector"))
    await service.start()
    try:
        azure.hanging = True
        (ack,) = await deployment.publisher.publish_many([upsert("acme", document("late", "answered at last"))])
        await asyncio.sleep(3)
        azure.hanging = False  # the calls taken in meanwhile stay unanswered
        await _wait_indexed(deployment, ack.seq, timeout_s=25)
    finally:
        await service.stop()
    entry = _entry(azure, "late")
    assert entry is not None
    assert entry["content"] == "answered at last"


def test_entries_the_service_throttles_are_a_passing_failure_not_one_to_look_at() -> None:
    """A 207 whose items say 503 was logged at error level, as a wrong key is (an Azure path tester's)."""
    assert is_transient(EntriesThrottled("3 entries throttled, e.g. (503, 'busy')"))


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
    older = await deployment.publisher.publish_many([upsert("acme", document("huge", "an older copy"))])
    await _wait_indexed(deployment, older[-1].seq)
    # A filterable field holds one term, which the service caps at 32,766 bytes; Postgres has no such limit.
    acks = await deployment.publisher.publish_many(
        [
            upsert("acme", document("ok-1", "fine")),
            upsert("acme", document("huge", "fine too", file_path="q" * 40_000)),
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
    huge = _entry(azure, "huge")  # the older copy is not left searchable: a tombstone at the refused sequence
    assert huge is not None
    assert (huge["deleted"], huge["seq"], huge["content"]) == (True, acks[1].seq, "")
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
        deployment.nats_url_as("query"),
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


@dataclass(frozen=True)
class Both:
    """Both projectors running, and a query worker on the azure-ai-search backend."""

    azure: AzureSearchServer
    azure_projector: AzureProjectorService
    ask: Ask


@pytest.fixture
def both(
    azure: AzureSearchServer, azure_projector: AzureProjectorService, projector: ProjectorService, ask_azure: Ask
) -> Both:
    return Both(azure, azure_projector, ask_azure)


CORPUS = {
    "csv": "read a csv file into rows with the csv module",
    "zip": "compress files into a zip archive",
    "http": "send an http request and read the response",
    "fib": "compute fibonacci numbers recursively",
}


async def _seed(deployment: Deployment, azure: AzureSearchServer | None) -> int:
    """The corpus, projected into both indexes (and, on the local server, the watermark past it)."""
    acks = await deployment.publisher.publish_many([upsert("acme", document(i, text)) for i, text in CORPUS.items()])
    await deployment.wait_projected(acks[-1].seq)
    await _wait_indexed(deployment, acks[-1].seq)
    if azure is not None:
        await _wait_watermark(azure, acks[-1].seq)
    return acks[-1].seq


async def test_the_azure_backend_answers_like_postgres_through_the_same_request(
    deployment: Deployment, both: Both
) -> None:
    seq = await _seed(deployment, both.azure)
    reply = await both.ask("read a zip archive", topK=4)
    assert reply.meta.backend == "azure-ai-search"
    assert reply.meta.degraded == []
    assert reply.meta.ontology_version.startswith(f"{seq}-")  # the Postgres snapshot's version
    assert next(r.id for r in reply.results) == "zip"
    assert {r.id for r in reply.results} == {"zip", "csv", "http"}  # "read" or "zip" or "archive"; fib shares none
    # The same request to a Postgres-backed worker finds the same documents.
    postgres = QueryService(deployment.settings, deployment.nats_url_as("query"), deployment.database_url, None)
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
    deployment: Deployment, both: Both
) -> None:
    await _seed(deployment, both.azure)
    await both.azure_projector.stop()  # the index stops taking deltas in; Postgres goes on
    acks = await deployment.publisher.publish_many([delete("acme", "zip")])
    await deployment.wait_projected(acks[-1].seq)
    assert _entry(both.azure, "zip") is not None
    assert _entry(both.azure, "zip")["deleted"] is False
    first = await both.ask("zip archive")
    assert "zip" not in [r.id for r in first.results]
    assert "keywordIndexBehind" in first.meta.degraded
    # Checked against the snapshot before fusion, not dropped at fetch: the answer is one state, not a mixed read.
    assert "ontologyVersionChanged" not in first.meta.degraded
    assert (await both.ask("zip archive")).meta.cache_hit is False  # an answer known to be incomplete is not kept
    await both.azure_projector.start()
    await _wait_watermark(both.azure, acks[-1].seq)
    caught_up = await both.ask("compress files")
    assert caught_up.meta.degraded == []


async def test_a_branch_sees_its_own_copy_not_mains(deployment: Deployment, both: Both) -> None:
    await _seed(deployment, both.azure)
    acks = await deployment.publisher.publish_many(
        [upsert("acme", document("zip", "tar and gzip a directory"), branch="feature/x")]
    )
    await deployment.wait_projected(acks[-1].seq)
    await _wait_indexed(deployment, acks[-1].seq)
    on_branch = await both.ask("zip archive", branch="feature/x")
    assert "zip" not in [r.id for r in on_branch.results]  # main's copy matches, but the branch shadows it
    assert [r.id for r in (await both.ask("gzip directory", branch="feature/x")).results] == ["zip"]
    assert "zip" in [r.id for r in (await both.ask("zip archive")).results]  # main still has its own


async def test_a_failing_service_degrades_the_keyword_path_and_the_caller_gets_a_clear_answer(
    deployment: Deployment, both: Both
) -> None:
    await _seed(deployment, both.azure)
    both.azure.fail_next(2, 503)  # the search and the watermark read, sent together
    reply = await QueryClient(deployment.nc, deployment.names).query(
        "acme", {"semanticQuery": "zip archive", "options": {"retrievers": ["keyword"]}}
    )
    # No retriever could run (no embedder here): a retryable error, not a hang or a crash.
    assert not isinstance(reply, QueryResponse)
    assert reply.error.code == "unavailable"
    assert reply.error.retryable is True
    both.azure.delay_s = 3.0  # slower than the 1.5 s budget
    slow = await QueryClient(deployment.nc, deployment.names, timeout_s=10).query(
        "acme", {"semanticQuery": "zip archive", "options": {"retrievers": ["keyword"]}}
    )
    assert not isinstance(slow, QueryResponse)
    assert slow.error.code == "unavailable"


async def test_an_entry_still_being_retried_holds_the_watermark_back(deployment: Deployment, both: Both) -> None:
    await _seed(deployment, both.azure)
    both.azure.fail_items(entry_key("acme", "main", "late"), times=2)  # throttled twice: its batch comes back twice
    tries = both.azure.requests["index_documents"]
    first = await deployment.publisher.publish_many([upsert("acme", document("late", "quantum entanglement"))])
    async with asyncio.timeout(10):  # its first try has failed before the next delta is published
        while both.azure.requests["index_documents"] == tries:
            await asyncio.sleep(0.02)
    then = await deployment.publisher.publish_many([upsert("acme", document("other", "zebra crossing"))])
    await deployment.wait_projected(then[-1].seq)
    async with asyncio.timeout(10):
        while _entry(both.azure, "other") is None:
            await asyncio.sleep(0.02)
    assert _entry(both.azure, "late") is None
    assert _watermark(both.azure) < first[-1].seq  # the later batch is in, but the floor waits for the throttled one
    meanwhile = await both.ask("quantum entanglement")
    assert "late" not in [r.id for r in meanwhile.results]
    assert "keywordIndexBehind" in meanwhile.meta.degraded
    await _wait_watermark(both.azure, then[-1].seq)
    done = await both.ask("quantum entanglement")
    assert ([r.id for r in done.results], done.meta.degraded) == (["late"], [])


async def test_a_republished_old_event_is_never_answered_from_the_index(deployment: Deployment, both: Both) -> None:
    old = upsert("acme", document("r", "alpha gamma old text"))
    acks = await deployment.publisher.publish_many([old, upsert("acme", document("r", "beta delta new text"))])
    # The old event again, past JetStream's duplicate window (another message id): Postgres knows the event and
    # ignores it; the index only sees a newer sequence and takes the old text in. It comes after the first two are
    # indexed: fetched in one batch with them, one event id would be applied once.
    await _wait_watermark(both.azure, acks[-1].seq)
    again = await _republish(deployment, both.azure, old, "x")
    stale = _entry(both.azure, "r")
    assert stale is not None
    assert stale["content"] == "alpha gamma old text"
    # Not the text Postgres shows: the hit is dropped, not answered with the new text's id.
    assert "r" not in [r.id for r in (await both.ask("alpha gamma")).results]
    assert acks[-1].seq < again


async def test_an_ingest_run_again_keeps_its_documents_searchable(deployment: Deployment, both: Both) -> None:
    # An ingester re-run republishes its deterministic events (same ids, same text) past the duplicate window:
    # Postgres ignores them, the index takes them in at a newer sequence; the text is the same, so is the answer.
    delta = upsert("acme", document("s", "sphinx of black quartz"))
    first = await deployment.publisher.publish_many([delta])
    # The re-run comes later: in one batch with the first run, one event id would be applied once.
    await _wait_watermark(both.azure, first[-1].seq)
    again = await _republish(deployment, both.azure, delta, "y")
    entry = _entry(both.azure, "s")
    assert entry is not None
    assert entry["seq"] == again  # the index took the republished event in
    reply = await both.ask("black quartz")
    assert ([r.id for r in reply.results], reply.meta.degraded) == (["s"], [])


@pytest.mark.parametrize("filter_cap", [1000, 2], ids=["hidden-in-filter", "too-many-for-the-filter"])
async def test_a_branch_hiding_many_of_mains_documents_still_gets_its_hits(
    deployment: Deployment, both: Both, filter_cap: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(azure_backend, "MAX_HIDDEN_IN_FILTER", filter_cap)
    main = [upsert("acme", document(f"d{i}", "alpha alpha alpha")) for i in range(10)]
    main += [upsert("acme", document(f"e{i}", "alpha and more words")) for i in range(3)]
    hidden = [delete("acme", f"d{i}", branch="feature/x") for i in range(8)]
    acks = await deployment.publisher.publish_many(main + hidden)
    await deployment.wait_projected(acks[-1].seq)
    await _wait_indexed(deployment, acks[-1].seq)
    reply = await both.ask("alpha", branch="feature/x", topK=3, options={"retrievers": ["keyword"], "candidates": 3})
    # Main's eight best matches are deleted on the branch; they must not fill the three places.
    found = [r.id for r in reply.results]
    assert len(found) == 3
    assert set(found[:2]) == {"d8", "d9"}  # equal scores: in either order
    assert found[2] in {"e0", "e1", "e2"}


async def test_an_entry_no_request_can_carry_is_refused_before_sending(azure: AzureSearchServer) -> None:
    settings = Settings(
        azure_search_endpoint=azure.endpoint, azure_search_api_key=SecretStr(KEY), insecure_http_secrets=True
    )
    indexes, client = index_client(settings, retries=0), search_client(settings, retries=0)
    try:
        await indexes.create_or_update_index(index_definition(settings.azure_search_index))
        huge = {"key": "a" * 64, "kind": "document", "content": "ж" * (3 * 1024 * 1024)}  # 18 MB escaped
        small = {"key": "b" * 64, "kind": "document", "content": "fine"}
        refused = await AzureSearchIndex(client).upload([huge, small])
        assert list(refused) == [huge["key"]]
        assert refused[huge["key"]][0] == 413
        assert azure.requests["index_documents"] == 1  # the small one alone went out
        assert set(azure.documents(settings.azure_search_index)) == {small["key"]}
    finally:
        await client.close()
        await indexes.close()


async def test_a_lost_index_is_filled_again_from_the_stream(
    deployment: Deployment, azure: AzureSearchServer, azure_projector: AzureProjectorService
) -> None:
    acks = await deployment.publisher.publish_many([upsert("acme", document(i, text)) for i, text in CORPUS.items()])
    await _wait_indexed(deployment, acks[-1].seq)
    await azure_projector.stop()
    await _delete_index(deployment, azure)
    await azure_projector.start()  # an empty index behind a consumer that acked everything: replay from the first
    async with asyncio.timeout(30):
        while len([k for k, v in azure.documents("ontofabric-documents").items() if v["kind"] == "document"]) < 4:
            await asyncio.sleep(0.05)
    await _wait_watermark(azure, acks[-1].seq)


async def test_a_lost_index_is_filled_from_the_snapshots_of_a_compacted_stream_and_then_the_stream(
    deployment: Deployment,
    azure: AzureSearchServer,
    azure_projector: AzureProjectorService,
    projector: ProjectorService,
) -> None:
    early = await deployment.publisher.publish_many([upsert("acme", document(i, text)) for i, text in CORPUS.items()])
    await deployment.wait_projected(early[-1].seq)
    await _wait_indexed(deployment, early[-1].seq)
    report = await compact(deployment.nc, deployment.names, deployment.settings, RecordedProgress())
    assert report.covers == early[-1].seq  # every index had settled them: the stream drops them
    late = await deployment.publisher.publish_many([upsert("acme", document("late", "after the compaction"))])
    await _wait_indexed(deployment, late[-1].seq)
    await azure_projector.stop()
    await _delete_index(deployment, azure)
    await azure_projector.start()  # the corpus is only in the snapshot now, "late" only in the stream
    await _wait_watermark(azure, late[-1].seq)
    assert all(_entry(azure, i) is not None for i in [*CORPUS, "late"])


async def test_compaction_keeps_what_an_azure_index_being_filled_again_has_yet_to_read(
    deployment: Deployment, azure: AzureSearchServer, projector: ProjectorService
) -> None:
    """The Azure AI Search projector deletes its consumer to fill a lost index again, and reads the snapshots
    before making it anew: a compaction meanwhile took no account of it, and purged what the index had yet to
    read. With an endpoint configured, its consumer missing has settled nothing."""
    acks = await deployment.publisher.publish_many([upsert("acme", document(i, text)) for i, text in CORPUS.items()])
    await deployment.wait_projected(acks[-1].seq)  # the Postgres index holds them; no Azure consumer exists
    report = await compact(deployment.nc, deployment.names, _settings(deployment, azure), RecordedProgress())
    assert (report.covers, report.purged) == (0, 0)
    assert (await deployment.js.stream_info(deployment.names.delta_stream)).state.first_seq == 1
    # Without an endpoint there is no Azure index to wait for.
    report = await compact(deployment.nc, deployment.names, deployment.settings, RecordedProgress())
    assert report.covers == acks[-1].seq


async def test_a_lost_index_is_filled_again_while_the_first_delta_is_still_retried(
    deployment: Deployment, azure: AzureSearchServer, azure_projector: AzureProjectorService
) -> None:
    azure.fail_items(entry_key("acme", "main", "first"), times=3)
    tries = azure.requests["index_documents"]
    first = await deployment.publisher.publish_many([upsert("acme", document("first", "text"))])
    async with asyncio.timeout(10):
        while azure.requests["index_documents"] == tries:
            await asyncio.sleep(0.02)
    later = await deployment.publisher.publish_many([upsert("acme", document(i, t)) for i, t in CORPUS.items()])
    async with asyncio.timeout(10):
        while any(_entry(azure, i) is None for i in CORPUS):
            await asyncio.sleep(0.02)
    await azure_projector.stop()  # acked: the corpus; the ack floor: still 0, the first delta waits for a retry
    await _delete_index(deployment, azure)
    await azure_projector.start()
    await _wait_watermark(azure, later[-1].seq)
    assert all(_entry(azure, i) is not None for i in [*CORPUS, "first"])
    assert first[-1].seq < later[-1].seq


# ------------------------------------------------------------------------------- against the real service


@pytest.mark.skipif(
    not (
        os.environ.get("ONTOFABRIC_TEST_AZURE_SEARCH_ENDPOINT") and os.environ.get("ONTOFABRIC_TEST_AZURE_SEARCH_KEY")
    ),
    reason="set ONTOFABRIC_TEST_AZURE_SEARCH_ENDPOINT and ONTOFABRIC_TEST_AZURE_SEARCH_KEY to run against the service",
)
async def test_the_live_service_indexes_and_answers(deployment: Deployment, projector: ProjectorService) -> None:
    """Projector and keyword backend against a real Azure AI Search service, in an index of the test's own."""
    settings = deployment.settings.model_copy(
        update={
            "azure_search_endpoint": os.environ["ONTOFABRIC_TEST_AZURE_SEARCH_ENDPOINT"],
            "azure_search_api_key": SecretStr(os.environ["ONTOFABRIC_TEST_AZURE_SEARCH_KEY"]),
            "azure_search_index": f"ontofabric-test-{deployment.settings.subject_prefix}",
            "keyword_backend": "azure-ai-search",
            "azure_search_timeout_ms": 10_000,
        }
    )
    indexes = index_client(settings, retries=3)
    indexer = AzureProjectorService(settings, deployment.nats_url_as("projector"))
    worker = QueryService(settings, deployment.nats_url_as("query"), deployment.database_url, None)
    try:
        await indexer.start()
        await worker.start()
        seq = await _seed(deployment, None)
        client = QueryClient(deployment.nc, deployment.names, timeout_s=30)
        async with asyncio.timeout(60):  # the service makes new entries searchable within about a second
            while True:
                reply = await client.query(
                    "acme", {"semanticQuery": "zip archive", "options": {"retrievers": ["keyword"]}}
                )
                assert isinstance(reply, QueryResponse), reply
                if reply.results:
                    break
                await asyncio.sleep(1)
        assert reply.meta.backend == "azure-ai-search"
        assert reply.meta.ontology_version.startswith(f"{seq}-")
        assert reply.results[0].id == "zip"
    finally:
        await worker.stop()
        await indexer.stop()
        await indexes.delete_index(settings.azure_search_index)
        await indexes.close()
