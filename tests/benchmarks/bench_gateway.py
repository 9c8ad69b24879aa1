"""Benchmark of the MCP gateway: what `ontofabric mcp` adds to a direct NATS request-reply to the query workers.

One run on the embedded servers: this project's tree ingested, a projector and a query worker in this process, and
the gateway as its own process, over stdio and over streamable HTTP, as an agent's client meets it. The same
queries go to the worker directly (request-reply over NATS, the reference) and as `ontology_query` tool calls, at
1 and at 16 calls in flight, the two alternated. The gateway is driven by a minimal JSON-RPC client (newline-
delimited over stdio; POSTs with httpx over HTTP), so that the figures are the gateway's and the transport's, not a
client library's; the official MCP Python SDK's client is measured apart, because it validates every structured
result against the output schema with jsonschema, which costs it milliseconds of its own per call.

Every query is asked once first, so both paths then answer from the worker's cache: the difference is what the
gateway adds (its transport, the SDK's request handling, its NATS request, its text rendering). Then cache misses,
where the pipeline's own time dominates.

Run: .venv/bin/python -m tests.benchmarks.bench_gateway [--queries 200] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from ontofabric.services.app import Roles
from ontofabric.services.demo import project_root
from ontofabric.services.ingest.chunking import chunk_file
from ontofabric.services.ingest.ingester import discover
from ontofabric.services.ops.measures import percentile
from ontofabric.services.query.client import QueryClient
from ontofabric.shared.jetstream import wait_caught_up
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import Endpoints, embedded_servers
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names

from .bench_spine import queries_from, serve_for_ingest

WORKSPACE = "bench"
PROTOCOL = "2025-11-25"
CLIENT = {"name": "bench", "version": "1"}
ONTOFABRIC = str(Path(sys.executable).parent / "ontofabric")

Call = Callable[[dict[str, Any]], Awaitable[None]]


async def timed(call: Call, requests: list[dict[str, Any]], in_flight: int) -> tuple[list[float], float]:
    """Each request's latency (ms) with ``in_flight`` at once, and the whole run's wall time (s)."""
    slots = asyncio.Semaphore(in_flight)
    latencies: list[float] = []

    async def one(request: dict[str, Any]) -> None:
        async with slots:
            started = time.perf_counter()
            await call(request)
            latencies.append((time.perf_counter() - started) * 1000)

    began = time.perf_counter()
    await asyncio.gather(*(one(r) for r in requests))
    return latencies, time.perf_counter() - began


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def compare(
    label: str, direct: Call, gateway: Call, batches: Iterator[list[dict[str, Any]]], rounds: int
) -> None:
    """Both paths at 1 and 16 in flight, alternated ``rounds`` times, each run with the next batch of requests."""
    for in_flight in (1, 16):
        samples: dict[str, list[float]] = {"direct": [], "gateway": []}
        walls: dict[str, float] = {"direct": 0.0, "gateway": 0.0}
        for _ in range(rounds):  # alternated, so both see the same machine
            for name, call in (("direct", direct), ("gateway", gateway)):
                latencies, wall = await timed(call, next(batches), in_flight)
                samples[name] += latencies
                walls[name] += wall
        d50, g50 = percentile(samples["direct"], 0.5), percentile(samples["gateway"], 0.5)
        d95, g95 = percentile(samples["direct"], 0.95), percentile(samples["gateway"], 0.95)
        d_qps, g_qps = len(samples["direct"]) / walls["direct"], len(samples["gateway"]) / walls["gateway"]
        print(
            f"| {label} | {in_flight} | {d50:.2f} | {g50:.2f} | {g50 - d50:+.2f} ({100 * (g50 / d50 - 1):+.0f} %) | "
            f"{d95:.2f} | {g95:.2f} | {d_qps:.0f} | {g_qps:.0f} ({100 * (g_qps / d_qps - 1):+.0f} %) |"
        )


class RawStdio:
    """The gateway over stdio, spoken to as newline-delimited JSON-RPC; calls in flight are told apart by id."""

    def __init__(self, env: dict[str, str]) -> None:
        self._env = env
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)

    async def start(self) -> None:
        self._process = await asyncio.create_subprocess_exec(
            ONTOFABRIC, "mcp", "--workspace", WORKSPACE, env=self._env, limit=1 << 26,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        self._reading = asyncio.create_task(self._read())
        await self.request("initialize", {"protocolVersion": PROTOCOL, "capabilities": {}, "clientInfo": CLIENT})
        self._send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    def _send(self, message: dict[str, Any]) -> None:
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps(message).encode() + b"\n")

    async def _read(self) -> None:
        assert self._process.stdout is not None
        while line := await self._process.stdout.readline():
            message = json.loads(line)
            if "id" in message:
                self._waiting.pop(message["id"]).set_result(message)

    async def request(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        number = next(self._ids)
        self._waiting[number] = asyncio.get_running_loop().create_future()
        self._send({"jsonrpc": "2.0", "id": number, "method": method, "params": params})
        return await self._waiting[number]

    async def stop(self) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()
        await self._process.wait()
        self._reading.cancel()


class RawHttp:
    """The gateway over streamable HTTP, spoken to with httpx: one session, JSON-RPC POSTs."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._http = httpx.AsyncClient(timeout=60)
        self._headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
        self._ids = itertools.count(1)

    async def start(self) -> None:
        params = {"protocolVersion": PROTOCOL, "capabilities": {}, "clientInfo": CLIENT}
        opened = await self._http.post(
            self._url, headers=self._headers, json={"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": params}
        )
        session = opened.headers.get("mcp-session-id")  # none from a stateless server
        self._headers |= {"mcp-protocol-version": PROTOCOL} | ({"mcp-session-id": session} if session else {})
        await self._http.post(
            self._url, headers=self._headers, json={"jsonrpc": "2.0", "method": "notifications/initialized"}
        )

    async def request(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        message = {"jsonrpc": "2.0", "id": next(self._ids), "method": method, "params": params}
        reply = await self._http.post(self._url, headers=self._headers, json=message)
        if reply.headers["content-type"].startswith("text/event-stream"):
            data = [line[5:] for line in reply.text.splitlines() if line.startswith("data:")]
            return dict(json.loads(data[-1]))
        return dict(reply.json())

    async def stop(self) -> None:
        await self._http.aclose()


async def run(endpoints: Endpoints, settings: Settings, query_count: int, rounds: int) -> None:
    names = Names(settings.subject_prefix)
    tree = project_root()
    async with AsyncExitStack() as stack:
        served = await serve_for_ingest(stack, settings, endpoints, Roles(azure_projector=False))
        nc, js = served.nc, served.js
        report = await served.ingester.ingest(tree, WORKSPACE)
        assert report.last_sequence is not None
        await wait_caught_up(js, names.delta_stream, names.postgres_projector_durable, report.last_sequence, 1800)
        await asyncio.sleep(0.5)
        chunks = [c for p in discover(tree) for c in chunk_file(str(p.relative_to(tree)), p.read_text(), 1 << 20)]
        texts = queries_from(chunks, query_count)
        client = QueryClient(nc, names, timeout_s=60)
        env = {"ONTOFABRIC_NATS_URL": endpoints.nats_url_as("client"), "ONTOFABRIC_LOG_LEVEL": "WARNING"}
        port = _free_port()
        http = await asyncio.create_subprocess_exec(
            ONTOFABRIC, "mcp", "--workspace", WORKSPACE, "--http", f"127.0.0.1:{port}", env=env
        )
        stack.push_async_callback(http.wait)
        stack.callback(http.terminate)
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            await asyncio.sleep(0.1)
        raw_stdio, raw_http = RawStdio(env), RawHttp(f"http://127.0.0.1:{port}/mcp")
        for raw in (raw_stdio, raw_http):
            await raw.start()
            stack.push_async_callback(raw.stop)
        sdk = await stack.enter_async_context(
            Client(StdioServerParameters(command=ONTOFABRIC, args=["mcp", "--workspace", WORKSPACE], env=env))
        )

        async def direct(request: dict[str, Any]) -> None:
            reply = json.loads(await client.send_raw(WORKSPACE, json.dumps(request).encode()))
            assert "results" in reply, reply

        def through(raw: RawStdio | RawHttp) -> Call:
            async def call(request: dict[str, Any]) -> None:
                reply = await raw.request("tools/call", {"name": "ontology_query", "arguments": request})
                assert not reply["result"].get("isError"), reply

            return call

        async def through_sdk(request: dict[str, Any]) -> None:
            result = await sdk.call_tool("ontology_query", request)
            assert not result.is_error, result.content

        print(f"{len(texts)} queries over {report.chunks} chunks of {tree.name}; {rounds} rounds each, alternated")
        print(
            "| path | in flight | direct p50 ms | gateway p50 ms | added at p50 | direct p95 ms | gateway p95 ms "
            "| direct calls/s | gateway calls/s |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        cached = [{"semanticQuery": t, "topK": 10} for t in texts]
        for request in cached:  # every later call is a cache hit, on both paths
            await direct(request)
        await compare("stdio, cache hits", direct, through(raw_stdio), itertools.repeat(cached), rounds)
        await compare("HTTP, cache hits", direct, through(raw_http), itertools.repeat(cached), rounds)
        await compare("stdio, Python SDK client, cache hits", direct, through_sdk, itertools.repeat(cached), rounds)
        # Never a cache hit: each run's requests differ in maxTokens, part of the cache key, which changes no answer.
        fresh = ([{"semanticQuery": t, "topK": 10, "maxTokens": 8000 + k} for t in texts] for k in itertools.count())
        await compare("stdio, cache misses", direct, through(raw_stdio), fresh, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", type=int, default=200, help="distinct queries")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each path, alternated")
    args = parser.parse_args()
    configure_logging("WARNING", "console")
    with embedded_servers() as endpoints:
        settings = Settings(nats_url=endpoints.nats_url_as("operator"), database_url=endpoints.database_url)
        asyncio.run(run(endpoints, settings, args.queries, args.rounds))


if __name__ == "__main__":
    main()
