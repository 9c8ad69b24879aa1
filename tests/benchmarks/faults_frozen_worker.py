"""Fault scenario of the read path: one of two query worker processes is frozen (SIGSTOP, as a paused VM or a
stuck host leaves it) while callers keep asking, half of them with receipts asked for and half without. With
``--freeze nats`` the nats-server is frozen instead: nats-py still calls its connections connected, and what a
client sends meanwhile waits in the server's socket.

A frozen worker keeps its place in the queue group: the NATS server drops its connection only when its pings go
unanswered, minutes later, and meanwhile hands it its share of the requests. A caller that asks for receipts
(``QueryClient`` by default) sends a request again once its receipt is a second late; one that does not waits
until the first attempt's share of its timeout has passed. Both kinds of caller run at once, against the same
workers, so the comparison is within one run.

On a part of this project's source tree (``services/query``: a few hundred chunks, embedded in seconds), cache
off. Each caller asks, waits for the reply or its timeout (10 s), and asks again at once. Timeline (``--seconds
45``): steady, then worker B frozen from 20 % of the run for ``--freeze-s`` (20 s), then thawed. Reported per
phase (by when a request was sent) and kind of caller: requests, outcomes, the replies' p50/p95/p99/max, and the
messages each kind's connection sent in that phase (each kind has a connection of its own; a request sent again
in a later phase counts there).

Run: .venv/bin/python -m tests.benchmarks.faults_frozen_worker [--seconds 45] [--clients 8] [--freeze-s 20]
[--freeze worker|nats]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass

from ontofabric.services.demo import project_root
from ontofabric.services.ops.measures import percentile
from ontofabric.services.query.client import QueryClient
from ontofabric.shared.jetstream import close, connect
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import EmbeddedRuntime
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names

from .bench_overload import ask
from .bench_spine import serve_tree
from .faults_query import ANSWERED, TIMEOUT_S, outcome_through, run_scenario, start_worker, stop_workers

KINDS = ("receipts", "no receipts")


@dataclass
class Request:
    kind: str
    sent: float
    """Seconds since the run began."""
    outcome: str
    took_s: float


async def run(runtime: EmbeddedRuntime, seconds: float, clients: int, freeze_s: float, frozen: str) -> None:
    endpoints = runtime.endpoints
    assert endpoints is not None
    settings = Settings(nats_url=endpoints.nats_url_as("operator"), database_url=endpoints.database_url)
    names = Names(settings.subject_prefix)
    tree = project_root() / "services" / "query"
    async with AsyncExitStack() as stack:
        corpus = await serve_tree(stack, settings, endpoints, "frozen", tree)
        served, workspace, texts = corpus.served, corpus.workspace, corpus.texts
        subject = names.request_subject("query", workspace)
        workers = [start_worker(endpoints, runtime.data_dir / f"worker-{n}") for n in range(2)]
        stack.callback(stop_workers, workers)
        while (await ask(served.nc, subject, "read a file", TIMEOUT_S, True))[0] not in ANSWERED:
            await asyncio.sleep(0.5)
        await asyncio.sleep(5)  # which worker answered is not visible here: time for the other's model to load

        connections = {kind: await connect(settings.nats_url or "", f"frozen-{n}") for n, kind in enumerate(KINDS)}
        for nc in connections.values():
            stack.push_async_callback(close, nc)
        by_kind = {
            kind: QueryClient(nc, names, timeout_s=TIMEOUT_S, receipts=kind == "receipts")
            for kind, nc in connections.items()
        }
        sent_at_phase: list[dict[str, int]] = []  # each connection's messages sent, as each phase begins

        def mark_phase() -> None:
            sent_at_phase.append({kind: nc.stats["out_msgs"] for kind, nc in connections.items()})

        node = runtime.nats_nodes[0].server
        assert node is not None
        frozen_pid = node.process.pid if frozen == "nats" else os.getpgid(workers[1].pid)
        requests: list[Request] = []
        began = time.perf_counter()
        end = began + seconds

        async def caller(offset: int) -> None:
            kind = KINDS[offset % 2]
            i = offset
            while time.perf_counter() < end:
                sent = time.perf_counter() - began
                outcome = await outcome_through(by_kind[kind], workspace, texts[i % len(texts)])
                requests.append(Request(kind, sent, outcome, time.perf_counter() - began - sent))
                i += clients

        def signal_frozen(signal_number: int) -> None:
            if frozen == "nats":
                os.kill(frozen_pid, signal_number)
            else:
                os.killpg(frozen_pid, signal_number)

        async def freeze() -> tuple[float, float]:
            frozen_at = 0.2 * seconds
            await asyncio.sleep(frozen_at)
            mark_phase()
            signal_frozen(signal.SIGSTOP)
            try:
                await asyncio.sleep(freeze_s)
            finally:
                signal_frozen(signal.SIGCONT)
            mark_phase()
            return frozen_at, frozen_at + freeze_s

        mark_phase()
        callers = [asyncio.create_task(caller(n)) for n in range(clients)]
        frozen_at, thawed_at = await freeze()
        await asyncio.gather(*callers)
        mark_phase()

    what = "the nats-server" if frozen == "nats" else "worker B"
    print(
        f"corpus: {corpus.chunks} chunks; {clients} callers (half with receipts), {TIMEOUT_S:g} s timeout, 2 query "
        f"workers, {what} frozen from {frozen_at:.0f} s to {thawed_at:.0f} s; {seconds:g} s"
    )
    phases = [
        ("steady", 0.0, frozen_at),
        (f"{what} frozen {freeze_s:g} s", frozen_at, thawed_at),
        ("after", thawed_at, seconds),
    ]
    for n, (label, start, stop) in enumerate(phases):
        for kind in KINDS:
            sent = sent_at_phase[n + 1][kind] - sent_at_phase[n][kind]
            chosen = [r for r in requests if r.kind == kind and start <= r.sent < stop]
            counts = Counter(r.outcome for r in chosen)
            answered = [r.took_s * 1000 for r in chosen if r.outcome in ANSWERED]
            spread = (
                ", ".join(f"p{int(q * 100)} {percentile(answered, q):.0f}" for q in (0.5, 0.95, 0.99))
                + f", max {max(answered):.0f} ms"
                if answered
                else "no answers"
            )
            print(
                f"{label}, {kind}: {len(chosen)} requests, {sent} messages sent; answers {spread}; "
                f"{dict(sorted(counts.items()))}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=45.0, help="length of the run")
    parser.add_argument("--clients", type=int, default=8, help="concurrent callers, half of each kind")
    parser.add_argument("--freeze-s", type=float, default=20.0, help="how long it stays frozen")
    parser.add_argument(
        "--freeze", choices=("worker", "nats"), default="worker", help="what is frozen: worker B or the nats-server"
    )
    args = parser.parse_args()
    configure_logging("ERROR", "console")
    run_scenario(
        "ontofabric-frozen-", lambda runtime: run(runtime, args.seconds, args.clients, args.freeze_s, args.freeze)
    )


if __name__ == "__main__":
    main()
