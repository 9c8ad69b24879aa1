"""A projector killed mid-stream (SIGKILL, no goodbye) and restarted ends with the fold of the stream."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import nats.errors
import pytest
import structlog
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from nats.js.api import ConsumerInfo, PubAck
from nats.js.errors import NotFoundError

from ontofabric.contracts import DeltaEnvelope, QueryResponse
from ontofabric.services.projector.planning import Delta, plan_batch
from ontofabric.services.projector.worker import ProjectorService
from ontofabric.services.query.client import QueryClient
from ontofabric.services.query.worker import QueryService
from ontofabric.shared.jetstream import connect
from ontofabric.shared.runtime import EmbeddedRuntime, Endpoints, NatsNode, nats_url_of, start_postgres, with_login
from ontofabric.shared.settings import Settings

from .conftest import (
    Deployment,
    Key,
    RecordedProgress,
    Row,
    fold,
    open_deployment,
    projected_rows,
    with_database,
)
from .factories import delete, document, upsert

ONTOFABRIC = str(Path(sys.executable).parent / "ontofabric")


def _stream(count: int, ids: int, seed: int) -> list[DeltaEnvelope]:
    rng = random.Random(seed)
    deltas = []
    for n in range(count):
        doc_id = f"doc-{rng.randrange(ids)}"
        if rng.random() < 0.2:
            deltas.append(delete("acme", doc_id))
        else:
            deltas.append(upsert("acme", document(doc_id, f"{doc_id} revision {n} {rng.random()}")))
    return deltas


def _start_projector(deployment: Deployment, **env_extra: str) -> subprocess.Popen[bytes]:
    # The default ack wait (the test deployments use a shorter one), to measure the recovery a deployment gets.
    env = deployment.env() | {
        "ONTOFABRIC_PROJECTOR_BATCH_SIZE": "10",
        "ONTOFABRIC_LOG_LEVEL": "WARNING",
        "ONTOFABRIC_PROJECTOR_ACK_WAIT_S": str(Settings.model_fields["projector_ack_wait_s"].default),
        **env_extra,
    }
    return subprocess.Popen([ONTOFABRIC, "projector"], env=env, stdout=subprocess.DEVNULL, start_new_session=True)


async def _acked(deployment: Deployment) -> int:
    names = deployment.names
    try:
        info = await deployment.js.consumer_info(names.delta_stream, names.postgres_projector_durable)
    except NotFoundError:  # the projector process has not created its consumer yet
        return 0
    return info.ack_floor.stream_seq or 0


@pytest.mark.slow
async def test_killed_projector_restarts_to_the_fold_of_the_stream(deployment: Deployment) -> None:
    deltas = _stream(count=1500, ids=200, seed=7)
    first = _start_projector(deployment)
    try:
        acks = await deployment.publisher.publish_many(deltas)
        async with asyncio.timeout(60):
            while await _acked(deployment) < 300:
                await asyncio.sleep(0.02)
        os.killpg(first.pid, signal.SIGKILL)
        killed = time.monotonic()
        first.wait(10)
        killed_at = await _acked(deployment)
        assert killed_at < acks[-1].seq, "the projector finished before it could be killed; use a longer stream"
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)

    second = _start_projector(deployment)
    try:
        # Recovery: the deltas the killed projector had in hand come back after the ack wait (6 s), not after the
        # longest a batch may take (it was 30 s): the ack floor moves again soon after the new process is up.
        async with asyncio.timeout(60):
            while await _acked(deployment) <= killed_at:
                await asyncio.sleep(0.05)
        recovered_s = time.monotonic() - killed
        print(f"recovery: ack floor moving again {recovered_s:.1f} s after the kill")
        assert recovered_s < 15
        await deployment.wait_projected(acks[-1].seq, timeout_s=120)
    finally:
        os.killpg(second.pid, signal.SIGTERM)
        assert second.wait(30) == 0  # a clean stop on SIGTERM

    # The fold of the stream, computed independently: last writer per document in stream order.
    assert await _projected(deployment) == fold((a.seq, d) for a, d in zip(acks, deltas, strict=True))

    # And the ontologyVersion equals the one a single uninterrupted pass computes.
    whole = plan_batch([Delta(a.seq, d) for a, d in zip(acks, deltas, strict=True)], {}, {})
    version = (await deployment.fetch("SELECT state_hash, stream_seq FROM ontology_versions"))[0]
    assert version["stream_seq"] == whole.versions[("acme", "main")].stream_seq
    assert version["state_hash"] % (1 << 64) == whole.versions[("acme", "main")].state_hash


async def test_a_later_copy_waits_for_the_copy_a_killed_projector_had_in_hand(deployment: Deployment) -> None:
    """After a crash the deltas the dead process held come back only after the ack wait, behind deltas never
    delivered: a later copy of one of their events (stored again past the duplicate window) was applied first and
    took its place over the delta between them. A starting projector read what its consumer had in hand and made
    the copy wait for it; since a fault tester's lost changes it reads the stream again from the index's position
    instead, in order, without waiting out the ack wait."""
    other = await deployment.publisher.publish(upsert("acme", document("z", "zeta"), event_id="evt-zeta"))
    first = _start_projector(deployment)
    try:
        async with asyncio.timeout(60):  # in the index, and its position said there: the next holder reads on
            while await _acked(deployment) < other.seq or await _position(deployment) < other.seq:
                await asyncio.sleep(0.05)
        first_copy = upsert("acme", document("a", "first"), event_id="evt-first")
        async with deployment.session() as conn, conn.transaction():
            await conn.execute("SELECT 1 FROM ontology_versions WHERE workspace = 'acme' FOR UPDATE")
            held = await deployment.publisher.publish(first_copy)
            async with asyncio.timeout(30):  # delivered, and its write waits for the lock
                while (await _consumer(deployment)).delivered.stream_seq < held.seq:
                    await asyncio.sleep(0.05)
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(10)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    later = upsert("acme", document("a", "second"), event_id="evt-second")
    between = await deployment.publisher.publish(later)
    copy = await deployment.js.publish(
        deployment.names.delta_subject("acme", "main"),
        first_copy.model_dump_json(exclude_none=True).encode(),
        headers={"Nats-Msg-Id": "acme:evt-first:stored-again"},
    )
    second = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
    with structlog.testing.capture_logs() as logged:
        await second.start()
        try:
            await deployment.wait_projected(copy.seq, timeout_s=60)
        finally:
            await second.stop()
    # Read again for what the dead process had in hand: not merely lucky timing.
    (reading_again,) = [entry for entry in logged if entry["event"] == "projector_reads_again"]
    assert reading_again["unsettled"] >= 1
    # As the stream folds: the first copy, then the delta after it; the later copy changes nothing.
    zeta = upsert("acme", document("z", "zeta"), event_id="evt-zeta")
    assert await projected_rows(deployment) == fold([(other.seq, zeta), (held.seq, first_copy), (between.seq, later)])


async def _position(deployment: Deployment) -> int:
    """Where the index's database says it stands (infra/migrations/0027); 0 before the first look says."""
    rows = await deployment.fetch("SELECT position FROM projection_fences")
    return int(rows[0]["position"] or 0) if rows else 0


