"""MCP over stdin and stdout on the event loop's own pipes.

The SDK's ``stdio_server`` reads each line and writes each message through a worker thread (anyio's file
wrapper): two thread hand-offs a call, which on a busy machine cost the gateway more than its whole NATS request
(docs/benchmarks.md, "MCP gateway"). This reads and writes the same newline-delimited JSON-RPC with asyncio's
pipe transports, and parses and serialises messages with the SDK's own types, as its transport does.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import selectors
import stat
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import mcp_types as types
import pydantic_core
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp.shared.message import SessionMessage
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from ontofabric.contracts import MAX_REQUEST_BYTES, ErrorReply
from ontofabric.contracts.query import clipped
from ontofabric.services.query.requests import repeated_key, repeated_key_error
from ontofabric.shared.half_characters import NOT_UTF8, not_utf8
from ontofabric.shared.logging import get_logger

from .errors import StdioUnusable
from .tools import render_error

log = get_logger(__name__)

MAX_LINE_BYTES = 64 * 1024 * 1024
"""A message line longer than this is skipped whole (the SDK's own reader has no limit; a runaway needs one)."""


def _check_streamable(fd: int, name: str) -> None:
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode)):
        raise StdioUnusable(
            f"the gateway's standard {name} is a file; MCP over stdio runs on pipes, as an agent starts it "
            "(or serve HTTP with --http)"
        )


def _watchable(fd: int, events: int) -> bool:
    """Whether the event loop's selector can wait on ``fd``: epoll (and kqueue) refuse a device that is always
    ready, as /dev/null is."""
    with selectors.DefaultSelector() as selector:
        try:
            selector.register(fd, events)
        except (OSError, ValueError):
            return False
    return True


def parsed(line: bytes) -> types.JSONRPCMessage:
    """The message on a line. JSON whose strings hold a lone UTF-16 surrogate (half of a character, as a
    JavaScript client cutting an emoji makes) is read too, by Python's parser: the SDK's refuses the whole message,
    while the worker, given the arguments, names the field that is not text."""
    try:
        message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
    except ValidationError as refused:
        if not any(e["type"] == "json_invalid" for e in refused.errors()):
            raise
        try:
            found = json.loads(line)
        except (ValueError, RecursionError):
            raise refused from None
        message = types.jsonrpc_message_adapter.validate_python(found, by_name=False)
    if isinstance(message, types.JSONRPCNotification) and b'"id"' in line and _has_id(line):
        # The SDK takes a message whose id is null, a fraction, a boolean or an object for a notification, and
        # answers nothing: its caller would wait for an answer to that id for ever.
        raise ValueError(ODD_ID)
    return message


ODD_ID = "its id is neither a string nor an integer"
NOT_A_REQUEST = "not a JSON-RPC 2.0 request, notification or response"


def _has_id(line: bytes) -> bool:
    try:
        found = json.loads(line)
    except (ValueError, RecursionError):
        return False
    return isinstance(found, dict) and "id" in found


def unreadable(line: bytes | None, problem: Exception | None = None) -> types.JSONRPCError | None:
    """The JSON-RPC answer to a line that is no message the SDK reads (None: an over-long line, skipped), refused
    with ``problem``: a parse error, or an invalid request under the line's id where it has one, so that a caller
    waiting for that id hears back. A blank line is no message and gets no answer."""
    if line is not None and not line.strip():
        return None
    if line is None:
        code, message, found = types.INVALID_REQUEST, f"a message over {MAX_LINE_BYTES} bytes, skipped", None
    else:
        try:
            found = json.loads(line)
        except (ValueError, RecursionError) as error:  # RecursionError: nested deeper than Python's stack
            return not_utf8_error(line) or types.JSONRPCError(
                jsonrpc="2.0", id=None, error=types.ErrorData(code=types.PARSE_ERROR, message=f"not JSON: {error}")
            )
        code, message = types.INVALID_REQUEST, NOT_A_REQUEST
        if isinstance(problem, ValidationError) and problem.errors():
            first = problem.errors()[0]  # its location's first part is the message type tried: left out
            message += f": {'.'.join(str(part) for part in first['loc'][1:]) or 'message'}: {str(first['msg'])[:200]}"
        elif isinstance(problem, ValueError) and str(problem) == ODD_ID:
            message += f": {ODD_ID}"
    return types.JSONRPCError(jsonrpc="2.0", id=request_id_of(found), error=types.ErrorData(code=code, message=message))


