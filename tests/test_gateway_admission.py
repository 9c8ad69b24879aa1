"""What an HTTP gateway takes on (services/gateway/admission.py): the pure parts, and the middleware before a
stand-in for the SDK's app. The whole path, a real gateway holding its limit: tests/test_gateway.py,
``test_an_http_gateway_holding_its_limit_refuses_more_at_once_and_takes_calls_again_when_they_end``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.types import Message, Receive, Scope, Send

from ontofabric.services.gateway import admission
from ontofabric.services.gateway.admission import ARRIVED, AdmitRequests, Intake, LoopLag
from ontofabric.services.gateway.auth import CALLER, Grant
from ontofabric.services.gateway.link import NatsLink
from ontofabric.services.gateway.server import Gateway
from ontofabric.services.gateway.tools import TOOLS
from ontofabric.shared.subjects import Names
from ontofabric.shared.tasks import watch_lateness


def test_the_loop_counts_as_late_only_when_its_last_looks_all_found_it_late() -> None:
    lag = LoopLag(tick_s=0.05)
    assert lag.late_s(100.0) == 0.0  # never looked: nothing known
    lag.observe(1.0, 100.0)  # one pause (a collection, a large reply written)
    assert lag.late_s(100.01) == 0.0  # the requests queued behind it still have most of their time
    lag.observe(0.6, 100.7)
    lag.observe(0.7, 101.4)
    assert lag.late_s(101.41) == 0.6  # three looks late in a row: the loop has a backlog
    assert lag.late_s(103.0) == 0.6  # the next look overdue counts as late as it is, the older ones as they were
    lag.observe(0.002, 103.1)
    assert lag.late_s(103.11) == 0.002  # caught up


def test_the_intake_refuses_beyond_its_held_requests_a_callers_share_and_while_the_loop_runs_late() -> None:
    intake = Intake(max_held=4, max_late_s=0.5)
    assert intake.refusal("alice", 0.1) is None
    intake.held_by["alice"] = 2
    said = "the token of 'alice' holds 2 requests, its share of this gateway is 2"
    assert intake.refusal("alice", 0.1) == ("held", said)
    intake.held_by["alice"] = 3  # its initialize and lists, always taken, count too
    assert intake.refusal("alice", 0.1) == ("held", said.replace("holds 2", "holds 3"))
    intake.held_by["alice"] = 2
    assert intake.refusal("bob", 0.1) is None
    assert intake.refusal("", 0.1) is None  # without tokens, every caller is one
    intake.held_by[""] = 2  # callers without a token: 4 in all
    assert intake.refusal("bob", 0.1) == (
        "held",
        "this gateway holds 4 requests, its limit (ONTOFABRIC_GATEWAY_MAX_HELD)",
    )
    intake.held_by.clear()
    assert intake.refusal("bob", 0.7) == ("late", "this gateway's event loop runs 700 ms late")
    assert intake.retry_after_ms(0.1) == 1000
    assert intake.retry_after_ms(0.7) == 1400


async def test_a_heartbeat_held_up_by_blocking_work_reports_how_late_it_ran() -> None:
    looks: list[float] = []
    watching = asyncio.ensure_future(watch_lateness(lambda late_s, _: looks.append(late_s), tick_s=0.01))
    await asyncio.sleep(0.05)
    loop = asyncio.get_running_loop()
    before = len(looks)
    blocked_until = loop.time() + 0.2
    while loop.time() < blocked_until:  # the loop's one thread busy, as a request's parsing keeps it
        pass
    async with asyncio.timeout(5):
        while len(looks) == before:
            await asyncio.sleep(0)
        assert looks[before] >= 0.19  # its timer was due within a tick of the block's start
        while looks[-1] >= 0.05:  # on time again once caught up (a busy machine may take a few looks)
            await asyncio.sleep(0.01)
    watching.cancel()


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    """The SDK's app, standing in: reads the body, answers with what it read and when the request arrived."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    answer = json.dumps({"read": json.loads(body), "arrived": ARRIVED.get(None)}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": answer})


