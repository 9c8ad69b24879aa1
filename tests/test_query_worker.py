"""End to end against real servers: publish → project → request-reply query, cache, errors, queue group."""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from functools import partial
from pathlib import Path
from random import Random
from urllib.parse import urlsplit

import asyncpg
import pytest
from nats.errors import NoRespondersError
from opentelemetry import trace
from pydantic import SecretStr

from ontofabric.contracts import MAX_REQUEST_BYTES, DocumentReply, ErrorReply, QueryResponse, StatusReply
from ontofabric.contracts.path_patterns import matches, normal_pattern, pattern_regex
from ontofabric.services.gateway.tools import answer_notes
from ontofabric.services.ingest.chunking import SECTION_PART_CHARS
from ontofabric.services.ingest.ingester import Ingester
from ontofabric.services.projector.worker import ProjectorService
from ontofabric.services.query import freshness as freshness_module
from ontofabric.services.query.budget import slice_lines
from ontofabric.services.query.client import QueryClient, RequestTooLarge, parse_reply
from ontofabric.services.query.freshness import LAYOUT_CHECK_S, POSITION_TTL_S, POSITION_WAIT_S
from ontofabric.services.query.requests import repeated_key
from ontofabric.services.query.rerankers import build_reranker
from ontofabric.services.query.worker import QueryService, answerable, parse_request
from ontofabric.shared import db
from ontofabric.shared.db import READER_ROLE, migrate
from ontofabric.shared.embedder import Embedder
from ontofabric.shared.half_characters import BYTE_ORDER_MARK, not_utf8, surrogate_field
from ontofabric.shared.runtime import EmbeddedRuntime, free_port

from .conftest import (
    CORPUS,
    METRICS,
    SPANS,
    Deployment,
    RecordedProgress,
    Start,
    cannot_become_the_superuser,
    metric_points,
    pump,
)
from .factories import delete, document, upsert


@pytest.fixture
def client(deployment: Deployment) -> QueryClient:
    return QueryClient(deployment.nc, deployment.names)


async def _ask(client: QueryClient, text: str, workspace: str = "acme", **params: object) -> QueryResponse:
    reply = await client.query(workspace, {"semanticQuery": text, **params})
    assert isinstance(reply, QueryResponse), reply
    return reply


async def test_paths_and_exclude_paths_select_files_as_ingest_exclude_reads_a_pattern(
    deployment: Deployment, projector: ProjectorService, start_query_worker: Start, client: QueryClient
) -> None:
    """A dogfooding tester's concept questions had tests' docstrings above the implementation (their wording is the
    question's); an agent could not ask for the code without its tests, nor within one directory."""
    files = {
        "core": "pkg/core.py", "test": "pkg/tests/test_core.py", "guide": "docs/guide.md", "deep": "docs/a/b.md",
        "star": "pkg/st*r.py",
    }  # fmt: skip
    deltas = [upsert("acme", document(key, f"alpha retry {key}", filePath=path)) for key, path in files.items()]
    deltas.append(upsert("acme", document("nofile", "alpha retry without a file")))
    acks = await deployment.publisher.publish_many(deltas)
    await deployment.wait_projected(acks[-1].seq)
    await start_query_worker(None)

    async def ids(**params: object) -> set[str]:
        reply = await client.query("acme", {"topK": 20, **params})
        assert isinstance(reply, QueryResponse), reply
        return {result.id for result in reply.results}

    everything = set(files) | {"nofile"}
    assert await ids(semanticQuery="alpha retry") == everything
    assert await ids(semanticQuery="alpha retry", excludePaths=["tests"]) == everything - {"test"}
    assert await ids(semanticQuery="alpha retry", paths=["pkg"]) == {"core", "test", "star"}
    assert await ids(semanticQuery="alpha retry", paths=["docs/*.md"]) == {"guide", "deep"}  # `*` crosses `/`
    assert await ids(semanticQuery="alpha retry", paths=["*.md"], excludePaths=["a"]) == {"guide"}
    assert await ids(semanticQuery="alpha retry", paths=["pkg/st\\*r.py"]) == {"star"}  # escaped: the star itself
    assert await ids(paths=["pkg/tests"]) == {"test"}  # a filter alone lists what it selects
    # Said back as read (an agent tester's could not tell its filter was honoured); left out without any.
    said = await _ask(client, "alpha retry", paths=["./pkg/"], excludePaths=["tests"], chunkLevel="method")
    assert said.meta.filters == {"paths": ["pkg"], "excludePaths": ["tests"], "chunkLevel": "method"}
    bare = await client.send_raw("acme", b'{"semanticQuery": "alpha retry"}')
    assert b'"filters"' not in bare
    refused = parse_reply(await client.send_raw("acme", b'{"semanticQuery": "alpha", "paths": ["../etc"]}'))
    assert isinstance(refused, ErrorReply)
    assert [d.field for d in refused.error.details] == ["paths.0"]  # by its place (a contract tester's were all paths)
    assert "names no path inside a tree" in refused.error.details[0].message
    negated = parse_reply(await client.send_raw("acme", b'{"semanticQuery": "alpha", "paths": ["docs", "!pkg"]}'))
    assert isinstance(negated, ErrorReply)  # a negation in .gitignore, which matched nothing here, unsaid
    assert [d.field for d in negated.error.details] == ["paths.1"]
    assert "negates" in negated.error.details[0].message
    # A ** directory is none or any, as git reads it (a contract tester's matched only the deeper files).
    assert await ids(semanticQuery="alpha retry", paths=["docs/**/*.md"]) == {"guide", "deep"}
    assert await ids(semanticQuery="alpha retry", excludePaths=["**/pkg/**/*.py"]) == {"guide", "deep", "nofile"}
    with_nul = parse_reply(await client.send_raw("acme", b'{"semanticQuery": "alpha", "excludePaths": ["a\\u0000"]}'))
    assert isinstance(with_nul, ErrorReply)  # refused, not the database's error (a review's)
    assert (with_nul.error.code, [d.field for d in with_nul.error.details]) == ("invalid_request", ["excludePaths.0"])
    # The database reads each pattern as the ingest does, over random ones.
    random = Random(11)
    glob = ["a", "b", "*", "?", ".", "/", "[ab]", "[!a]", "[b-a]", "-", "["]
    cases = []
    for _ in range(400):
        path = "/".join(random.choice(["a", "b", "ab", "a.b", "b-a"]) for _ in range(random.randint(1, 3)))
        pattern = normal_pattern("".join(random.choice(glob) for _ in range(random.randint(1, 5))))
        if pattern is not None:
            cases.append((path, pattern))
    rows = await deployment.fetch(
        "SELECT path ~ regex AS matched FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS c(path, regex, n)"
        " ORDER BY n",
        [path for path, _ in cases],
        [pattern_regex(pattern) for _, pattern in cases],
    )
    assert [r["matched"] for r in rows] == [matches(path, [pattern]) for path, pattern in cases]


