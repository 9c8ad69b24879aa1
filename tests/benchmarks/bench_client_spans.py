"""Benchmark of the database and HTTP spans (OpenTelemetry's asyncpg and httpx instrumentation) against none.

On the embedded PostgreSQL: the same statements (``SELECT 1``, and a fetch of 20 rows of 384-dimension vectors
like a query's dense candidates) timed with the asyncpg instrumentation on and off, in alternating rounds so the
machine's noise hits both alike; and an httpx request to a local HTTP server the same way. Spans go through a
BatchSpanProcessor to an exporter that drops them: what a worker pays with OTLP export on, short of the network.
Prints p50 per call and the difference per call (microseconds), with a 95 % bootstrap interval over rounds.

Run: .venv/bin/python -m tests.benchmarks.bench_client_spans [--rounds 20] [--calls 200]
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import asyncpg
import httpx
from opentelemetry import trace
from opentelemetry.instrumentation.asyncpg import AsyncPGInstrumentor
from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import EmbeddedRuntime
from ontofabric.shared.settings import Settings


class Dropped(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


class Quiet(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


async def _per_call_us(call: Callable[[], Awaitable[object]], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        await call()
    return (time.perf_counter() - started) / calls * 1e6


def _interval(differences: list[float]) -> tuple[float, float]:
    means = sorted(statistics.fmean(random.choices(differences, k=len(differences))) for _ in range(2000))
    return means[50], means[1949]


async def run(database_url: str, rounds: int, calls: int) -> None:
    conn = await asyncpg.connect(database_url)
    await conn.execute("CREATE TEMP TABLE vectors AS SELECT g AS id, array_fill(0.1::real, ARRAY[384]) AS v "
                       "FROM generate_series(1, 20) g")  # fmt: skip
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.server_port}")
    cases: dict[str, Callable[[], Awaitable[object]]] = {
        "asyncpg SELECT 1": lambda: conn.fetchval("SELECT 1"),
        "asyncpg 20 vectors": lambda: conn.fetch("SELECT id, v FROM vectors"),
        "httpx GET": lambda: client.get("/"),
    }
    database, http_client = AsyncPGInstrumentor(), HTTPXClientInstrumentor()  # type: ignore[no-untyped-call]
    timings: dict[tuple[str, bool], list[float]] = {(name, on): [] for name in cases for on in (False, True)}
    try:
        for _ in range(rounds):
            for on in (False, True) if random.random() < 0.5 else (True, False):
                if on:  # both wrap the classes' methods: the same connection and client are traced from now
                    database.instrument()
                    http_client.instrument()
                for name, call in cases.items():
                    timings[(name, on)].append(await _per_call_us(call, calls))
                if on:
                    database.uninstrument()
                    http_client.uninstrument()
    finally:
        await client.aclose()
        server.shutdown()
    print(f"{rounds} rounds of {calls} calls each; spans through a BatchSpanProcessor to an exporter that drops them")
    print("| call | without spans, p50 µs | with spans, p50 µs | difference per call, µs (95 % interval) |")
    print("|---|---|---|---|")
    for name in cases:
        plain, traced = timings[(name, False)], timings[(name, True)]
        differences = [b - a for a, b in zip(plain, traced, strict=True)]
        low, high = _interval(differences)
        print(
            f"| {name} | {statistics.median(plain):.0f} | {statistics.median(traced):.0f} | "
            f"{statistics.fmean(differences):+.0f} ({low:+.0f} … {high:+.0f}) |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    configure_logging("WARNING", "console")
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropped()))
    trace.set_tracer_provider(provider)
    with tempfile.TemporaryDirectory() as data_dir, EmbeddedRuntime(Settings(), Path(data_dir)) as runtime:
        assert runtime.endpoints is not None
        asyncio.run(run(runtime.endpoints.database_url, args.rounds, args.calls))


if __name__ == "__main__":
    main()
