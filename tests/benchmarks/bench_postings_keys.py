"""Postings storage by the keys a row carries (issue #23): what bench_scale's short ids hide, and integer keys.

The BM25 postings are one row per (term, document) with the workspace, the branch, the term and the document's id
as text (infra/migrations/0002, 0005). bench_scale names its documents ``s12345``; the reference ingester names
them by 32 hexadecimal characters (``Chunk.document_id``), and every posting repeats the id, in the row and in the
primary key's index. Here the same postings, the lexemes the projector's own analysis (``index_tsvector`` with the
deployment's text search configuration) makes of the sets' documents, are written three ways into tables of the
postings' shape and key, in the documents' order as a projector appends them:

- ids as bench_scale writes them (``s`` and a number);
- ids as the ingester writes them (32 hexadecimal characters: an md5, the length and alphabet of its sha256 cut);
- integer keys: the workspace, branch, term and document each as an integer (the term through a dictionary).

Printed: bytes per document of each table and its primary key, the time each INSERT took per document, and both
as ratios to the first. Compare the ratios within one run.

Run: .venv/bin/python -m tests.benchmarks.bench_postings_keys ../shared/eval/cosqa-dev ../shared/eval/scifact-train
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import asyncpg
from rich.console import Console
from rich.table import Table

from ontofabric.services.ops.beir import document_text, load_beir
from ontofabric.shared.db import migrate
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import EmbeddedRuntime
from ontofabric.shared.settings import Settings

VARIANTS = {
    "ids as bench_scale writes them": (
        "workspace text NOT NULL, branch text NOT NULL, term text NOT NULL, doc_id text NOT NULL",
        "SELECT 'scale', 'main', u.lexeme, 's' || d.n",
    ),
    "ids as the ingester writes them": (
        "workspace text NOT NULL, branch text NOT NULL, term text NOT NULL, doc_id text NOT NULL",
        "SELECT 'scale', 'main', u.lexeme, md5('s' || d.n)",
    ),
    "integer keys": (
        "workspace integer NOT NULL, branch integer NOT NULL, term integer NOT NULL, doc_id integer NOT NULL",
        "SELECT 1, 1, (SELECT t.id FROM bench_terms t WHERE t.lexeme = u.lexeme), d.n",
    ),
}


async def run(database_url: str, texts: list[str], settings: Settings) -> None:
    await migrate(database_url, settings)  # index_tsvector, as the projector analyses a document
    config = settings.text_search_config
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("DROP TABLE IF EXISTS bench_docs, bench_terms")
        await conn.execute("CREATE TABLE bench_docs (n integer PRIMARY KEY, body text NOT NULL)")
        await conn.copy_records_to_table("bench_docs", records=list(enumerate(texts)))
        await conn.execute(
            "CREATE TABLE bench_terms AS SELECT row_number() OVER (ORDER BY lexeme)::integer AS id, lexeme"
            " FROM (SELECT DISTINCT u.lexeme FROM bench_docs d, unnest(index_tsvector($1::regconfig, d.body)) u) s",
            config,
        )
        await conn.execute("CREATE UNIQUE INDEX ON bench_terms (lexeme) INCLUDE (id)")
        rows: list[tuple[str, float, float, int]] = []
        for number, (name, (columns, select)) in enumerate(VARIANTS.items()):
            table = f"bench_postings_{number}"
            await conn.execute(f"DROP TABLE IF EXISTS {table}")
            await conn.execute(
                f"CREATE TABLE {table} ({columns}, tf integer NOT NULL, doc_length integer NOT NULL,"
                " PRIMARY KEY (workspace, branch, term, doc_id) INCLUDE (tf, doc_length))"
            )
            started = time.perf_counter()
            await conn.execute(
                f"INSERT INTO {table} {select}, coalesce(cardinality(u.positions), 1), 100"
                " FROM bench_docs d, unnest(index_tsvector($1::regconfig, d.body)) u ORDER BY d.n",
                config,
            )
            took = time.perf_counter() - started
            await conn.execute(f"VACUUM ANALYZE {table}")
            heap = await conn.fetchval("SELECT pg_relation_size($1::regclass)", table)
            index = await conn.fetchval("SELECT pg_indexes_size($1::regclass)", table)
            count = await conn.fetchval(f"SELECT count(*) FROM {table}")
            rows.append((name, heap / len(texts), index / len(texts), count))
            print(f"{name}: {count:,} postings written in {took:.1f} s ({took / len(texts) * 1000:.3f} ms a document)")
    finally:
        await conn.close()
    first = rows[0][1] + rows[0][2]
    report = Table(title=f"postings of {len(texts):,} documents ({rows[0][3]:,} rows)")
    for column in ("keys", "table B/doc", "primary key B/doc", "total B/doc", "ratio"):
        report.add_column(column)
    for name, heap_per_doc, index_per_doc, _ in rows:
        total = heap_per_doc + index_per_doc
        report.add_row(name, f"{heap_per_doc:,.0f}", f"{index_per_doc:,.0f}", f"{total:,.0f}", f"{total / first:.2f}")
    Console().print(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("datasets", type=Path, nargs="+", help="BEIR-layout directories whose documents are analysed")
    args = parser.parse_args()
    configure_logging("WARNING", "console")
    texts = [
        document_text(entry)
        for directory in args.datasets
        for entry in load_beir(directory, sorted((directory / "qrels").glob("*.tsv"))[0].stem).corpus
    ]
    settings = Settings()
    with tempfile.TemporaryDirectory(prefix="bench-postings-") as scratch:
        runtime = EmbeddedRuntime(settings, Path(scratch))
        with runtime:
            assert runtime.endpoints is not None
            asyncio.run(run(runtime.endpoints.database_url, texts, settings))


if __name__ == "__main__":
    main()
