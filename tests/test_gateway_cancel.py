"""Which HTTP call a ``notifications/cancelled`` cancels: the gateway's middleware before a stand-in for the SDK's
stateless app (a call takes a while, a notification is accepted at once). The whole path, with a real client and a
worker that never answers: ``test_an_http_call_its_client_cancels_is_answered_at_once_and_not_sent_again`` in
tests/test_gateway.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from ontofabric.services.gateway.auth import CALLER, Grant
from ontofabric.services.gateway.server import CancelledWithClient

ALICE = Grant("0" * 64, "alice", ["acme"])
BOB = Grant("1" * 64, "bob", ["acme"])
WORK_S = 1.0


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    request = json.loads(body)
    if "id" in request:
        await asyncio.sleep(scope["work_s"])
        answer = json.dumps({"jsonrpc": "2.0", "id": request["id"], "result": {}}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": answer})
    else:
        await send({"type": "http.response.start", "status": 202, "headers": []})
        await send({"type": "http.response.body", "body": b""})


async def _post(
    gateway: CancelledWithClient,
    caller: Grant | None,
    message: dict[str, Any],
    work_s: float = WORK_S,
    gap_s: float = 0,
) -> dict[str, Any] | None:
    """The answer's JSON (None for an empty one); with ``gap_s``, the body comes in two parts that far apart."""
    body = json.dumps(message).encode()
    parts = [body] if not gap_s else [body[: len(body) // 2], body[len(body) // 2 :]]
    incoming: asyncio.Queue[Message] = asyncio.Queue()
    sent: list[Message] = []

    async def feed() -> None:
        for i, part in enumerate(parts):
            await asyncio.sleep(gap_s if i else 0)
            await incoming.put({"type": "http.request", "body": part, "more_body": i < len(parts) - 1})

    async def send(message: Message) -> None:
        sent.append(message)
        if message["type"] == "http.response.body":
            await incoming.put({"type": "http.disconnect"})  # as a server says once the answer is complete

    feeding = asyncio.ensure_future(feed())
    token = CALLER.set(caller)
    try:
        scope = {"type": "http", "method": "POST", "path": "/mcp", "work_s": work_s}
        await gateway(scope, incoming.get, send)
    finally:
        CALLER.reset(token)
        await feeding
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return json.loads(body) if body else None


def _call(request_id: int) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": {"name": "ontology_query"}}


def _cancel(request_id: int) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": request_id}}


CANCELLED = {"code": -32600, "message": "cancelled by its client"}


async def _timed(work: Any) -> tuple[Any, float]:
    loop = asyncio.get_running_loop()
    started = loop.time()
    return await work, loop.time() - started


async def test_a_call_is_cancelled_by_its_own_caller_only() -> None:
    gateway = CancelledWithClient(_app)
    call = asyncio.ensure_future(_timed(_post(gateway, ALICE, _call(1))))
    await asyncio.sleep(0.1)
    assert await _post(gateway, BOB, _cancel(1)) is None  # accepted, and bob's cancels nothing of alice's
    assert await _post(gateway, ALICE, _cancel(1)) is None
    answer, took = await call
    assert answer == {"jsonrpc": "2.0", "id": 1, "error": CANCELLED}
    assert took < WORK_S / 2
    # Without a token nobody is told apart: nothing is cancelled.
    anonymous = asyncio.ensure_future(_post(gateway, None, _call(2)))
    await asyncio.sleep(0.1)
    await _post(gateway, None, _cancel(2))
    assert (await anonymous) == {"jsonrpc": "2.0", "id": 2, "result": {}}


async def test_a_late_cancellation_spares_another_sessions_call_of_the_same_id() -> None:
    """A review's finding: two sessions on one token number their calls alike, and MCP lets a cancellation come
    after its call has ended; one session's late cancellation cancelled the other's call."""
    gateway = CancelledWithClient(_app)
    assert await _post(gateway, ALICE, _call(3), work_s=0.01) == {"jsonrpc": "2.0", "id": 3, "result": {}}
    other = asyncio.ensure_future(_post(gateway, ALICE, _call(3)))
    await asyncio.sleep(0.1)
    await _post(gateway, ALICE, _cancel(3))
    assert (await other) == {"jsonrpc": "2.0", "id": 3, "result": {}}


async def test_a_cancellation_that_comes_before_its_calls_body_is_whole_still_cancels_it() -> None:
    gateway = CancelledWithClient(_app)
    call = asyncio.ensure_future(_timed(_post(gateway, ALICE, _call(4), gap_s=0.3)))
    await asyncio.sleep(0.1)
    await _post(gateway, ALICE, _cancel(4))
    answer, took = await call
    assert answer == {"jsonrpc": "2.0", "id": 4, "error": CANCELLED}
    assert took < WORK_S
