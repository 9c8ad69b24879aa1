"""An HTTP request's body read ahead of the ASGI app it goes on to, and handed on to it as if unread."""

from __future__ import annotations

from collections import deque

from starlette.types import Message, Receive


async def peek_body(receive: Receive, limit: int) -> tuple[deque[Message], bytes | None]:
    """The messages read (for :func:`replaying`) and the body, whole; None when it runs past ``limit`` or the client
    left before it was whole."""
    read: deque[Message] = deque()
    size, complete = 0, False
    while not complete and size <= limit:
        message = await receive()
        read.append(message)
        if message["type"] != "http.request":
            return read, None
        size += len(message.get("body", b""))
        complete = not message.get("more_body", False)
    return read, b"".join(m.get("body", b"") for m in read) if complete else None


def replaying(read: deque[Message], receive: Receive) -> Receive:
    """``receive`` that first hands back what :func:`peek_body` read."""

    async def replay() -> Message:
        return read.popleft() if read else await receive()

    return replay
