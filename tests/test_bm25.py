"""BM25 inside PostgreSQL: the SQL scores equal BM25 computed by hand over the same lexemes, and the postings
and corpus statistics the projector keeps stay equal to a recomputation through upserts and deletes."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import numpy as np
import pytest

from ontofabric.services.ingest.chunking import bounded_symbol
from ontofabric.services.projector.planning import NAME_REPEATS, Delta, own_name_repeats, search_text
from ontofabric.services.projector.store import PostgresProjectionStore
from ontofabric.services.query import postgres as postgres_module
from ontofabric.services.query.core import Scope, SearchInput
from ontofabric.services.query.postgres import (
    HiddenStatistics,
    PostgresDense,
    PostgresDocuments,
    PostgresKeyword,
    PostgresSnapshots,
)
from ontofabric.shared.analysis import analyse
from ontofabric.shared.db import create_pool, migrate

from .conftest import Deployment
from .factories import delete, document, unit_vector, upsert

K1, B, K3 = 1.2, 0.85, 2.0

TEXTS = {
    "a": "def readFile(path): open the file at path and return its text",
    "b": "Parse a JSON string into a Python dictionary with json.loads",
    "c": "Write the dictionary to a JSON file; the file is created when missing",
    "d": "Sort a list of numbers; numbers sorted in place with list.sort",
    "e": "low-density lipoprotein levels and the risk of heart disease",
}


@pytest.fixture
async def pool(deployment: Deployment) -> AsyncIterator[asyncpg.Pool]:
    await migrate(deployment.database_url, deployment.settings)
    pool = await create_pool(deployment.database_url, deployment.settings)
    yield pool
    await pool.close()


async def _lexemes(conn: asyncpg.Connection, text: str) -> dict[str, int]:
    rows = await conn.fetch(
        "SELECT lexeme, coalesce(cardinality(positions), 1) AS tf FROM unnest(index_tsvector('english', $1))", text
    )
    return {r["lexeme"]: r["tf"] for r in rows}


async def _expected_scores(
    conn: asyncpg.Connection, indexed: dict[str, str], query: str, name_repeats: dict[str, str] | None = None
) -> dict[str, float]:
    """BM25 by hand; ``indexed`` is the text the projector indexed for each document (already analysed), and
    ``name_repeats`` a document's own-name repeats, which count in its term frequencies and not in its length."""
    docs: dict[str, dict[str, int]] = {}
    lengths: dict[str, int] = {}
    for doc_id, text in indexed.items():
        tfs = await _lexemes(conn, text)
        lengths[doc_id] = sum(tfs.values())
        for term, tf in (await _lexemes(conn, (name_repeats or {}).get(doc_id, ""))).items():
            tfs[term] = tfs.get(term, 0) + tf
        docs[doc_id] = tfs
    terms = await _lexemes(conn, analyse(query, catenate=False))
    n = len(docs)
    avgdl = sum(lengths.values()) / n
    scores: dict[str, float] = {}
    for term, repeats in terms.items():
        df = sum(1 for d in docs.values() if term in d)
        if df == 0:
            continue
        idf = (K3 + 1) * repeats / (K3 + repeats) * math.log(1 + (n - df + 0.5) / (df + 0.5))
        for doc_id, tfs in docs.items():
            tf = tfs.get(term, 0)
            if tf:
                length = lengths[doc_id]
                scores[doc_id] = scores.get(doc_id, 0.0) + idf * tf * (K1 + 1) / (
                    tf + K1 * (1 - B + B * length / avgdl)
                )
    return scores


