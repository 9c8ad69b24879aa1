"""The local Azure AI Search server, driven through the real azure-search-documents async clients."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from azure.core.credentials import AzureKeyCredential
from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ResourceNotFoundError,
    ServiceResponseTimeoutError,
)
from azure.search.documents.aio import SearchClient
from azure.search.documents.indexes.aio import SearchIndexClient
from azure.search.documents.indexes.models import (
    SearchableField,
    SearchField,
    SearchFieldDataType,
    SearchIndex,
    SimpleField,
)
from azure.search.documents.models import IndexDocumentsBatch, VectorizedQuery

from .azure_search_server import API_VERSION, AzureSearchServer

KEY = "test-admin-key"
INDEX = "chunks"
# No backoff between the SDK's retries, so the retry tests stay fast.
FAST = {"retry_backoff_factor": 0}


def _index(name: str = INDEX) -> SearchIndex:
    return SearchIndex(
        name=name,
        fields=[
            SimpleField(name="id", type=SearchFieldDataType.STRING, key=True, filterable=True),
            SearchableField(name="title"),
            SearchableField(name="body"),
            SimpleField(name="workspace", type=SearchFieldDataType.STRING, filterable=True),
            SimpleField(name="deleted", type=SearchFieldDataType.BOOLEAN, filterable=True),
            SimpleField(name="version", type=SearchFieldDataType.INT32, filterable=True, sortable=True),
            SearchableField(name="tags", collection=True, filterable=True),
            SimpleField(name="secret", type=SearchFieldDataType.STRING, hidden=True),
        ],
    )


@pytest.fixture
async def server() -> AsyncIterator[AzureSearchServer]:
    async with AzureSearchServer(api_key=KEY) as running:
        yield running


@pytest.fixture
async def client(server: AzureSearchServer) -> AsyncIterator[SearchClient]:
    async with SearchIndexClient(server.endpoint, AzureKeyCredential(KEY), **FAST) as indexes:
        await indexes.create_or_update_index(_index())
    async with SearchClient(server.endpoint, INDEX, AzureKeyCredential(KEY), **FAST) as search:
        yield search


def _doc(key: str, body: str, **fields: Any) -> dict[str, Any]:
    return {"id": key, "title": "", "body": body, "workspace": "acme", "deleted": False, "version": 1} | fields


async def _search(client: SearchClient, text: str | None, **kwargs: Any) -> list[dict[str, Any]]:
    return [hit async for hit in await client.search(search_text=text, **kwargs)]


async def test_index_definition_lifecycle(server: AzureSearchServer) -> None:
    async with SearchIndexClient(server.endpoint, AzureKeyCredential(KEY)) as indexes:
        created = await indexes.create_or_update_index(_index("kb"))
        assert created.e_tag
        fetched = await indexes.get_index("kb")
        fields = {f.name: f for f in fetched.fields}
        assert fields["id"].key
        assert fields["body"].searchable
        assert not fields["version"].searchable
        assert fields["secret"].hidden
        assert [name async for name in indexes.list_index_names()] == ["kb"]
        # Adding a field is allowed; changing an existing one is not.
        grown = _index("kb")
        grown.fields.append(SimpleField(name="lang", type=SearchFieldDataType.STRING))
        await indexes.create_or_update_index(grown)
        changed = _index("kb")
        changed.fields[5] = SimpleField(name="version", type=SearchFieldDataType.STRING)
        with pytest.raises(HttpResponseError) as caught:
            await indexes.create_or_update_index(changed)
        assert caught.value.status_code == 400
        await indexes.delete_index("kb")
        with pytest.raises(ResourceNotFoundError):
            await indexes.get_index("kb")


@pytest.mark.parametrize("keys", [0, 2])
async def test_index_needs_exactly_one_key(server: AzureSearchServer, keys: int) -> None:
    fields = [SearchField(name=f"k{i}", type=SearchFieldDataType.STRING, key=True) for i in range(keys)]
    fields.append(SearchableField(name="body"))
    async with SearchIndexClient(server.endpoint, AzureKeyCredential(KEY)) as indexes:
        with pytest.raises(HttpResponseError) as caught:
            await indexes.create_or_update_index(SearchIndex(name="bad", fields=fields))
    assert caught.value.status_code == 400
    assert caught.value.error is not None
    assert "key field" in (caught.value.error.message or "")


async def test_upload_merge_delete_and_lookup(server: AzureSearchServer, client: SearchClient) -> None:
    results = await client.upload_documents([_doc("a", "alpha"), _doc("b", "beta")])
    assert [(r.key, r.succeeded, r.status_code) for r in results] == [("a", True, 201), ("b", True, 201)]
    assert await client.get_document_count() == 2

    [merged] = await client.merge_or_upload_documents([{"id": "a", "version": 2}])
    assert (merged.succeeded, merged.status_code) == (True, 200)
    doc = await client.get_document("a")
    assert (doc["body"], doc["version"]) == ("alpha", 2)
    assert "secret" not in doc  # not retrievable
    assert await client.get_document("a", selected_fields=["version"]) == {"version": 2}

    # An upload replaces the whole document: fields it leaves out become null.
    await client.upload_documents([{"id": "a", "body": "again"}])
    assert server.documents(INDEX)["a"]["version"] is None

    await client.delete_documents([{"id": "a"}, {"id": "never-there"}])
    with pytest.raises(ResourceNotFoundError):
        await client.get_document("a")
    assert set(server.documents(INDEX)) == {"b"}
    assert server.requests["index_documents"] == 4


async def test_merge_of_missing_document_fails_per_item(server: AzureSearchServer, client: SearchClient) -> None:
    batch = IndexDocumentsBatch()
    batch.add_upload_actions([_doc("a", "alpha")])
    batch.add_merge_actions([{"id": "ghost", "version": 3}])
    batch.add_upload_actions([{"id": "bad key!", "body": "x"}])
    ok, missing, bad_key = await client.index_documents(batch)
    assert (ok.succeeded, ok.status_code) == (True, 201)
    assert (missing.succeeded, missing.status_code, missing.key) == (False, 404, "ghost")
    assert (bad_key.succeeded, bad_key.status_code) == (False, 400)
    assert set(server.documents(INDEX)) == {"a"}


async def test_schema_violations_reject_the_whole_batch(server: AzureSearchServer, client: SearchClient) -> None:
    for document in ({"id": "a", "colour": "red"}, {"id": "a", "version": "three"}, {"id": "a", "tags": "x"}):
        with pytest.raises(HttpResponseError) as caught:
            await client.upload_documents([_doc("ok", "fine"), document])
        assert caught.value.status_code == 400
    assert server.documents(INDEX) == {}
    with pytest.raises(HttpResponseError) as caught:
        await client.upload_documents([_doc(f"d{i}", "x") for i in range(1001)])
    assert caught.value.status_code == 400


async def test_bm25_ranks_rarer_terms_higher(client: SearchClient) -> None:
    await client.upload_documents(
        [
            _doc("common", "graph graph graph index"),
            _doc("rare", "graph projector"),
            _doc("neither", "unrelated words here"),
            _doc("other", "graph storage"),
        ]
    )
    hits = await _search(client, "graph projector")
    assert [hit["id"] for hit in hits] == ["rare", "common", "other"]
    scores = [hit["@search.score"] for hit in hits]
    assert scores == sorted(scores, reverse=True)
    # Lucene BM25 by hand for "rare": "graph" is in 3 of 4 bodies, "projector" in 1; lengths 4, 2, 3, 2.
    avgdl, norm = 11 / 4, 1.2 * (1 - 0.75 + 0.75 * 2 / 11 * 4)
    idf_graph, idf_projector = math.log(1 + 1.5 / 3.5), math.log(1 + 3.5 / 1.5)
    assert avgdl == 2.75
    assert hits[0]["@search.score"] == pytest.approx((idf_graph + idf_projector) / (1 + norm))
    assert await _search(client, "nothing matches this") == []
    assert [hit["id"] for hit in await _search(client, "graph projector", search_mode="all")] == ["rare"]
    assert await _search(client, "graph", search_fields=["title"]) == []


async def test_filters(client: SearchClient) -> None:
    await client.upload_documents(
        [
            _doc("a", "x", version=1, tags=["red", "blue"]),
            _doc("b", "x", version=2, deleted=True, tags=["red"]),
            _doc("c", "x", version=3, workspace="other"),
            _doc("d", "x", version=4, tags=[]),
        ]
    )

    async def ids(expression: str) -> list[str]:
        return sorted(hit["id"] for hit in await _search(client, "*", filter=expression))

    assert await ids("workspace eq 'acme'") == ["a", "b", "d"]
    assert await ids("deleted eq false and workspace ne 'other'") == ["a", "d"]
    assert await ids("not (deleted eq true) and (version eq 1 or version ge 4)") == ["a", "d"]
    assert await ids("search.in(id, 'a, c')") == ["a", "c"]
    assert await ids("search.in(id, 'b|d', '|') and version lt 4") == ["b"]
    assert await ids("tags/any(t: t eq 'blue')") == ["a"]
    assert await ids("tags/any(t: search.in(t, 'red')) and not tags/any(t: t eq 'blue')") == ["b"]
    assert await ids("tags/any()") == ["a", "b"]
    assert await ids("workspace eq 'it''s'") == []
    for bad in ("body eq 'x'", "version eq 'one'", "tags eq 'red'", "workspace eq", "nope eq 1", "id eq version"):
        with pytest.raises(HttpResponseError) as caught:
            await ids(bad)
        assert caught.value.status_code == 400, bad


async def test_top_skip_select_count_and_order(client: SearchClient) -> None:
    await client.upload_documents([_doc(f"d{i}", f"shared term {i}", version=i) for i in range(5)])
    results = await client.search(
        search_text="shared",
        top=2,
        skip=1,
        select=["id", "version"],
        include_total_count=True,
        order_by=["version desc"],
    )
    assert await results.get_count() == 5
    hits = [hit async for hit in results]
    assert [hit["version"] for hit in hits] == [3, 2]
    assert {key for key in hits[0] if not key.startswith("@search.")} == {"id", "version"}
    with pytest.raises(HttpResponseError):
        await _search(client, "*", select=["secret"])
    with pytest.raises(HttpResponseError):
        await _search(client, "*", order_by=["body asc"])


async def test_search_pages_through_continuation(server: AzureSearchServer, client: SearchClient) -> None:
    await client.upload_documents([_doc(f"d{i:03}", "x") for i in range(120)])
    assert len(await _search(client, "*")) == 120  # 50 a page without top, followed by the SDK
    assert server.requests["search"] == 3
    assert len(await _search(client, "*", top=70)) == 70
    assert server.requests["search"] == 4


@pytest.mark.parametrize("query", [{"query_type": "semantic"}, {"query_type": "full"}, {"facets": ["workspace"]}])
async def test_unsupported_query_features_are_rejected(client: SearchClient, query: dict[str, Any]) -> None:
    with pytest.raises(HttpResponseError) as caught:
        await _search(client, "graph", **query)
    assert caught.value.status_code == 400


async def test_vector_queries_are_rejected(client: SearchClient) -> None:
    with pytest.raises(HttpResponseError) as caught:
        await _search(
            client, None, vector_queries=[VectorizedQuery(vector=[0.1, 0.2], k_nearest_neighbors=3, fields="body")]
        )
    assert caught.value.status_code == 400


async def test_wrong_key_and_api_version_are_rejected(server: AzureSearchServer, client: SearchClient) -> None:
    async with SearchClient(server.endpoint, INDEX, AzureKeyCredential("wrong")) as intruder:
        with pytest.raises(HttpResponseError) as caught:
            await intruder.get_document_count()
    assert caught.value.status_code == 403
    url = f"{server.endpoint}/indexes('{INDEX}')/docs/$count"
    async with aiohttp.ClientSession() as session:
        async with session.get(url, params={"api-version": API_VERSION}) as response:
            assert response.status == 401
        for params in ({}, {"api-version": "2023-11-01"}):
            async with session.get(url, params=params, headers={"api-key": KEY}) as response:
                assert response.status == 400
                assert "error" in await response.json()
        async with session.get(url, params={"api-version": API_VERSION}, headers={"api-key": KEY}) as response:
            assert (response.status, await response.text()) == (200, "0")


async def test_injected_failures(server: AzureSearchServer, client: SearchClient) -> None:
    async with SearchClient(server.endpoint, INDEX, AzureKeyCredential(KEY), retry_total=0) as no_retries:
        server.fail_next(1, 503)
        with pytest.raises(HttpResponseError) as caught:
            await no_retries.get_document_count()
        assert caught.value.status_code == 503
        server.fail_next(1, 401)
        with pytest.raises(ClientAuthenticationError):
            await no_retries.get_document_count()
    # The SDK's default policy retries a 503 (three times) and a 429 that carries Retry-After, even on POST.
    server.fail_next(2, 503)
    assert await _search(client, "*") == []
    server.fail_next(1, 429, retry_after=0.01)
    await client.upload_documents([_doc("a", "x")])
    server.fail_next(4, 503)
    with pytest.raises(HttpResponseError) as caught:
        await client.get_document_count()
    assert caught.value.status_code == 503
    assert server.requests["search"] == 3
    assert server.requests["index_documents"] == 2
    assert server.requests["count"] == 2 + 4  # the four 503s: one attempt and three retries


async def test_delay_applies_to_every_request(server: AzureSearchServer, client: SearchClient) -> None:
    server.delay_s = 0.3
    with pytest.raises(ServiceResponseTimeoutError):
        await client.get_document_count(read_timeout=0.05, retry_total=0)
    server.delay_s = 0
    assert await client.get_document_count() == 0
