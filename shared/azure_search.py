"""The Azure AI Search index both the Azure projector and the azure-ai-search keyword backend use: its schema,
its keys and its clients."""

from __future__ import annotations

import hashlib

from azure.core.credentials import AzureKeyCredential
from azure.core.exceptions import ResourceNotFoundError
from azure.search.documents.aio import SearchClient
from azure.search.documents.indexes.aio import SearchIndexClient
from azure.search.documents.indexes.models import SearchableField, SearchField, SearchFieldDataType, SearchIndex
from azure.search.documents.indexes.models import SimpleField as _SimpleField

from .settings import Settings

DOCUMENT, WATERMARK = "document", "watermark"
"""The two kinds of index entry: a document (or its tombstone), and the watermark."""


def index_definition(name: str) -> SearchIndex:
    """The document schema of the Postgres index, as Azure AI Search fields. ``content`` is the same analysed text
    Postgres indexes (qualified name first, identifiers followed by their parts), searched with the English
    analyzer."""

    def simple(field_name: str, kind: str = SearchFieldDataType.STRING, **flags: bool) -> SearchField:
        return _SimpleField(name=field_name, type=kind, filterable=True, **flags)

    return SearchIndex(
        name=name,
        fields=[
            simple("key", key=True),
            simple("kind"),
            simple("workspace"),
            simple("branch"),
            simple("documentId"),
            simple("seq", SearchFieldDataType.INT64),
            simple("deleted", SearchFieldDataType.BOOLEAN),
            SearchableField(name="content", analyzer_name="en.lucene"),
            simple("contentMd5"),
            simple("objectType"),
            simple("sourceDomain"),
            simple("symbolKey"),
            simple("symbolKind"),
            simple("symbolFqn"),
            simple("contentHash"),
            simple("filePath"),
            simple("chunkLevel"),
            simple("provenance"),
        ],
    )


def entry_key(workspace: str, branch: str, document_id: str) -> str:
    """A document's index key. Keys allow only letters, digits, '_', '-' and '=' and at most 1,024 characters,
    where a workspace, a branch and an id together may be longer and hold any character: a SHA-256 of the three
    (the parts themselves are fields of the entry)."""
    return hashlib.sha256("\x1f".join([workspace, branch, document_id]).encode("utf-8")).hexdigest()


WATERMARK_KEY = WATERMARK
"""The one watermark entry: every delta of the stream up to its ``seq`` has been taken in (the consumer's ack
floor). No document key can equal it: those are 64 hexadecimal digits."""


def _service(settings: Settings) -> tuple[str, AzureKeyCredential]:
    if settings.azure_search_endpoint is None or settings.azure_search_api_key is None:
        raise ValueError("ONTOFABRIC_AZURE_SEARCH_ENDPOINT and ONTOFABRIC_AZURE_SEARCH_API_KEY must both be set")
    return settings.azure_search_endpoint, AzureKeyCredential(settings.azure_search_api_key.get_secret_value())


def index_client(settings: Settings, retries: int) -> SearchIndexClient:
    """A client of the configured service's index definitions; ``retries``: the SDK's own, of a failed call."""
    endpoint, credential = _service(settings)
    return SearchIndexClient(endpoint, credential, retry_total=retries)


def search_client(settings: Settings, retries: int, read_timeout_s: float | None = None) -> SearchClient:
    """A client of the configured index's documents; ``retries``: the SDK's own, of a failed call;
    ``read_timeout_s``: how long a call waits for the service to send anything (None: the SDK's 300 s)."""
    endpoint, credential = _service(settings)
    timeouts = {} if read_timeout_s is None else {"read_timeout": read_timeout_s}
    return SearchClient(endpoint, settings.azure_search_index, credential, retry_total=retries, **timeouts)


async def read_watermark(client: SearchClient) -> int | None:
    """The sequence up to which the index has taken in every delta; None when it has no watermark (new or lost)."""
    try:
        entry = await client.get_document(WATERMARK_KEY, selected_fields=["seq"])
    except ResourceNotFoundError:
        return None
    return int(entry["seq"])
