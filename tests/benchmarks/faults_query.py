"""Fault scenario of the read path: 50 callers keep asking two query worker processes while one worker is killed
with SIGKILL and started again, and later PostgreSQL is frozen (SIGSTOP on all its processes) for 10 s.

On the demo corpus (this project's source tree), cache off. Each caller asks, waits for the reply or its timeout
(10 s), and asks again at once; after a refusal or an error it waits 100 ms first, as a client that honours
``retryable`` would. Callers use the project's ``QueryClient``, which tells a worker 65 % of the time and sends
the request again with the rest when no reply came (the worker that had it died). Timeline (``--seconds 60``):
worker A killed at 25 % of the run and restarted 5 s later; PostgreSQL frozen at 55 % for ``--stall-s``.

Reported per phase (by when a request was sent) and in total: answers, answers with parts cut for the deadline,
refusals and errors by code, callers that heard nothing before their timeout, and the answers' p50/p95/p99.
Requests a killed worker held when it died get an answer only through the client's second attempt; those
still without a reply are counted as lost with it (sent before the kill). Everything must get a reply or a
refusal before its deadline.

Run: .venv/bin/python -m tests.benchmarks.faults_query [--seconds 60] [--clients 50] [--stall-s 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from ontofabric.services.ops.measures import percentile
from ontofabric.services.query.client import QueryClient
from ontofabric.shared.logging import configure_logging
from ontofabric.shared.runtime import EmbeddedRuntime, Endpoints
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names

from .bench_overload import ask, outcome_of
from .bench_spine import serve_tree

ONTOFABRIC = str(Path(sys.executable).parent / "ontofabric")
TIMEOUT_S = 10.0
NO_REPLY = "no reply in time"
ANSWERED = ("answered", "answered, parts cut for the deadline")


@dataclass
class Request:
    sent: float
    """Seconds since the run began."""
    outcome: str
    took_s: float


async def outcome_through(client: QueryClient, workspace: str, text: str) -> str:
    """What one query through ``client`` came to: an answer, a refusal's code, or no reply in time."""
    try:
        return outcome_of(await client.query(workspace, {"semanticQuery": text}))
    except NatsTimeout:
        return NO_REPLY
    except NoRespondersError:
        return "no responders"


def run_scenario(prefix: str, scenario: Callable[[EmbeddedRuntime], Coroutine[Any, Any, None]]) -> None:
    """Runs a fault scenario against embedded servers in a fresh data directory, removed afterwards."""
    with (
        tempfile.TemporaryDirectory(prefix=prefix) as data_dir,
        EmbeddedRuntime(Settings(), Path(data_dir)) as runtime,
    ):
        asyncio.run(scenario(runtime))