async def _consumer(deployment: Deployment) -> ConsumerInfo:
    return await deployment.js.consumer_info(deployment.names.delta_stream, deployment.names.postgres_projector_durable)


@dataclass
class Published:
    seq: int
    delta: DeltaEnvelope | None
    """None for a message that is not a delta at all."""
    poison: bool


async def _dead_lettered_sequences(deployment: Deployment) -> list[int]:
    """The original stream sequences of every dead letter (read back through a consumer of the test's own)."""
    names = deployment.names
    info = await deployment.js.stream_info(names.dlq_stream)
    found = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await deployment.js.get_msg(names.dlq_stream, seq)
        assert msg.headers is not None
        found.append(int(msg.headers["Ontofabric-Original-Sequence"]))
    return found


@pytest.mark.slow
async def test_three_kills_mid_ingest_with_poison_and_duplicates_mixed_in(deployment: Deployment) -> None:
    """The fault scenario of the overload issue for the write path: a projector killed with SIGKILL three times
    while deltas arrive, poison of several kinds and duplicates (same event id, new event id) mixed in. The oracle
    is the fold of what was published, computed here from the publisher's own record: 0 lost, 0 stale, 0 extra,
    0 wrongly dead-lettered, every poison delta dead-lettered."""
    rng = random.Random(11)
    subject = deployment.names.delta_subject("acme", "main")
    published: list[Published] = []
    deltas = _stream(count=2400, ids=300, seed=3)
    projector = _start_projector(deployment)
    recoveries: list[float] = []
    try:
        for start in range(0, len(deltas), 200):
            chunk = list(deltas[start : start + 200])
            # Duplicates: an earlier delta again with its event id (JetStream drops it) and with a new one.
            if published and rng.random() < 0.8:
                earlier = rng.choice([p.delta for p in published if p.delta is not None and not p.poison])
                assert earlier is not None
                chunk.insert(rng.randrange(len(chunk)), earlier)
                chunk.insert(rng.randrange(len(chunk)), earlier.model_copy(update={"event_id": uuid.uuid4().hex}))
            acks = await deployment.publisher.publish_many(chunk)
            for ack, delta in zip(acks, chunk, strict=True):
                if not ack.duplicate:
                    published.append(Published(ack.seq, delta, poison=False))
            # Poison of three kinds: not JSON, a vector of the wrong dimension, content past the limit.
            garbage = await deployment.js.publish(subject, b"{not json", headers={"Nats-Msg-Id": uuid.uuid4().hex})
            published.append(Published(garbage.seq, None, poison=True))
            for bad in (
                upsert("acme", document(f"doc-{rng.randrange(300)}", "bad vector", embedding=[0.1] * 8)),
                upsert(
                    "acme", document(f"doc-{rng.randrange(300)}", "x" * (deployment.settings.max_content_bytes + 1))
                ),
            ):
                ack = await deployment.publisher.publish(bad)
                published.append(Published(ack.seq, bad, poison=True))
            if start in (400, 1000, 1600):  # three kills, while deltas are still coming
                await asyncio.sleep(0.3)
                os.killpg(projector.pid, signal.SIGKILL)
                projector.wait(10)
                killed, floor = time.monotonic(), await _acked(deployment)
                projector = _start_projector(deployment)
                async with asyncio.timeout(60):
                    while await _acked(deployment) <= floor:
                        await asyncio.sleep(0.05)
                recoveries.append(time.monotonic() - killed)
        await deployment.wait_projected(max(p.seq for p in published), timeout_s=180)
    finally:
        os.killpg(projector.pid, signal.SIGTERM)
        projector.wait(30)

    stored = [(p.seq, p.delta) for p in published if not p.poison and p.delta is not None]
    lost, stale, extra = _divergence(fold(sorted(stored, key=lambda pair: pair[0])), await _projected(deployment))
    dead = await _dead_lettered_sequences(deployment)
    poison = {p.seq for p in published if p.poison}
    wrongly_dead = sorted(set(dead) - poison)
    not_dead = sorted(poison - set(dead))
    print(
        f"faults: {len(published)} deltas ({len(poison)} poison), 3 kills; recovery "
        f"{', '.join(f'{r:.1f}' for r in recoveries)} s; lost {len(lost)}, stale {len(stale)}, extra {len(extra)}, "
        f"wrongly dead-lettered {len(wrongly_dead)}, poison not dead-lettered {len(not_dead)}"
    )
    assert (lost, stale, extra, wrongly_dead, not_dead) == ([], [], [], [], [])
    assert len(dead) == len(set(dead))  # each poison delta dead-lettered once, across the kills


