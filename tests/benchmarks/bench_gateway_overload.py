"""Benchmark of one HTTP MCP gateway under sustained overload: its intake bounded (the defaults,
``ONTOFABRIC_GATEWAY_MAX_HELD`` and ``ONTOFABRIC_GATEWAY_MAX_LATE_MS``) against unbounded (both set out of reach), in
turn, ``--rounds`` times.

On the demo corpus (this project's source tree), cache off, one query worker in this process; the gateway is a
process of its own, and so is the load: the TypeScript MCP SDK (tests/node/gateway_load.mjs; `npm install --prefix
tests/node` first), ``--rate`` ontology_query calls a second for ``--seconds``, evenly spaced over ``--sessions``
sessions, each call given ``--timeout-ms`` by its client, and an MCP ping every 100 ms beside them. ``--busy N``
keeps N more processes spinning meanwhile (a machine the gateway shares).

Per phase: answers a second, the calls by outcome, latency, the calls that took longer than the gateway's own
timeout and a second (answered, if at all, after their caller's time), the ping's round trip (how far behind the
gateway's event loop is), and the gateway's RSS and CPU.

Run: .venv/bin/python -m tests.benchmarks.bench_gateway_overload [--rate 400] [--seconds 30] [--rounds 2] [--busy 0]
Compare ratios within one run: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path

from ontofabric.services.ops.measures import percentile
from ontofabric.services.query.worker import QueryService
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import Endpoints, embedded_servers
from ontofabric.shared.settings import Settings

from .bench_spine import serve_tree

NODE_DIR = Path(__file__).resolve().parent.parent / "node"
ONTOFABRIC = str(Path(sys.executable).parent / "ontofabric")
UNBOUNDED = {"ONTOFABRIC_GATEWAY_MAX_HELD": "1000000000", "ONTOFABRIC_GATEWAY_MAX_LATE_MS": "1000000000"}
GATEWAY_TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _usage(pid: int) -> tuple[float, float]:
    """A process's resident MB and CPU seconds so far."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return rss_kb / 1024, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def phase(endpoints: Endpoints, workspace: str, bounded: bool, args: argparse.Namespace, out: Path) -> str:
    port = _free_port()
    env = {
        **os.environ,
        "ONTOFABRIC_NATS_URL": endpoints.nats_url_as("client"),
        "ONTOFABRIC_LOG_LEVEL": "WARNING",
        "ONTOFABRIC_GATEWAY_TOKENS_FILE": str(out.parent / "no-tokens.json"),  # loopback, open
        "ONTOFABRIC_GATEWAY_TIMEOUT_S": str(GATEWAY_TIMEOUT_S),
        **({} if bounded else UNBOUNDED),
    }
    gateway = await asyncio.create_subprocess_exec(
        ONTOFABRIC, "mcp", "--http", f"127.0.0.1:{port}", env=env, stderr=asyncio.subprocess.DEVNULL
    )
    busy = [await asyncio.create_subprocess_exec(sys.executable, "-c", "while True: pass") for _ in range(args.busy)]
    try:
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            await asyncio.sleep(0.1)
        rss_start, cpu_start = _usage(gateway.pid)
        peak = rss_start

        async def sample() -> None:
            nonlocal peak
            while True:
                peak = max(peak, _usage(gateway.pid)[0])
                await asyncio.sleep(0.5)

        sampling = asyncio.ensure_future(sample())
        load = await asyncio.create_subprocess_exec(
            "node", str(NODE_DIR / "gateway_load.mjs"), f"http://127.0.0.1:{port}/mcp", workspace, str(args.rate),
            str(args.seconds), str(args.sessions), str(args.timeout_ms), str(out), cwd=NODE_DIR,
        )  # fmt: skip
        await load.wait()
        sampling.cancel()
        rss_end, cpu_end = _usage(gateway.pid)
    finally:
        for process in busy:
            process.kill()
            await process.wait()
        gateway.terminate()
        await gateway.wait()
    return summary(out, bounded, args.seconds, (rss_start, peak, rss_end), cpu_end - cpu_start)


