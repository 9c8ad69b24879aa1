"""How far an answer is behind the stream (services/query/freshness.py, DeltaWatch), on a real nats-server: the
deltas the stream republishes as they are stored, counted past an answer's position."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

import pytest
import structlog
from nats.js.errors import NotFoundError

from ontofabric.services.projector.worker import ProjectorService
from ontofabric.services.query import freshness as freshness_module
from ontofabric.services.query.core import Pending
from ontofabric.services.query.freshness import (
    FORGET_AFTER_S,
    POSITION_TTL_S,
    POSITION_UNKNOWN_WARN_S,
    UNCOUNTED_RETRY_S,
    DeltaWatch,
    age_ms,
)
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
        # The stream deleted under a running NATS: JetStream cannot count, and the answer says it cannot tell
        # (a tester's queries failed `internal` meanwhile).
        await deployment.js.delete_stream(deployment.names.delta_stream)
        with structlog.testing.capture_logs() as logged:
            assert await watch.pending("acme", ["main"], seqs[0] - 1) is None
            # The answers after it do not ask again for a while, nor warn each time (every answer did: note 73).
            asked: list[tuple[str, int]] = []

            async def still_deleted(subject: str, seq: int) -> Pending:
                asked.append((subject, seq))
                raise NotFoundError

            watch.published_after = still_deleted  # type: ignore[method-assign]
            assert await watch.pending("acme", ["main"], seqs[0] - 1) is None
            assert asked == []
        assert [e["event"] for e in logged] == ["pending_deltas_uncounted"]
        assert logged[0]["retry_in_s"] == UNCOUNTED_RETRY_S
        # Another branch is asked (a failure to count one says nothing of another), and after the hold-off the
        # first again.
        assert await watch.pending("acme", ["other"], seqs[0] - 1) is None
        assert [subject for subject, _ in asked] == [deployment.names.delta_subject("acme", "other")]
        asked.clear()
        watch._uncounted_until.put(deployment.names.delta_subject("acme", "main"), time.monotonic())
        assert await watch.pending("acme", ["main"], seqs[0] - 1) is None
        assert len(asked) == 1
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
    """Answers said only that pending deltas grew while a projector refused a replaced stream. A query worker (its
    own NATS login and database role) reads the refusals from the claim rows, whether or not a projector runs, and
    says them for the workspaces of the refused partition only (a review: every workspace's, at first), until the
    row no longer holds one (adopt-stream deletes it)."""
    from ontofabric.services.query.postgres import refused_consumers
    from ontofabric.shared.db import READER_ROLE, create_pool, migrate
    from ontofabric.shared.subjects import encode_token, partition_of_token

    durables = deployment.names.postgres_projector_durables(2)
    await migrate(deployment.database_url, deployment.settings)
    await deployment.fetch(
        "INSERT INTO projection_fences (durable, epoch, holder, refused) VALUES ($1, 1, 'h', NULL), "
        "($2, 1, 'h', 'the delta stream was made at ..., not at ...')",
        *durables,
    )
    workspaces = {partition_of_token(encode_token(w), 2): w for w in (f"ws{n}" for n in range(20))}
    nc = await connect_as(deployment, runtime, "query")
    pools = [await create_pool(deployment.database_url, deployment.settings, role=READER_ROLE)]
    watch = DeltaWatch(nc, deployment.names, partitions=2, refusals=functools.partial(refused_consumers, pools))
    try:
        await watch.start()  # the first look before the first answer
        assert watch.stream_refused(workspaces[1])
        assert not watch.stream_refused(workspaces[0])
        await deployment.fetch("DELETE FROM projection_fences WHERE durable = $1", durables[1])
        # The database unreadable (a review: read as none refused): the refusals stay as last read.
        await pools[0].close()
        await watch.follow_refusals()
        assert watch.stream_refused(workspaces[1])
        pools[0] = await create_pool(deployment.database_url, deployment.settings, role=READER_ROLE)
        await watch.follow_refusals()
        assert not watch.stream_refused(workspaces[1])
    finally:
        await watch.stop()
        await pools[0].close()
        await nc.close()


async def test_while_a_projector_makes_its_consumer_again_the_position_read_last_stays(
    deployment: Deployment, projector: ProjectorService
) -> None:
    """A projector taking over deletes its consumer and makes it again at the index's position; read meanwhile as
    0, a rolling-restart tester's answers said 13,074 deltas and 11 minutes pending while the index was current."""
    watch = DeltaWatch(deployment.nc, deployment.names)
    await watch.start()
    try:
        seqs = await _published(deployment, watch, 2)
        await deployment.wait_projected(seqs[-1])
        known = await watch.position()
        assert known is not None
        assert known >= seqs[-1]
        await projector.stop()  # as a takeover's first step: the consumer gone, its projector away
        await deployment.js.delete_consumer(deployment.names.delta_stream, deployment.names.postgres_projector_durable)
        await asyncio.sleep(0.1)  # past the position's time to live
        assert await watch.position() == known
        # Longer than a takeover: said once (no projector made its consumer again).
        watch._unknown_since = time.monotonic() - POSITION_UNKNOWN_WARN_S - 1
        with structlog.testing.capture_logs() as logged:
            for _ in range(2):
                await asyncio.sleep(0.06)
                assert await watch.position() == known
        assert [e["event"] for e in logged] == ["position_unknown"]
    finally:
        await watch.stop()


async def test_a_slow_position_read_gives_an_answer_the_last_one_and_a_status_none(
    deployment: Deployment, projector: ProjectorService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An answer takes the last position read when a read outlasts its wait (it only understates what the answer
    holds); a status, which reports the position, does not (a review's: no test told the two apart)."""
    watch = DeltaWatch(deployment.nc, deployment.names)
    await watch.start()
    try:
        seqs = await _published(deployment, watch, 1)
        await deployment.wait_projected(seqs[-1])
        known = await watch.position()
        assert known is not None
        assert known >= seqs[-1]
        read = freshness_module.highest_known_floor

        async def slow(*args: Any, **kwargs: Any) -> int | None:
            await asyncio.sleep(1.0)
            return await read(*args, **kwargs)

        monkeypatch.setattr(freshness_module, "highest_known_floor", slow)
        await asyncio.sleep(POSITION_TTL_S)
        assert await watch.position(0.1) == known
        assert await watch.position(0.1, or_last=False) is None
    finally:
        await watch.stop()