async def _post(admit: AdmitRequests, message: dict[str, Any]) -> tuple[int, dict[str, str], dict[str, Any]]:
    """The answer's status, headers and JSON, the body sent in two parts."""
    body = json.dumps(message).encode()
    parts: list[Message] = [
        {"type": "http.request", "body": body[:10], "more_body": True},
        {"type": "http.request", "body": body[10:], "more_body": False},
    ]
    sent: list[Message] = []

    async def receive() -> Message:
        return parts.pop(0) if parts else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await admit({"type": "http", "method": "POST", "path": "/mcp", "headers": []}, receive, send)
    start = sent[0]
    headers = {name.decode(): value.decode() for name, value in start.get("headers", [])}
    return start["status"], headers, json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def _call(request_id: int) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": {"name": "ontology_query"}}


def _late(lag: LoopLag, late_s: float) -> None:
    now = asyncio.get_running_loop().time()
    for _ in range(3):
        lag.observe(late_s, now)


async def test_while_the_loop_runs_late_a_tool_call_is_a_retryable_tool_error_under_its_id() -> None:
    lag = LoopLag()
    admit = AdmitRequests(_app, Intake(max_held=100, max_late_s=0.5), lag)
    _late(lag, 0.8)
    status, _, answer = await _post(admit, _call(7))
    assert status == 200
    assert answer["id"] == 7
    assert answer["result"]["isError"] is True
    text = answer["result"]["content"][0]["text"]
    assert (
        text == "error overloaded (retryable: try again in about 1600 ms): this gateway's event loop runs 800 ms late"
    )
    # Other requests are brief, and a client refused its initialize would not connect: they are taken, bodies whole.
    for request in (
        {"jsonrpc": "2.0", "id": "p", "method": "ping"},
        {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}},
        {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 7}},
        {"jsonrpc": "2.0", "id": None, "method": "tools/call"},  # an id the SDK's path answers as ill-formed
    ):
        status, _, answer = await _post(admit, request)
        assert (status, answer["read"]) == (200, request)


class SlowBody:
    """A request whose body's first part comes and the rest never does, to an app that reads twice."""

    def __init__(self, first: bytes) -> None:
        self.seen: list[Message] = []
        self._parts: list[Message] = [{"type": "http.request", "body": first, "more_body": True}]

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.seen.append(await receive())
        self.seen.append(await receive())

    async def receive(self) -> Message:
        if self._parts:
            return self._parts.pop(0)
        await asyncio.sleep(3600)  # the rest never comes
        raise AssertionError

    async def send(self, message: Message) -> None:
        raise AssertionError("nothing to answer")


async def test_a_body_that_does_not_arrive_in_time_is_read_as_its_client_gone(monkeypatch: Any) -> None:
    """A slow upload would hold its place for as long as its client likes (a reviewer's probe filled the gateway
    with two)."""
    monkeypatch.setattr(admission, "BODY_READ_S", 0.2)
    intake = Intake(max_held=10, max_late_s=0.5)
    slow = SlowBody(b'{"jsonrpc"')
    admit = AdmitRequests(slow.app, intake, LoopLag())
    scope = {"type": "http", "method": "POST", "path": "/mcp", "headers": []}
    await asyncio.wait_for(admit(scope, slow.receive, slow.send), 2)
    assert [message["type"] for message in slow.seen] == ["http.request", "http.disconnect"]
    assert intake.held == 0


@pytest.mark.parametrize("version", [b"2025-03-26", None])
async def test_a_body_read_for_a_batch_does_not_arrive_in_time_either(version: bytes | None) -> None:
    """A tester's: read for a possible batch, before admission, a body 18 bytes of 200 held its request open for
    minutes (every initialize, which names no version, and every 2025-03-26 client's request)."""
    from ontofabric.services.gateway.server import Batches

    slow = SlowBody(b'[{"jsonrpc"')
    headers = [(b"content-type", b"application/json"), (b"content-length", b"200")]
    headers += [(b"mcp-protocol-version", version)] if version is not None else []
    scope = {"type": "http", "method": "POST", "path": "/mcp", "headers": headers}
    await asyncio.wait_for(Batches(slow.app, body_read_s=0.2)(scope, slow.receive, slow.send), 2)
    assert [message["type"] for message in slow.seen] == ["http.request", "http.disconnect"]


