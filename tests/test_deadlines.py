"""Deadlines and load shedding: a request's timeout travels in a header; a worker refuses what it cannot take
(``overloaded``), works on nothing whose caller has given up (``deadline_exceeded``), and skips optional stages
that would end past the deadline. Worker tests: real NATS and PostgreSQL, a reranker that takes its time."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from structlog.testing import capture_logs

from ontofabric.contracts import (
    MAX_TIMEOUT_MS,
    RECEIPT_HEADER,
    RECEIVED,
    SENT_AT_HEADER,
    TIMEOUT_HEADER,
    ErrorDetail,
    ErrorReply,
    QueryResponse,
    StatusReply,
)
from ontofabric.services.query import client as client_module
from ontofabric.services.query.client import (
    FIRST_ATTEMPT_SHARE,
    MAX_SENDS,
    PUSHBACK_JITTER,
    RECEIPT_WAIT_S,
    Attempt,
    ClientError,
    ConnectionDown,
    NoQueryWorker,
    NoReplyInTime,
    QueryClient,
    RequestInvalid,
    RetryBudget,
    attempt_timeout,
    parse_reply,
    send_again_at,
)
from ontofabric.services.query.deadlines import (
    LAG_HALF_LIFE_S,
    MAX_MARGIN_S,
    MIN_MARGIN_S,
    SERVICE_TIME_HALF_LIFE_S,
    Deadline,
    PacedReturns,
    RecentDelay,
    ServiceTime,
    deadline_of,
    waited_before_receipt_s,
)
from ontofabric.services.query.turns import ahead_in_turn, displaced_by, runners_per_workspace, runners_serving
from ontofabric.services.query.worker import TURNED_AWAY_SAID_EVERY_S, QueryService, TurnedAway
from ontofabric.shared.embedder import Embedder
from ontofabric.shared.jetstream import close, connect, subscriptions_visible
from ontofabric.shared.nats_auth import NatsUser
from ontofabric.shared.runtime import EmbeddedRuntime, ManagedProcess, free_port
from ontofabric.shared.subjects import Names
from ontofabric.shared.turns import TurnQueue, Turns

from .conftest import Deployment, Start, connect_as, metric_points, spawn_nats

LONG_QUERY = "how do I sort a list of numbers in descending order"  # long enough that the reranker is not skipped


def test_the_deadline_is_the_callers_timeout_less_a_margin_for_the_way_back() -> None:
    assert deadline_of(None, 100.0, 10_000) == Deadline(100.0 + 10 - MAX_MARGIN_S, 10_000, stated=False)
    assert deadline_of({TIMEOUT_HEADER: " 250 "}, 100.0, 10_000) == Deadline(100.0 + 0.25 - 0.0125, 250)
    assert deadline_of({TIMEOUT_HEADER: "1"}, 0.0, 10_000) == Deadline(0.0, 1)  # the margin eats it: refused
    assert deadline_of({TIMEOUT_HEADER.lower(): "250"}, 100.0, 10_000) == Deadline(100.0 + 0.25 - 0.0125, 250)
    assert isinstance(deadline_of({TIMEOUT_HEADER: "50"}, 0.0, 1), Deadline)
    assert MIN_MARGIN_S < MAX_MARGIN_S


def test_a_loop_that_ran_late_lately_keeps_that_much_more_back_from_each_deadline() -> None:
    lag = RecentDelay()
    lag.observe(0.2, 10.0)  # a stall of 200 ms
    lag.observe(0.001, 10.05)
    assert lag.seconds == pytest.approx(0.2, rel=0.01)  # the largest recent one counts
    lag.observe(0.0, 10.0 + LAG_HALF_LIFE_S)
    assert lag.seconds == pytest.approx(0.1, rel=0.01)  # then fades
    plain = deadline_of({TIMEOUT_HEADER: "1400"}, 0.0, 10_000)
    kept_back = deadline_of({TIMEOUT_HEADER: "1400"}, 0.0, 10_000, lag_s=0.2)
    assert isinstance(plain, Deadline)
    assert isinstance(kept_back, Deadline)
    assert plain.at - kept_back.at == pytest.approx(0.2)
    short = deadline_of({TIMEOUT_HEADER: "100"}, 0.0, 10_000, lag_s=5.0)
    assert isinstance(short, Deadline)
    assert short.at == pytest.approx(0.1 - 0.005 - 0.025)  # at most a quarter of the timeout


def test_a_request_read_long_after_its_caller_sent_it_counts_the_wait() -> None:
    """A red team froze a query worker for 15 s: once it ran again it answered requests whose callers (2 s
    timeouts) had long gone, since each deadline ran from when the worker read it."""
    now = 1_000_000.0
    sent = {SENT_AT_HEADER: str(round((now - 15.0) * 1000))}
    assert waited_before_receipt_s(sent, now) == pytest.approx(14.75)  # the clocks' allowance, 250 ms, left out
    # A wait past the allowance counts, one under it does not (a load tester's answers came 0.9 s late after a
    # NATS freeze under an allowance of 1 s).
    assert waited_before_receipt_s({SENT_AT_HEADER: str(round((now - 0.9) * 1000))}, now) == pytest.approx(0.65)
    assert waited_before_receipt_s({SENT_AT_HEADER: str(round((now - 0.2) * 1000))}, now) == 0.0
    assert waited_before_receipt_s({SENT_AT_HEADER: str(round(now * 1000))}, now) == 0.0
    assert waited_before_receipt_s({SENT_AT_HEADER: str(round((now + 5) * 1000))}, now) == 0.0  # a clock ahead
    assert waited_before_receipt_s(None, now) == 0.0
    late = deadline_of({TIMEOUT_HEADER: "2000"}, 50.0, 10_000, waited_before_s=14.0)
    assert isinstance(late, Deadline)
    assert late.at == 50.0  # already due: refused unopened
    fresh = deadline_of({TIMEOUT_HEADER: "2000"}, 50.0, 10_000, waited_before_s=0.5)
    assert isinstance(fresh, Deadline)
    assert fresh.at == pytest.approx(50.0 + 2.0 - 0.1 - 0.5)
    # A day or more from the worker's clock: a clock set wrong or seconds sent, refused, not answered late (a
    # contract tester's 0 got a retryable deadline_exceeded each time).
    for value in ("soon", "-1", "1.5", "9" * 40, "0", str(round(now)), str(round((now + 90_000) * 1000))):
        problem = waited_before_receipt_s({SENT_AT_HEADER: value}, now)
        assert isinstance(problem, ErrorDetail)
        assert problem.field == f"header {SENT_AT_HEADER}"


@pytest.mark.parametrize(
    "value",
    [
        "0",
        "000",
        "-5",
        "abc",
        "1e3",
        "2.5",
        "",
        "9" * 5000,
        str(MAX_TIMEOUT_MS + 1),
        "0" + str(MAX_TIMEOUT_MS + 1),
        "٣",
    ],
)
def test_a_timeout_header_that_is_not_whole_milliseconds_in_range_is_named(value: str) -> None:
    problem = deadline_of({TIMEOUT_HEADER: value}, 0.0, 10_000)
    assert isinstance(problem, ErrorDetail)
    assert problem.field == f"header {TIMEOUT_HEADER}"


def test_a_timeout_header_with_leading_zeros_is_its_number() -> None:
    """The contract's pattern is digits: a tester's 0005000 was refused for having more than six."""
    for value, ms in (("0005000", 5000), ("0" * 40 + "1", 1), (f"00{MAX_TIMEOUT_MS}", MAX_TIMEOUT_MS)):
        deadline = deadline_of({TIMEOUT_HEADER: value}, 0.0, 10_000)
        assert isinstance(deadline, Deadline), value
        assert deadline.timeout_ms == ms


def test_the_expected_finish_counts_the_turns_ahead_and_the_work() -> None:
    service = ServiceTime()
    assert service.expected_finish(100, 4) == 0.0  # nothing measured yet: nobody is refused on a guess
    service.record(0.4)
    assert service.expected_finish(0, 4) == pytest.approx(0.4)  # a free slot: its own work
    assert service.expected_finish(3, 4) == pytest.approx(0.4)
    assert service.expected_finish(7, 4) == pytest.approx(0.4 * (1 + 4 / 4))  # four ahead of it in the queue
    service.record(1.4)
    assert service.seconds == pytest.approx(0.5)  # a moving average, not the last one


def test_a_workspace_may_hold_all_but_a_quarter_of_the_runners() -> None:
    assert [runners_per_workspace(n) for n in (1, 2, 3, 4, 8, 16)] == [1, 2, 3, 3, 6, 12]


def test_a_workspace_holding_alone_waits_for_its_own_share_of_the_runners() -> None:
    service = ServiceTime()
    service.record(0.12)
    # One workspace holding 13 requests on 16 runners: 12 of them at work, one waiting, the newcomer after it.
    alone = runners_serving(1, 16)
    assert alone == 12
    assert service.expected_wait(13, alone) == pytest.approx(0.12 * 2 / 12)
    assert service.expected_wait(13, 16) == 0.0  # what was estimated before: no wait
    # Others holding requests too: every runner serves the requests ahead of it.
    assert runners_serving(2, 16) == 16


def test_runners_take_the_next_item_of_a_workspace_that_may_run_and_the_others_keep_their_places() -> None:
    turns: Turns[str] = Turns()
    for key, item in [("acme", "a1"), ("globex", "g1"), ("acme", "a2"), ("initech", "i1")]:
        turns.put(key, item)
    assert turns.take(lambda key: key != "acme") == "g1"
    assert turns.take() == "a1"  # acme kept its place at the front
    assert turns.take(lambda key: key == "nobody") is None
    assert [turns.take(), turns.take(), turns.take()] == ["i1", "a2", None]


def test_refused_requests_are_told_to_come_back_a_runners_turn_apart() -> None:
    """A burst refused at once is told to come back spread over the time the runners take to come free, not all at
    the same moment; never past the horizon, and a refusal on its own is told its own wait."""
    returns = PacedReturns()
    waits = [returns.stated_wait(10.0, 0.1, 0.05, horizon=0.3) for _ in range(9)]  # a runner free every 50 ms
    assert waits == pytest.approx([0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.4, 0.4])
    assert returns.stated_wait(20.0, 0.1, 0.05, horizon=0.3) == pytest.approx(0.1)


def test_a_workspaces_own_requests_set_how_long_its_work_is_expected_to_take() -> None:
    service = ServiceTime()
    for _ in range(20):
        service.record(4.0, "flood")
    service.record(0.02, "light")
    assert service.seconds > 3  # the runners come free at the rate of every request
    assert service.expected_finish(1, 16, "light") == pytest.approx(0.02)  # a runner free soon, then its own work
    assert service.expected_finish(1, 16, "flood") == pytest.approx(4.0)
    assert service.expected_finish(1, 16, "newcomer") == 0.0  # never served: not refused on a guess
    assert service.expected_finish(31, 16, "light") == pytest.approx(service.seconds + 0.02)  # 16 ahead, then its own
    # Work its deadline cut would have taken longer: it does not pull the averages down (a load tester's worker
    # admitted ever more requests it then took up too late, each cut short and counted short).
    every = service.seconds
    service.record(0.05, "flood", cut=True)
    assert service.own("flood") == pytest.approx(4.0)
    # Its runner came free when it was cut: the rate runners come free at counts what it took (a review's: at the
    # costly workspace's average, its cuts raised every other workspace's expected wait).
    assert service.seconds == pytest.approx(every + 0.1 * (0.05 - every))
    service.record(6.0, "flood", cut=True)
    assert service.own("flood") == pytest.approx(4.2)


def test_what_the_average_says_fades_while_no_request_ends() -> None:
    # A tester's worker, after a slow reranker spell, refused 90 of 100 requests it answered in 100 ms (told they
    # would take 850): the few admitted moved the average a tenth each. Back to back, a tenth still.
    service = ServiceTime()
    for second in range(20):
        service.record(0.85, "w", now=100.0 + second * 0.01)
    service.record(0.1, "w", now=100.2)
    assert service.own("w") == pytest.approx(0.85 - 0.1 * 0.75, rel=0.05)
    # A second later without one ending: the next weighs more than half.
    service.record(0.1, "w", now=101.2 + SERVICE_TIME_HALF_LIFE_S)
    assert service.own("w") < 0.1 + 0.5 * (0.85 - 0.1)
    assert service.seconds < 0.1 + 0.5 * (0.85 - 0.1)
    # Up, a tenth whatever the wait: one slow request after a quiet spell does not make every request slow.
    before = service.seconds
    service.record(5.0, "other", now=110.0)
    assert service.seconds == pytest.approx(before + 0.1 * (5.0 - before))


class SlowReranker:
    """Keeps the given order after ``delay_s`` (for a query that starts with ``slow_prefix``: others at once);
    counts its calls."""

    name = "slow"

    def __init__(self, delay_s: float, slow_prefix: str = "") -> None:
        self.delay_s = delay_s
        self.slow_prefix = slow_prefix
        self.calls = 0

    async def rerank(self, query: str, documents: Sequence[str], top_n: int) -> list[tuple[int, float]]:
        self.calls += 1
        if query.startswith(self.slow_prefix):
            await asyncio.sleep(self.delay_s)
        return [(i, 1.0 - i / len(documents)) for i in range(min(top_n, len(documents)))]

    async def close(self) -> None:
        return None


@pytest.fixture
def start_worker(start_query_worker: Start, embedder: Embedder) -> Start:
    """A worker with a reranker of the test's choosing and no cache: every request does the work."""

    async def start(reranker: SlowReranker, **overrides: object) -> QueryService:
        settings = {"reranker_timeout_ms": 60_000, "query_cache_entries": 0, **overrides}
        return await start_query_worker(embedder, reranker, **settings)

    return start


