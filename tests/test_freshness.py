"""How far an answer is behind the stream (services/query/freshness.py, DeltaWatch), on a real nats-server: the
deltas the stream republishes as they are stored, counted past an answer's position."""

from __future__ import annotations

import asyncio
import time

from ontofabric.services.projector.worker import ProjectorService
from ontofabric.services.query.freshness import FORGET_AFTER_S, DeltaWatch, age_ms
from ontofabric.shared.runtime import EmbeddedRuntime

from .conftest import Deployment, connect_as
from .factories import document, upsert


async def _published(deployment: Deployment, watch: DeltaWatch, count: int) -> list[int]:
    seqs = [(await deployment.publisher.publish(upsert("acme", document(f"d{n}", "text")))).seq for n in range(count)]
    async with asyncio.timeout(10):
        while watch._last_seen < seqs[-1]:
            await asyncio.sleep(0.01)
    return seqs


async def test_an_answer_working_from_an_older_position_counts_what_was_published_past_it(
    deployment: Deployment,
) -> None:
    """A red team's finding: what the position before the last passed was forgotten, so an answer that had read its
    position two reads before (100 ms: one with a reranker, or a shared one) was told 0 pending."""
    watch = DeltaWatch(deployment.nc, deployment.names)
    await watch.start()
    try:
        seqs = await _published(deployment, watch, 3)
        start = time.monotonic()
        for step, floor in enumerate(seqs):  # three positions read, 50 ms apart
            watch._advance(floor, start + 0.05 * step)
        pending = await watch.pending("acme", ["main"], seqs[0])
        assert pending is not None
        assert pending.deltas == 2
        # A minute on, what those positions passed is forgotten: one that old is counted by JetStream, as rightly.
        watch._advance(seqs[-1], start + FORGET_AFTER_S + 1)
        assert watch._forgotten_to == seqs[-1]
        exact = await watch.pending("acme", ["main"], seqs[0])
        assert exact is not None
        assert exact.deltas == 2
    finally:
        await watch.stop()


async def test_deltas_stored_while_the_watch_was_away_are_counted(deployment: Deployment) -> None:
    """A red team's finding: deltas published while a worker's connection was down were never counted, and its
    answers said nothing was pending until the projector passed them."""
    watch = DeltaWatch(deployment.nc, deployment.names)
    await watch.start()
    try:
        (first,) = await _published(deployment, watch, 1)
        assert watch._subscription is not None
        await watch._subscription.unsubscribe()  # away: a connection lost, as the server sees it
        for n in range(2):
            await deployment.publisher.publish(upsert("acme", document(f"gap{n}", "text")))
        watch._subscription = await deployment.nc.subscribe(deployment.names.published_subjects, cb=watch._seen)
        await _published(deployment, watch, 1)  # back: the next one shows the gap
        pending = await watch.pending("acme", ["main"], first)
        assert pending is not None
        assert pending.deltas == 3
    finally:
        await watch.stop()


async def test_a_worker_configured_with_another_layout_reads_the_running_projectors_position(
    deployment: Deployment, projector: ProjectorService, runtime: EmbeddedRuntime
) -> None:
    """A red team's finding: a query worker whose ONTOFABRIC_PROJECTOR_PARTITIONS differed from the projectors' read
    the position of consumers no projector moved, and its answers claimed hundreds of deltas pending that were in the
    index. Here the worker (the query role's own login) is set to 2 partitions, the one projector runs 1."""
    nc = await connect_as(deployment, runtime, "query")
    watch = DeltaWatch(nc, deployment.names, partitions=2)
    await watch.start()
    try:
        seqs = await _published(deployment, watch, 3)
        await deployment.wait_projected(seqs[-1])
        async with asyncio.timeout(5):  # the first discovery, in the background
            while 1 not in watch._layouts:
                await asyncio.sleep(0.05)
        position = await watch.position()
        assert position is not None
        assert position >= seqs[-1]
        pending = await watch.pending("acme", ["main"], position)
        assert pending is not None
        assert pending.deltas == 0
    finally:
        await watch.stop()
        await nc.close()


def test_an_age_read_by_a_clock_behind_the_servers_is_not_negative() -> None:
    """A clock tester's worker 300 s behind its NATS server said a delta had been pending for -282,729.6 ms."""
    assert age_ms(time.time() + 300) == 0.0
    assert 1_900 <= age_ms(time.time() - 2) <= 2_500


async def test_a_refused_stream_is_said_for_the_workspaces_of_the_refused_partitions_only(
    deployment: Deployment, runtime: EmbeddedRuntime
) -> None:
    """A review's: every workspace's answers said the index had stopped following, also those whose partition's
    projector follows it. Two projectors of a 2-partition layout announce over real NATS, one refusing its
    partition; a query worker (its own login) tells the workspaces apart, and stops saying it once the refusing one
    says no more."""
    from ontofabric.shared.discovery import REFUSED, announce
    from ontofabric.shared.subjects import encode_token, partition_of_token

    names = deployment.names
    following = {"index": "postgres", "partitions": "0 of 2"}
    refusing = {"index": "postgres", "partitions": "1 of 2", REFUSED: "1"}
    projectors = await connect_as(deployment, runtime, "projector")
    announcements = [
        await announce(projectors, names.projector_service, "a projector", details) for details in (following, refusing)
    ]
    await projectors.flush()  # the subscriptions in place before the first ping
    workspaces = {partition_of_token(encode_token(w), 2): w for w in (f"ws{n}" for n in range(20))}
    nc = await connect_as(deployment, runtime, "query")
    watch = DeltaWatch(nc, names, partitions=2)
    try:
        await watch.follow_layouts()
        assert watch.stream_refused(workspaces[1])
        assert not watch.stream_refused(workspaces[0])
        del refusing[REFUSED]  # adopted: the projector follows again, and says so in its next answer
        await watch.follow_layouts()
        assert not watch.stream_refused(workspaces[1])
    finally:
        for announcement in announcements:
            await announcement.stop()
        await projectors.close()
        await nc.close()
