"""Benchmark of the client's pushback: an ``overloaded`` refusal that states its wait (``retryAfterMs``), waited out
and the request sent again within the caller's time, against the refusal handed back as it comes.

On the demo corpus (this project's source tree), cache off, one query worker as configured. Capacity is what
``query_concurrency`` callers in a closed loop get (as in bench_overload). Then, through the project's QueryClient
(what the MCP gateway and the CLI ask with), each caller waiting ``--timeout-ms``, two patterns, each run with
pushback off and on in turn, ``--rounds`` times:
1. bursts: every ``--period`` seconds, ``--burst`` x capacity x period requests at once, idle between (many agents'
   parallel tool calls landing together): the worker has the capacity on average, not at the moment;
2. sustained: requests at ``--load`` x capacity, evenly spaced, for the same time: more than the worker can answer,
   where retries could only add to the load (the retry budget is to stop them).
Counted per phase: answered, refused, no reply in time, answered p50 / p99, and the requests the worker was sent
(every send, retries included) per request asked, which is what pushback adds to the load. Each phase asks on a
connection of its own, so no retry budget carries over.

Run: .venv/bin/python -m tests.benchmarks.bench_pushback [--seconds 12] [--timeout-ms 3000] [--burst 0.75]
Compare ratios within one run: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout

from ontofabric.contracts import QueryResponse
from ontofabric.services.ops.measures import percentile
from ontofabric.services.query.client import QueryClient
from ontofabric.services.query.worker import QueryService
from ontofabric.shared.jetstream import close, connect, subscriptions_visible
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import Endpoints, embedded_servers
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names

from .bench_overload import closed_loop
from .bench_spine import serve_tree


@dataclass
class Phase:
    counts: Counter[str] = field(default_factory=Counter)
    answered_ms: list[float] = field(default_factory=list)
    sends: int = 0

    def line(self, label: str, seconds: float, capacity: float) -> str:
        asked = sum(self.counts.values())
        answered = self.counts["answered"]
        p50 = percentile(self.answered_ms, 0.5) if self.answered_ms else float("nan")
        p99 = percentile(self.answered_ms, 0.99) if self.answered_ms else float("nan")
        return (
            f"{label}: asked {asked}, answered {answered} ({answered / max(asked, 1):.1%}; "
            f"{answered / seconds / capacity:.2f} x capacity), answered p50 {p50:.0f} ms p99 {p99:.0f} ms, "
            f"sends per request {self.sends / max(asked, 1):.2f}; outcomes {dict(sorted(self.counts.items()))}"
        )


async def ask(client: QueryClient, workspace: str, text: str, phase: Phase) -> None:
    began = time.perf_counter()
    try:
        reply = await client.query(workspace, {"semanticQuery": text})
    except NatsTimeout:
        phase.counts["no reply in time"] += 1
        return
    if isinstance(reply, QueryResponse):
        phase.counts["answered"] += 1
        phase.answered_ms.append((time.perf_counter() - began) * 1000)
    else:
        phase.counts[reply.error.code] += 1


def arrivals(pattern: str, capacity: float, seconds: float, burst: float, period: float, load: float) -> list[float]:
    """When each request is sent, in seconds from the phase's start."""
    if pattern == "bursts":
        size = max(1, round(burst * capacity * period))
        return [start * period for start in range(int(seconds / period)) for _ in range(size)]
    rate = load * capacity
    return [i / rate for i in range(int(rate * seconds))]


async def run_phase(
    endpoints: Endpoints, names: Names, workspace: str, texts: list[str], at: list[float], timeout_s: float, push: bool
) -> Phase:
    phase = Phase()
    nc = await connect(endpoints.nats_url_as("operator"), "bench-pushback")

    async def count(_: Msg) -> None:
        phase.sends += 1

    counter = await nc.subscribe(names.request_subject("query", workspace), cb=count)
    await subscriptions_visible(nc)
    try:
        client = QueryClient(nc, names, timeout_s=timeout_s, pushback=push)
        started = time.perf_counter()
        tasks = []
        for i, offset in enumerate(at):
            delay = started + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(ask(client, workspace, texts[i % len(texts)], phase)))
        await asyncio.gather(*tasks)
        await nc.flush()
    finally:
        await counter.unsubscribe()
        await close(nc)
    return phase


async def run(endpoints: Endpoints, args: argparse.Namespace) -> None:
    settings = Settings(
        nats_url=endpoints.nats_url_as("operator"), database_url=endpoints.database_url, query_cache_entries=0
    )
    names = Names(settings.subject_prefix)
    async with AsyncExitStack() as stack:
        corpus = await serve_tree(stack, settings, endpoints, "pushback")
        served, embedder, workspace, texts = corpus.served, corpus.embedder, corpus.workspace, corpus.texts
        worker = QueryService(settings, endpoints.nats_url_as("query"), endpoints.database_url, embedder)
        await worker.start()
        stack.push_async_callback(worker.stop)
        subject = names.request_subject("query", workspace)
        await closed_loop(served.nc, subject, texts, 4, 3)  # warm up
        capacity = await closed_loop(served.nc, subject, texts, settings.query_concurrency, args.seconds)
        print(
            f"corpus: {corpus.chunks} chunks; query_concurrency {settings.query_concurrency}, queue limit "
            f"{settings.query_queue_limit}; capacity {capacity:.1f} answers/s; callers wait {args.timeout_ms} ms"
        )
        for pattern in ("bursts", "sustained"):
            at = arrivals(pattern, capacity, args.seconds, args.burst, args.period, args.load)
            shape = (
                f"{len(at) // int(args.seconds / args.period)} at once every {args.period:g} s"
                if pattern == "bursts"
                else f"{args.load:g} x capacity, evenly spaced"
            )
            for round_ in range(1, args.rounds + 1):
                for push in (False, True):
                    await asyncio.sleep(2)  # the worker's queue empties, its recent-work estimate settles
                    phase = await run_phase(endpoints, names, workspace, texts, at, args.timeout_ms / 1000, push)
                    label = f"{pattern} ({shape}), round {round_}, pushback {'on' if push else 'off'}"
                    print(phase.line(label, args.seconds, capacity), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=12.0, help="length of each measured phase")
    parser.add_argument("--timeout-ms", type=int, default=3000, help="each caller's timeout")
    parser.add_argument(
        "--burst",
        type=float,
        default=0.75,
        help="a burst's size, in capacity x period (so the mean load, as a multiple of capacity)",
    )
    parser.add_argument("--period", type=float, default=3.0, help="seconds from one burst to the next")
    parser.add_argument("--load", type=float, default=2.0, help="sustained arrival rate as a multiple of capacity")
    parser.add_argument("--rounds", type=int, default=2, help="times each pattern runs with pushback off and on")
    args = parser.parse_args()
    configure_logging("WARNING", "console")
    with embedded_servers() as endpoints:
        asyncio.run(run(endpoints, args))


if __name__ == "__main__":
    main()