async def _projected(deployment: Deployment) -> dict[Key, Row]:
    return await projected_rows(deployment, "WHERE workspace = 'acme'")


def _divergence(expected: dict[Key, Row], actual: dict[Key, Row]) -> tuple[list[Key], list[Key], list[Key]]:
    """(lost, stale, extra): live documents missing or deleted; documents with another state than the fold's;
    live documents the fold does not have."""
    lost = [doc for doc, row in expected.items() if not row[0] and (doc not in actual or actual[doc][0])]
    stale = [doc for doc in expected if doc in actual and actual[doc] != expected[doc] and doc not in lost]
    extra = [doc for doc in actual if doc not in expected and not actual[doc][0]]
    return lost, stale, extra


@pytest.mark.slow
async def test_postgresql_stopped_immediately_and_restarted_mid_ingest(deployment: Deployment, tmp_path: Path) -> None:
    """PostgreSQL of the test's own, stopped the way a crash stops it (SIGQUIT: immediate shutdown, recovery from
    the WAL at the next start) while the projector works, then started again on the same port."""
    server, url = start_postgres(tmp_path / "postgres")
    port = urlsplit(url).port
    assert port is not None
    deltas = _stream(count=1500, ids=200, seed=5)
    projector = _start_projector(deployment, ONTOFABRIC_DATABASE_URL=url)
    try:
        acks = await deployment.publisher.publish_many(deltas)
        async with asyncio.timeout(60):
            while await _acked(deployment) < 300:
                await asyncio.sleep(0.02)
        server.process.send_signal(signal.SIGQUIT)
        server.process.wait(30)
        stopped = time.monotonic()
        await asyncio.sleep(2.0)  # the projector meets a database that is gone
        server, _ = start_postgres(tmp_path / "postgres", port)
        await deployment.wait_projected(acks[-1].seq, timeout_s=120)
        caught_up = time.monotonic() - stopped
    finally:
        os.killpg(projector.pid, signal.SIGTERM)
        projector.wait(30)
    try:
        conn = await asyncpg.connect(url)
        try:
            rows = await conn.fetch("SELECT id, deleted, content, stream_seq FROM documents WHERE workspace = 'acme'")
            dead = (await deployment.js.stream_info(deployment.names.dlq_stream)).state.messages
        finally:
            await conn.close()
    finally:
        server.stop()
    print(f"postgres stop: the whole stream projected {caught_up:.1f} s after the immediate stop (2 s down)")
    assert {("acme", r["id"]): (r["deleted"], r["content"], r["stream_seq"]) for r in rows} == fold(
        (a.seq, d) for a, d in zip(acks, deltas, strict=True)
    )
    assert dead == 0  # nothing was dead-lettered for an outage