async def test_publish_project_query_end_to_end(
    seeded: int, deployment: Deployment, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    last_seq = seeded
    await start_query_worker(embedder)
    reply = await _ask(client, "how do I load a csv file", topK=3)
    assert reply.results[0].id == "csv"
    assert [r.rank for r in reply.results] == [1, 2, 3]
    assert {f.retriever for f in reply.results[0].found_by} == {"dense", "keyword"}
    meta = reply.meta
    assert meta.hybrid is True
    assert meta.reranked is False
    assert meta.skipped_rerank == "no_reranker"
    assert meta.cache_hit is False
    assert meta.degraded == []
    assert meta.backend == "postgres-bm25"
    assert meta.ontology_version.startswith(f"{last_seq}-")
    assert {"embed", "dense", "keyword", "fusion", "fetch", "total"} <= set(meta.timings_ms)
    assert 0 < reply.results[-1].score <= reply.results[0].score <= 1


async def test_filters_apply_to_both_retrievers(
    seeded: int, deployment: Deployment, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    await start_query_worker(embedder)
    by_type = await _ask(client, "file", objectType="io.Files", topK=10)
    assert {r.id for r in by_type.results} == {"csv", "zip"}
    by_level = await _ask(client, "file", chunkLevel="type", topK=10)
    assert [r.id for r in by_level.results] == ["zip"]
    by_provenance = await _ask(client, "install tests", provenance="hand-authored", topK=10)
    assert [r.id for r in by_provenance.results] == ["guide"]


async def test_a_filter_alone_lists_what_it_selects(
    seeded: int, deployment: Deployment, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    await start_query_worker(embedder)
    listing = await client.query("acme", {"objectType": "io.Files", "precision": True})
    assert isinstance(listing, QueryResponse), listing
    assert [r.id for r in listing.results] == ["csv", "zip"]  # no file or symbol: by id
    assert all(r.score == 1.0 and r.found_by == [] for r in listing.results)
    meta = listing.meta
    assert (meta.listing, meta.hybrid, meta.retrievers, meta.fusion, meta.reranked) == (True, False, [], None, False)
    assert meta.skipped_rerank == "listing"
    assert (meta.distance_metric, meta.embedding_model) == (None, None)  # a listing embeds no query
    assert meta.degraded == []
    assert "listing" in meta.timings_ms
    first = await client.query("acme", {"chunkLevel": "method", "topK": 2})
    assert isinstance(first, QueryResponse)
    assert [r.id for r in first.results] == ["csv", "fib"]  # a stable order, cut at topK
    refused = parse_reply(await client.send_raw("acme", b'{"topK": 3}'))
    assert isinstance(refused, ErrorReply)
    assert [d.field for d in refused.error.details] == ["semanticQuery"]
    # Read on with offset, page by page, each in the same order (an agent tester's 300 methods stopped at topK).
    whole = await client.query("acme", {"chunkLevel": "method", "topK": 100})
    assert isinstance(whole, QueryResponse)
    pages = []
    for offset in range(0, len(whole.results) + 2, 2):
        page = await client.query("acme", {"chunkLevel": "method", "topK": 2, "offset": offset})
        assert isinstance(page, QueryResponse)
        pages += [r.id for r in page.results]
    assert pages == [r.id for r in whole.results]
    assert len(pages) > 2
    ranked = parse_reply(await client.send_raw("acme", b'{"semanticQuery": "csv", "offset": 2}'))
    assert isinstance(ranked, ErrorReply)
    assert [d.field for d in ranked.error.details] == ["offset"]


async def test_symbol_kind_filters_and_distance_metric_is_reported(
    seeded: int, deployment: Deployment, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    await start_query_worker(embedder, query_cache_entries=0)
    classes = await _ask(client, "compress files into an archive", symbolKind="class", topK=10)
    assert [r.id for r in classes.results] == ["zip"]
    cosine = await _ask(client, "read a csv file", topK=5)
    assert cosine.meta.distance_metric is not None
    assert (cosine.meta.distance_metric.requested, cosine.meta.distance_metric.ran) == ("cosine", "cosine")
    assert cosine.meta.distance_metric.note is None
    l2 = await _ask(client, "read a csv file", topK=5, distanceMetric="l2")
    assert l2.meta.distance_metric is not None
    assert (l2.meta.distance_metric.requested, l2.meta.distance_metric.ran) == ("l2", "cosine")
    assert l2.meta.distance_metric.note is not None
    assert [r.id for r in l2.results] == [r.id for r in cosine.results]
    unknown = parse_reply(await client.send_raw("acme", b'{"semanticQuery": "csv", "distanceMetric": "hamming"}'))
    assert isinstance(unknown, ErrorReply)
    assert [d.field for d in unknown.error.details] == ["distanceMetric"]


async def test_every_answer_says_how_far_it_is_behind_the_stream(
    deployment: Deployment, projector: ProjectorService, start_query_worker: Start, client: QueryClient
) -> None:
    first = await deployment.publisher.publish(upsert("acme", document("a", "alpha text")))
    await deployment.wait_projected(first.seq)
    await start_query_worker(None)
    fresh = await _ask(client, "alpha")
    assert fresh.meta.freshness is not None
    assert fresh.meta.freshness.indexed_seq == first.seq
    assert (fresh.meta.freshness.pending_deltas, fresh.meta.freshness.pending_ms) == (0, None)
    # The projector stops; two deltas are published: the answer, still the old one, says they are pending.
    await projector.stop()
    late = [await deployment.publisher.publish(upsert("acme", document(d, f"{d} text"))) for d in ("b", "c")]
    await asyncio.sleep(0.2)
    behind = await _ask(client, "alpha")
    assert behind.meta.cache_hit is True  # the same version: the cached answer, its freshness read anew
    assert behind.meta.freshness is not None
    assert behind.meta.freshness.indexed_seq == first.seq
    assert behind.meta.freshness.pending_deltas == 2
    assert behind.meta.freshness.pending_ms is not None
    assert behind.meta.freshness.pending_ms >= 200
    # A delta that changes nothing (an event handled before, republished under another message id) moves the
    # position, not the version.
    await projector.start()
    await deployment.wait_projected(late[-1].seq)
    repeat = upsert("acme", document("a", "alpha text"), event_id="evt-a")
    applied = await deployment.publisher.publish(repeat)
    await deployment.wait_projected(applied.seq)
    await asyncio.sleep(0.2)
    version = (await _ask(client, "alpha", topK=3)).meta.ontology_version
    subject, data, _ = deployment.publisher._message(repeat)  # the same bytes, another message id
    noop = await deployment.js.publish(subject, data, headers={"Nats-Msg-Id": "evt-a-again"})
    await deployment.wait_projected(noop.seq)
    await asyncio.sleep(2 * POSITION_TTL_S)  # the worker reads the position anew
    caught_up = await _ask(client, "alpha", topK=4)
    assert caught_up.meta.ontology_version == version
    assert caught_up.meta.freshness is not None
    assert caught_up.meta.freshness.indexed_seq == noop.seq
    assert caught_up.meta.freshness.pending_deltas == 0


async def test_a_delta_waiting_for_a_retry_holds_every_answer_below_it(
    deployment: Deployment, impatient_projector: ProjectorService, start_query_worker: Start, client: QueryClient
) -> None:
    # A projector whose writes give up quickly on a lock: the delta behind the lock is nak'd and waits, while a
    # later delta of another workspace is applied.
    first = await deployment.publisher.publish(upsert("acme", document("a", "alpha")))
    other = await deployment.publisher.publish(upsert("globex", document("g", "gamma")))
    await deployment.wait_projected(other.seq)
    await start_query_worker(None)
    async with deployment.session() as conn, conn.transaction():
        await conn.execute("SELECT 1 FROM ontology_versions WHERE workspace = 'acme' FOR UPDATE")
        held = await deployment.publisher.publish(upsert("acme", document("b", "beta")))
        later = await deployment.publisher.publish(upsert("globex", document("h", "delta words")))
        async with asyncio.timeout(30):
            while not (answer := await _ask(client, "delta words", workspace="globex")).results:
                await asyncio.sleep(0.1)
        # The later delta is in the answer, but the answer does not claim the one still waiting below it.
        assert [r.id for r in answer.results] == ["h"]
        assert answer.meta.freshness is not None
        assert first.seq <= answer.meta.freshness.indexed_seq < held.seq < later.seq
        assert answer.meta.freshness.pending_deltas == 1  # globex's later delta, already in, is counted
    await deployment.wait_projected(later.seq, timeout_s=30)
    await asyncio.sleep(2 * POSITION_TTL_S)
    caught_up = await _ask(client, "beta")
    assert [r.id for r in caught_up.results] == ["b"]
    assert caught_up.meta.freshness is not None
    assert (caught_up.meta.freshness.indexed_seq, caught_up.meta.freshness.pending_deltas) == (later.seq, 0)


async def test_a_document_whole_or_in_slices(
    seeded: int, deployment: Deployment, start_query_worker: Start, client: QueryClient
) -> None:
    await start_query_worker(None)
    text = CORPUS["csv"][0]
    whole = await client.document("acme", {"id": "csv"})
    assert isinstance(whole, DocumentReply), whole
    assert (whole.content, whole.offset, whole.content_length, whole.truncated) == (text, 0, len(text), False)
    assert whole.object_type == "io.Files"
    assert whole.ontology_version.startswith(f"{seeded}-")
    part = await client.document("acme", {"id": "csv", "offset": 5, "maxChars": 10})
    assert isinstance(part, DocumentReply), part
    assert (part.content, part.truncated) == (text[5:15], True)

    def not_found_counted(request: str) -> float:
        points = metric_points("retrieval.query.errors")
        return sum(p.value for p in points if p.attributes == {"code": "not_found", "request": request})

    before = not_found_counted("document"), not_found_counted("query")
    missing = await client.document("acme", {"id": "nope"})
    assert isinstance(missing, ErrorReply)
    assert (missing.error.code, [d.field for d in missing.error.details]) == ("not_found", ["id"])
    # Counted as a document request's: the paging ratio reads queries' errors (an auditor's two stale ids read as
    # 67 % of requests failing).
    assert (not_found_counted("document"), not_found_counted("query")) == (before[0] + 1, before[1])
    refused = parse_reply(await client.send_raw("acme", b'{"id": "csv", "offset": -1}', "document"), DocumentReply)
    assert isinstance(refused, ErrorReply)
    assert (refused.error.code, [d.field for d in refused.error.details]) == ("invalid_request", ["offset"])
    on_branch = await client.document("acme", {"id": "nope", "branch": "feature/x"})
    assert isinstance(on_branch, ErrorReply)
    assert "main does" not in on_branch.error.message
    at_end = await client.document("acme", {"id": "csv", "offset": len(text)})
    assert isinstance(at_end, DocumentReply)
    assert at_end.content == ""
    past = await client.document("acme", {"id": "csv", "offset": len(text) + 1})
    assert isinstance(past, ErrorReply)
    assert (past.error.code, [d.field for d in past.error.details]) == ("invalid_request", ["offset"])


def test_a_slice_states_the_lines_of_the_file_it_spans() -> None:
    text, where = "a\nbb\nc\nd\n", {"startLine": 10, "endLine": 13}
    assert slice_lines(where, text, 0, len(text)) == [10, 13]
    assert slice_lines(where, text, 2, 3) == [11, 11]  # "bb\n": a newline ends its line, opens none
    assert slice_lines(where, text, 2, 4) == [11, 12]  # "bb\nc": the last in part
    assert slice_lines({"startLine": 10, "endLine": 11}, text, 0, len(text)) == [10, 11]  # within what it states
    assert slice_lines(where, text, len(text), 0) is None  # an empty slice
    assert slice_lines({**where, "symbolKind": "docstring"}, text, 0, 3) is None  # cleaned text, not the file's
    assert slice_lines({"startLine": "10"}, text, 0, 3) is None
    assert slice_lines({}, text, 0, 3) is None
    assert slice_lines({"startLine": 1}, "a\rb\r\nc\r", 5, 2) == [3, 3]  # line ends counted as the ingester counts


async def test_a_long_document_asked_for_whole_comes_within_the_answer_budget(
    deployment: Deployment, projector: ProjectorService, start_query_worker: Start, client: QueryClient
) -> None:
    text = "".join(f'line {i}: ünïcödé "quoted" text\n' for i in range(400))  # about 14,000 bytes of JSON
    ack = await deployment.publisher.publish(upsert("acme", document("long", text, startLine=101, endLine=500)))
    await deployment.wait_projected(ack.seq)
    await start_query_worker(None, answer_max_tokens=1000)  # 4,000 bytes
    first = await client.document("acme", {"id": "long"})
    assert isinstance(first, DocumentReply), first
    assert first.truncated is True
    assert text.startswith(first.content)
    assert first.content.endswith("\n")  # at a line's end
    # Each slice says which lines of the file it spans (an outside tester's agent read a slice as the section's start).
    shown = first.content.count("\n")
    assert first.slice_lines == [101, 100 + shown]
    assert 3000 < len(json.dumps(first.content, ensure_ascii=False).encode()) <= 4000
    assert len(first.model_dump_json().encode()) <= 4000  # the whole reply: a tester's was over by its envelope
    # Left out of a query's answer, the text's length is said (a tester found it null).
    listed = await client.query("acme", {"semanticQuery": "quoted text lines", "includeContent": False})
    assert isinstance(listed, QueryResponse), listed
    assert [(r.content, r.content_length) for r in listed.results] == [(None, len(text))]
    rest = await client.document("acme", {"id": "long", "offset": len(first.content), "maxChars": len(text)})
    assert isinstance(rest, DocumentReply), rest
    assert (first.content + rest.content, rest.truncated) == (text, False)
    assert rest.slice_lines == [101 + shown, 500]
    part = await client.document("acme", {"id": "long", "offset": len(first.content) + 3, "maxChars": 1})
    assert isinstance(part, DocumentReply), part
    assert part.slice_lines == [101 + shown, 101 + shown]  # a character inside a line: that line
    # With maxTokens, maxChars is held to it too, cut at a line's end (what an MCP gateway asks for).
    held = await client.document("acme", {"id": "long", "maxChars": len(text), "maxTokens": 1000})
    assert isinstance(held, DocumentReply), held
    assert (held.truncated, held.content) == (True, first.content)
    assert len(held.model_dump_json().encode()) <= 4000


async def test_a_branch_is_said_to_hide_mains_documents_its_tombstones_name_not_its_tombstones(
    deployment: Deployment, projector: ProjectorService, start_query_worker: Start, client: QueryClient
) -> None:
    """An auditor's branch said 7 hidden where it hid 5: two of its tombstones named ids main never indexed (their
    deltas had been dead-lettered there)."""
    deltas = [
        upsert("hider", document("a", "alpha")),
        upsert("hider", document("b", "beta")),
        delete("hider", "a", branch="feature/y"),
        delete("hider", "never-on-main", branch="feature/y"),
    ]
    acks = await deployment.publisher.publish_many(deltas)
    await deployment.wait_projected(acks[-1].seq)
    await start_query_worker(None)
    status = await client.status("hider", {"branch": "feature/y"})
    assert isinstance(status, StatusReply), status
    assert [(b.branch, b.hidden) for b in status.branches] == [("main", 0), ("feature/y", 1)]


async def test_the_status_says_how_far_the_index_is_behind_its_stream(
    deployment: Deployment, projector: ProjectorService, start_query_worker: Start, client: QueryClient
) -> None:
    first = await deployment.publisher.publish(upsert("acme", document("a", "alpha")))
    await deployment.wait_projected(first.seq)
    await start_query_worker(None)
    status = await client.status("acme", {})
    assert isinstance(status, StatusReply), status
    [main] = status.branches
    assert status.indexed_seq == first.seq
    assert (main.branch, main.latest_seq, main.pending_deltas) == ("main", first.seq, 0)
    assert (main.documents, status.pending_deltas, status.dead_letters) == (1, 0, 0)
    assert main.last_change is not None
    assert status.ontology_version == main.ontology_version
    assert status.ontology_version.startswith(f"{first.seq}-")
    # What a producer in another language must send vectors of (a nats.js tester found it nowhere it could read).
    assert (status.embedding_model, status.embedding_dimension) == (
        deployment.settings.embedding_model,
        deployment.settings.embedding_dim,
    )
    # The projector stops; a delta on main and one on a branch wait; one that can never apply is published too.
    await projector.stop()
    later = await deployment.publisher.publish(upsert("acme", document("b", "beta")))
    on_branch = await deployment.publisher.publish(upsert("acme", document("c", "gamma"), branch="feature/x"))
    broken = await deployment.js.publish(deployment.names.delta_subject("acme", "main"), b"{not json")
    behind = await client.status("acme", {"branch": "feature/x"})
    assert isinstance(behind, StatusReply), behind
    assert behind.indexed_seq == first.seq
    assert [(b.branch, b.latest_seq, b.pending_deltas) for b in behind.branches] == [
        ("main", broken.seq, 2),
        ("feature/x", on_branch.seq, 1),
    ]
    assert later.seq < broken.seq
    assert behind.pending_deltas == 3
    assert all(b.pending_ms is not None and b.pending_ms >= 0 for b in behind.branches)
    assert not behind.stream_refused
    # The projector had found the stream replaced (its claim row says so; none runs): the status says it within a
    # look, from the row.
    durable = deployment.names.postgres_projector_durable
    await deployment.fetch(
        "UPDATE projection_fences SET refused = 'a stream made at another time' WHERE durable = $1", durable
    )
    try:
        async with asyncio.timeout(LAYOUT_CHECK_S + 5):
            while not isinstance(said := await client.status("acme", {}), StatusReply) or not said.stream_refused:
                await asyncio.sleep(0.5)
        assert said.indexed_seq == first.seq
    finally:  # adopted
        await deployment.fetch("UPDATE projection_fences SET refused = NULL WHERE durable = $1", durable)
    await projector.start()
    await deployment.wait_projected(broken.seq)
    caught_up = await client.status("acme", {"branch": "feature/x"})
    assert isinstance(caught_up, StatusReply), caught_up
    assert caught_up.dead_letters == 1
    # The dead-lettered delta was the stream's last: the projector's position passed it, so nothing is pending.
    assert caught_up.indexed_seq == broken.seq
    main, branch = caught_up.branches
    assert [(b.branch, b.pending_deltas) for b in (main, branch)] == [("main", 0), ("feature/x", 0)]
    assert caught_up.ontology_version == f"{main.ontology_version}+{branch.ontology_version}"
    assert caught_up.other_branches == []
    # Asked of main, the branches it does not name are named (a tester's agent could not find a branch).
    assert (await client.status("acme", {})).other_branches == ["feature/x"]  # type: ignore[union-attr]
    # The dead-letter stream deleted under a running NATS (a tester's): none is held, and the status says so.
    await deployment.js.delete_stream(deployment.names.dlq_stream)
    without = await client.status("acme", {})
    assert isinstance(without, StatusReply), without
    assert without.dead_letters == 0


async def test_a_slow_position_read_a_status_waits_out_and_an_answer_says_the_last_one_read(
    deployment: Deployment,
    projector: ProjectorService,
    start_query_worker: Start,
    client: QueryClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a loaded CI machine the position read took over the half second a query waits for it: a status, which
    reports it, failed (retryable) where it could have answered, and answers said nothing of their freshness (a
    flake hunter's). The last position read, recent, only understates what an answer holds."""
    first = await deployment.publisher.publish(upsert("acme", document("a", "alpha text")))
    await deployment.wait_projected(first.seq)
    await start_query_worker(None, query_cache_entries=0)  # made anew: a cached answer keeps its maker's
    known = await _ask(client, "alpha")
    assert known.meta.freshness is not None
    assert known.meta.freshness.indexed_seq == first.seq
    read = freshness_module.highest_known_floor

    async def slow(*args: object, **kwargs: object) -> int | None:
        await asyncio.sleep(3 * POSITION_WAIT_S)
        return await read(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(freshness_module, "highest_known_floor", slow)
    await asyncio.sleep(POSITION_TTL_S)
    later = await _ask(client, "alpha")
    assert later.meta.freshness is not None
    assert later.meta.freshness.indexed_seq == first.seq
    status = await client.status("acme", {})
    assert isinstance(status, StatusReply), status
    assert status.indexed_seq == first.seq


async def test_cache_hit_then_invalidated_by_a_new_delta(
    seeded: int, deployment: Deployment, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    await start_query_worker(embedder)
    first = await _ask(client, "fibonacci numbers")
    held = _cached("entries"), _cached("bytes")
    second = await _ask(client, "fibonacci numbers")
    assert (first.meta.cache_hit, second.meta.cache_hit) == (False, True)
    assert (_cached("entries"), _cached("bytes")) == held  # the gauges count what is held, not what was asked
    await _ask(client, "binary search")
    assert _cached("entries") == held[0] + 1
    assert _cached("bytes") > held[1]
    assert second.results == first.results
    assert second.meta.ontology_version == first.meta.ontology_version
    # Cut to a budget, too: the cached answer's _meta holds fewer timings, and so had room for more (a property
    # tester's: a result more, contents cut elsewhere).
    tight = {"topK": 10, "maxTokens": 1000}
    cut, cached = await _ask(client, "fibonacci numbers", **tight), await _ask(client, "fibonacci numbers", **tight)
    assert cached.meta.cache_hit
    assert cut.meta.budget is not None
    assert cut.meta.budget.contents_cut or cut.meta.budget.contents_omitted  # the budget did cut
    assert cached.results == cut.results
    assert cached.meta.budget == cut.meta.budget.model_copy(
        update={"estimated_tokens": cached.meta.budget.estimated_tokens}
    )

    vector = embedder.embed_documents(["Fibonacci numbers with an iterative loop, fast and simple."])[0]
    ack = await deployment.publisher.publish(
        upsert(
            "acme",
            document(
                "fib2",
                "Fibonacci numbers with an iterative loop, fast and simple.",
                embedding=[float(x) for x in vector],
            ),
        )
    )
    await deployment.wait_projected(ack.seq)
    for _ in range(100):  # the worker learns the new version from the KV watch
        third = await _ask(client, "fibonacci numbers")
        if third.meta.ontology_version != first.meta.ontology_version:
            break
        await asyncio.sleep(0.05)
    assert third.meta.cache_hit is False
    assert third.meta.ontology_version.startswith(f"{ack.seq}-")
    assert "fib2" in {r.id for r in third.results}


async def test_a_repeated_question_is_told_what_its_first_asking_was(
    seeded: int, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    """An agent tester's: a name no chunk defines was said so in the first answer's text, not in the same answer
    from the cache (the note reads which lookups ran from the timings, which a cache hit had replaced)."""
    await start_query_worker(embedder)
    asked = {"semanticQuery": "frobnicate_widget_xyz"}
    first, again = await _ask(client, "frobnicate_widget_xyz"), await _ask(client, "frobnicate_widget_xyz")
    assert (first.meta.cache_hit, again.meta.cache_hit) == (False, True)
    assert any(
        "no chunk defining a symbol named 'frobnicate_widget_xyz'" in note for note in answer_notes(first, asked)
    )
    assert answer_notes(again, asked) == answer_notes(first, asked)
    assert set(again.meta.timings_ms) - {"queue"} == set(first.meta.timings_ms) - {"queue"}
    assert again.meta.timings_ms["total"] < first.meta.timings_ms["total"]  # this request's own


async def test_one_tenant_s_many_questions_leave_another_s_answers_cached(
    seeded: int, deployment: Deployment, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    """An outside tester's 1,100 distinct questions to one workspace pushed every other tenant's answers out of
    the one cache they share."""
    await start_query_worker(embedder, query_cache_entries=4)
    vector = embedder.embed_documents(["Retry with exponential backoff and jitter."])[0]
    ack = await deployment.publisher.publish(
        upsert(
            "globex",
            document("retry", "Retry with exponential backoff and jitter.", embedding=[float(x) for x in vector]),
        )
    )
    await deployment.wait_projected(ack.seq)
    assert not (await _ask(client, "fibonacci numbers")).meta.cache_hit
    for n in range(12):
        assert (await _ask(client, f"retry question {n}", workspace="globex")).results
    assert (await _ask(client, "fibonacci numbers")).meta.cache_hit
    assert (await _ask(client, "retry question 11", workspace="globex")).meta.cache_hit  # the flooder keeps some


async def test_a_document_the_branch_deleted_is_said_to_be_mains_still(
    seeded: int, deployment: Deployment, start_query_worker: Start, client: QueryClient
) -> None:
    """An agent on a branch read "no document" for an id main's answers had just given it."""
    await start_query_worker(None)
    ack = await deployment.publisher.publish(delete("acme", "csv", branch="feature/x"))
    await deployment.wait_projected(ack.seq)
    gone = await client.document("acme", {"id": "csv", "branch": "feature/x"})
    assert isinstance(gone, ErrorReply), gone
    assert gone.error.code == "not_found"
    assert "the branch does not hold it (deleted on the branch, or added to main after" in gone.error.message
    assert "ask with branch 'main'" in gone.error.message
    assert isinstance(await client.document("acme", {"id": "csv"}), DocumentReply)
    kept = await client.document("acme", {"id": "sort", "branch": "feature/x"})
    assert isinstance(kept, DocumentReply), kept


def _cached(what: str) -> int:
    """What the process's answer caches hold now, as ``retrieval.cache.entries`` or ``.bytes`` reads it."""
    return sum(point.value for point in metric_points(f"retrieval.cache.{what}"))


async def test_a_stopped_workers_answers_are_not_counted(
    seeded: int, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    """Its cache was counted until the collector took it: a gauge read before and after that differed by its
    answers, with no request between (a test read 3 entries, then 2)."""
    worker = await start_query_worker(embedder)
    before = _cached("entries")
    await _ask(client, "fibonacci numbers")
    assert _cached("entries") == before + 1
    await worker.stop()
    assert _cached("entries") == before  # the worker is still referenced here: its cache is alive, not counted


async def test_a_versions_bucket_made_again_is_watched_again(
    seeded: int, deployment: Deployment, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    """A versions bucket deleted and made again by the projector starts its sequence anew; the watch's consumer,
    made again past the last sequence it had read, heard nothing more: the worker took the old version for the
    announced one, and no answer of the new one was cached again (a fault tester: until a restart)."""
    await start_query_worker(embedder)
    first = await _ask(client, "fibonacci numbers")
    assert (await _ask(client, "fibonacci numbers")).meta.cache_hit
    kv = await deployment.js.key_value(deployment.names.version_bucket)
    key = deployment.names.version_key("acme", "main")
    announced = (await kv.get(key)).value or b""
    for _ in range(30):  # the history of a bucket in use: a longer sequence than the one made again will have
        await kv.put(key, announced)
    await deployment.js.delete_key_value(deployment.names.version_bucket)
    text = "Fibonacci numbers with an iterative loop, fast and simple."
    vector = [float(x) for x in embedder.embed_documents([text])[0]]
    ack = await deployment.publisher.publish(upsert("acme", document("fib2", text, embedding=vector)))
    await deployment.wait_projected(ack.seq, timeout_s=30)  # the projector makes the bucket again to announce
    async with asyncio.timeout(15):
        while (later := await _ask(client, "fibonacci numbers")).meta.ontology_version == first.meta.ontology_version:
            await asyncio.sleep(0.1)
    assert later.meta.ontology_version.startswith(f"{ack.seq}-")
    assert "fib2" in {r.id for r in later.results}
    async with asyncio.timeout(15):  # once the new version's announcement is heard, its answers are kept
        while not (await _ask(client, "fibonacci numbers")).meta.cache_hit:
            await asyncio.sleep(0.1)


async def test_two_workers_in_the_queue_group_both_serve(
    seeded: int, deployment: Deployment, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    first = await start_query_worker(embedder, query_cache_entries=0)
    second = await start_query_worker(embedder, query_cache_entries=0)
    replies = await asyncio.gather(*(_ask(client, f"sort numbers {i}") for i in range(40)))
    assert all(r.results[0].id == "sort" for r in replies)
    assert first.handled > 0
    assert second.handled > 0
    assert first.handled + second.handled == 40


MALFORMED = [
    (b"", None),
    (b"\xff\xfe not utf-8", None),
    (b"[1, 2, 3]", None),
    (b'{"semanticQuery": "x", "topK": 0}', "topK"),
    (b'{"semanticQuery": "x", "topK": 101}', "topK"),
    (b'{"semanticQuery": "x", "linkDepth": 2}', "linkDepth"),
    (b'{"semanticQuery": "x", "chunkLevel": "paragraph"}', "chunkLevel"),
    (b'{"semanticQuery": "x", "surprise": true}', "surprise"),
    (b'{"semanticQuery": "x", "workspace": "someone-else"}', "workspace"),
    (json.dumps({"semanticQuery": "x" * 5000}).encode(), "semanticQuery"),
    # Named as the field, not as the fusion object (a contract tester's).
    (b'{"semanticQuery": "x", "options": {"fusion": {"method": "convex", "rrfK": 5}}}', "options.fusion.rrfK"),
    (
        b'{"semanticQuery": "x", "options": {"fusion": {"method": "rrf", "denseWeight": 0.3}}}',
        "options.fusion.denseWeight",
    ),
    (b'{"semanticQuery": "x", "options": {"fusion": {"denseWeight": 0.9}}}', "options.fusion.denseWeight"),
    (b'{"semanticQuery": "x", "topK": 1, "topK": 50}', "topK"),  # which one was read, the client cannot know
    (b'{"semanticQuery": "x", "options": {"candidates": 5, "candidates": 50}}', "options.candidates"),
]


async def test_malformed_queries_get_structured_errors_and_the_worker_keeps_serving(
    seeded: int, deployment: Deployment, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    await start_query_worker(embedder)
    for body, field in MALFORMED:
        reply = ErrorReply.model_validate_json(await client.send_raw("acme", body))
        assert reply.error.code == "invalid_request", body
        assert reply.error.retryable is False
        if field is not None:
            assert field in {d.field for d in reply.error.details}, (body, reply.error.details)
        ok = await _ask(client, "send an http request")
        assert ok.results[0].id == "http"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (rb'{"semanticQuery": "a\ud800b"}', "semanticQuery"),  # an emoji cut in half by a JavaScript client
        (rb'{"semanticQuery": "ok", "options": {"retrievers": ["x\udfff"]}}', "options.retrievers.0"),
        (b'{"semanticQuery": }', None),  # not JSON at all: pydantic's own message, no field
        # Text in another encoding (an outside tester's `café` in Latin-1 got pydantic's message, no field).
        ('{"semanticQuery": "café signal"}'.encode("latin-1"), "semanticQuery"),
        (b'{"semanticQuery": "ok", "options": {"retrievers": ["\xc0\xaf"]}}', "options.retrievers.0"),
    ],
)
def test_half_a_character_is_named_by_its_field(body: bytes, field: str | None) -> None:
    reply = parse_request(body, "acme", 1000)
    assert isinstance(reply, bytes)
    error = ErrorReply.model_validate_json(reply).error
    assert error.code == "invalid_request"
    assert error.details[0].field == field
    whole = parse_request(rb'{"semanticQuery": "a\ud83d\ude00b"}', "acme", 1000)  # a whole pair is a character
    assert not isinstance(whole, bytes)
    assert whole.semantic_query == "a\U0001f600b"


def test_a_byte_order_mark_before_a_request_is_said() -> None:
    """As the projector says it of a delta (a nats.js tester's): not pydantic's "expected value at column 1"."""
    reply = parse_request(b'\xef\xbb\xbf{"semanticQuery": "x"}', "acme", 1000)
    assert isinstance(reply, bytes)
    error = ErrorReply.model_validate_json(reply).error
    assert error.code == "invalid_request"
    assert [(d.field, d.message) for d in error.details] == [(None, BYTE_ORDER_MARK)]


def test_a_key_given_twice_is_named_with_its_path() -> None:
    """A fault harness's: ``{"topK": 1, "topK": 50}`` was answered with 50 results, the last value read in silence."""
    assert repeated_key(b'{"a": [{"b": 1}, {"c": 1, "c": 2}]}') == "a.1.c"
    assert repeated_key(b'{"a": {"b": 1}, "c": {"b": 2}}') is None  # one name in two objects is no repeat
    assert repeated_key(b'{"a": 1, "a": {"b": 1, "b": 2}}') == "a"  # the outer first
    assert repeated_key(b'{"a": 1') is None  # not JSON: the contract's parser says so
    reply = parse_request(b'{"semanticQuery": "x", "topK": 1, "topK": 50}', "acme", 1000)
    assert isinstance(reply, bytes)
    error = ErrorReply.model_validate_json(reply).error
    assert (error.code, error.message) == ("invalid_request", "the request names 'topK' twice")
    assert [(d.field, d.message) for d in error.details] == [("topK", "given twice: a request names each field once")]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"semanticQuery": "x", "options": {"fusion": {"denseWeight": NaN}}}', "options.fusion.denseWeight"),
        (b'{"semanticQuery": "x", "minRelevance": -Infinity}', "minRelevance"),
    ],
)
def test_nan_and_infinity_are_refused_as_what_they_are(body: bytes, field: str) -> None:
    """An outside tester's: NaN, which no JSON holds, was read as a number and refused for a bound (at most 1)."""
    reply = parse_request(body, "acme", 1000)
    assert isinstance(reply, bytes)
    detail = ErrorReply.model_validate_json(reply).error.details[0]
    assert (detail.field, detail.message) == (field, "Input should be a finite number")


async def test_an_error_reply_names_the_first_problems_and_counts_the_rest(
    seeded: int, deployment: Deployment, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    # 60,000 unknown fields once made an error reply too large to send: the caller got nothing.
    await start_query_worker(embedder)
    long_names = [f'"{"x" * 1000}{i}": 1' for i in range(5)]  # named, but cut short
    fields = ", ".join([*long_names, *(f'"u{i:05d}": 1' for i in range(4_000 - 5))])
    body = f'{{"semanticQuery": "sort", {fields}}}'.encode()
    assert len(body) <= MAX_REQUEST_BYTES
    data = await client.send_raw("acme", body)
    reply = ErrorReply.model_validate_json(data)
    assert reply.error.code == "invalid_request"
    assert len(reply.error.details) == 21
    assert reply.error.details[-1].message == "and 3980 more problems"
    assert all(len(d.field or "") <= 200 for d in reply.error.details)
    assert len(data) < 16_000


async def test_a_body_longer_than_any_request_is_refused_unread(
    seeded: int, deployment: Deployment, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    """A red team's finding: a megabyte of unknown fields took the worker's event loop half a second to parse
    and report, and 20 such bodies made another tenant's replies seconds late."""
    await start_query_worker(embedder)
    fields = ", ".join(f'"u{i:05d}": 1' for i in range(60_000))
    body = f'{{"semanticQuery": "sort", {fields}}}'.encode()
    assert MAX_REQUEST_BYTES < len(body) < deployment.nc.max_payload
    with pytest.raises(RequestTooLarge, match="a request takes at most 65,536"):
        await client.send_raw("acme", body)  # our client refuses it unsent, with the one limit whatever the size
    with pytest.raises(RequestTooLarge, match="a request takes at most 65,536"):
        await client.send_raw("acme", b" " * 2_000_000)
    # Another client sends it all the same: the worker refuses it unread.
    answer = await deployment.nc.request(deployment.names.request_subject("query", "acme"), body, timeout=10)
    reply = ErrorReply.model_validate_json(answer.data)
    assert reply.error.code == "invalid_request"
    assert reply.error.message == f"the request is {len(body):,} bytes; a request takes at most {MAX_REQUEST_BYTES:,}"
    ok = await _ask(client, "send an http request")
    assert ok.results[0].id == "http"


def test_fields_are_read_by_their_wire_names_only() -> None:
    """The schema names camelCase only; a snake_case name was read as well, so a gateway that budgets by
    ``maxTokens`` let ``max_tokens`` through unhalved."""
    reply = parse_request(b'{"semanticQuery": "x", "max_tokens": 2000, "options": {"late_interaction": {}}}', "a", 99)
    assert isinstance(reply, bytes)
    fields = {d.field for d in ErrorReply.model_validate_json(reply).error.details}
    assert fields == {"max_tokens", "options.late_interaction"}
    assert not isinstance(parse_request(b'{"semanticQuery": "x", "maxTokens": 2000}', "a", 99), bytes)


async def test_without_an_embedder_answers_are_keyword_only_and_say_so(
    seeded: int, deployment: Deployment, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    await start_query_worker(None)
    reply = await _ask(client, "zip archive directory")
    assert reply.results[0].id == "zip"
    assert reply.meta.hybrid is False
    assert reply.meta.retrievers == ["keyword"]
    assert reply.meta.degraded == ["embedder"]
    assert [f.retriever for f in reply.results[0].found_by] == ["keyword"]


async def test_the_few_documents_sent_without_vectors_that_hold_a_rare_word_lead_its_answer(
    seeded: int, deployment: Deployment, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    """An outside tester's: five documents published without vectors (as a producer in another language may), the
    only ones holding a made-up word and alike in BM25, were all missing from the default request's answer for it;
    dense's cosines of unrelated code filled it."""
    await start_query_worker(embedder, query_cache_entries=0)
    bare = [
        upsert("acme", document(f"bare{i}", f"The blorpfive setting controls how widget number {i} renders."))
        for i in range(5)
    ]
    acks = await deployment.publisher.publish_many(bare)
    await deployment.wait_projected(acks[-1].seq)
    reply = await _ask(client, "blorpfive", topK=5)
    assert {r.id for r in reply.results} == {f"bare{i}" for i in range(5)}, [r.id for r in reply.results]
    assert reply.meta.hybrid is True


async def test_a_made_up_word_written_once_in_a_long_function_leads_its_answer(
    seeded: int, deployment: Deployment, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    """Ours, after an outside tester's: a plain word (no code shape) held by one long function and nowhere else
    saturated BM25 at 0.014 by length normalisation, dense took 0.95 of the weight with cosines for a word the
    model never learned, and the function was not in the top 5. Every query term it holds makes it lead, and its
    score says so."""
    await start_query_worker(embedder, query_cache_entries=0)
    body = "\n".join(f"    total_{i} = accumulate(records, offset={i})" for i in range(400))
    texts = {
        "long": f"def summarise(records):\n{body}\n    zorblaxquux = finalise(total_399)\n    return zorblaxquux",
        **{f"view{i}": f"def show_page_{i}(request):\n    return render(request, 'page{i}.html')" for i in range(20)},
    }
    vectors = embedder.embed_documents(list(texts.values()))
    deltas = [
        upsert("rare", document(k, v, embedding=list(e))) for (k, v), e in zip(texts.items(), vectors, strict=True)
    ]
    acks = await deployment.publisher.publish_many(deltas)
    await deployment.wait_projected(acks[-1].seq)
    reply = await _ask(client, "zorblaxquux", workspace="rare", topK=5)
    assert reply.results[0].id == "long", [r.id for r in reply.results]
    assert reply.meta.hybrid is True
    assert reply.meta.fusion is not None
    assert reply.meta.fusion.parameters["denseWeight"] < 0.5
    # What the answer says of it: the word held whole, and the gap fusion used.
    assert reply.meta.signals["keywordCoverage"] == 1.0
    assert reply.meta.signals["keywordSaturation"] < 0.1
    assert reply.meta.signals["keywordGap"] == reply.meta.fusion.parameters["keywordGap"]
    # Its calibrated score reads the same strength (it was 0.011, under the second result's 0.021), so a
    # threshold above the passing results keeps the one that holds the word.
    assert reply.results[0].score > 5 * max(r.score for r in reply.results[1:])
    kept = await _ask(client, "zorblaxquux", workspace="rare", topK=5, minRelevance=0.05)
    assert [r.id for r in kept.results] == ["long"]


async def test_a_sentence_deep_in_a_long_markdown_section_is_found_in_a_part_with_its_lines(
    deployment: Deployment,
    projector: ProjectorService,
    embedder: Embedder,
    start_query_worker: Start,
    client: QueryClient,
    tmp_path: Path,
) -> None:
    """An agent tester's: a section of 300 lines was one chunk, so a sentence at its end was found by neither
    retriever among shorter sections, and the hit pointed at the section's start. Cut into parts, the part holding
    it is found, with its own lines."""
    filler = "".join(
        f"Filler line {i} about the yearly budget, staffing and office moves.\n" + ("\n" if i % 7 == 0 else "")
        for i in range(300)
    )
    head = "# Operations handbook\n\n## Annual overview\n"
    (tmp_path / "handbook.md").write_text(
        head + filler + "The circuit breaker opens after seven consecutive failures.\n"
    )
    (tmp_path / "faults.md").write_text(
        "# Failures\n\nHow failures are counted.\n\n# Circuits\n\nA circuit in a building.\n\n# Breakers\n\nOne.\n"
    )
    ingester = Ingester(deployment.js, deployment.names, embedder, deployment.settings.max_content_bytes)
    report = await ingester.ingest(tmp_path, "handbook")
    assert report.last_sequence is not None
    await deployment.wait_projected(report.last_sequence)
    await start_query_worker(embedder, query_cache_entries=0)
    reply = await _ask(client, "circuit breaker seven consecutive failures", workspace="handbook", topK=3)
    first = reply.results[0]
    assert first.metadata["symbolFqn"] == "handbook.md > Operations handbook > Annual overview"
    assert first.content is not None
    assert "seven consecutive failures" in first.content
    assert len(first.content) <= SECTION_PART_CHARS
    line = (head + filler).count("\n") + 1
    assert first.metadata["startLine"] <= line == first.metadata["endLine"]


async def test_a_late_worker_knows_the_current_version(
    seeded: int, deployment: Deployment, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    last_seq = seeded
    await asyncio.sleep(0.2)
    await start_query_worker(embedder)  # started after every version was announced
    reply = await _ask(client, "json")
    assert reply.meta.ontology_version.startswith(f"{last_seq}-")
    empty = await _ask(client, "json", workspace="nobody")
    assert empty.results == []
    assert empty.meta.ontology_version == "0-0000000000000000"


async def test_database_outage_is_a_retryable_error_not_a_crash(
    seeded: int, deployment: Deployment, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    await start_query_worker(embedder, query_cache_entries=0)
    async with deployment.database_outage():
        down = ErrorReply.model_validate_json(await client.send_raw("acme", b'{"semanticQuery": "sort numbers"}'))
        assert down.error.code == "unavailable"
        assert down.error.retryable is True
    back = await _ask(client, "sort numbers")
    assert back.results[0].id == "sort"


async def test_query_metrics_and_trace_context_cross_nats(
    seeded: int, deployment: Deployment, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    await start_query_worker(embedder)
    hits, misses = _count("retrieval.cache.hit"), _count("retrieval.cache.miss")
    with trace.get_tracer("tests").start_as_current_span("gateway.request") as span:
        await _ask(client, "compress a directory into a zip archive")
        await _ask(client, "compress a directory into a zip archive")
    trace_id = span.get_span_context().trace_id
    assert (_count("retrieval.cache.hit") - hits, _count("retrieval.cache.miss") - misses) == (1, 1)
    expansions = _recorded("retrieval.graph_expansion.duration_ms")
    await _ask(client, "compress a directory into a zip archive", followLinks=True)
    assert _recorded("retrieval.graph_expansion.duration_ms") == expansions + 1
    cached = await _ask(client, "compress a directory into a zip archive", followLinks=True)
    assert cached.meta.cache_hit
    assert "expansion" in cached.meta.timings_ms  # its maker's: counted once, when it ran
    assert _recorded("retrieval.graph_expansion.duration_ms") == expansions + 1
    durations = metric_points("retrieval.query.duration_ms")
    attributes = [dict(p.attributes) for p in durations]
    fresh = {"hybrid": True, "reranked": False, "cacheHit": False, "backend": "postgres-bm25", "followLinks": False}
    assert fresh | {"shape": "concept"} in attributes
    await _ask(client, "what calls the zip archive function")
    assert fresh | {"shape": "relationship"} in [
        dict(p.attributes) for p in metric_points("retrieval.query.duration_ms")
    ]
    assert any(a["cacheHit"] is True for a in attributes)
    assert sum(p.value for p in metric_points("retrieval.candidates.dense")) > 0
    assert sum(p.value for p in metric_points("retrieval.candidates.sparse")) > 0
    # The worker's pipeline span continues the caller's trace: context travelled in the NATS headers.
    worker_spans = [s for s in SPANS.get_finished_spans() if s.name == "query.retrieve"]
    assert any(s.context.trace_id == trace_id for s in worker_spans)
    # and its statements are spans of that trace (OpenTelemetry's asyncpg instrumentation), without parameters
    statements = [
        s for s in SPANS.get_finished_spans() if s.context.trace_id == trace_id and s.attributes.get("db.system")
    ]
    assert statements
    assert all(s.attributes["db.system"] == "postgresql" for s in statements)
    assert not any("db.statement.parameters" in s.attributes for s in statements)


def _count(name: str, **attributes: str) -> float:
    """A counter's total in this process, over the data points carrying ``attributes``."""
    return sum(p.value for p in metric_points(name) if attributes.items() <= dict(p.attributes).items())


def _recorded(name: str) -> int:
    """How many values a histogram has recorded in this process."""
    return sum(p.count for p in metric_points(name))


async def test_each_request_has_a_span_and_its_failures_are_marked_on_the_workers(
    seeded: int, deployment: Deployment, start_query_worker: Start, client: QueryClient
) -> None:
    """An SRE's: `ontofabric query` (no span current) began a trace at the worker; an error reply left the worker's
    span unmarked, and an answer with failed parts left no mark on any span."""
    worker = await start_query_worker(None)  # no embedder: every answer is degraded
    SPANS.clear()
    assert not trace.get_current_span().get_span_context().is_valid
    degraded = _count("retrieval.degraded", sink="embedder")
    answered = await _ask(client, "fibonacci numbers")
    assert "embedder" in answered.meta.degraded
    assert _count("retrieval.degraded", sink="embedder") == degraded + 1  # what the burn alerts read
    missing = await client.document("acme", {"id": "no-such-document"})
    assert isinstance(missing, ErrorReply)
    await asyncio.sleep(0.2)  # the worker's spans end after its replies are sent
    spans = SPANS.get_finished_spans()
    sent = {s.name: s for s in spans if s.kind == trace.SpanKind.CLIENT and s.name.endswith(" request")}
    served = {s.name: s for s in spans if s.kind == trace.SpanKind.SERVER}
    for operation in ("query", "document"):
        parent = served[operation].parent
        assert parent is not None
        assert parent.span_id == sent[f"{operation} request"].context.span_id  # one trace
    retrieve = next(s for s in spans if s.name == "query.retrieve")
    assert "embedder" in (retrieve.attributes or {})["ontofabric.degraded"]
    # not_found is an answer, not a failure of the service: said by its type, not marked an error
    for span in (sent["document request"], served["document"]):
        assert (span.attributes or {})["error.type"] == "not_found"
        assert span.status.status_code != trace.StatusCode.ERROR
    await worker.stop()
    SPANS.clear()
    with pytest.raises(NoRespondersError):  # no worker listens: the request's span says so
        await client.query("acme", {"semanticQuery": "x"})
    (unanswered,) = [s for s in SPANS.get_finished_spans() if s.name == "query request"]
    assert unanswered.status.status_code == trace.StatusCode.ERROR


async def test_every_metric_says_what_it_measures_in_buckets_that_fit_it(
    seeded: int, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    """An SRE's: histograms and counters without a description, a gauge of milliseconds without its unit, and the
    fusion's sub-millisecond times all in the default buckets' first (5 ms)."""
    await start_query_worker(embedder, query_cache_entries=0)
    await _ask(client, "compress a directory into a zip archive")
    data = METRICS.get_metrics_data()
    assert data is not None
    metrics = {
        metric.name: metric
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        if scope.scope.name == "ontofabric"
        for metric in scope.metrics
    }
    assert "retrieval.fusion.duration_ms" in metrics
    assert [name for name, metric in metrics.items() if not metric.description] == []
    assert [name for name, metric in metrics.items() if name.endswith("_ms") and metric.unit != "ms"] == []
    fusion = metrics["retrieval.fusion.duration_ms"].data.data_points[0]
    assert fusion.explicit_bounds[0] < 1  # type: ignore[attr-defined]


async def test_a_subject_that_names_no_valid_workspace_gets_an_error(
    seeded: int, deployment: Deployment, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    await start_query_worker(embedder)
    # Undecodable or invalid names, and other spellings of the seeded "acme" than its canonical token: one name is
    # served on one subject only, so a NATS permission on that subject cannot be walked around.
    for token in ("_uffffff", "_00", "_2e_2e", "_61cme", "acm_65", "_u000061cme", "a_2Fb"):
        reply = await deployment.nc.request(
            f"{deployment.names.prefix}.query.{token}", b'{"semanticQuery": "x"}', timeout=5
        )
        error = ErrorReply.model_validate_json(reply.data)
        assert error.error.code == "invalid_request", token
        # Another spelling of "acme" is told the one accepted (an outside team's client wrote hex in capitals); not
        # a spelling of a name no workspace may have (a/b: a review's was told a spelling refused too).
        said = error.error.details[0].message
        assert ("written" in said) == (token in ("_61cme", "acm_65", "_u000061cme")), (token, said)
        assert "written" not in said or "written 'acme'" in said, (token, said)
    assert (await _ask(client, "sort numbers")).results[0].id == "sort"


async def test_an_answer_larger_than_a_nats_message_arrives_trimmed(
    deployment: Deployment, projector: ProjectorService, start_query_worker: Start, client: QueryClient
) -> None:
    # Eight documents of 200 KB: ten results would be 1.6 MB, past nats-server's 1 MB message limit.
    acks = await deployment.publisher.publish_many(
        [upsert("big", document(f"b{i}", f"bulky {i} " + "padding " * 25_000)) for i in range(8)]
    )
    await deployment.wait_projected(acks[-1].seq)
    await start_query_worker(None)
    # The largest budget a request may ask for is below nats-server's 1 MB message (the message size cuts only on
    # servers with a smaller one: tests/test_budget.py).
    request = {"semanticQuery": "bulky padding", "topK": 10, "maxTokens": 250_000}
    reply = await client.query("big", request)
    assert isinstance(reply, QueryResponse), reply
    assert len(reply.results) == 8  # every result, the best ranks with their content
    assert reply.meta.degraded == ["embedder"]  # a worker without an embedder: keyword only
    assert reply.meta.budget is not None
    assert 0 < reply.meta.budget.contents_omitted < 8
    # The default budget cuts long before the message size would: a bound asked for, not a failure.
    bounded = await client.query("big", {"semanticQuery": "bulky padding", "topK": 10})
    assert isinstance(bounded, QueryResponse), bounded
    assert bounded.meta.degraded == ["embedder"]
    assert bounded.meta.budget is not None
    assert bounded.meta.budget.estimated_tokens <= deployment.settings.answer_max_tokens
    assert bounded.meta.budget.contents_cut == [bounded.results[0].id]
    assert [r.id for r in bounded.results] == [r.id for r in reply.results]


async def test_queries_are_answered_across_a_rebuild_which_drops_answers_read_from_the_old_index(
    seeded: int, deployment: Deployment, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    from ontofabric.services.ops.rebuild import Rebuild

    await start_query_worker(embedder)
    await deployment.fetch("UPDATE documents SET content = 'corrupted' WHERE id = 'fib'")
    stale = await _ask(client, "fibonacci numbers")
    assert (await _ask(client, "fibonacci numbers")).meta.cache_hit is True
    assert stale.results[0].content == "corrupted"

    answers: list[QueryResponse] = []
    kinds: list[dict[str, object]] = [{}, {"options": {"retrievers": ["keyword"]}}, {"objectType": "algo.Sorting"}]

    async def keep_asking() -> None:  # each text new, so each answer is read from the database, never the cache
        while True:
            n = len(answers)
            answers.append(await _ask(client, f"sort a list of numbers {n}", topK=3, **kinds[n % len(kinds)]))

    asking = asyncio.create_task(keep_asking())
    try:
        await Rebuild(
            deployment.settings, deployment.nats_url, deployment.database_url, "acme", RecordedProgress()
        ).run()
        await asyncio.sleep(0.2)
    finally:
        asking.cancel()
    assert len(answers) > len(kinds)
    assert all(a.results[0].id == "sort" and a.meta.degraded == [] and not a.meta.cache_hit for a in answers)

    for _ in range(100):  # the worker learns of the rebuild from the KV watch
        fresh = await _ask(client, "fibonacci numbers")
        if not fresh.meta.cache_hit:
            break
        await asyncio.sleep(0.05)
    assert fresh.meta.cache_hit is False
    assert fresh.meta.ontology_version == stale.meta.ontology_version  # the same deltas, the same version
    assert fresh.results[0].content == CORPUS["fib"][0]


async def _cannot_write(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT current_user") == READER_ROLE
        for statement in (
            "INSERT INTO workspaces (workspace, partition_name) VALUES ('intruder', 'intruder')",
            "DELETE FROM documents",
            "UPDATE ontology_versions SET state_hash = 0",
            "CREATE TABLE planted (x int)",
            "SELECT ensure_workspace_partition('intruder')",
        ):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(statement)


async def test_the_query_worker_reads_as_a_role_that_cannot_write(
    seeded: int, deployment: Deployment, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    service = await start_query_worker(embedder)
    assert (await _ask(client, "sort numbers")).results[0].id == "sort"
    (pool,) = service._pools
    await _cannot_write(pool)


async def test_the_embedded_query_worker_reads_through_a_login_that_cannot_become_the_superuser(
    seeded: int, deployment: Deployment, runtime: EmbeddedRuntime, embedder: Embedder, client: QueryClient
) -> None:
    """A security tester's: the embedded deployment's query worker logged in as the superuser and acted as the
    reader role, which one `SELECT set_config('role', 'none', false)` left: then `COPY ... FROM PROGRAM` ran
    commands on the host. It reads through a login of its own now, which has nothing more to go back to."""
    assert runtime.endpoints is not None
    reader_login = runtime.endpoints.database_logins["query"]
    service = QueryService(
        deployment.settings, deployment.nats_url_as("query"), deployment.database_url, embedder,
        reader_login=reader_login,
    )  # fmt: skip
    await service.start()
    try:
        assert (await _ask(client, "sort numbers")).results[0].id == "sort"
        (pool,) = service._pools
        await _cannot_write(pool)
        insert = "INSERT INTO workspaces (workspace, partition_name) VALUES ('intruder', 'intruder')"
        await cannot_become_the_superuser(pool, reader_login[0], READER_ROLE, insert)
    finally:
        await service.stop()


async def test_a_query_worker_with_a_reader_login_waits_for_migrations_and_cannot_write(
    deployment: Deployment, embedder: Embedder, start_query_worker: Start, client: QueryClient
) -> None:
    # A login that holds ontofabric_reader and nothing else, as docs/security.md sets one up. It cannot migrate:
    # the worker waits for whoever may, here `migrate` as the owner a moment later.
    login = f"{deployment.settings.subject_prefix}_query"
    async with deployment.session() as admin:
        await admin.execute(f'CREATE ROLE "{login}" LOGIN')
    try:
        reader_url = deployment.database_url.replace("postgres@", f"{login}@", 1)
        starting = asyncio.create_task(start_query_worker(embedder, query_database_url=reader_url))
        await asyncio.sleep(1.0)
        assert not starting.done()  # waiting for the schema
        await migrate(deployment.database_url, deployment.settings)  # creates ontofabric_reader if it is new
        async with deployment.session() as admin:
            await admin.execute(f'GRANT ontofabric_reader TO "{login}"')
        service = await asyncio.wait_for(starting, 30)
        try:
            reply = await client.query("acme", {"semanticQuery": "anything"})
            assert isinstance(reply, QueryResponse), reply
            (pool,) = service._pools
            await _cannot_write(pool)
            async with pool.acquire() as conn:
                await conn.execute("RESET ROLE")  # the login itself has no more rights than the role it holds
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await conn.execute("INSERT INTO workspaces (workspace, partition_name) VALUES ('i', 'i')")
                await conn.execute(f"SET ROLE {READER_ROLE}")
        finally:
            await service.stop()
    finally:
        async with deployment.session() as admin:
            await admin.execute(f'DROP ROLE IF EXISTS "{login}"')


async def test_no_secret_reaches_a_reply_a_span_or_a_log(
    seeded: int, deployment: Deployment, embedder: Embedder, client: QueryClient, capfd: pytest.CaptureFixture[str]
) -> None:
    # The worker holds a rerank key (its endpoint refuses the connection, so the call fails and is reported),
    # a database password and NATS passwords; none of them may show in what it answers, its traces or its logs.
    rerank_key = "rk-" + "5ecret" * 4
    secrets = [
        rerank_key,
        urlsplit(deployment.database_url).password or "",
        *(password for _, password in deployment.nats_logins.values()),
        urlsplit(deployment.nats_url).password or "",
    ]
    assert all(secrets)
    settings = deployment.settings.model_copy(
        update={
            "reranker": "cohere",
            "reranker_url": "https://127.0.0.1:9/v2/rerank",
            "reranker_api_key": SecretStr(rerank_key),
        }
    )
    SPANS.clear()
    service = QueryService(
        settings, deployment.nats_url_as("query"), deployment.database_url, embedder, build_reranker(settings)
    )
    await service.start()
    try:
        reply = await _ask(client, "how do I sort a list of numbers in descending order")  # long: not skipped
        assert "reranker" in reply.meta.degraded  # the key was used, and the call failed
        error = parse_reply(await client.send_raw("acme", b'{"semanticQuery": 7, "unknown": true}'))
        assert isinstance(error, ErrorReply)
        missing = await client.document("acme", {"id": "no-such-document"})
        await asyncio.sleep(0.2)  # the last spans end after the replies are sent
    finally:
        await service.stop()
    outputs = [
        reply.model_dump_json(by_alias=True),
        error.model_dump_json(by_alias=True),
        json.dumps(missing.model_dump(by_alias=True), default=str),
        *(span.to_json() for span in SPANS.get_finished_spans()),
        *capfd.readouterr(),
    ]
    assert len(SPANS.get_finished_spans()) > 3
    assert [secret for secret in secrets if any(secret in output for output in outputs)] == []


async def _forward(port: int, target: tuple[str, int]) -> asyncio.Server:
    """A TCP listener on ``port`` that passes each connection on to ``target``: the database, once it serves."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(*target)
        await asyncio.gather(pump(reader, upstream_writer), pump(upstream_reader, writer))

    return await asyncio.start_server(serve, "127.0.0.1", port)


async def test_workers_started_while_their_database_cannot_serve_wait_for_it(
    deployment: Deployment, embedder: Embedder, client: QueryClient
) -> None:
    """A fault tester's: a query worker and a projector started while PostgreSQL refused connections (every slot
    taken) ended with a traceback. Here nothing listens at the database's address until a few seconds on."""
    real = urlsplit(deployment.database_url)
    assert real.hostname is not None
    assert real.port is not None
    port = free_port()
    login = real.netloc.rsplit("@", 1)[0] + "@" if "@" in real.netloc else ""
    later = real._replace(netloc=f"{login}127.0.0.1:{port}").geturl()
    projector = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), later)
    worker = QueryService(deployment.settings, deployment.nats_url_as("query"), later, embedder)
    starting = [asyncio.ensure_future(projector.start()), asyncio.ensure_future(worker.start())]
    server = None
    try:
        await asyncio.sleep(3)
        assert [task.done() for task in starting] == [False, False]  # waiting, not ended
        server = await _forward(port, (real.hostname, real.port))
        await asyncio.wait_for(asyncio.gather(*starting), 60)
        (ack,) = await deployment.publisher.publish_many(
            [upsert("acme", document("late", "a database that came late"))]
        )
        await deployment.wait_projected(ack.seq)
        reply = await _ask(client, "a database that came late", topK=1)
        assert reply.results[0].id == "late"
    finally:
        for task in starting:
            task.cancel()
        await asyncio.gather(*starting, return_exceptions=True)
        await worker.stop()
        await projector.stop()
        if server is not None:
            server.close()


async def test_a_starting_worker_waits_while_every_slot_is_taken_and_not_for_a_wrong_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the fault tester met ("too many clients") is waited out; a refusal that stays (a wrong password) is
    said at once."""
    monkeypatch.setattr(db, "DATABASE_RETRY_FIRST_S", 0.01)
    failures: list[Exception] = [asyncpg.exceptions.TooManyConnectionsError("sorry, too many clients already")] * 3

    async def attempt() -> str:
        if failures:
            raise failures.pop()
        return "pool"

    assert await db.once_the_database_serves("postgresql://u:secret@h/d", attempt) == "pool"
    failures.append(asyncpg.exceptions.InvalidPasswordError("password authentication failed"))
    with pytest.raises(asyncpg.exceptions.InvalidPasswordError):
        await db.once_the_database_serves("postgresql://u:secret@h/d", attempt)
    # Nor for settings that cannot work, which asyncpg raises as errors a database away would raise too (a review's:
    # they kept a worker waiting for ever).
    for unusable in ("postgres-sql://u@127.0.0.1:1/d", "postgresql://u@127.0.0.1:1/d?sslmode=verify_full",
                     "postgresql://u@127.0.0.1:1/d?sslmode=verify-full&sslrootcert=/no/such/root.crt"):  # fmt: skip
        with pytest.raises((asyncpg.ClientConfigurationError, OSError)) as raised:
            await asyncio.wait_for(db.once_the_database_serves(unusable, partial(asyncpg.connect, unusable)), 10)
        assert not isinstance(raised.value, TimeoutError), unusable  # raised, not waited on until cut


def test_a_long_key_over_a_long_list_costs_naming_a_field_little() -> None:
    """An audit's: the place of every value was made as text to find the one to name, copying a long key into
    each of its many items: a request within the 64 KiB limit took 0.23 s and 490 MB, a gateway's larger body
    gigabytes. Half a character, a byte that is no UTF-8, and a key given twice are named at about what the
    body weighs."""
    items = b"[" + b",".join([b"0"] * 15_000) + b"]"
    key = b"k" * 30_000
    half = b'{"semanticQuery": "\\ud800", "' + key + b'": ' + items + b"}"
    stray = b'{"semanticQuery": "\xff", "' + key + b'": ' + items + b"}"
    twice = b'{"a": 1, "a": 2, "' + key + b'": ' + items + b"}"
    tracemalloc.start()
    named = (surrogate_field(half), not_utf8(stray), repeated_key(twice))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert (named[0], named[1] and named[1][1], named[2]) == ("semanticQuery", "semanticQuery", "a")
    assert peak < 20_000_000, peak


def test_a_query_too_long_says_what_of_a_traceback_to_send() -> None:
    """An agent tester pasted a traceback of 5,000 characters and was told only the limit."""
    body = json.dumps({"semanticQuery": 'Traceback (most recent call last):\n  File "x.py", line 1\n' * 40}).encode()
    reply = parse_request(body, "acme", 1000)
    assert isinstance(reply, bytes)
    detail = ErrorReply.model_validate_json(reply).error.details[0]
    assert detail.field == "semanticQuery"
    assert "at most 1000 characters" in detail.message
    assert "last frames" in detail.message


@pytest.mark.parametrize(
    ("reply", "taken"),
    [
        ("_INBOX.ontofabric~client.abc.1", True),
        ("_INBOX.x", True),
        ("_INBOX.ontofabric~client.>", False),  # a fault harness's: wildcards name no one caller's inbox
        ("_INBOX.ontofabric~client.*.1", False),
        ("_INBOX..x", False),
        ("_INBOX.a b", False),
        ("$KV.manifests.x", False),
        ("ontofabric.delta.acme.main", False),
    ],
)
def test_a_worker_answers_on_a_callers_inbox_only(reply: str, taken: bool) -> None:
    assert answerable(reply) is taken
