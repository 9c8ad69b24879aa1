"""MCP over stdin and stdout on the event loop's own pipes.

The SDK's ``stdio_server`` reads each line and writes each message through a worker thread (anyio's file
wrapper): two thread hand-offs a call, which on a busy machine cost the gateway more than its whole NATS request
(docs/benchmarks.md, "MCP gateway"). This reads and writes the same newline-delimited JSON-RPC with asyncio's
pipe transports, and parses and serialises messages with the SDK's own types, as its transport does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator

import anyio
import mcp_types as types
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp.shared.message import SessionMessage

MAX_LINE_BYTES = 64 * 1024 * 1024
"""A request line longer than this ends the session (the SDK's own reader has no limit; a runaway needs one)."""


@contextlib.asynccontextmanager
async def stdio_streams() -> AsyncIterator[
    tuple[MemoryObjectReceiveStream[SessionMessage | Exception], MemoryObjectSendStream[SessionMessage]]
]:
    """The read and write streams of a session on this process's stdin and stdout. While it runs, ``sys.stdout``
    is the standard error, so that nothing else printed reaches the wire."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=MAX_LINE_BYTES)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(os.dup(0), "rb"))
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, os.fdopen(os.dup(1), "wb"))
    writer = asyncio.StreamWriter(transport, protocol, None, loop)
    incoming_writer, incoming = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    outgoing, outgoing_reader = anyio.create_memory_object_stream[SessionMessage](0)

    async def read() -> None:
        async with incoming_writer:
            while line := await reader.readline():
                try:
                    message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                except Exception as error:  # the session answers it with a parse error
                    await incoming_writer.send(error)
                    continue
                await incoming_writer.send(SessionMessage(message))

    async def write() -> None:
        async with outgoing_reader:
            async for session_message in outgoing_reader:
                json = session_message.message.model_dump_json(by_alias=True, exclude_unset=True)
                writer.write(json.encode() + b"\n")
                await writer.drain()

    stdout, sys.stdout = sys.stdout, sys.stderr
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(read)
            tasks.start_soon(write)
            yield incoming, outgoing
            tasks.cancel_scope.cancel()
    finally:
        sys.stdout = stdout
        transport.close()