@contextlib.asynccontextmanager
async def _deployment_on_own_nats(
    servers: Endpoints, directory: Path, nodes: int
) -> AsyncIterator[tuple[EmbeddedRuntime, Deployment]]:
    """A deployment on embedded nats-servers of the test's own, started by the project's runtime (one server, or
    a three-node cluster on loopback), its streams made by the project's code with one replica per server."""
    prefix = "t" + uuid.uuid4().hex[:12]
    base = Settings(nats_cluster_nodes=nodes, nats_replicas=nodes, database_url=servers.database_url)
    with EmbeddedRuntime(base, directory) as runtime:
        logins = runtime.nats_logins(prefix)
        settings = Settings(
            nats_url=with_login(nats_url_of(runtime.nats_nodes), *logins["operator"]),
            nats_replicas=nodes,
            database_url=with_database(servers.database_url, prefix),
            subject_prefix=prefix,
            embedder="none",
            data_dir=directory / "data",
        )
        async with open_deployment(settings, servers.database_url, logins) as deployment:
            yield runtime, deployment


async def _acked_through_faults(deployment: Deployment) -> int | None:
    """The projector's ack floor, or None while JetStream cannot say (its server or a leader away)."""
    try:
        return await _acked(deployment)
    except (nats.errors.Error, TimeoutError):
        return None


@dataclass
class NatsFaultRun:
    acks: list[PubAck]
    deltas: list[DeltaEnvelope]
    recoveries: list[float]
    """Seconds from each fault until the projector's ack floor moved past where it stood."""
    published_at_faults: list[int]


@dataclass
class Fault:
    inflict: Callable[[], Coroutine[None, None, None]]
    repair: Callable[[], Coroutine[None, None, None]]
    """Run beside the wait for recovery: a cluster that lost one server should go on before it is back."""


async def _project_through_nats_faults(
    deployment: Deployment, faults: list[Fault], count: int, seed: int, pause_s: float = 0.05
) -> NatsFaultRun:
    """Publish ``count`` deltas in chunks of 50, ``pause_s`` apart, while a projector subprocess works, and inflict
    each fault once a further share of them is acknowledged (the publisher and the projector both in flight); then
    wait until the whole stream is projected."""
    deltas = _stream(count=count, ids=300, seed=seed)
    acks: list[PubAck] = []

    async def publish() -> None:
        for start in range(0, len(deltas), 50):
            acks.extend(await deployment.publisher.publish_many(deltas[start : start + 50]))
            await asyncio.sleep(pause_s)

    async def acked() -> int:
        return await _acked_through_faults(deployment) or 0

    projector = _start_projector(deployment)
    publishing = asyncio.create_task(publish())
    run = NatsFaultRun(acks, deltas, [], [])
    try:
        for number, fault in enumerate(faults, start=1):
            async with asyncio.timeout(120):
                while len(acks) < count * number / (len(faults) + 1) or await acked() < 100:
                    await asyncio.sleep(0.02)
            floor = await acked()
            run.published_at_faults.append(len(acks))
            started = time.monotonic()
            await fault.inflict()
            repairing = asyncio.create_task(fault.repair())
            async with asyncio.timeout(120):
                while await acked() <= floor:
                    await asyncio.sleep(0.05)
            run.recoveries.append(time.monotonic() - started)
            await repairing
        await publishing
        async with asyncio.timeout(180):
            while await acked() < acks[-1].seq:
                await asyncio.sleep(0.1)
    finally:
        publishing.cancel()
        os.killpg(projector.pid, signal.SIGTERM)
        projector.wait(30)
    return run


