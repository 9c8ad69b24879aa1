"""Which HTTP call a ``notifications/cancelled`` cancels: the gateway's middleware before a stand-in for the SDK's
stateless app (a call takes a while, a notification is accepted at once). The whole path, with a real client and a
worker that never answers: ``test_an_http_call_its_client_cancels_is_answered_at_once_and_not_sent_again`` in
tests/test_gateway.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
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
        outcome = (
            {"error": {"code": -32602, "message": "no"}} if request.get("params", {}).get("fail") else {"result": {}}
        )
        answer = json.dumps({"jsonrpc": "2.0", "id": request["id"], **outcome}).encode()
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
    session: str | None = None,
    answer_headers: list[tuple[bytes, bytes]] | None = None,
) -> dict[str, Any] | None:
    """The answer's JSON (None for an empty one); with ``gap_s``, the body comes in two parts that far apart.
    ``session``: the Mcp-Session-Id the request carries; ``answer_headers`` is given the answer's headers."""
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
        headers = [] if session is None else [(b"mcp-session-id", session.encode())]
        scope = {"type": "http", "method": "POST", "path": "/mcp", "work_s": work_s, "headers": headers}
        await gateway(scope, incoming.get, send)
    finally:
        CALLER.reset(token)
        await feeding
    if answer_headers is not None:
        answer_headers.extend(h for m in sent if m["type"] == "http.response.start" for h in m["headers"])
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return json.loads(body) if body else None


def _call(request_id: int) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": {"name": "ontology_query"}}


def _cancel(request_id: int) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": request_id}}


CANCELLED = {"code": -32800, "message": "cancelled by its client"}


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


CALLERS = pytest.mark.parametrize(
    ("caller", "session"), [(ALICE, None), (None, "s1"), (ALICE, "s1")], ids=["token", "session", "both"]
)


@CALLERS
async def test_a_late_cancellation_spares_another_call_of_the_same_id(
    caller: Grant | None, session: str | None
) -> None:
    """A review's finding: two sessions on one token (without session ids) number their calls alike, and MCP lets a
    cancellation come after its call has ended; one session's late cancellation cancelled the other's call."""
    gateway = CancelledWithClient(_app)
    ended = await _post(gateway, caller, _call(3), work_s=0.01, session=session)
    assert ended == {"jsonrpc": "2.0", "id": 3, "result": {}}
    other = asyncio.ensure_future(_post(gateway, caller, _call(3), session=session))
    await asyncio.sleep(0.1)
    await _post(gateway, caller, _cancel(3), session=session)
    assert (await other) == {"jsonrpc": "2.0", "id": 3, "result": {}}


@CALLERS
async def test_a_cancellation_that_comes_before_its_calls_body_is_whole_still_cancels_it(
    caller: Grant | None, session: str | None
) -> None:
    gateway = CancelledWithClient(_app)
    call = asyncio.ensure_future(_timed(_post(gateway, caller, _call(4), gap_s=0.3, session=session)))
    await asyncio.sleep(0.1)
    await _post(gateway, caller, _cancel(4), session=session)
    answer, took = await call
    assert answer == {"jsonrpc": "2.0", "id": 4, "error": CANCELLED}
    assert took < WORK_S


def _session_ids(headers: list[tuple[bytes, bytes]]) -> list[str]:
    return [value.decode() for name, value in headers if name == b"mcp-session-id"]


async def test_an_initialize_answer_names_a_new_session_and_no_other_answer_does() -> None:
    gateway = CancelledWithClient(_app)
    initialize = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {}}
    first: list[tuple[bytes, bytes]] = []
    second: list[tuple[bytes, bytes]] = []
    called: list[tuple[bytes, bytes]] = []
    await _post(gateway, None, initialize, work_s=0, answer_headers=first)
    await _post(gateway, None, initialize, work_s=0, answer_headers=second)
    await _post(gateway, None, _call(1), work_s=0, session=_session_ids(first)[0], answer_headers=called)
    assert len(_session_ids(first)) == len(_session_ids(second)) == 1
    assert _session_ids(first) != _session_ids(second)
    assert len(_session_ids(first)[0]) == 32
    assert _session_ids(called) == []
    # A tester's: an initialize the server refused (its params wrong) got a session id all the same.
    refused: list[tuple[bytes, bytes]] = []
    failing = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {"fail": True}}
    answer = await _post(gateway, None, failing, work_s=0, answer_headers=refused)
    assert "error" in (answer or {})
    assert _session_ids(refused) == []


async def test_a_session_without_a_token_cancels_its_own_call_only() -> None:
    """A TypeScript client's timeout through a gateway open on loopback cancelled nothing: without a token no
    caller was told apart. Its session id, given at initialize, tells it apart."""
    gateway = CancelledWithClient(_app)
    call = asyncio.ensure_future(_timed(_post(gateway, None, _call(5), session="one")))
    await asyncio.sleep(0.1)
    await _post(gateway, None, _cancel(5), session="two")  # another session's id 5
    await _post(gateway, None, _cancel(5))  # no session: nobody's
    await _post(gateway, ALICE, _cancel(5), session="one")  # a token's session "one" is not the open one
    assert not call.done()
    await _post(gateway, None, _cancel(5), session="one")
    answer, took = await call
    assert answer == {"jsonrpc": "2.0", "id": 5, "error": CANCELLED}
    assert took < WORK_S / 2


async def test_two_sessions_on_one_token_each_cancel_their_own_call_of_the_same_id() -> None:
    """Before sessions, two calls of one token holding the same id were both spared: neither could be cancelled."""
    gateway = CancelledWithClient(_app)
    mine = asyncio.ensure_future(_timed(_post(gateway, ALICE, _call(6), session="mine")))
    theirs = asyncio.ensure_future(_post(gateway, ALICE, _call(6), session="theirs"))
    await asyncio.sleep(0.1)
    await _post(gateway, ALICE, _cancel(6), session="mine")
    answer, took = await mine
    assert answer == {"jsonrpc": "2.0", "id": 6, "error": CANCELLED}
    assert took < WORK_S / 2
    assert (await theirs) == {"jsonrpc": "2.0", "id": 6, "result": {}}
