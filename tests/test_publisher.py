"""The publishing client across a nats-server restart: every delta confirmed stored once, or reported by event id;
nothing left pending in the client. A nats-server of the test's own, killed with SIGKILL and started again on the
same port and store."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, PubAck

from ontofabric.services.ingest.client import PUBLISH_WINDOW, DeltaPublisher, PublishFailed, StreamFull
from ontofabric.services.ingest.ingester import Ingester
from ontofabric.shared.embedder import Embedder
from ontofabric.shared.jetstream import close, connect, ensure_jetstream, wait_projected
from ontofabric.shared.nats_auth import NatsUser
from ontofabric.shared.runtime import ManagedProcess, free_port
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names

from .conftest import spawn_nats
from .factories import LosesOneCancellation, document, upsert

pytestmark = pytest.mark.slow  # starts a server of its own

NAMES = Names("ontofabric")


@dataclass
class OwnNats:
    directory: Path
    port: int
    users: dict[str, NatsUser]
    server: ManagedProcess

    @property
    def url(self) -> str:
        return f"nats://op:pw@127.0.0.1:{self.port}"

    def kill(self) -> None:
        self.server.process.send_signal(signal.SIGKILL)
        self.server.process.wait(10)

    def restart(self) -> None:
        self.server = spawn_nats(self.directory, self.port, self.users)

    def freeze(self) -> None:
        """SIGSTOP, returning once the kernel says the server is stopped: the signal is delivered asynchronously,
        and a request sent at once was answered now and then in that window (a flaky run of the full suite)."""
        pid = self.server.process.pid
        os.kill(pid, signal.SIGSTOP)
        for _ in range(1000):
            with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
                threads = Path(f"/proc/{pid}/task").iterdir()
                if all((thread / "stat").read_text().rsplit(") ", 1)[1][:1] == "T" for thread in threads):
                    return
            time.sleep(0.001)
        raise AssertionError(f"nats-server {pid} did not stop")


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[OwnNats]:
    users = {"op": NatsUser("op", "pw", "operator", NAMES.prefix)}
    port = free_port()
    own = OwnNats(tmp_path, port, users, spawn_nats(tmp_path, port, users))
    try:
        yield own
    finally:
        own.server.stop()


def _pending(js: JetStreamContext) -> int:
    """Acknowledgements nats-py is still waiting for (each holds one of its 4,000 slots)."""
    return len(js._publish_async_futures)  # type: ignore[attr-defined]


async def test_a_server_killed_mid_publish_loses_nothing_and_stores_nothing_twice(own_nats: OwnNats) -> None:
    nc = await connect(own_nats.url, "publisher")
    try:
        js = nc.jetstream()
        await ensure_jetstream(js, NAMES, Settings())
        deltas = [upsert("acme", document(f"d{i}", f"text {i} " * 20)) for i in range(4000)]
        publishing = asyncio.create_task(
            DeltaPublisher(js, NAMES, ack_timeout_s=2, retry_for_s=60).publish_many(deltas)
        )
        while (await js.stream_info(NAMES.delta_stream)).state.messages < 500:
            await asyncio.sleep(0.01)
        own_nats.kill()
        await asyncio.sleep(1.0)
        own_nats.restart()
        acks = await asyncio.wait_for(publishing, 120)
        assert len(acks) == len(deltas)
        assert len({ack.seq for ack in acks}) == len(deltas)  # each its own message: none stored twice
        assert (await js.stream_info(NAMES.delta_stream)).state.messages == len(deltas)
        assert _pending(js) == 0
    finally:
        await nc.close()


async def test_what_cannot_be_confirmed_is_named_and_nothing_stays_pending(own_nats: OwnNats) -> None:
    nc = await connect(own_nats.url, "publisher")
    try:
        js = nc.jetstream()
        await ensure_jetstream(js, NAMES, Settings())
        deltas = [upsert("acme", document(f"d{i}", f"text {i} " * 20)) for i in range(3000)]
        publisher = DeltaPublisher(js, NAMES, ack_timeout_s=1, retry_for_s=3)
        confirmed: list[int] = []
        publishing = asyncio.create_task(
            publisher.publish_many(deltas, on_stored=lambda ack: confirmed.append(ack.seq))
        )
        while len(confirmed) < 300:
            await asyncio.sleep(0.01)
        own_nats.kill()  # and it stays down
        with pytest.raises(PublishFailed) as failed:
            await asyncio.wait_for(publishing, 60)
        stored, unconfirmed = failed.value.stored, failed.value.unconfirmed
        assert len(stored) >= 300
        assert [ack.seq for ack in stored] == confirmed  # each reported once, in order
        assert [d.event_id for d in deltas[len(stored) :]] == unconfirmed  # the rest, by event id, in order
        assert unconfirmed[0] in str(failed.value)
        assert _pending(js) == 0
    finally:
        with contextlib.suppress(ConnectionError):  # nats-py's close flushes into the lost connection
            await nc.close()


async def test_a_stream_that_fills_mid_window_is_said_at_once_with_what_was_stored(own_nats: OwnNats) -> None:
    """nats-py drops a publish_async acknowledgement that is an error: a full stream's refusals mid-window were
    waited out for the ack timeout, try after try, for the publisher's whole retry time (a review's finding)."""
    nc = await connect(own_nats.url, "publisher")
    try:
        js = nc.jetstream()
        await ensure_jetstream(js, NAMES, Settings(delta_stream_max_bytes=1024 * 1024))
        deltas = [upsert("acme", document(f"d{i}", "x" * 20_000)) for i in range(100)]  # 2 MB: half fits
        publisher = DeltaPublisher(js, NAMES, ack_timeout_s=3, retry_for_s=60)
        started = asyncio.get_running_loop().time()
        with pytest.raises(StreamFull) as full:
            await publisher.publish_many(deltas)
        # One ack timeout (the refusals nats-py dropped), then the next window's first delta hears it: not the
        # publisher's whole retry time.
        assert asyncio.get_running_loop().time() - started < 3 + 10
        stored = full.value.stored
        assert 10 < len(stored) < len(deltas)
        assert [d.event_id for d in deltas[len(stored) :]] == full.value.unconfirmed
        assert (await js.stream_info(NAMES.delta_stream)).state.messages >= len(stored)
        assert "the delta stream is full" in str(full.value)
        assert _pending(js) == 0
    finally:
        await nc.close()


async def test_a_wait_for_projection_outlasts_a_server_that_does_not_answer_for_a_while(own_nats: OwnNats) -> None:
    """A fault tester's ingest said it had waited out its hour after seconds of a frozen server: the JetStream
    request's timeout, asyncio's too, was taken for the wait's own."""
    nc = await connect(own_nats.url, "operator")
    try:
        js = nc.jetstream(timeout=1)
        await ensure_jetstream(js, NAMES, Settings())
        (durable,) = NAMES.postgres_projector_durables(1)
        await js.add_consumer(NAMES.delta_stream, ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT))
        ack = await DeltaPublisher(js, NAMES).publish(upsert("acme", document("a", "alpha")))
        subscription = await js.pull_subscribe_bind(durable, NAMES.delta_stream)
        (msg,) = await subscription.fetch(1)
        await msg.ack_sync()
        own_nats.freeze()
        frozen_s = 4.0
        try:
            waiting = asyncio.create_task(wait_projected(js, NAMES, 1, ack.seq, timeout_s=60))
            await asyncio.sleep(frozen_s)
            assert not waiting.done(), waiting  # before: TimeoutError, as if the 60 s had passed
        finally:
            own_nats.server.process.send_signal(signal.SIGCONT)
        await asyncio.wait_for(waiting, 30)
    finally:
        await nc.close()