async def _messages_in(deployment: Deployment, stream: str) -> int:
    """The stream's message count, asked again while its leader is still being elected after a fault."""
    async with asyncio.timeout(60):
        while True:
            try:
                return int((await deployment.js.stream_info(stream)).state.messages)
            except (nats.errors.Error, TimeoutError) as error:
                print(f"stream info of {stream} not answered yet: {error!r}")
                await asyncio.sleep(0.5)


async def _assert_thefold(deployment: Deployment, run: NatsFaultRun, label: str) -> None:
    lost, stale, extra = _divergence(
        fold((a.seq, d) for a, d in zip(run.acks, run.deltas, strict=True)), await _projected(deployment)
    )
    stored = await _messages_in(deployment, deployment.names.delta_stream)
    dead = await _messages_in(deployment, deployment.names.dlq_stream)
    print(
        f"{label}: {len(run.deltas)} deltas, stream holds {stored}; faults at "
        f"{', '.join(map(str, run.published_at_faults))} published; recovery "
        f"{', '.join(f'{r:.1f}' for r in run.recoveries)} s; lost {len(lost)}, stale {len(stale)}, "
        f"extra {len(extra)}, dead-lettered {dead}"
    )
    assert stored == len(run.deltas)  # every delta once: the publisher's retries were deduplicated
    assert (lost, stale, extra, dead) == ([], [], [], 0)


@pytest.mark.slow
async def test_nats_server_killed_and_restarted_mid_ingest(servers: Endpoints, tmp_path: Path) -> None:
    """The deployment's one nats-server killed with SIGKILL while deltas are published and projected, and started
    again a second later on its port and store: publisher and projector carry on, and the index is the fold."""
    async with _deployment_on_own_nats(servers, tmp_path, nodes=1) as (runtime, deployment):
        (node,) = runtime.nats_nodes
        run = await _project_through_nats_faults(deployment, [_lose(runtime, node)], count=2000, seed=13)
        await _assert_thefold(deployment, run, "nats-server kill")


def _lose(runtime: EmbeddedRuntime, node: NatsNode | Callable[[], Awaitable[NatsNode]]) -> Fault:
    """``node`` (or the one a call picks when the fault comes) killed with SIGKILL and started again 1 s later on
    its ports and store."""
    lost: list[NatsNode] = []

    async def inflict() -> None:
        lost.append(node if isinstance(node, NatsNode) else await node())
        _kill(lost[-1])

    async def repair() -> None:
        await asyncio.sleep(1.0)
        await asyncio.to_thread(runtime.restart_nats_node, lost[-1])

    return Fault(inflict, repair)


def _kill(node: NatsNode) -> None:
    assert node.server is not None
    node.server.process.kill()
    node.server.process.wait(10)


@pytest.mark.slow
async def test_a_three_node_cluster_loses_a_follower_then_the_stream_leader(servers: Endpoints, tmp_path: Path) -> None:
    """A three-node JetStream cluster on loopback, streams and buckets made with three replicas by the project's
    own code: one server that does not lead the delta stream is killed and restarted, then the stream's leader."""
    async with _deployment_on_own_nats(servers, tmp_path, nodes=3) as (runtime, deployment):
        names, js = deployment.names, deployment.js
        for stream in names.streams[:4]:
            assert (await js.stream_info(stream)).config.num_replicas == 3, stream

        async def leader() -> NatsNode:
            while True:
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    cluster = (await js.stream_info(names.delta_stream)).cluster
                    if cluster is not None and cluster.leader:
                        return next(node for node in runtime.nats_nodes if node.name == cluster.leader)
                await asyncio.sleep(0.1)

        async def a_follower() -> NatsNode:
            current = await leader()
            return next(node for node in runtime.nats_nodes if node is not current)

        faults = [_lose(runtime, a_follower), _lose(runtime, leader)]
        # Paced so that the publisher is still at work when the leader goes (recovering from the first loss can
        # take the projector up to ~10 s).
        run = await _project_through_nats_faults(deployment, faults, count=3000, seed=17, pause_s=0.3)
        consumer = await js.consumer_info(names.delta_stream, names.postgres_projector_durable)
        assert consumer.config.num_replicas == 3
        await _assert_thefold(deployment, run, "cluster: a follower, then the stream leader")


