"""The gateway's NATS link against real nats-servers: it starts without a server, connects when one is there, and
follows a server that moved (an `ontofabric up` restarted on other ports) instead of reconnecting for ever to the
one it knew."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest
import structlog

from ontofabric.services.gateway.link import RETRY_AFTER_S, NatsLink, NatsRefused, NatsUnavailable
from ontofabric.shared.jetstream import close, connect
from ontofabric.shared.nats_auth import NatsUser, render_config
from ontofabric.shared.runtime import free_port
from ontofabric.shared.settings import Settings

from .conftest import metric_points, spawn_nats

USERS = {"op": NatsUser("op", "pw", "operator", "ontofabric")}


def _url(port: int) -> str:
    return f"nats://op:pw@127.0.0.1:{port}"


async def test_the_link_waits_for_a_server_and_follows_it_when_it_moves(tmp_path: Path) -> None:
    settings = Settings(nats_connect_timeout_s=1.0)
    first_port, second_port = free_port(), free_port()
    where = {"url": _url(first_port)}
    link = NatsLink(lambda: where["url"], lambda url: connect(url, "test-link", settings), close)
    with pytest.raises(NatsUnavailable, match="no NATS server answered"):
        await link.client()  # nothing runs yet: said, not waited for
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    first = spawn_nats(tmp_path / "first", first_port, USERS)
    try:
        with pytest.raises(NatsUnavailable, match="no NATS server answered"):
            await link.client()  # right after a failed attempt: its error, at once, not another attempt
        await asyncio.sleep(RETRY_AFTER_S)
        nc = await link.client()
        assert nc.connected_url is not None
        assert nc.connected_url.port == first_port
        assert await link.client() is nc
    finally:
        first.stop()
    async with asyncio.timeout(10):
        while nc.is_connected:  # until the client has noticed
            await asyncio.sleep(0.02)
    with pytest.raises(NatsUnavailable, match="reconnecting"):
        await link.client()  # the server is still recorded where it was: nats-py may get it back
    second = spawn_nats(tmp_path / "second", second_port, USERS)
    try:
        where["url"] = _url(second_port)
        moved = await link.client()  # recorded elsewhere now: the next call connects there, without a wait
        assert moved.connected_url is not None
        assert moved.connected_url.port == second_port
        assert nc.is_closed  # the old one is closed, not left reconnecting
    finally:
        await link.close()
        second.stop()


async def test_refused_credentials_are_told_apart_from_an_unreachable_server(tmp_path: Path) -> None:
    # An agent told "retryable" tries again, which changes nothing while the gateway's credentials are wrong.
    port = free_port()
    server = spawn_nats(tmp_path, port, USERS)
    try:
        link = NatsLink(lambda: f"nats://op:wrong@127.0.0.1:{port}", lambda url: connect(url, "test-link"), close)
        with pytest.raises(NatsRefused, match="refused these credentials"):
            await link.client()
        with pytest.raises(NatsRefused, match="refused these credentials"):
            await link.client()  # the same error within RETRY_AFTER_S, without another attempt
        await link.close()
    finally:
        server.stop()


async def test_a_login_revoked_while_connected_is_refused_not_retryable_until_it_is_mended(tmp_path: Path) -> None:
    """nats-py retries a revoked login for ever; calls were told "unavailable, retryable" meanwhile, and an agent
    retried what only an operator can mend (an earlier stop's note)."""
    port = free_port()
    users = {**USERS, "gw": NatsUser("gw", "gwpw", "client", "ontofabric")}
    server = spawn_nats(tmp_path, port, users)
    config = tmp_path / "nats.conf"
    link = NatsLink(lambda: f"nats://gw:gwpw@127.0.0.1:{port}", lambda url: connect(url, "test-link"), close)
    try:
        nc = await link.client()
        written = config.read_text()
        config.write_text(render_config("127.0.0.1", port, str(tmp_path / "js"), USERS))  # gw revoked
        server.process.send_signal(signal.SIGHUP)
        async with asyncio.timeout(10):
            while True:
                try:
                    await link.client()
                except NatsRefused:
                    break
                except NatsUnavailable:  # disconnected, not yet refused a login
                    pass
                await asyncio.sleep(0.05)
        with pytest.raises(NatsRefused, match="refused the gateway's credentials"):
            await link.client()
        assert not nc.is_closed  # nats-py goes on trying, so the mend below is found
        config.write_text(written)
        server.process.send_signal(signal.SIGHUP)
        async with asyncio.timeout(10):
            while True:
                try:
                    assert await link.client() is nc
                    break
                except NatsUnavailable:
                    await asyncio.sleep(0.1)
    finally:
        await link.close()
        server.stop()


async def test_a_closed_connection_is_replaced_on_the_next_call(tmp_path: Path) -> None:
    port = free_port()
    server = spawn_nats(tmp_path, port, USERS)
    try:
        link = NatsLink(lambda: _url(port), lambda url: connect(url, "test-link"), close)
        nc = await link.client()
        await nc.close()  # as the server ending it over a protocol error leaves it
        again = await link.client()
        assert again is not nc
        assert again.is_connected
        await link.close()
    finally:
        server.stop()


async def test_a_replaced_connection_whose_close_does_not_return_holds_no_call_up() -> None:
    """Closing a connection to a server that is gone can wait on its socket; calls wait for the link's lock, so the
    old connection is closed in the background while the new one is made."""

    class Gone:
        is_connected = False
        is_closed = False

    class Here:
        is_connected = True
        is_closed = False

    where = {"url": "nats://first"}
    closes_begun: list[object] = []

    async def open_connection(url: str) -> Any:
        return Gone() if url == "nats://first" else Here()

    async def close_never(nc: object) -> None:
        closes_begun.append(nc)
        await asyncio.Event().wait()

    link = NatsLink(lambda: where["url"], open_connection, close_never)
    gone = await link.client()
    where["url"] = "nats://second"  # the server moved: the next call replaces the connection
    here = await asyncio.wait_for(link.client(), 2)
    assert isinstance(here, Here)
    assert closes_begun == [gone]


async def test_a_call_that_stops_waiting_cancels_no_connect_the_others_wait_for() -> None:
    """A call's time runs out while the connection is being made: it stops waiting, and the connect goes on for
    the calls behind it (cancelled, it was started again from scratch, and the client it had half made was left
    open)."""

    class Here:
        is_connected = True
        is_closed = False

    release = asyncio.Event()
    connects: list[str] = []

    async def slow_connect(url: str) -> Any:
        connects.append(url)
        await release.wait()
        return Here()

    async def close(nc: object) -> None:
        pass

    link = NatsLink(lambda: "nats://here", slow_connect, close)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(link.client(), 0.1)  # the first call's time runs out
    second = asyncio.create_task(link.client())
    await asyncio.sleep(0.05)
    release.set()
    assert isinstance(await asyncio.wait_for(second, 2), Here)
    assert connects == ["nats://here"]


async def test_a_call_waiting_for_a_connect_when_the_gateway_stops_hears_so() -> None:
    """close() gives a connect under way CLOSE_WAIT_S, then stops it: a call waiting for it is told the gateway is
    stopping (it got the connect's CancelledError), and no connect starts after."""

    async def hangs(_: object) -> Any:
        await asyncio.Event().wait()

    link = NatsLink(lambda: "nats://here", hangs, hangs)
    waiting = asyncio.create_task(link.client())
    await asyncio.sleep(0.05)
    with patch("ontofabric.services.gateway.link.CLOSE_WAIT_S", 0.1):
        await link.close()
    with pytest.raises(NatsUnavailable, match="stopping"):
        await waiting
    with pytest.raises(NatsUnavailable, match="stopping"):
        await link.client()


async def test_a_server_gone_for_a_while_is_logged_once_not_at_every_reconnect_attempt(tmp_path: Path) -> None:
    """A tester's: an idle gateway logged a `nats_error` line about once a second while its server was gone."""
    port = free_port()
    server = spawn_nats(tmp_path, port, USERS)
    nc = await connect(_url(port), "test-outage", Settings(nats_connect_timeout_s=2.0))
    try:
        with structlog.testing.capture_logs() as logged:
            server.stop()
            await asyncio.sleep(5)  # about four reconnect attempts, each refused alike
            server = spawn_nats(tmp_path, port, USERS)
            async with asyncio.timeout(15):
                while not nc.is_connected:
                    await asyncio.sleep(0.05)
        said = [entry["error"] for entry in logged if entry["event"] == "nats_error"]
        assert len(said) == len(set(said)), said  # the dropped connection's error, then the refusal once
        back = [entry for entry in logged if entry["event"] == "nats_reconnected"]
        assert back
        assert back[0]["errors_not_logged"] >= 2
    finally:
        await close(nc)
        server.stop()


async def test_a_connection_says_in_a_gauge_whether_it_is_up(tmp_path: Path) -> None:
    """An outage of a NATS server run as a service of its own raised no alert: the lag series are read from NATS and
    go away with it, and no query reaches a worker to fail. ``nats.connected`` is what the alert reads."""

    def connected(name: str) -> list[int]:
        return [p.value for p in metric_points("nats.connected") if p.attributes == {"client": name}]

    port = free_port()
    server = spawn_nats(tmp_path, port, USERS)
    nc = await connect(_url(port), "test-gauge", Settings(nats_connect_timeout_s=2.0))
    try:
        assert connected("test-gauge") == [1]
        server.stop()
        async with asyncio.timeout(15):
            while nc.is_connected:
                await asyncio.sleep(0.05)
        assert connected("test-gauge") == [0]
        server = spawn_nats(tmp_path, port, USERS)
        async with asyncio.timeout(15):
            while not nc.is_connected:
                await asyncio.sleep(0.05)
        assert connected("test-gauge") == [1]
    finally:
        await close(nc)
        server.stop()
    assert connected("test-gauge") == []  # closed by its process: no loss to report