async def test_a_wait_for_projection_follows_a_server_that_moved(own_nats: OwnNats, tmp_path: Path) -> None:
    """An operator tester's: `up` restarted on other ports while an ingest waited, and the wait looked at the old
    port until its timeout. ``moved`` hands it a connection to where the server is now: here a second server,
    whose projector has the delta."""

    async def projected_server(url: str) -> tuple[Client, int]:
        nc = await connect(url, "operator")
        js = nc.jetstream(timeout=1)
        await ensure_jetstream(js, NAMES, Settings())
        (durable,) = NAMES.postgres_projector_durables(1)
        await js.add_consumer(NAMES.delta_stream, ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT))
        ack = await DeltaPublisher(js, NAMES).publish(upsert("acme", document("a", "alpha")))
        (msg,) = await (await js.pull_subscribe_bind(durable, NAMES.delta_stream)).fetch(1)
        await msg.ack_sync()
        return nc, ack.seq

    old = await connect(own_nats.url, "operator")
    second_port = free_port()
    (tmp_path / "second").mkdir()
    second = spawn_nats(tmp_path / "second", second_port, own_nats.users)
    elsewhere, seq = await projected_server(f"nats://op:pw@127.0.0.1:{second_port}")
    asked: list[bool] = []

    async def moved() -> JetStreamContext | None:
        asked.append(True)
        return elsewhere.jetstream(timeout=1)

    try:
        js = old.jetstream(timeout=1)
        await ensure_jetstream(js, NAMES, Settings())  # nothing projected here
        own_nats.kill()
        await asyncio.wait_for(wait_projected(js, NAMES, 1, seq, timeout_s=60, moved=moved), 30)
        assert asked
    finally:
        await close(old)  # its server killed: nats-py's flush on closing may meet the lost connection
        await elsewhere.close()
        second.stop()
        own_nats.restart()