TOOL_ARGUMENTS = "params.arguments."
"""Where a tool call's arguments are, as a field's path names it."""


def tool_error(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=True)


CHECKED_BYTES = 2 * MAX_REQUEST_BYTES
"""The largest message read here for a repeated key or a nesting too deep: a tool call's arguments larger than a
worker's request are refused as too large anyway, and parsing a body of megabytes again held the event loop for
tens of milliseconds (a review's)."""


def repeated_key_answer(body: bytes) -> types.JSONRPCResponse | types.JSONRPCError | None:
    """The answer to a request one of whose objects names a key twice. The SDK's parser keeps the last value, so a
    tool call's ``{"topK": 1, "topK": 50}`` was read as 50 without a word, where the worker, sent the same body,
    refuses it (a tester's). None for a message without a repeat, and for one larger than :data:`CHECKED_BYTES`."""
    if len(body) > CHECKED_BYTES:
        return None
    repeated = repeated_key(body)
    return None if repeated is None else repeat_refusal(json.loads(body), repeated)


def repeat_refusal(message: Any, repeated: str) -> types.JSONRPCResponse | types.JSONRPCError | None:
    """The answer to ``message``, which names the key at ``repeated`` twice: a tool call's argument gets the
    worker's tool error naming the argument, the rest of a request an invalid request error naming the key. None
    for what is no request (a notification is answered nothing, nor is a client's response)."""
    return _refused_at(
        message,
        repeated,
        lambda argument: render_error(ErrorReply(error=repeated_key_error(argument))),
        "given twice: a message names each key once",
    )


def _refused_at(
    message: Any, path: str, tool_text: Callable[[str], str], why: str
) -> types.JSONRPCResponse | types.JSONRPCError | None:
    """The answer to a request refused for what is at ``path``: in a tool call's arguments, a tool error (its
    ``tool_text`` of the argument's path), elsewhere an invalid request error naming the path, ``why``. None for
    what is no request (a notification is answered nothing, nor is a client's response)."""
    if not isinstance(message, dict) or "id" not in message or "method" not in message:
        return None
    request_id = request_id_of(message)
    argument = path.removeprefix(TOOL_ARGUMENTS)
    if message.get("method") == "tools/call" and argument != path and request_id is not None:
        result = tool_error(tool_text(argument)).model_dump(mode="json", by_alias=True, exclude_none=True)
        return types.JSONRPCResponse(jsonrpc="2.0", id=request_id, result=result)
    refused = types.ErrorData(
        code=types.INVALID_REQUEST, message=f"{NOT_A_REQUEST}: {clipped(path) or 'message'}: {why}"
    )
    return types.JSONRPCError(jsonrpc="2.0", id=request_id, error=refused)


NESTING_READ = 201
"""How many objects and arrays within one another a message's JSON may hold: the MCP SDK's parser (jiter) refuses
one more."""


def too_deep_answer(body: bytes) -> types.JSONRPCResponse | types.JSONRPCError | None:
    """The answer to a request nested deeper than the SDK's parser reads (:data:`NESTING_READ`), naming where:
    over HTTP the SDK answered a parse error under id null, while stdio read it with Python's parser and the worker
    named only "request" (a tester's 198 levels of ``options.retrievers``). A tool call's arguments get a tool
    error naming the argument; the rest of a request an invalid request error. None for a message within the
    depth or larger than :data:`CHECKED_BYTES`, one no parser reads (its parse error says so), and what is no
    request (a notification, a client's response)."""
    if len(body) > CHECKED_BYTES or body.count(b"[") + body.count(b"{") <= NESTING_READ:  # unparsed, as most are
        return None
    try:
        pydantic_core.from_json(body)
        return None
    except ValueError as error:
        if "recursion limit" not in str(error):
            return None
    try:
        found = json.loads(body)
    except (ValueError, RecursionError):
        return None
    too_deep = f"nested more than {NESTING_READ} levels deep"
    return _refused_at(
        found,
        ".".join(_path_too_deep(found)),
        lambda argument: f"error invalid_request: the arguments are {too_deep}\n- {clipped(argument)}: {too_deep}",
        too_deep,
    )


