"""The batch pull loop against a real nats-server: every fetched message reaches the handler, and nothing ends the
loop but stop()."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig

from ontofabric.shared.jetstream import BatchPuller

from .conftest import Deployment

DURABLE = "test-puller"


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)


async def test_a_batch_that_fails_does_not_end_the_loop(deployment: Deployment) -> None:
    js, names = deployment.js, deployment.names
    subscription = await js.pull_subscribe(
        names.delta_subjects,
        durable=DURABLE,
        stream=names.delta_stream,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=60),
    )
    seen: list[bytes] = []

    async def handle(messages: list[Msg]) -> None:
        seen.extend(m.data for m in messages)
        if seen[0] == b"first" and len(seen) == 1:
            raise RuntimeError("a bug in the handler")
        for m in messages:
            await m.ack()

    puller = BatchPuller(subscription, handle, batch_size=10, fetch_timeout_s=0.05, consumer=DURABLE)
    puller.start()
    try:
        await js.publish(names.delta_subject("acme", "main"), b"first")
        await _until(lambda: seen == [b"first"])
        await js.publish(names.delta_subject("acme", "main"), b"second")
        await _until(lambda: b"second" in seen)
    finally:
        await puller.stop()
    info = await js.consumer_info(names.delta_stream, DURABLE)
    assert info.num_ack_pending == 1  # the failed one waits for its ack wait; nothing else is held back


async def test_stop_ends_the_loop_promptly(deployment: Deployment) -> None:
    js, names = deployment.js, deployment.names
    subscription = await js.pull_subscribe(
        names.delta_subjects, durable=DURABLE, stream=names.delta_stream, config=ConsumerConfig(ack_wait=60)
    )
    seen: list[bytes] = []

    async def handle(messages: list[Msg]) -> None:
        seen.extend(m.data for m in messages)
        for m in messages:
            await m.ack()

    puller = BatchPuller(subscription, handle, batch_size=10, fetch_timeout_s=0.5, consumer=DURABLE)
    puller.start()
    await js.publish(names.delta_subject("acme", "main"), b"before stop")
    await _until(lambda: seen == [b"before stop"])
    async with asyncio.timeout(5):  # within the fetch in flight: no hang
        await puller.stop()
    await js.publish(names.delta_subject("acme", "main"), b"after stop")
    await asyncio.sleep(1.0)
    assert seen == [b"before stop"]