async def test_sql_bm25_equals_bm25_by_hand(deployment: Deployment, pool: asyncpg.Pool) -> None:
    store = PostgresProjectionStore(pool, "english")
    await store.apply([Delta(i + 1, upsert("acme", document(k, v))) for i, (k, v) in enumerate(TEXTS.items())])
    keyword = PostgresKeyword(PostgresSnapshots(pool), "english", K1, B, K3)
    queries = ("read a file", "json dictionary file", "sorted numbers list", "lipoprotein density", "nothing")
    # A repeated query term weighs more than once and less than twice (k3 2: 1.5 for two, 1.8 for three).
    queries += ("file file file json", "json json json file")
    async with pool.acquire() as conn:  # the repeats the SQL reads, and a snake_case word's parts counted twice
        assert await _lexemes(conn, analyse("file file file json", catenate=False)) == {"file": 3, "json": 1}
        assert await _lexemes(conn, analyse("read_file", catenate=False)) == {"read": 2, "file": 2}
        # A word beside punctuation past ASCII is the word (the parser reads such punctuation as a letter).
        typography = analyse("the scheduler’s “exponential” backoff—see 🚀launch", catenate=True)
        words = await _lexemes(conn, "scheduler exponential backoff launch")
        assert set(words) <= set(await _lexemes(conn, typography))
    for query in queries:
        hits = await keyword.search(Scope("acme", "main"), SearchInput(query), 10)
        if hits.candidates:
            assert hits.ceiling is not None
            assert hits.candidates[0].score <= hits.ceiling  # saturation (score over ceiling) stays at most 1
        async with pool.acquire() as conn:
            expected = await _expected_scores(conn, {k: search_text(document(k, v)) for k, v in TEXTS.items()}, query)
        assert {c.id: pytest.approx(c.score, rel=1e-9) for c in hits.candidates} == expected, query
        assert [c.id for c in hits.candidates] == sorted(expected, key=lambda d: (-expected[d], d))


async def test_a_code_symbols_own_name_weighs_without_lengthening_it(
    deployment: Deployment, pool: asyncpg.Pool
) -> None:
    """A code symbol's own name is read ``NAME_REPEATS`` times more than its other words, after BM25F's weighted
    title field: the function named for what a query asks comes before code that only uses its words. The repeats
    add to the name's term frequencies and not to the document's length, so the symbol's other words score as they
    would without them."""
    texts = {
        "named": (
            "pkg.backoff.wait_exponential",
            "function",
            "The delay before the next attempt: doubled each time, up to the most the caller allows.",
        ),
        "user": (
            "pkg.retry.run",
            "function",
            "def run(call):\n    # wait, then wait longer: an exponential wait between exponential retries\n"
            "    for attempt in range(5):\n        pause(exponential(attempt))  # wait\n        call()",
        ),
        "module": ("pkg.units", "module", "Convert centimetres into metres and back."),
        "converter": ("pkg.units.to_metres", "function", "def to_metres(cm): convert centimetres: divide by 100"),
        # A name the content already holds nearly as often as a lexeme's positions may be (256): the repeats
        # still lengthen nothing.
        "crowded": ("pkg.polling.poll", "function", "def poll():\n" + "    poll()\n" * 250),
    }
    documents = {k: document(k, content, symbolFqn=fqn, symbolKind=kind) for k, (fqn, kind, content) in texts.items()}
    store = PostgresProjectionStore(pool, "english")
    await store.apply([Delta(i + 1, upsert("acme", doc)) for i, doc in enumerate(documents.values())])
    keyword = PostgresKeyword(PostgresSnapshots(pool), "english", K1, B, K3)
    hits = await keyword.search(Scope("acme", "main"), SearchInput("exponential wait"), 10)
    assert [c.id for c in hits.candidates] == ["named", "user"]

    async with pool.acquire() as conn:  # a snake_case name's parts are read twice each time, as anywhere
        repeats = {"wait": 2 * NAME_REPEATS, "exponenti": 2 * NAME_REPEATS}  # stemmed
        assert await _lexemes(conn, own_name_repeats(documents["named"])) == repeats
        indexed = {k: search_text(doc) for k, doc in documents.items()}
        repeated = {k: own_name_repeats(doc) for k, doc in documents.items()}
        unweighted = {k: sum((await _lexemes(conn, text)).values()) for k, text in indexed.items()}
        stored = dict(await conn.fetch("SELECT id, doc_length FROM documents WHERE workspace = 'acme'"))
        assert stored == unweighted  # the repeats lengthen no document
        for query in ("exponential wait", "convert centimetres into metres", "the next attempt"):
            expected = await _expected_scores(conn, indexed, query, repeated)
            hits = await keyword.search(Scope("acme", "main"), SearchInput(query), 10)
            assert {c.id: pytest.approx(c.score, rel=1e-9) for c in hits.candidates} == expected, query

    others = [
        ("README.md > Exponential wait", "section"),
        ("docs/wait.md", "page"),
        ("a.wait_exponential", None),
        ("Acme.Client.Send(System.Net.Http.HttpRequestMessage)", "method"),  # not an identifier
        (bounded_symbol("pkg.mod." + "wait_" * 120), "function"),  # cut short to a digest
    ]
    for fqn, kind in others:
        other = document("s", "How long to wait.", symbolFqn=fqn, **({"symbolKind": kind} if kind else {}))
        assert own_name_repeats(other) == "", kind
        assert search_text(other) == analyse(f"{fqn}\nHow long to wait.", catenate=True), kind