async def _request(
    deployment: Deployment,
    body: bytes,
    timeout_ms: int | str | None,
    wait_s: float,
    more_headers: dict[str, str] | None = None,
    operation: str = "query",
) -> list[bytes]:
    """Publish a request (a query unless said) with its own inbox and collect every reply for ``wait_s``, late ones
    included."""
    nc = deployment.nc
    inbox = nc.new_inbox()
    replies: list[bytes] = []

    async def collect(msg: Msg) -> None:
        replies.append(msg.data)

    subscription = await nc.subscribe(inbox, cb=collect)
    headers = ({} if timeout_ms is None else {TIMEOUT_HEADER: str(timeout_ms)}) | (more_headers or {})
    await nc.publish(deployment.names.request_subject(operation, "acme"), body, reply=inbox, headers=headers)
    await asyncio.sleep(wait_s)
    await subscription.unsubscribe()
    return replies


def _query(text: str = LONG_QUERY) -> bytes:
    return json.dumps({"semanticQuery": text}).encode()


async def test_beyond_its_queue_a_worker_refuses_at_once(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    reranker = SlowReranker(0.5)
    await start_worker(reranker, query_concurrency=1, query_queue_limit=1)
    client = QueryClient(deployment.nc, deployment.names, timeout_s=10, pushback=False)
    started = time.monotonic()

    async def ask() -> tuple[QueryResponse | ErrorReply, float]:
        reply = await client.query("acme", {"semanticQuery": LONG_QUERY})
        return reply, time.monotonic() - started

    answers = await asyncio.gather(*(ask() for _ in range(6)))
    answered = [(r, t) for r, t in answers if isinstance(r, QueryResponse)]
    refused = [(r, t) for r, t in answers if isinstance(r, ErrorReply)]
    assert len(answered) >= 2  # the one at work and the one waiting
    assert refused, answers
    for reply, took in refused:
        assert isinstance(reply, ErrorReply)
        assert (reply.error.code, reply.error.retryable) == ("overloaded", True)
        assert took < 0.4  # at once, not after the slow ones
        assert reply.error.retry_after_ms is None  # nothing answered yet, no time to expect a wait by
    assert reranker.calls == len(answered)
    # Now a request takes about 0.5 s, by those answered: with two held before a newcomer, leaving through one
    # runner, a refusal expects about 1 s.
    again = await asyncio.gather(*(ask() for _ in range(4)))
    refused_again = [reply for reply, _ in again if isinstance(reply, ErrorReply)]
    assert len(refused_again) == 2, again
    for reply in refused_again:
        assert reply.error.retry_after_ms is not None, reply.error
        assert 600 <= reply.error.retry_after_ms <= 2500, reply.error


async def test_a_refusal_told_to_come_back_well_past_its_wait_says_why(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    """An outside tester's storm (callers sending again as soon as refused) was told 10.6 s to come back beside
    "this worker would answer in about 758 ms", and nothing said why: each refusal is paced behind those before."""
    await start_worker(SlowReranker(0.2), query_concurrency=1, query_queue_limit=1)
    client = QueryClient(deployment.nc, deployment.names, timeout_s=10, pushback=False)
    assert isinstance(await client.query("acme", {"semanticQuery": LONG_QUERY}), QueryResponse)  # a time to go by
    refused: list[ErrorReply] = []
    with capture_logs() as logged:
        for _ in range(3):
            replies = await asyncio.gather(*(client.query("acme", {"semanticQuery": LONG_QUERY}) for _ in range(12)))
            refused += [r for r in replies if isinstance(r, ErrorReply) and r.error.retry_after_ms is not None]
    # and the log says so, a line a second at most (the storm's 500,000 refusals had left none)
    said_busy = [entry for entry in logged if entry["event"] == "query_requests_refused_busy"]
    assert said_busy
    assert sum(entry["requests"] for entry in said_busy) <= len(refused) + 12
    said = re.compile(r"told to come back in about (\d+) ms, after the requests refused before this one")
    for reply in refused:
        assert reply.error.retry_after_ms is not None
        found = said.search(reply.error.message)
        if reply.error.retry_after_ms > 2000:  # past any wait two held requests of 0.2 s make
            assert found is not None, reply.error.message
            assert abs(int(found.group(1)) - reply.error.retry_after_ms) <= 1
        if reply.error.retry_after_ms < 500:
            assert found is None, reply.error.message
    assert max(r.error.retry_after_ms or 0 for r in refused) > 2000  # the storm's pacing reached it


async def test_a_busy_worker_answers_a_malformed_request_at_once_and_a_hopeless_timeout_as_such(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    """Two load testers': under load a malformed body was refused "overloaded", retryable (a retrying client sent
    it again and again), or queued for seconds before its error; and a timeout too short for any answer was told
    to retry, where an idle worker said it was too short."""
    await start_worker(SlowReranker(0.5), query_concurrency=1, query_queue_limit=1)
    client = QueryClient(deployment.nc, deployment.names, timeout_s=10, pushback=False)
    assert isinstance(await client.query("acme", {"semanticQuery": LONG_QUERY}), QueryResponse)  # a time to go by
    held = [asyncio.create_task(client.query("acme", {"semanticQuery": LONG_QUERY})) for _ in range(2)]
    await asyncio.sleep(0.1)  # both places taken
    started = time.monotonic()
    (malformed,) = await _request(deployment, b'{"semanticQuery": 42, "topK": "ten"}', 2000, 0.3)
    invalid = parse_reply(malformed)
    assert isinstance(invalid, ErrorReply), invalid
    assert (invalid.error.code, invalid.error.retryable) == ("invalid_request", False), invalid.error.message
    assert {detail.field for detail in invalid.error.details} == {"semanticQuery", "topK"}
    assert time.monotonic() - started < 0.4  # not behind the slow ones
    (short,) = await _request(deployment, _query(), 20, 0.3)
    hopeless = parse_reply(short)
    assert isinstance(hopeless, ErrorReply), hopeless
    assert (hopeless.error.code, hopeless.error.retryable) == ("deadline_exceeded", False), hopeless.error.message
    assert hopeless.error.details[0].field == "header Ontofabric-Timeout-Ms"
    # A fusion parameter the fusion in use takes none of, too (a review's).
    unused = {"semanticQuery": LONG_QUERY, "options": {"fusion": {"denseWeight": 0.5}}}
    (unused_reply,) = await _request(deployment, json.dumps(unused).encode(), 2000, 0.3)
    refused = parse_reply(unused_reply)
    assert isinstance(refused, ErrorReply), refused
    assert (refused.error.code, refused.error.retryable) == ("invalid_request", False), refused.error.message
    assert all(isinstance(reply, QueryResponse) for reply in await asyncio.gather(*held))


async def test_one_workspace_s_refusals_do_not_pace_another_s_return(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    """A load tester's: during one tenant's flood every tenant was told to come back in about 11 s, the waits
    paced behind the flood's refusals, where its own wait was about 0.6 s."""
    await start_worker(SlowReranker(0.2), query_concurrency=1, query_queue_limit=1)
    client = QueryClient(deployment.nc, deployment.names, timeout_s=10, pushback=False)
    assert isinstance(await client.query("acme", {"semanticQuery": LONG_QUERY}), QueryResponse)
    flood: list[int] = []
    for _ in range(3):
        replies = await asyncio.gather(*(client.query("acme", {"semanticQuery": LONG_QUERY}) for _ in range(12)))
        flood += [r.error.retry_after_ms or 0 for r in replies if isinstance(r, ErrorReply)]
    assert max(flood) > 2000  # acme's own refusals paced behind each other
    others = await asyncio.gather(*(client.query("globex", {"semanticQuery": LONG_QUERY}) for _ in range(3)))
    told = [r.error.retry_after_ms for r in others if isinstance(r, ErrorReply)]
    assert told, others
    assert all(ms is not None and ms < 1500 for ms in told), told


async def test_a_burst_across_workspaces_is_told_moments_apart(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    """A review's: paced per workspace alone, twelve workspaces' requests at once, each the first refused of its
    workspace, were all told the same moment to come back."""
    await start_worker(SlowReranker(0.2), query_concurrency=1, query_queue_limit=1)
    client = QueryClient(deployment.nc, deployment.names, timeout_s=10, pushback=False)
    assert isinstance(await client.query("acme", {"semanticQuery": LONG_QUERY}), QueryResponse)
    replies = await asyncio.gather(*(client.query(f"w{n}", {"semanticQuery": LONG_QUERY}) for n in range(12)))
    told = [r.error.retry_after_ms for r in replies if isinstance(r, ErrorReply)]
    assert len(told) >= 8, replies
    assert len(set(told)) >= len(told) // 2, told  # moments apart, not one


async def test_answers_from_the_cache_are_no_measure_of_a_workspace_s_work(
    seeded: int,
    deployment: Deployment,
    start_query_worker: Start,
    embedder: Embedder,
) -> None:
    """A load tester's: a workspace asking one cached question over and over brought its average work down to a
    few ms, and its costly questions were taken in to fail at their deadlines."""
    service = await start_query_worker(
        embedder, SlowReranker(0.3), reranker_timeout_ms=60_000, query_concurrency=1, query_queue_limit=16
    )
    client = QueryClient(deployment.nc, deployment.names, timeout_s=10, pushback=False)
    assert isinstance(await client.query("acme", {"semanticQuery": LONG_QUERY}), QueryResponse)
    worked = service._service_time.own("acme query")
    assert worked >= 0.3
    for _ in range(20):
        cached = await client.query("acme", {"semanticQuery": LONG_QUERY})
        assert isinstance(cached, QueryResponse)
        assert cached.meta.cache_hit
    assert service._service_time.own("acme query") == pytest.approx(worked, rel=0.05)
    # The worker's runners do come free at once: a burst of the cached question is taken in, not refused by the
    # costly answer's time (a review's: 7 of 8 refused, each told to wait for a runner).
    burst = await asyncio.gather(
        *(_request(deployment, json.dumps({"semanticQuery": LONG_QUERY}).encode(), 1000, 0.5) for _ in range(8))
    )
    answers = [parse_reply(reply) for replies in burst for reply in replies]
    assert all(isinstance(answer, QueryResponse) and answer.meta.cache_hit for answer in answers), answers


async def test_a_workspace_flooding_a_worker_waits_behind_its_own_requests_not_in_front_of_others(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    reranker = SlowReranker(0.2)
    await start_worker(reranker, query_concurrency=1, query_queue_limit=15)  # 16 places
    client = QueryClient(deployment.nc, deployment.names, timeout_s=30, pushback=False)
    started = time.monotonic()

    async def ask(workspace: str) -> tuple[str, QueryResponse | ErrorReply, float]:
        reply = await client.query(workspace, {"semanticQuery": LONG_QUERY})
        return workspace, reply, time.monotonic() - started

    flood = [asyncio.create_task(ask("acme")) for _ in range(20)]
    await asyncio.sleep(0.1)  # the flood is held (or refused) before the others ask
    others = [asyncio.create_task(ask("globex")) for _ in range(2)]
    answers = await asyncio.gather(*flood, *others)
    refused = [reply for workspace, reply, _ in answers if workspace == "acme" and isinstance(reply, ErrorReply)]
    assert len(refused) == 6  # 4 beyond the 16 places, and 2 whose places went to the other workspace's requests
    assert all(reply.error.code == "overloaded" for reply in refused)
    assert sum("gave this request's place" in reply.error.message for reply in refused) == 2
    answered = [(workspace, took) for workspace, reply, took in answers if isinstance(reply, QueryResponse)]
    flooded = sorted(took for workspace, took in answered if workspace == "acme")
    theirs = [(reply, took) for workspace, reply, took in answers if workspace == "globex"]
    assert all(isinstance(reply, QueryResponse) for reply, _ in theirs), theirs  # room was kept for them
    # Served in turn: each right after a request of the flood, not after the whole of it.
    assert max(took for _, took in theirs) < flooded[4], (theirs, flooded)


FLOOD = """
import asyncio, sys, time
from ontofabric.shared.jetstream import connect

async def main(url: str, subject: str, seconds: str, per_second: str) -> None:
    nc = await connect(url, "flood")
    inbox, body = nc.new_inbox(), b'{"semanticQuery": "sorting numbers in descending order"}'
    sent, started = 0, time.monotonic()
    print("flooding", flush=True)
    while (took := time.monotonic() - started) < float(seconds):
        for _ in range(100):
            await nc.publish(subject, body, reply=inbox)
        sent += 100
        await asyncio.sleep(max(0.0, sent / float(per_second) - took))
    await nc.flush()
    print(sent, flush=True)
    await nc.close()

asyncio.run(main(*sys.argv[1:]))
"""
"""Publishes queries at a rate for a while, never waiting for an answer (an answer would come to its inbox, which
nothing reads); prints how many."""
FLOOD_PER_SECOND = int(os.environ.get("ONTOFABRIC_TEST_FLOOD_PER_SECOND", "0"))
"""The flood's rate. Whether a worker keeps up with one depends on the machine and what else it runs (the same
build passed at 20,000 a second on a quiet machine and failed under other load), so the test is a measurement, run
when a rate is given (docs/benchmarks.md, "A flood of one workspace's requests"), not part of the suite."""


@pytest.mark.skipif(not FLOOD_PER_SECOND, reason="a measurement: set ONTOFABRIC_TEST_FLOOD_PER_SECOND to run it")
async def test_a_workspace_sending_faster_than_a_worker_reads_does_not_hold_up_another_workspaces_requests(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    """A red team's tenant published queries at 10,000 a second without waiting for its answers: another tenant's
    requests waited behind them unread, neither answered nor refused, until seconds after the flood ended."""
    await start_worker(SlowReranker(0.0))
    subject = deployment.names.request_subject("query", "acme")
    flood = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        FLOOD,
        deployment.nats_url_as("client"),
        subject,
        "6",
        str(FLOOD_PER_SECOND),
        stdout=asyncio.subprocess.PIPE,
    )
    assert flood.stdout is not None
    try:
        assert (await asyncio.wait_for(flood.stdout.readline(), 60)).strip() == b"flooding"
        await asyncio.sleep(1.0)  # what the worker has not read piles up
        client = QueryClient(deployment.nc, deployment.names, timeout_s=2, pushback=False)
        replies: list[QueryResponse | ErrorReply | str] = []
        for _ in range(6):
            asked = time.monotonic()
            try:
                replies.append(await client.query("globex", {"semanticQuery": "sort numbers"}))
            except NatsTimeoutError:
                replies.append("no reply")
            await asyncio.sleep(max(0.0, 0.5 - (time.monotonic() - asked)))
        sent = int(await asyncio.wait_for(flood.stdout.readline(), 60))
    finally:
        with contextlib.suppress(ProcessLookupError):
            flood.kill()
        await flood.wait()
    assert sent > 6 * FLOOD_PER_SECOND / 2
    assert sum(isinstance(reply, QueryResponse) for reply in replies) >= 5, replies


async def test_a_burst_beyond_the_places_a_worker_holds_is_answered_when_it_comes_back(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A verifier's: a first version took requests in turn as they were read only up to the places a worker holds
    (72), and refused the rest of a burst of 200 at once without a wait stated, so QueryClient did not come back
    for them: 128 failed. Admission refuses them with the wait to come back after.

    The connection's retry budget is made larger than any burst here: on a busy machine the worker answers more
    slowly than it measured, some requests are refused again when they come back, and the default budget (Finagle's,
    which also holds earlier tests' requests on this connection) was spent once in a full run. That budget is
    tested on its own; this test is of admission's stated wait."""
    await start_worker(SlowReranker(0.0))
    client = QueryClient(deployment.nc, deployment.names, timeout_s=30)
    await asyncio.gather(*(client.query("acme", {"semanticQuery": "sort numbers"}) for _ in range(20)))  # timed
    monkeypatch.setattr(client_module._INBOXES[deployment.nc], "retries", RetryBudget(share=10.0))
    replies = await asyncio.gather(*(client.query("acme", {"semanticQuery": "sort numbers"}) for _ in range(200)))
    assert all(isinstance(reply, QueryResponse) for reply in replies), [r for r in replies if isinstance(r, ErrorReply)]


async def test_requests_turned_away_as_they_arrive_are_logged_together() -> None:
    with capture_logs() as logged:
        away = TurnedAway("query_requests_refused_unread", refused="overloaded")
        for _ in range(1000):
            away.note("ontofabric.query.acme")
        away.note("ontofabric.query.globex")
        assert [entry["requests"] for entry in logged] == [1]  # the first at once
        await asyncio.sleep(TURNED_AWAY_SAID_EVERY_S + 0.2)
        assert [entry["requests"] for entry in logged] == [1, 1000]  # the rest in one line
        assert (logged[-1]["subjects"], logged[-1]["most_on"], logged[-1]["most"]) == (2, "ontofabric.query.acme", 999)
        await asyncio.sleep(TURNED_AWAY_SAID_EVERY_S + 0.2)
        assert len(logged) == 2  # none since: nothing to say
        assert away.due is None  # and nothing due
        away.note("ontofabric.query.acme")
        assert len(logged) == 3  # at once again


def test_a_turn_queue_takes_one_key_at_a_time_and_counts_what_is_left() -> None:
    async def run() -> list[str]:
        queue: TurnQueue[str] = TurnQueue()
        for item in ("a1", "a2", "a3", "b1", "c1", "b2"):
            queue.put_nowait(item[0], item)
        taken = [await queue.get() for _ in range(6)]
        assert len(queue) == 0
        for _ in taken:
            queue.task_done()
        await asyncio.wait_for(queue.join(), 1)
        return taken

    assert asyncio.run(run()) == ["a1", "b1", "c1", "a2", "b2", "a3"]
    assert displaced_by({"big": 80}, "big") is None  # alone, a workspace has every place
    assert displaced_by({"big": 80}, "small") == "big"
    assert displaced_by({"big1": 40, "big2": 40}, "small") in ("big1", "big2")  # two floods leave room too
    assert displaced_by({"big": 41, "small": 39}, "small") == "big"
    assert displaced_by({"big": 40, "small": 39}, "small") is None  # within one: no place moves for nothing
    assert displaced_by({}, "small") is None
    assert ahead_in_turn(5, 1, 5) == 5  # alone: behind its own five
    assert ahead_in_turn(0, 2, 30) == 1  # a second workspace: one turn of the other's
    assert ahead_in_turn(2, 3, 30) == 8
    assert ahead_in_turn(20, 2, 30) == 30  # never more than are held


async def test_a_request_whose_caller_gave_up_while_it_waited_is_refused_unopened(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    reranker = SlowReranker(0.8)
    service = await start_worker(reranker, query_concurrency=1)
    handled = service.handled
    first = asyncio.create_task(_request(deployment, _query(), 10_000, 2.0))
    await asyncio.sleep(0.2)  # the first is at work
    late = await _request(deployment, _query("sorting numbers in descending order quickly please"), 300, 1.5)
    assert len(late) == 1
    reply = parse_reply(late[0])
    assert isinstance(reply, ErrorReply)
    assert (reply.error.code, reply.error.retryable) == ("deadline_exceeded", True)
    assert "waited" in reply.error.message
    assert isinstance(parse_reply((await first)[0]), QueryResponse)
    assert reranker.calls == 1  # nothing was done for the caller who had gone
    assert service.handled == handled + 1


async def test_a_client_whose_clock_is_behind_the_workers_is_answered(
    seeded: int, deployment: Deployment, start_worker: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clock tester's CLI 7 s or more behind its worker had every request refused deadline_exceeded (retryable,
    and refused again each time). The refusal names the send time's header; the client, with time left by its own
    clock, sends the request again without it, and so every request on the connection for a while."""
    await start_worker(SlowReranker(0.0))

    class Behind:
        @staticmethod
        def time() -> float:
            return time.time() - 30

    monkeypatch.setattr(client_module, "time", Behind)
    nc = await connect(deployment.nats_url_as("client"), "behind")  # its own: what it learns stays on it
    try:
        client = QueryClient(nc, deployment.names, timeout_s=5)
        with capture_logs() as logged:
            first = await client.query("acme", {"semanticQuery": "sort numbers"})
            second = await client.query("acme", {"semanticQuery": "sort numbers"})
        assert isinstance(first, QueryResponse), first
        assert isinstance(second, QueryResponse), second
        events = [entry["event"] for entry in logged]
        assert events.count("query_clocks_disagree") == 1
        assert events.count("query_request_resent") == 1  # the first, once; the second went without the header
    finally:
        await close(nc)


async def test_a_request_whose_caller_sent_it_long_before_the_worker_read_it_is_refused_unopened(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    reranker = SlowReranker(0.0)
    service = await start_worker(reranker)
    handled = service.handled
    long_ago = {SENT_AT_HEADER: str(round((time.time() - 15) * 1000))}
    (late,) = await _request(deployment, _query(), 2000, 1.0, long_ago)
    reply = parse_reply(late)
    assert isinstance(reply, ErrorReply)
    assert (reply.error.code, reply.error.retryable) == ("deadline_exceeded", True)
    # A tester's: it said "waited 0 ms for a free slot", naming no header, where a caller's clock may be behind.
    assert "was sent 15" in reply.error.message
    assert f"by its {SENT_AT_HEADER} header" in reply.error.message
    assert service.handled == handled  # no work for a caller that gave up
    just_now = {SENT_AT_HEADER: str(round(time.time() * 1000))}
    (answer,) = await _request(deployment, _query(), 2000, 1.5, just_now)
    assert isinstance(parse_reply(answer), QueryResponse)
    # So too while the worker holds its workspace's requests, their work timed: it was refused "overloaded ...
    # retry with a longer timeout" (an MCP fault tester's, after a frozen NATS server), as if any work were more
    # than 80 % of none.
    reranker.delay_s = 1.0
    busy = asyncio.create_task(_request(deployment, _query("sorting numbers in descending order"), 10_000, 3.0))
    await asyncio.sleep(0.3)  # at work
    (spent,) = await _request(deployment, _query(), 2000, 1.0, {SENT_AT_HEADER: str(round((time.time() - 15) * 1000))})
    refused_late = parse_reply(spent)
    assert isinstance(refused_late, ErrorReply)
    assert refused_late.error.code == "deadline_exceeded", refused_late.error.message
    assert isinstance(parse_reply((await busy)[0]), QueryResponse)
    (malformed,) = await _request(deployment, _query(), 2000, 1.0, {SENT_AT_HEADER: "yesterday"})
    refused = parse_reply(malformed)
    assert isinstance(refused, ErrorReply)
    assert refused.error.code == "invalid_request"
    assert refused.error.details[0].field == f"header {SENT_AT_HEADER}"


async def test_an_optional_stage_that_would_end_past_the_deadline_is_cut_and_named(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    await start_worker(SlowReranker(5.0))
    client = QueryClient(deployment.nc, deployment.names, timeout_s=1.5)
    started = time.monotonic()
    reply = await client.query("acme", {"semanticQuery": LONG_QUERY})
    assert time.monotonic() - started < 1.5
    assert isinstance(reply, QueryResponse), reply
    assert reply.results[0].id == "sort"  # the fused order, without the reranker's
    assert reply.meta.reranked is False
    assert {"deadline", "reranker"} <= set(reply.meta.degraded)


async def test_a_malformed_timeout_header_is_an_invalid_request_naming_it(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    await start_worker(SlowReranker(0.0))
    replies = await _request(deployment, _query(), "soon", 1.0)
    reply = parse_reply(replies[0])
    assert isinstance(reply, ErrorReply)
    assert reply.error.code == "invalid_request"
    assert reply.error.details[0].field == f"header {TIMEOUT_HEADER}"


async def test_a_query_that_gave_its_place_to_a_status_request_is_counted_a_querys_refusal(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    """A review's: a refusal was counted under the kind of the request handled when it was made, and a displaced
    query's was the newcomer's (a status request here), which the paging ratio leaves out."""
    await start_worker(SlowReranker(0.3), query_concurrency=1, query_queue_limit=3)  # 4 places
    client = QueryClient(deployment.nc, deployment.names, timeout_s=20, pushback=False)
    assert isinstance(await client.query("acme", {"semanticQuery": f"warm {LONG_QUERY}"}), QueryResponse)

    def overloaded(request: str) -> int:
        points = metric_points("retrieval.query.errors")
        return sum(int(p.value) for p in points if p.attributes == {"code": "overloaded", "request": request})

    before = overloaded("query"), overloaded("status")
    held = [asyncio.create_task(client.query("acme", {"semanticQuery": f"held {n} {LONG_QUERY}"})) for n in range(4)]
    await asyncio.sleep(0.1)  # the four places are taken
    assert isinstance(await client.status("globex", {}), StatusReply)
    replies = await asyncio.gather(*held)
    assert sum(isinstance(reply, ErrorReply) for reply in replies) == 1, replies
    assert (overloaded("query"), overloaded("status")) == (before[0] + 1, before[1])


async def test_a_request_that_gave_its_place_to_another_workspace_states_its_wait_and_is_answered_after_it(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    """A full worker gives the newest waiting request of the workspace holding the most to a newcomer of another
    workspace; the one refused says how long until a runner would take it, and the project's client, waiting that
    out, has it answered in its caller's time."""
    await start_worker(SlowReranker(0.3), query_concurrency=1, query_queue_limit=3)  # 4 places
    warm = QueryClient(deployment.nc, deployment.names, timeout_s=20)
    for n in range(2):  # answered requests: the worker knows how long one takes
        assert isinstance(await warm.query("acme", {"semanticQuery": f"warm {n} {LONG_QUERY}"}), QueryResponse)

    async def flood(client: QueryClient, round_: str) -> list[QueryResponse | ErrorReply]:
        held = [
            asyncio.create_task(client.query("acme", {"semanticQuery": f"{round_} {n} {LONG_QUERY}"})) for n in range(4)
        ]
        await asyncio.sleep(0.1)  # the four places are taken
        other = await client.query("globex", {"semanticQuery": f"{round_} other {LONG_QUERY}"})
        assert isinstance(other, QueryResponse), other
        return await asyncio.gather(*held)

    refused = [
        reply
        for reply in await flood(QueryClient(deployment.nc, deployment.names, timeout_s=20, pushback=False), "plain")
        if isinstance(reply, ErrorReply)
    ]
    assert len(refused) == 1, refused
    assert "gave this request's place" in refused[0].error.message
    assert refused[0].error.retry_after_ms is not None, refused[0].error
    assert refused[0].error.retry_after_ms >= 300, refused[0].error  # at least the one at work, about 0.3 s
    waited_out = _resent("waited_out")
    replies = await flood(QueryClient(deployment.nc, deployment.names, timeout_s=20), "waited")
    assert all(isinstance(reply, QueryResponse) for reply in replies), replies
    assert _resent("waited_out") == waited_out + 1


async def test_one_workspaces_costly_requests_do_not_have_anothers_cheap_ones_refused(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    """A red team's finding: a tenant holding every runner with costly requests (each 4 s) had another tenant's
    cheap ones refused on arrival, 45 of 47, each expected to take as long as the average request. Here the costly
    ones take 2 s and the cheap ones have 1.5 s: a runner comes free every 0.5 s. (With 1.2 s, 0.8 s and 0.3 s, a
    cheap one missed its deadline once in a full run on a busy machine: its own work, not a refusal.)"""
    await start_worker(SlowReranker(2.0, slow_prefix="costly"), query_concurrency=4)
    client = QueryClient(deployment.nc, deployment.names, timeout_s=10)
    assert isinstance(await client.query("globex", {"semanticQuery": "cheap " + LONG_QUERY}), QueryResponse)
    stop = asyncio.Event()

    async def costly(start_after_s: float) -> None:
        await asyncio.sleep(start_after_s)  # staggered: a runner comes free every 0.5 s
        for n in itertools.count():  # each its own: the same request in flight is answered once for all
            if stop.is_set():
                return
            await client.query("acme", {"semanticQuery": f"costly {start_after_s} {n} {LONG_QUERY}"})

    flood = [asyncio.create_task(costly(0.5 * n)) for n in range(4)]
    try:
        await asyncio.sleep(5)  # several costly answers: the worker's average request takes over a second now
        impatient = QueryClient(deployment.nc, deployment.names, timeout_s=1.5)
        replies = [await impatient.query("globex", {"semanticQuery": f"cheap {n} {LONG_QUERY}"}) for n in range(3)]
    finally:
        stop.set()
        await asyncio.gather(*flood)
    assert [getattr(reply, "error", None) for reply in replies] == [None] * 3


async def test_a_workspace_leaves_a_quarter_of_the_runners_to_the_others(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    """A red team's finding: a tenant holding every runner with costly requests made another tenant's cheap one wait
    for one of them to end, however its turn came. Here 4 costly requests (1.2 s each) start together on 4
    runners: one is kept waiting, and the cheap one, with 0.8 s, is answered at once."""
    await start_worker(SlowReranker(1.2, slow_prefix="costly"), query_concurrency=4)
    client = QueryClient(deployment.nc, deployment.names, timeout_s=10)
    assert isinstance(await client.query("globex", {"semanticQuery": "cheap " + LONG_QUERY}), QueryResponse)
    flood = [asyncio.create_task(client.query("acme", {"semanticQuery": f"costly {n} {LONG_QUERY}"})) for n in range(4)]
    await asyncio.sleep(0.2)
    impatient = QueryClient(deployment.nc, deployment.names, timeout_s=0.8)
    started = time.monotonic()
    cheap = await impatient.query("globex", {"semanticQuery": "cheap again " + LONG_QUERY})
    took = time.monotonic() - started
    assert getattr(cheap, "error", None) is None
    assert took < 0.6
    finished = await asyncio.gather(*flood)
    assert all(isinstance(reply, QueryResponse) for reply in finished)  # the fourth waited its turn, and ran


def _recorded_duration_ms() -> float:
    return sum(point.sum for point in metric_points("retrieval.query.duration_ms"))


async def test_a_request_that_waited_for_a_runner_says_so_and_the_latency_metric_counts_the_wait(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    """A soak's finding: at capacity, clients saw p50 454 ms where the duration metric (and the latency alert on
    it) saw 15 ms: it started when a runner took the request."""
    await start_worker(SlowReranker(0.4), query_concurrency=1)
    client = QueryClient(deployment.nc, deployment.names, timeout_s=10)
    before = _recorded_duration_ms()
    replies = await asyncio.gather(*(client.query("acme", {"semanticQuery": f"{n} {LONG_QUERY}"}) for n in range(2)))
    answers = [reply for reply in replies if isinstance(reply, QueryResponse)]
    assert len(answers) == 2
    waited = sorted(answer.meta.timings_ms.get("queue", 0.0) for answer in answers)
    assert waited[1] > 300  # the second waited for the first's 0.4 s
    taken = sum(answer.meta.timings_ms.get("queue", 0.0) + answer.meta.timings_ms["total"] for answer in answers)
    assert _recorded_duration_ms() - before == pytest.approx(taken, abs=1)


async def test_a_workspace_whose_last_requests_were_slow_is_not_locked_out_of_a_busy_worker(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    """A review's finding: judged by its own average, a workspace whose requests met a slow spell was refused on
    arrival whenever the worker held anything, and so never brought its average down again."""
    await start_worker(SlowReranker(1.0, slow_prefix="slow"), query_concurrency=2)
    client = QueryClient(deployment.nc, deployment.names, timeout_s=10)
    assert isinstance(await client.query("globex", {"semanticQuery": "slow " + LONG_QUERY}), QueryResponse)
    busy = asyncio.create_task(client.query("acme", {"semanticQuery": "slow too " + LONG_QUERY}))
    await asyncio.sleep(0.2)  # the worker holds acme's request: it is not idle
    impatient = QueryClient(deployment.nc, deployment.names, timeout_s=0.8)
    reply = await impatient.query("globex", {"semanticQuery": "quick " + LONG_QUERY})
    assert getattr(reply, "error", None) is None  # it holds nothing: taken, and its average comes down
    assert isinstance(await busy, QueryResponse)


async def test_requests_answered_unopened_free_their_places_for_other_workspaces(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    """A review's finding: a request refused at its deadline while it waited kept its place until a runner took
    it, and only its own workspace's runners, all at work, would: another workspace found the worker full while
    a runner kept for it stood idle."""
    await start_worker(SlowReranker(1.5, slow_prefix="slow"), query_concurrency=4, query_queue_limit=2)  # 6 places
    client = QueryClient(deployment.nc, deployment.names, timeout_s=10)
    assert isinstance(await client.query("globex", {"semanticQuery": "quick " + LONG_QUERY}), QueryResponse)
    working = [asyncio.create_task(client.query("acme", {"semanticQuery": f"slow {n} {LONG_QUERY}"})) for n in range(3)]
    await asyncio.sleep(0.2)  # acme holds its 3 runners of 4
    hasty = QueryClient(deployment.nc, deployment.names, timeout_s=0.3)
    waited = await asyncio.gather(
        *(hasty.query("acme", {"semanticQuery": f"slow w{n} {LONG_QUERY}"}) for n in range(3))
    )
    assert all(isinstance(reply, ErrorReply) for reply in waited)  # refused at their deadline, unopened
    reply = await QueryClient(deployment.nc, deployment.names, timeout_s=1).query(
        "globex", {"semanticQuery": "quick again " + LONG_QUERY}
    )
    assert getattr(reply, "error", None) is None
    assert all(isinstance(reply, QueryResponse) for reply in await asyncio.gather(*working))


async def test_a_request_that_would_wait_past_its_deadline_is_refused_on_arrival(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    reranker = SlowReranker(0.6)
    await start_worker(reranker, query_concurrency=1)
    assert isinstance(parse_reply((await _request(deployment, _query(), 10_000, 1.5))[0]), QueryResponse)
    busy = asyncio.create_task(_request(deployment, _query("sort numbers in descending order please now"), 10_000, 1.5))
    await asyncio.sleep(0.1)  # at work for 0.6 s; the worker knows a request takes about that long
    # Heard within 0.3 s: had it been queued, its refusal would have come at its deadline, 0.4 s.
    replies = await _request(deployment, _query("descending sort of a list of numbers with sorted"), 400, 0.3)
    assert len(replies) == 1
    reply = parse_reply(replies[0])
    assert isinstance(reply, ErrorReply)
    assert (reply.error.code, reply.error.retryable) == ("overloaded", True)
    assert "of this workspace's work), more than 80% of the" in reply.error.message, reply.error.message
    # The one at work takes about 0.6 s, by the first request's time: the wait it states is about that.
    assert reply.error.retry_after_ms is not None, reply.error
    assert 300 <= reply.error.retry_after_ms <= 1500, reply.error
    await busy
    assert reranker.calls == 2


async def test_a_request_taken_up_with_less_time_left_than_its_work_takes_is_refused_then_not_worked_on(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    """A load tester's: admitted by an estimate the request before it then outran, a request was taken up with
    170 ms of its 2 s left, worked on, and cut at its deadline, while others waited for the runner."""
    reranker = SlowReranker(0.8)
    await start_worker(reranker, query_concurrency=1)
    for text in ("descending sort of a list of numbers with sorted", "sort numbers in descending order please"):
        assert isinstance(parse_reply((await _request(deployment, _query(text), 10_000, 1.5))[0]), QueryResponse)
    reranker.delay_s = 3.9  # this one takes longer than the worker expects
    busy = asyncio.create_task(
        _request(deployment, _query("how do I read a csv file into rows of values"), 10_000, 5.0)
    )
    await asyncio.sleep(0.05)
    # Expected to wait about 0.8 s and work 0.8 s, within 80 % of 5 s: admitted; taken up after about 4 s, with
    # about 0.75 s left, under the 1.1 s or so its work is then expected to take.
    late = asyncio.create_task(
        _request(deployment, _query("compress a whole directory tree into a zip archive"), 5000, 5.5)
    )
    await asyncio.sleep(0.05)
    after = asyncio.create_task(_request(deployment, _query("parse the json body of a web request"), 10_000, 10.0))
    replies = await late
    assert len(replies) == 1
    reply = parse_reply(replies[0])
    assert isinstance(reply, ErrorReply), reply
    assert (reply.error.code, reply.error.retryable) == ("overloaded", True), reply.error
    assert "taken up with" in reply.error.message, reply.error.message
    assert [isinstance(parse_reply(r[0]), QueryResponse) for r in (await busy, await after)] == [True, True]
    assert reranker.calls == 4  # the two before, the one at work and the one after: not the refused one


async def test_a_document_read_is_not_judged_by_its_workspaces_queries(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    """A review's: a workspace's average work was one over its queries and reads alike, so a document read of a
    few milliseconds, asked with 800 ms while a query of about a second was at work, was refused on arrival."""
    await start_worker(SlowReranker(1.0), query_concurrency=4)
    assert isinstance(parse_reply((await _request(deployment, _query(), 10_000, 1.6))[0]), QueryResponse)
    busy = asyncio.create_task(_request(deployment, _query("sort numbers in descending order please"), 10_000, 1.6))
    await asyncio.sleep(0.1)  # the workspace holds a query: its averages are read on arrival
    replies = await _request(deployment, b'{"id": "csv"}', 800, 1.0, operation="document")
    assert len(replies) == 1
    assert b'"error"' not in replies[0], replies[0]
    assert json.loads(replies[0])["id"] == "csv"
    await busy


async def test_a_request_that_states_no_timeout_waits_briefly_for_a_slot_then_is_refused(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    """Its caller's timeout is unknown (NATS clients default to 0.5-1 s): it waits at most
    query_unstated_max_wait_ms for a runner, and is refused `overloaded` unopened past it. Before, it was given
    the default 10 s, so a flood of them queued for seconds while their callers had given up."""
    reranker = SlowReranker(0.0)
    await start_worker(reranker, query_concurrency=1, query_unstated_max_wait_ms=200)
    assert isinstance(parse_reply((await _request(deployment, _query(), None, 0.5))[0]), QueryResponse)
    reranker.delay_s = 1.2  # the worker still expects a quick answer, so the next one is let in and waits
    busy = asyncio.create_task(_request(deployment, _query("sort numbers in descending order please now"), None, 2.5))
    await asyncio.sleep(0.1)  # the runner has it
    started = time.monotonic()
    replies = await _request(deployment, _query("descending sort of a list of numbers with sorted"), None, 0.8)
    assert len(replies) == 1
    reply = parse_reply(replies[0])
    assert isinstance(reply, ErrorReply), reply
    assert (reply.error.code, reply.error.retryable) == ("overloaded", True)
    assert TIMEOUT_HEADER in reply.error.message
    assert "waited" in reply.error.message
    assert [d.field for d in reply.error.details] == [f"header {TIMEOUT_HEADER}"]
    assert reranker.calls == 2  # the refused one was never worked on
    # The one a runner took in time is answered, though its work lasts past the wait.
    assert isinstance(parse_reply((await busy)[0]), QueryResponse)
    assert time.monotonic() - started < 2.5
    assert reranker.calls == 2


async def test_a_request_that_states_no_timeout_is_refused_on_arrival_when_it_would_wait_too_long(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    reranker = SlowReranker(0.6)
    await start_worker(reranker, query_concurrency=1, query_unstated_max_wait_ms=200)
    assert isinstance(parse_reply((await _request(deployment, _query(), None, 1.5))[0]), QueryResponse)
    busy = asyncio.create_task(_request(deployment, _query("sort numbers in descending order please now"), None, 1.5))
    await asyncio.sleep(0.1)  # at work for 0.6 s; the worker knows a request takes about that long
    # Heard within 0.15 s: had it been queued, its refusal would have come at the end of its wait, 0.2 s.
    replies = await _request(deployment, _query("descending sort of a list of numbers with sorted"), None, 0.15)
    assert len(replies) == 1
    reply = parse_reply(replies[0])
    assert isinstance(reply, ErrorReply), reply
    assert (reply.error.code, reply.error.retryable) == ("overloaded", True)
    assert "would start this request in about" in reply.error.message
    assert TIMEOUT_HEADER in reply.error.message
    assert [d.field for d in reply.error.details] == [f"header {TIMEOUT_HEADER}"]  # an outside team's: it was []
    assert reply.error.retry_after_ms is not None, reply.error
    assert 300 <= reply.error.retry_after_ms <= 1500, reply.error
    # A caller that states its timeout may wait longer than that.
    stated = await _request(deployment, _query("descending sort of a list of numbers with sorted"), 5_000, 1.5)
    assert isinstance(parse_reply(stated[0]), QueryResponse)
    await busy
    assert reranker.calls == 3


async def test_an_idle_worker_takes_a_request_whatever_it_took_before(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    """After a slow spell (a database frozen for seconds) the worker's average says requests take long; refusing
    short deadlines on that alone, an idle worker refused every one and never learnt it was fast again."""
    reranker = SlowReranker(1.0)
    await start_worker(reranker, query_concurrency=1)
    assert isinstance(parse_reply((await _request(deployment, _query(), 10_000, 1.6))[0]), QueryResponse)
    reranker.delay_s = 0.0  # the slow spell is over; the average still says about a second
    # 1 s deadlines: the average (about 1 s) is past ADMISSION_SHARE of them, so a worker judging by it alone
    # refuses them; 500 ms ones left a loaded machine too little time to answer (one full run of 2026-12-01).
    for text in ("descending sort of a list of numbers with sorted", "sort numbers in descending order please"):
        replies = await _request(deployment, _query(text), 1000, 1.2)
        assert len(replies) == 1
        assert isinstance(parse_reply(replies[0]), QueryResponse)


async def test_publishes_without_a_reply_subject_take_no_place(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    """Nobody waits for them: had they been queued, the queue (1 here) would be full and the request refused."""
    await start_worker(SlowReranker(0.3), query_concurrency=1, query_queue_limit=1)
    for n in range(10):
        await deployment.nc.publish(deployment.names.request_subject("query", "acme"), _query(f"no one asks {n}"))
    replies = await _request(deployment, _query(), 10_000, 1.5)
    assert len(replies) == 1
    assert isinstance(parse_reply(replies[0]), QueryResponse)


async def test_a_request_the_admission_fails_on_is_answered_internal_and_the_next_is_served(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fault in the admission itself (here its estimate of the wait) is the worker's: its caller hears so at once
    rather than waiting out its timeout, and the admission goes on with the next request."""
    service = await start_worker(SlowReranker(0.0))
    estimate = service._service_time.expected_finish
    failures = iter([RuntimeError("the estimate failed")])

    def failing_once(*args: Any) -> float:
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return estimate(*args)

    monkeypatch.setattr(service._service_time, "expected_finish", failing_once)
    with capture_logs() as logs:
        first = await _request(deployment, _query(), 10_000, 1.0)
    assert len(first) == 1
    error = parse_reply(first[0])
    assert isinstance(error, ErrorReply)
    assert (error.error.code, error.error.retryable) == ("internal", True)
    assert [entry["event"] for entry in logs if entry["log_level"] == "error"] == ["request_failed_outside_its_handler"]
    second = await _request(deployment, _query(), 10_000, 1.5)
    assert len(second) == 1
    assert isinstance(parse_reply(second[0]), QueryResponse)


async def test_a_stalled_database_is_unavailable_before_the_deadline(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    # Statements end on the server after 1 s; the worker stops waiting for a silent one 1 s after that (for the
    # statement, and again for its transaction's rollback).
    await start_worker(SlowReranker(0.0), statement_timeout_ms=1000)
    client = QueryClient(deployment.nc, deployment.names, timeout_s=10)
    assert isinstance(await client.query("acme", {"semanticQuery": LONG_QUERY}), QueryResponse)
    # The database's server processes for this deployment freeze (SIGSTOP), as a host under memory pressure or a
    # stuck disk would: connections stay open and nothing answers.
    frozen = await _freeze_the_database(deployment)
    try:
        started = time.monotonic()
        reply = await client.query("acme", {"semanticQuery": "read a csv file into rows"})
        took = time.monotonic() - started
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    assert isinstance(reply, ErrorReply), reply
    assert reply.error.code == "unavailable"
    assert reply.error.retryable
    assert took < 7  # twice the client-side limit of 2 s, and the way: well before the caller's 10 s
    again = await client.query("acme", {"semanticQuery": "compress a directory into a zip archive"})
    assert isinstance(again, QueryResponse), again


async def _freeze_the_database(deployment: Deployment) -> list[int]:
    """SIGSTOP the deployment's database server processes, as a host under memory pressure or a stuck disk
    would: connections stay open and nothing answers. The pids, for SIGCONT."""
    rows = await deployment.fetch(
        "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND backend_type = 'client backend' "
        "AND pid <> pg_backend_pid()",
        deployment.settings.subject_prefix,
    )
    frozen = [row["pid"] for row in rows]
    assert frozen
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    return frozen


class SlowEmbedder:
    """``embedder`` whose query embeddings take ``delay_s`` longer (a model thread behind other work)."""

    def __init__(self, embedder: Embedder, delay_s: float) -> None:
        self._embedder = embedder
        self._delay_s = delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._embedder, name)

    async def embed_query_with_tokens_async(self, text: str, turn: str = "") -> Any:
        await asyncio.sleep(self._delay_s)
        return await self._embedder.embed_query_with_tokens_async(text)


async def test_a_discovery_ping_with_headers_near_max_payload_leaves_the_worker_connected(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    """Service discovery answers without the request's headers too (nats.micro's handlers echoed them)."""
    worker = await start_worker(SlowReranker(0.0))
    nc = deployment.nc
    headers = {"filler": "f" * (nc.max_payload - 64)}  # the request fits; with an answer beside it, no longer
    pong = await nc.request(f"$SRV.PING.{deployment.names.query_service}", b"", 5, headers=headers)
    assert json.loads(pong.data)["type"] == "io.nats.micro.v1.ping_response"
    info = await nc.request(f"$SRV.INFO.{deployment.names.query_service}", b"", 5)
    assert json.loads(info.data)["name"] == deployment.names.query_service
    again = await nc.request(deployment.names.request_subject("query", "acme"), _query(), 10)
    assert isinstance(parse_reply(again.data), QueryResponse)
    assert worker.connection is not None
    assert worker.connection.is_connected
    # A conformance tester's: INFO and STATS listed no endpoints, so `nats micro stats` counted nothing.
    prefix, queue = deployment.names.prefix, deployment.names.query_queue
    listed = json.loads(info.data)["endpoints"]
    assert {(e["name"], e["subject"], e["queue_group"]) for e in listed} == {
        (operation, f"{prefix}.{operation}.*", queue) for operation in ("query", "document", "status")
    }
    await nc.request(deployment.names.request_subject("query", "acme"), b"{}", 10)  # no query: refused
    stats = await nc.request(f"$SRV.STATS.{deployment.names.query_service}", b"", 5)
    query = next(e for e in json.loads(stats.data)["endpoints"] if e["name"] == "query")
    assert (query["num_requests"], query["num_errors"], query["last_error"]) == (2, 1, "invalid_request")
    assert query["processing_time"] > 0
    assert query["average_processing_time"] == query["processing_time"] // 2


async def test_retrievers_cut_by_the_deadline_are_deadline_exceeded_not_unavailable(
    seeded: int,
    deployment: Deployment,
    start_query_worker: Start,
    embedder: Embedder,
) -> None:
    """Nothing could run in the time the caller gave: what it is told is about its time, not an outage."""
    await start_query_worker(SlowEmbedder(embedder, 3.0), None, query_cache_entries=0)
    dense_only = {"semanticQuery": LONG_QUERY, "options": {"retrievers": ["dense"]}}
    replies = await _request(deployment, json.dumps(dense_only).encode(), 1000, 2.0)
    assert len(replies) == 1
    reply = parse_reply(replies[0])
    assert isinstance(reply, ErrorReply), reply
    assert (reply.error.code, reply.error.retryable) == ("deadline_exceeded", True)
    # What ran out of time, said as such (a fault tester's read "no retriever could run (deadline, keyword, dense)").
    assert "embedder did not answer within the request's time" in reply.error.message, reply.error.message
    # A timeout no retriever is ever given time in: the same again cannot be answered, so it is not retryable, and
    # the reply says what is needed (an outside tester's 20 ms requests, retryable, looped in a retrying client).
    # The margin kept for the reply counts: 21 to 25 ms were told to retry (an outside tester's).
    for asked, timeout_ms in (
        (dense_only, 50),
        (dense_only, 55),
        ({"semanticQuery": LONG_QUERY}, 20),
        ({"semanticQuery": LONG_QUERY}, 25),
    ):
        (hopeless,) = await _request(deployment, json.dumps(asked).encode(), timeout_ms, 2.0)
        refused = parse_reply(hopeless)
        assert isinstance(refused, ErrorReply), refused
        assert (refused.error.code, refused.error.retryable) == ("deadline_exceeded", False), refused.error.message
        longest = 55 if asked is dense_only else 25
        assert f"ask with more than {longest} ms" in refused.error.message
        assert refused.error.details[0].field == "header Ontofabric-Timeout-Ms"  # as a malformed one is named
    # Shorter still, refused before the pipeline was asked: the same (1 to 8 ms were retryable, 10 ms not).
    for timeout_ms in (1, 5, 8, 10):
        (hopeless,) = await _request(deployment, json.dumps({"semanticQuery": LONG_QUERY}).encode(), timeout_ms, 2.0)
        refused = parse_reply(hopeless)
        assert isinstance(refused, ErrorReply), refused
        assert (refused.error.code, refused.error.retryable) == ("deadline_exceeded", False), timeout_ms
        assert refused.error.details[0].field == "header Ontofabric-Timeout-Ms"
    # A document or a status request runs no retriever: refused for time, it may be tried again (a review's). And
    # a query's send time, when it took part, is still named.
    for operation, body in (("document", b'{"id": "csv"}'), ("status", b"{}")):
        (late,) = await _request(deployment, body, 1, 2.0, operation=operation)
        refused = parse_reply(late)
        assert isinstance(refused, ErrorReply), refused
        assert (refused.error.code, refused.error.retryable) == ("deadline_exceeded", True), operation
    sent_before = {SENT_AT_HEADER: str(int(time.time() * 1000) - 1200)}
    (late,) = await _request(deployment, json.dumps({"semanticQuery": LONG_QUERY}).encode(), 15, 2.0, sent_before)
    refused = parse_reply(late)
    assert isinstance(refused, ErrorReply), refused
    assert [d.field for d in refused.error.details] == ["header Ontofabric-Timeout-Ms", f"header {SENT_AT_HEADER}"]


async def test_refusals_for_time_the_caller_made_near_impossible_are_counted_apart(
    seeded: int,
    deployment: Deployment,
    start_query_worker: Start,
    embedder: Embedder,
) -> None:
    """A soak's finding: callers stating 30 ms timeouts put the paging error ratio at 2 % while the worker was
    healthy. A refusal for time of a request that allowed less than query_short_timeout_ms is counted with
    timeout="shorter_than_service" (the ratio leaves those out). Any other is the service's, however slow the
    workspace's requests have lately been: a review's finding against a first version, which compared with their
    moving average, so that a slow spell excused its own refusals."""
    await start_query_worker(SlowEmbedder(embedder, 1.0), None, query_cache_entries=0, query_short_timeout_ms=200)

    def refused_for_time() -> dict[str | None, int]:
        counts: dict[str | None, int] = {}
        for point in metric_points("retrieval.query.errors"):  # a query's, by its timer or its runner
            if (
                point.attributes.get("code") in ("deadline_exceeded", "overloaded")
                and point.attributes.get("request") == "query"
            ):
                timeout = point.attributes.get("timeout")
                counts[timeout] = counts.get(timeout, 0) + int(point.value)
        return counts

    dense_only = json.dumps({"semanticQuery": LONG_QUERY, "options": {"retrievers": ["dense"]}}).encode()
    for _ in range(3):  # a slow spell: the workspace's requests take a second and more
        (answer,) = await _request(deployment, dense_only, 5000, 3.0)
        assert isinstance(parse_reply(answer), QueryResponse)
    before = refused_for_time()
    (short,) = await _request(deployment, dense_only, 100, 1.0)
    assert parse_reply(short).error.code == "deadline_exceeded"  # type: ignore[union-attr]
    after_short = refused_for_time()
    assert after_short.get("shorter_than_service", 0) == before.get("shorter_than_service", 0) + 1
    assert after_short.get(None, 0) == before.get(None, 0)

    (late,) = await _request(deployment, dense_only, 500, 1.5)  # allowed more than the floor: the slow spell's
    assert parse_reply(late).error.code == "deadline_exceeded"  # type: ignore[union-attr]
    after_late = refused_for_time()
    assert after_late.get(None, 0) == after_short.get(None, 0) + 1
    assert after_late.get("shorter_than_service", 0) == after_short.get("shorter_than_service", 0)


async def test_a_request_refused_while_it_waited_is_counted_once(
    seeded: int,
    deployment: Deployment,
    start_query_worker: Start,
    embedder: Embedder,
) -> None:
    """An operator's finding: a request whose deadline passed while it waited for the runner was refused by its
    timer, and counted again when the runner came to it (the reply it made then was dropped): the paging error
    ratio counted deadline_exceeded twice."""
    await start_query_worker(SlowEmbedder(embedder, 1.0), None, query_cache_entries=0, query_concurrency=1)

    def counted() -> int:
        points = metric_points("retrieval.query.errors")
        return sum(
            int(p.value)
            for p in points
            if p.attributes.get("code") == "deadline_exceeded" and p.attributes["request"] == "query"
        )

    before = counted()
    slow = asyncio.create_task(_request(deployment, _query("the runner is busy with this one"), 10_000, 2.5))
    await asyncio.sleep(0.2)
    (refused,) = await _request(deployment, _query("this one waits past its deadline"), 400, 2.0)
    assert parse_reply(refused).error.code == "deadline_exceeded"  # type: ignore[union-attr]
    (answered,) = await slow
    assert isinstance(parse_reply(answered), QueryResponse)
    assert counted() == before + 1


async def test_callers_hear_back_by_their_deadline_while_the_runners_are_stuck(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    """One runner, stuck in a statement on a frozen database for longer than anyone waits (the client-side limit
    is 31 s): the request it holds and the one queued behind it are both refused by their deadlines, where
    before the queued one waited for a runner that never came, and the held one for a cleanup on the frozen
    connection."""
    await start_worker(SlowReranker(0.0), statement_timeout_ms=30_000, query_concurrency=1)
    assert isinstance(
        await QueryClient(deployment.nc, deployment.names).query("acme", {"semanticQuery": "csv"}), QueryResponse
    )
    frozen = await _freeze_the_database(deployment)
    try:

        async def ask(timeout_s: float, text: str) -> tuple[ErrorReply | QueryResponse, float]:
            started = time.monotonic()
            reply = await QueryClient(deployment.nc, deployment.names, timeout_s=timeout_s).query(
                "acme", {"semanticQuery": text}
            )
            return reply, time.monotonic() - started

        held = asyncio.create_task(ask(2.0, "read a csv file into rows"))
        await asyncio.sleep(0.2)  # the runner has it, and is stuck
        queued, queued_took = await ask(1.0, "serialise an object to json")
        held_reply, held_took = await held
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    for reply, took, timeout_s in ((held_reply, held_took, 2.0), (queued, queued_took, 1.0)):
        assert isinstance(reply, ErrorReply), reply
        assert (reply.error.code, reply.error.retryable) == ("deadline_exceeded", True)
        assert took < timeout_s


async def test_a_huge_baggage_header_is_ignored_without_a_log_line(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
    capfd: pytest.CaptureFixture[str],
) -> None:
    await start_worker(SlowReranker(0.0))
    nc = deployment.nc
    headers = {"baggage": "k=" + "v" * 20_000, TIMEOUT_HEADER: "10000"}
    capfd.readouterr()
    for _ in range(3):
        reply = await nc.request(deployment.names.request_subject("query", "acme"), _query(), 10, headers=headers)
        assert isinstance(parse_reply(reply.data), QueryResponse)
    assert "vvvvvvvvvv" not in "".join(capfd.readouterr())


async def test_a_request_with_headers_near_max_payload_is_answered_and_the_worker_stays_connected(
    seeded: int,
    deployment: Deployment,
    start_worker: Start,
) -> None:
    """The reply carries none of the request's headers: echoed, they took it over max_payload, and the server ended
    the worker's connection for good."""
    worker = await start_worker(SlowReranker(0.0))
    nc = deployment.nc
    headers = {"filler": "f" * (nc.max_payload - 4096), TIMEOUT_HEADER: "10000"}
    subject = deployment.names.request_subject("query", "acme")
    reply = await nc.request(subject, _query(), 10, headers=headers)
    assert isinstance(parse_reply(reply.data), QueryResponse)
    assert "filler" not in (reply.headers or {})
    again = await nc.request(subject, _query(), 10)
    assert isinstance(parse_reply(again.data), QueryResponse)
    assert worker.connection is not None
    assert worker.connection.is_connected


async def test_a_request_lost_with_its_worker_is_sent_again_in_the_time_left(
    deployment: Deployment, runtime: EmbeddedRuntime
) -> None:
    """A worker that takes a request and dies with it (here: one that says it has its first but never replies)
    leaves its caller silent past the timeout it was told; the client sends it again with the time left, to whichever
    worker takes it. Only when a second attempt still fits (1 s or more)."""
    names = deployment.names
    seen: list[int] = []
    answer = b'{"error": {"code": "overloaded", "message": "busy", "retryable": true}}'

    async def flaky(msg: Msg) -> None:
        assert msg.headers is not None
        seen.append(int(msg.headers[TIMEOUT_HEADER]))
        await worker.publish(msg.reply, b"", headers={RECEIPT_HEADER: RECEIVED})  # it has the request
        if len(seen) > 1:
            await msg.respond(answer)

    worker = await connect_as(deployment, runtime, "query")
    await worker.subscribe(names.request_subject("query", "acme"), queue=names.query_queue, cb=flaky)
    await subscriptions_visible(worker)
    try:
        started = time.monotonic()
        reply = await QueryClient(deployment.nc, names, timeout_s=3.0).send_raw("acme", b'{"semanticQuery": "x"}')
        took = time.monotonic() - started
        assert reply == answer
        assert took < 3.0
        assert len(seen) == 2
        assert 1600 <= seen[0] <= 1800  # 65 % of the time, less the way back
        assert seen[1] <= 1050 - 250 + 50

        seen.clear()  # 2 s: no room for a second attempt of 1 s after a first of 65 %
        with pytest.raises(NatsTimeoutError):
            await QueryClient(deployment.nc, names, timeout_s=2.0).send_raw("acme", b'{"semanticQuery": "x"}')
        assert len(seen) == 1
    finally:
        await worker.close()


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, float("nan"), float("inf")])
def test_a_client_refuses_a_timeout_that_is_no_positive_number_of_seconds(timeout_s: float) -> None:
    """A tester's NaN failed at the first send with "cannot convert float NaN to integer"; 0 and -1 sent a request
    and then timed out."""
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds"):
        QueryClient(None, Names(), timeout_s=timeout_s)  # type: ignore[arg-type]


def test_a_request_is_sent_again_once_no_attempt_of_it_can_be_expected_to_answer() -> None:
    """An attempt is expected to say it has the request within the receipt wait, and to answer by its timeout
    once it has; the request goes out again when no open attempt is within either."""
    wait = RECEIPT_WAIT_S
    silent = Attempt(0.0, 6.5)
    assert send_again_at([silent], wait) == wait
    silent.receipt_at = 0.01
    assert send_again_at([silent], wait) == 0.01 + 6.5  # it has it: the time it was told, from when it read it
    second = Attempt(1.0, 5.0)
    assert send_again_at([Attempt(0.0, 6.5), second], wait) == 1.0 + wait
    second.done = True  # refused: the first, silent, is all that is awaited
    assert send_again_at([Attempt(0.0, 6.5), second], wait) == wait
    assert send_again_at([second], wait) is None
    assert send_again_at([Attempt(0.0, 0.5)], wait) == 0.5  # a short attempt: its timeout first
    assert send_again_at([Attempt(0.0, 6.5, receipt_asked=False)], wait) == 6.5  # no receipt to wait for
    assert send_again_at([Attempt(0.0, 6.5)], None) == 6.5  # receipts not trusted on this connection
    assert send_again_at([Attempt(0.0, 6.5, listened_since=3.0)], wait) == 3.0 + wait  # the client was deaf
    assert attempt_timeout(10.0, 8) == 10.0 * FIRST_ATTEMPT_SHARE
    assert attempt_timeout(10.0, 1) == 10.0  # the last send has all that is left
    assert attempt_timeout(2.0, 8) == 2.0  # no room for another after a share of it


async def test_a_worker_says_it_has_a_request_before_it_answers_when_asked(
    seeded: int, deployment: Deployment, start_worker: Start
) -> None:
    await start_worker(SlowReranker(0.0))
    nc = deployment.nc
    subject = deployment.names.request_subject("query", "acme")
    for headers, expected in (({RECEIPT_HEADER: "1", TIMEOUT_HEADER: "10000"}, 2), ({TIMEOUT_HEADER: "10000"}, 1)):
        inbox = nc.new_inbox()
        replies = await nc.subscribe(inbox)
        await nc.publish(subject, _query(), reply=inbox, headers=headers)
        got = [await replies.next_msg(timeout=10) for _ in range(expected)]
        with pytest.raises(NatsTimeoutError):
            await replies.next_msg(timeout=0.3)
        await replies.unsubscribe()
        if expected == 2:
            assert (got[0].data, (got[0].headers or {}).get(RECEIPT_HEADER)) == (b"", RECEIVED)
        assert isinstance(parse_reply(got[-1].data), QueryResponse)
        assert RECEIPT_HEADER not in (got[-1].headers or {})


async def test_a_request_held_by_a_frozen_worker_is_sent_again_when_its_receipt_does_not_come(
    seeded: int, deployment: Deployment, runtime: EmbeddedRuntime, start_worker: Start
) -> None:
    """A worker frozen by its host (SIGSTOP, a paused VM) keeps its place in the queue group until the server's
    pings time out, minutes later, and takes its share of requests without a word. Here a member that reads one
    request and is never heard of again: the request is sent again once its receipt is a second late, not when
    the 65 % of the timeout given to the first attempt has passed."""
    await start_worker(SlowReranker(0.0))
    names = deployment.names
    client = QueryClient(deployment.nc, names, timeout_s=10)
    # Receipts are relied on once the connection has had one (a fleet of an earlier release sends none).
    assert isinstance(await client.query("acme", {"semanticQuery": "retry a call"}), QueryResponse)
    held: list[tuple[float, dict[str, str]]] = []

    async def frozen(msg: Msg) -> None:  # reads one request, then is gone (the queue group has one member left)
        held.append((time.monotonic(), dict(msg.headers or {})))
        await subscription.unsubscribe()

    hole = await connect_as(deployment, runtime, "query")
    subscription = await hole.subscribe(names.request_subject("query", "acme"), queue=names.query_queue, cb=frozen)
    await subscriptions_visible(hole)
    try:
        for _ in range(40):  # the queue group picks a member at random: until the frozen one has taken one
            started = time.monotonic()
            reply = await client.query("acme", {"semanticQuery": "retry a call"})
            took = time.monotonic() - started
            assert isinstance(reply, QueryResponse)
            if held:
                break
        assert held, "the frozen member never got a request"
        assert held[0][1].get(RECEIPT_HEADER) is not None
        assert RECEIPT_WAIT_S <= took < 10 * FIRST_ATTEMPT_SHARE - 1, took
    finally:
        await hole.close()


@dataclass
class _OwnServer:
    """A nats-server of the test's own, a lone member of the queue group that sends its receipt and then its
    answer (the times it read each request in ``read``), and a client that has had a receipt, so relies on them."""

    directory: Path
    port: int
    users: dict[str, NatsUser]
    server: ManagedProcess
    client: QueryClient
    caller: Any
    read: list[float]

    def signal(self, number: int) -> None:
        os.kill(self.server.process.pid, number)

    def restart(self) -> None:
        """Killed (frozen or not) and started again on the same port."""
        self.server.process.kill()
        self.server.process.wait()
        self.server = spawn_nats(self.directory, self.port, self.users)


@contextlib.asynccontextmanager
async def _own_server(tmp_path: Path) -> AsyncIterator[_OwnServer]:
    port, names = free_port(), Names("ontofabric")
    users = {role: NatsUser(role, "pw", role, names.prefix) for role in ("client", "query")}
    server = spawn_nats(tmp_path, port, users)
    caller = await connect(f"nats://client:pw@127.0.0.1:{port}", "test-caller")
    member = await connect(f"nats://query:pw@127.0.0.1:{port}", "test-member")
    read: list[float] = []

    async def take(msg: Msg) -> None:
        read.append(time.monotonic())
        await member.publish(msg.reply, b"", headers={RECEIPT_HEADER: RECEIVED})
        await member.publish(msg.reply, b'{"answer":1}')

    own = _OwnServer(tmp_path, port, users, server, QueryClient(caller, names, timeout_s=10), caller, read)
    try:
        await member.subscribe(names.request_subject("query", "acme"), queue=names.query_queue, cb=take)
        await subscriptions_visible(member)
        assert await own.client.send_raw("acme", b"{}") == b'{"answer":1}'  # receipts are relied on from now
        yield own
    finally:
        await close(caller)
        await close(member)
        own.server.stop()


async def test_a_request_is_not_sent_again_into_a_frozen_nats_server(tmp_path: Path) -> None:
    """A nats-server frozen by its host reads nothing, and nats-py still calls the connection connected: copies
    sent for want of a receipt would wait in its socket and reach the workers together when it wakes (a red team
    saw up to eight of one request). The client sends again only once the server has read the last send (a ping
    after it answered), and waits for the receipt from when the server answered."""
    async with _own_server(tmp_path) as own:
        own.signal(signal.SIGSTOP)
        try:
            asking = asyncio.create_task(own.client.send_raw("acme", b"{}"))
            await asyncio.sleep(3.5)  # three receipt waits
            assert own.caller.is_connected  # as nats-py sees it
        finally:
            own.signal(signal.SIGCONT)
        assert await asking == b'{"answer":1}'
        await asyncio.sleep(0.5)  # copies, had there been any, reach the member
        assert len(own.read) == 2, [round(t - own.read[0], 2) for t in own.read]


async def test_a_request_waiting_on_a_frozen_server_is_sent_again_once_a_new_one_has_taken_its_place(
    tmp_path: Path,
) -> None:
    """The server frozen, then killed and started again (a watchdog): the ping the request waited on is dropped
    with the connection, without a word from nats-py. The request is sent again on the new connection, rather
    than waiting out its timeout (a review's finding)."""
    async with _own_server(tmp_path) as own:
        own.signal(signal.SIGSTOP)
        started = time.monotonic()
        asking = asyncio.create_task(own.client.send_raw("acme", b"{}"))
        await asyncio.sleep(2.0)  # the request's receipt is late, and its ping unanswered
        own.restart()
        assert await asking == b'{"answer":1}'
        assert time.monotonic() - started < 6.0, time.monotonic() - started


async def test_every_failure_of_a_request_is_a_client_error_that_says_which(tmp_path: Path) -> None:
    """An application embedding the client caught exceptions of four modules (nats', pydantic's, the client's and
    builtins), and could not tell a NATS server away from a slow worker: both were nats' bare TimeoutError at the
    full timeout. Each is a ClientError now, and still the exception it was."""
    async with _own_server(tmp_path) as own:
        names = Names("ontofabric")
        with pytest.raises(RequestInvalid) as invalid:
            await own.client.query("acme", {"semanticQuery": "x", "topK": "many"})
        assert [detail.field for detail in invalid.value.details] == ["topK"]
        assert "topK" in str(invalid.value)
        assert isinstance(invalid.value, ValueError)
        with pytest.raises(NoQueryWorker) as nobody:  # no member on this workspace's subject
            await own.client.send_raw("nobody", b"{}")
        assert isinstance(nobody.value, NoRespondersError)
        assert "ontofabric.query.nobody" in str(nobody.value)

        slow_worker = await connect(f"nats://query:pw@127.0.0.1:{own.port}", "test-slow-worker")

        async def hold(msg: Msg) -> None:  # a receipt, then silence: a worker too slow for the caller
            await slow_worker.publish(msg.reply, b"", headers={RECEIPT_HEADER: RECEIVED})

        try:
            await slow_worker.subscribe(names.request_subject("query", "slow"), queue=names.query_queue, cb=hold)
            await subscriptions_visible(slow_worker)
            with pytest.raises(NoReplyInTime) as slow:
                await QueryClient(own.caller, names, timeout_s=1.5).send_raw("slow", b"{}")
        finally:
            await close(slow_worker)
        assert not isinstance(slow.value, ConnectionDown)
        assert "within 1.5 s" in str(slow.value)
        own.server.process.kill()
        own.server.process.wait()
        with pytest.raises(ConnectionDown) as away:
            await QueryClient(own.caller, names, timeout_s=1.5).send_raw("acme", b"{}")
        assert isinstance(away.value, NatsTimeoutError)
        assert isinstance(away.value, ClientError)
        assert "the connection to NATS is down" in str(away.value)


async def _member(deployment: Deployment, runtime: EmbeddedRuntime, answer: Any) -> tuple[Any, list[float]]:
    """A member of the query workers' queue group for workspace acme, run by ``answer(connection, msg, index)``
    (the how-manieth request it reads); and the times it read each."""
    names = deployment.names
    member = await connect_as(deployment, runtime, "query")
    read: list[float] = []

    async def take(msg: Msg) -> None:
        read.append(time.monotonic())
        asyncio.get_running_loop().create_task(answer(member, msg, len(read) - 1))

    await member.subscribe(names.request_subject("query", "acme"), queue=names.query_queue, cb=take)
    await subscriptions_visible(member)
    return member, read


async def _reads_after_each_request(
    deployment: Deployment, runtime: EmbeddedRuntime, answer: Any, expected: bytes, pauses_s: Sequence[float]
) -> list[int]:
    """How many requests a lone member run by ``answer`` has read after each of ``len(pauses_s)`` requests, each
    sent after its pause, over a connection of their own (nothing learned before)."""
    nc = await connect_as(deployment, runtime, "client")
    member, read = await _member(deployment, runtime, answer)
    counts: list[int] = []
    try:
        client = QueryClient(nc, deployment.names, timeout_s=10)
        for pause_s in pauses_s:
            await asyncio.sleep(pause_s)
            assert await client.send_raw("acme", b"{}") == expected
            counts.append(len(read))
        return counts
    finally:
        await member.close()
        await nc.close()


NOT_FOUND = b'{"error": {"code": "not_found", "message": "none", "retryable": false}}'


def _busy(retry_after_ms: int | None) -> bytes:
    stated = "" if retry_after_ms is None else f', "retryAfterMs": {retry_after_ms}'
    return f'{{"error": {{"code": "overloaded", "message": "busy", "retryable": true{stated}}}}}'.encode()


def _resent(reason: str) -> int:
    """How many requests the client sent again for ``reason`` (the counter query.client.resent)."""
    points = metric_points("query.client.resent")
    return sum(point.value for point in points if point.attributes.get("reason") == reason)


def test_the_retry_budget_allows_a_share_of_the_requests_on_top_of_a_few_a_second() -> None:
    budget = RetryBudget(share=0.2, min_per_s=0.5, window_s=10)  # 5 in reserve
    assert [budget.take_retry(0.0) for _ in range(6)] == [True] * 5 + [False]
    for _ in range(10):
        budget.asked(1.0)
    assert [budget.take_retry(1.0) for _ in range(3)] == [True, True, False]  # a fifth of the 10 asked
    assert not budget.take_retry(9.9)
    # The first five retries are forgotten: 2 of the 7 allowed are taken.
    assert [budget.take_retry(10.1) for _ in range(6)] == [True] * 5 + [False]
    assert [budget.take_retry(11.1) for _ in range(3)] == [False] * 3  # the 10 asked are forgotten too: 5 in all


async def _pushed_back(
    deployment: Deployment, runtime: EmbeddedRuntime, replies: Sequence[bytes], timeout_s: float, requests: int = 1
) -> tuple[list[bytes], list[list[float]]]:
    """What a client on a connection of its own gets for ``requests`` requests, one after another, to a lone member
    that answers its reads with ``replies`` in turn (the last one again and again); and when each request's reads
    came, from its send."""
    reads: list[list[float]] = []

    async def answer(member: Any, msg: Msg, index: int) -> None:
        await msg.respond(replies[min(index, len(replies) - 1)])

    nc = await connect_as(deployment, runtime, "client")
    member, read = await _member(deployment, runtime, answer)
    got: list[bytes] = []
    try:
        client = QueryClient(nc, deployment.names, timeout_s=timeout_s)
        for _ in range(requests):
            began, first = time.monotonic(), len(read)
            got.append(await client.send_raw("acme", b"{}"))
            reads.append([at - began for at in read[first:]])
        return got, reads
    finally:
        await member.close()
        await nc.close()


async def test_a_refusal_that_states_its_wait_is_waited_out_and_the_request_sent_again(
    deployment: Deployment, runtime: EmbeddedRuntime
) -> None:
    """A worker refusing ``overloaded`` with ``retryAfterMs`` expects a runner free by then: the client sends the
    request again after that wait, within the caller's time, rather than hand the refusal back at once (gRPC's
    server pushback)."""
    waited_out = _resent("waited_out")
    got, reads = await _pushed_back(deployment, runtime, [_busy(300), NOT_FOUND], timeout_s=5)
    assert got == [NOT_FOUND]
    [(first, second)] = reads
    assert 0.3 <= second - first <= 0.3 * (1 + PUSHBACK_JITTER) + 0.2
    assert _resent("waited_out") == waited_out + 1


async def test_a_refusal_whose_wait_does_not_fit_in_the_time_left_is_returned_at_once(
    deployment: Deployment, runtime: EmbeddedRuntime
) -> None:
    started = time.monotonic()
    got, reads = await _pushed_back(deployment, runtime, [_busy(1200), NOT_FOUND], timeout_s=1.5)
    assert got == [_busy(1200)]  # 0.3 s would be left: less than PUSHBACK_MIN_LEFT_S
    assert len(reads[0]) == 1
    assert time.monotonic() - started < 1.0  # not after the caller's time
    got, reads = await _pushed_back(deployment, runtime, [_busy(None), NOT_FOUND], timeout_s=5)
    assert got == [_busy(None)]  # no wait stated: nothing to wait out
    assert len(reads[0]) == 1


async def test_a_send_after_a_refusals_wait_is_sent_again_like_any_other_when_its_worker_freezes(
    deployment: Deployment, runtime: EmbeddedRuntime
) -> None:
    """A review's finding: the refusal waited out was returned as soon as the send after it went without its
    receipt, instead of that send being made again as a silent one is."""

    async def answer(member: Any, msg: Msg, index: int) -> None:
        if index == 2:  # frozen: it has the request and says nothing
            return
        await member.publish(msg.reply, b"", headers={RECEIPT_HEADER: RECEIVED})
        await member.publish(msg.reply, _busy(200) if index == 1 else NOT_FOUND)

    nc = await connect_as(deployment, runtime, "client")
    member, read = await _member(deployment, runtime, answer)
    try:
        client = QueryClient(nc, deployment.names, timeout_s=10)
        assert await client.send_raw("acme", b"{}") == NOT_FOUND  # a receipt: silence means something from now on
        began = time.monotonic()
        resent = (_resent("waited_out"), _resent("no_receipt"))
        assert await client.send_raw("acme", b"{}") == NOT_FOUND
        assert len(read) == 4
        assert (_resent("waited_out"), _resent("no_receipt")) == (resent[0] + 1, resent[1] + 1)
        assert time.monotonic() - began < 0.2 * (1 + PUSHBACK_JITTER) + RECEIPT_WAIT_S + 1.0
    finally:
        await member.close()
        await nc.close()


async def test_a_request_refused_with_a_wait_by_a_worker_that_then_stops_says_no_worker_is_serving(
    deployment: Deployment, runtime: EmbeddedRuntime
) -> None:
    """The worker that stated a wait leaves meanwhile (a restart, a scale-down) and none takes its place: the caller
    hears that no worker is serving, not the old refusal with its stale wait."""

    async def answer(member: Any, msg: Msg, index: int) -> None:
        await msg.respond(_busy(300))
        await member.drain()

    nc = await connect_as(deployment, runtime, "client")
    member, read = await _member(deployment, runtime, answer)
    try:
        client = QueryClient(nc, deployment.names, timeout_s=5)
        began = time.monotonic()
        with pytest.raises(NoRespondersError):
            await client.send_raw("acme", b"{}")
        assert len(read) == 1
        assert time.monotonic() - began < 4.0  # the wait and the no-responders retries (about 1.3 s), not the 5 s
    finally:
        await member.close()
        await nc.close()


async def test_refusals_are_not_retried_once_the_connections_retry_budget_is_spent(
    deployment: Deployment, runtime: EmbeddedRuntime
) -> None:
    """A worker that refuses everything (sustained overload) has each request sent again, up to MAX_SENDS in all,
    while the connection's budget lasts (100 retries in 10 s, and a fifth of the requests asked); then once."""
    declined = sum(point.value for point in metric_points("query.client.retries_declined"))
    got, reads = await _pushed_back(deployment, runtime, [_busy(1)], timeout_s=5, requests=20)
    assert got == [_busy(1)] * 20
    assert sum(point.value for point in metric_points("query.client.retries_declined")) > declined
    sends = [len(times) for times in reads]
    assert sends[:14] == [MAX_SENDS] * 14, sends
    assert sends[-3:] == [1, 1, 1], sends
    assert 100 <= sum(sends) - len(sends) <= 100 + 0.2 * len(sends), sends


async def test_a_worker_that_sends_no_receipts_is_not_sent_each_slow_request_again(
    deployment: Deployment, runtime: EmbeddedRuntime
) -> None:
    """Silence is taken for a frozen worker only on a connection that has had a receipt, and not for a minute after
    a reply without one (a worker of an earlier release, whose slow requests would each be sent again and again)."""

    async def old(member: Any, msg: Msg, index: int) -> None:
        await asyncio.sleep(1.6)
        await member.publish(msg.reply, NOT_FOUND)

    async def upgraded_then_old(member: Any, msg: Msg, index: int) -> None:
        if index == 0:  # the first request finds an upgraded worker
            await member.publish(msg.reply, b"", headers={RECEIPT_HEADER: RECEIVED})
            await member.publish(msg.reply, NOT_FOUND)
        else:
            await old(member, msg, index)

    assert await _reads_after_each_request(deployment, runtime, old, NOT_FOUND, [0, 0]) == [1, 2]
    # After the receipt, the old worker's first slow request is sent again once (to it: it is the only one); the
    # reply without a receipt stops that for the next.
    reads = await _reads_after_each_request(deployment, runtime, upgraded_then_old, NOT_FOUND, [0, 0, 0])
    assert reads == [1, 3, 4]


async def test_a_worker_whose_receipts_come_late_is_not_sent_each_request_again(
    deployment: Deployment, runtime: EmbeddedRuntime
) -> None:
    """A worker whose event loop runs late sends its receipts late: counted even when they come after the request
    had its answer from another attempt, they make the connection wait longer before it sends again."""

    async def late(member: Any, msg: Msg, index: int) -> None:
        if index in (1, 3):  # the second and fourth requests it reads it takes 2.5 s to read
            await asyncio.sleep(2.5)
        await member.publish(msg.reply, b"", headers={RECEIPT_HEADER: RECEIVED})
        await asyncio.sleep(0.1)
        await member.publish(msg.reply, NOT_FOUND)

    # The first request is read at once; the second's first send could not be told from a frozen worker's, and
    # its receipt came after the second send had the answer; the third is not sent again.
    reads = await _reads_after_each_request(deployment, runtime, late, NOT_FOUND, [0, 0, 2.0])
    assert reads == [1, 3, 4]


@pytest.mark.parametrize("reply", [b'{"error": "boom"}', b'{"error": {"message": "m"}}', b'{"error": {"co'])
async def test_an_error_reply_that_cannot_be_read_is_returned_as_it_came(
    deployment: Deployment, runtime: EmbeddedRuntime, reply: bytes
) -> None:
    """A review's: reading the error's code for the request's span raised on a broken reply, out of send_raw,
    where the gateway answers "the reply could not be read" for it."""
    nc = await connect_as(deployment, runtime, "client")

    async def broken(msg: Msg) -> None:
        await member.publish(msg.reply, reply)

    member = await _a_worker_that_calls(deployment, runtime, broken)
    try:
        assert await QueryClient(nc, deployment.names, timeout_s=5).send_raw("acme", b"{}") == reply
    finally:
        await member.close()
        await nc.close()


async def _a_worker_that_calls(
    deployment: Deployment, runtime: EmbeddedRuntime, take: Callable[[Msg], Awaitable[None]]
) -> Client:
    """A connection in the query workers' queue group that calls ``take`` with each query request of "acme"."""
    member = await connect_as(deployment, runtime, "query")
    names = deployment.names
    await member.subscribe(names.request_subject("query", "acme"), queue=names.query_queue, cb=take)
    await subscriptions_visible(member)
    return member


async def test_requests_waiting_when_their_connection_is_closed_end_at_once(
    deployment: Deployment, runtime: EmbeddedRuntime
) -> None:
    """A tester's application closed its connection with 100 requests waiting: they ended one by one, the last
    6.5 s later (its timeout 10 s)."""
    nc = await connect_as(deployment, runtime, "client")
    taken = 0

    async def silent(_: Msg) -> None:  # takes every request, and never answers
        nonlocal taken
        taken += 1

    member = await _a_worker_that_calls(deployment, runtime, silent)
    client = QueryClient(nc, deployment.names, timeout_s=10)
    try:
        waiting = [asyncio.create_task(client.send_raw("acme", b"{}")) for _ in range(50)]
        async with asyncio.timeout(5):
            while taken < 50:
                await asyncio.sleep(0.01)
        await nc.close()
        closed = time.monotonic()
        ended = await asyncio.gather(*waiting, return_exceptions=True)
        assert time.monotonic() - closed < 1.0
        assert all(isinstance(error, ConnectionClosedError) for error in ended), ended
    finally:
        await member.close()


async def test_a_request_nobody_listens_to_any_more_is_not_sent_again_and_again(
    deployment: Deployment, runtime: EmbeddedRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker that had the request froze and then no worker listened (each send: no responders): a few sends
    with growing pauses, then none, and the caller hears "no responders" then, not at its timeout. A review found
    the first version sending about 850 a second."""
    nc = await connect_as(deployment, runtime, "client")
    names = deployment.names
    member = await connect_as(deployment, runtime, "query")
    taken: list[int] = []

    async def answer_then_leave(msg: Msg) -> None:
        taken.append(1)
        if len(taken) == 1:  # answered, with its receipt: the connection has had one
            await member.publish(msg.reply, b"", headers={RECEIPT_HEADER: RECEIVED})
            await member.publish(msg.reply, NOT_FOUND)
        else:  # takes the request, then no worker listens
            await subscription.unsubscribe()

    subject = names.request_subject("query", "acme")
    subscription = await member.subscribe(subject, queue=names.query_queue, cb=answer_then_leave)
    await subscriptions_visible(member)
    client = QueryClient(nc, names, timeout_s=10)
    sends = 0
    publish = nc.publish

    async def counted(*args: Any, **kwargs: Any) -> None:
        nonlocal sends
        sends += 1
        await publish(*args, **kwargs)

    try:
        assert await client.send_raw("acme", b"{}") == NOT_FOUND
        monkeypatch.setattr(nc, "publish", counted)
        started = time.monotonic()
        with pytest.raises(NoRespondersError):
            await client.send_raw("acme", b"{}")
        assert time.monotonic() - started < 5
        assert sends <= 1 + 1 + 5, sends  # the one taken, the one after its silence, five after no responders
    finally:
        await member.close()
        await nc.close()
