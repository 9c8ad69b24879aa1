"""The gateway's NATS connection, made when a call needs it and made again when the server it knew is gone.

An agent platform starts the gateway with the session, whether or not NATS runs yet, and keeps it for the whole
session: a gateway that exited because NATS was not there, or that kept reconnecting to a port an `ontofabric up`
left when it restarted on other ports, would be lost to the agent until the session ends. So the gateway starts
without a connection, and every call that finds none, or finds one that is closed or reconnecting, looks the server
up again (the settings, else the running `ontofabric up`): one found where it was is left to nats-py's reconnecting,
one found elsewhere is connected to at once; meanwhile calls get a retryable error saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from typing import Any

from nats.aio.client import Client

from ontofabric.shared.jetstream import PermissionDenied, refused_login
from ontofabric.shared.logging import get_logger
from ontofabric.shared.tasks import cancel_and_wait, start_held

log = get_logger(__name__)

RETRY_AFTER_S = 1.0
"""After a failed attempt to connect, calls within this long get its error at once: calls that queued behind it
would otherwise each wait out an attempt of their own."""


CONNECT_LIMIT_S = 30.0
"""The longest a look-up and connect may take before the calls that follow start another. The connect given has
its own limit (``ONTOFABRIC_NATS_CONNECT_TIMEOUT_S``); this bounds what comes after it (closing what it half made),
since every call waits for the one under way."""
CLOSE_WAIT_S = 5.0
"""At the gateway's end, how long a connect or the closes of replaced connections still under way are waited for."""


class NatsUnavailable(Exception):
    """No NATS server to send the call to now; the message says why. The caller may try again."""


class NatsRefused(NatsUnavailable):
    """The NATS server refused this gateway's credentials: trying again changes nothing until an operator mends them
    (every call still tries, so a mended deployment is found)."""


class NatsLink:
    def __init__(
        self,
        locate: Callable[[], str],
        connect: Callable[[str], Coroutine[Any, Any, Client]],
        close: Callable[[Client], Coroutine[Any, Any, None]],
    ) -> None:
        self._locate = locate
        """The server's URL now; raises (with a message for the caller) when there is none to talk to."""
        self._connect = connect
        self._close = close
        self._nc: Client | None = None
        self._url: str | None = None
        self._failed: tuple[float, type[NatsUnavailable], str] | None = None
        """When the last attempt to connect failed, and why (raised anew each time: a stored exception raised again
        would grow its traceback)."""
        self._reconnecting: asyncio.Task[Client] | None = None
        """The one look-up and connect under way, which every call that finds no connection waits for. A task of
        its own: a call whose time runs out stops waiting, and cancels nothing the others wait for (nor a connect
        half made, whose client would be left open)."""
        self._closing: set[asyncio.Task[None]] = set()
        """Closes of replaced connections under way: beside the calls, as a close can wait on a dead socket."""
        self._closed = False

    async def client(self) -> Client:
        """A connected client, or NatsUnavailable."""
        nc = self._nc
        if nc is not None and nc.is_connected:
            return nc
        if self._closed:
            raise NatsUnavailable("the gateway is stopping")
        if self._reconnecting is None or self._reconnecting.done():
            self._reconnecting = asyncio.get_running_loop().create_task(self._reconnect())
            self._reconnecting.add_done_callback(_retrieved)
        reconnecting = self._reconnecting
        try:
            return await asyncio.shield(reconnecting)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if reconnecting.cancelled() and task is not None and not task.cancelling():  # close() stopped it
                raise NatsUnavailable("the gateway is stopping") from None
            raise

    async def _reconnect(self) -> Client:
        nc = self._nc
        if nc is not None and nc.is_connected:  # connected again meanwhile
            return nc
        now = time.monotonic()
        if self._failed is not None and now - self._failed[0] < RETRY_AFTER_S:
            _, kind, why = self._failed
            raise kind(why)
        try:
            url = self._locate()
        except Exception as error:
            self._failed = (now, NatsUnavailable, str(error))
            raise NatsUnavailable(str(error)) from error
        if nc is not None and not nc.is_closed and url == self._url:  # where it was: nats-py is reconnecting to it
            if refused_login(nc.last_error):  # a user revoked, say; nats-py goes on trying, which finds a mend
                raise NatsRefused("the NATS server refused the gateway's credentials on its last try to reconnect")
            raise NatsUnavailable("NATS is not answering; reconnecting")
        if nc is not None:
            self._nc = None
            log.info("gateway_nats_replaced", reason="closed" if nc.is_closed else "server moved")
            start_held(self._close(nc), self._closing).add_done_callback(_retrieved)
        try:
            async with asyncio.timeout(CONNECT_LIMIT_S):
                self._nc = await self._connect(url)
        except Exception as error:  # unreachable, refused credentials: said to the caller, tried again next call
            kind = NatsRefused if isinstance(error, PermissionDenied) else NatsUnavailable
            self._failed = (time.monotonic(), kind, str(error))
            raise kind(str(error)) from error
        self._url, self._failed = url, None
        return self._nc

    async def close(self) -> None:
        self._closed = True  # no connect starts from now
        under_way = {task for task in (self._reconnecting,) if task is not None} | self._closing
        if under_way:
            await asyncio.wait(under_way, timeout=CLOSE_WAIT_S)
        if self._reconnecting is not None and not self._reconnecting.done():
            with contextlib.suppress(Exception):  # logged where it failed
                await cancel_and_wait(self._reconnecting)
        if self._nc is not None:
            await self._close(self._nc)
            self._nc = None


def _retrieved(task: asyncio.Task[Any]) -> None:
    """A connect's or a close's outcome read even when no call waits for it any more; an unexpected error logged
    (asyncio would only say that nobody read it)."""
    if not task.cancelled() and task.exception() is not None:
        error = task.exception()
        if not isinstance(error, NatsUnavailable):
            log.warning("gateway_nats_task_failed", error=repr(error))
