"""The retrievers a query worker runs, registered in one place. The pipeline runs every one of them by default
(a request may ask for some by name), fuses their lists and reports each by its name."""

from __future__ import annotations

from azure.search.documents.aio import SearchClient

from ontofabric.shared.settings import Settings

from .azure import AzureKeyword
from .core import Retriever, VectorBy
from .postgres import PostgresDense, PostgresDocuments, PostgresKeyword, Snapshots


def build_retrievers(
    settings: Settings,
    snapshots: Snapshots,
    documents: PostgresDocuments,
    azure: SearchClient | None,
    vector_by: VectorBy | None = None,
) -> list[Retriever]:
    """Dense search on pgvector, and keyword search on the configured backend (``azure`` when it is Azure AI
    Search)."""
    keyword: Retriever
    if settings.keyword_backend == "azure-ai-search":
        if azure is None:
            raise ValueError("the azure-ai-search keyword backend needs an Azure AI Search client")
        keyword = AzureKeyword(documents, azure, settings.azure_search_timeout_ms / 1000)
    else:
        keyword = PostgresKeyword(
            snapshots,
            settings.text_search_config,
            settings.bm25_k1,
            settings.bm25_b,
            settings.bm25_k3,
            settings.bm25_full_read_postings,
            settings.bm25_completion_depth,
        )
    return [PostgresDense(snapshots, settings.hnsw_ef_search, vector_by), keyword]