class FreezesAtEmbedding:
    """An ingest's progress that freezes the NATS server (SIGSTOP) when embedding begins, and thaws it
    ``frozen_s`` later: the ingest's first save of its manifest then meets a server that does not answer."""

    def __init__(self, own_nats: OwnNats, frozen_s: float) -> None:
        self._own_nats = own_nats
        self._frozen_s = frozen_s
        self.froze = False

    def stage(self, name: str, total: int) -> None:
        if name == "embed" and not self.froze:
            self.froze = True
            process = self._own_nats.server.process
            process.send_signal(signal.SIGSTOP)
            asyncio.get_running_loop().call_later(self._frozen_s, process.send_signal, signal.SIGCONT)

    def advance(self, name: str, amount: int = 1) -> None:
        return None


async def test_an_ingest_saves_its_manifest_through_a_server_that_does_not_answer_for_a_while(
    own_nats: OwnNats, tmp_path: Path, embedder: Embedder
) -> None:
    """A fault tester's: the NATS server stopped for 20 s while an ingest embedded, and the ingest ended in a
    traceback from saving its manifest (nats: timeout); publishing the deltas retried, saving did not."""
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "shapes.py").write_text("def area(r):\n    return 3.14 * r * r\n")
    nc = await connect(own_nats.url, "operator")
    try:
        js = nc.jetstream(timeout=1)
        await ensure_jetstream(js, NAMES, Settings())
        progress = FreezesAtEmbedding(own_nats, frozen_s=4.0)
        ingester = Ingester(js, NAMES, embedder, Settings().max_content_bytes, progress=progress)
        report = await asyncio.wait_for(ingester.ingest(tmp_path / "tree", "acme"), 60)
        assert progress.froze
        assert report.upserts == report.chunks == 2
        saved = await ingester.load_manifest("acme", "main")
        assert len([key for key in saved.entries if key.startswith("d:")]) == 2
        assert not saved.unknown  # the second save, after publishing, went through too
    finally:
        await nc.close()


async def test_an_interrupt_lost_in_a_publish_stops_the_deltas_after_its_window() -> None:
    """A review's: nats-py swallows a cancellation in a flush it forces (a socket backed up), and an interrupted
    ingest published on to its end. The window under way is finished; the next ones are not sent."""

    class BackedUp(LosesOneCancellation):
        published = 0

        async def publish(self, subject: str, payload: bytes, **_: object) -> PubAck:
            return await self.wait(self.stored)  # as nats-py's forced flush does

        async def stored(self) -> PubAck:
            self.published += 1
            return PubAck(stream="deltas", seq=self.published)

        async def publish_async(self, subject: str, payload: bytes, headers: dict[str, str]) -> asyncio.Future[PubAck]:
            self.published += 1
            stored: asyncio.Future[PubAck] = asyncio.get_running_loop().create_future()
            stored.set_result(PubAck(stream="deltas", seq=self.published))
            return stored

    js = BackedUp()
    deltas = [upsert("acme", document(f"d{i}", "text")) for i in range(3 * PUBLISH_WINDOW)]
    publisher = DeltaPublisher(cast(JetStreamContext, js), NAMES)
    publishing = asyncio.create_task(publisher._publish_many(deltas, None))
    await asyncio.sleep(0.05)
    publishing.cancel()
    await asyncio.wait([publishing], timeout=10)
    assert publishing.cancelled()
    assert js.published == PUBLISH_WINDOW