def _path_too_deep(value: Any) -> list[str]:
    """The keys down to an object or array nested deeper than :data:`NESTING_READ`, as far as they run through
    objects (at most :data:`PATH_KEYS`), in one pass that visits each value once (a review's: a walk measuring each
    key's depth again took 5 s over 112 kB, on the event loop)."""
    stack: list[tuple[Any, int, tuple[str, ...], bool]] = [(value, 1, (), True)]
    while stack:
        item, level, path, named = stack.pop()  # level: how many objects and arrays hold it, itself included
        if not isinstance(item, dict | list):
            continue
        if level > NESTING_READ:
            return list(path)
        if isinstance(item, dict):
            for key, child in item.items():
                below = (*path, str(key)) if named and len(path) < PATH_KEYS else path
                stack.append((child, level + 1, below, named))
        else:  # an array's items have no key: the path stops at it
            stack.extend((child, level + 1, path, False) for child in item)
    return []


PATH_KEYS = 8
"""The most keys a path too deep names."""


def not_utf8_error(body: bytes) -> types.JSONRPCError | None:
    """The answer to a JSON-RPC message whose bytes are not all UTF-8, under its id, naming the field: the SDK
    answered a parse error under id null, and its caller never heard back. None for any other body."""
    found = not_utf8(body)
    if found is None:
        return None
    message, field = found
    code = types.INVALID_PARAMS if field.startswith("params.") else types.INVALID_REQUEST
    error = types.ErrorData(code=code, message=f"{clipped(field) if field else 'a key'}: {NOT_UTF8}")
    return types.JSONRPCError(jsonrpc="2.0", id=request_id_of(message), error=error)


def checked_request(message: object) -> types.ClientRequest | str | None:
    """A request read by the SDK's own request types: the request, or what is wrong with its params, naming the
    field (``params.arguments: Input should be a valid dictionary``; the SDK answers only "Invalid request
    parameters"). None for a method the SDK does not know (it answers those itself) and for what is no request."""
    if not isinstance(message, dict) or "id" not in message or not isinstance(message.get("method"), str):
        return None
    try:
        return types.client_request_adapter.validate_python(message, by_name=False)
    except ValidationError as refused:
        by_type: dict[object, list[ErrorDetails]] = {}
        for error in refused.errors():
            by_type.setdefault(error["loc"][0], []).append(error)
        for errors in by_type.values():
            if not any(error["loc"][1:2] == ("method",) for error in errors):  # the request type of this method
                first = errors[0]
                return f"{'.'.join(str(part) for part in first['loc'][1:]) or 'params'}: {first['msg']}"
    return None


def request_id_of(message: object) -> int | str | None:
    """The id to answer a parsed JSON-RPC message under: its own when a string or an integer, else null."""
    request_id = message.get("id") if isinstance(message, dict) else None
    return request_id if isinstance(request_id, int | str) and not isinstance(request_id, bool) else None


class SessionOpening:
    """Requests the SDK's session would refuse with only "Invalid request parameters", refused here saying why:
    params that do not fit their method (naming the field), and a request of the handshake era before
    ``initialize``. The SDK sets a connection's era by its first request: one carrying the per-request protocol
    envelope (``params._meta``, 2026-07-28 on) needs no ``initialize``, and its connection is left to the SDK, as
    is any request carrying the envelope (the SDK says which era the connection serves)."""

    def __init__(self) -> None:
        self._opened = False
        """Whether ``initialize`` came, or the first request carried the envelope."""
        self._first = True

    def refusal(self, message: types.JSONRPCMessage) -> types.JSONRPCError | None:
        if not isinstance(message, types.JSONRPCRequest):
            return None
        request = message.model_dump(by_alias=True, exclude_unset=True)
        envelope = _carries_envelope(request)
        first, self._first = self._first, False
        self._opened |= first and envelope
        checked = checked_request(request)
        if isinstance(checked, str):
            return _error(message.id, types.INVALID_PARAMS, checked)
        if message.method == "initialize":
            self._opened = True
        elif not (self._opened or envelope or checked is None or isinstance(checked, _NEEDING_NO_INITIALIZE)):
            return _error(message.id, types.INVALID_REQUEST, f"{message.method} before initialize: initialize first")
        return None


def _carries_envelope(request: dict[str, Any]) -> bool:
    params = request.get("params")
    meta = params.get("_meta") if isinstance(params, dict) else None
    return isinstance(meta, dict) and types.PROTOCOL_VERSION_META_KEY in meta


_NEEDING_NO_INITIALIZE = (types.PingRequest, types.DiscoverRequest, types.SubscriptionsListenRequest)
"""A ping, and the requests of the envelope era (which the SDK answers itself on a connection of either era)."""