@pytest.mark.slow
async def test_a_query_worker_answers_again_soon_after_its_nats_server_dies(servers: Endpoints, tmp_path: Path) -> None:
    """In a three-node cluster, the server a query worker is connected to is killed: the worker reconnects to
    another from its seed list and answers again, the caller connected elsewhere all along."""
    async with _deployment_on_own_nats(servers, tmp_path, nodes=3) as (runtime, deployment):
        settings = deployment.settings
        url = nats_url_of(runtime.nats_nodes)
        projector = ProjectorService(
            settings, with_login(url, *deployment.nats_logins["projector"]), deployment.database_url
        )
        await projector.start()
        worker = QueryService(
            settings, with_login(url, *deployment.nats_logins["query"]), deployment.database_url, None
        )
        await worker.start()
        try:
            acks = await deployment.publisher.publish_many(
                [
                    upsert("acme", document(f"doc-{n}", f"compress a directory into a zip archive {n}"))
                    for n in range(20)
                ]
            )
            await deployment.wait_projected(acks[-1].seq)
            assert worker.connection is not None
            assert worker.connection.connected_url is not None
            lost = next(node for node in runtime.nats_nodes if node.port == worker.connection.connected_url.port)
            caller_node = next(node for node in runtime.nats_nodes if node is not lost)
            caller = await connect(with_login(caller_node.url, *deployment.nats_logins["client"]), "caller")
            try:
                client = QueryClient(caller, deployment.names, timeout_s=2.0)
                assert isinstance(await client.query("acme", {"semanticQuery": "zip archive"}), QueryResponse)
                _kill(lost)
                killed = time.monotonic()
                replies: Counter[str] = Counter()
                async with asyncio.timeout(60):
                    while True:
                        try:
                            reply = await client.query("acme", {"semanticQuery": "zip archive"})
                        except nats.errors.Error as error:  # no worker subscribed for a moment, or no reply
                            replies[type(error).__name__] += 1
                            continue
                        if isinstance(reply, QueryResponse):
                            break
                        replies[reply.error.code] += 1
                answering_again_s = time.monotonic() - killed
                print(f"query worker's server killed: answering again after {answering_again_s:.1f} s; {dict(replies)}")
                assert answering_again_s < 15
            finally:
                await caller.close()
                await asyncio.to_thread(runtime.restart_nats_node, lost)
        finally:
            await worker.stop()
            await projector.stop()


@pytest.mark.slow
async def test_an_agent_through_the_gateway_is_answered_while_each_cluster_node_is_lost_in_turn(
    servers: Endpoints, tmp_path: Path
) -> None:
    """The MCP gateway in its own process, given the three servers' URLs, with the official Python SDK over stdio:
    each server is killed in turn (and started again before the next); the agent's calls are answered again soon
    after each loss, whichever server the gateway, the query worker or the projector were on."""
    async with _deployment_on_own_nats(servers, tmp_path, nodes=3) as (runtime, deployment):
        settings, logins = deployment.settings, deployment.nats_logins
        url = nats_url_of(runtime.nats_nodes)
        projector = ProjectorService(settings, with_login(url, *logins["projector"]), deployment.database_url)
        await projector.start()
        worker = QueryService(settings, with_login(url, *logins["query"]), deployment.database_url, None)
        await worker.start()
        env = deployment.env() | {
            "ONTOFABRIC_NATS_URL": with_login(url, *logins["client"]),
            "ONTOFABRIC_LOG_LEVEL": "WARNING",
        }
        gateway = StdioServerParameters(command=ONTOFABRIC, args=["mcp", "--workspace", "acme"], env=env)
        try:
            acks = await deployment.publisher.publish_many(
                [
                    upsert("acme", document(f"doc-{n}", f"compress a directory into a zip archive {n}"))
                    for n in range(20)
                ]
            )
            await deployment.wait_projected(acks[-1].seq)
            async with Client(gateway) as agent:
                ask = {"semanticQuery": "zip archive", "topK": 5}
                assert (await agent.call_tool("ontology_query", ask)).is_error is False
                recoveries, refusals = [], Counter[str]()
                for node in runtime.nats_nodes:
                    _kill(node)
                    killed = time.monotonic()
                    async with asyncio.timeout(60):
                        while (answer := await agent.call_tool("ontology_query", ask)).is_error:
                            refusals[str(answer.structured_content or answer.content)[:80]] += 1
                    recoveries.append(time.monotonic() - killed)
                    assert answer.structured_content["results"], answer
                    await asyncio.to_thread(runtime.restart_nats_node, node)
            times = ", ".join(f"{s:.1f}" for s in recoveries)
            print(f"gateway: answered again {times} s after each loss; refused meanwhile: {dict(refusals)}")
            assert max(recoveries) < 15
        finally:
            await worker.stop()
            await projector.stop()


