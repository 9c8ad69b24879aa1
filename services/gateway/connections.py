"""The HTTP gateway's connections, bounded before any request is read: a connection must send a request's headers
within HEADERS_READ_S, and the gateway holds at most half its file descriptors' worth of connections.

Neither is uvicorn's: its keep-alive timeout starts only after a response, and its ``limit_concurrency`` answers 503
once a request's headers are read. A fault tester's connections that sent half a header and then nothing held their
descriptors for good, without a token: at the process's limit the gateway accepted no connection at all, an
authorised ``ping`` went unanswered, and the log filled with ``accept()`` errors."""

from __future__ import annotations

import asyncio
import resource
from typing import ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

from ontofabric.shared.logging import get_logger

log = get_logger(__name__)

HEADERS_READ_S = 10.0
"""How long a connection may take to send a request's headers, from its start or its request's first byte (the
body's own limit is admission's BODY_READ_S)."""


DESCRIPTORS_WANTED = 65536


def connection_limit() -> int:
    """Half the process's file descriptors, once their soft limit is raised as far as the hard one allows (up to
    DESCRIPTORS_WANTED: a common soft limit of 1,024 would hold a team's gateway to 512 connections); the other
    half stays for NATS, logs and what the libraries open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = DESCRIPTORS_WANTED if hard == resource.RLIM_INFINITY else min(hard, DESCRIPTORS_WANTED)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass  # kept as it is
    return 4096 if soft == resource.RLIM_INFINITY else max(16, soft // 2)


class BoundedConnections(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, with a deadline for each request's headers and a bound on open connections
    (a connection past it is closed as it comes)."""

    limit: ClassVar[int] = 512
    """Set by the gateway as it starts (:func:`connection_limit`)."""
    headers_read_s: ClassVar[float] = HEADERS_READ_S

    _refused = False
    _headers_due: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limit:
            self._refused = True
            log.warning("gateway_connections_full", limit=self.limit)
            transport.abort()
            return
        super().connection_made(transport)
        self._expect_headers()

    def data_received(self, data: bytes) -> None:
        if self._waiting_for_headers():
            self._expect_headers()
        super().data_received(data)
        if not self._waiting_for_headers():
            self._headers_read()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._headers_read()
        super().connection_lost(exc)

    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _expect_headers(self) -> None:
        if self._headers_due is None:
            self._headers_due = self.loop.call_later(self.headers_read_s, self._headers_late)

    def _headers_read(self) -> None:
        if self._headers_due is not None:
            self._headers_due.cancel()
            self._headers_due = None

    def _headers_late(self) -> None:
        self._headers_due = None
        if self._waiting_for_headers() and not self.transport.is_closing():
            log.info("gateway_connection_closed", reason=f"no request headers within {self.headers_read_s:g} s")
            self.transport.close()