def start_worker(
    endpoints: Endpoints, data_dir: Path, extra: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """A query worker process with its cache off; ``extra``: more variables for it alone."""
    env = (
        {k: v for k, v in os.environ.items() if not k.startswith("ONTOFABRIC_")}
        | dict(extra or {})
        | {
            "ONTOFABRIC_NATS_URL": endpoints.nats_url_as("query"),
            "ONTOFABRIC_DATABASE_URL": endpoints.database_url,
            "ONTOFABRIC_QUERY_CACHE_ENTRIES": "0",
            "ONTOFABRIC_DATA_DIR": str(data_dir),
            "ONTOFABRIC_LOG_LEVEL": "WARNING",
        }
    )
    return subprocess.Popen(
        [ONTOFABRIC, "query-worker"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip


def postgres_processes(postmaster: int) -> list[int]:
    """The postmaster and its children. One signal to its process group does not reach them all: PostgreSQL
    makes each server process the leader of a group of its own."""
    children = Path(f"/proc/{postmaster}/task/{postmaster}/children").read_text().split()
    return [postmaster, *map(int, children)]


def stop_workers(workers: list[subprocess.Popen[bytes]]) -> None:
    for worker in workers:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(30)


async def run(runtime: EmbeddedRuntime, seconds: float, clients: int, stall_s: float) -> None:
    endpoints = runtime.endpoints
    assert endpoints is not None
    postgres = runtime.postgres_pid()
    settings = Settings(nats_url=endpoints.nats_url_as("operator"), database_url=endpoints.database_url)
    names = Names(settings.subject_prefix)
    async with AsyncExitStack() as stack:
        corpus = await serve_tree(stack, settings, endpoints, "faults")
        served, workspace, texts = corpus.served, corpus.workspace, corpus.texts
        subject = names.request_subject("query", workspace)
        workers = [start_worker(endpoints, runtime.data_dir / f"worker-{n}") for n in range(2)]
        stack.callback(stop_workers, workers)
        while (await ask(served.nc, subject, "read a file", TIMEOUT_S, True))[0] not in ANSWERED:
            await asyncio.sleep(0.5)
        await asyncio.sleep(5)  # which worker answered is not visible here: time for the other's model to load

        # The project's client: it sends a request again, in the time left, when the worker that had it died.
        client = QueryClient(served.nc, names, timeout_s=TIMEOUT_S)
        requests: list[Request] = []
        began = time.perf_counter()
        end = began + seconds

        async def caller(offset: int) -> None:
            i = offset
            while time.perf_counter() < end:
                sent = time.perf_counter() - began
                outcome = await outcome_through(client, workspace, texts[i % len(texts)])
                requests.append(Request(sent, outcome, time.perf_counter() - began - sent))
                if outcome not in ANSWERED and outcome != NO_REPLY:
                    await asyncio.sleep(0.1)
                i += clients

        async def faults() -> dict[str, float]:
            at = {"kill": 0.25 * seconds, "restart": 0.25 * seconds + 5, "stall": 0.55 * seconds}
            at["thaw"] = at["stall"] + stall_s
            await asyncio.sleep(at["kill"])
            os.killpg(workers[0].pid, signal.SIGKILL)
            await asyncio.sleep(at["restart"] - at["kill"])
            workers[0] = start_worker(endpoints, runtime.data_dir / "worker-0")
            await asyncio.sleep(at["stall"] - at["restart"])
            frozen = postgres_processes(postgres)
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(stall_s)
            finally:
                for pid in frozen:
                    os.kill(pid, signal.SIGCONT)
            return at

        callers = [asyncio.create_task(caller(n)) for n in range(clients)]
        at = await faults()
        await asyncio.gather(*callers)

    phases = [
        ("steady", 0.0, at["kill"]),
        ("worker killed, restarted 5 s later", at["kill"], at["stall"]),
        (f"PostgreSQL frozen {stall_s:g} s", at["stall"], at["thaw"]),
        ("after", at["thaw"], seconds),
        ("whole run", 0.0, seconds),
    ]
    print(
        f"corpus: {corpus.chunks} chunks; {clients} callers, {TIMEOUT_S:g} s timeout, 2 query workers "
        f"(query_concurrency {settings.query_concurrency}, queue limit {settings.query_queue_limit}); {seconds:g} s"
    )
    lost_with_worker = [
        r for r in requests if r.outcome == NO_REPLY and r.sent < at["kill"] and r.sent + r.took_s >= at["kill"]
    ]
    for label, start, stop in phases:
        chosen = [r for r in requests if start <= r.sent < stop]
        counts = Counter(r.outcome for r in chosen)
        answered = [r.took_s * 1000 for r in chosen if r.outcome in ANSWERED]
        spread = (
            ", ".join(f"p{int(q * 100)} {percentile(answered, q):.0f} ms" for q in (0.5, 0.95, 0.99))
            if answered
            else "no answers"
        )
        slowest = max((r.took_s for r in chosen if r.outcome != NO_REPLY), default=0.0)
        print(
            f"{label} [{start:.0f} s, {stop:.0f} s): {len(chosen)} requests; answers {spread}; slowest reply "
            f"{slowest:.2f} s; {dict(sorted(counts.items()))}"
        )
    silent = [r for r in requests if r.outcome == NO_REPLY]
    print(
        f"no reply before the deadline: {len(silent)}, of which {len(lost_with_worker)} were in flight when the "
        f"worker was killed; others: {len(silent) - len(lost_with_worker)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the run")
    parser.add_argument("--clients", type=int, default=50, help="concurrent callers")
    parser.add_argument("--stall-s", type=float, default=10.0, help="how long PostgreSQL stays frozen")
    args = parser.parse_args()
    configure_logging("WARNING", "console")
    run_scenario("ontofabric-faults-", lambda runtime: run(runtime, args.seconds, args.clients, args.stall_s))


if __name__ == "__main__":
    main()