@contextlib.asynccontextmanager
async def _stopped(runtime: EmbeddedRuntime, node: NatsNode) -> AsyncIterator[Path]:
    """``node`` killed (SIGKILL) for the block, which is given its JetStream store's directory, and started again
    on it afterwards."""
    _kill(node)
    yield node.home / "jetstream"
    await asyncio.to_thread(runtime.restart_nats_node, node)


async def _refusal(deployment: Deployment) -> str:
    """The reason the projector's row gives for refusing the stream, once it gives one."""
    async with asyncio.timeout(30):
        while not (rows := await deployment.fetch("SELECT refused FROM projection_fences WHERE refused IS NOT NULL")):
            await asyncio.sleep(0.2)
    return str(rows[0]["refused"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "replaced_by",
    ["an older backup", "nothing", "an older backup under a running projector", "a new stream beside its snapshots"],
)
async def test_a_stream_store_replaced_under_the_index_is_refused_until_adopted(
    servers: Endpoints, tmp_path: Path, replaced_by: str
) -> None:
    """JetStream's store replaced under the index, by a backup taken before the index's last 20 deltas or by
    nothing (a lost disk), then written to past the index's position. Before, the projector read on from the
    index's position: the new deltas were skipped, or made no-ops by the sequence rule, without a word (a disaster
    recovery tester's, 2026-12-02). Now it applies nothing of that stream and `status` names the problem; after
    `adopt-stream` the index is refilled from the stream as it is, and ends as its fold. Under a projector running
    as the stream is written past its position, the refusal stands: a tester's ingest republished the delta at the
    index's mark (event ids derived from what is published), and the check passed again."""
    from ontofabric.services.ops.adopt import adopt_stream
    from ontofabric.services.ops.snapshots import compact
    from ontofabric.services.ops.status import NO_QUERY_WORKER, deployment_status
    from ontofabric.services.query.freshness import DeltaWatch
    from ontofabric.services.query.postgres import refused_consumers
    from ontofabric.shared.db import READER_ROLE, create_pool
    from ontofabric.shared.jetstream import ensure_jetstream
    from ontofabric.shared.placement import Placement

    async with _deployment_on_own_nats(servers, tmp_path, nodes=1) as (runtime, deployment):
        (node,) = runtime.nats_nodes
        names, backup = deployment.names, tmp_path / "backup"

        async def projecting(deltas: list[DeltaEnvelope]) -> list[PubAck]:
            service = ProjectorService(
                deployment.settings, deployment.nats_url_as("projector"), deployment.database_url
            )
            await service.start()
            try:
                acks = await deployment.publisher.publish_many(deltas)
                await deployment.wait_projected(acks[-1].seq)
                return acks
            finally:
                await service.stop()

        kept = [upsert("acme", document(f"a{n}", f"first {n}")) for n in range(20)]
        kept_acks = await projecting(kept)
        placement = Placement.of(deployment.settings, deployment.database_url)
        alone = replaced_by == "a new stream beside its snapshots"
        if alone:  # snapshots through 20, which outlive the stream
            await compact(deployment.nc, names, deployment.settings, RecordedProgress(), placement)
        async with _stopped(runtime, node) as store:
            shutil.copytree(store, backup)
        lost = [upsert("acme", document(f"a{n}", f"second {n}")) for n in range(10)]
        lost += [delete("acme", f"a{n}") for n in range(10, 15)]
        lost += [upsert("acme", document(f"b{n}", f"second {n}")) for n in range(5)]
        lost[15] = upsert("beta", document("x", "a workspace only the lost deltas held"))
        position = (await projecting(lost))[-1].seq
        assert position == 40
        if alone:
            await deployment.js.delete_stream(names.delta_stream)
        else:
            async with _stopped(runtime, node) as store:
                shutil.rmtree(store)
                if replaced_by != "nothing":
                    shutil.copytree(backup, store)
        await ensure_jetstream(deployment.js, names, deployment.settings)  # a lost store: made again, as `up` does
        before = await _projected(deployment)
        later = [upsert("acme", document(f"b{n}", f"third {n}")) for n in range(5)]
        later += [upsert("acme", document(f"c{n}", f"third {n}")) for n in range(40)]
        # The last of the lost history again, at the same sequence (40) and with the same event id.
        later[19] = lost[-1].model_copy(update={"occurred_at": later[19].occurred_at})
        service = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
        reader = await create_pool(deployment.database_url, deployment.settings, role=READER_ROLE)
        running = replaced_by == "an older backup under a running projector"
        if running:
            await service.start()
            assert "ends at sequence 20, before the 40" in await _refusal(deployment)
        later_acks = await deployment.publisher.publish_many(later)
        assert later_acks[-1].seq > position  # past what the index read: a check of sequences alone passes it
        if not running:
            await service.start()
        try:
            reason = await _refusal(deployment)
            print(replaced_by, "->", reason)
            expected = {
                "an older backup": "is not the one this index read",
                "nothing": "was made at",
                "a new stream beside its snapshots": "was made at",
                "an older backup under a running projector": "ends at sequence 20, before the 40",
            }
            assert expected[replaced_by] in reason
            await asyncio.sleep(3)  # a look or two: still nothing applied, and the same reason
            assert await _projected(deployment) == before
            assert await _refusal(deployment) == reason
            assert await _projected(deployment) == before
            status = await deployment_status(deployment.nc, names, placement)
            assert any("applies nothing" in problem and "adopt-stream" in problem for problem in status.problems)
            # Also to a status run without the deployment's partition layout (it said: a consumer is missing).
            other_layout = Placement.of(
                deployment.settings.model_copy(update={"projector_partitions": 2}), deployment.database_url
            )
            status = await deployment_status(deployment.nc, names, other_layout)
            assert any("applies nothing" in problem and "adopt-stream" in problem for problem in status.problems)
            assert not [problem for problem in status.problems if "does not exist" in problem]
            # What query workers tell every answer, from the claim rows (as their reader role reads them).
            watch = DeltaWatch(deployment.nc, names, refusals=functools.partial(refused_consumers, [reader]))
            await watch.follow_refusals()
            assert watch.stream_refused("acme")

            adopted = await adopt_stream(deployment.nc, names, placement)
            assert adopted.documents == 20  # what the index held: a0..a9, a15..a19, b1..b4, beta's x
            assert adopted.gone == ["beta"]  # to be ingested again
            assert adopted.snapshots_dropped == (20 if alone else None)  # restored, they would shadow the stream
            assert adopted.stream_last == later_acks[-1].seq
            backed_up = replaced_by in ("an older backup", "an older backup under a running projector")
            stream = [*zip(kept_acks, kept, strict=True)] if backed_up else []
            stream += zip(later_acks, later, strict=True)
            await deployment.wait_projected(later_acks[-1].seq, timeout_s=60)
            lost_docs, stale, extra = _divergence(fold((a.seq, d) for a, d in stream), await _projected(deployment))
            assert (lost_docs, stale, extra) == ([], [], [])
            assert not await deployment.fetch("SELECT refused FROM projection_fences WHERE refused IS NOT NULL")
            status = await deployment_status(deployment.nc, names, placement)
            assert status.problems == [NO_QUERY_WORKER], status.problems  # none runs in this test
            await watch.follow_refusals()
            assert not watch.stream_refused("acme")

            # And it follows the adopted stream: the next change is applied.
            ack = await deployment.publisher.publish(upsert("acme", document("c0", "fourth")))
            await deployment.wait_projected(ack.seq)
            assert (await _projected(deployment))[("acme", "c0")] == (False, "fourth", ack.seq)
        finally:
            await service.stop()
            await reader.close()