async def test_spellings_of_one_word_and_words_within_chinese_find_each_other(
    deployment: Deployment, pool: asyncpg.Pool
) -> None:
    """A Unicode tester's: in the embedded server's C locale none of these found the document spelled the other
    way (the parser lowercases ASCII only, compares code points, and takes a Chinese sentence for one word)."""
    texts = {
        "accents": "Ein Café in Zürich: das Résumé",
        "decomposed": "Re\u0301sume\u0301 of the cafe\u0301 menu",  # as macOS writes names
        "wide": "the ＡＰＩ of the İstanbul office",
        "marked": "\u200fretry\u200e after a zero\u200bwidth space",
        "chinese": "数据库连接池管理模块。负责创建和回收连接。",
        "japanese": "インストールガイド",
        "other": "plain text about nothing here",
    }
    store = PostgresProjectionStore(pool, "english")
    await store.apply([Delta(i + 1, upsert("acme", document(k, v))) for i, (k, v) in enumerate(texts.items())])
    keyword = PostgresKeyword(PostgresSnapshots(pool), "english", K1, B, K3)

    async def found(query: str) -> set[str]:
        return {hit.id for hit in (await keyword.search(Scope("acme", "main"), SearchInput(query), 10)).candidates}

    assert await found("CAFÉ") == {"accents", "decomposed"}
    assert await found("zurich ZÜRICH") == {"accents"}  # accents are kept: zurich is another word
    assert await found("résumé") == {"accents", "decomposed"}
    assert await found("API istanbul") == {"wide"}
    assert await found("retry width") == {"marked"}
    assert await found("连接池") == {"chinese"}
    assert await found("インストール") == {"japanese"}