def summary(out: Path, bounded: bool, seconds: float, rss: tuple[float, float, float], cpu_s: float) -> str:
    """One phase's line, from what the load wrote."""
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    calls = [line for line in lines if line["kind"] == "call"]
    pings = [line["seconds"] * 1000 for line in lines if line["kind"] == "ping" and line["ok"]] or [float("nan")]
    pings_failed = sum(line["kind"] == "ping" and not line["ok"] for line in lines)
    outcomes = Counter(call["outcome"] for call in calls)
    refused_by = Counter(
        "gateway" if "this gateway" in call["text"] or "for this gateway" in call["text"] else "worker"
        for call in calls
        if call["outcome"] == "overloaded"
    )
    answered = sorted(call["seconds"] for call in calls if call["outcome"] == "answered") or [float("nan")]
    every = sorted(call["seconds"] for call in calls)
    late = sum(call["seconds"] > GATEWAY_TIMEOUT_S + 1 for call in calls)
    return (
        f"{'bounded' if bounded else 'unbounded'}: {len(calls)} calls, answered {outcomes['answered'] / seconds:.1f}/s "
        f"(p50 {percentile(answered, 0.5):.2f} s, p95 {percentile(answered, 0.95):.2f} s); all calls p95 "
        f"{percentile(every, 0.95):.2f} s, max {every[-1]:.2f} s; past {GATEWAY_TIMEOUT_S + 1:g} s: {late}; "
        f"outcomes {dict(outcomes.most_common())}, overloaded by {dict(refused_by)}; ping p50 "
        f"{percentile(pings, 0.5):.0f} ms, p95 {percentile(pings, 0.95):.0f} ms, max {max(pings):.0f} ms "
        f"({pings_failed} failed); gateway RSS {rss[0]:.0f}, peak {rss[1]:.0f}, end {rss[2]:.0f} MB; CPU "
        f"{cpu_s / seconds:.2f} of a core"
    )


async def run(endpoints: Endpoints, args: argparse.Namespace) -> None:
    settings = Settings(
        nats_url=endpoints.nats_url_as("operator"), database_url=endpoints.database_url, query_cache_entries=0
    )
    async with AsyncExitStack() as stack:
        corpus = await serve_tree(stack, settings, endpoints, "gwload")
        worker = QueryService(settings, endpoints.nats_url_as("query"), endpoints.database_url, corpus.embedder)
        await worker.start()
        stack.push_async_callback(worker.stop)
        print(
            f"corpus: {corpus.chunks} chunks; one query worker (query_concurrency {settings.query_concurrency}, "
            f"queue {settings.query_queue_limit}); {args.rate:g} calls/s for {args.seconds:g} s over "
            f"{args.sessions} sessions, each given {args.timeout_ms} ms; {args.busy} busy processes beside",
            flush=True,
        )
        with tempfile.TemporaryDirectory() as scratch:
            for round_ in range(1, args.rounds + 1):
                for bounded in (False, True):
                    await asyncio.sleep(3)  # the worker's queue empties
                    out = Path(scratch) / f"{round_}-{bounded}.jsonl"
                    print(f"round {round_}, {await phase(endpoints, corpus.workspace, bounded, args, out)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=400.0, help="tool calls a second")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each phase")
    parser.add_argument("--sessions", type=int, default=6, help="MCP sessions the calls are spread over")
    parser.add_argument("--timeout-ms", type=int, default=15000, help="each call's timeout in its client")
    parser.add_argument("--busy", type=int, default=0, help="processes spinning beside the gateway")
    parser.add_argument("--rounds", type=int, default=2, help="times each of unbounded and bounded runs")
    args = parser.parse_args()
    if not (NODE_DIR / "node_modules" / "@modelcontextprotocol").is_dir():
        sys.exit("the TypeScript MCP SDK is missing: npm install --prefix tests/node")
    configure_logging("WARNING", "console")
    with embedded_servers() as endpoints:
        asyncio.run(run(endpoints, args))


if __name__ == "__main__":
    main()
