"""What an HTTP gateway takes on (services/gateway/admission.py): the pure parts, and the middleware before a
stand-in for the SDK's app. The whole path, a real gateway holding its limit: tests/test_gateway.py,
``test_an_http_gateway_holding_its_limit_refuses_more_at_once_and_takes_calls_again_when_they_end``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from ontofabric.services.gateway.admission import ARRIVED, OVERLOADED, AdmitRequests, Intake, LoopLag
from ontofabric.services.gateway.link import NatsLink
from ontofabric.services.gateway.server import Gateway
from ontofabric.services.gateway.tools import TOOLS
from ontofabric.shared.subjects import Names
from ontofabric.shared.tasks import watch_lateness


def test_the_loop_is_as_late_as_its_last_look_or_later_while_the_next_is_overdue() -> None:
    lag = LoopLag(tick_s=0.05)
    assert lag.late_s(100.0) == 0.0  # never looked: nothing known
    lag.observe(0.3, 100.0)
    assert lag.late_s(100.01) == 0.3
    assert abs(lag.late_s(101.05) - 1.0) < 1e-9  # the next look, due at 100.05, has not come
    lag.observe(0.002, 101.1)
    assert lag.late_s(101.11) == 0.002  # caught up: a pause gone by refuses nothing


def test_the_intake_refuses_beyond_its_held_requests_and_while_the_loop_runs_late() -> None:
    intake = Intake(max_held=2, max_late_s=0.5)
    assert intake.refusal(0.1) is None
    intake.held = 2
    assert intake.refusal(0.1) == ("held", "this gateway holds 2 requests, its limit (ONTOFABRIC_GATEWAY_MAX_HELD)")
    intake.held = 1
    assert intake.refusal(0.7) == ("late", "this gateway's event loop runs 700 ms late")
    assert intake.retry_after_ms(0.1) == 1000
    assert intake.retry_after_ms(0.7) == 1400


async def test_a_heartbeat_held_up_by_blocking_work_reports_how_late_it_ran() -> None:
    lag = LoopLag(tick_s=0.01)
    watching = asyncio.ensure_future(watch_lateness(lag.observe, tick_s=0.01))
    await asyncio.sleep(0.05)
    loop = asyncio.get_running_loop()
    blocked_until = loop.time() + 0.2
    while loop.time() < blocked_until:  # the loop's one thread busy, as a request's parsing keeps it
        pass
    assert lag.late_s(loop.time()) >= 0.19
    await asyncio.sleep(0.05)
    assert lag.late_s(loop.time()) < 0.05
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


async def test_while_the_loop_runs_late_a_tool_call_is_a_retryable_tool_error_under_its_id() -> None:
    lag = LoopLag()
    admit = AdmitRequests(_app, Intake(max_held=100, max_late_s=0.5), lag)
    now = asyncio.get_running_loop().time()
    lag.observe(0.8, now)
    status, _, answer = await _post(admit, _call(7))
    assert status == 200
    assert answer["id"] == 7
    assert answer["result"]["isError"] is True
    text = answer["result"]["content"][0]["text"]
    assert (
        text == "error overloaded (retryable: try again in about 1600 ms): this gateway's event loop runs 800 ms late"
    )
    status, headers, answer = await _post(admit, {"jsonrpc": "2.0", "id": "p", "method": "ping"})
    assert (status, headers["retry-after"], answer["id"]) == (503, "2", "p")
    assert answer["error"]["code"] == OVERLOADED
    # A notification (a cancellation frees what the load holds) is taken, its body whole.
    notification = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 7}}
    status, _, answer = await _post(admit, notification)
    assert (status, answer["read"]) == (200, notification)


async def test_a_request_taken_is_held_while_it_runs_and_carries_its_arrival() -> None:
    intake = Intake(max_held=1, max_late_s=0.5)
    lag = LoopLag()
    release = asyncio.Event()

    async def slow(scope: Scope, receive: Receive, send: Send) -> None:
        await release.wait()
        await _app(scope, receive, send)

    admit = AdmitRequests(slow, intake, lag)
    before = asyncio.get_running_loop().time()
    first = asyncio.ensure_future(_post(admit, _call(1)))
    await asyncio.sleep(0.05)
    assert intake.held == 1
    status, _, answer = await _post(admit, _call(2))
    assert "this gateway holds 1 requests" in answer["result"]["content"][0]["text"]
    release.set()
    status, _, answer = await first
    assert status == 200
    assert before <= answer["arrived"] <= before + 0.05  # when it came, not when the app read it
    assert intake.held == 0


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
    assert text.startswith("error overloaded (retryable: try again in about 1000 ms): the call waited 12"), text
