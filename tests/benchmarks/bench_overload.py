"""Benchmark of one query worker past its capacity: are the answers still useful, and does every caller hear back?

On the demo corpus (this project's source tree), cache off so every request is worked on:
1. capacity: as many answers per second as ``query_concurrency`` callers in a closed loop get;
2. overload: requests arriving at twice that rate (open loop, evenly spaced) for the same time, each caller
   waiting ``--timeout-ms``. Counted: whole answers received in time (useful), answers whose optional parts were
   cut for the deadline, refusals (``overloaded``, ``deadline_exceeded``), other errors, and callers that heard
   nothing before their timeout.
   Run three times: as the worker is configured (deadlines carried, queue bounded); the same worker with callers
   that send no timeout header (as NATS clients do unless told: their wait is bounded by
   query_unstated_max_wait_ms); and as a reference the way it was before deadlines: requests without the timeout
   header, a queue that never refuses.

Target (the overload issue): useful answers per second at twice capacity >= 80 % of capacity, and no caller
without a reply or a refusal before its deadline.

Run: .venv/bin/python -m tests.benchmarks.bench_overload [--seconds 20] [--timeout-ms 2000] [--load 2.0]
Compare ratios within one run: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass

from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from ontofabric.contracts import TIMEOUT_HEADER, ErrorReply, QueryResponse
from ontofabric.services.ops.measures import percentile
from ontofabric.services.query.client import parse_reply
from ontofabric.services.query.worker import QueryService
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import Endpoints, embedded_servers
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names

from .bench_spine import serve_tree


@dataclass
class Outcome:
    counts: Counter[str]
    useful_latencies_ms: list[float]
    silent_latencies_ms: list[float]


async def ask(nc: Client, subject: str, text: str, timeout_s: float, header: bool) -> tuple[str, float]:
    headers = {TIMEOUT_HEADER: str(round(timeout_s * 1000))} if header else {}
    body = json.dumps({"semanticQuery": text}).encode()
    began = time.perf_counter()
    try:
        reply = parse_reply((await nc.request(subject, body, timeout=timeout_s, headers=headers)).data)
    except NatsTimeout:
        return "no reply in time", time.perf_counter() - began
    except NoRespondersError:  # no worker subscribed at all: told at once
        return "no responders", time.perf_counter() - began
    return outcome_of(reply), time.perf_counter() - began


def outcome_of(reply: QueryResponse | ErrorReply) -> str:
    if isinstance(reply, QueryResponse):
        return "answered, parts cut for the deadline" if "deadline" in reply.meta.degraded else "answered"
    return reply.error.code


async def closed_loop(nc: Client, subject: str, texts: list[str], callers: int, seconds: float) -> float:
    """Answers per second with ``callers`` each asking again as soon as answered."""
    deadline = time.perf_counter() + seconds
    answered = 0

    async def caller(offset: int) -> None:
        nonlocal answered
        i = offset
        while time.perf_counter() < deadline:
            outcome, _ = await ask(nc, subject, texts[i % len(texts)], 30.0, True)
            answered += outcome == "answered"
            i += callers

    started = time.perf_counter()
    await asyncio.gather(*(caller(i) for i in range(callers)))
    return answered / (time.perf_counter() - started)


async def open_loop(
    nc: Client, subject: str, texts: list[str], rate: float, seconds: float, timeout_s: float, header: bool
) -> Outcome:
    """Requests at ``rate`` per second, evenly spaced, whatever the answers do."""
    total = int(rate * seconds)
    started = time.perf_counter()
    tasks = []
    for i in range(total):
        delay = started + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(ask(nc, subject, texts[i % len(texts)], timeout_s, header)))
    results = await asyncio.gather(*tasks)
    counts = Counter(outcome for outcome, _ in results)
    return Outcome(
        counts,
        [took * 1000 for outcome, took in results if outcome == "answered"],
        [took * 1000 for outcome, took in results if outcome == "no reply in time"],
    )


async def run(endpoints: Endpoints, seconds: float, timeout_ms: int, load: float) -> None:
    settings = Settings(
        nats_url=endpoints.nats_url_as("operator"), database_url=endpoints.database_url, query_cache_entries=0
    )
    names = Names(settings.subject_prefix)
    async with AsyncExitStack() as stack:
        corpus = await serve_tree(stack, settings, endpoints, "overload")
        served, embedder, workspace, texts = corpus.served, corpus.embedder, corpus.workspace, corpus.texts
        subject = names.request_subject("query", workspace)
        timeout_s = timeout_ms / 1000
        print(
            f"corpus: {corpus.chunks} chunks; {len(texts)} distinct queries; query_concurrency "
            f"{settings.query_concurrency}, queue limit {settings.query_queue_limit}"
        )

        async def phase(worker_settings: Settings, header: bool, rate: float | None) -> tuple[float, Outcome | None]:
            worker = QueryService(worker_settings, endpoints.nats_url_as("query"), endpoints.database_url, embedder)
            await worker.start()
            try:
                await closed_loop(served.nc, subject, texts, 4, 3)  # warm up
                if rate is None:
                    return await closed_loop(served.nc, subject, texts, settings.query_concurrency, seconds), None
                return 0.0, await open_loop(served.nc, subject, texts, rate, seconds, timeout_s, header)
            finally:
                await worker.stop()

        capacity, _ = await phase(settings, True, None)
        print(f"capacity: {capacity:.1f} answers/s ({settings.query_concurrency} callers, closed loop, {seconds:g} s)")
        rate = load * capacity
        unbounded = settings.model_copy(
            update={
                "query_queue_limit": 1_000_000,
                "query_default_timeout_ms": 300_000,
                "query_unstated_max_wait_ms": 300_000,
            }
        )
        for label, worker_settings, header in (
            ("deadlines and a bounded queue", settings, True),
            ("callers that send no timeout header (the worker as built)", settings, False),
            ("reference: no deadline, unbounded queue", unbounded, False),
        ):
            _, outcome = await phase(worker_settings, header, rate)
            assert outcome is not None
            useful = outcome.counts["answered"] / seconds
            latencies = outcome.useful_latencies_ms
            p50 = percentile(latencies, 0.5) if latencies else float("nan")
            p99 = percentile(latencies, 0.99) if latencies else float("nan")
            print(
                f"{label}: {rate:.1f} requests/s for {seconds:g} s, {timeout_ms} ms timeout -> "
                f"useful {useful:.1f} answers/s = {useful / capacity:.2f} x capacity; answered p50 {p50:.0f} ms, "
                f"p99 {p99:.0f} ms; outcomes {dict(sorted(outcome.counts.items()))}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each measured phase")
    parser.add_argument("--timeout-ms", type=int, default=2000, help="each caller's timeout under overload")
    parser.add_argument("--load", type=float, default=2.0, help="arrival rate as a multiple of capacity")
    args = parser.parse_args()
    configure_logging("WARNING", "console")
    with embedded_servers() as endpoints:
        asyncio.run(run(endpoints, args.seconds, args.timeout_ms, args.load))


if __name__ == "__main__":
    main()