async def test_bm25_on_a_branch_equals_bm25_over_the_tree_the_branch_shows(
    deployment: Deployment, pool: asyncpg.Pool
) -> None:
    """A branch's statistics (N, the average length, document frequencies) leave out main's documents the branch
    hides: its scores are those of a workspace holding what the branch shows."""
    store = PostgresProjectionStore(pool, "english")
    await store.apply([Delta(i + 1, upsert("acme", document(k, v))) for i, (k, v) in enumerate(TEXTS.items())])
    changed = {"a": "read the JSON file, then read it again", "f": "a new file of numbers"}
    branch = [upsert("acme", document(k, v), branch="feat") for k, v in changed.items()]
    await store.apply([Delta(10 + i, d) for i, d in enumerate([*branch, delete("acme", "c", branch="feat")])])
    shown = {k: v for k, v in {**TEXTS, **changed}.items() if k != "c"}
    keyword = PostgresKeyword(PostgresSnapshots(pool), "english", K1, B, K3)

    async def scored_as_shown() -> None:
        for query in ("read a file", "json dictionary file", "sorted numbers list", "file file file json"):
            hits = await keyword.search(Scope("acme", "feat"), SearchInput(query), 10)
            async with pool.acquire() as conn:
                indexed = {k: search_text(document(k, v)) for k, v in shown.items()}
                expected = await _expected_scores(conn, indexed, query)
            assert {c.id: pytest.approx(c.score, rel=1e-9) for c in hits.candidates} == expected, query

    await scored_as_shown()
    # Main moves on, under a document the branch hides and beside it: the statistics follow its new version.
    later = {"a": "main's later file of json numbers", "d": "numbers sorted, a list of them"}
    await store.apply([Delta(20 + i, upsert("acme", document(k, v))) for i, (k, v) in enumerate(later.items())])
    shown["d"] = later["d"]
    await scored_as_shown()