def _error(request_id: types.RequestId, code: int, message: str) -> types.JSONRPCError:
    return types.JSONRPCError(jsonrpc="2.0", id=request_id, error=types.ErrorData(code=code, message=message))


async def next_line(reader: asyncio.StreamReader) -> bytes | None:
    """The next line (``b""`` at the end of input); None for a line over the reader's limit, skipped whole."""
    try:
        return await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError as end:
        return end.partial
    except asyncio.LimitOverrunError:
        pass
    while True:  # drop the rest of the over-long line, a limit's worth at a time
        try:
            await reader.readuntil(b"\n")
            return None
        except asyncio.IncompleteReadError:
            return None
        except asyncio.LimitOverrunError as error:
            await reader.readexactly(max(error.consumed, 1))


@contextlib.contextmanager
def _claimed(fd: int, diversion: int) -> Iterator[int]:
    """A private duplicate of a standard descriptor for the wire, while the descriptor itself points at
    ``diversion``: nothing else in the process (a print, a library, a child) reads or writes the protocol stream.
    Afterwards the descriptor is the wire again, in blocking mode as it was handed over."""
    wire = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    os.dup2(diversion, fd)
    try:
        yield wire
    finally:
        os.dup2(wire, fd)
        os.set_blocking(fd, True)  # the event loop made the shared file description non-blocking
        os.close(wire)


@contextlib.asynccontextmanager
async def stdio_streams() -> AsyncIterator[
    tuple[MemoryObjectReceiveStream[SessionMessage | Exception], MemoryObjectSendStream[SessionMessage]]
]:
    """The read and write streams of a session on this process's stdin and stdout. While it runs, descriptor 0
    reads nothing and descriptor 1 is the standard error."""
    loop = asyncio.get_running_loop()
    _check_streamable(0, "input")
    _check_streamable(1, "output")
    nothing = os.open(os.devnull, os.O_RDONLY)
    with contextlib.ExitStack() as claims:
        claims.callback(os.close, nothing)
        wire_in, wire_out = claims.enter_context(_claimed(0, nothing)), claims.enter_context(_claimed(1, 2))
        reader = asyncio.StreamReader(limit=MAX_LINE_BYTES)
        if not _watchable(wire_out, selectors.EVENT_WRITE):
            raise StdioUnusable(
                "the gateway's standard output is a device it cannot write MCP to (/dev/null?); MCP over stdio runs "
                "on pipes, as an agent starts it (or serve HTTP with --http)"
            )
        read_transport: asyncio.ReadTransport | None = None
        if _watchable(wire_in, selectors.EVENT_READ):
            read_transport, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(os.dup(wire_in), "rb")
            )
        else:
            # /dev/null, as a service manager gives it: nothing to read, as from an empty pipe (a tester's gateway
            # logged the event loop's traceback and hung).
            reader.feed_eof()
        transport, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(os.dup(wire_out), "wb")
        )
        writer = asyncio.StreamWriter(transport, protocol, None, loop)
        incoming_writer, incoming = anyio.create_memory_object_stream[SessionMessage | Exception](0)
        outgoing, outgoing_reader = anyio.create_memory_object_stream[SessionMessage](0)
        answers = outgoing.clone()

        session = SessionOpening()

        async def read() -> None:
            async with incoming_writer, answers:
                while (line := await next_line(reader)) != b"":
                    try:
                        if line is None:
                            raise ValueError("over-long")
                        message = parsed(line)
                    except Exception as problem:  # answered here: the SDK's session logs it and answers nothing
                        answer = unreadable(line, problem)
                        if answer is not None:
                            await answers.send(SessionMessage(answer))
                        continue
                    refusal = too_deep_answer(line) or repeated_key_answer(line) or session.refusal(message)
                    if refusal is not None:
                        await answers.send(SessionMessage(refusal))
                        continue
                    await incoming_writer.send(SessionMessage(message))

        async def write() -> None:
            async with outgoing_reader:
                async for session_message in outgoing_reader:
                    json = session_message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    try:
                        writer.write(json.encode() + b"\n")
                        await writer.drain()
                    except (BrokenPipeError, ConnectionResetError):  # the client closed its end: the session is over
                        log.info("gateway_client_closed_output")
                        tasks.cancel_scope.cancel()
                        return

        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(read)
                tasks.start_soon(write)
                yield incoming, outgoing
                tasks.cancel_scope.cancel()
        finally:
            if read_transport is not None:
                read_transport.close()
            transport.close()