async def test_a_request_taken_is_held_while_it_runs_and_carries_its_arrival() -> None:
    intake = Intake(max_held=1, max_late_s=0.5)
    lag = LoopLag()
    release = asyncio.Event()

    async def slow(scope: Scope, receive: Receive, send: Send) -> None:
        await release.wait()
        await _app(scope, receive, send)

    admit = AdmitRequests(slow, intake, lag)
    before = asyncio.get_running_loop().time()
    alice = CALLER.set(Grant("0" * 64, "alice", ["acme"]))
    try:
        first = asyncio.ensure_future(_post(admit, _call(1)))
        await asyncio.sleep(0.05)
        assert (intake.held, intake.held_by["alice"]) == (1, 1)
        status, _, answer = await _post(admit, _call(2))
    finally:
        CALLER.reset(alice)
    assert "this gateway holds 1 requests" in answer["result"]["content"][0]["text"]
    release.set()
    status, _, answer = await first
    assert status == 200
    assert before <= answer["arrived"] <= before + 0.05  # when it came, not when the app read it
    assert (intake.held, dict(intake.held_by)) == (0, {})


async def test_a_call_read_after_half_its_time_is_refused_without_asking_a_worker() -> None:
    async def never(_: object) -> Any:
        raise AssertionError("no call goes to NATS")

    gateway = Gateway(NatsLink(lambda: "nats://unused", never, never), Names(), "acme", 2.0)
    query = next(tool for tool in TOOLS if tool.operation == "query")
    arrived = ARRIVED.set(asyncio.get_running_loop().time() - 1.2)
    try:
        refused = await gateway.call(query, {"semanticQuery": "x"})
    finally:
        ARRIVED.reset(arrived)
    assert refused.is_error is True
    text = refused.content[0].text  # type: ignore[union-attr]
    # Come back once what held it has been read: about as long as it waited, at most a call's time.
    assert text.startswith("error overloaded (retryable: try again in about 12"), text
    assert "ms): the call waited 12" in text
    arrived = ARRIVED.set(asyncio.get_running_loop().time() - 30)
    try:
        stalled = await gateway.call(query, {"semanticQuery": "x"})
    finally:
        ARRIVED.reset(arrived)
    assert stalled.content[0].text.startswith("error overloaded (retryable: try again in about 2000 ms)")  # type: ignore[union-attr]


async def test_a_request_read_before_admission_counts_from_its_arrival_and_a_failing_message_is_its_own() -> None:
    """A review's: read for a possible batch, a body's upload time was left out of its call's; and one message
    raising left the others running with nobody to cancel them."""
    from ontofabric.services.gateway.server import Batches

    arrived: list[float] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        arrived.append(ARRIVED.get())
        message = json.loads((await receive())["body"])
        if message["method"] == "boom":
            raise RuntimeError("boom")
        body = json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": {}}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    batch = json.dumps([{"jsonrpc": "2.0", "id": 1, "method": "boom"}, {"jsonrpc": "2.0", "id": 2, "method": "ping"}])
    parts: list[Message] = [
        {"type": "http.request", "body": batch[:10].encode(), "more_body": True},
        {"type": "http.request", "body": batch[10:].encode(), "more_body": False},
    ]

    async def receive() -> Message:
        if parts:
            if len(parts) == 1:
                await asyncio.sleep(0.3)  # the rest of the body comes late
            return parts.pop(0)
        await asyncio.sleep(3600)
        raise AssertionError

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/mcp", "headers": [(b"content-type", b"application/json")]}
    started = asyncio.get_running_loop().time()
    admit = AdmitRequests(app, Intake(max_held=10, max_late_s=5.0), LoopLag())
    await asyncio.wait_for(Batches(admit)(scope, receive, send), 5)
    assert len(arrived) == 2
    assert all(at - started < 0.1 for at in arrived)  # from when the request came, not when its body was whole
    answers = json.loads(sent[-1]["body"])
    assert answers[0]["id"] == 1
    assert answers[0]["error"]["code"] == -32603
    assert answers[1] == {"jsonrpc": "2.0", "id": 2, "result": {}}