async def test_a_branch_versions_first_searches_together_read_its_hidden_rows_once(
    deployment: Deployment, pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new version's first answers arrive together; each read main's hidden documents' ids and their terms (a
    review's: the cost grows with the branch). The first reads them, the others wait for it."""
    store = PostgresProjectionStore(pool, "english")
    await store.apply([Delta(i + 1, upsert("acme", document(k, v))) for i, (k, v) in enumerate(TEXTS.items())])
    await store.apply([Delta(10, upsert("acme", document("a", "read the JSON file again"), branch="feat"))])
    keyword = PostgresKeyword(PostgresSnapshots(pool), "english", K1, B, K3)
    reads: list[str] = []
    read_hidden, read_shadowed = HiddenStatistics.read.__func__, postgres_module._shadowed_ids  # type: ignore[attr-defined]

    async def counted_hidden(cls: type[HiddenStatistics], *args: Any) -> HiddenStatistics:
        reads.append("statistics")
        return await read_hidden(cls, *args)  # type: ignore[no-any-return]

    async def counted_shadowed(*args: Any) -> list[str]:
        reads.append("ids")
        return await read_shadowed(*args)

    monkeypatch.setattr(HiddenStatistics, "read", classmethod(counted_hidden))
    monkeypatch.setattr(postgres_module, "_shadowed_ids", counted_shadowed)
    searches = [keyword.search(Scope("acme", "feat"), SearchInput("read a json file"), 10) for _ in range(8)]
    answers = await asyncio.gather(*searches)
    assert sorted(reads) == ["ids", "statistics"]
    assert len({tuple((c.id, c.score) for c in a.candidates) for a in answers}) == 1


async def test_postings_and_statistics_follow_upserts_and_deletes(deployment: Deployment, pool: asyncpg.Pool) -> None:
    store = PostgresProjectionStore(pool, "english")
    seq = 0

    async def apply(*deltas: object) -> None:
        nonlocal seq
        batch = []
        for delta in deltas:
            seq += 1
            batch.append(Delta(seq, delta))  # type: ignore[arg-type]
        await store.apply(batch)

    await apply(*(upsert("acme", document(k, v)) for k, v in TEXTS.items()))
    await apply(upsert("acme", document("a", "an entirely different text about tokens")), delete("acme", "b"))
    await apply(upsert("acme", document("b", "json again")), delete("acme", "c"), delete("acme", "zzz"))
    await apply(upsert("acme", document("a", "final words")), upsert("acme", document("a", "final final words")))

    async with pool.acquire() as conn:
        kept = await conn.fetch(
            "SELECT term, doc_id, tf, doc_length FROM postings WHERE workspace = 'acme' ORDER BY term, doc_id"
        )
        rebuilt = await conn.fetch(
            "SELECT u.lexeme AS term, d.id AS doc_id, coalesce(cardinality(u.positions), 1) AS tf, d.doc_length"
            " FROM documents d CROSS JOIN LATERAL unnest(d.search_vector) u"
            " WHERE d.workspace = 'acme' AND NOT d.deleted ORDER BY term, doc_id"
        )
        assert [tuple(r) for r in kept] == [tuple(r) for r in rebuilt]
        stats = await conn.fetchrow(
            "SELECT doc_count, total_length FROM ontology_versions WHERE workspace = 'acme' AND branch = 'main'"
        )
        live = await conn.fetchrow(
            "SELECT count(*) AS n, coalesce(sum(doc_length), 0) AS total FROM documents"
            " WHERE workspace = 'acme' AND NOT deleted"
        )
        assert (stats["doc_count"], stats["total_length"]) == (live["n"], live["total"]) == (4, live["total"])
        frequencies = await conn.fetch("SELECT term, df FROM term_statistics WHERE workspace = 'acme' ORDER BY term")
        counted = await conn.fetch(
            "SELECT term, count(*) AS df FROM postings WHERE workspace = 'acme' GROUP BY term ORDER BY term"
        )
        assert [tuple(r) for r in frequencies] == [tuple(r) for r in counted]
        assert await conn.fetchval("SELECT df FROM term_statistics WHERE workspace = 'acme' AND term = 'json'") == 1


async def test_common_terms_are_looked_up_only_for_the_leading_documents(
    deployment: Deployment, pool: asyncpg.Pool
) -> None:
    rare = {"r1": "zebra apple", "r2": "zebra", "r3": "zebra apple apple pear"}
    common = {f"c{i}": f"apple banana number{i}" for i in range(10)}
    texts = {**rare, **common}
    store = PostgresProjectionStore(pool, "english")
    await store.apply([Delta(i + 1, upsert("acme", document(k, v))) for i, (k, v) in enumerate(texts.items())])
    async with pool.acquire() as conn:
        indexed = {k: search_text(document(k, v)) for k, v in texts.items()}
        expected = await _expected_scores(conn, indexed, "zebra apple")
    scope, query = Scope("acme", "main"), SearchInput("zebra apple")

    exact = await PostgresKeyword(PostgresSnapshots(pool), "english", K1, B, K3).search(scope, query, 20)
    assert {c.id: pytest.approx(c.score, rel=1e-9) for c in exact.candidates} == expected
    assert not exact.pruned

    # Only "zebra" (3 postings) fits in a budget of 5; "apple" (12) is looked up for the documents zebra found.
    bounded = PostgresKeyword(PostgresSnapshots(pool), "english", K1, B, K3, full_read_postings=5)
    hits = await bounded.search(scope, query, 20)
    assert hits.pruned
    assert {c.id: pytest.approx(c.score, rel=1e-9) for c in hits.candidates} == {k: expected[k] for k in rare}
    assert (hits.ceiling, hits.query_ceiling) == (pytest.approx(exact.ceiling), pytest.approx(exact.query_ceiling))

    # Every document holds a query term here: no coverage is stated (see the next test).
    assert exact.coverage is None

    # With one leading document, apple is looked up for the best by zebra alone (the shortest) and no other.
    narrow = PostgresKeyword(PostgresSnapshots(pool), "english", K1, B, K3, full_read_postings=5, completion_depth=1)
    assert [c.id for c in (await narrow.search(scope, query, 1)).candidates] == ["r2"]


async def test_coverage_is_stated_for_a_list_of_rare_terms_only(deployment: Deployment, pool: asyncpg.Pool) -> None:
    """A hit's share of the query's term weight, whatever its counts and length: stated only when the list holds
    every document having a query term (not pruned, not filtered, shorter than asked) and they are few against the
    workspace's (at most a tenth)."""
    rare = {"r1": "zebra apple", "r2": "zebra", "r3": "zebra apple apple pear"}
    texts = {**rare, **{f"c{i}": f"banana number{i}" for i in range(37)}}
    store = PostgresProjectionStore(pool, "english")
    await store.apply([Delta(i + 1, upsert("acme", document(k, v))) for i, (k, v) in enumerate(texts.items())])
    keyword = PostgresKeyword(PostgresSnapshots(pool), "english", K1, B, K3)
    scope = Scope("acme", "main")

    def idf(df: int, n: int = len(texts)) -> float:
        return math.log(1 + (n - df + 0.5) / (df + 0.5))

    zebra, apple, missing = idf(3), idf(2), idf(0)
    hits = await keyword.search(scope, SearchInput("zebra apple"), 10)
    assert hits.coverage == {
        "r1": pytest.approx(1.0),
        "r2": pytest.approx(zebra / (zebra + apple)),
        "r3": pytest.approx(1.0),
    }
    # A query term no document holds counts against every hit; a repeated one weighs as its repeats do.
    absent = await keyword.search(scope, SearchInput("zebra zebra qqqmissing"), 10)
    assert absent.coverage == {r: pytest.approx(1.5 * zebra / (1.5 * zebra + missing)) for r in rare}
    # Not stated: a list as long as asked, a filtered one, a pruned one (zebra's postings left for the leaders).
    assert (await keyword.search(scope, SearchInput("zebra apple"), 3)).coverage is None
    assert (
        await keyword.search(Scope("acme", "main", chunk_level="method"), SearchInput("zebra"), 10)
    ).coverage is None
    bounded = PostgresKeyword(PostgresSnapshots(pool), "english", K1, B, K3, full_read_postings=1)
    pruned = await bounded.search(scope, SearchInput("zebra apple"), 10)
    assert pruned.pruned
    assert pruned.coverage is None
    # Nor for holders that are more than a tenth of the workspace: five of forty is no rare word.
    assert (await keyword.search(scope, SearchInput("zebra apple pear number1 number2"), 10)).coverage is None
    # On a branch, of the documents as the branch has them: r2 holds both terms there, r3 is deleted there.
    branch = [upsert("acme", document("r2", "zebra apple"), branch="feature"), delete("acme", "r3", branch="feature")]
    await store.apply([Delta(len(texts) + i + 1, d) for i, d in enumerate(branch)])
    on_branch = await keyword.search(Scope("acme", "feature"), SearchInput("zebra apple"), 10)
    assert on_branch.coverage == {"r1": pytest.approx(1.0), "r2": pytest.approx(1.0)}
    assert {c.id for c in on_branch.candidates} == {"r1", "r2"}
    assert (await keyword.search(scope, SearchInput("zebra apple"), 10)).coverage == hits.coverage  # main as it was


async def test_keyword_filters_apply_before_the_top_k(deployment: Deployment, pool: asyncpg.Pool) -> None:
    store = PostgresProjectionStore(pool, "english")
    deltas = [upsert("acme", document(f"m{i}", f"json parser number {i}", chunk_level="method")) for i in range(30)]
    deltas.append(upsert("acme", document("t", "a json type", chunk_level="type")))
    await store.apply([Delta(i + 1, d) for i, d in enumerate(deltas)])
    keyword = PostgresKeyword(PostgresSnapshots(pool), "english", K1, B, K3)
    hits = await keyword.search(Scope("acme", "main", chunk_level="type"), SearchInput("json"), 5)
    assert [c.id for c in hits.candidates] == ["t"]
    assert hits.ceiling is not None
    assert hits.ceiling > 0


async def test_dense_scores_are_the_cosines_dense_search_reports(deployment: Deployment, pool: asyncpg.Pool) -> None:
    store = PostgresProjectionStore(pool, "english")
    deltas = [upsert("acme", document(f"d{i}", f"text {i}", embedding=unit_vector(f"d{i}"))) for i in range(6)]
    deltas += [
        upsert("acme", document("typed", "a type", chunk_level="type", embedding=unit_vector("typed"))),
        upsert("acme", document("bare", "no embedding")),
        upsert("acme", document("d1", "text 1 on a branch", embedding=unit_vector("d1 branch")), branch="feature"),
        delete("acme", "d2"),
    ]
    await store.apply([Delta(i + 1, d) for i, d in enumerate(deltas)])
    snapshots = PostgresSnapshots(pool)
    dense_retriever, documents = PostgresDense(snapshots, 100), PostgresDocuments(snapshots)
    vector = np.asarray(unit_vector("query"), dtype=np.float32)
    query = SearchInput("q", vector)
    ids = ["d0", "d1", "d2", "d3", "typed", "bare", "unknown"]
    for scope in (Scope("acme", "main", chunk_level="method"), Scope("acme", "feature", chunk_level="method")):
        dense = await dense_retriever.search(scope, query, 100)
        scored = await documents.similarities(scope, query, ids)
        expected = {c.id: c.score for c in dense.candidates if c.id in ids}
        # Deleted, filtered out, without an embedding or unknown: none of them; d1 as the scope sees it.
        assert set(expected) == {"d0", "d1", "d3"}
        assert sorted(c.id for c in scored.candidates) == ["d0", "d1", "d3"]  # once each, branch rows or main's
        assert {c.id: pytest.approx(c.score, abs=1e-6) for c in scored.candidates} == expected
        assert scored.version == dense.version
    main_d1 = (await documents.similarities(Scope("acme", "main"), query, ["d1"])).candidates[0].score
    branch_d1 = (await documents.similarities(Scope("acme", "feature"), query, ["d1"])).candidates[0].score
    assert main_d1 == pytest.approx(float(np.dot(vector, unit_vector("d1"))), abs=1e-6)
    assert branch_d1 == pytest.approx(float(np.dot(vector, unit_vector("d1 branch"))), abs=1e-6)


async def test_a_compound_identifier_no_document_holds_is_not_missing_while_its_parts_are_held(
    deployment: Deployment, pool: asyncpg.Pool
) -> None:
    """A quality tester's: `jsonPrettyDump` scored a third of `json_pretty_dump` for the same answer. PostgreSQL
    keeps the camel-cased word whole (and its parts follow it), the snake-cased one only as its parts; the whole
    word, in no document, counted as a query term every match missed. A word no document holds that stands for
    nothing else still counts."""
    texts = {"p": "def json_pretty_dump(obj): write obj as indented JSON", "q": "dump the table to a csv file"}
    store = PostgresProjectionStore(pool, "english")
    await store.apply([Delta(i + 1, upsert("acme", document(k, v))) for i, (k, v) in enumerate(texts.items())])
    keyword = PostgresKeyword(PostgresSnapshots(pool), "english", K1, B, K3)
    scope = Scope("acme", "main")
    snake = await keyword.search(scope, SearchInput("json_pretty_dump"), 10)
    camel = await keyword.search(scope, SearchInput("jsonPrettyDump"), 10)
    assert [c.id for c in camel.candidates] == [c.id for c in snake.candidates] == ["p", "q"]
    assert camel.query_ceiling == pytest.approx(camel.ceiling)  # nothing missing: its parts are all held
    saturation = {
        name: hits.candidates[0].score / (hits.query_ceiling or 0)
        for name, hits in [("snake", snake), ("camel", camel)]
    }
    assert saturation["camel"] > 0.8 * saturation["snake"], saturation  # it was a third
    # Beside a word no document holds, standing for nothing, the ceiling still counts it; and a part no document
    # holds, whole or beside a part held (a review's: any held part excused the others, a word alone too).
    for query in ("jsonPrettyDump zyzzyva", "jsonQuuxFrobnicate", "json_quux_frobnicate", "zyzzyva jsonZyzzyva"):
        unheld = await keyword.search(scope, SearchInput(query), 10)
        assert (unheld.query_ceiling or 0) > (unheld.ceiling or 0), query
